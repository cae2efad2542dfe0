package policyserver

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/dysco/dysco/internal/api"
	"github.com/dysco/dysco/internal/psclient"
	"github.com/dysco/dysco/internal/testutil"
)

// etcdReplica is one policy server over etcd, served by httptest.
type etcdReplica struct {
	*Server
	srv *httptest.Server
	url string
}

// kill stops serving at once (open connections closed) and closes the server.
func (r *etcdReplica) kill() {
	r.srv.CloseClientConnections()
	r.srv.Close()
	r.Server.Close()
}

func startEtcdReplica(t *testing.T, etcdURL, prefix string) *etcdReplica {
	t.Helper()
	s, err := New(Config{Insecure: true, Etcd: []string{etcdURL}, EtcdPrefix: prefix, Logger: quietLogger()})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(s.Handler())
	r := &etcdReplica{Server: s, srv: srv, url: srv.URL}
	var once sync.Once
	t.Cleanup(func() { once.Do(r.kill) })
	return r
}

// registerAgent has host poll r for policies (which registers it) and
// waits until the registration is in etcd.
func registerAgent(t *testing.T, r *etcdReplica, host string) {
	t.Helper()
	call(t, "GET", r.url+"/v1/watch?host="+host+"&after=0&wait=0", "")
	testutil.Eventually(t, 10*time.Second, host+" to be registered", func() bool {
		regs, err := r.st.Agents(context.Background())
		if err != nil {
			return false
		}
		for _, reg := range regs {
			if reg.Host == host {
				return true
			}
		}
		return false
	})
}

// TestEtcdOperations: operations in etcd, through two replicas. An
// operation for an agent not registered is refused; one created at a is
// claimed by the agent's poll waiting at b, reported at a, and the
// operator's wait at b ends with the reply; two replicas' claims for the
// same agent take each operation once; the operations are kept under a
// lease.
func TestEtcdOperations(t *testing.T) {
	url, _ := startEtcd(t)
	a := startEtcdReplica(t, url, "/ops/")
	b := startEtcdReplica(t, url, "/ops/")
	ca, cb := api.NewServerClient(a.url), api.NewServerClient(b.url)
	ctx := t.Context()

	_, err := ca.CreateOperation(ctx, mbRemove("mb1", 0))
	var he *api.HTTPError
	if !errors.As(err, &he) || he.StatusCode != 409 || !strings.Contains(he.Message, `no agent named "mb1" is registered`) {
		t.Fatalf("operation for an unregistered agent: %v, want 409", err)
	}
	registerAgent(t, b, "mb1")

	claimed := make(chan api.Operation, 1)
	go func() {
		op, ok, err := cb.ClaimOperation(ctx, "mb1", 20*time.Second)
		if err != nil || !ok {
			t.Errorf("claim at b: ok %v err %v", ok, err)
		}
		claimed <- op
	}()
	op, err := ca.CreateOperation(ctx, mbRemove("mb1", 2000))
	if err != nil {
		t.Fatal(err)
	}
	if op.State != api.OpQueued || !strings.HasPrefix(op.ID, "op-") {
		t.Fatalf("created %+v", op)
	}
	select {
	case got := <-claimed:
		if got.ID != op.ID || got.State != api.OpRunning || got.Middlebox == nil || got.Middlebox.TimeoutMS != 2000 {
			t.Fatalf("claimed %+v, want %s running", got, op.ID)
		}
	case <-time.After(15 * time.Second):
		t.Fatal("the claim waiting at b did not get the operation created at a")
	}

	waited := make(chan api.Operation, 1)
	go func() {
		o, err := cb.Operation(ctx, op.ID, 20*time.Second)
		if err != nil {
			t.Error(err)
		}
		waited <- o
	}()
	rep := &api.ReconfigReply{Results: []api.ReconfigResult{{ID: 3, Outcome: "succeeded"}}}
	if err := ca.ReportOperation(ctx, op.ID, api.OperationResult{Host: "mb1", Reply: rep}); err != nil {
		t.Fatal(err)
	}
	if done := <-waited; done.State != api.OpDone || done.Reply == nil || done.Reply.Results[0].ID != 3 {
		t.Fatalf("the wait at b ended with %+v", done)
	}
	if err := cb.ReportOperation(ctx, op.ID, api.OperationResult{Host: "mb1", Reply: rep}); !errors.As(err, &he) || he.StatusCode != 409 {
		t.Fatalf("second report at b: %v, want 409", err)
	}
	for _, c := range []*api.Client{ca, cb} {
		all, err := c.Operations(ctx)
		if err != nil || len(all) != 1 || all[0].ID != op.ID || all[0].State != api.OpDone {
			t.Fatalf("list at %s: %+v %v", c.Target(), all, err)
		}
	}
	for _, id := range []string{"op-nope", "a/b", strings.Repeat("x", 100)} {
		if _, err := cb.Operation(ctx, id, 0); !api.IsNotFound(err) {
			t.Errorf("operation %q: %v, want 404", id, err)
		}
	}

	// Claims racing at both replicas: each of 20 operations runs once.
	const n = 20
	var mu sync.Mutex
	runs := map[string]int{}
	cctx, cancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	for _, c := range []*api.Client{ca, cb, ca, cb} {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for cctx.Err() == nil {
				op, ok, err := c.ClaimOperation(cctx, "mb1", 2*time.Second)
				if !ok || err != nil {
					continue
				}
				mu.Lock()
				runs[op.ID]++
				mu.Unlock()
				c.ReportOperation(ctx, op.ID, api.OperationResult{Host: "mb1", Error: "done"})
			}
		}()
	}
	var ids []string
	for i := range n {
		c := []*api.Client{ca, cb}[i%2]
		op, err := c.CreateOperation(ctx, mbRemove("mb1", 0))
		if err != nil {
			t.Fatal(err)
		}
		ids = append(ids, op.ID)
	}
	for _, id := range ids {
		if got, err := ca.Operation(ctx, id, 20); err != nil || got.State != api.OpFailed || got.Error != `agent "mb1": done` {
			t.Fatalf("operation %s: %+v %v", id, got, err)
		}
	}
	cancel()
	wg.Wait()
	for _, id := range ids {
		if runs[id] != 1 {
			t.Errorf("operation %s claimed %d times", id, runs[id])
		}
	}

	// Every operation is under a lease of about keepFinished.
	cli, err := clientv3.New(clientv3.Config{Endpoints: []string{url}})
	if err != nil {
		t.Fatal(err)
	}
	defer cli.Close()
	resp, err := cli.Get(ctx, "/ops/ops/", clientv3.WithPrefix())
	if err != nil || len(resp.Kvs) != n+1 {
		t.Fatalf("ops in etcd: %v %v", len(resp.Kvs), err)
	}
	for _, kv := range resp.Kvs {
		ttl, err := cli.TimeToLive(ctx, clientv3.LeaseID(kv.Lease))
		if err != nil || kv.Lease == 0 || ttl.TTL < int64((keepFinished-time.Minute)/time.Second) {
			t.Fatalf("%s: lease %x ttl %+v %v, want about %s", kv.Key, kv.Lease, ttl, err, keepFinished)
		}
	}
}

// Operations nobody claims or reports fail at their deadlines, whichever
// replica is asked; a registration that lapsed refuses new operations; with
// etcd gone, creating and claiming fail fast with 503.
func TestEtcdOperationsExpiry(t *testing.T) {
	shorten(t, 300*time.Millisecond, 200*time.Millisecond)
	oldTTL := registrationTTL
	registrationTTL = 2 * time.Second
	t.Cleanup(func() { registrationTTL = oldTTL })
	url, stop := startEtcd(t)
	a := startEtcdReplica(t, url, "/exp/")
	b := startEtcdReplica(t, url, "/exp/")
	ca, cb := api.NewServerClient(a.url), api.NewServerClient(b.url)
	ctx := t.Context()
	registerAgent(t, a, "gone")

	op, err := ca.CreateOperation(ctx, mbRemove("gone", 0))
	if err != nil {
		t.Fatal(err)
	}
	got, err := cb.Operation(ctx, op.ID, 10*time.Second)
	if err != nil || got.State != api.OpFailed || !strings.Contains(got.Error, "did not claim the operation") {
		t.Fatalf("unclaimed: %+v %v", got, err)
	}
	op, err = ca.CreateOperation(ctx, mbRemove("gone", 100))
	if err != nil {
		t.Fatal(err)
	}
	if _, ok, err := ca.ClaimOperation(ctx, "gone", 5*time.Second); err != nil || !ok {
		t.Fatalf("claim: %v %v", ok, err)
	}
	got, err = cb.Operation(ctx, op.ID, 10*time.Second)
	if err != nil || got.State != api.OpFailed || !strings.Contains(got.Error, "reported no result") {
		t.Fatalf("unreported: %+v %v", got, err)
	}
	var he *api.HTTPError
	err = ca.ReportOperation(ctx, op.ID, api.OperationResult{Host: "gone", Error: "late"})
	if !errors.As(err, &he) || he.StatusCode != 409 || !strings.Contains(he.Message, "is failed, not running") {
		t.Fatalf("late report: %v", err)
	}

	// The agent stops polling: its registration lapses with its lease,
	// and operations for it are refused.
	testutil.Eventually(t, 15*time.Second, "the registration to lapse", func() bool {
		_, err := cb.CreateOperation(ctx, mbRemove("gone", 0))
		return errors.As(err, &he) && he.StatusCode == 409 && strings.Contains(he.Message, "is registered")
	})

	registerAgent(t, a, "back")
	stop()
	for _, try := range []func() error{
		func() error { _, err := ca.CreateOperation(ctx, mbRemove("back", 0)); return err },
		func() error { _, _, err := cb.ClaimOperation(ctx, "back", 0); return err },
	} {
		start := time.Now()
		err := try()
		if !errors.As(err, &he) || he.StatusCode != http.StatusServiceUnavailable || !strings.Contains(he.Message, "no quorum") {
			t.Errorf("without etcd: %v, want 503 no quorum", err)
		}
		if d := time.Since(start); d > storeTimeout+2*time.Second {
			t.Errorf("failed after %s", d)
		}
	}
}

// A replica killed mid-operation loses nothing: the agent, given both
// replicas, reports to the other, and the operator's wait moves there too.
func TestEtcdReplicaKilledMidOperation(t *testing.T) {
	url, _ := startEtcd(t)
	a := startEtcdReplica(t, url, "/kill/")
	b := startEtcdReplica(t, url, "/kill/")
	both := a.url + "," + b.url
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	running := make(chan struct{})
	release := make(chan struct{})
	agentDone := make(chan error, 1)
	go func() {
		agentDone <- psclient.ServeOperations(ctx, psclient.OpsConfig{URL: both, Host: "mb1", Wait: time.Second, Logger: quietLogger(),
			Exec: func(ctx context.Context, op api.Operation) api.OperationResult {
				close(running)
				<-release
				return api.OperationResult{Reply: &api.ReconfigReply{Results: []api.ReconfigResult{{ID: 9, Outcome: "succeeded"}}}}
			}})
	}()
	registerAgent(t, a, "mb1")
	c := api.NewServerClient(both)
	op, err := c.CreateOperation(ctx, mbRemove("mb1", 0))
	if err != nil {
		t.Fatal(err)
	}
	if c.Target() != "policy server "+a.url {
		t.Fatalf("the operator's client asks %s first, want a", c.Target())
	}
	select {
	case <-running:
	case <-time.After(15 * time.Second):
		t.Fatal("the agent never ran the operation")
	}
	waited := make(chan api.Operation, 1)
	go func() {
		// As the CLI does: wait again while the operation runs (a
		// replica's shutdown on a loaded machine can outlast one wait).
		var got api.Operation
		for end := time.Now().Add(60 * time.Second); time.Now().Before(end); {
			var err error
			if got, err = c.Operation(ctx, op.ID, 20*time.Second); err != nil {
				t.Error(err)
				break
			}
			if got.IsFinished() {
				break
			}
		}
		waited <- got
	}()
	// Whether the wait is in at a when a dies (the connection is reset)
	// or not yet (the connection is refused), it goes on at b.
	a.kill()
	close(release)
	select {
	case got := <-waited:
		if got.State != api.OpDone || got.Reply == nil || got.Reply.Results[0].ID != 9 {
			t.Fatalf("after a was killed: %+v", got)
		}
	case <-time.After(70 * time.Second):
		t.Fatal("the operator's wait did not end")
	}
	if c.Target() != "policy server "+b.url {
		t.Errorf("the client asks %s first now, want b", c.Target())
	}
	cancel()
	if err := <-agentDone; err != nil {
		t.Fatal(err)
	}
}

// A value under ops/ that is not an operation is skipped, not fatal.
func TestEtcdOperationsBadValue(t *testing.T) {
	url, _ := startEtcd(t)
	a := startEtcdReplica(t, url, "/bad/")
	cli, err := clientv3.New(clientv3.Config{Endpoints: []string{url}})
	if err != nil {
		t.Fatal(err)
	}
	defer cli.Close()
	if _, err := cli.Put(t.Context(), "/bad/ops/op-junk", "{not json"); err != nil {
		t.Fatal(err)
	}
	registerAgent(t, a, "h")
	c := api.NewServerClient(a.url)
	if _, err := c.CreateOperation(t.Context(), mbRemove("h", 0)); err != nil {
		t.Fatal(err)
	}
	all, err := c.Operations(t.Context())
	if err != nil || len(all) != 1 {
		t.Fatalf("list: %+v %v", all, err)
	}
	if _, err := c.Operation(t.Context(), "op-junk", 0); err == nil {
		t.Fatal("a malformed operation was served")
	}
}

// Queries (`dysco sessions --server`): the agent's sessions come back in
// the operation; a result of the wrong kind is refused; a result larger
// than etcd takes is refused with 413, which the agent reports instead.
func TestEtcdQueryOperations(t *testing.T) {
	url, _ := startEtcd(t)
	a := startEtcdReplica(t, url, "/q/")
	c := api.NewServerClient(a.url)
	ctx := t.Context()
	registerAgent(t, a, "mb1")
	query := func(what string) api.Operation {
		t.Helper()
		op, err := c.CreateOperation(ctx, api.Operation{Host: "mb1", Query: &api.QueryRequest{What: what}})
		if err != nil {
			t.Fatal(err)
		}
		got, ok, err := c.ClaimOperation(ctx, "mb1", 5*time.Second)
		if err != nil || !ok || got.ID != op.ID || got.Query == nil || got.Query.What != what {
			t.Fatalf("claim: %+v %v %v", got, ok, err)
		}
		return op
	}
	op := query(api.QuerySessions)
	var he *api.HTTPError
	err := c.ReportOperation(ctx, op.ID, api.OperationResult{Host: "mb1", Reply: &api.ReconfigReply{}})
	if !errors.As(err, &he) || he.StatusCode != 400 {
		t.Fatalf("a reconfiguration reply to a sessions query: %v, want 400", err)
	}
	ss := &api.SessionsReply{Sessions: []api.Session{{ID: 4, Session: "10.0.0.1:1 -> 10.0.0.2:80"}}, Total: 3}
	if err := c.ReportOperation(ctx, op.ID, api.OperationResult{Host: "mb1", Sessions: ss}); err != nil {
		t.Fatal(err)
	}
	got, err := c.Operation(ctx, op.ID, 0)
	if err != nil || got.State != api.OpDone || got.Sessions == nil || got.Sessions.Total != 3 || got.Sessions.Sessions[0].ID != 4 {
		t.Fatalf("answered query: %+v %v", got, err)
	}

	old := maxEtcdOp
	maxEtcdOp = 2048
	t.Cleanup(func() { maxEtcdOp = old })
	op = query(api.QuerySessions)
	big := &api.SessionsReply{Total: 100}
	for i := range 100 {
		big.Sessions = append(big.Sessions, api.Session{ID: uint32(i), Session: "10.0.0.1:40000 -> 10.0.9.1:80"})
	}
	err = c.ReportOperation(ctx, op.ID, api.OperationResult{Host: "mb1", Sessions: big})
	if !errors.As(err, &he) || he.StatusCode != 413 {
		t.Fatalf("a result larger than etcd takes: %v, want 413", err)
	}
	if err := c.ReportOperation(ctx, op.ID, api.OperationResult{Host: "mb1", Error: "too large"}); err != nil {
		t.Fatalf("the refusal reported instead: %v", err)
	}
	if _, err := c.CreateOperation(ctx, api.Operation{Host: "mb1", Query: &api.QueryRequest{What: "secrets"}}); !errors.As(err, &he) || he.StatusCode != 400 {
		t.Fatalf("an unknown query: %v, want 400", err)
	}
}

// A waiting poll keeps its agent registered past the TTL; once the agent's
// connection ends, the registration lapses within about a TTL.
func TestAgentTTLRenewal(t *testing.T) {
	url, _ := startEtcd(t)
	s, err := New(Config{Insecure: true, Etcd: []string{url}, EtcdPrefix: "/ttl/", Logger: quietLogger(), AgentTTL: 2 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(s.Handler())
	defer func() { srv.Close(); s.Close() }()
	if _, err := New(Config{Insecure: true, Etcd: []string{url}, AgentTTL: time.Second}); err == nil || !strings.Contains(err.Error(), "agent TTL 1s: want 2s to 1h") {
		t.Fatalf("a TTL of 1s: %v", err)
	}
	registered := func() bool {
		regs, err := s.st.Agents(context.Background())
		return err == nil && len(regs) == 1 && regs[0].Host == "h1"
	}
	ctx, cancel := context.WithCancel(t.Context())
	polled := make(chan struct{})
	go func() {
		defer close(polled)
		req, _ := http.NewRequestWithContext(ctx, "GET", srv.URL+"/v1/watch?host=h1&after=0&wait=30", nil)
		if resp, err := http.DefaultClient.Do(req); err == nil {
			resp.Body.Close()
		}
	}()
	// The set is empty at version 0: the poll waits.
	testutil.Eventually(t, 5*time.Second, "h1 to be registered", registered)
	deadline := time.Now().Add(5 * time.Second) // 2.5 TTLs
	for time.Now().Before(deadline) {
		if !registered() {
			t.Fatal("the registration lapsed while the poll waited")
		}
		time.Sleep(200 * time.Millisecond)
	}
	cancel()
	<-polled
	start := time.Now()
	testutil.Eventually(t, 10*time.Second, "the registration to lapse", func() bool { return !registered() })
	if d := time.Since(start); d > 4*time.Second {
		t.Errorf("the registration lapsed %s after the poll ended, want about 2s", d)
	}
}
