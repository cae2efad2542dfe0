package reconfig

// Two-path progress (§3.5): the datapath's notices, the polling safety
// net, and the readiness of sessions that joined a new path.

import (
	"slices"
	"time"

	"github.com/dysco/dysco/internal/datapath"
	"github.com/dysco/dysco/internal/protocol"
)

// eventLoop feeds the datapath's progress notices to the protocol. The
// events waiting in the ring are taken together, and each side is read once
// for all of them (progress reads the side's variables as they are now):
// under many concurrent reconfigurations a side's bits change several times
// before the agent gets to them.
func (c *Shell) eventLoop(er *datapath.EventReader) {
	const most = 256 // sides per batch
	var keys []datapath.TPKey
	for {
		ev, err := er.Read()
		if err != nil {
			return
		}
		keys = append(keys[:0], datapath.TPKey{SessId: ev.SessID, Side: ev.Side})
		for len(keys) < most && er.Pending() {
			if ev, err = er.Read(); err != nil {
				break
			}
			if k := (datapath.TPKey{SessId: ev.SessID, Side: ev.Side}); !slices.Contains(keys, k) {
				keys = append(keys, k)
			}
		}
		c.locked(func() {
			for _, k := range keys {
				c.progress(k)
				// Each side's sends leave before the next side is
				// handled: bundles only gather what one item sent.
				c.runDeferred()
				c.flush()
			}
		})
		if err != nil {
			return
		}
	}
}

// progress feeds the datapath's two-path variables of a side to the
// protocol.
func (c *Shell) progress(k datapath.TPKey) {
	tp, ok := c.dp.TwoPath(k)
	if !ok || tp.State != datapath.TPActive {
		return
	}
	pid, ok := c.pidOf[k.SessId]
	if !ok {
		return
	}
	c.handle(c.famOf[k.SessId], protocol.TwoPathProgress{Session: pid, Side: protocol.Side(k.Side), Vars: varsOf(tp)})
}

func varsOf(tp datapath.TPVal) protocol.TwoPath {
	if tp.EgKey.Proto == datapath.ProtoUDP {
		// A UDP side counts the datagrams that came on its old path
		// after its switch (udp.h, udp_tp_ingress).
		return protocol.TwoPath{OldDgrams: uint64(tp.OldRcvd)}
	}
	return protocol.TwoPath{OldSent: tp.OldSent, OldRcvd: tp.OldRcvd, OldSentAcked: tp.OldSentAcked,
		OldRcvdAcked: tp.OldRcvdAcked, FirstNewRcvd: tp.FirstNewRcvd, NewRcvd: tp.NewRcvd != 0,
		AckHi: tp.AckHi, AckHiOK: tp.AckHiOk != 0}
}

// poll is the safety net of the event ring: sides in their two-path phase,
// armed sides that switched by themselves, joined sessions becoming ready.
// The ring reports every change of the progress bits; the polling of
// active sides runs every tenth tick only, so that hundreds of concurrent
// reconfigurations do not cost a lookup each per tick, and each joined
// session is looked at less often the longer it stays idle (readyPoll).
func (c *Shell) poll() {
	c.ticks++
	if c.ticks%10 == 0 {
		for k := range c.active {
			tp, ok := c.dp.TwoPath(k)
			if !ok || tp.State == datapath.TPNew {
				delete(c.active, k)
				continue
			}
			c.progress(k)
		}
	}
	t := time.Now()
	for pid, r := range c.notReady {
		if t.Before(r.next) {
			continue
		}
		if !c.checkReady(pid) {
			r.every = min(2*r.every, readyPollMax)
			r.next = t.Add(r.every)
		}
	}
}

// readyPoll is when to look again whether a joined session's datapath saw
// packets both ways. The look costs a dozen map reads, and a session may
// stay idle for long: each session is looked at less and less often (from
// every tick up to readyPollMax), and at once when a request needs it
// (checkReady).
type readyPoll struct {
	id    uint32
	next  time.Time
	every time.Duration
}

const readyPollMax = time.Second

// checkReady tells the protocol that a joined session is ready once its
// datapath has seen packets both ways, and reports whether it is.
func (c *Shell) checkReady(pid protocol.SessionID) bool {
	r, ok := c.notReady[pid]
	if !ok {
		return true
	}
	in0, in1 := false, false
	for _, k := range c.flowKeysOf(r.id) {
		f, ok := c.dp.Flow(k)
		if ok && f.Flags&datapath.FlIngress != 0 && f.Marked() {
			if f.Dir() == 0 {
				in0 = true
			} else {
				in1 = true
			}
		}
	}
	if !in0 || !in1 {
		return false
	}
	delete(c.notReady, pid)
	c.handle(c.famOf[r.id], protocol.DatapathReady{Session: pid})
	return true
}
