package e2e

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/dysco/dysco/internal/api"
	"github.com/dysco/dysco/internal/lab"
	"github.com/dysco/dysco/internal/testutil"
	"github.com/dysco/dysco/internal/wire"
)

// reconfigChain runs `dysco reconfig` on host with --chain given as it is
// (NF@ADDR hops) and returns its results.
func (e *env) reconfigChain(host, match, to, chain string) []api.ReconfigResult {
	e.t.Helper()
	args := []string{dyscoBin, "reconfig", "--json", "--timeout", "30s", "--match", match, "--to", to, "--chain", chain}
	out, err := e.lab.Command(e.t.Context(), host, args...).Output()
	var rep api.ReconfigReply
	if jerr := json.Unmarshal(out, &rep); jerr != nil {
		e.t.Fatalf("%s: %s: %v (%v)\n%s", host, strings.Join(args, " "), jerr, err, out)
	}
	return rep.Results
}

// nfStatus is the status of network function name at host's agent.
func (e *env) nfStatus(host, name string) api.NFStatus {
	e.t.Helper()
	for _, f := range e.status(host).NFs {
		if f.Name == name {
			return f
		}
	}
	e.t.Fatalf("%s: no network function %s in dysco status", host, name)
	return api.NFStatus{}
}

// TestNFOnDemand: network functions started on demand during a
// reconfiguration (heterogeneous-sfc-quic §IV). A live transfer's
// session is reconfigured to pass through mb1, whose agent must first
// start its network function "firewall" (an iptables firewall: FORWARD
// policy DROP, conntrack's established traffic and new connections of the
// session's port accepted). The session stays on its old path while the
// firewall starts (a second, on purpose), mb1 joins once it is ready, the
// firewall is started exactly once and its conntrack holds the session.
// Then mb1 asks to hand the session to mb2 through a function mb2 never
// gets ready: the request is cancelled with the reason, and the session
// stays on mb1. Every byte arrives, both ways.
//
// ipv6: the same with an IPv6 session (NF@ADDR with an IPv6 address) and
// an ip6tables firewall.
func TestNFOnDemand(t *testing.T) {
	t.Run("ipv4", func(t *testing.T) { nfOnDemand(t, false) })
	t.Run("ipv6", func(t *testing.T) { nfOnDemand(t, true) })
}

func nfOnDemand(t *testing.T, v6 bool) {
	dir := t.TempDir()
	starts := filepath.Join(dir, "firewall-starts")
	const port = "9700"
	ipt := "iptables"
	if v6 {
		ipt = "ip6tables"
	}
	fw := []string{
		"--nf", "firewall.start=sleep 1; " + ipt + " -P FORWARD DROP && " +
			ipt + " -A FORWARD -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT && " +
			ipt + " -A FORWARD -p tcp -m multiport --ports " + port + " -m conntrack --ctstate NEW -m comment --comment dysco-nf-firewall -j ACCEPT && " +
			"echo started >> " + starts + " && exec sleep infinity",
		"--nf", "firewall.ready=" + ipt + " -S FORWARD | grep -q dysco-nf-firewall",
		"--nf", "firewall.stop=" + ipt + " -F FORWARD; " + ipt + " -P FORWARD ACCEPT",
		"--nf", "firewall.start-timeout=10s",
	}
	broken := []string{"--nf", "broken.start=exec sleep infinity", "--nf", "broken.ready=false", "--nf", "broken.start-timeout=2s"}
	e := newLab(t, labOpts{topology: lab.Star("client", "mb1", "mb2", "server"),
		hostArgs: map[string][]string{"mb1": fw, "mb2": broken}})
	dst := e.addr("server", v6)
	mb1, mb2 := e.addr("mb1", v6), e.addr("mb2", v6)
	if st := e.nfStatus("mb1", "firewall"); st.State != "stopped" || st.Starts != 0 {
		t.Fatalf("firewall before any demand: %+v", st)
	}
	// A Dysco session straight to the server, reconfigurable later.
	e.policy("client", "r", "tcp dst port "+port)

	const total = 64 * mib
	lt := e.startTransfer("client", "server", dst, 9700, total, 4*mib)
	testutil.Eventually(t, 30*time.Second, "the transfer to start", func() bool { return lt.received.Load() > 2*mib })

	res := e.reconfigChain("client", "tcp port "+port, dst.String(), "firewall@"+mb1.String())
	if len(res) != 1 || res[0].Outcome != "succeeded" {
		t.Fatalf("insert firewall@mb1: %+v", res)
	}
	r := res[0]
	t.Logf("insert firewall@mb1: %.1f ms, of which %.1f ms waiting for the firewall to start", float64(r.Micros)/1000, float64(r.NFMicros)/1000)
	if r.NF != "firewall" || r.NFMicros < 900_000 || r.NFMicros > r.SetupMicros {
		t.Fatalf("the wait for the firewall (its start sleeps 1 s): nf %q, %d µs of a set-up of %d µs", r.NF, r.NFMicros, r.SetupMicros)
	}
	if lt.received.Load() >= total {
		t.Fatal("the transfer ended before the reconfiguration: pace it slower")
	}
	e.carries("mb1")
	st := e.nfStatus("mb1", "firewall")
	if st.State != "ready" || st.Starts != 1 || st.Sessions != 1 || st.PID == 0 || st.StartedAt.IsZero() {
		t.Fatalf("firewall at mb1: %+v", st)
	}
	if b, err := os.ReadFile(starts); err != nil || strings.Count(string(b), "started") != 1 {
		t.Fatalf("firewall start commands run: %q (%v), want one", b, err)
	}
	tuple, err := wire.ParseTuple(r.Session)
	if err != nil {
		t.Fatal(err)
	}
	testutil.Eventually(t, 10*time.Second, "mb1's conntrack to hold the session", func() bool { return e.tracked("mb1", tuple) })
	if out := e.run("mb1", ipt, "-S", "FORWARD"); !strings.Contains(out, "-P FORWARD DROP") {
		t.Fatalf("mb1's FORWARD chain:\n%s", out)
	}
	// The history shows the wait as its own phase.
	var hist api.ReconfigReply
	if err := json.Unmarshal([]byte(e.dysco("client", "reconfig", "history", "--json")), &hist); err != nil || len(hist.Results) == 0 ||
		hist.Results[len(hist.Results)-1].NF != "firewall" || hist.Results[len(hist.Results)-1].NFMicros != r.NFMicros {
		t.Fatalf("history: %+v (%v)", hist.Results, err)
	}
	if out := e.dysco("client", "reconfig", "history"); !strings.Contains(out, "/nf ") {
		t.Fatalf("history shows no network function phase:\n%s", out)
	}

	// mb1 hands the session on through a function mb2 cannot get ready:
	// cancelled, with the reason; the session stays on mb1.
	res = e.reconfigChain("mb1", "tcp port "+port, dst.String(), "broken@"+mb2.String())
	if len(res) != 1 || res[0].Outcome != "failed" ||
		!strings.Contains(res[0].Reason, "network function broken could not be started at "+mb2.String()) ||
		!strings.Contains(res[0].Reason, "not ready within 2s") {
		t.Fatalf("replace mb1 by broken@mb2: %+v", res)
	}
	t.Logf("broken@mb2: %s", res[0].Reason)
	if lt.received.Load() >= total {
		t.Fatal("the transfer ended before the cancellation: pace it slower")
	}
	e.carries("mb1")
	if n := len(e.sessions("mb2")); n != 0 {
		t.Errorf("mb2 holds %d sessions", n)
	}
	if st := e.nfStatus("mb2", "broken"); st.State != "failed" || st.Failures != 1 || st.Sessions != 0 {
		t.Errorf("broken at mb2: %+v", st)
	}
	if st := e.nfStatus("mb1", "firewall"); st.Starts != 1 || st.State != "ready" {
		t.Errorf("firewall at mb1 after the cancellation: %+v", st)
	}
	lt.wait(t)
}
