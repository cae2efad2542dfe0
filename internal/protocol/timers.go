package protocol

import (
	"time"
)

// Timers: retransmission with back-off, lock leases, lingering of old
// paths. The shell runs them and hands each back as a TimerFired event.

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
	if id.Kind == TimerTrigger {
		a.onTriggerTimer(id) // kept apart from the session (trigOut)
		return
	}
	s := a.sessions[id.Session]
	if s == nil {
		return
	}
	if _, ok := s.timers[id]; !ok {
		return // cancelled or moved
	}
	delete(s.timers, id)
	switch id.Kind {
	case TimerRebind:
		a.onRebindTimer(s, id.Req)
	case TimerRebound:
		a.onRebound(s, id.Req)
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
		if r := s.right; r != nil && r.req == id.Req {
			a.resendHeldSynAck(s, r)
			return
		}
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
	case TimerMigrate, TimerMigrateMsg:
		a.onMigrateTimer(s, id)
	case TimerQuiet:
		a.onQuiet(s, id.Req)
	}
}
