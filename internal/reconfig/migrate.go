package reconfig

// Replacing a stateful middlebox with state migration (paper §3.5, last
// paragraph; §5.3 "Middlebox replacement with state transfer"; M2M §5).
//
// The left anchor runs an ordinary reconfiguration (§3.1) whose switch is
// gated (protocol.Reconfigure.Gate): once the new path answered, and before
// anything uses it,
//
//  1. freeze (order, substream): each anchor holds, in its datapath, the packets it would send
//     on the old path (FlHoldData: those carrying new data; FlHoldAll:
//     every packet), so that the old instance's state stops changing
//     (the right anchor does so on the left anchor's "freeze" request);
//  2. drain, as the requested semantics says (below);
//  3. export: the old middlebox's agent exports the session's state through
//     its plug-ins (internal/migrate) and returns it;
//  4. import: the new middlebox's agent imports it and confirms;
//  5. switch: the left anchor lets the protocol proceed (ACK, two-path
//     phase); each anchor then re-injects what it held, which now goes on
//     the new path.
//
// Any failure — export, import, a full hold buffer, a timeout — aborts the
// gate: the new path is cancelled (§3.6), the anchors release what they
// held onto the old path, and the old instance still has its state. The
// old instance releases the session's state only when its agent frees the
// old path.
//
// Semantics (M2M §5, our reading for a session protocol; docs/protocol.md):
//
//   - loss-free (M2M §5.1, make before break): hold nothing; export and
//     import while the old path carries the session, then switch. No
//     packet reaches the new instance before its state, none is lost; the
//     old instance's state may change after the export (packets it
//     processes until the switch, and after it retransmissions and
//     acknowledgments of bytes it carried), which the copy does not have.
//   - order: hold every packet; wait until everything each anchor sent on
//     the old path before the freeze has reached the other anchor (so it
//     crossed the old instance), bounded by the drain timeout; then export.
//   - substream: hold new data; wait until every byte sent on the old path
//     is acknowledged in both directions (M2M Algorithm 2's checkpoint):
//     the old instance has seen a complete prefix of each byte stream and
//     the new one sees the rest.
//
// The messages between agents use the control socket: "DYSM", version 1,
// kind (1 request, 2 answer), a JSON body, HMAC-SHA256 (16 bytes) under the
// deployment key (sealJSON). Requests carry their send time and a token;
// retransmissions get the same answer.

import (
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"net/netip"
	"sync/atomic"
	"time"

	"github.com/dysco/dysco/internal/api"
	"github.com/dysco/dysco/internal/datapath"
	"github.com/dysco/dysco/internal/migrate"
	"github.com/dysco/dysco/internal/protocol"
	"github.com/dysco/dysco/internal/wire"
)

// Semantics of a state migration's cut-over.
const (
	SemLossFree  = "loss-free"
	SemOrder     = "order"
	SemSubstream = "substream"
)

// Defaults of a migration's bounds.
const (
	DefaultHoldLimit    = 8 << 20
	defaultMigTimeout   = 5 * time.Second
	defaultDrainTimeout = 200 * time.Millisecond
	migMagic            = "DYSM"
	migVersion          = 1
	migRequest          = 1
	migAnswer           = 2
	migMaxAge           = 30 * time.Second
)

// MigrateOptions ask for state migration in a reconfiguration.
type MigrateOptions struct {
	Semantics string
	// HoldLimit bounds the bytes each anchor holds; reaching it aborts.
	HoldLimit int64
	// Timeout bounds freeze + drain + export + import.
	Timeout time.Duration
	// DrainTimeout bounds the wait for packets in flight (order).
	DrainTimeout time.Duration
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
	if o.DrainTimeout <= 0 {
		o.DrainTimeout = defaultDrainTimeout
	}
	return nil
}

func (o *MigrateOptions) holdFlags() uint32 {
	if o.Semantics == SemOrder {
		return datapath.FlHoldAll
	}
	return datapath.FlHoldData
}

// migMsg is a migration request or its answer.
type migMsg struct {
	Token      uint64 `json:"token"`
	Op         string `json:"op,omitempty"` // freeze, export, import
	SentUnixMS int64  `json:"sent_unix_ms,omitempty"`

	// freeze: the request (its left anchor and number), the semantics,
	// the bound, and the left anchor's marks at its freeze.
	ReqLeft   netip.Addr `json:"req_left,omitzero"`
	ReqID     uint32     `json:"req_id,omitempty"`
	Semantics string     `json:"semantics,omitempty"`
	HoldLimit int64      `json:"hold_limit,omitempty"`
	DrainMS   int64      `json:"drain_ms,omitempty"`
	Marks     *marks     `json:"marks,omitempty"`

	// export / import: the subsession from the left anchor to the
	// middlebox (as its SYN went), the right anchor, the state.
	Sub         *wire.Tuple    `json:"sub,omitempty"`
	RightAnchor netip.Addr     `json:"right_anchor,omitzero"`
	State       migrate.Bundle `json:"state,omitempty"`

	// answer
	Err  string `json:"err,omitempty"`
	Note string `json:"note,omitempty"`
}

// marks are what a side has sent on the old path (session space).
type marks struct {
	Seq uint32 `json:"seq"`
	Ack uint32 `json:"ack"`
	Ok  bool   `json:"ok"`
}

func isMig(b []byte) bool { return len(b) >= 6 && string(b[:4]) == migMagic }

func encodeMig(key []byte, kind byte, m migMsg) ([]byte, error) {
	return sealJSON(key, migMagic, migVersion, kind, m)
}

func decodeMig(key, b []byte) (byte, migMsg, error) {
	var m migMsg
	kind, err := openJSON(key, b, migVersion, &m)
	return kind, m, err
}

// migration is a gated request at its left anchor.
type migration struct {
	token uint64
	v6    bool
	opts  MigrateOptions
	ready protocol.NewPathReady
	id    uint32 // datapath session
	start time.Time
	hold  *hold
	rep   api.MigrationReport
	// ended is set once the request ended (loop): the goroutine stops at
	// its next step.
	ended atomic.Bool
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

// onNewPathReady starts the state migration of a gated request (loop).
func (c *Shell) onNewPathReady(v6 bool, x protocol.NewPathReady) {
	m := c.migrations[x.Token]
	if m == nil {
		// Not ours (cannot happen: only migrations gate): go on.
		c.deferred = append(c.deferred, func() { c.handle(v6, protocol.Proceed{Session: x.Session, Req: x.Req}) })
		return
	}
	m.v6, m.ready, m.id = v6, x, c.dpID(x.Session)
	m.rep.Semantics = m.opts.Semantics
	fail := func(err error) {
		c.deferred = append(c.deferred, func() { c.migrationDone(m, err) })
	}
	switch {
	case c.holds == nil:
		fail(errors.New("this agent's datapath cannot hold packets"))
		return
	case !x.LeftDelta.IsZero():
		fail(fmt.Errorf("the old segment changes the byte streams (delta %s): its middlebox is a proxy, whose state cannot move", x.LeftDelta))
		return
	case x.OldPeer == x.RightAnchor:
		fail(errors.New("no middlebox between the anchors on the old path: no state to move"))
		return
	case len(x.Chain) != 1:
		fail(fmt.Errorf("the new path has %d middleboxes: state migration replaces one middlebox by one", len(x.Chain)))
		return
	}
	tp, ok := c.dp.TwoPath(datapath.TPKey{SessId: m.id, Side: uint32(protocol.SideRight)})
	if !ok {
		fail(errors.New("the session's two-path record is missing"))
		return
	}
	m.rep.FreezeMicros = time.Since(m.start).Microseconds()
	if m.opts.Semantics == SemLossFree {
		// Loss-free (M2M §5.1): make before break, nothing held; the
		// state moves while the old path carries the session.
		go c.runMigration(m, marks{}, datapath.Tuple{})
		return
	}
	h, err := c.holds.start(m.id, datapath.Tuple(tp.EgKey), m.opts.holdFlags(), m.opts.HoldLimit, func() {
		c.post(func() {
			c.migrationDone(m, fmt.Errorf("hold buffer full at the left anchor (over %d bytes)", m.opts.HoldLimit))
		})
	})
	if err != nil {
		fail(err)
		return
	}
	m.hold = h
	own := c.flowMarks(datapath.Tuple(tp.EgKey))
	inOld := datapath.Tuple(tp.InOld)
	go c.runMigration(m, own, inOld)
}

// flowMarks reads what a flow has sent (session space).
func (c *Shell) flowMarks(k datapath.Tuple) marks {
	f, ok := c.dp.Flow(k)
	if !ok || !f.Marked() {
		return marks{}
	}
	return marks{Seq: f.MkSeq, Ack: f.MkAck, Ok: true}
}

// drained tells whether a side's old path is empty enough for the
// semantics: substream — everything this side sent is acknowledged; order
// — everything the other anchor sent before its freeze (peer) arrived.
func (c *Shell) drained(sem string, own, peer marks, inOld datapath.Tuple) bool {
	in := c.flowMarks(inOld)
	switch sem {
	case SemSubstream:
		return !own.Ok || in.Ok && seqLeq(own.Seq, in.Ack)
	case SemOrder:
		return !peer.Ok || in.Ok && seqLeq(peer.Seq, in.Seq) && seqLeq(peer.Ack, in.Ack)
	}
	return true
}

func seqLeq(a, b uint32) bool { return int32(a-b) <= 0 }

// waitDrained polls the datapath until drained or the deadline.
func (c *Shell) waitDrained(ctx context.Context, sem string, own, peer marks, inOld datapath.Tuple) bool {
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

// runMigration does the steps after the left anchor's freeze (its own
// goroutine); the loop gets the outcome.
func (c *Shell) runMigration(m *migration, own marks, inOld datapath.Tuple) {
	ctx, cancel := context.WithTimeout(context.Background(), m.opts.Timeout)
	defer cancel()
	err := c.migrateSteps(ctx, m, own, inOld)
	if err == nil && ctx.Err() != nil {
		err = fmt.Errorf("state migration timed out after %s", m.opts.Timeout)
	}
	c.post(func() { c.migrationDone(m, err) })
}

// freezeAndDrain has the right anchor hold its packets too and waits for
// the old path to drain as the semantics says.
func (c *Shell) freezeAndDrain(ctx context.Context, m *migration, own marks, inOld datapath.Tuple) error {
	x := m.ready
	// 1. The right anchor freezes too (and, for the semantics that need
	// it, waits until its side of the old path drained).
	ans, err := c.migCall(ctx, x.RightAnchor, migMsg{Op: "freeze", ReqLeft: x.Req.LeftAnchor, ReqID: x.Req.ID,
		Semantics: m.opts.Semantics, HoldLimit: m.opts.HoldLimit, DrainMS: m.opts.DrainTimeout.Milliseconds(), Marks: &own})
	if err != nil {
		return fmt.Errorf("freeze at the right anchor %s: %w", x.RightAnchor, err)
	}
	if ans.Note != "" {
		m.rep.Note = "right anchor: " + ans.Note
	}
	// 2. Our side of the drain.
	var peer marks
	if ans.Marks != nil {
		peer = *ans.Marks
	}
	switch m.opts.Semantics {
	case SemSubstream:
		if !c.waitDrained(ctx, SemSubstream, own, peer, inOld) {
			return errors.New("the old path did not drain: data sent before the freeze is still unacknowledged")
		}
	case SemOrder:
		dctx, cancel := context.WithTimeout(ctx, m.opts.DrainTimeout)
		ok := c.waitDrained(dctx, SemOrder, own, peer, inOld)
		cancel()
		if !ok {
			m.rep.Note = joinNote(m.rep.Note, "left anchor: drain timeout: a packet sent before the freeze did not arrive (lost or late)")
		}
	}
	return nil
}

func (c *Shell) migrateSteps(ctx context.Context, m *migration, own marks, inOld datapath.Tuple) error {
	x := m.ready
	if m.opts.Semantics != SemLossFree {
		t0 := time.Now()
		if err := c.freezeAndDrain(ctx, m, own, inOld); err != nil {
			return err
		}
		m.rep.DrainMicros = time.Since(t0).Microseconds()
	}
	if m.ended.Load() {
		return errors.New("aborted")
	}
	// 3. Export at the old middlebox.
	t1 := time.Now()
	oldSub := x.OldSub
	ans, err := c.migCall(ctx, x.OldPeer, migMsg{Op: "export", Sub: &oldSub, RightAnchor: x.RightAnchor})
	if err != nil {
		return fmt.Errorf("export at %s: %w", x.OldPeer, err)
	}
	st := ans.State
	m.rep.ExportMicros = time.Since(t1).Microseconds()
	for name, b := range st {
		m.rep.Plugins = append(m.rep.Plugins, name)
		m.rep.StateBytes += len(b)
	}
	if m.ended.Load() {
		return errors.New("aborted")
	}
	// 4. Import at the new one.
	t2 := time.Now()
	newSub := x.NewSub
	if _, err = c.migCall(ctx, x.NewPeer, migMsg{Op: "import", Sub: &newSub, RightAnchor: x.RightAnchor, State: st}); err != nil {
		return fmt.Errorf("import at %s: %w", x.NewPeer, err)
	}
	m.rep.ImportMicros = time.Since(t2).Microseconds()
	return nil
}

func joinNote(a, b string) string {
	if a == "" {
		return b
	}
	return a + "; " + b
}

// migrationDone ends the gate (loop): proceed, or abort. Then the left
// anchor re-injects what it held: after the switch it goes on the new path,
// after an abort on the old one.
func (c *Shell) migrationDone(m *migration, err error) {
	if m.ended.Swap(true) {
		return
	}
	delete(c.migrations, m.token)
	m.rep.SwitchMicros = time.Since(m.start).Microseconds()
	if err != nil {
		m.rep.Error = err.Error()
	}
	if h := m.hold; h != nil {
		m.rep.HeldPackets, m.rep.HeldBytes, m.rep.HoldDropped = h.stats()
	}
	c.migReports[m.token] = m.rep
	if m.ready.Session != 0 || m.ready.Req.ID != 0 {
		abort := ""
		if err != nil {
			abort = err.Error()
		}
		var rep []byte
		if m.triggered {
			rep = migrationReport(m.rep)
		}
		c.handle(m.v6, protocol.Proceed{Session: m.ready.Session, Req: m.ready.Req, Abort: abort, Report: rep})
	}
	if h := m.hold; h != nil {
		go c.holds.release(h)
	}
}

// migrationEnded is called when a request's Result arrives (loop): a
// migration still running stops and releases what it held.
func (c *Shell) migrationEnded(token uint64) {
	if m := c.migrations[token]; m != nil {
		m.ended.Store(true)
		delete(c.migrations, token)
		if h := m.hold; h != nil {
			go c.holds.release(h)
		}
	}
}

// sealJSON frames the state migration messages (DYSM):
// magic (4 bytes), version, kind, a JSON body, then HMAC-SHA256 (16 bytes)
// of everything before it under the deployment key.
func sealJSON(key []byte, magic string, version, kind byte, v any) ([]byte, error) {
	body, err := json.Marshal(v)
	if err != nil {
		return nil, err
	}
	b := append([]byte(magic), version, kind)
	b = append(b, body...)
	h := hmac.New(sha256.New, key)
	h.Write(b)
	return append(b, h.Sum(nil)[:sealMACLen]...), nil
}

const sealMACLen = 16

var errSealMAC = errors.New("MAC mismatch")

// openJSON checks a sealJSON frame and decodes its body into v; it returns
// the kind.
func openJSON(key, b []byte, version byte, v any) (byte, error) {
	if len(b) < 6+sealMACLen {
		return 0, errors.New("message too short")
	}
	if b[4] != version {
		return 0, fmt.Errorf("message version %d", b[4])
	}
	body, tag := b[:len(b)-sealMACLen], b[len(b)-sealMACLen:]
	h := hmac.New(sha256.New, key)
	h.Write(body)
	if !hmac.Equal(h.Sum(nil)[:sealMACLen], tag) {
		return 0, errSealMAC
	}
	if err := json.Unmarshal(body[6:], v); err != nil {
		return 0, fmt.Errorf("message body: %v", err)
	}
	return b[5], nil
}
