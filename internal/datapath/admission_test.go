package datapath

import (
	"encoding/binary"
	"net/netip"
	"testing"

	"github.com/dysco/dysco/internal/wire"
)

// TestIngressAdmission: a Dysco SYN sets up a session only if a key of the
// datapath verifies its MAC for the subsession it arrives on, or if it comes
// from a trusted prefix (bpf/include/admit.h). Forged, altered and replayed
// blocks are dropped and counted before any state is made; during a key
// rotation both keys verify.
func TestIngressAdmission(t *testing.T) {
	fx := newFixture(t)
	keyOld := wire.MACKey{0x01, 0xd1}
	keyNew := wire.MACKey{0x02, 0xe2}
	n := nonceOf(0x31)
	blk := func() []byte { return block(t, sess4, n, serverV4) }
	elsewhere := tup(ap("10.1.0.21:31000"), ap("10.1.0.1:32000")) // another previous hop
	otherPort := tup(ap("10.1.0.20:31001"), ap("10.1.0.1:32000")) // the same hop, another port
	otherDst := tup(ap("10.1.0.20:31000"), ap("10.1.0.99:32000")) // signed for another receiver
	mut := func(b []byte, f func(b []byte)) []byte { f(b); return b }
	type keys struct {
		cur, prev *wire.MACKey
		trusted   []netip.Prefix
	}
	fxKeys := keys{cur: &fxSynKey}
	cases := []struct {
		name  string
		keys  keys
		sub   wire.Tuple // the SYN's subsession
		blk   []byte     // as sent: sign it with signed() where it should verify
		admit bool
		stat  string // the drop counter when not admitted
	}{
		{name: "MAC of the current key", keys: fxKeys, sub: subIn4, blk: signed(fxSynKey, blk(), subIn4), admit: true},
		{name: "MAC of the current key, v6", keys: fxKeys, sub: subIn6, blk: signed(fxSynKey, block(t, sess6, n, serverV6), subIn6), admit: true},
		{name: "no MAC", keys: fxKeys, sub: subIn4, blk: blk(), stat: "drop_bad_mac"},
		{name: "forged MAC", keys: fxKeys, sub: subIn4, blk: mut(blk(), func(b []byte) {
			binary.LittleEndian.PutUint64(b[wire.MACOff:], 0x0123456789abcdef)
		}), stat: "drop_bad_mac"},
		{name: "MAC under a key this host does not have", keys: fxKeys, sub: subIn4, blk: signed(keyOld, blk(), subIn4), stat: "drop_bad_mac"},
		{name: "hop list altered after signing", keys: fxKeys, sub: subIn4, blk: mut(signed(fxSynKey, blk(), subIn4), func(b []byte) {
			a := mbox2V4.As16()
			copy(b[wire.BlockHeaderLen:], a[:])
		}), stat: "drop_bad_mac"},
		{name: "nonce altered after signing", keys: fxKeys, sub: subIn4, blk: mut(signed(fxSynKey, blk(), subIn4), func(b []byte) { b[8] ^= 1 }), stat: "drop_bad_mac"},
		{name: "session port altered after signing", keys: fxKeys, sub: subIn4, blk: mut(signed(fxSynKey, blk(), subIn4), func(b []byte) { b[49] ^= 1 }), stat: "drop_bad_mac"},
		{name: "replayed from another address", keys: fxKeys, sub: elsewhere, blk: signed(fxSynKey, blk(), subIn4), stat: "drop_bad_mac"},
		{name: "replayed from another port", keys: fxKeys, sub: otherPort, blk: signed(fxSynKey, blk(), subIn4), stat: "drop_bad_mac"},
		{name: "signed for another receiver", keys: fxKeys, sub: subIn4, blk: signed(fxSynKey, blk(), otherDst), stat: "drop_bad_mac"},
		{name: "rotation: the previous key verifies", keys: keys{cur: &keyNew, prev: &keyOld}, sub: subIn4, blk: signed(keyOld, blk(), subIn4), admit: true},
		{name: "rotation: the new key verifies", keys: keys{cur: &keyNew, prev: &keyOld}, sub: subIn4, blk: signed(keyNew, blk(), subIn4), admit: true},
		{name: "rotation done: the old key is refused", keys: keys{cur: &keyNew}, sub: subIn4, blk: signed(keyOld, blk(), subIn4), stat: "drop_bad_mac"},
		{name: "no key, no trusted prefix: refused", keys: keys{}, sub: subIn4, blk: signed(fxSynKey, blk(), subIn4), stat: "drop_untrusted"},
		{name: "no key, trusted source", keys: keys{trusted: []netip.Prefix{netip.MustParsePrefix("10.1.0.16/28")}}, sub: subIn4, blk: blk(), admit: true},
		{name: "no key, source outside the trusted prefix", keys: keys{trusted: []netip.Prefix{netip.MustParsePrefix("10.1.0.16/28")}},
			sub: tup(ap("10.1.0.40:31000"), ap("10.1.0.1:32000")), blk: blk(), stat: "drop_untrusted"},
		{name: "no key, trusted v6 prefix", keys: keys{trusted: []netip.Prefix{netip.MustParsePrefix("fd00:1::/64")}}, sub: subIn6, blk: block(t, sess6, n, serverV6), admit: true},
		{name: "key and trusted prefix: bad MAC from the prefix", keys: keys{cur: &fxSynKey, trusted: []netip.Prefix{netip.MustParsePrefix("10.1.0.20/32")}},
			sub: subIn4, blk: blk(), admit: true},
		{name: "key and trusted prefix: bad MAC from elsewhere", keys: keys{cur: &fxSynKey, trusted: []netip.Prefix{netip.MustParsePrefix("10.1.0.20/32")}},
			sub: elsewhere, blk: blk(), stat: "drop_bad_mac"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			fx.reset(t)
			if err := fx.d.SetSynKeys(c.keys.cur, c.keys.prev); err != nil {
				t.Fatal(err)
			}
			if err := fx.d.SetTrusted(c.keys.trusted); err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() {
				_ = fx.d.SetSynKeys(&fxSynKey, nil)
				_ = fx.d.SetTrusted(nil)
			})
			in := dyscoSYNRaw(c.sub, c.blk, len(c.blk))
			before := fx.stats(t)
			verdict, _ := fx.run(t, fx.ingress, in.frame(t))
			if c.admit {
				if verdict != tcActOK {
					t.Fatalf("verdict %d, want %d (admitted)", verdict, tcActOK)
				}
				fx.expectStats(t, before, map[string]uint64{"setup_cont": 1})
				if s := fx.onlySession(t); s.Nonce != n {
					t.Errorf("session nonce %x, want the block's %x", s.Nonce, n)
				}
				return
			}
			if verdict != tcActShot {
				t.Fatalf("verdict %d, want %d (dropped)", verdict, tcActShot)
			}
			fx.expectStats(t, before, map[string]uint64{c.stat: 1})
			fx.expectNoState(t)
		})
	}
	if err := fx.d.SetSynKeys(nil, &keyOld); err == nil {
		t.Error("a previous key without a current one is accepted")
	}
}

// TestHalfOpenBudget: one source (a previous hop's IPv4 address or IPv6
// /64) sets up at most its budget of half-open sessions; more are dropped
// and counted, while other sources and retransmissions go on. A session
// gives its count back once: established, freed, or released by the
// collector.
func TestHalfOpenBudget(t *testing.T) {
	const budget = 3
	fx := newFixtureWith(t, func(_ *testNet, cfg *Config) { cfg.HalfOpenPerSource = budget })
	if got := fx.d.HalfOpenPerSource(); got != budget {
		t.Fatalf("budget %d, want %d", got, budget)
	}
	// Session k from the previous hop src: its own session and subsession
	// ports.
	syn := func(src netip.Addr, k uint16) (pkt, wire.Tuple, wire.Tuple) {
		sess := tup(apOf(clientV4, 40000+k), apOf(serverV4, 80))
		sub := tup(apOf(src, 31000+k), apOf(hostV4, 32000))
		if src.Is6() {
			sess = tup(apOf(clientV6, 40000+k), apOf(serverV6, 443))
			sub = tup(apOf(src, 31000+k), apOf(hostV6, 32000))
		}
		return dyscoSYN(sub, block(t, sess, nonceOf(byte(k)), sess.Dst), bl(1)), sess, sub
	}
	run := func(p pkt, verdict uint32, stats map[string]uint64) {
		t.Helper()
		before := fx.stats(t)
		if v, _ := fx.run(t, fx.ingress, p.frame(t)); v != verdict {
			t.Fatalf("verdict %d, want %d", v, verdict)
		}
		fx.expectStats(t, before, stats)
	}
	setup := map[string]uint64{"setup_cont": 1}
	over := map[string]uint64{"drop_half_open": 1}

	fx.reset(t)
	var first pkt
	var firstSess, firstSub wire.Tuple
	for k := uint16(1); k <= budget; k++ {
		p, sess, sub := syn(prevV4, k)
		if k == 1 {
			first, firstSess, firstSub = p, sess, sub
		}
		run(p, tcActOK, setup)
	}
	if got := fx.d.HalfOpen(prevV4); got != budget {
		t.Fatalf("%d half-open sessions counted for %s, want %d", got, prevV4, budget)
	}
	p4, _, _ := syn(prevV4, 4)
	run(p4, tcActShot, over)
	if got := len(fx.sessions(t)); got != budget {
		t.Fatalf("%d sessions after a SYN over budget, want %d", got, budget)
	}
	// A retransmitted SYN of a session set up already is no new session.
	run(first, tcActOK, map[string]uint64{"syn_retransmit": 1})
	// Another source has its own budget.
	other := netip.MustParseAddr("10.1.0.21")
	po, _, _ := syn(other, 5)
	run(po, tcActOK, setup)
	if got := fx.d.HalfOpen(other); got != 1 {
		t.Errorf("%d half-open sessions counted for %s, want 1", got, other)
	}

	// Established: the SYN-ACK leaves towards the previous hop, the ACK
	// comes in; the count goes back once.
	synack := pkt{seq: 0x55555555, ack: 0x11223345, flags: "SA", win: 65160, opts: synOpts()}
	if v, _ := fx.run(t, fx.egress, synack.with(firstSess.Reverse()).frame(t)); v == tcActShot {
		t.Fatalf("SYN-ACK dropped")
	}
	ack := pkt{seq: 0x11223345, ack: 0x55555556, flags: "A", win: 502}
	if v, _ := fx.run(t, fx.ingress, ack.with(firstSub).frame(t)); v == tcActShot {
		t.Fatalf("ACK dropped")
	}
	if got := fx.d.HalfOpen(prevV4); got != budget-1 {
		t.Fatalf("%d half-open sessions counted after one was established, want %d", got, budget-1)
	}
	fx.run(t, fx.ingress, ack.with(firstSub).frame(t))
	if got := fx.d.HalfOpen(prevV4); got != budget-1 {
		t.Fatalf("%d counted after a second ACK, want %d", got, budget-1)
	}
	run(p4, tcActOK, setup)
	run(func() pkt { p, _, _ := syn(prevV4, 6); return p }(), tcActShot, over)

	// Freed (dysco_ctl) or released by the collector: back once each.
	var ids []uint32
	for _, s := range fx.sessions(t) {
		if s.HoSrc == HalfOpenSource(prevV4) {
			ids = append(ids, s.ID)
		}
	}
	if len(ids) != budget {
		t.Fatalf("%d sessions of %s still counted, want %d", len(ids), prevV4, budget)
	}
	if _, err := fx.d.FreeSession(ids[0], Tuple{}); err != nil {
		t.Fatal(err)
	}
	if got := fx.d.HalfOpen(prevV4); got != budget-1 {
		t.Fatalf("%d counted after a session was freed, want %d", got, budget-1)
	}
	fx.d.ReleaseHalfOpen(ids[1:2])
	fx.d.ReleaseHalfOpen(ids[1:2])
	if got := fx.d.HalfOpen(prevV4); got != budget-2 {
		t.Fatalf("%d counted after a release (twice) of one session, want %d", got, budget-2)
	}

	// IPv6: one budget per /64.
	fx.reset(t)
	a, b := netip.MustParseAddr("fd00:1::20"), netip.MustParseAddr("fd00:1::ab:21")
	for k := uint16(1); k <= budget; k++ {
		src := a
		if k%2 == 0 {
			src = b
		}
		p, _, _ := syn(src, k)
		run(p, tcActOK, setup)
	}
	p6, _, _ := syn(b, 4)
	run(p6, tcActShot, over)
	p6o, _, _ := syn(netip.MustParseAddr("fd00:2::20"), 5)
	run(p6o, tcActOK, setup)
}

// TestHalfOpenSource: the budget is per IPv4 address and per IPv6 /64.
func TestHalfOpenSource(t *testing.T) {
	for _, c := range []struct {
		a, b string
		same bool
	}{
		{"10.0.0.1", "10.0.0.1", true},
		{"10.0.0.1", "10.0.0.2", false},
		{"10.0.0.1", "::ffff:10.0.0.1", true},
		{"fd00:1::1", "fd00:1::ffff:2", true},
		{"fd00:1::1", "fd00:2::1", false},
	} {
		if got := HalfOpenSource(netip.MustParseAddr(c.a)) == HalfOpenSource(netip.MustParseAddr(c.b)); got != c.same {
			t.Errorf("%s and %s share a budget: %v, want %v", c.a, c.b, got, c.same)
		}
	}
}

// TestSessionNonces: the loader gives the datapath a random nonce key, and
// the sessions started here get nonces made under it, all different.
func TestSessionNonces(t *testing.T) {
	fx := newFixture(t)
	var k dyscoMacKey
	if err := fx.d.Maps()["keys"].Lookup(uint32(keyNonce), &k); err != nil || k.Set == 0 || k.K0|k.K1 == 0 {
		t.Fatalf("no nonce key after Load: %+v (%v)", k, err)
	}
	if err := fx.d.SetPolicies([]PolicyChain{{Hops: []PolicyHop{{Addr: mboxV4}}, ToDst: true}}); err != nil {
		t.Fatal(err)
	}
	if err := fx.d.SetPolicyProgram(loadClassifier(t, fx.d, 1)); err != nil {
		t.Fatal(err)
	}
	const n = 64
	for i := range n {
		p := pkt{seq: 0xabcdef01, flags: "S", win: 64240, opts: synOpts()}
		if v, _ := fx.run(t, fx.egress, p.with(tup(apOf(hostV4, uint16(40000+i)), apOf(serverV4, 80))).frame(t)); v != tcActRedirect {
			t.Fatalf("SYN %d: verdict %d, want %d", i, v, tcActRedirect)
		}
	}
	seen := map[[wire.NonceLen]byte]bool{}
	for _, s := range fx.sessions(t) {
		if s.Nonce == ([wire.NonceLen]byte{}) || seen[s.Nonce] {
			t.Errorf("nonce %x zero or seen before", s.Nonce)
		}
		seen[s.Nonce] = true
	}
	if len(seen) != n {
		t.Errorf("%d nonces, want %d", len(seen), n)
	}
}
