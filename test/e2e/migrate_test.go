package e2e

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/dysco/dysco/internal/api"
	"github.com/dysco/dysco/internal/lab"
	"github.com/dysco/dysco/internal/migrate"
	"github.com/dysco/dysco/internal/testutil"
	"github.com/dysco/dysco/internal/wire"
)

// strictFirewall makes a host a strict stateful firewall: the
// FORWARD chain drops everything but established traffic and new SYNs,
// and conntrack neither picks up connections mid-stream nor lets packets
// outside the tracked windows through.
func (e *env) strictFirewall(host string) {
	e.t.Helper()
	for _, argv := range [][]string{
		{"iptables", "-P", "FORWARD", "DROP"},
		{"iptables", "-A", "FORWARD", "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT"},
		{"iptables", "-A", "FORWARD", "-p", "tcp", "--syn", "-m", "conntrack", "--ctstate", "NEW", "-j", "ACCEPT"},
		{"sysctl", "-qw", "net.netfilter.nf_conntrack_tcp_loose=0"},
		{"sysctl", "-qw", "net.netfilter.nf_conntrack_tcp_be_liberal=0"},
	} {
		e.run(host, argv...)
	}
}

// forwardDrops reads the packets the FORWARD chain's policy dropped.
func (e *env) forwardDrops(host string) uint64 {
	e.t.Helper()
	out := e.run(host, "iptables", "-L", "FORWARD", "-n", "-v", "-x")
	// Chain FORWARD (policy DROP 12 3456 bytes)
	m := regexp.MustCompile(`policy DROP (\d+) packets`).FindStringSubmatch(out)
	if m == nil {
		m = regexp.MustCompile(`policy DROP (\d+)`).FindStringSubmatch(out)
	}
	if m == nil {
		e.t.Fatalf("%s: no FORWARD policy counter in:\n%s", host, out)
	}
	n, _ := strconv.ParseUint(m[1], 10, 64)
	return n
}

// tracked tells whether a host's conntrack table holds the session, read
// through netlink with the conntrack state plug-in.
func (e *env) tracked(host string, t wire.Tuple) bool {
	e.t.Helper()
	var have bool
	err := e.inNS(host, func() error {
		set, err := migrate.NewSet([]string{"conntrack"}, migrate.Options{})
		if err != nil {
			return err
		}
		b, err := set.Export(context.Background(), migrate.Session{Tuple: t, Proto: 6})
		if err != nil {
			return err
		}
		have = len(b["conntrack"]) > 0
		return nil
	})
	if err != nil {
		e.t.Fatalf("%s: conntrack: %v", host, err)
	}
	return have
}

// testProviderName is the name the test's state providers register under
// (the same on every host: the api plug-in imports a provider's state into
// the provider of that name).
const testProviderName = "e2e-test"

// testProvider is a state provider of the api plug-in that a test serves
// itself (docs/state-migration-plugins.md, "api: the provider protocol"):
// export answers POST /v1/export, imp POST /v1/import (given the state);
// either, when nil, and POST /v1/release answer 204.
type testProvider struct {
	export func(ctx context.Context) (code int, body []byte)
	imp    func(state []byte) (code int, body []byte)
}

func (p testProvider) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	var req migrate.ProviderRequest
	if err := json.NewDecoder(r.Body).Decode(&req); err != nil || r.Method != http.MethodPost {
		code, body := providerError(http.StatusBadRequest, fmt.Sprintf("%s %s: want POST and a JSON body (%v)", r.Method, r.URL.Path, err))
		w.WriteHeader(code)
		w.Write(body)
		return
	}
	code, body := http.StatusNoContent, []byte(nil)
	switch r.URL.Path {
	case "/v1/export":
		if p.export != nil {
			code, body = p.export(r.Context())
		}
	case "/v1/import":
		if p.imp != nil {
			code, body = p.imp(req.State)
		}
	case "/v1/release":
	default:
		code, body = providerError(http.StatusNotFound, "no such route "+r.URL.Path)
	}
	w.WriteHeader(code)
	if len(body) > 0 {
		w.Write(body)
	}
}

// providerError is a provider's failure: code and {"error": msg}, which the
// api plug-in puts into the migration's error.
func providerError(code int, msg string) (int, []byte) {
	b, _ := json.Marshal(api.Error{Error: msg})
	return code, b
}

// stateProvider serves p on a Unix socket under the test's temporary
// directory and registers it with host's agent as testProviderName. The
// socket is a path, not an abstract socket: abstract sockets belong to a
// network namespace, and the agent runs in the host's, the test in the
// root one. When the test ends the provider is unregistered and closed
// (before the lab goes down: cleanups run last first).
func (e *env) stateProvider(host string, p testProvider) {
	e.t.Helper()
	sock := filepath.Join(e.t.TempDir(), host+".sock")
	ln, err := net.Listen("unix", sock)
	if err != nil {
		e.t.Fatalf("state provider for %s: %v", host, err)
	}
	srv := &http.Server{Handler: p}
	go srv.Serve(ln)
	path := "/v1/state/providers/" + testProviderName
	if err := e.agentAPI(host, http.MethodPut, path, migrate.RegisterRequest{Socket: sock}); err != nil {
		srv.Close()
		e.t.Fatalf("registering the state provider with %s's agent: %v", host, err)
	}
	e.t.Cleanup(func() {
		if err := e.agentAPI(host, http.MethodDelete, path, nil); err != nil {
			e.t.Errorf("unregistering the state provider from %s's agent: %v", host, err)
		}
		srv.Close()
	})
}

// agentAPI sends a request to the local API of host's agent. Its socket
// (api.AgentSocket) is abstract, so it exists in the host's network
// namespace only: the connection is opened there.
func (e *env) agentAPI(host, method, path string, body any) error {
	var rd io.Reader
	if body != nil {
		b, err := json.Marshal(body)
		if err != nil {
			return err
		}
		rd = bytes.NewReader(b)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, method, "http://dysco-agent"+path, rd)
	if err != nil {
		return err
	}
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	tr := &http.Transport{DisableKeepAlives: true, DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		var c net.Conn
		err := e.inNS(host, func() error {
			var err error
			c, err = (&net.Dialer{}).DialContext(ctx, "unix", api.AgentSocket)
			return err
		})
		return c, err
	}}
	defer tr.CloseIdleConnections()
	resp, err := (&http.Client{Transport: tr}).Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	data, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<16))
	if resp.StatusCode/100 != 2 {
		var ae api.Error
		if json.Unmarshal(data, &ae) == nil && ae.Error != "" {
			data = []byte(ae.Error)
		}
		return fmt.Errorf("%s %s: %s: %s", method, path, resp.Status, bytes.TrimSpace(data))
	}
	return nil
}

// migrateReconfig runs `dysco reconfig … --migrate-state` on host.
func (e *env) migrateReconfig(host, match string, to netip.Addr, chain netip.Addr, extra ...string) []api.ReconfigResult {
	e.t.Helper()
	args := append([]string{"reconfig", "--json", "--match", match, "--to", to.String(), "--chain", chain.String()}, extra...)
	out, err := e.lab.Command(e.t.Context(), host, append([]string{dyscoBin}, args...)...).Output()
	var rep api.ReconfigReply
	if jerr := json.Unmarshal(out, &rep); jerr != nil {
		e.t.Fatalf("%s: dysco %s: %v (%v)\n%s", host, strings.Join(args, " "), jerr, err, out)
	}
	return rep.Results
}

// TestStateMigration replaces a strict stateful firewall by another under
// running transfers in both directions (paper §3.5, §5.3): with
// state migration every byte arrives and the new firewall's conntrack
// holds the session, for each cut-over semantics; failures of the export,
// of the import and a full hold buffer cancel cleanly (the session goes on
// through the old firewall); without migration the new firewall drops the
// session's packets. A monitor on each instance checks the substream
// property.
func TestStateMigration(t *testing.T) {
	// The firewalls move their conntrack state and, through the api
	// plug-in, the state of a provider the test serves on each of them
	// (conntrack first: a failed api import rolls conntrack back).
	plugins := []string{"--state-plugins", "conntrack,api"}
	e := newLab(t, labOpts{
		topology: lab.Star("client", "mb1", "mb2", "mb3", "server"),
		hostArgs: map[string][]string{"mb1": plugins, "mb2": plugins, "mb3": plugins},
	})
	for _, h := range []string{"mb1", "mb2", "mb3"} {
		e.strictFirewall(h)
	}
	// mb1's provider has state of every session, which mb2's accepts; on
	// mb3, a firewall whose state fails both ways, it refuses exports and
	// imports (mb3 imports only in import-fails, where mb1's provider
	// state makes the api plug-in import at all). mb2's provider waits
	// 300 ms before it answers an export (only buffer-full exports at
	// mb2), so that paced packets surely reach the anchors during that
	// freeze even when the machine is loaded: with a freeze of a few ms
	// the case once found no packet to hold and succeeded.
	const mb1State = "mb1's state of the session"
	e.stateProvider("mb1", testProvider{
		export: func(context.Context) (int, []byte) { return http.StatusOK, []byte(mb1State) },
	})
	e.stateProvider("mb2", testProvider{
		export: func(ctx context.Context) (int, []byte) {
			select {
			case <-time.After(300 * time.Millisecond):
			case <-ctx.Done():
			}
			return http.StatusNoContent, nil
		},
		imp: func(state []byte) (int, []byte) {
			if string(state) != mb1State {
				return providerError(http.StatusBadRequest, fmt.Sprintf("state %q, want mb1's %q", state, mb1State))
			}
			return http.StatusNoContent, nil
		},
	})
	e.stateProvider("mb3", testProvider{
		export: func(context.Context) (int, []byte) {
			return providerError(http.StatusInternalServerError, "the test's provider refuses to export")
		},
		imp: func([]byte) (int, []byte) {
			return providerError(http.StatusInternalServerError, "the test's provider refuses to import")
		},
	})
	dst := e.addr("server", false)
	mb1, mb2, mb3 := e.addr("mb1", false), e.addr("mb2", false), e.addr("mb3", false)
	type tc struct {
		name   string
		port   uint16
		via    netip.Addr
		to     netip.Addr
		args   []string
		fail   string // expected failure in the reason; "" for success
		rate   int64
		stayOn string // host the session must stay on after a failure
	}
	cases := []tc{
		{name: "loss-free", port: 9402, via: mb1, to: mb2, args: []string{"--semantics", "loss-free"}},
		{name: "order", port: 9403, via: mb1, to: mb2, args: []string{"--semantics", "order"}},
		{name: "substream", port: 9404, via: mb1, to: mb2, args: []string{"--semantics", "substream"}, rate: 2 * mib},
		{name: "export-fails", port: 9406, via: mb3, to: mb2, fail: "export", stayOn: "mb3"},
		{name: "import-fails", port: 9407, via: mb1, to: mb3, fail: "import", stayOn: "mb1"},
		{name: "buffer-full", port: 9408, via: mb2, to: mb1, args: []string{"--semantics", "order", "--hold-limit", "1"}, fail: "hold buffer full", stayOn: "mb2"},
	}
	const total = 48 * mib
	lts := map[uint16]*liveTransfer{}
	for _, c := range cases {
		e.policy("client", fmt.Sprintf("p%d", c.port), fmt.Sprintf("tcp dst port %d", c.port), c.via.String())
	}
	e.policy("client", "plain", "tcp dst port 9405", mb1.String())
	// The monitors of the substream case: each firewall's session view.
	stop1 := e.capture("mb1", "dysco-tap", "tcp port 9404", "-S", "-tt", "-B", "16384")
	stop2 := e.capture("mb2", "dysco-tap", "tcp port 9404", "-S", "-tt", "-B", "16384")
	sessionOf := func(port uint16) wire.Tuple {
		for _, s := range e.sessions("client") {
			tu, err := parseTuple(s.Session)
			if err == nil && tu.DstPort == port {
				return tu
			}
		}
		t.Fatalf("no session to port %d at the client", port)
		return wire.Tuple{}
	}
	for _, c := range cases {
		// Each case's transfer starts when its turn comes, so that it is
		// still running when its middlebox is replaced.
		rate := c.rate
		if rate == 0 {
			rate = 6 * mib
		}
		lts[c.port] = e.startTransfer("client", "server", dst, c.port, total, rate)
		lt := lts[c.port]
		testutil.Eventually(t, 30*time.Second, c.name+" transfer to start", func() bool { return lt.received.Load() > mib })
		tu := sessionOf(c.port)
		if !e.tracked(hostOf(e, c.via), tu) {
			t.Fatalf("%s: the old firewall does not track %s", c.name, tu)
		}
		drops := e.forwardDrops("mb2")
		res := e.migrateReconfig("client", fmt.Sprintf("tcp port %d", c.port), dst, c.to, append([]string{"--migrate-state"}, c.args...)...)
		if len(res) != 1 {
			t.Fatalf("%s: %d results: %+v", c.name, len(res), res)
		}
		r := res[0]
		if lts[c.port].received.Load() >= total {
			t.Fatalf("%s: the transfer ended before the replacement: pace it slower", c.name)
		}
		if c.fail == "" {
			if r.Outcome != "succeeded" || r.Migration == nil || r.Migration.Error != "" {
				t.Fatalf("%s: %+v %+v", c.name, r, r.Migration)
			}
			m := r.Migration
			t.Logf("%s: switch after %.2f ms (drain %.2f, export %.2f, import %.2f), state %d B %v, held %d packets %d B; note %q; completed in %.2f ms",
				c.name, ms(m.SwitchMicros), ms(m.DrainMicros), ms(m.ExportMicros), ms(m.ImportMicros), m.StateBytes, m.Plugins, m.HeldPackets, m.HeldBytes, m.Note, ms(r.Micros))
			if !e.tracked("mb2", tu) {
				t.Errorf("%s: mb2's conntrack does not hold the session", c.name)
			}
			testutil.Eventually(t, 15*time.Second, c.name+": mb1 to leave the path", func() bool { return !hasSession(e, "mb1", c.port) })
			at := lts[c.port].received.Load()
			testutil.Eventually(t, 30*time.Second, c.name+": data through mb2", func() bool { return lts[c.port].received.Load() > at+2*mib })
			if d := e.forwardDrops("mb2") - drops; d != 0 {
				t.Errorf("%s: mb2's firewall dropped %d packets after the migration", c.name, d)
			}
			// The old instance lets go of the state once the old path is freed.
			testutil.Eventually(t, 20*time.Second, c.name+": mb1 to release the state", func() bool { return !e.tracked("mb1", tu) })
			continue
		}
		if r.Outcome != "failed" || !strings.Contains(r.Reason, c.fail) {
			t.Fatalf("%s: want a failure naming %q, got %+v %+v", c.name, c.fail, r, r.Migration)
		}
		t.Logf("%s: cancelled as expected: %s", c.name, r.Reason)
		// The session goes on through the old firewall, which still
		// tracks it; the new one neither holds the state nor the session.
		at := lts[c.port].received.Load()
		testutil.Eventually(t, 30*time.Second, c.name+": data through "+c.stayOn, func() bool { return lts[c.port].received.Load() > at+2*mib })
		if !e.tracked(c.stayOn, tu) {
			t.Errorf("%s: %s lost the session's state", c.name, c.stayOn)
		}
		if !hasSession(e, c.stayOn, c.port) {
			t.Errorf("%s: the session left %s", c.name, c.stayOn)
		}
		// A replacement cancelled after its import lets go of the state.
		h := hostOf(e, c.to)
		testutil.Eventually(t, 15*time.Second, c.name+": "+h+" to hold no state of the session", func() bool { return !e.tracked(h, tu) })
	}
	for _, c := range cases {
		lts[c.port].wait(t)
	}
	seen1, seen2 := stop1(), stop2()
	checkSubstream(t, seen1, seen2)

	// Without migration the same replacement breaks the session: mb2
	// drops its mid-stream packets (the test above can fail).
	lt := e.startTransfer("client", "server", dst, 9405, total, 6*mib)
	testutil.Eventually(t, 30*time.Second, "the plain transfer to start", func() bool { return lt.received.Load() > mib })
	drops := e.forwardDrops("mb2")
	res := e.reconfig("client", "tcp port 9405", dst, mb2)
	if len(res) != 1 {
		t.Fatalf("plain replacement: %+v", res)
	}
	testutil.Eventually(t, 15*time.Second, "mb2 to drop the session's packets", func() bool { return e.forwardDrops("mb2") > drops+10 })
	at := lt.received.Load()
	deadline := time.Now().Add(3 * time.Second)
	for time.Now().Before(deadline) {
		if lt.received.Load() > at+mib {
			t.Fatalf("data still flows through mb2 without its state: the strict firewall lets mid-stream packets through")
		}
		time.Sleep(50 * time.Millisecond)
	}
	t.Logf("without migration mb2 dropped %d packets and the transfer stalled at %d bytes", e.forwardDrops("mb2")-drops, lt.received.Load())
}

func ms(us int64) float64 { return float64(us) / 1000 }

func hostOf(e *env, a netip.Addr) string {
	for _, h := range []string{"mb1", "mb2", "mb3"} {
		if e.addr(h, a.Is6()) == a {
			return h
		}
	}
	e.t.Fatalf("no host has %s", a)
	return ""
}

func hasSession(e *env, host string, port uint16) bool {
	for _, s := range e.sessions(host) {
		if tu, err := parseTuple(s.Session); err == nil && tu.DstPort == port {
			return true
		}
	}
	return false
}

// parseTuple reads "a:p -> b:q" (wire.Tuple.String).
func parseTuple(s string) (wire.Tuple, error) {
	a, b, ok := strings.Cut(s, " -> ")
	if !ok {
		return wire.Tuple{}, fmt.Errorf("tuple %q", s)
	}
	src, err := netip.ParseAddrPort(strings.TrimSpace(a))
	if err != nil {
		return wire.Tuple{}, err
	}
	dst, err := netip.ParseAddrPort(strings.TrimSpace(b))
	if err != nil {
		return wire.Tuple{}, err
	}
	return wire.Tuple{Src: src.Addr(), Dst: dst.Addr(), SrcPort: src.Port(), DstPort: dst.Port()}, nil
}

// A data packet as tcpdump -S -tt printed it.
type seen struct {
	at       float64
	dir      string // "src > dst"
	from, to uint32
}

var tcpdumpData = regexp.MustCompile(`^(\d+\.\d+) IP6? (\S+) > (\S+): .* seq (\d+):(\d+),`)

func dataPackets(lines []string) []seen {
	var out []seen
	for _, l := range lines {
		m := tcpdumpData.FindStringSubmatch(l)
		if m == nil {
			continue
		}
		at, _ := strconv.ParseFloat(m[1], 64)
		a, _ := strconv.ParseUint(m[4], 10, 32)
		b, _ := strconv.ParseUint(m[5], 10, 32)
		out = append(out, seen{at: at, dir: m[2] + ">" + strings.TrimSuffix(m[3], ":"), from: uint32(a), to: uint32(b)})
	}
	return out
}

// checkSubstream checks M2M's substream order-preserving property for each
// direction: the old instance saw a complete prefix of the byte stream, the
// new one only bytes after it, and the old one saw its last byte before
// the new one saw its first.
func checkSubstream(t *testing.T, old, new []string) {
	t.Helper()
	po, pn := dataPackets(old), dataPackets(new)
	dirs := map[string]bool{}
	for _, p := range po {
		dirs[p.dir] = true
	}
	if len(dirs) != 2 {
		t.Fatalf("the old instance's monitor saw data in %d directions, want 2 (%d lines)", len(dirs), len(old))
	}
	for dir := range dirs {
		var ro, rn []seen
		for _, p := range po {
			if p.dir == dir {
				ro = append(ro, p)
			}
		}
		for _, p := range pn {
			if p.dir == dir {
				rn = append(rn, p)
			}
		}
		if len(rn) == 0 {
			t.Errorf("%s: the new instance saw no data", dir)
			continue
		}
		sort.Slice(ro, func(i, j int) bool { return int32(ro[i].from-ro[j].from) < 0 })
		// A complete prefix: the ranges join without a hole.
		end := ro[0].to
		var lastOld float64
		for _, p := range ro {
			if int32(p.from-end) > 0 {
				t.Errorf("%s: the old instance never saw bytes %d..%d", dir, end, p.from)
			}
			if int32(p.to-end) > 0 {
				end = p.to
			}
			lastOld = max(lastOld, p.at)
		}
		firstNew, minNew := rn[0].at, rn[0].from
		for _, p := range rn {
			firstNew = min(firstNew, p.at)
			if int32(p.from-minNew) < 0 {
				minNew = p.from
			}
		}
		if int32(minNew-end) < 0 {
			t.Errorf("%s: the new instance saw bytes from %d, before the end %d of the old one's prefix", dir, minNew, end)
		}
		if lastOld > firstNew {
			t.Errorf("%s: the old instance saw data %.6f s after the new one's first (%.6f)", dir, lastOld, firstNew)
		}
		t.Logf("substream %s: old instance %d packets up to %d, new instance %d packets from %d", dir, len(ro), end, len(rn), minNew)
	}
}
