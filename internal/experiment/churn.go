package experiment

// The churn runner: live reconfigurations while sessions come and go.
// Keep-alive HTTP sessions that nginx closes after a few requests (wrk opens
// new ones), byte-checked bulk sessions both ways that end and start again,
// and short connections (connect, request, close) run through the client's
// policy chains while the client, as left anchor, reconfigures them round
// after round (`dysco reconfig`). It counts what must never happen under
// churn: connections reset, transfers with bytes missing or wrong, and
// reconfigurations that stall. The experiment "churn" (exp_churn.go), the
// benchmark "churn" of `make bench` and the end-to-end test
// TestReconfigureUnderChurn run it.
//
// What a session's fate was comes from the kernel, not from the agents: a
// poller lists the client's TCP sockets (sock_diag) every 50 ms, so that
// each result can be set against whether its session was still open when
// the round returned.

import (
	"bytes"
	"context"
	"encoding/binary"
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
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/dysco/dysco/internal/api"
	"github.com/dysco/dysco/internal/lab"
)

// Ports of the churn workloads besides nginx's (httpPort).
const (
	churnStreamPort = 9600
	churnShortPort  = 9601
)

// churnPoll is the interval of the socket poller.
const churnPoll = 50 * time.Millisecond

// ChurnSpec says what RunChurn runs.
type ChurnSpec struct {
	// Lab is a star lab with hosts "client" and "server" and the hosts of
	// Middleboxes, each with an agent. RunChurn installs the client's
	// policies and starts the servers.
	Lab *lab.Lab
	// Dysco is the dysco binary for the CLI.
	Dysco string
	// Middleboxes are the hosts that rounds put in chains.
	Middleboxes []string
	// IPv4 and IPv6 select the sessions' address families; with both,
	// the workloads of the two families run side by side.
	IPv4, IPv6 bool
	// HTTPChain, StreamChain and ShortChain are the chains (host names)
	// of the client's policies for each workload; an empty chain makes
	// Dysco sessions with no middlebox.
	HTTPChain, StreamChain, ShortChain []string

	// nginx on the server serves a file of FileSize bytes and closes each
	// keep-alive connection after Keepalive requests; per family, wrk
	// -tWrkThreads -cWrkConns --timeout 4s asks for it from the client.
	Keepalive, FileSize, WrkThreads, WrkConns int
	// Streams is the number of byte-checked bulk sessions per family at
	// any time: each sends both ways at StreamRate bytes/s per direction
	// for a random time up to StreamLife, then the client half-closes,
	// the server goes on sending a little, then closes too, and the
	// worker opens the next one. 0: none.
	Streams    int
	StreamRate int64
	StreamLife time.Duration
	// Shorts is the number of workers per family that connect, send a
	// request, read the response (1–60 KB, checked) and close, ShortGap
	// apart. 0: none.
	Shorts   int
	ShortGap time.Duration

	// The first round starts Start after the workload; each next one
	// Interval after the previous returned (follow-ups at once). No round
	// starts after Duration (0: no limit) or after MaxRounds rounds (0:
	// no limit); one of the two must be set.
	Start, Interval time.Duration
	Duration        time.Duration
	MaxRounds       int
	// Alternate, if set, makes the rounds those of the issue's workload:
	// every round matches the HTTP sessions (`tcp dst port 80`) and
	// replaces whatever is between the client and the server by the next
	// host of Alternate, in turn. It needs a single address family.
	// Otherwise rounds are random (Seed): a family, a workload (or all),
	// and a chain among the middleboxes and the empty chain, some of them
	// the current path of the sessions.
	Alternate []string
	Seed      uint64
	// FollowUps is the fraction of random rounds that start as soon as
	// the previous one returned, on the same sessions.
	FollowUps float64
	// SlowAfter: a result that took longer than this is a stuck phase,
	// unless it is "session ended" for a session that did end (default
	// 1 s; ClassSlow names it so).
	SlowAfter time.Duration
	// Logf receives progress lines; nil for none.
	Logf func(format string, args ...any)
}

// IssueChurnSpec is the workload of the issue "reconfiguration under churn
// resets connections and stalls": a star lab client, mb1, mb2, server;
// nginx closing keep-alive connections after 200 requests of a 64 KiB file;
// `wrk -t2 -c50 --timeout 4s` from the client; the client's policy chains
// `tcp dst port 80` through mb1; from 1 s on, every 0.5 s, `dysco reconfig
// --match 'tcp dst port 80' --to SERVER --chain MB2`, then MB1, and so on,
// for 7 s (wrk's -d8s in the issue). The lab must have mb1 and mb2.
func IssueChurnSpec(l *lab.Lab, dysco string, v6 bool) ChurnSpec {
	return ChurnSpec{Lab: l, Dysco: dysco, Middleboxes: []string{"mb1", "mb2"}, IPv4: !v6, IPv6: v6,
		HTTPChain: []string{"mb1"}, Keepalive: 200, FileSize: 64 << 10, WrkThreads: 2, WrkConns: 50,
		Start: time.Second, Interval: 500 * time.Millisecond, Duration: 7 * time.Second,
		Alternate: []string{"mb2", "mb1"}, SlowAfter: time.Second}
}

// ChurnResult is what a churn run saw.
type ChurnResult struct {
	Families []string `json:"families"`
	// Seconds is how long the workload ran until the checks.
	Seconds float64     `json:"workload_s"`
	Wrk     []*ChurnWrk `json:"wrk"`
	Streams *ChurnFlows `json:"streams,omitempty"`
	Shorts  *ChurnFlows `json:"short_connections,omitempty"`
	// KernelResets are the kernel's counts of resets over the workload,
	// until before it stopped: "HOST Counter" → delta (TcpEstabResets on
	// the client and the server, TcpOutRsts on the middleboxes).
	KernelResets map[string]uint64 `json:"kernel_resets"`
	// KernelOutRsts are the RSTs the client and the server sent meanwhile
	// (for information: an end also answers stray segments with RSTs).
	KernelOutRsts map[string]uint64 `json:"kernel_out_rsts"`
	Rounds        []*ChurnRound     `json:"rounds"`
	// Outcomes counts the results by "outcome" or "outcome: reason".
	Outcomes map[string]int `json:"outcomes"`
	// Kinds counts the results by what the round asked of the session.
	Kinds map[string]int `json:"kinds"`
	// Times are the reconfiguration times of the succeeded results.
	Times ChurnTimes `json:"times"`
	// Resets, Failed, Stuck and Unexpected are the problems: connections
	// reset, transfers with bytes missing or wrong, stuck phases, and
	// results that do not fit their session's fate.
	Resets     []string `json:"resets,omitempty"`
	Failed     []string `json:"failed_transfers,omitempty"`
	Stuck      []string `json:"stuck,omitempty"`
	Unexpected []string `json:"unexpected,omitempty"`
	// Leftover are reconfiguration phases still held, after the settle
	// time, for sessions that had ended.
	Leftover []string `json:"leftover,omitempty"`
	// Errors are rounds that could not be run at all.
	Errors []string `json:"errors,omitempty"`
	// AgentCounters are the changes of each agent's datapath counters
	// (`dysco status`) over the workload, the nonzero ones.
	AgentCounters map[string]map[string]uint64 `json:"agent_counters"`
	// SocketPolls is how many times the poller listed the client's
	// sockets, SocketLives the session lives it saw.
	SocketPolls int `json:"socket_polls"`
	SocketLives int `json:"socket_lives"`
}

// ChurnWrk is one wrk's summary.
type ChurnWrk struct {
	Family   string  `json:"family"`
	Requests int64   `json:"requests"`
	RPS      float64 `json:"requests_per_s"`
	Connect  int64   `json:"connect_errors"`
	Read     int64   `json:"read_errors"`
	Write    int64   `json:"write_errors"`
	Timeout  int64   `json:"timeouts"`
	Non2xx   int64   `json:"non_2xx"`
	Output   string  `json:"output"`
}

// SocketErrors is the sum of wrk's socket errors.
func (w *ChurnWrk) SocketErrors() int64 { return w.Connect + w.Read + w.Write + w.Timeout }

// ChurnFlows counts the runner's own sessions of one kind.
type ChurnFlows struct {
	Sessions  int64 `json:"sessions"`
	Completed int64 `json:"completed"`
	BytesUp   int64 `json:"bytes_client_to_server"`
	BytesDown int64 `json:"bytes_server_to_client"`
	Resets    int64 `json:"resets"`
	Failed    int64 `json:"failed"`
}

// ChurnTimes is the distribution of reconfiguration times, in ms.
type ChurnTimes struct {
	N   int     `json:"n"`
	P50 float64 `json:"p50_ms"`
	P90 float64 `json:"p90_ms"`
	P99 float64 `json:"p99_ms"`
	Max float64 `json:"max_ms"`
}

// MarshalJSON writes NaN as null.
func (t ChurnTimes) MarshalJSON() ([]byte, error) {
	return json.Marshal(struct {
		N   int      `json:"n"`
		P50 *float64 `json:"p50_ms"`
		P90 *float64 `json:"p90_ms"`
		P99 *float64 `json:"p99_ms"`
		Max *float64 `json:"max_ms"`
	}{t.N, jsonNum(t.P50), jsonNum(t.P90), jsonNum(t.P99), jsonNum(t.Max)})
}

// ChurnRound is one `dysco reconfig` at the client.
type ChurnRound struct {
	N        int             `json:"n"`
	At       float64         `json:"at_s"` // since the workload started
	WallMs   float64         `json:"wall_ms"`
	Family   string          `json:"family"`
	Match    string          `json:"match"`
	To       string          `json:"to"`
	Chain    []string        `json:"chain"` // host names
	FollowUp bool            `json:"follow_up,omitempty"`
	Results  []*ChurnOutcome `json:"results"`
	Err      string          `json:"error,omitempty"`
}

// Classes of results that do not fit their session's fate.
const (
	// ClassLiveNotReconfigured: a session still open after the round was
	// not reconfigured (nor refused as the request asked for a middlebox
	// already on its path).
	ClassLiveNotReconfigured = "live session not reconfigured"
	// ClassEndedOtherReason: a session that ended during the round
	// failed with another reason than "session ended".
	ClassEndedOtherReason = "ended session failed with another reason than \"session ended\""
	// ClassClaimedEnded: "session ended" for a session still open.
	ClassClaimedEnded = "\"session ended\" for a session still open"
	// ClassSlow: a result slower than SlowAfter, unless it is "session
	// ended" for a session that did end.
	ClassSlow = "slower than 1 s, and not \"session ended\" of an ended session"
)

// ChurnOutcome is one session's result of a round, with what the round
// asked of it and what became of it.
type ChurnOutcome struct {
	api.ReconfigResult
	// Kind is what the round asked of the session, from the path the
	// runner knows it had: "insert", "delete", "replace", "unchanged"
	// (the chain is its path) or "overlap" (the chain names a middlebox
	// already on its path, and is not that path).
	Kind string `json:"kind"`
	// Path is that path (host names).
	Path []string `json:"path"`
	// Fate is "alive" if the client's socket was open after the round
	// returned, "ended" if it was closed by then, "unseen" if the poller
	// never saw it (a session shorter than a poll).
	Fate string `json:"fate"`
	// Classes are the ways the result does not fit (empty: it fits).
	Classes []string `json:"classes,omitempty"`
}

// ResetCount is the number of connections the applications saw reset:
// wrk's connect, read and write errors and the runner's sessions reset
// (the kernel's counters count some of the same again, from each host).
func (r *ChurnResult) ResetCount() int64 {
	var n int64
	for _, w := range r.Wrk {
		n += w.Connect + w.Read + w.Write
	}
	for _, f := range []*ChurnFlows{r.Streams, r.Shorts} {
		if f != nil {
			n += f.Resets
		}
	}
	return n
}

// KernelResetCount sums the kernel's reset counters (KernelResets).
func (r *ChurnResult) KernelResetCount() uint64 {
	var n uint64
	for _, v := range r.KernelResets {
		n += v
	}
	return n
}

// Problems lists what makes the run fail: resets, failed transfers, stuck
// phases, results that do not fit their session's fate, rounds that could
// not run.
func (r *ChurnResult) Problems() []string {
	var p []string
	list := func(what string, xs []string) {
		if len(xs) > 0 {
			p = append(p, fmt.Sprintf("%d %s (first: %s)", len(xs), what, strings.Join(firstN(xs, 3), "; ")))
		}
	}
	if len(r.Resets) > 0 {
		p = append(p, fmt.Sprintf("connections reset: %d seen by the applications, the kernels' counters went up by %d (first: %s)",
			r.ResetCount(), r.KernelResetCount(), strings.Join(firstN(r.Resets, 3), "; ")))
	}
	list("failed transfers", r.Failed)
	list("stuck phases", r.Stuck)
	list("results that do not fit their session's fate", r.Unexpected)
	list("rounds that could not run", r.Errors)
	return p
}

// ClassCount counts the results of a class.
func (r *ChurnResult) ClassCount(class string) int {
	n := 0
	for _, rd := range r.Rounds {
		for _, o := range rd.Results {
			if slices.Contains(o.Classes, class) {
				n++
			}
		}
	}
	return n
}

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
	return run(ctx, c.l, host, timeout, append([]string{c.spec.Dysco}, args...)...)
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
		}{{"web", httpPort, s.HTTPChain, true}, {"bulk", churnStreamPort, s.StreamChain, s.Streams > 0}, {"short", churnShortPort, s.ShortChain, s.Shorts > 0}} {
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
	conf, err := lab.WriteNginxConfigKeepalive(c.dir, httpPort, s.Keepalive, addrs...)
	if err != nil {
		return err
	}
	file := make([]byte, s.FileSize)
	for i := range file {
		file[i] = pattern2[i%patLen]
	}
	if err := os.WriteFile(filepath.Join(c.dir, "www", "file"), file, 0o644); err != nil {
		return err
	}
	if c.nginx, err = c.l.Start("server", "nginx-churn", "nginx", "-c", conf, "-p", c.dir); err != nil {
		return err
	}
	for _, f := range c.fams {
		if err := waitListening(ctx, c.l, netip.AddrPortFrom(f.server, httpPort)); err != nil {
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
		s.e.abort()
	}
	c.mu.Unlock()
	waitAll(&c.wg, 10*time.Second)
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
		url := fmt.Sprintf("http://%s/file", netip.AddrPortFrom(f.server, httpPort))
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
			ready = ready && c.socks.count(f, httpPort) > 0
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
				return fmt.Errorf("wrk (%s) exited at start (%v): %s", w.f.name, err, tail(w.out.String(), 500))
			default:
			}
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("the workload did not start within 20 s (wrk sessions seen %v, streams %d, short connections done %d)",
				c.socks.counts(httpPort), c.streams.sessions.Load(), c.shorts.completed.Load())
		}
		if err := sleepCtx(ctx, 20*time.Millisecond); err != nil {
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
		c.res.AgentCounters[h] = counterDelta(agents0[h], st)
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
	if !waitAll(&c.wg, 60*time.Second) {
		c.problem("failed", "some byte-checked sessions did not end within 60 s of the stop")
	}
	c.socks.close()
	return nil
}

// rounds runs the reconfiguration rounds.
func (c *churn) rounds(ctx context.Context) error {
	s := c.spec
	first := s.Start
	if s.Duration > 0 {
		first = min(first, s.Duration)
	}
	if err := sleepCtx(ctx, first); err != nil {
		return err
	}
	var prev *ChurnRound
	follow := false
	lastLog := time.Now()
	for n := 1; ; n++ {
		if s.MaxRounds > 0 && n > s.MaxRounds || s.Duration > 0 && time.Since(c.t0) >= s.Duration {
			return nil
		}
		rd, f := c.nextRound(n, prev, follow)
		follow = len(s.Alternate) == 0 && c.rng.Float64() < s.FollowUps
		c.runRound(ctx, rd, f)
		c.res.Rounds = append(c.res.Rounds, rd)
		if ctx.Err() != nil {
			return ctx.Err()
		}
		prev = rd
		if time.Since(lastLog) >= 5*time.Second || s.MaxRounds > 0 && s.MaxRounds <= 30 {
			lastLog = time.Now()
			c.logf("t=%.1f s: round %d (%s) %s", time.Since(c.t0).Seconds(), n, rd.Family, roundLine(rd))
		}
		if !follow {
			if err := sleepCtx(ctx, s.Interval); err != nil {
				return err
			}
		}
	}
}

// roundLine describes a round's outcome in one line.
func roundLine(rd *ChurnRound) string {
	chain := strings.Join(rd.Chain, ",")
	if chain == "" {
		chain = "(none)"
	}
	if rd.Err != "" {
		return fmt.Sprintf("%q → %s: error %s", rd.Match, chain, rd.Err)
	}
	n := map[string]int{}
	var worst int64
	for _, o := range rd.Results {
		n[o.Outcome]++
		worst = max(worst, o.Micros)
	}
	f := ""
	if rd.FollowUp {
		f = ", follow-up"
	}
	return fmt.Sprintf("%q → %s%s: %d results, %d succeeded, %d refused, %d failed, slowest %.1f ms, %.0f ms wall",
		rd.Match, chain, f, len(rd.Results), n["succeeded"], n["refused"], n["failed"], float64(worst)/1000, rd.WallMs)
}

// nextRound picks round n's family, match and chain.
func (c *churn) nextRound(n int, prev *ChurnRound, follow bool) (*ChurnRound, *churnFam) {
	s := c.spec
	rd := &ChurnRound{N: n}
	if len(s.Alternate) > 0 {
		f := c.fams[0]
		rd.Family, rd.Match, rd.To = f.name, f.filter(httpPort), f.server.String()
		rd.Chain = []string{s.Alternate[(n-1)%len(s.Alternate)]}
		return rd, f
	}
	type target struct {
		ports []int
		chain []string // the policy's, nil for several ports
	}
	targets := []target{{[]int{httpPort}, s.HTTPChain}}
	all := []int{httpPort}
	if s.Streams > 0 {
		targets = append(targets, target{[]int{churnStreamPort}, s.StreamChain})
		all = append(all, churnStreamPort)
	}
	if s.Shorts > 0 {
		targets = append(targets, target{[]int{churnShortPort}, s.ShortChain})
		all = append(all, churnShortPort)
	}
	if len(all) > 1 {
		targets = append(targets, target{all, nil})
	}
	var f *churnFam
	var t target
	if follow && prev != nil {
		rd.FollowUp = true
		for _, x := range c.fams {
			if x.name == prev.Family {
				f = x
			}
		}
		for _, x := range targets {
			if f.filter(x.ports...) == prev.Match {
				t = x
			}
		}
	} else {
		f = c.fams[c.rng.IntN(len(c.fams))]
		t = targets[c.rng.IntN(len(targets))]
	}
	rd.Family, rd.Match, rd.To = f.name, f.filter(t.ports...), f.server.String()
	last, hasLast := c.last[rd.Match]
	for {
		switch x := c.rng.Float64(); {
		case x < 0.15 && hasLast:
			// The chain of the last round on these sessions: those it
			// reconfigured, and still alive, are on it already.
			rd.Chain = slices.Clone(last)
		case x < 0.3 && t.chain != nil:
			// The policy's chain: the path of the sessions opened since.
			rd.Chain = slices.Clone(t.chain)
		case x < 0.45:
			rd.Chain = nil
		case x < 0.85 || len(s.Middleboxes) < 2:
			rd.Chain = []string{s.Middleboxes[c.rng.IntN(len(s.Middleboxes))]}
		default:
			p := c.rng.Perm(len(s.Middleboxes))
			rd.Chain = []string{s.Middleboxes[p[0]], s.Middleboxes[p[1]]}
		}
		// A follow-up asks for another path than the round before.
		if !rd.FollowUp || !slices.Equal(rd.Chain, prev.Chain) {
			break
		}
	}
	return rd, f
}

// churnKind tells what a chain asks of a session on path cur.
func churnKind(cur, next []string) string {
	switch {
	case slices.Equal(cur, next):
		return "unchanged"
	case slices.ContainsFunc(next, func(h string) bool { return slices.Contains(cur, h) }):
		return "overlap"
	case len(cur) == 0:
		return "insert"
	case len(next) == 0:
		return "delete"
	}
	return "replace"
}

// runRound runs one round and records its results.
func (c *churn) runRound(ctx context.Context, rd *ChurnRound, f *churnFam) {
	args := []string{"reconfig", "--json", "--match", rd.Match, "--to", rd.To}
	if len(rd.Chain) > 0 {
		args = append(args, "--chain", strings.Join(f.addrs(rd.Chain), ","))
	}
	t := time.Now()
	rd.At = t.Sub(c.t0).Seconds()
	out, err := c.dysco(ctx, "client", 90*time.Second, args...)
	rd.WallMs = float64(time.Since(t).Microseconds()) / 1000
	var rep api.ReconfigReply
	if jerr := json.Unmarshal([]byte(out), &rep); jerr != nil {
		if err == nil {
			err = jerr
		}
		rd.Err = strings.TrimSpace(tail(err.Error(), 400))
		// "no live session matches" is not an error of the product.
		if !strings.Contains(err.Error(), "no live session") {
			c.res.Errors = append(c.res.Errors, fmt.Sprintf("round %d (%s %q): %s", rd.N, rd.Family, rd.Match, rd.Err))
		}
		return
	}
	c.last[rd.Match] = rd.Chain
	for _, r := range rep.Results {
		o := &ChurnOutcome{ReconfigResult: r}
		o.Path = c.pathOf(r)
		o.Kind = churnKind(o.Path, rd.Chain)
		if r.Outcome == "succeeded" {
			c.paths[pathKey(r)] = slices.Clone(rd.Chain)
		}
		rd.Results = append(rd.Results, o)
	}
}

// pathKey names a session at the client's agent: its id there and its
// tuple.
func pathKey(r api.ReconfigResult) string { return fmt.Sprintf("%d %s", r.ID, r.Session) }

// pathOf is the path the runner knows a session has: the chain of its last
// successful round, or its policy's.
func (c *churn) pathOf(r api.ReconfigResult) []string {
	if p, ok := c.paths[pathKey(r)]; ok {
		return p
	}
	_, dst, ok := parseSession(r.Session)
	if !ok {
		return nil
	}
	switch dst.Port() {
	case churnStreamPort:
		return c.spec.StreamChain
	case churnShortPort:
		return c.spec.ShortChain
	}
	return c.spec.HTTPChain
}

// parseSession splits "SRC:PORT -> DST:PORT".
func parseSession(s string) (src, dst netip.AddrPort, ok bool) {
	a, b, found := strings.Cut(s, " -> ")
	if !found {
		return src, dst, false
	}
	src, err1 := netip.ParseAddrPort(a)
	dst, err2 := netip.ParseAddrPort(b)
	if err1 != nil || err2 != nil {
		return src, dst, false
	}
	return netip.AddrPortFrom(src.Addr().Unmap(), src.Port()), netip.AddrPortFrom(dst.Addr().Unmap(), dst.Port()), true
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
		if err := sleepCtx(ctx, 200*time.Millisecond); err != nil {
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
		s, err := run(ctx, c.l, host, 30*time.Second, "nstat", "-asz")
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
	w := &ChurnWrk{Output: tail(out, 2000)}
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
	e    *end
	done chan struct{}
}

// serveStream is the server end of a bulk session: it receives to EOF and
// sends at the same rate until a little after the client's EOF (a
// half-closed session still carrying data), then half-closes.
func (c *churn) serveStream(conn net.Conn) {
	var hdr [8]byte
	conn.SetReadDeadline(time.Now().Add(10 * time.Second))
	if _, err := io.ReadFull(conn, hdr[:]); err != nil {
		conn.Close()
		return
	}
	conn.SetReadDeadline(time.Time{})
	id := binary.BigEndian.Uint64(hdr[:])
	s := &streamServer{e: newEnd(conn), done: make(chan struct{})}
	c.mu.Lock()
	c.streamSrv[id] = s
	c.mu.Unlock()
	var stop atomic.Bool
	sent := make(chan struct{})
	go func() { defer close(sent); s.e.send(&stop, c.spec.StreamRate) }()
	s.e.recv()
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
			sleepCtx(context.Background(), 200*time.Millisecond)
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
		cl := newEnd(conn)
		var stop atomic.Bool
		var ends sync.WaitGroup
		ends.Add(2)
		go func() { defer ends.Done(); cl.send(&stop, s.StreamRate) }()
		go func() { defer ends.Done(); cl.recv() }()
		select {
		case <-time.After(s.StreamLife/4 + rand.N(s.StreamLife*3/4)):
		case <-c.stop:
		}
		stop.Store(true)
		if !waitAll(&ends, 30*time.Second) {
			c.streams.failed.Add(1)
			c.problem("failed", "%s: no EOF from the server within 30 s of the half-close (%d bytes sent, %d received)", what, cl.tx.Load(), cl.rx.Load())
			cl.abort()
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
		c.streams.up.Add(sv.e.rx.Load())
		c.streams.down.Add(cl.rx.Load())
		bad := false
		for _, x := range []struct {
			side string
			e    *end
		}{{"client", cl}, {"server", sv.e}} {
			if err := x.e.Err(); err != nil {
				c.flowError(&c.streams, what+" "+x.side, err)
				bad = true
			}
		}
		if !bad {
			for _, l := range []string{lossCheck(what+" up", cl, sv.e), lossCheck(what+" down", sv.e, cl)} {
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
		sv.e.c.Close()
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
	if n <= 0 || n > patLen {
		return
	}
	if _, err := conn.Write(pattern2[:n]); err != nil {
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
	buf := make([]byte, patLen+1)
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
			if !bytes.Equal(buf[:n], pattern2[:n]) {
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

// evaluate sets every result against its session's fate and gathers the
// problems.
func (c *churn) evaluate() {
	r := c.res
	var ms []float64
	for i, rd := range r.Rounds {
		end := rd.At + rd.WallMs/1000
		for _, o := range rd.Results {
			r.Kinds[o.Kind]++
			k := o.Outcome
			if o.Reason != "" {
				k += ": " + o.Reason
			}
			r.Outcomes[k]++
			if o.Outcome == "succeeded" {
				ms = append(ms, float64(o.Micros)/1000)
			}
			src, dst, _ := parseSession(o.Session)
			o.Fate = "unseen"
			if c.socks != nil {
				o.Fate = c.socks.fate(src, dst, end)
			}
			ended := strings.Contains(o.Reason, "session ended")
			what := fmt.Sprintf("round %d (%s, %q → %s), session %s (%s, path %s): %s%s after %.1f ms",
				i+1, rd.Family, rd.Match, orText(strings.Join(rd.Chain, ","), "no middlebox"), o.Session, o.Kind,
				orText(strings.Join(o.Path, ","), "none"), o.Outcome, prefixed(": ", o.Reason), float64(o.Micros)/1000)
			switch {
			case o.Outcome == "succeeded":
			case ended && o.Fate == "alive":
				o.Classes = append(o.Classes, ClassClaimedEnded)
			case ended:
			case o.Fate == "alive" && !(o.Outcome == "refused" && o.Kind == "overlap"):
				o.Classes = append(o.Classes, ClassLiveNotReconfigured)
			case o.Fate != "alive" && o.Outcome == "failed":
				o.Classes = append(o.Classes, ClassEndedOtherReason)
			}
			if time.Duration(o.Micros)*time.Microsecond > c.spec.SlowAfter && !(ended && o.Fate != "alive") {
				o.Classes = append(o.Classes, ClassSlow)
			}
			for _, cl := range o.Classes {
				if cl == ClassSlow {
					c.problem("stuck", "%s: %s (socket %s)", what, cl, o.Fate)
				} else {
					r.Unexpected = append(r.Unexpected, fmt.Sprintf("%s: %s (socket %s)", what, cl, o.Fate))
				}
			}
		}
	}
	sort.Float64s(ms)
	r.Times = ChurnTimes{N: len(ms), P50: quantile(ms, 0.5), P90: quantile(ms, 0.9), P99: quantile(ms, 0.99), Max: quantile(ms, 1)}
	for _, w := range r.Wrk {
		if n := w.SocketErrors(); n > 0 {
			c.problem("resets", "wrk (%s): socket errors: connect %d, read %d, write %d, timeout %d", w.Family, w.Connect, w.Read, w.Write, w.Timeout)
		}
		if w.Non2xx > 0 {
			c.problem("failed", "wrk (%s): %d non-2xx responses", w.Family, w.Non2xx)
		}
		if w.Requests == 0 {
			r.Errors = append(r.Errors, fmt.Sprintf("wrk (%s) reported no requests: %s", w.Family, tail(w.Output, 300)))
		}
	}
	var keys []string
	for k := range r.KernelResets {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		if v := r.KernelResets[k]; v > 0 {
			c.problem("resets", "%s went up by %d during the workload", k, v)
		}
	}
	if c.spec.Streams > 0 {
		r.Streams = c.streams.result()
	}
	if c.spec.Shorts > 0 {
		r.Shorts = c.shorts.result()
	}
	c.mu.Lock()
	r.Resets = append(r.Resets, c.problems["resets"]...)
	r.Failed = append(r.Failed, c.problems["failed"]...)
	r.Stuck = append(r.Stuck, c.problems["stuck"]...)
	c.mu.Unlock()
	if c.socks != nil {
		r.SocketPolls, r.SocketLives = c.socks.stats()
	}
}

func prefixed(p, s string) string {
	if s == "" {
		return ""
	}
	return p + s
}

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
	t := &sockTracker{h: nh, ports: map[uint16]bool{httpPort: true, churnStreamPort: streams, churnShortPort: shorts},
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

// Phases of the churn benchmark, which builds its own lab.
const (
	churnLabs     = "labs, churn"
	churnTeardown = "teardown, churn"
)

func churnPhaseName(o *Options) string {
	return fmt.Sprintf("reconfiguration under churn, %d rounds", o.ChurnRounds)
}

// churnEst estimates the benchmark: 1 s before the first round, rounds of
// about 0.55 s, the checks and wrk's stop.
func churnEst(o *Options) time.Duration {
	return time.Second + time.Duration(o.ChurnRounds)*550*time.Millisecond + 8*time.Second
}

// runChurnBench builds the churn benchmark's lab (the issue's star: client,
// mb1, mb2, server), runs the benchmark and tears the lab down.
func runChurnBench(ctx context.Context, o *Options, set *labSet, prefix string, r *Report, pr *progress, step func(string, func() error)) {
	name := churnPhaseName(o)
	if ctx.Err() != nil {
		r.fail(name, errors.New("not run: interrupted"))
		return
	}
	pr.begin(churnLabs)
	cfg := lab.Config{Name: prefix + "ch", Topology: lab.Star("client", "mb1", "mb2", "server"), AgentBinary: o.Dysco}
	if len(o.AgentArgs) > 0 {
		args := o.AgentArgs
		cfg.AgentArgs = func(*lab.Host) []string { return args }
	}
	upCtx, cancel := context.WithTimeout(ctx, 90*time.Second)
	pr.logf("building lab %s (star client, mb1, mb2, server)", cfg.Name)
	l, err := lab.Up(upCtx, cfg)
	cancel()
	if err != nil {
		r.fail(churnLabs, fmt.Errorf("lab %s: %w", cfg.Name, err))
		pr.logf("%s FAILED: %v", churnLabs, err)
		pr.skip(name)
		r.fail(name, errors.New("not run: the lab could not be built"))
	} else {
		set.add(l)
		step(name, func() error { return benchChurn(ctx, o, l, r, pr) })
	}
	pr.begin(churnTeardown)
	if err := set.down(); err != nil {
		r.fail(churnTeardown, err)
	}
}

// benchChurn runs the issue's workload for o.ChurnRounds rounds and adds
// the reconfiguration time under churn: p50 and p99 of the succeeded
// results, with the target p99 < 50 ms and no reset.
func benchChurn(ctx context.Context, o *Options, l *lab.Lab, r *Report, pr *progress) error {
	spec := IssueChurnSpec(l, o.Dysco, false)
	spec.Duration, spec.MaxRounds = 0, o.ChurnRounds
	spec.Logf = pr.logf
	cr, err := RunChurn(ctx, spec)
	r.Details["churn"] = cr
	if err != nil {
		if dir, lerr := saveLabLogs(l, filepath.Join(o.OutDir, r.RunID+"-churn-logs")); lerr == nil {
			err = fmt.Errorf("%w (logs of the lab's agents and nginx copied to %s)", err, dir)
		}
		return err
	}
	problems := cr.Problems()
	met := cr.Times.N > 0 && cr.Times.P99 < 50 && cr.ResetCount() == 0 && cr.KernelResetCount() == 0 && len(problems) == 0
	var wrk []string
	for _, w := range cr.Wrk {
		wrk = append(wrk, fmt.Sprintf("%d requests (%.0f/s), socket errors connect %d, read %d, write %d, timeout %d, non-2xx %d",
			w.Requests, w.RPS, w.Connect, w.Read, w.Write, w.Timeout, w.Non2xx))
	}
	results := 0
	for _, rd := range cr.Rounds {
		results += len(rd.Results)
	}
	note := fmt.Sprintf("%d rounds, %d results (%s); p90 %.2f ms, max %.2f ms over the %d succeeded; wrk: %s; kernel reset counters over the workload: %s; "+
		"%d results slower than 1 s (not \"session ended\" of an ended session); %d results that do not fit their session's fate",
		len(cr.Rounds), results, strings.Join(sortedCounts(cr.Outcomes), ", "), cr.Times.P90, cr.Times.Max, cr.Times.N, strings.Join(wrk, "; "),
		countsText(cr.KernelResets), cr.ClassCount(ClassSlow), len(cr.Unexpected))
	if len(problems) > 0 {
		note += "; problems: " + strings.Join(problems, "; ")
		if dir, lerr := saveLabLogs(l, filepath.Join(o.OutDir, r.RunID+"-churn-logs")); lerr == nil {
			note += fmt.Sprintf(" (logs and churn.log in %s)", dir)
		}
	}
	r.add(&Figure{
		Key:  "churn-reconfig",
		Name: fmt.Sprintf("reconfiguration time under churn, %d rounds (nginx keepalive_requests 200, wrk -c50)", o.ChurnRounds),
		Command: fmt.Sprintf("ip netns exec LAB-client wrk -t2 -c50 --timeout 4s http://%s/file (64 KiB); from 1 s on, 0.5 s after each round returned: "+
			"ip netns exec LAB-client dysco reconfig --json --match 'tcp dst port 80' --to %s --chain MB2, then MB1, …", spec.Lab.Host("server").Addr4, spec.Lab.Host("server").Addr4),
		Unit: "ms", Dysco: cr.Times.P50, Baseline: math.NaN(), Ratio: math.NaN(),
		DyscoText: fmt.Sprintf("%.2f ms (p99 %.2f)", cr.Times.P50, cr.Times.P99),
		Measured:  cr.Times.P99, MeasuredUnit: "ms p99",
		Target: "p99 < 50 ms, 0 resets", Met: metStr(met), Note: note,
	})
	return nil
}
