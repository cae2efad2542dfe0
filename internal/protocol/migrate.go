package protocol

import (
	"fmt"
	"net/netip"
	"time"

	"github.com/dysco/dysco/internal/wire"
)

// State migration (§3.5 last paragraph: a middlebox's state is moved while
// the new path is set up and unused; §5.3 "Middlebox replacement with
// state transfer"; M2M §5 for the cut-over semantics). A request with a
// migration spec (Reconfigure.Migrate) is gated: once the new path
// answered, its left anchor orchestrates the move before it switches:
//
//  1. freeze (order, substream): the left anchor holds the packets it
//     would send on the old path (Hold, answered by Held with its marks),
//     then asks the right anchor to do the same (a migrate message, op
//     freeze, sent straight to it); the right anchor holds, waits for its
//     side of the old path to drain (WaitDrained, Drained) and answers
//     with its marks;
//  2. drain: the left anchor waits for its side (WaitDrained, Drained);
//  3. export: the old middlebox's agent, asked on the old path (op
//     export), exports the session's state (ExportState, StateExported)
//     and answers with it;
//  4. import: the new middlebox's agent, asked on the new path (op
//     import, with the state), imports it (ImportState, StateImported) and
//     answers;
//  5. the left anchor reports MigrationDone; the agent answers with
//     Proceed (carrying its report), and the left anchor switches (§3.5).
//     Each anchor then lets its held packets go (ReleaseHold): the left
//     one after its switch, the right one at its own switch (the ACK or
//     the first packet on the new path).
//
// Any failure (a step fails, is not answered after MaxTries, a hold
// overflows, the migration's timeout) reports MigrationDone with the error;
// the Proceed that follows abandons the new path (§3.6): the session stays
// on the old path, the holds are released onto it (the right anchor's by
// the cancelLock that reaches it, or its hold's lease), and a new
// middlebox that imported the state releases it when it leaves the path
// (ReleaseState). The old middlebox keeps its state until its agent frees
// the old path.
//
// Messages: a migrate message carries the step (MigStep), the request
// (Req), its right anchor, the session, and the subsession it travels on
// with that subsession's nonce: export on the left anchor's old
// subsession, import on its new one, freeze and abort straight between the
// anchors naming the left anchor's new subsession with the new path's nonce
// (the right anchor knows it from the SYN: anchor.anchorNonce). Every
// receiver checks the sender against the subsession's peer or the
// request's anchor. The left anchor retransmits each step with the usual
// back-off (§3.6) until answered; an answer that the receiver still works
// resets its count. Receivers keep each step's answer (migServe) and
// answer a copy with it, or with "running" while they work: a step is
// never carried out twice.

// Defaults of a migration spec's zero fields.
const (
	DefaultHoldLimit    = 8 << 20
	DefaultMigTimeout   = 5 * time.Second
	DefaultDrainTimeout = 200 * time.Millisecond
	// rightHoldGrace is how much longer than the migration's timeout a
	// right anchor holds at most: the left anchor may be gone.
	rightHoldGrace = 5 * time.Second
)

// Maxima of a migration spec as a message carries it (a trigger from a
// middlebox, a freeze from the left anchor): larger values are clamped, so
// that no peer can make an anchor hold without bound or wait for ever.
const (
	MaxHoldLimit    = 256 << 20
	MaxMigTimeout   = 5 * time.Minute
	MaxDrainTimeout = 10 * time.Second
)

// MigrateSpecDefaults returns sp with its zero fields set to the defaults
// and the others clamped to the maxima.
func MigrateSpecDefaults(sp MigrateSpec) MigrateSpec {
	if sp.Semantics == MigrateDefault {
		sp.Semantics = MigrateLossFree
	}
	if sp.HoldLimit == 0 {
		sp.HoldLimit = DefaultHoldLimit
	}
	sp.HoldLimit = min(sp.HoldLimit, MaxHoldLimit)
	if sp.TimeoutMS == 0 {
		sp.TimeoutMS = uint32(DefaultMigTimeout / time.Millisecond)
	}
	sp.TimeoutMS = min(sp.TimeoutMS, uint32(MaxMigTimeout/time.Millisecond))
	return sp
}

// drainTimeout is a freeze's drain bound (ms), the default for 0, at most
// MaxDrainTimeout.
func drainTimeout(ms uint32) time.Duration {
	if ms == 0 {
		return DefaultDrainTimeout
	}
	return min(time.Duration(ms)*time.Millisecond, MaxDrainTimeout)
}

func (sp MigrateSpec) timeout() time.Duration { return time.Duration(sp.TimeoutMS) * time.Millisecond }

func (s MigrateSemantics) String() string {
	switch s {
	case MigrateLossFree:
		return "loss-free"
	case MigrateOrder:
		return "order"
	case MigrateSubstream:
		return "substream"
	}
	return "default"
}

// migPhase is where a left anchor's migration is.
type migPhase uint8

const (
	migHolding   migPhase = iota + 1 // Hold emitted, waiting for Held
	migFreezing                      // freeze sent to the right anchor
	migDraining                      // WaitDrained emitted
	migExporting                     // export sent to the old middlebox
	migImporting                     // import sent to the new middlebox
	migDone                          // MigrationDone emitted, waiting for Proceed
)

// migCall is a step this agent asked of another, until answered.
type migCall struct {
	to         netip.Addr
	msg        *Message
	sent       int
	unanswered int
}

// migLeft is a migration at its left anchor.
type migLeft struct {
	spec      MigrateSpec
	phase     migPhase
	held      bool // this anchor holds its old-path packets
	own, peer FlowMarks
	blob      []byte
	call      *migCall
	err, note string
	// at is when the current phase began; drain, export and imp are the
	// phases' durations.
	at                 time.Duration
	drain, export, imp time.Duration
}

// migRight is a freeze at the right anchor.
type migRight struct {
	spec      MigrateSpec
	drain     time.Duration // the drain's bound (order), the freeze's
	peer, own FlowMarks
	from      netip.Addr
	sub       wire.Tuple
	nonce     [wire.NonceLen]byte
	holding   bool // Hold emitted, no Held yet
	held      bool
	answer    *Message // the freeze's answer, once sent
	abort     *migCall // the abort sent to the left anchor
}

// migServe is a step this agent took as a middlebox (export, import).
type migServe struct {
	req    ReqKey
	op     MigOp
	peer   netip.Addr
	answer *Message // nil while the agent works
	msg    *Message // the request
}

// startMigration is the left anchor's step when the new path of a
// migrating request answered (newPathUp).
func (a *Agent) startMigration(s *session, l *anchor) {
	g := l.mig
	g.at = a.now
	a.setTimer(s, TimerMigrate, l.req, g.spec.timeout())
	oldPeer := s.sides[SideRight].Peer
	switch {
	case !l.delta.IsZero():
		a.migFail(s, l, fmt.Sprintf("the old segment changes the byte streams (delta %s): its middlebox is a proxy, whose state cannot move", l.delta))
		return
	case oldPeer == l.rightAnchor:
		a.migFail(s, l, "no middlebox between the anchors on the old path: no state to move")
		return
	case len(l.chain) != 1:
		a.migFail(s, l, fmt.Sprintf("the new path has %d middleboxes: state migration replaces one middlebox by one", len(l.chain)))
		return
	}
	if g.spec.Semantics == MigrateLossFree {
		// Make before break (M2M §5.1): nothing held.
		a.migExport(s, l)
		return
	}
	g.phase = migHolding
	a.emit(Hold{Session: s.id, Side: SideRight, Req: l.req, Semantics: g.spec.Semantics, Limit: g.spec.HoldLimit})
}

// migExport asks the old middlebox for the state, on the old path.
func (a *Agent) migExport(s *session, l *anchor) {
	g := l.mig
	g.phase, g.at = migExporting, a.now
	right := s.sides[SideRight]
	m := a.msg(s, MsgMigrate, right.Sub, l.req, l.rightAnchor)
	m.Mig = &MigStep{Op: MigExport}
	a.migCallStart(s, l, right.Peer, m)
}

func (a *Agent) migCallStart(s *session, l *anchor, to netip.Addr, m *Message) {
	l.mig.call = &migCall{to: to, msg: m}
	a.migTransmit(s, l.req, l.mig.call)
}

func (a *Agent) migTransmit(s *session, req ReqKey, c *migCall) {
	c.sent++
	c.unanswered++
	a.send(c.to, c.msg)
	a.setTimer(s, TimerMigrateMsg, req, a.backoff(c.sent))
}

// migFail ends a left anchor's migration with an error: the agent's
// Proceed then abandons the new path.
func (a *Agent) migFail(s *session, l *anchor, err string) {
	a.migFinish(s, l, err)
}

// migFinish reports the end of the migration's steps (MigrationDone).
func (a *Agent) migFinish(s *session, l *anchor, err string) {
	g := l.mig
	if g.phase == migDone {
		return
	}
	g.phase, g.err, g.call = migDone, err, nil
	a.cancelTimer(s, TimerMigrateMsg, l.req)
	a.cancelTimer(s, TimerMigrate, l.req)
	a.emit(MigrationDone{Session: s.id, Token: l.token, Req: l.req, Err: err, Note: g.note, State: g.blob,
		Drain: g.drain, Export: g.export, Import: g.imp})
}

// migReleaseLeft lets the left anchor's held packets go (after its switch,
// or after it abandoned the new path), and stops the migration's timers.
func (a *Agent) migReleaseLeft(s *session, l *anchor) {
	g := l.mig
	if g == nil {
		return
	}
	a.cancelTimer(s, TimerMigrateMsg, l.req)
	a.cancelTimer(s, TimerMigrate, l.req)
	g.call = nil
	if g.phase != migDone {
		g.phase, g.err = migDone, "the request ended"
	}
	if g.held {
		g.held = false
		a.emit(ReleaseHold{Session: s.id, Side: SideRight, Req: l.req})
	}
}

// migReleaseRight lets the right anchor's held packets go.
func (a *Agent) migReleaseRight(s *session, r *anchor) {
	g := r.rmig
	if g == nil {
		return
	}
	a.cancelTimer(s, TimerMigrate, r.req)
	if g.abort != nil {
		g.abort = nil
		a.cancelTimer(s, TimerMigrateMsg, r.req)
	}
	if g.held {
		g.held = false
		a.emit(ReleaseHold{Session: s.id, Side: SideLeft, Req: r.req})
	}
}

// onMigrateTimer handles TimerMigrate and TimerMigrateMsg.
func (a *Agent) onMigrateTimer(s *session, id TimerID) {
	if l := s.left; l != nil && l.req == id.Req && l.mig != nil {
		g := l.mig
		if g.phase == migDone {
			return
		}
		if id.Kind == TimerMigrate {
			a.migFail(s, l, fmt.Sprintf("state migration timed out after %s", g.spec.timeout()))
			return
		}
		c := g.call
		if c == nil {
			return
		}
		if c.unanswered >= a.cfg.MaxTries {
			a.migFail(s, l, fmt.Sprintf("%s: no answer from %s", migWhat(c.msg.Mig.Op, c.to), c.to))
			return
		}
		a.migTransmit(s, l.req, c)
		return
	}
	if r := s.right; r != nil && r.req == id.Req && r.rmig != nil {
		g := r.rmig
		if id.Kind == TimerMigrate {
			// The left anchor never let the request go on, nor ended it.
			a.migReleaseRight(s, r)
			return
		}
		if c := g.abort; c != nil {
			if c.unanswered >= a.cfg.MaxTries {
				g.abort = nil // the cancelLock or the lease ends it
				return
			}
			a.migTransmit(s, r.req, c)
		}
	}
}

// migWhat names a step asked of an agent in a failure's text, as the
// operator reads it.
func migWhat(op MigOp, at netip.Addr) string {
	if op == MigFreeze {
		return "freeze at the right anchor " + at.String()
	}
	return op.String() + " at " + at.String()
}

// onMigrate handles a migrate message or its answer (onMessage): each
// kind is matched with its request or its anchor, not by the general
// subsession checks (freeze and abort travel straight between the anchors).
func (a *Agent) onMigrate(e MessageIn, m *Message) {
	x := m.Mig
	switch {
	case m.Type == MsgMigrate && x.Op == MigFreeze:
		a.onFreeze(e.From, m)
	case m.Type == MsgMigrateAnswer && x.Op == MigAbort:
		a.onAbortAnswer(e.From, m)
	case m.Type == MsgMigrateAnswer:
		a.onMigAnswer(e.From, m)
	case x.Op == MigAbort:
		a.onMigAbort(e.From, m)
	default:
		a.onMigServe(e.From, m)
	}
}

// leftOf finds the left anchor a migration answer or abort is for.
func (a *Agent) leftOf(m *Message) (*session, *anchor) {
	ref, ok := a.subs[m.Sub]
	if !ok {
		return nil, nil
	}
	s := a.sessions[ref.id]
	if s == nil || s.left == nil || s.left.req != m.Req || s.left.mig == nil {
		return nil, nil
	}
	return s, s.left
}

// onMigAnswer takes the answer to the step in flight.
func (a *Agent) onMigAnswer(from netip.Addr, m *Message) {
	s, l := a.leftOf(m)
	if l == nil || l.mig.call == nil || l.mig.call.msg.Mig.Op != m.Mig.Op {
		a.reject(RejectUnexpected, m, from, "%s answer for %s: no such step pending", m.Mig.Op, m.Req)
		return
	}
	g, c := l.mig, l.mig.call
	switch {
	case from != c.to:
		a.reject(RejectWrongPeer, m, from, "%s answer for %s, asked of %s", m.Mig.Op, m.Req, c.to)
		return
	case m.Nonce != c.msg.Nonce:
		a.reject(RejectNonce, m, from, "%s answer for %s", m.Mig.Op, m.Req)
		return
	}
	x := m.Mig
	if x.Running {
		c.unanswered = 0 // it works at it
		return
	}
	g.call = nil
	a.cancelTimer(s, TimerMigrateMsg, l.req)
	if x.Failed {
		a.migFail(s, l, fmt.Sprintf("%s: %s", migWhat(x.Op, from), x.Text))
		return
	}
	switch x.Op {
	case MigFreeze:
		g.peer = x.Marks
		if x.Text != "" {
			g.note = joinText(g.note, "right anchor: "+x.Text)
		}
		g.phase = migDraining
		within := g.spec.timeout()
		if g.spec.Semantics == MigrateOrder {
			within = DefaultDrainTimeout
		}
		a.emit(WaitDrained{Session: s.id, Side: SideRight, Req: l.req, Semantics: g.spec.Semantics,
			Own: g.own, Peer: g.peer, Within: within})
	case MigExport:
		g.export = a.now - g.at
		g.blob = x.Blob
		g.phase, g.at = migImporting, a.now
		im := a.msg(s, MsgMigrate, l.newSub, l.req, l.rightAnchor)
		im.Mig = &MigStep{Op: MigImport, Blob: x.Blob}
		a.migCallStart(s, l, l.newPeer, im)
		if a.cfg.Faults&FaultMigEarlySwitch != 0 {
			a.migFinish(s, l, "") // broken: the import is not confirmed
		}
	case MigImport:
		g.imp = a.now - g.at
		a.migFinish(s, l, "")
	}
}

// onMigAbort: the right anchor cannot go on (its hold overflowed).
func (a *Agent) onMigAbort(from netip.Addr, m *Message) {
	s, l := a.leftOf(m)
	switch {
	case l == nil:
		a.reject(RejectUnexpected, m, from, "abort of %s: no such migration", m.Req)
		return
	case from != l.rightAnchor:
		a.reject(RejectWrongPeer, m, from, "abort of %s, whose right anchor is %s", m.Req, l.rightAnchor)
		return
	case m.Nonce != a.subs[l.newSub].nonce:
		a.reject(RejectNonce, m, from, "abort of %s", m.Req)
		return
	}
	a.send(from, &Message{Type: MsgMigrateAnswer, Nonce: m.Nonce, Sub: m.Sub, Session: m.Session, Req: m.Req,
		RightAnchor: m.RightAnchor, Mig: &MigStep{Op: MigAbort}})
	if l.mig.phase != migDone {
		a.migFail(s, l, m.Mig.Text)
	}
}

// onAbortAnswer: the left anchor took the right anchor's abort.
func (a *Agent) onAbortAnswer(from netip.Addr, m *Message) {
	s, r := a.rightOf(m.Req)
	if r == nil || r.rmig == nil || r.rmig.abort == nil || from != r.rmig.from || m.Nonce != r.rmig.nonce {
		a.reject(RejectUnexpected, m, from, "answer to an abort of %s: none pending", m.Req)
		return
	}
	r.rmig.abort = nil
	a.cancelTimer(s, TimerMigrateMsg, r.req)
}

func (a *Agent) rightOf(k ReqKey) (*session, *anchor) {
	id, ok := a.rightReq[k]
	if !ok {
		return nil, nil
	}
	s := a.sessions[id]
	if s == nil || s.right == nil || s.right.req != k {
		return nil, nil
	}
	return s, s.right
}

// onFreeze: the right anchor of a request holds its old-path packets, waits
// for its side to drain and answers with its marks.
func (a *Agent) onFreeze(from netip.Addr, m *Message) {
	s, r := a.rightOf(m.Req)
	switch {
	case r == nil:
		a.reject(RejectUnknownSession, m, from, "freeze for %s: not its right anchor", m.Req)
		return
	case from != m.Req.LeftAnchor:
		a.reject(RejectWrongPeer, m, from, "freeze for %s, whose left anchor is %s", m.Req, m.Req.LeftAnchor)
		return
	case m.Nonce != r.anchorNonce:
		a.reject(RejectNonce, m, from, "freeze for %s", m.Req)
		return
	}
	if g := r.rmig; g != nil {
		// A copy: the same answer, or "running".
		if g.answer != nil {
			a.send(from, g.answer)
		} else {
			a.send(from, a.migAnswerTo(m, &MigStep{Op: MigFreeze, Running: true}))
		}
		return
	}
	x := m.Mig
	g := &migRight{spec: MigrateSpec{Semantics: x.Semantics, HoldLimit: x.HoldLimit, TimeoutMS: x.TimeoutMS},
		peer: x.Marks, from: from, sub: m.Sub, nonce: m.Nonce}
	g.spec = MigrateSpecDefaults(g.spec)
	g.drain = drainTimeout(x.DrainMS)
	r.rmig = g
	if r.stage != StageWaitAck {
		a.migRightAnswer(s, r, &MigStep{Op: MigFreeze, Failed: true, Text: "the right anchor switched already"})
		return
	}
	g.holding = true
	a.emit(Hold{Session: s.id, Side: SideLeft, Req: r.req, Semantics: g.spec.Semantics, Limit: g.spec.HoldLimit})
	// Holding, this right anchor lets go only at its switch: the left
	// anchor's ACK, or its first packet on the new path. With the ACK
	// lost and nothing new from the left (it waits for acknowledgments
	// held here), the session would stall until the hold's lease. So the
	// synAck goes again, with the usual back-off, while it holds and has
	// not switched (§3.3, §3.6); the left anchor answers a copy with its
	// ACK (onSynAck). The Promela model found the stall.
	r.tries = 0
	a.setTimer(s, TimerSyn, r.req, a.backoff(1))
}

// resendHeldSynAck sends a holding right anchor's synAck again (TimerSyn
// at the right anchor): until it switches, or its hold ends.
func (a *Agent) resendHeldSynAck(s *session, r *anchor) {
	if r.stage != StageWaitAck || r.rmig == nil || !(r.rmig.holding || r.rmig.held) {
		return
	}
	r.tries++
	a.sendSynAck(s, r, r.newPeer, r.newSub)
	a.setTimer(s, TimerSyn, r.req, a.backoff(r.tries))
}

// migAnswerTo is the answer to migration request m.
func (a *Agent) migAnswerTo(m *Message, x *MigStep) *Message {
	return &Message{Type: MsgMigrateAnswer, Nonce: m.Nonce, Sub: m.Sub, Session: m.Session, Req: m.Req,
		RightAnchor: m.RightAnchor, Mig: x}
}

func (a *Agent) migRightAnswer(s *session, r *anchor, x *MigStep) {
	g := r.rmig
	g.answer = &Message{Type: MsgMigrateAnswer, Nonce: g.nonce, Sub: g.sub, Session: s.tuple, Req: r.req,
		RightAnchor: a.cfg.Self, Mig: x}
	a.send(g.from, g.answer)
}

// onHeld: the datapath holds a side's packets (or could not).
func (a *Agent) onHeld(e Held) {
	s := a.sessions[e.Session]
	var l, r *anchor
	if s != nil {
		l, r = s.left, s.right
	}
	switch {
	case e.Side == SideRight && l != nil && l.req == e.Req && l.mig != nil && l.mig.phase == migHolding:
		g := l.mig
		if e.Err != "" {
			a.migFail(s, l, e.Err)
			return
		}
		g.held, g.own = true, e.Marks
		g.phase = migFreezing
		g.at = a.now
		fm := a.msg(s, MsgMigrate, l.newSub, l.req, l.rightAnchor)
		fm.Mig = &MigStep{Op: MigFreeze, Semantics: g.spec.Semantics, HoldLimit: g.spec.HoldLimit,
			TimeoutMS: g.spec.TimeoutMS, DrainMS: uint32(DefaultDrainTimeout / time.Millisecond), Marks: g.own}
		a.migCallStart(s, l, l.rightAnchor, fm)
	case e.Side == SideLeft && r != nil && r.req == e.Req && r.rmig != nil && r.rmig.holding:
		g := r.rmig
		g.holding = false
		if e.Err != "" {
			a.migRightAnswer(s, r, &MigStep{Op: MigFreeze, Failed: true, Text: e.Err})
			return
		}
		g.held, g.own = true, e.Marks
		a.setTimer(s, TimerMigrate, r.req, g.spec.timeout()+rightHoldGrace)
		within := g.spec.timeout()
		if g.spec.Semantics == MigrateOrder {
			within = g.drain
		}
		a.emit(WaitDrained{Session: s.id, Side: SideLeft, Req: r.req, Semantics: g.spec.Semantics,
			Own: g.own, Peer: g.peer, Within: within})
	case e.Err == "":
		// Nobody waits for this hold any more: let it go at once.
		a.emit(ReleaseHold{Session: e.Session, Side: e.Side, Req: e.Req})
	}
}

// onDrained: a side's old path drained (OK), or the wait ended first.
func (a *Agent) onDrained(e Drained) {
	s := a.sessions[e.Session]
	if s == nil {
		return
	}
	if l := s.left; e.Side == SideRight && l != nil && l.req == e.Req && l.mig != nil && l.mig.phase == migDraining {
		g := l.mig
		if !e.OK {
			if g.spec.Semantics == MigrateSubstream {
				a.migFail(s, l, "the old path did not drain: data sent before the freeze is still unacknowledged")
				return
			}
			g.note = joinText(g.note, "left anchor: drain timeout: a packet sent before the freeze did not arrive (lost or late)")
		}
		g.drain = a.now - g.at
		a.migExport(s, l)
		return
	}
	if r := s.right; e.Side == SideLeft && r != nil && r.req == e.Req && r.rmig != nil && r.rmig.held && r.rmig.answer == nil {
		g := r.rmig
		x := &MigStep{Op: MigFreeze, Marks: g.own}
		if !e.OK {
			if g.spec.Semantics == MigrateSubstream {
				x = &MigStep{Op: MigFreeze, Failed: true, Text: "the old path did not drain at the right anchor: data sent before the freeze is still unacknowledged"}
			} else {
				x.Text = "drain timeout: a packet sent before the freeze did not arrive (lost or late)"
			}
		}
		a.migRightAnswer(s, r, x)
	}
}

// onHoldOverflow: a hold reached its bound.
func (a *Agent) onHoldOverflow(e HoldOverflow) {
	s := a.sessions[e.Session]
	if s == nil {
		return
	}
	if l := s.left; e.Side == SideRight && l != nil && l.mig != nil && l.mig.held && l.mig.phase != migDone {
		a.migFail(s, l, fmt.Sprintf("hold buffer full at the left anchor (over %d bytes)", l.mig.spec.HoldLimit))
		return
	}
	if r := s.right; e.Side == SideLeft && r != nil && r.rmig != nil && r.rmig.held && r.rmig.abort == nil {
		g := r.rmig
		m := &Message{Type: MsgMigrate, Nonce: g.nonce, Sub: g.sub, Session: s.tuple, Req: r.req, RightAnchor: a.cfg.Self,
			Mig: &MigStep{Op: MigAbort, Text: fmt.Sprintf("hold buffer full at the right anchor (over %d bytes)", g.spec.HoldLimit)}}
		g.abort = &migCall{to: g.from, msg: m}
		a.migTransmit(s, r.req, g.abort)
	}
}

// onMigServe: an export (the old middlebox, on its left subsession from
// the left anchor) or an import (the new middlebox, on the new path).
func (a *Agent) onMigServe(from netip.Addr, m *Message) {
	ref, ok := a.subs[m.Sub]
	if !ok {
		a.reject(RejectUnknownSession, m, from, "%s: no subsession %s", m.Mig.Op, m.Sub)
		return
	}
	s := a.sessions[ref.id]
	switch {
	case m.Nonce != ref.nonce:
		a.reject(RejectNonce, m, from, "session %d", s.id)
		return
	case from != ref.peer || ref.side != SideLeft:
		a.reject(RejectWrongPeer, m, from, "subsession %s belongs to %s (%s side)", m.Sub, ref.peer, ref.side)
		return
	case from != m.Req.LeftAnchor:
		a.reject(RejectWrongPeer, m, from, "%s for %s sent by %s", m.Mig.Op, m.Req, from)
		return
	}
	op := m.Mig.Op
	if v := s.served(m.Req, op); v != nil {
		if v.answer != nil {
			a.send(from, v.answer)
		} else {
			a.send(from, a.migAnswerTo(m, &MigStep{Op: op, Running: true}))
		}
		return
	}
	v := &migServe{req: m.Req, op: op, peer: from, msg: m}
	s.serve = append(s.serve, v)
	if len(s.serve) > historyLen {
		s.serve = s.serve[1:]
	}
	fail := func(text string) {
		v.answer = a.migAnswerTo(m, &MigStep{Op: op, Failed: true, Text: text})
		a.send(from, v.answer)
	}
	switch op {
	case MigExport:
		right := s.sides[SideRight]
		switch {
		case ref.tomb || s.lock != Locked || s.requestor != m.Req:
			fail("this middlebox is not locked for " + m.Req.String())
		case right == nil || right.Peer != m.RightAnchor:
			fail(fmt.Sprintf("the old segment has more than this middlebox before the right anchor %s: state migration replaces one middlebox by one", m.RightAnchor))
		default:
			a.emit(ExportState{Session: s.id, Req: m.Req, Tuple: s.tuple, RightAnchor: m.RightAnchor})
		}
	case MigImport:
		switch {
		case s.joinReq != m.Req || s.joinFailed:
			fail("this middlebox did not join the new path of " + m.Req.String())
		case s.imported:
			fail("this middlebox imported a state already")
		default:
			a.emit(ImportState{Session: s.id, Req: m.Req, Tuple: s.tuple, Blob: m.Mig.Blob})
		}
	}
}

func (s *session) served(k ReqKey, op MigOp) *migServe {
	for _, v := range s.serve {
		if v.req == k && v.op == op {
			return v
		}
	}
	return nil
}

// onStateExported: the old middlebox's plug-ins exported the state.
func (a *Agent) onStateExported(e StateExported) {
	s := a.sessions[e.Session]
	if s == nil {
		return
	}
	v := s.served(e.Req, MigExport)
	if v == nil || v.answer != nil {
		return
	}
	x := &MigStep{Op: MigExport, Blob: e.Blob}
	switch {
	case e.Err != "":
		x = &MigStep{Op: MigExport, Failed: true, Text: clipText(e.Err)}
	case len(e.Blob) > MaxStateLen:
		x = &MigStep{Op: MigExport, Failed: true,
			Text: fmt.Sprintf("a state of %d bytes exceeds the %d bytes a control message carries", len(e.Blob), MaxStateLen)}
	default:
		s.exported = true
	}
	v.answer = a.migAnswerTo(v.msg, x)
	a.send(v.peer, v.answer)
}

// onStateImported: the new middlebox's plug-ins imported the state.
func (a *Agent) onStateImported(e StateImported) {
	s := a.sessions[e.Session]
	if s == nil {
		if e.Err == "" {
			// The path went while the import ran: let the state go.
			a.emit(ReleaseState{Session: e.Session, Tuple: e.Tuple})
		}
		return
	}
	v := s.served(e.Req, MigImport)
	if v == nil || v.answer != nil {
		return
	}
	x := &MigStep{Op: MigImport}
	if e.Err != "" {
		x = &MigStep{Op: MigImport, Failed: true, Text: clipText(e.Err)}
	} else {
		s.imported = true
	}
	v.answer = a.migAnswerTo(v.msg, x)
	a.send(v.peer, v.answer)
}

func clipText(t string) string {
	if len(t) > MaxMigText {
		return t[:MaxMigText]
	}
	return t
}

func joinText(a, b string) string {
	if a == "" {
		return b
	}
	return a + "; " + b
}
