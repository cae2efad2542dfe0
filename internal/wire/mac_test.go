package wire

import (
	"encoding/binary"
	"net/netip"
	"testing"
)

// TestSipHash24Vectors checks SipHash-2-4 against the reference vectors of
// its authors (key 00..0f, messages 00..n-1): a few lengths around the
// 8-byte word boundary.
func TestSipHash24Vectors(t *testing.T) {
	var key MACKey
	for i := range key {
		key[i] = byte(i)
	}
	msg := make([]byte, 64)
	for i := range msg {
		msg[i] = byte(i)
	}
	for n, want := range map[int]uint64{
		0: 0x726fdb47dd0e0e31, 1: 0x74f839c593dc67fd, 7: 0xab0200f58b01d137, 8: 0x93f5f5799a932462,
		15: 0xa129ca6149be45e5, 16: 0x3f2acc7f57c29bdb, 63: 0x958a324ceb064572,
	} {
		if got := SipHash24(key, msg[:n]); got != want {
			t.Errorf("SipHash-2-4 of %d bytes: %#x, want %#x", n, got, want)
		}
	}
}

// TestBlockMAC: a signed block verifies on its own subsession with its own
// key only; every byte of the block and of the subsession is covered, the
// MAC field excepted.
func TestBlockMAC(t *testing.T) {
	key := MACKey{0xde, 0xad}
	b := SynBlock{Session: tuple("10.0.0.1", "10.0.0.9", 40000, 80), Nonce: [8]byte{1, 2, 3},
		Hops: []netip.Addr{netip.MustParseAddr("10.0.1.1"), netip.MustParseAddr("10.0.0.9")}}
	enc, err := b.Encode(nil)
	if err != nil {
		t.Fatal(err)
	}
	sub := tuple("10.0.0.1", "10.0.1.5", 21000, 22000)
	if VerifyBlock(key, enc, sub) {
		t.Fatal("unsigned block verifies")
	}
	if !SignBlock(key, enc, sub) || !VerifyBlock(key, enc, sub) {
		t.Fatal("signed block does not verify")
	}
	// The MAC is SipHash-2-4 of the block (MAC zeroed) and the subsession,
	// little-endian.
	m := append([]byte(nil), enc...)
	clear(m[MACOff : MACOff+MACLen])
	s, d := sub.Src.As16(), sub.Dst.As16()
	m = append(append(m, s[:]...), d[:]...)
	m = binary.BigEndian.AppendUint16(binary.BigEndian.AppendUint16(m, sub.SrcPort), sub.DstPort)
	if len(m)%8 != 0 || binary.LittleEndian.Uint64(enc[MACOff:]) != SipHash24(key, m) {
		t.Fatalf("MAC %x is not SipHash-2-4 of the %d-byte input", enc[MACOff:MACOff+MACLen], len(m))
	}
	if VerifyBlock(MACKey{0xde, 0xae}, enc, sub) {
		t.Error("verifies under another key")
	}
	for name, o := range map[string]Tuple{
		"source address": tuple("10.0.0.2", "10.0.1.5", 21000, 22000),
		"destination":    tuple("10.0.0.1", "10.0.1.6", 21000, 22000),
		"source port":    tuple("10.0.0.1", "10.0.1.5", 21001, 22000),
		"dest port":      tuple("10.0.0.1", "10.0.1.5", 21000, 22001),
		"reversed":       sub.Reverse(),
	} {
		if VerifyBlock(key, enc, o) {
			t.Errorf("verifies on a subsession with another %s", name)
		}
	}
	for i := range enc {
		enc[i] ^= 1
		if VerifyBlock(key, enc, sub) {
			t.Errorf("verifies with byte %d changed", i)
		}
		enc[i] ^= 1
	}
	if _, ok := BlockMAC(key, enc[:BlockHeaderLen-1], sub); ok {
		t.Error("MAC of a truncated block")
	}
}
