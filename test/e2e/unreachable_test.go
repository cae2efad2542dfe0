package e2e

import (
	"errors"
	"net/netip"
	"os"
	"syscall"
	"testing"
	"time"

	"github.com/dysco/dysco/internal/lab"
	"github.com/dysco/dysco/internal/testutil"
)

// TestUnreachableNextHop: a chain whose next hop cannot be reached fails the
// connection attempt at once and cleanly: the router's ICMP error names the
// subsession, and the client's agent translates it for the client's TCP.
// Nothing is left behind.
func TestUnreachableNextHop(t *testing.T) {
	for _, v6 := range []bool{false, true} {
		name := "ipv4"
		dead := netip.MustParseAddr("10.200.99.2") // no such subnet at the router
		if v6 {
			name, dead = "ipv6", netip.MustParseAddr("fd00:dc:0:99::2")
		}
		t.Run(name, func(t *testing.T) {
			e := newLab(t, labOpts{topology: lab.Star("client", "mb1", "server")})
			dst := e.addr("server", v6)
			e.policy("client", "dead", "tcp dst port 9700", dead.String())
			e.listen("server", netip.AddrPortFrom(dst, 9700))
			start := time.Now()
			c, err := e.dial("client", netip.AddrPortFrom(dst, 9700), 20*time.Second)
			if err == nil {
				c.Close()
				t.Fatal("connected through a chain whose next hop does not exist")
			}
			took := time.Since(start)
			var errno syscall.Errno
			if !errors.As(err, &errno) || (errno != syscall.ENETUNREACH && errno != syscall.EHOSTUNREACH) {
				t.Errorf("dial failed with %v, want network or host unreachable", err)
			}
			if errors.Is(err, os.ErrDeadlineExceeded) || took > 5*time.Second {
				t.Errorf("the connection attempt took %v to fail", took)
			}
			if n := e.status("client").Counters["icmp"]; n == 0 {
				t.Error("the client's agent translated no ICMP error")
			}
			testutil.Eventually(t, 15*time.Second, "the half-open session to be collected", func() bool { return len(e.sessions("client")) == 0 })
		})
	}
}
