package cli

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"slices"
	"sort"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/dysco/dysco/internal/api"
	"github.com/dysco/dysco/internal/certs"
)

func init() { register(newStatusCmd) }

// agentClient returns the client of the local agent; tests point it at a
// socket of their own.
var agentClient = api.NewAgentClient

// clientFor returns the client of the policy server at serverURL, with the
// certificates of pki, or of the local agent when serverURL is empty.
func clientFor(serverURL string, pki pkiFlags) (*api.Client, error) {
	if serverURL == "" {
		return agentClient(), nil
	}
	return pki.serverClient(serverURL)
}

// outputFormat is the value of the -o flag of the listing verbs.
type outputFormat string

const (
	outputTable outputFormat = "table"
	outputJSON  outputFormat = "json"
)

// addOutputFlag adds -o/--output to cmd and returns where its value lands.
func addOutputFlag(cmd *cobra.Command) *string {
	return cmd.Flags().StringP("output", "o", string(outputTable), "output format: table (for people) or json (for scripts)")
}

// parseOutput checks the -o flag.
func parseOutput(s string) (outputFormat, error) {
	switch f := outputFormat(s); f {
	case outputTable, outputJSON:
		return f, nil
	}
	return "", fmt.Errorf("--output %q: use table or json", s)
}

// writeJSONOut prints v as indented JSON, for scripts.
func writeJSONOut(w io.Writer, v any) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}

// newTabWriter aligns the columns of a table.
func newTabWriter(w io.Writer) *tabwriter.Writer {
	return tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
}

// orDash shows an empty cell as "-".
func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

func newStatusCmd() *cobra.Command {
	var (
		output  *string
		cluster bool
		server  string
		pki     pkiFlags
	)
	cmd := &cobra.Command{
		Use:   "status",
		Short: "Show the local agent's status: attachment, interfaces, forwarding, policies, counters",
		Long: `Show the status of the agent of this network namespace: how its datapath is
attached, on which interfaces, whether the host forwards IPv4 and IPv6 (a
host that passes chained sessions on must; the sysctls that are off are
named), which policy version it enforces and whether the policy server is
reachable, and the datapath counters.

Run it inside a lab host's namespace with: ip netns exec NAME dysco status

With --cluster --server URL it lists instead every agent registered at the
policy servers (every replica's, over etcd): the version of the policy set
each held at its last poll against the version in force, and how long ago
it was last heard from (a waiting poll renews it). An agent that stops
polling leaves the list within the servers' --agent-ttl (45 s by default).`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			format, err := parseOutput(*output)
			if err != nil {
				return err
			}
			if cluster {
				if server == "" {
					return errors.New("--cluster needs --server URL: the policy server knows the agents")
				}
				return clusterStatus(cmd, server, pki, format)
			}
			if server != "" {
				return errors.New("--server applies with --cluster only: the status of one agent comes from its own host")
			}
			st, err := agentClient().Status(cmd.Context())
			if err != nil {
				return err
			}
			if format == outputJSON {
				return writeJSONOut(cmd.OutOrStdout(), st)
			}
			return printStatus(cmd.OutOrStdout(), st, time.Now())
		},
	}
	output = addOutputFlag(cmd)
	cmd.Flags().BoolVar(&cluster, "cluster", false, "list the agents registered at the policy server (--server) and the policy version each holds")
	cmd.Flags().StringVar(&server, "server", "", serverFlagUsage)
	pki.add(cmd.Flags(), certs.RoleOperator)
	return cmd
}

// clusterStatus prints the agents registered at the policy server, with the
// version each holds against the one in force.
func clusterStatus(cmd *cobra.Command, server string, pki pkiFlags, format outputFormat) error {
	c, err := pki.serverClient(server)
	if err != nil {
		return err
	}
	set, err := c.Policies(cmd.Context())
	if err != nil {
		return err
	}
	regs, err := c.Agents(cmd.Context())
	if err != nil {
		return err
	}
	if format == outputJSON {
		return writeJSONOut(cmd.OutOrStdout(), map[string]any{"version": set.Version, "agents": regs})
	}
	return printCluster(cmd.OutOrStdout(), set.Version, regs, time.Now())
}

func printCluster(w io.Writer, version uint64, regs []api.AgentRegistration, now time.Time) error {
	behind := 0
	tw := newTabWriter(w)
	versions := map[string]int{}
	fmt.Fprintln(tw, "AGENT\tADDRESS\tAPPLIED\tLAST HEARD\tVERSION")
	for _, r := range regs {
		applied := fmt.Sprint(r.Applied)
		if r.Applied < version {
			applied += " (behind)"
			behind++
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s ago\t%s\n", r.Host, r.Addr, applied, now.Sub(r.Seen).Round(time.Second), orDash(r.Version))
		if r.Version != "" {
			versions[r.Version]++
		}
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	s := "s"
	if len(regs) == 1 {
		s = ""
	}
	if _, err := fmt.Fprintf(w, "%d agent%s, %d behind version %d in force\n", len(regs), s, behind, version); err != nil {
		return err
	}
	if len(versions) > 1 {
		// Agents of other wire versions refuse each other's SYN blocks
		// and control messages: an upgrade half done.
		var vs []string
		for v, n := range versions {
			vs = append(vs, fmt.Sprintf("%s: %d", v, n))
		}
		sort.Strings(vs)
		_, err := fmt.Fprintf(w, "warning: agents run %d versions (%s); agents of different block or control versions cannot chain sessions together\n", len(versions), strings.Join(vs, "; "))
		return err
	}
	return nil
}

func printStatus(w io.Writer, st api.Status, now time.Time) error {
	tw := newTabWriter(w)
	row := func(k, v string) { fmt.Fprintf(tw, "%s\t%s\n", k, v) }
	row("agent", orDash(st.Name))
	row("version", orDash(st.Version))
	if !st.Started.IsZero() {
		row("started", fmt.Sprintf("%s (up %s)", st.Started.Format(time.RFC3339), now.Sub(st.Started).Round(time.Second)))
	}
	row("pin dir", orDash(st.PinDir))
	row("attach", orDash(st.Attach))
	row("interfaces", orDash(strings.Join(st.Ifaces, ", ")))
	if len(st.Addrs) > 0 {
		row("agent address", strings.Join(st.Addrs, ", "))
	}
	if len(st.Locators) > 0 {
		var ls []string
		for sa, loc := range st.Locators {
			ls = append(ls, sa+" via "+loc)
		}
		sort.Strings(ls)
		row("session addresses", strings.Join(ls, ", "))
	}
	row("session tap", orDash(st.Tap))
	if f := st.Forwarding; f != nil {
		row("ip forwarding", forwardingLine(*f))
	}
	row("sessions", fmt.Sprint(st.Sessions))
	row("policy version", fmt.Sprint(st.PolicyVersion))
	switch {
	case st.PolicyServer == "":
		row("policy server", "none (local policies only)")
	case st.PolicyServerOK:
		row("policy server", st.PolicyServer+" (reachable)")
	default:
		row("policy server", fmt.Sprintf("%s (UNREACHABLE; enforcing the cached version %d)", st.PolicyServer, st.PolicyVersion))
	}
	switch len(st.ControlKeys) {
	case 0:
		row("control keys", "none (reconfiguration disabled)")
	case 1:
		row("control keys", st.ControlKeys[0])
	default:
		row("control keys", fmt.Sprintf("%s signs; also accepted: %s", st.ControlKeys[0], strings.Join(st.ControlKeys[1:], ", ")))
	}
	if st.Admission != "" {
		row("syn admission", st.Admission)
	}
	if len(st.NFs) > 0 {
		fmt.Fprintln(tw, "network functions:")
		for _, f := range st.NFs {
			v := f.State
			if f.PID != 0 {
				v += fmt.Sprintf(", pid %d", f.PID)
			}
			if !f.StartedAt.IsZero() {
				v += ", started " + f.StartedAt.Format(time.RFC3339)
			}
			v += fmt.Sprintf(", %d sessions, %d starts, %d exits, %d failed starts", f.Sessions, f.Starts, f.Exits, f.Failures)
			if f.LastError != "" {
				v += "; last error: " + f.LastError
			}
			row("  "+f.Name, v)
		}
	}
	if len(st.Counters) == 0 {
		row("counters", "none")
	} else {
		// A line without a tab ends the column block: the counters align
		// among themselves.
		fmt.Fprintln(tw, "counters:")
		names := make([]string, 0, len(st.Counters))
		for n := range st.Counters {
			names = append(names, n)
		}
		slices.Sort(names)
		for _, n := range names {
			row("  "+n, fmt.Sprint(st.Counters[n]))
		}
	}
	return tw.Flush()
}

// forwardingLine shows IP forwarding per family, and the sysctls that are
// off.
func forwardingLine(f api.Forwarding) string {
	word := func(on bool) string {
		if on {
			return "on"
		}
		return "OFF"
	}
	s := fmt.Sprintf("ipv4 %s, ipv6 %s", word(f.IPv4), word(f.IPv6))
	if len(f.Off) > 0 {
		s += " (" + strings.Join(f.Off, "=0, ") + "=0)"
	}
	return s
}
