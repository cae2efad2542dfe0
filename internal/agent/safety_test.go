package agent

import (
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"net/netip"
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
