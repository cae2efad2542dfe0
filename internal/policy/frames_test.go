package policy

import (
	"math/rand/v2"
	"net"
	"net/netip"
	"testing"

	"github.com/gopacket/gopacket"
	"github.com/gopacket/gopacket/layers"
)

// frame describes a test Ethernet frame; the zero value plus addresses is a
// TCP SYN over IPv4.
type frame struct {
	vlan     bool
	src, dst string // IPv4 or IPv6 addresses; the family picks the IP layer
	udp      bool
	sport    uint16
	dport    uint16
	flags    string // TCP flags among "SAFRP"; "" means "S"
	tos      uint8
	ipOpts   bool   // add a 4-byte IPv4 option (IHL 6)
	fragOff  uint16 // IPv4 fragment offset, in 8-byte units
	payload  []byte
	truncate int // cut the frame to this many bytes when > 0
	ethSrc   net.HardwareAddr
}

var (
	defaultEthSrc = net.HardwareAddr{0x02, 0, 0, 0, 0, 1}
	defaultEthDst = net.HardwareAddr{0x02, 0, 0, 0, 0, 2}
)

func (f frame) bytes(tb testing.TB) []byte {
	tb.Helper()
	src, dst := netip.MustParseAddr(f.src), netip.MustParseAddr(f.dst)
	eth := &layers.Ethernet{SrcMAC: defaultEthSrc, DstMAC: defaultEthDst}
	if f.ethSrc != nil {
		eth.SrcMAC = f.ethSrc
	}
	var ls []gopacket.SerializableLayer
	ls = append(ls, eth)

	ipType := layers.EthernetTypeIPv4
	if src.Is6() {
		ipType = layers.EthernetTypeIPv6
	}
	if f.vlan {
		eth.EthernetType = layers.EthernetTypeDot1Q
		ls = append(ls, &layers.Dot1Q{VLANIdentifier: 42, Type: ipType})
	} else {
		eth.EthernetType = ipType
	}

	proto := layers.IPProtocolTCP
	if f.udp {
		proto = layers.IPProtocolUDP
	}
	var netLayer gopacket.NetworkLayer
	if src.Is6() {
		ip := &layers.IPv6{Version: 6, TrafficClass: f.tos, NextHeader: proto, HopLimit: 64,
			SrcIP: src.AsSlice(), DstIP: dst.AsSlice()}
		netLayer = ip
		ls = append(ls, ip)
	} else {
		ip := &layers.IPv4{Version: 4, TOS: f.tos, TTL: 64, Protocol: proto, Id: 7,
			SrcIP: src.AsSlice(), DstIP: dst.AsSlice(), FragOffset: f.fragOff}
		if f.ipOpts {
			// Router alert: makes the TCP header start at offset 38,
			// which only an X-relative load (LDX MSH) finds.
			ip.Options = []layers.IPv4Option{{OptionType: 148, OptionLength: 4, OptionData: []byte{0, 0}}}
		}
		netLayer = ip
		ls = append(ls, ip)
	}

	if f.udp {
		udp := &layers.UDP{SrcPort: layers.UDPPort(f.sport), DstPort: layers.UDPPort(f.dport)}
		if err := udp.SetNetworkLayerForChecksum(netLayer); err != nil {
			tb.Fatal(err)
		}
		ls = append(ls, udp)
	} else {
		tcp := &layers.TCP{SrcPort: layers.TCPPort(f.sport), DstPort: layers.TCPPort(f.dport),
			Seq: 1000, Window: 64240}
		flags := f.flags
		if flags == "" {
			flags = "S"
		}
		for _, c := range flags {
			switch c {
			case 'S':
				tcp.SYN = true
			case 'A':
				tcp.ACK = true
			case 'F':
				tcp.FIN = true
			case 'R':
				tcp.RST = true
			case 'P':
				tcp.PSH = true
			default:
				tb.Fatalf("unknown TCP flag %q", c)
			}
		}
		if tcp.SYN {
			tcp.Options = []layers.TCPOption{{OptionType: layers.TCPOptionKindMSS, OptionLength: 4, OptionData: []byte{0x05, 0xb4}}}
		}
		if err := tcp.SetNetworkLayerForChecksum(netLayer); err != nil {
			tb.Fatal(err)
		}
		ls = append(ls, tcp)
	}
	if len(f.payload) > 0 {
		ls = append(ls, gopacket.Payload(f.payload))
	}

	buf := gopacket.NewSerializeBuffer()
	if err := gopacket.SerializeLayers(buf, gopacket.SerializeOptions{FixLengths: true, ComputeChecksums: true}, ls...); err != nil {
		tb.Fatal(err)
	}
	b := buf.Bytes()
	if f.truncate > 0 && f.truncate < len(b) {
		b = b[:f.truncate]
	}
	return b
}

// randomFrame returns a frame whose fields come from small pools, so that
// the test filters match some frames and not others, plus some damage:
// truncation, fragments, VLAN tags, odd header lengths, and pure noise.
func randomFrame(tb testing.TB, r *rand.Rand) []byte {
	if r.IntN(12) == 0 {
		// Noise, sometimes with an IPv4 or IPv6 EtherType so that the
		// filters read deeper into garbage.
		b := make([]byte, 14+40+r.IntN(120))
		for i := range b {
			b[i] = byte(r.Uint32())
		}
		switch r.IntN(3) {
		case 0:
			b[12], b[13] = 0x08, 0x00
		case 1:
			b[12], b[13] = 0x86, 0xdd
		}
		return b[:minTestRunLen(b)+r.IntN(len(b)-minTestRunLen(b)+1)]
	}
	pick := func(s []string) string { return s[r.IntN(len(s))] }
	ports := []uint16{80, 443, 8443, 22, 1500, 53, uint16(r.Uint32())}
	f := frame{
		udp:   r.IntN(8) == 0,
		vlan:  r.IntN(8) == 0,
		sport: ports[r.IntN(len(ports))],
		dport: ports[r.IntN(len(ports))],
		flags: pick([]string{"S", "S", "SA", "A", "AP", "F", "R"}),
		tos:   uint8(r.IntN(4)),
	}
	if r.IntN(2) == 0 {
		v4 := []string{"10.200.4.2", "10.0.0.1", "10.9.8.7", "192.168.1.5", "172.16.0.9"}
		f.src, f.dst = pick(v4), pick(v4)
		f.ipOpts = r.IntN(5) == 0
		if r.IntN(10) == 0 {
			f.fragOff = uint16(1 + r.IntN(100))
		}
	} else {
		v6 := []string{"2001:db8::1", "2001:db8:1::5", "fd00::2", "fe80::1"}
		f.src, f.dst = pick(v6), pick(v6)
	}
	if r.IntN(3) == 0 {
		f.payload = make([]byte, r.IntN(200))
		for i := range f.payload {
			f.payload[i] = byte(r.Uint32())
		}
		if r.IntN(2) == 0 && len(f.payload) >= 4 {
			copy(f.payload, "GET ")
		}
	}
	b := f.bytes(tb)
	if r.IntN(5) == 0 {
		min := minTestRunLen(b)
		b = b[:min+r.IntN(len(b)-min+1)]
	}
	return b
}

// minTestRunLen is the shortest prefix of b that BPF_PROG_TEST_RUN accepts
// for a SchedCLS program: an Ethernet header, plus a whole IPv4 or IPv6
// header when the EtherType announces one (Linux 6.18 refuses shorter ones
// with EINVAL). Truncated frames in the tests therefore cut into VLAN, L4
// headers and payload, which is where filters load beyond the end.
func minTestRunLen(b []byte) int {
	switch {
	case b[12] == 0x08 && b[13] == 0x00:
		return 14 + 20
	case b[12] == 0x86 && b[13] == 0xdd:
		return 14 + 40
	}
	return 14
}
