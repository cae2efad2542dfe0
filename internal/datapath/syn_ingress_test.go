package datapath

import (
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/gopacket/gopacket/layers"

	"github.com/dysco/dysco/internal/wire"
)

// TestIngressDyscoSYN covers a Dysco SYN arriving from the previous hop
// (§2.1): a middlebox host keeps a local tag for its egress (§4.2 "Tagging
// SYN packets"), the session's destination gets a plain SYN; both see the
// session tuple, and a retransmitted SYN finds the same session.
func TestIngressDyscoSYN(t *testing.T) {
	fx := newFixture(t)
	type want struct {
		role   uint8
		tag    bool         // a local tag replaces the marking option
		hops   []netip.Addr // set-up state kept for egress; nil: none
		stat   string
		inFlag uint32 // flags of the ingress flow
	}
	cases := []struct {
		name   string
		sub    wire.Tuple // subsession of the SYN on the wire
		blk    wire.SynBlock
		ipOpts bool
		want   want
	}{
		{
			name: "middlebox host v4, hops remain",
			sub:  subIn4,
			blk:  wire.SynBlock{Session: sess4, Nonce: nonceOf(1), Hops: []netip.Addr{serverV4}},
			want: want{role: RoleMiddle, tag: true, hops: []netip.Addr{serverV4}, stat: "setup_cont", inFlag: FlIngress | FlSYNStrip | FlTap},
		},
		{
			name: "middlebox host v4, two hops remain",
			sub:  subIn4,
			blk:  wire.SynBlock{Session: sess4, Nonce: nonceOf(2), Hops: []netip.Addr{mbox2V4, serverV4}},
			want: want{role: RoleMiddle, tag: true, hops: []netip.Addr{mbox2V4, serverV4}, stat: "setup_cont", inFlag: FlIngress | FlSYNStrip | FlTap},
		},
		{
			name: "middlebox host v4 with IP options",
			sub:  subIn4, ipOpts: true,
			blk:  wire.SynBlock{Session: sess4, Nonce: nonceOf(7), Hops: []netip.Addr{serverV4}},
			want: want{role: RoleMiddle, tag: true, hops: []netip.Addr{serverV4}, stat: "setup_cont", inFlag: FlIngress | FlSYNStrip | FlTap},
		},
		{
			name: "middlebox host v6, hops remain",
			sub:  subIn6,
			blk:  wire.SynBlock{Session: sess6, Nonce: nonceOf(3), Hops: []netip.Addr{serverV6}},
			want: want{role: RoleMiddle, tag: true, hops: []netip.Addr{serverV6}, stat: "setup_cont", inFlag: FlIngress | FlSYNStrip | FlTap},
		},
		{
			name: "destination v4: plain SYN",
			sub:  tup(ap("10.1.0.30:31000"), ap("10.1.0.1:32000")),
			blk:  wire.SynBlock{Session: tup(apOf(clientV4, 40000), apOf(hostV4, 80)), Nonce: nonceOf(4)},
			want: want{role: RoleEnd, stat: "setup_end", inFlag: FlIngress | FlSYNStrip},
		},
		{
			name: "destination v6: plain SYN",
			sub:  tup(ap("[fd00:1::30]:31000"), ap("[fd00:1::1]:32000")),
			blk:  wire.SynBlock{Session: tup(apOf(clientV6, 40000), apOf(hostV6, 443)), Nonce: nonceOf(5)},
			want: want{role: RoleEnd, stat: "setup_end", inFlag: FlIngress | FlSYNStrip},
		},
		{
			name: "chain ends before the destination: tag kept, no hops",
			sub:  subIn4,
			blk:  wire.SynBlock{Session: sess4, Nonce: nonceOf(6)},
			want: want{role: RoleEndFwd, tag: true, hops: []netip.Addr{}, stat: "setup_end", inFlag: FlIngress | FlSYNStrip | FlTap},
		},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			fx.reset(t)
			blk := block(t, c.blk.Session, c.blk.Nonce, c.blk.Hops...)
			in := dyscoSYN(c.sub, blk, len(blk))
			in.ipOpts = c.ipOpts
			frame := in.frame(t)

			before := fx.stats(t)
			verdict, out := fx.run(t, fx.ingress, frame)
			if verdict != tcActOK {
				t.Fatalf("verdict %d, want %d", verdict, tcActOK)
			}
			fx.expectStats(t, before, map[string]uint64{c.want.stat: 1})
			s := fx.onlySession(t)

			// The SYN the stack sees: session tuple, block gone, option
			// turned into the tag or removed.
			exp := in.with(c.blk.Session).withPayload(nil)
			if c.want.tag {
				exp.opts = append(synOpts(), optTag(s.ID))
			} else {
				exp.opts = synOpts()
			}
			expectFrame(t, out, exp)

			if s.ID == 0 || s.ID > 0xffffff {
				t.Errorf("session id %#x outside 24 bits", s.ID)
			}
			if s.Role != c.want.role || s.Tuple != EndsFrom(c.blk.Session) || s.Nonce != c.blk.Nonce ||
				s.State != StSYN || s.Policy != 0 || s.IsV6 != boolU8(!c.sub.Is4()) {
				t.Errorf("session %+v, want role %s tuple %v nonce %x state syn", s.Session, RoleName(c.want.role), c.blk.Session, c.blk.Nonce)
			}
			if f := fx.rawFlows(t)[in.key()]; f.Packets != 1 || f.LastMs != s.CreatedMs {
				t.Errorf("ingress flow counted %d packets at %d, want the SYN at %d", f.Packets, f.LastMs, s.CreatedMs)
			}
			if now := Now(); Age(now, s.CreatedMs) > time.Second || s.LastMs != s.CreatedMs {
				t.Errorf("session created %v ago (stamp %d, last %d, now %d), want now", Age(now, s.CreatedMs), s.CreatedMs, s.LastMs, now)
			}
			fx.expectFlows(t, map[Tuple]Flow{
				in.key():                           flow(c.blk.Session, s.ID, c.want.inFlag),
				TupleFrom(c.blk.Session.Reverse()): flow(c.sub.Reverse(), s.ID, FlReroute|FlRev),
			})
			st, ok := fx.synState(t, s.ID)
			switch {
			case c.want.hops == nil && ok:
				t.Errorf("set-up state kept at the destination: %+v", st)
			case c.want.hops != nil && !ok:
				t.Errorf("no set-up state for the egress")
			case ok:
				if got := hopsOf(st); len(got) != len(c.want.hops) || (len(got) > 0 && !equalAddrs(got, c.want.hops)) {
					t.Errorf("set-up hops %v, want %v", got, c.want.hops)
				}
				if st.Session != TupleFrom(c.blk.Session) || st.Nonce != c.blk.Nonce || st.Emitted != 0 {
					t.Errorf("set-up state %+v", st)
				}
			}

			// A retransmitted SYN (the SYN-ACK was lost) finds the same
			// session and is rewritten the same way.
			before = fx.stats(t)
			verdict, out2 := fx.run(t, fx.ingress, frame)
			if verdict != tcActOK {
				t.Fatalf("retransmission: verdict %d, want %d", verdict, tcActOK)
			}
			fx.expectStats(t, before, map[string]uint64{"syn_retransmit": 1})
			if s2 := fx.onlySession(t); s2.ID != s.ID {
				t.Errorf("retransmission made session %d, first SYN %d", s2.ID, s.ID)
			}
			if string(out2) != string(out) {
				t.Errorf("retransmission rewritten differently:\n got %x\nwant %x", out2, out)
			}
			if n := len(fx.flows(t)); n != 2 {
				t.Errorf("%d flows after the retransmission, want 2", n)
			}
		})
	}

	// A Dysco SYN addressed to another host, which this one routes on
	// (the path between two hops crosses it): forwarded as it is, no
	// state, nothing counted.
	t.Run("routed on", func(t *testing.T) {
		fx.reset(t)
		sub := tup(ap("10.1.0.20:31000"), ap("10.1.0.31:32000"))
		blk := block(t, sess4, nonceOf(8), serverV4)
		frame := dyscoSYN(sub, blk, len(blk)).frame(t)
		before := fx.stats(t)
		if verdict, out := fx.run(t, fx.ingress, frame); verdict != tcActOK || string(out) != string(frame) {
			t.Errorf("verdict %d, changed %v", verdict, string(out) != string(frame))
		}
		fx.expectStats(t, before, nil)
		fx.expectNoState(t)
	})
}

func equalAddrs(a, b []netip.Addr) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

// TestIngressBadSYN feeds Dysco SYNs with broken blocks: each is dropped,
// counted under its reason, and leaves no state. SYNs that are not Dysco
// SYNs pass untouched.
func TestIngressBadSYN(t *testing.T) {
	fx := newFixture(t)
	n := nonceOf(9)
	good := func() []byte { return block(t, sess4, n, serverV4) }
	good6 := func() []byte { return block(t, sess6, n, serverV6) }
	mut := func(b []byte, f func(b []byte)) []byte { f(b); return b }
	hops9 := []netip.Addr{}
	for i := 0; i < 9; i++ {
		hops9 = append(hops9, netip.AddrFrom4([4]byte{10, 1, 0, byte(100 + i)}))
	}
	cases := []struct {
		name    string
		in      pkt
		verdict uint32
		stat    string // counter expected to move by one; "" none
	}{
		{name: "bad magic", in: dyscoSYN(subIn4, mut(good(), func(b []byte) { b[0] = 'X' }), bl(1)), verdict: tcActShot, stat: "drop_bad_magic"},
		{name: "unknown version", in: dyscoSYN(subIn4, mut(good(), func(b []byte) { b[4] = 1 }), bl(1)), verdict: tcActShot, stat: "drop_bad_version"},
		{name: "too many hops, header only", in: dyscoSYN(subIn4, rawBlock(sess4, n, 9), bl(0)), verdict: tcActShot, stat: "drop_too_many_hops"},
		{name: "too many hops, all listed", in: dyscoSYN(subIn4, rawBlock(sess4, n, 9, hops9...), bl(9)), verdict: tcActShot, stat: "drop_too_many_hops"},
		{name: "block length differs from option", in: dyscoSYN(subIn4, good(), bl(0)), verdict: tcActShot, stat: "drop_bad_length"},
		{name: "option announces more than the payload", in: dyscoSYN(subIn4, good(), bl(2)), verdict: tcActShot, stat: "drop_bad_length"},
		{name: "block length differs from hop count", in: dyscoSYN(subIn4, rawBlock(sess4, n, 2, serverV4), bl(1)), verdict: tcActShot, stat: "drop_bad_length"},
		{name: "block shorter than its header", in: dyscoSYN(subIn4, good()[:48], 48), verdict: tcActShot, stat: "drop_bad_length"},
		{name: "marking option without a block", in: dyscoSYN(subIn4, nil, 0), verdict: tcActShot, stat: "drop_bad_length"},
		{name: "truncated block: frame shorter than the IP length", in: func() pkt {
			p := dyscoSYN(subIn4, good(), bl(1))
			p.cut = 20
			return p
		}(), verdict: tcActShot, stat: "drop_malformed"},
		{name: "address list names this host", in: dyscoSYN(subIn4, block(t, sess4, n, hostV4, serverV4), bl(2)), verdict: tcActShot, stat: "drop_loop"},
		{name: "address list names this host v6", in: dyscoSYN(subIn6, block(t, sess6, n, serverV6, hostV6), bl(2)), verdict: tcActShot, stat: "drop_loop"},
		{name: "repeated address", in: dyscoSYN(subIn4, rawBlock(sess4, n, 3, mboxV4, serverV4, mboxV4), bl(3)), verdict: tcActShot, stat: "drop_loop"},
		{name: "mixed families: v6 hop in a v4 block", in: dyscoSYN(subIn4, rawBlock(sess4, n, 1, serverV6), bl(1)), verdict: tcActShot, stat: "drop_malformed"},
		{name: "mixed families: v4 hop in a v6 block", in: dyscoSYN(subIn6, rawBlock(sess6, n, 1, serverV4), bl(1)), verdict: tcActShot, stat: "drop_malformed"},
		{name: "mixed families: v6 session in a v4 SYN", in: dyscoSYN(subIn4, good6(), bl(1)), verdict: tcActShot, stat: "drop_bad_session"},
		{name: "mixed families: session v4 to v6", in: dyscoSYN(subIn4, rawBlock(tup(apOf(clientV4, 40000), apOf(serverV6, 80)), n, 1, serverV4), bl(1)), verdict: tcActShot, stat: "drop_bad_session"},
		{name: "zero source port in session tuple", in: dyscoSYN(subIn4, rawBlock(tup(apOf(clientV4, 0), apOf(serverV4, 80)), n, 1, serverV4), bl(1)), verdict: tcActShot, stat: "drop_bad_session"},
		{name: "zero destination port in session tuple", in: dyscoSYN(subIn6, rawBlock(tup(apOf(clientV6, 40000), apOf(serverV6, 0)), n, 1, serverV6), bl(1)), verdict: tcActShot, stat: "drop_bad_session"},
		{name: "flags set", in: dyscoSYN(subIn4, mut(good(), func(b []byte) { b[5] = 1 }), bl(1)), verdict: tcActShot, stat: "drop_malformed"},
		{name: "protocol not TCP", in: dyscoSYN(subIn6, mut(good6(), func(b []byte) { b[7] = 17 }), bl(1)), verdict: tcActShot, stat: "drop_malformed"},
		{
			name: "marking option's byte 5 set",
			in: func() pkt {
				p := dyscoSYN(subIn4, good(), bl(1))
				o := wire.Option(bl(1))
				o[5] = 1
				p.opts[len(p.opts)-1] = optRaw(o[:]...)
				return p
			}(),
			verdict: tcActShot, stat: "drop_malformed",
		},
		{name: "session from an end to itself", in: dyscoSYN(subIn4, rawBlock(tup(apOf(clientV4, 40000), apOf(clientV4, 40000)), n, 1, serverV4), bl(1)), verdict: tcActShot, stat: "drop_bad_session"},
		{name: "session from an end to itself v6", in: dyscoSYN(subIn6, rawBlock(tup(apOf(serverV6, 443), apOf(serverV6, 443)), n, 1, serverV6), bl(1)), verdict: tcActShot, stat: "drop_bad_session"},
		{name: "unspecified session source", in: dyscoSYN(subIn4, rawBlock(tup(apOf(netip.AddrFrom4([4]byte{}), 40000), apOf(serverV4, 80)), n, 1, serverV4), bl(1)), verdict: tcActShot, stat: "drop_bad_session"},
		{name: "loopback session source", in: dyscoSYN(subIn4, rawBlock(tup(apOf(netip.MustParseAddr("127.0.0.1"), 40000), apOf(serverV4, 80)), n, 1, serverV4), bl(1)), verdict: tcActShot, stat: "drop_bad_session"},
		{name: "multicast session destination v6", in: dyscoSYN(subIn6, rawBlock(tup(apOf(clientV6, 40000), apOf(netip.MustParseAddr("ff02::1"), 80)), n, 1, serverV6), bl(1)), verdict: tcActShot, stat: "drop_bad_session"},
		{name: "broadcast session destination", in: dyscoSYN(subIn4, rawBlock(tup(apOf(clientV4, 40000), apOf(netip.AddrFrom4([4]byte{255, 255, 255, 255}), 80)), n, 1, serverV4), bl(1)), verdict: tcActShot, stat: "drop_bad_session"},
		{name: "unspecified hop v4", in: dyscoSYN(subIn4, rawBlock(sess4, n, 1, netip.AddrFrom4([4]byte{})), bl(1)), verdict: tcActShot, stat: "drop_malformed"},
		{name: "unspecified hop v6", in: dyscoSYN(subIn6, rawBlock(sess6, n, 1, netip.IPv6Unspecified()), bl(1)), verdict: tcActShot, stat: "drop_malformed"},
		{name: "loopback hop", in: dyscoSYN(subIn4, rawBlock(sess4, n, 2, mboxV4, netip.MustParseAddr("127.0.0.2")), bl(2)), verdict: tcActShot, stat: "drop_malformed"},
		{name: "loopback hop v6", in: dyscoSYN(subIn6, rawBlock(sess6, n, 1, netip.IPv6Loopback()), bl(1)), verdict: tcActShot, stat: "drop_malformed"},
		{name: "multicast hop", in: dyscoSYN(subIn4, rawBlock(sess4, n, 1, netip.MustParseAddr("224.0.0.5")), bl(1)), verdict: tcActShot, stat: "drop_malformed"},
		{name: "multicast hop v6", in: dyscoSYN(subIn6, rawBlock(sess6, n, 1, netip.MustParseAddr("ff05::2")), bl(1)), verdict: tcActShot, stat: "drop_malformed"},
		{name: "broadcast hop", in: dyscoSYN(subIn4, rawBlock(sess4, n, 1, netip.AddrFrom4([4]byte{255, 255, 255, 255})), bl(1)), verdict: tcActShot, stat: "drop_malformed"},
		{
			name: "local tag arriving from the wire is forged",
			in: func() pkt {
				p := dyscoSYN(subIn4, nil, 0)
				p.opts = append(synOpts(), optTag(1))
				return p
			}(),
			verdict: tcActShot, stat: "drop_malformed",
		},
		{
			name: "kind 253 option of another experiment is not Dysco",
			in: func() pkt {
				p := dyscoSYN(subIn4, good(), bl(1))
				p.opts = append(synOpts(), optRaw(253, 8, 0x12, 0x34, 1, 0, 0, byte(bl(1))))
				return p
			}(),
			verdict: tcActOK,
		},
		{
			name: "TCP Fast Open SYN with data is not Dysco",
			in: func() pkt {
				p := pkt{seq: 1, flags: "S", win: 64240, payload: []byte("GET / HTTP/1.1\r\n\r\n"),
					opts: append(synOpts(), optRaw(34, 10, 1, 2, 3, 4, 5, 6, 7, 8), optNOP(), optNOP())}
				return p.with(subIn4)
			}(),
			verdict: tcActOK,
		},
		{
			name: "TFO SYN whose data looks like a block",
			in: func() pkt {
				p := pkt{seq: 1, flags: "S", win: 64240, payload: good(),
					opts: append(synOpts(), optRaw(34, 10, 1, 2, 3, 4, 5, 6, 7, 8), optNOP(), optNOP())}
				return p.with(subIn4)
			}(),
			verdict: tcActOK,
		},
		{
			name: "marking option not last",
			in: func() pkt {
				p := dyscoSYN(subIn4, good(), bl(1))
				p.opts = append([]layers.TCPOption{optDysco(bl(1))}, synOpts()...)
				return p
			}(),
			verdict: tcActOK,
		},
		{
			name: "SYN-ACK with a marking option is not a Dysco SYN",
			in: func() pkt {
				p := dyscoSYN(subIn4, good(), bl(1))
				p.flags, p.ack = "SA", 1
				return p
			}(),
			verdict: tcActOK,
		},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			fx.reset(t)
			frame := c.in.frame(t)
			before := fx.stats(t)
			verdict, out := fx.run(t, fx.ingress, frame)
			if verdict != c.verdict {
				t.Errorf("verdict %d, want %d", verdict, c.verdict)
			}
			want := map[string]uint64{}
			if c.stat != "" {
				want[c.stat] = 1
			}
			fx.expectStats(t, before, want)
			fx.expectNoState(t)
			if c.verdict == tcActOK && string(out) != string(frame) {
				t.Errorf("packet changed:\n got %x\nwant %x", out, frame)
			}
		})
	}
}

// TestPrependHops: a middlebox host's agent prepends hops to the rest of a
// held SYN's address list (paper §2.2), and refuses lists the next hop
// would drop: another family, an address that is not unicast, an address
// twice, too many hops.
func TestPrependHops(t *testing.T) {
	fx := newFixture(t)
	frame := dyscoSYN(subIn4, block(t, sess4, nonceOf(4), serverV4), bl(1)).frame(t)
	if verdict, _ := fx.run(t, fx.ingress, frame); verdict != tcActOK {
		t.Fatalf("verdict %d for the SYN", verdict)
	}
	ss := fx.sessions(t)
	if len(ss) != 1 {
		t.Fatalf("%d sessions", len(ss))
	}
	id := ss[0].ID
	many := []netip.Addr{}
	for i := 0; i < wire.MaxHops; i++ {
		many = append(many, netip.AddrFrom4([4]byte{10, 1, 0, byte(100 + i)}))
	}
	for _, tc := range []struct {
		hops []netip.Addr
		want string
	}{
		{[]netip.Addr{serverV6}, "not of the session's address family"},
		{[]netip.Addr{netip.MustParseAddr("224.0.0.1")}, "224.0.0.1 is not a unicast address"},
		{[]netip.Addr{netip.MustParseAddr("127.0.0.2")}, "127.0.0.2 is not a unicast address"},
		{[]netip.Addr{mbox2V4, serverV4}, "would appear twice"},
		{many, "at most 8"},
	} {
		if _, err := fx.d.PrependHops(id, tc.hops); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("prepend %v: %v, want %q", tc.hops, err, tc.want)
		}
	}
	chain, err := fx.d.PrependHops(id, []netip.Addr{mbox2V4})
	if err != nil || !equalAddrs(chain, []netip.Addr{mbox2V4, serverV4}) {
		t.Fatalf("prepend %v: chain %v, %v", mbox2V4, chain, err)
	}
}
