package agent

// The local API's explicit rebind (dysco rebind): break before make on
// request, for the sessions this host is an end of (docs/mobility.md).

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"

	"github.com/dysco/dysco/internal/api"
	"github.com/dysco/dysco/internal/datapath"
	"github.com/dysco/dysco/internal/policy"
	"github.com/dysco/dysco/internal/protocol"
)

func (a *Agent) handleRebind(w http.ResponseWriter, r *http.Request) {
	var req api.RebindRequest
	if err := json.NewDecoder(http.MaxBytesReader(w, r.Body, 1<<16)).Decode(&req); err != nil {
		writeErr(w, 400, fmt.Errorf("rebind: bad JSON: %w", err))
		return
	}
	rep, err := a.rebind(r.Context(), req)
	if err != nil {
		writeErr(w, err.code, err)
		return
	}
	writeJSON(w, 200, rep)
}

// rebind moves the matching live sessions this host is an end of to
// req.Via, another of its addresses, by rebinds (the local API's POST
// /v1/rebind): the right side of those it starts, the left side of those
// that end here. Sessions of the other family than Via are left out.
func (a *Agent) rebind(ctx context.Context, req api.RebindRequest) (api.ReconfigReply, *requestError) {
	bad := func(err error) (api.ReconfigReply, *requestError) {
		return api.ReconfigReply{}, &requestError{400, err}
	}
	if a.ctl == nil {
		return api.ReconfigReply{}, &requestError{503, errNoControl}
	}
	via := req.Via.Unmap()
	ifs, _ := trafficIfaces()
	switch {
	case !via.IsValid():
		return bad(errors.New("rebind: no address to move to (via)"))
	case !a.ownAddr(via):
		return bad(fmt.Errorf("rebind: --via %s is not an address of this host", via))
	case !via.IsGlobalUnicast() || ifs[via] == 0:
		return bad(fmt.Errorf("rebind: --via %s is not a global address of an interface that carries traffic (not lo, not a dummy, not link-local)", via))
	}
	m, err := policy.CompileMatch(req.Match)
	if err != nil {
		return bad(err)
	}
	sessions, err := a.liveSessions(m, false, false)
	if err != nil {
		return api.ReconfigReply{}, &requestError{500, err}
	}
	bySide := map[protocol.Side][]uint32{}
	tuples := map[uint32]string{}
	for _, s := range sessions {
		t := s.Tuple.Wire()
		if t.Src.Unmap().Is4() != via.Is4() {
			continue
		}
		switch s.Role {
		case datapath.RoleStart:
			bySide[protocol.SideRight] = append(bySide[protocol.SideRight], s.ID)
		case datapath.RoleEnd, datapath.RoleEndFwd:
			bySide[protocol.SideLeft] = append(bySide[protocol.SideLeft], s.ID)
		default:
			continue // a middlebox's: it has no end to move
		}
		tuples[s.ID] = t.String()
	}
	ctx, cancel := context.WithTimeout(ctx, reconfigWait(req.TimeoutMS))
	defer cancel()
	// A session moved off its own address is rebound back to it if Via
	// goes (lostSessions).
	a.viaUsed.Store(true)
	rep := api.ReconfigReply{Results: []api.ReconfigResult{}}
	for _, side := range []protocol.Side{protocol.SideRight, protocol.SideLeft} {
		if len(bySide[side]) == 0 {
			continue
		}
		for _, o := range a.ctl.Rebind(ctx, bySide[side], side, via) {
			res := api.ReconfigResult{ID: o.ID, Session: tuples[o.ID], Outcome: o.Outcome, Reason: o.Reason, Micros: o.Took.Microseconds()}
			if o.Outcome == "succeeded" && o.Old == o.New {
				res.Unchanged, res.Reason = true, "unchanged"
			}
			rep.Results = append(rep.Results, res)
		}
	}
	return rep, nil
}
