package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/vishvananda/netns"

	"github.com/dysco/dysco/internal/migrate"
	"github.com/dysco/dysco/internal/testutil"
	"github.com/dysco/dysco/internal/wire"
)

// TestParseFrameCounts checks the counting rules on hand-made frames:
// retransmissions do not count twice, the SYN orients the session.
func TestParseFrameCounts(t *testing.T) {
	tab := newTable()
	c, s := netip.MustParseAddr("10.0.0.1"), netip.MustParseAddr("10.0.0.2")
	k := migrate.ProviderSession{Src: c, Dst: s, Sport: 40000, Dport: 80, Proto: 6}
	tab.packet(reverse(k), 500, true, true, 0) // a SYN-ACK seen first: k is still the session
	tab.packet(k, 1000, false, true, 100)
	tab.packet(k, 1100, false, true, 50)
	tab.packet(k, 1000, false, true, 100) // retransmission
	tab.packet(reverse(k), 501, false, true, 30)
	got := tab.m[k]
	if got == nil || got.Fwd.Bytes != 150 || got.Fwd.Packets != 3 || got.Rev.Bytes != 30 || got.Rev.Packets != 2 || len(tab.m) != 1 {
		t.Fatalf("counters %+v (%d sessions)", got, len(tab.m))
	}
}

// The end-to-end test: two statecounter instances, each registered with
// its own stand-in agent (the migrate.Providers handler on a Unix socket);
// the first counts the first part of a session, its counters move to the
// second through the "api" plug-in, and the second's counts continue from
// them.

func runCmd(t *testing.T, args ...string) {
	t.Helper()
	if out, err := exec.Command(args[0], args[1:]...).CombinedOutput(); err != nil {
		t.Fatalf("%s: %v\n%s", strings.Join(args, " "), err, out)
	}
}

func newNS(t *testing.T, short string) string {
	var b [3]byte
	_, _ = rand.Read(b[:])
	name := "dmig-" + hex.EncodeToString(b[:]) + "-" + short
	runCmd(t, "ip", "netns", "add", name)
	t.Cleanup(func() {
		if out, err := exec.Command("ip", "netns", "del", name).CombinedOutput(); err != nil {
			t.Errorf("ip netns del %s: %v: %s", name, err, out)
		}
	})
	runCmd(t, "ip", "-n", name, "link", "set", "lo", "up")
	return name
}

// inNS runs fn on a thread in namespace ns (never unlocked: discarded).
func inNS(t *testing.T, ns string, fn func()) {
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		h, err := netns.GetFromName(ns)
		if err == nil {
			defer h.Close()
			err = netns.Set(h)
		}
		if err != nil {
			errc <- err
			return
		}
		defer func() { errc <- nil }()
		fn()
	}()
	if err := <-errc; err != nil {
		t.Fatal(err)
	}
}

// fakeAgent serves a provider registry on a Unix socket, as the agent's
// local API does at /v1/state/.
func fakeAgent(t *testing.T, socket string) *migrate.Providers {
	p := migrate.NewProviders()
	ln, err := net.Listen("unix", socket)
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewUnstartedServer(p.Handler())
	srv.Listener = ln
	srv.Start()
	t.Cleanup(srv.Close)
	return p
}

// startCounter runs the statecounter binary in namespace ns.
func startCounter(t *testing.T, bin, ns, iface, agent, socket string) {
	cmd := exec.Command("ip", "netns", "exec", ns, bin, "-iface", iface, "-agent-socket", agent, "-socket", socket)
	cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	})
}

type row struct {
	Session migrate.ProviderSession `json:"session"`
	counter
}

func counters(t *testing.T, socket string) []row {
	t.Helper()
	hc := &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "unix", socket)
	}}}
	resp, err := hc.Get("http://statecounter/v1/counters")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var rows []row
	if err := json.NewDecoder(resp.Body).Decode(&rows); err != nil {
		t.Fatal(err)
	}
	return rows
}

func find(rows []row, s migrate.ProviderSession) *row {
	for i := range rows {
		if rows[i].Session == s {
			return &rows[i]
		}
	}
	return nil
}

// exchange sends n bytes each way over the connection pair.
func exchange(t *testing.T, a, b net.Conn, ab, ba int) {
	t.Helper()
	for _, x := range []struct {
		from, to net.Conn
		n        int
	}{{a, b, ab}, {b, a, ba}} {
		go func() { _, _ = x.from.Write(make([]byte, x.n)) }()
		_ = x.to.SetReadDeadline(time.Now().Add(5 * time.Second))
		if _, err := io.ReadFull(x.to, make([]byte, x.n)); err != nil {
			t.Fatalf("reading %d bytes: %v", x.n, err)
		}
	}
}

func TestStateMovesBetweenInstances(t *testing.T) {
	testutil.RequireRoot(t, "creates network namespaces and packet sockets")
	dir := t.TempDir()
	bin := filepath.Join(dir, "statecounter")
	if out, err := exec.Command("go", "build", "-o", bin, ".").CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	cli, srv := newNS(t, "sca"), newNS(t, "scb")
	runCmd(t, "ip", "-n", cli, "link", "add", "va", "type", "veth", "peer", "name", "vb", "netns", srv)
	runCmd(t, "ip", "-n", cli, "addr", "add", "10.3.0.1/24", "dev", "va")
	runCmd(t, "ip", "-n", cli, "addr", "add", "fd03::1/64", "dev", "va", "nodad")
	runCmd(t, "ip", "-n", srv, "addr", "add", "10.3.0.2/24", "dev", "vb")
	runCmd(t, "ip", "-n", srv, "addr", "add", "fd03::2/64", "dev", "vb", "nodad")
	runCmd(t, "ip", "-n", cli, "link", "set", "va", "up")
	runCmd(t, "ip", "-n", srv, "link", "set", "vb", "up")

	agentA, agentB := fakeAgent(t, filepath.Join(dir, "agent-a.sock")), fakeAgent(t, filepath.Join(dir, "agent-b.sock"))
	sockA, sockB := filepath.Join(dir, "counter-a.sock"), filepath.Join(dir, "counter-b.sock")
	registered := func(p *migrate.Providers, sock string) func() bool {
		return func() bool {
			return slices.Contains(p.List(), migrate.ProviderInfo{Name: "statecounter", Socket: sock})
		}
	}
	// Instance A counts on the client's side of the link.
	startCounter(t, bin, cli, "va", filepath.Join(dir, "agent-a.sock"), sockA)
	testutil.Eventually(t, 10*time.Second, "instance A to register", registered(agentA, sockA))

	// One IPv4 and one IPv6 session.
	type conn struct {
		c, s net.Conn
		sess migrate.Session
	}
	var conns []conn
	for _, addr := range []string{"10.3.0.2:0", "[fd03::2]:0"} {
		var ln net.Listener
		var err error
		inNS(t, srv, func() { ln, err = net.Listen("tcp", addr) })
		if err != nil {
			t.Fatal(err)
		}
		defer ln.Close()
		var c net.Conn
		inNS(t, cli, func() { c, err = net.DialTimeout("tcp", ln.Addr().String(), 5*time.Second) })
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		s, err := ln.Accept()
		if err != nil {
			t.Fatal(err)
		}
		defer s.Close()
		la, ra := c.LocalAddr().(*net.TCPAddr).AddrPort(), c.RemoteAddr().(*net.TCPAddr).AddrPort()
		sess := migrate.Session{Tuple: wire.Tuple{Src: la.Addr().Unmap(), Dst: ra.Addr().Unmap(), SrcPort: la.Port(), DstPort: ra.Port()}, Proto: 6}
		conns = append(conns, conn{c, s, sess})
	}
	waitCounts := func(sock string, s migrate.Session, fwd, rev uint64) {
		t.Helper()
		ps := migrate.ProviderSessionOf(s)
		var last *row
		testutil.Eventually(t, 10*time.Second, fmt.Sprintf("%s to count %s: %d and %d bytes", sock, s, fwd, rev), func() bool {
			last = find(counters(t, sock), ps)
			return last != nil && last.Fwd.Bytes == fwd && last.Rev.Bytes == rev
		})
	}
	for _, x := range conns {
		exchange(t, x.c, x.s, 1000, 500)
		waitCounts(sockA, x.sess, 1000, 500)
	}

	// Instance B, on the server's side, starts only now: it saw none of it.
	startCounter(t, bin, srv, "vb", filepath.Join(dir, "agent-b.sock"), sockB)
	testutil.Eventually(t, 10*time.Second, "instance B to register", registered(agentB, sockB))
	setA, err := migrate.NewSet([]string{"api"}, migrate.Options{APIProviders: agentA})
	if err != nil {
		t.Fatal(err)
	}
	setB, _ := migrate.NewSet([]string{"api"}, migrate.Options{APIProviders: agentB})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for _, x := range conns {
		b, err := setA.Export(ctx, x.sess)
		if err != nil || b["api"] == nil {
			t.Fatalf("export %s from A: %v %v", x.sess, b, err)
		}
		if err := setB.Import(ctx, x.sess, b); err != nil {
			t.Fatalf("import %s into B: %v", x.sess, err)
		}
		if err := setA.Release(ctx, x.sess); err != nil {
			t.Fatalf("release %s on A: %v", x.sess, err)
		}
		// Gone from A (a late pure ACK may have made a new, empty entry).
		if r := find(counters(t, sockA), migrate.ProviderSessionOf(x.sess)); r != nil && r.Fwd.Bytes+r.Rev.Bytes != 0 {
			t.Errorf("A still counts %s after release: %+v", x.sess, r.counter)
		}
	}
	for _, x := range conns {
		exchange(t, x.c, x.s, 3000, 700)
		waitCounts(sockB, x.sess, 4000, 1200)
	}
}
