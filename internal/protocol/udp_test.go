package protocol

import (
	"testing"
	"time"
)

// chainUDP is chain for a UDP session.
func (h *harness) chainUDP(ids []int) {
	for i, id := range ids {
		up := SessionUp{Session: sid, Tuple: sessionTuple, Nonce: testNonce, Proto: ProtoUDP}
		if i > 0 {
			up.Left = &SideInfo{Peer: addr(ids[i-1]), Sub: subTuple(ids[i-1], id)}
		}
		if i < len(ids)-1 {
			up.Right = &SideInfo{Peer: addr(ids[i+1]), Sub: subTuple(id, ids[i+1])}
		}
		h.deliver(addr(id), up)
	}
}

// quietAt returns when agent i's TimerQuiet fires, if set.
func (h *harness) quietAt(i int) (time.Duration, bool) {
	for k, at := range h.timers {
		if k.agent == addr(i) && k.id.Kind == TimerQuiet {
			return at, true
		}
	}
	return 0, false
}

func (h *harness) stage(i int, left bool) Stage {
	v, ok := h.view(i)
	if !ok {
		return 0
	}
	if left && v.Left != nil {
		return v.Left.Stage
	}
	if !left && v.Right != nil {
		return v.Right.Stage
	}
	return StageDone
}

// A UDP delete: each anchor switches (StartTwoPath, no clamp, no delta),
// sends nothing more until its old path has been quiet for the drain
// time, and the old path goes only when both have ended their sides.
func TestUDPSwitchAndDrain(t *testing.T) {
	h := newHarness(t, 3)
	h.chainUDP([]int{1, 2, 3})
	h.reconfigure(1, 3, nil, 1)
	h.runMessages()
	for _, i := range []int{1, 3} {
		if len(h.starts[addr(i)]) != 1 {
			t.Fatalf("agent %d started %d two-path phases\n%s", i, len(h.starts[addr(i)]), h.trace())
		}
		if len(h.clamps[addr(i)]) != 0 {
			t.Fatalf("agent %d clamped a UDP session's window: %v", i, h.clamps[addr(i)])
		}
		if at, ok := h.quietAt(i); !ok || at != h.now+500*time.Millisecond {
			t.Fatalf("agent %d: quiet timer %v %v, want at the drain time", i, at, ok)
		}
		for _, add := range h.adds[addr(i)] {
			if add.Delta != (Delta{}) {
				t.Fatalf("agent %d: a UDP subsession with a delta %v", i, add.Delta)
			}
		}
	}
	if h.sent[addr(1)][MsgFin]+h.sent[addr(3)][MsgFin] != 0 {
		t.Fatalf("a fin before the drain time\n%s", h.trace())
	}
	// Both paths are the session's during the phase.
	v1, _ := h.view(1)
	if _, _, ok := h.agents[addr(1)].Lookup(v1.Sides[SideRight].Sub); !ok {
		t.Fatal("the old subsession is not the session's during the phase")
	}
	if _, _, ok := h.agents[addr(1)].Lookup(v1.Left.NewSub); !ok {
		t.Fatal("the new subsession is not the session's during the phase")
	}
	h.run()
	r := h.result(1)
	if r.Outcome != Succeeded || r.Unconfirmed {
		t.Fatalf("result %s %s unconfirmed=%v\n%s", r.Outcome, r.Reason, r.Unconfirmed, h.trace())
	}
	if len(h.frees[addr(2)]) != 1 {
		t.Fatalf("agent 2 freed %v, want the session once\n%s", h.frees[addr(2)], h.trace())
	}
	for _, i := range []int{1, 3} {
		if len(h.ends[addr(i)]) != 1 {
			t.Fatalf("agent %d ended %d two-path phases", i, len(h.ends[addr(i)]))
		}
	}
	if v, _ := h.view(1); v.Proto != ProtoUDP || v.Lock != Unlocked || v.Sides[SideRight].Peer != addr(3) {
		t.Fatalf("agent 1 after: %+v", v)
	}
}

// A datagram on the old path restarts the drain time of that side only;
// the other side ends, but nothing is torn down (no EndTwoPath, no free
// at the middle agent) until both have.
func TestUDPTeardownAfterBothSides(t *testing.T) {
	h := newHarness(t, 3)
	h.chainUDP([]int{1, 2, 3})
	h.reconfigure(1, 3, nil, 1)
	h.runMessages()
	start := h.now
	h.now = start + 400*time.Millisecond
	h.deliver(addr(3), TwoPathProgress{Session: sid, Side: SideLeft, Vars: TwoPath{OldDgrams: 1}})
	if at, _ := h.quietAt(3); at != h.now+500*time.Millisecond {
		t.Fatalf("agent 3's quiet timer at %v, want %v", at, h.now+500*time.Millisecond)
	}
	// The same count again: nothing new arrived.
	h.now = start + 450*time.Millisecond
	h.deliver(addr(3), TwoPathProgress{Session: sid, Side: SideLeft, Vars: TwoPath{OldDgrams: 1}})
	if at, _ := h.quietAt(3); at != start+900*time.Millisecond {
		t.Fatalf("agent 3's quiet timer moved to %v on an unchanged count", at)
	}
	h.fireNext() // agent 1 quiet at 500 ms: its fin
	if h.now != start+500*time.Millisecond || h.sent[addr(1)][MsgFin] == 0 {
		t.Fatalf("agent 1 did not end its side at the drain time (now %v)\n%s", h.now-start, h.trace())
	}
	h.runMessages()
	if h.sent[addr(3)][MsgFinAck] == 0 {
		t.Fatalf("agent 3 did not answer agent 1's fin at once\n%s", h.trace())
	}
	if len(h.ends[addr(1)])+len(h.ends[addr(3)])+len(h.frees[addr(2)]) != 0 || h.sent[addr(3)][MsgFin] != 0 {
		t.Fatalf("torn down before agent 3's side ended\n%s", h.trace())
	}
	if h.stage(1, true) != StageTwoPath {
		t.Fatalf("agent 1 left the phase in stage %s", h.stage(1, true))
	}
	for h.sent[addr(3)][MsgFin] == 0 && h.now <= start+900*time.Millisecond && h.fireNext() { // agent 3 quiet at 900 ms (agent 1 probes meanwhile)
	}
	if h.now != start+900*time.Millisecond || h.sent[addr(3)][MsgFin] == 0 {
		t.Fatalf("agent 3 did not end its side at 900 ms (now %v)\n%s", h.now-start, h.trace())
	}
	h.run()
	if r := h.result(1); r.Outcome != Succeeded || r.Unconfirmed {
		t.Fatalf("result %s %s\n%s", r.Outcome, r.Reason, h.trace())
	}
	if len(h.frees[addr(2)]) != 1 {
		t.Fatalf("agent 2 not freed\n%s", h.trace())
	}
}

// A middlebox inserted into a UDP session joins it as UDP (the SYN
// carries the transport) and is ready to anchor at once (no marks).
func TestUDPInsertJoin(t *testing.T) {
	h := newHarness(t, 3)
	h.chainUDP([]int{1, 3})
	h.reconfigure(1, 3, []int{2}, 1)
	h.run()
	if r := h.result(1); r.Outcome != Succeeded {
		t.Fatalf("result %s %s\n%s", r.Outcome, r.Reason, h.trace())
	}
	j := h.joins[addr(2)]
	if len(j) != 1 || j[0].Proto != ProtoUDP {
		t.Fatalf("joins at agent 2: %+v", j)
	}
	ids := h.agents[addr(2)].Sessions()
	if len(ids) != 1 {
		t.Fatalf("agent 2 has %d sessions", len(ids))
	}
	// Agent 2 anchors a delete of nothing at once: ready without traffic.
	h.deliver(addr(2), Reconfigure{Session: ids[0], RightAnchor: addr(3), Token: 2})
	if r := h.result(2); r.Outcome != Succeeded || !r.Unchanged {
		t.Fatalf("joined UDP session as anchor: %s %s", r.Outcome, r.Reason)
	}
}

// The ACK lost: the right anchor keeps sending on the old path. Once the
// drain time has passed since the left anchor's switch and its old path
// still hears datagrams, it sends the ACK again, and the right anchor
// switches.
func TestUDPLostAck(t *testing.T) {
	h := newHarness(t, 3)
	h.chainUDP([]int{1, 2, 3})
	h.reconfigure(1, 3, nil, 1)
	for !h.queued(MsgAck) {
		if !h.step() {
			t.Fatalf("no ACK\n%s", h.trace())
		}
	}
	h.dropType(MsgAck, addr(3))
	h.runMessages()
	if h.stage(3, false) != StageWaitAck {
		t.Fatalf("agent 3 in stage %s, want waitAck", h.stage(3, false))
	}
	start := h.now
	for i := 1; i <= 3; i++ { // datagrams keep coming on agent 1's old path
		h.now = start + time.Duration(i)*300*time.Millisecond
		h.deliver(addr(1), TwoPathProgress{Session: sid, Side: SideRight, Vars: TwoPath{OldDgrams: uint64(i)}})
	}
	if h.sent[addr(1)][MsgAck] != 2 {
		t.Fatalf("agent 1 sent the ACK %d times, want again once after the drain time\n%s", h.sent[addr(1)][MsgAck], h.trace())
	}
	h.runMessages()
	if h.stage(3, false) != StageTwoPath {
		t.Fatalf("agent 3 in stage %s after the ACK again", h.stage(3, false))
	}
	h.run()
	if r := h.result(1); r.Outcome != Succeeded || r.Unconfirmed {
		t.Fatalf("result %s %s\n%s", r.Outcome, r.Reason, h.trace())
	}
}

// The session ends at the left anchor during the UDP phase: the request
// fails, its timers go, and the middleboxes of the new path are told.
func TestUDPSessionEndsDuringPhase(t *testing.T) {
	h := newHarness(t, 4)
	h.chainUDP([]int{1, 2, 3})
	h.reconfigure(1, 3, []int{4}, 1)
	h.runMessages()
	if h.stage(1, true) != StageTwoPath {
		t.Fatalf("agent 1 in stage %s", h.stage(1, true))
	}
	h.deliver(addr(1), SessionEnd{Session: sid, Cause: "idle"})
	if r := h.result(1); r.Outcome != Failed || r.Reason != ReasonSessionEnded {
		t.Fatalf("result %s %s", r.Outcome, r.Reason)
	}
	if _, ok := h.quietAt(1); ok {
		t.Fatal("agent 1 keeps its quiet timer")
	}
	if !h.queued(MsgCancelLock) {
		t.Fatalf("no cancelLock on the new path\n%s", h.trace())
	}
	h.runMessages()
	if n := len(h.agents[addr(4)].Sessions()); n != 0 {
		t.Fatalf("the joined middlebox keeps %d sessions\n%s", n, h.trace())
	}
}

// Cancelled before the switch (the SYN unanswered): the UDP session never
// left the old path, and the locks are released, as for TCP.
func TestUDPCancelBeforeSwitch(t *testing.T) {
	h := newHarness(t, 4)
	h.chainUDP([]int{1, 2, 3})
	h.dead[addr(4)] = true
	h.reconfigure(1, 3, []int{4}, 1)
	h.run()
	if r := h.result(1); r.Outcome != Failed || r.Reason != ReasonSetupFailed {
		t.Fatalf("result %s %s\n%s", r.Outcome, r.Reason, h.trace())
	}
	for _, i := range []int{1, 2} {
		if v, _ := h.view(i); v.Lock != Unlocked {
			t.Fatalf("agent %d still %s", i, v.Lock)
		}
	}
	if len(h.starts[addr(1)]) != 0 {
		t.Fatal("agent 1 switched")
	}
}

// The drain time is bounded, and the fault that ignores it ends a side at
// its switch.
func TestUDPDrainConfig(t *testing.T) {
	cfg := DefaultConfig(addr(1), testKey)
	cfg.UDPDrain = time.Hour
	if a := New(cfg); a.cfg.UDPDrain != MaxUDPDrain {
		t.Fatalf("drain %v, want the bound %v", a.cfg.UDPDrain, MaxUDPDrain)
	}
	cfg.UDPDrain = 0
	if a := New(cfg); a.cfg.UDPDrain != 500*time.Millisecond {
		t.Fatalf("default drain %v", a.cfg.UDPDrain)
	}
	h := newHarness(t, 3)
	for _, a := range h.agents {
		a.cfg.Faults |= FaultUDPNoQuiet
	}
	h.chainUDP([]int{1, 2, 3})
	h.reconfigure(1, 3, nil, 1)
	h.runMessages()
	if h.sent[addr(1)][MsgFin] == 0 {
		t.Fatalf("with the fault, agent 1 did not end its side at its switch\n%s", h.trace())
	}
}

// Messages of a UDP session say so; TCP ones do not change.
func TestUDPMessageProto(t *testing.T) {
	m := Message{Type: MsgSyn, Sub: subTuple(1, 2), Session: sessionTuple, Req: ReqKey{LeftAnchor: addr(1), ID: 1},
		RightAnchor: addr(3), Hops: nil, WScale: 14, Proto: ProtoUDP}
	m.Hops = append(m.Hops, addr(3))
	b, err := m.Encode(testKey, addr(1))
	if err != nil {
		t.Fatal(err)
	}
	d, err := Decode(testKey, addr(1), b)
	if err != nil {
		t.Fatal(err)
	}
	if d.Proto != ProtoUDP || d.WScale != 14 {
		t.Fatalf("decoded proto %s wscale %d", d.Proto, d.WScale)
	}
	m.Proto = ProtoTCP
	b, _ = m.Encode(testKey, addr(1))
	if d, _ := Decode(testKey, addr(1), b); d.Proto != ProtoTCP || d.WScale != 14 {
		t.Fatalf("decoded proto %s wscale %d", d.Proto, d.WScale)
	}
}
