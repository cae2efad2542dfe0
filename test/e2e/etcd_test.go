package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/dysco/dysco/internal/agent"
	"github.com/dysco/dysco/internal/api"
	"github.com/dysco/dysco/internal/lab"
	"github.com/dysco/dysco/internal/testutil"
)

// etcdBin and etcdctlBin are built by `make build` (test/etcd).
var (
	etcdBin    = filepath.Join("..", "..", "bin", "etcd")
	etcdctlBin = filepath.Join("..", "..", "bin", "etcdctl")
)

// etcdCluster is a three-member etcd in a lab, one member per etcd host.
type etcdCluster struct {
	e       *env
	hosts   []string
	dirs    []string
	members []*lab.Proc
}

func (c *etcdCluster) clientURL(i int) string {
	return "http://" + c.e.addr(c.hosts[i], false).String() + ":2379"
}

func (c *etcdCluster) endpoints() string {
	var urls []string
	for i := range c.hosts {
		urls = append(urls, c.clientURL(i))
	}
	return strings.Join(urls, ",")
}

// start runs member i (again, on its data directory).
func (c *etcdCluster) start(i int) {
	c.e.t.Helper()
	var initial []string
	for j, h := range c.hosts {
		initial = append(initial, fmt.Sprintf("m%d=http://%s:2380", j, c.e.addr(h, false)))
	}
	addr := c.e.addr(c.hosts[i], false).String()
	p, err := c.e.lab.Start(c.hosts[i], "etcd", etcdBin, "--name", fmt.Sprintf("m%d", i), "--data-dir", c.dirs[i],
		"--listen-client-urls", "http://"+addr+":2379", "--advertise-client-urls", "http://"+addr+":2379",
		"--listen-peer-urls", "http://"+addr+":2380", "--initial-advertise-peer-urls", "http://"+addr+":2380",
		"--initial-cluster", strings.Join(initial, ","), "--initial-cluster-token", c.e.lab.Name(),
		// Short elections: a lost leader is replaced within about a second.
		"--heartbeat-interval", "50", "--election-timeout", "500")
	if err != nil {
		c.e.t.Fatal(err)
	}
	c.members[i] = p
}

// kill ends member i with SIGKILL.
func (c *etcdCluster) kill(i int) {
	c.e.t.Helper()
	syscall.Kill(c.members[i].Pid(), syscall.SIGKILL)
	<-c.members[i].Done()
}

// etcdctl runs etcdctl in the router's namespace against every member.
func (c *etcdCluster) etcdctl(args ...string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	out, err := c.e.lab.Command(ctx, "router", append([]string{etcdctlBin, "--endpoints", c.endpoints(), "--dial-timeout", "2s", "--command-timeout", "3s"}, args...)...).CombinedOutput()
	return string(out), err
}

// leader is the index of the member that leads now (-1: none known).
func (c *etcdCluster) leader() int {
	out, err := c.etcdctl("endpoint", "status", "-w", "json")
	if err != nil && !strings.HasPrefix(strings.TrimSpace(out), "[") {
		return -1
	}
	var st []struct {
		Endpoint string
		Status   struct {
			Header struct {
				MemberID uint64 `json:"member_id"`
			}
			Leader uint64
		}
	}
	if json.Unmarshal([]byte(out[:strings.LastIndex(out, "]")+1]), &st) != nil {
		return -1
	}
	for _, s := range st {
		if s.Status.Leader != 0 && s.Status.Leader == s.Status.Header.MemberID {
			for i := range c.hosts {
				if s.Endpoint == c.clientURL(i) {
					return i
				}
			}
		}
	}
	return -1
}

// waitHealthy waits until every member is up and the cluster has a leader.
func (c *etcdCluster) waitHealthy(what string) {
	c.e.t.Helper()
	testutil.Eventually(c.e.t, 30*time.Second, what, func() bool {
		_, err := c.etcdctl("endpoint", "health")
		return err == nil
	})
}

// startEtcdCluster runs a member on each of hosts and waits for a leader.
func startEtcdCluster(e *env, hosts ...string) *etcdCluster {
	e.t.Helper()
	for _, b := range []string{etcdBin, etcdctlBin} {
		if _, err := os.Stat(b); err != nil {
			e.t.Fatalf("%v: run `make build` (it builds bin/etcd and bin/etcdctl from test/etcd)", err)
		}
	}
	c := &etcdCluster{e: e, hosts: hosts, members: make([]*lab.Proc, len(hosts))}
	dir := e.t.TempDir()
	for i := range hosts {
		c.dirs = append(c.dirs, filepath.Join(dir, fmt.Sprintf("m%d", i)))
		c.start(i)
	}
	c.waitHealthy("the etcd cluster to start")
	return c
}

// startReplica runs a policy server over etcd endpoints on host at
// listen, and waits until it serves.
func (e *env) startReplica(host, name, listen, endpoints string) *lab.Proc {
	e.t.Helper()
	ready := filepath.Join(e.t.TempDir(), "ready")
	p, err := e.lab.Start(host, name, dyscoBin, "policy-server", "--insecure", "--listen", listen, "--metrics-listen", "",
		"--etcd", endpoints, "--ready-file", ready, "--agent-ttl", "3s")
	if err != nil {
		e.t.Fatal(err)
	}
	testutil.Eventually(e.t, 20*time.Second, name+"'s ready file", func() bool { _, err := os.Stat(ready); return err == nil })
	return p
}

// serverGet GETs path from the policy server at url, from the client's
// namespace; it returns the status and the body.
func (e *env) serverGet(url, path string) (int, string) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	out, _ := e.lab.Command(ctx, "client", "curl", "-sS", "-m", "8", "-w", "\n%{http_code}", url+path).Output()
	s := strings.TrimSpace(string(out))
	i := strings.LastIndex(s, "\n")
	code, _ := strconv.Atoi(s[i+1:])
	return code, s[:max(i, 0)]
}

// newPoliciesRE matches an agent's log line for a set taken from the server.
var newPoliciesRE = regexp.MustCompile(`new policies .*version=(\d+) policies=(\d+)`)

// appliedInOrder checks an agent's log: the sets it took from the policy
// servers came in rising versions, and (policies are only added while
// the test runs) never with fewer policies than the one before.
func (e *env) appliedInOrder(host string) {
	e.t.Helper()
	data, err := os.ReadFile(e.lab.Agent(host).Log)
	if err != nil {
		e.t.Fatal(err)
	}
	var lastV, lastN int
	for _, m := range newPoliciesRE.FindAllStringSubmatch(string(data), -1) {
		v, _ := strconv.Atoi(m[1])
		n, _ := strconv.Atoi(m[2])
		if v <= lastV || n < lastN {
			e.t.Errorf("agent %s took version %d (%d policies) after version %d (%d policies)", host, v, n, lastV, lastN)
		}
		lastV, lastN = v, n
	}
	if lastV == 0 {
		e.t.Errorf("agent %s logged no set from the policy servers", host)
	}
}

// TestEtcdCluster: policy servers over a real three-member etcd cluster in
// the lab. Replica a (on etcd1's host) uses every member; replica b (on
// the router) only the third member; the agents ask b first, then a. A
// policy reaches every agent; the leader killed with SIGKILL during 100
// updates loses and reorders none of them at any agent; with the third
// member's link down its replica refuses polls and the agents move on to
// the other; with two members killed, sessions go on, new ones are set up
// under the policies held (also by a restarted agent), the CLI fails fast
// with the reason, and the agents catch up once the quorum is back. A
// replica whose watch resumes from a compacted revision reloads the set.
func TestEtcdCluster(t *testing.T) {
	hosts := []string{"client", "mb1", "server", "etcd1", "etcd2", "etcd3"}
	// The addresses of a star lab are known before it is up: host i on
	// 10.200.(i+1).2, the router on .1 of each link.
	a := "http://10.200.4.2:7017"
	b := "http://10.200.1.1:7027"
	e := newLab(t, labOpts{topology: lab.Star(hosts...), prefix: "ec", agentArgs: []string{"--policy-server", b + "," + a}})
	if e.addr("etcd1", false).String() != "10.200.4.2" || e.host("client").Gateway4.String() != "10.200.1.1" {
		t.Fatalf("star addressing changed: etcd1 %s, client's gateway %s", e.addr("etcd1", false), e.host("client").Gateway4)
	}
	c := startEtcdCluster(e, "etcd1", "etcd2", "etcd3")
	e.startReplica("etcd1", "replica-a", "10.200.4.2:7017", c.endpoints())
	e.startReplica("router", "replica-b", "10.200.1.1:7027", c.clientURL(2))
	both := b + "," + a
	mb1 := e.addr("mb1", false).String()
	dst := e.addr("server", false)

	// version is the set's version at replica a, once it has a quorum
	// (without one, it refuses to list a set that may be behind).
	version := func() uint64 {
		t.Helper()
		var set api.PolicySet
		testutil.Eventually(t, 15*time.Second, "replica a to list its policies", func() bool {
			code, body := e.serverGet(a, "/v1/policies")
			if code == 503 {
				return false
			}
			if code != 200 || json.Unmarshal([]byte(body), &set) != nil {
				t.Fatalf("policies at replica a: %d %s", code, body)
			}
			return true
		})
		return set.Version
	}
	// converged waits until every agent (but those of skip) enforces
	// version v or later.
	converged := func(what string, v uint64, within time.Duration, skip ...string) time.Duration {
		t.Helper()
		start := time.Now()
		testutil.Eventually(t, within, what, func() bool {
			for _, h := range hosts {
				if slices.Contains(skip, h) {
					continue
				}
				if e.status(h).PolicyVersion < v {
					return false
				}
			}
			return true
		})
		return time.Since(start)
	}
	add := func(name, filter string) error {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		out, err := e.lab.Command(ctx, "client", dyscoBin, "policy", "add", name, "--server", both, "--chain", mb1, filter).CombinedOutput()
		if err != nil {
			return fmt.Errorf("%v: %s", err, out)
		}
		return nil
	}
	through := func() uint64 { return e.status("mb1").Counters["setup_cont"] }

	// A policy reaches every agent, and every registration says so.
	if err := add("web", "tcp dst portrange 9400-9409"); err != nil {
		t.Fatal(err)
	}
	v := version()
	t.Logf("first policy at every agent %s after the CLI returned", converged("every agent to take the first policy", v, 30*time.Second).Round(time.Millisecond))
	testutil.Eventually(t, 10*time.Second, "every registration to show the version", func() bool {
		code, body := e.serverGet(b, "/v1/agents")
		var regs []api.AgentRegistration
		if code != 200 || json.Unmarshal([]byte(body), &regs) != nil || len(regs) != len(hosts) {
			return false
		}
		for _, r := range regs {
			if r.Applied < v {
				return false
			}
		}
		return true
	})
	base := through()
	e.exchange("client", "server", dst, 9400, mib)
	if through() != base+1 {
		t.Fatal("the session did not go through mb1")
	}

	// The leader killed with SIGKILL during 100 updates of one policy:
	// every agent ends with the last, having taken versions in order.
	lead := c.leader()
	for i := range 100 {
		if i == 10 {
			c.kill(lead)
		}
		filter := fmt.Sprintf("tcp dst port %d", 20000+i)
		deadline := time.Now().Add(20 * time.Second)
		for {
			err := add("seq", filter)
			if err == nil {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("update %d after the leader's loss: %v", i, err)
			}
		}
	}
	v = version()
	t.Logf("leader m%d killed during the updates; the last at every agent %s after the CLI returned", lead,
		converged("every agent to take the 100 updates", v, 30*time.Second).Round(time.Millisecond))
	for _, h := range hosts {
		var set api.PolicySet
		if err := json.Unmarshal([]byte(e.dysco(h, "policy", "list", "-o", "json")), &set); err != nil {
			t.Fatal(err)
		}
		for _, p := range set.Policies {
			if p.Name == "seq" && p.Filter != "tcp dst port 20099" {
				t.Errorf("agent %s enforces %q, not the last update", h, p.Filter)
			}
		}
		e.appliedInOrder(h)
	}
	c.start(lead)
	c.waitHealthy("the killed leader to rejoin")

	// The third member's link down: replica b, which only knows that
	// member, says it has no quorum, and the agents move on to replica a.
	// Meanwhile a write and a compaction: when the link is back, b's
	// watch resumes from a compacted revision and b reloads the set.
	// The router's end of etcd3's link goes down: etcd3 keeps its own
	// routes, which come back with the link.
	cut := ""
	for _, i := range e.host("router").Ifaces {
		if i.Peer == "etcd3" {
			cut = i.Name
		}
	}
	if cut == "" {
		t.Fatal("no router interface towards etcd3")
	}
	e.run("router", "ip", "link", "set", cut, "down")
	testutil.Eventually(t, 15*time.Second, "replica b to see it has no quorum", func() bool {
		code, _ := e.serverGet(b, "/healthz")
		return code == 503
	})
	if err := add("cut", "tcp dst port 9410"); err != nil {
		t.Fatalf("a write with one member cut off: %v", err)
	}
	v = version()
	// etcd3's own agent is cut off with its link.
	converged("every agent to take the policy from replica a", v, 30*time.Second, "etcd3")
	out, err := c.etcdctl("endpoint", "status", "-w", "json")
	rev := regexp.MustCompile(`"revision":(\d+)`).FindStringSubmatch(out)
	if rev == nil {
		t.Fatalf("etcd revision: %v %s", err, out)
	}
	if out, err := c.etcdctl("compact", rev[1], "--physical"); err != nil {
		t.Fatalf("compact: %v %s", err, out)
	}
	e.run("router", "ip", "link", "set", cut, "up")
	testutil.Eventually(t, 30*time.Second, "replica b to catch up", func() bool {
		code, body := e.serverGet(b, "/healthz")
		var h struct{ Version uint64 }
		return code == 200 && json.Unmarshal([]byte(body), &h) == nil && h.Version == v
	})
	converged("etcd3's agent to catch up", v, 30*time.Second)

	// An agent stopped: its registration lapses with its lease, and
	// operations for it are refused, with the reason.
	if err := e.lab.Agent("etcd2").Stop(); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	testutil.Eventually(t, 15*time.Second, "etcd2's registration to lapse", func() bool {
		code, body := e.serverGet(a, "/v1/agents")
		return code == 200 && !strings.Contains(body, `"etcd2"`)
	})
	t.Logf("etcd2's registration lapsed %s after its agent stopped (--agent-ttl 3s)", time.Since(start).Round(100*time.Millisecond))
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	refused, rerr := e.lab.Command(ctx, "client", dyscoBin, "middlebox", "remove", "--server", both, "--host", "etcd2").CombinedOutput()
	cancel()
	if rerr == nil || !strings.Contains(string(refused), `no agent named "etcd2" is registered`) {
		t.Fatalf("an operation for the lapsed agent: %v\n%s", rerr, refused)
	}
	if err := e.lab.RestartAgent("etcd2"); err != nil {
		t.Fatal(err)
	}

	// Two members killed: no quorum.
	live, served := e.openSession("client", "server", dst, 9401, mib)
	base = through()
	if base == 0 {
		t.Fatal("mb1 counted no session")
	}
	// The live session, as mb1's agent lists it, asked through the store.
	var ss []api.Session
	if err := json.Unmarshal([]byte(e.dysco("client", "sessions", "--server", both, "--host", "mb1", "-o", "json")), &ss); err != nil {
		t.Fatal(err)
	}
	if !slices.ContainsFunc(ss, func(s api.Session) bool { return strings.HasSuffix(s.Session, ":9401") && s.Role == "middle" }) {
		t.Fatalf("mb1's sessions through the policy servers: %+v, want the live one on port 9401", ss)
	}
	var hist api.ReconfigReply
	if err := json.Unmarshal([]byte(e.dysco("client", "reconfig", "history", "--server", both, "--host", "client", "--json")), &hist); err != nil {
		t.Fatalf("the client's history through the policy servers: %v", err)
	}
	c.kill(0)
	c.kill(1)
	start = time.Now()
	err = add("nope", "tcp dst port 9411")
	if err == nil || !strings.Contains(err.Error(), "no quorum") {
		t.Fatalf("a write without a quorum: %v, want the no-quorum error", err)
	}
	if d := time.Since(start); d > 15*time.Second {
		t.Errorf("the CLI failed after %s", d)
	}
	t.Logf("without a quorum the CLI failed after %s", time.Since(start).Round(time.Millisecond))
	if err := transfer(live, 1, 2, mib); err != nil {
		t.Fatalf("the session set up before the quorum was lost: %v", err)
	}
	if err := <-served; err != nil {
		t.Fatalf("server side: %v", err)
	}
	e.exchange("client", "server", dst, 9402, mib)
	if err := e.lab.RestartAgent("client"); err != nil {
		t.Fatal(err)
	}
	e.exchange("client", "server", dst, 9403, mib)
	if through() < base+2 {
		t.Fatalf("new sessions without a quorum did not go through mb1 (setup_cont %d -> %d)", base, through())
	}
	c.start(0)
	c.start(1)
	c.waitHealthy("the killed members to rejoin")
	testutil.Eventually(t, 30*time.Second, "the quorum to be back", func() bool { return add("back", "tcp dst port 9412") == nil })
	converged("every agent to catch up", version(), 30*time.Second)

	for _, h := range hosts {
		e.appliedInOrder(h)
	}
}

// TestEtcdOperationsBackToBack: sixteen operator reconfigurations of one
// live transfer, back to back through two replicas over etcd, the first
// replica asked killed after four and started again after eight, the
// client's agent restarted after eleven: every one succeeds, the transfer
// is intact, and every agent is registered with the version in force.
func TestEtcdOperationsBackToBack(t *testing.T) {
	hosts := []string{"client", "mb1", "mb2", "server", "etcd1", "etcd2", "etcd3"}
	// Host i of a star lab is 10.200.(i+1).2.
	a, b := "http://10.200.5.2:7017", "http://10.200.6.2:7017"
	both := b + "," + a
	e := newLab(t, labOpts{topology: lab.Star(hosts...), prefix: "eo", agentArgs: []string{"--policy-server", both}})
	if e.addr("etcd2", false).String() != "10.200.6.2" {
		t.Fatalf("star addressing changed: etcd2 %s", e.addr("etcd2", false))
	}
	c := startEtcdCluster(e, "etcd1", "etcd2", "etcd3")
	e.startReplica("etcd1", "replica-a", "10.200.5.2:7017", c.endpoints())
	pb := e.startReplica("etcd2", "replica-b", "10.200.6.2:7017", c.endpoints())
	dst := e.addr("server", false)
	mb1, mb2 := e.addr("mb1", false).String(), e.addr("mb2", false).String()
	e.dysco("client", "policy", "add", "web", "--server", both, "--chain", mb1, "tcp dst port 9500")
	testutil.Eventually(t, 20*time.Second, "the policy at the client", func() bool { return e.status("client").PolicyVersion > 0 })
	lt := e.startTransfer("client", "server", dst, 9500, 160*mib, 8*mib)
	testutil.Eventually(t, 30*time.Second, "the transfer to start", func() bool { return lt.received.Load() > 2*mib })
	for i := range 16 {
		switch i {
		case 4:
			syscall.Kill(pb.Pid(), syscall.SIGKILL)
			<-pb.Done()
		case 8:
			e.startReplica("etcd2", "replica-b2", "10.200.6.2:7017", c.endpoints())
		case 11:
			if err := e.lab.RestartAgent("client"); err != nil {
				t.Fatal(err)
			}
			restarted := time.Now() // the new agent's polls only
			// A restart that outlasts the registration's TTL (3 s)
			// leaves the agent unregistered, and operations for it
			// refused, until its first poll is registered.
			testutil.Eventually(t, 15*time.Second, "the restarted agent's registration", func() bool {
				code, body := e.serverGet(a, "/v1/agents")
				var regs []api.AgentRegistration
				if code != 200 || json.Unmarshal([]byte(body), &regs) != nil {
					return false
				}
				for _, r := range regs {
					if r.Host == "client" && r.Seen.After(restarted) {
						return true
					}
				}
				return false
			})
		}
		to := mb2
		if i%2 == 1 {
			to = mb1
		}
		out := e.dysco("client", "reconfig", "--json", "--server", both, "--host", "client",
			"--match", "tcp dst port 9500", "--to", dst.String(), "--chain", to)
		var rep api.ReconfigReply
		if err := json.Unmarshal([]byte(out), &rep); err != nil || len(rep.Results) != 1 || rep.Results[0].Outcome != "succeeded" {
			t.Fatalf("operation %d (to %s): %v\n%s", i, to, err, out)
		}
	}
	lt.wait(t)
	// Every agent registered with the version in force, and with its
	// release and wire versions: one, so no warning.
	out := e.dysco("client", "status", "--cluster", "--server", both)
	if !strings.Contains(out, fmt.Sprintf("%d agents, 0 behind", len(hosts))) || strings.Count(out, agent.WireVersion()) != len(hosts) || strings.Contains(out, "warning") {
		t.Errorf("status --cluster:\n%s", out)
	}
	// The restarted agent's history holds the operations since.
	var hist api.ReconfigReply
	if err := json.Unmarshal([]byte(e.dysco("client", "reconfig", "history", "--server", both, "--host", "client", "--json")), &hist); err != nil || len(hist.Results) != 5 {
		t.Errorf("the client's history through the policy servers: %v, %d results, want 5", err, len(hist.Results))
	}
}
