package reconfig

// Reconfigurations requested through the local API, this agent their
// left anchor.

import (
	"context"
	"fmt"
	"net/netip"
	"time"

	"github.com/dysco/dysco/internal/api"
	"github.com/dysco/dysco/internal/protocol"
)

// Reconfigure runs a reconfiguration of each datapath session in ids, this
// agent their left anchor, replacing the segment up to the right anchor to
// by a new path through chain (§3.1), and waits for the results (or ctx's
// deadline). mig, if not nil, migrates the middlebox's state (§3.5).
func (c *Shell) Reconfigure(ctx context.Context, ids []uint32, to netip.Addr, chain []netip.Addr, mig *MigrateOptions) []Outcome {
	return c.ReconfigurePath(ctx, ids, NewPath{To: to, Chain: chain}, mig)
}

// NewPath is the new path of a reconfiguration: the right anchor To, the
// chain of middleboxes before it, the network function each hop must run
// (NFs: one per hop, "" for none; nil: none), which the hop's agent
// starts before it joins the new path (heterogeneous-sfc-quic §IV), and
// the local address it leaves from (Source; zero: the route's), for a
// session moving to another of this host's addresses or interfaces.
type NewPath struct {
	To     netip.Addr
	Chain  []netip.Addr
	NFs    []string
	Source netip.Addr
}

// ReconfigurePath is Reconfigure onto the new path np.
func (c *Shell) ReconfigurePath(ctx context.Context, ids []uint32, np NewPath, mig *MigrateOptions) []Outcome {
	to := np.To
	type pending struct {
		id    uint32
		ch    chan waited
		mig   chan api.MigrationReport
		start time.Time
		err   error
	}
	ps := make([]*pending, len(ids))
	done := make(chan struct{})
	c.post(func() {
		for i, id := range ids {
			p := &pending{id: id, ch: make(chan waited, 1), start: time.Now()}
			ps[i] = p
			if err := c.announce(id); err != nil {
				p.err = err
				continue
			}
			if err := c.sameFamily(id, to); err != nil {
				p.err = err
				continue
			}
			if np.Source.IsValid() && np.Source.Unmap().Is4() != to.Unmap().Is4() {
				p.err = fmt.Errorf("the new path's source %s and the right anchor %s are of different address families", np.Source, to)
				continue
			}
			c.checkReady(c.pidOf[id])
			c.token++
			c.waiters[c.token] = p.ch
			c.started[c.token] = p.start
			if mig != nil {
				p.mig = make(chan api.MigrationReport, 1)
				c.startMigration(c.token, *mig, p.start, p.mig)
			}
			var spec *protocol.MigrateSpec
			if mig != nil {
				spec = migrateSpec(mig)
			}
			c.handle(c.famOf[id], protocol.Reconfigure{Session: c.pidOf[id], RightAnchor: to, Chain: np.Chain, NFs: np.NFs,
				Source: np.Source, Token: c.token, Migrate: spec})
		}
		close(done)
	})
	select {
	case <-done:
	case <-ctx.Done():
		return nil
	}
	out := make([]Outcome, len(ps))
	for i, p := range ps {
		out[i].ID = p.id
		if p.err != nil {
			out[i].Outcome, out[i].Reason = "refused", p.err.Error()
			continue
		}
		select {
		case w := <-p.ch:
			out[i].Result, out[i].Record = &w.res, w.rec
			if p.mig != nil {
				rep := <-p.mig // sent with the result
				out[i].Migration = &rep
			}
		case <-ctx.Done():
			out[i].Outcome, out[i].Reason = "failed", "no result before the deadline"
		}
	}
	return out
}

// sameFamily refuses a right anchor of another address family than the
// session's (announced) id: the new path carries the same TCP session. The
// protocol would refuse it too, as an invalid request; this says why.
func (c *Shell) sameFamily(id uint32, to netip.Addr) error {
	if v6 := c.famOf[id]; v6 == to.Unmap().Is4() {
		return fmt.Errorf("the session is %s and the right anchor %s is not: a new path keeps the session's address family", famName(v6), to)
	}
	return nil
}

// famName names an address family for messages.
func famName(v6 bool) string {
	if v6 {
		return "IPv6"
	}
	return "IPv4"
}

// Outcome is the outcome of one session's reconfiguration.
type Outcome struct {
	ID uint32 // the datapath session
	// Result is the protocol's result; nil if the request never started
	// (Outcome and Reason say why) or had none before the deadline.
	Result *protocol.Result
	// Record is the result as the history records it (with Result).
	Record    api.ReconfigResult
	Migration *api.MigrationReport
	Outcome   string
	Reason    string
}
