// Package agent is the Dysco agent (paper §4.1 "Daemon"): one per host or
// network namespace. It loads and pins the datapath, attaches it to every
// interface (also ones that appear later), keeps the datapath's view of the
// host's addresses, policies and middlebox types, collects ended sessions,
// serves the local API on an abstract Unix socket and exports metrics.
package agent

import (
	"context"
	"crypto/tls"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cilium/ebpf"
	"github.com/dysco/dysco/internal/api"
	"github.com/dysco/dysco/internal/datapath"
	"github.com/dysco/dysco/internal/keys"
	"github.com/dysco/dysco/internal/migrate"
	"github.com/dysco/dysco/internal/nf"
	"github.com/dysco/dysco/internal/policy"
	"github.com/dysco/dysco/internal/protocol"
	"github.com/dysco/dysco/internal/psclient"
	"github.com/dysco/dysco/internal/reconfig"
	"github.com/vishvananda/netlink"
)

// Config configures an agent.
type Config struct {
	Name string
	// PinDir is where the datapath is pinned (on a bpffs).
	PinDir string
	// StateDir keeps local policies and the policy server's last set.
	StateDir string
	// Tap names the session-view tap interface to create; empty for none.
	Tap string
	// PolicyServer is the policy server's URL; empty for local policies only.
	PolicyServer string
	// PolicyServerTLS is the agent's client certificate for the policy
	// server and the CA of the server's (nil for an http:// server).
	PolicyServerTLS *tls.Config
	// ReadyFile is written once the agent serves; tests wait on it.
	ReadyFile string
	// MetricsAddr serves Prometheus metrics; empty for none.
	MetricsAddr string
	// Socket is the local API socket (default api.AgentSocket).
	Socket string
	// Timeouts of the session collector.
	IdleTimeout, HalfOpenTimeout, CloseLinger time.Duration
	// UDPTimeout and UDPStreamTimeout end UDP sessions idle that long,
	// before and after they have carried datagrams both ways, unless
	// their policy sets its own (the Linux conntrack defaults: 30 s and
	// 120 s).
	UDPTimeout, UDPStreamTimeout time.Duration
	// UDPDrain is how long a UDP session's old path must have been quiet
	// before an anchor of its reconfiguration ends the two-path phase
	// (docs/protocol.md, "UDP sessions"); 0: the protocol's default.
	UDPDrain time.Duration
	// GCInterval is how often ended sessions are collected.
	GCInterval time.Duration
	// PortLo and PortN give the subsession port range.
	PortLo, PortN uint16
	// MaxSessions sizes the datapath's session maps (datapath.Config);
	// 0: the datapath object's own size.
	MaxSessions int
	// SessionAddrs are the host's session addresses, at most one per
	// family (docs/mobility.md): its applications' sessions from them keep
	// their tuple when the host's address changes; the first subsession
	// leaves from the host's current address, and moves (a rebind) when
	// that address goes. Empty: mobility is off.
	SessionAddrs []netip.Addr
	// Trusted is the set of prefixes whose Dysco SYNs are admitted
	// without a valid MAC (with a ControlKeyFile, SYNs are admitted with a
	// valid MAC or from these prefixes; without one, from these prefixes
	// only, and none when the set is empty).
	Trusted []netip.Prefix
	// NoForwardCheck hands chained SYNs this host would have to forward
	// to the stack even while IP forwarding is off (datapath.Config); by
	// default the datapath refuses them at once (forwarding.go).
	NoForwardCheck bool
	// HalfOpenPerSource is the budget of half-open sessions that Dysco
	// SYNs from one source (an IPv4 address or an IPv6 /64) may set up
	// here; 0: datapath.DefaultHalfOpenPerSource.
	HalfOpenPerSource int
	// ControlPort is the UDP port of the reconfiguration protocol (§3.3).
	ControlPort int
	// ControlKeyFile holds the deployment secrets that authenticate
	// control messages (internal/keys: one hex secret per line, the first
	// signs, all are accepted; mode 0600, owned by root or the agent's
	// user), read again on SIGHUP and when it changes. The keys derived
	// from them also sign and admit Dysco SYNs (admission.go). Empty
	// disables reconfiguration at this agent.
	ControlKeyFile string
	// StatePlugins are the state migration plug-ins (internal/migrate)
	// this agent exports and imports with.
	StatePlugins []string
	// NFs are the network functions this agent starts when a new path
	// names one for it (internal/nf; heterogeneous-sfc-quic §IV).
	NFs []nf.Spec
	Log *slog.Logger
}

// DefaultControlPort is the UDP port of the reconfiguration protocol.
const DefaultControlPort = reconfig.DefaultControlPort

// Agent is a running agent.
type Agent struct {
	cfg     Config
	nfs     *nf.Manager // nil: no network functions (--nf)
	log     *slog.Logger
	dp      *datapath.Datapath
	started time.Time
	metrics *metrics

	mu       sync.Mutex
	local    api.PolicySet // policies and types added through the local API
	server   api.PolicySet // the policy server's last set
	serverOK bool
	// serverInForce is the version of the server's set that the
	// classifier in force was built from (what `dysco status` reports:
	// the set just received may still be compiling).
	serverInForce uint64
	policyProg    *ebpf.Program
	ifaces        map[string]bool
	// slotPolicy names the policy of each verdict (policy slot + 1)
	// of both banks; replaced whole on each change.
	slotPolicy map[int]string
	typeIndex  map[string]int
	// applyMu serialises applyPolicies.
	applyMu sync.Mutex

	tapActive atomic.Bool
	// apiRefused counts local API connections refused for their peer
	// (peer.go).
	apiRefused atomic.Uint64
	// refusedUnchained and refusedFilter count the policies the agent
	// refused to install (compilePolicy): their filter matches no
	// protocol the datapath chains, or does not compile.
	refusedUnchained, refusedFilter atomic.Uint64

	// fwd is IP forwarding as last read (forwarding.go); fwdWatch the
	// main loop's state for logging refusals.
	fwd      atomic.Pointer[api.Forwarding]
	fwdWatch forwardWatch

	// ctl is the reconfiguration machinery (internal/reconfig); nil when
	// disabled.
	ctl *reconfig.Shell
	// keys is the control key file (nil without one); onKeys takes each
	// ring it loads after the first.
	keys *keys.File
	// srcCache: the source address of datagrams to each peer
	// (sourceAddr), forgotten when routes or addresses change.
	srcMu    sync.Mutex
	srcCache map[netip.Addr]srcEntry
	// providers are the middleboxes that registered their state with the
	// local API (the "api" state plug-in).
	providers *migrate.Providers

	// locators are the session addresses' current locators,
	// lastLocator their last valid ones, homeMoved those whose locator
	// changed since the agent started; rebinding and rebindAgain the
	// state of the rebind pass (mobility.go). Under mu.
	locators               map[netip.Addr]netip.Addr
	lastLocator            map[netip.Addr]netip.Addr
	homeMoved              map[netip.Addr]bool
	rebinding, rebindAgain bool
	// viaUsed: a session was moved to another address of the host
	// (reconfig --via), or a policy with via addresses was installed,
	// since the agent started.
	viaUsed atomic.Bool

	// Collector-goroutine state for re-routing decisions (reroute.go).
	routeCache     map[routeKey]bool
	rerouteCleared atomic.Uint64
}

// Defaults fills unset fields.
func (c *Config) defaults() {
	if c.Name == "" {
		c.Name, _ = os.Hostname()
	}
	if c.PinDir == "" {
		c.PinDir = DefaultPinDir()
	}
	if c.StateDir == "" {
		c.StateDir = "/var/lib/dysco/" + netnsID()
	}
	if c.Socket == "" {
		c.Socket = api.AgentSocket
	}
	if c.UDPTimeout == 0 {
		c.UDPTimeout = api.DefaultIdleTimeoutOneWay
	}
	if c.UDPStreamTimeout == 0 {
		c.UDPStreamTimeout = api.DefaultIdleTimeoutStream
	}
	if c.IdleTimeout == 0 {
		c.IdleTimeout = time.Hour
	}
	if c.HalfOpenTimeout == 0 {
		c.HalfOpenTimeout = 30 * time.Second
	}
	if c.CloseLinger == 0 {
		c.CloseLinger = 10 * time.Second
	}
	if c.GCInterval == 0 {
		c.GCInterval = time.Second
	}
	if c.ControlPort == 0 {
		c.ControlPort = reconfig.DefaultControlPort
	}
	if c.Log == nil {
		c.Log = slog.Default()
	}
}

// DefaultPinDir is where an agent of the current network namespace pins its
// datapath when --pin-dir is not given.
func DefaultPinDir() string { return "/sys/fs/bpf/dysco/" + netnsID() }

// netnsID names the current network namespace by its inode.
func netnsID() string {
	fi, err := os.Stat("/proc/self/ns/net")
	if err != nil {
		return "default"
	}
	if st, ok := statIno(fi); ok {
		return fmt.Sprintf("netns-%d", st)
	}
	return "default"
}

// Run runs the agent until ctx is cancelled.
func Run(ctx context.Context, cfg Config) error {
	cfg.defaults()
	a := &Agent{cfg: cfg, log: cfg.Log.With("agent", cfg.Name), started: time.Now(), ifaces: map[string]bool{}, routeCache: map[routeKey]bool{},
		lastLocator: map[netip.Addr]netip.Addr{}, homeMoved: map[netip.Addr]bool{}}
	if err := a.checkSessionAddrs(); err != nil {
		return err
	}
	if err := claimStateDir(cfg.StateDir, a.log); err != nil {
		return err
	}
	if err := a.loadLocal(); err != nil {
		return err
	}
	if err := a.loadServerCache(); err != nil {
		return err
	}
	if cfg.ControlKeyFile != "" {
		f, err := keys.Open(cfg.ControlKeyFile, os.Geteuid(), a.log)
		if err != nil {
			return fmt.Errorf("--control-key-file: %w", err)
		}
		a.keys = f
	}

	var tapIndex uint32
	if cfg.Tap != "" {
		idx, err := ensureTap(cfg.Tap)
		if err != nil {
			return err
		}
		tapIndex = uint32(idx)
	}
	dp, err := datapath.Load(datapath.Config{PinDir: cfg.PinDir, TapIfindex: tapIndex, PortLo: cfg.PortLo, PortN: cfg.PortN,
		HalfOpenPerSource: cfg.HalfOpenPerSource, MaxSessions: cfg.MaxSessions, NoForwardCheck: cfg.NoForwardCheck,
		ControlPort: uint16(max(cfg.ControlPort, 0))})
	if err != nil {
		return err
	}
	if sz := dp.Sizing; sz.Kept && cfg.MaxSessions != 0 {
		a.log.Warn("datapath: the pinned session maps keep their size; a new size takes 'dysco agent --reset' (every session on this host ends)",
			"sessions", sz.Sessions, "flows", sz.Flows, "asked_sessions", sz.Requested)
	}
	a.dp = dp
	defer func() {
		a.mu.Lock()
		if a.policyProg != nil {
			a.policyProg.Close()
		}
		a.mu.Unlock()
		dp.Close()
	}()
	if err := a.setAdmission(); err != nil {
		return err
	}
	if cfg.Tap != "" {
		if err := dp.AttachTap(cfg.Tap); err != nil {
			return err
		}
	}

	// Interfaces and addresses, now and as they change.
	linkCh := make(chan netlink.LinkUpdate, 64)
	addrCh := make(chan netlink.AddrUpdate, 64)
	done := make(chan struct{})
	defer close(done)
	if err := netlink.LinkSubscribe(linkCh, done); err != nil {
		return fmt.Errorf("agent: watch interfaces: %w", err)
	}
	if err := netlink.AddrSubscribe(addrCh, done); err != nil {
		return fmt.Errorf("agent: watch addresses: %w", err)
	}
	routeCh := make(chan netlink.RouteUpdate, 64)
	if err := netlink.RouteSubscribe(routeCh, done); err != nil {
		return fmt.Errorf("agent: watch routes: %w", err)
	}
	// Policies go in before the programs are swapped into the links: the
	// program array of a new load starts empty, and a session a policy
	// sends through a middlebox must never slip through unchained.
	if err := a.syncAddrs(); err != nil {
		return err
	}
	if err := a.applyPolicies(); err != nil {
		var na *notInForceError
		if errors.As(err, &na) {
			// The links still run the programs of the last agent, with
			// its classifier; new programs without one would let every
			// session bypass its chain.
			return fmt.Errorf("agent: the policies cannot be put in force: %w; the agent does not start without them", err)
		}
		a.log.Error("policies not applied", "err", err)
	}
	if err := a.syncInterfaces(); err != nil {
		return err
	}

	if a.keys != nil {
		var states *migrate.Set
		if len(cfg.StatePlugins) > 0 {
			a.providers = &migrate.Providers{}
			set, err := migrate.NewSet(cfg.StatePlugins, migrate.Options{APIProviders: a.providers})
			if err != nil {
				return fmt.Errorf("--state-plugins: %w", err)
			}
			states = set
		}
		rc := reconfig.Config{Port: cfg.ControlPort, Keys: protocol.KeysFromRing(a.keys.Ring()), Datapath: a.dp,
			Log: a.log, SelfAddr: a.selfAddr, SourceAddr: a.sourceAddr, SameRoute: a.sameRoute, Tap: cfg.Tap != "", States: states}
		if cfg.UDPDrain > 0 {
			rc.Tune = func(pc *protocol.Config) { pc.UDPDrain = cfg.UDPDrain }
		}
		if len(cfg.NFs) > 0 {
			m, err := nf.NewManager(cfg.NFs, a.log)
			if err != nil {
				return fmt.Errorf("--nf: %w", err)
			}
			a.nfs, rc.NFs = m, m
			defer func() {
				// The functions run in process groups of their own:
				// stopped with the agent.
				c, cancel := context.WithTimeout(context.Background(), nf.StopGrace+5*time.Second)
				defer cancel()
				m.Close(c)
			}()
		}
		ctl, err := reconfig.New(rc)
		if err != nil {
			return err
		}
		a.ctl = ctl
		go ctl.Run(ctx)
		// A key rotation: the file is read again on SIGHUP and when it
		// changes.
		a.keys.OnChange(a.onKeys)
		a.keys.Start(ctx, 0)
	} else {
		a.log.Info("reconfiguration disabled: no control key")
		if len(cfg.NFs) > 0 {
			a.log.Warn("network functions (--nf) are started for reconfigurations only: without --control-key-file none will be")
		}
		// No agent reads the hold ring: packets straddling a cut-off
		// go whole on the old path.
		if err := a.dp.SetSplitReader(0); err != nil {
			a.log.Warn("datapath: cannot clear the split reader", "err", err)
		}
	}
	a.metrics = newMetrics(a)
	srv, err := a.serveAPI()
	if err != nil {
		return err
	}
	defer srv.Close()
	if cfg.MetricsAddr != "" {
		ms, err := a.metrics.serve(cfg.MetricsAddr)
		if err != nil {
			return err
		}
		defer ms.Close()
	}
	if cfg.PolicyServer != "" {
		go psclient.Watch(ctx, psclient.WatchConfig{
			URL: cfg.PolicyServer, TLS: cfg.PolicyServerTLS, Host: cfg.Name, CacheFile: a.serverCache(),
			Version: WireVersion(), OnUpdate: a.onServerPolicies,
			OnStatus: func(ok bool, err error) {
				a.mu.Lock()
				changed := a.serverOK != ok
				a.serverOK = ok
				a.mu.Unlock()
				if changed {
					a.log.Info("policy server", "reachable", ok, "err", err)
				}
			},
		})
		go psclient.ServeOperations(ctx, psclient.OpsConfig{
			URL: cfg.PolicyServer, TLS: cfg.PolicyServerTLS, Host: cfg.Name, Exec: a.execOperation, Logger: a.log,
		})
	}
	a.startForwarding()
	if cfg.ReadyFile != "" {
		if err := os.WriteFile(cfg.ReadyFile, []byte(fmt.Sprintf("%d\n", os.Getpid())), 0o644); err != nil {
			return fmt.Errorf("agent: ready file: %w", err)
		}
		defer os.Remove(cfg.ReadyFile)
	}
	a.log.Info("agent ready", "pin_dir", cfg.PinDir, "attach", dp.Attach, "tap", cfg.Tap, "ifaces", a.ifaceList())
	if dp.MountedBPFFS {
		a.log.Warn("no bpffs was mounted at /sys/fs/bpf: the agent mounted one for its pins; under ip netns exec (which remounts /sys in a mount namespace of its own) that mount, and with it the pinned datapath and every session through this host, goes when the agent exits: start agents for network namespaces with 'nsenter --net=/run/netns/NAME dysco agent'",
			"pin_dir", cfg.PinDir)
	}

	gc := time.NewTicker(cfg.GCInterval)
	defer gc.Stop()
	fwdTick := time.NewTicker(forwardPoll)
	defer fwdTick.Stop()
	var tapTick <-chan time.Time
	if tapIndex != 0 {
		t := time.NewTicker(tapPoll)
		defer t.Stop()
		tapTick = t.C
		a.watchTap(int(tapIndex))
	}
	for {
		select {
		case <-ctx.Done():
			a.log.Info("agent stopping; pinned datapath keeps live sessions")
			return nil
		case <-linkCh:
			for len(linkCh) > 0 {
				<-linkCh
			}
			if err := a.syncInterfaces(); err != nil {
				a.log.Warn("interfaces", "err", err)
			}
			if err := a.syncLocators(); err != nil {
				a.log.Warn("locators", "err", err)
			}
			a.rebindLost(ctx)
		case <-addrCh:
			for len(addrCh) > 0 {
				<-addrCh
			}
			if err := a.syncAddrs(); err != nil {
				a.log.Warn("addresses", "err", err)
			}
			a.forgetSources()
			a.rebindLost(ctx)
		case <-routeCh:
			// Drain a burst of changes, then decide once.
			for len(routeCh) > 0 {
				<-routeCh
			}
			a.routesChanged()
			a.forgetSources()
			if err := a.syncLocators(); err != nil {
				a.log.Warn("locators", "err", err)
			}
			a.rebindLost(ctx)
		case <-gc.C:
			a.collect()
		case now := <-fwdTick.C:
			a.pollForwarding(now)
		case <-tapTick:
			a.watchTap(int(tapIndex))
		}
	}
}

// ensureTap creates the session-view tap: one end of a veth
// pair, up, with no addresses. The datapath copies each packet of the
// sessions chained through this host to its ingress; capture tools listen on
// it, and a drop program keeps the copies out of the stack.
func ensureTap(name string) (int, error) {
	if l, err := netlink.LinkByName(name); err == nil {
		return l.Attrs().Index, netlink.LinkSetUp(l)
	}
	peer := name + "-p"
	if len(peer) > 15 {
		peer = peer[:15]
	}
	la := netlink.NewLinkAttrs()
	la.Name = name
	v := &netlink.Veth{LinkAttrs: la, PeerName: peer}
	if err := netlink.LinkAdd(v); err != nil {
		return 0, fmt.Errorf("agent: create tap %s: %w", name, err)
	}
	for _, n := range []string{peer, name} {
		l, err := netlink.LinkByName(n)
		if err != nil {
			return 0, err
		}
		if err := netlink.LinkSetUp(l); err != nil {
			return 0, err
		}
	}
	l, err := netlink.LinkByName(name)
	if err != nil {
		return 0, err
	}
	return l.Attrs().Index, nil
}

func (a *Agent) isTap(name string) bool {
	if a.cfg.Tap == "" {
		return false
	}
	peer := a.cfg.Tap + "-p"
	if len(peer) > 15 {
		peer = peer[:15]
	}
	return name == a.cfg.Tap || name == peer
}

// syncInterfaces attaches the datapath to every interface but loopback and
// the tap.
func (a *Agent) syncInterfaces() error {
	links, err := netlink.LinkList()
	if err != nil {
		return err
	}
	seen := map[string]bool{}
	var errs []error
	for _, l := range links {
		at := l.Attrs()
		if at.Flags&net.FlagLoopback != 0 || a.isTap(at.Name) {
			continue
		}
		seen[at.Name] = true
		a.mu.Lock()
		known := a.ifaces[at.Name]
		a.mu.Unlock()
		if known {
			continue
		}
		if err := a.dp.AttachInterface(at.Name); err != nil {
			errs = append(errs, err)
			continue
		}
		a.mu.Lock()
		a.ifaces[at.Name] = true
		a.mu.Unlock()
		a.log.Info("attached", "iface", at.Name)
	}
	a.mu.Lock()
	for n := range a.ifaces {
		if !seen[n] {
			delete(a.ifaces, n)
		}
	}
	a.mu.Unlock()
	return errors.Join(errs...)
}

func (a *Agent) ifaceList() []string {
	a.mu.Lock()
	defer a.mu.Unlock()
	var out []string
	for n := range a.ifaces {
		out = append(out, n)
	}
	sort.Strings(out)
	return out
}

func (a *Agent) syncAddrs() error {
	addrs, err := hostAddrs(netlink.FAMILY_ALL)
	if err != nil {
		return err
	}
	if err := a.dp.SetLocalAddrs(addrs); err != nil {
		return err
	}
	ifs, err := trafficIfaces()
	if err != nil {
		return err
	}
	for ip := range ifs {
		if a.isSessionAddr(ip) {
			delete(ifs, ip)
		}
	}
	if err := a.dp.SetLocalIfaces(ifs); err != nil {
		return err
	}
	return a.syncLocators()
}

// trafficIfaces maps this host's addresses to their interfaces, for those
// on interfaces that carry traffic out of the host (not lo, not a dummy):
// a host that does not forward sends a rewritten packet out of its source
// address's interface.
func trafficIfaces() (map[netip.Addr]int, error) {
	links, err := netlink.LinkList()
	if err != nil {
		return nil, err
	}
	out := map[netip.Addr]int{}
	for _, l := range links {
		if l.Attrs().Flags&net.FlagLoopback != 0 || l.Type() == "dummy" {
			continue
		}
		addrs, err := netlink.AddrList(l, netlink.FAMILY_ALL)
		if err != nil {
			continue // gone meanwhile
		}
		for _, ad := range addrs {
			if ip, ok := netip.AddrFromSlice(ad.IP); ok && !ip.IsLinkLocalUnicast() {
				out[ip.Unmap()] = l.Attrs().Index
			}
		}
	}
	return out, nil
}

// ---- policies ----

func (a *Agent) localFile() string { return filepath.Join(a.cfg.StateDir, "local-policies.json") }

func (a *Agent) serverCache() string { return filepath.Join(a.cfg.StateDir, "server-policies.json") }

func (a *Agent) loadLocal() error {
	b, err := os.ReadFile(a.localFile())
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("agent: read local policies: %w (the agent does not start without them: fix the file's permissions, or remove it to start without local policies)", err)
	}
	if err := json.Unmarshal(b, &a.local); err != nil {
		return fmt.Errorf("agent: local policies %s: %w (the agent does not start without them: restore the file, or remove it to start without local policies)", a.localFile(), err)
	}
	return nil
}

// loadServerCache reads the policy server's last set, which the agent
// enforces from the start (the server may be down). A cache that exists but
// cannot be used stops the agent: starting without the server's policies
// would let their sessions bypass their chains until the server answers.
func (a *Agent) loadServerCache() error {
	if a.cfg.PolicyServer == "" {
		return nil
	}
	ps, err := psclient.ReadCache(a.serverCache(), a.cfg.Name)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("agent: the cache of the policy server's policies cannot be used: %w; "+
			"the agent does not start without the policies it last had: restore the file, or remove %s "+
			"to start with no server policies until %s sends them", err, a.serverCache(), a.cfg.PolicyServer)
	}
	a.server = ps
	return nil
}

func (a *Agent) saveLocal() error {
	b, err := json.MarshalIndent(a.local, "", "  ")
	if err != nil {
		return err
	}
	tmp := a.localFile() + ".tmp"
	if err := os.WriteFile(tmp, b, 0o600); err != nil {
		return err
	}
	return os.Rename(tmp, a.localFile())
}

func (a *Agent) onServerPolicies(ps api.PolicySet) {
	a.mu.Lock()
	old := a.server
	a.server = ps
	a.mu.Unlock()
	if err := a.applyPolicies(); err != nil {
		var na *notInForceError
		if errors.As(err, &na) {
			// The set in force stayed: so does the one the agent
			// merges local changes with.
			a.mu.Lock()
			a.server = old
			a.mu.Unlock()
		}
		a.log.Error("policy server's policies not applied", "version", ps.Version, "err", err)
		return
	}
	a.log.Info("policies from server", "version", ps.Version, "policies", len(ps.Policies))
}

// effectiveSet merges local and server policies; a local policy overrides a
// server policy of the same name. Policies are ordered by priority, name.
func effectiveSet(local, server api.PolicySet) ([]api.Policy, []api.MiddleboxType) {
	pol := map[string]api.Policy{}
	for _, p := range server.Policies {
		pol[p.Name] = p
	}
	for _, p := range local.Policies {
		pol[p.Name] = p
	}
	typ := map[string]api.MiddleboxType{}
	for _, t := range server.Types {
		typ[t.Name] = t
	}
	for _, t := range local.Types {
		typ[t.Name] = t
	}
	ps := make([]api.Policy, 0, len(pol))
	for _, p := range pol {
		ps = append(ps, p)
	}
	sort.Slice(ps, func(i, j int) bool {
		if ps[i].Priority != ps[j].Priority {
			return ps[i].Priority < ps[j].Priority
		}
		return ps[i].Name < ps[j].Name
	})
	ts := make([]api.MiddleboxType, 0, len(typ))
	for _, t := range typ {
		ts = append(ts, t)
	}
	sort.Slice(ts, func(i, j int) bool { return ts[i].Name < ts[j].Name })
	return ps, ts
}

// applyPolicies compiles the effective policies into the classifier program
// and puts it in force with their chains and types, all or nothing
// (datapath.InstallPolicies: the new set goes into the bank the classifier in
// force does not use, and one program-array update swaps it in; a classifier
// that does not load leaves the old set in force). A policy whose chain
// cannot be resolved (it names a type no one defines) keeps its slot with an
// empty chain, which the datapath drops (fail closed), never bypasses; a
// policy whose filter does not compile cannot classify anything and is left
// out, and so is one whose filter matches no protocol the datapath chains
// (compilePolicy logs and counts both). All are reported in the error.
func (a *Agent) applyPolicies() error {
	a.applyMu.Lock()
	defer a.applyMu.Unlock()
	a.mu.Lock()
	pols, types := effectiveSet(a.local, a.server)
	version := a.server.Version
	a.mu.Unlock()

	typeIndex := map[string]int{}
	var typeAddrs [][]netip.Addr
	for i, t := range types {
		typeIndex[t.Name] = i
		typeAddrs = append(typeAddrs, t.Instances)
	}
	var compiled []policy.Compiled
	var chains []datapath.PolicyChain
	var errs []error
	for _, p := range pols {
		c, err := a.compilePolicy(p)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		chain, err := resolveChain(p, typeIndex)
		if err != nil {
			errs = append(errs, fmt.Errorf("%w: its sessions are dropped", err))
			chain = datapath.PolicyChain{}
		}
		compiled = append(compiled, c)
		chains = append(chains, chain)
	}
	var base int
	prog, err := a.dp.InstallPolicies(typeAddrs, chains, func(b int) (*ebpf.Program, error) {
		base = b
		if len(compiled) == 0 {
			return nil, nil
		}
		spec, err := policy.BuildProgram(compiled, a.dp.ProgArray(), b)
		if err != nil {
			return nil, err
		}
		prog, err := ebpf.NewProgram(spec)
		if err != nil {
			return nil, fmt.Errorf("agent: load classifier: %w (the policies in force stay)", err)
		}
		return prog, nil
	})
	if err != nil && prog == nil {
		return errors.Join(append([]error{&notInForceError{err}}, errs...)...)
	}
	if err != nil {
		errs = append(errs, err)
	}
	a.mu.Lock()
	if a.policyProg != nil {
		a.policyProg.Close()
	}
	a.policyProg = prog
	// Names by verdict (slot + 1), of both banks: sessions set up under
	// the previous set keep their slot.
	names := map[int]string{}
	for v, n := range a.slotPolicy {
		if v <= base || v > base+a.dp.PoliciesPerBank() {
			names[v] = n
		}
	}
	for i, c := range compiled {
		names[base+i+1] = c.Policy.Name
	}
	a.slotPolicy = names
	a.typeIndex = typeIndex
	a.serverInForce = version
	a.mu.Unlock()
	for _, c := range compiled {
		a.noteVia(c.Policy)
	}
	return errors.Join(errs...)
}

// A policy's via addresses (api.MaxVia per family) must fit the
// datapath's map: this does not compile otherwise.
const _ = uint(datapath.MaxPolicySources - api.MaxVia)

// noteVia logs a policy's via addresses that are not this host's (its
// sessions that pick one leave from their route's source), and notes
// that sessions may leave from another address than their own: when
// that address goes, they are rebound to their own (mobility.go).
func (a *Agent) noteVia(p api.Policy) {
	if len(p.Via) == 0 {
		return
	}
	a.viaUsed.Store(true)
	for _, v := range p.Via {
		if !a.ownAddr(v.Unmap()) {
			a.log.Warn("policy names a via address this host does not have; its sessions that pick it leave from their route's source", "policy", p.Name, "via", v)
		}
	}
}

// compilePolicy compiles p for the classifier (policy.Compile). A policy it
// refuses, because its filter does not compile or matches no protocol the
// datapath chains (policy.UnchainedError), is logged and counted
// (dysco_policies_refused_total): the agent never installs a policy whose
// sessions would all bypass its chain.
func (a *Agent) compilePolicy(p api.Policy) (policy.Compiled, error) {
	c, err := policy.Compile(p)
	if err == nil {
		return c, nil
	}
	reason := "filter"
	var ue *policy.UnchainedError
	if errors.As(err, &ue) {
		reason = "unchained"
		a.refusedUnchained.Add(1)
	} else {
		a.refusedFilter.Add(1)
	}
	a.log.Error("policy refused, not installed", "name", p.Name, "filter", p.Filter, "reason", reason, "err", err)
	return policy.Compiled{}, err
}

// notInForceError is applyPolicies' failure to put the set in force: the
// set in force before stays.
type notInForceError struct{ err error }

func (e *notInForceError) Error() string { return e.err.Error() }
func (e *notInForceError) Unwrap() error { return e.err }

func resolveChain(p api.Policy, typeIndex map[string]int) (datapath.PolicyChain, error) {
	c := datapath.PolicyChain{ToDst: !p.EndBeforeDestination, Via: p.Via}
	if p.IdleTimeoutS != 0 {
		// The same for both phases of a UDP session (policy.IdleTimeouts).
		c.IdleS = [2]uint16{uint16(min(p.IdleTimeoutS, 0xffff)), uint16(min(p.IdleTimeoutS, 0xffff))}
	}
	for _, h := range p.Chain {
		if h.Addr.IsValid() {
			c.Hops = append(c.Hops, datapath.PolicyHop{Addr: h.Addr})
			continue
		}
		i, ok := typeIndex[h.Type]
		if !ok {
			return c, fmt.Errorf("policy %q: middlebox type %q is not defined (add it with 'dysco type add %s ADDR,...')", p.Name, h.Type, h.Type)
		}
		c.Hops = append(c.Hops, datapath.PolicyHop{Type: i})
	}
	return c, nil
}

// claimStateDir makes the state directory and marks it with this network
// namespace's cookie. A directory marked by another namespace (one that has
// gone and whose inode, which names the default directory, was reused) is
// emptied: its local policies were not meant for this host.
func claimStateDir(dir string, log *slog.Logger) error {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return fmt.Errorf("agent: state dir: %w", err)
	}
	cookie, err := datapath.NetnsCookie()
	if err != nil {
		return nil
	}
	mark := filepath.Join(dir, "netns")
	want := fmt.Sprintf("%d\n", cookie)
	if b, err := os.ReadFile(mark); err == nil && string(b) != want {
		log.Warn("state directory belonged to another network namespace; starting without its local policies", "dir", dir)
		for _, f := range []string{"local-policies.json", "server-policies.json"} {
			os.Remove(filepath.Join(dir, f))
		}
	}
	return os.WriteFile(mark, []byte(want), 0o600)
}
