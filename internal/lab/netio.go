package lab

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"time"
)

// Do runs fn on an OS thread in the namespace of host. Sockets that fn opens
// belong to that namespace for their whole life, and may be used anywhere
// afterwards; goroutines that fn starts run in the root namespace.
func (l *Lab) Do(host string, fn func() error) error {
	h, err := l.host(host)
	if err != nil {
		return err
	}
	return inNetns(h.Namespace, fn)
}

// Dial connects from the namespace of host, as net.Dialer.DialContext does.
// The address must hold an IP address, not a name: resolving a name could
// dial from another thread, outside the namespace.
func (l *Lab) Dial(ctx context.Context, host, network, address string) (net.Conn, error) {
	var c net.Conn
	err := l.Do(host, func() (err error) {
		var d net.Dialer
		c, err = d.DialContext(ctx, network, address)
		return err
	})
	return c, err
}

// Listen listens in the namespace of host, as net.Listen does.
func (l *Lab) Listen(host, network, address string) (net.Listener, error) {
	var ln net.Listener
	err := l.Do(host, func() (err error) {
		ln, err = net.Listen(network, address)
		return err
	})
	return ln, err
}

// Ping sends ICMP (or ICMPv6) echo requests from the namespace of host to
// dst, one every pingInterval, until a reply comes or ctx is done; without a
// deadline on ctx it gives up after 5 s. It needs no ping binary.
func (l *Lab) Ping(ctx context.Context, host string, dst netip.Addr) error {
	var cancel context.CancelFunc
	if _, ok := ctx.Deadline(); ok {
		ctx, cancel = context.WithCancel(ctx)
	} else {
		ctx, cancel = context.WithTimeout(ctx, 5*time.Second)
	}
	defer cancel()
	network, reqType, replyType := "ip4:icmp", byte(8), byte(0)
	if dst.Unmap().Is6() {
		network, reqType, replyType = "ip6:ipv6-icmp", 128, 129
	} else {
		dst = dst.Unmap()
	}
	var conn net.PacketConn
	err := l.Do(host, func() (err error) {
		conn, err = net.ListenPacket(network, "")
		return err
	})
	if err != nil {
		return fmt.Errorf("ping from %s: opening ICMP socket: %w", host, err)
	}
	defer conn.Close()
	go func() {
		<-ctx.Done()
		conn.SetReadDeadline(time.Now()) // wake the reader
	}()

	var idb [2]byte
	rand.Read(idb[:])
	id := binary.BigEndian.Uint16(idb[:])
	payload := make([]byte, 16)
	rand.Read(payload)
	to := &net.IPAddr{IP: dst.AsSlice(), Zone: dst.Zone()}
	const pingInterval = 200 * time.Millisecond
	buf := make([]byte, 1500)
	for seq := uint16(1); ; seq++ {
		msg := make([]byte, 8, 8+len(payload))
		msg[0] = reqType
		binary.BigEndian.PutUint16(msg[4:], id)
		binary.BigEndian.PutUint16(msg[6:], seq)
		msg = append(msg, payload...)
		if reqType == 8 {
			// The kernel fills in the ICMPv6 checksum, not the ICMP one.
			binary.BigEndian.PutUint16(msg[2:], icmpChecksum(msg))
		}
		if _, err := conn.WriteTo(msg, to); err != nil {
			return fmt.Errorf("ping from %s to %s: %w", host, dst, err)
		}
		conn.SetReadDeadline(time.Now().Add(pingInterval))
		for {
			n, _, err := conn.ReadFrom(buf)
			if ctx.Err() != nil {
				return fmt.Errorf("ping from %s to %s: no reply: %w", host, dst, ctx.Err())
			}
			if errors.Is(err, net.ErrClosed) {
				return err
			}
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				break // next request
			}
			if err != nil {
				return fmt.Errorf("ping from %s to %s: %w", host, dst, err)
			}
			// A raw socket sees every ICMP packet of the namespace: match
			// type, id and payload. (Go strips the IPv4 header.)
			r := buf[:n]
			if len(r) >= 8 && r[0] == replyType && binary.BigEndian.Uint16(r[4:]) == id && bytes.Equal(r[8:], payload) {
				return nil
			}
		}
	}
}

// icmpChecksum is the Internet checksum (RFC 1071).
func icmpChecksum(b []byte) uint16 {
	var sum uint32
	for i := 0; i+1 < len(b); i += 2 {
		sum += uint32(b[i])<<8 | uint32(b[i+1])
	}
	if len(b)%2 == 1 {
		sum += uint32(b[len(b)-1]) << 8
	}
	for sum>>16 != 0 {
		sum = sum&0xffff + sum>>16
	}
	return ^uint16(sum)
}
