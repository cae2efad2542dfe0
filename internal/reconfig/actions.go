package reconfig

// The core's actions carried out on the datapath: timers, new and
// removed subsessions, joins (§3.1), the two-path phase (§3.5), locks
// kept for a restart (§3.2), freed sessions.

import (
	"errors"
	"fmt"
	"net/netip"
	"syscall"
	"time"

	"github.com/dysco/dysco/internal/datapath"
	"github.com/dysco/dysco/internal/protocol"
	"github.com/dysco/dysco/internal/wire"
)

func (c *Shell) do(v6 bool, act protocol.Action) error {
	dp := c.dp
	switch x := act.(type) {
	case protocol.Send:
		c.send(x.To, x.From, x.Data)
		return nil
	case protocol.SetTimer:
		k := timerKey{v6, x.ID}
		if t := c.timers[k]; t != nil {
			t.Stop()
		}
		d := x.At - now()
		c.timers[k] = time.AfterFunc(max(d, 0), func() {
			c.post(func() {
				if c.timers[k] == nil {
					return
				}
				delete(c.timers, k)
				if x.ID.Kind == protocol.TimerQuiet {
					// A UDP anchor's drain: the old path's count
					// as it is now, before the timer (the core
					// takes the side for quiet only if it did not
					// move; docs/protocol.md, "UDP sessions").
					id := c.dpID(x.ID.Session)
					for side := uint32(0); side < 2; side++ {
						c.progress(datapath.TPKey{SessId: id, Side: side})
					}
				}
				c.handle(v6, protocol.TimerFired{ID: x.ID})
			})
		})
	case protocol.CancelTimer:
		k := timerKey{v6, x.ID}
		if t := c.timers[k]; t != nil {
			t.Stop()
			delete(c.timers, k)
		}
	case protocol.AddSubsession:
		// The protocol sends before it installs (docs/protocol.md,
		// settingUp): the map work need not delay the SYN.
		c.flush()
		return c.addSub(x)
	case protocol.StartTwoPath:
		k := datapath.TPKey{SessId: c.dpID(x.Session), Side: uint32(x.Side)}
		// EBUSY: the side's first new-path packet is starting it right
		// now (an armed record); it reports progress itself.
		if err := dp.StartTwoPath(k); err != nil && !errors.Is(err, syscall.EBUSY) {
			return err
		}
		c.active[k] = true
		// The variables at the cut-off: enough to finish at once when
		// nothing was in flight. After the current actions (never
		// c.post from the loop itself: with its channel full it would
		// wait for itself).
		c.deferred = append(c.deferred, func() { c.progress(k) })
	case protocol.EndTwoPath:
		k := datapath.TPKey{SessId: c.dpID(x.Session), Side: uint32(x.Side)}
		delete(c.active, k)
		delete(c.prevTP, k)
		if tp, ok := dp.TwoPath(k); ok {
			// The new ingress flow inherits what arrived on the old path.
			_ = dp.MergeMarks(tp.InOld, datapath.TupleOf(tp.NewOut.Wire().Reverse(), tp.NewOut.Proto))
		}
		dp.DeleteTPReq(k)
		// FINs that went on the old path: the new path's middleboxes
		// never saw them (protocol.FinsSeen). After the current actions.
		id, sess := k.SessId, x.Session
		c.deferred = append(c.deferred, func() {
			if s, ok := dp.Session(id); ok && s.State&(datapath.StFINFwd|datapath.StFINRev) != 0 {
				c.handle(v6, protocol.FinsSeen{Session: sess, Fwd: s.State&datapath.StFINFwd != 0, Rev: s.State&datapath.StFINRev != 0})
			}
		})
		return dp.SetTwoPathState(k, datapath.TPNew)
	case protocol.RemoveSubsession:
		return c.removeSub(x)
	case protocol.MoveSubsession:
		return c.moveSub(x)
	case protocol.RebindResult:
		c.onRebindResult(x)
	case protocol.NewPathReady:
		c.onNewPathReady(v6, x)
	case protocol.Hold:
		c.doHold(v6, x)
	case protocol.ReleaseHold:
		c.doReleaseHold(x)
	case protocol.WaitDrained:
		c.doWaitDrained(v6, x)
	case protocol.ExportState:
		c.doExport(v6, x)
	case protocol.ImportState:
		c.doImport(v6, x)
	case protocol.ReleaseState:
		c.doReleaseState(x)
	case protocol.MigrationDone:
		c.onMigrationDone(v6, x)
	case protocol.SetWindowClamp:
		k := datapath.TPKey{SessId: c.dpID(x.Session), Side: uint32(x.Side)}
		if err := dp.SetWindowClamp(k, x.Bytes); !errors.Is(err, syscall.ENOENT) {
			return err // nil, or a failure; ENOENT: the side's record is gone
		}
		return nil
	case protocol.StartNF:
		c.doStartNF(v6, x)
	case protocol.JoinSession:
		c.flush() // as AddSubsession: the SYN goes on first
		if err := c.join(v6, x); err != nil {
			// The protocol must not go on with a path this host does
			// not carry: it refuses the new path (after the current
			// actions).
			c.deferred = append(c.deferred, func() { c.handle(v6, protocol.JoinFailed{Session: x.Session}) })
			return err
		}
		return nil
	case protocol.KeepLock:
		// A middle agent's lock, for its next run if it restarts (§3.2):
		// announce gives it back (SessionUp.Lock), and resumeSpliced for
		// a proxy's joined session (kept under its client session, whose
		// id is the joined session's). The protocol emits it
		// after the ackLock it passes on, which leaves first: the map
		// write (some 20 µs here) is not on the request's path.
		c.flush()
		id := c.dpID(x.Session)
		if id == 0 || c.pidOf[id] != x.Session {
			// A session freed meanwhile (a new path through this host
			// took its place): nothing to keep.
			return nil
		}
		if x.Req.IsZero() {
			dp.DeleteLock(id)
			return nil
		}
		return dp.PutLock(id, x.Req.LeftAnchor.As16(), x.Req.ID)
	case protocol.FreeSession:
		if p, ok := c.spliced[x.Session]; ok {
			delete(c.spliced, x.Session)
			c.freeSpliced(p)
			c.forget(p.client, x.Session)
			c.forget(p.server, x.Session)
			return nil
		}
		id := c.dpID(x.Session)
		if id == 0 || c.pidOf[id] != x.Session {
			return nil // freed already (a new path through this host took its place)
		}
		c.free(id)
		c.drop(id, x.Session)
	case protocol.JoinedWScale:
		id := c.dpID(x.Session)
		if id == 0 {
			return nil
		}
		return dp.SetLeftwardWScale(id, x.Rev)
	case protocol.MarkClosed:
		id := c.dpID(x.Session)
		if id == 0 {
			return nil
		}
		var dirs uint32
		if x.Fwd {
			dirs |= datapath.StFINFwd
		}
		if x.Rev {
			dirs |= datapath.StFINRev
		}
		return dp.MarkClosed(id, dirs)
	case protocol.Result:
		c.migrationEnded(x.Token)
		rep, hasRep := c.migReports[x.Token]
		delete(c.migReports, x.Token)
		rec := c.record(x, rep, hasRep)
		if ch, ok := c.migOut[x.Token]; ok {
			delete(c.migOut, x.Token)
			ch <- rep
		}
		if ch, ok := c.waiters[x.Token]; ok {
			delete(c.waiters, x.Token)
			ch <- waited{res: x, rec: rec}
		}
		if x.Trigger.IsZero() {
			c.log.Info("reconfiguration", "session", x.Session, "req", x.Req.String(), "outcome", x.Outcome.String(),
				"reason", x.Reason.String(), "blocker", x.Blocker.String())
		} else {
			c.log.Info("reconfiguration", "session", x.Session, "req", x.Req.String(), "outcome", x.Outcome.String(),
				"reason", x.Reason.String(), "blocker", x.Blocker.String(), "trigger", x.Trigger.String())
		}
	case protocol.TriggerAccepted:
		c.onTriggerAccepted(x)
	case protocol.TriggerResult:
		c.onTriggerResult(x)
	case protocol.Rejected:
		c.countReject(x.Reason.String())
		if x.Reason == protocol.RejectVersion {
			c.olderPeer(x.From, x.Detail)
		}
		c.log.Debug("control message refused", "reason", x.Reason.String(), "type", x.Type.String(), "from", x.From, "detail", x.Detail)
	case protocol.Progress:
		c.notePhase(x)
		c.log.Debug("reconfiguration progress", "session", x.Session, "req", x.Req.String(), "role", x.Role.String(), "stage", x.Stage.String(), "note", x.Note)
	}
	return nil
}

// addSub installs a new subsession on a side (protocol.AddSubsession): its
// ingress flow with the side's translation, and the side's two-path record,
// then points the side's flows at the record.
func (c *Shell) addSub(x protocol.AddSubsession) error {
	dp := c.dp
	id := c.dpID(x.Session)
	s, ok := dp.Session(id)
	if !ok {
		return fmt.Errorf("no datapath session %d", id)
	}
	t := s.Tuple.Wire()
	// On the right the session leaves with its onward tuple, and the new
	// subsession's packets enter as the reverse of it (behind a NAT, what
	// the middlebox expects back).
	on := t
	if x.Side == protocol.SideRight {
		on = c.onward(id, &s)
	}
	eg, newOut, inFlow := on, x.Sub, datapath.Flow{Out: datapath.EndsFrom(on.Reverse()), SessId: id,
		Flags: datapath.FlIngress | datapath.FlRev | datapath.FlEst | datapath.FlTPNew | datapath.FlDelta}
	sndWS := s.Ws[0]
	if x.Side == protocol.SideLeft {
		eg, newOut = t.Reverse(), x.Sub.Reverse()
		inFlow.Out, inFlow.Flags = datapath.EndsFrom(t), datapath.FlIngress|datapath.FlEst|datapath.FlTPNew|datapath.FlDelta
		sndWS = s.Ws[1]
	}
	if sndWS == 0xff {
		sndWS = 0
	}
	egKey := datapath.TupleOf(eg, s.Proto)
	k := datapath.TPKey{SessId: id, Side: uint32(x.Side)}
	tp := datapath.TPVal{State: datapath.TPIdle, EgKey: egKey, NewOut: datapath.TupleOf(newOut, s.Proto), SndWs: sndWS, Nonce: x.Nonce}
	if x.Armed {
		tp.Armed = 1
	}
	if c.holds != nil {
		// This agent reads the hold ring: the datapath hands it packets
		// straddling the cut-off to split (holds.split).
		tp.Split = 1
	}
	if old, ok := dp.TwoPath(k); ok {
		if old.State != datapath.TPNew {
			return fmt.Errorf("side %s of session %d is already in a reconfiguration", x.Side, id)
		}
		// A second reconfiguration: the previous new path is the old
		// one now, with its translation.
		c.prevTP[k] = old
		tp.OldOut, tp.RerouteOld = old.NewOut, old.RerouteNew
		// Its ingress flow stops being a new subsession before the armed
		// record goes in: the datapath would take its packets for the
		// first on the new path and start this side at once, sending on
		// a path the other anchor may not receive on yet (it installs
		// after its SYN) — a reset of the session.
		if err := dp.SetFlowFlags(datapath.TupleOf(old.NewOut.Wire().Reverse(), s.Proto), 0, datapath.FlTPNew); err != nil {
			return err
		}
		if err := dp.PutDelta(egKey, old.Nd); err != nil {
			return err
		}
		if err := dp.SetFlowFlags(egKey, datapath.FlDelta, 0); err != nil {
			return err
		}
	} else {
		f, ok := dp.Flow(egKey)
		if !ok || f.SessId != id {
			return fmt.Errorf("session %d has no egress flow %s", id, eg)
		}
		tp.OldOut = f.Out.Tuple()
		if f.Flags&datapath.FlReroute != 0 {
			tp.RerouteOld = 1
		}
	}
	tp.InOld = datapath.TupleOf(tp.OldOut.Wire().Reverse(), s.Proto)
	// A new subsession leaving from another local address (a session
	// moved to another interface, Reconfigure.Source) is routed again,
	// by its source (route.h), even towards the same next hop.
	if !c.cfg.SameRoute(eg.Dst, newOut.Dst) || x.Side == protocol.SideRight && newOut.Src != tp.OldOut.Wire().Src {
		tp.RerouteNew = 1
	}
	tp.Nd = datapath.Delta{Ack: -int32(x.Delta.Seq), Tsecr: -int32(x.Delta.TS)}
	in := datapath.Delta{Seq: int32(x.Delta.Seq), Tsval: int32(x.Delta.TS), WsIn: x.WScaleIn, WsOut: x.WScaleOut}
	if x.WScaleIn != x.WScaleOut {
		in.WsOn = 1
	}
	newIn := datapath.TupleOf(newOut.Reverse(), s.Proto)
	// What a restarted agent needs to resume the request (reconfigured).
	rq := datapath.TPReq{LeftAnchor: x.Req.LeftAnchor.As16(), Id: x.Req.ID, RightAnchor: x.RightAnchor.As16(),
		OldNonce: x.OldNonce, Role: datapath.TPReqLeftAnchor}
	if x.Side == protocol.SideLeft {
		rq.Role = datapath.TPReqRightAnchor
	}
	if prev, ok := c.prevTP[k]; ok {
		rq.Prev, rq.HasPrev = prev, 1
	}
	kept, err := dp.AddSubsession(k, newIn, inFlow, in, tp, rq)
	if err != nil {
		return err
	}
	if !kept {
		// The reconfiguration goes on; only an agent restart in its
		// middle could not resume it.
		c.log.Warn("control: cannot record the request of a reconfiguration", "session", id)
	}
	return nil
}

// removeSub deletes a subsession's ingress flow. Removing the new one of a
// side that has not switched to it is a cancellation (§3.6): the side goes
// back to what it was.
func (c *Shell) removeSub(x protocol.RemoveSubsession) error {
	dp := c.dp
	id := c.dpID(x.Session)
	k := datapath.TPKey{SessId: id, Side: uint32(x.Side)}
	out := x.Sub
	if x.Side == protocol.SideLeft {
		out = x.Sub.Reverse()
	}
	var proto uint8
	if s, ok := dp.Session(id); ok {
		proto = s.Proto
	}
	in := datapath.TupleOf(out.Reverse(), proto)
	tp, ok := dp.TwoPath(k)
	// An old path removed after its linger leaves its marks behind: the
	// side's end of the two-path phase (EndTwoPath) merged them into the
	// new ingress flow, and what arrives on the old path after it carries
	// nothing beyond them (all of the other side's old data had arrived,
	// and ours had been acknowledged). Merging again here, seconds later,
	// compared marks that a fast session had moved more than 3 GiB apart
	// on the new path meanwhile: in 32-bit sequence space the old mark
	// then looked up to 2^30 ahead, replaced the new one, and the next
	// reconfiguration's cut-off came from it (the session stalled;
	// TestReconfigureMonitor at 9 Gbit/s, three seconds of linger).
	dp.DeleteFlow(in)
	if !ok || tp.NewOut != datapath.TupleOf(out, proto) || tp.State == datapath.TPNew {
		return nil
	}
	delete(c.active, k)
	_ = dp.SetFlowFlags(tp.InOld, 0, datapath.FlTPOld)
	if prev, ok := c.prevTP[k]; ok {
		delete(c.prevTP, k)
		_ = dp.SetFlowFlags(tp.EgKey, 0, datapath.FlDelta)
		dp.DeleteDelta(tp.EgKey)
		dp.DeleteTPReq(k)
		return dp.PutTwoPath(k, prev) // hash map update: the variables are not in use
	}
	if err := dp.SetFlowFlags(tp.EgKey, 0, datapath.FlTPOut); err != nil {
		return err
	}
	dp.DeleteTwoPath(k)
	return nil
}

// join creates the state of a middlebox joining a new path (§3.1): a
// session with the tuple of the session and its two subsessions.
func (c *Shell) join(v6 bool, x protocol.JoinSession) error {
	dp := c.dp
	t, l, r := x.Tuple, x.Left.Sub, x.Right.Sub
	// The SYN was checked when it came (onPacket: liveHere), but the
	// session may have come through this host since.
	proto := dpProto(x.Proto)
	if _, live := c.liveHere(t, x.Nonce, proto); live {
		return fmt.Errorf("join: session %s is already on a live path through this host", t)
	}
	sess := datapath.Session{Tuple: datapath.EndsFrom(t), Nonce: x.Nonce, Role: datapath.RoleMiddle, Proto: proto,
		State: datapath.StSYN | datapath.StSYNACK | datapath.StEst | datapath.StSetupDone}
	if v6 {
		sess.IsV6 = 1
	}
	// The window scale of the rightward direction came with the SYN; the
	// leftward one comes with the synAck (JoinedWScale).
	sess.Ws = [2]uint8{x.Right.SendWScale, 0xff}
	sess.CreatedMs = datapath.Now()
	sess.LastMs = sess.CreatedMs
	reroute := func(from, to netip.Addr) uint32 {
		if from == to || c.cfg.SameRoute(from, to) {
			return 0
		}
		return datapath.FlReroute | datapath.FlRouted
	}
	tap := uint32(0)
	if c.cfg.Tap {
		tap = datapath.FlTap
	}
	// This host may still hold the session from an old path being torn
	// down (both anchors' fins have passed it, it lingers to pass
	// retransmissions), or from a session that has ended: the new path
	// replaces it.
	for _, k := range []wire.Tuple{l, t, r.Reverse(), t.Reverse()} {
		f, ok := dp.Flow(datapath.TupleOf(k, proto))
		if !ok {
			continue
		}
		old := f.SessId
		pid, known := c.pidOf[old]
		c.log.Info("join: the old path's state of the session gives way to the new path", "session", t.String(), "old_id", old)
		c.free(old) // while its onward tuple is still known
		if known {
			// The protocol forgets it as if the collector had ended it
			// (after the current actions): its datapath state is gone.
			fam := c.famOf[old]
			c.drop(old, pid)
			c.deferred = append(c.deferred, func() { c.handle(fam, protocol.SessionEnd{Session: pid, Cause: "replaced", Replaced: true}) })
		}
	}
	id, err := dp.InsertSession(sess)
	if err != nil {
		return err
	}
	flows := []struct {
		k datapath.Tuple
		f datapath.Flow
	}{
		{datapath.TupleOf(l, proto), datapath.Flow{Out: datapath.EndsFrom(t), SessId: id, Flags: datapath.FlIngress | datapath.FlEst | tap}},
		{datapath.TupleOf(t, proto), datapath.Flow{Out: datapath.EndsFrom(r), SessId: id, Flags: datapath.FlEst | reroute(t.Dst, r.Dst)}},
		{datapath.TupleOf(r.Reverse(), proto), datapath.Flow{Out: datapath.EndsFrom(t.Reverse()), SessId: id, Flags: datapath.FlIngress | datapath.FlRev | datapath.FlEst | tap}},
		{datapath.TupleOf(t.Reverse(), proto), datapath.Flow{Out: datapath.EndsFrom(l.Reverse()), SessId: id, Flags: datapath.FlRev | datapath.FlEst | reroute(t.Src, l.Src)}},
	}
	for i, fl := range flows {
		if err := dp.AddFlow(fl.k, fl.f); err != nil {
			for _, g := range flows[:i] {
				dp.DeleteFlow(g.k)
			}
			dp.DeleteSession(id)
			return err
		}
	}
	c.joinedDP[x.Session] = id
	c.pidOf[id], c.famOf[id] = x.Session, v6
	c.holdNF(id, x.NF)
	c.notReady[x.Session] = &readyPoll{id: id, every: 20 * time.Millisecond}
	return nil
}

// free deletes a session and everything of it at this host (one system
// call: datapath.FreeSession). Should that fail, the collector still ends
// the session when it falls idle, and its flows with it.
func (c *Shell) free(id uint32) {
	if _, err := c.dp.FreeSession(id, c.onwardKey(id)); err != nil {
		c.log.Warn("control: cannot free a session's state; the collector will", "id", id, "err", err)
	}
}
