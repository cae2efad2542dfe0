package experiment

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
	"io"
	"math"
	"net"
	"net/netip"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/dysco/dysco/internal/api"
	"github.com/dysco/dysco/internal/lab"
)

// disruptionPort is the server port of the SACK-on run; the SACK-off run
// uses the next one, so that the reconfiguration of each run matches its
// session alone.
const disruptionPort = 9600

// tcpiOptSACK is TCPI_OPT_SACK of tcpi_options (linux/tcp.h).
const tcpiOptSACK = 2

// disruptionBin is the sampling interval.
const disruptionBin = 50 * time.Millisecond

// disruptionWin is the length of the windows compared: the second before
// the reconfiguration, and the reconfiguration plus the second after it.
const disruptionWin = time.Second

// The shaping of the old path (mb1's link) and the sender's congestion
// control. 150 Mbit/s is a few per cent of what the unshaped path carries
// here (about 10 Gbit/s, CPU-bound); 40 ms of FIFO at that rate is 750 kB,
// less than the sender's socket buffer, so cubic can fill it.
const (
	disruptionRateMbit = 150
	disruptionBufferMs = 40
	disruptionBurst    = 32 << 10 // bytes: TBF's bucket, about 1.7 ms at the rate
	disruptionCC       = "cubic"
)

// disruptionShaping is the set-up of the old path's shaping, as installed.
type disruptionShaping struct {
	Qdisc    string `json:"qdisc"`
	RateMbit int    `json:"rate_mbit"`
	// BufferMs is the FIFO's length at the rate, LimitBytes the same in
	// bytes (TBF's limit), BurstBytes TBF's bucket.
	BufferMs   int `json:"buffer_ms"`
	LimitBytes int `json:"limit_bytes"`
	BurstBytes int `json:"burst_bytes"`
	// Ifaces are the shaped interfaces, "HOST:IFACE", each on its egress:
	// the router's towards mb1 (client→mb1 data, server→mb1 acks) and
	// mb1's (mb1→server data, mb1→client acks).
	Ifaces   []string `json:"ifaces"`
	Commands []string `json:"commands"`
	// CC is the sender's congestion control (TCP_CONGESTION on its socket).
	CC string `json:"congestion_control"`
	// Unshaped says what is not shaped.
	Unshaped string `json:"unshaped"`
}

func (sh *disruptionShaping) String() string {
	return fmt.Sprintf("old path (mb1's link) shaped with %s to %d Mbit/s, a %d ms FIFO (%d B), on %s; new path (mb2's link) unshaped; sender's congestion control %s",
		sh.Qdisc, sh.RateMbit, sh.BufferMs, sh.LimitBytes, strings.Join(sh.Ifaces, " and "), sh.CC)
}

// newDisruptionShaping is the shaping of the lab's old path: rate in
// Mbit/s, a FIFO of bufferMs at that rate, on the egress of each of
// ifaces ("HOST:IFACE").
func newDisruptionShaping(rateMbit, bufferMs, burst int, ifaces []string) *disruptionShaping {
	sh := &disruptionShaping{Qdisc: "tbf", RateMbit: rateMbit, BufferMs: bufferMs, BurstBytes: burst,
		LimitBytes: rateMbit * 1_000_000 / 8 * bufferMs / 1000, Ifaces: ifaces, CC: disruptionCC,
		Unshaped: "mb2's link, the client's and the server's"}
	for _, hi := range ifaces {
		host, ifc, _ := strings.Cut(hi, ":")
		sh.Commands = append(sh.Commands, fmt.Sprintf("ip netns exec LAB-%s %s", host, strings.Join(sh.tcArgv(ifc), " ")))
	}
	return sh
}

// tcArgv is the command that installs the shaper on an interface.
func (sh *disruptionShaping) tcArgv(ifc string) []string {
	return []string{"tc", "qdisc", "replace", "dev", ifc, "root", "tbf",
		"rate", fmt.Sprintf("%dmbit", sh.RateMbit), "burst", fmt.Sprint(sh.BurstBytes), "limit", fmt.Sprint(sh.LimitBytes)}
}

// shapeError explains a failure to install the shaper.
func shapeError(hostIface string, err error) error {
	msg := err.Error()
	if strings.Contains(msg, "qdisc kind is unknown") || strings.Contains(msg, "Unknown qdisc") {
		return fmt.Errorf("shaping the old path on %s: this kernel has no TBF qdisc (CONFIG_NET_SCH_TBF); the disruption experiment needs it to make the old path slower than the new one (there is no unshaped fallback): %w", hostIface, err)
	}
	return fmt.Errorf("shaping the old path on %s with TBF: %w", hostIface, err)
}

// shape installs the shaper on the old path's interfaces. Lab.Down
// removes the namespaces, and their qdiscs with them.
func (dl *disruptionLab) shape(ctx context.Context, sh *disruptionShaping) error {
	for _, hi := range sh.Ifaces {
		host, ifc, _ := strings.Cut(hi, ":")
		if _, err := run(ctx, dl.lab, host, 10*time.Second, sh.tcArgv(ifc)...); err != nil {
			return shapeError(hi, err)
		}
		st, err := dl.qdiscStats(ctx, hi)
		if err != nil {
			return err
		}
		if st.Kind != sh.Qdisc {
			return fmt.Errorf("shaping the old path on %s: the root qdisc is %q after installing %s", hi, st.Kind, sh.Qdisc)
		}
	}
	return nil
}

// qdiscStats is what `tc -s -j qdisc show` says of an interface's root
// qdisc.
type qdiscStats struct {
	Kind       string `json:"kind"`
	Root       bool   `json:"root"`
	Bytes      uint64 `json:"bytes"`
	Packets    uint64 `json:"packets"`
	Drops      uint64 `json:"drops"`
	Overlimits uint64 `json:"overlimits"`
	Backlog    uint64 `json:"backlog"`
	Qlen       uint64 `json:"qlen"`
}

// parseQdiscStats picks the root qdisc out of `tc -s -j qdisc show dev X`.
func parseQdiscStats(out string) (qdiscStats, error) {
	var all []qdiscStats
	if err := json.Unmarshal([]byte(out), &all); err != nil {
		return qdiscStats{}, fmt.Errorf("tc -s -j qdisc show: %w: %s", err, tail(out, 300))
	}
	for _, q := range all {
		if q.Root {
			return q, nil
		}
	}
	return qdiscStats{}, fmt.Errorf("tc -s -j qdisc show: no root qdisc in %s", tail(out, 300))
}

func (dl *disruptionLab) qdiscStats(ctx context.Context, hostIface string) (qdiscStats, error) {
	host, ifc, _ := strings.Cut(hostIface, ":")
	out, err := run(ctx, dl.lab, host, 10*time.Second, "tc", "-s", "-j", "qdisc", "show", "dev", ifc)
	if err != nil {
		return qdiscStats{}, err
	}
	return parseQdiscStats(out)
}

// shaperDelta is what a shaper did over a run.
type shaperDelta struct {
	Bytes      uint64 `json:"bytes"`
	Packets    uint64 `json:"packets"`
	Drops      uint64 `json:"drops"`
	Overlimits uint64 `json:"overlimits"`
}

func (dl *disruptionLab) shaperStats(ctx context.Context) (map[string]qdiscStats, error) {
	out := map[string]qdiscStats{}
	for _, hi := range dl.shaping.Ifaces {
		st, err := dl.qdiscStats(ctx, hi)
		if err != nil {
			return nil, err
		}
		out[hi] = st
	}
	return out, nil
}

func shaperDeltas(a, b map[string]qdiscStats) map[string]shaperDelta {
	out := map[string]shaperDelta{}
	for k, y := range b {
		x := a[k]
		out[k] = shaperDelta{Bytes: y.Bytes - x.Bytes, Packets: y.Packets - x.Packets, Drops: y.Drops - x.Drops, Overlimits: y.Overlimits - x.Overlimits}
	}
	return out
}

// disruptionLab is the star lab of the benchmark.
type disruptionLab struct {
	lab                   *lab.Lab
	client, mb1, mb2, srv netip.Addr
	shaping               *disruptionShaping
}

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

// disruptionPolicy is the client's policy for one run's port.
func disruptionPolicy(port int) string { return fmt.Sprintf("tcp dst port %d", port) }

// upDisruptionLab builds the star lab and installs the client's policies.
func upDisruptionLab(ctx context.Context, o *Options, set *labSet, prefix string, pr *progress) (_ *disruptionLab, err error) {
	cfg := lab.Config{Name: prefix + "ds", Topology: lab.Star("client", "mb1", "mb2", "server"), AgentBinary: o.Dysco}
	if len(o.AgentArgs) > 0 {
		args := o.AgentArgs
		cfg.AgentArgs = func(*lab.Host) []string { return args }
	}
	upCtx, cancel := context.WithTimeout(ctx, 90*time.Second)
	defer cancel()
	pr.logf("building lab %s (star client, mb1, mb2, server)", cfg.Name)
	l, err := lab.Up(upCtx, cfg)
	if err != nil {
		return nil, fmt.Errorf("lab %s: %w", cfg.Name, err)
	}
	set.add(l)
	dl := &disruptionLab{lab: l, client: l.Host("client").Addr4, mb1: l.Host("mb1").Addr4,
		mb2: l.Host("mb2").Addr4, srv: l.Host("server").Addr4}
	for _, sack := range []bool{true, false} {
		port := disruptionPortOf(sack)
		if _, err := dyscoCLI(ctx, o, l, "client", "policy", "add", "d"+sackName(sack), "--chain", dl.mb1.String(), disruptionPolicy(port)); err != nil {
			return nil, err
		}
	}
	// The old path's shaping: both ends of mb1's link to the router.
	var toMB1 string
	for _, ifc := range l.Host("router").Ifaces {
		if ifc.Peer == "mb1" {
			toMB1 = ifc.Name
		}
	}
	if toMB1 == "" {
		return nil, fmt.Errorf("lab %s: the router has no interface towards mb1", l.Name())
	}
	dl.shaping = newDisruptionShaping(disruptionRateMbit, disruptionBufferMs, disruptionBurst,
		[]string{"router:" + toMB1, "mb1:" + l.Host("mb1").Iface})
	pr.logf("shaping the old path: %s", dl.shaping)
	if err := dl.shape(ctx, dl.shaping); err != nil {
		return nil, fmt.Errorf("lab %s: %w", l.Name(), err)
	}
	for _, to := range []netip.Addr{dl.mb1, dl.mb2, dl.srv} {
		if err := l.Ping(ctx, "client", to); err != nil {
			return nil, fmt.Errorf("lab %s: the client does not reach %s: %w", l.Name(), to, err)
		}
	}
	return dl, nil
}

func disruptionPortOf(sack bool) int {
	if sack {
		return disruptionPort
	}
	return disruptionPort + 1
}

func sackName(sack bool) string {
	if sack {
		return "-sack-on"
	}
	return "-sack-off"
}

// disruptionSample is one 50 ms bin of the session. A bin is longer when
// the sampler runs late, never shorter than half of disruptionBin.
type disruptionSample struct {
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

// disruptionRun is one run: one session, one reconfiguration.
type disruptionRun struct {
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
	Samples       []disruptionSample   `json:"samples"`
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

func (x *disruptionRun) problem(format string, args ...any) {
	x.Problems = append(x.Problems, fmt.Sprintf(format, args...))
}

// disruptionSummary compares the second before the reconfiguration with
// the reconfiguration and the second after it. NaN: no bin in a window.
type disruptionSummary struct {
	// BeforeGbps is the goodput over the bins that ended in the second
	// before the reconfiguration started; BeforeMinGbps its smallest bin
	// (the noise of the steady state).
	BeforeGbps    float64 `json:"before_gbps"`
	BeforeMinGbps float64 `json:"before_min_bin_gbps"`
	BeforeBins    int     `json:"before_bins"`
	// AfterMinGbps is the smallest bin among those that ended after the
	// reconfiguration started and at most 1 s after it ended, at
	// AfterMinAt; AfterGbps the goodput over those bins.
	AfterGbps    float64 `json:"after_gbps"`
	AfterMinGbps float64 `json:"after_min_bin_gbps"`
	AfterMinAt   float64 `json:"after_min_bin_t"`
	AfterBins    int     `json:"after_bins"`
	// Ratio is AfterMinGbps / BeforeGbps, BeforeRatio BeforeMinGbps /
	// BeforeGbps (the same figure for the steady state).
	Ratio       float64 `json:"ratio"`
	BeforeRatio float64 `json:"before_ratio"`
	// Retransmissions in the second before and in the reconfiguration
	// window (from the last bin before it to the last bin of it).
	RetransBefore uint32 `json:"retrans_before"`
	RetransWindow uint32 `json:"retrans_window"`
	// Congestion window (segments): mean and smallest over the second
	// before, smallest and mean over the window, and at the end of the
	// window.
	CwndBefore    float64 `json:"cwnd_before"`
	CwndBeforeMin uint32  `json:"cwnd_before_min"`
	CwndAfterMin  uint32  `json:"cwnd_after_min"`
	CwndAfterMean float64 `json:"cwnd_after_mean"`
	CwndAfterEnd  uint32  `json:"cwnd_after_end"`
	// Out-of-order packets at the receiver, reordering events and
	// duplicate SACKs at the sender, during the second before and during
	// the window.
	RcvOooBefore    uint32 `json:"rcv_ooopack_before"`
	DsackBefore     uint32 `json:"dsack_dups_before"`
	RcvOooWindow    uint32 `json:"rcv_ooopack_window"`
	ReordSeenWindow uint32 `json:"reord_seen_window"`
	DsackWindow     uint32 `json:"dsack_dups_window"`
	// StallBins counts the bins of the window in which nothing arrived.
	StallBins int `json:"stall_bins"`
	// The sender's smoothed RTT (tcpi_rtt, ms): mean over the second
	// before (the old path), largest in the window, mean over the last
	// second of the sampling (the new path).
	RttBeforeMs    float64 `json:"rtt_before_ms"`
	RttWindowMaxMs float64 `json:"rtt_window_max_ms"`
	RttLastMs      float64 `json:"rtt_last_ms"`
	// LastGbps is the goodput over the bins of the last second of the
	// sampling that end after the window (the new path), LastBins their
	// number.
	LastGbps float64 `json:"last_gbps"`
	LastBins int     `json:"last_bins"`
	// In the window: bins in which the sender was in recovery or loss
	// (ca_state ≥ 3), retransmission timeouts, and the most segments the
	// sender had marked lost and SACKed at a sample.
	RecoveryBins  int    `json:"recovery_bins"`
	RtoWindow     uint32 `json:"rtos_window"`
	LostWindowMax uint32 `json:"lost_window_max"`
	SackedMax     uint32 `json:"sacked_window_max"`
	// RecoveryBinsBefore is the same count over the second before.
	RecoveryBinsBefore int `json:"recovery_bins_before"`
	// The sender's reordering degree (tcpi_reordering: how many segments
	// may overtake one before it counts as lost) at the last bin before
	// the reconfiguration and at the end of the window.
	ReorderingBefore uint32 `json:"reordering_before"`
	ReorderingAfter  uint32 `json:"reordering_after"`
}

// MarshalJSON writes NaN as null.
func (s disruptionSummary) MarshalJSON() ([]byte, error) {
	type plain disruptionSummary
	num := jsonNum
	return json.Marshal(struct {
		plain
		BeforeGbps    *float64 `json:"before_gbps"`
		BeforeMinGbps *float64 `json:"before_min_bin_gbps"`
		AfterGbps     *float64 `json:"after_gbps"`
		AfterMinGbps  *float64 `json:"after_min_bin_gbps"`
		AfterMinAt    *float64 `json:"after_min_bin_t"`
		Ratio         *float64 `json:"ratio"`
		BeforeRatio   *float64 `json:"before_ratio"`
		CwndBefore    *float64 `json:"cwnd_before"`
		CwndAfterMean *float64 `json:"cwnd_after_mean"`
		RttBeforeMs   *float64 `json:"rtt_before_ms"`
		RttLastMs     *float64 `json:"rtt_last_ms"`
		RttWindowMax  *float64 `json:"rtt_window_max_ms"`
		LastGbps      *float64 `json:"last_gbps"`
	}{plain(s), num(s.BeforeGbps), num(s.BeforeMinGbps), num(s.AfterGbps), num(s.AfterMinGbps), num(s.AfterMinAt),
		num(s.Ratio), num(s.BeforeRatio), num(s.CwndBefore), num(s.CwndAfterMean), num(s.RttBeforeMs), num(s.RttLastMs), num(s.RttWindowMaxMs), num(s.LastGbps)})
}

// summarizeDisruption computes the summary of samples for a
// reconfiguration from start to end (seconds, the samples' time base):
// the "before" bins end in (start-win, start], the "after" bins in (start,
// end+win], the "last" bins in the last win of the samples, after
// end+win.
func summarizeDisruption(samples []disruptionSample, start, end float64, win time.Duration) disruptionSummary {
	w := win.Seconds()
	nan := math.NaN()
	s := disruptionSummary{BeforeGbps: nan, BeforeMinGbps: nan, AfterGbps: nan, AfterMinGbps: nan, AfterMinAt: nan,
		Ratio: nan, BeforeRatio: nan, CwndBefore: nan, CwndAfterMean: nan, RttBeforeMs: nan, RttWindowMaxMs: nan, RttLastMs: nan, LastGbps: nan}
	lastT := 0.0
	if len(samples) > 0 {
		lastT = samples[len(samples)-1].T
	}
	var bRtt, lRtt, lSec float64
	var lBytes uint64
	// lastBefore is the last bin that ended before the window of "before"
	// (the base of its counters), lastIn the last bin of "before".
	var firstBefore, lastBefore, lastAfter = -1, -1, -1
	var bBytes, aBytes uint64
	var bSec, aSec, bCwnd, aCwnd float64
	prevT := 0.0
	for i, x := range samples {
		dt := x.T - prevT
		prevT = x.T
		switch {
		case x.T > start-w && x.T <= start:
			if firstBefore < 0 {
				firstBefore = i
			}
			lastBefore = i
			if s.BeforeBins == 0 || x.Cwnd < s.CwndBeforeMin {
				s.CwndBeforeMin = x.Cwnd
			}
			s.BeforeBins++
			bBytes += x.Bytes
			bSec += dt
			bCwnd += float64(x.Cwnd)
			bRtt += float64(x.RttUs) / 1000
			if x.CaState >= 3 {
				s.RecoveryBinsBefore++
			}
			if math.IsNaN(s.BeforeMinGbps) || x.Gbps < s.BeforeMinGbps {
				s.BeforeMinGbps = x.Gbps
			}
		case x.T > start && x.T <= end+w:
			lastAfter = i
			if s.AfterBins == 0 || x.Cwnd < s.CwndAfterMin {
				s.CwndAfterMin = x.Cwnd
			}
			s.AfterBins++
			aBytes += x.Bytes
			aSec += dt
			aCwnd += float64(x.Cwnd)
			if math.IsNaN(s.AfterMinGbps) || x.Gbps < s.AfterMinGbps {
				s.AfterMinGbps, s.AfterMinAt = x.Gbps, x.T
			}
			if x.Bytes == 0 {
				s.StallBins++
			}
			if x.CaState >= 3 {
				s.RecoveryBins++
			}
			if r := float64(x.RttUs) / 1000; math.IsNaN(s.RttWindowMaxMs) || r > s.RttWindowMaxMs {
				s.RttWindowMaxMs = r
			}
			s.LostWindowMax = max(s.LostWindowMax, x.Lost)
			s.SackedMax = max(s.SackedMax, x.Sacked)
		case x.T > end+w && x.T > lastT-w:
			s.LastBins++
			lBytes += x.Bytes
			lSec += dt
			lRtt += float64(x.RttUs) / 1000
		}
	}
	if s.LastBins > 0 && lSec > 0 {
		s.LastGbps = float64(lBytes) * 8 / lSec / 1e9
		s.RttLastMs = lRtt / float64(s.LastBins)
	}
	if s.BeforeBins > 0 && bSec > 0 {
		s.BeforeGbps = float64(bBytes) * 8 / bSec / 1e9
		s.CwndBefore = bCwnd / float64(s.BeforeBins)
		s.RttBeforeMs = bRtt / float64(s.BeforeBins)
		s.BeforeRatio = ratio(s.BeforeMinGbps, s.BeforeGbps)
		base := samples[lastBefore]
		var b0 disruptionSample // counters start at zero
		if firstBefore > 0 {
			b0 = samples[firstBefore-1]
		}
		s.RetransBefore = base.Retrans - b0.Retrans
		s.RcvOooBefore = base.RcvOoo - b0.RcvOoo
		s.ReorderingBefore = base.Reordering
		s.DsackBefore = base.DsackDups - b0.DsackDups
	}
	if s.AfterBins > 0 && aSec > 0 {
		s.AfterGbps = float64(aBytes) * 8 / aSec / 1e9
		s.CwndAfterMean = aCwnd / float64(s.AfterBins)
		a := samples[lastAfter]
		s.CwndAfterEnd = a.Cwnd
		s.ReorderingAfter = a.Reordering
		var base disruptionSample
		if lastBefore >= 0 {
			base = samples[lastBefore]
		} else if i := lastAfter - s.AfterBins; i >= 0 {
			base = samples[i]
		}
		s.RetransWindow = a.Retrans - base.Retrans
		s.RcvOooWindow = a.RcvOoo - base.RcvOoo
		s.ReordSeenWindow = a.ReordSeen - base.ReordSeen
		s.DsackWindow = a.DsackDups - base.DsackDups
		s.RtoWindow = a.Rtos - base.Rtos
	}
	if !math.IsNaN(s.BeforeGbps) && !math.IsNaN(s.AfterMinGbps) {
		s.Ratio = ratio(s.AfterMinGbps, s.BeforeGbps)
	}
	return s
}

// tcpInfo reads TCP_INFO of a connection.
func tcpInfo(c *net.TCPConn) (*unix.TCPInfo, error) {
	rc, err := c.SyscallConn()
	if err != nil {
		return nil, err
	}
	var ti *unix.TCPInfo
	var serr error
	if err := rc.Control(func(fd uintptr) {
		ti, serr = unix.GetsockoptTCPInfo(int(fd), unix.IPPROTO_TCP, unix.TCP_INFO)
	}); err != nil {
		return nil, err
	}
	return ti, serr
}

// dialCC connects from host's namespace to dst with the congestion control
// cc set on the socket before the SYN (TCP_CONGESTION).
func dialCC(ctx context.Context, l *lab.Lab, host, dst, cc string) (net.Conn, error) {
	var c net.Conn
	err := l.Do(host, func() (err error) {
		d := net.Dialer{Control: func(_, _ string, rc syscall.RawConn) error {
			var serr error
			if err := rc.Control(func(fd uintptr) {
				serr = unix.SetsockoptString(int(fd), unix.IPPROTO_TCP, unix.TCP_CONGESTION, cc)
			}); err != nil {
				return err
			}
			if serr != nil {
				return fmt.Errorf("TCP_CONGESTION %s: %w (net.ipv4.tcp_available_congestion_control lists what the kernel has)", cc, serr)
			}
			return nil
		}}
		c, err = d.DialContext(ctx, "tcp", dst)
		return err
	})
	return c, err
}

// congestionControl reads a connection's congestion control.
func congestionControl(c *net.TCPConn) (string, error) {
	rc, err := c.SyscallConn()
	if err != nil {
		return "", err
	}
	var cc string
	var serr error
	if err := rc.Control(func(fd uintptr) {
		cc, serr = unix.GetsockoptString(int(fd), unix.IPPROTO_TCP, unix.TCP_CONGESTION)
	}); err != nil {
		return "", err
	}
	return strings.TrimRight(cc, "\x00"), serr
}

// setSACK sets net.ipv4.tcp_sack in the client's and the server's
// namespaces and returns a function that puts the old values back.
func (dl *disruptionLab) setSACK(ctx context.Context, on bool) (restore func() error, err error) {
	val := "0"
	if on {
		val = "1"
	}
	old := map[string]string{}
	restore = func() error {
		var errs []error
		for h, v := range old {
			rctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
			_, err := run(rctx, dl.lab, h, 10*time.Second, "sysctl", "-w", "net.ipv4.tcp_sack="+v)
			cancel()
			errs = append(errs, err)
		}
		return errors.Join(errs...)
	}
	for _, h := range []string{"client", "server"} {
		out, err := run(ctx, dl.lab, h, 10*time.Second, "sysctl", "-n", "net.ipv4.tcp_sack")
		if err != nil {
			return restore, err
		}
		old[h] = strings.TrimSpace(out)
		if _, err := run(ctx, dl.lab, h, 10*time.Second, "sysctl", "-w", "net.ipv4.tcp_sack="+val); err != nil {
			return restore, err
		}
	}
	return restore, nil
}

// reconfigArgv is the reconfiguration of a run: mb1 replaced by mb2.
func (dl *disruptionLab) reconfigArgv(o *Options, port int) []string {
	return []string{o.Dysco, "reconfig", "--json", "--match", fmt.Sprintf("tcp port %d", port), "--to", dl.srv.String(), "--chain", dl.mb2.String()}
}

// sessionsOf lists a host's sessions whose tuple ends in the port.
func (dl *disruptionLab) sessionsOf(ctx context.Context, o *Options, host string, port int) ([]api.Session, error) {
	out, err := dyscoCLI(ctx, o, dl.lab, host, "sessions", "-o", "json")
	if err != nil {
		return nil, err
	}
	var all []api.Session
	if err := json.Unmarshal([]byte(out), &all); err != nil {
		return nil, fmt.Errorf("dysco sessions on %s: %w: %s", host, err, tail(out, 300))
	}
	var mine []api.Session
	for _, s := range all {
		if strings.HasSuffix(s.Session, fmt.Sprintf(":%d", port)) {
			mine = append(mine, s)
		}
	}
	return mine, nil
}

// once runs one session with SACK on or off and reconfigures it. Problems
// of the product (the reconfiguration fails, the session stalls or breaks)
// go to x.Problems; the error is for what stops the run.
func (dl *disruptionLab) once(ctx context.Context, o *Options, sack bool, pr *progress) (x *disruptionRun, err error) {
	port := disruptionPortOf(sack)
	what := "SACK" + strings.ReplaceAll(sackName(sack), "-sack-", " ")
	x = &disruptionRun{SACK: sack, Port: port, Policy: fmt.Sprintf("dysco policy add d%s --chain %s '%s'", sackName(sack), dl.mb1, disruptionPolicy(port)),
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
	st1, err := agentStatus(ctx, o, dl.lab, "mb1")
	if err != nil {
		return x, err
	}
	st2, err := agentStatus(ctx, o, dl.lab, "mb2")
	if err != nil {
		return x, err
	}
	sh0, err := dl.shaperStats(ctx)
	if err != nil {
		return x, err
	}

	// The session: the runner's receiver on the server, its sender on the
	// client.
	dst := netip.AddrPortFrom(dl.srv, uint16(port)).String()
	ln, err := dl.lab.Listen("server", "tcp", dst)
	if err != nil {
		return x, fmt.Errorf("lab %s: listening on the server: %w", dl.lab.Name(), err)
	}
	defer ln.Close()
	accepted := make(chan net.Conn, 1)
	go func() {
		c, err := ln.Accept()
		if err != nil {
			close(accepted)
			return
		}
		accepted <- c
	}()
	dctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	sc, err := dialCC(dctx, dl.lab, "client", dst, disruptionCC)
	cancel()
	if err != nil {
		return x, fmt.Errorf("lab %s: dialling %s through mb1: %w", dl.lab.Name(), dst, err)
	}
	var rc net.Conn
	select {
	case c, ok := <-accepted:
		if !ok {
			sc.Close()
			return x, errors.New("accepting the session on the server failed")
		}
		rc = c
	case <-time.After(10 * time.Second):
		sc.Close()
		return x, fmt.Errorf("the server did not accept the session to %s in 10 s", dst)
	}
	snd, rcv := sc.(*net.TCPConn), rc.(*net.TCPConn)
	x.Session = fmt.Sprintf("%s -> %s", snd.LocalAddr(), snd.RemoteAddr())
	var stopped atomic.Bool
	var wg sync.WaitGroup
	var errMu sync.Mutex
	fail := func(side string, err error) {
		if stopped.Load() {
			return
		}
		errMu.Lock()
		x.SessionErrs = append(x.SessionErrs, fmt.Sprintf("%s: %v", side, err))
		errMu.Unlock()
	}
	var appRx atomic.Int64
	stop := func() {
		if stopped.Swap(true) {
			return
		}
		// RST: no FIN exchange, no TIME_WAIT.
		snd.SetLinger(0)
		rcv.SetLinger(0)
		snd.Close()
		rcv.Close()
		done := make(chan struct{})
		go func() { wg.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(10 * time.Second):
		}
	}
	defer stop()
	wg.Add(2)
	go func() {
		defer wg.Done()
		for !stopped.Load() {
			if _, err := snd.Write(payload); err != nil {
				fail("sender write", err)
				return
			}
		}
	}()
	go func() {
		defer wg.Done()
		buf := make([]byte, 256<<10)
		for {
			n, err := rcv.Read(buf)
			appRx.Add(int64(n))
			if err != nil {
				if err == io.EOF {
					err = errors.New("closed by the peer")
				}
				fail("receiver read", err)
				return
			}
		}
	}()
	if ti, err := tcpInfo(snd); err == nil {
		x.SACKNegotiated = ti.Options&tcpiOptSACK != 0
	}
	if x.CC, err = congestionControl(snd); err != nil {
		return x, fmt.Errorf("reading the sender's congestion control: %w", err)
	}
	if x.CC != disruptionCC {
		return x, fmt.Errorf("the sender's congestion control is %q, not %q", x.CC, disruptionCC)
	}
	pr.logf("disruption, %s: session %s through mb1, sending for %v, mb1 replaced by mb2 at %v", what, x.Session, o.DisruptionTime, disruptionAt(o))

	// Sampling, and the reconfiguration at disruptionAt.
	t0 := time.Now()
	since := func(t time.Time) float64 { return t.Sub(t0).Seconds() }
	at := disruptionAt(o)
	recDone := make(chan struct{})
	started := false
	var recOut string
	var recErr error
	var recStart, recEnd time.Time
	var prev disruptionSample
	var prevApp int64
	if ri, err := tcpInfo(rcv); err == nil {
		prev.Bytes = ri.Bytes_received // cumulative, the base of the first bin
	}
	prevApp = appRx.Load()
	tick := time.NewTicker(disruptionBin)
	defer tick.Stop()
	var sampleErr error
	for time.Since(t0) < o.DisruptionTime {
		select {
		case <-ctx.Done():
			return x, ctx.Err()
		case <-tick.C:
		}
		now := time.Now()
		if since(now)-prev.T < disruptionBin.Seconds()/2 {
			// The ticker's buffered tick right after a late one (this
			// process was not scheduled in time): a bin of a few ms
			// would be an empty "dip" that only the sampler made.
			continue
		}
		si, err1 := tcpInfo(snd)
		ri, err2 := tcpInfo(rcv)
		app := appRx.Load()
		if err := errors.Join(err1, err2); err != nil {
			sampleErr = err
			break
		}
		s := disruptionSample{T: since(now), Bytes: ri.Bytes_received - prev.Bytes, AppBytes: app - prevApp,
			Cwnd: si.Snd_cwnd, Ssthresh: si.Snd_ssthresh, Retrans: si.Total_retrans, RttUs: si.Rtt, CaState: si.Ca_state,
			ReordSeen: si.Reord_seen, DsackDups: si.Dsack_dups, RcvOoo: ri.Rcv_ooopack,
			Unacked: si.Unacked, Sacked: si.Sacked, Lost: si.Lost, Reordering: si.Reordering, Rtos: uint32(si.Total_rto)}
		if dt := s.T - prev.T; dt > 0 {
			s.Gbps = float64(s.Bytes) * 8 / dt / 1e9
		}
		// prev.Bytes holds the cumulative count for the next bin.
		prevApp = app
		x.Samples = append(x.Samples, s)
		prev = s
		prev.Bytes = ri.Bytes_received
		if !started && time.Since(t0) >= at {
			started = true
			x.ReconfigAt = since(time.Now())
			go func() {
				defer close(recDone)
				recStart = time.Now()
				recOut, recErr = run(ctx, dl.lab, "client", 30*time.Second, x.ReconfigArgv...)
				recEnd = time.Now()
			}()
		}
	}
	if !started {
		return x, fmt.Errorf("sampling stopped before the reconfiguration (%v)", sampleErr)
	}
	<-recDone
	x.ReconfigStart, x.ReconfigEnd = since(recStart), since(recEnd)
	if sampleErr != nil {
		x.problem("TCP_INFO could not be read after %.2f s: %v (the session's sockets are gone)", since(time.Now()), sampleErr)
	}
	var rep api.ReconfigReply
	if jerr := json.Unmarshal([]byte(recOut), &rep); jerr != nil {
		x.ReconfigErr = fmt.Sprintf("%v; output not JSON: %v", recErr, jerr)
		x.problem("reconfiguration: %s", x.ReconfigErr)
	} else {
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
	if ti, err := tcpInfo(snd); err == nil {
		x.MinRttUs = ti.Min_rtt
	}
	sum := summarizeDisruption(x.Samples, x.ReconfigStart, x.ReconfigEnd, disruptionWin)
	x.Summary = &sum
	micros := "–"
	if len(x.Results) == 1 {
		micros = fmt.Sprintf("%s in %.2f ms", x.Results[0].Outcome, float64(x.Results[0].Micros)/1000)
	}
	pr.logf("disruption, %s: reconfiguration %s (command %.3f–%.3f s); goodput %.2f Gbit/s in the second before, smallest 50 ms bin after %.2f Gbit/s at %.2f s (%.2f ×; before: %.2f ×), %d retransmissions in the window, cwnd %.0f → min %d",
		what, micros, x.ReconfigStart, x.ReconfigEnd, sum.BeforeGbps, sum.AfterMinGbps, sum.AfterMinAt, sum.Ratio, sum.BeforeRatio, sum.RetransWindow, sum.CwndBefore, sum.CwndAfterMin)

	// Checks, data still flowing: the session still carries data, mb1
	// left its path, mb2 carried it, the client's path goes to mb2.
	var last []disruptionSample
	for _, s := range x.Samples {
		if s.T > o.DisruptionTime.Seconds()-disruptionWin.Seconds() {
			last = append(last, s)
		}
	}
	var lastBytes uint64
	for _, s := range last {
		lastBytes += s.Bytes
	}
	if lastBytes == 0 {
		x.problem("the session stalled: nothing received in the last %v of the sampling", disruptionWin)
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
		s, err := dl.sessionsOf(ctx, o, "mb1", port)
		if err != nil {
			return x, err
		}
		if len(s) == 0 {
			x.MB1LeftMs = float64(time.Since(tl).Microseconds()) / 1000
			break
		}
		if time.Since(tl) > 10*time.Second {
			x.problem("mb1's agent still has the session 10 s after the sampling (%s, lock %s, reconfig %q)", s[0].State, s[0].Lock, s[0].Reconfig)
			break
		}
		if err := sleepCtx(ctx, 200*time.Millisecond); err != nil {
			return x, err
		}
	}
	a, err := agentStatus(ctx, o, dl.lab, "mb1")
	if err != nil {
		return x, err
	}
	rx0 := appRx.Load()
	if err := sleepCtx(ctx, time.Second); err != nil {
		return x, err
	}
	b, err := agentStatus(ctx, o, dl.lab, "mb1")
	if err != nil {
		return x, err
	}
	x.MB1RewritesAfter = proxyRewrites(b) - proxyRewrites(a)
	if appRx.Load() <= rx0 {
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
	e1, err := agentStatus(ctx, o, dl.lab, "mb1")
	if err != nil {
		return x, err
	}
	e2, err := agentStatus(ctx, o, dl.lab, "mb2")
	if err != nil {
		return x, err
	}
	x.MB1Counters, x.MB2Counters = counterDelta(st1, e1), counterDelta(st2, e2)
	sh1, err := dl.shaperStats(ctx)
	if err != nil {
		return x, err
	}
	x.Shapers = shaperDeltas(sh0, sh1)
	if rewritesOf(x.MB1Counters) == 0 {
		x.problem("mb1's datapath rewrote no packet: the session did not take the chain")
	}
	if rewritesOf(x.MB2Counters) == 0 {
		x.problem("mb2's datapath rewrote no packet: the session never went through mb2")
	}
	for h, c := range map[string]map[string]uint64{"mb1": x.MB1Counters, "mb2": x.MB2Counters} {
		if d := drops(c); len(d) > 0 {
			x.Notes = append(x.Notes, fmt.Sprintf("%s's datapath dropped packets: %v", h, d))
		}
	}
	stop()
	errMu.Lock()
	if len(x.SessionErrs) > 0 {
		x.problem("session errors: %s", strings.Join(x.SessionErrs, "; "))
	}
	errMu.Unlock()
	return x, nil
}

// disruptionDetails is the raw data of the benchmark.
type disruptionDetails struct {
	BinMs      int64   `json:"bin_ms"`
	WindowMs   int64   `json:"window_ms"`
	DurationS  float64 `json:"duration_s"`
	ReconfigAt float64 `json:"reconfig_at_s"`
	// Shaping is the old path's shaping and the sender's congestion
	// control.
	Shaping *disruptionShaping `json:"shaping"`
	Runs    []*disruptionRun   `json:"runs"`
}

// benchDisruption runs the session with SACK on, then off, and adds a
// figure for each.
func benchDisruption(ctx context.Context, o *Options, dl *disruptionLab, r *Report, pr *progress) (err error) {
	det := &disruptionDetails{BinMs: disruptionBin.Milliseconds(), WindowMs: disruptionWin.Milliseconds(),
		DurationS: o.DisruptionTime.Seconds(), ReconfigAt: disruptionAt(o).Seconds(), Shaping: dl.shaping}
	r.Details["disruption"] = det
	defer func() {
		if err != nil {
			if dir, lerr := saveLabLogs(dl.lab, filepath.Join(o.OutDir, r.RunID+"-disruption-logs")); lerr == nil {
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
func disruptionFigure(o *Options, dl *disruptionLab, x *disruptionRun, nproc int) *Figure {
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
		rec += "; command: " + strings.ReplaceAll(tail(x.ReconfigErr, 300), "\n", " ")
	}
	f := &Figure{
		Key:  "disruption-sack-" + name,
		Name: fmt.Sprintf("one session's goodput across a live reconfiguration (mb1 replaced by mb2, the new path faster), SACK %s", name),
		Command: fmt.Sprintf("%s; %s; runner: 1 session LAB-client → %s:%d (TCP_CONGESTION %s) sending as fast as TCP lets for %v, TCP_INFO every %v; at %v: ip netns exec LAB-client dysco reconfig --json --match 'tcp port %d' --to %s --chain %s",
			strings.Join(dl.shaping.Commands, "; "), x.Policy, dl.srv, x.Port, dl.shaping.CC, o.DisruptionTime, disruptionBin, disruptionAt(o), x.Port, dl.srv, dl.mb2),
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
		dl.shaping, rec, x.ReconfigStart, x.ReconfigEnd, x.SACKNegotiated, x.CC, s.RttBeforeMs, s.RttWindowMaxMs, s.RttLastMs, x.MinRttUs,
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
