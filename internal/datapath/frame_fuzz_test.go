package datapath

// Fuzz targets of the frame surgery in hold.go (segment, SplitFrame): pure
// functions on the frames the datapath hands over, no BPF loaded.

import (
	"bytes"
	"encoding/binary"
	"testing"

	"github.com/gopacket/gopacket/layers"
)

// cutRef is an Ethernet + IPv4/IPv6 + TCP frame as read by cutParse,
// independently of parseTCPFrame.
type cutRef struct {
	v6            bool
	ipHdr, tcpHdr int
	ipLen         int // bytes of IP packet: IPv4 total length, or 40 + IPv6 payload length
	seq           uint32
	flags         byte
	urgent        uint16
	id            uint16
	payload       []byte
}

// cutParse reads a frame by the rules hold.go documents: IPv4 (no
// fragment) or IPv6 (TCP right after the fixed header), a TCP header that
// fits the IP length, an IP length that fits the frame (the rest is
// link-layer padding).
func cutParse(frame []byte) (cutRef, bool) {
	var r cutRef
	if len(frame) < 14 {
		return r, false
	}
	ip := frame[14:]
	switch binary.BigEndian.Uint16(frame[12:]) {
	case 0x0800:
		if len(ip) < 20 || ip[0]>>4 != 4 || ip[9] != 6 || binary.BigEndian.Uint16(ip[6:])&0x3fff != 0 {
			return r, false
		}
		r.ipHdr = int(ip[0]&0xf) * 4
		r.ipLen = int(binary.BigEndian.Uint16(ip[2:]))
		r.id = binary.BigEndian.Uint16(ip[4:])
		if r.ipHdr < 20 {
			return r, false
		}
	case 0x86dd:
		if len(ip) < 40 || ip[0]>>4 != 6 || ip[6] != 6 {
			return r, false
		}
		r.v6 = true
		r.ipHdr = 40
		r.ipLen = 40 + int(binary.BigEndian.Uint16(ip[4:]))
	default:
		return r, false
	}
	if r.ipLen > len(ip) || r.ipLen < r.ipHdr+20 {
		return r, false
	}
	th := ip[r.ipHdr:r.ipLen]
	r.tcpHdr = int(th[12]>>4) * 4
	if r.tcpHdr < 20 || r.tcpHdr > len(th) {
		return r, false
	}
	r.seq = binary.BigEndian.Uint32(th[4:])
	r.flags = th[13]
	r.urgent = binary.BigEndian.Uint16(th[18:])
	r.payload = th[r.tcpHdr:]
	return r, true
}

// checkCutPart checks output frame out, part i of in holding in's payload
// bytes [lo, hi): a valid frame (lengths exact, IPv4 header and TCP
// checksums right: checkFrame), in's headers but for the fields a part
// changes, its bytes of payload at the right sequence number, FIN and PSH
// only if last, CWR only if first, the urgent pointer on the same byte or
// URG cleared once the part starts at or after that byte, IPv4 id id.
func checkCutPart(t *testing.T, frame []byte, in cutRef, out []byte, i, lo, hi int, first, last bool, id uint16) {
	t.Helper()
	p, ok := cutParse(out)
	if !ok {
		t.Fatalf("part %d is not a valid TCP frame: %x", i, out)
	}
	checkFrame(t, out)
	if len(out) != 14+p.ipLen {
		t.Fatalf("part %d: %d bytes, IP length %d", i, len(out), p.ipLen)
	}
	if p.v6 != in.v6 || p.ipHdr != in.ipHdr || p.tcpHdr != in.tcpHdr {
		t.Fatalf("part %d: headers v6 %v ip %d tcp %d, input's v6 %v ip %d tcp %d", i, p.v6, p.ipHdr, p.tcpHdr, in.v6, in.ipHdr, in.tcpHdr)
	}
	// The headers, but for the fields a part rewrites.
	mask := func(f []byte) []byte {
		h := append([]byte(nil), f[:14+in.ipHdr+in.tcpHdr]...)
		ip, th := h[14:], h[14+in.ipHdr:]
		if in.v6 {
			clear(ip[4:6])
		} else {
			clear(ip[2:6])
			clear(ip[10:12])
		}
		clear(th[4:8])
		clear(th[13:14])
		clear(th[16:20])
		return h
	}
	if !bytes.Equal(mask(out), mask(frame)) {
		t.Fatalf("part %d: headers not copied\n got %x\nwant %x", i, mask(out), mask(frame))
	}
	if !bytes.Equal(p.payload, in.payload[lo:hi]) {
		t.Fatalf("part %d: %d payload bytes, not the input's bytes %d..%d", i, len(p.payload), lo, hi)
	}
	if p.seq != in.seq+uint32(lo) {
		t.Fatalf("part %d: seq %#x, want %#x", i, p.seq, in.seq+uint32(lo))
	}
	fl, urg := in.flags, in.urgent
	if !last {
		fl &^= tcpFIN | tcpPSH
	}
	if !first {
		fl &^= tcpCWR
	}
	if fl&tcpURG != 0 && lo > 0 {
		if int(urg) > lo {
			urg -= uint16(lo)
		} else {
			fl &^= tcpURG
			urg = 0
		}
	}
	if p.flags != fl || p.urgent != urg {
		t.Fatalf("part %d [%d, %d): flags %#02x urgent %d, want %#02x %d (input %#02x %d)", i, lo, hi, p.flags, p.urgent, fl, urg, in.flags, in.urgent)
	}
	if p.flags&tcpURG != 0 && p.seq+uint32(p.urgent) != in.seq+uint32(in.urgent) {
		t.Fatalf("part %d: urgent pointer moved", i)
	}
	if !in.v6 && p.id != id {
		t.Fatalf("part %d: IPv4 id %#x, want %#x", i, p.id, id)
	}
}

// cutSeedFrame is a seed frame: TCP with a timestamp option, CWR set (as TSO
// leaves it on a GSO packet), its checksum left as built.
func cutSeedFrame(tb testing.TB, v6 bool, payload int, flags string, ipOpts bool) []byte {
	src, dst := ap("10.0.0.1:1234"), ap("10.0.0.2:80")
	if v6 {
		src, dst = ap("[fd00::1]:1234"), ap("[fd00::2]:80")
	}
	pl := make([]byte, payload)
	for i := range pl {
		pl[i] = byte(i * 7)
	}
	f := pkt{src: src, dst: dst, seq: 0xfffff000, ack: 99, flags: flags, win: 500, ipOpts: ipOpts,
		opts: []layers.TCPOption{optNOP(), optNOP(), optTS(1, 2)}, payload: pl}.frame(tb)
	ipHdr := 20
	if v6 {
		ipHdr = 40
	} else if ipOpts {
		ipHdr = 24
	}
	f[14+ipHdr+13] |= tcpCWR
	return f
}

// cutSeedFrames are frames for both targets: GSO-sized and plain, IPv4
// (with and without options) and IPv6, urgent data, padding, and frames
// that cannot be cut. Their payloads are a few hundred bytes, not the tens
// of kilobytes of real GSO packets: the fuzzer minimizes every new input it
// finds, in time quadratic in its length, and with frames of thousands of
// bytes it does nothing else.
func cutSeedFrames(tb testing.TB) [][]byte {
	var out [][]byte
	for _, v6 := range []bool{false, true} {
		big := cutSeedFrame(tb, v6, 300, "APF", false)
		urg := cutSeedFrame(tb, v6, 500, "APFU", false)
		ipHdr := 20
		if v6 {
			ipHdr = 40
		}
		binary.BigEndian.PutUint16(urg[14+ipHdr+18:], 420)
		small := cutSeedFrame(tb, v6, 3, "AP", false)
		padded := append(append([]byte(nil), small...), 0, 0, 0, 0, 0, 0) // link-layer padding
		ext := cutSeedFrame(tb, v6, 10, "A", false)
		ext[14+6] = 0 // IPv6: a hop-by-hop options header; IPv4: DF cleared
		out = append(out, big, urg, small, padded, ext, cutSeedFrame(tb, v6, 0, "AF", false),
			cutSeedFrame(tb, v6, 1, "SA", false), big[:len(big)-1])
	}
	opts := cutSeedFrame(tb, false, 150, "AP", true)
	udp := append([]byte(nil), opts...)
	udp[14+9] = 17
	arp := append([]byte(nil), opts...)
	binary.BigEndian.PutUint16(arp[12:], 0x0806)
	frag := append([]byte(nil), opts...)
	frag[14+6] |= 0x20 // more fragments
	return append(out, opts, udp, arp, frag, opts[:10], nil)
}

// FuzzSegment: segment (re-injection of held packets) never panics, and
// fails only on frames it cannot parse or an MTU that leaves no room for
// payload. What it returns is the input's payload, in order, in valid
// frames (checkCutPart) with consecutive sequence numbers and IPv4 ids: one
// frame if its payload fits one segment (at most gsoSize, if set, and what
// the MTU leaves) or it is a SYN or RST, else frames whose IP packets fit
// the MTU, all but the last with the same number of payload bytes, at most
// gsoSize if that is set.
//
// `go test` runs the seeds; `go test -run '^$' -fuzz '^FuzzSegment$'
// ./internal/datapath` searches (no BPF, no root).
func FuzzSegment(f *testing.F) {
	for _, fr := range cutSeedFrames(f) {
		for _, c := range []struct {
			gso uint16
			mtu uint32
		}{{100, 1500}, {0, 152}, {0, 172}, {100, 300}, {0, 1500}, {0, 65536}, {1, 80}, {0, 70}, {0, 53}, {0, 73}, {2, 200}, {7, 76}} {
			f.Add(fr, c.gso, c.mtu)
		}
	}
	f.Fuzz(func(t *testing.T, frame []byte, gsoSize uint16, mtu uint32) {
		in, ok := cutParse(frame)
		if !ok {
			if _, err := segment(frame, int(gsoSize), int(mtu)); err == nil {
				t.Fatalf("segmented a frame that is not Ethernet + IP + TCP: %x", frame)
			}
			return
		}
		hdrs := in.ipHdr + in.tcpHdr
		if mss := int(mtu) - hdrs; mss > 0 && hdrs+len(in.payload) > int(mtu) {
			if gsoSize > 0 && int(gsoSize) < mss {
				mss = int(gsoSize)
			}
			if len(in.payload)/mss > 64 {
				// Many segments are slow to check, and the fuzzer
				// minimizes every new input; more segments than
				// this exercise nothing new.
				return
			}
		}
		parts, err := segment(frame, int(gsoSize), int(mtu))
		if err != nil {
			if int(mtu) > hdrs {
				t.Fatalf("segment(mtu %d, gso %d) refused a valid frame: %v", mtu, gsoSize, err)
			}
			return
		}
		if int(mtu) <= hdrs {
			t.Fatalf("segmented with an MTU of %d for %d bytes of headers", mtu, hdrs)
		}
		mss := int(mtu) - hdrs
		if gsoSize > 0 && int(gsoSize) < mss {
			mss = int(gsoSize)
		}
		whole := len(in.payload) <= mss || in.flags&(tcpSYN|tcpRST) != 0
		if len(parts) == 0 || whole != (len(parts) == 1) {
			t.Fatalf("%d parts for %d bytes of headers and %d of payload, MTU %d", len(parts), hdrs, len(in.payload), mtu)
		}
		off, size := 0, 0
		for i, out := range parts {
			last := i == len(parts)-1
			n := len(out) - 14 - hdrs
			if n < 0 || off+n > len(in.payload) {
				t.Fatalf("part %d: %d bytes, past the input's payload", i, len(out))
			}
			checkCutPart(t, frame, in, out, i, off, off+n, i == 0, last, in.id+uint16(i))
			if len(parts) > 1 {
				if len(out)-14 > int(mtu) {
					t.Fatalf("part %d: %d bytes of IP, MTU %d", i, len(out)-14, mtu)
				}
				if n == 0 || gsoSize > 0 && n > int(gsoSize) {
					t.Fatalf("part %d: %d payload bytes, gso %d", i, n, gsoSize)
				}
				if i == 0 {
					size = n
				} else if !last && n != size || last && n > size {
					t.Fatalf("part %d: %d payload bytes, part 0 had %d", i, n, size)
				}
			}
			off += n
		}
		if off != len(in.payload) {
			t.Fatalf("parts carry %d of %d payload bytes", off, len(in.payload))
		}
	})
}

// FuzzSplitFrame: SplitFrame (a packet straddling the two-path cut-off)
// never panics, and fails only on frames it cannot parse, SYNs and RSTs,
// and frames that do not straddle cut: payload bytes on both sides of it,
// or payload before it and a FIN. What it returns is two valid frames (checkCutPart): the payload
// before cut, then the rest from sequence number cut on, the second's
// IPv4 id following the ids of the first part's gsoSize-byte segments.
//
// `go test` runs the seeds; `go test -run '^$' -fuzz '^FuzzSplitFrame$'
// ./internal/datapath` searches (no BPF, no root).
func FuzzSplitFrame(f *testing.F) {
	for _, fr := range cutSeedFrames(f) {
		for _, c := range []struct {
			off uint32
			gso uint16
		}{{410, 100}, {1, 100}, {499, 100}, {500, 100}, {501, 0}, {0, 0}, {^uint32(0), 0}, {2, 0}, {3, 7}, {150, 144}} {
			f.Add(fr, 0xfffff000+c.off, c.gso)
		}
	}
	f.Fuzz(func(t *testing.T, frame []byte, cut uint32, gsoSize uint16) {
		parts, err := SplitFrame(frame, cut, int(gsoSize))
		in, ok := cutParse(frame)
		if !ok {
			if err == nil {
				t.Fatalf("split a frame that is not Ethernet + IP + TCP: %x", frame)
			}
			return
		}
		n := uint32(len(in.payload))
		off := cut - in.seq
		straddles := off > 0 && (off < n || off == n && in.flags&tcpFIN != 0) && in.flags&(tcpSYN|tcpRST) == 0
		if err != nil {
			if straddles {
				t.Fatalf("refused a frame of %d payload bytes (flags %#02x) cut %d bytes in: %v", n, in.flags, off, err)
			}
			return
		}
		if !straddles {
			t.Fatalf("split a frame of %d payload bytes (flags %#02x) cut %d bytes in", n, in.flags, off)
		}
		if len(parts) != 2 {
			t.Fatalf("%d parts", len(parts))
		}
		ids := uint16(1)
		if gsoSize > 0 {
			ids = uint16(max(1, (int(off)+int(gsoSize)-1)/int(gsoSize)))
		}
		checkCutPart(t, frame, in, parts[0], 0, 0, int(off), true, false, in.id)
		checkCutPart(t, frame, in, parts[1], 1, int(off), int(n), false, true, in.id+ids)
	})
}
