package protocol

import (
	"errors"
	"net/netip"

	"github.com/dysco/dysco/internal/wire"
)

// Messages: building, sending and dispatching control messages, and the
// history of resolved requests (a duplicate gets the same answer).

func (a *Agent) msg(s *session, t MsgType, sub wire.Tuple, req ReqKey, ra netip.Addr) *Message {
	nonce := s.nonce
	if r, ok := a.subs[sub]; ok && r.id == s.id {
		nonce = r.nonce
	}
	return &Message{Type: t, Nonce: nonce, Sub: sub, Session: s.tuple, Req: req, RightAnchor: ra, Proto: s.proto}
}

// send sends m to the agent at to. A message about a subsession between
// this agent and to leaves from this agent's end of it, which to checks
// (onMessage, onNewSyn) and which the MAC covers: usually the address the
// route to to chooses, another of this host's when the left anchor moves
// the session to it (Reconfigure.Source).
func (a *Agent) send(to netip.Addr, m *Message) {
	from := a.source(to)
	if r, ok := a.subs[m.Sub]; ok && r.peer == to {
		switch to {
		case m.Sub.Dst:
			from = m.Sub.Src
		case m.Sub.Src:
			from = m.Sub.Dst
		}
	}
	a.sendFrom(to, from, m)
}

// sendFrom sends m to the agent at to from this host's address from,
// which the MAC covers.
func (a *Agent) sendFrom(to, from netip.Addr, m *Message) {
	b, err := m.Encode(a.cfg.Keys, from)
	if err != nil {
		panic("protocol: encoding a message we built: " + err.Error())
	}
	a.emit(Send{To: to, From: from, Msg: m, Data: b})
}

// sendSide sends m on the session's current subsession of side.
func (a *Agent) sendSide(s *session, side Side, m *Message) {
	sd := s.sides[side]
	m.Sub = sd.Sub
	m.Nonce = sd.Nonce
	a.send(sd.Peer, m)
}

// rightward reports whether m travels from the left anchor towards the right one.
func rightward(m *Message) bool {
	switch m.Type {
	case MsgRequestLock, MsgCancelLock, MsgSyn, MsgAck:
		return true
	case MsgFin, MsgFinAck:
		return m.Flags&FlagLeftward == 0
	}
	return false
}

func (a *Agent) onMessage(e MessageIn) {
	m, err := Decode(a.cfg.Keys, e.From, e.Data)
	if err != nil {
		var de *DecodeError
		if errors.As(err, &de) {
			a.reject(de.Reason, nil, e.From, "%s", de.Detail)
		} else {
			a.reject(RejectMalformed, nil, e.From, "%v", err)
		}
		return
	}
	if m.Type == MsgMigrate || m.Type == MsgMigrateAnswer {
		a.onMigrate(e, m)
		return
	}
	if m.Type == MsgTriggerResult {
		// Answers to triggers are matched with the trigger, not a
		// session: the sender may have left the path meanwhile.
		a.onTriggerResult(e.From, m)
		return
	}
	ref, ok := a.subs[m.Sub]
	if !ok {
		if m.Type == MsgTrigger {
			a.onTriggerUnknown(e, m)
			return
		}
		if m.Type == MsgSyn {
			a.onNewSyn(e.From, m, e.OnPath)
			return
		}
		if m.Type == MsgCancelLock && m.Flags&FlagNewPath != 0 {
			return // the new path's state is already gone
		}
		a.reject(RejectUnknownSession, m, e.From, "no subsession %s", m.Sub)
		if e.Gone && m.Type == MsgRequestLock {
			// The session ended here: its request cannot lock the
			// segment. Tell the left anchor now, and again at each of its
			// retransmissions (gone.go); the answer goes back the way the
			// request came, as any nackLock.
			a.onGoneRequest(m, e.From)
		}
		return
	}
	s := a.sessions[ref.id]
	if m.Nonce != ref.nonce {
		a.reject(RejectNonce, m, e.From, "session %d", s.id)
		return
	}
	if m.Type == MsgTrigger {
		// The sender, direction and current subsession are checked
		// there: some of those refusals are answered.
		a.onTrigger(s, ref, m, e.From)
		return
	}
	if m.Type == MsgRebind {
		// It comes from the sender's new address (rebind.go).
		a.onRebindIn(s, ref, m, e.From)
		return
	}
	if ref.moved {
		if m.Type == MsgRebindAck {
			a.onLateRebindAck(s, ref, m, e.From)
			return
		}
		a.reject(RejectUnexpected, m, e.From, "%s on subsession %s, which a rebind replaced", m.Type, m.Sub)
		return
	}
	if e.From != ref.peer {
		a.reject(RejectWrongPeer, m, e.From, "subsession %s belongs to %s", m.Sub, ref.peer)
		return
	}
	if m.Type == MsgRebindAck {
		a.onRebindAck(s, m)
		return
	}
	if rightward(m) != (ref.side == SideLeft) {
		a.reject(RejectUnexpected, m, e.From, "%s arrived on the %s side", m.Type, ref.side)
		return
	}
	if ref.tomb {
		a.onTomb(s, ref, m)
		return
	}
	if s.sides[ref.side].Sub != m.Sub && !a.onNewSub(s, ref, m) {
		return
	}
	if m.Flags&flagsClosed != 0 {
		a.onClosedNotice(s, ref, m)
		return
	}
	switch m.Type {
	case MsgRequestLock:
		a.onRequestLock(s, m, e.From, false)
	case MsgAckLock:
		a.onAckLock(s, m)
	case MsgNackLock:
		a.onNackLock(s, m)
	case MsgCancelLock:
		a.onCancelLock(s, m)
	case MsgAckCancel:
		a.onAckCancel(s, m)
	case MsgSyn:
		a.onSynDup(s, ref, m)
	case MsgSynAck:
		a.onSynAck(s, ref, m)
	case MsgAck:
		a.onAck(s, ref, m)
	case MsgFin:
		a.onFin(s, ref, m)
	case MsgFinAck:
		a.onFinAck(s, ref, m)
	}
}

// History of resolved requests: duplicates get the same answer.

func (s *session) resolved(k ReqKey) (resolution, bool) {
	for i := len(s.history) - 1; i >= 0; i-- {
		if s.history[i].req == k {
			return s.history[i], true
		}
	}
	return resolution{}, false
}

func (s *session) resolve(r resolution) {
	for i := range s.history {
		if s.history[i].req == r.req {
			s.history[i] = r
			return
		}
	}
	s.history = append(s.history, r)
	if len(s.history) > historyLen {
		s.history = s.history[1:]
	}
}

func (s *session) queuedReq(k ReqKey) bool {
	for _, q := range s.queue {
		if q.msg != nil && q.msg.Req == k {
			return true
		}
	}
	return false
}
