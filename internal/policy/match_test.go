package policy

import (
	"bytes"
	"net/netip"
	"strings"
	"testing"

	"github.com/gopacket/gopacket"
	"github.com/gopacket/gopacket/layers"

	"github.com/dysco/dysco/internal/wire"
)

func tupleOf(src string, sport uint16, dst string, dport uint16) wire.Tuple {
	return wire.Tuple{Src: netip.MustParseAddr(src), Dst: netip.MustParseAddr(dst), SrcPort: sport, DstPort: dport}
}

func TestSessionMatcher(t *testing.T) {
	v4 := tupleOf("10.0.0.1", 40000, "10.0.3.2", 80)
	v6 := tupleOf("2001:db8::1", 40001, "2001:db8:3::2", 443)
	mapped := tupleOf("::ffff:10.0.0.1", 40000, "::ffff:10.0.3.2", 80)
	for _, tc := range []struct {
		expr   string
		v4, v6 bool
	}{
		{"", true, true},
		{"  ", true, true},
		{"tcp", true, true},
		{"udp", false, false},
		{"icmp or icmp6", false, false},
		{"ip", true, false},
		{"ip6", false, true},
		{"host 10.0.0.1", true, false},
		{"src host 10.0.0.1 and dst host 10.0.3.2", true, false},
		{"dst host 10.0.0.1", false, false},
		{"host 2001:db8:3::2", false, true},
		{"src host 2001:db8:3::2", false, false},
		{"tcp dst port 80", true, false},
		{"tcp src port 80", false, false},
		{"tcp port 443", false, true},
		{"tcp dst portrange 1-1024", true, true},
		{"tcp src port 40000 or tcp src port 40001", true, true},
		{"net 10.0.0.0/24", true, false},
		{"dst net 10.0.0.0/24", false, false},
		{"dst net 10.0.0.0/16", true, false},
		{"net 2001:db8::/32", false, true},
		{"src net 2001:db8:3::/48", false, false},
		{"tcp[tcpflags] & tcp-syn != 0", true, false}, // tcp[] is IPv4 only in libpcap
		{"tcp[tcpflags] == tcp-syn", true, false},
		{"tcp[tcpflags] & (tcp-ack|tcp-fin|tcp-rst|tcp-push) != 0", false, false},
		{"ip6[53] & 0x02 != 0", false, true}, // the flags byte of the TCP header after 40 bytes of IPv6
		{"ip6[53] == 0x02", false, true},
		{"ip[8] == 64", true, false},       // TTL
		{"ip6[7] == 64", false, true},      // hop limit
		{"ip[6] & 0x40 != 0", true, false}, // DF
		{"tcp[12] == 0x50", true, false},   // 20-byte TCP header
		{"len == 54", true, false},
		{"len == 74", false, true},
		{"tcp[20] == 0", false, false}, // beyond the header: no options, no payload
		{"not tcp", false, false},
		{"ether dst 02:00:00:00:00:02", true, true},
		{"ether broadcast or ether multicast", false, false},
	} {
		m, err := CompileMatch(tc.expr)
		if err != nil {
			t.Errorf("CompileMatch(%q): %v", tc.expr, err)
			continue
		}
		if m.Expr != tc.expr {
			t.Errorf("CompileMatch(%q).Expr = %q", tc.expr, m.Expr)
		}
		if got := m.Match(v4); got != tc.v4 {
			t.Errorf("%q on %v = %v, want %v", tc.expr, v4, got, tc.v4)
		}
		if got := m.Match(mapped); got != tc.v4 {
			t.Errorf("%q on %v (v4-mapped) = %v, want %v like IPv4", tc.expr, mapped, got, tc.v4)
		}
		if got := m.Match(v6); got != tc.v6 {
			t.Errorf("%q on %v = %v, want %v", tc.expr, v6, got, tc.v6)
		}
	}
}

func TestSessionMatcherBadTuples(t *testing.T) {
	mixed := tupleOf("10.0.0.1", 1, "2001:db8::1", 2)
	var zero wire.Tuple
	all, err := CompileMatch("")
	if err != nil {
		t.Fatal(err)
	}
	tcp, err := CompileMatch("tcp or not tcp")
	if err != nil {
		t.Fatal(err)
	}
	for _, tu := range []wire.Tuple{mixed, zero} {
		if !all.Match(tu) {
			t.Errorf("empty expression on %v = false, want true", tu)
		}
		if tcp.Match(tu) {
			t.Errorf("%q on %v = true, want false (no frame for it)", tcp.Expr, tu)
		}
	}
}

func TestCompileMatchErrors(t *testing.T) {
	for _, tc := range []struct{ expr, want string }{
		{"tcp dst prot 80", `filter "tcp dst prot 80": `},
		{"tcp dst port", "syntax error"},
		{"host 10.0.0.300", `filter "host 10.0.0.300": `},
		{"tcp and (", "syntax error"},
	} {
		m, err := CompileMatch(tc.expr)
		if err == nil || m != nil {
			t.Errorf("CompileMatch(%q) = %v, %v; want an error", tc.expr, m, err)
			continue
		}
		if !strings.Contains(err.Error(), tc.want) {
			t.Errorf("CompileMatch(%q): %v; want it to contain %q", tc.expr, err, tc.want)
		}
	}
	// libpcap's own words come through.
	_, err := CompileMatch("tcp dst port")
	if err == nil || !strings.Contains(err.Error(), "can't parse filter expression") {
		t.Errorf("CompileMatch(\"tcp dst port\"): %v; want libpcap's message", err)
	}
}

// TestSynFrameWellFormed decodes the synthesised SYNs with gopacket and
// serialises them again with lengths and checksums recomputed: the bytes
// must not change (but for gopacket's Ethernet padding).
func TestSynFrameWellFormed(t *testing.T) {
	for _, tu := range []wire.Tuple{
		tupleOf("10.0.0.1", 40000, "10.0.3.2", 80),
		tupleOf("192.168.255.254", 65535, "172.16.0.1", 1),
		tupleOf("2001:db8::1", 40001, "2001:db8:3::2", 443),
		tupleOf("fe80::1", 0, "ff02::fb", 65535),
	} {
		b := synFrame(tu)
		p := gopacket.NewPacket(b, layers.LayerTypeEthernet, gopacket.Default)
		if el := p.ErrorLayer(); el != nil {
			t.Fatalf("%v: frame does not decode: %v", tu, el.Error())
		}
		tcp, _ := p.Layer(layers.LayerTypeTCP).(*layers.TCP)
		if tcp == nil || !tcp.SYN || tcp.ACK || tcp.FIN || tcp.RST || tcp.PSH || tcp.DataOffset != 5 ||
			uint16(tcp.SrcPort) != tu.SrcPort || uint16(tcp.DstPort) != tu.DstPort || len(tcp.Payload) != 0 {
			t.Fatalf("%v: TCP layer %+v", tu, tcp)
		}
		var ls []gopacket.SerializableLayer
		var netLayer gopacket.NetworkLayer
		eth := p.Layer(layers.LayerTypeEthernet).(*layers.Ethernet)
		ls = append(ls, eth)
		if tu.Is4() {
			ip := p.Layer(layers.LayerTypeIPv4).(*layers.IPv4)
			if ip.TTL != 64 || ip.Protocol != layers.IPProtocolTCP || ip.SrcIP.String() != tu.Src.String() || ip.DstIP.String() != tu.Dst.String() {
				t.Fatalf("%v: IPv4 layer %+v", tu, ip)
			}
			netLayer = ip
			ls = append(ls, ip)
		} else {
			ip := p.Layer(layers.LayerTypeIPv6).(*layers.IPv6)
			if ip.HopLimit != 64 || ip.NextHeader != layers.IPProtocolTCP || ip.SrcIP.String() != tu.Src.String() || ip.DstIP.String() != tu.Dst.String() {
				t.Fatalf("%v: IPv6 layer %+v", tu, ip)
			}
			netLayer = ip
			ls = append(ls, ip)
		}
		if err := tcp.SetNetworkLayerForChecksum(netLayer); err != nil {
			t.Fatal(err)
		}
		ls = append(ls, tcp)
		buf := gopacket.NewSerializeBuffer()
		if err := gopacket.SerializeLayers(buf, gopacket.SerializeOptions{FixLengths: true, ComputeChecksums: true}, ls...); err != nil {
			t.Fatal(err)
		}
		// gopacket pads Ethernet frames to the 60-byte minimum, as a NIC
		// does; the SYN the classifier sees at TC egress is not padded.
		want := append(append([]byte(nil), b...), make([]byte, max(0, 60-len(b)))...)
		if !bytes.Equal(buf.Bytes(), want) {
			t.Errorf("%v: frame\n% x\nre-serialised with computed lengths and checksums\n% x", tu, b, buf.Bytes())
		}
	}
}

func TestSessionMatcherProto(t *testing.T) {
	v4 := tupleOf("10.0.0.1", 50000, "10.0.3.2", 4433)
	v6 := tupleOf("2001:db8::1", 50000, "2001:db8:3::2", 4433)
	for _, tc := range []struct {
		expr     string
		tcp, udp bool
	}{
		{"", true, true},
		{"udp dst port 4433", false, true},
		{"tcp dst port 4433", true, false},
		{"port 4433", true, true},
		{"udp and src host 10.0.0.1", false, true},
	} {
		m, err := CompileMatch(tc.expr)
		if err != nil {
			t.Fatal(err)
		}
		if got := m.MatchProto(v4, ipProtoTCP); got != tc.tcp {
			t.Errorf("%q on TCP %v: %v, want %v", tc.expr, v4, got, tc.tcp)
		}
		if got := m.MatchProto(v4, ipProtoUDP); got != tc.udp {
			t.Errorf("%q on UDP %v: %v, want %v", tc.expr, v4, got, tc.udp)
		}
		if tc.expr == "udp and src host 10.0.0.1" {
			continue
		}
		if got := m.MatchProto(v6, ipProtoUDP); got != tc.udp {
			t.Errorf("%q on UDP %v: %v, want %v", tc.expr, v6, got, tc.udp)
		}
	}
	m, _ := CompileMatch("udp")
	if m.MatchProto(tupleOf("10.0.0.1", 1, "2001:db8::1", 2), ipProtoUDP) {
		t.Error("a tuple of two families matched")
	}
}
