package bench

// Benchmark "reconfig": an unmodified HAProxy removed from live sessions
// (paper §5.3, Figures 12 and 13). Its own lab, a star of client, proxy and
// server with an agent on each; the client's sessions to the proxy and the
// proxy's sessions to the server are Dysco sessions with no middlebox, so
// that the two can be joined. HAProxy relays in TCP mode with splicing;
// under LD_PRELOAD=lib/libdysco.so, its splice calls ask the proxy's agent
// to take the proxy off each session, and the client's agent, as left
// anchor, runs the reconfiguration and records how long it took (`dysco
// reconfig history`). The runner is both ends of every session: it dials
// from the client's namespace and serves on the server's, each session
// sending and receiving continuously.
//
// Each repetition has two phases over the same number of sessions:
//
//  1. "through the proxy": HAProxy without libdysco (plain relaying); the
//     sessions are paced for a while, then send as fast as they can: the
//     aggregate goodput over a window is the "before" figure. A proxy
//     under libdysco leaves at its first splices, so the "before" needs a
//     proxy that stays.
//  2. "removal": HAProxy under libdysco; the sessions are paced, every one
//     is spliced and removed; the runner waits for one result per session
//     at the client, checks that the sessions go straight to the server
//     and that the proxy host's datapath stops rewriting packets (the old
//     paths linger a little), then lets them send as fast as they can:
//     the aggregate goodput over a window of the same length is the
//     "after" figure, and the proxy host must rewrite nothing during it.
//     Every session must then still carry data both ways.

import (
	"context"
	"errors"
	"fmt"
	"math"
	"path/filepath"
	"strings"
	"time"

	"github.com/dysco/dysco/internal/api"
	"github.com/dysco/dysco/internal/labkit"
)

// Ports of the reconfig lab: HAProxy listens on the proxy, the runner's
// sink/source server on the server.
const (
	ProxyPort   = 9400
	backendPort = 9401
)

// Pacing of the sessions before the goodput windows: every session sends
// ReconfigRate bytes a second each way, in reconfigTick steps.
const (
	ReconfigRate = 32 << 10
	reconfigTick = 100 * time.Millisecond
	// greedyChunk is the size of each write when sending as fast as TCP
	// lets.
	greedyChunk = 64 << 10
	// reconfigWarm is how long the sessions send as fast as they can
	// before a goodput window starts.
	reconfigWarm = time.Second
)

// payload is what the sessions send (read only, shared).
var payload = make([]byte, greedyChunk)

// reconfigTrigger is libdysco's DYSCO_SPLICE_TRIGGER: ask for the removal
// once both directions are spliced (not the library's default, which asks
// once one direction is spliced and the other drained: the experiments
// choose the time of the removal with the second direction; see
// docs/libdysco.md).
const reconfigTrigger = "both"

func reconfigPhaseName(o *Options) string {
	return fmt.Sprintf("proxy removal, %d sessions", o.ReconfigSessions)
}

// reconfigEst estimates the benchmark's duration.
func reconfigEst(o *Options) time.Duration {
	n := time.Duration(o.ReconfigSessions)
	est := 2*(o.ReconfigWindow+reconfigWarm) + 10*time.Second + n*25*time.Millisecond
	if o.ReconfigOpenRate > 0 {
		est += 2 * time.Duration(float64(o.ReconfigSessions)/o.ReconfigOpenRate*float64(time.Second))
	}
	total := time.Duration(max(o.ReconfigReps, 1)) * est
	if rate := spacedRate(o); rate > 0 {
		total += 2*(o.ReconfigWindow+reconfigWarm) + 10*time.Second + n*5*time.Millisecond +
			2*time.Duration(float64(o.ReconfigSessions)/rate*float64(time.Second))
	}
	return total
}

// spacedRate is the open rate of the spaced repetition, 0 for none: it
// follows the back-to-back repetitions only (ReconfigSpacedRate).
func spacedRate(o *Options) float64 {
	if o.ReconfigOpenRate > 0 {
		return 0
	}
	return o.ReconfigSpacedRate
}

// reconfigDetails is the raw data of the benchmark.
type reconfigDetails struct {
	Sessions  int      `json:"sessions"`
	RateBytes int      `json:"paced_rate_bytes_per_s"`
	Trigger   string   `json:"libdysco_trigger"`
	HAProxy   []string `json:"haproxy_argv"`
	// Removal pools the results of every repetition.
	Removal *RemovalStats  `json:"removal,omitempty"`
	Reps    []*reconfigRep `json:"reps"`
	// Spaced is the repetition with the sessions opened at SpacedRate
	// (Options.ReconfigSpacedRate), SpacedRemoval its results.
	SpacedRate    float64       `json:"spaced_open_rate,omitempty"`
	Spaced        *reconfigRep  `json:"spaced,omitempty"`
	SpacedRemoval *RemovalStats `json:"spaced_removal,omitempty"`
}

// reconfigRep is one repetition: the sessions through the proxy, then
// through the proxy under libdysco, removed.
type reconfigRep struct {
	Rep    int           `json:"rep"`
	Before *windowResult `json:"goodput_through_proxy,omitempty"`
	After  *windowResult `json:"goodput_after_removal,omitempty"`
	// ProxyCounters are the changes of the proxy host's datapath
	// counters during each goodput window.
	ProxyCounters map[string]map[string]uint64 `json:"proxy_counters"`
	Removal       *RemovalStats                `json:"removal,omitempty"`
	// DialMs is the time the runner took to dial the sessions of the
	// removal phase, one after the other (they are spliced, and their
	// removal requested, as they come).
	DialMs float64 `json:"dial_ms"`
	// RemovalWallMs is from the first session's dial to the poll of the
	// history that saw the last result.
	RemovalWallMs float64 `json:"removal_wall_ms"`
	// AgentCPUms is the CPU time each agent used from the first dial to
	// the poll that saw the last result.
	AgentCPUms map[string]float64 `json:"agent_cpu_ms_during_removal,omitempty"`
	// Control traffic of each agent over the same time: messages sent and
	// the datagrams that carried them (several share one as a bundle).
	ControlOut map[string][2]uint64 `json:"control_messages_datagrams_out,omitempty"`
	// Direct is how many of the client's sessions go straight to the
	// server after the removal.
	Direct int `json:"direct"`
	// DrainMs is how long the proxy's agent took to collect the sessions
	// of phase 1 (-1: not within 30 s).
	DrainMs float64 `json:"phase1_drain_ms"`
	// QuietMs is from the check of the client's sessions after the last
	// result to the last change of the proxy host's rewrite counters (the
	// old paths linger to pass retransmissions); RewritesBeforeQuiet the
	// packets it rewrote meanwhile. -1: never quiet.
	QuietMs             float64 `json:"proxy_quiet_ms"`
	RewritesBeforeQuiet uint64  `json:"proxy_rewrites_before_quiet"`
	// StuckEnds are the session ends that received nothing in 15 s of
	// paced traffic after the goodput window.
	StuckEnds []string `json:"stuck_ends,omitempty"`
	// History is the client's results for the sessions, in the order
	// the agent recorded them.
	History     []api.ReconfigResult `json:"history"`
	Notes       []string             `json:"notes,omitempty"`
	SessionErrs []string             `json:"session_errors,omitempty"`
	Problems    []string             `json:"problems,omitempty"`

	locals map[string]bool
}

func (x *reconfigRep) problem(format string, args ...any) {
	x.Problems = append(x.Problems, fmt.Sprintf(format, args...))
}

// benchReconfig runs o.ReconfigReps repetitions and adds the figures.
func benchReconfig(ctx context.Context, o *Options, rl *ReconfigLab, r *Report, pr *labkit.Progress) (err error) {
	n := o.ReconfigSessions
	det := &reconfigDetails{Sessions: n, RateBytes: ReconfigRate, Trigger: reconfigTrigger, HAProxy: rl.haproxyArgv(true)}
	r.Details["reconfig"] = det
	defer func() {
		if serr := rl.StopHAProxy(); serr != nil && err == nil {
			err = serr
		}
		// The lab's run directory goes with the lab: keep its logs
		// (agents, HAProxy) when something went wrong.
		if err != nil {
			if dir, lerr := labkit.SaveLabLogs(rl.Lab, filepath.Join(o.OutDir, r.RunID+"-reconfig-logs")); lerr == nil {
				err = fmt.Errorf("%w (logs of the lab's agents and HAProxy copied to %s)", err, dir)
			}
		}
	}()
	var problems []string
	var all []api.ReconfigResult
	locals := map[string]bool{}
	var gp []Sample
	var done []*reconfigRep
	var repErr error
	for rep := 1; rep <= o.ReconfigReps; rep++ {
		x := &reconfigRep{Rep: rep, ProxyCounters: map[string]map[string]uint64{}}
		det.Reps = append(det.Reps, x)
		err := rl.repetition(ctx, o, x, pr, fmt.Sprintf("repetition %d/%d", rep, o.ReconfigReps))
		for _, p := range x.Problems {
			problems = append(problems, fmt.Sprintf("repetition %d: %s", rep, p))
		}
		if err != nil {
			// The figures come from the repetitions that ended.
			repErr = fmt.Errorf("repetition %d: %w", rep, err)
			break
		}
		done = append(done, x)
		all = append(all, x.History...)
		for k := range x.locals {
			locals[k] = true
		}
		gp = append(gp, Sample{Variant: "baseline", Rep: rep, Value: x.Before.TotalGbps},
			Sample{Variant: "dysco", Rep: rep, Value: x.After.TotalGbps})
	}
	errOut := func() error {
		if len(problems) > 0 {
			repErr = errors.Join(repErr, fmt.Errorf("proxy removal: %s", strings.Join(problems, "; ")))
		}
		return repErr
	}
	if len(done) == 0 {
		return errOut()
	}
	reps := len(done)
	st := Summarize(all, n*reps, locals)
	det.Removal = &st

	// Figures.
	var perRep, direct, stuck, quiet, inWindow, dial []string
	var up0, up1, starved0, starved1 []string
	for _, x := range done {
		perRep = append(perRep, fmt.Sprintf("%.2f/%.2f", x.Removal.P50ms, x.Removal.P99ms))
		direct = append(direct, fmt.Sprint(x.Direct))
		stuck = append(stuck, fmt.Sprint(len(x.StuckEnds)))
		quiet = append(quiet, fmt.Sprintf("%d (the last %.1f s after the check)", x.RewritesBeforeQuiet, x.QuietMs/1000))
		inWindow = append(inWindow, fmt.Sprint(rewritesOf(x.ProxyCounters["after_removal_window"])))
		ctl := ""
		if x.ControlOut != nil {
			var parts []string
			for _, h := range []string{"client", "proxy", "server"} {
				c := x.ControlOut[h]
				parts = append(parts, fmt.Sprintf("%s %d in %d", h, c[0], c[1]))
			}
			ctl = "; control messages sent in datagrams: " + strings.Join(parts, ", ")
		}
		dial = append(dial, fmt.Sprintf("%.2f s (results seen by %.1f s; agents' CPU meanwhile: client %.0f ms, proxy %.0f ms%s)",
			x.DialMs/1000, x.RemovalWallMs/1000, x.AgentCPUms["client"], x.AgentCPUms["proxy"], ctl))
		up0 = append(up0, fmt.Sprintf("%.2f/%.2f", x.Before.UpGbps, x.Before.DownGbps))
		up1 = append(up1, fmt.Sprintf("%.2f/%.2f", x.After.UpGbps, x.After.DownGbps))
		starved0 = append(starved0, fmt.Sprint(x.Before.StalledClients+x.Before.StalledServers))
		starved1 = append(starved1, fmt.Sprint(x.After.StalledClients+x.After.StalledServers))
	}
	list := func(v []string) string { return strings.Join(v, ", ") }
	haproxyCmd := fmt.Sprintf("ip netns exec LAB-proxy env LD_PRELOAD=lib/libdysco.so DYSCO_SPLICE_TRIGGER=%s haproxy -db -f haproxy.cfg", reconfigTrigger)
	open := "one after the other, back to back"
	if o.ReconfigOpenRate > 0 {
		open = fmt.Sprintf("at %g/s", o.ReconfigOpenRate)
	}
	note := fmt.Sprintf("%d repetition(s) of %d sessions client → HAProxy (TCP mode, splice-request/response) → server, dialled %s, each paced at %d KiB/s each way; "+
		"HAProxy splices each as it comes and libdysco asks for its removal, so removals overlap the dialling and each other; "+
		"per session, the time at the client (left anchor) from the proxy agent's trigger to the old path no longer used (`dysco reconfig history --json`), all repetitions pooled; "+
		"%s; "+
		"per repetition p50/p99 ms %s; dialling took %s; client sessions direct to the server afterwards %s of %d; "+
		"session ends without data in 15 s after the goodput window %s of %d; "+
		"packets the proxy host's datapath rewrote after the check of the client's sessions (old paths linger to pass retransmissions): %s; then, after 1 s without any, during the %v goodput window: %s",
		reps, n, open, ReconfigRate>>10, st.resultsText(n*reps),
		list(perRep), list(dial), list(direct), n, list(stuck), 2*n, list(quiet), o.ReconfigWindow, list(inWindow))
	if len(st.Reasons) > 0 {
		note += fmt.Sprintf("; not succeeded: %v", st.Reasons)
	}
	if reps < o.ReconfigReps {
		note += fmt.Sprintf("; only %d of %d repetitions ended: %v", reps, o.ReconfigReps, repErr)
	}
	r.add(removalFigure("reconfig-proxy-removal", fmt.Sprintf("proxy removal time, %d sessions (HAProxy under libdysco)", n),
		fmt.Sprintf("%s; runner: %d sessions LAB-client → %s:%d, then ip netns exec LAB-client dysco reconfig history --json",
			haproxyCmd, n, rl.Proxy, ProxyPort),
		st, n*reps, note))
	f := ratioFigure("reconfig-goodput", fmt.Sprintf("goodput of %d sessions, proxy removed (Dysco) vs through HAProxy (baseline)", n),
		fmt.Sprintf("runner: %d sessions LAB-client → HAProxy on LAB-proxy → LAB-server sending both ways as fast as TCP lets; bytes received by both ends over %v", n, o.ReconfigWindow),
		"Gbit/s", gp, 0, "goodput doubled")
	f.MeasuredUnit, f.Target, f.Met = "× through the proxy", "(reported)", "–"
	f.Note += fmt.Sprintf("; both directions summed, medians over the repetitions. Baseline: the sessions through HAProxy without libdysco (plain splicing relay; under libdysco a proxy leaves at its first splices, so there is no 'before' with it), "+
		"after %v paced and %v sending freely, over %v. Dysco: the sessions of the removal phase of the same repetition, once every result was in and the proxy host rewrote no more packets, after %v sending freely, over %v. "+
		"Up/down Gbit/s per repetition: %s through the proxy, %s after the removal; ends that received nothing during the window: %s through the proxy, %s after the removal (of %d). "+
		"All hosts share the machine's %d CPUs; the runner is both client and server",
		2*time.Second, reconfigWarm, o.ReconfigWindow, reconfigWarm, o.ReconfigWindow, list(up0), list(up1), list(starved0), list(starved1), 2*n, r.Env.Nproc)
	r.add(f)
	if rate := spacedRate(o); rate > 0 && repErr == nil {
		if err := benchReconfigSpaced(ctx, o, rl, r, pr, det, rate, haproxyCmd); err != nil {
			repErr = err
		}
	}
	return errOut()
}

// benchReconfigSpaced runs the spaced repetition: the same sessions,
// opened at rate per second, so that each removal has the agents to
// itself (the figure the protocol's own time is followed by; the
// back-to-back figure is the agents' queueing under a burst).
func benchReconfigSpaced(ctx context.Context, o *Options, rl *ReconfigLab, r *Report, pr *labkit.Progress, det *reconfigDetails, rate float64, haproxyCmd string) error {
	n := o.ReconfigSessions
	so := *o
	so.ReconfigOpenRate = rate
	x := &reconfigRep{Rep: 1, ProxyCounters: map[string]map[string]uint64{}}
	det.SpacedRate, det.Spaced = rate, x
	err := rl.repetition(ctx, &so, x, pr, fmt.Sprintf("spaced, sessions opened at %g/s", rate))
	var errs []error
	if err != nil {
		errs = append(errs, fmt.Errorf("spaced repetition: %w", err))
	}
	if len(x.Problems) > 0 {
		errs = append(errs, fmt.Errorf("proxy removal, spaced repetition: %s", strings.Join(x.Problems, "; ")))
	}
	if err != nil {
		return errors.Join(errs...)
	}
	st := Summarize(x.History, n, x.locals)
	det.SpacedRemoval = &st
	note := fmt.Sprintf("one repetition of %d sessions as above, dialled at %g/s (a removal every %.0f ms, so that removals do not overlap: the protocol's own time, not the agents' queueing under a burst); "+
		"%s; dialling took %.2f s; client sessions direct to the server afterwards %d of %d",
		n, rate, 1000/rate, st.resultsText(n), x.DialMs/1000, x.Direct, n)
	if len(st.Reasons) > 0 {
		note += fmt.Sprintf("; not succeeded: %v", st.Reasons)
	}
	r.add(removalFigure("reconfig-proxy-removal-spaced", fmt.Sprintf("proxy removal time, %d sessions opened at %g/s (removals spaced)", n, rate),
		fmt.Sprintf("%s; runner: %d sessions LAB-client → %s:%d at %g/s, then ip netns exec LAB-client dysco reconfig history --json",
			haproxyCmd, n, rl.Proxy, ProxyPort, rate),
		st, n, note))
	return errors.Join(errs...)
}

// removalFigure is a removal-time figure over n sessions' results (the
// back-to-back and the spaced rows): p50 against the target, p99 beside it.
func removalFigure(key, name, command string, st RemovalStats, n int, note string) *Figure {
	return &Figure{
		Key: key, Name: name, Command: command,
		Unit: "ms", Dysco: st.P50ms, Baseline: math.NaN(), Ratio: math.NaN(),
		DyscoText: fmt.Sprintf("%.2f ms (p99 %.2f)", st.P50ms, st.P99ms),
		Measured:  st.P50ms, MeasuredUnit: "ms p50",
		Target: "p50 ≤ 1 ms, p99 ≤ 3 ms, every session removed", Paper: "80 % under 2 ms, 98.7 % under 4 ms",
		Met: metStr(st.met(n)), Note: note,
	}
}

// repetition runs one repetition: phase 1 through the proxy, phase 2 the
// removal. Problems of the product go to x.Problems; the error is for
// what stops the repetition.
func (rl *ReconfigLab) repetition(ctx context.Context, o *Options, x *reconfigRep, pr *labkit.Progress, what string) error {
	if err := rl.throughProxy(ctx, o, x, pr, what); err != nil {
		return err
	}
	return rl.removal(ctx, o, x, pr, what)
}

// throughProxy is phase 1: the sessions through HAProxy without libdysco,
// their goodput, then HAProxy stopped and its sessions collected by the
// proxy's agent.
func (rl *ReconfigLab) throughProxy(ctx context.Context, o *Options, x *reconfigRep, pr *labkit.Progress, what string) error {
	n := o.ReconfigSessions

	// Phase 1: through the proxy (HAProxy without libdysco).
	st0, err := labkit.AgentStatus(ctx, o.Dysco, rl.Lab, "proxy")
	if err != nil {
		return err
	}
	pr.Logf("proxy removal, %s: %d sessions through HAProxy without libdysco", what, n)
	if err := rl.StartHAProxy(ctx, false); err != nil {
		return err
	}
	fs, err := rl.open(ctx, n, o.ReconfigOpenRate)
	if err != nil {
		fs.stop()
		return fmt.Errorf("through the proxy: %w", err)
	}
	if err := labkit.SleepCtx(ctx, 2*time.Second); err != nil {
		fs.stop()
		return err
	}
	before, d1, err := rl.measureWindow(ctx, o, fs)
	nerr1, errs1 := fs.errors()
	fs.stop()
	rl.cur.Store(nil)
	if err != nil {
		return fmt.Errorf("through the proxy: %w", err)
	}
	x.Before = &before
	x.ProxyCounters["through_proxy_window"] = d1
	pr.Logf("proxy removal, %s: through HAProxy: %.3f Gbit/s (%.3f up, %.3f down), proxy host rewrote %d packets",
		what, before.TotalGbps, before.UpGbps, before.DownGbps, rewritesOf(d1))
	if nerr1 > 0 {
		x.SessionErrs = append(x.SessionErrs, errs1...)
		x.problem("through the proxy: %d session errors (first: %s)", nerr1, strings.Join(errs1, "; "))
	}
	if rewritesOf(d1) == 0 {
		x.problem("through the proxy: the proxy host's datapath rewrote no packet: the sessions are not Dysco sessions")
	}
	// Ends starved through the proxy are the baseline's behaviour (HAProxy
	// and TCP under overload), not a failure of Dysco: noted with the
	// figure.
	//
	// Nothing of phase 1 may reach the proxy host's datapath during phase
	// 2: stop HAProxy (its orphaned sockets go with it) and wait until the
	// proxy's agent has collected the sessions of phase 1 (it has as many
	// as before phase 1: sessions of earlier repetitions' removals stay
	// until idle).
	if err := rl.StopHAProxy(); err != nil {
		return err
	}
	return rl.waitDrained(ctx, o, x, st0)
}

// waitDrained waits up to 30 s until the proxy's agent has no more
// sessions than st0 had.
func (rl *ReconfigLab) waitDrained(ctx context.Context, o *Options, x *reconfigRep, st0 *api.Status) error {
	t1 := time.Now()
	for {
		st, err := labkit.AgentStatus(ctx, o.Dysco, rl.Lab, "proxy")
		if err != nil {
			return err
		}
		if st.Sessions <= st0.Sessions {
			x.DrainMs = float64(time.Since(t1).Microseconds()) / 1000
			break
		}
		if time.Since(t1) > 30*time.Second {
			x.DrainMs = -1
			x.Notes = append(x.Notes, fmt.Sprintf("the proxy's agent had %d sessions 30 s after phase 1 ended, %d before it", st.Sessions, st0.Sessions))
			break
		}
		if err := labkit.SleepCtx(ctx, 250*time.Millisecond); err != nil {
			return err
		}
	}
	return nil
}

// removal is phase 2: the sessions through HAProxy under libdysco, which
// removes itself from each; the results at the left anchor, the sessions'
// new path, and the goodput after the removal.
func (rl *ReconfigLab) removal(ctx context.Context, o *Options, x *reconfigRep, pr *labkit.Progress, what string) error {
	n := o.ReconfigSessions
	hist0, err := rl.History(ctx, o)
	if err != nil {
		return err
	}
	pr.Logf("proxy removal, %s: %d sessions through HAProxy under libdysco (%s)", what, n, strings.Join(rl.haproxyArgv(true), " "))
	if err := rl.StartHAProxy(ctx, true); err != nil {
		return err
	}
	cpu0 := rl.agentCPU()
	ctl0 := rl.controlOut(ctx, o)
	t0 := time.Now()
	fs, err := rl.open(ctx, n, o.ReconfigOpenRate)
	defer fs.stop()
	defer rl.cur.Store(nil)
	if err != nil {
		return fmt.Errorf("removal: %w", err)
	}
	x.DialMs = float64(fs.dialed.Microseconds()) / 1000
	x.locals = map[string]bool{}
	fs.mu.Lock()
	for _, f := range fs.clients {
		x.locals[f.c.LocalAddr().String()] = true
	}
	fs.mu.Unlock()
	results, tLast, err := rl.waitResults(ctx, o, x, pr, what, hist0, t0)
	if err != nil {
		return err
	}
	if len(results) < n {
		rl.describeMissing(ctx, o, x, fs, results)
	}
	x.RemovalWallMs = float64(tLast.Sub(t0).Microseconds()) / 1000
	if cpu1 := rl.agentCPU(); cpu0 != nil && cpu1 != nil {
		x.AgentCPUms = map[string]float64{}
		for h, c := range cpu1 {
			x.AgentCPUms[h] = float64((c - cpu0[h]).Microseconds()) / 1000
		}
	}
	if ctl1 := rl.controlOut(ctx, o); ctl0 != nil && ctl1 != nil {
		x.ControlOut = map[string][2]uint64{}
		for h, c := range ctl1 {
			x.ControlOut[h] = [2]uint64{c[0] - ctl0[h][0], c[1] - ctl0[h][1]}
		}
	}
	x.History = results
	st := Summarize(results, n, x.locals)
	x.Removal = &st
	pr.Logf("proxy removal, %s: %d results (%d succeeded) within %.1f s of the first dial; p50 %.2f ms, p99 %.2f ms",
		what, st.Results, st.Succeeded, x.RemovalWallMs/1000, st.P50ms, st.P99ms)
	if st.Succeeded < st.Results {
		x.problem("removal: %d of %d results did not succeed: %v", st.Results-st.Succeeded, st.Results, st.Reasons)
	}
	if st.Results > n {
		x.problem("removal: %d results for %d sessions", st.Results, n)
	}
	if err := rl.countDirect(ctx, o, x); err != nil {
		return err
	}
	if err := rl.waitQuiet(ctx, o, x); err != nil {
		return err
	}
	return rl.afterRemoval(ctx, o, x, fs, pr, what)
}

// waitResults waits for one result per session at the left anchor (the
// client), giving up when none came for 15 s or after a minute and a
// half; it returns them and when the last one was seen.
func (rl *ReconfigLab) waitResults(ctx context.Context, o *Options, x *reconfigRep, pr *labkit.Progress, what string, hist0 []api.ReconfigResult, t0 time.Time) ([]api.ReconfigResult, time.Time, error) {
	n := o.ReconfigSessions
	var results []api.ReconfigResult
	var lastAt, tLast time.Time
	last, lastLog := -1, time.Now()
	hardStop := time.Now().Add(90 * time.Second)
	for {
		h, err := rl.History(ctx, o)
		if err != nil {
			return nil, tLast, err
		}
		results = NewResults(hist0, h)
		if len(results) != last {
			last, lastAt, tLast = len(results), time.Now(), time.Now()
		}
		if len(results) >= n {
			break
		}
		if time.Since(lastAt) > 15*time.Second || time.Now().After(hardStop) {
			x.problem("removal: %d of %d sessions have a result at the client after %.0f s (none new for %.0f s)",
				len(results), n, time.Since(t0).Seconds(), time.Since(lastAt).Seconds())
			break
		}
		if time.Since(lastLog) > 3*time.Second {
			pr.Logf("proxy removal, %s: %d/%d sessions have a reconfiguration result", what, len(results), n)
			lastLog = time.Now()
		}
		if err := labkit.SleepCtx(ctx, 200*time.Millisecond); err != nil {
			return nil, tLast, err
		}
	}
	return results, tLast, nil
}

// describeMissing writes what the hosts know of the sessions without a
// result, while they are still live (kept with the lab's logs).
func (rl *ReconfigLab) describeMissing(ctx context.Context, o *Options, x *reconfigRep, fs *flowSet, results []api.ReconfigResult) {
	have := map[string]bool{}
	for _, r := range results {
		src, _, _ := strings.Cut(r.Session, " -> ")
		have[src] = true
	}
	var stuck []StuckSession
	fs.mu.Lock()
	for _, f := range fs.clients {
		if a := f.c.LocalAddr().String(); !have[a] {
			stuck = append(stuck, StuckSession{What: "session " + a + ": no reconfiguration result at the client", Addresses: []string{a}})
		}
	}
	fs.mu.Unlock()
	if p, err := DumpStuck(ctx, o, rl, stuck); err != nil {
		x.problem("describing the sessions without a result: %v", err)
	} else {
		x.Notes = append(x.Notes, "what the hosts knew of the sessions without a result: "+filepath.Base(p)+" with the lab's logs")
	}
}

// countDirect counts the client's sessions that now go straight to the
// server.
func (rl *ReconfigLab) countDirect(ctx context.Context, o *Options, x *reconfigRep) error {
	n := o.ReconfigSessions
	direct, err := rl.DirectSessions(ctx, o, x.locals)
	if err != nil {
		return err
	}
	x.Direct += direct
	if x.Direct < n {
		x.problem("removal: %d of %d client sessions go straight to the server", x.Direct, n)
	}
	return nil
}

// waitQuiet waits, the sessions still paced, until the proxy host's
// datapath has rewritten nothing for a second: the old paths linger a
// little after their removal (to pass retransmissions).
func (rl *ReconfigLab) waitQuiet(ctx context.Context, o *Options, x *reconfigRep) error {
	tq := time.Now()
	var firstRw, lastRw uint64
	lastChange := time.Now()
	for i := 0; ; i++ {
		st, err := labkit.AgentStatus(ctx, o.Dysco, rl.Lab, "proxy")
		if err != nil {
			return err
		}
		rw := ProxyRewrites(st)
		if i == 0 {
			firstRw = rw
		} else if rw != lastRw {
			lastChange = time.Now()
		}
		lastRw = rw
		if time.Since(lastChange) >= time.Second {
			x.QuietMs = float64(lastChange.Sub(tq).Microseconds()) / 1000
			x.RewritesBeforeQuiet = lastRw - firstRw
			break
		}
		if time.Since(tq) > 20*time.Second {
			x.QuietMs = -1
			x.RewritesBeforeQuiet = lastRw - firstRw
			x.problem("after the removal: the proxy host's datapath still rewrites packets 20 s after the last result (%d since the last result)", lastRw-firstRw)
			break
		}
		if err := labkit.SleepCtx(ctx, 200*time.Millisecond); err != nil {
			return err
		}
	}
	return nil
}

// afterRemoval measures the goodput after the removal, with the proxy
// host out of the path, and checks that every session still carries data
// both ways.
func (rl *ReconfigLab) afterRemoval(ctx context.Context, o *Options, x *reconfigRep, fs *flowSet, pr *labkit.Progress, what string) error {
	win := o.ReconfigWindow
	after, d2, err := rl.measureWindow(ctx, o, fs)
	if err != nil {
		return fmt.Errorf("after the removal: %w", err)
	}
	rw2 := rewritesOf(d2)
	x.After = &after
	x.ProxyCounters["after_removal_window"] = d2
	pr.Logf("proxy removal, %s: after the removal: %.3f Gbit/s (%.3f up, %.3f down), proxy host rewrote %d packets",
		what, after.TotalGbps, after.UpGbps, after.DownGbps, rw2)
	if rw2 != 0 {
		x.problem("after the removal: the proxy host's datapath still rewrote %d packets during the %v window (counter changes %v)", rw2, win, d2)
	}
	// An end may starve for a while under the greedy load (losses, RTO
	// back-off; the baseline shows it too): what matters is that every
	// session still carries data both ways. Paced again, every end must
	// receive more within 15 s.
	fs.greedy.Store(false)
	stuck, err := fs.waitProgress(ctx, 15*time.Second)
	if err != nil {
		return err
	}
	x.StuckEnds = stuck
	if len(stuck) > 0 {
		x.problem("after the removal: %d session ends received nothing more in 15 s of paced traffic after the window (first: %s)", len(stuck), stuck[0])
	}
	if nerr2, errs2 := fs.errors(); nerr2 > 0 {
		x.SessionErrs = append(x.SessionErrs, errs2...)
		x.problem("removal: %d session errors (first: %s)", nerr2, strings.Join(errs2, "; "))
	}
	return nil
}
