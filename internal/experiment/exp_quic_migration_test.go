package experiment

import (
	"math"
	"testing"
	"time"

	"github.com/dysco/dysco/internal/api"
)

// TestQMBytes: a download is sized by the shaped rate shared by the
// sessions still on mb1 until its move, then the server's pace.
func TestQMBytes(t *testing.T) {
	z := qmSize{Warm: 2 * time.Second, Interval: 2 * time.Second, Tail: 2 * time.Second, ShapedMbit: 60, RateMbit: 60}
	// The first download: 20 Mbit/s for 2 s, 60 for 6 s = 400 Mbit; the
	// third: 20 for 2 s, 30 for 2 s, 60 for 4 s = 340 Mbit.
	for i, want := range []int64{50_000_000, 42_500_000, 42_500_000} {
		if got := qmBytes(z, i); got != want {
			t.Errorf("session %d: %d bytes, want %d", i+1, got, want)
		}
	}
}

// TestQMTimeline bins clients' samples, taken at their own instants, on
// the common 100 ms grid and splits them by middlebox at the switch.
func TestQMTimeline(t *testing.T) {
	t0 := time.Unix(1000, 0)
	base := float64(t0.UnixNano()) / 1e9
	z := qmSize{Warm: time.Second, Interval: time.Second, Tail: time.Second}
	d := &qmData{Size: z}
	// Three sessions at 8 Mbit/s (1 MB/s) until their switch at 1, 2 and
	// 3 s, 16 Mbit/s after; samples every 100 ms, offset per client.
	for i := 0; i < qmSessions; i++ {
		dl := &qmDownload{}
		sw := float64(i + 1)
		var bytes float64
		prev := 0.0
		for at := 0.03 * float64(i+1); at <= 4; at += 0.1 {
			for x := prev; x < at; x += 0.001 {
				if x < sw {
					bytes += 1e6 * 0.001
				} else {
					bytes += 2e6 * 0.001
				}
			}
			prev = at
			dl.samples = append(dl.samples, qmGetSample{At: base + at, Bytes: int64(bytes)})
		}
		dl.End = prev
		d.Downloads = append(d.Downloads, dl)
		r := api.ReconfigResult{Outcome: "succeeded"}
		d.Moves = append(d.Moves, &qmMove{Session: i + 1, At: sw, Switch: sw, Result: &r})
	}
	qmTimeline(d, t0)
	if n := len(d.Timeline); n < 35 || n > 41 {
		t.Fatalf("%d bins over 4 s", n)
	}
	near := func(a, b float64) bool { return math.Abs(a-b) < 0.5 }
	for _, b := range d.Timeline {
		if b.T < 0.2 || b.T > 3.8 || math.Abs(b.T-math.Round(b.T)) < 0.15 {
			continue // the edges, and the bins around a switch
		}
		sum := 0.0
		for i, m := range b.Mbps {
			want := 8.0
			if b.T > float64(i+1) {
				want = 16
			}
			if !near(m, want) {
				t.Errorf("t=%.1f session %d: %.2f Mbit/s, want %v", b.T, i+1, m, want)
			}
			sum += m
		}
		if !near(b.Mb1+b.Mb2, sum) {
			t.Errorf("t=%.1f: mb1 %.2f + mb2 %.2f != %.2f", b.T, b.Mb1, b.Mb2, sum)
		}
	}
	if !near(d.BeforeMbps, 24) || !near(d.AfterMbps, 48) {
		t.Errorf("before %.2f, after %.2f Mbit/s", d.BeforeMbps, d.AfterMbps)
	}
	for _, mv := range d.Moves {
		if !(mv.Gain > 1.7 && mv.Gain < 2.3) {
			t.Errorf("session %d: gain %.2f", mv.Session, mv.Gain)
		}
	}
}
