package experiment

// Experiment "udp-setup" (heterogeneous-SFC paper §VI: "the latencies for
// session initiation" of QUIC sessions): the first request/response
// exchange of new UDP sessions through 1 and 4 middleboxes, Dysco and
// plain routing. The first datagram of a session carries the address list
// and sets up each hop in BPF (docs/architecture.md, "UDP sessions"). It
// reuses the runner of `make bench` (bench.UDPSetup).

import (
	"context"
	"fmt"
	"strconv"
	"time"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/vg"

	"github.com/dysco/dysco/internal/bench"
	"github.com/dysco/dysco/internal/labkit"
)

func init() {
	Register(&Experiment{Name: "udp-setup", Paper: "QUIC paper §VI (session initiation)",
		Summary: "first request/response of new UDP sessions through 1 and 4 middleboxes, Dysco and baseline",
		Tools:   []string{"iperf3", "nginx"},
		Phases:  udpSetupPhases, Run: runUDPSetup})
}

func udpSetupSessions(s Size) int { return pick(s, 60, 1000, 2000) }

func udpSetupPhases(s Size) []Phase {
	n := time.Duration(udpSetupSessions(s))
	var ps []Phase
	for _, nmb := range []int{1, 4} {
		ps = append(ps, Phase{fmt.Sprintf("labs, %d mb", nmb), time.Duration(4+nmb) * time.Second},
			Phase{fmt.Sprintf("udp set-up, %d mb", nmb), n*4*300*time.Microsecond + 3*time.Second})
	}
	return ps
}

// targetText says how a first exchange's added µs per middlebox stands
// against the target of 25 µs.
func targetText(per float64) string {
	if per <= 25 {
		return fmt.Sprintf("within the target of 25 µs by %.1f µs", 25-per)
	}
	return fmt.Sprintf("over the target of 25 µs by %.1f µs", per-25)
}

func runUDPSetup(ctx context.Context, env *Env) (*Result, error) {
	o := env.O
	o.Connects = udpSetupSessions(env.Size)
	res := &Result{Title: "UDP session set-up latency"}
	var all []*bench.UDPSetupResult
	for _, nmb := range []int{1, 4} {
		env.Begin(fmt.Sprintf("labs, %d mb", nmb))
		p, err := labkit.UpPair(ctx, o.Agents(), env.set, env.Prefix, nmb, env.pr)
		if err != nil {
			return nil, err
		}
		env.Begin(fmt.Sprintf("udp set-up, %d mb", nmb))
		err = bench.UDPSetup(ctx, o, p, env.rep, env.pr)
		p.Close()
		if err != nil {
			return nil, err
		}
		all = append(all, env.rep.Details[fmt.Sprintf("udpsetup-%dmb", nmb)].(*bench.UDPSetupResult))
		if err := env.Down(); err != nil {
			return nil, err
		}
	}
	res.Data = all
	res.Setup = []string{
		"Two labs of the same line topology per middlebox count (`lab.Line`: client, mb1…mbN, server; N = 1 and 4). " +
			"**Dysco**: an agent on every host and a client policy `" + labkit.UDPPolicyFilter + "` chaining the middleboxes; **baseline**: no agents, the middleboxes forward by plain routing. The middleboxes run no application.",
		fmt.Sprintf("The runner, on an OS thread in the client's namespace, opens %d UDP sessions per lab one after the other, each a new socket bound to a new source port (a new five-tuple), "+
			"and times two exchanges on each: a 64-byte request to an echo server on the server and its answer. The first exchange is the session's set-up: its request carries the address list and sets up every hop's state in BPF on the way; "+
			"the second is the control (the steady state). 20 warm-up sessions per lab first; the labs alternate in chunks.", o.Connects),
		"On mb1 of the Dysco lab, with the kernel's BPF statistics on, the run time of its TC programs per exchange for the first exchange of new sessions and for the exchanges of one established session.",
		"The paper's sessions were ngtcp2 QUIC sessions between separate machines with FPGA and processor middleboxes; ours are network namespaces joined by veth pairs on one 2-vCPU machine.",
	}
	var rows, sum [][]string
	var groups []barGroup
	var cdfs []series
	for _, c := range all {
		for _, s := range []struct {
			variant, exch string
			v             []float64
		}{{"dysco", "first", c.DyscoFirst}, {"dysco", "second", c.DyscoSecond}, {"baseline", "first", c.BaselineFirst}, {"baseline", "second", c.BaselineSecond}} {
			for _, x := range s.v {
				rows = append(rows, []string{strconv.Itoa(c.Middleboxes), s.variant, s.exch, strconv.FormatFloat(x, 'f', 2, 64)})
			}
			sum = append(sum, []string{strconv.Itoa(c.Middleboxes), s.variant, s.exch, strconv.Itoa(len(s.v)),
				f2(mean(s.v)), f2(labkit.Median(s.v)), f2(labkit.Quantile(s.v, 0.99))})
		}
		df, bf := labkit.Median(c.DyscoFirst), labkit.Median(c.BaselineFirst)
		ds, bs := labkit.Median(c.DyscoSecond), labkit.Median(c.BaselineSecond)
		groups = append(groups,
			barGroup{fmt.Sprintf("%d mb, first", c.Middleboxes), []float64{df, bf}},
			barGroup{fmt.Sprintf("%d mb, second", c.Middleboxes), []float64{ds, bs}})
		cdfs = append(cdfs, series{fmt.Sprintf("Dysco, %d mb", c.Middleboxes), cdf(c.DyscoFirst)}, series{fmt.Sprintf("baseline, %d mb", c.Middleboxes), cdf(c.BaselineFirst)})
		added := df - bf
		per := added / float64(c.Middleboxes)
		bpf := "not measured"
		if c.BPF != nil {
			bpf = fmt.Sprintf("%.0f ns on mb1 per first exchange, %.0f ns per steady one", c.BPF.NsPerFirst, c.BPF.NsPerSteady)
		} else if c.BPFError != "" {
			bpf = "not measured: " + c.BPFError
		}
		res.Comparisons = append(res.Comparisons, Comparison{
			What: fmt.Sprintf("first exchange of a new UDP session through %d mb: median Dysco / baseline (p99); second exchange", c.Middleboxes),
			Ours: fmt.Sprintf("%.1f / %.1f µs (%.0f / %.0f): +%.1f µs, %.1f µs per middlebox; second exchange %.1f / %.1f µs (%+.1f µs); BPF: %s",
				df, bf, labkit.Quantile(c.DyscoFirst, 0.99), labkit.Quantile(c.BaselineFirst, 0.99), added, per, ds, bs, ds-bs, bpf),
			Paper:      "session initiation latency measured (§VI) but no figure or value given in the text; Table II gives per-packet firewall latency (115.6 µs software, 85.8 µs DPDK, 3.7 µs FPGA), not set-up",
			Difference: fmt.Sprintf("no number of the paper to compare with; Dysco adds %.1f µs per middlebox to the first exchange (%s) and %.1f µs per middlebox to the second", per, targetText(per), (ds-bs)/float64(c.Middleboxes)),
		})
	}
	if err := env.WriteCSV("udp_setup_samples.csv", []string{"middleboxes", "variant", "exchange", "us"}, rows); err != nil {
		return res, err
	}
	if err := env.WriteCSV("udp_setup_summary.csv", []string{"middleboxes", "variant", "exchange", "samples", "mean_us", "median_us", "p99_us"}, sum); err != nil {
		return res, err
	}
	bars, err := barChart("UDP exchange latency (median), Dysco and baseline", "µs", []string{"Dysco", "baseline"}, groups)
	if err != nil {
		return res, err
	}
	if err := env.SavePlots("udp_setup.png", 3.5*vg.Inch, bars); err != nil {
		return res, err
	}
	cp := newPlot("first exchange of a new UDP session, CDF", "µs (log scale)", "fraction of sessions")
	cp.X.Scale = plot.LogScale{}
	cp.X.Tick.Marker = plot.LogTicks{Prec: -1}
	if err := addLines(cp, cdfs, false); err != nil {
		return res, err
	}
	cp.Legend.Top, cp.Legend.Left = false, false
	if err := env.SavePlots("udp_setup_cdf.png", 3.5*vg.Inch, cp); err != nil {
		return res, err
	}
	var g []string
	for _, x := range groups {
		g = append(g, fmt.Sprintf("%s: %.0f vs %.0f µs", x.label, x.values[0], x.values[1]))
	}
	res.Plots = []Plot{
		{File: "udp_setup.png", Title: "Median exchange latency: a session's first exchange and its second",
			Shows: "Blue bars Dysco, grey bars baseline, for 1 and 4 middleboxes, first exchange (set-up) and second (steady state): " + joinSemi(g) + ". " +
				"The gap between the bars of a first-exchange group is the set-up cost of the chain; the gap in the second-exchange group is the steady per-datagram rewrite."},
		{File: "udp_setup_cdf.png", Title: "Distribution of the first exchange",
			Shows: "Cumulative distribution of every session's first exchange, log-scale x axis, Dysco and baseline for 1 and 4 middleboxes. The tails are the shared machine's scheduling noise, in both labs."},
	}
	c1, c4 := all[0], all[len(all)-1]
	res.Headline = []string{
		fmt.Sprintf("first UDP exchange through 4 middleboxes: Dysco %.0f µs, baseline %.0f µs (median): +%.1f µs per middlebox (target ≤ 25)", labkit.Median(c4.DyscoFirst), labkit.Median(c4.BaselineFirst), (labkit.Median(c4.DyscoFirst)-labkit.Median(c4.BaselineFirst))/4),
		fmt.Sprintf("first UDP exchange through 1 middlebox: Dysco %.0f µs, baseline %.0f µs (median); second exchange %.0f / %.0f µs", labkit.Median(c1.DyscoFirst), labkit.Median(c1.BaselineFirst), labkit.Median(c1.DyscoSecond), labkit.Median(c1.BaselineSecond)),
		fmt.Sprintf("%d sessions per lab and topology, alternating between the labs", o.Connects),
	}
	return res, nil
}
