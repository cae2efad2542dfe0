package lab

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/dysco/dysco/internal/testutil"
)

// labName returns a fresh lab name: "lt" and six random digits.
func labName(t *testing.T) string {
	t.Helper()
	for range 100 {
		name := fmt.Sprintf("lt%06d", rand.IntN(1_000_000))
		if checkAbsent(name) == nil {
			return name
		}
	}
	t.Fatal("no free lab name")
	return ""
}

// up builds a lab that is torn down when the test ends, whatever happens.
func up(t *testing.T, cfg Config) *Lab {
	t.Helper()
	if cfg.Name == "" {
		cfg.Name = labName(t)
	}
	t.Cleanup(func() {
		if err := DownByName(cfg.Name); err != nil {
			t.Errorf("cleanup: %v", err)
		}
	})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	l, err := Up(ctx, cfg)
	if err != nil {
		t.Fatalf("Up: %v", err)
	}
	return l
}

// assertGone checks that nothing of the lab called name is left.
func assertGone(t *testing.T, name string) {
	t.Helper()
	out, err := exec.Command("ip", "netns", "list").CombinedOutput()
	if err != nil {
		t.Fatalf("ip netns list: %v: %s", err, out)
	}
	for _, line := range strings.Split(string(out), "\n") {
		if strings.HasPrefix(line, name+"-") {
			t.Errorf("namespace left over: %s", line)
		}
	}
	if _, err := os.Stat(RunDir(name)); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("run directory %s left over (%v)", RunDir(name), err)
	}
	if pins, _ := filepath.Glob(filepath.Join(PinRoot, name+"-*")); len(pins) > 0 {
		t.Errorf("pin directories left over: %v", pins)
	}
}

// waitExit waits for a process of ours to have exited.
func waitExit(t *testing.T, p *Proc) {
	t.Helper()
	select {
	case <-p.Done():
	case <-time.After(10 * time.Second):
		t.Errorf("%s on %s (pid %d) still running", p.Name, p.Host, p.Pid())
	}
}

var fakeAgent struct {
	once sync.Once
	dir  string
	path string
	err  error
}

// buildFakeAgent builds testdata/fakeagent once per test binary.
func buildFakeAgent(t *testing.T) string {
	t.Helper()
	fakeAgent.once.Do(func() {
		fakeAgent.dir, fakeAgent.err = os.MkdirTemp("", "dysco-lab-test-")
		if fakeAgent.err != nil {
			return
		}
		fakeAgent.path = filepath.Join(fakeAgent.dir, "fakeagent")
		out, err := exec.Command("go", "build", "-o", fakeAgent.path, "./testdata/fakeagent").CombinedOutput()
		if err != nil {
			fakeAgent.err = fmt.Errorf("building fake agent: %v: %s", err, out)
		}
	})
	if fakeAgent.err != nil {
		t.Fatal(fakeAgent.err)
	}
	return fakeAgent.path
}

func TestMain(m *testing.M) {
	code := m.Run()
	if fakeAgent.dir != "" {
		os.RemoveAll(fakeAgent.dir)
	}
	os.Exit(code)
}

// readSysctl reads a sysctl in a host's namespace.
func readSysctl(t *testing.T, l *Lab, host, key string) string {
	t.Helper()
	var val []byte
	err := l.Do(host, func() (err error) {
		val, err = os.ReadFile(filepath.Join("/proc/sys", key))
		return err
	})
	if err != nil {
		t.Fatalf("%s: %v", host, err)
	}
	return strings.TrimSpace(string(val))
}

func ping(t *testing.T, l *Lab, from string, to netip.Addr) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := l.Ping(ctx, from, to); err != nil {
		t.Error(err)
	}
}

func TestStarUpDown(t *testing.T) {
	testutil.RequireRoot(t)
	l := up(t, Config{Topology: Star("client", "mb1", "mb2", "server")})
	name := l.Name()

	out, err := exec.Command("ip", "netns", "list").Output()
	if err != nil {
		t.Fatal(err)
	}
	for _, h := range []string{"client", "mb1", "mb2", "server", "router"} {
		if !strings.Contains(string(out), name+"-"+h) {
			t.Errorf("ip netns list has no %s-%s:\n%s", name, h, out)
		}
	}
	client, server, mb1 := l.Host("client"), l.Host("server"), l.Host("mb1")
	if mb1.Addr4 != netip.MustParseAddr("10.200.2.2") || mb1.Addr6 != netip.MustParseAddr("fd00:dc:0:2::2") || mb1.Iface != "eth0" {
		t.Errorf("mb1: %s %s %s", mb1.Iface, mb1.Addr4, mb1.Addr6)
	}

	ping(t, l, "client", server.Addr4)
	ping(t, l, "client", server.Addr6)
	ping(t, l, "server", client.Addr6)
	ping(t, l, "mb2", l.Host("router").Addr4)

	// Forwarding where it belongs, and no reverse-path filtering anywhere.
	for host, want := range map[string]string{"router": "1", "mb1": "1", "mb2": "1", "client": "0", "server": "0"} {
		if got := readSysctl(t, l, host, "net/ipv4/ip_forward"); got != want {
			t.Errorf("%s: ip_forward = %s, want %s", host, got, want)
		}
		if got := readSysctl(t, l, host, "net/ipv6/conf/all/forwarding"); got != want {
			t.Errorf("%s: ipv6 forwarding = %s, want %s", host, got, want)
		}
	}
	for _, key := range []string{"all", "default", "eth0"} {
		if got := readSysctl(t, l, "mb1", "net/ipv4/conf/"+key+"/rp_filter"); got != "0" {
			t.Errorf("mb1: %s rp_filter = %s", key, got)
		}
	}
	if got := readSysctl(t, l, "router", "net/ipv4/conf/r-4/rp_filter"); got != "0" {
		t.Errorf("router: r-4 rp_filter = %s", got)
	}

	// Command runs in the host's namespace.
	addrs, err := l.Command(context.Background(), "server", "ip", "-o", "addr", "show", "dev", "eth0").CombinedOutput()
	if err != nil || !strings.Contains(string(addrs), "10.200.4.2/24") || !strings.Contains(string(addrs), "fd00:dc:0:4::2/64") {
		t.Errorf("ip addr in server: %v\n%s", err, addrs)
	}
	// Plain routing from client to server goes through the router only.
	route, err := l.Command(context.Background(), "client", "ip", "route", "get", server.Addr4.String()).CombinedOutput()
	if err != nil || !strings.Contains(string(route), "via 10.200.1.1 dev eth0") {
		t.Errorf("ip route get in client: %v\n%s", err, route)
	}
	if err := l.Command(context.Background(), "nohost", "true").Run(); err == nil || !strings.Contains(err.Error(), "no host") {
		t.Errorf("Command on an unknown host: %v", err)
	}

	// A background program, stopped by Stop; its log is in the run dir.
	p, err := l.Start("server", "echo", "sh", "-c", "echo hello from $(ip -o -4 addr show dev eth0 | cut -d' ' -f7); exec sleep 600")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := l.Start("server", "echo", "true"); err == nil {
		t.Error("Start with a name in use: no error")
	}
	testutil.Eventually(t, 10*time.Second, "the echo program's output", func() bool {
		log, _ := os.ReadFile(p.Log)
		return strings.Contains(string(log), "hello from 10.200.4.2/24")
	})
	st, err := ReadState(name)
	if err != nil || len(st.Procs) != 1 || !st.Procs[0].Alive || !st.Ready || len(st.Namespaces) != 5 {
		t.Errorf("state: %+v, %v", st, err)
	}
	if err := p.Stop(); err != nil {
		t.Error(err)
	}
	select {
	case <-p.Done():
	default:
		t.Error("Stop returned before the program exited")
	}
	// Another, left for Down to stop.
	p2, err := l.Start("client", "sleep", "sleep", "600")
	if err != nil {
		t.Fatal(err)
	}

	if err := l.Down(); err != nil {
		t.Fatalf("Down: %v", err)
	}
	waitExit(t, p2)
	assertGone(t, name)
	if err := l.Down(); err != nil {
		t.Errorf("second Down: %v", err)
	}
}

func TestLineConnectivity(t *testing.T) {
	testutil.RequireRoot(t)
	l := up(t, Config{Topology: Line(DefaultLineHosts...)})
	client, server := l.Host("client"), l.Host("server")
	if l.Host("router") != nil {
		t.Error("a line has a router")
	}
	ping(t, l, "client", server.Addr4)
	ping(t, l, "client", server.Addr6)
	ping(t, l, "server", client.Addr4)
	ping(t, l, "mb1", l.Host("mb2").Ifaces[1].Addr4.Addr())

	// TCP end to end, through both intermediate hosts.
	ln, err := l.Listen("server", "tcp", net.JoinHostPort(server.Addr4.String(), "5001"))
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		io.Copy(c, c)
	}()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	c, err := l.Dial(ctx, "client", "tcp", net.JoinHostPort(server.Addr4.String(), "5001"))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(5 * time.Second))
	msg := []byte("through the line")
	if _, err := c.Write(msg); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, len(msg))
	if _, err := io.ReadFull(c, got); err != nil || string(got) != string(msg) {
		t.Errorf("echo: %q, %v", got, err)
	}
	if tr, err := l.Command(ctx, "client", "ip", "route", "get", server.Addr4.String()).CombinedOutput(); err != nil || !strings.Contains(string(tr), "via 10.201.1.2") {
		t.Errorf("route from client: %v %s", err, tr)
	}
}

// Agents start through nsenter in their host's namespace, see the bpffs pin
// directory, get the tap only on middleboxes, and restart.
func TestAgents(t *testing.T) {
	testutil.RequireRoot(t)
	bin := buildFakeAgent(t)
	l := up(t, Config{
		Topology:    Star("client", "mb1", "server"),
		AgentBinary: bin,
		AgentArgs:   func(h *Host) []string { return []string{"--extra", "x-" + h.Name} },
	})
	if l.Agent("router") != nil {
		t.Error("the router has an agent")
	}
	readInfo := func(host string) map[string]any {
		t.Helper()
		data, err := os.ReadFile(filepath.Join(l.RunDir(), host+".ready"))
		if err != nil {
			t.Fatal(err)
		}
		var info map[string]any
		if err := json.Unmarshal(data, &info); err != nil {
			t.Fatal(err)
		}
		return info
	}
	for _, h := range l.Hosts() {
		info := readInfo(h.Name)
		var ns syscall.Stat_t
		if err := syscall.Stat(filepath.Join(netnsDir, h.Namespace), &ns); err != nil {
			t.Fatal(err)
		}
		wantTap := ""
		if h.Role == RoleMiddlebox {
			wantTap = TapName
		}
		if info["name"] != h.Name || info["netns_ino"] != float64(ns.Ino) || info["pin_dir"] != PinDir(h.Namespace) ||
			info["pin_on_bpffs"] != true || info["tap"] != wantTap || info["extra"] != "x-"+h.Name {
			t.Errorf("agent of %s saw %v", h.Name, info)
		}
	}
	st, err := ReadState(l.Name())
	if err != nil || len(st.Agents) != 3 {
		t.Fatalf("state: %+v, %v", st, err)
	}
	for _, a := range st.Agents {
		if !a.Alive || a.Pid != l.Agent(a.Host).Pid() {
			t.Errorf("agent %+v: not alive or wrong pid", a)
		}
	}

	old := l.Agent("mb1")
	if err := l.RestartAgent("mb1"); err != nil {
		t.Fatal(err)
	}
	waitExit(t, old)
	if nw := l.Agent("mb1"); nw == old || nw.Pid() == old.Pid() {
		t.Error("RestartAgent did not start a new agent")
	}
	if log, _ := os.ReadFile(old.Log); strings.Count(string(log), "ready") != 2 || !strings.Contains(string(log), "terminated") {
		t.Errorf("agent log after restart:\n%s", log)
	}
	if err := l.RestartAgent("router"); err == nil {
		t.Error("RestartAgent on the router: no error")
	}

	agents := []*Proc{l.Agent("client"), l.Agent("mb1"), l.Agent("server")}
	if err := l.Down(); err != nil {
		t.Fatal(err)
	}
	for _, p := range agents {
		waitExit(t, p)
	}
	assertGone(t, l.Name())
}

// An agent that dies before it is ready makes Up fail with its log, and
// leaves nothing behind.
func TestAgentExitsEarly(t *testing.T) {
	testutil.RequireRoot(t)
	bin := buildFakeAgent(t)
	name := labName(t)
	t.Cleanup(func() { DownByName(name) })
	_, err := Up(context.Background(), Config{
		Name:        name,
		Topology:    Star("client", "mb1", "server"),
		AgentBinary: bin,
		AgentArgs: func(h *Host) []string {
			if h.Name == "mb1" {
				return []string{"--exit-early", "cannot load datapath: boom"}
			}
			return nil
		},
	})
	if err == nil {
		t.Fatal("Up succeeded")
	}
	for _, want := range []string{"agent on mb1 exited before it was ready", "exit status 1", "cannot load datapath: boom"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not say %q", err, want)
		}
	}
	assertGone(t, name)
}

// An agent that never gets ready makes Up fail at the deadline, or when the
// context ends; either way nothing is left.
func TestAgentNeverReady(t *testing.T) {
	testutil.RequireRoot(t)
	bin := buildFakeAgent(t)
	args := func(h *Host) []string {
		if h.Name == "server" {
			return []string{"--never-ready"}
		}
		return nil
	}
	t.Run("deadline", func(t *testing.T) {
		name := labName(t)
		t.Cleanup(func() { DownByName(name) })
		_, err := Up(context.Background(), Config{
			Name: name, Topology: Star("client", "server"), AgentBinary: bin, AgentArgs: args,
			ReadyTimeout: 300 * time.Millisecond,
		})
		if err == nil || !strings.Contains(err.Error(), "agent on server") || !strings.Contains(err.Error(), "no ready file") {
			t.Errorf("Up: %v", err)
		}
		assertGone(t, name)
	})
	t.Run("context", func(t *testing.T) {
		name := labName(t)
		t.Cleanup(func() { DownByName(name) })
		ctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
		defer cancel()
		_, err := Up(ctx, Config{Name: name, Topology: Star("client", "server"), AgentBinary: bin, AgentArgs: args})
		if !errors.Is(err, context.DeadlineExceeded) {
			t.Errorf("Up: %v, want a context deadline error", err)
		}
		assertGone(t, name)
	})
}

// After a crash of the process that built a lab, DownByName removes it from
// what is on the system alone.
func TestDownByNameAfterCrash(t *testing.T) {
	testutil.RequireRoot(t)
	bin := buildFakeAgent(t)
	l := up(t, Config{Topology: Star("client", "mb1", "server"), AgentBinary: bin})
	name := l.Name()
	procs := []*Proc{l.Agent("client"), l.Agent("mb1"), l.Agent("server")}
	sleeper, err := l.Start("server", "sleep", "sleep", "600")
	if err != nil {
		t.Fatal(err)
	}
	if !pidInNetns(sleeper.Pid(), name+"-server") {
		t.Fatal("Start returned before its process was in the server's namespace")
	}
	procs = append(procs, sleeper)
	// A process started behind the lab's back.
	stray := exec.Command("ip", "netns", "exec", name+"-client", "sleep", "600")
	if err := stray.Start(); err != nil {
		t.Fatal(err)
	}
	strayDone := make(chan struct{})
	go func() { stray.Wait(); close(strayDone) }()
	// The stray runs in its namespace before the crash (Start waits for
	// its own processes): until `ip netns exec` has entered the namespace
	// it is in the root one, where no teardown looks, and if it opened the
	// namespace before the teardown deleted it it enters it afterwards, out
	// of reach (seen once in CI).
	testutil.Eventually(t, 10*time.Second, "the stray process to enter its namespace", func() bool {
		return pidInNetns(stray.Process.Pid, name+"-client")
	})
	l = nil // the crash: only the system remembers the lab

	if err := DownByName(name); err != nil {
		t.Fatalf("DownByName: %v", err)
	}
	for _, p := range procs {
		waitExit(t, p)
	}
	select {
	case <-strayDone:
	case <-time.After(10 * time.Second):
		t.Error("a process started with ip netns exec survived")
	}
	assertGone(t, name)
	if err := DownByName(name); err != nil {
		t.Errorf("second DownByName: %v", err)
	}
}

// Up refuses a name that is in use, and leaves that lab alone.
func TestUpRefusesExisting(t *testing.T) {
	testutil.RequireRoot(t)
	l := up(t, Config{Topology: Star("a", "b")})
	_, err := Up(context.Background(), Config{Name: l.Name(), Topology: Star("c")})
	if err == nil || !strings.Contains(err.Error(), "already exists") {
		t.Fatalf("second Up: %v", err)
	}
	ping(t, l, "a", l.Host("b").Addr4)
}
