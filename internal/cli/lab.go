package cli

import (
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"time"

	"github.com/spf13/cobra"

	"github.com/dysco/dysco/internal/lab"
)

func init() { register(newLabCmd) }

func newLabCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "lab",
		Short: "Build and tear down a testbed of network namespaces on this machine",
		Long: `A lab is a set of hosts, each a network namespace called <lab>-<host>, linked
by veth pairs: a star around a router namespace (the paper's Fig. 11), or a
line (Fig. 1). Each host runs a Dysco agent unless --no-agents is given.
Run programs in a host with 'dysco lab exec' or 'ip netns exec <lab>-<host>'.
The lab stays up until 'dysco lab down'.`,
	}
	cmd.AddCommand(newLabUpCmd(), newLabDownCmd(), newLabStatusCmd(), newLabExecCmd(), newLabRunCmd())
	return cmd
}

func newLabUpCmd() *cobra.Command {
	var (
		name, topo, topoFile, agentBin string
		hosts, agentArgs               []string
		noAgents                       bool
		readyTimeout                   time.Duration
	)
	cmd := &cobra.Command{
		Use:   "up --name NAME (--topology star --hosts H1,H2,... | --topology line|fig11 | --topology-file FILE)",
		Short: "Build a lab and start its agents",
		Long: `Build a lab and start one agent per host, then print its hosts and addresses.
If building fails or is interrupted, everything built so far is removed.

A host's role is given after its name (NAME=ROLE: client, server, middlebox
or mb, host or plain), or follows the name: mb* are middleboxes, client*
clients, server* servers, anything else a plain host. Middlebox hosts forward
IP and their agents get a session-view tap; the table printed shows each
host's role. In a star, NAME:2 (or NAME=ROLE:2) gives a host a second link
to the router, on 10.202.i.0/24 and fd00:dc:2:i::/64 (docs/lab.md).`,
		Example: `  dysco lab up --name demo --topology star --hosts client,mb1,mb2,server
  dysco lab up --name fw --hosts client,fw=mb,ids=mb,server
  dysco lab up --name move --hosts client:2,fw=mb,server
  dysco lab up --name paper --topology fig11 --no-agents
  dysco lab up --name chain --topology-file topologies/chain.json`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			t, err := labTopology(topo, topoFile, hosts)
			if err != nil {
				return err
			}
			cfg := lab.Config{Name: name, Topology: t, ReadyTimeout: readyTimeout}
			if !noAgents {
				if agentBin == "" {
					if agentBin, err = os.Executable(); err != nil {
						return fmt.Errorf("finding the dysco binary for the agents: %w (give --agent-binary)", err)
					}
				}
				cfg.AgentBinary = agentBin
				cfg.AgentArgs = func(*lab.Host) []string { return agentArgs }
			} else if agentBin != "" || len(agentArgs) > 0 {
				return errors.New("--no-agents contradicts --agent-binary and --agent-arg: give one or the other")
			}
			l, err := lab.Up(cmd.Context(), cfg)
			if err != nil {
				return err
			}
			st, err := lab.ReadState(l.Name())
			if err != nil {
				return err
			}
			w := cmd.OutOrStdout()
			fmt.Fprintf(w, "lab %s is up (%s topology, run directory %s)\n\n", l.Name(), t.Kind, l.RunDir())
			if err := printLabHosts(w, st); err != nil {
				return err
			}
			fmt.Fprintf(w, "\nRun a program in a host: dysco lab exec --name %s HOST -- CMD...\nRemove the lab:          dysco lab down --name %s\n", l.Name(), l.Name())
			return nil
		},
	}
	f := cmd.Flags()
	f.StringVar(&name, "name", "", "lab name: 1 to 8 lower-case letters or digits, starting with a letter (required)")
	f.StringVar(&topo, "topology", "", "built-in topology: "+strings.Join(lab.Builtins, ", ")+" (star is the default with --hosts)")
	f.StringSliceVar(&hosts, "hosts", nil, "hosts of a star or line topology, in address order, comma-separated: NAME or NAME=ROLE (client, server, middlebox or mb, host or plain), then :2 for a second link (star), then +session for session addresses on lo, given to the host's agent (star; docs/mobility.md)")
	f.StringVar(&topoFile, "topology-file", "", "topology file (JSON, see topologies/)")
	f.BoolVar(&noAgents, "no-agents", false, "start no agents: plain forwarding, a baseline")
	f.StringVar(&agentBin, "agent-binary", "", "dysco binary for the agents (default: this binary)")
	f.StringArrayVar(&agentArgs, "agent-arg", nil, "extra argument for every agent (repeat for several)")
	f.DurationVar(&readyTimeout, "ready-timeout", lab.DefaultReadyTimeout, "how long to wait for each agent to be ready")
	_ = cmd.MarkFlagRequired("name")
	return cmd
}

// labTopology picks the topology from the flags of `lab up`.
func labTopology(topo, file string, hosts []string) (lab.Topology, error) {
	switch {
	case file != "" && (topo != "" || len(hosts) > 0):
		return lab.Topology{}, errors.New("--topology-file lists its own hosts: do not combine it with --topology or --hosts")
	case file != "":
		return lab.LoadTopology(file)
	case topo == "" && len(hosts) > 0:
		topo = "star"
	case topo == "":
		return lab.Topology{}, fmt.Errorf("say which topology to build: --topology (%s) or --topology-file", strings.Join(lab.Builtins, ", "))
	}
	return lab.Builtin(topo, hosts)
}

// printLabHosts prints a lab's hosts, the router last.
func printLabHosts(w io.Writer, st *lab.State) error {
	agents := make(map[string]lab.ProcState)
	for _, a := range st.Agents {
		agents[a.Host] = a
	}
	tw := newTabWriter(w)
	fmt.Fprintln(tw, "HOST\tROLE\tNAMESPACE\tIFACE\tIPV4\tIPV6\tAGENT")
	for _, h := range st.Hosts {
		agent := "-"
		if a, ok := agents[h.Name]; ok {
			agent = fmt.Sprintf("pid %d (%s)", a.Pid, aliveWord(a.Alive))
		}
		ns := h.Namespace
		if _, err := os.Stat("/run/netns/" + ns); err != nil {
			ns += " (MISSING)"
		}
		for i, ifc := range h.Ifaces {
			if i == 0 {
				fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s\n", h.Name, h.Role, ns, ifc.Name, ifc.Addr4, ifc.Addr6, agent)
			} else {
				fmt.Fprintf(tw, "\t\t\t%s\t%s\t%s\t\n", ifc.Name, ifc.Addr4, ifc.Addr6)
			}
		}
	}
	return tw.Flush()
}

func aliveWord(alive bool) string {
	if alive {
		return "alive"
	}
	return "DEAD"
}

func newLabDownCmd() *cobra.Command {
	var (
		name string
		all  bool
	)
	cmd := &cobra.Command{
		Use:   "down (--name NAME | --all)",
		Short: "Remove a lab: stop its processes, delete its namespaces, pins and run directory",
		Long: `Remove a lab: kill every process in its namespaces, delete the namespaces,
the agents' BPF pin directories and the run directory. It works from what is
on the system, so it also cleans up after a crashed test or 'lab up'. Removing
a lab that is not there is not an error.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			var names []string
			switch {
			case all && name != "":
				return errors.New("give --name or --all, not both")
			case all:
				var err error
				if names, err = lab.Labs(); err != nil {
					return err
				}
				if len(names) == 0 {
					fmt.Fprintf(cmd.OutOrStdout(), "no labs under %s\n", lab.RunRoot)
					return nil
				}
			case name != "":
				names = []string{name}
			default:
				return errors.New("say which lab to remove: --name NAME, or --all for every lab under " + lab.RunRoot)
			}
			var errs []error
			for _, n := range names {
				if err := lab.DownByName(n); err != nil {
					errs = append(errs, fmt.Errorf("lab %s: %w", n, err))
					continue
				}
				fmt.Fprintf(cmd.OutOrStdout(), "lab %s is down\n", n)
			}
			return errors.Join(errs...)
		},
	}
	cmd.Flags().StringVar(&name, "name", "", "lab to remove")
	cmd.Flags().BoolVar(&all, "all", false, "remove every lab that has a run directory under "+lab.RunRoot)
	return cmd
}

func newLabStatusCmd() *cobra.Command {
	var (
		name   string
		output *string
	)
	cmd := &cobra.Command{
		Use:   "status [--name NAME]",
		Short: "List the labs, their hosts, addresses and processes",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			format, err := parseOutput(*output)
			if err != nil {
				return err
			}
			names := []string{name}
			if name == "" {
				if names, err = lab.Labs(); err != nil {
					return err
				}
			}
			var states []*lab.State
			var broken []error
			for _, n := range names {
				st, err := lab.ReadState(n)
				if err != nil {
					if name != "" {
						return err
					}
					// A run directory without a state file: report it
					// and go on with the others.
					broken = append(broken, err)
					continue
				}
				states = append(states, st)
			}
			for _, err := range broken {
				fmt.Fprintln(cmd.ErrOrStderr(), "dysco:", err)
			}
			w := cmd.OutOrStdout()
			if format == outputJSON {
				if states == nil {
					states = []*lab.State{}
				}
				return writeJSONOut(w, states)
			}
			if len(states) == 0 && len(broken) == 0 {
				fmt.Fprintf(w, "no labs under %s\n", lab.RunRoot)
				return nil
			}
			for i, st := range states {
				if i > 0 {
					fmt.Fprintln(w)
				}
				if err := printLabStatus(w, st); err != nil {
					return err
				}
			}
			return nil
		},
	}
	cmd.Flags().StringVar(&name, "name", "", "show only this lab")
	output = addOutputFlag(cmd)
	return cmd
}

func printLabStatus(w io.Writer, st *lab.State) error {
	state := "up"
	if !st.Ready {
		state = "NOT READY (being built, or its builder died: remove it with dysco lab down --name " + st.Name + ")"
	}
	fmt.Fprintf(w, "lab %s: %s topology, %d hosts, created %s, %s\n",
		st.Name, st.Topology.Kind, len(st.Topology.Hosts), st.Created.Format(time.RFC3339), state)
	if err := printLabHosts(w, st); err != nil {
		return err
	}
	if len(st.Procs) == 0 {
		return nil
	}
	fmt.Fprintln(w)
	tw := newTabWriter(w)
	fmt.Fprintln(tw, "HOST\tPROGRAM\tPID\tSTATE\tLOG")
	for _, p := range st.Procs {
		fmt.Fprintf(tw, "%s\t%s\t%d\t%s\t%s\n", p.Host, p.Name, p.Pid, aliveWord(p.Alive), p.Log)
	}
	return tw.Flush()
}

func newLabExecCmd() *cobra.Command {
	var name string
	cmd := &cobra.Command{
		Use:   "exec --name NAME HOST -- CMD [ARG...]",
		Short: "Run a program in a lab host's namespace",
		Long: `Run a program in the network namespace of a lab host (or of "router"), as
'ip netns exec <lab>-<host> CMD' does. The exit status is the program's.`,
		Example: `  dysco lab exec --name demo client -- curl -s http://10.200.4.2/
  dysco lab exec --name demo router -- tcpdump -ni r-2`,
		Args: cobra.MinimumNArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			if name == "" {
				return errors.New("say which lab: --name NAME")
			}
			if err := lab.ValidateLabName(name); err != nil {
				return err
			}
			host, argv := args[0], args[1:]
			if dash := cmd.ArgsLenAtDash(); dash != 1 {
				return errors.New("put the program after --: dysco lab exec --name NAME HOST -- CMD [ARG...]")
			}
			ns := lab.Namespace(name, host)
			if _, err := os.Stat("/run/netns/" + ns); err != nil {
				return fmt.Errorf("lab %s has no host %q (no namespace %s): see dysco lab status --name %s", name, host, ns, name)
			}
			// Not CommandContext: a Ctrl-C reaches the program from the
			// terminal, and it decides (an interactive shell ignores it).
			c := exec.Command("ip", append([]string{"netns", "exec", ns}, argv...)...)
			c.Stdin, c.Stdout, c.Stderr = cmd.InOrStdin(), cmd.OutOrStdout(), cmd.ErrOrStderr()
			err := c.Run()
			var ee *exec.ExitError
			if errors.As(err, &ee) {
				if ws, ok := ee.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
					return exitError(128 + int(ws.Signal()))
				}
				return exitError(ee.ExitCode())
			}
			return err
		},
	}
	cmd.Flags().StringVar(&name, "name", "", "lab name (required)")
	return cmd
}
