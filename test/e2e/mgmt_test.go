package e2e

import (
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/dysco/dysco/internal/api"
	"github.com/dysco/dysco/internal/lab"
	"github.com/dysco/dysco/internal/testutil"
)

// mgmtPKI issues, with `dysco certs`, a CA and the certificates of a policy
// server at addr, of the agents hosts, of an operator and of a monitor, and
// returns their directory.
func mgmtPKI(t *testing.T, addr string, hosts ...string) string {
	t.Helper()
	dir := filepath.Join(t.TempDir(), "pki")
	steps := [][]string{{"ca"}, {"server", "--ip", addr}, {"operator"}, {"monitor"}}
	if len(hosts) > 0 {
		steps = append(steps, append([]string{"agent"}, hosts...))
	}
	for _, args := range steps {
		argv := append([]string{"certs"}, args...)
		if out, err := exec.Command(dyscoBin, append(argv, "--dir", dir)...).CombinedOutput(); err != nil {
			t.Fatalf("dysco %s: %v\n%s", strings.Join(argv, " "), err, out)
		}
	}
	return dir
}

// startPolicyServer runs the policy server in the router's namespace on
// addr:7017 with the certificates of pki, its metrics on 127.0.0.1:7018
// there, and waits until it serves.
func (e *env) startPolicyServer(addr, pki string) *lab.Proc {
	e.t.Helper()
	dir := e.t.TempDir()
	ready := filepath.Join(dir, "ready")
	ps, err := e.lab.Start("router", "policy-server", dyscoBin, "policy-server", "--listen", addr+":7017",
		"--pki-dir", pki, "--metrics-listen", "127.0.0.1:7018", "--db", filepath.Join(dir, "p.db"), "--ready-file", ready)
	if err != nil {
		e.t.Fatal(err)
	}
	testutil.Eventually(e.t, 10*time.Second, "the policy server's ready file", func() bool { _, err := os.Stat(ready); return err == nil })
	return ps
}

// waitOpsPolling waits until the policy server at url takes operations for
// each of hosts, that is until their agents poll it for operations (they
// started before the server and back off while it is down). It queues, as
// the operator, a request each agent refuses (a chain through the right
// anchor itself), which changes nothing.
func (e *env) waitOpsPolling(url, pki string, hosts ...string) {
	e.t.Helper()
	to := e.addr("server", false).String()
	for _, h := range hosts {
		body := `{"host":"` + h + `","reconfig":{"match":"tcp dst port 1","to":"` + to + `","chain":["` + to + `"]}}`
		testutil.Eventually(e.t, 30*time.Second, "agent "+h+" to poll the policy server for operations", func() bool {
			ctx, cancel := context.WithTimeout(e.t.Context(), 10*time.Second)
			defer cancel()
			out, _ := e.lab.Command(ctx, "router", "curl", "-sS", "-o", "/dev/null", "-w", "%{http_code}",
				"--cacert", filepath.Join(pki, "ca.crt"), "--cert", filepath.Join(pki, "operator.crt"), "--key", filepath.Join(pki, "operator.key"),
				"-X", "POST", "-H", "Content-Type: application/json", "--data-binary", body, url+"/v1/operations").Output()
			return strings.TrimSpace(string(out)) == "201"
		})
	}
}

// TestMgmtAuth: the policy server over mutual TLS, tried with curl. No
// certificate, another CA's certificate or plain HTTP gets no 2xx from any
// write or watch route; an agent's certificate cannot change a policy,
// watch another host's policies, or claim or report another host's
// operation; an operator's can; a monitor lists and cannot write; each
// refusal is counted by route and reason on the metrics listener, which
// is the only one serving metrics. Without its certificate the server does
// not start.
func TestMgmtAuth(t *testing.T) {
	router := "10.200.1.1" // the router's address on the client's link
	url := "https://" + router + ":7017"
	pki := mgmtPKI(t, router, "client", "server")
	foreign := mgmtPKI(t, router)
	e := newLab(t, labOpts{topology: lab.Star("client", "server"), agentArgs: []string{"--policy-server", url, "--pki-dir", pki}})
	e.startPolicyServer(router, pki)

	// curl runs curl in the client's namespace as who and returns the
	// status and the body.
	creds := map[string][]string{
		"none":     {"--cacert", filepath.Join(pki, "ca.crt")},
		"foreign":  {"--cacert", filepath.Join(pki, "ca.crt"), "--cert", filepath.Join(foreign, "operator.crt"), "--key", filepath.Join(foreign, "operator.key")},
		"agent":    {"--cacert", filepath.Join(pki, "ca.crt"), "--cert", filepath.Join(pki, "agent-client.crt"), "--key", filepath.Join(pki, "agent-client.key")},
		"operator": {"--cacert", filepath.Join(pki, "ca.crt"), "--cert", filepath.Join(pki, "operator.crt"), "--key", filepath.Join(pki, "operator.key")},
		"monitor":  {"--cacert", filepath.Join(pki, "ca.crt"), "--cert", filepath.Join(pki, "monitor.crt"), "--key", filepath.Join(pki, "monitor.key")},
	}
	curl := func(who, method, path, body string) (int, string) {
		t.Helper()
		base := url
		argv := []string{"curl", "-sS", "-X", method, "-w", "\n%{http_code}"}
		if who == "plain" {
			base = "http://" + router + ":7017"
		} else {
			argv = append(argv, creds[who]...)
		}
		if body != "" {
			argv = append(argv, "-H", "Content-Type: application/json", "--data-binary", body)
		}
		argv = append(argv, base+path)
		ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
		defer cancel()
		out, err := e.lab.Command(ctx, "client", argv...).Output()
		if err != nil && who == "plain" {
			// The TLS listener answers plain HTTP with a 400, or (for
			// methods it does not recognise) closes the connection.
			return 0, err.Error()
		}
		if err != nil {
			t.Fatalf("curl as %s: %s %s: %v\n%s", who, method, path, err, out)
		}
		s := strings.TrimSpace(string(out))
		i := strings.LastIndexByte(s, '\n')
		code, err := strconv.Atoi(s[i+1:])
		if err != nil {
			t.Fatalf("curl as %s: %s %s: no status in %q", who, method, path, s)
		}
		return code, s[:max(i, 0)]
	}
	want := map[string]int{} // "route code reason" -> refusals expected
	expect := func(who, method, path, body string, code int, route, reason string) string {
		t.Helper()
		got, out := curl(who, method, path, body)
		if got != code {
			t.Errorf("%s: %s %s: %d %s, want %d", who, method, path, got, out, code)
		}
		if reason != "" {
			want[route+" "+strconv.Itoa(code)+" "+reason]++
		}
		return out
	}

	op := `{"host":"server","middlebox":{"match":"tcp dst port 1"}}`
	routes := []struct{ method, path, route, body string }{
		{"PUT", "/v1/policies/p", "/v1/policies/{name}", `{"filter":"tcp"}`},
		{"DELETE", "/v1/policies/p", "/v1/policies/{name}", ""},
		{"PUT", "/v1/types/t", "/v1/types/{name}", `{"hops":["10.200.3.2"]}`},
		{"DELETE", "/v1/types/t", "/v1/types/{name}", ""},
		{"GET", "/v1/watch?host=server&wait=0", "/v1/watch", ""},
		{"POST", "/v1/operations", "/v1/operations", op},
		{"POST", "/v1/operations/claim?host=server&wait=0", "/v1/operations/claim", ""},
		{"PUT", "/v1/operations/x/result", "/v1/operations/{id}/result", `{"host":"server","error":"forged"}`},
	}
	for _, r := range routes {
		expect("none", r.method, r.path, r.body, 401, r.route, "no_certificate")
		expect("foreign", r.method, r.path, r.body, 401, r.route, "bad_certificate")
		if code, out := curl("plain", r.method, r.path, r.body); code/100 == 2 {
			t.Errorf("plain HTTP: %s %s: %d %s", r.method, r.path, code, out)
		}
	}

	// The client agent's certificate: no writes, nothing of the server host.
	expect("agent", "PUT", "/v1/policies/p", `{"filter":"tcp"}`, 403, "/v1/policies/{name}", "role")
	expect("agent", "DELETE", "/v1/types/t", "", 403, "/v1/types/{name}", "role")
	expect("agent", "POST", "/v1/operations", op, 403, "/v1/operations", "role")
	expect("agent", "GET", "/v1/policies", "", 403, "/v1/policies", "role")
	expect("agent", "GET", "/v1/watch?host=server&wait=0", "", 403, "/v1/watch", "other_host")
	expect("agent", "POST", "/v1/operations/claim?host=server&wait=0", "", 403, "/v1/operations/claim", "other_host")

	// The operator's: a policy for the server host only, which its agent
	// gets and the client's does not.
	expect("operator", "PUT", "/v1/policies/p", `{"filter":"tcp dst port 1","hosts":["server"]}`, 200, "", "")
	testutil.Eventually(t, 20*time.Second, "the server's agent to get the policy", func() bool { return e.status("server").PolicyVersion >= 1 })
	var set api.PolicySet
	if err := json.Unmarshal([]byte(expect("agent", "GET", "/v1/watch?wait=0", "", 200, "", "")), &set); err != nil || set.Version < 1 || len(set.Policies) != 0 {
		t.Errorf("the client agent's own watch: %+v %v, want version 1 and no policy", set, err)
	}
	// An operation for the server host: its agent carries it out; the
	// client's certificate may not report it.
	// (Queued once the agent polls for operations: 409 until then.)
	var queued api.Operation
	testutil.Eventually(t, 20*time.Second, "the operator's operation for the server's agent to be queued", func() bool {
		code, out := curl("operator", "POST", "/v1/operations", op)
		if code != 201 && code != 409 {
			t.Fatalf("operation: %d %s", code, out)
		}
		return code == 201 && json.Unmarshal([]byte(out), &queued) == nil && queued.ID != ""
	})
	var done api.Operation
	if err := json.Unmarshal([]byte(expect("monitor", "GET", "/v1/operations/"+queued.ID+"?wait=30", "", 200, "", "")), &done); err != nil || !done.IsFinished() {
		t.Fatalf("operation at the server's agent: %+v %v", done, err)
	}
	if done.State != api.OpDone {
		t.Errorf("operation at the server's agent: %+v", done)
	}
	expect("agent", "PUT", "/v1/operations/"+queued.ID+"/result", `{"reply":{"results":[]}}`, 403, "/v1/operations/{id}/result", "other_host")

	// The monitor's: lists, no writes.
	expect("monitor", "GET", "/v1/policies", "", 200, "", "")
	expect("monitor", "GET", "/v1/operations", "", 200, "", "")
	expect("monitor", "PUT", "/v1/policies/q", `{"filter":"tcp"}`, 403, "/v1/policies/{name}", "role")
	expect("monitor", "POST", "/v1/operations", op, 403, "/v1/operations", "role")

	// Metrics: not on the API listener; the refusals on the metrics one.
	expect("operator", "GET", "/metrics", "", 404, "", "")
	metrics := e.run("router", "curl", "-sS", "--fail", "http://127.0.0.1:7018/metrics")
	re := regexp.MustCompile(`(?m)^dysco_policyserver_requests_refused_total\{code="(\d+)",reason="([a-z_]+)",route="([^"]+)"\} (\d+)$`)
	got := map[string]int{}
	for _, m := range re.FindAllStringSubmatch(metrics, -1) {
		got[m[3]+" "+m[1]+" "+m[2]], _ = strconv.Atoi(m[4])
	}
	for k, n := range want {
		if got[k] != n {
			t.Errorf("refused{%s} = %d, want %d", k, got[k], n)
		}
	}
	for k, n := range got {
		if want[k] == 0 {
			t.Errorf("refused{%s} = %d, not caused by the test", k, n)
		}
	}
	t.Logf("refusals counted: %d kinds, %v", len(got), got)
	// Each plain-HTTP request failed the TLS handshake, and was counted.
	if m := regexp.MustCompile(`(?m)^dysco_policyserver_tls_handshake_errors_total (\d+)$`).FindStringSubmatch(metrics); m == nil {
		t.Error("no dysco_policyserver_tls_handshake_errors_total in the metrics")
	} else if n, _ := strconv.Atoi(m[1]); n < len(routes) {
		t.Errorf("tls_handshake_errors_total = %d, want at least the %d plain-HTTP requests", n, len(routes))
	}

	// Without its certificate the server does not start, and says why.
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	out, err := e.lab.Command(ctx, "router", dyscoBin, "policy-server", "--listen", router+":7027", "--metrics-listen", "",
		"--pki-dir", filepath.Join(t.TempDir(), "none"), "--db", filepath.Join(t.TempDir(), "p.db")).CombinedOutput()
	if err == nil || !strings.Contains(string(out), "--insecure") || !strings.Contains(string(out), "dysco certs") {
		t.Errorf("policy server without certificates: %v\n%s", err, out)
	}
}
