package policyserver

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"sync"
	"time"

	"github.com/dysco/dysco/internal/api"
	"github.com/dysco/dysco/internal/certs"
	"github.com/dysco/dysco/internal/psclient"
)

// Operator verbs through the policy server (paper §2.3's use cases: take a
// middlebox out of its sessions, replace it, insert one, from one place).
// An operator POSTs an api.Operation naming an agent; the agent, which
// long-polls POST /v1/operations/claim beside its policy watch, claims it,
// carries it out exactly as a request to its local API, and PUTs the reply
// to /v1/operations/ID/result; the operator waits on GET
// /v1/operations/ID?wait=S. A server over bbolt keeps operations in memory
// only: they are commands of the moment, not configuration, and a restarted
// server has none (a waiting CLI then says the operation is gone). Replicas
// over etcd keep them in etcd (etcdops.go), so that the operator, the agent
// and the report may each use another replica.
//
// Nothing waits for ever: an operation its agent does not claim within
// claimTimeout fails, as does one claimed and not reported within its own
// timeout plus reportSlack (the agent died or lost the server meanwhile;
// the sessions' outcomes are then in the agent's `dysco reconfig history`).

// Bounds of the operations kept.
const (
	// maxActiveOps bounds the queued and running operations; more are refused (503).
	maxActiveOps = 1024
	// maxKeptOps bounds the finished operations kept for their operators;
	// the oldest go first.
	maxKeptOps = 1024
	// keepFinished is how long a finished operation stays readable, and
	// how long an agent that stopped polling is remembered.
	keepFinished = time.Hour
)

// maxSeenHosts bounds the agents remembered in ops.seen; when it is full,
// the one heard from least recently (and not polling now) is forgotten. A
// variable for tests.
var maxSeenHosts = 4096

// Timing of the operations; variables so that tests can shorten them.
var (
	// claimTimeout is how long a queued operation waits for its agent.
	claimTimeout = 15 * time.Second
	// reportSlack is how much longer than its own timeout a claimed
	// operation may take before it is declared lost (the agent gives up
	// reporting after psclient.ReportSlack).
	reportSlack = psclient.ReportSlack
	// seenWithin is how recently an agent must have polled for operations
	// (or be polling now) for new operations to be accepted for it.
	seenWithin = MaxWait + 15*time.Second
)

// opStore keeps the operations: in the server's memory (memOps, the
// default), or in etcd, shared by every replica (etcdOps). Errors other than
// the HTTP ones create and report return are the store's (a
// *NoQuorumError when etcd cannot serve).
type opStore interface {
	// create queues op for its agent, or says why not (with an HTTP status).
	create(ctx context.Context, op api.Operation) (api.Operation, int, error)
	// list returns the operations in creation order.
	list(ctx context.Context) ([]api.Operation, error)
	// get returns operation id (ok false when there is none) and a channel
	// closed by the next change of any operation.
	get(ctx context.Context, id string) (op api.Operation, ok bool, changed <-chan struct{}, err error)
	// claimNext runs the oldest operation queued for host and returns it;
	// with none (or ctx ended), ok is false and changed is closed by the
	// next change.
	claimNext(ctx context.Context, host string) (op api.Operation, ok bool, changed <-chan struct{}, err error)
	// report takes res as the result of operation id, or says why not;
	// caller, when set, is the authenticated agent, which may report only
	// its own operations (403).
	report(ctx context.Context, id string, res api.OperationResult, caller string) (int, error)
	// polling marks the start (true) and end of an agent's claim poll.
	polling(host string, start bool)
	close()
}

// memOps keeps the operations in memory: all fields under mu.
type memOps struct {
	mu      sync.Mutex
	epoch   string // this server run's prefix of operation IDs
	seq     uint64
	byID    map[string]*api.Operation
	order   []string             // creation order
	seen    map[string]time.Time // host -> end of its last claim poll
	polls   map[string]int       // host -> claim polls waiting now
	changed chan struct{}        // closed and replaced on every change
}

var _ opStore = (*memOps)(nil)

func newMemOps() *memOps {
	// IDs differ from one server run to the next, so that a result
	// reported late, to a restarted server, cannot land on another
	// operation that got the same number.
	return &memOps{epoch: strconv.FormatInt(time.Now().UnixMilli(), 36), byID: map[string]*api.Operation{}, seen: map[string]time.Time{}, polls: map[string]int{},
		changed: make(chan struct{})}
}

func (o *memOps) close() {}

// bump wakes every waiter. Under mu.
func (o *memOps) bump() {
	close(o.changed)
	o.changed = make(chan struct{})
}

// deadline is when a queued operation fails unclaimed, or a running one
// unreported; ok is false for a finished one.
func deadline(op *api.Operation) (time.Time, bool) {
	switch op.State {
	case api.OpQueued:
		return op.Created.Add(claimTimeout), true
	case api.OpRunning:
		return runDeadline(op, op.Claimed), true
	}
	return time.Time{}, false
}

// expired tells whether op is past its deadline at now, and if so fails
// it with the reason.
func expired(op *api.Operation, now time.Time) bool {
	d, ok := deadline(op)
	if !ok || now.Before(d) {
		return false
	}
	switch op.State {
	case api.OpQueued:
		op.Error = fmt.Sprintf("agent %q did not claim the operation within %s (is it running, with --policy-server pointing here?)", op.Host, claimTimeout)
	case api.OpRunning:
		op.Error = fmt.Sprintf("agent %q claimed the operation at %s but reported no result by %s (it may have stopped or lost this server; `dysco reconfig history` on the hosts shows what happened to the sessions)",
			op.Host, op.Claimed.Format(time.RFC3339), d.Format(time.RFC3339))
	}
	op.State, op.Finished = api.OpFailed, now
	return true
}

// finishWith ends op with res, an agent's report; the status and error say
// why not when the report is not taken.
func finishWith(op *api.Operation, id string, res api.OperationResult, caller string, now time.Time) (int, error) {
	if caller != "" && op.Host != caller {
		return http.StatusForbidden, fmt.Errorf("operation %s is for agent %q: the agent certificate %q may not report it", id, op.Host, caller)
	}
	if res.Host != op.Host {
		return http.StatusConflict, fmt.Errorf("operation %s is for agent %q, not %q", id, op.Host, res.Host)
	}
	if op.State != api.OpRunning {
		return http.StatusConflict, fmt.Errorf("operation %s is %s, not running: its result is not taken (%s)", id, op.State, op.Error)
	}
	if (op.Query != nil && op.Query.What == api.QuerySessions) != (res.Sessions != nil) && res.Error == "" {
		return http.StatusBadRequest, fmt.Errorf("operation %s: the result's kind does not answer the operation's request", id)
	}
	if res.Error != "" {
		op.State, op.Error = api.OpFailed, fmt.Sprintf("agent %q: %s", op.Host, res.Error)
	} else {
		op.State, op.Reply, op.Sessions = api.OpDone, res.Reply, res.Sessions
	}
	op.Finished = now
	return 0, nil
}

// active counts the queued and running operations. Under mu.
func (o *memOps) active() int {
	n := 0
	for _, op := range o.byID {
		if !op.IsFinished() {
			n++
		}
	}
	return n
}

// expire fails the operations past their deadline and forgets old finished
// ones. Under mu.
func (o *memOps) expire(now time.Time) {
	for _, op := range o.byID {
		if expired(op, now) {
			o.bump()
		}
	}
	// Agents not heard from for a while are forgotten (a bound on the map
	// for any number of names polled).
	for h, t := range o.seen {
		if o.polls[h] == 0 && now.Sub(t) > keepFinished {
			delete(o.seen, h)
		}
	}
	// Finished operations: the oldest beyond maxKeptOps, and any older than keepFinished.
	finished := 0
	for _, id := range o.order {
		if o.byID[id].IsFinished() {
			finished++
		}
	}
	keep := o.order[:0]
	for _, id := range o.order {
		op := o.byID[id]
		if op.IsFinished() && (finished > maxKeptOps || now.Sub(op.Finished) > keepFinished) {
			finished--
			delete(o.byID, id)
			continue
		}
		keep = append(keep, id)
	}
	o.order = keep
}

// see records that host polled at now, forgetting the agent heard from
// least recently (not polling now) when the table is full. Under mu.
func (o *memOps) see(host string, now time.Time) {
	if _, ok := o.seen[host]; !ok && len(o.seen) >= maxSeenHosts {
		o.expire(now)
		for len(o.seen) >= maxSeenHosts {
			oldest, at := "", time.Time{}
			for h, t := range o.seen {
				if o.polls[h] == 0 && (oldest == "" || t.Before(at)) {
					oldest, at = h, t
				}
			}
			if oldest == "" {
				break // all polling now: bounded by the connections
			}
			delete(o.seen, oldest)
		}
	}
	o.seen[host] = now
}

func (o *memOps) polling(host string, start bool) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if start {
		o.polls[host]++
		return
	}
	if o.polls[host]--; o.polls[host] <= 0 {
		delete(o.polls, host)
	}
	o.see(host, time.Now())
}

// runDeadline is when a claimed operation must have been reported.
func runDeadline(op *api.Operation, claimed time.Time) time.Time {
	return claimed.Add(psclient.OpTimeout(op) + reportSlack)
}

func (s *Server) handleCreateOp(w http.ResponseWriter, r *http.Request) {
	var op api.Operation
	if err := decodeBody(r, w, &op, "operation"); err != nil {
		writeError(w, http.StatusBadRequest, err)
		return
	}
	if op.ID != "" || op.State != "" || op.Error != "" || op.Reply != nil || op.Sessions != nil || !op.Created.IsZero() || !op.Claimed.IsZero() || !op.Finished.IsZero() {
		writeError(w, http.StatusBadRequest, errors.New("operation: id, state, error, reply and times are the server's to set; send host and one of reconfig and middlebox"))
		return
	}
	if err := op.Validate(); err != nil {
		writeError(w, http.StatusBadRequest, err)
		return
	}
	if s.cfg.ValidateMatch != nil && op.Query == nil {
		if err := s.cfg.ValidateMatch(op.Match()); err != nil {
			writeError(w, http.StatusBadRequest, fmt.Errorf("operation: match: %w", err))
			return
		}
	}
	stored, code, err := s.ops.create(r.Context(), op)
	if err != nil {
		writeError(w, storeCode(code, err), err)
		return
	}
	s.log.Info("operation queued", "id", stored.ID, "host", stored.Host, "kind", psclient.OpKind(&stored))
	writeJSON(w, http.StatusCreated, stored)
}

// storeCode is the HTTP status of err: code when the store set one, 503
// when etcd has no quorum, else 500.
func storeCode(code int, err error) int {
	var nq *NoQuorumError
	switch {
	case code != 0:
		return code
	case errors.As(err, &nq):
		return http.StatusServiceUnavailable
	}
	return http.StatusInternalServerError
}

// create implements opStore.
func (o *memOps) create(_ context.Context, op api.Operation) (api.Operation, int, error) {
	now := time.Now()
	o.mu.Lock()
	defer o.mu.Unlock()
	o.expire(now)
	if o.polls[op.Host] == 0 {
		last, ok := o.seen[op.Host]
		if !ok {
			return op, http.StatusConflict, fmt.Errorf("no agent named %q has asked this policy server for operations (agents take operations when started with --policy-server; the name is the agent's --name)", op.Host)
		}
		if now.Sub(last) > seenWithin {
			return op, http.StatusConflict, fmt.Errorf("agent %q has not asked this policy server for operations since %s (%s ago): is it running, or busy with as many operations as it runs at once?", op.Host, last.Format(time.RFC3339), now.Sub(last).Round(time.Second))
		}
	}
	if n := o.active(); n >= maxActiveOps {
		return op, http.StatusServiceUnavailable, fmt.Errorf("%d operations are queued or running; try again when some have finished", n)
	}
	o.seq++
	op.ID = "op-" + o.epoch + "-" + strconv.FormatUint(o.seq, 10)
	op.State, op.Created = api.OpQueued, now
	stored := op
	o.byID[op.ID] = &stored
	o.order = append(o.order, op.ID)
	o.bump()
	return stored, 0, nil
}

// list implements opStore.
func (o *memOps) list(context.Context) ([]api.Operation, error) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.expire(time.Now())
	out := make([]api.Operation, 0, len(o.order))
	for _, id := range o.order {
		out = append(out, *o.byID[id])
	}
	return out, nil
}

// get implements opStore.
func (o *memOps) get(_ context.Context, id string) (api.Operation, bool, <-chan struct{}, error) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.expire(time.Now())
	op, ok := o.byID[id]
	if !ok {
		return api.Operation{}, false, o.changed, nil
	}
	return *op, true, o.changed, nil
}

// claimNext implements opStore.
func (o *memOps) claimNext(ctx context.Context, host string) (api.Operation, bool, <-chan struct{}, error) {
	now := time.Now()
	o.mu.Lock()
	defer o.mu.Unlock()
	o.expire(now)
	if ctx.Err() == nil { // else the agent went away: leave it for its next poll
		for _, id := range o.order {
			if op := o.byID[id]; op.Host == host && op.State == api.OpQueued {
				op.State, op.Claimed = api.OpRunning, now
				o.bump()
				return *op, true, nil, nil
			}
		}
	}
	return api.Operation{}, false, o.changed, nil
}

// report implements opStore.
func (o *memOps) report(_ context.Context, id string, res api.OperationResult, caller string) (int, error) {
	now := time.Now()
	o.mu.Lock()
	defer o.mu.Unlock()
	o.expire(now)
	op, ok := o.byID[id]
	if !ok {
		return http.StatusNotFound, fmt.Errorf("no operation %q here", id)
	}
	code, err := finishWith(op, id, res, caller, now)
	if err == nil {
		o.bump()
	}
	return code, err
}

func (s *Server) handleListOps(w http.ResponseWriter, r *http.Request) {
	out, err := s.ops.list(r.Context())
	if err != nil {
		writeError(w, storeCode(0, err), err)
		return
	}
	writeJSON(w, http.StatusOK, out)
}

// waitParam reads the wait=SECONDS parameter (0 when absent), at most MaxWait.
func waitParam(r *http.Request) (time.Duration, error) {
	v := r.URL.Query().Get("wait")
	if v == "" {
		return 0, nil
	}
	n, err := strconv.Atoi(v)
	if err != nil || n < 0 {
		return 0, fmt.Errorf("wait=%q is not a number of seconds", v)
	}
	return waitSeconds(n), nil
}

// waitSeconds is a wait of n seconds (n >= 0) as a client asks for it, at
// most MaxWait (and no overflow for a huge n).
func waitSeconds(n int) time.Duration {
	return time.Duration(min(n, int(MaxWait/time.Second))) * time.Second
}

// Outcomes of waitOps.
const (
	opsChanged = iota // something changed (or a second passed): look again
	opsTimeout        // the wait is over: answer with what there is
	opsGone           // the request ended, or the server stops (answered)
)

// waitOps waits for a change of the operations, a tick (deadlines pass
// without a change), the end of the wait, of the request, or of the server.
func (s *Server) waitOps(w http.ResponseWriter, r *http.Request, changed <-chan struct{}, timer, tick <-chan time.Time) int {
	select {
	case <-changed:
		return opsChanged
	case <-tick:
		return opsChanged
	case <-timer:
		return opsTimeout
	case <-r.Context().Done():
		return opsGone
	case <-s.closing:
		writeError(w, http.StatusServiceUnavailable, errors.New("policy server is shutting down"))
		return opsGone
	}
}

// handleGetOp returns an operation; with wait=S it answers when the
// operation finishes or S seconds have passed.
func (s *Server) handleGetOp(w http.ResponseWriter, r *http.Request) {
	id := r.PathValue("id")
	wait, err := waitParam(r)
	if err != nil {
		writeError(w, http.StatusBadRequest, err)
		return
	}
	timer := time.NewTimer(wait)
	defer timer.Stop()
	// Deadlines pass without a change: look again every second.
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	for {
		cur, ok, changed, err := s.ops.get(r.Context(), id)
		if err != nil {
			writeError(w, storeCode(0, err), err)
			return
		}
		if !ok {
			writeError(w, http.StatusNotFound, fmt.Errorf("no operation %q here (%s)", id, s.opsKept()))
			return
		}
		if cur.IsFinished() || wait == 0 {
			writeJSON(w, http.StatusOK, cur)
			return
		}
		switch s.waitOps(w, r, changed, timer.C, tick.C) {
		case opsTimeout:
			writeJSON(w, http.StatusOK, cur)
			return
		case opsGone:
			return
		}
	}
}

// opsKept says for how long operations are kept, for a 404.
func (s *Server) opsKept() string {
	if _, ok := s.ops.(*memOps); ok {
		return "operations are kept in memory for an hour after they finish; was the policy server restarted?"
	}
	return "operations are kept in etcd for an hour after they finish"
}

// handleClaimOp is the agents' long poll for operations: it answers with
// the oldest queued operation for host (now running), or 204 when none
// came within the wait.
func (s *Server) handleClaimOp(w http.ResponseWriter, r *http.Request) {
	host, ok := s.agentHost(w, r, "claim")
	if !ok {
		return
	}
	wait, err := waitParam(r)
	if err != nil {
		writeError(w, http.StatusBadRequest, err)
		return
	}
	// The poll is over (for the agents seen polling) before the answer
	// goes out.
	code, op, err := s.claim(w, r, host, wait)
	switch code {
	case 0: // answered (server stopping) or the agent went away
	case http.StatusOK:
		s.log.Info("operation claimed", "id", op.ID, "host", host)
		writeJSON(w, code, op)
	case http.StatusNoContent:
		w.WriteHeader(code)
	default:
		writeError(w, code, err)
	}
}

// claim waits for an operation for host; it returns 200 and the operation
// now running, 204 when none came within wait, an error status and the
// error when the store fails, or 0 when the request ended or the server
// stops (answered).
func (s *Server) claim(w http.ResponseWriter, r *http.Request, host string, wait time.Duration) (int, api.Operation, error) {
	s.ops.polling(host, true)
	defer s.ops.polling(host, false)
	timer := time.NewTimer(wait)
	defer timer.Stop()
	for {
		// No tick: an operation past its deadline is failed, not
		// claimed, when the store is read; only changes matter here.
		op, ok, changed, err := s.ops.claimNext(r.Context(), host)
		switch {
		case err != nil:
			return storeCode(0, err), api.Operation{}, err
		case ok:
			return http.StatusOK, op, nil
		case wait == 0:
			return http.StatusNoContent, api.Operation{}, nil
		}
		switch s.waitOps(w, r, changed, timer.C, nil) {
		case opsTimeout:
			return http.StatusNoContent, api.Operation{}, nil
		case opsGone:
			return 0, api.Operation{}, nil
		}
	}
}

// handleReportOp takes an agent's result for an operation it claimed.
func (s *Server) handleReportOp(w http.ResponseWriter, r *http.Request) {
	id := r.PathValue("id")
	// A reply has a line per session (a busy firewall: thousands), and
	// may come from a newer agent with fields this server does not know.
	var res api.OperationResult
	dec := json.NewDecoder(http.MaxBytesReader(w, r.Body, maxResultBody))
	if err := dec.Decode(&res); err != nil {
		code := http.StatusBadRequest
		var tooBig *http.MaxBytesError
		if errors.As(err, &tooBig) {
			code = http.StatusRequestEntityTooLarge
		}
		writeError(w, code, fmt.Errorf("request body is not a valid operation result: %v", err))
		return
	}
	if res.Answers() != 1 {
		writeError(w, http.StatusBadRequest, errors.New("operation result: give exactly one of error, reply and sessions"))
		return
	}
	caller := ""
	if id := identity(r); id.Role == certs.RoleAgent {
		// An agent reports for itself only: the host is its certificate's.
		if res.Host != "" && res.Host != id.Name {
			s.refuse(w, r, route(r), http.StatusForbidden, reasonOtherHost,
				fmt.Errorf("operation result: the agent certificate %q may not report for host %q", id.Name, res.Host))
			return
		}
		res.Host, caller = id.Name, id.Name
	}
	code, err := s.ops.report(r.Context(), id, res, caller)
	if code == http.StatusForbidden {
		s.refuse(w, r, route(r), code, reasonOtherHost, err)
		return
	}
	if err != nil {
		writeError(w, storeCode(code, err), err)
		return
	}
	s.log.Info("operation finished", "id", id, "host", res.Host, "err", res.Error)
	w.WriteHeader(http.StatusNoContent)
}

// maxResultBody bounds an agent's report (api.Client reads up to 16 MiB);
// a variable for tests.
var maxResultBody int64 = 16 << 20
