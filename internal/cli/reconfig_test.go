package cli

import (
	"encoding/json"
	"errors"
	"net/http"
	"net/netip"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/dysco/dysco/internal/api"
)

// reconfigAgent is a fake agent serving /v1/reconfig and /v1/middlebox: it
// records each request and answers with reply.
type reconfigAgent struct {
	reconfigs   chan api.ReconfigRequest
	middleboxes chan api.MiddleboxRequest
}

func newReconfigAgent(t *testing.T, reply api.ReconfigReply) *reconfigAgent {
	t.Helper()
	a := &reconfigAgent{reconfigs: make(chan api.ReconfigRequest, 10), middleboxes: make(chan api.MiddleboxRequest, 10)}
	mux := http.NewServeMux()
	mux.HandleFunc("POST /v1/reconfig", func(w http.ResponseWriter, r *http.Request) {
		var req api.ReconfigRequest
		if err := json.NewDecoder(r.Body).Decode(&req); err != nil {
			w.WriteHeader(400)
			agentJSON(w, api.Error{Error: err.Error()})
			return
		}
		a.reconfigs <- req
		agentJSON(w, reply)
	})
	mux.HandleFunc("POST /v1/middlebox", func(w http.ResponseWriter, r *http.Request) {
		var req api.MiddleboxRequest
		if err := json.NewDecoder(r.Body).Decode(&req); err != nil {
			w.WriteHeader(400)
			agentJSON(w, api.Error{Error: err.Error()})
			return
		}
		a.middleboxes <- req
		agentJSON(w, reply)
	})
	fakeAgent(t, mux)
	return a
}

// noCalls fails the test if the agent was asked anything.
func (a *reconfigAgent) noCalls(t *testing.T, what string) {
	t.Helper()
	select {
	case r := <-a.reconfigs:
		t.Errorf("%s: the agent got %+v", what, r)
	case r := <-a.middleboxes:
		t.Errorf("%s: the agent got %+v", what, r)
	default:
	}
}

func addrs(ss ...string) []netip.Addr {
	var out []netip.Addr
	for _, s := range ss {
		out = append(out, netip.MustParseAddr(s))
	}
	return out
}

func exitStatus(err error) int {
	var ee exitError
	if errors.As(err, &ee) {
		return int(ee)
	}
	return -1
}

var mixedReply = api.ReconfigReply{Results: []api.ReconfigResult{
	{ID: 4, Session: "10.0.0.1:40000 -> 10.0.9.1:80", Outcome: "succeeded", Micros: 12345, LockMicros: 1200, SetupMicros: 2500},
	{ID: 7, Session: "10.0.0.1:40002 -> 10.0.9.1:80", Outcome: "refused", Reason: "segment locked by another reconfiguration", Blocker: "10.0.1.2#3", Micros: 410},
	{ID: 9, Session: "10.0.0.1:40004 -> 10.0.9.1:80", Outcome: "failed", Reason: "new path could not be set up", Micros: 3000000, LockMicros: 800},
}}

func TestReconfigOutput(t *testing.T) {
	a := newReconfigAgent(t, mixedReply)
	out, err := runDysco(t, "reconfig", "--match", "tcp dst port 80", "--to", "10.0.3.2", "--chain", "10.0.2.5, 10.0.2.6", "--timeout", "30s")
	want := `ID  SESSION                        OUTCOME    REASON                                                             TIME      LOCK/SETUP/TWO-PATH
4   10.0.0.1:40000 -> 10.0.9.1:80  succeeded  -                                                                  12.3ms    1.2/1.3/9.8ms
7   10.0.0.1:40002 -> 10.0.9.1:80  refused    segment locked by another reconfiguration (blocked by 10.0.1.2#3)  0.4ms     -
9   10.0.0.1:40004 -> 10.0.9.1:80  failed     new path could not be set up                                       3000.0ms  0.8/-/-ms
1 succeeded, 1 refused, 1 failed
`
	if out != want {
		t.Errorf("printed\n%s\nwant\n%s", out, want)
	}
	if exitStatus(err) != 1 {
		t.Errorf("err = %v, want exit status 1", err)
	}
	wantReq := api.ReconfigRequest{Match: "tcp dst port 80", To: netip.MustParseAddr("10.0.3.2"), Chain: addrs("10.0.2.5", "10.0.2.6"), TimeoutMS: 30000}
	if got := <-a.reconfigs; !reflect.DeepEqual(got, wantReq) {
		t.Errorf("agent got %+v, want %+v", got, wantReq)
	}

	// --json prints the reply as it came; the exit status is the same.
	out, err = runDysco(t, "reconfig", "--match", "tcp", "--to", "10.0.3.2", "--json")
	var rep api.ReconfigReply
	if jerr := json.Unmarshal([]byte(out), &rep); jerr != nil || !reflect.DeepEqual(rep, mixedReply) {
		t.Errorf("--json printed %s (%v)", out, jerr)
	}
	if exitStatus(err) != 1 {
		t.Errorf("--json: err = %v, want exit status 1", err)
	}
	// No --chain: a deletion, with the default timeout.
	wantReq = api.ReconfigRequest{Match: "tcp", To: netip.MustParseAddr("10.0.3.2"), TimeoutMS: 10000}
	if got := <-a.reconfigs; !reflect.DeepEqual(got, wantReq) {
		t.Errorf("agent got %+v, want %+v", got, wantReq)
	}
}

// TestReconfigNFHops: --chain hops written NF@ADDR name the network
// function each host must start before it joins (IPv6 too: an address
// holds no '@'), plain addresses none; the phases show the wait for it.
func TestReconfigNFHops(t *testing.T) {
	a := newReconfigAgent(t, api.ReconfigReply{Results: []api.ReconfigResult{
		{ID: 3, Session: "10.0.0.1:40000 -> 10.0.9.1:80", Outcome: "succeeded", Micros: 900000, LockMicros: 1000,
			SetupMicros: 860000, NF: "firewall", NFMicros: 850000},
		{ID: 4, Session: "10.0.0.1:40001 -> 10.0.9.1:80", Outcome: "failed", Micros: 3100000, LockMicros: 1000, NF: "ids", NFMicros: 3000000,
			Reason: "network function ids could not be started at 10.0.2.6: not ready within 3s"},
	}})
	out, _ := runDysco(t, "reconfig", "--match", "tcp", "--to", "10.0.3.2", "--chain", "firewall@10.0.2.5,10.0.2.6,ids_2@10.0.2.7")
	for _, w := range []string{"1.0/nf 850.0/9.0/40.0ms", "1.0/nf 3000.0/-/-ms", "network function ids could not be started"} {
		if !strings.Contains(out, w) {
			t.Errorf("printed\n%s\nwant %q in it", out, w)
		}
	}
	wantReq := api.ReconfigRequest{Match: "tcp", To: netip.MustParseAddr("10.0.3.2"), Chain: addrs("10.0.2.5", "10.0.2.6", "10.0.2.7"),
		NFs: []string{"firewall", "", "ids_2"}, TimeoutMS: 10000}
	if got := <-a.reconfigs; !reflect.DeepEqual(got, wantReq) {
		t.Errorf("agent got %+v, want %+v", got, wantReq)
	}
	runDysco(t, "reconfig", "--match", "tcp", "--to", "2001:db8:9::1", "--chain", "fw@2001:db8::5")
	wantReq = api.ReconfigRequest{Match: "tcp", To: netip.MustParseAddr("2001:db8:9::1"), Chain: addrs("2001:db8::5"), NFs: []string{"fw"}, TimeoutMS: 10000}
	if got := <-a.reconfigs; !reflect.DeepEqual(got, wantReq) {
		t.Errorf("agent got %+v, want %+v", got, wantReq)
	}
}

func TestReconfigAllSucceed(t *testing.T) {
	a := newReconfigAgent(t, api.ReconfigReply{Results: []api.ReconfigResult{
		{ID: 1, Session: "[2001:db8::1]:40000 -> [2001:db8:9::1]:443", Outcome: "succeeded", Micros: 800},
		{ID: 2, Session: "[2001:db8::1]:40001 -> [2001:db8:9::1]:443", Outcome: "succeeded", Micros: 1250},
	}})
	out := mustDysco(t, "reconfig", "--match", "tcp port 443", "--to", "2001:db8:9::1", "--chain", "", "--timeout", "1500ms")
	want := `ID  SESSION                                     OUTCOME    REASON  TIME   LOCK/SETUP/TWO-PATH
1   [2001:db8::1]:40000 -> [2001:db8:9::1]:443  succeeded  -       0.8ms  -
2   [2001:db8::1]:40001 -> [2001:db8:9::1]:443  succeeded  -       1.2ms  -
2 succeeded, 0 refused, 0 failed
`
	if out != want {
		t.Errorf("printed\n%s\nwant\n%s", out, want)
	}
	wantReq := api.ReconfigRequest{Match: "tcp port 443", To: netip.MustParseAddr("2001:db8:9::1"), TimeoutMS: 1500}
	if got := <-a.reconfigs; !reflect.DeepEqual(got, wantReq) {
		t.Errorf("agent got %+v, want %+v", got, wantReq)
	}
}

func TestReconfigNoMatch(t *testing.T) {
	a := newReconfigAgent(t, api.ReconfigReply{})
	out, err := runDysco(t, "reconfig", "--match", "tcp dst port 22", "--to", "10.0.3.2")
	if want := `no live session at this host matches "tcp dst port 22" with a path to 10.0.3.2`; err == nil || err.Error() != want || out != "" {
		t.Errorf("printed %q, err %v; want no output and the error %q", out, err, want)
	}
	<-a.reconfigs
	out, err = runDysco(t, "reconfig", "--match", "tcp dst port 22", "--to", "10.0.3.2", "--json")
	if err == nil || !strings.HasPrefix(err.Error(), "no live session") || strings.TrimSpace(out) != "{\n  \"results\": []\n}" {
		t.Errorf("--json printed %q, err %v", out, err)
	}
	<-a.reconfigs
}

func TestReconfigFlagErrors(t *testing.T) {
	a := newReconfigAgent(t, mixedReply)
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--to", "10.0.3.2"}, "--match is required"},
		{[]string{"--match", " ", "--to", "10.0.3.2"}, `--match "": empty filter (use --match tcp`},
		{[]string{"--match", "tcp dst prot 80", "--to", "10.0.3.2"}, `--match: filter "tcp dst prot 80": `},
		{[]string{"--match", "tcp"}, "--to is required"},
		{[]string{"--match", "tcp", "--to", "x"}, `--to: "x" is not an IP address`},
		{[]string{"--match", "tcp", "--to", "10.0.3.2/24"}, `--to: "10.0.3.2/24" is not an IP address`},
		{[]string{"--match", "tcp", "--to", "0.0.0.0"}, `--to: 0.0.0.0 is not a unicast address`},
		{[]string{"--match", "tcp", "--to", "10.0.3.2", "--chain", "10.0.2.5,224.0.0.5"}, `--chain: 224.0.0.5 is not a unicast address`},
		{[]string{"--match", "tcp", "--to", "10.0.3.2", "--chain", "10.0.2.5,fw"}, `--chain: "fw" is not an IP address`},
		{[]string{"--match", "tcp", "--to", "10.0.3.2", "--chain", "10.0.2.5,10.0.3.2"}, "--chain: 10.0.3.2 is the right anchor (--to)"},
		{[]string{"--match", "tcp", "--to", "10.0.3.2", "--chain", "::ffff:10.0.3.2"}, "--chain: 10.0.3.2 is the right anchor (--to)"},
		{[]string{"--match", "tcp", "--to", "10.0.3.2", "--chain", "10.0.2.5,10.0.2.6", "--chain", "10.0.2.5"}, "--chain: 10.0.2.5 appears twice"},
		{[]string{"--match", "tcp", "--to", "10.0.3.2", "--chain", "2001:db8::5"}, "--chain: 2001:db8::5 and --to 10.0.3.2 are of different address families"},
		{[]string{"--match", "tcp", "--to", "10.0.3.2", "--chain", "10.0.2.1,10.0.2.2,10.0.2.3,10.0.2.4,10.0.2.5,10.0.2.6,10.0.2.7,10.0.2.8"}, "--chain: more than 7 hops; at most 7"},
		{[]string{"--match", "tcp", "--to", "10.0.3.2", "--chain", "fire wall@10.0.2.5"}, `--chain: "fire wall@10.0.2.5": the network function's name`},
		{[]string{"--match", "tcp", "--to", "10.0.3.2", "--chain", "@10.0.2.5"}, `--chain: "@10.0.2.5": the network function's name`},
		{[]string{"--match", "tcp", "--to", "10.0.3.2", "--chain", "fw@"}, `--chain: "fw@": no address after '@'`},
		{[]string{"--match", "tcp", "--to", "10.0.3.2", "--chain", "fw@10.0.3.2"}, "--chain: 10.0.3.2 is the right anchor (--to)"},
		{[]string{"--match", "tcp", "--to", "10.0.3.2", "--timeout", "0s"}, "--timeout 0s: must be at least 1ms"},
		{[]string{"--match", "tcp", "--to", "10.0.3.2", "--timeout", "-1s"}, "--timeout -1s: must be at least 1ms"},
		{[]string{"--match", "tcp", "--to", "10.0.3.2", "--timeout", "48h"}, "--timeout 48h0m0s: at most 24h"},
		{[]string{"tcp port 80", "--to", "10.0.3.2"}, `unexpected argument "tcp port 80": give the filter with --match 'FILTER'`},
		{[]string{"--match", "tcp", "--to", "10.0.3.2", "--host", "edge1"}, "--host needs --server"},
		{[]string{"--match", "tcp", "--to", "10.0.3.2", "--server", "http://127.0.0.1:1"}, "--server needs --host"},
	} {
		args := append([]string{"reconfig"}, tc.args...)
		_, err := runDysco(t, args...)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("dysco %s: %v\nwant an error containing %q", strings.Join(args, " "), err, tc.want)
		}
		a.noCalls(t, "dysco "+strings.Join(args, " "))
	}
}

func TestReconfigAgentError(t *testing.T) {
	mux := http.NewServeMux()
	mux.HandleFunc("POST /v1/reconfig", func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusServiceUnavailable)
		agentJSON(w, api.Error{Error: "reconfiguration is not enabled on this agent"})
	})
	fakeAgent(t, mux)
	out, err := runDysco(t, "reconfig", "--match", "tcp", "--to", "10.0.3.2")
	if err == nil || err.Error() != "reconfiguration is not enabled on this agent" || out != "" {
		t.Errorf("printed %q, err %v; want the agent's message", out, err)
	}
}

func TestMiddleboxVerbs(t *testing.T) {
	a := newReconfigAgent(t, api.ReconfigReply{Results: []api.ReconfigResult{
		{ID: 12, Session: "10.0.0.1:40000 -> 10.0.9.1:80", Outcome: "succeeded", Micros: 2100},
	}})
	want := `ID  SESSION                        OUTCOME    REASON  TIME   LOCK/SETUP/TWO-PATH
12  10.0.0.1:40000 -> 10.0.9.1:80  succeeded  -       2.1ms  -
1 succeeded, 0 refused, 0 failed
`
	if out := mustDysco(t, "middlebox", "remove"); out != want {
		t.Errorf("middlebox remove printed\n%s\nwant\n%s", out, want)
	}
	if got, want := <-a.middleboxes, (api.MiddleboxRequest{TimeoutMS: 10000}); !reflect.DeepEqual(got, want) {
		t.Errorf("agent got %+v, want %+v", got, want)
	}
	if out := mustDysco(t, "middlebox", "rm", "--match", "tcp dst port 80", "--timeout", "2s"); out != want {
		t.Errorf("middlebox rm printed\n%s\nwant\n%s", out, want)
	}
	if got, want := <-a.middleboxes, (api.MiddleboxRequest{Match: "tcp dst port 80", TimeoutMS: 2000}); !reflect.DeepEqual(got, want) {
		t.Errorf("agent got %+v, want %+v", got, want)
	}
	if out := mustDysco(t, "middlebox", "replace", "--with", "10.0.2.6,10.0.2.7", "--match", "src net 10.0.0.0/24"); out != want {
		t.Errorf("middlebox replace printed\n%s\nwant\n%s", out, want)
	}
	wantReq := api.MiddleboxRequest{Match: "src net 10.0.0.0/24", With: addrs("10.0.2.6", "10.0.2.7"), TimeoutMS: 10000}
	if got := <-a.middleboxes; !reflect.DeepEqual(got, wantReq) {
		t.Errorf("agent got %+v, want %+v", got, wantReq)
	}
	out := mustDysco(t, "middlebox", "replace", "--with", "10.0.2.6", "--json")
	var rep api.ReconfigReply
	if err := json.Unmarshal([]byte(out), &rep); err != nil || len(rep.Results) != 1 || rep.Results[0].ID != 12 {
		t.Errorf("--json printed %s (%v)", out, err)
	}
	<-a.middleboxes
}

func TestMiddleboxNoMatchAndFailures(t *testing.T) {
	a := newReconfigAgent(t, api.ReconfigReply{Results: []api.ReconfigResult{}})
	_, err := runDysco(t, "middlebox", "remove")
	if want := "no live session passes through this host"; err == nil || err.Error() != want {
		t.Errorf("remove with no session: %v, want %q", err, want)
	}
	<-a.middleboxes
	_, err = runDysco(t, "middlebox", "replace", "--with", "10.0.2.6", "--match", "tcp port 22")
	if want := `no live session passing through this host matches "tcp port 22"`; err == nil || err.Error() != want {
		t.Errorf("replace with no session: %v, want %q", err, want)
	}
	<-a.middleboxes

	a = newReconfigAgent(t, mixedReply)
	out, err := runDysco(t, "middlebox", "remove")
	if !strings.HasSuffix(out, "\n1 succeeded, 1 refused, 1 failed\n") || exitStatus(err) != 1 {
		t.Errorf("printed %q, err %v; want the summary and exit status 1", out, err)
	}
	<-a.middleboxes
}

func TestMiddleboxFlagErrors(t *testing.T) {
	a := newReconfigAgent(t, mixedReply)
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"remove", "--match", "tcp dst prot 80"}, `--match: filter "tcp dst prot 80": `},
		{[]string{"remove", "tcp"}, `unexpected argument "tcp": give the filter with --match 'FILTER'`},
		{[]string{"remove", "--timeout", "0s"}, "--timeout 0s: must be at least 1ms"},
		{[]string{"replace"}, "--with is required"},
		{[]string{"replace", "--with", ""}, `to take this host out without a replacement, use "dysco middlebox remove"`},
		{[]string{"replace", "--with", "mb2"}, `--with: "mb2" is not an IP address`},
		{[]string{"replace", "--with", "10.0.2.6,10.0.2.6"}, "--with: 10.0.2.6 appears twice"},
		{[]string{"replace", "--with", "10.0.2.6,2001:db8::6"}, "--with: 10.0.2.6 and 2001:db8::6 are of different address families"},
		{[]string{"replace", "--with", "10.0.2.6", "--match", "tcp and ("}, "--match: "},
		{[]string{"remove", "--host", "mb1"}, "--host needs --server"},
		{[]string{"replace", "--with", "10.0.2.6", "--server", "http://127.0.0.1:1", "--host", " "}, "--server needs --host"},
		{[]string{"remove", "--server", "http://127.0.0.1:1", "--host", "mb1"}, "policy server http://127.0.0.1:1 unreachable"},
	} {
		args := append([]string{"middlebox"}, tc.args...)
		_, err := runDysco(t, args...)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("dysco %s: %v\nwant an error containing %q", strings.Join(args, " "), err, tc.want)
		}
		a.noCalls(t, "dysco "+strings.Join(args, " "))
	}
}

func TestReconfigHelp(t *testing.T) {
	for _, args := range [][]string{{"reconfig", "--help"}, {"middlebox", "remove", "--help"}, {"middlebox", "replace", "--help"}} {
		out := mustDysco(t, args...)
		for _, want := range []string{"§3.1", "succeeded", "refused", "failed", "--match", "--timeout duration", "--json"} {
			if !strings.Contains(out, want) {
				t.Errorf("dysco %s lacks %q:\n%s", strings.Join(args, " "), want, out)
			}
		}
	}
	out := mustDysco(t, "reconfig", "--help")
	for _, want := range []string{"insert", "delete", "replace", "--to", "--chain"} {
		if !strings.Contains(out, want) {
			t.Errorf("dysco reconfig --help lacks %q", want)
		}
	}
	if out := mustDysco(t, "middlebox", "--help"); !strings.Contains(out, "§2.3") {
		t.Errorf("dysco middlebox --help lacks §2.3:\n%s", out)
	}
}

// TestStatusNFs: dysco status lists the agent's network functions.
func TestStatusNFs(t *testing.T) {
	at := time.Date(2026, 11, 28, 6, 10, 1, 0, time.UTC)
	var b strings.Builder
	err := printStatus(&b, api.Status{Name: "mb1", NFs: []api.NFStatus{
		{Name: "firewall", State: "ready", PID: 4242, StartedAt: at, Sessions: 1, Starts: 1},
		{Name: "ids", State: "failed", Starts: 2, Failures: 2, LastError: "network function ids not ready within 10s"},
	}}, at.Add(time.Minute))
	if err != nil {
		t.Fatal(err)
	}
	for _, w := range []string{
		"network functions:",
		"  firewall  ready, pid 4242, started 2026-11-28T06:10:01Z, 1 sessions, 1 starts, 0 exits, 0 failed starts",
		"  ids       failed, 0 sessions, 2 starts, 0 exits, 2 failed starts; last error: network function ids not ready within 10s",
	} {
		if !strings.Contains(b.String(), w) {
			t.Errorf("printed\n%s\nwant the line %q", b.String(), w)
		}
	}
}
