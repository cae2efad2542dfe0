package bench

// The churn runner's view of the client's TCP sockets (sock_diag), polled
// every churnPoll: when each session's socket was open.

import (
	"errors"
	"fmt"
	"math"
	"net/netip"
	"sync"
	"time"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/dysco/dysco/internal/labkit"
)

// sockTracker polls the client's TCP sockets of the workloads and keeps
// each session's lives: when its socket was first seen and last seen open.
type sockTracker struct {
	h     *netlink.Handle
	ports map[uint16]bool
	dsts  map[netip.Addr]bool
	done  chan struct{}
	wg    sync.WaitGroup
	once  sync.Once

	mu    sync.Mutex
	t0    time.Time
	now   float64
	polls int
	lives map[[2]netip.AddrPort][]*sockLife
}

// sockLife is one life of a session tuple (a tuple can be used again).
type sockLife struct {
	first, lastOpen, lastSeen float64
	open                      bool // at the last poll that saw it
}

func newSockTracker(ns string, fams []*churnFam, streams, shorts bool) (*sockTracker, error) {
	h, err := netns.GetFromName(ns)
	if err != nil {
		return nil, err
	}
	defer h.Close()
	nh, err := netlink.NewHandleAt(h, unix.NETLINK_INET_DIAG)
	if err != nil {
		return nil, fmt.Errorf("sock_diag in %s: %w", ns, err)
	}
	t := &sockTracker{h: nh, ports: map[uint16]bool{labkit.HTTPPort: true, churnStreamPort: streams, churnShortPort: shorts},
		dsts: map[netip.Addr]bool{}, done: make(chan struct{}), lives: map[[2]netip.AddrPort][]*sockLife{}}
	for _, f := range fams {
		t.dsts[f.server] = true
	}
	return t, nil
}

func (t *sockTracker) start(t0 time.Time) {
	t.t0 = t0
	t.poll()
	t.wg.Add(1)
	go func() {
		defer t.wg.Done()
		tick := time.NewTicker(churnPoll)
		defer tick.Stop()
		for {
			select {
			case <-t.done:
				return
			case <-tick.C:
				t.poll()
			}
		}
	}()
}

func (t *sockTracker) close() {
	t.once.Do(func() {
		close(t.done)
		t.wg.Wait()
		t.h.Close()
	})
}

// openState tells whether a TCP state is one of a session still open: it
// can still carry data one way or both.
func openState(s uint8) bool {
	switch s {
	case netlink.TCP_ESTABLISHED, netlink.TCP_SYN_SENT, netlink.TCP_FIN_WAIT1, netlink.TCP_FIN_WAIT2, netlink.TCP_CLOSE_WAIT:
		return true
	}
	return false
}

func (t *sockTracker) poll() {
	var socks []*netlink.Socket
	for _, fam := range []uint8{unix.AF_INET, unix.AF_INET6} {
		s, err := t.h.SocketDiagTCP(fam)
		if err != nil && !errors.Is(err, netlink.ErrDumpInterrupted) {
			continue
		}
		socks = append(socks, s...)
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	t.polls++
	now := time.Since(t.t0).Seconds()
	t.now = now
	for _, s := range socks {
		dst, ok := netip.AddrFromSlice(s.ID.Destination)
		if !ok || !t.ports[s.ID.DestinationPort] || !t.dsts[dst.Unmap()] {
			continue
		}
		src, _ := netip.AddrFromSlice(s.ID.Source)
		t.observe(netip.AddrPortFrom(src.Unmap(), s.ID.SourcePort), netip.AddrPortFrom(dst.Unmap(), s.ID.DestinationPort), openState(s.State), now)
	}
}

// observe records that a poll at now saw the socket src → dst, open or
// not (t.mu held).
func (t *sockTracker) observe(src, dst netip.AddrPort, open bool, now float64) {
	k := [2]netip.AddrPort{src, dst}
	ls := t.lives[k]
	var l *sockLife
	if n := len(ls); n > 0 {
		l = ls[n-1]
	}
	// A tuple seen open after it was closed, or after a gap, is a new
	// session.
	if l == nil || open && (!l.open || now-l.lastSeen > 1) {
		l = &sockLife{first: now}
		t.lives[k] = append(ls, l)
	}
	l.lastSeen = now
	l.open = open
	if open {
		l.lastOpen = now
	}
}

// life returns the life of a tuple that a round from at to end concerned:
// the last one that began before end.
func (t *sockTracker) life(src, dst netip.AddrPort, end float64) *sockLife {
	var out *sockLife
	for _, l := range t.lives[[2]netip.AddrPort{src, dst}] {
		if l.first <= end {
			out = l
		}
	}
	return out
}

// fate tells what became of a session by the end of a round (seconds since
// the start): "alive" if a poll after end saw its socket open, "ended" if
// not, "unseen" if no poll saw it before end.
func (t *sockTracker) fate(src, dst netip.AddrPort, end float64) string {
	t.mu.Lock()
	defer t.mu.Unlock()
	l := t.life(src, dst, end)
	switch {
	case l == nil:
		return "unseen"
	case l.lastOpen >= end:
		return "alive"
	}
	return "ended"
}

// aliveNow tells whether the last poll saw the session's socket open.
func (t *sockTracker) aliveNow(src, dst netip.AddrPort) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	l := t.life(src, dst, math.Inf(1))
	return l != nil && l.open && l.lastSeen >= t.now
}

// count is the number of sockets of a family to a port open at the last
// poll.
func (t *sockTracker) count(f *churnFam, port uint16) int {
	t.mu.Lock()
	defer t.mu.Unlock()
	n := 0
	for k, ls := range t.lives {
		if l := ls[len(ls)-1]; k[1].Port() == port && k[1].Addr() == f.server && l.open && l.lastSeen >= t.now {
			n++
		}
	}
	return n
}

func (t *sockTracker) counts(port uint16) map[netip.Addr]int {
	t.mu.Lock()
	defer t.mu.Unlock()
	out := map[netip.Addr]int{}
	for k, ls := range t.lives {
		if l := ls[len(ls)-1]; k[1].Port() == port && l.open && l.lastSeen >= t.now {
			out[k[1].Addr()]++
		}
	}
	return out
}

func (t *sockTracker) stats() (polls, lives int) {
	t.mu.Lock()
	defer t.mu.Unlock()
	for _, ls := range t.lives {
		lives += len(ls)
	}
	return t.polls, lives
}
