package protocol

import (
	"net/netip"
	"strings"
	"testing"

	"github.com/dysco/dysco/internal/wire"
)

// reconfigureNF is reconfigure with network functions for the chain's hops.
func (h *harness) reconfigureNF(at, ra int, chain []int, nfs []string, token uint64) {
	var c []netip.Addr
	for _, x := range chain {
		c = append(c, addr(x))
	}
	h.deliver(addr(at), Reconfigure{Session: sid, RightAnchor: addr(ra), Chain: c, NFs: nfs, Token: token})
}

// fireTimer fires agent at's pending timer of kind k.
func (h *harness) fireTimer(at netip.Addr, k TimerKind) {
	for key := range h.timers {
		if key.agent == at && key.id.Kind == k {
			if w := h.timers[key]; w > h.now {
				h.now = w
			}
			delete(h.timers, key)
			h.deliver(at, TimerFired{ID: key.id})
			return
		}
	}
	h.t.Fatalf("no %v timer at %s\n%s", k, at, h.trace())
}

// TestNFStartedBeforeJoin: a new path names a network function for its
// second middlebox (heterogeneous-sfc-quic §IV). That host asks its agent
// to start it once, answers the SYN and its retransmission with "starting"
// (the left anchor keeps waiting, the session stays on the old path), and
// joins and passes the SYN on only once the agent reports it ready.
func TestNFStartedBeforeJoin(t *testing.T) {
	h := newHarness(t, 8)
	h.chain([]int{1, 2, 3}, nil)
	h.reconfigureNF(1, 3, []int{6, 7}, []string{"", "fw"}, 1)
	h.runMessages()
	if n := len(h.nfStarts[addr(7)]); n != 1 || h.nfStarts[addr(7)][0].Name != "fw" || h.nfStarts[addr(7)][0].Session != sessionTuple {
		t.Fatalf("starts at 7: %+v\n%s", h.nfStarts[addr(7)], h.trace())
	}
	if len(h.nfStarts[addr(6)]) != 0 || len(h.joins[addr(6)]) != 1 || h.joins[addr(6)][0].NF != "" {
		t.Fatalf("6: starts %v joins %+v", h.nfStarts[addr(6)], h.joins[addr(6)])
	}
	if len(h.joins[addr(7)]) != 0 || h.sent[addr(7)][MsgSyn] != 0 {
		t.Fatalf("7 joined or passed the SYN on before its function was ready\n%s", h.trace())
	}
	if _, r := h.peers(1); r != addr(2) {
		t.Fatalf("left anchor's right peer %s: the session left its old path", r)
	}
	// The SYN sent again (the left anchor's timer): answered "starting"
	// again, not started twice.
	for range 3 {
		h.fireTimer(addr(1), TimerSyn)
		h.runMessages()
	}
	if n := len(h.nfStarts[addr(7)]); n != 1 {
		t.Fatalf("started %d times\n%s", n, h.trace())
	}
	if len(h.results) != 0 {
		t.Fatalf("results %+v", h.results)
	}
	// Ready: 7 joins with the function, the new path comes up.
	req := h.nfStarts[addr(7)][0].Req
	h.deliver(addr(7), NFStarted{Req: req, Name: "fw"})
	h.run()
	if r := h.result(1); r.Outcome != Succeeded {
		t.Fatalf("%+v\n%s", r, h.trace())
	}
	if len(h.joins[addr(7)]) != 1 || h.joins[addr(7)][0].NF != "fw" || h.joins[addr(7)][0].Right.Peer != addr(3) {
		t.Fatalf("joins at 7 %+v", h.joins[addr(7)])
	}
	if _, r := h.peers(1); r != addr(6) {
		t.Errorf("left anchor's right peer %s", r)
	}
	var waited, done bool
	for _, p := range h.progress {
		if p.Role == RoleLeftAnchor && p.NF == "fw" {
			waited = waited || !p.NFDone
			done = done || p.NFDone
		}
	}
	if !waited || !done {
		t.Errorf("left anchor's network function phase: waited %v, done %v\n%s", waited, done, h.trace())
	}
	// A late answer changes nothing.
	h.deliver(addr(7), NFStarted{Req: req, Name: "fw"})
	if len(h.joins[addr(7)]) != 1 {
		t.Fatal("joined twice")
	}
}

// TestNFFailedCancels: the agent cannot start the function: the host
// refuses the new path with the reason, the host before it leaves, the
// left anchor cancels and the session stays on its old path. A SYN sent
// again gets the same refusal, without a second start.
func TestNFFailedCancels(t *testing.T) {
	h := newHarness(t, 8)
	h.chain([]int{1, 2, 3}, nil)
	h.reconfigureNF(1, 3, []int{6, 7}, []string{"", "fw"}, 1)
	h.runMessages()
	req := h.nfStarts[addr(7)][0].Req
	h.deliver(addr(7), NFStarted{Req: req, Name: "fw", Err: "network function fw not ready within 10s"})
	h.run()
	r := h.result(1)
	if r.Outcome != Failed || r.Reason != ReasonNF || r.NF != "fw" || r.Hop != addr(7) || !strings.Contains(r.Detail, "not ready within 10s") {
		t.Fatalf("%+v\n%s", r, h.trace())
	}
	if _, rp := h.peers(1); rp != addr(2) {
		t.Errorf("left anchor's right peer %s: want the old path", rp)
	}
	if ids := h.agents[addr(6)].Sessions(); len(ids) != 0 {
		t.Errorf("6 keeps %v", ids)
	}
	if len(h.joins[addr(7)]) != 0 {
		t.Error("7 joined")
	}
	// The refusal lost: the SYN again gets it again.
	h.deliver(addr(7), MessageIn{From: addr(6), Data: h.synTo(7, req)})
	if n := len(h.nfStarts[addr(7)]); n != 1 {
		t.Fatalf("started %d times", n)
	}
	if q := h.queue; len(q) != 1 || q[0].msg.Type != MsgSynAck || q[0].msg.Reason != ReasonNF || q[0].msg.Flags&FlagRefuse == 0 {
		t.Fatalf("queued %+v", q)
	}
	// So does one on another subsession (6 joined again after it left).
	h.queue = nil
	h.deliver(addr(7), MessageIn{From: addr(6), Data: h.synOn(newSub(6, 7, 1), req)})
	if q := h.queue; len(q) != 1 || q[0].msg.Reason != ReasonNF || q[0].msg.Sub != newSub(6, 7, 1) || len(h.nfStarts[addr(7)]) != 1 {
		t.Fatalf("queued %+v", q)
	}
	// A second request is a new demand: started again.
	h.queue = nil
	h.reconfigureNF(1, 3, []int{6, 7}, []string{"", "fw"}, 2)
	h.runMessages()
	if n := len(h.nfStarts[addr(7)]); n != 2 {
		t.Fatalf("second request: %d starts", n)
	}
}

// synTo is a SYN of request req to agent i from agent 6, naming "fw" for i.
func (h *harness) synTo(i int, req ReqKey) []byte { return h.synOn(newSub(6, i, 0), req) }

// synOn is a SYN of request req on sub, naming "fw" for its receiver.
func (h *harness) synOn(sub wire.Tuple, req ReqKey) []byte {
	m := &Message{Type: MsgSyn, Nonce: testNonce, Sub: sub, Session: sessionTuple, Req: req,
		RightAnchor: addr(3), Hops: []netip.Addr{addr(3)}, NF: &NFBody{Names: []string{"fw"}}}
	b, err := m.Encode(h.key, addr(6))
	if err != nil {
		h.t.Fatal(err)
	}
	return b
}

// newSub is the new subsession from one agent to another that the sender
// made with its n-th port.
func newSub(from, to, n int) wire.Tuple {
	return wire.Tuple{Src: addr(from), Dst: addr(to), SrcPort: DefaultConfig(addr(from), nil).PortBase + uint16(n), DstPort: sessionTuple.DstPort}
}

// TestNFNeverAnswered: an agent that never reports its function does not
// hold the left anchor for ever: the wait is bounded, then the new path
// fails and the session stays on its old path.
func TestNFNeverAnswered(t *testing.T) {
	h := newHarness(t, 8)
	h.chain([]int{1, 2, 3}, nil)
	h.reconfigureNF(1, 3, []int{7}, []string{"fw"}, 1)
	h.run()
	r := h.result(1)
	if r.Outcome != Failed || r.Reason != ReasonSetupFailed {
		t.Fatalf("%+v\n%s", r, h.trace())
	}
	if _, rp := h.peers(1); rp != addr(2) {
		t.Errorf("left anchor's right peer %s", rp)
	}
	if n := len(h.nfStarts[addr(7)]); n != 1 {
		t.Fatalf("started %d times", n)
	}
}

// TestNFRequestChecked: network functions must fit the chain.
func TestNFRequestChecked(t *testing.T) {
	for _, nfs := range [][]string{{"fw"}, {"fw", "", "x"}, {"", "bad name"}, {"", "9fw"}} {
		h := newHarness(t, 8)
		h.chain([]int{1, 2, 3}, nil)
		h.reconfigureNF(1, 3, []int{6, 7}, nfs, 1)
		if r := h.result(1); r.Outcome != Refused || r.Reason != ReasonInvalid {
			t.Errorf("%q: %+v", nfs, r)
		}
	}
	if CheckNFs([]netip.Addr{addr(6)}, []string{"fw"}) != nil || CheckNFs([]netip.Addr{addr(6)}, nil) != nil ||
		CheckNFs([]netip.Addr{addr(6)}, []string{"a", "b"}) == nil {
		t.Error("CheckNFs")
	}
}
