package e2e

import (
	"encoding/json"
	"fmt"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/dysco/dysco/internal/lab"
	"github.com/dysco/dysco/internal/testutil"
)

// iperf runs iperf3 from client to an iperf3 server on server (forward,
// then reverse with -R) and returns the bytes each run moved. Each run has
// its own one-off server (-1), started and seen listening before the
// client starts, and gone before the next: a long-running iperf3 server
// closes and reopens its listener between tests, and a client connecting
// in that gap is refused or reset.
func (e *env) iperf(client, server string, dst netip.Addr, port int, seconds int) (fwd, rev float64) {
	e.t.Helper()
	get := func(run int, args ...string) float64 {
		p := e.iperfServerOnce(server, port, fmt.Sprintf("iperf3-%d-%d", port, run))
		out := e.run(client, append([]string{"iperf3", "-J", "-c", dst.String(), "-p", fmt.Sprint(port), "-t", fmt.Sprint(seconds)}, args...)...)
		bytes, ierr, err := iperfResult(out)
		if err != nil || ierr != "" {
			e.t.Fatalf("iperf3 %v: %v %s", args, err, ierr)
		}
		select {
		case <-p.Done():
		case <-time.After(30 * time.Second):
			e.t.Fatalf("the one-off iperf3 server of run %d did not exit after its test", run)
		}
		return bytes
	}
	return get(1), get(2, "-R")
}

// iperfResult reads an iperf3 -J report: the bytes received, and iperf3's
// own error.
func iperfResult(out string) (bytes float64, ierr string, err error) {
	var r struct {
		End struct {
			SumReceived struct {
				Bytes float64 `json:"bytes"`
			} `json:"sum_received"`
		} `json:"end"`
		Error string `json:"error"`
	}
	err = json.Unmarshal([]byte(out), &r)
	return r.End.SumReceived.Bytes, r.Error, err
}

// iperfServerOnce starts a one-off iperf3 server (it serves one test and
// exits) and returns once it listens.
func (e *env) iperfServerOnce(host string, port int, name string) *lab.Proc {
	e.t.Helper()
	p, err := e.lab.Start(host, name, "iperf3", "-s", "-1", "-p", fmt.Sprint(port))
	if err != nil {
		e.t.Fatal(err)
	}
	e.waitListen(host, port)
	return p
}

func (e *env) iperfServer(host string, port int) {
	e.t.Helper()
	if _, err := e.lab.Start(host, fmt.Sprintf("iperf3-%d", port), "iperf3", "-s", "-p", fmt.Sprint(port)); err != nil {
		e.t.Fatal(err)
	}
	e.waitListen(host, port)
}

// waitListen waits until a TCP listener on port is up on host (on any of
// its addresses): a ready signal that, unlike a probe connection, makes the
// listener do nothing.
func (e *env) waitListen(host string, port int) {
	e.t.Helper()
	testutil.Eventually(e.t, 10*time.Second, fmt.Sprintf("a listener on port %d of %s", port, host), func() bool {
		return strings.TrimSpace(e.run(host, "ss", "-Hltn", fmt.Sprintf("sport = :%d", port))) != ""
	})
}

// TestChainFourMiddleboxes sends sessions through four unmodified
// middleboxes: a stateful iptables firewall whose FORWARD policy is DROP (its
// conntrack must hold the session tuple), a tcpdump monitor on the
// session-view tap, a NAT (MASQUERADE: the tuple changes inside the chain,
// paper §2.1 tags), and a plain forwarder.
func TestChainFourMiddleboxes(t *testing.T) {
	for _, v6 := range []bool{false, true} {
		for _, off := range []bool{false, true} {
			chainFour(t, v6, off)
		}
	}
}

func chainFour(t *testing.T, v6, off bool) {
	ipt := "iptables"
	if v6 {
		ipt = "ip6tables"
	}
	t.Run(fmt.Sprintf("ipv6=%v/txcsum-off=%v", v6, off), func(t *testing.T) {
		e := newLab(t, labOpts{topology: lab.Star("client", "mb1", "mb2", "mb3", "mb4", "server")})
		if off {
			e.txOff("client", "mb1", "mb2", "mb3", "mb4", "server")
		}
		dst := e.addr("server", v6)
		// mb1: stateful firewall, default DROP.
		for _, r := range [][]string{
			{"-P", "FORWARD", "DROP"},
			{"-A", "FORWARD", "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT"},
			{"-A", "FORWARD", "-p", "tcp", "--syn", "-d", dst.String(), "-m", "multiport", "--dports", "9000,5201", "-m", "conntrack", "--ctstate", "NEW", "-j", "ACCEPT"},
		} {
			e.run("mb1", append([]string{ipt}, r...)...)
		}
		// mb3: NAT.
		e.run("mb3", ipt, "-t", "nat", "-A", "POSTROUTING", "-p", "tcp", "-j", "MASQUERADE")

		var chain []string
		for _, m := range []string{"mb1", "mb2", "mb3", "mb4"} {
			chain = append(chain, e.addr(m, v6).String())
		}
		e.policy("client", "four", "tcp and (dst port 9000 or dst port 5201 or dst port 80)", chain...)
		dir := t.TempDir()
		e.nginx("server", dir)
		want := randomFile(t, dir+"/www/blob", transferSize())
		e.run("mb1", ipt, "-I", "FORWARD", "2", "-p", "tcp", "--syn", "-d", dst.String(), "--dport", "80", "-m", "conntrack", "--ctstate", "NEW", "-j", "ACCEPT")
		if got := e.curlHash("client", urlFor(dst, "/blob")); got != want {
			t.Fatalf("curl through four middleboxes: sha256 %s, want %s", got, want)
		}

		tap := e.capture("mb2", "dysco-tap", "tcp port 9000")
		peer := e.exchange("client", "server", dst, 9000, transferSize())
		lines := tap()

		client := e.addr("client", v6).String()
		if !anyLine(lines, client+".", dst.String()+".9000") {
			t.Errorf("monitor on mb2's tap did not see the session tuple; saw:\n%s", strings.Join(head(lines, 5), "\n"))
		}
		// The firewall's conntrack holds the session tuple.
		family := "ipv4"
		if v6 {
			family = "ipv6"
		}
		ct := e.run("mb1", "conntrack", "-L", "-f", family, "-p", "tcp", "--dport", "9000")
		if !strings.Contains(ct, "src="+client) || !strings.Contains(ct, "dst="+dst.String()) {
			t.Errorf("mb1 conntrack has no entry for the session:\n%s", ct)
		}
		// The NAT changed the tuple inside the chain: the server's
		// socket sees mb3's address.
		if mb3 := e.addr("mb3", v6); peer.Addr() != mb3 {
			t.Errorf("the server saw the session from %s, want the NAT's address %s", peer, mb3)
		}

		fwd, rev := e.iperf("client", "server", dst, 5201, 2)
		if fwd <= 0 || rev <= 0 {
			t.Errorf("iperf3 moved %v bytes forward and %v in reverse", fwd, rev)
		}
		for _, h := range []string{"mb1", "mb2", "mb3", "mb4"} {
			if n := e.status(h).Counters["setup_cont"]; n < 3 {
				t.Errorf("%s continued %d chains, want at least 3", h, n)
			}
		}
		for _, h := range []string{"client", "mb1", "mb2", "mb3", "mb4", "server"} {
			testutil.Eventually(t, 20*time.Second, "sessions on "+h+" to be collected", func() bool { return len(e.sessions(h)) == 0 })
		}
	})
}

func anyLine(lines []string, subs ...string) bool {
	for _, l := range lines {
		ok := true
		for _, s := range subs {
			if !strings.Contains(l, s) {
				ok = false
				break
			}
		}
		if ok {
			return true
		}
	}
	return false
}
