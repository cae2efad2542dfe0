package sim

import (
	"fmt"
	"net/netip"
	"time"

	"github.com/dysco/dysco/internal/protocol"
	"github.com/dysco/dysco/internal/wire"
)

// The datapath model: what the eBPF programs and the agent's collector do
// with each packet and each protocol action, at one host.

// dpSess is a session at one host: its flows, deltas, two-path state.
type dpSess struct {
	h      *host
	id     protocol.SessionID
	sess   *simSession
	sides  [2]*dpSide
	app    protocol.AppDelta // a middlebox's own deltas
	end    *tcpEnd           // set on end hosts
	udp    *udpEnd           // set on end hosts of a UDP session
	joined bool
	ready  bool
	gone   bool
	// up is what the agent announces to its protocol, lazily (announce);
	// nil for a joined session, which the protocol made itself.
	up *protocol.SessionUp

	// collector
	lastActive time.Duration
	finSeen    [2]bool
	finOff     [2]uint32
	finAcked   [2]bool
	ending     bool
	rstSeen    bool
	// closedMark: FINs the old path carried, which a closed notice told
	// this joined middlebox of (MarkClosed).
	closedMark [2]bool

	// stateful middlebox check: the highest sequence number (plus one)
	// seen arriving in each direction, in the arrival side's session space.
	seenMax [2]uint32
	seen    [2]bool
}

type dpSide struct {
	cur   *dpSub // where packets leave (the only subsession outside reconfiguration)
	old   *dpSub // the old subsession during and just after the two-path phase
	neu   *dpSub // the new subsession until EndTwoPath
	armed bool
	// ended (UDP): EndTwoPath came; old is still there until
	// RemoveSubsession, and a datagram arriving on it is a violation.
	ended bool
	tp    *protocol.TwoPath
	marks protocol.Marks
	clamp uint32
}

type dpSub struct {
	ds    *dpSess
	side  protocol.Side
	tuple wire.Tuple
	peer  netip.Addr
	delta protocol.Delta
}

// pkt is a TCP segment. The tags never change on the way: they are what
// the sending TCP meant, so that receivers can check every rewrite.
type pkt struct {
	sess   *simSession
	dir    int // 0: left to right, 1: right to left
	seq    uint32
	ack    uint32
	len    uint32
	flags  uint8
	tsval  uint32
	tsecr  uint32
	off    uint32 // stream offset of seq at the sender (seq - ISS)
	ackOff uint32 // stream offset acknowledged (rcvNxt - IRS at the sender)
	tsTag  uint32 // the sender's clock in TSval
	ecrTag uint32 // the clock value echoed in TSecr
	hasEcr bool
}

func (p pkt) packet() protocol.Packet {
	return protocol.Packet{Seq: p.seq, Ack: p.ack, Len: p.len, Flags: p.flags}
}

func (p pkt) String() string {
	return fmt.Sprintf("s%d %s off=%d ackOff=%d", p.sess.idx, p.packet(), p.off, p.ackOff)
}

func seqLT(a, b uint32) bool { return int32(a-b) < 0 }

// receive handles a packet arriving from the network on subsession t.
func (h *host) receive(t wire.Tuple, p pkt) {
	if p.sess.udp {
		h.receiveUDP(t, p)
		return
	}
	w := h.w
	sub := h.subs[t]
	if sub == nil || sub.ds.gone {
		w.tracef("%s drop %s: no flow for %s", h, p, t)
		return
	}
	ds := sub.ds
	sd := ds.sides[sub.side]
	if (sub.side == protocol.SideLeft) != (p.dir == 0) {
		w.fail("%s: %s arrived on the %s side", h, p, sub.side)
		return
	}
	// Ingress translation (§3.4 table: in, add to the sequence number).
	p.seq += sub.delta.Seq
	p.tsval += sub.delta.TS
	pp := p.packet()
	if sub == sd.neu && sd.tp == nil && sd.armed {
		h.startTwoPath(ds, sub.side) // the first packet on an armed new path switches it
	}
	sd.marks = sd.marks.In(pp)
	if sd.tp != nil {
		path := protocol.PathOld
		if sub == sd.neu {
			path = protocol.PathNew
		}
		if pp.End() != pp.Seq {
			if path == protocol.PathOld {
				w.stats.OldPathData++
			} else {
				w.stats.NewPathData++
			}
		}
		if nv := protocol.Observe(*sd.tp, path, pp); nv != *sd.tp {
			*sd.tp = nv
			h.report(ds, sub.side)
		}
		// A late packet of the old path carries the highest ack received
		// (protocol.Deliver), as the datapath does; the end host's check
		// of the ack (tcp.go) then holds it to the offset that ack meant.
		if a := protocol.DeliverFault(*sd.tp, path, pp, w.opts.Faults).Ack; a != p.ack {
			w.stats.RaisedAcks++
			p.ackOff += a - p.ack
			p.ack = a
		}
	}
	w.tracef("%s in  %s on %s", h, p, t)
	ds.observe(p)
	if ds.end != nil {
		ds.end.receive(p)
		return
	}
	// A middlebox: remember what it forwards, apply its deltas, pass it on.
	if end := pp.End(); p.flags&protocol.TCPRst == 0 {
		if !ds.seen[p.dir] || seqLT(ds.seenMax[p.dir], end) {
			ds.seenMax[p.dir], ds.seen[p.dir] = end, true
		}
	}
	stream, other := ds.app.Right, ds.app.Left
	if p.dir == 1 {
		stream, other = ds.app.Left, ds.app.Right
	}
	p.seq += stream.Seq
	p.tsval += stream.TS
	p.ack -= other.Seq
	p.tsecr -= other.TS
	h.send(ds, sub.side.Other(), p)
}

// send handles a packet leaving the host on side: the two-path rules, the
// egress translation (§3.4 table: out, subtract from the ack), the network.
func (h *host) send(ds *dpSess, side protocol.Side, p pkt) {
	if ds.sess.udp {
		h.sendUDP(ds, side, p)
		return
	}
	w := h.w
	sd := ds.sides[side]
	if sd == nil || sd.cur == nil {
		w.fail("%s: session %d has no %s side for %s", h, ds.id, side, p)
		return
	}
	if ds.end == nil && !ds.joined && p.flags&protocol.TCPAck != 0 && p.flags&protocol.TCPRst == 0 &&
		ds.seen[1-p.dir] && seqLT(ds.seenMax[1-p.dir], p.ack) {
		// §3.1: middleboxes may reject acks for data they did not send;
		// acks go on the old path so that its middleboxes never see one.
		// (A middlebox that joined a new path picks the stream up in the
		// middle, like conntrack in loose mode: not checked.)
		w.fail("%s (s%d): forwards ack %d beyond the data it forwarded (%d)", h, ds.sess.idx, p.ack, ds.seenMax[1-p.dir])
		return
	}
	pp := p.packet()
	sd.marks = sd.marks.Out(pp)
	ds.observe(p)
	type piece struct {
		c   protocol.Piece
		sub *dpSub
	}
	var pieces []piece
	if sd.tp != nil {
		d, nv := protocol.DecideFault(*sd.tp, pp, w.opts.Faults)
		var data [3]bool
		for _, c := range d.List() {
			if c.Len > 0 || c.Flags&protocol.TCPFin != 0 {
				data[c.Path] = true
			} else if c.Path == protocol.PathOld && c.Ack == sd.tp.OldRcvd && pp.Ack != c.Ack {
				w.stats.ExtraOldAcks++
			}
		}
		if data[protocol.PathOld] && data[protocol.PathNew] {
			w.stats.Splits++
		}
		for _, c := range d.List() {
			sub := sd.old
			if c.Path == protocol.PathNew {
				sub = sd.neu
			}
			pieces = append(pieces, piece{c, sub})
		}
		if nv != *sd.tp {
			*sd.tp = nv
			h.report(ds, side)
		}
	} else {
		pieces = []piece{{protocol.Piece{Seq: p.seq, Len: p.len, Ack: p.ack, Flags: p.flags}, sd.cur}}
	}
	for _, pc := range pieces {
		if pc.sub == nil {
			w.fail("%s: no subsession for the %s path", h, pc.c.Path)
			return
		}
		q := p
		q.off = p.off + (pc.c.Seq - p.seq)
		q.ackOff = p.ackOff - (p.ack - pc.c.Ack)
		q.seq, q.len, q.ack, q.flags = pc.c.Seq, pc.c.Len, pc.c.Ack, pc.c.Flags
		q.ack -= pc.sub.delta.Seq
		q.tsecr -= pc.sub.delta.TS
		to := w.byAddr[pc.sub.peer]
		t := pc.sub.tuple
		w.stats.DataSent++
		w.tracef("%s out %s on %s", h, q, t)
		w.deliver(h, to, "data", func() { to.receive(t, q) })
	}
}

// observe is the collector's view of a packet: FIN, RST, activity; and,
// for a joined session, whether its marks are known yet.
func (ds *dpSess) observe(p pkt) {
	w := ds.h.w
	ds.lastActive = w.now
	if p.flags&protocol.TCPRst != 0 {
		ds.rstSeen = true
		if !ds.ending {
			ds.ending = true
			ds.sess.markEnding(w.now)
			w.after(rstLinger, func() { ds.h.endSession(ds, "rst") })
		}
		return
	}
	if p.flags&protocol.TCPFin != 0 {
		ds.finSeen[p.dir], ds.finOff[p.dir] = true, p.off+p.len
	}
	if o := 1 - p.dir; p.flags&protocol.TCPAck != 0 && ds.finSeen[o] && !seqLT(p.ackOff, ds.finOff[o]+1) {
		ds.finAcked[o] = true
	}
	ds.closeCheck()
	if ds.joined && !ds.ready {
		l, r := ds.sides[protocol.SideLeft], ds.sides[protocol.SideRight]
		if l.marks.Ready() && r.marks.Ready() {
			ds.ready = true
			w.after(0, func() {
				if !ds.gone {
					ds.h.handle(protocol.DatapathReady{Session: ds.id})
				}
			})
		}
	}
}

// closeCheck starts the close linger once the session is closed both ways:
// each FIN seen and acknowledged here, or recorded by a closed notice.
func (ds *dpSess) closeCheck() {
	w := ds.h.w
	closed := func(d int) bool { return ds.finAcked[d] || ds.closedMark[d] }
	if closed(0) && closed(1) && !ds.ending {
		ds.ending = true
		ds.sess.markEnding(w.now)
		w.after(closeLinger, func() { ds.h.endSession(ds, "fin") })
	}
}

// markClosed records FINs the old path carried (protocol.MarkClosed).
func (ds *dpSess) markClosed(fwd, rev bool) {
	if fwd {
		ds.closedMark[0], ds.finSeen[0] = true, true
	}
	if rev {
		ds.closedMark[1], ds.finSeen[1] = true, true
	}
	ds.closeCheck()
}

func (h *host) startTwoPath(ds *dpSess, side protocol.Side) {
	sd := ds.sides[side]
	if sd.tp != nil {
		return
	}
	if ds.sess.udp {
		h.startUDP(ds, side)
		return
	}
	if !sd.marks.Ready() {
		h.w.fail("%s: cut-off on the %s side of s%d with unknown marks", h, side, ds.sess.idx)
		return
	}
	if sd.neu == nil {
		h.w.fail("%s: two-path phase without a new subsession", h)
		return
	}
	v := protocol.CutOff(sd.marks)
	sd.tp, sd.old, sd.armed = &v, sd.cur, false
	h.w.stats.CutOffs++
	h.w.tracef("%s cut-off %s side s%d: %s", h, side, ds.sess.idx, v)
	h.report(ds, side)
}

// report tells the agent the two-path variables changed. As the agent's
// shell does (internal/reconfig progress), the variables are read when the
// notice is handled, and only from the phase that sent it while it is
// still running: a notice of a phase that has ended since reports nothing
// (else it would reach the next request's right anchor in waitAck as its
// datapath's switch).
func (h *host) report(ds *dpSess, side protocol.Side) {
	tp := ds.sides[side].tp
	h.w.after(0, func() {
		if ds.gone || ds.sides[side].tp != tp {
			return
		}
		h.handle(protocol.TwoPathProgress{Session: ds.id, Side: side, Vars: *tp})
		h.w.checkLocks()
	})
}

func (h *host) applyDatapath(act protocol.Action) {
	w := h.w
	switch x := act.(type) {
	case protocol.AddSubsession:
		ds := h.dp[x.Session]
		if ds == nil {
			w.fail("%s: AddSubsession for session %d, which the datapath does not hold", h, x.Session)
			return
		}
		if s := ds.sess; !s.udp {
			// Packets arriving on a right side's new subsession travel
			// leftwards; on a left side's, rightwards.
			want := s.ws[0]
			if x.Side == protocol.SideRight {
				want = s.ws[1]
			}
			if x.WScaleIn != want || x.WScaleOut != want {
				w.fail("%s: s%d's new %s subsession rescales windows from %d to %d; both are %d",
					h, s.idx, x.Side, x.WScaleIn, x.WScaleOut, want)
				return
			}
		}
		sub := &dpSub{ds: ds, side: x.Side, tuple: x.Sub, peer: x.Peer, delta: x.Delta}
		sd := ds.sides[x.Side]
		sd.neu, sd.armed = sub, x.Armed
		h.addSub(sub)
		w.tracef("%s add %s subsession %s delta %s armed=%v", h, x.Side, x.Sub, x.Delta, x.Armed)
	case protocol.JoinSession:
		var s *simSession
		for _, c := range w.sessions {
			if c.nonce == x.Nonce {
				s = c
			}
		}
		// The session tuple never changes (§3.1: the ends and the kept
		// middleboxes see the same session), and a UDP session is joined
		// as one.
		if s != nil && x.Tuple != s.tuple {
			w.fail("%s: joins s%d with tuple %s, the session's is %s", h, s.idx, x.Tuple, s.tuple)
			return
		}
		if s != nil && (x.Proto == protocol.ProtoUDP) != s.udp {
			w.fail("%s: joins s%d as %s", h, s.idx, x.Proto)
			return
		}
		if s != nil && !s.udp && (x.Right.SendWScale != s.ws[0] || x.Left.PeerWScale != s.ws[0]) {
			w.fail("%s: joins s%d with rightward window scale %d (left side %d), the session's is %d",
				h, s.idx, x.Right.SendWScale, x.Left.PeerWScale, s.ws[0])
			return
		}
		// One state per session tuple, as in the datapath: a session
		// carried here on a live path cannot be joined again (the agent
		// checked the SYN, onPath; the protocol refuses if this fails),
		// and stale state of the tuple gives way to the new path.
		if live := h.liveHere(x.Tuple, x.Nonce); live != nil {
			if w.opts.old&oldJoin != 0 {
				w.tracef("%s cannot join s%d: it carries it already; the agent goes on", h, s.idx)
				return
			}
			w.tracef("%s cannot join s%d: it carries it already", h, s.idx)
			w.after(0, func() { h.handle(protocol.JoinFailed{Session: x.Session}) })
			return
		}
		if w.opts.old == 0 && w.rng.IntN(50) == 0 {
			// Now and then the datapath refuses a join (full maps).
			w.tracef("%s cannot join s%d: its datapath refuses (full)", h, s.idx)
			w.joinFails[x.Req] = true
			w.after(0, func() { h.handle(protocol.JoinFailed{Session: x.Session}) })
			return
		}
		for _, id := range h.dpIDs() {
			if old := h.dp[id]; old.sess.tuple == x.Tuple {
				w.tracef("%s: the state of session %d (s%d) gives way to the new path", h, id, old.sess.idx)
				known := h.known[id]
				h.freeDP(old)
				if known {
					// The agent ends it in its protocol too (after the
					// current actions), as the collector would have.
					w.after(0, func() { h.handle(protocol.SessionEnd{Session: id, Cause: "replaced", Replaced: true}) })
				}
			}
		}
		ds := &dpSess{h: h, id: x.Session, sess: s, joined: true, lastActive: w.now}
		h.known[ds.id] = true
		w.holdStart(s, h)
		for i, info := range []protocol.SideInfo{x.Left, x.Right} {
			sub := &dpSub{ds: ds, side: protocol.Side(i), tuple: info.Sub, peer: info.Peer}
			ds.sides[i] = &dpSide{cur: sub}
			h.addSub(sub)
		}
		h.dp[ds.id] = ds
		h.idleCheck(ds)
		w.tracef("%s joined s%d as session %d", h, s.idx, ds.id)
	case protocol.StartTwoPath:
		if ds := h.dp[x.Session]; ds != nil {
			if ds.sides[x.Side].tp == nil && ds.sides[x.Side].cur.tuple != x.Old {
				w.fail("%s: StartTwoPath old %s, datapath sends on %s", h, x.Old, ds.sides[x.Side].cur.tuple)
				return
			}
			h.startTwoPath(ds, x.Side)
		}
	case protocol.EndTwoPath:
		ds := h.dp[x.Session]
		if ds == nil {
			w.fail("%s: EndTwoPath for session %d, which the datapath does not hold", h, x.Session)
			return
		}
		sd := ds.sides[x.Side]
		if sd.neu == nil || sd.neu.tuple != x.New {
			w.fail("%s: EndTwoPath for %s, new subsession %v", h, x.New, sd.neu)
			return
		}
		sd.cur, sd.neu, sd.tp, sd.ended = sd.neu, nil, nil, ds.sess.udp
		w.tracef("%s end two-path %s side s%d", h, x.Side, ds.sess.idx)
		if w.opts.old&oldNoNotice == 0 {
			id := ds.id
			w.after(0, func() {
				if !ds.gone && (ds.finSeen[0] || ds.finSeen[1]) {
					h.handle(protocol.FinsSeen{Session: id, Fwd: ds.finSeen[0], Rev: ds.finSeen[1]})
				}
			})
		}
	case protocol.RemoveSubsession:
		sub := h.subs[x.Sub]
		if sub == nil {
			return
		}
		delete(h.subs, x.Sub)
		sd := sub.ds.sides[sub.side]
		if sd.old == sub {
			sd.old = nil
		}
		if sd.neu == sub {
			sd.neu, sd.armed = nil, false
		}
		if sd.cur == sub {
			w.fail("%s: removing the subsession in use %s", h, x.Sub)
		}
	case protocol.SetWindowClamp:
		if ds := h.dp[x.Session]; ds != nil {
			ds.sides[x.Side].clamp = x.Bytes
		}
	case protocol.FreeSession:
		if ds := h.dp[x.Session]; ds != nil {
			w.tracef("%s free session %d (s%d)", h, ds.id, ds.sess.idx)
			h.freeDP(ds)
		}
	case protocol.KeepLock:
		// For an agent restart, which the simulation does not model.
	default:
		panic(fmt.Sprintf("sim: unknown action %T", act))
	}
}

func (h *host) addSub(sub *dpSub) {
	if old := h.subs[sub.tuple]; old != nil && !old.ds.gone {
		h.w.fail("%s: subsession %s installed twice", h, sub.tuple)
	}
	h.subs[sub.tuple] = sub
}

func (h *host) freeDP(ds *dpSess) {
	if !ds.gone {
		h.w.holdEnd(ds.sess, h)
	}
	ds.gone = true
	for t, sub := range h.subs {
		if sub.ds == ds {
			delete(h.subs, t)
		}
	}
	delete(h.dp, ds.id)
	delete(h.known, ds.id)
}

// holdStart and holdEnd record when host h holds datapath state of s.
func (w *world) holdStart(s *simSession, h *host) {
	if w.held[s] == nil {
		w.held[s] = map[*host][]span{}
	}
	w.held[s][h] = append(w.held[s][h], span{start: w.now, end: -1})
}

func (w *world) holdEnd(s *simSession, h *host) {
	sp := w.held[s][h]
	for i := len(sp) - 1; i >= 0; i-- {
		if sp[i].end < 0 {
			sp[i].end = w.now
			return
		}
	}
}

// heldDuring reports whether h held state of s at some time in [from, to].
func (w *world) heldDuring(s *simSession, h *host, from, to time.Duration) bool {
	for _, sp := range w.held[s][h] {
		if sp.start <= to && (sp.end < 0 || sp.end >= from) {
			return true
		}
	}
	return false
}

// endSession is the collector ending a session (§3.7: FIN or RST in any
// state): the agent drops its state, then the datapath its flows.
func (h *host) endSession(ds *dpSess, cause string) {
	if ds.gone {
		return
	}
	h.w.tracef("%s collector ends session %d (s%d): %s", h, ds.id, ds.sess.idx, cause)
	if cause == "idle" && h.w.loss == 0 && !ds.sess.rst && !ds.sess.udp {
		// Without loss every host of the path sees the session's FINs, or
		// learns of those that went on an old path (FinsSeen): none keeps
		// it until its idle timeout.
		h.w.fail("%s keeps s%d (session %d) until its idle timeout", h, ds.sess.idx, ds.id)
		return
	}
	ds.sess.markEnding(h.w.now)
	// §3.7: a reconfiguration completes unless its new path fails; one
	// still going when the session ends must not be stuck (after a reset,
	// agents that missed the RST wait for their idle timeout).
	if v, ok := h.agent.View(ds.id); ok && !ds.sess.rst {
		for _, an := range []*protocol.AnchorView{v.Left, v.Right} {
			if an != nil && h.w.now-h.w.started[an.Req] > stuckAfter {
				h.w.fail("%s: reconfiguration %s stuck in %s for %s", h, an.Req, an.Stage, h.w.now-h.w.started[an.Req])
			}
		}
	}
	if h.known[ds.id] {
		h.handle(protocol.SessionEnd{Session: ds.id, Cause: cause})
	}
	h.freeDP(ds)
	h.w.checkLocks()
}

func (h *host) idleCheck(ds *dpSess) {
	idle := idleTimeout
	if ds.sess.udp {
		idle = udpIdle // UDP sessions end by idleness only
	}
	h.w.at(ds.lastActive+idle, func() {
		if ds.gone {
			return
		}
		if h.w.now-ds.lastActive >= idle {
			h.endSession(ds, "idle")
			return
		}
		h.idleCheck(ds)
	})
}

func (s *simSession) markEnding(now time.Duration) {
	if !s.ending {
		s.ending, s.endingAt = true, now
	}
}
