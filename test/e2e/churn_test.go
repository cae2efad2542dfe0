package e2e

import (
	"context"
	"fmt"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/dysco/dysco/internal/bench"
	"github.com/dysco/dysco/internal/lab"
	"github.com/dysco/dysco/internal/testutil"
)

// TestReconfigureUnderChurn reconfigures keep-alive HTTP sessions while
// nginx closes them and wrk opens new ones: nginx on the server closes each
// connection after 200 requests of a 64 KiB file, `wrk -t2 -c50` asks from
// the client, whose policy chains port 80 through mb1, and from 1 s on,
// every 0.5 s for 6 s, the client replaces the middlebox of every live
// session by mb2, then by mb1, and so on (`dysco reconfig --match 'tcp dst
// port 80' --to SERVER --chain MB`). Rounds towards mb1 find both sessions
// on mb2 (replaced) and sessions opened through mb1 since the last round
// (their path is the chain asked for), and sessions end in the middle of
// rounds.
//
// No connection may be reset (wrk's socket errors, the ends' and the
// middleboxes' reset counters), every session still open after a round
// must have been reconfigured, a session that ended during a round reports
// "session ended", and no result takes longer than a second unless it is
// "session ended" for a session that did end. The runner is the churn experiment's (internal/bench,
// RunChurn); what became of each session comes from the client's sockets.
func TestReconfigureUnderChurn(t *testing.T) {
	testutil.RequireTools(t, "wrk", "nginx", "nstat")
	for _, c := range []struct {
		name string
		v6   bool
	}{{"ipv4", false}, {"ipv6", true}} {
		t.Run(c.name, func(t *testing.T) { reconfigureUnderChurn(t, c.v6) })
	}
}

func reconfigureUnderChurn(t *testing.T, v6 bool) {
	e := newLab(t, labOpts{topology: lab.Star("client", "mb1", "mb2", "server"), prefix: "ch"})
	spec := bench.IssueChurnSpec(e.lab, dyscoBin, v6)
	spec.Logf = t.Logf
	ctx, cancel := context.WithTimeout(t.Context(), 3*time.Minute)
	defer cancel()
	res, err := bench.RunChurn(ctx, spec)
	if err != nil {
		t.Fatalf("churn run: %v", err)
	}
	for _, rd := range res.Rounds {
		t.Logf("round %d at %.2f s, chain %v: %s", rd.N, rd.At, rd.Chain, summary(rd))
	}
	var outcomes []string
	results := 0
	for k, n := range res.Outcomes {
		outcomes = append(outcomes, fmt.Sprintf("%s ×%d", k, n))
		results += n
	}
	sort.Strings(outcomes)
	t.Logf("%d rounds, %d results: %s; reconfiguration times of the %d succeeded: p50 %.1f ms, p90 %.1f, p99 %.1f, max %.1f",
		len(res.Rounds), results, strings.Join(outcomes, ", "), res.Times.N, res.Times.P50, res.Times.P90, res.Times.P99, res.Times.Max)
	for _, w := range res.Wrk {
		t.Logf("wrk (%s): %d requests, %.0f/s; socket errors connect %d, read %d, write %d, timeout %d; non-2xx %d",
			w.Family, w.Requests, w.RPS, w.Connect, w.Read, w.Write, w.Timeout, w.Non2xx)
	}
	t.Logf("kernel resets over the workload: %v (RSTs sent by the ends, for information: %v)", res.KernelResets, res.KernelOutRsts)

	// The workload and the rounds ran.
	if len(res.Wrk) != 1 || res.Wrk[0].Requests == 0 {
		t.Fatalf("wrk did not run: %+v", res.Wrk)
	}
	// Stalled rounds make fewer rounds: that is checked below, by the
	// results' times.
	if len(res.Rounds) < 2 || res.Times.N == 0 {
		t.Fatalf("%d rounds, %d reconfigurations succeeded: the rounds did not run", len(res.Rounds), res.Times.N)
	}
	for _, x := range res.Errors {
		t.Errorf("round error: %s", x)
	}
	// No connection reset.
	if w := res.Wrk[0]; w.SocketErrors() != 0 || w.Non2xx != 0 {
		t.Errorf("wrk: socket errors connect %d, read %d, write %d, timeout %d; non-2xx %d: want none", w.Connect, w.Read, w.Write, w.Timeout, w.Non2xx)
	}
	for k, v := range res.KernelResets {
		if v != 0 {
			t.Errorf("%s went up by %d during the workload: want 0", k, v)
		}
	}
	// Every result fits what became of its session.
	for _, class := range []string{bench.ClassLiveNotReconfigured, bench.ClassEndedOtherReason, bench.ClassClaimedEnded, bench.ClassSlow} {
		if n := res.ClassCount(class); n > 0 {
			var ex []string
			for _, rd := range res.Rounds {
				for _, o := range rd.Results {
					for _, c := range o.Classes {
						if c == class && len(ex) < 5 {
							ex = append(ex, fmt.Sprintf("round %d: %s %s%s after %.1f ms (socket %s)", rd.N, o.Session, o.Outcome, reason(o.Reason), float64(o.Micros)/1000, o.Fate))
						}
					}
				}
			}
			t.Errorf("%d results: %s; e.g. %s", n, class, strings.Join(ex, "; "))
		}
	}
	// Nothing left in a phase once the rounds were over.
	for _, x := range res.Stuck {
		if !strings.Contains(x, bench.ClassSlow) {
			t.Errorf("stuck: %s", x)
		}
	}
	for _, x := range res.Leftover {
		t.Logf("phase left on an ended session: %s", x)
	}
}

func summary(rd *bench.ChurnRound) string {
	if rd.Err != "" {
		return "error: " + rd.Err
	}
	n := map[string]int{}
	var worst int64
	for _, o := range rd.Results {
		k := o.Outcome + reason(o.Reason)
		n[k]++
		worst = max(worst, o.Micros)
	}
	var parts []string
	for k, v := range n {
		parts = append(parts, fmt.Sprintf("%d %s", v, k))
	}
	sort.Strings(parts)
	return fmt.Sprintf("%d results (%s), slowest %.1f ms, %.0f ms wall", len(rd.Results), strings.Join(parts, ", "), float64(worst)/1000, rd.WallMs)
}

func reason(r string) string {
	if r == "" {
		return ""
	}
	return " (" + r + ")"
}
