package experiment

// Experiment "quic-migration" (heterogeneous-sfc-quic §VI.B, Figure 5):
// three QUIC sessions (HTTP/3 downloads with dysco-h3) through a slow
// middlebox, moved one by one to a fast one whose firewall its agent
// starts on demand for the first move (§III.B: the control message names
// the function the new hop must run). Throughput per session every
// 100 ms, each move and the firewall's start marked.
//
// The paper's slow middlebox was a software firewall in a container
// (796 Mbit/s for three sessions, Table II) and its fast one an FPGA
// firewall loaded by partial reconfiguration (196 ms). Here both are
// iptables firewalls in lab namespaces: the slow one (mb1) is slow because
// its link is shaped with TBF (this kernel has no netem, KNOWN_ISSUES.md),
// the fast one (mb2) is unshaped, and the server paces each body (dysco-h3
// serve --rate) as the paper's processor-based QUIC server limited the
// FPGA path.

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"time"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"

	"github.com/dysco/dysco/internal/api"
	"github.com/dysco/dysco/internal/lab"
	"github.com/dysco/dysco/internal/labkit"
)

func init() {
	Register(&Experiment{Name: "quic-migration", Paper: "QUIC Fig. 5",
		Summary: "three HTTP/3 (QUIC) downloads moved one by one from a shaped middlebox to a fast one whose firewall starts on demand: throughput per 100 ms",
		Tools:   []string{"tc", "iptables", "conntrack"},
		Phases:  qmPhases, Run: runQUICMigration})
}

// qmSessions is the number of QUIC sessions (the paper's three).
const qmSessions = 3

// qmPortBase is the server's UDP port of the first session; session i
// uses qmPortBase+i.
const qmPortBase = 4470

type qmSize struct {
	// Warm is the time before the first move, Interval between moves,
	// Tail after the last one.
	Warm, Interval, Tail time.Duration
	// ShapedMbit is the rate of mb1's link (TBF), RateMbit the server's
	// pace per session.
	ShapedMbit, RateMbit int
}

func qmSizes(s Size) qmSize {
	return pick(s,
		qmSize{1500 * time.Millisecond, 1500 * time.Millisecond, 1500 * time.Millisecond, 60, 60},
		qmSize{2 * time.Second, 2 * time.Second, 2 * time.Second, 60, 60},
		qmSize{5 * time.Second, 5 * time.Second, 5 * time.Second, 100, 100})
}

// moveAt is when session i moves, from the downloads' start.
func (z qmSize) moveAt(i int) time.Duration { return z.Warm + time.Duration(i)*z.Interval }

func (z qmSize) total() time.Duration { return z.moveAt(qmSessions-1) + z.Tail }

func qmPhases(s Size) []Phase {
	z := qmSizes(s)
	return []Phase{{"lab, firewall and shaper", 6 * time.Second}, {"three downloads, moved one by one", z.total() + 3*time.Second},
		{"checks", 3 * time.Second}}
}

// qmBufferMs is the FIFO of mb1's shaper at its rate; qmBurst its bucket.
const (
	qmBufferMs = 40
	qmBurst    = 32 << 10
)

// qmBinS is the width of the throughput bins (the paper's 100 ms).
const qmBinS = 0.1

// qmDownload is one session's download.
type qmDownload struct {
	Port  int   `json:"port"`
	Bytes int64 `json:"bytes_asked"`
	// From get's summary.
	OK      bool    `json:"ok"`
	Got     int64   `json:"bytes"`
	Seconds float64 `json:"seconds"`
	Mbps    float64 `json:"mbps"`
	Error   string  `json:"error,omitempty"`
	// From the server's stats.
	Connections int    `json:"server_connections"`
	Migrated    int    `json:"server_migrated"`
	Remotes     int    `json:"server_remotes"`
	Close       string `json:"server_close,omitempty"`
	// End is when the last sample came, from the downloads' start.
	End     float64        `json:"end_s"`
	samples []qmGetSample  `json:"-"`
	stats   string         `json:"-"`
	srv     *lab.Proc      `json:"-"`
	out     chan getResult `json:"-"`
}

type getResult struct {
	out string
	err error
}

// qmGetSample is a line of dysco-h3 get --samples.
type qmGetSample struct {
	At    float64 `json:"at"`
	Bytes int64   `json:"bytes"`
}

// qmMove is one session's move from mb1 to mb2.
type qmMove struct {
	Session int                 `json:"session"`
	At      float64             `json:"at_s"` // the request, from the downloads' start
	Result  *api.ReconfigResult `json:"result,omitempty"`
	Error   string              `json:"error,omitempty"`
	// Switch is when the new path took over (the request plus the set-up
	// time); NFFrom and NFTo bracket the wait for mb2's firewall to
	// start (the first move only).
	Switch float64 `json:"switch_s"`
	NFFrom float64 `json:"nf_from_s,omitempty"`
	NFTo   float64 `json:"nf_to_s,omitempty"`
	// Dip is the lowest 100 ms bin of the moved session in the second
	// after its switch over its mean in the second before; Gain its mean
	// in the second after over that before.
	Dip  float64 `json:"dip_ratio"`
	Gain float64 `json:"gain_ratio"`
}

// qmBin is one 100 ms bin of the timeline.
type qmBin struct {
	T    float64   `json:"t"` // the bin's end, from the downloads' start
	Mbps []float64 `json:"session_mbps"`
	// Mb1 and Mb2 split the total by the middlebox each session crossed.
	Mb1 float64 `json:"mb1_mbps"`
	Mb2 float64 `json:"mb2_mbps"`
}

// qmData is the experiment's raw data.
type qmData struct {
	Size      qmSize            `json:"size"`
	Shaper    []string          `json:"shaper_commands"`
	Downloads []*qmDownload     `json:"downloads"`
	Moves     []*qmMove         `json:"moves"`
	Timeline  []qmBin           `json:"timeline"`
	NF        *api.NFStatus     `json:"mb2_firewall,omitempty"`
	Tracked   []int             `json:"mb2_conntrack_ports"`
	Drops     map[string]uint64 `json:"anchor_drops,omitempty"`
	// BeforeMbps is the total in the second before the first move,
	// AfterMbps after the last switch until the first download ended.
	BeforeMbps float64 `json:"before_mbps"`
	AfterMbps  float64 `json:"after_mbps"`
	afterBins  int
	// ShapedBytes and ShapedDrops are mb1's shaper's counters.
	ShapedBytes uint64 `json:"shaper_bytes"`
	ShapedDrops uint64 `json:"shaper_drops"`
}

// h3Binary finds dysco-h3: beside the dysco binary (make build puts both
// in bin/), else on the PATH.
func h3Binary(dysco string) (string, error) {
	p := filepath.Join(filepath.Dir(dysco), "dysco-h3")
	if _, err := os.Stat(p); err == nil {
		return p, nil
	}
	if p, err := exec.LookPath("dysco-h3"); err == nil {
		return filepath.Abs(p)
	}
	return "", fmt.Errorf("quic-migration needs dysco-h3 beside %s or on the PATH: run `make build`", dysco)
}

// qmFirewall is the firewall's iptables set-up, the same on mb1 (set up
// by the experiment) and mb2 (started on demand by its agent): FORWARD
// policy DROP, established traffic and new UDP sessions of the
// downloads' ports accepted (a firewall started on a live session sees it
// mid-stream, maybe first from the server: the port either way).
func qmFirewall() [][]string {
	ports := fmt.Sprintf("%d:%d", qmPortBase, qmPortBase+qmSessions-1)
	return [][]string{
		{"iptables", "-P", "FORWARD", "DROP"},
		{"iptables", "-A", "FORWARD", "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT"},
		{"iptables", "-A", "FORWARD", "-p", "udp", "-m", "multiport", "--ports", ports, "-m", "conntrack", "--ctstate", "NEW",
			"-m", "comment", "--comment", "dysco-nf-firewall", "-j", "ACCEPT"},
	}
}

// qmNFArgs configure the on-demand firewall on an agent.
func qmNFArgs() []string {
	var start []string
	for _, r := range qmFirewall() {
		start = append(start, strings.Join(r, " "))
	}
	return []string{
		"--nf", "firewall.start=" + strings.Join(start, " && ") + " && exec sleep infinity",
		"--nf", "firewall.ready=iptables -S FORWARD | grep -q dysco-nf-firewall",
		"--nf", "firewall.stop=iptables -F FORWARD; iptables -P FORWARD ACCEPT",
	}
}

func runQUICMigration(ctx context.Context, env *Env) (*Result, error) {
	z := qmSizes(env.Size)
	res := &Result{Title: "three QUIC sessions moved one by one to a faster middlebox, its firewall started on demand"}
	d := &qmData{Size: z}
	res.Data = d
	h3, err := h3Binary(env.Dysco)
	if err != nil {
		return res, err
	}
	tmp, err := os.MkdirTemp("", "dysco-quic-migration-")
	if err != nil {
		return res, err
	}
	defer os.RemoveAll(tmp)

	env.Begin("lab, firewall and shaper")
	// Every agent knows the firewall; only mb2's is asked for it.
	agents := labkit.Agents{Dysco: env.O.Dysco, Args: append(append([]string(nil), env.O.AgentArgs...), qmNFArgs()...)}
	l, err := env.set.Up(ctx, env.Prefix+"qm", lab.Star("client", "mb1", "mb2", "server"), agents)
	if err != nil {
		return res, err
	}
	mb1, mb2, srv := l.Host("mb1"), l.Host("mb2").Addr4, l.Host("server").Addr4
	for _, argv := range qmFirewall() {
		if _, err := labkit.Run(ctx, l, "mb1", 10*time.Second, argv...); err != nil {
			return res, err
		}
	}
	shaper := []string{"tc", "qdisc", "replace", "dev", mb1.Iface, "root", "tbf", "rate", fmt.Sprintf("%dmbit", z.ShapedMbit),
		"burst", strconv.Itoa(qmBurst), "limit", strconv.Itoa(z.ShapedMbit * 1_000_000 / 8 * qmBufferMs / 1000)}
	d.Shaper = []string{"ip netns exec LAB-mb1 " + strings.Join(shaper, " ")}
	if _, err := labkit.Run(ctx, l, "mb1", 10*time.Second, shaper...); err != nil {
		return res, fmt.Errorf("shaping mb1's link with TBF (the slow middlebox; no unshaped fallback): %w", err)
	}
	var filters []string
	for i := 0; i < qmSessions; i++ {
		filters = append(filters, fmt.Sprintf("dst port %d", qmPortBase+i))
	}
	if _, err := labkit.DyscoCLI(ctx, env.O.Dysco, l, "client", "policy", "add", "quic", "--chain", mb1.Addr4.String(),
		"udp and ("+strings.Join(filters, " or ")+")"); err != nil {
		return res, err
	}
	for i := 0; i < qmSessions; i++ {
		dl := &qmDownload{Port: qmPortBase + i, Bytes: qmBytes(z, i), stats: filepath.Join(tmp, fmt.Sprintf("stats%d.json", i)), out: make(chan getResult, 1)}
		d.Downloads = append(d.Downloads, dl)
		dl.srv, err = l.Start("server", fmt.Sprintf("h3-%d", dl.Port), h3, "serve", "--listen", fmt.Sprintf("0.0.0.0:%d", dl.Port),
			"--stats", dl.stats, "--rate", fmt.Sprintf("%dM", z.RateMbit))
		if err != nil {
			return res, err
		}
		defer dl.srv.Stop()
	}
	for _, dl := range d.Downloads {
		if err := waitSocket(ctx, l, "-Hlun", dl.Port, "dysco-h3 serve"); err != nil {
			return res, err
		}
	}
	before := map[string]*api.Status{}
	for _, h := range []string{"client", "server"} {
		if before[h], err = labkit.AgentStatus(ctx, env.O.Dysco, l, h); err != nil {
			return res, err
		}
	}

	env.Begin("three downloads, moved one by one")
	t0 := time.Now()
	gctx, cancel := context.WithTimeout(ctx, z.total()+90*time.Second)
	defer cancel()
	for i, dl := range d.Downloads {
		url := fmt.Sprintf("https://%s/bytes/%d", netip.AddrPortFrom(srv, uint16(dl.Port)), dl.Bytes)
		samples := filepath.Join(tmp, fmt.Sprintf("samples%d.jsonl", i))
		cmd := l.Command(gctx, "client", h3, "get", url, "--insecure", "--timeout", (z.total() + 80*time.Second).String(),
			"--interval", "100ms", "--samples", samples)
		go func() {
			out, err := cmd.Output()
			if err == nil {
				err = readSamples(samples, &dl.samples)
			} else {
				readSamples(samples, &dl.samples)
			}
			dl.out <- getResult{string(out), err}
		}()
	}
	nfMarked := false
	env.Logf("%d downloads through mb1 (shaped to %d Mbit/s), the server pacing each at %d Mbit/s", qmSessions, z.ShapedMbit, z.RateMbit)
	for i := 0; i < qmSessions; i++ {
		if err := labkit.SleepCtx(ctx, time.Until(t0.Add(z.moveAt(i)))); err != nil {
			return res, err
		}
		mv := &qmMove{Session: i + 1, At: time.Since(t0).Seconds()}
		d.Moves = append(d.Moves, mv)
		out, err := labkit.DyscoCLI(ctx, env.O.Dysco, l, "client", "reconfig", "--json", "--timeout", "30s",
			"--match", fmt.Sprintf("udp dst port %d", qmPortBase+i), "--to", srv.String(), "--chain", "firewall@"+mb2.String())
		var rep api.ReconfigReply
		if jerr := json.Unmarshal([]byte(out), &rep); jerr != nil || len(rep.Results) != 1 {
			mv.Error = fmt.Sprintf("dysco reconfig: %v %v: %s", err, jerr, labkit.Tail(out, 300))
			res.problem("session %d's move: %s", i+1, mv.Error)
			continue
		}
		r := rep.Results[0]
		mv.Result = &r
		mv.Switch = mv.At + float64(r.SetupMicros)/1e6
		// The first move that names the function starts it; the later
		// ones find it running (a wait of well under a millisecond).
		if r.NF != "" && !nfMarked {
			nfMarked = true
			mv.NFTo = mv.Switch
			mv.NFFrom = mv.NFTo - float64(r.NFMicros)/1e6
		}
		if r.Outcome != "succeeded" {
			res.problem("session %d's move: %s %s", i+1, r.Outcome, r.Reason)
		}
		nf := ""
		if r.NF != "" {
			nf = fmt.Sprintf(", of which %.1f ms waiting for mb2's %s to start", float64(r.NFMicros)/1000, r.NF)
		}
		env.Logf("session %d moved to firewall@mb2 at %.1f s: %s in %.1f ms (set-up %.1f ms%s)", i+1, mv.At, r.Outcome,
			float64(r.Micros)/1000, float64(r.SetupMicros)/1000, nf)
	}
	if err := labkit.SleepCtx(ctx, time.Until(t0.Add(z.total()))); err != nil {
		return res, err
	}
	for i, dl := range d.Downloads {
		var g getResult
		select {
		case g = <-dl.out:
		case <-ctx.Done():
			return res, ctx.Err()
		}
		var sum struct {
			OK      bool    `json:"ok"`
			Bytes   int64   `json:"bytes"`
			Seconds float64 `json:"seconds"`
			Mbps    float64 `json:"mbps"`
			Error   string  `json:"error"`
		}
		if jerr := json.Unmarshal([]byte(lastJSONLine(g.out)), &sum); jerr != nil {
			res.problem("download %d: %v %v: %s", i+1, g.err, jerr, labkit.Tail(g.out, 300))
			continue
		}
		dl.OK, dl.Got, dl.Seconds, dl.Mbps, dl.Error = sum.OK, sum.Bytes, sum.Seconds, sum.Mbps, sum.Error
		if !dl.OK || dl.Got != dl.Bytes || g.err != nil {
			res.problem("download %d: %d of %d bytes, ok %v: %s %v", i+1, dl.Got, dl.Bytes, dl.OK, dl.Error, g.err)
		}
		if n := len(dl.samples); n > 0 {
			dl.End = dl.samples[n-1].At - float64(t0.UnixNano())/1e9
		}
	}

	env.Begin("checks")
	qmCheck(ctx, env, l, res, d, before)
	qmTimeline(d, t0)
	if d.afterBins == 0 {
		res.problem("no 100 ms bin between the last switch and the first download's end: the downloads ended too early")
	} else if !(d.AfterMbps > d.BeforeMbps) {
		res.problem("throughput after the moves (%.1f Mbit/s) is not above that before (%.1f Mbit/s)", d.AfterMbps, d.BeforeMbps)
	}
	return res, qmReport(env, res, d)
}

// qmBytes sizes session i's download to end about when the run does: at
// the shaped rate shared by the sessions still on mb1 until its move, at
// the server's pace after.
func qmBytes(z qmSize, i int) int64 {
	bits := 0.0
	prev := 0.0
	for k := 0; k <= i; k++ {
		t := z.moveAt(k).Seconds()
		bits += float64(z.ShapedMbit) * 1e6 / float64(qmSessions-k) * (t - prev)
		prev = t
	}
	bits += float64(z.RateMbit) * 1e6 * (z.total().Seconds() - prev)
	return int64(bits/8) / 1000 * 1000
}

// waitSocket waits until the server has a socket on port that `ss` lists
// with flags (-Hlun: UDP, -Hltn: a TCP listener); what names its program.
// No connection is tried: a test server would take it for a client.
func waitSocket(ctx context.Context, l *lab.Lab, flags string, port int, what string) error {
	deadline := time.Now().Add(15 * time.Second)
	for {
		out, err := labkit.Run(ctx, l, "server", 5*time.Second, "ss", flags, fmt.Sprintf("sport = :%d", port))
		if err == nil && strings.TrimSpace(out) != "" {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%s on port %d did not listen within 15 s (see the lab's logs): %v", what, port, err)
		}
		if err := labkit.SleepCtx(ctx, 50*time.Millisecond); err != nil {
			return err
		}
	}
}

func readSamples(path string, into *[]qmGetSample) error {
	b, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	for _, line := range strings.Split(strings.TrimSpace(string(b)), "\n") {
		var s qmGetSample
		if json.Unmarshal([]byte(line), &s) == nil && s.At > 0 {
			*into = append(*into, s)
		}
	}
	if len(*into) == 0 {
		return errors.New("no throughput samples")
	}
	return nil
}

// lastJSONLine is the last line of out that holds a JSON object.
func lastJSONLine(out string) string {
	lines := strings.Split(strings.TrimSpace(out), "\n")
	for i := len(lines) - 1; i >= 0; i-- {
		if strings.HasPrefix(lines[i], "{") {
			return lines[i]
		}
	}
	return ""
}

// qmCheck reads the servers' stats, mb2's firewall and conntrack, the
// anchors' drop counters and mb1's shaper.
func qmCheck(ctx context.Context, env *Env, l *lab.Lab, res *Result, d *qmData, before map[string]*api.Status) {
	for i, dl := range d.Downloads {
		if err := dl.srv.Stop(); err != nil {
			res.problem("server %d: %v", i+1, err)
		}
		var st struct {
			Connections int `json:"connections"`
			Migrated    int `json:"migrated"`
			Conns       []struct {
				Remotes []string `json:"remotes"`
				Close   string   `json:"close"`
			} `json:"conns"`
		}
		b, err := os.ReadFile(dl.stats)
		if err == nil {
			err = json.Unmarshal(b, &st)
		}
		if err != nil {
			res.problem("server %d's stats: %v", i+1, err)
			continue
		}
		dl.Connections, dl.Migrated = st.Connections, st.Migrated
		if len(st.Conns) > 0 {
			dl.Remotes, dl.Close = len(st.Conns[0].Remotes), st.Conns[0].Close
		}
		if dl.Connections != 1 || dl.Migrated != 0 || dl.Remotes != 1 {
			res.problem("session %d: the server saw %d connections, %d migrated, %d remote addresses; want one connection that never migrated", i+1, dl.Connections, dl.Migrated, dl.Remotes)
		}
	}
	st, err := labkit.AgentStatus(ctx, env.O.Dysco, l, "mb2")
	if err != nil {
		res.problem("mb2's status: %v", err)
	} else {
		for _, f := range st.NFs {
			if f.Name == "firewall" {
				d.NF = &f
			}
		}
		if d.NF == nil || d.NF.Starts != 1 || d.NF.State != "ready" {
			res.problem("mb2's firewall: %+v, want started once and ready", d.NF)
		}
	}
	ct, err := labkit.Run(ctx, l, "mb2", 10*time.Second, "conntrack", "-L", "-p", "udp")
	if err != nil {
		res.problem("mb2's conntrack: %v", err)
	}
	client, srv := l.Host("client").Addr4.String(), l.Host("server").Addr4.String()
	for _, dl := range d.Downloads {
		for _, line := range strings.Split(ct, "\n") {
			if strings.Contains(line, "src="+client+" ") && strings.Contains(line, "dst="+srv+" ") && strings.Contains(line, fmt.Sprintf("dport=%d ", dl.Port)) {
				d.Tracked = append(d.Tracked, dl.Port)
				break
			}
		}
	}
	if len(d.Tracked) != qmSessions {
		res.problem("mb2's conntrack holds the sessions of ports %v, want all %d", d.Tracked, qmSessions)
	}
	d.Drops = map[string]uint64{}
	for _, h := range []string{"client", "server"} {
		after, err := labkit.AgentStatus(ctx, env.O.Dysco, l, h)
		if err != nil {
			res.problem("%s's status: %v", h, err)
			continue
		}
		for k, v := range labkit.Drops(labkit.CounterDelta(before[h], after)) {
			d.Drops[h+":"+k] = v
		}
	}
	if len(d.Drops) > 0 {
		res.problem("drop counters moved at the anchors: %s", labkit.CountsText(d.Drops))
	}
	out, err := labkit.Run(ctx, l, "mb1", 10*time.Second, "tc", "-s", "-j", "qdisc", "show", "dev", l.Host("mb1").Iface)
	var qs []struct {
		Kind  string `json:"kind"`
		Root  bool   `json:"root"`
		Bytes uint64 `json:"bytes"`
		Drops uint64 `json:"drops"`
	}
	if err == nil && json.Unmarshal([]byte(out), &qs) == nil {
		for _, q := range qs {
			if q.Root && q.Kind == "tbf" {
				d.ShapedBytes, d.ShapedDrops = q.Bytes, q.Drops
			}
		}
	}
	if d.ShapedBytes < 1e6 {
		res.problem("mb1's shaper sent %d bytes: the sessions did not cross it (%v)", d.ShapedBytes, err)
	}
}

// qmTimeline bins the downloads' samples on a common 100 ms grid from
// the downloads' start (each client's cumulative bytes, interpolated at
// the grid's instants), and the moves' figures.
func qmTimeline(d *qmData, t0 time.Time) {
	base := float64(t0.UnixNano()) / 1e9
	end := 0.0
	for _, dl := range d.Downloads {
		end = max(end, dl.End)
	}
	cum := func(dl *qmDownload, t float64) float64 {
		s := dl.samples
		at := t + base
		if len(s) == 0 || at <= s[0].At {
			if len(s) > 0 && s[0].At > 0 {
				return float64(s[0].Bytes) * max(0, at-base) / max(s[0].At-base, 1e-9)
			}
			return 0
		}
		k := sort.Search(len(s), func(k int) bool { return s[k].At >= at })
		if k == len(s) {
			return float64(s[len(s)-1].Bytes)
		}
		a, b := s[k-1], s[k]
		f := (at - a.At) / max(b.At-a.At, 1e-9)
		return float64(a.Bytes) + f*float64(b.Bytes-a.Bytes)
	}
	switchAt := make([]float64, qmSessions)
	for i := range switchAt {
		switchAt[i] = math.Inf(1)
	}
	for _, mv := range d.Moves {
		if mv.Result != nil && mv.Result.Outcome == "succeeded" {
			switchAt[mv.Session-1] = mv.Switch
		}
	}
	d.Timeline = nil
	for t := qmBinS; t <= end+1e-9; t += qmBinS {
		b := qmBin{T: t, Mbps: make([]float64, len(d.Downloads))}
		for i, dl := range d.Downloads {
			m := (cum(dl, t) - cum(dl, t-qmBinS)) * 8 / qmBinS / 1e6
			b.Mbps[i] = m
			if t-qmBinS/2 >= switchAt[i] {
				b.Mb2 += m
			} else {
				b.Mb1 += m
			}
		}
		d.Timeline = append(d.Timeline, b)
	}
	total := func(b qmBin) float64 {
		s := 0.0
		for _, m := range b.Mbps {
			s += m
		}
		return s
	}
	firstEnd := math.Inf(1)
	for _, dl := range d.Downloads {
		firstEnd = min(firstEnd, dl.End)
	}
	var before, after []float64
	first := d.Size.Warm.Seconds()
	last := switchAt[qmSessions-1]
	for _, b := range d.Timeline {
		switch {
		case b.T > first-1 && b.T <= first:
			before = append(before, total(b))
		case b.T-qmBinS > last+0.2 && b.T <= firstEnd-qmBinS:
			after = append(after, total(b))
		}
	}
	if len(before) > 0 {
		d.BeforeMbps = mean(before)
	}
	if len(after) > 0 {
		d.AfterMbps = mean(after)
	}
	d.afterBins = len(after)
	for _, mv := range d.Moves {
		i := mv.Session - 1
		var pre, post []float64
		for _, b := range d.Timeline {
			switch {
			case b.T > mv.At-1 && b.T <= mv.At:
				pre = append(pre, b.Mbps[i])
			case b.T-qmBinS >= mv.Switch && b.T <= mv.Switch+1 && b.T <= d.Downloads[i].End:
				post = append(post, b.Mbps[i])
			}
		}
		if m := mean(pre); m > 0 && len(post) > 0 {
			low := post[0]
			for _, v := range post {
				low = min(low, v)
			}
			mv.Dip, mv.Gain = low/m, mean(post)/m
		}
	}
}

func qmReport(env *Env, res *Result, d *qmData) error {
	z := d.Size
	var rows [][]string
	for _, b := range d.Timeline {
		row := []string{strconv.FormatFloat(b.T, 'f', 2, 64)}
		for _, m := range b.Mbps {
			row = append(row, strconv.FormatFloat(m, 'f', 2, 64))
		}
		row = append(row, strconv.FormatFloat(b.Mb1, 'f', 2, 64), strconv.FormatFloat(b.Mb2, 'f', 2, 64))
		rows = append(rows, row)
	}
	hdr := []string{"t_s"}
	for i := range d.Downloads {
		hdr = append(hdr, fmt.Sprintf("session%d_mbps", i+1))
	}
	if err := env.WriteCSV("quic_migration_timeline.csv", append(hdr, "via_mb1_mbps", "via_mb2_mbps"), rows); err != nil {
		return err
	}
	rows = nil
	var times []float64
	for _, mv := range d.Moves {
		row := []string{strconv.Itoa(mv.Session), strconv.FormatFloat(mv.At, 'f', 3, 64)}
		if r := mv.Result; r != nil {
			row = append(row, r.Outcome, r.Reason, ms(r.Micros), ms(r.LockMicros), ms(r.SetupMicros), r.NF, ms(r.NFMicros))
			if r.Outcome == "succeeded" {
				times = append(times, float64(r.Micros)/1000)
			}
		} else {
			row = append(row, "error", mv.Error, "", "", "", "", "")
		}
		rows = append(rows, row)
	}
	if err := env.WriteCSV("quic_migration_moves.csv", []string{"session", "at_s", "outcome", "reason", "total_ms", "lock_ms", "setup_ms", "nf", "nf_ms"}, rows); err != nil {
		return err
	}

	// The plots: per session (and the total), and per middlebox as the
	// paper's.
	top, maxS := 1.0, 1.0
	var ss []series
	for i := range d.Downloads {
		var xy plotter.XYs
		for _, b := range d.Timeline {
			xy = append(xy, plotter.XY{X: b.T, Y: b.Mbps[i]})
			maxS = max(maxS, b.Mbps[i])
		}
		ss = append(ss, series{fmt.Sprintf("session %d", i+1), xy})
	}
	var tot, via1, via2 plotter.XYs
	for _, b := range d.Timeline {
		s := b.Mb1 + b.Mb2
		tot = append(tot, plotter.XY{X: b.T, Y: s})
		via1 = append(via1, plotter.XY{X: b.T, Y: b.Mb1})
		via2 = append(via2, plotter.XY{X: b.T, Y: b.Mb2})
		top = max(top, s)
	}
	ps := newPlot("throughput per QUIC session, 100 ms bins", "", "Mbit/s")
	if err := addLines(ps, ss, false); err != nil {
		return err
	}
	pm := newPlot("throughput by middlebox (as Fig. 5): mb1 shaped, mb2 firewall on demand", "seconds since the downloads started", "Mbit/s")
	if err := addLines(pm, []series{{"via mb1 (shaped)", via1}, {"via mb2 (fast)", via2}, {"total", tot}}, false); err != nil {
		return err
	}
	for _, m := range []struct {
		p   *plot.Plot
		top float64
	}{{ps, maxS}, {pm, top}} {
		for _, mv := range d.Moves {
			if err := vline(m.p, mv.At, 0, m.top*1.05, colour(5)); err != nil {
				return err
			}
			if mv.NFTo > 0 {
				vline(m.p, mv.NFFrom, 0, m.top*1.05, colour(4))
				vline(m.p, mv.NFTo, 0, m.top*1.05, colour(4))
			}
		}
		m.p.Y.Min, m.p.Y.Max = 0, m.top*1.4
	}
	if err := env.SavePlots("quic_migration.png", 2.8*vg.Inch, ps, pm); err != nil {
		return err
	}

	var nfMs float64
	var nfMove *qmMove
	for _, mv := range d.Moves {
		if mv.Result != nil && mv.Result.NF != "" {
			nfMove, nfMs = mv, float64(mv.Result.NFMicros)/1000
			break
		}
	}
	intact := 0
	for _, dl := range d.Downloads {
		if dl.OK && dl.Got == dl.Bytes && dl.Connections == 1 && dl.Migrated == 0 {
			intact++
		}
	}
	moveTimes := []string{}
	for _, mv := range d.Moves {
		if r := mv.Result; r != nil {
			moveTimes = append(moveTimes, fmt.Sprintf("session %d %s in %.1f ms (set-up %.1f ms)", mv.Session, r.Outcome, float64(r.Micros)/1000, float64(r.SetupMicros)/1000))
		}
	}
	res.Setup = []string{
		"A star lab: client, mb1, mb2 and server around a router, an agent on each. mb1 and mb2 are iptables firewalls (FORWARD policy DROP, conntrack's ESTABLISHED/RELATED accepted, NEW UDP datagrams of the downloads' ports accepted).",
		fmt.Sprintf("mb1, the slow middlebox, is a firewall from the start, its link shaped with TBF: `%s` (%d Mbit/s, a %d ms FIFO, on mb1's egress, which carries the downloads towards the client and their acknowledgements towards the server).", strings.Join(d.Shaper, "`; `"), z.ShapedMbit, qmBufferMs),
		"mb2, the fast middlebox, is unshaped and runs no firewall until a reconfiguration asks for one: its agent has the network function `firewall` (`--nf firewall.start=…`, `firewall.ready=iptables -S FORWARD | grep -q dysco-nf-firewall`; docs/operating.md, \"Network functions on demand\"). Every agent is given the same flags; only mb2's is asked for it.",
		fmt.Sprintf("The server runs one `dysco-h3 serve --rate %dM` per session (UDP ports %d–%d): each body is paced at %d Mbit/s, so that the fast path, as in the paper (\"FPGA throughput was again limited by the processor-based generation of QUIC packets\"), is limited by the server, not by the CPU the lab shares.", z.RateMbit, qmPortBase, qmPortBase+qmSessions-1, z.RateMbit),
		fmt.Sprintf("The client's policy `udp and (dst port %d or …)` chains the sessions through mb1. Three `dysco-h3 get` downloads start together (one QUIC connection each, sized to last the run; each client samples its bytes every 100 ms, binned on a common 100 ms grid).", qmPortBase),
		fmt.Sprintf("At %.1f s and then every %.1f s the client moves one session to mb2: `dysco reconfig --match 'udp dst port P' --to SERVER --chain firewall@MB2`. The first move makes mb2's agent start the firewall before the new path answers (the session stays on mb1 meanwhile); the later ones find it running. The run ends %.1f s after the last move, and the downloads run to their end.", z.Warm.Seconds(), z.Interval.Seconds(), z.Tail.Seconds()),
		"Checked: every download's bytes and hash (dysco-h3 get), one connection per server that never migrated (dysco-h3 serve's stats), mb2's firewall started exactly once and its conntrack holding every session's tuple, no `drop_*` counter moved at the anchors (client, server), and bytes through mb1's shaper.",
		"**Not as in the paper**: the paper's fast middlebox was an FPGA firewall loaded by partial reconfiguration (196 ms to load a 5.8 MB bitstream) and its slow one a software firewall in a container (796 Mbit/s for three sessions); the QUIC stack was ngtcp2 on a 28-core server with 10 Gbit/s NICs. Here both middleboxes are the same iptables firewall in network namespaces on a shared 2-core machine: mb1 is slow only because TBF shapes its link, and the firewall's \"reconfiguration\" is the start of an iptables process. The rates are set by the shaper and the server's pace, not by the middleboxes.",
	}
	var gains []string
	for _, mv := range d.Moves {
		gains = append(gains, fmt.Sprintf("session %d: lowest bin %.2f ×, mean %.2f × the second before", mv.Session, mv.Dip, mv.Gain))
	}
	res.Comparisons = []Comparison{
		{What: "total throughput of the three sessions through the slow middlebox (the second before the first move)",
			Ours:       fmt.Sprintf("%.1f Mbit/s (mb1's link shaped to %d Mbit/s)", d.BeforeMbps, z.ShapedMbit),
			Paper:      "under 1,000 Mbit/s (the software firewall's limit, Table II: 796 Mbit/s)",
			Difference: "ours is the TBF shaper's rate less QUIC's and UDP's overhead, a tenth of the paper's: the lab's rate is set so that three paced sessions fill it on a shared 2-core machine"},
		{What: "total throughput after all three moved to the fast middlebox",
			Ours:       fmt.Sprintf("%s Mbit/s (the server paces each session at %d Mbit/s); %.2f × before", f1(d.AfterMbps), z.RateMbit, d.AfterMbps/d.BeforeMbps),
			Paper:      "significantly higher than before (FPGA firewall 1,270 Mbit/s, Table II; 1.6 × the software firewall), limited by the server's packet generation",
			Difference: "both limited by the sender, not the fast middlebox; our ratio is set by the shaper and the pace we chose"},
		{What: "start of the fast middlebox's firewall for the first move",
			Ours: func() string {
				if nfMove == nil {
					return "no network function was waited for"
				}
				return fmt.Sprintf("%.1f ms (iptables rules and the ready check, at mb2's agent; session %d's set-up waited for it, on its old path meanwhile)", nfMs, nfMove.Session)
			}(),
			Paper:      "196 ms (partial reconfiguration of the FPGA, loading the firewall's bitstream from flash), the session on its old path meanwhile",
			Difference: "a process start, not an FPGA reconfiguration: shorter; in both the session keeps flowing on the old path while the function starts"},
		{What: "time per move (request to the old path no longer used, with the UDP drain of 500 ms)",
			Ours:       labkit.OrText(strings.Join(moveTimes, "; "), "no move"),
			Paper:      "not given; moves at 5, 10 and 15 s",
			Difference: fmt.Sprintf("moves every %.1f s (%s run); the paper every 5 s", z.Interval.Seconds(), env.Size)},
		{What: "the moved session's throughput across its move (100 ms bins in the second after the switch, over the second before)",
			Ours:       strings.Join(gains, "; "),
			Paper:      "each moved session continues at once at the fast middlebox's rate (Fig. 5)",
			Difference: "the same shape; the first bins after a switch carry what the old path still held"},
		{What: "sessions intact (bytes, hash, one connection that never migrated)",
			Ours:       fmt.Sprintf("%d of %d; anchors' drop counters: %s", intact, qmSessions, labkit.OrText(labkit.CountsText(d.Drops), "none moved")),
			Paper:      "the sessions continue (no loss reported)",
			Difference: map[bool]string{true: "the same", false: "a session was hurt: see the checks"}[intact == qmSessions && len(d.Drops) == 0]},
	}
	nfText := "The orange dashed pair brackets the wait for mb2's firewall to start, during the first move."
	if nfMove == nil {
		nfText = "No move waited for mb2's firewall (no orange pair)."
	}
	res.Plots = []Plot{{File: "quic_migration.png", Title: "Throughput of three QUIC sessions moved one by one to a faster middlebox (as Fig. 5)",
		Shows: fmt.Sprintf("Top: each session's throughput per 100 ms bin; bottom: the total, split by the middlebox the sessions crossed (a session counts for mb2 from its switch), as the paper's red (software) and blue (FPGA) lines. "+
			"The purple dashed lines are the moves' requests (%s). %s Before the moves the three sessions share mb1's shaped link; each move lifts the moved session to the server's pace and leaves more of the shaper to the others.",
			strings.Join(moveAts(d), ", "), nfText)}}
	res.Headline = []string{
		fmt.Sprintf("three QUIC sessions through mb1 (TBF %d Mbit/s): %.1f Mbit/s in total; after moving to mb2: %s Mbit/s (%.2f ×)", z.ShapedMbit, d.BeforeMbps, f1(d.AfterMbps), d.AfterMbps/d.BeforeMbps),
		fmt.Sprintf("mb2's firewall started on demand in %.1f ms during the first move (paper: 196 ms FPGA partial reconfiguration); moves: %s", nfMs, labkit.OrText(strings.Join(moveTimes, "; "), "none")),
		fmt.Sprintf("%d of %d downloads intact (hash, one connection never migrated); anchors' drops: %s", intact, qmSessions, labkit.OrText(labkit.CountsText(d.Drops), "none")),
	}
	if len(times) > 0 {
		res.Notes = append(res.Notes, fmt.Sprintf("Move times: median %.1f ms, max %.1f ms. mb1's shaper sent %d bytes and dropped %d packets.", labkit.Median(times), labkit.Quantile(times, 1), d.ShapedBytes, d.ShapedDrops))
	}
	return nil
}

func moveAts(d *qmData) []string {
	var out []string
	for _, mv := range d.Moves {
		out = append(out, fmt.Sprintf("session %d at %.1f s", mv.Session, mv.At))
	}
	return out
}

func ms(us int64) string { return strconv.FormatFloat(float64(us)/1000, 'f', 3, 64) }
