package policy

import (
	"bytes"
	"errors"
	"math/rand/v2"
	"net/netip"
	"testing"

	"github.com/gopacket/gopacket"
	"github.com/gopacket/gopacket/layers"

	"github.com/dysco/dysco/internal/api"
)

func TestProtocols(t *testing.T) {
	const (
		tcp   = ProtoSet(TCP)
		udp   = ProtoSet(UDP)
		icmp  = ProtoSet(ICMP)
		other = ProtoSet(Other)
		all   = tcp | udp | icmp | other
	)
	for _, tc := range []struct {
		filter string
		want   ProtoSet
	}{
		{"tcp", tcp},
		{"tcp dst port 80", tcp},
		{"udp", udp},
		{"udp dst port 4433", udp},
		{"udp dst port 4433 and dst host 10.0.3.2", udp},
		{"port 53", tcp | udp | other}, // libpcap's port also means SCTP
		{"tcp port 53 or udp port 53", tcp | udp},
		{"host 10.0.3.2", all},
		{"src host 10.0.3.1 and dst host 10.0.3.2 and src port 5000 and dst port 6000", tcp | udp | other},
		{"ip6 host 2001:db8::5 or ip6 host 2001:db8::6", all},
		{"ip6 src host 2001:db8::5 and ip6 dst host 2001:db8::6 and udp dst port 443", udp},
		{"net 10.0.0.0/8 and not net 10.1.0.0/16", all},
		{"dst portrange 1000-2000 and udp", udp},
		{"udp and udp[2:2] > 1023", udp},
		{"icmp", icmp},
		{"icmp6", icmp},
		{"icmp or icmp6", icmp},
		{"icmp[icmptype] = icmp-echoreply", icmp},
		{"ip6 and udp", udp},
		{"ip and udp", udp},
		{"sctp", other},
		{"sctp port 5000", other},
		{"ip proto 47", other},
		{"ip proto 47 or ip proto 50", other},
		{"ip6 proto 99", other},
		{"ip proto 253", other},
		{"dst portrange 1000-2000", tcp | udp | other},
		{"tcp and not dst portrange 1-65535", tcp}, // port 0
		{"tcp or udp", tcp | udp},
		{"not tcp", udp | icmp | other},
		{"not udp and not icmp", tcp | icmp | other}, // icmp6 is not icmp to libpcap
		{"ip", all},
		{"ip6", all},
		{"udp[8:4] = 0x12345678", udp},
		{"tcp[tcpflags] & tcp-syn != 0", tcp},
		{"tcp[tcpflags] & tcp-ack != 0", 0},
		{"tcp[tcpflags] == tcp-syn|tcp-ack", 0},
		{"ether src 02:00:00:00:00:99 and tcp", tcp},
		{"ip[8] = 1 and udp", udp},
		{"vlan and tcp", 0},
		{"ip[6:2] & 0x1fff != 0", 0},
		{"arp", 0},
		{"greater 1000", 0},
		{"less 80 and tcp", tcp},
		{"ip and ip[1] & 0xfc = 0xb8 and tcp dst port 443", tcp},
	} {
		t.Run(tc.filter, func(t *testing.T) {
			f, err := CompileFilter(tc.filter)
			if err != nil {
				t.Fatal(err)
			}
			if got := f.Protocols(); got != tc.want {
				t.Errorf("Protocols(%q) = %v, want %v", tc.filter, got, tc.want)
			}
		})
	}
}

// TestProtocolsOfTestFilters runs the probes over the filters the classifier
// tests use: the shapes operators write and every instruction libpcap emits.
func TestProtocolsOfTestFilters(t *testing.T) {
	for _, f := range append(realisticFilters(12), oracleFilters...) {
		cf, err := CompileFilter(f)
		if err != nil {
			t.Fatal(err)
		}
		t.Logf("%-90s %v", f, cf.Protocols())
	}
}

func BenchmarkProtocols(b *testing.B) {
	f, err := CompileFilter("tcp and (port 443 or port 8443) and not src net 10.0.0.0/8")
	if err != nil {
		b.Fatal(err)
	}
	for b.Loop() {
		f.Protocols()
	}
}

func TestCompileRefusesUnchained(t *testing.T) {
	for _, tc := range []struct {
		p    api.Policy
		want string // error; "" when accepted
		note string // Compiled.Note when accepted
	}{
		{api.Policy{Name: "quic", Filter: "udp dst port 4433 and dst host 10.0.3.2"}, "", ""},
		{api.Policy{Name: "web", Filter: "tcp dst port 80"}, "", ""},
		{api.Policy{Name: "both", Filter: "tcp or udp"}, "", ""},
		{api.Policy{Name: "ping", Filter: "icmp"},
			`policy "ping": filter "icmp" matches only icmp packets; dysco chains tcp and udp sessions`, ""},
		{api.Policy{Name: "tun", Filter: "ip proto 47 or sctp or icmp6"},
			`policy "tun": filter "ip proto 47 or sctp or icmp6" matches only icmp and other packets; dysco chains tcp and udp sessions`, ""},
		{api.Policy{Name: "acks", Filter: "tcp[tcpflags] & tcp-ack != 0"},
			`policy "acks": filter "tcp[tcpflags] & tcp-ack != 0" matches no first packet of a session dysco can chain ` +
				`(a TCP SYN or a UDP datagram, untagged, over IPv4 without fragmentation or IPv6 without extension headers); ` +
				`dysco chains tcp and udp sessions`, ""},
		{api.Policy{Name: "web", Filter: "host 10.0.3.2"}, "",
			`policy "web" chains tcp and udp sessions; other packets its filter matches (icmp and other) pass unchained`},
		{api.Policy{Name: "dns", Filter: "tcp port 53 or icmp"}, "",
			`policy "dns" chains tcp sessions; other packets its filter matches (icmp) pass unchained`},
	} {
		t.Run(tc.p.Filter, func(t *testing.T) {
			c, err := Compile(tc.p)
			if tc.want != "" {
				var ue *UnchainedError
				if err == nil || err.Error() != tc.want || !errors.As(err, &ue) {
					t.Fatalf("Compile error\n got %v\nwant %s", err, tc.want)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if got := c.Note(); got != tc.note {
				t.Errorf("Note\n got %q\nwant %q", got, tc.note)
			}
		})
	}
}

// TestFirstPacket decodes the first packets with gopacket and checks their
// lengths and checksums.
func TestFirstPacket(t *testing.T) {
	for _, tc := range []struct {
		proto    uint8
		src, dst string
		layer    gopacket.LayerType
	}{
		{ipProtoTCP, "10.0.1.1:5000", "10.0.3.2:80", layers.LayerTypeTCP},
		{ipProtoTCP, "[2001:db8::1]:5000", "[2001:db8::2]:80", layers.LayerTypeTCP},
		{ipProtoUDP, "10.0.1.1:5000", "10.0.3.2:4433", layers.LayerTypeUDP},
		{ipProtoUDP, "[2001:db8::1]:5000", "[2001:db8::2]:4433", layers.LayerTypeUDP},
		{ipProtoICMP, "10.0.1.1:0", "10.0.3.2:0", layers.LayerTypeICMPv4},
		{ipProtoICMP, "[2001:db8::1]:0", "[2001:db8::2]:0", layers.LayerTypeICMPv6},
		{ipProtoSCTP, "10.0.1.1:5000", "10.0.3.2:6000", layers.LayerTypeSCTP},
		{ipProtoTest, "10.0.1.1:0", "10.0.3.2:0", layers.LayerTypeIPv4},
		{ipProtoTest, "[2001:db8::1]:0", "[2001:db8::2]:0", layers.LayerTypeIPv6},
	} {
		b, err := FirstPacket(tc.proto, netip.MustParseAddrPort(tc.src), netip.MustParseAddrPort(tc.dst))
		if err != nil {
			t.Fatal(err)
		}
		pkt := gopacket.NewPacket(b, layers.LayerTypeEthernet, gopacket.Default)
		if el := pkt.ErrorLayer(); el != nil && tc.proto != ipProtoTest {
			t.Errorf("%d %s: %v", tc.proto, tc.src, el.Error())
			continue
		}
		if pkt.Layer(tc.layer) == nil {
			t.Errorf("%d %s: no %v layer in %v", tc.proto, tc.src, tc.layer, pkt)
		}
		// Checksums: recompute with gopacket and compare.
		var ls []gopacket.SerializableLayer
		var nl gopacket.NetworkLayer
		for _, l := range pkt.Layers() {
			if n, ok := l.(gopacket.NetworkLayer); ok {
				nl = n
			}
			switch l := l.(type) {
			case *layers.TCP:
				l.SetNetworkLayerForChecksum(nl)
			case *layers.UDP:
				l.SetNetworkLayerForChecksum(nl)
			case *layers.ICMPv6:
				l.SetNetworkLayerForChecksum(nl)
			}
			if s, ok := l.(gopacket.SerializableLayer); ok {
				ls = append(ls, s)
			}
		}
		if tc.proto == ipProtoSCTP || tc.proto == ipProtoTest {
			continue // no checksum FirstPacket computes; gopacket rewrites SCTP's
		}
		buf := gopacket.NewSerializeBuffer()
		if err := gopacket.SerializeLayers(buf, gopacket.SerializeOptions{FixLengths: true, ComputeChecksums: true}, ls...); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(buf.Bytes(), b) {
			t.Errorf("%d %s:\n got %x\nwant %x", tc.proto, tc.src, b, buf.Bytes())
		}
	}
	if _, err := FirstPacket(ipProtoUDP, netip.MustParseAddrPort("10.0.0.1:1"), netip.MustParseAddrPort("[2001:db8::1]:1")); err == nil {
		t.Error("FirstPacket across families succeeded")
	}
}

// TestFirstPacketMatchesSYN checks that the TCP first packet is what the
// classifier sees for a SYN: the filters of SessionMatcher agree on it.
func TestFirstPacketMatchesSYN(t *testing.T) {
	b, err := FirstPacket(ipProtoTCP, netip.MustParseAddrPort("10.0.1.1:5000"), netip.MustParseAddrPort("10.0.3.2:80"))
	if err != nil {
		t.Fatal(err)
	}
	for _, expr := range []string{"tcp dst port 80", "tcp[tcpflags] == tcp-syn", "src host 10.0.1.1 and src port 5000"} {
		f, err := CompileFilter(expr)
		if err != nil {
			t.Fatal(err)
		}
		if !f.Match(b) {
			t.Errorf("%q does not match the SYN", expr)
		}
	}
}

// TestProtocolsCoverRandomFirstPackets checks Protocols against the filter
// itself: whenever a first packet (built by FirstPacket from addresses and
// ports the filters name, and others) matches a filter, Protocols of that
// filter includes the packet's protocol class.
func TestProtocolsCoverRandomFirstPackets(t *testing.T) {
	filters := []string{
		"tcp dst port 80", "udp dst port 4433", "port 53", "host 10.0.3.2", "icmp", "ip6 and udp",
		"sctp", "tcp or udp", "not tcp", "udp dst port 4433 and dst host 10.0.3.2",
		"src net 10.0.0.0/16 and dst portrange 5000-6000", "ip6 src host 2001:db8::5 and udp",
		"dst host 2001:db8::6 or ip proto 47", "udp and not dst port 53 and src port 5000",
		"(tcp dst port 80 and src host 10.0.3.1) or (udp src port 6000 and dst net 10.0.3.0/24)",
	}
	filters = append(filters, oracleFilters...)
	filters = append(filters, realisticFilters(6)...)
	v4 := []string{"10.0.3.2", "10.0.3.1", "10.0.0.7", "10.200.4.2", "192.168.1.5"}
	v6 := []string{"2001:db8::5", "2001:db8::6", "2001:db8:3::9", "fd00::1"}
	ports := []uint16{53, 80, 443, 4433, 5000, 5500, 6000, 1000, 8443, 40000}
	protos := []uint8{ipProtoTCP, ipProtoUDP, ipProtoICMP, ipProtoSCTP, 47, 50, ipProtoTest}
	r := rand.New(rand.NewPCG(45, 1))
	for _, expr := range filters {
		f, err := CompileFilter(expr)
		if err != nil {
			t.Fatal(err)
		}
		got := f.Protocols()
		matched := 0
		for range 3000 {
			proto := protos[r.IntN(len(protos))]
			pool := v4
			if r.IntN(2) == 0 {
				pool = v6
			}
			src := netip.AddrPortFrom(netip.MustParseAddr(pool[r.IntN(len(pool))]), ports[r.IntN(len(ports))])
			dst := netip.AddrPortFrom(netip.MustParseAddr(pool[r.IntN(len(pool))]), ports[r.IntN(len(ports))])
			b, err := FirstPacket(proto, src, dst)
			if err != nil {
				t.Fatal(err)
			}
			class := Other
			switch proto {
			case ipProtoTCP:
				class = TCP
			case ipProtoUDP:
				class = UDP
			case ipProtoICMP:
				class = ICMP
			}
			if !f.Match(b) {
				continue
			}
			matched++
			if !got.Has(class) {
				t.Errorf("%q matches %v %s -> %s (proto %d) but Protocols = %v", expr, class, src, dst, proto, got)
				break
			}
		}
		t.Logf("%q: %d of 3000 packets matched; Protocols %v", expr, matched, got)
	}
}
