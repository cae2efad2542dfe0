package wire

import (
	"bytes"
	"errors"
	"net/netip"
	"os"
	"testing"
)

func tuple(s, d string, sp, dp uint16) Tuple {
	return Tuple{Src: netip.MustParseAddr(s), Dst: netip.MustParseAddr(d), SrcPort: sp, DstPort: dp}
}

func TestRoundTrip(t *testing.T) {
	for _, b := range []SynBlock{
		{Session: tuple("10.0.0.1", "10.0.0.9", 40000, 80), Nonce: [8]byte{1, 2, 3, 4, 5, 6, 7, 8},
			Hops: []netip.Addr{netip.MustParseAddr("10.0.1.1"), netip.MustParseAddr("10.0.0.9")}},
		{Session: tuple("fd00::1", "fd00::9", 1, 443), MAC: [MACLen]byte{9, 8, 7}},
	} {
		enc, err := b.Encode(nil)
		if err != nil {
			t.Fatal(err)
		}
		if len(enc) != b.Len() {
			t.Fatalf("len %d, want %d", len(enc), b.Len())
		}
		got, err := Decode(enc)
		if err != nil {
			t.Fatal(err)
		}
		if got.Session != b.Session || got.Nonce != b.Nonce || got.MAC != b.MAC || len(got.Hops) != len(b.Hops) {
			t.Fatalf("round trip: got %+v, want %+v", got, b)
		}
		for i := range b.Hops {
			if got.Hops[i] != b.Hops[i] {
				t.Fatalf("hop %d: %s, want %s", i, got.Hops[i], b.Hops[i])
			}
		}
	}
}

func TestDecodeErrors(t *testing.T) {
	good := SynBlock{Session: tuple("10.0.0.1", "10.0.0.9", 40000, 80), Hops: []netip.Addr{netip.MustParseAddr("10.0.1.1")}}
	enc, _ := good.Encode(nil)
	mut := func(f func(p []byte) []byte) []byte { p := append([]byte(nil), enc...); return f(p) }
	for name, tc := range map[string]struct {
		p    []byte
		want error
	}{
		"short":                    {enc[:10], ErrShort},
		"magic":                    {mut(func(p []byte) []byte { p[0] ^= 1; return p }), ErrMagic},
		"version":                  {mut(func(p []byte) []byte { p[4] = 9; return p }), ErrVersion},
		"too many":                 {mut(func(p []byte) []byte { p[6] = MaxHops + 1; return p }), ErrTooMany},
		"length":                   {mut(func(p []byte) []byte { p[6] = 2; return p }), ErrLength},
		"trailing":                 {mut(func(p []byte) []byte { return append(p, 0) }), ErrLength},
		"port 0":                   {mut(func(p []byte) []byte { p[48], p[49] = 0, 0; return p }), ErrBadSession},
		"flags":                    {mut(func(p []byte) []byte { p[5] = 1; return p }), ErrReserved},
		"udp without its timeouts": {mut(func(p []byte) []byte { p[7] = ProtoUDP; return p }), ErrLength},
		"sctp":                     {mut(func(p []byte) []byte { p[7] = 132; return p }), ErrProto},
		"to itself": {mut(func(p []byte) []byte {
			copy(p[32:48], p[16:32])
			copy(p[50:52], p[48:50])
			return p
		}), ErrBadSession},
		"unspecified source": {mut(func(p []byte) []byte { clear(p[28:32]); return p }), ErrBadSession},
		"loopback destination": {mut(func(p []byte) []byte {
			a := netip.MustParseAddr("127.0.0.1").As16()
			copy(p[32:48], a[:])
			return p
		}), ErrBadSession},
		"multicast hop": {mut(func(p []byte) []byte {
			a := netip.MustParseAddr("239.1.2.3").As16()
			copy(p[BlockHeaderLen:], a[:])
			return p
		}), ErrBadHop},
		"broadcast hop": {mut(func(p []byte) []byte {
			a := netip.MustParseAddr("255.255.255.255").As16()
			copy(p[BlockHeaderLen:], a[:])
			return p
		}), ErrBadHop},
		"family": {mut(func(p []byte) []byte {
			a := netip.MustParseAddr("fd00::1").As16()
			copy(p[BlockHeaderLen:], a[:])
			return p
		}), ErrFamily},
		"loop": {func() []byte {
			b := good
			b.Hops = []netip.Addr{netip.MustParseAddr("10.0.1.1"), netip.MustParseAddr("10.0.2.1")}
			e, _ := b.Encode(nil)
			copy(e[BlockHeaderLen+AddrLen:], e[BlockHeaderLen:BlockHeaderLen+AddrLen])
			return e
		}(), ErrLoop},
	} {
		if _, err := Decode(tc.p); !errors.Is(err, tc.want) {
			t.Errorf("%s: got %v, want %v", name, err, tc.want)
		}
	}
	good6 := SynBlock{Session: tuple("fd00::1", "fd00::9", 40000, 80), Hops: []netip.Addr{netip.MustParseAddr("fd00::5")}}
	for _, h := range []string{"::", "::1", "ff02::1"} {
		b := good6
		b.Hops = []netip.Addr{netip.MustParseAddr(h)}
		if _, err := b.Encode(nil); !errors.Is(err, ErrBadHop) {
			t.Errorf("encode with hop %s: %v, want %v", h, err, ErrBadHop)
		}
	}
	if _, err := (&SynBlock{Session: good.Session, Hops: make([]netip.Addr, MaxHops+1)}).Encode(nil); !errors.Is(err, ErrTooMany) {
		t.Errorf("encode of too many hops: %v", err)
	}
}

// TestCHeaderCommitted fails when bpf/include/wire_gen.h is not what this
// package generates: run `make generate`.
func TestCHeaderCommitted(t *testing.T) {
	got, err := os.ReadFile("../../bpf/include/wire_gen.h")
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, CHeader()) {
		t.Fatal("bpf/include/wire_gen.h is stale: run `make generate`")
	}
}

func TestUnicast(t *testing.T) {
	for a, want := range map[string]bool{
		"10.0.0.1": true, "fd00::1": true, "::ffff:10.0.0.1": true, "fe80::1": true, "192.168.1.255": true,
		"0.0.0.0": false, "::": false, "127.0.0.1": false, "127.1.2.3": false, "::1": false,
		"224.0.0.1": false, "239.255.255.255": false, "ff02::1": false, "255.255.255.255": false,
		"::ffff:127.0.0.1": false, "::ffff:0.0.0.0": false,
	} {
		if got := Unicast(netip.MustParseAddr(a)); got != want {
			t.Errorf("Unicast(%s) = %v, want %v", a, got, want)
		}
	}
	if Unicast(netip.Addr{}) {
		t.Error("Unicast of the zero Addr")
	}
}

func TestOption(t *testing.T) {
	o := Option(100)
	if o[0] != OptKind || o[1] != OptLen || o[4] != OptTypeSYNBlock || int(o[6])<<8|int(o[7]) != 100 {
		t.Fatalf("option %x", o)
	}
}

func TestUDPBlockRoundTrip(t *testing.T) {
	b := SynBlock{Session: tuple("10.0.0.1", "10.0.3.2", 40000, 4433), Proto: ProtoUDP,
		Hops: []netip.Addr{netip.MustParseAddr("10.0.1.1")}, IdleOneWay: 30, IdleStream: 120}
	enc, err := b.Encode(nil)
	if err != nil {
		t.Fatal(err)
	}
	if len(enc) != b.Len() || len(enc) != BlockHeaderLen+AddrLen+UDPExtLen {
		t.Fatalf("length %d, Len %d", len(enc), b.Len())
	}
	got, err := Decode(enc)
	if err != nil {
		t.Fatal(err)
	}
	if got.Proto != ProtoUDP || got.IdleOneWay != 30 || got.IdleStream != 120 || got.Session != b.Session || len(got.Hops) != 1 {
		t.Fatalf("decoded %+v", got)
	}
	for _, pad := range []int{0, 1} {
		data := []byte("hello")[:5-pad]
		p := append(append(append([]byte(nil), data...), make([]byte, pad)...), enc...)
		m := UDPMarker(len(enc), pad)
		p = append(p, m[:]...)
		d, blk, ok, err := SplitUDP(p)
		if !ok || err != nil || string(d) != string(data) || string(blk) != string(enc) {
			t.Fatalf("pad %d: %q %x %v %v", pad, d, blk, ok, err)
		}
	}
	if _, _, ok, _ := SplitUDP([]byte("a plain datagram")); ok {
		t.Fatal("plain datagram taken for a block")
	}
	m := UDPMarker(MaxBlockLen, 0)
	if _, _, ok, err := SplitUDP(append([]byte("short"), m[:]...)); !ok || err == nil {
		t.Fatalf("a marker longer than its datagram: ok %v err %v", ok, err)
	}
}
