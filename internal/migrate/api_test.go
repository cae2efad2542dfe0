package migrate

import (
	"context"
	"encoding/json"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
)

func TestProvidersHandler(t *testing.T) {
	p := NewProviders()
	srv := httptest.NewServer(p.Handler())
	defer srv.Close()
	do := func(method, path, body string) (int, string) {
		t.Helper()
		req, _ := http.NewRequest(method, srv.URL+path, strings.NewReader(body))
		resp, err := srv.Client().Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, strings.TrimSpace(string(b))
	}
	if c, b := do("PUT", "/v1/state/providers/counter", `{"socket":"@dysco-counter"}`); c != 200 || b != `{"name":"counter","socket":"@dysco-counter"}` {
		t.Errorf("PUT: %d %s", c, b)
	}
	if c, _ := do("PUT", "/v1/state/providers/cache", `{"socket":"/run/cache.sock"}`); c != 200 {
		t.Errorf("PUT cache: %d", c)
	}
	if c, b := do("GET", "/v1/state/providers", ""); c != 200 || b != `[{"name":"cache","socket":"/run/cache.sock"},{"name":"counter","socket":"@dysco-counter"}]` {
		t.Errorf("GET: %d %s", c, b)
	}
	for _, bad := range []struct{ path, body, want string }{
		{"/v1/state/providers/x", `{"socket":"relative.sock"}`, `want an absolute path or \"@name\"`},
		{"/v1/state/providers/x", `{}`, `missing \"socket\"`},
		{"/v1/state/providers/x", `{"sock":"@a"}`, `unknown field \"sock\"`},
		{"/v1/state/providers/x", `not json`, `body: want {\"socket\"`},
		{"/v1/state/providers/-x", `{"socket":"@a"}`, `provider name \"-x\"`},
		{"/v1/state/providers/x", `{"socket":"@` + strings.Repeat("a", 107) + `"}`, `longer than 107 bytes`},
	} {
		c, b := do("PUT", bad.path, bad.body)
		var e struct{ Error string }
		if c != 400 || json.Unmarshal([]byte(b), &e) != nil || !strings.Contains(b, bad.want) {
			t.Errorf("PUT %s %s: %d %s, want 400 with %s", bad.path, bad.body, c, b, bad.want)
		}
	}
	if c, _ := do("DELETE", "/v1/state/providers/cache", ""); c != 204 {
		t.Errorf("DELETE: %d", c)
	}
	if c, b := do("DELETE", "/v1/state/providers/cache", ""); c != 404 || !strings.Contains(b, `no state provider \"cache\"`) {
		t.Errorf("second DELETE: %d %s", c, b)
	}
	if got := p.List(); len(got) != 1 || got[0].Name != "counter" {
		t.Errorf("List() = %v", got)
	}
}

// fakeProvider is an in-memory state provider on a Unix socket.
type fakeProvider struct {
	mu      sync.Mutex
	state   map[ProviderSession][]byte
	failImp bool
	calls   []string
	socket  string
}

func newFakeProvider(t *testing.T, name string) *fakeProvider {
	f := &fakeProvider{state: map[ProviderSession][]byte{}, socket: filepath.Join(t.TempDir(), name+".sock")}
	ln, err := net.Listen("unix", f.socket)
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewUnstartedServer(http.HandlerFunc(f.serve))
	srv.Listener = ln
	srv.Start()
	t.Cleanup(srv.Close)
	return f
}

func (f *fakeProvider) serve(w http.ResponseWriter, r *http.Request) {
	var req ProviderRequest
	if err := json.NewDecoder(r.Body).Decode(&req); err != nil {
		http.Error(w, err.Error(), 400)
		return
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	f.calls = append(f.calls, r.URL.Path)
	switch r.URL.Path {
	case "/v1/export":
		st, ok := f.state[req.Session]
		if !ok {
			w.WriteHeader(http.StatusNoContent)
			return
		}
		_, _ = w.Write(st)
	case "/v1/import":
		if f.failImp {
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(500)
			_, _ = w.Write([]byte(`{"error":"table full"}`))
			return
		}
		f.state[req.Session] = req.State
	case "/v1/release":
		delete(f.state, req.Session)
	default:
		http.NotFound(w, r)
	}
}

func TestAPIPlugin(t *testing.T) {
	ctx := context.Background()
	ps := ProviderSessionOf(testSession)
	// Old host: "counter" has state, "cache" has none.
	oldCounter, oldCache := newFakeProvider(t, "oc"), newFakeProvider(t, "ocache")
	oldCounter.state[ps] = []byte(`{"bytes":42}`)
	oldReg := NewProviders()
	_ = oldReg.Register("counter", oldCounter.socket)
	_ = oldReg.Register("cache", oldCache.socket)
	oldSet, err := NewSet([]string{"api"}, Options{APIProviders: oldReg})
	if err != nil {
		t.Fatal(err)
	}
	b, err := oldSet.Export(ctx, testSession)
	if err != nil {
		t.Fatal(err)
	}
	if got := string(b["api"]); got != `{"counter":"eyJieXRlcyI6NDJ9"}` {
		t.Fatalf("api state %s", got)
	}

	// New host without "counter": refused, nothing imported.
	newCache := newFakeProvider(t, "ncache")
	newReg := NewProviders()
	_ = newReg.Register("cache", newCache.socket)
	newSet, _ := NewSet([]string{"api"}, Options{APIProviders: newReg})
	err = newSet.Import(ctx, testSession, b)
	if err == nil || !strings.Contains(err.Error(), `api: import: state for provider "counter", which is not registered on this host (registered: cache)`) {
		t.Fatalf("import without the provider: %v", err)
	}

	// With it: the state arrives; twice (retransmission) changes nothing.
	newCounter := newFakeProvider(t, "nc")
	_ = newReg.Register("counter", newCounter.socket)
	for range 2 {
		if err := newSet.Import(ctx, testSession, b); err != nil {
			t.Fatal(err)
		}
	}
	if got := string(newCounter.state[ps]); got != `{"bytes":42}` || len(newCounter.state) != 1 {
		t.Errorf("new counter's state %v", newCounter.state)
	}
	if len(newCache.calls) != 0 {
		t.Errorf("a provider without state was called at import: %v", newCache.calls)
	}

	// Release on the old host reaches every provider.
	if err := oldSet.Release(ctx, testSession); err != nil {
		t.Fatal(err)
	}
	if len(oldCounter.state) != 0 || !slices.Contains(oldCache.calls, "/v1/release") {
		t.Errorf("after release: counter %v, cache calls %v", oldCounter.state, oldCache.calls)
	}
	if b, err := oldSet.Export(ctx, testSession); err != nil || len(b) != 0 {
		t.Errorf("export after release: %v %v", b, err)
	}
}

func TestAPIPluginImportRollsBack(t *testing.T) {
	ctx := context.Background()
	a, z := newFakeProvider(t, "a"), newFakeProvider(t, "z")
	z.failImp = true
	reg := NewProviders()
	_ = reg.Register("a", a.socket)
	_ = reg.Register("z", z.socket)
	st, _ := json.Marshal(map[string][]byte{"a": []byte("A"), "z": []byte("Z")})
	err := NewAPI(reg).Import(ctx, testSession, st)
	if err == nil || !strings.Contains(err.Error(), `provider "z": POST /v1/import: 500 Internal Server Error: table full`) {
		t.Fatalf("import: %v", err)
	}
	if len(a.state) != 0 || !slices.Equal(a.calls, []string{"/v1/import", "/v1/release"}) {
		t.Errorf("provider a after the failed import: state %v calls %v", a.state, a.calls)
	}
	// A provider that is gone fails with its name.
	_ = reg.Register("gone", filepath.Join(t.TempDir(), "nothing.sock"))
	if _, err := NewAPI(reg).Export(ctx, testSession); err == nil || !strings.Contains(err.Error(), `provider "gone"`) {
		t.Errorf("export with a dead provider: %v", err)
	}
}
