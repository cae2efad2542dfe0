package datapath

// Packet holding at an anchor while a session's middlebox state migrates
// (paper §3.5, last paragraph; M2M draft §5.2-5.3). The datapath copies each
// held packet to the dysco_hold ring buffer and swallows it (bpf/include/
// hold.h); the agent reads the copies with a HoldReader and, once the new
// path is ready, sends them again with a Reinjector. Re-injected packets
// carry ReinjectMark, which the datapath never holds, and take the ordinary
// egress path (translation, two paths, reroute) as any packet of the
// session.

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"time"

	"github.com/cilium/ebpf/ringbuf"
	"golang.org/x/sys/unix"
)

// ReinjectMark is the socket mark of re-injected packets (consts.h
// DYSCO_REINJECT_MARK).
const ReinjectMark uint32 = 0x0d5c0001

// Flow flags that hold an egress flow's packets, set and cleared with
// SetFlowFlags (consts.h FL_HOLD_*).
const (
	// FlagHoldData holds packets that carry new data: payload or FIN that
	// ends beyond the flow's mark (retransmissions and pure ACKs go on).
	FlagHoldData uint32 = 1 << 13
	// FlagHoldAll holds every packet of the flow, ACKs included.
	FlagHoldAll uint32 = 1 << 14
)

// holdHdrLen is the size of struct hold_hdr; holdFlag* are HOLD_F_*.
const (
	holdHdrLen    = 16
	holdFlagV6    = 1 << 0
	holdFlagSplit = 1 << 1
	holdFlagRight = 1 << 2
)

// HeldPacket is a packet the datapath held: the frame from its Ethernet
// header, as it was leaving by interface Ifindex, in session space. A GSO
// packet comes whole, with its segment size.
//
// A packet with Split is not held but handed over to be split: its data
// straddles the cut-off (OldSent) of the two-path record {Session, Side},
// and the agent sends it again as two packets (SplitFrame), each of which
// then takes its own path (paper §3.5; bpf/include/twopath_fwd.h, tp_split).
type HeldPacket struct {
	Session uint32
	Ifindex int
	GSOSize uint16
	IPv6    bool
	Split   bool
	Side    uint32
	Frame   []byte
}

// HoldReader reads held packets in the order they were held.
type HoldReader struct{ r *ringbuf.Reader }

// HoldReader returns a reader of the held packets.
func (d *Datapath) HoldReader() (*HoldReader, error) {
	r, err := ringbuf.NewReader(d.objs.DyscoHold)
	if err != nil {
		return nil, fmt.Errorf("datapath: held packets: %w", err)
	}
	return &HoldReader{r: r}, nil
}

// Read blocks until a held packet is there. After Close it returns an error
// that matches ringbuf.ErrClosed; past a deadline one that matches
// os.ErrDeadlineExceeded.
func (r *HoldReader) Read() (HeldPacket, error) {
	for {
		rec, err := r.r.Read()
		if err != nil {
			return HeldPacket{}, err
		}
		p, err := parseHeld(rec.RawSample)
		if err != nil {
			continue // not written by this datapath; cannot happen
		}
		return p, nil
	}
}

func parseHeld(b []byte) (HeldPacket, error) {
	if len(b) < holdHdrLen {
		return HeldPacket{}, errors.New("short record")
	}
	n := binary.NativeEndian.Uint32(b[8:])
	if uint64(n) > uint64(len(b)-holdHdrLen) {
		return HeldPacket{}, errors.New("record shorter than its frame")
	}
	flags := binary.NativeEndian.Uint16(b[14:])
	p := HeldPacket{
		Session: binary.NativeEndian.Uint32(b),
		Ifindex: int(binary.NativeEndian.Uint32(b[4:])),
		GSOSize: binary.NativeEndian.Uint16(b[12:]),
		IPv6:    flags&holdFlagV6 != 0,
		Split:   flags&holdFlagSplit != 0,
		Frame:   append([]byte(nil), b[holdHdrLen:holdHdrLen+int(n)]...),
	}
	if flags&holdFlagRight != 0 {
		p.Side = 1
	}
	return p, nil
}

// SetDeadline makes Read return os.ErrDeadlineExceeded once t has passed
// with nothing to read (the zero time: no deadline), so that the agent can
// drain the ring.
func (r *HoldReader) SetDeadline(t time.Time) { r.r.SetDeadline(t) }

// Close stops the reader; a blocked Read returns.
func (r *HoldReader) Close() error { return r.r.Close() }

// Reinjector sends held packets again: one AF_PACKET socket per interface,
// opened on first use, with the socket mark ReinjectMark, so that the
// datapath's egress program translates them and never holds them again.
// Frames longer than the interface's MTU (GSO packets) are segmented.
// It is safe for use by one goroutine.
type Reinjector struct {
	socks map[int]reinjectSock
}

type reinjectSock struct {
	fd  int
	mtu int
}

// NewReinjector returns a Reinjector with no socket open yet. Sockets are
// opened in the caller's network namespace.
func NewReinjector() *Reinjector { return &Reinjector{socks: map[int]reinjectSock{}} }

func (r *Reinjector) sock(ifindex int) (reinjectSock, error) {
	if s, ok := r.socks[ifindex]; ok {
		return s, nil
	}
	ifc, err := net.InterfaceByIndex(ifindex)
	if err != nil {
		return reinjectSock{}, fmt.Errorf("datapath: re-inject on interface %d: %w", ifindex, err)
	}
	// Protocol 0: the socket sends only, it receives nothing.
	fd, err := unix.Socket(unix.AF_PACKET, unix.SOCK_RAW|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return reinjectSock{}, fmt.Errorf("datapath: re-inject on %s: packet socket: %w", ifc.Name, err)
	}
	if err := unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_MARK, int(ReinjectMark)); err != nil {
		unix.Close(fd)
		return reinjectSock{}, fmt.Errorf("datapath: re-inject on %s: SO_MARK (needs CAP_NET_ADMIN): %w", ifc.Name, err)
	}
	s := reinjectSock{fd: fd, mtu: ifc.MTU}
	r.socks[ifindex] = s
	return s, nil
}

// Send sends a held packet on its interface, segmented to the interface's
// MTU if it is longer, with every TCP checksum computed in full (a held
// packet's checksum may be partial: CHECKSUM_PARTIAL).
func (r *Reinjector) Send(p HeldPacket) error {
	s, err := r.sock(p.Ifindex)
	if err != nil {
		return err
	}
	frames, err := segment(p.Frame, int(p.GSOSize), s.mtu)
	if err != nil {
		return fmt.Errorf("datapath: re-inject packet of session %d: %w", p.Session, err)
	}
	for _, f := range frames {
		sa := &unix.SockaddrLinklayer{Ifindex: p.Ifindex, Protocol: htons(binary.BigEndian.Uint16(f[12:]))}
		if err := unix.Sendto(s.fd, f, 0, sa); err != nil {
			return fmt.Errorf("datapath: re-inject packet of session %d on interface %d: %w", p.Session, p.Ifindex, err)
		}
	}
	return nil
}

// Close closes the sockets.
func (r *Reinjector) Close() error {
	var errs []error
	for i, s := range r.socks {
		errs = append(errs, unix.Close(s.fd))
		delete(r.socks, i)
	}
	return errors.Join(errs...)
}

const (
	ethHdrLen   = 14
	etherIPv4   = 0x0800
	etherIPv6   = 0x86dd
	tcpFIN      = 0x01
	tcpSYN      = 0x02
	tcpRST      = 0x04
	tcpPSH      = 0x08
	tcpURG      = 0x20
	tcpCWR      = 0x80
	ipv4HdrMin  = 20
	ipv6HdrLen  = 40
	tcpHdrMin   = 20
	ipProtoTCP  = 6
	ipv4MFOrOff = 0x3fff
)

// tcpFrame is an Ethernet + IPv4/IPv6 + TCP frame taken apart for cutting
// (segment, SplitFrame).
type tcpFrame struct {
	frame         []byte
	v6            bool
	ipHdr, tcpHdr int
	hdrs          int    // Ethernet, IP and TCP headers
	payload       []byte // without link-layer padding
	seq           uint32
	flags         byte
	id            uint16 // IPv4
}

func parseTCPFrame(frame []byte) (tcpFrame, error) {
	f := tcpFrame{frame: frame}
	if len(frame) < ethHdrLen {
		return f, fmt.Errorf("frame of %d bytes", len(frame))
	}
	var l3Len int
	ip := frame[ethHdrLen:]
	switch et := binary.BigEndian.Uint16(frame[12:]); et {
	case etherIPv4:
		if len(ip) < ipv4HdrMin || ip[0]>>4 != 4 {
			return f, errors.New("truncated or bad IPv4 header")
		}
		f.ipHdr = int(ip[0]&0xf) * 4
		l3Len = int(binary.BigEndian.Uint16(ip[2:]))
		if f.ipHdr < ipv4HdrMin || ip[9] != ipProtoTCP {
			return f, fmt.Errorf("IPv4 packet with header length %d, protocol %d: only TCP is held", f.ipHdr, ip[9])
		}
		if binary.BigEndian.Uint16(ip[6:])&ipv4MFOrOff != 0 {
			return f, errors.New("IPv4 fragment: cannot be held")
		}
		f.id = binary.BigEndian.Uint16(ip[4:])
	case etherIPv6:
		f.v6 = true
		if len(ip) < ipv6HdrLen || ip[0]>>4 != 6 {
			return f, errors.New("truncated or bad IPv6 header")
		}
		f.ipHdr = ipv6HdrLen
		l3Len = ipv6HdrLen + int(binary.BigEndian.Uint16(ip[4:]))
		if ip[6] != ipProtoTCP {
			return f, fmt.Errorf("IPv6 next header %d: extension headers are not supported, only TCP directly after the IPv6 header", ip[6])
		}
	default:
		return f, fmt.Errorf("ethertype %#04x: only IPv4 and IPv6 are held", et)
	}
	if l3Len > len(ip) || l3Len < f.ipHdr+tcpHdrMin {
		return f, fmt.Errorf("IP length %d does not fit the frame's %d bytes", l3Len, len(ip))
	}
	f.tcpHdr = int(ip[f.ipHdr+12]>>4) * 4
	if f.tcpHdr < tcpHdrMin || f.ipHdr+f.tcpHdr > l3Len {
		return f, fmt.Errorf("TCP header length %d does not fit the IP length %d", f.tcpHdr, l3Len)
	}
	f.hdrs = ethHdrLen + f.ipHdr + f.tcpHdr
	f.payload = frame[f.hdrs : ethHdrLen+l3Len]
	f.seq = binary.BigEndian.Uint32(frame[ethHdrLen+f.ipHdr+4:])
	f.flags = frame[ethHdrLen+f.ipHdr+13]
	return f, nil
}

// piece returns part i of the frame cut into parts: the payload bytes
// [lo, hi), its sequence number advanced by lo, FIN and PSH only on the
// last part, CWR only on the first, the IPv4 id advanced by i, lengths
// and checksums (IPv4 header, TCP in full) computed for it. The urgent
// pointer (relative to the sequence number) keeps pointing at the same
// byte; a part that starts at or after that point carries no URG, since
// its urgent data was in an earlier part (RFC 9293 3.8.5).
func (f tcpFrame) piece(lo, hi, i int, last bool) []byte {
	chunk := f.payload[lo:hi]
	out := make([]byte, f.hdrs+len(chunk))
	copy(out, f.frame[:f.hdrs])
	copy(out[f.hdrs:], chunk)
	fip := out[ethHdrLen:]
	th := fip[f.ipHdr:]
	if f.v6 {
		binary.BigEndian.PutUint16(fip[4:], uint16(f.tcpHdr+len(chunk)))
	} else {
		binary.BigEndian.PutUint16(fip[2:], uint16(f.ipHdr+f.tcpHdr+len(chunk)))
		binary.BigEndian.PutUint16(fip[4:], f.id+uint16(i))
		fip[10], fip[11] = 0, 0
		binary.BigEndian.PutUint16(fip[10:], ^fold16(sum16be(fip[:f.ipHdr], 0)))
	}
	binary.BigEndian.PutUint32(th[4:], f.seq+uint32(lo))
	fl := f.flags
	if !last {
		fl &^= tcpFIN | tcpPSH
	}
	if i > 0 {
		fl &^= tcpCWR
	}
	if fl&tcpURG != 0 && lo > 0 {
		up := int(binary.BigEndian.Uint16(th[18:]))
		if up > lo {
			binary.BigEndian.PutUint16(th[18:], uint16(up-lo))
		} else {
			fl &^= tcpURG
			th[18], th[19] = 0, 0
		}
	}
	th[13] = fl
	seg := th[:f.tcpHdr+len(chunk)]
	var pseudo uint32
	if f.v6 {
		pseudo = sum16be(fip[8:40], 0)
	} else {
		pseudo = sum16be(fip[12:20], 0)
	}
	pseudo += ipProtoTCP + uint32(len(seg))
	th[16], th[17] = 0, 0
	binary.BigEndian.PutUint16(th[16:], ^fold16(sum16be(seg, pseudo)))
	return out
}

// segment splits an Ethernet + IPv4/IPv6 + TCP frame into frames whose IP
// packets fit mtu, as the kernel's TCP segmentation offload would: payload
// in mss-byte segments (gsoSize, or what the MTU leaves, if less; a SYN or
// RST stays whole), sequence numbers
// advanced, IPv4 total length, id and header checksum and IPv6 payload
// length fixed, FIN and PSH on the last segment only, CWR on the first only,
// the urgent pointer kept on its byte (piece). Every frame, segmented or
// not, gets its TCP checksum computed in full.
func segment(frame []byte, gsoSize, mtu int) ([][]byte, error) {
	f, err := parseTCPFrame(frame)
	if err != nil {
		return nil, err
	}
	mss := mtu - f.ipHdr - f.tcpHdr
	if gsoSize > 0 && gsoSize < mss {
		mss = gsoSize
	}
	if mss <= 0 {
		return nil, fmt.Errorf("MTU %d leaves no room for TCP payload", mtu)
	}
	// A GSO packet is cut into its gsoSize-byte segments even when it
	// would fit the MTU whole: gsoSize is the MSS its sender chose (the
	// peer's, or a clamped one). A SYN or RST is never cut (its data,
	// if any, does not start at seq, and the flag cannot be repeated).
	n := 1
	if len(f.payload) > mss && f.flags&(tcpSYN|tcpRST) == 0 {
		n = (len(f.payload) + mss - 1) / mss
	}
	out := make([][]byte, 0, n)
	for i := 0; i < n; i++ {
		lo, hi := i*mss, len(f.payload) // the last segment: the rest (all of it when n is 1)
		if i < n-1 {
			hi = lo + mss
		}
		out = append(out, f.piece(lo, hi, i, i == n-1))
	}
	return out, nil
}

// SplitFrame cuts an Ethernet + IPv4/IPv6 + TCP frame whose data straddles
// sequence number cut into two frames (paper §3.5: the bytes below the
// cut-off go on the old path, the rest on the new one): the payload before
// cut, then the payload from cut on with the FIN, if any (so a segment
// whose payload ends at cut and that carries a FIN is cut into its data
// and a bare FIN). The parts get lengths and checksums of their own (TCP
// in full), FIN and PSH only on the second, CWR only on the first, the
// urgent pointer kept on its byte (piece). The second part's IPv4 id
// follows those of the first's segments, if the first is a GSO packet of
// gsoSize-byte segments (0: not GSO). It refuses a frame that does not
// straddle cut, and a SYN or RST.
func SplitFrame(frame []byte, cut uint32, gsoSize int) ([][]byte, error) {
	f, err := parseTCPFrame(frame)
	if err != nil {
		return nil, err
	}
	if f.flags&(tcpSYN|tcpRST) != 0 {
		return nil, errors.New("a SYN or RST is not split")
	}
	off := cut - f.seq
	n := uint32(len(f.payload))
	if off == 0 || off > n || (off == n && f.flags&tcpFIN == 0) {
		return nil, fmt.Errorf("segment [%d, %d) with %d payload bytes does not straddle %d", f.seq, f.seq+n, n, cut)
	}
	ids := 1 // the segments of the first part, and so its ids
	if gsoSize > 0 {
		ids = max(1, (int(off)+gsoSize-1)/gsoSize)
	}
	return [][]byte{f.piece(0, int(off), 0, false), f.piece(int(off), int(n), ids, true)}, nil
}

// sum16be adds b as big-endian 16-bit words to s (one's complement sum,
// not folded).
func sum16be(b []byte, s uint32) uint32 {
	for len(b) >= 2 {
		s += uint32(b[0])<<8 | uint32(b[1])
		b = b[2:]
	}
	if len(b) == 1 {
		s += uint32(b[0]) << 8
	}
	return s
}

func fold16(s uint32) uint16 {
	for s>>16 != 0 {
		s = s&0xffff + s>>16
	}
	return uint16(s)
}
