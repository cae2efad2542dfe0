package agent

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
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"time"

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

func (a *Agent) handleSplice(w http.ResponseWriter, r *http.Request) {
	if a.ctl == nil {
		writeErr(w, 503, errNoControl)
		return
	}
	var req api.SpliceRequest
	if err := json.NewDecoder(http.MaxBytesReader(w, r.Body, 1<<16)).Decode(&req); err != nil {
		writeErr(w, 400, fmt.Errorf("splice: bad JSON: %w", err))
		return
	}
	for _, sp := range []api.SocketPair{req.In, req.Out} {
		if !sp.Local.IsValid() || !sp.Remote.IsValid() {
			writeErr(w, 400, errors.New("splice: both sockets need local and remote addresses"))
			return
		}
	}
	var (
		rep api.SpliceReply
		ch  chan triggerMsg
		err error
		at  = time.Now()
	)
	done := make(chan struct{})
	a.ctl.post(func() {
		defer close(done)
		rep.ID, ch, err = a.ctl.splice(req)
	})
	<-done
	if err != nil {
		code := 409
		var be badSplice
		if errors.As(err, &be) {
			code = 400
		}
		a.log.Warn("proxy splice refused", "in", req.In.Remote.String()+"->"+req.In.Local.String(),
			"out", req.Out.Local.String()+"->"+req.Out.Remote.String(), "err", err)
		writeErr(w, code, err)
		return
	}
	a.log.Info("proxy splice: removal requested", "in", req.In.Remote.String()+"->"+req.In.Local.String(),
		"out", req.Out.Local.String()+"->"+req.Out.Remote.String(), "delta", req.Delta, "delta_rev", req.DeltaRev)
	if req.Wait {
		ctx, cancel := context.WithTimeout(r.Context(), defaultReconfigWait)
		defer cancel()
		res := api.ReconfigResult{ID: rep.ID}
		select {
		case m := <-ch:
			res.Outcome, res.Reason, res.Blocker = m.Outcome, m.Reason, m.Blocker
			res.Micros = time.Since(at).Microseconds()
		case <-ctx.Done():
			res.Outcome, res.Reason = "failed", "no result before the deadline"
		}
		rep.Result = &res
	} else {
		go func() {
			m := <-ch
			a.log.Info("proxy removal", "session", rep.ID, "outcome", m.Outcome, "reason", m.Reason)
		}()
	}
	writeJSON(w, 200, rep)
}

type badSplice struct{ error }

// splice joins the two sessions of a proxy and sends the trigger (loop
// goroutine).
func (c *control) splice(req api.SpliceRequest) (uint32, chan triggerMsg, error) {
	dp := c.a.dp
	find := func(sp api.SocketPair) (uint32, datapath.Session, error) {
		k := wire.Tuple{Src: sp.Local.Addr().Unmap(), Dst: sp.Remote.Addr().Unmap(), SrcPort: sp.Local.Port(), DstPort: sp.Remote.Port()}
		f, ok := dp.Flow(datapath.TupleFrom(k))
		if !ok || f.Flags&datapath.FlIngress != 0 {
			return 0, datapath.Session{}, fmt.Errorf("splice: no Dysco session for socket %s -> %s at this host (the client and the proxy need a policy that makes their sessions Dysco sessions, e.g. one with no chain)", sp.Local, sp.Remote)
		}
		s, ok := dp.Session(f.SessId)
		if !ok {
			return 0, datapath.Session{}, fmt.Errorf("splice: session of %s -> %s is gone", sp.Local, sp.Remote)
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
		return 0, nil, badSplice{errors.New("splice: both sockets are the same session")}
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
		return 0, nil, badSplice{fmt.Errorf("splice: the client's session is %s and the server's %s: one TCP session cannot change address family, so the proxy stays on the path",
			famName(cS.IsV6 != 0), famName(sS.IsV6 != 0))}
	}
	for _, s := range []datapath.Session{cS, sS} {
		if s.State&datapath.StEst == 0 || s.State&(datapath.StRST|datapath.StFINFwd|datapath.StFINRev) != 0 {
			return 0, nil, errors.New("splice: a session is not established (or is closing)")
		}
	}
	left, ok1 := c.currentSub(cID, cS.Tuple.Wire(), protocol.SideLeft)
	right, ok2 := c.currentSub(sID, sS.Tuple.Wire(), protocol.SideRight)
	if !ok1 || !ok2 {
		return 0, nil, errors.New("splice: the sessions have no subsessions at this host")
	}
	ws := func(v uint8) uint8 {
		if v == 0xff {
			return 0
		}
		return v
	}
	app := protocol.AppDelta{
		Right: protocol.Delta{Seq: sS.Isn[0] - cS.Isn[0] + uint32(int32(lenLR)), TS: tsOffset(sS, 0) - tsOffset(cS, 0)},
		Left:  protocol.Delta{Seq: cS.Isn[1] - sS.Isn[1] + uint32(int32(lenRL)), TS: tsOffset(cS, 1) - tsOffset(sS, 1)},
	}
	if app.Right.TS != 0 || app.Left.TS != 0 {
		app.Right.TS += tsMarginMS
		app.Left.TS += tsMarginMS
	}
	// Any earlier announcement of either session goes: the joined session
	// replaces both.
	v6 := cS.IsV6 != 0
	for _, id := range []uint32{cID, sID} {
		if pid, ok := c.pidOf[id]; ok {
			c.handle(c.famOf[id], protocol.SessionEnd{Session: pid, Cause: "spliced"})
			delete(c.pidOf, id)
		}
	}
	pid := protocol.SessionID(cID)
	up := protocol.SessionUp{Session: pid, Tuple: cS.Tuple.Wire(), Nonce: cS.Nonce, App: app,
		Left:  &protocol.SideInfo{Peer: left.Src, Sub: left, SendWScale: ws(cS.Ws[1]), PeerWScale: ws(cS.Ws[0]), Nonce: cS.Nonce},
		Right: &protocol.SideInfo{Peer: right.Dst, Sub: right, SendWScale: ws(sS.Ws[0]), PeerWScale: ws(sS.Ws[1]), Nonce: sS.Nonce},
	}
	c.pidOf[cID], c.famOf[cID] = pid, v6
	c.pidOf[sID], c.famOf[sID] = pid, v6
	c.spliced[pid] = splicedPair{client: cID, server: sID}
	c.handle(v6, up)
	ch, err := c.sendTrigger(left.Src, triggerMsg{Sub: &left, RightAnchor: right.Dst})
	if err != nil {
		return 0, nil, err
	}
	return cID, ch, nil
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
func (c *control) freeSpliced(p splicedPair) {
	for _, id := range []uint32{p.client, p.server} {
		// One system call per session (datapath.CutSession).
		if _, err := c.a.dp.CutSession(id); err != nil {
			c.a.log.Warn("control: cannot cut the proxy off a spliced session", "id", id, "err", err)
		}
	}
}
