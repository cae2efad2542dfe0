package cli

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/dysco/dysco/internal/api"
	"github.com/dysco/dysco/internal/policyserver"
	"github.com/dysco/dysco/internal/testutil"
)

// runCLI runs the dysco command line with args and returns what it printed.
func runDysco(t *testing.T, args ...string) (string, error) {
	t.Helper()
	root := Root()
	var out bytes.Buffer
	root.SetOut(&out)
	root.SetErr(&out)
	root.SetArgs(args)
	err := root.ExecuteContext(t.Context())
	return out.String(), err
}

func mustDysco(t *testing.T, args ...string) string {
	t.Helper()
	out, err := runDysco(t, args...)
	if err != nil {
		t.Fatalf("dysco %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	return out
}

// startPolicyServer serves a policy server with a temporary database from
// an httptest server and returns its URL.
func startPolicyServer(t *testing.T, validate func(api.Policy) error) string {
	t.Helper()
	s, err := policyserver.New(policyserver.Config{
		DB:             filepath.Join(t.TempDir(), "policy.db"),
		ValidatePolicy: validate,
		Logger:         slog.New(slog.NewTextHandler(io.Discard, nil)),
		Insecure:       true, // TestPolicyServerVerb covers TLS
	})
	if err != nil {
		t.Fatal(err)
	}
	hs := httptest.NewServer(s.Handler())
	t.Cleanup(func() {
		hs.Close()
		s.Close()
	})
	return hs.URL
}

func TestPolicyVerbsOnServer(t *testing.T) {
	url := startPolicyServer(t, nil)

	out := mustDysco(t, "policy", "add", "web", "--chain", "10.0.1.2,nat", "--priority", "5", "--server", url, "tcp dst port 80")
	if want := `policy "web" installed on policy server ` + url + "\n"; out != want {
		t.Errorf("add printed %q, want %q", out, want)
	}
	// The filter may also come as several words, and flags may follow it.
	mustDysco(t, "policy", "add", "ssh", "tcp", "port", "22", "--server", url, "--host", "h1", "--host", "h2",
		"--chain", "10.0.1.3", "--end-before-destination")
	mustDysco(t, "type", "add", "nat", "10.0.1.5,10.0.1.6", "10.0.1.7", "--server", url)

	out = mustDysco(t, "policy", "list", "--server", url)
	want := `NAME  PRIORITY  FILTER           CHAIN                               HOSTS
ssh   0         tcp port 22      10.0.1.3 (ends before destination)  h1,h2
web   5         tcp dst port 80  10.0.1.2,nat                        *
`
	if out != want {
		t.Errorf("policy list printed\n%s\nwant\n%s", out, want)
	}

	var set api.PolicySet
	if err := json.Unmarshal([]byte(mustDysco(t, "policy", "ls", "-o", "json", "--server", url)), &set); err != nil {
		t.Fatal(err)
	}
	wantWeb := api.Policy{Name: "web", Filter: "tcp dst port 80", Priority: 5,
		Chain: []api.Hop{{Addr: netip.MustParseAddr("10.0.1.2")}, {Type: "nat"}}}
	if set.Version != 3 || len(set.Policies) != 2 || !reflect.DeepEqual(set.Policies[1], wantWeb) {
		t.Errorf("policy list -o json: %+v", set)
	}

	out = mustDysco(t, "type", "list", "--server", url)
	if want := "NAME  INSTANCES\nnat   10.0.1.5,10.0.1.6,10.0.1.7\n"; out != want {
		t.Errorf("type list printed %q, want %q", out, want)
	}

	// A filter that also matches unchained protocols is accepted, with a
	// note; --idle shows in the list.
	out = mustDysco(t, "policy", "add", "dns", "--chain", "10.0.1.4", "--idle", "5m", "--priority", "9", "--server", url, "port 53 or icmp")
	if want := `policy "dns" installed on policy server ` + url + "\n" +
		`policy "dns" chains tcp and udp sessions; other packets its filter matches (icmp and other) pass unchained` + "\n"; out != want {
		t.Errorf("add printed\n%s\nwant\n%s", out, want)
	}
	out = mustDysco(t, "policy", "list", "--server", url)
	want = `NAME  PRIORITY  FILTER           CHAIN                               HOSTS  IDLE
ssh   0         tcp port 22      10.0.1.3 (ends before destination)  h1,h2  -
web   5         tcp dst port 80  10.0.1.2,nat                        *      -
dns   9         port 53 or icmp  10.0.1.4                            *      5m0s
`
	if out != want {
		t.Errorf("policy list printed\n%s\nwant\n%s", out, want)
	}
	if err := json.Unmarshal([]byte(mustDysco(t, "policy", "ls", "-o", "json", "--server", url)), &set); err != nil {
		t.Fatal(err)
	}
	if len(set.Policies) != 3 || set.Policies[2].IdleTimeoutS != 300 {
		t.Errorf("policy list -o json: %+v", set)
	}

	// policy test runs the policies, in order, on the first packet.
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"10.0.0.1:40000", "10.0.3.2:80"}, `tcp 10.0.0.1:40000 -> 10.0.3.2:80: policy "web" matches: chain 10.0.1.2,nat` + "\n"},
		{[]string{"--proto", "udp", "10.0.0.1:40000", "10.0.3.2:53"}, `udp 10.0.0.1:40000 -> 10.0.3.2:53: policy "dns" matches: chain 10.0.1.4` + "\n"},
		{[]string{"--proto", "udp", "[2001:db8::1]:40000", "[2001:db8::2]:53"}, `udp [2001:db8::1]:40000 -> [2001:db8::2]:53: policy "dns" matches: chain 10.0.1.4` + "\n"},
		{[]string{"--proto", "udp", "10.0.0.1:40000", "10.0.3.2:80"}, `udp 10.0.0.1:40000 -> 10.0.3.2:80: no policy matches; the session is not chained` + "\n"},
		{[]string{"--proto", "icmp", "10.0.0.1", "10.0.3.2"}, `icmp 10.0.0.1 -> 10.0.3.2: policy "dns" matches: chain 10.0.1.4` + "\n" +
			`dysco chains tcp and udp sessions: this icmp packet passes unchained` + "\n"},
		// ssh is given to h1 and h2 only.
		{[]string{"--host", "h3", "10.0.0.1:40000", "10.0.3.2:22"}, `tcp 10.0.0.1:40000 -> 10.0.3.2:22: no policy matches; the session is not chained` + "\n"},
		{[]string{"--host", "h1", "10.0.0.1:40000", "10.0.3.2:22"}, `tcp 10.0.0.1:40000 -> 10.0.3.2:22: policy "ssh" matches: chain 10.0.1.3 (ends before destination)` + "\n"},
	} {
		out := mustDysco(t, append([]string{"policy", "test", "--server", url}, tc.args...)...)
		if out != tc.want {
			t.Errorf("policy test %s printed\n%s\nwant\n%s", strings.Join(tc.args, " "), out, tc.want)
		}
	}

	mustDysco(t, "policy", "rm", "web", "ssh", "dns", "--server", url)
	mustDysco(t, "type", "rm", "nat", "--server", url)
	if out := mustDysco(t, "policy", "list", "--server", url); out != "no policies (version 8)\n" {
		t.Errorf("empty list printed %q", out)
	}
	if out := mustDysco(t, "type", "list", "-o", "json", "--server", url); strings.TrimSpace(out) != "[]" {
		t.Errorf("empty type list -o json printed %q", out)
	}
	_, err := runDysco(t, "policy", "rm", "web", "--server", url)
	if err == nil || err.Error() != `policy "web" not found` {
		t.Errorf("rm of an absent policy: %v", err)
	}
}

func TestPolicyAddErrors(t *testing.T) {
	url := startPolicyServer(t, func(p api.Policy) error {
		return fmt.Errorf("policy %q: filter %q: syntax error", p.Name, p.Filter)
	})
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"policy", "add"}, "missing policy NAME and FILTER"},
		{[]string{"policy", "add", "tcp port 80", "--chain", "10.0.0.1"}, `missing policy NAME before the filter "tcp port 80"`},
		{[]string{"policy", "add", "web"}, `missing FILTER after the policy name "web"`},
		{[]string{"policy", "add", "web", "--chain", "10.0.0.1,bad hop", "tcp"}, `--chain: hop "bad hop": neither an IP address nor a middlebox type name`},
		{[]string{"policy", "add", "web", "--host", "h1", "tcp"}, "--host only applies with --server"},
		{[]string{"policy", "add", "web", "--end-before-destination", "tcp"}, "end_before_destination needs a chain"},
		// The server's hook refuses this one; the CLI's own checks pass.
		{[]string{"policy", "add", "web", "--server", url, "tcp dst port 80"}, `policy "web": filter "tcp dst port 80": syntax error`},
		// These the CLI refuses before sending.
		{[]string{"policy", "add", "web", "--server", url, "tcp dst port"}, `policy "web": filter "tcp dst port": can't parse filter expression: syntax error`},
		{[]string{"policy", "add", "ping", "--server", url, "icmp"}, `policy "ping": filter "icmp" matches only icmp packets; dysco chains tcp and udp sessions`},
		{[]string{"policy", "add", "acks", "--server", url, "tcp[tcpflags] & tcp-ack != 0"}, `policy "acks": filter "tcp[tcpflags] & tcp-ack != 0" matches no first packet of a session dysco can chain`},
		{[]string{"policy", "add", "quic", "--idle", "500ms", "udp"}, `--idle 500ms: want whole seconds from 1s to 18h0m0s (0 for the defaults, 30s one way, 2m0s both ways)`},
		{[]string{"policy", "add", "quic", "--idle", "25h", "udp"}, `--idle 25h0m0s: want whole seconds`},
		{[]string{"policy", "add", "quic", "--idle", "-1s", "udp"}, `--idle -1s: want whole seconds`},
		{[]string{"policy", "test", "10.0.0.1:1"}, `accepts 2 arg(s), received 1`},
		{[]string{"policy", "test", "--proto", "ospf", "10.0.0.1", "10.0.0.2"}, `--proto "ospf": want tcp, udp, icmp, icmp6, sctp or an IP protocol number`},
		{[]string{"policy", "test", "10.0.0.1:1", "host:2"}, `DST: "host:2" is not ADDR, ADDR:PORT or [ADDR]:PORT`},
		{[]string{"policy", "test", "10.0.0.1:1", "[2001:db8::1]:2"}, `are of different address families`},
		{[]string{"policy", "test", "--host", "h1", "10.0.0.1:1", "10.0.0.2:2"}, `--host only applies with --server`},
		{[]string{"policy", "list", "-o", "yaml", "--server", url}, `--output "yaml": use table or json`},
		{[]string{"type", "add", "nat"}, "usage: dysco type add NAME ADDR"},
		{[]string{"type", "add", "nat", "10.0.0.1,box"}, `type "nat": instance "box" is not an IP address`},
	} {
		_, err := runDysco(t, tc.args...)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("dysco %s: %v\nwant an error containing %q", strings.Join(tc.args, " "), err, tc.want)
		}
	}
}

var sockSeq atomic.Uint64

// fakeAgent serves h on a fresh abstract socket and points the CLI at it.
func fakeAgent(t *testing.T, h http.Handler) {
	t.Helper()
	name := fmt.Sprintf("@dysco-cli-test-%d-%d-%d", os.Getpid(), time.Now().UnixNano(), sockSeq.Add(1))
	ln, err := net.Listen("unix", name)
	if err != nil {
		t.Fatal(err)
	}
	s := httptest.NewUnstartedServer(h)
	s.Listener.Close()
	s.Listener = ln
	s.Start()
	old := agentClient
	agentClient = func() *api.Client { return api.NewUnixClient(name) }
	t.Cleanup(func() {
		agentClient = old
		s.Close()
	})
}

func agentJSON(w http.ResponseWriter, v any) {
	w.Header().Set("Content-Type", "application/json")
	json.NewEncoder(w).Encode(v)
}

func TestPolicyAddOnLocalAgent(t *testing.T) {
	got := make(chan api.Policy, 1)
	mux := http.NewServeMux()
	mux.HandleFunc("PUT /v1/policies/{name}", func(w http.ResponseWriter, r *http.Request) {
		var p api.Policy
		json.NewDecoder(r.Body).Decode(&p)
		got <- p
		agentJSON(w, p)
	})
	fakeAgent(t, mux)
	out := mustDysco(t, "policy", "add", "web", "--chain", "10.0.1.2", "tcp dst port 80")
	if out != "policy \"web\" installed on the local agent\n" {
		t.Errorf("printed %q", out)
	}
	want := api.Policy{Name: "web", Filter: "tcp dst port 80", Chain: []api.Hop{{Addr: netip.MustParseAddr("10.0.1.2")}}}
	if p := <-got; !reflect.DeepEqual(p, want) {
		t.Errorf("agent got %+v, want %+v", p, want)
	}

	out = mustDysco(t, "policy", "add", "quic", "--chain", "10.0.1.2", "--idle", "90s", "host 10.0.3.2 and not tcp")
	if want := "policy \"quic\" installed on the local agent\n" +
		"policy \"quic\" chains udp sessions; other packets its filter matches (icmp and other) pass unchained\n"; out != want {
		t.Errorf("printed\n%s\nwant\n%s", out, want)
	}
	want = api.Policy{Name: "quic", Filter: "host 10.0.3.2 and not tcp", Chain: []api.Hop{{Addr: netip.MustParseAddr("10.0.1.2")}}, IdleTimeoutS: 90}
	if p := <-got; !reflect.DeepEqual(p, want) {
		t.Errorf("agent got %+v, want %+v", p, want)
	}
}

func TestStatusAndSessions(t *testing.T) {
	started := time.Now().Add(-90 * time.Second).UTC().Truncate(time.Second)
	status := api.Status{Name: "h1", Version: "dev", Started: started, PinDir: "/sys/fs/bpf/dysco", Attach: "tcx",
		Ifaces: []string{"eth0", "eth1"}, Addrs: []string{"10.0.0.1", "fd00::1"}, Tap: "dysco-tap", Sessions: 1, PolicyVersion: 7,
		PolicyServer: "http://10.0.0.9:7017", PolicyServerOK: false,
		Counters:   map[string]uint64{"setups": 3, "drop_map_full": 0},
		Forwarding: &api.Forwarding{IPv4: true, Off: []string{"net.ipv6.conf.all.forwarding"}}}
	sessions := []api.Session{{ID: 4, Proto: "tcp", Session: "10.0.0.1:40000 -> 10.0.0.3:80", Right: "10.0.0.1:40000 -> 10.0.1.2:80",
		Chain: []string{"10.0.1.2"}, Role: "start", State: "established", PacketsFwd: 10, BytesFwd: 5000,
		PacketsRev: 8, BytesRev: 3 << 20, AgeSeconds: 75.4}}
	mux := http.NewServeMux()
	mux.HandleFunc("GET /v1/status", func(w http.ResponseWriter, r *http.Request) { agentJSON(w, status) })
	mux.HandleFunc("GET /v1/sessions", func(w http.ResponseWriter, r *http.Request) { agentJSON(w, sessions) })
	fakeAgent(t, mux)

	out := mustDysco(t, "status")
	for _, want := range []string{
		"agent           h1\n",
		"attach          tcx\n",
		"interfaces      eth0, eth1\n",
		"agent address   10.0.0.1, fd00::1\n",
		"policy version  7\n",
		"ip forwarding   ipv4 on, ipv6 OFF (net.ipv6.conf.all.forwarding=0)\n",
		"policy server   http://10.0.0.9:7017 (UNREACHABLE; enforcing the cached version 7)\n",
		"counters:\n  drop_map_full  0\n  setups         3\n",
		"started         " + started.Format(time.RFC3339) + " (up 1m3",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("status lacks %q:\n%s", want, out)
		}
	}
	var st api.Status
	if err := json.Unmarshal([]byte(mustDysco(t, "status", "-o", "json")), &st); err != nil || !reflect.DeepEqual(st, status) {
		t.Errorf("status -o json: %+v, %v", st, err)
	}

	out = mustDysco(t, "sessions")
	want := `ID  PROTO  SESSION                        ROLE   STATE        LEFT  RIGHT                          CHAIN     PKTS FWD/REV  BYTES FWD/REV  AGE
4   tcp    10.0.0.1:40000 -> 10.0.0.3:80  start  established  -     10.0.0.1:40000 -> 10.0.1.2:80  10.0.1.2  10/8          4.9KiB/3.0MiB  1m15s
`
	if out != want {
		t.Errorf("sessions printed\n%s\nwant\n%s", out, want)
	}
	var ss []api.Session
	if err := json.Unmarshal([]byte(mustDysco(t, "sessions", "-o", "json")), &ss); err != nil || !reflect.DeepEqual(ss, sessions) {
		t.Errorf("sessions -o json: %+v, %v", ss, err)
	}
}

func TestNoAgent(t *testing.T) {
	old := agentClient
	agentClient = func() *api.Client {
		return api.NewUnixClient(fmt.Sprintf("@dysco-cli-test-absent-%d-%d", os.Getpid(), time.Now().UnixNano()))
	}
	t.Cleanup(func() { agentClient = old })
	for _, verb := range [][]string{{"status"}, {"sessions"}, {"policy", "list"}} {
		_, err := runDysco(t, verb...)
		if err == nil || err.Error() != api.ErrNoAgent.Error() {
			t.Errorf("dysco %s with no agent: %v", verb, err)
		}
	}
}

// The policy server and the policy verbs over mutual TLS, with the
// certificates of `dysco certs`.
func TestPolicyServerVerb(t *testing.T) {
	dir := t.TempDir()
	pki := filepath.Join(dir, "pki")
	mustDysco(t, "certs", "ca", "--dir", pki)
	mustDysco(t, "certs", "server", "--dir", pki, "--ip", "127.0.0.1")
	mustDysco(t, "certs", "operator", "--dir", pki)
	mustDysco(t, "certs", "monitor", "--dir", pki)
	if _, err := runDysco(t, "certs", "operator", "--dir", pki); err == nil || !strings.Contains(err.Error(), "--force") {
		t.Errorf("second operator certificate: %v, want a refusal naming --force", err)
	}
	ready := filepath.Join(dir, "ready")
	w := testutil.NewFileWaiter(t, ready)
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() {
		root := Root()
		root.SetArgs([]string{"policy-server", "--listen", "127.0.0.1:0", "--metrics-listen", "", "--pki-dir", pki, "--db", filepath.Join(dir, "db", "p.db"), "--ready-file", ready})
		root.SetErr(io.Discard)
		done <- root.ExecuteContext(ctx)
	}()
	addr := w.Wait(t)
	url := "https://" + addr
	mustDysco(t, "policy", "add", "all", "--server", url, "--pki-dir", pki, "tcp")
	if out := mustDysco(t, "policy", "list", "--server", url, "--pki-dir", pki); !strings.Contains(out, "all   0         tcp     -      *") {
		t.Errorf("list printed %q", out)
	}
	mon := []string{"--server", url, "--pki-dir", pki, "--tls-cert", filepath.Join(pki, "monitor.crt")}
	if out := mustDysco(t, append([]string{"policy", "list"}, mon...)...); !strings.Contains(out, "all ") {
		t.Errorf("monitor's list printed %q", out)
	}
	if _, err := runDysco(t, append([]string{"policy", "rm", "all"}, mon...)...); err == nil || !strings.Contains(err.Error(), "not for the monitor role") {
		t.Errorf("monitor's rm: %v, want a 403", err)
	}
	// The monitor's certificate revoked: refused without a restart.
	if out := mustDysco(t, "certs", "revoke", "monitor", "--dir", pki); !strings.Contains(out, `revoked monitor "monitor"`) || !strings.Contains(out, "number 1") {
		t.Errorf("revoke printed %q", out)
	}
	testutil.Eventually(t, 5*time.Second, "the monitor to be refused", func() bool {
		_, err := runDysco(t, append([]string{"policy", "list"}, mon...)...)
		return err != nil && strings.Contains(err.Error(), "is revoked")
	})
	if _, err := runDysco(t, "policy", "list", "--server", "http://"+addr, "--pki-dir", pki); err == nil || !strings.Contains(err.Error(), "serves HTTPS") {
		t.Errorf("http:// URL: %v", err)
	}
	if _, err := runDysco(t, "policy", "list", "--server", url, "--pki-dir", filepath.Join(dir, "none")); err == nil || !strings.Contains(err.Error(), "dysco certs") {
		t.Errorf("no certificates: %v", err)
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("policy-server: %v", err)
	}
	// Two stores at once: refused before anything starts.
	if _, err := runDysco(t, "policy-server", "--insecure", "--etcd", "http://127.0.0.1:1", "--db", filepath.Join(dir, "p2.db")); err == nil || !strings.Contains(err.Error(), "give one store") {
		t.Errorf("--db with --etcd: %v", err)
	}
}

// TestPolicyServerRefusesUnchained sends policies straight to a policy
// server that validates with the hook `dysco policy-server` installs: a
// filter that matches no protocol dysco chains gets a 400.
func TestPolicyServerRefusesUnchained(t *testing.T) {
	url := startPolicyServer(t, policyServerValidatePolicy)
	c, err := clientFor(url, pkiFlags{})
	if err != nil {
		t.Fatal(err)
	}
	err = c.PutPolicy(t.Context(), api.Policy{Name: "quic", Filter: "icmp", Chain: []api.Hop{{Addr: netip.MustParseAddr("10.0.1.2")}}})
	if want := `policy "quic": filter "icmp" matches only icmp packets; dysco chains tcp and udp sessions`; err == nil || err.Error() != want {
		t.Errorf("PUT icmp policy: %v\nwant %s", err, want)
	}
	if err := c.PutPolicy(t.Context(), api.Policy{Name: "quic", Filter: "udp dst port 4433", IdleTimeoutS: 60}); err != nil {
		t.Errorf("PUT udp policy: %v", err)
	}
	set, err := c.Policies(t.Context())
	if err != nil || len(set.Policies) != 1 || set.Policies[0].IdleTimeoutS != 60 {
		t.Errorf("policies %+v, %v", set, err)
	}
}

// TestStatusCluster: the agents registered at the policy server, with the
// version each holds against the one in force.
func TestStatusCluster(t *testing.T) {
	url := startPolicyServer(t, nil)
	mustDysco(t, "policy", "add", "web", "--server", url, "tcp dst port 80")
	// Two agents poll: h1 holds the set in force (version 1), h2 none;
	// they run different versions.
	for _, q := range []string{"host=h1&after=1&wait=0&version=1.0+(block+2,+control+6)", "host=h2&after=0&wait=0&version=0.9"} {
		resp, err := http.Get(url + "/v1/watch?" + q)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
	}
	var out string
	testutil.Eventually(t, 5*time.Second, "both agents registered", func() bool {
		out = mustDysco(t, "status", "--cluster", "--server", url)
		return strings.Contains(out, "2 agents")
	})
	for _, want := range []string{"AGENT  ADDRESS    APPLIED     LAST HEARD  VERSION\n", "\nh1     127.0.0.1  1           ", "  1.0 (block 2, control 6)\n", "\nh2     127.0.0.1  0 (behind)  ",
		"2 agents, 1 behind version 1 in force\n", "warning: agents run 2 versions (0.9: 1; 1.0 (block 2, control 6): 1)"} {
		if !strings.Contains(out, want) {
			t.Errorf("status --cluster lacks %q:\n%s", want, out)
		}
	}
	// A version that is not one is refused.
	if resp, err := http.Get(url + "/v1/watch?host=h3&wait=0&version=%01"); err != nil || resp.StatusCode != http.StatusBadRequest {
		t.Errorf("a poll with a control character in its version: %v %v", resp, err)
	}
	if _, err := runDysco(t, "status", "--cluster"); err == nil || !strings.Contains(err.Error(), "--cluster needs --server") {
		t.Errorf("--cluster without --server: %v", err)
	}
}
