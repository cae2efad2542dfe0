package protocol

import (
	"net/netip"
	"slices"
	"testing"
	"time"
)

// A host holds one datapath state per session tuple, so a middlebox cannot
// be on a session's old and new path at once. These tests cover the two
// places that keep a request from putting one there: the left anchor, which
// compares its new chain with the old segment that the ackLock lists
// (sameOrCrossing), and a host named in the new path, which refuses to join
// a session it carries already (MessageIn.OnPath, refuseSyn).

// quiet checks that nothing is left of a request: no locks, no anchors, no
// cancellations, at any agent of the path.
func (h *harness) quiet(ids ...int) {
	h.t.Helper()
	for _, i := range ids {
		v, ok := h.view(i)
		if !ok {
			h.t.Fatalf("agent %d lost the session\n%s", i, h.trace())
		}
		if v.Lock != Unlocked || v.Left != nil || v.Right != nil || v.Cancels != 0 || v.Queued != 0 {
			h.t.Fatalf("agent %d keeps lock=%s left=%v right=%v cancels=%d queued=%d\n%s",
				i, v.Lock, v.Left, v.Right, v.Cancels, v.Queued, h.trace())
		}
	}
}

func TestAckLockListsOldSegment(t *testing.T) {
	h := newHarness(t, 5)
	h.chain([]int{1, 2, 3, 4, 5}, nil)
	h.reconfigure(1, 5, []int{2, 3, 4}, 1)
	var got *Message
	for h.step() {
		for _, e := range h.queue {
			if e.msg.Type == MsgAckLock && e.to == addr(1) {
				got = e.msg
			}
		}
		if got != nil {
			break
		}
	}
	if got == nil {
		t.Fatalf("no ackLock reached the left anchor\n%s", h.trace())
	}
	if want := addrs(2, 3, 4); !slices.Equal(got.Hops, want) || got.Flags&FlagPartial != 0 {
		t.Fatalf("ackLock lists %v (flags %#x), want %v", got.Hops, got.Flags, want)
	}
}

func TestUnchangedChain(t *testing.T) {
	h := newHarness(t, 4)
	h.chain([]int{1, 2, 3, 4}, nil)
	h.reconfigure(1, 4, []int{2, 3}, 1)
	h.run()
	r := h.result(1)
	if r.Outcome != Succeeded || !r.Unchanged {
		t.Fatalf("result %s %s unchanged=%v, want succeeded unchanged\n%s", r.Outcome, r.Reason, r.Unchanged, h.trace())
	}
	if len(h.joins[addr(2)])+len(h.joins[addr(3)])+len(h.adds[addr(1)])+len(h.adds[addr(4)]) != 0 {
		t.Fatalf("a new path was set up\n%s", h.trace())
	}
	if v, _ := h.view(1); v.Sides[SideRight].Sub != subTuple(1, 2) {
		t.Fatalf("the left anchor's right side moved to %s", v.Sides[SideRight].Sub)
	}
	h.quiet(1, 2, 3, 4)
	// The session can be reconfigured again at once.
	h.reconfigure(1, 4, nil, 2)
	h.run()
	if r := h.result(2); r.Outcome != Succeeded || r.Unchanged {
		t.Fatalf("the delete after it: %s %s unchanged=%v\n%s", r.Outcome, r.Reason, r.Unchanged, h.trace())
	}
}

func TestUnchangedDirectSegment(t *testing.T) {
	h := newHarness(t, 3)
	h.chain([]int{1, 2, 3}, nil)
	h.reconfigure(1, 2, nil, 1)
	if len(h.queue) != 0 {
		t.Fatalf("a delete of nothing sent messages\n%s", h.trace())
	}
	if r := h.result(1); r.Outcome != Succeeded || !r.Unchanged {
		t.Fatalf("result %s %s unchanged=%v, want succeeded unchanged", r.Outcome, r.Reason, r.Unchanged)
	}
	h.quiet(1)
}

func TestChainCrossesOldSegment(t *testing.T) {
	for _, tc := range []struct {
		name  string
		chain []int
		hop   int
	}{
		{"kept-first", []int{2, 5}, 2},
		{"kept-last", []int{5, 3}, 3},
		{"reordered", []int{3, 2}, 3},
		{"one-of-two", []int{2}, 2},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, 5)
			h.chain([]int{1, 2, 3, 4}, nil)
			h.reconfigure(1, 4, tc.chain, 1)
			h.run()
			r := h.result(1)
			if r.Outcome != Refused || r.Reason != ReasonOnPath || r.Hop != addr(tc.hop) {
				t.Fatalf("result %s %s hop %s, want refused on-path %s\n%s", r.Outcome, r.Reason, r.Hop, addr(tc.hop), h.trace())
			}
			for _, i := range []int{2, 3, 5} {
				if len(h.joins[addr(i)]) != 0 {
					t.Fatalf("agent %d joined a new path\n%s", i, h.trace())
				}
			}
			h.quiet(1, 2, 3, 4)
		})
	}
}

// A host of the new path that carries the session already, outside the
// reconfigured segment (the left anchor's list cannot show it), refuses to
// join: the left anchor cancels and the session stays as it was.
func TestJoinRefusedOnPath(t *testing.T) {
	h := newHarness(t, 5)
	h.chain([]int{1, 2, 3, 4}, nil)
	h.reconfigure(3, 4, []int{2}, 1)
	h.run()
	r := h.result(1)
	if r.Outcome != Refused || r.Reason != ReasonOnPath || r.Hop != addr(2) {
		t.Fatalf("result %s %s hop %s, want refused on-path 10.0.0.2\n%s", r.Outcome, r.Reason, r.Hop, h.trace())
	}
	if len(h.joins[addr(2)]) != 0 {
		t.Fatalf("agent 2 joined a new path of a session it carries\n%s", h.trace())
	}
	if v, _ := h.view(3); v.Sides[SideRight].Sub != subTuple(3, 4) {
		t.Fatalf("the left anchor's right side moved to %s", v.Sides[SideRight].Sub)
	}
	h.quiet(1, 2, 3, 4)
	// A SYN of the old path's request retransmitted later gets the same
	// answer: nothing is kept for it.
	if n := len(h.agents[addr(2)].Sessions()); n != 1 {
		t.Fatalf("agent 2 has %d sessions, want its own", n)
	}
}

// A middlebox whose datapath cannot install a joined session (JoinFailed)
// refuses the new path to the left and frees the hosts after it; the
// request fails and nothing is left anywhere.
func TestJoinFailed(t *testing.T) {
	h := newHarness(t, 5)
	h.chain([]int{1, 2, 3}, nil)
	h.reconfigure(1, 3, []int{4, 5}, 1)
	failed := false
	for i := 0; i < 1000 && !failed; i++ {
		if !h.step() {
			break
		}
		if js := h.joins[addr(4)]; len(js) == 1 {
			failed = true
			h.deliver(addr(4), JoinFailed{Session: js[0].Session})
		}
	}
	if !failed {
		t.Fatalf("agent 4 never joined\n%s", h.trace())
	}
	h.run()
	r := h.result(1)
	if r.Outcome != Failed || r.Reason != ReasonSetupFailed {
		t.Fatalf("result %s %s, want failed setup\n%s", r.Outcome, r.Reason, h.trace())
	}
	for _, i := range []int{4, 5} {
		if n := len(h.agents[addr(i)].Sessions()); n != 0 {
			t.Fatalf("agent %d keeps %d sessions\n%s", i, n, h.trace())
		}
	}
	if len(h.frees[addr(5)]) != 1 {
		t.Fatalf("agent 5 was not freed\n%s", h.trace())
	}
	h.quiet(1, 2, 3)
}

// The list stays within the message: a full list is marked partial, and
// the left anchor then goes on (the joining hosts check).
func TestAckLockListPartial(t *testing.T) {
	a := New(DefaultConfig(addr(9), testKey))
	m := &Message{Type: MsgAckLock, Hops: addrs(1, 2, 3, 4, 5, 6, 7, 8)}
	a.listSelf(m)
	if m.Flags&FlagPartial == 0 || len(m.Hops) != 8 {
		t.Fatalf("full list: flags %#x hops %v", m.Flags, m.Hops)
	}
	m = &Message{Type: MsgAckLock, Hops: addrs(1, 9)}
	a.listSelf(m)
	if m.Flags&FlagPartial == 0 || len(m.Hops) != 2 {
		t.Fatalf("a list naming us: flags %#x hops %v", m.Flags, m.Hops)
	}
}

func addrs(ids ...int) []netip.Addr {
	var out []netip.Addr
	for _, i := range ids {
		out = append(out, addr(i))
	}
	return out
}

// FINs that went on the old path: after a reconfiguration through
// middleboxes, each anchor tells the new path's middleboxes what its
// datapath saw (FinsSeen), and they record it (MarkClosed); the other
// anchor drops the notice. A direct new path has no middlebox to tell.
func TestClosedNotice(t *testing.T) {
	h := newHarness(t, 5)
	h.chain([]int{1, 2, 3}, nil)
	h.reconfigure(1, 3, []int{4, 5}, 1)
	h.runMessages() // no timer: the old subsessions still linger
	if r := h.result(1); r.Outcome != Succeeded {
		t.Fatalf("result %s %s\n%s", r.Outcome, r.Reason, h.trace())
	}
	joined := func(i int) SessionID {
		ids := h.agents[addr(i)].Sessions()
		if len(ids) != 1 {
			t.Fatalf("agent %d has sessions %v", i, ids)
		}
		return ids[0]
	}
	marks := map[netip.Addr][]MarkClosed{}
	deliver := func(at int, ev Event) {
		for _, act := range h.agents[addr(at)].Handle(h.now, ev) {
			if m, ok := act.(MarkClosed); ok {
				marks[addr(at)] = append(marks[addr(at)], m)
			}
			h.apply(addr(at), act)
		}
	}
	flush := func() {
		for len(h.queue) > 0 {
			e := h.queue[0]
			h.queue = h.queue[1:]
			deliver(indexOf(e.to), h.messageIn(e))
		}
	}
	deliver(1, FinsSeen{Session: sid, Fwd: true})
	flush()
	// The right anchor's notice names both FINs; the one the left anchor
	// sent already is not sent again.
	deliver(3, FinsSeen{Session: sid, Fwd: true, Rev: true})
	deliver(1, FinsSeen{Session: sid, Fwd: true})
	flush()
	for _, i := range []int{4, 5} {
		want := []MarkClosed{{Session: joined(i), Fwd: true}, {Session: joined(i), Fwd: true, Rev: true}}
		if !slices.Equal(marks[addr(i)], want) {
			t.Fatalf("agent %d recorded %v, want %v\n%s", i, marks[addr(i)], want, h.trace())
		}
	}
	if len(marks[addr(1)])+len(marks[addr(3)]) != 0 || len(h.rejected) != 0 {
		t.Fatalf("the anchors took the notices: %v %v, rejected %v", marks[addr(1)], marks[addr(3)], h.rejected)
	}

	// A delete (direct new path): nothing to tell.
	h2 := newHarness(t, 3)
	h2.chain([]int{1, 2, 3}, nil)
	h2.reconfigure(1, 3, nil, 1)
	h2.runMessages()
	h2.deliver(addr(1), FinsSeen{Session: sid, Fwd: true, Rev: true})
	if len(h2.queue) != 0 {
		t.Fatalf("a closed notice on a direct new path\n%s", h2.trace())
	}
}

func indexOf(a netip.Addr) int { return int(a.As4()[3]) }

// A session that ends while its left anchor sets a new path up frees the
// middleboxes that joined it: nothing else would.
func TestSessionEndFreesNewPath(t *testing.T) {
	h := newHarness(t, 4)
	h.chain([]int{1, 2, 3}, nil)
	h.reconfigure(1, 3, []int{4}, 1)
	for i := 0; i < 100 && len(h.joins[addr(4)]) == 0; i++ {
		if !h.step() {
			break
		}
	}
	if len(h.joins[addr(4)]) != 1 {
		t.Fatalf("agent 4 did not join\n%s", h.trace())
	}
	h.queue = nil // the rest of the set-up is lost
	h.deliver(addr(1), SessionEnd{Session: sid, Cause: "fin"})
	h.runMessages()
	if r := h.result(1); r.Outcome != Failed || r.Reason != ReasonSessionEnded {
		t.Fatalf("result %s %s", r.Outcome, r.Reason)
	}
	if n := len(h.agents[addr(4)].Sessions()); n != 0 || len(h.frees[addr(4)]) != 1 {
		t.Fatalf("agent 4 keeps %d sessions (freed %v)\n%s", n, h.frees[addr(4)], h.trace())
	}
}

// A request for a session that ended at a middle agent (its datapath has
// collected it: MessageIn.Gone) is refused at once, "session ended", not
// after every retransmission of requestLock.
func TestRequestForGoneSession(t *testing.T) {
	h := newHarness(t, 3)
	h.chain([]int{1, 2, 3}, nil)
	h.deliver(addr(2), SessionEnd{Session: sid, Cause: "fin"})
	h.reconfigure(1, 3, nil, 1)
	var gone []MessageIn // what agent 2 was told about the ended session
	for len(h.queue) > 0 {
		e := h.queue[0]
		h.queue = h.queue[1:]
		in := h.messageIn(e)
		if _, _, known := h.agents[e.to].Lookup(e.msg.Sub); !known && e.msg.Type != MsgSyn {
			in.Gone = true
			if e.to == addr(2) {
				gone = append(gone, in)
			}
		}
		h.deliver(e.to, in)
	}
	r := h.result(1)
	if r.Outcome != Refused || r.Reason != ReasonSessionEnded {
		t.Fatalf("result %s %s, want refused: session ended\n%s", r.Outcome, r.Reason, h.trace())
	}
	if h.sent[addr(1)][MsgRequestLock] != 1 {
		t.Fatalf("requestLock sent %d times", h.sent[addr(1)][MsgRequestLock])
	}
	// The same requestLock again at once (a duplicate: no retransmission
	// comes this soon) is not answered.
	if len(gone) != 1 {
		t.Fatalf("agent 2 was told %d messages of the ended session, want the requestLock", len(gone))
	}
	nacks := h.sent[addr(2)][MsgNackLock]
	h.deliver(addr(2), gone[0])
	if len(h.queue) != 0 || h.sent[addr(2)][MsgNackLock] != nacks {
		t.Fatalf("agent 2 answered a duplicated requestLock of an ended session\n%s", h.trace())
	}
	// Once its left anchor has long stopped asking, a copy is a replay:
	// not answered either.
	h.now += 10 * time.Minute
	h.deliver(addr(2), gone[0])
	if len(h.queue) != 0 || h.sent[addr(2)][MsgNackLock] != nacks {
		t.Fatalf("agent 2 answered a replayed requestLock of an ended session\n%s", h.trace())
	}
}

// The "session ended" answer is idempotent: a retransmitted requestLock
// whose nack was lost is answered again, and so is one whose first copy
// passed the host while the session still lived there (its request is in
// the replay window). Before, both went unanswered and the left anchor
// gave up after all its retransmissions, "timeout" instead of "session
// ended".
func TestGoneAnswerRetransmitted(t *testing.T) {
	gone := func(h *harness) { // delivers everything, "Gone" where the receiver has no session
		for len(h.queue) > 0 {
			e := h.queue[0]
			h.queue = h.queue[1:]
			in := h.messageIn(e)
			if _, _, known := h.agents[e.to].Lookup(e.msg.Sub); !known && e.msg.Type != MsgSyn {
				in.Gone = true
			}
			h.deliver(e.to, in)
		}
	}
	t.Run("nack-lost", func(t *testing.T) {
		h := newHarness(t, 3)
		h.chain([]int{1, 2, 3}, nil)
		h.deliver(addr(2), SessionEnd{Session: sid, Cause: "fin"})
		h.reconfigure(1, 3, nil, 1)
		h.dropType(MsgSyn, addr(3)) // the early SYN: not needed here
		e := h.queue[0]
		h.queue = h.queue[1:]
		h.deliver(addr(2), MessageIn{From: e.from, Data: e.data, Gone: true}) // nack
		h.dropType(MsgNackLock, addr(1))
		h.fireNext() // agent 1 retransmits
		gone(h)
		if r := h.result(1); r.Outcome != Refused || r.Reason != ReasonSessionEnded {
			t.Fatalf("result %s %s, want refused: session ended\n%s", r.Outcome, r.Reason, h.trace())
		}
		if n := h.sent[addr(1)][MsgRequestLock]; n != 2 {
			t.Fatalf("requestLock sent %d times, want 2", n)
		}
	})
	t.Run("passed-then-ended", func(t *testing.T) {
		h := newHarness(t, 3)
		h.chain([]int{1, 2, 3}, nil)
		h.reconfigure(1, 3, nil, 1)
		h.stepType(MsgRequestLock, addr(2)) // passes agent 2 while it lives
		h.dropType(MsgRequestLock, addr(3))
		h.deliver(addr(2), SessionEnd{Session: sid, Cause: "fin"})
		h.fireNext() // agent 1 retransmits
		gone(h)
		if r := h.result(1); r.Outcome != Refused || r.Reason != ReasonSessionEnded {
			t.Fatalf("result %s %s, want refused: session ended\n%s", r.Outcome, r.Reason, h.trace())
		}
	})
	t.Run("other-sender", func(t *testing.T) {
		// A copy of the request on its subsession from another sender is
		// not answered: it was not the one answered.
		h := newHarness(t, 3)
		h.chain([]int{1, 2, 3}, nil)
		h.deliver(addr(2), SessionEnd{Session: sid, Cause: "fin"})
		h.reconfigure(1, 3, nil, 1)
		e := h.queue[0]
		gone(h)
		m := *e.msg
		b, err := m.Encode(testKey, addr(3))
		if err != nil {
			t.Fatal(err)
		}
		nacks := h.sent[addr(2)][MsgNackLock]
		h.now += time.Second
		h.deliver(addr(2), MessageIn{From: addr(3), Data: b, Gone: true})
		if h.sent[addr(2)][MsgNackLock] != nacks {
			t.Fatalf("agent 2 answered a copy from another sender\n%s", h.trace())
		}
	})
}

// The refusal of a failed join lost: the SYN sent again is refused again
// by the host that failed (it keeps the session, without datapath state,
// until the cancelLock), and the request fails at once, not after every
// retransmission of the SYN.
func TestJoinFailedRefusalLost(t *testing.T) {
	h := newHarness(t, 5)
	h.chain([]int{1, 2, 3}, nil)
	h.reconfigure(1, 3, []int{4, 5}, 1)
	for i := 0; i < 1000 && len(h.joins[addr(4)]) == 0; i++ {
		if !h.step() {
			break
		}
	}
	if len(h.joins[addr(4)]) != 1 {
		t.Fatalf("agent 4 never joined\n%s", h.trace())
	}
	h.deliver(addr(4), JoinFailed{Session: h.joins[addr(4)][0].Session})
	h.dropType(MsgSynAck, addr(1))
	h.run()
	r := h.result(1)
	if r.Outcome != Failed || r.Reason != ReasonSetupFailed || r.Hop != addr(4) {
		t.Fatalf("result %s %s hop %s, want failed setup at 10.0.0.4\n%s", r.Outcome, r.Reason, r.Hop, h.trace())
	}
	if n := h.sent[addr(1)][MsgSyn]; n != 2 {
		t.Fatalf("the left anchor sent %d SYNs, want 2 (the first, one retransmission)\n%s", n, h.trace())
	}
	for _, i := range []int{4, 5} {
		if n := len(h.agents[addr(i)].Sessions()); n != 0 {
			t.Fatalf("agent %d keeps %d sessions\n%s", i, n, h.trace())
		}
	}
	h.quiet(1, 2, 3)
}

// A middle agent of an old path that both anchors' fins have passed, whose
// datapath state gives way to a new path of the session through it
// (SessionEnd.Replaced), still passes the old path's fins and finAcks until
// its linger ends: a finAck lost meanwhile is recovered by the fin sent
// again, and the request is confirmed.
func TestReplacedMiddleRelaysOldPath(t *testing.T) {
	// The new path goes through agent 4, so the fins travel the old path
	// alone (a direct new path carries copies of them).
	h := newHarness(t, 4)
	h.chain([]int{1, 2, 3}, nil)
	h.reconfigure(1, 3, []int{4}, 1)
	for i := 0; i < 1000 && h.agents[addr(2)].OnLivePath(sid); i++ {
		if !h.step() && !h.fireNext() {
			break
		}
	}
	if h.agents[addr(2)].OnLivePath(sid) {
		t.Fatalf("both fins never passed agent 2\n%s", h.trace())
	}
	h.deliver(addr(2), SessionEnd{Session: sid, Cause: "replaced", Replaced: true})
	lost := 0
	kept := h.queue[:0]
	for _, e := range h.queue {
		if e.msg.Type == MsgFinAck {
			h.log = append(h.log, "lost: "+e.msg.String())
			lost++
			continue
		}
		kept = append(kept, e)
	}
	h.queue = kept
	if lost == 0 {
		t.Fatalf("no finAck in flight when both fins had passed agent 2\n%s", h.trace())
	}
	h.run()
	if r := h.result(1); r.Outcome != Succeeded || r.Unconfirmed {
		t.Fatalf("result %s %s unconfirmed=%v, want succeeded and confirmed\n%s", r.Outcome, r.Reason, r.Unconfirmed, h.trace())
	}
	if n := len(h.agents[addr(2)].Sessions()); n != 0 {
		t.Fatalf("agent 2 keeps %d sessions after its linger\n%s", n, h.trace())
	}
}
