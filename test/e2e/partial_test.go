package e2e

import (
	"context"
	"net/netip"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/dysco/dysco/internal/lab"
	"github.com/dysco/dysco/internal/testutil"
)

// TestPartialChains covers chains that do not span the whole TCP session
// (paper §2.4): an edge host starts the chain for a client that runs no
// agent, and a chain may end at a middlebox before the server. In a line
// topology the edge host and the middlebox are on the return path, as a
// gateway would be.
func TestPartialChains(t *testing.T) {
	e := newLab(t, labOpts{topology: lab.Line("client", "gw", "mb1", "server")})
	// The client runs no agent: stop it and remove its datapath.
	if err := e.lab.Agent("client").Stop(); err != nil {
		t.Logf("stop client agent: %v", err)
	}
	// Through nsenter, as the lab starts agents: under ip netns exec the
	// host's bpffs, where the pins are, is not mounted.
	ns := e.host("client").Namespace
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if out, err := exec.CommandContext(ctx, "nsenter", "--net=/run/netns/"+ns, "--",
		dyscoBin, "agent", "--reset", "--pin-dir", lab.PinDir(ns)).CombinedOutput(); err != nil {
		t.Fatalf("reset the client's datapath: %v\n%s", err, out)
	} else if !strings.Contains(string(out), "removed the pinned datapath") {
		t.Fatalf("reset the client's datapath: %s", out)
	}

	dst := e.addr("server", false)
	mb1 := e.host("mb1")
	// The chain's first hop is mb1's address on the gw side.
	mb1Addr := mb1.Ifaces[0].Addr4.Addr()
	e.policy("gw", "edge", "tcp dst port 9500", mb1Addr.String())
	e.dysco("gw", "policy", "add", "partial", "--chain", mb1Addr.String(), "--end-before-destination", "tcp dst port 9501")

	t.Run("edge starts the chain", func(t *testing.T) {
		peer := e.exchange("client", "server", dst, 9500, 4*mib)
		if client := e.addr("client", false); peer.Addr() != client {
			t.Errorf("server saw %s, want the client %s", peer, client)
		}
		if n := e.status("server").Counters["setup_end"]; n != 1 {
			t.Errorf("server ended %d chains, want 1", n)
		}
		if n := e.status("gw").Counters["setup_start"]; n < 1 {
			t.Errorf("gw started %d chains", n)
		}
	})
	t.Run("chain ends before the server", func(t *testing.T) {
		before := e.status("server").Counters["setup_end"]
		peer := e.exchange("client", "server", dst, 9501, 4*mib)
		if client := e.addr("client", false); peer.Addr() != client {
			t.Errorf("server saw %s, want the client %s", peer, client)
		}
		if n := e.status("server").Counters["setup_end"]; n != before {
			t.Errorf("the server ended a chain; the chain should have ended at mb1")
		}
		if n := e.status("mb1").Counters["setup_end"]; n < 1 {
			t.Errorf("mb1 ended %d chains, want 1", n)
		}
	})
}

// TestClassifierPrepends: a middlebox holding a session's SYN chooses the
// next middlebox through its agent's local API (paper §2.2).
func TestClassifierPrepends(t *testing.T) {
	e := newLab(t, labOpts{topology: lab.Star("client", "mb1", "mb2", "server")})
	dst := e.addr("server", false)
	e.policy("client", "c", "tcp dst port 9600", e.addr("mb1", false).String())
	// The "classifier" on mb1 holds SYNs to port 9600 until it has decided.
	hold := []string{"FORWARD", "-p", "tcp", "--syn", "--dport", "9600", "-j", "DROP"}
	e.run("mb1", append([]string{"iptables", "-I"}, hold...)...)

	ln := e.listen("server", netip.AddrPortFrom(dst, 9600))
	accepted := make(chan netip.AddrPort, 1)
	go func() {
		c, err := ln.Accept()
		if err == nil {
			accepted <- netip.MustParseAddrPort(c.RemoteAddr().String())
			c.Close()
		}
	}()
	dialed := make(chan error, 1)
	go func() {
		c, err := e.dial("client", netip.AddrPortFrom(dst, 9600), 20*time.Second)
		if err == nil {
			c.Close()
		}
		dialed <- err
	}()
	var session string
	testutil.Eventually(t, 10*time.Second, "mb1 to hold the session's SYN", func() bool {
		for _, s := range e.sessions("mb1") {
			if strings.HasSuffix(s.Session, ":9600") {
				session = s.Session
				return true
			}
		}
		return false
	})
	out := e.dysco("mb1", "prepend", session, e.addr("mb2", false).String())
	if !strings.Contains(out, e.addr("mb2", false).String()) {
		t.Fatalf("prepend: %s", out)
	}
	e.run("mb1", append([]string{"iptables", "-D"}, hold...)...)
	if err := <-dialed; err != nil {
		t.Fatalf("dial after the classifier chose mb2: %v", err)
	}
	<-accepted
	if n := e.status("mb2").Counters["setup_cont"]; n != 1 {
		t.Errorf("mb2 continued %d chains, want 1 (the classifier's choice)", n)
	}
	// Too late once the SYN has left.
	ctxOut, err := e.lab.Command(t.Context(), "mb1", dyscoBin, "prepend", session, e.addr("mb2", false).String()).CombinedOutput()
	if err == nil || !strings.Contains(string(ctxOut), "already left") {
		t.Errorf("prepend after the SYN left: %v %s", err, ctxOut)
	}
}

// TestMiddleboxTypes: a policy names a middlebox type; the client's agent
// picks its instances round robin (paper §2.2).
func TestMiddleboxTypes(t *testing.T) {
	e := newLab(t, labOpts{topology: lab.Star("client", "mb1", "mb2", "server")})
	dst := e.addr("server", false)
	e.dysco("client", "type", "add", "firewall", e.addr("mb1", false).String()+","+e.addr("mb2", false).String())
	e.policy("client", "typed", "tcp dst portrange 9800-9809", "firewall")
	for i := 0; i < 4; i++ {
		e.exchange("client", "server", dst, uint16(9800+i), 64<<10)
	}
	for _, mb := range []string{"mb1", "mb2"} {
		if n := e.status(mb).Counters["setup_cont"]; n != 2 {
			t.Errorf("%s continued %d of 4 chains, want 2 (round robin)", mb, n)
		}
	}
}

// TestLocalPolicies: the local API adds, lists and removes policies and
// types, refuses bad ones with a clear error, and a removed policy no longer
// chains new sessions.
func TestLocalPolicies(t *testing.T) {
	e := newLab(t, labOpts{topology: lab.Star("client", "mb1", "server")})
	dst := e.addr("server", false)
	mb1 := e.addr("mb1", false).String()
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"policy", "add", "bad", "--chain", mb1, "tcp dst prot 80"}, `policy "bad": filter "tcp dst prot 80"`},
		{[]string{"policy", "add", "notype", "--chain", "scrubber", "tcp"}, `middlebox type "scrubber" is not defined`},
		{[]string{"policy", "add", "ping", "--chain", mb1, "icmp"}, `policy "ping": filter "icmp" matches only icmp packets; dysco chains tcp and udp sessions`},
		{[]string{"policy", "rm", "nosuch"}, `no such local policy`},
		{[]string{"type", "rm", "nosuch"}, `no such local type`},
	} {
		out, err := e.lab.Command(t.Context(), "client", append([]string{dyscoBin}, c.args...)...).CombinedOutput()
		if err == nil || !strings.Contains(string(out), c.want) {
			t.Errorf("dysco %s: err %v, output %q, want an error saying %q", strings.Join(c.args, " "), err, out, c.want)
		}
	}
	e.dysco("client", "type", "add", "fw", mb1)
	e.policy("client", "p", "tcp dst portrange 9950-9951", "fw")
	if out := e.dysco("client", "policy", "list"); !strings.Contains(out, "tcp dst portrange 9950-9951") {
		t.Errorf("policy list:\n%s", out)
	}
	e.exchange("client", "server", dst, 9950, 64<<10)
	if n := e.status("mb1").Counters["setup_cont"]; n != 1 {
		t.Fatalf("mb1 continued %d chains, want 1", n)
	}
	e.dysco("client", "policy", "rm", "p")
	e.exchange("client", "server", dst, 9951, 64<<10)
	if n := e.status("mb1").Counters["setup_cont"]; n != 1 {
		t.Errorf("after policy rm, a new session still went through mb1")
	}
}

// TestMetrics: the agent's Prometheus endpoint reports set-ups and the
// traffic exchanged with each neighbouring hop.
func TestMetrics(t *testing.T) {
	e := newLab(t, labOpts{topology: lab.Star("client", "mb1", "server"), agentArgs: []string{"--metrics", "127.0.0.1:9017"}})
	dst := e.addr("server", false)
	mb1 := e.addr("mb1", false).String()
	e.policy("client", "m", "tcp dst port 9960", mb1)
	ln := e.listen("server", netip.AddrPortFrom(dst, 9960))
	go func() {
		c, err := ln.Accept()
		if err == nil {
			transferOnce(c, 2, 1, mib)
			defer c.Close()
		}
	}()
	c, err := e.dial("client", netip.AddrPortFrom(dst, 9960), 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if err := transferOnce(c, 1, 2, mib); err != nil {
		t.Fatal(err)
	}
	out := e.run("client", "curl", "-sS", "--max-time", "5", "http://127.0.0.1:9017/metrics")
	for _, want := range []string{
		`dysco_datapath_events_total{event="setup_start"} 1`,
		`dysco_sessions{role="start",state=`,
		`dysco_hop_bytes{direction="to",hop="` + mb1 + `"}`,
		`dysco_hop_bytes{direction="from",hop="` + mb1 + `"}`,
	} {
		if !strings.Contains(out, want) {
			t.Errorf("metrics lack %s", want)
		}
	}
}
