package bench

// Benchmark "churn": the churn runner on IssueChurnSpec's workload, in a
// lab of its own.

import (
	"context"
	"errors"
	"fmt"
	"math"
	"path/filepath"
	"strings"
	"time"

	"github.com/dysco/dysco/internal/lab"
	"github.com/dysco/dysco/internal/labkit"
)

// Phases of the churn benchmark, which builds its own lab.
const (
	churnLabs     = "labs, churn"
	churnTeardown = "teardown, churn"
)

func churnPhaseName(o *Options) string {
	return fmt.Sprintf("reconfiguration under churn, %d rounds", o.ChurnRounds)
}

// churnEst estimates the benchmark: 1 s before the first round, rounds of
// about 0.55 s, the checks and wrk's stop.
func churnEst(o *Options) time.Duration {
	return time.Second + time.Duration(o.ChurnRounds)*550*time.Millisecond + 8*time.Second
}

// runChurnBench builds the churn benchmark's lab (IssueChurnSpec's star:
// client, mb1, mb2, server), runs the benchmark and tears the lab down.
func runChurnBench(ctx context.Context, o *Options, set *labkit.Labs, prefix string, r *Report, pr *labkit.Progress, step func(string, func() error)) {
	name := churnPhaseName(o)
	if ctx.Err() != nil {
		r.fail(name, errors.New("not run: interrupted"))
		return
	}
	pr.Begin(churnLabs)
	pr.Logf("building lab %s (star client, mb1, mb2, server)", prefix+"ch")
	l, err := set.Up(ctx, prefix+"ch", lab.Star("client", "mb1", "mb2", "server"), o.Agents())
	if err != nil {
		r.fail(churnLabs, err)
		pr.Logf("%s FAILED: %v", churnLabs, err)
		pr.Skip(name)
		r.fail(name, errors.New("not run: the lab could not be built"))
	} else {
		step(name, func() error { return benchChurn(ctx, o, l, r, pr) })
	}
	pr.Begin(churnTeardown)
	if err := set.Down(); err != nil {
		r.fail(churnTeardown, err)
	}
}

// benchChurn runs IssueChurnSpec's workload for o.ChurnRounds rounds and adds
// the reconfiguration time under churn: p50 and p99 of the succeeded
// results, with the target p99 < 50 ms and no reset.
func benchChurn(ctx context.Context, o *Options, l *lab.Lab, r *Report, pr *labkit.Progress) error {
	spec := IssueChurnSpec(l, o.Dysco, false)
	spec.Duration, spec.MaxRounds = 0, o.ChurnRounds
	spec.Logf = pr.Logf
	cr, err := RunChurn(ctx, spec)
	r.Details["churn"] = cr
	if err != nil {
		if dir, lerr := labkit.SaveLabLogs(l, filepath.Join(o.OutDir, r.RunID+"-churn-logs")); lerr == nil {
			err = fmt.Errorf("%w (logs of the lab's agents and nginx copied to %s)", err, dir)
		}
		return err
	}
	problems := cr.Problems()
	met := cr.Times.N > 0 && cr.Times.P99 < 50 && cr.ResetCount() == 0 && cr.KernelResetCount() == 0 && len(problems) == 0
	var wrk []string
	for _, w := range cr.Wrk {
		wrk = append(wrk, fmt.Sprintf("%d requests (%.0f/s), socket errors connect %d, read %d, write %d, timeout %d, non-2xx %d",
			w.Requests, w.RPS, w.Connect, w.Read, w.Write, w.Timeout, w.Non2xx))
	}
	results := 0
	for _, rd := range cr.Rounds {
		results += len(rd.Results)
	}
	note := fmt.Sprintf("%d rounds, %d results (%s); p90 %.2f ms, max %.2f ms over the %d succeeded; wrk: %s; kernel reset counters over the workload: %s; "+
		"%d results slower than 1 s (not \"session ended\" of an ended session); %d results that do not fit their session's fate",
		len(cr.Rounds), results, strings.Join(labkit.SortedCounts(cr.Outcomes), ", "), cr.Times.P90, cr.Times.Max, cr.Times.N, strings.Join(wrk, "; "),
		labkit.CountsText(cr.KernelResets), cr.ClassCount(ClassSlow), len(cr.Unexpected))
	if len(problems) > 0 {
		note += "; problems: " + strings.Join(problems, "; ")
		if dir, lerr := labkit.SaveLabLogs(l, filepath.Join(o.OutDir, r.RunID+"-churn-logs")); lerr == nil {
			note += fmt.Sprintf(" (logs and churn.log in %s)", dir)
		}
	}
	r.add(&Figure{
		Key:  "churn-reconfig",
		Name: fmt.Sprintf("reconfiguration time under churn, %d rounds (nginx keepalive_requests 200, wrk -c50)", o.ChurnRounds),
		Command: fmt.Sprintf("ip netns exec LAB-client wrk -t2 -c50 --timeout 4s http://%s/file (64 KiB); from 1 s on, 0.5 s after each round returned: "+
			"ip netns exec LAB-client dysco reconfig --json --match 'tcp dst port 80' --to %s --chain MB2, then MB1, …", spec.Lab.Host("server").Addr4, spec.Lab.Host("server").Addr4),
		Unit: "ms", Dysco: cr.Times.P50, Baseline: math.NaN(), Ratio: math.NaN(),
		DyscoText: fmt.Sprintf("%.2f ms (p99 %.2f)", cr.Times.P50, cr.Times.P99),
		Measured:  cr.Times.P99, MeasuredUnit: "ms p99",
		Target: "p99 < 50 ms, 0 resets", Met: metStr(met), Note: note,
	})
	return nil
}
