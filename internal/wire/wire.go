// Package wire defines Dysco's on-the-wire formats: the TCP option that marks
// a Dysco SYN, the address-list block carried in the SYN payload (paper §2.1),
// and the tuple encoding shared with the datapath.
//
// This package is the single home of these facts. The datapath's C header
// bpf/include/wire_gen.h is generated from it (go generate ./internal/wire),
// and a test fails when the committed header differs from what this package
// generates.
package wire

//go:generate go run ./gen -o ../../bpf/include/wire_gen.h

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"
	"strings"
)

// Constants of the SYN marking option and the SYN block. Every name here is
// emitted into wire_gen.h with a DYSCO_ prefix.
const (
	// OptKind is the TCP option kind used to mark Dysco SYNs: 253 is
	// reserved for experiments and shared through an experiment ID (RFC 6994).
	OptKind = 253
	// OptLen is the length of the marking option, kind and length bytes included.
	OptLen = 8
	// OptExID is the RFC 6994 experiment identifier ("DY").
	OptExID = 0x4459

	// OptTypeSYNBlock marks a SYN that carries a SynBlock in its payload; the
	// option's last two bytes hold the block length.
	OptTypeSYNBlock = 1
	// OptTypeLocalTag marks a SYN inside a middlebox host (§2.1, §4.2 "Tagging
	// SYN packets"): the option's last three bytes hold a tag that is
	// meaningful only to the agent that wrote it and never leaves the host.
	OptTypeLocalTag = 2
	// OptTypeUDPBlock marks a UDP datagram that carries a SynBlock (§2.1
	// applied to sessions without a SYN): the 8-byte marker, the option's
	// layout, is the datagram's last 8 bytes; its byte 5 is the number of
	// zero bytes (0 or 1) between the application's data and the block,
	// which keeps the block at an even offset for the checksum, and its last
	// two bytes the block length (UDPMarker).
	OptTypeUDPBlock = 3

	// Magic opens every SynBlock ("DYSC").
	Magic = 0x44595343
	// Version is the SynBlock version this code writes and accepts.
	// Version 2 added the MAC and the protocol byte.
	Version = 2
	// MaxHops bounds the address list of a SYN block.
	MaxHops = 8
	// AddrLen is the size of one address: IPv4 is stored IPv4-mapped.
	AddrLen = 16
	// BlockHeaderLen is the fixed part of a SynBlock before the hops.
	BlockHeaderLen = 60
	// UDPExtLen is the size of the part a UDP session's block adds after
	// the hops: the idle timeouts of the session in seconds, before it has
	// seen a datagram in both directions and after (2 bytes each), and 4
	// bytes of zeros that keep the MAC's input a multiple of 8 bytes.
	UDPExtLen = 8
	// MaxBlockLen is the largest SynBlock.
	MaxBlockLen = BlockHeaderLen + MaxHops*AddrLen + UDPExtLen
	// NonceLen is the size of the per-session nonce.
	NonceLen = 8

	// ProtoTCP and ProtoUDP are the session protocols a block announces
	// (byte 7, the IP protocol number); a receiver refuses any other.
	ProtoTCP = 6
	ProtoUDP = 17
	// MACOff is where the block's MAC sits, MACLen its size (SipHash-2-4
	// output, little-endian as SipHash writes it).
	MACOff = 52
	MACLen = 8
	// MACKeyLen is the size of a SYN MAC key (SipHash-2-4's 128 bits).
	MACKeyLen = 16
	// MACSubLen is the size of the subsession tuple appended to the block
	// to form the MAC's input: source and destination address (16 bytes
	// each, IPv4-mapped) and ports (2 each, network order).
	MACSubLen = 36
)

// Tuple is the addresses and ports of a session or a subsession; the
// protocol (TCP or UDP) is the session's.
type Tuple struct {
	Src, Dst         netip.Addr
	SrcPort, DstPort uint16
}

// Reverse returns the tuple of packets travelling the other way.
func (t Tuple) Reverse() Tuple {
	return Tuple{Src: t.Dst, Dst: t.Src, SrcPort: t.DstPort, DstPort: t.SrcPort}
}

func (t Tuple) String() string {
	return fmt.Sprintf("%s -> %s", netip.AddrPortFrom(t.Src, t.SrcPort), netip.AddrPortFrom(t.Dst, t.DstPort))
}

// Is4 reports whether both addresses are IPv4.
func (t Tuple) Is4() bool { return t.Src.Unmap().Is4() && t.Dst.Unmap().Is4() }

// SynBlock is the payload of a Dysco SYN (§2.1): the session tuple, the
// per-session nonce used later to authenticate control messages, the
// addresses still to be visited after the receiver, and a MAC that admits
// the SYN at its receiver (BlockMAC). The receiver is the
// destination of the packet carrying the block; when Hops is empty the
// receiver ends the chain (it is the session's destination, or it hands the
// plain SYN on by ordinary routing, §2.4).
//
// Layout, network byte order:
//
//	0  magic (4)   4 version (1)  5 flags (1)  6 hop count (1)  7 protocol (1, TCP or UDP)
//	8  nonce (8)
//	16 session source address (16)   32 session destination address (16)
//	48 session source port (2)       50 session destination port (2)
//	52 MAC (8)
//	60 hops, 16 bytes each
//	UDP only, after the hops: idle timeout one way (2), idle timeout both ways (2), seconds; zero (4)
type SynBlock struct {
	Session Tuple
	// Proto is ProtoTCP (also when zero) or ProtoUDP.
	Proto uint8
	Nonce [NonceLen]byte
	Hops  []netip.Addr
	// IdleOneWay and IdleStream are a UDP session's idle timeouts in
	// seconds, before and after it has carried datagrams both ways; 0: the
	// receiver's default. Not carried for TCP.
	IdleOneWay, IdleStream uint16
	// MAC is carried as is by Encode and Decode; SignBlock computes it.
	MAC [MACLen]byte
}

// Errors returned by Decode; the datapath counts the same cases as drops.
var (
	ErrShort      = errors.New("dysco syn block: truncated")
	ErrMagic      = errors.New("dysco syn block: bad magic")
	ErrVersion    = errors.New("dysco syn block: unknown version")
	ErrTooMany    = errors.New("dysco syn block: too many hops")
	ErrLength     = errors.New("dysco syn block: length does not match hop count")
	ErrFamily     = errors.New("dysco syn block: mixed address families")
	ErrLoop       = errors.New("dysco syn block: address list repeats an address")
	ErrBadSession = errors.New("dysco syn block: invalid session tuple")
	ErrBadHop     = errors.New("dysco syn block: a hop is not a unicast address")
	ErrReserved   = errors.New("dysco syn block: flags set")
	ErrProto      = errors.New("dysco syn block: protocol not supported")
)

// Unicast reports whether a can be a host of a session or a hop of a chain:
// a valid address that is not unspecified, loopback, multicast or the IPv4
// broadcast address. A SYN block, a control message or a policy naming any
// other address is refused: a SYN sent to it would go nowhere, to this
// host, or to many hosts.
func Unicast(a netip.Addr) bool {
	a = a.Unmap()
	return a.IsValid() && !a.IsUnspecified() && !a.IsLoopback() && !a.IsMulticast() &&
		a != netip.AddrFrom4([4]byte{255, 255, 255, 255})
}

// Len is the encoded length of b.
func (b *SynBlock) Len() int {
	n := BlockHeaderLen + len(b.Hops)*AddrLen
	if b.Proto == ProtoUDP {
		n += UDPExtLen
	}
	return n
}

func (b *SynBlock) proto() uint8 {
	if b.Proto == 0 {
		return ProtoTCP
	}
	return b.Proto
}

// Encode appends the encoded block to dst.
func (b *SynBlock) Encode(dst []byte) ([]byte, error) {
	if len(b.Hops) > MaxHops {
		return nil, ErrTooMany
	}
	if err := b.validate(); err != nil {
		return nil, err
	}
	var h [BlockHeaderLen]byte
	binary.BigEndian.PutUint32(h[0:], Magic)
	h[4] = Version
	h[6] = byte(len(b.Hops))
	h[7] = b.proto()
	copy(h[8:16], b.Nonce[:])
	a := b.Session.Src.As16()
	copy(h[16:32], a[:])
	a = b.Session.Dst.As16()
	copy(h[32:48], a[:])
	binary.BigEndian.PutUint16(h[48:], b.Session.SrcPort)
	binary.BigEndian.PutUint16(h[50:], b.Session.DstPort)
	copy(h[MACOff:], b.MAC[:])
	dst = append(dst, h[:]...)
	for _, hop := range b.Hops {
		a := hop.As16()
		dst = append(dst, a[:]...)
	}
	if b.Proto == ProtoUDP {
		dst = binary.BigEndian.AppendUint16(dst, b.IdleOneWay)
		dst = binary.BigEndian.AppendUint16(dst, b.IdleStream)
		dst = append(dst, 0, 0, 0, 0)
	}
	return dst, nil
}

// Decode parses a block that must fill p exactly.
func Decode(p []byte) (*SynBlock, error) {
	if len(p) < BlockHeaderLen {
		return nil, ErrShort
	}
	if binary.BigEndian.Uint32(p) != Magic {
		return nil, ErrMagic
	}
	if p[4] != Version {
		return nil, fmt.Errorf("%w %d", ErrVersion, p[4])
	}
	// Version 2 defines no flags: a block with any set is of a version
	// this code does not know.
	if p[5] != 0 {
		return nil, ErrReserved
	}
	if p[7] != ProtoTCP && p[7] != ProtoUDP {
		return nil, ErrProto
	}
	n := int(p[6])
	if n > MaxHops {
		return nil, ErrTooMany
	}
	ext := 0
	if p[7] == ProtoUDP {
		ext = UDPExtLen
	}
	if len(p) != BlockHeaderLen+n*AddrLen+ext {
		return nil, ErrLength
	}
	b := &SynBlock{Proto: p[7]}
	if ext != 0 {
		e := p[len(p)-ext:]
		if binary.BigEndian.Uint32(e[4:]) != 0 {
			return nil, ErrReserved
		}
		b.IdleOneWay = binary.BigEndian.Uint16(e)
		b.IdleStream = binary.BigEndian.Uint16(e[2:])
	}
	copy(b.Nonce[:], p[8:16])
	b.Session.Src = addr16(p[16:32])
	b.Session.Dst = addr16(p[32:48])
	b.Session.SrcPort = binary.BigEndian.Uint16(p[48:])
	b.Session.DstPort = binary.BigEndian.Uint16(p[50:])
	copy(b.MAC[:], p[MACOff:MACOff+MACLen])
	for i := 0; i < n; i++ {
		off := BlockHeaderLen + i*AddrLen
		b.Hops = append(b.Hops, addr16(p[off:off+AddrLen]))
	}
	if err := b.validate(); err != nil {
		return nil, err
	}
	return b, nil
}

func (b *SynBlock) validate() error {
	s := b.Session
	if !Unicast(s.Src) || !Unicast(s.Dst) || s.SrcPort == 0 || s.DstPort == 0 || s.Src.Unmap() == s.Dst.Unmap() && s.SrcPort == s.DstPort {
		return ErrBadSession
	}
	v4 := s.Src.Unmap().Is4()
	if s.Dst.Unmap().Is4() != v4 {
		return ErrFamily
	}
	for i, h := range b.Hops {
		if h.Unmap().Is4() != v4 {
			return ErrFamily
		}
		if !Unicast(h) {
			return ErrBadHop
		}
		for _, g := range b.Hops[:i] {
			if g.Unmap() == h.Unmap() {
				return ErrLoop
			}
		}
	}
	return nil
}

// addr16 returns the address in p, unmapped when it is IPv4-mapped.
func addr16(p []byte) netip.Addr {
	var a [16]byte
	copy(a[:], p)
	return netip.AddrFrom16(a).Unmap()
}

// Option returns the 8-byte marking option announcing a block of blockLen bytes.
func Option(blockLen int) [OptLen]byte {
	return [OptLen]byte{OptKind, OptLen, OptExID >> 8, OptExID & 0xff, OptTypeSYNBlock, 0, byte(blockLen >> 8), byte(blockLen)}
}

// UDPMarker returns the 8 bytes that end a UDP datagram carrying a block of
// blockLen bytes after pad zero bytes (0 or 1).
func UDPMarker(blockLen, pad int) [OptLen]byte {
	return [OptLen]byte{OptKind, OptLen, OptExID >> 8, OptExID & 0xff, OptTypeUDPBlock, byte(pad), byte(blockLen >> 8), byte(blockLen)}
}

// SplitUDP separates a UDP payload that ends with a marker into the
// application's data and the block. ok is false when the payload carries
// no marker; err tells a marker whose block cannot be there.
func SplitUDP(payload []byte) (data, block []byte, ok bool, err error) {
	if len(payload) < OptLen {
		return payload, nil, false, nil
	}
	m := payload[len(payload)-OptLen:]
	if m[0] != OptKind || m[1] != OptLen || m[2] != OptExID>>8 || m[3] != OptExID&0xff || m[4] != OptTypeUDPBlock {
		return payload, nil, false, nil
	}
	pad, blen := int(m[5]), int(m[6])<<8|int(m[7])
	if pad > 1 || blen < BlockHeaderLen || blen > MaxBlockLen || pad+blen+OptLen > len(payload) {
		return payload, nil, true, ErrLength
	}
	end := len(payload) - OptLen
	return payload[:end-blen-pad], payload[end-blen : end], true, nil
}

// ParseTuple reads a tuple written as "SRC:PORT -> DST:PORT" (IPv6
// addresses in brackets), the form String writes.
func ParseTuple(s string) (Tuple, error) {
	parts := strings.Split(s, "->")
	if len(parts) != 2 {
		parts = strings.Fields(s)
	}
	if len(parts) != 2 {
		return Tuple{}, fmt.Errorf("tuple %q: want SRC:PORT -> DST:PORT", s)
	}
	src, err := netip.ParseAddrPort(strings.TrimSpace(parts[0]))
	if err != nil {
		return Tuple{}, fmt.Errorf("tuple %q: source: %w", s, err)
	}
	dst, err := netip.ParseAddrPort(strings.TrimSpace(parts[1]))
	if err != nil {
		return Tuple{}, fmt.Errorf("tuple %q: destination: %w", s, err)
	}
	t := Tuple{Src: src.Addr().Unmap(), Dst: dst.Addr().Unmap(), SrcPort: src.Port(), DstPort: dst.Port()}
	if t.Src.Is4() != t.Dst.Is4() {
		// No TCP session has ends of two families (found by FuzzSessionArgs).
		return Tuple{}, fmt.Errorf("tuple %q: the source and the destination are of different address families", s)
	}
	return t, nil
}
