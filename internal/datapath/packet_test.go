package datapath

// Packets for the fixture tests: crafted with gopacket with correct
// checksums, decoded back into a field-by-field view, and checked with
// checksums recomputed here from scratch (test-run skbs are CHECKSUM_NONE,
// so a wrong incremental update shows in the output).

import (
	"encoding/binary"
	"fmt"
	"net"
	"net/netip"
	"reflect"
	"slices"
	"strings"
	"testing"

	"github.com/gopacket/gopacket"
	"github.com/gopacket/gopacket/layers"

	"github.com/dysco/dysco/internal/wire"
)

var (
	macSrc = net.HardwareAddr{0x02, 0xd7, 0, 0, 0, 1}
	macDst = net.HardwareAddr{0x02, 0xd7, 0, 0, 0, 2}
)

// pkt describes an Ethernet + IPv4/IPv6 + TCP frame. The address family
// follows src.
type pkt struct {
	src, dst netip.AddrPort
	seq, ack uint32
	flags    string // TCP flags among "SAFRPU"
	win      uint16
	opts     []layers.TCPOption
	payload  []byte
	ipOpts   bool   // IPv4: a Router Alert option (IHL 6)
	cut      int    // bytes cut off the end of the frame (lengths keep claiming them)
	idPlus   uint16 // IPv4: added to the header's id (0x4242)
}

func ap(s string) netip.AddrPort { return netip.MustParseAddrPort(s) }

func (p pkt) tuple() wire.Tuple {
	return wire.Tuple{Src: p.src.Addr(), Dst: p.dst.Addr(), SrcPort: p.src.Port(), DstPort: p.dst.Port()}
}

// key is the datapath's flow key of the packet.
func (p pkt) key() Tuple { return TupleFrom(p.tuple()) }

// with returns a copy of p with its tuple replaced.
func (p pkt) with(t wire.Tuple) pkt {
	p.src = netip.AddrPortFrom(t.Src, t.SrcPort)
	p.dst = netip.AddrPortFrom(t.Dst, t.DstPort)
	return p
}

// withOpts returns a copy of p with new options (the slice is not shared).
func (p pkt) withOpts(opts ...layers.TCPOption) pkt {
	p.opts = append([]layers.TCPOption(nil), opts...)
	return p
}

func (p pkt) withPayload(b []byte) pkt {
	p.payload = append([]byte(nil), b...)
	return p
}

// frame serializes p with correct lengths and checksums.
func (p pkt) frame(tb testing.TB) []byte {
	tb.Helper()
	tcp := &layers.TCP{
		SrcPort: layers.TCPPort(p.src.Port()), DstPort: layers.TCPPort(p.dst.Port()),
		Seq: p.seq, Ack: p.ack, Window: p.win,
		Options: p.opts,
	}
	for _, f := range p.flags {
		switch f {
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
		case 'U':
			tcp.URG = true
		default:
			tb.Fatalf("pkt: unknown TCP flag %q", f)
		}
	}
	eth := &layers.Ethernet{SrcMAC: macSrc, DstMAC: macDst}
	var ip gopacket.SerializableLayer
	if p.src.Addr().Is4() {
		eth.EthernetType = layers.EthernetTypeIPv4
		ip4 := &layers.IPv4{
			Version: 4, TOS: 0x10, Id: 0x4242 + p.idPlus, Flags: layers.IPv4DontFragment, TTL: 64,
			Protocol: layers.IPProtocolTCP, SrcIP: p.src.Addr().AsSlice(), DstIP: p.dst.Addr().AsSlice(),
		}
		if p.ipOpts {
			ip4.Options = []layers.IPv4Option{{OptionType: 148, OptionLength: 4, OptionData: []byte{0, 0}}}
		}
		if err := tcp.SetNetworkLayerForChecksum(ip4); err != nil {
			tb.Fatal(err)
		}
		ip = ip4
	} else {
		eth.EthernetType = layers.EthernetTypeIPv6
		ip6 := &layers.IPv6{
			Version: 6, TrafficClass: 0x10, FlowLabel: 0x12345, HopLimit: 64,
			NextHeader: layers.IPProtocolTCP, SrcIP: p.src.Addr().AsSlice(), DstIP: p.dst.Addr().AsSlice(),
		}
		if err := tcp.SetNetworkLayerForChecksum(ip6); err != nil {
			tb.Fatal(err)
		}
		ip = ip6
	}
	buf := gopacket.NewSerializeBuffer()
	err := gopacket.SerializeLayers(buf, gopacket.SerializeOptions{FixLengths: true, ComputeChecksums: true},
		eth, ip, tcp, gopacket.Payload(p.payload))
	if err != nil {
		tb.Fatalf("pkt: serialize: %v", err)
	}
	b := append([]byte(nil), buf.Bytes()...)
	return b[:len(b)-p.cut]
}

// TCP options as Linux writes them on a SYN, and the ones steady-state
// packets carry.
func optMSS(mss uint16) layers.TCPOption {
	return layers.TCPOption{OptionType: layers.TCPOptionKindMSS, OptionLength: 4, OptionData: binary.BigEndian.AppendUint16(nil, mss)}
}

func optSACKPerm() layers.TCPOption {
	return layers.TCPOption{OptionType: layers.TCPOptionKindSACKPermitted, OptionLength: 2}
}

func optTS(val, ecr uint32) layers.TCPOption {
	d := binary.BigEndian.AppendUint32(nil, val)
	return layers.TCPOption{OptionType: layers.TCPOptionKindTimestamps, OptionLength: 10, OptionData: binary.BigEndian.AppendUint32(d, ecr)}
}

func optNOP() layers.TCPOption {
	return layers.TCPOption{OptionType: layers.TCPOptionKindNop, OptionLength: 1}
}

func optWS(shift uint8) layers.TCPOption {
	return layers.TCPOption{OptionType: layers.TCPOptionKindWindowScale, OptionLength: 3, OptionData: []byte{shift}}
}

// optSACK takes left/right edge pairs.
func optSACK(edges ...uint32) layers.TCPOption {
	var d []byte
	for _, e := range edges {
		d = binary.BigEndian.AppendUint32(d, e)
	}
	return layers.TCPOption{OptionType: layers.TCPOptionKindSACK, OptionLength: uint8(2 + len(d)), OptionData: d}
}

// optRaw is an option given as its bytes from the kind on.
func optRaw(b ...byte) layers.TCPOption {
	return layers.TCPOption{OptionType: layers.TCPOptionKind(b[0]), OptionLength: b[1], OptionData: b[2:]}
}

// optDysco is the marking option announcing a block of blen bytes.
func optDysco(blen int) layers.TCPOption {
	o := wire.Option(blen)
	return optRaw(o[:]...)
}

// optTag is the local tag of session id.
func optTag(id uint32) layers.TCPOption {
	return optRaw(wire.OptKind, wire.OptLen, wire.OptExID>>8, wire.OptExID&0xff, wire.OptTypeLocalTag,
		byte(id>>16), byte(id>>8), byte(id))
}

// synOpts is what Linux puts on a SYN: 20 bytes, doff 10.
func synOpts() []layers.TCPOption {
	return []layers.TCPOption{optMSS(1460), optSACKPerm(), optTS(0x01020304, 0), optNOP(), optWS(7)}
}

// view is the field-by-field reading of an output frame.
type view struct {
	EthSrc, EthDst string
	Src, Dst       netip.AddrPort
	TOS, TTL       uint8
	ID             uint16
	IPFlags        uint8
	FlowLabel      uint32
	IPLen          int // IPv4 total length, IPv6 payload length
	IPOpts         string
	Seq, Ack       uint32
	Flags          string
	Window, Urgent uint16
	DataOff        uint8 // 32-bit words
	Options        []string
	Payload        string
}

func decode(tb testing.TB, frame []byte) (view, *layers.TCP) {
	tb.Helper()
	pk := gopacket.NewPacket(frame, layers.LayerTypeEthernet, gopacket.DecodeOptions{NoCopy: true})
	if el := pk.ErrorLayer(); el != nil {
		tb.Fatalf("decode: %v\n%x", el.Error(), frame)
	}
	var v view
	eth, _ := pk.Layer(layers.LayerTypeEthernet).(*layers.Ethernet)
	tcp, _ := pk.Layer(layers.LayerTypeTCP).(*layers.TCP)
	if eth == nil || tcp == nil {
		tb.Fatalf("decode: not Ethernet/IP/TCP:\n%s", pk.Dump())
	}
	v.EthSrc, v.EthDst = eth.SrcMAC.String(), eth.DstMAC.String()
	var src, dst netip.Addr
	if ip4, ok := pk.Layer(layers.LayerTypeIPv4).(*layers.IPv4); ok {
		src, _ = netip.AddrFromSlice(ip4.SrcIP)
		dst, _ = netip.AddrFromSlice(ip4.DstIP)
		v.TOS, v.TTL, v.ID, v.IPFlags, v.IPLen = ip4.TOS, ip4.TTL, ip4.Id, uint8(ip4.Flags), int(ip4.Length)
		v.IPOpts = fmt.Sprintf("ihl %d %x", ip4.IHL, ip4.Contents[20:])
	} else if ip6, ok := pk.Layer(layers.LayerTypeIPv6).(*layers.IPv6); ok {
		src, _ = netip.AddrFromSlice(ip6.SrcIP)
		dst, _ = netip.AddrFromSlice(ip6.DstIP)
		v.TOS, v.TTL, v.FlowLabel, v.IPLen = ip6.TrafficClass, ip6.HopLimit, ip6.FlowLabel, int(ip6.Length)
	}
	v.Src = netip.AddrPortFrom(src, uint16(tcp.SrcPort))
	v.Dst = netip.AddrPortFrom(dst, uint16(tcp.DstPort))
	v.Seq, v.Ack, v.Window, v.Urgent, v.DataOff = tcp.Seq, tcp.Ack, tcp.Window, tcp.Urgent, tcp.DataOffset
	for _, f := range []struct {
		on bool
		c  byte
	}{{tcp.SYN, 'S'}, {tcp.ACK, 'A'}, {tcp.FIN, 'F'}, {tcp.RST, 'R'}, {tcp.PSH, 'P'}, {tcp.URG, 'U'}, {tcp.ECE, 'E'}, {tcp.CWR, 'C'}} {
		if f.on {
			v.Flags += string(f.c)
		}
	}
	for _, o := range tcp.Options {
		if o.OptionType == layers.TCPOptionKindNop {
			v.Options = append(v.Options, "nop")
			continue
		}
		v.Options = append(v.Options, fmt.Sprintf("%d:%x", o.OptionType, o.OptionData))
	}
	v.Payload = fmt.Sprintf("%x", tcp.Payload)
	return v, tcp
}

// checkFrame verifies an output frame from scratch: the IP length covers the
// frame exactly (but for the padding of a minimum-size Ethernet frame), and the IPv4 header and TCP checksums are right.
func checkFrame(tb testing.TB, frame []byte) {
	tb.Helper()
	if len(frame) < 14 {
		tb.Fatalf("frame of %d bytes", len(frame))
	}
	var pseudo uint32
	var seg []byte
	switch binary.BigEndian.Uint16(frame[12:]) {
	case 0x0800:
		ip := frame[14:]
		ihl := int(ip[0]&0xf) * 4
		tot := int(binary.BigEndian.Uint16(ip[2:]))
		if tot != len(ip) && !(tot < len(ip) && len(frame) == 60) { // 60: Ethernet minimum, padded
			tb.Errorf("IPv4 total length %d, frame carries %d bytes of IP", tot, len(ip))
			return
		}
		if s := fold(sum16(ip[:ihl], 0)); s != 0xffff {
			tb.Errorf("IPv4 header checksum wrong: header %x sums to %#04x", ip[:ihl], s)
		}
		seg = ip[ihl:tot]
		pseudo = sum16(ip[12:20], 0) + 6 + uint32(len(seg))
	case 0x86dd:
		ip := frame[14:]
		plen := int(binary.BigEndian.Uint16(ip[4:]))
		if plen+40 != len(ip) && !(plen+40 < len(ip) && len(frame) == 60) {
			tb.Errorf("IPv6 payload length %d, frame carries %d bytes after the header", plen, len(ip)-40)
			return
		}
		seg = ip[40 : 40+plen]
		pseudo = sum16(ip[8:40], 0) + 6 + uint32(len(seg))
	default:
		tb.Fatalf("not IP: %x", frame)
	}
	if s := fold(sum16(seg, pseudo)); s != 0xffff {
		tb.Errorf("TCP checksum wrong: stored %#04x, segment+pseudo-header sums to %#04x (want 0xffff)",
			binary.BigEndian.Uint16(seg[16:]), s)
	}
}

// sum16 adds b as big-endian 16-bit words to s, without folding.
func sum16(b []byte, s uint32) uint32 {
	for i := 0; i+1 < len(b); i += 2 {
		s += uint32(b[i])<<8 | uint32(b[i+1])
	}
	if len(b)%2 == 1 {
		s += uint32(b[len(b)-1]) << 8
	}
	return s
}

func fold(s uint32) uint16 {
	for s>>16 != 0 {
		s = s&0xffff + s>>16
	}
	return uint16(s)
}

// expectFrame checks an output frame against the expected packet: checksums
// from scratch, every header field, and then the bytes.
func expectFrame(tb testing.TB, got []byte, want pkt) {
	tb.Helper()
	checkFrame(tb, got)
	wantFrame := want.frame(tb)
	gv, _ := decode(tb, got)
	wv, _ := decode(tb, wantFrame)
	if !reflect.DeepEqual(gv, wv) {
		var diffs []string
		rg, rw := reflect.ValueOf(gv), reflect.ValueOf(wv)
		for i := 0; i < rg.NumField(); i++ {
			if !reflect.DeepEqual(rg.Field(i).Interface(), rw.Field(i).Interface()) {
				diffs = append(diffs, fmt.Sprintf("  %s: got %v, want %v", rg.Type().Field(i).Name, rg.Field(i).Interface(), rw.Field(i).Interface()))
			}
		}
		tb.Errorf("output packet differs:\n%s", strings.Join(diffs, "\n"))
		return
	}
	if string(got) != string(wantFrame) {
		tb.Errorf("output frame differs in bytes not covered by the view:\n got %x\nwant %x", got, wantFrame)
	}
}

// rawBlock encodes a SYN block without the validation wire.Encode does, for
// the bad inputs; n is the hop count written in the header.
func rawBlock(sess wire.Tuple, nonce [wire.NonceLen]byte, n int, hops ...netip.Addr) []byte {
	b := make([]byte, wire.BlockHeaderLen, wire.BlockHeaderLen+len(hops)*wire.AddrLen)
	binary.BigEndian.PutUint32(b, wire.Magic)
	b[4] = wire.Version
	b[6] = byte(n)
	b[7] = wire.ProtoTCP
	copy(b[8:], nonce[:])
	if sess.Src.IsValid() {
		a := sess.Src.As16()
		copy(b[16:], a[:])
	}
	if sess.Dst.IsValid() {
		a := sess.Dst.As16()
		copy(b[32:], a[:])
	}
	binary.BigEndian.PutUint16(b[48:], sess.SrcPort)
	binary.BigEndian.PutUint16(b[50:], sess.DstPort)
	for _, h := range hops {
		a := h.As16()
		b = append(b, a[:]...)
	}
	return b
}

// block encodes a valid SYN block.
func block(tb testing.TB, sess wire.Tuple, nonce [wire.NonceLen]byte, hops ...netip.Addr) []byte {
	tb.Helper()
	b, err := (&wire.SynBlock{Session: sess, Nonce: nonce, Hops: hops}).Encode(nil)
	if err != nil {
		tb.Fatalf("encode block: %v", err)
	}
	return b
}

// bl is the length of a block of n hops.
func bl(n int) int { return wire.BlockHeaderLen + n*wire.AddrLen }

// fxSynKey is the SYN MAC key of the fixtures' datapath (newFixtureWith).
var fxSynKey = wire.MACKey{0x5e, 0xc2, 0xe7, 0x01, 0x02, 0x03, 0x04, 0x05, 0x06, 0x07, 0x08, 0x09, 0x0a, 0x0b, 0x0c, 0x0d}

// signed returns blk signed under key for subsession sub (a copy; blk as
// it is if it is shorter than a block header).
func signed(key wire.MACKey, blk []byte, sub wire.Tuple) []byte {
	c := slices.Clone(blk)
	wire.SignBlock(key, c, sub)
	return c
}

// dyscoSYN is a SYN on a subsession carrying blk signed for it under
// fxSynKey, marked as Linux options plus the marking option announcing
// blen bytes.
func dyscoSYN(sub wire.Tuple, blk []byte, blen int) pkt {
	return dyscoSYNRaw(sub, signed(fxSynKey, blk, sub), blen)
}

// dyscoSYNRaw is dyscoSYN with blk as it is (its MAC not made).
func dyscoSYNRaw(sub wire.Tuple, blk []byte, blen int) pkt {
	p := pkt{seq: 0x11223344, flags: "S", win: 64240, opts: append(synOpts(), optDysco(blen)), payload: blk}
	return p.with(sub)
}
