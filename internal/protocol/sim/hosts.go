package sim

// The simulated hosts: each runs a protocol agent, carries out its actions
// and hands it what the network and its datapath bring.

import (
	"fmt"
	"net/netip"
	"sort"
	"strings"
	"time"

	"github.com/dysco/dysco/internal/protocol"
	"github.com/dysco/dysco/internal/wire"
)

type host struct {
	w     *world
	name  string
	addr  netip.Addr
	dead  bool
	mbox  bool
	agent *protocol.Agent
	dp    map[protocol.SessionID]*dpSess
	subs  map[wire.Tuple]*dpSub
	tmr   map[protocol.TimerID]*event
	// trigTok: the requests this host's agent started for triggers, by
	// the tokens it gave them (TriggerAccepted).
	trigTok map[uint64]*request
	// known: the sessions announced to the agent (SessionUp), lazily, as
	// the agent does: when a request or a control message first concerns
	// them (announce).
	known map[protocol.SessionID]bool
	// holds are the packets held for migrations, by session and side;
	// state the middlebox plug-ins' state moved for migrations
	// (migrate.go).
	holds map[holdKey]protocol.ReqKey
	state map[protocol.SessionID]string
}

func (h *host) String() string { return h.name }

func (w *world) newHost(name string, mbox bool) *host {
	a := netip.AddrFrom4([4]byte{10, 0, byte(len(w.hosts) / 250), byte(len(w.hosts)%250 + 1)})
	cfg := protocol.Config{
		Self: a, Keys: deploymentKey,
		RTO: 30 * time.Millisecond, MaxRTO: time.Second, MaxTries: 16,
		Linger: 3 * time.Second, LockLease: 40 * time.Second,
		PortBase: 20000, PortCount: 40000,
		Faults: w.opts.Faults,
	}
	h := &host{w: w, name: name, addr: a, mbox: mbox, agent: protocol.New(cfg),
		dp: map[protocol.SessionID]*dpSess{}, subs: map[wire.Tuple]*dpSub{}, tmr: map[protocol.TimerID]*event{},
		known: map[protocol.SessionID]bool{}, trigTok: map[uint64]*request{},
		holds: map[holdKey]protocol.ReqKey{}, state: map[protocol.SessionID]string{}}
	w.hosts = append(w.hosts, h)
	w.byAddr[a] = h
	return h
}

// handle gives an event to the host's agent and carries out its actions.
func (h *host) handle(ev protocol.Event) {
	for _, act := range h.agent.Handle(h.w.now, ev) {
		h.apply(act)
	}
}

func (h *host) apply(act protocol.Action) {
	w := h.w
	switch x := act.(type) {
	case protocol.Send:
		to := w.byAddr[x.To]
		w.stats.ControlSent++
		w.tracef("%s -> %s %s", h, to, x.Msg)
		data, msg := x.Data, x.Msg
		if msg.Type == protocol.MsgTriggerResult {
			w.noteAnswer(h, to, msg)
		}
		w.deliver(h, to, x.Msg.Type.String(), func() {
			if msg.Type == protocol.MsgTrigger {
				w.triggerHeard(to, msg)
			}
			to.handle(to.messageIn(h.addr, data))
			w.checkLocks()
		})
	case protocol.SetTimer:
		if e := h.tmr[x.ID]; e != nil {
			e.cancelled = true
		}
		id := x.ID
		h.tmr[id] = w.at(x.At, func() {
			delete(h.tmr, id)
			w.tracef("%s timer %s", h, id)
			h.handle(protocol.TimerFired{ID: id})
			w.checkLocks()
		})
	case protocol.CancelTimer:
		if e := h.tmr[x.ID]; e != nil {
			e.cancelled = true
			delete(h.tmr, x.ID)
		}
	case protocol.Result:
		w.onResult(h, x)
	case protocol.TriggerAccepted:
		w.onTriggerAccepted(h, x)
	case protocol.TriggerResult:
		w.onTriggerResult(h, x)
	case protocol.JoinedWScale:
		if ds := h.dp[x.Session]; ds != nil && x.Rev != ds.sess.ws[1] {
			w.fail("%s: s%d learns leftward window scale %d, the session's is %d", h, ds.sess.idx, x.Rev, ds.sess.ws[1])
		}
	case protocol.MarkClosed:
		if ds := h.dp[x.Session]; ds != nil {
			w.stats.ClosedMarks++
			w.tracef("%s closed notice s%d fwd=%v rev=%v", h, ds.sess.idx, x.Fwd, x.Rev)
			ds.markClosed(x.Fwd, x.Rev)
		}
	case protocol.NewPathReady:
		// The agent moves state meanwhile: it answers after a while, or
		// aborts (an export that fails).
		r := w.byToken[x.Token]
		if t := h.trigTok[x.Token]; t != nil {
			r = t
		}
		if r == nil || !r.gate {
			w.fail("%s: NewPathReady for a request that is not gated (%d)", h, x.Token)
			return
		}
		if r.mig != nil {
			w.onMigReady(h, r, x) // the core moves the state (migrate.go)
			return
		}
		abort := ""
		if r.abort {
			abort = "simulated export failure"
		}
		w.tracef("%s GATE %s abort=%q", h, x.Req, abort)
		w.after(time.Duration(w.rng.Int64N(int64(20*time.Millisecond))), func() {
			h.handle(protocol.Proceed{Session: x.Session, Req: x.Req, Abort: abort, Report: r.report()})
			w.checkLocks()
		})
	case protocol.Hold, protocol.ReleaseHold, protocol.WaitDrained, protocol.ExportState, protocol.ImportState,
		protocol.ReleaseState, protocol.MigrationDone:
		h.applyMigration(act)
	case protocol.StartTwoPath:
		w.onMigSwitch(h, x)
		h.applyDatapath(act)
	case protocol.Rejected:
		w.stats.Rejected[x.Reason.String()]++
		w.tracef("%s rejected %s from %s: %s: %s", h, x.Type, x.From, x.Reason, x.Detail)
	case protocol.Progress:
		w.tracef("%s %s %s %s %s %s", h, x.Req, x.Role, x.Stage, x.Note, h.sessName(x.Session))
		if _, ok := w.started[x.Req]; !ok {
			w.started[x.Req] = w.now
		}
		if x.Role == protocol.RoleLeftAnchor && x.Stage == protocol.StageSettingUp {
			w.recordLock(h, x)
		}
		if x.Role == protocol.RoleLeftAnchor && x.Stage == protocol.StageCancelling && strings.HasPrefix(x.Note, "unchanged") {
			w.recordUnchanged(h, x)
		}
	default:
		h.applyDatapath(act)
	}
}

func (h *host) sessName(id protocol.SessionID) string {
	if ds := h.dp[id]; ds != nil {
		return fmt.Sprintf("(s%d)", ds.sess.idx)
	}
	return ""
}

// messageIn is what the agent makes of a datagram (internal/reconfig
// onPacket): a control message about a session the protocol does not know
// yet announces it first (announce); a new path's SYN that would make this
// host join a session it carries on a live path is marked OnPath. An
// answer to a trigger announces nothing.
func (h *host) messageIn(from netip.Addr, data []byte) protocol.MessageIn {
	in := protocol.MessageIn{From: from, Data: data}
	m, err := protocol.Decode(deploymentKey, from, data)
	if err != nil || m.Type == protocol.MsgTriggerResult {
		// (An answer to a trigger is matched with its trigger: the
		// agent announces nothing for it.)
		return in
	}
	if _, _, known := h.agent.Lookup(m.Sub); known {
		return in
	}
	if m.Type == protocol.MsgSyn {
		if m.RightAnchor != h.addr && len(m.Hops) > 0 && h.w.opts.old&oldJoin == 0 {
			in.OnPath = h.liveHere(m.Session, m.Nonce) != nil
		}
		return in
	}
	if sub := h.subs[m.Sub]; sub != nil {
		h.announce(sub.ds)
	} else if h.w.opts.old&oldAnnounce == 0 {
		in.Gone = true
	}
	return in
}

// announce tells the agent's protocol about a datapath session, unless it
// knows it already, as the agent does (control.announce): not one that was
// reset (nor, as the agent did before, one that has seen a FIN). It
// reports whether the protocol knows the session.
func (h *host) announce(ds *dpSess) bool {
	if ds.gone {
		return false
	}
	if h.known[ds.id] {
		return true
	}
	if ds.up == nil || ds.rstSeen || h.w.opts.old&oldAnnounce != 0 && (ds.finSeen[0] || ds.finSeen[1]) {
		return false
	}
	h.known[ds.id] = true
	h.handle(*ds.up)
	return true
}

// liveHere returns a session of tuple t that this host carries on a live
// path (internal/reconfig liveHere): not reset, either unknown to the
// protocol or on its live path (protocol.Agent.OnLivePath), and either the
// session of nonce (FINs both ways do not end it: the bytes before them
// may still be on their way, or be sent again) or another one that is not
// closed both ways (a session of another nonce closed both ways is an
// earlier TCP connection of the same tuple, which gives way).
func (h *host) liveHere(t wire.Tuple, nonce [wire.NonceLen]byte) *dpSess {
	for _, id := range h.dpIDs() {
		ds := h.dp[id]
		if ds.gone || ds.sess.tuple != t || ds.rstSeen || ds.sess.nonce != nonce && ds.finSeen[0] && ds.finSeen[1] {
			continue
		}
		if !h.known[id] || h.agent.OnLivePath(id) {
			return ds
		}
	}
	return nil
}

// dpIDs returns the ids of the host's datapath sessions, sorted (the
// simulation must not depend on map order).
func (h *host) dpIDs() []protocol.SessionID {
	ids := make([]protocol.SessionID, 0, len(h.dp))
	for id := range h.dp {
		ids = append(ids, id)
	}
	sort.Slice(ids, func(i, j int) bool { return ids[i] < ids[j] })
	return ids
}
