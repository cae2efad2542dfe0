package migrate

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"net"
	"net/netip"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/dysco/dysco/internal/testutil"
	"github.com/dysco/dysco/internal/wire"
)

// strictFirewall makes ns a firewall that lets through only connections it
// saw start: FORWARD policy DROP, accept ESTABLISHED,RELATED and NEW TCP
// SYNs, no mid-stream pick-up (nf_conntrack_tcp_loose=0) and strict window
// tracking (nf_conntrack_tcp_be_liberal=0).
func strictFirewall(t *testing.T, ns string) {
	t.Helper()
	for _, ipt := range []string{"iptables", "ip6tables"} {
		nsRun(t, ns, ipt, "-P", "FORWARD", "DROP")
		nsRun(t, ns, ipt, "-A", "FORWARD", "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT")
		nsRun(t, ns, ipt, "-A", "FORWARD", "-p", "tcp", "--syn", "-m", "conntrack", "--ctstate", "NEW", "-j", "ACCEPT")
	}
	nsRun(t, ns, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1", "net.ipv6.conf.all.forwarding=1",
		"net.netfilter.nf_conntrack_tcp_loose=0", "net.netfilter.nf_conntrack_tcp_be_liberal=0")
}

// veth links namespace a (interface an, addresses aAddrs) to b.
func veth(t *testing.T, a, an string, aAddrs []string, b, bn string, bAddrs []string) {
	t.Helper()
	runCmd(t, "ip", "-n", a, "link", "add", an, "type", "veth", "peer", "name", bn, "netns", b)
	for _, x := range []struct {
		ns, dev string
		addrs   []string
	}{{a, an, aAddrs}, {b, bn, bAddrs}} {
		for _, ad := range x.addrs {
			args := []string{"ip", "-n", x.ns, "addr", "add", ad, "dev", x.dev}
			if strings.Contains(ad, ":") {
				args = append(args, "nodad")
			}
			runCmd(t, args...)
		}
		runCmd(t, "ip", "-n", x.ns, "link", "set", x.dev, "up")
	}
}

// fwLab is client <-> fw1 <-> server with a second path client <-> fw2 <->
// server; the end hosts' session addresses (10.9.0.1/2, fd09::1/2) sit on
// lo and are routed through fw1 or fw2.
type fwLab struct {
	cli, fw1, fw2, srv string
}

func newFwLab(t *testing.T) *fwLab {
	l := &fwLab{cli: newNS(t, "cli"), fw1: newNS(t, "fw1"), fw2: newNS(t, "fw2"), srv: newNS(t, "srv")}
	for _, fw := range []string{l.fw1, l.fw2} {
		strictFirewall(t, fw)
	}
	for i, fw := range []string{l.fw1, l.fw2} {
		n := string(rune('1' + i))
		veth(t, l.cli, "c"+n, []string{"10.1." + n + ".1/24", "fd01:" + n + "::1/64"}, fw, "fa", []string{"10.1." + n + ".2/24", "fd01:" + n + "::2/64"})
		veth(t, l.srv, "s"+n, []string{"10.2." + n + ".1/24", "fd02:" + n + "::1/64"}, fw, "fb", []string{"10.2." + n + ".2/24", "fd02:" + n + "::2/64"})
		runCmd(t, "ip", "-n", fw, "route", "add", "10.9.0.1/32", "via", "10.1."+n+".1")
		runCmd(t, "ip", "-n", fw, "route", "add", "10.9.0.2/32", "via", "10.2."+n+".1")
		runCmd(t, "ip", "-n", fw, "-6", "route", "add", "fd09::1/128", "via", "fd01:"+n+"::1")
		runCmd(t, "ip", "-n", fw, "-6", "route", "add", "fd09::2/128", "via", "fd02:"+n+"::1")
	}
	runCmd(t, "ip", "-n", l.cli, "addr", "add", "10.9.0.1/32", "dev", "lo")
	runCmd(t, "ip", "-n", l.cli, "addr", "add", "fd09::1/128", "dev", "lo")
	runCmd(t, "ip", "-n", l.srv, "addr", "add", "10.9.0.2/32", "dev", "lo")
	runCmd(t, "ip", "-n", l.srv, "addr", "add", "fd09::2/128", "dev", "lo")
	l.route(t, 1, "replace")
	return l
}

// route sends both end hosts' session traffic through firewall n (1 or 2).
func (l *fwLab) route(t *testing.T, n int, verb string) {
	t.Helper()
	s := string(rune('0' + n))
	runCmd(t, "ip", "-n", l.cli, "route", verb, "10.9.0.2/32", "via", "10.1."+s+".2", "src", "10.9.0.1")
	runCmd(t, "ip", "-n", l.srv, "route", verb, "10.9.0.1/32", "via", "10.2."+s+".2", "src", "10.9.0.2")
	runCmd(t, "ip", "-n", l.cli, "-6", "route", verb, "fd09::2/128", "via", "fd01:"+s+"::2", "src", "fd09::1")
	runCmd(t, "ip", "-n", l.srv, "-6", "route", verb, "fd09::1/128", "via", "fd02:"+s+"::2", "src", "fd09::2")
}

// connect opens a TCP connection from the client to the server's listener
// and returns both ends.
func (l *fwLab) connect(t *testing.T, ln net.Listener) (cli, srv net.Conn) {
	t.Helper()
	var err error
	inNS(t, l.cli, func() {
		d := net.Dialer{Timeout: 5 * time.Second}
		cli, err = d.Dial("tcp", ln.Addr().String())
	})
	if err != nil {
		t.Fatalf("dial %s: %v", ln.Addr(), err)
	}
	t.Cleanup(func() { cli.Close() })
	_ = ln.(*net.TCPListener).SetDeadline(time.Now().Add(5 * time.Second))
	srv, err = ln.Accept()
	if err != nil {
		t.Fatalf("accept: %v", err)
	}
	t.Cleanup(func() { srv.Close() })
	return cli, srv
}

// transfer writes n bytes on a and reads them on b within timeout.
func transfer(a, b net.Conn, n int, timeout time.Duration) error {
	data := bytes.Repeat([]byte("dysco"), n/5+1)[:n]
	errc := make(chan error, 1)
	go func() {
		_ = a.SetWriteDeadline(time.Now().Add(timeout))
		_, err := a.Write(data)
		errc <- err
	}()
	_ = b.SetReadDeadline(time.Now().Add(timeout))
	got := make([]byte, n)
	if _, err := io.ReadFull(b, got); err != nil {
		return err
	}
	if !bytes.Equal(got, data) {
		return errors.New("data corrupted")
	}
	return <-errc
}

func sessionOf(t *testing.T, cli net.Conn) Session {
	t.Helper()
	la := cli.LocalAddr().(*net.TCPAddr).AddrPort()
	ra := cli.RemoteAddr().(*net.TCPAddr).AddrPort()
	return Session{Tuple: wire.Tuple{Src: la.Addr().Unmap(), Dst: ra.Addr().Unmap(), SrcPort: la.Port(), DstPort: ra.Port()}, Proto: 6}
}

// TestConntrackMigration is the acceptance test of the "conntrack" plug-in:
// a strict firewall drops the mid-stream packets of a connection it never
// saw, and lets them through both ways once the entry exported from the
// firewall that carried the connection is imported.
func TestConntrackMigration(t *testing.T) {
	requireNetfilter(t)
	l := newFwLab(t)
	set, err := NewSet([]string{"conntrack"}, Options{})
	if err != nil {
		t.Fatal(err)
	}
	for _, fam := range []struct {
		name, listen string
		v6           bool
	}{{"ipv4", "10.9.0.2:0", false}, {"ipv6", "[fd09::2]:0", true}} {
		t.Run(fam.name, func(t *testing.T) {
			var ln net.Listener
			inNS(t, l.srv, func() { ln, err = net.Listen("tcp", fam.listen) })
			if err != nil {
				t.Fatal(err)
			}
			defer ln.Close()
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()

			// Without the entry: fw2 drops the connection's packets.
			l.route(t, 1, "replace")
			c1, s1 := l.connect(t, ln)
			if err := transfer(c1, s1, 1000, 5*time.Second); err != nil {
				t.Fatalf("through fw1: %v", err)
			}
			l.route(t, 2, "replace")
			drops := policyDrops(t, l.fw2, fam.v6)
			go func() { _, _ = c1.Write([]byte("lost")) }()
			testutil.Eventually(t, 10*time.Second, "fw2 to drop the connection's packets", func() bool { return policyDrops(t, l.fw2, fam.v6) > drops })
			_ = s1.SetReadDeadline(time.Now().Add(time.Second))
			if n, err := s1.Read(make([]byte, 10)); err == nil || !os.IsTimeout(err) {
				t.Fatalf("server received %d bytes through fw2 without the entry (err %v)", n, err)
			}
			l.route(t, 1, "replace")
			_ = c1.(*net.TCPConn).SetLinger(0)
			c1.Close()
			s1.Close()

			// With the entry exported from fw1 and imported into fw2.
			c2, s2 := l.connect(t, ln)
			if err := transfer(c2, s2, 3000, 5*time.Second); err != nil {
				t.Fatalf("through fw1: %v", err)
			}
			if err := transfer(s2, c2, 3000, 5*time.Second); err != nil {
				t.Fatalf("through fw1: %v", err)
			}
			sess := sessionOf(t, c2)
			var b Bundle
			inNS(t, l.fw1, func() { b, err = set.Export(ctx, sess) })
			if err != nil {
				t.Fatalf("export from fw1: %v", err)
			}
			var st ctState
			if err := json.Unmarshal(b["conntrack"], &st); err != nil {
				t.Fatalf("exported state %q: %v", b["conntrack"], err)
			}
			if len(st.Entries) != 1 {
				t.Fatalf("exported %d entries, want 1: %s", len(st.Entries), b["conntrack"])
			}
			e := st.Entries[0]
			if e.Reply != e.Orig.reverse() || e.TCP == nil || e.TCP.State != 3 || e.Status&(ipsAssured|ipsSeenReply) != ipsAssured|ipsSeenReply {
				t.Fatalf("exported entry %+v (tcp %+v): want established, assured, no NAT", e, e.TCP)
			}
			if e.TCP.FlagsOrig&tcpFlagWindowScale == 0 || e.TCP.WscaleOrig == 0 {
				t.Errorf("exported entry lacks the window scale: %+v", e.TCP)
			}
			want := fwRule{Table: "filter", Rule: "-A FORWARD -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT"}
			if len(st.Rules) != 1 || st.Rules[0] != want {
				t.Errorf("recorded rules %v, want [%v]", st.Rules, want)
			}

			for i := range 2 { // the second import is a retransmission
				inNS(t, l.fw2, func() { err = set.Import(ctx, sess, b) })
				if err != nil {
					t.Fatalf("import #%d into fw2: %v", i+1, err)
				}
				var got Bundle
				inNS(t, l.fw2, func() { got, err = set.Export(ctx, sess) })
				if err != nil {
					t.Fatalf("export from fw2: %v", err)
				}
				var st2 ctState
				if err := json.Unmarshal(got["conntrack"], &st2); err != nil || len(st2.Entries) != 1 {
					t.Fatalf("fw2 after import #%d: %q %v", i+1, got["conntrack"], err)
				}
				g := st2.Entries[0]
				if g.Orig != e.Orig || g.Reply != e.Reply || *g.TCP != (ctTCP{State: e.TCP.State, WscaleOrig: e.TCP.WscaleOrig, WscaleReply: e.TCP.WscaleReply,
					FlagsOrig: e.TCP.FlagsOrig&tcpFlagsCarried | tcpFlagBeLiberal, FlagsReply: e.TCP.FlagsReply&tcpFlagsCarried | tcpFlagBeLiberal}) ||
					g.Status&ipsSettable != e.Status&ipsSettable || g.Mark != e.Mark {
					t.Fatalf("fw2's entry after import #%d: %+v tcp %+v; exported %+v tcp %+v", i+1, g, g.TCP, e, e.TCP)
				}
			}

			l.route(t, 2, "replace")
			drops = policyDrops(t, l.fw2, fam.v6)
			for round := range 3 {
				if err := transfer(c2, s2, 20000, 10*time.Second); err != nil {
					t.Fatalf("round %d, client to server through fw2: %v", round, err)
				}
				if err := transfer(s2, c2, 20000, 10*time.Second); err != nil {
					t.Fatalf("round %d, server to client through fw2: %v", round, err)
				}
			}
			if d := policyDrops(t, l.fw2, fam.v6); d != drops {
				t.Errorf("fw2 dropped %d packets after the import", d-drops)
			}

			// The old firewall releases its entry.
			inNS(t, l.fw1, func() { err = set.Release(ctx, sess) })
			if err != nil {
				t.Fatalf("release on fw1: %v", err)
			}
			inNS(t, l.fw1, func() { b, err = set.Export(ctx, sess) })
			if err != nil || len(b) != 0 {
				t.Fatalf("fw1 after release: %v %v, want no state", b, err)
			}
			inNS(t, l.fw1, func() { err = set.Release(ctx, sess) })
			if err != nil {
				t.Fatalf("second release on fw1: %v", err)
			}
			l.route(t, 1, "replace")
		})
	}
}

// TestConntrackImportNeedsRules: an import into a host lacking the rule the
// entry relies on fails, naming the rule, and installs nothing; with an
// equivalent rule (other comment, interface names) it succeeds. The entries
// are made through ctnetlink, one of them with a NAT binding.
func TestConntrackImportNeedsRules(t *testing.T) {
	requireNetfilter(t)
	a, b := newNS(t, "a"), newNS(t, "b")
	nsRun(t, a, "iptables", "-A", "FORWARD", "-i", "eth0", "-m", "conntrack", "--ctstate", "RELATED,ESTABLISHED", "-m", "comment", "--comment", "stateful firewall", "-j", "ACCEPT")
	nsRun(t, a, "iptables", "-A", "FORWARD", "-p", "tcp", "--dport", "22", "-j", "ACCEPT")
	nsRun(t, a, "iptables", "-t", "nat", "-A", "POSTROUTING", "-j", "MASQUERADE")
	nsRun(t, b, "iptables", "-t", "nat", "-A", "POSTROUTING", "-j", "MASQUERADE")
	nsRun(t, b, "iptables", "-A", "FORWARD", "-p", "tcp", "--dport", "22", "-j", "ACCEPT")
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()

	sess := Session{Tuple: wire.Tuple{Src: netip.MustParseAddr("10.0.0.1"), Dst: netip.MustParseAddr("10.0.9.9"), SrcPort: 40000, DstPort: 80}, Proto: 6}
	orig := sessionTuple(sess)
	// SNAT to 192.0.2.1:50000.
	natted := &ctEntry{Orig: orig, Reply: ctTuple{Src: orig.Dst, Dst: netip.MustParseAddr("192.0.2.1"), Sport: 80, Dport: 50000, Proto: 6},
		Status: ipsAssured | ipsSeenReply, Timeout: 600, Mark: 7,
		TCP: &ctTCP{State: 3, WscaleOrig: 7, WscaleReply: 9, FlagsOrig: tcpFlagWindowScale | tcpFlagSackPerm, FlagsReply: tcpFlagWindowScale}}
	var err error
	inNS(t, a, func() {
		var nl *nlConn
		if nl, err = dialNetfilter(); err != nil {
			return
		}
		defer nl.Close()
		err = nl.ctCreate(ctx, natted)
	})
	if err != nil {
		t.Fatalf("creating the entry in %s: %v", a, err)
	}
	ct := NewConntrack(nil)
	var state []byte
	inNS(t, a, func() { state, err = ct.Export(ctx, sess) })
	if err != nil || state == nil {
		t.Fatalf("export: %q %v", state, err)
	}
	var st ctState
	if err := json.Unmarshal(state, &st); err != nil {
		t.Fatal(err)
	}
	if len(st.Entries) != 1 || st.Entries[0].Reply != natted.Reply || st.Entries[0].Status&ipsSrcNat == 0 || st.Entries[0].Mark != 7 {
		t.Fatalf("exported %s, want the SNAT entry", state)
	}
	want := `"-A FORWARD -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT" (table filter)`

	inNS(t, b, func() { err = ct.Import(ctx, sess, state) })
	if err == nil || !strings.Contains(err.Error(), "lacks firewall rule "+want) {
		t.Fatalf("import into a host without the rule: %v; want an error naming %s", err, want)
	}
	var got []byte
	inNS(t, b, func() { got, err = ct.Export(ctx, sess) })
	if err != nil || got != nil {
		t.Fatalf("after the refused import %s has state %q (%v)", b, got, err)
	}

	nsRun(t, b, "iptables", "-A", "FORWARD", "-i", "ens3", "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT")
	inNS(t, b, func() { err = ct.Import(ctx, sess, state) })
	if err != nil {
		t.Fatalf("import into a host with an equivalent rule: %v", err)
	}
	inNS(t, b, func() { got, err = ct.Export(ctx, sess) })
	var st2 ctState
	if err != nil || json.Unmarshal(got, &st2) != nil || len(st2.Entries) != 1 {
		t.Fatalf("after import: %q %v", got, err)
	}
	g := st2.Entries[0]
	// Imported entries are liberal (ctnetlink.go setAttrs).
	wantTCP := *natted.TCP
	wantTCP.FlagsOrig |= tcpFlagBeLiberal
	wantTCP.FlagsReply |= tcpFlagBeLiberal
	if g.Reply != natted.Reply || g.Status&(ipsSrcNat|ipsAssured|ipsSeenReply) != ipsSrcNat|ipsAssured|ipsSeenReply || g.Mark != 7 ||
		*g.TCP != wantTCP || g.Timeout > 600 || g.Timeout < 590 {
		t.Fatalf("imported entry %+v tcp %+v, want %+v tcp %+v", g, g.TCP, natted, wantTCP)
	}
}
