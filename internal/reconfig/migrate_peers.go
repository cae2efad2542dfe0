package reconfig

// State migration at the other agents: the right anchor's freeze, and
// the old and new middleboxes' export and import; the requests between
// agents with their retransmission.

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"time"

	"github.com/dysco/dysco/internal/datapath"
	"github.com/dysco/dysco/internal/migrate"
	"github.com/dysco/dysco/internal/protocol"
)

// rightHold is a right anchor's hold, released when its side switches or
// the request ends.
type rightHold struct {
	h     *hold
	timer *time.Timer
}

// onMig handles a migration request or answer (loop).
func (c *Shell) onMig(from netip.Addr, data []byte) {
	kind, m, err := decodeMig(c.key, data)
	if err != nil {
		reason := "migration_malformed"
		if errors.Is(err, errSealMAC) {
			reason = "migration_bad_mac"
		}
		c.countReject(reason)
		return
	}
	switch kind {
	case migAnswer:
		call := c.migCalls[m.Token]
		if call == nil || call.to != from {
			c.countReject("migration_unexpected")
			return
		}
		delete(c.migCalls, m.Token)
		call.timer.Stop()
		call.ch <- m
	case migRequest:
		k := migKey{from, m.Token}
		if res, ok := c.migAnswers[k]; ok {
			if res != nil {
				c.send(from, res)
			}
			return
		}
		age := time.Since(time.UnixMilli(m.SentUnixMS))
		if age > migMaxAge || age < -migMaxAge {
			c.countReject("migration_stale")
			return
		}
		c.migAnswers[k] = nil
		answer := func(r migMsg) {
			r.Token = m.Token
			b, err := encodeMig(c.key, migAnswer, r)
			if err != nil {
				return
			}
			c.migAnswers[k] = b
			time.AfterFunc(2*migMaxAge, func() { c.post(func() { delete(c.migAnswers, k) }) })
			c.send(from, b)
		}
		// answerLater answers from another goroutine.
		answerLater := func(r migMsg) { c.post(func() { answer(r) }) }
		switch m.Op {
		case "freeze":
			c.onFreeze(from, m, answer, answerLater)
		case "export":
			c.onExport(from, m, answer, answerLater)
		case "import":
			c.onImport(from, m, answer, answerLater)
		case "abort":
			c.onAbort(from, m, answer)
		default:
			answer(migMsg{Err: fmt.Sprintf("unknown operation %q", m.Op)})
		}
	default:
		c.countReject("migration_malformed")
	}
}

// onFreeze: the right anchor holds its old-path packets and reports its
// marks (after its drain, for the semantics that need one).
func (c *Shell) onFreeze(from netip.Addr, m migMsg, answer, answerLater func(migMsg)) {
	req := protocol.ReqKey{LeftAnchor: m.ReqLeft, ID: m.ReqID}
	if from != m.ReqLeft {
		answer(migMsg{Err: "freeze must come from the request's left anchor"})
		return
	}
	p := c.proto(from.Is6())
	if p == nil {
		answer(migMsg{Err: "no address of this family"})
		return
	}
	pid, ok := p.RightAnchorOf(req)
	if !ok {
		answer(migMsg{Err: fmt.Sprintf("not the right anchor of %s", req)})
		return
	}
	opts := MigrateOptions{Semantics: m.Semantics, HoldLimit: m.HoldLimit, DrainTimeout: time.Duration(m.DrainMS) * time.Millisecond}
	if err := opts.normalize(); err != nil {
		answer(migMsg{Err: err.Error()})
		return
	}
	id := c.dpID(pid)
	k := datapath.TPKey{SessId: id, Side: uint32(protocol.SideLeft)}
	tp, ok := c.dp.TwoPath(k)
	if !ok {
		answer(migMsg{Err: "the session's two-path record is missing"})
		return
	}
	if rh := c.rightHolds[k]; rh != nil {
		answer(migMsg{Err: "this side is already frozen"})
		return
	}
	if c.holds == nil {
		answer(migMsg{Err: "the right anchor's datapath cannot hold packets"})
		return
	}
	limit := opts.HoldLimit
	h, err := c.holds.start(id, datapath.Tuple(tp.EgKey), opts.holdFlags(), limit, func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		_, _ = c.migCall(ctx, req.LeftAnchor, migMsg{Op: "abort", ReqLeft: req.LeftAnchor, ReqID: req.ID,
			Note: fmt.Sprintf("hold buffer full at the right anchor (over %d bytes)", limit)})
	})
	if err != nil {
		answer(migMsg{Err: err.Error()})
		return
	}
	rh := &rightHold{h: h}
	c.rightHolds[k] = rh
	// Never hold beyond every bound of the left anchor: it may be gone.
	rh.timer = time.AfterFunc(defaultMigTimeout+opts.Timeout, func() { c.post(func() { c.releaseRightHold(k) }) })
	own := c.flowMarks(datapath.Tuple(tp.EgKey))
	var peer marks
	if m.Marks != nil {
		peer = *m.Marks
	}
	inOld := datapath.Tuple(tp.InOld)
	if opts.Semantics == SemLossFree {
		answer(migMsg{Marks: &own})
		return
	}
	go func() {
		limit := opts.Timeout
		if opts.Semantics == SemOrder {
			limit = opts.DrainTimeout
		}
		ctx, cancel := context.WithTimeout(context.Background(), limit)
		ok := c.waitDrained(ctx, opts.Semantics, own, peer, inOld)
		cancel()
		switch {
		case ok:
			answerLater(migMsg{Marks: &own})
		case opts.Semantics == SemOrder:
			answerLater(migMsg{Marks: &own, Note: "drain timeout: a packet sent before the freeze did not arrive (lost or late)"})
		default:
			answerLater(migMsg{Err: "the old path did not drain at the right anchor: data sent before the freeze is still unacknowledged"})
		}
	}()
}

// onAbort: the right anchor cannot go on (its hold is full).
func (c *Shell) onAbort(from netip.Addr, m migMsg, answer func(migMsg)) {
	req := protocol.ReqKey{LeftAnchor: m.ReqLeft, ID: m.ReqID}
	for _, mg := range c.migrations {
		if mg.ready.Req == req && mg.ready.RightAnchor == from {
			c.migrationDone(mg, errors.New(m.Note))
			answer(migMsg{})
			return
		}
	}
	answer(migMsg{Err: "no migration of " + req.String() + " here"})
}

// releaseRightHold ends a right anchor's hold (loop).
func (c *Shell) releaseRightHold(k datapath.TPKey) {
	rh := c.rightHolds[k]
	if rh == nil {
		return
	}
	delete(c.rightHolds, k)
	rh.timer.Stop()
	go c.holds.release(rh.h)
}

// stateSession finds the session a state request names by the subsession
// from the left anchor to this host (as its SYN went), which the sender
// must be the left end of.
func (c *Shell) stateSession(from netip.Addr, m migMsg) (uint32, datapath.Session, string) {
	if m.Sub == nil || m.Sub.Src != from {
		return 0, datapath.Session{}, m.Op + " must come from the left end of the named subsession"
	}
	id, ok := c.sessionBySub(*m.Sub)
	if !ok {
		return 0, datapath.Session{}, "no session on subsession " + m.Sub.String()
	}
	s, ok := c.dp.Session(id)
	if !ok {
		return 0, datapath.Session{}, "session gone"
	}
	if c.states == nil {
		return 0, datapath.Session{}, "state migration is disabled on this agent (no --state-plugins)"
	}
	return id, s, ""
}

// onExport: the old middlebox exports the session's state (the plug-ins'
// Set refuses a bundle too large for one control message).
func (c *Shell) onExport(from netip.Addr, m migMsg, answer, answerLater func(migMsg)) {
	id, s, bad := c.stateSession(from, m)
	if bad != "" {
		answer(migMsg{Err: bad})
		return
	}
	t := s.Tuple.Wire()
	if on := c.onward(id, &s); on != t {
		// This middlebox translates the session (a NAT): its replacement
		// would send the session on with the NAT's output, and a host
		// joining a new path keys the session's egress by the tuple in
		// the SYN (docs/state-migration.md, "What is not covered").
		answer(migMsg{Err: fmt.Sprintf("this middlebox translates the session's tuple (%s leaves as %s): a replacement cannot take it over on a new path", t, on)})
		return
	}
	if right, ok := c.currentSub(id, &s, protocol.SideRight); !ok || right.Dst != m.RightAnchor {
		answer(migMsg{Err: fmt.Sprintf("the old segment has more than this middlebox before the right anchor %s: state migration replaces one middlebox by one", m.RightAnchor)})
		return
	}
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), defaultMigTimeout)
		defer cancel()
		b, err := c.states.Export(ctx, migrate.Session{Tuple: t, Proto: 6})
		if err != nil {
			answerLater(migMsg{Err: err.Error()})
			return
		}
		c.post(func() { c.exported[id] = t })
		answerLater(migMsg{State: b})
	}()
}

// onImport: the new middlebox installs the state before any packet of the
// session reaches it.
func (c *Shell) onImport(from netip.Addr, m migMsg, answer, answerLater func(migMsg)) {
	id, s, bad := c.stateSession(from, m)
	if bad != "" {
		answer(migMsg{Err: bad})
		return
	}
	t := s.Tuple.Wire()
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), defaultMigTimeout)
		defer cancel()
		if err := c.states.Import(ctx, migrate.Session{Tuple: t, Proto: 6}, m.State); err != nil {
			answerLater(migMsg{Err: err.Error()})
			return
		}
		// If this new path is abandoned, the state goes with it; if it
		// was abandoned while the import ran, at once.
		c.post(func() {
			c.exported[id] = t
			if _, ok := c.dp.Session(id); !ok || c.pidOf[id] == 0 {
				c.releaseExported(id)
			}
		})
		answerLater(migMsg{})
	}()
}

// releaseExported drops the state of a session this host exported (or
// imported), once the path through it is freed: the old path after the
// move, or a new path that was abandoned (loop; the work runs aside).
func (c *Shell) releaseExported(id uint32) {
	t, ok := c.exported[id]
	if !ok {
		return
	}
	delete(c.exported, id)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), defaultMigTimeout)
		defer cancel()
		if err := c.states.Release(ctx, migrate.Session{Tuple: t, Proto: 6}); err != nil {
			c.log.Warn("releasing migrated state", "session", t.String(), "err", err)
		}
	}()
}

// migKey names a migration request at its receiver: its sender and token.
type migKey struct {
	from  netip.Addr
	token uint64
}

type migCall struct {
	to    netip.Addr
	data  []byte
	ch    chan migMsg
	tries int
	timer *time.Timer
}

// migCall sends a request and waits for its answer (not on the loop).
func (c *Shell) migCall(ctx context.Context, to netip.Addr, m migMsg) (migMsg, error) {
	ch := make(chan migMsg, 1)
	var token uint64
	errc := make(chan error, 1)
	c.post(func() {
		c.token++
		token = c.token
		m.Token = token
		m.SentUnixMS = time.Now().UnixMilli()
		b, err := encodeMig(c.key, migRequest, m)
		if err != nil {
			errc <- err
			return
		}
		call := &migCall{to: to, data: b, ch: ch}
		c.migCalls[token] = call
		var send func()
		send = func() {
			call.tries++
			c.send(to, call.data)
			// 20 ms, doubling to 320 ms: the answers may need a drain.
			call.timer = time.AfterFunc(time.Duration(20<<min(call.tries-1, 4))*time.Millisecond, func() {
				c.post(func() {
					if c.migCalls[token] == call {
						send()
					}
				})
			})
		}
		send()
		errc <- nil
	})
	if err := <-errc; err != nil {
		return migMsg{}, err
	}
	select {
	case a := <-ch:
		if a.Err != "" {
			return a, errors.New(a.Err)
		}
		return a, nil
	case <-ctx.Done():
		c.post(func() {
			if call := c.migCalls[token]; call != nil {
				call.timer.Stop()
				delete(c.migCalls, token)
			}
		})
		return migMsg{}, fmt.Errorf("no answer from %s", to)
	}
}
