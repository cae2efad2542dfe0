package labkit

// Byte streams whose every byte is checked: the sender writes a known
// pattern, the receiver compares what it reads with it. At the end the
// sender half-closes and the receiver reads to EOF, so that "nothing lost"
// is a byte count and a byte-by-byte comparison, not an assumption.

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"
)

// PatLen is the period of the pattern: not a power of two, so that writes
// and reads do not line up with it.
const PatLen = 65521

// Pattern2 is the pattern twice, so that any window of up to PatLen bytes
// starting at an offset mod PatLen is one slice.
var Pattern2 = func() []byte {
	r := rand.New(rand.NewPCG(1, 2))
	b := make([]byte, 2*PatLen)
	for i := range PatLen {
		b[i] = byte(r.Uint32())
	}
	copy(b[PatLen:], b[:PatLen])
	return b
}()

// End is one socket of a session, with what it sent and received.
type End struct {
	Conn   *net.TCPConn
	Tx, Rx atomic.Int64
	GotEOF atomic.Bool  // the peer's FIN arrived
	bad    atomic.Int64 // offset+1 of the first byte that differed
	err    atomic.Pointer[error]
}

// NewEnd is the end of a TCP connection.
func NewEnd(c net.Conn) *End { return &End{Conn: c.(*net.TCPConn)} }

// Fail records err unless an error was recorded before.
func (e *End) Fail(err error) { e.err.CompareAndSwap(nil, &err) }

// Err is the first error of the end's reader or writer.
func (e *End) Err() error {
	if p := e.err.Load(); p != nil {
		return *p
	}
	return nil
}

// Send writes the pattern until stop, as fast as TCP lets (rate 0) or at
// rate bytes a second in 100 ms steps, then half-closes (FIN).
func (e *End) Send(stop *atomic.Bool, rate int64) {
	const tick = 100 * time.Millisecond
	const piece = 60000 // at most patLen
	chunk := piece
	if rate > 0 {
		chunk = max(int(rate*int64(tick)/int64(time.Second)), 1)
	}
	next := time.Now()
	for !stop.Load() {
		if rate > 0 {
			if d := time.Until(next); d > 0 {
				time.Sleep(min(d, tick))
				continue
			}
			next = next.Add(tick)
		}
		// A step's bytes, in writes of at most one pattern period.
		for left := chunk; left > 0; {
			off := int(e.Tx.Load() % PatLen)
			n, err := e.Conn.Write(Pattern2[off : off+min(left, piece)])
			e.Tx.Add(int64(n))
			left -= n
			if err != nil {
				e.Fail(fmt.Errorf("write after %d bytes: %w", e.Tx.Load(), err))
				return
			}
		}
	}
	if err := e.Conn.CloseWrite(); err != nil {
		e.Fail(fmt.Errorf("half-close: %w", err))
	}
}

// Recv reads to EOF, checking every byte against the pattern.
func (e *End) Recv() {
	buf := make([]byte, 32<<10)
	for {
		n, err := e.Conn.Read(buf)
		if n > 0 {
			off := int(e.Rx.Load() % PatLen)
			if e.bad.Load() == 0 && !bytes.Equal(buf[:n], Pattern2[off:off+n]) {
				i := 0
				for i < n && buf[i] == Pattern2[off+i] {
					i++
				}
				e.bad.Store(e.Rx.Load() + int64(i) + 1)
			}
			e.Rx.Add(int64(n))
		}
		if errors.Is(err, io.EOF) {
			e.GotEOF.Store(true)
			return
		}
		if err != nil {
			e.Fail(fmt.Errorf("read after %d bytes: %w", e.Rx.Load(), err))
			return
		}
	}
}

// SetNotsentLowat limits the bytes a sender keeps queued in its socket
// beyond what is in flight (TCP_NOTSENT_LOWAT): the writer waits instead of
// filling its send buffer (4 MiB). Hundreds of greedy sessions whose ends
// all live in one kernel would otherwise hold gigabytes of unsent data and
// push TCP into global memory pressure (tcp_mem counts every network
// namespace), which a real host with one end of each session would not
// see: Linux then shrinks every socket's buffers and drops what it cannot
// queue, and some sessions' congestion control collapses
// (docs/experiments.md, "Large bundles"). In-flight data is not counted, so
// the window is not limited.
func SetNotsentLowat(c *net.TCPConn, n int) error {
	rc, err := c.SyscallConn()
	if err != nil {
		return err
	}
	var serr error
	if err := rc.Control(func(fd uintptr) {
		serr = unix.SetsockoptInt(int(fd), unix.IPPROTO_TCP, unix.TCP_NOTSENT_LOWAT, n)
	}); err != nil {
		return err
	}
	return serr
}

// TCPMemPages is the TCP memory in use on the machine, in pages (the "mem"
// of /proc/net/sockstat, which counts every network namespace), and the
// pressure threshold (the middle value of net.ipv4.tcp_mem).
func TCPMemPages() (inUse, pressure int64, err error) {
	b, err := os.ReadFile("/proc/net/sockstat")
	if err != nil {
		return 0, 0, err
	}
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) > 0 && f[0] == "TCP:" {
			for i := 1; i+1 < len(f); i += 2 {
				if f[i] == "mem" {
					inUse, err = strconv.ParseInt(f[i+1], 10, 64)
				}
			}
		}
	}
	if err != nil {
		return 0, 0, err
	}
	b, err = os.ReadFile("/proc/sys/net/ipv4/tcp_mem")
	if err != nil {
		return inUse, 0, err
	}
	f := strings.Fields(string(b))
	if len(f) != 3 {
		return inUse, 0, fmt.Errorf("tcp_mem: %q", b)
	}
	pressure, err = strconv.ParseInt(f[1], 10, 64)
	return inUse, pressure, err
}

// Abort closes the socket with an RST (no TIME_WAIT left behind).
func (e *End) Abort() {
	e.Conn.SetLinger(0)
	e.Conn.Close()
}

// LossCheck compares what a sender sent with what its receiver got, once
// the receiver has seen EOF; it returns "" if every byte arrived intact.
func LossCheck(what string, snd, rcv *End) string {
	switch {
	case !rcv.GotEOF.Load():
		return fmt.Sprintf("%s: no EOF after %d of %d bytes (%v)", what, rcv.Rx.Load(), snd.Tx.Load(), errors.Join(rcv.Err(), snd.Err()))
	case rcv.Rx.Load() != snd.Tx.Load():
		return fmt.Sprintf("%s: %d bytes sent, %d received", what, snd.Tx.Load(), rcv.Rx.Load())
	case rcv.bad.Load() != 0:
		return fmt.Sprintf("%s: byte %d differs from what was sent", what, rcv.bad.Load()-1)
	}
	return ""
}

// WaitAll waits for wg up to d; it tells whether it returned in time.
func WaitAll(wg *sync.WaitGroup, d time.Duration) bool {
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	select {
	case <-done:
		return true
	case <-time.After(d):
		return false
	}
}

// WaitAccepted waits until the runner's server has accepted n sessions
// (*accepted, under mu), for at most 30 s; it returns how many it got.
func WaitAccepted(ctx context.Context, mu *sync.Mutex, accepted *int, n int) (int, error) {
	for deadline := time.Now().Add(30 * time.Second); ; {
		mu.Lock()
		a := *accepted
		mu.Unlock()
		if a == n {
			return a, nil
		}
		if time.Now().After(deadline) {
			return a, errors.New("not all within 30 s")
		}
		if err := SleepCtx(ctx, 20*time.Millisecond); err != nil {
			return a, err
		}
	}
}

// ReadSessionID reads the id that a runner's session sends first (8 bytes,
// big-endian) on the server's end c, waiting at most timeout for it.
func ReadSessionID(c net.Conn, timeout time.Duration) (uint64, error) {
	var hdr [8]byte
	c.SetReadDeadline(time.Now().Add(timeout))
	if _, err := io.ReadFull(c, hdr[:]); err != nil {
		return 0, err
	}
	c.SetReadDeadline(time.Time{})
	return binary.BigEndian.Uint64(hdr[:]), nil
}
