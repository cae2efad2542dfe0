package bench

import (
	"context"
	"encoding/json"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/dysco/dysco/internal/api"
	"github.com/dysco/dysco/internal/testutil"
)

func TestParseIperf(t *testing.T) {
	bps, err := parseIperf(`{"start":{},"end":{"sum_sent":{"bits_per_second":2e9},"sum_received":{"bits_per_second":1.5e9,"bytes":1}}}`)
	if err != nil || bps != 1.5e9 {
		t.Errorf("parseIperf = %v, %v; want 1.5e9", bps, err)
	}
	if _, err := parseIperf(`{"error":"unable to connect to server"}`); err == nil || !strings.Contains(err.Error(), "unable to connect") {
		t.Errorf("parseIperf of an error: %v", err)
	}
	if _, err := parseIperf("iperf3: garbage"); err == nil {
		t.Error("parseIperf accepted garbage")
	}
}

func TestParseIperfUDP(t *testing.T) {
	// iperf3 3.12 -u -J: sum_received is the receiver's side.
	res, err := parseIperfUDP(`{"end":{"sum":{"bits_per_second":2e9,"lost_packets":0,"packets":10},"sum_sent":{"bits_per_second":2e9,"packets":100},"sum_received":{"bits_per_second":1.5e9,"lost_packets":3,"packets":100}}}`)
	if err != nil || res.Gbps != 1.5 || res.Lost != 3 || res.Packets != 100 || res.LossPct() != 3 {
		t.Errorf("parseIperfUDP = %+v, %v", res, err)
	}
	// Older iperf3: only sum.
	res, err = parseIperfUDP(`{"end":{"sum":{"bits_per_second":1e9,"lost_packets":1,"packets":1000}}}`)
	if err != nil || res.Gbps != 1 || res.Lost != 1 {
		t.Errorf("parseIperfUDP without sum_received = %+v, %v", res, err)
	}
	for _, bad := range []string{`{"error":"unable to connect to server"}`, `{"end":{}}`, "garbage"} {
		if _, err := parseIperfUDP(bad); err == nil {
			t.Errorf("parseIperfUDP(%q) accepted", bad)
		}
	}
	argv := strings.Join(iperfUDPArgv("10.0.0.2", 6, 1, 100, 2e9), " ")
	if !strings.Contains(argv, "-u -b 20000000 ") || !strings.Contains(argv, "-P 100") {
		t.Errorf("iperfUDPArgv: -b is per stream: %s", argv)
	}
}

func TestParseWrk(t *testing.T) {
	out := `Running 5s test @ http://10.201.2.2:80/1k.bin
  2 threads and 100 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency     3.10ms    1.20ms  30.00ms   90.00%
    Req/Sec    16.20k     1.10k   18.00k    70.00%
  161234 requests in 5.00s, 190.12MB read
  Socket errors: connect 0, read 3, write 0, timeout 0
Requests/sec:  32246.80
Transfer/sec:     38.02MB
`
	rps, note, err := parseWrk(out)
	if err != nil || rps != 32246.80 {
		t.Fatalf("parseWrk = %v, %v", rps, err)
	}
	if !strings.Contains(note, "read 3") {
		t.Errorf("socket errors not reported: %q", note)
	}
	if _, _, err := parseWrk("unable to connect"); err == nil {
		t.Error("parseWrk accepted output without Requests/sec")
	}
}

func TestUpdateMarkdown(t *testing.T) {
	path := filepath.Join(t.TempDir(), "B.md")
	if err := os.WriteFile(path, []byte("# Benchmarks\n\nMethod.\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, run := range []string{"first\n", "second\n"} {
		if err := updateMarkdown(path, run); err != nil {
			t.Fatal(err)
		}
	}
	b, _ := os.ReadFile(path)
	s := string(b)
	if !strings.HasPrefix(s, "# Benchmarks\n\nMethod.\n") || strings.Contains(s, "first") || strings.Count(s, "second") != 1 || strings.Count(s, mdBegin) != 1 {
		t.Errorf("results section not replaced in place:\n%s", s)
	}
}

func TestPlan(t *testing.T) {
	o, err := ParseFlags([]string{"--quick"})
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, p := range plan(o) {
		names = append(names, p.Name)
	}
	got := strings.Join(names, "|")
	for _, want := range []string{"labs, 1 mb|goodput, 1 mb|", "memory per session|udp goodput, 1 mb; datagrams lost across reconfigurations|quic download, 1 mb|udp set-up latency, 1 mb|teardown, 1 mb|labs, 4 mb|nginx+wrk, 4 mb|", "quic download, 4 mb|udp set-up latency, 4 mb|teardown, 4 mb|", "teardown, 4 mb|labs, proxy removal|proxy removal, 60 sessions|teardown, proxy removal|labs, churn|reconfiguration under churn, 6 rounds|teardown, churn|labs, disruption|disruption of one session by a reconfiguration, 4s, SACK on and off|teardown, disruption|labs, moves|make-before-break moves between two links, 10 moves|break-before-make moves, 10 moves|teardown, moves|policy convergence, 50 agents, bbolt, etcd and kubernetes"} {
		if !strings.Contains(got, want) {
			t.Errorf("plan %q lacks %q", got, want)
		}
	}
	o, _ = ParseFlags([]string{"--only", "memory"})
	for _, p := range plan(o) {
		if p.nmb == 4 {
			t.Errorf("--only memory plans %q", p.Name)
		}
	}
	if o.Markdown != "" {
		t.Errorf("a partial run writes %s by default", o.Markdown)
	}
	if o, _ := ParseFlags(nil); o.Markdown != "BENCHMARKS.md" || o.mode() != "full" {
		t.Errorf("a full run writes %q (mode %s)", o.Markdown, o.mode())
	}
	if o, _ := ParseFlags([]string{"--agent-arg=--tap="}); o.Markdown != "" || o.mode() != "partial" {
		t.Errorf("a run with agent arguments writes %q (mode %s)", o.Markdown, o.mode())
	}
	o, _ = ParseFlags([]string{"--only", "reconfig"})
	names = nil
	for _, p := range plan(o) {
		names = append(names, p.Name)
	}
	if got := strings.Join(names, "|"); got != "labs, proxy removal|proxy removal, 600 sessions|teardown, proxy removal" {
		t.Errorf("--only reconfig plans %q", got)
	}
	if o.Markdown != "" || o.ReconfigWindow != 5*time.Second || o.ReconfigReps != 3 || o.ReconfigSessions != 600 {
		t.Errorf("--only reconfig: markdown %q, window %v, %d repetitions of %d sessions", o.Markdown, o.ReconfigWindow, o.ReconfigReps, o.ReconfigSessions)
	}
	if o, _ := ParseFlags([]string{"--quick", "--only", "reconfig"}); o.ReconfigReps != 1 || o.ReconfigSessions != 60 || o.ReconfigWindow != 2*time.Second {
		t.Errorf("--quick --only reconfig: %d repetitions of %d sessions, window %v", o.ReconfigReps, o.ReconfigSessions, o.ReconfigWindow)
	}
	// The spaced repetition follows the back-to-back ones only.
	if got := spacedRate(o); got != 50 {
		t.Errorf("--only reconfig: spaced repetition at %g/s, want 50", got)
	}
	for _, args := range [][]string{{"--reconfig-spaced-rate", "0"}, {"--reconfig-open-rate", "100"}} {
		if o, _ := ParseFlags(append([]string{"--only", "reconfig"}, args...)); spacedRate(o) != 0 {
			t.Errorf("%v: spaced repetition at %g/s, want none", args, spacedRate(o))
		}
	}
	if none, _ := ParseFlags([]string{"--only", "reconfig", "--reconfig-spaced-rate", "0"}); reconfigEst(none) >= reconfigEst(o) {
		t.Errorf("the estimate without the spaced repetition (%v) is not below the one with it (%v)", reconfigEst(none), reconfigEst(o))
	}
	o, _ = ParseFlags([]string{"--only", "disruption"})
	names = nil
	for _, p := range plan(o) {
		names = append(names, p.Name)
	}
	if got := strings.Join(names, "|"); got != "labs, disruption|disruption of one session by a reconfiguration, 8s, SACK on and off|teardown, disruption" {
		t.Errorf("--only disruption plans %q", got)
	}
	if o.Markdown != "" || o.DisruptionTime != 8*time.Second || disruptionAt(o) != 3*time.Second {
		t.Errorf("--only disruption: markdown %q, session of %v, reconfiguration at %v", o.Markdown, o.DisruptionTime, disruptionAt(o))
	}
	if o, _ := ParseFlags([]string{"--quick", "--only", "disruption"}); o.DisruptionTime != 4*time.Second || disruptionAt(o) != 1500*time.Millisecond {
		t.Errorf("--quick --only disruption: session of %v, reconfiguration at %v", o.DisruptionTime, disruptionAt(o))
	}
	if _, err := ParseFlags([]string{"--only", "disruption", "--disruption-time", "2s"}); err == nil {
		t.Error("--disruption-time 2s accepted")
	}
	o, _ = ParseFlags([]string{"--only", "churn"})
	names = nil
	for _, p := range plan(o) {
		names = append(names, p.Name)
	}
	if got := strings.Join(names, "|"); got != "labs, churn|reconfiguration under churn, 20 rounds|teardown, churn" || o.Markdown != "" {
		t.Errorf("--only churn plans %q (markdown %q)", got, o.Markdown)
	}
	if o, _ := ParseFlags([]string{"--only", "churn", "--churn-rounds", "50"}); o.ChurnRounds != 50 {
		t.Errorf("--churn-rounds 50: %d rounds", o.ChurnRounds)
	}
	if _, err := ParseFlags([]string{"--only", "nonsense"}); err == nil {
		t.Error("unknown benchmark accepted")
	}
}

// TestQuick runs every benchmark in --quick mode: real labs, agents,
// iperf3, wrk and nginx. Its figures mean nothing; it checks that each
// benchmark runs and produces a number, and that the labs go away.
func TestQuick(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: the quick benchmark run takes about a minute")
	}
	testutil.RequireRoot(t, "builds labs: network namespaces, agents loading eBPF programs")
	testutil.RequireTools(t, "iperf3", "wrk", "nginx", "ethtool", "haproxy")
	dir := t.TempDir()
	bin := filepath.Join(dir, "dysco")
	if out, err := exec.Command("go", "build", "-o", bin, "../../cmd/dysco").CombinedOutput(); err != nil {
		t.Fatalf("building dysco: %v\n%s", err, out)
	}
	// dysco-h3 beside it, for the quic benchmark (its own module).
	if out, err := exec.Command("go", "build", "-C", "../../test/h3", "-o", filepath.Join(dir, "dysco-h3"), ".").CombinedOutput(); err != nil {
		t.Fatalf("building dysco-h3: %v\n%s", err, out)
	}
	// etcd, kube-apiserver and dysco-kube beside it, for the convergence
	// benchmark (`make build` builds them).
	for _, name := range []string{"etcd", "kube-apiserver", "dysco-kube"} {
		b, _ := filepath.Abs(filepath.Join("../../bin", name))
		if _, err := os.Stat(b); err != nil {
			t.Fatalf("%v: run `make build` (it builds bin/%s)", err, name)
		}
		if err := os.Symlink(b, filepath.Join(dir, name)); err != nil {
			t.Fatal(err)
		}
	}
	// libdysco, preloaded into HAProxy by the reconfig benchmark.
	if out, err := exec.Command("make", "-s", "-C", "../..", "lib/libdysco.so").CombinedOutput(); err != nil {
		t.Fatalf("building libdysco: %v\n%s", err, out)
	}
	lib, _ := filepath.Abs("../../lib/libdysco.so")
	o, err := ParseFlags([]string{"--quick", "--dysco", bin, "--libdysco", lib, "--out", filepath.Join(dir, "out")})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 7*time.Minute)
	defer cancel()
	var log strings.Builder
	rep, err := Run(ctx, o, &log)
	if rep == nil {
		t.Fatalf("Run: %v\n%s", err, log.String())
	}
	if werr := WriteOutputs(o, rep, &log); werr != nil {
		t.Error(werr)
	}
	if err != nil {
		t.Errorf("Run: %v\nerrors: %v\n%s", err, rep.Errors, log.String())
	}
	if !strings.Contains(log.String(), "left]") {
		t.Error("no progress lines")
	}
	want := []string{"goodput-1mb-P1", "goodput-1mb-P100", "rps-1mb", "rps-4mb",
		"bpf-dysco_ingress-iperf3", "bpf-dysco_egress-wrk",
		"connect-1mb-offload-on", "connect-1mb-offload-off", "connect-4mb-offload-on", "connect-4mb-offload-off",
		"memory-all-mb1", "memory-all-client", "memory-fixed-client",
		"reconfig-proxy-removal", "reconfig-goodput", "churn-reconfig",
		"disruption-sack-on", "disruption-sack-off",
		"udp-1mb-P1", "udp-1mb-P100", "udp-reconfig-1mb", "quic-1mb", "quic-4mb", "udpsetup-1mb", "udpsetup-4mb",
		"convergence-etcd", "convergence-etcd-leader-kill", "convergence-kubernetes", "convergence-kubernetes-controller-kill", "moves-make-before-break", "moves-break-before-make"}
	got := map[string]*Figure{}
	for _, f := range rep.Figures {
		got[f.Key] = f
		// A connect or udpsetup figure is a difference and may be
		// negative. A
		// disruption figure is its smallest 50 ms bin, and a bin that
		// received nothing is a measured dip (0), not a missing value:
		// the benchmark reports a session that stalled as an error,
		// which the check of Run's error above catches.
		missing := math.IsNaN(f.Dysco)
		switch {
		case strings.HasPrefix(f.Key, "connect"):
		case strings.HasPrefix(f.Key, "udpsetup"):
		case strings.HasPrefix(f.Key, "disruption"), strings.HasPrefix(f.Key, "udp-reconfig"):
			// udp-reconfig counts datagrams lost: 0 is the target.
			missing = missing || f.Dysco < 0
		default:
			missing = missing || f.Dysco <= 0
		}
		if missing {
			t.Errorf("figure %s has no Dysco value: %+v", f.Key, f)
		}
		// The datapath cost is judged net of the statistics' own cost,
		// measured with an empty program on the baseline lab's hooks.
		if strings.HasPrefix(f.Key, "bpf-") && !(f.Baseline > 0 && f.Measured == f.Dysco-f.Baseline) {
			t.Errorf("figure %s: no floor measured (baseline %v, measured %v, Dysco %v): %s", f.Key, f.Baseline, f.Measured, f.Dysco, f.Note)
		}
		if f.Met != "yes" && f.Met != "no" && !(f.Met == "–" && f.Target == "(reported)") {
			t.Errorf("figure %s: met = %q", f.Key, f.Met)
		}
	}
	for _, k := range want {
		if got[k] == nil {
			t.Errorf("no figure %s", k)
		}
	}
	data, err := os.ReadFile(filepath.Join(dir, "out", "latest.json"))
	if err != nil {
		t.Fatal(err)
	}
	var back map[string]any
	if err := json.Unmarshal(data, &back); err != nil {
		t.Errorf("latest.json: %v", err)
	}
	// Every lab is gone.
	if rep.RunID == "" {
		t.Fatal("report has no run id")
	}
	out, _ := exec.Command("ip", "netns", "list").Output()
	for _, l := range strings.Split(string(out), "\n") {
		if strings.HasPrefix(l, rep.RunID) {
			t.Errorf("lab namespace left over: %s", l)
		}
	}
}

func TestSummarize(t *testing.T) {
	res := []api.ReconfigResult{
		{Session: "10.0.0.1:1000 -> 10.0.0.2:9400", Outcome: "succeeded", Micros: 500},
		{Session: "10.0.0.1:1001 -> 10.0.0.2:9400", Outcome: "succeeded", Micros: 1500},
		{Session: "10.0.0.1:1002 -> 10.0.0.2:9400", Outcome: "succeeded", Micros: 3000},
		{Session: "10.0.0.9:1 -> 10.0.0.2:9400", Outcome: "failed", Reason: "timeout", Micros: 9000},
	}
	locals := map[string]bool{"10.0.0.1:1000": true, "10.0.0.1:1001": true, "10.0.0.1:1002": true}
	s := Summarize(res, 5, locals)
	if s.Results != 4 || s.Succeeded != 3 || s.Named != 3 || s.Reasons["failed: timeout"] != 1 {
		t.Errorf("summarize = %+v", s)
	}
	if s.P50ms != 1.5 || s.MaxMs != 3 || s.Under2ms != 2.0/5 || s.Under4ms != 3.0/5 {
		t.Errorf("summarize times = p50 %v max %v under2 %v under4 %v", s.P50ms, s.MaxMs, s.Under2ms, s.Under4ms)
	}
}

func TestGoodputWindow(t *testing.T) {
	t0 := time.Now()
	a := snapshot{at: t0, clients: []int64{0, 10}, servers: []int64{5, 5}}
	b := snapshot{at: t0.Add(2 * time.Second), clients: []int64{1e9, 10}, servers: []int64{5 + 5e8, 5 + 5e8}}
	w := goodput(a, b)
	if w.StalledClients != 1 || w.StalledServers != 0 || w.DownGbps != 4 || w.UpGbps != 4 || w.TotalGbps != 8 {
		t.Errorf("goodput = %+v", w)
	}
}

func TestNewResults(t *testing.T) {
	r := func(id uint32) api.ReconfigResult {
		return api.ReconfigResult{ID: id, Outcome: "succeeded", Micros: int64(id)}
	}
	prev := []api.ReconfigResult{r(1), r(2)}
	if got := NewResults(prev, []api.ReconfigResult{r(1), r(2), r(3), r(4)}); len(got) != 2 || got[0] != r(3) {
		t.Errorf("newResults = %v", got)
	}
	// The agent trimmed the oldest entries.
	if got := NewResults(prev, []api.ReconfigResult{r(2), r(3)}); len(got) != 1 || got[0] != r(3) {
		t.Errorf("newResults after a trim = %v", got)
	}
	if got := NewResults(nil, []api.ReconfigResult{r(1)}); len(got) != 1 {
		t.Errorf("newResults with no earlier reading = %v", got)
	}
}

func TestSummarizeDisruption(t *testing.T) {
	// 50 ms bins of 62.5 MB (10 Gbit/s) from 0.05 s to 4 s; the
	// reconfiguration runs from 1.5 to 1.52 s; the bin ending at 2 s
	// carries a quarter, the one at 2.55 s (after the window) nothing.
	var xs []DisruptionSample
	var retrans, ooo uint32
	for i := 1; i <= 80; i++ {
		x := DisruptionSample{T: float64(i) * 0.05, Bytes: 62_500_000, Cwnd: 1000}
		switch i {
		case 25: // 1.25 s
			retrans += 3
		case 35: // 1.75 s
			retrans += 5
			ooo += 7
			x.Cwnd = 400
		case 40: // 2.0 s
			x.Bytes /= 4
		case 51: // 2.55 s
			x.Bytes = 0
			retrans += 100
		}
		x.Retrans, x.RcvOoo = retrans, ooo
		x.Gbps = float64(x.Bytes) * 8 / 0.05 / 1e9
		xs = append(xs, x)
	}
	s := summarizeDisruption(xs, 1.5, 1.52, time.Second)
	near := func(a, b float64) bool { return math.Abs(a-b) < 1e-6 }
	if s.BeforeBins != 20 || s.AfterBins != 20 || !near(s.BeforeGbps, 10) || !near(s.BeforeMinGbps, 10) || !near(s.BeforeRatio, 1) {
		t.Errorf("before: %+v", s)
	}
	if !near(s.AfterMinGbps, 2.5) || !near(s.AfterMinAt, 2.0) || !near(s.Ratio, 0.25) || s.StallBins != 0 {
		t.Errorf("after: %+v", s)
	}
	if s.RetransBefore != 3 || s.RetransWindow != 5 || s.RcvOooWindow != 7 || s.CwndAfterMin != 400 || s.CwndBefore != 1000 || s.CwndAfterEnd != 1000 {
		t.Errorf("counters: %+v", s)
	}
	if _, err := json.Marshal(summarizeDisruption(nil, 1.5, 1.52, time.Second)); err != nil {
		t.Errorf("an empty summary does not marshal: %v", err)
	}
}
