package experiment

// Benchmark "reconfig": an unmodified HAProxy removed from live sessions
// (paper §5.3, Figures 12 and 13). Its own lab, a star of client, proxy and
// server with an agent on each; the client's sessions to the proxy and the
// proxy's sessions to the server are Dysco sessions with no middlebox, so
// that the two can be joined. HAProxy relays in TCP mode with splicing;
// under LD_PRELOAD=lib/libdysco.so, its splice calls ask the proxy's agent
// to take the proxy off each session, and the client's agent, as left
// anchor, runs the reconfiguration and records how long it took (`dysco
// reconfig history`). The runner is both ends of every session: it dials
// from the client's namespace and serves on the server's, each session
// sending and receiving continuously.
//
// Each repetition has two phases over the same number of sessions:
//
//  1. "through the proxy": HAProxy without libdysco (plain relaying); the
//     sessions are paced for a while, then send as fast as they can: the
//     aggregate goodput over a window is the "before" figure. A proxy
//     under libdysco leaves at its first splices, so the "before" needs a
//     proxy that stays.
//  2. "removal": HAProxy under libdysco; the sessions are paced, every one
//     is spliced and removed; the runner waits for one result per session
//     at the client, checks that the sessions go straight to the server
//     and that the proxy host's datapath stops rewriting packets (the old
//     paths linger a little), then lets them send as fast as they can:
//     the aggregate goodput over a window of the same length is the
//     "after" figure, and the proxy host must rewrite nothing during it.
//     Every session must then still carry data both ways.

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/dysco/dysco/internal/api"
	"github.com/dysco/dysco/internal/lab"
)

// Ports of the reconfig lab: HAProxy listens on the proxy, the runner's
// sink/source server on the server.
const (
	proxyPort   = 9400
	backendPort = 9401
)

// Pacing of the sessions before the goodput windows: every session sends
// reconfigRate bytes a second each way, in reconfigTick steps.
const (
	reconfigRate = 32 << 10
	reconfigTick = 100 * time.Millisecond
	// greedyChunk is the size of each write when sending as fast as TCP
	// lets.
	greedyChunk = 64 << 10
	// reconfigWarm is how long the sessions send as fast as they can
	// before a goodput window starts.
	reconfigWarm = time.Second
)

// payload is what the sessions send (read only, shared).
var payload = make([]byte, greedyChunk)

// reconfigTrigger is libdysco's DYSCO_SPLICE_TRIGGER: ask for the removal
// once both directions are spliced (the library's default; see
// docs/libdysco.md).
const reconfigTrigger = "both"

// reconfigLab is the star lab of the benchmark.
type reconfigLab struct {
	lab                   *lab.Lab
	client, proxy, server netip.Addr
	lib                   string // absolute path of libdysco.so
	dir                   string // HAProxy's configuration
	cfg                   string
	ln                    net.Listener
	cur                   atomic.Pointer[flowSet] // where accepted connections go
	// accept, if set, takes the server's connections instead of cur
	// (the proxy-removal experiment).
	accept  atomic.Pointer[func(net.Conn)]
	haproxy *lab.Proc
	closed  sync.Once
}

func reconfigPhaseName(o *Options) string {
	return fmt.Sprintf("proxy removal, %d sessions", o.ReconfigSessions)
}

// reconfigEst estimates the benchmark's duration.
func reconfigEst(o *Options) time.Duration {
	n := time.Duration(o.ReconfigSessions)
	est := 2*(o.ReconfigWindow+reconfigWarm) + 10*time.Second + n*25*time.Millisecond
	if o.ReconfigOpenRate > 0 {
		est += 2 * time.Duration(float64(o.ReconfigSessions)/o.ReconfigOpenRate*float64(time.Second))
	}
	total := time.Duration(max(o.ReconfigReps, 1)) * est
	if rate := spacedRate(o); rate > 0 {
		total += 2*(o.ReconfigWindow+reconfigWarm) + 10*time.Second + n*5*time.Millisecond +
			2*time.Duration(float64(o.ReconfigSessions)/rate*float64(time.Second))
	}
	return total
}

// spacedRate is the open rate of the spaced repetition, 0 for none: it
// follows the back-to-back repetitions only (ReconfigSpacedRate).
func spacedRate(o *Options) float64 {
	if o.ReconfigOpenRate > 0 {
		return 0
	}
	return o.ReconfigSpacedRate
}

// haproxyConfig is HAProxy's configuration: TCP mode, splicing forced on
// both ways, a pipe for each direction of each session (the default,
// maxconn/4, would leave sessions unspliced), timeouts well beyond the
// benchmark.
func haproxyConfig(listen, backend netip.AddrPort, sessions int) string {
	return fmt.Sprintf(`global
    maxconn %d
    maxpipes %d
defaults
    mode tcp
    timeout connect 5s
    timeout client 300s
    timeout server 300s
    option splice-request
    option splice-response
listen relay
    bind %s
    maxconn %d
    server backend %s maxconn %d
`, 2*sessions+200, 2*sessions+200, listen, sessions+100, backend, sessions+100)
}

// upReconfigLab builds the star lab, installs the policies, starts the
// sink/source server and writes HAProxy's configuration.
func upReconfigLab(ctx context.Context, o *Options, set *labSet, prefix string, pr *progress) (_ *reconfigLab, err error) {
	lib, err := filepath.Abs(o.Libdysco)
	if err != nil {
		return nil, err
	}
	if _, err := os.Stat(lib); err != nil {
		return nil, fmt.Errorf("libdysco: %w (run `make build`, or give --libdysco)", err)
	}
	cfg := lab.Config{Name: prefix + "rp", Topology: lab.Star("client", "proxy", "server"), AgentBinary: o.Dysco}
	if len(o.AgentArgs) > 0 {
		args := o.AgentArgs
		cfg.AgentArgs = func(*lab.Host) []string { return args }
	}
	upCtx, cancel := context.WithTimeout(ctx, 90*time.Second)
	defer cancel()
	pr.logf("building lab %s (star client, proxy, server)", cfg.Name)
	l, err := lab.Up(upCtx, cfg)
	if err != nil {
		return nil, fmt.Errorf("lab %s: %w", cfg.Name, err)
	}
	set.add(l)
	rl := &reconfigLab{lab: l, lib: lib,
		client: l.Host("client").Addr4, proxy: l.Host("proxy").Addr4, server: l.Host("server").Addr4}
	defer func() {
		if err != nil {
			rl.close()
		}
	}()
	// Both TCP sessions are Dysco sessions with no middlebox (as in
	// test/e2e/proxy_test.go), so that they can be joined.
	if _, err := dyscoCLI(ctx, o, l, "client", "policy", "add", "to-proxy", fmt.Sprintf("tcp dst port %d", proxyPort)); err != nil {
		return nil, err
	}
	if _, err := dyscoCLI(ctx, o, l, "proxy", "policy", "add", "to-server", fmt.Sprintf("tcp dst port %d", backendPort)); err != nil {
		return nil, err
	}
	for _, p := range []struct {
		from string
		to   netip.Addr
	}{{"client", rl.proxy}, {"proxy", rl.server}} {
		if err := l.Ping(ctx, p.from, p.to); err != nil {
			return nil, fmt.Errorf("lab %s: %s does not reach %s: %w", l.Name(), p.from, p.to, err)
		}
	}
	// Linux's default limit of a TCP receive buffer (tcp_rmem max 6 MiB)
	// on every host, whatever the machine's sysctl says: hundreds of greedy
	// sessions through a proxy, with the larger limits some machines set
	// (32 MiB here), push the kernel into TCP memory pressure (tcp_mem is
	// shared by every namespace), where receive windows collapse to a few
	// KiB and senders crawl; a proxy removal then waits tens of seconds
	// for the old path's last bytes (BENCHMARKS.md, proxy removal).
	for _, h := range []string{"client", "proxy", "server"} {
		if _, err := run(ctx, l, h, 10*time.Second, "sysctl", "-w", "net.ipv4.tcp_rmem="+labTCPRmem); err != nil {
			return nil, err
		}
	}
	if rl.dir, err = os.MkdirTemp("", "dysco-bench-"+l.Name()+"-"); err != nil {
		return nil, err
	}
	rl.cfg = filepath.Join(rl.dir, "haproxy.cfg")
	conf := haproxyConfig(netip.AddrPortFrom(rl.proxy, proxyPort), netip.AddrPortFrom(rl.server, backendPort), o.ReconfigSessions)
	if err := os.WriteFile(rl.cfg, []byte(conf), 0o644); err != nil {
		return nil, err
	}
	if rl.ln, err = l.Listen("server", "tcp", netip.AddrPortFrom(rl.server, backendPort).String()); err != nil {
		return nil, fmt.Errorf("lab %s: listening on the server: %w", l.Name(), err)
	}
	go rl.serve()
	return rl, nil
}

// labTCPRmem is the net.ipv4.tcp_rmem of the proxy-removal lab's hosts:
// Linux's defaults.
const labTCPRmem = "4096 131072 6291456"

// serve hands the server's connections to the current flow set; without
// one (HAProxy's readiness probes) they are closed.
func (rl *reconfigLab) serve() {
	for {
		c, err := rl.ln.Accept()
		if err != nil {
			return
		}
		if h := rl.accept.Load(); h != nil {
			(*h)(c)
		} else if fs := rl.cur.Load(); fs != nil {
			fs.add(c, false)
		} else {
			c.Close()
		}
	}
}

func (rl *reconfigLab) close() {
	rl.closed.Do(func() {
		if rl.ln != nil {
			rl.ln.Close()
		}
		if rl.dir != "" {
			os.RemoveAll(rl.dir)
		}
	})
}

// haproxyArgv is HAProxy's command line, under libdysco or not.
func (rl *reconfigLab) haproxyArgv(preload bool) []string {
	argv := []string{"haproxy", "-db", "-f", rl.cfg}
	if preload {
		argv = append([]string{"env", "LD_PRELOAD=" + rl.lib, "DYSCO_SPLICE_TRIGGER=" + reconfigTrigger}, argv...)
	}
	return argv
}

// startHAProxy stops the running HAProxy, if any, starts a new one and
// waits until it listens. It asks `ss` rather than connecting: HAProxy
// would relay a probe connection to the server, where it could be taken for
// one of the benchmark's sessions.
func (rl *reconfigLab) startHAProxy(ctx context.Context, preload bool) error {
	if err := rl.stopHAProxy(); err != nil {
		return err
	}
	name := "haproxy-plain"
	if preload {
		name = "haproxy-libdysco"
	}
	p, err := rl.lab.Start("proxy", name, rl.haproxyArgv(preload)...)
	if err != nil {
		return err
	}
	rl.haproxy = p
	ap := netip.AddrPortFrom(rl.proxy, proxyPort).String()
	deadline := time.Now().Add(15 * time.Second)
	for {
		select {
		case <-p.Done():
			return fmt.Errorf("haproxy exited at start (%v): see %s", p.Err(), p.Log)
		default:
		}
		out, err := run(ctx, rl.lab, "proxy", 5*time.Second, "ss", "-Hltn", "src", ap)
		if err == nil && strings.Contains(out, ap) {
			return nil
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("haproxy does not listen on %s after 15 s (see %s; ss: %v)", ap, p.Log, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func (rl *reconfigLab) stopHAProxy() error {
	if rl.haproxy == nil {
		return nil
	}
	err := rl.haproxy.Stop()
	rl.haproxy = nil
	return err
}

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
		if err := sleepCtx(ctx, 100*time.Millisecond); err != nil {
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
func (rl *reconfigLab) open(ctx context.Context, n int, rate float64) (*flowSet, error) {
	fs := newFlowSet(reconfigRate)
	rl.cur.Store(fs)
	dst := netip.AddrPortFrom(rl.proxy, proxyPort).String()
	start := time.Now()
	err := rl.lab.Do("client", func() error {
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

// sleepCtx sleeps for d unless ctx is done first.
func sleepCtx(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// measureWindow makes the set greedy, lets it warm up, and measures the
// goodput over o.ReconfigWindow, with the changes of the proxy host's
// datapath counters during the window.
func (rl *reconfigLab) measureWindow(ctx context.Context, o *Options, fs *flowSet) (windowResult, map[string]uint64, error) {
	fs.greedy.Store(true)
	if err := sleepCtx(ctx, reconfigWarm); err != nil {
		return windowResult{}, nil, err
	}
	before, err := agentStatus(ctx, o, rl.lab, "proxy")
	if err != nil {
		return windowResult{}, nil, err
	}
	a := fs.snap()
	if err := sleepCtx(ctx, o.ReconfigWindow); err != nil {
		return windowResult{}, nil, err
	}
	b := fs.snap()
	after, err := agentStatus(ctx, o, rl.lab, "proxy")
	if err != nil {
		return windowResult{}, nil, err
	}
	return goodput(a, b), counterDelta(before, after), nil
}

func proxyRewrites(st *api.Status) uint64 {
	return st.Counters["rewrite_in"] + st.Counters["rewrite_out"]
}

// rewritesOf sums the rewrite counters of a counter delta.
func rewritesOf(d map[string]uint64) uint64 { return d["rewrite_in"] + d["rewrite_out"] }

func (rl *reconfigLab) history(ctx context.Context, o *Options) ([]api.ReconfigResult, error) {
	out, err := dyscoCLI(ctx, o, rl.lab, "client", "reconfig", "history", "--json")
	if err != nil {
		return nil, err
	}
	var rep api.ReconfigReply
	if err := json.Unmarshal([]byte(out), &rep); err != nil {
		return nil, fmt.Errorf("dysco reconfig history --json on the client: %w: %s", err, tail(out, 300))
	}
	return rep.Results, nil
}

// removalStats summarises the reconfiguration results of the sessions.
type removalStats struct {
	Results   int            `json:"results"`
	Succeeded int            `json:"succeeded"`
	Outcomes  map[string]int `json:"outcomes"`
	Reasons   map[string]int `json:"reasons,omitempty"` // "outcome: reason" of the others
	// Named is how many results name one of the benchmark's sessions.
	Named int `json:"named"`
	// Micros are the times of the succeeded results, sorted.
	Micros []int64 `json:"micros"`
	P50ms  float64 `json:"p50_ms"`
	P99ms  float64 `json:"p99_ms"`
	MaxMs  float64 `json:"max_ms"`
	// Under2ms and Under4ms are the fractions of the sessions (of all
	// expected, failed and missing ones counting as over) removed in
	// under 2 and 4 ms, the paper's marks.
	Under2ms float64 `json:"under_2ms"`
	Under4ms float64 `json:"under_4ms"`
	// Phases are the medians of the succeeded results' phases at the
	// left anchor (api.ReconfigResult): locking, setting up the new path,
	// the two-path phase; NaN without phase times (older agents).
	LockP50ms, SetupP50ms, TwoPathP50ms float64 `json:"-"` // MarshalJSON writes them
}

func orText(s, alt string) string {
	if s == "" {
		return alt
	}
	return s
}

// met tells whether the removal-time target holds: a result for each of
// the n sessions, all succeeded, p50 ≤ 1 ms and p99 ≤ 3 ms (issue 3).
func (s removalStats) met(n int) bool {
	return s.Succeeded == n && s.Results == n && !math.IsNaN(s.P50ms) && s.P50ms <= 1 && s.P99ms <= 3
}

// resultsText describes the results of n sessions for a figure's note.
func (s removalStats) resultsText(n int) string {
	return fmt.Sprintf("%d results for %d sessions, %d succeeded; p99 %.2f ms, max %.2f ms; %.1f %% under 2 ms, %.1f %% under 4 ms; %s",
		s.Results, n, s.Succeeded, s.P99ms, s.MaxMs, 100*s.Under2ms, 100*s.Under4ms, orText(s.phasesText(), "phases unknown"))
}

// phasesText describes the median phases, "" when unknown.
func (s removalStats) phasesText() string {
	if math.IsNaN(s.LockP50ms) {
		return ""
	}
	return fmt.Sprintf("median phases at the left anchor: locking %.2f ms, new path set-up %.2f ms, two-path phase %.2f ms", s.LockP50ms, s.SetupP50ms, s.TwoPathP50ms)
}

// summarize computes removalStats of the results over n expected sessions,
// whose client ends are locals ("IP:PORT").
func summarize(results []api.ReconfigResult, n int, locals map[string]bool) removalStats {
	s := removalStats{Results: len(results), Outcomes: map[string]int{}, Reasons: map[string]int{}}
	var ms, lock, setup, two []float64
	for _, x := range results {
		s.Outcomes[x.Outcome]++
		if src, _, ok := strings.Cut(x.Session, " -> "); ok && locals[src] {
			s.Named++
		}
		if x.Outcome != "succeeded" {
			k := x.Outcome
			if x.Reason != "" {
				k += ": " + x.Reason
			}
			s.Reasons[k]++
			continue
		}
		s.Succeeded++
		s.Micros = append(s.Micros, x.Micros)
		ms = append(ms, float64(x.Micros)/1000)
		if x.LockMicros > 0 && x.SetupMicros >= x.LockMicros {
			lock = append(lock, float64(x.LockMicros)/1000)
			setup = append(setup, float64(x.SetupMicros-x.LockMicros)/1000)
			two = append(two, float64(x.Micros-x.SetupMicros)/1000)
		}
	}
	s.LockP50ms, s.SetupP50ms, s.TwoPathP50ms = quantile(lock, 0.5), quantile(setup, 0.5), quantile(two, 0.5)
	sort.Slice(s.Micros, func(i, j int) bool { return s.Micros[i] < s.Micros[j] })
	s.P50ms, s.P99ms = quantile(ms, 0.5), quantile(ms, 0.99)
	s.MaxMs = quantile(ms, 1)
	if n > 0 {
		for _, m := range ms {
			if m < 2 {
				s.Under2ms++
			}
			if m < 4 {
				s.Under4ms++
			}
		}
		s.Under2ms /= float64(n)
		s.Under4ms /= float64(n)
	}
	return s
}

// newResults returns the entries of h recorded after prev, an earlier
// reading of the same history: those after prev's last entry, found from
// the end (the agent trims its history when it is long).
func newResults(prev, h []api.ReconfigResult) []api.ReconfigResult {
	if len(prev) == 0 {
		return h
	}
	last := prev[len(prev)-1]
	for i := len(h) - 1; i >= 0; i-- {
		if h[i] == last {
			return h[i+1:]
		}
	}
	return h
}

// reconfigDetails is the raw data of the benchmark.
type reconfigDetails struct {
	Sessions  int      `json:"sessions"`
	RateBytes int      `json:"paced_rate_bytes_per_s"`
	Trigger   string   `json:"libdysco_trigger"`
	HAProxy   []string `json:"haproxy_argv"`
	// Removal pools the results of every repetition.
	Removal *removalStats  `json:"removal,omitempty"`
	Reps    []*reconfigRep `json:"reps"`
	// Spaced is the repetition with the sessions opened at SpacedRate
	// (Options.ReconfigSpacedRate), SpacedRemoval its results.
	SpacedRate    float64       `json:"spaced_open_rate,omitempty"`
	Spaced        *reconfigRep  `json:"spaced,omitempty"`
	SpacedRemoval *removalStats `json:"spaced_removal,omitempty"`
}

// reconfigRep is one repetition: the sessions through the proxy, then
// through the proxy under libdysco, removed.
type reconfigRep struct {
	Rep    int           `json:"rep"`
	Before *windowResult `json:"goodput_through_proxy,omitempty"`
	After  *windowResult `json:"goodput_after_removal,omitempty"`
	// ProxyCounters are the changes of the proxy host's datapath
	// counters during each goodput window.
	ProxyCounters map[string]map[string]uint64 `json:"proxy_counters"`
	Removal       *removalStats                `json:"removal,omitempty"`
	// DialMs is the time the runner took to dial the sessions of the
	// removal phase, one after the other (they are spliced, and their
	// removal requested, as they come).
	DialMs float64 `json:"dial_ms"`
	// RemovalWallMs is from the first session's dial to the poll of the
	// history that saw the last result.
	RemovalWallMs float64 `json:"removal_wall_ms"`
	// AgentCPUms is the CPU time each agent used from the first dial to
	// the poll that saw the last result.
	AgentCPUms map[string]float64 `json:"agent_cpu_ms_during_removal,omitempty"`
	// Control traffic of each agent over the same time: messages sent and
	// the datagrams that carried them (several share one as a bundle).
	ControlOut map[string][2]uint64 `json:"control_messages_datagrams_out,omitempty"`
	// Direct is how many of the client's sessions go straight to the
	// server after the removal.
	Direct int `json:"direct"`
	// DrainMs is how long the proxy's agent took to collect the sessions
	// of phase 1 (-1: not within 30 s).
	DrainMs float64 `json:"phase1_drain_ms"`
	// QuietMs is from the check of the client's sessions after the last
	// result to the last change of the proxy host's rewrite counters (the
	// old paths linger to pass retransmissions); RewritesBeforeQuiet the
	// packets it rewrote meanwhile. -1: never quiet.
	QuietMs             float64 `json:"proxy_quiet_ms"`
	RewritesBeforeQuiet uint64  `json:"proxy_rewrites_before_quiet"`
	// StuckEnds are the session ends that received nothing in 15 s of
	// paced traffic after the goodput window.
	StuckEnds []string `json:"stuck_ends,omitempty"`
	// History is the client's results for the sessions, in the order
	// the agent recorded them.
	History     []api.ReconfigResult `json:"history"`
	Notes       []string             `json:"notes,omitempty"`
	SessionErrs []string             `json:"session_errors,omitempty"`
	Problems    []string             `json:"problems,omitempty"`

	locals map[string]bool
}

func (x *reconfigRep) problem(format string, args ...any) {
	x.Problems = append(x.Problems, fmt.Sprintf(format, args...))
}

// benchReconfig runs o.ReconfigReps repetitions and adds the figures.
func benchReconfig(ctx context.Context, o *Options, rl *reconfigLab, r *Report, pr *progress) (err error) {
	n := o.ReconfigSessions
	det := &reconfigDetails{Sessions: n, RateBytes: reconfigRate, Trigger: reconfigTrigger, HAProxy: rl.haproxyArgv(true)}
	r.Details["reconfig"] = det
	defer func() {
		if serr := rl.stopHAProxy(); serr != nil && err == nil {
			err = serr
		}
		// The lab's run directory goes with the lab: keep its logs
		// (agents, HAProxy) when something went wrong.
		if err != nil {
			if dir, lerr := saveLabLogs(rl.lab, filepath.Join(o.OutDir, r.RunID+"-reconfig-logs")); lerr == nil {
				err = fmt.Errorf("%w (logs of the lab's agents and HAProxy copied to %s)", err, dir)
			}
		}
	}()
	var problems []string
	var all []api.ReconfigResult
	locals := map[string]bool{}
	var gp []sample
	var done []*reconfigRep
	var repErr error
	for rep := 1; rep <= o.ReconfigReps; rep++ {
		x := &reconfigRep{Rep: rep, ProxyCounters: map[string]map[string]uint64{}}
		det.Reps = append(det.Reps, x)
		err := rl.repetition(ctx, o, x, pr, fmt.Sprintf("repetition %d/%d", rep, o.ReconfigReps))
		for _, p := range x.Problems {
			problems = append(problems, fmt.Sprintf("repetition %d: %s", rep, p))
		}
		if err != nil {
			// The figures come from the repetitions that ended.
			repErr = fmt.Errorf("repetition %d: %w", rep, err)
			break
		}
		done = append(done, x)
		all = append(all, x.History...)
		for k := range x.locals {
			locals[k] = true
		}
		gp = append(gp, sample{Variant: "baseline", Rep: rep, Value: x.Before.TotalGbps},
			sample{Variant: "dysco", Rep: rep, Value: x.After.TotalGbps})
	}
	errOut := func() error {
		if len(problems) > 0 {
			repErr = errors.Join(repErr, fmt.Errorf("proxy removal: %s", strings.Join(problems, "; ")))
		}
		return repErr
	}
	if len(done) == 0 {
		return errOut()
	}
	reps := len(done)
	st := summarize(all, n*reps, locals)
	det.Removal = &st

	// Figures.
	var perRep, direct, stuck, quiet, inWindow, dial []string
	var up0, up1, starved0, starved1 []string
	for _, x := range done {
		perRep = append(perRep, fmt.Sprintf("%.2f/%.2f", x.Removal.P50ms, x.Removal.P99ms))
		direct = append(direct, fmt.Sprint(x.Direct))
		stuck = append(stuck, fmt.Sprint(len(x.StuckEnds)))
		quiet = append(quiet, fmt.Sprintf("%d (the last %.1f s after the check)", x.RewritesBeforeQuiet, x.QuietMs/1000))
		inWindow = append(inWindow, fmt.Sprint(rewritesOf(x.ProxyCounters["after_removal_window"])))
		ctl := ""
		if x.ControlOut != nil {
			var parts []string
			for _, h := range []string{"client", "proxy", "server"} {
				c := x.ControlOut[h]
				parts = append(parts, fmt.Sprintf("%s %d in %d", h, c[0], c[1]))
			}
			ctl = "; control messages sent in datagrams: " + strings.Join(parts, ", ")
		}
		dial = append(dial, fmt.Sprintf("%.2f s (results seen by %.1f s; agents' CPU meanwhile: client %.0f ms, proxy %.0f ms%s)",
			x.DialMs/1000, x.RemovalWallMs/1000, x.AgentCPUms["client"], x.AgentCPUms["proxy"], ctl))
		up0 = append(up0, fmt.Sprintf("%.2f/%.2f", x.Before.UpGbps, x.Before.DownGbps))
		up1 = append(up1, fmt.Sprintf("%.2f/%.2f", x.After.UpGbps, x.After.DownGbps))
		starved0 = append(starved0, fmt.Sprint(x.Before.StalledClients+x.Before.StalledServers))
		starved1 = append(starved1, fmt.Sprint(x.After.StalledClients+x.After.StalledServers))
	}
	list := func(v []string) string { return strings.Join(v, ", ") }
	haproxyCmd := fmt.Sprintf("ip netns exec LAB-proxy env LD_PRELOAD=lib/libdysco.so DYSCO_SPLICE_TRIGGER=%s haproxy -db -f haproxy.cfg", reconfigTrigger)
	open := "one after the other, back to back"
	if o.ReconfigOpenRate > 0 {
		open = fmt.Sprintf("at %g/s", o.ReconfigOpenRate)
	}
	note := fmt.Sprintf("%d repetition(s) of %d sessions client → HAProxy (TCP mode, splice-request/response) → server, dialled %s, each paced at %d KiB/s each way; "+
		"HAProxy splices each as it comes and libdysco asks for its removal, so removals overlap the dialling and each other; "+
		"per session, the time at the client (left anchor) from the proxy agent's trigger to the old path no longer used (`dysco reconfig history --json`), all repetitions pooled; "+
		"%s; "+
		"per repetition p50/p99 ms %s; dialling took %s; client sessions direct to the server afterwards %s of %d; "+
		"session ends without data in 15 s after the goodput window %s of %d; "+
		"packets the proxy host's datapath rewrote after the check of the client's sessions (old paths linger to pass retransmissions): %s; then, after 1 s without any, during the %v goodput window: %s",
		reps, n, open, reconfigRate>>10, st.resultsText(n*reps),
		list(perRep), list(dial), list(direct), n, list(stuck), 2*n, list(quiet), o.ReconfigWindow, list(inWindow))
	if len(st.Reasons) > 0 {
		note += fmt.Sprintf("; not succeeded: %v", st.Reasons)
	}
	if reps < o.ReconfigReps {
		note += fmt.Sprintf("; only %d of %d repetitions ended: %v", reps, o.ReconfigReps, repErr)
	}
	r.add(removalFigure("reconfig-proxy-removal", fmt.Sprintf("proxy removal time, %d sessions (HAProxy under libdysco)", n),
		fmt.Sprintf("%s; runner: %d sessions LAB-client → %s:%d, then ip netns exec LAB-client dysco reconfig history --json",
			haproxyCmd, n, rl.proxy, proxyPort),
		st, n*reps, note))
	f := ratioFigure("reconfig-goodput", fmt.Sprintf("goodput of %d sessions, proxy removed (Dysco) vs through HAProxy (baseline)", n),
		fmt.Sprintf("runner: %d sessions LAB-client → HAProxy on LAB-proxy → LAB-server sending both ways as fast as TCP lets; bytes received by both ends over %v", n, o.ReconfigWindow),
		"Gbit/s", gp, 0, "goodput doubled")
	f.MeasuredUnit, f.Target, f.Met = "× through the proxy", "(reported)", "–"
	f.Note += fmt.Sprintf("; both directions summed, medians over the repetitions. Baseline: the sessions through HAProxy without libdysco (plain splicing relay; under libdysco a proxy leaves at its first splices, so there is no 'before' with it), "+
		"after %v paced and %v sending freely, over %v. Dysco: the sessions of the removal phase of the same repetition, once every result was in and the proxy host rewrote no more packets, after %v sending freely, over %v. "+
		"Up/down Gbit/s per repetition: %s through the proxy, %s after the removal; ends that received nothing during the window: %s through the proxy, %s after the removal (of %d). "+
		"All hosts share the machine's %d CPUs; the runner is both client and server",
		2*time.Second, reconfigWarm, o.ReconfigWindow, reconfigWarm, o.ReconfigWindow, list(up0), list(up1), list(starved0), list(starved1), 2*n, r.Env.Nproc)
	r.add(f)
	if rate := spacedRate(o); rate > 0 && repErr == nil {
		if err := benchReconfigSpaced(ctx, o, rl, r, pr, det, rate, haproxyCmd); err != nil {
			repErr = err
		}
	}
	return errOut()
}

// benchReconfigSpaced runs the spaced repetition: the same sessions,
// opened at rate per second, so that each removal has the agents to
// itself (the figure the protocol's own time is followed by; the
// back-to-back figure is the agents' queueing under a burst).
func benchReconfigSpaced(ctx context.Context, o *Options, rl *reconfigLab, r *Report, pr *progress, det *reconfigDetails, rate float64, haproxyCmd string) error {
	n := o.ReconfigSessions
	so := *o
	so.ReconfigOpenRate = rate
	x := &reconfigRep{Rep: 1, ProxyCounters: map[string]map[string]uint64{}}
	det.SpacedRate, det.Spaced = rate, x
	err := rl.repetition(ctx, &so, x, pr, fmt.Sprintf("spaced, sessions opened at %g/s", rate))
	var errs []error
	if err != nil {
		errs = append(errs, fmt.Errorf("spaced repetition: %w", err))
	}
	if len(x.Problems) > 0 {
		errs = append(errs, fmt.Errorf("proxy removal, spaced repetition: %s", strings.Join(x.Problems, "; ")))
	}
	if err != nil {
		return errors.Join(errs...)
	}
	st := summarize(x.History, n, x.locals)
	det.SpacedRemoval = &st
	note := fmt.Sprintf("one repetition of %d sessions as above, dialled at %g/s (a removal every %.0f ms, so that removals do not overlap: the protocol's own time, not the agents' queueing under a burst); "+
		"%s; dialling took %.2f s; client sessions direct to the server afterwards %d of %d",
		n, rate, 1000/rate, st.resultsText(n), x.DialMs/1000, x.Direct, n)
	if len(st.Reasons) > 0 {
		note += fmt.Sprintf("; not succeeded: %v", st.Reasons)
	}
	r.add(removalFigure("reconfig-proxy-removal-spaced", fmt.Sprintf("proxy removal time, %d sessions opened at %g/s (removals spaced)", n, rate),
		fmt.Sprintf("%s; runner: %d sessions LAB-client → %s:%d at %g/s, then ip netns exec LAB-client dysco reconfig history --json",
			haproxyCmd, n, rl.proxy, proxyPort, rate),
		st, n, note))
	return errors.Join(errs...)
}

// removalFigure is a removal-time figure over n sessions' results (the
// back-to-back and the spaced rows): p50 against the target, p99 beside it.
func removalFigure(key, name, command string, st removalStats, n int, note string) *Figure {
	return &Figure{
		Key: key, Name: name, Command: command,
		Unit: "ms", Dysco: st.P50ms, Baseline: math.NaN(), Ratio: math.NaN(),
		DyscoText: fmt.Sprintf("%.2f ms (p99 %.2f)", st.P50ms, st.P99ms),
		Measured:  st.P50ms, MeasuredUnit: "ms p50",
		Target: "p50 ≤ 1 ms, p99 ≤ 3 ms, every session removed", Paper: "80 % under 2 ms, 98.7 % under 4 ms",
		Met: metStr(st.met(n)), Note: note,
	}
}

// repetition runs one repetition: phase 1 through the proxy, phase 2 the
// removal. Problems of the product go to x.Problems; the error is for
// what stops the repetition.
func (rl *reconfigLab) repetition(ctx context.Context, o *Options, x *reconfigRep, pr *progress, what string) error {
	n := o.ReconfigSessions
	win := o.ReconfigWindow

	// Phase 1: through the proxy (HAProxy without libdysco).
	st0, err := agentStatus(ctx, o, rl.lab, "proxy")
	if err != nil {
		return err
	}
	pr.logf("proxy removal, %s: %d sessions through HAProxy without libdysco", what, n)
	if err := rl.startHAProxy(ctx, false); err != nil {
		return err
	}
	fs, err := rl.open(ctx, n, o.ReconfigOpenRate)
	if err != nil {
		fs.stop()
		return fmt.Errorf("through the proxy: %w", err)
	}
	if err := sleepCtx(ctx, 2*time.Second); err != nil {
		fs.stop()
		return err
	}
	before, d1, err := rl.measureWindow(ctx, o, fs)
	nerr1, errs1 := fs.errors()
	fs.stop()
	rl.cur.Store(nil)
	if err != nil {
		return fmt.Errorf("through the proxy: %w", err)
	}
	x.Before = &before
	x.ProxyCounters["through_proxy_window"] = d1
	pr.logf("proxy removal, %s: through HAProxy: %.3f Gbit/s (%.3f up, %.3f down), proxy host rewrote %d packets",
		what, before.TotalGbps, before.UpGbps, before.DownGbps, rewritesOf(d1))
	if nerr1 > 0 {
		x.SessionErrs = append(x.SessionErrs, errs1...)
		x.problem("through the proxy: %d session errors (first: %s)", nerr1, strings.Join(errs1, "; "))
	}
	if rewritesOf(d1) == 0 {
		x.problem("through the proxy: the proxy host's datapath rewrote no packet: the sessions are not Dysco sessions")
	}
	// Ends starved through the proxy are the baseline's behaviour (HAProxy
	// and TCP under overload), not a failure of Dysco: noted with the
	// figure.
	//
	// Nothing of phase 1 may reach the proxy host's datapath during phase
	// 2: stop HAProxy (its orphaned sockets go with it) and wait until the
	// proxy's agent has collected the sessions of phase 1 (it has as many
	// as before phase 1: sessions of earlier repetitions' removals stay
	// until idle).
	if err := rl.stopHAProxy(); err != nil {
		return err
	}
	t1 := time.Now()
	for {
		st, err := agentStatus(ctx, o, rl.lab, "proxy")
		if err != nil {
			return err
		}
		if st.Sessions <= st0.Sessions {
			x.DrainMs = float64(time.Since(t1).Microseconds()) / 1000
			break
		}
		if time.Since(t1) > 30*time.Second {
			x.DrainMs = -1
			x.Notes = append(x.Notes, fmt.Sprintf("the proxy's agent had %d sessions 30 s after phase 1 ended, %d before it", st.Sessions, st0.Sessions))
			break
		}
		if err := sleepCtx(ctx, 250*time.Millisecond); err != nil {
			return err
		}
	}

	// Phase 2: removal (HAProxy under libdysco).
	hist0, err := rl.history(ctx, o)
	if err != nil {
		return err
	}
	pr.logf("proxy removal, %s: %d sessions through HAProxy under libdysco (%s)", what, n, strings.Join(rl.haproxyArgv(true), " "))
	if err := rl.startHAProxy(ctx, true); err != nil {
		return err
	}
	cpu0 := rl.agentCPU()
	ctl0 := rl.controlOut(ctx, o)
	t0 := time.Now()
	fs, err = rl.open(ctx, n, o.ReconfigOpenRate)
	defer fs.stop()
	defer rl.cur.Store(nil)
	if err != nil {
		return fmt.Errorf("removal: %w", err)
	}
	x.DialMs = float64(fs.dialed.Microseconds()) / 1000
	x.locals = map[string]bool{}
	fs.mu.Lock()
	for _, f := range fs.clients {
		x.locals[f.c.LocalAddr().String()] = true
	}
	fs.mu.Unlock()
	// Wait for one result per session at the left anchor (the client),
	// giving up when none came for 15 s or after a minute and a half.
	var results []api.ReconfigResult
	var lastAt, tLast time.Time
	last, lastLog := -1, time.Now()
	hardStop := time.Now().Add(90 * time.Second)
	for {
		h, err := rl.history(ctx, o)
		if err != nil {
			return err
		}
		results = newResults(hist0, h)
		if len(results) != last {
			last, lastAt, tLast = len(results), time.Now(), time.Now()
		}
		if len(results) >= n {
			break
		}
		if time.Since(lastAt) > 15*time.Second || time.Now().After(hardStop) {
			x.problem("removal: %d of %d sessions have a result at the client after %.0f s (none new for %.0f s)",
				len(results), n, time.Since(t0).Seconds(), time.Since(lastAt).Seconds())
			break
		}
		if time.Since(lastLog) > 3*time.Second {
			pr.logf("proxy removal, %s: %d/%d sessions have a reconfiguration result", what, len(results), n)
			lastLog = time.Now()
		}
		if err := sleepCtx(ctx, 200*time.Millisecond); err != nil {
			return err
		}
	}
	if len(results) < n {
		// What the hosts know of the sessions without a result, while
		// they are still live (kept with the lab's logs).
		have := map[string]bool{}
		for _, r := range results {
			src, _, _ := strings.Cut(r.Session, " -> ")
			have[src] = true
		}
		var stuck []stuckSession
		fs.mu.Lock()
		for _, f := range fs.clients {
			if a := f.c.LocalAddr().String(); !have[a] {
				stuck = append(stuck, stuckSession{What: "session " + a + ": no reconfiguration result at the client", Addresses: []string{a}})
			}
		}
		fs.mu.Unlock()
		if p, err := dumpStuck(ctx, o, rl, stuck); err != nil {
			x.problem("describing the sessions without a result: %v", err)
		} else {
			x.Notes = append(x.Notes, "what the hosts knew of the sessions without a result: "+filepath.Base(p)+" with the lab's logs")
		}
	}
	x.RemovalWallMs = float64(tLast.Sub(t0).Microseconds()) / 1000
	if cpu1 := rl.agentCPU(); cpu0 != nil && cpu1 != nil {
		x.AgentCPUms = map[string]float64{}
		for h, c := range cpu1 {
			x.AgentCPUms[h] = float64((c - cpu0[h]).Microseconds()) / 1000
		}
	}
	if ctl1 := rl.controlOut(ctx, o); ctl0 != nil && ctl1 != nil {
		x.ControlOut = map[string][2]uint64{}
		for h, c := range ctl1 {
			x.ControlOut[h] = [2]uint64{c[0] - ctl0[h][0], c[1] - ctl0[h][1]}
		}
	}
	x.History = results
	st := summarize(results, n, x.locals)
	x.Removal = &st
	pr.logf("proxy removal, %s: %d results (%d succeeded) within %.1f s of the first dial; p50 %.2f ms, p99 %.2f ms",
		what, st.Results, st.Succeeded, x.RemovalWallMs/1000, st.P50ms, st.P99ms)
	if st.Succeeded < st.Results {
		x.problem("removal: %d of %d results did not succeed: %v", st.Results-st.Succeeded, st.Results, st.Reasons)
	}
	if st.Results > n {
		x.problem("removal: %d results for %d sessions", st.Results, n)
	}
	// The sessions now go straight to the server.
	out, err := dyscoCLI(ctx, o, rl.lab, "client", "sessions", "-o", "json")
	if err != nil {
		return err
	}
	var sess []api.Session
	if err := json.Unmarshal([]byte(out), &sess); err != nil {
		return fmt.Errorf("dysco sessions on the client: %w", err)
	}
	for _, s := range sess {
		src, _, _ := strings.Cut(s.Session, " -> ")
		if x.locals[src] && strings.Contains(s.Right, "-> "+rl.server.String()+":") {
			x.Direct++
		}
	}
	if x.Direct < n {
		x.problem("removal: %d of %d client sessions go straight to the server", x.Direct, n)
	}
	// The old paths linger a little after their removal (to pass
	// retransmissions): wait, with the sessions still paced, until the
	// proxy host's datapath has rewritten nothing for a second.
	tq := time.Now()
	var firstRw, lastRw uint64
	lastChange := time.Now()
	for i := 0; ; i++ {
		st, err := agentStatus(ctx, o, rl.lab, "proxy")
		if err != nil {
			return err
		}
		rw := proxyRewrites(st)
		if i == 0 {
			firstRw = rw
		} else if rw != lastRw {
			lastChange = time.Now()
		}
		lastRw = rw
		if time.Since(lastChange) >= time.Second {
			x.QuietMs = float64(lastChange.Sub(tq).Microseconds()) / 1000
			x.RewritesBeforeQuiet = lastRw - firstRw
			break
		}
		if time.Since(tq) > 20*time.Second {
			x.QuietMs = -1
			x.RewritesBeforeQuiet = lastRw - firstRw
			x.problem("after the removal: the proxy host's datapath still rewrites packets 20 s after the last result (%d since the last result)", lastRw-firstRw)
			break
		}
		if err := sleepCtx(ctx, 200*time.Millisecond); err != nil {
			return err
		}
	}
	// Goodput after the removal, and the proxy host out of the path.
	after, d2, err := rl.measureWindow(ctx, o, fs)
	if err != nil {
		return fmt.Errorf("after the removal: %w", err)
	}
	rw2 := rewritesOf(d2)
	x.After = &after
	x.ProxyCounters["after_removal_window"] = d2
	pr.logf("proxy removal, %s: after the removal: %.3f Gbit/s (%.3f up, %.3f down), proxy host rewrote %d packets",
		what, after.TotalGbps, after.UpGbps, after.DownGbps, rw2)
	if rw2 != 0 {
		x.problem("after the removal: the proxy host's datapath still rewrote %d packets during the %v window (counter changes %v)", rw2, win, d2)
	}
	// An end may starve for a while under the greedy load (losses, RTO
	// back-off; the baseline shows it too): what matters is that every
	// session still carries data both ways. Paced again, every end must
	// receive more within 15 s.
	fs.greedy.Store(false)
	stuck, err := fs.waitProgress(ctx, 15*time.Second)
	if err != nil {
		return err
	}
	x.StuckEnds = stuck
	if len(stuck) > 0 {
		x.problem("after the removal: %d session ends received nothing more in 15 s of paced traffic after the window (first: %s)", len(stuck), stuck[0])
	}
	if nerr2, errs2 := fs.errors(); nerr2 > 0 {
		x.SessionErrs = append(x.SessionErrs, errs2...)
		x.problem("removal: %d session errors (first: %s)", nerr2, strings.Join(errs2, "; "))
	}
	return nil
}

// controlOut returns the control messages and datagrams the agents of the
// client, the proxy and the server have sent so far, nil if a status
// cannot be read.
func (rl *reconfigLab) controlOut(ctx context.Context, o *Options) map[string][2]uint64 {
	out := map[string][2]uint64{}
	for _, h := range []string{"client", "proxy", "server"} {
		st, err := agentStatus(ctx, o, rl.lab, h)
		if err != nil {
			return nil
		}
		out[h] = [2]uint64{st.Counters["control_messages_out"], st.Counters["control_datagrams_out"]}
	}
	return out
}

// agentCPU returns the CPU time used so far by the agents of the client and
// the proxy, nil if it cannot be read.
func (rl *reconfigLab) agentCPU() map[string]time.Duration {
	out := map[string]time.Duration{}
	for _, h := range []string{"client", "proxy"} {
		p := rl.lab.Agent(h)
		if p == nil {
			return nil
		}
		c, err := cpuTime(p.Pid())
		if err != nil {
			return nil
		}
		out[h] = c
	}
	return out
}

// MarshalJSON writes the figures that have no value (no removal succeeded)
// as null: encoding/json refuses NaN.
func (s removalStats) MarshalJSON() ([]byte, error) {
	type plain removalStats
	num := jsonNum
	return json.Marshal(struct {
		plain
		P50ms    *float64 `json:"p50_ms"`
		P99ms    *float64 `json:"p99_ms"`
		MaxMs    *float64 `json:"max_ms"`
		Under2ms *float64 `json:"under_2ms"`
		Under4ms *float64 `json:"under_4ms"`
		Lock     *float64 `json:"lock_p50_ms"`
		Setup    *float64 `json:"setup_p50_ms"`
		TwoPath  *float64 `json:"two_path_p50_ms"`
	}{plain(s), num(s.P50ms), num(s.P99ms), num(s.MaxMs), num(s.Under2ms), num(s.Under4ms), num(s.LockP50ms), num(s.SetupP50ms), num(s.TwoPathP50ms)})
}
