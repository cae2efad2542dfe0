package datapath

import (
	"bytes"
	"encoding/binary"
	"net/netip"
	"testing"

	"github.com/gopacket/gopacket"
	"github.com/gopacket/gopacket/layers"

	"github.com/dysco/dysco/internal/wire"
)

// udpFrame is an Ethernet frame of a UDP datagram from src to dst carrying
// payload, with its checksum computed (zeroSum: sent as zero).
func udpFrame(tb testing.TB, src, dst netip.AddrPort, payload []byte, zeroSum bool) []byte {
	tb.Helper()
	udp := &layers.UDP{SrcPort: layers.UDPPort(src.Port()), DstPort: layers.UDPPort(dst.Port())}
	eth := &layers.Ethernet{SrcMAC: macSrc, DstMAC: macDst}
	var ip gopacket.SerializableLayer
	if src.Addr().Is4() {
		eth.EthernetType = layers.EthernetTypeIPv4
		ip4 := &layers.IPv4{Version: 4, Id: 0x4242, TTL: 64, Protocol: layers.IPProtocolUDP,
			SrcIP: src.Addr().AsSlice(), DstIP: dst.Addr().AsSlice()}
		_ = udp.SetNetworkLayerForChecksum(ip4)
		ip = ip4
	} else {
		eth.EthernetType = layers.EthernetTypeIPv6
		ip6 := &layers.IPv6{Version: 6, HopLimit: 64, NextHeader: layers.IPProtocolUDP,
			SrcIP: src.Addr().AsSlice(), DstIP: dst.Addr().AsSlice()}
		_ = udp.SetNetworkLayerForChecksum(ip6)
		ip = ip6
	}
	buf := gopacket.NewSerializeBuffer()
	if err := gopacket.SerializeLayers(buf, gopacket.SerializeOptions{FixLengths: true, ComputeChecksums: true},
		eth, ip, udp, gopacket.Payload(payload)); err != nil {
		tb.Fatal(err)
	}
	b := append([]byte(nil), buf.Bytes()...)
	if zeroSum {
		l4 := 14 + 20
		if src.Addr().Is6() {
			l4 = 14 + 40
		}
		binary.BigEndian.PutUint16(b[l4+6:], 0)
	}
	return b
}

// udpOut decodes a datagram a program left, checks its lengths and its
// checksum (zero allowed over IPv4, meaning none) and returns its tuple,
// payload and checksum.
func udpOut(tb testing.TB, frame []byte) (wire.Tuple, []byte, uint16) {
	tb.Helper()
	p := gopacket.NewPacket(frame, layers.LayerTypeEthernet, gopacket.Default)
	u, _ := p.Layer(layers.LayerTypeUDP).(*layers.UDP)
	if u == nil {
		tb.Fatalf("not a UDP datagram: %v", p)
	}
	var src, dst netip.Addr
	var pseudo []byte
	l4 := 0
	if ip4, ok := p.Layer(layers.LayerTypeIPv4).(*layers.IPv4); ok {
		src, _ = netip.AddrFromSlice(ip4.SrcIP.To4())
		dst, _ = netip.AddrFromSlice(ip4.DstIP.To4())
		if int(ip4.Length) != 20+int(u.Length) {
			tb.Errorf("IPv4 length %d, UDP length %d", ip4.Length, u.Length)
		}
		if fold(sum16(frame[14:34], 0)) != 0xffff {
			tb.Errorf("IPv4 header checksum wrong")
		}
		pseudo = append(append([]byte{}, ip4.SrcIP.To4()...), ip4.DstIP.To4()...)
		l4 = 34
	} else {
		ip6 := p.Layer(layers.LayerTypeIPv6).(*layers.IPv6)
		src, _ = netip.AddrFromSlice(ip6.SrcIP)
		dst, _ = netip.AddrFromSlice(ip6.DstIP)
		if int(ip6.Length) != int(u.Length) {
			tb.Errorf("IPv6 payload length %d, UDP length %d", ip6.Length, u.Length)
		}
		pseudo = append(append([]byte{}, ip6.SrcIP...), ip6.DstIP...)
		l4 = 54
	}
	seg := frame[l4 : l4+int(u.Length)]
	if int(u.Length) != 8+len(u.Payload) {
		tb.Errorf("UDP length %d, payload %d", u.Length, len(u.Payload))
	}
	if u.Checksum != 0 || src.Is6() {
		s := sum16(pseudo, 0)
		s += 17 + uint32(len(seg))
		if fold(sum16(seg, s)) != 0xffff {
			tb.Errorf("UDP checksum %#04x wrong", u.Checksum)
		}
	}
	t := wire.Tuple{Src: src.Unmap(), Dst: dst.Unmap(), SrcPort: uint16(u.SrcPort), DstPort: uint16(u.DstPort)}
	return t, append([]byte(nil), u.Payload...), u.Checksum
}

// udpBlock is a datagram's payload carrying data and a UDP block for the
// session sess with hops, signed for the subsession sub.
func udpBlock(tb testing.TB, data []byte, sess, sub wire.Tuple, hops ...netip.Addr) []byte {
	tb.Helper()
	b, err := (&wire.SynBlock{Session: sess, Proto: wire.ProtoUDP, Nonce: nonceOf(7), Hops: hops, IdleOneWay: 9, IdleStream: 99}).Encode(nil)
	if err != nil {
		tb.Fatal(err)
	}
	wire.SignBlock(fxSynKey, b, sub)
	pad := len(data) & 1
	out := append(append([]byte(nil), data...), make([]byte, pad)...)
	out = append(out, b...)
	m := wire.UDPMarker(len(b), pad)
	return append(out, m[:]...)
}

// TestUDPChainStart: the first datagram of a UDP session that a policy
// matches leaves with the block after its data, signed for its subsession;
// the next ones carry it again on the same subsession until a datagram
// comes back, and then go plain.
func TestUDPChainStart(t *testing.T) {
	fx := newFixture(t)
	classify := loadClassifier(t, fx.d, 1)
	for _, v6 := range []bool{false, true} {
		fx.reset(t)
		host, mbox, server := hostV4, mboxV4, serverV4
		if v6 {
			host, mbox, server = hostV6, mboxV6, serverV6
		}
		if err := fx.d.SetPolicies([]PolicyChain{{Hops: []PolicyHop{{Addr: mbox}}, ToDst: true, IdleS: [2]uint16{11, 222}}}); err != nil {
			t.Fatal(err)
		}
		if err := fx.d.SetPolicyProgram(classify); err != nil {
			t.Fatal(err)
		}
		sess := wire.Tuple{Src: host, Dst: server, SrcPort: 40000, DstPort: 4433}
		var sub wire.Tuple
		for i, data := range [][]byte{[]byte("hello"), []byte("even"), []byte("third!")} {
			before := fx.stats(t)
			v, out := fx.run(t, fx.egress, udpFrame(t, apOf(host, 40000), apOf(server, 4433), data, false))
			if v != tcActRedirect {
				t.Fatalf("v6=%v datagram %d: verdict %d, want redirect (stats %v)", v6, i, v, fx.stats(t))
			}
			got, payload, _ := udpOut(t, out)
			d, blk, ok, err := wire.SplitUDP(payload)
			if !ok || err != nil || string(d) != string(data) {
				t.Fatalf("datagram %d: data %q block %v %v", i, d, ok, err)
			}
			b, err := wire.Decode(blk)
			if err != nil {
				t.Fatalf("datagram %d: block: %v", i, err)
			}
			if b.Proto != wire.ProtoUDP || b.Session != sess || len(b.Hops) != 1 || b.Hops[0] != server || b.IdleOneWay != 11 || b.IdleStream != 222 {
				t.Errorf("datagram %d: block %+v", i, b)
			}
			if !wire.VerifyBlock(fxSynKey, blk, got) {
				t.Errorf("datagram %d: block not signed for %v", i, got)
			}
			if got.Src != host || got.Dst != mbox {
				t.Errorf("datagram %d: subsession %v", i, got)
			}
			if i == 0 {
				sub = got
				fx.expectStats(t, before, map[string]uint64{"setup_start": 1, "rewrite_out": 0})
			} else if got != sub {
				t.Errorf("datagram %d: subsession %v, the first went on %v", i, got, sub)
			}
		}
		s := fx.onlySession(t)
		if s.Proto != ProtoUDP || s.IdleS != [2]uint16{11, 222} || s.Role != RoleStart {
			t.Errorf("session %+v", s.Session)
		}
		// The answer on the subsession: the session, and the rest plain.
		v, out := fx.run(t, fx.ingress, udpFrame(t, apOf(mbox, sub.DstPort), apOf(host, sub.SrcPort), []byte("answer"), false))
		if v != tcActOK {
			t.Fatalf("answer: verdict %d", v)
		}
		if got, payload, _ := udpOut(t, out); got != sess.Reverse() || string(payload) != "answer" {
			t.Errorf("answer delivered as %v %q", got, payload)
		}
		v, out = fx.run(t, fx.egress, udpFrame(t, apOf(host, 40000), apOf(server, 4433), []byte("plain"), false))
		if v != tcActRedirect && v != tcActOK {
			t.Fatalf("after the answer: verdict %d", v)
		}
		if got, payload, _ := udpOut(t, out); got != sub || string(payload) != "plain" {
			t.Errorf("after the answer: %v %q, want %v plain", got, payload, sub)
		}
	}
}

// TestUDPIngress: a datagram with a block sets the session up at a
// middlebox host and reaches the stack as the session's datagram, its data
// unchanged; a zero checksum stays zero; forged, truncated and replayed
// blocks are refused and counted.
func TestUDPIngress(t *testing.T) {
	fx := newFixture(t)
	sess := wire.Tuple{Src: clientV4, Dst: serverV4, SrcPort: 5353, DstPort: 53}
	sub := wire.Tuple{Src: prevV4, Dst: hostV4, SrcPort: 41001, DstPort: 41002}
	good := udpBlock(t, []byte("query"), sess, sub, serverV4)

	before := fx.stats(t)
	v, out := fx.run(t, fx.ingress, udpFrame(t, apOf(sub.Src, sub.SrcPort), apOf(sub.Dst, sub.DstPort), good, false))
	if v != tcActOK {
		t.Fatalf("verdict %d, stats %v", v, fx.stats(t))
	}
	got, payload, _ := udpOut(t, out)
	if got != sess || string(payload) != "query" {
		t.Fatalf("delivered %v %q, want %v \"query\"", got, payload, sess)
	}
	fx.expectStats(t, before, map[string]uint64{"setup_cont": 1})
	s := fx.onlySession(t)
	if s.Proto != ProtoUDP || s.Role != RoleMiddle || s.IdleS != [2]uint16{9, 99} {
		t.Errorf("session %+v", s.Session)
	}
	if _, ok := fx.synState(t, s.ID); !ok {
		t.Error("no set-up state for the rest of the chain")
	}
	// The block again: a retransmission, same session.
	before = fx.stats(t)
	if v, _ := fx.run(t, fx.ingress, udpFrame(t, apOf(sub.Src, sub.SrcPort), apOf(sub.Dst, sub.DstPort), good, false)); v != tcActOK {
		t.Fatalf("again: verdict %d", v)
	}
	fx.expectStats(t, before, map[string]uint64{"syn_retransmit": 1})
	if n := len(fx.sessions(t)); n != 1 {
		t.Errorf("%d sessions after a retransmitted block", n)
	}
	// A plain datagram with no checksum keeps none.
	v, out = fx.run(t, fx.ingress, udpFrame(t, apOf(sub.Src, sub.SrcPort), apOf(sub.Dst, sub.DstPort), []byte("no checksum"), true))
	if v != tcActOK {
		t.Fatalf("zero checksum: verdict %d", v)
	}
	if got, payload, sum := udpOut(t, out); got != sess || string(payload) != "no checksum" || sum != 0 {
		t.Errorf("zero checksum: %v %q checksum %#04x, want zero", got, payload, sum)
	}

	// Bad input on new subsessions: refused, counted, no state left.
	fx.reset(t)
	other := wire.Tuple{Src: prevV4, Dst: hostV4, SrcPort: 41003, DstPort: 41004}
	forged := udpBlock(t, []byte("query"), sess, other, serverV4)
	forged[len(forged)-wire.OptLen-wire.UDPExtLen-wire.AddrLen-3] ^= 1 // a MAC byte
	m := wire.UDPMarker(wire.MaxBlockLen, 0)
	truncated := append(make([]byte, 70), m[:]...)
	tcpBlock := udpBlock(t, []byte("query"), sess, other, serverV4)
	tcpBlock[len(tcpBlock)-wire.OptLen-wire.UDPExtLen-wire.AddrLen-wire.BlockHeaderLen+7] = wire.ProtoTCP
	for _, c := range []struct {
		name    string
		payload []byte
		stat    string
	}{
		{"forged MAC", forged, "drop_bad_mac"},
		{"marker longer than the datagram", truncated, "drop_bad_length"},
		{"replayed on another subsession", good, "drop_bad_mac"},
		{"protocol byte TCP", tcpBlock, "drop_malformed"},
	} {
		before := fx.stats(t)
		v, _ := fx.run(t, fx.ingress, udpFrame(t, apOf(other.Src, other.SrcPort), apOf(other.Dst, other.DstPort), c.payload, false))
		if v != tcActShot {
			t.Errorf("%s: verdict %d, want drop", c.name, v)
		}
		fx.expectStats(t, before, map[string]uint64{c.stat: 1})
		fx.expectNoState(t)
	}

	// A block addressed to another host (this one routes the datagram
	// on, the path between two hops crossing it): forwarded as it is, no
	// state, nothing counted.
	fx.reset(t)
	transit := wire.Tuple{Src: prevV4, Dst: mboxV4, SrcPort: 41005, DstPort: 41006}
	frame := udpFrame(t, apOf(transit.Src, transit.SrcPort), apOf(transit.Dst, transit.DstPort), udpBlock(t, []byte("query"), sess, transit, serverV4), false)
	before = fx.stats(t)
	if v, out := fx.run(t, fx.ingress, frame); v != tcActOK || !bytes.Equal(out, frame) {
		t.Errorf("routed on: verdict %d, changed %v", v, !bytes.Equal(out, frame))
	}
	fx.expectStats(t, before, nil)
	fx.expectNoState(t)
}

// TestUDP6ZeroChecksum: an IPv6 datagram of a session that carries no
// checksum (RFC 6935 allows it for tunnels) leaves with its checksum
// computed, the datagram otherwise as any other of the session.
func TestUDP6ZeroChecksum(t *testing.T) {
	fx := newFixture(t)
	sess := wire.Tuple{Src: clientV6, Dst: serverV6, SrcPort: 4789, DstPort: 4789}
	sub := wire.Tuple{Src: prevV6, Dst: hostV6, SrcPort: 41001, DstPort: 41002}
	if v, _ := fx.run(t, fx.ingress, udpFrame(t, apOf(sub.Src, sub.SrcPort), apOf(sub.Dst, sub.DstPort),
		udpBlock(t, []byte("first"), sess, sub, serverV6), false)); v != tcActOK {
		t.Fatalf("set-up: verdict %d, stats %v", v, fx.stats(t))
	}
	for _, n := range []int{0, 1, 7, 512, 513, 1400} {
		data := make([]byte, n)
		for i := range data {
			data[i] = byte(i*7 + n)
		}
		v, out := fx.run(t, fx.ingress, udpFrame(t, apOf(sub.Src, sub.SrcPort), apOf(sub.Dst, sub.DstPort), data, true))
		if v != tcActOK {
			t.Fatalf("%d bytes: verdict %d, stats %v", n, v, fx.stats(t))
		}
		got, payload, sum := udpOut(t, out) // checks the checksum
		if got != sess || string(payload) != string(data) || sum == 0 {
			t.Errorf("%d bytes: %v, %d bytes, checksum %#04x; want %v, the data, a checksum", n, got, len(payload), sum, sess)
		}
	}
}
