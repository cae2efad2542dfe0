package reconfig

// What the agent's API asks of the shell.

import (
	"context"
	"fmt"
	"net/netip"
	"time"

	"github.com/dysco/dysco/internal/api"
	"github.com/dysco/dysco/internal/datapath"
	"github.com/dysco/dysco/internal/protocol"
)

// ParseMigrate checks a request's state migration part (nil: none) for a
// new chain of hops middleboxes.
func ParseMigrate(spec *api.MigrateSpec, hops int) (*MigrateOptions, error) {
	if spec == nil {
		return nil, nil
	}
	if err := spec.Validate(); err != nil {
		return nil, err
	}
	o := &MigrateOptions{Semantics: spec.Semantics, HoldLimit: spec.HoldLimit, Timeout: time.Duration(spec.TimeoutMS) * time.Millisecond}
	if err := o.normalize(); err != nil {
		return nil, fmt.Errorf("migrate: %w", err)
	}
	if hops != 1 {
		return nil, fmt.Errorf("migrate: state migration replaces one middlebox by one: the new chain has %d", hops)
	}
	return o, nil
}

// RemoveSelf takes this host, a middlebox, out of each of sessions (with
// the middleboxes with in its place, if any): it sends a trigger per
// session to the session's left neighbour and collects the results.
func (c *Shell) RemoveSelf(ctx context.Context, sessions []datapath.SessionEntry, with []netip.Addr, mig *api.MigrateSpec) []api.ReconfigResult {
	type pending struct {
		res api.ReconfigResult
		ch  chan trigOutcome
		at  time.Time
	}
	var ps []*pending
	done := make(chan struct{})
	c.post(func() {
		defer close(done)
		for _, s := range sessions {
			if c.leftPath(s.ID) {
				continue // no longer passing through this host
			}
			p := &pending{res: api.ReconfigResult{ID: s.ID, Session: s.Tuple.Wire().String()}, at: time.Now()}
			ps = append(ps, p)
			_, ok1 := c.currentSub(s.ID, &s.Session, protocol.SideLeft)
			right, ok2 := c.currentSub(s.ID, &s.Session, protocol.SideRight)
			if !ok1 || !ok2 {
				p.res.Outcome, p.res.Reason = "refused", "this host is not in the middle of the session"
				continue
			}
			// The protocol sends the trigger on the session's left side,
			// as it knows it (announced from the datapath if need be).
			if err := c.announce(s.ID); err != nil {
				p.res.Outcome, p.res.Reason = "refused", err.Error()
				continue
			}
			var chain []netip.Addr
			for _, h := range with {
				chain = append(chain, h.Unmap())
			}
			ch, err := c.sendTrigger(s.ID, right.Dst, chain, mig, 0)
			if err != nil {
				p.res.Outcome, p.res.Reason = "refused", err.Error()
				continue
			}
			p.ch = ch
		}
	})
	select {
	case <-done:
	case <-ctx.Done():
		return nil
	}
	out := make([]api.ReconfigResult, 0, len(ps))
	for _, p := range ps {
		if p.ch != nil {
			select {
			case m := <-p.ch:
				p.res.Outcome, p.res.Reason, p.res.Blocker = m.Outcome, m.Reason, m.Blocker
				p.res.Micros = m.Micros
				p.res.Migration = m.Migration
			case <-ctx.Done():
				p.res.Outcome, p.res.Reason = "failed", "no result before the deadline"
			}
		}
		out = append(out, p.res)
	}
	return out
}

// leftPath tells whether this host is a middle of an old path of session
// id, torn down or being torn down by a reconfiguration (§3.5): the session
// lingers here to answer FINs, but no longer passes through this host.
// Loop goroutine.
func (c *Shell) leftPath(id uint32) bool {
	pid, ok := c.pidOf[id]
	if !ok {
		return false
	}
	p := c.protos[c.famOf[id]]
	if p == nil {
		return false
	}
	v, ok := p.View(pid)
	return ok && v.Teardown
}

// Counters are the shell's counters for the agent's status (§3.3): control
// messages refused by reason, messages and datagrams in and out (a bundle
// carries several messages, docs/protocol.md "Bundles"), and the packet
// holding of state migration.
func (c *Shell) Counters() map[string]uint64 {
	st := map[string]uint64{}
	for r, n := range c.rejectedCounts() {
		st["control_rejected_"+r] = n
	}
	st["control_messages_in"] = c.msgsIn.Load()
	st["control_messages_out"] = c.msgsOut.Load()
	st["control_datagrams_in"] = c.dgramsIn.Load()
	st["control_datagrams_out"] = c.dgramsOut.Load()
	st["rebinds"], st["rebinds_failed"], st["rebinds_accepted"] = c.rebindsDone.Load(), c.rebindsFailed.Load(), c.rebindsIn.Load()
	if hs := c.holds; hs != nil {
		// Held packets sent on again, failures, and packets that
		// arrived for no hold (sent on at once).
		hs.injMu.Lock()
		st["hold_reinjected"], st["hold_reinject_errors"], st["hold_stray"] = uint64(hs.injected), uint64(hs.injectErrs), uint64(hs.stray)
		// Packets straddling a cut-off that the agent split (both
		// parts sent again), and that it sent again whole.
		st["tp_split"], st["tp_split_whole"] = uint64(hs.splits), uint64(hs.splitWhole)
		hs.injMu.Unlock()
	}
	return st
}

// Holds reports whether the shell reads the datapath's hold ring (state
// migration, and packets split at a cut-off).
func (c *Shell) Holds() bool { return c.holds != nil }

// Views are the protocol's views of the sessions it knows, by datapath id.
func (c *Shell) Views() map[uint32]protocol.SessionView { return c.views() }

// SessionsEnded tells the shell that the collector ended these datapath
// sessions.
func (c *Shell) SessionsEnded(ids []uint32) { c.sessionsEnded(ids) }

// History is the last results of reconfigurations this agent ran as left
// anchor, oldest first.
func (c *Shell) History() []api.ReconfigResult { return c.reconfigHistory() }

// JoinNote joins two notes of a result's reason.
func JoinNote(a, b string) string { return joinNote(a, b) }
