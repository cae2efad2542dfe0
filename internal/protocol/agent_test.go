package protocol

import (
	"net/netip"
	"strings"
	"testing"
)

func neg(x int32) uint32 { return uint32(x) }

// assertClean checks that the session is unlocked everywhere it remains
// and that no agent still holds reconfiguration state.
func (h *harness) assertClean(ids ...int) {
	h.t.Helper()
	for _, id := range ids {
		v, ok := h.view(id)
		if !ok {
			continue
		}
		if v.Lock != Unlocked || v.Left != nil || v.Right != nil || v.Queued != 0 || v.Cancels != 0 {
			h.t.Fatalf("agent %d not clean: lock %s by %s, left %v right %v queued %d cancels %d\n%s",
				id, v.Lock, v.Requestor, v.Left, v.Right, v.Queued, v.Cancels, h.trace())
		}
	}
}

// runLossy delivers messages and fires timers until nothing is left,
// losing those drop selects (n: how many of that type went before) and,
// with dup, delivering every other one twice.
func (h *harness) runLossy(drop func(n int, e envelope) bool, dup bool) {
	seen := map[MsgType]int{}
	for i := 0; i < 100000; i++ {
		if len(h.queue) == 0 {
			if !h.fireNext() {
				return
			}
			continue
		}
		e := h.queue[0]
		h.queue = h.queue[1:]
		n := seen[e.msg.Type]
		seen[e.msg.Type]++
		if drop != nil && drop(n, e) {
			h.log = append(h.log, "lost: "+e.msg.String())
			continue
		}
		h.deliver(e.to, MessageIn{From: e.from, Data: e.data})
		if dup {
			h.deliver(e.to, MessageIn{From: e.from, Data: e.data})
		}
	}
}

func (h *harness) peers(id int) (left, right netip.Addr) {
	v, ok := h.view(id)
	if !ok {
		h.t.Fatalf("agent %d has no session", id)
	}
	if v.Sides[SideLeft] != nil {
		left = v.Sides[SideLeft].Peer
	}
	if v.Sides[SideRight] != nil {
		right = v.Sides[SideRight].Peer
	}
	return
}

// §3.1, §3.4: deleting three middleboxes with deltas in both directions;
// the anchors end up with the sums.
func TestDeleteAccumulatesDeltas(t *testing.T) {
	h := newHarness(t, 5)
	app := map[int]AppDelta{
		2: {Right: Delta{Seq: 100, TS: 7}, Left: Delta{Seq: neg(-30), TS: 5}},
		3: {Right: Delta{Seq: 1000, TS: neg(-2)}, Left: Delta{Seq: 50}},
		4: {Right: Delta{Seq: 7}, Left: Delta{Seq: neg(-1), TS: 1 << 31}},
	}
	h.chain([]int{1, 2, 3, 4, 5}, app)
	h.reconfigure(1, 5, nil, 1)
	h.run()
	if r := h.result(1); r.Outcome != Succeeded {
		t.Fatalf("result %+v\n%s", r, h.trace())
	}
	wantRight := app[2].Right.Add(app[3].Right).Add(app[4].Right)
	wantLeft := app[2].Left.Add(app[3].Left).Add(app[4].Left)
	if got := h.adds[addr(5)][0]; got.Delta != wantRight || got.Side != SideLeft || !got.Armed {
		t.Errorf("right anchor subsession %+v, want delta %s", got, wantRight)
	}
	if got := h.adds[addr(1)][0]; got.Delta != wantLeft || got.Side != SideRight {
		t.Errorf("left anchor subsession %+v, want delta %s", got, wantLeft)
	}
	for _, id := range []int{2, 3, 4} {
		if _, ok := h.view(id); ok {
			t.Errorf("middlebox %d still has the session", id)
		}
		if len(h.frees[addr(id)]) != 1 {
			t.Errorf("middlebox %d: FreeSession %v", id, h.frees[addr(id)])
		}
	}
	if _, r := h.peers(1); r != addr(5) {
		t.Errorf("left anchor's right peer %s", r)
	}
	if l, _ := h.peers(5); l != addr(1) {
		t.Errorf("right anchor's left peer %s", l)
	}
	// §5.3: window clamped during the two-path phase, then released.
	if c := h.clamps[addr(1)]; len(c) != 2 || c[0].Bytes != 64<<10 || c[1].Bytes != 0 {
		t.Errorf("clamps %+v", c)
	}
	h.assertClean(1, 5)
	if v, _ := h.view(1); v.Lingering != 0 {
		t.Errorf("old subsession still lingering after linger timeout")
	}
}

// A former anchor's delta is part of what it contributes when it is
// deleted later: two steps give the same deltas as one.
func TestDeltasCompose(t *testing.T) {
	h := newHarness(t, 5)
	app := map[int]AppDelta{
		2: {Right: Delta{Seq: 100, TS: 3}, Left: Delta{Seq: neg(-30)}},
		3: {Right: Delta{Seq: 1000}, Left: Delta{Seq: 50, TS: 9}},
		4: {Right: Delta{Seq: 7}, Left: Delta{Seq: neg(-1)}},
	}
	h.chain([]int{1, 2, 3, 4, 5}, app)
	h.reconfigure(2, 4, nil, 1) // delete 3
	h.run()
	if r := h.result(1); r.Outcome != Succeeded {
		t.Fatalf("first %+v\n%s", r, h.trace())
	}
	h.reconfigure(1, 5, nil, 2) // delete 2 and 4
	h.run()
	if r := h.result(2); r.Outcome != Succeeded {
		t.Fatalf("second %+v\n%s", r, h.trace())
	}
	wantRight := app[2].Right.Add(app[3].Right).Add(app[4].Right)
	wantLeft := app[2].Left.Add(app[3].Left).Add(app[4].Left)
	v1, _ := h.view(1)
	v5, _ := h.view(5)
	if v5.Sides[SideLeft].Delta != wantRight || v1.Sides[SideRight].Delta != wantLeft {
		t.Errorf("deltas: right anchor %s want %s, left anchor %s want %s",
			v5.Sides[SideLeft].Delta, wantRight, v1.Sides[SideRight].Delta, wantLeft)
	}
}

// §3.1: insertion through two new middleboxes that join with the SYN.
func TestInsertJoinsNewPath(t *testing.T) {
	h := newHarness(t, 8)
	h.chain([]int{1, 2, 3}, nil)
	h.reconfigure(1, 3, []int{6, 7}, 1)
	h.run()
	if r := h.result(1); r.Outcome != Succeeded {
		t.Fatalf("%+v\n%s", r, h.trace())
	}
	if len(h.joins[addr(6)]) != 1 || len(h.joins[addr(7)]) != 1 {
		t.Fatalf("joins %v %v", h.joins[addr(6)], h.joins[addr(7)])
	}
	j6, j7 := h.joins[addr(6)][0], h.joins[addr(7)][0]
	if j6.Left.Peer != addr(1) || j6.Right.Peer != addr(7) || j7.Left.Peer != addr(6) || j7.Right.Peer != addr(3) {
		t.Errorf("new path %+v %+v", j6, j7)
	}
	if j6.Right.Sub != j7.Left.Sub || j6.Tuple != sessionTuple || j6.Nonce != testNonce {
		t.Errorf("subsessions do not line up: %s %s", j6.Right.Sub, j7.Left.Sub)
	}
	if _, r := h.peers(1); r != addr(6) {
		t.Errorf("left anchor's right peer %s", r)
	}
	if l, _ := h.peers(3); l != addr(7) {
		t.Errorf("right anchor's left peer %s", l)
	}
	if _, ok := h.view(2); ok {
		t.Error("old middlebox still in the session")
	}
	// The new path can be reconfigured in turn: delete 6 and 7 again.
	h.reconfigure(1, 3, nil, 2)
	h.run()
	if r := h.result(2); r.Outcome != Succeeded {
		t.Fatalf("second %+v\n%s", r, h.trace())
	}
	if _, r := h.peers(1); r != addr(3) {
		t.Errorf("left anchor's right peer %s", r)
	}
	if ids := h.agents[addr(6)].Sessions(); len(ids) != 0 {
		t.Errorf("middlebox 6 keeps %v", ids)
	}
}

// §3.2, Figure 5: X (2) locks [2..4] first; W's (1) request for [1..3] is
// blocked at X and refused when X's request is acknowledged.
func TestContentionBlockedThenRefused(t *testing.T) {
	h := newHarness(t, 5)
	h.chain([]int{1, 2, 3, 4, 5}, nil)
	h.reconfigure(2, 4, nil, 10) // X
	h.reconfigure(1, 3, nil, 20) // W
	h.step()                     // X's requestLock reaches 3, goes on to 4
	h.step()                     // X's early SYN reaches 4: kept (sendEarlySyn)
	h.step()                     // W's requestLock reaches 2: blocked (lockPending)
	if v, _ := h.view(2); v.Lock != LockPending || v.Queued != 1 {
		t.Fatalf("at 2: %s queued %d", v.Lock, v.Queued)
	}
	h.run()
	x, w := h.result(10), h.result(20)
	if x.Outcome != Succeeded {
		t.Fatalf("X %+v\n%s", x, h.trace())
	}
	if w.Outcome != Refused || w.Reason != ReasonLocked || w.Blocker != x.Req {
		t.Fatalf("W %+v, want refused locked by %s\n%s", w, x.Req, h.trace())
	}
	h.assertClean(1, 2, 4, 5)
}

// §3.2: if X's own request is refused, the request it blocked goes on.
func TestContentionReleasedGoesOn(t *testing.T) {
	h := newHarness(t, 5)
	h.chain([]int{1, 2, 3, 4, 5}, nil)
	h.reconfigure(3, 5, nil, 30) // Y: locks [3..5]
	h.reconfigure(2, 4, nil, 20) // X: blocked at 3 by Y, then refused
	h.reconfigure(1, 3, nil, 10) // W: blocked at 2 by X, then goes on
	h.run()
	y, x, w := h.result(30), h.result(20), h.result(10)
	if y.Outcome != Succeeded || w.Outcome != Succeeded {
		t.Fatalf("Y %+v W %+v\n%s", y, w, h.trace())
	}
	if x.Outcome != Refused || x.Reason != ReasonLocked || x.Blocker != y.Req {
		t.Fatalf("X %+v\n%s", x, h.trace())
	}
	if _, r := h.peers(1); r != addr(3) {
		t.Errorf("1's right peer %s", r)
	}
	if _, r := h.peers(3); r != addr(5) {
		t.Errorf("3's right peer %s", r)
	}
	h.assertClean(1, 3, 5)
}

// An operator request at an agent whose right subsession is lockPending
// for a request passing through waits like a blocked request.
func TestLocalRequestQueued(t *testing.T) {
	h := newHarness(t, 5)
	h.chain([]int{1, 2, 3, 4, 5}, nil)
	h.reconfigure(1, 4, nil, 1)
	h.step() // 2 forwards: lockPending
	h.reconfigure(2, 5, nil, 2)
	if v, _ := h.view(2); v.Queued != 1 {
		t.Fatalf("local request not queued: %+v", v)
	}
	h.run()
	a, b := h.result(1), h.result(2)
	if a.Outcome != Succeeded || b.Outcome != Refused || b.Reason != ReasonLocked || b.Blocker != a.Req {
		t.Fatalf("%+v %+v\n%s", a, b, h.trace())
	}
	// Once the lock holder is gone, refusals are immediate and clear.
	h.reconfigure(1, 1, nil, 3)
	if r := h.result(3); r.Outcome != Refused || r.Reason != ReasonInvalid {
		t.Fatalf("%+v", r)
	}
}

// §3.2: the right anchor is not on the path: refused, every lock released.
func TestNotOnPath(t *testing.T) {
	h := newHarness(t, 9)
	h.chain([]int{1, 2, 3}, nil)
	h.reconfigure(1, 9, nil, 1)
	h.run()
	if r := h.result(1); r.Outcome != Refused || r.Reason != ReasonNotOnPath {
		t.Fatalf("%+v\n%s", r, h.trace())
	}
	h.assertClean(1, 2, 3)
}

// §3.6: the new path cannot be set up (a dead middlebox): the SYN times
// out, cancelLock releases every lock, the session stays on the old path.
func TestSetupFailsCancels(t *testing.T) {
	h := newHarness(t, 7)
	h.chain([]int{1, 2, 3, 4}, nil)
	h.dead[addr(6)] = true
	h.reconfigure(1, 4, []int{5, 6}, 1)
	h.run()
	r := h.result(1)
	if r.Outcome != Failed || r.Reason != ReasonSetupFailed {
		t.Fatalf("%+v\n%s", r, h.trace())
	}
	h.assertClean(1, 2, 3, 4)
	if _, rp := h.peers(1); rp != addr(2) {
		t.Errorf("session left the old path: right peer %s", rp)
	}
	if ids := h.agents[addr(5)].Sessions(); len(ids) != 0 {
		t.Errorf("middlebox 5 of the failed path keeps %v", ids)
	}
	// The segment can be reconfigured again.
	delete(h.dead, addr(6))
	h.reconfigure(1, 4, []int{5, 6}, 2)
	h.run()
	if r := h.result(2); r.Outcome != Succeeded {
		t.Fatalf("retry %+v\n%s", r, h.trace())
	}
}

// Lost messages are retransmitted with back-off; duplicates and
// reordering are harmless.
func TestLossAndDuplicates(t *testing.T) {
	for _, tc := range []struct {
		name string
		drop func(n int, e envelope) bool
		dup  bool
	}{
		{"lose first ackLock", func(n int, e envelope) bool { return e.msg.Type == MsgAckLock && n < 2 }, false},
		{"lose first synAck", func(n int, e envelope) bool { return e.msg.Type == MsgSynAck && n < 1 }, false},
		{"lose every ack", func(n int, e envelope) bool { return e.msg.Type == MsgAck }, false},
		{"lose first fins", func(n int, e envelope) bool { return e.msg.Type == MsgFin && n < 3 }, false},
		{"duplicate everything", nil, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, 6)
			h.chain([]int{1, 2, 3, 4}, map[int]AppDelta{2: {Right: Delta{Seq: 5}}, 3: {Left: Delta{Seq: 9}}})
			h.reconfigure(1, 4, []int{6}, 1)
			h.runLossy(tc.drop, tc.dup)
			if r := h.result(1); r.Outcome != Succeeded {
				t.Fatalf("%+v\n%s", r, h.trace())
			}
			h.assertClean(1, 4, 6)
			for _, r := range h.rejected {
				if r.Reason != RejectUnexpected && r.Reason != RejectUnknownSession {
					t.Errorf("rejected %+v", r)
				}
			}
		})
	}
}

// TCP FIN/RST in the middle of a reconfiguration: the agents that see the
// session end drop everything; the left anchor reports it.
func TestSessionEndDuringReconfiguration(t *testing.T) {
	h := newHarness(t, 4)
	h.chain([]int{1, 2, 3, 4}, nil)
	h.reconfigure(1, 4, nil, 1)
	h.step()
	h.step() // requestLock at 3, lockPending at 2 and 3
	for i := 1; i <= 4; i++ {
		h.deliver(addr(i), SessionEnd{Session: sid, Cause: "rst"})
	}
	h.run()
	if r := h.result(1); r.Outcome != Failed || r.Reason != ReasonSessionEnded {
		t.Fatalf("%+v", r)
	}
	for i := 1; i <= 4; i++ {
		if ids := h.agents[addr(i)].Sessions(); len(ids) != 0 {
			t.Errorf("agent %d keeps %v", i, ids)
		}
	}
	if len(h.timers) != 0 {
		t.Errorf("timers left: %v", h.timers)
	}
}

// §3.5: the UDP FIN waits for oldSentAcked = oldSent, the FIN-ACK for
// oldRcvdAcked = oldRcvd and the other anchor's cut-off (carried in its FIN
// and translated by the deltas).
func TestTeardownWaitsForOldPath(t *testing.T) {
	h := newHarness(t, 3)
	h.chain([]int{1, 2, 3}, map[int]AppDelta{2: {Right: Delta{Seq: 1000}, Left: Delta{Seq: neg(-200)}}})
	h.holdVars = true
	h.reconfigure(1, 3, nil, 1)
	h.runMessages() // lock, SYN, SYN-ACK, ACK: both anchors switched
	if len(h.starts[addr(1)]) != 1 || len(h.starts[addr(3)]) != 1 {
		t.Fatalf("starts %v %v\n%s", h.starts[addr(1)], h.starts[addr(3)], h.trace())
	}
	// Left anchor: sent up to 500, acked 400; received up to 7000 (its
	// space), acked all. Right anchor: sent up to 7200 (its space), all
	// acked; received 1400 (= 400 + 1000), acked 1400.
	left := TwoPath{OldSent: 500, OldSentAcked: 400, OldRcvd: 7000, OldRcvdAcked: 7000}
	right := TwoPath{OldSent: 7200, OldSentAcked: 7200, OldRcvd: 1400, OldRcvdAcked: 1400}
	h.deliver(addr(1), TwoPathProgress{Session: sid, Side: SideRight, Vars: left})
	h.deliver(addr(3), TwoPathProgress{Session: sid, Side: SideLeft, Vars: right})
	// Only the right anchor's sending is done: one FIN, leftward, cut-off
	// 7200, the new path being direct, first a copy on it (to the left
	// anchor), then on the old path (to the middlebox).
	if len(h.queue) != 2 {
		t.Fatalf("queue %v", h.queue)
	}
	for i, to := range []netip.Addr{addr(1), addr(2)} {
		if m := h.queue[i].msg; m.Type != MsgFin || m.Delta.Seq != 7200 || h.queue[i].to != to {
			t.Fatalf("fin %d: %+v to %s, want cut-off 7200 to %s", i, m, h.queue[i].to, to)
		}
	}
	h.runMessages()
	// 7200 - 200 = 7000 = oldRcvd: the left anchor answers.
	if v, _ := h.view(1); !v.Left.FinAckSent {
		t.Fatalf("left anchor did not answer the FIN\n%s", h.trace())
	}
	// The rest of the left anchor's old data arrives and is acked: the
	// right anchor got 1500, acked 1500.
	left.OldSentAcked = 500
	h.deliver(addr(1), TwoPathProgress{Session: sid, Side: SideRight, Vars: left})
	// The FIN (cut-off 500) reaches 3 on both paths: 500 + 1000 = 1500 ≠
	// oldRcvd 1400: no answer yet.
	h.runMessages()
	if v, _ := h.view(3); v.Right == nil || v.Right.FinAckSent {
		t.Fatalf("right anchor answered early\n%s", h.trace())
	}
	right.OldRcvd, right.OldRcvdAcked = 1500, 1500
	h.deliver(addr(3), TwoPathProgress{Session: sid, Side: SideLeft, Vars: right})
	h.run()
	if r := h.result(1); r.Outcome != Succeeded {
		t.Fatalf("%+v\n%s", r, h.trace())
	}
	if _, ok := h.view(2); ok {
		t.Error("middlebox not freed")
	}
}

// The enumerations the Promela model mirrors have distinct paper names.
func TestEnumerationsNamed(t *testing.T) {
	seen := map[string]bool{}
	var names []string
	for _, m := range MsgTypes {
		names = append(names, m.String())
	}
	for _, l := range LockStates {
		names = append(names, l.String())
	}
	for _, s := range Stages {
		names = append(names, s.String())
	}
	for _, r := range RejectReasons {
		names = append(names, r.String())
	}
	for _, n := range names {
		if seen[n] || strings.Contains(n, "-") {
			t.Errorf("name %q repeated or unnamed", n)
		}
		seen[n] = true
	}
	want := "requestLock ackLock nackLock cancelLock ackCancel syn synAck ack fin finAck trigger triggerResult migrate migrateAnswer rebind rebindAck unlocked lockPending locked"
	if got := strings.Join(names[:19], " "); got != want {
		t.Errorf("names %q, want %q", got, want)
	}
}

// §3.5, a liveness gap found by the Promela model (docs/verification.md):
// when every copy of one anchor's fin is lost, that anchor gives up and
// completes Unconfirmed; the other one, its own fin answered, must not wait
// in the two-path phase for ever. It asks again (the fin as a probe); the
// completed anchor's tomb answers with its fin (FlagDone), or, once the tomb
// is gone, nobody answers and it completes Unconfirmed too.
func TestOtherAnchorsFinLost(t *testing.T) {
	for _, tc := range []struct {
		name string
		drop func(e envelope) bool
		// the right anchor completes Unconfirmed
		unconfirmed bool
	}{
		{"tomb answers", func(e envelope) bool {
			return e.msg.Type == MsgFin && e.from == addr(1) && e.msg.Flags&FlagDone == 0
		}, false},
		{"nobody answers", func(e envelope) bool {
			return e.msg.Type == MsgFin && e.from == addr(1)
		}, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, 4)
			h.chain([]int{1, 2, 3, 4}, map[int]AppDelta{2: {Right: Delta{Seq: 5}}, 3: {Left: Delta{Seq: 9}}})
			h.reconfigure(1, 4, nil, 1)
			h.runLossy(func(_ int, e envelope) bool { return tc.drop(e) }, false)
			if len(h.queue) != 0 || len(h.timers) != 0 {
				t.Fatalf("no quiescence: %d queued, timers %v\n%s", len(h.queue), h.timers, h.trace())
			}
			if r := h.result(1); r.Outcome != Succeeded || !r.Unconfirmed {
				t.Fatalf("left anchor: %+v\n%s", r, h.trace())
			}
			h.assertClean(1, 2, 3, 4)
			for _, m := range []int{2, 3} {
				// With the fin exchange finished the middleboxes leave the
				// session; without, only their lock leases end (the
				// datapath's idle timeout frees the rest).
				if _, ok := h.view(m); ok && !tc.unconfirmed {
					t.Errorf("middlebox %d keeps the session\n%s", m, h.trace())
				}
			}
			done := ""
			for _, l := range h.log {
				if strings.HasPrefix(l, addr(4).String()+" ") && strings.Contains(l, " "+StageDone.String()) {
					done = l
				}
			}
			if done == "" {
				t.Fatalf("right anchor never completed\n%s", h.trace())
			}
			if got := strings.HasSuffix(done, "unconfirmed"); got != tc.unconfirmed {
				t.Errorf("right anchor: %q, want unconfirmed=%v\n%s", done, tc.unconfirmed, h.trace())
			}
		})
	}
}

// §3.5 completion on a direct new path: the anchors' fins and finAcks also
// go on the new subsession, straight to the other anchor, so both anchors
// complete with their fins confirmed while the old path's copies are still
// on their way; those copies then tear the old path down (the middle agent
// passes them and the tombs answer), with nothing rejected on the way.
func TestFinOnDirectNewPath(t *testing.T) {
	for _, lose := range []bool{false, true} {
		t.Run(map[bool]string{false: "old path late", true: "old path lost"}[lose], func(t *testing.T) {
			testFinOnDirectNewPath(t, lose)
		})
	}
}

// With lose, what was held on the old path is lost instead of late: the
// tombs send their fins there again (TimerOldFin) until the old path
// answers, so that its middle agent still sees the finAcks both ways.
func testFinOnDirectNewPath(t *testing.T, lose bool) {
	h := newHarness(t, 3)
	h.chain([]int{1, 2, 3}, map[int]AppDelta{2: {Right: Delta{Seq: 1000}}})
	h.reconfigure(1, 3, nil, 1)
	// Lock, SYN, SYN-ACK and ACK, until the first fins are sent.
	for !h.queued(MsgFin) {
		if !h.step() {
			t.Fatalf("no fin\n%s", h.trace())
		}
	}
	// Deliver only what goes between the anchors; hold the old path.
	var held []envelope
	for len(h.queue) > 0 {
		e := h.queue[0]
		h.queue = h.queue[1:]
		if e.to == addr(2) || e.from == addr(2) {
			held = append(held, e)
			continue
		}
		if (e.msg.Type == MsgFin || e.msg.Type == MsgFinAck) && (e.to == addr(1) || e.to == addr(3)) {
			if e.msg.Sub != h.adds[addr(1)][0].Sub {
				t.Fatalf("%s between the anchors on %s, not on the new subsession %s", e.msg.Type, e.msg.Sub, h.adds[addr(1)][0].Sub)
			}
		}
		h.deliver(e.to, MessageIn{From: e.from, Data: e.data})
	}
	if r := h.result(1); r.Outcome != Succeeded || r.Unconfirmed {
		t.Fatalf("with the old path held: %+v\n%s", r, h.trace())
	}
	if v, ok := h.view(3); !ok || v.Right != nil {
		t.Fatalf("the right anchor did not complete: %+v\n%s", v, h.trace())
	}
	if len(held) == 0 {
		t.Fatalf("nothing went on the old path\n%s", h.trace())
	}
	// Now the old path, and the fins' retransmissions whichever way.
	if !lose {
		h.queue = append(held, h.queue...)
	}
	h.run()
	if _, ok := h.view(2); ok || len(h.frees[addr(2)]) != 1 {
		t.Fatalf("the old path's middlebox keeps the session (frees %v)\n%s", h.frees[addr(2)], h.trace())
	}
	if len(h.rejected) != 0 {
		t.Fatalf("rejected %+v\n%s", h.rejected, h.trace())
	}
	h.assertClean(1, 3)
}

// An old path's middle agent that passed both anchors' fins but never a
// finAck (every copy lost on its way to it) leaves the session when its
// lease expires: both anchors had everything they sent on the old path
// acknowledged, so nothing more crosses it. One that saw the fin of one
// anchor only keeps the session (unlocked): the other anchor may still
// send on the old path. Seen in TestControlLoss: the middlebox kept the
// session until its idle timeout.
func TestOldPathMiddleFreedByLease(t *testing.T) {
	for _, tc := range []struct {
		name  string
		lose  func(e envelope) bool
		freed bool
	}{
		{"finAcks lost", func(e envelope) bool { return e.msg.Type == MsgFinAck && e.to == addr(2) }, true},
		{"leftward fins lost", func(e envelope) bool {
			return e.msg.Type == MsgFin && e.to == addr(2) && e.msg.Flags&FlagLeftward != 0
		}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, 3)
			h.chain([]int{1, 2, 3}, nil)
			h.reconfigure(1, 3, nil, 1)
			h.runLossy(func(_ int, e envelope) bool { return tc.lose(e) }, false)
			if r := h.result(1); r.Outcome != Succeeded {
				t.Fatalf("%+v\n%s", r, h.trace())
			}
			h.assertClean(1, 3)
			v, kept := h.view(2)
			if tc.freed {
				if kept || len(h.frees[addr(2)]) != 1 {
					t.Fatalf("the old path's middlebox keeps the session (frees %v)\n%s", h.frees[addr(2)], h.trace())
				}
				if !strings.Contains(h.trace(), "old path torn down (finAcks lost)") {
					t.Fatalf("freed, but not by the lease\n%s", h.trace())
				}
				return
			}
			if !kept || len(h.frees[addr(2)]) != 0 {
				t.Fatalf("the middlebox left the session with one anchor's fin unseen (frees %v)\n%s", h.frees[addr(2)], h.trace())
			}
			if v.Lock != Unlocked {
				t.Fatalf("lock %s by %s after the lease\n%s", v.Lock, v.Requestor, h.trace())
			}
		})
	}
}

// A new path through a middlebox carries no copies: the fins go on the old
// path only.
func TestFinNotCopiedThroughMiddlebox(t *testing.T) {
	h := newHarness(t, 4)
	h.chain([]int{1, 2, 4}, nil)
	h.reconfigure(1, 4, []int{3}, 1)
	for !h.queued(MsgFin) {
		if !h.step() {
			t.Fatalf("no fin\n%s", h.trace())
		}
	}
	h.run()
	if r := h.result(1); r.Outcome != Succeeded || r.Unconfirmed {
		t.Fatalf("%+v\n%s", r, h.trace())
	}
	for _, l := range h.log {
		if strings.Contains(l, "-> 10.0.0.3 fin") || strings.Contains(l, "10.0.0.3 -> 10.0.0.") && strings.Contains(l, " fin") {
			t.Fatalf("a fin through the new path's middlebox: %s\n%s", l, h.trace())
		}
	}
}

// A request whose right anchor or new hops are not unicast addresses of the
// agent's family is refused at once as invalid: the messages it would send
// are ones every peer's Decode refuses as malformed.
func TestReconfigureBadAddresses(t *testing.T) {
	for i, c := range []struct {
		name  string
		ra    netip.Addr
		chain []netip.Addr
	}{
		{"anchor of the other family", netip.MustParseAddr("fd00::3"), nil},
		{"hop of the other family", addr(3), []netip.Addr{netip.MustParseAddr("fd00::2")}},
		{"multicast anchor", netip.MustParseAddr("224.0.0.1"), nil},
		{"unspecified hop", addr(3), []netip.Addr{netip.IPv4Unspecified()}},
		{"loopback hop", addr(3), []netip.Addr{netip.MustParseAddr("127.0.0.2")}},
	} {
		t.Run(c.name, func(t *testing.T) {
			h := newHarness(t, 3)
			h.chain([]int{1, 2, 3}, nil)
			tok := uint64(i + 1)
			h.deliver(addr(1), Reconfigure{Session: sid, RightAnchor: c.ra, Chain: c.chain, Token: tok})
			h.run()
			if r := h.result(tok); r.Outcome != Refused || r.Reason != ReasonInvalid {
				t.Fatalf("%+v\n%s", r, h.trace())
			}
			h.assertClean(1, 2, 3)
		})
	}
}
