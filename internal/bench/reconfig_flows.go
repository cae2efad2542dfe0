package bench

// The reconfig benchmark's sessions: both ends of each, paced or greedy,
// and their goodput over a window.

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/netip"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/dysco/dysco/internal/labkit"
)

// flow is one end of a session.
type flow struct {
	c      net.Conn
	client bool
	rx, tx atomic.Int64
}

// flowSet is the sessions of one phase, both ends of each (the client's
// and the server's sockets are the runner's).
type flowSet struct {
	rate    int64
	dialed  time.Duration // time taken to dial every session
	greedy  atomic.Bool
	stopped atomic.Bool
	wg      sync.WaitGroup

	mu      sync.Mutex
	clients []*flow
	servers []*flow
	nerr    int
	errs    []string
}

func newFlowSet(rate int64) *flowSet { return &flowSet{rate: rate} }

// add starts sending and receiving on c.
func (fs *flowSet) add(c net.Conn, client bool) {
	f := &flow{c: c, client: client}
	fs.mu.Lock()
	if client {
		fs.clients = append(fs.clients, f)
	} else {
		fs.servers = append(fs.servers, f)
	}
	fs.mu.Unlock()
	fs.wg.Add(2)
	go fs.send(f)
	go fs.recv(f)
}

func (fs *flowSet) counts() (clients, servers int) {
	fs.mu.Lock()
	defer fs.mu.Unlock()
	return len(fs.clients), len(fs.servers)
}

// fail records an error of a session, unless the set is being stopped.
func (fs *flowSet) fail(f *flow, what string, err error) {
	if fs.stopped.Load() {
		return
	}
	side := "server"
	if f.client {
		side = "client"
	}
	fs.mu.Lock()
	defer fs.mu.Unlock()
	fs.nerr++
	if len(fs.errs) < 5 {
		fs.errs = append(fs.errs, fmt.Sprintf("%s %s (%s -> %s, after %d bytes in, %d out): %v",
			side, what, f.c.LocalAddr(), f.c.RemoteAddr(), f.rx.Load(), f.tx.Load(), err))
	}
}

func (fs *flowSet) errors() (int, []string) {
	fs.mu.Lock()
	defer fs.mu.Unlock()
	return fs.nerr, slices.Clone(fs.errs)
}

// send writes rate bytes a second in steps of reconfigTick (starting at a
// random point of the first step, so that the sessions do not write in
// lockstep), or as fast as TCP lets once the set is greedy.
func (fs *flowSet) send(f *flow) {
	defer fs.wg.Done()
	chunk := max(int(fs.rate*int64(reconfigTick)/int64(time.Second)), 1)
	next := time.Now().Add(rand.N(reconfigTick))
	for !fs.stopped.Load() {
		b := payload
		if !fs.greedy.Load() {
			if d := time.Until(next); d > 0 {
				time.Sleep(d)
			}
			next = next.Add(reconfigTick)
			if now := time.Now(); next.Before(now) {
				next = now.Add(reconfigTick)
			}
			b = payload[:chunk]
		}
		n, err := f.c.Write(b)
		f.tx.Add(int64(n))
		if err != nil {
			fs.fail(f, "write", err)
			return
		}
	}
}

func (fs *flowSet) recv(f *flow) {
	defer fs.wg.Done()
	buf := make([]byte, 16<<10)
	for {
		n, err := f.c.Read(buf)
		f.rx.Add(int64(n))
		if err != nil {
			if err == io.EOF {
				err = errors.New("closed by the peer")
			}
			fs.fail(f, "read", err)
			return
		}
	}
}

// stop closes every socket of the set (with an RST: no FIN exchange nor
// TIME_WAIT left behind) and waits for the goroutines.
func (fs *flowSet) stop() {
	fs.stopped.Store(true)
	fs.mu.Lock()
	all := append(slices.Clone(fs.clients), fs.servers...)
	fs.mu.Unlock()
	for _, f := range all {
		if tc, ok := f.c.(*net.TCPConn); ok {
			tc.SetLinger(0)
		}
		f.c.Close()
	}
	done := make(chan struct{})
	go func() { fs.wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
	}
}

// snapshot is the bytes each end received so far.
type snapshot struct {
	at      time.Time
	clients []int64 // received by the client ends (server → client)
	servers []int64 // received by the server ends (client → server)
}

func (fs *flowSet) snap() snapshot {
	fs.mu.Lock()
	defer fs.mu.Unlock()
	s := snapshot{at: time.Now()}
	for _, f := range fs.clients {
		s.clients = append(s.clients, f.rx.Load())
	}
	for _, f := range fs.servers {
		s.servers = append(s.servers, f.rx.Load())
	}
	return s
}

// waitProgress waits until every end has received more than it had at the
// call, for up to d, and returns the ends that did not.
func (fs *flowSet) waitProgress(ctx context.Context, d time.Duration) ([]string, error) {
	fs.mu.Lock()
	all := append(slices.Clone(fs.clients), fs.servers...)
	fs.mu.Unlock()
	base := make([]int64, len(all))
	for i, f := range all {
		base[i] = f.rx.Load()
	}
	deadline := time.Now().Add(d)
	for {
		var stuck []string
		for i, f := range all {
			if f.rx.Load() <= base[i] {
				side := "server"
				if f.client {
					side = "client"
				}
				stuck = append(stuck, fmt.Sprintf("%s end %s <- %s", side, f.c.LocalAddr(), f.c.RemoteAddr()))
			}
		}
		if len(stuck) == 0 || time.Now().After(deadline) {
			return stuck, nil
		}
		if err := labkit.SleepCtx(ctx, 100*time.Millisecond); err != nil {
			return stuck, err
		}
	}
}

// windowResult is the goodput of a set over a window.
type windowResult struct {
	Seconds float64 `json:"seconds"`
	// Up is client → server, Down server → client, in Gbit/s.
	UpGbps    float64 `json:"up_gbps"`
	DownGbps  float64 `json:"down_gbps"`
	TotalGbps float64 `json:"total_gbps"`
	// Stalled counts the ends that received nothing during the window.
	StalledClients int `json:"stalled_clients"`
	StalledServers int `json:"stalled_servers"`
}

// goodput compares two snapshots of the same set.
func goodput(a, b snapshot) windowResult {
	sec := b.at.Sub(a.at).Seconds()
	w := windowResult{Seconds: sec}
	sum := func(x, y []int64, stalled *int) float64 {
		var t int64
		for i := range y {
			var d int64
			if i < len(x) {
				d = y[i] - x[i]
			} else {
				d = y[i]
			}
			if d <= 0 {
				*stalled++
			}
			t += d
		}
		return float64(t) * 8 / sec / 1e9
	}
	if sec <= 0 {
		return w
	}
	w.DownGbps = sum(a.clients, b.clients, &w.StalledClients)
	w.UpGbps = sum(a.servers, b.servers, &w.StalledServers)
	w.TotalGbps = w.UpGbps + w.DownGbps
	return w
}

// open dials n sessions from the client to HAProxy and waits until the
// server has accepted all n; the sessions start sending at once.
func (rl *ReconfigLab) open(ctx context.Context, n int, rate float64) (*flowSet, error) {
	fs := newFlowSet(ReconfigRate)
	rl.cur.Store(fs)
	dst := netip.AddrPortFrom(rl.Proxy, ProxyPort).String()
	start := time.Now()
	err := rl.Lab.Do("client", func() error {
		d := net.Dialer{Timeout: 10 * time.Second}
		for i := 0; i < n; i++ {
			if rate > 0 {
				if w := time.Until(start.Add(time.Duration(float64(i) / rate * float64(time.Second)))); w > 0 {
					time.Sleep(w)
				}
			}
			c, err := d.DialContext(ctx, "tcp", dst)
			if err != nil {
				return fmt.Errorf("session %d/%d to %s: %w", i+1, n, dst, err)
			}
			fs.add(c, true)
		}
		fs.dialed = time.Since(start)
		return nil
	})
	if err != nil {
		return fs, err
	}
	deadline := time.Now().Add(20 * time.Second)
	for {
		_, s := fs.counts()
		if s >= n {
			return fs, nil
		}
		if err := ctx.Err(); err != nil {
			return fs, err
		}
		if time.Now().After(deadline) {
			return fs, fmt.Errorf("the server accepted %d of the %d sessions relayed by HAProxy after 20 s", s, n)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// measureWindow makes the set greedy, lets it warm up, and measures the
// goodput over o.ReconfigWindow, with the changes of the proxy host's
// datapath counters during the window.
func (rl *ReconfigLab) measureWindow(ctx context.Context, o *Options, fs *flowSet) (windowResult, map[string]uint64, error) {
	fs.greedy.Store(true)
	if err := labkit.SleepCtx(ctx, reconfigWarm); err != nil {
		return windowResult{}, nil, err
	}
	before, err := labkit.AgentStatus(ctx, o.Dysco, rl.Lab, "proxy")
	if err != nil {
		return windowResult{}, nil, err
	}
	a := fs.snap()
	if err := labkit.SleepCtx(ctx, o.ReconfigWindow); err != nil {
		return windowResult{}, nil, err
	}
	b := fs.snap()
	after, err := labkit.AgentStatus(ctx, o.Dysco, rl.Lab, "proxy")
	if err != nil {
		return windowResult{}, nil, err
	}
	return goodput(a, b), labkit.CounterDelta(before, after), nil
}
