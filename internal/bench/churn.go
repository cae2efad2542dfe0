package bench

// The churn runner: live reconfigurations while sessions come and go.
// Keep-alive HTTP sessions that nginx closes after a few requests (wrk opens
// new ones), byte-checked bulk sessions both ways that end and start again,
// and short connections (connect, request, close) run through the client's
// policy chains while the client, as left anchor, reconfigures them round
// after round (`dysco reconfig`). It counts what must never happen under
// churn: connections reset, transfers with bytes missing or wrong, and
// reconfigurations that stall. The experiment "churn" (internal/experiment),
// the benchmark "churn" of `make bench` and the end-to-end test
// TestReconfigureUnderChurn run it.
//
// What a session's fate was comes from the kernel, not from the agents: a
// poller lists the client's TCP sockets (sock_diag) every 50 ms, so that
// each result can be set against whether its session was still open when
// the round returned.

import (
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/dysco/dysco/internal/api"
	"github.com/dysco/dysco/internal/lab"
	"github.com/dysco/dysco/internal/labkit"
)

// Ports of the churn workloads besides nginx's (httpPort).
const (
	churnStreamPort = 9600
	churnShortPort  = 9601
)

// churnPoll is the interval of the socket poller.
const churnPoll = 50 * time.Millisecond

// ChurnSpec says what RunChurn runs.
type ChurnSpec struct {
	// Lab is a star lab with hosts "client" and "server" and the hosts of
	// Middleboxes, each with an agent. RunChurn installs the client's
	// policies and starts the servers.
	Lab *lab.Lab
	// Dysco is the dysco binary for the CLI.
	Dysco string
	// Middleboxes are the hosts that rounds put in chains.
	Middleboxes []string
	// IPv4 and IPv6 select the sessions' address families; with both,
	// the workloads of the two families run side by side.
	IPv4, IPv6 bool
	// HTTPChain, StreamChain and ShortChain are the chains (host names)
	// of the client's policies for each workload; an empty chain makes
	// Dysco sessions with no middlebox.
	HTTPChain, StreamChain, ShortChain []string

	// nginx on the server serves a file of FileSize bytes and closes each
	// keep-alive connection after Keepalive requests; per family, wrk
	// -tWrkThreads -cWrkConns --timeout 4s asks for it from the client.
	Keepalive, FileSize, WrkThreads, WrkConns int
	// Streams is the number of byte-checked bulk sessions per family at
	// any time: each sends both ways at StreamRate bytes/s per direction
	// for a random time up to StreamLife, then the client half-closes,
	// the server goes on sending a little, then closes too, and the
	// worker opens the next one. 0: none.
	Streams    int
	StreamRate int64
	StreamLife time.Duration
	// Shorts is the number of workers per family that connect, send a
	// request, read the response (1–60 KB, checked) and close, ShortGap
	// apart. 0: none.
	Shorts   int
	ShortGap time.Duration

	// The first round starts Start after the workload; each next one
	// Interval after the previous returned (follow-ups at once). No round
	// starts after Duration (0: no limit) or after MaxRounds rounds (0:
	// no limit); one of the two must be set.
	Start, Interval time.Duration
	Duration        time.Duration
	MaxRounds       int
	// Alternate, if set, makes the rounds those of IssueChurnSpec:
	// every round matches the HTTP sessions (`tcp dst port 80`) and
	// replaces whatever is between the client and the server by the next
	// host of Alternate, in turn. It needs a single address family.
	// Otherwise rounds are random (Seed): a family, a workload (or all),
	// and a chain among the middleboxes and the empty chain, some of them
	// the current path of the sessions.
	Alternate []string
	Seed      uint64
	// FollowUps is the fraction of random rounds that start as soon as
	// the previous one returned, on the same sessions.
	FollowUps float64
	// SlowAfter: a result that took longer than this is a stuck phase,
	// unless it is "session ended" for a session that did end (default
	// 1 s; ClassSlow names it so).
	SlowAfter time.Duration
	// Logf receives progress lines; nil for none.
	Logf func(format string, args ...any)
}

// IssueChurnSpec is the workload under which reconfigurations were once
// seen to reset connections and stall: a star lab client, mb1, mb2, server;
// nginx closing keep-alive connections after 200 requests of a 64 KiB file;
// `wrk -t2 -c50 --timeout 4s` from the client; the client's policy chains
// `tcp dst port 80` through mb1; from 1 s on, every 0.5 s, `dysco reconfig
// --match 'tcp dst port 80' --to SERVER --chain MB2`, then MB1, and so on,
// for 7 s (wrk ran with -d8s). The lab must have mb1 and mb2.
func IssueChurnSpec(l *lab.Lab, dysco string, v6 bool) ChurnSpec {
	return ChurnSpec{Lab: l, Dysco: dysco, Middleboxes: []string{"mb1", "mb2"}, IPv4: !v6, IPv6: v6,
		HTTPChain: []string{"mb1"}, Keepalive: 200, FileSize: 64 << 10, WrkThreads: 2, WrkConns: 50,
		Start: time.Second, Interval: 500 * time.Millisecond, Duration: 7 * time.Second,
		Alternate: []string{"mb2", "mb1"}, SlowAfter: time.Second}
}

// ChurnResult is what a churn run saw.
type ChurnResult struct {
	Families []string `json:"families"`
	// Seconds is how long the workload ran until the checks.
	Seconds float64     `json:"workload_s"`
	Wrk     []*ChurnWrk `json:"wrk"`
	Streams *ChurnFlows `json:"streams,omitempty"`
	Shorts  *ChurnFlows `json:"short_connections,omitempty"`
	// KernelResets are the kernel's counts of resets over the workload,
	// until before it stopped: "HOST Counter" → delta (TcpEstabResets on
	// the client and the server, TcpOutRsts on the middleboxes).
	KernelResets map[string]uint64 `json:"kernel_resets"`
	// KernelOutRsts are the RSTs the client and the server sent meanwhile
	// (for information: an end also answers stray segments with RSTs).
	KernelOutRsts map[string]uint64 `json:"kernel_out_rsts"`
	Rounds        []*ChurnRound     `json:"rounds"`
	// Outcomes counts the results by "outcome" or "outcome: reason".
	Outcomes map[string]int `json:"outcomes"`
	// Kinds counts the results by what the round asked of the session.
	Kinds map[string]int `json:"kinds"`
	// Times are the reconfiguration times of the succeeded results.
	Times ChurnTimes `json:"times"`
	// Resets, Failed, Stuck and Unexpected are the problems: connections
	// reset, transfers with bytes missing or wrong, stuck phases, and
	// results that do not fit their session's fate.
	Resets     []string `json:"resets,omitempty"`
	Failed     []string `json:"failed_transfers,omitempty"`
	Stuck      []string `json:"stuck,omitempty"`
	Unexpected []string `json:"unexpected,omitempty"`
	// Leftover are reconfiguration phases still held, after the settle
	// time, for sessions that had ended.
	Leftover []string `json:"leftover,omitempty"`
	// Errors are rounds that could not be run at all.
	Errors []string `json:"errors,omitempty"`
	// AgentCounters are the changes of each agent's datapath counters
	// (`dysco status`) over the workload, the nonzero ones.
	AgentCounters map[string]map[string]uint64 `json:"agent_counters"`
	// SocketPolls is how many times the poller listed the client's
	// sockets, SocketLives the session lives it saw.
	SocketPolls int `json:"socket_polls"`
	SocketLives int `json:"socket_lives"`
}

// ChurnWrk is one wrk's summary.
type ChurnWrk struct {
	Family   string  `json:"family"`
	Requests int64   `json:"requests"`
	RPS      float64 `json:"requests_per_s"`
	Connect  int64   `json:"connect_errors"`
	Read     int64   `json:"read_errors"`
	Write    int64   `json:"write_errors"`
	Timeout  int64   `json:"timeouts"`
	Non2xx   int64   `json:"non_2xx"`
	Output   string  `json:"output"`
}

// SocketErrors is the sum of wrk's socket errors.
func (w *ChurnWrk) SocketErrors() int64 { return w.Connect + w.Read + w.Write + w.Timeout }

// ChurnFlows counts the runner's own sessions of one kind.
type ChurnFlows struct {
	Sessions  int64 `json:"sessions"`
	Completed int64 `json:"completed"`
	BytesUp   int64 `json:"bytes_client_to_server"`
	BytesDown int64 `json:"bytes_server_to_client"`
	Resets    int64 `json:"resets"`
	Failed    int64 `json:"failed"`
}

// ChurnTimes is the distribution of reconfiguration times, in ms.
type ChurnTimes struct {
	N   int     `json:"n"`
	P50 float64 `json:"p50_ms"`
	P90 float64 `json:"p90_ms"`
	P99 float64 `json:"p99_ms"`
	Max float64 `json:"max_ms"`
}

// MarshalJSON writes NaN as null.
func (t ChurnTimes) MarshalJSON() ([]byte, error) {
	return json.Marshal(struct {
		N   int      `json:"n"`
		P50 *float64 `json:"p50_ms"`
		P90 *float64 `json:"p90_ms"`
		P99 *float64 `json:"p99_ms"`
		Max *float64 `json:"max_ms"`
	}{t.N, labkit.JSONNum(t.P50), labkit.JSONNum(t.P90), labkit.JSONNum(t.P99), labkit.JSONNum(t.Max)})
}

// ChurnRound is one `dysco reconfig` at the client.
type ChurnRound struct {
	N        int             `json:"n"`
	At       float64         `json:"at_s"` // since the workload started
	WallMs   float64         `json:"wall_ms"`
	Family   string          `json:"family"`
	Match    string          `json:"match"`
	To       string          `json:"to"`
	Chain    []string        `json:"chain"` // host names
	FollowUp bool            `json:"follow_up,omitempty"`
	Results  []*ChurnOutcome `json:"results"`
	Err      string          `json:"error,omitempty"`
}

// Classes of results that do not fit their session's fate.
const (
	// ClassLiveNotReconfigured: a session still open after the round was
	// not reconfigured (nor refused as the request asked for a middlebox
	// already on its path).
	ClassLiveNotReconfigured = "live session not reconfigured"
	// ClassEndedOtherReason: a session that ended during the round
	// failed with another reason than "session ended".
	ClassEndedOtherReason = "ended session failed with another reason than \"session ended\""
	// ClassClaimedEnded: "session ended" for a session still open.
	ClassClaimedEnded = "\"session ended\" for a session still open"
	// ClassSlow: a result slower than SlowAfter, unless it is "session
	// ended" for a session that did end.
	ClassSlow = "slower than 1 s, and not \"session ended\" of an ended session"
)

// ChurnOutcome is one session's result of a round, with what the round
// asked of it and what became of it.
type ChurnOutcome struct {
	api.ReconfigResult
	// Kind is what the round asked of the session, from the path the
	// runner knows it had: "insert", "delete", "replace", "unchanged"
	// (the chain is its path) or "overlap" (the chain names a middlebox
	// already on its path, and is not that path).
	Kind string `json:"kind"`
	// Path is that path (host names).
	Path []string `json:"path"`
	// Fate is "alive" if the client's socket was open after the round
	// returned, "ended" if it was closed by then, "unseen" if the poller
	// never saw it (a session shorter than a poll).
	Fate string `json:"fate"`
	// Classes are the ways the result does not fit (empty: it fits).
	Classes []string `json:"classes,omitempty"`
}

// ResetCount is the number of connections the applications saw reset:
// wrk's connect, read and write errors and the runner's sessions reset
// (the kernel's counters count some of the same again, from each host).
func (r *ChurnResult) ResetCount() int64 {
	var n int64
	for _, w := range r.Wrk {
		n += w.Connect + w.Read + w.Write
	}
	for _, f := range []*ChurnFlows{r.Streams, r.Shorts} {
		if f != nil {
			n += f.Resets
		}
	}
	return n
}

// KernelResetCount sums the kernel's reset counters (KernelResets).
func (r *ChurnResult) KernelResetCount() uint64 {
	var n uint64
	for _, v := range r.KernelResets {
		n += v
	}
	return n
}

// Problems lists what makes the run fail: resets, failed transfers, stuck
// phases, results that do not fit their session's fate, rounds that could
// not run.
func (r *ChurnResult) Problems() []string {
	var p []string
	list := func(what string, xs []string) {
		if len(xs) > 0 {
			p = append(p, fmt.Sprintf("%d %s (first: %s)", len(xs), what, strings.Join(labkit.FirstN(xs, 3), "; ")))
		}
	}
	if len(r.Resets) > 0 {
		p = append(p, fmt.Sprintf("connections reset: %d seen by the applications, the kernels' counters went up by %d (first: %s)",
			r.ResetCount(), r.KernelResetCount(), strings.Join(labkit.FirstN(r.Resets, 3), "; ")))
	}
	list("failed transfers", r.Failed)
	list("stuck phases", r.Stuck)
	list("results that do not fit their session's fate", r.Unexpected)
	list("rounds that could not run", r.Errors)
	return p
}

// ClassCount counts the results of a class.
func (r *ChurnResult) ClassCount(class string) int {
	n := 0
	for _, rd := range r.Rounds {
		for _, o := range rd.Results {
			if slices.Contains(o.Classes, class) {
				n++
			}
		}
	}
	return n
}
