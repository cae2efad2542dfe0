// Package experiment runs the paper's evaluation (§5) on one machine, as
// the experiments of `dysco lab run`, each writing raw data (CSV, JSON),
// plots and a report. Each experiment is one file that registers itself in
// an init function:
//
//	func init() {
//		Register(&Experiment{Name: "my-exp", Paper: "Fig. 15", ...,
//			Phases: myPhases, Run: runMyExp})
//	}
//
// Run gets an *Env (sizes, a lab set that is always torn down, progress,
// writers for CSV files and plots) and returns what goes into report.md.
// docs/experiments.md describes the experiments and how to add one. The
// runners they reuse are those of `make bench` (internal/bench), in labs
// of internal/labkit.
package experiment

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"time"

	"github.com/dysco/dysco/internal/bench"
	"github.com/dysco/dysco/internal/labkit"
)

// Size is how big a run is: Tiny for tests, Quick (the default) for a few
// minutes on two cores, Full for the paper's scale where the machine allows.
type Size int

// The sizes of a run.
const (
	Tiny Size = iota
	Quick
	Full
)

func (s Size) String() string {
	switch s {
	case Tiny:
		return "tiny"
	case Quick:
		return "quick"
	case Full:
		return "full"
	}
	return fmt.Sprintf("size(%d)", int(s))
}

// pick returns the value of a size: tiny, quick or full.
func pick[T any](s Size, tiny, quick, full T) T {
	switch s {
	case Tiny:
		return tiny
	case Full:
		return full
	}
	return quick
}

// Phase is a step of an experiment with its expected duration, for the
// progress lines' estimate of what is left.
type Phase struct {
	Name string
	Est  time.Duration
}

// Experiment is one experiment of `dysco lab run`.
type Experiment struct {
	// Name is the command-line name ("proxy-removal").
	Name string
	// Paper names the figures of the paper it reproduces ("Fig. 12, 13").
	Paper string
	// Summary is one line for `dysco lab run --list`.
	Summary string
	// Tools are the programs it needs on the PATH.
	Tools []string
	// Phases lists its steps for a size, in order (for progress).
	Phases func(Size) []Phase
	// Run runs it. It builds its labs through env (which tears them
	// down), writes its CSV files and plots through env, and returns the
	// report's content; an error means no usable result.
	Run func(ctx context.Context, env *Env) (*Result, error)
	// TimedPhases, if set, makes the experiment take a duration (`dysco
	// lab run --duration`, Config.Duration): its workload runs that long,
	// with the other figures of its size, and these are its phases.
	TimedPhases func(d time.Duration) []Phase
}

var registry = map[string]*Experiment{}

// Register adds an experiment; a second one of the same name panics.
func Register(e *Experiment) {
	if _, dup := registry[e.Name]; dup {
		panic("experiment: " + e.Name + " registered twice")
	}
	if e.Run == nil || e.Phases == nil {
		panic("experiment: " + e.Name + " has no Run or Phases")
	}
	registry[e.Name] = e
}

// Lookup returns the named experiment.
func Lookup(name string) (*Experiment, error) {
	if e, ok := registry[name]; ok {
		return e, nil
	}
	return nil, fmt.Errorf("unknown experiment %q (known: %s)", name, strings.Join(Names(), ", "))
}

// Names lists the registered experiments, sorted.
func Names() []string {
	var n []string
	for k := range registry {
		n = append(n, k)
	}
	sort.Strings(n)
	return n
}

// Config is what a run of an experiment needs from its caller.
type Config struct {
	Dysco     string   // dysco binary for the agents and the CLI
	Libdysco  string   // lib/libdysco.so (proxy-removal)
	Size      Size     // tiny, quick or full
	OutDir    string   // where its files go (created)
	AgentArgs []string // extra arguments for every agent
	// Duration, if set, is how long the workload of a timed experiment
	// runs (Experiment.TimedPhases); 0 for its size's default.
	Duration time.Duration
	Log      io.Writer // progress lines
	// Command is the command line, for the report.
	Command string
}

// Env is what an experiment's Run works with.
type Env struct {
	Config
	// O are the options of the runners shared with `make bench`, set to
	// the size's defaults; an experiment adjusts the fields it uses.
	O   *bench.Options
	rep *bench.Report // figures and details of the shared runners
	pr  *labkit.Progress
	set *labkit.Labs
	// Prefix starts the names of the run's labs.
	Prefix string
	files  []string
}

// Begin starts a phase of the progress plan.
func (env *Env) Begin(name string) { env.pr.Begin(name) }

// Logf prints a progress line.
func (env *Env) Logf(format string, args ...any) { env.pr.Logf(format, args...) }

// Down tears down every lab built so far.
func (env *Env) Down() error { return env.set.Down() }

// Result is what an experiment found; it becomes data.json and report.md.
type Result struct {
	Experiment string        `json:"experiment"`
	Title      string        `json:"title"`
	Paper      string        `json:"paper"`
	Size       string        `json:"size"`
	Command    string        `json:"command"`
	Started    time.Time     `json:"started"`
	Finished   time.Time     `json:"finished"`
	Machine    bench.EnvInfo `json:"machine"`
	// Setup describes what ran, one item per line of a list.
	Setup []string `json:"setup"`
	// Comparisons are our figures and the paper's, side by side.
	Comparisons []Comparison `json:"comparisons"`
	Plots       []Plot       `json:"plots"`
	// Files are the raw data files written beside the report.
	Files []string `json:"files"`
	// Headline is three lines of figures (printed by `make demo`).
	Headline []string `json:"headline"`
	// Problems are checks that failed (a run with problems is an error).
	Problems []string `json:"problems,omitempty"`
	// Notes are anything else worth knowing.
	Notes []string `json:"notes,omitempty"`
	// Data is the experiment's raw data.
	Data any `json:"data"`
}

// Comparison is one row of the report's table.
type Comparison struct {
	What       string `json:"what"`
	Ours       string `json:"ours"`
	Paper      string `json:"paper"`
	Difference string `json:"difference"`
}

// Plot is a PNG written beside the report, with what it shows.
type Plot struct {
	File  string `json:"file"`
	Title string `json:"title"`
	Shows string `json:"shows"`
}

func (r *Result) problem(format string, args ...any) {
	r.Problems = append(r.Problems, fmt.Sprintf(format, args...))
}

// RunExperiment runs the named experiment: it checks the tools, builds
// and always tears down its labs, and writes data.json, the CSV files, the
// plots and report.md to cfg.OutDir. The result is returned also when the
// run failed part-way (what was measured is written).
func RunExperiment(ctx context.Context, name string, cfg Config) (res *Result, err error) {
	e, err := Lookup(name)
	if err != nil {
		return nil, err
	}
	if cfg.Log == nil {
		cfg.Log = io.Discard
	}
	if cfg.Duration != 0 && (e.TimedPhases == nil || cfg.Duration < 0) {
		if e.TimedPhases == nil {
			return nil, fmt.Errorf("experiment %s does not take a duration (its sizes set how long it runs)", name)
		}
		return nil, fmt.Errorf("duration %v: not positive", cfg.Duration)
	}
	bin, err := exec.LookPath(cfg.Dysco)
	if err != nil {
		return nil, fmt.Errorf("dysco binary %q: %w (run `make build`)", cfg.Dysco, err)
	}
	if cfg.Dysco, err = filepath.Abs(bin); err != nil {
		return nil, err
	}
	if cfg.Libdysco != "" {
		if cfg.Libdysco, err = filepath.Abs(cfg.Libdysco); err != nil {
			return nil, err
		}
	}
	for _, tool := range append([]string{"ip"}, e.Tools...) {
		if _, err := exec.LookPath(tool); err != nil {
			return nil, fmt.Errorf("experiment %s needs %s: run scripts/deps.sh (%w)", name, tool, err)
		}
	}
	if cfg.OutDir == "" {
		cfg.OutDir = filepath.Join("out", "experiments", name)
	}
	if err := os.MkdirAll(cfg.OutDir, 0o755); err != nil {
		return nil, err
	}
	o := &bench.Options{Dysco: cfg.Dysco, Libdysco: cfg.Libdysco, Quick: cfg.Size != Full,
		OutDir: cfg.OutDir, AgentArgs: cfg.AgentArgs, Only: []string{name}}
	if cfg.Size == Tiny {
		o.Reps = 1
	}
	o.Defaults()
	// Alternating chunks of connect() calls, except in tiny runs.
	o.Quick = cfg.Size == Tiny
	prefix := labkit.RunID()
	prefix = "x" + prefix[1:]
	// The labs' logs are kept while the run goes and removed when it
	// succeeds: a failed run leaves them next to its report.
	logDir := filepath.Join(cfg.OutDir, "logs")
	if err := os.RemoveAll(logDir); err != nil {
		return nil, err
	}
	env := &Env{Config: cfg, O: o, rep: bench.NewReport(o), set: &labkit.Labs{LogDir: logDir}, Prefix: prefix}
	var phases []labkit.Phase
	plan := e.Phases(cfg.Size)
	if cfg.Duration > 0 {
		plan = e.TimedPhases(cfg.Duration)
	}
	for _, p := range plan {
		phases = append(phases, labkit.Phase{Name: p.Name, Est: p.Est})
	}
	env.pr = labkit.NewProgress(cfg.Log, phases)
	env.pr.Tag = "lab run " + name
	started := time.Now().UTC()
	env.Logf("%s (%s), %s run; labs %s*; files in %s", name, e.Paper, cfg.Size, prefix, cfg.OutDir)
	defer func() {
		if derr := env.set.Down(); derr != nil {
			err = errors.Join(err, derr)
		}
		if res == nil {
			return
		}
		res.Experiment, res.Paper, res.Size, res.Command = name, e.Paper, cfg.Size.String(), cfg.Command
		res.Started, res.Finished, res.Machine = started, time.Now().UTC(), env.rep.Env
		for _, f := range env.files {
			if !slices.Contains(res.Files, f) {
				res.Files = append(res.Files, f)
			}
		}
		if werr := writeResult(cfg.OutDir, res); werr != nil {
			err = errors.Join(err, werr)
		}
		if err == nil && len(res.Problems) > 0 {
			err = fmt.Errorf("%s: %d check(s) failed: %s", name, len(res.Problems), strings.Join(res.Problems, "; "))
		}
		if err == nil {
			err = os.RemoveAll(logDir)
		} else if _, serr := os.Stat(logDir); serr == nil {
			env.Logf("the labs' logs (agents and programs) are in %s", logDir)
		}
		env.Logf("done in %s: report %s", labkit.FmtClock(res.Finished.Sub(started)), filepath.Join(cfg.OutDir, "report.md"))
	}()
	res, err = e.Run(ctx, env)
	if err != nil && ctx.Err() != nil {
		err = fmt.Errorf("interrupted: %w", err)
	}
	return res, err
}
