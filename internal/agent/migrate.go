package agent

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
// deployment key, like triggers (trigger.go). Requests carry their send
// time and a token; retransmissions get the same answer.

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"sync"
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

// setupMigration gives the control machinery its state plug-ins and its
// packet holding (agent start).
func (a *Agent) setupMigration(c *control) error {
	if len(a.cfg.StatePlugins) > 0 {
		a.providers = &migrate.Providers{}
		set, err := migrate.NewSet(a.cfg.StatePlugins, migrate.Options{APIProviders: a.providers,
			FailExport: a.cfg.StateFailExport, FailImport: a.cfg.StateFailImport, DelayExport: a.cfg.StateDelayExport})
		if err != nil {
			return fmt.Errorf("--state-plugins: %w", err)
		}
		c.states = set
	}
	hs, err := newHolds(a.dp, func(msg string, args ...any) { a.log.Warn(msg, args...) })
	if err != nil {
		a.log.Warn("state migration disabled: the datapath cannot hold packets", "err", err)
		return nil
	}
	c.holds = hs
	return nil
}

// The lease by which this agent tells the datapath that it reads the hold
// ring (Datapath.SetSplitReader), and how often the control loop renews it.
// An agent that dies without clearing its lease leaves packets straddling
// a cut-off to a ring nobody reads (TCP sends them again) for at most
// splitLease; after that they go whole on the old path.
const (
	splitLease      = 3 * time.Second
	splitLeaseRenew = time.Second
)

// setSplitReader tells the datapath whether this agent reads the hold ring
// and so splits packets straddling a cut-off (holds.split): on takes (or
// renews) a lease of splitLease, off clears it, which the agent does when
// it stops, so that such packets go whole on the old path while no agent
// reads the ring.
func (a *Agent) setSplitReader(on bool) {
	lease := time.Duration(0)
	if on {
		lease = splitLease
	}
	if err := a.dp.SetSplitReader(lease); err != nil {
		a.log.Warn("datapath: cannot set whether packets straddling a cut-off are split", "on", on, "err", err)
	}
}

// ---- holding packets ----

// hold is one anchor side's held packets (the datapath copies them to the
// dysco_hold ring buffer and steals them; the hold reader queues them here).
type hold struct {
	sess  uint32
	eg    datapath.Tuple
	flags uint32
	limit int64

	mu         sync.Mutex
	q          []datapath.HeldPacket
	qBytes     int64
	pkts       int64
	bytes      int64
	dropped    int64
	overflow   bool
	onOverflow func()
	releasing  bool
	done       bool
	released   chan struct{}
}

// holds routes held packets to their hold and re-injects them.
type holds struct {
	dp  *datapath.Datapath
	log func(msg string, args ...any)

	mu     sync.Mutex
	bySess map[uint32]*hold
	rd     *datapath.HoldReader
	injMu  sync.Mutex
	inj    *datapath.Reinjector

	injected, injectErrs, stray int64 // under injMu
	// Packets straddling a cut-off (HeldPacket.Split): split and sent
	// again, and sent again whole because they could not be split.
	splits, splitWhole int64 // under injMu
}

func newHolds(dp *datapath.Datapath, log func(string, ...any)) (*holds, error) {
	rd, err := dp.HoldReader()
	if err != nil {
		return nil, err
	}
	hs := &holds{dp: dp, log: log, bySess: map[uint32]*hold{}, rd: rd, inj: datapath.NewReinjector()}
	go hs.readLoop()
	return hs, nil
}

func (hs *holds) close() {
	_ = hs.rd.Close()
	hs.injMu.Lock()
	_ = hs.inj.Close()
	hs.injMu.Unlock()
}

func (hs *holds) inject(p datapath.HeldPacket) {
	hs.injMu.Lock()
	defer hs.injMu.Unlock()
	if err := hs.inj.Send(p); err != nil {
		hs.injectErrs++
		hs.log("re-injecting a held packet failed", "session", p.Session, "err", err)
		return
	}
	hs.injected++
}

func (hs *holds) readLoop() {
	for {
		p, err := hs.rd.Read()
		if err != nil {
			return
		}
		if p.Split {
			hs.split(p)
			continue
		}
		hs.mu.Lock()
		h := hs.bySess[p.Session]
		hs.mu.Unlock()
		if h == nil || !h.add(p) {
			// Nobody holds this session (any more): send it on at once.
			if h == nil {
				hs.injMu.Lock()
				hs.stray++
				hs.injMu.Unlock()
			}
			hs.inject(p)
		}
	}
}

// split cuts a packet whose data straddles the cut-off of its side's
// two-path phase and sends both parts again (paper §3.5; bpf/dysco.c,
// tp_split): each part then takes its own path in the datapath, the bytes
// below oldSent the old one. The cut-off is the record's, fixed while the
// phase is active. A packet whose phase is over when it is read (its record
// gone, or in another state: ended, or a later reconfiguration's) or that
// cannot be cut goes again whole, and then the path the side uses now.
func (hs *holds) split(p datapath.HeldPacket) {
	var parts [][]byte
	rec, ok := hs.dp.TwoPath(datapath.TPKey{SessId: p.Session, Side: p.Side})
	if ok && rec.State == datapath.TPActive {
		var err error
		if parts, err = datapath.SplitFrame(p.Frame, rec.OldSent, int(p.GSOSize)); err != nil {
			hs.log("splitting a packet at the cut-off failed; sent whole", "session", p.Session, "err", err)
			parts = nil
		}
	}
	if parts == nil {
		hs.injMu.Lock()
		hs.splitWhole++
		hs.injMu.Unlock()
		hs.inject(p)
		return
	}
	hs.injMu.Lock()
	hs.splits++
	hs.injMu.Unlock()
	for _, f := range parts {
		q := p
		q.Frame = f
		hs.inject(q)
	}
}

// add queues a held packet; false when the hold is over (send it now).
func (h *hold) add(p datapath.HeldPacket) bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.done {
		return false
	}
	n := int64(len(p.Frame))
	if !h.releasing {
		if !h.overflow && h.bytes+n > h.limit {
			h.overflow = true
			if h.onOverflow != nil {
				go h.onOverflow()
			}
		}
		if h.qBytes+n > 2*h.limit {
			// Far past the bound while the abort runs: let the sender's
			// TCP retransmit it rather than grow without limit.
			h.dropped++
			return true
		}
	}
	h.q = append(h.q, p)
	h.qBytes += n
	h.pkts++
	h.bytes += n
	return true
}

func (h *hold) stats() (pkts, bytes, dropped int64) {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.pkts, h.bytes, h.dropped
}

// start begins holding a flow's packets.
func (hs *holds) start(sess uint32, eg datapath.Tuple, flags uint32, limit int64, onOverflow func()) (*hold, error) {
	h := &hold{sess: sess, eg: eg, flags: flags, limit: limit, onOverflow: onOverflow, released: make(chan struct{})}
	hs.mu.Lock()
	if old := hs.bySess[sess]; old != nil {
		hs.mu.Unlock()
		return nil, fmt.Errorf("session %d already holds its packets", sess)
	}
	hs.bySess[sess] = h
	hs.mu.Unlock()
	if err := hs.dp.SetFlowFlags(eg, flags, 0); err != nil {
		hs.mu.Lock()
		delete(hs.bySess, sess)
		hs.mu.Unlock()
		return nil, fmt.Errorf("holding packets: %w", err)
	}
	return h, nil
}

// release re-injects everything held, in order, then stops holding (new
// packets keep being queued behind the held ones until the queue is empty;
// re-injected packets carry the mark the datapath never holds). Safe to
// call more than once; returns when done.
func (hs *holds) release(h *hold) {
	h.mu.Lock()
	if h.releasing {
		h.mu.Unlock()
		<-h.released
		return
	}
	h.releasing = true
	h.mu.Unlock()
	for {
		h.mu.Lock()
		q := h.q
		h.q, h.qBytes = nil, 0
		if len(q) == 0 {
			if err := hs.dp.SetFlowFlags(h.eg, 0, datapath.FlHoldData|datapath.FlHoldAll); err != nil {
				hs.log("clearing the hold flags failed", "session", h.sess, "err", err)
			}
			h.done = true
			h.mu.Unlock()
			break
		}
		h.mu.Unlock()
		for _, p := range q {
			hs.inject(p)
		}
	}
	hs.mu.Lock()
	if hs.bySess[h.sess] == h {
		delete(hs.bySess, h.sess)
	}
	hs.mu.Unlock()
	close(h.released)
}

// ---- the left anchor's orchestration ----

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
}

// startMigration registers a migration before its request starts (loop).
func (c *control) startMigration(token uint64, o MigrateOptions, start time.Time, out chan api.MigrationReport) {
	c.migrations[token] = &migration{token: token, opts: o, start: start, rep: api.MigrationReport{Semantics: o.Semantics}}
	c.migReports[token] = api.MigrationReport{Semantics: o.Semantics, Error: "the new path was not set up"}
	if out != nil {
		c.migOut[token] = out
	}
}

// onNewPathReady starts the state migration of a gated request (loop).
func (c *control) onNewPathReady(v6 bool, x protocol.NewPathReady) {
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
	tp, ok := c.a.dp.TwoPath(datapath.TPKey{SessId: m.id, Side: uint32(protocol.SideRight)})
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
func (c *control) flowMarks(k datapath.Tuple) marks {
	f, ok := c.a.dp.Flow(k)
	if !ok || !f.Marked() {
		return marks{}
	}
	return marks{Seq: f.MkSeq, Ack: f.MkAck, Ok: true}
}

// drained tells whether a side's old path is empty enough for the
// semantics: substream — everything this side sent is acknowledged; order
// — everything the other anchor sent before its freeze (peer) arrived.
func (c *control) drained(sem string, own, peer marks, inOld datapath.Tuple) bool {
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
func (c *control) waitDrained(ctx context.Context, sem string, own, peer marks, inOld datapath.Tuple) bool {
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
func (c *control) runMigration(m *migration, own marks, inOld datapath.Tuple) {
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
func (c *control) freezeAndDrain(ctx context.Context, m *migration, own marks, inOld datapath.Tuple) error {
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

func (c *control) migrateSteps(ctx context.Context, m *migration, own marks, inOld datapath.Tuple) error {
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
func (c *control) migrationDone(m *migration, err error) {
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
		c.handle(m.v6, protocol.Proceed{Session: m.ready.Session, Req: m.ready.Req, Abort: abort})
	}
	if h := m.hold; h != nil {
		go c.holds.release(h)
	}
}

// migrationEnded is called when a request's Result arrives (loop): a
// migration still running stops and releases what it held.
func (c *control) migrationEnded(token uint64) {
	if m := c.migrations[token]; m != nil {
		m.ended.Store(true)
		delete(c.migrations, token)
		if h := m.hold; h != nil {
			go c.holds.release(h)
		}
	}
}

// ---- the other agents' parts ----

// rightHold is a right anchor's hold, released when its side switches or
// the request ends.
type rightHold struct {
	h     *hold
	timer *time.Timer
}

// onMig handles a migration request or answer (loop).
func (c *control) onMig(from netip.Addr, data []byte) {
	kind, m, err := decodeMig(c.key, data)
	if err != nil {
		reason := "migration_malformed"
		if errors.Is(err, errSealMAC) {
			reason = "migration_bad_mac"
		}
		c.countReject(reason)
		return
	}
	switch kind {
	case migAnswer:
		call := c.migCalls[m.Token]
		if call == nil || call.to != from {
			c.countReject("migration_unexpected")
			return
		}
		delete(c.migCalls, m.Token)
		call.timer.Stop()
		call.ch <- m
	case migRequest:
		k := triggerKey{from, m.Token}
		if res, ok := c.migAnswers[k]; ok {
			if res != nil {
				c.send(from, res)
			}
			return
		}
		age := time.Since(time.UnixMilli(m.SentUnixMS))
		if age > migMaxAge || age < -migMaxAge {
			c.countReject("migration_stale")
			return
		}
		c.migAnswers[k] = nil
		answer := func(r migMsg) {
			r.Token = m.Token
			b, err := encodeMig(c.key, migAnswer, r)
			if err != nil {
				return
			}
			c.migAnswers[k] = b
			time.AfterFunc(2*migMaxAge, func() { c.post(func() { delete(c.migAnswers, k) }) })
			c.send(from, b)
		}
		// answerLater answers from another goroutine.
		answerLater := func(r migMsg) { c.post(func() { answer(r) }) }
		switch m.Op {
		case "freeze":
			c.onFreeze(from, m, answer, answerLater)
		case "export":
			c.onExport(from, m, answer, answerLater)
		case "import":
			c.onImport(from, m, answer, answerLater)
		case "abort":
			c.onAbort(from, m, answer)
		default:
			answer(migMsg{Err: fmt.Sprintf("unknown operation %q", m.Op)})
		}
	default:
		c.countReject("migration_malformed")
	}
}

// onFreeze: the right anchor holds its old-path packets and reports its
// marks (after its drain, for the semantics that need one).
func (c *control) onFreeze(from netip.Addr, m migMsg, answer, answerLater func(migMsg)) {
	req := protocol.ReqKey{LeftAnchor: m.ReqLeft, ID: m.ReqID}
	if from != m.ReqLeft {
		answer(migMsg{Err: "freeze must come from the request's left anchor"})
		return
	}
	p := c.proto(from.Is6())
	if p == nil {
		answer(migMsg{Err: "no address of this family"})
		return
	}
	pid, ok := p.RightAnchorOf(req)
	if !ok {
		answer(migMsg{Err: fmt.Sprintf("not the right anchor of %s", req)})
		return
	}
	opts := MigrateOptions{Semantics: m.Semantics, HoldLimit: m.HoldLimit, DrainTimeout: time.Duration(m.DrainMS) * time.Millisecond}
	if err := opts.normalize(); err != nil {
		answer(migMsg{Err: err.Error()})
		return
	}
	id := c.dpID(pid)
	k := datapath.TPKey{SessId: id, Side: uint32(protocol.SideLeft)}
	tp, ok := c.a.dp.TwoPath(k)
	if !ok {
		answer(migMsg{Err: "the session's two-path record is missing"})
		return
	}
	if rh := c.rightHolds[k]; rh != nil {
		answer(migMsg{Err: "this side is already frozen"})
		return
	}
	if c.holds == nil {
		answer(migMsg{Err: "the right anchor's datapath cannot hold packets"})
		return
	}
	limit := opts.HoldLimit
	h, err := c.holds.start(id, datapath.Tuple(tp.EgKey), opts.holdFlags(), limit, func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		_, _ = c.migCall(ctx, req.LeftAnchor, migMsg{Op: "abort", ReqLeft: req.LeftAnchor, ReqID: req.ID,
			Note: fmt.Sprintf("hold buffer full at the right anchor (over %d bytes)", limit)})
	})
	if err != nil {
		answer(migMsg{Err: err.Error()})
		return
	}
	rh := &rightHold{h: h}
	c.rightHolds[k] = rh
	// Never hold beyond every bound of the left anchor: it may be gone.
	rh.timer = time.AfterFunc(defaultMigTimeout+opts.Timeout, func() { c.post(func() { c.releaseRightHold(k) }) })
	own := c.flowMarks(datapath.Tuple(tp.EgKey))
	var peer marks
	if m.Marks != nil {
		peer = *m.Marks
	}
	inOld := datapath.Tuple(tp.InOld)
	if opts.Semantics == SemLossFree {
		answer(migMsg{Marks: &own})
		return
	}
	go func() {
		limit := opts.Timeout
		if opts.Semantics == SemOrder {
			limit = opts.DrainTimeout
		}
		ctx, cancel := context.WithTimeout(context.Background(), limit)
		ok := c.waitDrained(ctx, opts.Semantics, own, peer, inOld)
		cancel()
		switch {
		case ok:
			answerLater(migMsg{Marks: &own})
		case opts.Semantics == SemOrder:
			answerLater(migMsg{Marks: &own, Note: "drain timeout: a packet sent before the freeze did not arrive (lost or late)"})
		default:
			answerLater(migMsg{Err: "the old path did not drain at the right anchor: data sent before the freeze is still unacknowledged"})
		}
	}()
}

// onAbort: the right anchor cannot go on (its hold is full).
func (c *control) onAbort(from netip.Addr, m migMsg, answer func(migMsg)) {
	req := protocol.ReqKey{LeftAnchor: m.ReqLeft, ID: m.ReqID}
	for _, mg := range c.migrations {
		if mg.ready.Req == req && mg.ready.RightAnchor == from {
			c.migrationDone(mg, errors.New(m.Note))
			answer(migMsg{})
			return
		}
	}
	answer(migMsg{Err: "no migration of " + req.String() + " here"})
}

// releaseRightHold ends a right anchor's hold (loop).
func (c *control) releaseRightHold(k datapath.TPKey) {
	rh := c.rightHolds[k]
	if rh == nil {
		return
	}
	delete(c.rightHolds, k)
	rh.timer.Stop()
	go c.holds.release(rh.h)
}

// stateSession finds the session a state request names by the subsession
// from the left anchor to this host (as its SYN went), which the sender
// must be the left end of.
func (c *control) stateSession(from netip.Addr, m migMsg) (uint32, datapath.Session, string) {
	if m.Sub == nil || m.Sub.Src != from {
		return 0, datapath.Session{}, m.Op + " must come from the left end of the named subsession"
	}
	id, ok := c.sessionBySub(*m.Sub)
	if !ok {
		return 0, datapath.Session{}, "no session on subsession " + m.Sub.String()
	}
	s, ok := c.a.dp.Session(id)
	if !ok {
		return 0, datapath.Session{}, "session gone"
	}
	if c.states == nil {
		return 0, datapath.Session{}, "state migration is disabled on this agent (no --state-plugins)"
	}
	return id, s, ""
}

// onExport: the old middlebox exports the session's state (the plug-ins'
// Set refuses a bundle too large for one control message).
func (c *control) onExport(from netip.Addr, m migMsg, answer, answerLater func(migMsg)) {
	id, s, bad := c.stateSession(from, m)
	if bad != "" {
		answer(migMsg{Err: bad})
		return
	}
	t := s.Tuple.Wire()
	if on := c.onward(id, &s); on != t {
		// This middlebox translates the session (a NAT): its replacement
		// would send the session on with the NAT's output, and a host
		// joining a new path keys the session's egress by the tuple in
		// the SYN (docs/state-migration.md, "What is not covered").
		answer(migMsg{Err: fmt.Sprintf("this middlebox translates the session's tuple (%s leaves as %s): a replacement cannot take it over on a new path", t, on)})
		return
	}
	if right, ok := c.currentSub(id, &s, protocol.SideRight); !ok || right.Dst != m.RightAnchor {
		answer(migMsg{Err: fmt.Sprintf("the old segment has more than this middlebox before the right anchor %s: state migration replaces one middlebox by one", m.RightAnchor)})
		return
	}
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), defaultMigTimeout)
		defer cancel()
		b, err := c.states.Export(ctx, migrate.Session{Tuple: t, Proto: 6})
		if err != nil {
			answerLater(migMsg{Err: err.Error()})
			return
		}
		c.post(func() { c.exported[id] = t })
		answerLater(migMsg{State: b})
	}()
}

// onImport: the new middlebox installs the state before any packet of the
// session reaches it.
func (c *control) onImport(from netip.Addr, m migMsg, answer, answerLater func(migMsg)) {
	id, s, bad := c.stateSession(from, m)
	if bad != "" {
		answer(migMsg{Err: bad})
		return
	}
	t := s.Tuple.Wire()
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), defaultMigTimeout)
		defer cancel()
		if err := c.states.Import(ctx, migrate.Session{Tuple: t, Proto: 6}, m.State); err != nil {
			answerLater(migMsg{Err: err.Error()})
			return
		}
		// If this new path is abandoned, the state goes with it; if it
		// was abandoned while the import ran, at once.
		c.post(func() {
			c.exported[id] = t
			if _, ok := c.a.dp.Session(id); !ok || c.pidOf[id] == 0 {
				c.releaseExported(id)
			}
		})
		answerLater(migMsg{})
	}()
}

// releaseExported drops the state of a session this host exported (or
// imported), once the path through it is freed: the old path after the
// move, or a new path that was abandoned (loop; the work runs aside).
func (c *control) releaseExported(id uint32) {
	t, ok := c.exported[id]
	if !ok {
		return
	}
	delete(c.exported, id)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), defaultMigTimeout)
		defer cancel()
		if err := c.states.Release(ctx, migrate.Session{Tuple: t, Proto: 6}); err != nil {
			c.a.log.Warn("releasing migrated state", "session", t.String(), "err", err)
		}
	}()
}

// ---- requests with retransmission ----

type migCall struct {
	to    netip.Addr
	data  []byte
	ch    chan migMsg
	tries int
	timer *time.Timer
}

// migCall sends a request and waits for its answer (not on the loop).
func (c *control) migCall(ctx context.Context, to netip.Addr, m migMsg) (migMsg, error) {
	ch := make(chan migMsg, 1)
	var token uint64
	errc := make(chan error, 1)
	c.post(func() {
		c.token++
		token = c.token
		m.Token = token
		m.SentUnixMS = time.Now().UnixMilli()
		b, err := encodeMig(c.key, migRequest, m)
		if err != nil {
			errc <- err
			return
		}
		call := &migCall{to: to, data: b, ch: ch}
		c.migCalls[token] = call
		var send func()
		send = func() {
			call.tries++
			c.send(to, call.data)
			// 20 ms, doubling to 320 ms: the answers may need a drain.
			call.timer = time.AfterFunc(time.Duration(20<<min(call.tries-1, 4))*time.Millisecond, func() {
				c.post(func() {
					if c.migCalls[token] == call {
						send()
					}
				})
			})
		}
		send()
		errc <- nil
	})
	if err := <-errc; err != nil {
		return migMsg{}, err
	}
	select {
	case a := <-ch:
		if a.Err != "" {
			return a, errors.New(a.Err)
		}
		return a, nil
	case <-ctx.Done():
		c.post(func() {
			if call := c.migCalls[token]; call != nil {
				call.timer.Stop()
				delete(c.migCalls, token)
			}
		})
		return migMsg{}, fmt.Errorf("no answer from %s", to)
	}
}
