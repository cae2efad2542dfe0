package protocol

import (
	"net/netip"
	"sort"

	"github.com/dysco/dysco/internal/wire"
)

// SessionView is a read-only copy of a session's protocol state, for
// status commands, checkers and tests.
type SessionView struct {
	ID        SessionID
	Tuple     wire.Tuple
	Proto     Proto
	Sides     [2]*SideInfo // nil where the chain ends
	App       AppDelta
	Joined    bool // created by a new path's SYN
	Lock      LockState
	Requestor ReqKey
	Queued    int
	Left      *AnchorView // this agent is the left anchor of a reconfiguration
	Right     *AnchorView // this agent is the right anchor of a reconfiguration
	Cancels   int         // cancelLock exchanges in progress
	Lingering int         // torn-down old subsessions kept to answer FINs
	Teardown  bool        // a middle agent of an old path being torn down
	// TornDown: a middle agent of an old path that both anchors' fins
	// have passed: nothing more travels that path (for UDP sessions, the
	// old path drained before either anchor sent its fin).
	TornDown bool
}

// AnchorView is a read-only copy of an anchor's state.
type AnchorView struct {
	Req         ReqKey
	Role        Role
	Stage       Stage
	RightAnchor netip.Addr
	NewSub      wire.Tuple
	NewPeer     netip.Addr
	Delta       Delta // leftDelta (left anchor) or rightDelta (right anchor)
	NewDelta    Delta // what the new subsession applies
	Vars        TwoPath
	FinSent     bool
	FinAcked    bool
	FinAckSent  bool
	GotFin      bool
}

// Sessions returns the ids of the agent's sessions, sorted.
func (a *Agent) Sessions() []SessionID {
	ids := make([]SessionID, 0, len(a.sessions))
	for id := range a.sessions {
		ids = append(ids, id)
	}
	sort.Slice(ids, func(i, j int) bool { return ids[i] < ids[j] })
	return ids
}

// Lookup finds the session and side of a subsession (current, new or
// lingering).
func (a *Agent) Lookup(sub wire.Tuple) (SessionID, Side, bool) {
	r, ok := a.subs[sub]
	return r.id, r.side, ok
}

// View returns a copy of a session's state.
func (a *Agent) View(id SessionID) (SessionView, bool) {
	s := a.sessions[id]
	if s == nil {
		return SessionView{}, false
	}
	v := SessionView{ID: s.id, Tuple: s.tuple, Proto: s.proto, App: s.app, Joined: !s.joinReq.IsZero(), Lock: s.lock,
		Requestor: s.requestor, Queued: len(s.queue), Cancels: len(s.cancels), Lingering: len(s.tombs),
		Teardown: s.teardown != nil,
		TornDown: s.teardown != nil && s.teardown.fins[0] && s.teardown.fins[1]}
	for i, sd := range s.sides {
		if sd != nil {
			c := *sd
			v.Sides[i] = &c
		}
	}
	v.Left, v.Right = viewAnchor(s.left), viewAnchor(s.right)
	return v, true
}

func viewAnchor(an *anchor) *AnchorView {
	if an == nil {
		return nil
	}
	return &AnchorView{Req: an.req, Role: an.role, Stage: an.stage, RightAnchor: an.rightAnchor,
		NewSub: an.newSub, NewPeer: an.newPeer, Delta: an.delta, NewDelta: an.newDelta, Vars: an.vars,
		FinSent: an.finSent, FinAcked: an.finAcked, FinAckSent: an.finAckSent, GotFin: an.finVia != 0}
}

// RightAnchorOf returns the session this agent is the right anchor of for
// request k, while that request is in progress here.
func (a *Agent) RightAnchorOf(k ReqKey) (SessionID, bool) {
	id, ok := a.rightReq[k]
	return id, ok
}

// OnLivePath reports whether this agent's session id is on the session's
// live path: known here, and not a middle agent of an old path past which
// both anchors' fins have gone (then neither anchor sends on that path any
// more, §3.5, and the session only lingers here). A host holds one
// datapath state per session tuple, so a new path's SYN for a session that
// is on a live path here must be refused (MessageIn.OnPath), not joined.
func (a *Agent) OnLivePath(id SessionID) bool {
	s := a.sessions[id]
	if s == nil {
		return false
	}
	td := s.teardown
	return td == nil || !(td.fins[0] && td.fins[1])
}
