package protocol

import (
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"sort"
	"time"

	"github.com/dysco/dysco/internal/wire"
)

// Config configures an Agent.
type Config struct {
	// Self is this agent's address: the one other agents name it by in
	// address lists and send control messages to.
	Self netip.Addr
	// Key is the deployment key authenticating control messages (HMAC-SHA256).
	Key []byte
	// RTO is the first retransmission timeout of a control message; it
	// doubles at each retransmission up to MaxRTO (exponential back-off).
	RTO, MaxRTO time.Duration
	// MaxTries is how many times a message is sent before giving up.
	MaxTries int
	// Linger is how long the old path's state stays after teardown, to
	// answer retransmitted FINs.
	Linger time.Duration
	// LockLease releases a lock that nothing resolves for this long (the
	// left anchor died, every cancelLock was lost). It must exceed the
	// longest exchange: MaxTries retransmissions.
	LockLease time.Duration
	// GateTimeout bounds the wait of a gated request for Proceed
	// (Reconfigure.Gate): then it aborts by itself, well before the locks'
	// leases expire. At most LockLease/2; default LockLease/4.
	GateTimeout time.Duration
	// WindowClamp is the largest window advertised by an anchor during the
	// two-path phase (§5.3: 64 KB).
	WindowClamp uint32
	// PortBase and PortCount bound the ports of new subsessions.
	PortBase, PortCount uint16
	// JoinedBase is the number after which this agent numbers the sessions
	// it creates itself (a middlebox joining a new path); zero means
	// 1<<63, above every id an agent announces (SessionUp). Agents whose
	// session ids share one space (an agent's IPv4 and IPv6 halves) need
	// ranges that do not meet.
	JoinedBase SessionID
	// FirstReq is the number after which this agent numbers its requests
	// (ReqKey.ID). Other agents refuse a request not newer than the last
	// one they saw from this agent for a session, so an agent that
	// restarts must go on above every number it may have used before.
	FirstReq uint32
	// Faults breaks the protocol on purpose (tests only).
	Faults Fault
}

// DefaultConfig returns the defaults for self and key.
func DefaultConfig(self netip.Addr, key []byte) Config {
	return Config{
		Self:        self,
		Key:         key,
		RTO:         200 * time.Millisecond,
		MaxRTO:      3 * time.Second,
		MaxTries:    10,
		Linger:      10 * time.Second,
		LockLease:   2 * time.Minute,
		WindowClamp: 64 << 10,
		PortBase:    40000,
		PortCount:   20000,
	}
}

// Agent is the protocol state of one Dysco agent: its sessions, their
// locks and the reconfigurations they take part in. Not safe for
// concurrent use: the caller serialises events.
type Agent struct {
	cfg      Config
	sessions map[SessionID]*session
	subs     map[wire.Tuple]subRef
	rightReq map[ReqKey]SessionID // sessions where this agent is the right anchor of a request
	// earlySyns are the early SYNs of direct new paths that came before
	// their request's requestLock (sendEarlySyn), at most maxEarlySyns.
	earlySyns map[ReqKey]earlySyn
	// reqWindows are, per left anchor, the requests heard of here as their
	// right anchor: an early SYN of one of them is a replay (replay.go).
	reqWindows map[netip.Addr]*reqWindow
	nextReq    uint32
	nextJoin   SessionID
	nextPort   uint16

	now time.Duration
	out []Action
}

// maxEarlySyns bounds Agent.earlySyns: one per request on its way to this
// agent as a right anchor; each expires after LockLease.
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
}

type session struct {
	id      SessionID
	tuple   wire.Tuple
	nonce   [wire.NonceLen]byte
	sides   [2]*SideInfo
	app     AppDelta
	joinReq ReqKey // set when a new-path SYN created the session
	// joinRight is the right anchor of joinReq.
	joinRight netip.Addr
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

	cancels  map[ReqKey]*cancelJob
	history  []resolution
	maxID    map[netip.Addr]uint32
	teardown *teardown // old path middle agent: FIN exchanges seen
	tombs    []tomb
	timers   map[TimerID]struct{}
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
	tries       int
	delta       Delta // leftDelta at the left anchor, rightDelta at the right anchor (§3.4)
	// grantDelta (right anchor): the leftDelta that requestLock gathered
	// on its way, which the granting synAck carries (synAckMsg).
	grantDelta  Delta
	peerWS      uint8
	anchorNonce [wire.NonceLen]byte // the nonce of the new path (the left anchor's)
	newSub      wire.Tuple
	newPeer     netip.Addr
	newDelta    Delta

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
}

// The ways a fin can come (anchor.finVia).
const (
	viaOld uint8 = 1 << iota
	viaNew
)

// direct reports whether the new path joins the two anchors with no
// middlebox between them (a delete, a proxy removal): then the anchors'
// fins and finAcks also go on it, straight to the other anchor, beside the
// copies that tear the old path down (sendFin).
func (an *anchor) direct() bool {
	other := an.rightAnchor
	if an.role == RoleRightAnchor {
		other = an.req.LeftAnchor
	}
	return an.newPeer.IsValid() && an.newPeer == other
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
func New(cfg Config) *Agent {
	d := DefaultConfig(cfg.Self, cfg.Key)
	if cfg.RTO == 0 {
		cfg.RTO = d.RTO
	}
	if cfg.MaxRTO == 0 {
		cfg.MaxRTO = d.MaxRTO
	}
	if cfg.MaxTries == 0 {
		cfg.MaxTries = d.MaxTries
	}
	if cfg.Linger == 0 {
		cfg.Linger = d.Linger
	}
	if cfg.LockLease == 0 {
		cfg.LockLease = d.LockLease
	}
	if cfg.GateTimeout <= 0 || cfg.GateTimeout > cfg.LockLease/2 {
		cfg.GateTimeout = cfg.LockLease / 4
	}
	if cfg.WindowClamp == 0 {
		cfg.WindowClamp = d.WindowClamp
	}
	if cfg.PortCount == 0 {
		cfg.PortBase, cfg.PortCount = d.PortBase, d.PortCount
	}
	if cfg.JoinedBase == 0 {
		cfg.JoinedBase = joinedIDBit
	}
	return &Agent{
		cfg:        cfg,
		sessions:   map[SessionID]*session{},
		subs:       map[wire.Tuple]subRef{},
		rightReq:   map[ReqKey]SessionID{},
		earlySyns:  map[ReqKey]earlySyn{},
		reqWindows: map[netip.Addr]*reqWindow{},
		nextJoin:   cfg.JoinedBase,
		nextReq:    cfg.FirstReq,
	}
}

// Self returns the agent's address.
func (a *Agent) Self() netip.Addr { return a.cfg.Self }

// LastReq returns the number of the agent's latest request (Config.FirstReq
// before the first).
func (a *Agent) LastReq() uint32 { return a.nextReq }

// Handle processes one event at time now and returns the actions to carry
// out, in order.
func (a *Agent) Handle(now time.Duration, ev Event) []Action {
	a.now = now
	a.out = nil
	switch e := ev.(type) {
	case SessionUp:
		a.onSessionUp(e)
	case SetAppDelta:
		if s := a.sessions[e.Session]; s != nil {
			s.app = e.App
		}
	case MessageIn:
		a.onMessage(e)
	case Reconfigure:
		a.onReconfigure(e)
	case Proceed:
		a.onProceed(e)
	case JoinFailed:
		a.onJoinFailed(e)
	case FinsSeen:
		a.onFinsSeen(e)
	case TimerFired:
		a.onTimer(e.ID)
	case TwoPathProgress:
		a.onProgress(e)
	case DatapathReady:
		if s := a.sessions[e.Session]; s != nil {
			s.ready = true
		}
	case SessionEnd:
		if s := a.sessions[e.Session]; s != nil {
			a.endSession(s)
		}
	default:
		panic(fmt.Sprintf("protocol: unknown event %T", ev))
	}
	out := a.out
	a.out = nil
	return out
}

func (a *Agent) emit(act Action) { a.out = append(a.out, act) }

func (a *Agent) reject(r RejectReason, m *Message, from netip.Addr, format string, args ...any) {
	var t MsgType
	if m != nil {
		t = m.Type
	}
	a.emit(Rejected{Reason: r, Type: t, From: from, Detail: fmt.Sprintf(format, args...)})
}

func (a *Agent) progress(s *session, req ReqKey, role Role, st Stage, note string) {
	a.emit(Progress{Session: s.id, Req: req, Role: role, Stage: st, Note: note})
}

// ---- sessions ----

func (a *Agent) onSessionUp(e SessionUp) {
	if old := a.sessions[e.Session]; old != nil {
		a.endSession(old)
	}
	s := a.newSession(e.Session, e.Tuple, e.Nonce)
	s.app, s.ready = e.App, true
	if e.Left != nil {
		l := *e.Left
		if l.Nonce == ([wire.NonceLen]byte{}) {
			l.Nonce = e.Nonce
		}
		s.sides[SideLeft] = &l
		a.subs[l.Sub] = subRef{id: s.id, side: SideLeft, peer: l.Peer, nonce: l.Nonce}
	}
	if e.Right != nil {
		r := *e.Right
		if r.Nonce == ([wire.NonceLen]byte{}) {
			r.Nonce = e.Nonce
		}
		s.sides[SideRight] = &r
		a.subs[r.Sub] = subRef{id: s.id, side: SideRight, peer: r.Peer, nonce: r.Nonce}
	}
	for _, side := range []Side{SideRight, SideLeft} {
		if sd := s.sides[side]; sd != nil && sd.Resume != nil {
			rs := sd.Resume
			sd.Resume = nil
			a.resume(s, side, rs)
		}
	}
	if k := e.Lock; !k.IsZero() && s.left == nil && s.right == nil && s.sides[SideLeft] != nil && s.sides[SideRight] != nil {
		// A middle agent of an old path that restarted (KeepLock): locked
		// for the request again, as the anchors still count on it (§3.2),
		// with a fresh lease. Who sent the request is gone with the old
		// agent: answers go left (sendRequestor).
		s.lock, s.requestor = Locked, k
		a.maxSeen(s, k)
		a.setTimer(s, TimerLease, k, a.cfg.LockLease)
	}
}

// resume takes up a reconfiguration of side that the agent left unfinished
// when it restarted (SideInfo.Resume).
func (a *Agent) resume(s *session, side Side, rs *Resume) {
	an := &anchor{role: RoleRightAnchor, req: rs.Req, rightAnchor: rs.RightAnchor, anchorNonce: rs.NewNonce,
		newSub: rs.NewSub, newPeer: rs.NewPeer, newDelta: rs.NewDelta, resumed: true}
	a.subs[rs.NewSub] = subRef{id: s.id, side: side, peer: rs.NewPeer, nonce: rs.NewNonce}
	a.maxSeen(s, rs.Req)
	const note = "resumed after an agent restart"
	if side == SideRight {
		an.role = RoleLeftAnchor
		s.left = an
		s.lock, s.requestor = Locked, rs.Req
		if !rs.Switched {
			// Setting up the new path: what it needs (the chain, the SYN's
			// retransmissions) is gone; abandon it (§3.6).
			a.progress(s, an.req, RoleLeftAnchor, StageSettingUp, note)
			an.aborted = true
			a.abortSetup(s, an)
			return
		}
	} else {
		s.right = an
		a.rightReq[rs.Req] = s.id
		if !rs.Switched {
			an.stage = StageWaitAck
			a.progress(s, an.req, RoleRightAnchor, StageWaitAck, note)
			a.setTimer(s, TimerLease, an.req, a.cfg.LockLease)
			return
		}
	}
	// The datapath is in its two-path phase: the agent reports its
	// variables (TwoPathProgress), and evaluate goes on from there.
	an.stage = StageTwoPath
	a.progress(s, an.req, an.role, StageTwoPath, note)
}

func (a *Agent) newSession(id SessionID, t wire.Tuple, nonce [wire.NonceLen]byte) *session {
	s := &session{id: id, tuple: t, nonce: nonce,
		cancels: map[ReqKey]*cancelJob{}, maxID: map[netip.Addr]uint32{}, timers: map[TimerID]struct{}{}}
	a.sessions[id] = s
	return s
}

// endSession drops all state of a session whose TCP session ended (§3.7:
// a FIN or RST may arrive in any state): requests fail, locks go.
func (a *Agent) endSession(s *session) {
	if l := s.left; l != nil && l.stage != StageDone {
		if (l.stage == StageSettingUp || l.stage == StageTwoPath) && !l.direct() {
			// Free the middleboxes that joined the new path (best
			// effort): with the session gone nothing will ever cancel
			// it or cross it, and its FINs may have gone the old way.
			c := a.msg(s, MsgCancelLock, l.newSub, l.req, l.rightAnchor)
			c.Flags = FlagNewPath
			a.send(l.newPeer, c)
		}
		a.emit(Result{Session: s.id, Token: l.token, Req: l.req, Outcome: Failed, Reason: ReasonSessionEnded})
	}
	for _, q := range s.queue {
		if q.local != nil {
			a.emit(Result{Session: s.id, Token: q.local.token, Req: q.local.req, Outcome: Refused, Reason: ReasonSessionEnded})
		}
	}
	a.drop(s)
}

// drop forgets a session without reporting anything.
func (a *Agent) drop(s *session) {
	ids := make([]TimerID, 0, len(s.timers))
	for id := range s.timers {
		ids = append(ids, id)
	}
	sort.Slice(ids, func(i, j int) bool { return ids[i].String() < ids[j].String() })
	for _, id := range ids {
		a.emit(CancelTimer{ID: id})
	}
	subs := []wire.Tuple{}
	for _, sd := range s.sides {
		if sd != nil {
			subs = append(subs, sd.Sub)
		}
	}
	for _, an := range []*anchor{s.left, s.right} {
		if an != nil {
			subs = append(subs, an.newSub)
		}
	}
	for _, t := range s.tombs {
		subs = append(subs, t.sub)
	}
	for _, t := range subs {
		if r, ok := a.subs[t]; ok && r.id == s.id {
			delete(a.subs, t)
		}
	}
	if s.right != nil {
		delete(a.rightReq, s.right.req)
	}
	delete(a.sessions, s.id)
}

// ---- timers ----

func (a *Agent) setTimer(s *session, kind TimerKind, req ReqKey, after time.Duration) {
	id := TimerID{Session: s.id, Kind: kind, Req: req}
	s.timers[id] = struct{}{}
	a.emit(SetTimer{ID: id, At: a.now + after})
}

func (a *Agent) cancelTimer(s *session, kind TimerKind, req ReqKey) {
	id := TimerID{Session: s.id, Kind: kind, Req: req}
	if _, ok := s.timers[id]; ok {
		delete(s.timers, id)
		a.emit(CancelTimer{ID: id})
	}
}

// backoff is the timeout after the tries-th transmission.
func (a *Agent) backoff(tries int) time.Duration {
	d := a.cfg.RTO
	for i := 1; i < tries && d < a.cfg.MaxRTO; i++ {
		d *= 2
	}
	return min(d, a.cfg.MaxRTO)
}

func (a *Agent) onTimer(id TimerID) {
	s := a.sessions[id.Session]
	if s == nil {
		return
	}
	if _, ok := s.timers[id]; !ok {
		return // cancelled or moved
	}
	delete(s.timers, id)
	switch id.Kind {
	case TimerRequest:
		l := s.left
		if l == nil || l.req != id.Req || l.stage != StageLocking {
			return
		}
		if l.tries >= a.cfg.MaxTries {
			// §3.6: give up; some agents may hold the lock for us.
			s.lock, s.requestor = Unlocked, ReqKey{}
			a.finishLeft(s, Failed, ReasonTimeout, ReqKey{})
			a.startCancel(s, l.req, l.rightAnchor, nil)
			a.releaseQueue(s)
			return
		}
		a.sendRequestLock(s, l)
	case TimerSyn:
		l := s.left
		if l == nil || l.req != id.Req || l.stage != StageSettingUp {
			return
		}
		if l.tries >= a.cfg.MaxTries {
			a.abortSetup(s, l)
			return
		}
		a.sendSyn(s, l)
	case TimerCancel:
		j := s.cancels[id.Req]
		if j == nil {
			return
		}
		if j.tries >= a.cfg.MaxTries {
			// Nobody answers: the leases release what is left.
			a.cancelDone(s, j)
			return
		}
		a.sendCancel(s, j)
	case TimerFin:
		an := a.anchorFor(s, id.Req)
		if an == nil || an.stage != StageTwoPath || !an.finSent || an.finVia != 0 && an.finAcked {
			return
		}
		if !an.finAcked {
			if an.tries >= a.cfg.MaxTries {
				// The other anchor stopped answering. Everything we sent on
				// the old path is acknowledged, so going on is safe; say so.
				an.finAcked, an.finOldAcked, an.unconfirmed = true, true, true
				a.evaluate(s, an)
				a.waitFin(s, an)
				return
			}
			a.sendFin(s, an)
			return
		}
		// Our fin is answered but the other anchor's has not come. If every
		// copy of it was lost, the other anchor gave up and completed
		// Unconfirmed, and nothing would ever end our two-path phase: ask
		// again. A live anchor answers our fin with a finAck, a completed
		// one's tomb also with its own fin (onTomb).
		if an.probes >= a.cfg.MaxTries {
			// Nobody answers any more, not even a tomb: the other anchor
			// completed at least Linger ago and no longer uses the old path.
			an.unconfirmed = true
			a.complete(s, an)
			return
		}
		an.probes++
		a.sendFin(s, an)
	case TimerLease:
		a.onLease(s, id.Req)
	case TimerGate:
		if l := s.left; l != nil && l.req == id.Req && l.gated {
			a.onProceed(Proceed{Session: s.id, Req: l.req, Abort: "no Proceed within the gate timeout"})
		}
	case TimerOldFin:
		a.onOldFin(s, id.Req)
	case TimerLinger:
		a.onLinger(s, id.Req)
	}
}

// ---- operator requests (§3.1) ----

func (a *Agent) onReconfigure(e Reconfigure) {
	refuse := func(r Reason, blocker ReqKey) {
		a.nextReq++
		a.emit(Result{Session: e.Session, Token: e.Token, Req: ReqKey{LeftAnchor: a.cfg.Self, ID: a.nextReq},
			Outcome: Refused, Reason: r, Blocker: blocker})
	}
	s := a.sessions[e.Session]
	if s == nil || s.sides[SideRight] == nil {
		refuse(ReasonNoSession, ReqKey{})
		return
	}
	if err := a.checkChain(e.RightAnchor, e.Chain); err != nil {
		refuse(ReasonInvalid, ReqKey{})
		return
	}
	if s.left != nil {
		refuse(ReasonBusy, s.left.req) // one reconfiguration at a time per left anchor
		return
	}
	if !s.ready {
		refuse(ReasonBusy, s.joinReq) // joined a new path; the datapath has not seen traffic yet
		return
	}
	a.nextReq++
	l := &anchor{role: RoleLeftAnchor, req: ReqKey{LeftAnchor: a.cfg.Self, ID: a.nextReq}, token: e.Token,
		rightAnchor: e.RightAnchor, chain: append([]netip.Addr(nil), e.Chain...), gate: e.Gate}
	switch {
	case s.lock == Unlocked || a.cfg.Faults&FaultSkipLock != 0:
		a.startLeft(s, l)
	case s.lock == LockPending:
		// Blocked behind a request passing through, like a request from
		// the left (§3.2): it goes on if that one is refused.
		s.queue = append(s.queue, queued{local: l})
		a.progress(s, l.req, RoleLeftAnchor, StageLocking, "queued behind "+s.requestor.String())
	default:
		refuse(ReasonLocked, s.requestor)
	}
}

func (a *Agent) checkChain(ra netip.Addr, chain []netip.Addr) error {
	// Every address is unicast and of this agent's family, as Decode
	// demands of the messages that will carry them: a request that mixes
	// families (an IPv6 session, an IPv4 right anchor) would otherwise
	// send messages that every peer refuses as malformed, until it times
	// out.
	ok := func(x netip.Addr) bool {
		return x.IsValid() && wire.Unicast(x) && x.Unmap().Is4() == a.cfg.Self.Unmap().Is4()
	}
	if !ok(ra) || ra == a.cfg.Self {
		return errors.New("right anchor")
	}
	if len(chain)+1 > wire.MaxHops {
		return errors.New("too many hops")
	}
	seen := map[netip.Addr]bool{a.cfg.Self: true, ra: true}
	for _, h := range chain {
		if !ok(h) || seen[h] {
			return errors.New("repeated or invalid address")
		}
		seen[h] = true
	}
	return nil
}

// startLeft takes the lock of the right side and sends requestLock (§3.2),
// unless the request is a delete of a segment with nothing in it (the
// right anchor is the next hop already): that one succeeds as unchanged at
// once, with nothing locked.
func (a *Agent) startLeft(s *session, l *anchor) {
	if len(l.chain) == 0 && s.sides[SideRight].Peer == l.rightAnchor {
		s.resolve(resolution{req: l.req, kind: resDone})
		a.progress(s, l.req, RoleLeftAnchor, StageDone, "succeeded: unchanged (the right anchor is the next hop)")
		a.emit(Result{Session: s.id, Token: l.token, Req: l.req, Outcome: Succeeded, Unchanged: true})
		return
	}
	s.left = l
	l.stage = StageLocking
	s.lock, s.requestor = LockPending, l.req
	a.maxSeen(s, l.req)
	a.progress(s, l.req, RoleLeftAnchor, StageLocking, "")
	a.sendRequestLock(s, l)
	a.sendEarlySyn(s, l)
}

// sendEarlySyn sends the SYN of a direct new path (no middlebox: a delete,
// a proxy removal) beside requestLock, straight to the right anchor. The
// right anchor keeps it until it grants the lock and answers it then
// (onRequestLock, acceptSyn), so the SYN and the SYN-ACK travel while the
// lock is being taken, and the left anchor switches as soon as it holds
// the lock (beginSetup). The paper (§3.1) sends the SYN once the segment
// is locked; nothing at the right anchor uses the new subsession before
// the left anchor's ACK or first packet, which follow the lock. It is the
// SYN's first try: if its SYN-ACK has not come when the lock is held,
// TimerSyn sends the SYN again (beginSetup). Not on a path with
// middleboxes: they would join the new path before the lock is held.
// Model: agent.pml sendEarlySyn.
func (a *Agent) sendEarlySyn(s *session, l *anchor) {
	if len(l.chain) != 0 {
		return
	}
	side := s.sides[SideRight]
	l.newPeer = l.rightAnchor
	l.newSub = a.allocPort(l.newPeer, s.tuple.DstPort)
	a.subs[l.newSub] = subRef{id: s.id, side: SideRight, peer: l.newPeer, nonce: side.Nonce}
	a.send(l.newPeer, a.msg(s, MsgSyn, l.newSub, l.req, l.rightAnchor))
}

func (a *Agent) maxSeen(s *session, k ReqKey) {
	if k.ID > s.maxID[k.LeftAnchor] {
		s.maxID[k.LeftAnchor] = k.ID
	}
}

// ---- messages ----

func (a *Agent) msg(s *session, t MsgType, sub wire.Tuple, req ReqKey, ra netip.Addr) *Message {
	nonce := s.nonce
	if r, ok := a.subs[sub]; ok && r.id == s.id {
		nonce = r.nonce
	}
	return &Message{Type: t, Nonce: nonce, Sub: sub, Session: s.tuple, Req: req, RightAnchor: ra}
}

func (a *Agent) send(to netip.Addr, m *Message) {
	b, err := m.Encode(a.cfg.Key)
	if err != nil {
		panic("protocol: encoding a message we built: " + err.Error())
	}
	a.emit(Send{To: to, Msg: m, Data: b})
}

// sendSide sends m on the session's current subsession of side.
func (a *Agent) sendSide(s *session, side Side, m *Message) {
	sd := s.sides[side]
	m.Sub = sd.Sub
	m.Nonce = sd.Nonce
	a.send(sd.Peer, m)
}

// rightward reports whether m travels from the left anchor towards the right one.
func rightward(m *Message) bool {
	switch m.Type {
	case MsgRequestLock, MsgCancelLock, MsgSyn, MsgAck:
		return true
	case MsgFin, MsgFinAck:
		return m.Flags&FlagLeftward == 0
	}
	return false
}

func (a *Agent) onMessage(e MessageIn) {
	m, err := Decode(a.cfg.Key, e.Data)
	if err != nil {
		var de *DecodeError
		if errors.As(err, &de) {
			a.reject(de.Reason, nil, e.From, "%s", de.Detail)
		} else {
			a.reject(RejectMalformed, nil, e.From, "%v", err)
		}
		return
	}
	ref, ok := a.subs[m.Sub]
	if !ok {
		if m.Type == MsgSyn {
			a.onNewSyn(e.From, m, e.OnPath)
			return
		}
		if m.Type == MsgCancelLock && m.Flags&FlagNewPath != 0 {
			return // the new path's state is already gone
		}
		a.reject(RejectUnknownSession, m, e.From, "no subsession %s", m.Sub)
		if e.Gone && m.Type == MsgRequestLock && !a.knownReq(m.Req) {
			// The session ended here: its request cannot lock the
			// segment. Tell the left anchor now (the answer goes back
			// the way the request came, as any nackLock). Only once,
			// and only for a request not heard of here before (the
			// window of replay.go): a replayed requestLock of a
			// session that has ended gets no answer. A retransmission
			// of one whose nack was lost gets none either; its left
			// anchor gives up when its retransmissions run out.
			a.heardOf(m.Req)
			n := &Message{Type: MsgNackLock, Reason: ReasonSessionEnded, Nonce: m.Nonce, Sub: m.Sub,
				Session: m.Session, Req: m.Req, RightAnchor: m.RightAnchor}
			a.send(e.From, n)
		}
		return
	}
	s := a.sessions[ref.id]
	if m.Nonce != ref.nonce {
		a.reject(RejectNonce, m, e.From, "session %d", s.id)
		return
	}
	if e.From != ref.peer {
		a.reject(RejectWrongPeer, m, e.From, "subsession %s belongs to %s", m.Sub, ref.peer)
		return
	}
	if rightward(m) != (ref.side == SideLeft) {
		a.reject(RejectUnexpected, m, e.From, "%s arrived on the %s side", m.Type, ref.side)
		return
	}
	if ref.tomb {
		a.onTomb(s, ref, m)
		return
	}
	if s.sides[ref.side].Sub != m.Sub && !a.onNewSub(s, ref, m) {
		return
	}
	if m.Flags&flagsClosed != 0 {
		a.onClosedNotice(s, ref, m)
		return
	}
	switch m.Type {
	case MsgRequestLock:
		a.onRequestLock(s, m, e.From, false)
	case MsgAckLock:
		a.onAckLock(s, m)
	case MsgNackLock:
		a.onNackLock(s, m)
	case MsgCancelLock:
		a.onCancelLock(s, m)
	case MsgAckCancel:
		a.onAckCancel(s, m)
	case MsgSyn:
		a.onSynDup(s, ref, m)
	case MsgSynAck:
		a.onSynAck(s, ref, m)
	case MsgAck:
		a.onAck(s, ref, m)
	case MsgFin:
		a.onFin(s, ref, m)
	case MsgFinAck:
		a.onFinAck(s, ref, m)
	}
}

// ---- history of resolved requests: duplicates get the same answer ----

func (s *session) resolved(k ReqKey) (resolution, bool) {
	for i := len(s.history) - 1; i >= 0; i-- {
		if s.history[i].req == k {
			return s.history[i], true
		}
	}
	return resolution{}, false
}

func (s *session) resolve(r resolution) {
	for i := range s.history {
		if s.history[i].req == r.req {
			s.history[i] = r
			return
		}
	}
	s.history = append(s.history, r)
	if len(s.history) > historyLen {
		s.history = s.history[1:]
	}
}

func (s *session) queuedReq(k ReqKey) bool {
	for _, q := range s.queue {
		if q.msg != nil && q.msg.Req == k {
			return true
		}
	}
	return false
}

// ---- §3.2 locking ----

// contribution is what this agent does to the stream flowing towards side
// to: its own anchor delta on the arrival side plus the application's
// delta (§3.4). Summed along the old path it gives rightDelta / leftDelta.
func (s *session) contribution(to Side) Delta {
	if to == SideRight {
		return s.sides[SideLeft].Delta.Add(s.app.Right)
	}
	return s.sides[SideRight].Delta.Add(s.app.Left)
}

func (a *Agent) onRequestLock(s *session, m *Message, from netip.Addr, fromQueue bool) {
	k := m.Req
	// The early SYN of k, if it came first: answered below if this agent
	// grants k the lock, dropped otherwise (sendEarlySyn).
	var early earlySyn
	hasEarly := false
	// Every request is marked in its left anchor's window here, also
	// at a middle agent: a replay after the session ended must not be
	// answered (onMessage, MessageIn.Gone).
	a.heardOf(k)
	if m.RightAnchor == a.cfg.Self {
		early, hasEarly = a.takeEarlySyn(k)
	}
	if r, ok := s.resolved(k); ok {
		if r.kind == resNacked {
			a.sendNack(s, m, from, r.reason, r.blocker) // a retransmission: same answer
		} else if !fromQueue {
			a.reject(RejectUnexpected, m, from, "request %s already resolved", k)
		}
		return
	}
	if r := s.right; r != nil && r.req == k {
		a.sendAckLock(s, r) // duplicate at the right anchor
		return
	}
	if s.lock != Unlocked && s.requestor == k {
		a.forwardRequest(s, m) // duplicate: forward again, the right anchor answers again
		return
	}
	if s.queuedReq(k) {
		return
	}
	// A left anchor numbers its requests upwards and has one at a time: a
	// request that is neither active here nor newer than every one seen
	// from that anchor is a replay or a stale retransmission. (A request
	// released from the queue was the newest when it arrived.)
	if max := s.maxID[k.LeftAnchor]; k.ID < max || k.ID == max && !fromQueue {
		if !fromQueue {
			a.reject(RejectReplay, m, from, "request %s not newer than %d", k, max)
		}
		return
	}
	a.maxSeen(s, k)
	if r := s.right; r != nil {
		// Our left side is still being reconfigured (we are its right
		// anchor): it cannot be part of another segment yet.
		a.nack(s, m, from, ReasonBusy, r.req)
		return
	}
	if m.RightAnchor == a.cfg.Self {
		if !s.ready {
			a.nack(s, m, from, ReasonBusy, s.joinReq)
			return
		}
		r := &anchor{role: RoleRightAnchor, req: k, stage: StageWaitSyn, rightAnchor: a.cfg.Self,
			delta: m.Delta, grantDelta: m.LeftDelta, peerWS: m.WScale, anchorNonce: m.AnchorNonce}
		s.right = r
		a.rightReq[k] = s.id
		// The answer first: the agent sends it before it installs
		// (acceptSyn) or at the end of the step, after every action
		// queued before it.
		a.sendAckLock(s, r)
		a.progress(s, k, RoleRightAnchor, StageWaitSyn, "rightDelta "+m.Delta.String())
		a.setTimer(s, TimerLease, k, a.cfg.LockLease)
		if hasEarly {
			a.acceptSyn(s, early.from, early.m)
		}
		return
	}
	if s.sides[SideRight] == nil {
		a.nack(s, m, from, ReasonNotOnPath, ReqKey{})
		return
	}
	if a.cfg.Faults&FaultSkipLock != 0 && s.lock != Unlocked {
		s.lock = Unlocked // broken on purpose: take the lock over
	}
	switch s.lock {
	case Unlocked:
		s.lock, s.requestor = LockPending, k
		s.reqSub, s.reqPeer = m.Sub, from
		a.forwardRequest(s, m)
	case LockPending:
		s.queue = append(s.queue, queued{msg: m, from: from})
	case Locked:
		a.nack(s, m, from, ReasonLocked, s.requestor)
	}
}

// forwardRequest passes requestLock on to the right, adding this agent's
// contribution to rightDelta (§3.4), and to the leftDelta gathered for a
// granting synAck the contribution it will add to the ackLock (onAckLock:
// the same, since a lock pending here keeps both sides as they are).
func (a *Agent) forwardRequest(s *session, m *Message) {
	f := *m
	f.Delta = m.Delta.Add(s.contribution(SideRight))
	f.LeftDelta = m.LeftDelta.Add(s.contribution(SideLeft))
	a.sendSide(s, SideRight, &f)
	a.setTimer(s, TimerLease, m.Req, a.cfg.LockLease)
}

func (a *Agent) sendRequestLock(s *session, l *anchor) {
	m := a.msg(s, MsgRequestLock, wire.Tuple{}, l.req, l.rightAnchor)
	m.WScale = s.sides[SideRight].SendWScale
	// The new path will carry the left anchor's nonce: the right anchor
	// checks its SYN against it (the two differ when a proxy joined two
	// sessions).
	m.AnchorNonce = s.sides[SideRight].Nonce
	a.sendSide(s, SideRight, m)
	l.tries++
	a.setTimer(s, TimerRequest, l.req, a.backoff(l.tries))
}

func (a *Agent) sendAckLock(s *session, r *anchor) {
	m := a.msg(s, MsgAckLock, wire.Tuple{}, r.req, a.cfg.Self)
	m.WScale = s.sides[SideLeft].SendWScale
	a.sendSide(s, SideLeft, m) // leftDelta starts at zero: anchors do not contribute
}

// nack refuses a request from the left and remembers the answer.
// nack refuses a request from the left and remembers the answer. The answer
// goes back the way the request came (its subsession and sender), which is
// the left side unless the left side was reconfigured while the request
// waited in the queue (as in the Promela model).
func (a *Agent) nack(s *session, m *Message, from netip.Addr, r Reason, blocker ReqKey) {
	s.resolve(resolution{req: m.Req, kind: resNacked, reason: r, blocker: blocker})
	a.sendNack(s, m, from, r, blocker)
}

func (a *Agent) sendNack(s *session, m *Message, from netip.Addr, r Reason, blocker ReqKey) {
	n := a.msg(s, MsgNackLock, wire.Tuple{}, m.Req, m.RightAnchor)
	n.Reason, n.Blocker = r, blocker
	a.sendOn(s, m.Sub, from, n)
}

// sendOn sends m on subsession sub to peer, with that subsession's nonce.
func (a *Agent) sendOn(s *session, sub wire.Tuple, peer netip.Addr, m *Message) {
	m.Sub = sub
	if r, ok := a.subs[sub]; ok && r.id == s.id {
		m.Nonce = r.nonce
	}
	a.send(peer, m)
}

// sendRequestor sends an answer for the request holding the lock of the
// right side back the way that request came.
func (a *Agent) sendRequestor(s *session, m *Message) {
	if s.reqPeer.IsValid() {
		a.sendOn(s, s.reqSub, s.reqPeer, m)
		return
	}
	a.sendSide(s, SideLeft, m)
}

func (a *Agent) onAckLock(s *session, m *Message) {
	k := m.Req
	if l := s.left; l != nil && l.req == k {
		if l.stage != StageLocking {
			return // duplicate, or the granting synAck came first
		}
		if a.sameOrCrossing(s, l, m) {
			return
		}
		a.granted(s, l, m)
		return
	}
	if k.LeftAnchor == a.cfg.Self {
		// An answer to a request we already gave up: somebody holds a
		// lock for it. Release it (§3.6).
		if r, ok := s.resolved(k); ok && r.kind == resDone {
			return
		}
		if s.cancels[k] == nil {
			a.startCancel(s, k, m.RightAnchor, nil)
		}
		return
	}
	if s.lock != Unlocked && s.requestor == k {
		locking := s.lock == LockPending
		if locking {
			s.lock = Locked
			a.nackQueue(s)
		}
		f := *m
		f.Delta = m.Delta.Add(s.contribution(SideLeft))
		a.listSelf(&f)
		a.sendRequestor(s, &f)
		a.setTimer(s, TimerLease, k, a.cfg.LockLease)
		if locking {
			a.emit(KeepLock{Session: s.id, Req: k}) // after the answer: off the request's path
		}
		return
	}
	a.reject(RejectUnexpected, m, s.sides[SideRight].Peer, "ackLock for %s, lock %s by %s", k, s.lock, s.requestor)
}

// listSelf adds this middle agent in front of an ackLock's list of the old
// segment's middle agents (the left anchor compares it with the new chain:
// sameOrCrossing). A list that is full, or names this agent already, stays
// as it is and is marked partial.
func (a *Agent) listSelf(m *Message) {
	if m.Flags&FlagPartial != 0 {
		return
	}
	if len(m.Hops) >= wire.MaxHops || slices.Contains(m.Hops, a.cfg.Self) {
		m.Flags |= FlagPartial
		return
	}
	m.Hops = append([]netip.Addr{a.cfg.Self}, m.Hops...)
}

// sameOrCrossing is the left anchor's check of its new chain against the
// old segment, which the ackLock lists (listSelf), before it sets the new
// path up. A host holds one state per session tuple, so a middlebox
// cannot be on the old and the new path at once: the new path through it
// would replace the old path's state there while the old path still
// carries the session (docs/protocol.md, "A middlebox on both paths").
// If the new chain equals the old segment, nothing is to change: the
// request succeeds as unchanged. If it names a middlebox of the old
// segment otherwise, the request is refused (ReasonOnPath, naming it).
// Either way the segment is locked now: the locks are released with
// cancelLock (§3.6) and the result is reported once they are. It reports
// whether it took the request over. A partial list (FlagPartial) proves
// nothing: the request goes on, and a middlebox of the new path that
// holds the session refuses to join (onNewSyn).
func (a *Agent) sameOrCrossing(s *session, l *anchor, m *Message) bool {
	if len(l.chain) == 0 || m.Flags&FlagPartial != 0 || a.cfg.Faults&FaultNoPathCheck != 0 {
		return false
	}
	end := &Result{Session: s.id, Token: l.token, Req: l.req}
	note := ""
	if slices.Equal(l.chain, m.Hops) {
		end.Outcome, end.Unchanged = Succeeded, true
		note = "unchanged: the new chain is the old segment"
	} else {
		for _, h := range l.chain {
			if slices.Contains(m.Hops, h) {
				end.Outcome, end.Reason, end.Hop = Refused, ReasonOnPath, h
				note = "refused: " + h.String() + " is on the old segment"
				break
			}
		}
		if end.Outcome == 0 {
			return false
		}
	}
	a.cancelTimer(s, TimerRequest, l.req)
	s.lock = Locked
	l.delta, l.peerWS = m.Delta, m.WScale
	a.nackQueue(s)
	l.stage = StageCancelling
	a.progress(s, l.req, RoleLeftAnchor, StageCancelling, note)
	a.startCancel(s, l.req, l.rightAnchor, l)
	s.cancels[l.req].end = end
	return true
}

// granted is the left anchor's step when the right anchor grants its
// request: by the ackLock, or by the synAck that answers the early SYN
// (FlagGrant), whichever comes first. Both carry leftDelta and the right
// anchor's window scale.
func (a *Agent) granted(s *session, l *anchor, m *Message) {
	a.cancelTimer(s, TimerRequest, l.req)
	s.lock = Locked
	l.delta, l.peerWS = m.Delta, m.WScale
	a.nackQueue(s)
	a.beginSetup(s, l)
}

// nackQueue refuses every blocked request: the subsession is now locked (§3.2).
func (a *Agent) nackQueue(s *session) {
	q := s.queue
	s.queue = nil
	for _, b := range q {
		if b.local != nil {
			a.emit(Result{Session: s.id, Token: b.local.token, Req: b.local.req, Outcome: Refused,
				Reason: ReasonLocked, Blocker: s.requestor})
			continue
		}
		a.nack(s, b.msg, b.from, ReasonLocked, s.requestor)
	}
}

// releaseQueue lets the first blocked request go on once the subsession is
// unlocked (§3.2: the unblocked request is now the rightmost one).
func (a *Agent) releaseQueue(s *session) {
	for s.lock == Unlocked && len(s.queue) > 0 {
		b := s.queue[0]
		s.queue = s.queue[1:]
		if b.local != nil {
			if s.left != nil {
				a.emit(Result{Session: s.id, Token: b.local.token, Req: b.local.req, Outcome: Refused,
					Reason: ReasonBusy, Blocker: s.left.req})
				continue
			}
			a.startLeft(s, b.local)
			continue
		}
		a.onRequestLock(s, b.msg, b.from, true)
	}
}

func (a *Agent) onNackLock(s *session, m *Message) {
	k := m.Req
	if l := s.left; l != nil && l.req == k {
		if l.stage != StageLocking {
			return // stale
		}
		a.cancelTimer(s, TimerRequest, k)
		s.lock, s.requestor = Unlocked, ReqKey{}
		a.finishLeft(s, Refused, m.Reason, m.Blocker)
		a.releaseQueue(s)
		return
	}
	if s.lock == LockPending && s.requestor == k {
		s.lock, s.requestor = Unlocked, ReqKey{}
		a.cancelTimer(s, TimerLease, k)
		s.resolve(resolution{req: k, kind: resNacked, reason: m.Reason, blocker: m.Blocker})
		f := *m
		a.sendRequestor(s, &f)
		a.releaseQueue(s)
		return
	}
	if k.LeftAnchor != a.cfg.Self {
		a.reject(RejectUnexpected, m, s.sides[SideRight].Peer, "nackLock for %s, lock %s by %s", k, s.lock, s.requestor)
	}
}

// finishLeft ends the left anchor's part in its request and reports it.
func (a *Agent) finishLeft(s *session, o Outcome, r Reason, blocker ReqKey) {
	a.finishLeftWith(s, Result{Outcome: o, Reason: r, Blocker: blocker})
}

// finishLeftWith is finishLeft with the whole result (Unchanged, Hop).
func (a *Agent) finishLeftWith(s *session, res Result) {
	l := s.left
	s.left = nil
	if ref, ok := a.subs[l.newSub]; ok && l.stage == StageLocking && ref.id == s.id {
		delete(a.subs, l.newSub) // the early SYN's subsession, never installed
	}
	kind := resDone
	if res.Outcome != Succeeded {
		kind = resNacked
	}
	s.resolve(resolution{req: l.req, kind: kind, reason: res.Reason, blocker: res.Blocker})
	l.stage = StageDone
	a.progress(s, l.req, RoleLeftAnchor, StageDone, res.Outcome.String()+": "+res.Reason.String())
	res.Session, res.Token, res.Req = s.id, l.token, l.req
	res.Unconfirmed, res.Resumed = l.unconfirmed, l.resumed
	a.emit(res)
}

func (a *Agent) onLease(s *session, k ReqKey) {
	if s.joinFailed && s.joinReq == k {
		// A refused new path that nobody cancelled: free the hosts
		// after this one (best effort) and leave.
		c := a.msg(s, MsgCancelLock, wire.Tuple{}, s.joinReq, s.joinRight)
		c.Flags = FlagNewPath
		a.sendSide(s, SideRight, c)
		a.emit(FreeSession{Session: s.id})
		a.drop(s)
		return
	}
	if r := s.right; r != nil && r.req == k && (r.stage == StageWaitSyn || r.stage == StageWaitAck) {
		a.releaseRight(s, r, resExpired)
		return
	}
	if td := s.teardown; td != nil && td.req == k && td.fins[0] && td.fins[1] && s.left == nil && s.right == nil {
		// A middle agent of an old path that passed both anchors' fins
		// but not both finAcks, and nothing of the request for a lease
		// since: every copy of a finAck was lost on one of its hops, or
		// the tombs that answer the fins are gone. Each anchor sent its
		// fin only once everything it had sent on the old path was
		// acknowledged (§3.5), so the old path carries nothing more: it
		// leaves the session, as after the finAcks (onLinger). Without
		// this it kept the session until the idle timeout, with nothing
		// crossing it (TestControlLoss, seen once in CI).
		a.progress(s, k, RoleMiddle, StageDone, "old path torn down (finAcks lost)")
		s.resolve(resolution{req: k, kind: resDone})
		a.emit(FreeSession{Session: s.id})
		a.drop(s)
		return
	}
	if s.lock != Unlocked && s.requestor == k && s.left == nil {
		if s.lock == Locked {
			a.emit(KeepLock{Session: s.id}) // released
		}
		s.lock, s.requestor = Unlocked, ReqKey{}
		s.resolve(resolution{req: k, kind: resExpired})
		a.progress(s, k, RoleMiddle, StageDone, "lock lease expired")
		a.releaseQueue(s)
	}
}

// ---- §3.6 cancellation ----

func (a *Agent) startCancel(s *session, k ReqKey, ra netip.Addr, l *anchor) {
	j := &cancelJob{req: k, rightAnchor: ra, anchor: l}
	s.cancels[k] = j
	a.sendCancel(s, j)
}

func (a *Agent) sendCancel(s *session, j *cancelJob) {
	a.sendSide(s, SideRight, a.msg(s, MsgCancelLock, wire.Tuple{}, j.req, j.rightAnchor))
	j.tries++
	a.setTimer(s, TimerCancel, j.req, a.backoff(j.tries))
}

func (a *Agent) cancelDone(s *session, j *cancelJob) {
	delete(s.cancels, j.req)
	a.cancelTimer(s, TimerCancel, j.req)
	if l := j.anchor; l != nil && s.left == l {
		s.lock, s.requestor = Unlocked, ReqKey{}
		switch {
		case j.end != nil:
			a.finishLeftWith(s, *j.end)
		case l.aborted:
			a.finishLeft(s, Failed, ReasonAborted, ReqKey{})
		default:
			a.finishLeft(s, Failed, ReasonSetupFailed, ReqKey{})
		}
		a.releaseQueue(s)
	}
}

// onProceed ends the wait of a gated request: switch, or abandon the new
// path as when it does not answer (§3.6).
func (a *Agent) onProceed(e Proceed) {
	s := a.sessions[e.Session]
	if s == nil {
		return
	}
	l := s.left
	if l == nil || l.req != e.Req || l.stage != StageSettingUp || !l.gated {
		return
	}
	l.gated = false
	a.cancelTimer(s, TimerGate, l.req)
	if e.Abort != "" {
		a.progress(s, l.req, RoleLeftAnchor, StageCancelling, "aborted: "+e.Abort)
		l.aborted = true
		a.abortSetup(s, l)
		return
	}
	a.switchAndAck(s, l)
}

// abortSetup gives up a new path that does not answer (§3.6): the session
// stays on the old path and every lock is released with cancelLock.
func (a *Agent) abortSetup(s *session, l *anchor) {
	a.dropNewPath(s, l, "new path does not answer", nil)
}

// dropNewPath abandons the new path being set up (§3.6): the session stays
// on the old path, the middleboxes that joined the new path are freed
// (best effort), and every lock is released with cancelLock; end, if set,
// is what the request reports then (cancelJob.end).
func (a *Agent) dropNewPath(s *session, l *anchor, note string, end *Result) {
	a.cancelTimer(s, TimerSyn, l.req)
	// Best effort: free the middleboxes that joined the new path.
	c := a.msg(s, MsgCancelLock, l.newSub, l.req, l.rightAnchor)
	c.Flags = FlagNewPath
	a.send(l.newPeer, c)
	delete(a.subs, l.newSub)
	a.emit(RemoveSubsession{Session: s.id, Side: SideRight, Sub: l.newSub})
	l.stage = StageCancelling
	a.progress(s, l.req, RoleLeftAnchor, StageCancelling, note)
	a.startCancel(s, l.req, l.rightAnchor, l)
	s.cancels[l.req].end = end
}

func (a *Agent) onCancelLock(s *session, m *Message) {
	k := m.Req
	if m.Flags&FlagNewPath != 0 {
		// A new path that will not be used: a joined middlebox frees it.
		if s.joinReq == k && s.sides[SideRight] != nil {
			f := *m
			a.sendSide(s, SideRight, &f)
			a.emit(FreeSession{Session: s.id})
			a.drop(s)
		} else if r := s.right; r != nil && r.req == k && r.stage != StageTwoPath {
			a.releaseRight(s, r, resCancelled)
		}
		return
	}
	if r := s.right; r != nil && r.req == k {
		if r.stage == StageTwoPath {
			a.reject(RejectUnexpected, m, s.sides[SideLeft].Peer, "cancelLock after the switch")
			return
		}
		a.releaseRight(s, r, resCancelled)
		a.sendSide(s, SideLeft, a.msg(s, MsgAckCancel, wire.Tuple{}, k, m.RightAnchor))
		return
	}
	if m.RightAnchor == a.cfg.Self || s.sides[SideRight] == nil {
		s.resolve(resolution{req: k, kind: resCancelled})
		a.sendSide(s, SideLeft, a.msg(s, MsgAckCancel, wire.Tuple{}, k, m.RightAnchor))
		return
	}
	held := s.lock != Unlocked && s.requestor == k && s.left == nil
	r, ok := s.resolved(k)
	if held || ok && r.kind == resCancelled {
		if held {
			if s.lock == Locked {
				a.emit(KeepLock{Session: s.id}) // released
			}
			s.lock, s.requestor = Unlocked, ReqKey{}
			a.cancelTimer(s, TimerLease, k)
			s.resolve(resolution{req: k, kind: resCancelled})
		}
		f := *m
		a.sendSide(s, SideRight, &f)
		a.releaseQueue(s)
		return
	}
	// The request never got past this agent: nothing to the right holds it.
	a.sendSide(s, SideLeft, a.msg(s, MsgAckCancel, wire.Tuple{}, k, m.RightAnchor))
}

// releaseRight abandons the right anchor's part in a request that never
// switched to the new path.
func (a *Agent) releaseRight(s *session, r *anchor, kind resKind) {
	if r.newSub.Src.IsValid() {
		delete(a.subs, r.newSub)
		a.emit(RemoveSubsession{Session: s.id, Side: SideLeft, Sub: r.newSub})
	}
	a.cancelTimer(s, TimerLease, r.req)
	delete(a.rightReq, r.req)
	s.right = nil
	s.resolve(resolution{req: r.req, kind: kind})
	a.progress(s, r.req, RoleRightAnchor, StageDone, "released")
}

func (a *Agent) onAckCancel(s *session, m *Message) {
	k := m.Req
	if j := s.cancels[k]; j != nil {
		a.cancelDone(s, j)
		return
	}
	if r, ok := s.resolved(k); ok && r.kind == resCancelled && s.sides[SideLeft] != nil && k.LeftAnchor != a.cfg.Self {
		f := *m
		a.sendSide(s, SideLeft, &f)
	}
}

// ---- §3.1, §3.3: the new path ----

func (a *Agent) allocPort(dst netip.Addr, dport uint16) wire.Tuple {
	for i := 0; i < int(a.cfg.PortCount); i++ {
		p := a.cfg.PortBase + a.nextPort
		a.nextPort = (a.nextPort + 1) % a.cfg.PortCount
		t := wire.Tuple{Src: a.cfg.Self, Dst: dst, SrcPort: p, DstPort: dport}
		if _, used := a.subs[t]; !used {
			return t
		}
	}
	// Every port is in use towards dst: reuse (the datapath refuses it).
	return wire.Tuple{Src: a.cfg.Self, Dst: dst, SrcPort: a.cfg.PortBase, DstPort: dport}
}

// beginSetup is the left anchor's step once the segment is locked: send
// the SYN carrying the address list and install the new subsession.
//
// The SYN goes first: installing takes the agent a few map operations,
// and nothing needs the subsession at this host before the SYN-ACK, which
// this agent handles after this step. (The right anchor, in onNewSyn,
// installs before it answers: the left anchor's first packets on the new
// path may follow the SYN-ACK at once.)
//
// After an early SYN (sendEarlySyn) the subsession is the one that SYN
// named; if its SYN-ACK has come, the new path is up and the anchor goes
// on at once (newPathUp); otherwise the early SYN was the first try, and
// TimerSyn sends it again if its SYN-ACK does not come (usually it is on
// its way: the right anchor answers right after its ackLock).
func (a *Agent) beginSetup(s *session, l *anchor) {
	side := s.sides[SideRight]
	early := l.newSub.Src.IsValid()
	if !early {
		hops := append(append([]netip.Addr(nil), l.chain...), l.rightAnchor)
		l.newPeer = hops[0]
		l.newSub = a.allocPort(l.newPeer, s.tuple.DstPort)
		a.subs[l.newSub] = subRef{id: s.id, side: SideRight, peer: l.newPeer, nonce: side.Nonce}
	}
	// §3.4: incoming data on the new path gets what the deleted
	// middleboxes added, on top of what this side already applied.
	l.newDelta = side.Delta.Add(l.delta)
	l.stage, l.tries = StageSettingUp, 0
	add := AddSubsession{Session: s.id, Side: SideRight, Sub: l.newSub, Peer: l.newPeer, Delta: l.newDelta,
		WScaleIn: l.peerWS, WScaleOut: side.PeerWScale, Nonce: side.Nonce,
		Req: l.req, RightAnchor: l.rightAnchor, OldNonce: side.Nonce}
	if l.synAcked {
		a.emit(add)
		a.progress(s, l.req, RoleLeftAnchor, StageSettingUp, "leftDelta "+l.delta.String()+"; early SYN answered")
		a.newPathUp(s, l)
		return
	}
	if early {
		l.tries = 1
		a.setTimer(s, TimerSyn, l.req, a.backoff(l.tries))
	} else {
		a.sendSyn(s, l)
	}
	a.emit(add)
	a.progress(s, l.req, RoleLeftAnchor, StageSettingUp, "leftDelta "+l.delta.String())
}

func (a *Agent) sendSyn(s *session, l *anchor) {
	m := a.msg(s, MsgSyn, l.newSub, l.req, l.rightAnchor)
	// The addresses after the receiver, ending with the right anchor; none
	// when the receiver is the right anchor.
	m.Hops = append(append([]netip.Addr(nil), l.chain...), l.rightAnchor)[1:]
	a.send(l.newPeer, m)
	l.tries++
	a.setTimer(s, TimerSyn, l.req, a.backoff(l.tries))
}

// onNewSyn handles a SYN on a subsession nobody knows yet: at the right
// anchor it completes the new path; elsewhere the agent joins it, unless
// the session crosses this host already (onPath: MessageIn.OnPath), which
// it then refuses to the left (refuseSyn).
func (a *Agent) onNewSyn(from netip.Addr, m *Message, onPath bool) {
	if m.Sub.Dst != a.cfg.Self || m.Sub.Src != from {
		a.reject(RejectWrongPeer, m, from, "syn for %s", m.Sub)
		return
	}
	if m.RightAnchor == a.cfg.Self {
		id, ok := a.rightReq[m.Req]
		if !ok {
			if len(m.Hops) == 0 && from == m.Req.LeftAnchor {
				a.keepEarlySyn(from, m)
				return
			}
			a.reject(RejectUnexpected, m, from, "syn for %s: not locked here", m.Req)
			return
		}
		a.acceptSyn(a.sessions[id], from, m)
		return
	}
	if len(m.Hops) == 0 {
		a.reject(RejectMalformed, m, from, "syn with no hops for a middlebox")
		return
	}
	if onPath {
		a.refuseSyn(from, m, ReasonOnPath, a.cfg.Self)
		return
	}
	a.nextJoin++
	s := a.newSession(a.nextJoin, m.Session, m.Nonce)
	s.joinReq, s.joinRight = m.Req, m.RightAnchor
	next := m.Hops[0]
	left := SideInfo{Peer: from, Sub: m.Sub, Nonce: m.Nonce}
	right := SideInfo{Peer: next, Sub: a.allocPort(next, m.Session.DstPort), Nonce: m.Nonce}
	s.sides[SideLeft], s.sides[SideRight] = &left, &right
	a.subs[left.Sub] = subRef{id: s.id, side: SideLeft, peer: from, nonce: m.Nonce}
	a.subs[right.Sub] = subRef{id: s.id, side: SideRight, peer: next, nonce: m.Nonce}
	// The SYN goes on first, as at the left anchor (beginSetup): new-path
	// packets reach this host only after the SYN-ACK, which this agent
	// passes back after this step.
	a.forwardSyn(s, m)
	a.emit(JoinSession{Session: s.id, Tuple: s.tuple, Nonce: s.nonce, Left: left, Right: right, Req: m.Req})
	a.progress(s, m.Req, RoleNewHop, StageSettingUp, "joined")
}

// acceptSyn is the right anchor's part of the new path's set-up, once it
// holds the lock for the SYN's request: install the new subsession and
// answer with the SYN-ACK (§3.1). Model: agent.pml acceptSyn.
func (a *Agent) acceptSyn(s *session, from netip.Addr, m *Message) {
	r := s.right
	if r == nil || m.Nonce != r.anchorNonce {
		a.reject(RejectNonce, m, from, "session %d", s.id)
		return
	}
	if r.stage != StageWaitSyn {
		a.reject(RejectUnexpected, m, from, "syn for %s in stage %s", m.Req, r.stage)
		return
	}
	if _, used := a.subs[m.Sub]; used {
		a.reject(RejectUnexpected, m, from, "syn for %s: subsession %s in use", m.Req, m.Sub)
		return
	}
	side := s.sides[SideLeft]
	r.newSub, r.newPeer = m.Sub, from
	r.newDelta = side.Delta.Add(r.delta)
	a.subs[m.Sub] = subRef{id: s.id, side: SideLeft, peer: from, nonce: m.Nonce}
	// Armed: the first packet on the new path switches this side even
	// if the ACK is lost.
	a.emit(AddSubsession{Session: s.id, Side: SideLeft, Sub: m.Sub, Peer: from, Delta: r.newDelta,
		WScaleIn: r.peerWS, WScaleOut: side.PeerWScale, Armed: true, Nonce: m.Nonce,
		Req: r.req, RightAnchor: a.cfg.Self, OldNonce: side.Nonce})
	r.stage = StageWaitAck
	a.progress(s, r.req, RoleRightAnchor, StageWaitAck, "")
	a.setTimer(s, TimerLease, r.req, a.cfg.LockLease)
	a.sendSynAck(s, r, from, m.Sub)
}

// sendSynAck sends the right anchor's synAck (synAckMsg) to the new path's
// first hop back.
func (a *Agent) sendSynAck(s *session, r *anchor, to netip.Addr, sub wire.Tuple) {
	a.send(to, a.synAckMsg(s, r, sub))
}

// synAckMsg is the right anchor's synAck on the new subsession sub. On a
// direct new path (the SYN came from the left anchor itself: an early
// SYN) it also grants the lock (FlagGrant) with what the ackLock carries:
// leftDelta, gathered by requestLock on its way (forwardRequest), and our
// window scale. The left anchor, whose early SYN it answers, then goes on
// one hop after our grant instead of the ackLock's two back along the old
// path; the ackLock still goes, and locks the old path's middle agents on
// its way (docs/protocol.md, "The granting SYN-ACK"). Model: agent.pml
// sendSynAck. A right anchor resumed after its agent restarted (resume)
// does not grant: the leftDelta was the old agent's, not kept in the
// datapath, and a grant with none would give the left anchor a wrong
// delta; that left anchor waits for the ackLock, which a retransmitted
// requestLock brings (a duplicate at the right anchor).
func (a *Agent) synAckMsg(s *session, r *anchor, sub wire.Tuple) *Message {
	m := a.msg(s, MsgSynAck, sub, r.req, a.cfg.Self)
	if r.newPeer == r.req.LeftAnchor && !r.resumed {
		m.Flags |= FlagGrant
		m.Delta = r.grantDelta
		m.WScale = s.sides[SideLeft].SendWScale
	}
	return m
}

// keepEarlySyn keeps the early SYN of a request whose requestLock has not
// come yet (sendEarlySyn). A request heard of here already (its
// requestLock came and it is resolved, or its early SYN is kept) makes the
// SYN a replay or a stale retransmission: refused (replay.go). The store is
// bounded: expired entries go first; when it is still full the SYN is
// refused (the left anchor sends it again once it holds the lock).
func (a *Agent) keepEarlySyn(from netip.Addr, m *Message) {
	if _, ok := a.earlySyns[m.Req]; ok {
		a.reject(RejectUnexpected, m, from, "early syn for %s: kept already", m.Req)
		return
	}
	if a.knownReq(m.Req) {
		a.reject(RejectReplay, m, from, "early syn for %s: request heard of already", m.Req)
		return
	}
	if len(a.earlySyns) >= maxEarlySyns {
		for k, e := range a.earlySyns {
			if a.now-e.at >= a.cfg.LockLease {
				delete(a.earlySyns, k)
			}
		}
		if len(a.earlySyns) >= maxEarlySyns {
			a.reject(RejectUnexpected, m, from, "early syn for %s: %d kept already", m.Req, len(a.earlySyns))
			return
		}
	}
	a.heardOf(m.Req)
	a.earlySyns[m.Req] = earlySyn{from: from, m: m, at: a.now}
}

// takeEarlySyn removes and returns the early SYN of request k, if one is
// kept and has not expired.
func (a *Agent) takeEarlySyn(k ReqKey) (earlySyn, bool) {
	e, ok := a.earlySyns[k]
	if !ok {
		return e, false
	}
	delete(a.earlySyns, k)
	return e, a.now-e.at < a.cfg.LockLease
}

// refuseSyn answers a new path's SYN with a synAck that refuses it
// (FlagRefuse, reason r, naming the host by that refused in its list),
// back the way the SYN came: this host will not join. The hosts that joined before it pass the refusal on and leave
// (onSynAck); the left anchor abandons the new path and cancels (§3.6).
// Stateless: a retransmitted SYN gets the same answer.
func (a *Agent) refuseSyn(from netip.Addr, m *Message, r Reason, by netip.Addr) {
	n := &Message{Type: MsgSynAck, Flags: FlagRefuse, Reason: r, Nonce: m.Nonce, Sub: m.Sub,
		Session: m.Session, Req: m.Req, RightAnchor: m.RightAnchor, Hops: []netip.Addr{by}}
	a.send(from, n)
}

// onJoinFailed: the agent could not install a session this agent joined
// (JoinFailed). The SYN went on already (onNewSyn sends it first): the
// left anchor learns of the refusal and abandons the new path
// (dropNewPath). The session stays, with no datapath state: a SYN sent
// again (the refusal lost) is refused again (onSynDup) rather than joined
// and passed on, and the left anchor's cancelLock on the new path passes
// through it to free the hosts after it and the right anchor
// (onCancelLock), which are thus released only once the left anchor has
// let the request go. Should that cancelLock never come, the lease sends
// it on and forgets the session (onLease).
func (a *Agent) onJoinFailed(e JoinFailed) {
	s := a.sessions[e.Session]
	if s == nil || s.joinReq.IsZero() || s.joinFailed || s.sides[SideLeft] == nil || s.sides[SideRight] == nil {
		return
	}
	s.joinFailed, s.failedAt = true, a.cfg.Self
	a.progress(s, s.joinReq, RoleNewHop, StageDone, "refused: the datapath could not install the session")
	a.refuseJoin(s)
	a.setTimer(s, TimerLease, s.joinReq, a.cfg.LockLease)
}

// refuseJoin sends the refusal of a joined session whose new path failed
// to its left, naming the host whose join failed.
func (a *Agent) refuseJoin(s *session) {
	left := s.sides[SideLeft]
	a.refuseSyn(left.Peer, &Message{Nonce: left.Nonce, Sub: left.Sub, Session: s.tuple, Req: s.joinReq,
		RightAnchor: s.joinRight}, ReasonSetupFailed, s.failedAt)
}

func (a *Agent) forwardSyn(s *session, m *Message) {
	f := *m
	f.Hops = m.Hops[1:]
	a.sendSide(s, SideRight, &f)
}

// onSynDup handles a retransmitted SYN: answer or forward it again.
func (a *Agent) onSynDup(s *session, ref subRef, m *Message) {
	if r := s.right; r != nil && r.req == m.Req && r.newSub == m.Sub {
		a.sendSynAck(s, r, r.newPeer, m.Sub)
		return
	}
	if s.joinFailed && s.joinReq == m.Req && ref.side == SideLeft {
		a.refuseJoin(s) // the refusal was lost: the same answer
		return
	}
	if s.joinReq == m.Req && ref.side == SideLeft && len(m.Hops) > 0 {
		a.forwardSyn(s, m)
		return
	}
	a.reject(RejectUnexpected, m, ref.peer, "syn for %s", m.Req)
}

func (a *Agent) onSynAck(s *session, ref subRef, m *Message) {
	if l := s.left; l != nil && l.req == m.Req && l.newSub == m.Sub {
		if m.Flags&FlagRefuse != 0 {
			// A host of the new path refused to join it (refuseSyn).
			if l.stage == StageSettingUp && !l.gated {
				// A host that carries the session already: nothing
				// changed, the request does not fit the path (refused).
				// One that could not install it: the new path failed.
				end := &Result{Outcome: Failed, Reason: ReasonSetupFailed}
				if m.Reason == ReasonOnPath {
					end = &Result{Outcome: Refused, Reason: ReasonOnPath}
				}
				if len(m.Hops) == 1 {
					end.Hop = m.Hops[0] // the host that refused
				}
				a.dropNewPath(s, l, "new path refused: "+m.Reason.String(), end)
			}
			return
		}
		switch {
		case l.stage == StageLocking && m.Flags&FlagGrant != 0 && len(l.chain) == 0 &&
			ref.peer == l.rightAnchor && s.lock == LockPending && s.requestor == l.req:
			// The early SYN's answer, granting the lock (synAckMsg): the
			// new path is up and the segment ours.
			l.synAcked = true
			a.granted(s, l, m)
		case l.stage == StageLocking:
			l.synAcked = true // the early SYN's answer: used once the lock is held
		case l.stage == StageSettingUp && l.gated:
			// A retransmitted SYN-ACK while the agent works: it waits.
		case l.stage == StageSettingUp:
			a.newPathUp(s, l)
		case l.stage == StageTwoPath:
			a.sendAck(s, l) // our ACK was lost
		}
		return
	}
	if s.joinReq == m.Req && ref.side == SideRight {
		if s.joinFailed {
			return // refused already: the new path will not be used
		}
		f := *m
		a.sendSide(s, SideLeft, &f)
		if m.Flags&FlagRefuse != 0 {
			// A host after us refused the new path: it will never be
			// used.
			a.progress(s, m.Req, RoleNewHop, StageDone, "new path refused further on: "+m.Reason.String())
			if m.Reason == ReasonOnPath {
				// It did not pass the SYN on: nothing after it to free.
				// Leave (the left anchor's cancelLock on the new path
				// would find nothing here to pass on to).
				a.emit(FreeSession{Session: s.id})
				a.drop(s)
				return
			}
			// Its join failed after it passed the SYN on: stay, as it
			// does, for the left anchor's cancelLock on the new path to
			// pass through to the hosts after it (onJoinFailed).
			s.joinFailed, s.failedAt = true, m.Hops[0]
			a.setTimer(s, TimerLease, s.joinReq, a.cfg.LockLease)
		}
		return
	}
	a.reject(RejectUnexpected, m, ref.peer, "synAck for %s", m.Req)
}

// newPathUp is the left anchor's step when the new path has answered in
// settingUp: wait for the agent (a gated request), or switch and ACK.
func (a *Agent) newPathUp(s *session, l *anchor) {
	a.cancelTimer(s, TimerSyn, l.req)
	if l.gate {
		l.gated = true
		a.setTimer(s, TimerGate, l.req, a.cfg.GateTimeout)
		a.progress(s, l.req, RoleLeftAnchor, StageSettingUp, "new path ready; waiting for the agent")
		a.emit(NewPathReady{Session: s.id, Token: l.token, Req: l.req, RightAnchor: l.rightAnchor,
			Chain: append([]netip.Addr(nil), l.chain...), OldPeer: s.sides[SideRight].Peer, NewPeer: l.newPeer,
			OldSub: s.sides[SideRight].Sub, NewSub: l.newSub, LeftDelta: l.delta})
		return
	}
	a.switchAndAck(s, l)
}

// switchAndAck is the left anchor's switch to the new path. It switches
// before the ACK goes: an agent that restarts in between resumes a
// switched side (the right anchor's armed side follows the first packet),
// never an ACKed one that did not switch.
func (a *Agent) switchAndAck(s *session, l *anchor) {
	a.switchPaths(s, l, SideRight)
	a.sendAck(s, l)
}

// sendAck sends the new path's ACK to the first new hop.
func (a *Agent) sendAck(s *session, l *anchor) {
	a.send(l.newPeer, a.msg(s, MsgAck, l.newSub, l.req, l.rightAnchor))
}

func (a *Agent) onAck(s *session, ref subRef, m *Message) {
	if r := s.right; r != nil && r.req == m.Req && r.newSub == m.Sub {
		if r.stage == StageWaitAck {
			a.switchPaths(s, r, SideLeft)
		}
		return
	}
	if s.joinReq == m.Req && ref.side == SideLeft && !s.joinFailed {
		f := *m
		a.sendSide(s, SideRight, &f)
		return
	}
	a.reject(RejectUnexpected, m, ref.peer, "ack for %s", m.Req)
}

// switchPaths starts an anchor's two-path phase (§3.5): new data goes on
// the new path from now on; the window is clamped (§5.3).
func (a *Agent) switchPaths(s *session, an *anchor, side Side) {
	if an.stage == StageTwoPath {
		return
	}
	if an.role == RoleRightAnchor {
		a.cancelTimer(s, TimerLease, an.req)
	}
	an.stage, an.tries = StageTwoPath, 0
	a.emit(StartTwoPath{Session: s.id, Side: side, Old: s.sides[side].Sub, New: an.newSub})
	a.emit(SetWindowClamp{Session: s.id, Side: side, Bytes: a.cfg.WindowClamp})
	a.progress(s, an.req, an.role, StageTwoPath, "")
}

// ---- §3.5: two paths and teardown ----

// anchorSide returns the anchor reconfiguring side, if any.
func (s *session) anchorSide(side Side) *anchor {
	if side == SideRight {
		return s.left
	}
	return s.right
}

func (a *Agent) anchorFor(s *session, k ReqKey) *anchor {
	if s.left != nil && s.left.req == k {
		return s.left
	}
	if s.right != nil && s.right.req == k {
		return s.right
	}
	return nil
}

func sideOf(an *anchor) Side {
	if an.role == RoleLeftAnchor {
		return SideRight
	}
	return SideLeft
}

func (a *Agent) onProgress(e TwoPathProgress) {
	s := a.sessions[e.Session]
	if s == nil {
		return
	}
	an := s.anchorSide(e.Side)
	if an == nil {
		return
	}
	if an.role == RoleRightAnchor && an.stage == StageWaitAck {
		// The datapath switched by itself on the first new-path packet.
		a.switchPaths(s, an, SideLeft)
	}
	if an.stage != StageTwoPath {
		return
	}
	an.vars, an.haveVars = e.Vars, true
	a.evaluate(s, an)
}

// evaluate sends the UDP FIN once everything sent on the old path is
// acknowledged, answers the other anchor's FIN once everything it sent is
// received and acknowledged, and completes when both hold.
func (a *Agent) evaluate(s *session, an *anchor) {
	if an.stage != StageTwoPath || !an.haveVars {
		return // the datapath reports the cut-off right after StartTwoPath
	}
	if !an.finSent && an.vars.SendDone() {
		an.finSent, an.tries = true, 0
		a.sendFin(s, an)
	}
	if an.finVia != 0 && !an.finAckSent && an.vars.RecvDone(an.peerCutoff, true) {
		an.finAckSent = true
		a.sendFinAck(s, an, an.finVia)
	}
	if an.finAcked && an.finAckSent {
		a.complete(s, an)
	}
}

// waitFin arms TimerFin once our fin is answered while the other anchor's
// has not come (see TimerFin: the probes).
func (a *Agent) waitFin(s *session, an *anchor) {
	if an.stage == StageTwoPath && an.finAcked && an.finVia == 0 {
		a.setTimer(s, TimerFin, an.req, a.backoff(an.tries+1))
	}
}

func (a *Agent) oldPathMsg(s *session, an *anchor, t MsgType) *Message {
	side := sideOf(an)
	m := a.msg(s, t, s.sides[side].Sub, an.req, an.rightAnchor)
	if an.role == RoleRightAnchor {
		m.RightAnchor = a.cfg.Self
	}
	if side == SideLeft {
		m.Flags = FlagLeftward // from the right anchor towards the left one
	}
	return m
}

// sendFin sends our fin (§3.5) on the old path, where its middle agents
// pass it and learn that the old path is being torn down, and, when the new
// path is direct, a copy on the new subsession straight to the other
// anchor: that copy and its answer skip the old path's middleboxes, so the
// two-path phase ends two hops sooner (docs/protocol.md, "Completion").
func (a *Agent) sendFin(s *session, an *anchor) {
	m := a.oldFin(s, an)
	if an.direct() {
		// The copy first: each send carries its datagram through the
		// network stack before it returns (some 50 µs between lab
		// namespaces), and the copy is the one that ends the exchange.
		c := *m
		a.sendNew(an, &c)
	}
	a.sendSide(s, sideOf(an), m)
	an.tries++
	a.setTimer(s, TimerFin, an.req, a.backoff(an.tries))
}

// oldFin is our fin on the old path, carrying our cut-off in our session
// space.
func (a *Agent) oldFin(s *session, an *anchor) *Message {
	m := a.oldPathMsg(s, an, MsgFin)
	m.Delta.Seq = an.vars.OldSent
	return m
}

// tombFin is a tomb's own fin again, flagged done, the way its old path
// runs towards the other anchor.
func (a *Agent) tombFin(s *session, t *tomb, rightAnchor netip.Addr) *Message {
	fin := a.msg(s, MsgFin, t.sub, t.req, rightAnchor)
	fin.Delta.Seq = t.cutoff
	fin.Flags = FlagDone
	if t.side == SideLeft {
		fin.Flags |= FlagLeftward
	}
	return fin
}

// sendNew sends m on the anchor's new subsession.
func (a *Agent) sendNew(an *anchor, m *Message) {
	m.Sub = an.newSub
	m.Nonce = a.subs[an.newSub].nonce
	a.send(an.newPeer, m)
}

// sendFinAck answers the other anchor's fin the ways it came (finVia).
func (a *Agent) sendFinAck(s *session, an *anchor, via uint8) {
	if via&viaNew != 0 { // first, as in sendFin
		a.sendNew(an, a.oldPathMsg(s, an, MsgFinAck))
	}
	if via&viaOld != 0 {
		a.sendSide(s, sideOf(an), a.oldPathMsg(s, an, MsgFinAck))
	}
}

func (a *Agent) onFin(s *session, ref subRef, m *Message) {
	if an := s.anchorSide(ref.side); an != nil && an.req == m.Req {
		if an.role == RoleRightAnchor && an.stage == StageWaitAck {
			a.switchPaths(s, an, SideLeft) // the left anchor switched: so do we
		}
		if an.stage != StageTwoPath {
			a.reject(RejectUnexpected, m, ref.peer, "fin for %s in stage %s", m.Req, an.stage)
			return
		}
		// The sender's cut-off in our session space: what arrives on the
		// new path gets newDelta, and the old path added the same.
		via := viaOld
		if m.Sub == an.newSub {
			via = viaNew
		}
		an.finVia |= via
		an.peerCutoff = m.Delta.Seq + an.newDelta.Seq
		if an.finAckSent {
			a.sendFinAck(s, an, via)
			return
		}
		a.evaluate(s, an)
		return
	}
	if a.passOldPath(s, ref, m) {
		s.teardown.fins[s.teardown.dir(m)] = true
		return
	}
	a.reject(RejectUnexpected, m, ref.peer, "fin for %s", m.Req)
}

func (a *Agent) onFinAck(s *session, ref subRef, m *Message) {
	if an := s.anchorSide(ref.side); an != nil && an.req == m.Req {
		if an.stage == StageTwoPath && m.Sub != an.newSub {
			an.finOldAcked = true
			a.cancelTimer(s, TimerOldFin, an.req)
		}
		if an.stage == StageTwoPath && an.finSent && !an.finAcked {
			an.finAcked = true
			a.cancelTimer(s, TimerFin, an.req)
			if !an.finOldAcked {
				// Answered on the direct new path first: the old path's
				// copy (or its answer) may be lost, and its middle agents
				// wait for both. (The TimerFin tries count on.)
				a.setTimer(s, TimerOldFin, an.req, a.backoff(an.tries))
			}
			a.evaluate(s, an)
			a.waitFin(s, an)
		} else if an.stage == StageTwoPath && an.finAcked && an.finVia == 0 {
			an.probes = 0 // the other anchor, or its tomb, is there
		}
		return
	}
	if a.passOldPath(s, ref, m) {
		td := s.teardown
		td.finAcks[td.dir(m)] = true
		if td.finAcks[0] && td.finAcks[1] {
			a.setTimer(s, TimerLinger, m.Req, a.cfg.Linger)
		}
		return
	}
	a.reject(RejectUnexpected, m, ref.peer, "finAck for %s", m.Req)
}

// passOldPath forwards a FIN or FIN-ACK through a middle agent of the old
// path (locked by the request, or pending for it: lockByTeardown).
func (a *Agent) passOldPath(s *session, ref subRef, m *Message) bool {
	if s.lock == Unlocked || s.requestor != m.Req || s.left != nil || s.sides[ref.side.Other()] == nil {
		return false
	}
	if a.lockByTeardown(s, m.Req) {
		defer a.emit(KeepLock{Session: s.id, Req: m.Req}) // after the fin: off its path
	}
	if s.teardown == nil || s.teardown.req != m.Req {
		s.teardown = &teardown{req: m.Req}
	}
	f := *m
	a.sendSide(s, ref.side.Other(), &f)
	a.setTimer(s, TimerLease, m.Req, a.cfg.LockLease)
	return true
}

// lockByTeardown takes a middle agent's lock that is still pending for
// request k when a fin or finAck of k passes, and reports whether it did:
// an anchor sends them only once the right anchor granted k, and with a
// granting synAck the anchors can be done with the lock phase before the
// ackLock, which locks this agent, has come (a lost ackLock is not sent
// again: the left anchor stopped retransmitting requestLock when it was
// granted). The queued requests are refused, as the ackLock would have
// refused them (§3.2). Model: agent.pml lockByTeardown.
func (a *Agent) lockByTeardown(s *session, k ReqKey) bool {
	if s.lock != LockPending || s.requestor != k {
		return false
	}
	s.lock = Locked
	a.nackQueue(s)
	return true
}

// complete ends the reconfiguration at an anchor: the new subsession is
// the side's subsession, the old one lingers to answer FINs, then goes.
func (a *Agent) complete(s *session, an *anchor) {
	side := sideOf(an)
	sd := s.sides[side]
	old := sd.Sub
	a.cancelTimer(s, TimerFin, an.req)
	a.emit(EndTwoPath{Session: s.id, Side: side, New: an.newSub})
	a.emit(SetWindowClamp{Session: s.id, Side: side, Bytes: 0})
	a.subs[old] = subRef{id: s.id, side: side, peer: sd.Peer, nonce: sd.Nonce, tomb: true}
	ra := an.rightAnchor
	if an.role == RoleRightAnchor {
		ra = a.cfg.Self
	}
	s.tombs = append(s.tombs, tomb{sub: old, side: side, req: an.req, cutoff: an.vars.OldSent,
		acked: an.finOldAcked, tries: an.tries, unconfirmed: an.unconfirmed, rightAnchor: ra, viaMiddles: !an.direct()})
	a.setTimer(s, TimerLinger, an.req, a.cfg.Linger)
	sd.Sub, sd.Peer, sd.Delta = an.newSub, an.newPeer, an.newDelta
	sd.Nonce = a.subs[an.newSub].nonce
	if an.role == RoleLeftAnchor {
		s.lock, s.requestor = Unlocked, ReqKey{}
		a.finishLeft(s, Succeeded, ReasonNone, ReqKey{})
		a.releaseQueue(s)
		return
	}
	an.stage = StageDone
	delete(a.rightReq, an.req)
	s.right = nil
	s.resolve(resolution{req: an.req, kind: resDone})
	note := ""
	if an.unconfirmed {
		note = "unconfirmed"
	}
	a.progress(s, an.req, RoleRightAnchor, StageDone, note)
}

// onFinsSeen sends the closed notice (FlagClosedFwd/Rev) on each side of
// s that completed a reconfiguration through middleboxes within the last
// Linger (it has a tomb): the FINs the datapath saw here went on the old
// path if they were sent before the cut-off, and the new path's
// middleboxes never saw them. The notice goes from the left anchor as an
// ack, from the right anchor as a synAck, along the new path, whose
// middleboxes record the FINs (MarkClosed) and pass it on; the other
// anchor drops it. Each anchor sends it, so one copy lost leaves the
// other; both lost, the middleboxes keep the session until their idle
// timeout, as before.
func (a *Agent) onFinsSeen(e FinsSeen) {
	s := a.sessions[e.Session]
	if s == nil {
		return
	}
	var flags uint8
	if e.Fwd {
		flags |= FlagClosedFwd
	}
	if e.Rev {
		flags |= FlagClosedRev
	}
	for i := range s.tombs {
		t := &s.tombs[i]
		if !t.viaMiddles || flags&^t.closed == 0 || s.sides[t.side] == nil {
			continue
		}
		t.closed |= flags
		typ := MsgAck
		if t.side == SideLeft {
			typ = MsgSynAck
		}
		m := a.msg(s, typ, wire.Tuple{}, t.req, t.rightAnchor)
		m.Flags = t.closed
		a.sendSide(s, t.side, m)
	}
}

// onClosedNotice handles a closed notice (onFinsSeen) at the hosts of the
// new path: a middlebox that joined it for the notice's request records
// the FINs and passes it on; the other anchor drops it.
func (a *Agent) onClosedNotice(s *session, ref subRef, m *Message) {
	rightward := m.Type == MsgAck
	if s.joinReq == m.Req && (ref.side == SideLeft) == rightward {
		f := *m
		a.sendSide(s, ref.side.Other(), &f)
		a.emit(MarkClosed{Session: s.id, Fwd: m.Flags&FlagClosedFwd != 0, Rev: m.Flags&FlagClosedRev != 0})
	}
}

// onTomb answers a retransmitted FIN on a torn-down old path.
func (a *Agent) onTomb(s *session, ref subRef, m *Message) {
	if m.Type == MsgFin {
		for i := range s.tombs {
			if t := &s.tombs[i]; t.sub == m.Sub && t.req == m.Req {
				f := a.msg(s, MsgFinAck, m.Sub, m.Req, m.RightAnchor)
				if t.side == SideLeft {
					f.Flags = FlagLeftward
				}
				a.send(ref.peer, f)
				if m.Flags&FlagDone == 0 && t.unconfirmed {
					// The other anchor may still wait for our fin (every
					// copy lost, we completed Unconfirmed): send it again.
					// A confirmed completion means it has our fin.
					a.send(ref.peer, a.tombFin(s, t, m.RightAnchor))
				}
				return
			}
		}
	}
	if m.Type == MsgAckLock {
		for _, t := range s.tombs {
			if t.sub == m.Sub && t.req == m.Req && t.side == SideRight {
				return // late: its granting synAck came first (synAckMsg)
			}
		}
	}
	if m.Type == MsgFinAck {
		for i := range s.tombs {
			if t := &s.tombs[i]; t.sub == m.Sub && t.req == m.Req && !t.acked {
				t.acked = true
				a.cancelTimer(s, TimerOldFin, t.req)
			}
		}
		return
	}
	a.reject(RejectUnexpected, m, ref.peer, "%s on a torn-down path", m.Type)
}

// onOldFin (TimerOldFin) sends our fin again on the old path, where it was
// not answered yet although the other anchor answered its copy on the
// direct new path: the old path's middle agents free the session once they
// have passed the finAcks both ways (onFinAck). Before completion the
// anchor sends it, after completion its tomb (with FlagDone: the other
// anchor has our fin). After MaxTries the middle agents' leases free them.
func (a *Agent) onOldFin(s *session, k ReqKey) {
	if an := a.anchorFor(s, k); an != nil && an.stage == StageTwoPath {
		if an.finOldAcked {
			return
		}
		if an.tries >= a.cfg.MaxTries {
			an.finOldAcked = true
			return
		}
		a.sendSide(s, sideOf(an), a.oldFin(s, an))
		an.tries++
		a.setTimer(s, TimerOldFin, k, a.backoff(an.tries))
		return
	}
	for i := range s.tombs {
		t := &s.tombs[i]
		if t.req != k || t.acked {
			continue
		}
		if t.tries >= a.cfg.MaxTries {
			t.acked = true
			return
		}
		ref, ok := a.subs[t.sub]
		if !ok {
			return
		}
		a.send(ref.peer, a.tombFin(s, t, t.rightAnchor))
		t.tries++
		a.setTimer(s, TimerOldFin, k, a.backoff(t.tries))
		return
	}
}

func (a *Agent) onLinger(s *session, k ReqKey) {
	if td := s.teardown; td != nil && td.req == k && s.left == nil && s.right == nil {
		// A middle agent of a torn-down old path: it left the session.
		a.progress(s, k, RoleMiddle, StageDone, "old path torn down")
		s.resolve(resolution{req: k, kind: resDone})
		a.emit(FreeSession{Session: s.id})
		a.drop(s)
		return
	}
	kept := s.tombs[:0]
	for _, t := range s.tombs {
		if t.req != k {
			kept = append(kept, t)
			continue
		}
		delete(a.subs, t.sub)
		a.cancelTimer(s, TimerOldFin, t.req)
		a.emit(RemoveSubsession{Session: s.id, Side: t.side, Sub: t.sub})
	}
	s.tombs = kept
}

// onNewSub screens a message that arrived on an anchor's new subsession,
// before the old one is gone: only the new path's own messages belong
// there. It reports whether to go on handling m.
func (a *Agent) onNewSub(s *session, ref subRef, m *Message) bool {
	switch m.Type {
	case MsgSyn, MsgSynAck, MsgAck:
		return true
	case MsgFin, MsgFinAck:
		// The copies on a direct new path (sendFin).
		if an := s.anchorSide(ref.side); an != nil && an.req == m.Req && an.newSub == m.Sub && an.direct() {
			return true
		}
	case MsgCancelLock:
		return m.Flags&FlagNewPath != 0
	case MsgRequestLock:
		if r := s.right; r != nil {
			// A middlebox of our new path wants a segment that ends at or
			// passes us before our old path is gone. The refusal is kept
			// (resolve), as every refusal: a copy of the request that
			// comes after our old path is gone gets the same answer, never
			// a forward that the right anchor could grant while the agents
			// on its way back have already let the request go (its
			// granting synAck skips them).
			// maxSeen too: a copy that comes after the kept answers have
			// moved on (historyLen) is still not newer than it.
			a.maxSeen(s, m.Req)
			s.resolve(resolution{req: m.Req, kind: resNacked, reason: ReasonBusy, blocker: r.req})
			n := a.msg(s, MsgNackLock, m.Sub, m.Req, m.RightAnchor)
			n.Reason, n.Blocker = ReasonBusy, r.req
			a.send(ref.peer, n)
			return false
		}
	}
	a.reject(RejectUnexpected, m, ref.peer, "%s on a new subsession", m.Type)
	return false
}
