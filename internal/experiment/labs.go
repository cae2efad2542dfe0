package experiment

import (
	"context"
	"crypto/rand"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/dysco/dysco/internal/api"
	"github.com/dysco/dysco/internal/lab"
)

// Ports of the servers in the labs; the Dysco policy matches all three.
const (
	iperfPort   = 5201
	httpPort    = 80
	connectPort = 9000
	smallFile   = "1k.bin"
)

// policyFilter is the client's policy in the Dysco labs.
var policyFilter = fmt.Sprintf("tcp and (dst port %d or dst port %d or dst port %d)", iperfPort, httpPort, connectPort)

// variant is one side of a comparison: a lab with a client and a server.
type variant struct {
	name   string // "dysco" or "baseline"
	lab    *lab.Lab
	server netip.Addr
	mbs    []string
}

// pair is a Dysco lab and a baseline lab of the same line topology.
type pair struct {
	nmb    int
	dysco  *variant
	base   *variant
	chain  []netip.Addr // middlebox addresses, in order
	hosts  []string
	dirs   []string
	lns    []net.Listener
	closed sync.Once
}

// both returns the two variants in measurement order.
func (p *pair) both() []*variant { return []*variant{p.dysco, p.base} }

// labSet tracks every lab the run builds so that all are torn down.
type labSet struct {
	mu   sync.Mutex
	labs []*lab.Lab
	// logDir, when set, receives a copy of every lab's logs (agents and
	// programs) before the lab goes: LOGDIR/LAB/HOST.NAME.log.
	logDir string
}

func (s *labSet) add(l *lab.Lab) {
	s.mu.Lock()
	s.labs = append(s.labs, l)
	s.mu.Unlock()
}

// down tears down every lab (idempotent).
func (s *labSet) down() error {
	s.mu.Lock()
	labs := s.labs
	s.labs = nil
	s.mu.Unlock()
	var errs []error
	for _, l := range labs {
		if s.logDir != "" {
			if _, err := copyLogs(l.RunDir(), filepath.Join(s.logDir, l.Name())); err != nil {
				errs = append(errs, fmt.Errorf("lab %s logs: %w", l.Name(), err))
			}
		}
		if err := l.Down(); err != nil {
			errs = append(errs, fmt.Errorf("lab %s down: %w", l.Name(), err))
		}
	}
	return errors.Join(errs...)
}

// copyLogs copies the *.log files of a lab's run directory to dst and
// returns how many there were.
func copyLogs(runDir, dst string) (int, error) {
	logs, err := filepath.Glob(filepath.Join(runDir, "*.log"))
	if err != nil || len(logs) == 0 {
		return 0, err
	}
	if err := os.MkdirAll(dst, 0o755); err != nil {
		return 0, err
	}
	var errs []error
	for _, f := range logs {
		data, err := os.ReadFile(f)
		if err == nil {
			err = os.WriteFile(filepath.Join(dst, filepath.Base(f)), data, 0o644)
		}
		errs = append(errs, err)
	}
	return len(logs), errors.Join(errs...)
}

// saveLabLogs copies the logs of a lab's run directory to dir; a lab
// without logs is an error.
func saveLabLogs(l *lab.Lab, dir string) (string, error) {
	n, err := copyLogs(l.RunDir(), dir)
	if err == nil && n == 0 {
		err = fmt.Errorf("no logs in %s", l.RunDir())
	}
	return dir, err
}

// runID is a random lab name prefix: "b" and four characters.
func runID() string {
	const alnum = "abcdefghijklmnopqrstuvwxyz0123456789"
	var b [4]byte
	rand.Read(b[:])
	id := []byte{'b'}
	for _, c := range b {
		id = append(id, alnum[int(c)%len(alnum)])
	}
	return string(id)
}

func lineHosts(nmb int) []string {
	hosts := []string{"client"}
	for i := 1; i <= nmb; i++ {
		hosts = append(hosts, fmt.Sprintf("mb%d", i))
	}
	return append(hosts, "server")
}

// upPair builds the Dysco and the baseline lab of a line with nmb
// middleboxes, starts the servers in both and installs the Dysco policy.
func upPair(ctx context.Context, o *Options, set *labSet, prefix string, nmb int, pr *progress) (_ *pair, err error) {
	hosts := lineHosts(nmb)
	p := &pair{nmb: nmb, hosts: hosts}
	defer func() {
		if err != nil {
			p.close()
		}
	}()
	mk := func(name, suffix string, agents bool) (*variant, error) {
		cfg := lab.Config{Name: fmt.Sprintf("%s%s%d", prefix, suffix, nmb), Topology: lab.Line(hosts...)}
		if agents {
			cfg.AgentBinary = o.Dysco
			if len(o.AgentArgs) > 0 {
				args := o.AgentArgs
				cfg.AgentArgs = func(*lab.Host) []string { return args }
			}
		}
		upCtx, cancel := context.WithTimeout(ctx, 90*time.Second)
		defer cancel()
		pr.logf("building lab %s (%s, line %s)", cfg.Name, name, strings.Join(hosts, "-"))
		l, err := lab.Up(upCtx, cfg)
		if err != nil {
			return nil, fmt.Errorf("lab %s: %w", cfg.Name, err)
		}
		set.add(l)
		return &variant{name: name, lab: l, server: l.Host("server").Addr4, mbs: hosts[1 : len(hosts)-1]}, nil
	}
	if p.base, err = mk("baseline", "b", false); err != nil {
		return nil, err
	}
	if p.dysco, err = mk("dysco", "d", true); err != nil {
		return nil, err
	}
	for _, mb := range p.dysco.mbs {
		p.chain = append(p.chain, p.dysco.lab.Host(mb).Addr4)
	}
	var chain []string
	for _, a := range p.chain {
		chain = append(chain, a.String())
	}
	if _, err := dyscoCLI(ctx, o, p.dysco.lab, "client", "policy", "add", "bench", "--chain", strings.Join(chain, ","), policyFilter); err != nil {
		return nil, err
	}
	for _, v := range p.both() {
		if err := v.lab.Ping(ctx, "client", v.server); err != nil {
			return nil, fmt.Errorf("lab %s: the client does not reach the server: %w", v.lab.Name(), err)
		}
		if err := p.startServers(ctx, v); err != nil {
			return nil, err
		}
	}
	// One session through the chain: the Dysco lab must really chain.
	before, err := agentStatus(ctx, o, p.dysco.lab, "mb1")
	if err != nil {
		return nil, err
	}
	c, err := p.dysco.lab.Dial(ctx, "client", "tcp", netip.AddrPortFrom(p.dysco.server, connectPort).String())
	if err != nil {
		return nil, fmt.Errorf("lab %s: connecting through the chain: %w", p.dysco.lab.Name(), err)
	}
	c.Close()
	after, err := agentStatus(ctx, o, p.dysco.lab, "mb1")
	if err != nil {
		return nil, err
	}
	if after.Counters["setup_cont"] <= before.Counters["setup_cont"] {
		return nil, fmt.Errorf("lab %s: a session to port %d did not go through the chain (mb1 setup_cont stayed at %d): the policy is not in force", p.dysco.lab.Name(), connectPort, after.Counters["setup_cont"])
	}
	return p, nil
}

// startServers starts iperf3, nginx and a connect() listener on the server.
func (p *pair) startServers(ctx context.Context, v *variant) error {
	l := v.lab
	if _, err := l.Start("server", "iperf3", "iperf3", "-s", "-B", v.server.String(), "-p", fmt.Sprint(iperfPort)); err != nil {
		return err
	}
	dir, err := os.MkdirTemp("", "dysco-bench-"+l.Name()+"-")
	if err != nil {
		return err
	}
	p.dirs = append(p.dirs, dir)
	if err := writeNginx(dir, v.server); err != nil {
		return err
	}
	if _, err := l.Start("server", "nginx", "nginx", "-c", filepath.Join(dir, "nginx.conf"), "-p", dir); err != nil {
		return err
	}
	ln, err := l.Listen("server", "tcp", netip.AddrPortFrom(v.server, connectPort).String())
	if err != nil {
		return fmt.Errorf("lab %s: listening on the server: %w", l.Name(), err)
	}
	p.lns = append(p.lns, ln)
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			c.Close()
		}
	}()
	for _, port := range []uint16{iperfPort, httpPort} {
		if err := waitListening(ctx, l, netip.AddrPortFrom(v.server, port)); err != nil {
			return err
		}
	}
	return nil
}

// close stops the pair's listeners and removes its temporary files; the
// labs themselves go with the labSet.
func (p *pair) close() {
	p.closed.Do(func() {
		for _, ln := range p.lns {
			ln.Close()
		}
		for _, d := range p.dirs {
			os.RemoveAll(d)
		}
	})
}

// waitListening waits until a server accepts connections, dialling from the
// server itself (so no Dysco session is made).
func waitListening(ctx context.Context, l *lab.Lab, ap netip.AddrPort) error {
	deadline := time.Now().Add(15 * time.Second)
	for {
		dctx, cancel := context.WithTimeout(ctx, time.Second)
		c, err := l.Dial(dctx, "server", "tcp", ap.String())
		cancel()
		if err == nil {
			c.Close()
			return nil
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("lab %s: nothing listens on %s after 15 s (see the logs in %s): %w", l.Name(), ap, l.RunDir(), err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func writeNginx(dir string, addr netip.Addr) error {
	if _, err := lab.WriteNginxConfig(dir, httpPort, addr); err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(dir, "www", smallFile), []byte(strings.Repeat("dysco-bench\n", 86)[:1024]), 0o644)
}

// run runs argv in a lab host and returns its stdout; a failure carries
// stderr.
func run(ctx context.Context, l *lab.Lab, host string, timeout time.Duration, argv ...string) (string, error) {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	cmd := l.Command(ctx, host, argv...)
	var stderr strings.Builder
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		if ctx.Err() != nil && errors.Is(ctx.Err(), context.DeadlineExceeded) {
			err = fmt.Errorf("timed out after %v", timeout)
		}
		return string(out), fmt.Errorf("%s on %s of lab %s: %w\n%s%s", strings.Join(argv, " "), host, l.Name(), err, tail(stderr.String(), 800), tail(string(out), 800))
	}
	return string(out), nil
}

func tail(s string, n int) string {
	if len(s) > n {
		return "..." + s[len(s)-n:]
	}
	return s
}

func dyscoCLI(ctx context.Context, o *Options, l *lab.Lab, host string, args ...string) (string, error) {
	return run(ctx, l, host, 30*time.Second, append([]string{o.Dysco}, args...)...)
}

func agentStatus(ctx context.Context, o *Options, l *lab.Lab, host string) (*api.Status, error) {
	out, err := dyscoCLI(ctx, o, l, host, "status", "-o", "json")
	if err != nil {
		return nil, err
	}
	var st api.Status
	if err := json.Unmarshal([]byte(out), &st); err != nil {
		return nil, fmt.Errorf("status of %s in lab %s: %w", host, l.Name(), err)
	}
	return &st, nil
}

// counterDelta returns after-before for the counters that changed.
func counterDelta(before, after *api.Status) map[string]uint64 {
	d := map[string]uint64{}
	for k, v := range after.Counters {
		if v != before.Counters[k] {
			d[k] = v - before.Counters[k]
		}
	}
	return d
}

// drops sums the drop counters of a delta.
func drops(d map[string]uint64) map[string]uint64 {
	out := map[string]uint64{}
	for k, v := range d {
		if strings.HasPrefix(k, "drop_") && v > 0 {
			out[k] = v
		}
	}
	return out
}

// setTxOffload turns transmit checksum offload on or off on every interface
// of every host of both labs (ethtool -K IFACE tx on|off).
func (p *pair) setTxOffload(ctx context.Context, on bool) error {
	val := "off"
	if on {
		val = "on"
	}
	for _, v := range p.both() {
		for _, h := range v.lab.Hosts() {
			for _, ifc := range h.Ifaces {
				if _, err := run(ctx, v.lab, h.Name, 10*time.Second, "ethtool", "-K", ifc.Name, "tx", val); err != nil {
					return err
				}
			}
		}
	}
	return nil
}
