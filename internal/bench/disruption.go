package bench

// Benchmark "disruption": what a live reconfiguration does to one TCP
// session (paper §5.3, Figure 14: goodput and congestion window of a session
// across a reconfiguration, SACK on and off, where the new path is faster
// than the old one). Its own lab, a star of client, mb1, mb2 and server
// with an agent on each; the client's policy chains the session through
// mb1. The runner is both ends: it dials from the client's namespace and
// sends as fast as TCP lets, and receives on the server's. Every 50 ms it
// samples the receiver's bytes received (TCP_INFO tcpi_bytes_received: the
// goodput of the bin) and the sender's congestion window, smoothed RTT,
// retransmissions and reordering counters. Part-way through, it replaces
// mb1 by mb2 in the live session at the client (`dysco reconfig --match
// 'tcp port P' --to SERVER --chain MB2`). Once with SACK on (the default),
// once with SACK off in the client's and the server's namespaces
// (net.ipv4.tcp_sack is per namespace).
//
// The old path is the slower one. This kernel has no netem, so the paper's
// link delays cannot be set; instead mb1's link to the router is shaped
// with TBF in both directions (the router's interface towards mb1 and
// mb1's eth0) to a rate far below what the unshaped path carries, with a
// FIFO of tens of ms, and the sender uses cubic (TCP_CONGESTION on its
// socket; the lab's default, BBR, would keep the queue empty). Cubic fills
// the FIFO, so the old path's RTT is its queueing delay; mb2's link is
// left alone. At the switch-over the new path's packets overtake those
// still queued on the old one, and arrive at the server out of order.

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"path/filepath"
	"sort"
	"strings"
	"time"

	"github.com/dysco/dysco/internal/api"
	"github.com/dysco/dysco/internal/labkit"
)

// disruptionPort is the server port of the SACK-on run; the SACK-off run
// uses the next one, so that the reconfiguration of each run matches its
// session alone.
const disruptionPort = 9600

// tcpiOptSACK is TCPI_OPT_SACK of tcpi_options (linux/tcp.h).
const tcpiOptSACK = 2

// disruptionBin is the sampling interval.
const disruptionBin = 50 * time.Millisecond

// DisruptionWin is the length of the windows compared: the second before
// the reconfiguration, and the reconfiguration plus the second after it.
const DisruptionWin = time.Second

func disruptionPhaseName(o *Options) string {
	return fmt.Sprintf("disruption of one session by a reconfiguration, %v, SACK on and off", o.DisruptionTime)
}

// disruptionEst estimates the benchmark's duration: two runs, each with
// its set-up and the checks after the sampling.
func disruptionEst(o *Options) time.Duration {
	return 2 * (o.DisruptionTime + 5*time.Second)
}

// disruptionAt is when the reconfiguration starts, from the session's
// start: 3 s of 8 (1.5 s of 4 with --quick).
func disruptionAt(o *Options) time.Duration { return o.DisruptionTime * 3 / 8 }

// DisruptionSample is one 50 ms bin of the session. A bin is longer when
// the sampler runs late, never shorter than half of disruptionBin.
type DisruptionSample struct {
	// T is the end of the bin, in seconds since the session was
	// established.
	T float64 `json:"t"`
	// Bytes is what the receiver's kernel received in order during the bin
	// (the change of tcpi_bytes_received), Gbps the same as a rate over the
	// bin's actual length.
	Bytes uint64  `json:"bytes"`
	Gbps  float64 `json:"goodput_gbps"`
	// AppBytes is what the receiving goroutine read during the bin.
	AppBytes int64 `json:"app_bytes"`
	// The sender's TCP_INFO: congestion window and slow-start threshold
	// (segments), retransmissions so far, smoothed RTT, congestion
	// avoidance state (0 open, 1 disorder, 2 CWR, 3 recovery, 4 loss),
	// reordering events seen and duplicate SACKs so far; segments in
	// flight, SACKed and marked lost now (tcpi_unacked, tcpi_sacked,
	// tcpi_lost); its reordering degree (tcpi_reordering, 3 until it sees
	// reordering) and retransmission timeouts so far (tcpi_total_rto).
	Cwnd       uint32 `json:"cwnd"`
	Ssthresh   uint32 `json:"ssthresh"`
	Retrans    uint32 `json:"retrans"`
	RttUs      uint32 `json:"rtt_us"`
	CaState    uint8  `json:"ca_state"`
	ReordSeen  uint32 `json:"reord_seen"`
	DsackDups  uint32 `json:"dsack_dups"`
	Unacked    uint32 `json:"unacked"`
	Sacked     uint32 `json:"sacked"`
	Lost       uint32 `json:"lost"`
	Reordering uint32 `json:"reordering"`
	Rtos       uint32 `json:"rtos"`
	// RcvOoo is the receiver's out-of-order packets so far
	// (tcpi_rcv_ooopack).
	RcvOoo uint32 `json:"rcv_ooopack"`
}

// DisruptionRun is one run: one session, one reconfiguration.
type DisruptionRun struct {
	SACK bool `json:"sack"`
	// SACKNegotiated is whether the session's handshake agreed on SACK
	// (the sender's tcpi_options).
	SACKNegotiated bool `json:"sack_negotiated"`
	// CC is the sender's congestion control, as its socket reports it
	// (TCP_CONGESTION), MinRttUs its smallest RTT (tcpi_min_rtt) at the
	// end of the sampling.
	CC       string `json:"congestion_control"`
	MinRttUs uint32 `json:"min_rtt_us"`
	Port     int    `json:"port"`
	Session  string `json:"session,omitempty"`
	Policy   string `json:"policy"`
	// ReconfigAt is when the runner started the reconfiguration command,
	// ReconfigStart and ReconfigEnd when the command started and returned,
	// all in seconds since the session was established (the samples' time
	// base).
	ReconfigAt    float64              `json:"reconfig_at"`
	ReconfigStart float64              `json:"reconfig_start"`
	ReconfigEnd   float64              `json:"reconfig_end"`
	ReconfigArgv  []string             `json:"reconfig_argv"`
	Results       []api.ReconfigResult `json:"reconfig_results"`
	ReconfigErr   string               `json:"reconfig_error,omitempty"`
	Samples       []DisruptionSample   `json:"samples"`
	Summary       *disruptionSummary   `json:"summary,omitempty"`
	// Counter changes of the middleboxes' datapaths over the run (from
	// before the dial to the end of the checks).
	MB1Counters map[string]uint64 `json:"mb1_counters,omitempty"`
	MB2Counters map[string]uint64 `json:"mb2_counters,omitempty"`
	// Shapers is what the old path's shapers sent and dropped over the
	// run, by "HOST:IFACE".
	Shapers map[string]shaperDelta `json:"shapers,omitempty"`
	// MB1LeftMs is how long after the sampling mb1's agent still had the
	// session (-1: still after 10 s); MB1RewritesAfter the packets mb1's
	// datapath rewrote in the next second, data flowing.
	MB1LeftMs        float64 `json:"mb1_left_ms"`
	MB1RewritesAfter uint64  `json:"mb1_rewrites_after_left"`
	// ClientRight is the client's subsession towards the chain after the
	// run.
	ClientRight string   `json:"client_right,omitempty"`
	Notes       []string `json:"notes,omitempty"`
	SessionErrs []string `json:"session_errors,omitempty"`
	Problems    []string `json:"problems,omitempty"`
}

func (x *DisruptionRun) problem(format string, args ...any) {
	x.Problems = append(x.Problems, fmt.Sprintf(format, args...))
}

// once runs one session with SACK on or off and reconfigures it. Problems
// of the product (the reconfiguration fails, the session stalls or breaks)
// go to x.Problems; the error is for what stops the run.
func (dl *DisruptionLab) once(ctx context.Context, o *Options, sack bool, pr *labkit.Progress) (x *DisruptionRun, err error) {
	port := disruptionPortOf(sack)
	what := "SACK" + strings.ReplaceAll(sackName(sack), "-sack-", " ")
	x = &DisruptionRun{SACK: sack, Port: port, Policy: fmt.Sprintf("dysco policy add d%s --chain %s '%s'", sackName(sack), dl.mb1, disruptionPolicy(port)),
		ReconfigArgv: dl.reconfigArgv(o, port), MB1LeftMs: -1}
	restore, err := dl.setSACK(ctx, sack)
	defer func() {
		if rerr := restore(); rerr != nil {
			err = errors.Join(err, fmt.Errorf("restoring net.ipv4.tcp_sack: %w", rerr))
		}
	}()
	if err != nil {
		return x, err
	}
	before, err := dl.counters(ctx, o)
	if err != nil {
		return x, err
	}
	s, err := dl.openSession(ctx, x, port)
	if err != nil {
		return x, err
	}
	defer s.close()
	pr.Logf("disruption, %s: session %s through mb1, sending for %v, mb1 replaced by mb2 at %v", what, x.Session, o.DisruptionTime, disruptionAt(o))

	rec, err := dl.sample(ctx, o, x, s)
	if err != nil {
		return x, err
	}
	x.readReconfig(rec)
	if ti, err := tcpInfo(s.snd); err == nil {
		x.MinRttUs = ti.Min_rtt
	}
	sum := summarizeDisruption(x.Samples, x.ReconfigStart, x.ReconfigEnd, DisruptionWin)
	x.Summary = &sum
	micros := "–"
	if len(x.Results) == 1 {
		micros = fmt.Sprintf("%s in %.2f ms", x.Results[0].Outcome, float64(x.Results[0].Micros)/1000)
	}
	pr.Logf("disruption, %s: reconfiguration %s (command %.3f–%.3f s); goodput %.2f Gbit/s in the second before, smallest 50 ms bin after %.2f Gbit/s at %.2f s (%.2f ×; before: %.2f ×), %d retransmissions in the window, cwnd %.0f → min %d",
		what, micros, x.ReconfigStart, x.ReconfigEnd, sum.BeforeGbps, sum.AfterMinGbps, sum.AfterMinAt, sum.Ratio, sum.BeforeRatio, sum.RetransWindow, sum.CwndBefore, sum.CwndAfterMin)

	if err := dl.checkFlowing(ctx, o, x, s, port, sum); err != nil {
		return x, err
	}
	after, err := dl.counters(ctx, o)
	if err != nil {
		return x, err
	}
	dl.checkCounters(x, before, after)
	s.stop()
	s.errMu.Lock()
	if len(x.SessionErrs) > 0 {
		x.problem("session errors: %s", strings.Join(x.SessionErrs, "; "))
	}
	s.errMu.Unlock()
	return x, nil
}

// disruptionCounters are what the checks of a run compare: the
// middleboxes' agents' status and the old path's shapers.
type disruptionCounters struct {
	mb1, mb2 *api.Status
	shapers  map[string]qdiscStats
}

// counters reads the middleboxes' status and the shapers' counters.
func (dl *DisruptionLab) counters(ctx context.Context, o *Options) (c disruptionCounters, err error) {
	if c.mb1, err = labkit.AgentStatus(ctx, o.Dysco, dl.lab, "mb1"); err != nil {
		return c, err
	}
	if c.mb2, err = labkit.AgentStatus(ctx, o.Dysco, dl.lab, "mb2"); err != nil {
		return c, err
	}
	c.shapers, err = dl.shaperStats(ctx)
	return c, err
}

// readReconfig reads the reconfiguration's JSON output: one result, for
// the run's session, that succeeded.
func (x *DisruptionRun) readReconfig(rec reconfigCommand) {
	recOut, recErr := rec.out, rec.err
	var rep api.ReconfigReply
	if jerr := json.Unmarshal([]byte(recOut), &rep); jerr != nil {
		x.ReconfigErr = fmt.Sprintf("%v; output not JSON: %v", recErr, jerr)
		x.problem("reconfiguration: %s", x.ReconfigErr)
		return
	}
	x.Results = rep.Results
	if recErr != nil {
		x.ReconfigErr = recErr.Error()
	}
	switch {
	case len(rep.Results) != 1:
		x.problem("reconfiguration: %d results for the one session (%+v; %v)", len(rep.Results), rep.Results, recErr)
	case rep.Results[0].Outcome != "succeeded":
		r0 := rep.Results[0]
		x.problem("reconfiguration: %s: %s (blocker %q) after %.2f ms", r0.Outcome, r0.Reason, r0.Blocker, float64(r0.Micros)/1000)
	}
}

// checkFlowing checks the run, data still flowing: the session still
// carries data, mb1 left its path, and the client's path goes to mb2.
func (dl *DisruptionLab) checkFlowing(ctx context.Context, o *Options, x *DisruptionRun, s *disruptionSession, port int, sum disruptionSummary) error {
	var last []DisruptionSample
	for _, smp := range x.Samples {
		if smp.T > o.DisruptionTime.Seconds()-DisruptionWin.Seconds() {
			last = append(last, smp)
		}
	}
	var lastBytes uint64
	for _, smp := range last {
		lastBytes += smp.Bytes
	}
	if lastBytes == 0 {
		x.problem("the session stalled: nothing received in the last %v of the sampling", DisruptionWin)
	}
	// Empty bins are a dip, which is what the figure measures; only a
	// window with nothing at all is a stall.
	switch {
	case sum.AfterBins > 0 && sum.StallBins == sum.AfterBins:
		x.problem("the session stalled: all %d bins of the reconfiguration window received nothing", sum.AfterBins)
	case sum.StallBins > 0:
		x.Notes = append(x.Notes, fmt.Sprintf("%d of the %d bins of the reconfiguration window received nothing", sum.StallBins, sum.AfterBins))
	}
	tl := time.Now()
	for {
		ss, err := dl.sessionsOf(ctx, o, "mb1", port)
		if err != nil {
			return err
		}
		if len(ss) == 0 {
			x.MB1LeftMs = float64(time.Since(tl).Microseconds()) / 1000
			break
		}
		if time.Since(tl) > 10*time.Second {
			x.problem("mb1's agent still has the session, 10 s after the sampling (%s, lock %s, reconfig %q)", ss[0].State, ss[0].Lock, ss[0].Reconfig)
			break
		}
		if err := labkit.SleepCtx(ctx, 200*time.Millisecond); err != nil {
			return err
		}
	}
	a, err := labkit.AgentStatus(ctx, o.Dysco, dl.lab, "mb1")
	if err != nil {
		return err
	}
	rx0 := s.appRx.Load()
	if err := labkit.SleepCtx(ctx, time.Second); err != nil {
		return err
	}
	b, err := labkit.AgentStatus(ctx, o.Dysco, dl.lab, "mb1")
	if err != nil {
		return err
	}
	x.MB1RewritesAfter = ProxyRewrites(b) - ProxyRewrites(a)
	if s.appRx.Load() <= rx0 {
		x.problem("the session received nothing in the second of the checks after the sampling")
	}
	if x.MB1LeftMs >= 0 && x.MB1RewritesAfter > 0 {
		x.problem("mb1 left the session but its datapath still rewrote %d packets in the next second", x.MB1RewritesAfter)
	}
	if cs, err := dl.sessionsOf(ctx, o, "client", port); err == nil && len(cs) == 1 {
		x.ClientRight = cs[0].Right
		if !strings.Contains(cs[0].Right, "-> "+dl.mb2.String()+":") {
			x.problem("the client's subsession does not go to mb2 after the reconfiguration: %q", cs[0].Right)
		}
	} else {
		x.problem("the client has %d sessions on port %d after the run (%v)", len(cs), port, err)
	}
	return nil
}

// checkCounters records the middleboxes' and the shapers' counters over
// the run and checks that both middleboxes carried the session.
func (dl *DisruptionLab) checkCounters(x *DisruptionRun, before, after disruptionCounters) {
	x.MB1Counters, x.MB2Counters = labkit.CounterDelta(before.mb1, after.mb1), labkit.CounterDelta(before.mb2, after.mb2)
	x.Shapers = shaperDeltas(before.shapers, after.shapers)
	if rewritesOf(x.MB1Counters) == 0 {
		x.problem("mb1's datapath rewrote no packet: the session did not take the chain")
	}
	if rewritesOf(x.MB2Counters) == 0 {
		x.problem("mb2's datapath rewrote no packet: the session never went through mb2")
	}
	for h, c := range map[string]map[string]uint64{"mb1": x.MB1Counters, "mb2": x.MB2Counters} {
		if d := labkit.Drops(c); len(d) > 0 {
			x.Notes = append(x.Notes, fmt.Sprintf("%s's datapath dropped packets: %v", h, d))
		}
	}
}

// DisruptionDetails is the raw data of the benchmark.
type DisruptionDetails struct {
	BinMs      int64   `json:"bin_ms"`
	WindowMs   int64   `json:"window_ms"`
	DurationS  float64 `json:"duration_s"`
	ReconfigAt float64 `json:"reconfig_at_s"`
	// Shaping is the old path's shaping and the sender's congestion
	// control.
	Shaping *disruptionShaping `json:"shaping"`
	Runs    []*DisruptionRun   `json:"runs"`
}

// Disruption runs the session with SACK on, then off, and adds a
// figure for each.
func Disruption(ctx context.Context, o *Options, dl *DisruptionLab, r *Report, pr *labkit.Progress) (err error) {
	det := &DisruptionDetails{BinMs: disruptionBin.Milliseconds(), WindowMs: DisruptionWin.Milliseconds(),
		DurationS: o.DisruptionTime.Seconds(), ReconfigAt: disruptionAt(o).Seconds(), Shaping: dl.Shaping}
	r.Details["disruption"] = det
	defer func() {
		if err != nil {
			if dir, lerr := labkit.SaveLabLogs(dl.lab, filepath.Join(o.OutDir, r.RunID+"-disruption-logs")); lerr == nil {
				err = fmt.Errorf("%w (logs of the lab's agents copied to %s)", err, dir)
			}
		}
	}()
	var errs []error
	for _, sack := range []bool{true, false} {
		x, err := dl.once(ctx, o, sack, pr)
		if x != nil {
			det.Runs = append(det.Runs, x)
		}
		name := "SACK" + strings.ReplaceAll(sackName(sack), "-sack-", " ")
		if err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", name, err))
			if ctx.Err() != nil {
				break
			}
			continue
		}
		if len(x.Problems) > 0 {
			errs = append(errs, fmt.Errorf("%s: %s", name, strings.Join(x.Problems, "; ")))
		}
		r.add(disruptionFigure(o, dl, x, r.Env.Nproc))
	}
	return errors.Join(errs...)
}

// disruptionFigure is the figure of one run.
func disruptionFigure(o *Options, dl *DisruptionLab, x *DisruptionRun, nproc int) *Figure {
	s := x.Summary
	name := "on"
	if !x.SACK {
		name = "off"
	}
	rec := "no result"
	if len(x.Results) == 1 {
		rec = fmt.Sprintf("%s in %.2f ms at the left anchor", x.Results[0].Outcome, float64(x.Results[0].Micros)/1000)
		if x.Results[0].Reason != "" {
			rec += " (" + x.Results[0].Reason + ")"
		}
	}
	if x.ReconfigErr != "" {
		rec += "; command: " + strings.ReplaceAll(labkit.Tail(x.ReconfigErr, 300), "\n", " ")
	}
	f := &Figure{
		Key:  "disruption-sack-" + name,
		Name: fmt.Sprintf("one session's goodput across a live reconfiguration (mb1 replaced by mb2, the new path faster), SACK %s", name),
		Command: fmt.Sprintf("%s; %s; runner: 1 session LAB-client → %s:%d (TCP_CONGESTION %s) sending as fast as TCP lets for %v, TCP_INFO every %v; at %v: ip netns exec LAB-client dysco reconfig --json --match 'tcp port %d' --to %s --chain %s",
			strings.Join(dl.Shaping.Commands, "; "), x.Policy, dl.srv, x.Port, dl.Shaping.CC, o.DisruptionTime, disruptionBin, disruptionAt(o), x.Port, dl.srv, dl.mb2),
		Unit:         "Gbit/s",
		Dysco:        s.AfterMinGbps,
		Baseline:     s.BeforeGbps,
		DyscoText:    fmt.Sprintf("min 50 ms bin %s", fmtVal(s.AfterMinGbps, "Gbit/s")),
		BaselineText: fmt.Sprintf("second before %s", fmtVal(s.BeforeGbps, "Gbit/s")),
		Ratio:        s.Ratio,
		Measured:     s.Ratio,
		MeasuredUnit: "× the second before",
	}
	if !x.SACK {
		f.Command = "net.ipv4.tcp_sack=0 (sysctl -w, LAB-client and LAB-server); " + f.Command
	}
	ok := len(x.Problems) == 0 && !math.IsNaN(s.Ratio) && s.Ratio >= 0.5
	if x.SACK {
		f.Target = "no visible dip with SACK on (min 50 ms bin ≥ 0.5 × the mean of the second before)"
		f.Paper = "no dip with SACK on"
		f.Met = metStr(ok)
	} else {
		f.Target = "(reported)"
		f.Paper = "Fig. 14, SACK off"
		f.Met = "–"
	}
	f.Note = fmt.Sprintf("%s; reconfiguration %s, command from %.3f s to %.3f s after the session started; "+
		"SACK negotiated: %v; congestion control %s; sender's smoothed RTT (tcpi_rtt) %.1f ms over the second before (old path), at most %.1f ms in the window, %.2f ms over the last second (new path; tcpi_min_rtt %d µs); "+
		"goodput (receiver's tcpi_bytes_received per bin) %.3f Gbit/s over the second before, %.2f Gbit/s over the reconfiguration and the second after it, %.2f Gbit/s over the last second, smallest bin after the start %.3f Gbit/s at %.2f s (%+.0f ms from the command's return); "+
		"for scale, the smallest bin of the second before was %.2f × its mean; "+
		"sender's retransmissions (tcpi_total_retrans) %d in the second before, %d in the reconfiguration window (timeouts %d, bins in recovery %d, before %d; most segments marked lost at a sample %d); "+
		"receiver's out-of-order packets %d in the second before, %d in the window; sender's DSACKs %d before, %d in the window, reordering events in the window %d; "+
		"cwnd (segments) mean %.0f, min %d in the second before → min %d, mean %.0f, %d at the end of the window; "+
		"the shapers over the run: %s; "+
		"mb1's agent dropped the session %s after the sampling and its datapath rewrote %d packets in the second after; client's subsession afterwards %q. "+
		"One run, one session. The old path is slower because mb1's link is shaped (TBF) and cubic fills its FIFO: its RTT is queueing delay that follows cubic's window (no netem on this kernel, so no constant link delay); "+
		"the new path is CPU-bound (the sender, the receiver, every datapath, the agents and the `dysco` command share the machine's %d vCPUs), so its goodput swings from bin to bin; "+
		"the old path keeps draining at its rate while the agents clamp the window to 64 KB during the two-path phase, so the in-order goodput stays near the old path's rate until the switch; "+
		"the lab also reorders packets without any reconfiguration (the receiver's out-of-order packets of the second before). "+
		"Per-sample series (t, goodput, cwnd, RTT, retransmissions, reordering counters, the reconfiguration's start and end) in details.disruption of the JSON",
		dl.Shaping, rec, x.ReconfigStart, x.ReconfigEnd, x.SACKNegotiated, x.CC, s.RttBeforeMs, s.RttWindowMaxMs, s.RttLastMs, x.MinRttUs,
		s.BeforeGbps, s.AfterGbps, s.LastGbps, s.AfterMinGbps, s.AfterMinAt, 1000*(s.AfterMinAt-x.ReconfigEnd),
		s.BeforeRatio, s.RetransBefore, s.RetransWindow, s.RtoWindow, s.RecoveryBins, s.RecoveryBinsBefore, s.LostWindowMax,
		s.RcvOooBefore, s.RcvOooWindow, s.DsackBefore, s.DsackWindow, s.ReordSeenWindow,
		s.CwndBefore, s.CwndBeforeMin, s.CwndAfterMin, s.CwndAfterMean, s.CwndAfterEnd,
		shaperText(x.Shapers), leftText(x.MB1LeftMs), x.MB1RewritesAfter, x.ClientRight, nproc)
	if len(x.Notes) > 0 {
		f.Note += "; " + strings.Join(x.Notes, "; ")
	}
	if len(x.Problems) > 0 {
		f.Note += "; PROBLEMS: " + strings.Join(x.Problems, "; ")
	}
	return f
}

// shaperText lists what each shaper sent and dropped.
func shaperText(m map[string]shaperDelta) string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	var out []string
	for _, k := range keys {
		d := m[k]
		out = append(out, fmt.Sprintf("%s sent %.1f MB in %d packets, dropped %d", k, float64(d.Bytes)/1e6, d.Packets, d.Drops))
	}
	if len(out) == 0 {
		return "no reading"
	}
	return strings.Join(out, ", ")
}

func leftText(ms float64) string {
	if ms < 0 {
		return "not within 10 s"
	}
	return fmt.Sprintf("%.0f ms", ms)
}
