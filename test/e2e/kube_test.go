package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/dysco/dysco/internal/api"
	"github.com/dysco/dysco/internal/kubeapi"
	"github.com/dysco/dysco/internal/lab"
	"github.com/dysco/dysco/internal/testutil"
)

// kubeAPIBin is built by `make build` (make kube).
var kubeAPIBin = filepath.Join("..", "..", "bin", "kube-apiserver")

var (
	dyscoKubeOnce sync.Once
	dyscoKubeBin  string
	dyscoKubeErr  error
)

// dyscoKube builds dysco with the Kubernetes store (-tags kubernetes)
// beside the binary under test.
func dyscoKube(t *testing.T) string {
	t.Helper()
	dyscoKubeOnce.Do(func() {
		dyscoKubeBin = filepath.Join(filepath.Dir(dyscoBin), "dysco-kube")
		out, err := exec.Command("go", "build", "-tags", "kubernetes", "-o", dyscoKubeBin, "../../cmd/dysco").CombinedOutput()
		if err != nil {
			dyscoKubeErr = fmt.Errorf("building dysco-kube: %v\n%s", err, out)
		}
	})
	if dyscoKubeErr != nil {
		t.Fatal(dyscoKubeErr)
	}
	return dyscoKubeBin
}

// kubectl runs kubectl as the administrator of ks in the router's
// namespace; stdin, when not empty, is its input.
func (e *env) kubectl(ks *kubeapi.Server, stdin string, args ...string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cmd := e.lab.Command(ctx, "router", ks.Kubectl(args...)...)
	cmd.Stdin = strings.NewReader(stdin)
	out, err := cmd.CombinedOutput()
	return strings.TrimSpace(string(out)), err
}

// mustKubectl is kubectl that fails the test on an error.
func (e *env) mustKubectl(ks *kubeapi.Server, stdin string, args ...string) string {
	e.t.Helper()
	out, err := e.kubectl(ks, stdin, args...)
	if err != nil {
		e.t.Fatalf("kubectl %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	return out
}

// startKubeAPI runs kube-apiserver on host at addr over etcd, waits until
// it is ready and returns its process.
func (e *env) startKubeAPI(ks *kubeapi.Server, host string) *lab.Proc {
	e.t.Helper()
	p, err := e.lab.Start(host, "kube-apiserver", ks.Argv(kubeAPIBin)...)
	if err != nil {
		e.t.Fatal(err)
	}
	dial := func(ctx context.Context, network, addr string) (net.Conn, error) {
		return e.lab.Dial(ctx, "router", network, addr)
	}
	if err := ks.Ready(context.Background(), 90*time.Second, dial, p.Done()); err != nil {
		log, _ := os.ReadFile(p.Log)
		e.t.Fatalf("%v; its log ends: %s", err, string(log[max(0, len(log)-1500):]))
	}
	return p
}

// startKubeReplica runs `dysco-kube policy-server --kubernetes` on host
// at listen, and waits until it serves.
func (e *env) startKubeReplica(ks *kubeapi.Server, host, name, listen string) *lab.Proc {
	e.t.Helper()
	ready := filepath.Join(e.t.TempDir(), "ready")
	p, err := e.lab.Start(host, name, dyscoKube(e.t), "policy-server", "--insecure", "--listen", listen, "--metrics-listen", "",
		"--kubernetes", "--kubeconfig", ks.Kubeconfig, "--kube-lease", "3s", "--ready-file", ready, "--agent-ttl", "3s")
	if err != nil {
		e.t.Fatal(err)
	}
	testutil.Eventually(e.t, 30*time.Second, name+"'s ready file", func() bool { _, err := os.Stat(ready); return err == nil })
	return p
}

// TestKubeAgents: agents in lab namespaces follow policies written as
// Kubernetes objects with kubectl. A real kube-apiserver over a real etcd
// runs on the kube host; two dysco-kube replicas serve the agents, which
// ask the router's first. A Policy selecting the client's Node by label,
// with a chain of a MiddleboxType whose instance is a Pod's address (Pods
// exist only as objects: nothing runs them), reaches the client's agent
// only, and sessions go through mb1. The controller's replica is killed
// with SIGKILL and a change still arrives; the agents are Leases. With the
// API server killed, sessions go on and are set up, an agent restarts
// from its cache, and a write through a replica fails fast with the
// reason; once it is back a deletion reaches the agents.
func TestKubeAgents(t *testing.T) {
	for _, b := range []string{kubeAPIBin, etcdBin} {
		if _, err := os.Stat(b); err != nil {
			t.Fatalf("%v: run `make build` (it builds bin/kube-apiserver and bin/etcd)", err)
		}
	}
	dyscoKube(t)
	hosts := []string{"client", "mb1", "server", "kube"}
	// A star lab's addresses are known before it is up: host i on
	// 10.200.(i+1).2, the router on .1 of each link.
	a := "http://10.200.4.2:7017"
	b := "http://10.200.1.1:7027"
	both := b + "," + a
	e := newLab(t, labOpts{topology: lab.Star(hosts...), prefix: "ku", agentArgs: []string{"--policy-server", both}})
	if e.addr("kube", false).String() != "10.200.4.2" || e.host("client").Gateway4.String() != "10.200.1.1" {
		t.Fatalf("star addressing changed: kube %s, client's gateway %s", e.addr("kube", false), e.host("client").Gateway4)
	}
	etcd := startEtcdCluster(e, "kube")
	dir := t.TempDir()
	ks, err := kubeapi.Prepare(dir, netip.AddrPortFrom(e.addr("kube", false), 6443), etcd.endpoints())
	if err != nil {
		t.Fatal(err)
	}
	api0 := e.startKubeAPI(ks, "kube")
	command := func(ctx context.Context, name string, args ...string) *exec.Cmd {
		return e.lab.Command(ctx, "router", append([]string{name}, args...)...)
	}
	if err := ks.Install(context.Background(), command); err != nil {
		t.Fatal(err)
	}
	replicas := map[int]*lab.Proc{}
	for _, r := range []struct{ host, name, listen string }{{"kube", "replica-a", "10.200.4.2:7017"}, {"router", "replica-b", "10.200.1.1:7027"}} {
		p := e.startKubeReplica(ks, r.host, r.name, r.listen)
		replicas[p.Pid()] = p
	}
	mb1 := e.addr("mb1", false).String()
	dst := e.addr("server", false)
	through := func() uint64 { return e.status("mb1").Counters["setup_cont"] }
	// filterAt is the filter of policy name that host's agent enforces
	// ("" for none).
	filterAt := func(host, name string) string {
		var set api.PolicySet
		if err := json.Unmarshal([]byte(e.dysco(host, "policy", "list", "-o", "json")), &set); err != nil {
			t.Fatal(err)
		}
		for _, p := range set.Policies {
			if p.Name == name {
				return p.Filter
			}
		}
		return ""
	}

	// Nodes with labels, a Pod as mb1's instance, a type selecting it
	// and a policy selecting the client's node, all with kubectl.
	var objs []string
	for _, h := range []string{"client", "mb1", "server"} {
		objs = append(objs, fmt.Sprintf(`{"apiVersion":"v1","kind":"Node","metadata":{"name":%q,"labels":{"dysco.io/role":%q}}}`, h, h))
	}
	objs = append(objs, `{"apiVersion":"v1","kind":"Pod","metadata":{"name":"fw-0","namespace":"dysco-system","labels":{"app":"fw"}},
		"spec":{"containers":[{"name":"fw","image":"example.invalid/fw"}]}}`)
	e.mustKubectl(ks, `{"apiVersion":"v1","kind":"List","items":[`+strings.Join(objs, ",")+`]}`, "apply", "-f", "-")
	e.mustKubectl(ks, "", "patch", "pod", "fw-0", "-n", "dysco-system", "--subresource=status", "--type=merge", "-p",
		fmt.Sprintf(`{"status":{"podIP":%q,"podIPs":[{"ip":%q}],"conditions":[{"type":"Ready","status":"True"}]}}`, mb1, mb1))
	policy := func(ports string) string {
		return fmt.Sprintf(`apiVersion: dysco.io/v1alpha1
kind: MiddleboxType
metadata: {name: fw}
spec:
  podSelector: {matchLabels: {app: fw}}
  podNamespace: dysco-system
---
apiVersion: dysco.io/v1alpha1
kind: Policy
metadata: {name: web}
spec:
  filter: tcp dst portrange %s
  chain: [{type: fw}]
  nodeSelector: {matchLabels: {dysco.io/role: client}}
`, ports)
	}
	e.mustKubectl(ks, policy("9400-9409"), "apply", "-f", "-")
	start := time.Now()
	testutil.Eventually(t, 30*time.Second, "the client's agent to enforce web", func() bool { return filterAt("client", "web") != "" })
	t.Logf("the client's agent enforces the Policy %s after kubectl apply", time.Since(start).Round(time.Millisecond))
	if got := e.mustKubectl(ks, "", "get", "policy", "web", "-o", "jsonpath={.status.conditions[0].status}"); got != "True" {
		t.Errorf("web's Accepted condition is %q", got)
	}
	for _, h := range []string{"mb1", "server"} {
		if f := filterAt(h, "web"); f != "" {
			t.Errorf("agent %s enforces web (%q), which selects the client's node only", h, f)
		}
	}
	base := through()
	e.exchange("client", "server", dst, 9400, mib)
	if through() != base+1 {
		t.Fatal("the session did not go through mb1, the type's instance")
	}

	// The agents are Leases, and `dysco status --cluster` lists them.
	testutil.Eventually(t, 20*time.Second, "every agent's Lease", func() bool {
		out, err := e.kubectl(ks, "", "get", "leases", "-n", "dysco-system", "-l", "dysco.io/agent=true", "-o", "jsonpath={.items[*].spec.holderIdentity}")
		got := strings.Fields(out)
		slices.Sort(got)
		return err == nil && slices.Equal(got, []string{"client", "kube", "mb1", "server"})
	})
	if out := e.dysco("client", "status", "--cluster", "--server", both); !strings.Contains(out, "mb1") || !strings.Contains(out, "kube") {
		t.Errorf("dysco status --cluster:\n%s", out)
	}

	// The controller's replica killed: the other takes over within the
	// Lease and the next change reaches the client.
	pid, err := ks.ControllerPID(context.Background(), command)
	if err != nil {
		t.Fatal(err)
	}
	ctl := replicas[pid]
	if ctl == nil {
		t.Fatalf("the controller's Lease names process %d, not a replica", pid)
	}
	syscall.Kill(pid, syscall.SIGKILL)
	<-ctl.Done()
	start = time.Now()
	e.mustKubectl(ks, policy("9410-9419"), "apply", "-f", "-")
	testutil.Eventually(t, 30*time.Second, "the change after the controller's kill", func() bool {
		return filterAt("client", "web") == "tcp dst portrange 9410-9419"
	})
	t.Logf("controller %s killed; the next change at the client %s after kubectl apply", ctl.Name, time.Since(start).Round(time.Millisecond))
	base = through()
	e.exchange("client", "server", dst, 9410, mib)
	if through() != base+1 {
		t.Fatal("the session on the changed ports did not go through mb1")
	}
	// The surviving replica's URL.
	alive := a
	if ctl.Name == "replica-a" {
		alive = b
	}

	// The API server killed: a session set up before goes on, new ones
	// are set up under the policies held (also by a restarted agent),
	// and a write through a replica fails fast with the reason.
	live, served := e.openSession("client", "server", dst, 9411, mib)
	base = through()
	syscall.Kill(api0.Pid(), syscall.SIGKILL)
	<-api0.Done()
	start = time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	out, werr := e.lab.Command(ctx, "client", dyscoBin, "policy", "add", "nope", "--server", alive, "tcp dst port 9499").CombinedOutput()
	cancel()
	if werr == nil || !strings.Contains(string(out), "Kubernetes API server cannot be reached") {
		t.Fatalf("a write with the API server down: %v\n%s", werr, out)
	}
	if d := time.Since(start); d > 15*time.Second {
		t.Errorf("the CLI failed after %s", d)
	}
	t.Logf("with the API server down the CLI failed after %s", time.Since(start).Round(time.Millisecond))
	if err := transfer(live, 1, 2, mib); err != nil {
		t.Fatalf("the session set up before the API server's loss: %v", err)
	}
	if err := <-served; err != nil {
		t.Fatalf("server side: %v", err)
	}
	e.exchange("client", "server", dst, 9412, mib)
	if err := e.lab.RestartAgent("client"); err != nil {
		t.Fatal(err)
	}
	e.exchange("client", "server", dst, 9413, mib)
	if through() < base+2 {
		t.Fatalf("new sessions with the API server down did not go through mb1 (setup_cont %d -> %d)", base, through())
	}

	// The API server back: a deletion reaches the client.
	e.startKubeAPI(ks, "kube")
	e.mustKubectl(ks, "", "delete", "policy", "web")
	testutil.Eventually(t, 30*time.Second, "the client to drop web", func() bool { return filterAt("client", "web") == "" })
	base = through()
	e.exchange("client", "server", dst, 9414, mib)
	if through() != base {
		t.Fatal("a session went through mb1 after its policy was deleted")
	}
}
