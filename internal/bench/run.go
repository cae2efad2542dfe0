package bench

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os/exec"
	"path/filepath"
	"time"

	"github.com/dysco/dysco/internal/labkit"
)

// Run runs the benchmarks o asks for and returns the report, also when some
// failed (their errors are in Report.Errors and in the returned error). It
// tears down every lab it built before returning.
func Run(ctx context.Context, o *Options, log io.Writer) (rep *Report, err error) {
	o.Defaults()
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
	r := NewReport(o)
	pr := labkit.NewProgress(log, phasesOf(plan(o)))
	set := &labkit.Labs{}
	defer func() {
		if derr := set.Down(); derr != nil {
			err = errors.Join(err, derr)
		}
		r.Finished = time.Now().UTC()
		if len(r.Errors) > 0 && err == nil {
			err = fmt.Errorf("%d benchmark(s) failed: see the report", len(r.Errors))
		}
	}()
	prefix := labkit.RunID()
	r.RunID = prefix
	pr.Logf("run %s: %s (lab names %s*)", prefix, describe(o), prefix)

	// step runs one benchmark unless the run was interrupted; a failure is
	// recorded and the run goes on with the next one.
	step := func(phaseName string, fn func() error) {
		if ctx.Err() != nil {
			pr.Skip(phaseName)
			r.fail(phaseName, errors.New("not run: interrupted"))
			return
		}
		pr.Begin(phaseName)
		if err := fn(); err != nil {
			if ctx.Err() != nil {
				err = fmt.Errorf("interrupted: %w", err)
			}
			r.fail(phaseName, err)
			pr.Logf("%s FAILED: %v", phaseName, err)
		}
	}

	for _, nmb := range []int{1, 4} {
		var phases []string
		for _, ph := range plan(o) {
			if ph.nmb == nmb && ph.bench != "" {
				phases = append(phases, ph.Name)
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
		pr.Begin(labs)
		p, err := labkit.UpPair(ctx, o.Agents(), set, prefix, nmb, pr)
		if err != nil {
			r.fail(labs, err)
			pr.Logf("%s FAILED: %v", labs, err)
			for _, ph := range phases {
				pr.Skip(ph)
				r.fail(ph, fmt.Errorf("not run: the labs could not be built"))
			}
		} else {
			for _, ph := range plan(o) {
				if ph.nmb != nmb || ph.bench == "" {
					continue
				}
				step(ph.Name, func() error { return ph.run(ctx, o, p, r, pr) })
			}
			p.Close()
		}
		teardown := fmt.Sprintf("teardown, %d mb", nmb)
		pr.Begin(teardown)
		if err := set.Down(); err != nil {
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
	if o.wants("moves") {
		runMoves(ctx, o, set, prefix, r, pr, step)
	}
	if o.wants("convergence") {
		step(convergencePhase, func() error { return Convergence(ctx, o, r, pr) })
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
func runReconfig(ctx context.Context, o *Options, set *labkit.Labs, prefix string, r *Report, pr *labkit.Progress, step func(string, func() error)) {
	name := reconfigPhaseName(o)
	if ctx.Err() != nil {
		r.fail(name, errors.New("not run: interrupted"))
		return
	}
	pr.Begin(reconfigLabs)
	rl, err := UpReconfigLab(ctx, o, set, prefix, pr)
	if err != nil {
		r.fail(reconfigLabs, err)
		pr.Logf("%s FAILED: %v", reconfigLabs, err)
		pr.Skip(name)
		r.fail(name, fmt.Errorf("not run: the lab could not be built"))
	} else {
		step(name, func() error { return benchReconfig(ctx, o, rl, r, pr) })
		rl.Close()
	}
	pr.Begin(reconfigTeardown)
	if err := set.Down(); err != nil {
		r.fail(reconfigTeardown, err)
	}
}

// convergencePhase is the convergence benchmark's phase (no lab).
const convergencePhase = "policy convergence, 50 agents, bbolt, etcd and kubernetes"

// Phases of the disruption benchmark, which builds its own lab.
const (
	disruptionLabs     = "labs, disruption"
	disruptionTeardown = "teardown, disruption"
)

// runDisruption builds the disruption benchmark's lab, runs the benchmark
// and tears the lab down.
func runDisruption(ctx context.Context, o *Options, set *labkit.Labs, prefix string, r *Report, pr *labkit.Progress, step func(string, func() error)) {
	name := disruptionPhaseName(o)
	if ctx.Err() != nil {
		r.fail(name, errors.New("not run: interrupted"))
		return
	}
	pr.Begin(disruptionLabs)
	dl, err := UpDisruptionLab(ctx, o, set, prefix, pr)
	if err != nil {
		r.fail(disruptionLabs, err)
		pr.Logf("%s FAILED: %v", disruptionLabs, err)
		pr.Skip(name)
		r.fail(name, fmt.Errorf("not run: the lab could not be built"))
	} else {
		step(name, func() error { return Disruption(ctx, o, dl, r, pr) })
	}
	pr.Begin(disruptionTeardown)
	if err := set.Down(); err != nil {
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
	labkit.Phase
	bench string // "" for lab phases
	nmb   int    // 0: not on a pair of labs
	run   func(ctx context.Context, o *Options, p *labkit.Pair, r *Report, pr *labkit.Progress) error
}

// plan lists the phases o asks for, in run order, with estimated durations.
func plan(o *Options) []planned {
	it := o.IperfTime + time.Second // -O 1
	var out []planned
	add := func(bench string, nmb int, name string, est time.Duration, fn func(context.Context, *Options, *labkit.Pair, *Report, *labkit.Progress) error) {
		if o.wants(bench) {
			out = append(out, planned{labkit.Phase{Name: name, Est: est}, bench, nmb, fn})
		}
	}
	connectEst := time.Duration(o.Connects)*2*300*time.Microsecond + 3*time.Second
	withOffload := func(on bool) func(context.Context, *Options, *labkit.Pair, *Report, *labkit.Progress) error {
		return func(ctx context.Context, o *Options, p *labkit.Pair, r *Report, pr *labkit.Progress) error {
			if err := p.SetTxOffload(ctx, on); err != nil {
				return err
			}
			err := Connect(ctx, o, p, r, pr, on)
			if !on {
				// The benchmarks after it run with the veths'
				// default, offload on.
				err = errors.Join(err, p.SetTxOffload(ctx, true))
			}
			return err
		}
	}
	for _, nmb := range []int{1, 4} {
		var benches []planned
		if nmb == 1 {
			add("goodput", 1, "goodput, 1 mb", 2*time.Duration(o.Reps)*2*(it+2*time.Second), benchGoodput)
		}
		add("rps", nmb, fmt.Sprintf("nginx+wrk, %d mb", nmb), time.Duration(o.Reps)*2*(o.WrkTime+1500*time.Millisecond), RPS)
		if nmb == 1 {
			add("bpfstats", 1, "datapath cost (BPF stats), 1 mb", 2*(it+o.WrkTime)+8*time.Second, benchBPFStats) // each workload in both labs
		}
		add("connect", nmb, fmt.Sprintf("connect() latency, %d mb, tx offload on", nmb), connectEst, withOffload(true))
		add("connect", nmb, fmt.Sprintf("connect() latency, %d mb, tx offload off", nmb), connectEst, withOffload(false))
		if nmb == 1 {
			add("memory", 1, "memory per session", 2*11*time.Second, benchMemory)
			add("udp", 1, "udp goodput, 1 mb; datagrams lost across reconfigurations", 2*(8*3*time.Second+2*time.Duration(o.Reps)*(it+2*time.Second))+20*time.Second, benchUDP)
		}
		add("quic", nmb, fmt.Sprintf("quic download, %d mb", nmb), 10*time.Second+2*time.Duration(o.Reps)*4*time.Second, benchQUIC)
		add("udpsetup", nmb, fmt.Sprintf("udp set-up latency, %d mb", nmb), 2*connectEst+2*time.Second, UDPSetup)
		for _, p := range out {
			if p.nmb == nmb && p.bench != "" {
				benches = append(benches, p)
			}
		}
		if len(benches) == 0 {
			continue
		}
		// Lab phases around the benchmarks of this pair.
		labs := planned{Phase: labkit.Phase{Name: fmt.Sprintf("labs, %d mb", nmb), Est: time.Duration(4+nmb) * time.Second}, nmb: nmb}
		down := planned{Phase: labkit.Phase{Name: fmt.Sprintf("teardown, %d mb", nmb), Est: 3 * time.Second}, nmb: nmb}
		i := len(out) - len(benches)
		out = append(out[:i], append([]planned{labs}, append(benches, down)...)...)
	}
	if o.wants("reconfig") {
		out = append(out,
			planned{Phase: labkit.Phase{Name: reconfigLabs, Est: 5 * time.Second}},
			planned{Phase: labkit.Phase{Name: reconfigPhaseName(o), Est: reconfigEst(o)}, bench: "reconfig"},
			planned{Phase: labkit.Phase{Name: reconfigTeardown, Est: 3 * time.Second}})
	}
	if o.wants("churn") {
		out = append(out,
			planned{Phase: labkit.Phase{Name: churnLabs, Est: 5 * time.Second}},
			planned{Phase: labkit.Phase{Name: churnPhaseName(o), Est: churnEst(o)}, bench: "churn"},
			planned{Phase: labkit.Phase{Name: churnTeardown, Est: 3 * time.Second}})
	}
	if o.wants("disruption") {
		out = append(out,
			planned{Phase: labkit.Phase{Name: disruptionLabs, Est: 5 * time.Second}},
			planned{Phase: labkit.Phase{Name: disruptionPhaseName(o), Est: disruptionEst(o)}, bench: "disruption"},
			planned{Phase: labkit.Phase{Name: disruptionTeardown, Est: 3 * time.Second}})
	}
	if o.wants("moves") {
		out = append(out,
			planned{Phase: labkit.Phase{Name: movesLabs, Est: 4 * time.Second}},
			planned{Phase: labkit.Phase{Name: movesPhaseName(o), Est: movesEst(o)}, bench: "moves"},
			planned{Phase: labkit.Phase{Name: movesBreakPhaseName(o), Est: movesBreakEst(o)}, bench: "moves"},
			planned{Phase: labkit.Phase{Name: movesTeardown, Est: 2 * time.Second}})
	}
	if o.wants("convergence") {
		n := 100
		if o.Quick {
			n = 10
		}
		out = append(out, planned{Phase: labkit.Phase{Name: convergencePhase, Est: 40*time.Second + time.Duration(3*n)*50*time.Millisecond}, bench: "convergence"})
	}
	return out
}

// phasesOf turns a plan into progress phases.
func phasesOf(pl []planned) []labkit.Phase {
	out := make([]labkit.Phase, len(pl))
	for i, p := range pl {
		out[i] = p.Phase
	}
	return out
}
