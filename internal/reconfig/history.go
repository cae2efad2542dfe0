package reconfig

// Counters, views and the history of results at this left anchor.

import (
	"sync/atomic"
	"time"

	"github.com/dysco/dysco/internal/api"
	"github.com/dysco/dysco/internal/protocol"
)

func (c *Shell) countReject(reason string) {
	v, _ := c.rejected.LoadOrStore(reason, new(atomic.Uint64))
	v.(*atomic.Uint64).Add(1)
}

// rejectedCounts returns the refused control messages by reason.
func (c *Shell) rejectedCounts() map[string]uint64 {
	out := map[string]uint64{}
	c.rejected.Range(func(k, v any) bool {
		out[k.(string)] = v.(*atomic.Uint64).Load()
		return true
	})
	return out
}

// views returns the protocol's view of the sessions it knows, by datapath id.
func (c *Shell) views() map[uint32]protocol.SessionView {
	out := map[uint32]protocol.SessionView{}
	done := make(chan struct{})
	c.post(func() {
		defer close(done)
		for id, pid := range c.pidOf {
			if p := c.protos[c.famOf[id]]; p != nil {
				if v, ok := p.View(pid); ok {
					out[id] = v
				}
			}
		}
	})
	<-done
	return out
}

// historyLen bounds the results kept for `dysco reconfig history`.
const historyLen = 4096

// waited is what a caller waiting for a request's result gets: the result
// and its record as `dysco reconfig history` shows it (times measured when
// the result came, not when the caller looked).
type waited struct {
	res protocol.Result
	rec api.ReconfigResult
}

// record keeps a result (loop goroutine) and returns the record.
func (c *Shell) record(x protocol.Result, rep api.MigrationReport, hasRep bool) api.ReconfigResult {
	// The time first: what follows is this record's bookkeeping, not the
	// reconfiguration's.
	at, timed := c.started[x.Token]
	took := time.Since(at)
	r := api.ReconfigResult{ID: c.dpID(x.Session), Outcome: x.Outcome.String(), Reason: reasonText(x), Blocker: blockerText(x),
		Unchanged: x.Unchanged}
	if hasRep {
		r.Migration = &rep
		if rep.Error != "" {
			r.Reason = joinNote(r.Reason, rep.Error)
		}
	}
	if s, ok := c.dp.Session(r.ID); ok {
		r.Session = s.Tuple.Wire().String()
	}
	if timed {
		r.Micros = took.Microseconds()
		delete(c.started, x.Token)
		if ph, ok := c.phases[x.Req]; ok {
			if !ph.locked.IsZero() {
				r.LockMicros = ph.locked.Sub(at).Microseconds()
			}
			if !ph.twoPath.IsZero() {
				r.SetupMicros = ph.twoPath.Sub(at).Microseconds()
			}
			if !ph.nfStart.IsZero() {
				end := ph.nfEnd
				if end.IsZero() {
					end = at.Add(took)
				}
				r.NF, r.NFMicros = ph.nf, end.Sub(ph.nfStart).Microseconds()
			}
		}
	}
	delete(c.phases, x.Req)
	if len(c.history) >= historyLen {
		c.history = append(c.history[:0], c.history[len(c.history)-historyLen/2:]...)
	}
	c.history = append(c.history, r)
	return r
}

// phaseTimes are when a request this host is the left anchor of reached
// its phases (api.ReconfigResult's LockMicros and SetupMicros).
type phaseTimes struct {
	locked, twoPath time.Time
	// nfStart and nfEnd: the new path's wait for a network function
	// (protocol.Progress.NF), nf its name.
	nfStart, nfEnd time.Time
	nf             string
}

// maxPhases bounds c.phases: requests whose result never comes (an agent
// stopped mid-way cannot happen, but a protocol bug must not grow memory).
const maxPhases = 1 << 16

// notePhase records the phases of the left anchor's requests.
func (c *Shell) notePhase(x protocol.Progress) {
	if x.Role != protocol.RoleLeftAnchor {
		return
	}
	if c.phases == nil || len(c.phases) >= maxPhases {
		c.phases = map[protocol.ReqKey]phaseTimes{}
	}
	ph := c.phases[x.Req]
	if x.NF != "" {
		switch {
		case x.NFDone && ph.nfEnd.IsZero():
			ph.nfEnd = time.Now()
		case !x.NFDone && ph.nfStart.IsZero():
			ph.nfStart, ph.nf = time.Now(), x.NF
		}
		c.phases[x.Req] = ph
		return
	}
	switch x.Stage {
	case protocol.StageSettingUp: // reported again when a gated new path is ready
		if !ph.locked.IsZero() {
			return
		}
		ph.locked = time.Now()
	case protocol.StageTwoPath:
		if !ph.twoPath.IsZero() {
			return
		}
		ph.twoPath = time.Now()
	default:
		return
	}
	c.phases[x.Req] = ph
}

// reconfigHistory returns the results kept.
func (c *Shell) reconfigHistory() []api.ReconfigResult {
	var out []api.ReconfigResult
	done := make(chan struct{})
	c.post(func() {
		out = append([]api.ReconfigResult{}, c.history...)
		close(done)
	})
	<-done
	return out
}
