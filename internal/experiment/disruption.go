package experiment

// Benchmark "disruption": what a live reconfiguration does to one TCP
// session (paper §5.3, Figure 14: goodput and congestion window of a session
// across a reconfiguration, SACK on and off). Its own lab, a star of client,
// mb1, mb2 and server with an agent on each; the client's policy chains the
// session through mb1. The runner is both ends: it dials from the client's
// namespace and sends as fast as TCP lets, and receives on the server's.
// Every 50 ms it samples the receiver's bytes received (TCP_INFO
// tcpi_bytes_received: the goodput of the bin) and the sender's congestion
// window and retransmissions (TCP_INFO tcpi_snd_cwnd, tcpi_total_retrans).
// Part-way through, it replaces mb1 by mb2 in the live session at the
// client (`dysco reconfig --match 'tcp port P' --to SERVER --chain MB2`).
// Once with SACK on (the default), once with SACK off in the client's and
// the server's namespaces (net.ipv4.tcp_sack is per namespace). The lab has
// no netem: the path has the delay of veths and eBPF, nothing added.

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
	"strings"
	"sync"
	"sync/atomic"
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

// disruptionLab is the star lab of the benchmark.
type disruptionLab struct {
	lab                   *lab.Lab
	client, mb1, mb2, srv netip.Addr
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

// disruptionSample is one 50 ms bin of the session.
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
	// reordering events seen and duplicate SACKs so far.
	Cwnd      uint32 `json:"cwnd"`
	Ssthresh  uint32 `json:"ssthresh"`
	Retrans   uint32 `json:"retrans"`
	RttUs     uint32 `json:"rtt_us"`
	CaState   uint8  `json:"ca_state"`
	ReordSeen uint32 `json:"reord_seen"`
	DsackDups uint32 `json:"dsack_dups"`
	// RcvOoo is the receiver's out-of-order packets so far
	// (tcpi_rcv_ooopack).
	RcvOoo uint32 `json:"rcv_ooopack"`
}

// disruptionRun is one run: one session, one reconfiguration.
type disruptionRun struct {
	SACK bool `json:"sack"`
	// SACKNegotiated is whether the session's handshake agreed on SACK
	// (the sender's tcpi_options).
	SACKNegotiated bool   `json:"sack_negotiated"`
	Port           int    `json:"port"`
	Session        string `json:"session,omitempty"`
	Policy         string `json:"policy"`
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
	}{plain(s), num(s.BeforeGbps), num(s.BeforeMinGbps), num(s.AfterGbps), num(s.AfterMinGbps), num(s.AfterMinAt),
		num(s.Ratio), num(s.BeforeRatio), num(s.CwndBefore), num(s.CwndAfterMean)})
}

// summarizeDisruption computes the summary of samples for a
// reconfiguration from start to end (seconds, the samples' time base):
// the "before" bins end in (start-win, start], the "after" bins in (start,
// end+win].
func summarizeDisruption(samples []disruptionSample, start, end float64, win time.Duration) disruptionSummary {
	w := win.Seconds()
	nan := math.NaN()
	s := disruptionSummary{BeforeGbps: nan, BeforeMinGbps: nan, AfterGbps: nan, AfterMinGbps: nan, AfterMinAt: nan,
		Ratio: nan, BeforeRatio: nan, CwndBefore: nan, CwndAfterMean: nan}
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
		}
	}
	if s.BeforeBins > 0 && bSec > 0 {
		s.BeforeGbps = float64(bBytes) * 8 / bSec / 1e9
		s.CwndBefore = bCwnd / float64(s.BeforeBins)
		s.BeforeRatio = ratio(s.BeforeMinGbps, s.BeforeGbps)
		base := samples[lastBefore]
		var b0 disruptionSample // counters start at zero
		if firstBefore > 0 {
			b0 = samples[firstBefore-1]
		}
		s.RetransBefore = base.Retrans - b0.Retrans
		s.RcvOooBefore = base.RcvOoo - b0.RcvOoo
		s.DsackBefore = base.DsackDups - b0.DsackDups
	}
	if s.AfterBins > 0 && aSec > 0 {
		s.AfterGbps = float64(aBytes) * 8 / aSec / 1e9
		s.CwndAfterMean = aCwnd / float64(s.AfterBins)
		a := samples[lastAfter]
		s.CwndAfterEnd = a.Cwnd
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
	sc, err := dl.lab.Dial(dctx, "client", "tcp", dst)
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
		si, err1 := tcpInfo(snd)
		ri, err2 := tcpInfo(rcv)
		app := appRx.Load()
		if err := errors.Join(err1, err2); err != nil {
			sampleErr = err
			break
		}
		s := disruptionSample{T: since(now), Bytes: ri.Bytes_received - prev.Bytes, AppBytes: app - prevApp,
			Cwnd: si.Snd_cwnd, Ssthresh: si.Snd_ssthresh, Retrans: si.Total_retrans, RttUs: si.Rtt, CaState: si.Ca_state,
			ReordSeen: si.Reord_seen, DsackDups: si.Dsack_dups, RcvOoo: ri.Rcv_ooopack}
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
	BinMs      int64            `json:"bin_ms"`
	WindowMs   int64            `json:"window_ms"`
	DurationS  float64          `json:"duration_s"`
	ReconfigAt float64          `json:"reconfig_at_s"`
	Runs       []*disruptionRun `json:"runs"`
}

// benchDisruption runs the session with SACK on, then off, and adds a
// figure for each.
func benchDisruption(ctx context.Context, o *Options, dl *disruptionLab, r *Report, pr *progress) (err error) {
	det := &disruptionDetails{BinMs: disruptionBin.Milliseconds(), WindowMs: disruptionWin.Milliseconds(),
		DurationS: o.DisruptionTime.Seconds(), ReconfigAt: disruptionAt(o).Seconds()}
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
		Name: fmt.Sprintf("one session's goodput across a live reconfiguration (mb1 replaced by mb2), SACK %s", name),
		Command: fmt.Sprintf("%s; runner: 1 session LAB-client → %s:%d sending as fast as TCP lets for %v, TCP_INFO every %v; at %v: ip netns exec LAB-client dysco reconfig --json --match 'tcp port %d' --to %s --chain %s",
			x.Policy, dl.srv, x.Port, o.DisruptionTime, disruptionBin, disruptionAt(o), x.Port, dl.srv, dl.mb2),
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
	f.Note = fmt.Sprintf("reconfiguration %s, command from %.3f s to %.3f s after the session started; "+
		"SACK negotiated: %v; goodput (receiver's tcpi_bytes_received per bin) %.2f Gbit/s over the second before, %.2f Gbit/s over the reconfiguration and the second after it, smallest bin there %.2f Gbit/s at %.2f s (%+.0f ms from the command's return); "+
		"for scale, the smallest bin of the second before was %.2f × its mean; "+
		"sender's retransmissions (tcpi_total_retrans) %d in the second before, %d in the reconfiguration window; "+
		"cwnd (segments) mean %.0f, min %d in the second before → min %d, mean %.0f, %d at the end of the window; "+
		"receiver's out-of-order packets %d in the second before, %d in the window; sender's DSACKs %d before, %d in the window (reordering events in the window %d); "+
		"mb1's agent dropped the session %s after the sampling and its datapath rewrote %d packets in the second after; client's subsession afterwards %q. "+
		"One run, one session: the lab has no netem (no added delay or loss: RTT of veths and eBPF, tens to hundreds of µs), so a dip of a few ms can hide in a 50 ms bin; "+
		"the session is never cwnd-limited at such RTTs, and Linux's cwnd swings by an order of magnitude from sample to sample without any loss, so cwnd says little about its rate here; "+
		"the lab reorders packets without any reconfiguration (the receiver's out-of-order packets of the second before), and with SACK on Linux answers reordering with spurious retransmissions (DSACKs ≈ retransmissions); "+
		"the sender, the receiver (both the runner), the datapaths of every host, the agents running the reconfiguration and the `dysco` command itself share the machine's %d vCPUs, so goodput is CPU-bound and a dip may come from CPU contention rather than from TCP. "+
		"Per-sample series (t, goodput, cwnd, retransmissions, the reconfiguration's start and end) in details.disruption of the JSON",
		rec, x.ReconfigStart, x.ReconfigEnd, x.SACKNegotiated, s.BeforeGbps, s.AfterGbps, s.AfterMinGbps, s.AfterMinAt, 1000*(s.AfterMinAt-x.ReconfigEnd),
		s.BeforeRatio, s.RetransBefore, s.RetransWindow, s.CwndBefore, s.CwndBeforeMin, s.CwndAfterMin, s.CwndAfterMean, s.CwndAfterEnd,
		s.RcvOooBefore, s.RcvOooWindow, s.DsackBefore, s.DsackWindow, s.ReordSeenWindow, leftText(x.MB1LeftMs), x.MB1RewritesAfter, x.ClientRight, nproc)
	if len(x.Notes) > 0 {
		f.Note += "; " + strings.Join(x.Notes, "; ")
	}
	if len(x.Problems) > 0 {
		f.Note += "; PROBLEMS: " + strings.Join(x.Problems, "; ")
	}
	return f
}

func leftText(ms float64) string {
	if ms < 0 {
		return "not within 10 s"
	}
	return fmt.Sprintf("%.0f ms", ms)
}
