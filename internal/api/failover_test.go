package api

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
)

// A client of several replicas sends a request to the next when one is
// unreachable or answers 503, asks the one that answered first next time,
// and never sends a POST again once it may have been received.
func TestClientFailover(t *testing.T) {
	var hitsDown, hitsUp, hitsReset atomic.Int64
	down := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		hitsDown.Add(1)
		w.WriteHeader(http.StatusServiceUnavailable)
		w.Write([]byte(`{"error":"etcd has no quorum"}`))
	}))
	defer down.Close()
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		hitsUp.Add(1)
		if r.Method == http.MethodPost {
			w.Write([]byte(`{}`))
			return
		}
		w.Write([]byte(`[]`))
	}))
	defer up.Close()
	reset := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		hitsReset.Add(1)
		conn, _, err := w.(http.Hijacker).Hijack()
		if err == nil {
			conn.Close() // received, then gone without an answer
		}
	}))
	defer reset.Close()
	gone := httptest.NewServer(http.NotFoundHandler())
	goneURL := gone.URL
	gone.Close() // connections refused

	ctx := context.Background()
	c := NewServerClient(down.URL + ", " + goneURL + "," + up.URL + ",")
	if len(c.peers) != 3 {
		t.Fatalf("peers %+v, want 3", c.peers)
	}
	if _, err := c.Operations(ctx); err != nil {
		t.Fatalf("GET past a 503 and a refused connection: %v", err)
	}
	if c.Target() != "policy server "+up.URL || hitsDown.Load() != 1 || hitsUp.Load() != 1 {
		t.Fatalf("target %s, hits down %d up %d", c.Target(), hitsDown.Load(), hitsUp.Load())
	}
	// The replica that answered is asked first.
	c.Operations(ctx)
	if hitsDown.Load() != 1 || hitsUp.Load() != 2 {
		t.Fatalf("second GET: hits down %d up %d, want the answering replica only", hitsDown.Load(), hitsUp.Load())
	}

	// A POST goes on past a refused connection, not past one that took
	// the request and died.
	c = NewServerClient(goneURL + "," + up.URL)
	if _, err := c.CreateOperation(ctx, Operation{Host: "h"}); err != nil {
		t.Fatalf("POST past a refused connection: %v", err)
	}
	c = NewServerClient(reset.URL + "," + up.URL)
	before := hitsUp.Load()
	_, err := c.CreateOperation(ctx, Operation{Host: "h"})
	if err == nil || !strings.Contains(err.Error(), "unreachable") || hitsUp.Load() != before {
		t.Fatalf("POST after a reset: %v, up hit %d times, want the error and no second send", err, hitsUp.Load()-before)
	}
	// A GET is sent again.
	if _, err := c.Operations(ctx); err != nil || hitsUp.Load() != before+1 {
		t.Fatalf("GET after a reset: %v", err)
	}
	// One replica: its error as before.
	c = NewServerClient(goneURL)
	if _, err := c.Operations(ctx); err == nil || !strings.Contains(err.Error(), "policy server "+goneURL+" unreachable") {
		t.Fatalf("one replica down: %v", err)
	}
}
