package protocol

import (
	"net/netip"
	"slices"
	"time"

	"github.com/dysco/dysco/internal/wire"
)

// Triggers (§2.3: "a middlebox can ask to be removed"; §4.2: a proxy
// removes itself by splice). A middlebox is in the middle of the segments
// around it, so it cannot be their left anchor: it asks the left neighbour
// of a session, the agent at the other end of its left subsession, to
// reconfigure as left anchor (§3.1). The trigger is a control message like
// the others (§3.3): authenticated by the deployment key and the session's
// nonce, checked against the subsession's peer and direction, retransmitted
// by the sender with the usual back-off until answered (§3.6), and answered
// with the result of the request it started.
//
// Identity: a trigger is named by its sender and a number from the
// sender's request counter (ReqKey; Config.FirstReq), so its numbers grow
// like its requests' and survive a restart of the sender's agent. The left
// neighbour keeps, per session, the triggers it took (running, or answered
// with their answer: a retransmission gets the same answer), and marks
// every trigger number in its sender's window (replay.go): a trigger not
// in the session's history whose number is known there, or older than the
// window, is a replay or a stale retransmission, refused and not answered.
//
// At the left neighbour a trigger is refused, and answered so, when its
// subsession does not lead to its sender (ReasonWrongSender), when the
// session's right side is being reconfigured (ReasonBusy, naming that
// request: the sender may ask again), or when the subsession is no longer
// the side's current one (ReasonNotNextHop: a reconfiguration took the
// sender out of the path and its old subsession lingers here, §3.5; the
// sender must not reconfigure the segment that replaced it). Otherwise it
// starts a request as any local one would (onReconfigure), whose Result
// the agent gets as usual, marked with the trigger (Result.Trigger), and
// whose outcome the answer carries.

// trigOut is a trigger this agent sent, waiting for its answer. It is kept
// apart from the session: a middlebox that asked to be removed may leave
// the path (its session freed, §3.5) before the answer comes.
type trigOut struct {
	key     ReqKey
	token   uint64
	session SessionID
	to      netip.Addr
	sub     wire.Tuple
	nonce   [wire.NonceLen]byte
	msg     *Message
	// sent counts the transmissions (the back-off); unanswered those
	// since the last answer that the request still runs.
	sent, unanswered int
	armed            bool // its retransmission timer is set
}

// trigIn is a trigger this agent took as a session's left neighbour.
type trigIn struct {
	key   ReqKey
	sub   wire.Tuple // the subsession it came on (its answer goes back on it)
	peer  netip.Addr // its sender
	nonce [wire.NonceLen]byte
	ra    netip.Addr
	token uint64
	at    time.Duration
	// report is the agent's report of the request's gate (Proceed.Report).
	report []byte
	// answer is the answer sent, nil while the request runs.
	answer *Message
}

// sendTrigger sends a trigger for a session to its left neighbour
// (Trigger). A session with no left side, or a request no left neighbour
// could take (an invalid right anchor or chain, a migration not of one
// middlebox by one), is refused here at once.
func (a *Agent) sendTrigger(e Trigger) {
	s := a.sessions[e.Session]
	local := func(r Reason) {
		a.emit(TriggerResult{Session: e.Session, Token: e.Token, Outcome: Refused, Reason: r})
	}
	if s == nil || s.sides[SideLeft] == nil {
		local(ReasonNoSession)
		return
	}
	left := s.sides[SideLeft]
	if !a.triggerChainOK(e, left.Peer) {
		local(ReasonInvalid)
		return
	}
	a.nextReq++
	k := ReqKey{LeftAnchor: a.cfg.Self, ID: a.nextReq}
	m := &Message{Type: MsgTrigger, Nonce: left.Nonce, Sub: left.Sub, Session: s.tuple, Req: k,
		RightAnchor: e.RightAnchor, Hops: slices.Clone(e.Chain)}
	if e.Migrate != nil {
		sp := *e.Migrate
		m.Migrate = &sp
	}
	if _, err := m.Encode(a.cfg.Keys, a.source(left.Peer)); err != nil {
		local(ReasonInvalid)
		return
	}
	t := &trigOut{key: k, token: e.Token, session: s.id, to: left.Peer, sub: left.Sub, nonce: left.Nonce, msg: m}
	a.triggers[k] = t
	a.transmitTrigger(t)
}

// triggerChainOK checks what Decode demands of a trigger and what its left
// neighbour's request will (checkChain): a unicast right anchor of this
// agent's family other than the left neighbour, at most wire.MaxHops-1
// distinct unicast hops of the family naming neither, a migration only of
// one middlebox by one.
func (a *Agent) triggerChainOK(e Trigger, leftPeer netip.Addr) bool {
	ok := func(x netip.Addr) bool {
		return x.IsValid() && wire.Unicast(x) && x.Unmap().Is4() == a.cfg.Self.Unmap().Is4()
	}
	if !ok(e.RightAnchor) || e.RightAnchor == leftPeer || len(e.Chain)+1 > wire.MaxHops {
		return false
	}
	seen := map[netip.Addr]bool{leftPeer: true, e.RightAnchor: true}
	for _, h := range e.Chain {
		if !ok(h) || seen[h] {
			return false
		}
		seen[h] = true
	}
	if sp := e.Migrate; sp != nil && (len(e.Chain) != 1 || sp.Semantics > MigrateSubstream || sp.HoldLimit > maxHoldLimit) {
		return false
	}
	return true
}

// transmitTrigger sends a trigger (again) and sets its retransmission
// timer, with the back-off of every message (§3.6). Each copy is signed
// under the keys of the moment (a rotation may have changed them).
func (a *Agent) transmitTrigger(t *trigOut) {
	t.sent++
	t.unanswered++
	a.send(t.to, t.msg)
	t.armed = true
	a.emit(SetTimer{ID: t.timerID(), At: a.now + a.backoff(t.sent)})
}

func (t *trigOut) timerID() TimerID {
	return TimerID{Session: t.session, Kind: TimerTrigger, Req: t.key}
}

// onTriggerTimer retransmits a trigger, or gives up after MaxTries
// transmissions with no answer since the last sign of life (§3.6).
func (a *Agent) onTriggerTimer(id TimerID) {
	t := a.triggers[id.Req]
	if t == nil || !t.armed {
		return
	}
	t.armed = false
	if t.unanswered >= a.cfg.MaxTries {
		delete(a.triggers, t.key)
		a.emit(TriggerResult{Session: t.session, Token: t.token, Trigger: t.key, To: t.to, Outcome: Failed, Reason: ReasonNoAnswer})
		return
	}
	a.transmitTrigger(t)
}

// onTriggerResult takes the answer to a trigger this agent sent: it must
// come from the left neighbour the trigger went to, on the subsession it
// named, with its nonce (§2.3). An answer that the request still runs
// keeps the trigger alive (its retransmissions count afresh); the final
// one ends it. An answer to no pending trigger (a duplicate, or after
// this agent gave up) is refused.
func (a *Agent) onTriggerResult(from netip.Addr, m *Message) {
	t := a.triggers[m.Req]
	switch {
	case t == nil:
		a.reject(RejectUnexpected, m, from, "answer to trigger %s: none pending (answered already, or given up)", m.Req)
		return
	case from != t.to:
		a.reject(RejectWrongPeer, m, from, "answer to trigger %s, sent to %s", m.Req, t.to)
		return
	case m.Nonce != t.nonce:
		a.reject(RejectNonce, m, from, "answer to trigger %s", m.Req)
		return
	case m.Sub != t.sub:
		a.reject(RejectUnexpected, m, from, "answer to trigger %s on subsession %s, sent on %s", m.Req, m.Sub, t.sub)
		return
	}
	x := m.Answer
	if x.Outcome == 0 {
		t.unanswered = 0 // the left neighbour is at it
		return
	}
	delete(a.triggers, t.key)
	if t.armed {
		t.armed = false
		a.emit(CancelTimer{ID: t.timerID()})
	}
	r := TriggerResult{Session: t.session, Token: t.token, Trigger: t.key, To: t.to, Answered: true,
		Outcome: x.Outcome, Reason: m.Reason, Blocker: m.Blocker, Hop: x.Hop,
		Unchanged: x.Unchanged, Unconfirmed: x.Unconfirmed, Resumed: x.Resumed,
		Micros: int64(min(x.Micros, 1<<62)), Report: x.Report}
	if x.ReqID != 0 {
		r.Req = ReqKey{LeftAnchor: from, ID: x.ReqID}
	}
	a.emit(r)
}

// onTrigger handles a trigger at the left neighbour, on a subsession of
// session s whose nonce it carries (onMessage checked it): duplicates and
// replays first, then the refusals, then the request (§2.3, §3.1).
func (a *Agent) onTrigger(s *session, ref subRef, m *Message, from netip.Addr) {
	k := m.Req
	if k.LeftAnchor != from {
		// The number is the sender's: nobody marks another's window.
		a.reject(RejectWrongPeer, m, from, "trigger %s sent by %s", k, from)
		return
	}
	if ref.side != SideRight {
		a.reject(RejectUnexpected, m, from, "trigger on the left side")
		return
	}
	if a.cfg.Faults&FaultTriggerDup == 0 {
		if t := s.trigger(k); t != nil {
			// A retransmission (§3.6): the same answer, or, while the
			// request runs, an acknowledgement that it does.
			if t.answer != nil {
				a.send(t.peer, t.answer)
			} else {
				a.sendTriggerAnswer(s, t, &TriggerAnswer{Micros: uint64(max(a.now-t.at, 0) / time.Microsecond)}, 0, ReqKey{})
			}
			return
		}
		if a.knownReq(k) {
			a.reject(RejectReplay, m, from, "trigger %s: heard of already, or older than the window", k)
			return
		}
	}
	a.heardOf(k)
	t := &trigIn{key: k, sub: m.Sub, peer: from, nonce: ref.nonce, ra: m.RightAnchor, at: a.now}
	s.addTrigger(t)
	right := s.sides[SideRight]
	switch {
	case ref.peer != from:
		a.refuseTrigger(s, t, ReasonWrongSender, ReqKey{})
		return
	case s.left != nil:
		// The side is in a reconfiguration (this agent its left anchor):
		// the sender may ask again once it has ended (§3.2).
		a.refuseTrigger(s, t, ReasonBusy, s.left.req)
		return
	case ref.tomb || right == nil || right.Sub != m.Sub:
		// An old path after teardown (§3.5), kept to answer fins: the
		// sender left the session's path.
		a.refuseTrigger(s, t, ReasonNotNextHop, ReqKey{})
		return
	case m.Migrate != nil && len(m.Hops) != 1:
		a.refuseTrigger(s, t, ReasonInvalid, ReqKey{})
		return
	}
	a.trigTokens++
	t.token = a.cfg.TriggerTokens + a.trigTokens
	a.emit(TriggerAccepted{Session: s.id, Token: t.token, Trigger: k, Migrate: m.Migrate})
	a.onReconfigure(Reconfigure{Session: s.id, RightAnchor: m.RightAnchor, Chain: m.Hops, Token: t.token,
		Migrate: m.Migrate}, t)
}

// onTriggerUnknown handles a trigger naming a subsession no session of
// this agent has. If the subsession leads from this agent to the sender
// and the trigger is new (the sender's window, replay.go), it is answered
// once, refused: the session ended here (gone: the datapath holds no
// session of the nonce either), or there is none. A replay, or a
// retransmission of a trigger whose refusal was lost, gets no answer;
// its sender gives up after its retransmissions (§3.6).
func (a *Agent) onTriggerUnknown(e MessageIn, m *Message) {
	k := m.Req
	if k.LeftAnchor != e.From || m.Sub.Src != a.source(e.From) || m.Sub.Dst != e.From {
		a.reject(RejectUnknownSession, m, e.From, "trigger for no subsession %s", m.Sub)
		return
	}
	if a.knownReq(k) {
		a.reject(RejectReplay, m, e.From, "trigger %s for no subsession: heard of already", k)
		return
	}
	a.heardOf(k)
	a.reject(RejectUnknownSession, m, e.From, "trigger for no subsession %s", m.Sub)
	r := ReasonNoSession
	if e.Gone {
		r = ReasonSessionEnded
	}
	a.send(e.From, &Message{Type: MsgTriggerResult, Reason: r, Nonce: m.Nonce, Sub: m.Sub, Session: m.Session,
		Req: k, RightAnchor: m.RightAnchor, Answer: &TriggerAnswer{Outcome: Refused}})
}

// refuseTrigger answers a trigger that starts no request.
func (a *Agent) refuseTrigger(s *session, t *trigIn, r Reason, blocker ReqKey) {
	a.answerTrigger(s, t, Result{Outcome: Refused, Reason: r, Blocker: blocker})
}

// answerTrigger sends the final answer to trigger t: the result of its
// request (res), kept for retransmissions.
func (a *Agent) answerTrigger(s *session, t *trigIn, res Result) {
	x := &TriggerAnswer{Outcome: res.Outcome, Unchanged: res.Unchanged, Unconfirmed: res.Unconfirmed,
		Resumed: res.Resumed, ReqID: res.Req.ID, Micros: uint64(max(a.now-t.at, 0) / time.Microsecond)}
	if h := res.Hop; h.IsValid() && wire.Unicast(h) && h.Unmap().Is4() == t.sub.Src.Unmap().Is4() {
		x.Hop = h
	}
	if len(t.report) <= MaxReportLen {
		x.Report = t.report
	}
	t.answer = a.sendTriggerAnswer(s, t, x, res.Reason, res.Blocker)
}

// sendTriggerAnswer sends an answer to trigger t on the subsession it came
// on, with that subsession's nonce, and returns it.
func (a *Agent) sendTriggerAnswer(s *session, t *trigIn, x *TriggerAnswer, r Reason, blocker ReqKey) *Message {
	m := &Message{Type: MsgTriggerResult, Reason: r, Blocker: blocker, Nonce: t.nonce, Sub: t.sub, Session: s.tuple,
		Req: t.key, RightAnchor: t.ra, Answer: x}
	if b := m.Blocker.LeftAnchor; b.IsValid() && b.Unmap().Is4() != t.sub.Src.Unmap().Is4() {
		m.Blocker = ReqKey{}
	}
	a.send(t.peer, m)
	return m
}

// emitResult reports the end of a request at its left anchor, and answers
// the trigger that asked for it, if one did.
func (a *Agent) emitResult(s *session, t *trigIn, res Result) {
	if t != nil {
		res.Trigger = t.key
	}
	a.emit(res)
	if t != nil && s != nil {
		a.answerTrigger(s, t, res)
	}
}

// trigger returns the trigger k this session took, if it is still in its
// history.
func (s *session) trigger(k ReqKey) *trigIn {
	for _, t := range s.trigs {
		if t.key == k {
			return t
		}
	}
	return nil
}

// addTrigger records a trigger taken for the session, forgetting the
// oldest answered ones beyond historyLen (a running one stays: its answer
// is to come).
func (s *session) addTrigger(t *trigIn) {
	s.trigs = append(s.trigs, t)
	answered := 0
	for _, x := range s.trigs {
		if x.answer != nil {
			answered++
		}
	}
	for i := 0; answered > historyLen && i < len(s.trigs); {
		if s.trigs[i].answer != nil {
			s.trigs = append(s.trigs[:i], s.trigs[i+1:]...)
			answered--
			continue
		}
		i++
	}
}
