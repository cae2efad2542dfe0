package experiment

// Experiment "disruption" (paper §5.3, Figure 14): one greedy session
// across a live reconfiguration (mb1 replaced by mb2) where the new path is
// faster than the old one, congestion window, RTT and goodput every 50 ms,
// SACK on and off. It reuses the disruption runner of `make bench`
// (bench.Disruption). The paper set link delays and bandwidths with netem in
// Mininet; this kernel has no netem (CONFIG_NET_SCH_NETEM is off), so the
// runner shapes mb1's link with TBF and has the sender use cubic, which
// fills the shaper's FIFO: the old path is slower in rate and in RTT
// (queueing delay), mb2's path is left alone.

import (
	"context"
	"fmt"
	"math"
	"strconv"
	"strings"
	"time"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"

	"github.com/dysco/dysco/internal/bench"
)

func init() {
	Register(&Experiment{Name: "disruption", Paper: "Fig. 14",
		Summary: "one session across a reconfiguration to a faster path (mb1's link shaped with TBF): cwnd, RTT and goodput over time, SACK on and off",
		Tools:   []string{"sysctl", "tc"},
		Phases:  disruptionPhases, Run: runDisruption})
}

func disruptionTime(s Size) time.Duration {
	return pick(s, 4*time.Second, 8*time.Second, 16*time.Second)
}

func disruptionPhases(s Size) []Phase {
	return []Phase{{"lab", 5 * time.Second}, {"one session, SACK on and off", 2 * (disruptionTime(s) + 5*time.Second)}}
}

// Floors of the log-scale plots: a bin with nothing received is drawn at
// 1 Mbit/s, an RTT under 10 µs at 10 µs.
const (
	disruptionGbpsFloor = 0.001
	disruptionRttFloor  = 0.01
)

func sackOnOff(sack bool) string {
	if sack {
		return "on"
	}
	return "off"
}

func runDisruption(ctx context.Context, env *Env) (*Result, error) {
	o := env.O
	o.DisruptionTime = disruptionTime(env.Size)
	res := &Result{Title: "one session across a reconfiguration to a faster path"}
	env.Begin("lab")
	dl, err := bench.UpDisruptionLab(ctx, o, env.set, env.Prefix, env.pr)
	if err != nil {
		return res, err
	}
	env.Begin("one session, SACK on and off")
	berr := bench.Disruption(ctx, o, dl, env.rep, env.pr)
	det, _ := env.rep.Details["disruption"].(*bench.DisruptionDetails)
	res.Data = det
	if det == nil || len(det.Runs) == 0 {
		return res, berr
	}
	if berr != nil {
		res.problem("%v", berr)
	}
	sh := dl.Shaping
	var rows [][]string
	var plots, reorder []*plot.Plot
	u := func(v uint32) string { return strconv.FormatUint(uint64(v), 10) }
	for _, x := range det.Runs {
		name := sackOnOff(x.SACK)
		for _, s := range x.Samples {
			rows = append(rows, []string{name, strconv.FormatFloat(s.T, 'f', 3, 64), strconv.FormatFloat(s.Gbps, 'f', 4, 64),
				u(s.Cwnd), u(s.Ssthresh), u(s.RttUs), strconv.Itoa(int(s.CaState)), u(s.Retrans), u(s.DsackDups), u(s.ReordSeen),
				u(s.RcvOoo), u(s.Unacked), u(s.Sacked), u(s.Lost), u(s.Reordering), u(s.Rtos)})
		}
		ps, err := disruptionRunPlots(x)
		if err != nil {
			return res, err
		}
		plots = append(plots, ps...)
		pr, err := disruptionReorderPlot(x)
		if err != nil {
			return res, err
		}
		reorder = append(reorder, pr)
		s := x.Summary
		if s == nil {
			continue
		}
		paper := "no disruption: cwnd and goodput carry on through the proxy removal at 30 s (Fig. 14(a))"
		if !x.SACK {
			paper = "with SACK disabled, packet losses temporarily degrade the session's performance (Fig. 14(b))"
		}
		diff := "no dip beyond the bins' own swing"
		if s.Ratio < s.BeforeRatio {
			diff = fmt.Sprintf("the smallest bin after is lower than the smallest before (%.2f vs %.2f ×)", s.Ratio, s.BeforeRatio)
		}
		diff += "; the ratio compares with the old path's rate, at which the old path's queue keeps delivering until the switch, so it shows stalls, not the loss of the new path's higher rate. " +
			"During the two-path phase the agents clamp the advertised window to 64 KB (paper §5.3), which bounds how much new-path data can overtake the old path's queue once the clamped window reaches the sender (the acks that carry it queue behind the data in mb1's FIFO)"
		recov := fmt.Sprintf("%d retransmissions (%d DSACKs: spurious)", s.RetransWindow, s.DsackWindow)
		if x.SACK {
			diff += fmt.Sprintf(". With SACK, RACK allows reordering of about a quarter of the minimum RTT (tcpi_min_rtt %d µs, measured before the FIFO filled), so a packet still queued on the old path when a newer one is SACKed is retransmitted needlessly, and comes back as a DSACK", x.MinRttUs)
		} else {
			recov = fmt.Sprintf("%d retransmissions (no DSACKs without SACK)", s.RetransWindow)
			diff += fmt.Sprintf(". Without SACK, Linux's sender takes a segment as lost after more duplicate acks than its reordering degree (tcpi_reordering %d before the switch, %d after; it grows when the sender sees reordering, which this lab also does by itself)", s.ReorderingBefore, s.ReorderingAfter)
			if s.RetransWindow == 0 && s.RecoveryBins == 0 {
				diff += fmt.Sprintf("; here no retransmission and no recovery at the switch-over (%d packets out of order at the server): unlike the paper, no loss degraded the session", s.RcvOooWindow)
			} else {
				diff += fmt.Sprintf("; here %d retransmissions, %d bins in recovery and %d timeouts in the window (%d packets out of order at the server)", s.RetransWindow, s.RecoveryBins, s.RtoWindow, s.RcvOooWindow)
			}
		}
		res.Comparisons = append(res.Comparisons, Comparison{
			What: fmt.Sprintf("SACK %s: smallest 50 ms bin after the reconfiguration / mean of the second before (for scale: smallest bin before / mean); what happened at the switch-over", name),
			Ours: fmt.Sprintf("%.2f × (%.2f ×); %.3f Gbit/s before; in the window %d packets out of order at the server, %s, %d bins in recovery; reconfiguration %s",
				s.Ratio, s.BeforeRatio, s.BeforeGbps, s.RcvOooWindow, recov, s.RecoveryBins,
				map[bool]string{true: fmt.Sprintf("in %.2f ms", float64(firstMicros(x))/1000), false: "FAILED"}[len(x.Results) == 1 && x.Results[0].Outcome == "succeeded"]),
			Paper: paper, Difference: diff})
	}
	var paths []string
	for _, x := range det.Runs {
		if s := x.Summary; s != nil {
			paths = append(paths, fmt.Sprintf("SACK %s: RTT %.1f ms on mb1's path (second before) → %.2f ms on mb2's (last second); goodput %.3f → %.1f Gbit/s",
				sackOnOff(x.SACK), s.RttBeforeMs, s.RttLastMs, s.BeforeGbps, s.LastGbps))
		}
	}
	res.Comparisons = append([]Comparison{{
		What:  "the new path is faster than the old one (so that packets overtake at the switch-over)",
		Ours:  joinSemi(paths),
		Paper: "Mininet links with different delays and bandwidths, the new path faster (the paper does not give the figures)",
		Difference: fmt.Sprintf("shaping plus queueing delay, not a constant link delay: this kernel has no netem, so mb1's link is limited to %d Mbit/s by TBF with a %d ms FIFO and the sender uses %s, which keeps the FIFO mostly full; "+
			"the old path's RTT is that queue (0 to %d ms, following cubic's window, so it differs from run to run) and a full FIFO drops packets, while the paper's links had a set delay. "+
			"mb2's path is unshaped: the RTT of veths and eBPF and a CPU-bound rate. The paper's delays and rates are not given, so the size of the difference cannot be compared",
			sh.RateMbit, sh.BufferMs, sh.CC, sh.BufferMs),
	}}, res.Comparisons...)
	if err := env.WriteCSV("disruption.csv", []string{"sack", "t_s", "goodput_gbps", "cwnd_segments", "ssthresh_segments", "rtt_us", "ca_state",
		"retrans_total", "dsack_total", "reord_seen_total", "rcv_ooopack_total", "unacked", "sacked", "lost", "reordering", "rtos_total"}, rows); err != nil {
		return res, err
	}
	if err := env.SavePlots("disruption.png", 2*vg.Inch, plots...); err != nil {
		return res, err
	}
	if err := env.SavePlots("disruption-reordering.png", 2.4*vg.Inch, reorder...); err != nil {
		return res, err
	}
	res.Setup = []string{
		"A star lab: client, mb1, mb2 and server around a router, an agent on each; the client's policy chains the session through mb1.",
		fmt.Sprintf("The old path is made slower: %s. Commands: `%s`. TBF drops what does not fit in the FIFO; the namespaces, and the qdiscs with them, go when the lab is torn down. "+
			"If TBF cannot be installed the experiment fails and says what is missing; it does not fall back to an unshaped run.",
			sh, strings.Join(sh.Commands, "`; `")),
		fmt.Sprintf("One session, the runner at both ends, sending as fast as TCP lets for %v with %s on the sender's socket (TCP_CONGESTION; the lab's default, BBR, would keep the FIFO empty); every 50 ms, TCP_INFO of the receiver (bytes received: goodput; out-of-order packets) and of the sender (cwnd, smoothed RTT, retransmissions, DSACKs, reordering events and degree, segments lost and SACKed, congestion state). "+
			"At 3/8 of the run the client replaces mb1 by mb2 (`dysco reconfig --match 'tcp port P' --to SERVER --chain MB2`). Once with SACK on, once with `net.ipv4.tcp_sack=0` at both ends. The shapers' counters (`tc -s qdisc`) are read before and after each run.", o.DisruptionTime, sh.CC),
		"**Not as in the paper**: the paper ran this in Mininet with netem link delays and bandwidths. This kernel has no netem (CONFIG_NET_SCH_NETEM is not set; `tc qdisc add ... netem` fails with 'unknown qdisc'), " +
			"so the old path's extra RTT is queueing delay in a shaper that cubic fills, not a constant delay, and mb2's path has the delay of veths and eBPF alone; the paper's removal came 30 s into the session, ours after a few seconds.",
	}
	res.Plots = []Plot{
		{File: "disruption.png", Title: "Goodput, congestion window and RTT across the reconfiguration (as Fig. 14)",
			Shows: "Six panels, three per run (SACK on, then off): goodput per 50 ms bin (log scale: the old path's ~0.14 Gbit/s and the new path's Gbit/s in one panel; an empty bin is drawn at 1 Mbit/s), the sender's congestion window, and the sender's smoothed RTT (log scale; tens of ms on the shaped old path, sub-ms on the new one). " +
				"The dashed lines are when the `dysco reconfig` command started and returned. " +
				fmt.Sprintf("On the new path goodput swings from bin to bin by itself (the session is CPU-bound on a shared machine); empty 50 ms bins in the second after the reconfiguration: %s. ", stallText(det)) +
				"Before the switch the window is what fills the shaper's FIFO (the RTT rises with it); after, at sub-ms RTTs, the session is not window-limited and cwnd says little about its rate."},
		{File: "disruption-reordering.png", Title: "Reordering and recovery around the switch-over",
			Shows: "One panel per run, from 1 s before the reconfiguration to 1 s after it ended: counters since the start of the panel of the receiver's out-of-order packets (tcpi_rcv_ooopack), the sender's retransmissions (tcpi_total_retrans) and duplicate SACKs (tcpi_dsack_dups: retransmissions the receiver already had, i.e. spurious), and the sender's reordering events (tcpi_reord_seen). " +
				"A step in out-of-order packets at the dashed lines is the new path's packets overtaking the old path's queue (a packet behind a lost one counts too, as after the shaper's drops); DSACKs equal to the retransmissions mean every retransmission was of a packet that was late, not lost (the DSACK line then hides the retransmissions' line)."},
	}
	res.Headline = append(res.Headline, fmt.Sprintf("old path (mb1) shaped with TBF to %d Mbit/s, %d ms FIFO, sender %s; new path (mb2) unshaped: %s",
		sh.RateMbit, sh.BufferMs, sh.CC, joinSemi(paths)))
	for _, x := range det.Runs {
		if s := x.Summary; s != nil {
			retr := fmt.Sprintf("%d retransmissions", s.RetransWindow)
			if x.SACK {
				retr += fmt.Sprintf(" (%d DSACKs)", s.DsackWindow)
			}
			res.Headline = append(res.Headline, fmt.Sprintf("SACK %s: smallest 50 ms bin after the reconfiguration %.2f × the second before (before, for scale: %.2f ×); at the switch-over %d packets out of order at the server, %s, %d bins in recovery",
				sackOnOff(x.SACK), s.Ratio, s.BeforeRatio, s.RcvOooWindow, retr, s.RecoveryBins))
		}
	}
	return res, nil
}

// disruptionRunPlots are the goodput, cwnd and RTT panels of one run.
func disruptionRunPlots(x *bench.DisruptionRun) ([]*plot.Plot, error) {
	name := sackOnOff(x.SACK)
	var g, c, r plotter.XYs
	maxG, maxC, maxR := disruptionGbpsFloor, 1.0, disruptionRttFloor
	for _, s := range x.Samples {
		rtt := float64(s.RttUs) / 1000
		g = append(g, plotter.XY{X: s.T, Y: math.Max(s.Gbps, disruptionGbpsFloor)})
		c = append(c, plotter.XY{X: s.T, Y: float64(s.Cwnd)})
		r = append(r, plotter.XY{X: s.T, Y: math.Max(rtt, disruptionRttFloor)})
		maxG, maxC, maxR = max(maxG, s.Gbps), max(maxC, float64(s.Cwnd)), max(maxR, rtt)
	}
	pg := newPlot(fmt.Sprintf("SACK %s: goodput per 50 ms", name), "", "Gbit/s (log)")
	pc := newPlot(fmt.Sprintf("SACK %s: congestion window", name), "", "segments")
	pr := newPlot(fmt.Sprintf("SACK %s: sender's smoothed RTT", name), "seconds since the session started", "ms (log)")
	for _, l := range []struct {
		p    *plot.Plot
		name string
		xy   plotter.XYs
	}{{pg, "goodput", g}, {pc, "cwnd", c}, {pr, "RTT (tcpi_rtt)", r}} {
		if err := addLines(l.p, []series{{l.name, l.xy}}, false); err != nil {
			return nil, err
		}
	}
	pg.Y.Scale, pr.Y.Scale = plot.LogScale{}, plot.LogScale{}
	pg.Y.Tick.Marker, pr.Y.Tick.Marker = plot.LogTicks{Prec: -1}, plot.LogTicks{Prec: -1}
	pg.Y.Min, pg.Y.Max = disruptionGbpsFloor, maxG*4
	pr.Y.Min, pr.Y.Max = disruptionRttFloor, maxR*4
	pc.Y.Min, pc.Y.Max = 0, maxC*1.3
	for _, t := range []float64{x.ReconfigStart, x.ReconfigEnd} {
		for _, v := range []struct {
			p      *plot.Plot
			y0, y1 float64
		}{{pg, disruptionGbpsFloor, maxG * 2}, {pc, 0, maxC * 1.05}, {pr, disruptionRttFloor, maxR * 2}} {
			if err := vline(v.p, t, v.y0, v.y1, colour(2)); err != nil {
				return nil, err
			}
		}
	}
	return []*plot.Plot{pg, pc, pr}, nil
}

// disruptionReorderPlot draws the reordering and recovery counters of a
// run from 1 s before the reconfiguration to 1 s after it ended, counted
// from the start of that span.
func disruptionReorderPlot(x *bench.DisruptionRun) (*plot.Plot, error) {
	from, to := x.ReconfigStart-bench.DisruptionWin.Seconds(), x.ReconfigEnd+bench.DisruptionWin.Seconds()
	var base *bench.DisruptionSample
	var ooo, retr, dsack, reord plotter.XYs
	top := 1.0
	for i := range x.Samples {
		s := &x.Samples[i]
		if s.T <= from {
			base = s
			continue
		}
		if s.T > to {
			break
		}
		if base == nil {
			base = &bench.DisruptionSample{}
		}
		d := func(a, b uint32) float64 { return float64(a - b) }
		ooo = append(ooo, plotter.XY{X: s.T, Y: d(s.RcvOoo, base.RcvOoo)})
		retr = append(retr, plotter.XY{X: s.T, Y: d(s.Retrans, base.Retrans)})
		dsack = append(dsack, plotter.XY{X: s.T, Y: d(s.DsackDups, base.DsackDups)})
		reord = append(reord, plotter.XY{X: s.T, Y: d(s.ReordSeen, base.ReordSeen)})
		top = max(top, d(s.RcvOoo, base.RcvOoo), d(s.Retrans, base.Retrans), d(s.DsackDups, base.DsackDups), d(s.ReordSeen, base.ReordSeen))
	}
	p := newPlot(fmt.Sprintf("SACK %s: reordering and recovery around the reconfiguration", sackOnOff(x.SACK)), "seconds since the session started", "count since the panel's start")
	if err := addLines(p, []series{{"out-of-order packets at the server", ooo}, {"retransmissions", retr}, {"DSACKs (spurious retransmissions)", dsack}, {"reordering events (sender)", reord}}, true); err != nil {
		return nil, err
	}
	for _, t := range []float64{x.ReconfigStart, x.ReconfigEnd} {
		if err := vline(p, t, 0, top*1.05, colour(6)); err != nil {
			return nil, err
		}
	}
	p.Y.Min, p.Y.Max = 0, top*2.2 // room for the legend
	p.X.Min, p.X.Max = from, to
	return p, nil
}

func firstMicros(x *bench.DisruptionRun) int64 {
	if len(x.Results) == 0 {
		return 0
	}
	return x.Results[0].Micros
}

// stallText lists the empty bins after each run's reconfiguration.
func stallText(det *bench.DisruptionDetails) string {
	var out []string
	for _, x := range det.Runs {
		if x.Summary != nil {
			out = append(out, fmt.Sprintf("SACK %s %d of %d", sackOnOff(x.SACK), x.Summary.StallBins, x.Summary.AfterBins))
		}
	}
	return joinSemi(out)
}
