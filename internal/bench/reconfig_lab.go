package bench

// The reconfig benchmark's lab: a star of client, proxy and server, HAProxy
// on the proxy (with or without libdysco), the runner's server.

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/dysco/dysco/internal/api"
	"github.com/dysco/dysco/internal/lab"
	"github.com/dysco/dysco/internal/labkit"
)

// ReconfigLab is the star lab of the benchmark.
type ReconfigLab struct {
	Lab                   *lab.Lab
	Client, Proxy, Server netip.Addr
	lib                   string // absolute path of libdysco.so
	dir                   string // HAProxy's configuration
	cfg                   string
	ln                    net.Listener
	cur                   atomic.Pointer[flowSet] // where accepted connections go
	// accept, if set, takes the server's connections instead of cur
	// (the proxy-removal experiment).
	Accept  atomic.Pointer[func(net.Conn)]
	HAProxy *lab.Proc
	closed  sync.Once
}

// haproxyConfig is HAProxy's configuration: TCP mode, splicing forced on
// both ways, a pipe for each direction of each session (the default,
// maxconn/4, would leave sessions unspliced), timeouts well beyond the
// benchmark.
func haproxyConfig(listen, backend netip.AddrPort, sessions int) string {
	return fmt.Sprintf(`global
    maxconn %d
    maxpipes %d
defaults
    mode tcp
    timeout connect 5s
    timeout client 300s
    timeout server 300s
    option splice-request
    option splice-response
listen relay
    bind %s
    maxconn %d
    server backend %s maxconn %d
`, 2*sessions+200, 2*sessions+200, listen, sessions+100, backend, sessions+100)
}

// UpReconfigLab builds the star lab, installs the policies, starts the
// sink/source server and writes HAProxy's configuration.
func UpReconfigLab(ctx context.Context, o *Options, set *labkit.Labs, prefix string, pr *labkit.Progress) (_ *ReconfigLab, err error) {
	lib, err := filepath.Abs(o.Libdysco)
	if err != nil {
		return nil, err
	}
	if _, err := os.Stat(lib); err != nil {
		return nil, fmt.Errorf("libdysco: %w (run `make build`, or give --libdysco)", err)
	}
	pr.Logf("building lab %s (star client, proxy, server)", prefix+"rp")
	l, err := set.Up(ctx, prefix+"rp", lab.Star("client", "proxy", "server"), o.Agents())
	if err != nil {
		return nil, err
	}
	rl := &ReconfigLab{Lab: l, lib: lib,
		Client: l.Host("client").Addr4, Proxy: l.Host("proxy").Addr4, Server: l.Host("server").Addr4}
	defer func() {
		if err != nil {
			rl.Close()
		}
	}()
	// Both TCP sessions are Dysco sessions with no middlebox (as in
	// test/e2e/proxy_test.go), so that they can be joined.
	if _, err := labkit.DyscoCLI(ctx, o.Dysco, l, "client", "policy", "add", "to-proxy", fmt.Sprintf("tcp dst port %d", ProxyPort)); err != nil {
		return nil, err
	}
	if _, err := labkit.DyscoCLI(ctx, o.Dysco, l, "proxy", "policy", "add", "to-server", fmt.Sprintf("tcp dst port %d", backendPort)); err != nil {
		return nil, err
	}
	for _, p := range []struct {
		from string
		to   netip.Addr
	}{{"client", rl.Proxy}, {"proxy", rl.Server}} {
		if err := l.Ping(ctx, p.from, p.to); err != nil {
			return nil, fmt.Errorf("lab %s: %s does not reach %s: %w", l.Name(), p.from, p.to, err)
		}
	}
	// Linux's default limit of a TCP receive buffer (tcp_rmem max 6 MiB)
	// on every host, whatever the machine's sysctl says: hundreds of greedy
	// sessions through a proxy, with the larger limits some machines set
	// (32 MiB here), push the kernel into TCP memory pressure (tcp_mem is
	// shared by every namespace), where receive windows collapse to a few
	// KiB and senders crawl; a proxy removal then waits tens of seconds
	// for the old path's last bytes (BENCHMARKS.md, proxy removal).
	for _, h := range []string{"client", "proxy", "server"} {
		if _, err := labkit.Run(ctx, l, h, 10*time.Second, "sysctl", "-w", "net.ipv4.tcp_rmem="+LabTCPRmem); err != nil {
			return nil, err
		}
	}
	if rl.dir, err = os.MkdirTemp("", "dysco-bench-"+l.Name()+"-"); err != nil {
		return nil, err
	}
	rl.cfg = filepath.Join(rl.dir, "haproxy.cfg")
	conf := haproxyConfig(netip.AddrPortFrom(rl.Proxy, ProxyPort), netip.AddrPortFrom(rl.Server, backendPort), o.ReconfigSessions)
	if err := os.WriteFile(rl.cfg, []byte(conf), 0o644); err != nil {
		return nil, err
	}
	if rl.ln, err = l.Listen("server", "tcp", netip.AddrPortFrom(rl.Server, backendPort).String()); err != nil {
		return nil, fmt.Errorf("lab %s: listening on the server: %w", l.Name(), err)
	}
	go rl.serve()
	return rl, nil
}

// LabTCPRmem is the net.ipv4.tcp_rmem of the proxy-removal lab's hosts:
// Linux's defaults.
const LabTCPRmem = "4096 131072 6291456"

// serve hands the server's connections to the current flow set; without
// one (HAProxy's readiness probes) they are closed.
func (rl *ReconfigLab) serve() {
	for {
		c, err := rl.ln.Accept()
		if err != nil {
			return
		}
		if h := rl.Accept.Load(); h != nil {
			(*h)(c)
		} else if fs := rl.cur.Load(); fs != nil {
			fs.add(c, false)
		} else {
			c.Close()
		}
	}
}

func (rl *ReconfigLab) Close() {
	rl.closed.Do(func() {
		if rl.ln != nil {
			rl.ln.Close()
		}
		if rl.dir != "" {
			os.RemoveAll(rl.dir)
		}
	})
}

// haproxyArgv is HAProxy's command line, under libdysco or not.
func (rl *ReconfigLab) haproxyArgv(preload bool) []string {
	argv := []string{"haproxy", "-db", "-f", rl.cfg}
	if preload {
		argv = append([]string{"env", "LD_PRELOAD=" + rl.lib, "DYSCO_SPLICE_TRIGGER=" + reconfigTrigger}, argv...)
	}
	return argv
}

// StartHAProxy stops the running HAProxy, if any, starts a new one and
// waits until it listens. It asks `ss` rather than connecting: HAProxy
// would relay a probe connection to the server, where it could be taken for
// one of the benchmark's sessions.
func (rl *ReconfigLab) StartHAProxy(ctx context.Context, preload bool) error {
	if err := rl.StopHAProxy(); err != nil {
		return err
	}
	name := "haproxy-plain"
	if preload {
		name = "haproxy-libdysco"
	}
	p, err := rl.Lab.Start("proxy", name, rl.haproxyArgv(preload)...)
	if err != nil {
		return err
	}
	rl.HAProxy = p
	ap := netip.AddrPortFrom(rl.Proxy, ProxyPort).String()
	deadline := time.Now().Add(15 * time.Second)
	for {
		select {
		case <-p.Done():
			return fmt.Errorf("haproxy exited at start (%v): see %s", p.Err(), p.Log)
		default:
		}
		out, err := labkit.Run(ctx, rl.Lab, "proxy", 5*time.Second, "ss", "-Hltn", "src", ap)
		if err == nil && strings.Contains(out, ap) {
			return nil
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("haproxy does not listen on %s after 15 s (see %s; ss: %v)", ap, p.Log, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func (rl *ReconfigLab) StopHAProxy() error {
	if rl.HAProxy == nil {
		return nil
	}
	err := rl.HAProxy.Stop()
	rl.HAProxy = nil
	return err
}

// ProxyRewrites is the packets a host's datapath rewrote, both ways.
func ProxyRewrites(st *api.Status) uint64 {
	return st.Counters["rewrite_in"] + st.Counters["rewrite_out"]
}

// rewritesOf sums the rewrite counters of a counter delta.
func rewritesOf(d map[string]uint64) uint64 { return d["rewrite_in"] + d["rewrite_out"] }

// DirectSessions counts the client's sessions from locals ("IP:PORT")
// that go straight to the server.
func (rl *ReconfigLab) DirectSessions(ctx context.Context, o *Options, locals map[string]bool) (int, error) {
	out, err := labkit.DyscoCLI(ctx, o.Dysco, rl.Lab, "client", "sessions", "-o", "json")
	if err != nil {
		return 0, err
	}
	var sess []api.Session
	if err := json.Unmarshal([]byte(out), &sess); err != nil {
		return 0, fmt.Errorf("dysco sessions on the client: %w", err)
	}
	n := 0
	for _, s := range sess {
		src, _, _ := strings.Cut(s.Session, " -> ")
		if locals[src] && strings.Contains(s.Right, "-> "+rl.Server.String()+":") {
			n++
		}
	}
	return n, nil
}

func (rl *ReconfigLab) History(ctx context.Context, o *Options) ([]api.ReconfigResult, error) {
	out, err := labkit.DyscoCLI(ctx, o.Dysco, rl.Lab, "client", "reconfig", "history", "--json")
	if err != nil {
		return nil, err
	}
	var rep api.ReconfigReply
	if err := json.Unmarshal([]byte(out), &rep); err != nil {
		return nil, fmt.Errorf("dysco reconfig history --json on the client: %w: %s", err, labkit.Tail(out, 300))
	}
	return rep.Results, nil
}

// controlOut returns the control messages and datagrams the agents of the
// client, the proxy and the server have sent so far, nil if a status
// cannot be read.
func (rl *ReconfigLab) controlOut(ctx context.Context, o *Options) map[string][2]uint64 {
	out := map[string][2]uint64{}
	for _, h := range []string{"client", "proxy", "server"} {
		st, err := labkit.AgentStatus(ctx, o.Dysco, rl.Lab, h)
		if err != nil {
			return nil
		}
		out[h] = [2]uint64{st.Counters["control_messages_out"], st.Counters["control_datagrams_out"]}
	}
	return out
}

// agentCPU returns the CPU time used so far by the agents of the client and
// the proxy, nil if it cannot be read.
func (rl *ReconfigLab) agentCPU() map[string]time.Duration {
	out := map[string]time.Duration{}
	for _, h := range []string{"client", "proxy"} {
		p := rl.Lab.Agent(h)
		if p == nil {
			return nil
		}
		c, err := CPUTime(p.Pid())
		if err != nil {
			return nil
		}
		out[h] = c
	}
	return out
}
