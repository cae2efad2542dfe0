package bench

// Interruption of a session by break-before-make moves (docs/mobility.md,
// rebinds): the client has a session address and two links; a paced
// stream from it to the server leaves by one link, whose address is then
// deleted with its default route, so that the client's agent rebinds the
// session from the other link's address; the address comes back and the
// next move deletes the other one. Per move, the longest gap between the
// server's reads from the deletion until movesTail after the session
// leaves from the other address, against windows as long with no move.

import (
	"context"
	"fmt"
	"net/netip"
	"time"

	"github.com/dysco/dysco/internal/lab"
	"github.com/dysco/dysco/internal/labkit"
)

const movesBreakPort = 9711

func movesBreakPhaseName(o *Options) string {
	return fmt.Sprintf("break-before-make moves, %d moves", movesCount(o))
}

// movesBreakEst is the phase's estimate: per move, the rebind (polled),
// its window, the restore and a window with no move.
func movesBreakEst(o *Options) time.Duration {
	return 2*time.Second + time.Duration(movesCount(o))*(movesPause+2*movesTail+300*time.Millisecond)
}

// MovesBreakDetails is the raw data of the break-before-make figure.
type MovesBreakDetails struct {
	Moves     int       `json:"moves"`
	GapMS     []float64 `json:"gap_ms"`
	BaseGapMS []float64 `json:"baseline_gap_ms"`
	// RebindMS is, per move, the time from the deletion of the address
	// to the first look that found the session on the other one (an
	// upper bound of the rebind's time, the CLI polled every 10 ms).
	RebindMS []float64 `json:"rebind_ms"`
	RttMS    float64   `json:"rtt_ms"`
	Failed   int       `json:"failed"`
}

// MovesBreak measures the interruption of break-before-make moves in lab
// l (a star whose client has two links and session addresses).
func MovesBreak(ctx context.Context, o *Options, l *lab.Lab, r *Report, pr *labkit.Progress) error {
	n := movesCount(o)
	d := &MovesBreakDetails{Moves: n}
	r.Details["moves_break"] = d
	mv, err := labkit.NewLinkMover(l, "client", o.Dysco)
	if err != nil {
		return err
	}
	srv := l.Host("server").Addr4
	if _, err := labkit.DyscoCLI(ctx, o.Dysco, l, "client", "policy", "add", "rebinds", fmt.Sprintf("tcp dst port %d", movesBreakPort)); err != nil {
		return err
	}
	st, err := startStream(ctx, l, netip.AddrPortFrom(srv, movesBreakPort))
	if err != nil {
		return err
	}
	defer st.close()
	var moves, bases []window
	for i := range n {
		k := i % 2
		if got := mv.LeavesFrom(ctx, movesBreakPort); got != mv.Addr(k) {
			return fmt.Errorf("move %d: the session leaves from %s, not %s", i+1, got, mv.Addr(k))
		}
		start, moved, err := mv.Move(ctx, k, movesBreakPort, 10*time.Second)
		if err != nil {
			return err
		}
		if moved.IsZero() {
			d.Failed++
			pr.Logf("move %d: the session did not leave from %s within 10 s", i+1, mv.Addr(1-k))
			moved = time.Now()
		} else {
			d.RebindMS = append(d.RebindMS, float64(moved.Sub(start))/float64(time.Millisecond))
		}
		mw := window{start, moved.Add(movesTail)}
		moves = append(moves, mw)
		if err := labkit.SleepCtx(ctx, time.Until(mw.to)); err != nil {
			return err
		}
		if err := mv.Restore(ctx, k); err != nil {
			return err
		}
		base := time.Now().Add(20 * time.Millisecond)
		bases = append(bases, window{base, base.Add(mw.to.Sub(mw.from))})
		if err := labkit.SleepCtx(ctx, time.Until(base.Add(mw.to.Sub(mw.from)+movesPause))); err != nil {
			return err
		}
		if d.Failed > 0 {
			break
		}
		if (i+1)%10 == 0 {
			pr.Logf("break-before-make moves: %d of %d", i+1, n)
		}
	}
	if d.GapMS, d.BaseGapMS, d.RttMS, err = st.gaps(moves, bases); err != nil {
		return err
	}
	rtt := d.RttMS
	g50, g99 := percentile(d.GapMS, 50), percentile(d.GapMS, 99)
	b50, b99 := percentile(d.BaseGapMS, 50), percentile(d.BaseGapMS, 99)
	m50 := percentile(d.RebindMS, 50)
	extra := g99 - b99
	r.add(&Figure{
		Key:          "moves-break-before-make",
		Name:         fmt.Sprintf("longest gap in the bytes a server receives around a break-before-make move of a 50 Mbit/s stream: the client's link address deleted, the session rebound from its other link (%d moves)", len(moves)),
		Command:      "bin/dysco-bench --only moves",
		Unit:         "ms (p99)",
		Dysco:        g99,
		Baseline:     b99,
		DyscoText:    fmt.Sprintf("p50 %.2f, p99 %.2f ms (rebound within %.0f ms p50 of the deletion, CLI polling; %d failed)", g50, g99, m50, d.Failed),
		BaselineText: fmt.Sprintf("p50 %.2f, p99 %.2f ms in windows as long with no move", b50, b99),
		Ratio:        g99 / b99,
		Measured:     extra,
		MeasuredUnit: "ms beyond the baseline",
		Target:       fmt.Sprintf("≤ one RTT (%.2f ms) beyond the baseline (the new address is usable at the deletion)", rtt),
		Met:          metStr(d.Failed == 0 && extra <= rtt),
	})
	if d.Failed > 0 {
		return fmt.Errorf("%d of %d break-before-make moves failed", d.Failed, len(moves))
	}
	return nil
}
