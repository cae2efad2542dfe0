package e2e

import (
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/dysco/dysco/internal/api"
	"github.com/dysco/dysco/internal/lab"
	"github.com/dysco/dysco/internal/testutil"
)

// TestReconfigureOnPath: a host carries a session once (its datapath holds
// one state per session tuple). An IPv4 and an IPv6 session, both through
// mb2, are moved through mb1 and back while their data flows; on the way:
//   - a chain equal to the segment succeeds "unchanged", touching nothing;
//   - a chain that keeps mb2 and adds mb1 is refused, naming mb2 (the left
//     anchor sees mb2 in the ackLock's list of the old segment);
//   - a new path from mb1 through the client, which is on the session's
//     path before the segment, is refused by the client's agent;
//   - mb1 holds joined sessions of both families at once, and tearing the
//     IPv4 one down leaves the IPv6 one alone (the two halves of an agent
//     number their joined sessions apart).
//
// Both streams are checked byte for byte.
func TestReconfigureOnPath(t *testing.T) {
	e := newLab(t, labOpts{topology: lab.Star("client", "mb1", "mb2", "server")})
	type fam struct {
		name          string
		port          uint16
		dst, mb1, mb2 netip.Addr
		client, match string
		lt            *liveTransfer
	}
	var fams []*fam
	for _, v6 := range []bool{false, true} {
		f := &fam{name: "ipv4", port: 9310, dst: e.addr("server", v6), mb1: e.addr("mb1", v6), mb2: e.addr("mb2", v6)}
		filter := "ip and tcp dst port 9310"
		if v6 {
			f.name, f.port, filter = "ipv6", 9311, "ip6 and tcp dst port 9311"
		}
		f.match = strings.TrimPrefix(strings.TrimPrefix(filter, "ip6 and "), "ip and ")
		e.policy("client", f.name, filter, f.mb2.String())
		fams = append(fams, f)
	}
	const total = 64 * mib
	for _, f := range fams {
		f.lt = e.startTransfer("client", "server", f.dst, f.port, total, 8*mib)
	}
	for _, f := range fams {
		testutil.Eventually(t, 30*time.Second, f.name+" transfer to start", func() bool { return f.lt.received.Load() > 2*mib })
	}
	one := func(what string, res []api.ReconfigResult) api.ReconfigResult {
		t.Helper()
		if len(res) != 1 {
			t.Fatalf("%s: %d results: %+v", what, len(res), res)
		}
		t.Logf("%s: %s %s (%.2f ms)", what, res[0].Outcome, res[0].Reason, float64(res[0].Micros)/1000)
		return res[0]
	}
	move := func(f *fam, to netip.Addr) {
		t.Helper()
		if r := one(f.name+" through "+to.String(), e.reconfig("client", f.match, f.dst, to)); r.Outcome != "succeeded" || r.Unchanged {
			t.Fatalf("%+v", r)
		}
	}
	v4, v6 := fams[0], fams[1]

	// Unchanged: nothing is set up, nothing moves.
	before := e.status("mb1").Counters["rewrite_in"]
	if r := one("ipv4 through mb2 again", e.reconfig("client", v4.match, v4.dst, v4.mb2)); r.Outcome != "succeeded" || !r.Unchanged ||
		!strings.Contains(r.Reason, "unchanged") {
		t.Fatalf("%+v", r)
	}
	// Crossing the old segment: refused with the hop named.
	if r := one("ipv6 through mb2 and mb1", e.reconfig("client", v6.match, v6.dst, v6.mb2, v6.mb1)); r.Outcome != "refused" ||
		!strings.Contains(r.Reason, v6.mb2.String()+" is already on the session's path") {
		t.Fatalf("%+v", r)
	}
	if after := e.status("mb1").Counters["rewrite_in"]; after != before {
		t.Fatalf("mb1 rewrote %d packets after requests that change nothing", after-before)
	}

	move(v4, v4.mb1)
	move(v6, v6.mb1)
	e.carries("mb1")
	// From mb1, a new path through the client, which the session crosses
	// before mb1: the client's agent refuses to join it.
	cl := e.addr("client", true)
	if r := one("ipv6 from mb1 through the client", e.reconfig("mb1", v6.match, v6.dst, cl)); r.Outcome != "refused" ||
		!strings.Contains(r.Reason, cl.String()+" is already on the session's path") {
		t.Fatalf("%+v", r)
	}
	// mb1 leaves the IPv4 session's path; the IPv6 one goes on through it.
	move(v4, v4.mb2)
	at := v6.lt.received.Load()
	testutil.Eventually(t, 30*time.Second, "the ipv6 transfer to go on through mb1", func() bool { return v6.lt.received.Load() > at+4*mib })
	testutil.Eventually(t, 10*time.Second, "mb1 to free the ipv4 session (after its linger)", func() bool { return len(e.sessions("mb1")) == 1 })
	at = v6.lt.received.Load()
	testutil.Eventually(t, 30*time.Second, "the ipv6 transfer to go on after that", func() bool { return v6.lt.received.Load() > at+4*mib })
	if s := e.sessions("mb1"); len(s) != 1 || !strings.HasPrefix(s[0].Session, "fd00:") && !strings.HasPrefix(s[0].Session, "[") {
		t.Fatalf("mb1 keeps %+v, want the ipv6 session", s)
	}
	move(v6, v6.mb2)
	for _, f := range fams {
		f.lt.wait(t)
	}
	for _, h := range []string{"client", "mb1", "mb2", "server"} {
		if n := e.status(h).Counters["rst"]; n != 0 {
			t.Errorf("%s saw %d RSTs", h, n)
		}
	}
}
