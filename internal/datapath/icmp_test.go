package datapath

import (
	"net"
	"net/netip"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/gopacket/gopacket"
	"github.com/gopacket/gopacket/layers"

	"github.com/dysco/dysco/internal/wire"
)

// icmpErr builds an ICMP(v6) destination-unreachable from router to the
// host, quoting the start of a TCP packet of tuple quoted.
func icmpErr(tb testing.TB, router netip.Addr, quoted pkt) []byte {
	tb.Helper()
	inner := quoted.frame(tb)[14:] // the quoted IP packet
	if len(inner) > 48 {
		inner = inner[:48] // IP header and the first bytes of TCP, as routers quote
	}
	eth := &layers.Ethernet{SrcMAC: macDst, DstMAC: macSrc}
	opts := gopacket.SerializeOptions{FixLengths: true, ComputeChecksums: true}
	buf := gopacket.NewSerializeBuffer()
	var err error
	if router.Is4() {
		eth.EthernetType = layers.EthernetTypeIPv4
		ip := &layers.IPv4{Version: 4, TTL: 64, Protocol: layers.IPProtocolICMPv4, SrcIP: router.AsSlice(), DstIP: quoted.src.Addr().AsSlice()}
		icmp := &layers.ICMPv4{TypeCode: layers.CreateICMPv4TypeCode(layers.ICMPv4TypeDestinationUnreachable, layers.ICMPv4CodeNet)}
		err = gopacket.SerializeLayers(buf, opts, eth, ip, icmp, gopacket.Payload(inner))
	} else {
		eth.EthernetType = layers.EthernetTypeIPv6
		ip := &layers.IPv6{Version: 6, HopLimit: 64, NextHeader: layers.IPProtocolICMPv6, SrcIP: router.AsSlice(), DstIP: quoted.src.Addr().AsSlice()}
		icmp := &layers.ICMPv6{TypeCode: layers.CreateICMPv6TypeCode(layers.ICMPv6TypeDestinationUnreachable, 0)}
		icmp.SetNetworkLayerForChecksum(ip)
		err = gopacket.SerializeLayers(buf, opts, eth, ip, icmp, gopacket.Payload(append([]byte{0, 0, 0, 0}, inner...)))
	}
	if err != nil {
		tb.Fatal(err)
	}
	return append([]byte(nil), buf.Bytes()...)
}

// TestICMPErrorTranslated: an ICMP error quoting a subsession packet this
// host sent is rewritten to quote the session's packet, with every checksum
// right, so that the sending TCP learns of it (a dead next hop).
func TestICMPErrorTranslated(t *testing.T) {
	fx := newFixture(t)
	for _, c := range []struct {
		name         string
		sub, session string // the quoted subsession (as sent) and the session tuple
		router       string
	}{
		{"v4", "10.1.0.1:41001 -> 10.9.0.5:41002", "10.1.0.1:40000 -> 10.9.0.5:80", "10.1.0.254"},
		{"v6", "[fd00:1::1]:41001 -> [fd00:9::5]:41002", "[fd00:1::1]:40000 -> [fd00:9::5]:443", "fd00:1::fe"},
	} {
		t.Run(c.name, func(t *testing.T) {
			fx.reset(t)
			sub, sess := mustTuple(t, c.sub), mustTuple(t, c.session)
			// The reverse subsession's ingress flow maps replies to the session.
			f := Flow{Out: EndsFrom(sess.Reverse()), SessId: 1, Flags: FlIngress | FlRev}
			if err := fx.d.PutFlow(TupleFrom(sub.Reverse()), f, ebpf.UpdateAny); err != nil {
				t.Fatal(err)
			}
			before := fx.stats(t)
			in := icmpErr(t, netip.MustParseAddr(c.router), dataPkt(sub))
			verdict, out := fx.run(t, fx.ingress, in)
			if verdict != tcActOK {
				t.Fatalf("verdict %d", verdict)
			}
			fx.expectStats(t, before, map[string]uint64{"icmp": 1})
			p := gopacket.NewPacket(out[:len(in)], layers.LayerTypeEthernet, gopacket.Default)
			var payload []byte
			if sub.Is4() {
				icmp, _ := p.Layer(layers.LayerTypeICMPv4).(*layers.ICMPv4)
				if icmp == nil {
					t.Fatal("no ICMP in the output")
				}
				// Recompute the ICMP checksum over the message.
				msg := append(append([]byte(nil), icmp.Contents...), icmp.Payload...)
				if fold(sum16(msg, 0)) != 0xffff {
					t.Errorf("ICMP checksum wrong after the rewrite")
				}
				payload = icmp.Payload
			} else {
				icmp, _ := p.Layer(layers.LayerTypeICMPv6).(*layers.ICMPv6)
				if icmp == nil {
					t.Fatal("no ICMPv6 in the output")
				}
				ip := p.Layer(layers.LayerTypeIPv6).(*layers.IPv6)
				msg := append(append([]byte(nil), icmp.Contents...), icmp.Payload...)
				ps := pseudo6(ip.SrcIP, ip.DstIP, len(msg), 58)
				if fold(sum16(msg, sum16(ps, 0))) != 0xffff {
					t.Errorf("ICMPv6 checksum wrong after the rewrite")
				}
				payload = icmp.Payload[4:]
			}
			q := gopacket.NewPacket(payload, map[bool]gopacket.LayerType{true: layers.LayerTypeIPv4, false: layers.LayerTypeIPv6}[sub.Is4()], gopacket.Default)
			var src, dst netip.Addr
			if ip4, ok := q.NetworkLayer().(*layers.IPv4); ok {
				src, _ = netip.AddrFromSlice(ip4.SrcIP)
				dst, _ = netip.AddrFromSlice(ip4.DstIP)
				hdr := payload[:ip4.IHL*4]
				if fold(sum16(hdr, 0)) != 0xffff {
					t.Errorf("quoted IPv4 header checksum wrong after the rewrite")
				}
			} else if ip6, ok := q.NetworkLayer().(*layers.IPv6); ok {
				src, _ = netip.AddrFromSlice(ip6.SrcIP)
				dst, _ = netip.AddrFromSlice(ip6.DstIP)
			}
			tcpOff := 20
			if !sub.Is4() {
				tcpOff = 40
			}
			gotSport := uint16(payload[tcpOff])<<8 | uint16(payload[tcpOff+1])
			gotDport := uint16(payload[tcpOff+2])<<8 | uint16(payload[tcpOff+3])
			if src.Unmap() != sess.Src || dst.Unmap() != sess.Dst || gotSport != sess.SrcPort || gotDport != sess.DstPort {
				t.Errorf("quoted %s:%d -> %s:%d, want the session %v", src, gotSport, dst, gotDport, sess)
			}
		})
	}
}

func mustTuple(tb testing.TB, s string) wire.Tuple {
	tb.Helper()
	t, err := wire.ParseTuple(s)
	if err != nil {
		tb.Fatal(err)
	}
	return t
}

// pseudo6 is the IPv6 pseudo header of an upper-layer checksum.
func pseudo6(src, dst net.IP, length int, next byte) []byte {
	b := append(append([]byte(nil), src.To16()...), dst.To16()...)
	return append(b, byte(length>>24), byte(length>>16), byte(length>>8), byte(length), 0, 0, 0, next)
}
