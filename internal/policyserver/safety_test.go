package policyserver

import (
	"testing"

	"github.com/dysco/dysco/internal/api"
)

// A middlebox type that a policy names cannot be deleted: the answer is 409
// and names every policy that uses it, and nothing changes.
func TestDeleteTypeInUse(t *testing.T) {
	ts := startServer(t, Config{})
	mustPut(t, ts.url, "/v1/types/fw", `{"instances":["10.0.0.5"]}`)
	mustPut(t, ts.url, "/v1/types/ids", `{"instances":["10.0.0.6"]}`)
	mustPut(t, ts.url, "/v1/policies/web", `{"filter":"tcp dst port 80","chain":[{"type":"fw"},{"addr":"10.0.0.2"}]}`)
	mustPut(t, ts.url, "/v1/policies/mail", `{"filter":"tcp dst port 25","chain":[{"type":"ids"},{"type":"fw"}]}`)
	before := list(t, ts.url)

	code, data := call(t, "DELETE", ts.url+"/v1/types/fw", "")
	e := decode[api.Error](t, data)
	if code != 409 || e.Error != `type "fw" is used by policies mail, web: change or remove those policies first` {
		t.Fatalf("DELETE of a type in use: %d %q, want 409 naming mail and web", code, e.Error)
	}
	if after := list(t, ts.url); after.Version != before.Version || len(after.Types) != 2 {
		t.Fatalf("a refused delete changed the set: %+v", after)
	}

	// Once no policy names it, it goes.
	if code, data := call(t, "DELETE", ts.url+"/v1/policies/mail", ""); code != 204 {
		t.Fatalf("DELETE policy: %d %s", code, data)
	}
	code, data = call(t, "DELETE", ts.url+"/v1/types/ids", "")
	if code != 204 {
		t.Fatalf("DELETE of a type no policy uses: %d %s", code, data)
	}
	code, data = call(t, "DELETE", ts.url+"/v1/types/fw", "")
	if e := decode[api.Error](t, data); code != 409 || e.Error != `type "fw" is used by policy web: change or remove that policy first` {
		t.Fatalf("DELETE of a type one policy uses: %d %q", code, e.Error)
	}
}
