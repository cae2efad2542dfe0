package reconfig

// Replacing a stateful middlebox with state migration (paper §3.5, last
// paragraph; §5.3 "Middlebox replacement with state transfer"; M2M §5).
//
// The protocol core orchestrates the migration (protocol.Reconfigure.Migrate;
// internal/protocol/migrate.go): the left anchor's freeze, the right
// anchor's, the drain, the export at the old middlebox and the import at
// the new one travel as control messages of the protocol (migrate and
// migrateAnswer, authenticated, retransmitted and deduplicated as any), and
// the switch waits for them. The shell carries out the core's local work:
//
//   - Hold / ReleaseHold: the datapath holds the packets a side sends on
//     its old path (FlHoldData: those carrying new data, substream;
//     FlHoldAll: every packet, order), and re-injects them, in order, on
//     the path the side uses then; a full hold buffer is HoldOverflow;
//   - WaitDrained: the side's flow marks are watched until its old path
//     drained as the semantics says (drained), or the bound passes;
//   - ExportState / ImportState / ReleaseState: the plug-ins
//     (internal/migrate) export, import and release the session's state;
//   - MigrationDone: the report (api.MigrationReport) is made, kept for the
//     request's result, and given to the core with Proceed, which answers
//     the trigger that asked for the request with it.
//
// Semantics (M2M §5, our reading for a session protocol; docs/protocol.md):
//
//   - loss-free (M2M §5.1, make before break): hold nothing; export and
//     import while the old path carries the session, then switch.
//   - order: hold every packet; wait until everything each anchor sent on
//     the old path before the freeze has reached the other anchor (so it
//     crossed the old instance), bounded by the drain timeout; then export.
//   - substream: hold new data; wait until every byte sent on the old path
//     is acknowledged in both directions (M2M Algorithm 2's checkpoint).

import (
	"context"
	"fmt"
	"math"
	"time"

	"github.com/dysco/dysco/internal/api"
	"github.com/dysco/dysco/internal/datapath"
	"github.com/dysco/dysco/internal/migrate"
	"github.com/dysco/dysco/internal/protocol"
)

// Semantics of a state migration's cut-over.
const (
	SemLossFree  = "loss-free"
	SemOrder     = "order"
	SemSubstream = "substream"
)

// Defaults of a migration's bounds.
const (
	DefaultHoldLimit  = protocol.DefaultHoldLimit
	defaultMigTimeout = protocol.DefaultMigTimeout
	// oldMigMagic opens the JSON state migration messages of agents
	// before control protocol version 4 ("DYSM"): refused as another
	// version.
	oldMigMagic = "DYSM"
)

func isOldMig(b []byte) bool { return len(b) >= 4 && string(b[:4]) == oldMigMagic }

// The plug-ins' bundle always fits a control message.
var _ = [1]struct{}{}[migrate.MaxBundleSize/(protocol.MaxStateLen+1)]

// StatePlugins export, import and release a session's middlebox state
// (*migrate.Set; a fake in tests).
type StatePlugins interface {
	Export(ctx context.Context, s migrate.Session) (migrate.Bundle, error)
	Import(ctx context.Context, s migrate.Session, b migrate.Bundle) error
	Release(ctx context.Context, s migrate.Session) error
}

// MigrateOptions ask for state migration in a reconfiguration.
type MigrateOptions struct {
	Semantics string
	// HoldLimit bounds the bytes each anchor holds; reaching it aborts.
	HoldLimit int64
	// Timeout bounds freeze + drain + export + import.
	Timeout time.Duration
}

// normalize fills the defaults and checks the semantics.
func (o *MigrateOptions) normalize() error {
	switch o.Semantics {
	case "":
		o.Semantics = SemLossFree
	case SemLossFree, SemOrder, SemSubstream:
	default:
		return fmt.Errorf("unknown semantics %q (want %s, %s or %s)", o.Semantics, SemLossFree, SemOrder, SemSubstream)
	}
	if o.HoldLimit < 0 {
		return fmt.Errorf("hold limit %d: must not be negative", o.HoldLimit)
	}
	if o.HoldLimit == 0 {
		o.HoldLimit = DefaultHoldLimit
	}
	if o.Timeout <= 0 {
		o.Timeout = defaultMigTimeout
	}
	// A trigger's spec comes from a peer: at most the protocol's maxima.
	o.HoldLimit = min(o.HoldLimit, protocol.MaxHoldLimit)
	o.Timeout = min(o.Timeout, protocol.MaxMigTimeout)
	return nil
}

// migration is a migrating request at its left anchor: what its report
// needs.
type migration struct {
	token uint64
	opts  MigrateOptions
	start time.Time
	rep   api.MigrationReport
	// triggered: a trigger asked for the request; the answer carries the
	// report (protocol.Proceed.Report).
	triggered bool
}

// startMigration registers a migration before its request starts (loop).
func (c *Shell) startMigration(token uint64, o MigrateOptions, start time.Time, out chan api.MigrationReport) {
	c.migrations[token] = &migration{token: token, opts: o, start: start, rep: api.MigrationReport{Semantics: o.Semantics}}
	c.migReports[token] = api.MigrationReport{Semantics: o.Semantics, Error: "the new path was not set up"}
	if out != nil {
		c.migOut[token] = out
	}
}

// onNewPathReady: a gated request reached its gate. A migration's steps
// are the core's; the time of the freeze counts from here. A gate that is
// no migration of this agent's (none is asked for) goes on at once.
func (c *Shell) onNewPathReady(v6 bool, x protocol.NewPathReady) {
	if m := c.migrations[x.Token]; m != nil {
		m.rep.FreezeMicros = time.Since(m.start).Microseconds()
		return
	}
	c.deferred = append(c.deferred, func() { c.handle(v6, protocol.Proceed{Session: x.Session, Req: x.Req}) })
}

// onMigrationDone makes the report of a migration whose steps ended, and
// lets the core switch or abort (Proceed).
func (c *Shell) onMigrationDone(v6 bool, x protocol.MigrationDone) {
	var rep []byte
	if m := c.migrations[x.Token]; m != nil {
		delete(c.migrations, x.Token)
		r := &m.rep
		r.Error, r.Note = x.Err, x.Note
		r.DrainMicros, r.ExportMicros, r.ImportMicros = x.Drain.Microseconds(), x.Export.Microseconds(), x.Import.Microseconds()
		if b, err := migrate.DecodeBundle(x.State); err == nil {
			for name, st := range b {
				r.Plugins = append(r.Plugins, name)
				r.StateBytes += len(st)
			}
		}
		k := datapath.TPKey{SessId: c.dpID(x.Session), Side: uint32(protocol.SideRight)}
		if h := c.migHolds[k]; h != nil {
			r.HeldPackets, r.HeldBytes, r.HoldDropped = h.stats()
		}
		r.SwitchMicros = time.Since(m.start).Microseconds()
		c.migReports[x.Token] = *r
		if m.triggered {
			rep = migrationReport(*r)
		}
	}
	c.deferred = append(c.deferred, func() {
		c.handle(v6, protocol.Proceed{Session: x.Session, Req: x.Req, Abort: x.Err, Report: rep})
	})
}

// migrationEnded is called when a request's Result arrives (loop).
func (c *Shell) migrationEnded(token uint64) { delete(c.migrations, token) }

// doHold holds a side's old-path packets (protocol.Hold) and answers Held
// with the side's marks (after the current actions).
func (c *Shell) doHold(v6 bool, x protocol.Hold) {
	ev := protocol.Held{Session: x.Session, Side: x.Side, Req: x.Req}
	defer func() { c.deferred = append(c.deferred, func() { c.handle(v6, ev) }) }()
	k := datapath.TPKey{SessId: c.dpID(x.Session), Side: uint32(x.Side)}
	if c.holder == nil {
		ev.Err = "this agent's datapath cannot hold packets"
		return
	}
	tp, ok := c.dp.TwoPath(k)
	if !ok {
		ev.Err = "the session's two-path record is missing"
		return
	}
	if c.migHolds[k] != nil {
		ev.Err = "this side already holds its packets"
		return
	}
	flags := uint32(datapath.FlHoldData)
	if x.Semantics == protocol.MigrateOrder {
		flags = datapath.FlHoldAll
	}
	var h heldPackets
	h, err := c.holder.start(k.SessId, datapath.Tuple(tp.EgKey), flags, int64(min(x.Limit, math.MaxInt64)), func() {
		c.post(func() {
			if c.migHolds[k] == h {
				c.handle(v6, protocol.HoldOverflow{Session: x.Session, Side: x.Side})
			}
		})
	})
	if err != nil {
		ev.Err = err.Error()
		return
	}
	c.migHolds[k] = h
	ev.Marks = c.flowMarks(datapath.Tuple(tp.EgKey))
}

// doReleaseHold re-injects what a side held (protocol.ReleaseHold): on the
// path the side uses now.
func (c *Shell) doReleaseHold(x protocol.ReleaseHold) {
	k := datapath.TPKey{SessId: c.dpID(x.Session), Side: uint32(x.Side)}
	h := c.migHolds[k]
	if h == nil {
		return
	}
	delete(c.migHolds, k)
	go c.holder.release(h)
}

// doWaitDrained watches a side's old path until it drained, or the bound
// passes (protocol.WaitDrained), and answers Drained.
func (c *Shell) doWaitDrained(v6 bool, x protocol.WaitDrained) {
	k := datapath.TPKey{SessId: c.dpID(x.Session), Side: uint32(x.Side)}
	tp, ok := c.dp.TwoPath(k)
	if !ok {
		c.deferred = append(c.deferred, func() {
			c.handle(v6, protocol.Drained{Session: x.Session, Side: x.Side, Req: x.Req})
		})
		return
	}
	inOld := datapath.Tuple(tp.InOld)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), x.Within)
		ok := c.waitDrained(ctx, x.Semantics, x.Own, x.Peer, inOld)
		cancel()
		c.post(func() { c.handle(v6, protocol.Drained{Session: x.Session, Side: x.Side, Req: x.Req, OK: ok}) })
	}()
}

// flowMarks reads what a flow has sent (session space).
func (c *Shell) flowMarks(k datapath.Tuple) protocol.FlowMarks {
	f, ok := c.dp.Flow(k)
	if !ok || !f.Marked() {
		return protocol.FlowMarks{}
	}
	return protocol.FlowMarks{Seq: f.MkSeq, Ack: f.MkAck, OK: true}
}

// drained tells whether a side's old path is empty enough for the
// semantics: substream — everything this side sent is acknowledged; order
// — everything the other anchor sent before its freeze (peer) arrived.
func (c *Shell) drained(sem protocol.MigrateSemantics, own, peer protocol.FlowMarks, inOld datapath.Tuple) bool {
	in := c.flowMarks(inOld)
	switch sem {
	case protocol.MigrateSubstream:
		return !own.OK || in.OK && seqLeq(own.Seq, in.Ack)
	case protocol.MigrateOrder:
		return !peer.OK || in.OK && seqLeq(peer.Seq, in.Seq) && seqLeq(peer.Ack, in.Ack)
	}
	return true
}

func seqLeq(a, b uint32) bool { return int32(a-b) <= 0 }

// waitDrained polls the datapath until drained or the deadline.
func (c *Shell) waitDrained(ctx context.Context, sem protocol.MigrateSemantics, own, peer protocol.FlowMarks, inOld datapath.Tuple) bool {
	t := time.NewTicker(500 * time.Microsecond)
	defer t.Stop()
	for {
		if c.drained(sem, own, peer, inOld) {
			return true
		}
		select {
		case <-ctx.Done():
			return false
		case <-t.C:
		}
	}
}

func joinNote(a, b string) string {
	if a == "" {
		return b
	}
	return a + "; " + b
}
