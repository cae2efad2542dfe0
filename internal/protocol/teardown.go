package protocol

import (
	"net/netip"

	"github.com/dysco/dysco/internal/wire"
)

// Two paths and teardown (§3.5): progress of the two-path phase, fin and
// finAck on the old path, closed notices, tombs and lingering.

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
	if s.proto == ProtoUDP {
		a.onUDPProgress(s, an, e.Vars)
		return
	}
	an.vars, an.haveVars = e.Vars, true
	a.evaluate(s, an)
}

// evaluate sends the UDP FIN once everything sent on the old path is
// acknowledged, answers the other anchor's FIN once everything it sent is
// received and acknowledged, and completes when both hold.
//
// For a UDP session (udp.go) the fin goes once the side's old path has been
// quiet for the drain time, and the other's fin is answered at once: it
// says that the other side has ended.
func (a *Agent) evaluate(s *session, an *anchor) {
	udp := s.proto == ProtoUDP
	if an.stage != StageTwoPath || !an.haveVars && !udp {
		return // the datapath reports the cut-off right after StartTwoPath
	}
	if !an.finSent && (udp && an.quiet || !udp && an.vars.SendDone()) {
		an.finSent, an.tries = true, 0
		a.sendFin(s, an)
	}
	if an.finVia != 0 && !an.finAckSent && (udp || an.vars.RecvDone(an.peerCutoff, true)) {
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
	a.cancelTimer(s, TimerQuiet, an.req)
	a.emit(EndTwoPath{Session: s.id, Side: side, New: an.newSub})
	if s.proto != ProtoUDP {
		a.emit(SetWindowClamp{Session: s.id, Side: side, Bytes: 0})
	}
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
	if s == nil || s.proto == ProtoUDP {
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

// relaysOldPath reports whether this agent is only a middle of an old path
// that both anchors' fins have passed: it lingers to pass retransmitted
// fins and finAcks (onLinger ends it), and needs no datapath state for
// that (SessionEnd.Replaced).
func (s *session) relaysOldPath() bool {
	td := s.teardown
	return td != nil && td.fins[0] && td.fins[1] && s.left == nil && s.right == nil
}
