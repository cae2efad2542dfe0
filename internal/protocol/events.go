package protocol

import (
	"fmt"
	"net/netip"
	"time"

	"github.com/dysco/dysco/internal/wire"
)

// Event is an input of the Agent.
type Event interface{ event() }

// SideInfo describes one side of a session at an agent.
type SideInfo struct {
	Peer netip.Addr // the agent at the other end of the subsession
	Sub  wire.Tuple // the subsession, written as its SYN went (left to right)
	// Delta is what this agent adds to sequence numbers (and timestamps) of
	// packets arriving on this side, and subtracts from the acks (and echoed
	// timestamps) it sends on it: non-zero after this agent was an anchor
	// (§3.4, Figure 6).
	Delta Delta
	// SendWScale is the window scale this host's side of the TCP session
	// announced on this side; PeerWScale the one it received (§4.2).
	SendWScale, PeerWScale uint8
	// Nonce is the nonce of the session this side's subsession belongs
	// to; zero means the session's (SessionUp.Nonce). The two sides of a
	// proxy's joined sessions have different ones (§2.4).
	Nonce [wire.NonceLen]byte
	// Resume, when set, is a reconfiguration of this side that an earlier
	// run of the agent left unfinished: the agent restarted while it was
	// an anchor of it. Sub, Peer and Nonce are then the old subsession's.
	Resume *Resume
}

// Resume describes an unfinished reconfiguration of a side that the
// datapath kept across an agent restart (its two-path record and the
// request behind it; the protocol's memory is gone). The side's anchor
// goes on where the datapath is:
//   - Switched (the datapath is in its two-path phase): the anchor resumes
//     its two-path phase (§3.5). Its UDP FIN and FIN-ACK exchange with the
//     other anchor is idempotent, and a completed other anchor's tomb
//     answers it, so the teardown completes as usual.
//   - Not switched, at the right anchor (the new path is armed): it waits
//     for the ACK or the first packet on the new path, as before.
//   - Not switched, at the left anchor (the new path was being set up):
//     it abandons the new path and cancels the request (§3.6); the session
//     stays on the old path and every lock is released.
type Resume struct {
	Req         ReqKey
	RightAnchor netip.Addr
	NewSub      wire.Tuple // written as its SYN went
	NewPeer     netip.Addr
	NewNonce    [wire.NonceLen]byte
	NewDelta    Delta
	Switched    bool
}

// SessionUp announces an established session (its chain is set up, §2.1).
// Left is nil at the chain's first agent, Right at its last.
type SessionUp struct {
	Session SessionID
	Tuple   wire.Tuple
	// Proto is the session's transport (zero: TCP). A UDP session's
	// two-path phase has no cut-off: each anchor sends every datagram on
	// the new path from its switch and ends its side once its old path
	// has been quiet for Config.UDPDrain (udp.go, docs/protocol.md "UDP
	// sessions").
	Proto Proto
	Nonce [wire.NonceLen]byte
	Left  *SideInfo
	Right *SideInfo
	App   AppDelta
	// Lock, when set, is the request whose lock this agent held as a
	// middle agent of its old path when it restarted (KeepLock): the
	// session is locked for it again, so that the anchors' FINs pass and
	// the old path is torn down as usual (§3.5).
	Lock ReqKey
}

// SetAppDelta changes what the middlebox application does to the byte
// streams of a session (§3.4): known through an API, libdysco's splice, or
// reconstructed. Nothing in the agent sends it today (libdysco's delta
// comes with SessionUp). It must not come while a reconfiguration has the
// session's lock pending or held: requestLock gathers the middle agent's
// contribution to leftDelta when it passes (forwardRequest) and the ackLock
// adds it again when it comes back, and a granting synAck carries the
// first while the ackLock carries the second.
type SetAppDelta struct {
	Session SessionID
	App     AppDelta
}

// MessageIn is a control message received from the network (UDP payload).
type MessageIn struct {
	From netip.Addr
	Data []byte
	// OnPath (a new path's SYN that would make this agent join it): the
	// session's tuple is live in this host's datapath already, on a path
	// that is not being torn down. The datapath holds one state per
	// session tuple, so this host cannot be on the old and the new path
	// at once (nor twice on one path): the agent refuses the new path
	// (a synAck with FlagRefuse, ReasonOnPath) instead of joining it.
	OnPath bool
	// Gone: the subsession the message names belongs to no session of
	// this host's datapath (the session ended here, and its state was
	// collected). A requestLock is then refused at once (nackLock,
	// ReasonSessionEnded), so that its left anchor does not wait for
	// every retransmission before it gives up.
	Gone bool
}

// Reconfigure is an operator's request that this agent, as left anchor,
// replace the segment between itself and RightAnchor by a
// new path through Chain (§3.1): empty Chain deletes every middlebox in
// between; Chain must not name this agent or the right anchor. Token is
// echoed in the Result.
type Reconfigure struct {
	Session     SessionID
	RightAnchor netip.Addr
	Chain       []netip.Addr
	// Source, if valid, is the local address the new path leaves from:
	// the session moves to another of this host's addresses or
	// interfaces (make before break; Serval §4.4, M2M §4.2.1). Zero: the
	// address the host's route to the new path's first hop chooses. The
	// shell checks that it is this host's.
	Source netip.Addr
	// NFs, if set, has one entry per hop of Chain: the network function
	// that hop must run (its agent starts it before it joins the new
	// path; heterogeneous-sfc-quic §IV), "" for none.
	NFs   []string
	Token uint64
	// Gate holds the switch to the new path: once the new path answered
	// (SYN-ACK), the left anchor emits NewPathReady and waits for Proceed
	// before it sends the ACK and starts the two-path phase.
	Gate bool
	// Migrate, if set, moves the replaced middlebox's state before the
	// switch (§3.5 last paragraph, §5.3; migrate.go): the request is
	// gated, and the left anchor orchestrates the migration's steps
	// after NewPathReady, then reports MigrationDone and waits for
	// Proceed.
	Migrate *MigrateSpec
}

// Proceed ends the wait of a gated request (Reconfigure.Gate) at its left
// anchor: with Abort empty the switch happens; otherwise the new path is
// abandoned as when it does not answer (§3.6), the session stays on the old
// path, and the request fails with ReasonAborted.
type Proceed struct {
	Session SessionID
	Req     ReqKey
	Abort   string
	// Report is what the agent did at the gate (a state migration's
	// report), opaque to the protocol: the answer to the trigger that
	// started the request, if one did, carries it (TriggerAnswer.Report,
	// at most MaxReportLen bytes; a longer one is left out).
	Report []byte
}

// Trigger asks the left neighbour of a session (the agent at the other end
// of its left side) to reconfigure the segment from itself to RightAnchor
// through Chain, as its left anchor (§2.3: a middlebox can ask to be
// removed; §4.2: a proxy removes itself). The agent sends a trigger
// message, retransmits it as any message, and reports the answer, or that
// none came, with TriggerResult (trigger.go). Migrate, if set, asks the
// left neighbour to move the replaced middlebox's state (its request is
// gated, Reconfigure.Gate). Token is echoed in the TriggerResult.
type Trigger struct {
	Session     SessionID
	Token       uint64
	RightAnchor netip.Addr
	Chain       []netip.Addr
	Migrate     *MigrateSpec
}

// JoinFailed reports that the agent could not carry out a JoinSession
// (its datapath refused the session: full maps, or the session's tuple
// became live here meanwhile). The protocol refuses the new path (a synAck
// with FlagRefuse, ReasonSetupFailed, to the left), frees the middleboxes
// it passed the SYN to (cancelLock on the new path) and forgets the
// session.
type JoinFailed struct {
	Session SessionID
}

// FinsSeen reports the TCP FINs this agent's datapath has seen for a
// session (Fwd: in the SYN's direction, Rev: the other), when a side of it
// has just completed a reconfiguration (EndTwoPath). A FIN sent before the
// cut-off travels the old path only, so the middleboxes that joined the
// new path never see it and would keep the session until their idle
// timeout: the protocol tells them (a closed notice on the new path).
type FinsSeen struct {
	Session  SessionID
	Fwd, Rev bool
}

// TimerFired reports that a timer set by SetTimer expired.
type TimerFired struct{ ID TimerID }

// TwoPathProgress reports the datapath's two-path variables of an anchor's
// side after they changed, or after the datapath started the two-path phase
// by itself (an armed new subsession received its first packet). For a
// UDP session only Vars.OldDgrams counts (udp.go): the agent reports it
// when it changes, and at the latest right before it hands over the side's
// TimerQuiet, so that the protocol never takes a side for quiet that
// received a datagram on its old path within the drain time.
type TwoPathProgress struct {
	Session SessionID
	Side    Side
	Vars    TwoPath
}

// SessionEnd reports that the TCP session ended at this agent (RST, FIN in
// both directions, idle): all its protocol state goes, locks included.
type SessionEnd struct {
	Session SessionID
	Cause   string
	// Replaced: the datapath's state of the session at this host gave way
	// to a new path of the same session through it (JoinSession). A
	// middle agent of an old path that both anchors' fins have passed
	// (OnLivePath false) does not end then: it goes on passing the old
	// path's fins and finAcks, which travel between the agents, not in the
	// datapath, until its linger ends (§3.5). Without it an anchor whose
	// finAck was lost would send its fin again into a host that no longer
	// knows the old subsession, and complete unconfirmed.
	Replaced bool
}

// Held answers Hold: the datapath holds the side's old-path packets, and
// Marks are what the side had sent on the old path then; or Err says why
// it cannot.
type Held struct {
	Session SessionID
	Side    Side
	Req     ReqKey
	Marks   FlowMarks
	Err     string
}

// Drained answers WaitDrained: OK, the side's old path drained as the
// semantics asks; not OK, Within passed first.
type Drained struct {
	Session SessionID
	Side    Side
	Req     ReqKey
	OK      bool
}

// StateExported answers ExportState: the plug-ins' state (opaque), or Err.
type StateExported struct {
	Session SessionID
	Req     ReqKey
	Blob    []byte
	Err     string
}

// NFStarted answers StartNF: Err is empty when the network function is
// ready, and says why not otherwise (unknown here, failed to start, not
// ready in time); the new path is then refused (ReasonNF).
type NFStarted struct {
	Req  ReqKey
	Name string
	Err  string
}

// StateImported answers ImportState (Tuple is the action's).
type StateImported struct {
	Session SessionID
	Req     ReqKey
	Tuple   wire.Tuple
	Err     string
}

// HoldOverflow reports that a side's hold (Hold) reached its limit: the
// migration fails (at the right anchor: it tells the left one).
type HoldOverflow struct {
	Session SessionID
	Side    Side
}

// DatapathReady reports that the datapath has seen packets in both
// directions of a session the protocol created (JoinSession), so its marks
// are known: until then the session cannot be an anchor (it refuses with
// ReasonBusy).
type DatapathReady struct{ Session SessionID }

func (DatapathReady) event()   {}
func (SessionUp) event()       {}
func (SetAppDelta) event()     {}
func (MessageIn) event()       {}
func (Reconfigure) event()     {}
func (TimerFired) event()      {}
func (TwoPathProgress) event() {}
func (SessionEnd) event()      {}
func (Proceed) event()         {}
func (JoinFailed) event()      {}
func (FinsSeen) event()        {}
func (Trigger) event()         {}
func (Held) event()            {}
func (Drained) event()         {}
func (StateExported) event()   {}
func (StateImported) event()   {}
func (NFStarted) event()       {}
func (HoldOverflow) event()    {}

// TimerKind says what a timer is for.
type TimerKind uint8

// Timers.
const (
	TimerRequest    TimerKind = iota + 1 // retransmit requestLock (left anchor)
	TimerSyn                             // retransmit the new path's SYN (left anchor)
	TimerCancel                          // retransmit cancelLock (left anchor)
	TimerFin                             // retransmit the UDP FIN (either anchor)
	TimerLease                           // release a lock nobody resolves (middle agents, right anchor before switching)
	TimerLinger                          // free the old path's state after teardown
	TimerGate                            // abort a gated request the agent never let proceed (left anchor)
	TimerOldFin                          // retransmit the UDP FIN on the old path only, answered on the direct new path (anchor or tomb)
	TimerTrigger                         // retransmit a trigger (its sender); Req is the trigger's key
	TimerMigrate                         // a state migration's bound (left anchor), a right anchor's hold's lease
	TimerMigrateMsg                      // retransmit a state migration's step
	TimerQuiet                           // a UDP anchor's old path may have been quiet for the drain time (udp.go)
	TimerRebind                          // retransmit a rebind (the agent that moves, rebind.go)
	TimerRebound                         // forget a subsession a rebind replaced (its neighbour, after Linger)
)

func (k TimerKind) String() string {
	switch k {
	case TimerRequest:
		return "request"
	case TimerSyn:
		return "syn"
	case TimerCancel:
		return "cancel"
	case TimerFin:
		return "fin"
	case TimerLease:
		return "lease"
	case TimerLinger:
		return "linger"
	case TimerGate:
		return "gate"
	case TimerOldFin:
		return "old-fin"
	case TimerTrigger:
		return "trigger"
	case TimerMigrate:
		return "migrate"
	case TimerMigrateMsg:
		return "migrate-msg"
	case TimerQuiet:
		return "quiet"
	case TimerRebind:
		return "rebind"
	case TimerRebound:
		return "rebound"
	}
	return fmt.Sprintf("timer-%d", uint8(k))
}

// TimerID names a timer; setting a timer with the ID of a running one
// moves it.
type TimerID struct {
	Session SessionID
	Kind    TimerKind
	Req     ReqKey
}

func (t TimerID) String() string { return fmt.Sprintf("%s/%d/%s", t.Kind, t.Session, t.Req) }

// Action is an output of the Agent, for the caller to carry out in order.
type Action interface{ action() }

// Send sends a control message (UDP) to an agent. Msg is the decoded form,
// for logs and traces; Data is what goes on the wire.
type Send struct {
	To netip.Addr
	// From is the local address the datagram must leave from: the MAC
	// covers it (Message.Encode).
	From netip.Addr
	Msg  *Message
	Data []byte
}

// SetTimer asks for a TimerFired event at time At.
type SetTimer struct {
	ID TimerID
	At time.Duration
}

// CancelTimer cancels a timer; a TimerFired for it after this is ignored.
type CancelTimer struct{ ID TimerID }

// AddSubsession installs the flows of a new-path subsession on one side of
// an anchor: packets arriving on Sub are translated to the session (seq +=
// Delta.Seq, TSval += Delta.TS, window rescaled from WScaleIn to
// WScaleOut), and packets sent on it get ack -= Delta.Seq (and SACK edges),
// TSecr -= Delta.TS. The side keeps sending on its current subsession until
// StartTwoPath; if Armed, the datapath starts the two-path phase by itself
// when the first packet arrives on Sub, and reports TwoPathProgress.
type AddSubsession struct {
	Session             SessionID
	Side                Side
	Sub                 wire.Tuple
	Peer                netip.Addr
	Delta               Delta
	WScaleIn, WScaleOut uint8
	Armed               bool
	// Nonce is the one control messages about the new subsession carry
	// (the left anchor's): the side's nonce once it switches.
	Nonce [wire.NonceLen]byte
	// Req, RightAnchor and OldNonce (the nonce of the side's current
	// subsession) are for the agent to keep beside the datapath's record,
	// so that it can resume the reconfiguration if it restarts
	// (SideInfo.Resume).
	Req         ReqKey
	RightAnchor netip.Addr
	OldNonce    [wire.NonceLen]byte
}

// JoinSession creates a session at a middlebox on a new path (§3.1, the
// SYN carries the address list so that it joins): flows between Left.Sub,
// the session tuple and Right.Sub, no deltas.
type JoinSession struct {
	Session     SessionID
	Tuple       wire.Tuple
	Proto       Proto // the session's transport, from the SYN
	Nonce       [wire.NonceLen]byte
	Left, Right SideInfo
	Req         ReqKey // the request whose new path it is
	// NF is the network function the request named for this host, which
	// StartNF made ready (the session uses it until it is freed); "" for
	// none.
	NF string
}

// StartNF asks the agent to start the network function Name, which the
// new path of Req names for this host (heterogeneous-sfc-quic §IV: "The
// need for a specific VNF can be included in the control packet"), and
// to answer with NFStarted once it is ready or cannot be. The SYN waits
// meanwhile: the host joins the new path and passes the SYN on only once
// the function is ready, and answers the SYN's retransmissions with a
// synAck saying that it is starting (the session stays on its old path).
type StartNF struct {
	Req     ReqKey
	Name    string
	Session wire.Tuple
}

// StartTwoPath starts the two-path phase on a side (§3.5): the datapath
// takes the cut-off from its marks (CutOff), sends every outgoing packet as
// Decide says, updates the variables with Observe for incoming ones, and
// reports TwoPathProgress when they change. A no-op if already started.
type StartTwoPath struct {
	Session  SessionID
	Side     Side
	Old, New wire.Tuple
}

// EndTwoPath ends the two-path phase: everything goes on the new
// subsession, which becomes the side's only one for sending; the old one
// still accepts late packets until RemoveSubsession.
type EndTwoPath struct {
	Session SessionID
	Side    Side
	New     wire.Tuple
}

// RemoveSubsession deletes the flows of a subsession.
type RemoveSubsession struct {
	Session SessionID
	Side    Side
	Sub     wire.Tuple
}

// SetWindowClamp limits the receive window advertised on a side to Bytes
// (after scaling): min(window, 64 KB) during reconfiguration (§5.3); 0
// removes the limit.
type SetWindowClamp struct {
	Session SessionID
	Side    Side
	Bytes   uint32
}

// NewPathReady tells the agent that the new path of a gated request
// (Reconfigure.Gate) is set up to the right anchor and nothing uses it
// yet; the left anchor waits for Proceed. OldPeer is the agent after this
// one on the old path, NewPeer the first on the new path; OldSub and NewSub
// are the two subsessions from here (as their SYNs went).
type NewPathReady struct {
	Session          SessionID
	Token            uint64
	Req              ReqKey
	RightAnchor      netip.Addr
	Chain            []netip.Addr
	OldPeer, NewPeer netip.Addr
	OldSub, NewSub   wire.Tuple
	// LeftDelta is what the old segment's middleboxes do to the byte
	// streams (§3.4): non-zero when one of them changed their length.
	LeftDelta Delta
}

// Hold asks the datapath to hold the packets a side of an anchor sends on
// its old path (a state migration's freeze): order holds every packet,
// substream those carrying new data; Limit bounds the bytes held (then
// HoldOverflow). The agent answers with Held, and lets the packets go on
// ReleaseHold: onto the path the side uses then.
type Hold struct {
	Session   SessionID
	Side      Side
	Req       ReqKey
	Semantics MigrateSemantics
	Limit     uint64
}

// ReleaseHold ends a Hold: the held packets are sent again, in order, on
// the path the side uses now (the new one after the switch, the old one
// after an abort).
type ReleaseHold struct {
	Session SessionID
	Side    Side
	Req     ReqKey
}

// WaitDrained asks the agent to watch a side's flow marks until its old
// path drained as the semantics says, or Within passes; it answers
// Drained. Substream: everything the side sent (Own) is acknowledged;
// order: everything the other anchor sent before its freeze (Peer)
// arrived.
type WaitDrained struct {
	Session   SessionID
	Side      Side
	Req       ReqKey
	Semantics MigrateSemantics
	Own, Peer FlowMarks
	Within    time.Duration
}

// ExportState asks the old middlebox's agent for the session's state (its
// plug-ins); it answers StateExported. The state stays here until
// ReleaseState.
type ExportState struct {
	Session     SessionID
	Req         ReqKey
	Tuple       wire.Tuple
	RightAnchor netip.Addr
}

// ImportState asks the new middlebox's agent to install the session's
// state before any packet of the session reaches it; it answers
// StateImported.
type ImportState struct {
	Session SessionID
	Req     ReqKey
	Tuple   wire.Tuple
	Blob    []byte
}

// ReleaseState lets go of the state this host exported or imported for a
// session: the path through it was freed (the old path after the move,
// a new path abandoned), or the session ended.
type ReleaseState struct {
	Session SessionID
	Tuple   wire.Tuple
}

// MigrationDone reports the end of a migration's steps at its left
// anchor: Err empty, the state moved and the request may switch; else
// why not. Drain, Export and Import are the phases' durations; State is
// the blob moved; Note what did not fail but the agent should report. The
// agent answers with Proceed (with Abort = Err when Err is set, and its
// report).
type MigrationDone struct {
	Session               SessionID
	Token                 uint64
	Req                   ReqKey
	Err, Note             string
	State                 []byte
	Drain, Export, Import time.Duration
}

// KeepLock asks the agent to keep, beside the datapath's session, the
// request that a middle agent of the old path is locked for (§3.2): an
// agent that restarts in the request's two-path phase then still passes
// the anchors' FINs (SessionUp.Lock). A zero Req: the lock is released.
type KeepLock struct {
	Session SessionID
	Req     ReqKey
}

// FreeSession deletes a session and all its flows at this agent: it left
// the path (a middlebox of a torn-down old path, §3.5).
type FreeSession struct{ Session SessionID }

// MarkClosed records in a joined session's datapath state the FINs that
// the old path carried and this agent did not see (FinsSeen at an anchor,
// passed on by a closed notice): its collector then ends the session as
// any host that saw them does.
type MarkClosed struct {
	Session  SessionID
	Fwd, Rev bool
}

// JoinedWScale records in a joined session's datapath state the window
// scale of the windows that travel leftwards (towards the session's
// client), which the new path's synAck brought; the SYN brought the other
// (JoinSession: Right.SendWScale).
type JoinedWScale struct {
	Session SessionID
	Rev     uint8
}

// Result reports the end of a reconfiguration request at its left anchor.
type Result struct {
	Session SessionID
	Token   uint64
	Req     ReqKey
	Outcome Outcome
	Reason  Reason
	// Blocker is the request that held the lock (contention refusals).
	Blocker ReqKey
	// Unconfirmed: the old path was torn down without a FIN-ACK from the
	// other anchor after every retransmission.
	Unconfirmed bool
	// Resumed: the request was begun by an earlier run of the agent, which
	// restarted in its middle (SideInfo.Resume).
	Resumed bool
	// Unchanged (Succeeded): the new chain is the segment's current one;
	// nothing was changed (the locks were taken and released).
	Unchanged bool
	// Hop (ReasonOnPath) is the hop of the new chain already on the
	// session's path, when the left anchor knows it.
	Hop netip.Addr
	// NF (ReasonNF) is the network function Hop could not start, and
	// Detail its agent's reason.
	NF, Detail string
	// Trigger, when set, is the trigger that asked for the request (its
	// sender and number): the agent did not ask for it itself, and Token
	// is the one TriggerAccepted gave. The sender gets the result in the
	// answer to its trigger.
	Trigger ReqKey
}

// TriggerAccepted reports that this agent, as a session's left neighbour,
// took a trigger and starts a request for it (§2.3): its Result will come
// with Token and Trigger. Migrate is the trigger's state migration spec:
// the request is gated, and the agent must be ready for its NewPathReady
// (the same Token) when it comes. It comes before any other action of the
// request.
type TriggerAccepted struct {
	Session SessionID
	Token   uint64
	Trigger ReqKey
	Migrate *MigrateSpec
}

// TriggerResult reports the end of a trigger this agent sent (Trigger):
// the left neighbour's answer (Answered), or a refusal before it was sent
// (a session with no left side, an invalid chain: Answered false), or
// ReasonNoAnswer when no answer came after every retransmission. Req is
// the request the trigger started at the left neighbour (zero: none, the
// trigger was refused before); the other fields are its Result's, and
// Micros is the time the left neighbour took. Report is the left
// neighbour's report (Proceed.Report), if any.
type TriggerResult struct {
	Session  SessionID
	Token    uint64
	Trigger  ReqKey
	To       netip.Addr
	Answered bool
	Req      ReqKey
	Outcome  Outcome
	Reason   Reason
	Blocker  ReqKey
	Hop      netip.Addr
	// Unchanged, Unconfirmed and Resumed as in Result.
	Unchanged, Unconfirmed, Resumed bool
	Micros                          int64
	Report                          []byte
}

// Rejected reports a control message this agent refused, for counters.
type Rejected struct {
	Reason RejectReason
	Type   MsgType
	From   netip.Addr
	Detail string
}

// Progress reports a change of stage of a reconfiguration at this agent,
// for logs, traces and the model.
type Progress struct {
	Session SessionID
	Req     ReqKey
	Role    Role
	Stage   Stage
	Note    string
	// NF (left anchor, settingUp): a host of the new path starts this
	// network function, the new path waits for it; NFDone: the wait
	// is over (the new path answered, or was refused).
	NF     string
	NFDone bool
}

func (Send) action()             {}
func (SetTimer) action()         {}
func (CancelTimer) action()      {}
func (AddSubsession) action()    {}
func (JoinSession) action()      {}
func (StartNF) action()          {}
func (StartTwoPath) action()     {}
func (EndTwoPath) action()       {}
func (RemoveSubsession) action() {}
func (SetWindowClamp) action()   {}
func (FreeSession) action()      {}
func (MarkClosed) action()       {}
func (JoinedWScale) action()     {}
func (KeepLock) action()         {}
func (NewPathReady) action()     {}
func (Result) action()           {}
func (TriggerAccepted) action()  {}
func (TriggerResult) action()    {}
func (Rejected) action()         {}
func (Hold) action()             {}
func (ReleaseHold) action()      {}
func (WaitDrained) action()      {}
func (ExportState) action()      {}
func (ImportState) action()      {}
func (ReleaseState) action()     {}
func (MigrationDone) action()    {}
func (Progress) action()         {}
