package sim

import (
	"fmt"
	"math/rand/v2"
	"time"

	"github.com/dysco/dysco/internal/protocol"
	"github.com/dysco/dysco/internal/wire"
)

// UDP sessions (protocol/udp.go, docs/protocol.md "UDP sessions"): the
// ends send datagrams both ways, with pauses, and stop; the collectors end
// the session after udpIdle without a datagram. A datagram that reaches a
// host on a path whose state is gone there, or that arrives on an old path
// after the host's part of its teardown began (an anchor that completed,
// EndTwoPath; a middle agent both anchors' fins have passed), is a
// violation: the old path was torn down before it drained.

const (
	udpIdle = 4 * time.Second // collector: a UDP session without a datagram this long ends
	dgram   = 100             // payload bytes of a datagram
	// udpStream selects the random stream that decides how many UDP
	// sessions a run has, apart from the seed's main stream.
	udpStream = 0x5544505f73657373
)

// udpEnd is one end of a UDP session.
type udpEnd struct {
	w     *world
	h     *host
	ds    *dpSess
	sess  *simSession
	side  protocol.Side
	dir   int
	name  string
	total uint32 // datagrams to send
	sent  uint32
	rcvd  map[uint32]int // datagram index → copies received
}

// udpCount draws how many UDP sessions a run has (from its own stream, so
// that a run without them is the run it was before UDP sessions came).
func udpCount(seed int64) int {
	r := rand.New(rand.NewPCG(uint64(seed), udpStream))
	return []int{0, 0, 1, 1, 2}[r.IntN(5)]
}

// setUpUDP sets UDP session s up through a chain of live middleboxes, as
// setUp does TCP ones: no deltas (datagrams have no sequence numbers).
func (w *world) setUpUDP(s *simSession, live []*host) {
	r := w.rng
	i, c, sv := s.idx, s.client, s.server
	k := r.IntN(min(4, len(live)) + 1)
	hosts := []*host{c}
	for _, j := range r.Perm(len(live))[:k] {
		hosts = append(hosts, live[j])
	}
	hosts = append(hosts, sv)
	n := len(hosts)
	subs := make([]wire.Tuple, n-1)
	for j := range subs {
		w.portSeq++
		subs[j] = wire.Tuple{Src: hosts[j].addr, Dst: hosts[j+1].addr, SrcPort: 1000 + w.portSeq, DstPort: 53}
	}
	var dss []*dpSess
	for j, h := range hosts {
		w.nextSessID++
		ds := &dpSess{h: h, id: w.nextSessID, sess: s, ready: true, lastActive: w.now}
		up := protocol.SessionUp{Session: ds.id, Tuple: s.tuple, Nonce: s.nonce, Proto: protocol.ProtoUDP}
		if j > 0 {
			sub := &dpSub{ds: ds, side: protocol.SideLeft, tuple: subs[j-1], peer: hosts[j-1].addr}
			ds.sides[protocol.SideLeft] = &dpSide{cur: sub}
			h.addSub(sub)
			up.Left = &protocol.SideInfo{Peer: sub.peer, Sub: sub.tuple}
		}
		if j < n-1 {
			sub := &dpSub{ds: ds, side: protocol.SideRight, tuple: subs[j], peer: hosts[j+1].addr}
			ds.sides[protocol.SideRight] = &dpSide{cur: sub}
			h.addSub(sub)
			up.Right = &protocol.SideInfo{Peer: sub.peer, Sub: sub.tuple}
		}
		ds.up = &up
		h.dp[ds.id] = ds
		w.holdStart(s, h)
		h.idleCheck(ds)
		dss = append(dss, ds)
	}
	totals := []uint32{0, uint32(1 + r.IntN(20)), uint32(20 + r.IntN(200))}
	a := &udpEnd{w: w, h: c, ds: dss[0], sess: s, side: protocol.SideRight, dir: 0, name: fmt.Sprintf("%s(s%d)", c, i),
		total: totals[r.IntN(3)], rcvd: map[uint32]int{}}
	b := &udpEnd{w: w, h: sv, ds: dss[n-1], sess: s, side: protocol.SideLeft, dir: 1, name: fmt.Sprintf("%s(s%d)", sv, i),
		total: totals[r.IntN(3)], rcvd: map[uint32]int{}}
	dss[0].udp, dss[n-1].udp = a, b
	s.uends = [2]*udpEnd{a, b}
	for _, e := range s.uends {
		e := e
		w.after(time.Duration(r.IntN(200))*time.Millisecond, func() { e.pump() })
	}
	var names []string
	for _, h := range hosts {
		names = append(names, h.String())
	}
	w.stats.UDPSessions++
	w.tracef("session s%d (udp): %v %s, %d datagrams right, %d left", i, names, s.tuple, a.total, b.total)
	for k := r.IntN(4); k > 0; k-- {
		w.after(time.Duration(20+r.IntN(3000))*time.Millisecond, func() { w.issue(s, 1) })
	}
	if r.Float64() < 0.6 {
		w.after(time.Duration(20+r.IntN(2500))*time.Millisecond, func() { w.issue(s, 2+w.rng.IntN(2)) })
	}
}

// pump sends the next datagram and schedules the one after, with a pause
// now and then (shorter than udpIdle).
func (e *udpEnd) pump() {
	if e.ds.gone || e.sent >= e.total {
		return
	}
	p := pkt{sess: e.sess, dir: e.dir, seq: e.sent, len: dgram, off: e.sent}
	e.sent++
	e.w.stats.Datagrams++
	e.h.send(e.ds, e.side, p)
	gap := time.Duration(e.w.rng.IntN(40)) * time.Millisecond
	if e.w.rng.IntN(15) == 0 {
		gap = time.Duration(e.w.rng.IntN(1500)) * time.Millisecond
	}
	e.w.after(gap, e.pump)
}

// receive checks a datagram reaching its end: its peer sent it.
func (e *udpEnd) receive(p pkt) {
	if p.dir == e.dir {
		e.w.fail("%s: received its own direction's datagram %s", e.name, p)
		return
	}
	if p.off >= e.sess.uends[1-e.dir].sent {
		e.w.fail("%s: received datagram %d, which its peer never sent", e.name, p.off)
		return
	}
	e.rcvd[p.off]++
}

// receiveUDP handles a datagram arriving from the network on subsession
// t (receive's part for UDP sessions).
func (h *host) receiveUDP(t wire.Tuple, p pkt) {
	w := h.w
	sub := h.subs[t]
	if sub == nil || sub.ds.gone {
		w.fail("%s: datagram s%d #%d dir %d lost: no state of its path (%s) here any more", h, p.sess.idx, p.off, p.dir, t)
		return
	}
	ds := sub.ds
	sd := ds.sides[sub.side]
	if (sub.side == protocol.SideLeft) != (p.dir == 0) {
		w.fail("%s: %s arrived on the %s side", h, p, sub.side)
		return
	}
	if sub == sd.neu && sd.tp == nil && sd.armed {
		h.startTwoPath(ds, sub.side) // the first datagram on an armed new path switches it
	}
	if sd.ended && sub == sd.old {
		w.fail("%s: datagram s%d #%d arrived on the old path %s after this anchor tore the phase down (EndTwoPath)", h, p.sess.idx, p.off, t)
		return
	}
	if ds.end == nil && ds.udp == nil && sub == sd.cur && h.known[ds.id] {
		if v, ok := h.agent.View(ds.id); ok && v.TornDown {
			w.fail("%s: datagram s%d #%d passes the old path after both anchors' fins (torn down before it drained)", h, p.sess.idx, p.off)
			return
		}
	}
	if sd.tp != nil {
		if sub == sd.old {
			w.stats.OldPathDgrams++
			sd.tp.OldDgrams++
			h.report(ds, sub.side)
		} else {
			w.stats.NewPathDgrams++
		}
	}
	w.tracef("%s in  dgram s%d #%d dir %d on %s", h, p.sess.idx, p.off, p.dir, t)
	ds.lastActive = w.now
	if ds.udp != nil {
		ds.udp.receive(p)
		return
	}
	h.send(ds, sub.side.Other(), p)
}

// sendUDP sends a datagram on side: on the new path once the side has
// switched (every datagram from the switch on), else on its subsession.
func (h *host) sendUDP(ds *dpSess, side protocol.Side, p pkt) {
	w := h.w
	sd := ds.sides[side]
	if sd == nil || sd.cur == nil {
		w.fail("%s: session %d has no %s side for datagram %d", h, ds.id, side, p.off)
		return
	}
	ds.lastActive = w.now
	sub := sd.cur
	if sd.tp != nil {
		sub = sd.neu
	}
	if sub == nil {
		w.fail("%s: no subsession for a datagram of s%d", h, ds.sess.idx)
		return
	}
	to, t := w.byAddr[sub.peer], sub.tuple
	w.stats.DataSent++
	w.tracef("%s out dgram s%d #%d dir %d on %s", h, p.sess.idx, p.off, p.dir, t)
	w.deliver(h, to, "datagram", func() { to.receiveUDP(t, p) })
}

// startUDP is startTwoPath for a UDP side: the switch (no cut-off, no
// marks).
func (h *host) startUDP(ds *dpSess, side protocol.Side) {
	sd := ds.sides[side]
	if sd.neu == nil {
		h.w.fail("%s: two-path phase without a new subsession", h)
		return
	}
	sd.tp, sd.old, sd.armed, sd.ended = &protocol.TwoPath{}, sd.cur, false, false
	h.w.stats.UDPSwitches++
	h.w.tracef("%s switch %s side s%d (udp)", h, side, ds.sess.idx)
	h.report(ds, side)
}
