// Package kubestore tests `dysco policy-server --kubernetes` against a
// real API server: policies written through a replica or as objects reach
// the agents' polls at every replica, invalid objects are refused in their
// status and kept out of the set, the controller's death is survived, and
// agents register as Leases.
package kubestore

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"sigs.k8s.io/controller-runtime/pkg/envtest"

	"github.com/dysco/dysco/internal/api"
	"github.com/dysco/dysco/internal/policyserver"
	"github.com/dysco/dysco/internal/testutil"
)

// start runs etcd and kube-apiserver with the CRDs of deploy/crds and the
// namespace dysco-system, and returns an administrator's kubeconfig file
// and clients.
func start(t *testing.T) (string, kubernetes.Interface, dynamic.Interface) {
	t.Helper()
	if !policyserver.KubeSupport {
		t.Fatal("the Kubernetes store is built with -tags kubernetes: go test -tags kubernetes ./... (make test does)")
	}
	bin, _ := filepath.Abs(filepath.Join("..", "..", "bin"))
	for _, b := range []string{"kube-apiserver", "etcd"} {
		if _, err := os.Stat(filepath.Join(bin, b)); err != nil {
			t.Fatalf("%v: run `make build` (it builds bin/etcd and bin/kube-apiserver)", err)
		}
	}
	env := &envtest.Environment{BinaryAssetsDirectory: bin,
		CRDInstallOptions: envtest.CRDInstallOptions{Paths: []string{filepath.Join("..", "..", "deploy", "crds")}, ErrorIfPathMissing: true}}
	cfg, err := env.Start()
	if err != nil {
		t.Fatalf("starting etcd and kube-apiserver: %v", err)
	}
	t.Cleanup(func() { env.Stop() })
	cs := kubernetes.NewForConfigOrDie(cfg)
	dyn := dynamic.NewForConfigOrDie(cfg)
	if _, err := cs.CoreV1().Namespaces().Create(t.Context(), &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: policyserver.DefaultKubeNamespace}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	user, err := env.ControlPlane.AddUser(envtest.User{Name: "dysco-policy-server", Groups: []string{"system:masters"}}, nil)
	if err != nil {
		t.Fatal(err)
	}
	kc, err := user.KubeConfig()
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(t.TempDir(), "kubeconfig")
	if err := os.WriteFile(path, kc, 0o600); err != nil {
		t.Fatal(err)
	}
	return path, cs, dyn
}

type replica struct {
	s   *policyserver.Server
	srv *httptest.Server
}

func (r *replica) close() {
	r.srv.CloseClientConnections()
	r.srv.Close()
	r.s.Close()
}

// startReplica starts a replica over the API server of kc; with (if
// given) changes its configuration first.
func startReplica(t *testing.T, kc string, with ...func(*policyserver.Config)) *replica {
	t.Helper()
	cfg := policyserver.Config{Insecure: true, Kubernetes: true, Kubeconfig: kc, KubeLease: 3 * time.Second,
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil)),
		ValidatePolicy: func(p api.Policy) error {
			if strings.Contains(p.Filter, "bogus") {
				return errors.New("filter: syntax error")
			}
			return nil
		}}
	for _, f := range with {
		f(&cfg)
	}
	s, err := policyserver.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	r := &replica{s: s, srv: httptest.NewServer(s.Handler())}
	t.Cleanup(r.close)
	return r
}

// set is what an agent named host gets from r now.
func set(t *testing.T, r *replica, host string) api.PolicySet {
	t.Helper()
	resp, err := http.Get(r.srv.URL + "/v1/watch?host=" + host + "&after=0&wait=0")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var ps api.PolicySet
	json.NewDecoder(resp.Body).Decode(&ps)
	return ps
}

func names(ps api.PolicySet) string {
	var out []string
	for _, p := range ps.Policies {
		out = append(out, p.Name)
	}
	return strings.Join(out, ",")
}

func TestKubeStore(t *testing.T) {
	kc, _, dyn := start(t)
	a, b := startReplica(t, kc), startReplica(t, kc)
	c := api.NewServerClient(a.srv.URL)
	ctx := t.Context()

	// Through a replica's API: every replica serves it.
	if err := c.PutPolicy(ctx, api.Policy{Name: "web", Filter: "tcp dst port 80"}); err != nil {
		t.Fatal(err)
	}
	testutil.Eventually(t, 20*time.Second, "replica b to serve web", func() bool { return names(set(t, b, "h1")) == "web" })
	v1 := set(t, b, "h1").Version

	// As objects, the way kubectl writes them: a valid one is published;
	// one whose filter libpcap refuses is kept out, with the reason in
	// its status.
	pol := schema.GroupVersionResource{Group: "dysco.io", Version: "v1alpha1", Resource: "policies"}
	for name, filter := range map[string]string{"ssh": "tcp dst port 22", "broken": "tcp bogus"} {
		obj := &unstructured.Unstructured{Object: map[string]any{"apiVersion": "dysco.io/v1alpha1", "kind": "Policy",
			"metadata": map[string]any{"name": name}, "spec": map[string]any{"filter": filter, "nodes": []any{"h1"}}}}
		if _, err := dyn.Resource(pol).Create(ctx, obj, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	testutil.Eventually(t, 20*time.Second, "ssh at replica a", func() bool { return names(set(t, a, "h1")) == "ssh,web" })
	if got := names(set(t, a, "h2")); got != "web" {
		t.Errorf("h2 gets %q, want web only (ssh is for h1)", got)
	}
	testutil.Eventually(t, 20*time.Second, "broken's Accepted=False", func() bool {
		o, err := dyn.Resource(pol).Get(ctx, "broken", metav1.GetOptions{})
		if err != nil {
			return false
		}
		conds, _, _ := unstructured.NestedSlice(o.Object, "status", "conditions")
		return len(conds) == 1 && conds[0].(map[string]any)["status"] == "False" && strings.Contains(conds[0].(map[string]any)["message"].(string), "syntax error")
	})
	if v := set(t, a, "h1").Version; v <= v1 {
		t.Errorf("version %d after a change, was %d", v, v1)
	}

	// Deleted through replica b: gone at a, with a newer version.
	v2 := set(t, a, "h1").Version
	req, _ := http.NewRequest("DELETE", b.srv.URL+"/v1/policies/ssh", nil)
	if resp, err := http.DefaultClient.Do(req); err != nil || resp.StatusCode != 204 {
		t.Fatalf("delete: %v %v", resp, err)
	}
	testutil.Eventually(t, 20*time.Second, "ssh gone at a", func() bool { ps := set(t, a, "h1"); return names(ps) == "web" && ps.Version > v2 })

	// The controller (whichever replica leads) dies: the other takes
	// over within the lease and publishes the next change.
	a.close()
	cb := api.NewServerClient(b.srv.URL)
	if err := cb.PutPolicy(ctx, api.Policy{Name: "dns", Filter: "udp dst port 53"}); err != nil {
		t.Fatal(err)
	}
	testutil.Eventually(t, 30*time.Second, "dns at replica b after a died", func() bool { return names(set(t, b, "h1")) == "dns,web" })

	// The polls registered the agents as Leases, with the version an
	// agent's poll gives.
	if resp, err := http.Get(b.srv.URL + "/v1/watch?host=h2&after=0&wait=0&version=1.0"); err == nil {
		resp.Body.Close()
	}
	testutil.Eventually(t, 10*time.Second, "h1 and h2 registered", func() bool {
		regs, err := cb.Agents(ctx)
		if err != nil {
			return false
		}
		hosts := map[string]string{}
		for _, r := range regs {
			hosts[r.Host] = r.Version
		}
		v1, ok1 := hosts["h1"]
		return ok1 && v1 == "" && hosts["h2"] == "1.0"
	})
}

// TestKubeAgentLeasesSwept: the Lease of an agent that stopped for good is
// deleted by the controller once it has been expired for ExpiredAgentKeep;
// an agent that goes on polling keeps its own.
func TestKubeAgentLeasesSwept(t *testing.T) {
	kc, cs, _ := start(t)
	r := startReplica(t, kc, func(c *policyserver.Config) { c.AgentTTL, c.ExpiredAgentKeep = 2*time.Second, 2*time.Second })
	leases := func() map[string]bool {
		list, err := cs.CoordinationV1().Leases(policyserver.DefaultKubeNamespace).List(t.Context(), metav1.ListOptions{LabelSelector: "dysco.io/agent=true"})
		if err != nil {
			t.Fatal(err)
		}
		out := map[string]bool{}
		for _, l := range list.Items {
			out[l.Annotations["dysco.io/host"]] = true
		}
		return out
	}
	set(t, r, "gone")
	testutil.Eventually(t, 10*time.Second, "the Leases of live and gone", func() bool {
		set(t, r, "live")
		l := leases()
		return l["live"] && l["gone"]
	})
	// gone expires 2 s after its poll and is deleted 2 s later, within
	// a sweep (a second): live's polls renew its Lease meanwhile.
	testutil.Eventually(t, 20*time.Second, "gone's Lease to be deleted", func() bool {
		set(t, r, "live")
		return !leases()["gone"]
	})
	if !leases()["live"] {
		t.Fatal("the Lease of an agent that kept polling was deleted")
	}
}

// TestKubeReplicaStartsWithoutAPIServer: a replica whose API server does
// not answer at start starts all the same and answers 503 (polls, lists,
// /healthz), never an empty set; once the API server answers it serves
// the published set. The API server is reached through a proxy that
// refuses connections until it starts forwarding them.
func TestKubeReplicaStartsWithoutAPIServer(t *testing.T) {
	kc, _, _ := start(t)
	a := startReplica(t, kc)
	if err := api.NewServerClient(a.srv.URL).PutPolicy(t.Context(), api.Policy{Name: "web", Filter: "tcp dst port 80"}); err != nil {
		t.Fatal(err)
	}
	cfg, err := os.ReadFile(kc)
	if err != nil {
		t.Fatal(err)
	}
	serverRE := regexp.MustCompile(`server: https://(127\.0\.0\.1:\d+)`)
	m := serverRE.FindSubmatch(cfg)
	if m == nil {
		t.Fatalf("no API server address in the kubeconfig:\n%s", cfg)
	}
	upstream := string(m[1])
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	proxy := ln.Addr().String()
	ln.Close() // refused until the proxy starts
	kc2 := filepath.Join(t.TempDir(), "kubeconfig")
	if err := os.WriteFile(kc2, serverRE.ReplaceAll(cfg, []byte("server: https://"+proxy)), 0o600); err != nil {
		t.Fatal(err)
	}

	began := time.Now()
	b := startReplica(t, kc2)
	if d := time.Since(began); d > 10*time.Second {
		t.Fatalf("the replica took %v to start without its API server", d)
	}
	get := func(path string) (int, string) {
		resp, err := http.Get(b.srv.URL + path)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		body, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(body)
	}
	for _, path := range []string{"/healthz", "/v1/policies", "/v1/watch?host=h1&after=0&wait=1"} {
		if code, body := get(path); code != http.StatusServiceUnavailable || !strings.Contains(body, "cannot reach the API server") {
			t.Fatalf("GET %s without the API server: %d %s", path, code, body)
		}
	}

	// The proxy starts forwarding: b reads the published set.
	back := time.Now()
	pl, err := net.Listen("tcp", proxy)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { pl.Close() })
	go func() {
		for {
			c, err := pl.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				u, err := net.Dial("tcp", upstream)
				if err != nil {
					return
				}
				defer u.Close()
				go io.Copy(u, c)
				io.Copy(c, u)
			}()
		}
	}()
	testutil.Eventually(t, 60*time.Second, "replica b to serve web", func() bool {
		code, body := get("/v1/policies")
		if code == http.StatusServiceUnavailable {
			return false
		}
		var set api.PolicySet
		if code != http.StatusOK || json.Unmarshal([]byte(body), &set) != nil || names(set) != "web" || set.Version == 0 {
			t.Fatalf("replica b serves %d %s", code, body)
		}
		return true
	})
	t.Logf("replica b served the set %v after the API server's return", time.Since(back).Round(time.Millisecond))
}

// Operations as Operation objects: refused for an agent without a live
// Lease; created at one replica, claimed at the other, reported, and
// waited for; claims racing at both replicas take each operation once.
func TestKubeOperations(t *testing.T) {
	kc, _, _ := start(t)
	a, b := startReplica(t, kc), startReplica(t, kc)
	ca, cb := api.NewServerClient(a.srv.URL), api.NewServerClient(b.srv.URL)
	ctx := t.Context()
	mb := func(timeout int) api.Operation {
		return api.Operation{Host: "mb1", Middlebox: &api.MiddleboxRequest{Match: "tcp", TimeoutMS: timeout}}
	}
	_, err := ca.CreateOperation(ctx, mb(0))
	var he *api.HTTPError
	if !errors.As(err, &he) || he.StatusCode != 409 || !strings.Contains(he.Message, `no agent named "mb1" is registered`) {
		t.Fatalf("operation for an agent without a Lease: %v", err)
	}
	set(t, b, "mb1") // the poll registers mb1
	testutil.Eventually(t, 10*time.Second, "mb1's Lease", func() bool { _, err := ca.CreateOperation(ctx, mb(1500)); return err == nil })
	got, ok, err := cb.ClaimOperation(ctx, "mb1", 10*time.Second)
	if err != nil || !ok || got.State != api.OpRunning || got.Middlebox == nil || got.Middlebox.TimeoutMS != 1500 {
		t.Fatalf("claim at b: %+v %v %v", got, ok, err)
	}
	rep := &api.ReconfigReply{Results: []api.ReconfigResult{{ID: 5, Outcome: "succeeded"}}}
	if err := ca.ReportOperation(ctx, got.ID, api.OperationResult{Host: "mb1", Reply: rep}); err != nil {
		t.Fatal(err)
	}
	done, err := cb.Operation(ctx, got.ID, 10*time.Second)
	if err != nil || done.State != api.OpDone || done.Reply == nil || done.Reply.Results[0].ID != 5 {
		t.Fatalf("the wait at b: %+v %v", done, err)
	}
	if err := cb.ReportOperation(ctx, got.ID, api.OperationResult{Host: "mb1", Reply: rep}); !errors.As(err, &he) || he.StatusCode != 409 {
		t.Fatalf("second report: %v", err)
	}

	// Claims racing at both replicas.
	const n = 10
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
		op, err := []*api.Client{ca, cb}[i%2].CreateOperation(ctx, mb(0))
		if err != nil {
			t.Fatal(err)
		}
		ids = append(ids, op.ID)
	}
	for _, id := range ids {
		if got, err := ca.Operation(ctx, id, 20*time.Second); err != nil || got.State != api.OpFailed || got.Error != `agent "mb1": done` {
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
}
