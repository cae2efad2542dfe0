package protocol

import (
	"fmt"
	"net/netip"
	"reflect"
	"testing"

	"github.com/dysco/dysco/internal/wire"
)

// Every kind of control message is bound to its session's nonce and to its
// sender (§2.3, §3.3; docs/protocol.md, "Authentication"). Scenarios that
// between them send every kind run with a prober in front of each
// delivery, which first hands the receiver three forgeries of the message:
//
//   - the message with another nonce, authentic (a message of another
//     session on the same subsession's tuple, or a key holder's forgery):
//     refused;
//   - the message's own bytes from another address (a replay from
//     elsewhere): refused, for its MAC;
//   - the message authentic as sent by another address (a key holder
//     there): refused.
//
// A refusal here is a Rejected action and nothing else, with the
// receiver's sessions as they were; then the real message is delivered
// and the scenario must end as it would have.
//
// One forgery is not refused, by design: a new path's SYN that a host
// joins (§3.3) carries the new path's nonce, which that host has no means
// to know yet; and the early SYN the right anchor keeps until its
// requestLock comes is checked against the request's nonce only then
// (acceptSyn). Both are bound to the sender and the MAC.
func TestBindingEveryKind(t *testing.T) {
	const stranger = 99 // an address with no part in the session
	covered := map[MsgType]bool{}
	for _, sc := range []struct {
		name string
		n    int
		run  func(h *harness)
	}{
		{"reconfiguration through a new middlebox", 5, func(h *harness) {
			h.chain([]int{1, 2, 3, 4}, nil)
			h.reconfigure(1, 4, []int{5}, 1)
			h.run()
			if r := h.result(1); r.Outcome != Succeeded {
				t.Fatalf("result %+v", r)
			}
		}},
		{"two requests contending", 4, func(h *harness) {
			h.chain([]int{1, 2, 3, 4}, nil)
			h.reconfigure(1, 3, nil, 1)
			h.reconfigure(2, 4, nil, 2)
			h.run()
			if h.result(1).Outcome == Succeeded == (h.result(2).Outcome == Succeeded) {
				t.Fatalf("results %+v %+v: want one to win", h.result(1), h.result(2))
			}
		}},
		{"a trigger", 3, func(h *harness) {
			h.chain([]int{1, 2, 3}, nil)
			h.trigger(2, 3, nil, 1, nil)
			h.run()
			if tr := h.trigResult(1); !tr.Answered || tr.Outcome != Succeeded {
				t.Fatalf("trigger %+v", tr)
			}
		}},
		{"a state migration", 4, func(h *harness) {
			h.chain([]int{1, 2, 4}, nil)
			h.deliver(addr(1), Reconfigure{Session: sid, RightAnchor: addr(4), Chain: []netip.Addr{addr(3)}, Token: 1,
				Migrate: &MigrateSpec{Semantics: MigrateOrder}})
			h.runMessages()
			done := h.migDone[addr(1)]
			if len(done) != 1 || done[0].Err != "" {
				t.Fatalf("migration done %+v", done)
			}
			h.deliver(addr(1), Proceed{Session: sid, Req: done[0].Req})
			h.run()
			if r := h.result(1); r.Outcome != Succeeded {
				t.Fatalf("result %+v", r)
			}
		}},
		{"a state migration that fails and is cancelled", 4, func(h *harness) {
			h.chain([]int{1, 2, 4}, nil)
			h.migFail[addr(2)] = "export"
			h.deliver(addr(1), Reconfigure{Session: sid, RightAnchor: addr(4), Chain: []netip.Addr{addr(3)}, Token: 1,
				Migrate: &MigrateSpec{Semantics: MigrateOrder}})
			h.runMessages()
			done := h.migDone[addr(1)]
			if len(done) != 1 || done[0].Err == "" {
				t.Fatalf("migration done %+v", done)
			}
			h.deliver(addr(1), Proceed{Session: sid, Req: done[0].Req, Abort: done[0].Err})
			h.run()
			if r := h.result(1); r.Outcome != Failed {
				t.Fatalf("result %+v", r)
			}
		}},
		{"a rebind", 3, func(h *harness) {
			h.alias = map[netip.Addr]netip.Addr{moveTo: addr(1)}
			h.chain([]int{1, 2, 3}, nil)
			h.deliver(addr(1), Rebind{Session: sid, Side: SideRight, Source: moveTo, Token: 1})
			h.run()
			if r := h.rebindResult(1); r.Outcome != Succeeded {
				t.Fatalf("rebind %+v", r)
			}
		}},
		{"a state migration the right anchor aborts", 4, func(h *harness) {
			h.chain([]int{1, 2, 4}, nil)
			h.deliver(addr(1), Reconfigure{Session: sid, RightAnchor: addr(4), Chain: []netip.Addr{addr(3)}, Token: 1,
				Migrate: &MigrateSpec{Semantics: MigrateOrder, HoldLimit: 1}})
			for !h.queued(MsgMigrate) {
				if !h.step() {
					t.Fatalf("no freeze")
				}
			}
			h.stepType(MsgMigrate, addr(4))
			h.deliver(addr(4), HoldOverflow{Session: sid, Side: SideLeft})
			h.runMessages()
			done := h.migDone[addr(1)]
			if len(done) != 1 || done[0].Err == "" {
				t.Fatalf("migration done %+v", done)
			}
			h.deliver(addr(1), Proceed{Session: sid, Req: done[0].Req, Abort: done[0].Err})
			h.run()
		}},
	} {
		t.Run(sc.name, func(t *testing.T) {
			h := newHarness(t, sc.n)
			h.probe = func(e envelope) {
				covered[e.msg.Type] = true
				joining := e.msg.Type == MsgSyn && !h.agentAt(e.to).knows(e.msg.Sub)
				forged := *e.msg
				forged.Nonce[0] ^= 0x55
				forged.AnchorNonce[0] ^= 0x55
				other := addr(stranger)
				for _, f := range []struct {
					what string
					from netip.Addr
					data []byte
					mac  bool // refused for its MAC
				}{
					{"another nonce", e.from, h.encode(&forged, e.from), false},
					{"replayed from another address", other, e.data, true},
					{"sent by a key holder at another address", other, h.encode(e.msg, other), false},
				} {
					if joining && f.what == "another nonce" {
						continue
					}
					h.expectRefused(e, f.what, MessageIn{From: f.from, Data: f.data}, f.mac)
				}
			}
			sc.run(h)
			if t.Failed() {
				t.Log(h.trace())
			}
		})
	}
	for _, typ := range MsgTypes {
		if !covered[typ] {
			t.Errorf("no scenario sent a %s", typ)
		}
	}
}

func (h *harness) encode(m *Message, from netip.Addr) []byte {
	b, err := m.Encode(h.key, from)
	if err != nil {
		h.t.Fatal(err)
	}
	return b
}

// knows reports whether the agent has the subsession.
func (a *Agent) knows(sub wire.Tuple) bool {
	_, ok := a.subs[sub]
	return ok
}

// expectRefused hands the receiver of e a forgery of it: it must answer
// with refusals only (a MAC refusal if mac), and keep its sessions as they
// were.
func (h *harness) expectRefused(e envelope, what string, in MessageIn, mac bool) {
	h.t.Helper()
	a := h.agentAt(e.to)
	before := h.snapshot(a)
	acts := a.Handle(h.now, in)
	n := 0
	for _, act := range acts {
		r, ok := act.(Rejected)
		if !ok {
			h.t.Errorf("%s to %s, %s: %T %+v, want refused\n%s", e.msg, e.to, what, act, act, h.trace())
			continue
		}
		if mac != (r.Reason == RejectMAC) {
			h.t.Errorf("%s to %s, %s: refused %s (%s)", e.msg, e.to, what, r.Reason, r.Detail)
		}
		n++
	}
	if n == 0 {
		h.t.Errorf("%s to %s, %s: ignored, not refused (and not counted)", e.msg, e.to, what)
	}
	if after := h.snapshot(a); !reflect.DeepEqual(before, after) {
		h.t.Errorf("%s to %s, %s: state changed\n%s\n%s", e.msg, e.to, what, before, after)
	}
}

// agentState is what an agent holds of its sessions, and the triggers it
// waits on.
type agentState struct {
	Views                []SessionView
	Subs, Trigs, EarlyNs int
}

func (h *harness) snapshot(a *Agent) agentState {
	st := agentState{Subs: len(a.subs), Trigs: len(a.triggers), EarlyNs: len(a.earlySyns)}
	for _, id := range a.Sessions() {
		v, _ := a.View(id)
		st.Views = append(st.Views, v)
	}
	return st
}

func (st agentState) String() string {
	s := fmt.Sprintf("subs %d triggers %d early SYNs %d", st.Subs, st.Trigs, st.EarlyNs)
	for _, v := range st.Views {
		s += fmt.Sprintf("\n%d lock %s by %s queued %d", v.ID, v.Lock, v.Requestor, v.Queued)
		for _, sd := range v.Sides {
			if sd != nil {
				s += fmt.Sprintf("\n  side %+v", *sd)
			}
		}
		for _, an := range []*AnchorView{v.Left, v.Right} {
			if an != nil {
				s += fmt.Sprintf("\n  anchor %+v", *an)
			}
		}
	}
	return s
}
