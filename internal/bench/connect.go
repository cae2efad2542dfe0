package bench

import (
	"context"
	"errors"
	"fmt"
	"math"
	"net/netip"
	"time"

	"github.com/dysco/dysco/internal/lab"
	"golang.org/x/sys/unix"

	"github.com/dysco/dysco/internal/labkit"
)

// connectWarmup connections per variant are made and thrown away before
// measuring (neighbour entries, caches).
const connectWarmup = 20

// connectSamples times n blocking connect() calls from the client of l to
// dst, on an OS thread in the client's namespace, and returns them in µs.
// Each socket is closed with an RST (SO_LINGER 0) so that no TIME_WAIT
// builds up. connect() returns when the SYN-ACK is in: the figure is the
// set-up round trip through the chain, without the final ACK.
func connectSamples(ctx context.Context, l *lab.Lab, dst netip.AddrPort, n int) ([]float64, int, error) {
	out := make([]float64, 0, n)
	interrupted := 0
	sa := &unix.SockaddrInet4{Port: int(dst.Port()), Addr: dst.Addr().As4()}
	err := l.Do("client", func() error {
		for i := 0; i < n; i++ {
			if err := ctx.Err(); err != nil {
				return err
			}
			fd, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
			if err != nil {
				return fmt.Errorf("socket: %w", err)
			}
			// Two SYN retransmissions at most: a lost SYN shows as a
			// ~1 s sample rather than a hang.
			_ = unix.SetsockoptInt(fd, unix.IPPROTO_TCP, unix.TCP_SYNCNT, 2)
			t0 := time.Now()
			err = unix.Connect(fd, sa)
			d := time.Since(t0)
			_ = unix.SetsockoptLinger(fd, unix.SOL_SOCKET, unix.SO_LINGER, &unix.Linger{Onoff: 1, Linger: 0})
			unix.Close(fd)
			if errors.Is(err, unix.EINTR) {
				interrupted++
				continue
			}
			if err != nil {
				return fmt.Errorf("connect %d/%d to %s: %w", i+1, n, dst, err)
			}
			out = append(out, float64(d.Nanoseconds())/1e3)
		}
		return nil
	})
	return out, interrupted, err
}

// ConnectResult is the raw data of one connect() comparison.
type ConnectResult struct {
	Middleboxes int       `json:"middleboxes"`
	TxOffload   bool      `json:"tx_offload"`
	Dysco       []float64 `json:"dysco_us"`
	Baseline    []float64 `json:"baseline_us"`
	Interrupted int       `json:"interrupted"`
	// ChainSetups is, per middlebox of the Dysco lab (mb1 first), how
	// many SYNs its datapath continued along the chain (status counter
	// setup_cont) while the Dysco samples were taken: at least one per
	// sample when every connect() went through the whole chain.
	ChainSetups []uint64 `json:"chain_setups"`
}

// Connect measures connect() latency through the pair's middleboxes
// with transmit checksum offload as it is, alternating between the labs in
// chunks.
func Connect(ctx context.Context, o *Options, p *labkit.Pair, r *Report, pr *labkit.Progress, offload bool) error {
	chunks := 5
	if o.Quick || o.Connects < 5*chunks {
		chunks = 1
	}
	per := (o.Connects + chunks - 1) / chunks
	res := &ConnectResult{Middleboxes: p.NMB, TxOffload: offload}
	r.Details[fmt.Sprintf("connect-%dmb-offload-%s", p.NMB, OnOff(offload))] = res
	what := fmt.Sprintf("connect(), %d mb, tx offload %s", p.NMB, OnOff(offload))
	for _, v := range p.Both() {
		if _, _, err := connectSamples(ctx, v.Lab, netip.AddrPortFrom(v.Server, labkit.ConnectPort), connectWarmup); err != nil {
			return fmt.Errorf("%s, %s lab, warm-up: %w", what, v.Name, err)
		}
	}
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
		pr.Logf("%s: chunk %d/%d, %d calls per lab", what, c, chunks, per)
		for _, v := range p.Both() {
			ss, intr, err := connectSamples(ctx, v.Lab, netip.AddrPortFrom(v.Server, labkit.ConnectPort), per)
			res.Interrupted += intr
			if err != nil {
				return fmt.Errorf("%s, %s lab: %w", what, v.Name, err)
			}
			if v.Name == "dysco" {
				res.Dysco = append(res.Dysco, ss...)
			} else {
				res.Baseline = append(res.Baseline, ss...)
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
	dm, bm := labkit.Median(res.Dysco), labkit.Median(res.Baseline)
	d99, b99 := labkit.Quantile(res.Dysco, 0.99), labkit.Quantile(res.Baseline, 0.99)
	added := (dm - bm) / float64(p.NMB)
	added99 := (d99 - b99) / float64(p.NMB)
	paper := ""
	if p.NMB == 4 {
		paper = "94 µs for 4 mbs"
	}
	r.add(&Figure{
		Key:  fmt.Sprintf("connect-%dmb-offload-%s", p.NMB, OnOff(offload)),
		Name: fmt.Sprintf("connect() latency added per mb, %d mb, tx csum offload %s", p.NMB, OnOff(offload)),
		Command: fmt.Sprintf("runner on a thread in LAB-client: %d× socket()+connect(%s:%d)+close(RST), %d chunks alternating Dysco/baseline",
			o.Connects, p.Dysco.Server, labkit.ConnectPort, chunks),
		Unit: "µs", Dysco: dm, Baseline: bm,
		DyscoText:    fmt.Sprintf("%.1f µs (p99 %.1f)", dm, d99),
		BaselineText: fmt.Sprintf("%.1f µs (p99 %.1f)", bm, b99),
		Ratio:        labkit.Ratio(dm, bm),
		Measured:     added, MeasuredUnit: "µs/mb",
		Target: "≤ 25 µs per mb", Paper: paper,
		Met:  metStr(!math.IsNaN(added) && added <= 25),
		Note: fmt.Sprintf("p99 added %.1f µs/mb; %d samples per lab", added99, len(res.Dysco)),
	})
	return nil
}

// OnOff is "on" or "off".
func OnOff(b bool) string {
	if b {
		return "on"
	}
	return "off"
}
