package cli

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/dysco/dysco/internal/experiment"
)

// newLabRunCmd is `dysco lab run`: the paper's evaluation as lab
// experiments (internal/experiment, docs/experiments.md).
func newLabRunCmd() *cobra.Command {
	var (
		quick, full, tiny, list bool
		out, agentBin, lib      string
		agentArgs               []string
		duration                time.Duration
	)
	cmd := &cobra.Command{
		Use:   "run EXPERIMENT [--quick|--full|--tiny] [--duration D] [--out DIR]",
		Short: "Run one of the paper's experiments in labs: raw data, plots and a report",
		Long: `Run an experiment of the paper's evaluation (§5) in labs built for it, and
write its raw data (CSV, data.json), PNG plots and report.md (our figures
beside the paper's) to --out (default out/experiments/EXPERIMENT). Progress
goes to stderr; the labs are always torn down, also on failure or Ctrl-C.

--quick (the default) takes a few minutes on two cores; --full uses the
paper's scale where the machine allows. Experiments that run a workload for
as long as asked (churn) also take --duration. Experiments: ` + strings.Join(experiment.Names(), ", ") + `.
See docs/experiments.md.`,
		Example: `  dysco lab run proxy-removal
  dysco lab run goodput --full --out /tmp/goodput
  dysco lab run churn --duration 30m
  dysco lab run --list`,
		Args: cobra.MaximumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if list {
				for _, n := range experiment.Names() {
					e, _ := experiment.Lookup(n)
					fmt.Fprintf(cmd.OutOrStdout(), "%-20s %-14s %s\n", n, e.Paper, e.Summary)
				}
				return nil
			}
			if len(args) != 1 {
				return fmt.Errorf("say which experiment to run (%s), or --list", strings.Join(experiment.Names(), ", "))
			}
			n := 0
			size := experiment.Quick
			for _, f := range []struct {
				on bool
				s  experiment.Size
			}{{quick, experiment.Quick}, {full, experiment.Full}, {tiny, experiment.Tiny}} {
				if f.on {
					n++
					size = f.s
				}
			}
			if n > 1 {
				return errors.New("give one of --quick, --full and --tiny")
			}
			if os.Geteuid() != 0 {
				return errors.New("lab run needs root (network namespaces, eBPF)")
			}
			if agentBin == "" {
				exe, err := os.Executable()
				if err != nil {
					return fmt.Errorf("finding the dysco binary for the agents: %w (give --agent-binary)", err)
				}
				agentBin = exe
			}
			if lib == "" {
				lib = "lib/libdysco.so"
				if _, err := os.Stat(lib); err != nil {
					lib = filepath.Join(filepath.Dir(agentBin), "..", "lib", "libdysco.so")
				}
			}
			res, err := experiment.RunExperiment(cmd.Context(), args[0], experiment.Config{
				Dysco: agentBin, Libdysco: lib, Size: size, OutDir: out, AgentArgs: agentArgs, Duration: duration,
				Log: cmd.ErrOrStderr(), Command: "dysco lab run " + strings.Join(os.Args[3:], " "),
			})
			if res != nil {
				dir := out
				if dir == "" {
					dir = filepath.Join("out", "experiments", args[0])
				}
				w := cmd.OutOrStdout()
				fmt.Fprintf(w, "report: %s\nplots:", filepath.Join(dir, "report.md"))
				for _, p := range res.Plots {
					fmt.Fprintf(w, " %s", filepath.Join(dir, p.File))
				}
				fmt.Fprintln(w)
				for _, h := range res.Headline {
					fmt.Fprintf(w, "  %s\n", h)
				}
			}
			return err
		},
	}
	f := cmd.Flags()
	f.BoolVar(&quick, "quick", false, "a few minutes on two cores (the default)")
	f.BoolVar(&full, "full", false, "the paper's scale where the machine allows (long)")
	f.BoolVar(&tiny, "tiny", false, "the smallest run that produces every file (what the tests run)")
	f.BoolVar(&list, "list", false, "list the experiments")
	f.StringVar(&out, "out", "", "directory for the report, plots and raw data (default out/experiments/EXPERIMENT)")
	f.StringVar(&agentBin, "agent-binary", "", "dysco binary for the agents and the CLI (default: this binary)")
	f.StringVar(&lib, "libdysco", "", "libdysco.so preloaded into HAProxy (default lib/libdysco.so, or ../lib beside the binary)")
	f.StringArrayVar(&agentArgs, "agent-arg", nil, "extra argument for every agent (repeat for several)")
	f.DurationVar(&duration, "duration", 0, "how long the workload runs, for experiments that take it (churn); the other figures come from the size")
	return cmd
}
