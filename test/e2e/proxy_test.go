package e2e

import (
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/dysco/dysco/internal/lab"
)

// haproxy starts an unmodified HAProxy in TCP mode with splicing forced on,
// under libdysco's LD_PRELOAD, relaying listen to backend, and waits until
// it accepts connections.
func (e *env) haproxy(host string, listen, backend netip.AddrPort) {
	e.t.Helper()
	dir := e.t.TempDir()
	conf := filepath.Join(dir, "haproxy.cfg")
	cfg := fmt.Sprintf(`global
    maxconn 2000
defaults
    mode tcp
    timeout connect 5s
    timeout client 120s
    timeout server 120s
    option splice-request
    option splice-response
listen relay
    bind %s
    server backend %s
`, listen, backend)
	if err := os.WriteFile(conf, []byte(cfg), 0o644); err != nil {
		e.t.Fatal(err)
	}
	if _, err := e.lab.Start(host, "haproxy", "env", "LD_PRELOAD="+libdysco, "haproxy", "-db", "-f", conf); err != nil {
		e.t.Fatal(err)
	}
	eventually(e.t, 10*time.Second, "haproxy to accept connections", func() bool {
		c, err := e.dial(host, listen, time.Second)
		if err != nil {
			return false
		}
		c.Close()
		return true
	})
}

// TestProxyRemoval: an unmodified HAProxy that splices its sockets is
// removed from a live session while data flows both ways (paper §2.4,
// §4.2); the session goes on directly between client and server, every byte
// arrives, and the proxy host sees none of the session's packets afterwards.
func TestProxyRemoval(t *testing.T) {
	for _, off := range []bool{false, true} {
		name := "offload"
		if off {
			name = "tx-csum-off"
		}
		t.Run(name, func(t *testing.T) { proxyRemoval(t, off) })
	}
}

func proxyRemoval(t *testing.T, off bool) {
	e := newLab(t, labOpts{topology: lab.Star("client", "proxy", "server")})
	if off {
		e.txOff("client", "proxy", "server")
	}
	proxy, server := e.addr("proxy", false), e.addr("server", false)
	// Both TCP sessions are Dysco sessions with no middlebox, so that
	// they can be reconfigured (joined) later.
	e.policy("client", "to-proxy", "tcp dst port 9400")
	e.policy("proxy", "to-server", "tcp dst port 9401")
	e.haproxy("proxy", netip.AddrPortFrom(proxy, 9400), netip.AddrPortFrom(server, 9401))

	const total = 64 * mib
	before := e.status("proxy").Counters
	lt := e.startTransferVia("client", "server", netip.AddrPortFrom(server, 9401), netip.AddrPortFrom(proxy, 9400), total, 8*mib)
	eventually(t, 30*time.Second, "the proxy to leave the path", func() bool {
		return len(e.sessions("server")) > 0 && e.status("proxy").Counters["rewrite_in"] > before["rewrite_in"] &&
			clientGoesDirect(e, server)
	})
	if lt.received.Load() >= total {
		t.Fatal("the transfer ended before the proxy left: pace it slower")
	}
	at := rewrites(e.status("proxy"))
	n := lt.received.Load()
	eventually(t, 30*time.Second, "more data", func() bool { return lt.received.Load() > n+4*mib })
	if got := rewrites(e.status("proxy")); got != at {
		t.Errorf("the proxy host still rewrites the session's packets after leaving: %d -> %d", at, got)
	}
	lt.wait(t)
	for _, s := range e.sessions("client") {
		t.Logf("client session %s: right %s, %d/%d bytes", s.Session, s.Right, s.BytesFwd, s.BytesRev)
	}
	st := e.status("proxy")
	t.Logf("proxy: rewrite_in %d, drop_orphan %d", st.Counters["rewrite_in"], st.Counters["drop_orphan"])
}

// clientGoesDirect tells whether the client's session now has its right
// subsession to the server.
func clientGoesDirect(e *env, server netip.Addr) bool {
	for _, s := range e.sessions("client") {
		if strings.Contains(s.Right, "-> "+server.String()+":") {
			return true
		}
	}
	return false
}
