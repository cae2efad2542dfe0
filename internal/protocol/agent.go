package protocol

import (
	"fmt"
	"net/netip"
	"time"

	"github.com/dysco/dysco/internal/wire"
)

// Config configures an Agent.
type Config struct {
	// Self is this agent's address: the one other agents name it by in
	// address lists and send control messages to.
	Self netip.Addr
	// Keys authenticate control messages (HMAC-SHA256): the first signs,
	// all verify (SetKeys changes them).
	Keys *Keys
	// Source returns the address a datagram to the agent at to leaves
	// from (the host's route to it chooses it): the MAC covers it, as the
	// receiver sees it. Nil: Self.
	Source func(to netip.Addr) netip.Addr
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
	// UDPDrain is how long a UDP anchor's old path must have been quiet
	// (no datagram received on it) since its switch before the anchor
	// ends its side of the two-path phase (udp.go). It must exceed the
	// longest time a datagram spends on the old path. Zero: 500 ms; at
	// most MaxUDPDrain.
	UDPDrain time.Duration
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
	// TriggerTokens is the number after which this agent numbers the
	// tokens of the requests it starts for triggers (TriggerAccepted);
	// zero means 1<<63, above the tokens an agent gives its own requests.
	// Agents whose tokens share one space (an agent's IPv4 and IPv6
	// halves) need ranges that do not meet.
	TriggerTokens uint64
	// Faults breaks the protocol on purpose (tests only).
	Faults Fault
}

// DefaultConfig returns the defaults for self and keys.
func DefaultConfig(self netip.Addr, k *Keys) Config {
	return Config{
		Self:        self,
		Keys:        k,
		RTO:         200 * time.Millisecond,
		MaxRTO:      3 * time.Second,
		MaxTries:    10,
		Linger:      10 * time.Second,
		LockLease:   2 * time.Minute,
		WindowClamp: 64 << 10,
		UDPDrain:    500 * time.Millisecond,
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
	// triggers are the triggers this agent sent, waiting for their
	// answers, by their keys (trigger.go).
	triggers map[ReqKey]*trigOut
	// nfJoins are the new paths waiting here for a network function to
	// start before this agent joins them (nf.go), at most maxNFJoins.
	nfJoins map[ReqKey]*nfJoin
	// gone are the requestLocks answered "session ended" or passed here,
	// for answering their retransmissions (gone.go).
	gone       goneSet
	trigTokens uint64
	nextReq    uint32
	nextJoin   SessionID
	nextPort   uint16

	now time.Duration
	out []Action
}

// maxEarlySyns bounds Agent.earlySyns: one per request on its way to this
// agent as a right anchor; each expires after LockLease.
func New(cfg Config) *Agent {
	d := DefaultConfig(cfg.Self, cfg.Keys)
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
	if cfg.UDPDrain <= 0 {
		cfg.UDPDrain = d.UDPDrain
	}
	cfg.UDPDrain = min(cfg.UDPDrain, MaxUDPDrain, cfg.LockLease/4)
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
	if cfg.TriggerTokens == 0 {
		cfg.TriggerTokens = 1 << 63
	}
	return &Agent{
		cfg:        cfg,
		sessions:   map[SessionID]*session{},
		subs:       map[wire.Tuple]subRef{},
		rightReq:   map[ReqKey]SessionID{},
		earlySyns:  map[ReqKey]earlySyn{},
		reqWindows: map[netip.Addr]*reqWindow{},
		triggers:   map[ReqKey]*trigOut{},
		nfJoins:    map[ReqKey]*nfJoin{},
		nextJoin:   cfg.JoinedBase,
		nextReq:    cfg.FirstReq,
	}
}

// Self returns the agent's address.
func (a *Agent) Self() netip.Addr { return a.cfg.Self }

// SetKeys changes the keys of control messages (a rotation): what the
// agent sends from now on is signed by the first; what it sent before and
// retransmits keeps the MAC it was sent with.
func (a *Agent) SetKeys(k *Keys) { a.cfg.Keys = k }

// source is the address a datagram to to leaves from (Config.Source).
func (a *Agent) source(to netip.Addr) netip.Addr {
	if a.cfg.Source != nil {
		if s := a.cfg.Source(to); s.IsValid() {
			return s
		}
	}
	return a.cfg.Self
}

// LastReq returns the number of the agent's latest request or trigger
// (Config.FirstReq before the first): the two share one counter.
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
		a.onReconfigure(e, nil)
	case Trigger:
		a.sendTrigger(e)
	case Rebind:
		a.onRebind(e)
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
	case Held:
		a.onHeld(e)
	case Drained:
		a.onDrained(e)
	case StateExported:
		a.onStateExported(e)
	case StateImported:
		a.onStateImported(e)
	case NFStarted:
		a.onNFStarted(e)
	case HoldOverflow:
		a.onHoldOverflow(e)
	case DatapathReady:
		if s := a.sessions[e.Session]; s != nil {
			s.ready = true
		}
	case SessionEnd:
		if s := a.sessions[e.Session]; s != nil && !(e.Replaced && s.relaysOldPath()) {
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
