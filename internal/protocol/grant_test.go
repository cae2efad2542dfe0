package protocol

import (
	"testing"
)

// The granting SYN-ACK (synAckMsg): on a direct new path the right anchor's
// answer to the early SYN grants the lock with the leftDelta that
// requestLock gathered on its way, so the left anchor switches one hop
// after the grant, before the ackLock has come back along the old path.
// Its leftDelta is the one the ackLock brings (here with a middlebox that
// changes the stream both ways), and the late ackLock is not a refusal.
func TestGrantingSynAck(t *testing.T) {
	app := map[int]AppDelta{2: {Right: Delta{Seq: 1000, TS: 7}, Left: Delta{Seq: neg(-200), TS: 3}}}
	for _, first := range []MsgType{MsgSynAck, MsgAckLock} {
		t.Run("first "+first.String(), func(t *testing.T) {
			h := newHarness(t, 3)
			h.chain([]int{1, 2, 3}, app)
			h.reconfigure(1, 3, nil, 1)
			h.stepType(MsgSyn, addr(3))         // kept
			h.stepType(MsgRequestLock, addr(2)) // pending at 2
			h.stepType(MsgRequestLock, addr(3)) // granted: ackLock to 2, synAck to 1
			var grant *Message
			for _, e := range h.queue {
				if e.msg.Type == MsgSynAck && e.to == addr(1) {
					grant = e.msg
				}
			}
			want := Delta{Seq: neg(-200), TS: 3} // what 2 adds to the stream towards 1
			if grant == nil || grant.Flags&FlagGrant == 0 || grant.Delta != want {
				t.Fatalf("the right anchor's synAck %v, want a grant with leftDelta %s\n%s", grant, want, h.trace())
			}
			if first == MsgSynAck {
				h.stepType(MsgSynAck, addr(1))
				if len(h.starts[addr(1)]) != 1 {
					t.Fatalf("the left anchor did not switch on the granting synAck\n%s", h.trace())
				}
				if v, _ := h.view(2); v.Lock != LockPending {
					t.Fatalf("the middle agent is %s before its ackLock, want lockPending", v.Lock)
				}
			} else {
				h.stepType(MsgAckLock, addr(2))
				h.stepType(MsgAckLock, addr(1)) // granted: waits for the synAck
				if len(h.starts[addr(1)]) != 0 {
					t.Fatalf("the left anchor switched before the new path answered\n%s", h.trace())
				}
				h.stepType(MsgSynAck, addr(1))
				if len(h.starts[addr(1)]) != 1 {
					t.Fatalf("the left anchor did not switch on the synAck after the ackLock\n%s", h.trace())
				}
			}
			if got := h.adds[addr(1)][0].Delta; got != want {
				t.Fatalf("the left anchor's new subsession has delta %s, want %s", got, want)
			}
			h.run()
			if r := h.result(1); r.Outcome != Succeeded {
				t.Fatalf("%+v\n%s", r, h.trace())
			}
			if len(h.rejected) != 0 {
				t.Fatalf("rejected %+v\n%s", h.rejected, h.trace())
			}
			if _, ok := h.view(2); ok {
				t.Errorf("the middlebox keeps the session\n%s", h.trace())
			}
			h.assertClean(1, 3)
		})
	}
}

// A middle agent whose ackLock is lost is locked by the anchors' fins: they
// come only once the request was granted (passOldPath), and the left
// anchor, granted by the synAck, does not ask again. The request it had
// queued meanwhile is refused then, as an ackLock would have refused it.
func TestMiddleLockedByFin(t *testing.T) {
	h := newHarness(t, 4)
	h.chain([]int{1, 2, 3, 4}, nil)
	h.reconfigure(1, 4, nil, 1)
	h.stepType(MsgSyn, addr(4))
	h.stepType(MsgRequestLock, addr(2))
	h.stepType(MsgRequestLock, addr(3))
	// 2 wants 2..4 while its lock is pending for 1's request: its own
	// request waits in its queue.
	h.reconfigure(2, 4, nil, 2)
	if v, _ := h.view(2); v.Queued != 1 {
		t.Fatalf("agent 2 queued %d requests, want 1\n%s", v.Queued, h.trace())
	}
	h.stepType(MsgRequestLock, addr(4))
	h.dropType(MsgAckLock, addr(3)) // neither 3 nor 2 gets it
	h.run()
	if r := h.result(1); r.Outcome != Succeeded {
		t.Fatalf("request 1: %+v\n%s", r, h.trace())
	}
	if r := h.result(2); r.Outcome != Refused || r.Reason != ReasonLocked {
		t.Fatalf("request 2: %+v, want refused (locked)\n%s", r, h.trace())
	}
	if len(h.rejected) != 0 {
		t.Fatalf("rejected %+v\n%s", h.rejected, h.trace())
	}
	for _, id := range []int{2, 3} {
		if _, ok := h.view(id); ok {
			t.Errorf("middlebox %d keeps the session\n%s", id, h.trace())
		}
	}
	h.assertClean(1, 4)
}

// A right anchor still completing a reconfiguration of its left side
// refuses a request that reaches it on the new subsession (onNewSub), and
// keeps that refusal: a copy of the request that comes after it completed
// gets the same answer. Granted, its synAck would tell the request's left
// anchor that it holds a segment whose middle agents let the request go
// when the refusal passed them (the simulation found this).
func TestNewSubRefusalKept(t *testing.T) {
	h := newHarness(t, 4)
	h.chain([]int{1, 2, 3, 4}, nil)
	// runHolding delivers every message but finAcks to 4 (which would
	// let 4 complete), and keeps a copy of the first requestLock of
	// agent 1 to 4.
	var held []envelope
	var dup *envelope
	runHolding := func() {
		for len(h.queue) > 0 {
			e := h.queue[0]
			h.queue = h.queue[1:]
			if e.msg.Type == MsgFinAck && e.to == addr(4) {
				held = append(held, e)
				continue
			}
			if e.msg.Type == MsgRequestLock && e.to == addr(4) && e.msg.Req.LeftAnchor == addr(1) && dup == nil {
				c := e
				dup = &c
			}
			h.deliver(e.to, MessageIn{From: e.from, Data: e.data})
		}
	}
	h.reconfigure(2, 4, nil, 1) // delete 3
	runHolding()
	if r := h.result(1); r.Outcome != Succeeded {
		t.Fatalf("2..4: %+v\n%s", r, h.trace())
	}
	if v, _ := h.view(4); v.Right == nil {
		t.Fatalf("4 completed although its finAcks were held\n%s", h.trace())
	}
	h.reconfigure(1, 4, nil, 2) // delete 2: refused by 4, still completing
	runHolding()
	if r := h.result(2); r.Outcome != Refused || r.Reason != ReasonBusy {
		t.Fatalf("1..4: %+v, want refused (busy)\n%s", r, h.trace())
	}
	if dup == nil {
		t.Fatalf("request 2 never reached 4\n%s", h.trace())
	}
	h.queue = append(h.queue, held...)
	h.runMessages()
	if v, _ := h.view(4); v.Right != nil {
		t.Fatalf("4 did not complete 2..4\n%s", h.trace())
	}
	before := h.sent[addr(4)][MsgNackLock]
	h.deliver(dup.to, MessageIn{From: dup.from, Data: dup.data})
	if v, _ := h.view(4); v.Right != nil || h.sent[addr(4)][MsgNackLock] != before+1 {
		t.Fatalf("4 answered a copy of the refused request otherwise than with a nackLock (right %v)\n%s", v.Right, h.trace())
	}
}

// A right anchor whose agent restarts after it granted, before its ackLock
// and granting synAck left, does not grant when a copy of the early SYN
// reaches the restarted agent: the leftDelta went with the old agent, and
// a grant with none would give the left anchor a wrong delta (the reviewer
// of the granting SYN-ACK found this). The left anchor's retransmitted
// requestLock brings the ackLock, with the leftDelta the middle agent adds.
func TestResumedRightAnchorDoesNotGrant(t *testing.T) {
	app := map[int]AppDelta{2: {Right: Delta{Seq: 1000, TS: 7}, Left: Delta{Seq: neg(-200), TS: 3}}}
	h := newHarness(t, 3)
	h.chain([]int{1, 2, 3}, app)
	h.reconfigure(1, 3, nil, 1)
	var syn *envelope
	for _, e := range h.queue {
		if e.msg.Type == MsgSyn && e.to == addr(3) {
			c := e
			syn = &c
		}
	}
	if syn == nil {
		t.Fatalf("no early SYN queued\n%s", h.trace())
	}
	h.stepType(MsgSyn, addr(3))
	h.stepType(MsgRequestLock, addr(2))
	h.stepType(MsgRequestLock, addr(3)) // granted, installed: ackLock to 2, synAck to 1
	if len(h.adds[addr(3)]) != 1 {
		t.Fatalf("the right anchor did not install the new subsession\n%s", h.trace())
	}
	h.dropType(MsgAckLock, addr(2))
	h.dropType(MsgSynAck, addr(1))
	h.restart(3, 0, false)
	h.deliver(syn.to, MessageIn{From: syn.from, Data: syn.data})
	var answer *Message
	for _, e := range h.queue {
		if e.msg.Type == MsgSynAck && e.to == addr(1) {
			answer = e.msg
		}
	}
	if answer == nil || answer.Flags&FlagGrant != 0 {
		t.Fatalf("the restarted right anchor answered the SYN's copy with %v, want a synAck without the grant\n%s", answer, h.trace())
	}
	h.run()
	if r := h.result(1); r.Outcome != Succeeded {
		t.Fatalf("%+v\n%s", r, h.trace())
	}
	want := Delta{Seq: neg(-200), TS: 3}
	if got := h.adds[addr(1)][0].Delta; got != want {
		t.Fatalf("the left anchor's new subsession has delta %s, want %s\n%s", got, want, h.trace())
	}
	h.assertClean(1, 3)
}
