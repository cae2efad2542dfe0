package e2e

import (
	"encoding/json"
	"fmt"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/dysco/dysco/internal/api"
	"github.com/dysco/dysco/internal/lab"
	"github.com/dysco/dysco/internal/testutil"
)

// TestReconfigureLine reconfigures live sessions in a line topology (paper
// Fig. 1: client — mb1 — mb2 — server), where each middlebox host has two
// addresses, one per link, and the direct path between client and server
// crosses both middlebox hosts as routers. A middlebox deleted and then
// inserted again, a middlebox host as left anchor, and a middlebox
// removing itself all succeed, data flowing both ways: the new subsessions
// leave each host from the address its route to the next hop chooses,
// which the next hop checks; a host that only routes a session's set-up
// packet on does not take it for itself; and a middlebox that joined a new
// path knows the session's window scales when it anchors the next
// reconfiguration.
func TestReconfigureLine(t *testing.T) {
	e := newLab(t, labOpts{topology: lab.Line("client", "mb1", "mb2", "server"), prefix: "ln"})
	for _, v6 := range []bool{false, true} {
		t.Run(fmt.Sprintf("tcp/ipv6=%v", v6), func(t *testing.T) { reconfigureLineTCP(e.withT(t), v6) })
	}
	t.Run("udp", func(t *testing.T) { reconfigureLineUDP(e.withT(t)) })
}

func reconfigureLineTCP(e *env, v6 bool) {
	t := e.t
	dst, mb1, mb2 := e.addr("server", v6), e.addr("mb1", v6), e.addr("mb2", v6)
	port := uint16(9400)
	if v6 {
		port++
	}
	match := fmt.Sprintf("tcp port %d", port)
	e.policy("client", fmt.Sprintf("line%d", port), fmt.Sprintf("tcp dst port %d", port), mb1.String(), mb2.String())

	const total = 64 * mib
	lt := e.startTransfer("client", "server", dst, port, total, 8*mib)
	testutil.Eventually(t, 30*time.Second, "the transfer to start", func() bool { return lt.received.Load() > 2*mib })
	e.carries("mb1")
	e.carries("mb2")

	step := func(what, host string, chain ...netip.Addr) {
		t.Helper()
		res := e.reconfig(host, match, dst, chain...)
		if len(res) != 1 || res[0].Outcome != "succeeded" || res[0].Reason != "" {
			t.Fatalf("%s: %+v", what, res)
		}
		if lt.received.Load() >= total {
			t.Fatalf("%s: the transfer ended before the reconfiguration: pace it slower", what)
		}
	}
	step("delete mb1 and mb2", "client")
	e.leftPath("mb1", lt)
	e.leftPath("mb2", lt)
	step("insert mb1 again", "client", mb1)
	e.carries("mb1")
	// mb1's new subsession to mb2 leaves from its second address.
	step("insert mb2 from mb1", "mb1", mb2)
	e.carries("mb2")

	out, err := e.lab.Command(t.Context(), "mb2", dyscoBin, "middlebox", "remove", "--json", "--match", match).Output()
	var rep api.ReconfigReply
	if jerr := json.Unmarshal(out, &rep); jerr != nil || len(rep.Results) != 1 || rep.Results[0].Outcome != "succeeded" {
		t.Fatalf("mb2 removing itself: %v %v\n%s", err, jerr, out)
	}
	e.leftPath("mb2", lt)

	// A request that names an address of its own host as a hop is
	// refused with the reason (mb1's other address, not the one agents
	// name it by).
	var other netip.Addr
	for _, ifc := range e.host("mb1").Ifaces {
		a := ifc.Addr4.Addr()
		if v6 {
			a = ifc.Addr6.Addr()
		}
		if a != mb1 {
			other = a
		}
	}
	if !other.IsValid() {
		t.Fatalf("mb1 has no second address: %+v", e.host("mb1").Ifaces)
	}
	msg, err := e.lab.Command(t.Context(), "mb1", dyscoBin, "reconfig", "--match", match, "--to", dst.String(), "--chain", other.String()).CombinedOutput()
	if err == nil || !strings.Contains(string(msg), "an address of this host") {
		t.Fatalf("mb1 naming its own %s as a hop: %v\n%s", other, err, msg)
	}
	lt.wait(t)
}

// reconfigureLineUDP deletes the middleboxes of a live iperf3 -u stream and
// inserts them again, twice: no datagram lost.
func reconfigureLineUDP(e *env) {
	t := e.t
	testutil.RequireTools(t, "iperf3")
	dst, mb1, mb2 := e.addr("server", false), e.addr("mb1", false), e.addr("mb2", false)
	match := fmt.Sprintf("udp dst port %d", iperfPort)
	e.policy("client", "line-udp", match, mb1.String())
	p := e.iperfServerOnce("server", iperfPort, "iperf3-line-udp")
	done := make(chan string, 1)
	go func() {
		out, _ := e.lab.Command(t.Context(), "client", "iperf3", "-J", "-u", "-b", "50M", "-l", "1200", "-w", "4M", "-t", "5",
			"-c", dst.String(), "-p", fmt.Sprint(iperfPort)).Output()
		done <- string(out)
	}()
	testutil.Eventually(t, 10*time.Second, "the UDP session to be answered at the client", func() bool {
		for _, s := range e.sessions("client") {
			if s.Proto == "udp" && s.State == "established" {
				return true
			}
		}
		return false
	})
	for i, chain := range [][]netip.Addr{nil, {mb1}, nil, {mb1, mb2}} {
		for _, r := range e.reconfig("client", match, dst, chain...) {
			if r.Outcome != "succeeded" {
				t.Fatalf("step %d (chain %v): %+v", i, chain, r)
			}
		}
	}
	out := <-done
	r, err := parseIperfUDP(out)
	if err != nil {
		t.Fatalf("iperf3 -u: %v\n%s", err, out)
	}
	if s := r.End.Sum; s.LostPackets != 0 || s.Packets == 0 {
		t.Errorf("iperf3 -u: %d of %d datagrams lost across four reconfigurations", s.LostPackets, s.Packets)
	}
	select {
	case <-p.Done():
	case <-time.After(30 * time.Second):
		t.Fatal("the one-off iperf3 server did not exit")
	}
}
