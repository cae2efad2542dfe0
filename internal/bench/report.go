package bench

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/dysco/dysco/internal/labkit"
)

// Report is everything one run measured; it is written as JSON.
type Report struct {
	// RunID prefixes the names of the run's labs.
	RunID    string    `json:"run_id"`
	Started  time.Time `json:"started"`
	Finished time.Time `json:"finished"`
	Env      EnvInfo   `json:"env"`
	Options  *Options  `json:"options"`
	Figures  []*Figure `json:"figures"`
	// Errors are the benchmarks that could not run, with why.
	Errors []string `json:"errors,omitempty"`
	// Details holds per-benchmark raw data (samples, counters, map sizes).
	Details map[string]any `json:"details"`
}

// EnvInfo describes the machine.
type EnvInfo struct {
	Kernel   string `json:"kernel"`
	Nproc    int    `json:"nproc"`
	CPU      string `json:"cpu"`
	MemTotal string `json:"mem_total"`
	Go       string `json:"go"`
	Commit   string `json:"commit"`
	Iperf3   string `json:"iperf3"`
	Wrk      string `json:"wrk"`
	Nginx    string `json:"nginx"`
}

// Figure is one row of the results table.
type Figure struct {
	Key     string `json:"key"`
	Name    string `json:"name"`
	Command string `json:"command"`
	Unit    string `json:"unit"`
	// Dysco and Baseline are the figures compared (medians), NaN when
	// there is no baseline.
	Dysco    float64 `json:"dysco"`
	Baseline float64 `json:"baseline"`
	// DyscoText and BaselineText, if set, replace the formatted figures
	// (to add a p99, for example).
	DyscoText    string  `json:"dysco_text,omitempty"`
	BaselineText string  `json:"baseline_text,omitempty"`
	Ratio        float64 `json:"ratio"`
	// Measured is what the target judges, in MeasuredUnit.
	Measured     float64 `json:"measured"`
	MeasuredUnit string  `json:"measured_unit"`
	Target       string  `json:"target"`
	Paper        string  `json:"paper,omitempty"`
	// Met is "yes", "no" or "n/a".
	Met  string `json:"met"`
	Note string `json:"note,omitempty"`
}

// MarshalJSON writes NaN as null.
func (f *Figure) MarshalJSON() ([]byte, error) {
	type plain Figure
	type withNulls struct {
		*plain
		Dysco    *float64 `json:"dysco"`
		Baseline *float64 `json:"baseline"`
		Ratio    *float64 `json:"ratio"`
		Measured *float64 `json:"measured"`
	}
	p := labkit.JSONNum
	return json.Marshal(withNulls{(*plain)(f), p(f.Dysco), p(f.Baseline), p(f.Ratio), p(f.Measured)})
}

func metStr(ok bool) string {
	if ok {
		return "yes"
	}
	return "no"
}

// NewReport starts the report of a run with the options o.
func NewReport(o *Options) *Report {
	return &Report{Started: time.Now().UTC(), Env: environment(), Options: o, Details: map[string]any{}}
}

func (r *Report) add(f *Figure) { r.Figures = append(r.Figures, f) }

func (r *Report) fail(bench string, err error) {
	r.Errors = append(r.Errors, fmt.Sprintf("%s: %v", bench, err))
}

func environment() EnvInfo {
	var e EnvInfo
	var u unix.Utsname
	if unix.Uname(&u) == nil {
		e.Kernel = unix.ByteSliceToString(u.Release[:])
	}
	e.Nproc = runtime.NumCPU()
	if b, err := os.ReadFile("/proc/cpuinfo"); err == nil {
		for _, l := range strings.Split(string(b), "\n") {
			if strings.HasPrefix(l, "model name") {
				if i := strings.Index(l, ":"); i >= 0 {
					e.CPU = strings.TrimSpace(l[i+1:])
				}
				break
			}
		}
	}
	if b, err := os.ReadFile("/proc/meminfo"); err == nil {
		for _, l := range strings.Split(string(b), "\n") {
			if strings.HasPrefix(l, "MemTotal:") {
				e.MemTotal = strings.TrimSpace(strings.TrimPrefix(l, "MemTotal:"))
			}
		}
	}
	e.Go = runtime.Version()
	first := func(name string, args ...string) string {
		out, _ := exec.Command(name, args...).CombinedOutput()
		line, _, _ := strings.Cut(strings.TrimSpace(string(out)), "\n")
		return line
	}
	e.Commit = first("git", "rev-parse", "--short", "HEAD")
	if out, err := exec.Command("git", "status", "--porcelain", "--untracked-files=no").Output(); err == nil && len(bytes.TrimSpace(out)) > 0 {
		e.Commit += " (with uncommitted changes)"
	}
	e.Iperf3 = first("iperf3", "--version")
	e.Wrk = first("wrk", "--version")
	e.Nginx = first("nginx", "-v")
	return e
}

// WriteOutputs writes the raw JSON and, if asked, the Markdown results.
func WriteOutputs(o *Options, r *Report, log io.Writer) error {
	if r.Finished.IsZero() {
		r.Finished = time.Now().UTC()
	}
	if err := os.MkdirAll(o.OutDir, 0o755); err != nil {
		return err
	}
	data, err := json.MarshalIndent(r, "", "  ")
	if err != nil {
		return err
	}
	name := filepath.Join(o.OutDir, fmt.Sprintf("%s-%s.json", r.Started.Format("20060102T150405Z"), o.mode()))
	if err := os.WriteFile(name, append(data, '\n'), 0o644); err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(o.OutDir, "latest.json"), append(data, '\n'), 0o644); err != nil {
		return err
	}
	fmt.Fprintf(log, "bench: raw results in %s\n", name)
	md := markdown(r)
	fmt.Fprintf(log, "\n%s\n", md)
	if o.Markdown == "" {
		return nil
	}
	if err := updateMarkdown(o.Markdown, md); err != nil {
		return err
	}
	fmt.Fprintf(log, "bench: results written to %s\n", o.Markdown)
	return nil
}

// Markers of the generated part of BENCHMARKS.md.
const (
	mdBegin = "<!-- bench:results:begin (generated by scripts/bench.sh; do not edit by hand) -->"
	mdEnd   = "<!-- bench:results:end -->"
)

// updateMarkdown replaces the generated results section of path, or
// appends one if the file has none.
func updateMarkdown(path, md string) error {
	old, err := os.ReadFile(path)
	if err != nil && !os.IsNotExist(err) {
		return err
	}
	section := mdBegin + "\n" + md + mdEnd + "\n"
	s := string(old)
	i, j := strings.Index(s, mdBegin), strings.Index(s, mdEnd)
	switch {
	case i >= 0 && j > i:
		s = s[:i] + section + strings.TrimPrefix(s[j+len(mdEnd):], "\n")
	case len(s) == 0:
		s = "# Benchmarks\n\n" + section
	default:
		s = strings.TrimRight(s, "\n") + "\n\n" + section
	}
	return os.WriteFile(path, []byte(s), 0o644)
}

// markdown renders the results table and the environment.
func markdown(r *Report) string {
	var b strings.Builder
	mode := r.Options.mode() + " run"
	if r.Options.Quick {
		mode = "quick run (smoke test: figures are not meaningful)"
	}
	fmt.Fprintf(&b, "### Results of %s (%s)\n\n", r.Started.Format("2006-01-02 15:04 UTC"), mode)
	o := r.Options
	fmt.Fprintf(&b, "- machine: Linux %s, %d CPUs (`nproc`), %s, %s RAM; shared and noisy\n", r.Env.Kernel, r.Env.Nproc, r.Env.CPU, r.Env.MemTotal)
	fmt.Fprintf(&b, "- software: %s, %s, %s, %s; commit %s\n", r.Env.Go, r.Env.Iperf3, r.Env.Wrk, r.Env.Nginx, r.Env.Commit)
	fmt.Fprintf(&b, "- command: `scripts/bench.sh%s` (%d repetitions of each Dysco/baseline pair, interleaved; iperf3 %v after 1 s omitted, wrk %v, %d connect() calls per variant and setting, %d sessions for memory); took %s\n",
		argsText(o.Args), o.Reps, o.IperfTime, o.WrkTime, o.Connects, o.Sessions, r.Finished.Sub(r.Started).Round(time.Second))
	b.WriteString("- `LAB` is the Dysco lab or the baseline lab (same line topology; the Dysco lab runs agents and a policy chaining the middleboxes). Dysco and baseline figures are medians over the repetitions.\n\n")
	b.WriteString("| figure | command | Dysco | baseline | ratio | measured | target [paper] | met |\n")
	b.WriteString("|---|---|---|---|---|---|---|---|\n")
	for _, f := range r.Figures {
		dt, bt := f.DyscoText, f.BaselineText
		if dt == "" {
			dt = fmtVal(f.Dysco, f.Unit)
		}
		if bt == "" {
			bt = fmtVal(f.Baseline, f.Unit)
		}
		target := f.Target
		if f.Paper != "" {
			target += " [" + f.Paper + "]"
		}
		fmt.Fprintf(&b, "| %s | `%s` | %s | %s | %s | %s | %s | %s |\n",
			f.Name, f.Command, dt, bt, fmtRatio(f.Ratio), fmtVal(f.Measured, f.MeasuredUnit), target, f.Met)
	}
	var notes []string
	for _, f := range r.Figures {
		if f.Note != "" {
			notes = append(notes, fmt.Sprintf("- %s: %s", f.Name, f.Note))
		}
	}
	if len(notes) > 0 {
		b.WriteString("\nNotes:\n\n" + strings.Join(notes, "\n") + "\n")
	}
	if len(r.Errors) > 0 {
		b.WriteString("\nNot measured:\n\n")
		for _, e := range r.Errors {
			fmt.Fprintf(&b, "- %s\n", strings.ReplaceAll(strings.TrimSpace(e), "\n", " "))
		}
	}
	return b.String()
}

func argsText(args []string) string {
	if len(args) == 0 {
		return ""
	}
	return " " + strings.Join(args, " ")
}

func fmtVal(v float64, unit string) string {
	if math.IsNaN(v) || math.IsInf(v, 0) {
		return "–"
	}
	var s string
	switch {
	case math.Abs(v) >= 1000:
		s = fmt.Sprintf("%.0f", v)
	case math.Abs(v) >= 100:
		s = fmt.Sprintf("%.1f", v)
	default:
		s = fmt.Sprintf("%.2f", v)
	}
	if unit != "" {
		s += " " + unit
	}
	return s
}

func fmtRatio(v float64) string {
	if math.IsNaN(v) || math.IsInf(v, 0) {
		return "–"
	}
	return fmt.Sprintf("%.3f", v)
}
