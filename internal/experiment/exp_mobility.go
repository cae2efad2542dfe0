package experiment

// Experiment "mobility" (M2M §4.2.3, break before make): a client with a
// session address and two links downloads from a server through a
// stateful firewall and a monitor, and moves between its two subnets
// every few seconds: the address of the link it uses is deleted with its
// default route, its agent rebinds the session from the other link, and
// the address comes back for the next move. Goodput over time, each move
// marked, and the gap per move; the firewall keeps its one conntrack
// entry and the monitor sees one session throughout.

import (
	"context"
	"fmt"
	"io"
	"net/netip"
	"os"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"

	"github.com/dysco/dysco/internal/lab"
	"github.com/dysco/dysco/internal/labkit"
)

func init() {
	Register(&Experiment{Name: "mobility", Paper: "M2M §4.2.3",
		Summary: "a client with a session address moves between two subnets every few seconds during a download through a firewall and a monitor: goodput over time, each move marked, the gap per move",
		Tools:   []string{"iptables", "conntrack", "tcpdump"},
		Phases:  mobPhases, Run: runMobility})
}

// mobSize is a run's length, the time between moves and the download's
// rate.
type mobSize struct {
	Run, Every time.Duration
	RateMbit   int
}

func mobSizes(s Size) mobSize {
	return pick(s,
		mobSize{6 * time.Second, 1500 * time.Millisecond, 50},
		mobSize{20 * time.Second, 3 * time.Second, 100},
		mobSize{40 * time.Second, 3 * time.Second, 200})
}

func mobPhases(s Size) []Phase {
	z := mobSizes(s)
	return []Phase{{"lab, firewall and monitor", 6 * time.Second}, {"download with moves", z.Run + 3*time.Second}}
}

const (
	mobPort  = 9720
	mobBin   = 100 * time.Millisecond
	mobChunk = 16 << 10
)

// mobMove is one move.
type mobMove struct {
	AtS  float64 `json:"at_s"` // the deletion, from the download's start
	From string  `json:"from"`
	To   string  `json:"to"`
	// RebindMS is the time from the deletion until the session was seen
	// leaving from the other address (CLI polling every 10 ms); GapMS the
	// longest time with no byte received from the deletion to 1 s after.
	RebindMS float64 `json:"rebind_ms"`
	GapMS    float64 `json:"gap_ms"`
}

// mobData is the experiment's raw data.
type mobData struct {
	Size     mobSize   `json:"size"`
	Firewall []string  `json:"firewall_rules"`
	Moves    []mobMove `json:"moves"`
	Mbps     []float64 `json:"mbps"` // received, per mobBin
	Bytes    int64     `json:"bytes"`
	// Conntrack is the firewall's entries for the session before the
	// first move and after the last.
	ConntrackBefore []string `json:"conntrack_before"`
	ConntrackAfter  []string `json:"conntrack_after"`
	// Monitor is the tuples the monitor on mb1's tap saw (one per
	// direction of each session).
	Monitor []string `json:"monitor_tuples"`
}

func runMobility(ctx context.Context, env *Env) (*Result, error) {
	z := mobSizes(env.Size)
	res := &Result{Title: "a client moving between two subnets during a download through a firewall and a monitor"}
	d := &mobData{Size: z}
	res.Data = d

	env.Begin("lab, firewall and monitor")
	topo := lab.Topology{Kind: lab.KindStar, Hosts: []lab.HostSpec{{Name: "client", Role: lab.RoleClient, Links: 2, SessionAddr: true},
		{Name: "mb1", Role: lab.RoleMiddlebox}, {Name: "server", Role: lab.RoleServer}}}
	l, err := env.set.Up(ctx, env.Prefix+"mo", topo, labkit.Agents{Dysco: env.O.Dysco, Args: env.O.AgentArgs})
	if err != nil {
		return res, err
	}
	c, srv, mb1 := l.Host("client"), l.Host("server").Addr4, l.Host("mb1").Addr4
	mv, err := labkit.NewLinkMover(l, "client", env.O.Dysco)
	if err != nil {
		return res, err
	}
	for _, r := range [][]string{
		{"-P", "FORWARD", "DROP"},
		{"-A", "FORWARD", "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT"},
		{"-A", "FORWARD", "-p", "tcp", "--syn", "-s", c.SessionAddr4.String(), "-d", srv.String(), "--dport", strconv.Itoa(mobPort),
			"-m", "conntrack", "--ctstate", "NEW", "-j", "ACCEPT"},
	} {
		d.Firewall = append(d.Firewall, "iptables "+strings.Join(r, " "))
		if _, err := labkit.Run(ctx, l, "mb1", 10*time.Second, append([]string{"iptables"}, r...)...); err != nil {
			return res, err
		}
	}
	monitor, err := l.Start("mb1", "monitor", "tcpdump", "-l", "-n", "-i", lab.TapName, fmt.Sprintf("tcp port %d", mobPort))
	if err != nil {
		return res, err
	}
	defer monitor.Stop()
	if _, err := labkit.DyscoCLI(ctx, env.O.Dysco, l, "client", "policy", "add", "mobile", fmt.Sprintf("tcp dst port %d", mobPort), "--chain", mb1.String()); err != nil {
		return res, err
	}

	env.Begin("download with moves")
	dl, err := startDownload(ctx, l, netip.AddrPortFrom(srv, mobPort), float64(z.RateMbit)*1e6)
	if err != nil {
		return res, err
	}
	defer dl.close()
	t0 := dl.start
	ct := func() []string {
		out, err := labkit.Run(ctx, l, "mb1", 10*time.Second, "conntrack", "-L", "-p", "tcp", "--dport", strconv.Itoa(mobPort))
		if err != nil {
			res.problem("conntrack -L on mb1: %v", err)
		}
		return labkit.ConntrackOrig(out)
	}
	d.ConntrackBefore = ct()
	for j := 0; ; j++ {
		at := t0.Add(time.Duration(j+1) * z.Every)
		if at.After(t0.Add(z.Run - z.Every/2)) {
			break
		}
		if err := labkit.SleepCtx(ctx, time.Until(at)); err != nil {
			return res, err
		}
		k := j % 2
		m := mobMove{From: mv.Addr(k).String(), To: mv.Addr(1 - k).String()}
		start, moved, err := mv.Move(ctx, k, mobPort, 5*time.Second)
		if err != nil {
			return res, err
		}
		m.AtS = start.Sub(t0).Seconds()
		if moved.IsZero() {
			res.problem("move %d: the session did not leave from %s within 5 s", j+1, m.To)
		} else {
			m.RebindMS = float64(moved.Sub(start)) / float64(time.Millisecond)
		}
		d.Moves = append(d.Moves, m)
		env.Logf("move %d: %s -> %s at %.1f s, rebound within %.0f ms", j+1, m.From, m.To, m.AtS, m.RebindMS)
		if err := labkit.SleepCtx(ctx, 200*time.Millisecond); err != nil {
			return res, err
		}
		if err := mv.Restore(ctx, k); err != nil {
			return res, err
		}
	}
	if err := labkit.SleepCtx(ctx, time.Until(t0.Add(z.Run))); err != nil {
		return res, err
	}
	d.ConntrackAfter = ct()
	if err := dl.finish(); err != nil {
		res.problem("the download: %v", err)
	}
	monitor.Stop()
	if b, err := os.ReadFile(monitor.Log); err == nil {
		d.Monitor = monitorTuples(string(b))
	}
	mobSummarize(d, dl)
	if len(d.Moves) == 0 {
		res.problem("no move")
	}
	if len(d.ConntrackBefore) != 1 || strings.Join(d.ConntrackBefore, "") != strings.Join(d.ConntrackAfter, "") {
		res.problem("mb1's conntrack: %v before the moves, %v after: want the same one entry", d.ConntrackBefore, d.ConntrackAfter)
	}
	sess := c.SessionAddr4.String() + "."
	for _, tup := range d.Monitor {
		if !strings.Contains(tup, sess) {
			res.problem("the monitor saw %s, not the session from %s", tup, c.SessionAddr4)
		}
	}
	if len(d.Monitor) != 2 {
		res.problem("the monitor saw %d tuples (%v), want the session's two directions", len(d.Monitor), d.Monitor)
	}
	return res, mobReport(env, res, d)
}

// download is a paced download from the lab's server to its client, whose
// reads the client records.
type download struct {
	start time.Time
	mu    sync.Mutex
	reads []time.Time
	sizes []int
	ln    interface{ Close() error }
	conn  io.ReadCloser
	stop  context.CancelFunc
	sent  chan error
	got   chan error
}

func startDownload(ctx context.Context, l *lab.Lab, srv netip.AddrPort, rate float64) (*download, error) {
	ln, err := l.Listen("server", "tcp", srv.String())
	if err != nil {
		return nil, err
	}
	dl := &download{ln: ln, sent: make(chan error, 1), got: make(chan error, 1)}
	sctx, stop := context.WithCancel(ctx)
	dl.stop = stop
	go func() {
		conn, err := ln.Accept()
		if err != nil {
			dl.sent <- err
			return
		}
		defer conn.Close()
		err = labkit.PacedWrite(sctx, conn, rate, mobChunk)
		if err == context.Canceled {
			err = nil
		}
		dl.sent <- err
	}()
	conn, err := l.Dial(ctx, "client", "tcp", srv.String())
	if err != nil {
		stop()
		ln.Close()
		return nil, err
	}
	dl.conn = conn
	first := make(chan struct{})
	go func() {
		buf := make([]byte, 64<<10)
		for {
			n, err := conn.Read(buf)
			if n > 0 {
				dl.mu.Lock()
				if len(dl.reads) == 0 {
					close(first)
				}
				dl.reads = append(dl.reads, time.Now())
				dl.sizes = append(dl.sizes, n)
				dl.mu.Unlock()
			}
			if err != nil {
				if err == io.EOF {
					err = nil
				}
				dl.got <- err
				return
			}
		}
	}()
	select {
	case <-first:
		dl.start = time.Now()
		return dl, nil
	case <-time.After(10 * time.Second):
		dl.close()
		return nil, fmt.Errorf("no byte of the download 10 s after it started")
	case <-ctx.Done():
		dl.close()
		return nil, ctx.Err()
	}
}

// finish stops the server's writes and waits for the end of the stream.
func (dl *download) finish() error {
	dl.stop()
	if err := <-dl.sent; err != nil {
		return fmt.Errorf("the server: %w", err)
	}
	select {
	case err := <-dl.got:
		return err
	case <-time.After(30 * time.Second):
		return fmt.Errorf("the client did not see the end of the stream")
	}
}

func (dl *download) close() {
	dl.stop()
	dl.conn.Close()
	dl.ln.Close()
}

// mobSummarize bins the received bytes and measures each move's gap.
func mobSummarize(d *mobData, dl *download) {
	dl.mu.Lock()
	defer dl.mu.Unlock()
	end := dl.start.Add(d.Size.Run)
	n := int(d.Size.Run / mobBin)
	bins := make([]float64, n)
	for i, t := range dl.reads {
		d.Bytes += int64(dl.sizes[i])
		if b := int(t.Sub(dl.start) / mobBin); t.After(dl.start) && t.Before(end) && b < n {
			bins[b] += float64(dl.sizes[i])
		}
	}
	for i := range bins {
		bins[i] = bins[i] * 8 / 1e6 / mobBin.Seconds()
	}
	d.Mbps = bins
	for i := range d.Moves {
		from := dl.start.Add(time.Duration(d.Moves[i].AtS * float64(time.Second)))
		to := from.Add(time.Second)
		k := sort.Search(len(dl.reads), func(j int) bool { return !dl.reads[j].Before(from) })
		last, worst := from, time.Duration(0)
		for ; k < len(dl.reads) && !dl.reads[k].After(to); k++ {
			worst = max(worst, dl.reads[k].Sub(last))
			last = dl.reads[k]
		}
		worst = max(worst, to.Sub(last))
		d.Moves[i].GapMS = float64(worst) / float64(time.Millisecond)
	}
}

// monitorTuples returns the distinct "A > B" of tcpdump's lines.
func monitorTuples(out string) []string {
	seen := map[string]bool{}
	for _, line := range strings.Split(out, "\n") {
		f := strings.Fields(line)
		for i := 0; i+3 < len(f); i++ {
			if f[i] == "IP" && f[i+2] == ">" {
				seen[f[i+1]+" > "+strings.TrimSuffix(f[i+3], ":")] = true
				break
			}
		}
	}
	var out2 []string
	for t := range seen {
		out2 = append(out2, t)
	}
	sort.Strings(out2)
	return out2
}

func mobReport(env *Env, res *Result, d *mobData) error {
	var rows [][]string
	var xy plotter.XYs
	top := float64(d.Size.RateMbit)
	for i, v := range d.Mbps {
		t := float64(i+1) * mobBin.Seconds()
		rows = append(rows, []string{strconv.FormatFloat(t, 'f', 1, 64), strconv.FormatFloat(v, 'f', 2, 64)})
		xy = append(xy, plotter.XY{X: t, Y: v})
		top = max(top, v)
	}
	if err := env.WriteCSV("mobility.csv", []string{"t_s", "mbps"}, rows); err != nil {
		return err
	}
	var mrows [][]string
	var gaps, rebinds []float64
	for _, m := range d.Moves {
		mrows = append(mrows, []string{strconv.FormatFloat(m.AtS, 'f', 3, 64), m.From, m.To,
			strconv.FormatFloat(m.RebindMS, 'f', 1, 64), strconv.FormatFloat(m.GapMS, 'f', 2, 64)})
		gaps, rebinds = append(gaps, m.GapMS), append(rebinds, m.RebindMS)
	}
	if err := env.WriteCSV("mobility_moves.csv", []string{"at_s", "from", "to", "rebind_ms", "gap_ms"}, mrows); err != nil {
		return err
	}
	p := newPlot("goodput of a download; the client moves at each line", "seconds", "Mbit/s")
	if err := addLines(p, []series{{"download (client receives)", xy}}, false); err != nil {
		return err
	}
	for _, m := range d.Moves {
		if err := vline(p, m.AtS, 0, top*1.05, colour(5)); err != nil {
			return err
		}
	}
	p.Y.Min, p.Y.Max = 0, top*1.3
	if err := env.SavePlots("mobility.png", 2.8*vg.Inch, p); err != nil {
		return err
	}
	sort.Float64s(gaps)
	gapText := "no move"
	if len(gaps) > 0 {
		gapText = fmt.Sprintf("median %.1f ms, longest %.1f ms over %d moves (the rebind seen within %.0f ms median, CLI polling)",
			labkit.Median(gaps), gaps[len(gaps)-1], len(gaps), labkit.Median(rebinds))
	}
	r := d.Size.RateMbit
	res.Setup = []string{
		"A star lab: a client with two links to the router (eth0 on 10.200.1.0/24, eth1 on 10.202.1.0/24) and session addresses on lo (10.250.1.1, the source of its default routes; `--hosts client:2+session,mb1,server`), a middlebox mb1 and a server, an agent on each. The client's policy sends the download's session through mb1.",
		fmt.Sprintf("mb1 is a stateful firewall (`%s`) and a monitor (tcpdump on its session-view tap).", strings.Join(d.Firewall, "`; `")),
		fmt.Sprintf("The server sends %d Mbit/s (paced, %d KB writes) for %s to the client, which records every read. Every %s the client loses the address of the link it uses, with its default route (`ip addr del`, `ip route del default dev ethK`, as when a DHCP lease ends); its agent rebinds the session from the other link's address (docs/mobility.md); 200 ms later the address comes back, for the next move, which goes the other way.", r, mobChunk>>10, d.Size.Run, d.Size.Every),
		"Goodput is what the client received per 100 ms. A move's gap is the longest time with no byte received from the deletion until 1 s after it.",
	}
	res.Comparisons = []Comparison{
		{What: "interruption per move",
			Ours:       gapText,
			Paper:      "M2M §4.2.3 describes the rebind to the first-hop middlebox after a move and gives no figure",
			Difference: "a TCP session keeps its tuple, its middlebox and the middlebox's state; only its first subsession changes"},
		{What: "what the middlebox sees",
			Ours:       fmt.Sprintf("conntrack: %d entry before the moves, the same after; the monitor saw %d tuples (%s)", len(d.ConntrackBefore), len(d.Monitor), strings.Join(d.Monitor, ", ")),
			Paper:      "the middleboxes keep seeing the same session (§4.2.3, a non-routable IP as a unique ID)",
			Difference: "the same"},
	}
	res.Plots = []Plot{{File: "mobility.png", Title: "Goodput of a download while the client moves between two subnets",
		Shows: fmt.Sprintf("What the client received per 100 ms; each dashed line is a move (the deletion of the address the session used). The download runs at %d Mbit/s; each move costs a dip of a few milliseconds, and TCP catches up.", r)}}
	res.Headline = []string{
		fmt.Sprintf("mobility: a %d Mbit/s download through a firewall and a monitor, the client moving between two subnets every %s", r, d.Size.Every),
		fmt.Sprintf("gap per move: %s", gapText),
		fmt.Sprintf("firewall entries before/after: %d/%d (the same); monitor tuples: %d", len(d.ConntrackBefore), len(d.ConntrackAfter), len(d.Monitor)),
	}
	return nil
}
