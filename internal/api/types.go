// Package api holds the types that the agent's local API, the policy server
// and the CLI exchange as JSON, and the small client the CLI uses.
package api

import (
	"errors"
	"fmt"
	"net/netip"
	"regexp"
	"sort"
	"strings"
	"time"

	"github.com/dysco/dysco/internal/wire"
)

// Policy steers the sessions whose first packet matches Filter through Chain
// (paper §2.2). Policies are evaluated in ascending Priority, then Name; the
// first match wins.
type Policy struct {
	// Name identifies the policy; [A-Za-z0-9._-], at most 63 characters.
	Name string `json:"name"`
	// Filter is a predicate in tcpdump filter syntax, compiled by libpcap
	// against the Ethernet frame of the session's first packet: a TCP SYN
	// or the first UDP datagram. A filter that matches neither is refused
	// (policy.Compile).
	Filter string `json:"filter"`
	// Chain lists the middleboxes to traverse, in order. An empty chain makes
	// matching sessions Dysco sessions straight to their destination so that
	// they can be reconfigured later.
	Chain []Hop `json:"chain,omitempty"`
	// EndBeforeDestination ends the chain at its last hop, which hands the
	// plain SYN on to the destination by ordinary routing (§2.4). Without
	// it the destination is the chain's last address.
	EndBeforeDestination bool `json:"end_before_destination,omitempty"`
	// Priority orders policies; lower is evaluated first.
	Priority int `json:"priority,omitempty"`
	// Hosts names the agents the policy server gives this policy to; empty
	// means every agent.
	Hosts []string `json:"hosts,omitempty"`
	// IdleTimeoutS is how long, in seconds, a session of this policy that
	// does not end with a FIN (UDP) lives without a packet: 0 for the
	// defaults (DefaultIdleTimeoutOneWay, DefaultIdleTimeoutStream), else
	// MinIdleTimeout to MaxIdleTimeout, for sessions that have seen one
	// direction or both alike.
	IdleTimeoutS int `json:"idle_timeout_s,omitempty"`
	// Via lists local addresses that the sessions the policy starts leave
	// from (their first subsession: the session tuple keeps its own
	// source), for a host with several links. A session's hash picks one
	// of those of its family, an address listed k times having k shares;
	// a session whose pick is not an address of one of the host's
	// interfaces that carry traffic leaves from its route's source, as do
	// all when Via is empty. At most MaxVia per family.
	Via []netip.Addr `json:"via,omitempty"`
}

// MaxVia is the most local addresses of one family a policy's Via lists
// (repetitions included).
const MaxVia = 8

// Idle timeouts of sessions that do not end with a FIN (UDP). The defaults
// are those of Linux's connection tracking for UDP
// (nf_conntrack_udp_timeout and nf_conntrack_udp_timeout_stream): a session
// that has seen packets one way only ends after DefaultIdleTimeoutOneWay
// without a packet, one that has seen both directions after
// DefaultIdleTimeoutStream. A policy's IdleTimeoutS replaces both.
const (
	DefaultIdleTimeoutOneWay = 30 * time.Second
	DefaultIdleTimeoutStream = 120 * time.Second
	MinIdleTimeout           = time.Second
	MaxIdleTimeout           = 18 * time.Hour // the block carries seconds in 16 bits
)

// IdleTimeout is p's idle timeout, 0 when p uses the defaults.
func (p *Policy) IdleTimeout() time.Duration {
	return time.Duration(p.IdleTimeoutS) * time.Second
}

// Hop is one element of a chain: a middlebox address, or the name of a
// middlebox type whose instance the agent picks (round robin).
type Hop struct {
	Addr netip.Addr `json:"addr,omitzero"`
	Type string     `json:"type,omitempty"`
}

func (h Hop) String() string {
	if h.Type != "" {
		return h.Type
	}
	return h.Addr.String()
}

// ParseHop reads an address, or else a type name.
func ParseHop(s string) (Hop, error) {
	s = strings.TrimSpace(s)
	if a, err := netip.ParseAddr(s); err == nil {
		return Hop{Addr: a.Unmap()}, nil
	}
	if !nameRE.MatchString(s) {
		return Hop{}, fmt.Errorf("hop %q: neither an IP address nor a middlebox type name", s)
	}
	return Hop{Type: s}, nil
}

// MaxInstances bounds the instances of a middlebox type (the datapath's
// MAX_INSTANCES).
const MaxInstances = 16

// MiddleboxType is a named set of interchangeable middlebox instances.
type MiddleboxType struct {
	Name      string       `json:"name"`
	Instances []netip.Addr `json:"instances"`
}

var nameRE = regexp.MustCompile(`^[A-Za-z][A-Za-z0-9._-]{0,62}$`)

// MaxChain is the longest chain a policy may name (the SYN block carries the
// chain plus the destination).
const MaxChain = 7

// Bounds of a policy set: the datapath holds at most MaxTypes middlebox
// types and MaxPolicies policies per host (a bank of its maps); the
// policy server stores at most MaxStoredPolicies policies (each host gets
// those meant for it); a policy names at most MaxHosts agents and its
// filter is at most MaxFilterLen bytes.
const (
	MaxTypes          = 64
	MaxPolicies       = 64
	MaxStoredPolicies = 1024
	MaxHosts          = 256
	MaxFilterLen      = 8192
)

// Validate checks everything about p that does not need libpcap.
func (p *Policy) Validate() error {
	if !nameRE.MatchString(p.Name) {
		return fmt.Errorf("policy %q: name must start with a letter and contain only letters, digits, '.', '_' and '-' (at most 63)", p.Name)
	}
	if strings.TrimSpace(p.Filter) == "" {
		return fmt.Errorf("policy %q: empty filter (use \"tcp\" to match every TCP session)", p.Name)
	}
	if len(p.Filter) > MaxFilterLen {
		return fmt.Errorf("policy %q: filter of %d bytes, at most %d", p.Name, len(p.Filter), MaxFilterLen)
	}
	if len(p.Chain) > MaxChain {
		return fmt.Errorf("policy %q: chain has %d hops, at most %d are allowed", p.Name, len(p.Chain), MaxChain)
	}
	if len(p.Hosts) > MaxHosts {
		return fmt.Errorf("policy %q: %d hosts, at most %d", p.Name, len(p.Hosts), MaxHosts)
	}
	for _, h := range p.Hosts {
		if h == "" || len(h) > 253 || strings.IndexFunc(h, func(r rune) bool { return r <= ' ' || r == 0x7f }) >= 0 {
			return fmt.Errorf("policy %q: host %q is not an agent name", p.Name, h)
		}
	}
	if s := p.IdleTimeoutS; s != 0 && (s < int(MinIdleTimeout/time.Second) || s > int(MaxIdleTimeout/time.Second)) {
		return fmt.Errorf("policy %q: idle timeout of %d s: want 0 (the defaults, %v one way, %v both ways) or %v to %v",
			p.Name, p.IdleTimeoutS, DefaultIdleTimeoutOneWay, DefaultIdleTimeoutStream, MinIdleTimeout, MaxIdleTimeout)
	}
	perFamily := map[bool]int{}
	for _, a := range p.Via {
		if !a.IsValid() || !wire.Unicast(a) {
			return fmt.Errorf("policy %q: via %s is not a unicast address (unspecified, loopback, multicast or broadcast)", p.Name, a)
		}
		if perFamily[a.Unmap().Is6()]++; perFamily[a.Unmap().Is6()] > MaxVia {
			return fmt.Errorf("policy %q: more than %d via addresses of one family", p.Name, MaxVia)
		}
	}
	if p.EndBeforeDestination && len(p.Chain) == 0 {
		return fmt.Errorf("policy %q: end_before_destination needs a chain", p.Name)
	}
	seen := map[string]bool{}
	for i, h := range p.Chain {
		if h.Addr.IsValid() == (h.Type != "") {
			return fmt.Errorf("policy %q: hop %d must be an address or a type, not both or neither", p.Name, i+1)
		}
		if h.Addr.IsValid() && !wire.Unicast(h.Addr) {
			return fmt.Errorf("policy %q: hop %s is not a unicast address (unspecified, loopback, multicast or broadcast)", p.Name, h)
		}
		if h.Addr.IsValid() && seen[h.String()] {
			return fmt.Errorf("policy %q: hop %s appears twice (the chain would loop)", p.Name, h)
		}
		seen[h.String()] = true
	}
	return nil
}

// Validate checks a middlebox type.
func (t *MiddleboxType) Validate() error {
	if !nameRE.MatchString(t.Name) {
		return fmt.Errorf("type %q: invalid name", t.Name)
	}
	if len(t.Instances) == 0 {
		return fmt.Errorf("type %q: no instances", t.Name)
	}
	if len(t.Instances) > MaxInstances {
		return fmt.Errorf("type %q: %d instances, at most %d", t.Name, len(t.Instances), MaxInstances)
	}
	seen := map[netip.Addr]bool{}
	for i, a := range t.Instances {
		if !a.IsValid() {
			return fmt.Errorf("type %q: instance %d is not an IP address", t.Name, i+1)
		}
		if !wire.Unicast(a) {
			return fmt.Errorf("type %q: instance %s is not a unicast address (unspecified, loopback, multicast or broadcast)", t.Name, a)
		}
		if seen[a.Unmap()] {
			return fmt.Errorf("type %q: instance %s appears twice", t.Name, a)
		}
		seen[a.Unmap()] = true
	}
	return nil
}

// PolicySet is what the policy server hands an agent, and what an agent keeps
// on disk to keep working while the server is down.
type PolicySet struct {
	// Version increases with every change at the server.
	Version  uint64          `json:"version"`
	Policies []Policy        `json:"policies"`
	Types    []MiddleboxType `json:"types"`
}

// ReconfigRequest asks the agent, as left anchor, to replace the segment of
// every live session matching Match between itself and the right anchor To
// by a new path through Chain (paper §3.1): an empty Chain deletes every
// middlebox in between. Insert, delete and replace are uses of it.
type ReconfigRequest struct {
	// Match is a tcpdump filter tested against each session's tuple (as
	// the session's first SYN).
	Match string       `json:"match"`
	To    netip.Addr   `json:"to"`
	Chain []netip.Addr `json:"chain,omitempty"`
	// NFs, if set, has one entry per hop of Chain: the network function
	// that hop's agent must start before it joins the new path ("" for
	// none; docs/operating.md, "Network functions on demand").
	NFs []string `json:"nfs,omitempty"`
	// Via, if set, is the address of this host the new path leaves from:
	// the sessions move to another of its addresses or interfaces while
	// the old path still works (make before break; docs/mobility.md).
	Via netip.Addr `json:"via,omitzero"`
	// TimeoutMS bounds the wait for the results (0: the agent's default).
	TimeoutMS int `json:"timeout_ms,omitempty"`
	// Migrate moves the replaced middlebox's per-session state to its
	// replacement before the new path carries a packet (paper §3.5, §5.3).
	Migrate *MigrateSpec `json:"migrate,omitempty"`
}

// RebindRequest asks the agent to rebind the live sessions matching Match
// that this host is an end of (it starts them, or they end here) to Via,
// another address of this host: the subsession to the session's
// neighbour moves to Via at once, without a new path (break before make;
// docs/mobility.md). The reply is a ReconfigReply, one result per session.
type RebindRequest struct {
	Match string     `json:"match"`
	Via   netip.Addr `json:"via"`
	// TimeoutMS bounds the wait for the results (0: the agent's default).
	TimeoutMS int `json:"timeout_ms,omitempty"`
}

// CheckPath checks the right anchor and new chain of a ReconfigRequest:
// unicast addresses of one family, the anchor not in the chain, no address
// twice, at most MaxChain hops. The CLI checks the same before asking.
func CheckPath(to netip.Addr, chain []netip.Addr) error {
	to = to.Unmap()
	if !to.IsValid() {
		return errors.New("no right anchor (to)")
	}
	if !wire.Unicast(to) {
		return fmt.Errorf("the right anchor %s is not a unicast address", to)
	}
	if len(chain) > MaxChain {
		return fmt.Errorf("the chain has %d hops, at most %d are allowed", len(chain), MaxChain)
	}
	for i, h := range chain {
		h = h.Unmap()
		switch {
		case !wire.Unicast(h):
			return fmt.Errorf("hop %s is not a unicast address", h)
		case h == to:
			return fmt.Errorf("the right anchor %s is in the chain", to)
		case h.Is4() != to.Is4():
			return fmt.Errorf("hop %s and the right anchor %s are of different address families", h, to)
		}
		for _, g := range chain[:i] {
			if g.Unmap() == h {
				return fmt.Errorf("hop %s appears twice (the path would loop)", h)
			}
		}
	}
	return nil
}

// MigrateSpec asks for state migration (docs/state-migration.md).
type MigrateSpec struct {
	// Semantics of the cut-over: "loss-free" (default), "order" or
	// "substream" (M2M §5).
	Semantics string `json:"semantics,omitempty"`
	// HoldLimit bounds the bytes each anchor holds meanwhile (0: 8 MiB);
	// reaching it cancels the replacement.
	HoldLimit int64 `json:"hold_limit,omitempty"`
	// TimeoutMS bounds freeze, drain, export and import (0: 5 s).
	TimeoutMS int `json:"timeout_ms,omitempty"`
}

// Maxima of a MigrateSpec (the protocol clamps what peers send to the same).
const (
	MaxHoldLimit        = 256 << 20
	MaxMigrateTimeoutMS = 5 * 60 * 1000
)

// Validate checks the bounds of a migration spec (nil: none).
func (m *MigrateSpec) Validate() error {
	if m == nil {
		return nil
	}
	if m.HoldLimit < 0 || m.HoldLimit > MaxHoldLimit {
		return fmt.Errorf("migrate: hold_limit %d: want 0 (8 MiB) to %d (256 MiB)", m.HoldLimit, MaxHoldLimit)
	}
	if m.TimeoutMS < 0 || m.TimeoutMS > MaxMigrateTimeoutMS {
		return fmt.Errorf("migrate: timeout_ms %d: want 0 (5 s) to %d (5 minutes)", m.TimeoutMS, MaxMigrateTimeoutMS)
	}
	return nil
}

// MigrationReport tells how a state migration went, at the left anchor.
type MigrationReport struct {
	Semantics string `json:"semantics"`
	// Error is why it was cancelled; empty when the state moved.
	Error string `json:"error,omitempty"`
	Note  string `json:"note,omitempty"`
	// Plugins that exported state, and its size.
	Plugins    []string `json:"plugins,omitempty"`
	StateBytes int      `json:"state_bytes"`
	// Packets and bytes the left anchor held; dropped past twice the bound.
	HeldPackets int64 `json:"held_packets"`
	HeldBytes   int64 `json:"held_bytes"`
	HoldDropped int64 `json:"hold_dropped,omitempty"`
	// Times from the request's start: the left anchor froze, then the
	// drain, export and import took so long, and the new path was let go
	// (SwitchMicros: the reconfiguration time with state transfer).
	FreezeMicros int64 `json:"freeze_us"`
	DrainMicros  int64 `json:"drain_us"`
	ExportMicros int64 `json:"export_us"`
	ImportMicros int64 `json:"import_us"`
	SwitchMicros int64 `json:"switch_us"`
}

// ReconfigResult is the outcome of the reconfiguration of one session.
type ReconfigResult struct {
	ID      uint32 `json:"id"`
	Session string `json:"session"`
	// Outcome is "succeeded", "refused" (never locked: contention, bad
	// request, right anchor not on the path) or "failed" (locked but not
	// completed; the session goes on on its old path).
	Outcome string `json:"outcome"`
	Reason  string `json:"reason,omitempty"`
	// Unchanged (succeeded): the new chain was the session's current
	// segment between the anchors; nothing changed.
	Unchanged bool `json:"unchanged,omitempty"`
	// Blocker is the request that held the lock, for contention refusals.
	Blocker string `json:"blocker,omitempty"`
	// Micros is the time from the request to the old path no longer being
	// used (the left anchor's completion).
	Micros int64 `json:"micros"`
	// LockMicros and SetupMicros split Micros into its phases, where the
	// left anchor saw them: from the request to the segment locked
	// (ackLock, §3.2) and to the new path in use (its handshake done, the
	// two-path phase of §3.5 begun); the rest, Micros - SetupMicros, is the
	// two-path phase, until the old path's last bytes are acknowledged.
	// Zero where the request did not get that far.
	LockMicros  int64 `json:"lock_micros,omitempty"`
	SetupMicros int64 `json:"setup_micros,omitempty"`
	// NF is the network function a host of the new path started for the
	// request (the first one the left anchor waited for), and NFMicros
	// the time the new path's set-up waited for it: from that host's
	// word that it starts the function to the new path's answer (or
	// refusal). Part of SetupMicros when the new path came up.
	NF       string `json:"nf,omitempty"`
	NFMicros int64  `json:"nf_micros,omitempty"`
	// Migration is set for requests with state migration.
	Migration *MigrationReport `json:"migration,omitempty"`
}

// ReconfigReply lists the results, one per matching session this agent can
// be the left anchor of.
type ReconfigReply struct {
	Results []ReconfigResult `json:"results"`
}

// SocketPair names one TCP socket by its two ends.
type SocketPair struct {
	Local  netip.AddrPort `json:"local"`
	Remote netip.AddrPort `json:"remote"`
}

// SpliceRequest comes from libdysco inside a session-terminating proxy
// (paper §2.4, §4.2 "Triggering a reconfiguration using splice"): the proxy
// hands the byte streams of two sockets to each other and wants to leave the
// path. In is the socket data comes from, Out the one it goes to. Delta is
// the number of bytes the proxy added to (positive) or removed from
// (negative) the In → Out stream before splicing; DeltaRev the same for the
// Out → In stream.
type SpliceRequest struct {
	In       SocketPair `json:"in"`
	Out      SocketPair `json:"out"`
	Delta    int64      `json:"delta"`
	DeltaRev int64      `json:"delta_rev"`
	// Wait makes the call return only when the removal is over.
	Wait bool `json:"wait,omitempty"`
}

// SpliceReply tells what became of a splice request.
type SpliceReply struct {
	// Session is the joined session's id at this agent.
	ID uint32 `json:"id"`
	// Result is set when the request waited.
	Result *ReconfigResult `json:"result,omitempty"`
}

// MiddleboxRequest is a middlebox host's request about the sessions passing
// through it (paper §2.3 use cases): with With empty, remove this host from
// every matching session; otherwise replace it by the hops in With. The
// agent asks each session's left neighbour to reconfigure the segment
// around this host, and the reply holds one result per session.
type MiddleboxRequest struct {
	Match     string       `json:"match"` // tcpdump filter on the session tuple; empty matches all
	With      []netip.Addr `json:"with,omitempty"`
	TimeoutMS int          `json:"timeout_ms,omitempty"`
	// Migrate moves this host's state of each session to the (single)
	// replacement in With.
	Migrate *MigrateSpec `json:"migrate,omitempty"`
}

// Operation is an operator's reconfiguration request that the policy server
// relays to one agent (paper §2.3's use cases, run from a central place):
// exactly one of Reconfig (the agent is the left anchor, as `dysco
// reconfig`) and Middlebox (the agent is the middlebox leaving or being
// replaced, as `dysco middlebox`). The server gives it an ID and a state;
// AgentRegistration is an agent that polls the policy servers for its
// policies (GET /v1/agents): registered by each poll, it lapses when the
// agent stops polling (docs/etcd.md, "Agents").
type AgentRegistration struct {
	Host string `json:"host"`
	// Addr is the address the agent's last poll came from.
	Addr string `json:"addr"`
	// Applied is the version of the set the agent held at its last poll
	// (its after=): the convergence signal.
	Applied uint64 `json:"applied"`
	// Seen is the time of its last poll.
	Seen time.Time `json:"seen"`
	// Version is the agent's release and the wire versions it speaks, as
	// its polls say (empty for an agent that does not say).
	Version string `json:"version,omitempty"`
}

// the agent named by Host claims it, carries it out as if asked through its
// local API, and reports the reply. docs/operating.md, "From one place,
// through the policy server".
type Operation struct {
	ID        string            `json:"id,omitempty"`
	Host      string            `json:"host"`
	Reconfig  *ReconfigRequest  `json:"reconfig,omitempty"`
	Middlebox *MiddleboxRequest `json:"middlebox,omitempty"`
	// Query asks the agent for what its local API lists (its sessions,
	// its reconfiguration history), for `dysco sessions --server`.
	Query *QueryRequest `json:"query,omitempty"`
	// State is OpQueued, OpRunning, OpDone or OpFailed (set by the server).
	State string `json:"state,omitempty"`
	// Error is why the operation failed: the agent refused the request
	// (bad filter, reconfiguration disabled), or never claimed it, or
	// claimed it and never reported.
	Error string `json:"error,omitempty"`
	// Reply is the agent's reply when State is OpDone: one result per
	// session, as the local API gives it.
	Reply *ReconfigReply `json:"reply,omitempty"`
	// Sessions is the reply to a sessions query.
	Sessions *SessionsReply `json:"sessions,omitempty"`
	Created  time.Time      `json:"created,omitzero"`
	Claimed  time.Time      `json:"claimed,omitzero"`
	Finished time.Time      `json:"finished,omitzero"`
}

// States of an Operation.
const (
	OpQueued  = "queued"  // waiting for its agent to claim it
	OpRunning = "running" // claimed; the agent is carrying it out
	OpDone    = "done"    // the agent replied (per-session outcomes in Reply)
	OpFailed  = "failed"  // refused by the agent, or lost (Error says which)
)

// IsFinished tells whether the operation has reached its final state.
func (o *Operation) IsFinished() bool { return o.State == OpDone || o.State == OpFailed }

// Match is the request's filter.
func (o *Operation) Match() string {
	switch {
	case o.Reconfig != nil:
		return o.Reconfig.Match
	case o.Middlebox != nil:
		return o.Middlebox.Match
	}
	return ""
}

// TimeoutMS is how long the agent waits for the sessions' results.
func (o *Operation) TimeoutMS() int {
	switch {
	case o.Reconfig != nil:
		return o.Reconfig.TimeoutMS
	case o.Middlebox != nil:
		return o.Middlebox.TimeoutMS
	}
	return 0
}

// Validate checks what the server can check of an operation before it is
// queued; the agent checks the rest (the filter, the addresses against its
// sessions) as for a local request.
func (o *Operation) Validate() error {
	if o.Host == "" {
		return errors.New("operation: no host: name the agent that is to carry it out")
	}
	if len(o.Host) > 253 || strings.IndexFunc(o.Host, func(r rune) bool { return r <= ' ' || r == 0x7f }) >= 0 {
		return fmt.Errorf("operation: host %q is not an agent name", o.Host)
	}
	n := 0
	for _, set := range []bool{o.Reconfig != nil, o.Middlebox != nil, o.Query != nil} {
		if set {
			n++
		}
	}
	if n != 1 {
		return errors.New("operation: give exactly one of reconfig, middlebox and query")
	}
	if q := o.Query; q != nil {
		if q.What != QuerySessions && q.What != QueryHistory {
			return fmt.Errorf("operation: query %q: want %q or %q", q.What, QuerySessions, QueryHistory)
		}
		if q.Limit < 0 || q.Limit > MaxQueryLimit {
			return fmt.Errorf("operation: query limit %d: want 0 (%d) to %d", q.Limit, DefaultQueryLimit, MaxQueryLimit)
		}
	}
	if ms := o.TimeoutMS(); ms < 0 || ms > MaxOperationTimeoutMS {
		return fmt.Errorf("operation: timeout_ms %d: want 0 (the agent's default) to %d (5 minutes, the most an agent waits)", ms, MaxOperationTimeoutMS)
	}
	if match := o.Match(); len(match) > MaxMatchLen {
		return fmt.Errorf("operation: match filter of %d bytes, at most %d", len(match), MaxMatchLen)
	}
	if r := o.Reconfig; r != nil {
		if !r.To.IsValid() {
			return errors.New("operation: reconfig needs a right anchor (to)")
		}
		if len(r.Chain) > MaxChain {
			return fmt.Errorf("operation: reconfig chain of %d hops, at most %d", len(r.Chain), MaxChain)
		}
		if len(r.NFs) != 0 && len(r.NFs) != len(r.Chain) {
			return fmt.Errorf("operation: reconfig with %d network functions for %d hops", len(r.NFs), len(r.Chain))
		}
	}
	if m := o.Middlebox; m != nil && len(m.With) > MaxChain {
		return fmt.Errorf("operation: middlebox with %d hops, at most %d", len(m.With), MaxChain)
	}
	if r := o.Reconfig; r != nil {
		if err := r.Migrate.Validate(); err != nil {
			return fmt.Errorf("operation: %w", err)
		}
	}
	if m := o.Middlebox; m != nil {
		if err := m.Migrate.Validate(); err != nil {
			return fmt.Errorf("operation: %w", err)
		}
	}
	return nil
}

// QueryRequest asks an agent, through the policy server, for what its
// local API lists.
type QueryRequest struct {
	// What is QuerySessions or QueryHistory.
	What string `json:"what"`
	// Limit bounds the sessions or results in the reply (0:
	// DefaultQueryLimit): the newest history results, the first sessions.
	Limit int `json:"limit,omitempty"`
}

// What a QueryRequest may ask for, and its bounds.
const (
	QuerySessions     = "sessions" // the agent's sessions (SessionsReply)
	QueryHistory      = "history"  // its reconfiguration history (ReconfigReply)
	DefaultQueryLimit = 1000
	MaxQueryLimit     = 10000
)

// QueryLimit is q's limit, DefaultQueryLimit when unset.
func (q *QueryRequest) QueryLimit() int {
	if q.Limit <= 0 {
		return DefaultQueryLimit
	}
	return q.Limit
}

// SessionsReply is an agent's answer to a sessions query: at most the
// query's limit of its sessions, and how many it has.
type SessionsReply struct {
	Sessions []Session `json:"sessions"`
	Total    int       `json:"total"`
}

// Bounds of an Operation's request.
const (
	MaxOperationTimeoutMS = 5 * 60 * 1000
	MaxMatchLen           = 8192
)

// OperationResult is what an agent reports for an operation it claimed:
// Error when it refused the request, else Reply. Host is the agent's name:
// the server takes the result only from the agent the operation was for.
type OperationResult struct {
	Host     string         `json:"host"`
	Error    string         `json:"error,omitempty"`
	Reply    *ReconfigReply `json:"reply,omitempty"`
	Sessions *SessionsReply `json:"sessions,omitempty"`
}

// Answers counts what res carries of error, reply and sessions: exactly
// one is valid.
func (res *OperationResult) Answers() int {
	n := 0
	for _, set := range []bool{res.Error != "", res.Reply != nil, res.Sessions != nil} {
		if set {
			n++
		}
	}
	return n
}

// PoliciesUsingType names the policies of policies whose chain names the
// middlebox type typ, sorted.
func PoliciesUsingType(policies []Policy, typ string) []string {
	var names []string
	for _, p := range policies {
		for _, h := range p.Chain {
			if h.Type == typ {
				names = append(names, p.Name)
				break
			}
		}
	}
	sort.Strings(names)
	return names
}

// TypeInUseError refuses the deletion of a middlebox type that policies
// still name: their sessions would lose a middlebox of their chain.
type TypeInUseError struct {
	Type     string
	Policies []string
}

func (e *TypeInUseError) Error() string {
	if len(e.Policies) == 1 {
		return fmt.Sprintf("type %q is used by policy %s: change or remove that policy first", e.Type, e.Policies[0])
	}
	return fmt.Sprintf("type %q is used by policies %s: change or remove those policies first", e.Type, strings.Join(e.Policies, ", "))
}
