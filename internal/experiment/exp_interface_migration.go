package experiment

// Experiment "interface-migration" (Serval §6.3, Figure 9): two greedy
// flows share one link of a host with two; one of them is moved to the
// second link while it runs, and both then go at the link's rate. Serval's
// server migrated a flow between its two GigE interfaces; here the
// multihomed host is the client (a Dysco session is moved by the host that
// starts it), its two links are shaped with TBF to the same rate, and the
// move is `dysco reconfig --via` (make before break, docs/mobility.md).

import (
	"context"
	"encoding/json"
	"fmt"
	"strconv"
	"strings"
	"time"

	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"

	"github.com/dysco/dysco/internal/api"
	"github.com/dysco/dysco/internal/lab"
	"github.com/dysco/dysco/internal/labkit"
)

func init() {
	Register(&Experiment{Name: "interface-migration", Paper: "Serval Fig. 9",
		Summary: "two flows on one of a host's two shaped links, one moved to the other with dysco reconfig --via: goodput per flow over time",
		Tools:   []string{"iperf3", "tc"},
		Phases:  imPhases, Run: runInterfaceMigration})
}

// imSize is a run's length, the move's time and the links' rate.
type imSize struct {
	Run, MoveAt time.Duration
	RateMbit    int
}

func imSizes(s Size) imSize {
	return pick(s,
		imSize{5 * time.Second, 2500 * time.Millisecond, 50},
		imSize{12 * time.Second, 6 * time.Second, 100},
		imSize{20 * time.Second, 10 * time.Second, 200})
}

func imPhases(s Size) []Phase {
	z := imSizes(s)
	return []Phase{{"lab and shapers", 6 * time.Second}, {"two flows, one moved", z.Run + 3*time.Second}}
}

// imPorts are the two flows' iperf3 ports; the second flow moves.
var imPorts = [2]int{5201, 5202}

// imIntervalS is iperf3's reporting interval.
const imIntervalS = 0.2

// imData is the experiment's raw data.
type imData struct {
	Size    imSize   `json:"size"`
	Shapers []string `json:"shaper_commands"`
	// Mbps are each flow's goodput per interval (iperf3's sender side).
	Mbps [2][]float64 `json:"flow_mbps"`
	// Move is the reconfiguration's results (the flow's data and control
	// connections), At its request from the flows' start.
	Move []api.ReconfigResult `json:"move"`
	At   float64              `json:"move_at_s"`
	// Before and After are each flow's mean goodput from 1 s to the move
	// and from 1 s after it to the end.
	Before [2]float64 `json:"before_mbps"`
	After  [2]float64 `json:"after_mbps"`
	// Eth1Bytes is what the second link's shaper sent.
	Eth1Bytes uint64 `json:"eth1_shaper_bytes"`
}

func runInterfaceMigration(ctx context.Context, env *Env) (*Result, error) {
	z := imSizes(env.Size)
	res := &Result{Title: "two flows on one link, one moved to the host's second link"}
	d := &imData{Size: z}
	res.Data = d

	env.Begin("lab and shapers")
	topo := lab.Topology{Kind: lab.KindStar, Hosts: []lab.HostSpec{{Name: "client", Role: lab.RoleClient, Links: 2}, {Name: "server", Role: lab.RoleServer}}}
	l, err := env.set.Up(ctx, env.Prefix+"im", topo, labkit.Agents{Dysco: env.O.Dysco, Args: env.O.AgentArgs})
	if err != nil {
		return res, err
	}
	srv, second := l.Host("server").Addr4, l.Host("client").Ifaces[1].Addr4.Addr()
	for _, ifc := range []string{"eth0", "eth1"} {
		sh := []string{"tc", "qdisc", "replace", "dev", ifc, "root", "tbf", "rate", fmt.Sprintf("%dmbit", z.RateMbit),
			"burst", "32kb", "limit", strconv.Itoa(z.RateMbit * 1_000_000 / 8 * 40 / 1000)}
		d.Shapers = append(d.Shapers, "ip netns exec LAB-client "+strings.Join(sh, " "))
		if _, err := labkit.Run(ctx, l, "client", 10*time.Second, sh...); err != nil {
			return res, fmt.Errorf("shaping the client's %s with TBF: %w", ifc, err)
		}
	}
	if _, err := labkit.DyscoCLI(ctx, env.O.Dysco, l, "client", "policy", "add", "flows",
		fmt.Sprintf("tcp and (dst port %d or dst port %d)", imPorts[0], imPorts[1])); err != nil {
		return res, err
	}
	for _, p := range imPorts {
		srvP, err := l.Start("server", fmt.Sprintf("iperf3-%d", p), "iperf3", "-s", "-p", strconv.Itoa(p))
		if err != nil {
			return res, err
		}
		defer srvP.Stop()
		if err := waitSocket(ctx, l, "-Hltn", p, "iperf3 -s"); err != nil {
			return res, err
		}
	}

	env.Begin("two flows, one moved")
	type out struct {
		b   []byte
		err error
	}
	outs := [2]chan out{make(chan out, 1), make(chan out, 1)}
	t0 := time.Now()
	for i, p := range imPorts {
		cmd := l.Command(ctx, "client", "iperf3", "-c", srv.String(), "-p", strconv.Itoa(p), "-t", strconv.Itoa(int(z.Run.Seconds())),
			"-i", fmt.Sprint(imIntervalS), "-J")
		go func() { b, err := cmd.Output(); outs[i] <- out{b, err} }()
	}
	if err := labkit.SleepCtx(ctx, time.Until(t0.Add(z.MoveAt))); err != nil {
		return res, err
	}
	d.At = time.Since(t0).Seconds()
	mv, err := labkit.DyscoCLI(ctx, env.O.Dysco, l, "client", "reconfig", "--json", "--match", fmt.Sprintf("tcp port %d", imPorts[1]),
		"--to", srv.String(), "--via", second.String())
	var rep api.ReconfigReply
	if jerr := json.Unmarshal([]byte(mv), &rep); jerr != nil {
		res.problem("dysco reconfig --via: %v %v: %s", err, jerr, labkit.Tail(mv, 300))
	}
	d.Move = rep.Results
	for _, r := range rep.Results {
		if r.Outcome != "succeeded" {
			res.problem("the move of %s: %s %s", r.Session, r.Outcome, r.Reason)
		}
	}
	if len(rep.Results) == 0 {
		res.problem("the move matched no session")
	}
	env.Logf("flow 2 moved to %s at %.1f s: %d sessions", second, d.At, len(rep.Results))
	for i := range outs {
		var o out
		select {
		case o = <-outs[i]:
		case <-ctx.Done():
			return res, ctx.Err()
		}
		var j struct {
			Intervals []struct {
				Sum struct {
					End  float64 `json:"end"`
					Bits float64 `json:"bits_per_second"`
				} `json:"sum"`
			} `json:"intervals"`
			Error string `json:"error"`
		}
		if jerr := json.Unmarshal(o.b, &j); jerr != nil || j.Error != "" || o.err != nil {
			res.problem("flow %d: iperf3: %v %v %s", i+1, o.err, jerr, j.Error)
			continue
		}
		for _, iv := range j.Intervals {
			d.Mbps[i] = append(d.Mbps[i], iv.Sum.Bits/1e6)
		}
	}
	if st, err := labkit.Run(ctx, l, "client", 10*time.Second, "tc", "-s", "qdisc", "show", "dev", "eth1"); err == nil {
		if f := strings.Fields(st[strings.Index(st, "Sent ")+len("Sent "):]); len(f) > 0 {
			d.Eth1Bytes, _ = strconv.ParseUint(f[0], 10, 64)
		}
	}
	imSummarize(d)
	for i := range 2 {
		if !(d.After[i] >= 0.7*float64(z.RateMbit)) {
			res.problem("flow %d after the move: %.1f Mbit/s, under 70%% of the link's %d", i+1, d.After[i], z.RateMbit)
		}
	}
	if d.Eth1Bytes < uint64(z.RateMbit)*1_000_000/8/4 {
		res.problem("the second link's shaper sent %d bytes: the moved flow did not leave by it", d.Eth1Bytes)
	}
	return res, imReport(env, res, d)
}

// imSummarize fills the means before and after the move.
func imSummarize(d *imData) {
	for i := range 2 {
		var b, a []float64
		for k, v := range d.Mbps[i] {
			t := float64(k+1) * imIntervalS // the interval's end
			switch {
			case t > 1 && t <= d.At:
				b = append(b, v)
			case t > d.At+1:
				a = append(a, v)
			}
		}
		d.Before[i], d.After[i] = mean(b), mean(a)
	}
}

func imReport(env *Env, res *Result, d *imData) error {
	var rows [][]string
	var ss [2]plotter.XYs
	top := float64(d.Size.RateMbit)
	for k := range max(len(d.Mbps[0]), len(d.Mbps[1])) {
		t := float64(k+1) * imIntervalS
		row := []string{strconv.FormatFloat(t, 'f', 1, 64)}
		for i := range 2 {
			v := 0.0
			if k < len(d.Mbps[i]) {
				v = d.Mbps[i][k]
				ss[i] = append(ss[i], plotter.XY{X: t, Y: v})
				top = max(top, v)
			}
			row = append(row, strconv.FormatFloat(v, 'f', 2, 64))
		}
		rows = append(rows, row)
	}
	if err := env.WriteCSV("interface_migration.csv", []string{"t_s", "flow1_mbps", "flow2_mbps"}, rows); err != nil {
		return err
	}
	p := newPlot("goodput per flow; flow 2 moved to the second link (line)", "seconds", "Mbit/s")
	if err := addLines(p, []series{{"flow 1 (stays on the first link)", ss[0]}, {"flow 2 (moved)", ss[1]}}, false); err != nil {
		return err
	}
	if err := vline(p, d.At, 0, top*1.05, colour(5)); err != nil {
		return err
	}
	p.Y.Min, p.Y.Max = 0, top*1.3
	if err := env.SavePlots("interface_migration.png", 2.8*vg.Inch, p); err != nil {
		return err
	}
	ms := "no result"
	if len(d.Move) > 0 {
		var ts []string
		for _, r := range d.Move {
			ts = append(ts, fmt.Sprintf("%.2f ms", float64(r.Micros)/1000))
		}
		ms = strings.Join(ts, ", ")
	}
	r := d.Size.RateMbit
	res.Setup = []string{
		"A star lab: a client with two links to the router (eth0 on 10.200.1.0/24, eth1 on 10.202.1.0/24; `--hosts client:2,server`) and a server, an agent on each. The client's policy makes both flows Dysco sessions with no middlebox.",
		fmt.Sprintf("Both of the client's links are shaped to %d Mbit/s with TBF on their egress (`%s`), the flows' direction (iperf3 sends from the client).", r, strings.Join(d.Shapers, "`; `")),
		fmt.Sprintf("Two iperf3 flows (ports %d and %d) start together and run %s, both on eth0, the route's choice. At %.1f s the client moves the second, `dysco reconfig --match 'tcp port %d' --to SERVER --via 10.202.1.2` (its data and control connections), which sets up a subsession from eth1's address to the server while the old one carries the flow, then switches with the two-path rules (docs/mobility.md).", imPorts[0], imPorts[1], d.Size.Run, d.At, imPorts[1]),
		"Goodput is iperf3's sender side every 200 ms; the means leave out each phase's first second.",
	}
	res.Comparisons = []Comparison{
		{What: "each flow's goodput while both share one link",
			Ours:       fmt.Sprintf("%.1f and %.1f Mbit/s (link %d Mbit/s)", d.Before[0], d.Before[1], r),
			Paper:      "about 500 Mbit/s each on one GigE interface",
			Difference: fmt.Sprintf("half the link each in both; our links are TBF-shaped veths at %d Mbit/s on a shared 2-core machine, Serval's were GigE NICs", r)},
		{What: "each flow's goodput after the move",
			Ours:       fmt.Sprintf("%.1f (stayed) and %.1f (moved) Mbit/s; %.2f and %.2f × before", d.After[0], d.After[1], d.After[0]/max(d.Before[0], 1e-9), d.After[1]/max(d.Before[1], 1e-9)),
			Paper:      "both rise quickly to nearly 1 Gbit/s, each on its own interface",
			Difference: "the same shape: TCP's congestion control takes up the capacity the move frees"},
		{What: "the move",
			Ours:       fmt.Sprintf("%s (lock, set-up and switch, per connection); the second link's shaper then sent %d bytes", ms, d.Eth1Bytes),
			Paper:      "the server's service controller signals the SAL to migrate the flow (an RSYN exchange); no time is given",
			Difference: "Serval resynchronises the flow end to end; Dysco replaces the host's first subsession by a new one from the other address while the old one still carries data (make before break)"},
	}
	res.Plots = []Plot{{File: "interface_migration.png", Title: "Goodput of two flows, one moved to the host's second link (as Serval's Fig. 9)",
		Shows: fmt.Sprintf("Each flow's goodput every 200 ms (iperf3's sender side). Until the dashed line (the move's request, at %.1f s) both flows share the first link and get about half of its %d Mbit/s; from there the moved flow has the second link to itself and both rise to the link's rate.", d.At, r)}}
	res.Headline = []string{
		fmt.Sprintf("interface migration: two flows on one %d Mbit/s link, one moved to the second link with dysco reconfig --via", r),
		fmt.Sprintf("before: %.1f + %.1f Mbit/s; after: %.1f + %.1f Mbit/s", d.Before[0], d.Before[1], d.After[0], d.After[1]),
		fmt.Sprintf("move: %s", ms),
	}
	return nil
}
