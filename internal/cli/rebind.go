package cli

import (
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/dysco/dysco/internal/api"
)

func init() { register(newRebindCmd) }

func newRebindCmd() *cobra.Command {
	var (
		match   string
		via     string
		timeout time.Duration
		asJSON  bool
	)
	cmd := &cobra.Command{
		Use:   "rebind --match 'FILTER' --via ADDR [--timeout 10s] [--json]",
		Short: "Move the sessions this host is an end of to another of its addresses, at once",
		Long: `Rebind the live sessions at this host that match FILTER and that this host
is an end of (it starts them, or they end here) to ADDR, another address of
this host (break before make, M2M §4.2.3; docs/mobility.md). For each of
them, the subsession between this host and its neighbour on the session's
path (its first middlebox, or the other end when the chain is empty) moves
to ADDR: this host sends an authenticated rebind from ADDR, the neighbour
moves its end at once and answers, and this host then sends from ADDR too.
The session's tuple, its other subsessions and its middleboxes do not
change. Packets this host sends during the rebind are held and sent on
afterwards; packets already on their way to the old address arrive there
while the old subsession lingers.

The agent rebinds by itself when the address a session leaves from goes
away (docs/mobility.md); use this command when it cannot know: the old
address is about to go, or the network no longer reaches it. While the old
address works, "dysco reconfig --via" moves sessions with no packet lost.
A session already on ADDR succeeds as "unchanged"; sessions of the other
address family, and those this host forwards as a middlebox, are left out.

` + matchSemantics + `

` + outcomeSemantics,
		Example: `  # move every session of this host to its second link's address
  dysco rebind --match tcp --via 10.202.1.2
  # only the web sessions, as JSON
  dysco rebind --match 'tcp port 443' --via fd00:dc:2:1::2 --json`,
		Args: noArgsUse("give the filter with --match 'FILTER'"),
		RunE: func(cmd *cobra.Command, _ []string) error {
			if !cmd.Flags().Changed("match") {
				return errors.New(`--match is required: a tcpdump filter selecting the sessions ("tcp" selects every TCP session)`)
			}
			if strings.TrimSpace(match) == "" {
				return errors.New(`--match "": empty filter (use --match tcp to rebind every TCP session)`)
			}
			if err := checkMatch(match); err != nil {
				return err
			}
			if !cmd.Flags().Changed("via") {
				return errors.New("--via is required: the address of this host the sessions move to")
			}
			to, err := parseAddr("--via", via)
			if err != nil {
				return err
			}
			tms, err := timeoutMS(timeout)
			if err != nil {
				return err
			}
			req := api.RebindRequest{Match: match, Via: to, TimeoutMS: tms}
			rep, err := agentClient().Rebind(cmd.Context(), req)
			if err != nil {
				return err
			}
			return reportResults(cmd.OutOrStdout(), rep, asJSON,
				fmt.Sprintf("no live session of the local agent that it is an end of matches %q with a %s address", match, family(to)))
		},
	}
	f := cmd.Flags()
	f.StringVar(&match, "match", "", "tcpdump filter selecting the sessions, tested against their first SYN (required)")
	f.StringVar(&via, "via", "", "address of this host the sessions move to (required)")
	f.DurationVar(&timeout, "timeout", defaultReconfigTimeout, "how long the agent waits for the sessions' results")
	f.BoolVar(&asJSON, "json", false, "print the agent's reply as JSON")
	return cmd
}

// family names an address's family.
func family(a interface{ Is4() bool }) string {
	if a.Is4() {
		return "IPv4"
	}
	return "IPv6"
}
