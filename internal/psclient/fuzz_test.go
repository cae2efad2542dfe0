package psclient

import (
	"bytes"
	"encoding/json"
	"errors"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"testing"

	"github.com/dysco/dysco/internal/api"
)

// FuzzServerAnswer: an agent's decoding of what the policy server answers
// (api.Client, as Watch and ServeOperations use it), with whatever status
// and body the fuzzer makes, served by a real HTTP server. which picks the
// call: the policy watch, an operation claim or an operation's status.
// Whatever comes, the call returns (no panic), and:
//   - a non-2xx answer is an *api.HTTPError with that status;
//   - an accepted policy set encodes to JSON that decodes to the same
//     encoding (what the agent caches is what it applies);
//   - a claimed operation has an ID, and the agent's time for it
//     (OpTimeout) is positive and at most MaxOpTimeout, whatever timeout it
//     asks for.
//
// `go test` runs the seeds; `go test -run '^$' -fuzz '^FuzzServerAnswer$'
// ./internal/psclient` searches.
func FuzzServerAnswer(f *testing.F) {
	set, _ := json.Marshal(api.PolicySet{Version: 7, Policies: []api.Policy{{Name: "p", Filter: "tcp dst port 80"}},
		Types: []api.MiddleboxType{{Name: "fw"}}})
	op, _ := json.Marshal(api.Operation{ID: "op-1", Host: "mb1", State: api.OpRunning,
		Reconfig: &api.ReconfigRequest{Match: "tcp", TimeoutMS: 1 << 30}})
	for _, s := range []struct {
		status uint16
		body   []byte
	}{
		{200, set}, {200, op}, {204, nil}, {200, []byte("null")}, {200, []byte(`{"version":"x"}`)},
		{200, []byte(`{"id":"a","middlebox":{"timeout_ms":-5}}`)}, {404, []byte(`{"error":"no such host"}`)},
		{500, []byte("<html>oops</html>")}, {403, bytes.Repeat([]byte("x"), 300)}, {200, set[:len(set)/2]},
	} {
		for which := range uint8(3) {
			f.Add(s.status, s.body, which)
		}
	}
	var status uint16
	var body []byte
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(int(status))
		w.Write(body)
	}))
	f.Cleanup(srv.Close)
	c := api.NewServerClient(srv.URL)
	f.Fuzz(func(t *testing.T, st uint16, b []byte, which uint8) {
		status, body = 200+st%400, b // net/http refuses codes outside 1xx-5xx; 1xx are not final answers
		var err error
		switch which % 3 {
		case 0:
			var set api.PolicySet
			set, err = c.Watch(t.Context(), "mb1", 3, 0, "")
			if err == nil {
				enc, merr := json.Marshal(set)
				if merr != nil {
					t.Fatalf("accepted set does not encode: %v", merr)
				}
				var again api.PolicySet
				if err := json.Unmarshal(enc, &again); err != nil {
					t.Fatalf("accepted set does not decode again: %v", err)
				}
				if enc2, _ := json.Marshal(again); !bytes.Equal(enc, enc2) {
					t.Fatalf("policy set round trip\n got %s\nwant %s", enc2, enc)
				}
			}
		case 1:
			var op api.Operation
			var ok bool
			op, ok, err = c.ClaimOperation(t.Context(), "mb1", 0)
			if ok {
				if op.ID == "" {
					t.Fatal("claimed an operation without an ID")
				}
				if d := OpTimeout(&op); d <= 0 || d > MaxOpTimeout {
					t.Fatalf("operation time %v (asked %d ms), want within (0, %v]", d, op.TimeoutMS(), MaxOpTimeout)
				}
			}
		case 2:
			_, err = c.Operation(t.Context(), "op-1", 0)
		}
		if status/100 != 2 {
			var he *api.HTTPError
			if !errors.As(err, &he) || he.StatusCode != int(status) {
				t.Fatalf("answer %d: error %v (%T), want an *api.HTTPError with that status", status, err, err)
			}
		}
	})
}

// FuzzReadCache: the agent's policy cache file, whatever its bytes. What
// readCache accepts for a host is a set that writeCache writes and
// readCache reads back to the same set; a cache naming another host is
// refused.
//
// `go test` runs the seeds; `go test -run '^$' -fuzz '^FuzzReadCache$'
// ./internal/psclient` searches.
func FuzzReadCache(f *testing.F) {
	good, _ := json.MarshalIndent(cacheFile{PolicySet: api.PolicySet{Version: 3,
		Policies: []api.Policy{{Name: "p", Filter: "tcp", Priority: 2}}}, Host: "mb1"}, "", "  ")
	for _, s := range [][]byte{good, good[:20], []byte(`{}`), []byte(`{"host":"mb2","version":1}`), []byte(`[]`),
		[]byte(`{"version":18446744073709551615,"policies":null}`), []byte("\xff\xfe"), nil} {
		f.Add(s)
	}
	dir := f.TempDir()
	path, again := filepath.Join(dir, "cache.json"), filepath.Join(dir, "again.json")
	f.Fuzz(func(t *testing.T, data []byte) {
		if err := os.WriteFile(path, data, 0o600); err != nil {
			t.Fatal(err)
		}
		set, err := readCache(path, "mb1")
		if err != nil {
			return
		}
		var cf cacheFile
		if json.Unmarshal(data, &cf) != nil || (cf.Host != "" && cf.Host != "mb1") {
			t.Fatalf("accepted a cache of host %q (or one that does not decode)", cf.Host)
		}
		if err := writeCache(again, "mb1", set); err != nil {
			t.Fatal(err)
		}
		got, err := readCache(again, "mb1")
		if err != nil {
			t.Fatalf("a cache written from an accepted set is refused: %v", err)
		}
		a, _ := json.Marshal(set)
		b, _ := json.Marshal(got)
		if !bytes.Equal(a, b) {
			t.Fatalf("cache round trip\n got %s\nwant %s", b, a)
		}
		if _, err := readCache(again, "mb2"); err == nil {
			t.Fatal("the cache of mb1 was accepted for mb2")
		}
	})
}
