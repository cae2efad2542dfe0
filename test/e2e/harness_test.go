// Package e2e runs Dysco end to end: labs of network namespaces with real
// agents, the real datapath and real programs (nginx, curl, iperf3, iptables,
// tcpdump), started and torn down by the tests themselves.
package e2e

import (
	"bufio"
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/json"
	"fmt"
	"hash"
	"io"
	"math/rand/v2"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/dysco/dysco/internal/api"
	"github.com/dysco/dysco/internal/lab"
	"github.com/dysco/dysco/internal/testutil"
	"github.com/vishvananda/netns"
)

// dyscoBin is the binary under test, built once by TestMain.
var dyscoBin string

// libdysco is the path of lib/libdysco.so, built by TestMain.
var libdysco string

func TestMain(m *testing.M) {
	if addr := os.Getenv("DYSCO_E2E_ECHO"); addr != "" {
		echoServer(addr) // a child process started by a test: see echoServer
		return
	}
	if os.Geteuid() != 0 {
		fmt.Println("e2e: skipped: needs root (network namespaces, eBPF)")
		os.Exit(0)
	}
	dir, err := os.MkdirTemp("", "dysco-e2e")
	if err != nil {
		panic(err)
	}
	dyscoBin = filepath.Join(dir, "dysco")
	out, err := exec.Command("go", "build", "-o", dyscoBin, "../../cmd/dysco").CombinedOutput()
	if err != nil {
		fmt.Fprintf(os.Stderr, "e2e: building dysco: %v\n%s", err, out)
		os.Exit(1)
	}
	// libdysco, for the proxy-removal tests (LD_PRELOAD into HAProxy).
	if out, err := exec.Command("make", "-s", "-C", "../..", "lib/libdysco.so").CombinedOutput(); err != nil {
		fmt.Fprintf(os.Stderr, "e2e: building libdysco: %v\n%s", err, out)
		os.Exit(1)
	}
	libdysco, _ = filepath.Abs("../../lib/libdysco.so")
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

// env is one lab under test.
type env struct {
	t     *testing.T
	lab   *lab.Lab
	holds int // hold rules inserted so far (holdRule names them)
}

type labOpts struct {
	topology  lab.Topology
	agentArgs []string
	// hostArgs are added to agentArgs on the named hosts.
	hostArgs map[string][]string
	noAgents bool
	// prefix starts the lab's name instead of "e" (a test whose labs
	// should be told apart from the others').
	prefix string
}

// newLab builds a lab whose name is unique to this run; it is torn down when
// the test ends, also when it fails.
func newLab(t *testing.T, o labOpts) *env {
	t.Helper()
	prefix := o.prefix
	if prefix == "" {
		prefix = "e"
	}
	name := fmt.Sprintf("%s%05d", prefix, rand.IntN(100000))
	cfg := lab.Config{Name: name, Topology: o.topology}
	if !o.noAgents {
		cfg.AgentBinary = dyscoBin
		args := append([]string{"--close-linger", "1s", "--half-open-timeout", "3s"}, o.agentArgs...)
		cfg.AgentArgs = func(h *lab.Host) []string { return append(append([]string(nil), args...), o.hostArgs[h.Name]...) }
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	l, err := lab.Up(ctx, cfg)
	if err != nil {
		t.Fatalf("lab up: %v", err)
	}
	t.Cleanup(func() {
		if t.Failed() {
			dumpLogs(t, l)
			if os.Getenv("DYSCO_E2E_KEEP") != "" {
				t.Logf("lab %s kept for debugging (DYSCO_E2E_KEEP); remove it with: dysco lab down --name %s", l.Name(), l.Name())
				return
			}
		}
		if err := l.Down(); err != nil {
			t.Errorf("lab down: %v", err)
		}
	})
	return &env{t: t, lab: l}
}

func dumpLogs(t *testing.T, l *lab.Lab) {
	for _, h := range l.Hosts() {
		if l.Agent(h.Name) == nil {
			continue
		}
		out, _ := l.Command(context.Background(), h.Name, dyscoBin, "status", "-o", "json").CombinedOutput()
		var st api.Status
		if json.Unmarshal(out, &st) == nil {
			nz := map[string]uint64{}
			for k, v := range st.Counters {
				if v != 0 {
					nz[k] = v
				}
			}
			t.Logf("--- %s counters: %v", h.Name, nz)
		}
		out, _ = l.Command(context.Background(), h.Name, dyscoBin, "sessions").CombinedOutput()
		t.Logf("--- %s sessions:\n%s", h.Name, out)
	}
	files, _ := filepath.Glob(filepath.Join(l.RunDir(), "*.log"))
	for _, f := range files {
		b, _ := os.ReadFile(f)
		if len(b) > 4000 {
			b = b[len(b)-4000:]
		}
		t.Logf("--- %s ---\n%s", filepath.Base(f), b)
	}
}

// withT returns the env for a subtest that shares the lab: failures are
// reported to t, from t's goroutine.
func (e *env) withT(t *testing.T) *env {
	c := *e
	c.t = t
	return &c
}

func (e *env) host(name string) *lab.Host {
	h := e.lab.Host(name)
	if h == nil {
		e.t.Fatalf("no host %s", name)
	}
	return h
}

func (e *env) addr(name string, v6 bool) netip.Addr {
	if v6 {
		return e.host(name).Addr6
	}
	return e.host(name).Addr4
}

// run runs a command in a host and fails the test if it fails.
func (e *env) run(host string, argv ...string) string {
	e.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	out, err := e.lab.Command(ctx, host, argv...).CombinedOutput()
	if err != nil {
		e.t.Fatalf("%s: %s: %v\n%s", host, strings.Join(argv, " "), err, out)
	}
	return string(out)
}

// dysco runs the CLI in a host.
func (e *env) dysco(host string, args ...string) string {
	e.t.Helper()
	return e.run(host, append([]string{dyscoBin}, args...)...)
}

func (e *env) policy(host, name, filter string, chain ...string) {
	e.t.Helper()
	args := []string{"policy", "add", name}
	if len(chain) > 0 {
		args = append(args, "--chain", strings.Join(chain, ","))
	}
	e.dysco(host, append(args, filter)...)
}

func (e *env) status(host string) api.Status {
	e.t.Helper()
	var st api.Status
	if err := json.Unmarshal([]byte(e.dysco(host, "status", "-o", "json")), &st); err != nil {
		e.t.Fatalf("status of %s: %v", host, err)
	}
	return st
}

func (e *env) sessions(host string) []api.Session {
	e.t.Helper()
	var ss []api.Session
	if err := json.Unmarshal([]byte(e.dysco(host, "sessions", "-o", "json")), &ss); err != nil {
		e.t.Fatalf("sessions of %s: %v", host, err)
	}
	return ss
}

// inNS runs f on an OS thread switched into the host's network namespace.
// Sockets created by f belong to that namespace for their whole life.
func (e *env) inNS(host string, f func() error) error {
	h := e.host(host)
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		// The thread is not unlocked: it is left to die with its namespace
		// changed rather than be reused by other goroutines.
		ns, err := netns.GetFromName(h.Namespace)
		if err != nil {
			errc <- err
			return
		}
		defer ns.Close()
		if err := netns.Set(ns); err != nil {
			errc <- err
			return
		}
		errc <- f()
	}()
	return <-errc
}

func (e *env) listen(host string, addr netip.AddrPort) net.Listener {
	e.t.Helper()
	var ln net.Listener
	err := e.inNS(host, func() error {
		var err error
		ln, err = net.Listen("tcp", addr.String())
		return err
	})
	if err != nil {
		e.t.Fatalf("listen on %s in %s: %v", addr, host, err)
	}
	e.t.Cleanup(func() { ln.Close() })
	return ln
}

func (e *env) dial(host string, addr netip.AddrPort, timeout time.Duration) (net.Conn, error) {
	var c net.Conn
	err := e.inNS(host, func() error {
		var err error
		c, err = net.DialTimeout("tcp", addr.String(), timeout)
		return err
	})
	return c, err
}

// stream is a deterministic byte stream: both ends can hash it.
type stream struct{ r *rand.ChaCha8 }

func newStream(seed uint64) *stream {
	var s [32]byte
	s[0] = byte(seed)
	s[1] = byte(seed >> 8)
	s[2] = byte(seed >> 16)
	return &stream{r: rand.NewChaCha8(s)}
}

func (s *stream) Read(p []byte) (int, error) { return s.r.Read(p) }

func streamHash(seed uint64, n int64) [32]byte {
	h := sha256.New()
	io.Copy(h, io.LimitReader(newStream(seed), n))
	var out [32]byte
	copy(out[:], h.Sum(nil))
	return out
}

// exchange sends n bytes each way over a session between client and a server
// the test runs on port, and checks byte for byte (by hash) what arrived. It
// returns the peer address the server's socket saw: the session's source.
func (e *env) exchange(client, server string, dst netip.Addr, port uint16, n int64) (peer netip.AddrPort) {
	e.t.Helper()
	ln := e.listen(server, netip.AddrPortFrom(dst, port))
	serverErr := make(chan error, 1)
	go func() {
		c, err := ln.Accept()
		if err != nil {
			serverErr <- err
			return
		}
		defer c.Close()
		peer = c.RemoteAddr().(*net.TCPAddr).AddrPort()
		serverErr <- transfer(c, 2, 1, n)
	}()
	c, err := e.dial(client, netip.AddrPortFrom(dst, port), 10*time.Second)
	if err != nil {
		e.t.Fatalf("dial %s from %s: %v", dst, client, err)
	}
	defer c.Close()
	if err := transfer(c, 1, 2, n); err != nil {
		e.t.Fatalf("client side: %v", err)
	}
	select {
	case err := <-serverErr:
		if err != nil {
			e.t.Fatalf("server side: %v", err)
		}
	case <-time.After(2 * time.Minute):
		e.t.Fatal("server side did not finish")
	}
	peer = netip.AddrPortFrom(peer.Addr().Unmap(), peer.Port())
	return peer
}

// openSession opens a session from client to a server the test runs on
// host server at dst:port; the server's side then exchanges n bytes each
// way with transfer, and served gives its result. The caller's side runs
// transfer(conn, 1, 2, n) when it wants, and closes conn.
func (e *env) openSession(client, server string, dst netip.Addr, port uint16, n int64) (net.Conn, <-chan error) {
	e.t.Helper()
	ln := e.listen(server, netip.AddrPortFrom(dst, port))
	served := make(chan error, 1)
	go func() {
		c, err := ln.Accept()
		if err != nil {
			served <- err
			return
		}
		defer c.Close()
		served <- transfer(c, 2, 1, n)
	}()
	c, err := e.dial(client, netip.AddrPortFrom(dst, port), 10*time.Second)
	if err != nil {
		e.t.Fatalf("dial %s from %s: %v", dst, client, err)
	}
	e.t.Cleanup(func() { c.Close() })
	return c, served
}

// transfer writes n bytes of stream sendSeed while reading n bytes that must
// hash like stream recvSeed; it half-closes after writing.
func transfer(c net.Conn, sendSeed, recvSeed uint64, n int64) error {
	var wg sync.WaitGroup
	var werr error
	wg.Add(1)
	go func() {
		defer wg.Done()
		_, werr = io.Copy(c, io.LimitReader(newStream(sendSeed), n))
		if hc, ok := c.(interface{ CloseWrite() error }); ok {
			hc.CloseWrite()
		}
	}()
	h := sha256.New()
	got, rerr := io.Copy(h, c)
	wg.Wait()
	if werr != nil {
		return fmt.Errorf("write: %w", werr)
	}
	if rerr != nil {
		return fmt.Errorf("read after %d bytes: %w", got, rerr)
	}
	if got != n {
		return fmt.Errorf("received %d bytes, want %d", got, n)
	}
	return checkStream(h, recvSeed, n)
}

// checkStream tells whether h hashed the first n bytes of stream seed.
func checkStream(h hash.Hash, seed uint64, n int64) error {
	want := streamHash(seed, n)
	if !bytes.Equal(h.Sum(nil), want[:]) {
		return fmt.Errorf("received %d bytes whose hash differs from what was sent", n)
	}
	return nil
}

// txOff turns transmit checksum offload off on the host's interfaces, so
// that every checksum the datapath writes is checked by the receiver
// (veth hides wrong checksums under CHECKSUM_PARTIAL).
func (e *env) txOff(hosts ...string) {
	for _, h := range hosts {
		e.run(h, "ethtool", "-K", e.host(h).Iface, "tx", "off")
	}
}

// capture runs tcpdump on a host's interface until stop is called, and
// returns the lines it printed.
func (e *env) capture(host, iface, filter string, extra ...string) (stop func() []string) {
	e.t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	argv := append(append([]string{"tcpdump", "-l", "-n", "-i", iface}, extra...), filter)
	cmd := e.lab.Command(ctx, host, argv...)
	var out bytes.Buffer
	var mu sync.Mutex
	cmd.Stdout = writerFunc(func(p []byte) (int, error) { mu.Lock(); defer mu.Unlock(); return out.Write(p) })
	stderr, _ := cmd.StderrPipe()
	if err := cmd.Start(); err != nil {
		cancel()
		e.t.Fatalf("tcpdump: %v", err)
	}
	// tcpdump says "listening on" once its capture is open: the ready signal.
	sc := bufio.NewScanner(stderr)
	ready := make(chan struct{})
	go func() {
		for sc.Scan() {
			if strings.Contains(sc.Text(), "listening on") {
				close(ready)
				break
			}
		}
		io.Copy(io.Discard, stderr)
	}()
	select {
	case <-ready:
	case <-time.After(10 * time.Second):
		cancel()
		e.t.Fatal("tcpdump did not start")
	}
	if iface == "dysco-tap" {
		// The datapath copies to the tap only while a capture is open:
		// wait until the agent has seen this one.
		testutil.Eventually(e.t, 5*time.Second, "the agent to see the capture on the tap", func() bool { return e.status(host).TapActive })
	}
	return func() []string {
		cancel()
		cmd.Wait()
		mu.Lock()
		defer mu.Unlock()
		return strings.Split(strings.TrimSpace(out.String()), "\n")
	}
}

type writerFunc func([]byte) (int, error)

func (f writerFunc) Write(p []byte) (int, error) { return f(p) }

// echoServer runs in a child process of the test binary (started in a lab
// host with DYSCO_E2E_ECHO=addr): it echoes every connection until the peer
// closes. Sessions by the ten thousand need their own process, as each
// process may hold only so many sockets.
func echoServer(addr string) {
	limit := raiseFileLimit()
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		fmt.Fprintln(os.Stderr, "echo:", err)
		os.Exit(1)
	}
	fmt.Println("listening; open file limit", limit)
	for {
		c, err := ln.Accept()
		if err != nil {
			fmt.Fprintln(os.Stderr, "echo: accept:", err)
			os.Exit(1)
		}
		go func() {
			// Plain reads and writes: io.Copy between TCP sockets would
			// splice through a pipe, two more descriptors a session.
			io.Copy(struct{ io.Writer }{c}, struct{ io.Reader }{c})
			c.Close()
		}()
	}
}

// raiseFileLimit raises the soft limit on open files to the hard limit.
func raiseFileLimit() uint64 {
	var lim syscall.Rlimit
	syscall.Getrlimit(syscall.RLIMIT_NOFILE, &lim)
	lim.Cur = lim.Max
	syscall.Setrlimit(syscall.RLIMIT_NOFILE, &lim)
	return lim.Cur
}

// ruleHold is an iptables DROP rule a test inserts and later deletes. Its
// comment names it, so that its counter is found among other rules.
type ruleHold struct {
	e                *env
	host, ipt, chain string
	spec             []string // match, DROP target and comment included
	tag              string
	released         bool
}

// holdRule inserts a DROP rule with the matches spec at the head of chain
// on host; it is deleted by release, or when the test ends.
func (e *env) holdRule(host, ipt, chain string, spec ...string) *ruleHold {
	e.t.Helper()
	e.holds++
	tag := fmt.Sprintf("dysco-test-hold-%d", e.holds)
	h := &ruleHold{e: e, host: host, ipt: ipt, chain: chain, tag: tag,
		spec: append(append(slices.Clone(spec), "-m", "comment", "--comment", tag), "-j", "DROP")}
	e.run(host, append([]string{ipt, "-I", chain}, h.spec...)...)
	e.t.Cleanup(h.release)
	return h
}

func (h *ruleHold) release() {
	if !h.released {
		h.released = true
		h.e.run(h.host, append([]string{h.ipt, "-D", h.chain}, h.spec...)...)
	}
}

// drops returns the packets the rule dropped.
func (h *ruleHold) drops() uint64 {
	h.e.t.Helper()
	out := h.e.run(h.host, h.ipt, "-L", h.chain, "-n", "-v", "-x")
	for _, l := range strings.Split(out, "\n") {
		if f := strings.Fields(l); len(f) > 2 && f[2] == "DROP" && strings.Contains(l, "/* "+h.tag+" */") {
			n, _ := strconv.ParseUint(f[0], 10, 64)
			return n
		}
	}
	h.e.t.Fatalf("%s: %s %s: no rule %s:\n%s", h.host, h.ipt, h.chain, h.tag, out)
	return 0
}
