package reconfig

// Triggers: a middlebox host asks the left neighbour of one of its sessions
// to reconfigure the segment around it (paper §2.3: "a middlebox can ask to
// be removed"; §4.2: a proxy removes itself). The protocol core sends,
// retransmits, checks and answers them (protocol.Trigger, trigger
// messages of the control protocol, docs/protocol.md "Triggers"); the
// shell asks for them (RemoveSelf, Splice), delivers their answers, and, at
// the left neighbour, starts the state migration a trigger asks for and
// keeps the time and history of the request it started, as for its own.

import (
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"net/netip"
	"time"

	"github.com/cilium/ebpf"

	"github.com/dysco/dysco/internal/api"
	"github.com/dysco/dysco/internal/protocol"
)

// oldTriggerMagic opens the JSON triggers of agents before control
// protocol version 4 ("DYST"): refused as another version.
const oldTriggerMagic = "DYST"

func isOldTrigger(b []byte) bool { return len(b) >= 4 && string(b[:4]) == oldTriggerMagic }

// trigOutcome is the outcome of a trigger this agent sent, as its callers
// report it.
type trigOutcome struct {
	Outcome, Reason, Blocker string
	// Micros is the time the left neighbour took.
	Micros    int64
	Migration *api.MigrationReport
}

// trigWait is a trigger this agent sent, waiting for its TriggerResult.
type trigWait struct {
	ch chan trigOutcome
	to netip.Addr
	// splice is the client session of the proxy's joined sessions this
	// trigger asks to remove (0: none): their record notes the answer.
	splice uint32
	mig    *api.MigrateSpec
}

// sendTrigger asks the left neighbour of datapath session id (this host a
// middlebox of it) to reconfigure the segment up to the right anchor ra
// through chain; the outcome arrives on the returned channel, once.
// splice is the client session of a proxy's joined sessions that the
// trigger asks to remove, 0 for other triggers. Loop goroutine.
func (c *Shell) sendTrigger(id uint32, ra netip.Addr, chain []netip.Addr, mig *api.MigrateSpec, splice uint32) (chan trigOutcome, error) {
	pid, ok := c.pidOf[id]
	if !ok {
		return nil, fmt.Errorf("session %d is not announced", id)
	}
	v6 := c.famOf[id]
	if c.proto(v6) == nil {
		return nil, fmt.Errorf("this host has no %s address", famName(v6))
	}
	if err := c.sameFamily(id, ra); err != nil {
		return nil, err
	}
	var spec *protocol.MigrateSpec
	if mig != nil {
		o, err := ParseMigrate(mig, len(chain))
		if err != nil {
			return nil, err
		}
		spec = migrateSpec(o)
	}
	c.token++
	w := &trigWait{ch: make(chan trigOutcome, 1), splice: splice, mig: mig}
	c.trigWaits[c.token] = w
	c.handle(v6, protocol.Trigger{Session: pid, Token: c.token, RightAnchor: ra, Chain: chain, Migrate: spec})
	return w.ch, nil
}

// onTriggerResult delivers the end of a trigger this agent sent.
func (c *Shell) onTriggerResult(x protocol.TriggerResult) {
	w := c.trigWaits[x.Token]
	if w == nil {
		return
	}
	delete(c.trigWaits, x.Token)
	if w.splice != 0 && x.Answered {
		// Answered, whatever the outcome: a restarted agent does not
		// ask again (resumeSplice).
		if err := c.dp.SpliceAnswered(w.splice); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			c.log.Warn("proxy removal: cannot note the left anchor's answer", "session", w.splice, "err", err)
		}
	}
	o := trigOutcome{Outcome: x.Outcome.String(), Blocker: blockerText(protocol.Result{Blocker: x.Blocker}), Micros: x.Micros}
	switch {
	case x.Reason == protocol.ReasonNoAnswer:
		o.Reason = "no answer from the left neighbour " + x.To.String()
	default:
		o.Reason = reasonText(protocol.Result{Outcome: x.Outcome, Reason: x.Reason, Hop: x.Hop,
			Unchanged: x.Unchanged, Unconfirmed: x.Unconfirmed, Resumed: x.Resumed})
	}
	if w.mig != nil && !x.Req.IsZero() {
		// The left neighbour started a gated request: its agent's
		// report of the migration, or, if the request never got to its
		// gate, what its own history says then.
		rep := api.MigrationReport{Error: "the new path was not set up"}
		if o, err := ParseMigrate(w.mig, 1); err == nil {
			rep.Semantics = o.Semantics
		}
		if len(x.Report) > 0 {
			if err := json.Unmarshal(x.Report, &rep); err != nil {
				rep = api.MigrationReport{Semantics: rep.Semantics, Error: "the left neighbour's report is unreadable: " + err.Error()}
			}
		}
		o.Migration = &rep
		if rep.Error != "" {
			o.Reason = joinNote(o.Reason, rep.Error)
		}
	}
	c.log.Info("trigger answered", "trigger", x.Trigger.String(), "to", x.To, "answered", x.Answered, "req", x.Req.String(),
		"outcome", o.Outcome, "reason", o.Reason)
	w.ch <- o
}

// onTriggerAccepted: this agent, a session's left neighbour, starts a
// request for a trigger. Its time counts from now, and the state migration
// it asks for starts before the request reaches its gate (NewPathReady).
func (c *Shell) onTriggerAccepted(x protocol.TriggerAccepted) {
	now := time.Now()
	c.started[x.Token] = now
	if x.Migrate == nil {
		return
	}
	c.startMigration(x.Token, migrateOptions(x.Migrate), now, nil)
	c.migrations[x.Token].triggered = true
}

// migrateSpec is a state migration's options as a trigger carries them.
func migrateSpec(o *MigrateOptions) *protocol.MigrateSpec {
	sp := &protocol.MigrateSpec{HoldLimit: uint64(max(o.HoldLimit, 0)),
		TimeoutMS: uint32(min(max(o.Timeout.Milliseconds(), 0), math.MaxUint32))}
	switch o.Semantics {
	case SemLossFree:
		sp.Semantics = protocol.MigrateLossFree
	case SemOrder:
		sp.Semantics = protocol.MigrateOrder
	case SemSubstream:
		sp.Semantics = protocol.MigrateSubstream
	}
	return sp
}

// migrateOptions is the other way: a trigger's spec as options, with the
// defaults filled in.
func migrateOptions(sp *protocol.MigrateSpec) MigrateOptions {
	o := MigrateOptions{HoldLimit: int64(min(sp.HoldLimit, math.MaxInt64)), Timeout: time.Duration(sp.TimeoutMS) * time.Millisecond}
	switch sp.Semantics {
	case protocol.MigrateOrder:
		o.Semantics = SemOrder
	case protocol.MigrateSubstream:
		o.Semantics = SemSubstream
	default:
		o.Semantics = SemLossFree
	}
	_ = o.normalize() // the semantics are known and the bounds positive: it fills the defaults
	return o
}

// migrationReport is the report a gated request's answer to its trigger
// carries (protocol.Proceed.Report), if it fits.
func migrationReport(rep api.MigrationReport) []byte {
	b, err := json.Marshal(rep)
	if err != nil || len(b) > protocol.MaxReportLen {
		return nil
	}
	return b
}

// olderPeer logs, once per peer, that a peer speaks another version of the
// control protocol (a JSON trigger of version 1 to 3, or a message of
// another version): its messages are refused and counted as bad_version.
func (c *Shell) olderPeer(from netip.Addr, what string) {
	if c.otherVersion[from] {
		return
	}
	if len(c.otherVersion) >= maxOtherVersion {
		clear(c.otherVersion)
	}
	c.otherVersion[from] = true
	c.log.Info("control: a peer speaks another version of the control protocol; every agent of a deployment must run the same version",
		"peer", from, "got", what, "version", protocol.MsgVersion)
}

// maxOtherVersion bounds the peers olderPeer remembers.
const maxOtherVersion = 1024

func reasonText(r protocol.Result) string {
	text := r.Reason.String()
	if r.Reason == protocol.ReasonOnPath && r.Hop.IsValid() {
		text = r.Hop.String() + " is already on the session's path (a middlebox cannot be on the old and the new path at once; to keep it, anchor the request at it)"
	}
	if r.Reason == protocol.ReasonNF {
		text = fmt.Sprintf("network function %s could not be started at %s: %s; cancelled, the session stays on its old path", r.NF, r.Hop, r.Detail)
	}
	if r.Outcome == protocol.Succeeded {
		text = ""
		if r.Unchanged {
			text = "unchanged: the session already takes this path"
		}
		if r.Unconfirmed {
			text = "old path torn down without confirmation"
		}
	}
	if r.Resumed {
		text = joinNote(text, "resumed after an agent restart")
	}
	return text
}

func blockerText(r protocol.Result) string {
	if r.Blocker.IsZero() {
		return ""
	}
	return r.Blocker.String()
}
