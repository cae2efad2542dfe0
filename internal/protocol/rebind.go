package protocol

import (
	"net/netip"
	"time"

	"github.com/dysco/dysco/internal/wire"
)

// Break before make (M2M §4.2.3): an agent whose address changed under a
// live session (the old address is gone, so no reconfiguration can use
// the old path) moves the subsession to its neighbour onto its new
// address: the session's first agent its right subsession, the last
// agent (a server renumbered) its left one, symmetrically. Only that
// subsession changes: the session's tuple, its other subsessions and its
// middleboxes stay as they are.
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
// The mover of a right side holds the lock of its right subsession
// (§3.2) for the rebind: a reconfiguration of the session waits for it,
// or is refused, as it would be behind another reconfiguration. The mover
// of a left side refuses, as the right anchor, a reconfiguration that
// would take that subsession (ReasonBusy), as it refuses a second one
// (§3.2); the neighbour refuses a rebind of a subsession a
// reconfiguration holds there.

// Rebind asks the agent to move the subsession of a session's Side to
// another of this host's addresses, Source (break before make).
type Rebind struct {
	Session SessionID
	Side    Side
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
	// MoveSwitch sends the side's packets on New (the mover, on the
	// rebindAck); Old's ingress flow stays until RemoveSubsession (after
	// Linger), for the neighbour's packets still on their way.
	MoveSwitch
	// MoveAbandon removes New's ingress flow (the mover, refused).
	MoveAbandon
	// MoveGiveUp keeps the side's packets on Old and New's ingress flow
	// until RemoveSubsession (the mover, no answer: the neighbour may
	// have moved and lost every answer).
	MoveGiveUp
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
	side     Side
	req      ReqKey
	token    uint64
	source   netip.Addr
	old, new wire.Tuple
	tries    int
	start    time.Duration
}

// moved is a subsession kept for Linger after a rebind: the one a rebind
// replaced (at both ends), to take the packets still on their way to it
// and, at the neighbour, to answer the rebind's retransmissions; or, at a
// mover that gave up (gaveUp), the new subsession it asked for, from
// which the old one (old) may still follow a late answer.
type moved struct {
	side   Side
	sub    wire.Tuple
	req    ReqKey
	gaveUp bool
	old    wire.Tuple
}

// refusal is a rebind the neighbour refused, answered the same way again
// if a copy of it comes.
type refusal struct {
	req, blocker ReqKey
	reason       Reason
}

// ownEnd returns this agent's address on a subsession of a side (written
// as its SYN went): the source on the right, the destination on the
// left.
func ownEnd(side Side, sub wire.Tuple) netip.Addr {
	if side == SideRight {
		return sub.Src.Unmap()
	}
	return sub.Dst.Unmap()
}

// withOwnEnd returns sub with this agent's address on it replaced by x.
func withOwnEnd(side Side, sub wire.Tuple, x netip.Addr) wire.Tuple {
	if side == SideRight {
		sub.Src = x
	} else {
		sub.Dst = x
	}
	return sub
}

func (a *Agent) onRebind(e Rebind) {
	res := RebindResult{Session: e.Session, Token: e.Token}
	s := a.sessions[e.Session]
	if s == nil || e.Side > SideRight || s.sides[e.Side] == nil {
		res.Outcome, res.Reason = Refused, ReasonNoSession
		a.emit(res)
		return
	}
	sd := s.sides[e.Side]
	res.Old, res.New = sd.Sub, sd.Sub
	src := e.Source.Unmap()
	if !src.IsValid() || !wire.Unicast(src) || src.Is4() != sd.Sub.Src.Unmap().Is4() {
		res.Outcome, res.Reason = Refused, ReasonInvalid
		a.emit(res)
		return
	}
	if ownEnd(e.Side, sd.Sub) == src {
		res.Outcome = Succeeded // already there
		a.emit(res)
		return
	}
	switch {
	case s.rebind != nil:
		res.Outcome, res.Reason, res.Blocker = Refused, ReasonBusy, s.rebind.req
	case e.Side == SideRight && s.left != nil:
		res.Outcome, res.Reason, res.Blocker = Refused, ReasonBusy, s.left.req
	case e.Side == SideRight && s.lock != Unlocked:
		res.Outcome, res.Reason, res.Blocker = Refused, ReasonLocked, s.requestor
	case e.Side == SideLeft && s.right != nil:
		res.Outcome, res.Reason, res.Blocker = Refused, ReasonBusy, s.right.req
	}
	if res.Outcome != 0 {
		a.emit(res)
		return
	}
	nw := withOwnEnd(e.Side, sd.Sub, src)
	// A subsession this side left within Linger (it moves back) is taken
	// again.
	if r, used := a.subs[nw]; used && !(r.id == s.id && r.moved) {
		res.Outcome, res.Reason = Refused, ReasonInvalid
		a.emit(res)
		return
	}
	a.nextReq++
	rb := &rebindOut{side: e.Side, req: ReqKey{LeftAnchor: a.cfg.Self, ID: a.nextReq}, token: e.Token, source: src, old: sd.Sub, new: nw, start: a.now}
	s.rebind = rb
	if e.Side == SideRight {
		s.lock, s.requestor = Locked, rb.req
	}
	a.subs[nw] = subRef{id: s.id, side: e.Side, peer: sd.Peer, nonce: sd.Nonce}
	a.emit(MoveSubsession{Session: s.id, Side: e.Side, Old: rb.old, New: nw, Step: MoveListen})
	a.sendRebind(s, rb)
}

// sendRebind sends (again) the rebind, from the new address.
func (a *Agent) sendRebind(s *session, rb *rebindOut) {
	sd := s.sides[rb.side]
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
		a.switchSide(s, rb.side, rb.old, rb.new, rb.req)
	} else if r == ReasonTimeout {
		// No answer: the neighbour may have moved and every answer been
		// lost. The new subsession stays (marked moved) until Linger:
		// packets the neighbour sends on it arrive in the session, a late
		// answer moves this side too (onLateRebindAck), and a rebind
		// asked again finds the neighbour there already.
		if ref, ok := a.subs[rb.new]; ok {
			ref.moved = true
			a.subs[rb.new] = ref
		}
		s.moved = append(s.moved, moved{side: rb.side, sub: rb.new, req: rb.req, gaveUp: true, old: rb.old})
		a.setTimer(s, TimerRebound, rb.req, a.cfg.Linger)
		a.emit(MoveSubsession{Session: s.id, Side: rb.side, Old: rb.old, New: rb.new, Step: MoveGiveUp})
	} else {
		delete(a.subs, rb.new)
		a.emit(MoveSubsession{Session: s.id, Side: rb.side, Old: rb.old, New: rb.new, Step: MoveAbandon})
	}
	if rb.side == SideRight && s.requestor == rb.req {
		s.lock, s.requestor = Unlocked, ReqKey{}
	}
	a.emit(RebindResult{Session: s.id, Token: rb.token, Req: rb.req, Old: rb.old, New: rb.new, Outcome: o, Reason: r, Blocker: blocker})
	a.releaseQueue(s)
}

// switchSide moves the mover's side from subsession old to nw (rebind
// req). The old subsession is kept, marked moved, until Linger: its
// ingress flow takes the neighbour's packets still on their way (if the
// old address still works, the stack would answer them with a reset).
func (a *Agent) switchSide(s *session, side Side, old, nw wire.Tuple, req ReqKey) {
	if ref, ok := a.subs[old]; ok {
		ref.moved = true
		a.subs[old] = ref
	}
	s.sides[side].Sub = nw
	s.moved = append(s.moved, moved{side: side, sub: old, req: req})
	a.setTimer(s, TimerRebound, req, a.cfg.Linger)
	a.emit(MoveSubsession{Session: s.id, Side: side, Old: old, New: nw, Step: MoveSwitch})
}

// onRebindTimer retransmits the rebind, or gives up after MaxTries or
// half of Linger, whichever comes first: the neighbour, which may have
// moved with every answer lost, still knows the old subsession when the
// mover asks again (onRebindIn).
func (a *Agent) onRebindTimer(s *session, req ReqKey) {
	rb := s.rebind
	if rb == nil || rb.req != req {
		return
	}
	if rb.tries >= a.cfg.MaxTries || a.now-rb.start >= a.cfg.Linger/2 {
		a.endRebind(s, Failed, ReasonTimeout, ReqKey{})
		return
	}
	a.sendRebind(s, rb)
}

// onRebindAck is the neighbour's answer, on the new subsession (ref).
func (a *Agent) onRebindAck(s *session, m *Message) {
	rb := s.rebind
	if rb == nil && m.Reason == ReasonNone && (s.sides[SideRight] != nil && m.Sub == s.sides[SideRight].Sub ||
		s.sides[SideLeft] != nil && m.Sub == s.sides[SideLeft].Sub) {
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

// onLateRebindAck is an answer that came after the mover gave up its
// rebind (ref: the new subsession, kept marked moved): an acceptance
// means that the neighbour moved, and this side follows it.
func (a *Agent) onLateRebindAck(s *session, ref subRef, m *Message, from netip.Addr) {
	for _, mv := range s.moved {
		if !mv.gaveUp || mv.sub != m.Sub || mv.req != m.Req {
			continue
		}
		sd := s.sides[mv.side]
		if m.Reason != ReasonNone || from != ref.peer || s.rebind != nil || sd == nil || sd.Sub != mv.old {
			break
		}
		ref.moved = false
		a.subs[mv.sub] = ref
		a.switchSide(s, mv.side, mv.old, mv.sub, mv.req)
		return
	}
	a.reject(RejectUnexpected, m, from, "%s on subsession %s, which a rebind replaced", m.Type, m.Sub)
}

// onRebindIn is a rebind at the neighbour: ref is the subsession it names
// (found, and the nonce checked), from the datagram's source. The side
// that moves is ref.side here (the mover's other side).
func (a *Agent) onRebindIn(s *session, ref subRef, m *Message, from netip.Addr) {
	side := ref.side
	sd := s.sides[side]
	if sd == nil || ref.tomb {
		a.reject(RejectUnexpected, m, from, "a rebind of the %s side of session %d", ref.side, s.id)
		return
	}
	if m.RightAnchor != from {
		a.reject(RejectWrongPeer, m, from, "a rebind to %s sent from %s", m.RightAnchor, from)
		return
	}
	last := s.rebound[side]
	newer := func(k ReqKey) bool { return k.LeftAnchor != m.Req.LeftAnchor || m.Req.ID > k.ID }
	if ref.moved {
		// The old subsession of an accepted rebind: a retransmission
		// is answered again, and so is a newer rebind from the address
		// the side moved to, asking for where it is already (the mover
		// gave up the first, its answers lost); anything else is a
		// replay.
		if from == sd.Peer && (m.Req == last || newer(last) && newer(s.refused[side].req) && withOwnEnd(side.Other(), m.Sub, from) == sd.Sub) {
			s.rebound[side] = m.Req
			a.sendRebindAck(s, side, sd.Sub, m.Req, ReasonNone, ReqKey{})
			return
		}
		a.reject(RejectReplay, m, from, "rebind %s of session %d: its subsession moved already", m.Req, s.id)
		return
	}
	// A reconfiguration that holds the subsession here refuses the
	// rebind, as it would a second reconfiguration (§3.2); also when the
	// rebind names a subsession the reconfiguration is replacing here
	// (the mover, done with it, already moved on to its new path).
	var holder ReqKey
	switch {
	case side == SideLeft && s.right != nil:
		holder = s.right.req
	case side == SideRight && s.left != nil:
		holder = s.left.req
	case side == SideRight && s.lock != Unlocked:
		holder = s.requestor
	case s.rebind != nil && s.rebind.side == side:
		holder = s.rebind.req // both ends of the subsession move
	}
	if m.Sub != sd.Sub {
		if !holder.IsZero() {
			a.sendRebindAck(s, side, withOwnEnd(side.Other(), m.Sub, from), m.Req, ReasonBusy, holder)
			return
		}
		a.reject(RejectUnexpected, m, from, "rebind of %s, session %d is on %s", m.Sub, s.id, sd.Sub)
		return
	}
	// A copy of a rebind refused here gets the same answer: accepted
	// now, it would move this side while the mover, refused, stays.
	if rf := s.refused[side]; m.Req == rf.req {
		a.sendRebindAck(s, side, withOwnEnd(side.Other(), m.Sub, from), m.Req, rf.reason, rf.blocker)
		return
	}
	if !newer(last) || !newer(s.refused[side].req) {
		a.reject(RejectReplay, m, from, "rebind %s of session %d is not newer than %s", m.Req, s.id, last)
		return
	}
	nw := withOwnEnd(side.Other(), m.Sub, from)
	refuse := func(r Reason, blocker ReqKey) {
		s.refused[side] = refusal{req: m.Req, reason: r, blocker: blocker}
		a.sendRebindAck(s, side, nw, m.Req, r, blocker)
	}
	if !last.IsZero() && a.now-s.reboundAt[side] < a.cfg.RTO {
		a.reject(RejectRate, m, from, "session %d was rebound %v ago", s.id, a.now-s.reboundAt[side])
		refuse(ReasonBusy, last)
		return
	}
	if !holder.IsZero() {
		refuse(ReasonBusy, holder)
		return
	}
	// The new subsession may be one an earlier rebind of this session
	// replaced (the host moves back to an address it had): it is taken
	// again.
	if r, used := a.subs[nw]; used && !(r.id == s.id && r.moved) {
		refuse(ReasonInvalid, ReqKey{})
		return
	}
	old := sd.Sub
	a.emit(MoveSubsession{Session: s.id, Side: side, Old: old, New: nw, Step: MoveAll})
	ref.moved = true
	a.subs[old] = ref
	a.subs[nw] = subRef{id: s.id, side: side, peer: from, nonce: ref.nonce}
	sd.Sub, sd.Peer = nw, from
	s.rebound[side], s.reboundAt[side] = m.Req, a.now
	s.moved = append(s.moved, moved{side: side, sub: old, req: m.Req})
	a.setTimer(s, TimerRebound, m.Req, a.cfg.Linger)
	a.sendRebindAck(s, side, nw, m.Req, ReasonNone, ReqKey{})
}

// sendRebindAck answers a rebind of a side's subsession on its new
// subsession sub (accepted or not): to the mover's new address, from
// this host's end of sub.
func (a *Agent) sendRebindAck(s *session, side Side, sub wire.Tuple, req ReqKey, r Reason, blocker ReqKey) {
	mover := ownEnd(side.Other(), sub)
	ack := a.msg(s, MsgRebindAck, sub, req, mover)
	ack.Reason, ack.Blocker = r, blocker
	a.sendFrom(mover, ownEnd(side, sub), ack)
}

// onRebound forgets the subsessions kept after rebind req (moved), and
// the datapath their ingress flows.
func (a *Agent) onRebound(s *session, req ReqKey) {
	keep := s.moved[:0]
	for _, mv := range s.moved {
		if mv.req != req {
			keep = append(keep, mv)
			continue
		}
		if r, ok := a.subs[mv.sub]; ok && r.id == s.id && r.moved {
			delete(a.subs, mv.sub)
			a.emit(RemoveSubsession{Session: s.id, Side: mv.side, Sub: mv.sub})
		}
	}
	s.moved = keep
}
