package cli

import (
	"encoding/json"
	"net/http"
	"strings"
	"testing"

	"github.com/dysco/dysco/internal/api"
)

// TestRebindCmd: dysco rebind checks its flags before it asks, sends the
// filter and the address to POST /v1/rebind, and prints the results as
// dysco reconfig does (exit status 1 unless every session succeeded).
func TestRebindCmd(t *testing.T) {
	got := make(chan api.RebindRequest, 4)
	mux := http.NewServeMux()
	mux.HandleFunc("POST /v1/rebind", func(w http.ResponseWriter, r *http.Request) {
		var req api.RebindRequest
		if err := json.NewDecoder(r.Body).Decode(&req); err != nil {
			t.Errorf("rebind request: %v", err)
		}
		got <- req
		agentJSON(w, api.ReconfigReply{Results: []api.ReconfigResult{
			{ID: 7, Session: "10.250.1.1:40000 -> 10.0.9.1:80", Outcome: "succeeded", Micros: 900},
			{ID: 8, Session: "10.250.1.1:40002 -> 10.0.9.1:80", Outcome: "refused", Reason: "busy"},
		}})
	})
	fakeAgent(t, mux)
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--via", "10.202.1.2"}, "--match is required"},
		{[]string{"--match", " ", "--via", "10.202.1.2"}, `--match "": empty filter`},
		{[]string{"--match", "tcp dst prot 80", "--via", "10.202.1.2"}, `--match: filter "tcp dst prot 80": `},
		{[]string{"--match", "tcp"}, "--via is required"},
		{[]string{"--match", "tcp", "--via", "eth1"}, `--via: "eth1" is not an IP address`},
		{[]string{"--match", "tcp", "--via", "10.202.1.2", "--timeout", "0s"}, "--timeout 0s: must be at least 1ms"},
	} {
		args := append([]string{"rebind"}, tc.args...)
		if _, err := runDysco(t, args...); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("dysco %s: %v\nwant an error containing %q", strings.Join(args, " "), err, tc.want)
		}
	}
	if len(got) != 0 {
		t.Fatalf("%d requests sent for bad flags", len(got))
	}
	out, err := runDysco(t, "rebind", "--match", "tcp port 80", "--via", "10.202.1.2")
	if err == nil || !strings.Contains(out, "1 succeeded, 1 refused, 0 failed") || !strings.Contains(out, "busy") {
		t.Errorf("printed %q, err %v", out, err)
	}
	if req := <-got; req.Match != "tcp port 80" || req.Via.String() != "10.202.1.2" || req.TimeoutMS != 10000 {
		t.Errorf("request %+v", req)
	}
}
