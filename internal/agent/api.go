package agent

import (
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"slices"
	"sort"
	"strings"
	"time"

	"github.com/dysco/dysco/internal/api"
	"github.com/dysco/dysco/internal/datapath"
	"github.com/dysco/dysco/internal/protocol"
	"github.com/dysco/dysco/internal/wire"
)

// Version is the agent's version string.
var Version = "0.1.0-dev"

// WireVersion is Version with the versions of the SYN block and the
// control messages this agent speaks: agents that differ in those cannot
// chain or reconfigure sessions together (an upgrade is all at once). The
// agent gives it to the policy server with its polls.
func WireVersion() string {
	return fmt.Sprintf("%s (block %d, control %d)", Version, wire.Version, protocol.MsgVersion)
}

// serveAPI serves the local API (HTTP/JSON) on the abstract Unix socket. Only
// root may use it: the peer's credentials are checked on every connection.
func (a *Agent) serveAPI() (*http.Server, error) {
	ln, err := net.Listen("unix", a.cfg.Socket)
	if err != nil {
		return nil, fmt.Errorf("agent: local API on %s: %w (is another agent running in this network namespace?)", a.cfg.Socket, err)
	}
	srv := &http.Server{Handler: a.apiMux(), ReadHeaderTimeout: 5 * time.Second}
	go srv.Serve(&rootOnly{Listener: ln, log: a.log, refused: &a.apiRefused})
	return srv, nil
}

// apiMux routes the local API's requests to their handlers.
func (a *Agent) apiMux() *http.ServeMux {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /v1/status", a.handleStatus)
	mux.HandleFunc("GET /v1/sessions", a.handleSessions)
	mux.HandleFunc("GET /v1/policies", a.handlePolicies)
	mux.HandleFunc("PUT /v1/policies/{name}", a.handlePutPolicy)
	mux.HandleFunc("DELETE /v1/policies/{name}", a.handleDeletePolicy)
	mux.HandleFunc("PUT /v1/types/{name}", a.handlePutType)
	mux.HandleFunc("DELETE /v1/types/{name}", a.handleDeleteType)
	mux.HandleFunc("POST /v1/sessions/prepend", a.handlePrepend)
	mux.HandleFunc("POST /v1/reconfig", a.handleReconfig)
	mux.HandleFunc("POST /v1/rebind", a.handleRebind)
	mux.HandleFunc("GET /v1/reconfig/history", a.handleReconfigHistory)
	mux.HandleFunc("POST /v1/middlebox", a.handleMiddlebox)
	mux.HandleFunc("POST /v1/sessions/splice", a.handleSplice)
	if a.providers != nil {
		mux.Handle("/v1/state/", a.providers.Handler())
	}
	return mux
}

func writeJSON(w http.ResponseWriter, code int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	_ = json.NewEncoder(w).Encode(v)
}

func writeErr(w http.ResponseWriter, code int, err error) {
	writeJSON(w, code, api.Error{Error: err.Error()})
}

func (a *Agent) handleStatus(w http.ResponseWriter, r *http.Request) {
	st, err := a.dp.Stats()
	if err != nil {
		writeErr(w, 500, err)
		return
	}
	st["agent_reroutes_settled"] = a.rerouteCleared.Load()
	// Capacity of the session maps (--max-sessions).
	st["capacity_sessions"], st["capacity_flows"] = uint64(a.dp.Sizing.Sessions), uint64(a.dp.Sizing.Flows)
	if a.ctl != nil {
		for k, v := range a.ctl.Counters() {
			st[k] = v
		}
		if a.ctl.Holds() {
			// What is left of the lease by which the datapath hands
			// packets straddling a cut-off to this agent (renewed
			// every second).
			if left, err := a.dp.SplitReaderLease(); err == nil {
				st["split_lease_ms"] = uint64(left / time.Millisecond)
			}
		}
	}
	st["api_refused_peers"] = a.apiRefused.Load()
	st["policies_refused_unchained"] = a.refusedUnchained.Load()
	st["policies_refused_filter"] = a.refusedFilter.Load()
	var keyIDs []string
	if a.keys != nil {
		keyIDs = a.keys.Ring().IDs()
		st["control_key_reloads"] = a.keys.Reloads()
		st["control_key_reload_errors"] = a.keys.Errors()
	}
	sess, _ := a.dp.Sessions()
	a.mu.Lock()
	out := api.Status{ControlKeys: keyIDs,
		Name: a.cfg.Name, Version: Version, Started: a.started, PinDir: a.cfg.PinDir, Attach: a.dp.Attach,
		Tap: a.cfg.Tap, TapActive: a.tapActive.Load(), Sessions: len(sess), PolicyVersion: a.serverInForce, PolicyServer: a.cfg.PolicyServer,
		PolicyServerOK: a.serverOK, Counters: st, Admission: a.admission(),
	}
	a.mu.Unlock()
	out.Ifaces = a.ifaceList()
	for _, v6 := range []bool{false, true} {
		if s := a.nameAddr(v6); s.IsValid() {
			out.Addrs = append(out.Addrs, s.String())
		}
	}
	a.mu.Lock()
	for sa, loc := range a.locators {
		if out.Locators == nil {
			out.Locators = map[string]string{}
		}
		out.Locators[sa.String()] = loc.String()
	}
	a.mu.Unlock()
	out.Forwarding = a.fwd.Load()
	if a.nfs != nil {
		for _, f := range a.nfs.Status() {
			out.NFs = append(out.NFs, api.NFStatus{Name: f.Name, State: string(f.State), PID: f.PID, StartedAt: f.StartedAt,
				Sessions: f.Sessions, Starts: f.Starts, Exits: f.Exits, Failures: f.Failures, LastError: f.LastError})
		}
	}
	writeJSON(w, 200, out)
}

func (a *Agent) handleSessions(w http.ResponseWriter, r *http.Request) {
	out, err := a.sessionList()
	if err != nil {
		writeErr(w, 500, err)
		return
	}
	writeJSON(w, 200, out)
}

// sessionList joins sessions with their flows: the ingress flow of a SYN's
// block is the left subsession, the egress flow that emitted the block the
// right one.
func (a *Agent) sessionList() ([]api.Session, error) {
	sessions, err := a.dp.Sessions()
	if err != nil {
		return nil, err
	}
	flows, err := a.dp.Flows()
	if err != nil {
		return nil, err
	}
	role := make(map[uint32]uint8, len(sessions))
	for _, s := range sessions {
		role[s.ID] = s.Role
	}
	left := map[uint32]string{}
	right := map[uint32]string{}
	// A rebind leaves the old left subsession's ingress flow for a while
	// (docs/protocol.md, "Rebinds"): all of them, to pick the current one.
	ingress := map[uint32][]datapath.Tuple{}
	// Ages from the datapath's stamps, at a now read after them (datapath.Age).
	now := datapath.Now()
	type tally struct {
		packets, bytes [2]uint64
		idle           time.Duration // since the latest packet
	}
	counts := make(map[uint32]*tally, len(sessions))
	reconfigured := map[uint32]bool{} // sessions with a two-path record
	for _, f := range flows {
		if f.Flags&datapath.FlTPOut != 0 {
			reconfigured[f.SessId] = true
		}
		// The ingress flow of the SYN's direction comes from the left
		// subsession; the egress flow of that direction goes to the right
		// one (a reconfigured side's current subsession is in its two-path
		// record, below).
		switch {
		case f.Dir() != 0 || f.Flags&(datapath.FlTPNew|datapath.FlDrop) != 0:
		case f.Flags&datapath.FlIngress != 0:
			left[f.SessId] = f.Key.String()
			ingress[f.SessId] = append(ingress[f.SessId], f.Key)
		default:
			right[f.SessId] = f.Out.String()
		}
		t := counts[f.SessId]
		if t == nil {
			t = &tally{idle: datapath.StampRange}
			counts[f.SessId] = t
		}
		if datapath.Counted(f.Flow, role[f.SessId]) {
			t.packets[f.Dir()] += f.Packets
			t.bytes[f.Dir()] += f.Bytes
		}
		t.idle = min(t.idle, datapath.Age(now, f.LastMs))
	}
	a.mu.Lock()
	eff := a.slotPolicy
	a.mu.Unlock()
	var views map[uint32]protocol.SessionView
	if a.ctl != nil {
		views = a.ctl.Views()
	}
	synHops, err := a.dp.AllSynHops()
	if err != nil {
		return nil, err
	}
	out := make([]api.Session, 0, len(sessions))
	for _, s := range sessions {
		t := counts[s.ID]
		if t == nil {
			t = &tally{idle: datapath.StampRange}
		}
		if v, ok := views[s.ID]; ok && v.Sides[0] != nil && len(ingress[s.ID]) > 1 {
			if k := datapath.TupleOf(v.Sides[0].Sub, s.Proto); slices.Contains(ingress[s.ID], k) {
				left[s.ID] = k.String()
			}
		}
		var sides []api.TwoPathSide
		if reconfigured[s.ID] {
			for side := uint32(0); side < 2; side++ {
				tp, ok := a.dp.TwoPath(datapath.TPKey{SessId: s.ID, Side: side})
				if !ok {
					continue
				}
				if tp.State == datapath.TPNew {
					if side == 0 {
						left[s.ID] = tp.NewOut.Wire().Reverse().String()
					} else {
						right[s.ID] = tp.NewOut.String()
					}
					continue
				}
				sides = append(sides, twoPathSide(side, tp))
			}
		}
		as := api.Session{
			ID: s.ID, Session: s.Tuple.String(), Proto: datapath.ProtoName(s.Proto), Left: left[s.ID], Right: right[s.ID],
			Role: datapath.RoleName(s.Role), State: datapath.StateName(s.State),
			PacketsFwd: t.packets[0], BytesFwd: t.bytes[0], PacketsRev: t.packets[1], BytesRev: t.bytes[1],
			AgeSeconds:  datapath.Age(now, s.CreatedMs).Seconds(),
			IdleSeconds: min(datapath.Age(now, s.LastMs), t.idle).Seconds(),
			TwoPath:     sides,
		}
		if v, ok := views[s.ID]; ok {
			as.Lock, as.Queued = v.Lock.String(), v.Queued
			for _, an := range []*protocol.AnchorView{v.Left, v.Right} {
				if an != nil {
					as.Reconfig = an.Role.String() + ":" + an.Stage.String()
				}
			}
		}
		if name, ok := eff[int(s.Policy)]; ok && s.Policy > 0 {
			as.Policy = name
		}
		if hops, ok := synHops[s.ID]; ok {
			for _, h := range hops {
				as.Chain = append(as.Chain, h.String())
			}
		}
		out = append(out, as)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].ID < out[j].ID })
	return out, nil
}

// twoPathSide reports a side's two-path record (not yet TPNew).
func twoPathSide(side uint32, tp datapath.TPVal) api.TwoPathSide {
	st := "idle"
	switch {
	case tp.State == datapath.TPActive:
		st = "active"
	case tp.State == datapath.TPStarting:
		st = "starting"
	case tp.Armed != 0:
		st = "armed"
	}
	return api.TwoPathSide{Side: protocol.Side(side).String(), State: st,
		OldSent: tp.OldSent, OldRcvd: tp.OldRcvd, OldSentAcked: tp.OldSentAcked, OldRcvdAcked: tp.OldRcvdAcked,
		FirstNewRcvd: tp.FirstNewRcvd, NewRcvd: tp.NewRcvd != 0, ToOld: tp.ToOld, ToNew: tp.ToNew}
}

func (a *Agent) handlePolicies(w http.ResponseWriter, r *http.Request) {
	a.mu.Lock()
	pols, types := effectiveSet(a.local, a.server)
	v := a.server.Version
	a.mu.Unlock()
	writeJSON(w, 200, api.PolicySet{Version: v, Policies: pols, Types: types})
}

func (a *Agent) handlePutPolicy(w http.ResponseWriter, r *http.Request) {
	var p api.Policy
	if err := json.NewDecoder(http.MaxBytesReader(w, r.Body, 1<<20)).Decode(&p); err != nil {
		writeErr(w, 400, fmt.Errorf("policy: bad JSON: %w", err))
		return
	}
	name := r.PathValue("name")
	if p.Name == "" {
		p.Name = name
	}
	if p.Name != name {
		writeErr(w, 400, fmt.Errorf("policy name %q in the body differs from %q in the path", p.Name, name))
		return
	}
	if _, err := a.compilePolicy(p); err != nil {
		writeErr(w, 400, err)
		return
	}
	a.mu.Lock()
	_, types := effectiveSet(a.local, a.server)
	a.mu.Unlock()
	idx := map[string]int{}
	for i, t := range types {
		idx[t.Name] = i
	}
	if _, err := resolveChain(p, idx); err != nil {
		writeErr(w, 400, err)
		return
	}
	err := a.changeLocal(func(l *api.PolicySet) bool {
		l.Policies = upsert(l.Policies, p, func(p api.Policy) string { return p.Name })
		return true
	})
	if err != nil {
		writeErr(w, 500, err)
		return
	}
	a.log.Info("policy added", "name", p.Name, "filter", p.Filter, "chain", hopsString(p.Chain))
	writeJSON(w, 200, p)
}

func hopsString(hs []api.Hop) string {
	var s []string
	for _, h := range hs {
		s = append(s, h.String())
	}
	return strings.Join(s, ",")
}

func (a *Agent) handleDeletePolicy(w http.ResponseWriter, r *http.Request) {
	name := r.PathValue("name")
	err := a.changeLocal(func(l *api.PolicySet) (found bool) {
		l.Policies, found = without(l.Policies, name, func(p api.Policy) string { return p.Name })
		return found
	})
	if err == errNotFound {
		err = fmt.Errorf("policy %q: no such local policy (policies from the policy server are removed there)", name)
		writeErr(w, 404, err)
		return
	}
	if err != nil {
		writeErr(w, 500, err)
		return
	}
	w.WriteHeader(204)
}

func (a *Agent) handlePutType(w http.ResponseWriter, r *http.Request) {
	var t api.MiddleboxType
	if err := json.NewDecoder(http.MaxBytesReader(w, r.Body, 1<<20)).Decode(&t); err != nil {
		writeErr(w, 400, fmt.Errorf("type: bad JSON: %w", err))
		return
	}
	if t.Name == "" {
		t.Name = r.PathValue("name")
	}
	if t.Name != r.PathValue("name") {
		writeErr(w, 400, errors.New("type name in the body differs from the path"))
		return
	}
	if err := t.Validate(); err != nil {
		writeErr(w, 400, err)
		return
	}
	err := a.changeLocal(func(l *api.PolicySet) bool {
		l.Types = upsert(l.Types, t, func(t api.MiddleboxType) string { return t.Name })
		return true
	})
	if err != nil {
		writeErr(w, 500, err)
		return
	}
	writeJSON(w, 200, t)
}

func (a *Agent) handleDeleteType(w http.ResponseWriter, r *http.Request) {
	name := r.PathValue("name")
	var inUse error
	err := a.changeLocal(func(l *api.PolicySet) bool {
		rest, found := without(slices.Clone(l.Types), name, func(t api.MiddleboxType) string { return t.Name })
		if !found {
			return false
		}
		if inUse = typeInUse(api.PolicySet{Policies: l.Policies, Types: rest}, a.server, name); inUse != nil {
			return false
		}
		l.Types = rest
		return true
	})
	if inUse != nil {
		writeErr(w, 409, inUse)
		return
	}
	if err == errNotFound {
		writeErr(w, 404, fmt.Errorf("type %q: no such local type", name))
		return
	}
	if err != nil {
		writeErr(w, 500, err)
		return
	}
	w.WriteHeader(204)
}

// typeInUse tells, as an *api.TypeInUseError, whether the effective
// policies of local and server still name the type typ when neither defines
// it: their sessions would lose a middlebox of their chain.
func typeInUse(local, server api.PolicySet, typ string) error {
	pols, types := effectiveSet(local, server)
	for _, t := range types {
		if t.Name == typ {
			return nil // the server's type of that name takes over
		}
	}
	if users := api.PoliciesUsingType(pols, typ); len(users) > 0 {
		return &api.TypeInUseError{Type: typ, Policies: users}
	}
	return nil
}

// errNotFound is changeLocal's answer when its change found nothing to do.
var errNotFound = errors.New("not found")

// changeLocal applies change to the local policies and types under the lock;
// if it changed something (returned true), it saves them and applies the
// effective set to the datapath.
func (a *Agent) changeLocal(change func(*api.PolicySet) bool) error {
	a.mu.Lock()
	old := api.PolicySet{Version: a.local.Version, Policies: slices.Clone(a.local.Policies), Types: slices.Clone(a.local.Types)}
	if !change(&a.local) {
		a.mu.Unlock()
		return errNotFound
	}
	err := a.saveLocal()
	a.mu.Unlock()
	if err != nil {
		return err
	}
	err = a.applyPolicies()
	var na *notInForceError
	if errors.As(err, &na) {
		// All or nothing: the set in force stayed, so do the local
		// policies.
		a.mu.Lock()
		a.local = old
		if serr := a.saveLocal(); serr != nil {
			err = errors.Join(err, serr)
		}
		a.mu.Unlock()
		return fmt.Errorf("the change is undone, the policies in force stay: %w", err)
	}
	return err
}

// upsert replaces the item of list with item's name, or appends item.
func upsert[T any](list []T, item T, name func(T) string) []T {
	for i := range list {
		if name(list[i]) == name(item) {
			list[i] = item
			return list
		}
	}
	return append(list, item)
}

// without removes the item called n from list.
func without[T any](list []T, n string, name func(T) string) ([]T, bool) {
	kept := list[:0]
	found := false
	for _, x := range list {
		if name(x) == n {
			found = true
			continue
		}
		kept = append(kept, x)
	}
	return kept, found
}

// handlePrepend lets a middlebox (a classifier) choose the next middleboxes
// of a session whose SYN it holds (paper §2.2).
func (a *Agent) handlePrepend(w http.ResponseWriter, r *http.Request) {
	var req api.PrependRequest
	if err := json.NewDecoder(http.MaxBytesReader(w, r.Body, 1<<16)).Decode(&req); err != nil {
		writeErr(w, 400, fmt.Errorf("prepend: bad JSON: %w", err))
		return
	}
	t, err := wire.ParseTuple(req.Session)
	if err != nil {
		writeErr(w, 400, err)
		return
	}
	if len(req.Hops) == 0 {
		writeErr(w, 400, errors.New("prepend: no hops given"))
		return
	}
	id, err := a.dp.SessionIDByTuple(t)
	if err != nil {
		writeErr(w, 404, err)
		return
	}
	chain, err := a.dp.PrependHops(id, req.Hops)
	if errors.Is(err, datapath.ErrTooLate) {
		writeErr(w, 409, fmt.Errorf("session %s: %w", t, err))
		return
	}
	if err != nil {
		writeErr(w, 400, err)
		return
	}
	out := api.PrependReply{ID: id}
	for _, h := range chain {
		out.Chain = append(out.Chain, h.String())
	}
	a.log.Info("hops prepended", "session", t.String(), "chain", out.Chain)
	writeJSON(w, 200, out)
}
