package protocol

import (
	"net/netip"
	"slices"

	"github.com/dysco/dysco/internal/wire"
)

// Locking (§3.2): requestLock, ackLock and nackLock along the old path,
// queued requests, and the lock lease.

// contribution is what this agent does to the stream flowing towards side
// to: its own anchor delta on the arrival side plus the application's
// delta (§3.4). Summed along the old path it gives rightDelta / leftDelta.
func (s *session) contribution(to Side) Delta {
	if s.proto == ProtoUDP {
		return Delta{} // datagrams: no sequence numbers
	}
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
	// answered, but a retransmission from the same sender must
	// (onGoneRequest, MessageIn.Gone).
	a.heardOf(k)
	if !fromQueue {
		a.notePassed(m, from)
	}
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
		if rb := s.rebind; rb != nil && rb.side == SideLeft {
			// Our left subsession is moving (rebind.go).
			a.nack(s, m, from, ReasonBusy, rb.req)
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
	if slices.Equal(l.chain, m.Hops) && !l.moving(s) {
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
			a.emitResult(s, b.local.trig, Result{Session: s.id, Token: b.local.token, Req: b.local.req, Outcome: Refused,
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
				a.emitResult(s, b.local.trig, Result{Session: s.id, Token: b.local.token, Req: b.local.req, Outcome: Refused,
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
	if l.mig != nil && a.cfg.Faults&FaultMigHoldLeak == 0 {
		a.migReleaseLeft(s, l)
	}
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
	a.emitResult(s, l.trig, res)
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
