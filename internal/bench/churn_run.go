package bench

// The churn runner's run: the families, the policies and servers it sets
// up, the workload it starts and stops, and the counters and log it keeps.

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/dysco/dysco/internal/api"
	"github.com/dysco/dysco/internal/lab"
	"github.com/dysco/dysco/internal/labkit"
)

// churnFam is one address family of a run.
type churnFam struct {
	name           string // "IPv4", "IPv6"
	qual           string // "ip", "ip6": filters' family, "" with a single family
	client, server netip.Addr
	mbs            map[string]netip.Addr
}

func (f *churnFam) filter(ports ...int) string {
	var ps []string
	for _, p := range ports {
		ps = append(ps, fmt.Sprintf("dst port %d", p))
	}
	s := "tcp " + ps[0]
	if len(ps) > 1 {
		s = "tcp and (" + strings.Join(ps, " or ") + ")"
	}
	if f.qual != "" {
		s = f.qual + " and " + s
	}
	return s
}

func (f *churnFam) addrs(hosts []string) []string {
	var out []string
	for _, h := range hosts {
		out = append(out, f.mbs[h].String())
	}
	return out
}

// churn is a run in progress.
type churn struct {
	spec ChurnSpec
	l    *lab.Lab
	fams []*churnFam
	rng  *rand.Rand
	res  *ChurnResult

	t0     time.Time
	stop   chan struct{}
	wg     sync.WaitGroup
	socks  *sockTracker
	nextID atomic.Uint64

	streams, shorts flowCounter
	mu              sync.Mutex
	problems        map[string][]string // "resets", "failed": descriptions
	streamSrv       map[uint64]*streamServer
	lns             []net.Listener
	dir             string
	nginx           *lab.Proc
	// sessionsAtStop is every agent's sessions when the last round was
	// over, one JSON record a line with whether the client's socket was
	// open, for churn.log.
	sessionsAtStop strings.Builder

	// paths are the sessions' paths as the runner made them (absent:
	// their policy's chain), by pathKey: a tuple is used again by later
	// sessions (wrk's ports wrap around in a long run), which the
	// client's agent gives new ids.
	paths map[string][]string
	// last is the last chain a round asked for, by match.
	last map[string][]string
}

type flowCounter struct {
	sessions, completed, up, down, resets, failed atomic.Int64
}

func (fc *flowCounter) result() *ChurnFlows {
	return &ChurnFlows{Sessions: fc.sessions.Load(), Completed: fc.completed.Load(), BytesUp: fc.up.Load(),
		BytesDown: fc.down.Load(), Resets: fc.resets.Load(), Failed: fc.failed.Load()}
}

func (s *ChurnSpec) defaults() error {
	if s.Lab == nil || s.Dysco == "" {
		return errors.New("churn: no lab or no dysco binary")
	}
	if !s.IPv4 && !s.IPv6 {
		return errors.New("churn: no address family")
	}
	if s.Duration <= 0 && s.MaxRounds <= 0 {
		return errors.New("churn: neither a duration nor a number of rounds")
	}
	if len(s.Alternate) > 0 && s.IPv4 && s.IPv6 {
		return errors.New("churn: alternating rounds need a single address family")
	}
	if s.SlowAfter <= 0 {
		s.SlowAfter = time.Second
	}
	if s.Interval <= 0 {
		s.Interval = 500 * time.Millisecond
	}
	if s.Keepalive <= 0 {
		s.Keepalive = 100
	}
	if s.FileSize <= 0 {
		s.FileSize = 64 << 10
	}
	if s.WrkThreads <= 0 {
		s.WrkThreads = 1
	}
	s.WrkConns = max(s.WrkConns, s.WrkThreads)
	if s.StreamLife <= 0 {
		s.StreamLife = 5 * time.Second
	}
	if s.ShortGap <= 0 {
		s.ShortGap = 50 * time.Millisecond
	}
	for _, h := range append(append(append(slices.Clone(s.HTTPChain), s.StreamChain...), s.ShortChain...), s.Alternate...) {
		if !slices.Contains(s.Middleboxes, h) {
			return fmt.Errorf("churn: %s is in a chain but not among the middleboxes %v", h, s.Middleboxes)
		}
	}
	for _, h := range append([]string{"client", "server"}, s.Middleboxes...) {
		if s.Lab.Host(h) == nil {
			return fmt.Errorf("churn: lab %s has no host %s", s.Lab.Name(), h)
		}
	}
	return nil
}

func (c *churn) logf(format string, args ...any) {
	if c.spec.Logf != nil {
		c.spec.Logf(format, args...)
	}
}

func (c *churn) problem(kind, format string, args ...any) {
	c.mu.Lock()
	c.problems[kind] = append(c.problems[kind], fmt.Sprintf(format, args...))
	c.mu.Unlock()
}

// dysco runs the CLI on a host.
func (c *churn) dysco(ctx context.Context, host string, timeout time.Duration, args ...string) (string, error) {
	return labkit.Run(ctx, c.l, host, timeout, append([]string{c.spec.Dysco}, args...)...)
}

// RunChurn runs the workload of spec with its reconfiguration rounds and
// returns what it saw. The error is for what kept it from running; what
// went wrong under churn is in the result (Problems).
func RunChurn(ctx context.Context, spec ChurnSpec) (*ChurnResult, error) {
	if err := spec.defaults(); err != nil {
		return nil, err
	}
	l := spec.Lab
	c := &churn{spec: spec, l: l, rng: rand.New(rand.NewPCG(spec.Seed, spec.Seed^0x9e3779b97f4a7c15)),
		res:      &ChurnResult{KernelResets: map[string]uint64{}, KernelOutRsts: map[string]uint64{}, Outcomes: map[string]int{}, Kinds: map[string]int{}},
		stop:     make(chan struct{}),
		problems: map[string][]string{}, streamSrv: map[uint64]*streamServer{},
		paths: map[string][]string{}, last: map[string][]string{}}
	for _, v6 := range []bool{false, true} {
		if v6 && !spec.IPv6 || !v6 && !spec.IPv4 {
			continue
		}
		f := &churnFam{name: "IPv4", mbs: map[string]netip.Addr{}}
		addr := func(h string) netip.Addr { return l.Host(h).Addr4 }
		if v6 {
			f.name = "IPv6"
			addr = func(h string) netip.Addr { return l.Host(h).Addr6 }
		}
		if spec.IPv4 && spec.IPv6 {
			f.qual = map[bool]string{false: "ip", true: "ip6"}[v6]
		}
		f.client, f.server = addr("client"), addr("server")
		for _, m := range spec.Middleboxes {
			f.mbs[m] = addr(m)
		}
		c.fams = append(c.fams, f)
		c.res.Families = append(c.res.Families, f.name)
	}
	defer c.cleanup()
	if err := c.setUp(ctx); err != nil {
		return c.res, err
	}
	err := c.runWorkload(ctx)
	c.evaluate()
	c.writeLog()
	return c.res, err
}

// setUp installs the policies and starts the servers.
func (c *churn) setUp(ctx context.Context) error {
	s := c.spec
	for _, f := range c.fams {
		for _, p := range []struct {
			name  string
			port  int
			chain []string
			on    bool
		}{{"web", labkit.HTTPPort, s.HTTPChain, true}, {"bulk", churnStreamPort, s.StreamChain, s.Streams > 0}, {"short", churnShortPort, s.ShortChain, s.Shorts > 0}} {
			if !p.on {
				continue
			}
			args := []string{"policy", "add", "churn-" + p.name + strings.TrimPrefix(f.name, "IPv")}
			if len(p.chain) > 0 {
				args = append(args, "--chain", strings.Join(f.addrs(p.chain), ","))
			}
			if _, err := c.dysco(ctx, "client", 30*time.Second, append(args, f.filter(p.port))...); err != nil {
				return err
			}
		}
		if err := c.l.Ping(ctx, "client", f.server); err != nil {
			return fmt.Errorf("lab %s: the client does not reach the server (%s): %w", c.l.Name(), f.name, err)
		}
	}
	var err error
	if c.dir, err = os.MkdirTemp("", "dysco-churn-"+c.l.Name()+"-"); err != nil {
		return err
	}
	var addrs []netip.Addr
	for _, f := range c.fams {
		addrs = append(addrs, f.server)
	}
	conf, err := lab.WriteNginxConfigKeepalive(c.dir, labkit.HTTPPort, s.Keepalive, addrs...)
	if err != nil {
		return err
	}
	file := make([]byte, s.FileSize)
	for i := range file {
		file[i] = labkit.Pattern2[i%labkit.PatLen]
	}
	if err := os.WriteFile(filepath.Join(c.dir, "www", "file"), file, 0o644); err != nil {
		return err
	}
	if c.nginx, err = c.l.Start("server", "nginx-churn", "nginx", "-c", conf, "-p", c.dir); err != nil {
		return err
	}
	for _, f := range c.fams {
		if err := labkit.WaitListening(ctx, c.l, netip.AddrPortFrom(f.server, labkit.HTTPPort)); err != nil {
			return err
		}
		for _, p := range []struct {
			port  int
			on    bool
			serve func(net.Conn)
		}{{churnStreamPort, s.Streams > 0, c.serveStream}, {churnShortPort, s.Shorts > 0, c.serveShort}} {
			if !p.on {
				continue
			}
			ln, err := c.l.Listen("server", "tcp", netip.AddrPortFrom(f.server, uint16(p.port)).String())
			if err != nil {
				return fmt.Errorf("lab %s: listening on the server: %w", c.l.Name(), err)
			}
			c.lns = append(c.lns, ln)
			go func() {
				for {
					conn, err := ln.Accept()
					if err != nil {
						return
					}
					c.wg.Add(1)
					go func() { defer c.wg.Done(); p.serve(conn) }()
				}
			}()
		}
	}
	return nil
}

func (c *churn) cleanup() {
	select {
	case <-c.stop:
	default:
		close(c.stop)
	}
	for _, ln := range c.lns {
		ln.Close()
	}
	c.mu.Lock()
	for _, s := range c.streamSrv {
		s.e.Abort()
	}
	c.mu.Unlock()
	labkit.WaitAll(&c.wg, 10*time.Second)
	if c.socks != nil {
		c.socks.close()
	}
	if c.nginx != nil {
		c.nginx.Stop()
	}
	if c.dir != "" {
		os.RemoveAll(c.dir)
	}
}

// wrkRun is one wrk in progress.
type wrkRun struct {
	f    *churnFam
	cmd  interface{ Signal(os.Signal) error }
	out  bytes.Buffer
	done chan error
}

// runWorkload starts the workloads, runs the rounds, checks for stuck
// phases and resets, and stops the workloads.
func (c *churn) runWorkload(ctx context.Context) error {
	s := c.spec
	var err error
	if c.socks, err = newSockTracker(c.l.Host("client").Namespace, c.fams, s.Streams > 0, s.Shorts > 0); err != nil {
		return err
	}
	c.t0 = time.Now()
	c.socks.start(c.t0)
	before, err := c.kernelCounters(ctx)
	if err != nil {
		return err
	}
	agents0, err := c.agentCounters(ctx)
	if err != nil {
		return err
	}
	// wrk runs until it is interrupted (SIGINT makes it print its
	// summary), so that the checks below run while it still does.
	var wrks []*wrkRun
	defer func() {
		for _, w := range wrks {
			w.cmd.Signal(os.Kill)
		}
	}()
	for _, f := range c.fams {
		url := fmt.Sprintf("http://%s/file", netip.AddrPortFrom(f.server, labkit.HTTPPort))
		argv := []string{"wrk", "-t", strconv.Itoa(s.WrkThreads), "-c", strconv.Itoa(s.WrkConns), "-d", "3600s", "--timeout", "4s", url}
		cmd := c.l.Command(ctx, "client", argv...)
		w := &wrkRun{f: f, done: make(chan error, 1)}
		cmd.Stdout, cmd.Stderr = &w.out, &w.out
		if err := cmd.Start(); err != nil {
			return fmt.Errorf("wrk: %w", err)
		}
		w.cmd = cmd.Process
		go func() { w.done <- cmd.Wait() }()
		wrks = append(wrks, w)
		for i := 0; i < s.Streams; i++ {
			c.wg.Add(1)
			go c.streamWorker(f)
		}
		for i := 0; i < s.Shorts; i++ {
			c.wg.Add(1)
			go c.shortWorker(f)
		}
	}
	// Ready: every workload has sessions open or done.
	for deadline := time.Now().Add(20 * time.Second); ; {
		ready := true
		for _, f := range c.fams {
			ready = ready && c.socks.count(f, labkit.HTTPPort) > 0
		}
		if s.Streams > 0 {
			ready = ready && c.streams.sessions.Load() >= int64(len(c.fams)*s.Streams)
		}
		if s.Shorts > 0 {
			ready = ready && c.shorts.completed.Load() > 0
		}
		if ready {
			break
		}
		for _, w := range wrks {
			select {
			case err := <-w.done:
				return fmt.Errorf("wrk (%s) exited at start (%v): %s", w.f.name, err, labkit.Tail(w.out.String(), 500))
			default:
			}
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("the workload did not start within 20 s (wrk sessions seen %v, streams %d, short connections done %d)",
				c.socks.counts(labkit.HTTPPort), c.streams.sessions.Load(), c.shorts.completed.Load())
		}
		if err := labkit.SleepCtx(ctx, 20*time.Millisecond); err != nil {
			return err
		}
	}
	c.logf("workload running (%s): wrk -t%d -c%d per family, %d streams and %d short-connection workers per family; rounds from %v, every %v",
		strings.Join(c.res.Families, ", "), s.WrkThreads, s.WrkConns, s.Streams, s.Shorts, s.Start, s.Interval)

	if err := c.rounds(ctx); err != nil {
		return err
	}
	c.res.Seconds = time.Since(c.t0).Seconds()

	// No round runs now: nothing may be left in a phase.
	if err := c.phasesLeft(ctx); err != nil {
		return err
	}
	after, err := c.kernelCounters(ctx)
	if err != nil {
		return err
	}
	agents1, err := c.agentCounters(ctx)
	if err != nil {
		return err
	}
	c.res.AgentCounters = map[string]map[string]uint64{}
	for h, st := range agents1 {
		c.res.AgentCounters[h] = labkit.CounterDelta(agents0[h], st)
	}
	for k, v := range after {
		if strings.HasPrefix(k, "client TcpOutRsts") || strings.HasPrefix(k, "server TcpOutRsts") {
			c.res.KernelOutRsts[k] = v - before[k]
		} else {
			c.res.KernelResets[k] = v - before[k]
		}
	}

	// Stop the workloads.
	for _, w := range wrks {
		w.cmd.Signal(os.Interrupt)
	}
	for _, w := range wrks {
		select {
		case <-w.done:
		case <-time.After(20 * time.Second):
			w.cmd.Signal(os.Kill)
			<-w.done
			c.res.Errors = append(c.res.Errors, fmt.Sprintf("wrk (%s) did not stop within 20 s of SIGINT", w.f.name))
		}
		cw := parseChurnWrk(w.out.String())
		cw.Family = w.f.name
		c.res.Wrk = append(c.res.Wrk, cw)
	}
	wrks = nil
	close(c.stop)
	if !labkit.WaitAll(&c.wg, 60*time.Second) {
		c.problem("failed", "some byte-checked sessions did not end within 60 s of the stop")
	}
	c.socks.close()
	return nil
}

// phasesLeft waits up to 3 s for every agent to hold no lock and no
// reconfiguration stage; what is left on a session still open is a stuck
// phase, on an ended one a leftover.
func (c *churn) phasesLeft(ctx context.Context) error {
	hosts := append(append([]string{"client"}, c.spec.Middleboxes...), "server")
	var left []string
	var leftLive []bool
	for first, deadline := true, time.Now().Add(3*time.Second); ; first = false {
		left, leftLive = nil, nil
		for _, h := range hosts {
			out, err := c.dysco(ctx, h, 30*time.Second, "sessions", "-o", "json")
			if err != nil {
				return err
			}
			var ss []api.Session
			if err := json.Unmarshal([]byte(out), &ss); err != nil {
				return fmt.Errorf("dysco sessions on %s: %w", h, err)
			}
			if first {
				fmt.Fprintf(&c.sessionsAtStop, "\n%s: %d sessions when the last round was over\n", h, len(ss))
				for _, x := range ss {
					src, dst, _ := parseSession(x.Session)
					j, _ := json.Marshal(x)
					fmt.Fprintf(&c.sessionsAtStop, "  client socket %s %s\n", map[bool]string{true: "open  ", false: "closed"}[c.socks.aliveNow(src, dst)], j)
				}
			}
			for _, x := range ss {
				var in []string
				if x.Lock == "locked" || x.Lock == "lockPending" {
					in = append(in, "lock "+x.Lock)
				}
				if x.Reconfig != "" && !strings.HasSuffix(x.Reconfig, ":done") {
					in = append(in, "stage "+x.Reconfig)
				}
				for _, tp := range x.TwoPath {
					if tp.State != "idle" {
						in = append(in, fmt.Sprintf("two-path %s side %s", tp.Side, tp.State))
					}
				}
				if len(in) == 0 {
					continue
				}
				src, dst, _ := parseSession(x.Session)
				live := c.socks.aliveNow(src, dst)
				left = append(left, fmt.Sprintf("%s: session %s (%s, %s): %s", h, x.Session, x.State, map[bool]string{true: "socket open", false: "socket closed"}[live], strings.Join(in, ", ")))
				leftLive = append(leftLive, live)
			}
		}
		if len(left) == 0 || time.Now().After(deadline) {
			break
		}
		if err := labkit.SleepCtx(ctx, 200*time.Millisecond); err != nil {
			return err
		}
	}
	for i, x := range left {
		if leftLive[i] {
			c.problem("stuck", "still in a phase 3 s after the last round: %s", x)
		} else {
			c.res.Leftover = append(c.res.Leftover, x)
		}
	}
	return nil
}

// kernelCounters reads the reset counters: TcpEstabResets of the client
// and the server (a connection reset, whoever sent the RST), TcpOutRsts of
// the middleboxes (which hold no TCP socket of the workload: any RST they
// send answers a packet the datapath let through to their own stack).
func (c *churn) kernelCounters(ctx context.Context) (map[string]uint64, error) {
	out := map[string]uint64{}
	read := func(host string, names ...string) error {
		s, err := labkit.Run(ctx, c.l, host, 30*time.Second, "nstat", "-asz")
		if err != nil {
			return err
		}
		for _, line := range strings.Split(s, "\n") {
			f := strings.Fields(line)
			if len(f) >= 2 && slices.Contains(names, f[0]) {
				v, _ := strconv.ParseUint(f[1], 10, 64)
				out[host+" "+f[0]] = v
			}
		}
		return nil
	}
	for _, h := range []string{"client", "server"} {
		if err := read(h, "TcpEstabResets", "TcpOutRsts"); err != nil {
			return nil, err
		}
	}
	for _, h := range c.spec.Middleboxes {
		if err := read(h, "TcpOutRsts"); err != nil {
			return nil, err
		}
	}
	return out, nil
}

// agentCounters reads every agent's status.
func (c *churn) agentCounters(ctx context.Context) (map[string]*api.Status, error) {
	out := map[string]*api.Status{}
	for _, h := range append(append([]string{"client"}, c.spec.Middleboxes...), "server") {
		s, err := c.dysco(ctx, h, 30*time.Second, "status", "-o", "json")
		if err != nil {
			return nil, err
		}
		var st api.Status
		if err := json.Unmarshal([]byte(s), &st); err != nil {
			return nil, fmt.Errorf("status of %s: %w", h, err)
		}
		out[h] = &st
	}
	return out, nil
}

// writeLog writes churn.log to the lab's run directory (kept with the
// agents' logs when a run fails): every round, the problems, the kernel's
// and the agents' counters, wrk's output.
func (c *churn) writeLog() {
	var b strings.Builder
	r := c.res
	fmt.Fprintf(&b, "churn run in lab %s: %s, %.1f s of workload, %d rounds\n\n", c.l.Name(), strings.Join(r.Families, ", "), r.Seconds, len(r.Rounds))
	for _, rd := range r.Rounds {
		fmt.Fprintf(&b, "round %d at %.3f s (%s): %s\n", rd.N, rd.At, rd.Family, roundLine(rd))
		for _, o := range rd.Results {
			fmt.Fprintf(&b, "  %s %s%s %.3f ms (lock %.3f, set-up %.3f) %s, path %v, socket %s%s\n", o.Session, o.Outcome, prefixed(": ", o.Reason),
				float64(o.Micros)/1000, float64(o.LockMicros)/1000, float64(o.SetupMicros)/1000, o.Kind, o.Path, o.Fate, prefixed(" — ", strings.Join(o.Classes, "; ")))
		}
	}
	fmt.Fprintf(&b, "\nproblems:\n")
	for _, p := range r.Problems() {
		fmt.Fprintf(&b, "  %s\n", p)
	}
	for _, xs := range [][]string{r.Resets, r.Failed, r.Stuck, r.Unexpected, r.Leftover, r.Errors} {
		for _, x := range xs {
			fmt.Fprintf(&b, "  - %s\n", x)
		}
	}
	fmt.Fprintf(&b, "\nkernel resets %v; RSTs sent by the ends %v\n", r.KernelResets, r.KernelOutRsts)
	for _, h := range append(append([]string{"client"}, c.spec.Middleboxes...), "server") {
		fmt.Fprintf(&b, "agent %s counters over the workload: %v\n", h, r.AgentCounters[h])
	}
	for _, w := range r.Wrk {
		fmt.Fprintf(&b, "\nwrk (%s):\n%s\n", w.Family, w.Output)
	}
	b.WriteString(c.sessionsAtStop.String())
	os.WriteFile(filepath.Join(c.l.RunDir(), "churn.log"), []byte(b.String()), 0o644)
}

var (
	wrkReqRE  = regexp.MustCompile(`(?m)^\s*(\d+) requests in`)
	wrkSockRE = regexp.MustCompile(`Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)`)
)

// parseChurnWrk reads wrk's summary.
func parseChurnWrk(out string) *ChurnWrk {
	w := &ChurnWrk{Output: labkit.Tail(out, 2000)}
	if m := wrkReqRE.FindStringSubmatch(out); m != nil {
		w.Requests, _ = strconv.ParseInt(m[1], 10, 64)
	}
	if m := wrkRPSRE.FindStringSubmatch(out); m != nil {
		w.RPS, _ = strconv.ParseFloat(m[1], 64)
	}
	if m := wrkSockRE.FindStringSubmatch(out); m != nil {
		for i, p := range []*int64{&w.Connect, &w.Read, &w.Write, &w.Timeout} {
			*p, _ = strconv.ParseInt(m[i+1], 10, 64)
		}
	}
	if m := wrkNon2xxRE.FindStringSubmatch(out); m != nil {
		w.Non2xx, _ = strconv.ParseInt(m[1], 10, 64)
	}
	return w
}
