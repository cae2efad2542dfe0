package datapath

import (
	"math"
	"testing"
	"time"
)

// TestAge: ages from 32-bit millisecond stamps across the wrap, and the
// guarantee the collector rests on: an age is never longer than the truth.
func TestAge(t *testing.T) {
	const ms = time.Millisecond
	for _, c := range []struct {
		name   string
		now, t uint32
		want   time.Duration
	}{
		{"fresh", 1000, 1000, 0},
		{"one second", 5000, 4000, time.Second},
		{"across the wrap", 500, math.MaxUint32 - 499, 1000 * ms},
		{"stamp written after now", 1000, 1000 + 30000, 0},
		{"stamp a skew after now, across the wrap", math.MaxUint32, 59999, 0},
		{"oldest exact age", 0, uint32(1<<32 - int64(MaxAge/ms)), MaxAge},
	} {
		if got := Age(c.now, c.t); got != c.want {
			t.Errorf("%s: Age(%d, %d) = %v, want %v", c.name, c.now, c.t, got, c.want)
		}
	}
	// A stamp of true age a (ms) reads as a mod 2^32, or 0: never more.
	for _, a := range []int64{0, 1, 3600e3, int64(MaxAge / ms), int64(MaxAge/ms) + 1, 1<<32 - 1, 1 << 32, 1<<32 + 5000, 3<<32 + 17} {
		now := uint32(123456789)
		got := Age(now, now-uint32(a))
		if got > time.Duration(a)*ms {
			t.Errorf("true age %d ms reads %v: longer", a, got)
		}
		if a <= int64(MaxAge/ms) && got != time.Duration(a)*ms {
			t.Errorf("true age %d ms reads %v, want exact", a, got)
		}
	}
}

// TestNowFollowsTheDatapathClock: Now is Monotonic in ms, truncated as the
// datapath truncates bpf_ktime_get_coarse_ns.
func TestNowFollowsTheDatapathClock(t *testing.T) {
	before := uint32(Monotonic() / time.Millisecond)
	n := Now()
	after := uint32(Monotonic() / time.Millisecond)
	if Age(n, before) > time.Second || Age(after, n) > time.Second {
		t.Errorf("Now %d outside [%d, %d]", n, before, after)
	}
}
