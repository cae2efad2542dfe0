package protocol

import (
	"net/netip"
	"slices"

	"github.com/dysco/dysco/internal/wire"
)

// The new path (§3.1, §3.3): SYN, SYN-ACK and ack of the new path, joins
// and their refusals, early SYNs, and the switch to two paths.

// allocPort chooses the tuple of a new subsession from src to dst: a port
// of the agent's range that no subsession to dst uses.
//
// Without src the subsession leaves from the address the host's route to
// dst chooses (Config.Source), as the datagrams of its control messages
// do and as the datapath's subsessions set up by a SYN do: a host with
// several addresses (a middlebox between two subnets) sends the SYN of
// the new path from the subsession's own source, which the next hop
// checks (onNewSyn). A left anchor moving the session to another of its
// addresses gives that one (Reconfigure.Source), and its messages about
// the subsession leave from it (send).
func (a *Agent) allocPort(src, dst netip.Addr, dport uint16) wire.Tuple {
	if !src.IsValid() {
		src = a.source(dst)
	}
	for i := 0; i < int(a.cfg.PortCount); i++ {
		p := a.cfg.PortBase + a.nextPort
		a.nextPort = (a.nextPort + 1) % a.cfg.PortCount
		t := wire.Tuple{Src: src, Dst: dst, SrcPort: p, DstPort: dport}
		if _, used := a.subs[t]; !used {
			return t
		}
	}
	// Every port is in use towards dst: reuse (the datapath refuses it).
	return wire.Tuple{Src: src, Dst: dst, SrcPort: a.cfg.PortBase, DstPort: dport}
}

// beginSetup is the left anchor's step once the segment is locked: send
// the SYN carrying the address list and install the new subsession.
//
// The SYN goes first: installing takes the agent a few map operations,
// and nothing needs the subsession at this host before the SYN-ACK, which
// this agent handles after this step. (The right anchor, in onNewSyn,
// installs before it answers: the left anchor's first packets on the new
// path may follow the SYN-ACK at once.)
//
// After an early SYN (sendEarlySyn) the subsession is the one that SYN
// named; if its SYN-ACK has come, the new path is up and the anchor goes
// on at once (newPathUp); otherwise the early SYN was the first try, and
// TimerSyn sends it again if its SYN-ACK does not come (usually it is on
// its way: the right anchor answers right after its ackLock).
func (a *Agent) beginSetup(s *session, l *anchor) {
	side := s.sides[SideRight]
	early := l.newSub.Src.IsValid()
	if !early {
		hops := append(append([]netip.Addr(nil), l.chain...), l.rightAnchor)
		l.newPeer = hops[0]
		l.newSub = a.allocPort(l.source, l.newPeer, s.tuple.DstPort)
		a.subs[l.newSub] = subRef{id: s.id, side: SideRight, peer: l.newPeer, nonce: side.Nonce}
	}
	// §3.4: incoming data on the new path gets what the deleted
	// middleboxes added, on top of what this side already applied.
	l.newDelta = side.Delta.Add(l.delta)
	l.stage, l.tries = StageSettingUp, 0
	add := AddSubsession{Session: s.id, Side: SideRight, Sub: l.newSub, Peer: l.newPeer, Delta: l.newDelta,
		WScaleIn: l.peerWS, WScaleOut: side.PeerWScale, Nonce: side.Nonce,
		Req: l.req, RightAnchor: l.rightAnchor, OldNonce: side.Nonce}
	if l.synAcked {
		a.emit(add)
		a.progress(s, l.req, RoleLeftAnchor, StageSettingUp, "leftDelta "+l.delta.String()+"; early SYN answered")
		a.newPathUp(s, l)
		return
	}
	if early {
		l.tries = 1
		a.setTimer(s, TimerSyn, l.req, a.backoff(l.tries))
	} else {
		a.sendSyn(s, l)
	}
	a.emit(add)
	a.progress(s, l.req, RoleLeftAnchor, StageSettingUp, "leftDelta "+l.delta.String())
}

func (a *Agent) sendSyn(s *session, l *anchor) {
	m := a.msg(s, MsgSyn, l.newSub, l.req, l.rightAnchor)
	m.WScale = s.sides[SideRight].SendWScale // synWScale
	// The addresses after the receiver, ending with the right anchor; none
	// when the receiver is the right anchor.
	m.Hops = append(append([]netip.Addr(nil), l.chain...), l.rightAnchor)[1:]
	if len(l.chain) == 0 && l.fromElsewhere(a, s) {
		m.Flags |= FlagDirect
	}
	if l.nfs != nil {
		// The network function of each middlebox, the receiver's first
		// (heterogeneous-sfc-quic §IV).
		m.NF = &NFBody{Names: append([]string(nil), l.nfs...)}
	}
	a.send(l.newPeer, m)
	l.tries++
	a.setTimer(s, TimerSyn, l.req, a.backoff(l.tries))
}

// onNewSyn handles a SYN on a subsession nobody knows yet: at the right
// anchor it completes the new path; elsewhere the agent joins it, unless
// the session crosses this host already (onPath: MessageIn.OnPath), which
// it then refuses to the left (refuseSyn).
func (a *Agent) onNewSyn(from netip.Addr, m *Message, onPath bool) {
	if m.Sub.Dst != a.cfg.Self || m.Sub.Src != from {
		a.reject(RejectWrongPeer, m, from, "syn for %s", m.Sub)
		return
	}
	if m.RightAnchor == a.cfg.Self {
		id, ok := a.rightReq[m.Req]
		if !ok {
			direct := len(m.Hops) == 0 && (from == m.Req.LeftAnchor || m.Flags&FlagDirect != 0)
			if direct {
				a.keepEarlySyn(from, m)
				return
			}
			a.reject(RejectUnexpected, m, from, "syn for %s: not locked here", m.Req)
			if a.knownReq(m.Req) {
				// A SYN of a request that is over here (cancelled,
				// released), come through middleboxes: a late copy of
				// one sent before the cancel, which hosts that had left
				// the new path joined again. Refused (stale), so that
				// they leave again (onSynAck) instead of keeping the
				// session until it is idle (§3.6).
				a.refuseSyn(from, m, ReasonStale, a.cfg.Self)
			}
			return
		}
		a.acceptSyn(a.sessions[id], from, m)
		return
	}
	if len(m.Hops) == 0 {
		a.reject(RejectMalformed, m, from, "syn with no hops for a middlebox")
		return
	}
	if onPath {
		a.refuseSyn(from, m, ReasonOnPath, a.cfg.Self)
		return
	}
	if name := m.selfNF(); name != "" {
		// Join once the function runs (nf.go).
		a.onNFSyn(from, m, name)
		return
	}
	a.joinNewPath(from, m, "")
}

// joinNewPath joins the new path of the SYN m (from the host before this
// one on it): a session with both subsessions, the SYN passed on. nf is
// the network function the request named for this host, ready now.
func (a *Agent) joinNewPath(from netip.Addr, m *Message, nf string) {
	a.nextJoin++
	s := a.newSession(a.nextJoin, m.Session, m.Nonce)
	s.joinReq, s.joinRight, s.proto = m.Req, m.RightAnchor, m.Proto
	// A joined UDP session needs no marks to be an anchor: it is ready.
	s.ready = s.proto == ProtoUDP
	next := m.Hops[0]
	// The windows of the packets that pass rightwards are in the left
	// anchor's scale, which the SYN carries (synWScale); those that pass
	// leftwards in the right anchor's, which its synAck brings (onSynAck).
	left := SideInfo{Peer: from, Sub: m.Sub, Nonce: m.Nonce, PeerWScale: m.WScale}
	right := SideInfo{Peer: next, Sub: a.allocPort(netip.Addr{}, next, m.Session.DstPort), Nonce: m.Nonce, SendWScale: m.WScale}
	s.sides[SideLeft], s.sides[SideRight] = &left, &right
	a.subs[left.Sub] = subRef{id: s.id, side: SideLeft, peer: from, nonce: m.Nonce}
	a.subs[right.Sub] = subRef{id: s.id, side: SideRight, peer: next, nonce: m.Nonce}
	// The SYN goes on first, as at the left anchor (beginSetup): new-path
	// packets reach this host only after the SYN-ACK, which this agent
	// passes back after this step.
	a.forwardSyn(s, m)
	a.emit(JoinSession{Session: s.id, Tuple: s.tuple, Proto: s.proto, Nonce: s.nonce, Left: left, Right: right, Req: m.Req, NF: nf})
	note := "joined"
	if nf != "" {
		note = "joined, network function " + nf + " ready"
	}
	a.progress(s, m.Req, RoleNewHop, StageSettingUp, note)
}

// acceptSyn is the right anchor's part of the new path's set-up, once it
// holds the lock for the SYN's request: install the new subsession and
// answer with the SYN-ACK (§3.1). Model: agent.pml acceptSyn.
func (a *Agent) acceptSyn(s *session, from netip.Addr, m *Message) {
	r := s.right
	if r == nil || m.Nonce != r.anchorNonce {
		a.reject(RejectNonce, m, from, "session %d", s.id)
		return
	}
	if r.stage != StageWaitSyn {
		a.reject(RejectUnexpected, m, from, "syn for %s in stage %s", m.Req, r.stage)
		return
	}
	if m.Proto != s.proto {
		a.reject(RejectUnexpected, m, from, "syn for %s: a %s session here, not %s", m.Req, s.proto, m.Proto)
		return
	}
	if _, used := a.subs[m.Sub]; used {
		a.reject(RejectUnexpected, m, from, "syn for %s: subsession %s in use", m.Req, m.Sub)
		return
	}
	side := s.sides[SideLeft]
	r.newSub, r.newPeer = m.Sub, from
	r.directNew = m.Flags&FlagDirect != 0 || from == r.req.LeftAnchor
	r.newDelta = side.Delta.Add(r.delta)
	a.subs[m.Sub] = subRef{id: s.id, side: SideLeft, peer: from, nonce: m.Nonce}
	// Armed: the first packet on the new path switches this side even
	// if the ACK is lost.
	a.emit(AddSubsession{Session: s.id, Side: SideLeft, Sub: m.Sub, Peer: from, Delta: r.newDelta,
		WScaleIn: r.peerWS, WScaleOut: side.PeerWScale, Armed: true, Nonce: m.Nonce,
		Req: r.req, RightAnchor: a.cfg.Self, OldNonce: side.Nonce})
	r.stage = StageWaitAck
	a.progress(s, r.req, RoleRightAnchor, StageWaitAck, "")
	a.setTimer(s, TimerLease, r.req, a.cfg.LockLease)
	a.sendSynAck(s, r, from, m.Sub)
}

// sendSynAck sends the right anchor's synAck (synAckMsg) to the new path's
// first hop back.
func (a *Agent) sendSynAck(s *session, r *anchor, to netip.Addr, sub wire.Tuple) {
	a.send(to, a.synAckMsg(s, r, sub))
}

// synAckMsg is the right anchor's synAck on the new subsession sub. On a
// direct new path (the SYN came from the left anchor itself: an early
// SYN) it also grants the lock (FlagGrant) with what the ackLock carries:
// leftDelta, gathered by requestLock on its way (forwardRequest), and our
// window scale. The left anchor, whose early SYN it answers, then goes on
// one hop after our grant instead of the ackLock's two back along the old
// path; the ackLock still goes, and locks the old path's middle agents on
// its way (docs/protocol.md, "The granting SYN-ACK"). Model: agent.pml
// sendSynAck. A right anchor resumed after its agent restarted (resume)
// does not grant: the leftDelta was the old agent's, not kept in the
// datapath, and a grant with none would give the left anchor a wrong
// delta; that left anchor waits for the ackLock, which a retransmitted
// requestLock brings (a duplicate at the right anchor).
func (a *Agent) synAckMsg(s *session, r *anchor, sub wire.Tuple) *Message {
	m := a.msg(s, MsgSynAck, sub, r.req, a.cfg.Self)
	// Our window scale: the grant's, and for the middleboxes joining the
	// new path the scale of the windows they pass leftwards.
	m.WScale = s.sides[SideLeft].SendWScale
	if r.directNew && !r.resumed {
		m.Flags |= FlagGrant
		m.Delta = r.grantDelta
	}
	return m
}

// keepEarlySyn keeps the early SYN of a request whose requestLock has not
// come yet (sendEarlySyn). A request heard of here already (its
// requestLock came and it is resolved, or its early SYN is kept) makes the
// SYN a replay or a stale retransmission: refused (replay.go). The store is
// bounded: expired entries go first; when it is still full the SYN is
// refused (the left anchor sends it again once it holds the lock).
func (a *Agent) keepEarlySyn(from netip.Addr, m *Message) {
	if _, ok := a.earlySyns[m.Req]; ok {
		a.reject(RejectUnexpected, m, from, "early syn for %s: kept already", m.Req)
		return
	}
	if a.knownReq(m.Req) {
		a.reject(RejectReplay, m, from, "early syn for %s: request heard of already", m.Req)
		return
	}
	if len(a.earlySyns) >= maxEarlySyns {
		for k, e := range a.earlySyns {
			if a.now-e.at >= a.cfg.LockLease {
				delete(a.earlySyns, k)
			}
		}
		if len(a.earlySyns) >= maxEarlySyns {
			a.reject(RejectUnexpected, m, from, "early syn for %s: %d kept already", m.Req, len(a.earlySyns))
			return
		}
	}
	a.heardOf(m.Req)
	a.earlySyns[m.Req] = earlySyn{from: from, m: m, at: a.now}
}

// takeEarlySyn removes and returns the early SYN of request k, if one is
// kept and has not expired.
func (a *Agent) takeEarlySyn(k ReqKey) (earlySyn, bool) {
	e, ok := a.earlySyns[k]
	if !ok {
		return e, false
	}
	delete(a.earlySyns, k)
	return e, a.now-e.at < a.cfg.LockLease
}

// refuseSyn answers a new path's SYN with a synAck that refuses it
// (FlagRefuse, reason r, naming the host by that refused in its list),
// back the way the SYN came: this host will not join. The hosts that joined before it pass the refusal on and leave
// (onSynAck); the left anchor abandons the new path and cancels (§3.6).
// Stateless: a retransmitted SYN gets the same answer.
func (a *Agent) refuseSyn(from netip.Addr, m *Message, r Reason, by netip.Addr) {
	n := &Message{Type: MsgSynAck, Flags: FlagRefuse, Reason: r, Nonce: m.Nonce, Sub: m.Sub,
		Session: m.Session, Req: m.Req, RightAnchor: m.RightAnchor, Hops: []netip.Addr{by}}
	// From the address the SYN came to (this host's end of the new
	// subsession): the left neighbour takes the answer only from there,
	// also when the route to it would choose another of this host's.
	a.sendFrom(from, m.Sub.Dst, n)
}

// onJoinFailed: the agent could not install a session this agent joined
// (JoinFailed). The SYN went on already (onNewSyn sends it first): the
// left anchor learns of the refusal and abandons the new path
// (dropNewPath). The session stays, with no datapath state: a SYN sent
// again (the refusal lost) is refused again (onSynDup) rather than joined
// and passed on, and the left anchor's cancelLock on the new path passes
// through it to free the hosts after it and the right anchor
// (onCancelLock), which are thus released only once the left anchor has
// let the request go. Should that cancelLock never come, the lease sends
// it on and forgets the session (onLease).
func (a *Agent) onJoinFailed(e JoinFailed) {
	s := a.sessions[e.Session]
	if s == nil || s.joinReq.IsZero() || s.joinFailed || s.sides[SideLeft] == nil || s.sides[SideRight] == nil {
		return
	}
	s.joinFailed, s.failedAt = true, a.cfg.Self
	a.progress(s, s.joinReq, RoleNewHop, StageDone, "refused: the datapath could not install the session")
	a.refuseJoin(s)
	a.setTimer(s, TimerLease, s.joinReq, a.cfg.LockLease)
}

// refuseJoin sends the refusal of a joined session whose new path failed
// to its left, naming the host whose join failed.
func (a *Agent) refuseJoin(s *session) {
	left := s.sides[SideLeft]
	a.refuseSyn(left.Peer, &Message{Nonce: left.Nonce, Sub: left.Sub, Session: s.tuple, Req: s.joinReq,
		RightAnchor: s.joinRight}, ReasonSetupFailed, s.failedAt)
}

func (a *Agent) forwardSyn(s *session, m *Message) {
	f := *m
	f.Hops = m.Hops[1:]
	f.NF = nil
	if m.NF != nil && slices.ContainsFunc(m.NF.Names[1:], func(n string) bool { return n != "" }) {
		// The later middleboxes' network functions.
		f.NF = &NFBody{Names: m.NF.Names[1:]}
	}
	a.sendSide(s, SideRight, &f)
}

// onSynDup handles a retransmitted SYN: answer or forward it again.
func (a *Agent) onSynDup(s *session, ref subRef, m *Message) {
	if r := s.right; r != nil && r.req == m.Req && r.newSub == m.Sub {
		a.sendSynAck(s, r, r.newPeer, m.Sub)
		return
	}
	if s.joinFailed && s.joinReq == m.Req && ref.side == SideLeft {
		a.refuseJoin(s) // the refusal was lost: the same answer
		return
	}
	if s.joinReq == m.Req && ref.side == SideLeft && len(m.Hops) > 0 {
		a.forwardSyn(s, m)
		return
	}
	a.reject(RejectUnexpected, m, ref.peer, "syn for %s", m.Req)
}

func (a *Agent) onSynAck(s *session, ref subRef, m *Message) {
	if l := s.left; l != nil && l.req == m.Req && l.newSub == m.Sub {
		if m.NF != nil && m.Flags&FlagRefuse == 0 {
			a.onNFStarting(s, l, m)
			return
		}
		if l.nfWait != "" && !l.nfDone {
			l.nfDone = true
			a.emit(Progress{Session: s.id, Req: l.req, Role: RoleLeftAnchor, Stage: l.stage,
				Note: "the new path answered after network function " + l.nfWait + " started", NF: l.nfWait, NFDone: true})
		}
		if m.Flags&FlagRefuse != 0 {
			// A host of the new path refused to join it (refuseSyn).
			if l.stage == StageSettingUp && !l.gated {
				// A host that carries the session already: nothing
				// changed, the request does not fit the path (refused).
				// One that could not install it: the new path failed.
				end := &Result{Outcome: Failed, Reason: ReasonSetupFailed}
				switch m.Reason {
				case ReasonOnPath:
					end = &Result{Outcome: Refused, Reason: ReasonOnPath}
				case ReasonNF:
					// Its network function could not be started
					// (heterogeneous-sfc-quic §IV): cancelled.
					end = &Result{Outcome: Failed, Reason: ReasonNF, NF: m.NF.Names[0], Detail: m.NF.Text}
				}
				if len(m.Hops) == 1 {
					end.Hop = m.Hops[0] // the host that refused
				}
				a.dropNewPath(s, l, "new path refused: "+m.Reason.String(), end)
			}
			return
		}
		switch {
		case l.stage == StageLocking && m.Flags&FlagGrant != 0 && len(l.chain) == 0 &&
			ref.peer == l.rightAnchor && s.lock == LockPending && s.requestor == l.req:
			// The early SYN's answer, granting the lock (synAckMsg): the
			// new path is up and the segment ours.
			l.synAcked = true
			a.granted(s, l, m)
		case l.stage == StageLocking:
			l.synAcked = true // the early SYN's answer: used once the lock is held
		case l.stage == StageSettingUp && l.gated:
			// A retransmitted SYN-ACK while the agent works: it waits.
		case l.stage == StageSettingUp:
			a.newPathUp(s, l)
		case l.stage == StageTwoPath:
			a.sendAck(s, l) // our ACK was lost
		}
		return
	}
	if s.joinReq == m.Req && ref.side == SideRight {
		if s.joinFailed {
			return // refused already: the new path will not be used
		}
		f := *m
		a.sendSide(s, SideLeft, &f)
		if m.Flags&FlagRefuse == 0 && !s.joinWS && s.proto == ProtoTCP {
			// The right anchor's window scale: that of the windows
			// this host passes leftwards, which it needs should it be
			// an anchor of a later reconfiguration (§4.2).
			s.joinWS = true
			s.sides[SideLeft].SendWScale, s.sides[SideRight].PeerWScale = m.WScale, m.WScale
			a.emit(JoinedWScale{Session: s.id, Rev: m.WScale})
		}
		if m.Flags&FlagRefuse != 0 {
			// A host after us refused the new path: it will never be
			// used.
			a.progress(s, m.Req, RoleNewHop, StageDone, "new path refused further on: "+m.Reason.String())
			if m.Reason == ReasonOnPath || m.Reason == ReasonStale || m.Reason == ReasonNF {
				// It did not pass the SYN on (a host on the path
				// already, or the right anchor of a request that is
				// over): nothing after it to free.
				// Leave (the left anchor's cancelLock on the new path
				// would find nothing here to pass on to).
				a.emit(FreeSession{Session: s.id})
				a.drop(s)
				return
			}
			// Its join failed after it passed the SYN on: stay, as it
			// does, for the left anchor's cancelLock on the new path to
			// pass through to the hosts after it (onJoinFailed).
			s.joinFailed, s.failedAt = true, m.Hops[0]
			a.setTimer(s, TimerLease, s.joinReq, a.cfg.LockLease)
		}
		return
	}
	a.reject(RejectUnexpected, m, ref.peer, "synAck for %s", m.Req)
}

// newPathUp is the left anchor's step when the new path has answered in
// settingUp: wait for the agent (a gated request), or switch and ACK.
func (a *Agent) newPathUp(s *session, l *anchor) {
	a.cancelTimer(s, TimerSyn, l.req)
	if l.gate {
		l.gated = true
		a.setTimer(s, TimerGate, l.req, a.cfg.GateTimeout)
		a.progress(s, l.req, RoleLeftAnchor, StageSettingUp, "new path ready; waiting for the agent")
		a.emit(NewPathReady{Session: s.id, Token: l.token, Req: l.req, RightAnchor: l.rightAnchor,
			Chain: append([]netip.Addr(nil), l.chain...), OldPeer: s.sides[SideRight].Peer, NewPeer: l.newPeer,
			OldSub: s.sides[SideRight].Sub, NewSub: l.newSub, LeftDelta: l.delta})
		if l.mig != nil {
			a.startMigration(s, l)
		}
		return
	}
	a.switchAndAck(s, l)
}

// switchAndAck is the left anchor's switch to the new path. It switches
// before the ACK goes: an agent that restarts in between resumes a
// switched side (the right anchor's armed side follows the first packet),
// never an ACKed one that did not switch.
func (a *Agent) switchAndAck(s *session, l *anchor) {
	a.switchPaths(s, l, SideRight)
	a.sendAck(s, l)
}

// sendAck sends the new path's ACK to the first new hop.
func (a *Agent) sendAck(s *session, l *anchor) {
	a.send(l.newPeer, a.msg(s, MsgAck, l.newSub, l.req, l.rightAnchor))
}

func (a *Agent) onAck(s *session, ref subRef, m *Message) {
	if r := s.right; r != nil && r.req == m.Req && r.newSub == m.Sub {
		if r.stage == StageWaitAck {
			a.switchPaths(s, r, SideLeft)
		}
		return
	}
	if s.joinReq == m.Req && ref.side == SideLeft && !s.joinFailed {
		f := *m
		a.sendSide(s, SideRight, &f)
		return
	}
	a.reject(RejectUnexpected, m, ref.peer, "ack for %s", m.Req)
}

// switchPaths starts an anchor's two-path phase (§3.5): new data goes on
// the new path from now on; the window is clamped (§5.3).
func (a *Agent) switchPaths(s *session, an *anchor, side Side) {
	if an.stage == StageTwoPath {
		return
	}
	if an.role == RoleRightAnchor {
		a.cancelTimer(s, TimerLease, an.req)
	}
	an.stage, an.tries = StageTwoPath, 0
	a.emit(StartTwoPath{Session: s.id, Side: side, Old: s.sides[side].Sub, New: an.newSub})
	if s.proto == ProtoUDP {
		// Every datagram from now on goes on the new path; both paths
		// are accepted until the old one is torn down (udp.go).
		a.progress(s, an.req, an.role, StageTwoPath, "")
		a.udpSwitched(s, an)
		return
	}
	if an.role == RoleRightAnchor {
		a.migReleaseRight(s, an) // what it held goes on the new path
	}
	a.emit(SetWindowClamp{Session: s.id, Side: side, Bytes: a.cfg.WindowClamp})
	a.progress(s, an.req, an.role, StageTwoPath, "")
}
