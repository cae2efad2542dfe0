package agent

import (
	"time"

	"github.com/dysco/dysco/internal/datapath"
)

// collect ends sessions (DESIGN requirement 8; paper §2.1 "Flexible session
// teardown"): after a reset, or FINs in both directions, plus a linger that
// lets the last ACK and retransmitted FINs through; after the half-open
// timeout for sessions never established; after the idle timeout for the
// rest. A session's last activity is the latest of its flows' and its own
// state changes. Set-up state goes once the session is established, and
// flows whose session is gone go too, so nothing is left behind.
//
// It reads the maps in batches and keeps only a small summary per session,
// so that its memory and CPU stay modest at 100,000 sessions.
func (a *Agent) collect() {
	// Last activity by session, from the flows.
	last := map[uint32]uint64{}
	var reroutes []datapath.FlowEntry
	if err := a.dp.EachFlow(func(k *datapath.Tuple, f *datapath.Flow) {
		if f.Flags&(datapath.FlReroute|datapath.FlRouted|datapath.FlIngress) == datapath.FlReroute {
			reroutes = append(reroutes, datapath.FlowEntry{Key: *k, Flow: *f})
		}
		last[f.SessId] = max(last[f.SessId], f.LastNs) // also marks the session as having flows
	}); err != nil {
		a.log.Warn("collector: list flows", "err", err)
		return
	}
	a.settleReroutes(reroutes)
	now := datapath.Monotonic()
	var dead []uint32
	if err := a.dp.EachSession(func(id uint32, s *datapath.Session) {
		l, hasFlows := last[id]
		delete(last, id) // what stays in last afterwards has no session
		age := now - time.Duration(s.CreatedNs)
		idle := now - time.Duration(max(s.LastNs, l))
		st := s.State
		switch {
		case st&datapath.StRST != 0 && idle > a.cfg.CloseLinger/5,
			st&datapath.StFINFwd != 0 && st&datapath.StFINRev != 0 && idle > a.cfg.CloseLinger,
			st&datapath.StEst == 0 && age > a.cfg.HalfOpenTimeout && idle > a.cfg.HalfOpenTimeout,
			idle > a.cfg.IdleTimeout,
			!hasFlows && age > a.cfg.HalfOpenTimeout:
			dead = append(dead, id)
		}
	}); err != nil {
		a.log.Warn("collector: list sessions", "err", err)
		return
	}
	for _, id := range dead {
		a.dp.DeleteSession(id)
		for side := uint32(0); side < 2; side++ {
			a.dp.DeleteTwoPath(datapath.TPKey{SessId: id, Side: side})
		}
	}
	if a.ctl != nil && len(dead) > 0 {
		a.ctl.sessionsEnded(dead)
	}
	// Set-up state is small and short-lived: drop it once the session is
	// established (or gone).
	var setupDone []uint32
	_ = a.dp.EachSetup(func(id uint32) { setupDone = append(setupDone, id) })
	for _, id := range setupDone {
		if s, ok := a.dp.Session(id); !ok || s.State&datapath.StEst != 0 {
			a.dp.DeleteSynState(id)
		}
	}
	// Flows of ended sessions, and flows whose session is missing. A flow is
	// created just after its session, so an orphan seen here may be brand
	// new: it is removed only if its session is still missing now.
	gone := make(map[uint32]bool, len(dead)+len(last))
	for _, id := range dead {
		gone[id] = true
	}
	for id := range last {
		if !a.dp.SessionExists(id) {
			gone[id] = true
		}
	}
	stale := 0
	if len(gone) > 0 {
		var keys []datapath.Tuple
		_ = a.dp.EachFlow(func(k *datapath.Tuple, f *datapath.Flow) {
			if gone[f.SessId] {
				keys = append(keys, *k)
			}
		})
		for _, k := range keys {
			a.dp.DeleteFlow(k)
			a.dp.DeleteDelta(k)
		}
		stale = len(keys)
	}
	if len(dead) > 0 || stale > 0 {
		a.metrics.collected.Add(float64(len(dead)))
		a.log.Debug("collector", "sessions_ended", len(dead), "flows_removed", stale)
	}
}
