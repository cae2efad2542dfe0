package protocol

import "time"

// UDP sessions: the two-path phase for datagrams (docs/protocol.md, "UDP
// sessions"; it replaces §3.5's cut-off rules for them).
//
// A datagram has no sequence number to cut over on, and none is
// retransmitted, so the phase keeps no variables but one count. Each
// anchor switches at one moment: the left anchor when the new path
// answers (its SYN-ACK; the ACK tells the right anchor), the right anchor
// on that ACK, the first datagram on its new subsession (armed, as for
// TCP) or the left anchor's fin. From its switch an anchor sends every
// datagram on the new path and accepts datagrams on both paths (the old
// and the new ingress subsession both map to the session). It ends its
// side of the phase once its old path has been quiet, no datagram received
// on it, for the drain time (Config.UDPDrain) since its switch: the
// datapath counts the old path's datagrams (TwoPath.OldDgrams), and
// TimerQuiet fires when the count has not moved for the drain time. Ending
// its side, the anchor sends its fin (no cut-off); it answers the other's
// fin at once; it completes, and the old path is torn down as after a TCP
// phase (tombs, lingering, middle agents freed once the finAcks passed
// both ways, locks released), only when its fin is answered and the
// other's has come: both sides have ended. No deltas, marks, cut-off,
// window clamp or split. A left anchor whose old path still hears
// datagrams a drain time after its switch sends the ACK again, at most
// once per drain time: the right anchor may have lost it (onUDPProgress).
//
// Why nothing is lost: a datagram on the old path was sent by an anchor
// before its switch. The left anchor switches before the right one, and
// the right anchor's fin leaves at least a drain time after its own
// switch, so by then every datagram either anchor sent on the old path has
// had the drain time to arrive; an anchor, and a middle agent, tears its
// old path down only after both fins (assuming, as the docs say, that the
// drain time exceeds the longest time a datagram spends on the old path).
// The quiet test adds a margin where that assumption fails: a side that
// still hears its old path waits.

// MaxUDPDrain bounds Config.UDPDrain (also at most a quarter of the lock
// lease, which the middle agents of the old path hold meanwhile).
const MaxUDPDrain = 30 * time.Second

// udpSwitched starts the drain time of a UDP anchor's side at its switch.
func (a *Agent) udpSwitched(s *session, an *anchor) {
	an.quiet, an.heardAt, an.ackAt = false, a.now, a.now
	if a.cfg.Faults&FaultUDPNoQuiet != 0 {
		an.quiet = true
		a.evaluate(s, an)
		return
	}
	a.setTimer(s, TimerQuiet, an.req, a.cfg.UDPDrain)
}

// onUDPProgress takes the datapath's count of old-path datagrams: one that
// moved restarts the drain time.
func (a *Agent) onUDPProgress(s *session, an *anchor, v TwoPath) {
	if v.OldDgrams == an.oldDgrams {
		return
	}
	an.oldDgrams = v.OldDgrams
	if an.quiet {
		return // this side has ended; the old path stays until both have
	}
	an.heardAt = a.now
	a.setTimer(s, TimerQuiet, an.req, a.cfg.UDPDrain)
	if an.role == RoleLeftAnchor && a.now-an.ackAt >= a.cfg.UDPDrain {
		// The old path still carries datagrams a drain time after our
		// switch: the right anchor may not have switched (our ACK lost,
		// and nothing of ours on the new path since), and it would go on
		// sending there until our fin, which waits for quiet. The ACK
		// again, at most once per drain time (idempotent there).
		an.ackAt = a.now
		a.sendAck(s, an)
	}
}

// onQuiet is TimerQuiet: the side's old path may have been quiet for the
// drain time.
func (a *Agent) onQuiet(s *session, k ReqKey) {
	an := a.anchorFor(s, k)
	if an == nil || an.stage != StageTwoPath || an.quiet {
		return
	}
	if left := a.cfg.UDPDrain - (a.now - an.heardAt); left > 0 {
		a.setTimer(s, TimerQuiet, an.req, left)
		return
	}
	an.quiet = true
	a.progress(s, an.req, an.role, StageTwoPath, "old path quiet")
	a.evaluate(s, an)
}
