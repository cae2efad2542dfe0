package reconfig

import (
	"time"

	"github.com/dysco/dysco/internal/datapath"
	"github.com/dysco/dysco/internal/wire"
)

// A session leaves a host towards the right with the tuple its middlebox
// sends it with. That is the tuple it arrived with (its session tuple in the
// datapath), except behind a middlebox that changes the five-tuple (a NAT,
// paper §2.1 "local tag"): there the egress flow of the SYN's direction is
// keyed by the middlebox's output, and the reconfiguration of a segment
// that begins at, or passes through, such a host needs that key to find the
// session's right side (docs/protocol.md, "Middleboxes that change the
// five-tuple").
//
// The datapath keeps no record of it beyond the flow itself: onward finds
// the flow by a walk of the session and flow maps (scanOnward), made only
// for a session whose tuple keys no egress flow of its own, and remembers
// what it found for such sessions until they end. A walk costs one batched
// read of both maps (at 100,000 sessions, some 500,000 entries) with the
// control loop held.

// onwardEntry is a session's onward tuple and the session's creation stamp,
// which tells that an id still names the same session.
type onwardEntry struct {
	t       wire.Tuple
	created uint32
}

// onwardMargin covers the coarse clock of the datapath's stamps (a few ms)
// when a stamp is compared with the agent's own clock.
const onwardMargin = time.Second

// onward returns the tuple with which session id (s at this host) leaves it
// towards the right: its session tuple where it has no right side (this host
// ends it).
func (c *Shell) onward(id uint32, s *datapath.Session) wire.Tuple {
	t := s.Tuple.Wire()
	if s.Role != datapath.RoleStart && s.Role != datapath.RoleMiddle {
		return t
	}
	if f, ok := c.dp.Flow(datapath.TupleOf(t, s.Proto)); ok && f.SessId == id && f.Flags&datapath.FlIngress == 0 {
		return t
	}
	if o, ok := c.onwardOf[id]; ok && o.created == s.CreatedMs {
		return o.t
	}
	// The last walk cannot have missed the flow if the SYN-ACK had come
	// back before it began: the datapath adds the egress flow of the SYN
	// (emit_syn) with the ingress flow the SYN-ACK comes back by, and the
	// SYN-ACK's state change (or a later one) stamps LastMs. Age never
	// overestimates (it reads a stamp older than 49.7 days as younger), so
	// a wrapped stamp costs a walk more, never one less.
	if c.onwardScanned && s.State&datapath.StSYNACK != 0 &&
		datapath.Age(datapath.Now(), s.LastMs) > time.Since(c.onwardScanAt)+onwardMargin {
		return t // the last walk saw its flows: it has no egress flow
	}
	c.scanOnward()
	if o, ok := c.onwardOf[id]; ok && o.created == s.CreatedMs {
		return o.t
	}
	return t
}

// scanOnward walks the flows and the sessions once and records the onward
// tuple of every session whose egress flow of the SYN's direction is not
// keyed by its session tuple. A walk that fails does not count as one.
func (c *Shell) scanOnward() {
	at := time.Now()
	eg := map[uint32]datapath.Tuple{}
	if err := c.dp.EachFlow(func(k *datapath.Tuple, f *datapath.Flow) {
		if f.Flags&(datapath.FlIngress|datapath.FlRev) == 0 {
			eg[f.SessId] = *k
		}
	}); err != nil {
		c.log.Warn("control: list flows for onward tuples", "err", err)
		return
	}
	if err := c.dp.EachSession(func(id uint32, s *datapath.Session) {
		k, ok := eg[id]
		if !ok || k.Wire() == s.Tuple.Wire() {
			return
		}
		c.onwardOf[id] = onwardEntry{t: k.Wire(), created: s.CreatedMs}
	}); err != nil {
		c.log.Warn("control: list sessions for onward tuples", "err", err)
		return
	}
	c.onwardScanAt, c.onwardScanned = at, true
}

// onwardKey is what FreeSession and CutSession take for session id: the key
// of its egress flow of the SYN's direction if that is not its tuple, the
// zero Tuple otherwise (or if the session is gone).
func (c *Shell) onwardKey(id uint32) datapath.Tuple {
	s, ok := c.dp.Session(id)
	if !ok {
		return datapath.Tuple{}
	}
	if on := c.onward(id, &s); on != s.Tuple.Wire() {
		return datapath.TupleOf(on, s.Proto)
	}
	return datapath.Tuple{}
}
