package e2e

import (
	"encoding/json"
	"fmt"
	"net/netip"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/dysco/dysco/internal/api"
	"github.com/dysco/dysco/internal/lab"
	"github.com/dysco/dysco/internal/testutil"
)

// reconfigVia runs `dysco reconfig --via` on host: the sessions matching
// match move to the host's address via, the new segment ending at to.
func (e *env) reconfigVia(host, match string, to, via netip.Addr) []api.ReconfigResult {
	e.t.Helper()
	args := []string{"reconfig", "--json", "--match", match, "--to", to.String(), "--via", via.String()}
	out, err := e.lab.Command(e.t.Context(), host, append([]string{dyscoBin}, args...)...).Output()
	var rep api.ReconfigReply
	if jerr := json.Unmarshal(out, &rep); jerr != nil {
		e.t.Fatalf("%s: dysco %s: %v (%v)\n%s", host, strings.Join(args, " "), jerr, err, out)
	}
	return rep.Results
}

// secondAddr is the address of host's second link (eth1).
func (e *env) secondAddr(host string, v6 bool) netip.Addr {
	e.t.Helper()
	ifs := e.host(host).Ifaces
	if len(ifs) < 2 {
		e.t.Fatalf("%s has no second link", host)
	}
	if v6 {
		return ifs[1].Addr6.Addr()
	}
	return ifs[1].Addr4.Addr()
}

// linkUp sets a host's interface up and gives it back the addresses
// (IPv6 ones go with the link, keep_addr_on_down being 0) and routes the
// lab gave it.
func (e *env) linkUp(host, iface string) {
	e.t.Helper()
	e.run(host, "ip", "link", "set", iface, "up")
	for _, ifc := range e.host(host).Ifaces {
		if ifc.Name == iface {
			e.run(host, "ip", "addr", "replace", ifc.Addr4.String(), "dev", iface)
			e.run(host, "ip", "addr", "replace", ifc.Addr6.String(), "dev", iface, "nodad")
		}
	}
	for _, r := range e.host(host).Routes {
		if r.Iface != iface {
			continue
		}
		args := []string{"ip", "route", "replace", r.Dst.String(), "via", r.Via.String(), "dev", iface}
		if r.Metric != 0 {
			args = append(args, "metric", fmt.Sprint(r.Metric))
		}
		if r.Table != 0 {
			args = append(args, "table", fmt.Sprint(r.Table))
		}
		if r.Src.IsValid() {
			args = append(args, "src", r.Src.String())
		}
		e.run(host, args...)
	}
}

// countMatching counts the lines of a capture that contain s.
func countMatching(lines []string, s string) int {
	n := 0
	for _, l := range lines {
		if strings.Contains(l, s) {
			n++
		}
	}
	return n
}

// TestMoveInterface: make before break onto a second interface (Serval
// §4.4, M2M §4.2.1). A multihomed client moves a live session, with data
// flowing both ways, from its first link's address to its second's with
// `dysco reconfig --via`: through a middlebox (the segment to mb1 is
// replaced by one from the new address to mb1) and with no middlebox (the
// segment to the server). Every byte arrives; afterwards the session's
// packets use the second link both ways, and the first carries none of
// them; the middlebox keeps one session, whose tuple did not change. Then
// the second link goes down and the agent rebinds the session back to the
// first link's address, its own (break before make).
func TestMoveInterface(t *testing.T) {
	for _, v6 := range []bool{false, true} {
		name := "ipv4"
		if v6 {
			name = "ipv6"
		}
		t.Run(name, func(t *testing.T) { moveInterface(t, v6) })
	}
}

func moveInterface(t *testing.T, v6 bool) {
	e := newLab(t, labOpts{prefix: "mv", topology: lab.Topology{Kind: lab.KindStar, Hosts: []lab.HostSpec{
		{Name: "client", Role: lab.RoleClient, Links: 2}, {Name: "mb1", Role: lab.RoleMiddlebox}, {Name: "server", Role: lab.RoleServer}}}})
	dst, mb1 := e.addr("server", v6), e.addr("mb1", v6)
	first, second := e.addr("client", v6), e.secondAddr("client", v6)
	e.policy("client", "through", "tcp dst port 9600", mb1.String())
	e.policy("client", "direct", "tcp dst port 9601")

	for _, c := range []struct {
		what string
		port uint16
		to   netip.Addr // the right anchor: the next hop
	}{{"through mb1", 9600, mb1}, {"direct", 9601, dst}} {
		t.Run(c.what, func(t *testing.T) {
			e := e.withT(t)
			const total = 48 * mib
			lt := e.startTransfer("client", "server", dst, c.port, total, 8*mib)
			testutil.Eventually(t, 30*time.Second, "the transfer to start", func() bool { return lt.received.Load() > 4*mib })
			match := fmt.Sprintf("tcp port %d", c.port)
			res := e.reconfigVia("client", match, c.to, second)
			if len(res) != 1 || res[0].Outcome != "succeeded" {
				t.Fatalf("the move: %+v", res)
			}
			t.Logf("moved to %s in %.2f ms", second, float64(res[0].Micros)/1000)
			if lt.received.Load() >= total {
				t.Fatal("the transfer ended before the move: pace it slower")
			}
			// Asking again is a no-op: the session leaves from there.
			if res := e.reconfigVia("client", match, c.to, second); len(res) != 1 || res[0].Outcome != "succeeded" || !res[0].Unchanged {
				t.Errorf("the same move again: %+v", res)
			}
			// From here on the session's packets use the second link,
			// both ways, and none the first.
			peer := c.to.String()
			on1 := e.capture("client", "eth0", "tcp and host "+peer)
			on2 := e.capture("client", "eth1", "tcp and host "+peer)
			base := lt.received.Load()
			testutil.Eventually(t, 30*time.Second, "more data after the move", func() bool { return lt.received.Load() > base+4*mib })
			l1, l2 := on1(), on2()
			if n := countMatching(l1, peer); n > 0 {
				t.Errorf("%d packets of the session on the first link after the move, e.g. %q", n, l1[0])
			}
			src, dstSeen := countMatching(l2, second.String()+"."), countMatching(l2, "> "+second.String()+".")
			if src-dstSeen < 100 || dstSeen < 100 {
				t.Errorf("on the second link: %d packets from %s, %d to it; want both ways", src-dstSeen, second, dstSeen)
			}
			// The second link goes down: the session moves back to
			// the first link's address (a rebind, no make-before-break
			// possible), and the link comes back for the next case.
			e.run("client", "ip", "link", "set", "eth1", "down")
			base = lt.received.Load()
			testutil.Eventually(t, 30*time.Second, "data after the second link went down", func() bool { return lt.received.Load() > base+4*mib })
			for _, s := range e.sessions("client") {
				if strings.HasSuffix(s.Session, fmt.Sprintf(":%d", c.port)) && s.State == "established" &&
					!strings.HasPrefix(s.Right, first.String()+":") && !strings.HasPrefix(s.Right, "["+first.String()+"]") {
					t.Errorf("after the second link went down the session leaves from %s, not %s", s.Right, first)
				}
			}
			e.linkUp("client", "eth1")
			if c.to == mb1 {
				ss := e.sessions("mb1")
				if len(ss) != 1 || !strings.HasSuffix(ss[0].Session, fmt.Sprintf(":%d", c.port)) {
					t.Errorf("mb1's sessions: %+v, want the one session", ss)
				} else if !strings.HasPrefix(ss[0].Session, first.String()) && !strings.HasPrefix(ss[0].Session, "["+first.String()) {
					t.Errorf("mb1 sees the session as %s: its tuple changed (from %s)", ss[0].Session, first)
				}
			}
			lt.wait(t)
		})
	}
	t.Run("policy via", func(t *testing.T) { policyVia(e.withT(t), v6) })
}

// policyVia: multihoming by policy (Serval §4.4). A policy through mb1
// spreads its sessions over the client's two links' addresses (--via):
// sixteen transfers leave from both, the sessions keep the client's own
// address as their source (mb1 sees the first link's address), and when
// the second link goes down, its sessions move back to the first: every
// transfer finishes intact.
func policyVia(e *env, v6 bool) {
	t := e.t
	dst, mb1 := e.addr("server", v6), e.addr("mb1", v6)
	first, second := e.addr("client", v6), e.secondAddr("client", v6)
	e.dysco("client", "policy", "add", "spread", "--chain", mb1.String(), "--via", first.String()+","+second.String(),
		"tcp dst portrange 9610-9625")
	out := e.dysco("client", "policy", "list")
	if !strings.Contains(out, "VIA") || !strings.Contains(out, second.String()) {
		t.Errorf("policy list shows no via addresses:\n%s", out)
	}
	var lts []*liveTransfer
	for port := uint16(9610); port <= 9625; port++ {
		lts = append(lts, e.startTransfer("client", "server", dst, port, 12*mib, 2*mib))
	}
	for _, lt := range lts {
		testutil.Eventually(t, 30*time.Second, "the transfers to start", func() bool { return lt.received.Load() > mib })
	}
	from := map[string]int{}
	for _, s := range e.sessions("client") {
		port := s.Session[strings.LastIndex(s.Session, ":")+1:]
		if p, err := strconv.Atoi(port); err != nil || p < 9610 || p > 9625 || s.State != "established" {
			continue // another subtest's
		}
		if !strings.HasPrefix(s.Session, first.String()) && !strings.HasPrefix(s.Session, "["+first.String()) {
			t.Errorf("a session %s: not from the client's own address", s.Session)
			continue
		}
		switch {
		case strings.HasPrefix(s.Right, first.String()+":") || strings.HasPrefix(s.Right, "["+first.String()+"]"):
			from["first"]++
		case strings.HasPrefix(s.Right, second.String()+":") || strings.HasPrefix(s.Right, "["+second.String()+"]"):
			from["second"]++
		default:
			t.Errorf("a session leaves from %s", s.Right)
		}
	}
	t.Logf("sessions by the link they leave by: %v", from)
	if from["first"] == 0 || from["second"] == 0 || from["first"]+from["second"] != 16 {
		t.Fatalf("16 sessions spread over two addresses: %v", from)
	}
	before := e.status("client").Counters["rebinds"]
	e.run("client", "ip", "link", "set", "eth1", "down")
	for _, lt := range lts {
		lt.wait(t)
	}
	e.linkUp("client", "eth1")
	if n := e.status("client").Counters["rebinds"] - before; n < uint64(from["second"]) {
		t.Errorf("%d rebinds, want at least %d (the sessions on the second link)", n, from["second"])
	}
	e.dysco("client", "policy", "rm", "spread")
}
