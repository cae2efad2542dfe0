package reconfig

// Proxy removal (paper §2.4, §4.2 "Triggering a reconfiguration using
// splice"): a session-terminating proxy (HAProxy under libdysco's
// LD_PRELOAD, or a proxy calling dysco_splice) hands the byte streams of two
// sockets to each other. Its agent joins the two TCP sessions into one chain
// through this host, with the proxy's sequence-number, timestamp and window
// translation as the middlebox's own delta (§3.4), and asks the left
// neighbour (the client side's agent) to replace the segment through this
// host by a direct path to the right neighbour (the server side's agent).
// Once the old path is torn down the proxy's sockets are cut off: whatever
// the proxy still sends on them is dropped here and counted (drop_orphan),
// never delivered to the ends that now talk directly.

import (
	"errors"
	"fmt"

	"github.com/dysco/dysco/internal/api"
	"github.com/dysco/dysco/internal/datapath"
	"github.com/dysco/dysco/internal/protocol"
	"github.com/dysco/dysco/internal/wire"
)

// tsMarginMS is added to the timestamp translation of a joined session:
// translated TSvals run a little ahead of the proxy's own, never behind
// (PAWS would drop the packets, RFC 7323 §5); echoes are translated back
// exactly.
const tsMarginMS = 16

// splicedPair is a joined session's two datapath sessions: the one the
// client opened to the proxy (this host its end) and the one the proxy
// opened to the server (this host its start).
type splicedPair struct{ client, server uint32 }

// Splice joins the two sessions of a proxy's sockets and asks the left
// neighbour to remove this host from the chain (a trigger). It returns the
// client session's id and a channel that receives the outcome once.
// Errors of a BadSpliceError are the caller's (a socket that names no
// session, or a bad delta); the others are this host's state.
func (c *Shell) Splice(req api.SpliceRequest) (uint32, <-chan api.ReconfigResult, error) {
	var (
		id  uint32
		ch  chan trigOutcome
		err error
	)
	done := make(chan struct{})
	c.post(func() {
		defer close(done)
		id, ch, err = c.splice(req)
	})
	<-done
	if err != nil {
		return id, nil, err
	}
	out := make(chan api.ReconfigResult, 1)
	go func() {
		m := <-ch
		out <- api.ReconfigResult{ID: id, Outcome: m.Outcome, Reason: m.Reason, Blocker: m.Blocker, Micros: m.Micros}
	}()
	return id, out, nil
}

// BadSpliceError is a splice request that is wrong as asked.
type BadSpliceError struct{ error }

func (e BadSpliceError) Unwrap() error { return e.error }

// splice joins the two sessions of a proxy and sends the trigger (loop
// goroutine).
func (c *Shell) splice(req api.SpliceRequest) (uint32, chan trigOutcome, error) {
	dp := c.dp
	find := func(sp api.SocketPair) (uint32, datapath.Session, error) {
		k := wire.Tuple{Src: sp.Local.Addr().Unmap(), Dst: sp.Remote.Addr().Unmap(), SrcPort: sp.Local.Port(), DstPort: sp.Remote.Port()}
		f, ok := dp.Flow(datapath.TupleFrom(k))
		if !ok || f.Flags&datapath.FlIngress != 0 {
			return 0, datapath.Session{}, fmt.Errorf("splice: no Dysco session for socket %s -> %s at this host (the client and the proxy need a policy that makes their sessions Dysco sessions, e.g. one with no chain)", sp.Local, sp.Remote)
		}
		if f.Flags&datapath.FlDrop != 0 {
			return 0, datapath.Session{}, fmt.Errorf("splice: the session of %s -> %s was spliced already: this host is off its path", sp.Local, sp.Remote)
		}
		s, ok := dp.Session(f.SessId)
		if !ok {
			return 0, datapath.Session{}, fmt.Errorf("splice: session of %s -> %s is gone", sp.Local, sp.Remote)
		}
		if _, ok := c.spliced[protocol.SessionID(f.SessId)]; ok {
			return 0, datapath.Session{}, fmt.Errorf("splice: the session of %s -> %s is being spliced already", sp.Local, sp.Remote)
		}
		return f.SessId, s, nil
	}
	inID, inS, err := find(req.In)
	if err != nil {
		return 0, nil, err
	}
	outID, outS, err := find(req.Out)
	if err != nil {
		return 0, nil, err
	}
	if inID == outID {
		return 0, nil, BadSpliceError{errors.New("splice: both sockets are the same session")}
	}
	// The client's session ends here, the server's starts here.
	cID, cS, sID, sS := inID, inS, outID, outS
	lenLR, lenRL := req.Delta, req.DeltaRev
	if inS.Role == datapath.RoleStart {
		cID, cS, sID, sS = outID, outS, inID, inS
		lenLR, lenRL = req.DeltaRev, req.Delta
	}
	if cS.Role != datapath.RoleEnd || sS.Role != datapath.RoleStart {
		return 0, nil, fmt.Errorf("splice: the sockets must be a session accepted here from a Dysco client and a session this host opened as a Dysco session (roles %s and %s)",
			datapath.RoleName(cS.Role), datapath.RoleName(sS.Role))
	}
	if cS.IsV6 != sS.IsV6 {
		return 0, nil, BadSpliceError{fmt.Errorf("splice: the client's session is %s and the server's %s: one TCP session cannot change address family, so the proxy stays on the path",
			famName(cS.IsV6 != 0), famName(sS.IsV6 != 0))}
	}
	for _, s := range []datapath.Session{cS, sS} {
		if s.State&datapath.StEst == 0 || s.State&(datapath.StRST|datapath.StFINFwd|datapath.StFINRev) != 0 {
			return 0, nil, errors.New("splice: a session is not established (or is closing)")
		}
	}
	app := protocol.AppDelta{
		Right: protocol.Delta{Seq: sS.Isn[0] - cS.Isn[0] + uint32(int32(lenLR)), TS: tsOffset(sS, 0) - tsOffset(cS, 0)},
		Left:  protocol.Delta{Seq: cS.Isn[1] - sS.Isn[1] + uint32(int32(lenRL)), TS: tsOffset(cS, 1) - tsOffset(sS, 1)},
	}
	if app.Right.TS != 0 || app.Left.TS != 0 {
		app.Right.TS += tsMarginMS
		app.Left.TS += tsMarginMS
	}
	up, err := c.joinedUp(cID, cS, sID, sS, app)
	if err != nil {
		return 0, nil, err
	}
	// Kept in the datapath for this agent's next run, should it restart
	// before the proxy has left (resumeSpliced). Without it a restart
	// would leave the proxy on the path: nothing lost, but not removed.
	if err := c.dp.PutSplice(datapath.Splice{Client: cID, Server: sID,
		SeqLR: app.Right.Seq, TSLR: app.Right.TS, SeqRL: app.Left.Seq, TSRL: app.Left.TS,
		ClientCreatedMs: cS.CreatedMs, ServerCreatedMs: sS.CreatedMs}); err != nil {
		c.log.Warn("proxy splice: cannot keep the joined sessions for a restart of this agent", "err", err)
	}
	c.adoptJoined(up, cID, sID, cS.IsV6 != 0)
	ch, err := c.sendTrigger(cID, up.Right.Sub.Dst, nil, nil, cID)
	if err != nil {
		return 0, nil, err
	}
	return cID, ch, nil
}

// joinedUp describes a proxy's joined session to the protocol (§2.4,
// §4.2): the session cID that the client opened to the proxy ends here, the
// one (sID) that the proxy opened to the server starts here; the joined
// session has the client's tuple and nonce, its left side is the client's
// subsession, its right side the server's, and the proxy's delta is app.
func (c *Shell) joinedUp(cID uint32, cS datapath.Session, sID uint32, sS datapath.Session, app protocol.AppDelta) (protocol.SessionUp, error) {
	left, ok1 := c.currentSub(cID, &cS, protocol.SideLeft)
	right, ok2 := c.currentSub(sID, &sS, protocol.SideRight)
	if !ok1 || !ok2 {
		return protocol.SessionUp{}, errors.New("splice: the sessions have no subsessions at this host")
	}
	ws := func(v uint8) uint8 {
		if v == 0xff {
			return 0
		}
		return v
	}
	return protocol.SessionUp{Session: protocol.SessionID(cID), Tuple: cS.Tuple.Wire(), Nonce: cS.Nonce, App: app,
		Left:  &protocol.SideInfo{Peer: left.Src, Sub: left, SendWScale: ws(cS.Ws[1]), PeerWScale: ws(cS.Ws[0]), Nonce: cS.Nonce},
		Right: &protocol.SideInfo{Peer: right.Dst, Sub: right, SendWScale: ws(sS.Ws[0]), PeerWScale: ws(sS.Ws[1]), Nonce: sS.Nonce},
	}, nil
}

// adoptJoined hands a joined session to the protocol in place of its two
// sessions: any earlier announcement of either goes.
func (c *Shell) adoptJoined(up protocol.SessionUp, cID, sID uint32, v6 bool) {
	for _, id := range []uint32{cID, sID} {
		if pid, ok := c.pidOf[id]; ok {
			c.handle(c.famOf[id], protocol.SessionEnd{Session: pid, Cause: "spliced"})
			delete(c.pidOf, id)
		}
	}
	c.pidOf[cID], c.famOf[cID] = up.Session, v6
	c.pidOf[sID], c.famOf[sID] = up.Session, v6
	c.spliced[up.Session] = splicedPair{client: cID, server: sID}
	c.handle(v6, up)
}

// resumeSpliced takes up the sessions that an earlier agent of this proxy
// host joined (PutSplice) and that have not left the path yet: an agent
// restart between the proxy's splice and the old path's teardown. Each is
// handed to the protocol again with its delta and, if the old agent was
// locked for the left anchor's request (KeepLock), locked again, so that
// the anchors' removal goes on through this host. One that was not locked
// yet asks the left anchor again, unless the left anchor had answered the
// earlier agent's trigger (the earlier agent's retransmissions went with
// it). The new trigger's number is above the earlier agent's (request
// numbers survive a restart, reqnums.go), so the left anchor takes it for
// a new one; one that is already at the removal refuses it as busy. Loop
// goroutine, at start.
func (c *Shell) resumeSpliced() {
	var sps []datapath.Splice
	if err := c.dp.EachSplice(func(sp datapath.Splice) { sps = append(sps, sp) }); err != nil {
		c.log.Warn("control: a proxy's joined sessions kept by an earlier agent", "err", err)
		return
	}
	for _, sp := range sps {
		locked, err := c.resumeSplice(sp)
		if err != nil {
			// Neither is the lock kept for it: the client's session must
			// not be announced as a session of its own with it.
			c.dp.DeleteSplice(sp.Client)
			c.dp.DeleteLock(sp.Client)
			c.log.Warn("control: a proxy's joined sessions of an earlier agent are not taken up", "client_session", sp.Client,
				"server_session", sp.Server, "err", err)
			continue
		}
		c.log.Info("control: took up a proxy's joined sessions of an earlier agent", "client_session", sp.Client,
			"server_session", sp.Server, "locked", locked)
	}
}

func (c *Shell) resumeSplice(sp datapath.Splice) (locked bool, err error) {
	dp := c.dp
	cS, ok1 := dp.Session(sp.Client)
	sS, ok2 := dp.Session(sp.Server)
	if !ok1 || !ok2 || cS.CreatedMs != sp.ClientCreatedMs || sS.CreatedMs != sp.ServerCreatedMs {
		return false, errors.New("a session is gone (its id is free or names another session)")
	}
	if cS.Role != datapath.RoleEnd || sS.Role != datapath.RoleStart {
		return false, fmt.Errorf("roles %s and %s, not a proxy's", datapath.RoleName(cS.Role), datapath.RoleName(sS.Role))
	}
	for _, s := range []datapath.Session{cS, sS} {
		if s.State&datapath.StEst == 0 || s.State&(datapath.StRST|datapath.StFINFwd|datapath.StFINRev) != 0 {
			return false, errors.New("a session is closing")
		}
		t := s.Tuple.Wire()
		for _, k := range []wire.Tuple{t, t.Reverse()} {
			if f, ok := dp.Flow(datapath.TupleFrom(k)); ok && f.Flags&datapath.FlDrop != 0 {
				return false, errors.New("the proxy was cut off its sessions already (it has left the path)")
			}
		}
	}
	up, err := c.joinedUp(sp.Client, cS, sp.Server, sS, protocol.AppDelta{
		Right: protocol.Delta{Seq: sp.SeqLR, TS: sp.TSLR}, Left: protocol.Delta{Seq: sp.SeqRL, TS: sp.TSRL}})
	if err != nil {
		return false, err
	}
	if la, n, ok := dp.Lock(sp.Client); ok {
		up.Lock = protocol.ReqKey{LeftAnchor: addrFrom16(la), ID: n}
	}
	c.adoptJoined(up, sp.Client, sp.Server, cS.IsV6 != 0)
	if !up.Lock.IsZero() {
		return true, nil
	}
	if sp.Answered {
		// The left anchor answered the earlier agent's trigger: the
		// removal failed or was refused (had it succeeded, the teardown
		// would have locked this agent). Not asked again unprompted.
		return false, nil
	}
	ch, err := c.sendTrigger(sp.Client, up.Right.Sub.Dst, nil, nil, sp.Client)
	if err != nil {
		c.log.Warn("proxy removal not asked again after an agent restart", "session", sp.Client, "err", err)
		return false, nil // taken up all the same: a middle agent of its path
	}
	go func() {
		m := <-ch
		c.log.Info("proxy removal asked again after an agent restart", "session", sp.Client, "outcome", m.Outcome, "reason", m.Reason)
	}()
	return false, nil
}

// tsOffset is the timestamp clock offset of the sender of direction dir of
// a session, from the TSval of its SYN or SYN-ACK and when it was seen:
// Linux's TCP timestamps are milliseconds of the monotonic clock plus a
// per-connection offset (RFC 7323 §5.4). Zero when the session has none.
func tsOffset(s datapath.Session, dir int) uint32 {
	if s.HasTs&(1<<dir) == 0 {
		return 0
	}
	return s.Tsoff[dir]
}

// freeSpliced cuts a proxy off its two sessions once the old path through
// it is torn down: their ingress flows go, their egress flows drop what the
// proxy still sends (its sockets live on until it closes them). The
// sessions stay for the collector, which ends them when they fall idle.
func (c *Shell) freeSpliced(p splicedPair) {
	for _, id := range []uint32{p.client, p.server} {
		// One system call per session (datapath.CutSession).
		if _, err := c.dp.CutSession(id, c.onwardKey(id)); err != nil {
			c.log.Warn("control: cannot cut the proxy off a spliced session", "id", id, "err", err)
		}
	}
}
