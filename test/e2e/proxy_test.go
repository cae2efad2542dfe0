package e2e

import (
	"bufio"
	"bytes"
	"crypto/sha256"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/dysco/dysco/internal/api"
	"github.com/dysco/dysco/internal/lab"
	"github.com/dysco/dysco/internal/testutil"
)

// haproxy starts an unmodified HAProxy in TCP mode with splicing forced on,
// under libdysco's LD_PRELOAD, relaying listen to backend, and waits until
// it listens.
func (e *env) haproxy(host string, listen, backend netip.AddrPort) {
	e.t.Helper()
	dir := e.t.TempDir()
	conf := filepath.Join(dir, "haproxy.cfg")
	cfg := fmt.Sprintf(`global
    maxconn 2000
defaults
    mode tcp
    timeout connect 5s
    timeout client 120s
    timeout server 120s
    option splice-request
    option splice-response
listen relay
    bind %s
    server backend %s
`, listen, backend)
	if err := os.WriteFile(conf, []byte(cfg), 0o644); err != nil {
		e.t.Fatal(err)
	}
	if _, err := e.lab.Start(host, "haproxy", "env", "LD_PRELOAD="+libdysco, "haproxy", "-db", "-f", conf); err != nil {
		e.t.Fatal(err)
	}
	// Not a probe connection: HAProxy would open one to the backend for it,
	// and retry it for seconds if the backend is not up yet, so that the
	// test's server could accept the probe's instead of the session's.
	e.waitListen(host, int(listen.Port()))
}

// TestProxyRemoval: an unmodified HAProxy that splices its sockets is
// removed from a live session while data flows both ways (paper §2.4,
// §4.2); the session goes on directly between client and server, every byte
// arrives, and the proxy host sees none of the session's packets afterwards.
//
// server-plain, client-plain: that host has TCP timestamps and SACK off, so
// the proxy's two sessions negotiated different options; after the removal
// one end uses options the other never agreed to (the end without them
// ignores them; the one with them gets segments without).
func TestProxyRemoval(t *testing.T) {
	for _, off := range []bool{false, true} {
		name := "offload"
		if off {
			name = "tx-csum-off"
		}
		t.Run(name, func(t *testing.T) { proxyRemoval(t, off, "", false) })
	}
	for _, h := range []string{"server", "client"} {
		t.Run(h+"-plain", func(t *testing.T) { proxyRemoval(t, false, h, false) })
	}
	t.Run("ipv6", func(t *testing.T) { proxyRemoval(t, false, "", true) })
}

func proxyRemoval(t *testing.T, off bool, plain string, v6 bool) {
	e := newLab(t, labOpts{topology: lab.Star("client", "proxy", "server")})
	if off {
		e.txOff("client", "proxy", "server")
	}
	if plain != "" {
		e.run(plain, "sysctl", "-qw", "net.ipv4.tcp_timestamps=0", "net.ipv4.tcp_sack=0")
	}
	proxy, server := e.addr("proxy", v6), e.addr("server", v6)
	// Both TCP sessions are Dysco sessions with no middlebox, so that
	// they can be reconfigured (joined) later.
	e.policy("client", "to-proxy", "tcp dst port 9400")
	e.policy("proxy", "to-server", "tcp dst port 9401")
	e.haproxy("proxy", netip.AddrPortFrom(proxy, 9400), netip.AddrPortFrom(server, 9401))

	const total = 64 * mib
	before := e.status("proxy").Counters
	lt := e.startTransferVia("client", "server", netip.AddrPortFrom(server, 9401), netip.AddrPortFrom(proxy, 9400), total, 8*mib)
	testutil.Eventually(t, 30*time.Second, "the proxy to leave the path", func() bool {
		return len(e.sessions("server")) > 0 && e.status("proxy").Counters["rewrite_in"] > before["rewrite_in"] &&
			clientGoesDirect(e, server)
	})
	if lt.received.Load() >= total {
		t.Fatal("the transfer ended before the proxy left: pace it slower")
	}
	// The old path through the proxy lingers a few seconds for late
	// packets; then the proxy's sessions are cut off (no subsessions).
	testutil.Eventually(t, 20*time.Second, "the old path through the proxy to be torn down", func() bool {
		for _, s := range e.sessions("proxy") {
			if s.Left != "" || s.Right != "" {
				return false
			}
		}
		return true
	})
	at := rewrites(e.status("proxy"))
	n := lt.received.Load()
	testutil.Eventually(t, 30*time.Second, "more data", func() bool { return lt.received.Load() > n+4*mib })
	if got := rewrites(e.status("proxy")); got != at {
		t.Errorf("the proxy host still rewrites the session's packets after leaving: %d -> %d", at, got)
	}
	lt.wait(t)
	for _, s := range e.sessions("client") {
		t.Logf("client session %s: right %s, %d/%d bytes", s.Session, s.Right, s.BytesFwd, s.BytesRev)
	}
	st := e.status("proxy")
	t.Logf("proxy: rewrite_in %d, drop_orphan %d", st.Counters["rewrite_in"], st.Counters["drop_orphan"])
}

// clientGoesDirect tells whether the client's session now has its right
// subsession to the server.
func clientGoesDirect(e *env, server netip.Addr) bool {
	to := "-> " + addrPrefix(server)
	for _, s := range e.sessions("client") {
		if strings.Contains(s.Right, to) {
			return true
		}
	}
	return false
}

// TestProxyRemovalDelta: a proxy modified for Dysco changes the length of
// the client's stream (it prefixes the first line with 7 bytes) before it
// calls dysco_splice with that delta (§4.2); after its removal every byte
// still arrives where it belongs, in both directions.
//
// restart-then-insert: after the removal the agents of both anchors
// restart, and then a middlebox is inserted into the session. The restarted
// agents learn the sides' deltas from the datapath (control.sideDelta); had
// they taken them for zero, the insertion would compose wrong deltas and the
// stream would break.
//
// proxy-restart-unlocked, proxy-restart-locked: the proxy's agent restarts
// in the middle of its removal, before the left anchor's request has
// reached it (the proxy host drops the client's control messages until
// then), or while it is locked for it (the client's messages to the server,
// those of the new path, are dropped until then). The restarted agent takes
// the joined session up from what the datapath kept (control.resumeSpliced):
// the proxy's delta, which the request gathers only after the restart in
// the first case, and the lock in the second, so that the old path's
// teardown crosses it and cuts the proxy off.
func TestProxyRemovalDelta(t *testing.T) {
	t.Run("remove", func(t *testing.T) { proxyRemovalDelta(t, "", false) })
	t.Run("remove-ipv6", func(t *testing.T) { proxyRemovalDelta(t, "", true) })
	t.Run("restart-then-insert", func(t *testing.T) { proxyRemovalDelta(t, "restart-then-insert", false) })
	t.Run("proxy-restart-unlocked", func(t *testing.T) { proxyRemovalDelta(t, "proxy-restart-unlocked", false) })
	t.Run("proxy-restart-locked", func(t *testing.T) { proxyRemovalDelta(t, "proxy-restart-locked", false) })
	t.Run("proxy-restart-locked-ipv6", func(t *testing.T) { proxyRemovalDelta(t, "proxy-restart-locked", true) })
}

func proxyRemovalDelta(t *testing.T, mode string, v6 bool) {
	restartInsert := mode == "restart-then-insert"
	bin := filepath.Join(t.TempDir(), "lenproxy")
	root, _ := filepath.Abs("../..")
	lib := filepath.Dir(libdysco)
	out, err := exec.Command("cc", "-O2", "-Wall", "-I", filepath.Join(root, "include"), "-o", bin,
		filepath.Join(root, "test/libdysco/testdata/lenproxy.c"), "-L", lib, "-ldysco", "-Wl,-rpath,"+lib).CombinedOutput()
	if err != nil {
		t.Fatalf("building lenproxy: %v\n%s", err, out)
	}
	hosts := []string{"client", "proxy", "server"}
	n := int64(24 * mib)
	if restartInsert {
		hosts = append(hosts, "mb")
		n = 64 * mib // long enough for two restarts and an insertion
	}
	e := newLab(t, labOpts{topology: lab.Star(hosts...)})
	proxy, server := e.addr("proxy", v6), e.addr("server", v6)
	e.policy("client", "to-proxy", "tcp and dst host "+proxy.String())
	e.policy("proxy", "to-server", "tcp dst port 9701")
	// The hold of a proxy restart, in place before the splice.
	var hold *ruleHold
	ipt := "iptables"
	if v6 {
		ipt = "ip6tables"
	}
	switch mode {
	case "proxy-restart-unlocked":
		hold = e.holdRule("proxy", ipt, "INPUT", "-p", "udp", "-s", e.addr("client", v6).String(), "--dport", strconv.Itoa(ctlPort))
	case "proxy-restart-locked":
		hold = e.holdRule("client", ipt, "OUTPUT", "-p", "udp", "-d", server.String(), "--dport", strconv.Itoa(ctlPort))
	}

	const rate = 6 * mib
	line := "GET /hello HTTP/1.0\n"
	ln := e.listen("server", netip.AddrPortFrom(server, 9701))
	serverErr := make(chan error, 1)
	go func() {
		c, err := ln.Accept()
		if err != nil {
			serverErr <- err
			return
		}
		defer c.Close()
		// Close only once both directions are done: the client may read
		// late (it restarts agents first), and closing with our stream
		// unsent would cut it short.
		wrote := make(chan error, 1)
		go func() {
			_, err := io.Copy(pacedConn{c, rate}, io.LimitReader(newStream(2), n))
			c.(*net.TCPConn).CloseWrite()
			wrote <- err
		}()
		defer func() { <-wrote }()
		br := bufio.NewReader(c)
		got, err := br.ReadString('\n')
		if err != nil || got != "X-Len: "+line {
			serverErr <- fmt.Errorf("first line %q (%v), want %q", got, err, "X-Len: "+line)
			return
		}
		h := sha256.New()
		if m, err := io.Copy(h, br); err != nil || m != n {
			serverErr <- fmt.Errorf("server received %d bytes after the line (%v), want %d", m, err, n)
			return
		}
		serverErr <- checkStream(h, 1, n)
	}()

	cmd := e.lab.Command(t.Context(), "proxy", bin, proxy.String(), server.String(), "9701", "add")
	stdout, _ := cmd.StdoutPipe()
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	var port uint16
	if _, err := fmt.Fscan(stdout, &port); err != nil {
		t.Fatalf("lenproxy did not say its port: %v\n%s", err, stderr.String())
	}

	c, err := e.dial("client", netip.AddrPortFrom(proxy, port), 10*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	go func() {
		pc := pacedConn{c, rate}
		pc.Write([]byte(line))
		io.Copy(pc, io.LimitReader(newStream(1), n))
		c.(*net.TCPConn).CloseWrite()
	}()
	// The client reads all along: a reconfiguration's two-path phase ends
	// only once each side's old data is acknowledged.
	h := sha256.New()
	type readResult struct {
		n   int64
		err error
	}
	read := make(chan readResult, 1)
	go func() {
		m, err := io.Copy(h, c)
		read <- readResult{m, err}
	}()
	if hold != nil {
		restartProxyMidRemoval(e, hold, mode == "proxy-restart-locked")
	}
	testutil.Eventually(t, 20*time.Second, "the proxy to leave the path", func() bool { return clientGoesDirect(e, server) })
	if hold != nil {
		// The old path's teardown crossed the restarted agent: it cut the
		// proxy off its sessions and kept nothing of the removal.
		testutil.Eventually(t, 20*time.Second, "the old path through the proxy to be torn down", func() bool {
			for _, s := range e.sessions("proxy") {
				if s.Left != "" || s.Right != "" {
					return false
				}
			}
			return true
		})
		if n := e.pinnedEntries("proxy", "dysco_tp_req"); n != 0 {
			t.Errorf("the proxy host keeps %d entries of dysco_tp_req after its removal", n)
		}
		var rep api.ReconfigReply
		out := e.dysco("client", "reconfig", "history", "--json")
		if err := json.Unmarshal([]byte(out), &rep); err != nil {
			t.Fatalf("history: %v\n%s", err, out)
		}
		// The held request itself succeeded: none failed (one that gave
		// up before the hold ended would show here; the restarted proxy's
		// second trigger may be refused as busy while it runs).
		succeeded := 0
		for _, r := range rep.Results {
			t.Logf("client's history: %s %s", r.Outcome, r.Reason)
			switch r.Outcome {
			case "succeeded":
				succeeded++
			case "refused":
			default:
				t.Errorf("a removal %s: %+v", r.Outcome, r)
			}
		}
		if succeeded != 1 {
			t.Fatalf("%d successful removals in the client's history, want 1: %+v", succeeded, rep.Results)
		}
	}
	if restartInsert {
		for _, h := range []string{"client", "server"} {
			if err := e.lab.RestartAgent(h); err != nil {
				t.Fatalf("restart agent on %s: %v", h, err)
			}
		}
		res := e.reconfig("client", "tcp and dst host "+proxy.String(), server, e.addr("mb", false))
		if len(res) != 1 || res[0].Outcome != "succeeded" {
			t.Fatalf("insert mb after the restarts: %+v", res)
		}
	}
	select {
	case r := <-read:
		if r.err != nil || r.n != n {
			t.Fatalf("client received %d bytes (%v), want %d", r.n, r.err, n)
		}
	case <-time.After(2 * time.Minute):
		t.Fatalf("the client's stream stalled (a wrong delta stalls it: the sequence numbers no longer match)")
	}
	if err := checkStream(h, 2, n); err != nil {
		t.Fatalf("client: %v", err)
	}
	if err := <-serverErr; err != nil {
		t.Fatalf("server: %v", err)
	}
	if restartInsert {
		// Data went through the inserted middlebox, not only the last acks.
		if got := rewrites(e.status("mb")); got < 1000 {
			t.Errorf("the inserted middlebox rewrote %d packets of the session", got)
		}
	}
	if !strings.Contains(stderr.String(), "dysco_splice: ok") {
		t.Errorf("lenproxy: %s", stderr.String())
	}
}

// restartProxyMidRemoval waits until the proxy's removal is held where
// hold holds it (locked: the proxy's agent locked for the request; else:
// the client's request dropped on its way to the proxy), restarts the
// proxy's agent, checks that the new agent took the joined session up as
// the old one left it, and releases the hold.
func restartProxyMidRemoval(e *env, hold *ruleHold, locked bool) {
	e.t.Helper()
	want := "unlocked"
	if locked {
		want = "locked"
	}
	joined := func() bool {
		ss := e.sessions("proxy")
		n := 0
		for _, s := range ss {
			if s.Lock == want {
				n++
			}
		}
		return n == 2 // the client's session and the server's: one joined session
	}
	requested := func() bool {
		for _, s := range e.sessions("client") {
			if strings.HasPrefix(s.Reconfig, "leftAnchor:") {
				return true
			}
		}
		return false
	}
	testutil.Eventually(e.t, 30*time.Second, "the removal to be held before the restart", func() bool {
		return hold.drops() > 0 && requested() && joined()
	})
	if err := e.lab.RestartAgent("proxy"); err != nil {
		e.t.Fatalf("restart agent on proxy: %v", err)
	}
	if !joined() {
		e.t.Fatalf("the restarted proxy agent did not take up the joined session (%s): %+v", want, e.sessions("proxy"))
	}
	hold.release()
}

// TestProxyRemovalMixedFamilies: a proxy that accepts its client over IPv6
// and reaches its server over IPv4 cannot be removed (one TCP session cannot
// change family). Its splice is refused with a clear reason, the proxy stays
// on the path, and every byte arrives both ways.
func TestProxyRemovalMixedFamilies(t *testing.T) {
	e := newLab(t, labOpts{topology: lab.Star("client", "proxy", "server")})
	proxy6, server4 := e.addr("proxy", true), e.addr("server", false)
	e.policy("client", "to-proxy", "tcp dst port 9400")
	e.policy("proxy", "to-server", "tcp dst port 9401")
	e.haproxy("proxy", netip.AddrPortFrom(proxy6, 9400), netip.AddrPortFrom(server4, 9401))

	const total = 16 * mib
	lt := e.startTransferVia("client", "server", netip.AddrPortFrom(server4, 9401), netip.AddrPortFrom(proxy6, 9400), total, 8*mib)
	lt.wait(t)
	if clientGoesDirect(e, server4) {
		t.Error("the client's session went direct to the server")
	}
	// libdysco logs the agent's answer from its own thread: wait for it
	// (the log is printed with the others if it never comes).
	hlog := filepath.Join(e.lab.RunDir(), "proxy.haproxy.log")
	testutil.Eventually(t, 10*time.Second, "libdysco to report the agent's refusal, naming the families", func() bool {
		b, _ := os.ReadFile(hlog)
		return bytes.Contains(b, []byte("the agent refused to splice")) && bytes.Contains(b, []byte("family"))
	})
}

// TestProxyRemovalOneWay: an unmodified HAProxy in TCP mode with splicing,
// under libdysco with its default settings, relays a plain download (the
// client sends a small request, which HAProxy relays with recv and send;
// the server streams 256 MiB, which HAProxy splices) and then a plain
// upload (256 MiB from the client, a short answer from the server after
// it). libdysco asks for the removal once one direction is spliced and the
// other holds nothing unrelayed (paper §4.2): the proxy leaves both
// sessions, every byte arrives (SHA-256), and the proxy host's interfaces
// carry less than a tenth of the bytes.
func TestProxyRemovalOneWay(t *testing.T) {
	e := newLab(t, labOpts{topology: lab.Star("client", "proxy", "server")})
	proxy, server := e.addr("proxy", false), e.addr("server", false)
	e.policy("client", "to-proxy", "tcp dst port 9400")
	e.policy("proxy", "to-server", "tcp dst port 9401")
	e.haproxy("proxy", netip.AddrPortFrom(proxy, 9400), netip.AddrPortFrom(server, 9401))
	ln := e.listen("server", netip.AddrPortFrom(server, 9401))

	// Paced so that the removal, tens of milliseconds on a loaded
	// machine, is a small part of the transfer.
	const total, rate = 256 * mib, 64 * mib
	const request = "GET /256M\n"
	for _, download := range []bool{true, false} {
		name := "upload"
		if download {
			name = "download"
		}
		rx0, tx0 := e.ifaceBytes("proxy")
		serverErr := serveOne(ln, func(c net.Conn) error {
			if download {
				line, err := bufio.NewReader(c).ReadString('\n')
				if err != nil || line != request {
					return fmt.Errorf("request %q: %v", line, err)
				}
				_, err = io.Copy(pacedConn{c, rate}, io.LimitReader(newStream(3), total))
				return err
			}
			if err := recvStream(c, 4, total); err != nil {
				return err
			}
			_, err := io.WriteString(c, "ok\n")
			return err
		})
		c, err := e.dial("client", netip.AddrPortFrom(proxy, 9400), 10*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		port := c.LocalAddr().(*net.TCPAddr).Port
		clientErr := make(chan error, 1)
		go func() {
			defer c.Close()
			if download {
				if _, err := io.WriteString(c, request); err != nil {
					clientErr <- err
					return
				}
				clientErr <- recvStream(c, 3, total)
				return
			}
			if _, err := io.Copy(pacedConn{c, rate}, io.LimitReader(newStream(4), total)); err != nil {
				clientErr <- err
				return
			}
			c.(*net.TCPConn).CloseWrite()
			ans, err := io.ReadAll(c)
			if err == nil && string(ans) != "ok\n" {
				err = fmt.Errorf("answer %q", ans)
			}
			clientErr <- err
		}()
		testutil.Eventually(t, time.Minute, name+": the proxy to leave the path", func() bool {
			return sessionGoesDirect(e, port, server)
		})
		for _, ch := range []<-chan error{clientErr, serverErr} {
			select {
			case err := <-ch:
				if err != nil {
					t.Fatalf("%s: %v", name, err)
				}
			case <-time.After(3 * time.Minute):
				t.Fatalf("%s: the transfer did not finish", name)
			}
		}
		rx1, tx1 := e.ifaceBytes("proxy")
		rx, tx := rx1-rx0, tx1-tx0
		t.Logf("%s: the proxy host received %.1f MiB and sent %.1f MiB of the %d MiB (%.1f %%, %.1f %%)",
			name, float64(rx)/mib, float64(tx)/mib, total/mib, 100*float64(rx)/total, 100*float64(tx)/total)
		if rx > total/10 || tx > total/10 {
			t.Errorf("%s: the proxy host carried more than a tenth of the bytes", name)
		}
	}
}

// sessionGoesDirect tells whether the client's session from local port
// port now has its right subsession to the server.
func sessionGoesDirect(e *env, port int, server netip.Addr) bool {
	from := fmt.Sprintf(":%d -> ", port)
	to := "-> " + addrPrefix(server)
	for _, s := range e.sessions("client") {
		if strings.Contains(s.Session, from) && strings.Contains(s.Right, to) {
			return true
		}
	}
	return false
}

// ifaceBytes is the bytes received and sent by the host's interfaces other
// than loopback (/proc/net/dev of its namespace).
func (e *env) ifaceBytes(host string) (rx, tx int64) {
	e.t.Helper()
	for _, line := range strings.Split(e.run(host, "cat", "/proc/net/dev"), "\n") {
		name, rest, ok := strings.Cut(line, ":")
		if !ok || strings.TrimSpace(name) == "lo" {
			continue
		}
		f := strings.Fields(rest)
		if len(f) < 9 {
			continue
		}
		r, err1 := strconv.ParseInt(f[0], 10, 64)
		s, err2 := strconv.ParseInt(f[8], 10, 64)
		if err1 != nil || err2 != nil {
			e.t.Fatalf("%s: /proc/net/dev: %q", host, line)
		}
		rx += r
		tx += s
	}
	return rx, tx
}

// recvStream reads r to its end and checks that it was the total bytes of
// the stream of seed.
func recvStream(r io.Reader, seed uint64, total int64) error {
	h := sha256.New()
	n, err := io.Copy(h, r)
	if err != nil {
		return err
	}
	if n != total {
		return fmt.Errorf("received %d bytes, want %d", n, total)
	}
	return checkStream(h, seed, total)
}

// serveOne accepts one connection on ln, runs serve on it and closes it;
// the channel gets serve's error (or Accept's).
func serveOne(ln net.Listener, serve func(net.Conn) error) <-chan error {
	done := make(chan error, 1)
	go func() {
		c, err := ln.Accept()
		if err != nil {
			done <- err
			return
		}
		defer c.Close()
		done <- serve(c)
	}()
	return done
}
