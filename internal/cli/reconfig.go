package cli

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/netip"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/dysco/dysco/internal/api"
	"github.com/dysco/dysco/internal/certs"
	"github.com/dysco/dysco/internal/policy"
	"github.com/dysco/dysco/internal/protocol"
	"github.com/dysco/dysco/internal/psclient"
	"github.com/dysco/dysco/internal/wire"
)

func init() {
	register(newReconfigCmd)
	register(newMiddleboxCmd)
}

// defaultReconfigTimeout is the default of --timeout: how long the agent
// waits for the results of a reconfiguration request.
const defaultReconfigTimeout = 10 * time.Second

const matchSemantics = `FILTER is a tcpdump filter tested against each session's first SYN as the
client sent it: the session's addresses and ports (not those of its
subsessions), TCP, TTL 64, SYN only, no options, no payload: "tcp dst port
80", "src net 10.1.0.0/16 and dst host 10.0.9.1", "tcp and ip6".`

const outcomeSemantics = `Each matching session gets one line: its id at this agent, its tuple, the
outcome, the reason (and, when another reconfiguration holds part of the
path, that request as "blocked by ANCHOR#ID") and the time taken. The
outcome is
  succeeded  the session runs on the new path; the old one is gone (or,
             with the reason "unchanged", the segment already was the
             new chain: nothing was to change);
  refused    nothing changed: part of the path was locked by another
             reconfiguration (§3.2), an anchor was busy, the request does
             not fit the session, the right anchor is not on its path, or
             a hop of --chain is on the session's path already (named in
             the reason);
  failed     the reconfiguration started but could not complete (the new
             path could not be set up, no answer in time, the session
             ended); the session goes on on its old path.
A summary line follows. The exit status is 0 only if every matching session
succeeded; it is 1 if any did not, or if no session matched. --json prints
the agent's reply as JSON instead (same exit status).`

func newReconfigCmd() *cobra.Command {
	var (
		match   string
		to      string
		via     string
		chain   []string
		timeout time.Duration
		asJSON  bool
		mig     migFlags
		remote  remoteFlags
	)
	cmd := &cobra.Command{
		Use:   "reconfig --match 'FILTER' --to RIGHT_ANCHOR [--chain HOP[,HOP...]] [--via ADDR] [--timeout 10s] [--json] [--server URL --host AGENT]",
		Short: "Insert, delete or replace middleboxes in live sessions, from this host",
		Long: `Reconfigure the live sessions at this host that match FILTER (paper §3.1).
For each of them whose path goes on from this host to RIGHT_ANCHOR, this
host, the left anchor, replaces the segment of the path between itself and
RIGHT_ANCHOR (the right anchor) by a new segment through the hops of --chain,
in order. The middleboxes strictly between the two anchors leave the path;
the endpoints and the middleboxes kept see the same TCP session go on,
unbroken.

RIGHT_ANCHOR is a host after this one on the session's path (a middlebox of
its chain, or the session's destination) and runs an agent. The hops of
--chain are middlebox addresses (no type names), of the session's address
family, running agents; neither anchor may appear among them. A hop written
NF@ADDR (firewall@10.0.2.5) names the network function its host must run:
its agent starts it (its --nf NF.start=...) and waits until it is ready
before it joins the new segment, while the session stays on its old path;
if it cannot (no such function there, the start failed or was not ready in
time) the request fails with the reason and the session keeps its old path.
--timeout should cover the function's start. A host carries
a session once: a hop that the session already crosses cannot be on the new
segment too (the request is refused, naming it), unless --chain is exactly
the segment as it is (then nothing changes, and the request succeeds as
"unchanged"). To keep a middlebox and change what follows or precedes it,
anchor the request at it. The three operations are uses of this one
primitive:

  insert   --to the current next hop, --chain the new middlebox(es): they
           go between this host and its next hop;
  delete   --to the first host to keep after the ones deleted, no --chain
           (or --chain ''): every middlebox between this host and
           RIGHT_ANCHOR leaves the path;
  replace  --to the host after the middlebox(es) replaced, --chain the
           replacement(s).

The sessions this host can reconfigure are those it starts a chain for or
forwards as a middlebox: it must have a next hop. Sessions that one end has
closed are included (the other end's data still flows); sessions closed
both ways or reset, and those still in their handshake, are not. To act
from a middlebox on the sessions passing through it, see "dysco middlebox".

With --via ADDR the new segment leaves this host from ADDR, another of its
addresses (of another interface, or a second address of the same one): the
sessions move to it while the old path still works, with the two-path rules
of every reconfiguration, so no byte is lost (make before break; Serval §4.4).
The applications and the middleboxes keep seeing the same session. With no
middlebox to change, --to is the current next hop and --chain is left out.

With --server URL --host AGENT the request goes to the policy server, which
relays it to the agent named AGENT (its --name); that agent is then "this
host", and the command prints its results as if run there. The request
carries the operator certificate of --pki-dir (or --tls-cert, --tls-key).

` + matchSemantics + `

` + outcomeSemantics,
		Example: `  # insert the IDS 10.0.2.5 before the next hop 10.0.3.2 of web sessions
  dysco reconfig --match 'tcp dst port 80' --to 10.0.3.2 --chain 10.0.2.5
  # delete every middlebox between this host and the server 10.0.9.1
  dysco reconfig --match 'tcp dst port 80 and dst host 10.0.9.1' --to 10.0.9.1
  # replace the middlebox before 10.0.3.2 by two others, waiting up to 30s
  dysco reconfig --match tcp --to 10.0.3.2 --chain 10.0.2.6,10.0.2.7 --timeout 30s

  # insert 10.0.2.5, whose agent starts its network function "firewall"
  # (agent flag --nf firewall.start=...) before it joins
  dysco reconfig --match tcp --to 10.0.3.2 --chain firewall@10.0.2.5
  # replace the firewall before 10.0.3.2 by 10.0.2.6, moving its conntrack state
  dysco reconfig --match tcp --to 10.0.3.2 --chain 10.0.2.6 --migrate-state --semantics substream
  # move web sessions to this host's second interface (10.202.1.2), the
  # next hop 10.200.2.2 staying the same
  dysco reconfig --match 'tcp dst port 80' --to 10.200.2.2 --via 10.202.1.2
  # the same insertion, at the agent named edge1, from anywhere
  dysco reconfig --server https://10.0.0.9:7017 --host edge1 --match 'tcp dst port 80' --to 10.0.3.2 --chain 10.0.2.5`,
		Args: noArgsUse("give the filter with --match 'FILTER'"),
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := remote.check(); err != nil {
				return err
			}
			if !cmd.Flags().Changed("match") {
				return errors.New(`--match is required: a tcpdump filter selecting the sessions ("tcp" selects every session)`)
			}
			if strings.TrimSpace(match) == "" {
				return errors.New(`--match "": empty filter (use --match tcp to reconfigure every session with a path to --to)`)
			}
			if err := checkMatch(match); err != nil {
				return err
			}
			if !cmd.Flags().Changed("to") {
				return errors.New("--to is required: the right anchor, a host after this one on the sessions' path (the current next hop, to insert)")
			}
			right, err := parseAddr("--to", to)
			if err != nil {
				return err
			}
			hops, nfs, err := parseNFHops("--chain", chain)
			if err != nil {
				return err
			}
			for _, h := range hops {
				if h == right {
					return fmt.Errorf("--chain: %s is the right anchor (--to); the chain lists the middleboxes before it", h)
				}
				if h.Is4() != right.Is4() {
					return fmt.Errorf("--chain: %s and --to %s are of different address families", h, right)
				}
			}
			tms, err := timeoutMS(timeout)
			if err != nil {
				return err
			}
			req := api.ReconfigRequest{Match: match, To: right, Chain: hops, NFs: nfs, TimeoutMS: tms}
			if cmd.Flags().Changed("via") {
				if req.Via, err = parseAddr("--via", via); err != nil {
					return err
				}
				if req.Via.Is4() != right.Is4() {
					return fmt.Errorf("--via %s and --to %s are of different address families", req.Via, right)
				}
			}
			if req.Migrate, err = mig.spec(cmd, len(hops), "--chain"); err != nil {
				return err
			}
			rep, where, err := remote.do(cmd, api.Operation{Reconfig: &req}, timeout,
				func(ctx context.Context) (api.ReconfigReply, error) { return agentClient().Reconfig(ctx, req) })
			if err != nil {
				return err
			}
			return reportResults(cmd.OutOrStdout(), rep, asJSON,
				fmt.Sprintf("no live session at %s matches %q with a path to %s", where, match, right))
		},
	}
	f := cmd.Flags()
	f.StringVar(&match, "match", "", "tcpdump filter selecting the sessions, tested against their first SYN (required)")
	f.StringVar(&to, "to", "", "right anchor: the host after this one on the sessions' path where the new segment ends (required)")
	f.StringSliceVar(&chain, "chain", nil, "middleboxes of the new segment, in order: IP addresses, or NF@ADDR to have the host at ADDR start its network function NF before it joins (its agent's --nf), comma-separated; empty deletes every middlebox up to --to")
	f.StringVar(&via, "via", "", "address of this host the new segment leaves from: move the sessions to another of its addresses or interfaces (default: the one the route to the first hop chooses)")
	f.DurationVar(&timeout, "timeout", defaultReconfigTimeout, "how long the agent waits for the sessions' results")
	f.BoolVar(&asJSON, "json", false, "print the agent's reply as JSON")
	mig.flags(cmd)
	remote.flags(cmd)
	cmd.AddCommand(newReconfigHistoryCmd())
	return cmd
}

func newReconfigHistoryCmd() *cobra.Command {
	var (
		asJSON bool
		remote remoteFlags
		limit  int
	)
	cmd := &cobra.Command{
		Use:   "history [--json]",
		Short: "List the last reconfigurations this host ran as left anchor",
		Long: `List the reconfigurations this host's agent ran as left anchor, oldest
first: requested here with 'dysco reconfig', or asked for by a middlebox
(a proxy removing itself, 'dysco middlebox remove'). TIME is from the request
at this host to the old path no longer being used. The agent keeps the last
few thousand in memory: a restarted agent starts a new history.

With --server URL --host AGENT the policy server asks the agent named AGENT
(its --name) instead, and prints its newest results (--limit).`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := remote.check(); err != nil {
				return err
			}
			var rep api.ReconfigReply
			if remote.server != "" {
				op, err := remote.query(cmd, api.QueryHistory, limit)
				if err != nil {
					return err
				}
				if op.Reply != nil {
					rep = *op.Reply
				}
			} else {
				var err error
				if rep, err = agentClient().ReconfigHistory(cmd.Context()); err != nil {
					return err
				}
			}
			if asJSON {
				if rep.Results == nil {
					rep.Results = []api.ReconfigResult{}
				}
				return writeJSONOut(cmd.OutOrStdout(), rep)
			}
			if len(rep.Results) == 0 {
				_, err := fmt.Fprintln(cmd.OutOrStdout(), "no reconfigurations yet")
				return err
			}
			return printResults(cmd.OutOrStdout(), rep.Results)
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print the agent's reply as JSON")
	remote.queryFlags(cmd, &limit, "results (the newest)")
	return cmd
}

func newMiddleboxCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "middlebox",
		Short: "Take this middlebox host out of live sessions, or replace it in them",
		Long: `Run on a middlebox host: reconfigure the live sessions passing through it
(paper §2.3), for example before taking the middlebox down for maintenance,
to shed load onto other instances, or to leave sessions it no longer needs
to see. For each session the agent asks its left neighbour on the path to
reconfigure the segment around this host (paper §3.1: the left neighbour is
the left anchor, this host's right neighbour the right anchor).

With --server URL --host AGENT the request goes to the policy server, which
relays it to the middlebox agent named AGENT (its --name): run it from
anywhere, for example an operator's console, with the operator certificate
of --pki-dir (or --tls-cert, --tls-key).`,
	}
	cmd.AddCommand(newMiddleboxRemoveCmd(), newMiddleboxReplaceCmd())
	return cmd
}

func newMiddleboxRemoveCmd() *cobra.Command {
	var (
		match   string
		timeout time.Duration
		asJSON  bool
		remote  remoteFlags
	)
	cmd := &cobra.Command{
		Use:     "remove [--match FILTER] [--timeout 10s] [--json] [--server URL --host AGENT]",
		Aliases: []string{"rm"},
		Short:   "Take this host out of every matching session passing through it",
		Long: `Take this middlebox host out of every live session passing through it that
matches FILTER (every such session without --match): the session goes on
straight from this host's left neighbour to its right neighbour on the path
(paper §2.3, a deletion in the sense of §3.1). Sessions this host starts or
ends are not affected.

` + matchSemantics + `

` + outcomeSemantics,
		Example: `  dysco middlebox remove
  dysco middlebox remove --match 'tcp dst port 443' --timeout 30s
  # take the middlebox host named fw1 out of its sessions, from anywhere
  dysco middlebox remove --server https://10.0.0.9:7017 --host fw1`,
		Args: noArgsUse("give the filter with --match 'FILTER'"),
		RunE: func(cmd *cobra.Command, _ []string) error {
			return runMiddlebox(cmd, match, nil, timeout, asJSON, nil, remote)
		},
	}
	addMiddleboxFlags(cmd, &match, &timeout, &asJSON)
	remote.flags(cmd)
	return cmd
}

func newMiddleboxReplaceCmd() *cobra.Command {
	var (
		match   string
		with    []string
		timeout time.Duration
		asJSON  bool
		mig     migFlags
		remote  remoteFlags
	)
	cmd := &cobra.Command{
		Use:   "replace --with HOP[,HOP...] [--match FILTER] [--timeout 10s] [--json] [--server URL --host AGENT]",
		Short: "Replace this host by other middleboxes in every matching session passing through it",
		Long: `Replace this middlebox host, in every live session passing through it that
matches FILTER (every such session without --match), by the hops of --with,
in order: the session goes from this host's left neighbour through them to
its right neighbour (paper §2.3, a replacement in the sense of §3.1). The
hops are middlebox addresses (no type names) of one address family, running
agents; this host must not be among them. Sessions this host starts or ends
are not affected.

` + matchSemantics + `

` + outcomeSemantics,
		Example: `  dysco middlebox replace --with 10.0.2.6
  dysco middlebox replace --with 10.0.2.6,10.0.2.7 --match 'src net 10.1.0.0/16'`,
		Args: noArgsUse("give the replacement hops with --with HOP[,HOP...] and the filter with --match 'FILTER'"),
		RunE: func(cmd *cobra.Command, _ []string) error {
			hops, err := parseHops("--with", with)
			if err != nil {
				return err
			}
			if len(hops) == 0 {
				return errors.New(`--with is required: the middleboxes to replace this host by (to take this host out without a replacement, use "dysco middlebox remove")`)
			}
			for _, h := range hops[1:] {
				if h.Is4() != hops[0].Is4() {
					return fmt.Errorf("--with: %s and %s are of different address families", hops[0], h)
				}
			}
			spec, err := mig.spec(cmd, len(hops), "--with")
			if err != nil {
				return err
			}
			return runMiddlebox(cmd, match, hops, timeout, asJSON, spec, remote)
		},
	}
	cmd.Flags().StringSliceVar(&with, "with", nil, "middleboxes to put in this host's place, in order: IP addresses, comma-separated (required)")
	mig.flags(cmd)
	addMiddleboxFlags(cmd, &match, &timeout, &asJSON)
	remote.flags(cmd)
	return cmd
}

func addMiddleboxFlags(cmd *cobra.Command, match *string, timeout *time.Duration, asJSON *bool) {
	f := cmd.Flags()
	f.StringVar(match, "match", "", "tcpdump filter selecting the sessions, tested against their first SYN (default: every session through this host)")
	f.DurationVar(timeout, "timeout", defaultReconfigTimeout, "how long the agent waits for the sessions' results")
	f.BoolVar(asJSON, "json", false, "print the agent's reply as JSON")
}

func runMiddlebox(cmd *cobra.Command, match string, with []netip.Addr, timeout time.Duration, asJSON bool, spec *api.MigrateSpec, remote remoteFlags) error {
	if err := remote.check(); err != nil {
		return err
	}
	if err := checkMatch(match); err != nil {
		return err
	}
	tms, err := timeoutMS(timeout)
	if err != nil {
		return err
	}
	req := api.MiddleboxRequest{Match: match, With: with, TimeoutMS: tms, Migrate: spec}
	rep, where, err := remote.do(cmd, api.Operation{Middlebox: &req}, timeout,
		func(ctx context.Context) (api.ReconfigReply, error) { return agentClient().Middlebox(ctx, req) })
	if err != nil {
		return err
	}
	none := "no live session passes through " + where
	if strings.TrimSpace(match) != "" {
		none = fmt.Sprintf("no live session passing through %s matches %q", where, match)
	}
	return reportResults(cmd.OutOrStdout(), rep, asJSON, none)
}

// remoteFlags send a reconfiguration request through the policy server to
// a named agent (--server, --host) instead of to the local agent.
type remoteFlags struct {
	server, host string
	pki          pkiFlags
}

func (r *remoteFlags) flags(cmd *cobra.Command) {
	f := cmd.Flags()
	f.StringVar(&r.server, "server", "", "policy server URL (https://HOST:7017, with the operator certificate of --pki-dir): send the request through it to the agent --host; default: the local agent")
	f.StringVar(&r.host, "host", "", "with --server: the agent (its --name) that carries the request out")
	r.pki.add(f, certs.RoleOperator)
}

func (r *remoteFlags) check() error {
	switch {
	case r.server == "" && r.host != "":
		return errors.New("--host needs --server: the policy server relays the request to the agent named by --host (without both, the local agent carries it out)")
	case r.server != "" && strings.TrimSpace(r.host) == "":
		return errors.New("--server needs --host: the name of the agent that is to carry the request out")
	}
	return nil
}

// do carries op out: through the policy server on the agent --host when
// --server is given, else on the local agent (local). where names the agent
// for the messages.
func (r *remoteFlags) do(cmd *cobra.Command, op api.Operation, timeout time.Duration,
	local func(context.Context) (api.ReconfigReply, error)) (rep api.ReconfigReply, where string, err error) {
	if r.server == "" {
		rep, err = local(cmd.Context())
		return rep, "this host", err
	}
	rep, err = r.run(cmd, op, timeout)
	return rep, r.host, err
}

// run has the policy server relay op to the agent r.host and waits for its
// reply: the agent's own wait (timeout), plus the time to claim and report.
func (r *remoteFlags) run(cmd *cobra.Command, op api.Operation, timeout time.Duration) (api.ReconfigReply, error) {
	cur, err := r.runOp(cmd, op, timeout)
	if err != nil {
		return api.ReconfigReply{}, err
	}
	if cur.Reply == nil {
		return api.ReconfigReply{}, fmt.Errorf("operation %s: the agent's reply has no results", cur.ID)
	}
	return *cur.Reply, nil
}

// runOp has the policy server relay op to the agent r.host and returns it
// done, or the error it failed with.
func (r *remoteFlags) runOp(cmd *cobra.Command, op api.Operation, timeout time.Duration) (api.Operation, error) {
	op.Host = strings.TrimSpace(r.host)
	if timeout > api.MaxOperationTimeoutMS*time.Millisecond {
		return api.Operation{}, fmt.Errorf("--timeout %v: at most 5m through the policy server (the most an agent waits)", timeout)
	}
	c, err := r.pki.serverClient(r.server)
	if err != nil {
		return api.Operation{}, err
	}
	created, err := c.CreateOperation(cmd.Context(), op)
	if err != nil {
		return api.Operation{}, err
	}
	// The server fails an operation that is not claimed or reported in
	// time, so this wait ends; the margin covers a server that restarted
	// (and forgot the operation) while we waited.
	deadline := time.Now().Add(timeout + 2*time.Minute)
	cur := created
	for !cur.IsFinished() {
		left := time.Until(deadline)
		if left <= 0 {
			return api.Operation{}, fmt.Errorf("operation %s at agent %q: no result from %s in time (last state %s); `dysco reconfig history` on the left anchors shows what happened", created.ID, op.Host, c.Target(), cur.State)
		}
		cur, err = c.Operation(cmd.Context(), created.ID, min(left, 30*time.Second))
		if err != nil {
			return api.Operation{}, fmt.Errorf("operation %s at agent %q: %w", created.ID, op.Host, err)
		}
	}
	if cur.State != api.OpDone {
		return api.Operation{}, fmt.Errorf("operation %s: %s", created.ID, cur.Error)
	}
	return cur, nil
}

// query asks the agent r.host, through the policy server, for what its
// local API lists.
func (r *remoteFlags) query(cmd *cobra.Command, what string, limit int) (api.Operation, error) {
	if limit < 0 || limit > api.MaxQueryLimit {
		return api.Operation{}, fmt.Errorf("--limit %d: want 1 to %d", limit, api.MaxQueryLimit)
	}
	return r.runOp(cmd, api.Operation{Query: &api.QueryRequest{What: what, Limit: limit}}, psclient.DefaultOpTimeout)
}

// queryFlags are --server, --host and --limit of the listing verbs.
func (r *remoteFlags) queryFlags(cmd *cobra.Command, limit *int, what string) {
	f := cmd.Flags()
	f.StringVar(&r.server, "server", "", "policy server URL (https://HOST:7017, with the operator certificate of --pki-dir), or several replicas' URLs separated by commas: ask the agent --host through it; default: the local agent")
	f.StringVar(&r.host, "host", "", "with --server: the agent (its --name) to ask")
	f.IntVar(limit, "limit", api.DefaultQueryLimit, "with --server: at most this many "+what)
	r.pki.add(f, certs.RoleOperator)
}

// migFlags are the state migration flags of reconfig and middlebox replace.
type migFlags struct {
	on        bool
	semantics string
	holdLimit int64
	timeout   time.Duration
}

func (m *migFlags) flags(cmd *cobra.Command) {
	f := cmd.Flags()
	f.BoolVar(&m.on, "migrate-state", false, "move the replaced middlebox's per-session state (conntrack entries, state of middleboxes registered with the agent) to its replacement before the new path carries a packet; one middlebox replaced by one")
	f.StringVar(&m.semantics, "semantics", "loss-free", "cut-over semantics with --migrate-state: loss-free, order or substream (docs/state-migration.md)")
	f.Int64Var(&m.holdLimit, "hold-limit", 0, "bytes each anchor may hold during the cut-over with --migrate-state; reaching it cancels (default 8 MiB, at most 256 MiB)")
	f.DurationVar(&m.timeout, "migrate-timeout", 5*time.Second, "bound on freeze, drain, export and import with --migrate-state; exceeding it cancels (at most 5m)")
}

// spec checks the flags and returns the request's migration part.
func (m *migFlags) spec(cmd *cobra.Command, hops int, hopsFlag string) (*api.MigrateSpec, error) {
	f := cmd.Flags()
	if !m.on {
		for _, n := range []string{"semantics", "hold-limit", "migrate-timeout"} {
			if f.Changed(n) {
				return nil, fmt.Errorf("--%s needs --migrate-state", n)
			}
		}
		return nil, nil
	}
	if hops != 1 {
		return nil, fmt.Errorf("--migrate-state replaces one middlebox by one: %s must name exactly one (it names %d)", hopsFlag, hops)
	}
	switch m.semantics {
	case "loss-free", "order", "substream":
	default:
		return nil, fmt.Errorf("--semantics %q: want loss-free, order or substream", m.semantics)
	}
	if m.holdLimit < 0 || m.holdLimit > api.MaxHoldLimit {
		return nil, fmt.Errorf("--hold-limit %d: want 0 (8 MiB) to %d (256 MiB)", m.holdLimit, api.MaxHoldLimit)
	}
	if m.timeout <= 0 || m.timeout > api.MaxMigrateTimeoutMS*time.Millisecond {
		return nil, fmt.Errorf("--migrate-timeout %s: want more than 0 and at most 5m", m.timeout)
	}
	return &api.MigrateSpec{Semantics: m.semantics, HoldLimit: m.holdLimit, TimeoutMS: int(m.timeout.Milliseconds())}, nil
}

// noArgsUse refuses positional arguments with a hint: a filter given
// without --match is the likely mistake.
func noArgsUse(hint string) cobra.PositionalArgs {
	return func(cmd *cobra.Command, args []string) error {
		if len(args) > 0 {
			return fmt.Errorf("unexpected argument %q: %s", strings.Join(args, " "), hint)
		}
		return nil
	}
}

// checkMatch compiles a --match filter here, so that a mistake is reported
// before the agent is asked; empty matches everything.
func checkMatch(match string) error {
	if _, err := policy.CompileMatch(match); err != nil {
		return fmt.Errorf("--match: %w", err)
	}
	return nil
}

// parseAddr reads the IP address given to flag.
func parseAddr(flag, s string) (netip.Addr, error) {
	a, err := netip.ParseAddr(strings.TrimSpace(s))
	if err != nil {
		return netip.Addr{}, fmt.Errorf("%s: %q is not an IP address", flag, s)
	}
	if !wire.Unicast(a) {
		return netip.Addr{}, fmt.Errorf("%s: %s is not a unicast address (unspecified, loopback, multicast or broadcast)", flag, a.Unmap())
	}
	return a.Unmap(), nil
}

// parseHops reads the addresses given to flag (comma-separated, or the flag
// repeated), skipping blanks; they must be distinct and at most
// api.MaxChain.
func parseHops(flag string, vals []string) ([]netip.Addr, error) {
	var hops []netip.Addr
	for _, v := range vals {
		if strings.TrimSpace(v) == "" {
			continue
		}
		a, err := parseAddr(flag, v)
		if err != nil {
			return nil, err
		}
		if len(hops) == api.MaxChain {
			// Before the loop below, which is quadratic: a list of
			// tens of thousands took seconds (FuzzSessionArgs stalled).
			return nil, fmt.Errorf("%s: more than %d hops; at most %d are allowed", flag, api.MaxChain, api.MaxChain)
		}
		for _, h := range hops {
			if h == a {
				return nil, fmt.Errorf("%s: %s appears twice (the path would loop)", flag, a)
			}
		}
		hops = append(hops, a)
	}
	return hops, nil
}

// parseNFHops reads hops as parseHops does, each an address or NF@ADDR:
// the network function the host at ADDR must run, which its agent starts
// before it joins the new path (its --nf). nfs is nil when no hop names
// one, else one per hop ("" for none). An IPv6 address holds no '@'.
func parseNFHops(flag string, vals []string) ([]netip.Addr, []string, error) {
	var addrs, nfs []string
	named := false
	for _, v := range vals {
		if strings.TrimSpace(v) == "" {
			continue
		}
		name, addr, ok := strings.Cut(strings.TrimSpace(v), "@")
		if !ok {
			name, addr = "", v
		} else if !protocol.ValidNFName(name) {
			return nil, nil, fmt.Errorf("%s: %q: the network function's name must be a letter, then letters, digits, '_' or '-', at most %d characters", flag, v, protocol.MaxNFName)
		} else if strings.TrimSpace(addr) == "" {
			return nil, nil, fmt.Errorf("%s: %q: no address after '@'", flag, v)
		} else {
			named = true
		}
		addrs = append(addrs, addr)
		nfs = append(nfs, name)
	}
	hops, err := parseHops(flag, addrs)
	if err != nil {
		return nil, nil, err
	}
	if !named {
		nfs = nil
	}
	return hops, nfs, nil
}

// timeoutMS converts --timeout for the request.
func timeoutMS(d time.Duration) (int, error) {
	if d < time.Millisecond {
		return 0, fmt.Errorf("--timeout %v: must be at least 1ms", d)
	}
	if d > 24*time.Hour {
		return 0, fmt.Errorf("--timeout %v: at most 24h", d)
	}
	return int(d.Milliseconds()), nil
}

// Outcomes of api.ReconfigResult.
const (
	outcomeSucceeded = "succeeded"
	outcomeRefused   = "refused"
	outcomeFailed    = "failed"
)

// reportResults prints the reply (a table and a summary line, or JSON) and
// returns the command's verdict: an error saying none when no session
// matched, exit status 1 when some session did not succeed.
func reportResults(w io.Writer, rep api.ReconfigReply, asJSON bool, none string) error {
	if asJSON {
		if rep.Results == nil {
			rep.Results = []api.ReconfigResult{}
		}
		if err := writeJSONOut(w, rep); err != nil {
			return err
		}
	}
	if len(rep.Results) == 0 {
		return errors.New(none)
	}
	var ok, refused, failed int
	for _, r := range rep.Results {
		switch r.Outcome {
		case outcomeSucceeded:
			ok++
		case outcomeRefused:
			refused++
		default:
			// "failed", or an outcome this CLI does not know: it did
			// not succeed.
			failed++
		}
	}
	if !asJSON {
		if err := printResults(w, rep.Results); err != nil {
			return err
		}
		if _, err := fmt.Fprintf(w, "%d succeeded, %d refused, %d failed\n", ok, refused, failed); err != nil {
			return err
		}
	}
	if ok != len(rep.Results) {
		return exitError(1)
	}
	return nil
}

func printResults(w io.Writer, rs []api.ReconfigResult) error {
	tw := newTabWriter(w)
	fmt.Fprintln(tw, "ID\tSESSION\tOUTCOME\tREASON\tTIME\tLOCK/SETUP/TWO-PATH")
	for _, r := range rs {
		reason := r.Reason
		if r.Blocker != "" {
			reason = strings.TrimSpace(reason + " (blocked by " + r.Blocker + ")")
		}
		fmt.Fprintf(tw, "%d\t%s\t%s\t%s\t%s\t%s\n", r.ID, orDash(r.Session), orDash(r.Outcome), orDash(reason), formatMicros(r.Micros), formatPhases(r))
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	for _, r := range rs {
		if m := r.Migration; m != nil && m.Error == "" {
			fmt.Fprintf(w, "%d: state %s (%d B, %s) moved in %s: drain %s, export %s, import %s; held %d packets (%d B)",
				r.ID, m.Semantics, m.StateBytes, orDash(strings.Join(m.Plugins, "+")), formatMicros(m.SwitchMicros),
				formatMicros(m.DrainMicros), formatMicros(m.ExportMicros), formatMicros(m.ImportMicros), m.HeldPackets, m.HeldBytes)
			if m.Note != "" {
				fmt.Fprintf(w, "; %s", m.Note)
			}
			fmt.Fprintln(w)
		}
	}
	return nil
}

// formatPhases writes the phases of a reconfiguration at its left anchor:
// locking, setting up the new path, and the two-path phase (each its own
// duration, adding up to the total), "-" where they are not known. When
// the new path waited for a network function to start, that wait is a
// phase of its own after the locking ("nf 812.0").
func formatPhases(r api.ReconfigResult) string {
	if r.LockMicros <= 0 {
		return "-"
	}
	if r.NFMicros > 0 {
		// The wait for a network function, its own phase within the
		// set-up: lock/nf/rest of the set-up/two-path.
		if r.SetupMicros <= 0 {
			return fmt.Sprintf("%.1f/nf %.1f/-/-ms", float64(r.LockMicros)/1000, float64(r.NFMicros)/1000)
		}
		return fmt.Sprintf("%.1f/nf %.1f/%.1f/%.1fms", float64(r.LockMicros)/1000, float64(r.NFMicros)/1000,
			float64(max(r.SetupMicros-r.LockMicros-r.NFMicros, 0))/1000, float64(r.Micros-r.SetupMicros)/1000)
	}
	if r.SetupMicros <= 0 {
		return fmt.Sprintf("%.1f/-/-ms", float64(r.LockMicros)/1000)
	}
	return fmt.Sprintf("%.1f/%.1f/%.1fms", float64(r.LockMicros)/1000, float64(r.SetupMicros-r.LockMicros)/1000, float64(r.Micros-r.SetupMicros)/1000)
}

// formatMicros writes a duration in microseconds as milliseconds: 12.3ms.
func formatMicros(us int64) string {
	return fmt.Sprintf("%.1fms", float64(us)/1000)
}
