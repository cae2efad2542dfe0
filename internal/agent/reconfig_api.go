package agent

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/netip"
	"time"

	"github.com/dysco/dysco/internal/api"
	"github.com/dysco/dysco/internal/datapath"
	"github.com/dysco/dysco/internal/policy"
	"github.com/dysco/dysco/internal/protocol"
	"github.com/vishvananda/netlink"
)

const (
	defaultReconfigWait = 10 * time.Second
	maxReconfigWait     = 5 * time.Minute
)

var errNoControl = errors.New("reconfiguration is disabled on this agent: start it with --control-key-file (every agent of a deployment needs the same key)")

func reconfigWait(ms int) time.Duration {
	if ms <= 0 {
		return defaultReconfigWait
	}
	return min(time.Duration(ms)*time.Millisecond, maxReconfigWait)
}

// liveSessions returns the sessions matching m that carry data, and for
// which this host has the sides the caller needs: established, not reset,
// not closed both ways (a session one end has closed still carries the
// other end's data, and is reconfigured like any other). Sessions still in
// their handshake are not included.
func (a *Agent) liveSessions(m *policy.SessionMatcher, needLeft, needRight bool) ([]datapath.SessionEntry, error) {
	all, err := a.dp.Sessions()
	if err != nil {
		return nil, err
	}
	var out []datapath.SessionEntry
	for _, s := range all {
		if s.State&datapath.StEst == 0 || s.State&datapath.StRST != 0 ||
			s.State&(datapath.StFINFwd|datapath.StFINRev) == datapath.StFINFwd|datapath.StFINRev {
			continue
		}
		hasRight := s.Role == datapath.RoleStart || s.Role == datapath.RoleMiddle
		hasLeft := s.Role != datapath.RoleStart
		if needLeft && !hasLeft || needRight && !hasRight {
			continue
		}
		if !m.Match(s.Tuple.Wire()) {
			continue
		}
		out = append(out, s)
	}
	return out, nil
}

func (a *Agent) handleReconfig(w http.ResponseWriter, r *http.Request) {
	var req api.ReconfigRequest
	if err := json.NewDecoder(http.MaxBytesReader(w, r.Body, 1<<16)).Decode(&req); err != nil {
		writeErr(w, 400, fmt.Errorf("reconfig: bad JSON: %w", err))
		return
	}
	rep, err := a.reconfig(r.Context(), req)
	if err != nil {
		writeErr(w, err.code, err)
		return
	}
	writeJSON(w, 200, rep)
}

// requestError is a request refused, with its HTTP status.
type requestError struct {
	code int
	err  error
}

func (e *requestError) Error() string { return e.err.Error() }

// reconfig carries out a reconfiguration request as left anchor (the
// local API's POST /v1/reconfig, or an operation from the policy server).
func (a *Agent) reconfig(ctx context.Context, req api.ReconfigRequest) (api.ReconfigReply, *requestError) {
	bad := func(err error) (api.ReconfigReply, *requestError) {
		return api.ReconfigReply{}, &requestError{400, err}
	}
	if a.ctl == nil {
		return api.ReconfigReply{}, &requestError{503, errNoControl}
	}
	if err := api.CheckPath(req.To, req.Chain); err != nil {
		return bad(fmt.Errorf("reconfig: %w", err))
	}
	to := req.To.Unmap()
	chain := make([]netip.Addr, 0, len(req.Chain))
	for _, h := range req.Chain {
		chain = append(chain, h.Unmap())
	}
	mig, err := migrateOptions(req.Migrate, len(chain))
	if err != nil {
		return bad(err)
	}
	m, err := policy.CompileMatch(req.Match)
	if err != nil {
		return bad(err)
	}
	sessions, err := a.liveSessions(m, false, true)
	if err != nil {
		return api.ReconfigReply{}, &requestError{500, err}
	}
	ids := make([]uint32, len(sessions))
	tuples := map[uint32]string{}
	for i, s := range sessions {
		ids[i] = s.ID
		tuples[s.ID] = s.Tuple.Wire().String()
	}
	ctx, cancel := context.WithTimeout(ctx, reconfigWait(req.TimeoutMS))
	defer cancel()
	rep := api.ReconfigReply{Results: []api.ReconfigResult{}}
	for _, o := range a.ctl.reconfigure(ctx, ids, to, chain, mig) {
		res := api.ReconfigResult{ID: o.id, Session: tuples[o.id], Outcome: o.outcome, Reason: o.reason}
		if o.res != nil {
			// As history has it (with the migration's report): the
			// times of its phases, measured when the result came.
			res = o.rec
			res.ID, res.Session = o.id, tuples[o.id]
			if o.mig != nil && res.Migration == nil {
				res.Migration = o.mig
				if o.mig.Error != "" {
					res.Reason = joinNote(res.Reason, o.mig.Error)
				}
			}
		}
		rep.Results = append(rep.Results, res)
	}
	return rep, nil
}

// migrateOptions checks a request's state migration part.
func migrateOptions(spec *api.MigrateSpec, hops int) (*MigrateOptions, error) {
	if spec == nil {
		return nil, nil
	}
	o := &MigrateOptions{Semantics: spec.Semantics, HoldLimit: spec.HoldLimit, Timeout: time.Duration(spec.TimeoutMS) * time.Millisecond}
	if err := o.normalize(); err != nil {
		return nil, fmt.Errorf("migrate: %w", err)
	}
	if hops != 1 {
		return nil, fmt.Errorf("migrate: state migration replaces one middlebox by one: the new chain has %d", hops)
	}
	return o, nil
}

// handleReconfigHistory lists the last reconfigurations this agent ran as
// left anchor (requested here or triggered by a middlebox), oldest first.
func (a *Agent) handleReconfigHistory(w http.ResponseWriter, r *http.Request) {
	if a.ctl == nil {
		writeErr(w, 503, errNoControl)
		return
	}
	writeJSON(w, 200, api.ReconfigReply{Results: a.ctl.reconfigHistory()})
}

// handleMiddlebox asks the left neighbour of each matching session through
// this host to remove this host from it, or replace it (§2.3).
func (a *Agent) handleMiddlebox(w http.ResponseWriter, r *http.Request) {
	var req api.MiddleboxRequest
	if err := json.NewDecoder(http.MaxBytesReader(w, r.Body, 1<<16)).Decode(&req); err != nil {
		writeErr(w, 400, fmt.Errorf("middlebox: bad JSON: %w", err))
		return
	}
	rep, err := a.middlebox(r.Context(), req)
	if err != nil {
		writeErr(w, err.code, err)
		return
	}
	writeJSON(w, 200, rep)
}

// middlebox carries out a middlebox host's request about the sessions
// through it (the local API's POST /v1/middlebox, or an operation from the
// policy server).
func (a *Agent) middlebox(ctx context.Context, req api.MiddleboxRequest) (api.ReconfigReply, *requestError) {
	if a.ctl == nil {
		return api.ReconfigReply{}, &requestError{503, errNoControl}
	}
	if _, err := migrateOptions(req.Migrate, len(req.With)); err != nil {
		return api.ReconfigReply{}, &requestError{400, err}
	}
	m, err := policy.CompileMatch(req.Match)
	if err != nil {
		return api.ReconfigReply{}, &requestError{400, err}
	}
	sessions, err := a.liveSessions(m, true, true)
	if err != nil {
		return api.ReconfigReply{}, &requestError{500, err}
	}
	ctx, cancel := context.WithTimeout(ctx, reconfigWait(req.TimeoutMS))
	defer cancel()
	rep := api.ReconfigReply{Results: []api.ReconfigResult{}}
	rep.Results = append(rep.Results, a.ctl.removeSelf(ctx, sessions, req.With, req.Migrate)...)
	return rep, nil
}

// execOperation carries out an operation relayed by the policy server, as
// the same request to the local API would be.
func (a *Agent) execOperation(ctx context.Context, op api.Operation) api.OperationResult {
	var (
		rep  api.ReconfigReply
		rerr *requestError
	)
	switch {
	case op.Reconfig != nil:
		rep, rerr = a.reconfig(ctx, *op.Reconfig)
	case op.Middlebox != nil:
		rep, rerr = a.middlebox(ctx, *op.Middlebox)
	default:
		return api.OperationResult{Error: "the operation holds no request this agent knows (a newer policy server?)"}
	}
	if rerr != nil {
		return api.OperationResult{Error: rerr.Error()}
	}
	a.log.Info("operation carried out", "id", op.ID, "sessions", len(rep.Results))
	return api.OperationResult{Reply: &rep}
}

// removeSelf sends a trigger per session and collects the results.
func (c *control) removeSelf(ctx context.Context, sessions []datapath.SessionEntry, with []netip.Addr, mig *api.MigrateSpec) []api.ReconfigResult {
	type pending struct {
		res api.ReconfigResult
		ch  chan triggerMsg
		at  time.Time
	}
	var ps []*pending
	done := make(chan struct{})
	c.post(func() {
		defer close(done)
		for _, s := range sessions {
			if c.leftPath(s.ID) {
				continue // no longer passing through this host
			}
			p := &pending{res: api.ReconfigResult{ID: s.ID, Session: s.Tuple.Wire().String()}, at: time.Now()}
			ps = append(ps, p)
			left, ok1 := c.currentSub(s.ID, &s.Session, protocol.SideLeft)
			right, ok2 := c.currentSub(s.ID, &s.Session, protocol.SideRight)
			if !ok1 || !ok2 {
				p.res.Outcome, p.res.Reason = "refused", "this host is not in the middle of the session"
				continue
			}
			var chain []netip.Addr
			for _, h := range with {
				chain = append(chain, h.Unmap())
			}
			ch, err := c.sendTrigger(left.Src, triggerMsg{Sub: &left, RightAnchor: right.Dst, Chain: chain, Migrate: mig}, 0)
			if err != nil {
				p.res.Outcome, p.res.Reason = "failed", err.Error()
				continue
			}
			p.ch = ch
		}
	})
	select {
	case <-done:
	case <-ctx.Done():
		return nil
	}
	out := make([]api.ReconfigResult, 0, len(ps))
	for _, p := range ps {
		if p.ch != nil {
			select {
			case m := <-p.ch:
				p.res.Outcome, p.res.Reason, p.res.Blocker = m.Outcome, m.Reason, m.Blocker
				p.res.Micros = m.Micros
				p.res.Migration = m.Migration
			case <-ctx.Done():
				p.res.Outcome, p.res.Reason = "failed", "no result before the deadline"
			}
		}
		out = append(out, p.res)
	}
	return out
}

// leftPath tells whether this host is a middle of an old path of session
// id, torn down or being torn down by a reconfiguration (§3.5): the session
// lingers here to answer FINs, but no longer passes through this host.
// Loop goroutine.
func (c *control) leftPath(id uint32) bool {
	pid, ok := c.pidOf[id]
	if !ok {
		return false
	}
	p := c.protos[c.famOf[id]]
	if p == nil {
		return false
	}
	v, ok := p.View(pid)
	return ok && v.Teardown
}

// selfAddr returns this host's first global address of a family: the
// address other agents name it by in address lists.
func (a *Agent) selfAddr(v6 bool) netip.Addr {
	fam := netlink.FAMILY_V4
	if v6 {
		fam = netlink.FAMILY_V6
	}
	addrs, err := netlink.AddrList(nil, fam)
	if err != nil {
		return netip.Addr{}
	}
	var best netip.Addr
	for _, ad := range addrs {
		ip, ok := netip.AddrFromSlice(ad.IP)
		if !ok {
			continue
		}
		ip = ip.Unmap()
		if ip.Is6() != v6 || !ip.IsGlobalUnicast() {
			continue
		}
		if !best.IsValid() || ip.Less(best) {
			best = ip
		}
	}
	return best
}
