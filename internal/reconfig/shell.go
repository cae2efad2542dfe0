package reconfig

import (
	"context"
	"fmt"
	"log/slog"
	"net/netip"
	"sync"
	"sync/atomic"
	"time"

	"github.com/dysco/dysco/internal/api"
	"github.com/dysco/dysco/internal/datapath"
	"github.com/dysco/dysco/internal/migrate"
	"github.com/dysco/dysco/internal/protocol"
)

// DefaultControlPort is the UDP port of the reconfiguration protocol.
const DefaultControlPort = 4790

// controlPortBase and controlPortCount bound the ports of subsessions made
// by reconfigurations, apart from the datapath's set-up range.
const (
	controlPortBase  = 61000
	controlPortCount = 4000
)

// Config is what a Shell needs from its agent.
type Config struct {
	// Port is the control port (UDP) of every agent; Keys the keys that
	// authenticate control messages (SetKeys changes them).
	Port int
	Keys *protocol.Keys
	// SourceAddr returns the address a datagram to to leaves this host
	// from, which the control messages' MAC covers; nil, or an invalid
	// answer: the host's address of the family (SelfAddr).
	SourceAddr func(to netip.Addr) netip.Addr
	// Datapath is the host's datapath (a *datapath.Datapath, or a fake in
	// tests).
	Datapath Datapath
	// Conn is the control socket; nil opens a UDP socket on Port.
	Conn Conn
	Log  *slog.Logger
	// SelfAddr returns the host's address of a family that other agents
	// name it by (invalid if it has none).
	SelfAddr func(v6 bool) netip.Addr
	// SameRoute reports whether two addresses leave this host by the same
	// route (a new subsession to another next hop needs re-routing).
	SameRoute func(x, y netip.Addr) bool
	// Tap: joined sessions are shown on the session-view tap.
	Tap bool
	// States are the state migration plug-ins (a *migrate.Set); nil: none.
	States StatePlugins
	// NFs starts the network functions new paths name for this host
	// (nf.go); nil: none (such a new path is refused).
	NFs NFManager
	// Tune, if set, changes the protocol core's configuration after the
	// shell's defaults (tests: shorter timers).
	Tune func(*protocol.Config)
}

// Shell is the reconfiguration machinery of one agent: the shell around
// the protocol core, as raft's node is to its state machine. It owns the
// session index (datapath ids and protocol ids), the timers and the
// control socket, and turns the core's actions into datapath calls.
type Shell struct {
	cfg  Config
	dp   Datapath
	log  *slog.Logger
	conn Conn
	port int
	keys *protocol.Keys

	// mu guards everything below: whoever holds it is "the loop" (the
	// comments' loop goroutine). Taken by run for posted work and ticks, by
	// readLoop for each control message and by eventLoop for each datapath
	// event: a message is handled by the goroutine that read it, with no
	// hand-off to another goroutine (one thread wake-up less per message;
	// reconfigurations in an idle lab took 0.8 × the time they took with
	// the hand-off, BENCHMARKS.md).
	mu        sync.Mutex
	protos    map[bool]*protocol.Agent // by "is IPv6"
	timers    map[timerKey]*time.Timer
	joinedDP  map[protocol.SessionID]uint32 // protocol-made sessions → datapath id
	pidOf     map[uint32]protocol.SessionID // datapath id → protocol id, for every session the protocol knows
	famOf     map[uint32]bool
	notReady  map[protocol.SessionID]*readyPoll // joined sessions waiting for packets both ways
	waiters   map[uint64]chan waited
	started   map[uint64]time.Time           // when each request (token) began
	phases    map[protocol.ReqKey]phaseTimes // the left anchor's requests: when they reached their phases
	history   []api.ReconfigResult           // the last historyLen results at this left anchor
	active    map[datapath.TPKey]bool        // sides in their two-path phase (polled as a safety net)
	prevTP    map[datapath.TPKey]datapath.TPVal
	spliced   map[protocol.SessionID]splicedPair
	trigWaits map[uint64]*trigWait // triggers this agent sent, by token
	nfOf      map[uint32]string    // joined sessions → the network function they use (nf.go)
	// otherVersion: peers logged as speaking another control protocol
	// version (olderPeer).
	otherVersion map[netip.Addr]bool
	token        uint64
	ticks        uint64
	deferred     []func() // work of the loop itself, run after the current event's actions

	// Sessions leaving this host with another tuple than they arrived
	// with (onward.go), and when the flows were last walked for them.
	onwardOf      map[uint32]onwardEntry
	onwardScanAt  time.Time
	onwardScanned bool

	// State migration (migrate.go).
	holds *holds // nil: the datapath cannot hold packets
	// holder holds packets for migrations (holds, or a fake in tests);
	// migHolds are the holds it keeps, by side.
	holder   packetHolder
	migHolds map[datapath.TPKey]heldPackets
	// rebindHolds hold the packets a side sends while its rebind runs
	// (rebind.go), by datapath session.
	rebindHolds map[uint32]heldPackets
	states      StatePlugins
	migrations  map[uint64]*migration // by token, at the left anchor
	migReports  map[uint64]api.MigrationReport
	migOut      map[uint64]chan api.MigrationReport

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

	// rebinds wait for their results, by token (rebind.go); rebindsDone
	// and rebindsFailed count this agent's, rebindsIn those it accepted.
	rebinds                               map[uint64]chan protocol.RebindResult
	rebindsDone, rebindsFailed, rebindsIn atomic.Uint64

	rejected sync.Map // reason string → *atomic.Uint64
	msgsIn   atomic.Uint64
	msgsOut  atomic.Uint64
	// Datagrams, each one message or a bundle of several.
	dgramsIn, dgramsOut atomic.Uint64

	// outbox holds what the current step of the loop sends (guarded by
	// mu); a step queues a few messages, so send scans it.
	outbox []outMsg
}

type timerKey struct {
	v6 bool
	id protocol.TimerID
}

// New makes the shell of one agent: it opens the control socket (unless
// cfg.Conn is given) and reserves request numbers in the datapath. Run
// serves it.
func New(cfg Config) (*Shell, error) {
	if cfg.Log == nil {
		cfg.Log = slog.Default()
	}
	if cfg.SameRoute == nil {
		cfg.SameRoute = func(x, y netip.Addr) bool { return true }
	}
	conn := cfg.Conn
	if conn == nil {
		var err error
		if conn, err = listenUDP(cfg.Port); err != nil {
			return nil, err
		}
	}
	c := &Shell{cfg: cfg, dp: cfg.Datapath, log: cfg.Log, conn: conn, port: cfg.Port, keys: cfg.Keys, states: cfg.States,
		protos: map[bool]*protocol.Agent{}, timers: map[timerKey]*time.Timer{},
		nfOf:     map[uint32]string{},
		joinedDP: map[protocol.SessionID]uint32{}, pidOf: map[uint32]protocol.SessionID{}, famOf: map[uint32]bool{},
		notReady: map[protocol.SessionID]*readyPoll{}, waiters: map[uint64]chan waited{}, started: map[uint64]time.Time{},
		active: map[datapath.TPKey]bool{}, prevTP: map[datapath.TPKey]datapath.TPVal{}, spliced: map[protocol.SessionID]splicedPair{},
		onwardOf:  map[uint32]onwardEntry{},
		trigWaits: map[uint64]*trigWait{}, rebinds: map[uint64]chan protocol.RebindResult{}, otherVersion: map[netip.Addr]bool{}, wake: make(chan struct{}, 1),
		migrations: map[uint64]*migration{}, migReports: map[uint64]api.MigrationReport{},
		migHolds: map[datapath.TPKey]heldPackets{}, rebindHolds: map[uint32]heldPackets{}, migOut: map[uint64]chan api.MigrationReport{},
		// Tokens name this agent's requests and triggers; they stay
		// below the tokens of requests the protocol starts for
		// triggers (protocol.Config.TriggerTokens, from 2^63).
		token: uint64(time.Now().UnixNano())}
	if s, ok := cfg.States.(*migrate.Set); ok && s == nil {
		c.states = nil // a nil *migrate.Set: no plug-ins
	}
	if err := c.loadReqs(); err != nil {
		conn.Close()
		return nil, fmt.Errorf("reconfig: request numbers: %w", err)
	}
	hs, err := newHolds(c.dp, func(msg string, args ...any) { c.log.Warn(msg, args...) })
	if err != nil {
		c.log.Warn("state migration disabled: the datapath cannot hold packets", "err", err)
	} else {
		c.holds, c.holder = hs, hs
	}
	c.setSplitReader(c.holds != nil)
	return c, nil
}

// proto returns the protocol agent of a family, creating it with this
// host's first address of the family; nil if the host has none.
func (c *Shell) proto(v6 bool) *protocol.Agent {
	if p := c.protos[v6]; p != nil {
		return p
	}
	self := c.cfg.SelfAddr(v6)
	if !self.IsValid() {
		return nil
	}
	cfg := protocol.DefaultConfig(self, c.keys)
	cfg.Source = c.cfg.SourceAddr
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
		// pidOf...): their joined sessions must not share ids, nor
		// their triggered requests tokens.
		cfg.JoinedBase = protocol.JoinedBase6
		cfg.TriggerTokens = protocol.TriggerTokens6
	}
	if c.cfg.Tune != nil {
		c.cfg.Tune(&cfg)
	}
	p := protocol.New(cfg)
	c.protos[v6] = p
	return p
}

// SetKeys changes the keys of control messages (a rotation of the
// deployment secrets): messages sent from now on are signed by the first,
// those received are checked against each.
func (c *Shell) SetKeys(k *protocol.Keys) {
	c.locked(func() {
		c.keys = k
		for _, p := range c.protos {
			p.SetKeys(k)
		}
	})
}

// Run serves until ctx ends.
func (c *Shell) Run(ctx context.Context) {
	// Sessions left in the middle of a reconfiguration by an earlier agent
	// first, then the messages (they wait in the socket meanwhile).
	c.locked(c.resumeAll)
	go c.readLoop()
	if er, err := c.dp.EventReader(); err == nil {
		go c.eventLoop(er)
		defer er.Close()
	} else {
		c.log.Warn("control: no datapath events; polling only", "err", err)
	}
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	defer c.conn.Close()
	leased := time.Now() // the split lease was taken in New
	for {
		select {
		case <-ctx.Done():
			if c.holds != nil {
				c.setSplitReader(false)
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
				c.setSplitReader(true)
				leased = time.Now()
			}
			c.locked(c.poll)
		}
	}
}

// locked runs f as one step of the loop: holding mu, then the work f
// deferred, then the step's sends (f is one item, or sends per item
// itself).
func (c *Shell) locked(f func()) {
	c.mu.Lock()
	defer c.mu.Unlock()
	f()
	c.runDeferred()
	c.flush()
}

// post has the loop goroutine run f, after the work posted before it. It
// never blocks and may be called from anywhere, the loop included; f runs
// later, never during the call.
func (c *Shell) post(f func()) {
	c.qmu.Lock()
	c.queue = append(c.queue, f)
	c.qmu.Unlock()
	select {
	case c.wake <- struct{}{}:
	default: // a wake-up is pending already
	}
}

// now is the protocol's clock: monotonic, from Go's clock (the vDSO; a
// clock_gettime system call per event costs more on some virtual machines),
// set to the datapath's clock at start.
func now() time.Duration { return clockBase + time.Since(clockStart) }

var clockBase, clockStart = datapath.Monotonic(), time.Now()

// handle feeds an event to a protocol agent and carries out its actions.
func (c *Shell) handle(v6 bool, ev protocol.Event) {
	p := c.proto(v6)
	if p == nil {
		return
	}
	// A request, a trigger sent, or a trigger received (which starts a
	// request) takes a number: at most one per event.
	if p.LastReq()+reqMargin >= c.reqLimit {
		c.reserveReqs()
	}
	for _, act := range p.Handle(now(), ev) {
		if err := c.do(v6, act); err != nil {
			c.log.Warn("control: action failed", "action", fmt.Sprintf("%T", act), "err", err)
		}
	}
	c.runDeferred()
}

// runDeferred runs the loop's own deferred work, also what that defers.
func (c *Shell) runDeferred() {
	for len(c.deferred) > 0 {
		f := c.deferred[0]
		c.deferred = c.deferred[1:]
		f()
	}
}
