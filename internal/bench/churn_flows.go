package bench

// The churn runner's own sessions: byte-checked bulk sessions both ways
// and short connections, with their resets and failures.

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/netip"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/dysco/dysco/internal/labkit"
)

// isReset tells whether a socket error is a connection reset (or refused:
// an RST in answer to the SYN).
func isReset(err error) bool {
	return errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.EPIPE) ||
		errors.Is(err, syscall.ECONNREFUSED) || errors.Is(err, syscall.ECONNABORTED)
}

// flowError records a session's error as a reset or a failure.
func (c *churn) flowError(fc *flowCounter, what string, err error) {
	if isReset(err) {
		fc.resets.Add(1)
		c.problem("resets", "%s: %v", what, err)
		return
	}
	fc.failed.Add(1)
	c.problem("failed", "%s: %v", what, err)
}

func (c *churn) stopped() bool {
	select {
	case <-c.stop:
		return true
	default:
		return false
	}
}

// streamServer is the server end of a bulk session.
type streamServer struct {
	e    *labkit.End
	done chan struct{}
}

// serveStream is the server end of a bulk session: it receives to EOF and
// sends at the same rate until a little after the client's EOF (a
// half-closed session still carrying data), then half-closes.
func (c *churn) serveStream(conn net.Conn) {
	id, err := labkit.ReadSessionID(conn, 10*time.Second)
	if err != nil {
		conn.Close()
		return
	}
	s := &streamServer{e: labkit.NewEnd(conn), done: make(chan struct{})}
	c.mu.Lock()
	c.streamSrv[id] = s
	c.mu.Unlock()
	var stop atomic.Bool
	sent := make(chan struct{})
	go func() { defer close(sent); s.e.Send(&stop, c.spec.StreamRate) }()
	s.e.Recv()
	// Half-closed by the client: go on sending for up to 300 ms.
	select {
	case <-time.After(rand.N(300 * time.Millisecond)):
	case <-c.stop:
	}
	stop.Store(true)
	select {
	case <-sent:
	case <-time.After(30 * time.Second):
	}
	close(s.done)
}

// streamWorker opens byte-checked bulk sessions one after the other until
// the run stops.
func (c *churn) streamWorker(f *churnFam) {
	defer c.wg.Done()
	s := c.spec
	dst := netip.AddrPortFrom(f.server, churnStreamPort).String()
	for !c.stopped() {
		id := c.nextID.Add(1)
		dctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		conn, err := c.l.Dial(dctx, "client", "tcp", dst)
		cancel()
		what := fmt.Sprintf("%s stream %d", f.name, id)
		if err != nil {
			c.flowError(&c.streams, what+": dial", err)
			labkit.SleepCtx(context.Background(), 200*time.Millisecond)
			continue
		}
		c.streams.sessions.Add(1)
		what = fmt.Sprintf("%s stream %d (%s)", f.name, id, conn.LocalAddr())
		var hdr [8]byte
		binary.BigEndian.PutUint64(hdr[:], id)
		if _, err := conn.Write(hdr[:]); err != nil {
			c.flowError(&c.streams, what+": header", err)
			conn.Close()
			continue
		}
		cl := labkit.NewEnd(conn)
		var stop atomic.Bool
		var ends sync.WaitGroup
		ends.Add(2)
		go func() { defer ends.Done(); cl.Send(&stop, s.StreamRate) }()
		go func() { defer ends.Done(); cl.Recv() }()
		select {
		case <-time.After(s.StreamLife/4 + rand.N(s.StreamLife*3/4)):
		case <-c.stop:
		}
		stop.Store(true)
		if !labkit.WaitAll(&ends, 30*time.Second) {
			c.streams.failed.Add(1)
			c.problem("failed", "%s: no EOF from the server within 30 s of the half-close (%d bytes sent, %d received)", what, cl.Tx.Load(), cl.Rx.Load())
			cl.Abort()
			continue
		}
		c.mu.Lock()
		sv := c.streamSrv[id]
		c.mu.Unlock()
		if sv == nil {
			c.streams.failed.Add(1)
			c.problem("failed", "%s: the server never got it", what)
			conn.Close()
			continue
		}
		select {
		case <-sv.done:
		case <-time.After(30 * time.Second):
		}
		c.streams.up.Add(sv.e.Rx.Load())
		c.streams.down.Add(cl.Rx.Load())
		bad := false
		for _, x := range []struct {
			side string
			e    *labkit.End
		}{{"client", cl}, {"server", sv.e}} {
			if err := x.e.Err(); err != nil {
				c.flowError(&c.streams, what+" "+x.side, err)
				bad = true
			}
		}
		if !bad {
			for _, l := range []string{labkit.LossCheck(what+" up", cl, sv.e), labkit.LossCheck(what+" down", sv.e, cl)} {
				if l != "" && !bad {
					bad = true
					c.streams.failed.Add(1)
					c.problem("failed", "%s", l)
				}
			}
		}
		if !bad {
			c.streams.completed.Add(1)
		}
		conn.Close()
		sv.e.Conn.Close()
		c.mu.Lock()
		delete(c.streamSrv, id)
		c.mu.Unlock()
	}
}

// serveShort answers a short connection: a 16-byte request (id, size), a
// response of size bytes of the pattern, a half-close, then EOF.
func (c *churn) serveShort(conn net.Conn) {
	defer conn.Close()
	conn.SetDeadline(time.Now().Add(30 * time.Second))
	var hdr [16]byte
	if _, err := io.ReadFull(conn, hdr[:]); err != nil {
		if !c.stopped() && err != io.EOF {
			c.flowError(&c.shorts, "short connection, server: request", err)
		}
		return
	}
	n := int(binary.BigEndian.Uint64(hdr[8:]))
	if n <= 0 || n > labkit.PatLen {
		return
	}
	if _, err := conn.Write(labkit.Pattern2[:n]); err != nil {
		c.flowError(&c.shorts, fmt.Sprintf("short connection %d, server: response", binary.BigEndian.Uint64(hdr[:8])), err)
		return
	}
	conn.(*net.TCPConn).CloseWrite()
	if _, err := io.Copy(io.Discard, conn); err != nil {
		c.flowError(&c.shorts, fmt.Sprintf("short connection %d, server: waiting for the close", binary.BigEndian.Uint64(hdr[:8])), err)
	}
}

// shortWorker opens short connections one after the other until the run
// stops.
func (c *churn) shortWorker(f *churnFam) {
	defer c.wg.Done()
	dst := netip.AddrPortFrom(f.server, churnShortPort).String()
	buf := make([]byte, labkit.PatLen+1)
	for !c.stopped() {
		id := c.nextID.Add(1)
		n := 1000 + rand.N(59000)
		what := fmt.Sprintf("%s short connection %d", f.name, id)
		err := func() error {
			dctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			conn, err := c.l.Dial(dctx, "client", "tcp", dst)
			cancel()
			if err != nil {
				return fmt.Errorf("dial: %w", err)
			}
			defer conn.Close()
			c.shorts.sessions.Add(1)
			what = fmt.Sprintf("%s short connection %d (%s)", f.name, id, conn.LocalAddr())
			conn.SetDeadline(time.Now().Add(30 * time.Second))
			var hdr [16]byte
			binary.BigEndian.PutUint64(hdr[:8], id)
			binary.BigEndian.PutUint64(hdr[8:], uint64(n))
			if _, err := conn.Write(hdr[:]); err != nil {
				return fmt.Errorf("request: %w", err)
			}
			c.shorts.up.Add(16)
			got, err := io.ReadFull(conn, buf[:n])
			c.shorts.down.Add(int64(got))
			if err != nil {
				return fmt.Errorf("response after %d of %d bytes: %w", got, n, err)
			}
			if !bytes.Equal(buf[:n], labkit.Pattern2[:n]) {
				return fmt.Errorf("%w: the response differs from what was sent", errBytes)
			}
			if k, err := conn.Read(buf); k != 0 || err != io.EOF {
				return fmt.Errorf("after the response: %d more bytes, %v (want EOF)", k, err)
			}
			return nil
		}()
		switch {
		case err == nil:
			c.shorts.completed.Add(1)
		case c.stopped() && !isReset(err):
		default:
			c.flowError(&c.shorts, what, err)
		}
		select {
		case <-time.After(c.spec.ShortGap):
		case <-c.stop:
		}
	}
}

var errBytes = errors.New("bytes differ")
