// Package libdysco_test tests libdysco (libdysco/, include/dysco.h) with real
// proxies on loopback: spliceproxy, an unmodified splice(2) relay run under
// LD_PRELOAD, and lenproxy, a proxy linked with -ldysco that changes the
// length of the stream and calls dysco_splice. A fake agent on an abstract
// Unix socket records the requests.
package libdysco_test

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"
)

var (
	libPath     string // lib/libdysco.so, built with make
	spliceProxy string // test programs, built in a temporary directory
	lenProxy    string
)

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "libdysco-test")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	if err := build(dir); err != nil {
		fmt.Fprintf(os.Stderr, "libdysco: %v\n", err)
		os.RemoveAll(dir)
		os.Exit(1)
	}
	// The fake agents run as the test's user: the library checks that
	// the agent's socket is served by DYSCO_AGENT_UID (root otherwise).
	os.Setenv("DYSCO_AGENT_UID", strconv.Itoa(os.Getuid()))
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

// build makes lib/libdysco.so with the repository's Makefile and compiles
// the test proxies into dir.
func build(dir string) error {
	root, err := repoRoot()
	if err != nil {
		return err
	}
	run := func(name string, args ...string) error {
		out, err := exec.Command(name, args...).CombinedOutput()
		if err != nil {
			return fmt.Errorf("%s %s: %v\n%s", name, strings.Join(args, " "), err, out)
		}
		return nil
	}
	if err := run("make", "--no-print-directory", "-C", root, "lib/libdysco.so"); err != nil {
		return err
	}
	libDir := filepath.Join(root, "lib")
	libPath = filepath.Join(libDir, "libdysco.so")
	spliceProxy = filepath.Join(dir, "spliceproxy")
	lenProxy = filepath.Join(dir, "lenproxy")
	flags := []string{"-O2", "-Wall", "-Wextra", "-Werror"}
	// _FORTIFY_SOURCE=3 turns spliceproxy's banner recv into __recv_chk.
	if err := run("cc", append(flags, "-D_FORTIFY_SOURCE=3", "-o", spliceProxy, "testdata/spliceproxy.c")...); err != nil {
		return err
	}
	return run("cc", append(flags, "-I", filepath.Join(root, "include"), "-o", lenProxy, "testdata/lenproxy.c",
		"-L", libDir, "-Wl,-rpath,"+libDir, "-ldysco")...)
}

// repoRoot is the directory holding go.mod, above the test's directory.
func repoRoot() (string, error) {
	dir, err := os.Getwd()
	if err != nil {
		return "", err
	}
	for {
		if _, err := os.Stat(filepath.Join(dir, "go.mod")); err == nil {
			return dir, nil
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return "", fmt.Errorf("no go.mod above the test's directory")
		}
		dir = parent
	}
}

const timeout = 20 * time.Second

var agentCount atomic.Int64

// agentRequest is what the fake agent saw of one request.
type agentRequest struct {
	Method, Path, Host, ContentType string
	Close                           bool
	ContentLength                   int64
	Body                            string
}

// fakeAgent serves the agent's splice endpoint on an abstract Unix socket.
type fakeAgent struct {
	name string
	reqs chan agentRequest
	mu   sync.Mutex
	all  []agentRequest
}

// startAgent answers every request with code and body.
func startAgent(t *testing.T, code int, body string) *fakeAgent {
	t.Helper()
	a := &fakeAgent{
		name: fmt.Sprintf("@dysco-test-%d-%d", os.Getpid(), agentCount.Add(1)),
		reqs: make(chan agentRequest, 16),
	}
	ln, err := net.Listen("unix", a.name)
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		req := agentRequest{Method: r.Method, Path: r.URL.Path, Host: r.Host,
			ContentType: r.Header.Get("Content-Type"), Close: r.Close, ContentLength: r.ContentLength, Body: string(b)}
		a.mu.Lock()
		a.all = append(a.all, req)
		a.mu.Unlock()
		select {
		case a.reqs <- req:
		default:
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(code)
		io.WriteString(w, body)
	})}
	go srv.Serve(ln)
	t.Cleanup(func() { srv.Close() })
	return a
}

func (a *fakeAgent) count() int {
	a.mu.Lock()
	defer a.mu.Unlock()
	return len(a.all)
}

// next waits for the next request.
func (a *fakeAgent) next(t *testing.T) agentRequest {
	t.Helper()
	select {
	case r := <-a.reqs:
		return r
	case <-time.After(timeout):
		t.Fatalf("no request reached the agent in %v", timeout)
		return agentRequest{}
	}
}

// proc is a proxy under test.
type proc struct {
	cmd    *exec.Cmd
	port   int
	done   chan struct{}
	err    error
	stderr *watchedBuffer
}

// watchedBuffer collects a process's stderr and lets a test wait for text.
type watchedBuffer struct {
	mu   sync.Mutex
	buf  bytes.Buffer
	cond *sync.Cond
	eof  bool
}

func (w *watchedBuffer) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.buf.Write(p)
	w.cond.Broadcast()
	return len(p), nil
}

func (w *watchedBuffer) String() string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.buf.String()
}

// waitFor waits until the output contains s, or the process's stderr ends.
func (w *watchedBuffer) waitFor(t *testing.T, s string) {
	t.Helper()
	timer := time.AfterFunc(timeout, func() {
		w.mu.Lock()
		w.eof = true
		w.cond.Broadcast()
		w.mu.Unlock()
	})
	defer timer.Stop()
	w.mu.Lock()
	defer w.mu.Unlock()
	for !strings.Contains(w.buf.String(), s) {
		if w.eof {
			t.Fatalf("stderr does not contain %q:\n%s", s, w.buf.String())
		}
		w.cond.Wait()
	}
}

// startProxy runs a proxy and waits for the port it prints on stdout.
func startProxy(t *testing.T, env []string, path string, args ...string) *proc {
	t.Helper()
	p := &proc{cmd: exec.Command(path, args...), done: make(chan struct{}), stderr: &watchedBuffer{}}
	p.stderr.cond = sync.NewCond(&p.stderr.mu)
	p.cmd.Env = append(os.Environ(), env...)
	stdout, err := p.cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	stderr, err := p.cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := p.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	stderrDone := make(chan struct{})
	go func() {
		io.Copy(p.stderr, stderr)
		p.stderr.mu.Lock()
		p.stderr.eof = true
		p.stderr.cond.Broadcast()
		p.stderr.mu.Unlock()
		close(stderrDone)
	}()
	ports := make(chan string, 1)
	go func() {
		line, _ := bufio.NewReader(stdout).ReadString('\n')
		ports <- line
		io.Copy(io.Discard, stdout)
		<-stderrDone
		p.err = p.cmd.Wait()
		close(p.done)
	}()
	t.Cleanup(func() {
		select {
		case <-p.done:
		default:
			p.cmd.Process.Kill()
			<-p.done
		}
		if t.Failed() {
			t.Logf("%s stderr:\n%s", filepath.Base(path), p.stderr.String())
		}
	})
	select {
	case line := <-ports:
		p.port, err = strconv.Atoi(strings.TrimSpace(line))
		if err != nil {
			<-p.done
			t.Fatalf("%s printed no port (%v): %s", path, p.err, p.stderr.String())
		}
	case <-time.After(timeout):
		t.Fatalf("%s did not start in %v", path, timeout)
	}
	return p
}

// wait waits for the proxy to exit and checks it succeeded.
func (p *proc) wait(t *testing.T) {
	t.Helper()
	select {
	case <-p.done:
	case <-time.After(timeout):
		t.Fatalf("the proxy did not exit in %v", timeout)
	}
	if p.err != nil {
		t.Fatalf("proxy: %v\n%s", p.err, p.stderr.String())
	}
}

// backend is an echo server accepting one connection; with a banner it
// first sends the banner.
type backend struct {
	ln    net.Listener
	conns chan *net.TCPConn
}

func startBackend(t *testing.T, host, banner string) *backend {
	t.Helper()
	ln, err := net.Listen("tcp", net.JoinHostPort(host, "0"))
	if err != nil {
		t.Fatal(err)
	}
	b := &backend{ln: ln, conns: make(chan *net.TCPConn, 1)}
	accepted := make(chan net.Conn, 1)
	t.Cleanup(func() {
		ln.Close()
		if c := <-accepted; c != nil {
			c.Close()
		}
	})
	go func() {
		c, err := ln.Accept()
		if err != nil {
			accepted <- nil
			return
		}
		accepted <- c
		tc := c.(*net.TCPConn)
		b.conns <- tc
		tc.SetDeadline(time.Now().Add(timeout))
		if banner != "" {
			if _, err := io.WriteString(tc, banner); err != nil {
				return
			}
		}
		io.Copy(tc, tc)
		tc.CloseWrite()
	}()
	return b
}

func (b *backend) hostPort() (string, string) {
	host, port, _ := net.SplitHostPort(b.ln.Addr().String())
	return host, port
}

func (b *backend) conn(t *testing.T) *net.TCPConn {
	t.Helper()
	select {
	case c := <-b.conns:
		return c
	case <-time.After(timeout):
		t.Fatal("the proxy did not connect to the backend")
		return nil
	}
}

// addr is how libdysco writes an address: IPv4-mapped IPv6 as IPv4.
func addr(a net.Addr) string {
	ap := a.(*net.TCPAddr).AddrPort()
	return netip.AddrPortFrom(ap.Addr().Unmap(), ap.Port()).String()
}

// wantBody is the exact request body for the proxy's sockets "in" (whose
// peer is inPeer) and "out" (whose peer is outPeer), seen from the peers.
func wantBody(inPeer, outPeer *net.TCPConn, delta, deltaRev int) string {
	return fmt.Sprintf(`{"in":{"local":%q,"remote":%q},"out":{"local":%q,"remote":%q},"delta":%d,"delta_rev":%d,"wait":false}`,
		addr(inPeer.RemoteAddr()), addr(inPeer.LocalAddr()), addr(outPeer.RemoteAddr()), addr(outPeer.LocalAddr()), delta, deltaRev)
}

// checkRequest checks one request against the contract.
func checkRequest(t *testing.T, r agentRequest, body string) {
	t.Helper()
	if r.Method != "POST" || r.Path != "/v1/sessions/splice" || r.Host != "dysco-agent" ||
		r.ContentType != "application/json" || !r.Close || r.ContentLength != int64(len(r.Body)) {
		t.Errorf("request: %+v", r)
	}
	if r.Body != body {
		t.Errorf("body:\n got %s\nwant %s", r.Body, body)
	}
	// The agent decodes it as netip address-ports.
	var v struct {
		In, Out struct {
			Local, Remote netip.AddrPort
		}
		Delta    int64
		DeltaRev int64 `json:"delta_rev"`
		Wait     bool
	}
	dec := json.NewDecoder(strings.NewReader(r.Body))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&v); err != nil {
		t.Errorf("body %s: %v", r.Body, err)
	}
}

// exchange sends first through the proxy, reads its echo (the backend's
// answer, possibly changed by the proxy: want), then calls during (while the
// connection is up), then sends a larger payload, closes and checks
// everything came back byte for byte.
func exchange(t *testing.T, c *net.TCPConn, first, want []byte, during func()) {
	t.Helper()
	c.SetDeadline(time.Now().Add(timeout))
	if _, err := c.Write(first); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, len(want))
	if _, err := io.ReadFull(c, got); err != nil {
		t.Fatalf("reading the first echo: %v", err)
	}
	if !bytes.Equal(got, want) {
		t.Fatalf("first echo: got %q, want %q", trunc(got), trunc(want))
	}
	if during != nil {
		during()
	}
	payload := randomBytes(4 << 20)
	werr := make(chan error, 1)
	go func() {
		_, err := c.Write(payload)
		if err == nil {
			err = c.CloseWrite()
		}
		werr <- err
	}()
	rest, err := io.ReadAll(c)
	if err != nil {
		t.Fatalf("reading the echo: %v", err)
	}
	if err := <-werr; err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(rest, payload) {
		t.Fatalf("echo of %d bytes: got %d bytes, different", len(payload), len(rest))
	}
}

func trunc(b []byte) []byte {
	if len(b) > 64 {
		return b[:64]
	}
	return b
}

func dial(t *testing.T, host string, port int) *net.TCPConn {
	t.Helper()
	c, err := net.Dial("tcp", net.JoinHostPort(host, strconv.Itoa(port)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c.(*net.TCPConn)
}

func hasIPv6(t *testing.T) {
	ln, err := net.Listen("tcp6", "[::1]:0")
	if err != nil {
		t.Skip("no IPv6 loopback")
	}
	ln.Close()
}

func randomBytes(n int) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(rand.Uint32())
	}
	return b
}

// TestSpliceProxy runs the unmodified splice relay under LD_PRELOAD: one
// request per socket pair, with the tuples the client and the backend see
// and no delta.
func TestSpliceProxy(t *testing.T) {
	cases := []struct {
		name                      string
		listen, dialHost, backend string
		env                       []string
		banner                    bool
	}{
		{name: "ipv4", listen: "127.0.0.1", dialHost: "127.0.0.1", backend: "127.0.0.1"},
		{name: "ipv6", listen: "::1", dialHost: "::1", backend: "::1"},
		// A dual-stack listener: the accepted socket has IPv4-mapped addresses.
		{name: "mapped", listen: "::", dialHost: "127.0.0.1", backend: "127.0.0.1"},
		{name: "trigger-first", listen: "127.0.0.1", dialHost: "127.0.0.1", backend: "127.0.0.1",
			env: []string{"DYSCO_SPLICE_TRIGGER=first"}},
		// The proxy adds 10 bytes to the backend -> client stream with
		// recv and send before splicing: delta_rev 10.
		{name: "banner", listen: "127.0.0.1", dialHost: "127.0.0.1", backend: "127.0.0.1", banner: true},
		{name: "debug", listen: "127.0.0.1", dialHost: "127.0.0.1", backend: "127.0.0.1",
			env: []string{"DYSCO_DEBUG=2"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			if tc.backend == "::1" {
				hasIPv6(t)
			}
			banner := ""
			if tc.banner {
				banner = "220 backend ready\n"
			}
			agent := startAgent(t, http.StatusOK, `{"id":1}`)
			be := startBackend(t, tc.backend, banner)
			host, port := be.hostPort()
			args := []string{tc.listen, host, port}
			if tc.banner {
				args = append(args, "banner")
			}
			env := append([]string{"LD_PRELOAD=" + libPath, "DYSCO_AGENT_SOCKET=" + agent.name}, tc.env...)
			p := startProxy(t, env, spliceProxy, args...)
			c := dial(t, tc.dialHost, p.port)
			deltaRev := 0
			if tc.banner {
				want := "X-Banner: " + banner
				got := make([]byte, len(want))
				c.SetDeadline(time.Now().Add(timeout))
				if _, err := io.ReadFull(c, got); err != nil || string(got) != want {
					t.Fatalf("banner: %q, %v", got, err)
				}
				deltaRev = 10
			}
			bc := be.conn(t)
			first := randomBytes(100 << 10)
			exchange(t, c, first, first, func() {
				// The client -> backend direction is spliced first, so
				// the client's socket is "in".
				checkRequest(t, agent.next(t), wantBody(c, bc, 0, deltaRev))
			})
			p.wait(t)
			if n := agent.count(); n != 1 {
				t.Errorf("%d requests, want 1", n)
			}
			if tc.name == "debug" {
				for _, s := range []string{"libdysco[", "spliced through pipe", "the agent took the splice", ": splice 65536"} {
					if !strings.Contains(p.stderr.String(), s) {
						t.Errorf("no %q in the debug output:\n%s", s, p.stderr.String())
					}
				}
			}
		})
	}
}

// TestSpliceProxyNoAgent: nothing listens on the agent socket; the proxy
// relays all the same and says why on stderr.
func TestSpliceProxyNoAgent(t *testing.T) {
	be := startBackend(t, "127.0.0.1", "")
	host, port := be.hostPort()
	name := fmt.Sprintf("@dysco-test-%d-absent-%d", os.Getpid(), agentCount.Add(1))
	p := startProxy(t, []string{"LD_PRELOAD=" + libPath, "DYSCO_AGENT_SOCKET=" + name}, spliceProxy, "127.0.0.1", host, port)
	c := dial(t, "127.0.0.1", p.port)
	first := randomBytes(10 << 10)
	exchange(t, c, first, first, func() {
		p.stderr.waitFor(t, "libdysco[")
	})
	p.wait(t)
	if s := p.stderr.String(); !strings.Contains(s, "cannot reach the Dysco agent on "+name) ||
		!strings.Contains(s, "Connection refused") {
		t.Errorf("stderr:\n%s", s)
	}
}

// TestSpliceProxyAgentError: the agent refuses; its message is logged.
func TestSpliceProxyAgentError(t *testing.T) {
	agent := startAgent(t, http.StatusConflict, `{"error":"no session matches 127.0.0.1"}`+"\n")
	be := startBackend(t, "127.0.0.1", "")
	host, port := be.hostPort()
	p := startProxy(t, []string{"LD_PRELOAD=" + libPath, "DYSCO_AGENT_SOCKET=" + agent.name}, spliceProxy, "127.0.0.1", host, port)
	c := dial(t, "127.0.0.1", p.port)
	first := randomBytes(10 << 10)
	exchange(t, c, first, first, func() {
		p.stderr.waitFor(t, "HTTP 409: no session matches 127.0.0.1")
	})
	p.wait(t)
	if n := agent.count(); n != 1 {
		t.Errorf("%d requests, want 1", n)
	}
}

// TestSpliceProxyDisabled: DYSCO_DISABLE=1 makes the library a pass-through.
func TestSpliceProxyDisabled(t *testing.T) {
	agent := startAgent(t, http.StatusOK, `{"id":1}`)
	be := startBackend(t, "127.0.0.1", "")
	host, port := be.hostPort()
	p := startProxy(t, []string{"LD_PRELOAD=" + libPath, "DYSCO_AGENT_SOCKET=" + agent.name, "DYSCO_DISABLE=1", "DYSCO_DEBUG=1"},
		spliceProxy, "127.0.0.1", host, port)
	c := dial(t, "127.0.0.1", p.port)
	first := randomBytes(100 << 10)
	exchange(t, c, first, first, nil)
	// Queued requests are sent before the proxy exits: none may come later.
	p.wait(t)
	if n := agent.count(); n != 0 {
		t.Errorf("%d requests, want none", n)
	}
	if s := p.stderr.String(); !strings.Contains(s, "disabled (pass-through)") || strings.Contains(s, "spliced") {
		t.Errorf("stderr:\n%s", s)
	}
}

// TestLenProxy runs the proxy linked with libdysco: it changes the length of
// the client's stream and calls dysco_splice with the delta.
func TestLenProxy(t *testing.T) {
	const line = "GET /dysco HTTP/1.0\n"
	cases := []struct {
		mode   string
		banner bool
		delta  int
		want   string // what the backend gets for line
	}{
		{mode: "add", delta: 7, want: "X-Len: " + line},
		{mode: "cut", delta: -len(line), want: ""},
		// The proxy adds 10 bytes to the backend -> client stream with
		// recv and send: the library's wrappers count them (delta_rev).
		{mode: "add", banner: true, delta: 7, want: "X-Len: " + line},
	}
	for _, tc := range cases {
		name := tc.mode
		if tc.banner {
			name += "-banner"
		}
		t.Run(name, func(t *testing.T) {
			banner := ""
			args := []string{"127.0.0.1", "", "", tc.mode}
			deltaRev := 0
			if tc.banner {
				banner = "220 backend ready\n"
				args = append(args, "banner")
				deltaRev = 10
			}
			agent := startAgent(t, http.StatusOK, `{"id":7}`)
			be := startBackend(t, "127.0.0.1", banner)
			args[1], args[2] = be.hostPort()
			p := startProxy(t, []string{"DYSCO_AGENT_SOCKET=" + agent.name}, lenProxy, args...)
			c := dial(t, "127.0.0.1", p.port)
			if tc.banner {
				want := "X-Banner: " + banner
				got := make([]byte, len(want))
				c.SetDeadline(time.Now().Add(timeout))
				if _, err := io.ReadFull(c, got); err != nil || string(got) != want {
					t.Fatalf("banner: %q, %v", got, err)
				}
			}
			bc := be.conn(t)
			rest := randomBytes(50 << 10)
			first := append([]byte(line), rest...)
			want := append([]byte(tc.want), rest...)
			exchange(t, c, first, want, func() {
				checkRequest(t, agent.next(t), wantBody(c, bc, tc.delta, deltaRev))
				p.stderr.waitFor(t, "lenproxy: dysco_splice: ok")
			})
			p.wait(t)
			if n := agent.count(); n != 1 {
				t.Errorf("%d requests, want 1", n)
			}
		})
	}
}

// TestLenProxyFailures: dysco_splice fails with the documented errno, logs
// why, and the proxy goes on relaying.
func TestLenProxyFailures(t *testing.T) {
	const line = "hello\n"
	t.Run("no-agent", func(t *testing.T) {
		be := startBackend(t, "127.0.0.1", "")
		host, port := be.hostPort()
		name := fmt.Sprintf("@dysco-test-%d-absent-%d", os.Getpid(), agentCount.Add(1))
		p := startProxy(t, []string{"DYSCO_AGENT_SOCKET=" + name}, lenProxy, "127.0.0.1", host, port, "add")
		c := dial(t, "127.0.0.1", p.port)
		rest := randomBytes(1000)
		exchange(t, c, append([]byte(line), rest...), append([]byte("X-Len: "+line), rest...), nil)
		p.wait(t)
		s := p.stderr.String()
		if !strings.Contains(s, "lenproxy: dysco_splice: Connection refused") ||
			!strings.Contains(s, "libdysco[") {
			t.Errorf("stderr:\n%s", s)
		}
	})
	t.Run("agent-error", func(t *testing.T) {
		agent := startAgent(t, http.StatusBadRequest, `{"error":"bad \"delta\""}`)
		be := startBackend(t, "127.0.0.1", "")
		host, port := be.hostPort()
		p := startProxy(t, []string{"DYSCO_AGENT_SOCKET=" + agent.name}, lenProxy, "127.0.0.1", host, port, "cut")
		c := dial(t, "127.0.0.1", p.port)
		rest := randomBytes(1000)
		exchange(t, c, append([]byte(line), rest...), rest, nil)
		p.wait(t)
		s := p.stderr.String()
		if !strings.Contains(s, "lenproxy: dysco_splice: Input/output error") ||
			!strings.Contains(s, `HTTP 400: bad "delta"`) {
			t.Errorf("stderr:\n%s", s)
		}
	})
}

// TestHAProxy runs HAProxy, unmodified, in TCP mode with splicing in both
// directions, under LD_PRELOAD: the case the library is for.
func TestHAProxy(t *testing.T) {
	haproxy, err := exec.LookPath("haproxy")
	if err != nil {
		t.Skip("no haproxy")
	}
	agent := startAgent(t, http.StatusOK, `{"id":1}`)
	be := startBackend(t, "127.0.0.1", "")
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	lf, err := ln.(*net.TCPListener).File()
	if err != nil {
		t.Fatal(err)
	}
	cfg := filepath.Join(t.TempDir(), "haproxy.cfg")
	err = os.WriteFile(cfg, []byte(fmt.Sprintf(`global
	maxconn 100
defaults
	mode tcp
	timeout connect 5s
	timeout client 30s
	timeout server 30s
	option splice-request
	option splice-response
listen relay
	bind fd@3
	server backend %s
`, be.ln.Addr())), 0o644)
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(haproxy, "-db", "-f", cfg)
	cmd.Env = append(os.Environ(), "LD_PRELOAD="+libPath, "DYSCO_AGENT_SOCKET="+agent.name, "DYSCO_DEBUG=1")
	cmd.ExtraFiles = []*os.File{lf}
	stderr := &watchedBuffer{}
	stderr.cond = sync.NewCond(&stderr.mu)
	cmd.Stdout, cmd.Stderr = stderr, stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	lf.Close()
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	t.Cleanup(func() {
		cmd.Process.Kill()
		<-done
		if t.Failed() {
			t.Logf("haproxy output:\n%s", stderr.String())
		}
	})
	defer ln.Close()
	c := dial(t, "127.0.0.1", ln.Addr().(*net.TCPAddr).Port)
	bc := be.conn(t)
	first := randomBytes(1 << 20)
	exchange(t, c, first, first, func() {
		r := agent.next(t)
		// Whichever direction HAProxy splices first names "in".
		a, b := wantBody(c, bc, 0, 0), wantBody(bc, c, 0, 0)
		if r.Body != a && r.Body != b {
			t.Errorf("body:\n got %s\nwant %s\n  or %s", r.Body, a, b)
		}
		checkRequest(t, r, r.Body)
	})
	// A soft stop: HAProxy exits once the connection is over, and any
	// request still queued is sent before.
	cmd.Process.Signal(syscall.SIGUSR1)
	select {
	case err := <-done:
		done <- err
		if err != nil {
			t.Errorf("haproxy: %v", err)
		}
	case <-time.After(timeout):
		t.Fatal("haproxy did not stop")
	}
	if n := agent.count(); n != 1 {
		t.Errorf("%d requests, want 1", n)
	}
}

// TestSpliceProxyOneDirection: the proxy relays the client's direction with
// recv and send and splices only the backend's (a download through
// HAProxy). With the default trigger the library asks for the removal once
// the spliced direction moves data and the other one is drained, and then
// guards the streams: the proxy may relay what still comes, unchanged, but
// a write that changes a stream is refused.
func TestSpliceProxyOneDirection(t *testing.T) {
	setup := func(t *testing.T, mode ...string) (*fakeAgent, *proc, *net.TCPConn, *net.TCPConn) {
		agent := startAgent(t, http.StatusOK, `{"id":1}`)
		be := startBackend(t, "127.0.0.1", "")
		host, port := be.hostPort()
		p := startProxy(t, []string{"LD_PRELOAD=" + libPath, "DYSCO_AGENT_SOCKET=" + agent.name},
			spliceProxy, append([]string{"127.0.0.1", host, port}, mode...)...)
		c := dial(t, "127.0.0.1", p.port)
		return agent, p, c, be.conn(t)
	}

	// The request's bytes were relayed and nothing else waits: the first
	// spliced bytes back trigger the request, with the backend's socket
	// as "in". The client's later bytes, relayed with recv and send after
	// the request, are relayed unchanged.
	t.Run("relay", func(t *testing.T) {
		agent, p, c, bc := setup(t, "user-request")
		first := randomBytes(100 << 10)
		exchange(t, c, first, first, func() {
			checkRequest(t, agent.next(t), wantBody(bc, c, 0, 0))
		})
		p.wait(t)
		if n := agent.count(); n != 1 {
			t.Errorf("%d requests, want 1", n)
		}
		if s := p.stderr.String(); strings.Contains(s, "refused") {
			t.Errorf("stderr:\n%s", s)
		}
	})

	// The proxy changes the client's direction all along: that direction
	// is never drained, so no request is made (it is never spliced either),
	// and the streams are as the proxy makes them.
	t.Run("changing", func(t *testing.T) {
		agent, p, c, _ := setup(t, "user-request-add", "0")
		sent := letters(1 << 20)
		c.SetDeadline(time.Now().Add(timeout))
		werr := make(chan error, 1)
		go func() {
			_, err := c.Write(sent)
			if err == nil {
				err = c.CloseWrite()
			}
			werr <- err
		}()
		got, err := io.ReadAll(c)
		if err != nil {
			t.Fatal(err)
		}
		if err := <-werr; err != nil {
			t.Fatal(err)
		}
		p.wait(t)
		if plus := bytes.Count(got, []byte("+")); plus == 0 || !bytes.Equal(bytes.ReplaceAll(got, []byte("+"), nil), sent) {
			t.Fatalf("echo: %d bytes with %d '+', want the %d bytes sent with the proxy's '+' between chunks", len(got), plus, len(sent))
		}
		if n := agent.count(); n != 0 {
			t.Errorf("%d requests, want none", n)
		}
	})

	// The proxy starts changing the client's direction after the request:
	// its first such write is refused, it ends the session, and no changed
	// byte ever reaches the backend (whose echo the client reads).
	t.Run("change-after-request", func(t *testing.T) {
		const k = 100 << 10
		agent, p, c, bc := setup(t, "user-request-add", strconv.Itoa(k))
		first := letters(k)
		c.SetDeadline(time.Now().Add(timeout))
		if _, err := c.Write(first); err != nil {
			t.Fatal(err)
		}
		got := make([]byte, k)
		if _, err := io.ReadFull(c, got); err != nil || !bytes.Equal(got, first) {
			t.Fatalf("first echo: %v", err)
		}
		checkRequest(t, agent.next(t), wantBody(bc, c, 0, 0))
		if _, err := c.Write(letters(1000)); err != nil {
			t.Fatal(err)
		}
		p.stderr.waitFor(t, "refused (EPIPE)")
		rest, _ := io.ReadAll(c) // EOF or a reset once the proxy is gone
		if len(rest) != 0 {
			t.Errorf("%d more bytes came back after the refused write (%q...)", len(rest), trunc(rest))
		}
		<-p.done
		if p.err == nil || !strings.Contains(p.stderr.String(), "send: Broken pipe") {
			t.Errorf("the proxy went on after the refused write (%v):\n%s", p.err, p.stderr.String())
		}
	})
}

// letters is n random lowercase letters (no '+').
func letters(n int) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = 'a' + byte(rand.IntN(26))
	}
	return b
}

// TestAnswerCorpus runs libdysco's fuzzing harness for the agent's answers
// (libdysco/fuzz/answer_fuzz.c, fuzzed with libFuzzer by make fuzz) over
// its corpus, built with the plain driver and AddressSanitizer and
// UndefinedBehaviorSanitizer: every input that was ever interesting, or
// crashed, stays a regression test.
func TestAnswerCorpus(t *testing.T) {
	root, err := repoRoot()
	if err != nil {
		t.Fatal(err)
	}
	bin := filepath.Join(t.TempDir(), "answer-driver")
	src := filepath.Join(root, "libdysco")
	args := []string{"-O1", "-g", "-Wall", "-Wextra", "-Werror", "-fsanitize=address,undefined", "-fno-sanitize-recover=all",
		"-I", src, "-I", filepath.Join(root, "include"), "-o", bin,
		filepath.Join(src, "fuzz", "driver.c"), filepath.Join(src, "fuzz", "answer_fuzz.c"), filepath.Join(src, "answer.c")}
	if out, err := exec.Command("cc", args...).CombinedOutput(); err != nil {
		t.Fatalf("cc %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	out, err := exec.Command(bin, filepath.Join(src, "fuzz", "corpus")).CombinedOutput()
	if err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	var n int
	if _, err := fmt.Sscanf(string(out), "%d inputs", &n); err != nil || n < 10 {
		t.Fatalf("ran %q, want the corpus (10 inputs or more)", out)
	}
}
