package datapath

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"
	"sync"
	"time"

	"github.com/cilium/ebpf"
	"github.com/dysco/dysco/internal/wire"
	"golang.org/x/sys/unix"
)

// Names of the datapath counters, in the order of enum stat in
// bpf/include/consts.h (a test checks the count against the map size).
var StatNames = []string{
	"setup_start", "setup_cont", "setup_end", "syn_retransmit",
	"rewrite_in", "rewrite_out", "tap",
	"drop_malformed", "drop_bad_magic", "drop_bad_version", "drop_bad_length",
	"drop_too_many_hops", "drop_loop", "drop_bad_session", "drop_untrusted",
	"drop_sessions_full", "drop_flows_full", "drop_no_port", "drop_no_route",
	"drop_option_space", "drop_syn_data", "drop_no_setup", "drop_bad_policy",
	"drop_no_syn_state", "drop_helper",
	"fin", "rst", "delta", "icmp", "reused",
	"tp_old", "tp_new", "tp_straddle", "tp_clamp", "drop_orphan", "events_lost",
	"hold_pkts", "hold_bytes", "hold_drop",
}

// Session roles and state bits, mirrors of consts.h.
const (
	RoleStart  = 1
	RoleMiddle = 2
	RoleEnd    = 3
	RoleEndFwd = 4

	StSYN       = 1 << 0
	StSYNACK    = 1 << 1
	StEst       = 1 << 2
	StFINFwd    = 1 << 3
	StFINRev    = 1 << 4
	StRST       = 1 << 5
	StSetupDone = 1 << 6

	FlReroute  = 1 << 0
	FlSYNStrip = 1 << 1
	FlSYNEmit  = 1 << 2
	FlTap      = 1 << 3
	FlDelta    = 1 << 4
	FlRev      = 1 << 5
	FlIngress  = 1 << 6
	FlEst      = 1 << 7
	FlRouted   = 1 << 8
	FlTPOut    = 1 << 9
	FlTPOld    = 1 << 10
	FlTPNew    = 1 << 11
	FlDrop     = 1 << 12
	FlHoldData = FlagHoldData // hold.go
	FlHoldAll  = FlagHoldAll
	FlMarks    = 1 << 15 // MkSeq and MkAck are known

	hopAddr = 1
	hopType = 2
)

// RoleName names a session role.
func RoleName(r uint8) string {
	switch r {
	case RoleStart:
		return "start"
	case RoleMiddle:
		return "middle"
	case RoleEnd:
		return "end"
	case RoleEndFwd:
		return "end-forward"
	}
	return fmt.Sprintf("role-%d", r)
}

// StateName summarises session state bits.
func StateName(st uint32) string {
	switch {
	case st&StRST != 0:
		return "reset"
	case st&StFINFwd != 0 && st&StFINRev != 0:
		return "closed"
	case st&(StFINFwd|StFINRev) != 0:
		return "fin"
	case st&StEst != 0:
		return "established"
	case st&StSYNACK != 0:
		return "syn-ack"
	}
	return "syn"
}

// Tuple is the Go view of struct dysco_tuple.
type Tuple = dyscoDyscoTuple

// Session is the Go view of struct session_val.
type Session = dyscoSessionVal

// Flow is the Go view of struct flow_val.
type Flow = dyscoFlowVal

// Ends is the Go view of struct dysco_ends, a Tuple without the protocol
// (always TCP): the addresses and ports a flow writes into its packets
// (Flow.Out), and a session's tuple (Session.Tuple).
type Ends = dyscoDyscoEnds

// Tuple4 is the Go view of struct dysco_tuple4, the key of the IPv4 flow
// map; Flow4 of struct flow_val4, its value. Callers use Tuple and Flow:
// the flow methods of Datapath convert (Tuple.Is4 tells which map a key
// belongs to).
type (
	Tuple4 = dyscoDyscoTuple4
	Flow4  = dyscoFlowVal4
)

// Is4 tells whether both addresses of the tuple are IPv4 (IPv4-mapped): its
// flow lives in the IPv4 flow map.
func (k Tuple) Is4() bool { return isMapped4(k.Saddr) && isMapped4(k.Daddr) }

func isMapped4(a [16]byte) bool { return netip.AddrFrom16(a).Is4In6() }

func addr4(a [16]byte) uint32 { return binary.NativeEndian.Uint32(a[12:]) }

func mapped(a uint32) [16]byte {
	var b [4]byte
	binary.NativeEndian.PutUint32(b[:], a)
	return netip.AddrFrom4(b).As16()
}

// To4 gives the IPv4 flow map's key of an IPv4 tuple (Is4).
func (k Tuple) To4() Tuple4 {
	return Tuple4{Saddr: addr4(k.Saddr), Daddr: addr4(k.Daddr), Sport: k.Sport, Dport: k.Dport, Proto: k.Proto}
}

// Tuple gives the tuple of an IPv4 flow map key.
func (k Tuple4) Tuple() Tuple {
	return Tuple{Saddr: mapped(k.Saddr), Daddr: mapped(k.Daddr), Sport: k.Sport, Dport: k.Dport, Proto: k.Proto}
}

// To4 gives the IPv4 flow map's value of a flow whose target is IPv4.
func (f Flow) To4() (Flow4, error) {
	if !isMapped4(f.Out.Saddr) || !isMapped4(f.Out.Daddr) {
		return Flow4{}, fmt.Errorf("datapath: IPv4 flow with an IPv6 target %s", f.Out)
	}
	return Flow4{Packets: f.Packets, Bytes: f.Bytes, SessId: f.SessId, Flags: f.Flags, MkSeq: f.MkSeq,
		MkAck: f.MkAck, LastMs: f.LastMs,
		Out: dyscoDyscoEnds4{Saddr: addr4(f.Out.Saddr), Daddr: addr4(f.Out.Daddr), Sport: f.Out.Sport, Dport: f.Out.Dport}}, nil
}

// Flow gives the flow of an IPv4 flow map value.
func (f Flow4) Flow() Flow {
	return Flow{Packets: f.Packets, Bytes: f.Bytes, SessId: f.SessId, Flags: f.Flags, MkSeq: f.MkSeq,
		MkAck: f.MkAck, LastMs: f.LastMs,
		Out: Ends{Saddr: mapped(f.Out.Saddr), Daddr: mapped(f.Out.Daddr), Sport: f.Out.Sport, Dport: f.Out.Dport}}
}

// PutFlow writes the flow at k into the map of its family. The datapath
// writes flows itself; the agent adds the flows of new subsessions
// (AddFlow), and tests and benchmarks install flows with it.
func (d *Datapath) PutFlow(k Tuple, f Flow, flags ebpf.MapUpdateFlags) error {
	if k.Is4() {
		f4, err := f.To4()
		if err != nil {
			return err
		}
		k4 := k.To4()
		return d.objs.DyscoFlows4.Update(&k4, &f4, flags)
	}
	return d.objs.DyscoFlows6.Update(&k, &f, flags)
}

func (d *Datapath) lookupFlow(k Tuple) (Flow, error) {
	return LookupFlowIn(d.objs.DyscoFlows4, d.objs.DyscoFlows6, k)
}

// LookupFlowIn looks the flow at k up in the flow map of its family:
// flows4 and flows6 are a datapath's dysco_flows4 and dysco_flows6 (its
// pinned maps, for a reader outside the agent).
func LookupFlowIn(flows4, flows6 *ebpf.Map, k Tuple) (Flow, error) {
	if k.Is4() {
		var f4 Flow4
		k4 := k.To4()
		if err := flows4.Lookup(&k4, &f4); err != nil {
			return Flow{}, err
		}
		return f4.Flow(), nil
	}
	var f Flow
	err := flows6.Lookup(&k, &f)
	return f, err
}

// Dir is a flow's direction: 0 for the SYN's, 1 for the reverse (FlRev).
func (f Flow) Dir() uint8 {
	if f.Flags&FlRev != 0 {
		return 1
	}
	return 0
}

// Marked tells whether the flow's marks (MkSeq, MkAck) are known.
func (f Flow) Marked() bool { return f.Flags&FlMarks != 0 }

// Delta is the Go view of struct delta_val.
type Delta = dyscoDeltaVal

// TupleFrom converts a wire tuple.
func TupleFrom(t wire.Tuple) Tuple {
	var k Tuple
	k.Saddr = t.Src.As16()
	k.Daddr = t.Dst.As16()
	k.Sport = htons(t.SrcPort)
	k.Dport = htons(t.DstPort)
	k.Proto = unix.IPPROTO_TCP
	return k
}

// Wire converts to a wire tuple.
func (k Tuple) Wire() wire.Tuple {
	return wire.Tuple{
		Src: netip.AddrFrom16(k.Saddr).Unmap(), Dst: netip.AddrFrom16(k.Daddr).Unmap(),
		SrcPort: ntohs(k.Sport), DstPort: ntohs(k.Dport),
	}
}

func (k Tuple) String() string { return k.Wire().String() }

// Ends returns the addresses and ports of the tuple.
func (k Tuple) Ends() Ends {
	return Ends{Saddr: k.Saddr, Daddr: k.Daddr, Sport: k.Sport, Dport: k.Dport}
}

// EndsFrom converts a wire tuple.
func EndsFrom(t wire.Tuple) Ends { return TupleFrom(t).Ends() }

// Tuple returns the TCP tuple with these addresses and ports.
func (e Ends) Tuple() Tuple {
	return Tuple{Saddr: e.Saddr, Daddr: e.Daddr, Sport: e.Sport, Dport: e.Dport, Proto: unix.IPPROTO_TCP}
}

// Wire converts to a wire tuple.
func (e Ends) Wire() wire.Tuple { return e.Tuple().Wire() }

func (e Ends) String() string { return e.Wire().String() }

func htons(v uint16) uint16 {
	var b [2]byte
	binary.BigEndian.PutUint16(b[:], v)
	return binary.NativeEndian.Uint16(b[:])
}

func ntohs(v uint16) uint16 {
	var b [2]byte
	binary.NativeEndian.PutUint16(b[:], v)
	return binary.BigEndian.Uint16(b[:])
}

// SetLocalAddrs replaces the set of this host's addresses.
func (d *Datapath) SetLocalAddrs(addrs []netip.Addr) error {
	want := map[[16]byte]bool{}
	for _, a := range addrs {
		want[a.As16()] = true
	}
	var k [16]byte
	var v uint8
	var stale [][16]byte
	it := d.objs.DyscoLocal.Iterate()
	for it.Next(&k, &v) {
		if !want[k] {
			stale = append(stale, k)
		}
	}
	for _, s := range stale {
		_ = d.objs.DyscoLocal.Delete(s)
	}
	for a := range want {
		if err := d.objs.DyscoLocal.Put(a, uint8(1)); err != nil {
			return fmt.Errorf("datapath: local address %s: %w", netip.AddrFrom16(a), err)
		}
	}
	return nil
}

// PolicyHop is one resolved hop of a policy: an address or a type index.
type PolicyHop struct {
	Addr netip.Addr
	Type int // index into the types given to SetTypes, when Addr is not valid
}

// PolicyChain is what the datapath needs of one policy slot.
type PolicyChain struct {
	Hops  []PolicyHop
	ToDst bool
}

// SetPolicies writes the chains of policy slots 0..len-1 and clears the rest.
func (d *Datapath) SetPolicies(chains []PolicyChain) error {
	if len(chains) > int(d.objs.DyscoPolicies.MaxEntries()) {
		return fmt.Errorf("datapath: %d policies, at most %d", len(chains), d.objs.DyscoPolicies.MaxEntries())
	}
	for i := 0; i < int(d.objs.DyscoPolicies.MaxEntries()); i++ {
		var v dyscoPolicyVal
		if i < len(chains) {
			c := chains[i]
			if len(c.Hops)+boolInt(c.ToDst) > wire.MaxHops {
				return fmt.Errorf("datapath: policy slot %d: %d hops, at most %d", i, len(c.Hops), wire.MaxHops-boolInt(c.ToDst))
			}
			v.N_hops = uint8(len(c.Hops))
			v.ToDst = boolU8(c.ToDst)
			for j, h := range c.Hops {
				if h.Addr.IsValid() {
					v.Kind[j] = hopAddr
					v.Addr[j] = h.Addr.As16()
				} else {
					v.Kind[j] = hopType
					v.Type[j] = uint32(h.Type)
				}
			}
		}
		if err := d.objs.DyscoPolicies.Put(uint32(i), v); err != nil {
			return err
		}
	}
	return nil
}

func boolInt(b bool) int {
	if b {
		return 1
	}
	return 0
}

// SetTypes writes the middlebox types (index = type id). The round-robin
// cursor of a type whose instances are unchanged is kept.
func (d *Datapath) SetTypes(types [][]netip.Addr) error {
	max := int(d.objs.DyscoTypes.MaxEntries())
	if len(types) > max {
		return fmt.Errorf("datapath: %d middlebox types, at most %d", len(types), max)
	}
	for i := 0; i < max; i++ {
		var v dyscoTypeVal
		if i < len(types) {
			if len(types[i]) > len(v.Addr) {
				return fmt.Errorf("datapath: type %d has %d instances, at most %d", i, len(types[i]), len(v.Addr))
			}
			var old dyscoTypeVal
			if err := d.objs.DyscoTypes.Lookup(uint32(i), &old); err == nil {
				v.Rr = old.Rr
			}
			v.N = uint32(len(types[i]))
			for j, a := range types[i] {
				v.Addr[j] = a.As16()
			}
		}
		if err := d.objs.DyscoTypes.Put(uint32(i), v); err != nil {
			return err
		}
	}
	return nil
}

// SetTrusted replaces the prefixes allowed to send Dysco SYNs (used when the
// datapath was loaded with EnforceTrusted).
func (d *Datapath) SetTrusted(prefixes []netip.Prefix) error {
	var k dyscoTrustedKey
	var v uint8
	var stale []dyscoTrustedKey
	it := d.objs.DyscoTrusted.Iterate()
	for it.Next(&k, &v) {
		stale = append(stale, k)
	}
	for _, s := range stale {
		_ = d.objs.DyscoTrusted.Delete(s)
	}
	for _, p := range prefixes {
		bits := p.Bits()
		if p.Addr().Is4() {
			bits += 96
		}
		k := dyscoTrustedKey{Prefixlen: uint32(bits), Addr: p.Addr().As16()}
		if err := d.objs.DyscoTrusted.Put(k, uint8(1)); err != nil {
			return err
		}
	}
	return nil
}

// Stats sums the per-CPU counters.
func (d *Datapath) Stats() (map[string]uint64, error) {
	if out, ok := d.statsBatch(); ok {
		return out, nil
	}
	return d.statsEach()
}

// statsBatch reads every counter of every CPU with one batch lookup (`dysco
// status` and each metrics scrape read them all); ok is false if the
// kernel refuses it.
func (d *Datapath) statsBatch() (map[string]uint64, bool) {
	ncpu, err := ebpf.PossibleCPU()
	if err != nil {
		return nil, false
	}
	keys := make([]uint32, len(StatNames))
	per := make([]uint64, len(StatNames)*ncpu)
	var cur ebpf.MapBatchCursor
	n, err := d.objs.DyscoStats.BatchLookup(&cur, keys, per, nil)
	if (err != nil && !errors.Is(err, ebpf.ErrKeyNotExist)) || n != len(StatNames) {
		return nil, false
	}
	out := make(map[string]uint64, len(StatNames))
	for i, k := range keys {
		if int(k) >= len(StatNames) {
			return nil, false
		}
		var sum uint64
		for _, v := range per[i*ncpu : (i+1)*ncpu] {
			sum += v
		}
		out[StatNames[k]] = sum
	}
	return out, len(out) == len(StatNames)
}

// statsEach reads the counters one lookup each.
func (d *Datapath) statsEach() (map[string]uint64, error) {
	out := make(map[string]uint64, len(StatNames))
	for i, name := range StatNames {
		var per []uint64
		if err := d.objs.DyscoStats.Lookup(uint32(i), &per); err != nil {
			return nil, err
		}
		var sum uint64
		for _, v := range per {
			sum += v
		}
		out[name] = sum
	}
	return out, nil
}

// SessionEntry is a session with its id.
type SessionEntry struct {
	ID uint32
	Session
}

// batchSize is how many entries one batch lookup reads: listing 100,000
// sessions takes tens of system calls, not hundreds of thousands.
const batchSize = 4096

// batchBufs keeps the buffers of the walks of one map from walk to walk:
// the collector walks the flows and sessions every second, and fresh
// buffers would be 1.5 MiB of garbage a second, which the agent's heap (and
// RSS) would grow by. A walk that finds them in use (walks run on several
// goroutines: collector, metrics, API) makes its own.
type batchBufs[K, V any] struct {
	mu   sync.Mutex
	keys []K
	vals []V
	// size is the batch, batchSize if 0: smaller for maps of big values
	// that hold few entries (the two-path records).
	size int
}

// eachBatch reads m in batches and calls fn for every entry, with the
// buffers of b (fn must not keep k or v).
func eachBatch[K, V any](m *ebpf.Map, what string, b *batchBufs[K, V], fn func(k *K, v *V)) error {
	var keys []K
	var vals []V
	size := batchSize
	if b.size > 0 {
		size = b.size
	}
	if b.mu.TryLock() {
		defer b.mu.Unlock()
		if b.keys == nil {
			b.keys, b.vals = make([]K, size), make([]V, size)
		}
		keys, vals = b.keys, b.vals
	} else {
		keys, vals = make([]K, size), make([]V, size)
	}
	var cursor ebpf.MapBatchCursor
	for {
		n, err := m.BatchLookup(&cursor, keys, vals, nil)
		for i := 0; i < n; i++ {
			fn(&keys[i], &vals[i])
		}
		if errors.Is(err, ebpf.ErrKeyNotExist) {
			return nil
		}
		if err != nil {
			return fmt.Errorf("datapath: list %s: %w", what, err)
		}
	}
}

// EachSession calls fn for every session without holding them all; s is
// valid during the call only.
func (d *Datapath) EachSession(fn func(id uint32, s *Session)) error {
	return eachBatch(d.objs.DyscoSessions, "sessions", &d.sessionBufs, func(k *uint32, v *Session) { fn(*k, v) })
}

// EachFlow calls fn for every flow, IPv4 and IPv6, without holding them
// all; k and f are valid during the call only.
func (d *Datapath) EachFlow(fn func(k *Tuple, f *Flow)) error {
	var k Tuple
	var f Flow
	if err := eachBatch(d.objs.DyscoFlows4, "IPv4 flows", &d.flow4Bufs, func(k4 *Tuple4, f4 *Flow4) {
		k, f = k4.Tuple(), f4.Flow()
		fn(&k, &f)
	}); err != nil {
		return err
	}
	return eachBatch(d.objs.DyscoFlows6, "IPv6 flows", &d.flow6Bufs, fn)
}

// EachSetup calls fn with the id of every session that has set-up state.
func (d *Datapath) EachSetup(fn func(id uint32)) error {
	return eachBatch(d.objs.DyscoSyns, "set-up state", &d.setupBufs, func(k *uint32, _ *dyscoSynState) { fn(*k) })
}

// Sessions lists the sessions.
func (d *Datapath) Sessions() ([]SessionEntry, error) {
	var out []SessionEntry
	err := d.EachSession(func(id uint32, s *Session) { out = append(out, SessionEntry{ID: id, Session: *s}) })
	return out, err
}

// FlowEntry is a flow with its key.
type FlowEntry struct {
	Key Tuple
	Flow
}

// Flows lists the flows.
func (d *Datapath) Flows() ([]FlowEntry, error) {
	var out []FlowEntry
	err := d.EachFlow(func(k *Tuple, f *Flow) { out = append(out, FlowEntry{Key: *k, Flow: *f}) })
	return out, err
}

// Session returns one session.
func (d *Datapath) Session(id uint32) (Session, bool) {
	var s Session
	return s, d.objs.DyscoSessions.Lookup(id, &s) == nil
}

// Counted tells whether a flow's counters count its packets for this host:
// a packet that crosses the host passes an ingress and an egress flow, and is
// counted where it enters, or where it leaves if the host made it.
func Counted(f Flow, role uint8) bool {
	if f.Flags&FlIngress != 0 {
		return true
	}
	return (f.Dir() == 0 && role == RoleStart) || (f.Dir() == 1 && (role == RoleEnd || role == RoleEndFwd))
}

// SetTapActive tells the datapath whether a capture listens on the
// session-view tap; copies are made only then.
func (d *Datapath) SetTapActive(on bool) error {
	return d.setConfig(func(v *dyscoConfig) { v.TapActive = uint32(boolU8(on)) })
}

// SetSplitReader tells the datapath that the agent reads the hold ring and
// so splits packets that straddle a cut-off (HeldPacket.Split), for lease
// from now on (on the datapath's clock, Monotonic); a lease of 0 or less
// says that it does not. Only while a lease runs does the datapath hand
// such packets over; otherwise they go whole on the old path. The agent
// renews its lease well before it runs out, so that an agent that dies
// without clearing it does not leave straddling packets to a ring nobody
// reads for longer than the lease.
func (d *Datapath) SetSplitReader(lease time.Duration) error {
	return d.setConfig(func(v *dyscoConfig) { v.SplitUntil = leaseStamp(Monotonic(), lease) })
}

// SplitReaderLease returns what is left of the split reader's lease
// (SetSplitReader), 0 if there is none or it has run out.
func (d *Datapath) SplitReaderLease() (time.Duration, error) {
	var v dyscoConfig
	if err := d.objs.DyscoConfig.Lookup(uint32(0), &v); err != nil {
		return 0, fmt.Errorf("datapath: configuration: %w", err)
	}
	return leaseLeft(v.SplitUntil, Monotonic()), nil
}

// leaseLeft is the time from now to the lease's end stamp until (modulo
// 2^32 ms, as the datapath compares), 0 for none or one that has run out.
func leaseLeft(until uint32, now time.Duration) time.Duration {
	left := int32(until - uint32(now/time.Millisecond))
	if until == 0 || left <= 0 {
		return 0
	}
	return time.Duration(left) * time.Millisecond
}

// leaseStamp is the stamp (32 bits of milliseconds of Monotonic, as
// stamp() in bpf/include/session.h) at which a lease taken at now runs out, or 0 (no
// lease) for lease <= 0. A lease that would end at stamp 0, which means
// none, ends a millisecond later. Leases are compared modulo 2^32 ms, so
// they must be shorter than about 24 days.
func leaseStamp(now, lease time.Duration) uint32 {
	if lease <= 0 {
		return 0
	}
	until := uint32((now + lease) / time.Millisecond)
	if until == 0 {
		until = 1
	}
	return until
}

// setConfig changes the one entry of dysco_config (pinned: it outlives the
// agent) field by field, under cfgMu.
func (d *Datapath) setConfig(f func(*dyscoConfig)) error {
	d.cfgMu.Lock()
	defer d.cfgMu.Unlock()
	var v dyscoConfig
	if err := d.objs.DyscoConfig.Lookup(uint32(0), &v); err != nil {
		return fmt.Errorf("datapath: configuration: %w", err)
	}
	f(&v)
	return d.objs.DyscoConfig.Put(uint32(0), v)
}

// synHops returns the address list a session's SYN still had to visit.
func synHops(st *dyscoSynState) []netip.Addr {
	var out []netip.Addr
	for i := 0; i < int(st.N_hops) && i < len(st.Hops); i++ {
		out = append(out, netip.AddrFrom16(st.Hops[i]).Unmap())
	}
	return out
}

// AllSynHops returns, by session id, the address list still to visit of
// every session that has set-up state, from one walk of the map: a session
// listing would otherwise make a lookup per session, most of which miss
// (set-up state goes once a session is established).
func (d *Datapath) AllSynHops() (map[uint32][]netip.Addr, error) {
	out := map[uint32][]netip.Addr{}
	err := eachBatch(d.objs.DyscoSyns, "set-up state", &d.setupBufs, func(k *uint32, st *dyscoSynState) { out[*k] = synHops(st) })
	return out, err
}

// DeleteSession removes a session and its set-up state; flows are removed
// by DeleteFlow.
func (d *Datapath) DeleteSession(id uint32) {
	_ = d.objs.DyscoSessions.Delete(id)
	_ = d.objs.DyscoSyns.Delete(id)
}

// deleteBatch deletes keys from m with as few system calls as the kernel
// allows: a batch deletion stops at a key that is gone (the datapath may
// have freed it), so it goes on after that key. If batches are refused it
// deletes one key at a time. It returns how many keys were deleted.
func deleteBatch[K any](m *ebpf.Map, keys []K) int {
	deleted := 0
	for len(keys) > 0 {
		n, err := m.BatchDelete(keys, nil)
		deleted += n
		switch {
		case err == nil:
			return deleted
		case errors.Is(err, ebpf.ErrKeyNotExist) && n < len(keys):
			keys = keys[n+1:] // keys[n] is gone
		default:
			for i := n; i < len(keys); i++ {
				if m.Delete(&keys[i]) == nil {
					deleted++
				}
			}
			return deleted
		}
	}
	return deleted
}

// DeleteSessions removes sessions, in batches (the collector ends many at
// once); their set-up state goes with DeleteSynStates.
func (d *Datapath) DeleteSessions(ids []uint32) {
	deleteBatch(d.objs.DyscoSessions, ids)
}

// DeleteSynStates removes set-up state, in batches.
func (d *Datapath) DeleteSynStates(ids []uint32) {
	deleteBatch(d.objs.DyscoSyns, ids)
}

// DeleteFlows removes flows and the deltas attached to them, in batches:
// the flows of each family with one call per batch, and of the deltas (a
// small map: only reconfigured flows have one) those it holds for the
// keys, found by one walk of it rather than a deletion per key, which
// would mostly miss. It returns how many flows it deleted.
func (d *Datapath) DeleteFlows(keys []Tuple) int {
	var k4s []Tuple4
	var k6s []Tuple
	want := make(map[Tuple]bool, len(keys))
	for _, k := range keys {
		want[k] = true
		if k.Is4() {
			k4s = append(k4s, k.To4())
		} else {
			k6s = append(k6s, k)
		}
	}
	n := deleteBatch(d.objs.DyscoFlows4, k4s) + deleteBatch(d.objs.DyscoFlows6, k6s)
	var dks []Tuple
	_ = eachBatch(d.objs.DyscoDeltas, "deltas", &d.deltaBufs, func(k *Tuple, _ *Delta) {
		if want[*k] {
			dks = append(dks, *k)
		}
	})
	deleteBatch(d.objs.DyscoDeltas, dks)
	return n
}

// DeleteFlow removes one flow and any delta attached to it.
func (d *Datapath) DeleteFlow(k Tuple) {
	if k.Is4() {
		k4 := k.To4()
		_ = d.objs.DyscoFlows4.Delete(&k4)
	} else {
		_ = d.objs.DyscoFlows6.Delete(&k)
	}
	_ = d.objs.DyscoDeltas.Delete(&k)
}

// Monotonic returns the clock the datapath stamps sessions with.
func Monotonic() time.Duration {
	var ts unix.Timespec
	_ = unix.ClockGettime(unix.CLOCK_MONOTONIC_COARSE, &ts)
	return time.Duration(ts.Nano())
}

// Stamps. The datapath stamps flows (Flow.LastMs, every packet) and
// sessions (Session.CreatedMs, Session.LastMs, state changes) with 32 bits
// of Monotonic in milliseconds: the stamp wraps every 2^32 ms, 49.7 days
// (stamp() in bpf/include/session.h). 32 bits keep the values at 72 and 80 bytes.
//
// An age is therefore known modulo 2^32 ms only. Age(now, t) is (now - t)
// mod 2^32 ms: exact for ages up to MaxAge, and for older stamps shorter
// by a multiple of StampRange (or 0), never longer. A stamp taken after
// now — the datapath goes on stamping while the agent reads the maps
// against a now read before — is less than StampSkew ahead and has age 0,
// not 49.7 days. Whoever ends sessions by age (the collector) can thus end
// one late, when a stamp's age crosses a multiple of 49.7 days, but never
// early.

const (
	// StampRange is the span of the stamps: ages are known modulo it.
	StampRange = time.Duration(1<<32) * time.Millisecond
	// StampSkew is how far ahead of now a stamp may be and still be
	// taken for one of now (a read of the maps takes well under it).
	StampSkew = time.Minute
	// MaxAge is the longest age Age tells.
	MaxAge = StampRange - StampSkew - time.Millisecond
)

// Now returns the stamp of the present.
func Now() uint32 { return uint32(Monotonic() / time.Millisecond) }

// Age returns how long before now stamp t was taken (see Stamps above).
func Age(now, t uint32) time.Duration {
	d := time.Duration(now-t) * time.Millisecond
	if d > MaxAge {
		return 0 // t is (up to StampSkew) after now
	}
	return d
}

// Maps gives tests and benchmarks direct access to the maps.
func (d *Datapath) Maps() map[string]*ebpf.Map {
	return map[string]*ebpf.Map{
		"flows4": d.objs.DyscoFlows4, "flows6": d.objs.DyscoFlows6, "sessions": d.objs.DyscoSessions, "syns": d.objs.DyscoSyns,
		"deltas": d.objs.DyscoDeltas, "local": d.objs.DyscoLocal, "policies": d.objs.DyscoPolicies,
		"types": d.objs.DyscoTypes, "stats": d.objs.DyscoStats,
	}
}

// Programs gives fixture tests the entry programs.
func (d *Datapath) Programs() (ingress, egress, setup *ebpf.Program) {
	return d.objs.DyscoIngress, d.objs.DyscoEgress, d.objs.DyscoSetup
}

// SessionExists tells whether session id is in the session map.
func (d *Datapath) SessionExists(id uint32) bool {
	var s Session
	return d.objs.DyscoSessions.Lookup(id, &s) == nil
}

// ErrTooLate is returned when a session's SYN has already left the host.
var ErrTooLate = errors.New("the session's SYN has already left this host")

// SessionIDByTuple finds a session set up on this host by its session tuple
// (as it entered the host).
func (d *Datapath) SessionIDByTuple(t wire.Tuple) (uint32, error) {
	f, err := d.lookupFlow(TupleFrom(t.Reverse()))
	if err != nil {
		return 0, fmt.Errorf("no session %s on this host", t)
	}
	return f.SessId, nil
}

// PrependHops puts hops at the head of the untraversed part of a session's
// address list (paper §2.2: a middlebox such as a classifier chooses the
// next middlebox). It works while the SYN is inside this host, before the
// middlebox has let it go on.
func (d *Datapath) PrependHops(id uint32, hops []netip.Addr) ([]netip.Addr, error) {
	var st dyscoSynState
	if err := d.objs.DyscoSyns.Lookup(id, &st); err != nil {
		return nil, fmt.Errorf("session %d has no pending SYN on this host (is this host in its chain, and not its last hop?)", id)
	}
	if st.Emitted != 0 {
		return nil, ErrTooLate
	}
	n := int(st.N_hops)
	if n+len(hops) > len(st.Hops) {
		return nil, fmt.Errorf("the address list would have %d hops, at most %d", n+len(hops), len(st.Hops))
	}
	v4 := netip.AddrFrom16(st.Session.Saddr).Unmap().Is4()
	var list [wire.MaxHops][16]byte
	seen := map[[16]byte]bool{}
	for i, h := range hops {
		if h.Unmap().Is4() != v4 {
			return nil, fmt.Errorf("hop %s is not of the session's address family", h)
		}
		if !wire.Unicast(h) {
			return nil, fmt.Errorf("hop %s is not a unicast address", h.Unmap())
		}
		list[i] = h.Unmap().As16()
	}
	copy(list[len(hops):], st.Hops[:n])
	for _, a := range list[:n+len(hops)] {
		if seen[a] {
			return nil, fmt.Errorf("hop %s would appear twice in the address list", netip.AddrFrom16(a).Unmap())
		}
		seen[a] = true
	}
	st.Hops = list
	st.N_hops = uint8(n + len(hops))
	if err := d.objs.DyscoSyns.Update(id, &st, ebpf.UpdateExist); err != nil {
		return nil, fmt.Errorf("update session %d: %w", id, err)
	}
	out := make([]netip.Addr, 0, n+len(hops))
	for _, a := range list[:n+len(hops)] {
		out = append(out, netip.AddrFrom16(a).Unmap())
	}
	return out, nil
}

// SetFlowFlags sets and clears flags of a flow, atomically with respect to
// the datapath's own updates of the entry (dysco_ctl runs in the kernel).
// Flags that steer packets are only ever changed here, by the agent. FlMarks
// and FlRev are not the agent's to change: the datapath sets the first when
// it writes the marks, and the second is the flow's direction.
func (d *Datapath) SetFlowFlags(k Tuple, set, clear uint32) error {
	if (set|clear)&(FlMarks|FlRev) != 0 {
		return fmt.Errorf("datapath: flow %s: FlMarks and FlRev cannot be changed", k)
	}
	if set != 0 {
		if err := d.ctl(ctlFlagsSet, &k, nil, set); err != nil {
			return err
		}
	}
	if clear != 0 {
		return d.ctl(ctlFlagsClear, &k, nil, clear)
	}
	return nil
}
