package protocol

import (
	"errors"
	"net/netip"
	"slices"

	"github.com/dysco/dysco/internal/wire"
)

// Operator requests (§3.1): a Reconfigure event at the left anchor checks
// the chain and starts the request; a trigger (trig, trigger.go) starts
// one the same way.

func (a *Agent) onReconfigure(e Reconfigure, trig *trigIn) {
	s := a.sessions[e.Session]
	refuse := func(r Reason, blocker ReqKey) {
		a.nextReq++
		a.emitResult(s, trig, Result{Session: e.Session, Token: e.Token, Req: ReqKey{LeftAnchor: a.cfg.Self, ID: a.nextReq},
			Outcome: Refused, Reason: r, Blocker: blocker})
	}
	if s == nil || s.sides[SideRight] == nil {
		refuse(ReasonNoSession, ReqKey{})
		return
	}
	if err := a.checkChain(e.RightAnchor, e.Chain); err != nil || !checkNFs(e.Chain, e.NFs) ||
		e.Source.IsValid() && (!wire.Unicast(e.Source) || e.Source.Unmap().Is4() != a.cfg.Self.Unmap().Is4()) {
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
	if e.Migrate != nil && e.Source.IsValid() {
		// The migration's messages come from the left anchor's own
		// address (migrate.go), the new path's from Source.
		refuse(ReasonInvalid, ReqKey{})
		return
	}
	if s.proto == ProtoUDP && e.Migrate != nil {
		// State migration's semantics (order, substream) are defined
		// on TCP's marks (state-migration.md).
		refuse(ReasonInvalid, ReqKey{})
		return
	}
	a.nextReq++
	l := &anchor{role: RoleLeftAnchor, req: ReqKey{LeftAnchor: a.cfg.Self, ID: a.nextReq}, token: e.Token,
		rightAnchor: e.RightAnchor, chain: append([]netip.Addr(nil), e.Chain...), gate: e.Gate || e.Migrate != nil, trig: trig,
		source: e.Source.Unmap()}
	if slices.ContainsFunc(e.NFs, func(n string) bool { return n != "" }) {
		l.nfs = append([]string(nil), e.NFs...)
	}
	if e.Migrate != nil {
		l.mig = &migLeft{spec: MigrateSpecDefaults(*e.Migrate)}
	}
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
// right anchor is the next hop already, and the subsession leaves from
// the address asked for): that one succeeds as unchanged at once, with
// nothing locked.
func (a *Agent) startLeft(s *session, l *anchor) {
	if len(l.chain) == 0 && s.sides[SideRight].Peer == l.rightAnchor && !l.moving(s) {
		s.resolve(resolution{req: l.req, kind: resDone})
		a.progress(s, l.req, RoleLeftAnchor, StageDone, "succeeded: unchanged (the right anchor is the next hop)")
		a.emitResult(s, l.trig, Result{Session: s.id, Token: l.token, Req: l.req, Outcome: Succeeded, Unchanged: true})
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
	l.newSub = a.allocPort(l.source, l.newPeer, s.tuple.DstPort)
	a.subs[l.newSub] = subRef{id: s.id, side: SideRight, peer: l.newPeer, nonce: side.Nonce}
	m := a.msg(s, MsgSyn, l.newSub, l.req, l.rightAnchor)
	m.WScale = side.SendWScale // synWScale
	if l.fromElsewhere(a, s) {
		m.Flags |= FlagDirect
	}
	a.send(l.newPeer, m)
}

func (a *Agent) maxSeen(s *session, k ReqKey) {
	if k.ID > s.maxID[k.LeftAnchor] {
		s.maxID[k.LeftAnchor] = k.ID
	}
}
