package protocol

import (
	"testing"

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
		b, err := m.Encode(testKey)
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
