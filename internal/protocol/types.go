package protocol

import (
	"fmt"
	"net/netip"
)

// SessionID names a session in one agent. The agent chooses the ids of the
// sessions it announces with SessionUp; ids of sessions the protocol creates
// itself (a middlebox joining a new path, §3.1) have the high bit set.
type SessionID uint64

// joinedIDBit marks session ids allocated by the protocol.
const joinedIDBit SessionID = 1 << 63

// TriggerTokens6 is a TriggerTokens for the IPv6 half of an agent whose
// IPv4 half uses the default: the two number the tokens of triggered
// requests apart (2^62 each).
const TriggerTokens6 = 1<<63 | 1<<62

// JoinedBase6 is a JoinedBase for the IPv6 half of an agent whose IPv4
// half uses the default: the two number joined sessions apart (2^62 ids
// each).
const JoinedBase6 = joinedIDBit | 1<<62

// Side is one of the two sides of a session at an agent: the subsession to
// its left (towards the session's initiator) or to its right.
type Side uint8

// The two sides of a session at an agent.
const (
	SideLeft Side = iota
	SideRight
)

// Other returns the opposite side.
func (s Side) Other() Side { return 1 - s }

func (s Side) String() string {
	if s == SideLeft {
		return "left"
	}
	return "right"
}

// Path tells which of an anchor's two paths a packet uses in the two-path
// phase of a reconfiguration (§3.5).
type Path uint8

// The two paths of an anchor during reconfiguration.
const (
	PathOld Path = 1
	PathNew Path = 2
)

func (p Path) String() string {
	switch p {
	case PathOld:
		return "old"
	case PathNew:
		return "new"
	}
	return fmt.Sprintf("path-%d", uint8(p))
}

// LockState is the state of the subsession to an agent's right, kept by
// that agent (§3.2).
type LockState uint8

// Lock states, named as in the paper and the Promela model.
const (
	Unlocked LockState = iota
	LockPending
	Locked
)

// LockStates lists every lock state, for comparison with the model.
var LockStates = []LockState{Unlocked, LockPending, Locked}

func (s LockState) String() string {
	switch s {
	case Unlocked:
		return "unlocked"
	case LockPending:
		return "lockPending"
	case Locked:
		return "locked"
	}
	return fmt.Sprintf("lockState-%d", uint8(s))
}

// ReqKey identifies one reconfiguration request: the left anchor that
// initiated it and a number that anchor never reuses (it only grows).
type ReqKey struct {
	LeftAnchor netip.Addr
	ID         uint32
}

// IsZero reports whether k names no request.
func (k ReqKey) IsZero() bool { return !k.LeftAnchor.IsValid() && k.ID == 0 }

func (k ReqKey) String() string {
	if k.IsZero() {
		return "-"
	}
	return fmt.Sprintf("%s#%d", k.LeftAnchor, k.ID)
}

// Delta is a sequence-space translation for one direction of a byte
// stream (§3.4): Seq is added to sequence numbers (and subtracted from the
// acknowledgments and SACK edges that refer to them), TS likewise to
// timestamps (§4.2). Arithmetic is modulo 2^32, so a negative delta is its
// two's complement.
type Delta struct {
	Seq uint32
	TS  uint32
}

// Add returns the composition of two deltas.
func (d Delta) Add(e Delta) Delta { return Delta{Seq: d.Seq + e.Seq, TS: d.TS + e.TS} }

// IsZero reports whether d changes nothing.
func (d Delta) IsZero() bool { return d == Delta{} }

func (d Delta) String() string { return fmt.Sprintf("seq%+d/ts%+d", int32(d.Seq), int32(d.TS)) }

// AppDelta is what a middlebox application does to the two byte streams
// passing through it (§3.4): Right for the stream flowing left to right,
// Left for the stream flowing right to left. Bytes leave the middlebox with
// sequence number = arrival sequence number + delta. It is an input of the
// agent (an API, libdysco, or reconstructed), assumed not to change once the
// middlebox is ready to be deleted.
type AppDelta struct {
	Right Delta
	Left  Delta
}

// Role is an agent's part in one reconfiguration.
type Role uint8

// Roles in a reconfiguration (§2.3, Figure 3).
const (
	RoleLeftAnchor Role = iota + 1
	RoleRightAnchor
	RoleMiddle   // on the old path between the anchors
	RoleNewHop   // a middlebox joining on the new path
	RoleObserver // none of the above
)

func (r Role) String() string {
	switch r {
	case RoleLeftAnchor:
		return "leftAnchor"
	case RoleRightAnchor:
		return "rightAnchor"
	case RoleMiddle:
		return "middle"
	case RoleNewHop:
		return "newHop"
	}
	return "observer"
}

// Stage is the progress of a reconfiguration at one of its anchors.
type Stage uint8

// Anchor stages. The left anchor goes Locking → SettingUp → TwoPath → Done,
// or to Cancelling when the new path cannot be set up (§3.6); the right
// anchor goes WaitSyn → WaitAck → TwoPath → Done.
const (
	StageLocking    Stage = iota + 1 // requestLock sent, waiting for ackLock/nackLock
	StageSettingUp                   // locked; UDP SYN sent on the new path
	StageWaitSyn                     // right anchor: ackLock sent, waiting for the SYN
	StageWaitAck                     // right anchor: SYN-ACK sent, waiting for the ACK
	StageTwoPath                     // both paths in use (§3.5)
	StageCancelling                  // cancelLock sent, waiting for ackCancel (§3.6)
	StageDone                        // old path torn down, or request resolved
)

// Stages lists every anchor stage, for comparison with the model.
var Stages = []Stage{StageLocking, StageSettingUp, StageWaitSyn, StageWaitAck, StageTwoPath, StageCancelling, StageDone}

func (s Stage) String() string {
	switch s {
	case StageLocking:
		return "locking"
	case StageSettingUp:
		return "settingUp"
	case StageWaitSyn:
		return "waitSyn"
	case StageWaitAck:
		return "waitAck"
	case StageTwoPath:
		return "twoPath"
	case StageCancelling:
		return "cancelling"
	case StageDone:
		return "done"
	}
	return fmt.Sprintf("stage-%d", uint8(s))
}

// Reason explains a refusal or failure. It travels in nackLock and in a
// trigger's answer, and is reported in Result and TriggerResult.
type Reason uint8

// Reasons.
const (
	ReasonNone         Reason = iota
	ReasonLocked              // a subsession of the segment is locked by another reconfiguration (§3.2)
	ReasonBusy                // an agent of the segment is still completing an earlier reconfiguration
	ReasonNotOnPath           // the right anchor is not on the session's path to the right
	ReasonInvalid             // the request itself is wrong (empty session, bad address list)
	ReasonNoSession           // no such session, or it has no subsession to the right
	ReasonTimeout             // no answer to requestLock after every retransmission
	ReasonSetupFailed         // the new path could not be set up; cancelled (§3.6)
	ReasonSessionEnded        // the TCP session ended (FIN, RST, idle) first
	ReasonStale               // an answer to a request that is already resolved
	ReasonAborted             // the agent aborted a gated request before the switch (Proceed.Abort)
	ReasonOnPath              // a hop of the new chain is already on the session's path (Result.Hop)
	// ReasonWrongSender (trigger): the subsession the trigger names does
	// not lead to its sender.
	ReasonWrongSender
	// ReasonNotNextHop (trigger): the sender is no longer the session's
	// next hop at the left neighbour: a reconfiguration took it out of
	// the path, whose old subsession lingers there.
	ReasonNotNextHop
	// ReasonNoAnswer (TriggerResult, never on the wire): the left
	// neighbour did not answer the trigger after every retransmission.
	ReasonNoAnswer
	// ReasonNF: a host of the new path could not start the network
	// function the request named for it (Result.Hop, Result.NF, and why
	// in Result.Detail; heterogeneous-sfc-quic §IV).
	ReasonNF
)

// lastWireReason is the last reason a message may carry (a trigger's
// answer carries any reason a request can end with).
const lastWireReason = ReasonNotNextHop

func (r Reason) String() string {
	switch r {
	case ReasonNone:
		return "none"
	case ReasonLocked:
		return "segment locked by another reconfiguration"
	case ReasonBusy:
		return "an anchor is still completing an earlier reconfiguration"
	case ReasonNotOnPath:
		return "right anchor not on the session's path"
	case ReasonInvalid:
		return "invalid request"
	case ReasonNoSession:
		return "no such session or no subsession to the right"
	case ReasonTimeout:
		return "no answer to requestLock"
	case ReasonSetupFailed:
		return "new path could not be set up"
	case ReasonSessionEnded:
		return "session ended"
	case ReasonStale:
		return "stale request"
	case ReasonAborted:
		return "aborted before the switch"
	case ReasonOnPath:
		return "a middlebox of the new chain is already on the session's path"
	case ReasonWrongSender:
		return "the subsession does not lead to the sender"
	case ReasonNotNextHop:
		return "the sender is no longer this session's next hop (its path changed)"
	case ReasonNoAnswer:
		return "no answer from the left neighbour"
	case ReasonNF:
		return "a host of the new path could not start its network function"
	}
	return fmt.Sprintf("reason-%d", uint8(r))
}

// Contention reports whether r is a refusal caused by another request.
func (r Reason) Contention() bool { return r == ReasonLocked || r == ReasonBusy }

// Outcome is the final result of a reconfiguration request.
type Outcome uint8

// Outcomes.
const (
	Succeeded Outcome = iota + 1 // the new path carries the session, the old one is gone
	Refused                      // never locked: contention, bad request, right anchor not found
	Failed                       // locked but not completed: setup failed (cancelled), timeout, session ended
)

func (o Outcome) String() string {
	switch o {
	case Succeeded:
		return "succeeded"
	case Refused:
		return "refused"
	case Failed:
		return "failed"
	}
	return fmt.Sprintf("outcome-%d", uint8(o))
}

// Fault deliberately breaks the protocol, to show that the simulation's
// checkers catch mistakes. Never set outside tests.
type Fault uint32

// Faults.
const (
	// FaultSkipLock: agents forward requestLock whatever the state of the
	// subsession to their right, and take the lock over (§3.2 ignored).
	FaultSkipLock Fault = 1 << iota
	// FaultAcksOnOldPath: in the two-path phase every acknowledgment goes on
	// the old path (§3.5 ack table ignored).
	FaultAcksOnOldPath
	// FaultStaleOldAcks: late packets of the old path keep their stale
	// ack (Deliver does nothing), and end hosts discard them once the ack
	// is more than a window old.
	FaultStaleOldAcks
	// FaultNoPathCheck: the left anchor does not compare its new chain
	// with the old segment the ackLock lists (sameOrCrossing), so a new
	// path may name a middlebox of the old one. With an agent that joins
	// such a path anyway, this is how reconfigurations behaved before the
	// check (docs/protocol.md, "A middlebox on both paths").
	FaultNoPathCheck
	// FaultTriggerDup: the left neighbour takes every copy of a trigger
	// for a new one (no history, no replay window): a duplicated or
	// retransmitted trigger starts a second request (§3.6 ignored).
	FaultTriggerDup
	// FaultMigEarlySwitch: a migrating left anchor switches as soon as
	// the old middlebox exported the state, before the new one confirmed
	// its import (§3.5: the state must be in place before the switch).
	FaultMigEarlySwitch
	// FaultMigHoldLeak: a migration that fails leaves the left anchor's
	// hold in place (its packets are never sent again).
	FaultMigHoldLeak
	// FaultUDPNoQuiet: a UDP anchor ends its side of the two-path phase
	// as soon as it switches, without waiting for its old path to be
	// quiet for the drain time (udp.go): datagrams still on the old path
	// reach an anchor whose old path is gone.
	FaultUDPNoQuiet
)

// Proto is a session's transport protocol. The zero value is TCP.
type Proto uint8

// Transport protocols of sessions.
const (
	ProtoTCP Proto = iota
	ProtoUDP
)

func (p Proto) String() string {
	switch p {
	case ProtoTCP:
		return "tcp"
	case ProtoUDP:
		return "udp"
	}
	return fmt.Sprintf("proto-%d", uint8(p))
}
