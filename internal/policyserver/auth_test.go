package policyserver

import (
	"context"
	"crypto/tls"
	"encoding/json"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/dysco/dysco/internal/api"
	"github.com/dysco/dysco/internal/certs"
	"github.com/dysco/dysco/internal/psclient"
	"github.com/dysco/dysco/internal/testutil"
)

// testPKI is a CA with the server's certificate (127.0.0.1) and clients'.
type testPKI struct{ dir string }

func newPKI(t *testing.T, clients ...string) testPKI {
	t.Helper()
	dir := t.TempDir()
	if _, err := certs.CreateCA(dir, "", certs.Options{}); err != nil {
		t.Fatal(err)
	}
	if _, _, err := certs.IssueServer(dir, []string{"localhost"}, []netip.Addr{netip.MustParseAddr("127.0.0.1")}, certs.Options{}); err != nil {
		t.Fatal(err)
	}
	for _, c := range clients { // "role:name"
		role, name, _ := strings.Cut(c, ":")
		if _, _, err := certs.IssueClient(dir, role, name, certs.Options{}); err != nil {
			t.Fatal(err)
		}
	}
	return testPKI{dir}
}

func (p testPKI) serverConfig() Config {
	c, k := certs.Paths(p.dir, certs.ServerName)
	return Config{CertFile: c, KeyFile: k, ClientCAFile: filepath.Join(p.dir, certs.CAFile)}
}

// tls returns the client configuration of role:name ("" for none).
func (p testPKI) tls(t *testing.T, who string) *tls.Config {
	t.Helper()
	cert, key := "", ""
	if who != "" {
		role, name, _ := strings.Cut(who, ":")
		cert, key = certs.Paths(p.dir, certs.BaseName(role, name))
	}
	tc, err := certs.ClientTLS(filepath.Join(p.dir, certs.CAFile), cert, key)
	if err != nil {
		t.Fatal(err)
	}
	return tc
}

// doAs sends a request with the TLS configuration tc.
func doAs(t *testing.T, tc *tls.Config, method, url, body string) (int, []byte) {
	t.Helper()
	tr := &http.Transport{TLSClientConfig: tc}
	defer tr.CloseIdleConnections()
	req, err := http.NewRequest(method, url, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	resp, err := (&http.Client{Transport: tr}).Do(req)
	if err != nil {
		t.Fatalf("%s %s: %v", method, url, err)
	}
	defer resp.Body.Close()
	data, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, data
}

// refusedCounts scrapes the refusal counter: "route code reason" -> count.
func refusedCounts(t *testing.T, s *Server) map[string]int {
	t.Helper()
	mts := httptest.NewServer(s.MetricsHandler())
	defer mts.Close()
	_, data := call(t, "GET", mts.URL+"/metrics", "")
	re := regexp.MustCompile(`(?m)^dysco_policyserver_requests_refused_total\{code="(\d+)",reason="([a-z_]+)",route="([^"]+)"\} (\d+)$`)
	out := map[string]int{}
	for _, m := range re.FindAllStringSubmatch(string(data), -1) {
		n, _ := strconv.Atoi(m[4])
		out[m[3]+" "+m[1]+" "+m[2]] = n
	}
	return out
}

// Every route refuses a client without a certificate, with one of another
// CA, and with one whose role does not fit (403); each refusal is counted.
func TestAuthRolesAndCounters(t *testing.T) {
	pki := newPKI(t, "agent:h1", "agent:h2", "operator:operator", "monitor:monitor")
	ts := startServer(t, pki.serverConfig())
	other := newPKI(t, "operator:operator")
	ca := pki.tls(t, "")
	foreign := other.tls(t, "operator:operator")
	foreign.RootCAs = ca.RootCAs // trusts the server, presents another CA's certificate
	h1, h2, op, mon := pki.tls(t, "agent:h1"), pki.tls(t, "agent:h2"), pki.tls(t, "operator:operator"), pki.tls(t, "monitor:monitor")
	u := ts.url

	policy := `{"filter":"tcp","hosts":["h2"]}`
	routes := []struct{ method, path, body string }{
		{"PUT", "/v1/policies/p", policy},
		{"DELETE", "/v1/policies/p", ""},
		{"PUT", "/v1/types/t", `{"hops":["10.0.0.1"]}`},
		{"DELETE", "/v1/types/t", ""},
		{"GET", "/v1/watch?host=h2&wait=0", ""},
		{"POST", "/v1/operations", `{"host":"h2","middlebox":{"match":"tcp"}}`},
		{"POST", "/v1/operations/claim?host=h2&wait=0", ""},
		{"PUT", "/v1/operations/x/result", `{"host":"h2","error":"x"}`},
		{"GET", "/v1/policies", ""},
		{"GET", "/v1/operations", ""},
	}
	for _, r := range routes {
		for _, c := range []struct {
			name string
			tc   *tls.Config
		}{{"no certificate", ca}, {"another CA's certificate", foreign}} {
			if code, data := doAs(t, c.tc, r.method, u+r.path, r.body); code != http.StatusUnauthorized {
				t.Errorf("%s %s with %s: %d %s, want 401", r.method, r.path, c.name, code, data)
			}
		}
	}
	// Plain HTTP to the TLS listener: no 2xx.
	if code, _ := call(t, "GET", "http"+strings.TrimPrefix(u, "https")+"/v1/policies", ""); code/100 == 2 {
		t.Errorf("plain HTTP answered %d", code)
	}
	testutil.Eventually(t, 5*time.Second, "the failed handshake to be counted", func() bool {
		mts := httptest.NewServer(ts.MetricsHandler())
		defer mts.Close()
		_, data := call(t, "GET", mts.URL+"/metrics", "")
		return strings.Contains(string(data), "dysco_policyserver_tls_handshake_errors_total 1\n")
	})

	expect := func(tc *tls.Config, who, method, path, body string, want int) []byte {
		t.Helper()
		code, data := doAs(t, tc, method, u+path, body)
		if code != want {
			t.Errorf("%s: %s %s: %d %s, want %d", who, method, path, code, data, want)
		}
		return data
	}
	// Agents: no writes, no lists, no other host's policies or operations.
	expect(h1, "agent h1", "PUT", "/v1/policies/p", policy, 403)
	expect(h1, "agent h1", "DELETE", "/v1/types/t", "", 403)
	expect(h1, "agent h1", "POST", "/v1/operations", `{"host":"h2","middlebox":{"match":"tcp"}}`, 403)
	expect(h1, "agent h1", "GET", "/v1/policies", "", 403)
	expect(h1, "agent h1", "GET", "/v1/watch?host=h2&wait=0", "", 403)
	expect(h1, "agent h1", "POST", "/v1/operations/claim?host=h2&wait=0", "", 403)
	// Monitors read and nothing else.
	expect(mon, "monitor", "GET", "/v1/policies", "", 200)
	expect(mon, "monitor", "GET", "/v1/operations", "", 200)
	expect(mon, "monitor", "PUT", "/v1/policies/p", policy, 403)
	expect(mon, "monitor", "GET", "/v1/watch?host=h2&wait=0", "", 403)
	expect(mon, "monitor", "POST", "/v1/operations/claim?wait=0", "", 403)
	// Operators write.
	expect(op, "operator", "PUT", "/v1/policies/p", policy, 200)
	expect(op, "operator", "POST", "/v1/operations/claim?host=h2&wait=0", "", 403)

	// An agent's watch is for its own host, whatever it asks.
	for who, tc := range map[string]*tls.Config{"h1": h1, "h2": h2} {
		set := decode[api.PolicySet](t, expect(tc, who, "GET", "/v1/watch?wait=0", "", 200))
		if want := map[string]int{"h1": 0, "h2": 1}[who]; len(set.Policies) != want {
			t.Errorf("%s's watch got %d policies, want %d", who, len(set.Policies), want)
		}
	}
	expect(h2, "h2", "GET", "/v1/watch?host=h2&wait=0", "", 200)

	// Operations: h2 polls, the operator queues one for h2; h1 neither
	// gets it nor may report it; h2 claims and reports it.
	expect(h2, "h2", "POST", "/v1/operations/claim?wait=0", "", 204)
	var queued api.Operation
	json.Unmarshal(expect(op, "operator", "POST", "/v1/operations", `{"host":"h2","middlebox":{"match":"tcp"}}`, 201), &queued)
	expect(h1, "h1", "POST", "/v1/operations/claim?wait=0", "", 204)
	claimed := decode[api.Operation](t, expect(h2, "h2", "POST", "/v1/operations/claim?wait=0", "", 200))
	if claimed.ID != queued.ID {
		t.Fatalf("h2 claimed %q, want %q", claimed.ID, queued.ID)
	}
	res := `{"reply":{"results":[]}}`
	expect(h1, "h1", "PUT", "/v1/operations/"+queued.ID+"/result", res, 403)
	expect(h1, "h1", "PUT", "/v1/operations/"+queued.ID+"/result", `{"host":"h2","reply":{"results":[]}}`, 403)
	expect(h2, "h2", "PUT", "/v1/operations/"+queued.ID+"/result", res, 204)
	done := decode[api.Operation](t, expect(mon, "monitor", "GET", "/v1/operations/"+queued.ID, "", 200))
	if done.State != api.OpDone {
		t.Errorf("operation after h2's report: %+v", done)
	}

	got := refusedCounts(t, ts.Server)
	for k, want := range map[string]int{
		"/v1/policies/{name} 401 no_certificate":        2,
		"/v1/policies/{name} 401 bad_certificate":       2,
		"/v1/watch 401 no_certificate":                  1,
		"/v1/operations/claim 401 bad_certificate":      1,
		"/v1/policies/{name} 403 role":                  2,
		"/v1/watch 403 other_host":                      1,
		"/v1/watch 403 role":                            1,
		"/v1/operations/claim 403 other_host":           1,
		"/v1/operations/claim 403 role":                 2,
		"/v1/operations/{id}/result 403 other_host":     2,
		"/v1/operations/{id}/result 401 no_certificate": 1,
	} {
		if got[k] != want {
			t.Errorf("refused{%s} = %d, want %d (all: %v)", k, got[k], want, got)
		}
	}
}

// The agent's client (psclient) works through TLS with its certificate,
// and the name the server uses is the certificate's.
func TestAgentClientOverTLS(t *testing.T) {
	pki := newPKI(t, "agent:h1", "operator:operator")
	ts := startServer(t, pki.serverConfig())
	c := api.NewServerClientTLS(strings.TrimPrefix(ts.url, "https://"), pki.tls(t, "operator:operator"))
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	if err := c.PutPolicy(ctx, api.Policy{Name: "p", Filter: "tcp", Hosts: []string{"h1"}}); err != nil {
		t.Fatal(err)
	}
	got := make(chan api.PolicySet, 4)
	go psclient.Watch(ctx, psclient.WatchConfig{URL: ts.url, TLS: pki.tls(t, "agent:h1"), Host: "h1", Wait: time.Second,
		Logger: quietLogger(), OnUpdate: func(s api.PolicySet) { got <- s }})
	select {
	case set := <-got:
		if len(set.Policies) != 1 {
			t.Fatalf("agent h1 got %+v", set)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("no policies over TLS")
	}
	// Without a certificate, the client says what is missing.
	_, err := api.NewServerClientTLS(ts.url, pki.tls(t, "")).Policies(ctx)
	if err == nil || !strings.Contains(err.Error(), "no client certificate") {
		t.Errorf("no certificate: %v", err)
	}
	// An http:// URL to the TLS server: a clear error.
	_, err = api.NewServerClient("http" + strings.TrimPrefix(ts.url, "https")).Policies(ctx)
	if err == nil || !strings.Contains(err.Error(), "serves HTTPS") {
		t.Errorf("http:// to TLS: %v", err)
	}
}

// New refuses to start without certificates unless insecure, and says how.
func TestNewNeedsTLS(t *testing.T) {
	db := filepath.Join(t.TempDir(), "p.db")
	_, err := New(Config{DB: db, Logger: quietLogger()})
	if err == nil || !strings.Contains(err.Error(), "--insecure") {
		t.Errorf("no certificates: %v", err)
	}
	dir := t.TempDir()
	_, err = New(Config{DB: db, Logger: quietLogger(), CertFile: filepath.Join(dir, "server.crt"), KeyFile: filepath.Join(dir, "server.key"), ClientCAFile: filepath.Join(dir, "ca.crt")})
	if err == nil || !strings.Contains(err.Error(), "dysco certs") {
		t.Errorf("missing files: %v", err)
	}
	// An insecure server on an https URL: the client says it does not speak TLS.
	ts := startServer(t, Config{Insecure: true})
	pki := newPKI(t, "operator:operator")
	_, err = api.NewServerClientTLS("https"+strings.TrimPrefix(ts.url, "http"), pki.tls(t, "operator:operator")).Policies(t.Context())
	if err == nil || !strings.Contains(err.Error(), "does not speak TLS") {
		t.Errorf("https:// to plain: %v", err)
	}
}

// syncBuffer is a log sink safe for concurrent writes.
type syncBuffer struct {
	mu sync.Mutex
	b  strings.Builder
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// An agent whose certificate the server refuses says so in its log, not
// that the server is unreachable.
func TestAgentRefusedLogged(t *testing.T) {
	pki := newPKI(t)
	other := newPKI(t, "agent:h1")
	ts := startServer(t, pki.serverConfig())
	tc := other.tls(t, "agent:h1")
	tc.RootCAs = pki.tls(t, "").RootCAs
	var logs syncBuffer
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	go psclient.Watch(ctx, psclient.WatchConfig{URL: ts.url, TLS: tc, Host: "h1", Wait: time.Second,
		Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	testutil.Eventually(t, 10*time.Second, "the refusal in the agent's log", func() bool {
		return strings.Contains(logs.String(), "refused this agent's certificate")
	})
	if strings.Contains(logs.String(), "unreachable") {
		t.Errorf("a refused certificate logged as unreachable:\n%s", logs.String())
	}
}

// TestRevokedCertificate: a certificate on the CA's revocation list is
// refused (401, counted with reason "revoked"); one revoked while its
// connection is open is refused on that connection's next request, without
// a restart of the server.
func TestRevokedCertificate(t *testing.T) {
	pki := newPKI(t, "operator:operator", "operator:alice", "operator:bob")
	if _, _, _, err := certs.Revoke(pki.dir, []string{certs.CertFile(pki.dir, "operator-alice")}, time.Now()); err != nil {
		t.Fatal(err)
	}
	ts := startServer(t, pki.serverConfig())
	ctx := t.Context()
	if _, err := api.NewServerClientTLS(ts.url, pki.tls(t, "operator:alice")).Policies(ctx); err == nil || !strings.Contains(err.Error(), "is revoked") {
		t.Fatalf("alice's revoked certificate: %v", err)
	}
	bob := api.NewServerClientTLS(ts.url, pki.tls(t, "operator:bob"))
	if _, err := bob.Policies(ctx); err != nil {
		t.Fatalf("bob before his revocation: %v", err)
	}
	if _, _, _, err := certs.Revoke(pki.dir, []string{certs.CertFile(pki.dir, "operator-bob")}, time.Now()); err != nil {
		t.Fatal(err)
	}
	testutil.Eventually(t, 5*time.Second, "bob's connection to be refused", func() bool {
		_, err := bob.Policies(ctx)
		return err != nil && strings.Contains(err.Error(), "is revoked")
	})
	if _, err := api.NewServerClientTLS(ts.url, pki.tls(t, "operator:operator")).Policies(ctx); err != nil {
		t.Fatalf("the operator, not revoked: %v", err)
	}
	if n := refusedCounts(t, ts.Server)["/v1/policies 401 revoked"]; n < 2 {
		t.Errorf("%d refusals counted as revoked, want 2 or more", n)
	}
}
