// Package sim is a deterministic discrete-event simulation of Dysco agents
// running the reconfiguration protocol (package protocol) over a network
// that loses, duplicates, delays and reorders control and data packets.
//
// Each run builds hosts (end hosts and middleboxes, some of which apply
// sequence and timestamp deltas to the streams they forward, like a proxy),
// sets up TCP sessions through chains of middleboxes, transfers data in
// both directions with a simplified TCP, and fires reconfiguration requests
// at random, several at once on overlapping segments, through middleboxes
// that are sometimes dead, while end hosts close or reset their sessions at
// any time. Some runs add UDP sessions (udp.go): their ends send
// datagrams both ways and stop, the collectors end them when idle, and
// their reconfigurations take the UDP two-path phase (protocol/udp.go);
// a datagram that reaches a host whose state of its path is gone, or an
// old path whose teardown has begun, is a violation. A model of the
// datapath carries out the agents' actions (flows,
// deltas, the two-path rules of protocol.Decide and protocol.Observe), and a
// model of the agent's collector ends sessions after FIN, RST or idleness.
//
// Invariants (paper §3.7) are checked as the run goes and at its end: when
// overlapping requests contend exactly one wins (a contention refusal names
// a request that went on to lock the segment, and a locked segment is
// locked at every agent of its old path); the end hosts receive each byte
// stream in order and complete, with correct sequence, ack and timestamp
// numbers; stateful middleboxes never see an ack for data they did not
// forward; a reconfiguration whose new path works succeeds; sessions end and
// no agent keeps any state or lock. Everything follows from the seed.
package sim

import (
	"container/heap"
	"fmt"
	"math/rand/v2"
	"net/netip"
	"sort"
	"strings"
	"time"

	"github.com/dysco/dysco/internal/protocol"
	"github.com/dysco/dysco/internal/wire"
)

// Options selects a run. Everything not given is drawn from the seed.
type Options struct {
	Seed int64
	// Faults breaks the protocol on purpose, to show the checkers fail.
	Faults protocol.Fault
	// Trace records a readable trace of every event.
	Trace bool
	// NoUDP: no UDP sessions (a run as it was before they came, for
	// seeds that found bugs in TCP runs).
	NoUDP bool
	// noLockWalk turns the continuous lock check off, to show that the
	// end-of-run checks catch broken locking on their own.
	noLockWalk bool
	// old makes the hosts behave as the agent did before (with
	// protocol.FaultNoPathCheck, the old behaviour), to show that the
	// checkers catch each flaw.
	old oldAgent
}

// oldAgent selects behaviours of the agent before it checked its datapath
// for the sessions it carries.
type oldAgent uint8

const (
	// oldJoin: a new path's SYN is never marked OnPath, and a JoinSession
	// whose tuple the datapath holds live fails silently: the protocol
	// goes on with a path this host does not carry.
	oldJoin oldAgent = 1 << iota
	// oldAnnounce: a session that has seen a FIN is not announced to the
	// protocol, so its control messages are rejected.
	oldAnnounce
	// oldNoNotice: no FinsSeen after a reconfiguration, so the middleboxes
	// of a new path never learn of FINs that went the old way.
	oldNoNotice
)

// Report is the outcome of one run.
type Report struct {
	Seed  int64
	Err   error    // the first invariant violated, nil if none
	Trace []string // with Options.Trace
	Stats Stats
}

// Stats counts what happened in a run.
type Stats struct {
	Sessions, Hosts                      int
	Requests, Succeeded, Refused, Failed int
	Contended                            int // refused because of another request
	SetupFailed                          int // new path through a dead middlebox: cancelled
	Unconfirmed                          int
	Resets                               int
	// A new chain equal to the old segment (succeeded unchanged), one
	// naming a middlebox that carries the session (refused on-path),
	// closed notices recorded by joined middleboxes, sessions that reuse
	// an earlier session's tuple, requests issued right after a result.
	Unchanged, OnPath, ClosedMarks, Reused, BackToBack int
	ControlSent, DataSent                              int
	Lost, Duplicated                                   int
	Rejected                                           map[string]int
	Outcomes                                           map[string]int // outcome: reason
	// The two-path phase at work (§3.5): cut-offs, packets split at
	// oldSent, extra acks of oldRcvd on the old path, data received on
	// each path after a cut-off, late old-path packets whose ack was
	// raised to the highest received (protocol.Deliver), and segments an
	// end host discarded because their ack was more than a window old.
	CutOffs, Splits, ExtraOldAcks, OldPathData, NewPathData, RaisedAcks, TooOldAcks int
	// Triggers (trigger.go): sent, taken by the left neighbour (a request
	// started), answered with a request's result, refused by the left
	// neighbour's handler, unanswered after every retransmission;
	// acknowledgements that a request still runs, replays sent.
	Triggers, TriggersTaken, TriggersAnswered, TriggersRefused, TriggersUnanswered, TriggerAcks, TriggerReplays int
	// State migrations (migrate.go): started (NewPathReady), moved,
	// aborted (a step failed), holds taken.
	Migrations, MigMoved, MigAborted, Holds int
	// UDP sessions (udp.go): sessions, reconfigurations requested and
	// succeeded, switches of anchors' sides, datagrams sent by the ends,
	// and datagrams received by anchors on each path in the phase.
	// (UDPChanged: succeeded, not unchanged.)
	UDPSessions, UDPRequests, UDPSucceeded, UDPChanged, UDPSwitches, Datagrams, OldPathDgrams, NewPathDgrams int
	SimTime                                                                                                  time.Duration
	Events                                                                                                   int
}

// Add accumulates another run's counts.
func (s *Stats) Add(o Stats) {
	s.Sessions += o.Sessions
	s.Hosts += o.Hosts
	s.Requests += o.Requests
	s.Succeeded += o.Succeeded
	s.Refused += o.Refused
	s.Failed += o.Failed
	s.Contended += o.Contended
	s.SetupFailed += o.SetupFailed
	s.Unconfirmed += o.Unconfirmed
	s.Resets += o.Resets
	s.Unchanged += o.Unchanged
	s.OnPath += o.OnPath
	s.ClosedMarks += o.ClosedMarks
	s.Reused += o.Reused
	s.BackToBack += o.BackToBack
	s.ControlSent += o.ControlSent
	s.DataSent += o.DataSent
	s.Lost += o.Lost
	s.Duplicated += o.Duplicated
	s.SimTime += o.SimTime
	s.Events += o.Events
	s.CutOffs += o.CutOffs
	s.Splits += o.Splits
	s.Migrations += o.Migrations
	s.MigMoved += o.MigMoved
	s.MigAborted += o.MigAborted
	s.Holds += o.Holds
	s.UDPSessions += o.UDPSessions
	s.UDPRequests += o.UDPRequests
	s.UDPSucceeded += o.UDPSucceeded
	s.UDPChanged += o.UDPChanged
	s.UDPSwitches += o.UDPSwitches
	s.Datagrams += o.Datagrams
	s.OldPathDgrams += o.OldPathDgrams
	s.NewPathDgrams += o.NewPathDgrams
	s.ExtraOldAcks += o.ExtraOldAcks
	s.OldPathData += o.OldPathData
	s.NewPathData += o.NewPathData
	s.RaisedAcks += o.RaisedAcks
	s.TooOldAcks += o.TooOldAcks
	s.Triggers += o.Triggers
	s.TriggersTaken += o.TriggersTaken
	s.TriggersAnswered += o.TriggersAnswered
	s.TriggersRefused += o.TriggersRefused
	s.TriggersUnanswered += o.TriggersUnanswered
	s.TriggerAcks += o.TriggerAcks
	s.TriggerReplays += o.TriggerReplays
	if s.Rejected == nil {
		s.Rejected, s.Outcomes = map[string]int{}, map[string]int{}
	}
	for k, v := range o.Rejected {
		s.Rejected[k] += v
	}
	for k, v := range o.Outcomes {
		s.Outcomes[k] += v
	}
}

func (s Stats) String() string {
	list := func(m map[string]int) string {
		keys := make([]string, 0, len(m))
		for k := range m {
			keys = append(keys, k)
		}
		sort.Strings(keys)
		var l []string
		for _, k := range keys {
			l = append(l, fmt.Sprintf("%s=%d", k, m[k]))
		}
		return strings.Join(l, " ")
	}
	return fmt.Sprintf("sessions=%d (reused tuples %d) requests=%d (back to back %d) succeeded=%d (unchanged %d) refused=%d (contention %d, on path %d) failed=%d (dead new path %d) "+
		"unconfirmed=%d resets=%d closed-marks=%d\n  outcomes[%s]\n  two-path: cut-offs=%d splits=%d extra-old-acks=%d old-path-data=%d new-path-data=%d raised-acks=%d too-old-acks=%d\n"+
		"  triggers=%d (taken %d, answered %d, refused by the left neighbour %d, unanswered %d, acks %d, replays %d)\n"+
		"  migrations=%d (moved %d, aborted %d, holds %d)\n"+
		"  udp: sessions=%d requests=%d succeeded=%d (changed %d) switches=%d datagrams=%d old-path=%d new-path=%d\n"+
		"  control=%d data=%d lost=%d dup=%d rejected[%s] simtime=%s events=%d",
		s.Sessions, s.Reused, s.Requests, s.BackToBack, s.Succeeded, s.Unchanged, s.Refused, s.Contended, s.OnPath, s.Failed, s.SetupFailed, s.Unconfirmed,
		s.Resets, s.ClosedMarks, list(s.Outcomes), s.CutOffs, s.Splits, s.ExtraOldAcks, s.OldPathData, s.NewPathData, s.RaisedAcks, s.TooOldAcks,
		s.Triggers, s.TriggersTaken, s.TriggersAnswered, s.TriggersRefused, s.TriggersUnanswered, s.TriggerAcks, s.TriggerReplays,
		s.Migrations, s.MigMoved, s.MigAborted, s.Holds,
		s.UDPSessions, s.UDPRequests, s.UDPSucceeded, s.UDPChanged, s.UDPSwitches, s.Datagrams, s.OldPathDgrams, s.NewPathDgrams,
		s.ControlSent, s.DataSent, s.Lost, s.Duplicated, list(s.Rejected), s.SimTime, s.Events)
}

// Fixed parameters of the simulated deployment.
const (
	mss          = 1000
	tcpWindow    = 8 * mss
	tcpRTO       = 150 * time.Millisecond
	tcpMaxRTO    = time.Second
	tcpMaxTries  = 25
	closeLinger  = 10 * time.Second // collector: after FINs both ways are acked (as the agent's --close-linger)
	rstLinger    = 1 * time.Second  // collector: after a RST
	idleTimeout  = 60 * time.Second
	stuckAfter   = 45 * time.Second // a reconfiguration still going after this is stuck
	horizon      = 20 * time.Minute // a run that lasts longer did not terminate
	maxEvents    = 2_000_000
	traceTailLen = 400
)

var deploymentKey = protocol.NewKeys([]byte("dysco simulation deployment key"))

// Run simulates one seed.
func Run(opts Options) *Report {
	w := newWorld(opts)
	w.build()
	w.loop()
	w.finish()
	r := &Report{Seed: opts.Seed, Err: w.err, Trace: w.trace, Stats: w.stats}
	r.Stats.SimTime = w.now
	return r
}

// TraceTail returns the last lines of a trace.
func TraceTail(tr []string, n int) []string {
	if len(tr) > n {
		return append([]string{fmt.Sprintf("... %d earlier lines", len(tr)-n)}, tr[len(tr)-n:]...)
	}
	return tr
}

type world struct {
	opts  Options
	rng   *rand.Rand
	now   time.Duration
	q     eventQueue
	seq   uint64
	err   error
	trace []string
	stats Stats

	hosts    []*host
	byAddr   map[netip.Addr]*host
	sessions []*simSession
	reqs     []*request
	byToken  map[uint64]*request
	byReq    map[protocol.ReqKey]*request

	loss, dup        float64
	delayMin, jitter time.Duration
	nextSessID       protocol.SessionID
	portSeq          uint16
	tokens           uint64
	locked           map[protocol.ReqKey]lockRec // when each request locked its segment, and the segment
	started          map[protocol.ReqKey]time.Duration
	// held records when each host held datapath state of each session
	// (to judge on-path refusals).
	held map[*simSession]map[*host][]span
	// joinFails: requests whose new path a datapath refused to join.
	joinFails map[protocol.ReqKey]bool
	// byTrigger: the triggered requests by their triggers' keys.
	byTrigger map[protocol.ReqKey]*request
	// unchanged: the segments of requests whose ackLock found their chain
	// equal to the old segment, when it came.
	unchanged map[protocol.ReqKey][]*host
	// migs are the migrating requests, by key (migrate.go).
	migs map[protocol.ReqKey]*simMig
}

// span is a time a host held state of a session; end < 0: still.
type span struct{ start, end time.Duration }

// lockRec is a request's segment (the subsessions of the path between its
// anchors) when its left anchor got ackLock.
type lockRec struct {
	at    time.Duration
	edges map[[2]*dpSess]bool
}

func newWorld(opts Options) *world {
	w := &world{opts: opts, rng: rand.New(rand.NewPCG(uint64(opts.Seed), 0x9e3779b97f4a7c15)),
		byAddr: map[netip.Addr]*host{}, byToken: map[uint64]*request{}, byReq: map[protocol.ReqKey]*request{},
		locked: map[protocol.ReqKey]lockRec{}, started: map[protocol.ReqKey]time.Duration{},
		held: map[*simSession]map[*host][]span{}, joinFails: map[protocol.ReqKey]bool{},
		byTrigger: map[protocol.ReqKey]*request{}, unchanged: map[protocol.ReqKey][]*host{},
		migs: map[protocol.ReqKey]*simMig{}}
	w.stats.Rejected, w.stats.Outcomes = map[string]int{}, map[string]int{}
	return w
}

func (w *world) tracef(format string, args ...any) {
	if w.opts.Trace {
		w.trace = append(w.trace, fmt.Sprintf("%9.4fs ", w.now.Seconds())+fmt.Sprintf(format, args...))
	}
}

// fail records the first invariant violation; the run stops.
func (w *world) fail(format string, args ...any) {
	if w.err == nil {
		w.err = fmt.Errorf("t=%.4fs: %s", w.now.Seconds(), fmt.Sprintf(format, args...))
		w.tracef("VIOLATION: %v", w.err)
	}
}

// ---- events ----

type event struct {
	at        time.Duration
	seq       uint64
	fn        func()
	cancelled bool
}

type eventQueue []*event

func (q eventQueue) Len() int { return len(q) }
func (q eventQueue) Less(i, j int) bool {
	if q[i].at != q[j].at {
		return q[i].at < q[j].at
	}
	return q[i].seq < q[j].seq
}
func (q eventQueue) Swap(i, j int) { q[i], q[j] = q[j], q[i] }
func (q *eventQueue) Push(x any)   { *q = append(*q, x.(*event)) }
func (q *eventQueue) Pop() any {
	old := *q
	e := old[len(old)-1]
	*q = old[:len(old)-1]
	return e
}

func (w *world) at(t time.Duration, fn func()) *event {
	if t < w.now {
		t = w.now
	}
	w.seq++
	e := &event{at: t, seq: w.seq, fn: fn}
	heap.Push(&w.q, e)
	return e
}

func (w *world) after(d time.Duration, fn func()) *event { return w.at(w.now+d, fn) }

func (w *world) loop() {
	for w.q.Len() > 0 && w.err == nil {
		e := heap.Pop(&w.q).(*event)
		if e.cancelled {
			continue
		}
		w.now = e.at
		w.stats.Events++
		if w.now > horizon || w.stats.Events > maxEvents {
			w.fail("the run does not terminate (%d events)", w.stats.Events)
			return
		}
		e.fn()
	}
}

// ---- network ----

// deliver sends something from one host to another through the network:
// lost, duplicated, delayed (which reorders) at random.
func (w *world) deliver(from, to *host, what string, fn func()) {
	if from.dead || to.dead {
		w.tracef("%s -> %s %s: dead host, dropped", from, to, what)
		return
	}
	if w.rng.Float64() < w.loss {
		w.stats.Lost++
		w.tracef("%s -> %s %s: LOST", from, to, what)
		return
	}
	copies := 1
	if w.rng.Float64() < w.dup {
		copies = 2
		w.stats.Duplicated++
	}
	for i := 0; i < copies; i++ {
		d := w.delayMin + time.Duration(w.rng.Int64N(int64(w.jitter)+1))
		w.after(d, func() {
			if to.dead {
				return
			}
			fn()
		})
	}
}

// ---- hosts ----

// ---- sessions and requests ----

type simSession struct {
	idx   int
	tuple wire.Tuple
	nonce [wire.NonceLen]byte
	ends  [2]*tcpEnd // [0] the initiator (left), [1] the responder (right)
	udp   bool       // a UDP session: uends instead of ends
	uends [2]*udpEnd
	// ws are the window scales of a TCP session's two directions: of the
	// windows that travel rightwards (the initiator's) and leftwards (the
	// responder's). No middlebox rescales windows, so every host's
	// translation of a new subsession keeps them (§4.2).
	ws       [2]uint8
	rst      bool          // an end host reset the session (or gave up)
	ending   bool          // a collector saw the session end (FINs both ways acknowledged, or RST)
	endingAt time.Duration // when it first did
	// client and server host it (a later session may reuse them and the
	// tuple, as a client reuses a port).
	client, server *host
}

// segment returns the hosts strictly between left and right on s's path
// now, or nil if the path does not go from left to right.
func (w *world) segment(s *simSession, left, right *host) []*host {
	hs, _ := w.path(s)
	for i, h := range hs {
		if h != left {
			continue
		}
		for j := i + 1; j < len(hs); j++ {
			if hs[j] == right {
				return append([]*host{}, hs[i+1:j]...)
			}
		}
	}
	return nil
}

func sameHosts(a, b []*host) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

type request struct {
	token      uint64
	sess       *simSession
	left       *host
	right      *host
	chain      []*host
	deadChain  bool
	issued     time.Duration
	res        *protocol.Result
	resAt      time.Duration
	key        protocol.ReqKey
	contention bool // issued as part of a burst of overlapping requests
	// gate: the request is gated (state migration); abort: the simulated
	// agent aborts it at the gate.
	gate, abort bool
	// mig: the gated request moves state (migrate.go): the core
	// orchestrates it; abort makes a step fail.
	mig *protocol.MigrateSpec
	// sender, if set, asked the left anchor for the request with a
	// trigger (trigger.go); the other fields of a trigger are there.
	sender *host
	trig   *trigState
	// badView: the sender's agent knows the right anchor as its left
	// neighbour (sendTrigger); it refuses the trigger itself.
	badView bool
}

func (r *request) String() string {
	var c []string
	for _, h := range r.chain {
		c = append(c, h.name)
	}
	if r.sender != nil {
		return fmt.Sprintf("req#%d s%d %s..%s via [%s] triggered by %s", r.token, r.sess.idx, r.left, r.right, strings.Join(c, " "), r.sender)
	}
	return fmt.Sprintf("req#%d s%d %s..%s via [%s]", r.token, r.sess.idx, r.left, r.right, strings.Join(c, " "))
}

func (w *world) onResult(h *host, x protocol.Result) {
	r := w.byToken[x.Token]
	if !x.Trigger.IsZero() {
		r = w.triggeredResult(h, x)
	}
	if r == nil {
		w.fail("%s: result for unknown token %d", h, x.Token)
		return
	}
	if r.res != nil {
		w.fail("%s: two results for %s: %s then %s", h, r, r.res.Outcome, x.Outcome)
		return
	}
	r.res, r.resAt, r.key = &x, w.now, x.Req
	w.byReq[x.Req] = r
	if x.Unchanged {
		// The segment between the anchors was the new chain while the
		// request held it: nothing was to change. A request that found
		// so in its ackLock held the whole segment then (recordUnchanged);
		// it reports once its cancelLock has released the locks, and the
		// agents that cancelLock passed may have reconfigured the session
		// since. One whose right anchor is the next hop reports at once.
		w.stats.Unchanged++
		seg, ok := w.unchanged[x.Req]
		if !ok {
			seg = w.segment(r.sess, r.left, r.right)
		}
		if !r.sess.rst && !r.sess.ending && !sameHosts(seg, r.chain) {
			w.fail("%s: succeeded unchanged, but the segment is %v", r, seg)
			return
		}
	}
	if x.Reason == protocol.ReasonOnPath {
		w.stats.OnPath++
	}
	// The session tuple is the same at every host of the path, whatever
	// the reconfigurations did (the ends' and kept middleboxes' view).
	_, dss := w.path(r.sess)
	for _, ds := range dss {
		if v, ok := ds.h.agent.View(ds.id); ok && v.Tuple != r.sess.tuple {
			w.fail("%s: s%d's tuple is %s here, %s at its ends", ds.h, r.sess.idx, v.Tuple, r.sess.tuple)
			return
		}
		if v, ok := ds.h.agent.View(ds.id); ok && (v.Proto == protocol.ProtoUDP) != r.sess.udp {
			w.fail("%s: s%d is %s here", ds.h, r.sess.idx, v.Proto)
			return
		}
	}
	if !r.sess.rst && !r.sess.ending && w.rng.IntN(4) == 0 {
		// The same session again at once (back to back).
		w.stats.BackToBack++
		w.after(0, func() { w.issue(r.sess, 1) })
	}
	note := ""
	if x.Unchanged {
		note = " unchanged"
	}
	if x.Hop.IsValid() {
		note += " hop=" + x.Hop.String()
	}
	w.tracef("%s RESULT %s %s: %s %s blocker=%s unconfirmed=%v%s", h, r, x.Req, x.Outcome, x.Reason, x.Blocker, x.Unconfirmed, note)
	if r.sess.udp {
		w.stats.UDPRequests++
		if x.Outcome == protocol.Succeeded {
			w.stats.UDPSucceeded++
			if !x.Unchanged {
				w.stats.UDPChanged++
			}
		}
	}
	switch x.Outcome {
	case protocol.Succeeded:
		w.stats.Succeeded++
	case protocol.Refused:
		w.stats.Refused++
		if x.Reason.Contention() {
			w.stats.Contended++
		}
	case protocol.Failed:
		w.stats.Failed++
		if x.Reason == protocol.ReasonSetupFailed && r.deadChain {
			w.stats.SetupFailed++
		}
	}
	if x.Unconfirmed {
		w.stats.Unconfirmed++
	}
}

// path returns the hosts a session's packets traverse now, left to right,
// with the datapath state at each, as the datapath's egress flows say.
func (w *world) path(s *simSession) ([]*host, []*dpSess) {
	var first *dpSess
	if e := s.ends[0]; e != nil {
		first = e.ds
	} else if e := s.uends[0]; e != nil {
		first = e.ds
	}
	if first == nil || first.gone {
		return nil, nil
	}
	hs, ds := []*host{first.h}, []*dpSess{first}
	cur := first
	for i := 0; i < 16; i++ {
		sd := cur.sides[protocol.SideRight]
		if sd == nil || sd.cur == nil {
			return hs, ds
		}
		peer := w.byAddr[sd.cur.peer]
		sub := peer.subs[sd.cur.tuple]
		if sub == nil || sub.ds.gone {
			return hs, ds
		}
		cur = sub.ds
		hs, ds = append(hs, peer), append(ds, cur)
	}
	return hs, ds
}

// recordUnchanged remembers the segment of a request whose ackLock found
// the new chain equal to the old segment: every agent of it is locked for
// the request now.
func (w *world) recordUnchanged(h *host, x protocol.Progress) {
	ds := h.dp[x.Session]
	v, ok := h.agent.View(x.Session)
	if ds == nil || !ok || v.Left == nil {
		return
	}
	w.unchanged[x.Req] = w.segment(ds.sess, h, w.byAddr[v.Left.RightAnchor])
}

// recordLock remembers the segment a request holds from now on.
func (w *world) recordLock(h *host, x protocol.Progress) {
	ds := h.dp[x.Session]
	v, ok := h.agent.View(x.Session)
	if ds == nil || !ok || v.Left == nil {
		return
	}
	hs, dss := w.path(ds.sess)
	rec := lockRec{at: w.now, edges: map[[2]*dpSess]bool{}}
	in := false
	for i := 0; i+1 < len(hs); i++ {
		in = in || dss[i] == ds // a host may be on the path twice: compare its session state
		if in {
			rec.edges[[2]*dpSess{dss[i], dss[i+1]}] = true
			if hs[i+1].addr == v.Left.RightAnchor {
				break
			}
		}
	}
	w.locked[x.Req] = rec
}
