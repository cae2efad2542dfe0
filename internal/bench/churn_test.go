package bench

import (
	"net/netip"
	"testing"
)

func TestChurnKind(t *testing.T) {
	for _, c := range []struct {
		cur, next []string
		want      string
	}{
		{nil, nil, "unchanged"},
		{[]string{"mb1"}, []string{"mb1"}, "unchanged"},
		{[]string{"mb1", "mb2"}, []string{"mb1", "mb2"}, "unchanged"},
		{[]string{"mb1", "mb2"}, []string{"mb2", "mb1"}, "overlap"},
		{[]string{"mb1"}, []string{"mb1", "mb3"}, "overlap"},
		{[]string{"mb1", "mb2"}, []string{"mb2"}, "overlap"},
		{nil, []string{"mb2"}, "insert"},
		{[]string{"mb2"}, nil, "delete"},
		{[]string{"mb1"}, []string{"mb2", "mb3"}, "replace"},
	} {
		if got := churnKind(c.cur, c.next); got != c.want {
			t.Errorf("churnKind(%v, %v) = %s, want %s", c.cur, c.next, got, c.want)
		}
	}
}

func TestParseChurnWrk(t *testing.T) {
	out := `Running 60m test @ http://10.200.5.2:80/file
  2 threads and 50 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency     2.14ms    1.04ms  63.88ms   94.38%
    Req/Sec    11.78k   833.72    13.61k    71.75%
  469340 requests in 20.02s, 28.75GB read
  Socket errors: connect 1, read 100, write 2, timeout 3
  Non-2xx or 3xx responses: 4
Requests/sec:  23444.97
Transfer/sec:      1.44GB
`
	w := parseChurnWrk(out)
	if w.Requests != 469340 || w.RPS != 23444.97 || w.Connect != 1 || w.Read != 100 || w.Write != 2 || w.Timeout != 3 || w.Non2xx != 4 || w.SocketErrors() != 106 {
		t.Errorf("parseChurnWrk = %+v", w)
	}
	if w := parseChurnWrk("  10 requests in 1.00s, 1MB read\nRequests/sec: 10.00\n"); w.Requests != 10 || w.SocketErrors() != 0 {
		t.Errorf("without errors: %+v", w)
	}
}

func TestParseSession(t *testing.T) {
	src, dst, ok := parseSession("[fd00:dc:0:1::2]:38276 -> [fd00:dc:0:4::2]:80")
	if !ok || src != netip.MustParseAddrPort("[fd00:dc:0:1::2]:38276") || dst.Port() != 80 {
		t.Errorf("IPv6: %v %v %v", src, dst, ok)
	}
	src, dst, ok = parseSession("10.200.1.2:34680 -> 10.200.4.2:80")
	if !ok || src.Addr() != netip.MustParseAddr("10.200.1.2") || dst != netip.MustParseAddrPort("10.200.4.2:80") {
		t.Errorf("IPv4: %v %v %v", src, dst, ok)
	}
	if _, _, ok := parseSession("nonsense"); ok {
		t.Error("parsed nonsense")
	}
}

// TestSockFate: a session's fate after a round is what the polls after the
// round's end saw; a tuple used again is a new life.
func TestSockFate(t *testing.T) {
	tr := &sockTracker{lives: map[[2]netip.AddrPort][]*sockLife{}}
	a := netip.MustParseAddrPort("10.0.0.1:40000")
	b := netip.MustParseAddrPort("10.0.0.2:80")
	for _, x := range []struct {
		open bool
		at   float64
	}{{true, 1.0}, {true, 1.05}, {true, 1.1}, {false, 1.15}, {false, 1.2}, {true, 3.0}, {true, 3.05}} {
		tr.observe(a, b, x.open, x.at)
	}
	tr.now = 3.05
	for _, c := range []struct {
		at, end float64
		want    string
	}{
		{1.0, 1.08, "alive"}, // a poll after the round saw it open
		{1.0, 1.12, "ended"}, // closed at the next poll
		{1.02, 2.0, "ended"}, // ended during a long round
		{2.9, 3.02, "alive"}, // the tuple's second life
		{0.0, 0.5, "unseen"}, // before it was seen
		{2.5, 2.7, "ended"},  // between the lives: the first one, closed
	} {
		if got := tr.fate(a, b, c.end); got != c.want {
			t.Errorf("fate of a round %.2f–%.2f = %s, want %s", c.at, c.end, got, c.want)
		}
	}
	if !tr.aliveNow(a, b) {
		t.Error("not alive at the last poll")
	}
	if n := len(tr.lives[[2]netip.AddrPort{a, b}]); n != 2 {
		t.Errorf("%d lives, want 2", n)
	}
}
