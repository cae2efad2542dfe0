package bench

// Convergence of policy changes to many agents through the policy servers
// (docs/etcd.md). The agents are light: each is the agent's own policy
// client (psclient.Watch, the long poll, its back-off and its version
// order) without a datapath, so that 50 of them fit on two shared cores
// beside a three-member etcd; the compilation of the policies into the
// agent's maps, the same with any backend, is left out. The delay of one
// agent for one change runs from the start of the operator's write to the
// moment the agent's client delivers the version. Backends: one server
// over bbolt (the baseline), and two replicas over a three-member etcd
// cluster on loopback, half the agents asking each replica first; then
// the etcd leader is killed with SIGKILL and the next change is timed
// from the kill.

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/dysco/dysco/internal/api"
	"github.com/dysco/dysco/internal/kubeapi"
	"github.com/dysco/dysco/internal/labkit"
	"github.com/dysco/dysco/internal/psclient"
)

// convergenceAgents is the number of light agents.
const convergenceAgents = 50

// ConvergenceDetails is the raw data of the convergence figures.
type ConvergenceDetails struct {
	Agents  int `json:"agents"`
	Changes int `json:"changes"`
	// DelaysMS are every agent's delay for every change, by backend.
	DelaysMS map[string][]float64 `json:"delays_ms"`
	// KillToAllMS is, after the etcd leader's SIGKILL, the time until
	// every agent held the first change written after it; WriteRetries
	// the writes refused meanwhile (no quorum during the election).
	KillToAllMS  float64 `json:"kill_to_all_ms"`
	WriteRetries int     `json:"write_retries"`
	// RangesAfterKill is the reads etcd served from the kill until every
	// agent held the change: the replicas' reloads and probes, not one
	// per agent (no re-list).
	RangesAfterKill float64 `json:"ranges_after_kill"`
	// ControllerKillToAllMS is, after the SIGKILL of the replica that
	// controls the Kubernetes store, the time until every agent held the
	// first change written after it; ListsAfterControllerKill the LIST
	// requests the API server served meanwhile (a re-list would be one
	// per watched resource and replica).
	ControllerKillToAllMS    float64 `json:"controller_kill_to_all_ms"`
	ListsAfterControllerKill float64 `json:"lists_after_controller_kill"`
	// ListsBeforeControllerKill is every LIST the API server had served
	// until the kill (the informers' first lists among them).
	ListsBeforeControllerKill float64 `json:"lists_before_controller_kill"`
}

// convergenceRun is one backend's servers and light agents.
type convergenceRun struct {
	urls   []string // the policy servers' URLs
	mu     sync.Mutex
	got    [][]gotSet // per agent, the sets received
	notify chan struct{}
	cancel context.CancelFunc
	done   sync.WaitGroup
}

type gotSet struct {
	version uint64
	at      time.Time
}

// startAgents starts n light agents, agent i asking urls rotated by i.
func (c *convergenceRun) startAgents(n int) {
	ctx, cancel := context.WithCancel(context.Background())
	c.cancel = cancel
	c.got = make([][]gotSet, n)
	c.notify = make(chan struct{}, 1)
	quiet := slog.New(slog.NewTextHandler(io.Discard, nil))
	for i := range n {
		k := i % len(c.urls)
		urls := append(append([]string(nil), c.urls[k:]...), c.urls[:k]...)
		c.done.Add(1)
		go func() {
			defer c.done.Done()
			psclient.Watch(ctx, psclient.WatchConfig{URL: strings.Join(urls, ","), Host: fmt.Sprintf("light%02d", i), Logger: quiet,
				OnUpdate: func(set api.PolicySet) {
					c.mu.Lock()
					c.got[i] = append(c.got[i], gotSet{set.Version, time.Now()})
					c.mu.Unlock()
					select {
					case c.notify <- struct{}{}:
					default:
					}
				}})
		}()
	}
}

func (c *convergenceRun) stop() {
	if c.cancel != nil {
		c.cancel()
		c.done.Wait()
	}
}

// waitAll waits until every agent has version v or later and returns when
// each got it first.
func (c *convergenceRun) waitAll(ctx context.Context, v uint64, within time.Duration) ([]time.Time, error) {
	deadline := time.NewTimer(within)
	defer deadline.Stop()
	for {
		c.mu.Lock()
		at := make([]time.Time, len(c.got))
		missing := 0
		for i, sets := range c.got {
			for _, s := range sets {
				if s.version >= v {
					at[i] = s.at
					break
				}
			}
			if at[i].IsZero() {
				missing++
			}
		}
		c.mu.Unlock()
		if missing == 0 {
			return at, nil
		}
		select {
		case <-c.notify:
		case <-deadline.C:
			return nil, fmt.Errorf("%d of %d agents lack version %d after %s", missing, len(c.got), v, within)
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
}

// convergenceHop is the chain of the policy changed: a documentation
// address; the light agents send no traffic.
var convergenceHop = netip.MustParseAddr("192.0.2.1")

// change writes one policy change through cl, retrying refusals until
// within has passed; it returns the version written and the refusals.
func change(ctx context.Context, cl *api.Client, i int, within time.Duration) (uint64, int, error) {
	p := api.Policy{Name: "conv", Filter: fmt.Sprintf("tcp dst port %d", 20000+i), Chain: []api.Hop{{Addr: convergenceHop}}}
	retries := 0
	end := time.Now().Add(within)
	for {
		err := cl.PutPolicy(ctx, p)
		if err == nil {
			break
		}
		if time.Now().After(end) || ctx.Err() != nil {
			return 0, retries, err
		}
		retries++
	}
	for {
		// A replica whose store lost its quorum refuses to list.
		set, err := cl.Policies(ctx)
		if err == nil || time.Now().After(end) || ctx.Err() != nil {
			return set.Version, retries, err
		}
		select {
		case <-ctx.Done():
		case <-time.After(10 * time.Millisecond):
		}
	}
}

// measure makes changes changes and returns every agent's delay for each,
// in milliseconds.
func (c *convergenceRun) measure(ctx context.Context, cl *api.Client, changes, from int) ([]float64, error) {
	var out []float64
	for i := range changes {
		start := time.Now()
		v, _, err := change(ctx, cl, from+i, 10*time.Second)
		if err != nil {
			return out, err
		}
		at, err := c.waitAll(ctx, v, 30*time.Second)
		if err != nil {
			return out, err
		}
		for _, t := range at {
			out = append(out, math.Max(0, float64(t.Sub(start))/float64(time.Millisecond)))
		}
	}
	return out, nil
}

// msToLast is the time from start to the latest of at, in milliseconds
// (0 when none is later).
func msToLast(start time.Time, at []time.Time) float64 {
	last := start
	for _, t := range at {
		if t.After(last) {
			last = t
		}
	}
	return float64(last.Sub(start)) / float64(time.Millisecond)
}

// percentile is the p-th percentile (0..100) of xs, nearest rank.
func percentile(xs []float64, p float64) float64 {
	if len(xs) == 0 {
		return math.NaN()
	}
	s := slices.Clone(xs)
	slices.Sort(s)
	k := int(math.Ceil(p/100*float64(len(s)))) - 1
	return s[max(0, min(k, len(s)-1))]
}

// loopbackPort is a free TCP port on 127.0.0.1.
func loopbackPort() (int, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port, nil
}

// convProcs are the processes a convergence run started.
type convProcs struct {
	dir   string
	procs []*exec.Cmd
}

func (p *convProcs) start(name string, argv ...string) (*exec.Cmd, error) {
	logf, err := os.Create(filepath.Join(p.dir, name+".log"))
	if err != nil {
		return nil, err
	}
	defer logf.Close()
	cmd := exec.Command(argv[0], argv[1:]...)
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("%s: %w", name, err)
	}
	p.procs = append(p.procs, cmd)
	return cmd, nil
}

// stopAll kills every process and removes the directory.
func (p *convProcs) stopAll() {
	for _, c := range p.procs {
		if c.ProcessState == nil {
			syscall.Kill(-c.Process.Pid, syscall.SIGKILL)
			c.Wait()
		}
	}
	os.RemoveAll(p.dir)
}

// policyServer starts `dysco policy-server` with args and waits until it
// serves; it returns its URL.
func (p *convProcs) policyServer(ctx context.Context, dysco, name string, args ...string) (string, error) {
	port, err := loopbackPort()
	if err != nil {
		return "", err
	}
	ready := filepath.Join(p.dir, name+".ready")
	listen := fmt.Sprintf("127.0.0.1:%d", port)
	argv := append([]string{dysco, "policy-server", "--insecure", "--listen", listen, "--metrics-listen", "", "--ready-file", ready}, args...)
	if _, err := p.start(name, argv...); err != nil {
		return "", err
	}
	if err := waitFile(ctx, ready, 20*time.Second); err != nil {
		return "", fmt.Errorf("%s: %w (log: %s)", name, err, filepath.Join(p.dir, name+".log"))
	}
	return "http://" + listen, nil
}

// waitFile waits for path to exist, for at most within.
func waitFile(ctx context.Context, path string, within time.Duration) error {
	end := time.Now().Add(within)
	for {
		if _, err := os.Stat(path); err == nil {
			return nil
		}
		if time.Now().After(end) {
			return fmt.Errorf("not ready within %s", within)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// etcdRanges is the range requests (reads) each member of clients has
// served: etcd_mvcc_range_total of its /metrics (0 for one that does not
// answer).
func etcdRanges(clients []string) []float64 {
	out := make([]float64, len(clients))
	hc := &http.Client{Timeout: 2 * time.Second}
	for i, u := range clients {
		resp, err := hc.Get(u + "/metrics")
		if err != nil {
			continue
		}
		data, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		for _, l := range strings.Split(string(data), "\n") {
			if f := strings.Fields(l); len(f) == 2 && f[0] == "etcd_mvcc_range_total" {
				fmt.Sscan(f[1], &out[i])
			}
		}
	}
	return out
}

// etcdCluster starts three members on loopback and waits for a leader; it
// returns the client URLs and the members.
func (p *convProcs) etcdCluster(ctx context.Context, etcd string) ([]string, []*exec.Cmd, error) {
	var clients, peers []string
	for range 3 {
		cp, err := loopbackPort()
		if err != nil {
			return nil, nil, err
		}
		pp, err := loopbackPort()
		if err != nil {
			return nil, nil, err
		}
		clients = append(clients, fmt.Sprintf("http://127.0.0.1:%d", cp))
		peers = append(peers, fmt.Sprintf("http://127.0.0.1:%d", pp))
	}
	var initial []string
	for i := range 3 {
		initial = append(initial, fmt.Sprintf("m%d=%s", i, peers[i]))
	}
	var members []*exec.Cmd
	for i := range 3 {
		cmd, err := p.start(fmt.Sprintf("etcd%d", i), etcd, "--name", fmt.Sprintf("m%d", i), "--data-dir", filepath.Join(p.dir, fmt.Sprintf("m%d", i)),
			"--listen-client-urls", clients[i], "--advertise-client-urls", clients[i],
			"--listen-peer-urls", peers[i], "--initial-advertise-peer-urls", peers[i],
			"--initial-cluster", strings.Join(initial, ","), "--heartbeat-interval", "50", "--election-timeout", "500")
		if err != nil {
			return nil, nil, err
		}
		members = append(members, cmd)
	}
	cli, err := clientv3.New(clientv3.Config{Endpoints: clients, DialTimeout: 2 * time.Second, Logger: zap.NewNop()})
	if err != nil {
		return nil, nil, err
	}
	defer cli.Close()
	end := time.Now().Add(30 * time.Second)
	for {
		c, cancel := context.WithTimeout(ctx, time.Second)
		_, err := cli.Get(clientv3.WithRequireLeader(c), "health")
		cancel()
		if err == nil {
			return clients, members, nil
		}
		if time.Now().After(end) || ctx.Err() != nil {
			return nil, nil, fmt.Errorf("etcd cluster without a leader after 30 s: %w", err)
		}
	}
}

// etcdLeader is the index of the member of clients that leads.
func etcdLeader(ctx context.Context, clients []string) (int, error) {
	cli, err := clientv3.New(clientv3.Config{Endpoints: clients, DialTimeout: 2 * time.Second, Logger: zap.NewNop()})
	if err != nil {
		return -1, err
	}
	defer cli.Close()
	for i, u := range clients {
		c, cancel := context.WithTimeout(ctx, 2*time.Second)
		st, err := cli.Status(c, u)
		cancel()
		if err == nil && st.Leader == st.Header.MemberId {
			return i, nil
		}
	}
	return -1, errors.New("no member says it leads")
}

// Convergence measures policy changes reaching 50 light agents with each
// backend.
func Convergence(ctx context.Context, o *Options, r *Report, pr *labkit.Progress) error {
	changes := 100
	if o.Quick {
		changes = 10
	}
	etcd := filepath.Join(filepath.Dir(o.Dysco), "etcd")
	if _, err := os.Stat(etcd); err != nil {
		return fmt.Errorf("%w: run `make build` (it builds bin/etcd beside bin/dysco)", err)
	}
	d := &ConvergenceDetails{Agents: convergenceAgents, Changes: changes, DelaysMS: map[string][]float64{}}
	r.Details["convergence"] = d

	// bbolt: one server.
	dir, err := os.MkdirTemp("", "dysco-convergence")
	if err != nil {
		return err
	}
	procs := &convProcs{dir: dir}
	defer procs.stopAll()
	bolt, err := procs.policyServer(ctx, o.Dysco, "bbolt", "--db", filepath.Join(dir, "policy.db"))
	if err != nil {
		return err
	}
	run := &convergenceRun{urls: []string{bolt}}
	run.startAgents(convergenceAgents)
	pr.Logf("convergence: %d changes to %d agents, one server over bbolt", changes, convergenceAgents)
	d.DelaysMS["bbolt"], err = run.measure(ctx, api.NewServerClient(bolt), changes, 0)
	run.stop()
	if err != nil {
		return fmt.Errorf("bbolt: %w", err)
	}

	// etcd: three members, two replicas.
	clients, members, err := procs.etcdCluster(ctx, etcd)
	if err != nil {
		return err
	}
	var replicas []string
	for _, name := range []string{"replica-a", "replica-b"} {
		u, err := procs.policyServer(ctx, o.Dysco, name, "--etcd", strings.Join(clients, ","))
		if err != nil {
			return err
		}
		replicas = append(replicas, u)
	}
	run = &convergenceRun{urls: replicas}
	run.startAgents(convergenceAgents)
	defer run.stop()
	cl := api.NewServerClient(strings.Join(replicas, ","))
	pr.Logf("convergence: %d changes to %d agents, two replicas over a three-member etcd", changes, convergenceAgents)
	d.DelaysMS["etcd"], err = run.measure(ctx, cl, changes, 0)
	if err != nil {
		return fmt.Errorf("etcd: %w", err)
	}

	// The leader killed; the next change timed from the kill.
	lead, err := etcdLeader(ctx, clients)
	if err != nil {
		return err
	}
	ranges0 := etcdRanges(clients)
	kill := time.Now()
	syscall.Kill(members[lead].Process.Pid, syscall.SIGKILL)
	v, retries, err := change(ctx, cl, changes, 20*time.Second)
	if err != nil {
		return fmt.Errorf("the change after the leader's kill: %w", err)
	}
	d.WriteRetries = retries
	at, err := run.waitAll(ctx, v, 30*time.Second)
	if err != nil {
		return fmt.Errorf("after the leader's kill: %w", err)
	}
	d.KillToAllMS = msToLast(kill, at)
	// The survivors' reads (the killed member's are gone with it).
	ranges1 := etcdRanges(clients)
	for i := range clients {
		if i != lead {
			d.RangesAfterKill += ranges1[i] - ranges0[i]
		}
	}

	b50, b99 := percentile(d.DelaysMS["bbolt"], 50), percentile(d.DelaysMS["bbolt"], 99)
	e50, e99 := percentile(d.DelaysMS["etcd"], 50), percentile(d.DelaysMS["etcd"], 99)
	cmd := "bin/dysco-bench --only convergence"
	r.add(&Figure{
		Key:          "convergence-etcd",
		Name:         fmt.Sprintf("policy change to %d agents (light: the agent's policy client without a datapath), two replicas over three etcd members, from the write's start to each agent", convergenceAgents),
		Command:      cmd,
		Unit:         "ms (p99)",
		Dysco:        e99,
		Baseline:     b99,
		DyscoText:    fmt.Sprintf("p50 %.1f, p99 %.1f ms over %d changes × %d agents", e50, e99, changes, convergenceAgents),
		BaselineText: fmt.Sprintf("p50 %.1f, p99 %.1f ms, one server over bbolt", b50, b99),
		Ratio:        e99 / b99,
		Measured:     e99,
		MeasuredUnit: "ms",
		Target:       "p99 < 1000 ms",
		Met:          metStr(e99 < 1000),
	})
	r.add(&Figure{
		Key:          "convergence-etcd-leader-kill",
		Name:         fmt.Sprintf("etcd leader killed (SIGKILL), then a policy change: from the kill to the last of %d agents holding it", convergenceAgents),
		Command:      cmd,
		Unit:         "ms",
		Dysco:        d.KillToAllMS,
		Baseline:     math.NaN(),
		DyscoText:    fmt.Sprintf("%.0f ms (%d writes refused during the election; %.0f etcd reads meanwhile for %d agents: no re-list)", d.KillToAllMS, retries, d.RangesAfterKill, convergenceAgents),
		Ratio:        math.NaN(),
		Measured:     d.KillToAllMS,
		MeasuredUnit: "ms",
		Target:       "(reported)",
		Met:          "–",
	})

	// Kubernetes: an API server over the surviving etcd members.
	run.stop()
	var live []string
	for i, u := range clients {
		if i != lead {
			live = append(live, u)
		}
	}
	pr.Logf("convergence: %d changes to %d agents, two dysco-kube replicas over a kube-apiserver", changes, convergenceAgents)
	if err := convergenceKube(ctx, o, r, procs, strings.Join(live, ","), d, changes); err != nil {
		return fmt.Errorf("kubernetes: %w", err)
	}
	return nil
}

// convergenceKube measures the Kubernetes store: a kube-apiserver over
// etcd (client URLs), two dysco-kube replicas with a 3 s controller
// Lease, the light agents half on each; then the controller's replica is
// killed with SIGKILL and the next change is timed from the kill.
func convergenceKube(ctx context.Context, o *Options, r *Report, procs *convProcs, etcd string, d *ConvergenceDetails, changes int) error {
	bin := filepath.Dir(o.Dysco)
	kubeBin, dyscoKube := filepath.Join(bin, "kube-apiserver"), filepath.Join(bin, "dysco-kube")
	for _, b := range []string{kubeBin, dyscoKube} {
		if _, err := os.Stat(b); err != nil {
			return fmt.Errorf("%w: run `make build` (it builds bin/kube-apiserver and bin/dysco-kube beside bin/dysco)", err)
		}
	}
	port, err := loopbackPort()
	if err != nil {
		return err
	}
	dir := filepath.Join(procs.dir, "kube")
	if err := os.Mkdir(dir, 0o700); err != nil {
		return err
	}
	ks, err := kubeapi.Prepare(dir, netip.AddrPortFrom(netip.MustParseAddr("127.0.0.1"), uint16(port)), etcd)
	if err != nil {
		return err
	}
	if _, err := procs.start("kube-apiserver", ks.Argv(kubeBin)...); err != nil {
		return err
	}
	if err := ks.Ready(ctx, 90*time.Second, nil, nil); err != nil {
		log, _ := os.ReadFile(filepath.Join(procs.dir, "kube-apiserver.log"))
		return fmt.Errorf("%w; its log ends: %s", err, labkit.Tail(string(log), 600))
	}
	if err := ks.Install(ctx, exec.CommandContext); err != nil {
		return err
	}
	var replicas []string
	byPID := map[int]*exec.Cmd{}
	for _, name := range []string{"kube-a", "kube-b"} {
		u, err := procs.policyServer(ctx, dyscoKube, name, "--kubernetes", "--kubeconfig", ks.Kubeconfig, "--kube-lease", "3s")
		if err != nil {
			return err
		}
		replicas = append(replicas, u)
		c := procs.procs[len(procs.procs)-1]
		byPID[c.Process.Pid] = c
	}
	run := &convergenceRun{urls: replicas}
	run.startAgents(convergenceAgents)
	defer run.stop()
	cl := api.NewServerClient(strings.Join(replicas, ","))
	// The API server's first write of a Policy takes about 2 s (it sets
	// up the new type's storage and CEL rules): a warm-up, not counted.
	if _, _, err := change(ctx, cl, 999, 20*time.Second); err != nil {
		return fmt.Errorf("the first write: %w", err)
	}
	d.DelaysMS["kubernetes"], err = run.measure(ctx, cl, changes, 1000)
	if err != nil {
		return err
	}

	pid, err := ks.ControllerPID(ctx, exec.CommandContext)
	if err != nil {
		return err
	}
	ctl := byPID[pid]
	if ctl == nil {
		return fmt.Errorf("the controller's Lease names process %d, not a replica", pid)
	}
	lists0, err := ks.Requests(ctx, "LIST")
	if err != nil {
		return err
	}
	kill := time.Now()
	syscall.Kill(-pid, syscall.SIGKILL)
	ctl.Wait()
	v, _, err := change(ctx, cl, 1000+changes, 20*time.Second)
	if err != nil {
		return fmt.Errorf("the change after the controller's kill: %w", err)
	}
	at, err := run.waitAll(ctx, v, 30*time.Second)
	if err != nil {
		return fmt.Errorf("after the controller's kill: %w", err)
	}
	d.ControllerKillToAllMS = msToLast(kill, at)
	lists1, err := ks.Requests(ctx, "LIST")
	if err != nil {
		return err
	}
	d.ListsAfterControllerKill, d.ListsBeforeControllerKill = lists1-lists0, lists0

	k50, k99 := percentile(d.DelaysMS["kubernetes"], 50), percentile(d.DelaysMS["kubernetes"], 99)
	b50, b99 := percentile(d.DelaysMS["bbolt"], 50), percentile(d.DelaysMS["bbolt"], 99)
	cmd := "bin/dysco-bench --only convergence"
	r.add(&Figure{
		Key:          "convergence-kubernetes",
		Name:         fmt.Sprintf("policy change to %d agents (light), two dysco-kube replicas over a kube-apiserver, from the write's start to each agent", convergenceAgents),
		Command:      cmd,
		Unit:         "ms (p99)",
		Dysco:        k99,
		Baseline:     b99,
		DyscoText:    fmt.Sprintf("p50 %.1f, p99 %.1f ms over %d changes × %d agents", k50, k99, changes, convergenceAgents),
		BaselineText: fmt.Sprintf("p50 %.1f, p99 %.1f ms, one server over bbolt", b50, b99),
		Ratio:        k99 / b99,
		Measured:     k99,
		MeasuredUnit: "ms",
		Target:       "p99 < 1000 ms",
		Met:          metStr(k99 < 1000),
	})
	r.add(&Figure{
		Key:          "convergence-kubernetes-controller-kill",
		Name:         fmt.Sprintf("the controller's replica killed (SIGKILL, 3 s Lease), then a policy change: from the kill to the last of %d agents holding it", convergenceAgents),
		Command:      cmd,
		Unit:         "ms",
		Dysco:        d.ControllerKillToAllMS,
		Baseline:     math.NaN(),
		DyscoText:    fmt.Sprintf("%.0f ms (%.0f LIST requests meanwhile, %.0f before: no re-list)", d.ControllerKillToAllMS, d.ListsAfterControllerKill, d.ListsBeforeControllerKill),
		Ratio:        math.NaN(),
		Measured:     d.ControllerKillToAllMS,
		MeasuredUnit: "ms",
		Target:       "(reported)",
		Met:          "–",
	})
	return nil
}
