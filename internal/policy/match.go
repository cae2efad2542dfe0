package policy

import (
	"encoding/binary"
	"net/netip"
	"strings"

	"github.com/dysco/dysco/internal/wire"
)

// SessionMatcher selects live sessions by a tcpdump filter, as the
// reconfiguration requests do (`dysco reconfig --match`, `dysco middlebox …
// --match`): the filter is tested against the Ethernet frame of a SYN that
// Match synthesises from the session tuple. (Matcher, in policy.go, is the
// policy classifier's user-space twin: it takes frames, not tuples.) A
// SessionMatcher is safe for concurrent use.
type SessionMatcher struct {
	// Expr is the expression as the operator wrote it; empty matches
	// every session.
	Expr string

	filter Filter // unused when all
	all    bool
}

// CompileMatch compiles a tcpdump filter expression for
// SessionMatcher.Match. The empty (or blank) expression matches every
// session. Errors carry libpcap's message, as those of CompileFilter do.
func CompileMatch(expr string) (*SessionMatcher, error) {
	if strings.TrimSpace(expr) == "" {
		return &SessionMatcher{Expr: expr, all: true}, nil
	}
	f, err := CompileFilter(expr)
	if err != nil {
		return nil, err
	}
	return &SessionMatcher{Expr: expr, filter: f}, nil
}

// Match tells whether the session whose tuple is t matches. The filter sees
// the session's first SYN as the client would have sent it with no Dysco in
// the way: Ethernet, then IPv4 (no options, DF, TTL 64) or IPv6 (hop limit
// 64, no extension headers) according to the tuple's addresses, then a
// 20-byte TCP header with only SYN set, and no payload. Predicates on
// addresses, ports, protocols and TCP flags therefore behave as on the real
// SYN; predicates on link-layer addresses, IP identification, TCP options or
// payload see placeholder values, and loads beyond the 20-byte TCP header
// fail (which rejects the frame). A tuple whose addresses are invalid or of
// two families matches only the empty expression.
func (m *SessionMatcher) Match(t wire.Tuple) bool {
	if m.all {
		return true
	}
	frame := synFrame(t)
	if frame == nil {
		return false
	}
	return m.filter.Match(frame)
}

// MatchProto is Match for a session of IP protocol proto: a TCP session is
// tested as Match does, on its SYN; a session of another protocol (UDP) on
// the first packet FirstPacket builds from t, as the policy classifier saw
// it.
func (m *SessionMatcher) MatchProto(t wire.Tuple, proto uint8) bool {
	if m.all {
		return true
	}
	if proto == ipProtoTCP {
		return m.Match(t)
	}
	frame, err := FirstPacket(proto, netip.AddrPortFrom(t.Src, t.SrcPort), netip.AddrPortFrom(t.Dst, t.DstPort))
	if err != nil {
		return false
	}
	return m.filter.Match(frame)
}

// Placeholder MAC addresses of synthesised frames: unicast, locally
// administered.
var (
	synSrcMAC = [6]byte{0x02, 0, 0, 0, 0, 1}
	synDstMAC = [6]byte{0x02, 0, 0, 0, 0, 2}
)

const (
	ethHeaderLen  = 14
	ipv4HeaderLen = 20
	ipv6HeaderLen = 40
	tcpHeaderLen  = 20

	etherTypeIPv4 = 0x0800
	etherTypeIPv6 = 0x86dd
	protoTCP      = 6
	synTTL        = 64
	tcpFlagSYN    = 0x02
	synWindow     = 64240 // Linux's initial window with a 1460-byte MSS
)

// synFrame builds the Ethernet frame of the first SYN of the session t, with
// correct lengths and checksums; nil when t's addresses are invalid or of
// different families.
func synFrame(t wire.Tuple) []byte {
	src, dst := t.Src.Unmap(), t.Dst.Unmap()
	if !src.IsValid() || !dst.IsValid() || src.Is4() != dst.Is4() {
		return nil
	}
	ipLen := ipv6HeaderLen
	etherType := uint16(etherTypeIPv6)
	if src.Is4() {
		ipLen = ipv4HeaderLen
		etherType = etherTypeIPv4
	}
	b := make([]byte, ethHeaderLen+ipLen+tcpHeaderLen)

	copy(b[0:6], synDstMAC[:])
	copy(b[6:12], synSrcMAC[:])
	binary.BigEndian.PutUint16(b[12:14], etherType)

	ip := b[ethHeaderLen : ethHeaderLen+ipLen]
	if src.Is4() {
		ip[0] = 0x45 // version 4, IHL 5
		binary.BigEndian.PutUint16(ip[2:4], ipv4HeaderLen+tcpHeaderLen)
		binary.BigEndian.PutUint16(ip[6:8], 0x4000) // DF, offset 0
		ip[8] = synTTL
		ip[9] = protoTCP
		s4, d4 := src.As4(), dst.As4()
		copy(ip[12:16], s4[:])
		copy(ip[16:20], d4[:])
		binary.BigEndian.PutUint16(ip[10:12], ^fold(sum(0, ip)))
	} else {
		ip[0] = 0x60 // version 6, traffic class 0, flow label 0
		binary.BigEndian.PutUint16(ip[4:6], tcpHeaderLen)
		ip[6] = protoTCP
		ip[7] = synTTL
		s16, d16 := src.As16(), dst.As16()
		copy(ip[8:24], s16[:])
		copy(ip[24:40], d16[:])
	}

	tcp := b[ethHeaderLen+ipLen:]
	binary.BigEndian.PutUint16(tcp[0:2], t.SrcPort)
	binary.BigEndian.PutUint16(tcp[2:4], t.DstPort)
	// Sequence and acknowledgement numbers stay 0.
	tcp[12] = (tcpHeaderLen / 4) << 4
	tcp[13] = tcpFlagSYN
	binary.BigEndian.PutUint16(tcp[14:16], synWindow)
	binary.BigEndian.PutUint16(tcp[16:18], ^fold(sum(pseudoHeaderSum(src, dst, tcpHeaderLen), tcp)))
	return b
}

// pseudoHeaderSum is the unfolded one's-complement sum of the TCP
// pseudo-header (RFC 9293 §3.1, RFC 8200 §8.1).
func pseudoHeaderSum(src, dst netip.Addr, tcpLen int) uint32 {
	var s uint32
	if src.Is4() {
		a, b := src.As4(), dst.As4()
		s = sum(sum(0, a[:]), b[:])
	} else {
		a, b := src.As16(), dst.As16()
		s = sum(sum(0, a[:]), b[:])
	}
	return s + protoTCP + uint32(tcpLen)
}

// sum adds b, as big-endian 16-bit words (an odd last byte padded with
// zero), to the running one's-complement sum s.
func sum(s uint32, b []byte) uint32 {
	for len(b) >= 2 {
		s += uint32(binary.BigEndian.Uint16(b))
		b = b[2:]
	}
	if len(b) == 1 {
		s += uint32(b[0]) << 8
	}
	return s
}

// fold folds the carries of a one's-complement sum into 16 bits.
func fold(s uint32) uint16 {
	for s > 0xffff {
		s = s>>16 + s&0xffff
	}
	return uint16(s)
}
