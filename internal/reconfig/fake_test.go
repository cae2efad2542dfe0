package reconfig

import (
	"context"
	"errors"
	"net"
	"net/netip"
	"sync"
	"syscall"
	"time"

	"github.com/dysco/dysco/internal/datapath"
	"github.com/dysco/dysco/internal/migrate"
	"github.com/dysco/dysco/internal/wire"
)

// fakeDP is a datapath in memory: the maps the shell works on, and the
// control program's operations on them as bpf/dysco.c does them, without
// packets. A side's cut-off (StartTwoPath) takes its marks from the
// session's initial sequence numbers: nothing is in flight, so each side's
// two-path phase can end as soon as the anchors have exchanged their fins.
// It has no rings: the shell polls the two-path records.
type fakeDP struct {
	mu       sync.Mutex
	sessions map[uint32]datapath.Session
	flows    map[datapath.Tuple]datapath.Flow
	deltas   map[datapath.Tuple]datapath.Delta
	tps      map[datapath.TPKey]datapath.TPVal
	reqs     map[datapath.TPKey]datapath.TPReq
	locks    map[uint32]lockVal
	splices  map[uint32]datapath.Splice
	reqHigh  uint32
	nextID   uint32
	// unmarked: flows added by the shell have seen no packet (a joined
	// session is not ready until they have).
	unmarked bool
}

type lockVal struct {
	la  [16]byte
	req uint32
}

func newFakeDP() *fakeDP {
	return &fakeDP{sessions: map[uint32]datapath.Session{}, flows: map[datapath.Tuple]datapath.Flow{},
		deltas: map[datapath.Tuple]datapath.Delta{}, tps: map[datapath.TPKey]datapath.TPVal{},
		reqs: map[datapath.TPKey]datapath.TPReq{}, locks: map[uint32]lockVal{}, splices: map[uint32]datapath.Splice{},
		nextID: 1}
}

var errNoRing = errors.New("fake datapath: no ring")

func (d *fakeDP) Flow(k datapath.Tuple) (datapath.Flow, bool) {
	d.mu.Lock()
	defer d.mu.Unlock()
	f, ok := d.flows[k]
	return f, ok
}

func (d *fakeDP) AddFlow(k datapath.Tuple, f datapath.Flow) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if !d.unmarked {
		f.Flags |= datapath.FlMarks
	}
	d.flows[k] = f
	return nil
}

func (d *fakeDP) ReplaceFlow(k datapath.Tuple, f datapath.Flow) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if _, ok := d.flows[k]; !ok {
		return syscall.ENOENT
	}
	d.flows[k] = f
	return nil
}

func (d *fakeDP) Delta(k datapath.Tuple) (datapath.Delta, bool) {
	d.mu.Lock()
	defer d.mu.Unlock()
	v, ok := d.deltas[k]
	return v, ok
}

func (d *fakeDP) DeleteFlow(k datapath.Tuple) {
	d.mu.Lock()
	defer d.mu.Unlock()
	delete(d.flows, k)
	delete(d.deltas, k)
}

func (d *fakeDP) SetFlowFlags(k datapath.Tuple, set, clear uint32) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	f, ok := d.flows[k]
	if !ok {
		return syscall.ENOENT
	}
	f.Flags = f.Flags&^clear | set
	d.flows[k] = f
	return nil
}

func (d *fakeDP) EachFlow(fn func(k *datapath.Tuple, f *datapath.Flow)) error {
	d.mu.Lock()
	fs := make(map[datapath.Tuple]datapath.Flow, len(d.flows))
	for k, f := range d.flows {
		fs[k] = f
	}
	d.mu.Unlock()
	for k, f := range fs {
		fn(&k, &f)
	}
	return nil
}

func (d *fakeDP) PutDelta(k datapath.Tuple, v datapath.Delta) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.deltas[k] = v
	return nil
}

func (d *fakeDP) DeleteDelta(k datapath.Tuple) {
	d.mu.Lock()
	defer d.mu.Unlock()
	delete(d.deltas, k)
}

func (d *fakeDP) Session(id uint32) (datapath.Session, bool) {
	d.mu.Lock()
	defer d.mu.Unlock()
	s, ok := d.sessions[id]
	return s, ok
}

func (d *fakeDP) Sessions() ([]datapath.SessionEntry, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	var out []datapath.SessionEntry
	for id, s := range d.sessions {
		out = append(out, datapath.SessionEntry{ID: id, Session: s})
	}
	return out, nil
}

func (d *fakeDP) EachSession(fn func(id uint32, s *datapath.Session)) error {
	ss, _ := d.Sessions()
	for _, e := range ss {
		fn(e.ID, &e.Session)
	}
	return nil
}

func (d *fakeDP) InsertSession(s datapath.Session) (uint32, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	id := d.nextID
	d.nextID++
	d.sessions[id] = s
	return id, nil
}

func (d *fakeDP) DeleteSession(id uint32) {
	d.mu.Lock()
	defer d.mu.Unlock()
	delete(d.sessions, id)
}

// FreeSession deletes the session and everything of it.
func (d *fakeDP) FreeSession(id uint32, _ datapath.Tuple) (int, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if _, ok := d.sessions[id]; !ok {
		return 0, syscall.ENOENT
	}
	n := 0
	for k, f := range d.flows {
		if f.SessId == id {
			delete(d.flows, k)
			delete(d.deltas, k)
			n++
		}
	}
	d.deleteReconf(id)
	delete(d.sessions, id)
	return n, nil
}

// CutSession deletes the session's ingress flows and drops what its
// egress flows carry.
func (d *fakeDP) CutSession(id uint32, _ datapath.Tuple) (int, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	n := 0
	for k, f := range d.flows {
		if f.SessId != id {
			continue
		}
		n++
		if f.Flags&datapath.FlIngress != 0 {
			delete(d.flows, k)
			delete(d.deltas, k)
		} else {
			f.Flags |= datapath.FlDrop
			d.flows[k] = f
		}
	}
	return n, nil
}

func (d *fakeDP) SetLeftwardWScale(id uint32, ws uint8) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	s, ok := d.sessions[id]
	if !ok {
		return syscall.ENOENT
	}
	s.Ws[1] = ws
	d.sessions[id] = s
	return nil
}

func (d *fakeDP) MarkClosed(id uint32, dirs uint32) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	s, ok := d.sessions[id]
	if !ok {
		return syscall.ENOENT
	}
	s.State |= dirs & (datapath.StFINFwd | datapath.StFINRev)
	s.LastMs = datapath.Now()
	d.sessions[id] = s
	return nil
}

func (d *fakeDP) SetWindowClamp(k datapath.TPKey, bytes uint32) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	tp, ok := d.tps[k]
	if !ok {
		return syscall.ENOENT
	}
	tp.Clamp = bytes
	d.tps[k] = tp
	return nil
}

func (d *fakeDP) TwoPath(k datapath.TPKey) (datapath.TPVal, bool) {
	d.mu.Lock()
	defer d.mu.Unlock()
	tp, ok := d.tps[k]
	return tp, ok
}

func (d *fakeDP) PutTwoPath(k datapath.TPKey, v datapath.TPVal) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.tps[k] = v
	return nil
}

// DeleteTwoPath deletes the side's record and the request behind it.
func (d *fakeDP) DeleteTwoPath(k datapath.TPKey) {
	d.mu.Lock()
	defer d.mu.Unlock()
	delete(d.tps, k)
	delete(d.reqs, k)
}

func (d *fakeDP) EachTwoPath(fn func(k datapath.TPKey, v datapath.TPVal)) error {
	d.mu.Lock()
	tps := make(map[datapath.TPKey]datapath.TPVal, len(d.tps))
	for k, v := range d.tps {
		tps[k] = v
	}
	d.mu.Unlock()
	for k, v := range tps {
		fn(k, v)
	}
	return nil
}

// StartTwoPath takes the side's cut-off. The side sends in the SYN's
// direction on the right and in the other on the left; with nothing in
// flight every byte sent before the cut-off is acknowledged.
func (d *fakeDP) StartTwoPath(k datapath.TPKey) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	tp, ok := d.tps[k]
	if !ok {
		return syscall.ENOENT
	}
	if tp.State != datapath.TPIdle {
		return nil
	}
	s := d.sessions[k.SessId]
	snd, rcv := 0, 1
	if k.Side == 0 {
		snd, rcv = 1, 0
	}
	tp.State = datapath.TPActive
	tp.OldSent, tp.OldSentAcked = s.Isn[snd]+1, s.Isn[snd]+1
	tp.OldRcvd, tp.OldRcvdAcked = s.Isn[rcv]+1, s.Isn[rcv]+1
	d.tps[k] = tp
	return nil
}

func (d *fakeDP) SetTwoPathState(k datapath.TPKey, state uint32) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	tp, ok := d.tps[k]
	if !ok {
		return syscall.ENOENT
	}
	tp.State = state
	d.tps[k] = tp
	return nil
}

func (d *fakeDP) MergeMarks(from, to datapath.Tuple) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	f, ok1 := d.flows[from]
	g, ok2 := d.flows[to]
	if !ok1 || !ok2 {
		return syscall.ENOENT
	}
	g.MkSeq, g.MkAck = max(g.MkSeq, f.MkSeq), max(g.MkAck, f.MkAck)
	d.flows[to] = g
	return nil
}

// AddSubsession installs the new subsession of side k as add_sub does.
func (d *fakeDP) AddSubsession(k datapath.TPKey, in datapath.Tuple, f datapath.Flow, delta datapath.Delta, tp datapath.TPVal, req datapath.TPReq) (bool, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.reqs[k] = req
	d.tps[k] = tp
	d.deltas[in] = delta
	if !d.unmarked {
		f.Flags |= datapath.FlMarks
	}
	d.flows[in] = f
	for _, x := range []struct {
		k    datapath.Tuple
		flag uint32
	}{{tp.EgKey, datapath.FlTPOut}, {tp.InOld, datapath.FlTPOld}} {
		if g, ok := d.flows[x.k]; ok {
			g.Flags |= x.flag
			d.flows[x.k] = g
		}
	}
	return true, nil
}

func (d *fakeDP) TPReqOf(k datapath.TPKey) (datapath.TPReq, bool) {
	d.mu.Lock()
	defer d.mu.Unlock()
	r, ok := d.reqs[k]
	return r, ok
}

func (d *fakeDP) DeleteTPReq(k datapath.TPKey) {
	d.mu.Lock()
	defer d.mu.Unlock()
	delete(d.reqs, k)
}

func (d *fakeDP) DeleteReconfigState(id uint32) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.deleteReconf(id)
}

func (d *fakeDP) deleteReconf(id uint32) {
	for side := uint32(0); side < 2; side++ {
		k := datapath.TPKey{SessId: id, Side: side}
		delete(d.tps, k)
		delete(d.reqs, k)
	}
	delete(d.locks, id)
	delete(d.splices, id)
}

func (d *fakeDP) Lock(id uint32) ([16]byte, uint32, bool) {
	d.mu.Lock()
	defer d.mu.Unlock()
	l, ok := d.locks[id]
	return l.la, l.req, ok
}

func (d *fakeDP) PutLock(id uint32, la [16]byte, req uint32) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.locks[id] = lockVal{la, req}
	return nil
}

func (d *fakeDP) DeleteLock(id uint32) {
	d.mu.Lock()
	defer d.mu.Unlock()
	delete(d.locks, id)
}

func (d *fakeDP) EachLock(fn func(id uint32)) error {
	d.mu.Lock()
	var ids []uint32
	for id := range d.locks {
		ids = append(ids, id)
	}
	d.mu.Unlock()
	for _, id := range ids {
		fn(id)
	}
	return nil
}

func (d *fakeDP) PutSplice(sp datapath.Splice) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.splices[sp.Client] = sp
	return nil
}

func (d *fakeDP) DeleteSplice(id uint32) {
	d.mu.Lock()
	defer d.mu.Unlock()
	delete(d.splices, id)
}

func (d *fakeDP) EachSplice(fn func(datapath.Splice)) error {
	d.mu.Lock()
	var sps []datapath.Splice
	for _, sp := range d.splices {
		sps = append(sps, sp)
	}
	d.mu.Unlock()
	for _, sp := range sps {
		fn(sp)
	}
	return nil
}

func (d *fakeDP) SpliceAnswered(id uint32) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	sp, ok := d.splices[id]
	if !ok {
		return syscall.ENOENT
	}
	sp.Answered = true
	d.splices[id] = sp
	return nil
}

func (d *fakeDP) ReqHigh() (uint32, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.reqHigh, nil
}

func (d *fakeDP) SetReqHigh(n uint32) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.reqHigh = n
	return nil
}

func (d *fakeDP) EventReader() (*datapath.EventReader, error) { return nil, errNoRing }
func (d *fakeDP) HoldReader() (*datapath.HoldReader, error)   { return nil, errNoRing }
func (d *fakeDP) SetSplitReader(time.Duration) error          { return nil }

// counts reports what the datapath holds: sessions, two-path records,
// requests and locks.
func (d *fakeDP) counts() (sessions, tps, reqs, locks int) {
	d.mu.Lock()
	defer d.mu.Unlock()
	return len(d.sessions), len(d.tps), len(d.reqs), len(d.locks)
}

// addChainSession installs, as the datapath's SYN set-up would, the state
// of session t at a host of its chain: role, its left subsession l (as it
// arrives here; zero at the start) and its right one r (as it leaves;
// zero at the end). It returns the session's id.
func (d *fakeDP) addChainSession(t, l, r wire.Tuple, role uint8, nonce [wire.NonceLen]byte, isn [2]uint32) uint32 {
	d.mu.Lock()
	id := d.nextID
	d.nextID++
	d.sessions[id] = datapath.Session{Tuple: datapath.EndsFrom(t), Nonce: nonce, Role: role, Isn: isn,
		State: datapath.StSYN | datapath.StSYNACK | datapath.StEst | datapath.StSetupDone,
		Ws:    [2]uint8{7, 7}, CreatedMs: datapath.Now(), LastMs: datapath.Now()}
	d.mu.Unlock()
	est := uint32(datapath.FlEst | datapath.FlMarks)
	if role != datapath.RoleStart {
		// From the left: the subsession arrives, the session goes up;
		// back to the left: the session's reverse leaves as l's.
		_ = d.AddFlow(datapath.TupleFrom(l), datapath.Flow{SessId: id, Out: datapath.EndsFrom(t), Flags: est | datapath.FlIngress})
		_ = d.AddFlow(datapath.TupleFrom(t.Reverse()), datapath.Flow{SessId: id, Out: datapath.EndsFrom(l.Reverse()), Flags: est | datapath.FlRev})
	}
	if role != datapath.RoleEnd {
		_ = d.AddFlow(datapath.TupleFrom(t), datapath.Flow{SessId: id, Out: datapath.EndsFrom(r), Flags: est})
		_ = d.AddFlow(datapath.TupleFrom(r.Reverse()), datapath.Flow{SessId: id, Out: datapath.EndsFrom(t.Reverse()), Flags: est | datapath.FlIngress | datapath.FlRev})
	}
	return id
}

// fakeNet carries datagrams between the shells' control sockets in
// memory. drop, if set, loses the datagrams it returns true for.
type fakeNet struct {
	mu    sync.Mutex
	conns map[netip.Addr]*fakeConn
	drop  func(from, to netip.Addr, data []byte) bool
}

func newFakeNet() *fakeNet { return &fakeNet{conns: map[netip.Addr]*fakeConn{}} }

type datagram struct {
	from netip.Addr
	data []byte
}

type fakeConn struct {
	n      *fakeNet
	addr   netip.Addr
	in     chan datagram
	closed chan struct{}
	once   sync.Once
}

// conn opens the control socket of the host at addr.
func (n *fakeNet) conn(addr netip.Addr) *fakeConn {
	c := &fakeConn{n: n, addr: addr, in: make(chan datagram, 4096), closed: make(chan struct{})}
	n.mu.Lock()
	n.conns[addr] = c
	n.mu.Unlock()
	return c
}

func (n *fakeNet) setDrop(f func(from, to netip.Addr, data []byte) bool) {
	n.mu.Lock()
	n.drop = f
	n.mu.Unlock()
}

func (c *fakeConn) ReadFromUDPAddrPort(b []byte) (int, netip.AddrPort, error) {
	select {
	case d := <-c.in:
		return copy(b, d.data), netip.AddrPortFrom(d.from, DefaultControlPort), nil
	case <-c.closed:
		return 0, netip.AddrPort{}, net.ErrClosed
	}
}

func (c *fakeConn) WriteToUDPAddrPort(b []byte, to netip.AddrPort) (int, error) {
	c.n.mu.Lock()
	dst, drop := c.n.conns[to.Addr()], c.n.drop
	c.n.mu.Unlock()
	if dst == nil || drop != nil && drop(c.addr, to.Addr(), b) {
		return len(b), nil // lost, as UDP loses it
	}
	select {
	case dst.in <- datagram{c.addr, append([]byte(nil), b...)}:
	case <-dst.closed:
	default: // a full socket buffer drops it
	}
	return len(b), nil
}

func (c *fakeConn) WriteMsgUDPAddrPort(b, _ []byte, to netip.AddrPort) (int, int, error) {
	n, err := c.WriteToUDPAddrPort(b, to)
	return n, 0, err
}

func (c *fakeConn) Close() error {
	c.once.Do(func() {
		close(c.closed)
		c.n.mu.Lock()
		if c.n.conns[c.addr] == c {
			delete(c.n.conns, c.addr)
		}
		c.n.mu.Unlock()
	})
	return nil
}

// flowsOf lists the flows of session id.
func (d *fakeDP) flowsOf(id uint32) []datapath.Flow {
	d.mu.Lock()
	defer d.mu.Unlock()
	var out []datapath.Flow
	for _, f := range d.flows {
		if f.SessId == id {
			out = append(out, f)
		}
	}
	return out
}

// fakeHolder holds packets for migrations in name only (the fake
// datapath has no packets): it counts the holds started and released, and
// reports an overflow at once when told to.
type fakeHolder struct {
	mu                sync.Mutex
	active            map[*fakeHold]bool
	started, released int
	overflow          bool
}

type fakeHold struct{ sess uint32 }

func (*fakeHold) stats() (pkts, bytes, dropped int64) { return 0, 0, 0 }

func newFakeHolder() *fakeHolder { return &fakeHolder{active: map[*fakeHold]bool{}} }

func (f *fakeHolder) start(sess uint32, _ datapath.Tuple, _ uint32, _ int64, onOverflow func()) (heldPackets, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	h := &fakeHold{sess: sess}
	f.active[h] = true
	f.started++
	if f.overflow {
		go onOverflow()
	}
	return h, nil
}

func (f *fakeHolder) release(h heldPackets) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if !f.active[h.(*fakeHold)] {
		panic("fake holder: release of a hold not active")
	}
	delete(f.active, h.(*fakeHold))
	f.released++
}

// counts returns the holds started, released and still active.
func (f *fakeHolder) counts() (started, released, active int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.started, f.released, len(f.active)
}

// fakeStates are state plug-ins in memory: a session's state is a token
// naming the host that had it first.
type fakeStates struct {
	mu                     sync.Mutex
	name                   string
	failExport, failImport bool
	// exportDelay makes an export take so long (an overflow comes first)
	exportDelay      time.Duration
	have             map[wire.Tuple]string
	exports, imports int
	releases         int
}

func newFakeStates(name string) *fakeStates {
	return &fakeStates{name: name, have: map[wire.Tuple]string{}}
}

func (f *fakeStates) Export(_ context.Context, s migrate.Session) (migrate.Bundle, error) {
	time.Sleep(f.exportDelay)
	f.mu.Lock()
	defer f.mu.Unlock()
	f.exports++
	if f.failExport {
		return nil, errors.New("the test's plug-in refuses to export")
	}
	st, ok := f.have[s.Tuple]
	if !ok {
		st = "state of " + f.name
		f.have[s.Tuple] = st
	}
	return migrate.Bundle{"fake": []byte(st)}, nil
}

func (f *fakeStates) Import(_ context.Context, s migrate.Session, b migrate.Bundle) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.imports++
	if f.failImport {
		return errors.New("the test's plug-in refuses to import")
	}
	f.have[s.Tuple] = string(b["fake"])
	return nil
}

func (f *fakeStates) Release(_ context.Context, s migrate.Session) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.releases++
	delete(f.have, s.Tuple)
	return nil
}

func (f *fakeStates) state(t wire.Tuple) (string, bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	st, ok := f.have[t]
	return st, ok
}
