package reconfig

// The control socket: what the loop's steps send leaves when the step
// ends, several messages for one agent as one bundle (docs/protocol.md,
// "Bundles"); each datagram read is handled as one step.

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"unsafe"

	"github.com/dysco/dysco/internal/protocol"
	"golang.org/x/sys/unix"
)

// controlRcvBuf is the control socket's receive buffer.
const controlRcvBuf = 8 << 20

// outMsg is a datagram payload waiting for the end of the loop's step,
// with the address it leaves from (zero: the route's).
type outMsg struct {
	to, from netip.Addr
	data     []byte
}

// dest is where a bundle goes, and from where.
type dest struct{ to, from netip.Addr }

// listenUDP opens the control socket on port, both families.
func listenUDP(port int) (Conn, error) {
	conn, err := net.ListenUDP("udp", &net.UDPAddr{IP: net.IPv6unspecified, Port: port})
	if err != nil {
		return nil, fmt.Errorf("reconfig: control socket on UDP port %d: %w", port, err)
	}
	// Hundreds of reconfigurations can start at once (a proxy splicing
	// all its sessions): a receive buffer far beyond the default keeps
	// the burst from overflowing it (SO_RCVBUFFORCE: root may exceed
	// net.core.rmem_max).
	if raw, err := conn.SyscallConn(); err == nil {
		_ = raw.Control(func(fd uintptr) {
			if unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_RCVBUFFORCE, controlRcvBuf) != nil {
				_ = conn.SetReadBuffer(controlRcvBuf)
			}
		})
	}
	return conn, nil
}

// send queues a datagram payload (a control message, a
// migration message) for the agent at to, leaving from the local address
// from (zero: the one the route chooses); it leaves when the loop's step
// ends (flush), or at once when a full bundle for to is waiting. Loop
// goroutine.
func (c *Shell) send(to, from netip.Addr, data []byte) {
	n := 0 // the bytes of a bundle of what waits for to
	for _, m := range c.outbox {
		if m.to == to && m.from == from {
			n += 2 + len(m.data)
		}
	}
	if n > 0 && n+2+len(data) > protocol.BundleMax-protocol.BundleHeaderLen {
		c.flush()
	}
	c.msgsOut.Add(1)
	c.outbox = append(c.outbox, outMsg{to, from, data})
}

// flush sends what the loop's step queued: per destination, in the order
// of each destination's first message, its messages in the order they were
// queued, as few datagrams as PackBundles makes of them. Loop goroutine.
func (c *Shell) flush() {
	switch len(c.outbox) {
	case 0:
		return
	case 1: // the common case: nothing to bundle
		m := c.outbox[0]
		c.outbox[0] = outMsg{}
		c.outbox = c.outbox[:0]
		c.write(m.to, m.from, m.data)
		return
	}
	box := c.outbox
	c.outbox = c.outbox[:0]
	var dests []dest
	per := map[dest][][]byte{}
	for _, m := range box {
		k := dest{m.to, m.from}
		if _, ok := per[k]; !ok {
			dests = append(dests, k)
		}
		per[k] = append(per[k], m.data)
	}
	for _, k := range dests {
		for _, d := range protocol.PackBundles(per[k], protocol.BundleMax) {
			c.write(k.to, k.from, d)
		}
	}
	clear(box)
}

// write sends one datagram to the agent at to, from the local address
// from (the MAC covers it: the route's choice may have changed since the
// message was built).
func (c *Shell) write(to, from netip.Addr, d []byte) {
	c.dgramsOut.Add(1)
	addr := netip.AddrPortFrom(to, uint16(c.port))
	var err error
	if from.IsValid() {
		_, _, err = c.conn.WriteMsgUDPAddrPort(d, sourceCmsg(from), addr)
	} else {
		_, err = c.conn.WriteToUDPAddrPort(d, addr)
	}
	if err != nil {
		c.log.Warn("control: send failed", "to", to, "from", from, "bytes", len(d), "err", err)
	}
}

// readLoop reads the control socket and handles each datagram itself, as
// one step of the loop. (One datagram a step: taking all that are waiting
// costs a receive that fails with EAGAIN every step, which an idle agent
// pays on every message, and with 600 removals at once it did not change
// the agents' CPU or the removal times, BENCHMARKS.md "Control messages
// bundled".)
func (c *Shell) readLoop() {
	buf := make([]byte, 64<<10)
	for {
		n, from, err := c.conn.ReadFromUDPAddrPort(buf)
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			continue
		}
		data := append([]byte(nil), buf[:n]...)
		src := from.Addr().Unmap()
		c.locked(func() { c.onDatagram(src, data) })
	}
}

// onDatagram handles a datagram: one message, or a bundle of several, each
// handled as if it had come alone.
func (c *Shell) onDatagram(from netip.Addr, data []byte) {
	c.dgramsIn.Add(1)
	if !protocol.IsBundle(data) {
		c.msgsIn.Add(1)
		c.onPacket(from, data)
		return
	}
	ps, err := protocol.SplitBundle(data)
	if err != nil {
		c.msgsIn.Add(1)
		c.countReject("bad_bundle")
		c.log.Debug("control datagram refused", "from", from, "err", err)
		return
	}
	c.msgsIn.Add(uint64(len(ps)))
	for _, p := range ps {
		c.onPacket(from, p)
	}
}

// sourceCmsg is the ancillary data that makes a datagram of the dual-stack
// control socket leave from src: IPV6_PKTINFO, which also takes an
// IPv4-mapped address for an IPv4 datagram (the kernel's ip_cmsg_send).
// golang.org/x/net/ipv6 leaves IPv4 addresses out of it.
func sourceCmsg(src netip.Addr) []byte {
	b := make([]byte, unix.CmsgSpace(unix.SizeofInet6Pktinfo))
	h := (*unix.Cmsghdr)(unsafe.Pointer(&b[0]))
	h.Level, h.Type = unix.IPPROTO_IPV6, unix.IPV6_PKTINFO
	h.SetLen(unix.CmsgLen(unix.SizeofInet6Pktinfo))
	info := b[unix.CmsgLen(0):]
	a := src.As16() // IPv4-mapped for IPv4
	copy(info[:16], a[:])
	binary.NativeEndian.PutUint32(info[16:20], 0) // any interface
	return b
}
