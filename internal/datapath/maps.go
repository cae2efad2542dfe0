package datapath

import (
	"encoding/binary"
	"fmt"
	"net/netip"
	"time"

	"github.com/cilium/ebpf"
	"github.com/dysco/dysco/internal/wire"
	"golang.org/x/sys/unix"
)

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
	FlPending  = 1 << 16 // a UDP session's tuple on egress before its subsession exists

	hopAddr = 1
	hopType = 2
)

// Session protocols (session_val.proto: the IP protocol number).
const (
	ProtoTCP = 6
	ProtoUDP = 17
)

// ProtoName names a session's protocol.
func ProtoName(p uint8) string {
	switch p {
	case ProtoTCP:
		return "tcp"
	case ProtoUDP:
		return "udp"
	}
	return fmt.Sprintf("proto-%d", p)
}

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

// TupleOf converts a wire tuple to a key of protocol proto (a session's
// session_val.proto; 0 is taken for TCP).
func TupleOf(t wire.Tuple, proto uint8) Tuple {
	k := TupleFrom(t)
	if proto != 0 {
		k.Proto = proto
	}
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

// Counted tells whether a flow's counters count its packets for this host:
// a packet that crosses the host passes an ingress and an egress flow, and is
// counted where it enters, or where it leaves if the host made it.
func Counted(f Flow, role uint8) bool {
	if f.Flags&FlIngress != 0 {
		return true
	}
	return (f.Dir() == 0 && role == RoleStart) || (f.Dir() == 1 && (role == RoleEnd || role == RoleEndFwd))
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
		"deltas": d.objs.DyscoDeltas, "local": d.objs.DyscoLocal, "local_if": d.objs.DyscoLocalIf, "locator": d.objs.DyscoLocator, "policies": d.objs.DyscoPolicies,
		"policy_src": d.objs.DyscoPolicySrc,
		"types":      d.objs.DyscoTypes, "stats": d.objs.DyscoStats, "keys": d.objs.DyscoKeys, "halfopen": d.objs.DyscoHalfopen,
	}
}

// Programs gives fixture tests the entry programs.
func (d *Datapath) Programs() (ingress, egress, setup *ebpf.Program) {
	return d.objs.DyscoIngress, d.objs.DyscoEgress, d.objs.DyscoSetup
}
