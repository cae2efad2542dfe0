package bench

// Interruption of a session by make-before-break moves between a host's
// two links (docs/mobility.md): a paced stream from a multihomed client
// to a server, moved back and forth between the client's two addresses
// with `dysco reconfig --via`; per move, the longest gap between the
// server's reads from the request until 200 ms after its answer, against
// the same measure over windows of the same length with no move (the
// baseline) and the path's RTT (the stream's minimum, TCP_INFO).

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"net"
	"net/netip"
	"sort"
	"sync"
	"time"

	"github.com/dysco/dysco/internal/api"
	"github.com/dysco/dysco/internal/lab"
	"github.com/dysco/dysco/internal/labkit"
)

// Phases of the moves benchmark, which builds its own lab.
const (
	movesLabs     = "labs, moves"
	movesTeardown = "teardown, moves"
)

func movesCount(o *Options) int {
	if o.Quick {
		return 10
	}
	return 100
}

func movesPhaseName(o *Options) string {
	return fmt.Sprintf("make-before-break moves between two links, %d moves", movesCount(o))
}

// movesEst is the phase's estimate: a move and a pause each.
func movesEst(o *Options) time.Duration {
	return 3*time.Second + time.Duration(movesCount(o))*(movesPause+2*movesTail+100*time.Millisecond)
}

// movesTail is how long after an answer a move's window lasts; a window
// as long with no move follows it, then movesPause before the next move.
const (
	movesPause = 100 * time.Millisecond
	movesTail  = 200 * time.Millisecond
)

// movesRateBps paces the stream: 50 Mbit/s in 8 KB writes, a write
// every 1.3 ms.
const (
	movesRateBps = 50e6
	movesChunk   = 8 << 10
	movesPort    = 9710
)

// MovesDetails is the raw data of the moves figure.
type MovesDetails struct {
	Moves int `json:"moves"`
	// GapMS is each move's longest gap between reads at the server, from
	// its request until movesTail after its answer; BaseGapMS the same
	// measure over windows as long with no move, one after each move.
	GapMS     []float64 `json:"gap_ms"`
	BaseGapMS []float64 `json:"baseline_gap_ms"`
	// MoveMS are the moves' times (the agent's, request to result).
	MoveMS []float64 `json:"move_ms"`
	RttMS  float64   `json:"rtt_ms"`
	Failed int       `json:"failed"`
}

// runMoves builds the lab, runs the benchmark and tears the lab down.
func runMoves(ctx context.Context, o *Options, set *labkit.Labs, prefix string, r *Report, pr *labkit.Progress, step func(string, func() error)) {
	name := movesPhaseName(o)
	pr.Begin(movesLabs)
	// The client's session addresses serve the break-before-make moves;
	// the make-before-break stream starts from one too.
	topo := lab.Topology{Kind: lab.KindStar, Hosts: []lab.HostSpec{{Name: "client", Role: lab.RoleClient, Links: 2, SessionAddr: true},
		{Name: "server", Role: lab.RoleServer}}}
	l, err := set.Up(ctx, prefix+"mv", topo, labkit.Agents{Dysco: o.Dysco, Args: o.AgentArgs})
	if err != nil {
		r.fail(movesLabs, err)
		for _, n := range []string{name, movesBreakPhaseName(o)} {
			pr.Skip(n)
			r.fail(n, fmt.Errorf("not run: the lab could not be built"))
		}
	} else {
		step(name, func() error { return Moves(ctx, o, l, r, pr) })
		step(movesBreakPhaseName(o), func() error { return MovesBreak(ctx, o, l, r, pr) })
	}
	pr.Begin(movesTeardown)
	if err := set.Down(); err != nil {
		r.fail(movesTeardown, err)
	}
}

// Moves measures the interruption of make-before-break moves in lab l (a
// star with a two-link client and a server).
func Moves(ctx context.Context, o *Options, l *lab.Lab, r *Report, pr *labkit.Progress) error {
	n := movesCount(o)
	d := &MovesDetails{Moves: n}
	r.Details["moves"] = d
	c := l.Host("client")
	srv := l.Host("server").Addr4
	addrs := [2]netip.Addr{c.Addr4, c.Ifaces[1].Addr4.Addr()}
	if _, err := labkit.DyscoCLI(ctx, o.Dysco, l, "client", "policy", "add", "moves", fmt.Sprintf("tcp dst port %d", movesPort)); err != nil {
		return err
	}
	st, err := startStream(ctx, l, netip.AddrPortFrom(srv, movesPort))
	if err != nil {
		return err
	}
	defer st.close()
	var moves, bases []window
	for i := range n {
		via := addrs[(i+1)%2] // the second link first, then back
		start := time.Now()
		out, err := labkit.DyscoCLI(ctx, o.Dysco, l, "client", "reconfig", "--json", "--match", fmt.Sprintf("tcp port %d", movesPort),
			"--to", srv.String(), "--via", via.String())
		end := time.Now()
		var rep api.ReconfigReply
		if json.Unmarshal([]byte(out), &rep) != nil || len(rep.Results) != 1 || rep.Results[0].Outcome != "succeeded" {
			d.Failed++
			pr.Logf("move %d to %s: %v %s", i+1, via, err, labkit.Tail(out, 200))
		} else {
			d.MoveMS = append(d.MoveMS, float64(rep.Results[0].Micros)/1000)
		}
		mw := window{start, end.Add(movesTail)}
		moves = append(moves, mw)
		// A window as long, with no move, after this one; the next
		// move comes after it.
		base := mw.to.Add(20 * time.Millisecond)
		bases = append(bases, window{base, base.Add(mw.to.Sub(mw.from))})
		if err := labkit.SleepCtx(ctx, time.Until(base.Add(mw.to.Sub(mw.from)+movesPause))); err != nil {
			return err
		}
		if (i+1)%10 == 0 {
			pr.Logf("moves: %d of %d", i+1, n)
		}
	}
	if d.GapMS, d.BaseGapMS, d.RttMS, err = st.gaps(moves, bases); err != nil {
		return err
	}
	rtt := d.RttMS
	g50, g99 := percentile(d.GapMS, 50), percentile(d.GapMS, 99)
	b50, b99 := percentile(d.BaseGapMS, 50), percentile(d.BaseGapMS, 99)
	m50 := percentile(d.MoveMS, 50)
	extra := g99 - b99
	r.add(&Figure{
		Key:          "moves-make-before-break",
		Name:         fmt.Sprintf("longest gap in the bytes a server receives around a make-before-break move of a 50 Mbit/s stream between the client's two links (%d moves, dysco reconfig --via)", n),
		Command:      "bin/dysco-bench --only moves",
		Unit:         "ms (p99)",
		Dysco:        g99,
		Baseline:     b99,
		DyscoText:    fmt.Sprintf("p50 %.2f, p99 %.2f ms (moves %.2f ms p50; %d failed)", g50, g99, m50, d.Failed),
		BaselineText: fmt.Sprintf("p50 %.2f, p99 %.2f ms in windows as long with no move", b50, b99),
		Ratio:        g99 / b99,
		Measured:     extra,
		MeasuredUnit: "ms beyond the baseline",
		Target:       fmt.Sprintf("≤ one RTT (%.2f ms) beyond the baseline", rtt),
		Met:          metStr(d.Failed == 0 && extra <= rtt),
	})
	if d.Failed > 0 {
		return fmt.Errorf("%d of %d moves failed", d.Failed, n)
	}
	return nil
}

// window is a span of time in which the benchmark looks for the longest
// gap between the server's reads.
type window struct{ from, to time.Time }

// stream is a paced stream from the lab's client to its server, whose
// reads the server records.
type stream struct {
	mu    sync.Mutex
	reads []time.Time
	conn  net.Conn
	ln    net.Listener
	stop  context.CancelFunc
	sent  chan error
	done  chan error
}

// startStream starts the stream to dst and returns once the server has
// read from it.
func startStream(ctx context.Context, l *lab.Lab, dst netip.AddrPort) (*stream, error) {
	ln, err := l.Listen("server", "tcp", dst.String())
	if err != nil {
		return nil, err
	}
	st := &stream{ln: ln, sent: make(chan error, 1), done: make(chan error, 1)}
	flowing := make(chan struct{}) // closed at the server's first read
	go func() {
		conn, err := ln.Accept()
		if err != nil {
			st.done <- err
			return
		}
		defer conn.Close()
		buf := make([]byte, 64<<10)
		for {
			k, err := conn.Read(buf)
			if k > 0 {
				st.mu.Lock()
				if len(st.reads) == 0 {
					close(flowing)
				}
				st.reads = append(st.reads, time.Now())
				st.mu.Unlock()
			}
			if err == io.EOF {
				st.done <- nil
				return
			}
			if err != nil {
				st.done <- err
				return
			}
		}
	}()
	conn, err := l.Dial(ctx, "client", "tcp", dst.String())
	if err != nil {
		ln.Close()
		return nil, err
	}
	st.conn = conn
	sctx, stop := context.WithCancel(ctx)
	st.stop = stop
	go func() { st.sent <- labkit.PacedWrite(sctx, conn, movesRateBps, movesChunk) }()
	select {
	case <-flowing:
		return st, nil
	case err := <-st.done:
		st.close()
		return nil, fmt.Errorf("the server ended before the stream flowed: %v", err)
	case <-time.After(10 * time.Second):
		st.close()
		return nil, errors.New("no data at the server 10 s after the stream started")
	case <-ctx.Done():
		st.close()
		return nil, ctx.Err()
	}
}

// finish ends the stream and returns the path's RTT: the stream's
// minimum (TCP_INFO), NaN if unknown.
func (st *stream) finish() (float64, error) {
	rtt := math.NaN()
	if tc, ok := st.conn.(*net.TCPConn); ok {
		if ti, err := tcpInfo(tc); err == nil && ti.Min_rtt > 0 {
			rtt = float64(ti.Min_rtt) / 1000
		}
	}
	st.stop()
	st.conn.(interface{ CloseWrite() error }).CloseWrite()
	if err := <-st.sent; err != nil && err != context.Canceled {
		return rtt, fmt.Errorf("the stream: %w", err)
	}
	if err := <-st.done; err != nil {
		return rtt, fmt.Errorf("the server: %w", err)
	}
	return rtt, nil
}

func (st *stream) close() {
	if st.stop != nil {
		st.stop()
	}
	if st.conn != nil {
		st.conn.Close()
	}
	st.ln.Close()
}

// gaps ends the stream and returns the longest gap in each window of
// moves and of bases, and the path's RTT (finish).
func (st *stream) gaps(moves, bases []window) (g, b []float64, rtt float64, err error) {
	if rtt, err = st.finish(); err != nil {
		return nil, nil, rtt, err
	}
	for i := range moves {
		g = append(g, st.gap(moves[i]))
		b = append(b, st.gap(bases[i]))
	}
	return g, b, rtt, nil
}

// gap is the longest time with no read inside w, its edges counting as
// reads, in milliseconds.
func (st *stream) gap(w window) float64 {
	st.mu.Lock()
	defer st.mu.Unlock()
	reads := st.reads
	i := sort.Search(len(reads), func(k int) bool { return !reads[k].Before(w.from) })
	last, worst := w.from, time.Duration(0)
	for ; i < len(reads) && !reads[i].After(w.to); i++ {
		worst = max(worst, reads[i].Sub(last))
		last = reads[i]
	}
	worst = max(worst, w.to.Sub(last))
	return float64(worst) / float64(time.Millisecond)
}
