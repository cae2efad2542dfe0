package bench

import (
	"errors"
	"math"
	"strings"
	"testing"
	"time"
)

func TestDisruptionShaping(t *testing.T) {
	sh := newDisruptionShaping(150, 40, 32<<10, []string{"router:r-2", "mb1:eth0"})
	if sh.LimitBytes != 750_000 || sh.CC != "cubic" || sh.Qdisc != "tbf" {
		t.Errorf("shaping %+v", sh)
	}
	if got := strings.Join(sh.tcArgv("r-2"), " "); got != "tc qdisc replace dev r-2 root tbf rate 150mbit burst 32768 limit 750000" {
		t.Errorf("tc argv %q", got)
	}
	if len(sh.Commands) != 2 || sh.Commands[0] != "ip netns exec LAB-router tc qdisc replace dev r-2 root tbf rate 150mbit burst 32768 limit 750000" ||
		!strings.HasPrefix(sh.Commands[1], "ip netns exec LAB-mb1 tc qdisc replace dev eth0 ") {
		t.Errorf("commands %q", sh.Commands)
	}
	for _, want := range []string{"150 Mbit/s", "40 ms FIFO", "router:r-2 and mb1:eth0", "cubic", "unshaped"} {
		if !strings.Contains(sh.String(), want) {
			t.Errorf("%q lacks %q", sh, want)
		}
	}
	// What tc says on a kernel without the qdisc (as it says of netem on
	// this one).
	err := shapeError("router:r-2", errors.New("tc qdisc replace dev r-2 root tbf ...: exit status 2\nError: Specified qdisc kind is unknown."))
	if !strings.Contains(err.Error(), "CONFIG_NET_SCH_TBF") || !strings.Contains(err.Error(), "no unshaped fallback") {
		t.Errorf("missing TBF: %v", err)
	}
	if err := shapeError("mb1:eth0", errors.New("timed out")); strings.Contains(err.Error(), "CONFIG_NET_SCH_TBF") {
		t.Errorf("another failure blamed on the kernel: %v", err)
	}
}

func TestParseQdiscStats(t *testing.T) {
	// `tc -s -j qdisc show dev va` of iproute2 6.1 after a TBF.
	out := `[{"kind":"tbf","handle":"8009:","root":true,"refcnt":3,"options":{"rate":18750000,"burst":32756,"lat":38253},"bytes":1500,"packets":1,"drops":2,"overlimits":3,"requeues":0,"backlog":0,"qlen":0}]`
	q, err := parseQdiscStats(out)
	if err != nil || q.Kind != "tbf" || q.Bytes != 1500 || q.Packets != 1 || q.Drops != 2 || q.Overlimits != 3 {
		t.Errorf("parse: %+v, %v", q, err)
	}
	if _, err := parseQdiscStats(`[{"kind":"pfifo","handle":"1:","parent":"8009:1"}]`); err == nil {
		t.Error("no root qdisc accepted")
	}
	if _, err := parseQdiscStats("Error"); err == nil {
		t.Error("not JSON accepted")
	}
	d := shaperDeltas(map[string]qdiscStats{"r:a": {Bytes: 10, Packets: 1, Drops: 1}}, map[string]qdiscStats{"r:a": {Bytes: 110, Packets: 3, Drops: 4}})
	if d["r:a"] != (shaperDelta{Bytes: 100, Packets: 2, Drops: 3}) {
		t.Errorf("deltas %+v", d)
	}
	if got := shaperText(d); got != "r:a sent 0.0 MB in 2 packets, dropped 3" {
		t.Errorf("shaperText %q", got)
	}
}

// TestSummarizeDisruptionPaths checks the figures of the old and new
// paths: RTT before and at the end, goodput of the last second, recovery
// bins and the reordering degree.
func TestSummarizeDisruptionPaths(t *testing.T) {
	// 80 bins of 50 ms; the old path (to 1.5 s) carries 0.15 Gbit/s at a
	// 30 ms RTT, the new one 10 Gbit/s at 0.5 ms; the reconfiguration runs
	// from 1.5 to 1.52 s, two bins of it in recovery.
	var xs []DisruptionSample
	for i := 1; i <= 80; i++ {
		x := DisruptionSample{T: float64(i) * 0.05, Bytes: 937_500, RttUs: 30_000, Reordering: 3}
		if x.T > 1.5 {
			x.Bytes, x.RttUs, x.Reordering = 62_500_000, 500, 40
		}
		if i == 32 || i == 33 {
			x.CaState, x.Lost = 3, 7
		}
		if i >= 32 {
			x.Rtos = 1
		}
		x.Gbps = float64(x.Bytes) * 8 / 0.05 / 1e9
		xs = append(xs, x)
	}
	s := summarizeDisruption(xs, 1.5, 1.52, time.Second)
	near := func(a, b float64) bool { return math.Abs(a-b) < 1e-6 }
	if !near(s.RttBeforeMs, 30) || !near(s.RttLastMs, 0.5) || !near(s.RttWindowMaxMs, 0.5) {
		t.Errorf("RTT: before %v, window max %v, last %v", s.RttBeforeMs, s.RttWindowMaxMs, s.RttLastMs)
	}
	if !near(s.BeforeGbps, 0.15) || !near(s.LastGbps, 10) || s.LastBins != 20 {
		t.Errorf("goodput: before %v, last %v over %d bins", s.BeforeGbps, s.LastGbps, s.LastBins)
	}
	if s.RecoveryBins != 2 || s.RecoveryBinsBefore != 0 || s.LostWindowMax != 7 || s.RtoWindow != 1 {
		t.Errorf("recovery: %+v", s)
	}
	if s.ReorderingBefore != 3 || s.ReorderingAfter != 40 {
		t.Errorf("reordering degree %d → %d", s.ReorderingBefore, s.ReorderingAfter)
	}
	// A run too short for a last second after the window has none.
	if s := summarizeDisruption(xs[:50], 1.5, 1.52, time.Second); s.LastBins != 0 || !math.IsNaN(s.LastGbps) || !math.IsNaN(s.RttLastMs) {
		t.Errorf("short run: %d last bins, %v Gbit/s", s.LastBins, s.LastGbps)
	}
}
