package policyserver

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/netip"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/dysco/dysco/internal/api"
	"github.com/dysco/dysco/internal/psclient"
)

// shorten sets the operations' timing for one test.
func shorten(t *testing.T, claim, slack time.Duration) {
	t.Helper()
	oc, os, ow := claimTimeout, reportSlack, seenWithin
	claimTimeout, reportSlack = claim, slack
	t.Cleanup(func() { claimTimeout, reportSlack, seenWithin = oc, os, ow })
}

func mbRemove(host string, timeoutMS int) api.Operation {
	return api.Operation{Host: host, Middlebox: &api.MiddleboxRequest{Match: "tcp", TimeoutMS: timeoutMS}}
}

// A whole round: the operator creates, the agent claims and reports, the
// operator's wait returns the reply.
func TestOperationRoundTrip(t *testing.T) {
	ts := startServer(t, Config{})
	c := api.NewServerClient(ts.url)
	ctx := t.Context()

	// No agent has polled yet: refused, with the reason.
	_, err := c.CreateOperation(ctx, mbRemove("mb1", 0))
	var he *api.HTTPError
	if !errors.As(err, &he) || he.StatusCode != 409 || !strings.Contains(he.Message, `no agent named "mb1"`) {
		t.Fatalf("operation for an unknown agent: %v, want 409 no agent named", err)
	}

	// The agent polls (nothing yet), then waits in a second poll.
	if _, ok, err := c.ClaimOperation(ctx, "mb1", 0); err != nil || ok {
		t.Fatalf("empty claim: ok %v err %v", ok, err)
	}
	claimed := make(chan api.Operation, 1)
	go func() {
		op, ok, err := c.ClaimOperation(ctx, "mb1", 20*time.Second)
		if err != nil || !ok {
			t.Errorf("claim: ok %v err %v", ok, err)
			close(claimed)
			return
		}
		claimed <- op
	}()
	op, err := c.CreateOperation(ctx, mbRemove("mb1", 2000))
	if err != nil {
		t.Fatal(err)
	}
	if op.ID == "" || op.State != api.OpQueued || op.Created.IsZero() {
		t.Fatalf("created: %+v", op)
	}
	got := <-claimed
	if got.ID != op.ID || got.State != api.OpRunning || got.Middlebox == nil || got.Middlebox.TimeoutMS != 2000 {
		t.Fatalf("claimed %+v, want %s running with its request", got, op.ID)
	}
	// A second agent's poll does not get it.
	if _, ok, _ := c.ClaimOperation(ctx, "mb2", 0); ok {
		t.Fatal("another agent claimed mb1's operation")
	}

	// The operator waits; the agent reports meanwhile.
	waited := make(chan api.Operation, 1)
	go func() {
		o, err := c.Operation(ctx, op.ID, 20*time.Second)
		if err != nil {
			t.Error(err)
		}
		waited <- o
	}()
	rep := &api.ReconfigReply{Results: []api.ReconfigResult{{ID: 7, Session: "10.0.0.1:1 -> 10.0.0.2:2", Outcome: "succeeded"}}}
	// Only the agent the operation is for may report it.
	err = c.ReportOperation(ctx, op.ID, api.OperationResult{Host: "mb2", Reply: rep})
	if !errors.As(err, &he) || he.StatusCode != 409 || !strings.Contains(he.Message, `is for agent "mb1", not "mb2"`) {
		t.Fatalf("report by another agent: %v, want 409", err)
	}
	if err := c.ReportOperation(ctx, op.ID, api.OperationResult{Host: "mb1", Reply: rep}); err != nil {
		t.Fatal(err)
	}
	done := <-waited
	if done.State != api.OpDone || done.Reply == nil || len(done.Reply.Results) != 1 || done.Reply.Results[0].ID != 7 || done.Finished.IsZero() {
		t.Fatalf("after the report: %+v", done)
	}
	// A second report is refused; the list has the operation.
	err = c.ReportOperation(ctx, op.ID, api.OperationResult{Host: "mb1", Reply: rep})
	if !errors.As(err, &he) || he.StatusCode != 409 {
		t.Fatalf("second report: %v, want 409", err)
	}
	all, err := c.Operations(ctx)
	if err != nil || len(all) != 1 || all[0].ID != op.ID {
		t.Fatalf("list: %+v %v", all, err)
	}
	if !strings.HasPrefix(op.ID, "op-") || strings.Count(op.ID, "-") != 2 {
		t.Errorf("operation ID %q, want op-EPOCH-N (unique across server runs)", op.ID)
	}
	if _, err := c.Operation(ctx, "op-999", 0); !api.IsNotFound(err) {
		t.Fatalf("unknown operation: %v, want 404", err)
	}
}

// An agent's refusal comes back as a failed operation with its message.
func TestOperationRefusedByAgent(t *testing.T) {
	ts := startServer(t, Config{})
	c := api.NewServerClient(ts.url)
	ctx := t.Context()
	c.ClaimOperation(ctx, "client", 0)
	op, err := c.CreateOperation(ctx, api.Operation{Host: "client", Reconfig: &api.ReconfigRequest{Match: "tcp", To: netip.MustParseAddr("10.0.0.9")}})
	if err != nil {
		t.Fatal(err)
	}
	if got, ok, err := c.ClaimOperation(ctx, "client", 5*time.Second); err != nil || !ok || got.ID != op.ID {
		t.Fatalf("claim: %+v %v %v", got, ok, err)
	}
	if err := c.ReportOperation(ctx, op.ID, api.OperationResult{Host: "client", Error: "reconfiguration is disabled on this agent"}); err != nil {
		t.Fatal(err)
	}
	got, err := c.Operation(ctx, op.ID, 0)
	if err != nil || got.State != api.OpFailed || got.Error != `agent "client": reconfiguration is disabled on this agent` {
		t.Fatalf("refused: %+v %v", got, err)
	}
}

// Operations nobody claims, or nobody reports, fail in bounded time, and
// the operator's wait ends with the reason.
func TestOperationExpiry(t *testing.T) {
	shorten(t, 300*time.Millisecond, 200*time.Millisecond)
	ts := startServer(t, Config{})
	c := api.NewServerClient(ts.url)
	ctx := t.Context()
	c.ClaimOperation(ctx, "gone", 0) // seen once, then never polls again
	op, err := c.CreateOperation(ctx, mbRemove("gone", 0))
	if err != nil {
		t.Fatal(err)
	}
	got, err := c.Operation(ctx, op.ID, 10*time.Second)
	if err != nil || got.State != api.OpFailed || !strings.Contains(got.Error, "did not claim the operation") {
		t.Fatalf("unclaimed: %+v %v", got, err)
	}

	op, err = c.CreateOperation(ctx, mbRemove("gone", 100))
	if err != nil {
		t.Fatal(err)
	}
	if _, ok, err := c.ClaimOperation(ctx, "gone", 5*time.Second); err != nil || !ok {
		t.Fatalf("claim: %v %v", ok, err)
	}
	start := time.Now()
	got, err = c.Operation(ctx, op.ID, 10*time.Second)
	if err != nil || got.State != api.OpFailed || !strings.Contains(got.Error, "reported no result") {
		t.Fatalf("unreported: %+v %v", got, err)
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Errorf("the lost operation failed after %s, want about 300 ms", d)
	}
	// Its late report is refused, saying why.
	err = c.ReportOperation(ctx, op.ID, api.OperationResult{Host: "gone", Error: "late"})
	var he *api.HTTPError
	if !errors.As(err, &he) || he.StatusCode != 409 || !strings.Contains(he.Message, "is failed, not running") {
		t.Fatalf("late report: %v", err)
	}

	// An agent last seen too long ago is refused up front.
	seenWithin = 0
	if _, err := c.CreateOperation(ctx, mbRemove("gone", 0)); !errors.As(err, &he) || he.StatusCode != 409 || !strings.Contains(he.Message, "has not asked this policy server") {
		t.Fatalf("stale agent: %v", err)
	}
}

func TestOperationBadInput(t *testing.T) {
	ts := startServer(t, Config{ValidateMatch: func(m string) error {
		if strings.Contains(m, "(") {
			return errors.New("syntax error")
		}
		return nil
	}})
	c := api.NewServerClient(ts.url)
	c.ClaimOperation(t.Context(), "mb1", 0)
	for _, tc := range []struct{ body, want string }{
		{``, "empty request body"},
		{`{"host":"mb1"}`, "exactly one of reconfig, middlebox and query"},
		{`{"host":"mb1","reconfig":{"match":"tcp","to":"10.0.0.1"},"middlebox":{}}`, "exactly one of reconfig, middlebox and query"},
		{`{"middlebox":{}}`, "no host"},
		{`{"host":"a b","middlebox":{}}`, "not an agent name"},
		{`{"host":"mb1","reconfig":{"match":"tcp"}}`, "needs a right anchor"},
		{`{"host":"mb1","middlebox":{"match":"tcp ("}}`, "match: syntax error"},
		{`{"host":"mb1","middlebox":{},"state":"done"}`, "the server's to set"},
		{`{"host":"mb1","middlebox":{"timeout_ms":-1}}`, "timeout_ms -1: want 0"},
		{`{"host":"mb1","middlebox":{"timeout_ms":9300000000000}}`, "timeout_ms 9300000000000: want 0"},
		{`{"host":"mb1","middlebox":{"match":"` + strings.Repeat("x", api.MaxMatchLen+1) + `"}}`, "match filter of 8193 bytes"},
		{`{"host":"mb1","midlebox":{}}`, `unknown field`},
		{`{"host":"mb1","query":{"what":"keys"}}`, `query \"keys\": want \"sessions\"`},
		{`{"host":"mb1","query":{"what":"sessions","limit":10001}}`, `query limit 10001`},
		{`{"host":"mb1","query":{"what":"sessions"},"sessions":{"sessions":[],"total":0}}`, "the server's to set"},
	} {
		code, data := call(t, "POST", ts.url+"/v1/operations", tc.body)
		if code != 400 || !strings.Contains(string(data), tc.want) {
			t.Errorf("POST %s: %d %s, want 400 with %q", tc.body, code, data, tc.want)
		}
	}
	for _, tc := range []struct{ method, path, body string }{
		{"POST", "/v1/operations/claim", ""},
		{"POST", "/v1/operations/claim?host=mb1&wait=x", ""},
		{"GET", "/v1/operations/op-1?wait=-1", ""},
		{"PUT", "/v1/operations/op-1/result", `{}`},
		{"PUT", "/v1/operations/op-1/result", `{"error":"x","reply":{"results":[]}}`},
	} {
		if code, data := call(t, tc.method, ts.url+tc.path, tc.body); code != 400 {
			t.Errorf("%s %s %s: %d %s, want 400", tc.method, tc.path, tc.body, code, data)
		}
	}
	if code, _ := call(t, "PUT", ts.url+"/v1/operations/op-9/result", `{"host":"mb1","error":"x"}`); code != 404 {
		t.Errorf("report of an unknown operation: %d, want 404", code)
	}
}

// ServeOperations carries out what the server relays, in parallel, and
// reports; an operation the agent refuses comes back failed.
func TestServeOperations(t *testing.T) {
	ts := startServer(t, Config{})
	c := api.NewServerClient(ts.url)
	ctx, cancel := context.WithCancel(t.Context())
	var mu sync.Mutex
	var seen []string
	release := make(chan struct{})
	done := make(chan error, 1)
	go func() {
		done <- psclient.ServeOperations(ctx, psclient.OpsConfig{URL: ts.url, Host: "mb1", Wait: time.Second, Logger: quietLogger(),
			Exec: func(ctx context.Context, op api.Operation) api.OperationResult {
				mu.Lock()
				seen = append(seen, op.ID)
				mu.Unlock()
				if op.Middlebox.Match == "refuse" {
					return api.OperationResult{Error: "no such filter"}
				}
				<-release // both are running at once before either finishes
				return api.OperationResult{Reply: &api.ReconfigReply{Results: []api.ReconfigResult{{ID: 1, Outcome: "succeeded"}}}}
			}})
	}()
	// Wait for the agent's first poll to be registered.
	deadline := time.Now().Add(10 * time.Second)
	for {
		o := ts.ops.(*memOps)
		o.mu.Lock()
		n := o.polls["mb1"]
		o.mu.Unlock()
		if n > 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the agent never polled")
		}
		time.Sleep(10 * time.Millisecond)
	}
	a, err := c.CreateOperation(t.Context(), mbRemove("mb1", 0))
	if err != nil {
		t.Fatal(err)
	}
	b, err := c.CreateOperation(t.Context(), api.Operation{Host: "mb1", Middlebox: &api.MiddleboxRequest{Match: "refuse"}})
	if err != nil {
		t.Fatal(err)
	}
	gb, err := c.Operation(t.Context(), b.ID, 10*time.Second)
	if err != nil || gb.State != api.OpFailed || !strings.Contains(gb.Error, "no such filter") {
		t.Fatalf("refused operation: %+v %v", gb, err)
	}
	close(release)
	ga, err := c.Operation(t.Context(), a.ID, 10*time.Second)
	if err != nil || ga.State != api.OpDone || ga.Reply == nil || len(ga.Reply.Results) != 1 {
		t.Fatalf("operation: %+v %v", ga, err)
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if len(seen) != 2 {
		t.Fatalf("executed %v, want both", seen)
	}
}

// A reply the server refuses (too large) comes back as a failed operation
// that says so, at once, not as a lost one at the deadline.
func TestServeOperationsReplyRefused(t *testing.T) {
	old := maxResultBody
	maxResultBody = 512
	t.Cleanup(func() { maxResultBody = old })
	ts := startServer(t, Config{})
	c := api.NewServerClient(ts.url)
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	go psclient.ServeOperations(ctx, psclient.OpsConfig{URL: ts.url, Host: "fw1", Wait: time.Second, Logger: quietLogger(),
		Exec: func(ctx context.Context, op api.Operation) api.OperationResult {
			rep := &api.ReconfigReply{}
			for i := range 50 {
				rep.Results = append(rep.Results, api.ReconfigResult{ID: uint32(i), Session: "10.0.0.1:40000 -> 10.0.9.1:80", Outcome: "succeeded"})
			}
			return api.OperationResult{Reply: rep}
		}})
	var op api.Operation
	deadline := time.Now().Add(10 * time.Second)
	for {
		var err error
		op, err = c.CreateOperation(t.Context(), mbRemove("fw1", 0))
		if err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the agent never polled: %v", err)
		}
		time.Sleep(10 * time.Millisecond) // until the agent's first poll is in
	}
	got, err := c.Operation(t.Context(), op.ID, 10*time.Second)
	if err != nil || got.State != api.OpFailed || !strings.Contains(got.Error, "carried out on 50 session(s), but the policy server refused the reply") {
		t.Fatalf("refused reply: %+v %v", got, err)
	}
}

// The agents remembered (ops.seen) are bounded in number, forgotten after
// keepFinished, and host names given as parameters are bounded in length.
func TestSeenBounded(t *testing.T) {
	old := maxSeenHosts
	maxSeenHosts = 16
	t.Cleanup(func() { maxSeenHosts = old })
	ts := startServer(t, Config{})
	c := api.NewServerClient(ts.url)
	ctx := t.Context()
	for i := range 100 {
		if _, _, err := c.ClaimOperation(ctx, fmt.Sprintf("h%03d", i), 0); err != nil {
			t.Fatal(err)
		}
	}
	o := ts.ops.(*memOps)
	o.mu.Lock()
	n := len(o.seen)
	_, newest := o.seen["h099"]
	_, oldest := o.seen["h000"]
	o.mu.Unlock()
	if n > maxSeenHosts || !newest || oldest {
		t.Errorf("seen holds %d hosts (bound %d), newest kept %v, oldest kept %v", n, maxSeenHosts, newest, oldest)
	}
	// The newest can still be given operations; the forgotten cannot.
	if _, err := c.CreateOperation(ctx, mbRemove("h099", 0)); err != nil {
		t.Errorf("operation for a remembered agent: %v", err)
	}
	if _, err := c.CreateOperation(ctx, mbRemove("h000", 0)); err == nil {
		t.Error("operation for a forgotten agent accepted")
	}
	// Expiry: an agent not heard from for keepFinished is forgotten.
	o.mu.Lock()
	o.seen["h099"] = time.Now().Add(-keepFinished - time.Second)
	o.expire(time.Now())
	_, kept := o.seen["h099"]
	o.mu.Unlock()
	if kept {
		t.Error("an agent silent for keepFinished is still remembered")
	}
	// A host name beyond 253 bytes is refused, not remembered.
	long := strings.Repeat("a", 64<<10)
	_, _, err := c.ClaimOperation(ctx, long, 0)
	var he *api.HTTPError
	if !errors.As(err, &he) || he.StatusCode != http.StatusBadRequest {
		t.Errorf("claim with a 64 KiB host: %v, want 400", err)
	}
	o.mu.Lock()
	_, kept = o.seen[long]
	o.mu.Unlock()
	if kept {
		t.Error("a 64 KiB host name was remembered")
	}
}
