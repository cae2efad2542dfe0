package policyserver

import (
	"context"
	"encoding/json"
	"errors"
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
	"testing"
	"time"

	bolt "go.etcd.io/bbolt"

	"github.com/dysco/dysco/internal/api"
	"github.com/dysco/dysco/internal/testutil"
)

// testServer is a Server serving on a real TCP listener on 127.0.0.1.
type testServer struct {
	*Server
	url  string
	stop func() // stops serving and closes the database; idempotent
}

func quietLogger() *slog.Logger {
	return slog.New(slog.NewTextHandler(io.Discard, nil))
}

func startServer(t *testing.T, cfg Config) *testServer {
	t.Helper()
	if cfg.DB == "" {
		cfg.DB = filepath.Join(t.TempDir(), "policy.db")
	}
	if cfg.Logger == nil {
		cfg.Logger = quietLogger()
	}
	// The tests of the routes' logic run on an insecure server; those of
	// authentication (auth_test.go) give it certificates.
	if cfg.CertFile == "" {
		cfg.Insecure = true
	}
	s, err := New(cfg)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- s.Serve(ctx, ln) }()
	stopped := false
	stop := func() {
		if stopped {
			return
		}
		stopped = true
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Serve: %v", err)
		}
		if err := s.Close(); err != nil {
			t.Errorf("Close: %v", err)
		}
	}
	t.Cleanup(stop)
	scheme := "https://"
	if cfg.Insecure {
		scheme = "http://"
	}
	return &testServer{Server: s, url: scheme + ln.Addr().String(), stop: stop}
}

// call sends body (a string of JSON, or "" for none) and returns the status
// and the answer.
func call(t *testing.T, method, url, body string) (int, []byte) {
	t.Helper()
	var rd io.Reader
	if body != "" {
		rd = strings.NewReader(body)
	}
	req, err := http.NewRequest(method, url, rd)
	if err != nil {
		t.Fatal(err)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatalf("%s %s: %v", method, url, err)
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp.StatusCode, data
}

func decode[T any](t *testing.T, data []byte) T {
	t.Helper()
	var v T
	if err := json.Unmarshal(data, &v); err != nil {
		t.Fatalf("decoding %q: %v", data, err)
	}
	return v
}

func list(t *testing.T, url string) api.PolicySet {
	t.Helper()
	code, data := call(t, "GET", url+"/v1/policies", "")
	if code != 200 {
		t.Fatalf("GET /v1/policies: %d %s", code, data)
	}
	return decode[api.PolicySet](t, data)
}

func mustPut(t *testing.T, url, path, body string) {
	t.Helper()
	if code, data := call(t, "PUT", url+path, body); code != 200 {
		t.Fatalf("PUT %s: %d %s", path, code, data)
	}
}

var (
	addr2 = netip.MustParseAddr("10.0.0.2")
	addr5 = netip.MustParseAddr("10.0.0.5")
	addr6 = netip.MustParseAddr("10.0.0.6")
)

func TestPutListDelete(t *testing.T) {
	ts := startServer(t, Config{})
	if set := list(t, ts.url); set.Version != 0 || len(set.Policies) != 0 || len(set.Types) != 0 {
		t.Fatalf("empty server lists %+v", set)
	}

	code, data := call(t, "PUT", ts.url+"/v1/policies/web",
		`{"filter":"tcp dst port 80","chain":[{"addr":"10.0.0.2"},{"type":"nat"}],"priority":5}`)
	want := api.Policy{Name: "web", Filter: "tcp dst port 80", Chain: []api.Hop{{Addr: addr2}, {Type: "nat"}}, Priority: 5}
	if got := decode[api.Policy](t, data); code != 200 || !reflect.DeepEqual(got, want) {
		t.Fatalf("PUT answered %d %+v, want the stored policy %+v", code, got, want)
	}
	mustPut(t, ts.url, "/v1/policies/all", `{"name":"all","filter":"tcp","priority":1}`)
	mustPut(t, ts.url, "/v1/types/nat", `{"instances":["10.0.0.5","10.0.0.6"]}`)

	set := list(t, ts.url)
	if set.Version != 3 {
		t.Errorf("version after 3 changes = %d", set.Version)
	}
	if names := policyNames(set); !reflect.DeepEqual(names, []string{"all", "web"}) {
		t.Errorf("policies %v, want in priority order [all web]", names)
	}
	if !reflect.DeepEqual(set.Policies[1], want) {
		t.Errorf("listed %+v, want %+v", set.Policies[1], want)
	}
	wantType := api.MiddleboxType{Name: "nat", Instances: []netip.Addr{addr5, addr6}}
	if len(set.Types) != 1 || !reflect.DeepEqual(set.Types[0], wantType) {
		t.Errorf("types %+v, want [%+v]", set.Types, wantType)
	}

	// The same PUT again changes nothing, so the version stays.
	mustPut(t, ts.url, "/v1/policies/all", `{"name":"all","filter":"tcp","priority":1}`)
	if v := list(t, ts.url).Version; v != 3 {
		t.Errorf("version after an identical PUT = %d, want 3", v)
	}
	// A different one replaces it.
	mustPut(t, ts.url, "/v1/policies/all", `{"name":"all","filter":"tcp","priority":10}`)
	set = list(t, ts.url)
	if set.Version != 4 || !reflect.DeepEqual(policyNames(set), []string{"web", "all"}) {
		t.Errorf("after replacing: version %d, policies %v", set.Version, policyNames(set))
	}

	if code, data := call(t, "DELETE", ts.url+"/v1/policies/web", ""); code != 204 {
		t.Fatalf("DELETE: %d %s", code, data)
	}
	if code, data := call(t, "DELETE", ts.url+"/v1/types/nat", ""); code != 204 {
		t.Fatalf("DELETE type: %d %s", code, data)
	}
	set = list(t, ts.url)
	if set.Version != 6 || !reflect.DeepEqual(policyNames(set), []string{"all"}) || len(set.Types) != 0 {
		t.Errorf("after deleting: %+v", set)
	}

	code, data = call(t, "DELETE", ts.url+"/v1/policies/web", "")
	if e := decode[api.Error](t, data); code != 404 || e.Error != `policy "web" not found` {
		t.Errorf("DELETE absent: %d %q", code, e.Error)
	}
	code, data = call(t, "DELETE", ts.url+"/v1/types/nat", "")
	if e := decode[api.Error](t, data); code != 404 || e.Error != `type "nat" not found` {
		t.Errorf("DELETE absent type: %d %q", code, e.Error)
	}
	if v := list(t, ts.url).Version; v != 6 {
		t.Errorf("failed deletes bumped the version to %d", v)
	}

	code, data = call(t, "GET", ts.url+"/healthz", "")
	if code != 200 || !strings.Contains(string(data), `"ok"`) {
		t.Errorf("healthz: %d %s", code, data)
	}
}

func policyNames(set api.PolicySet) []string {
	var n []string
	for _, p := range set.Policies {
		n = append(n, p.Name)
	}
	return n
}

func TestValidationErrors(t *testing.T) {
	hook := func(p api.Policy) error {
		if strings.Contains(p.Filter, "prot ") {
			return fmt.Errorf("policy %q: filter %q: syntax error near \"prot\"", p.Name, p.Filter)
		}
		return nil
	}
	ts := startServer(t, Config{ValidatePolicy: hook})
	for _, tc := range []struct {
		method, path, body string
		code               int
		want               string // in the error message
	}{
		{"PUT", "/v1/policies/web", `{"name":"other","filter":"tcp"}`, 400, `policy name in the path ("web") differs from the name in the body ("other")`},
		{"PUT", "/v1/policies/9x", `{"filter":"tcp"}`, 400, `policy "9x": name must start with a letter`},
		{"PUT", "/v1/policies/web", `{"filter":" "}`, 400, `policy "web": empty filter`},
		{"PUT", "/v1/policies/web", `{"filter":"tcp","end_before_destination":true}`, 400, "end_before_destination needs a chain"},
		{"PUT", "/v1/policies/web", `{"filter":"tcp","chain":[{}]}`, 400, "hop 1 must be an address or a type"},
		{"PUT", "/v1/policies/web", `{"filter":"tcp","chian":[]}`, 400, `unknown field "chian"`},
		{"PUT", "/v1/policies/web", ``, 400, "empty request body: send the policy as JSON"},
		{"PUT", "/v1/policies/web", `{"filter":`, 400, "request body is not a valid policy"},
		{"PUT", "/v1/policies/web", `{"filter":"tcp"}{}`, 400, "more than one JSON value"},
		{"PUT", "/v1/policies/web", `{"filter":"tcp dst prot 80"}`, 400, `policy "web": filter "tcp dst prot 80": syntax error near "prot"`},
		{"PUT", "/v1/policies/quic", `{"filter":"udp","idle_timeout_s":64801}`, 400, `policy "quic": idle timeout of 64801 s: want 0 (the defaults, 30s one way, 2m0s both ways) or 1s to 18h0m0s`},
		{"PUT", "/v1/policies/quic", `{"filter":"udp","idle_timeout_s":"5m"}`, 400, "request body is not a valid policy"},
		{"PUT", "/v1/types/nat", `{"instances":[]}`, 400, `type "nat": no instances`},
		{"PUT", "/v1/types/nat", `{"instances":["10.0.0.5","10.0.0.5"]}`, 400, "instance 10.0.0.5 appears twice"},
		{"PUT", "/v1/types/nat", `{"instances":["nope"]}`, 400, "request body is not a valid middlebox type"},
		{"PUT", "/v1/types/nat", `{"instances":["10.0.0.5","ff02::2"]}`, 400, "instance ff02::2 is not a unicast address"},
		{"PUT", "/v1/policies/web", `{"filter":"tcp","chain":[{"addr":"127.0.0.1"}]}`, 400, `policy "web": hop 127.0.0.1 is not a unicast address`},
		{"PUT", "/v1/types/nat", `{"name":"nut","instances":["10.0.0.5"]}`, 400, `type name in the path ("nat") differs`},
		{"GET", "/v1/policies/web", ``, 405, "method GET is not allowed on /v1/policies/web (allowed: PUT, DELETE)"},
		{"POST", "/v1/policies", `{}`, 405, "allowed: GET"},
		{"GET", "/v2/nothing", ``, 404, "no route GET /v2/nothing"},
		{"GET", "/v1/watch?after=1", ``, 400, "watch needs host=NAME"},
		{"GET", "/v1/watch?host=a&after=x", ``, 400, `after="x" is not a version number`},
		{"GET", "/v1/watch?host=a&wait=-1", ``, 400, `wait="-1" is not a number of seconds`},
	} {
		code, data := call(t, tc.method, ts.url+tc.path, tc.body)
		var e api.Error
		if err := json.Unmarshal(data, &e); err != nil {
			t.Errorf("%s %s %s: answer is not a JSON api.Error: %q", tc.method, tc.path, tc.body, data)
			continue
		}
		if code != tc.code || !strings.Contains(e.Error, tc.want) {
			t.Errorf("%s %s %s: %d %q\nwant %d and %q", tc.method, tc.path, tc.body, code, e.Error, tc.code, tc.want)
		}
	}
	if set := list(t, ts.url); set.Version != 0 {
		t.Errorf("refused requests changed the version to %d", set.Version)
	}
}

func TestPersistence(t *testing.T) {
	db := filepath.Join(t.TempDir(), "sub", "dir", "policy.db") // the directory is created
	ts := startServer(t, Config{DB: db})
	mustPut(t, ts.url, "/v1/policies/web", `{"filter":"tcp port 80","chain":[{"type":"nat"}],"hosts":["h1"]}`)
	mustPut(t, ts.url, "/v1/types/nat", `{"instances":["10.0.0.5"]}`)
	before := list(t, ts.url)
	ts.stop()

	ts = startServer(t, Config{DB: db})
	after := list(t, ts.url)
	if !reflect.DeepEqual(before, after) {
		t.Fatalf("after a restart the server holds\n%+v\nwant\n%+v", after, before)
	}
	mustPut(t, ts.url, "/v1/policies/ssh", `{"filter":"tcp port 22"}`)
	if v := list(t, ts.url).Version; v != before.Version+1 {
		t.Errorf("version after restart and a change = %d, want %d", v, before.Version+1)
	}
}

// TestIdleTimeoutStored checks that the server stores and returns a policy's
// idle timeout, and that a record written before the field existed reads
// as 0, the defaults.
func TestIdleTimeoutStored(t *testing.T) {
	db := filepath.Join(t.TempDir(), "policy.db")
	st, err := openStore(db)
	if err != nil {
		t.Fatal(err)
	}
	err = st.db.Update(func(tx *bolt.Tx) error {
		return tx.Bucket(bucketPolicies).Put([]byte("old"), []byte(`{"name":"old","filter":"tcp port 25","chain":[{"addr":"10.0.0.2"}]}`))
	})
	if err != nil {
		t.Fatal(err)
	}
	st.Close()

	ts := startServer(t, Config{DB: db})
	mustPut(t, ts.url, "/v1/policies/quic", `{"filter":"udp dst port 4433","idle_timeout_s":300}`)
	set := list(t, ts.url)
	want := []api.Policy{
		{Name: "old", Filter: "tcp port 25", Chain: []api.Hop{{Addr: addr2}}},
		{Name: "quic", Filter: "udp dst port 4433", IdleTimeoutS: 300},
	}
	if !reflect.DeepEqual(set.Policies, want) {
		t.Fatalf("listed %+v\nwant %+v", set.Policies, want)
	}
	ts.stop()
	ts = startServer(t, Config{DB: db})
	if got := list(t, ts.url).Policies; !reflect.DeepEqual(got, want) {
		t.Errorf("after a restart: %+v", got)
	}
}

func TestDatabaseLocked(t *testing.T) {
	db := filepath.Join(t.TempDir(), "policy.db")
	startServer(t, Config{DB: db})
	_, err := New(Config{DB: db, Logger: quietLogger(), Insecure: true})
	if err == nil || !strings.Contains(err.Error(), "locked by another process") {
		t.Fatalf("second server on the same database: %v", err)
	}
}

// startWatch runs one GET /v1/watch on a goroutine and returns its answer.
func startWatch(t *testing.T, url, query string) <-chan api.PolicySet {
	t.Helper()
	out := make(chan api.PolicySet, 1)
	go func() {
		resp, err := http.Get(url + "/v1/watch?" + query)
		if err != nil {
			t.Errorf("watch: %v", err)
			close(out)
			return
		}
		defer resp.Body.Close()
		var set api.PolicySet
		if resp.StatusCode != 200 || json.NewDecoder(resp.Body).Decode(&set) != nil {
			t.Errorf("watch answered %s", resp.Status)
			close(out)
			return
		}
		out <- set
	}()
	return out
}

func TestWatchWakesOnChange(t *testing.T) {
	ts := startServer(t, Config{})
	waiting := make(chan struct{}, 10)
	ts.waitHook = func() { waiting <- struct{}{} }

	mustPut(t, ts.url, "/v1/policies/a", `{"filter":"tcp"}`)
	// A watcher behind the current version is answered at once.
	if set := <-startWatch(t, ts.url, "host=h1&after=0"); set.Version != 1 || len(set.Policies) != 1 {
		t.Fatalf("watch after=0: %+v", set)
	}

	// One that is up to date waits (for up to 120 s) until the next change.
	ans := startWatch(t, ts.url, "host=h1&after=1&wait=120")
	select {
	case <-waiting:
	case <-time.After(5 * time.Second):
		t.Fatal("the watch never started waiting")
	}
	if n := ts.watchers.Load(); n != 1 {
		t.Errorf("watchers gauge = %d, want 1", n)
	}
	// Metrics are on their own listener, not on the API's.
	if code, _ := call(t, "GET", ts.url+"/metrics", ""); code != http.StatusNotFound {
		t.Errorf("GET /metrics on the API listener: %d, want 404", code)
	}
	mts := httptest.NewServer(ts.MetricsHandler())
	defer mts.Close()
	_, metrics := call(t, "GET", mts.URL+"/metrics", "")
	for _, line := range []string{"dysco_policyserver_watchers 1", "dysco_policyserver_version 1", "dysco_policyserver_policies 1"} {
		if !strings.Contains(string(metrics), line+"\n") {
			t.Errorf("metrics lack %q:\n%s", line, metrics)
		}
	}
	mustPut(t, ts.url, "/v1/policies/b", `{"filter":"udp"}`)
	select {
	case set := <-ans:
		if set.Version != 2 || !reflect.DeepEqual(policyNames(set), []string{"a", "b"}) {
			t.Fatalf("woken watch got %+v", set)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the change did not wake the watch")
	}
}

func TestWatchTimeoutAndShutdown(t *testing.T) {
	ts := startServer(t, Config{})
	waiting := make(chan struct{}, 10)
	ts.waitHook = func() { waiting <- struct{}{} }
	// wait=0: the wait is over at once, and the answer is the current set.
	if set := <-startWatch(t, ts.url, "host=h1&after=0&wait=0"); set.Version != 0 || set.Policies == nil {
		t.Fatalf("watch wait=0: %+v", set)
	}
	<-waiting

	errc := make(chan error, 1)
	go func() {
		_, err := api.NewServerClient(ts.url).Watch(context.Background(), "h1", 0, MaxWait, "")
		errc <- err
	}()
	<-waiting
	ts.stop() // must not wait out the long poll
	var he *api.HTTPError
	if err := <-errc; !errors.As(err, &he) || he.StatusCode != 503 || he.Message != "policy server is shutting down" {
		t.Fatalf("watch during shutdown: %v", err)
	}
}

func TestWatchFiltersByHost(t *testing.T) {
	ts := startServer(t, Config{})
	mustPut(t, ts.url, "/v1/policies/everyone", `{"filter":"tcp"}`)
	mustPut(t, ts.url, "/v1/policies/only-a", `{"filter":"tcp port 1","hosts":["a"]}`)
	mustPut(t, ts.url, "/v1/policies/a-and-b", `{"filter":"tcp port 2","hosts":["b","a"]}`)
	mustPut(t, ts.url, "/v1/policies/only-c", `{"filter":"tcp port 3","hosts":["c"]}`)
	mustPut(t, ts.url, "/v1/types/nat", `{"instances":["10.0.0.5"]}`)
	for host, want := range map[string][]string{
		"a": {"a-and-b", "everyone", "only-a"},
		"b": {"a-and-b", "everyone"},
		"z": {"everyone"},
	} {
		set := <-startWatch(t, ts.url, "host="+host)
		if set.Version != 5 || !reflect.DeepEqual(policyNames(set), want) || len(set.Types) != 1 {
			t.Errorf("host %s got version %d, policies %v, %d types; want 5, %v, 1", host, set.Version, policyNames(set), len(set.Types), want)
		}
	}
	if n := len(list(t, ts.url).Policies); n != 4 {
		t.Errorf("GET /v1/policies lists %d policies, want all 4", n)
	}
}

func TestRunReadyFile(t *testing.T) {
	dir := t.TempDir()
	ready := filepath.Join(dir, "ready")
	if err := os.WriteFile(ready, []byte("stale\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	w := testutil.NewFileWaiter(t, ready)
	go func() {
		done <- Run(ctx, Config{Listen: "127.0.0.1:0", DB: filepath.Join(dir, "p.db"), ReadyFile: ready, Logger: quietLogger(), Insecure: true})
	}()
	addr := w.Wait(t)
	if addr == "stale" {
		t.Fatal("read the stale ready file")
	}
	if set := list(t, "http://"+addr); set.Version != 0 {
		t.Fatalf("fresh server: %+v", set)
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("Run: %v", err)
	}
	if _, err := os.Stat(ready); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("ready file left behind: %v", err)
	}
}

// A connection that never sends a request (an HTTP client's spare dial)
// does not hold up the server's shutdown.
func TestShutdownWithIdleNewConnection(t *testing.T) {
	ts := startServer(t, Config{})
	conn, err := net.Dial("tcp", strings.TrimPrefix(ts.url, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	// The server has accepted it once a request on another connection
	// has been answered after it (accepts are in order).
	if code, _ := call(t, "GET", ts.url+"/healthz", ""); code != 200 {
		t.Fatalf("healthz: %d", code)
	}
	start := time.Now()
	ts.stop() // fails the test if Serve returns an error
	if d := time.Since(start); d > 3*time.Second {
		t.Errorf("shutdown took %s with an idle new connection open", d)
	}
}
