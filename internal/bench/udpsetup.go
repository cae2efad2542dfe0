package bench

// The set-up latency of a UDP session: the first request/response
// exchange of a new five-tuple, whose request carries the address-list
// block and sets up each hop's state in BPF before the middlebox sees it
// (docs/architecture.md, "UDP sessions"), against the baseline's, and the
// session's second exchange as the control.

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"net/netip"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"

	"github.com/dysco/dysco/internal/lab"
	"github.com/dysco/dysco/internal/labkit"
)

// udpSetupWarmup sessions per lab are made and thrown away first.
const udpSetupWarmup = 20

// udpPayload is the size of the request and of the echoed response.
const udpPayload = 64

// udpPorts hands out client source ports, so that every session of a
// run is a new five-tuple (an ephemeral port could come back while the
// Dysco lab still holds the session of its last use).
var udpPorts atomic.Uint32

func nextUDPPort() int {
	const lo, n = 20000, 40000
	return lo + int(udpPorts.Add(1)%n)
}

// echoServer is a UDP echo server on a blocking socket in a lab host.
type echoServer struct {
	fd   int
	stop atomic.Bool
	wg   sync.WaitGroup
}

// startEcho starts a UDP echo server at ap in host of l.
func startEcho(l *lab.Lab, host string, ap netip.AddrPort) (*echoServer, error) {
	e := &echoServer{fd: -1}
	err := l.Do(host, func() error {
		fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
		if err != nil {
			return err
		}
		e.fd = fd
		if err := unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &unix.Timeval{Usec: 100_000}); err != nil {
			return err
		}
		return unix.Bind(fd, &unix.SockaddrInet4{Port: int(ap.Port()), Addr: ap.Addr().As4()})
	})
	if err != nil {
		if e.fd >= 0 {
			unix.Close(e.fd)
		}
		return nil, fmt.Errorf("udp echo server in lab %s: %w", l.Name(), err)
	}
	e.wg.Add(1)
	go func() {
		defer e.wg.Done()
		buf := make([]byte, 2048)
		for !e.stop.Load() {
			n, from, err := unix.Recvfrom(e.fd, buf, 0)
			if err != nil {
				continue // timeout (EAGAIN) or EINTR: check stop
			}
			_ = unix.Sendto(e.fd, buf[:n], 0, from)
		}
	}()
	return e, nil
}

func (e *echoServer) Close() {
	e.stop.Store(true)
	e.wg.Wait()
	unix.Close(e.fd)
}

// udpSessions opens n new UDP sessions (a new source port each) from the
// client of l to dst, one after the other, on an OS thread in the
// client's namespace, and makes exch request/response exchanges on each.
// It returns the time of each exchange in µs, by exchange (t[0] the
// first exchanges of all sessions), and the exchanges that got no answer
// within a second (lost).
func udpSessions(ctx context.Context, l *lab.Lab, dst netip.AddrPort, n, exch int) (t [][]float64, lost int, err error) {
	t = make([][]float64, exch)
	sa := &unix.SockaddrInet4{Port: int(dst.Port()), Addr: dst.Addr().As4()}
	req, resp := make([]byte, udpPayload), make([]byte, 2048)
	err = l.Do("client", func() error {
		for i := 0; i < n; i++ {
			if err := ctx.Err(); err != nil {
				return err
			}
			fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
			if err != nil {
				return fmt.Errorf("socket: %w", err)
			}
			err = func() error {
				defer unix.Close(fd)
				if err := unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &unix.Timeval{Sec: 1}); err != nil {
					return err
				}
				bound := false
				for try := 0; try < 100 && !bound; try++ {
					err := unix.Bind(fd, &unix.SockaddrInet4{Port: nextUDPPort()})
					if err == nil {
						bound = true
					} else if !errors.Is(err, unix.EADDRINUSE) {
						return fmt.Errorf("bind: %w", err)
					}
				}
				if !bound {
					return errors.New("bind: no free source port in 100 tries")
				}
				if err := unix.Connect(fd, sa); err != nil {
					return fmt.Errorf("connect: %w", err)
				}
				for x := 0; x < exch; x++ {
					binary.BigEndian.PutUint64(req, uint64(i)<<16|uint64(x))
					t0 := time.Now()
					if _, err := unix.Write(fd, req); err != nil {
						return fmt.Errorf("send: %w", err)
					}
					for {
						m, err := unix.Read(fd, resp)
						if errors.Is(err, unix.EINTR) {
							continue
						}
						if errors.Is(err, unix.EAGAIN) {
							lost++
							return nil // this session is over
						}
						if err != nil {
							return fmt.Errorf("receive: %w", err)
						}
						if m != udpPayload || binary.BigEndian.Uint64(resp) != binary.BigEndian.Uint64(req) {
							continue // a late answer to an earlier request
						}
						break
					}
					t[x] = append(t[x], float64(time.Since(t0).Nanoseconds())/1e3)
				}
				return nil
			}()
			if err != nil {
				return fmt.Errorf("udp session %d/%d to %s: %w", i+1, n, dst, err)
			}
		}
		return nil
	})
	return t, lost, err
}

// UDPSetupResult is the raw data of one UDP set-up comparison.
type UDPSetupResult struct {
	Middleboxes int `json:"middleboxes"`
	// First and Second are the times of the first and second exchange of
	// each session, in µs.
	DyscoFirst     []float64 `json:"dysco_first_us"`
	DyscoSecond    []float64 `json:"dysco_second_us"`
	BaselineFirst  []float64 `json:"baseline_first_us"`
	BaselineSecond []float64 `json:"baseline_second_us"`
	Lost           int       `json:"lost"`
	// ChainSetups is, per middlebox of the Dysco lab (mb1 first), how
	// many sessions its datapath continued along the chain (setup_cont)
	// while the Dysco samples were taken: one per session when each went
	// through the whole chain.
	ChainSetups []uint64 `json:"chain_setups"`
	// BPF is the datapath's run time on mb1 per new session and per
	// steady exchange (kernel BPF statistics), nil if not measured.
	BPF *UDPSetupBPF `json:"bpf,omitempty"`
	// BPFError says why BPF is missing.
	BPFError string `json:"bpf_error,omitempty"`
}

// UDPSetupBPF is the run time of mb1's TC programs (all hooks) per
// exchange: the first exchange of new sessions against exchanges of one
// established session. An exchange is a request and its response, each
// through mb1's ingress and egress hooks.
type UDPSetupBPF struct {
	Exchanges     int     `json:"exchanges"`
	NsPerFirst    float64 `json:"ns_per_first_exchange"`
	NsPerSteady   float64 `json:"ns_per_steady_exchange"`
	RunsPerFirst  float64 `json:"runs_per_first_exchange"`
	RunsPerSteady float64 `json:"runs_per_steady_exchange"`
	SetupNsPerHop float64 `json:"setup_ns"` // NsPerFirst - NsPerSteady
	// NsPerConnect is the same run time per TCP connect() through the
	// chain (SYN, SYN-ACK, ACK and the RST of the close), for reference.
	NsPerConnect    float64 `json:"ns_per_tcp_connect"`
	StatsMethod     string  `json:"stats_method"`
	ProgramsMeasure string  `json:"programs"`
}

// UDPSetup measures the first and second exchange of new UDP sessions
// through the pair's middleboxes, alternating between the labs in chunks,
// and mb1's BPF run time per set-up.
func UDPSetup(ctx context.Context, o *Options, p *labkit.Pair, r *Report, pr *labkit.Progress) error {
	if err := p.AddUDPPolicy(ctx); err != nil {
		return err
	}
	res := &UDPSetupResult{Middleboxes: p.NMB}
	r.Details[fmt.Sprintf("udpsetup-%dmb", p.NMB)] = res
	what := fmt.Sprintf("udp set-up, %d mb", p.NMB)
	for _, v := range p.Both() {
		e, err := startEcho(v.Lab, "server", netip.AddrPortFrom(v.Server, labkit.UDPEchoPort))
		if err != nil {
			return err
		}
		defer e.Close()
		_, lost, err := udpSessions(ctx, v.Lab, netip.AddrPortFrom(v.Server, labkit.UDPEchoPort), udpSetupWarmup, 2)
		if err != nil {
			return fmt.Errorf("%s, %s lab, warm-up: %w", what, v.Name, err)
		}
		if lost == udpSetupWarmup {
			return fmt.Errorf("%s, %s lab, warm-up: none of %d sessions was answered", what, v.Name, udpSetupWarmup)
		}
	}
	chunks := 5
	if o.Quick || o.Connects < 5*chunks {
		chunks = 1
	}
	per := (o.Connects + chunks - 1) / chunks
	setups := func() ([]uint64, error) {
		var n []uint64
		for _, h := range p.Dysco.MBs {
			st, err := labkit.AgentStatus(ctx, o.Dysco, p.Dysco.Lab, h)
			if err != nil {
				return nil, fmt.Errorf("%s: %w", what, err)
			}
			n = append(n, st.Counters["setup_cont"])
		}
		return n, nil
	}
	before, err := setups()
	if err != nil {
		return err
	}
	for c := 1; c <= chunks; c++ {
		pr.Logf("%s: chunk %d/%d, %d sessions per lab", what, c, chunks, per)
		for _, v := range p.Both() {
			t, lost, err := udpSessions(ctx, v.Lab, netip.AddrPortFrom(v.Server, labkit.UDPEchoPort), per, 2)
			res.Lost += lost
			if err != nil {
				return fmt.Errorf("%s, %s lab: %w", what, v.Name, err)
			}
			if v.Name == "dysco" {
				res.DyscoFirst, res.DyscoSecond = append(res.DyscoFirst, t[0]...), append(res.DyscoSecond, t[1]...)
			} else {
				res.BaselineFirst, res.BaselineSecond = append(res.BaselineFirst, t[0]...), append(res.BaselineSecond, t[1]...)
			}
		}
	}
	after, err := setups()
	if err != nil {
		return err
	}
	for i := range after {
		res.ChainSetups = append(res.ChainSetups, after[i]-before[i])
	}
	for i, n := range res.ChainSetups {
		if n < uint64(len(res.DyscoFirst)) {
			return fmt.Errorf("%s: mb%d continued %d sessions along the chain for %d sessions measured: the sessions did not all take the chain", what, i+1, n, len(res.DyscoFirst))
		}
	}
	if b, err := udpSetupBPF(ctx, p, per); err != nil {
		res.BPFError = err.Error()
		pr.Logf("%s: BPF statistics: %v", what, err)
	} else {
		res.BPF = b
	}
	df, bf := labkit.Median(res.DyscoFirst), labkit.Median(res.BaselineFirst)
	ds, bs := labkit.Median(res.DyscoSecond), labkit.Median(res.BaselineSecond)
	d99, b99 := labkit.Quantile(res.DyscoFirst, 0.99), labkit.Quantile(res.BaselineFirst, 0.99)
	added := (df - bf) / float64(p.NMB)
	addedSteady := (ds - bs) / float64(p.NMB)
	note := fmt.Sprintf("second exchange of the same session (control): Dysco %.1f µs, baseline %.1f µs, %+.1f µs/mb; p99 of the first exchange added %.1f µs/mb; %d sessions per lab, %d exchanges unanswered",
		ds, bs, addedSteady, (d99-b99)/float64(p.NMB), len(res.DyscoFirst), res.Lost)
	if res.BPF != nil {
		note += fmt.Sprintf("; BPF run time on mb1 per exchange: %.0f ns for a session's first, %.0f ns for a steady one (%+.0f ns of set-up per hop); per TCP connect() through the same chain %.0f ns",
			res.BPF.NsPerFirst, res.BPF.NsPerSteady, res.BPF.SetupNsPerHop, res.BPF.NsPerConnect)
	}
	r.add(&Figure{
		Key:  fmt.Sprintf("udpsetup-%dmb", p.NMB),
		Name: fmt.Sprintf("UDP first-exchange latency added per mb, %d mb", p.NMB),
		Command: fmt.Sprintf("runner on a thread in LAB-client: %d× new UDP socket (new source port), %d-byte request to an echo server at %s:%d and its answer, twice; %d chunks alternating Dysco/baseline",
			o.Connects, udpPayload, p.Dysco.Server, labkit.UDPEchoPort, chunks),
		Unit: "µs", Dysco: df, Baseline: bf,
		DyscoText:    fmt.Sprintf("%.1f µs (p99 %.1f)", df, d99),
		BaselineText: fmt.Sprintf("%.1f µs (p99 %.1f)", bf, b99),
		Ratio:        labkit.Ratio(df, bf),
		Measured:     added, MeasuredUnit: "µs/mb",
		Target: "≤ 25 µs per mb",
		Met:    metStr(!math.IsNaN(added) && added <= 25),
		Note:   note,
	})
	return nil
}

// udpSetupBPF measures the run time of mb1's TC programs in the Dysco lab
// per first exchange of n new sessions and per exchange of one session
// making n exchanges.
func udpSetupBPF(ctx context.Context, p *labkit.Pair, n int) (_ *UDPSetupBPF, err error) {
	l := p.Dysco.Lab
	hooks, progs, err := hostHooks(l, "mb1")
	defer func() {
		for _, pg := range progs {
			pg.Close()
		}
	}()
	if err != nil {
		return nil, err
	}
	method, restore, err := enableBPFStats()
	if err != nil {
		return nil, fmt.Errorf("enabling BPF statistics: %w", err)
	}
	defer func() {
		if rerr := restore(); rerr != nil {
			err = errors.Join(err, fmt.Errorf("restoring BPF statistics: %w", rerr))
		}
	}()
	dst := netip.AddrPortFrom(p.Dysco.Server, labkit.UDPEchoPort)
	total := func() (time.Duration, uint64, error) {
		var rt time.Duration
		var runs uint64
		for id, pg := range progs {
			st, err := pg.Stats()
			if err != nil {
				return 0, 0, fmt.Errorf("stats of program %d: %w", id, err)
			}
			rt += st.Runtime
			runs += st.RunCount
		}
		return rt, runs, nil
	}
	measure := func(sessions, exch int) (float64, float64, error) {
		rt0, r0, err := total()
		if err != nil {
			return 0, 0, err
		}
		t, _, err := udpSessions(ctx, l, dst, sessions, exch)
		if err != nil {
			return 0, 0, err
		}
		rt1, r1, err := total()
		if err != nil {
			return 0, 0, err
		}
		got := 0
		for _, x := range t {
			got += len(x)
		}
		if got == 0 {
			return 0, 0, errors.New("no exchange answered")
		}
		return float64((rt1 - rt0).Nanoseconds()) / float64(got), float64(r1-r0) / float64(got), nil
	}
	b := &UDPSetupBPF{Exchanges: n, StatsMethod: method}
	for _, h := range hooks {
		b.ProgramsMeasure += fmt.Sprintf("%s@%s:%s ", h.Iface, h.Hook, h.Program)
	}
	if b.NsPerFirst, b.RunsPerFirst, err = measure(n, 1); err != nil {
		return nil, err
	}
	if b.NsPerSteady, b.RunsPerSteady, err = measure(1, n); err != nil {
		return nil, err
	}
	b.SetupNsPerHop = b.NsPerFirst - b.NsPerSteady
	rt0, _, err := total()
	if err != nil {
		return nil, err
	}
	cs, _, err := connectSamples(ctx, l, netip.AddrPortFrom(p.Dysco.Server, labkit.ConnectPort), n)
	if err != nil {
		return nil, err
	}
	rt1, _, err := total()
	if err != nil {
		return nil, err
	}
	if len(cs) > 0 {
		b.NsPerConnect = float64((rt1 - rt0).Nanoseconds()) / float64(len(cs))
	}
	return b, nil
}
