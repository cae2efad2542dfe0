package policy

import (
	"fmt"
	"net/netip"
	"strings"

	"golang.org/x/net/bpf"
)

// Proto is a class of IP protocol, as far as session chaining is concerned.
type Proto uint8

// The protocol classes Filter.Protocols tells apart. ICMP stands for ICMP
// over IPv4 and ICMPv6; Other for every other IP protocol (SCTP, GRE, ESP,
// ...).
const (
	TCP Proto = 1 << iota
	UDP
	ICMP
	Other
)

var protoNames = []struct {
	p    Proto
	name string
}{{TCP, "tcp"}, {UDP, "udp"}, {ICMP, "icmp"}, {Other, "other"}}

func (p Proto) String() string {
	for _, n := range protoNames {
		if n.p == p {
			return n.name
		}
	}
	return fmt.Sprintf("Proto(%d)", uint8(p))
}

// ProtoSet is a set of protocol classes.
type ProtoSet uint8

// NewProtoSet returns the set of ps.
func NewProtoSet(ps ...Proto) ProtoSet {
	var s ProtoSet
	for _, p := range ps {
		s |= ProtoSet(p)
	}
	return s
}

// Has tells whether p is in s.
func (s ProtoSet) Has(p Proto) bool { return s&ProtoSet(p) != 0 }

// Protos lists s in the order tcp, udp, icmp, other.
func (s ProtoSet) Protos() []Proto {
	var out []Proto
	for _, n := range protoNames {
		if s.Has(n.p) {
			out = append(out, n.p)
		}
	}
	return out
}

// String reads "tcp", "tcp and udp", "tcp, udp and icmp"; "none" when empty.
func (s ProtoSet) String() string {
	var names []string
	for _, p := range s.Protos() {
		names = append(names, p.String())
	}
	switch len(names) {
	case 0:
		return "none"
	case 1:
		return names[0]
	}
	return strings.Join(names[:len(names)-1], ", ") + " and " + names[len(names)-1]
}

// Chained is the set of protocols whose sessions the datapath chains: the
// classifier runs on the first packet of a new session of these protocols
// only (a TCP SYN without ACK, the first UDP datagram of a flow). A policy
// whose filter matches none of them is refused (Compile); packets of other
// protocols its filter matches pass unchained.
var Chained = NewProtoSet(TCP, UDP)

// UnchainedError refuses a policy whose filter matches no first packet of a
// protocol in Chained: accepted, it would never steer a session through its
// chain.
type UnchainedError struct {
	Policy string
	Filter string
	// Matches is what the filter matches among the probes
	// (Filter.Protocols); empty when it matches none of them.
	Matches ProtoSet
}

func (e *UnchainedError) Error() string {
	if e.Matches == 0 {
		return fmt.Sprintf("policy %q: filter %q matches no first packet of a session dysco can chain "+
			"(a TCP SYN or a UDP datagram, untagged, over IPv4 without fragmentation or IPv6 without extension headers); "+
			"dysco chains %s sessions", e.Policy, e.Filter, Chained)
	}
	return fmt.Sprintf("policy %q: filter %q matches only %s packets; dysco chains %s sessions",
		e.Policy, e.Filter, e.Matches, Chained)
}

// checkChained refuses a filter that matches no chained protocol.
func checkChained(name string, f Filter) (ProtoSet, error) {
	ps := f.Protocols()
	if ps&Chained == 0 {
		return ps, &UnchainedError{Policy: name, Filter: f.Expr, Matches: ps}
	}
	return ps, nil
}

// Note is what the CLI tells an operator about a compiled policy whose
// filter also matches protocols the datapath does not chain, for example
// `policy "web" chains tcp and udp sessions; other packets its filter
// matches (icmp) pass unchained`; empty when everything it matches is
// chained.
func (c Compiled) Note() string {
	unchained := c.Protocols &^ Chained
	if unchained == 0 {
		return ""
	}
	return fmt.Sprintf("policy %q chains %s sessions; other packets its filter matches (%s) pass unchained",
		c.Policy.Name, c.Protocols&Chained, unchained)
}

// Protocols tells which protocol classes the filter can match, by running it
// on synthetic first packets: a TCP SYN (no ACK), a UDP datagram, an ICMP or
// ICMPv6 echo request, an SCTP INIT and a packet of IP protocol 253, each
// over IPv4 and IPv6 (FirstPacket builds them).
//
// A probe is not one fixed packet: Protocols explores the filter's program
// on it and fills in the fields the program compares. It executes the
// classic BPF on the probe, and when a conditional jump tests a value loaded
// straight from the packet (optionally masked by an AND) from bytes the probe
// leaves free, it follows both branches, writing into those bytes a value
// that makes each branch's test true or false: the jump's constant k itself,
// k+1, k-1, the masked bits of k set or cleared. Bytes once read are
// settled on that path, so a path's packet is consistent, and every packet
// found is checked with Filter.Match. Thus `udp dst port 4433 and dst host
// 10.0.3.2` finds a UDP datagram to 10.0.3.2 port 4433, `ip6 host
// 2001:db8::1` writes the four words of the address, `icmp[icmptype] =
// icmp-echoreply` turns the echo request into a reply, `ip proto 47` turns
// the protocol-253 probe into GRE.
//
// Free bytes are the MAC addresses; the IP header's TOS, identification,
// TTL, checksum and addresses (IPv6: the low bits of the traffic class, the
// flow label, hop limit and addresses); the transport header but for TCP's
// data offset and flags (a first packet is a SYN) and UDP's length; and the
// payload. Fixed are the EtherType, the IP version, header and packet
// lengths, IPv4's flags and fragment offset, and the protocol (next header),
// which is free in the protocol-253 probe only, for values other than those
// of TCP, UDP, ICMP, ICMPv6 and IPv6 extension headers.
//
// Limits: a filter that matches only VLAN-tagged frames, IPv4 options or
// fragments, IPv6 extension headers, TCP segments other than a SYN, or
// frames of other sizes than the probes' (greater, less, len) matches no
// probe; so does one whose tests depend on arithmetic over packet bytes
// (ip[2:2] / 4 > 10) when the probe's values do not satisfy it. Such a
// filter is reported as matching less than it does, which can only get a
// policy refused, never accepted and bypassed: the datapath itself chains
// only untagged TCP and UDP over IPv4 without fragmentation and IPv6
// without extension headers. The exploration of each probe stops after
// maxProbePaths paths or maxProbeSteps instructions; a filter with that many
// alternatives before its match may be reported as matching less than it
// does, with the same consequence.
func (f Filter) Protocols() ProtoSet {
	if f.vm == nil {
		return 0
	}
	prog, err := decode(f.Insns)
	if err != nil {
		return 0
	}
	acc := acceptReachable(prog)
	var s ProtoSet
	for _, pr := range probes {
		if s.Has(pr.class) {
			continue
		}
		if f.explore(prog, acc, pr) {
			s |= ProtoSet(pr.class)
		}
	}
	return s
}

// maxProbePaths bounds the paths explored on one probe, and maxProbeSteps
// the instructions executed on it over all paths (a few milliseconds).
const (
	maxProbePaths = 4096
	maxProbeSteps = 1 << 20
)

// A probe is a first packet whose free bytes the exploration may write.
type probe struct {
	class Proto
	frame []byte
	fixed []bool // bytes the exploration must not change
	// protoOff is the offset of the IP protocol (next header) byte when
	// it is free for values that keep the packet in class Other; else 0.
	protoOff int
}

var probes = buildProbes()

func buildProbes() []probe {
	v4s, v4d := netip.MustParseAddrPort("192.0.2.1:50123"), netip.MustParseAddrPort("198.51.100.2:40404")
	v6s, v6d := netip.MustParseAddrPort("[2001:db8::1]:50123"), netip.MustParseAddrPort("[2001:db8:1::2]:40404")
	var out []probe
	for _, c := range []struct {
		class Proto
		proto uint8
	}{
		{TCP, ipProtoTCP}, {UDP, ipProtoUDP}, {ICMP, ipProtoICMP},
		{Other, ipProtoSCTP}, {Other, ipProtoTest},
	} {
		for _, v6 := range []bool{false, true} {
			src, dst := v4s, v4d
			if v6 {
				src, dst = v6s, v6d
			}
			b, err := FirstPacket(c.proto, src, dst)
			if err != nil {
				panic(err)
			}
			pr := probe{class: c.class, frame: b, fixed: make([]bool, len(b))}
			pr.fixed[12], pr.fixed[13] = true, true // EtherType
			l3 := ethHeaderLen
			var l4, protoOff int
			if v6 {
				l4 = l3 + ipv6HeaderLen
				protoOff = l3 + 6
				// Version (with the top of the traffic class),
				// payload length, next header.
				for _, o := range []int{0, 4, 5, 6} {
					pr.fixed[l3+o] = true
				}
			} else {
				l4 = l3 + ipv4HeaderLen
				protoOff = l3 + 9
				// Version and IHL, total length, flags and
				// fragment offset, protocol.
				for _, o := range []int{0, 2, 3, 6, 7, 9} {
					pr.fixed[l3+o] = true
				}
			}
			switch c.proto {
			case ipProtoTCP:
				pr.fixed[l4+12], pr.fixed[l4+13] = true, true // data offset, flags
			case ipProtoUDP:
				pr.fixed[l4+4], pr.fixed[l4+5] = true, true // length
			}
			if c.proto == ipProtoTest {
				pr.protoOff = protoOff
			}
			out = append(out, pr)
		}
	}
	return out
}

// protoAllowed tells whether the protocol byte of an Other probe may take
// the value v: not a protocol of another class, nor an IPv6 extension header
// (hop-by-hop, routing, fragment, no next header, destination options),
// which would change how the rest of the packet reads.
func protoAllowed(v byte) bool {
	switch v {
	case 0, ipProtoICMP, ipProtoTCP, ipProtoUDP, 43, 44, ipProtoICMPv6, 59, 60:
		return false
	}
	return true
}

// acceptReachable marks the instructions from which an accepting return
// (RET with a non-zero constant, or RET A) can be reached. Jumps only go
// forward, so one backward pass suffices.
func acceptReachable(prog []bpf.Instruction) []bool {
	n := len(prog)
	acc := make([]bool, n+1)
	at := func(pc int) bool { return pc >= 0 && pc < n && acc[pc] }
	for pc := n - 1; pc >= 0; pc-- {
		switch ins := prog[pc].(type) {
		case bpf.RetConstant:
			acc[pc] = ins.Val != 0
		case bpf.RetA:
			acc[pc] = true
		case bpf.Jump:
			acc[pc] = at(pc + 1 + int(ins.Skip))
		case bpf.JumpIf:
			acc[pc] = at(pc+1+int(ins.SkipTrue)) || at(pc+1+int(ins.SkipFalse))
		case bpf.JumpIfX:
			acc[pc] = at(pc+1+int(ins.SkipTrue)) || at(pc+1+int(ins.SkipFalse))
		default:
			acc[pc] = at(pc + 1)
		}
	}
	return acc[:n]
}

// path is one state of the exploration: the classic BPF machine, the packet
// as written so far, and which of its bytes are settled.
type path struct {
	pc      int
	a, x    uint32
	m       [16]uint32
	frame   []byte
	settled []bool
	// src says that A holds the packet bytes [off, off+size) ANDed with
	// mask, none of them settled yet: a jump on A may still choose them.
	src struct {
		ok        bool
		off, size int
		mask      uint32
	}
}

func (p *path) clone() *path {
	q := *p
	q.frame = append([]byte(nil), p.frame...)
	q.settled = append([]bool(nil), p.settled...)
	return &q
}

// settle marks the bytes A was loaded from as settled: their value is now
// used as it is.
func (p *path) settle() {
	if p.src.ok {
		for i := p.src.off; i < p.src.off+p.src.size; i++ {
			p.settled[i] = true
		}
		p.src.ok = false
	}
}

// load reads size bytes at off, big-endian; ok is false past the end.
func (p *path) load(off uint64, size int) (uint32, bool) {
	if off+uint64(size) > uint64(len(p.frame)) {
		return 0, false
	}
	var v uint32
	for i := 0; i < size; i++ {
		v = v<<8 | uint32(p.frame[int(off)+i])
	}
	return v, true
}

// explore searches for a packet of probe pr that the filter accepts.
func (f Filter) explore(prog []bpf.Instruction, acc []bool, pr probe) bool {
	start := &path{frame: append([]byte(nil), pr.frame...), settled: make([]bool, len(pr.frame))}
	stack := []*path{start}
	paths, steps := 0, maxProbeSteps
	for len(stack) > 0 && paths < maxProbePaths && steps > 0 {
		p := stack[len(stack)-1]
		stack = stack[:len(stack)-1]
		paths++
		accepted, forks := run(prog, acc, pr, p, &steps)
		if accepted && f.Match(p.frame) {
			return true
		}
		stack = append(stack, forks...)
	}
	return false
}

// run executes p until it returns (reporting whether it accepts) or reaches
// a jump whose test it can choose; then it returns the paths of the
// branches, the one where the test is true last (explored first).
func run(prog []bpf.Instruction, acc []bool, pr probe, p *path, steps *int) (bool, []*path) {
	for p.pc < len(prog) {
		if !acc[p.pc] || *steps <= 0 {
			return false, nil
		}
		*steps--
		ins := prog[p.pc]
		if j, ok := ins.(bpf.JumpIf); ok {
			t, f := p.pc+1+int(j.SkipTrue), p.pc+1+int(j.SkipFalse)
			if p.src.ok && t != f {
				return false, p.fork(pr, j, t, f)
			}
			if jumpTest(j.Cond, p.a, j.Val) {
				p.pc = t
			} else {
				p.pc = f
			}
			continue
		}
		if alu, ok := ins.(bpf.ALUOpConstant); ok && alu.Op == bpf.ALUOpAnd && p.src.ok {
			p.a &= alu.Val
			p.src.mask &= alu.Val
			p.pc++
			continue
		}
		// Any other use of A takes its value as it is.
		p.settle()
		next := p.pc + 1
		switch ins := ins.(type) {
		case bpf.LoadAbsolute:
			if !p.loadA(pr, uint64(ins.Off), ins.Size) {
				return false, nil
			}
		case bpf.LoadIndirect:
			if !p.loadA(pr, uint64(ins.Off)+uint64(p.x), ins.Size) {
				return false, nil
			}
		case bpf.LoadMemShift:
			v, ok := p.load(uint64(ins.Off), 1)
			if !ok {
				return false, nil
			}
			p.settled[ins.Off] = true
			p.x = (v & 0xf) * 4
		case bpf.LoadConstant:
			if ins.Dst == bpf.RegX {
				p.x = ins.Val
			} else {
				p.a = ins.Val
			}
		case bpf.LoadScratch:
			if ins.N < 0 || ins.N >= len(p.m) {
				return false, nil
			}
			if ins.Dst == bpf.RegX {
				p.x = p.m[ins.N]
			} else {
				p.a = p.m[ins.N]
			}
		case bpf.StoreScratch:
			if ins.N < 0 || ins.N >= len(p.m) {
				return false, nil
			}
			if ins.Src == bpf.RegX {
				p.m[ins.N] = p.x
			} else {
				p.m[ins.N] = p.a
			}
		case bpf.LoadExtension:
			if ins.Num != bpf.ExtLen {
				return false, nil
			}
			p.a = uint32(len(p.frame))
		case bpf.TAX:
			p.x = p.a
		case bpf.TXA:
			p.a = p.x
		case bpf.NegateA:
			p.a = -p.a
		case bpf.ALUOpConstant:
			v, ok := alu(ins.Op, p.a, ins.Val)
			if !ok {
				return false, nil
			}
			p.a = v
		case bpf.ALUOpX:
			v, ok := alu(ins.Op, p.a, p.x)
			if !ok {
				return false, nil
			}
			p.a = v
		case bpf.Jump:
			next = p.pc + 1 + int(ins.Skip)
		case bpf.JumpIfX:
			if jumpTest(ins.Cond, p.a, p.x) {
				next = p.pc + 1 + int(ins.SkipTrue)
			} else {
				next = p.pc + 1 + int(ins.SkipFalse)
			}
		case bpf.RetConstant:
			return ins.Val != 0, nil
		case bpf.RetA:
			return p.a != 0, nil
		default:
			return false, nil
		}
		p.pc = next
	}
	return false, nil
}

// loadA loads A from the packet, remembering where from when the bytes are
// free and unsettled; ok is false past the end of the packet.
func (p *path) loadA(pr probe, off uint64, size int) bool {
	v, ok := p.load(off, size)
	if !ok {
		return false
	}
	p.a = v
	o := int(off)
	free := true
	for i := o; i < o+size; i++ {
		if (pr.fixed[i] && i != pr.protoOff) || p.settled[i] {
			free = false
			break
		}
	}
	if free && (pr.protoOff == 0 || pr.protoOff < o || pr.protoOff >= o+size || size == 1) {
		p.src.ok, p.src.off, p.src.size, p.src.mask = true, o, size, 0xffffffff
		return true
	}
	for i := o; i < o+size; i++ {
		p.settled[i] = true
	}
	return true
}

// fork returns the paths that take the branches of j, each with the loaded
// bytes rewritten to a value that makes j's test come out its way (when
// there is one), the true branch last.
func (p *path) fork(pr probe, j bpf.JumpIf, t, f int) []*path {
	cur, _ := p.load(uint64(p.src.off), p.src.size)
	max := uint32(1)<<(8*p.src.size) - 1
	if p.src.size == 4 {
		max = 0xffffffff
	}
	mask, k := p.src.mask, j.Val
	low := func(v uint32) uint32 { return v & -v }
	// The constant first: a range test (portrange) is two jumps on one
	// value, and k, the bound of the first, usually satisfies the second.
	cands := []uint32{
		cur&^mask | k&mask,
		k, k + 1, k - 1,
		cur&^mask | (k+1)&mask,
		cur,
		cur ^ low(mask),
		cur | low(mask&k),
		cur &^ (mask & k),
		0, max,
	}
	var out []*path
	for _, want := range []bool{false, true} {
		target := f
		if want {
			target = t
		}
		for _, v := range cands {
			if v > max || jumpTest(j.Cond, v&mask, k) != want {
				continue
			}
			if pr.protoOff != 0 && p.src.off == pr.protoOff && !protoAllowed(byte(v)) {
				continue
			}
			q := p.clone()
			for i := 0; i < q.src.size; i++ {
				q.frame[q.src.off+i] = byte(v >> (8 * (q.src.size - 1 - i)))
			}
			q.a = v & mask
			q.settle()
			q.pc = target
			out = append(out, q)
			break
		}
	}
	return out
}

// jumpTest evaluates a classic BPF jump condition.
func jumpTest(c bpf.JumpTest, a, k uint32) bool {
	switch c {
	case bpf.JumpEqual:
		return a == k
	case bpf.JumpNotEqual:
		return a != k
	case bpf.JumpGreaterThan:
		return a > k
	case bpf.JumpLessThan:
		return a < k
	case bpf.JumpGreaterOrEqual:
		return a >= k
	case bpf.JumpLessOrEqual:
		return a <= k
	case bpf.JumpBitsSet:
		return a&k != 0
	case bpf.JumpBitsNotSet:
		return a&k == 0
	}
	return false
}

// alu evaluates a classic BPF ALU operation with the VM's semantics (see
// Filter.Match); ok is false on a division or modulo by zero.
func alu(op bpf.ALUOp, a, v uint32) (uint32, bool) {
	switch op {
	case bpf.ALUOpAdd:
		return a + v, true
	case bpf.ALUOpSub:
		return a - v, true
	case bpf.ALUOpMul:
		return a * v, true
	case bpf.ALUOpDiv:
		if v == 0 {
			return 0, false
		}
		return a / v, true
	case bpf.ALUOpMod:
		if v == 0 {
			return 0, false
		}
		return a % v, true
	case bpf.ALUOpOr:
		return a | v, true
	case bpf.ALUOpAnd:
		return a & v, true
	case bpf.ALUOpShiftLeft:
		if v >= 32 {
			return 0, true
		}
		return a << v, true
	case bpf.ALUOpShiftRight:
		if v >= 32 {
			return 0, true
		}
		return a >> v, true
	case bpf.ALUOpXor:
		return a ^ v, true
	}
	return 0, false
}
