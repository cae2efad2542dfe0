package migrate

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// ctnetlink: the conntrack subsystem of NETLINK_NETFILTER
// (include/uapi/linux/netfilter/nfnetlink_conntrack.h). Messages are built
// by hand rather than through vishvananda/netlink's ConntrackFlow, which
// carries neither the status bits, nor the TCP window scales and flags, nor
// the zone on create.
const (
	nfnlSubsysCtnetlink = 1
	ipctnlMsgCtNew      = 0
	ipctnlMsgCtGet      = 1
	ipctnlMsgCtDelete   = 2

	nlaFNested = 0x8000
	nlaTypeMsk = 0x3fff

	ctaTupleOrig    = 1
	ctaTupleReply   = 2
	ctaStatus       = 3
	ctaProtoinfo    = 4
	ctaNatSrc       = 6
	ctaTimeout      = 7
	ctaMark         = 8
	ctaNatDst       = 13
	ctaZone         = 18
	ctaLabels       = 22
	ctaLabelsMask   = 23
	ctaTupleIP      = 1
	ctaTupleProto   = 2
	ctaIPv4Src      = 1
	ctaIPv4Dst      = 2
	ctaIPv6Src      = 3
	ctaIPv6Dst      = 4
	ctaProtoNum     = 1
	ctaProtoSport   = 2
	ctaProtoDport   = 3
	ctaProtoinfoTCP = 1
	ctaTCPState     = 1
	ctaTCPWscaleO   = 2
	ctaTCPWscaleR   = 3
	ctaTCPFlagsO    = 4
	ctaTCPFlagsR    = 5
	ctaNatV4Min     = 1
	ctaNatV4Max     = 2
	ctaNatProto     = 3
	ctaNatV6Min     = 4
	ctaNatV6Max     = 5
	ctaProtonatMin  = 1
	ctaProtonatMax  = 2
)

// Conntrack status bits (enum ip_conntrack_status).
const (
	ipsSeenReply    = 1 << 1
	ipsAssured      = 1 << 2
	ipsConfirmed    = 1 << 3
	ipsSrcNat       = 1 << 4
	ipsDstNat       = 1 << 5
	ipsFixedTimeout = 1 << 10
	// ipsSettable are the bits ctnetlink lets user space set on a new
	// entry (ctnetlink_change_status refuses to change EXPECTED, CONFIRMED
	// and DYING and ignores the NAT bits, which come with CTA_NAT_*).
	ipsSettable = ipsSeenReply | ipsAssured | ipsFixedTimeout
)

// TCP conntrack flags (IP_CT_TCP_FLAG_*): the ones that describe the
// connection rather than the tracker's recent packets move; MAXACK_SET,
// DATA_UNACKNOWLEDGED and EXP_CHALLENGE_ACK refer to window data that
// ctnetlink cannot carry (td_maxack and friends) and are cleared.
const (
	tcpFlagWindowScale = 0x01
	tcpFlagSackPerm    = 0x02
	tcpFlagCloseInit   = 0x04
	tcpFlagBeLiberal   = 0x08
	tcpFlagSimOpen     = 0x80
	tcpFlagsCarried    = tcpFlagWindowScale | tcpFlagSackPerm | tcpFlagCloseInit | tcpFlagBeLiberal | tcpFlagSimOpen
)

// nlConn is a NETLINK_NETFILTER socket, opened in the calling thread's
// network namespace.
type nlConn struct {
	fd  int
	seq uint32
}

func dialNetfilter() (*nlConn, error) {
	fd, err := unix.Socket(unix.AF_NETLINK, unix.SOCK_RAW|unix.SOCK_CLOEXEC, unix.NETLINK_NETFILTER)
	if err != nil {
		return nil, fmt.Errorf("netlink socket: %w", err)
	}
	if err := unix.Bind(fd, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("netlink bind: %w", err)
	}
	_ = unix.SetsockoptInt(fd, unix.SOL_NETLINK, unix.NETLINK_EXT_ACK, 1)
	return &nlConn{fd: fd, seq: uint32(time.Now().UnixNano())}, nil
}

func (c *nlConn) Close() error { return unix.Close(c.fd) }

// errNoEntry is ENOENT from ctnetlink: no such conntrack entry.
var errNoEntry = errors.New("no such conntrack entry")

// request sends one ctnetlink message (msg type, flags besides REQUEST|ACK)
// and returns the payloads (after nfgenmsg) of the messages answered before
// the ack. ctx bounds the wait for the answer.
func (c *nlConn) request(ctx context.Context, msgType uint16, flags uint16, family uint8, attrs []byte) ([][]byte, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	c.seq++
	seq := c.seq
	msg := make([]byte, 0, unix.NLMSG_HDRLEN+4+len(attrs))
	msg = binary.NativeEndian.AppendUint32(msg, uint32(unix.NLMSG_HDRLEN+4+len(attrs)))
	msg = binary.NativeEndian.AppendUint16(msg, nfnlSubsysCtnetlink<<8|msgType)
	msg = binary.NativeEndian.AppendUint16(msg, unix.NLM_F_REQUEST|unix.NLM_F_ACK|flags)
	msg = binary.NativeEndian.AppendUint32(msg, seq)
	msg = binary.NativeEndian.AppendUint32(msg, 0)
	msg = append(msg, family, 0 /* NFNETLINK_V0 */, 0, 0)
	msg = append(msg, attrs...)
	if err := unix.Sendto(c.fd, msg, 0, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
		return nil, fmt.Errorf("netlink send: %w", err)
	}
	deadline, ok := ctx.Deadline()
	if !ok {
		deadline = time.Now().Add(5 * time.Second)
	}
	var out [][]byte
	buf := make([]byte, 1<<16)
	for {
		wait := time.Until(deadline)
		if wait <= 0 {
			return nil, fmt.Errorf("netlink: no answer: %w", context.DeadlineExceeded)
		}
		tv := unix.NsecToTimeval(wait.Nanoseconds())
		if err := unix.SetsockoptTimeval(c.fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv); err != nil {
			return nil, fmt.Errorf("netlink: %w", err)
		}
		n, _, err := unix.Recvfrom(c.fd, buf, 0)
		if err != nil {
			if errors.Is(err, unix.EINTR) {
				continue
			}
			if errors.Is(err, unix.EAGAIN) {
				return nil, fmt.Errorf("netlink: no answer: %w", context.DeadlineExceeded)
			}
			return nil, fmt.Errorf("netlink receive: %w", err)
		}
		msgs, err := syscall.ParseNetlinkMessage(buf[:n])
		if err != nil {
			return nil, fmt.Errorf("netlink: %w", err)
		}
		for _, m := range msgs {
			if m.Header.Seq != seq {
				continue
			}
			switch m.Header.Type {
			case unix.NLMSG_ERROR:
				if len(m.Data) < 4 {
					return nil, errors.New("netlink: short error message")
				}
				errno := -int32(binary.NativeEndian.Uint32(m.Data[:4]))
				switch {
				case errno == 0:
					return out, nil
				case unix.Errno(errno) == unix.ENOENT:
					return out, errNoEntry
				default:
					return out, unix.Errno(errno)
				}
			case unix.NLMSG_DONE:
				return out, nil
			default:
				if len(m.Data) < 4 {
					return nil, errors.New("netlink: short conntrack message")
				}
				// Copy: the next receive reuses buf.
				out = append(out, append([]byte(nil), m.Data[4:]...))
			}
		}
	}
}

// attribute building

type attrs []byte

func (a attrs) add(typ uint16, val []byte) attrs {
	l := 4 + len(val)
	a = binary.NativeEndian.AppendUint16(a, uint16(l))
	a = binary.NativeEndian.AppendUint16(a, typ)
	a = append(a, val...)
	for len(a)%4 != 0 {
		a = append(a, 0)
	}
	return a
}

func (a attrs) nest(typ uint16, inner attrs) attrs { return a.add(typ|nlaFNested, inner) }
func (a attrs) u8(typ uint16, v uint8) attrs       { return a.add(typ, []byte{v}) }
func (a attrs) be16(typ uint16, v uint16) attrs {
	return a.add(typ, binary.BigEndian.AppendUint16(nil, v))
}
func (a attrs) be32(typ uint16, v uint32) attrs {
	return a.add(typ, binary.BigEndian.AppendUint32(nil, v))
}

// parseAttrs splits a run of attributes by type (nested flag cleared).
func parseAttrs(b []byte) (map[uint16][]byte, error) {
	m := map[uint16][]byte{}
	for len(b) >= 4 {
		l := int(binary.NativeEndian.Uint16(b[0:2]))
		typ := binary.NativeEndian.Uint16(b[2:4]) & nlaTypeMsk
		if l < 4 || l > len(b) {
			return nil, fmt.Errorf("netlink attribute %d: bad length %d", typ, l)
		}
		m[typ] = b[4:l]
		al := (l + 3) &^ 3
		if al > len(b) {
			al = len(b)
		}
		b = b[al:]
	}
	return m, nil
}

// ctTuple is one direction of a conntrack entry.
type ctTuple struct {
	Src   netip.Addr `json:"src"`
	Dst   netip.Addr `json:"dst"`
	Sport uint16     `json:"sport"`
	Dport uint16     `json:"dport"`
	Proto uint8      `json:"proto"`
}

func (t ctTuple) reverse() ctTuple {
	return ctTuple{Src: t.Dst, Dst: t.Src, Sport: t.Dport, Dport: t.Sport, Proto: t.Proto}
}

func (t ctTuple) String() string {
	return fmt.Sprintf("proto %d %s -> %s", t.Proto, netip.AddrPortFrom(t.Src, t.Sport), netip.AddrPortFrom(t.Dst, t.Dport))
}

func (t ctTuple) attrs() attrs {
	var ip attrs
	if t.Src.Is4() {
		s, d := t.Src.As4(), t.Dst.As4()
		ip = ip.add(ctaIPv4Src, s[:]).add(ctaIPv4Dst, d[:])
	} else {
		s, d := t.Src.As16(), t.Dst.As16()
		ip = ip.add(ctaIPv6Src, s[:]).add(ctaIPv6Dst, d[:])
	}
	proto := attrs(nil).u8(ctaProtoNum, t.Proto).be16(ctaProtoSport, t.Sport).be16(ctaProtoDport, t.Dport)
	return attrs(nil).nest(ctaTupleIP, ip).nest(ctaTupleProto, proto)
}

func parseTuple(b []byte) (ctTuple, error) {
	var t ctTuple
	m, err := parseAttrs(b)
	if err != nil {
		return t, err
	}
	ip, err := parseAttrs(m[ctaTupleIP])
	if err != nil {
		return t, err
	}
	if s, ok := ip[ctaIPv4Src]; ok && len(s) == 4 && len(ip[ctaIPv4Dst]) == 4 {
		t.Src = netip.AddrFrom4([4]byte(s))
		t.Dst = netip.AddrFrom4([4]byte(ip[ctaIPv4Dst]))
	} else if s, ok := ip[ctaIPv6Src]; ok && len(s) == 16 && len(ip[ctaIPv6Dst]) == 16 {
		t.Src = netip.AddrFrom16([16]byte(s))
		t.Dst = netip.AddrFrom16([16]byte(ip[ctaIPv6Dst]))
	} else {
		return t, errors.New("conntrack tuple without addresses")
	}
	pr, err := parseAttrs(m[ctaTupleProto])
	if err != nil {
		return t, err
	}
	if v := pr[ctaProtoNum]; len(v) == 1 {
		t.Proto = v[0]
	}
	if v := pr[ctaProtoSport]; len(v) == 2 {
		t.Sport = binary.BigEndian.Uint16(v)
	}
	if v := pr[ctaProtoDport]; len(v) == 2 {
		t.Dport = binary.BigEndian.Uint16(v)
	}
	return t, nil
}

// ctTCP is the TCP part of an entry that ctnetlink can set (nlattr_to_tcp):
// the state, each direction's window scale and flags. The window edges
// (td_end, td_maxend, td_maxwin) cannot be set: on the new host the first
// packet in each direction takes the tracker's mid-stream pick-up path
// (tcp_in_window, "td_maxwin == 0"), which needs no nf_conntrack_tcp_loose.
type ctTCP struct {
	State       uint8 `json:"state"`
	WscaleOrig  uint8 `json:"wscale_orig"`
	WscaleReply uint8 `json:"wscale_reply"`
	FlagsOrig   uint8 `json:"flags_orig"`
	FlagsReply  uint8 `json:"flags_reply"`
}

// ctEntry is one conntrack entry as it moves.
type ctEntry struct {
	Orig    ctTuple `json:"orig"`
	Reply   ctTuple `json:"reply"`
	Zone    uint16  `json:"zone,omitempty"`
	Status  uint32  `json:"status"`  // as exported (all bits); only ipsSettable are set on import
	Timeout uint32  `json:"timeout"` // seconds left
	Mark    uint32  `json:"mark,omitempty"`
	Labels  []byte  `json:"labels,omitempty"`
	TCP     *ctTCP  `json:"tcp,omitempty"`
}

func (e *ctEntry) family() uint8 {
	if e.Orig.Src.Is4() {
		return unix.AF_INET
	}
	return unix.AF_INET6
}

func parseEntry(b []byte) (*ctEntry, error) {
	m, err := parseAttrs(b)
	if err != nil {
		return nil, err
	}
	e := &ctEntry{}
	if e.Orig, err = parseTuple(m[ctaTupleOrig]); err != nil {
		return nil, fmt.Errorf("original tuple: %w", err)
	}
	if e.Reply, err = parseTuple(m[ctaTupleReply]); err != nil {
		return nil, fmt.Errorf("reply tuple: %w", err)
	}
	if v := m[ctaZone]; len(v) == 2 {
		e.Zone = binary.BigEndian.Uint16(v)
	}
	if v := m[ctaStatus]; len(v) == 4 {
		e.Status = binary.BigEndian.Uint32(v)
	}
	if v := m[ctaTimeout]; len(v) == 4 {
		e.Timeout = binary.BigEndian.Uint32(v)
	}
	if v := m[ctaMark]; len(v) == 4 {
		e.Mark = binary.BigEndian.Uint32(v)
	}
	if v := m[ctaLabels]; len(v) > 0 && !allZero(v) {
		e.Labels = append([]byte(nil), v...)
	}
	if v, ok := m[ctaProtoinfo]; ok {
		pi, err := parseAttrs(v)
		if err != nil {
			return nil, err
		}
		if v, ok := pi[ctaProtoinfoTCP]; ok {
			tm, err := parseAttrs(v)
			if err != nil {
				return nil, err
			}
			tcp := &ctTCP{}
			if v := tm[ctaTCPState]; len(v) == 1 {
				tcp.State = v[0]
			}
			if v := tm[ctaTCPWscaleO]; len(v) == 1 {
				tcp.WscaleOrig = v[0]
			}
			if v := tm[ctaTCPWscaleR]; len(v) == 1 {
				tcp.WscaleReply = v[0]
			}
			if v := tm[ctaTCPFlagsO]; len(v) >= 1 { // struct nf_ct_tcp_flags {flags, mask}
				tcp.FlagsOrig = v[0]
			}
			if v := tm[ctaTCPFlagsR]; len(v) >= 1 {
				tcp.FlagsReply = v[0]
			}
			e.TCP = tcp
		}
	}
	return e, nil
}

func allZero(b []byte) bool {
	for _, c := range b {
		if c != 0 {
			return false
		}
	}
	return true
}

// keyAttrs names the entry by its original tuple in its zone (GET, DELETE).
func keyAttrs(orig ctTuple, zone uint16) attrs {
	return attrs(nil).nest(ctaTupleOrig, orig.attrs()).be16(ctaZone, zone)
}

// natAttrs returns the CTA_NAT_SRC / CTA_NAT_DST ranges that rebuild the
// entry's NAT binding: ctnetlink takes NAT only as a range to set up
// (nf_nat_setup_info), not from the reply tuple or the NAT status bits. A
// one-address, one-port range gives back exactly the exported binding.
func natAttrs(e *ctEntry) attrs {
	var a attrs
	// DNAT: the reply comes from somewhere other than where the
	// initiator sent it.
	if e.Reply.Src != e.Orig.Dst || e.Reply.Sport != e.Orig.Dport {
		a = a.nest(ctaNatDst, natRange(e.Reply.Src, e.Reply.Sport))
	}
	// SNAT: the reply goes somewhere other than the initiator.
	if e.Reply.Dst != e.Orig.Src || e.Reply.Dport != e.Orig.Sport {
		a = a.nest(ctaNatSrc, natRange(e.Reply.Dst, e.Reply.Dport))
	}
	return a
}

func natRange(addr netip.Addr, port uint16) attrs {
	var a attrs
	if addr.Is4() {
		b := addr.As4()
		a = a.add(ctaNatV4Min, b[:]).add(ctaNatV4Max, b[:])
	} else {
		b := addr.As16()
		a = a.add(ctaNatV6Min, b[:]).add(ctaNatV6Max, b[:])
	}
	return a.nest(ctaNatProto, attrs(nil).be16(ctaProtonatMin, port).be16(ctaProtonatMax, port))
}

// setAttrs are the attributes of an entry that both create and update take:
// timeout, status, mark, labels and TCP protoinfo.
func setAttrs(e *ctEntry, status uint32) attrs {
	a := attrs(nil).be32(ctaTimeout, max(e.Timeout, 1)).be32(ctaStatus, status).be32(ctaMark, e.Mark)
	if len(e.Labels) > 0 {
		a = a.add(ctaLabels, e.Labels)
		mask := make([]byte, len(e.Labels))
		for i := range mask {
			mask[i] = 0xff
		}
		a = a.add(ctaLabelsMask, mask)
	}
	if e.TCP != nil {
		// BE_LIBERAL on both directions, as conntrackd does for the
		// entries it injects ("TCPWindowTracking Off"): ctnetlink cannot
		// carry the window edges, and the tracker's mid-stream pick-up
		// takes the receiver's window from the first packet it sees, so
		// a burst of data in flight at the switch (held packets released
		// at once) falls outside it and would be dropped as INVALID. The
		// entry still admits only this connection's tuples; its sequence
		// numbers are no longer checked against the windows.
		t := attrs(nil).u8(ctaTCPState, e.TCP.State).
			add(ctaTCPFlagsO, []byte{e.TCP.FlagsOrig&tcpFlagsCarried | tcpFlagBeLiberal, 0xff}).
			add(ctaTCPFlagsR, []byte{e.TCP.FlagsReply&tcpFlagsCarried | tcpFlagBeLiberal, 0xff}).
			u8(ctaTCPWscaleO, e.TCP.WscaleOrig).
			u8(ctaTCPWscaleR, e.TCP.WscaleReply)
		a = a.nest(ctaProtoinfo, attrs(nil).nest(ctaProtoinfoTCP, t))
	}
	return a
}

// ctGet returns the entry whose original tuple is orig in zone, or
// errNoEntry.
func (c *nlConn) ctGet(ctx context.Context, orig ctTuple, zone uint16) (*ctEntry, error) {
	fam := uint8(unix.AF_INET6)
	if orig.Src.Is4() {
		fam = unix.AF_INET
	}
	msgs, err := c.request(ctx, ipctnlMsgCtGet, 0, fam, keyAttrs(orig, zone))
	if err != nil {
		return nil, err
	}
	if len(msgs) == 0 {
		return nil, errNoEntry
	}
	e, err := parseEntry(msgs[0])
	if err != nil {
		return nil, fmt.Errorf("conntrack entry %s: %w", orig, err)
	}
	e.Zone = zone
	return e, nil
}

// ctCreate creates e, failing with EEXIST when its tuples are taken.
func (c *nlConn) ctCreate(ctx context.Context, e *ctEntry) error {
	// The reply tuple goes in un-NATed: NAT set-up (CTA_NAT_*) derives the
	// translated reply tuple from it and sets the NAT status bits only when
	// it changes the tuple; a translated reply tuple here would leave the
	// entry without SRC_NAT/DST_NAT and the packets untranslated.
	a := attrs(nil).nest(ctaTupleOrig, e.Orig.attrs()).nest(ctaTupleReply, e.Orig.reverse().attrs()).be16(ctaZone, e.Zone)
	a = append(a, natAttrs(e)...)
	// ctnetlink_create_conntrack marks the entry CONFIRMED before it
	// applies CTA_STATUS, and ctnetlink_change_status refuses to change
	// that bit: say it.
	a = append(a, setAttrs(e, e.Status&ipsSettable|ipsConfirmed)...)
	var err error
	for range 3 {
		// EAGAIN: the kernel loaded the NAT module for the NAT set-up and
		// asks to send the request again.
		_, err = c.request(ctx, ipctnlMsgCtNew, unix.NLM_F_CREATE|unix.NLM_F_EXCL, e.family(), a)
		if !errors.Is(err, unix.EAGAIN) {
			break
		}
	}
	if err != nil {
		return err
	}
	// NAT set-up picks another binding when the exported one is taken here.
	got, err := c.ctGet(ctx, e.Orig, e.Zone)
	if err != nil {
		return fmt.Errorf("reading the new entry back: %w", err)
	}
	if got.Reply != e.Reply {
		_ = c.ctDelete(ctx, e.Orig, e.Zone)
		return fmt.Errorf("NAT binding %s is taken on this host (the kernel chose %s)", e.Reply, got.Reply)
	}
	return nil
}

// ctUpdate changes the existing entry cur (named by its original tuple) to
// e's timeout, status bits, mark, labels and TCP state (not its tuples or
// NAT). The kernel refuses (EBUSY) to clear SEEN_REPLY or ASSURED.
func (c *nlConn) ctUpdate(ctx context.Context, cur, e *ctEntry) error {
	a := attrs(nil).nest(ctaTupleOrig, e.Orig.attrs()).be16(ctaZone, e.Zone)
	// ctnetlink_change_status refuses a status that differs in CONFIRMED,
	// EXPECTED or DYING: keep the entry's own bits outside ipsSettable.
	a = append(a, setAttrs(e, cur.Status&^ipsSettable|e.Status&ipsSettable)...)
	_, err := c.request(ctx, ipctnlMsgCtNew, 0, e.family(), a)
	return err
}

// ctDelete deletes the entry whose original tuple is orig in zone;
// errNoEntry when there is none.
func (c *nlConn) ctDelete(ctx context.Context, orig ctTuple, zone uint16) error {
	fam := uint8(unix.AF_INET6)
	if orig.Src.Is4() {
		fam = unix.AF_INET
	}
	_, err := c.request(ctx, ipctnlMsgCtDelete, 0, fam, keyAttrs(orig, zone))
	return err
}
