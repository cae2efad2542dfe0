package reconfig

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/netip"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/dysco/dysco/internal/api"
	"github.com/dysco/dysco/internal/datapath"
	"github.com/dysco/dysco/internal/keys"
	"github.com/dysco/dysco/internal/protocol"
	"github.com/dysco/dysco/internal/testutil"
	"github.com/dysco/dysco/internal/wire"
)

var _ Datapath = (*fakeDP)(nil)

// The shells of these tests run against fake datapaths (fake_test.go) and
// a network in memory; no root, no packets. Each host's agent is a Shell
// with the agent's own configuration but shorter timers.

var testKey = protocol.NewKeys([]byte("0123456789abcdef0123456789abcdef"))

type host struct {
	name string
	addr netip.Addr
	dp   *fakeDP
	sh   *Shell
	stop context.CancelFunc
	done chan struct{}
	logs *logBuf
	// holder and states, if set, are the host's fake packet holds and
	// state plug-ins (migration tests).
	holder *fakeHolder
	states *fakeStates
	// nfs, if set, starts the host's network functions (nf_test.go).
	nfs NFManager
}

// logBuf keeps a shell's log for a failing test.
type logBuf struct {
	mu sync.Mutex
	b  strings.Builder
}

func (l *logBuf) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *logBuf) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

type lab struct {
	t     *testing.T
	net   *fakeNet
	hosts map[string]*host
	order []*host
	// tune, if set, changes the protocol's configuration after the
	// tests' shorter timers.
	tune func(*protocol.Config)
}

// newLab starts a shell for each name, at 10.0.0.1, 10.0.0.2, ... in
// order.
func newLab(t *testing.T, names ...string) *lab {
	t.Helper()
	return newTunedLab(t, nil, names...)
}

// newTunedLab is newLab with the protocol's configuration changed by tune.
func newTunedLab(t *testing.T, tune func(*protocol.Config), names ...string) *lab {
	t.Helper()
	l := &lab{t: t, net: newFakeNet(), hosts: map[string]*host{}, tune: tune}
	for i, n := range names {
		h := &host{name: n, addr: netip.AddrFrom4([4]byte{10, 0, 0, byte(i + 1)}), dp: newFakeDP()}
		l.hosts[n], l.order = h, append(l.order, h)
		l.start(h)
	}
	t.Cleanup(func() {
		for _, h := range l.order {
			l.stopHost(h)
		}
		if t.Failed() {
			for _, h := range l.order {
				t.Logf("--- %s (%s) log:\n%s", h.name, h.addr, h.logs)
			}
		}
	})
	return l
}

// start runs a shell on h's datapath (again, after stopHost: an agent
// restarted).
func (l *lab) start(h *host) {
	l.t.Helper()
	if h.logs == nil {
		h.logs = &logBuf{}
	}
	self := h.addr
	sh, err := New(Config{Port: DefaultControlPort, Keys: testKey, Datapath: h.dp, Conn: l.net.conn(h.addr), NFs: h.nfs,
		Log:      slog.New(slog.NewTextHandler(io.MultiWriter(h.logs), &slog.HandlerOptions{Level: slog.LevelDebug})).With("host", h.name),
		SelfAddr: func(v6 bool) netip.Addr { return map[bool]netip.Addr{false: self}[v6] },
		Tune: func(c *protocol.Config) {
			c.RTO, c.MaxRTO, c.MaxTries = 10*time.Millisecond, 40*time.Millisecond, 8
			c.Linger = 100 * time.Millisecond
			c.LockLease = 2 * time.Second
			if l.tune != nil {
				l.tune(c)
			}
		}})
	if err != nil {
		l.t.Fatal(err)
	}
	if h.holder != nil {
		sh.holder = h.holder
	}
	if h.states != nil {
		sh.states = h.states
	}
	ctx, cancel := context.WithCancel(context.Background())
	h.sh, h.stop, h.done = sh, cancel, make(chan struct{})
	go func(done chan struct{}) {
		sh.Run(ctx)
		close(done)
	}(h.done)
}

// stopHost stops h's shell and waits until it has.
func (l *lab) stopHost(h *host) {
	if h.stop == nil {
		return
	}
	h.stop()
	<-h.done
	h.stop = nil
}

// session names one TCP session along a chain of hosts: its tuple as the
// applications see it, and its id at each host.
type session struct {
	t   wire.Tuple
	ids map[string]uint32
}

var nextPort uint16 = 40000

// chain sets a session from the first host to the last up through the
// ones between, as the datapath's SYN set-up leaves it: one subsession per
// hop.
func (l *lab) chain(names ...string) session {
	l.t.Helper()
	nextPort++
	first, last := l.hosts[names[0]], l.hosts[names[len(names)-1]]
	t := wire.Tuple{Src: first.addr, Dst: last.addr, SrcPort: nextPort, DstPort: 80}
	var nonce [wire.NonceLen]byte
	copy(nonce[:], fmt.Sprintf("n%05d", nextPort))
	isn := [2]uint32{1000 * uint32(nextPort), 7000 * uint32(nextPort)}
	subs := make([]wire.Tuple, len(names)-1)
	for i := range subs {
		a, b := l.hosts[names[i]], l.hosts[names[i+1]]
		subs[i] = wire.Tuple{Src: a.addr, Dst: b.addr, SrcPort: 20000 + nextPort, DstPort: 30000 + uint16(i)}
		if i == len(subs)-1 {
			subs[i].DstPort = t.DstPort
		}
		if i == 0 {
			subs[i].SrcPort = t.SrcPort
		}
	}
	s := session{t: t, ids: map[string]uint32{}}
	for i, n := range names {
		var left, right wire.Tuple
		role := datapath.RoleMiddle
		switch i {
		case 0:
			role, right = datapath.RoleStart, subs[0]
		case len(names) - 1:
			role, left = datapath.RoleEnd, subs[i-1]
		default:
			left, right = subs[i-1], subs[i]
		}
		s.ids[n] = l.hosts[n].dp.addChainSession(t, left, right, uint8(role), nonce, isn)
	}
	return s
}

// reconfigure runs a reconfiguration at host from (the left anchor) of
// session s, to the right anchor to through chain.
func (l *lab) reconfigure(from string, s session, to string, chain ...string) Outcome {
	l.t.Helper()
	var hops []netip.Addr
	for _, c := range chain {
		hops = append(hops, l.hosts[c].addr)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	out := l.hosts[from].sh.Reconfigure(ctx, []uint32{s.ids[from]}, l.hosts[to].addr, hops, nil)
	if len(out) != 1 {
		l.t.Fatalf("%d outcomes", len(out))
	}
	return out[0]
}

func outcome(o Outcome) string {
	if o.Result == nil {
		return o.Outcome + ": " + o.Reason
	}
	return o.Result.Outcome.String() + ": " + o.Result.Reason.String()
}

func succeeded(t *testing.T, o Outcome) {
	t.Helper()
	if o.Result == nil || o.Result.Outcome != protocol.Succeeded {
		t.Fatalf("reconfiguration: %s, want succeeded", outcome(o))
	}
}

// rightOut is where host h sends session id to the right now.
func rightOut(h *host, id uint32) wire.Tuple {
	s, _ := h.dp.Session(id)
	if tp, ok := h.dp.TwoPath(datapath.TPKey{SessId: id, Side: 1}); ok && tp.State == datapath.TPNew {
		return tp.NewOut.Wire()
	}
	f, _ := h.dp.Flow(datapath.TupleFrom(s.Tuple.Wire()))
	return f.Out.Wire()
}

// settled waits until no reconfiguration state is left at any host: no
// lock, no request record, no two-path record that has not ended.
func (l *lab) settled() {
	l.t.Helper()
	var left string
	for end := time.Now().Add(10 * time.Second); ; time.Sleep(5 * time.Millisecond) {
		left = ""
		for _, h := range l.order {
			h.dp.mu.Lock()
			for id, lk := range h.dp.locks {
				left += fmt.Sprintf("%s: session %d locked by %s#%d; ", h.name, id, addrFrom16(lk.la), lk.req)
			}
			for k := range h.dp.reqs {
				left += fmt.Sprintf("%s: request record of %d/%d; ", h.name, k.SessId, k.Side)
			}
			for k, tp := range h.dp.tps {
				if tp.State != datapath.TPNew {
					left += fmt.Sprintf("%s: two-path record of %d/%d in state %d; ", h.name, k.SessId, k.Side, tp.State)
				}
			}
			h.dp.mu.Unlock()
		}
		if left == "" {
			return
		}
		if time.Now().After(end) {
			l.t.Fatalf("the hosts did not settle: %s", left)
		}
	}
}

// A middlebox deleted from a chain (§3.1 with an empty new chain): the
// anchors switch to a direct subsession, and the middlebox's agent frees
// the session once the old path is torn down (§3.5).
func TestShellDeleteMiddlebox(t *testing.T) {
	l := newLab(t, "a", "m", "b")
	s := l.chain("a", "m", "b")
	succeeded(t, l.reconfigure("a", s, "b"))
	a, b, m := l.hosts["a"], l.hosts["b"], l.hosts["m"]
	if out := rightOut(a, s.ids["a"]); out.Dst != b.addr {
		t.Fatalf("a sends the session to %s, want b (%s)", out, b.addr)
	}
	testutil.Eventually(t, 5*time.Second, "m to free the session", func() bool { n, _, _, _ := m.dp.counts(); return n == 0 })
	l.settled()
	if v, ok := a.sh.Views()[s.ids["a"]]; !ok || v.Teardown {
		t.Errorf("a's view of the session: %+v, %v", v, ok)
	}
}

// A middlebox inserted (§3.1): its agent joins the new path with a session
// of its own, and both anchors end up sending through it.
func TestShellInsertMiddlebox(t *testing.T) {
	l := newLab(t, "a", "b", "m")
	s := l.chain("a", "b")
	succeeded(t, l.reconfigure("a", s, "b", "m"))
	a, b, m := l.hosts["a"], l.hosts["b"], l.hosts["m"]
	if out := rightOut(a, s.ids["a"]); out.Dst != m.addr {
		t.Fatalf("a sends the session to %s, want m (%s)", out, m.addr)
	}
	if n, _, _, _ := m.dp.counts(); n != 1 {
		t.Fatalf("m holds %d sessions, want the joined one", n)
	}
	tp, ok := b.dp.TwoPath(datapath.TPKey{SessId: s.ids["b"], Side: 0})
	if !ok || tp.NewOut.Wire().Src != b.addr || tp.NewOut.Wire().Dst != m.addr {
		t.Fatalf("b's left side: %+v %v, want a new subsession to m", tp.NewOut.Wire(), ok)
	}
	l.settled()
	// And out again: the joined session is a middle like any other.
	succeeded(t, l.reconfigure("a", s, "b"))
	testutil.Eventually(t, 5*time.Second, "m to free the joined session", func() bool { n, _, _, _ := m.dp.counts(); return n == 0 })
	l.settled()
}

// Two left anchors contend for overlapping segments (§3.2): a deletes both
// middleboxes while m1 deletes m2. One gets the locks; the other is
// refused, or runs after it; nothing is left locked.
func TestShellLockContention(t *testing.T) {
	l := newLab(t, "a", "m1", "m2", "b")
	s := l.chain("a", "m1", "m2", "b")
	var wg sync.WaitGroup
	var oa, om Outcome
	wg.Add(2)
	go func() { defer wg.Done(); oa = l.reconfigure("a", s, "b") }()
	go func() { defer wg.Done(); om = l.reconfigure("m1", s, "b") }()
	wg.Wait()
	won := 0
	for _, o := range []Outcome{oa, om} {
		if o.Result == nil {
			t.Fatalf("no result: %s", outcome(o))
		}
		switch o.Result.Outcome {
		case protocol.Succeeded:
			won++
		case protocol.Refused, protocol.Failed:
		default:
			t.Fatalf("outcome %s", outcome(o))
		}
	}
	if won == 0 {
		t.Fatalf("neither request succeeded: a %s, m1 %s", outcome(oa), outcome(om))
	}
	t.Logf("a: %s; m1: %s", outcome(oa), outcome(om))
	l.settled()
	// Whatever happened, a request now finds the session free.
	succeeded(t, l.reconfigure("a", s, "b", "m2"))
	l.settled()
}

// A new path through a host that never answers (§3.6): the left anchor
// gives up, cancels, and the old path goes on carrying the session; the
// locks on it are released.
func TestShellDeadHopCancelled(t *testing.T) {
	l := newLab(t, "a", "m", "b", "dead")
	dead := l.hosts["dead"]
	l.net.setDrop(func(from, to netip.Addr, _ []byte) bool { return to == dead.addr || from == dead.addr })
	s := l.chain("a", "m", "b")
	o := l.reconfigure("a", s, "b", "dead")
	if o.Result == nil || o.Result.Outcome == protocol.Succeeded {
		t.Fatalf("through a dead hop: %s, want failed", outcome(o))
	}
	t.Logf("through a dead hop: %s", outcome(o))
	a, m := l.hosts["a"], l.hosts["m"]
	if out := rightOut(a, s.ids["a"]); out.Dst != m.addr {
		t.Fatalf("a sends the session to %s, want m still", out)
	}
	l.settled()
	l.net.setDrop(nil)
	succeeded(t, l.reconfigure("a", s, "b"))
}

// An agent restarted in the middle of a reconfiguration (§3.2, a lock kept
// in the datapath): the right anchor's agent stops after it installed its
// new subsession; a new agent on the same datapath resumes the request
// from what the datapath kept, and the reconfiguration completes.
func TestShellResumeAfterRestart(t *testing.T) {
	l := newLab(t, "a", "m", "b")
	s := l.chain("a", "m", "b")
	b := l.hosts["b"]
	// Nothing b sends arrives until it has restarted.
	var cut sync.Mutex
	blocked := true
	l.net.setDrop(func(from, _ netip.Addr, _ []byte) bool {
		cut.Lock()
		defer cut.Unlock()
		return blocked && from == b.addr
	})
	res := make(chan Outcome, 1)
	go func() { res <- l.reconfigure("a", s, "b") }()
	testutil.Eventually(t, 5*time.Second, "b to install the new subsession", func() bool {
		_, ok := b.dp.TPReqOf(datapath.TPKey{SessId: s.ids["b"], Side: 0})
		return ok
	})
	l.stopHost(b)
	cut.Lock()
	blocked = false
	cut.Unlock()
	l.start(b)
	succeeded(t, <-res)
	if !strings.Contains(b.logs.String(), "resumed a reconfiguration of an earlier agent") {
		t.Errorf("b's new agent did not resume the request")
	}
	l.settled()
}

// A replayed requestLock of a session that ended here is refused and not
// answered; a fresh one is answered at once, "session ended".
func TestShellEndedSession(t *testing.T) {
	l := newLab(t, "a", "m", "b")
	s := l.chain("a", "m", "b")
	m := l.hosts["m"]
	var mu sync.Mutex
	var fromM []protocol.MsgType
	l.net.setDrop(func(from, _ netip.Addr, data []byte) bool {
		if from == m.addr {
			if msg, err := protocol.Decode(testKey, from, data); err == nil {
				mu.Lock()
				fromM = append(fromM, msg.Type)
				mu.Unlock()
			}
		}
		return false
	})
	m.sh.SessionsEnded([]uint32{s.ids["m"]})
	if _, err := m.dp.FreeSession(s.ids["m"], datapath.Tuple{}); err != nil {
		t.Fatal(err)
	}
	o := l.reconfigure("a", s, "b")
	if o.Result == nil || o.Result.Reason != protocol.ReasonSessionEnded {
		t.Fatalf("reconfiguration of a session ended at m: %s, want session ended", outcome(o))
	}
	mu.Lock()
	n := len(fromM)
	mu.Unlock()
	if n != 1 || fromM[0] != protocol.MsgNackLock {
		t.Fatalf("m sent %v, want one nackLock", fromM)
	}
}

// A proxy removes itself (§2.4): its agent joins the client's session and
// its own to the server into one, and triggers the client's agent, which
// replaces the segment through the proxy by a direct path to the server.
// The proxy's sockets are then cut off.
func TestShellSplice(t *testing.T) {
	l := newLab(t, "a", "p", "b")
	in := l.chain("a", "p")  // the client's connection to the proxy
	out := l.chain("p", "b") // the proxy's own to the server
	a, p, b := l.hosts["a"], l.hosts["p"], l.hosts["b"]
	req := api.SpliceRequest{
		In:  api.SocketPair{Local: netip.AddrPortFrom(in.t.Dst, in.t.DstPort), Remote: netip.AddrPortFrom(in.t.Src, in.t.SrcPort)},
		Out: api.SocketPair{Local: netip.AddrPortFrom(out.t.Src, out.t.SrcPort), Remote: netip.AddrPortFrom(out.t.Dst, out.t.DstPort)},
	}
	// Nothing answers the trigger at first: a second splice meanwhile is
	// refused, the first goes on.
	l.net.setDrop(func(from, _ netip.Addr, _ []byte) bool { return from == p.addr })
	id, ch, err := p.sh.Splice(req)
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := p.sh.Splice(req); err == nil || !strings.Contains(err.Error(), "being spliced already") {
		t.Errorf("a splice of sockets being spliced: %v, want refused", err)
	}
	l.net.setDrop(nil)
	if id != in.ids["p"] {
		t.Errorf("splice named session %d, want the client's (%d)", id, in.ids["p"])
	}
	select {
	case r := <-ch:
		if r.Outcome != "succeeded" {
			t.Fatalf("proxy removal: %s: %s", r.Outcome, r.Reason)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("no outcome of the proxy removal")
	}
	if o := rightOut(a, in.ids["a"]); o.Dst != b.addr {
		t.Fatalf("a sends the session to %s, want b (%s)", o, b.addr)
	}
	testutil.Eventually(t, 5*time.Second, "the proxy's sessions to be cut off", func() bool {
		for _, id := range []uint32{in.ids["p"], out.ids["p"]} {
			for _, f := range p.dp.flowsOf(id) {
				if f.Flags&datapath.FlIngress != 0 || f.Flags&datapath.FlDrop == 0 {
					return false
				}
			}
		}
		return true
	})
	l.settled()
	// A second splice of the same sockets is refused: they are cut off.
	if _, _, err := p.sh.Splice(req); err == nil || !strings.Contains(err.Error(), "spliced already") {
		t.Errorf("a second splice of the same sockets: %v, want refused", err)
	}
}

// Splice requests that are wrong as asked are the caller's errors.
func TestShellSpliceBad(t *testing.T) {
	l := newLab(t, "a", "p", "b")
	in := l.chain("a", "p")
	p := l.hosts["p"]
	sock := api.SocketPair{Local: netip.AddrPortFrom(in.t.Dst, in.t.DstPort), Remote: netip.AddrPortFrom(in.t.Src, in.t.SrcPort)}
	if _, _, err := p.sh.Splice(api.SpliceRequest{In: sock, Out: sock}); err == nil || !errors.As(err, new(BadSpliceError)) {
		t.Errorf("both sockets the same session: %v, want a BadSpliceError", err)
	}
	other := api.SocketPair{Local: netip.MustParseAddrPort("10.0.0.2:1"), Remote: netip.MustParseAddrPort("10.0.0.3:2")}
	if _, _, err := p.sh.Splice(api.SpliceRequest{In: sock, Out: other}); err == nil || !strings.Contains(err.Error(), "no Dysco session") {
		t.Errorf("a socket of no session: %v", err)
	}
}

// A middlebox takes itself out of a session (a trigger to its left
// neighbour, which runs the reconfiguration as left anchor), then out of
// one that no longer passes through it.
func TestShellRemoveSelf(t *testing.T) {
	l := newLab(t, "a", "m", "b", "n")
	s := l.chain("a", "m", "b")
	a, m, n := l.hosts["a"], l.hosts["m"], l.hosts["n"]
	entries, _ := m.dp.Sessions()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	res := m.sh.RemoveSelf(ctx, entries, []netip.Addr{n.addr}, nil)
	if len(res) != 1 || res[0].Outcome != "succeeded" {
		t.Fatalf("remove m, with n in its place: %+v", res)
	}
	if o := rightOut(a, s.ids["a"]); o.Dst != n.addr {
		t.Fatalf("a sends the session to %s, want n (%s)", o, n.addr)
	}
	l.settled()
	// m's session lingers until the old path is torn down, then goes; a
	// second removal finds nothing to do.
	entries, _ = m.dp.Sessions()
	if res := m.sh.RemoveSelf(ctx, entries, nil, nil); len(res) != 0 {
		t.Fatalf("a second removal: %+v, want nothing", res)
	}
}

// triggerAnswer reports whether a datagram carries a final answer to a
// trigger (alone or in a bundle).
func triggerAnswer(from netip.Addr, data []byte) bool {
	ps := [][]byte{data}
	if protocol.IsBundle(data) {
		var err error
		if ps, err = protocol.SplitBundle(data); err != nil {
			return false
		}
	}
	for _, p := range ps {
		if m, err := protocol.Decode(testKey, from, p); err == nil && m.Type == protocol.MsgTriggerResult && m.Answer.Outcome != 0 {
			return true
		}
	}
	return false
}

// A middlebox removes itself, and the left neighbour's answer is lost:
// the middlebox's next retransmission of its trigger gets the same answer
// (the left neighbour keeps it), and the left neighbour ran one request.
func TestShellTriggerAnswerLost(t *testing.T) {
	l := newLab(t, "a", "m", "b")
	s := l.chain("a", "m", "b")
	a, m, b := l.hosts["a"], l.hosts["m"], l.hosts["b"]
	var mu sync.Mutex
	lost, triggers := 0, 0
	l.net.setDrop(func(from, to netip.Addr, data []byte) bool {
		mu.Lock()
		defer mu.Unlock()
		if from == m.addr && to == a.addr {
			if msg, err := protocol.Decode(testKey, from, data); err == nil && msg.Type == protocol.MsgTrigger {
				triggers++
			}
		}
		if from == a.addr && to == m.addr && lost == 0 && triggerAnswer(from, data) {
			lost++
			return true
		}
		return false
	})
	entries, _ := m.dp.Sessions()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	res := m.sh.RemoveSelf(ctx, entries, nil, nil)
	if len(res) != 1 || res[0].Outcome != "succeeded" {
		t.Fatalf("remove m: %+v", res)
	}
	mu.Lock()
	if lost != 1 || triggers < 2 {
		t.Errorf("answers lost %d, triggers sent %d: want one lost and a retransmission", lost, triggers)
	}
	mu.Unlock()
	if o := rightOut(a, s.ids["a"]); o.Dst != b.addr {
		t.Fatalf("a sends the session to %s, want b (%s)", o, b.addr)
	}
	if h := a.sh.History(); len(h) != 1 || h[0].Outcome != "succeeded" {
		t.Fatalf("a's history %+v, want the one request the trigger started", h)
	}
	l.settled()
}

// A middlebox that a reconfiguration took out of a session's path asks to
// be removed all the same (its session lingers until the old path is torn
// down, and so does the left neighbour's old subsession): the left
// neighbour refuses, the sender is no longer its next hop.
func TestShellTriggerNotNextHop(t *testing.T) {
	l := newTunedLab(t, func(c *protocol.Config) { c.Linger = 5 * time.Second }, "a", "m", "b")
	s := l.chain("a", "m", "b")
	a, m, b := l.hosts["a"], l.hosts["m"], l.hosts["b"]
	succeeded(t, l.reconfigure("a", s, "b"))
	testutil.Eventually(t, 5*time.Second, "m to see the old path torn down", func() bool { return m.sh.leftPathOf(s.ids["m"]) })
	var ch chan trigOutcome
	var err error
	done := make(chan struct{})
	m.sh.post(func() {
		defer close(done)
		ch, err = m.sh.sendTrigger(s.ids["m"], b.addr, nil, nil, 0)
	})
	<-done
	if err != nil {
		t.Fatal(err)
	}
	select {
	case o := <-ch:
		if o.Outcome != "refused" || !strings.Contains(o.Reason, "no longer this session's next hop") {
			t.Fatalf("a trigger from a host off the path: %s: %s, want refused, not the next hop", o.Outcome, o.Reason)
		}
		t.Logf("a trigger from a host off the path: %s: %s", o.Outcome, o.Reason)
	case <-time.After(5 * time.Second):
		t.Fatal("no answer")
	}
	if h := a.sh.History(); len(h) != 1 {
		t.Fatalf("a ran %d requests, want only its own delete", len(h))
	}
}

// A JSON trigger of an agent before control protocol version 4, and
// messages of versions 3 and 4 (before the MAC covered the sender), are
// refused as another version, counted, and logged once per peer.
func TestShellOldTrigger(t *testing.T) {
	l := newLab(t, "a", "m")
	a, m := l.hosts["a"], l.hosts["m"]
	old := append([]byte("DYST\x01\x01{\"token\":1}"), make([]byte, 16)...)
	msg := protocol.Message{Type: protocol.MsgTrigger, Sub: wire.Tuple{Src: a.addr, Dst: m.addr, SrcPort: 1, DstPort: 2},
		Session: wire.Tuple{Src: a.addr, Dst: m.addr, SrcPort: 3, DstPort: 4}, Req: protocol.ReqKey{LeftAnchor: m.addr, ID: 1},
		RightAnchor: m.addr}
	v3, err := msg.Encode(testKey, netip.MustParseAddr("10.0.0.99"))
	if err != nil {
		t.Fatal(err)
	}
	v4 := append([]byte(nil), v3...)
	v3[4], v4[4] = 3, 4
	conn := l.net.conn(netip.MustParseAddr("10.0.0.99"))
	t.Cleanup(func() { conn.Close() })
	for _, d := range [][]byte{old, old, v3, v4} {
		if _, err := conn.WriteToUDPAddrPort(d, netip.AddrPortFrom(a.addr, DefaultControlPort)); err != nil {
			t.Fatal(err)
		}
	}
	testutil.Eventually(t, 5*time.Second, "the refusals to be counted", func() bool { return a.sh.Counters()["control_rejected_bad_version"] == 4 })
	if n := strings.Count(a.logs.String(), "speaks another version of the control protocol"); n != 1 {
		t.Errorf("logged %d times, want once for the peer", n)
	}
}

// leftPathOf is leftPath from outside the loop.
func (c *Shell) leftPathOf(id uint32) bool {
	var r bool
	done := make(chan struct{})
	c.post(func() {
		r = c.leftPath(id)
		close(done)
	})
	<-done
	return r
}

// keysOf returns the control keys of a ring of deployment secrets.
func keysOf(t *testing.T, secrets ...string) *protocol.Keys {
	t.Helper()
	var ss [][]byte
	for _, x := range secrets {
		ss = append(ss, []byte(x))
	}
	r, err := keys.NewRing(ss...)
	if err != nil {
		t.Fatal(err)
	}
	return protocol.KeysFromRing(r)
}

// The rotation of the deployment secret (docs/operating.md, "Control
// keys"), with hosts that take each step at different times: every
// reconfiguration succeeds, one per step. A host left with a ring that
// lacks the key its peers sign with refuses their messages, counted as
// bad_mac, and the reconfiguration fails without harm; once it has the
// key, the next succeeds.
func TestShellKeyRotation(t *testing.T) {
	l := newLab(t, "a", "m", "b")
	const oldS, newS = "the old deployment secret", "the new deployment secret"
	old, adding, moved, after := keysOf(t, oldS), keysOf(t, oldS, newS), keysOf(t, newS, oldS), keysOf(t, newS)
	set := func(k *protocol.Keys, names ...string) {
		for _, n := range names {
			l.hosts[n].sh.SetKeys(k)
		}
	}
	set(old, "a", "m", "b")
	s := l.chain("a", "m", "b")
	through := true // m is on the path
	round := func(step string) Outcome {
		t.Helper()
		var o Outcome
		if through {
			o = l.reconfigure("a", s, "b")
		} else {
			o = l.reconfigure("a", s, "b", "m")
		}
		if o.Result != nil && o.Result.Outcome == protocol.Succeeded {
			through = !through
		}
		t.Logf("%s: %s", step, outcome(o))
		return o
	}
	for _, st := range []struct {
		step string
		k    *protocol.Keys
		at   []string
	}{
		{"all sign and accept the old key", old, nil},
		{"a adds the new key second", adding, []string{"a"}},
		{"m and b add it", adding, []string{"m", "b"}},
		{"a moves it first: a signs with it", moved, []string{"a"}},
		{"m moves it first", moved, []string{"m"}},
		{"b moves it first", moved, []string{"b"}},
		{"a drops the old key", after, []string{"a"}},
		{"m and b drop it", after, []string{"m", "b"}},
	} {
		set(st.k, st.at...)
		succeeded(t, round(st.step))
		l.settled()
	}
	// m goes back to the old key alone (a host the rotation missed).
	set(old, "m")
	before := l.hosts["m"].sh.Counters()["control_rejected_bad_mac"]
	if o := round("m has only the old key"); o.Result != nil && o.Result.Outcome == protocol.Succeeded {
		t.Fatalf("a reconfiguration through a host without the key succeeded")
	}
	if n := l.hosts["m"].sh.Counters()["control_rejected_bad_mac"]; n <= before {
		t.Fatalf("m counted %d bad_mac, want more than %d", n, before)
	}
	l.settled()
	set(after, "m")
	succeeded(t, round("m has the new key"))
}
