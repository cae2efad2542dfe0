package experiment

// Experiment "proxy-removal" (paper §5.3, Figures 12 and 13): bundles of
// greedy sessions through an unmodified, splicing HAProxy running under
// LD_PRELOAD=lib/libdysco.so, removed from the path one bundle at a time;
// goodput per second and the proxy's CPU, and the CDF of the
// reconfiguration times.
//
// How a bundle is removed when we choose: libdysco asks for the removal of
// a session once HAProxy has spliced both of its directions (trigger
// "both", which the lab sets; docs/libdysco.md). The sessions send client → server only, so
// HAProxy splices one direction and stays on the path; at the bundle's
// time, the runner's server ends start answering (32 KiB/s), HAProxy
// splices the second direction, and libdysco asks the proxy's agent to take
// the proxy off those sessions. At the end every sender half-closes and
// every receiver must read to EOF exactly the bytes sent, both ways,
// compared byte by byte.

import (
	"context"
	"encoding/binary"
	"fmt"
	"math"
	"net"
	"net/netip"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"

	"github.com/dysco/dysco/internal/api"
	"github.com/dysco/dysco/internal/bench"
	"github.com/dysco/dysco/internal/labkit"
)

func init() {
	Register(&Experiment{Name: "proxy-removal", Paper: "Fig. 12, 13",
		Summary: "bundles of sessions through HAProxy (libdysco) removed one bundle at a time: goodput, proxy CPU, reconfiguration times",
		Tools:   []string{"haproxy", "sysctl"},
		Phases:  proxyRemovalPhases, Run: runProxyRemoval})
}

type proxyRemovalSize struct {
	Bundles, PerBundle int
	// Warm is the time before the first removal, Interval between
	// removals, Tail after the last one.
	Warm, Interval, Tail time.Duration
}

func proxyRemovalSizes(s Size) proxyRemovalSize {
	return pick(s,
		// --tiny (what the tests run): 5 s before the first removal and after
		// the last, so that each goodput window holds three or four 1 s
		// samples; with two, a burst of another test package's load in one
		// of them could decide the before/after comparison.
		proxyRemovalSize{2, 5, 5 * time.Second, 3 * time.Second, 5 * time.Second},
		proxyRemovalSize{4, 50, 8 * time.Second, 6 * time.Second, 6 * time.Second},
		proxyRemovalSize{4, 150, 40 * time.Second, 20 * time.Second, 20 * time.Second})
}

func (z proxyRemovalSize) total() time.Duration {
	return z.Warm + time.Duration(z.Bundles-1)*z.Interval + z.Tail
}

func proxyRemovalPhases(s Size) []Phase {
	z := proxyRemovalSizes(s)
	n := time.Duration(z.Bundles * z.PerBundle)
	return []Phase{{"lab", 5 * time.Second}, {"opening the sessions", 2*time.Second + n*5*time.Millisecond},
		{"sessions through HAProxy, bundles removed one at a time", z.total()}, {"checks: results, paths, every byte", 3 * time.Second}}
}

// prNotsentLowat bounds the unsent bytes each of the runner's senders keeps
// in its socket (labkit.SetNotsentLowat): without it, 600 greedy sessions took the
// machine's TCP memory over its pressure threshold and some sessions
// crawled for minutes after their removal (docs/experiments.md, "Large
// bundles").
const prNotsentLowat = 128 << 10

// prSecond is one second of the timeline.
type prSecond struct {
	T            float64   `json:"t"`
	BundleGbps   []float64 `json:"bundle_gbps"` // client → server, per bundle
	TotalGbps    float64   `json:"total_gbps"`
	HAProxyCPU   float64   `json:"haproxy_cpu_pct"` // % of one core
	AgentCPU     float64   `json:"proxy_agent_cpu_pct"`
	ProxyRewrite uint64    `json:"proxy_rewrites"` // packets the proxy host's datapath rewrote
	TCPMemPages  int64     `json:"tcp_mem_pages"`  // TCP memory of the whole machine (every namespace)
}

// prData is the experiment's raw data.
type prData struct {
	Size     proxyRemovalSize `json:"size"`
	Triggers []float64        `json:"triggers_s"` // when each bundle's server ends started answering
	Timeline []prSecond       `json:"timeline"`
	// TCPMemPressure is net.ipv4.tcp_mem's pressure threshold, in pages.
	TCPMemPressure int64                `json:"tcp_mem_pressure_pages"`
	Results        []api.ReconfigResult `json:"reconfig_results"`
	Removal        bench.RemovalStats   `json:"removal"`
	Direct         int                  `json:"client_sessions_direct"`
	BytesUp        int64                `json:"bytes_client_to_server"`
	BytesDown      int64                `json:"bytes_server_to_client"`
	Lost           []string             `json:"lost,omitempty"`
	BeforeGbps     float64              `json:"goodput_before_gbps"`
	AfterGbps      float64              `json:"goodput_after_gbps"`
	CPUBefore      float64              `json:"haproxy_cpu_before_pct"`
	CPUAfter       float64              `json:"haproxy_cpu_after_pct"`
}

func runProxyRemoval(ctx context.Context, env *Env) (*Result, error) {
	z := proxyRemovalSizes(env.Size)
	n := z.Bundles * z.PerBundle
	o := env.O
	o.ReconfigSessions = n
	res := &Result{Title: "proxy removal"}
	d := &prData{Size: z}
	res.Data = d
	env.Begin("lab")
	rl, err := bench.UpReconfigLab(ctx, o, env.set, env.Prefix, env.pr)
	if err != nil {
		return res, err
	}
	defer rl.Close()
	x := newPRRun(z)
	defer x.shutdown()
	hook := func(c net.Conn) { go x.serve(c) }
	rl.Accept.Store(&hook)
	if err := rl.StartHAProxy(ctx, true); err != nil {
		return res, err
	}
	defer rl.StopHAProxy()
	hist0, err := rl.History(ctx, o)
	if err != nil {
		return res, err
	}

	env.Begin("opening the sessions")
	if err := x.open(ctx, env, rl); err != nil {
		return res, err
	}
	env.Begin("sessions through HAProxy, bundles removed one at a time")
	if err := x.timeline(ctx, env, rl, d); err != nil {
		return res, err
	}
	env.Begin("checks: results, paths, every byte")
	if err := x.check(ctx, env, rl, res, d, hist0); err != nil {
		return res, err
	}
	return res, proxyRemovalReport(env, res, d, z, x.bundleOf)
}

// prRun is a run in progress: its sessions, and what starts and stops
// their ends.
type prRun struct {
	sessionSet
	z     proxyRemovalSize
	trig  []chan struct{} // closed when a bundle's server ends start sending
	start chan struct{}   // closed when the client ends start sending
	// locals are the sessions' client addresses, bundleOf their bundles.
	locals   map[string]bool
	bundleOf map[string]int
}

func newPRRun(z proxyRemovalSize) *prRun {
	x := &prRun{sessionSet: newSessionSet(z.Bundles * z.PerBundle), z: z, trig: make([]chan struct{}, z.Bundles),
		start: make(chan struct{}), locals: map[string]bool{}, bundleOf: map[string]int{}}
	for i := range x.trig {
		x.trig[i] = make(chan struct{})
	}
	return x
}

// serve is the server's end of a connection HAProxy relays: a session
// names itself in its first 8 bytes.
func (x *prRun) serve(c net.Conn) {
	s := x.serverEnd(c, func(e *labkit.End) {
		if err := labkit.SetNotsentLowat(e.Conn, prNotsentLowat); err != nil {
			e.Fail(fmt.Errorf("TCP_NOTSENT_LOWAT: %w", err))
		}
	})
	if s == nil {
		return
	}
	go func() { defer x.wg.Done(); s.sv.Recv() }()
	go func() {
		defer x.wg.Done()
		select {
		case <-x.trig[s.Bundle]:
			s.sv.Send(&x.stop, bench.ReconfigRate)
		case <-x.quit:
			s.sv.Conn.CloseWrite()
		}
	}()
}

// open opens every session first, so that the senders start together:
// opening hundreds of sessions one by one is then not slowed by the ones
// already sending, and the first second of the timeline counts only its
// own bytes.
func (x *prRun) open(ctx context.Context, env *Env, rl *bench.ReconfigLab) error {
	n := len(x.sessions)
	dst := netip.AddrPortFrom(rl.Proxy, bench.ProxyPort).String()
	for i := 0; i < n; i++ {
		c, err := rl.Lab.Dial(ctx, "client", "tcp", dst)
		if err != nil {
			return fmt.Errorf("session %d of %d to HAProxy: %w", i+1, n, err)
		}
		s := &bundledSession{ID: i, Bundle: i / x.z.PerBundle, cl: labkit.NewEnd(c), local: c.LocalAddr().String()}
		if err := labkit.SetNotsentLowat(s.cl.Conn, prNotsentLowat); err != nil {
			c.Close()
			return fmt.Errorf("session %d: TCP_NOTSENT_LOWAT: %w", i+1, err)
		}
		x.locals[s.local], x.bundleOf[s.local] = true, s.Bundle
		var hdr [8]byte
		binary.BigEndian.PutUint64(hdr[:], uint64(i))
		x.mu.Lock()
		x.sessions[i] = s
		x.mu.Unlock()
		if _, err := c.Write(hdr[:]); err != nil {
			return fmt.Errorf("session %d: %w", i+1, err)
		}
		x.wg.Add(2)
		go func() {
			defer x.wg.Done()
			select {
			case <-x.start:
				s.cl.Send(&x.stop, 0)
			case <-x.quit:
				s.cl.Conn.CloseWrite()
			}
		}()
		go func() { defer x.wg.Done(); s.cl.Recv() }()
	}
	if a, err := labkit.WaitAccepted(ctx, &x.mu, &x.accepted, n); err != nil {
		return fmt.Errorf("the server got %d of the %d sessions relayed by HAProxy (HAProxy log: %s): %w", a, n, rl.HAProxy.Log, err)
	}
	env.Logf("%d sessions in %d bundles through HAProxy (pid %d), client → server as fast as TCP lets", n, x.z.Bundles, rl.HAProxy.Pid())
	close(x.start)
	return nil
}

// timeline samples every second the goodput of each bundle, HAProxy's and
// the proxy's agent's CPU and the proxy host's datapath, and triggers the
// bundles' removals one at a time.
func (x *prRun) timeline(ctx context.Context, env *Env, rl *bench.ReconfigLab, d *prData) error {
	z, o := x.z, env.O
	hpid := rl.HAProxy.Pid()
	apid := rl.Lab.Agent("proxy").Pid()
	t0 := time.Now()
	prevT := t0
	prevCPU, _ := bench.CPUTime(hpid)
	prevAgent, _ := bench.CPUTime(apid)
	prevBytes := make([]int64, z.Bundles)
	st0, err := labkit.AgentStatus(ctx, o.Dysco, rl.Lab, "proxy")
	if err != nil {
		return err
	}
	prevRw := bench.ProxyRewrites(st0)
	next := 0
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	for time.Since(t0) < z.total() {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-tick.C:
		}
		now := time.Now()
		dt := now.Sub(prevT).Seconds()
		sec := prSecond{T: now.Sub(t0).Seconds(), BundleGbps: make([]float64, z.Bundles)}
		cur := make([]int64, z.Bundles)
		for _, s := range x.sessions {
			cur[s.Bundle] += s.sv.Rx.Load()
		}
		for b := range cur {
			sec.BundleGbps[b] = float64(cur[b]-prevBytes[b]) * 8 / dt / 1e9
			sec.TotalGbps += sec.BundleGbps[b]
		}
		prevBytes = cur
		if c, err := bench.CPUTime(hpid); err == nil {
			sec.HAProxyCPU = 100 * (c - prevCPU).Seconds() / dt
			prevCPU = c
		}
		if c, err := bench.CPUTime(apid); err == nil {
			sec.AgentCPU = 100 * (c - prevAgent).Seconds() / dt
			prevAgent = c
		}
		if st, err := labkit.AgentStatus(ctx, o.Dysco, rl.Lab, "proxy"); err == nil {
			sec.ProxyRewrite = bench.ProxyRewrites(st) - prevRw
			prevRw = bench.ProxyRewrites(st)
		}
		if m, p, err := labkit.TCPMemPages(); err == nil {
			sec.TCPMemPages = m
			d.TCPMemPressure = p
		}
		prevT = now
		d.Timeline = append(d.Timeline, sec)
		env.Logf("t=%2.0f s: %.2f Gbit/s, HAProxy %.0f %% CPU, proxy datapath %d packets", sec.T, sec.TotalGbps, sec.HAProxyCPU, sec.ProxyRewrite)
		if next < z.Bundles && time.Since(t0) >= z.Warm+time.Duration(next)*z.Interval-time.Second/2 {
			close(x.trig[next])
			d.Triggers = append(d.Triggers, time.Since(t0).Seconds())
			env.Logf("bundle %d of %d: the server ends answer; HAProxy splices the second direction and libdysco asks for its removal", next+1, z.Bundles)
			next++
		}
	}
	return nil
}

// check checks the run: one result per session at the left anchor, every
// session straight to the server, and nothing lost.
func (x *prRun) check(ctx context.Context, env *Env, rl *bench.ReconfigLab, res *Result, d *prData, hist0 []api.ReconfigResult) error {
	n, o := len(x.sessions), env.O
	// One result per session at the left anchor (the client).
	var results []api.ReconfigResult
	for last, lastAt := -1, time.Now(); ; {
		h, err := rl.History(ctx, o)
		if err != nil {
			return err
		}
		results = nil
		for _, r := range bench.NewResults(hist0, h) {
			if src, _, _ := strings.Cut(r.Session, " -> "); x.locals[src] {
				results = append(results, r)
			}
		}
		if len(results) != last {
			last, lastAt = len(results), time.Now()
		}
		if len(results) >= n || time.Since(lastAt) > 10*time.Second {
			break
		}
		if err := labkit.SleepCtx(ctx, 200*time.Millisecond); err != nil {
			return err
		}
	}
	d.Results = results
	d.Removal = bench.Summarize(results, n, x.locals)
	if d.Removal.Succeeded != n {
		res.problem("%d of %d removals succeeded (%d results; %v)", d.Removal.Succeeded, n, d.Removal.Results, d.Removal.Reasons)
	}
	direct, err := rl.DirectSessions(ctx, o, x.locals)
	if err != nil {
		return err
	}
	d.Direct += direct
	if d.Direct != n {
		res.problem("%d of %d client sessions go straight to the server after the removals", d.Direct, n)
	}
	// Nothing lost: every sender half-closes, every receiver reads to EOF.
	if !x.finish(30 * time.Second) {
		var stuck []bench.StuckSession
		for _, s := range x.sessions {
			// The client's end and HAProxy's end towards the server name
			// the session; the proxy's and server's listening addresses
			// are shared by all.
			addrs := []string{s.local, s.sv.Conn.RemoteAddr().String()}
			if !s.sv.GotEOF.Load() {
				stuck = append(stuck, bench.StuckSession{What: labkit.LossCheck(fmt.Sprintf("session %d (%s) up", s.ID, s.local), s.cl, s.sv), Addresses: addrs})
			}
			if !s.cl.GotEOF.Load() {
				stuck = append(stuck, bench.StuckSession{What: labkit.LossCheck(fmt.Sprintf("session %d (%s) down", s.ID, s.local), s.sv, s.cl), Addresses: addrs})
			}
		}
		msg := "some session ends did not finish within 30 s of the senders' FIN"
		if p, err := bench.DumpStuck(ctx, o, rl, stuck); err != nil {
			msg += fmt.Sprintf(" (describing them failed: %v)", err)
		} else {
			msg += fmt.Sprintf("; what the hosts know of them: %s (kept in the run's logs)", filepath.Base(p))
		}
		res.problem("%s", msg)
	}
	for _, s := range x.sessions {
		d.BytesUp += s.sv.Rx.Load()
		d.BytesDown += s.cl.Rx.Load()
		for _, l := range []string{labkit.LossCheck(fmt.Sprintf("session %d (%s) up", s.ID, s.local), s.cl, s.sv), labkit.LossCheck(fmt.Sprintf("session %d (%s) down", s.ID, s.local), s.sv, s.cl)} {
			if l != "" {
				d.Lost = append(d.Lost, l)
			}
		}
	}
	if len(d.Lost) > 0 {
		res.problem("%d session directions lost or changed bytes (first: %s)", len(d.Lost), d.Lost[0])
	}
	return nil
}

// removalTimeDifference explains the removal times against the paper's,
// from where the time went (the phases at the left anchor).
func removalTimeDifference(st bench.RemovalStats, perBundle int) string {
	queue := fmt.Sprintf("%d removals are asked for within a few ms of each other (a bundle at once), and the agents queue them; one removal is about ten control messages through the router, each a Go agent's work on a shared CPU, while the paper's agents ran on dedicated cores", perBundle)
	if math.IsNaN(st.TwoPathP50ms) {
		return queue
	}
	if st.TwoPathP50ms > st.LockP50ms+st.SetupP50ms {
		return fmt.Sprintf("longer: most of the time is the two-path phase (median %.2f ms of %.2f ms), in which the old path delivers what the loaded proxy still holds (its socket and pipe buffers of greedy sessions) and the server acknowledges it; locking and setting up the new path take %.2f + %.2f ms. "+
			"The paper does not say what its figure measures up to; ours ends when the old path is no longer used. %s",
			st.TwoPathP50ms, st.P50ms, st.LockP50ms, st.SetupP50ms, queue)
	}
	return fmt.Sprintf("longer: locking and setting up the new path take most of the time (median %.2f + %.2f ms, the two-path phase %.2f ms): %s", st.LockP50ms, st.SetupP50ms, st.TwoPathP50ms, queue)
}

// goodputDifference explains the goodput gain against the paper's doubling.
func goodputDifference(ratio float64) string {
	const shared = "every host of the lab runs on the same 2 vCPUs"
	switch {
	case ratio >= 2.2:
		return "a larger gain: " + shared + ", so relaying through HAProxy takes CPU from the senders, receivers and datapaths, and taking HAProxy out frees more here than in the paper, where the proxy host had its own cores and the 10 GbE links capped the gain"
	case ratio >= 1.8:
		return "about the same gain"
	default:
		return "a smaller gain: " + shared + ", and after the removals the senders, receivers and datapaths of all the sessions saturate them; in the paper each bundle had its own client and server hosts"
	}
}

// tcpMemSentence reports the machine's peak TCP memory during the run
// against the pressure threshold, above which Linux shrinks every socket's
// buffers and drops segments it cannot queue.
func tcpMemSentence(d *prData) string {
	var peak int64
	for _, s := range d.Timeline {
		peak = max(peak, s.TCPMemPages)
	}
	if peak == 0 || d.TCPMemPressure == 0 {
		return ""
	}
	const page = 4096
	verdict := "below it"
	if peak >= d.TCPMemPressure {
		verdict = "over it: Linux was shrinking buffers and dropping segments, and some sessions' congestion control may have collapsed"
	}
	return fmt.Sprintf("The machine's TCP memory peaked at %.0f MiB, against a pressure threshold of %.0f MiB: %s.", float64(peak*page)/(1<<20), float64(d.TCPMemPressure*page)/(1<<20), verdict)
}

// window averages f over the seconds whose end is in (from, to].
func window(tl []prSecond, from, to float64, f func(prSecond) float64) float64 {
	var xs []float64
	for _, s := range tl {
		if s.T > from && s.T <= to {
			xs = append(xs, f(s))
		}
	}
	return mean(xs)
}

func proxyRemovalReport(env *Env, res *Result, d *prData, z proxyRemovalSize, bundleOf map[string]int) error {
	n := z.Bundles * z.PerBundle
	warm := z.Warm.Seconds()
	lastTrig := warm + float64(z.Bundles-1)*z.Interval.Seconds()
	if len(d.Triggers) > 0 {
		warm, lastTrig = d.Triggers[0], d.Triggers[len(d.Triggers)-1]
	}
	total := func(s prSecond) float64 { return s.TotalGbps }
	cpu := func(s prSecond) float64 { return s.HAProxyCPU }
	from := warm - min(warm/2, 10)
	d.BeforeGbps, d.CPUBefore = window(d.Timeline, from, warm, total), window(d.Timeline, from, warm, cpu)
	d.AfterGbps, d.CPUAfter = window(d.Timeline, lastTrig+1.5, 1e9, total), window(d.Timeline, lastTrig+1.5, 1e9, cpu)

	// Tables.
	var rows [][]string
	for _, s := range d.Timeline {
		row := []string{f1(s.T)}
		for _, g := range s.BundleGbps {
			row = append(row, strconv.FormatFloat(g, 'f', 4, 64))
		}
		row = append(row, strconv.FormatFloat(s.TotalGbps, 'f', 4, 64), f1(s.HAProxyCPU), f1(s.AgentCPU), strconv.FormatUint(s.ProxyRewrite, 10), strconv.FormatInt(s.TCPMemPages, 10))
		rows = append(rows, row)
	}
	hdr := []string{"t_s"}
	for b := 0; b < z.Bundles; b++ {
		hdr = append(hdr, fmt.Sprintf("bundle%d_gbps", b+1))
	}
	hdr = append(hdr, "total_gbps", "haproxy_cpu_pct", "proxy_agent_cpu_pct", "proxy_datapath_packets", "tcp_mem_pages")
	if err := env.WriteCSV("proxy_removal_timeline.csv", hdr, rows); err != nil {
		return err
	}
	rows = nil
	var ms []float64
	for _, r := range d.Results {
		src, _, _ := strings.Cut(r.Session, " -> ")
		rows = append(rows, []string{r.Session, strconv.Itoa(bundleOf[src] + 1), r.Outcome, strconv.FormatFloat(float64(r.Micros)/1000, 'f', 3, 64)})
		if r.Outcome == "succeeded" {
			ms = append(ms, float64(r.Micros)/1000)
		}
	}
	if err := env.WriteCSV("proxy_removal_times.csv", []string{"session", "bundle", "outcome", "reconfig_ms"}, rows); err != nil {
		return err
	}

	// Plots: the timeline (Fig. 12) and the CDF (Fig. 13).
	top := newPlot(fmt.Sprintf("goodput of %d sessions, %d bundles (client → server)", n, z.Bundles), "", "Gbit/s")
	var ss []series
	for b := 0; b < z.Bundles; b++ {
		var xy plotter.XYs
		for _, s := range d.Timeline {
			xy = append(xy, plotter.XY{X: s.T, Y: s.BundleGbps[b]})
		}
		ss = append(ss, series{fmt.Sprintf("bundle %d", b+1), xy})
	}
	var tot, hc, ac plotter.XYs
	maxG := 0.0
	for _, s := range d.Timeline {
		tot = append(tot, plotter.XY{X: s.T, Y: s.TotalGbps})
		hc = append(hc, plotter.XY{X: s.T, Y: s.HAProxyCPU})
		ac = append(ac, plotter.XY{X: s.T, Y: s.AgentCPU})
		maxG = max(maxG, s.TotalGbps)
	}
	ss = append([]series{{"all sessions", tot}}, ss...)
	if err := addLines(top, ss, false); err != nil {
		return err
	}
	bottom := newPlot("CPU of the proxy host's processes", "seconds", "% of one core")
	if err := addLines(bottom, []series{{"HAProxy", hc}, {"proxy's Dysco agent", ac}}, false); err != nil {
		return err
	}
	maxC := 0.0
	for _, p := range hc {
		maxC = max(maxC, p.Y)
	}
	for _, t := range d.Triggers {
		vline(top, t, 0, maxG*1.05, colour(2))
		vline(bottom, t, 0, maxC*1.05+1, colour(2))
	}
	top.Y.Min, bottom.Y.Min = 0, 0
	top.Y.Max, bottom.Y.Max = maxG*1.35, maxC*1.35+1
	if err := env.SavePlots("proxy_removal_timeline.png", 3*vg.Inch, top, bottom); err != nil {
		return err
	}
	cp := newPlot("reconfiguration time at the left anchor (CDF)", "ms", "fraction of removals")
	if err := addLines(cp, []series{{"ours", cdf(ms)}}, false); err != nil {
		return err
	}
	paperPts, _ := plotter.NewScatter(plotter.XYs{{X: 2, Y: 0.8}, {X: 4, Y: 0.987}})
	paperPts.GlyphStyle.Color = colour(2)
	paperPts.GlyphStyle.Radius = vg.Points(4)
	cp.Add(paperPts)
	cp.Legend.Add("paper: 80 % < 2 ms, 98.7 % < 4 ms", paperPts)
	cp.Legend.Top, cp.Legend.Left = false, false
	cp.Y.Min, cp.Y.Max = 0, 1.05
	cp.X.Min = 0
	if err := env.SavePlots("proxy_removal_cdf.png", 3.5*vg.Inch, cp); err != nil {
		return err
	}

	st := d.Removal
	ratio := d.AfterGbps / d.BeforeGbps
	// What each removal changed: the means between consecutive removals.
	var steps []string
	bounds := append([]float64{0}, d.Triggers...)
	bounds = append(bounds, 1e9)
	for i := 0; i+1 < len(bounds); i++ {
		lo := bounds[i] + 1.5
		if i == 0 {
			lo = 0
		}
		label := "before the first removal"
		if i > 0 {
			label = fmt.Sprintf("after removal %d", i)
		}
		steps = append(steps, fmt.Sprintf("%s %.2f Gbit/s, %.0f %%", label, window(d.Timeline, lo, bounds[i+1], total), window(d.Timeline, lo, bounds[i+1], cpu)))
	}
	res.Setup = []string{
		"A star lab (paper Fig. 11 in small): client, proxy and server around a router, an agent on each. Policies with no chain make the client → proxy and proxy → server connections Dysco sessions, so that the proxy's agent can join them.",
		fmt.Sprintf("HAProxy 2.6 on the proxy in TCP mode with `option splice-request/splice-response`, under `LD_PRELOAD=lib/libdysco.so` (trigger `both`: libdysco asks for a session's removal once HAProxy has spliced both of its directions)."),
		fmt.Sprintf("%d sessions in %d bundles of %d, opened by the runner from the client's namespace to its own receiver in the server's namespace; each sends client → server as fast as TCP lets. "+
			"The paper had 600 sessions in 4 bundles of 150, each bundle a client-server pair on its own hosts; here one client and one server namespace carry every bundle. "+
			"Every host has Linux's default TCP receive buffer limit (net.ipv4.tcp_rmem %s), whatever the machine's, and the runner's senders keep at most %d KiB unsent in their sockets (TCP_NOTSENT_LOWAT): the ends of every session share one kernel, whose TCP memory limit (net.ipv4.tcp_mem) is global. %s",
			n, z.Bundles, z.PerBundle, bench.LabTCPRmem, prNotsentLowat>>10, tcpMemSentence(d)),
		fmt.Sprintf("At %.0f s and then every %.0f s (paper: 40, 60, 80, 100 s), one bundle's server ends start answering at 32 KiB/s: HAProxy splices that direction too, and libdysco asks the proxy's agent to remove the proxy from those sessions. "+
			"The run ends %.0f s after the last removal.", z.Warm.Seconds(), z.Interval.Seconds(), z.Tail.Seconds()),
		"Every second: the bytes the server ends received per bundle (goodput), HAProxy's CPU time (utime + stime from /proc/PID/stat), the proxy agent's CPU time, and the packets the proxy host's datapath rewrote.",
		"Reconfiguration time: `dysco reconfig history --json` at the client (the left anchor), from the proxy agent's request to the old path no longer used, one result per session.",
		"At the end every sender half-closes and every receiver reads to EOF: the bytes received must equal the bytes sent, both directions, each compared with the sender's pattern.",
	}
	res.Comparisons = []Comparison{
		{What: "goodput of all sessions, after the last removal vs before the first",
			Ours:       fmt.Sprintf("%.2f → %.2f Gbit/s (%.1f ×)", d.BeforeGbps, d.AfterGbps, ratio),
			Paper:      "doubled (2 ×)",
			Difference: goodputDifference(ratio)},
		{What: "HAProxy's CPU, before the first removal and after the last",
			Ours:       fmt.Sprintf("%.0f %% → %.1f %% of one core", d.CPUBefore, d.CPUAfter),
			Paper:      "falls at each removal, to zero after the last",
			Difference: map[bool]string{true: "the same: HAProxy does nothing once its sessions have left it", false: "HAProxy still uses CPU after the last removal: see the timeline"}[d.CPUAfter < 0.1*d.CPUBefore+1]},
		{What: "reconfiguration time (per session, at the left anchor)",
			Ours: fmt.Sprintf("p50 %.2f ms, p99 %.2f ms, max %.2f ms; %.1f %% under 2 ms, %.1f %% under 4 ms (%d of %d succeeded); %s",
				st.P50ms, st.P99ms, st.MaxMs, 100*st.Under2ms, 100*st.Under4ms, st.Succeeded, n, labkit.OrText(st.PhasesText(), "phases unknown")),
			Paper:      "80 % under 2 ms, 98.7 % under 4 ms",
			Difference: removalTimeDifference(st, z.PerBundle)},
		{What: "bytes lost", Ours: fmt.Sprintf("%d session directions with a loss, of %d (%.2f GB up, %.2f MB down, checked byte by byte)", len(d.Lost), 2*n, float64(d.BytesUp)/1e9, float64(d.BytesDown)/1e6),
			Paper: "none (no session disrupted)", Difference: map[bool]string{true: "the same", false: "we lost bytes: a bug"}[len(d.Lost) == 0]},
	}
	res.Plots = []Plot{
		{File: "proxy_removal_timeline.png", Title: "Goodput and proxy CPU over time (as Fig. 12)",
			Shows: fmt.Sprintf("Top: goodput per second of all sessions (blue) and of each bundle, client → server; the dashed lines are the removals (when each bundle's server ends start answering). "+
				"Before the first removal the sessions share the relay at %.2f Gbit/s; each removal moves a bundle off the proxy and the total steps up, to %.2f Gbit/s after the last. "+
				"Mean total and HAProxy CPU between consecutive removals: %s. "+
				"Bottom: HAProxy's CPU (%% of one core), from %.0f %% before the first removal to %.1f %% after the last, and the proxy agent's CPU.",
				d.BeforeGbps, d.AfterGbps, strings.Join(steps, "; "), d.CPUBefore, d.CPUAfter)},
		{File: "proxy_removal_cdf.png", Title: "Reconfiguration times (as Fig. 13)",
			Shows: fmt.Sprintf("Cumulative distribution of the %d removal times measured at the client; the two red points are the paper's (80 %% under 2 ms, 98.7 %% under 4 ms). Our median is %.2f ms and p99 %.2f ms: the curve lies to the right of the paper's points, for the reason in the table.",
				len(ms), st.P50ms, st.P99ms)},
	}
	res.Headline = []string{
		fmt.Sprintf("%d sessions through HAProxy, removed in %d bundles: %d/%d removals succeeded, p50 %.2f ms, p99 %.2f ms (paper: 80 %% < 2 ms)", n, z.Bundles, st.Succeeded, n, st.P50ms, st.P99ms),
		fmt.Sprintf("goodput %.2f Gbit/s through the proxy → %.2f Gbit/s after (%.1f ×; paper: 2 ×); HAProxy CPU %.0f %% → %.1f %% of a core", d.BeforeGbps, d.AfterGbps, ratio, d.CPUBefore, d.CPUAfter),
		fmt.Sprintf("bytes lost: %d session directions of %d (%.2f GB checked byte by byte)", len(d.Lost), 2*n, float64(d.BytesUp+d.BytesDown)/1e9),
	}
	return nil
}
