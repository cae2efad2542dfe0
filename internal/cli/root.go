// Package cli holds the dysco subcommands, one file per subcommand.
package cli

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"github.com/spf13/cobra"
)

// commands holds the constructors of the top-level subcommands; each
// subcommand's file registers itself from init.
var commands []func() *cobra.Command

func register(f func() *cobra.Command) { commands = append(commands, f) }

// Root builds the command tree.
func Root() *cobra.Command {
	root := &cobra.Command{
		Use:   "dysco",
		Short: "Session-level dynamic service chaining for Linux",
		Long: `Session-level dynamic service chaining for Linux.

The commands that talk to the local agent reach it on the abstract Unix
socket @dysco-agent of the caller's network namespace, and first check
that the process serving it runs as root (or as the uid in
DYSCO_AGENT_UID): a socket another user bound is refused, naming its pid
and uid, before anything is sent.`,
		SilenceUsage:  true,
		SilenceErrors: true,
	}
	for _, f := range commands {
		root.AddCommand(f())
	}
	return root
}

// Main runs the CLI and returns the process exit code. SIGINT and SIGTERM
// cancel the command's context so that long-running commands clean up.
func Main(args []string) int {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	root := Root()
	root.SetArgs(args)
	if err := root.ExecuteContext(ctx); err != nil {
		var ee exitError
		if errors.As(err, &ee) {
			return int(ee)
		}
		fmt.Fprintln(os.Stderr, "dysco:", err)
		return 1
	}
	return 0
}

// exitError lets a command choose its exit code after printing its own message.
type exitError int

func (e exitError) Error() string { return fmt.Sprintf("exit status %d", int(e)) }
