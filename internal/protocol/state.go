package protocol

import (
	"net/netip"
	"time"

	"github.com/dysco/dysco/internal/wire"
)

const maxEarlySyns = 4096

type earlySyn struct {
	from netip.Addr
	m    *Message
	at   time.Duration
}

type subRef struct {
	id   SessionID
	side Side
	peer netip.Addr
	// nonce is what messages on this subsession carry: the nonce of the
	// session the subsession was made for (one session end to end, or one
	// half of a proxy's two joined sessions, §2.4).
	nonce [wire.NonceLen]byte
	tomb  bool // an old path after teardown, kept to answer FINs
	// moved: a subsession a rebind replaced, kept to answer the
	// rebind's retransmissions (rebind.go).
	moved bool
}

type session struct {
	id      SessionID
	tuple   wire.Tuple
	proto   Proto
	nonce   [wire.NonceLen]byte
	sides   [2]*SideInfo
	app     AppDelta
	joinReq ReqKey // set when a new-path SYN created the session
	// joinRight is the right anchor of joinReq.
	joinRight netip.Addr
	// joinWS: this joined session has learned the window scale of the
	// windows that travel left, from its new path's synAck (JoinedWScale).
	joinWS bool
	// joinFailed: this joined session's new path failed: its datapath
	// could not install it (JoinFailed; the session has no datapath
	// state), or a host after it could not (a setup-failed refusal passed
	// on). Kept until the left anchor's cancelLock on the new path or a
	// lease, to refuse the SYN again if it comes again and to pass that
	// cancelLock on.
	joinFailed bool
	// failedAt is the host whose join failed (this one, or one after it).
	failedAt netip.Addr
	ready    bool // the datapath knows the marks (always, unless joined)

	// §3.2: the state of the subsession to the right, kept here.
	lock      LockState
	requestor ReqKey
	// reqSub and reqPeer are where the requestor's requestLock came from:
	// its answers go back that way (the left side may change meanwhile).
	reqSub  wire.Tuple
	reqPeer netip.Addr
	queue   []queued // requests blocked by a lockPending subsession

	left  *anchor // this agent is the left anchor of a reconfiguration of its right side
	right *anchor // this agent is the right anchor of a reconfiguration of its left side

	cancels map[ReqKey]*cancelJob
	history []resolution
	// trigs are the triggers this agent took for the session as its left
	// neighbour, running or answered (trigger.go), at most historyLen
	// answered ones.
	trigs    []*trigIn
	maxID    map[netip.Addr]uint32
	teardown *teardown // old path middle agent: FIN exchanges seen
	tombs    []tomb
	timers   map[TimerID]struct{}
	// serve are the migration steps this agent took for the session as
	// a middlebox (migrate.go); exported and imported: its plug-ins
	// hold state moved for it (ReleaseState when it goes).
	serve              []*migServe
	exported, imported bool
	// rebind is this agent's rebind of a side in progress (rebind.go);
	// rebound and reboundAt the last rebind of each side accepted here
	// (none: zero); moved the subsessions rebinds replaced here, until
	// Linger.
	rebind    *rebindOut
	rebound   [2]ReqKey
	reboundAt [2]time.Duration
	refused   [2]refusal // the last rebind of each side refused here
	moved     []moved
}

type queued struct {
	msg   *Message // a requestLock from the left
	from  netip.Addr
	local *anchor // or a local Reconfigure
}

type resKind uint8

const (
	resNacked resKind = iota + 1
	resCancelled
	resDone
	resExpired
)

type resolution struct {
	req     ReqKey
	kind    resKind
	reason  Reason
	blocker ReqKey
}

const historyLen = 32

// anchor is the state of one reconfiguration at one of its anchors.
type anchor struct {
	role        Role
	req         ReqKey
	token       uint64
	stage       Stage
	rightAnchor netip.Addr
	chain       []netip.Addr
	// nfs (left anchor): the network function of each hop of chain, ""
	// for none; nil when none names one (Reconfigure.NFs).
	nfs []string
	// nfWait (left anchor): a host of the new path said it starts this
	// network function; nfDone: the new path has answered since.
	nfWait  string
	nfDone  bool
	nfSince time.Duration // when the first such word came
	tries   int
	delta   Delta // leftDelta at the left anchor, rightDelta at the right anchor (§3.4)
	// grantDelta (right anchor): the leftDelta that requestLock gathered
	// on its way, which the granting synAck carries (synAckMsg).
	grantDelta  Delta
	peerWS      uint8
	anchorNonce [wire.NonceLen]byte // the nonce of the new path (the left anchor's)
	newSub      wire.Tuple
	newPeer     netip.Addr
	newDelta    Delta
	// source (left anchor): the local address the new path leaves from
	// (Reconfigure.Source); zero for the route's.
	source netip.Addr
	// directNew (right anchor): the new path came straight from the left
	// anchor (its SYN carried FlagDirect, or came from the left anchor's
	// own address).
	directNew bool

	vars                          TwoPath
	haveVars                      bool
	finSent, finAcked, finAckSent bool
	// finVia says which ways the other anchor's fin came, 0 while none
	// has: viaOld (the old path) and viaNew (the direct new path, see
	// direct); the finAck answers each copy the way it came.
	finVia     uint8
	peerCutoff uint32
	// finOldAcked: our fin was answered on the old path (or we gave up),
	// so its middle agents saw the teardown both ways; until then
	// TimerOldFin sends it again there, also after completion (tomb).
	finOldAcked bool
	unconfirmed bool
	// probes counts the fins sent, after ours was answered, to ask for the
	// other anchor's fin, since the last answer (TimerFin sends them,
	// waitFin arms it, onFinAck resets the count).
	probes int
	// gate: wait for Proceed between the SYN-ACK and the ACK
	// (Reconfigure.Gate); gated: waiting now.
	gate, gated bool
	// synAcked: the SYN-ACK of the early SYN came while still locking
	// (sendEarlySyn).
	synAcked bool
	aborted  bool // the agent aborted the gated request
	resumed  bool // begun by an earlier run of the agent (resume)
	// trig is the trigger that asked for the request, nil if the agent
	// did (trigger.go).
	trig *trigIn
	// mig is the state migration of a migrating request at its left
	// anchor, rmig its freeze at the right anchor (migrate.go).
	mig  *migLeft
	rmig *migRight
	// UDP sessions (udp.go): quiet, the side's old path has been quiet
	// for the drain time since the switch (its side of the phase ended);
	// oldDgrams, the datapath's count of old-path datagrams last reported;
	// heardAt, when the protocol last saw it move (or the switch); ackAt
	// (left anchor), when the ACK last went.
	quiet          bool
	oldDgrams      uint64
	heardAt, ackAt time.Duration
}

// The ways a fin can come (anchor.finVia).
const (
	viaOld uint8 = 1 << iota
	viaNew
)

// moving reports whether the left anchor's new path leaves from another
// of its addresses than the current subsession (Reconfigure.Source).
func (an *anchor) moving(s *session) bool {
	return an.source.IsValid() && an.source != s.sides[SideRight].Sub.Src.Unmap()
}

// fromElsewhere reports whether the left anchor's direct new path leaves
// from another address than the one it names itself by (Config.Self):
// the session moves to another address, or the host's own is a session
// address (rebind.go), which nothing is sent from. The right anchor
// cannot tell such a SYN by its source; it carries FlagDirect.
func (an *anchor) fromElsewhere(a *Agent, s *session) bool {
	return an.moving(s) || an.newSub.Src.IsValid() && an.newSub.Src.Unmap() != a.cfg.Self
}

// direct reports whether the new path joins the two anchors with no
// middlebox between them (a delete, a proxy removal): then the anchors'
// fins and finAcks also go on it, straight to the other anchor, beside the
// copies that tear the old path down (sendFin).
func (an *anchor) direct() bool {
	if an.role == RoleRightAnchor {
		return an.newPeer.IsValid() && (an.directNew || an.newPeer == an.req.LeftAnchor)
	}
	return an.newPeer.IsValid() && an.newPeer == an.rightAnchor
}

type cancelJob struct {
	req         ReqKey
	rightAnchor netip.Addr
	tries       int
	anchor      *anchor // the left anchor's own cancellation (§3.6), or nil for a stale lock
	// end, when set, is what the left anchor reports once the locks are
	// released (a new chain that equals the old segment, or crosses it);
	// otherwise the new path failed (ReasonSetupFailed, ReasonAborted).
	end *Result
}

type teardown struct {
	req     ReqKey
	fins    [2]bool // seen travelling rightward [0] / leftward [1]
	finAcks [2]bool // the same for the answers
}

// dir is the index of m's direction in a teardown's arrays.
func (td *teardown) dir(m *Message) int {
	if m.Flags&FlagLeftward != 0 {
		return 1
	}
	return 0
}

type tomb struct {
	sub    wire.Tuple
	side   Side
	req    ReqKey
	cutoff uint32 // the cut-off our fin carried, re-sent with FlagDone
	// acked: our fin was answered on this old path (anchor.finOldAcked);
	// until then TimerOldFin sends it again, tries times so far.
	acked       bool
	tries       int
	unconfirmed bool // we completed Unconfirmed: the other anchor may lack our fin
	rightAnchor netip.Addr
	// viaMiddles: the new path that replaced this one has middleboxes
	// (they get the closed notice, onFinsSeen); closed: the flags of the
	// notice sent so far.
	viaMiddles bool
	closed     uint8
}

// New returns an agent with no sessions. Zero durations and counts in cfg
// take their defaults.
