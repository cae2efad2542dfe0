package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/dysco/dysco/internal/api"
	"github.com/dysco/dysco/internal/lab"
	"github.com/dysco/dysco/internal/testutil"
)

// Live QUIC sessions (HTTP/3 downloads with dysco-h3) whose middleboxes
// change under them (docs/protocol.md, "UDP sessions";
// heterogeneous-sfc-quic §III.B and §VI.B: QUIC sessions moved between
// middleboxes mid-stream, a network function started for the move).
//
// The server paces each body (dysco-h3 serve --rate), so that a download
// lasts long enough for the reconfigurations whatever the machine's speed.

// quicRate and quicPacedSize: a download of 24 MB at 40 Mbit/s lasts
// about 4.8 s.
const (
	quicRate      = "40M"
	quicPacedSize = 24_000_000
)

// h3Download is a live download: its server, its client and what they
// report.
type h3Download struct {
	e       *env
	port    int
	n       int64
	srv     *lab.Proc
	stats   string
	samples string
	done    chan string // get's output, when it exits
}

// startH3 starts a dysco-h3 server on the server host (paced at rate) and
// a download of n bytes from the client, and returns once the body flows.
func (e *env) startH3(v6 bool, port int, n int64, rate string) *h3Download {
	t := e.t
	t.Helper()
	dir := t.TempDir()
	d := &h3Download{e: e, port: port, n: n, stats: filepath.Join(dir, "stats.json"), samples: filepath.Join(dir, "samples.jsonl"), done: make(chan string, 1)}
	srv, err := e.lab.Start("server", fmt.Sprintf("h3q-%d", port), h3Bin(t), "serve", "--listen", fmt.Sprintf("[::]:%d", port), "--stats", d.stats, "--rate", rate)
	if err != nil {
		t.Fatal(err)
	}
	d.srv = srv
	t.Cleanup(func() { srv.Stop() })
	e.waitListenUDP("server", port, 1)
	url := fmt.Sprintf("https://%s/bytes/%d", netip.AddrPortFrom(e.addr("server", v6), uint16(port)), n)
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	t.Cleanup(cancel)
	cmd := e.lab.Command(ctx, "client", h3Bin(t), "get", url, "--insecure", "--timeout", "60s", "--interval", "50ms", "--samples", d.samples)
	go func() {
		out, _ := cmd.CombinedOutput()
		d.done <- string(out)
	}()
	flowing := regexp.MustCompile(`"bytes":[1-9]`)
	testutil.Eventually(t, 15*time.Second, "the HTTP/3 body to flow", func() bool {
		b, _ := os.ReadFile(d.samples)
		return flowing.Match(b)
	})
	return d
}

// running fails the test if the download already ended: the steps it was
// to live through came too late.
func (d *h3Download) running(what string) {
	d.e.t.Helper()
	select {
	case out := <-d.done:
		d.done <- out
		d.e.t.Fatalf("the download ended before %s (pace it slower):\n%s", what, out)
	default:
	}
}

// check waits for the download to end and checks it: every byte with the
// right hash at the client; at the server exactly one connection, one
// request, never migrated.
func (d *h3Download) check() h3Summary {
	t := d.e.t
	t.Helper()
	var out string
	select {
	case out = <-d.done:
	case <-time.After(90 * time.Second):
		t.Fatal("the download did not end within 90 s")
	}
	var sum h3Summary
	if err := json.Unmarshal([]byte(jsonLine(out)), &sum); err != nil || !sum.OK || sum.Bytes != d.n {
		t.Fatalf("HTTP/3 download of %d bytes: %v\n%s", d.n, err, out)
	}
	if err := d.srv.Stop(); err != nil {
		t.Fatal(err)
	}
	var st h3Stats
	b, err := os.ReadFile(d.stats)
	if err == nil {
		err = json.Unmarshal(b, &st)
	}
	if err != nil {
		t.Fatalf("the server's stats: %v", err)
	}
	if st.Connections != 1 || len(st.Conns) != 1 || st.Migrated != 0 {
		t.Fatalf("the server accepted %d connections (%d migrated), want one that did not migrate:\n%s", st.Connections, st.Migrated, b)
	}
	if c := st.Conns[0]; len(c.Remotes) != 1 || c.RemoteStart != c.RemoteEnd || c.Requests != 1 || c.Bytes != d.n {
		t.Errorf("the server's connection: %+v", c)
	}
	t.Logf("HTTP/3: %d bytes in %.2f s (%.1f Mb/s), hash intact, one connection that never migrated", sum.Bytes, sum.Seconds, sum.Mbps)
	return sum
}

// waitUDPSession waits until host holds the established UDP session to
// port.
func (e *env) waitUDPSession(host string, port int) api.Session {
	e.t.Helper()
	var got api.Session
	testutil.Eventually(e.t, 10*time.Second, fmt.Sprintf("the UDP session to port %d at %s", port, host), func() bool {
		for _, s := range e.sessions(host) {
			if s.Proto == "udp" && s.State == "established" && strings.HasSuffix(s.Session, fmt.Sprintf(":%d", port)) {
				got = s
				return true
			}
		}
		return false
	})
	return got
}

// anchorDrops sums the drop_* counters of the hosts.
func (e *env) anchorDrops(hosts ...string) map[string]uint64 {
	e.t.Helper()
	m := map[string]uint64{}
	for _, h := range hosts {
		for k, v := range e.status(h).Counters {
			if strings.HasPrefix(k, "drop_") {
				m[h+":"+k] = v
			}
		}
	}
	return m
}

// moved lists the drop counters that differ between two snapshots.
func moved(before, after map[string]uint64) []string {
	var out []string
	for k, v := range after {
		if v != before[k] {
			out = append(out, fmt.Sprintf("%s +%d", k, v-before[k]))
		}
	}
	return out
}

// reconfigUDP runs `dysco reconfig` on host for the sessions match selects
// (an empty chain deletes the middleboxes) and returns its results.
func (e *env) reconfigUDP(host, match, to string, chain []string) []api.ReconfigResult {
	e.t.Helper()
	args := []string{dyscoBin, "reconfig", "--json", "--timeout", "30s", "--match", match, "--to", to}
	if len(chain) > 0 {
		args = append(args, "--chain", strings.Join(chain, ","))
	}
	out, err := e.lab.Command(e.t.Context(), host, args...).Output()
	var rep api.ReconfigReply
	if jerr := json.Unmarshal(out, &rep); jerr != nil {
		e.t.Fatalf("%s: %s: %v (%v)\n%s", host, strings.Join(args, " "), jerr, err, out)
	}
	return rep.Results
}

// TestUDPQUICReconfigure: a live HTTP/3 download whose QUIC session has
// its middlebox replaced (mb1 by mb2), deleted and inserted again (mb1),
// back to back, by the client's agent; IPv4 and IPv6, transmit checksum
// offload on, then off. The download gets every byte with its hash, the
// server sees one connection that never migrated (the tuple the ends see
// never changes), and no drop counter moves at the anchors.
func TestUDPQUICReconfigure(t *testing.T) {
	h3Bin(t)
	e := newLab(t, labOpts{topology: lab.Star("client", "mb1", "mb2", "server"), prefix: "uq"})
	port := 4450
	for _, off := range []bool{false, true} {
		if off {
			e.txOff("client", "mb1", "mb2", "server")
		}
		for _, v6 := range []bool{false, true} {
			port++
			t.Run(fmt.Sprintf("txcsum-off=%v/ipv6=%v", off, v6), func(t *testing.T) {
				e := e.withT(t)
				dst, mb1, mb2 := e.addr("server", v6), e.addr("mb1", v6), e.addr("mb2", v6)
				fam := "ip"
				if v6 {
					fam = "ip6"
				}
				match := fmt.Sprintf("%s and udp dst port %d", fam, port)
				e.policy("client", fmt.Sprintf("q%d", port), match, mb1.String())
				drops := e.anchorDrops("client", "server")
				d := e.startH3(v6, port, quicPacedSize, quicRate)
				e.waitUDPSession("client", port)
				e.carries("mb1")
				for _, step := range []struct {
					what    string
					chain   []string
					carrier string
				}{
					{"replace mb1 by mb2", []string{mb2.String()}, "mb2"},
					{"delete mb2", nil, ""},
					{"insert mb1", []string{mb1.String()}, "mb1"},
				} {
					res := e.reconfigUDP("client", match, dst.String(), step.chain)
					if len(res) != 1 || res[0].Outcome != "succeeded" {
						t.Fatalf("%s: %+v", step.what, res)
					}
					r := res[0]
					t.Logf("%s: %.1f ms (lock %.1f, set-up %.1f)", step.what, float64(r.Micros)/1000, float64(r.LockMicros)/1000, float64(r.SetupMicros)/1000)
					d.running("the reconfiguration " + step.what + " ended")
				}
				e.carries("mb1")
				d.running("the three reconfigurations")
				d.check()
				if m := moved(drops, e.anchorDrops("client", "server")); len(m) > 0 {
					t.Errorf("drop counters moved at the anchors: %s", strings.Join(m, ", "))
				}
			})
		}
	}
}

// TestUDPQUICNFOnDemand: a network function started on demand for a live
// QUIC session (heterogeneous-sfc-quic §III.B, §VI.B). A download runs
// straight from the client to the server; the client inserts
// firewall@mb1, whose agent starts the firewall (iptables FORWARD DROP,
// conntrack's established traffic and new UDP sessions of the port
// accepted) before mb1 joins the path. The firewall starts exactly once
// (also for the IPv6 session after the IPv4 one), its conntrack holds the
// session tuple, and the download gets every byte. Then the client asks to
// replace it by broken@mb2, a function that never gets ready: the request
// fails with the reason, the session stays on mb1, and the download still
// ends intact on a connection that never migrated.
func TestUDPQUICNFOnDemand(t *testing.T) {
	testutil.RequireTools(t, "conntrack", "iptables", "ip6tables")
	h3Bin(t)
	starts := filepath.Join(t.TempDir(), "firewall-starts")
	const ports = "4460,4461"
	var fwStart []string
	for _, ipt := range []string{"iptables", "ip6tables"} {
		fwStart = append(fwStart,
			ipt+" -P FORWARD DROP",
			ipt+" -A FORWARD -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT",
			// A firewall started on a live session sees it mid-stream,
			// maybe first from the server: its port either way.
			ipt+" -A FORWARD -p udp -m multiport --ports "+ports+" -m conntrack --ctstate NEW -m comment --comment dysco-nf-firewall -j ACCEPT")
	}
	fw := []string{
		"--nf", "firewall.start=" + strings.Join(fwStart, " && ") + " && echo started >> " + starts + " && exec sleep infinity",
		"--nf", "firewall.ready=iptables -S FORWARD | grep -q dysco-nf-firewall && ip6tables -S FORWARD | grep -q dysco-nf-firewall",
		"--nf", "firewall.stop=iptables -F FORWARD; iptables -P FORWARD ACCEPT; ip6tables -F FORWARD; ip6tables -P FORWARD ACCEPT",
		"--nf", "firewall.start-timeout=10s",
	}
	broken := []string{"--nf", "broken.start=exec sleep infinity", "--nf", "broken.ready=false", "--nf", "broken.start-timeout=2s"}
	e := newLab(t, labOpts{topology: lab.Star("client", "mb1", "mb2", "server"), prefix: "un",
		hostArgs: map[string][]string{"mb1": fw, "mb2": broken}})
	if st := e.nfStatus("mb1", "firewall"); st.State != "stopped" || st.Starts != 0 {
		t.Fatalf("firewall before any demand: %+v", st)
	}
	for i, v6 := range []bool{false, true} {
		port := 4460 + i
		t.Run(fmt.Sprintf("ipv6=%v", v6), func(t *testing.T) {
			e := e.withT(t)
			client, dst, mb1, mb2 := e.addr("client", v6), e.addr("server", v6), e.addr("mb1", v6), e.addr("mb2", v6)
			fam, family := "ip", "ipv4"
			if v6 {
				fam, family = "ip6", "ipv6"
			}
			match := fmt.Sprintf("%s and udp dst port %d", fam, port)
			// A Dysco session straight to the server, reconfigurable.
			e.policy("client", fmt.Sprintf("n%d", port), match)
			drops := e.anchorDrops("client", "server")
			d := e.startH3(v6, port, 30_000_000, quicRate)
			e.waitUDPSession("client", port)

			res := e.reconfigUDP("client", match, dst.String(), []string{"firewall@" + mb1.String()})
			if len(res) != 1 || res[0].Outcome != "succeeded" {
				t.Fatalf("insert firewall@mb1: %+v", res)
			}
			r := res[0]
			t.Logf("insert firewall@mb1: %.1f ms (set-up %.1f ms, of which %.1f ms waiting for the firewall)", float64(r.Micros)/1000, float64(r.SetupMicros)/1000, float64(r.NFMicros)/1000)
			if !v6 && (r.NF != "firewall" || r.NFMicros <= 0 || r.NFMicros > r.SetupMicros) {
				t.Errorf("the wait for the firewall: nf %q, %d µs of a set-up of %d µs", r.NF, r.NFMicros, r.SetupMicros)
			}
			d.running("the firewall was inserted")
			e.carries("mb1")
			st := e.nfStatus("mb1", "firewall")
			if st.State != "ready" || st.Starts != 1 || st.Sessions < 1 || st.PID == 0 {
				t.Fatalf("firewall at mb1: %+v", st)
			}
			if b, err := os.ReadFile(starts); err != nil || strings.Count(string(b), "started") != 1 {
				t.Fatalf("firewall start commands run: %q (%v), want one", b, err)
			}
			// The firewall may have seen the session first from the
			// server (a download): its entry is in either direction.
			testutil.Eventually(t, 10*time.Second, "mb1's conntrack to hold the session", func() bool {
				ct := e.run("mb1", "conntrack", "-L", "-f", family, "-p", "udp")
				return anyLine(strings.Split(ct, "\n"), "="+client.String()+" ", "="+dst.String()+" ", fmt.Sprintf("port=%d ", port))
			})

			// A function that never gets ready: the request fails with
			// the reason, the session stays on mb1.
			res = e.reconfigUDP("client", match, dst.String(), []string{"broken@" + mb2.String()})
			if len(res) != 1 || res[0].Outcome != "failed" ||
				!strings.Contains(res[0].Reason, "network function broken could not be started at "+mb2.String()) ||
				!strings.Contains(res[0].Reason, "not ready within 2s") {
				t.Fatalf("replace firewall@mb1 by broken@mb2: %+v", res)
			}
			t.Logf("broken@mb2: %s (after %.1f ms)", res[0].Reason, float64(res[0].Micros)/1000)
			d.running("the broken function's request failed")
			e.carries("mb1")
			for _, s := range e.sessions("mb2") {
				if s.Proto == "udp" {
					t.Errorf("mb2 holds a UDP session: %+v", s)
				}
			}
			if st := e.nfStatus("mb2", "broken"); st.State != "failed" || st.Failures != uint64(i+1) || st.Sessions != 0 {
				t.Errorf("broken at mb2: %+v", st)
			}
			d.check()
			if st := e.nfStatus("mb1", "firewall"); st.Starts != 1 || st.State != "ready" {
				t.Errorf("firewall at mb1 after the download: %+v", st)
			}
			if m := moved(drops, e.anchorDrops("client", "server")); len(m) > 0 {
				t.Errorf("drop counters moved at the anchors: %s", strings.Join(m, ", "))
			}
		})
	}
}
