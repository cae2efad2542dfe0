package reconfig

// Break before make (protocol/rebind.go, M2M §4.2.3): moving a session's
// first subsession (or last, at its right end) to another address of
// this host after its old one is gone, and the neighbour's side of it.

import (
	"context"
	"fmt"
	"net/netip"
	"time"

	"github.com/dysco/dysco/internal/datapath"
	"github.com/dysco/dysco/internal/protocol"
	"github.com/dysco/dysco/internal/wire"
)

// RebindOutcome is the end of one session's rebind.
type RebindOutcome struct {
	ID       uint32 // the datapath session
	Outcome  string // succeeded, refused, failed
	Reason   string
	Old, New wire.Tuple
	Took     time.Duration
}

// Rebind moves a side of each datapath session in ids (the right side at
// the session's first agent, the left at its last) to source, another
// address of this host, by a rebind to its neighbour on that side, and
// waits for the results (or ctx's deadline).
func (c *Shell) Rebind(ctx context.Context, ids []uint32, side protocol.Side, source netip.Addr) []RebindOutcome {
	type pending struct {
		id    uint32
		ch    chan protocol.RebindResult
		err   error
		start time.Time
	}
	ps := make([]*pending, len(ids))
	done := make(chan struct{})
	c.post(func() {
		for i, id := range ids {
			p := &pending{id: id, ch: make(chan protocol.RebindResult, 1), start: time.Now()}
			ps[i] = p
			if err := c.announce(id); err != nil {
				p.err = err
				continue
			}
			if v6 := c.famOf[id]; v6 == source.Unmap().Is4() {
				p.err = fmt.Errorf("the session is %s and %s is not", famName(v6), source)
				continue
			}
			c.token++
			c.rebinds[c.token] = p.ch
			c.handle(c.famOf[id], protocol.Rebind{Session: c.pidOf[id], Side: side, Source: source.Unmap(), Token: c.token})
		}
		close(done)
	})
	select {
	case <-done:
	case <-ctx.Done():
		return nil
	}
	out := make([]RebindOutcome, len(ps))
	for i, p := range ps {
		out[i].ID = p.id
		if p.err != nil {
			out[i].Outcome, out[i].Reason = "refused", p.err.Error()
			continue
		}
		select {
		case r := <-p.ch:
			out[i].Outcome, out[i].Old, out[i].New, out[i].Took = r.Outcome.String(), r.Old, r.New, time.Since(p.start)
			if r.Reason != protocol.ReasonNone {
				out[i].Reason = r.Reason.String()
			}
		case <-ctx.Done():
			out[i].Outcome, out[i].Reason = "failed", "no result before the deadline"
		}
	}
	return out
}

// onRebindResult hands a rebind's end to its waiter.
func (c *Shell) onRebindResult(x protocol.RebindResult) {
	c.rebindsDone.Add(1)
	if x.Outcome != protocol.Succeeded {
		c.rebindsFailed.Add(1)
	}
	if ch, ok := c.rebinds[x.Token]; ok {
		delete(c.rebinds, x.Token)
		ch <- x
	}
	c.log.Info("rebind", "session", x.Session, "req", x.Req.String(), "outcome", x.Outcome.String(), "reason", x.Reason.String(),
		"old", x.Old.String(), "new", x.New.String())
}

// rebindHoldLimit bounds what a side holds while its rebind runs: beyond
// it packets are dropped, and TCP sends them again.
const rebindHoldLimit = 4 << 20

// moveSub carries out a step of a subsession's move (protocol.MoveSubsession):
// the new subsession's ingress flow is a copy of the old one's (its
// session, flags, marks and translation), the side's egress sends to the
// new subsession (and is routed again, by its new source or destination),
// and the old ingress flow stays until RemoveSubsession (after Linger), at
// both ends. The mover holds the side's packets from
// the listen step (its old address is gone: they would be lost) and sends
// them on once it has switched, or given up.
func (c *Shell) moveSub(x protocol.MoveSubsession) error {
	dp := c.dp
	id := c.dpID(x.Session)
	s, ok := dp.Session(id)
	if !ok {
		return fmt.Errorf("no datapath session %d", id)
	}
	// The tuples of packets this host sends on the side.
	oldOut, newOut := x.Old, x.New
	if x.Side == protocol.SideLeft {
		oldOut, newOut = x.Old.Reverse(), x.New.Reverse()
	}
	oldIn, newIn := datapath.TupleOf(oldOut.Reverse(), s.Proto), datapath.TupleOf(newOut.Reverse(), s.Proto)
	listen := func() error {
		if f, ok := dp.Flow(newIn); ok && f.SessId == id {
			return nil // a subsession the session had (it moves back)
		}
		f, ok := dp.Flow(oldIn)
		if !ok || f.SessId != id {
			return fmt.Errorf("session %d has no ingress flow %s", id, oldIn)
		}
		if err := dp.AddFlow(newIn, f); err != nil {
			return err
		}
		if d, ok := dp.Delta(oldIn); ok {
			return dp.PutDelta(newIn, d)
		}
		return nil
	}
	sw := func() error {
		eg := s.Tuple.Wire().Reverse()
		if x.Side == protocol.SideRight {
			eg = c.onward(id, &s)
		}
		egKey := datapath.TupleOf(eg, s.Proto)
		nw := datapath.TupleOf(newOut, s.Proto)
		k := datapath.TPKey{SessId: id, Side: uint32(x.Side)}
		if tp, ok := dp.TwoPath(k); ok && tp.NewOut.Wire() == oldOut {
			// A side reconfigured before: its egress takes the record's
			// new path.
			if tp.State != datapath.TPNew {
				return fmt.Errorf("side %s of session %d is in a reconfiguration", x.Side, id)
			}
			tp.NewOut, tp.RerouteNew = nw, 1
			if err := dp.PutTwoPath(k, tp); err != nil {
				return err
			}
		}
		if f, ok := dp.Flow(egKey); ok && f.SessId == id && f.Out.Wire() == oldOut {
			f.Out = datapath.EndsFrom(newOut)
			f.Flags |= datapath.FlReroute
			if err := dp.ReplaceFlow(egKey, f); err != nil {
				return err
			}
		}
		return nil
	}
	egKey := func() datapath.Tuple {
		if x.Side == protocol.SideRight {
			return datapath.TupleOf(c.onward(id, &s), s.Proto)
		}
		return datapath.TupleOf(s.Tuple.Wire().Reverse(), s.Proto)
	}
	release := func() {
		if h := c.rebindHolds[id]; h != nil {
			delete(c.rebindHolds, id)
			go c.holder.release(h)
		}
	}
	switch x.Step {
	case protocol.MoveListen:
		if err := listen(); err != nil {
			return err
		}
		if c.holder != nil && c.rebindHolds[id] == nil {
			h, err := c.holder.start(id, egKey(), datapath.FlHoldAll, rebindHoldLimit, nil)
			if err != nil {
				// A migration holds them already: they wait there.
				c.log.Info("rebind: packets not held", "session", id, "err", err)
			} else {
				c.rebindHolds[id] = h
			}
		}
		return nil
	case protocol.MoveSwitch:
		// The old ingress flow stays until RemoveSubsession.
		err := sw()
		release()
		return err
	case protocol.MoveAbandon:
		dp.DeleteFlow(newIn)
		release()
		return nil
	case protocol.MoveGiveUp:
		// New's ingress flow stays until RemoveSubsession.
		release()
		return nil
	case protocol.MoveAll:
		if err := listen(); err != nil {
			return err
		}
		c.rebindsIn.Add(1)
		// The old ingress flow stays until RemoveSubsession.
		return sw()
	}
	return fmt.Errorf("unknown move step %d", x.Step)
}
