package cli

import (
	"cmp"
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"strconv"
	"strings"

	"github.com/spf13/cobra"

	"github.com/dysco/dysco/internal/api"
	"github.com/dysco/dysco/internal/certs"
	"github.com/dysco/dysco/internal/policy"
)

// testProtos are the protocols `dysco policy test --proto` takes by name.
var testProtos = map[string]uint8{"tcp": 6, "udp": 17, "icmp": 1, "icmp6": 58, "sctp": 132}

func newPolicyTestCmd() *cobra.Command {
	var (
		proto  string
		host   string
		server string
		pki    pkiFlags
	)
	cmd := &cobra.Command{
		Use:   "test [--proto tcp|udp|icmp|sctp|N] SRC[:PORT] DST[:PORT]",
		Short: "Tell which policy the first packet of a session would match",
		Long: `Build the first packet of a session from SRC to DST, as the host sends it (a
TCP SYN, or the first UDP datagram of a flow, or an ICMP echo request, ...),
and run the policies on it in evaluation order, as the agent's classifier
does. It prints the first policy that matches and its chain, or that none
does. Policies come from the local agent, or from the policy server with
--server (with --host, only those given to that agent).`,
		Example: `  dysco policy test 10.0.1.1:40000 10.0.3.2:80
  dysco policy test --proto udp 10.0.1.1:50000 10.0.3.2:4433
  dysco policy test --server https://10.0.0.9:7017 --host h1 --proto udp '[2001:db8::1]:5353' '[2001:db8::2]:53'`,
		Args: cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			num, name, err := parseTestProto(proto)
			if err != nil {
				return err
			}
			src, err := parseEndpoint(args[0])
			if err != nil {
				return fmt.Errorf("SRC: %w", err)
			}
			dst, err := parseEndpoint(args[1])
			if err != nil {
				return fmt.Errorf("DST: %w", err)
			}
			frame, err := policy.FirstPacket(num, src, dst)
			if err != nil {
				return err
			}
			if server == "" && host != "" {
				return errors.New("--host only applies with --server: the local agent uses every policy it has")
			}
			c, err := clientFor(server, pki)
			if err != nil {
				return err
			}
			set, err := c.Policies(cmd.Context())
			if err != nil {
				return err
			}
			w := cmd.OutOrStdout()
			var compiled []policy.Compiled
			for _, p := range evaluationOrder(set.Policies, host) {
				cp, err := policy.Compile(p)
				if err != nil {
					// The agent leaves such a policy out too.
					fmt.Fprintf(w, "skipped: %v\n", err)
					continue
				}
				compiled = append(compiled, cp)
			}
			desc := fmt.Sprintf("%s %s -> %s", name, src, dst)
			if num != 6 && num != 17 && num != 132 {
				desc = fmt.Sprintf("%s %s -> %s", name, src.Addr(), dst.Addr())
			}
			p, ok := policy.NewMatcher(compiled).Match(frame)
			if !ok {
				fmt.Fprintf(w, "%s: no policy matches; the session is not chained\n", desc)
				return nil
			}
			fmt.Fprintf(w, "%s: policy %q matches: chain %s\n", desc, p.Name, chainString(p))
			if cls := protoClass(num); !policy.Chained.Has(cls) {
				fmt.Fprintf(w, "dysco chains %s sessions: this %s packet passes unchained\n", policy.Chained, name)
			}
			return nil
		},
	}
	f := cmd.Flags()
	f.StringVar(&proto, "proto", "tcp", "protocol of the session: tcp, udp, icmp, icmp6, sctp or an IP protocol number")
	f.StringVar(&host, "host", "", "with --server: test the policies the server gives this agent")
	f.StringVar(&server, "server", "", serverFlagUsage)
	pki.add(f, certs.RoleOperator)
	return cmd
}

// parseTestProto reads --proto: a name of testProtos or a number.
func parseTestProto(s string) (uint8, string, error) {
	s = strings.ToLower(strings.TrimSpace(s))
	if n, ok := testProtos[s]; ok {
		return n, s, nil
	}
	n, err := strconv.ParseUint(s, 10, 8)
	if err != nil {
		return 0, "", fmt.Errorf("--proto %q: want tcp, udp, icmp, icmp6, sctp or an IP protocol number (0-255)", s)
	}
	for name, v := range testProtos {
		if v == uint8(n) {
			return v, name, nil
		}
	}
	return uint8(n), "ip proto " + s, nil
}

// protoClass is the policy.Proto class of IP protocol n.
func protoClass(n uint8) policy.Proto {
	switch n {
	case 6:
		return policy.TCP
	case 17:
		return policy.UDP
	case 1, 58:
		return policy.ICMP
	}
	return policy.Other
}

// parseEndpoint reads ADDR, ADDR:PORT or [ADDR6]:PORT; no port means 0.
func parseEndpoint(s string) (netip.AddrPort, error) {
	if ap, err := netip.ParseAddrPort(s); err == nil {
		return netip.AddrPortFrom(ap.Addr().Unmap(), ap.Port()), nil
	}
	a, err := netip.ParseAddr(strings.TrimSuffix(strings.TrimPrefix(s, "["), "]"))
	if err != nil {
		return netip.AddrPort{}, fmt.Errorf("%q is not ADDR, ADDR:PORT or [ADDR]:PORT", s)
	}
	return netip.AddrPortFrom(a.Unmap(), 0), nil
}

// evaluationOrder returns the policies host gets (all of them for an empty
// host) in the agent's evaluation order: priority, then name.
func evaluationOrder(ps []api.Policy, host string) []api.Policy {
	var out []api.Policy
	for _, p := range ps {
		if host == "" || len(p.Hosts) == 0 || slices.Contains(p.Hosts, host) {
			out = append(out, p)
		}
	}
	slices.SortStableFunc(out, func(a, b api.Policy) int {
		if c := cmp.Compare(a.Priority, b.Priority); c != 0 {
			return c
		}
		return strings.Compare(a.Name, b.Name)
	})
	return out
}
