package sim

import (
	"fmt"
	"strings"

	"github.com/dysco/dysco/internal/protocol"
)

// checkLocks checks mutual exclusion as the run goes (§3.2, §3.7): while
// a left anchor holds its segment (from ackLock until the FIN exchange
// starts tearing the old path down), every agent of the old path up to the
// right anchor has its subsession to the right locked by that request, and
// the right anchor is the right anchor of that request. Two overlapping
// requests can therefore not both be past the lock phase.
func (w *world) checkLocks() {
	if w.err != nil || w.opts.noLockWalk {
		return
	}
	for _, h := range w.hosts {
		for _, id := range h.agent.Sessions() {
			v, _ := h.agent.View(id)
			l := v.Left
			if l == nil || l.Stage != protocol.StageSettingUp && l.Stage != protocol.StageTwoPath || l.FinAckSent || l.FinAcked {
				continue
			}
			ds := h.dp[id]
			if ds == nil || ds.sess.rst || ds.sess.ending {
				continue // agents drop sessions that end, locks and all
			}
			if v.Lock != protocol.Locked || v.Requestor != l.Req {
				w.fail("%s: left anchor of %s (%s) but its lock is %s by %s: overlapping reconfigurations", h, l.Req, l.Stage, v.Lock, v.Requestor)
				return
			}
			sub, peer := v.Sides[protocol.SideRight].Sub, v.Sides[protocol.SideRight].Peer
			for step := 0; ; step++ {
				ph := w.byAddr[peer]
				pid, _, ok := ph.agent.Lookup(sub)
				if step > 16 || !ok {
					w.fail("%s: the old path of %s is broken at %s (subsession %s)", h, l.Req, ph, sub)
					return
				}
				pv, _ := ph.agent.View(pid)
				if peer == l.RightAnchor {
					if pv.Right == nil || pv.Right.Req != l.Req {
						w.fail("%s: right anchor of %s does not hold it (holds %v)", ph, l.Req, pv.Right)
						return
					}
					break
				}
				// Locked by the request, or, on a direct new path, still
				// pending for it: with a granting synAck the left anchor
				// goes on while the ackLock, which locks the middle agents,
				// is on its way (a pending lock queues other requests,
				// never grants them). Only a direct new path's synAck
				// grants (synAckMsg).
				pendingOK := pv.Lock == protocol.LockPending && l.NewPeer == l.RightAnchor
				if pv.Lock != protocol.Locked && !pendingOK || pv.Requestor != l.Req {
					w.fail("%s: inside the segment of %s (%s..%s), its subsession to the right is %s by %s: overlapping reconfigurations",
						ph, l.Req, h, w.byAddr[l.RightAnchor], pv.Lock, pv.Requestor)
					return
				}
				if pv.Sides[protocol.SideRight] == nil {
					w.fail("%s: the old path of %s ends before its right anchor", ph, l.Req)
					return
				}
				sub, peer = pv.Sides[protocol.SideRight].Sub, pv.Sides[protocol.SideRight].Peer
			}
		}
	}
}

// finish checks the end state: nothing left anywhere, every request
// answered for a good reason, every stream delivered.
func (w *world) finish() {
	if w.err != nil {
		return
	}
	// The streams first: what the applications see.
	for _, s := range w.sessions {
		if s.udp {
			if s.uends[0] == nil {
				w.fail("s%d was never set up", s.idx)
				return
			}
			continue // every datagram lost was lost by the network (receiveUDP)
		}
		if s.ends[0] == nil {
			w.fail("s%d was never set up", s.idx)
			return
		}
		if s.rst {
			continue // a reset stream may stop anywhere, but what arrived was checked
		}
		for _, e := range s.ends {
			if e.state != tcpTimeWait {
				w.fail("%s: not closed at the end (state %d, sent %d of %d acked %d, received %d of %d)",
					e.name, e.state, e.sndNxt-e.iss, e.total, e.sndUna-e.iss, e.rcvOff, e.peerTotal)
				return
			}
			if e.rcvOff != e.peerTotal+1 {
				w.fail("%s: received %d bytes of %d", e.name, e.rcvOff, e.peerTotal)
				return
			}
		}
	}
	for _, h := range w.hosts {
		if ids := h.agent.Sessions(); len(ids) > 0 {
			var desc []string
			for _, id := range ids {
				v, _ := h.agent.View(id)
				desc = append(desc, fmt.Sprintf("%d lock=%s by %s left=%v right=%v queued=%d cancels=%d lingering=%d",
					id, v.Lock, v.Requestor, v.Left, v.Right, v.Queued, v.Cancels, v.Lingering))
			}
			w.fail("%s: agent keeps state after the run: %s", h, strings.Join(desc, "; "))
			return
		}
		if len(h.dp) > 0 || len(h.subs) > 0 {
			w.fail("%s: datapath keeps %d sessions, %d subsessions after the run", h, len(h.dp), len(h.subs))
			return
		}
	}
	for _, r := range w.reqs {
		if r.res == nil && r.sender != nil {
			continue // a trigger that started no request (finishTriggers)
		}
		if r.res == nil {
			w.fail("%s was never answered", r)
			return
		}
		key := r.res.Outcome.String()
		if r.res.Outcome != protocol.Succeeded {
			key += ":" + strings.ReplaceAll(r.res.Reason.String(), " ", "_")
			if b := w.byReq[r.res.Blocker]; b != nil && r.res.Reason.Contention() {
				if b.left == r.left {
					key += "(same_left_anchor)"
				} else {
					key += "(other_left_anchor)"
				}
			}
		}
		w.stats.Outcomes[key]++
		if why := w.unjustified(r, 0); why != "" {
			w.fail("%s: %s %s: %s", r, r.res.Outcome, r.res.Reason, why)
			return
		}
	}
	w.finishTriggers()
	w.finishMigrations()
	if w.err != nil {
		return
	}
	// §3.7: of overlapping requests, one at a time holds the segment and
	// succeeds: no two successful requests held overlapping segments at
	// overlapping times.
	for i, a := range w.reqs {
		for _, b := range w.reqs[i+1:] {
			if a.sess != b.sess || a.res == nil || b.res == nil || a.res.Outcome != protocol.Succeeded || b.res.Outcome != protocol.Succeeded {
				continue
			}
			la, lb := w.locked[a.key], w.locked[b.key]
			if la.at > b.resAt || lb.at > a.resAt {
				continue
			}
			for e := range la.edges {
				if lb.edges[e] {
					w.fail("%s and %s both succeeded holding the subsession %s-%s at the same time", a, b, e[0].h, e[1].h)
					return
				}
			}
		}
	}
}

// unjustified says why an outcome breaks the §3.7 properties, or "".
func (w *world) unjustified(r *request, depth int) string {
	res := r.res
	ending := r.sess.rst || r.sess.ending
	switch res.Outcome {
	case protocol.Succeeded:
		if res.Unconfirmed && !(r.sess.ending && r.sess.endingAt <= r.resAt) {
			return "old path torn down without a FIN-ACK while the other anchor was there"
		}
		return ""
	case protocol.Failed:
		switch {
		case r.sess.rst, r.sess.ending && r.sess.endingAt <= r.resAt:
			// The session ended (or was reset) first: a request cannot
			// wait for it, nor fail because of it, while it still
			// carries traffic.
			return ""
		case res.Reason == protocol.ReasonSetupFailed && (r.deadChain || w.joinFails[r.key]):
			return ""
		case res.Reason == protocol.ReasonAborted && r.abort:
			return ""
		}
		return "a reconfiguration whose new path works must succeed"
	}
	switch res.Reason {
	case protocol.ReasonLocked, protocol.ReasonBusy:
		// Exactly one of contending requests wins: the blocker must have
		// gone on to hold the segment (or failed for a good reason).
		b := w.byReq[res.Blocker]
		if b == nil || b == r || b.res == nil {
			return fmt.Sprintf("blocker %s is not another answered request", res.Blocker)
		}
		if res.Reason == protocol.ReasonBusy && b.left == r.left && b.sess == r.sess {
			return "" // one request at a time per left anchor: a local rule, not contention for a segment
		}
		if depth > 8 {
			return "blockers form a cycle"
		}
		if why := w.unjustified(b, depth+1); why != "" {
			return fmt.Sprintf("blocked by %s, which %s (%s): %s", b, b.res.Outcome, b.res.Reason, why)
		}
		// (A request refused because its new chain crosses the path did
		// hold the segment: it learns the old segment from the ackLock,
		// or the refusal from its new path, once it is locked.)
		if b.res.Outcome == protocol.Refused && !b.res.Reason.Contention() && b.res.Reason != protocol.ReasonOnPath {
			return fmt.Sprintf("blocked by %s, which never held the segment (%s)", b, b.res.Reason)
		}
		return ""
	case protocol.ReasonNotOnPath, protocol.ReasonNoSession:
		// The operator named the path as it was; another reconfiguration
		// may have changed it since.
		if ending {
			return ""
		}
		for _, o := range w.reqs {
			if o != r && o.sess == r.sess && o.res != nil && o.res.Outcome == protocol.Succeeded && o.resAt >= r.issued {
				return ""
			}
		}
		return "the right anchor was on the path and nothing changed it"
	case protocol.ReasonSessionEnded:
		if ending {
			return ""
		}
		return "session did not end"
	case protocol.ReasonOnPath:
		// A host holds one state per session tuple: the hop named (or,
		// if none is, one of the new chain) carried the session, or an
		// earlier session of the same tuple not yet closed there.
		hops := r.chain
		if h := w.byAddr[res.Hop]; h != nil {
			hops = []*host{h}
		}
		for _, h := range hops {
			for _, o := range w.sessions {
				if o.tuple == r.sess.tuple && w.heldDuring(o, h, r.issued, r.resAt) {
					return ""
				}
			}
		}
		return "no hop of the new chain carried the session's tuple"
	}
	return "unexpected refusal"
}
