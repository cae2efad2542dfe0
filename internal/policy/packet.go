package policy

import (
	"encoding/binary"
	"fmt"
	"net/netip"
)

// IP protocol numbers of the first packets FirstPacket builds.
const (
	ipProtoICMP   = 1
	ipProtoTCP    = 6
	ipProtoUDP    = 17
	ipProtoICMPv6 = 58
	ipProtoSCTP   = 132
	// ipProtoTest is reserved for experimentation (RFC 3692): the
	// protocol of the "other" probes.
	ipProtoTest = 253
)

// Lengths of what FirstPacket puts after the IP header.
const (
	synHeaderLen   = 40 // a 20-byte TCP header and 20 bytes of options, as Linux sends
	udpHeaderLen   = 8
	icmpHeaderLen  = 8
	sctpHeaderLen  = 12 // the common header; an INIT chunk follows
	sctpInitLen    = 20
	firstPayload   = 32 // payload of UDP, ICMP and other first packets
	synOptionsLen  = synHeaderLen - tcpHeaderLen
	synDataOffWord = synHeaderLen / 4
)

// synOptions are the options of a Linux SYN: MSS 1460, SACK permitted,
// timestamps, NOP, window scale 7.
var synOptions = [synOptionsLen]byte{
	2, 4, 0x05, 0xb4,
	4, 2,
	8, 10, 0, 0, 0, 1, 0, 0, 0, 0,
	1,
	3, 3, 7,
}

// FirstPacket builds the Ethernet frame of the first packet of a session of
// IP protocol proto from src to dst, as the host sends it with no Dysco in
// the way, with correct lengths and checksums: Ethernet, then IPv4 (no
// options, DF, TTL 64) or IPv6 (hop limit 64, no extension headers), then
//   - TCP (6): a SYN with no ACK, a 40-byte header with Linux's options
//     (MSS 1460, SACK permitted, timestamps, window scale 7), no payload;
//   - UDP (17): a datagram with 32 bytes of zero payload;
//   - ICMP (1, IPv4) and ICMPv6 (58, IPv6): an echo request with 32 bytes of
//     zero payload (ports are ignored);
//   - SCTP (132): the common header and an INIT chunk;
//   - any other protocol: 32 bytes of zero payload.
//
// `dysco policy test` uses it, and so do the protocol probes of
// Filter.Protocols. The addresses must be valid and of one family.
func FirstPacket(proto uint8, src, dst netip.AddrPort) ([]byte, error) {
	s, d := src.Addr().Unmap(), dst.Addr().Unmap()
	if !s.IsValid() || !d.IsValid() {
		return nil, fmt.Errorf("first packet: invalid address")
	}
	if s.Is4() != d.Is4() {
		return nil, fmt.Errorf("first packet: %s and %s are of different address families", s, d)
	}
	if proto == ipProtoICMP && !s.Is4() {
		proto = ipProtoICMPv6
	} else if proto == ipProtoICMPv6 && s.Is4() {
		proto = ipProtoICMP
	}
	var l4Len int
	switch proto {
	case ipProtoTCP:
		l4Len = synHeaderLen
	case ipProtoUDP:
		l4Len = udpHeaderLen + firstPayload
	case ipProtoICMP, ipProtoICMPv6:
		l4Len = icmpHeaderLen + firstPayload
	case ipProtoSCTP:
		l4Len = sctpHeaderLen + sctpInitLen
	default:
		l4Len = firstPayload
	}
	ipLen := ipv6HeaderLen
	etherType := uint16(etherTypeIPv6)
	if s.Is4() {
		ipLen = ipv4HeaderLen
		etherType = etherTypeIPv4
	}
	b := make([]byte, ethHeaderLen+ipLen+l4Len)
	copy(b[0:6], synDstMAC[:])
	copy(b[6:12], synSrcMAC[:])
	binary.BigEndian.PutUint16(b[12:14], etherType)

	ip := b[ethHeaderLen : ethHeaderLen+ipLen]
	if s.Is4() {
		ip[0] = 0x45
		binary.BigEndian.PutUint16(ip[2:4], uint16(ipv4HeaderLen+l4Len))
		binary.BigEndian.PutUint16(ip[6:8], 0x4000)
		ip[8] = synTTL
		ip[9] = proto
		s4, d4 := s.As4(), d.As4()
		copy(ip[12:16], s4[:])
		copy(ip[16:20], d4[:])
		binary.BigEndian.PutUint16(ip[10:12], ^fold(sum(0, ip)))
	} else {
		ip[0] = 0x60
		binary.BigEndian.PutUint16(ip[4:6], uint16(l4Len))
		ip[6] = proto
		ip[7] = synTTL
		s16, d16 := s.As16(), d.As16()
		copy(ip[8:24], s16[:])
		copy(ip[24:40], d16[:])
	}

	l4 := b[ethHeaderLen+ipLen:]
	pseudo := pseudoSum(s, d, proto, l4Len)
	switch proto {
	case ipProtoTCP:
		binary.BigEndian.PutUint16(l4[0:2], src.Port())
		binary.BigEndian.PutUint16(l4[2:4], dst.Port())
		binary.BigEndian.PutUint32(l4[4:8], 1)
		l4[12] = synDataOffWord << 4
		l4[13] = tcpFlagSYN
		binary.BigEndian.PutUint16(l4[14:16], synWindow)
		copy(l4[tcpHeaderLen:], synOptions[:])
		binary.BigEndian.PutUint16(l4[16:18], ^fold(sum(pseudo, l4)))
	case ipProtoUDP:
		binary.BigEndian.PutUint16(l4[0:2], src.Port())
		binary.BigEndian.PutUint16(l4[2:4], dst.Port())
		binary.BigEndian.PutUint16(l4[4:6], uint16(l4Len))
		c := ^fold(sum(pseudo, l4))
		if c == 0 {
			c = 0xffff // RFC 768: a computed zero is sent as all ones
		}
		binary.BigEndian.PutUint16(l4[6:8], c)
	case ipProtoICMP:
		l4[0] = 8 // echo request
		binary.BigEndian.PutUint16(l4[4:6], 1)
		binary.BigEndian.PutUint16(l4[2:4], ^fold(sum(0, l4)))
	case ipProtoICMPv6:
		l4[0] = 128 // echo request
		binary.BigEndian.PutUint16(l4[4:6], 1)
		binary.BigEndian.PutUint16(l4[2:4], ^fold(sum(pseudo, l4)))
	case ipProtoSCTP:
		binary.BigEndian.PutUint16(l4[0:2], src.Port())
		binary.BigEndian.PutUint16(l4[2:4], dst.Port())
		// Verification tag 0 in an INIT (RFC 9260 §8.5.1). The
		// checksum is CRC32c; no filter has a reason to check it, so
		// it stays 0.
		init := l4[sctpHeaderLen:]
		init[0] = 1 // INIT
		binary.BigEndian.PutUint16(init[2:4], sctpInitLen)
		binary.BigEndian.PutUint32(init[4:8], 1)        // initiate tag
		binary.BigEndian.PutUint32(init[8:12], 0x20000) // a_rwnd
		binary.BigEndian.PutUint16(init[12:14], 10)     // outbound streams
		binary.BigEndian.PutUint16(init[14:16], 0xffff) // inbound streams
		binary.BigEndian.PutUint32(init[16:20], 1)      // initial TSN
	}
	return b, nil
}

// pseudoSum is the unfolded one's-complement sum of the pseudo-header of an
// upper-layer checksum (RFC 768, RFC 9293 §3.1, RFC 8200 §8.1).
func pseudoSum(src, dst netip.Addr, proto uint8, l4Len int) uint32 {
	var s uint32
	if src.Is4() {
		a, b := src.As4(), dst.As4()
		s = sum(sum(0, a[:]), b[:])
	} else {
		a, b := src.As16(), dst.As16()
		s = sum(sum(0, a[:]), b[:])
	}
	return s + uint32(proto) + uint32(l4Len)
}
