package agent

// The agent's half of dynamic reconfiguration (paper §3, §4.1 "Daemon"): a
// UDP socket for control messages, timers, and the translation between the
// protocol core (internal/protocol, a pure state machine) and the datapath's
// maps. The control state is serialised by one mutex (control.mu): the
// goroutine that reads the control socket handles what it read itself,
// holding it, and so does the one that reads the datapath's events; work from
// elsewhere (the API, timers, the collector) is posted as closures to the
// loop goroutine, which runs them holding it too.
//
// What the loop sends for one item (a datagram read, a side's progress
// from the datapath's ring, a posted closure) goes out when the item has
// been handled, several messages for the same agent as one bundle
// (protocol.PackBundles; docs/protocol.md, "Bundles"): a datagram carried
// through the network stack once for several messages, and no item's
// messages waiting for another item's handling.

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"slices"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/dysco/dysco/internal/api"
	"github.com/dysco/dysco/internal/datapath"
	"github.com/dysco/dysco/internal/migrate"
	"github.com/dysco/dysco/internal/protocol"
	"github.com/dysco/dysco/internal/wire"
	"golang.org/x/sys/unix"
)

// DefaultControlPort is the UDP port of the reconfiguration protocol.
const DefaultControlPort = 4790

// controlPortBase and controlPortCount bound the ports of subsessions made
// by reconfigurations, apart from the datapath's set-up range.
const (
	controlPortBase  = 61000
	controlPortCount = 4000
)

// controlRcvBuf is the control socket's receive buffer.
const controlRcvBuf = 8 << 20

// control is the reconfiguration machinery of one agent.
type control struct {
	a    *Agent
	conn *net.UDPConn
	port int
	key  []byte

	// mu guards everything below: whoever holds it is "the loop" (the
	// comments' loop goroutine). Taken by run for posted work and ticks, by
	// readLoop for each control message and by eventLoop for each datapath
	// event: a message is handled by the goroutine that read it, with no
	// hand-off to another goroutine (one thread wake-up less per message;
	// reconfigurations in an idle lab took 0.8 × the time they took with
	// the hand-off, BENCHMARKS.md).
	mu          sync.Mutex
	protos      map[bool]*protocol.Agent // by "is IPv6"
	timers      map[timerKey]*time.Timer
	joinedDP    map[protocol.SessionID]uint32 // protocol-made sessions → datapath id
	pidOf       map[uint32]protocol.SessionID // datapath id → protocol id, for every session the protocol knows
	famOf       map[uint32]bool
	notReady    map[protocol.SessionID]*readyPoll // joined sessions waiting for packets both ways
	waiters     map[uint64]chan waited
	started     map[uint64]time.Time           // when each request (token) began
	phases      map[protocol.ReqKey]phaseTimes // the left anchor's requests: when they reached their phases
	history     []api.ReconfigResult           // the last historyLen results at this left anchor
	active      map[datapath.TPKey]bool        // sides in their two-path phase (polled as a safety net)
	prevTP      map[datapath.TPKey]datapath.TPVal
	spliced     map[protocol.SessionID]splicedPair
	triggers    map[uint64]*trigger
	trigAnswers map[triggerKey][]byte // nil value: request still running
	token       uint64
	ticks       uint64
	deferred    []func() // work of the loop itself, run after the current event's actions

	// Sessions leaving this host with another tuple than they arrived
	// with (onward.go), and when the flows were last walked for them.
	onwardOf      map[uint32]onwardEntry
	onwardScanAt  time.Time
	onwardScanned bool

	// State migration (migrate.go).
	holds      *holds // nil: the datapath cannot hold packets
	states     *migrate.Set
	migrations map[uint64]*migration // by token, at the left anchor
	migReports map[uint64]api.MigrationReport
	migCalls   map[uint64]*migCall
	migAnswers map[triggerKey][]byte
	rightHolds map[datapath.TPKey]*rightHold
	exported   map[uint32]wire.Tuple // sessions whose state this host exported
	migOut     map[uint64]chan api.MigrationReport

	// Work posted to the loop goroutine (post): an unbounded queue, so that
	// posting never blocks, not even when the poster holds mu.
	qmu   sync.Mutex
	queue []func()
	wake  chan struct{}

	// Request numbers (protocol.Config.FirstReq): the protocol agents
	// number their requests above reqBase, and the datapath keeps reqLimit,
	// raised before a request could reach it, so that an agent that
	// restarts numbers its requests above every one it may have used.
	reqBase, reqLimit uint32

	rejected sync.Map // reason string → *atomic.Uint64
	msgsIn   atomic.Uint64
	msgsOut  atomic.Uint64
	// Datagrams, each one message or a bundle of several.
	dgramsIn, dgramsOut atomic.Uint64

	// outbox holds what the current step of the loop sends (guarded by
	// mu); a step queues a few messages, so send scans it.
	outbox []outMsg
}

// outMsg is a datagram payload waiting for the end of the loop's step.
type outMsg struct {
	to   netip.Addr
	data []byte
}

type timerKey struct {
	v6 bool
	id protocol.TimerID
}

// newControl opens the control socket. key is the deployment key.
func newControl(a *Agent, port int, key []byte) (*control, error) {
	conn, err := net.ListenUDP("udp", &net.UDPAddr{IP: net.IPv6unspecified, Port: port})
	if err != nil {
		return nil, fmt.Errorf("agent: control socket on UDP port %d: %w", port, err)
	}
	// Hundreds of reconfigurations can start at once (a proxy splicing
	// all its sessions): a receive buffer far beyond the default keeps
	// the burst from overflowing it (SO_RCVBUFFORCE: root may exceed
	// net.core.rmem_max).
	if raw, err := conn.SyscallConn(); err == nil {
		_ = raw.Control(func(fd uintptr) {
			if unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_RCVBUFFORCE, controlRcvBuf) != nil {
				_ = conn.SetReadBuffer(controlRcvBuf)
			}
		})
	}
	c := &control{a: a, conn: conn, port: port, key: key,
		protos: map[bool]*protocol.Agent{}, timers: map[timerKey]*time.Timer{},
		joinedDP: map[protocol.SessionID]uint32{}, pidOf: map[uint32]protocol.SessionID{}, famOf: map[uint32]bool{},
		notReady: map[protocol.SessionID]*readyPoll{}, waiters: map[uint64]chan waited{}, started: map[uint64]time.Time{},
		active: map[datapath.TPKey]bool{}, prevTP: map[datapath.TPKey]datapath.TPVal{}, spliced: map[protocol.SessionID]splicedPair{},
		onwardOf: map[uint32]onwardEntry{},
		triggers: map[uint64]*trigger{}, trigAnswers: map[triggerKey][]byte{}, wake: make(chan struct{}, 1),
		migrations: map[uint64]*migration{}, migReports: map[uint64]api.MigrationReport{}, migCalls: map[uint64]*migCall{},
		migAnswers: map[triggerKey][]byte{}, rightHolds: map[datapath.TPKey]*rightHold{}, exported: map[uint32]wire.Tuple{},
		migOut: map[uint64]chan api.MigrationReport{},
		// Tokens name this agent's triggers at their receivers, which
		// answer a token they have seen with their first answer: a
		// restarted agent must not reuse its predecessor's.
		token: uint64(time.Now().UnixNano())}
	if err := c.loadReqs(); err != nil {
		conn.Close()
		return nil, fmt.Errorf("agent: request numbers: %w", err)
	}
	return c, nil
}

// proto returns the protocol agent of a family, creating it with this
// host's first address of the family; nil if the host has none.
func (c *control) proto(v6 bool) *protocol.Agent {
	if p := c.protos[v6]; p != nil {
		return p
	}
	self := c.a.selfAddr(v6)
	if !self.IsValid() {
		return nil
	}
	cfg := protocol.DefaultConfig(self, c.key)
	cfg.PortBase, cfg.PortCount = controlPortBase, controlPortCount
	// 16 transmissions in about 6.75 s (50, 100, 200, 400 ms, then every
	// 500 ms): a dead hop is given up as soon as with 10 up to 1 s apart,
	// and under loss more tries fit in that time. With 20 % loss per
	// message a lock round trip through one middlebox (four messages)
	// fails 59 % of its tries; all 10 failed 0.5 % of the time, all 16
	// fail 0.02 % (TestControlLoss failed so once).
	cfg.RTO = 50 * time.Millisecond
	cfg.MaxRTO = 500 * time.Millisecond
	cfg.MaxTries = 16
	cfg.Linger = 3 * time.Second
	cfg.LockLease = 30 * time.Second
	cfg.FirstReq = c.reqBase
	if v6 {
		// Both halves' sessions share the agent's maps (joinedDP,
		// pidOf...): their joined sessions must not share ids.
		cfg.JoinedBase = protocol.JoinedBase6
	}
	p := protocol.New(cfg)
	c.protos[v6] = p
	return p
}

// run serves until ctx ends.
func (c *control) run(ctx context.Context) {
	// Sessions left in the middle of a reconfiguration by an earlier agent
	// first, then the messages (they wait in the socket meanwhile).
	c.locked(c.resumeAll)
	go c.readLoop()
	if er, err := c.a.dp.EventReader(); err == nil {
		go c.eventLoop(er)
		defer er.Close()
	} else {
		c.a.log.Warn("control: no datapath events; polling only", "err", err)
	}
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	defer c.conn.Close()
	leased := time.Now() // the agent took its split lease at start (agent.go)
	for {
		select {
		case <-ctx.Done():
			if c.holds != nil {
				c.a.setSplitReader(false)
			}
			c.locked(func() {
				for _, t := range c.timers {
					t.Stop()
				}
			})
			return
		case <-c.wake:
			c.qmu.Lock()
			q := c.queue
			c.queue = nil
			c.qmu.Unlock()
			for _, f := range q {
				c.locked(f)
			}
		case <-tick.C:
			if c.holds != nil && time.Since(leased) >= splitLeaseRenew {
				c.a.setSplitReader(true)
				leased = time.Now()
			}
			c.locked(c.poll)
		}
	}
}

// locked runs f as one step of the loop: holding mu, then the work f
// deferred, then the step's sends (f is one item, or sends per item
// itself).
func (c *control) locked(f func()) {
	c.mu.Lock()
	defer c.mu.Unlock()
	f()
	c.runDeferred()
	c.flush()
}

// send queues a datagram payload (a control message, a trigger, a
// migration message) for the agent at to; it leaves when the
// loop's step ends (flush), or at once when a full bundle for to is
// waiting. Loop goroutine.
func (c *control) send(to netip.Addr, data []byte) {
	n := 0 // the bytes of a bundle of what waits for to
	for _, m := range c.outbox {
		if m.to == to {
			n += 2 + len(m.data)
		}
	}
	if n > 0 && n+2+len(data) > protocol.BundleMax-protocol.BundleHeaderLen {
		c.flush()
	}
	c.msgsOut.Add(1)
	c.outbox = append(c.outbox, outMsg{to, data})
}

// flush sends what the loop's step queued: per destination, in the order
// of each destination's first message, its messages in the order they were
// queued, as few datagrams as PackBundles makes of them. Loop goroutine.
func (c *control) flush() {
	switch len(c.outbox) {
	case 0:
		return
	case 1: // the common case: nothing to bundle
		m := c.outbox[0]
		c.outbox[0] = outMsg{}
		c.outbox = c.outbox[:0]
		c.write(m.to, m.data)
		return
	}
	box := c.outbox
	c.outbox = c.outbox[:0]
	var dests []netip.Addr
	per := map[netip.Addr][][]byte{}
	for _, m := range box {
		if _, ok := per[m.to]; !ok {
			dests = append(dests, m.to)
		}
		per[m.to] = append(per[m.to], m.data)
	}
	for _, to := range dests {
		for _, d := range protocol.PackBundles(per[to], protocol.BundleMax) {
			c.write(to, d)
		}
	}
	clear(box)
}

// write sends one datagram to the agent at to.
func (c *control) write(to netip.Addr, d []byte) {
	c.dgramsOut.Add(1)
	if _, err := c.conn.WriteToUDPAddrPort(d, netip.AddrPortFrom(to, uint16(c.port))); err != nil {
		c.a.log.Warn("control: send failed", "to", to, "bytes", len(d), "err", err)
	}
}

// post has the loop goroutine run f, after the work posted before it. It
// never blocks and may be called from anywhere, the loop included; f runs
// later, never during the call.
func (c *control) post(f func()) {
	c.qmu.Lock()
	c.queue = append(c.queue, f)
	c.qmu.Unlock()
	select {
	case c.wake <- struct{}{}:
	default: // a wake-up is pending already
	}
}

// readLoop reads the control socket and handles each datagram itself, as
// one step of the loop. (One datagram a step: taking all that are waiting
// costs a receive that fails with EAGAIN every step, which an idle agent
// pays on every message, and with 600 removals at once it did not change
// the agents' CPU or the removal times, BENCHMARKS.md "Control messages
// bundled".)
func (c *control) readLoop() {
	buf := make([]byte, 64<<10)
	for {
		n, from, err := c.conn.ReadFromUDPAddrPort(buf)
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			continue
		}
		data := append([]byte(nil), buf[:n]...)
		src := from.Addr().Unmap()
		c.locked(func() { c.onDatagram(src, data) })
	}
}

// onDatagram handles a datagram: one message, or a bundle of several, each
// handled as if it had come alone.
func (c *control) onDatagram(from netip.Addr, data []byte) {
	c.dgramsIn.Add(1)
	if !protocol.IsBundle(data) {
		c.msgsIn.Add(1)
		c.onPacket(from, data)
		return
	}
	ps, err := protocol.SplitBundle(data)
	if err != nil {
		c.msgsIn.Add(1)
		c.countReject("bad_bundle")
		c.a.log.Debug("control datagram refused", "from", from, "err", err)
		return
	}
	c.msgsIn.Add(uint64(len(ps)))
	for _, p := range ps {
		c.onPacket(from, p)
	}
}

// eventLoop feeds the datapath's progress notices to the protocol. The
// events waiting in the ring are taken together, and each side is read once
// for all of them (progress reads the side's variables as they are now):
// under many concurrent reconfigurations a side's bits change several times
// before the agent gets to them.
func (c *control) eventLoop(er *datapath.EventReader) {
	const most = 256 // sides per batch
	var keys []datapath.TPKey
	for {
		ev, err := er.Read()
		if err != nil {
			return
		}
		keys = append(keys[:0], datapath.TPKey{SessId: ev.SessID, Side: ev.Side})
		for len(keys) < most && er.Pending() {
			if ev, err = er.Read(); err != nil {
				break
			}
			if k := (datapath.TPKey{SessId: ev.SessID, Side: ev.Side}); !slices.Contains(keys, k) {
				keys = append(keys, k)
			}
		}
		c.locked(func() {
			for _, k := range keys {
				c.progress(k)
				// Each side's sends leave before the next side is
				// handled: bundles only gather what one item sent.
				c.runDeferred()
				c.flush()
			}
		})
		if err != nil {
			return
		}
	}
}

// Request numbers are reserved in blocks of reqBlock, a new block once the
// latest request is within reqMargin of the reserved limit (one event
// numbers at most one request).
const (
	reqBlock  = 4096
	reqMargin = 64
)

// loadReqs starts this agent's request numbers above those an earlier
// agent on this host may have used (protocol.Config.FirstReq).
func (c *control) loadReqs() error {
	hi, err := c.a.dp.ReqHigh()
	if err != nil {
		return err
	}
	c.reqBase, c.reqLimit = hi, hi
	return c.reserveReqs()
}

// reserveReqs raises the limit of request numbers kept in the datapath.
func (c *control) reserveReqs() error {
	limit := c.reqLimit + reqBlock
	if err := c.a.dp.SetReqHigh(limit); err != nil {
		c.a.log.Warn("control: cannot keep the request numbers for a restart", "err", err)
		return err
	}
	c.reqLimit = limit
	return nil
}

// now is the protocol's clock: monotonic, from Go's clock (the vDSO; a
// clock_gettime system call per event costs more on some virtual machines),
// set to the datapath's clock at start.
func now() time.Duration { return clockBase + time.Since(clockStart) }

var clockBase, clockStart = datapath.Monotonic(), time.Now()

// handle feeds an event to a protocol agent and carries out its actions.
func (c *control) handle(v6 bool, ev protocol.Event) {
	p := c.proto(v6)
	if p == nil {
		return
	}
	if _, ok := ev.(protocol.Reconfigure); ok && p.LastReq()+reqMargin >= c.reqLimit {
		c.reserveReqs()
	}
	for _, act := range p.Handle(now(), ev) {
		if err := c.do(v6, act); err != nil {
			c.a.log.Warn("control: action failed", "action", fmt.Sprintf("%T", act), "err", err)
		}
	}
	c.runDeferred()
}

// runDeferred runs the loop's own deferred work, also what that defers.
func (c *control) runDeferred() {
	for len(c.deferred) > 0 {
		f := c.deferred[0]
		c.deferred = c.deferred[1:]
		f()
	}
}

func (c *control) onPacket(from netip.Addr, data []byte) {
	if isTrigger(data) {
		c.onTrigger(from, data)
		return
	}
	if isMig(data) {
		c.onMig(from, data)
		return
	}
	v6 := from.Is6()
	p := c.proto(v6)
	if p == nil {
		c.countReject("no_address")
		return
	}
	// A message about a session the protocol does not know yet: announce
	// the session from the datapath first (sessions are announced lazily,
	// when a reconfiguration first concerns them).
	onPath, gone := false, false
	if m, err := protocol.Decode(c.key, data); err == nil && m.Type == protocol.MsgSyn {
		// A new path's SYN that would make this host join it: refused
		// if the session crosses this host already (one datapath state
		// per session tuple; protocol.MessageIn.OnPath).
		if _, _, known := p.Lookup(m.Sub); !known && m.RightAnchor != p.Self() && len(m.Hops) > 0 {
			_, onPath = c.liveHere(m.Session, m.Nonce)
		}
	} else if err == nil {
		pid, _, ok := p.Lookup(m.Sub)
		if !ok {
			if id, ok := c.sessionBySub(m.Sub); ok {
				_ = c.announce(id)
			} else {
				// No session of the datapath has the subsession, nor
				// the session it names (an old path's subsession of a
				// live session is not an ended session).
				gone = !c.hasSession(m.Session, m.Nonce)
			}
		} else if m.Type == protocol.MsgRequestLock && m.RightAnchor == p.Self() {
			// A joined session may be the right anchor now. (A middle
			// agent passes the request whether or not it is ready:
			// the look is a dozen map reads.)
			c.checkReady(pid)
		}
	}
	c.handle(v6, protocol.MessageIn{From: from, Data: data, OnPath: onPath, Gone: gone})
}

// liveHere reports whether this host carries a session of tuple t (as it
// arrives here) on a live path, which a new path's SYN for the session of
// nonce must not replace: a datapath session keyed by t, not reset, that
// the protocol either does not know (a chain set up through this host that
// no reconfiguration touched here) or knows on a live path
// (protocol.Agent.OnLivePath: not an old path past which both anchors'
// fins have gone), and that is either the session of nonce (FINs both
// ways do not end it: the bytes before them may still be on their way, or
// be sent again) or another one not closed both ways (a stale SYN of an
// earlier connection must not take over the tuple). A session of another
// nonce closed both ways is an earlier TCP connection of the same tuple:
// it gives way. It returns the session.
func (c *control) liveHere(t wire.Tuple, nonce [wire.NonceLen]byte) (uint32, bool) {
	const closed = datapath.StFINFwd | datapath.StFINRev
	for _, k := range []wire.Tuple{t, t.Reverse()} {
		f, ok := c.a.dp.Flow(datapath.TupleFrom(k))
		if !ok {
			continue
		}
		s, ok := c.a.dp.Session(f.SessId)
		if !ok || s.State&datapath.StRST != 0 || s.Nonce != nonce && s.State&closed == closed {
			continue
		}
		pid, known := c.pidOf[f.SessId]
		if !known {
			return f.SessId, true
		}
		if p := c.protos[c.famOf[f.SessId]]; p == nil || p.OnLivePath(pid) {
			return f.SessId, true
		}
	}
	return 0, false
}

// hasSession reports whether the datapath holds a session of tuple t (as
// it arrives here, either way) with the given nonce.
func (c *control) hasSession(t wire.Tuple, nonce [wire.NonceLen]byte) bool {
	for _, k := range []wire.Tuple{t, t.Reverse()} {
		if f, ok := c.a.dp.Flow(datapath.TupleFrom(k)); ok {
			if s, ok := c.a.dp.Session(f.SessId); ok && s.Nonce == nonce {
				return true
			}
		}
	}
	return false
}

// sessionBySub finds the datapath session that has subsession sub (as its
// SYN went) on one of its sides at this host.
func (c *control) sessionBySub(sub wire.Tuple) (uint32, bool) {
	for _, k := range []wire.Tuple{sub, sub.Reverse()} {
		if f, ok := c.a.dp.Flow(datapath.TupleFrom(k)); ok && f.Flags&datapath.FlIngress != 0 {
			return f.SessId, true
		}
	}
	return 0, false
}

// announce tells the protocol about a datapath session (SessionUp), unless
// it knows it already.
func (c *control) announce(id uint32) error {
	if _, ok := c.pidOf[id]; ok {
		return nil
	}
	s, ok := c.a.dp.Session(id)
	if !ok {
		return fmt.Errorf("no session %d", id)
	}
	// A session that one end has closed carries the other's data still,
	// and a FIN is a byte of the stream for the two-path rules (§3.5):
	// such a session is reconfigured like any other. One that has not
	// completed its handshake, or is reset, has nothing to reconfigure.
	if s.State&datapath.StEst == 0 {
		return fmt.Errorf("session %d is not established", id)
	}
	if s.State&datapath.StRST != 0 {
		return fmt.Errorf("session %d was reset", id)
	}
	t := s.Tuple.Wire()
	// The tuple a new path to the right carries (its SYN's session tuple)
	// is the one the old path carried from here: behind a NAT, the
	// middlebox's output.
	up := protocol.SessionUp{Session: protocol.SessionID(id), Tuple: c.onward(id, &s), Nonce: s.Nonce}
	ws := func(i int) uint8 {
		if s.Ws[i] == 0xff {
			return 0
		}
		return s.Ws[i]
	}
	// Right side: the egress flow of the SYN's direction.
	if s.Role == datapath.RoleStart || s.Role == datapath.RoleMiddle {
		if sub, ok := c.currentSub(id, &s, protocol.SideRight); ok {
			up.Right = &protocol.SideInfo{Peer: sub.Dst, Sub: sub, SendWScale: ws(0), PeerWScale: ws(1)}
			c.reconfigured(id, protocol.SideRight, up.Right)
		}
	}
	if s.Role != datapath.RoleStart {
		if sub, ok := c.currentSub(id, &s, protocol.SideLeft); ok {
			up.Left = &protocol.SideInfo{Peer: sub.Src, Sub: sub, SendWScale: ws(1), PeerWScale: ws(0)}
			c.reconfigured(id, protocol.SideLeft, up.Left)
		}
	}
	if up.Left == nil && up.Right == nil {
		detail := ""
		for _, k := range []wire.Tuple{up.Tuple, t.Reverse()} {
			if f, ok := c.a.dp.Flow(datapath.TupleFrom(k)); ok {
				detail += fmt.Sprintf("; flow %s: session %d flags %#x -> %s", k, f.SessId, f.Flags, f.Out.Wire())
			} else {
				detail += fmt.Sprintf("; no flow %s", k)
			}
		}
		return fmt.Errorf("session %d (%s, %s) has no subsession at this host%s", id, t, datapath.RoleName(s.Role), detail)
	}
	if up.Left != nil && up.Right != nil {
		if la, n, ok := c.a.dp.Lock(id); ok {
			up.Lock = protocol.ReqKey{LeftAnchor: addrFrom16(la), ID: n}
		}
	}
	v6 := t.Dst.Is6() && !t.Dst.Is4In6()
	c.pidOf[id], c.famOf[id] = protocol.SessionID(id), v6
	var resumed []datapath.TPKey
	for side, si := range map[protocol.Side]*protocol.SideInfo{protocol.SideLeft: up.Left, protocol.SideRight: up.Right} {
		if si != nil && si.Resume != nil && si.Resume.Switched {
			resumed = append(resumed, datapath.TPKey{SessId: id, Side: uint32(side)})
		}
	}
	c.handle(v6, up)
	for _, k := range resumed {
		// A side resumed in its two-path phase: its variables now, and
		// the polling safety net from here on.
		c.active[k] = true
		c.progress(k)
	}
	return nil
}

// reconfigured fills in what an earlier reconfiguration of a side left in
// the datapath's two-path record (addSub): the side's delta (§3.4; Nd is
// what its egress subtracts from acks and echoed timestamps) and the nonce
// of its control messages (the left anchor's, §3.3). The protocol learns
// them from here when it meets the session afresh, after an agent restart:
// with a zero delta the side's next reconfiguration would compose a wrong
// one, and with the session's own nonce the other anchor's messages would
// be rejected.
//
// A side still in a reconfiguration (the agent restarted during it) is
// resumed (protocol.Resume) from the request the agent kept beside the
// record (datapath.TPReq): si describes the old path then, whose delta and
// nonce are those of the record before the request, if any.
func (c *control) reconfigured(id uint32, side protocol.Side, si *protocol.SideInfo) {
	k := datapath.TPKey{SessId: id, Side: uint32(side)}
	tp, ok := c.a.dp.TwoPath(k)
	if !ok {
		return
	}
	deltaOf := func(tp datapath.TPVal) protocol.Delta {
		return protocol.Delta{Seq: uint32(-tp.Nd.Ack), TS: uint32(-tp.Nd.Tsecr)}
	}
	if tp.State == datapath.TPNew {
		si.Delta, si.Nonce = deltaOf(tp), tp.Nonce
		return
	}
	rq, ok := c.a.dp.TPReqOf(k)
	if !ok {
		c.a.log.Warn("control: a reconfiguration left unfinished by an earlier agent cannot be resumed (no request recorded)",
			"session", id, "side", side.String())
		return
	}
	want := uint8(datapath.TPReqLeftAnchor)
	if side == protocol.SideLeft {
		want = datapath.TPReqRightAnchor
	}
	if rq.Role != want {
		c.a.log.Warn("control: a reconfiguration record does not match its side", "session", id, "side", side.String(), "role", rq.Role)
		return
	}
	si.Nonce = rq.OldNonce
	if rq.HasPrev != 0 {
		si.Delta = deltaOf(rq.Prev)
		c.prevTP[k] = rq.Prev
	}
	newSub := tp.NewOut.Wire() // as the side sends: from here to the new peer
	newPeer := newSub.Dst
	if side == protocol.SideLeft {
		newSub, newPeer = newSub.Reverse(), newSub.Dst
	}
	si.Resume = &protocol.Resume{
		Req:         protocol.ReqKey{LeftAnchor: addrFrom16(rq.LeftAnchor), ID: rq.Id},
		RightAnchor: addrFrom16(rq.RightAnchor),
		NewSub:      newSub, NewPeer: newPeer, NewNonce: tp.Nonce, NewDelta: deltaOf(tp),
		Switched: tp.State == datapath.TPActive || tp.State == datapath.TPStarting,
	}
}

// addrFrom16 reads an address kept in 16 bytes (IPv4 as IPv4-mapped).
func addrFrom16(b [16]byte) netip.Addr { return netip.AddrFrom16(b).Unmap() }

// resumeAll takes up the reconfigurations an earlier agent left unfinished
// (an agent restart): every session with a side in a reconfiguration, or
// with a lock the agent held as a middle agent of an old path
// (protocol.KeepLock), is announced to the protocol at once, which resumes
// them (reconfigured, SessionUp.Lock).
// A proxy's joined sessions are taken up first (resumeSpliced): the lock
// kept for one is under its client session, which must not be announced
// as a session of its own.
// Loop goroutine.
func (c *control) resumeAll() {
	c.resumeSpliced()
	ids := map[uint32]bool{}
	if err := c.a.dp.EachTwoPath(func(k datapath.TPKey, v datapath.TPVal) {
		if v.State != datapath.TPNew {
			ids[k.SessId] = true
		}
	}); err != nil {
		c.a.log.Warn("control: reconfigurations of an earlier agent", "err", err)
		return
	}
	if err := c.a.dp.EachLock(func(id uint32) { ids[id] = true }); err != nil {
		c.a.log.Warn("control: locks kept by an earlier agent", "err", err)
	}
	for id := range ids {
		if _, ok := c.pidOf[id]; ok {
			continue // a proxy's joined session, taken up already
		}
		if err := c.announce(id); err != nil {
			if _, ok := c.a.dp.Session(id); !ok {
				c.a.dp.DeleteLock(id) // kept for a session gone meanwhile
			}
			c.a.log.Warn("control: a reconfiguration of an earlier agent cannot be resumed", "session", id, "err", err)
			continue
		}
		c.a.log.Info("control: resumed a reconfiguration of an earlier agent", "session", id)
	}
}

// currentSub returns the subsession a side of session id (s at this host)
// sends on, written as its SYN went: from the side's two-path record once
// a reconfiguration has touched it, else from the side's egress flow, keyed
// on the left by the reverse of the session tuple and on the right by the
// onward tuple (behind a NAT, the middlebox's output: onward).
func (c *control) currentSub(id uint32, s *datapath.Session, side protocol.Side) (wire.Tuple, bool) {
	var out wire.Tuple
	if tp, ok := c.a.dp.TwoPath(datapath.TPKey{SessId: id, Side: uint32(side)}); ok && tp.State == datapath.TPNew {
		out = tp.NewOut.Wire()
	} else if ok {
		out = tp.OldOut.Wire() // in a reconfiguration: the old path (after an earlier one, not the flow's)
	} else {
		eg := s.Tuple.Wire().Reverse()
		if side == protocol.SideRight {
			eg = c.onward(id, s)
		}
		f, ok := c.a.dp.Flow(datapath.TupleFrom(eg))
		if !ok || f.SessId != id || f.Flags&datapath.FlIngress != 0 {
			return wire.Tuple{}, false
		}
		out = f.Out.Wire()
	}
	if side == protocol.SideLeft {
		return out.Reverse(), true
	}
	return out, true
}

// dpID maps a protocol session to its datapath session (0: none).
func (c *control) dpID(pid protocol.SessionID) uint32 {
	if id, ok := c.joinedDP[pid]; ok {
		return id
	}
	if pid&(1<<63) != 0 {
		return 0 // a joined session whose datapath state is gone
	}
	return uint32(pid)
}

// progress feeds the datapath's two-path variables of a side to the
// protocol.
func (c *control) progress(k datapath.TPKey) {
	tp, ok := c.a.dp.TwoPath(k)
	if !ok || tp.State != datapath.TPActive {
		return
	}
	pid, ok := c.pidOf[k.SessId]
	if !ok {
		return
	}
	c.handle(c.famOf[k.SessId], protocol.TwoPathProgress{Session: pid, Side: protocol.Side(k.Side), Vars: varsOf(tp)})
}

func varsOf(tp datapath.TPVal) protocol.TwoPath {
	return protocol.TwoPath{OldSent: tp.OldSent, OldRcvd: tp.OldRcvd, OldSentAcked: tp.OldSentAcked,
		OldRcvdAcked: tp.OldRcvdAcked, FirstNewRcvd: tp.FirstNewRcvd, NewRcvd: tp.NewRcvd != 0,
		AckHi: tp.AckHi, AckHiOK: tp.AckHiOk != 0}
}

// flowKeysOf returns the keys of a session's flows at this host, found
// from its tuple without walking the flow map: the egress flow of each
// direction, the ingress flow of the subsession each sends on, and the
// subsessions of its two-path records.
func (c *control) flowKeysOf(id uint32) []datapath.Tuple {
	s, ok := c.a.dp.Session(id)
	if !ok {
		return nil
	}
	seen := map[datapath.Tuple]bool{}
	var out []datapath.Tuple
	add := func(k datapath.Tuple) {
		if seen[k] {
			return
		}
		seen[k] = true
		if f, ok := c.a.dp.Flow(k); ok && f.SessId == id {
			out = append(out, k)
		}
	}
	t := s.Tuple.Wire()
	for _, eg := range []wire.Tuple{c.onward(id, &s), t.Reverse()} {
		k := datapath.TupleFrom(eg)
		if f, ok := c.a.dp.Flow(k); ok && f.SessId == id {
			add(k)
			add(datapath.TupleFrom(f.Out.Wire().Reverse()))
		}
	}
	for side := uint32(0); side < 2; side++ {
		if tp, ok := c.a.dp.TwoPath(datapath.TPKey{SessId: id, Side: side}); ok {
			add(tp.InOld)
			add(datapath.TupleFrom(tp.NewOut.Wire().Reverse()))
		}
	}
	return out
}

// poll is the safety net of the event ring: sides in their two-path phase,
// armed sides that switched by themselves, joined sessions becoming ready.
// The ring reports every change of the progress bits; the polling of
// active sides runs every tenth tick only, so that hundreds of concurrent
// reconfigurations do not cost a lookup each per tick, and each joined
// session is looked at less often the longer it stays idle (readyPoll).
func (c *control) poll() {
	c.ticks++
	if c.ticks%10 == 0 {
		for k := range c.active {
			tp, ok := c.a.dp.TwoPath(k)
			if !ok || tp.State == datapath.TPNew {
				delete(c.active, k)
				continue
			}
			c.progress(k)
		}
	}
	t := time.Now()
	for pid, r := range c.notReady {
		if t.Before(r.next) {
			continue
		}
		if !c.checkReady(pid) {
			r.every = min(2*r.every, readyPollMax)
			r.next = t.Add(r.every)
		}
	}
}

// readyPoll is when to look again whether a joined session's datapath saw
// packets both ways. The look costs a dozen map reads, and a session may
// stay idle for long: each session is looked at less and less often (from
// every tick up to readyPollMax), and at once when a request needs it
// (checkReady).
type readyPoll struct {
	id    uint32
	next  time.Time
	every time.Duration
}

const readyPollMax = time.Second

// checkReady tells the protocol that a joined session is ready once its
// datapath has seen packets both ways, and reports whether it is.
func (c *control) checkReady(pid protocol.SessionID) bool {
	r, ok := c.notReady[pid]
	if !ok {
		return true
	}
	in0, in1 := false, false
	for _, k := range c.flowKeysOf(r.id) {
		f, ok := c.a.dp.Flow(k)
		if ok && f.Flags&datapath.FlIngress != 0 && f.Marked() {
			if f.Dir() == 0 {
				in0 = true
			} else {
				in1 = true
			}
		}
	}
	if !in0 || !in1 {
		return false
	}
	delete(c.notReady, pid)
	c.handle(c.famOf[r.id], protocol.DatapathReady{Session: pid})
	return true
}

// sessionsEnded is called by the collector with the sessions it ended.
func (c *control) sessionsEnded(ids []uint32) {
	c.post(func() {
		for _, id := range ids {
			delete(c.onwardOf, id)
			pid, ok := c.pidOf[id]
			if !ok {
				continue
			}
			c.handle(c.famOf[id], protocol.SessionEnd{Session: pid, Cause: "ended"})
			c.forget(id, pid)
			if p, ok := c.spliced[pid]; ok {
				// One of a proxy's joined sessions ended, and the joined
				// session with it: nothing of it is to be taken up after
				// a restart (the record and a kept lock are under the
				// client's session, which may outlive the server's).
				delete(c.spliced, pid)
				c.a.dp.DeleteReconfigState(p.client)
			}
		}
	})
}

func (c *control) forget(id uint32, pid protocol.SessionID) {
	c.drop(id, pid)
	c.a.dp.DeleteReconfigState(id)
}

// drop is forget for a session whose datapath state is freed already.
func (c *control) drop(id uint32, pid protocol.SessionID) {
	delete(c.onwardOf, id)
	delete(c.pidOf, id)
	delete(c.famOf, id)
	delete(c.joinedDP, pid)
	delete(c.notReady, pid)
	for side := uint32(0); side < 2; side++ {
		k := datapath.TPKey{SessId: id, Side: side}
		delete(c.active, k)
		delete(c.prevTP, k)
	}
}

func (c *control) countReject(reason string) {
	v, _ := c.rejected.LoadOrStore(reason, new(atomic.Uint64))
	v.(*atomic.Uint64).Add(1)
}

// rejectedCounts returns the refused control messages by reason.
func (c *control) rejectedCounts() map[string]uint64 {
	out := map[string]uint64{}
	c.rejected.Range(func(k, v any) bool {
		out[k.(string)] = v.(*atomic.Uint64).Load()
		return true
	})
	return out
}

// views returns the protocol's view of the sessions it knows, by datapath id.
func (c *control) views() map[uint32]protocol.SessionView {
	out := map[uint32]protocol.SessionView{}
	done := make(chan struct{})
	c.post(func() {
		defer close(done)
		for id, pid := range c.pidOf {
			if p := c.protos[c.famOf[id]]; p != nil {
				if v, ok := p.View(pid); ok {
					out[id] = v
				}
			}
		}
	})
	<-done
	return out
}

// historyLen bounds the results kept for `dysco reconfig history`.
const historyLen = 4096

// waited is what a caller waiting for a request's result gets: the result
// and its record as `dysco reconfig history` shows it (times measured when
// the result came, not when the caller looked).
type waited struct {
	res protocol.Result
	rec api.ReconfigResult
}

// record keeps a result (loop goroutine) and returns the record.
func (c *control) record(x protocol.Result, rep api.MigrationReport, hasRep bool) api.ReconfigResult {
	// The time first: what follows is this record's bookkeeping, not the
	// reconfiguration's.
	at, timed := c.started[x.Token]
	took := time.Since(at)
	r := api.ReconfigResult{ID: c.dpID(x.Session), Outcome: x.Outcome.String(), Reason: reasonText(x), Blocker: blockerText(x),
		Unchanged: x.Unchanged}
	if hasRep {
		r.Migration = &rep
		if rep.Error != "" {
			r.Reason = joinNote(r.Reason, rep.Error)
		}
	}
	if s, ok := c.a.dp.Session(r.ID); ok {
		r.Session = s.Tuple.Wire().String()
	}
	if timed {
		r.Micros = took.Microseconds()
		delete(c.started, x.Token)
		if ph, ok := c.phases[x.Req]; ok {
			if !ph.locked.IsZero() {
				r.LockMicros = ph.locked.Sub(at).Microseconds()
			}
			if !ph.twoPath.IsZero() {
				r.SetupMicros = ph.twoPath.Sub(at).Microseconds()
			}
		}
	}
	delete(c.phases, x.Req)
	if len(c.history) >= historyLen {
		c.history = append(c.history[:0], c.history[len(c.history)-historyLen/2:]...)
	}
	c.history = append(c.history, r)
	return r
}

// phaseTimes are when a request this host is the left anchor of reached
// its phases (api.ReconfigResult's LockMicros and SetupMicros).
type phaseTimes struct{ locked, twoPath time.Time }

// maxPhases bounds c.phases: requests whose result never comes (an agent
// stopped mid-way cannot happen, but a protocol bug must not grow memory).
const maxPhases = 1 << 16

// notePhase records the phases of the left anchor's requests.
func (c *control) notePhase(x protocol.Progress) {
	if x.Role != protocol.RoleLeftAnchor {
		return
	}
	if c.phases == nil || len(c.phases) >= maxPhases {
		c.phases = map[protocol.ReqKey]phaseTimes{}
	}
	ph := c.phases[x.Req]
	switch x.Stage {
	case protocol.StageSettingUp: // reported again when a gated new path is ready
		if !ph.locked.IsZero() {
			return
		}
		ph.locked = time.Now()
	case protocol.StageTwoPath:
		if !ph.twoPath.IsZero() {
			return
		}
		ph.twoPath = time.Now()
	default:
		return
	}
	c.phases[x.Req] = ph
}

// reconfigHistory returns the results kept.
func (c *control) reconfigHistory() []api.ReconfigResult {
	var out []api.ReconfigResult
	done := make(chan struct{})
	c.post(func() {
		out = append([]api.ReconfigResult{}, c.history...)
		close(done)
	})
	<-done
	return out
}

// ---- actions ----

func (c *control) do(v6 bool, act protocol.Action) error {
	dp := c.a.dp
	switch x := act.(type) {
	case protocol.Send:
		c.send(x.To, x.Data)
		return nil
	case protocol.SetTimer:
		k := timerKey{v6, x.ID}
		if t := c.timers[k]; t != nil {
			t.Stop()
		}
		d := x.At - now()
		c.timers[k] = time.AfterFunc(max(d, 0), func() {
			c.post(func() {
				if c.timers[k] == nil {
					return
				}
				delete(c.timers, k)
				c.handle(v6, protocol.TimerFired{ID: x.ID})
			})
		})
	case protocol.CancelTimer:
		k := timerKey{v6, x.ID}
		if t := c.timers[k]; t != nil {
			t.Stop()
			delete(c.timers, k)
		}
	case protocol.AddSubsession:
		// The protocol sends before it installs (docs/protocol.md,
		// settingUp): the map work need not delay the SYN.
		c.flush()
		return c.addSub(x)
	case protocol.StartTwoPath:
		k := datapath.TPKey{SessId: c.dpID(x.Session), Side: uint32(x.Side)}
		// EBUSY: the side's first new-path packet is starting it right
		// now (an armed record); it reports progress itself.
		if err := dp.StartTwoPath(k); err != nil && !errors.Is(err, syscall.EBUSY) {
			return err
		}
		c.active[k] = true
		if c.rightHolds[k] != nil {
			// A right anchor that held its packets for a state migration:
			// they go on the new path now.
			c.deferred = append(c.deferred, func() { c.releaseRightHold(k) })
		}
		// The variables at the cut-off: enough to finish at once when
		// nothing was in flight. After the current actions (never
		// c.post from the loop itself: with its channel full it would
		// wait for itself).
		c.deferred = append(c.deferred, func() { c.progress(k) })
	case protocol.EndTwoPath:
		k := datapath.TPKey{SessId: c.dpID(x.Session), Side: uint32(x.Side)}
		delete(c.active, k)
		delete(c.prevTP, k)
		if tp, ok := dp.TwoPath(k); ok {
			// The new ingress flow inherits what arrived on the old path.
			_ = dp.MergeMarks(tp.InOld, datapath.TupleFrom(tp.NewOut.Wire().Reverse()))
		}
		dp.DeleteTPReq(k)
		// FINs that went on the old path: the new path's middleboxes
		// never saw them (protocol.FinsSeen). After the current actions.
		id, sess := k.SessId, x.Session
		c.deferred = append(c.deferred, func() {
			if s, ok := dp.Session(id); ok && s.State&(datapath.StFINFwd|datapath.StFINRev) != 0 {
				c.handle(v6, protocol.FinsSeen{Session: sess, Fwd: s.State&datapath.StFINFwd != 0, Rev: s.State&datapath.StFINRev != 0})
			}
		})
		return dp.SetTwoPathState(k, datapath.TPNew)
	case protocol.RemoveSubsession:
		if x.Side == protocol.SideLeft {
			// A right anchor's request ended before the switch.
			k := datapath.TPKey{SessId: c.dpID(x.Session), Side: uint32(x.Side)}
			c.deferred = append(c.deferred, func() { c.releaseRightHold(k) })
		}
		return c.removeSub(x)
	case protocol.NewPathReady:
		c.onNewPathReady(v6, x)
	case protocol.SetWindowClamp:
		k := datapath.TPKey{SessId: c.dpID(x.Session), Side: uint32(x.Side)}
		if err := dp.SetWindowClamp(k, x.Bytes); !errors.Is(err, syscall.ENOENT) {
			return err // nil, or a failure; ENOENT: the side's record is gone
		}
		return nil
	case protocol.JoinSession:
		c.flush() // as AddSubsession: the SYN goes on first
		if err := c.join(v6, x); err != nil {
			// The protocol must not go on with a path this host does
			// not carry: it refuses the new path (after the current
			// actions).
			c.deferred = append(c.deferred, func() { c.handle(v6, protocol.JoinFailed{Session: x.Session}) })
			return err
		}
		return nil
	case protocol.KeepLock:
		// A middle agent's lock, for its next run if it restarts (§3.2):
		// announce gives it back (SessionUp.Lock), and resumeSpliced for
		// a proxy's joined session (kept under its client session, whose
		// id is the joined session's). The protocol emits it
		// after the ackLock it passes on, which leaves first: the map
		// write (some 20 µs here) is not on the request's path.
		c.flush()
		id := c.dpID(x.Session)
		if id == 0 || c.pidOf[id] != x.Session {
			// A session freed meanwhile (a new path through this host
			// took its place): nothing to keep.
			return nil
		}
		if x.Req.IsZero() {
			dp.DeleteLock(id)
			return nil
		}
		return dp.PutLock(id, x.Req.LeftAnchor.As16(), x.Req.ID)
	case protocol.FreeSession:
		if p, ok := c.spliced[x.Session]; ok {
			delete(c.spliced, x.Session)
			c.freeSpliced(p)
			c.forget(p.client, x.Session)
			c.forget(p.server, x.Session)
			return nil
		}
		id := c.dpID(x.Session)
		if id == 0 || c.pidOf[id] != x.Session {
			return nil // freed already (a new path through this host took its place)
		}
		c.releaseExported(id)
		for _, side := range []uint32{0, 1} {
			k := datapath.TPKey{SessId: id, Side: side}
			c.deferred = append(c.deferred, func() { c.releaseRightHold(k) })
		}
		c.free(id)
		c.drop(id, x.Session)
	case protocol.MarkClosed:
		id := c.dpID(x.Session)
		if id == 0 {
			return nil
		}
		var dirs uint32
		if x.Fwd {
			dirs |= datapath.StFINFwd
		}
		if x.Rev {
			dirs |= datapath.StFINRev
		}
		return dp.MarkClosed(id, dirs)
	case protocol.Result:
		c.migrationEnded(x.Token)
		rep, hasRep := c.migReports[x.Token]
		delete(c.migReports, x.Token)
		rec := c.record(x, rep, hasRep)
		if ch, ok := c.migOut[x.Token]; ok {
			delete(c.migOut, x.Token)
			ch <- rep
		}
		if ch, ok := c.waiters[x.Token]; ok {
			delete(c.waiters, x.Token)
			ch <- waited{res: x, rec: rec}
		}
		c.a.log.Info("reconfiguration", "session", x.Session, "req", x.Req.String(), "outcome", x.Outcome.String(),
			"reason", x.Reason.String(), "blocker", x.Blocker.String())
	case protocol.Rejected:
		c.countReject(x.Reason.String())
		c.a.log.Debug("control message refused", "reason", x.Reason.String(), "type", x.Type.String(), "from", x.From, "detail", x.Detail)
	case protocol.Progress:
		c.notePhase(x)
		c.a.log.Debug("reconfiguration progress", "session", x.Session, "req", x.Req.String(), "role", x.Role.String(), "stage", x.Stage.String(), "note", x.Note)
	}
	return nil
}

// addSub installs a new subsession on a side (protocol.AddSubsession): its
// ingress flow with the side's translation, and the side's two-path record,
// then points the side's flows at the record.
func (c *control) addSub(x protocol.AddSubsession) error {
	dp := c.a.dp
	id := c.dpID(x.Session)
	s, ok := dp.Session(id)
	if !ok {
		return fmt.Errorf("no datapath session %d", id)
	}
	t := s.Tuple.Wire()
	// On the right the session leaves with its onward tuple, and the new
	// subsession's packets enter as the reverse of it (behind a NAT, what
	// the middlebox expects back).
	on := t
	if x.Side == protocol.SideRight {
		on = c.onward(id, &s)
	}
	eg, newOut, inFlow := on, x.Sub, datapath.Flow{Out: datapath.EndsFrom(on.Reverse()), SessId: id,
		Flags: datapath.FlIngress | datapath.FlRev | datapath.FlEst | datapath.FlTPNew | datapath.FlDelta}
	sndWS := s.Ws[0]
	if x.Side == protocol.SideLeft {
		eg, newOut = t.Reverse(), x.Sub.Reverse()
		inFlow.Out, inFlow.Flags = datapath.EndsFrom(t), datapath.FlIngress|datapath.FlEst|datapath.FlTPNew|datapath.FlDelta
		sndWS = s.Ws[1]
	}
	if sndWS == 0xff {
		sndWS = 0
	}
	egKey := datapath.TupleFrom(eg)
	k := datapath.TPKey{SessId: id, Side: uint32(x.Side)}
	tp := datapath.TPVal{State: datapath.TPIdle, EgKey: egKey, NewOut: datapath.TupleFrom(newOut), SndWs: sndWS, Nonce: x.Nonce}
	if x.Armed {
		tp.Armed = 1
	}
	if c.holds != nil {
		// This agent reads the hold ring: the datapath hands it packets
		// straddling the cut-off to split (holds.split).
		tp.Split = 1
	}
	if old, ok := dp.TwoPath(k); ok {
		if old.State != datapath.TPNew {
			return fmt.Errorf("side %s of session %d is already in a reconfiguration", x.Side, id)
		}
		// A second reconfiguration: the previous new path is the old
		// one now, with its translation.
		c.prevTP[k] = old
		tp.OldOut, tp.RerouteOld = old.NewOut, old.RerouteNew
		// Its ingress flow stops being a new subsession before the armed
		// record goes in: the datapath would take its packets for the
		// first on the new path and start this side at once, sending on
		// a path the other anchor may not receive on yet (it installs
		// after its SYN) — a reset of the session.
		if err := dp.SetFlowFlags(datapath.TupleFrom(old.NewOut.Wire().Reverse()), 0, datapath.FlTPNew); err != nil {
			return err
		}
		if err := dp.PutDelta(egKey, old.Nd); err != nil {
			return err
		}
		if err := dp.SetFlowFlags(egKey, datapath.FlDelta, 0); err != nil {
			return err
		}
	} else {
		f, ok := dp.Flow(egKey)
		if !ok || f.SessId != id {
			return fmt.Errorf("session %d has no egress flow %s", id, eg)
		}
		tp.OldOut = f.Out.Tuple()
		if f.Flags&datapath.FlReroute != 0 {
			tp.RerouteOld = 1
		}
	}
	tp.InOld = datapath.TupleFrom(tp.OldOut.Wire().Reverse())
	if !c.a.sameRoute(eg.Dst, newOut.Dst) {
		tp.RerouteNew = 1
	}
	tp.Nd = datapath.Delta{Ack: -int32(x.Delta.Seq), Tsecr: -int32(x.Delta.TS)}
	in := datapath.Delta{Seq: int32(x.Delta.Seq), Tsval: int32(x.Delta.TS), WsIn: x.WScaleIn, WsOut: x.WScaleOut}
	if x.WScaleIn != x.WScaleOut {
		in.WsOn = 1
	}
	newIn := datapath.TupleFrom(newOut.Reverse())
	// What a restarted agent needs to resume the request (reconfigured).
	rq := datapath.TPReq{LeftAnchor: x.Req.LeftAnchor.As16(), Id: x.Req.ID, RightAnchor: x.RightAnchor.As16(),
		OldNonce: x.OldNonce, Role: datapath.TPReqLeftAnchor}
	if x.Side == protocol.SideLeft {
		rq.Role = datapath.TPReqRightAnchor
	}
	if prev, ok := c.prevTP[k]; ok {
		rq.Prev, rq.HasPrev = prev, 1
	}
	kept, err := dp.AddSubsession(k, newIn, inFlow, in, tp, rq)
	if err != nil {
		return err
	}
	if !kept {
		// The reconfiguration goes on; only an agent restart in its
		// middle could not resume it.
		c.a.log.Warn("control: cannot record the request of a reconfiguration", "session", id)
	}
	return nil
}

// removeSub deletes a subsession's ingress flow. Removing the new one of a
// side that has not switched to it is a cancellation (§3.6): the side goes
// back to what it was.
func (c *control) removeSub(x protocol.RemoveSubsession) error {
	dp := c.a.dp
	id := c.dpID(x.Session)
	k := datapath.TPKey{SessId: id, Side: uint32(x.Side)}
	out := x.Sub
	if x.Side == protocol.SideLeft {
		out = x.Sub.Reverse()
	}
	in := datapath.TupleFrom(out.Reverse())
	tp, ok := dp.TwoPath(k)
	// An old path removed after its linger leaves its marks behind: the
	// side's end of the two-path phase (EndTwoPath) merged them into the
	// new ingress flow, and what arrives on the old path after it carries
	// nothing beyond them (all of the other side's old data had arrived,
	// and ours had been acknowledged). Merging again here, seconds later,
	// compared marks that a fast session had moved more than 3 GiB apart
	// on the new path meanwhile: in 32-bit sequence space the old mark
	// then looked up to 2^30 ahead, replaced the new one, and the next
	// reconfiguration's cut-off came from it (the session stalled;
	// TestReconfigureMonitor at 9 Gbit/s, three seconds of linger).
	dp.DeleteFlow(in)
	if !ok || tp.NewOut != datapath.TupleFrom(out) || tp.State == datapath.TPNew {
		return nil
	}
	delete(c.active, k)
	_ = dp.SetFlowFlags(tp.InOld, 0, datapath.FlTPOld)
	if prev, ok := c.prevTP[k]; ok {
		delete(c.prevTP, k)
		_ = dp.SetFlowFlags(tp.EgKey, 0, datapath.FlDelta)
		dp.DeleteDelta(tp.EgKey)
		dp.DeleteTPReq(k)
		return dp.PutTwoPath(k, prev) // hash map update: the variables are not in use
	}
	if err := dp.SetFlowFlags(tp.EgKey, 0, datapath.FlTPOut); err != nil {
		return err
	}
	dp.DeleteTwoPath(k)
	return nil
}

// join creates the state of a middlebox joining a new path (§3.1): a
// session with the tuple of the session and its two subsessions.
func (c *control) join(v6 bool, x protocol.JoinSession) error {
	dp := c.a.dp
	t, l, r := x.Tuple, x.Left.Sub, x.Right.Sub
	// The SYN was checked when it came (onPacket: liveHere), but the
	// session may have come through this host since.
	if _, live := c.liveHere(t, x.Nonce); live {
		return fmt.Errorf("join: session %s is already on a live path through this host", t)
	}
	sess := datapath.Session{Tuple: datapath.EndsFrom(t), Nonce: x.Nonce, Role: datapath.RoleMiddle,
		State: datapath.StSYN | datapath.StSYNACK | datapath.StEst | datapath.StSetupDone}
	if v6 {
		sess.IsV6 = 1
	}
	sess.Ws = [2]uint8{0xff, 0xff}
	sess.CreatedMs = datapath.Now()
	sess.LastMs = sess.CreatedMs
	reroute := func(from, to netip.Addr) uint32 {
		if from == to || c.a.sameRoute(from, to) {
			return 0
		}
		return datapath.FlReroute | datapath.FlRouted
	}
	tap := uint32(0)
	if c.a.cfg.Tap != "" {
		tap = datapath.FlTap
	}
	// This host may still hold the session from an old path being torn
	// down (both anchors' fins have passed it, it lingers to pass
	// retransmissions), or from a session that has ended: the new path
	// replaces it.
	for _, k := range []wire.Tuple{l, t, r.Reverse(), t.Reverse()} {
		f, ok := dp.Flow(datapath.TupleFrom(k))
		if !ok {
			continue
		}
		old := f.SessId
		pid, known := c.pidOf[old]
		c.a.log.Info("join: the old path's state of the session gives way to the new path", "session", t.String(), "old_id", old)
		c.free(old) // while its onward tuple is still known
		if known {
			// The protocol forgets it as if the collector had ended it
			// (after the current actions): its datapath state is gone.
			fam := c.famOf[old]
			c.drop(old, pid)
			c.deferred = append(c.deferred, func() { c.handle(fam, protocol.SessionEnd{Session: pid, Cause: "replaced"}) })
		}
	}
	id, err := dp.InsertSession(sess)
	if err != nil {
		return err
	}
	flows := []struct {
		k datapath.Tuple
		f datapath.Flow
	}{
		{datapath.TupleFrom(l), datapath.Flow{Out: datapath.EndsFrom(t), SessId: id, Flags: datapath.FlIngress | datapath.FlEst | tap}},
		{datapath.TupleFrom(t), datapath.Flow{Out: datapath.EndsFrom(r), SessId: id, Flags: datapath.FlEst | reroute(t.Dst, r.Dst)}},
		{datapath.TupleFrom(r.Reverse()), datapath.Flow{Out: datapath.EndsFrom(t.Reverse()), SessId: id, Flags: datapath.FlIngress | datapath.FlRev | datapath.FlEst | tap}},
		{datapath.TupleFrom(t.Reverse()), datapath.Flow{Out: datapath.EndsFrom(l.Reverse()), SessId: id, Flags: datapath.FlRev | datapath.FlEst | reroute(t.Src, l.Src)}},
	}
	for i, fl := range flows {
		if err := dp.AddFlow(fl.k, fl.f); err != nil {
			for _, g := range flows[:i] {
				dp.DeleteFlow(g.k)
			}
			dp.DeleteSession(id)
			return err
		}
	}
	c.joinedDP[x.Session] = id
	c.pidOf[id], c.famOf[id] = x.Session, v6
	c.notReady[x.Session] = &readyPoll{id: id, every: 20 * time.Millisecond}
	return nil
}

// free deletes a session and everything of it at this host (one system
// call: datapath.FreeSession). Should that fail, the collector still ends
// the session when it falls idle, and its flows with it.
func (c *control) free(id uint32) {
	if _, err := c.a.dp.FreeSession(id, c.onwardKey(id)); err != nil {
		c.a.log.Warn("control: cannot free a session's state; the collector will", "id", id, "err", err)
	}
}

// ---- requests from the local API ----

// reconfigure runs a reconfiguration of each session in ids, as left
// anchor, and waits for the results (or the deadline).
func (c *control) reconfigure(ctx context.Context, ids []uint32, to netip.Addr, chain []netip.Addr, mig *MigrateOptions) []reconfigOutcome {
	type pending struct {
		id    uint32
		ch    chan waited
		mig   chan api.MigrationReport
		start time.Time
		err   error
	}
	ps := make([]*pending, len(ids))
	done := make(chan struct{})
	c.post(func() {
		for i, id := range ids {
			p := &pending{id: id, ch: make(chan waited, 1), start: time.Now()}
			ps[i] = p
			if err := c.announce(id); err != nil {
				p.err = err
				continue
			}
			if err := c.sameFamily(id, to); err != nil {
				p.err = err
				continue
			}
			c.checkReady(c.pidOf[id])
			c.token++
			c.waiters[c.token] = p.ch
			c.started[c.token] = p.start
			if mig != nil {
				p.mig = make(chan api.MigrationReport, 1)
				c.startMigration(c.token, *mig, p.start, p.mig)
			}
			c.handle(c.famOf[id], protocol.Reconfigure{Session: c.pidOf[id], RightAnchor: to, Chain: chain, Token: c.token, Gate: mig != nil})
		}
		close(done)
	})
	select {
	case <-done:
	case <-ctx.Done():
		return nil
	}
	out := make([]reconfigOutcome, len(ps))
	for i, p := range ps {
		out[i].id = p.id
		if p.err != nil {
			out[i].outcome, out[i].reason = "refused", p.err.Error()
			continue
		}
		select {
		case w := <-p.ch:
			out[i].res, out[i].rec = &w.res, w.rec
			if p.mig != nil {
				rep := <-p.mig // sent with the result
				out[i].mig = &rep
			}
		case <-ctx.Done():
			out[i].outcome, out[i].reason = "failed", "no result before the deadline"
		}
	}
	return out
}

// sameFamily refuses a right anchor of another address family than the
// session's (announced) id: the new path carries the same TCP session. The
// protocol would refuse it too, as an invalid request; this says why.
func (c *control) sameFamily(id uint32, to netip.Addr) error {
	if v6 := c.famOf[id]; v6 == to.Unmap().Is4() {
		return fmt.Errorf("the session is %s and the right anchor %s is not: a new path keeps the session's address family", famName(v6), to)
	}
	return nil
}

// famName names an address family for messages.
func famName(v6 bool) string {
	if v6 {
		return "IPv6"
	}
	return "IPv4"
}

type reconfigOutcome struct {
	mig     *api.MigrationReport
	id      uint32
	res     *protocol.Result
	rec     api.ReconfigResult // with res: as history records it
	outcome string
	reason  string
}
