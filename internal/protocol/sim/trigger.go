package sim

import (
	"bytes"
	"fmt"
	"net/netip"
	"time"

	"github.com/dysco/dysco/internal/protocol"
	"github.com/dysco/dysco/internal/wire"
)

// Triggers (protocol/trigger.go): some requests are asked for by the
// middlebox after their left anchor, which sends a trigger to it (§2.3).
// The trigger and its answer cross the same lossy network as every control
// message. Checked, as the run goes and at its end:
//   - each trigger ends with exactly one TriggerResult at its sender: the
//     left neighbour's answer, a refusal before it was sent, or no answer
//     after every retransmission (never on a network that loses nothing);
//   - a trigger starts at most one request (TriggerAccepted, Result), and
//     every final answer sent for it is the same;
//   - an answer naming a request equals that request's Result at the left
//     anchor (outcome, reason, blocker, hop) and carries the report the
//     agent gave at its gate; an answer naming none (refused by the
//     trigger's handler) has a reason the run justifies, and no request
//     was started for it;
//   - replays: a copy of a trigger sent again to its left neighbour later
//     in the run gets at most the same answer (from the session's history)
//     and none once the session has left that host; at the end of the run
//     every trigger the left neighbour heard of is sent again, and must be
//     refused as a replay and not answered.

// trigState is what the run knows of one trigger.
type trigState struct {
	key  protocol.ReqKey
	data []byte // the trigger as sent, for replays
	to   *host  // the left neighbour it went to
	sub  wire.Tuple
	// heard: a copy reached the left neighbour.
	heard bool
	// accepted counts the requests started for it (TriggerAccepted);
	// answers the final answers sent for it.
	accepted, answers int
	answer            *protocol.Message // the first final answer sent
	res               *protocol.TriggerResult
	resAt             time.Duration
}

// report is what the simulated agent reports at the gate of a triggered
// request (protocol.Proceed.Report).
func (r *request) report() []byte {
	if r.sender == nil {
		return nil
	}
	return fmt.Appendf(nil, "migration report of req#%d", r.token)
}

// sendTrigger has the request's sender ask its left neighbour for it.
func (w *world) sendTrigger(r *request, ds *dpSess, chain []netip.Addr) {
	h := r.sender
	r.trig = &trigState{}
	w.stats.Triggers++
	w.tracef("TRIGGER %s", r)
	if !h.announce(ds) {
		// The agent cannot announce a session that was reset: it refuses
		// the trigger itself.
		w.onTriggerResult(h, protocol.TriggerResult{Token: r.token, Outcome: protocol.Refused, Reason: protocol.ReasonNoSession})
		return
	}
	// The sender asks the left neighbour its agent knows: in its own
	// reconfiguration's two-path phase, as its right anchor, the path the
	// datapath follows may already be the new one. A chain naming that
	// neighbour would be refused (the left anchor cannot be on its new
	// path): the run leaves it out, and expects the sender's own refusal
	// if it is the right anchor.
	if v, ok := h.agent.View(ds.id); ok && v.Sides[protocol.SideLeft] != nil {
		if lp := w.byAddr[v.Sides[protocol.SideLeft].Peer]; lp != nil && lp != r.left {
			w.tracef("%s: the sender's agent knows %s as its left neighbour, not %s", r, lp, r.left)
			r.left = lp
			var c []*host
			chain = nil
			for _, x := range r.chain {
				if x != lp {
					c, chain = append(c, x), append(chain, x.addr)
				}
			}
			r.chain = c
			r.badView = r.right == lp
			if r.gate && len(r.chain) != 1 {
				r.gate, r.abort = false, false
			}
		}
	}
	var spec *protocol.MigrateSpec
	if r.gate {
		spec = &protocol.MigrateSpec{Semantics: protocol.MigrateSemantics(w.rng.IntN(4)), HoldLimit: uint64(w.rng.IntN(1 << 24)),
			TimeoutMS: uint32(w.rng.IntN(10000))}
		r.mig = spec
	}
	acts := h.agent.Handle(w.now, protocol.Trigger{Session: ds.id, Token: r.token, RightAnchor: r.right.addr, Chain: chain, Migrate: spec})
	for _, a := range acts {
		if s, ok := a.(protocol.Send); ok && s.Msg.Type == protocol.MsgTrigger && r.trig.key.IsZero() {
			t := r.trig
			t.key, t.data, t.to, t.sub = s.Msg.Req, s.Data, w.byAddr[s.To], s.Msg.Sub
			w.byTrigger[t.key] = r
			if t.to != r.left {
				w.tracef("%s: the sender's left neighbour is %s, not %s", r, t.to, r.left)
				r.left = t.to
			}
		}
	}
	for _, a := range acts {
		h.apply(a)
	}
	w.checkLocks()
}

// triggerHeard notes that a copy of a trigger reached host to.
func (w *world) triggerHeard(to *host, m *protocol.Message) {
	if r := w.byTrigger[m.Req]; r != nil && r.trig.to == to {
		r.trig.heard = true
	}
}

func (w *world) onTriggerAccepted(h *host, x protocol.TriggerAccepted) {
	r := w.byTrigger[x.Trigger]
	if r == nil {
		w.fail("%s: took trigger %s, which nobody sent", h, x.Trigger)
		return
	}
	t := r.trig
	t.accepted++
	w.tracef("%s ACCEPTED trigger %s of %s as token %d", h, x.Trigger, r, x.Token)
	switch {
	case t.accepted > 1:
		w.fail("%s: trigger %s of %s started a second request", h, x.Trigger, r)
	case h != t.to:
		w.fail("%s: took trigger %s of %s, sent to %s", h, x.Trigger, r, t.to)
	case (x.Migrate != nil) != r.gate:
		w.fail("%s: trigger %s of %s taken with migrate=%v, gated=%v", h, x.Trigger, r, x.Migrate, r.gate)
	}
	h.trigTok[x.Token] = r
	w.stats.TriggersTaken++
}

// triggeredResult is the request of a Result that a trigger asked for.
func (w *world) triggeredResult(h *host, x protocol.Result) *request {
	r := w.byTrigger[x.Trigger]
	if r == nil || h.trigTok[x.Token] != r {
		w.fail("%s: result %s for trigger %s, token %d, which this host did not take", h, x.Req, x.Trigger, x.Token)
		return nil
	}
	return r
}

// noteAnswer checks an answer to a trigger as it is sent.
func (w *world) noteAnswer(from, to *host, m *protocol.Message) {
	r := w.byTrigger[m.Req]
	if r == nil {
		w.fail("%s: answer to trigger %s, which nobody sent", from, m.Req)
		return
	}
	t := r.trig
	if m.Answer.Outcome == 0 {
		w.stats.TriggerAcks++
		return
	}
	t.answers++
	if t.answer == nil {
		t.answer = m
		return
	}
	if !sameAnswer(t.answer, m) {
		w.fail("%s: two different answers to trigger %s of %s: %s, then %s", from, m.Req, r, t.answer, m)
	}
}

func sameAnswer(a, b *protocol.Message) bool {
	x, y := a.Answer, b.Answer
	return a.Reason == b.Reason && a.Blocker == b.Blocker && x.Outcome == y.Outcome && x.ReqID == y.ReqID &&
		x.Unchanged == y.Unchanged && x.Unconfirmed == y.Unconfirmed && x.Resumed == y.Resumed && x.Hop == y.Hop &&
		bytes.Equal(x.Report, y.Report)
}

func (w *world) onTriggerResult(h *host, x protocol.TriggerResult) {
	r := w.byToken[x.Token]
	if r == nil || r.sender != h {
		w.fail("%s: trigger result for token %d, not a trigger of this host", h, x.Token)
		return
	}
	t := r.trig
	if t.res != nil {
		w.fail("%s: two results for trigger %s of %s: %s %s, then %s %s", h, t.key, r, t.res.Outcome, t.res.Reason, x.Outcome, x.Reason)
		return
	}
	t.res, t.resAt = &x, w.now
	w.tracef("%s TRIGGER RESULT %s %s: answered=%v %s %s blocker=%s req=%s", h, r, x.Trigger, x.Answered, x.Outcome, x.Reason, x.Blocker, x.Req)
	if x.Answered && t.answer != nil && (x.Outcome != t.answer.Answer.Outcome || x.Reason != t.answer.Reason) {
		w.fail("%s: result of trigger %s (%s %s) is not its answer %s", h, x.Trigger, x.Outcome, x.Reason, t.answer)
		return
	}
	if t.heard && w.rng.IntN(2) == 0 {
		// A copy of the trigger comes again later (a replay, or a
		// retransmission the network held back).
		w.after(time.Duration(w.rng.Int64N(int64(8*time.Second))), func() { w.replayTrigger(r, false) })
	}
}

// replayTrigger sends a trigger's bytes to its left neighbour again,
// through the network (direct: at once, at the end of the run). Once the
// left neighbour has no session with the trigger's subsession it must not
// answer.
func (w *world) replayTrigger(r *request, direct bool) {
	t := r.trig
	to := t.to
	send := func() {
		_, _, known := to.agent.Lookup(t.sub)
		answers, replays := t.answers, w.stats.Rejected[protocol.RejectReplay.String()]
		w.stats.TriggerReplays++
		w.tracef("%s REPLAY of trigger %s of %s (subsession known here: %v)", to, t.key, r, known)
		to.handle(to.messageIn(r.sender.addr, t.data))
		switch {
		case !known && t.answers > answers:
			w.fail("%s answered a replay of trigger %s of %s, whose session it no longer has", to, t.key, r)
		case direct && w.stats.Rejected[protocol.RejectReplay.String()] != replays+1:
			w.fail("%s did not refuse a replay of trigger %s of %s as a replay", to, t.key, r)
		}
		w.checkLocks()
	}
	if direct {
		send()
		return
	}
	w.deliver(r.sender, to, "trigger (replayed)", send)
}

// finishTriggers checks every trigger at the end of the run, then sends
// each again to its left neighbour, which knows no session any more.
func (w *world) finishTriggers() {
	for _, r := range w.reqs {
		if r.sender != nil && w.err == nil {
			w.checkTrigger(r)
		}
	}
	for _, r := range w.reqs {
		if r.sender != nil && r.trig.heard && w.err == nil {
			w.replayTrigger(r, true)
		}
	}
}

func (w *world) checkTrigger(r *request) {
	t := r.trig
	x := t.res
	if x == nil {
		w.fail("trigger %s of %s never ended at its sender", t.key, r)
		return
	}
	if t.accepted > 0 && r.res == nil {
		w.fail("trigger %s of %s started a request that never ended", t.key, r)
		return
	}
	switch {
	case x.Answered && !x.Req.IsZero():
		w.stats.TriggersAnswered++
		res := r.res
		switch {
		case res == nil:
			w.fail("trigger %s of %s answered with request %s, which has no result", t.key, r, x.Req)
		case res.Req != x.Req || res.Outcome != x.Outcome || res.Reason != x.Reason || res.Blocker != x.Blocker ||
			res.Unchanged != x.Unchanged || res.Hop != x.Hop:
			w.fail("trigger %s of %s: the answer (%s %s %s blocker=%s) is not the left anchor's result (%s %s %s blocker=%s)",
				t.key, r, x.Req, x.Outcome, x.Reason, x.Blocker, res.Req, res.Outcome, res.Reason, res.Blocker)
		case len(x.Report) > 0 && !bytes.Equal(x.Report, r.report()):
			w.fail("trigger %s of %s: the answer carries the report %q", t.key, r, x.Report)
		case r.gate && x.Outcome == protocol.Succeeded && !x.Unchanged && len(x.Report) == 0:
			w.fail("trigger %s of %s: succeeded through its gate, but the answer has no report", t.key, r)
		}
	case x.Answered:
		w.stats.TriggersRefused++
		w.stats.Outcomes["trigger-refused:"+reasonKey(x.Reason)]++
		if t.accepted > 0 {
			w.fail("trigger %s of %s: refused (%s), but it started a request", t.key, r, x.Reason)
			return
		}
		if why := w.triggerRefusal(r, x); why != "" {
			w.fail("trigger %s of %s: refused: %s: %s", t.key, r, x.Reason, why)
		}
	case x.Reason == protocol.ReasonNoAnswer:
		w.stats.TriggersUnanswered++
		if w.loss == 0 {
			w.fail("trigger %s of %s: no answer on a network that loses nothing", t.key, r)
		}
	case x.Reason == protocol.ReasonInvalid && r.badView:
	case x.Reason != protocol.ReasonNoSession:
		w.fail("trigger %s of %s: refused by its sender: %s", t.key, r, x.Reason)
	case !r.sess.rst:
		// Only a reset session cannot be announced (announce).
		w.fail("trigger %s of %s: refused by its sender: %s, but the session was not reset", t.key, r, x.Reason)
	}
}

// triggerRefusal says why the refusal of a trigger by its left neighbour's
// handler (no request started) is wrong, or "".
func (w *world) triggerRefusal(r *request, x *protocol.TriggerResult) string {
	changed := func() bool {
		if r.sess.rst || r.sess.ending {
			return true
		}
		for _, o := range w.reqs {
			if o != r && o.sess == r.sess && o.res != nil && o.res.Outcome == protocol.Succeeded && o.resAt >= r.issued {
				return true
			}
		}
		return false
	}
	switch x.Reason {
	case protocol.ReasonBusy:
		// The left neighbour was the left anchor of another request of
		// the session (one at a time per left anchor, §3.2).
		b := w.byReq[x.Blocker]
		if b == nil || b == r || b.left != r.trig.to || b.sess != r.sess {
			return fmt.Sprintf("blocker %s is not another request of the left neighbour", x.Blocker)
		}
		return ""
	case protocol.ReasonNotNextHop, protocol.ReasonNoSession, protocol.ReasonSessionEnded:
		// The sender left the path (another request took it out), or
		// the session ended at the left neighbour.
		if changed() {
			return ""
		}
		return "the sender was the next hop and nothing changed the path"
	}
	return "unexpected refusal"
}

func reasonKey(r protocol.Reason) string {
	return string(bytes.ReplaceAll([]byte(r.String()), []byte(" "), []byte("_")))
}
