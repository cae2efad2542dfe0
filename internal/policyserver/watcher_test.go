package policyserver

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"reflect"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/dysco/dysco/internal/api"
	"github.com/dysco/dysco/internal/psclient"
)

// runWatch runs psclient.Watch on a goroutine and hands out what it reports; the
// returned stop cancels it and waits for it to return.
type watchRun struct {
	updates chan api.PolicySet
	status  chan error // nil for ok
	stop    func()
}

func runWatch(t *testing.T, cfg psclient.WatchConfig) *watchRun {
	t.Helper()
	w := &watchRun{updates: make(chan api.PolicySet, 100), status: make(chan error, 1000)}
	cfg.OnUpdate = func(s api.PolicySet) { w.updates <- s }
	cfg.OnStatus = func(ok bool, err error) {
		if ok != (err == nil) {
			t.Errorf("OnStatus(%v, %v)", ok, err)
		}
		select {
		case w.status <- err:
		default:
		}
	}
	if cfg.Logger == nil {
		cfg.Logger = quietLogger()
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- psclient.Watch(ctx, cfg) }()
	stopped := false
	w.stop = func() {
		if stopped {
			return
		}
		stopped = true
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Watch returned %v", err)
		}
	}
	t.Cleanup(w.stop)
	return w
}

func (w *watchRun) next(t *testing.T) api.PolicySet {
	t.Helper()
	select {
	case s := <-w.updates:
		return s
	case <-time.After(10 * time.Second):
		t.Fatal("no OnUpdate")
		return api.PolicySet{}
	}
}

// nextStatus returns the next status report that matches ok.
func (w *watchRun) nextStatus(t *testing.T, ok bool) error {
	t.Helper()
	deadline := time.After(10 * time.Second)
	for {
		select {
		case err := <-w.status:
			if (err == nil) == ok {
				return err
			}
		case <-deadline:
			t.Fatalf("no OnStatus(%v)", ok)
			return nil
		}
	}
}

func TestWatcherFollowsServer(t *testing.T) {
	ts := startServer(t, Config{})
	mustPut(t, ts.url, "/v1/policies/web", `{"filter":"tcp port 80","hosts":["h1"]}`)
	mustPut(t, ts.url, "/v1/policies/other", `{"filter":"tcp port 81","hosts":["h2"]}`)
	cache := filepath.Join(t.TempDir(), "state", "policies.json")

	w := runWatch(t, psclient.WatchConfig{URL: ts.url, Host: "h1", CacheFile: cache})
	set := w.next(t)
	if set.Version != 2 || !reflect.DeepEqual(policyNames(set), []string{"web"}) {
		t.Fatalf("first update %+v", set)
	}
	if err := w.nextStatus(t, true); err != nil {
		t.Fatal(err)
	}
	if got := readCacheT(t, cache); !reflect.DeepEqual(got, set) {
		t.Errorf("cache holds %+v, want %+v", got, set)
	}

	// A change for another host still bumps the version, and h1 gets the set.
	mustPut(t, ts.url, "/v1/policies/other", `{"filter":"tcp port 82","hosts":["h2"]}`)
	if set := w.next(t); set.Version != 3 || !reflect.DeepEqual(policyNames(set), []string{"web"}) {
		t.Fatalf("second update %+v", set)
	}
	if code, _ := call(t, "DELETE", ts.url+"/v1/policies/web", ""); code != 204 {
		t.Fatal("delete failed")
	}
	set = w.next(t)
	if set.Version != 4 || len(set.Policies) != 0 {
		t.Fatalf("third update %+v", set)
	}
	if got := readCacheT(t, cache); !reflect.DeepEqual(got, set) {
		t.Errorf("cache holds %+v, want %+v", got, set)
	}
}

func readCacheT(t *testing.T, path string) api.PolicySet {
	t.Helper()
	set, err := psclient.ReadCache(path, "h1")
	if err != nil {
		t.Fatal(err)
	}
	return set
}

func TestWatcherCacheSurvivesServerDown(t *testing.T) {
	ts := startServer(t, Config{})
	mustPut(t, ts.url, "/v1/types/nat", `{"instances":["10.0.0.5"]}`)
	mustPut(t, ts.url, "/v1/policies/web", `{"filter":"tcp port 80","chain":[{"type":"nat"}]}`)
	cache := filepath.Join(t.TempDir(), "policies.json")

	w := runWatch(t, psclient.WatchConfig{URL: ts.url, Host: "h1", CacheFile: cache})
	want := w.next(t)
	w.stop()
	ts.stop()

	// A new watcher (an agent restarted while the server is down) starts
	// with the cached set and reports the server unreachable.
	w = runWatch(t, psclient.WatchConfig{URL: ts.url, Host: "h1", CacheFile: cache})
	if got := w.next(t); !reflect.DeepEqual(got, want) {
		t.Fatalf("cached update %+v, want %+v", got, want)
	}
	err := w.nextStatus(t, false)
	if !strings.Contains(err.Error(), "unreachable") {
		t.Errorf("status error %q does not say the server is unreachable", err)
	}
	// It keeps retrying (with back-off) and delivers nothing else.
	w.nextStatus(t, false)
	select {
	case s := <-w.updates:
		t.Fatalf("update %+v while the server is down", s)
	default:
	}
}

func TestWatcherNeverGoesBack(t *testing.T) {
	ts := startServer(t, Config{})
	mustPut(t, ts.url, "/v1/policies/p", `{"filter":"tcp","priority":1}`)
	cache := filepath.Join(t.TempDir(), "policies.json")
	cached := api.PolicySet{Version: 5, Policies: []api.Policy{{Name: "cached", Filter: "tcp"}}, Types: []api.MiddleboxType{}}
	data, _ := json.Marshal(cached) // a plain PolicySet loads too
	if err := os.WriteFile(cache, data, 0o644); err != nil {
		t.Fatal(err)
	}

	w := runWatch(t, psclient.WatchConfig{URL: ts.url, Host: "h1", CacheFile: cache, Wait: time.Second})
	if got := w.next(t); !reflect.DeepEqual(got, cached) {
		t.Fatalf("cached update %+v", got)
	}
	// Versions 2..5 are not newer than the cache; 6 is.
	for i := 2; i <= 6; i++ {
		mustPut(t, ts.url, "/v1/policies/p", `{"filter":"tcp","priority":`+strconv.Itoa(i)+`}`)
	}
	if got := w.next(t); got.Version != 6 || got.Policies[0].Priority != 6 {
		t.Fatalf("update after the cache: %+v, want version 6", got)
	}
}

func TestWatcherIgnoresOtherHostsCache(t *testing.T) {
	ts := startServer(t, Config{})
	mustPut(t, ts.url, "/v1/policies/p", `{"filter":"tcp"}`)
	cache := filepath.Join(t.TempDir(), "policies.json")
	if err := os.WriteFile(cache, []byte(`{"version":9,"host":"h2"}`), 0o644); err != nil {
		t.Fatal(err)
	}
	w := runWatch(t, psclient.WatchConfig{URL: ts.url, Host: "h1", CacheFile: cache})
	if got := w.next(t); got.Version != 1 {
		t.Fatalf("first update %+v, want the server's version 1, not h2's cache", got)
	}
	if got := readCacheT(t, cache); got.Version != 1 {
		t.Fatalf("cache not replaced: %+v", got)
	}
}
