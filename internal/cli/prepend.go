package cli

import (
	"fmt"
	"net/netip"
	"strings"

	"github.com/dysco/dysco/internal/api"
	"github.com/spf13/cobra"
)

func init() { register(newPrependCmd) }

func newPrependCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "prepend 'SRC:PORT -> DST:PORT' HOP[,HOP…]",
		Short: "Choose the next middleboxes of a session whose SYN this middlebox holds",
		Long: `Put hops at the head of the untraversed part of a session's address list
(paper §2.2). A middlebox such as an application classifier calls this on its
own host while it holds the session's SYN (for example from an NFQUEUE), then
lets the SYN go: it continues to the hops given, then to the rest of the chain.

The session is named by its tuple as it entered this host.`,
		Args: cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			hops, err := parsePrependHops(args[1])
			if err != nil {
				return err
			}
			req := api.PrependRequest{Session: args[0], Hops: hops}
			rep, err := agentClient().Prepend(cmd.Context(), req)
			if err != nil {
				return err
			}
			fmt.Fprintf(cmd.OutOrStdout(), "session %d now goes on through %s\n", rep.ID, strings.Join(rep.Chain, ", "))
			return nil
		},
	}
}

// parsePrependHops reads prepend's comma-separated hop list: IP addresses,
// IPv4-mapped ones as IPv4.
func parsePrependHops(list string) ([]netip.Addr, error) {
	var hops []netip.Addr
	for _, h := range strings.Split(list, ",") {
		a, err := netip.ParseAddr(strings.TrimSpace(h))
		if err != nil {
			return nil, fmt.Errorf("hop %q: not an IP address", h)
		}
		hops = append(hops, a.Unmap())
	}
	return hops, nil
}
