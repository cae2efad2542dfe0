package protocol

import (
	"bytes"
	"errors"
	"net/netip"
	"reflect"
	"testing"
)

// Triggers (trigger.go, §2.3): a middlebox asks the left neighbour of a
// session to reconfigure as left anchor, and gets the result.

// trigger has agent at send a trigger for the test session, to the right
// anchor ra through chain.
func (h *harness) trigger(at, ra int, chain []int, token uint64, mig *MigrateSpec) {
	var c []netip.Addr
	for _, x := range chain {
		c = append(c, addr(x))
	}
	h.deliver(addr(at), Trigger{Session: sid, Token: token, RightAnchor: addr(ra), Chain: c, Migrate: mig})
}

// trigResult returns the TriggerResult of token, failing if there is not
// exactly one.
func (h *harness) trigResult(token uint64) TriggerResult {
	h.t.Helper()
	var out []TriggerResult
	for _, r := range h.trigResults {
		if r.Token == token {
			out = append(out, r)
		}
	}
	if len(out) != 1 {
		h.t.Fatalf("%d trigger results for token %d, want one\n%s", len(out), token, h.trace())
	}
	return out[0]
}

// queuedMsg returns the first queued message of type t to to.
func (h *harness) queuedMsg(t MsgType, to netip.Addr) envelope {
	h.t.Helper()
	for _, e := range h.queue {
		if e.msg.Type == t && e.to == to {
			return e
		}
	}
	h.t.Fatalf("no %s queued for %s\n%s", t, to, h.trace())
	return envelope{}
}

// A middlebox asks to be removed (§2.3, §4.2): its left neighbour runs
// the request as left anchor; its Result is marked with the trigger, and
// the answer carries it to the middlebox.
func TestTriggerRemovesSender(t *testing.T) {
	h := newHarness(t, 3)
	h.chain([]int{1, 2, 3}, nil)
	h.trigger(2, 3, nil, 5, nil)
	trig := h.queuedMsg(MsgTrigger, addr(1)).msg
	if trig.Sub != subTuple(1, 2) || trig.Req.LeftAnchor != addr(2) || trig.Nonce != testNonce || trig.RightAnchor != addr(3) {
		t.Fatalf("trigger %s, want one from agent 2 on the subsession from agent 1 with the session's nonce", trig)
	}
	h.run()
	acc := h.trigAccepted[addr(1)]
	if len(acc) != 1 || acc[0].Trigger != trig.Req || acc[0].Token < 1<<63 || acc[0].Migrate != nil {
		t.Fatalf("agent 1 took %+v, want trigger %s once, with a token from 2^63", acc, trig.Req)
	}
	res := h.result(acc[0].Token)
	if res.Outcome != Succeeded || res.Trigger != trig.Req || res.Req.LeftAnchor != addr(1) {
		t.Fatalf("agent 1's result %+v, want succeeded, marked with the trigger", res)
	}
	tr := h.trigResult(5)
	if !tr.Answered || tr.Outcome != Succeeded || tr.Req != res.Req || tr.Trigger != trig.Req || tr.To != addr(1) {
		t.Fatalf("agent 2's trigger result %+v, want the answer with agent 1's request %s", tr, res.Req)
	}
	if v, _ := h.view(1); v.Sides[SideRight].Peer != addr(3) {
		t.Fatalf("agent 1 sends to %s, want agent 3", v.Sides[SideRight].Peer)
	}
	if _, ok := h.view(2); ok {
		t.Fatalf("agent 2 keeps the session after it left the path")
	}
	if len(h.agents[addr(2)].triggers) != 0 {
		t.Fatalf("agent 2 keeps %d triggers", len(h.agents[addr(2)].triggers))
	}
}

// Duplicates (§3.6): a copy of a trigger while its request runs gets an
// acknowledgement, one after it ended the same answer; it never starts a
// second request. An answer lost comes again with the next retransmission.
func TestTriggerDuplicates(t *testing.T) {
	h := newHarness(t, 4)
	h.chain([]int{1, 2, 3}, nil)
	h.trigger(2, 3, []int{4}, 6, nil)
	e := h.queuedMsg(MsgTrigger, addr(1))
	h.stepType(MsgTrigger, addr(1))
	// A copy while the request runs: acknowledged.
	h.deliver(addr(1), MessageIn{From: addr(2), Data: e.data})
	ack := h.queuedMsg(MsgTriggerResult, addr(2)).msg
	if ack.Answer.Outcome != 0 || ack.Req != e.msg.Req {
		t.Fatalf("answer to a copy while running: %s, want an acknowledgement", ack)
	}
	// The final answer is lost; the sender's retransmission gets it again.
	var first *Message
	for first == nil {
		for i, q := range h.queue {
			if q.msg.Type == MsgTriggerResult && q.msg.Answer.Outcome != 0 {
				first = q.msg
				h.queue = append(h.queue[:i:i], h.queue[i+1:]...)
				h.log = append(h.log, "lost: "+q.msg.String())
				break
			}
		}
		if first == nil && !h.step() {
			t.Fatalf("no final answer\n%s", h.trace())
		}
	}
	if len(h.trigResults) != 0 {
		t.Fatalf("a result before the answer came\n%s", h.trace())
	}
	for len(h.trigResults) == 0 {
		if !h.step() && !h.fireNext() {
			t.Fatalf("no result\n%s", h.trace())
		}
	}
	tr := h.trigResult(6)
	if !tr.Answered || tr.Outcome != first.Answer.Outcome || tr.Req.ID != first.Answer.ReqID {
		t.Fatalf("result %+v, want the lost answer %s", tr, first)
	}
	if n := len(h.trigAccepted[addr(1)]); n != 1 {
		t.Fatalf("agent 1 took the trigger %d times, want once", n)
	}
	if h.sent[addr(2)][MsgTrigger] < 2 {
		t.Fatalf("agent 2 sent its trigger %d times, want a retransmission", h.sent[addr(2)][MsgTrigger])
	}
	// A copy after the end: the same answer (the old subsession lingers
	// at agent 1, §3.5), no new request.
	h.deliver(addr(1), MessageIn{From: addr(2), Data: e.data})
	again := h.queuedMsg(MsgTriggerResult, addr(2)).msg
	if !reflect.DeepEqual(again, first) {
		t.Fatalf("answer to a late copy\n got %s\nwant %s", again, first)
	}
	h.run() // the sender no longer waits: refused as unexpected
	if n := len(h.trigAccepted[addr(1)]); n != 1 || len(h.trigResults) != 1 {
		t.Fatalf("agent 1 took the trigger %d times, agent 2 has %d results", n, len(h.trigResults))
	}
}

// Replays (replay.go): a trigger not in the session's history whose number
// is known, or older than the sender's window, is refused and not
// answered; so is one for a session that ended here, once answered.
func TestTriggerReplay(t *testing.T) {
	h := newHarness(t, 3)
	h.chain([]int{1, 2, 3}, nil)
	h.agents[addr(2)].nextReq = 5000
	h.trigger(2, 3, nil, 7, nil)
	e := h.queuedMsg(MsgTrigger, addr(1))
	h.stepType(MsgTrigger, addr(1))
	forge := func(id uint32) []byte {
		m := *e.msg
		m.Req.ID = id
		b, err := m.Encode(testKey, addr(2))
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	for _, id := range []uint32{5001 - reqWindowBits - 1, 4000} {
		// 4000 is within the window but never heard of: it is new.
		h.rejected = nil
		n := len(h.queue)
		h.deliver(addr(1), MessageIn{From: addr(2), Data: forge(id)})
		if id == 4000 {
			if len(h.trigAccepted[addr(1)]) != 1 || len(h.queue) != n+1 {
				t.Fatalf("trigger #%d within the window: queue %d -> %d\n%s", id, n, len(h.queue), h.trace())
			}
			if a := h.queue[n].msg; a.Type != MsgTriggerResult || a.Reason != ReasonBusy {
				t.Fatalf("trigger #%d while #5001 runs: %s, want refused busy", id, a)
			}
			continue
		}
		if len(h.rejected) != 1 || h.rejected[0].Reason != RejectReplay || len(h.queue) != n {
			t.Fatalf("trigger #%d below the window: rejected %+v, queue %d -> %d", id, h.rejected, n, len(h.queue))
		}
	}
	h.run()
	// The session ends at agent 1: a copy of a trigger it heard of is a
	// replay there now.
	h.deliver(addr(1), SessionEnd{Session: sid})
	h.rejected = nil
	h.deliver(addr(1), MessageIn{From: addr(2), Data: e.data, Gone: true})
	if len(h.rejected) != 1 || h.rejected[0].Reason != RejectReplay || len(h.queue) != 0 {
		t.Fatalf("replay after the session ended: rejected %+v, queued %d", h.rejected, len(h.queue))
	}
	// A new trigger for it is answered once: the session ended.
	h.rejected = nil
	b := forge(6000)
	h.deliver(addr(1), MessageIn{From: addr(2), Data: b, Gone: true})
	if len(h.queue) != 1 || h.queue[0].msg.Reason != ReasonSessionEnded || h.queue[0].msg.Answer.Outcome != Refused {
		t.Fatalf("a new trigger for an ended session: %v\n%s", h.queue, h.trace())
	}
	h.queue = nil
	h.deliver(addr(1), MessageIn{From: addr(2), Data: b, Gone: true})
	if len(h.queue) != 0 || h.rejected[len(h.rejected)-1].Reason != RejectReplay {
		t.Fatalf("its copy: answered %v, rejected %+v", h.queue, h.rejected)
	}
}

// A trigger from a middlebox that a reconfiguration took out of the path
// (§3.5: its old subsession lingers at the left neighbour) is refused: the
// sender is no longer the session's next hop.
func TestTriggerNotNextHop(t *testing.T) {
	h := newHarness(t, 3)
	h.chain([]int{1, 2, 3}, nil)
	h.reconfigure(1, 3, nil, 1)
	h.runMessages()
	if r := h.result(1); r.Outcome != Succeeded {
		t.Fatalf("delete: %s %s", r.Outcome, r.Reason)
	}
	if _, ok := h.view(2); !ok {
		t.Fatal("agent 2 left before its linger")
	}
	h.trigger(2, 3, nil, 8, nil)
	h.runMessages()
	tr := h.trigResult(8)
	if !tr.Answered || tr.Outcome != Refused || tr.Reason != ReasonNotNextHop || !tr.Req.IsZero() {
		t.Fatalf("trigger from a host off the path: %+v, want refused, not the next hop", tr)
	}
	if len(h.trigAccepted[addr(1)]) != 0 {
		t.Fatal("agent 1 started a request for it")
	}
}

// Refusals by the left neighbour: a side in a reconfiguration answers
// busy (naming it); a trigger on a subsession that does not lead to its
// sender is refused so; one whose number is not its sender's is not
// answered.
func TestTriggerRefusals(t *testing.T) {
	h := newHarness(t, 5)
	h.chain([]int{1, 2, 3}, nil)
	h.reconfigure(1, 3, []int{4}, 1)
	h.step() // requestLock to 2
	h.trigger(2, 3, nil, 9, nil)
	h.stepType(MsgTrigger, addr(1))
	h.stepType(MsgTriggerResult, addr(2))
	tr := h.trigResult(9)
	if tr.Outcome != Refused || tr.Reason != ReasonBusy || tr.Blocker.LeftAnchor != addr(1) {
		t.Fatalf("trigger while agent 1 reconfigures: %+v, want refused busy", tr)
	}
	h.run()

	// Agent 5 names agent 1's subsession to the right (now to agent 4),
	// with its nonce.
	v, _ := h.view(1)
	if v.Sides[SideRight].Peer != addr(4) {
		t.Fatalf("agent 1 sends to %s, want agent 4", v.Sides[SideRight].Peer)
	}
	m := &Message{Type: MsgTrigger, Nonce: v.Sides[SideRight].Nonce, Sub: v.Sides[SideRight].Sub, Session: sessionTuple,
		Req: ReqKey{LeftAnchor: addr(5), ID: 1}, RightAnchor: addr(3)}
	b, _ := m.Encode(testKey, addr(5))
	h.queue = nil
	h.deliver(addr(1), MessageIn{From: addr(5), Data: b})
	if len(h.queue) != 1 || h.queue[0].to != addr(5) || h.queue[0].msg.Reason != ReasonWrongSender {
		t.Fatalf("a trigger from a host the subsession does not lead to: %v\n%s", h.queue, h.trace())
	}
	// Its number names another sender: refused, not answered.
	m.Req.ID = 2
	b, _ = m.Encode(testKey, addr(4))
	h.queue, h.rejected = nil, nil
	h.deliver(addr(1), MessageIn{From: addr(4), Data: b})
	if len(h.queue) != 0 || len(h.rejected) != 1 || h.rejected[0].Reason != RejectWrongPeer {
		t.Fatalf("a trigger numbered by another host: answered %v, rejected %+v", h.queue, h.rejected)
	}
	if n := len(h.trigAccepted[addr(1)]); n != 0 {
		t.Fatalf("agent 1 took %d triggers", n)
	}
}

// The sender: a session with no left side, or a request its left neighbour
// could not take, is refused at once; a dead left neighbour means no
// answer after MaxTries transmissions; answers not from the left
// neighbour, or with another nonce, are refused.
func TestTriggerSender(t *testing.T) {
	h := newHarness(t, 4)
	h.chain([]int{1, 2, 3}, nil)
	h.trigger(1, 3, nil, 1, nil) // the first agent has no left side
	h.trigger(2, 1, nil, 2, nil) // the left neighbour as right anchor
	h.trigger(2, 3, []int{4, 4}, 3, nil)
	h.trigger(2, 3, []int{4, 3}, 4, nil)
	h.trigger(2, 3, nil, 5, &MigrateSpec{}) // a migration replaces one middlebox by one
	for tok, want := range map[uint64]Reason{1: ReasonNoSession, 2: ReasonInvalid, 3: ReasonInvalid, 4: ReasonInvalid, 5: ReasonInvalid} {
		if tr := h.trigResult(tok); tr.Answered || tr.Outcome != Refused || tr.Reason != want {
			t.Errorf("trigger %d: %+v, want refused here: %s", tok, tr, want)
		}
	}
	if len(h.queue) != 0 {
		t.Fatalf("refused triggers were sent")
	}

	h.trigger(2, 3, nil, 6, nil)
	e := h.queuedMsg(MsgTrigger, addr(1))
	answer := &Message{Type: MsgTriggerResult, Nonce: testNonce, Sub: subTuple(1, 2), Session: sessionTuple, Req: e.msg.Req,
		RightAnchor: addr(3), Answer: &TriggerAnswer{Outcome: Succeeded}}
	for _, tc := range []struct {
		from netip.Addr
		edit func(m *Message)
		want RejectReason
	}{
		{addr(4), func(*Message) {}, RejectWrongPeer},
		{addr(1), func(m *Message) { m.Nonce[0] ^= 1 }, RejectNonce},
		{addr(1), func(m *Message) { m.Sub = subTuple(1, 3) }, RejectUnexpected},
		{addr(1), func(m *Message) { m.Req.ID++ }, RejectUnexpected},
	} {
		m := *answer
		tc.edit(&m)
		b, _ := m.Encode(testKey, tc.from) // a key holder at tc.from
		h.rejected = nil
		h.deliver(addr(2), MessageIn{From: tc.from, Data: b})
		if len(h.rejected) != 1 || h.rejected[0].Reason != tc.want {
			t.Errorf("answer %s from %s: rejected %+v, want %s", &m, tc.from, h.rejected, tc.want)
		}
	}
	if len(h.trigResults) != 5 {
		t.Fatalf("a forged answer ended the trigger")
	}

	h.dead[addr(1)] = true
	h.queue = nil
	h.run()
	tr := h.trigResult(6)
	if tr.Answered || tr.Outcome != Failed || tr.Reason != ReasonNoAnswer || tr.To != addr(1) {
		t.Fatalf("no left neighbour: %+v, want failed, no answer", tr)
	}
	if n := h.sent[addr(2)][MsgTrigger]; n != DefaultConfig(addr(2), testKey).MaxTries {
		t.Fatalf("agent 2 sent its trigger %d times, want MaxTries", n)
	}
}

// A trigger asking for a state migration: the left neighbour's request is
// gated, its agent hears of it first (TriggerAccepted, then NewPathReady
// with the same token), and the report it gives with Proceed comes back
// in the answer.
func TestTriggerMigrationReport(t *testing.T) {
	h := newHarness(t, 4)
	h.chain([]int{1, 2, 3}, nil)
	spec := &MigrateSpec{Semantics: MigrateSubstream, HoldLimit: 1 << 20, TimeoutMS: 3000}
	h.trigger(2, 3, []int{4}, 10, spec)
	h.runMessages()
	acc := h.trigAccepted[addr(1)]
	ready := h.ready[addr(1)]
	if len(acc) != 1 || !reflect.DeepEqual(acc[0].Migrate, spec) || len(ready) != 1 || ready[0].Token != acc[0].Token {
		t.Fatalf("accepted %+v, new path ready %+v: want the spec, then the gate with the same token", acc, ready)
	}
	done := h.migDone[addr(1)]
	if len(done) != 1 || done[0].Err != "" || string(done[0].State) != "state of "+addr(2).String() {
		t.Fatalf("migration done %+v, want the state of agent 2 moved", done)
	}
	report := []byte(`{"semantics":"substream","state_bytes":42}`)
	h.deliver(addr(1), Proceed{Session: sid, Req: ready[0].Req, Report: report})
	h.run()
	tr := h.trigResult(10)
	if tr.Outcome != Succeeded || !bytes.Equal(tr.Report, report) {
		t.Fatalf("answer %+v, want succeeded with the report", tr)
	}
}

// The extension body (version 4): its layout is checked exactly.
func TestMessageExtension(t *testing.T) {
	trig := sampleOf(MsgTrigger, sampleMessage())
	ans := sampleOf(MsgTriggerResult, sampleMessage())
	enc := func(m *Message) []byte {
		b, err := m.Encode(testKey, testFrom)
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	ext := func(b []byte, m *Message) int { return len(b) - MACLen - extLen(t, m) }
	tb, ab := enc(&trig), enc(&ans)
	edit := func(src []byte, fn func(b []byte)) []byte {
		b := append([]byte(nil), src...)
		fn(b)
		return remac(b)
	}
	for _, tc := range []struct {
		name string
		b    []byte
		ok   bool
	}{
		{"trigger with a spec", tb, true},
		{"answer with a report", ab, true},
		{"extension version", edit(tb, func(b []byte) { b[ext(b, &trig)] = 2 }), false},
		{"answer's kind on a trigger", edit(tb, func(b []byte) { b[ext(b, &trig)+1] = ExtAnswer }), false},
		{"unknown semantics", edit(tb, func(b []byte) { b[ext(b, &trig)+2] = 4 }), false},
		{"reserved byte", edit(tb, func(b []byte) { b[ext(b, &trig)+3] = 1 }), false},
		{"hold limit", edit(tb, func(b []byte) { b[ext(b, &trig)+4] = 0x80 }), false},
		{"unknown outcome", edit(ab, func(b []byte) { b[ext(b, &ans)+2] = 4 }), false},
		{"unknown answer flag", edit(ab, func(b []byte) { b[ext(b, &ans)+3] = 8 }), false},
		{"report longer than the body", edit(ab, func(b []byte) { b[ext(b, &ans)+33]++ }), false},
		{"report shorter than the body", edit(ab, func(b []byte) { b[ext(b, &ans)+33]-- }), false},
		{"length beyond the message", edit(ab, func(b []byte) { b[155]++ }), false},
		{"no extension on an answer", func() []byte {
			m := ans
			m.Answer = nil
			return enc(&m)
		}(), false},
		{"a reason only the sender gives", edit(ab, func(b []byte) { b[7] = byte(ReasonNoAnswer) }), false},
		{"flags on a trigger", edit(tb, func(b []byte) { b[6] = FlagLeftward }), false},
		{"a trigger with a reason", edit(tb, func(b []byte) { b[7] = byte(ReasonBusy) }), false},
		{"hops on an answer", func() []byte {
			m := ans
			m.Hops = []netip.Addr{addr(5)}
			return enc(&m)
		}(), false},
		{"an extension on a requestLock", func() []byte {
			m := sampleOf(MsgRequestLock, sampleMessage())
			m.Migrate = &MigrateSpec{}
			return enc(&m)
		}(), false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			m, err := Decode(testKey, testFrom, tc.b)
			if tc.ok {
				if err != nil {
					t.Fatal(err)
				}
				if m.Type == MsgTrigger && !reflect.DeepEqual(m, &trig) || m.Type == MsgTriggerResult && !reflect.DeepEqual(m, &ans) {
					t.Fatalf("round trip: %+v", m)
				}
				return
			}
			var de *DecodeError
			if !errors.As(err, &de) || de.Reason != RejectMalformed {
				t.Fatalf("got %v, want malformed", err)
			}
		})
	}
	// Version 3 (no triggers) is another version; so is a JSON trigger's
	// magic another protocol.
	old := append([]byte(nil), tb...)
	old[4] = 3
	if _, err := Decode(testKey, testFrom, remac(old)); !isReject(err, RejectVersion) {
		t.Errorf("version 3: %v, want bad version", err)
	}
	if _, err := Decode(testKey, testFrom, append([]byte("DYST\x01\x01{}"), make([]byte, MACLen)...)); !isReject(err, RejectMagic) {
		t.Errorf("a JSON trigger: %v, want bad magic", err)
	}
	// A report too long for one datagram is not encoded.
	long := ans
	long.Answer = &TriggerAnswer{Outcome: Failed, Report: make([]byte, MaxReportLen+1)}
	if _, err := long.Encode(testKey, testFrom); !errors.Is(err, ErrExtTooLong) {
		t.Errorf("a report of %d bytes: %v", MaxReportLen+1, err)
	}
}

func isReject(err error, r RejectReason) bool {
	var de *DecodeError
	return errors.As(err, &de) && de.Reason == r
}
