package api

import (
	"net/netip"
	"time"
)

// AgentSocket is the abstract Unix socket the agent serves its local API on.
// Abstract sockets belong to a network namespace, so `ip netns exec NAME
// dysco ...` reaches the agent of that namespace with no path to configure.
const AgentSocket = "@dysco-agent"

// Error is the body of every non-2xx answer of the local API and the policy server.
type Error struct {
	Error string `json:"error"`
}

// Status describes an agent.
type Status struct {
	Name    string    `json:"name"`
	Version string    `json:"version"`
	Started time.Time `json:"started"`
	PinDir  string    `json:"pin_dir"`
	Attach  string    `json:"attach"` // "tcx" or "clsact"
	Ifaces  []string  `json:"ifaces"`
	// Addrs are the addresses other agents and reconfiguration requests
	// name this host by (--chain, --to), one per family it has.
	Addrs []string `json:"addrs,omitempty"`
	// Locators maps each session address of the host (--session-addr) to
	// its current locator, the address its sessions' first subsessions
	// leave from (docs/mobility.md).
	Locators map[string]string `json:"locators,omitempty"`
	Tap      string            `json:"tap,omitempty"`
	// TapActive tells whether a capture listens on the tap: the datapath
	// copies packets there only then.
	TapActive bool `json:"tap_active,omitempty"`
	Sessions  int  `json:"sessions"`
	// PolicyVersion is the version of the policy set in force (0: local only).
	PolicyVersion uint64 `json:"policy_version"`
	// PolicyServer is the server URL, empty when none is configured.
	PolicyServer string `json:"policy_server,omitempty"`
	// PolicyServerOK tells whether the last contact with the server worked.
	PolicyServerOK bool `json:"policy_server_ok"`
	// Counters holds the datapath counters by name (drops by reason, set-ups, ...).
	Counters map[string]uint64 `json:"counters"`
	// ControlKeys are the ids of the deployment secrets of the control
	// key file in use, the signing one first (none: reconfiguration is
	// disabled).
	ControlKeys []string `json:"control_keys,omitempty"`
	// Admission says which Dysco SYNs the agent admits: with a valid MAC,
	// from trusted prefixes, both, or none.
	Admission string `json:"admission,omitempty"`
	// Forwarding is whether the host forwards IP, per family; nil from an
	// agent that does not tell.
	Forwarding *Forwarding `json:"forwarding,omitempty"`
	// NFs are the network functions the agent starts on demand (its --nf),
	// sorted by name.
	NFs []NFStatus `json:"nfs,omitempty"`
}

// NFStatus is the state of one network function an agent starts on demand
// (docs/operating.md, "Network functions on demand").
type NFStatus struct {
	Name string `json:"name"`
	// State is stopped, starting, ready, stopping or failed (its last
	// start failed; it is started again on the next demand).
	State string `json:"state"`
	// PID is its process group's leader, while it runs; StartedAt when
	// that process started.
	PID       int       `json:"pid,omitempty"`
	StartedAt time.Time `json:"started_at,omitzero"`
	// Sessions is the number of sessions joined at this host for it.
	Sessions int `json:"sessions"`
	// Starts counts the processes started, Exits those that exited by
	// themselves, Failures the starts that failed.
	Starts   uint64 `json:"starts"`
	Exits    uint64 `json:"exits"`
	Failures uint64 `json:"failures"`
	// LastError is why the last start failed, or how the process last
	// exited by itself.
	LastError string `json:"last_error,omitempty"`
}

// Forwarding says whether a host forwards IP, per family. A host that passes
// chained sessions on (a middlebox host) must: its datapath refuses the SYNs
// of a family it does not forward (counter drop_no_forward).
type Forwarding struct {
	IPv4 bool `json:"ipv4"`
	IPv6 bool `json:"ipv6"`
	// Off names the forwarding sysctls at 0: a family's
	// (net.ipv4.ip_forward, net.ipv6.conf.all.forwarding) or, where that
	// is on, an interface's (net.ipv4.conf.IFACE.forwarding, …).
	Off []string `json:"off,omitempty"`
}

// Session is one session known to an agent, as `dysco sessions` shows it.
type Session struct {
	ID      uint32 `json:"id"`
	Session string `json:"session"` // session tuple "a:p -> b:q"
	Proto   string `json:"proto"`   // "tcp" or "udp"
	// Left and Right are the subsessions on each side of this host, empty
	// where this host is an end of the chain.
	Left        string   `json:"left,omitempty"`
	Right       string   `json:"right,omitempty"`
	Chain       []string `json:"chain,omitempty"` // remaining hops seen at set-up
	Role        string   `json:"role"`            // "start", "middle", "end"
	State       string   `json:"state"`           // "syn", "established", "fin", "closed", "reset"
	Policy      string   `json:"policy,omitempty"`
	PacketsFwd  uint64   `json:"packets_fwd"`
	BytesFwd    uint64   `json:"bytes_fwd"`
	PacketsRev  uint64   `json:"packets_rev"`
	BytesRev    uint64   `json:"bytes_rev"`
	AgeSeconds  float64  `json:"age_seconds"`
	IdleSeconds float64  `json:"idle_seconds"`
	// Reconfiguration state (§3.2), when the reconfiguration protocol
	// knows the session: the lock of its right side ("unlocked",
	// "lockPending", "locked"), requests queued behind it, and the stage
	// of a reconfiguration this host anchors ("leftAnchor:twoPath", ...).
	Lock     string `json:"lock,omitempty"`
	Queued   int    `json:"queued,omitempty"`
	Reconfig string `json:"reconfig,omitempty"`
	// TwoPath is the datapath's record of each side in a two-path phase
	// (§3.5), what an anchor's completion waits for.
	TwoPath []TwoPathSide `json:"two_path,omitempty"`
}

// TwoPathSide is one side of a session in its two-path phase (§3.5), in
// session sequence space: OldSent is the cut-off; the side is done sending
// when OldSentAcked reaches it, and done receiving when OldRcvdAcked =
// OldRcvd and the other anchor's cut-off (or the first byte on the new
// path) is below OldRcvd.
type TwoPathSide struct {
	Side         string `json:"side"`  // "left" or "right"
	State        string `json:"state"` // "idle", "armed", "starting", "active"
	OldSent      uint32 `json:"old_sent"`
	OldRcvd      uint32 `json:"old_rcvd"`
	OldSentAcked uint32 `json:"old_sent_acked"`
	OldRcvdAcked uint32 `json:"old_rcvd_acked"`
	FirstNewRcvd uint32 `json:"first_new_rcvd,omitempty"`
	NewRcvd      bool   `json:"new_rcvd"`
	ToOld        uint64 `json:"to_old"` // packets sent on the old path in the phase
	ToNew        uint64 `json:"to_new"`
}

// PrependRequest asks a middlebox host's agent to put hops at the head of the
// untraversed part of a session's address list (paper §2.2), while the
// session's SYN is inside the host.
type PrependRequest struct {
	// Session is the session tuple as it entered the host, "SRC:PORT -> DST:PORT".
	Session string       `json:"session"`
	Hops    []netip.Addr `json:"hops"`
}

// PrependReply is the session's address list after the change.
type PrependReply struct {
	ID    uint32   `json:"id"`
	Chain []string `json:"chain"`
}
