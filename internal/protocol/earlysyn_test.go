package protocol

import (
	"net/netip"
	"testing"
	"time"

	"github.com/dysco/dysco/internal/wire"
)

// ownSubs counts the subsessions agent i maps to sessions other than its
// sides' (new paths, early SYNs' subsessions, tombs).
func (h *harness) ownSubs(i int) int {
	a := h.agents[addr(i)]
	n := 0
	for t, r := range a.subs {
		s := a.sessions[r.id]
		if s == nil || (s.sides[SideLeft] == nil || s.sides[SideLeft].Sub != t) &&
			(s.sides[SideRight] == nil || s.sides[SideRight].Sub != t) {
			n++
		}
	}
	return n
}

// A delete (direct new path): the SYN goes beside requestLock, the right
// anchor answers it when it grants the lock, and the left anchor switches
// when the lock is held, with no second SYN.
func TestEarlySynDirect(t *testing.T) {
	h := newHarness(t, 3)
	h.chain([]int{1, 2, 3}, nil)
	h.reconfigure(1, 3, nil, 1)
	if !h.queued(MsgSyn) || !h.queued(MsgRequestLock) {
		t.Fatalf("after the trigger: want requestLock and the early SYN queued\n%s", h.trace())
	}
	h.step() // requestLock reaches 2
	h.step() // the SYN reaches 3 first: kept
	if n := len(h.agents[addr(3)].earlySyns); n != 1 || len(h.adds[addr(3)]) != 0 {
		t.Fatalf("right anchor: %d early SYNs kept, %d subsessions added\n%s", n, len(h.adds[addr(3)]), h.trace())
	}
	h.run()
	if r := h.result(1); r.Outcome != Succeeded {
		t.Fatalf("%+v\n%s", r, h.trace())
	}
	if n := h.sent[addr(1)][MsgSyn]; n != 1 {
		t.Fatalf("left anchor sent %d SYNs, want 1\n%s", n, h.trace())
	}
	if n := len(h.agents[addr(3)].earlySyns); n != 0 {
		t.Fatalf("right anchor still keeps %d early SYNs", n)
	}
	if len(h.starts[addr(1)]) != 1 || len(h.starts[addr(3)]) != 1 {
		t.Fatalf("switches: left %d, right %d\n%s", len(h.starts[addr(1)]), len(h.starts[addr(3)]), h.trace())
	}
	h.assertClean(1, 3)
}

// The early SYN lost: TimerSyn sends it again once the left anchor holds
// the lock. Overtaken by requestLock and ackLock: the left anchor waits
// for its SYN-ACK, which comes, and sends no second SYN.
func TestEarlySynLostOrLate(t *testing.T) {
	for _, how := range []string{"lost", "late"} {
		t.Run(how, func(t *testing.T) {
			h := newHarness(t, 3)
			h.chain([]int{1, 2, 3}, nil)
			h.reconfigure(1, 3, nil, 1)
			if how == "lost" {
				h.dropType(MsgSyn, addr(3))
			} else {
				// requestLock, then ackLock, overtake it.
				h.stepType(MsgRequestLock, addr(2))
				h.stepType(MsgRequestLock, addr(3))
				h.stepType(MsgAckLock, addr(2))
				h.stepType(MsgAckLock, addr(1))
			}
			h.run()
			if r := h.result(1); r.Outcome != Succeeded {
				t.Fatalf("%+v\n%s", r, h.trace())
			}
			want := map[string]int{"lost": 2, "late": 1}[how]
			if n := h.sent[addr(1)][MsgSyn]; n != want {
				t.Fatalf("left anchor sent %d SYNs, want %d\n%s", n, want, h.trace())
			}
			if len(h.adds[addr(3)]) != 1 {
				t.Fatalf("right anchor added %d subsessions, want 1\n%s", len(h.adds[addr(3)]), h.trace())
			}
			h.assertClean(1, 3)
		})
	}
}

// A request refused on the old path leaves no subsession behind at its
// left anchor; its early SYN stays at the right anchor, unused, until it
// expires.
func TestEarlySynRefused(t *testing.T) {
	h := newHarness(t, 5)
	h.chain([]int{1, 2, 3, 4, 5}, nil)
	h.reconfigure(2, 4, nil, 10)
	h.reconfigure(1, 3, nil, 20)
	h.run()
	if w := h.result(20); w.Outcome != Refused {
		t.Fatalf("%+v\n%s", w, h.trace())
	}
	if n := h.ownSubs(1); n != 0 {
		t.Fatalf("the refused left anchor keeps %d subsessions", n)
	}
	if n := len(h.agents[addr(3)].earlySyns); n != 1 {
		t.Fatalf("agent 3 keeps %d early SYNs, want the refused request's", n)
	}
	h.assertClean(1, 2, 4, 5)
}

// The right anchor keeps at most maxEarlySyns early SYNs; expired ones make
// room.
func TestEarlySynBounded(t *testing.T) {
	h := newHarness(t, 3)
	h.chain([]int{1, 2, 3}, nil)
	a := h.agents[addr(3)]
	syn := func(id uint32) {
		m := &Message{Type: MsgSyn, Nonce: testNonce, Session: sessionTuple,
			Sub: wire.Tuple{Src: addr(1), Dst: addr(3), SrcPort: 40000, DstPort: 80},
			Req: ReqKey{LeftAnchor: addr(1), ID: id}, RightAnchor: addr(3)}
		b, err := m.Encode(testKey, addr(1))
		if err != nil {
			t.Fatal(err)
		}
		h.deliver(addr(3), MessageIn{From: addr(1), Data: b})
	}
	for i := range maxEarlySyns {
		syn(uint32(1000 + i))
	}
	if len(a.earlySyns) != maxEarlySyns || len(h.rejected) != 0 {
		t.Fatalf("%d kept, %d rejected", len(a.earlySyns), len(h.rejected))
	}
	syn(999999)
	if len(a.earlySyns) != maxEarlySyns || len(h.rejected) != 1 || h.rejected[0].Reason != RejectUnexpected {
		t.Fatalf("full store: %d kept, rejected %+v", len(a.earlySyns), h.rejected)
	}
	h.now += a.cfg.LockLease
	syn(999999)
	if len(a.earlySyns) != 1 || len(h.rejected) != 1 {
		t.Fatalf("after expiry: %d kept, %d rejected", len(a.earlySyns), len(h.rejected))
	}
}

// An early SYN replayed after its request finished, or sent twice while it
// is kept, is refused and counted, and nothing answers it (replay.go).
func TestEarlySynReplayed(t *testing.T) {
	for _, first := range []string{"syn", "requestLock"} {
		t.Run(first+" first", func(t *testing.T) {
			h := newHarness(t, 3)
			h.chain([]int{1, 2, 3}, nil)
			h.reconfigure(1, 3, nil, 1)
			var syn envelope
			for _, e := range h.queue {
				if e.msg.Type == MsgSyn && e.to == addr(3) {
					syn = e
				}
			}
			if syn.msg == nil {
				t.Fatalf("no early SYN queued\n%s", h.trace())
			}
			again := func() {
				h.deliver(addr(3), MessageIn{From: syn.from, Data: syn.data})
			}
			if first == "syn" {
				h.stepType(MsgSyn, addr(3))
				again() // a duplicate of the kept SYN
				if n := len(h.agents[addr(3)].earlySyns); n != 1 || len(h.rejected) != 1 || h.rejected[0].Reason != RejectUnexpected {
					t.Fatalf("duplicate while kept: %d kept, rejected %+v\n%s", n, h.rejected, h.trace())
				}
				h.rejected = nil
			}
			h.run()
			if r := h.result(1); r.Outcome != Succeeded {
				t.Fatalf("%+v\n%s", r, h.trace())
			}
			h.assertClean(1, 3)
			sent := h.sent[addr(3)][MsgSynAck]
			// While the session lives its subsession is the new path's:
			// a duplicate SYN of a finished exchange (onSynDup).
			again()
			if len(h.rejected) != 1 || h.rejected[0].Reason != RejectUnexpected {
				t.Fatalf("replayed during the session: rejected %+v\n%s", h.rejected, h.trace())
			}
			// Once it has ended nothing names the subsession: only the
			// request's window tells.
			h.rejected = nil
			h.deliver(addr(3), SessionEnd{Session: sid, Cause: "fin"})
			for range 2 {
				again()
			}
			if len(h.rejected) != 2 || h.rejected[0].Reason != RejectReplay || h.rejected[1].Reason != RejectReplay {
				t.Fatalf("replayed twice after the end: rejected %+v\n%s", h.rejected, h.trace())
			}
			if n := len(h.agents[addr(3)].earlySyns); n != 0 || len(h.queue) != 0 || h.sent[addr(3)][MsgSynAck] != sent {
				t.Fatalf("replay kept (%d) or answered (%d queued)\n%s", n, len(h.queue), h.trace())
			}
		})
	}
}

func TestReqWindow(t *testing.T) {
	var w reqWindow
	w.top = 99
	for _, id := range []uint32{100, 105, 103} {
		w.mark(id)
	}
	for id, want := range map[uint32]bool{100: true, 101: false, 103: true, 104: false, 105: true, 106: false} {
		if got := w.known(id); got != want {
			t.Errorf("known(%d) = %v, want %v", id, got, want)
		}
	}
	// Slide by less than the window: marks within it stay; by more: the
	// old ones are older than the window, hence known.
	w.mark(105 + reqWindowBits - 2)
	if !w.known(105) || w.known(104) || !w.known(103) {
		t.Errorf("after a short slide: 103 %v, 104 %v, 105 %v", w.known(103), w.known(104), w.known(105))
	}
	w.mark(10 * reqWindowBits)
	if !w.known(105) || !w.known(10*reqWindowBits-reqWindowBits) || w.known(10*reqWindowBits-1) || w.known(10*reqWindowBits+1) {
		t.Errorf("after a long slide to %d: known(105) %v, known(%d) %v, known(%d) %v, known(%d) %v; want true, true, false, false",
			10*reqWindowBits, w.known(105), 9*reqWindowBits, w.known(9*reqWindowBits),
			10*reqWindowBits-1, w.known(10*reqWindowBits-1), 10*reqWindowBits+1, w.known(10*reqWindowBits+1))
	}
	// A slot reused a lap later is cleared by the slide.
	w = reqWindow{top: 999}
	w.mark(1000)
	w.mark(1000 + reqWindowBits - 1)
	w.mark(1000 + reqWindowBits + 5)
	if w.known(1000+reqWindowBits) || !w.known(1000) {
		t.Errorf("a slot of the previous lap: known(%d) %v, known(1000) %v", 1000+reqWindowBits, w.known(1000+reqWindowBits), w.known(1000))
	}
}

// The windows are bounded: the left anchor heard of least recently goes.
func TestReqWindowsBounded(t *testing.T) {
	a := New(DefaultConfig(addr(1), testKey))
	for i := range maxReqWindows {
		a.now = time.Duration(i+1) * time.Millisecond
		a.heardOf(ReqKey{LeftAnchor: netip.AddrFrom4([4]byte{10, 1, byte(i >> 8), byte(i)}), ID: 5})
	}
	first := ReqKey{LeftAnchor: netip.AddrFrom4([4]byte{10, 1, 0, 0}), ID: 5}
	a.now += time.Millisecond
	a.heardOf(first) // heard of again: now the most recent
	a.heardOf(ReqKey{LeftAnchor: addr(200), ID: 7})
	if len(a.reqWindows) != maxReqWindows || !a.knownReq(first) || !a.knownReq(ReqKey{LeftAnchor: addr(200), ID: 7}) {
		t.Fatalf("%d windows; first known %v", len(a.reqWindows), a.knownReq(first))
	}
	if a.knownReq(ReqKey{LeftAnchor: netip.AddrFrom4([4]byte{10, 1, 0, 1}), ID: 5}) {
		t.Fatal("the least recent anchor was not forgotten")
	}
}
