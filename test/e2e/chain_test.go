package e2e

import (
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/dysco/dysco/internal/lab"
	"github.com/dysco/dysco/internal/testutil"
)

const mib = 1 << 20

// transferSize is what each direction carries in the byte-exact checks
// (100 MB each way; -short uses 8 MB).
func transferSize() int64 {
	if testing.Short() {
		return 8 * mib
	}
	return 100 * mib
}

// nginx starts nginx on a host, serving dir on port 80 of both addresses
// (and of its session addresses, if it has them), and waits until it
// accepts connections.
func (e *env) nginx(host, dir string) {
	e.t.Helper()
	h := e.host(host)
	addrs := []netip.Addr{h.Addr4, h.Addr6}
	if h.SessionAddr4.IsValid() {
		addrs = append(addrs, h.SessionAddr4, h.SessionAddr6)
	}
	conf, err := lab.WriteNginxConfig(dir, 80, addrs...)
	if err != nil {
		e.t.Fatal(err)
	}
	if _, err := e.lab.Start(host, "nginx", "nginx", "-c", conf, "-p", dir); err != nil {
		e.t.Fatal(err)
	}
	testutil.Eventually(e.t, 10*time.Second, "nginx to accept connections", func() bool {
		c, err := e.dial(host, netip.AddrPortFrom(h.Addr4, 80), time.Second)
		if err != nil {
			return false
		}
		c.Close()
		return true
	})
}

// randomFile writes n random bytes and returns the file's SHA-256.
func randomFile(t *testing.T, path string, n int64) string {
	t.Helper()
	f, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	h := sha256.New()
	if _, err := io.Copy(io.MultiWriter(f, h), io.LimitReader(rand.Reader, n)); err != nil {
		t.Fatal(err)
	}
	return hex.EncodeToString(h.Sum(nil))
}

// curlHash downloads url from host with curl and returns the SHA-256 of what
// arrived.
func (e *env) curlHash(host, url string) string {
	e.t.Helper()
	out := e.run(host, "sh", "-c", fmt.Sprintf("curl -sS -f -g --max-time 120 %s | sha256sum", url))
	return strings.Fields(out)[0]
}

func urlFor(a netip.Addr, path string) string {
	if a.Is6() {
		return fmt.Sprintf("http://[%s]%s", a, path)
	}
	return fmt.Sprintf("http://%s%s", a, path)
}

// chainScenario sets up client -> mbs... -> server with a policy on the
// client for port 80 and 5201 and the test's own port, checks every transfer
// byte for byte, and checks what the middleboxes saw.
func TestChainOneMiddlebox(t *testing.T) {
	for _, v6 := range []bool{false, true} {
		for _, mode := range []string{"default", "txcsum-off", "partial-checked"} {
			name := fmt.Sprintf("ipv6=%v/txcsum-off=%v", v6, mode == "txcsum-off")
			if mode == "partial-checked" {
				name = fmt.Sprintf("ipv6=%v/partial-checked", v6)
			}
			t.Run(name, func(t *testing.T) {
				e := newLab(t, labOpts{topology: lab.Star("client", "mb1", "server")})
				switch mode {
				case "txcsum-off":
					e.txOff("client", "mb1", "server")
				case "partial-checked":
					// Offloads stay on at client, mb1 and server, so that
					// every rewrite there sees CHECKSUM_PARTIAL skbs (the
					// checksum field holds the pseudo header's sum), which
					// veth would deliver unchecked; only the router's last
					// hops to the end hosts compute checksums in software,
					// from the fields the datapath wrote, so that the end
					// hosts check them.
					e.run("router", "ethtool", "-K", "r-1", "tx", "off")
					e.run("router", "ethtool", "-K", "r-3", "tx", "off")
				}
				dst := e.addr("server", v6)
				mb := e.addr("mb1", v6)
				e.policy("client", "web", "tcp and (dst port 80 or dst port 5201 or dst port 9000)", mb.String())

				dir := t.TempDir()
				e.nginx("server", dir)
				want := randomFile(t, filepath.Join(dir, "www", "blob"), transferSize())

				tap := e.capture("mb1", "dysco-tap", "tcp port 9000")
				wire := e.capture("mb1", "eth0", "tcp")
				if got := e.curlHash("client", urlFor(dst, "/blob")); got != want {
					t.Fatalf("curl through the chain: sha256 %s, want %s", got, want)
				}
				peer := e.exchange("client", "server", dst, 9000, transferSize())
				tapLines := tap()
				wireLines := wire()

				// The unmodified server sees the original session.
				clientAddr := e.addr("client", v6)
				if peer.Addr() != clientAddr {
					t.Errorf("the server saw the session from %s, want the client %s", peer, clientAddr)
				}
				// The monitor on the session-view tap saw the session tuple.
				sawSession := false
				for _, l := range tapLines {
					if strings.Contains(l, clientAddr.String()+".") && strings.Contains(l, dst.String()+".9000") {
						sawSession = true
						break
					}
				}
				if !sawSession {
					t.Errorf("tcpdump on dysco-tap did not see the session %s -> %s:9000; it saw:\n%s", clientAddr, dst, strings.Join(head(tapLines, 5), "\n"))
				}
				// It saw the SYN as the server does: the local tag (option
				// 253) never leaves mb1, not even to its monitors.
				sawSYN := false
				for _, l := range tapLines {
					if strings.Contains(l, "Flags [S]") {
						sawSYN = true
						if strings.Contains(l, "unknown-253") || strings.Contains(l, "exp-") {
							t.Errorf("the tap's SYN carries the local tag: %s", l)
						}
					}
				}
				if !sawSYN {
					t.Errorf("tcpdump on dysco-tap saw no SYN; it saw:\n%s", strings.Join(head(tapLines, 5), "\n"))
				}
				// On the wire, the middlebox's packets carry subsession
				// tuples: nothing from client to server directly.
				for _, l := range head(wireLines, 2000) {
					if strings.Contains(l, clientAddr.String()+".") && strings.Contains(l, "> "+dst.String()+".") {
						t.Errorf("the wire at mb1 carried the session tuple (no rewrite): %s", l)
						break
					}
				}
				if fwd, rev := e.iperf("client", "server", dst, 5201, 1); fwd <= 0 || rev <= 0 {
					t.Errorf("iperf3 moved %v bytes forward and %v in reverse", fwd, rev)
				}
				st := e.status("mb1")
				if st.Counters["setup_cont"] < 2 {
					t.Errorf("mb1 continued %d chains, want at least 2 (curl and the exchange)", st.Counters["setup_cont"])
				}
				for _, c := range []string{"drop_helper", "drop_no_route", "drop_malformed"} {
					for _, h := range []string{"client", "mb1", "server"} {
						if n := e.status(h).Counters[c]; n != 0 {
							t.Errorf("%s: %s = %d", h, c, n)
						}
					}
				}
				// Teardown: every session ends on every host, and
				// nothing of it stays in the datapath's maps.
				for _, h := range []string{"client", "mb1", "server"} {
					testutil.Eventually(t, 15*time.Second, "sessions on "+h+" to be collected", func() bool { return len(e.sessions(h)) == 0 })
					testutil.Eventually(t, 5*time.Second, "the flows and set-up state of "+h+" to be freed", func() bool {
						n := 0
						for _, m := range []string{"dysco_flows4", "dysco_flows6", "dysco_syns", "dysco_deltas", "dysco_sessions"} {
							n += e.pinnedEntries(h, m)
						}
						return n == 0
					})
				}
			})
		}
	}
}

func head(s []string, n int) []string {
	if len(s) > n {
		return s[:n]
	}
	return s
}
