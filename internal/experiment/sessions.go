package experiment

// The runner's own sessions in the firewall-migration and proxy-removal
// experiments: both ends of each, the client's dialled by the runner, the
// server's found by the id each session sends in its first 8 bytes.

import (
	"net"
	"sync"
	"sync/atomic"
	"time"

	"github.com/dysco/dysco/internal/labkit"
)

// bundledSession is one session: its client end and its server end.
type bundledSession struct {
	ID, Bundle int
	cl, sv     *labkit.End
	local      string // the client end's address, where it is needed
}

// sessionSet is the sessions of a run and what stops their ends.
type sessionSet struct {
	stop     atomic.Bool
	wg       sync.WaitGroup
	sessions []*bundledSession
	mu       sync.Mutex // sessions, accepted
	accepted int
	quit     chan struct{}
	lns      []net.Listener // the server's, if the runner listens itself
}

func newSessionSet(n int) sessionSet {
	return sessionSet{sessions: make([]*bundledSession, n), quit: make(chan struct{})}
}

// serverEnd takes c as the server's end of the session whose id it
// reads first, runs prepare (if set) on it, and counts it accepted with
// two more goroutines to wait for (its receiver and its sender). It
// closes c and returns nil when c names no session still without one.
func (x *sessionSet) serverEnd(c net.Conn, prepare func(*labkit.End)) *bundledSession {
	n, err := labkit.ReadSessionID(c, 30*time.Second)
	if err != nil {
		c.Close() // a health check (HAProxy), or a broken session
		return nil
	}
	id := int(n)
	x.mu.Lock()
	if id < 0 || id >= len(x.sessions) || x.sessions[id] == nil || x.sessions[id].sv != nil {
		x.mu.Unlock()
		c.Close()
		return nil
	}
	s := x.sessions[id]
	s.sv = labkit.NewEnd(c)
	if prepare != nil {
		prepare(s.sv)
	}
	x.accepted++
	x.wg.Add(2)
	x.mu.Unlock()
	return s
}

// finish has every sender half-close and waits up to d for every end to
// finish; it tells whether they did.
func (x *sessionSet) finish(d time.Duration) bool {
	x.stop.Store(true)
	close(x.quit)
	return labkit.WaitAll(&x.wg, d)
}

// shutdown stops every end and listener and waits up to 10 s for them.
func (x *sessionSet) shutdown() {
	x.stop.Store(true)
	select {
	case <-x.quit:
	default:
		close(x.quit)
	}
	for _, ln := range x.lns {
		ln.Close()
	}
	for _, s := range x.sessions {
		if s == nil {
			continue
		}
		s.cl.Abort()
		if s.sv != nil {
			s.sv.Abort()
		}
	}
	labkit.WaitAll(&x.wg, 10*time.Second)
}
