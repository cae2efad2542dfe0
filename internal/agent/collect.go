package agent

import (
	"sync"
	"time"

	"github.com/dysco/dysco/internal/datapath"
)

// collect ends sessions (paper §2.1 "Flexible session
// teardown"): after a reset, or FINs in both directions, plus a linger that
// lets the last ACK and retransmitted FINs through; after the half-open
// timeout for sessions never established; after the idle timeout for the
// rest. A UDP session has no FIN: it ends when idle for its one-way time
// before a datagram came back, its stream time after (udpTimeouts). A session's last activity is the latest of its flows' and its own
// state changes. Set-up state goes once the session is established, and
// flows whose session is gone go too, so nothing is left behind.
//
// It reads the maps in batches and keeps only a small summary per session,
// so that its memory and CPU stay modest at 100,000 sessions.
//
// Ages come from the datapath's 32-bit stamps (datapath.Age), all against
// one now read before the maps: stamps written while the maps are read
// count as of now, and a stamp older than 49.7 days reads younger than it
// is. An age is thus never overestimated, and a live session is never
// ended early; an idle one may be ended late, by at most a timeout, when
// one of its stamps crosses a multiple of 49.7 days. Timeouts are capped
// below datapath.MaxAge, so that every one can be reached.
func (a *Agent) collect() {
	now := datapath.Now()
	// The latest packet of each session, from its flows (a map kept from
	// pass to pass: at 100,000 sessions, a map grown afresh every second
	// would be 2.4 MiB of garbage a second, and the agent's heap would
	// grow with it).
	latest := map[uint32]uint32(nil)
	if latestMu.TryLock() {
		latest = latestMap
		defer func() {
			clear(latest)
			latestMu.Unlock()
		}()
	} else {
		latest = make(map[uint32]uint32) // another agent's collector has it
	}
	var reroutes []datapath.FlowEntry
	if err := a.dp.EachFlow(func(k *datapath.Tuple, f *datapath.Flow) {
		if f.Flags&(datapath.FlReroute|datapath.FlRouted|datapath.FlIngress) == datapath.FlReroute {
			reroutes = append(reroutes, datapath.FlowEntry{Key: *k, Flow: *f})
		}
		if l, ok := latest[f.SessId]; !ok || datapath.Age(now, f.LastMs) < datapath.Age(now, l) {
			latest[f.SessId] = f.LastMs // also marks the session as having flows
		}
	}); err != nil {
		a.log.Warn("collector: list flows", "err", err)
		return
	}
	a.settleReroutes(reroutes)
	capped := func(d time.Duration) time.Duration { return min(d, datapath.MaxAge-time.Minute) }
	idleTimeout, halfOpen, linger := capped(a.cfg.IdleTimeout), capped(a.cfg.HalfOpenTimeout), capped(a.cfg.CloseLinger)
	var dead, counted []uint32
	if err := a.dp.EachSession(func(id uint32, s *datapath.Session) {
		l, hasFlows := latest[id]
		delete(latest, id) // what stays in latest afterwards has no session
		age := datapath.Age(now, s.CreatedMs)
		idle := datapath.Age(now, s.LastMs)
		if hasFlows {
			idle = min(idle, datapath.Age(now, l))
		}
		st := s.State
		if s.Proto == datapath.ProtoUDP {
			oneWay, stream := a.udpTimeouts(s)
			if st&datapath.StEst == 0 && idle > capped(oneWay) || idle > capped(stream) || !hasFlows && age > halfOpen {
				dead = append(dead, id)
				if s.HoSrc != 0 {
					counted = append(counted, id)
				}
			}
			return
		}
		switch {
		case st&datapath.StRST != 0 && idle > linger/5,
			st&datapath.StFINFwd != 0 && st&datapath.StFINRev != 0 && idle > linger,
			st&datapath.StEst == 0 && age > halfOpen && idle > halfOpen,
			idle > idleTimeout,
			!hasFlows && age > halfOpen:
			dead = append(dead, id)
			if s.HoSrc != 0 {
				counted = append(counted, id)
			}
		}
	}); err != nil {
		a.log.Warn("collector: list sessions", "err", err)
		return
	}
	// Sessions still counted against their source's half-open budget
	// give their count back first (datapath.ReleaseHalfOpen).
	a.dp.ReleaseHalfOpen(counted)
	a.dp.DeleteSessions(dead)
	a.dp.DeleteReconfigStates(dead)
	if a.ctl != nil && len(dead) > 0 {
		a.ctl.SessionsEnded(dead)
	}
	// Set-up state is small and short-lived: drop it once the session is
	// established (or gone).
	var setups, setupDone []uint32
	_ = a.dp.EachSetup(func(id uint32) { setups = append(setups, id) })
	for _, id := range setups {
		if s, ok := a.dp.Session(id); !ok || s.State&datapath.StEst != 0 {
			setupDone = append(setupDone, id)
		}
	}
	a.dp.DeleteSynStates(setupDone)
	// Flows of ended sessions, and flows whose session is missing. A flow is
	// created just after its session, so an orphan seen here may be brand
	// new: it is removed only if its session is still missing now.
	gone := make(map[uint32]bool, len(dead)+len(latest))
	for _, id := range dead {
		gone[id] = true
	}
	for id := range latest {
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
		a.dp.DeleteFlows(keys) // and their deltas
		stale = len(keys)
	}
	if len(dead) > 0 || stale > 0 {
		a.metrics.collected.Add(float64(len(dead)))
		a.log.Debug("collector", "sessions_ended", len(dead), "flows_removed", stale)
	}
}

// latestMap is the collector's map, kept from pass to pass (one agent runs
// in a process; a second one's collector makes its own).
var (
	latestMu  sync.Mutex
	latestMap = map[uint32]uint32{}
)

// udpGrace is how much longer than the chain's start a middlebox host or
// the far end keeps an idle UDP session: every datagram passes every host,
// so the start, which sets a new chain up for the next datagram, forgets
// the session first, and no host of the chain refuses a datagram of a
// session the start still has.
const udpGrace = 5 * time.Second

// udpTimeouts gives a UDP session's idle timeouts at this host: its
// policy's (carried in the block to every host of the chain), else this
// agent's defaults.
func (a *Agent) udpTimeouts(s *datapath.Session) (oneWay, stream time.Duration) {
	oneWay, stream = a.cfg.UDPTimeout, a.cfg.UDPStreamTimeout
	if s.IdleS[0] != 0 {
		oneWay = time.Duration(s.IdleS[0]) * time.Second
	}
	if s.IdleS[1] != 0 {
		stream = time.Duration(s.IdleS[1]) * time.Second
	}
	if s.Role != datapath.RoleStart {
		oneWay += udpGrace
		stream += udpGrace
	}
	return oneWay, stream
}
