package reconfig

// The control socket: what the loop's steps send leaves when the step
// ends, several messages for one agent as one bundle (docs/protocol.md,
// "Bundles"); each datagram read is handled as one step.

import (
	"errors"
	"fmt"
	"net"
	"net/netip"

	"github.com/dysco/dysco/internal/protocol"
	"golang.org/x/sys/unix"
)

// controlRcvBuf is the control socket's receive buffer.
const controlRcvBuf = 8 << 20

// outMsg is a datagram payload waiting for the end of the loop's step.
type outMsg struct {
	to   netip.Addr
	data []byte
}

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
// migration message) for the agent at to; it leaves when the
// loop's step ends (flush), or at once when a full bundle for to is
// waiting. Loop goroutine.
func (c *Shell) send(to netip.Addr, data []byte) {
	n := 0 // the bytes of a bundle of what waits for to
	for _, m := range c.outbox {
		if m.to == to {
			n += 2 + len(m.data)
		}
	}
	if n > 0 && n+2+len(data) > protocol.BundleMax-protocol.BundleHeaderLen {
		c.flush()
	}
	c.msgsOut.Add(1)
	c.outbox = append(c.outbox, outMsg{to, data})
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
		c.write(m.to, m.data)
		return
	}
	box := c.outbox
	c.outbox = c.outbox[:0]
	var dests []netip.Addr
	per := map[netip.Addr][][]byte{}
	for _, m := range box {
		if _, ok := per[m.to]; !ok {
			dests = append(dests, m.to)
		}
		per[m.to] = append(per[m.to], m.data)
	}
	for _, to := range dests {
		for _, d := range protocol.PackBundles(per[to], protocol.BundleMax) {
			c.write(to, d)
		}
	}
	clear(box)
}

// write sends one datagram to the agent at to.
func (c *Shell) write(to netip.Addr, d []byte) {
	c.dgramsOut.Add(1)
	if _, err := c.conn.WriteToUDPAddrPort(d, netip.AddrPortFrom(to, uint16(c.port))); err != nil {
		c.log.Warn("control: send failed", "to", to, "bytes", len(d), "err", err)
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
