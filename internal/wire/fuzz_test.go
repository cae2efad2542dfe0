package wire

import (
	"bytes"
	"net/netip"
	"reflect"
	"testing"
)

// FuzzDecode: Decode, which reads the block from a SYN's payload as it came
// from the network, never panics. What it accepts:
//   - fills the input exactly (Len), with at most MaxHops hops;
//   - has a valid session tuple (addresses, non-zero ports, not to itself),
//     session and hops all of one address family, no hop repeated;
//   - encodes again (Encode) to a block that decodes to an equal block;
//   - and to the input's bytes exactly (the flags are 0, the protocol TCP,
//     the MAC carried as is): IPv4 addresses are read unmapped and written
//     IPv4-mapped again;
//   - whose MAC, once signed for a subsession, verifies, and no longer
//     verifies for another subsession or with any byte changed.
//
// `go test` runs the seeds; `go test -run '^$' -fuzz '^FuzzDecode$'
// ./internal/wire` searches.
func FuzzDecode(f *testing.F) {
	var good []byte
	for _, b := range []SynBlock{
		{Session: tuple("10.0.0.1", "10.0.0.9", 40000, 80), Nonce: [8]byte{1, 2, 3, 4, 5, 6, 7, 8},
			Hops: []netip.Addr{netip.MustParseAddr("10.0.1.1"), netip.MustParseAddr("10.0.0.9")}},
		{Session: tuple("fd00::1", "fd00::9", 1, 443)},
		{Session: tuple("fd00::1", "fd00::9", 1, 443), Nonce: [8]byte{9},
			Hops: []netip.Addr{netip.MustParseAddr("fd00::5"), netip.MustParseAddr("fd00::6"), netip.MustParseAddr("fd00::9")}},
		{Session: tuple("10.0.0.1", "10.0.0.9", 1, 2), Hops: []netip.Addr{
			netip.MustParseAddr("10.0.1.1"), netip.MustParseAddr("10.0.1.2"), netip.MustParseAddr("10.0.1.3"), netip.MustParseAddr("10.0.1.4"),
			netip.MustParseAddr("10.0.1.5"), netip.MustParseAddr("10.0.1.6"), netip.MustParseAddr("10.0.1.7"), netip.MustParseAddr("10.0.0.9")}},
	} {
		enc, err := b.Encode(nil)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(enc)
		if good == nil {
			good = enc
		}
	}
	mut := func(fn func(p []byte) []byte) []byte { return fn(append([]byte(nil), good...)) }
	f.Add([]byte(nil))
	f.Add(good[:10])
	f.Add(good[:BlockHeaderLen])
	f.Add(good[:len(good)-1])
	f.Add(mut(func(p []byte) []byte { return append(p, 0) }))
	f.Add(mut(func(p []byte) []byte { p[5], p[7] = 0xff, 0xff; return p }))
	f.Add(mut(func(p []byte) []byte { p[7] = 17; return p }))
	f.Add(mut(func(p []byte) []byte { p[6] = MaxHops + 1; return p }))
	f.Add(mut(func(p []byte) []byte { p[48], p[49] = 0, 0; return p }))
	f.Add(mut(func(p []byte) []byte {
		copy(p[BlockHeaderLen+AddrLen:], p[BlockHeaderLen:BlockHeaderLen+AddrLen])
		return p
	}))

	f.Fuzz(func(t *testing.T, p []byte) {
		b, err := Decode(p)
		if err != nil {
			return
		}
		if len(b.Hops) > MaxHops || len(p) != b.Len() || b.Len() > MaxBlockLen {
			t.Fatalf("accepted %d bytes as %d hops", len(p), len(b.Hops))
		}
		s := b.Session
		if !s.Src.IsValid() || !s.Dst.IsValid() || s.SrcPort == 0 || s.DstPort == 0 || s == s.Reverse() {
			t.Fatalf("accepted session %s", s)
		}
		v4 := s.Src.Is4()
		if s.Dst.Is4() != v4 {
			t.Fatalf("accepted session %s mixing families", s)
		}
		seen := map[netip.Addr]bool{}
		for i, h := range b.Hops {
			if !h.IsValid() || h.Is4() != v4 || h.Is4In6() || seen[h] {
				t.Fatalf("accepted hop %d %s in %v (session %s)", i, h, b.Hops, s)
			}
			seen[h] = true
		}
		enc, err := b.Encode(nil)
		if err != nil {
			t.Fatalf("decoded block does not encode: %v\n%+v", err, b)
		}
		again, err := Decode(enc)
		if err != nil {
			t.Fatalf("re-encoded block does not decode: %v\n%+v", err, b)
		}
		if !reflect.DeepEqual(again, b) {
			t.Fatalf("round trip\n got %+v\nwant %+v", again, b)
		}
		if !bytes.Equal(enc, p) {
			t.Fatalf("re-encoding differs from the input\n got %x\nwant %x", enc, p)
		}
		key := MACKey{1, 2, 3}
		sub := tuple("10.9.0.1", "10.9.0.2", 20001, 20002)
		if !s.Src.Is4() {
			sub = tuple("fd09::1", "fd09::2", 20001, 20002)
		}
		if !SignBlock(key, enc, sub) || !VerifyBlock(key, enc, sub) {
			t.Fatalf("signed block does not verify")
		}
		other := sub
		other.SrcPort++
		if VerifyBlock(key, enc, other) {
			t.Fatalf("block verifies on another subsession")
		}
		for i := range enc {
			enc[i] ^= 0x40
			if VerifyBlock(key, enc, sub) {
				t.Fatalf("block verifies with byte %d changed", i)
			}
			enc[i] ^= 0x40
		}
	})
}
