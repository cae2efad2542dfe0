package e2e

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/dysco/dysco/internal/api"
	"github.com/dysco/dysco/internal/lab"
	"github.com/dysco/dysco/internal/labkit"
	"github.com/dysco/dysco/internal/testutil"
)

// TestRebindAddressLost: break before make (M2M §4.2.3). The client has a
// session address (on a dummy interface, which its applications use) and
// two links; its sessions go through mb1, a stateful iptables firewall
// whose FORWARD policy is DROP, watched by a tcpdump monitor on its
// session-view tap. While a paced transfer (bytes checked both ways), an
// iperf3 test and a curl download run, the client's address on its first
// link is deleted with its default route (as when a DHCP lease ends): the
// client's agent rebinds every session from its second link's address.
// Everything finishes intact, mb1's conntrack holds the same one entry
// per session throughout, its monitor sees each session under its one
// tuple, and the session leaves by the second link afterwards. IPv4 and
// IPv6, one after the other, in one lab.
func TestRebindAddressLost(t *testing.T) {
	e := newLab(t, labOpts{prefix: "rb", topology: lab.Topology{Kind: lab.KindStar, Hosts: []lab.HostSpec{
		{Name: "client", Role: lab.RoleClient, Links: 2, SessionAddr: true}, {Name: "mb1", Role: lab.RoleMiddlebox},
		{Name: "server", Role: lab.RoleServer}}}})
	dir := t.TempDir()
	e.nginx("server", dir)
	want := randomFile(t, dir+"/www/blob", 24*mib)
	e.iperfServer("server", 5201)
	for _, v6 := range []bool{false, true} {
		name := "ipv4"
		if v6 {
			name = "ipv6"
		}
		t.Run(name, func(t *testing.T) { rebindAddressLost(e.withT(t), "client", v6, want) })
	}
	t.Run("link down", func(t *testing.T) { rebindLinkDown(e.withT(t)) })
	t.Run("during a reconfiguration", func(t *testing.T) { rebindDuringReconfig(e.withT(t)) })
}

// TestRebindServerRenumbered: the far end moves (M2M §4.2.3, the
// symmetric case). The server has a session address, which the router
// reaches through its first link, and two links; the client opens its
// sessions to the session address through mb1 (the same DROP-policy
// firewall and monitor as above). While the same transfers run, the
// server's address on its first link is deleted with its default route:
// its agent rebinds the last subsession of every session from its second
// link's address, and mb1 moves its right side there. Everything
// finishes intact, with mb1's conntrack entries and monitor as before; a
// transfer with no middlebox is rebound straight to the client. IPv4 and
// IPv6, one after the other, in one lab.
func TestRebindServerRenumbered(t *testing.T) {
	e := newLab(t, labOpts{prefix: "rs", topology: lab.Topology{Kind: lab.KindStar, Hosts: []lab.HostSpec{
		{Name: "client", Role: lab.RoleClient}, {Name: "mb1", Role: lab.RoleMiddlebox},
		{Name: "server", Role: lab.RoleServer, Links: 2, SessionAddr: true}}}})
	dir := t.TempDir()
	e.nginx("server", dir)
	want := randomFile(t, dir+"/www/blob", 24*mib)
	e.iperfServer("server", 5201)
	t.Run("on request", func(t *testing.T) { rebindOnRequest(e.withT(t)) })
	for _, v6 := range []bool{false, true} {
		name := "ipv4"
		if v6 {
			name = "ipv6"
		}
		t.Run(name, func(t *testing.T) { rebindAddressLost(e.withT(t), "server", v6, want) })
	}
}

// rebindOnRequest: `dysco rebind` on the server moves two live sessions
// (through mb1, and with no middlebox) to its second link's address while
// the first still works; asked again, nothing changes; both transfers
// finish intact (the neighbours' packets on their way to the old address
// arrive while the old subsession lingers).
func rebindOnRequest(e *env) {
	t := e.t
	sess, second := e.host("server").SessionAddr4, e.secondAddr("server", false)
	e.policy("client", "req", "tcp dst port 9702", e.addr("mb1", false).String())
	e.policy("client", "req-direct", "tcp dst port 9703")
	lts := []*liveTransfer{
		e.startTransfer("client", "server", sess, 9702, 24*mib, 4*mib),
		e.startTransfer("client", "server", sess, 9703, 24*mib, 4*mib),
	}
	for _, lt := range lts {
		testutil.Eventually(t, 30*time.Second, "the transfers to start", func() bool { return lt.received.Load() > 2*mib })
	}
	rebind := func() api.ReconfigReply {
		var rep api.ReconfigReply
		out := e.dysco("server", "rebind", "--match", "tcp port 9702 or tcp port 9703", "--via", second.String(), "--json")
		if err := json.Unmarshal([]byte(out), &rep); err != nil {
			t.Fatalf("dysco rebind --json: %v\n%s", err, out)
		}
		return rep
	}
	rep := rebind()
	if len(rep.Results) != 2 {
		t.Fatalf("rebind: %+v", rep)
	}
	for _, r := range rep.Results {
		if r.Outcome != "succeeded" || r.Unchanged {
			t.Errorf("rebind of %s: %+v", r.Session, r)
		}
	}
	for _, s := range e.sessions("server") {
		if (strings.HasSuffix(s.Session, ":9702") || strings.HasSuffix(s.Session, ":9703")) && !strings.Contains(s.Left, "-> "+second.String()+":") {
			t.Errorf("session %s: its left subsession %s does not end at %s", s.Session, s.Left, second)
		}
	}
	for _, r := range rebind().Results {
		if r.Outcome != "succeeded" || !r.Unchanged {
			t.Errorf("the same rebind again, %s: %+v", r.Session, r)
		}
	}
	// An address that is not the server's is refused before anything.
	out, err := e.lab.Command(t.Context(), "server", dyscoBin, "rebind", "--match", "tcp", "--via", e.addr("client", false).String()).CombinedOutput()
	if err == nil || !strings.Contains(string(out), "is not an address of this host") {
		t.Errorf("a rebind to another host's address: %v %s", err, out)
	}
	for _, lt := range lts {
		lt.wait(t)
	}
	e.dysco("client", "policy", "rm", "req")
	e.dysco("client", "policy", "rm", "req-direct")
}

// rebindDuringReconfig brings the first link back, starts a transfer
// through mb1 on it, and deletes the link's address while a
// reconfiguration of the same session (mb1 taken out of it) starts: the
// two contend like two reconfigurations, whichever goes first, and the
// transfer finishes intact from the second link's address.
func rebindDuringReconfig(e *env) {
	t := e.t
	h := e.host("client")
	e.run("client", "ip", "link", "set", "eth0", "up")
	e.run("client", "ip", "-4", "route", "replace", "default", "via", h.Gateway4.String(), "dev", "eth0", "src", h.SessionAddr4.String())
	dst, first, second := e.addr("server", false), e.addr("client", false), e.secondAddr("client", false)
	testutil.Eventually(t, 10*time.Second, "the first link's address to be the locator again", func() bool {
		return e.status("client").Locators[h.SessionAddr4.String()] == first.String()
	})
	lt := e.startTransfer("client", "server", dst, 9700, 24*mib, 6*mib)
	testutil.Eventually(t, 30*time.Second, "the transfer to start", func() bool { return lt.received.Load() > 2*mib })
	var leaves string
	for _, s := range e.sessions("client") {
		if strings.HasSuffix(s.Session, ":9700") && s.State == "established" {
			leaves = s.Right
		}
	}
	if !strings.HasPrefix(leaves, first.String()+":") {
		t.Fatalf("the session leaves from %q, not the first link", leaves)
	}
	res := make(chan string, 1)
	go func() {
		out, _ := e.lab.Command(t.Context(), "client", dyscoBin, "reconfig", "--match", "tcp port 9700", "--to", dst.String()).CombinedOutput()
		res <- string(out)
	}()
	e.run("client", "ip", "-4", "addr", "del", h.Ifaces[0].Addr4.String(), "dev", "eth0")
	_ = e.lab.Command(t.Context(), "client", "ip", "-4", "route", "del", "default", "dev", "eth0").Run()
	t.Logf("the reconfiguration: %s", strings.TrimSpace(<-res))
	lt.wait(t)
	for _, s := range e.sessions("client") {
		if strings.HasSuffix(s.Session, ":9700") && s.State == "established" && !strings.HasPrefix(s.Right, second.String()+":") {
			t.Errorf("after the move the session leaves from %s, not %s", s.Right, second)
		}
	}
}

// rebindLinkDown gives the client its first link's addresses and default
// routes back (new sessions leave by it again), starts transfers of both
// families, through mb1 and with no middlebox (to the server directly),
// and takes the first link down: every session moves to the second link
// and finishes intact.
func rebindLinkDown(e *env) {
	t := e.t
	h := e.host("client")
	e.run("client", "ip", "-4", "addr", "add", h.Ifaces[0].Addr4.String(), "dev", "eth0")
	e.run("client", "ip", "-6", "addr", "add", h.Ifaces[0].Addr6.String(), "dev", "eth0", "nodad")
	e.run("client", "ip", "-4", "route", "replace", "default", "via", h.Gateway4.String(), "dev", "eth0", "src", h.SessionAddr4.String())
	e.run("client", "ip", "-6", "route", "replace", "default", "via", h.Gateway6.String(), "dev", "eth0", "src", h.SessionAddr6.String(), "metric", "1024")
	e.dysco("client", "policy", "rm", "mobile")
	e.policy("client", "mobile4", "ip and tcp dst port 9700", e.addr("mb1", false).String())
	e.policy("client", "mobile6", "ip6 and tcp dst port 9700", e.addr("mb1", true).String())
	e.policy("client", "direct", "tcp and dst port 9701")
	type tr struct {
		lt    *liveTransfer
		v6    bool
		first string
	}
	var trs []tr
	for _, c := range []struct {
		v6   bool
		port uint16
	}{{false, 9700}, {true, 9700}, {false, 9701}, {true, 9701}} {
		trs = append(trs, tr{e.startTransfer("client", "server", e.addr("server", c.v6), c.port, 24*mib, 6*mib), c.v6, e.addr("client", c.v6).String()})
	}
	for _, x := range trs {
		testutil.Eventually(t, 30*time.Second, "the transfers to start", func() bool { return x.lt.received.Load() > 2*mib })
	}
	rights := func() []string {
		var out []string
		for _, s := range e.sessions("client") {
			if s.Role == "start" && s.State == "established" {
				out = append(out, s.Right)
			}
		}
		return out
	}
	before := rights()
	if len(before) < 4 {
		t.Fatalf("the client's sessions: %v", before)
	}
	for _, r := range before {
		if !strings.HasPrefix(r, e.addr("client", false).String()+":") && !strings.HasPrefix(r, "["+e.addr("client", true).String()+"]") {
			t.Errorf("a session leaves from %s, not the first link", r)
		}
	}
	e.run("client", "ip", "link", "set", "eth0", "down")
	for _, x := range trs {
		x.lt.wait(t)
	}
	for _, r := range rights() {
		if !strings.HasPrefix(r, e.secondAddr("client", false).String()+":") && !strings.HasPrefix(r, "["+e.secondAddr("client", true).String()+"]") {
			t.Errorf("after the link went down a session leaves from %s, not the second link", r)
		}
	}
	if n := e.status("server").Counters["rebinds_accepted"]; n < 2 {
		t.Errorf("the server accepted %d rebinds (the sessions with no middlebox)", n)
	}
}

// rebindAddressLost runs transfers of a family from the client to the
// server through mb1 and deletes the first link's address of mover (the
// client or the server, the end with a session address and two links).
func rebindAddressLost(e *env, mover string, v6 bool, want string) {
	t := e.t
	ipt, family, ip := "iptables", "ipv4", "-4"
	if v6 {
		ipt, family, ip = "ip6tables", "ipv6", "-6"
	}
	h := e.host(mover)
	sess, first, second := h.SessionAddr4, e.addr(mover, v6), e.secondAddr(mover, v6)
	if v6 {
		sess = h.SessionAddr6
	}
	src, dst, mb1 := sess, e.addr("server", v6), e.addr("mb1", v6)
	if mover == "server" {
		src, dst = e.addr("client", v6), sess
	}
	for _, r := range [][]string{
		{"-P", "FORWARD", "DROP"},
		{"-A", "FORWARD", "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT"},
		{"-A", "FORWARD", "-p", "tcp", "--syn", "-s", src.String(), "-d", dst.String(), "-m", "multiport", "--dports", "80,5201,9700",
			"-m", "conntrack", "--ctstate", "NEW", "-j", "ACCEPT"},
	} {
		e.run("mb1", append([]string{ipt}, r...)...)
	}
	if v6 {
		e.dysco("client", "policy", "rm", "mobile")
	}
	e.policy("client", "mobile", "tcp and (dst port 80 or dst port 5201 or dst port 9700)", mb1.String())
	monitor := e.capture("mb1", "dysco-tap", "tcp and (port 80 or port 5201 or port 9700)")

	const total = 40 * mib
	lt := e.startTransfer("client", "server", dst, 9700, total, 6*mib)
	// With the server moving, one more session has no middlebox: the
	// rebind goes straight to the client.
	var direct *liveTransfer
	if mover == "server" {
		if !v6 {
			e.policy("client", "direct", "tcp dst port 9701")
		}
		direct = e.startTransfer("client", "server", dst, 9701, 24*mib, 4*mib)
	}
	curlOut := filepath.Join(t.TempDir(), "curl.sha256")
	curl, err := e.lab.Start("client", "curl-"+family, "sh", "-c",
		fmt.Sprintf("curl -sS -f -g --max-time 120 --limit-rate 3M %s | sha256sum > %s", urlFor(dst, "/blob"), curlOut))
	if err != nil {
		t.Fatal(err)
	}
	iperf, err := e.lab.Start("client", "iperf3-"+family, "sh", "-c",
		fmt.Sprintf("iperf3 -J -c %s -p 5201 -t 8 -b 20M > %s", dst, curlOut+".iperf"))
	if err != nil {
		t.Fatal(err)
	}
	testutil.Eventually(t, 30*time.Second, "the transfer to start", func() bool { return lt.received.Load() > 4*mib })

	// Every session is the session address's, and mb1's conntrack has
	// one entry for each.
	for _, s := range e.sessions(mover) {
		if strings.HasPrefix(s.Session, "[") != v6 {
			continue // the other family's, ended
		}
		if !strings.Contains(s.Session, sess.String()) {
			t.Errorf("a session %s, not of the session address %s", s.Session, sess)
		}
	}
	ctBefore := conntrackTuples(e, family)
	if len(ctBefore) < 3 {
		t.Fatalf("mb1's conntrack before the move: %v", ctBefore)
	}

	// The first link's address goes, with its default route.
	pfx := h.Ifaces[0].Addr4
	if v6 {
		pfx = h.Ifaces[0].Addr6
	}
	moved := time.Now()
	e.run(mover, "ip", ip, "addr", "del", pfx.String(), "dev", "eth0")
	_ = e.lab.Command(t.Context(), mover, "ip", ip, "route", "del", "default", "dev", "eth0").Run()
	base := lt.received.Load()
	testutil.Eventually(t, 30*time.Second, "data after the address was lost", func() bool { return lt.received.Load() > base+2*mib })
	t.Logf("the transfer went on %.0f ms after the address was deleted", float64(time.Since(moved).Microseconds())/1000)

	on0 := e.capture(mover, "eth0", "tcp and host "+mb1.String())
	on1 := e.capture(mover, "eth1", "tcp and host "+mb1.String())
	base = lt.received.Load()
	testutil.Eventually(t, 30*time.Second, "more data", func() bool { return lt.received.Load() > base+2*mib })
	l0, l1 := on0(), on1()
	if n := countMatching(l0, mb1.String()); n > 0 {
		t.Errorf("%d packets on the first link after the move: %q", n, l0)
	}
	if n := countMatching(l1, second.String()+"."); n < 50 {
		t.Errorf("%d packets from %s on the second link", n, second)
	}

	lt.wait(t)
	if direct != nil {
		direct.wait(t)
		if n := e.status("client").Counters["rebinds_accepted"]; n < 1 {
			t.Errorf("the client accepted %d rebinds (the session with no middlebox)", n)
		}
	}
	select {
	case <-curl.Done():
	case <-time.After(2 * time.Minute):
		t.Fatal("curl did not finish")
	}
	if err := curl.Err(); err != nil {
		t.Errorf("curl: %v", err)
	}
	if got, _ := os.ReadFile(curlOut); !strings.HasPrefix(string(got), want) {
		t.Errorf("curl's download: sha256 %q, want %s", got, want)
	}
	select {
	case <-iperf.Done():
	case <-time.After(time.Minute):
		t.Fatal("iperf3 did not finish")
	}
	out, _ := os.ReadFile(curlOut + ".iperf")
	if bytes, ierr, err := iperfResult(string(out)); err != nil || ierr != "" || bytes <= 0 {
		t.Errorf("iperf3: %v bytes, %v %s", bytes, err, ierr)
	}

	// The same conntrack entries, none new; the monitor saw each session
	// under its one tuple, from the session address.
	ctAfter := conntrackTuples(e, family)
	for tup := range ctAfter {
		if !ctBefore[tup] {
			t.Errorf("mb1's conntrack has a new entry %s (before: %v)", tup, ctBefore)
		}
	}
	for _, l := range monitor() {
		if strings.Contains(l, first.String()+".") || strings.Contains(l, second.String()+".") {
			t.Errorf("mb1's monitor saw a locator, not the session: %q", l)
			break
		}
	}
	if c := e.status(mover).Counters; c["rebinds"] < 3 || c["rebinds_failed"] != 0 {
		t.Errorf("%s counters: rebinds %d, failed %d", mover, c["rebinds"], c["rebinds_failed"])
	}
	if n := e.status("mb1").Counters["rebinds_accepted"]; n < 3 {
		t.Errorf("mb1 accepted %d rebinds", n)
	}
}

// conntrackTuples lists the original tuples of mb1's TCP conntrack
// entries of a family ("src=… dst=… sport=… dport=…").
func conntrackTuples(e *env, family string) map[string]bool {
	got := map[string]bool{}
	for _, tup := range labkit.ConntrackOrig(e.run("mb1", "conntrack", "-L", "-f", family, "-p", "tcp")) {
		got[tup] = true
	}
	return got
}
