package protocol

import (
	"net/netip"
	"testing"
	"time"
)

// moveTo2 is a third address of agent 1.
var moveTo2 = netip.MustParseAddr("10.0.2.1")

func rebindHarness(t *testing.T, chain []int) *harness {
	h := newHarness(t, 3)
	h.alias = map[netip.Addr]netip.Addr{moveTo: addr(1), moveTo2: addr(1)}
	h.chain(chain, nil)
	return h
}

// A rebind moves the first subsession to the mover's new address at both
// of its ends, direct to the far end and to a middlebox: the mover listens
// on the new subsession before it asks, switches on the answer, and the
// neighbour moves at once. Nothing is rejected, the lock is released, and
// a reconfiguration afterwards runs on the new subsession.
func TestRebind(t *testing.T) {
	for _, c := range []struct {
		name  string
		chain []int
	}{{"direct", []int{1, 3}}, {"through a middlebox", []int{1, 2, 3}}} {
		t.Run(c.name, func(t *testing.T) {
			h := rebindHarness(t, c.chain)
			nb := c.chain[1]
			old := subTuple(1, nb)
			want := old
			want.Src = moveTo
			h.deliver(addr(1), Rebind{Session: sid, Side: SideRight, Source: moveTo, Token: 1})
			h.run()
			if r := h.rebindResult(1); r.Outcome != Succeeded || r.Old != old || r.New != want {
				t.Fatalf("%+v\n%s", r, h.trace())
			}
			if len(h.rejected) != 0 {
				t.Fatalf("rejected: %+v\n%s", h.rejected, h.trace())
			}
			mv := h.moves[addr(1)]
			if len(mv) != 2 || mv[0].Step != MoveListen || mv[1].Step != MoveSwitch || mv[1].New != want || mv[1].Side != SideRight {
				t.Fatalf("mover's moves %+v", mv)
			}
			nm := h.moves[addr(nb)]
			if len(nm) != 1 || nm[0].Step != MoveAll || nm[0].Old != old || nm[0].New != want || nm[0].Side != SideLeft {
				t.Fatalf("neighbour's moves %+v", nm)
			}
			s1, s2 := h.agents[addr(1)].sessions[sid], h.agents[addr(nb)].sessions[sid]
			if s1.sides[SideRight].Sub != want || s1.lock != Unlocked || s2.sides[SideLeft].Sub != want || s2.sides[SideLeft].Peer != moveTo {
				t.Fatalf("sides: mover %s (%s), neighbour %s from %s", s1.sides[SideRight].Sub, s1.lock, s2.sides[SideLeft].Sub, s2.sides[SideLeft].Peer)
			}
			// Back to the first address, before the neighbour forgot
			// it: the old subsession is taken again.
			h.now += time.Second
			h.deliver(addr(1), Rebind{Session: sid, Side: SideRight, Source: addr(1), Token: 3})
			h.runMessages()
			if r := h.rebindResult(3); r.Outcome != Succeeded || r.New != old {
				t.Fatalf("moving back: %+v\n%s", r, h.trace())
			}
			if s2 := h.agents[addr(nb)].sessions[sid]; s2.sides[SideLeft].Sub != old || s2.sides[SideLeft].Peer != addr(1) {
				t.Fatalf("the neighbour's side after moving back: %s from %s", s2.sides[SideLeft].Sub, s2.sides[SideLeft].Peer)
			}
			if len(c.chain) == 3 {
				// The middlebox leaves: its old path is the new subsession.
				h.reconfigure(1, 3, nil, 2)
				h.run()
				if r := h.result(2); r.Outcome != Succeeded {
					t.Fatalf("reconfiguration after the rebind: %+v\n%s", r, h.trace())
				}
				if len(h.rejected) != 0 {
					t.Fatalf("rejected: %+v\n%s", h.rejected, h.trace())
				}
			}
		})
	}
}

// The far end moves too (a server renumbered): the last agent rebinds its
// left subsession from its new address, directly to the first agent or
// to a middlebox, which moves its right side. A reconfiguration of the
// session and the rebind contend: the right anchor refuses the request
// while its left subsession moves, and a neighbour refuses a rebind of a
// subsession a reconfiguration holds.
func TestRebindLeft(t *testing.T) {
	serverNew := netip.MustParseAddr("10.0.3.9")
	for _, c := range []struct {
		name  string
		chain []int
	}{{"direct", []int{1, 3}}, {"through a middlebox", []int{1, 2, 3}}} {
		t.Run(c.name, func(t *testing.T) {
			h := rebindHarness(t, c.chain)
			h.alias[serverNew] = addr(3)
			nb := c.chain[len(c.chain)-2]
			old := subTuple(nb, 3)
			want := old
			want.Dst = serverNew
			h.deliver(addr(3), Rebind{Session: sid, Side: SideLeft, Source: serverNew, Token: 1})
			h.run()
			if r := h.rebindResult(1); r.Outcome != Succeeded || r.Old != old || r.New != want {
				t.Fatalf("%+v\n%s", r, h.trace())
			}
			if len(h.rejected) != 0 {
				t.Fatalf("rejected: %+v\n%s", h.rejected, h.trace())
			}
			mv := h.moves[addr(3)]
			if len(mv) != 2 || mv[0].Step != MoveListen || mv[1].Step != MoveSwitch || mv[1].New != want || mv[1].Side != SideLeft {
				t.Fatalf("mover's moves %+v", mv)
			}
			nm := h.moves[addr(nb)]
			if len(nm) != 1 || nm[0].Step != MoveAll || nm[0].Old != old || nm[0].New != want || nm[0].Side != SideRight {
				t.Fatalf("neighbour's moves %+v", nm)
			}
			s3, sn := h.agents[addr(3)].sessions[sid], h.agents[addr(nb)].sessions[sid]
			if s3.sides[SideLeft].Sub != want || sn.sides[SideRight].Sub != want || sn.sides[SideRight].Peer != serverNew {
				t.Fatalf("sides: mover %s, neighbour %s to %s", s3.sides[SideLeft].Sub, sn.sides[SideRight].Sub, sn.sides[SideRight].Peer)
			}
			// A reconfiguration afterwards runs on the new subsession.
			h.now += time.Second
			h.reconfigure(1, 3, nil, 2)
			h.run()
			if r := h.result(2); r.Outcome != Succeeded {
				t.Fatalf("reconfiguration after the rebind: %+v\n%s", r, h.trace())
			}
			if len(h.rejected) != 0 {
				t.Fatalf("rejected: %+v\n%s", h.rejected, h.trace())
			}
		})
	}

	// The rebind first: the reconfiguration's request is refused at the
	// right anchor until it ends.
	h := rebindHarness(t, []int{1, 2, 3})
	h.alias[serverNew] = addr(3)
	h.dead[addr(2)] = true
	h.deliver(addr(3), Rebind{Session: sid, Side: SideLeft, Source: serverNew, Token: 1})
	h.runMessages()
	delete(h.dead, addr(2))
	h.reconfigure(1, 3, nil, 2)
	h.runMessages()
	if r := h.result(2); r.Outcome != Refused || r.Reason != ReasonBusy {
		t.Fatalf("reconfiguration during the rebind: %+v\n%s", r, h.trace())
	}
	// The reconfiguration first: the middlebox refuses the rebind of the
	// subsession its lock holds.
	h = rebindHarness(t, []int{1, 2, 3})
	h.alias[serverNew] = addr(3)
	h.dead[addr(3)] = true // the request waits at 2, locked there
	h.reconfigure(1, 3, nil, 3)
	h.runMessages()
	delete(h.dead, addr(3))
	h.deliver(addr(3), Rebind{Session: sid, Side: SideLeft, Source: serverNew, Token: 4})
	h.runMessages()
	if r := h.rebindResult(4); r.Outcome != Refused || r.Reason != ReasonBusy {
		t.Fatalf("rebind during a reconfiguration: %+v\n%s", r, h.trace())
	}
	if s := h.agents[addr(3)].sessions[sid]; s.sides[SideLeft].Sub != subTuple(2, 3) {
		t.Fatalf("the refused rebind moved the side to %s", s.sides[SideLeft].Sub)
	}
}

// Bad rebinds change nothing and are counted: a replayed one (after the
// session moved on, and once its old subsession is forgotten), a forged
// one (another key, another nonce), one for an unknown subsession, one
// whose new address is not its sender's, and a rebind too soon after the
// last (rate limit: refused busy, then accepted once an RTO has passed).
func TestRebindRefused(t *testing.T) {
	h := rebindHarness(t, []int{1, 2, 3})
	var first envelope
	h.probe = func(e envelope) {
		if e.msg.Type == MsgRebind && first.msg == nil {
			first = e
		}
	}
	h.deliver(addr(1), Rebind{Session: sid, Side: SideRight, Source: moveTo, Token: 1})
	h.runMessages()
	if r := h.rebindResult(1); r.Outcome != Succeeded {
		t.Fatalf("%+v\n%s", r, h.trace())
	}
	// At once a second move: too soon.
	h.deliver(addr(1), Rebind{Session: sid, Side: SideRight, Source: moveTo2, Token: 2})
	h.runMessages()
	if r := h.rebindResult(2); r.Outcome != Refused || r.Reason != ReasonBusy {
		t.Fatalf("a rebind right after the last: %+v\n%s", r, h.trace())
	}
	if n := countRejects(h, RejectRate); n != 1 {
		t.Fatalf("%d rate rejections\n%s", n, h.trace())
	}
	if mv := h.moves[addr(1)]; mv[len(mv)-1].Step != MoveAbandon {
		t.Fatalf("refused rebind not abandoned: %+v", mv)
	}
	h.now += time.Second
	h.deliver(addr(1), Rebind{Session: sid, Side: SideRight, Source: moveTo2, Token: 3})
	h.runMessages()
	if r := h.rebindResult(3); r.Outcome != Succeeded {
		t.Fatalf("%+v\n%s", r, h.trace())
	}
	cur := h.agents[addr(2)].sessions[sid].sides[SideLeft]

	// The first rebind again: its subsession moved already.
	h.queue = append(h.queue, first)
	h.runMessages()
	if n := countRejects(h, RejectReplay); n != 1 {
		t.Fatalf("%d replays rejected\n%s", n, h.trace())
	}
	// Forged: another key, another nonce, an unknown subsession, a new
	// address that is not the sender's.
	m := *first.msg
	m.Sub = cur.Sub
	m.Req.ID = 1000
	forge := func(k *Keys, mm Message, from netip.Addr) {
		b, err := mm.Encode(k, from)
		if err != nil {
			t.Fatal(err)
		}
		h.queue = append(h.queue, envelope{from: from, to: addr(2), data: b, msg: &mm})
	}
	forge(NewKeys([]byte("not the deployment key")), m, moveTo)
	bad := m
	bad.Nonce[0] ^= 1
	forge(testKey, bad, moveTo)
	unknown := m
	unknown.Sub.SrcPort++
	forge(testKey, unknown, moveTo)
	other := m
	other.RightAnchor = netip.MustParseAddr("10.0.3.1")
	forge(testKey, other, moveTo)
	h.runMessages()
	for _, r := range []RejectReason{RejectMAC, RejectNonce, RejectUnknownSession, RejectWrongPeer} {
		if n := countRejects(h, r); n != 1 {
			t.Fatalf("%d %s rejections, want 1\n%s", n, r, h.trace())
		}
	}
	if now := h.agents[addr(2)].sessions[sid].sides[SideLeft]; now.Sub != cur.Sub || now.Peer != cur.Peer {
		t.Fatalf("the session moved to %s (%s)", now.Sub, now.Peer)
	}
	// Once the old subsession is forgotten (Linger), the replay names
	// no session.
	h.run()
	h.queue = append(h.queue, first)
	h.runMessages()
	if n := countRejects(h, RejectUnknownSession); n != 2 {
		t.Fatalf("%d unknown-session rejections, want 2\n%s", n, h.trace())
	}
}

// A rebind and a reconfiguration of the same session contend like two
// reconfigurations: each is refused while the other holds the lock, and
// a rebind to a neighbour that never answers gives up after MaxTries and
// releases the lock.
func TestRebindContention(t *testing.T) {
	h := rebindHarness(t, []int{1, 2, 3})
	h.reconfigure(1, 3, nil, 1)
	h.deliver(addr(1), Rebind{Session: sid, Side: SideRight, Source: moveTo, Token: 2})
	if r := h.rebindResult(2); r.Outcome != Refused || r.Reason != ReasonBusy {
		t.Fatalf("rebind during a reconfiguration: %+v\n%s", r, h.trace())
	}
	h.run()
	if r := h.result(1); r.Outcome != Succeeded {
		t.Fatalf("%+v\n%s", r, h.trace())
	}

	h = rebindHarness(t, []int{1, 2, 3})
	h.dead[addr(2)] = true
	h.deliver(addr(1), Rebind{Session: sid, Side: SideRight, Source: moveTo, Token: 1})
	h.reconfigure(1, 3, nil, 2)
	if r := h.result(2); r.Outcome != Refused || r.Reason != ReasonLocked {
		t.Fatalf("reconfiguration during a rebind: %+v\n%s", r, h.trace())
	}
	h.run()
	if r := h.rebindResult(1); r.Outcome != Failed || r.Reason != ReasonTimeout {
		t.Fatalf("%+v\n%s", r, h.trace())
	}
	// Sent at 0, 0.2, 0.6, 1.4 and 3 s; given up at 6 s, half of Linger
	// past (before MaxTries).
	if got := h.sent[addr(1)][MsgRebind]; got != 5 {
		t.Fatalf("%d rebinds sent", got)
	}
	if s := h.agents[addr(1)].sessions[sid]; s.lock != Unlocked || s.sides[SideRight].Sub != subTuple(1, 2) {
		t.Fatalf("after the timeout: %s on %s", s.lock, s.sides[SideRight].Sub)
	}
	// The subsession asked for is kept until Linger (the neighbour may
	// have moved), then forgotten.
	abandoned := subTuple(1, 2)
	abandoned.Src = moveTo
	if _, ok := h.agents[addr(1)].subs[abandoned]; ok {
		t.Fatal("the subsession given up is still known after Linger")
	}
}

func countRejects(h *harness, r RejectReason) int {
	n := 0
	for _, x := range h.rejected {
		if x.Reason == r {
			n++
		}
	}
	return n
}

// Every answer lost: the mover gives up, keeps its new subsession for
// Linger (step give-up), and the two ends recover either way: a late
// answer moves the mover too, and a rebind asked again is answered at once
// by the neighbour, which is there already.
func TestRebindAnswersLost(t *testing.T) {
	for _, recover := range []string{"late answer", "asked again"} {
		t.Run(recover, func(t *testing.T) {
			h := rebindHarness(t, []int{1, 2, 3})
			var ack envelope
			old, want := subTuple(1, 2), subTuple(1, 2)
			want.Src = moveTo
			h.deliver(addr(1), Rebind{Session: sid, Side: SideRight, Source: moveTo, Token: 1})
			// Every answer to the mover's new address is lost.
			for i := 0; i < 1000 && !h.hasRebindResult(1); i++ {
				if e, ok := h.take(MsgRebindAck, moveTo); ok {
					if ack.msg == nil {
						ack = e
					}
					continue
				}
				if !h.step() {
					h.fireNext()
				}
			}
			if r := h.rebindResult(1); r.Outcome != Failed || r.Reason != ReasonTimeout {
				t.Fatalf("%+v\n%s", r, h.trace())
			}
			mv := h.moves[addr(1)]
			if mv[len(mv)-1].Step != MoveGiveUp {
				t.Fatalf("mover's moves %+v", mv)
			}
			s1, s2 := h.agents[addr(1)].sessions[sid], h.agents[addr(2)].sessions[sid]
			if s1.sides[SideRight].Sub != old || s2.sides[SideLeft].Sub != want {
				t.Fatalf("after the give-up: mover on %s, neighbour on %s", s1.sides[SideRight].Sub, s2.sides[SideLeft].Sub)
			}
			if recover == "late answer" {
				if ack.msg == nil {
					t.Fatal("no answer was sent")
				}
				h.queue = append(h.queue, ack)
				h.runMessages()
			} else {
				h.deliver(addr(1), Rebind{Session: sid, Side: SideRight, Source: moveTo, Token: 2})
				h.runMessages()
				if r := h.rebindResult(2); r.Outcome != Succeeded || r.New != want {
					t.Fatalf("asked again: %+v\n%s", r, h.trace())
				}
			}
			if s1.sides[SideRight].Sub != want || s1.lock != Unlocked {
				t.Fatalf("the mover is on %s (%s), the neighbour on %s\n%s", s1.sides[SideRight].Sub, s1.lock, s2.sides[SideLeft].Sub, h.trace())
			}
			if mv := h.moves[addr(1)]; mv[len(mv)-1].Step != MoveSwitch {
				t.Fatalf("mover's moves %+v", mv)
			}
			if n := countRejects(h, RejectReplay); n != 0 {
				t.Fatalf("%d replays rejected\n%s", n, h.trace())
			}
		})
	}
}

// A copy of a refused rebind that arrives once the neighbour could take it
// gets the same refusal: accepted, it would move the neighbour while the
// mover, refused, stays.
func TestRebindRefusalCopy(t *testing.T) {
	h := rebindHarness(t, []int{1, 2, 3})
	h.deliver(addr(1), Rebind{Session: sid, Side: SideRight, Source: moveTo, Token: 1})
	h.runMessages()
	var copyOf envelope
	h.probe = func(e envelope) {
		if e.msg.Type == MsgRebind && copyOf.msg == nil {
			copyOf = e
		}
	}
	h.deliver(addr(1), Rebind{Session: sid, Side: SideRight, Source: moveTo2, Token: 2})
	h.runMessages()
	if r := h.rebindResult(2); r.Outcome != Refused || r.Reason != ReasonBusy {
		t.Fatalf("a rebind right after the last: %+v\n%s", r, h.trace())
	}
	// An RTO later the neighbour would take a new rebind; the copy of
	// the refused one gets the refusal again.
	h.now += time.Second
	acks := h.sent[addr(2)][MsgRebindAck]
	h.queue = append(h.queue, copyOf)
	h.runMessages()
	want := subTuple(1, 2)
	want.Src = moveTo
	if s2 := h.agents[addr(2)].sessions[sid]; s2.sides[SideLeft].Sub != want {
		t.Fatalf("the copy moved the neighbour to %s", s2.sides[SideLeft].Sub)
	}
	if h.sent[addr(2)][MsgRebindAck] != acks+1 {
		t.Fatalf("the copy was not answered\n%s", h.trace())
	}
}

// A rebind that reaches a neighbour still in the two-path phase of a
// reconfiguration the mover has finished (it names the new path, which
// the neighbour does not use yet) is refused busy, not ignored.
func TestRebindDuringNeighbourTwoPath(t *testing.T) {
	h := rebindHarness(t, []int{1, 2, 3})
	h.reconfigure(1, 3, nil, 1)
	// The right anchor's last finAck is held back: the left anchor is
	// done, the right anchor still in its two-path phase.
	var held []envelope
	for i := 0; i < 1000 && !h.hasResult(1); i++ {
		if e, ok := h.take(MsgFinAck, addr(3)); ok {
			held = append(held, e)
			continue
		}
		if !h.step() {
			h.fireNext()
		}
	}
	if r := h.result(1); r.Outcome != Succeeded {
		t.Fatalf("%+v\n%s", r, h.trace())
	}
	if h.agents[addr(3)].sessions[sid].right == nil {
		t.Fatalf("the right anchor is done already\n%s", h.trace())
	}
	h.now += time.Second
	h.deliver(addr(1), Rebind{Session: sid, Side: SideRight, Source: moveTo, Token: 2})
	h.runMessages()
	if r := h.rebindResult(2); r.Outcome != Refused || r.Reason != ReasonBusy {
		t.Fatalf("%+v\n%s", r, h.trace())
	}
	h.queue = append(h.queue, held...)
	h.run()
	h.now += time.Second
	h.deliver(addr(1), Rebind{Session: sid, Side: SideRight, Source: moveTo, Token: 3})
	h.runMessages()
	if r := h.rebindResult(3); r.Outcome != Succeeded {
		t.Fatalf("after the two-path phase: %+v\n%s", r, h.trace())
	}
}
