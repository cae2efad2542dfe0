package wire

// The MAC of a SYN block: admission of Dysco SYNs to a deployment.
//
// A SYN block carries a SipHash-2-4 MAC under a 128-bit key the deployment's
// hosts share. Its input is the block with the MAC field zeroed, followed by
// the subsession tuple of the packet carrying it (MACSubLen bytes: source
// and destination address, IPv4-mapped, then the ports). Every host that
// passes a SYN on signs the block for the subsession it sends it on, so a
// block replayed from another address or port, or altered in any byte, is
// refused by its receiver. Nothing of TCP beyond the addresses and ports is
// covered (no sequence number or option), and the protocol is a byte of the
// block: a set-up datagram of another protocol carrying the same block is
// signed and checked the same way.
//
// The datapath computes the same function (bpf/include/mac.h); the tests of
// internal/datapath check that the two agree.

import (
	"encoding/binary"
	"math/bits"
)

// MACKey is a SYN MAC key.
type MACKey [MACKeyLen]byte

// BlockMAC returns the MAC of an encoded block (whatever its MAC field
// holds) carried on subsession sub. ok is false if block is shorter than a
// block header.
func BlockMAC(key MACKey, block []byte, sub Tuple) (mac [MACLen]byte, ok bool) {
	if len(block) < BlockHeaderLen {
		return mac, false
	}
	binary.LittleEndian.PutUint64(mac[:], SipHash24(key, macInput(block, sub)))
	return mac, true
}

// SignBlock writes the MAC of block for subsession sub into its MAC field.
func SignBlock(key MACKey, block []byte, sub Tuple) bool {
	mac, ok := BlockMAC(key, block, sub)
	if ok {
		copy(block[MACOff:], mac[:])
	}
	return ok
}

// VerifyBlock tells whether block carries the MAC of subsession sub under
// key.
func VerifyBlock(key MACKey, block []byte, sub Tuple) bool {
	mac, ok := BlockMAC(key, block, sub)
	if !ok {
		return false
	}
	var d byte
	for i := range mac {
		d |= mac[i] ^ block[MACOff+i]
	}
	return d == 0
}

// macInput is the MAC's message: the block, its MAC zeroed, then the
// subsession tuple.
func macInput(block []byte, sub Tuple) []byte {
	m := make([]byte, 0, len(block)+MACSubLen)
	m = append(m, block...)
	clear(m[MACOff : MACOff+MACLen])
	s, d := sub.Src.As16(), sub.Dst.As16()
	m = append(m, s[:]...)
	m = append(m, d[:]...)
	m = binary.BigEndian.AppendUint16(m, sub.SrcPort)
	return binary.BigEndian.AppendUint16(m, sub.DstPort)
}

// SipHash24 is SipHash-2-4 (Aumasson and Bernstein, 2012) of m under key.
func SipHash24(key MACKey, m []byte) uint64 {
	k0 := binary.LittleEndian.Uint64(key[0:])
	k1 := binary.LittleEndian.Uint64(key[8:])
	v0 := k0 ^ 0x736f6d6570736575
	v1 := k1 ^ 0x646f72616e646f6d
	v2 := k0 ^ 0x6c7967656e657261
	v3 := k1 ^ 0x7465646279746573
	round := func() {
		v0 += v1
		v1 = bits.RotateLeft64(v1, 13)
		v1 ^= v0
		v0 = bits.RotateLeft64(v0, 32)
		v2 += v3
		v3 = bits.RotateLeft64(v3, 16)
		v3 ^= v2
		v0 += v3
		v3 = bits.RotateLeft64(v3, 21)
		v3 ^= v0
		v2 += v1
		v1 = bits.RotateLeft64(v1, 17)
		v1 ^= v2
		v2 = bits.RotateLeft64(v2, 32)
	}
	n := len(m)
	for ; len(m) >= 8; m = m[8:] {
		w := binary.LittleEndian.Uint64(m)
		v3 ^= w
		round()
		round()
		v0 ^= w
	}
	last := uint64(n) << 56
	for i, c := range m {
		last |= uint64(c) << (8 * i)
	}
	v3 ^= last
	round()
	round()
	v0 ^= last
	v2 ^= 0xff
	round()
	round()
	round()
	round()
	return v0 ^ v1 ^ v2 ^ v3
}
