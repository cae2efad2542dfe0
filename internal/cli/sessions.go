package cli

import (
	"fmt"
	"io"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/dysco/dysco/internal/api"
)

func init() { register(newSessionsCmd) }

func newSessionsCmd() *cobra.Command {
	var (
		output *string
		remote remoteFlags
		limit  int
	)
	cmd := &cobra.Command{
		Use:   "sessions",
		Short: "List the sessions the local agent knows, with their subsessions and counters",
		Long: `List the sessions of the agent of this network namespace: the session
five-tuple, this host's role in the chain (start, middle, end), the state,
the subsessions on its left and right, the chain still ahead at set-up, and
the packets and bytes seen forward and in reverse.

With --server URL --host AGENT the policy server asks the agent named AGENT
(its --name) instead: its first --limit sessions, and how many it has.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			format, err := parseOutput(*output)
			if err != nil {
				return err
			}
			if err := remote.check(); err != nil {
				return err
			}
			var (
				ss    []api.Session
				total = -1
			)
			if remote.server != "" {
				op, err := remote.query(cmd, api.QuerySessions, limit)
				if err != nil {
					return err
				}
				if op.Sessions != nil {
					ss, total = op.Sessions.Sessions, op.Sessions.Total
				}
			} else if ss, err = agentClient().Sessions(cmd.Context()); err != nil {
				return err
			}
			if format == outputJSON {
				if ss == nil {
					ss = []api.Session{}
				}
				return writeJSONOut(cmd.OutOrStdout(), ss)
			}
			if len(ss) == 0 {
				fmt.Fprintln(cmd.OutOrStdout(), "no sessions")
				return nil
			}
			if err := printSessions(cmd.OutOrStdout(), ss); err != nil {
				return err
			}
			if total > len(ss) {
				fmt.Fprintf(cmd.OutOrStdout(), "(%d of the agent's %d sessions; --limit for more)\n", len(ss), total)
			}
			return nil
		},
	}
	output = addOutputFlag(cmd)
	remote.queryFlags(cmd, &limit, "sessions")
	return cmd
}

func printSessions(w io.Writer, ss []api.Session) error {
	tw := newTabWriter(w)
	fmt.Fprintln(tw, "ID\tPROTO\tSESSION\tROLE\tSTATE\tLEFT\tRIGHT\tCHAIN\tPKTS FWD/REV\tBYTES FWD/REV\tAGE")
	for _, s := range ss {
		fmt.Fprintf(tw, "%d\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%d/%d\t%s/%s\t%s\n",
			s.ID, orDash(s.Proto), s.Session, orDash(s.Role), orDash(s.State), orDash(s.Left), orDash(s.Right),
			orDash(strings.Join(s.Chain, ",")), s.PacketsFwd, s.PacketsRev,
			formatBytes(s.BytesFwd), formatBytes(s.BytesRev), formatAge(s.AgeSeconds))
	}
	return tw.Flush()
}

// formatBytes writes n with a binary unit: 512B, 3.4KiB, 12.0MiB.
func formatBytes(n uint64) string {
	if n < 1024 {
		return fmt.Sprintf("%dB", n)
	}
	v := float64(n)
	for _, unit := range []string{"KiB", "MiB", "GiB", "TiB"} {
		v /= 1024
		if v < 1024 || unit == "TiB" {
			return fmt.Sprintf("%.1f%s", v, unit)
		}
	}
	panic("unreachable")
}

// formatAge writes a number of seconds as a duration rounded to the second.
func formatAge(sec float64) string {
	return (time.Duration(sec * float64(time.Second))).Round(time.Second).String()
}
