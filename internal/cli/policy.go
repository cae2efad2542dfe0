package cli

import (
	"errors"
	"fmt"
	"io"
	"net/netip"
	"regexp"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/dysco/dysco/internal/api"
	"github.com/dysco/dysco/internal/certs"
	"github.com/dysco/dysco/internal/policy"
)

func init() {
	register(newPolicyCmd)
	register(newTypeCmd)
}

const serverFlagUsage = "policy server URL (https://HOST:7017, with the operator certificate of --pki-dir; http:// for a server run with --insecure), or several replicas' URLs separated by commas; default: the local agent"

// where says where a change went, for the confirmation line.
func where(c *api.Client, serverURL string) string {
	if serverURL == "" {
		return "on the local agent"
	}
	return "on " + c.Target()
}

func newPolicyCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "policy",
		Short: "Add, list and remove the policies that steer sessions through middleboxes",
		Long: `A policy sends the sessions whose first packet matches a tcpdump filter
through a chain of middleboxes (paper §2.2). Policies live on the local agent, or on
the policy server (--server), which hands them to the agents.`,
	}
	cmd.AddCommand(newPolicyAddCmd(), newPolicyListCmd(), newPolicyRmCmd(), newPolicyTestCmd())
	return cmd
}

// policyNameRE mirrors the name rule of api.Policy.Validate, to tell a
// missing NAME from a missing FILTER.
var policyNameRE = regexp.MustCompile(`^[A-Za-z][A-Za-z0-9._-]{0,62}$`)

// policyArgs reads NAME and the FILTER (the remaining arguments, joined as
// tcpdump joins its own).
func policyArgs(args []string) (name, filter string, err error) {
	const usage = "usage: dysco policy add NAME --chain HOP[,HOP...] 'FILTER'"
	switch {
	case len(args) == 0:
		return "", "", errors.New("missing policy NAME and FILTER; " + usage)
	case len(args) == 1 && !policyNameRE.MatchString(args[0]):
		return "", "", fmt.Errorf("missing policy NAME before the filter %q; %s", args[0], usage)
	case len(args) == 1:
		return "", "", fmt.Errorf("missing FILTER after the policy name %q (\"tcp\" matches every TCP session); %s", args[0], usage)
	}
	return args[0], strings.Join(args[1:], " "), nil
}

func newPolicyAddCmd() *cobra.Command {
	var (
		chain    []string
		via      []string
		hosts    []string
		priority int
		endEarly bool
		idle     time.Duration
		server   string
		pki      pkiFlags
	)
	cmd := &cobra.Command{
		Use:   "add NAME [--chain HOP[,HOP...]] [flags] 'FILTER'",
		Short: "Add or replace a policy",
		Long: `Add the policy NAME, or replace it: sessions whose first packet (a TCP SYN,
or the first UDP datagram of a flow) matches FILTER (tcpdump syntax) go
through the chain of hops, each an IP address or the name of a middlebox type
(see "dysco type"). An empty chain makes matching sessions Dysco sessions
straight to their destination, so that a chain can be inserted later.

Dysco chains TCP and UDP sessions. A filter that matches neither (icmp, sctp,
"tcp[tcpflags] & tcp-ack != 0", which no SYN matches) is refused; one that also
matches other protocols (host 10.0.3.2) is accepted, and the packets of those
protocols pass unchained.

--idle sets how long a UDP session lives without a packet (1s to 18h); by
default 30s until it has seen packets both ways, 120s after.

--via spreads the sessions the policy starts over local addresses (a host
with several links): each session leaves from the one its hash picks among
those of its family, an address given k times getting k shares; the session
keeps its own source address. A session whose pick is not an address of an
interface of this host that carries traffic leaves as without --via; when
the address it left from goes, it moves back to its own (docs/mobility.md).`,
		Example: `  dysco policy add web --chain 10.0.1.2,nat 'tcp dst port 80'
  dysco policy add quic --chain fw --idle 5m 'udp dst port 4433'
  dysco policy add spread --via 10.0.1.5,10.0.2.5,10.0.2.5 'tcp dst port 443'
  dysco policy add --server https://10.0.0.9:7017 --host h1 ssh --chain ids tcp port 22`,
		RunE: func(cmd *cobra.Command, args []string) error {
			name, filter, err := policyArgs(args)
			if err != nil {
				return err
			}
			idleS, err := idleSeconds(idle)
			if err != nil {
				return err
			}
			p := api.Policy{Name: name, Filter: filter, EndBeforeDestination: endEarly, Priority: priority, Hosts: hosts, IdleTimeoutS: idleS}
			for _, s := range chain {
				h, err := api.ParseHop(s)
				if err != nil {
					return fmt.Errorf("--chain: %w", err)
				}
				p.Chain = append(p.Chain, h)
			}
			for _, s := range via {
				a, err := netip.ParseAddr(s)
				if err != nil {
					return fmt.Errorf("--via %q: not an IP address", s)
				}
				p.Via = append(p.Via, a.Unmap())
			}
			if server == "" && len(hosts) > 0 {
				return errors.New("--host only applies with --server: the policy server hands policies to the hosts named; the local agent takes every policy it is given")
			}
			// Compile validates p, compiles its filter with libpcap
			// and refuses one that matches no protocol dysco chains,
			// before anything is sent.
			compiled, err := policy.Compile(p)
			if err != nil {
				return err
			}
			c, err := clientFor(server, pki)
			if err != nil {
				return err
			}
			if err := c.PutPolicy(cmd.Context(), p); err != nil {
				return err
			}
			fmt.Fprintf(cmd.OutOrStdout(), "policy %q installed %s\n", p.Name, where(c, server))
			if note := compiled.Note(); note != "" {
				fmt.Fprintln(cmd.OutOrStdout(), note)
			}
			return nil
		},
	}
	f := cmd.Flags()
	f.DurationVar(&idle, "idle", 0, "idle timeout of the policy's UDP sessions, whole seconds from 1s to 18h (default 30s one way, 120s both ways)")
	f.StringSliceVar(&chain, "chain", nil, "middleboxes to traverse, in order: IP addresses or middlebox type names, comma-separated")
	f.StringSliceVar(&via, "via", nil, "local addresses the sessions leave from, spread by hash; repeat an address to weight it (comma-separated)")
	f.BoolVar(&endEarly, "end-before-destination", false, "end the chain at its last hop, which hands the plain SYN on to the destination (§2.4)")
	f.IntVar(&priority, "priority", 0, "evaluation order; lower first, then by name")
	f.StringSliceVar(&hosts, "host", nil, "agent to give the policy to (repeatable; default every agent; with --server only)")
	f.StringVar(&server, "server", "", serverFlagUsage)
	pki.add(f, certs.RoleOperator)
	return cmd
}

// idleSeconds turns --idle into api.Policy.IdleTimeoutS.
func idleSeconds(d time.Duration) (int, error) {
	if d == 0 {
		return 0, nil
	}
	if d < api.MinIdleTimeout || d > api.MaxIdleTimeout || d%time.Second != 0 {
		return 0, fmt.Errorf("--idle %v: want whole seconds from %v to %v (0 for the defaults, %v one way, %v both ways)",
			d, api.MinIdleTimeout, api.MaxIdleTimeout, api.DefaultIdleTimeoutOneWay, api.DefaultIdleTimeoutStream)
	}
	return int(d / time.Second), nil
}

func newPolicyListCmd() *cobra.Command {
	var (
		server string
		pki    pkiFlags
		output *string
	)
	cmd := &cobra.Command{
		Use:     "list",
		Aliases: []string{"ls"},
		Short:   "List the policies, in evaluation order",
		Args:    cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			format, err := parseOutput(*output)
			if err != nil {
				return err
			}
			c, err := clientFor(server, pki)
			if err != nil {
				return err
			}
			set, err := c.Policies(cmd.Context())
			if err != nil {
				return err
			}
			if format == outputJSON {
				return writeJSONOut(cmd.OutOrStdout(), set)
			}
			return printPolicies(cmd.OutOrStdout(), set)
		},
	}
	cmd.Flags().StringVar(&server, "server", "", serverFlagUsage)
	pki.add(cmd.Flags(), certs.RoleOperator)
	output = addOutputFlag(cmd)
	return cmd
}

func printPolicies(w io.Writer, set api.PolicySet) error {
	if len(set.Policies) == 0 {
		_, err := fmt.Fprintf(w, "no policies (version %d)\n", set.Version)
		return err
	}
	// The IDLE and VIA columns appear when a policy sets them.
	idle, via := false, false
	for _, p := range set.Policies {
		idle = idle || p.IdleTimeoutS != 0
		via = via || len(p.Via) > 0
	}
	tw := newTabWriter(w)
	fmt.Fprint(tw, "NAME\tPRIORITY\tFILTER\tCHAIN\tHOSTS")
	if idle {
		fmt.Fprint(tw, "\tIDLE")
	}
	if via {
		fmt.Fprint(tw, "\tVIA")
	}
	fmt.Fprintln(tw)
	for _, p := range set.Policies {
		fmt.Fprintf(tw, "%s\t%d\t%s\t%s\t%s", p.Name, p.Priority, p.Filter, chainString(p), hostsString(p.Hosts))
		if idle {
			fmt.Fprintf(tw, "\t%s", idleString(p))
		}
		if via {
			fmt.Fprintf(tw, "\t%s", viaString(p.Via))
		}
		fmt.Fprintln(tw)
	}
	return tw.Flush()
}

// chainString shows a chain as "10.0.1.2,nat", marking one that ends before
// the destination.
func chainString(p api.Policy) string {
	if len(p.Chain) == 0 {
		return "-"
	}
	hops := make([]string, len(p.Chain))
	for i, h := range p.Chain {
		hops[i] = h.String()
	}
	s := strings.Join(hops, ",")
	if p.EndBeforeDestination {
		s += " (ends before destination)"
	}
	return s
}

// idleString shows a policy's idle timeout, "-" for the defaults.
func idleString(p api.Policy) string {
	if p.IdleTimeoutS == 0 {
		return "-"
	}
	return p.IdleTimeout().String()
}

// viaString shows a policy's via addresses, "-" for none.
func viaString(via []netip.Addr) string {
	if len(via) == 0 {
		return "-"
	}
	s := make([]string, len(via))
	for i, a := range via {
		s[i] = a.String()
	}
	return strings.Join(s, ",")
}

func hostsString(hosts []string) string {
	if len(hosts) == 0 {
		return "*"
	}
	return strings.Join(hosts, ",")
}

func newPolicyRmCmd() *cobra.Command {
	var (
		server string
		pki    pkiFlags
	)
	cmd := &cobra.Command{
		Use:     "rm NAME...",
		Aliases: []string{"remove", "delete"},
		Short:   "Remove policies",
		Args:    cobra.MinimumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := clientFor(server, pki)
			if err != nil {
				return err
			}
			for _, name := range args {
				if err := c.DeletePolicy(cmd.Context(), name); err != nil {
					return err
				}
				fmt.Fprintf(cmd.OutOrStdout(), "policy %q removed %s\n", name, where(c, server))
			}
			return nil
		},
	}
	cmd.Flags().StringVar(&server, "server", "", serverFlagUsage)
	pki.add(cmd.Flags(), certs.RoleOperator)
	return cmd
}

func newTypeCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "type",
		Short: "Add, list and remove middlebox types (named sets of interchangeable instances)",
		Long: `A middlebox type names a set of interchangeable middlebox instances; a chain
hop that names a type is served by one of its instances, picked round robin
by the agent that sets the session up.`,
	}
	cmd.AddCommand(newTypeAddCmd(), newTypeListCmd(), newTypeRmCmd())
	return cmd
}

func newTypeAddCmd() *cobra.Command {
	var (
		server string
		pki    pkiFlags
	)
	cmd := &cobra.Command{
		Use:     "add NAME ADDR[,ADDR...]",
		Short:   "Add or replace a middlebox type",
		Example: "  dysco type add nat 10.0.1.2,10.0.1.3",
		RunE: func(cmd *cobra.Command, args []string) error {
			if len(args) < 2 {
				return errors.New("usage: dysco type add NAME ADDR[,ADDR...] (the instances' IP addresses)")
			}
			t := api.MiddleboxType{Name: args[0]}
			for _, a := range args[1:] {
				for _, s := range strings.Split(a, ",") {
					if s = strings.TrimSpace(s); s == "" {
						continue
					}
					addr, err := netip.ParseAddr(s)
					if err != nil {
						return fmt.Errorf("type %q: instance %q is not an IP address", t.Name, s)
					}
					t.Instances = append(t.Instances, addr.Unmap())
				}
			}
			if err := t.Validate(); err != nil {
				return err
			}
			c, err := clientFor(server, pki)
			if err != nil {
				return err
			}
			if err := c.PutType(cmd.Context(), t); err != nil {
				return err
			}
			fmt.Fprintf(cmd.OutOrStdout(), "type %q installed %s\n", t.Name, where(c, server))
			return nil
		},
	}
	cmd.Flags().StringVar(&server, "server", "", serverFlagUsage)
	pki.add(cmd.Flags(), certs.RoleOperator)
	return cmd
}

func newTypeListCmd() *cobra.Command {
	var (
		server string
		pki    pkiFlags
		output *string
	)
	cmd := &cobra.Command{
		Use:     "list",
		Aliases: []string{"ls"},
		Short:   "List the middlebox types",
		Args:    cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			format, err := parseOutput(*output)
			if err != nil {
				return err
			}
			c, err := clientFor(server, pki)
			if err != nil {
				return err
			}
			set, err := c.Policies(cmd.Context())
			if err != nil {
				return err
			}
			types := set.Types
			if types == nil {
				types = []api.MiddleboxType{}
			}
			if format == outputJSON {
				return writeJSONOut(cmd.OutOrStdout(), types)
			}
			if len(types) == 0 {
				fmt.Fprintln(cmd.OutOrStdout(), "no middlebox types")
				return nil
			}
			tw := newTabWriter(cmd.OutOrStdout())
			fmt.Fprintln(tw, "NAME\tINSTANCES")
			for _, t := range types {
				addrs := make([]string, len(t.Instances))
				for i, a := range t.Instances {
					addrs[i] = a.String()
				}
				fmt.Fprintf(tw, "%s\t%s\n", t.Name, strings.Join(addrs, ","))
			}
			return tw.Flush()
		},
	}
	cmd.Flags().StringVar(&server, "server", "", serverFlagUsage)
	pki.add(cmd.Flags(), certs.RoleOperator)
	output = addOutputFlag(cmd)
	return cmd
}

func newTypeRmCmd() *cobra.Command {
	var (
		server string
		pki    pkiFlags
	)
	cmd := &cobra.Command{
		Use:     "rm NAME...",
		Aliases: []string{"remove", "delete"},
		Short:   "Remove middlebox types",
		Args:    cobra.MinimumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := clientFor(server, pki)
			if err != nil {
				return err
			}
			for _, name := range args {
				if err := c.DeleteType(cmd.Context(), name); err != nil {
					return err
				}
				fmt.Fprintf(cmd.OutOrStdout(), "type %q removed %s\n", name, where(c, server))
			}
			return nil
		},
	}
	cmd.Flags().StringVar(&server, "server", "", serverFlagUsage)
	pki.add(cmd.Flags(), certs.RoleOperator)
	return cmd
}
