package api

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"os"
	"reflect"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

var sockSeq atomic.Uint64

// uniqueSocket names an abstract socket no other test (or test binary) uses.
func uniqueSocket(t *testing.T) string {
	return fmt.Sprintf("@dysco-test-%d-%d-%d", os.Getpid(), time.Now().UnixNano(), sockSeq.Add(1))
}

// serveUnix serves h on a fresh abstract Unix socket and returns its name.
func serveUnix(t *testing.T, h http.Handler) string {
	t.Helper()
	name := uniqueSocket(t)
	ln, err := net.Listen("unix", name)
	if err != nil {
		t.Fatalf("listen %s: %v", name, err)
	}
	s := httptest.NewUnstartedServer(h)
	s.Listener.Close()
	s.Listener = ln
	s.Start()
	t.Cleanup(s.Close)
	return name
}

func writeJSON(w http.ResponseWriter, code int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	json.NewEncoder(w).Encode(v)
}

func TestClientAgentRoutes(t *testing.T) {
	status := Status{Name: "h1", Attach: "tcx", Ifaces: []string{"eth0"}, PolicyVersion: 3,
		Counters: map[string]uint64{"setups": 2}}
	sessions := []Session{{ID: 1, Session: "10.0.0.1:1234 -> 10.0.0.3:80", Role: "start", State: "established"}}
	set := PolicySet{Version: 4, Policies: []Policy{{Name: "web", Filter: "tcp dst port 80"}}}
	type call struct{ method, path, body string }
	calls := make(chan call, 10)
	mux := http.NewServeMux()
	record := func(r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		calls <- call{r.Method, r.URL.EscapedPath(), string(b)}
	}
	mux.HandleFunc("GET /v1/status", func(w http.ResponseWriter, r *http.Request) { record(r); writeJSON(w, 200, status) })
	mux.HandleFunc("GET /v1/sessions", func(w http.ResponseWriter, r *http.Request) { record(r); writeJSON(w, 200, sessions) })
	mux.HandleFunc("GET /v1/policies", func(w http.ResponseWriter, r *http.Request) { record(r); writeJSON(w, 200, set) })
	mux.HandleFunc("PUT /v1/policies/{name}", func(w http.ResponseWriter, r *http.Request) { record(r); writeJSON(w, 200, set.Policies[0]) })
	mux.HandleFunc("DELETE /v1/policies/{name}", func(w http.ResponseWriter, r *http.Request) {
		record(r)
		if r.PathValue("name") != "web" {
			writeJSON(w, 404, Error{Error: fmt.Sprintf("policy %q not found", r.PathValue("name"))})
			return
		}
		w.WriteHeader(http.StatusNoContent)
	})
	mux.HandleFunc("PUT /v1/types/{name}", func(w http.ResponseWriter, r *http.Request) { record(r); writeJSON(w, 200, nil) })
	mux.HandleFunc("DELETE /v1/types/{name}", func(w http.ResponseWriter, r *http.Request) { record(r); w.WriteHeader(204) })

	c := NewUnixClient(serveUnix(t, mux))
	ctx := t.Context()

	gotStatus, err := c.Status(ctx)
	if err != nil || !reflect.DeepEqual(gotStatus, status) {
		t.Fatalf("Status = %+v, %v; want %+v", gotStatus, err, status)
	}
	<-calls
	gotSessions, err := c.Sessions(ctx)
	if err != nil || !reflect.DeepEqual(gotSessions, sessions) {
		t.Fatalf("Sessions = %+v, %v", gotSessions, err)
	}
	<-calls
	gotSet, err := c.Policies(ctx)
	if err != nil || !reflect.DeepEqual(gotSet, set) {
		t.Fatalf("Policies = %+v, %v", gotSet, err)
	}
	<-calls

	p := Policy{Name: "web", Filter: "tcp dst port 80", Chain: []Hop{{Addr: netip.MustParseAddr("10.0.0.2")}, {Type: "nat"}}}
	if err := c.PutPolicy(ctx, p); err != nil {
		t.Fatalf("PutPolicy: %v", err)
	}
	got := <-calls
	var sent Policy
	if err := json.Unmarshal([]byte(got.body), &sent); err != nil || got.method != "PUT" || got.path != "/v1/policies/web" || !reflect.DeepEqual(sent, p) {
		t.Fatalf("PutPolicy sent %+v (%v)", got, err)
	}

	if err := c.DeletePolicy(ctx, "web"); err != nil {
		t.Fatalf("DeletePolicy: %v", err)
	}
	<-calls
	err = c.DeletePolicy(ctx, "a b")
	if !IsNotFound(err) || err.Error() != `policy "a b" not found` {
		t.Fatalf("DeletePolicy(absent) = %v, want 404 with the server's message", err)
	}
	if got := <-calls; got.path != "/v1/policies/a%20b" {
		t.Fatalf("DeletePolicy path = %q, want escaped name", got.path)
	}

	mt := MiddleboxType{Name: "nat", Instances: []netip.Addr{netip.MustParseAddr("10.0.0.5")}}
	if err := c.PutType(ctx, mt); err != nil {
		t.Fatalf("PutType: %v", err)
	}
	if got := <-calls; got.method != "PUT" || got.path != "/v1/types/nat" {
		t.Fatalf("PutType sent %+v", got)
	}
	if err := c.DeleteType(ctx, "nat"); err != nil {
		t.Fatalf("DeleteType: %v", err)
	}
	if got := <-calls; got.method != "DELETE" || got.path != "/v1/types/nat" {
		t.Fatalf("DeleteType sent %+v", got)
	}
}

func TestClientNoAgent(t *testing.T) {
	c := NewUnixClient(uniqueSocket(t))
	_, err := c.Status(t.Context())
	if !errors.Is(err, ErrNoAgent) {
		t.Fatalf("Status with no agent = %v, want ErrNoAgent", err)
	}
	want := `no dysco agent in this network namespace (is "dysco agent" running? run the CLI inside the host's namespace: ip netns exec NAME dysco ...)`
	if err.Error() != want {
		t.Fatalf("error = %q\nwant    %q", err, want)
	}
}

func TestClientNonJSONError(t *testing.T) {
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		http.Error(w, "teapot trouble", http.StatusTeapot)
	})
	c := NewUnixClient(serveUnix(t, h))
	_, err := c.Sessions(t.Context())
	var he *HTTPError
	if !errors.As(err, &he) || he.StatusCode != http.StatusTeapot {
		t.Fatalf("err = %v, want HTTPError 418", err)
	}
	if want := "GET /v1/sessions: 418 I'm a teapot: teapot trouble"; !strings.Contains(err.Error(), want) {
		t.Fatalf("err = %q, want it to contain %q", err, want)
	}
}

func TestClientServerOverTCP(t *testing.T) {
	var gotQuery atomic.Value
	mux := http.NewServeMux()
	mux.HandleFunc("GET /v1/watch", func(w http.ResponseWriter, r *http.Request) {
		gotQuery.Store(r.URL.RawQuery)
		writeJSON(w, 200, PolicySet{Version: 9})
	})
	s := httptest.NewServer(mux)
	t.Cleanup(s.Close)

	// A bare host:port means http.
	c := NewServerClient(s.Listener.Addr().String() + "/")
	set, err := c.Watch(t.Context(), "h1", 7, 30*time.Second, "")
	if err != nil || set.Version != 9 {
		t.Fatalf("Watch = %+v, %v", set, err)
	}
	if q := gotQuery.Load(); q != "after=7&host=h1&wait=30" {
		t.Fatalf("watch query = %q", q)
	}
	// A route the server lacks still gives an error naming it.
	if _, err := c.Status(t.Context()); err == nil || !strings.Contains(err.Error(), "404") {
		t.Fatalf("Status on server = %v, want 404", err)
	}
}

func TestClientServerUnreachable(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	c := NewServerClient("http://" + addr)
	_, err = c.Policies(t.Context())
	if err == nil || !strings.Contains(err.Error(), "policy server http://"+addr+" unreachable") {
		t.Fatalf("err = %v, want it to say the server is unreachable", err)
	}
}

func TestClientTimeout(t *testing.T) {
	release := make(chan struct{})
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-release:
		case <-r.Context().Done():
		}
	})
	c := NewUnixClient(serveUnix(t, h))
	defer close(release)
	c.Timeout = 50 * time.Millisecond
	_, err := c.Status(context.Background())
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("err = %v, want deadline exceeded", err)
	}
}

func TestClientReconfigRoutes(t *testing.T) {
	type call struct{ method, path, body string }
	calls := make(chan call, 10)
	record := func(r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		calls <- call{r.Method, r.URL.EscapedPath(), string(b)}
	}
	res := ReconfigResult{ID: 4, Session: "10.0.0.1:40000 -> 10.0.0.3:80", Outcome: "succeeded", Micros: 1234}
	refused := ReconfigResult{ID: 5, Session: "10.0.0.1:40001 -> 10.0.0.3:80", Outcome: "refused", Reason: "locked", Blocker: "10.0.0.2#7", Micros: 80}
	mux := http.NewServeMux()
	mux.HandleFunc("POST /v1/reconfig", func(w http.ResponseWriter, r *http.Request) {
		record(r)
		writeJSON(w, 200, ReconfigReply{Results: []ReconfigResult{res, refused}})
	})
	mux.HandleFunc("POST /v1/middlebox", func(w http.ResponseWriter, r *http.Request) {
		record(r)
		writeJSON(w, 200, ReconfigReply{Results: []ReconfigResult{res}})
	})
	mux.HandleFunc("POST /v1/sessions/splice", func(w http.ResponseWriter, r *http.Request) {
		record(r)
		writeJSON(w, 200, SpliceReply{ID: 9, Result: &res})
	})
	c := NewUnixClient(serveUnix(t, mux))
	ctx := t.Context()
	a := netip.MustParseAddr

	rreq := ReconfigRequest{Match: "tcp dst port 80", To: a("10.0.0.3"), Chain: []netip.Addr{a("10.0.1.2"), a("10.0.1.3")}, TimeoutMS: 2500}
	rep, err := c.Reconfig(ctx, rreq)
	if err != nil || !reflect.DeepEqual(rep.Results, []ReconfigResult{res, refused}) {
		t.Fatalf("Reconfig = %+v, %v", rep, err)
	}
	got := <-calls
	var sentR ReconfigRequest
	if err := json.Unmarshal([]byte(got.body), &sentR); err != nil || got.method != "POST" || got.path != "/v1/reconfig" || !reflect.DeepEqual(sentR, rreq) {
		t.Fatalf("Reconfig sent %+v (%v)", got, err)
	}
	if want := `{"match":"tcp dst port 80","to":"10.0.0.3","chain":["10.0.1.2","10.0.1.3"],"timeout_ms":2500}`; got.body != want {
		t.Errorf("Reconfig body = %s\nwant %s", got.body, want)
	}

	mreq := MiddleboxRequest{With: []netip.Addr{a("2001:db8::5")}}
	rep, err = c.Middlebox(ctx, mreq)
	if err != nil || !reflect.DeepEqual(rep.Results, []ReconfigResult{res}) {
		t.Fatalf("Middlebox = %+v, %v", rep, err)
	}
	got = <-calls
	if want := `{"match":"","with":["2001:db8::5"]}`; got.method != "POST" || got.path != "/v1/middlebox" || got.body != want {
		t.Fatalf("Middlebox sent %+v, want body %s", got, want)
	}

	sreq := SpliceRequest{
		In:    SocketPair{Local: netip.MustParseAddrPort("10.0.0.2:80"), Remote: netip.MustParseAddrPort("10.0.0.1:40000")},
		Out:   SocketPair{Local: netip.MustParseAddrPort("10.0.0.2:41000"), Remote: netip.MustParseAddrPort("10.0.0.3:8080")},
		Delta: -12, DeltaRev: 30, Wait: true,
	}
	srep, err := c.Splice(ctx, sreq)
	if err != nil || srep.ID != 9 || srep.Result == nil || *srep.Result != res {
		t.Fatalf("Splice = %+v, %v", srep, err)
	}
	got = <-calls
	var sentS SpliceRequest
	if err := json.Unmarshal([]byte(got.body), &sentS); err != nil || got.method != "POST" || got.path != "/v1/sessions/splice" || sentS != sreq {
		t.Fatalf("Splice sent %+v (%v)", got, err)
	}
}

func TestClientReconfigErrors(t *testing.T) {
	mux := http.NewServeMux()
	mux.HandleFunc("POST /v1/reconfig", func(w http.ResponseWriter, r *http.Request) {
		writeJSON(w, 400, Error{Error: `match "tcp dst prot 80": can't parse filter expression: syntax error`})
	})
	mux.HandleFunc("POST /v1/middlebox", func(w http.ResponseWriter, r *http.Request) {
		writeJSON(w, 409, Error{Error: "this host is no middlebox of any session"})
	})
	c := NewUnixClient(serveUnix(t, mux))
	_, err := c.Reconfig(t.Context(), ReconfigRequest{Match: "tcp dst prot 80", To: netip.MustParseAddr("10.0.0.3")})
	var he *HTTPError
	if !errors.As(err, &he) || he.StatusCode != 400 || err.Error() != `match "tcp dst prot 80": can't parse filter expression: syntax error` {
		t.Fatalf("Reconfig error = %v, want the agent's message", err)
	}
	_, err = c.Middlebox(t.Context(), MiddleboxRequest{})
	if !errors.As(err, &he) || he.StatusCode != 409 || err.Error() != "this host is no middlebox of any session" {
		t.Fatalf("Middlebox error = %v, want the agent's message", err)
	}
	// A route the agent lacks (an older agent) names it.
	_, err = c.Splice(t.Context(), SpliceRequest{})
	if !IsNotFound(err) || !strings.Contains(err.Error(), "POST /v1/sessions/splice: 404") {
		t.Fatalf("Splice on an agent without the route = %v", err)
	}
	_, err = NewUnixClient(uniqueSocket(t)).Reconfig(t.Context(), ReconfigRequest{TimeoutMS: 100})
	if !errors.Is(err, ErrNoAgent) {
		t.Fatalf("Reconfig with no agent = %v, want ErrNoAgent", err)
	}
}

// TestClientReconfigOutwaitsAgent: a reconfiguration request waits for the
// agent's own wait plus a margin, even when the client's Timeout is shorter.
func TestClientReconfigOutwaitsAgent(t *testing.T) {
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		time.Sleep(300 * time.Millisecond) // the agent waits for results
		writeJSON(w, 200, ReconfigReply{Results: []ReconfigResult{{ID: 1, Outcome: "failed", Reason: "timeout"}}})
	})
	c := NewUnixClient(serveUnix(t, h))
	c.Timeout = 50 * time.Millisecond
	rep, err := c.Reconfig(context.Background(), ReconfigRequest{TimeoutMS: 250})
	if err != nil || len(rep.Results) != 1 {
		t.Fatalf("Reconfig = %+v, %v; want the agent's answer after its 250ms wait", rep, err)
	}
	if _, err := c.Middlebox(context.Background(), MiddleboxRequest{TimeoutMS: 250}); err != nil {
		t.Fatalf("Middlebox: %v", err)
	}
	// Other requests keep the client's Timeout.
	if _, err := c.Status(context.Background()); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Status = %v, want deadline exceeded", err)
	}
	// The caller's shorter deadline still wins.
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	if _, err := c.Reconfig(ctx, ReconfigRequest{TimeoutMS: 250}); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Reconfig under a 50ms context = %v, want deadline exceeded", err)
	}
}

func TestReconfigContextDeadline(t *testing.T) {
	c := NewUnixClient(uniqueSocket(t))
	for _, tc := range []struct {
		timeoutMS int
		clientTO  time.Duration
		want      time.Duration
	}{
		{10000, 0, 10*time.Second + ReconfigSlack},
		{1, 0, time.Millisecond + ReconfigSlack},
		{0, 0, DefaultReconfigWait},
		{-5, 0, DefaultReconfigWait},
		{1000, 2 * time.Minute, 2 * time.Minute},
		{1 << 62, 0, 24*time.Hour + ReconfigSlack},
	} {
		c.Timeout = tc.clientTO
		start := time.Now()
		ctx, cancel := c.reconfigContext(context.Background(), tc.timeoutMS)
		dl, ok := ctx.Deadline()
		cancel()
		if got := dl.Sub(start); !ok || got < tc.want || got > tc.want+time.Second {
			t.Errorf("TimeoutMS %d, Timeout %v: deadline in %v, want %v", tc.timeoutMS, tc.clientTO, got, tc.want)
		}
	}
}
