package experiment

// Experiment "setup-latency" (paper §5.1, Figure 8): connect() time through
// 1 and 4 middleboxes, Dysco and plain routing, checksum offload on and
// off. It reuses the connect() runner of `make bench` (bench.Connect).

import (
	"context"
	"fmt"
	"math"
	"strconv"
	"time"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/vg"

	"github.com/dysco/dysco/internal/bench"
	"github.com/dysco/dysco/internal/labkit"
)

func init() {
	Register(&Experiment{Name: "setup-latency", Paper: "Fig. 8",
		Summary: "connect() time through 1 and 4 middleboxes, Dysco and baseline, checksum offload on and off",
		Tools:   []string{"iperf3", "nginx", "ethtool"},
		Phases:  setupLatencyPhases, Run: runSetupLatency})
}

func setupConnects(s Size) int { return pick(s, 60, 1000, 2000) }

func setupLatencyPhases(s Size) []Phase {
	n := time.Duration(setupConnects(s))
	var ps []Phase
	for _, nmb := range []int{1, 4} {
		ps = append(ps, Phase{fmt.Sprintf("labs, %d mb", nmb), time.Duration(4+nmb) * time.Second})
		for _, off := range []string{"on", "off"} {
			ps = append(ps, Phase{fmt.Sprintf("connect(), %d mb, offload %s", nmb, off), n*2*300*time.Microsecond + 3*time.Second})
		}
	}
	return ps
}

func mean(xs []float64) float64 {
	if len(xs) == 0 {
		return math.NaN()
	}
	s := 0.0
	for _, x := range xs {
		s += x
	}
	return s / float64(len(xs))
}

func runSetupLatency(ctx context.Context, env *Env) (*Result, error) {
	o := env.O
	o.Connects = setupConnects(env.Size)
	res := &Result{Title: "session set-up latency"}
	var all []*bench.ConnectResult
	for _, nmb := range []int{1, 4} {
		env.Begin(fmt.Sprintf("labs, %d mb", nmb))
		p, err := labkit.UpPair(ctx, o.Agents(), env.set, env.Prefix, nmb, env.pr)
		if err != nil {
			return nil, err
		}
		for _, on := range []bool{true, false} {
			env.Begin(fmt.Sprintf("connect(), %d mb, offload %s", nmb, bench.OnOff(on)))
			if err := p.SetTxOffload(ctx, on); err != nil {
				p.Close()
				return nil, err
			}
			if err := bench.Connect(ctx, o, p, env.rep, env.pr, on); err != nil {
				p.Close()
				return nil, err
			}
			all = append(all, env.rep.Details[fmt.Sprintf("connect-%dmb-offload-%s", nmb, bench.OnOff(on))].(*bench.ConnectResult))
		}
		p.Close()
		if err := env.Down(); err != nil {
			return nil, err
		}
	}
	res.Data = all
	res.Setup = []string{
		"Two labs of the same line topology per middlebox count (`lab.Line`: client, mb1…mbN, server; N = 1 and 4), as in the paper (three and six hosts in a line). " +
			"**Dysco**: an agent on every host and a client policy chaining the middleboxes; **baseline**: no agents, the middleboxes forward by plain routing. The middleboxes run no application, as in the paper.",
		fmt.Sprintf("The runner, on an OS thread in the client's namespace, times %d blocking `connect()` calls per lab and setting to a listener on the server (after 20 warm-up calls; "+
			"sockets closed with an RST), alternating between the two labs in chunks. connect() returns when the SYN-ACK is in: the set-up round trip through the chain.", o.Connects),
		"Transmit checksum offload on (veth default) and off (`ethtool -K IFACE tx off` on every interface of every host): Fig. 8(a) and 8(b).",
		"The paper's hosts were separate machines with 10 GbE NICs; ours are network namespaces joined by veth pairs on one 2-vCPU machine, so every hop costs CPU time rather than wire time.",
	}
	// Tables.
	var rows, sum [][]string
	groups := []barGroup{}
	for _, c := range all {
		for i, v := range [][]float64{c.Dysco, c.Baseline} {
			name := []string{"dysco", "baseline"}[i]
			for _, x := range v {
				rows = append(rows, []string{strconv.Itoa(c.Middleboxes), bench.OnOff(c.TxOffload), name, strconv.FormatFloat(x, 'f', 2, 64)})
			}
			sum = append(sum, []string{strconv.Itoa(c.Middleboxes), bench.OnOff(c.TxOffload), name, strconv.Itoa(len(v)),
				f2(mean(v)), f2(labkit.Median(v)), f2(labkit.Quantile(v, 0.99))})
		}
	}
	if err := env.WriteCSV("setup_latency_samples.csv", []string{"middleboxes", "tx_offload", "variant", "connect_us"}, rows); err != nil {
		return res, err
	}
	if err := env.WriteCSV("setup_latency_summary.csv", []string{"middleboxes", "tx_offload", "variant", "samples", "mean_us", "median_us", "p99_us"}, sum); err != nil {
		return res, err
	}
	// Comparisons and plots.
	var cdfs []series
	for _, off := range []bool{true, false} {
		for _, c := range all {
			if c.TxOffload != off {
				continue
			}
			dm, bm := mean(c.Dysco), mean(c.Baseline)
			groups = append(groups, barGroup{fmt.Sprintf("%d mb, offload %s", c.Middleboxes, bench.OnOff(off)), []float64{dm, bm}})
			added := dm - bm
			paper, diff := "bars only (values not in the text)", ""
			if c.Middleboxes == 4 && !off {
				paper = "94 µs more than baseline (averages; the worst case)"
				diff = fmt.Sprintf("we add %.0f µs where the paper added 94 µs: ", added)
			}
			switch {
			case c.Middleboxes == 4 && !off && added < 94:
				diff += "lower, probably because our hops are veths on one machine (no NIC, no wire) and the paper's checksums without offload were computed in software on every host"
			case c.Middleboxes == 4 && !off:
				diff += "higher: on one 2-vCPU machine the set-up work of all six hosts' datapaths and agents queues for the same two CPUs"
			default:
				diff = fmt.Sprintf("Dysco adds %.0f µs (%.1f µs per middlebox) to a %.0f µs baseline; not comparable number for number, the paper gives no value", added, added/float64(c.Middleboxes), bm)
			}
			res.Comparisons = append(res.Comparisons, Comparison{
				What: fmt.Sprintf("connect() through %d mb, tx checksum offload %s: mean Dysco / baseline (median; p99)", c.Middleboxes, bench.OnOff(off)),
				Ours: fmt.Sprintf("%.1f / %.1f µs (%.1f / %.1f; %.0f / %.0f): +%.1f µs", dm, bm, labkit.Median(c.Dysco), labkit.Median(c.Baseline),
					labkit.Quantile(c.Dysco, 0.99), labkit.Quantile(c.Baseline, 0.99), added),
				Paper: paper, Difference: diff})
			if off {
				continue
			}
			cdfs = append(cdfs, series{fmt.Sprintf("Dysco, %d mb", c.Middleboxes), cdf(c.Dysco)}, series{fmt.Sprintf("baseline, %d mb", c.Middleboxes), cdf(c.Baseline)})
		}
	}
	bars, err := barChart("connect() latency (mean), Dysco and baseline", "µs", []string{"Dysco", "baseline"}, groups)
	if err != nil {
		return res, err
	}
	if err := env.SavePlots("setup_latency.png", 3.5*vg.Inch, bars); err != nil {
		return res, err
	}
	cp := newPlot("connect() latency CDF, tx offload on", "µs (log scale)", "fraction of calls")
	cp.X.Scale = plot.LogScale{}
	cp.X.Tick.Marker = plot.LogTicks{Prec: -1}
	if err := addLines(cp, cdfs, false); err != nil {
		return res, err
	}
	cp.Legend.Top, cp.Legend.Left = false, false
	if err := env.SavePlots("setup_latency_cdf.png", 3.5*vg.Inch, cp); err != nil {
		return res, err
	}
	var g []string
	for _, x := range groups {
		g = append(g, fmt.Sprintf("%s: %.0f vs %.0f µs", x.label, x.values[0], x.values[1]))
	}
	res.Plots = []Plot{
		{File: "setup_latency.png", Title: "Mean connect() latency (as Fig. 8)",
			Shows: "Blue bars Dysco, grey bars baseline, for 1 and 4 middleboxes with transmit checksum offload on (left pair of groups) and off (right pair): " +
				fmt.Sprintf("%s. ", joinSemi(g)) +
				"Dysco's bar is the taller one in every group and the gap grows with the number of middleboxes, as in the paper's figure; the paper's figure has averages of a few hundred µs, ours are tens of µs because nothing crosses a wire."},
		{File: "setup_latency_cdf.png", Title: "Distribution of connect() latency, offload on",
			Shows: "Cumulative distribution of every call, log-scale x axis. The Dysco curves lie to the right of the baseline curves of the same middlebox count: the added set-up work is paid by nearly every call, not by a few. " +
				"The right-hand tails (p99, in the table) are the shared machine's scheduling noise; they are present in both labs."},
	}
	c4 := all[len(all)-1]
	res.Headline = []string{
		fmt.Sprintf("connect() through 4 middleboxes, offload off: Dysco %.0f µs, baseline %.0f µs (mean): +%.0f µs (paper: +94 µs)", mean(c4.Dysco), mean(c4.Baseline), mean(c4.Dysco)-mean(c4.Baseline)),
		fmt.Sprintf("connect() through 1 middlebox, offload on: Dysco %.0f µs, baseline %.0f µs (mean)", mean(all[0].Dysco), mean(all[0].Baseline)),
		fmt.Sprintf("%d calls per lab and setting, alternating between the labs", o.Connects),
	}
	return res, nil
}

func joinSemi(s []string) string {
	out := ""
	for i, x := range s {
		if i > 0 {
			out += "; "
		}
		out += x
	}
	return out
}
