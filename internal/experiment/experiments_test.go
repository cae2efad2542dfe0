package experiment

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/dysco/dysco/internal/bench"
	"github.com/dysco/dysco/internal/labkit"
	"github.com/dysco/dysco/internal/testutil"
)

// testBinDir holds the dysco that testBinaries built; TestMain removes it.
var testBinDir string

func TestMain(m *testing.M) {
	code := m.Run()
	if testBinDir != "" {
		os.RemoveAll(testBinDir)
	}
	os.Exit(code)
}

// testBinaries builds dysco and libdysco once for the package's lab tests.
var testBinaries = sync.OnceValues(func() ([2]string, error) {
	dir, err := os.MkdirTemp("", "dysco-experiment-test-")
	if err != nil {
		return [2]string{}, err
	}
	testBinDir = dir
	bin := filepath.Join(dir, "dysco")
	if out, err := exec.Command("go", "build", "-o", bin, "../../cmd/dysco").CombinedOutput(); err != nil {
		return [2]string{}, &buildError{"dysco", err, out}
	}
	if out, err := exec.Command("make", "-s", "-C", "../..", "lib/libdysco.so").CombinedOutput(); err != nil {
		return [2]string{}, &buildError{"libdysco", err, out}
	}
	// dysco-h3 beside dysco, where quic-migration looks for it.
	if out, err := exec.Command("go", "build", "-C", "../../test/h3", "-o", filepath.Join(dir, "dysco-h3"), ".").CombinedOutput(); err != nil {
		return [2]string{}, &buildError{"dysco-h3", err, out}
	}
	lib, _ := filepath.Abs("../../lib/libdysco.so")
	return [2]string{bin, lib}, nil
})

type buildError struct {
	what string
	err  error
	out  []byte
}

func (e *buildError) Error() string {
	return "building " + e.what + ": " + e.err.Error() + "\n" + string(e.out)
}

func needLab(t *testing.T, tools ...string) {
	t.Helper()
	testutil.RequireRoot(t, "builds labs: network namespaces, agents loading eBPF programs")
	testutil.RequireTools(t, tools...)
}

// TestRegistry checks that every experiment of docs/experiments.md is
// registered with phases for every size.
func TestRegistry(t *testing.T) {
	for _, n := range []string{"setup-latency", "goodput", "nginx", "proxy-removal", "disruption", "firewall-migration", "churn", "udp-setup", "quic-migration", "interface-migration", "mobility"} {
		e, err := Lookup(n)
		if err != nil {
			t.Fatal(err)
		}
		for _, s := range []Size{Tiny, Quick, Full} {
			if len(e.Phases(s)) == 0 {
				t.Errorf("%s: no phases for %s", n, s)
			}
		}
	}
	if _, err := Lookup("nonsense"); err == nil || !strings.Contains(err.Error(), "proxy-removal") {
		t.Errorf("Lookup of an unknown name: %v", err)
	}
}

// TestExperimentsTiny runs every experiment in its tiny size with real
// labs, agents and programs, and checks that each writes its files and
// that its figures are plausible.
func TestExperimentsTiny(t *testing.T) {
	needLab(t, "iperf3", "wrk", "nginx", "ethtool", "haproxy", "sysctl")
	bins, err := testBinaries()
	if err != nil {
		t.Fatal(err)
	}
	checks := map[string]func(t *testing.T, r *Result){
		"setup-latency": func(t *testing.T, r *Result) {
			all := r.Data.([]*bench.ConnectResult)
			if len(all) != 4 {
				t.Fatalf("%d settings, want 4", len(all))
			}
			for _, c := range all {
				if len(c.Dysco) < setupConnects(Tiny)-5 || len(c.Baseline) < setupConnects(Tiny)-5 {
					t.Errorf("%d mb, offload %v: %d/%d samples", c.Middleboxes, c.TxOffload, len(c.Dysco), len(c.Baseline))
				}
				for _, m := range []float64{labkit.Median(c.Dysco), labkit.Median(c.Baseline)} {
					if !(m > 0 && m < 10_000) {
						t.Errorf("%d mb: median connect() %v µs", c.Middleboxes, m)
					}
				}
			}
			// Every Dysco connect() went through the whole chain (not
			// a comparison of times: 60 samples on a shared machine
			// put Dysco's median under the baseline's once in CI).
			for _, c := range all {
				if len(c.ChainSetups) != c.Middleboxes {
					t.Fatalf("%d mb: set-ups counted on %d middleboxes", c.Middleboxes, len(c.ChainSetups))
				}
				t.Logf("%d mb, offload %v: SYNs continued per middlebox %v for %d connect() samples", c.Middleboxes, c.TxOffload, c.ChainSetups, len(c.Dysco))
				for i, n := range c.ChainSetups {
					if n < uint64(len(c.Dysco)) {
						t.Errorf("%d mb, offload %v: mb%d continued %d SYNs for %d connect() samples", c.Middleboxes, c.TxOffload, i+1, n, len(c.Dysco))
					}
				}
			}
		},
		"udp-setup": func(t *testing.T, r *Result) {
			all := r.Data.([]*bench.UDPSetupResult)
			if len(all) != 2 {
				t.Fatalf("%d topologies, want 2", len(all))
			}
			for _, c := range all {
				n := udpSetupSessions(Tiny)
				if len(c.DyscoFirst) < n-5 || len(c.BaselineFirst) < n-5 || len(c.DyscoSecond) < n-5 || len(c.BaselineSecond) < n-5 {
					t.Errorf("%d mb: %d/%d first and %d/%d second exchanges", c.Middleboxes, len(c.DyscoFirst), len(c.BaselineFirst), len(c.DyscoSecond), len(c.BaselineSecond))
				}
				for _, m := range []float64{labkit.Median(c.DyscoFirst), labkit.Median(c.BaselineFirst)} {
					if !(m > 0 && m < 10_000) {
						t.Errorf("%d mb: median first exchange %v µs", c.Middleboxes, m)
					}
				}
				// Every Dysco session went through the whole chain (the
				// runner fails otherwise; here the counts are logged).
				if len(c.ChainSetups) != c.Middleboxes {
					t.Fatalf("%d mb: set-ups counted on %d middleboxes", c.Middleboxes, len(c.ChainSetups))
				}
				t.Logf("%d mb: sessions continued per middlebox %v for %d sessions; BPF %+v %s", c.Middleboxes, c.ChainSetups, len(c.DyscoFirst), c.BPF, c.BPFError)
			}
		},
		"goodput": func(t *testing.T, r *Result) {
			pts := *r.Data.(*[]*goodputPoint)
			if len(pts) != len(goodputSizes(Tiny).counts) {
				t.Fatalf("%d points", len(pts))
			}
			for _, p := range pts {
				for _, s := range p.Samples {
					if !(s.Value > 0.01 && s.Value < 1000) {
						t.Errorf("%d sessions, %s: %v Gbit/s", p.Sessions, s.Variant, s.Value)
					}
				}
			}
		},
		"nginx": func(t *testing.T, r *Result) {
			d := r.Data.(map[string][]bench.Sample)
			for _, k := range []string{"1mb", "4mb"} {
				if len(d[k]) != 2 {
					t.Errorf("%s: %d samples", k, len(d[k]))
				}
				for _, s := range d[k] {
					if s.Value < 100 {
						t.Errorf("%s %s: %v req/s", k, s.Variant, s.Value)
					}
				}
			}
		},
		"proxy-removal": func(t *testing.T, r *Result) {
			d := r.Data.(*prData)
			n := d.Size.Bundles * d.Size.PerBundle
			if d.Removal.Succeeded != n || d.Direct != n {
				t.Errorf("%d removals succeeded, %d sessions direct, of %d", d.Removal.Succeeded, d.Direct, n)
			}
			if len(d.Lost) > 0 || d.BytesUp == 0 || d.BytesDown == 0 {
				t.Errorf("lost %v; %d bytes up, %d down", d.Lost, d.BytesUp, d.BytesDown)
			}
			// A tiny run has too few sessions for HAProxy to be their
			// bottleneck (7-9 Gbit/s through it in CI), and under make
			// test the other packages take the CPU it frees: goodput after
			// the removals came out a few per cent either side of before
			// (CI: 6.63 after against 7.07 before, 6.06 against 7.83, 8.49
			// against 8.67 Gbit/s). What a tiny run must show is that the
			// sessions keep their speed on the direct path (HAProxy's CPU,
			// below, shows it left the data path); the gain is the full
			// run's figure (BENCHMARKS.md, "Proxy removal in bundles").
			if !(d.AfterGbps > d.BeforeGbps/2) {
				t.Errorf("goodput after the removals %v Gbit/s, under half the %v before", d.AfterGbps, d.BeforeGbps)
			}
			if !(d.CPUAfter < d.CPUBefore/2) {
				t.Errorf("HAProxy's CPU %v %% after the removals, %v %% before", d.CPUAfter, d.CPUBefore)
			}
			if len(d.Triggers) != d.Size.Bundles {
				t.Errorf("%d bundles triggered of %d", len(d.Triggers), d.Size.Bundles)
			}
		},
		"firewall-migration": func(t *testing.T, r *Result) {
			d := r.Data.(*fwData)
			if len(d.Moves) != len(fwSemantics) {
				t.Fatalf("%d moves, want %d", len(d.Moves), len(fwSemantics))
			}
			for _, mv := range d.Moves {
				if mv.Succeeded != d.Size.PerBundle || !(mv.SwitchP50 > 0) {
					t.Errorf("%s: %d of %d moved, switch p50 %v ms (%v)", mv.Semantics, mv.Succeeded, d.Size.PerBundle, mv.SwitchP50, mv.Reasons)
				}
			}
			if d.Mb2Drops != 0 || len(d.Lost) > 0 || d.BytesUp == 0 || d.BytesDown == 0 {
				t.Errorf("mb2 dropped %d; lost %v; %d bytes up, %d down", d.Mb2Drops, d.Lost, d.BytesUp, d.BytesDown)
			}
			if d.Mb1After != 0 {
				t.Errorf("%d sessions still on mb1 after every bundle moved", d.Mb1After)
			}
		},
		// churn fails by itself (RunExperiment's error) on resets, failed
		// transfers, stuck phases and results that do not fit their
		// session's fate; here, that the workload and the rounds ran.
		"churn": func(t *testing.T, r *Result) {
			d := r.Data.(*churnData).Run
			fams := map[string]int{}
			results := 0
			for _, rd := range d.Rounds {
				fams[rd.Family]++
				results += len(rd.Results)
			}
			if len(d.Rounds) < 5 || fams["IPv4"] == 0 || fams["IPv6"] == 0 || results < 10 || d.Times.N == 0 {
				t.Errorf("%d rounds (by family %v), %d results, %d succeeded", len(d.Rounds), fams, results, d.Times.N)
			}
			if len(d.Wrk) != 2 || d.Wrk[0].Requests == 0 || d.Wrk[1].Requests == 0 {
				t.Errorf("wrk: %+v", d.Wrk)
			}
			if d.Streams == nil || d.Streams.Completed == 0 || d.Shorts == nil || d.Shorts.Completed == 0 {
				t.Errorf("streams %+v, short connections %+v", d.Streams, d.Shorts)
			}
			if d.SocketPolls < 10 || d.SocketLives == 0 {
				t.Errorf("the socket poller listed the client's sockets %d times and saw %d sessions", d.SocketPolls, d.SocketLives)
			}
		},
		"mobility": func(t *testing.T, r *Result) {
			// RunExperiment fails by itself when a move is not seen,
			// the firewall's entry changes or the monitor sees another
			// tuple.
			d := r.Data.(*mobData)
			if len(d.Moves) < 2 || d.Bytes < int64(d.Size.RateMbit)*1e6/8*int64(d.Size.Run/time.Second)/2 {
				t.Errorf("%d moves, %d bytes received in %s at %d Mbit/s", len(d.Moves), d.Bytes, d.Size.Run, d.Size.RateMbit)
			}
			for i, m := range d.Moves {
				if !(m.GapMS < 1000) || m.From == m.To {
					t.Errorf("move %d: %+v", i+1, m)
				}
			}
		},
		"interface-migration": func(t *testing.T, r *Result) {
			// RunExperiment fails by itself when a flow is under 70% of
			// the link after the move or the second link carried nothing.
			d := r.Data.(*imData)
			if len(d.Move) != 2 || d.Move[0].Outcome != "succeeded" || d.Move[1].Outcome != "succeeded" {
				t.Errorf("the move: %+v, want the flow's two connections moved", d.Move)
			}
			// Before the move the two flows share one link.
			if sum := d.Before[0] + d.Before[1]; !(sum <= 1.1*float64(d.Size.RateMbit)) {
				t.Errorf("before the move: %.1f + %.1f Mbit/s on one link of %d", d.Before[0], d.Before[1], d.Size.RateMbit)
			}
		},
		"quic-migration": func(t *testing.T, r *Result) {
			d := r.Data.(*qmData)
			if len(d.Moves) != qmSessions || len(d.Downloads) != qmSessions || len(d.Timeline) < 30 {
				t.Fatalf("%d moves, %d downloads, %d bins", len(d.Moves), len(d.Downloads), len(d.Timeline))
			}
			for _, mv := range d.Moves {
				if mv.Result == nil || mv.Result.Outcome != "succeeded" {
					t.Errorf("session %d's move: %+v %s", mv.Session, mv.Result, mv.Error)
				}
			}
			if d.Moves[0].Result == nil || d.Moves[0].Result.NF != "firewall" || d.NF == nil || d.NF.Starts != 1 {
				t.Errorf("mb2's firewall: first move %+v, status %+v", d.Moves[0].Result, d.NF)
			}
			for i, dl := range d.Downloads {
				if !dl.OK || dl.Got != dl.Bytes || dl.Connections != 1 || dl.Migrated != 0 {
					t.Errorf("download %d: %+v", i+1, dl)
				}
			}
			// The fast path is paced by the server, the slow one shaped
			// to the same rate for all three: well above, not a close call.
			if !(d.BeforeMbps > 0 && d.AfterMbps > 1.5*d.BeforeMbps) {
				t.Errorf("throughput %v Mbit/s before the moves, %v after", d.BeforeMbps, d.AfterMbps)
			}
		},
		"disruption": func(t *testing.T, r *Result) {
			d := r.Data.(*bench.DisruptionDetails)
			if len(d.Runs) != 2 {
				t.Fatalf("%d runs", len(d.Runs))
			}
			if d.Shaping == nil || d.Shaping.Qdisc != "tbf" || len(d.Shaping.Ifaces) != 2 || d.Shaping.CC != "cubic" {
				t.Fatalf("shaping %+v", d.Shaping)
			}
			for _, x := range d.Runs {
				if len(x.Samples) < 40 || x.Summary == nil || !(x.Summary.AfterGbps > 0) {
					t.Fatalf("SACK %v: %d samples, summary %+v", x.SACK, len(x.Samples), x.Summary)
				}
				s := x.Summary
				// The old path is the shaped one: its rate is the
				// shaper's and its RTT the FIFO that cubic fills; the
				// new path is faster on both counts.
				if x.CC != "cubic" || !(s.BeforeGbps > 0 && s.BeforeGbps < 1.2*float64(d.Shaping.RateMbit)/1000) || !(s.LastGbps > 2*s.BeforeGbps) {
					t.Errorf("SACK %v: %s, goodput %v Gbit/s on the old path, %v on the new", x.SACK, x.CC, s.BeforeGbps, s.LastGbps)
				}
				if !(s.RttBeforeMs > 5 && s.RttLastMs < s.RttBeforeMs/3) {
					t.Errorf("SACK %v: RTT %v ms on the old path, %v ms on the new", x.SACK, s.RttBeforeMs, s.RttLastMs)
				}
				for _, hi := range d.Shaping.Ifaces {
					if x.Shapers[hi].Bytes < 1e6 {
						t.Errorf("SACK %v: the shaper on %s sent %d bytes", x.SACK, hi, x.Shapers[hi].Bytes)
					}
				}
			}
		},
	}
	for _, name := range Names() {
		check := checks[name]
		if check == nil {
			continue // an experiment with its own test
		}
		t.Run(name, func(t *testing.T) {
			out := t.TempDir()
			var log bytes.Buffer
			ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
			defer cancel()
			t0 := time.Now()
			res, err := RunExperiment(ctx, name, Config{Dysco: bins[0], Libdysco: bins[1], Size: Tiny, OutDir: out, Log: &log, Command: "test"})
			t.Logf("%s: %v", name, time.Since(t0).Round(time.Second))
			if err != nil {
				t.Fatalf("%v\n%s", err, log.String())
			}
			if !strings.Contains(log.String(), "left]") {
				t.Error("no progress lines")
			}
			for _, f := range append([]string{"report.md", "data.json"}, res.Files...) {
				if st, err := os.Stat(filepath.Join(out, f)); err != nil || st.Size() == 0 {
					t.Errorf("file %s: %v", f, err)
				}
			}
			if len(res.Plots) == 0 || len(res.Comparisons) == 0 || len(res.Headline) < 3 {
				t.Errorf("%d plots, %d comparisons, %d headline lines", len(res.Plots), len(res.Comparisons), len(res.Headline))
			}
			for _, p := range res.Plots {
				b, err := os.ReadFile(filepath.Join(out, p.File))
				if err != nil || !bytes.HasPrefix(b, []byte("\x89PNG")) || len(b) < 5000 {
					t.Errorf("plot %s: not a PNG with content (%d bytes, %v)", p.File, len(b), err)
				}
			}
			md, _ := os.ReadFile(filepath.Join(out, "report.md"))
			for _, want := range []string{"## Set-up", "## Our figures and the paper's", "## Plots", res.Paper} {
				if !bytes.Contains(md, []byte(want)) {
					t.Errorf("report.md lacks %q", want)
				}
			}
			var back map[string]any
			if b, err := os.ReadFile(filepath.Join(out, "data.json")); err != nil || json.Unmarshal(b, &back) != nil {
				t.Errorf("data.json does not read back: %v", err)
			}
			check(t, res)
			out2, _ := exec.Command("ip", "netns", "list").Output()
			for _, l := range strings.Split(string(out2), "\n") {
				if strings.HasPrefix(l, "x") && len(l) > 5 && strings.Contains(l, "-") && strings.Contains(log.String(), "labs "+l[:5]) {
					t.Errorf("lab namespace left over: %s", l)
				}
			}
		})
	}
}
