package datapath

import (
	"net/netip"
	"slices"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/gopacket/gopacket/layers"

	"github.com/dysco/dysco/internal/wire"
)

// synStep is one SYN through the egress program and what must come out.
type synStep struct {
	in      pkt
	verdict uint32
	next    netip.Addr        // REDIRECT: the subsession's destination
	hops    []netip.Addr      // REDIRECT: the hops in the block
	stats   map[string]uint64 // counters expected to move
	retrans bool              // REDIRECT: same subsession as the step before
}

// checkEmitted checks a SYN that dysco_setup sent on to the next hop and
// returns its subsession: source = this host, ports in the configured range,
// destination next; the options opts followed by the marking option as the
// last option; a block that package wire decodes, carrying session, nonce and
// hops. Every other field is the input's.
func checkEmitted(t *testing.T, in pkt, out []byte, session wire.Tuple, nonce [wire.NonceLen]byte, opts []layers.TCPOption, next netip.Addr, hops []netip.Addr) wire.Tuple {
	t.Helper()
	v, tcp := decode(t, out)
	src := hostV4
	if !session.Is4() {
		src = hostV6
	}
	sub := tup(v.Src, v.Dst)
	if v.Src.Addr() != src || v.Dst.Addr() != next {
		t.Errorf("subsession %v, want %v -> %v", sub, src, next)
	}
	for _, p := range []uint16{sub.SrcPort, sub.DstPort} {
		if p < fxPortLo || p >= fxPortLo+fxPortN {
			t.Errorf("subsession port %d outside [%d, %d)", p, fxPortLo, fxPortLo+fxPortN)
		}
	}
	b, err := wire.Decode(tcp.Payload)
	if err != nil {
		t.Fatalf("block of the emitted SYN: %v (%x)", err, tcp.Payload)
	}
	if b.Session != session || b.Nonce != nonce || !equalAddrs(b.Hops, hops) {
		t.Errorf("block session %v nonce %x hops %v, want %v %x %v", b.Session, b.Nonce, b.Hops, session, nonce, hops)
	}
	// Signed for the subsession it goes on, as package wire computes it.
	if !wire.VerifyBlock(fxSynKey, tcp.Payload, sub) {
		t.Errorf("the emitted block's MAC %x does not verify for %v", b.MAC, sub)
	}
	exp := in.with(sub).withOpts(append(slices.Clone(opts), optDysco(b.Len()))...).withPayload(signed(fxSynKey, block(t, session, nonce, hops...), sub))
	expectFrame(t, out, exp)
	return sub
}

// TestEgressChainStart covers the start of a chain (§2.1, §2.2): a SYN of
// no known session goes through the policy program and dysco_setup, which
// resolves the policy, allocates the session and the subsession, writes the
// marking option and the block, and redirects the SYN to the first hop.
func TestEgressChainStart(t *testing.T) {
	fx := newFixture(t)
	classify := loadClassifier(t, fx.d, 1)
	noMatch := loadClassifier(t, fx.d, 0)
	sixth := loadClassifier(t, fx.d, 6) // a slot SetPolicies left empty

	syn := func(src, dst netip.AddrPort) pkt {
		p := pkt{seq: 0xabcdef01, flags: "S", win: 64240, opts: synOpts()}
		return p.with(tup(src, dst))
	}
	syn4 := syn(apOf(hostV4, 40000), apOf(serverV4, 80))
	syn6 := syn(apOf(hostV6, 40000), apOf(serverV6, 443))
	full := syn4.withOpts(append(synOpts(), optRaw(append([]byte{254, 20}, make([]byte, 18)...)...))...)
	withData := syn4.withPayload([]byte("hello"))
	start := map[string]uint64{"setup_start": 1}
	addr := func(a netip.Addr) PolicyHop { return PolicyHop{Addr: a} }
	cases := []struct {
		name     string
		prog     *ebpf.Program // policy program, nil: none installed
		policies []PolicyChain
		types    [][]netip.Addr
		steps    []synStep
	}{
		{
			name: "v4 middlebox then destination", prog: classify,
			policies: []PolicyChain{{Hops: []PolicyHop{addr(mboxV4)}, ToDst: true}},
			steps:    []synStep{{in: syn4, verdict: tcActRedirect, next: mboxV4, hops: []netip.Addr{serverV4}, stats: start}},
		},
		{
			name: "v6 middlebox then destination", prog: classify,
			policies: []PolicyChain{{Hops: []PolicyHop{addr(mboxV6)}, ToDst: true}},
			steps:    []synStep{{in: syn6, verdict: tcActRedirect, next: mboxV6, hops: []netip.Addr{serverV6}, stats: start}},
		},
		{
			name: "two middleboxes then destination", prog: classify,
			policies: []PolicyChain{{Hops: []PolicyHop{addr(mboxV4), addr(mbox2V4)}, ToDst: true}},
			steps:    []synStep{{in: syn4, verdict: tcActRedirect, next: mboxV4, hops: []netip.Addr{mbox2V4, serverV4}, stats: start}},
		},
		{
			name: "chain ending at a middlebox", prog: classify,
			policies: []PolicyChain{{Hops: []PolicyHop{addr(mboxV4)}}},
			steps:    []synStep{{in: syn4, verdict: tcActRedirect, next: mboxV4, hops: []netip.Addr{}, stats: start}},
		},
		{
			name: "retransmitted SYN keeps its subsession", prog: classify,
			policies: []PolicyChain{{Hops: []PolicyHop{addr(mboxV4)}, ToDst: true}},
			steps: []synStep{
				{in: syn4, verdict: tcActRedirect, next: mboxV4, hops: []netip.Addr{serverV4}, stats: start},
				{in: syn4, verdict: tcActRedirect, next: mboxV4, hops: []netip.Addr{serverV4}, stats: map[string]uint64{"syn_retransmit": 1}, retrans: true},
			},
		},
		{
			name: "middlebox type resolved round robin", prog: classify,
			policies: []PolicyChain{{Hops: []PolicyHop{{Type: 0}}, ToDst: true}},
			types:    [][]netip.Addr{{mboxV4, mbox2V4}},
			steps: []synStep{
				{in: syn4, verdict: tcActRedirect, next: mboxV4, hops: []netip.Addr{serverV4}, stats: start},
				{in: syn(apOf(hostV4, 40001), apOf(serverV4, 80)), verdict: tcActRedirect, next: mbox2V4, hops: []netip.Addr{serverV4}, stats: start},
				{in: syn(apOf(hostV4, 40002), apOf(serverV4, 80)), verdict: tcActRedirect, next: mboxV4, hops: []netip.Addr{serverV4}, stats: start},
			},
		},
		{
			name: "options area full", prog: classify,
			policies: []PolicyChain{{Hops: []PolicyHop{addr(mboxV4)}, ToDst: true}},
			steps:    []synStep{{in: full, verdict: tcActShot, stats: map[string]uint64{"setup_start": 1, "drop_option_space": 1}}},
		},
		{
			name: "SYN with data at chain start", prog: classify,
			policies: []PolicyChain{{Hops: []PolicyHop{addr(mboxV4)}, ToDst: true}},
			steps:    []synStep{{in: withData, verdict: tcActShot, stats: map[string]uint64{"drop_syn_data": 1}}},
		},
		{
			name: "type slot empty fails closed", prog: classify,
			policies: []PolicyChain{{Hops: []PolicyHop{{Type: 3}}, ToDst: true}},
			types:    [][]netip.Addr{{mboxV4}},
			steps:    []synStep{{in: syn4, verdict: tcActShot, stats: map[string]uint64{"drop_bad_policy": 1}}},
		},
		{
			name: "policy slot empty fails closed", prog: sixth,
			policies: []PolicyChain{{Hops: []PolicyHop{addr(mboxV4)}, ToDst: true}},
			steps:    []synStep{{in: syn4, verdict: tcActShot, stats: map[string]uint64{"drop_bad_policy": 1}}},
		},
		{
			name: "no route to the first hop", prog: classify,
			policies: []PolicyChain{{Hops: []PolicyHop{addr(noRoute)}, ToDst: true}},
			steps:    []synStep{{in: syn4, verdict: tcActShot, stats: map[string]uint64{"setup_start": 1, "drop_no_route": 1}}},
		},
		{
			name: "no policy matches: plain SYN", prog: noMatch,
			policies: []PolicyChain{{Hops: []PolicyHop{addr(mboxV4)}, ToDst: true}},
			steps:    []synStep{{in: syn4, verdict: tcActOK}},
		},
		{
			name:  "no policy program installed: plain SYN",
			steps: []synStep{{in: syn4, verdict: tcActOK}},
		},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			fx.reset(t)
			if err := fx.d.SetPolicies(c.policies); err != nil {
				t.Fatal(err)
			}
			if err := fx.d.SetTypes(c.types); err != nil {
				t.Fatal(err)
			}
			if c.prog != nil {
				if err := fx.d.SetPolicyProgram(c.prog); err != nil {
					t.Fatal(err)
				}
			}
			var prev wire.Tuple
			for i, s := range c.steps {
				frame := s.in.frame(t)
				before := fx.stats(t)
				verdict, out := fx.run(t, fx.egress, frame)
				if verdict != s.verdict {
					t.Fatalf("SYN %d: verdict %d, want %d", i, verdict, s.verdict)
				}
				fx.expectStats(t, before, s.stats)
				switch s.verdict {
				case tcActShot:
					fx.expectNoState(t)
					continue
				case tcActOK:
					if string(out) != string(frame) {
						t.Errorf("SYN %d changed:\n got %x\nwant %x", i, out, frame)
					}
					fx.expectNoState(t)
					continue
				}
				var sess SessionEntry
				for _, e := range fx.sessions(t) {
					if e.Tuple == s.in.key().Ends() {
						sess = e
					}
				}
				sub := checkEmitted(t, s.in, out, s.in.tuple(), sess.Nonce, s.in.opts, s.next, s.hops)
				if s.retrans && sub != prev {
					t.Errorf("SYN %d: retransmission on subsession %v, first SYN on %v", i, sub, prev)
				}
				prev = sub
				if sess.Role != RoleStart || sess.Policy != 1 || sess.State != StSYN || sess.IsV6 != boolU8(!s.in.src.Addr().Is4()) {
					t.Errorf("SYN %d: session %+v, want role start, policy slot 1, state syn", i, sess)
				}
				flows := fx.flows(t)
				if f := flows[s.in.key()]; f != flow(sub, sess.ID, FlReroute|FlSYNEmit) {
					t.Errorf("SYN %d: forward flow %+v, want out %v sess %d reroute|syn-emit", i, f, sub, sess.ID)
				}
				if f := flows[TupleFrom(sub.Reverse())]; f != flow(s.in.tuple().Reverse(), sess.ID, FlIngress|FlRev) {
					t.Errorf("SYN %d: reverse flow %+v, want out %v sess %d rev", i, f, s.in.tuple().Reverse(), sess.ID)
				}
				st, ok := fx.synState(t, sess.ID)
				want := append([]netip.Addr{s.next}, s.hops...)
				if !ok || !equalAddrs(hopsOf(st), want) || st.Emitted != 1 || st.Session != s.in.key() || st.Nonce != sess.Nonce {
					t.Errorf("SYN %d: set-up state %v (found %v), want hops %v, emitted", i, st, ok, want)
				}
			}
			if n, want := len(fx.sessions(t)), countNew(c.steps); n != want {
				t.Errorf("%d sessions, want %d", n, want)
			}
			if n, want := len(fx.flows(t)), 2*countNew(c.steps); n != want {
				t.Errorf("%d flows, want %d", n, want)
			}
		})
	}
}

// TestEgressPolicySource: a policy's via addresses (multihoming). The
// first subsession of a session the policy starts leaves from the one its
// hash picks, if that is an address of an interface of the host
// (dysco_local_if), and is routed by it (reroute); else from the route's
// source. The session keeps its own source. A policy with more via
// addresses than the map holds is refused.
func TestEgressPolicySource(t *testing.T) {
	fx := newFixture(t)
	classify := loadClassifier(t, fx.d, 1)
	via4, via6 := netip.MustParseAddr("10.9.0.5"), netip.MustParseAddr("fd00:9::5")
	syn4 := pkt{seq: 1, flags: "S", win: 64240, opts: synOpts()}.with(tup(apOf(hostV4, 40001), apOf(serverV4, 80)))
	syn6 := pkt{seq: 1, flags: "S", win: 64240, opts: synOpts()}.with(tup(apOf(hostV6, 40001), apOf(serverV6, 80)))
	for _, c := range []struct {
		name    string
		in      pkt
		local   bool
		wantSrc netip.Addr
	}{
		{"IPv4, a local via address", syn4, true, via4},
		{"IPv6, a local via address", syn6, true, via6},
		{"IPv4, not an address of the host", syn4, false, hostV4},
	} {
		t.Run(c.name, func(t *testing.T) {
			fx.reset(t)
			next := mboxV4
			if !c.in.src.Addr().Is4() {
				next = mboxV6
			}
			if err := fx.d.SetPolicies([]PolicyChain{{Hops: []PolicyHop{{Addr: next}}, ToDst: true, Via: []netip.Addr{via4, via6}}}); err != nil {
				t.Fatal(err)
			}
			ifs := map[netip.Addr]int{}
			if c.local {
				ifs = map[netip.Addr]int{via4: 1, via6: 1}
			}
			if err := fx.d.SetLocalIfaces(ifs); err != nil {
				t.Fatal(err)
			}
			if err := fx.d.SetPolicyProgram(classify); err != nil {
				t.Fatal(err)
			}
			verdict, out := fx.run(t, fx.egress, c.in.frame(t))
			if verdict != tcActRedirect {
				t.Fatalf("verdict %d", verdict)
			}
			v, _ := decode(t, out)
			if v.Src.Addr() != c.wantSrc || v.Dst.Addr() != next {
				t.Fatalf("the SYN went %v -> %v, want from %v to %v", v.Src, v.Dst, c.wantSrc, next)
			}
			f := fx.flows(t)[c.in.key()]
			if f.Out.Wire().Src.Unmap() != c.wantSrc || f.Flags&FlReroute == 0 {
				t.Fatalf("forward flow %+v: want from %v, rerouted", f, c.wantSrc)
			}
		})
	}
	if err := fx.d.SetPolicies([]PolicyChain{{ToDst: true, Via: slices.Repeat([]netip.Addr{via4}, MaxPolicySources+1)}}); err == nil {
		t.Fatal("a policy with too many via addresses was written")
	}
	if err := fx.d.SetLocalIfaces(nil); err != nil {
		t.Fatal(err)
	}
}

func countNew(steps []synStep) int {
	n := 0
	for _, s := range steps {
		if s.verdict == tcActRedirect && !s.retrans {
			n++
		}
	}
	return n
}

// TestEgressContinuation covers a SYN leaving a middlebox host: the
// middlebox (or the stack forwarding it) sends the SYN with the local tag
// that ingress left; dysco_setup turns the tag into the marking option in
// place, appends the block with the rest of the list and redirects the SYN to
// the next hop. A chain that ends here lets the SYN go on plain (§2.4).
func TestEgressContinuation(t *testing.T) {
	fx := newFixture(t)
	type tc struct {
		name    string
		sub     wire.Tuple    // subsession the Dysco SYN arrived on
		blk     wire.SynBlock // its block
		leave   wire.Tuple    // tuple of the SYN as the middlebox sends it
		tag     uint32        // tag to use instead of ingress's (no ingress run)
		verdict uint32
		next    netip.Addr
		hops    []netip.Addr
		stats   map[string]uint64
		resend  bool // send the tagged SYN twice
	}
	cases := []tc{
		{
			name: "v4 continues to the destination",
			sub:  subIn4, blk: wire.SynBlock{Session: sess4, Nonce: nonceOf(1), Hops: []netip.Addr{serverV4}}, leave: sess4,
			verdict: tcActRedirect, next: serverV4, hops: []netip.Addr{},
		},
		{
			name: "v4 continues to another middlebox",
			sub:  subIn4, blk: wire.SynBlock{Session: sess4, Nonce: nonceOf(2), Hops: []netip.Addr{mbox2V4, serverV4}}, leave: sess4,
			verdict: tcActRedirect, next: mbox2V4, hops: []netip.Addr{serverV4},
		},
		{
			name: "v6 continues to the destination",
			sub:  subIn6, blk: wire.SynBlock{Session: sess6, Nonce: nonceOf(3), Hops: []netip.Addr{serverV6}}, leave: sess6,
			verdict: tcActRedirect, next: serverV6, hops: []netip.Addr{},
		},
		{
			name: "a NAT middlebox changed the tuple: the block carries the new one",
			sub:  subIn4, blk: wire.SynBlock{Session: sess4, Nonce: nonceOf(4), Hops: []netip.Addr{serverV4}},
			leave:   tup(ap("10.1.0.1:50000"), ap("10.9.0.5:80")),
			verdict: tcActRedirect, next: serverV4, hops: []netip.Addr{},
		},
		{
			name: "retransmitted tagged SYN keeps its subsession",
			sub:  subIn4, blk: wire.SynBlock{Session: sess4, Nonce: nonceOf(5), Hops: []netip.Addr{serverV4}}, leave: sess4,
			verdict: tcActRedirect, next: serverV4, hops: []netip.Addr{}, resend: true,
		},
		{
			name: "chain ends here: tag removed, plain SYN",
			sub:  subIn4, blk: wire.SynBlock{Session: sess4, Nonce: nonceOf(6)}, leave: sess4,
			verdict: tcActOK,
		},
		{
			name: "tag with no set-up state", tag: 0x123456, leave: sess4,
			verdict: tcActShot, stats: map[string]uint64{"drop_no_syn_state": 1},
		},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			fx.reset(t)
			id := c.tag
			if c.tag == 0 {
				blk := block(t, c.blk.Session, c.blk.Nonce, c.blk.Hops...)
				verdict, _ := fx.run(t, fx.ingress, dyscoSYN(c.sub, blk, len(blk)).frame(t))
				if verdict != tcActOK {
					t.Fatalf("ingress of the Dysco SYN: verdict %d", verdict)
				}
				id = fx.onlySession(t).ID
			}
			tagged := pkt{seq: 0x11223344, flags: "S", win: 64240, opts: append(synOpts(), optTag(id))}.with(c.leave)
			frame := tagged.frame(t)
			flowsBefore := fx.flows(t)
			var first wire.Tuple
			for i := 0; i < 1+boolInt(c.resend); i++ {
				before := fx.stats(t)
				verdict, out := fx.run(t, fx.egress, frame)
				if verdict != c.verdict {
					t.Fatalf("verdict %d, want %d", verdict, c.verdict)
				}
				want := c.stats
				if i > 0 {
					want = map[string]uint64{"syn_retransmit": 1}
				}
				fx.expectStats(t, before, want)
				switch c.verdict {
				case tcActShot:
					fx.expectNoState(t)
					return
				case tcActOK:
					expectFrame(t, out, tagged.withOpts(synOpts()...))
					fx.expectFlows(t, flowsBefore)
					return
				}
				sub := checkEmitted(t, tagged, out, c.leave, c.blk.Nonce, synOpts(), c.next, c.hops)
				if i == 0 {
					first = sub
				} else if sub != first {
					t.Errorf("retransmission on subsession %v, first SYN on %v", sub, first)
				}
				want2 := map[Tuple]Flow{}
				for k, f := range flowsBefore {
					want2[k] = f
				}
				// The flow routes again only if the next hop's route
				// differs from the session destination's (same_route).
				emit := uint32(FlSYNEmit)
				if !sameRoute(c.leave.Dst, c.next) {
					emit |= FlReroute
				}
				want2[TupleFrom(c.leave)] = flow(sub, id, emit)
				want2[TupleFrom(sub.Reverse())] = flow(c.leave.Reverse(), id, FlIngress|FlRev|FlTap)
				fx.expectFlows(t, want2)
				st, ok := fx.synState(t, id)
				if !ok || st.Emitted != 1 || st.Session != TupleFrom(c.leave) {
					t.Errorf("set-up state %+v (found %v), want emitted, session %v", st, ok, c.leave)
				}
			}
		})
	}
}

// TestSessionsFull fills the session map: new chained sessions are refused
// and counted, and never pass unchained.
func TestSessionsFull(t *testing.T) {
	fx := newFixture(t)
	m := fx.d.Maps()["sessions"]
	const batch = 8192
	keys := make([]uint32, batch)
	vals := make([]Session, batch)
	for base := uint32(0); base < m.MaxEntries(); base += batch {
		for i := range keys {
			keys[i] = 0x800000 + base + uint32(i)
			vals[i] = Session{Role: RoleMiddle, State: StEst}
		}
		if _, err := m.BatchUpdate(keys, vals, nil); err != nil {
			t.Fatalf("fill sessions at %d: %v", base, err)
		}
	}
	if err := m.Put(uint32(1), Session{}); err == nil {
		t.Fatal("session map accepted an entry past its size")
	}
	if err := fx.d.SetPolicies([]PolicyChain{{Hops: []PolicyHop{{Addr: mboxV4}}, ToDst: true}}); err != nil {
		t.Fatal(err)
	}
	if err := fx.d.SetPolicyProgram(loadClassifier(t, fx.d, 1)); err != nil {
		t.Fatal(err)
	}
	blk := block(t, sess4, nonceOf(1), serverV4)
	startSYN := pkt{seq: 1, flags: "S", win: 64240, opts: synOpts()}.with(tup(apOf(hostV4, 40000), apOf(serverV4, 80)))
	cases := []struct {
		name   string
		prog   *ebpf.Program
		in     pkt
		counts map[string]uint64
	}{
		{"chain start on egress", fx.egress, startSYN, map[string]uint64{"drop_sessions_full": 1}},
		{"middlebox host on ingress", fx.ingress, dyscoSYN(subIn4, blk, len(blk)), map[string]uint64{"drop_sessions_full": 1}},
		{"destination on ingress", fx.ingress, func() pkt {
			b := block(t, tup(apOf(clientV4, 40000), apOf(hostV4, 80)), nonceOf(2))
			return dyscoSYN(tup(ap("10.1.0.30:31000"), ap("10.1.0.1:32000")), b, len(b))
		}(), map[string]uint64{"drop_sessions_full": 1}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			before := fx.stats(t)
			verdict, _ := fx.run(t, c.prog, c.in.frame(t))
			if verdict != tcActShot {
				t.Errorf("verdict %d, want %d (refused, never passed unchained)", verdict, tcActShot)
			}
			fx.expectStats(t, before, c.counts)
			if f := fx.flows(t); len(f) != 0 {
				t.Errorf("%d flows left behind", len(f))
			}
			if n := fx.synCount(t); n != 0 {
				t.Errorf("%d set-up states left behind", n)
			}
			var s Session
			for _, k := range []uint32{1, 2, 3, 4, 5} {
				if m.Lookup(k, &s) == nil {
					t.Errorf("session %d exists in a full map", k)
				}
			}
		})
	}
}

// sameRoute tells whether the fixture's namespace routes a and b the same
// way: both behind the gateway (servers), or the same on-link address.
func sameRoute(a, b netip.Addr) bool {
	behind := func(x netip.Addr) bool {
		return netip.MustParsePrefix("10.9.0.0/16").Contains(x) || netip.MustParsePrefix("fd00:9::/64").Contains(x)
	}
	return a == b || (behind(a) && behind(b))
}
