package agent

import (
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/dysco/dysco/internal/api"
)

// Deleting a local middlebox type that an effective policy (local or from
// the policy server) names is refused with 409, naming the policies, and
// the local set is left as it was; a server type of the same name that
// takes over makes the delete fine.
func TestDeleteLocalTypeInUse(t *testing.T) {
	fw := api.MiddleboxType{Name: "fw", Instances: []netip.Addr{netip.MustParseAddr("10.0.0.5")}}
	a := &Agent{cfg: Config{StateDir: t.TempDir()}}
	a.local = api.PolicySet{
		Policies: []api.Policy{{Name: "web", Filter: "tcp", Chain: []api.Hop{{Type: "fw"}}}},
		Types:    []api.MiddleboxType{fw},
	}
	a.server = api.PolicySet{Version: 2, Policies: []api.Policy{{Name: "mail", Filter: "tcp port 25", Chain: []api.Hop{{Type: "fw"}}}}}

	del := func() (int, string) {
		req := httptest.NewRequest(http.MethodDelete, "/v1/types/fw", nil)
		req.SetPathValue("name", "fw")
		rec := httptest.NewRecorder()
		a.handleDeleteType(rec, req)
		var e api.Error
		_ = json.Unmarshal(rec.Body.Bytes(), &e)
		return rec.Code, e.Error
	}
	code, msg := del()
	if code != 409 || msg != `type "fw" is used by policies mail, web: change or remove those policies first` {
		t.Fatalf("delete of a type in use: %d %q", code, msg)
	}
	if len(a.local.Types) != 1 || a.local.Types[0].Name != "fw" {
		t.Fatalf("a refused delete changed the local types: %+v", a.local.Types)
	}

	// The server defines fw too: deleting the local one leaves the
	// server's in force, so no policy loses it.
	a.server.Types = []api.MiddleboxType{{Name: "fw", Instances: []netip.Addr{netip.MustParseAddr("10.0.0.6")}}}
	if err := typeInUse(api.PolicySet{Policies: a.local.Policies}, a.server, "fw"); err != nil {
		t.Errorf("a server type of the same name takes over, yet: %v", err)
	}
	// No policy names it: fine.
	if err := typeInUse(api.PolicySet{}, api.PolicySet{}, "fw"); err != nil {
		t.Errorf("unused type: %v", err)
	}
}

// An agent whose server-policy cache or local-policy file exists but cannot
// be read does not start: the error names the file and the way out. It
// stops before it touches the datapath (the pin directory given here is no
// bpffs, so an agent that went on would fail on it with another error).
func TestUnreadablePolicyFilesStopTheAgent(t *testing.T) {
	for _, c := range []struct {
		file, content string
		want          []string
	}{
		{"server-policies.json", `{"version":3,"policies":[{"name":"web",`, []string{
			"server-policies.json", "unexpected end of JSON input", "remove", "to start with no server policies until http://192.0.2.1:7017 sends them"}},
		{"server-policies.json", `{"version":3,"host":"other","policies":[]}`, []string{
			`holds the policies of host "other", not "h1"`, "remove"}},
		{"local-policies.json", `{"policies":[{"name":`, []string{
			"local-policies.json", "unexpected end of JSON input", "remove it to start without local policies"}},
	} {
		t.Run(c.file, func(t *testing.T) {
			dir := t.TempDir()
			if err := os.WriteFile(filepath.Join(dir, c.file), []byte(c.content), 0o600); err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithCancel(context.Background())
			cancel()
			err := Run(ctx, Config{Name: "h1", StateDir: dir, PinDir: filepath.Join(t.TempDir(), "pins"),
				PolicyServer: "http://192.0.2.1:7017", Socket: "@dysco-test-unused", Log: slog.New(slog.NewTextHandler(io.Discard, nil))})
			if err == nil {
				t.Fatal("the agent started with an unreadable policy file")
			}
			for _, w := range c.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q does not say %q", err, w)
				}
			}
		})
	}
}

// An operation claimed from the policy server is checked against the same
// bounds as the server checks, before the agent acts on it.
func TestOperationBoundsCheckedAtAgent(t *testing.T) {
	a := &Agent{}
	to := netip.MustParseAddr("10.0.0.3")
	for _, op := range []api.Operation{
		{ID: "1", Host: "h1", Reconfig: &api.ReconfigRequest{To: to, TimeoutMS: api.MaxOperationTimeoutMS + 1}},
		{ID: "2", Host: "h1", Reconfig: &api.ReconfigRequest{To: to, Match: strings.Repeat("x", api.MaxMatchLen+1)}},
		{ID: "3", Host: "h1", Middlebox: &api.MiddleboxRequest{With: []netip.Addr{to}, Migrate: &api.MigrateSpec{HoldLimit: 1 << 40}}},
	} {
		res := a.execOperation(context.Background(), op)
		if res.Reply != nil || !strings.HasPrefix(res.Error, "refused: operation: ") {
			t.Errorf("operation %s: %+v", op.ID, res)
		}
	}
}
