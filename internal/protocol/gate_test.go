package protocol

import (
	"net/netip"
	"testing"
)

// A gated request (state migration, §3.5 last paragraph) stops between the
// new path's SYN-ACK and the ACK: nothing switches until Proceed.
func TestGateHoldsSwitchUntilProceed(t *testing.T) {
	h := newHarness(t, 4)
	h.chain([]int{1, 2, 4}, nil)
	h.deliver(addr(1), Reconfigure{Session: sid, RightAnchor: addr(4), Chain: []netip.Addr{addr(3)}, Token: 1, Gate: true})
	h.runMessages()
	rd := h.ready[addr(1)]
	if len(rd) != 1 {
		t.Fatalf("NewPathReady %+v\n%s", rd, h.trace())
	}
	r := rd[0]
	if r.OldPeer != addr(2) || r.NewPeer != addr(3) || r.RightAnchor != addr(4) || r.Token != 1 {
		t.Fatalf("NewPathReady %+v", r)
	}
	if len(h.results) != 0 || len(h.starts[addr(1)]) != 0 || len(h.starts[addr(4)]) != 0 {
		t.Fatalf("switched before Proceed: results %v starts %v %v\n%s", h.results, h.starts[addr(1)], h.starts[addr(4)], h.trace())
	}
	// A stray Proceed for another request changes nothing.
	h.deliver(addr(1), Proceed{Session: sid, Req: ReqKey{LeftAnchor: addr(1), ID: 99}})
	h.runMessages()
	if len(h.starts[addr(1)]) != 0 {
		t.Fatal("a Proceed for another request switched")
	}
	h.deliver(addr(1), Proceed{Session: sid, Req: r.Req})
	h.run()
	if res := h.result(1); res.Outcome != Succeeded {
		t.Fatalf("result %+v\n%s", res, h.trace())
	}
	if _, ok := h.view(2); ok {
		t.Error("the replaced middlebox still has the session")
	}
	h.assertClean(1, 3, 4)
}

// An aborted gate cancels like a new path that does not answer (§3.6): the
// session stays on the old path, every lock is released, the new
// middlebox frees its state.
func TestGateAbortCancels(t *testing.T) {
	h := newHarness(t, 4)
	h.chain([]int{1, 2, 4}, nil)
	h.deliver(addr(1), Reconfigure{Session: sid, RightAnchor: addr(4), Chain: []netip.Addr{addr(3)}, Token: 1, Gate: true})
	h.runMessages()
	if len(h.ready[addr(1)]) != 1 {
		t.Fatalf("no NewPathReady\n%s", h.trace())
	}
	h.deliver(addr(1), Proceed{Session: sid, Req: h.ready[addr(1)][0].Req, Abort: "state export failed"})
	h.run()
	res := h.result(1)
	if res.Outcome != Failed || res.Reason != ReasonAborted {
		t.Fatalf("result %+v\n%s", res, h.trace())
	}
	if len(h.starts[addr(1)])+len(h.starts[addr(4)]) != 0 {
		t.Fatal("an anchor switched after the abort")
	}
	if _, r := h.peers(1); r != addr(2) {
		t.Errorf("left anchor's right peer %s, want the old middlebox", r)
	}
	if _, ok := h.view(3); ok {
		t.Error("the new middlebox kept the session")
	}
	h.assertClean(1, 2, 4)
	// The session can be reconfigured again.
	h.reconfigure(1, 4, []int{3}, 2)
	h.run()
	if res := h.result(2); res.Outcome != Succeeded {
		t.Fatalf("retry %+v\n%s", res, h.trace())
	}
}

// A gate nobody opens aborts by itself before the leases expire: nothing
// stays locked.
func TestGateTimesOut(t *testing.T) {
	h := newHarness(t, 4)
	h.chain([]int{1, 2, 4}, nil)
	h.deliver(addr(1), Reconfigure{Session: sid, RightAnchor: addr(4), Chain: []netip.Addr{addr(3)}, Token: 1, Gate: true})
	h.run()
	if len(h.ready[addr(1)]) != 1 {
		t.Fatalf("no NewPathReady\n%s", h.trace())
	}
	res := h.result(1)
	if res.Outcome != Failed || res.Reason != ReasonAborted {
		t.Fatalf("result %+v\n%s", res, h.trace())
	}
	for _, a := range []netip.Addr{addr(2), addr(4)} {
		for _, r := range h.rejected {
			if r.From == a || a == addr(4) && r.Type == MsgCancelLock {
				t.Errorf("refused %+v: the gate outlived a lease", r)
			}
		}
	}
	h.assertClean(1, 2, 4)
}
