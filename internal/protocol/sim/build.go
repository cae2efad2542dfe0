package sim

import (
	"fmt"
	"net/netip"
	"time"

	"github.com/dysco/dysco/internal/protocol"
	"github.com/dysco/dysco/internal/wire"
)

// build draws a deployment from the seed: middlebox hosts (some dead),
// sessions through chains of live ones, their traffic, the requests and
// resets to come.
func (w *world) build() {
	r := w.rng
	w.loss = []float64{0, 0.01, 0.03, 0.05}[r.IntN(4)]
	w.dup = []float64{0, 0.01, 0.03}[r.IntN(3)]
	w.delayMin = time.Millisecond
	w.jitter = []time.Duration{0, 2 * time.Millisecond, 6 * time.Millisecond}[r.IntN(3)]
	nM := 3 + r.IntN(4)
	var live []*host
	for i := 0; i < nM; i++ {
		h := w.newHost(fmt.Sprintf("m%d", i), true)
		if r.Float64() < 0.2 {
			h.dead = true // never in a first chain; new paths through it fail (§3.6)
		} else {
			live = append(live, h)
		}
	}
	// Sessions start at random times, several at once, so that some are
	// set up while others are being reconfigured; some reuse the tuple of
	// an earlier one once it has closed, as a client reuses its ports,
	// while middleboxes may still hold the earlier one's state.
	nS := 1 + r.IntN(6)
	for i := 0; i < nS; i++ {
		var reuse *simSession
		if i > 0 && r.IntN(4) == 0 {
			reuse = w.sessions[r.IntN(len(w.sessions))]
		}
		s := w.newSession(i, live, reuse)
		if i == 0 {
			w.startSession(s, live, 0)
		} else {
			w.startSession(s, live, time.Duration(r.IntN(2500))*time.Millisecond)
		}
	}
	// UDP sessions beside them (udp.go), on their own clients and
	// servers.
	nU := 0
	if !w.opts.NoUDP {
		nU = udpCount(w.opts.Seed)
	}
	for i := nS; i < nS+nU; i++ {
		s := &simSession{idx: i, udp: true}
		s.client = w.newHost(fmt.Sprintf("c%d", i), false)
		s.server = w.newHost(fmt.Sprintf("s%d", i), false)
		s.tuple = wire.Tuple{Src: s.client.addr, Dst: s.server.addr, SrcPort: uint16(30000 + i), DstPort: 53}
		for j := range s.nonce {
			s.nonce[j] = byte(r.IntN(256))
		}
		w.sessions = append(w.sessions, s)
		w.after(time.Duration(r.IntN(2500))*time.Millisecond, func() { w.setUpUDP(s, live) })
	}
	w.stats.Sessions, w.stats.Hosts = nS+nU, len(w.hosts)
	w.tracef("seed %d: loss %.2f dup %.2f jitter %s, %d middleboxes, %d sessions", w.opts.Seed, w.loss, w.dup, w.jitter, nM, nS)
	for _, h := range w.hosts {
		w.tracef("host %s %s dead=%v", h, h.addr, h.dead)
	}
}

func (w *world) randDelta() protocol.Delta {
	r := w.rng
	var d protocol.Delta
	switch r.IntN(4) {
	case 1:
		d.Seq = uint32(int32(r.IntN(2001) - 1000))
	case 2, 3:
		d.Seq = r.Uint32()
	}
	if r.IntN(2) == 1 {
		d.TS = r.Uint32()
	}
	return d
}

// newSession makes session i: on its own client and server, or on those
// and the tuple of reuse.
func (w *world) newSession(i int, live []*host, reuse *simSession) *simSession {
	r := w.rng
	s := &simSession{idx: i}
	if reuse != nil {
		s.client, s.server, s.tuple = reuse.client, reuse.server, reuse.tuple
		w.stats.Reused++
	} else {
		s.client = w.newHost(fmt.Sprintf("c%d", i), false)
		s.server = w.newHost(fmt.Sprintf("s%d", i), false)
		s.tuple = wire.Tuple{Src: s.client.addr, Dst: s.server.addr, SrcPort: uint16(30000 + i), DstPort: 80}
	}
	for j := range s.nonce {
		s.nonce[j] = byte(r.IntN(256))
	}
	w.sessions = append(w.sessions, s)
	return s
}

// startSession sets session s up after d: at once, or, for a session that
// reuses a tuple, once the earlier sessions of that tuple have closed at
// both ends.
func (w *world) startSession(s *simSession, live []*host, d time.Duration) {
	w.after(d, func() {
		for _, o := range w.sessions {
			if o.idx >= s.idx || o.tuple != s.tuple || o.udp {
				continue
			}
			if o.ends[0] == nil || !o.rst && (o.ends[0].state == tcpOpen || o.ends[1].state == tcpOpen) {
				if w.now > horizon/2 {
					return // the earlier one never closes: the run checks it
				}
				w.startSession(s, live, 200*time.Millisecond)
				return
			}
		}
		w.setUp(s, live)
	})
}

// setUp sets a session up through a chain of live middleboxes: its state
// at every host (announced to the agents lazily), its traffic, the
// requests and resets to come.
func (w *world) setUp(s *simSession, live []*host) {
	r := w.rng
	i, c, sv := s.idx, s.client, s.server
	k := r.IntN(min(4, len(live)) + 1)
	hosts := []*host{c}
	for _, j := range r.Perm(len(live))[:k] {
		hosts = append(hosts, live[j])
	}
	hosts = append(hosts, sv)
	n := len(hosts)

	apps := make([]protocol.AppDelta, n)
	for j := 1; j < n-1; j++ {
		apps[j] = protocol.AppDelta{Right: w.randDelta(), Left: w.randDelta()}
	}
	// Sequence and timestamp spaces where each stream arrives at each host.
	issA, issB, tsA, tsB := r.Uint32(), r.Uint32(), r.Uint32(), r.Uint32()
	rIn, lIn := make([]protocol.Delta, n), make([]protocol.Delta, n)
	rIn[0] = protocol.Delta{Seq: issA, TS: tsA}
	for j := 1; j < n; j++ {
		rIn[j] = rIn[j-1].Add(apps[j-1].Right)
	}
	lIn[n-1] = protocol.Delta{Seq: issB, TS: tsB}
	for j := n - 2; j >= 0; j-- {
		lIn[j] = lIn[j+1].Add(apps[j+1].Left)
	}
	rOut := func(j int) uint32 { return rIn[j].Seq + apps[j].Right.Seq }
	lOut := func(j int) uint32 { return lIn[j].Seq + apps[j].Left.Seq }

	subs := make([]wire.Tuple, n-1)
	for j := range subs {
		w.portSeq++
		subs[j] = wire.Tuple{Src: hosts[j].addr, Dst: hosts[j+1].addr, SrcPort: 1000 + w.portSeq, DstPort: 80}
	}
	// From values drawn already: the random stream, which the regression
	// seeds replay, stays as it was.
	s.ws = [2]uint8{uint8(issA % 15), uint8(issB % 15)}
	var dss []*dpSess
	for j, h := range hosts {
		w.nextSessID++
		ds := &dpSess{h: h, id: w.nextSessID, sess: s, app: apps[j], ready: true, lastActive: w.now}
		ds.seenMax = [2]uint32{rIn[j].Seq, lIn[j].Seq}
		ds.seen = [2]bool{true, true}
		up := protocol.SessionUp{Session: ds.id, Tuple: s.tuple, Nonce: s.nonce, App: apps[j]}
		if j > 0 {
			sub := &dpSub{ds: ds, side: protocol.SideLeft, tuple: subs[j-1], peer: hosts[j-1].addr}
			ds.sides[protocol.SideLeft] = &dpSide{cur: sub, marks: protocol.Marks{
				SndNxt: lOut(j), AckRcvd: lOut(j), RcvNxt: rIn[j].Seq, AckSent: rIn[j].Seq, Sent: true, Rcvd: true}}
			h.addSub(sub)
			up.Left = &protocol.SideInfo{Peer: sub.peer, Sub: sub.tuple, SendWScale: s.ws[1], PeerWScale: s.ws[0]}
		}
		if j < n-1 {
			sub := &dpSub{ds: ds, side: protocol.SideRight, tuple: subs[j], peer: hosts[j+1].addr}
			ds.sides[protocol.SideRight] = &dpSide{cur: sub, marks: protocol.Marks{
				SndNxt: rOut(j), AckRcvd: rOut(j), RcvNxt: lIn[j].Seq, AckSent: lIn[j].Seq, Sent: true, Rcvd: true}}
			h.addSub(sub)
			up.Right = &protocol.SideInfo{Peer: sub.peer, Sub: sub.tuple, SendWScale: s.ws[0], PeerWScale: s.ws[1]}
		}
		ds.up = &up
		h.dp[ds.id] = ds
		w.holdStart(s, h)
		h.idleCheck(ds)
		dss = append(dss, ds)
	}
	sizes := []uint32{0, uint32(r.IntN(3000)), uint32(r.IntN(40000)), uint32(r.IntN(150000))}
	totA, totB := sizes[r.IntN(4)], sizes[r.IntN(4)]
	a := &tcpEnd{w: w, h: c, ds: dss[0], sess: s, side: protocol.SideRight, dir: 0, name: fmt.Sprintf("%s(s%d)", c, i),
		iss: issA, irs: lIn[0].Seq, total: totA, peerTotal: totB, tsOff: tsA, peerTSBase: lIn[0].TS}
	b := &tcpEnd{w: w, h: sv, ds: dss[n-1], sess: s, side: protocol.SideLeft, dir: 1, name: fmt.Sprintf("%s(s%d)", sv, i),
		iss: issB, irs: rIn[n-1].Seq, total: totB, peerTotal: totA, tsOff: tsB, peerTSBase: rIn[n-1].TS}
	for _, e := range []*tcpEnd{a, b} {
		e.sndUna, e.sndNxt = e.iss, e.iss
		dss[0].end, dss[n-1].end = a, b
		e := e
		w.after(time.Duration(r.IntN(200))*time.Millisecond, func() { w.write(e) })
	}
	s.ends = [2]*tcpEnd{a, b}
	var names []string
	for j, h := range hosts {
		names = append(names, fmt.Sprintf("%s%s", h, apps[j]))
	}
	w.tracef("session s%d: %v %s, %d bytes right, %d bytes left", i, names, s.tuple, totA, totB)

	// Reconfiguration requests, alone and in bursts on overlapping
	// segments; a reset now and then.
	for k := r.IntN(4); k > 0; k-- {
		w.after(time.Duration(20+r.IntN(3000))*time.Millisecond, func() { w.issue(s, 1) })
	}
	if r.Float64() < 0.6 {
		w.after(time.Duration(20+r.IntN(2500))*time.Millisecond, func() { w.issue(s, 2+w.rng.IntN(2)) })
	}
	if r.Float64() < 0.15 {
		e := s.ends[r.IntN(2)]
		w.after(time.Duration(r.IntN(3000))*time.Millisecond, e.reset)
	}
}

// write is the application writing its stream in chunks, sometimes pausing.
func (w *world) write(e *tcpEnd) {
	if e.state != tcpOpen || e.ds.gone {
		return
	}
	e.avail = min(e.total, e.avail+uint32(1+w.rng.IntN(2000)))
	e.pump()
	if e.avail < e.total {
		gap := time.Duration(w.rng.IntN(60)) * time.Millisecond
		if w.rng.IntN(10) == 0 {
			gap = time.Duration(w.rng.IntN(1000)) * time.Millisecond
		}
		w.after(gap, func() { w.write(e) })
	}
}

// issue asks n left anchors at once to reconfigure segments of s that all
// contain one subsession of the current path (n = 1: any segment).
func (w *world) issue(s *simSession, n int) {
	r := w.rng
	hs, dss := w.path(s)
	if len(hs) < 2 || s.rst || s.ending {
		return
	}
	core := r.IntN(len(hs) - 1) // the subsession hs[core] → hs[core+1]
	if n > 1 && core == 0 && len(hs) > 2 {
		core = 1 + r.IntN(len(hs)-2) // leave room for different left anchors
	}
	lefts := r.Perm(core + 1) // distinct left anchors while there are enough
	for k := 0; k < n; k++ {
		li, ri := r.IntN(len(hs)-1), 0
		if n > 1 {
			li = lefts[k%len(lefts)]
			ri = core + 1 + r.IntN(len(hs)-core-1)
		} else {
			ri = li + 1 + r.IntN(len(hs)-li-1)
		}
		if hs[ri] == hs[li] {
			continue // a host on the path twice (two new paths through it): it cannot anchor both ends
		}
		// New middleboxes: mostly hosts with no state of this session at
		// all; sometimes the segment as it is (nothing to change), or a
		// host that carries the session (on the path, or lingering after
		// an old path went), which the request must not put on its new
		// path as well.
		var free, carrying []*host
		for _, h := range w.hosts {
			if !h.mbox || h == hs[li] || h == hs[ri] {
				continue
			}
			busy := false
			for _, ds := range h.dp {
				busy = busy || ds.sess == s && !ds.gone
			}
			if busy {
				carrying = append(carrying, h)
			} else {
				free = append(free, h)
			}
		}
		var chain []*host
		switch x := r.IntN(10); {
		case x < 2:
			chain = append(chain, hs[li+1:ri]...)
		case x < 4 && len(carrying) > 0:
			for _, j := range r.Perm(len(free))[:min(len(free), r.IntN(2))] {
				chain = append(chain, free[j])
			}
			at := r.IntN(len(chain) + 1)
			chain = append(chain[:at], append([]*host{carrying[r.IntN(len(carrying))]}, chain[at:]...)...)
		default:
			for _, j := range r.Perm(len(free))[:min(len(free), r.IntN(3))] {
				chain = append(chain, free[j])
			}
		}
		// Now and then the replacement of one middlebox by one, with its
		// state (migrate.go).
		migrating := n == 1 && ri == li+2 && len(free) > 0 && r.IntN(3) == 0 && !s.udp
		if migrating {
			chain = []*host{free[r.IntN(len(free))]}
		}
		var addrs []netip.Addr
		dead := false
		for _, h := range chain {
			addrs = append(addrs, h.addr)
			dead = dead || h.dead
		}
		w.tokens++
		req := &request{token: w.tokens, sess: s, left: hs[li], right: hs[ri], chain: chain, deadChain: dead,
			issued: w.now, contention: n > 1}
		// Now and then the request is a trigger (trigger.go): the host
		// after the left anchor, a middlebox, asks it for the request.
		if li+1 < len(hs)-1 && ri > li && r.IntN(4) == 0 {
			req.sender = hs[li+1]
		}
		if r.IntN(3) == 0 && (req.sender == nil || len(chain) == 1 && !s.udp) { // a triggered gate migrates: TCP only
			req.gate, req.abort = true, r.IntN(3) == 0
		}
		if migrating && req.sender == nil {
			req.gate, req.abort = true, r.IntN(3) == 0
			req.mig = &protocol.MigrateSpec{Semantics: protocol.MigrateSemantics(r.IntN(4)),
				HoldLimit: uint64(r.IntN(1 << 24)), TimeoutMS: uint32(500 + r.IntN(5000))}
		}
		w.reqs = append(w.reqs, req)
		w.byToken[req.token] = req
		w.stats.Requests++
		if req.sender != nil {
			w.sendTrigger(req, dss[li+1], addrs)
			continue
		}
		w.tracef("OPERATOR %s", req)
		if !hs[li].announce(dss[li]) {
			// The agent refuses a session it cannot announce (reset).
			w.onResult(hs[li], protocol.Result{Session: dss[li].id, Token: req.token, Outcome: protocol.Refused,
				Reason: protocol.ReasonNoSession, Req: protocol.ReqKey{LeftAnchor: hs[li].addr}})
			continue
		}
		hs[li].handle(protocol.Reconfigure{Session: dss[li].id, RightAnchor: hs[ri].addr, Chain: addrs, Token: req.token,
			Gate: req.gate && req.mig == nil, Migrate: req.mig})
		w.checkLocks()
	}
}
