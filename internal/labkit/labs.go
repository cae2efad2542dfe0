// Package labkit is the lab recipe that the benchmarks (internal/bench)
// and the paper's experiments (internal/experiment) share: labs built with
// an agent on every host and torn down together (Labs), the Dysco and
// baseline line pair with its servers (UpPair), commands and the dysco CLI
// run in lab hosts, byte streams checked end to end (End), progress lines
// with an estimate of what is left (Progress), and the statistics and
// text of the reports.
package labkit

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
	IperfPort   = 5201
	HTTPPort    = 80
	ConnectPort = 9000
	SmallFile   = "1k.bin"
	// UDPEchoPort is the UDP echo server of the UDP set-up benchmark;
	// H3Port the dysco-h3 server's.
	UDPEchoPort = 9001
	H3Port      = 4433
)

// UDPPolicyFilter is the Dysco labs' second policy, given by
// Pair.AddUDPPolicy: the UDP data of iperf3 -u (its control connection is
// TCP), the UDP echo server and dysco-h3.
var UDPPolicyFilter = fmt.Sprintf("udp and (dst port %d or dst port %d or dst port %d)", IperfPort, UDPEchoPort, H3Port)

// policyFilter is the client's policy in the Dysco labs.
var policyFilter = fmt.Sprintf("tcp and (dst port %d or dst port %d or dst port %d)", IperfPort, HTTPPort, ConnectPort)

// Variant is one side of a comparison: a lab with a client and a server.
type Variant struct {
	Name   string // "dysco" or "baseline"
	Lab    *lab.Lab
	Server netip.Addr
	MBs    []string
}

// Pair is a Dysco lab and a baseline lab of the same line topology.
type Pair struct {
	NMB    int
	Dysco  *Variant
	Base   *Variant
	Chain  []netip.Addr // middlebox addresses, in order
	hosts  []string
	dirs   []string
	lns    []net.Listener
	closed sync.Once
	dysco  string
	udpPol bool
	// closers run at Close.
	closers []func()
}

// Both returns the two variants in measurement order.
func (p *Pair) Both() []*Variant { return []*Variant{p.Dysco, p.Base} }

// Labs tracks every lab the run builds so that all are torn down.
type Labs struct {
	mu   sync.Mutex
	labs []*lab.Lab
	// logDir, when set, receives a copy of every lab's logs (agents and
	// programs) before the lab goes: LOGDIR/LAB/HOST.NAME.log.
	LogDir string
}

// Agents is how a lab runs Dysco: the binary of its agents and of the
// CLI, and extra arguments for every agent.
type Agents struct {
	Dysco string
	Args  []string
}

// Up builds a lab of topo, with an agent on every host when a.Dysco is
// set, within 90 s, and adds it to the set.
func (s *Labs) Up(ctx context.Context, name string, topo lab.Topology, a Agents) (*lab.Lab, error) {
	cfg := lab.Config{Name: name, Topology: topo, AgentBinary: a.Dysco}
	if a.Dysco != "" && len(a.Args) > 0 {
		args := a.Args
		cfg.AgentArgs = func(*lab.Host) []string { return args }
	}
	upCtx, cancel := context.WithTimeout(ctx, 90*time.Second)
	defer cancel()
	l, err := lab.Up(upCtx, cfg)
	if err != nil {
		return nil, fmt.Errorf("lab %s: %w", cfg.Name, err)
	}
	s.add(l)
	return l, nil
}

func (s *Labs) add(l *lab.Lab) {
	s.mu.Lock()
	s.labs = append(s.labs, l)
	s.mu.Unlock()
}

// Down tears down every lab (idempotent).
func (s *Labs) Down() error {
	s.mu.Lock()
	labs := s.labs
	s.labs = nil
	s.mu.Unlock()
	var errs []error
	for _, l := range labs {
		if s.LogDir != "" {
			if _, err := copyLogs(l.RunDir(), filepath.Join(s.LogDir, l.Name())); err != nil {
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

// SaveLabLogs copies the logs of a lab's run directory to dir; a lab
// without logs is an error.
func SaveLabLogs(l *lab.Lab, dir string) (string, error) {
	n, err := copyLogs(l.RunDir(), dir)
	if err == nil && n == 0 {
		err = fmt.Errorf("no logs in %s", l.RunDir())
	}
	return dir, err
}

// RunID is a random lab name prefix: "b" and four characters.
func RunID() string {
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

// UpPair builds the Dysco and the baseline lab of a line with nmb
// middleboxes, starts the servers in both and installs the Dysco policy.
func UpPair(ctx context.Context, a Agents, set *Labs, prefix string, nmb int, pr *Progress) (_ *Pair, err error) {
	hosts := lineHosts(nmb)
	p := &Pair{NMB: nmb, hosts: hosts, dysco: a.Dysco}
	defer func() {
		if err != nil {
			p.Close()
		}
	}()
	mk := func(name, suffix string, agents bool) (*Variant, error) {
		la := a
		if !agents {
			la = Agents{}
		}
		lname := fmt.Sprintf("%s%s%d", prefix, suffix, nmb)
		pr.Logf("building lab %s (%s, line %s)", lname, name, strings.Join(hosts, "-"))
		l, err := set.Up(ctx, lname, lab.Line(hosts...), la)
		if err != nil {
			return nil, err
		}
		return &Variant{Name: name, Lab: l, Server: l.Host("server").Addr4, MBs: hosts[1 : len(hosts)-1]}, nil
	}
	if p.Base, err = mk("baseline", "b", false); err != nil {
		return nil, err
	}
	if p.Dysco, err = mk("dysco", "d", true); err != nil {
		return nil, err
	}
	for _, mb := range p.Dysco.MBs {
		p.Chain = append(p.Chain, p.Dysco.Lab.Host(mb).Addr4)
	}
	var chain []string
	for _, addr := range p.Chain {
		chain = append(chain, addr.String())
	}
	if _, err := DyscoCLI(ctx, a.Dysco, p.Dysco.Lab, "client", "policy", "add", "bench", "--chain", strings.Join(chain, ","), policyFilter); err != nil {
		return nil, err
	}
	for _, v := range p.Both() {
		if err := v.Lab.Ping(ctx, "client", v.Server); err != nil {
			return nil, fmt.Errorf("lab %s: the client does not reach the server: %w", v.Lab.Name(), err)
		}
		if err := p.startServers(ctx, v); err != nil {
			return nil, err
		}
	}
	// One session through the chain: the Dysco lab must really chain.
	before, err := AgentStatus(ctx, a.Dysco, p.Dysco.Lab, "mb1")
	if err != nil {
		return nil, err
	}
	c, err := p.Dysco.Lab.Dial(ctx, "client", "tcp", netip.AddrPortFrom(p.Dysco.Server, ConnectPort).String())
	if err != nil {
		return nil, fmt.Errorf("lab %s: connecting through the chain: %w", p.Dysco.Lab.Name(), err)
	}
	c.Close()
	after, err := AgentStatus(ctx, a.Dysco, p.Dysco.Lab, "mb1")
	if err != nil {
		return nil, err
	}
	if after.Counters["setup_cont"] <= before.Counters["setup_cont"] {
		return nil, fmt.Errorf("lab %s: a session to port %d did not go through the chain (mb1 setup_cont stayed at %d): the policy is not in force", p.Dysco.Lab.Name(), ConnectPort, after.Counters["setup_cont"])
	}
	return p, nil
}

// AddUDPPolicy gives the client of the Dysco lab a second policy, "udp",
// chaining the UDP sessions of UDPPolicyFilter through the same middleboxes
// (once; the TCP benchmarks run without it).
func (p *Pair) AddUDPPolicy(ctx context.Context) error {
	if p.udpPol {
		return nil
	}
	var chain []string
	for _, addr := range p.Chain {
		chain = append(chain, addr.String())
	}
	if _, err := DyscoCLI(ctx, p.dysco, p.Dysco.Lab, "client", "policy", "add", "udp", "--chain", strings.Join(chain, ","), UDPPolicyFilter); err != nil {
		return err
	}
	p.udpPol = true
	return nil
}

// OnClose registers fn to run when the pair is closed (servers a
// benchmark started for itself).
func (p *Pair) OnClose(fn func()) {
	p.closers = append(p.closers, fn)
}

// startServers starts iperf3, nginx and a connect() listener on the server.
func (p *Pair) startServers(ctx context.Context, v *Variant) error {
	l := v.Lab
	if _, err := l.Start("server", "iperf3", "iperf3", "-s", "-B", v.Server.String(), "-p", fmt.Sprint(IperfPort)); err != nil {
		return err
	}
	dir, err := os.MkdirTemp("", "dysco-bench-"+l.Name()+"-")
	if err != nil {
		return err
	}
	p.dirs = append(p.dirs, dir)
	if err := writeNginx(dir, v.Server); err != nil {
		return err
	}
	if _, err := l.Start("server", "nginx", "nginx", "-c", filepath.Join(dir, "nginx.conf"), "-p", dir); err != nil {
		return err
	}
	ln, err := l.Listen("server", "tcp", netip.AddrPortFrom(v.Server, ConnectPort).String())
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
	for _, port := range []uint16{IperfPort, HTTPPort} {
		if err := WaitListening(ctx, l, netip.AddrPortFrom(v.Server, port)); err != nil {
			return err
		}
	}
	return nil
}

// Close stops the pair's listeners and removes its temporary files; the
// labs themselves go with the Labs.
func (p *Pair) Close() {
	p.closed.Do(func() {
		for _, fn := range p.closers {
			fn()
		}
		for _, ln := range p.lns {
			ln.Close()
		}
		for _, d := range p.dirs {
			os.RemoveAll(d)
		}
	})
}

// WaitListening waits until a server accepts connections, dialling from the
// server itself (so no Dysco session is made).
func WaitListening(ctx context.Context, l *lab.Lab, ap netip.AddrPort) error {
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
	if _, err := lab.WriteNginxConfig(dir, HTTPPort, addr); err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(dir, "www", SmallFile), []byte(strings.Repeat("dysco-bench\n", 86)[:1024]), 0o644)
}

// Run runs argv in a lab host and returns its stdout; a failure carries
// stderr.
func Run(ctx context.Context, l *lab.Lab, host string, timeout time.Duration, argv ...string) (string, error) {
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
		return string(out), fmt.Errorf("%s on %s of lab %s: %w\n%s%s", strings.Join(argv, " "), host, l.Name(), err, Tail(stderr.String(), 800), Tail(string(out), 800))
	}
	return string(out), nil
}

// Tail is the last n bytes of s, after "..." when s is longer.
func Tail(s string, n int) string {
	if len(s) > n {
		return "..." + s[len(s)-n:]
	}
	return s
}

// DyscoCLI runs the dysco binary's CLI on a lab host.
func DyscoCLI(ctx context.Context, dysco string, l *lab.Lab, host string, args ...string) (string, error) {
	return Run(ctx, l, host, 30*time.Second, append([]string{dysco}, args...)...)
}

// AgentStatus is `dysco status` of a lab host's agent.
func AgentStatus(ctx context.Context, dysco string, l *lab.Lab, host string) (*api.Status, error) {
	out, err := DyscoCLI(ctx, dysco, l, host, "status", "-o", "json")
	if err != nil {
		return nil, err
	}
	var st api.Status
	if err := json.Unmarshal([]byte(out), &st); err != nil {
		return nil, fmt.Errorf("status of %s in lab %s: %w", host, l.Name(), err)
	}
	return &st, nil
}

// CounterDelta returns after-before for the counters that changed.
func CounterDelta(before, after *api.Status) map[string]uint64 {
	d := map[string]uint64{}
	for k, v := range after.Counters {
		if v != before.Counters[k] {
			d[k] = v - before.Counters[k]
		}
	}
	return d
}

// Drops sums the drop counters of a delta.
func Drops(d map[string]uint64) map[string]uint64 {
	out := map[string]uint64{}
	for k, v := range d {
		if strings.HasPrefix(k, "drop_") && v > 0 {
			out[k] = v
		}
	}
	return out
}

// SetTxOffload turns transmit checksum offload on or off on every interface
// of every host of both labs (ethtool -K IFACE tx on|off).
func (p *Pair) SetTxOffload(ctx context.Context, on bool) error {
	val := "off"
	if on {
		val = "on"
	}
	for _, v := range p.Both() {
		for _, h := range v.Lab.Hosts() {
			for _, ifc := range h.Ifaces {
				if _, err := Run(ctx, v.Lab, h.Name, 10*time.Second, "ethtool", "-K", ifc.Name, "tx", val); err != nil {
					return err
				}
			}
		}
	}
	return nil
}

// SleepCtx sleeps for d unless ctx is done first.
func SleepCtx(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}
