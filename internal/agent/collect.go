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
// state changes. Set-up state of established sessions goes at once, and flows
// whose session is gone go too, so nothing is left behind.
func (a *Agent) collect() {
	sessions, err := a.dp.Sessions()
	if err != nil {
		a.log.Warn("collector: list sessions", "err", err)
		return
	}
	flows, err := a.dp.Flows()
	if err != nil {
		a.log.Warn("collector: list flows", "err", err)
		return
	}
	last := make(map[uint32]uint64, len(sessions))
	for _, f := range flows {
		last[f.SessId] = max(last[f.SessId], f.LastNs)
	}
	now := datapath.Monotonic()
	live := make(map[uint32]bool, len(sessions))
	ended := 0
	for _, s := range sessions {
		age := now - time.Duration(s.CreatedNs)
		idle := now - time.Duration(max(s.LastNs, last[s.ID]))
		st := s.State
		dead := false
		switch {
		case st&datapath.StRST != 0 && idle > a.cfg.CloseLinger/5:
			dead = true
		case st&datapath.StFINFwd != 0 && st&datapath.StFINRev != 0 && idle > a.cfg.CloseLinger:
			dead = true
		case st&datapath.StEst == 0 && age > a.cfg.HalfOpenTimeout && idle > a.cfg.HalfOpenTimeout:
			dead = true
		case idle > a.cfg.IdleTimeout:
			dead = true
		}
		if dead {
			a.dp.DeleteSession(s.ID)
			ended++
			continue
		}
		live[s.ID] = true
		if st&datapath.StEst != 0 && !a.synCollected[s.ID] {
			a.dp.DeleteSynState(s.ID)
			a.synCollected[s.ID] = true
		}
	}
	for id := range a.synCollected {
		if !live[id] {
			delete(a.synCollected, id)
		}
	}
	// A flow is created just after its session; one whose session is
	// missing from a listing taken before it may be brand new, so look
	// the session up again before deleting.
	stale := 0
	for _, f := range flows {
		if live[f.SessId] || a.dp.SessionExists(f.SessId) {
			continue
		}
		a.dp.DeleteFlow(f.Key)
		stale++
	}
	if ended > 0 || stale > 0 {
		a.metrics.collected.Add(float64(ended))
		a.log.Debug("collector", "sessions_ended", ended, "flows_removed", stale)
	}
}
