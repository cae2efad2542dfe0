package experiment

// Experiment "goodput" (paper §5.2, Figure 9): goodput at the receivers of
// N greedy sessions through one middlebox, for N from 1 up to 10,000,
// Dysco and baseline. The runner is both ends (sockets in the client's and
// the server's namespaces), so that N is not limited by a tool's stream
// count; every byte is checked at the receiver.

import (
	"context"
	"fmt"
	"math"
	"net"
	"net/netip"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"

	"github.com/dysco/dysco/internal/bench"
	"github.com/dysco/dysco/internal/labkit"
)

func init() {
	Register(&Experiment{Name: "goodput", Paper: "Fig. 9",
		Summary: "goodput vs number of sessions through 1 middlebox, Dysco and baseline",
		Tools:   []string{"iperf3", "nginx"},
		Phases:  goodputPhases, Run: runGoodput})
}

// goodputPort is where the runner's receiver listens in both labs.
const goodputPort = 9100

type goodputSize struct {
	counts []int
	reps   int
	window time.Duration
}

func goodputSizes(s Size) goodputSize {
	return pick(s,
		goodputSize{[]int{1, 8}, 1, time.Second},
		goodputSize{[]int{1, 10, 100, 1000}, 2, 3 * time.Second},
		goodputSize{[]int{1, 10, 100, 1000, 10000}, 3, 5 * time.Second})
}

func goodputPhases(s Size) []Phase {
	g := goodputSizes(s)
	ps := []Phase{{"labs, 1 mb", 5 * time.Second}}
	for _, n := range g.counts {
		est := time.Duration(g.reps) * 2 * (g.window + 2*time.Second + time.Duration(n)*300*time.Microsecond)
		ps = append(ps, Phase{fmt.Sprintf("goodput, %d sessions", n), est})
	}
	return ps
}

// goodputPoint is the figure of one session count.
type goodputPoint struct {
	Sessions int            `json:"sessions"`
	Samples  []bench.Sample `json:"samples"` // Gbit/s per repetition and variant
}

// greedyRun opens n sessions from the client of v to the runner's receiver
// on its server, lets them send for a second, measures the goodput over the
// window, then ends them and checks that every byte arrived.
func greedyRun(ctx context.Context, v *labkit.Variant, recv *goodputReceiver, n int, window time.Duration) (float64, string, error) {
	dst := netip.AddrPortFrom(v.Server, goodputPort).String()
	var stop atomic.Bool
	var wg sync.WaitGroup
	var clients []*labkit.End
	recv.reset(n)
	defer func() {
		stop.Store(true)
		for _, c := range clients {
			c.Abort()
		}
		for _, s := range recv.ends() {
			s.Abort()
		}
		labkit.WaitAll(&wg, 10*time.Second)
	}()
	for i := 0; i < n; i++ {
		c, err := v.Lab.Dial(ctx, "client", "tcp", dst)
		if err != nil {
			return 0, "", fmt.Errorf("dialling session %d of %d: %w", i+1, n, err)
		}
		e := labkit.NewEnd(c)
		clients = append(clients, e)
		wg.Add(1)
		go func() { defer wg.Done(); e.Send(&stop, 0) }()
	}
	if err := recv.wait(ctx, n, 30*time.Second); err != nil {
		return 0, "", err
	}
	if err := labkit.SleepCtx(ctx, time.Second); err != nil {
		return 0, "", err
	}
	t0, b0 := time.Now(), recv.total()
	if err := labkit.SleepCtx(ctx, window); err != nil {
		return 0, "", err
	}
	gbps := float64(recv.total()-b0) * 8 / time.Since(t0).Seconds() / 1e9
	// End: every sender half-closes, every receiver must read to EOF
	// exactly what was sent.
	stop.Store(true)
	if !labkit.WaitAll(recv.wg, 30*time.Second) {
		return gbps, "", fmt.Errorf("%d sessions: receivers did not see EOF within 30 s of the senders' FIN", n)
	}
	srv := recv.ends()
	var lost []string
	byAddr := map[string]*labkit.End{}
	for _, s := range srv {
		byAddr[s.Conn.RemoteAddr().String()] = s
	}
	for _, c := range clients {
		s := byAddr[c.Conn.LocalAddr().String()]
		if s == nil {
			lost = append(lost, fmt.Sprintf("%s: not accepted", c.Conn.LocalAddr()))
			continue
		}
		if l := labkit.LossCheck(c.Conn.LocalAddr().String(), c, s); l != "" {
			lost = append(lost, l)
		}
	}
	if len(lost) > 0 {
		return gbps, "", fmt.Errorf("%d of %d sessions lost or changed bytes (first: %s)", len(lost), n, lost[0])
	}
	return gbps, "", nil
}

// goodputReceiver accepts the sessions on a server and reads them.
type goodputReceiver struct {
	ln net.Listener
	mu sync.Mutex
	es []*labkit.End
	wg *sync.WaitGroup
}

func newGoodputReceiver(v *labkit.Variant) (*goodputReceiver, error) {
	ln, err := v.Lab.Listen("server", "tcp", netip.AddrPortFrom(v.Server, goodputPort).String())
	if err != nil {
		return nil, err
	}
	r := &goodputReceiver{ln: ln, wg: &sync.WaitGroup{}}
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			e := labkit.NewEnd(c)
			r.mu.Lock()
			r.es = append(r.es, e)
			wg := r.wg
			wg.Add(1)
			r.mu.Unlock()
			go func() { defer wg.Done(); e.Recv() }()
		}
	}()
	return r, nil
}

func (r *goodputReceiver) reset(n int) {
	r.mu.Lock()
	r.es = make([]*labkit.End, 0, n)
	r.wg = &sync.WaitGroup{}
	r.mu.Unlock()
}

func (r *goodputReceiver) ends() []*labkit.End {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]*labkit.End(nil), r.es...)
}

func (r *goodputReceiver) total() int64 {
	var t int64
	for _, e := range r.ends() {
		t += e.Rx.Load()
	}
	return t
}

func (r *goodputReceiver) wait(ctx context.Context, n int, d time.Duration) error {
	deadline := time.Now().Add(d)
	for {
		if got := len(r.ends()); got >= n {
			return nil
		} else if time.Now().After(deadline) {
			return fmt.Errorf("the server accepted %d of %d sessions in %v", got, n, d)
		}
		if err := labkit.SleepCtx(ctx, 20*time.Millisecond); err != nil {
			return err
		}
	}
}

func runGoodput(ctx context.Context, env *Env) (*Result, error) {
	g := goodputSizes(env.Size)
	o := env.O
	o.Reps = g.reps
	res := &Result{Title: "goodput vs number of sessions"}
	var points []*goodputPoint
	res.Data = &points
	env.Begin("labs, 1 mb")
	p, err := labkit.UpPair(ctx, o.Agents(), env.set, env.Prefix, 1, env.pr)
	if err != nil {
		return res, err
	}
	defer p.Close()
	if _, err := labkit.DyscoCLI(ctx, o.Dysco, p.Dysco.Lab, "client", "policy", "add", "goodput", "--chain", p.Chain[0].String(), fmt.Sprintf("tcp dst port %d", goodputPort)); err != nil {
		return res, err
	}
	recvs := map[string]*goodputReceiver{}
	for _, v := range p.Both() {
		r, err := newGoodputReceiver(v)
		if err != nil {
			return res, err
		}
		defer r.ln.Close()
		recvs[v.Name] = r
	}
	for _, n := range g.counts {
		env.Begin(fmt.Sprintf("goodput, %d sessions", n))
		ss, err := bench.Interleaved(ctx, o, p, env.pr, fmt.Sprintf("goodput, %d sessions", n), func(v *labkit.Variant) (float64, string, error) {
			return greedyRun(ctx, v, recvs[v.Name], n, g.window)
		})
		points = append(points, &goodputPoint{Sessions: n, Samples: ss})
		if err != nil {
			return res, err
		}
	}
	var rows [][]string
	var dys, base series
	dys.name, base.name = "Dysco", "baseline"
	var errD, errB plotter.XYs
	var ratios []string
	for _, pt := range points {
		for _, s := range pt.Samples {
			rows = append(rows, []string{strconv.Itoa(pt.Sessions), s.Variant, strconv.Itoa(s.Rep), strconv.FormatFloat(s.Value, 'f', 4, 64)})
		}
		d, b := bench.Values(pt.Samples, "dysco"), bench.Values(pt.Samples, "baseline")
		dys.xy = append(dys.xy, plotter.XY{X: float64(pt.Sessions), Y: mean(d)})
		base.xy = append(base.xy, plotter.XY{X: float64(pt.Sessions), Y: mean(b)})
		errD = append(errD, plotter.XY{X: stddev(d)})
		errB = append(errB, plotter.XY{X: stddev(b)})
		ratios = append(ratios, fmt.Sprintf("%d: %s", pt.Sessions, pct(mean(d), mean(b))))
		res.Comparisons = append(res.Comparisons, Comparison{
			What:       fmt.Sprintf("goodput, %d session%s: Dysco / baseline (mean ± sd of %d)", pt.Sessions, labkit.Plural(pt.Sessions), len(d)),
			Ours:       fmt.Sprintf("%.2f ± %.2f / %.2f ± %.2f Gbit/s (%s)", mean(d), stddev(d), mean(b), stddev(b), pct(mean(d), mean(b))),
			Paper:      "Dysco within 1.5 points of baseline (and within one sd); values in the figure only",
			Difference: goodputDiff(mean(d), mean(b), stddev(d)+stddev(b), pt.Sessions),
		})
	}
	if err := env.WriteCSV("goodput.csv", []string{"sessions", "variant", "repetition", "goodput_gbps"}, rows); err != nil {
		return res, err
	}
	pl := newPlot("goodput at the receivers, through 1 middlebox", "sessions (log scale)", "Gbit/s")
	pl.X.Scale = plot.LogScale{}
	pl.X.Tick.Marker = plot.LogTicks{Prec: -1}
	if err := addLines(pl, []series{dys, base}, true); err != nil {
		return res, err
	}
	for i, e := range []plotter.XYs{errD, errB} {
		xy := []series{dys, base}[i].xy
		eb, err := plotter.NewYErrorBars(errBars{xy, e})
		if err != nil {
			return res, err
		}
		eb.Color = colour(i)
		pl.Add(eb)
	}
	pl.Y.Min = 0
	pl.Y.Max *= 1.3
	if err := env.SavePlots("goodput.png", 3.5*vg.Inch, pl); err != nil {
		return res, err
	}
	res.Setup = []string{
		"Two labs of the same line topology: client, mb1, server. Dysco: agents on every host and a client policy chaining mb1; baseline: no agents, mb1 forwards by plain routing. mb1 runs no application, as in the paper.",
		fmt.Sprintf("For each session count N (%v), the runner opens N TCP sessions from the client's namespace to its own receiver in the server's namespace; each sends as fast as TCP lets. "+
			"After 1 s, the bytes the receivers read over %v give the goodput. Then every sender half-closes and every receiver must read to EOF exactly the bytes sent, each compared with the pattern the sender wrote. "+
			"%d repetition(s), alternating Dysco and baseline; figure: mean ± standard deviation, as in the paper.", g.counts, g.window, g.reps),
		"The paper ran four clients and four servers on separate hosts through one middlebox host, over 10 GbE (the link was the bottleneck beyond 100 sessions). " +
			"Here client, middlebox and server are namespaces sharing 2 vCPUs: the CPU is the bottleneck at every N, and the runner that sends and receives takes its share.",
	}
	res.Plots = []Plot{{File: "goodput.png", Title: "Goodput vs sessions (as Fig. 9)",
		Shows: fmt.Sprintf("Mean goodput with ±1 sd error bars, blue Dysco, grey baseline, against the number of sessions on a log scale. Dysco relative to the baseline per N: %s. "+
			"The two curves have the same shape; where they differ by more than their error bars the difference is the datapath's CPU cost on a machine whose CPUs are the bottleneck (the paper's was the link).", strings.Join(ratios, ", "))}}
	last := points[len(points)-1]
	res.Headline = []string{
		fmt.Sprintf("goodput, 1 session: Dysco %.2f Gbit/s, baseline %.2f (%s; paper: within 1.5 %%)", dys.xy[0].Y, base.xy[0].Y, pct(dys.xy[0].Y, base.xy[0].Y)),
		fmt.Sprintf("goodput, %d sessions: Dysco %.2f Gbit/s, baseline %.2f (%s)", last.Sessions, dys.xy[len(dys.xy)-1].Y, base.xy[len(base.xy)-1].Y, pct(dys.xy[len(dys.xy)-1].Y, base.xy[len(base.xy)-1].Y)),
		"every byte of every session arrived and matched what was sent",
	}
	return res, nil
}

func goodputDiff(d, b, sd float64, n int) string {
	r := d/b - 1
	switch {
	case math.Abs(d-b) <= sd:
		return "within one standard deviation, as in the paper"
	case r < -0.015:
		return fmt.Sprintf("Dysco %.1f points below, more than the paper's 1.5: here the datapath's per-packet CPU cost competes with the senders and receivers for the same 2 vCPUs (the paper's limit was the NIC)", -100*r)
	case r > 0.015:
		return fmt.Sprintf("Dysco %.1f points above the baseline: the machine's noise (repetitions alternate, but %d session(s) on 2 shared vCPUs swing by more than that)", 100*r, n)
	}
	return "within 1.5 points, as in the paper"
}

// errBars pairs points with their y errors for plotter.NewYErrorBars.
type errBars struct {
	xy  plotter.XYs
	err plotter.XYs // X holds the error
}

func (e errBars) Len() int                    { return len(e.xy) }
func (e errBars) XY(i int) (float64, float64) { return e.xy[i].X, e.xy[i].Y }
func (e errBars) YError(i int) (float64, float64) {
	return e.err[i].X, e.err[i].X
}

func stddev(xs []float64) float64 {
	if len(xs) < 2 {
		return 0
	}
	m := mean(xs)
	s := 0.0
	for _, x := range xs {
		s += (x - m) * (x - m)
	}
	return math.Sqrt(s / float64(len(xs)-1))
}
