package protocol

import (
	"net/netip"

	"github.com/dysco/dysco/internal/wire"
)

// Cancellation (§3.6): cancelLock and ackCancel, releasing locks and
// dropping a new path that will not be used.

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
	if g := l.mig; g != nil {
		if g.phase != migDone && e.Abort == "" && a.cfg.Faults&FaultMigEarlySwitch == 0 {
			// The switch waits for the state to be in place (§3.5).
			return
		}
		if g.err != "" && e.Abort == "" {
			e.Abort = g.err
		}
	}
	l.gated = false
	a.cancelTimer(s, TimerGate, l.req)
	if l.trig != nil {
		l.trig.report = e.Report // for the trigger's answer
	}
	if e.Abort != "" {
		a.progress(s, l.req, RoleLeftAnchor, StageCancelling, "aborted: "+e.Abort)
		l.aborted = true
		a.abortSetup(s, l)
		if a.cfg.Faults&FaultMigHoldLeak == 0 {
			a.migReleaseLeft(s, l)
		}
		return
	}
	a.switchAndAck(s, l)
	a.migReleaseLeft(s, l) // what it held goes on the new path
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
	a.migReleaseRight(s, r) // what it held goes on the old path
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
