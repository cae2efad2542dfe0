package experiment

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os/exec"
	"path/filepath"
	"time"
)

// Run runs the benchmarks o asks for and returns the report, also when some
// failed (their errors are in Report.Errors and in the returned error). It
// tears down every lab it built before returning.
func Run(ctx context.Context, o *Options, log io.Writer) (rep *Report, err error) {
	o.defaults()
	bin, err := exec.LookPath(o.Dysco)
	if err != nil {
		return nil, fmt.Errorf("dysco binary: %w (run `make build`, or give --dysco)", err)
	}
	if o.Dysco, err = filepath.Abs(bin); err != nil {
		return nil, err
	}
	tools := []string{"iperf3", "wrk", "nginx", "ethtool", "ip"}
	if o.wants("reconfig") {
		tools = append(tools, "haproxy")
	}
	if o.wants("reconfig") || o.wants("disruption") {
		tools = append(tools, "sysctl")
	}
	if o.wants("churn") {
		tools = append(tools, "nstat")
	}
	for _, tool := range tools {
		if _, err := exec.LookPath(tool); err != nil {
			return nil, fmt.Errorf("%s is missing: run scripts/deps.sh (%w)", tool, err)
		}
	}
	r := newReport(o)
	pr := newProgress(log, phasesOf(plan(o)))
	set := &labSet{}
	defer func() {
		if derr := set.down(); derr != nil {
			err = errors.Join(err, derr)
		}
		r.Finished = time.Now().UTC()
		if len(r.Errors) > 0 && err == nil {
			err = fmt.Errorf("%d benchmark(s) failed: see the report", len(r.Errors))
		}
	}()
	prefix := runID()
	r.RunID = prefix
	pr.logf("run %s: %s (lab names %s*)", prefix, describe(o), prefix)

	// step runs one benchmark unless the run was interrupted; a failure is
	// recorded and the run goes on with the next one.
	step := func(phaseName string, fn func() error) {
		if ctx.Err() != nil {
			pr.skip(phaseName)
			r.fail(phaseName, errors.New("not run: interrupted"))
			return
		}
		pr.begin(phaseName)
		if err := fn(); err != nil {
			if ctx.Err() != nil {
				err = fmt.Errorf("interrupted: %w", err)
			}
			r.fail(phaseName, err)
			pr.logf("%s FAILED: %v", phaseName, err)
		}
	}

	for _, nmb := range []int{1, 4} {
		var phases []string
		for _, ph := range plan(o) {
			if ph.nmb == nmb && ph.bench != "" {
				phases = append(phases, ph.name)
			}
		}
		if len(phases) == 0 {
			continue
		}
		if ctx.Err() != nil {
			for _, ph := range phases {
				r.fail(ph, errors.New("not run: interrupted"))
			}
			continue
		}
		labs := fmt.Sprintf("labs, %d mb", nmb)
		pr.begin(labs)
		p, err := upPair(ctx, o, set, prefix, nmb, pr)
		if err != nil {
			r.fail(labs, err)
			pr.logf("%s FAILED: %v", labs, err)
			for _, ph := range phases {
				pr.skip(ph)
				r.fail(ph, fmt.Errorf("not run: the labs could not be built"))
			}
		} else {
			for _, ph := range plan(o) {
				if ph.nmb != nmb || ph.bench == "" {
					continue
				}
				step(ph.name, func() error { return ph.run(ctx, o, p, r, pr) })
			}
			p.close()
		}
		teardown := fmt.Sprintf("teardown, %d mb", nmb)
		pr.begin(teardown)
		if err := set.down(); err != nil {
			r.fail(teardown, err)
		}
	}
	if o.wants("reconfig") {
		runReconfig(ctx, o, set, prefix, r, pr, step)
	}
	if o.wants("churn") {
		runChurnBench(ctx, o, set, prefix, r, pr, step)
	}
	if o.wants("disruption") {
		runDisruption(ctx, o, set, prefix, r, pr, step)
	}
	if ctx.Err() != nil {
		return r, ctx.Err()
	}
	return r, nil
}

// Phases of the reconfig benchmark, which builds its own lab.
const (
	reconfigLabs     = "labs, proxy removal"
	reconfigTeardown = "teardown, proxy removal"
)

// runReconfig builds the reconfig benchmark's lab, runs the benchmark and
// tears the lab down.
func runReconfig(ctx context.Context, o *Options, set *labSet, prefix string, r *Report, pr *progress, step func(string, func() error)) {
	name := reconfigPhaseName(o)
	if ctx.Err() != nil {
		r.fail(name, errors.New("not run: interrupted"))
		return
	}
	pr.begin(reconfigLabs)
	rl, err := upReconfigLab(ctx, o, set, prefix, pr)
	if err != nil {
		r.fail(reconfigLabs, err)
		pr.logf("%s FAILED: %v", reconfigLabs, err)
		pr.skip(name)
		r.fail(name, fmt.Errorf("not run: the lab could not be built"))
	} else {
		step(name, func() error { return benchReconfig(ctx, o, rl, r, pr) })
		rl.close()
	}
	pr.begin(reconfigTeardown)
	if err := set.down(); err != nil {
		r.fail(reconfigTeardown, err)
	}
}

// Phases of the disruption benchmark, which builds its own lab.
const (
	disruptionLabs     = "labs, disruption"
	disruptionTeardown = "teardown, disruption"
)

// runDisruption builds the disruption benchmark's lab, runs the benchmark
// and tears the lab down.
func runDisruption(ctx context.Context, o *Options, set *labSet, prefix string, r *Report, pr *progress, step func(string, func() error)) {
	name := disruptionPhaseName(o)
	if ctx.Err() != nil {
		r.fail(name, errors.New("not run: interrupted"))
		return
	}
	pr.begin(disruptionLabs)
	dl, err := upDisruptionLab(ctx, o, set, prefix, pr)
	if err != nil {
		r.fail(disruptionLabs, err)
		pr.logf("%s FAILED: %v", disruptionLabs, err)
		pr.skip(name)
		r.fail(name, fmt.Errorf("not run: the lab could not be built"))
	} else {
		step(name, func() error { return benchDisruption(ctx, o, dl, r, pr) })
	}
	pr.begin(disruptionTeardown)
	if err := set.down(); err != nil {
		r.fail(disruptionTeardown, err)
	}
}

func describe(o *Options) string {
	mode := o.mode()
	return fmt.Sprintf("%s run of %v, %d repetitions, iperf3 %v, wrk %v, %d connects, %d sessions, proxy removal of %d sessions (opened %s) with %v goodput windows, %d repetition(s), %d churn rounds, disruption session of %v",
		mode, o.Only, o.Reps, o.IperfTime, o.WrkTime, o.Connects, o.Sessions, o.ReconfigSessions, openRate(o.ReconfigOpenRate), o.ReconfigWindow, o.ReconfigReps, o.ChurnRounds, o.DisruptionTime)
}

func openRate(r float64) string {
	if r <= 0 {
		return "at once"
	}
	return fmt.Sprintf("at %g/s", r)
}

// planned is a phase of the run: a benchmark on one pair of labs, or the
// building or teardown of the labs; the reconfig and disruption
// benchmarks (nmb 0) have a lab of their own each.
type planned struct {
	phase
	bench string // "" for lab phases
	nmb   int    // 0: not on a pair of labs
	run   func(ctx context.Context, o *Options, p *pair, r *Report, pr *progress) error
}

// plan lists the phases o asks for, in run order, with estimated durations.
func plan(o *Options) []planned {
	it := o.IperfTime + time.Second // -O 1
	var out []planned
	add := func(bench string, nmb int, name string, est time.Duration, fn func(context.Context, *Options, *pair, *Report, *progress) error) {
		if o.wants(bench) {
			out = append(out, planned{phase{name, est}, bench, nmb, fn})
		}
	}
	connectEst := time.Duration(o.Connects)*2*300*time.Microsecond + 3*time.Second
	withOffload := func(on bool) func(context.Context, *Options, *pair, *Report, *progress) error {
		return func(ctx context.Context, o *Options, p *pair, r *Report, pr *progress) error {
			if err := p.setTxOffload(ctx, on); err != nil {
				return err
			}
			return benchConnect(ctx, o, p, r, pr, on)
		}
	}
	for _, nmb := range []int{1, 4} {
		var benches []planned
		if nmb == 1 {
			add("goodput", 1, "goodput, 1 mb", 2*time.Duration(o.Reps)*2*(it+2*time.Second), benchGoodput)
		}
		add("rps", nmb, fmt.Sprintf("nginx+wrk, %d mb", nmb), time.Duration(o.Reps)*2*(o.WrkTime+1500*time.Millisecond), benchRPS)
		if nmb == 1 {
			add("bpfstats", 1, "datapath cost (BPF stats), 1 mb", 2*(it+o.WrkTime)+8*time.Second, benchBPFStats) // each workload in both labs
		}
		add("connect", nmb, fmt.Sprintf("connect() latency, %d mb, tx offload on", nmb), connectEst, withOffload(true))
		add("connect", nmb, fmt.Sprintf("connect() latency, %d mb, tx offload off", nmb), connectEst, withOffload(false))
		if nmb == 1 {
			add("memory", 1, "memory per session", 2*11*time.Second, benchMemory)
		}
		for _, p := range out {
			if p.nmb == nmb && p.bench != "" {
				benches = append(benches, p)
			}
		}
		if len(benches) == 0 {
			continue
		}
		// Lab phases around the benchmarks of this pair.
		labs := planned{phase: phase{fmt.Sprintf("labs, %d mb", nmb), time.Duration(4+nmb) * time.Second}, nmb: nmb}
		down := planned{phase: phase{fmt.Sprintf("teardown, %d mb", nmb), 3 * time.Second}, nmb: nmb}
		i := len(out) - len(benches)
		out = append(out[:i], append([]planned{labs}, append(benches, down)...)...)
	}
	if o.wants("reconfig") {
		out = append(out,
			planned{phase: phase{reconfigLabs, 5 * time.Second}},
			planned{phase: phase{reconfigPhaseName(o), reconfigEst(o)}, bench: "reconfig"},
			planned{phase: phase{reconfigTeardown, 3 * time.Second}})
	}
	if o.wants("churn") {
		out = append(out,
			planned{phase: phase{churnLabs, 5 * time.Second}},
			planned{phase: phase{churnPhaseName(o), churnEst(o)}, bench: "churn"},
			planned{phase: phase{churnTeardown, 3 * time.Second}})
	}
	if o.wants("disruption") {
		out = append(out,
			planned{phase: phase{disruptionLabs, 5 * time.Second}},
			planned{phase: phase{disruptionPhaseName(o), disruptionEst(o)}, bench: "disruption"},
			planned{phase: phase{disruptionTeardown, 3 * time.Second}})
	}
	return out
}

// phasesOf turns a plan into progress phases.
func phasesOf(pl []planned) []phase {
	out := make([]phase, len(pl))
	for i, p := range pl {
		out[i] = p.phase
	}
	return out
}
