package experiment

// Experiment "churn" (a soak of §3's live reconfiguration; no figure of the
// paper has it): keep-alive HTTP that nginx closes every few requests,
// byte-checked bulk sessions both ways that end and start again, and short
// connections, IPv4 and IPv6 side by side, through the client's policy
// chains, while the client inserts, deletes and replaces middleboxes in
// them round after round (random chains among mb1, mb2, mb3 and none; some
// rounds right after the previous one, some asking for the path the
// sessions already have). It fails on any reset, failed transfer or stuck
// phase. The runner is internal/bench's RunChurn, shared with `make bench`
// and the end-to-end test.

import (
	"context"
	"crypto/rand"
	"encoding/binary"
	"fmt"
	"math"
	"sort"
	"strconv"
	"strings"
	"time"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"

	"github.com/dysco/dysco/internal/bench"
	"github.com/dysco/dysco/internal/lab"
	"github.com/dysco/dysco/internal/labkit"
)

func init() {
	Register(&Experiment{Name: "churn", Paper: "§3",
		Summary:     "random insert/delete/replace rounds on HTTP, bulk and short sessions that come and go, IPv4 and IPv6: resets, failed transfers, stuck phases, times",
		Tools:       []string{"nginx", "wrk", "nstat"},
		Phases:      func(s Size) []Phase { return churnPhases(churnSizes(s).Duration) },
		TimedPhases: churnPhases, Run: runChurn})
}

// churnSize is a run's workload: Duration of rounds, and per family wrk's
// connections, streams and short-connection workers.
type churnSize struct {
	Duration   time.Duration `json:"duration"`
	Interval   time.Duration `json:"interval"`
	WrkConns   int           `json:"wrk_connections"`
	Keepalive  int           `json:"keepalive_requests"`
	Streams    int           `json:"streams"`
	StreamRate int64         `json:"stream_rate"`
	StreamLife time.Duration `json:"stream_life"`
	Shorts     int           `json:"short_workers"`
}

func churnSizes(s Size) churnSize {
	return pick(s,
		churnSize{12 * time.Second, 300 * time.Millisecond, 8, 50, 2, 1 << 20, 3 * time.Second, 1},
		churnSize{150 * time.Second, 500 * time.Millisecond, 25, 100, 4, 2 << 20, 8 * time.Second, 2},
		churnSize{600 * time.Second, 500 * time.Millisecond, 50, 100, 8, 2 << 20, 10 * time.Second, 3})
}

func churnPhases(d time.Duration) []Phase {
	return []Phase{{"lab", 6 * time.Second}, {"workload under reconfiguration rounds", d + 3*time.Second}, {"checks and report", 8 * time.Second}}
}

// churnData is the experiment's raw data.
type churnData struct {
	Size churnSize          `json:"size"`
	Seed uint64             `json:"seed"`
	Run  *bench.ChurnResult `json:"run"`
}

func runChurn(ctx context.Context, env *Env) (*Result, error) {
	z := churnSizes(env.Size)
	if env.Duration > 0 {
		z.Duration = env.Duration
	}
	var seed [8]byte
	rand.Read(seed[:])
	d := &churnData{Size: z, Seed: binary.BigEndian.Uint64(seed[:])}
	res := &Result{Title: "live reconfiguration under churn", Data: d}

	env.Begin("lab")
	l, err := env.set.Up(ctx, env.Prefix+"ch", lab.Star("client", "mb1", "mb2", "mb3", "server"), env.O.Agents())
	if err != nil {
		return res, err
	}

	env.Begin("workload under reconfiguration rounds")
	spec := bench.ChurnSpec{Lab: l, Dysco: env.O.Dysco, Middleboxes: []string{"mb1", "mb2", "mb3"}, IPv4: true, IPv6: true,
		HTTPChain: []string{"mb1"}, StreamChain: []string{"mb2"},
		Keepalive: z.Keepalive, FileSize: 64 << 10, WrkThreads: 1, WrkConns: z.WrkConns,
		Streams: z.Streams, StreamRate: z.StreamRate, StreamLife: z.StreamLife, Shorts: z.Shorts, ShortGap: 50 * time.Millisecond,
		Start: time.Second, Interval: z.Interval, Duration: z.Duration, Seed: d.Seed, FollowUps: 0.25,
		SlowAfter: time.Second, Logf: env.Logf}
	d.Run, err = bench.RunChurn(ctx, spec)
	if err != nil {
		return res, err
	}
	env.Begin("checks and report")
	for _, p := range d.Run.Problems() {
		res.problem("%s", p)
	}
	return res, churnReport(env, res, d, spec)
}

// churnReport writes the CSV files and the plot, and fills the report.
func churnReport(env *Env, res *Result, d *churnData, spec bench.ChurnSpec) error {
	r := d.Run
	var rounds, results [][]string
	var follow int
	byKind := map[string][]float64{}
	var all []float64
	byOutcome := map[string]plotter.XYs{}
	for _, rd := range r.Rounds {
		n := map[string]int{}
		for _, o := range rd.Results {
			n[o.Outcome]++
			ms := float64(o.Micros) / 1000
			results = append(results, []string{strconv.Itoa(rd.N), rd.Family, o.Session, o.Kind, strings.Join(o.Path, " "), strings.Join(rd.Chain, " "),
				o.Outcome, o.Reason, f3(ms), f3(float64(o.LockMicros) / 1000), f3(float64(o.SetupMicros) / 1000), o.Fate, strings.Join(o.Classes, "; ")})
			if o.Outcome == "succeeded" {
				byKind[o.Kind] = append(byKind[o.Kind], ms)
				all = append(all, ms)
			}
			byOutcome[o.Outcome] = append(byOutcome[o.Outcome], plotter.XY{X: rd.At, Y: math.Max(ms, 0.01)})
		}
		if rd.FollowUp {
			follow++
		}
		rounds = append(rounds, []string{strconv.Itoa(rd.N), f3(rd.At), rd.Family, rd.Match, strings.Join(rd.Chain, " "), strconv.FormatBool(rd.FollowUp),
			f3(rd.WallMs), strconv.Itoa(len(rd.Results)), strconv.Itoa(n["succeeded"]), strconv.Itoa(n["refused"]), strconv.Itoa(n["failed"]), rd.Err})
	}
	if err := env.WriteCSV("churn_rounds.csv", []string{"round", "at_s", "family", "match", "chain", "follow_up", "wall_ms", "results", "succeeded", "refused", "failed", "error"}, rounds); err != nil {
		return err
	}
	if err := env.WriteCSV("churn_results.csv", []string{"round", "family", "session", "kind", "path_before", "chain", "outcome", "reason", "ms", "lock_ms", "setup_ms", "socket", "classes"}, results); err != nil {
		return err
	}
	var wl [][]string
	for _, w := range r.Wrk {
		wl = append(wl, []string{"wrk " + w.Family, strconv.FormatInt(w.Requests, 10), f1(w.RPS), strconv.FormatInt(w.Connect, 10), strconv.FormatInt(w.Read, 10),
			strconv.FormatInt(w.Write, 10), strconv.FormatInt(w.Timeout, 10), strconv.FormatInt(w.Non2xx, 10), "", "", ""})
	}
	for _, x := range []struct {
		name string
		f    *bench.ChurnFlows
	}{{"streams", r.Streams}, {"short connections", r.Shorts}} {
		if x.f != nil {
			wl = append(wl, []string{x.name, strconv.FormatInt(x.f.Sessions, 10), "", "", "", "", "", "", strconv.FormatInt(x.f.Resets, 10), strconv.FormatInt(x.f.Failed, 10),
				fmt.Sprintf("%d/%d", x.f.BytesUp, x.f.BytesDown)})
		}
	}
	if err := env.WriteCSV("churn_workload.csv", []string{"workload", "requests_or_sessions", "requests_per_s", "connect_errors", "read_errors", "write_errors", "timeouts", "non_2xx", "resets", "failed", "bytes_up_down"}, wl); err != nil {
		return err
	}

	// Plots: the CDF of the times by kind, and every result over time.
	cp := newPlot("reconfiguration time of the succeeded results (CDF)", "ms (log)", "fraction")
	kinds := []string{"insert", "delete", "replace", "unchanged", "overlap"}
	ss := []series{{fmt.Sprintf("all (%d)", len(all)), cdf(clampPos(all))}}
	for _, k := range kinds {
		if len(byKind[k]) > 0 {
			ss = append(ss, series{fmt.Sprintf("%s (%d)", k, len(byKind[k])), cdf(clampPos(byKind[k]))})
		}
	}
	if err := addLines(cp, ss, false); err != nil {
		return err
	}
	cp.X.Scale, cp.X.Tick.Marker = plot.LogScale{}, plot.LogTicks{Prec: -1}
	cp.Y.Min, cp.Y.Max = 0, 1.05
	cp.Legend.Top, cp.Legend.Left = false, false
	tl := newPlot("every result of every round", "seconds since the workload started", "ms (log)")
	var outs []string
	for k := range byOutcome {
		outs = append(outs, k)
	}
	sort.Strings(outs)
	for _, k := range outs {
		sc, err := plotter.NewScatter(byOutcome[k])
		if err != nil {
			return err
		}
		sc.GlyphStyle.Color = colour(map[string]int{"succeeded": 0, "refused": 4, "failed": 2}[k])
		sc.GlyphStyle.Radius = vg.Points(1.5)
		tl.Add(sc)
		tl.Legend.Add(fmt.Sprintf("%s (%d)", k, len(byOutcome[k])), sc)
	}
	tl.Y.Scale, tl.Y.Tick.Marker = plot.LogScale{}, plot.LogTicks{Prec: -1}
	tl.X.Min, tl.X.Max = 0, r.Seconds+0.5
	tl.Legend.Top = false
	if len(outs) > 0 {
		if err := env.SavePlots("churn_times.png", 3.2*vg.Inch, cp, tl); err != nil {
			return err
		}
	}

	// The report.
	z := d.Size
	fams := strings.Join(r.Families, " and ")
	res.Setup = []string{
		"A star lab: client, mb1, mb2, mb3 and server around a router, an agent on each. The client's policies chain port 80 (HTTP) through mb1, port 9600 (bulk) through mb2, and make port 9601 (short connections) Dysco sessions with no middlebox; one policy per port and family.",
		fmt.Sprintf("Workload, %s side by side: nginx (1 worker) serves a 64 KiB file and closes each keep-alive connection after %d requests; `wrk -t1 -c%d --timeout 4s` per family asks for it, opening a new connection each time nginx closes one. "+
			"%d bulk sessions per family at any time, each sending the runner's pattern both ways at %d KiB/s per direction for up to %v, then the client half-closes, the server goes on sending for up to 300 ms and closes too, and every byte is compared; the next one opens at once. "+
			"%d worker%s per family open short connections one after the other (connect, a 16-byte request, a 1–60 KB response checked byte by byte, close), %v apart.",
			fams, z.Keepalive, z.WrkConns, z.Streams, z.StreamRate>>10, z.StreamLife, z.Shorts, labkit.Plural(z.Shorts), spec.ShortGap),
		fmt.Sprintf("Rounds, from 1 s on, %v after the previous one returned, for %v: at the client, `dysco reconfig --match FILTER --to SERVER [--chain HOPS]` with a random family, workload (or all three) and chain: the chain of the last round on those sessions (15 %%), the policy's (15 %%), none (15 %%), one of mb1–mb3 (40 %%) or two of them (15 %%). "+
			"A quarter of the rounds follow the previous one at once, on the same sessions with another chain. The seed was %d.", z.Interval, z.Duration, d.Seed),
		"What a result asked of its session comes from the path the runner gave it (its policy's chain, then the chain of its last successful round): insert (no middlebox before), delete (none after), replace, unchanged (the chain is its path) or overlap (the chain names a middlebox already on its path, and is not that path). What became of the session comes from the kernel: the client's sockets, listed every 50 ms (sock_diag).",
		"Resets: wrk's socket errors, resets seen by the runner's sessions, TcpEstabResets of the client and the server and TcpOutRsts of the middleboxes (nstat) over the workload. Failed transfers: bytes missing or wrong, wrk's non-2xx. Stuck phases: a lock or reconfiguration stage held on any host 3 s after the last round, on a session still open, and results slower than 1 s unless they are \"session ended\" for a session that did end. " +
			"Results that do not fit: a session still open after its round and not reconfigured (unless refused for an overlap), a session that ended during its round and failed with another reason than \"session ended\", \"session ended\" for a session still open.",
	}
	outcomes := labkit.SortedCounts(r.Outcomes)
	kindCounts := labkit.SortedCounts(r.Kinds)
	var wrkText []string
	for _, w := range r.Wrk {
		wrkText = append(wrkText, fmt.Sprintf("wrk %s %d/%d/%d/%d", w.Family, w.Connect, w.Read, w.Write, w.Timeout))
	}
	resets := r.ResetCount()
	flowsText := func(f *bench.ChurnFlows) string {
		if f == nil {
			return "none"
		}
		return fmt.Sprintf("%d of %d", f.Resets, f.Sessions)
	}
	failedText := func(f *bench.ChurnFlows) string {
		if f == nil {
			return "none"
		}
		return fmt.Sprintf("%d of %d (%.2f GB up, %.2f GB down)", f.Failed, f.Sessions, float64(f.BytesUp)/1e9, float64(f.BytesDown)/1e9)
	}
	var non2xx int64
	for _, w := range r.Wrk {
		non2xx += w.Non2xx
	}
	same := func(ok bool, bad string) string {
		if ok {
			return "the same"
		}
		return bad
	}
	res.Comparisons = []Comparison{
		{What: "connections reset",
			Ours: fmt.Sprintf("%d seen by the applications: %s (socket errors connect/read/write/timeout), streams %s, short connections %s; kernel counters: %s",
				resets, strings.Join(wrkText, ", "), flowsText(r.Streams), flowsText(r.Shorts), labkit.CountsText(r.KernelResets)),
			Paper:      "none: the endpoints see the same TCP session go on (§3.1)",
			Difference: same(len(r.Resets) == 0, "connections were reset: a bug (the checks that failed name them; churn.log in the lab's logs has every round)")},
		{What: "failed transfers (bytes missing or wrong)",
			Ours:       fmt.Sprintf("streams %s; short connections %s; wrk non-2xx %d", failedText(r.Streams), failedText(r.Shorts), non2xx),
			Paper:      "none",
			Difference: same(len(r.Failed) == 0, "transfers failed: a bug")},
		{What: "stuck phases",
			Ours:       fmt.Sprintf("%d (%d results slower than 1 s that are not \"session ended\" of an ended session); %d phases left on sessions that had ended", len(r.Stuck), r.ClassCount(bench.ClassSlow), len(r.Leftover)),
			Paper:      "none: a reconfiguration ends when the old path's last bytes are acknowledged (§3.5)",
			Difference: same(len(r.Stuck) == 0, "reconfigurations stalled: a bug")},
		{What: fmt.Sprintf("reconfiguration time at the left anchor, %d succeeded results", r.Times.N),
			Ours:       fmt.Sprintf("p50 %s ms, p90 %s, p99 %s, max %s", f2(r.Times.P50), f2(r.Times.P90), f2(r.Times.P99), f2(r.Times.Max)),
			Paper:      "Fig. 13 (proxy removals one at a time): 80 % under 2 ms, 98.7 % under 4 ms",
			Difference: fmt.Sprintf("each round reconfigures every matching session at once (up to %d), with wrk, nginx, the streams and every agent on 2 shared vCPUs; the paper's removals had the agents to themselves", maxResults(r))},
		{What: "results by outcome and reason",
			Ours:       strings.Join(outcomes, "; "),
			Paper:      "–",
			Difference: fmt.Sprintf("%d results do not fit their session's fate; by what was asked: %s", len(r.Unexpected), strings.Join(kindCounts, ", "))},
		{What: "rounds",
			Ours:       fmt.Sprintf("%d over %.0f s, %d right after the previous one; %d could not run", len(r.Rounds), r.Seconds, follow, len(r.Errors)),
			Paper:      "–",
			Difference: "–"},
	}
	res.Plots = []Plot{{File: "churn_times.png", Title: "Reconfiguration times under churn",
		Shows: fmt.Sprintf("Top: the CDF of the time from the request to the old path unused, for the %d succeeded results, all and by what the round asked (log scale). "+
			"Bottom: every result of every round at the time its round started, by outcome; a column of points is one round, and a stall shows as a column high up.", r.Times.N)}}
	res.Headline = []string{
		fmt.Sprintf("churn: %d rounds over %.0f s (%s), %s", len(r.Rounds), r.Seconds, fams, strings.Join(labkit.FirstN(outcomes, 4), ", ")),
		fmt.Sprintf("connections reset %d (kernel counters +%d), failed transfers %d, stuck phases %d, results that do not fit %d", resets, r.KernelResetCount(), len(r.Failed), len(r.Stuck), len(r.Unexpected)),
		fmt.Sprintf("reconfiguration time p50 %s ms, p90 %s, p99 %s, max %s (%d succeeded)", f2(r.Times.P50), f2(r.Times.P90), f2(r.Times.P99), f2(r.Times.Max), r.Times.N),
	}
	if len(r.Leftover) > 0 {
		res.Notes = append(res.Notes, fmt.Sprintf("Phases left on sessions that had ended (not counted as stuck): %s", strings.Join(labkit.FirstN(r.Leftover, 5), "; ")))
	}
	res.Notes = append(res.Notes, fmt.Sprintf("RSTs the client and the server sent over the workload (for information): %s; the agents' counter changes are in data.json.", labkit.CountsText(r.KernelOutRsts)))
	return nil
}

func f3(v float64) string { return fmtNum(v, 3) }

// clampPos keeps values positive for a log axis.
func clampPos(xs []float64) []float64 {
	out := make([]float64, len(xs))
	for i, x := range xs {
		out[i] = math.Max(x, 0.001)
	}
	return out
}

func maxResults(r *bench.ChurnResult) int {
	n := 0
	for _, rd := range r.Rounds {
		n = max(n, len(rd.Results))
	}
	return n
}
