package reconfig

// The session index: datapath sessions announced to the protocol core
// (lazily, when a message or request first concerns them), the ids of
// each, and what a restarted agent resumes from the datapath.

import (
	"fmt"
	"net/netip"

	"github.com/dysco/dysco/internal/datapath"
	"github.com/dysco/dysco/internal/protocol"
	"github.com/dysco/dysco/internal/wire"
)

func (c *Shell) onPacket(from netip.Addr, data []byte) {
	if isOldTrigger(data) {
		// A JSON trigger of control protocol version 1 to 3: the peer
		// runs an older agent.
		c.countReject(protocol.RejectVersion.String())
		c.olderPeer(from, "a JSON trigger (DYST)")
		return
	}
	if isOldMig(data) {
		// A JSON state migration message of control protocol version 1
		// to 3: the peer runs an older agent.
		c.countReject(protocol.RejectVersion.String())
		c.olderPeer(from, "a JSON state migration message (DYSM)")
		return
	}
	v6 := from.Is6()
	p := c.proto(v6)
	if p == nil {
		c.countReject("no_address")
		return
	}
	// A message about a session the protocol does not know yet: announce
	// the session from the datapath first (sessions are announced lazily,
	// when a reconfiguration first concerns them).
	onPath, gone := false, false
	if m, err := protocol.Decode(c.keys, from, data); err == nil && m.Type == protocol.MsgSyn {
		// A new path's SYN that would make this host join it: refused
		// if the session crosses this host already (one datapath state
		// per session tuple; protocol.MessageIn.OnPath).
		if _, _, known := p.Lookup(m.Sub); !known && m.RightAnchor != p.Self() && len(m.Hops) > 0 {
			_, onPath = c.liveHere(m.Session, m.Nonce, dpProto(m.Proto))
		}
	} else if err == nil && m.Type != protocol.MsgTriggerResult {
		// (An answer to a trigger names this host's subsession of a
		// session it may have left meanwhile: the protocol matches it
		// with its trigger, and it must not announce the session.)
		pid, _, ok := p.Lookup(m.Sub)
		if !ok {
			if id, ok := c.sessionBySub(m.Sub, dpProto(m.Proto)); ok {
				_ = c.announce(id)
			} else {
				// No session of the datapath has the subsession, nor
				// the session it names (an old path's subsession of a
				// live session is not an ended session).
				gone = !c.hasSession(m.Session, m.Nonce, dpProto(m.Proto))
			}
		} else if m.Type == protocol.MsgRequestLock && m.RightAnchor == p.Self() {
			// A joined session may be the right anchor now. (A middle
			// agent passes the request whether or not it is ready:
			// the look is a dozen map reads.)
			c.checkReady(pid)
		}
	}
	c.handle(v6, protocol.MessageIn{From: from, Data: data, OnPath: onPath, Gone: gone})
}

// liveHere reports whether this host carries a session of tuple t (as it
// arrives here) on a live path, which a new path's SYN for the session of
// nonce must not replace: a datapath session keyed by t, not reset, that
// the protocol either does not know (a chain set up through this host that
// no reconfiguration touched here) or knows on a live path
// (protocol.Agent.OnLivePath: not an old path past which both anchors'
// fins have gone), and that is either the session of nonce (FINs both
// ways do not end it: the bytes before them may still be on their way, or
// be sent again) or another one not closed both ways (a stale SYN of an
// earlier connection must not take over the tuple). A session of another
// nonce closed both ways is an earlier TCP connection of the same tuple:
// it gives way. It returns the session.
func (c *Shell) liveHere(t wire.Tuple, nonce [wire.NonceLen]byte, proto uint8) (uint32, bool) {
	const closed = datapath.StFINFwd | datapath.StFINRev
	for _, k := range []wire.Tuple{t, t.Reverse()} {
		f, ok := c.dp.Flow(datapath.TupleOf(k, proto))
		if !ok {
			continue
		}
		s, ok := c.dp.Session(f.SessId)
		if !ok || s.State&datapath.StRST != 0 || s.Nonce != nonce && s.State&closed == closed {
			continue
		}
		pid, known := c.pidOf[f.SessId]
		if !known {
			return f.SessId, true
		}
		if p := c.protos[c.famOf[f.SessId]]; p == nil || p.OnLivePath(pid) {
			return f.SessId, true
		}
	}
	return 0, false
}

// hasSession reports whether the datapath holds a session of tuple t (as
// it arrives here, either way) with the given nonce.
func (c *Shell) hasSession(t wire.Tuple, nonce [wire.NonceLen]byte, proto uint8) bool {
	for _, k := range []wire.Tuple{t, t.Reverse()} {
		if f, ok := c.dp.Flow(datapath.TupleOf(k, proto)); ok {
			if s, ok := c.dp.Session(f.SessId); ok && s.Nonce == nonce {
				return true
			}
		}
	}
	return false
}

// sessionBySub finds the datapath session that has subsession sub (as its
// SYN went) on one of its sides at this host.
func (c *Shell) sessionBySub(sub wire.Tuple, proto uint8) (uint32, bool) {
	for _, k := range []wire.Tuple{sub, sub.Reverse()} {
		if f, ok := c.dp.Flow(datapath.TupleOf(k, proto)); ok && f.Flags&datapath.FlIngress != 0 {
			return f.SessId, true
		}
	}
	return 0, false
}

// announce tells the protocol about a datapath session (SessionUp), unless
// it knows it already.
func (c *Shell) announce(id uint32) error {
	if _, ok := c.pidOf[id]; ok {
		return nil
	}
	s, ok := c.dp.Session(id)
	if !ok {
		return fmt.Errorf("no session %d", id)
	}
	// A session that one end has closed carries the other's data still,
	// and a FIN is a byte of the stream for the two-path rules (§3.5):
	// such a session is reconfigured like any other. One that has not
	// completed its handshake, or is reset, has nothing to reconfigure.
	if s.State&datapath.StEst == 0 {
		return fmt.Errorf("session %d is not established", id)
	}
	if s.State&datapath.StRST != 0 {
		return fmt.Errorf("session %d was reset", id)
	}
	t := s.Tuple.Wire()
	// The tuple a new path to the right carries (its SYN's session tuple)
	// is the one the old path carried from here: behind a NAT, the
	// middlebox's output.
	up := protocol.SessionUp{Session: protocol.SessionID(id), Tuple: c.onward(id, &s), Nonce: s.Nonce}
	if s.Proto == datapath.ProtoUDP {
		up.Proto = protocol.ProtoUDP // the two-path phase for datagrams (protocol/udp.go)
	}
	ws := func(i int) uint8 {
		if s.Ws[i] == 0xff {
			return 0
		}
		return s.Ws[i]
	}
	// Right side: the egress flow of the SYN's direction.
	if s.Role == datapath.RoleStart || s.Role == datapath.RoleMiddle {
		if sub, ok := c.currentSub(id, &s, protocol.SideRight); ok {
			up.Right = &protocol.SideInfo{Peer: sub.Dst, Sub: sub, SendWScale: ws(0), PeerWScale: ws(1)}
			c.reconfigured(id, protocol.SideRight, up.Right)
		}
	}
	if s.Role != datapath.RoleStart {
		if sub, ok := c.currentSub(id, &s, protocol.SideLeft); ok {
			up.Left = &protocol.SideInfo{Peer: sub.Src, Sub: sub, SendWScale: ws(1), PeerWScale: ws(0)}
			c.reconfigured(id, protocol.SideLeft, up.Left)
		}
	}
	if up.Left == nil && up.Right == nil {
		detail := ""
		for _, k := range []wire.Tuple{up.Tuple, t.Reverse()} {
			if f, ok := c.dp.Flow(datapath.TupleOf(k, s.Proto)); ok {
				detail += fmt.Sprintf("; flow %s: session %d flags %#x -> %s", k, f.SessId, f.Flags, f.Out.Wire())
			} else {
				detail += fmt.Sprintf("; no flow %s", k)
			}
		}
		return fmt.Errorf("session %d (%s, %s) has no subsession at this host%s", id, t, datapath.RoleName(s.Role), detail)
	}
	if up.Left != nil && up.Right != nil {
		if la, n, ok := c.dp.Lock(id); ok {
			up.Lock = protocol.ReqKey{LeftAnchor: addrFrom16(la), ID: n}
		}
	}
	v6 := t.Dst.Is6() && !t.Dst.Is4In6()
	c.pidOf[id], c.famOf[id] = protocol.SessionID(id), v6
	var resumed []datapath.TPKey
	for side, si := range map[protocol.Side]*protocol.SideInfo{protocol.SideLeft: up.Left, protocol.SideRight: up.Right} {
		if si != nil && si.Resume != nil && si.Resume.Switched {
			resumed = append(resumed, datapath.TPKey{SessId: id, Side: uint32(side)})
		}
	}
	c.handle(v6, up)
	for _, k := range resumed {
		// A side resumed in its two-path phase: its variables now, and
		// the polling safety net from here on.
		c.active[k] = true
		c.progress(k)
	}
	return nil
}

// reconfigured fills in what an earlier reconfiguration of a side left in
// the datapath's two-path record (addSub): the side's delta (§3.4; Nd is
// what its egress subtracts from acks and echoed timestamps) and the nonce
// of its control messages (the left anchor's, §3.3). The protocol learns
// them from here when it meets the session afresh, after an agent restart:
// with a zero delta the side's next reconfiguration would compose a wrong
// one, and with the session's own nonce the other anchor's messages would
// be rejected.
//
// A side still in a reconfiguration (the agent restarted during it) is
// resumed (protocol.Resume) from the request the agent kept beside the
// record (datapath.TPReq): si describes the old path then, whose delta and
// nonce are those of the record before the request, if any.
func (c *Shell) reconfigured(id uint32, side protocol.Side, si *protocol.SideInfo) {
	k := datapath.TPKey{SessId: id, Side: uint32(side)}
	tp, ok := c.dp.TwoPath(k)
	if !ok {
		return
	}
	deltaOf := func(tp datapath.TPVal) protocol.Delta {
		return protocol.Delta{Seq: uint32(-tp.Nd.Ack), TS: uint32(-tp.Nd.Tsecr)}
	}
	if tp.State == datapath.TPNew {
		si.Delta, si.Nonce = deltaOf(tp), tp.Nonce
		return
	}
	rq, ok := c.dp.TPReqOf(k)
	if !ok {
		c.log.Warn("control: a reconfiguration left unfinished by an earlier agent cannot be resumed (no request recorded)",
			"session", id, "side", side.String())
		return
	}
	want := uint8(datapath.TPReqLeftAnchor)
	if side == protocol.SideLeft {
		want = datapath.TPReqRightAnchor
	}
	if rq.Role != want {
		c.log.Warn("control: a reconfiguration record does not match its side", "session", id, "side", side.String(), "role", rq.Role)
		return
	}
	si.Nonce = rq.OldNonce
	if rq.HasPrev != 0 {
		si.Delta = deltaOf(rq.Prev)
		c.prevTP[k] = rq.Prev
	}
	newSub := tp.NewOut.Wire() // as the side sends: from here to the new peer
	newPeer := newSub.Dst
	if side == protocol.SideLeft {
		newSub, newPeer = newSub.Reverse(), newSub.Dst
	}
	si.Resume = &protocol.Resume{
		Req:         protocol.ReqKey{LeftAnchor: addrFrom16(rq.LeftAnchor), ID: rq.Id},
		RightAnchor: addrFrom16(rq.RightAnchor),
		NewSub:      newSub, NewPeer: newPeer, NewNonce: tp.Nonce, NewDelta: deltaOf(tp),
		Switched: tp.State == datapath.TPActive || tp.State == datapath.TPStarting,
	}
}

// addrFrom16 reads an address kept in 16 bytes (IPv4 as IPv4-mapped).
func addrFrom16(b [16]byte) netip.Addr { return netip.AddrFrom16(b).Unmap() }

// resumeAll takes up the reconfigurations an earlier agent left unfinished
// (an agent restart): every session with a side in a reconfiguration, or
// with a lock the agent held as a middle agent of an old path
// (protocol.KeepLock), is announced to the protocol at once, which resumes
// them (reconfigured, SessionUp.Lock).
// A proxy's joined sessions are taken up first (resumeSpliced): the lock
// kept for one is under its client session, which must not be announced
// as a session of its own.
// Loop goroutine.
func (c *Shell) resumeAll() {
	c.resumeSpliced()
	ids := map[uint32]bool{}
	if err := c.dp.EachTwoPath(func(k datapath.TPKey, v datapath.TPVal) {
		if v.State != datapath.TPNew {
			ids[k.SessId] = true
		}
	}); err != nil {
		c.log.Warn("control: reconfigurations of an earlier agent", "err", err)
		return
	}
	if err := c.dp.EachLock(func(id uint32) { ids[id] = true }); err != nil {
		c.log.Warn("control: locks kept by an earlier agent", "err", err)
	}
	for id := range ids {
		if _, ok := c.pidOf[id]; ok {
			continue // a proxy's joined session, taken up already
		}
		if err := c.announce(id); err != nil {
			if _, ok := c.dp.Session(id); !ok {
				c.dp.DeleteLock(id) // kept for a session gone meanwhile
			}
			c.log.Warn("control: a reconfiguration of an earlier agent cannot be resumed", "session", id, "err", err)
			continue
		}
		c.log.Info("control: resumed a reconfiguration of an earlier agent", "session", id)
	}
}

// currentSub returns the subsession a side of session id (s at this host)
// sends on, written as its SYN went: from the side's two-path record once
// a reconfiguration has touched it, else from the side's egress flow, keyed
// on the left by the reverse of the session tuple and on the right by the
// onward tuple (behind a NAT, the middlebox's output: onward).
func (c *Shell) currentSub(id uint32, s *datapath.Session, side protocol.Side) (wire.Tuple, bool) {
	var out wire.Tuple
	if tp, ok := c.dp.TwoPath(datapath.TPKey{SessId: id, Side: uint32(side)}); ok && tp.State == datapath.TPNew {
		out = tp.NewOut.Wire()
	} else if ok {
		out = tp.OldOut.Wire() // in a reconfiguration: the old path (after an earlier one, not the flow's)
	} else {
		eg := s.Tuple.Wire().Reverse()
		if side == protocol.SideRight {
			eg = c.onward(id, s)
		}
		f, ok := c.dp.Flow(datapath.TupleOf(eg, s.Proto))
		if !ok || f.SessId != id || f.Flags&datapath.FlIngress != 0 {
			return wire.Tuple{}, false
		}
		out = f.Out.Wire()
	}
	if side == protocol.SideLeft {
		return out.Reverse(), true
	}
	return out, true
}

// dpID maps a protocol session to its datapath session (0: none).
func (c *Shell) dpID(pid protocol.SessionID) uint32 {
	if id, ok := c.joinedDP[pid]; ok {
		return id
	}
	if pid&(1<<63) != 0 {
		return 0 // a joined session whose datapath state is gone
	}
	return uint32(pid)
}

// flowKeysOf returns the keys of a session's flows at this host, found
// from its tuple without walking the flow map: the egress flow of each
// direction, the ingress flow of the subsession each sends on, and the
// subsessions of its two-path records.
func (c *Shell) flowKeysOf(id uint32) []datapath.Tuple {
	s, ok := c.dp.Session(id)
	if !ok {
		return nil
	}
	seen := map[datapath.Tuple]bool{}
	var out []datapath.Tuple
	add := func(k datapath.Tuple) {
		if seen[k] {
			return
		}
		seen[k] = true
		if f, ok := c.dp.Flow(k); ok && f.SessId == id {
			out = append(out, k)
		}
	}
	t := s.Tuple.Wire()
	for _, eg := range []wire.Tuple{c.onward(id, &s), t.Reverse()} {
		k := datapath.TupleOf(eg, s.Proto)
		if f, ok := c.dp.Flow(k); ok && f.SessId == id {
			add(k)
			add(datapath.TupleOf(f.Out.Wire().Reverse(), s.Proto))
		}
	}
	for side := uint32(0); side < 2; side++ {
		if tp, ok := c.dp.TwoPath(datapath.TPKey{SessId: id, Side: side}); ok {
			add(tp.InOld)
			add(datapath.TupleOf(tp.NewOut.Wire().Reverse(), s.Proto))
		}
	}
	return out
}

// sessionsEnded is called by the collector with the sessions it ended.
func (c *Shell) sessionsEnded(ids []uint32) {
	c.post(func() {
		for _, id := range ids {
			delete(c.onwardOf, id)
			pid, ok := c.pidOf[id]
			if !ok {
				continue
			}
			c.handle(c.famOf[id], protocol.SessionEnd{Session: pid, Cause: "ended"})
			c.forget(id, pid)
			if p, ok := c.spliced[pid]; ok {
				// One of a proxy's joined sessions ended, and the joined
				// session with it: nothing of it is to be taken up after
				// a restart (the record and a kept lock are under the
				// client's session, which may outlive the server's).
				delete(c.spliced, pid)
				c.dp.DeleteReconfigState(p.client)
			}
		}
	})
}

func (c *Shell) forget(id uint32, pid protocol.SessionID) {
	c.drop(id, pid)
	c.dp.DeleteReconfigState(id)
}

// drop is forget for a session whose datapath state is freed already.
func (c *Shell) drop(id uint32, pid protocol.SessionID) {
	delete(c.onwardOf, id)
	delete(c.pidOf, id)
	delete(c.famOf, id)
	delete(c.joinedDP, pid)
	delete(c.notReady, pid)
	c.releaseNF(id)
	for side := uint32(0); side < 2; side++ {
		k := datapath.TPKey{SessId: id, Side: side}
		delete(c.active, k)
		delete(c.prevTP, k)
	}
}

// dpProto gives the datapath's protocol number (session_val.proto) of a
// protocol transport.
func dpProto(p protocol.Proto) uint8 {
	if p == protocol.ProtoUDP {
		return datapath.ProtoUDP
	}
	return datapath.ProtoTCP
}
