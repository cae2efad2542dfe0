package protocol

import (
	"fmt"
	"net/netip"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/dysco/dysco/internal/wire"
)

// harness runs agents over a perfect in-order network with a fake
// datapath, one message at a time, so that tests can interleave steps.
type harness struct {
	t      *testing.T
	now    time.Duration
	key    *Keys
	agents map[netip.Addr]*Agent
	order  []netip.Addr
	queue  []envelope
	timers map[timerKey]time.Duration
	dead   map[netip.Addr]bool

	results  []Result
	rejected []Rejected
	// triggers: what the agents reported of the triggers they sent, and
	// of those they took
	trigResults  []TriggerResult
	trigAccepted map[netip.Addr][]TriggerAccepted
	log          []string
	// datapath view per agent
	adds   map[netip.Addr][]AddSubsession
	joins  map[netip.Addr][]JoinSession
	starts map[netip.Addr][]StartTwoPath
	ends   map[netip.Addr][]EndTwoPath
	frees  map[netip.Addr][]SessionID
	clamps map[netip.Addr][]SetWindowClamp
	ready  map[netip.Addr][]NewPathReady
	// the lock each middle agent asked to keep (KeepLock)
	locks map[netip.Addr]ReqKey
	// vars reported when a side starts its two-path phase
	vars func(at netip.Addr, side Side) TwoPath
	// hold back two-path reports (to test the FIN exchange by hand)
	holdVars bool
	// messages sent, per agent and type
	sent map[netip.Addr]map[MsgType]int
	// state migration: what the agents' shells did (the harness answers
	// at once: holds taken, drained, state exported as "state of <addr>",
	// imported), and the migrations' ends
	migLog  map[netip.Addr][]string
	migDone map[netip.Addr][]MigrationDone
	// migFail makes the harness fail a step at an agent: "hold",
	// "export", "import"
	migFail map[netip.Addr]string
	// probe, if set, sees every message before it is delivered
	// (binding_test.go).
	probe func(envelope)
	// holdLimit is the limit of the last Hold.
	holdLimit uint64
	// nfStarts: the network functions each agent was asked to start
	// (tests answer with NFStarted).
	nfStarts map[netip.Addr][]StartNF
	progress []Progress
	// alias maps an agent's other addresses to its own (a multihomed
	// host: messages to them reach it).
	alias map[netip.Addr]netip.Addr
	// rebinds: the rebinds' ends; moves: the subsession moves, per agent
	rebinds []RebindResult
	moves   map[netip.Addr][]MoveSubsession
}

type envelope struct {
	from, to netip.Addr
	data     []byte
	msg      *Message
}

type timerKey struct {
	agent netip.Addr
	id    TimerID
}

func addr(i int) netip.Addr { return netip.AddrFrom4([4]byte{10, 0, 0, byte(i)}) }

var testKey = NewKeys([]byte("deployment key for tests"))

// testFrom is the sender of the messages that tests encode without
// delivering them from an agent.
var testFrom = addr(1)

var testNonce = [wire.NonceLen]byte{1, 2, 3, 4, 5, 6, 7, 8}

var sessionTuple = wire.Tuple{Src: addr(1), Dst: addr(9), SrcPort: 33000, DstPort: 80}

const sid SessionID = 7

func newHarness(t *testing.T, n int) *harness {
	h := &harness{t: t, key: testKey, agents: map[netip.Addr]*Agent{}, timers: map[timerKey]time.Duration{},
		dead: map[netip.Addr]bool{}, adds: map[netip.Addr][]AddSubsession{}, joins: map[netip.Addr][]JoinSession{},
		starts: map[netip.Addr][]StartTwoPath{}, ends: map[netip.Addr][]EndTwoPath{}, frees: map[netip.Addr][]SessionID{},
		clamps: map[netip.Addr][]SetWindowClamp{}, ready: map[netip.Addr][]NewPathReady{},
		migLog: map[netip.Addr][]string{}, migDone: map[netip.Addr][]MigrationDone{}, migFail: map[netip.Addr]string{},
		nfStarts: map[netip.Addr][]StartNF{}, moves: map[netip.Addr][]MoveSubsession{},
		locks: map[netip.Addr]ReqKey{}, sent: map[netip.Addr]map[MsgType]int{}, trigAccepted: map[netip.Addr][]TriggerAccepted{}}
	h.vars = func(netip.Addr, Side) TwoPath {
		return TwoPath{OldSent: 1000, OldSentAcked: 1000, OldRcvd: 5000, OldRcvdAcked: 5000, NewRcvd: true, FirstNewRcvd: 5000}
	}
	for i := 1; i <= n; i++ {
		cfg := DefaultConfig(addr(i), testKey)
		h.agents[addr(i)] = New(cfg)
		h.order = append(h.order, addr(i))
	}
	return h
}

// chain sets up a session through agents from..to (inclusive) with the
// given middlebox deltas (index = agent number).
func (h *harness) chain(ids []int, app map[int]AppDelta) {
	for i, id := range ids {
		up := SessionUp{Session: sid, Tuple: sessionTuple, Nonce: testNonce, App: app[id]}
		if i > 0 {
			up.Left = &SideInfo{Peer: addr(ids[i-1]), Sub: subTuple(ids[i-1], id)}
		}
		if i < len(ids)-1 {
			up.Right = &SideInfo{Peer: addr(ids[i+1]), Sub: subTuple(id, ids[i+1])}
		}
		h.deliver(addr(id), up)
	}
}

func subTuple(a, b int) wire.Tuple {
	return wire.Tuple{Src: addr(a), Dst: addr(b), SrcPort: uint16(1000 + a), DstPort: uint16(2000 + b)}
}

func (h *harness) deliver(at netip.Addr, ev Event) {
	for _, act := range h.agents[at].Handle(h.now, ev) {
		h.apply(at, act)
	}
}

func (h *harness) apply(at netip.Addr, act Action) {
	switch x := act.(type) {
	case Send:
		h.log = append(h.log, fmt.Sprintf("%s -> %s %s", at, x.To, x.Msg))
		if h.sent[at] == nil {
			h.sent[at] = map[MsgType]int{}
		}
		h.sent[at][x.Msg.Type]++
		if !h.dead[x.To] && !h.dead[at] {
			from := at // the agent's own address, unless the message names another (Send.From)
			if x.From.IsValid() {
				from = x.From
			}
			h.queue = append(h.queue, envelope{from: from, to: x.To, data: x.Data, msg: x.Msg})
		}
	case SetTimer:
		h.timers[timerKey{at, x.ID}] = x.At
	case CancelTimer:
		delete(h.timers, timerKey{at, x.ID})
	case Result:
		h.log = append(h.log, fmt.Sprintf("%s result %s %s %s blocker=%s", at, x.Req, x.Outcome, x.Reason, x.Blocker))
		h.results = append(h.results, x)
	case Rejected:
		h.log = append(h.log, fmt.Sprintf("%s rejected %s %s: %s", at, x.Type, x.Reason, x.Detail))
		h.rejected = append(h.rejected, x)
	case TriggerAccepted:
		h.log = append(h.log, fmt.Sprintf("%s took trigger %s as token %d", at, x.Trigger, x.Token))
		h.trigAccepted[at] = append(h.trigAccepted[at], x)
	case TriggerResult:
		h.log = append(h.log, fmt.Sprintf("%s trigger result %s answered=%v %s %s req=%s", at, x.Trigger, x.Answered, x.Outcome, x.Reason, x.Req))
		h.trigResults = append(h.trigResults, x)
	case AddSubsession:
		h.adds[at] = append(h.adds[at], x)
	case JoinSession:
		h.joins[at] = append(h.joins[at], x)
	case StartTwoPath:
		h.starts[at] = append(h.starts[at], x)
		if !h.holdVars {
			h.deliver(at, TwoPathProgress{Session: x.Session, Side: x.Side, Vars: h.vars(at, x.Side)})
		}
	case EndTwoPath:
		h.ends[at] = append(h.ends[at], x)
	case FreeSession:
		h.frees[at] = append(h.frees[at], x.Session)
	case KeepLock:
		h.locks[at] = x.Req
	case SetWindowClamp:
		h.clamps[at] = append(h.clamps[at], x)
	case Hold:
		h.migLog[at] = append(h.migLog[at], fmt.Sprintf("hold %s", x.Side))
		h.holdLimit = x.Limit
		if h.migFail[at] == "hold" {
			h.deliver(at, Held{Session: x.Session, Side: x.Side, Req: x.Req, Err: "cannot hold"})
		} else {
			h.deliver(at, Held{Session: x.Session, Side: x.Side, Req: x.Req, Marks: FlowMarks{Seq: 1, Ack: 1, OK: true}})
		}
	case ReleaseHold:
		h.migLog[at] = append(h.migLog[at], fmt.Sprintf("release %s", x.Side))
	case WaitDrained:
		h.migLog[at] = append(h.migLog[at], fmt.Sprintf("drain %s %s", x.Side, x.Semantics))
		h.deliver(at, Drained{Session: x.Session, Side: x.Side, Req: x.Req, OK: true})
	case ExportState:
		h.migLog[at] = append(h.migLog[at], "export")
		if h.migFail[at] == "export" {
			h.deliver(at, StateExported{Session: x.Session, Req: x.Req, Err: "cannot export"})
		} else {
			h.deliver(at, StateExported{Session: x.Session, Req: x.Req, Blob: []byte("state of " + at.String())})
		}
	case ImportState:
		h.migLog[at] = append(h.migLog[at], "import "+string(x.Blob))
		if h.migFail[at] == "import" {
			h.deliver(at, StateImported{Session: x.Session, Req: x.Req, Tuple: x.Tuple, Err: "cannot import"})
		} else {
			h.deliver(at, StateImported{Session: x.Session, Req: x.Req, Tuple: x.Tuple})
		}
	case ReleaseState:
		h.migLog[at] = append(h.migLog[at], "release state")
	case MigrationDone:
		h.log = append(h.log, fmt.Sprintf("%s migration done %s err=%q", at, x.Req, x.Err))
		h.migDone[at] = append(h.migDone[at], x)
	case NewPathReady:
		h.log = append(h.log, fmt.Sprintf("%s new path ready %s", at, x.Req))
		h.ready[at] = append(h.ready[at], x)
	case Progress:
		h.log = append(h.log, fmt.Sprintf("%s %s %s %s %s", at, x.Req, x.Role, x.Stage, x.Note))
		h.progress = append(h.progress, x)
	case MoveSubsession:
		h.log = append(h.log, fmt.Sprintf("%s move %s side, step %d: %s => %s", at, x.Side, x.Step, x.Old, x.New))
		h.moves[at] = append(h.moves[at], x)
	case RebindResult:
		h.log = append(h.log, fmt.Sprintf("%s rebind %s %s %s blocker=%s", at, x.Req, x.Outcome, x.Reason, x.Blocker))
		h.rebinds = append(h.rebinds, x)
	case StartNF:
		h.log = append(h.log, fmt.Sprintf("%s start network function %s for %s", at, x.Name, x.Req))
		h.nfStarts[at] = append(h.nfStarts[at], x)
	}
}

// agentAt is the agent at x, one of its own addresses or an alias.
func (h *harness) agentAt(x netip.Addr) *Agent {
	if a, ok := h.alias[x]; ok {
		x = a
	}
	return h.agents[x]
}

// step delivers the next message; false when none is queued.
func (h *harness) step() bool {
	if len(h.queue) == 0 {
		return false
	}
	e := h.queue[0]
	h.queue = h.queue[1:]
	if h.probe != nil {
		h.probe(e)
	}
	to := e.to
	if a, ok := h.alias[to]; ok {
		to = a
	}
	h.deliver(to, h.messageIn(e))
	return true
}

// messageIn is what the agent makes of a datagram: a new path's SYN for a
// session the receiver holds on a live path already is marked OnPath, as
// the agent does from its datapath (one state per session tuple).
func (h *harness) messageIn(e envelope) MessageIn {
	in := MessageIn{From: e.from, Data: e.data}
	if e.msg.Type != MsgSyn || e.msg.RightAnchor == e.to {
		return in
	}
	a := h.agents[e.to]
	if _, _, known := a.Lookup(e.msg.Sub); known {
		return in
	}
	for _, id := range a.Sessions() {
		if v, _ := a.View(id); v.Tuple == e.msg.Session && a.OnLivePath(id) {
			in.OnPath = true
		}
	}
	return in
}

// stepType delivers the first queued message of type t (out of order).
func (h *harness) stepType(t MsgType, to netip.Addr) {
	for i, e := range h.queue {
		if e.msg.Type == t && e.to == to {
			h.queue = append(h.queue[:i:i], h.queue[i+1:]...)
			h.deliver(e.to, h.messageIn(e))
			return
		}
	}
	h.t.Fatalf("no %s queued for %s\n%s", t, to, h.trace())
}

// take removes the first queued message of type t to to, if any.
func (h *harness) take(t MsgType, to netip.Addr) (envelope, bool) {
	for i, e := range h.queue {
		if e.msg.Type == t && e.to == to {
			h.queue = append(h.queue[:i:i], h.queue[i+1:]...)
			h.log = append(h.log, "lost: "+e.msg.String())
			return e, true
		}
	}
	return envelope{}, false
}

// dropType loses the first queued message of type t to to.
func (h *harness) dropType(t MsgType, to netip.Addr) {
	for i, e := range h.queue {
		if e.msg.Type == t && e.to == to {
			h.queue = append(h.queue[:i:i], h.queue[i+1:]...)
			h.log = append(h.log, "lost: "+e.msg.String())
			return
		}
	}
	h.t.Fatalf("no %s queued for %s\n%s", t, to, h.trace())
}

// run delivers messages and fires timers until nothing is left.
func (h *harness) run() {
	for i := 0; i < 100000; i++ {
		if h.step() {
			continue
		}
		if !h.fireNext() {
			return
		}
	}
	h.t.Fatalf("no quiescence\n%s", h.trace())
}

// runMessages delivers messages only (no timers).
func (h *harness) runMessages() {
	for h.step() {
	}
}

func (h *harness) fireNext() bool {
	if len(h.timers) == 0 {
		return false
	}
	keys := make([]timerKey, 0, len(h.timers))
	for k := range h.timers {
		keys = append(keys, k)
	}
	sort.Slice(keys, func(i, j int) bool {
		a, b := h.timers[keys[i]], h.timers[keys[j]]
		if a != b {
			return a < b
		}
		return keys[i].id.String()+keys[i].agent.String() < keys[j].id.String()+keys[j].agent.String()
	})
	k := keys[0]
	if at := h.timers[k]; at > h.now {
		h.now = at
	}
	delete(h.timers, k)
	h.deliver(k.agent, TimerFired{ID: k.id})
	return true
}

func (h *harness) reconfigure(at int, ra int, chain []int, token uint64) {
	var c []netip.Addr
	for _, x := range chain {
		c = append(c, addr(x))
	}
	h.deliver(addr(at), Reconfigure{Session: sid, RightAnchor: addr(ra), Chain: c, Token: token})
}

func (h *harness) result(token uint64) Result {
	for _, r := range h.results {
		if r.Token == token {
			return r
		}
	}
	h.t.Fatalf("no result for token %d\n%s", token, h.trace())
	return Result{}
}

func (h *harness) hasResult(token uint64) bool {
	for _, r := range h.results {
		if r.Token == token {
			return true
		}
	}
	return false
}

func (h *harness) hasRebindResult(token uint64) bool {
	for _, r := range h.rebinds {
		if r.Token == token {
			return true
		}
	}
	return false
}

func (h *harness) rebindResult(token uint64) RebindResult {
	for _, r := range h.rebinds {
		if r.Token == token {
			return r
		}
	}
	h.t.Fatalf("no rebind result for token %d\n%s", token, h.trace())
	return RebindResult{}
}

func (h *harness) trace() string { return strings.Join(h.log, "\n") }

// view returns agent i's view of the session (or of the only joined one).
func (h *harness) view(i int) (SessionView, bool) {
	return h.agents[addr(i)].View(sid)
}

// queued reports whether a message of type t is queued.
func (h *harness) queued(t MsgType) bool {
	for _, e := range h.queue {
		if e.msg.Type == t {
			return true
		}
	}
	return false
}
