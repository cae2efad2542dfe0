package e2e

import (
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/dysco/dysco/internal/lab"
	"github.com/dysco/dysco/internal/testutil"
)

// TestForwardingOff: a host that must pass a chained session on but does not
// forward IP refuses its SYN at once. The lab is built from the host list
// "client,fw=mb,ids,server": fw is a middlebox host by its explicit role
// (forwarding, a tap), ids a plain host by its name (no forwarding). A chain
// through fw works; a chain through ids, through fw then ids (the reset then
// crosses fw), or through fw once its forwarding is turned off, fails
// connect() with ECONNREFUSED within a second, IPv4
// and IPv6 alike: the refusing host counts drop_no_forward and sends a reset
// back along the chain, its agent logs the sysctls to set, `dysco status`
// shows forwarding per family, and an agent started on a middlebox host that
// does not forward warns. With forwarding back on, the same chain carries
// data again.
func TestForwardingOff(t *testing.T) {
	topo, err := lab.Builtin("star", []string{"client", "fw=mb", "ids", "server"})
	if err != nil {
		t.Fatal(err)
	}
	e := newLab(t, labOpts{topology: topo, prefix: "fwd"})
	if fw, ids := e.host("fw"), e.host("ids"); fw.Role != lab.RoleMiddlebox || !fw.Forwarding || ids.Role != lab.RoleHost || ids.Forwarding {
		t.Fatalf("roles: fw %s (forwarding %v), ids %s (forwarding %v); want a forwarding middlebox and a plain host",
			fw.Role, fw.Forwarding, ids.Role, ids.Forwarding)
	}
	if st := e.status("fw"); st.Tap == "" || st.Forwarding == nil || !st.Forwarding.IPv4 || !st.Forwarding.IPv6 || len(st.Forwarding.Off) != 0 {
		t.Fatalf("fw: tap %q, forwarding %+v; want a tap and both families forwarded", st.Tap, st.Forwarding)
	}
	both := []string{"net.ipv4.ip_forward", "net.ipv6.conf.all.forwarding"}
	if f := e.status("ids").Forwarding; f == nil || f.IPv4 || f.IPv6 || !slices.Equal(f.Off, both) {
		t.Fatalf("ids: forwarding %+v, want both families off, naming %v", f, both)
	}

	// One listener and one policy per family and chain: through fw,
	// through ids, and through fw then ids (the reset then crosses fw).
	type route struct {
		name string
		dst  netip.AddrPort
	}
	routes := map[string]route{}
	port := uint16(9710)
	for _, chain := range [][]string{{"fw"}, {"ids"}, {"fw", "ids"}} {
		for _, v6 := range []bool{false, true} {
			fam := map[bool]string{false: "ipv4", true: "ipv6"}[v6]
			dst := netip.AddrPortFrom(e.addr("server", v6), port)
			e.listen("server", dst)
			var hops []string
			for _, h := range chain {
				hops = append(hops, e.addr(h, v6).String())
			}
			// Port+100 is for the exchange at the end.
			name := strings.Join(chain, "+") + "/" + fam
			e.policy("client", strings.Join(chain, "")+fam, fmt.Sprintf("tcp dst port %d or tcp dst port %d", port, port+100), hops...)
			routes[name] = route{name, dst}
			port++
		}
	}
	connects := func(r route) {
		t.Helper()
		c, err := e.dial("client", r.dst, 10*time.Second)
		if err != nil {
			t.Fatalf("%s: %v", r.name, err)
		}
		c.Close()
	}
	refused := func(r route) {
		t.Helper()
		start := time.Now()
		c, err := e.dial("client", r.dst, 20*time.Second)
		took := time.Since(start)
		if err == nil {
			c.Close()
			t.Fatalf("%s: connected through a host that does not forward", r.name)
		}
		if !errors.Is(err, syscall.ECONNREFUSED) {
			t.Errorf("%s: connect failed with %v, want ECONNREFUSED", r.name, err)
		}
		if took > time.Second {
			t.Errorf("%s: connect took %v to fail, want under a second", r.name, took)
		}
		t.Logf("%s: connect() failed after %v: %v", r.name, took.Round(time.Microsecond), err)
	}
	agentLog := func(host string) string {
		b, err := os.ReadFile(filepath.Join(e.lab.RunDir(), host+".agent.log"))
		if err != nil {
			t.Fatal(err)
		}
		return string(b)
	}
	loggedRefusal := func(host string, sysctls ...string) {
		t.Helper()
		testutil.Eventually(t, 5*time.Second, host+"'s agent to log the refusals with "+strings.Join(sysctls, ","), func() bool {
			l := agentLog(host)
			i := strings.LastIndex(l, "refused chained SYNs")
			return i >= 0 && strings.Contains(l[i:], `sysctls=`+strings.Join(sysctls, ","))
		})
	}
	setForwarding := func(host, v string) {
		t.Helper()
		e.run(host, "sysctl", "-q", "-w", "net.ipv4.ip_forward="+v, "net.ipv6.conf.all.forwarding="+v)
	}

	for _, fam := range []string{"ipv4", "ipv6"} {
		connects(routes["fw/"+fam])
	}
	rstBefore, fwRstBefore := e.status("client").Counters["rst"], e.status("fw").Counters["rst"]
	for _, fam := range []string{"ipv4", "ipv6"} {
		refused(routes["ids/"+fam])
		refused(routes["fw+ids/"+fam])
	}
	if n := e.status("ids").Counters["drop_no_forward"]; n < 4 {
		t.Errorf("ids counted %d SYNs as drop_no_forward, want one per family and chain at least", n)
	}
	if n := e.status("client").Counters["rst"] - rstBefore; n < 4 {
		t.Errorf("the client's datapath saw %d resets, want one per refusal", n)
	}
	if n := e.status("fw").Counters["rst"] - fwRstBefore; n < 2 {
		t.Errorf("fw's datapath saw %d resets, want the two of the chains through it", n)
	}
	loggedRefusal("ids", both...)

	// The middlebox host's forwarding turned off: refused, counted,
	// logged, shown; its agent warns when it starts so.
	setForwarding("fw", "0")
	testutil.Eventually(t, 5*time.Second, "fw's status to show forwarding off", func() bool {
		f := e.status("fw").Forwarding
		return f != nil && !f.IPv4 && !f.IPv6
	})
	if out := e.dysco("fw", "status"); !strings.Contains(out, "ip forwarding   ipv4 OFF, ipv6 OFF (net.ipv4.ip_forward=0, net.ipv6.conf.all.forwarding=0)") {
		t.Errorf("fw's status does not show forwarding off:\n%s", out)
	}
	before := e.status("fw").Counters["drop_no_forward"]
	for _, fam := range []string{"ipv4", "ipv6"} {
		refused(routes["fw/"+fam])
	}
	if n := e.status("fw").Counters["drop_no_forward"] - before; n < 2 {
		t.Errorf("fw counted %d more SYNs as drop_no_forward, want one per family at least", n)
	}
	loggedRefusal("fw", both...)
	if err := e.lab.RestartAgent("fw"); err != nil {
		t.Fatal(err)
	}
	if l := agentLog("fw"); !strings.Contains(l, "IP forwarding is off, but it has a session-view tap") ||
		!strings.Contains(l[strings.LastIndex(l, "IP forwarding is off"):], "sysctls=net.ipv4.ip_forward,net.ipv6.conf.all.forwarding") {
		t.Errorf("fw's agent started without forwarding and did not warn:\n%s", l)
	}

	// Forwarding back on: the same chains carry data.
	setForwarding("fw", "1")
	before = e.status("fw").Counters["setup_cont"]
	for _, fam := range []string{"ipv4", "ipv6"} {
		r := routes["fw/"+fam]
		connects(r)
		e.exchange("client", "server", r.dst.Addr(), r.dst.Port()+100, 1<<20)
	}
	if n := e.status("fw").Counters["setup_cont"] - before; n != 4 {
		t.Errorf("fw continued %d chains with forwarding back on, want 4", n)
	}
}
