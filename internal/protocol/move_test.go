package protocol

import (
	"net/netip"
	"testing"
)

// moveTo is another address of agent 1 (its second interface).
var moveTo = netip.MustParseAddr("10.0.1.1")

// The left anchor moves the session to another of its addresses
// (Reconfigure.Source), direct to its next hop and through a middlebox:
// the new subsession leaves from that address, its SYN (flag direct on
// the direct path) and the ack come from it, the right anchor keeps the
// early SYN and grants as for one from the left anchor's own address, and
// the request succeeds with one SYN, nothing rejected.
func TestMoveSource(t *testing.T) {
	for _, c := range []struct {
		name  string
		chain []int
	}{{"direct", []int{1, 3}}, {"through a middlebox", []int{1, 2, 3}}} {
		t.Run(c.name, func(t *testing.T) {
			h := newHarness(t, 3)
			h.alias = map[netip.Addr]netip.Addr{moveTo: addr(1)}
			h.chain(c.chain, nil)
			ra := c.chain[1] // the next hop: only the first subsession changes
			var syns []envelope
			h.probe = func(e envelope) {
				if e.msg.Type == MsgSyn {
					syns = append(syns, e)
				}
			}
			h.deliver(addr(1), Reconfigure{Session: sid, RightAnchor: addr(ra), Source: moveTo, Token: 1})
			h.run()
			if r := h.result(1); r.Outcome != Succeeded || r.Unchanged {
				t.Fatalf("%+v\n%s", r, h.trace())
			}
			if len(h.rejected) != 0 {
				t.Fatalf("rejected: %+v\n%s", h.rejected, h.trace())
			}
			if len(syns) != 1 || syns[0].from != moveTo || syns[0].msg.Flags&FlagDirect == 0 || syns[0].msg.Sub.Src != moveTo {
				t.Fatalf("SYNs %+v, want one from %s with the flag direct\n%s", syns, moveTo, h.trace())
			}
			adds := h.adds[addr(ra)]
			if len(adds) != 1 || adds[0].Sub.Src != moveTo || adds[0].Peer != moveTo {
				t.Fatalf("the right anchor's new subsession %+v, want one from %s", adds, moveTo)
			}
			if side := h.agents[addr(1)].sessions[sid].sides[SideRight]; side.Sub.Src != moveTo || side.Peer != addr(ra) {
				t.Fatalf("the left anchor's side is %s to %s", side.Sub, side.Peer)
			}

			// Asked again: nothing to change. Without Source a delete to
			// the next hop is unchanged as before.
			h.deliver(addr(1), Reconfigure{Session: sid, RightAnchor: addr(ra), Source: moveTo, Token: 2})
			h.deliver(addr(1), Reconfigure{Session: sid, RightAnchor: addr(ra), Token: 3})
			h.run()
			for _, tok := range []uint64{2, 3} {
				if r := h.result(tok); r.Outcome != Succeeded || !r.Unchanged && tok == 2 {
					t.Fatalf("request %d: %+v\n%s", tok, r, h.trace())
				}
			}
		})
	}
}

// A move combined with a state migration is refused: the migration's
// messages leave from the left anchor's own address, the new path's from
// the other.
func TestMoveSourceRefused(t *testing.T) {
	h := newHarness(t, 3)
	h.alias = map[netip.Addr]netip.Addr{moveTo: addr(1)}
	h.chain([]int{1, 2, 3}, nil)
	h.deliver(addr(1), Reconfigure{Session: sid, RightAnchor: addr(3), Chain: []netip.Addr{addr(2)}, Source: moveTo, Token: 1,
		Migrate: &MigrateSpec{}})
	h.deliver(addr(1), Reconfigure{Session: sid, RightAnchor: addr(3), Source: netip.MustParseAddr("fd00::1"), Token: 2})
	h.run()
	for _, tok := range []uint64{1, 2} {
		if r := h.result(tok); r.Outcome != Refused || r.Reason != ReasonInvalid {
			t.Fatalf("request %d: %+v", tok, r)
		}
	}
	// The same chain from another address is not "unchanged": mb2 is on
	// the old segment.
	h.deliver(addr(1), Reconfigure{Session: sid, RightAnchor: addr(3), Chain: []netip.Addr{addr(2)}, Source: moveTo, Token: 3})
	h.run()
	if r := h.result(3); r.Outcome != Refused || r.Reason != ReasonOnPath {
		t.Fatalf("the same chain from another address: %+v\n%s", r, h.trace())
	}
}
