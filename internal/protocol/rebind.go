package protocol

import (
	"net/netip"

	"github.com/dysco/dysco/internal/wire"
)

// Break before make (M2M §4.2.3): an agent whose address changed under a
// live session (the old address is gone, so no reconfiguration can use
// the old path) moves the subsession to its right neighbour onto its new
// address. Only that subsession changes: the session's tuple, its other
// subsessions and its middleboxes stay as they are.
//
// The agent that moves (the mover) installs the new subsession's ingress
// flow (MoveSubsession, MoveListen), then sends a rebind from its new
// address to the neighbour, naming the old subsession. The neighbour
// checks that the rebind holds the session (the subsession's nonce, and
// the MAC under the control key, which covers the sender's address), that
// it is newer than every rebind of the session it accepted (Req.ID, which
// only grows at the mover), that the session's last rebind is at least an
// RTO old (rate limit) and that no reconfiguration holds its side (it
// contends like a second reconfiguration: ReasonBusy). It then moves its
// side to the new subsession at once (MoveAll: new ingress flow, egress
// to the new address; the old ingress flow stays until Linger for packets
// still on their way) and answers with a
// rebindAck on the new subsession. The mover switches its egress then
// (MoveSwitch). Packets the two ends send meanwhile on the old subsession
// are lost; TCP retransmits them on the new one.
//
// The mover holds the lock of its right subsession (§3.2) for the
// rebind: a reconfiguration of the session waits for it, or is refused,
// as it would be behind another reconfiguration.

// Rebind asks the agent to move the subsession of a session's right side
// to another of this host's addresses, Source (break before make).
type Rebind struct {
	Session SessionID
	Source  netip.Addr
	Token   uint64
}

func (Rebind) event() {}

// MoveStep is what a MoveSubsession does.
type MoveStep uint8

// The steps of a subsession's move.
const (
	// MoveListen installs New's ingress flow beside Old's (the mover,
	// before its rebind).
	MoveListen MoveStep = iota + 1
	// MoveSwitch sends the side's packets on New and removes Old's
	// ingress flow (the mover, on the rebindAck).
	MoveSwitch
	// MoveAbandon removes New's ingress flow (the mover, refused).
	MoveAbandon
	// MoveAll installs New's ingress flow and sends the side's packets
	// on New (the neighbour); Old's ingress flow stays until
	// RemoveSubsession (after Linger), for the mover's packets still on
	// their way: dropped there, or answered with a reset by the stack,
	// they would cost a retransmission or the session.
	MoveAll
)

// MoveSubsession moves a side of a session from subsession Old to New
// (both written as their SYNs went), which differ only in the address of
// the agent that moved.
type MoveSubsession struct {
	Session  SessionID
	Side     Side
	Old, New wire.Tuple
	Step     MoveStep
}

func (MoveSubsession) action() {}

// RebindResult reports the end of a Rebind.
type RebindResult struct {
	Session  SessionID
	Token    uint64
	Req      ReqKey
	Old, New wire.Tuple
	Outcome  Outcome
	Reason   Reason
	Blocker  ReqKey
}

func (RebindResult) action() {}

// rebindOut is a rebind in progress at the mover.
type rebindOut struct {
	req      ReqKey
	token    uint64
	source   netip.Addr
	old, new wire.Tuple
	tries    int
}

// moved is a subsession that a rebind replaced at the neighbour, kept for
// Linger to answer the rebind's retransmissions.
type moved struct {
	sub wire.Tuple
	req ReqKey
}

func (a *Agent) onRebind(e Rebind) {
	res := RebindResult{Session: e.Session, Token: e.Token}
	s := a.sessions[e.Session]
	if s == nil || s.sides[SideRight] == nil {
		res.Outcome, res.Reason = Refused, ReasonNoSession
		a.emit(res)
		return
	}
	sd := s.sides[SideRight]
	res.Old, res.New = sd.Sub, sd.Sub
	src := e.Source.Unmap()
	if !src.IsValid() || !wire.Unicast(src) || src.Is4() != sd.Sub.Src.Unmap().Is4() {
		res.Outcome, res.Reason = Refused, ReasonInvalid
		a.emit(res)
		return
	}
	if sd.Sub.Src.Unmap() == src {
		res.Outcome = Succeeded // already there
		a.emit(res)
		return
	}
	switch {
	case s.rebind != nil:
		res.Outcome, res.Reason, res.Blocker = Refused, ReasonBusy, s.rebind.req
	case s.left != nil:
		res.Outcome, res.Reason, res.Blocker = Refused, ReasonBusy, s.left.req
	case s.lock != Unlocked:
		res.Outcome, res.Reason, res.Blocker = Refused, ReasonLocked, s.requestor
	}
	if res.Outcome != 0 {
		a.emit(res)
		return
	}
	nw := sd.Sub
	nw.Src = src
	if _, used := a.subs[nw]; used {
		res.Outcome, res.Reason = Refused, ReasonInvalid
		a.emit(res)
		return
	}
	a.nextReq++
	rb := &rebindOut{req: ReqKey{LeftAnchor: a.cfg.Self, ID: a.nextReq}, token: e.Token, source: src, old: sd.Sub, new: nw}
	s.rebind = rb
	s.lock, s.requestor = Locked, rb.req
	a.subs[nw] = subRef{id: s.id, side: SideRight, peer: sd.Peer, nonce: sd.Nonce}
	a.emit(MoveSubsession{Session: s.id, Side: SideRight, Old: rb.old, New: nw, Step: MoveListen})
	a.sendRebind(s, rb)
}

// sendRebind sends (again) the rebind, from the new address.
func (a *Agent) sendRebind(s *session, rb *rebindOut) {
	sd := s.sides[SideRight]
	a.sendFrom(sd.Peer, rb.source, a.msg(s, MsgRebind, rb.old, rb.req, rb.source))
	rb.tries++
	a.setTimer(s, TimerRebind, rb.req, a.backoff(rb.tries))
}

// endRebind ends the mover's rebind; the new subsession is abandoned
// unless it succeeded.
func (a *Agent) endRebind(s *session, o Outcome, r Reason, blocker ReqKey) {
	rb := s.rebind
	s.rebind = nil
	a.cancelTimer(s, TimerRebind, rb.req)
	if o == Succeeded {
		sd := s.sides[SideRight]
		delete(a.subs, rb.old)
		sd.Sub = rb.new
		a.emit(MoveSubsession{Session: s.id, Side: SideRight, Old: rb.old, New: rb.new, Step: MoveSwitch})
	} else {
		delete(a.subs, rb.new)
		a.emit(MoveSubsession{Session: s.id, Side: SideRight, Old: rb.old, New: rb.new, Step: MoveAbandon})
	}
	if s.requestor == rb.req {
		s.lock, s.requestor = Unlocked, ReqKey{}
	}
	a.emit(RebindResult{Session: s.id, Token: rb.token, Req: rb.req, Old: rb.old, New: rb.new, Outcome: o, Reason: r, Blocker: blocker})
	a.releaseQueue(s)
}

// onRebindTimer retransmits the rebind, or gives up after MaxTries.
func (a *Agent) onRebindTimer(s *session, req ReqKey) {
	rb := s.rebind
	if rb == nil || rb.req != req {
		return
	}
	if rb.tries >= a.cfg.MaxTries {
		a.endRebind(s, Failed, ReasonTimeout, ReqKey{})
		return
	}
	a.sendRebind(s, rb)
}

// onRebindAck is the neighbour's answer, on the new subsession (ref).
func (a *Agent) onRebindAck(s *session, m *Message) {
	rb := s.rebind
	if rb == nil && m.Reason == ReasonNone && s.sides[SideRight] != nil && m.Sub == s.sides[SideRight].Sub {
		return // the answer to a retransmission of the rebind that moved it
	}
	if rb == nil || m.Req != rb.req || m.Sub != rb.new {
		a.reject(RejectUnexpected, m, m.RightAnchor, "no rebind %s of session %d in progress", m.Req, s.id)
		return
	}
	if m.Reason != ReasonNone {
		a.endRebind(s, Refused, m.Reason, m.Blocker)
		return
	}
	a.endRebind(s, Succeeded, ReasonNone, ReqKey{})
}

// onRebindIn is a rebind at the neighbour: ref is the subsession it names
// (found, and the nonce checked), from the datagram's source.
func (a *Agent) onRebindIn(s *session, ref subRef, m *Message, from netip.Addr) {
	sd := s.sides[SideLeft]
	if ref.side != SideLeft || sd == nil || ref.tomb {
		a.reject(RejectUnexpected, m, from, "a rebind of the %s side of session %d", ref.side, s.id)
		return
	}
	if m.RightAnchor != from {
		a.reject(RejectWrongPeer, m, from, "a rebind to %s sent from %s", m.RightAnchor, from)
		return
	}
	if ref.moved {
		// The old subsession of an accepted rebind: a retransmission
		// is answered again; anything else is a replay.
		if m.Req == s.rebound && from == sd.Peer {
			a.sendRebindAck(s, sd.Sub, m.Req, ReasonNone, ReqKey{})
			return
		}
		a.reject(RejectReplay, m, from, "rebind %s of session %d: its subsession moved already", m.Req, s.id)
		return
	}
	if m.Sub != sd.Sub {
		a.reject(RejectUnexpected, m, from, "rebind of %s, session %d is on %s", m.Sub, s.id, sd.Sub)
		return
	}
	if m.Req.LeftAnchor == s.rebound.LeftAnchor && m.Req.ID <= s.rebound.ID {
		a.reject(RejectReplay, m, from, "rebind %s of session %d is not newer than %s", m.Req, s.id, s.rebound)
		return
	}
	nw := m.Sub
	nw.Src = from
	if !s.rebound.IsZero() && a.now-s.reboundAt < a.cfg.RTO {
		a.reject(RejectRate, m, from, "session %d was rebound %v ago", s.id, a.now-s.reboundAt)
		a.sendRebindAck(s, nw, m.Req, ReasonBusy, s.rebound)
		return
	}
	if s.right != nil {
		a.sendRebindAck(s, nw, m.Req, ReasonBusy, s.right.req)
		return
	}
	// The new subsession may be one an earlier rebind of this session
	// replaced (the host moves back to an address it had): it is taken
	// again.
	if r, used := a.subs[nw]; used && !(r.id == s.id && r.moved) {
		a.sendRebindAck(s, nw, m.Req, ReasonInvalid, ReqKey{})
		return
	}
	old := sd.Sub
	a.emit(MoveSubsession{Session: s.id, Side: SideLeft, Old: old, New: nw, Step: MoveAll})
	ref.moved = true
	a.subs[old] = ref
	a.subs[nw] = subRef{id: s.id, side: SideLeft, peer: from, nonce: ref.nonce}
	sd.Sub, sd.Peer = nw, from
	s.rebound, s.reboundAt = m.Req, a.now
	s.moved = append(s.moved, moved{sub: old, req: m.Req})
	a.setTimer(s, TimerRebound, m.Req, a.cfg.Linger)
	a.sendRebindAck(s, nw, m.Req, ReasonNone, ReqKey{})
}

// sendRebindAck answers a rebind on its new subsession sub (accepted or
// not): to the mover's new address, from this host's end of sub.
func (a *Agent) sendRebindAck(s *session, sub wire.Tuple, req ReqKey, r Reason, blocker ReqKey) {
	ack := a.msg(s, MsgRebindAck, sub, req, sub.Src.Unmap())
	ack.Reason, ack.Blocker = r, blocker
	a.sendFrom(sub.Src.Unmap(), sub.Dst.Unmap(), ack)
}

// onRebound forgets the old subsession of an accepted rebind, and the
// datapath its ingress flow.
func (a *Agent) onRebound(s *session, req ReqKey) {
	for i, mv := range s.moved {
		if mv.req != req {
			continue
		}
		if r, ok := a.subs[mv.sub]; ok && r.id == s.id && r.moved {
			delete(a.subs, mv.sub)
			a.emit(RemoveSubsession{Session: s.id, Side: SideLeft, Sub: mv.sub})
		}
		s.moved = append(s.moved[:i], s.moved[i+1:]...)
		return
	}
}
