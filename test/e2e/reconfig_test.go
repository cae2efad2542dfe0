package e2e

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/netip"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/dysco/dysco/internal/api"
	"github.com/dysco/dysco/internal/lab"
	"github.com/dysco/dysco/internal/testutil"
)

// liveTransfer runs a paced transfer of total bytes each way between client
// and server; wait returns when both sides checked what they received.
type liveTransfer struct {
	received  atomic.Int64
	clientErr chan error
	serverErr chan error
}

func (e *env) startTransfer(client, server string, dst netip.Addr, port uint16, total, rate int64) *liveTransfer {
	e.t.Helper()
	ap := netip.AddrPortFrom(dst, port)
	return e.startTransferVia(client, server, ap, ap, total, rate)
}

// startTransferVia is startTransfer with the server listening on listen and
// the client dialling dial (a proxy in between).
func (e *env) startTransferVia(client, server string, listen, dial netip.AddrPort, total, rate int64) *liveTransfer {
	e.t.Helper()
	lt := &liveTransfer{clientErr: make(chan error, 1), serverErr: make(chan error, 1)}
	ln := e.listen(server, listen)
	go func() {
		c, err := ln.Accept()
		if err != nil {
			lt.serverErr <- err
			return
		}
		defer c.Close()
		lt.serverErr <- transfer(pacedConn{countingConn{c, &lt.received}, rate}, 2, 1, total)
	}()
	c, err := e.dial(client, dial, 10*time.Second)
	if err != nil {
		e.t.Fatal(err)
	}
	e.t.Cleanup(func() { c.Close() })
	go func() { lt.clientErr <- transfer(pacedConn{c, rate}, 1, 2, total) }()
	return lt
}

func (lt *liveTransfer) wait(t *testing.T) {
	t.Helper()
	for _, ch := range []chan error{lt.clientErr, lt.serverErr} {
		select {
		case err := <-ch:
			if err != nil {
				t.Fatal(err)
			}
		case <-time.After(3 * time.Minute):
			t.Fatal("transfer did not finish")
		}
	}
}

// reconfig runs `dysco reconfig` on host and returns its results.
func (e *env) reconfig(host, match string, to netip.Addr, chain ...netip.Addr) []api.ReconfigResult {
	e.t.Helper()
	args := []string{"reconfig", "--json", "--match", match, "--to", to.String()}
	if len(chain) > 0 {
		var hs []string
		for _, h := range chain {
			hs = append(hs, h.String())
		}
		args = append(args, "--chain", strings.Join(hs, ","))
	}
	out, err := e.lab.Command(e.t.Context(), host, append([]string{dyscoBin}, args...)...).Output()
	var rep api.ReconfigReply
	if jerr := json.Unmarshal(out, &rep); jerr != nil {
		e.t.Fatalf("%s: dysco %s: %v (%v)\n%s", host, strings.Join(args, " "), jerr, err, out)
	}
	return rep.Results
}

func rewrites(st api.Status) uint64 { return st.Counters["rewrite_in"] + st.Counters["rewrite_out"] }

// TestReconfigure changes the chain of one live session, while data flows
// in both directions (paper §3.1): mb1 replaced by mb2, mb2 deleted (the
// session goes direct), mb1 inserted again. Every byte arrives, and a
// middlebox that left the path sees none of the session's packets.
func TestReconfigure(t *testing.T) {
	for _, c := range []struct {
		name    string
		off, v6 bool
	}{{"offload", false, false}, {"tx-csum-off", true, false}, {"ipv6", false, true}} {
		t.Run(c.name, func(t *testing.T) { reconfigure(t, c.off, c.v6) })
	}
}

func reconfigure(t *testing.T, off, v6 bool) {
	e := newLab(t, labOpts{topology: lab.Star("client", "mb1", "mb2", "server")})
	if off {
		e.txOff("client", "mb1", "mb2", "server")
	}
	dst := e.addr("server", v6)
	mb1, mb2 := e.addr("mb1", v6), e.addr("mb2", v6)
	e.policy("client", "r", "tcp dst port 9300", mb1.String())

	const total = 96 * mib
	lt := e.startTransfer("client", "server", dst, 9300, total, 12*mib)
	testutil.Eventually(t, 30*time.Second, "the transfer to start", func() bool { return lt.received.Load() > 4*mib })

	step := func(what string, chain ...netip.Addr) {
		t.Helper()
		res := e.reconfig("client", "tcp port 9300", dst, chain...)
		if len(res) != 1 || res[0].Outcome != "succeeded" {
			t.Fatalf("%s: %+v", what, res)
		}
		t.Logf("%s: %.2f ms", what, float64(res[0].Micros)/1000)
		if lt.received.Load() >= total {
			t.Fatalf("%s: the transfer ended before the reconfiguration: pace it slower", what)
		}
	}
	left := func(host string) { t.Helper(); e.leftPath(host, lt) }
	carries := e.carries

	// A right anchor of the other family: refused with the reason, and
	// the session goes on through mb1.
	other := e.addr("server", !v6)
	if res := e.reconfig("client", "tcp port 9300", other, e.addr("mb2", !v6)); len(res) != 1 || res[0].Outcome != "refused" ||
		!strings.Contains(res[0].Reason, "address family") {
		t.Fatalf("right anchor %s for the session to %s: %+v", other, dst, res)
	}
	carries("mb1")

	step("replace mb1 by mb2", mb2)
	left("mb1")
	carries("mb2")
	step("delete mb2")
	left("mb2")
	step("insert mb1", mb1)
	carries("mb1")
	lt.wait(t)

	// Once the session ends, nothing of its three reconfigurations stays:
	// the collector frees the anchors' two-path records and requests with
	// the session.
	hosts := []string{"client", "mb1", "mb2", "server"}
	testutil.Eventually(t, 30*time.Second, "the session to be collected everywhere", func() bool {
		n := 0
		for _, h := range hosts {
			n += len(e.sessions(h))
		}
		return n == 0
	})
	reconfState := func() (kept []string) {
		for _, h := range hosts {
			for _, m := range []string{"dysco_tp", "dysco_tp_req"} {
				if n := e.pinnedEntries(h, m); n != 0 {
					kept = append(kept, fmt.Sprintf("%s: %d in %s", h, n, m))
				}
			}
		}
		return kept
	}
	// The same pass of the collector removes them, just after the session.
	var kept []string
	defer func() {
		if len(kept) > 0 {
			t.Logf("reconfiguration state kept after the session ended: %s", strings.Join(kept, ", "))
		}
	}()
	testutil.Eventually(t, 5*time.Second, "the session's reconfiguration state to go with it", func() bool {
		kept = reconfState()
		return len(kept) == 0
	})
}

// leftPath checks that host left the path of lt's session: it freed the
// session (FreeSession: no session and no flow left) and rewrites none of
// the packets that keep flowing.
func (e *env) leftPath(host string, lt *liveTransfer) {
	e.t.Helper()
	testutil.Eventually(e.t, 10*time.Second, host+" to leave the path", func() bool { return len(e.sessions(host)) == 0 })
	if n := e.pinnedEntries(host, "dysco_flows4") + e.pinnedEntries(host, "dysco_flows6"); n != 0 {
		e.t.Errorf("%s freed the session but kept %d flows", host, n)
	}
	before := rewrites(e.status(host))
	at := lt.received.Load()
	testutil.Eventually(e.t, 30*time.Second, "more data", func() bool { return lt.received.Load() > at+2*mib })
	if after := rewrites(e.status(host)); after != before {
		e.t.Errorf("%s still rewrites packets after leaving the path: %d -> %d", host, before, after)
	}
}

// carries waits until host rewrites the packets of a live session.
func (e *env) carries(host string) {
	e.t.Helper()
	before := rewrites(e.status(host))
	testutil.Eventually(e.t, 10*time.Second, host+" to carry the session", func() bool { return rewrites(e.status(host)) > before+100 })
}

// holdSession opens a session from client to server on port and keeps it
// open until the test ends; check sends a message each way through it.
func (e *env) holdSession(client, server string, dst netip.Addr, port uint16) (check func() error) {
	e.t.Helper()
	ln := e.listen(server, netip.AddrPortFrom(dst, port))
	accepted := make(chan net.Conn, 1)
	go func() {
		c, err := ln.Accept()
		if err != nil {
			close(accepted)
			return
		}
		accepted <- c
	}()
	c, err := e.dial(client, netip.AddrPortFrom(dst, port), 10*time.Second)
	if err != nil {
		e.t.Fatal(err)
	}
	s, ok := <-accepted
	if !ok {
		e.t.Fatal("accept failed")
	}
	e.t.Cleanup(func() { c.Close(); s.Close() })
	return func() error {
		for _, p := range [][2]net.Conn{{c, s}, {s, c}} {
			msg := []byte("ping " + p[0].LocalAddr().String())
			if _, err := p[0].Write(msg); err != nil {
				return err
			}
			buf := make([]byte, len(msg))
			p[1].SetReadDeadline(time.Now().Add(10 * time.Second))
			if _, err := io.ReadFull(p[1], buf); err != nil {
				return err
			}
			if !bytes.Equal(buf, msg) {
				return fmt.Errorf("got %q, want %q", buf, msg)
			}
		}
		return nil
	}
}

// TestReconfigureContention: two left anchors ask for overlapping segments
// of the same session at the same moment (§3.2): the client (segment
// client..server) and mb1 (segment mb1..server). Exactly one wins each
// time, the other is refused cleanly, and no lock is left behind: the
// session can be reconfigured again at once and still carries data.
//
// ipv6: the same with an IPv6 session, in fewer rounds.
func TestReconfigureContention(t *testing.T) {
	t.Run("ipv4", func(t *testing.T) { contention(t, false, 8) })
	t.Run("ipv6", func(t *testing.T) { contention(t, true, 4) })
}

func contention(t *testing.T, v6 bool, rounds int) {
	e := newLab(t, labOpts{topology: lab.Star("client", "mb1", "mb2", "server")})
	dst := e.addr("server", v6)
	mb1, mb2 := e.addr("mb1", v6), e.addr("mb2", v6)
	e.policy("client", "r", "tcp dst portrange 9500-9599", mb1.String(), mb2.String())
	ipt := "iptables"
	if v6 {
		ipt = "ip6tables"
	}

	wins := map[string]int{}
	for i := range rounds {
		port := uint16(9500 + i)
		check := e.holdSession("client", "server", dst, port)
		if err := check(); err != nil {
			t.Fatalf("session %d before: %v", i, err)
		}
		match := fmt.Sprintf("tcp port %d", port)
		// Both requests must meet: mb2 drops control messages until
		// mb1 holds one request (its right side lockPending) and has
		// queued the other.
		drop := []string{"-p", "udp", "--dport", "4790", "-j", "DROP"}
		e.run("mb2", append([]string{ipt, "-I", "INPUT"}, drop...)...)
		var wg sync.WaitGroup
		res := map[string][]api.ReconfigResult{}
		var mu sync.Mutex
		for _, h := range []string{"client", "mb1"} {
			wg.Add(1)
			go func() {
				defer wg.Done()
				r := e.reconfig(h, match, dst)
				mu.Lock()
				res[h] = r
				mu.Unlock()
			}()
		}
		testutil.Eventually(t, 20*time.Second, "both requests to meet at mb1", func() bool {
			for _, s := range e.sessions("mb1") {
				if strings.HasSuffix(s.Session, fmt.Sprintf(":%d", port)) {
					return s.Lock == "lockPending" && s.Queued == 1
				}
			}
			return false
		})
		e.run("mb2", append([]string{ipt, "-D", "INPUT"}, drop...)...)
		wg.Wait()
		won := ""
		for h, r := range res {
			if len(r) != 1 {
				t.Fatalf("round %d: %s: %d results: %+v", i, h, len(r), r)
			}
			switch r[0].Outcome {
			case "succeeded":
				if won != "" {
					t.Fatalf("round %d: both %s and %s won: %+v", i, won, h, res)
				}
				won = h
			case "refused":
			default:
				t.Fatalf("round %d: %s: %+v (want succeeded or refused)", i, h, r[0])
			}
		}
		if won == "" {
			t.Fatalf("round %d: nobody won: %+v", i, res)
		}
		loser := "mb1"
		if won == "mb1" {
			loser = "client"
		}
		t.Logf("round %d: %s won; %s refused: %s %s", i, won, loser, res[loser][0].Reason, res[loser][0].Blocker)
		wins[won]++
		// No lock left: the client reconfigures the session again at once.
		var again []api.ReconfigResult
		if won == "client" {
			again = e.reconfig("client", match, dst, mb2) // insert mb2 into the direct session
		} else {
			again = e.reconfig("client", match, dst) // delete mb1
		}
		if len(again) != 1 || again[0].Outcome != "succeeded" {
			t.Fatalf("round %d: reconfiguration after the contest: %+v", i, again)
		}
		if err := check(); err != nil {
			t.Fatalf("round %d: session after: %v", i, err)
		}
	}
	t.Logf("wins: %v", wins)
}

// TestReconfigureCancel: the new path cannot be set up (its middlebox is
// down: nothing answers at its address). The left anchor cancels (§3.6),
// the session goes on on its old path, and every lock is released: a later
// reconfiguration succeeds.
//
// ipv6: the same with an IPv6 session (the dead middlebox is an unused
// address of the server's IPv6 subnet).
func TestReconfigureCancel(t *testing.T) {
	t.Run("ipv4", func(t *testing.T) { reconfigureCancel(t, false) })
	t.Run("ipv6", func(t *testing.T) { reconfigureCancel(t, true) })
}

func reconfigureCancel(t *testing.T, v6 bool) {
	e := newLab(t, labOpts{topology: lab.Star("client", "mb1", "server")})
	dst := e.addr("server", v6)
	mb1 := e.addr("mb1", v6)
	e.policy("client", "r", "tcp dst port 9600", mb1.String())
	const total = 48 * mib
	lt := e.startTransfer("client", "server", dst, 9600, total, 3*mib)
	testutil.Eventually(t, 30*time.Second, "the transfer to start", func() bool { return lt.received.Load() > mib })
	b := dst.As16()
	b[15] = 250 // an address of the server's subnet that no host has
	dead := netip.AddrFrom16(b).Unmap()
	res := e.reconfig("client", "tcp port 9600", dst, dead)
	if len(res) != 1 || res[0].Outcome != "failed" || !strings.Contains(res[0].Reason, "new path") {
		t.Fatalf("reconfiguration through a dead middlebox: %+v (want failed: new path could not be set up)", res)
	}
	if lt.received.Load() >= total {
		t.Fatal("the transfer ended before the cancellation: pace it slower")
	}
	before := rewrites(e.status("mb1"))
	testutil.Eventually(t, 10*time.Second, "mb1 to go on carrying the session", func() bool { return rewrites(e.status("mb1")) > before+50 })
	res = e.reconfig("client", "tcp port 9600", dst)
	if len(res) != 1 || res[0].Outcome != "succeeded" {
		t.Fatalf("reconfiguration after the cancellation: %+v", res)
	}
	lt.wait(t)
}

// TestReconfigureMonitor: a tcpdump monitor is inserted into a live iperf3
// session and sees it on its session-view tap; two middleboxes are replaced
// by one, and the monitor is deleted again. iperf3 finishes without error.
//
// ipv6: the same with an IPv6 session.
func TestReconfigureMonitor(t *testing.T) {
	t.Run("ipv4", func(t *testing.T) { reconfigureMonitor(t, false) })
	t.Run("ipv6", func(t *testing.T) { reconfigureMonitor(t, true) })
}

func reconfigureMonitor(t *testing.T, v6 bool) {
	e := newLab(t, labOpts{topology: lab.Star("client", "mb1", "mb2", "mb3", "server")})
	dst := e.addr("server", v6)
	mb1, mb2, mon := e.addr("mb1", v6), e.addr("mb2", v6), e.addr("mb3", v6)
	e.policy("client", "r", "tcp dst port 5301", mb1.String(), mb2.String())
	e.iperfServer("server", 5301)
	stop := e.capture("mb3", "dysco-tap", "tcp port 5301")

	done := make(chan string, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		out, err := e.lab.Command(ctx, "client", "iperf3", "-J", "-c", dst.String(), "-p", "5301", "-t", "8").CombinedOutput()
		if err != nil {
			done <- fmt.Sprintf("iperf3: %v\n%s", err, out)
			return
		}
		done <- string(out)
	}()
	testutil.Eventually(t, 20*time.Second, "iperf3 data to flow through mb2", func() bool {
		return rewrites(e.status("mb2")) > 2000
	})
	step := func(what string, chain ...netip.Addr) {
		t.Helper()
		res := e.reconfig("client", "tcp port 5301", dst, chain...)
		if len(res) == 0 {
			t.Fatalf("%s: no session matched", what)
		}
		for _, r := range res {
			if r.Outcome != "succeeded" {
				t.Fatalf("%s: %+v", what, res)
			}
		}
		t.Logf("%s: %d sessions", what, len(res))
	}
	step("replace mb1, mb2 by the monitor", mon)
	testutil.Eventually(t, 10*time.Second, "mb1 and mb2 to leave", func() bool { return len(e.sessions("mb1"))+len(e.sessions("mb2")) == 0 })
	before := rewrites(e.status("mb3"))
	testutil.Eventually(t, 10*time.Second, "the monitor to carry the session", func() bool { return rewrites(e.status("mb3")) > before+1000 })
	step("delete the monitor")
	testutil.Eventually(t, 10*time.Second, "the monitor to leave", func() bool { return len(e.sessions("mb3")) == 0 })
	seen := stop()
	n := 0
	for _, l := range seen {
		if strings.Contains(l, dst.String()+".5301") {
			n++
		}
	}
	if n < 100 {
		t.Errorf("the monitor's tap showed %d packets of the session, want many:\n%s", n, strings.Join(head(seen, 5), "\n"))
	}
	out := <-done
	moved, ierr, err := iperfResult(out)
	if err != nil || ierr != "" || moved == 0 {
		t.Fatalf("iperf3 across the reconfigurations: %v %s\n%s", err, ierr, out)
	}
	t.Logf("iperf3 moved %.0f MB; the monitor saw %d packets", moved/1e6, n)
}

// TestReconfigureAgentRestart: an anchor's agent, or the old path's middle
// agent, restarts while the session is in its two-path phase (§3.5). The
// restarted agent resumes the reconfiguration from what the datapath kept
// (an anchor: its two-path record and the request behind it; the middle
// agent: the request it is locked for, §3.2): the old path is torn down
// with the usual FIN exchange, confirmed by the other anchor, the old
// middlebox leaves the session, every byte arrives, and the session can be
// reconfigured again (a restarted left anchor numbers its requests above
// those it used before, or the right anchor would refuse them).
//
// ipv6: the middle agent's restart with an IPv6 session (the case that
// exercises the most: its lock is established again from the datapath;
// the anchors resume from the same family-blind records).
func TestReconfigureAgentRestart(t *testing.T) {
	cases := []struct{ name, host, role string }{
		{"left-anchor", "client", "leftAnchor"},
		{"right-anchor", "server", "rightAnchor"},
		{"middle", "mb1", "middle"},
	}
	t.Run("ipv4", func(t *testing.T) {
		for _, c := range cases {
			t.Run(c.name, func(t *testing.T) { reconfigureRestart(t, c.host, c.role, false) })
		}
	})
	t.Run("ipv6", func(t *testing.T) {
		t.Run("middle", func(t *testing.T) { reconfigureRestart(t, "mb1", "middle", true) })
	})
}

func reconfigureRestart(t *testing.T, host, role string, v6 bool) {
	e := newLab(t, labOpts{topology: lab.Star("client", "mb1", "mb2", "server")})
	dst := e.addr("server", v6)
	mb1, mb2 := e.addr("mb1", v6), e.addr("mb2", v6)
	ipt := "iptables"
	if v6 {
		ipt = "ip6tables"
	}
	const port = 9310
	e.policy("client", "r", fmt.Sprintf("tcp dst port %d", port), mb1.String())
	const total = 64 * mib
	lt := e.startTransfer("client", "server", dst, port, total, 4*mib)
	testutil.Eventually(t, 30*time.Second, "the transfer to start", func() bool { return lt.received.Load() > 2*mib })

	// Hold the old path: mb1 drops the session's packets both ways, so
	// that what each end sent on it stays unacknowledged and both anchors
	// stay in their two-path phase until the hold ends.
	fwd := e.holdRule("mb1", ipt, "FORWARD", "-p", "tcp", "--dport", strconv.Itoa(port))
	rev := e.holdRule("mb1", ipt, "FORWARD", "-p", "tcp", "--sport", strconv.Itoa(port))
	release := func() { fwd.release(); rev.release() }
	testutil.Eventually(t, 10*time.Second, "mb1 to drop data of both ends", func() bool {
		return fwd.drops() > 0 && rev.drops() > 0
	})

	type outcome struct {
		res []api.ReconfigResult
		err error
	}
	first := make(chan outcome, 1)
	go func() {
		res, err := e.ctlReconfig("client", time.Minute, fmt.Sprintf("tcp port %d", port), dst, mb2)
		first <- outcome{res, err}
	}()
	stage := func(host, role string) bool {
		for _, s := range e.sessions(host) {
			if strings.HasSuffix(s.Session, fmt.Sprintf(":%d", port)) &&
				(s.Reconfig == role+":twoPath" || role == "middle" && s.Lock == "locked") {
				return true
			}
		}
		return false
	}
	inTwoPath := func() bool { return stage(host, role) }
	if role == "middle" {
		// mb1 is locked from the ackLock on; the anchors' two-path phase
		// is what the restart must fall into.
		inTwoPath = func() bool {
			return stage("client", "leftAnchor") && stage("server", "rightAnchor") && stage(host, role)
		}
	}
	testutil.Eventually(t, 30*time.Second, host+" to be in its two-path phase", inTwoPath)
	if err := e.lab.RestartAgent(host); err != nil {
		t.Fatalf("restart agent on %s: %v", host, err)
	}
	// The restarted agent took the reconfiguration up where the datapath is.
	if !stage(host, role) {
		t.Fatalf("the restarted agent on %s did not resume the two-path phase: %+v", host, e.sessions(host))
	}
	release()

	testutil.Eventually(t, 60*time.Second, "mb1 to leave the path", func() bool { return len(e.sessions("mb1")) == 0 })
	// Nothing of the request is kept anywhere: the anchors' requests went
	// with their two-path phases, mb1's kept lock with the session.
	for _, h := range []string{"client", "mb1", "server"} {
		if n := e.pinnedEntries(h, "dysco_tp_req"); n != 0 {
			t.Errorf("%s keeps %d requests (dysco_tp_req) after the reconfiguration", h, n)
		}
	}
	if host != "client" {
		// The left anchor's agent ran throughout: its request succeeds,
		// and the other anchor confirmed the old path's teardown (its FINs
		// crossed the middle agent).
		o := <-first
		if o.err != nil || len(o.res) != 1 || o.res[0].Outcome != "succeeded" || o.res[0].Reason != "" {
			t.Fatalf("reconfiguration across the restart of %s's agent: %+v %v", host, o.res, o.err)
		}
	} else {
		// The CLI's agent went away; the history of the new one has the
		// resumed request.
		var rep api.ReconfigReply
		out := e.dysco("client", "reconfig", "history", "--json")
		if err := json.Unmarshal([]byte(out), &rep); err != nil {
			t.Fatalf("history: %v\n%s", err, out)
		}
		if len(rep.Results) != 1 || rep.Results[0].Outcome != "succeeded" || rep.Results[0].Reason != "resumed after an agent restart" {
			t.Fatalf("history of the restarted left anchor: %+v", rep.Results)
		}
	}
	before := rewrites(e.status("mb1"))
	at := lt.received.Load()
	testutil.Eventually(t, 30*time.Second, "more data", func() bool { return lt.received.Load() > at+2*mib })
	if after := rewrites(e.status("mb1")); after != before {
		t.Errorf("mb1 still rewrites packets after leaving the path: %d -> %d", before, after)
	}
	if lt.received.Load() >= total {
		t.Fatal("the transfer ended before the second reconfiguration: pace it slower")
	}
	res := e.reconfig("client", fmt.Sprintf("tcp port %d", port), dst, mb1)
	if len(res) != 1 || res[0].Outcome != "succeeded" {
		t.Fatalf("a reconfiguration after the restart: %+v", res)
	}
	lt.wait(t)
}

// TestReconfigureNAT reconfigures a session through a NAT middlebox
// (MASQUERADE with random ports on mb1: the session leaves mb1 with mb1's
// address and another port, paper §2.1), where each side of mb1 has its own
// session tuple. The chain is mb1, mb2; then:
//   - a state migration that would replace the NAT is refused;
//   - mb2 takes itself out (`dysco middlebox remove`): the NAT's host, its
//     left neighbour, takes the trigger and reconfigures a side that no
//     reconfiguration has touched yet;
//   - mb1 as left anchor inserts mb2 again: mb2 sees the tuple after the
//     NAT;
//   - the client inserts mb3 before mb1 (mb1 the right anchor): mb3 sees
//     the client's tuple;
//   - mb1 takes itself out: mb3 and mb2, which see the session with
//     different tuples, meet directly;
//   - the client deletes every middlebox up to the server: the client and
//     the server meet directly, each anchor translating to its own tuple.
//
// Every byte arrives both ways, and each host that leaves the path frees
// the session with all its flows.
func TestReconfigureNAT(t *testing.T) {
	for _, v6 := range []bool{false, true} {
		t.Run(map[bool]string{false: "ipv4", true: "ipv6"}[v6], func(t *testing.T) { reconfigureNAT(t, v6) })
	}
}

func reconfigureNAT(t *testing.T, v6 bool) {
	e := newLab(t, labOpts{topology: lab.Star("client", "mb1", "mb2", "mb3", "server")})
	cli, dst := e.addr("client", v6), e.addr("server", v6)
	mb1, mb2, mb3 := e.addr("mb1", v6), e.addr("mb2", v6), e.addr("mb3", v6)
	ipt := map[bool]string{false: "iptables", true: "ip6tables"}[v6]
	e.run("mb1", ipt, "-t", "nat", "-A", "POSTROUTING", "-p", "tcp", "-j", "MASQUERADE", "--random-fully")
	e.policy("client", "nat", "tcp dst port 9310", mb1.String(), mb2.String())

	const total = 160 * mib
	lt := e.startTransfer("client", "server", dst, 9310, total, 12*mib)
	testutil.Eventually(t, 30*time.Second, "the transfer to start", func() bool { return lt.received.Load() > 4*mib })
	session := func(host string) api.Session {
		t.Helper()
		ss := e.sessions(host)
		if len(ss) != 1 {
			t.Fatalf("%s holds %d sessions, want 1: %+v", host, len(ss), ss)
		}
		return ss[0]
	}
	// in: the session as the client sent it; out: as the NAT sends it on.
	in, out := session("mb1").Session, session("server").Session
	if !strings.HasPrefix(out, addrPrefix(mb1)) {
		t.Fatalf("the server's session is %s: want it from the NAT's address %s", out, mb1)
	}
	t.Logf("the NAT sends %s on as %s", in, out)
	check := func(what string, res []api.ReconfigResult, err error) {
		t.Helper()
		if err != nil || len(res) != 1 || res[0].Outcome != "succeeded" {
			t.Fatalf("%s: %+v %v", what, res, err)
		}
		t.Logf("%s: %.2f ms", what, float64(res[0].Micros)/1000)
		if lt.received.Load() >= total {
			t.Fatalf("%s: the transfer ended before the reconfiguration: pace it slower", what)
		}
	}
	step := func(what, host string, to netip.Addr, chain ...netip.Addr) {
		t.Helper()
		check(what, e.reconfig(host, "tcp port 9310", to, chain...), nil)
	}
	removeSelf := func(what, host string) {
		t.Helper()
		out, err := e.lab.Command(t.Context(), host, dyscoBin, "middlebox", "remove", "--json").Output()
		var rep api.ReconfigReply
		if jerr := json.Unmarshal(out, &rep); jerr != nil {
			t.Fatalf("%s: dysco middlebox remove: %v %v\n%s", host, err, jerr, out)
		}
		check(what, rep.Results, err)
	}

	if s := session("mb2").Session; s != out {
		t.Errorf("mb2 sees the session as %s, want the NAT's output %s", s, out)
	}
	// A state migration cannot replace the NAT (its replacement would be
	// on the new path): refused with the reason, the session stays on mb1.
	if res := e.migrateReconfig("client", "tcp port 9310", mb2, mb3, "--migrate-state"); len(res) != 1 ||
		res[0].Outcome == "succeeded" || !strings.Contains(res[0].Reason, "translates the session's tuple") {
		t.Fatalf("migrating the NAT's state: %+v", res)
	}
	e.carries("mb1")

	removeSelf("mb2 takes itself out (the NAT's host takes the trigger)", "mb2")
	e.leftPath("mb2", lt)
	step("mb1 inserts mb2 behind the NAT", "mb1", dst, mb2)
	e.carries("mb2")
	if s := session("mb2").Session; s != out {
		t.Errorf("mb2 sees the session as %s, want the NAT's output %s", s, out)
	}
	step("the client inserts mb3 before the NAT", "client", mb1, mb3)
	e.carries("mb3")
	if s := session("mb3").Session; s != in {
		t.Errorf("mb3 sees the session as %s, want the client's tuple %s", s, in)
	}
	removeSelf("the NAT takes itself out", "mb1")
	e.leftPath("mb1", lt)
	e.carries("mb2")
	e.carries("mb3")
	step("the client deletes every middlebox", "client", dst)
	for _, h := range []string{"mb2", "mb3"} {
		e.leftPath(h, lt)
	}
	// The two ends meet: the server's left subsession comes from the
	// client, and each end keeps the tuple its socket knows.
	if c, s := session("client"), session("server"); !strings.Contains(c.Right, "-> "+addrPrefix(dst)) ||
		!strings.HasPrefix(s.Left, addrPrefix(cli)) || c.Session != in || s.Session != out {
		t.Errorf("after the deletion: client %s on %s, server %s from %s; want %s to the server, %s from the client", c.Session, c.Right, s.Session, s.Left, in, out)
	}
	lt.wait(t)

	hosts := []string{"client", "mb1", "mb2", "mb3", "server"}
	testutil.Eventually(t, 30*time.Second, "the session to be collected everywhere", func() bool {
		n := 0
		for _, h := range hosts {
			n += len(e.sessions(h))
		}
		return n == 0
	})
	testutil.Eventually(t, 5*time.Second, "the reconfiguration state to go with the session", func() bool {
		n := 0
		for _, h := range hosts {
			n += e.pinnedEntries(h, "dysco_tp") + e.pinnedEntries(h, "dysco_tp_req")
		}
		return n == 0
	})
}
