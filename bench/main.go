// Command bench runs Dysco's benchmarks (`make bench`, scripts/bench.sh):
// Dysco against a plain-routing baseline, side by side in one run. The
// runners live in internal/bench, which `dysco lab run` shares; see
// BENCHMARKS.md for the method and docs/experiments.md for the paper's
// evaluation.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"github.com/dysco/dysco/internal/bench"
)

func main() {
	o, err := bench.ParseFlags(os.Args[1:])
	if errors.Is(err, flag.ErrHelp) {
		os.Exit(0)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		os.Exit(2)
	}
	if os.Geteuid() != 0 {
		fmt.Fprintln(os.Stderr, "bench: needs root (network namespaces, eBPF)")
		os.Exit(2)
	}
	// The first Ctrl-C cancels the run; the handler stays installed so that
	// further ones do not kill the runner before it has torn the labs down.
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM, syscall.SIGHUP)
	defer stop()
	rep, err := bench.Run(ctx, o, os.Stderr)
	if ctx.Err() != nil {
		// Partial results go to JSON only, never over the last full
		// results in the Markdown file.
		o.Markdown = ""
	}
	if rep != nil {
		if werr := bench.WriteOutputs(o, rep, os.Stderr); werr != nil {
			err = errors.Join(err, werr)
		}
	}
	if ctx.Err() != nil {
		fmt.Fprintln(os.Stderr, "bench: interrupted; labs torn down")
		os.Exit(130)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		os.Exit(1)
	}
}
