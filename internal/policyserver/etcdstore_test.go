package policyserver

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/dysco/dysco/internal/api"
	"github.com/dysco/dysco/internal/certs"
	"github.com/dysco/dysco/internal/testutil"
)

// etcdBin is the etcd server that `make build` builds from test/etcd.
var etcdBin = filepath.Join("..", "..", "bin", "etcd")

// freePort returns a loopback TCP port nobody listens on now.
func freePort(t *testing.T) int {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port
}

// startEtcd runs a one-member etcd on loopback for the test and returns its
// client URL and a function that kills it; the member and its data go when
// the test ends.
func startEtcd(t *testing.T) (string, func()) {
	t.Helper()
	return startEtcdTLS(t, "")
}

// startEtcdTLS is startEtcd, serving clients over TLS with client
// certificates when pki names a directory with the CA (ca.crt) and a server
// certificate for 127.0.0.1 (server.crt, server.key).
func startEtcdTLS(t *testing.T, pki string) (string, func()) {
	t.Helper()
	if _, err := os.Stat(etcdBin); err != nil {
		t.Fatalf("%v: run `make build` (it builds bin/etcd from test/etcd)", err)
	}
	dir := t.TempDir()
	scheme := "http"
	var tlsArgs []string
	ccfg := clientv3.Config{DialTimeout: time.Second}
	if pki != "" {
		scheme = "https"
		tlsArgs = []string{"--cert-file", filepath.Join(pki, "server.crt"), "--key-file", filepath.Join(pki, "server.key"),
			"--client-cert-auth", "--trusted-ca-file", filepath.Join(pki, "ca.crt")}
		ec, err := etcdClientConfig(Config{Etcd: []string{"x"}, EtcdCertFile: filepath.Join(pki, "operator-etcd.crt"),
			EtcdKeyFile: filepath.Join(pki, "operator-etcd.key"), EtcdCAFile: filepath.Join(pki, "ca.crt")})
		if err != nil {
			t.Fatal(err)
		}
		ccfg.TLS = ec.TLS
	}
	client := fmt.Sprintf("%s://127.0.0.1:%d", scheme, freePort(t))
	peer := fmt.Sprintf("http://127.0.0.1:%d", freePort(t))
	stop := runEtcd(t, dir, client, peer, tlsArgs...)
	waitEtcd(t, client, ccfg)
	return client, stop
}

// runEtcd starts a one-member etcd with its data in dir, serving clients
// at client and its peer at peer, and returns a function that kills it;
// it is killed when the test ends too, and its log shown if the test
// failed.
func runEtcd(t *testing.T, dir, client, peer string, tlsArgs ...string) func() {
	t.Helper()
	log := filepath.Join(dir, "etcd.log")
	cmd := exec.Command(etcdBin, append([]string{"--name", "m1", "--data-dir", filepath.Join(dir, "data"),
		"--listen-client-urls", client, "--advertise-client-urls", client,
		"--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
		"--initial-cluster", "m1=" + peer, "--log-outputs", log}, tlsArgs...)...)
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	var once sync.Once
	stop := func() {
		once.Do(func() {
			cmd.Process.Kill()
			cmd.Wait()
		})
	}
	t.Cleanup(func() {
		stop()
		if t.Failed() {
			if b, err := os.ReadFile(log); err == nil {
				t.Logf("etcd log:\n%s", b)
			}
		}
	})
	return stop
}

// waitEtcd waits until the etcd at client serves reads with a leader.
func waitEtcd(t *testing.T, client string, ccfg clientv3.Config) {
	t.Helper()
	ccfg.Endpoints = []string{client}
	cli, err := clientv3.New(ccfg)
	if err != nil {
		t.Fatal(err)
	}
	defer cli.Close()
	testutil.Eventually(t, 20*time.Second, "etcd to serve", func() bool {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		_, err := cli.Get(clientv3.WithRequireLeader(ctx), "health")
		return err == nil
	})
}

func openTestEtcdStore(t *testing.T, url, prefix string, changes *atomic.Int64) *etcdStore {
	t.Helper()
	s, err := openEtcdStore(clientv3.Config{Endpoints: []string{url}}, prefix, slog.Default(), func() { changes.Add(1) }, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return s
}

// TestEtcdStore: the policy set in a real etcd, through two replicas of
// the store. Versions are the store's revisions and rise with every change
// and only then; each replica sees the other's changes by its watch; the
// bounds and a type's use are checked against the set a change applies to;
// a watch that fell behind a compaction reloads the set.
func TestEtcdStore(t *testing.T) {
	url, _ := startEtcd(t)
	ctx := t.Context()
	var ca, cb atomic.Int64
	a := openTestEtcdStore(t, url, "/dysco-test/", &ca)
	b := openTestEtcdStore(t, url, "/dysco-test", &cb)

	set, err := a.Load(ctx)
	if err != nil || set.Version != 0 || len(set.Policies) != 0 {
		t.Fatalf("empty store: %+v %v", set, err)
	}
	pol := api.Policy{Name: "web", Filter: "tcp dst port 80", Chain: []api.Hop{{Type: "fw"}}}
	typ := api.MiddleboxType{Name: "fw", Instances: []netip.Addr{netip.MustParseAddr("10.0.0.5")}}
	if ch, err := a.PutType(ctx, typ); !ch || err != nil {
		t.Fatalf("put type: %v %v", ch, err)
	}
	if ch, err := a.PutPolicy(ctx, pol); !ch || err != nil {
		t.Fatalf("put policy: %v %v", ch, err)
	}
	v1, err := b.Load(ctx)
	if err != nil || len(v1.Policies) != 1 || v1.Policies[0].Filter != pol.Filter || len(v1.Types) != 1 || v1.Version == 0 {
		t.Fatalf("replica b reads %+v %v", v1, err)
	}
	testutil.Eventually(t, 5*time.Second, "replica b to see both changes", func() bool { return cb.Load() >= 1 })

	// The same object again: no change, no new version.
	if ch, err := b.PutPolicy(ctx, pol); ch || err != nil {
		t.Fatalf("same policy again: changed %v, %v", ch, err)
	}
	if v, _ := a.Load(ctx); v.Version != v1.Version {
		t.Fatalf("version %d after an unchanged put, was %d", v.Version, v1.Version)
	}
	// A type in use stays; once its policy is gone it goes.
	var inUse *api.TypeInUseError
	if found, err := b.DeleteType(ctx, "fw"); !found || !errors.As(err, &inUse) {
		t.Fatalf("delete a type in use: %v %v", found, err)
	}
	if found, err := b.DeletePolicy(ctx, "web"); !found || err != nil {
		t.Fatalf("delete policy: %v %v", found, err)
	}
	if found, err := b.DeletePolicy(ctx, "web"); found || err != nil {
		t.Fatalf("delete it again: %v %v", found, err)
	}
	if found, err := a.DeleteType(ctx, "fw"); !found || err != nil {
		t.Fatalf("delete the type: %v %v", found, err)
	}
	v2, _ := a.Load(ctx)
	if v2.Version <= v1.Version || len(v2.Policies)+len(v2.Types) != 0 {
		t.Fatalf("after the deletes: %+v (was version %d)", v2, v1.Version)
	}
	// Bounds: MaxTypes types, then a FullError.
	for i := range api.MaxTypes {
		if _, err := a.PutType(ctx, api.MiddleboxType{Name: fmt.Sprintf("t%d", i), Instances: []netip.Addr{netip.MustParseAddr("10.0.0.5")}}); err != nil {
			t.Fatal(err)
		}
	}
	var full *FullError
	if _, err := b.PutType(ctx, api.MiddleboxType{Name: "one-more", Instances: []netip.Addr{netip.MustParseAddr("10.0.0.5")}}); !errors.As(err, &full) {
		t.Fatalf("type beyond the bound: %v", err)
	}

	// A compaction past the revision a watch would resume from: the
	// replica reloads (its onChange runs) and follows later changes.
	cli, err := clientv3.New(clientv3.Config{Endpoints: []string{url}})
	if err != nil {
		t.Fatal(err)
	}
	defer cli.Close()
	resp, err := cli.Get(ctx, "x")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := cli.Compact(ctx, resp.Header.Revision); err != nil {
		t.Fatal(err)
	}
	before := cb.Load()
	if _, err := a.PutPolicy(ctx, api.Policy{Name: "after-compaction", Filter: "udp"}); err != nil {
		t.Fatal(err)
	}
	testutil.Eventually(t, 5*time.Second, "replica b to see the change after the compaction", func() bool { return cb.Load() > before })
}

// TestEtcdRegistrations: an agent's registration lives under its lease and
// lapses once it stops polling; another replica takes it over.
func TestEtcdRegistrations(t *testing.T) {
	url, _ := startEtcd(t)
	var n atomic.Int64
	a := openTestEtcdStore(t, url, "/reg/", &n)
	b := openTestEtcdStore(t, url, "/reg/", &n)
	ctx := t.Context()
	reg := api.AgentRegistration{Host: "h1", Addr: "10.0.0.1", Applied: 7, Seen: time.Now().UTC().Truncate(time.Second)}
	if err := a.Register(ctx, reg, 2*time.Second); err != nil {
		t.Fatal(err)
	}
	reg.Applied, reg.Version = 9, "1.0 (block 2, control 6)"
	if err := b.Register(ctx, reg, 2*time.Second); err != nil {
		t.Fatal(err)
	}
	regs, err := a.Agents(ctx)
	if err != nil || len(regs) != 1 || regs[0].Applied != 9 || regs[0].Version != reg.Version {
		t.Fatalf("registrations %+v %v", regs, err)
	}
	if set, err := a.Load(ctx); err != nil || len(set.Policies) != 0 || set.Version != 0 {
		t.Fatalf("registrations show in the set: %+v %v", set, err)
	}
	if n.Load() != 0 {
		t.Fatalf("registrations woke the replicas' watches %d times", n.Load())
	}
	testutil.Eventually(t, 10*time.Second, "h1's registration to lapse", func() bool {
		regs, err := b.Agents(ctx)
		return err == nil && len(regs) == 0
	})

	// Agents that stopped for good are forgotten by the replicas too:
	// 100 one-off agents leave nothing behind once lapsed.
	for i := range 100 {
		if err := a.Register(ctx, api.AgentRegistration{Host: fmt.Sprintf("gone%d", i)}, 2*time.Second); err != nil {
			t.Fatal(err)
		}
	}
	leases := func(s *etcdStore) int {
		s.leaseMu.Lock()
		defer s.leaseMu.Unlock()
		return len(s.leases)
	}
	if got := leases(a); got != 100 { // h1's lapsed: forgotten
		t.Fatalf("replica a keeps %d leases, want 100", got)
	}
	testutil.Eventually(t, 10*time.Second, "the one-off agents' registrations to lapse", func() bool {
		regs, err := a.Agents(ctx)
		return err == nil && len(regs) == 0
	})
	if err := a.Register(ctx, reg, 2*time.Second); err != nil {
		t.Fatal(err)
	}
	if got := leases(a); got != 1 {
		t.Fatalf("replica a keeps %d leases after the others lapsed, want 1 (h1's)", got)
	}
	if regs, err := a.Agents(ctx); err != nil || len(regs) != 1 || regs[0].Host != "h1" {
		t.Fatalf("registrations %+v %v", regs, err)
	}
}

// TestEtcdStoreNoQuorum: with etcd gone, reads and writes fail within the
// store's timeout with a NoQuorumError, never hang.
func TestEtcdStoreNoQuorum(t *testing.T) {
	url, stop := startEtcd(t)
	var n atomic.Int64
	s := openTestEtcdStore(t, url, "", &n)
	if _, err := s.PutPolicy(t.Context(), api.Policy{Name: "p", Filter: "tcp"}); err != nil {
		t.Fatal(err)
	}
	// The test's etcd is the only member: stopping it takes the quorum.
	stop()
	start := time.Now()
	_, err := s.PutPolicy(t.Context(), api.Policy{Name: "q", Filter: "tcp"})
	var nq *NoQuorumError
	if !errors.As(err, &nq) {
		t.Fatalf("write without etcd: %v", err)
	}
	if d := time.Since(start); d > storeTimeout+2*time.Second {
		t.Fatalf("the write failed after %v", d)
	}
}

// TestEtcdReplicas: two policy servers over one etcd serve the same set: a
// policy put through one reaches a watch on the other; with etcd gone, a
// write fails at once with 503 and the reason, and so, once the replicas
// have noticed, do the agents' polls and /healthz.
func TestEtcdReplicas(t *testing.T) {
	url, stop := startEtcd(t)
	replica := func() (*Server, string) {
		s, err := New(Config{Insecure: true, Etcd: []string{url}, EtcdPrefix: "/replicas/"})
		if err != nil {
			t.Fatal(err)
		}
		srv := httptest.NewServer(s.Handler())
		t.Cleanup(func() { srv.Close(); s.Close() })
		return s, srv.URL
	}
	_, a := replica()
	_, b := replica()
	got := make(chan api.PolicySet, 1)
	go func() {
		var set api.PolicySet
		resp, err := http.Get(b + "/v1/watch?host=h1&after=0&wait=20")
		if err == nil {
			json.NewDecoder(resp.Body).Decode(&set)
			resp.Body.Close()
		}
		got <- set
	}()
	mustPut(t, a, "/v1/policies/web", `{"filter":"tcp dst port 80"}`)
	select {
	case set := <-got:
		if len(set.Policies) != 1 || set.Policies[0].Name != "web" || set.Version == 0 {
			t.Fatalf("replica b's watch answered %+v", set)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("replica b's watch did not answer")
	}

	// h1's poll at b registered it, with the version it held: a lists it.
	testutil.Eventually(t, 5*time.Second, "h1 to be registered", func() bool {
		_, data := call(t, "GET", a+"/v1/agents", "")
		regs := decode[[]api.AgentRegistration](t, data)
		return len(regs) == 1 && regs[0].Host == "h1" && regs[0].Applied == 0 && regs[0].Addr == "127.0.0.1"
	})

	stop()
	start := time.Now()
	code, data := call(t, "PUT", a+"/v1/policies/ssh", `{"filter":"tcp dst port 22"}`)
	if e := decode[api.Error](t, data); code != http.StatusServiceUnavailable || !strings.Contains(e.Error, "no quorum") {
		t.Fatalf("write without etcd: %d %q", code, e.Error)
	}
	if d := time.Since(start); d > storeTimeout+2*time.Second {
		t.Fatalf("the write failed after %v", d)
	}
	// Within a probe and a timeout, the replicas know they have no
	// quorum: they send the agents' polls and load balancers elsewhere.
	testutil.Eventually(t, probeEvery+storeTimeout+5*time.Second, "replica b to see it has no quorum", func() bool {
		code, _ := call(t, "GET", b+"/healthz", "")
		return code == http.StatusServiceUnavailable
	})
	code, data = call(t, "GET", b+"/v1/watch?host=h1&after=0&wait=1", "")
	if e := decode[api.Error](t, data); code != http.StatusServiceUnavailable || !strings.Contains(e.Error, "no quorum") {
		t.Fatalf("watch on replica b without etcd: %d %q", code, e.Error)
	}
	// A list would be as stale: the operator hears why instead.
	code, data = call(t, "GET", b+"/v1/policies", "")
	if e := decode[api.Error](t, data); code != http.StatusServiceUnavailable || !strings.Contains(e.Error, "no quorum") {
		t.Fatalf("list on replica b without etcd: %d %q", code, e.Error)
	}
}

// TestEtcdReplicaStartsWithoutQuorum: a replica started while etcd is down
// starts all the same and answers 503 (polls, lists, writes, /healthz),
// never an empty set; once etcd is back it serves the set etcd holds, and
// writes and operations work.
func TestEtcdReplicaStartsWithoutQuorum(t *testing.T) {
	dir := t.TempDir()
	client := fmt.Sprintf("http://127.0.0.1:%d", freePort(t))
	peer := fmt.Sprintf("http://127.0.0.1:%d", freePort(t))
	stop := runEtcd(t, dir, client, peer)
	waitEtcd(t, client, clientv3.Config{DialTimeout: time.Second})
	replica := func() string {
		s, err := New(Config{Insecure: true, Etcd: []string{client}, AgentTTL: 3 * time.Second})
		if err != nil {
			t.Fatal(err)
		}
		srv := httptest.NewServer(s.Handler())
		t.Cleanup(func() { srv.Close(); s.Close() })
		return srv.URL
	}
	a := replica()
	mustPut(t, a, "/v1/policies/web", `{"filter":"tcp dst port 80"}`)
	stop()

	start := time.Now()
	b := replica()
	if d := time.Since(start); d > storeTimeout+5*time.Second {
		t.Fatalf("the replica took %v to start without etcd", d)
	}
	for _, path := range []string{"/healthz", "/v1/policies", "/v1/watch?host=h1&after=0&wait=1"} {
		code, data := call(t, "GET", b+path, "")
		if e := decode[api.Error](t, data); code != http.StatusServiceUnavailable || !strings.Contains(e.Error, "no quorum") {
			t.Fatalf("GET %s without etcd: %d %q", path, code, e.Error)
		}
	}
	if code, _ := call(t, "PUT", b+"/v1/policies/ssh", `{"filter":"tcp dst port 22"}`); code != http.StatusServiceUnavailable {
		t.Fatalf("a write without etcd: %d", code)
	}

	// etcd back, with its data: b serves the set it holds.
	runEtcd(t, dir, client, peer)
	testutil.Eventually(t, 30*time.Second, "replica b to serve web", func() bool {
		code, data := call(t, "GET", b+"/v1/policies", "")
		if code == http.StatusServiceUnavailable {
			return false
		}
		set := decode[api.PolicySet](t, data)
		if code != http.StatusOK || len(set.Policies) != 1 || set.Policies[0].Name != "web" || set.Version == 0 {
			t.Fatalf("replica b serves %d %s", code, data)
		}
		return true
	})
	// Writes and polls (b's probe may still flap while etcd settles: 503
	// is tried again).
	ok := func(what string, f func() (int, []byte), check func([]byte) bool) {
		t.Helper()
		testutil.Eventually(t, 10*time.Second, what, func() bool {
			code, data := f()
			if code == http.StatusServiceUnavailable {
				return false
			}
			if code != http.StatusOK || !check(data) {
				t.Fatalf("%s: %d %s", what, code, data)
			}
			return true
		})
	}
	ok("a write at b", func() (int, []byte) { return call(t, "PUT", b+"/v1/policies/ssh", `{"filter":"tcp dst port 22"}`) },
		func([]byte) bool { return true })
	// Operations too: h1's poll registers it, an operation for it is
	// created at b and claimed at a.
	ok("a poll at b", func() (int, []byte) { return call(t, "GET", b+"/v1/watch?host=h1&after=0&wait=1", "") },
		func(data []byte) bool { return len(decode[api.PolicySet](t, data).Policies) == 2 })
	testutil.Eventually(t, 10*time.Second, "an operation for h1 at b", func() bool {
		code, _ := call(t, "POST", b+"/v1/operations", `{"host":"h1","query":{"what":"sessions"}}`)
		// 409: h1's registration not written yet; 503: b's probe has
		// not seen the quorum again yet.
		if code != http.StatusCreated && code != http.StatusConflict && code != http.StatusServiceUnavailable {
			t.Fatalf("creating an operation at b: %d", code)
		}
		return code == http.StatusCreated
	})
	ok("a claim at a", func() (int, []byte) { return call(t, "POST", a+"/v1/operations/claim?host=h1&wait=5", "") },
		func(data []byte) bool { return decode[api.Operation](t, data).Host == "h1" })
}

// TestEtcdTLS: etcd serving clients over TLS with client certificates
// (the CA and certificates of `dysco certs`): a policy server with its
// client certificate stores and serves policies; without a certificate,
// or with another CA's, it does not start, and says why.
func TestEtcdTLS(t *testing.T) {
	pki := t.TempDir()
	if _, err := certs.CreateCA(pki, "dysco test", certs.Options{}); err != nil {
		t.Fatal(err)
	}
	if _, _, err := certs.IssueServer(pki, nil, []netip.Addr{netip.MustParseAddr("127.0.0.1")}, certs.Options{}); err != nil {
		t.Fatal(err)
	}
	if _, _, err := certs.IssueClient(pki, certs.RoleOperator, "etcd", certs.Options{}); err != nil {
		t.Fatal(err)
	}
	url, _ := startEtcdTLS(t, pki)
	cfg := Config{Insecure: true, Etcd: []string{url}, EtcdPrefix: "/tls/", Logger: quietLogger(),
		EtcdCertFile: filepath.Join(pki, "operator-etcd.crt"), EtcdKeyFile: filepath.Join(pki, "operator-etcd.key"), EtcdCAFile: filepath.Join(pki, "ca.crt")}
	s, err := New(cfg)
	if err != nil {
		t.Fatalf("with its client certificate: %v", err)
	}
	srv := httptest.NewServer(s.Handler())
	defer func() { srv.Close(); s.Close() }()
	mustPut(t, srv.URL, "/v1/policies/web", `{"filter":"tcp dst port 80"}`)

	noCert := cfg
	noCert.EtcdCertFile, noCert.EtcdKeyFile = "", ""
	foreign := t.TempDir()
	if _, err := certs.CreateCA(foreign, "another", certs.Options{}); err != nil {
		t.Fatal(err)
	}
	if _, _, err := certs.IssueClient(foreign, certs.RoleOperator, "etcd", certs.Options{}); err != nil {
		t.Fatal(err)
	}
	otherCA := cfg
	otherCA.EtcdCertFile, otherCA.EtcdKeyFile = filepath.Join(foreign, "operator-etcd.crt"), filepath.Join(foreign, "operator-etcd.key")
	for name, c := range map[string]Config{"no client certificate": noCert, "another CA's certificate": otherCA} {
		start := time.Now()
		s, err := New(c)
		if err == nil {
			s.Close()
			t.Errorf("%s: the policy server started", name)
			continue
		}
		t.Logf("%s: %v", name, err)
		if !strings.Contains(err.Error(), "certificate") {
			t.Errorf("%s: %v, want the reason (a certificate)", name, err)
		}
		if d := time.Since(start); d > storeTimeout+2*time.Second {
			t.Errorf("%s: failed after %s", name, d)
		}
	}
}
