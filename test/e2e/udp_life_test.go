package e2e

import (
	"fmt"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/dysco/dysco/internal/lab"
	"github.com/dysco/dysco/internal/testutil"
)

// TestUDPLifetime: UDP sessions end after their policy's idle time on
// every host of the chain, the start first, and the same tuple then sets
// up a new chain; a session that a middlebox host has forgotten (its
// agent's shorter timeouts) is refused visibly, never sent around it; a
// session map that is full refuses new UDP sessions, counted, and never
// lets their datagrams go around the middlebox.
func TestUDPLifetime(t *testing.T) {
	testutil.RequireTools(t, "dnsmasq", "dig", "tcpdump")
	const maxSessions = 64
	const otherPort = 5353 // sessions of no set idle time: each agent's own
	e := newLab(t, labOpts{topology: lab.Star("client", "mb1", "server"), prefix: "ul",
		agentArgs: []string{"--max-sessions", fmt.Sprint(maxSessions)},
		hostArgs:  map[string][]string{"mb1": {"--udp-timeout", "1s", "--udp-stream-timeout", "1s"}}})
	srv, mb1 := e.addr("server", false), e.addr("mb1", false)
	if _, err := e.lab.Start("server", "dnsmasq", "dnsmasq", "--conf-file=/dev/null", "--keep-in-foreground",
		"--no-resolv", "--no-hosts", "--user=root", "--bind-interfaces", "--log-facility=-",
		"--listen-address="+srv.String(), fmt.Sprintf("--port=%d", dnsPort), "--address=/x.lab/10.9.9.9", "--cache-size=0"); err != nil {
		t.Fatal(err)
	}
	if _, err := e.lab.Start("server", "dnsmasq2", "dnsmasq", "--conf-file=/dev/null", "--keep-in-foreground",
		"--no-resolv", "--no-hosts", "--user=root", "--bind-interfaces", "--log-facility=-", "--pid-file="+filepath.Join(t.TempDir(), "dnsmasq2.pid"),
		"--listen-address="+srv.String(), fmt.Sprintf("--port=%d", otherPort), "--address=/x.lab/10.9.9.9", "--cache-size=0"); err != nil {
		t.Fatal(err)
	}
	e.waitListenUDP("server", dnsPort, 1)
	e.waitListenUDP("server", otherPort, 1)
	e.dysco("client", "policy", "add", "dns", "--idle", "2s", "--chain", mb1.String(), fmt.Sprintf("udp dst port %d", dnsPort))
	e.dysco("client", "policy", "add", "dns-other", "--chain", mb1.String(), fmt.Sprintf("udp dst port %d", otherPort))
	queryTo := func(dport, port int) string {
		out, _ := e.lab.Command(t.Context(), "client", "dig", "@"+srv.String(), "-p", fmt.Sprint(dport), "-b",
			fmt.Sprintf("%s#%d", e.addr("client", false), port), "+short", "+tries=1", "+time=1", "q.x.lab", "A").CombinedOutput()
		return strings.TrimSpace(string(out))
	}
	query := func(port int) string { return queryTo(dnsPort, port) }
	udpSessions := func(host string) int {
		n := 0
		for _, s := range e.sessions(host) {
			if s.Proto == "udp" {
				n++
			}
		}
		return n
	}

	t.Run("idle", func(t *testing.T) {
		e := e.withT(t)
		start := e.status("client").Counters["setup_start"]
		if out := query(30001); out != "10.9.9.9" {
			t.Fatalf("query: %q", out)
		}
		for _, h := range []string{"client", "mb1", "server"} {
			if n := udpSessions(h); n != 1 {
				t.Fatalf("%s holds %d UDP sessions after one query, want 1", h, n)
			}
		}
		// The start forgets first (2 s of idle, collected within a
		// second), the others 5 s later.
		began := time.Now()
		testutil.Eventually(t, 10*time.Second, "the client to end the idle session", func() bool { return udpSessions("client") == 0 })
		atStart := time.Since(began)
		if n := udpSessions("mb1"); n != 1 {
			t.Errorf("mb1 ended the session with the client (%d left): it must keep it longer", n)
		}
		testutil.Eventually(t, 15*time.Second, "mb1 and the server to end the session", func() bool {
			return udpSessions("mb1") == 0 && udpSessions("server") == 0
		})
		t.Logf("ended after %v at the client, %v everywhere", atStart.Round(100*time.Millisecond), time.Since(began).Round(100*time.Millisecond))
		// The same tuple again: a new chain.
		if out := query(30001); out != "10.9.9.9" {
			t.Fatalf("query after the session ended: %q", out)
		}
		if d := e.status("client").Counters["setup_start"] - start; d != 2 {
			t.Errorf("the client started %d chains for the tuple, want 2 (one per session)", d)
		}
	})

	t.Run("forgotten at a middlebox", func(t *testing.T) {
		e := e.withT(t)
		if out := queryTo(otherPort, 30002); out != "10.9.9.9" {
			t.Fatalf("query: %q", out)
		}
		// mb1 forgets it after 1 s (+5 s after the start's time); the
		// client keeps it for its 120 s.
		testutil.Eventually(t, 15*time.Second, "mb1 to end the session", func() bool { return udpSessions("mb1") == 0 })
		if n := udpSessions("client"); n != 1 {
			t.Fatalf("the client holds %d UDP sessions, want the one mb1 forgot", n)
		}
		stop := e.capture("server", e.host("server").Iface, fmt.Sprintf("udp port %d", otherPort))
		out := queryTo(otherPort, 30002)
		if lines := stop(); len(lines) > 0 && lines[0] != "" {
			t.Errorf("%d datagrams of the forgotten session reached the server:\n%s", len(lines), strings.Join(lines, "\n"))
		}
		if !strings.Contains(out, "connection refused") {
			t.Errorf("a datagram of a session mb1 forgot: want the client's socket refused (ICMP port unreachable from mb1), got %q", out)
		}
	})

	t.Run("full map", func(t *testing.T) {
		e := e.withT(t)
		// Nothing reaches the server from the client's own address: every
		// datagram of a chained session arrives from mb1's subsession.
		stop := e.capture("server", e.host("server").Iface, fmt.Sprintf("udp and src host %s", e.addr("client", false)))
		before := e.status("mb1").Counters
		answered := 0
		const n = maxSessions + 16
		for i := range n {
			if query(31000+i) == "10.9.9.9" {
				answered++
			}
		}
		after := e.status("mb1").Counters
		full := after["drop_sessions_full"] - before["drop_sessions_full"] + e.status("client").Counters["drop_sessions_full"]
		if lines := stop(); len(lines) > 0 && lines[0] != "" {
			t.Errorf("%d datagrams reached the server around mb1:\n%s", len(lines), strings.Join(lines[:min(5, len(lines))], "\n"))
		}
		t.Logf("%d of %d queries answered with room for %d sessions; %d refused for a full map", answered, n, maxSessions, full)
		if answered >= n || full == 0 {
			t.Errorf("a full session map must refuse sessions, counted: %d answered, drop_sessions_full %d", answered, full)
		}
		if answered == 0 {
			t.Error("no query was answered")
		}
	})
}
