package policyserver

import (
	"bytes"
	"context"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/dysco/dysco/internal/testutil"

	"github.com/dysco/dysco/internal/api"
)

// fuzzRoutes are the paths the fuzzer's requests go to; "NAME" is replaced
// by the fuzzer's name, and the query by its query. The last one takes the
// fuzzer's path as it is.
var fuzzRoutes = []string{
	"/v1/policies", "/v1/policies/NAME", "/v1/types/NAME", "/v1/watch", "/v1/operations",
	"/v1/operations/NAME", "/v1/operations/claim", "/v1/operations/NAME/result", "/healthz", "NAME",
}

var fuzzMethods = []string{http.MethodGet, http.MethodPut, http.MethodPost, http.MethodDelete, http.MethodPatch}

// FuzzAPI sends the policy server's handler (Handler, below any listener)
// requests the fuzzer makes: a route, a method, a name in the path, a query
// (host, after, wait, ...) and a JSON body. Whatever comes:
//   - the server answers (long polls end with the request's context) with
//     no 5xx: a request cannot make the server fail;
//   - every answer from 400 up is JSON with an error message;
//   - the published version never goes back;
//   - a policy or type stored (200 to a PUT) is in the published set, equal
//     to the answer; a 204 to a DELETE takes it out.
//
// `go test` runs the seeds; `go test -run '^$' -fuzz '^FuzzAPI$'
// ./internal/policyserver` searches.
func FuzzAPI(f *testing.F) {
	pol, _ := json.Marshal(api.Policy{Name: "web", Filter: "tcp dst port 80", Chain: []api.Hop{{Type: "fw"}}})
	typ := []byte(`{"name":"fw","instances":["10.0.0.1","10.0.0.2"]}`)
	op := []byte(`{"host":"mb1","reconfig":{"match":"tcp","to":"10.0.0.9","timeout_ms":100}}`)
	seeds := []struct {
		route, method uint8
		name, query   string
		body          []byte
	}{
		{1, 1, "web", "", pol}, {2, 1, "fw", "", typ}, {0, 0, "", "", nil}, {1, 3, "web", "", nil},
		{2, 3, "fw", "", nil}, {3, 0, "", "host=mb1&after=0&wait=0", nil}, {3, 0, "", "host=&after=x", nil},
		{3, 0, "", "host=mb1&after=18446744073709551616&wait=-1", nil}, {4, 2, "", "", op},
		{4, 2, "", "", []byte(`{"host":"mb1"}`)}, {6, 2, "", "host=mb1&wait=0", nil},
		{7, 1, "op-1", "", []byte(`{"host":"mb1","reply":{"results":[]}}`)}, {5, 0, "op-1", "wait=1", nil},
		{1, 1, "web", "", []byte(`{"name":"other"}`)}, {1, 1, "a b", "", []byte(`{"filter":"tcp","unknown":1}`)},
		{1, 1, "x", "", []byte(`{"filter":"tcp"} {}`)}, {9, 0, "/v1/../v1/policies", "", nil}, {1, 4, "web", "", pol},
	}
	for _, s := range seeds {
		f.Add(s.route, s.method, s.name, s.query, s.body)
	}
	s, err := New(Config{DB: filepath.Join(f.TempDir(), "policy.db"), Logger: quietLogger(), Insecure: true})
	if err != nil {
		f.Fatal(err)
	}
	f.Cleanup(func() { s.Close() })
	h := s.Handler()
	f.Fuzz(func(t *testing.T, route, method uint8, name, query string, body []byte) {
		path := strings.ReplaceAll(fuzzRoutes[int(route)%len(fuzzRoutes)], "NAME", name)
		m := fuzzMethods[int(method)%len(fuzzMethods)]
		target := "http://policy-server" + path
		if query != "" {
			target += "?" + query
		}
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
		defer cancel()
		req, err := http.NewRequestWithContext(ctx, m, target, bytes.NewReader(body))
		if err != nil {
			return // not a request a client could send
		}
		v0 := s.Current().Version
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, req)
		code := rec.Code
		if code >= 500 {
			t.Fatalf("%s %s: %d %s", m, target, code, rec.Body.Bytes())
		}
		if code >= 400 {
			var e api.Error
			if err := json.Unmarshal(rec.Body.Bytes(), &e); err != nil || e.Error == "" {
				t.Fatalf("%s %s: %d without a JSON error: %q", m, target, code, rec.Body.Bytes())
			}
		}
		cur := s.Current()
		if cur.Version < v0 {
			t.Fatalf("version went back from %d to %d", v0, cur.Version)
		}
		kind := int(route) % len(fuzzRoutes)
		switch {
		case kind == 1 && m == http.MethodPut && code == 200:
			var p api.Policy
			if err := json.Unmarshal(rec.Body.Bytes(), &p); err != nil {
				t.Fatal(err)
			}
			if !testutil.ListedJSON(cur.Policies, p, func(q api.Policy) string { return q.Name }) {
				t.Fatalf("stored policy %q is not in the published set as answered", p.Name)
			}
		case kind == 2 && m == http.MethodPut && code == 200:
			var ty api.MiddleboxType
			if err := json.Unmarshal(rec.Body.Bytes(), &ty); err != nil {
				t.Fatal(err)
			}
			if !testutil.ListedJSON(cur.Types, ty, func(q api.MiddleboxType) string { return q.Name }) {
				t.Fatalf("stored type %q is not in the published set as answered", ty.Name)
			}
		case (kind == 1 || kind == 2) && m == http.MethodDelete && code == 204:
			for _, p := range cur.Policies {
				if kind == 1 && p.Name == req.PathValue("name") {
					t.Fatalf("deleted policy %q still published", p.Name)
				}
			}
			for _, ty := range cur.Types {
				if kind == 2 && ty.Name == req.PathValue("name") {
					t.Fatalf("deleted type %q still published", ty.Name)
				}
			}
		}
	})
}
