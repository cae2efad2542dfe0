package protocol

import (
	"net/netip"
	"sort"

	"github.com/dysco/dysco/internal/wire"
)

// Sessions: announced by the agent's shell (SessionUp, with Resume after a
// restart), ended by its collector (SessionEnd), and dropped here once no
// request, cancel or teardown needs them.

func (a *Agent) onSessionUp(e SessionUp) {
	if old := a.sessions[e.Session]; old != nil {
		a.endSession(old)
	}
	s := a.newSession(e.Session, e.Tuple, e.Nonce)
	s.app, s.ready, s.proto = e.App, true, e.Proto
	if s.proto == ProtoUDP {
		s.app = AppDelta{} // no sequence numbers: no deltas
	}
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
	if s.proto == ProtoUDP {
		a.udpSwitched(s, an) // the drain time starts again
	}
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
		a.emitResult(s, l.trig, Result{Session: s.id, Token: l.token, Req: l.req, Outcome: Failed, Reason: ReasonSessionEnded})
	}
	for _, q := range s.queue {
		if q.local != nil {
			a.emitResult(s, q.local.trig, Result{Session: s.id, Token: q.local.token, Req: q.local.req, Outcome: Refused, Reason: ReasonSessionEnded})
		}
	}
	if rb := s.rebind; rb != nil {
		a.emit(RebindResult{Session: s.id, Token: rb.token, Req: rb.req, Old: rb.old, New: rb.new, Outcome: Failed, Reason: ReasonSessionEnded})
	}
	a.drop(s)
}

// drop forgets a session without reporting anything but what its
// migrations leave: holds let go, state moved for it released.
func (a *Agent) drop(s *session) {
	if l := s.left; l != nil && l.mig != nil && a.cfg.Faults&FaultMigHoldLeak == 0 {
		a.migReleaseLeft(s, l)
	}
	if r := s.right; r != nil {
		a.migReleaseRight(s, r)
	}
	if s.exported || s.imported {
		s.exported, s.imported = false, false
		a.emit(ReleaseState{Session: s.id, Tuple: s.tuple})
	}
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
	for _, mv := range s.moved {
		subs = append(subs, mv.sub)
	}
	if rb := s.rebind; rb != nil {
		subs = append(subs, rb.new)
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
