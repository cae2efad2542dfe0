package reconfig

// Holding packets in the agent: packets the datapath hands over through
// its hold ring (frozen for a state migration, or straddling a cut-off to
// be split), queued per session and sent on again.

import (
	"fmt"
	"sync"
	"time"

	"github.com/dysco/dysco/internal/datapath"
)

// The lease by which this agent tells the datapath that it reads the hold
// ring (Datapath.SetSplitReader), and how often the control loop renews it.
// An agent that dies without clearing its lease leaves packets straddling
// a cut-off to a ring nobody reads (TCP sends them again) for at most
// splitLease; after that they go whole on the old path.
const (
	splitLease      = 3 * time.Second
	splitLeaseRenew = time.Second
)

// setSplitReader tells the datapath whether this agent reads the hold ring
// and so splits packets straddling a cut-off (holds.split): on takes (or
// renews) a lease of splitLease, off clears it, which the agent does when
// it stops, so that such packets go whole on the old path while no agent
// reads the ring.
func (c *Shell) setSplitReader(on bool) {
	lease := time.Duration(0)
	if on {
		lease = splitLease
	}
	if err := c.dp.SetSplitReader(lease); err != nil {
		c.log.Warn("datapath: cannot set whether packets straddling a cut-off are split", "on", on, "err", err)
	}
}

// hold is one anchor side's held packets (the datapath copies them to the
// dysco_hold ring buffer and steals them; the hold reader queues them here).
type hold struct {
	sess  uint32
	eg    datapath.Tuple
	flags uint32
	limit int64

	mu         sync.Mutex
	q          []datapath.HeldPacket
	qBytes     int64
	pkts       int64
	bytes      int64
	dropped    int64
	overflow   bool
	onOverflow func()
	releasing  bool
	done       bool
	released   chan struct{}
}

// holds routes held packets to their hold and re-injects them.
type holds struct {
	dp  Datapath
	log func(msg string, args ...any)

	mu     sync.Mutex
	bySess map[uint32]*hold
	rd     *datapath.HoldReader
	injMu  sync.Mutex
	inj    *datapath.Reinjector

	injected, injectErrs, stray int64 // under injMu
	// Packets straddling a cut-off (HeldPacket.Split): split and sent
	// again, and sent again whole because they could not be split.
	splits, splitWhole int64 // under injMu
}

func newHolds(dp Datapath, log func(string, ...any)) (*holds, error) {
	rd, err := dp.HoldReader()
	if err != nil {
		return nil, err
	}
	hs := &holds{dp: dp, log: log, bySess: map[uint32]*hold{}, rd: rd, inj: datapath.NewReinjector()}
	hs.clearStale()
	go hs.readLoop()
	return hs, nil
}

// clearStale ends the holds an earlier agent of the pinned datapath left
// (it stopped during a migration or a rebind): their packets, which
// nobody would send on, go on their path again (what was held then is
// lost, and TCP sends it again).
func (hs *holds) clearStale() {
	var stale []datapath.Tuple
	_ = hs.dp.EachFlow(func(k *datapath.Tuple, f *datapath.Flow) {
		if f.Flags&(datapath.FlHoldData|datapath.FlHoldAll) != 0 {
			stale = append(stale, *k)
		}
	})
	for _, k := range stale {
		if err := hs.dp.SetFlowFlags(k, 0, datapath.FlHoldData|datapath.FlHoldAll); err != nil {
			hs.log("clearing a hold left by an earlier agent failed", "flow", k.String(), "err", err)
		}
	}
	if len(stale) > 0 {
		hs.log("ended holds an earlier agent left", "flows", len(stale))
	}
}

func (hs *holds) close() {
	_ = hs.rd.Close()
	hs.injMu.Lock()
	_ = hs.inj.Close()
	hs.injMu.Unlock()
}

func (hs *holds) inject(p datapath.HeldPacket) {
	hs.injMu.Lock()
	defer hs.injMu.Unlock()
	if err := hs.inj.Send(p); err != nil {
		hs.injectErrs++
		hs.log("re-injecting a held packet failed", "session", p.Session, "err", err)
		return
	}
	hs.injected++
}

func (hs *holds) readLoop() {
	for {
		p, err := hs.rd.Read()
		if err != nil {
			return
		}
		if p.Split {
			hs.split(p)
			continue
		}
		hs.mu.Lock()
		h := hs.bySess[p.Session]
		hs.mu.Unlock()
		if h == nil || !h.add(p) {
			// Nobody holds this session (any more): send it on at once.
			if h == nil {
				hs.injMu.Lock()
				hs.stray++
				hs.injMu.Unlock()
			}
			hs.inject(p)
		}
	}
}

// split cuts a packet whose data straddles the cut-off of its side's
// two-path phase and sends both parts again (paper §3.5;
// bpf/include/twopath_fwd.h, tp_split): each part then takes its own path
// in the datapath, the bytes below oldSent the old one. The cut-off is the record's, fixed while the
// phase is active. A packet whose phase is over when it is read (its record
// gone, or in another state: ended, or a later reconfiguration's) or that
// cannot be cut goes again whole, and then the path the side uses now.
func (hs *holds) split(p datapath.HeldPacket) {
	var parts [][]byte
	rec, ok := hs.dp.TwoPath(datapath.TPKey{SessId: p.Session, Side: p.Side})
	if ok && rec.State == datapath.TPActive {
		var err error
		if parts, err = datapath.SplitFrame(p.Frame, rec.OldSent, int(p.GSOSize)); err != nil {
			hs.log("splitting a packet at the cut-off failed; sent whole", "session", p.Session, "err", err)
			parts = nil
		}
	}
	if parts == nil {
		hs.injMu.Lock()
		hs.splitWhole++
		hs.injMu.Unlock()
		hs.inject(p)
		return
	}
	hs.injMu.Lock()
	hs.splits++
	hs.injMu.Unlock()
	for _, f := range parts {
		q := p
		q.Frame = f
		hs.inject(q)
	}
}

// add queues a held packet; false when the hold is over (send it now).
func (h *hold) add(p datapath.HeldPacket) bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.done {
		return false
	}
	n := int64(len(p.Frame))
	if !h.releasing {
		if !h.overflow && h.bytes+n > h.limit {
			h.overflow = true
			if h.onOverflow != nil {
				go h.onOverflow()
			}
		}
		if h.qBytes+n > 2*h.limit {
			// Far past the bound while the abort runs: let the sender's
			// TCP retransmit it rather than grow without limit.
			h.dropped++
			return true
		}
	}
	h.q = append(h.q, p)
	h.qBytes += n
	h.pkts++
	h.bytes += n
	return true
}

func (h *hold) stats() (pkts, bytes, dropped int64) {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.pkts, h.bytes, h.dropped
}

// heldPackets is one side's hold as the shell sees it (*hold).
type heldPackets interface {
	stats() (pkts, bytes, dropped int64)
}

// packetHolder starts and ends holds: *holds, or a fake in tests.
type packetHolder interface {
	start(sess uint32, eg datapath.Tuple, flags uint32, limit int64, onOverflow func()) (heldPackets, error)
	release(h heldPackets)
}

// start begins holding a flow's packets.
func (hs *holds) start(sess uint32, eg datapath.Tuple, flags uint32, limit int64, onOverflow func()) (heldPackets, error) {
	h, err := hs.startHold(sess, eg, flags, limit, onOverflow)
	if err != nil {
		return nil, err
	}
	return h, nil
}

// release re-injects everything a hold (*hold) held and ends it
// (releaseHold).
func (hs *holds) release(h heldPackets) { hs.releaseHold(h.(*hold)) }

func (hs *holds) startHold(sess uint32, eg datapath.Tuple, flags uint32, limit int64, onOverflow func()) (*hold, error) {
	h := &hold{sess: sess, eg: eg, flags: flags, limit: limit, onOverflow: onOverflow, released: make(chan struct{})}
	hs.mu.Lock()
	if old := hs.bySess[sess]; old != nil {
		hs.mu.Unlock()
		return nil, fmt.Errorf("session %d already holds its packets", sess)
	}
	hs.bySess[sess] = h
	hs.mu.Unlock()
	if err := hs.dp.SetFlowFlags(eg, flags, 0); err != nil {
		hs.mu.Lock()
		delete(hs.bySess, sess)
		hs.mu.Unlock()
		return nil, fmt.Errorf("holding packets: %w", err)
	}
	return h, nil
}

// releaseHold re-injects everything held, in order, then stops holding
// (new packets keep being queued behind the held ones until the queue is
// empty; re-injected packets carry the mark the datapath never holds).
// Safe to call more than once; returns when done.
func (hs *holds) releaseHold(h *hold) {
	h.mu.Lock()
	if h.releasing {
		h.mu.Unlock()
		<-h.released
		return
	}
	h.releasing = true
	h.mu.Unlock()
	for {
		h.mu.Lock()
		q := h.q
		h.q, h.qBytes = nil, 0
		if len(q) == 0 {
			if err := hs.dp.SetFlowFlags(h.eg, 0, datapath.FlHoldData|datapath.FlHoldAll); err != nil {
				hs.log("clearing the hold flags failed", "session", h.sess, "err", err)
			}
			h.done = true
			h.mu.Unlock()
			break
		}
		h.mu.Unlock()
		for _, p := range q {
			hs.inject(p)
		}
	}
	hs.mu.Lock()
	if hs.bySess[h.sess] == h {
		delete(hs.bySess, h.sess)
	}
	hs.mu.Unlock()
	close(h.released)
}
