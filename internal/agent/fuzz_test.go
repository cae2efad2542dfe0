package agent

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/dysco/dysco/internal/api"
	"github.com/dysco/dysco/internal/datapath"
	"github.com/dysco/dysco/internal/migrate"
	"github.com/dysco/dysco/internal/testutil"
)

// fuzzRoutes are the local API paths of FuzzLocalAPI's requests; "NAME" is
// replaced by the fuzzer's name. The last one takes the fuzzer's path as
// it is.
var fuzzRoutes = []string{
	"/v1/status", "/v1/sessions", "/v1/policies", "/v1/policies/NAME", "/v1/types/NAME",
	"/v1/sessions/prepend", "/v1/reconfig", "/v1/reconfig/history", "/v1/middlebox",
	"/v1/sessions/splice", "/v1/state/providers", "/v1/state/providers/NAME", "NAME",
}

var fuzzMethods = []string{http.MethodGet, http.MethodPut, http.MethodPost, http.MethodDelete}

// FuzzLocalAPI sends the agent's local API (its handlers, below the
// socket) requests the fuzzer makes: a route, a method, a name in the path
// and a JSON body, on an agent with a real datapath (loaded, not attached)
// and no reconfiguration machinery. Whatever comes:
//   - the agent answers, every answer from 400 up in JSON with an error;
//   - 503 only from the routes that need the reconfiguration machinery,
//     and 500 only from a policy or type change (the datapath refusing
//     the set);
//   - a policy or type stored (200 to a PUT) is what GET /v1/policies
//     then lists under its name, and the local policies file, read back
//     as the agent reads it at start, holds the same local set.
//
// `go test` runs the seeds (root); `go test -run '^$' -fuzz '^FuzzLocalAPI$'
// ./internal/agent` searches.
func FuzzLocalAPI(f *testing.F) {
	testutil.RequireRoot(f)
	seeds := []struct {
		route, method uint8
		name          string
		body          []byte
	}{
		{3, 1, "web", []byte(`{"filter":"tcp dst port 80","chain":[{"type":"fw"}]}`)},
		{4, 1, "fw", []byte(`{"instances":["10.0.0.1","fd00::1"]}`)},
		{3, 1, "web", []byte(`{"filter":"tcp dst port 80","chain":[{"addr":"10.0.0.3"}],"priority":-4}`)},
		{3, 1, "bad", []byte(`{"filter":"tcp dst port 99999"}`)},
		{3, 1, "x", []byte(`{"name":"y","filter":"tcp"}`)},
		{3, 3, "web", nil}, {4, 3, "fw", nil}, {2, 0, "", nil}, {0, 0, "", nil}, {1, 0, "", nil},
		{5, 2, "", []byte(`{"session":"10.0.0.1:1 -> 10.0.0.2:2","hops":["10.0.0.3"]}`)},
		{5, 2, "", []byte(`{"session":"10.0.0.1:1 -> [::1]:2","hops":[]}`)},
		{6, 2, "", []byte(`{"match":"tcp","to":"10.0.0.9","chain":["10.0.0.5"]}`)},
		{8, 2, "", []byte(`{"match":"tcp","with":["10.0.0.5"],"migrate":{"semantics":"order"}}`)},
		{9, 2, "", []byte(`{"in":{"local":"10.0.0.2:80","remote":"10.0.0.1:4000"},"out":{"local":"10.0.1.2:5000","remote":"10.0.1.3:80"},"delta":7}`)},
		{7, 0, "", nil}, {11, 1, "ids", []byte(`{"url":"http://127.0.0.1:9/state"}`)}, {10, 0, "", nil},
		{12, 0, "/v1/../v1/status", nil}, {3, 1, "big", bytes.Repeat([]byte(" "), 70000)},
	}
	for _, s := range seeds {
		f.Add(s.route, s.method, s.name, s.body)
	}
	pin := fmt.Sprintf("/sys/fs/bpf/dysco-test/FuzzLocalAPI-%d", os.Getpid())
	_ = datapath.Reset(pin)
	d, err := datapath.Load(datapath.Config{PinDir: pin})
	if err != nil {
		f.Fatal(err)
	}
	f.Cleanup(func() { d.Close(); _ = datapath.Reset(pin) })
	a := &Agent{cfg: Config{Name: "fz", StateDir: f.TempDir()}, dp: d, started: time.Now(),
		log: slog.New(slog.NewTextHandler(io.Discard, nil)), providers: migrate.NewProviders()}
	h := a.apiMux()
	f.Fuzz(func(t *testing.T, route, method uint8, name string, body []byte) {
		kind := int(route) % len(fuzzRoutes)
		path := strings.ReplaceAll(fuzzRoutes[kind], "NAME", name)
		m := fuzzMethods[int(method)%len(fuzzMethods)]
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		req, err := http.NewRequestWithContext(ctx, m, "http://dysco-agent"+path, bytes.NewReader(body))
		if err != nil {
			return // not a request a client could send
		}
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, req)
		code := rec.Code
		if code >= 400 {
			var e api.Error
			if rec.Body.Len() > 0 || code != 404 && code != 405 { // the mux's own 404/405 are plain text
				if err := json.Unmarshal(rec.Body.Bytes(), &e); (err != nil || e.Error == "") && !muxAnswer(rec) {
					t.Fatalf("%s %s: %d without a JSON error: %q", m, path, code, rec.Body.Bytes())
				}
			}
		}
		switch {
		case code == 503 && kind != 6 && kind != 7 && kind != 8 && kind != 9:
			t.Fatalf("%s %s: 503 %s", m, path, rec.Body.Bytes())
		case code >= 500 && code != 503 && !(code == 500 && (kind == 3 || kind == 4) && (m == http.MethodPut || m == http.MethodDelete)):
			t.Fatalf("%s %s: %d %s", m, path, code, rec.Body.Bytes())
		}
		if (kind == 3 || kind == 4) && m == http.MethodPut && code == 200 {
			lrec := httptest.NewRecorder()
			h.ServeHTTP(lrec, httptest.NewRequest(http.MethodGet, "http://dysco-agent/v1/policies", nil))
			var set api.PolicySet
			if err := json.Unmarshal(lrec.Body.Bytes(), &set); err != nil {
				t.Fatal(err)
			}
			var ok bool
			if kind == 3 {
				var p api.Policy
				json.Unmarshal(rec.Body.Bytes(), &p)
				ok = testutil.ListedJSON(set.Policies, p, func(q api.Policy) string { return q.Name })
			} else {
				var ty api.MiddleboxType
				json.Unmarshal(rec.Body.Bytes(), &ty)
				ok = testutil.ListedJSON(set.Types, ty, func(q api.MiddleboxType) string { return q.Name })
			}
			if !ok {
				t.Fatalf("stored %s is not listed as answered: %s", path, rec.Body.Bytes())
			}
			saved := &Agent{cfg: a.cfg}
			if err := saved.loadLocal(); err != nil {
				t.Fatalf("the local policies file does not load again: %v", err)
			}
			a.mu.Lock()
			want, _ := json.Marshal(a.local)
			a.mu.Unlock()
			if got, _ := json.Marshal(saved.local); !bytes.Equal(got, want) {
				t.Fatalf("local policies file\n got %s\nwant %s", got, want)
			}
		}
	})
}

// muxAnswer tells whether rec is net/http's own answer to a path with no
// route or a method not allowed (plain text, not from a handler).
func muxAnswer(rec *httptest.ResponseRecorder) bool {
	return strings.HasPrefix(rec.Header().Get("Content-Type"), "text/plain") && (rec.Code == 404 || rec.Code == 405 || rec.Code == 301)
}

// FuzzLocalFile: the agent's local policies file (local-policies.json in
// its state directory), whatever its bytes. What loadLocal accepts, the
// agent saves (saveLocal) to a file that loads back to the same set.
//
// `go test` runs the seeds; `go test -run '^$' -fuzz '^FuzzLocalFile$'
// ./internal/agent` searches.
func FuzzLocalFile(f *testing.F) {
	good, _ := json.MarshalIndent(api.PolicySet{Policies: []api.Policy{{Name: "p", Filter: "tcp", Chain: []api.Hop{{Type: "fw"}}}},
		Types: []api.MiddleboxType{{Name: "fw"}}}, "", "  ")
	for _, s := range [][]byte{good, good[:10], []byte(`{}`), []byte(`null`), []byte(`{"policies":[{"chain":[{"addr":"x"}]}]}`),
		[]byte(`{"types":[{"instances":["10.0.0.1","::ffff:10.0.0.1"]}]}`), []byte("\x00"), nil} {
		f.Add(s)
	}
	dir := f.TempDir()
	f.Fuzz(func(t *testing.T, data []byte) {
		a := &Agent{cfg: Config{StateDir: filepath.Join(dir, "a")}}
		os.MkdirAll(a.cfg.StateDir, 0o700)
		if err := os.WriteFile(a.localFile(), data, 0o600); err != nil {
			t.Fatal(err)
		}
		if err := a.loadLocal(); err != nil {
			if !strings.Contains(err.Error(), a.localFile()) {
				t.Fatalf("error does not name the file: %v", err)
			}
			return
		}
		b := &Agent{cfg: Config{StateDir: filepath.Join(dir, "b")}, local: a.local}
		os.MkdirAll(b.cfg.StateDir, 0o700)
		if err := b.saveLocal(); err != nil {
			t.Fatal(err)
		}
		c := &Agent{cfg: b.cfg}
		if err := c.loadLocal(); err != nil {
			t.Fatalf("a saved set does not load: %v", err)
		}
		x, _ := json.Marshal(a.local)
		y, _ := json.Marshal(c.local)
		if !bytes.Equal(x, y) {
			t.Fatalf("local file round trip\n got %s\nwant %s", y, x)
		}
	})
}
