package agent

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/netip"
	"slices"
	"time"

	"github.com/dysco/dysco/internal/api"
	"github.com/dysco/dysco/internal/datapath"
	"github.com/dysco/dysco/internal/policy"
	"github.com/dysco/dysco/internal/protocol"
	"github.com/dysco/dysco/internal/reconfig"
	"github.com/vishvananda/netlink"
)

const (
	defaultReconfigWait = 10 * time.Second
	maxReconfigWait     = 5 * time.Minute
)

var errNoControl = errors.New("reconfiguration is disabled on this agent: start it with --control-key-file (every agent of a deployment needs the same deployment secret)")

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
// their handshake are not included, nor UDP sessions that no datagram has
// answered yet. The filter is tested on the session's first packet (a TCP
// SYN, or a UDP datagram).
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
		if !m.MatchProto(s.Tuple.Wire(), s.Proto) {
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
	if err := protocol.CheckNFs(chain, req.NFs); err != nil {
		return bad(fmt.Errorf("reconfig: %w", err))
	}
	if a.ownAddr(to) {
		return bad(fmt.Errorf("reconfig: --to %s is an address of this host: the right anchor is a host after this one on the session's path", to))
	}
	for _, h := range chain {
		if a.ownAddr(h) {
			return bad(fmt.Errorf("reconfig: --chain names %s, an address of this host: this host is the left anchor, not a hop of the new segment", h))
		}
	}
	via := req.Via.Unmap()
	if via.IsValid() {
		ifs, _ := trafficIfaces()
		switch {
		case !a.ownAddr(via):
			return bad(fmt.Errorf("reconfig: --via %s is not an address of this host: the new path leaves from one of this host's addresses", via))
		case !via.IsGlobalUnicast() || ifs[via] == 0:
			return bad(fmt.Errorf("reconfig: --via %s is not a global address of an interface that carries traffic (not lo, not a dummy, not link-local)", via))
		case via.Is4() != to.Is4():
			return bad(fmt.Errorf("reconfig: --via %s and --to %s are of different address families", via, to))
		case req.Migrate != nil:
			return bad(errors.New("reconfig: --via moves the session to another address of this host, --migrate moves a middlebox's state: give one or the other"))
		}
	}
	mig, err := reconfig.ParseMigrate(req.Migrate, len(chain))
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
	if via.IsValid() {
		// From now on a lost interface may strand a session here
		// (mobility.go, lostSessions).
		a.viaUsed.Store(true)
	}
	for _, o := range a.ctl.ReconfigurePath(ctx, ids, reconfig.NewPath{To: to, Chain: chain, NFs: req.NFs, Source: via}, mig) {
		res := api.ReconfigResult{ID: o.ID, Session: tuples[o.ID], Outcome: o.Outcome, Reason: o.Reason}
		if o.Result != nil {
			// As history has it (with the migration's report): the
			// times of its phases, measured when the result came.
			res = o.Record
			res.ID, res.Session = o.ID, tuples[o.ID]
			if o.Migration != nil && res.Migration == nil {
				res.Migration = o.Migration
				if o.Migration.Error != "" {
					res.Reason = reconfig.JoinNote(res.Reason, o.Migration.Error)
				}
			}
		}
		rep.Results = append(rep.Results, res)
	}
	return rep, nil
}

// handleReconfigHistory lists the last reconfigurations this agent ran as
// left anchor (requested here or triggered by a middlebox), oldest first.
func (a *Agent) handleReconfigHistory(w http.ResponseWriter, r *http.Request) {
	if a.ctl == nil {
		writeErr(w, 503, errNoControl)
		return
	}
	writeJSON(w, 200, api.ReconfigReply{Results: a.ctl.History()})
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
	if _, err := reconfig.ParseMigrate(req.Migrate, len(req.With)); err != nil {
		return api.ReconfigReply{}, &requestError{400, err}
	}
	for _, h := range req.With {
		if a.ownAddr(h.Unmap()) {
			return api.ReconfigReply{}, &requestError{400, fmt.Errorf("middlebox: the replacement %s is an address of this host, which leaves the sessions", h)}
		}
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
	rep.Results = append(rep.Results, a.ctl.RemoveSelf(ctx, sessions, req.With, req.Migrate)...)
	return rep, nil
}

// execOperation carries out an operation relayed by the policy server, as
// the same request to the local API would be.
func (a *Agent) execOperation(ctx context.Context, op api.Operation) api.OperationResult {
	var (
		rep  api.ReconfigReply
		rerr *requestError
	)
	// The operation came over the network: the bounds the server checks
	// (timeout, filter length, chain length, migration spec) are checked
	// again here.
	if err := op.Validate(); err != nil {
		return api.OperationResult{Error: "refused: " + err.Error()}
	}
	switch {
	case op.Reconfig != nil:
		rep, rerr = a.reconfig(ctx, *op.Reconfig)
	case op.Middlebox != nil:
		rep, rerr = a.middlebox(ctx, *op.Middlebox)
	case op.Query != nil:
		return a.query(*op.Query)
	default:
		return api.OperationResult{Error: "the operation holds no request this agent knows (a newer policy server?)"}
	}
	if rerr != nil {
		return api.OperationResult{Error: rerr.Error()}
	}
	a.log.Info("operation carried out", "id", op.ID, "sessions", len(rep.Results))
	return api.OperationResult{Reply: &rep}
}

// query answers a query relayed by the policy server with what the local
// API lists: the first sessions, or the newest results of the history.
func (a *Agent) query(q api.QueryRequest) api.OperationResult {
	limit := q.QueryLimit()
	switch q.What {
	case api.QuerySessions:
		ss, err := a.sessionList()
		if err != nil {
			return api.OperationResult{Error: err.Error()}
		}
		rep := &api.SessionsReply{Sessions: ss[:min(len(ss), limit)], Total: len(ss)}
		if rep.Sessions == nil {
			rep.Sessions = []api.Session{}
		}
		return api.OperationResult{Sessions: rep}
	case api.QueryHistory:
		if a.ctl == nil {
			return api.OperationResult{Error: errNoControl.Error()}
		}
		h := a.ctl.History()
		return api.OperationResult{Reply: &api.ReconfigReply{Results: h[max(0, len(h)-limit):]}}
	}
	return api.OperationResult{Error: fmt.Sprintf("query %q: this agent answers %q and %q", q.What, api.QuerySessions, api.QueryHistory)}
}

// hostAddrs lists this host's addresses of family fam (netlink.FAMILY_V4,
// _V6 or _ALL), IPv4 ones unmapped.
func hostAddrs(fam int) ([]netip.Addr, error) {
	addrs, err := netlink.AddrList(nil, fam)
	if err != nil {
		return nil, err
	}
	out := make([]netip.Addr, 0, len(addrs))
	for _, ad := range addrs {
		if ip, ok := netip.AddrFromSlice(ad.IP); ok {
			out = append(out, ip.Unmap())
		}
	}
	return out, nil
}

// ownAddr reports whether x is one of this host's addresses.
func (a *Agent) ownAddr(x netip.Addr) bool {
	fam := netlink.FAMILY_V4
	if x.Is6() {
		fam = netlink.FAMILY_V6
	}
	addrs, _ := hostAddrs(fam)
	return slices.Contains(addrs, x)
}

// selfAddr returns this host's session address of a family, or else its
// first global address of the family: the address other agents name it by
// in address lists.
func (a *Agent) selfAddr(v6 bool) netip.Addr {
	// A session address never changes: the agent's identity in its
	// requests (ReqKey) stays the same when the host moves.
	if s := a.sessionAddr(v6); s.IsValid() {
		return s
	}
	return a.nameAddr(v6)
}

// nameAddr returns this host's first global address of a family that is
// not a session address: the one other agents and operators can name it
// by in chains (--chain, --to).
func (a *Agent) nameAddr(v6 bool) netip.Addr {
	fam := netlink.FAMILY_V4
	if v6 {
		fam = netlink.FAMILY_V6
	}
	addrs, _ := hostAddrs(fam)
	var best netip.Addr
	for _, ip := range addrs {
		if ip.Is6() != v6 || !ip.IsGlobalUnicast() || a.isSessionAddr(ip) {
			continue
		}
		if !best.IsValid() || ip.Less(best) {
			best = ip
		}
	}
	return best
}
