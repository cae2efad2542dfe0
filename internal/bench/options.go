// Package bench is the benchmark harness of `make bench` (bench/,
// scripts/bench.sh): Dysco against a plain-routing baseline, BENCHMARKS.md.
// Its runners (RPS, Connect, RunChurn, Disruption, the reconfig lab...) are
// also what the paper's experiments of `dysco lab run` (internal/experiment)
// measure with; the labs they run in come from internal/labkit.
//
// Every figure is measured on Dysco and on a baseline side by side, in the
// same run: two labs with the same line topology (client, mb1..mbN,
// server), one with agents and a policy whose chain lists the middleboxes,
// one without agents where the middleboxes forward by plain routing. Both runs cross the same hosts and links. Measurements alternate
// between the two labs (A B A B ...) so that the noise of a shared machine
// hits both alike.
//
// Benchmarks:
//
//	goodput   iperf3, 1 and 100 sessions through 1 middlebox
//	rps       nginx + wrk, through 1 and 4 middleboxes
//	connect   connect() latency through 1 and 4 middleboxes, checksum
//	          offload on and off
//	bpfstats  run time per packet of the TC programs (kernel BPF stats)
//	memory    memory per session at 100,000 sessions (maps + agent)
//	udp       iperf3 -u, 1 and 100 flows through 1 middlebox, at the
//	          highest rate the baseline carries without loss
//	quic      HTTP/3 downloads (dysco-h3) through 1 and 4 middleboxes
//	udpsetup  the first request/response exchange of new UDP sessions
//	          through 1 and 4 middleboxes, and mb1's BPF time per set-up
//	reconfig  an unmodified HAProxy under libdysco removed from 600 live
//	          sessions: reconfiguration time at the left anchor, goodput
//	          through the proxy and after its removal (own star lab)
//	churn     the reconfiguration time of rounds that replace the
//	          middlebox of keep-alive HTTP sessions (nginx closing them
//	          every 200 requests, wrk -c50) every 0.5 s, and the
//	          resets (own star lab)
//	disruption  one greedy session across a live reconfiguration (mb1
//	          replaced by mb2), SACK on and off: goodput and congestion
//	          window every 50 ms (own star lab)
//	convergence  policy changes reaching 50 light agents (the agent's
//	          policy client without a datapath) through one server over
//	          bbolt, and two replicas over a three-member etcd on
//	          loopback; then the etcd leader killed (no lab)
//
// Results go to out/bench/*.json (raw) and, for full runs, to the results
// section of BENCHMARKS.md. Progress goes to stderr. Labs are always torn
// down, also on failure and on Ctrl-C. See BENCHMARKS.md for the method.
package bench

import (
	"flag"
	"fmt"
	"strings"
	"time"

	"github.com/dysco/dysco/internal/labkit"
)

// Options are the command line of the runner.
type Options struct {
	Dysco     string        `json:"dysco"`      // dysco binary for the agents and CLI
	Quick     bool          `json:"quick"`      // smoke run: short durations, one repetition
	Reps      int           `json:"reps"`       // repetitions of each Dysco/baseline pair
	IperfTime time.Duration `json:"iperf_time"` // iperf3 -t (plus 1 s omitted with -O 1)
	WrkTime   time.Duration `json:"wrk_time"`   // wrk -d
	Connects  int           `json:"connects"`   // connect() calls per variant per setting
	Sessions  int           `json:"sessions"`   // sessions for the memory benchmark
	// ReconfigSessions are the concurrent sessions whose proxy is removed.
	ReconfigSessions int `json:"reconfig_sessions"`
	// ReconfigWindow is each goodput window of the reconfig benchmark.
	ReconfigWindow time.Duration `json:"reconfig_window"`
	// ReconfigReps are the repetitions of the reconfig benchmark.
	ReconfigReps int `json:"reconfig_reps"`
	// ReconfigOpenRate spaces the dials of the reconfig benchmark's
	// sessions (sessions/s; 0: back to back).
	ReconfigOpenRate float64 `json:"reconfig_open_rate"`
	// ReconfigSpacedRate: after the repetitions with the sessions dialled
	// back to back (ReconfigOpenRate 0), one more with them opened at this
	// rate (sessions/s), so that the removals do not overlap (0: none).
	ReconfigSpacedRate float64  `json:"reconfig_spaced_rate"`
	Libdysco           string   `json:"libdysco"`   // lib/libdysco.so, preloaded into HAProxy
	Only               []string `json:"only"`       // benchmarks to run
	OutDir             string   `json:"out_dir"`    // raw JSON results
	Markdown           string   `json:"markdown"`   // file whose results section is rewritten, "" for none
	AgentArgs          []string `json:"agent_args"` // extra arguments for every agent
	Args               []string `json:"args"`       // the command line, for the report

	// DisruptionTime is how long the disruption benchmark's session
	// sends; the reconfiguration starts at 3/8 of it.
	DisruptionTime time.Duration `json:"disruption_time"`

	// ChurnRounds is the number of rounds of the churn benchmark.
	ChurnRounds int `json:"churn_rounds"`
}

// Agents is how the labs run Dysco.
func (o *Options) Agents() labkit.Agents { return labkit.Agents{Dysco: o.Dysco, Args: o.AgentArgs} }

// Benchmark names, in run order.
var allBenchmarks = []string{"goodput", "rps", "connect", "bpfstats", "memory", "udp", "quic", "udpsetup", "reconfig", "churn", "disruption", "moves", "convergence"}

func (o *Options) wants(name string) bool {
	for _, b := range o.Only {
		if b == name {
			return true
		}
	}
	return false
}

// ParseFlags parses the command line of `make bench` (bench/main.go).
func ParseFlags(args []string) (*Options, error) {
	o := &Options{Args: args}
	fs := flag.NewFlagSet("bench", flag.ContinueOnError)
	fs.Usage = func() {
		fmt.Fprintf(fs.Output(), "usage: bench [flags]\n\nRuns Dysco's benchmarks against a plain-routing baseline (see BENCHMARKS.md).\nNeeds root, iperf3, wrk, nginx and (reconfig) haproxy.\n\nflags:\n")
		fs.PrintDefaults()
	}
	only := fs.String("only", strings.Join(allBenchmarks, ","), "benchmarks to run, comma-separated: "+strings.Join(allBenchmarks, ","))
	fs.StringVar(&o.Dysco, "dysco", "bin/dysco", "dysco binary (agents and CLI)")
	fs.BoolVar(&o.Quick, "quick", false, "smoke run: 1 s measurements, one repetition, results only in JSON")
	fs.IntVar(&o.Reps, "reps", 0, "repetitions of each Dysco/baseline pair (default 5, quick 1)")
	fs.DurationVar(&o.IperfTime, "iperf-time", 0, "iperf3 duration, after 1 s of omitted warm-up (default 6s, quick 1s)")
	fs.DurationVar(&o.WrkTime, "wrk-time", 0, "wrk duration (default 6s, quick 1s)")
	fs.IntVar(&o.Connects, "connects", 0, "connect() calls per variant, topology and offload setting, and new UDP sessions per variant and topology (default 2000, quick 100)")
	fs.IntVar(&o.Sessions, "sessions", 100000, "sessions for the memory benchmark")
	fs.IntVar(&o.ReconfigSessions, "reconfig-sessions", 0, "concurrent sessions whose proxy is removed, reconfig benchmark (default 600, quick 60)")
	fs.DurationVar(&o.ReconfigWindow, "reconfig-window", 0, "goodput window before and after the proxy removal, reconfig benchmark (default 5s, quick 2s)")
	fs.IntVar(&o.ReconfigReps, "reconfig-reps", 0, "repetitions of the reconfig benchmark, each through the proxy then removing it (default 3, quick 1)")
	fs.Float64Var(&o.ReconfigOpenRate, "reconfig-open-rate", 0, "sessions opened per second by the reconfig benchmark (0: back to back, so that their removals overlap)")
	fs.Float64Var(&o.ReconfigSpacedRate, "reconfig-spaced-rate", 50, "after the back-to-back repetitions, one more repetition of the reconfig benchmark with the sessions opened at this rate (sessions/s), so that the removals do not overlap; 0: none (not run when --reconfig-open-rate is set)")
	fs.DurationVar(&o.DisruptionTime, "disruption-time", 0, "how long the disruption benchmark's session sends, sampled every 50 ms; mb1 is replaced by mb2 at 3/8 of it (default 8s, quick 4s)")
	fs.IntVar(&o.ChurnRounds, "churn-rounds", 0, "rounds of the churn benchmark, one every 0.5 s, each replacing the middlebox of every live HTTP session (default 20, quick 6)")
	fs.StringVar(&o.Libdysco, "libdysco", "lib/libdysco.so", "libdysco, preloaded into HAProxy by the reconfig benchmark")
	fs.StringVar(&o.OutDir, "out", "out/bench", "directory for the raw JSON results")
	md := fs.String("markdown", "", "rewrite the results section of this file (default: BENCHMARKS.md for a full run of every benchmark with default agents, none otherwise); \"-\" for none")
	fs.Func("agent-arg", "extra argument for every agent of the Dysco labs (repeat for several; e.g. --agent-arg=--tap= to run middlebox hosts without the session-view tap)", func(v string) error {
		o.AgentArgs = append(o.AgentArgs, v)
		return nil
	})
	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	if fs.NArg() > 0 {
		return nil, fmt.Errorf("unexpected arguments %q", fs.Args())
	}
	for _, b := range strings.Split(*only, ",") {
		b = strings.TrimSpace(b)
		if b == "" {
			continue
		}
		ok := false
		for _, a := range allBenchmarks {
			ok = ok || a == b
		}
		if !ok {
			return nil, fmt.Errorf("--only: unknown benchmark %q (known: %s)", b, strings.Join(allBenchmarks, ", "))
		}
		o.Only = append(o.Only, b)
	}
	o.Defaults()
	if o.wants("disruption") && o.DisruptionTime < 4*time.Second {
		return nil, fmt.Errorf("--disruption-time %v: at least 4s, so that a second before the reconfiguration (at 3/8) and a second after it fit after the session's start", o.DisruptionTime)
	}
	switch *md {
	case "":
		if o.complete() {
			o.Markdown = "BENCHMARKS.md"
		}
	case "-":
	default:
		o.Markdown = *md
	}
	return o, nil
}

// complete tells whether o is a full run of every benchmark with the
// default agents: the runs whose results go to BENCHMARKS.md by default.
func (o *Options) complete() bool {
	return !o.Quick && len(o.Only) == len(allBenchmarks) && len(o.AgentArgs) == 0
}

// mode names the kind of run in file names and reports.
func (o *Options) mode() string {
	switch {
	case o.Quick:
		return "quick"
	case o.complete():
		return "full"
	}
	return "partial"
}

// Defaults fills the durations and counts that were not given.
func (o *Options) Defaults() {
	def := func(v *int, full, quick int) {
		if *v <= 0 {
			*v = full
			if o.Quick {
				*v = quick
			}
		}
	}
	defd := func(v *time.Duration, full, quick time.Duration) {
		if *v <= 0 {
			*v = full
			if o.Quick {
				*v = quick
			}
		}
	}
	def(&o.Reps, 5, 1)
	def(&o.Connects, 2000, 100)
	def(&o.Sessions, 100000, 100000)
	def(&o.ReconfigSessions, 600, 60)
	def(&o.ReconfigReps, 3, 1)
	def(&o.ChurnRounds, 20, 6)
	defd(&o.IperfTime, 6*time.Second, time.Second)
	defd(&o.WrkTime, 6*time.Second, time.Second)
	defd(&o.ReconfigWindow, 5*time.Second, 2*time.Second)
	defd(&o.DisruptionTime, 8*time.Second, 4*time.Second)
	if o.Libdysco == "" {
		o.Libdysco = "lib/libdysco.so"
	}
	if len(o.Only) == 0 {
		o.Only = append([]string(nil), allBenchmarks...)
	}
	if o.OutDir == "" {
		o.OutDir = "out/bench"
	}
}
