package e2e

import (
	"encoding/json"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/dysco/dysco/internal/lab"
	"github.com/dysco/dysco/internal/testutil"
)

// UDP sessions through chains of unmodified middleboxes: HTTP/3 (QUIC) with
// dysco-h3, iperf3 -u, and DNS (dnsmasq and dig, a new session per query).
//
// Every scenario runs in two modes on the same star topology (client, mb1
// to mb4, server) with the same middleboxes:
//
//   - baseline: no Dysco policy. The router steers the sessions through the
//     middleboxes by policy routing (ip rule on the UDP port, per ingress
//     interface), as a chain is built without Dysco. It checks the tools,
//     the middleboxes' configuration and every end-to-end assertion that
//     does not depend on Dysco.
//   - dysco: Dysco policies `udp ...` on the client send the sessions
//     through the chains; on top of the baseline's checks, the set-up
//     counters of every host along the chain must grow.
//
// The dysco mode first checks that a UDP session is chained at all; while
// the datapath chains TCP only, it skips (see udpChained).
//
// The middleboxes: mb1 is a stateful firewall (FORWARD policy DROP, UDP
// conntrack rules: its conntrack must hold the session tuple), mb2 a monitor
// (tcpdump on the session-view tap in the dysco mode, on eth0 in the
// baseline, which must see the session tuple), mb3 a NAT (MASQUERADE: the
// server sees mb3's address) and mb4 a plain forwarder.

// udpChained says that the datapath chains UDP sessions. While it is
// false, the dysco mode skips when a UDP policy is refused or bypassed;
// once true, either is a failure. DYSCO_E2E_UDP_STRICT=1 in the
// environment does the same without editing it (for work on the datapath).
const udpChained = true

func udpStrict() bool { return udpChained || os.Getenv("DYSCO_E2E_UDP_STRICT") != "" }

// The UDP ports of the scenarios: QUIC through one middlebox (mb1, the
// firewall), and QUIC, iperf3 and DNS through all four.
const (
	quicPort1 = 4431
	quicPort4 = 4434
	iperfPort = 5201
	dnsPort   = 53
	// closedPort has no socket on the server: its sessions go through
	// mb4 alone, and the server's port unreachable must fail the client's
	// socket as it would without a chain.
	closedPort = 5399
)

var chain4Ports = []int{quicPort4, iperfPort, dnsPort}

// dnsQueries is how many DNS sessions the DNS scenario opens, from the
// source ports dnsSrcPort on (below the ephemeral range); the round with
// offloads off uses the dnsQueries ports below, so that its sessions are
// new ones (the same tuple within the idle timeout is the same session).
const (
	dnsQueries = 10000
	dnsSrcPort = 20000
)

// quicSize is the size of the HTTP/3 downloads (50 MB; -short uses 8 MB).
func quicSize() int64 {
	if testing.Short() {
		return 8 * mib
	}
	return 50 * mib
}

var (
	h3Once sync.Once
	h3Path string
	h3Err  error
)

// h3Bin builds dysco-h3 (test/h3, its own module) next to the dysco binary
// under test, once.
func h3Bin(t *testing.T) string {
	t.Helper()
	h3Once.Do(func() {
		h3Path = filepath.Join(filepath.Dir(dyscoBin), "dysco-h3")
		out, err := exec.Command("go", "build", "-C", "../h3", "-o", h3Path, ".").CombinedOutput()
		if err != nil {
			h3Err = fmt.Errorf("building dysco-h3: %v\n%s", err, out)
		}
	})
	if h3Err != nil {
		t.Fatal(h3Err)
	}
	return h3Path
}

// udpEnv is one lab set up for the UDP scenarios in one mode.
type udpEnv struct {
	*env
	dysco bool
	mbs   []string
}

func TestUDP(t *testing.T) {
	testutil.RequireTools(t, "dnsmasq", "dig", "iperf3", "conntrack", "tcpdump", "iptables", "ip6tables")
	h3Bin(t)
	for _, mode := range []string{"baseline", "dysco"} {
		t.Run(mode, func(t *testing.T) {
			u := newUDPEnv(t, mode == "dysco")
			for _, off := range []bool{false, true} {
				if off {
					u.txOff("client", "mb1", "mb2", "mb3", "mb4", "server")
				}
				for _, v6 := range []bool{false, true} {
					t.Run(fmt.Sprintf("txcsum-off=%v/ipv6=%v", off, v6), func(t *testing.T) {
						t.Run("quic-chain1", func(t *testing.T) { u.withT(t).quic(v6, quicPort1, u.mbs[:1]) })
						t.Run("quic-chain4", func(t *testing.T) { u.withT(t).quic(v6, quicPort4, u.mbs) })
						t.Run("iperf3", func(t *testing.T) { u.withT(t).iperfUDP(v6) })
						t.Run("dns", func(t *testing.T) { u.withT(t).dns(v6, off) })
						t.Run("closed-port", func(t *testing.T) { u.withT(t).closedPort(v6) })
					})
				}
			}
		})
	}
}

func (u *udpEnv) withT(t *testing.T) *udpEnv {
	return &udpEnv{env: u.env.withT(t), dysco: u.dysco, mbs: u.mbs}
}

func newUDPEnv(t *testing.T, dysco bool) *udpEnv {
	e := newLab(t, labOpts{topology: lab.Star("client", "mb1", "mb2", "mb3", "mb4", "server"), prefix: "u"})
	u := &udpEnv{env: e, dysco: dysco, mbs: []string{"mb1", "mb2", "mb3", "mb4"}}
	for _, v6 := range []bool{false, true} {
		ipt := "iptables"
		if v6 {
			ipt = "ip6tables"
		}
		dst := e.addr("server", v6).String()
		ports := fmt.Sprintf("%d,%d,%d,%d", quicPort1, quicPort4, iperfPort, dnsPort)
		// mb1: stateful firewall, default DROP; a NEW rule for the
		// sessions' ports, the rest by conntrack.
		for _, r := range [][]string{
			{"-P", "FORWARD", "DROP"},
			{"-A", "FORWARD", "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT"},
			{"-A", "FORWARD", "-p", "udp", "-d", dst, "-m", "multiport", "--dports", ports, "-m", "conntrack", "--ctstate", "NEW", "-j", "ACCEPT"},
		} {
			e.run("mb1", append([]string{ipt}, r...)...)
		}
		// mb3: NAT.
		e.run("mb3", ipt, "-t", "nat", "-A", "POSTROUTING", "-p", "udp", "-j", "MASQUERADE")
		if dysco {
			fam := "ip"
			if v6 {
				fam = "ip6"
			}
			var chain []string
			for _, m := range u.mbs {
				chain = append(chain, e.addr(m, v6).String())
			}
			u.udpPolicy(fmt.Sprintf("udp1-%s", fam), fmt.Sprintf("%s and udp dst port %d", fam, quicPort1), chain[:1])
			var dports []string
			for _, p := range chain4Ports {
				dports = append(dports, fmt.Sprintf("dst port %d", p))
			}
			u.udpPolicy(fmt.Sprintf("udp4-%s", fam), fmt.Sprintf("%s and udp and (%s)", fam, strings.Join(dports, " or ")), chain)
			u.udpPolicy(fmt.Sprintf("closed-%s", fam), fmt.Sprintf("%s and udp dst port %d", fam, closedPort), chain[3:])
		} else {
			u.steer(v6, []int{quicPort1}, u.mbs[:1])
			u.steer(v6, chain4Ports, u.mbs)
		}
	}
	// dnsmasq on the server: a fixed answer for *.x.lab, no upstream.
	srv := e.host("server")
	if _, err := e.lab.Start("server", "dnsmasq", "dnsmasq", "--conf-file=/dev/null", "--keep-in-foreground",
		"--no-resolv", "--no-hosts", "--user=root", "--bind-interfaces", "--log-facility=-",
		"--listen-address="+srv.Addr4.String(), "--listen-address="+srv.Addr6.String(),
		fmt.Sprintf("--port=%d", dnsPort), "--address=/x.lab/10.9.9.9", "--cache-size=0"); err != nil {
		t.Fatal(err)
	}
	e.waitListenUDP("server", dnsPort, 2)
	if dysco {
		u.probe()
	}
	return u
}

// udpPolicy adds a Dysco policy for UDP sessions; in the dysco mode a
// refusal skips while udpChained is false.
func (u *udpEnv) udpPolicy(name, filter string, chain []string) {
	u.t.Helper()
	out, err := u.lab.Command(u.t.Context(), "client", dyscoBin, "policy", "add", name, "--chain", strings.Join(chain, ","), filter).CombinedOutput()
	if err != nil {
		if !udpStrict() {
			u.t.Skipf("the agent refused the UDP policy %q (%v): %s", filter, err, out)
		}
		u.t.Fatalf("policy add %s %q: %v\n%s", name, filter, err, out)
	}
}

// probe checks that a UDP session (one DNS query) is chained: the client
// starts a chain, mb1 continues it. While udpChained is false, a bypassed
// policy skips the dysco mode.
func (u *udpEnv) probe() {
	u.t.Helper()
	start, cont := u.status("client").Counters["setup_start"], u.status("mb1").Counters["setup_cont"]
	out := u.run("client", "dig", "@"+u.addr("server", false).String(), "+short", "+tries=1", "+time=5", "probe.x.lab", "A")
	if strings.TrimSpace(out) != "10.9.9.9" {
		u.t.Fatalf("the probe query through the chain got %q", out)
	}
	if u.status("client").Counters["setup_start"] > start && u.status("mb1").Counters["setup_cont"] > cont {
		return
	}
	if !udpStrict() {
		u.t.Skip("the UDP policy was bypassed (the client's setup_start or mb1's setup_cont did not grow): the datapath does not chain UDP sessions yet; the baseline mode covers the scenarios")
	}
	u.t.Error("a UDP session matching a policy was not chained (the client's setup_start or mb1's setup_cont did not grow)")
}

// steer makes the router send UDP sessions to ports through the
// middleboxes of chain, in order, and their replies back through them in
// reverse order: policy routing on the ingress interface and the port.
// The NAT's replies are addressed to it; steering by interface and port
// takes them through the middleboxes all the same.
func (u *udpEnv) steer(v6 bool, ports []int, chain []string) {
	u.t.Helper()
	ip := []string{"ip", "-4"}
	if v6 {
		ip = []string{"ip", "-6"}
	}
	// Each middlebox has a routing table whose default route leads to it:
	// 100 + its position in the star (r-N is the router's side of its link).
	table := func(h string) string {
		i, err := strconv.Atoi(strings.TrimPrefix(u.host(h).Ifaces[0].PeerIface, "r-"))
		if err != nil {
			u.t.Fatalf("%s: router interface %q", h, u.host(h).Ifaces[0].PeerIface)
		}
		return strconv.Itoa(100 + i)
	}
	iface := func(h string) string { return u.host(h).Ifaces[0].PeerIface }
	for _, m := range chain {
		u.run("router", append(slices.Clone(ip), "route", "replace", "default", "via", u.addr(m, v6).String(), "dev", iface(m), "table", table(m))...)
	}
	for _, p := range ports {
		prev := "client"
		for _, m := range chain {
			u.run("router", append(slices.Clone(ip), "rule", "add", "iif", iface(prev), "ipproto", "udp", "dport", fmt.Sprint(p), "lookup", table(m))...)
			prev = m
		}
		prev = "server"
		for i := len(chain) - 1; i >= 0; i-- {
			m := chain[i]
			u.run("router", append(slices.Clone(ip), "rule", "add", "iif", iface(prev), "ipproto", "udp", "sport", fmt.Sprint(p), "lookup", table(m))...)
			prev = m
		}
	}
}

// waitListenUDP waits until host has n UDP sockets bound to port.
func (e *env) waitListenUDP(host string, port, n int) {
	e.t.Helper()
	testutil.Eventually(e.t, 10*time.Second, fmt.Sprintf("%d UDP sockets on port %d of %s", n, port, host), func() bool {
		out := strings.TrimSpace(e.run(host, "ss", "-Hlun", fmt.Sprintf("sport = :%d", port)))
		return out != "" && len(strings.Split(out, "\n")) >= n
	})
}

// counters returns the named counters of each host.
func (e *env) counters(hosts []string, name string) map[string]uint64 {
	m := map[string]uint64{}
	for _, h := range hosts {
		m[h] = e.status(h).Counters[name]
	}
	return m
}

// setups snapshots the set-up counters along a chain: the client starts,
// the middleboxes continue, the server ends.
type setups struct {
	start, end uint64
	cont       map[string]uint64
}

func (u *udpEnv) setups(chain []string) setups {
	return setups{
		start: u.status("client").Counters["setup_start"],
		end:   u.status("server").Counters["setup_end"],
		cont:  u.counters(chain, "setup_cont"),
	}
}

// checkChained checks, in the dysco mode, that at least n sessions were set
// up through every host of chain since before.
func (u *udpEnv) checkChained(before setups, chain []string, n uint64) {
	u.t.Helper()
	if !u.dysco {
		return
	}
	after := u.setups(chain)
	if d := after.start - before.start; d < n {
		u.t.Errorf("the client started %d chains, want at least %d", d, n)
	}
	for _, m := range chain {
		if d := after.cont[m] - before.cont[m]; d < n {
			u.t.Errorf("%s continued %d chains, want at least %d", m, d, n)
		}
	}
	if d := after.end - before.end; d < n {
		u.t.Errorf("the server ended %d chains, want at least %d", d, n)
	}
}

// h3Stats is the part of dysco-h3 serve's report the tests read.
type h3Stats struct {
	Connections int `json:"connections"`
	Migrated    int `json:"migrated"`
	Conns       []struct {
		RemoteStart string   `json:"remote_start"`
		RemoteEnd   string   `json:"remote_end"`
		Remotes     []string `json:"remotes"`
		Requests    int      `json:"requests"`
		Bytes       int64    `json:"bytes_sent"`
		Close       string   `json:"close"`
	} `json:"conns"`
}

// h3Summary is dysco-h3 get's summary.
type h3Summary struct {
	OK      bool    `json:"ok"`
	Bytes   int64   `json:"bytes"`
	SHA256  string  `json:"sha256"`
	Seconds float64 `json:"seconds"`
	Mbps    float64 `json:"mbps"`
	Error   string  `json:"error"`
}

// quic downloads quicSize() bytes over HTTP/3 from a dysco-h3 server on
// port, through chain; the client checks the hash, the server that the
// connection was its only one and never moved, the middleboxes what they
// saw.
func (u *udpEnv) quic(v6 bool, port int, chain []string) {
	t := u.t
	dir := t.TempDir()
	stats := filepath.Join(dir, "stats.json")
	name := fmt.Sprintf("h3-%d", port)
	srv, err := u.lab.Start("server", name, h3Bin(t), "serve", "--listen", fmt.Sprintf("[::]:%d", port), "--stats", stats)
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Stop()
	u.waitListenUDP("server", port, 1)

	client, dst := u.addr("client", v6), u.addr("server", v6)
	monitored := len(chain) > 1 // mb2, the monitor, is in the chain
	var stopMon, stopWire func() []string
	if monitored {
		iface := "eth0"
		if u.dysco {
			iface = "dysco-tap"
			// On the wire, the chain carries subsession tuples.
			stopWire = u.capture("mb2", "eth0", "udp", "-c", "200")
		}
		stopMon = u.capture("mb2", iface, fmt.Sprintf("udp and host %s and port %d", dst, port), "-c", "50")
	}
	before := u.setups(chain)
	n := quicSize()
	out := u.run("client", h3Bin(t), "get", fmt.Sprintf("https://%s/bytes/%d", netip.AddrPortFrom(dst, uint16(port)), n), "--insecure", "--timeout", "100s")
	var sum h3Summary
	if err := json.Unmarshal([]byte(jsonLine(out)), &sum); err != nil || !sum.OK || sum.Bytes != n {
		t.Fatalf("HTTP/3 download of %d bytes: %v\n%s", n, err, out)
	}
	t.Logf("HTTP/3: %d bytes in %.2f s (%.0f Mb/s)", sum.Bytes, sum.Seconds, sum.Mbps)

	// The server: one connection, one request, never migrated, from the
	// client (or, behind the NAT, from mb3).
	if err := srv.Stop(); err != nil {
		t.Fatal(err)
	}
	var st h3Stats
	b, err := os.ReadFile(stats)
	if err == nil {
		err = json.Unmarshal(b, &st)
	}
	if err != nil {
		t.Fatalf("the server's stats: %v", err)
	}
	if st.Connections != 1 || len(st.Conns) != 1 || st.Migrated != 0 {
		t.Fatalf("the server accepted %d connections (%d migrated), want one that did not migrate:\n%s", st.Connections, st.Migrated, b)
	}
	c := st.Conns[0]
	if len(c.Remotes) != 1 || c.RemoteStart != c.RemoteEnd || c.Requests != 1 || c.Bytes != n {
		t.Errorf("the server's connection: %+v", c)
	}
	wantPeer := client
	if slices.Contains(chain, "mb3") {
		wantPeer = u.addr("mb3", v6) // the NAT
	}
	if ap, err := netip.ParseAddrPort(c.RemoteStart); err != nil || ap.Addr().Unmap() != wantPeer {
		t.Errorf("the server's connection came from %s, want %s", c.RemoteStart, wantPeer)
	}

	// The firewall's conntrack holds the session tuple.
	family := "ipv4"
	if v6 {
		family = "ipv6"
	}
	ct := u.run("mb1", "conntrack", "-L", "-f", family, "-p", "udp", "--dport", fmt.Sprint(port))
	if !anyLine(strings.Split(ct, "\n"), "src="+client.String()+" ", "dst="+dst.String()+" ") {
		t.Errorf("mb1's conntrack has no entry for the session %s -> %s:%d:\n%s", client, dst, port, ct)
	}
	// The monitor saw the session tuple (before the NAT: the client's).
	if monitored {
		lines := stopMon()
		if !anyLine(lines, client.String()+".", dst.String()+fmt.Sprintf(".%d:", port)) {
			t.Errorf("the monitor on mb2 did not see the session tuple %s -> %s:%d; it saw:\n%s", client, dst, port, strings.Join(head(lines, 5), "\n"))
		}
	}
	if stopWire != nil {
		if l := stopWire(); anyLine(l, client.String()+".", "> "+dst.String()+".") {
			t.Errorf("the wire at mb2 carried the session tuple (no rewrite); it saw:\n%s", strings.Join(head(l, 5), "\n"))
		}
	}
	u.checkChained(before, chain, 1)
}

// jsonLine returns the last line of out that holds a JSON object (programs
// may log to stderr around it).
func jsonLine(out string) string {
	lines := strings.Split(strings.TrimSpace(out), "\n")
	for i := len(lines) - 1; i >= 0; i-- {
		if strings.HasPrefix(lines[i], "{") {
			return lines[i]
		}
	}
	return ""
}

// iperfUDP runs iperf3 -u through the four middleboxes, forward and
// reverse (-R), and checks what arrived: bytes, and loss under 10%. The
// rate is modest (20 Mb/s): each datagram crosses ten veth hops, and on a
// busy 2-core machine a faster stream overruns the receiver's socket
// buffer, a loss that says nothing about the chain; -w 2M gives the
// receiver half a second of slack (within net.core.rmem_max).
func (u *udpEnv) iperfUDP(v6 bool) {
	t := u.t
	dst := u.addr("server", v6)
	before := u.setups(u.mbs)
	for run, args := range [][]string{nil, {"-R"}} {
		p := u.iperfServerOnce("server", iperfPort, fmt.Sprintf("iperf3u-%d", run))
		out := u.run("client", append([]string{"iperf3", "-J", "-u", "-b", "20M", "-w", "2M", "-t", "2", "-c", dst.String(), "-p", fmt.Sprint(iperfPort)}, args...)...)
		r, err := parseIperfUDP(out)
		if err != nil {
			t.Fatalf("iperf3 -u %v: %v\n%s", args, err, out)
		}
		s := r.End.Sum
		t.Logf("iperf3 -u %v: %d bytes, %d packets, %d lost (%.2f%%)", args, s.Bytes, s.Packets, s.LostPackets, s.LostPercent)
		if s.Bytes < 4*mib || s.Packets == 0 {
			t.Errorf("iperf3 -u %v moved %d bytes in %d packets, want at least 4 MiB", args, s.Bytes, s.Packets)
		}
		if s.LostPercent > 10 {
			t.Errorf("iperf3 -u %v lost %.2f%% of its packets", args, s.LostPercent)
		}
		select {
		case <-p.Done():
		case <-time.After(30 * time.Second):
			t.Fatalf("the one-off iperf3 server of run %d did not exit after its test", run)
		}
	}
	// Each run is one UDP session (its data) besides iperf3's TCP control
	// connection, which no policy matches.
	u.checkChained(before, u.mbs, 2)
}

// dns sends dnsQueries queries with dig, each from a source port of its
// own (a new UDP session), through the four middleboxes; every one must be answered,
// and the firewall must have tracked every one.
func (u *udpEnv) dns(v6, txOff bool) {
	t := u.t
	dst := u.addr("server", v6)
	// dig picks source ports at random, and 10,000 draws from the
	// ephemeral range repeat some (the same tuple again: the same session
	// to conntrack and to Dysco). So each query binds a port of its own.
	src := u.addr("client", v6)
	base := dnsSrcPort
	if txOff {
		base -= dnsQueries
	}
	var q strings.Builder
	for i := range dnsQueries {
		fmt.Fprintf(&q, "-b %s#%d q%d.x.lab A\n", src, base+i, i)
	}
	file := filepath.Join(t.TempDir(), "queries")
	if err := os.WriteFile(file, []byte(q.String()), 0o644); err != nil {
		t.Fatal(err)
	}
	u.run("mb1", "conntrack", "-F")
	before := u.setups(u.mbs)
	start := time.Now()
	out := u.run("client", "dig", "@"+dst.String(), "-p", fmt.Sprint(dnsPort), "+short", "+tries=1", "+time=3", "-f", file)
	took := time.Since(start)
	answered := 0
	var other []string
	for _, l := range strings.Split(strings.TrimSpace(out), "\n") {
		if l == "10.9.9.9" {
			answered++
		} else if len(other) < 5 {
			other = append(other, l)
		}
	}
	t.Logf("dig: %d of %d queries answered in %v", answered, dnsQueries, took.Round(time.Millisecond))
	if answered != dnsQueries {
		t.Fatalf("%d of %d queries answered; other output:\n%s", answered, dnsQueries, strings.Join(other, "\n"))
	}
	// Every query was a session of its own: the firewall tracked each.
	family := "ipv4"
	if v6 {
		family = "ipv6"
	}
	ct := u.run("mb1", "conntrack", "-L", "-f", family, "-p", "udp", "--dport", fmt.Sprint(dnsPort), "-d", dst.String())
	tracked := 0
	for _, l := range strings.Split(ct, "\n") {
		if strings.HasPrefix(l, "udp ") {
			tracked++
		}
	}
	if tracked < dnsQueries {
		t.Errorf("mb1's conntrack holds %d DNS sessions, want %d (one per query)", tracked, dnsQueries)
	}
	u.checkChained(before, u.mbs, dnsQueries)
}

// closedPort sends a query to a port nobody listens on, through mb4: the
// server's ICMP port unreachable, translated back along the chain, fails
// dig's socket at once (connection refused), as it does without a chain.
func (u *udpEnv) closedPort(v6 bool) {
	t := u.t
	before := u.setups(u.mbs[3:])
	start := time.Now()
	cmd := u.lab.Command(t.Context(), "client", "dig", "@"+u.addr("server", v6).String(), "-p", fmt.Sprint(closedPort), "+tries=1", "+time=10", "closed.x.lab", "A")
	out, _ := cmd.CombinedOutput()
	took := time.Since(start)
	if !strings.Contains(string(out), "connection refused") {
		t.Fatalf("dig to a closed port through the chain: want connection refused, got (after %v):\n%s", took, out)
	}
	if took > 5*time.Second {
		t.Errorf("the refusal took %v: the ICMP error did not reach the client's socket", took)
	}
	u.checkChained(before, u.mbs[3:], 1)
}
