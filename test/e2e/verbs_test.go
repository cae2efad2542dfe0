package e2e

import (
	"context"
	"encoding/json"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/dysco/dysco/internal/api"
	"github.com/dysco/dysco/internal/lab"
	"github.com/dysco/dysco/internal/testutil"
)

// TestOperatorVerbs: the paper's use cases (§2.3) from one place, through
// the policy server, on live sessions with data flowing both ways: replace
// middlebox mb1 by mb2 in one session and take mb1 out of the other (both
// run by mb1's agent, as `dysco middlebox`), then delete mb2 from the first
// (run by the client's agent, the left anchor, as `dysco reconfig`). The
// operator's CLI runs in the server's namespace, on no host of the paths.
// Every byte arrives, and the middleboxes that left see no more packets.
// Refusals come back with the agent's or the server's reason.
func TestOperatorVerbs(t *testing.T) {
	router := "10.200.1.1"
	url := "https://" + router + ":7017"
	pki := mgmtPKI(t, router, "client", "mb1", "mb2", "server")
	e := newLab(t, labOpts{topology: lab.Star("client", "mb1", "mb2", "server"), agentArgs: []string{"--policy-server", url, "--pki-dir", pki}})
	e.startPolicyServer(router, pki)
	e.waitOpsPolling(url, pki, "mb1", "client")
	dst, mb1, mb2 := e.addr("server", false), e.addr("mb1", false), e.addr("mb2", false)
	e.dysco("client", "policy", "add", "central", "--server", url, "--pki-dir", pki, "--chain", mb1.String(), "tcp dst portrange 9500-9501")
	testutil.Eventually(t, 20*time.Second, "the client agent to get the policy", func() bool { return e.status("client").PolicyVersion >= 1 })

	const total = 64 * mib
	a := e.startTransfer("client", "server", dst, 9500, total, 8*mib)
	b := e.startTransfer("client", "server", dst, 9501, total, 8*mib)
	testutil.Eventually(t, 30*time.Second, "the transfers to start", func() bool {
		return a.received.Load() > 2*mib && b.received.Load() > 2*mib
	})
	if n := len(e.sessions("mb1")); n != 2 {
		t.Fatalf("mb1 carries %d sessions, want both", n)
	}

	// remote runs the CLI in the server's namespace through the policy
	// server; it returns the results and the command's error.
	remote := func(args ...string) ([]api.ReconfigResult, string, error) {
		t.Helper()
		ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
		defer cancel()
		argv := append([]string{dyscoBin}, args...)
		argv = append(argv, "--server", url, "--pki-dir", pki, "--json")
		cmd := e.lab.Command(ctx, "server", argv...)
		var stderr strings.Builder
		cmd.Stderr = &stderr
		out, err := cmd.Output()
		var rep api.ReconfigReply
		if len(out) > 0 {
			if jerr := json.Unmarshal(out, &rep); jerr != nil {
				t.Fatalf("dysco %s: %v\n%s\n%s", strings.Join(args, " "), jerr, out, stderr.String())
			}
		}
		return rep.Results, stderr.String(), err
	}
	succeeded := func(what string, res []api.ReconfigResult, stderr string, err error) {
		t.Helper()
		if err != nil || len(res) != 1 || res[0].Outcome != "succeeded" {
			t.Fatalf("%s: %+v (%v)\n%s", what, res, err, stderr)
		}
		t.Logf("%s: %s, %.2f ms", what, res[0].Session, float64(res[0].Micros)/1000)
	}
	quiet := func(host string, lt ...*liveTransfer) {
		t.Helper()
		before := rewrites(e.status(host))
		for _, l := range lt {
			at := l.received.Load()
			testutil.Eventually(t, 30*time.Second, "more data", func() bool { return l.received.Load() > at+mib })
		}
		if after := rewrites(e.status(host)); after != before {
			t.Errorf("%s still rewrites packets after leaving the paths: %d -> %d", host, before, after)
		}
	}

	res, stderr, err := remote("middlebox", "replace", "--host", "mb1", "--with", mb2.String(), "--match", "tcp dst port 9500")
	succeeded("replace mb1 by mb2 (at mb1, through the server)", res, stderr, err)
	res, stderr, err = remote("middlebox", "remove", "--host", "mb1")
	succeeded("remove mb1 (at mb1, through the server)", res, stderr, err)
	testutil.Eventually(t, 10*time.Second, "mb1 to leave both paths", func() bool { return len(e.sessions("mb1")) == 0 })
	quiet("mb1", a, b)
	res, stderr, err = remote("reconfig", "--host", "client", "--match", "tcp dst port 9500", "--to", dst.String())
	succeeded("delete mb2 (at the client, through the server)", res, stderr, err)
	testutil.Eventually(t, 10*time.Second, "mb2 to leave the path", func() bool { return len(e.sessions("mb2")) == 0 })
	quiet("mb2", a)

	// Refusals: no such agent (the server's), nothing to do (the agent's
	// answer: no session matches).
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"middlebox", "remove", "--host", "nosuch"}, `no agent named "nosuch" has asked this policy server for operations`},
		{[]string{"middlebox", "remove", "--host", "mb1"}, "no live session passes through mb1"},
		{[]string{"reconfig", "--host", "server", "--match", "tcp", "--to", e.addr("client", false).String()}, "no live session at server matches"},
	} {
		_, stderr, err := remote(c.args...)
		if err == nil || !strings.Contains(stderr, c.want) {
			t.Errorf("dysco %s: err %v, stderr %q; want a failure saying %q", strings.Join(c.args, " "), err, stderr, c.want)
		}
	}
	// A request only the agent can refuse (the CLI would have caught it,
	// so it goes straight to the server's API): the failed operation
	// carries the agent's reason.
	body := `{"host":"client","reconfig":{"match":"tcp","to":"` + dst.String() + `","chain":["` + dst.String() + `"]}}`
	var op api.Operation
	operator := []string{"--cacert", filepath.Join(pki, "ca.crt"), "--cert", filepath.Join(pki, "operator.crt"), "--key", filepath.Join(pki, "operator.key")}
	curl := func(args ...string) string {
		return e.run("server", append(append([]string{"curl", "-sS", "--fail-with-body"}, operator...), args...)...)
	}
	if err := json.Unmarshal([]byte(curl("-X", "POST", "--json", body, url+"/v1/operations")), &op); err != nil || op.ID == "" {
		t.Fatalf("creating an operation with curl: %v %+v", err, op)
	}
	if err := json.Unmarshal([]byte(curl(url+"/v1/operations/"+op.ID+"?wait=30")), &op); err != nil {
		t.Fatal(err)
	}
	if op.State != api.OpFailed || !strings.Contains(op.Error, `agent "client": reconfig: the right anchor `+dst.String()+` is in the chain`) {
		t.Errorf("operation refused by the agent: %+v", op)
	}
	a.wait(t)
	b.wait(t)
}
