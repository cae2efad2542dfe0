package experiment

// Experiment "disruption" (paper §5.3, Figure 14): one greedy session
// across a live reconfiguration (mb1 replaced by mb2), congestion window
// and goodput every 50 ms, SACK on and off. It reuses the disruption runner
// of `make bench` (disruption.go). The paper set link delays with netem so
// that the new path was faster; this kernel has no netem
// (CONFIG_NET_SCH_NETEM is off), so both paths have the delay of veths and
// eBPF alone.

import (
	"context"
	"fmt"
	"strconv"
	"time"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"
)

func init() {
	Register(&Experiment{Name: "disruption", Paper: "Fig. 14",
		Summary: "one session across a reconfiguration: cwnd and goodput over time, SACK on and off",
		Tools:   []string{"sysctl"},
		Phases:  disruptionPhases, Run: runDisruptionExp})
}

func disruptionTime(s Size) time.Duration {
	return pick(s, 4*time.Second, 8*time.Second, 16*time.Second)
}

func disruptionPhases(s Size) []Phase {
	return []Phase{{"lab", 5 * time.Second}, {"one session, SACK on and off", 2 * (disruptionTime(s) + 5*time.Second)}}
}

func runDisruptionExp(ctx context.Context, env *Env) (*Result, error) {
	o := env.O
	o.DisruptionTime = disruptionTime(env.Size)
	res := &Result{Title: "one session across a reconfiguration"}
	env.Begin("lab")
	dl, err := upDisruptionLab(ctx, o, env.set, env.Prefix, env.pr)
	if err != nil {
		return res, err
	}
	env.Begin("one session, SACK on and off")
	berr := benchDisruption(ctx, o, dl, env.rep, env.pr)
	det, _ := env.rep.Details["disruption"].(*disruptionDetails)
	res.Data = det
	if det == nil || len(det.Runs) == 0 {
		return res, berr
	}
	if berr != nil {
		res.problem("%v", berr)
	}
	var rows [][]string
	var plots []*plot.Plot
	for _, x := range det.Runs {
		name := "on"
		if !x.SACK {
			name = "off"
		}
		for _, s := range x.Samples {
			rows = append(rows, []string{name, strconv.FormatFloat(s.T, 'f', 3, 64), strconv.FormatFloat(s.Gbps, 'f', 4, 64),
				strconv.FormatUint(uint64(s.Cwnd), 10), strconv.FormatUint(uint64(s.Retrans), 10), strconv.FormatUint(uint64(s.RttUs), 10)})
		}
		var g, c plotter.XYs
		maxG, maxC := 0.0, 0.0
		for _, s := range x.Samples {
			g = append(g, plotter.XY{X: s.T, Y: s.Gbps})
			c = append(c, plotter.XY{X: s.T, Y: float64(s.Cwnd)})
			maxG, maxC = max(maxG, s.Gbps), max(maxC, float64(s.Cwnd))
		}
		pg := newPlot(fmt.Sprintf("SACK %s: goodput per 50 ms", name), "", "Gbit/s")
		pc := newPlot(fmt.Sprintf("SACK %s: congestion window", name), "seconds since the session started", "segments")
		if err := addLines(pg, []series{{"goodput", g}}, false); err != nil {
			return res, err
		}
		if err := addLines(pc, []series{{"cwnd", c}}, false); err != nil {
			return res, err
		}
		for _, t := range []float64{x.ReconfigStart, x.ReconfigEnd} {
			vline(pg, t, 0, maxG*1.05, colour(2))
			vline(pc, t, 0, maxC*1.05, colour(2))
		}
		pg.Y.Min, pc.Y.Min = 0, 0
		pg.Y.Max, pc.Y.Max = maxG*1.3, maxC*1.3
		plots = append(plots, pg, pc)
		s := x.Summary
		if s == nil {
			continue
		}
		paper := "no disruption: cwnd and goodput carry on through the proxy removal at 30 s"
		if !x.SACK {
			paper = "losses temporarily degrade the session's performance"
		}
		diff := "no dip beyond the bins' own swing"
		if s.Ratio < s.BeforeRatio {
			diff = fmt.Sprintf("the smallest bin after is lower than the smallest before (%.2f vs %.2f ×)", s.Ratio, s.BeforeRatio)
		}
		if !x.SACK {
			diff += "; the paper's SACK-off dip came from packets lost when the new path was faster (netem delays); with no netem here both paths are as fast, so the switch-over is not expected to reorder packets and SACK off should look like SACK on"
		} else {
			diff += "; as in the paper, though here with no netem the new path is not faster than the old one, so the test is weaker"
		}
		res.Comparisons = append(res.Comparisons, Comparison{
			What: fmt.Sprintf("SACK %s: smallest 50 ms bin after the reconfiguration / mean of the second before (for scale: smallest bin before / mean)", name),
			Ours: fmt.Sprintf("%.2f × (%.2f ×); %.2f Gbit/s before; %d retransmissions in the window; reconfiguration %s", s.Ratio, s.BeforeRatio, s.BeforeGbps, s.RetransWindow,
				map[bool]string{true: fmt.Sprintf("in %.2f ms", float64(firstMicros(x))/1000), false: "FAILED"}[len(x.Results) == 1 && x.Results[0].Outcome == "succeeded"]),
			Paper: paper, Difference: diff})
	}
	if err := env.WriteCSV("disruption.csv", []string{"sack", "t_s", "goodput_gbps", "cwnd_segments", "retrans_total", "rtt_us"}, rows); err != nil {
		return res, err
	}
	if err := env.SavePlots("disruption.png", 2.2*vg.Inch, plots...); err != nil {
		return res, err
	}
	res.Setup = []string{
		"A star lab: client, mb1, mb2 and server around a router, an agent on each; the client's policy chains the session through mb1.",
		fmt.Sprintf("One session, the runner at both ends, sending as fast as TCP lets for %v; every 50 ms, TCP_INFO of the receiver (bytes received: goodput) and of the sender (cwnd, retransmissions). "+
			"At 3/8 of the run the client replaces mb1 by mb2 (`dysco reconfig --match 'tcp port P' --to SERVER --chain MB2`). Once with SACK on, once with `net.ipv4.tcp_sack=0` at both ends.", o.DisruptionTime),
		"**Not as in the paper**: the paper ran this in Mininet with netem link delays so that the new path was faster than the old one (packets arrive out of order at the switch-over). " +
			"This kernel has no netem (CONFIG_NET_SCH_NETEM is not set; `tc qdisc add ... netem` fails with 'unknown qdisc'), so both paths have the delay of veths and eBPF alone (tens to hundreds of µs); the paper's removal came 30 s into the session, ours after a few seconds.",
	}
	res.Plots = []Plot{{File: "disruption.png", Title: "Goodput and congestion window across the reconfiguration (as Fig. 14)",
		Shows: "Four panels: goodput per 50 ms bin and the sender's congestion window, first with SACK on, then off; the dashed lines are when the `dysco reconfig` command started and returned. " +
			fmt.Sprintf("Goodput swings from bin to bin by itself (the session is CPU-bound on a shared machine); empty 50 ms bins in the second after the reconfiguration: %s. ", stallText(det)) +
			"the congestion window swings by an order of magnitude without any loss (at µs RTTs the session is never window-limited), so it says little here, unlike the paper's ms-RTT Mininet links."}}
	for _, x := range det.Runs {
		if x.Summary != nil {
			res.Headline = append(res.Headline, fmt.Sprintf("SACK %s: smallest 50 ms bin after the reconfiguration %.2f × the second before (before, for scale: %.2f ×)",
				map[bool]string{true: "on", false: "off"}[x.SACK], x.Summary.Ratio, x.Summary.BeforeRatio))
		}
	}
	res.Headline = append(res.Headline, "no netem on this kernel: both paths equally fast (the paper's new path was faster)")
	return res, nil
}

func firstMicros(x *disruptionRun) int64 {
	if len(x.Results) == 0 {
		return 0
	}
	return x.Results[0].Micros
}

// stallText lists the empty bins after each run's reconfiguration.
func stallText(det *disruptionDetails) string {
	var out []string
	for _, x := range det.Runs {
		if x.Summary != nil {
			out = append(out, fmt.Sprintf("SACK %s %d of %d", map[bool]string{true: "on", false: "off"}[x.SACK], x.Summary.StallBins, x.Summary.AfterBins))
		}
	}
	return joinSemi(out)
}
