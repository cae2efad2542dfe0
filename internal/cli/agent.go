package cli

import (
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"runtime/pprof"
	"runtime/trace"
	"strings"
	"time"

	"github.com/dysco/dysco/internal/agent"
	"github.com/dysco/dysco/internal/api"
	"github.com/dysco/dysco/internal/certs"
	"github.com/dysco/dysco/internal/datapath"
	"github.com/dysco/dysco/internal/nf"
	"github.com/spf13/cobra"
)

func init() { register(newAgentCmd) }

// resetDatapath removes the pinned datapath at pinDir (this namespace's
// default when empty). It refuses while an agent answers on socket: the
// agent would go on with maps no longer pinned, and its next restart would
// start afresh anyway.
func resetDatapath(w io.Writer, pinDir, socket string) error {
	if pinDir == "" {
		pinDir = agent.DefaultPinDir()
	}
	if c, err := net.DialTimeout("unix", socket, time.Second); err == nil {
		perr := api.CheckAgentPeer(c, socket)
		c.Close()
		if perr != nil {
			return fmt.Errorf("not resetting: %w", perr)
		}
		return fmt.Errorf("an agent is running in this network namespace (it answers on %s): stop it before 'dysco agent --reset'", socket)
	}
	if _, err := os.Stat(pinDir); errors.Is(err, fs.ErrNotExist) {
		if strings.HasPrefix(pinDir, "/sys/fs/bpf/") && !datapath.OnBPFFS("/sys/fs/bpf") {
			return fmt.Errorf("nothing pinned at %s, and no bpffs is mounted at /sys/fs/bpf here (ip netns exec remounts /sys): run 'nsenter --net=/run/netns/NAME dysco agent --reset'", pinDir)
		}
		_, err := fmt.Fprintf(w, "dysco: nothing pinned at %s\n", pinDir)
		return err
	}
	if err := datapath.Reset(pinDir); err != nil {
		return err
	}
	_, err := fmt.Fprintf(w, "dysco: removed the pinned datapath %s (every session it carried has ended)\n", pinDir)
	return err
}

// agentServerTLS loads the agent's certificate for the policy server into
// cfg, and checks that it is an agent certificate naming this agent (the
// server takes the agent's name from it).
func agentServerTLS(cfg *agent.Config, pki pkiFlags) error {
	name := cfg.Name
	if name == "" {
		name, _ = os.Hostname()
	}
	tc, err := pki.tlsFor(cfg.PolicyServer, name)
	if err != nil || tc == nil {
		return err
	}
	certFile, _, _ := pki.files(name)
	id, err := certs.ClientIdentity(certFile)
	if err != nil {
		return fmt.Errorf("--tls-cert: %w", err)
	}
	if id.Role != certs.RoleAgent || id.Name != name {
		return fmt.Errorf("--tls-cert %s is the %s certificate of %q, not the agent certificate of %q (this agent's --name): issue one with `dysco certs agent %s`", certFile, id.Role, id.Name, name, name)
	}
	cfg.PolicyServerTLS = tc
	return nil
}

func newAgentCmd() *cobra.Command {
	var cfg agent.Config
	var trusted, nfFlags, sessionAddrs []string
	var reset, debug, forwardCheck bool
	var ports, keyFile, cpuProfile, execTrace string
	var pki pkiFlags
	cmd := &cobra.Command{
		Use:   "agent",
		Short: "Run the Dysco agent of this host (network namespace)",
		Long: `Run the Dysco agent: it loads and pins the eBPF datapath, attaches it to every
interface of the network namespace, keeps policies, collects ended sessions and
serves the local API that the other dysco commands use.

Restarting the agent does not disturb live sessions: the datapath stays pinned
under --pin-dir. 'dysco agent --reset' (with the agent stopped, and the same
--pin-dir if it was given one) removes it: every session on the host ends.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			level := slog.LevelInfo
			if debug {
				level = slog.LevelDebug
			}
			cfg.Log = slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: level}))
			if reset {
				return resetDatapath(cmd.ErrOrStderr(), cfg.PinDir, api.AgentSocket)
			}
			for _, x := range sessionAddrs {
				ip, err := netip.ParseAddr(strings.TrimSpace(x))
				if err != nil {
					return fmt.Errorf("--session-addr %q: not an IP address", x)
				}
				cfg.SessionAddrs = append(cfg.SessionAddrs, ip.Unmap())
			}
			for _, t := range trusted {
				p, err := parsePrefix(t)
				if err != nil {
					return err
				}
				cfg.Trusted = append(cfg.Trusted, p)
			}
			cfg.NoForwardCheck = !forwardCheck
			specs, err := nf.ParseFlags(nfFlags)
			if err != nil {
				return err
			}
			cfg.NFs = specs
			if ports != "" {
				var lo, hi uint16
				if _, err := fmt.Sscanf(ports, "%d-%d", &lo, &hi); err != nil || hi < lo {
					return fmt.Errorf("--ports %q: want LOW-HIGH, e.g. 20000-59999", ports)
				}
				cfg.PortLo, cfg.PortN = lo, hi-lo+1
			}
			cfg.ControlKeyFile = keyFile
			if cfg.UDPDrain <= 0 || cfg.UDPDrain > 7500*time.Millisecond {
				return fmt.Errorf("--udp-drain %v: want more than 0 and at most 7.5s (a quarter of the old path's lock lease)", cfg.UDPDrain)
			}
			for _, d := range []struct {
				flag string
				v    time.Duration
			}{{"--udp-timeout", cfg.UDPTimeout}, {"--udp-stream-timeout", cfg.UDPStreamTimeout}} {
				if d.v < time.Second || d.v > 18*time.Hour {
					return fmt.Errorf("%s %v: want 1s to 18h", d.flag, d.v)
				}
			}
			if cfg.PolicyServer != "" {
				if err := agentServerTLS(&cfg, pki); err != nil {
					return err
				}
			}
			for _, r := range []struct {
				flag, path string
				start      func(io.Writer) error
				stop       func()
			}{
				{"--cpu-profile", cpuProfile, pprof.StartCPUProfile, pprof.StopCPUProfile},
				{"--exec-trace", execTrace, trace.Start, trace.Stop},
			} {
				if r.path == "" {
					continue
				}
				f, err := os.Create(strings.ReplaceAll(r.path, "{name}", cfg.Name))
				if err != nil {
					return fmt.Errorf("%s: %w", r.flag, err)
				}
				if err := r.start(f); err != nil {
					f.Close()
					return fmt.Errorf("%s: %w", r.flag, err)
				}
				defer func() { r.stop(); f.Close() }()
			}
			return agent.Run(cmd.Context(), cfg)
		},
	}
	f := cmd.Flags()
	f.StringVar(&cfg.Name, "name", "", "agent name, used by the policy server to choose policies (default: hostname)")
	f.StringVar(&cfg.PinDir, "pin-dir", "", "bpffs directory for the pinned datapath (default /sys/fs/bpf/dysco/netns-INODE)")
	f.StringVar(&cfg.StateDir, "state-dir", "", "directory for local policies and the policy server's last set (default /var/lib/dysco/netns-INODE)")
	f.StringVar(&cfg.Tap, "tap", "", "create the session-view tap with this name (middlebox hosts; e.g. dysco-tap)")
	f.StringVar(&cfg.PolicyServer, "policy-server", "", "policy server URL, e.g. https://10.0.0.1:7017 (with the agent certificate of --pki-dir; http:// for a server run with --insecure), or several replicas' URLs separated by commas, tried in turn")
	pki.add(f, "agent-{name}")
	f.StringVar(&cfg.ReadyFile, "ready-file", "", "write this file once the agent is ready")
	f.StringVar(&cfg.MetricsAddr, "metrics", "", "serve Prometheus metrics on this address, e.g. 127.0.0.1:9017")
	f.DurationVar(&cfg.IdleTimeout, "idle-timeout", time.Hour, "end sessions idle this long")
	f.DurationVar(&cfg.HalfOpenTimeout, "half-open-timeout", 30*time.Second, "end sessions not established within this time")
	f.DurationVar(&cfg.UDPTimeout, "udp-timeout", api.DefaultIdleTimeoutOneWay, "end UDP sessions that have carried datagrams one way only after this idle time (a policy's --idle overrides it)")
	f.DurationVar(&cfg.UDPDrain, "udp-drain", 500*time.Millisecond, "reconfiguring a UDP session: how long its old path must have been quiet before the anchors tear it down; longer than the longest time a datagram spends on a path (at most 7.5s)")
	f.DurationVar(&cfg.UDPStreamTimeout, "udp-stream-timeout", api.DefaultIdleTimeoutStream, "end UDP sessions that have carried datagrams both ways after this idle time (a policy's --idle overrides it)")
	f.DurationVar(&cfg.CloseLinger, "close-linger", 10*time.Second, "keep closed sessions this long for retransmitted FINs and ACKs")
	f.IntVar(&cfg.MaxSessions, "max-sessions", 0, fmt.Sprintf("sessions the datapath's maps hold, 1 to %d, four flow entries each (default: the datapath's own size, MAX_SESSIONS; 'dysco status' shows capacity_sessions); maps already pinned keep their size until --reset", datapath.MaxSessionsLimit))
	f.StringVar(&ports, "ports", "", "subsession port range LOW-HIGH (default 20000-59999)")
	f.StringSliceVar(&sessionAddrs, "session-addr", nil, "this host's session addresses, at most one per family (docs/mobility.md): an address of this host that does not change when it moves, usually on a dummy interface; sessions from it keep their tuple when the host's other addresses change, the agent rebinding their first subsession to the new address")
	f.StringSliceVar(&trusted, "trusted", nil, "also admit Dysco SYNs without a valid MAC from these prefixes (without --control-key-file: only from them; with neither, Dysco SYNs from other hosts are refused)")
	f.IntVar(&cfg.HalfOpenPerSource, "half-open-per-source", datapath.DefaultHalfOpenPerSource, "half-open sessions that Dysco SYNs from one source (IPv4 address or IPv6 /64) may set up here; more are dropped (drop_half_open)")
	f.BoolVar(&forwardCheck, "forward-check", true, "refuse at once (a reset back to the client, counter drop_no_forward) chained SYNs this host must pass on while IP forwarding is off for their family; false for a host whose local transparent proxy takes them")
	f.BoolVar(&reset, "reset", false, "remove the pinned datapath under --pin-dir (default: this namespace's) and exit")
	f.BoolVar(&debug, "debug", false, "debug logging")
	f.StringVar(&cpuProfile, "cpu-profile", "", "write a CPU profile of the agent to this file until it exits (go tool pprof); {name} in it becomes --name")
	f.StringVar(&execTrace, "exec-trace", "", "write a Go execution trace of the agent to this file until it exits (go tool trace); {name} in it becomes --name")
	f.IntVar(&cfg.ControlPort, "control-port", agent.DefaultControlPort, "UDP port of the reconfiguration protocol")
	f.StringArrayVar(&nfFlags, "nf", nil, "a network function this agent starts when a reconfiguration's new path names it for this host (dysco reconfig --chain NF@ADDR): one attribute per flag, NAME.KEY=VALUE, KEY one of start (required: a /bin/sh -c command, run in its own process group for as long as the function runs), ready (a command polled until it exits 0; default: ready once started), stop (a command run after its processes are gone), stop-idle (stop it after serving no session this long; default 0: never), start-timeout (default 10s, at most 20s); repeat the flag (docs/operating.md, \"Network functions on demand\")")
	f.StringSliceVar(&cfg.StatePlugins, "state-plugins", []string{"conntrack", "api"}, "middlebox state this agent exports and imports for state migration (conntrack, api; empty: none)")
	f.StringVar(&keyFile, "control-key-file", "", "file of deployment secrets that authenticate reconfiguration messages and Dysco SYNs: one hex secret (at least 16 bytes) per line, '#' comments; the first signs, every one is accepted (Dysco SYNs: the first two; rotation: docs/operating.md); mode 0600, owned by root or the agent's user; read again on SIGHUP and when it changes; without it reconfiguration is disabled and Dysco SYNs are admitted from --trusted prefixes only")
	return cmd
}

func parsePrefix(s string) (netip.Prefix, error) {
	s = strings.TrimSpace(s)
	if !strings.Contains(s, "/") {
		a, err := netip.ParseAddr(s)
		if err != nil {
			return netip.Prefix{}, fmt.Errorf("%q: not an address or prefix", s)
		}
		return netip.PrefixFrom(a.Unmap(), a.Unmap().BitLen()), nil
	}
	p, err := netip.ParsePrefix(s)
	if err != nil {
		return netip.Prefix{}, fmt.Errorf("%q: %w", s, err)
	}
	return p.Masked(), nil
}
