package datapath

import (
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/gopacket/gopacket/layers"

	"github.com/dysco/dysco/internal/wire"
)

// rewriteCase is one steady-state packet: a flow (keyed by the input
// packet's tuple) and maybe a session and a delta set up, the packet run
// through ingress or egress, and the verdict, output packet and counters
// expected.
type rewriteCase struct {
	name    string
	egress  bool
	flow    *Flow    // nil: no flow for the packet
	sess    *Session // stored under flow.SessId
	delta   *Delta   // stored under the packet's key
	in      pkt
	verdict uint32
	out     pkt               // expected output (verdicts OK and REDIRECT)
	stats   map[string]uint64 // counters expected to move
	check   func(t *testing.T, fx *fixture, in []byte)
}

func (c rewriteCase) run(t *testing.T, fx *fixture) {
	fx.reset(t)
	m := fx.d.Maps()
	if c.flow != nil {
		f := *c.flow
		if !c.egress {
			f.Flags |= FlIngress // rows name the hook; flows apply at one hook only
		}
		if err := fx.d.PutFlow(c.in.key(), f, ebpf.UpdateAny); err != nil {
			t.Fatal(err)
		}
		if c.sess != nil {
			if err := m["sessions"].Put(c.flow.SessId, *c.sess); err != nil {
				t.Fatal(err)
			}
		}
	}
	if c.delta != nil {
		if err := m["deltas"].Put(c.in.key(), *c.delta); err != nil {
			t.Fatal(err)
		}
	}
	prog := fx.ingress
	if c.egress {
		prog = fx.egress
	}
	in := c.in.frame(t)
	before := fx.stats(t)
	verdict, out := fx.run(t, prog, in)
	if verdict != c.verdict {
		t.Errorf("verdict %d, want %d", verdict, c.verdict)
	}
	if c.verdict != tcActShot {
		expectFrame(t, out, c.out)
	}
	fx.expectStats(t, before, c.stats)
	if c.check != nil {
		c.check(t, fx, in)
	}
}

// Tuples of a middlebox host's steady state (§2.1): subsessions on the
// wire, the session inside the host.
var (
	subIn4  = tup(ap("10.1.0.20:31000"), ap("10.1.0.1:32000"))
	sess4   = tup(ap("10.5.0.7:40000"), ap("10.9.0.5:80"))
	subOut4 = tup(ap("10.1.0.1:41001"), ap("10.9.0.5:41002"))
	subIn6  = tup(ap("[fd00:1::20]:31000"), ap("[fd00:1::1]:32000"))
	sess6   = tup(ap("[fd00:5::7]:40000"), ap("[fd00:9::5]:443"))
	subOut6 = tup(ap("[fd00:1::1]:41003"), ap("[fd00:9::5]:41004"))
)

// dataPkt is an established-connection segment with timestamps, two SACK
// blocks and a payload.
func dataPkt(t wire.Tuple) pkt {
	p := pkt{
		seq: 0x10000000, ack: 0x20000000, flags: "PA", win: 502,
		opts:    []layers.TCPOption{optNOP(), optNOP(), optTS(1000, 2000), optNOP(), optNOP(), optSACK(0x20001000, 0x20002000, 0x20003000, 0x20004000)},
		payload: []byte("GET / HTTP/1.1\r\nHost: dysco\r\n\r\n and some more bytes to make it odd."),
	}
	return p.with(t)
}

// synAck is a SYN-ACK with Linux's options, window scale included.
func synAck(t wire.Tuple) pkt {
	p := pkt{seq: 0x55555555, ack: 0x11223345, flags: "SA", win: 65160,
		opts: []layers.TCPOption{optMSS(1400), optSACKPerm(), optTS(3000, 0x01020304), optNOP(), optWS(9)}}
	return p.with(t)
}

func withIPOpts(p pkt) pkt {
	p.ipOpts = true
	return p
}

func estSession(t wire.Tuple, role uint8) *Session {
	return &Session{Tuple: EndsFrom(t), State: StSYN | StSYNACK | StEst, Role: role, IsV6: boolU8(!t.Is4())}
}

func TestSteadyStateRewrite(t *testing.T) {
	fx := newFixture(t)
	one := func(names ...string) map[string]uint64 {
		m := map[string]uint64{}
		for _, n := range names {
			m[n]++
		}
		return m
	}
	fin := dataPkt(sess4.Reverse())
	fin.flags = "FA"
	fin.payload = nil
	cases := []rewriteCase{
		{
			name: "ingress v4 data to session tuple",
			flow: &Flow{Out: EndsFrom(sess4), SessId: 7}, sess: estSession(sess4, RoleMiddle),
			in: dataPkt(subIn4), verdict: tcActOK, out: dataPkt(sess4),
			stats: one("rewrite_in"),
			check: func(t *testing.T, fx *fixture, in []byte) {
				f := fx.rawFlows(t)[dataPkt(subIn4).key()]
				if f.Packets != 1 || f.Bytes != uint64(len(in)) || Age(Now(), f.LastMs) > time.Second {
					t.Errorf("flow counted packets %d bytes %d (last packet %v ago), want 1 %d, now", f.Packets, f.Bytes, Age(Now(), f.LastMs), len(in))
				}
			},
		},
		{
			name: "ingress v4 SYN-ACK keeps MSS, SACK-permitted, timestamps, window scale",
			flow: &Flow{Out: EndsFrom(sess4.Reverse()), SessId: 7, Flags: FlRev},
			in:   synAck(subOut4.Reverse()), verdict: tcActOK, out: synAck(sess4.Reverse()),
			stats: one("rewrite_in"),
		},
		{
			name: "ingress v6 data to session tuple",
			flow: &Flow{Out: EndsFrom(sess6), SessId: 8},
			in:   dataPkt(subIn6), verdict: tcActOK, out: dataPkt(sess6),
			stats: one("rewrite_in"),
		},
		{
			name: "ingress v6 SYN-ACK",
			flow: &Flow{Out: EndsFrom(sess6.Reverse()), SessId: 8, Flags: FlRev},
			in:   synAck(subOut6.Reverse()), verdict: tcActOK, out: synAck(sess6.Reverse()),
			stats: one("rewrite_in"),
		},
		{
			name: "ingress v4 with IP options",
			flow: &Flow{Out: EndsFrom(sess4)},
			in:   withIPOpts(dataPkt(subIn4)), verdict: tcActOK, out: withIPOpts(dataPkt(sess4)),
			stats: one("rewrite_in"),
		},
		{
			name:   "egress v4 with IP options rerouted",
			egress: true, flow: &Flow{Out: EndsFrom(subOut4), Flags: FlReroute},
			in: withIPOpts(dataPkt(sess4)), verdict: tcActRedirect, out: withIPOpts(dataPkt(subOut4)),
			stats: one("rewrite_out"),
		},
		{
			name: "ingress v4 ports only",
			flow: &Flow{Out: EndsFrom(tup(ap("10.1.0.20:1"), ap("10.1.0.1:65535")))},
			in:   dataPkt(subIn4), verdict: tcActOK, out: dataPkt(tup(ap("10.1.0.20:1"), ap("10.1.0.1:65535"))),
			stats: one("rewrite_in"),
		},
		{
			name: "ingress v6 addresses only",
			flow: &Flow{Out: EndsFrom(tup(ap("[fd00:5::7]:31000"), ap("[fd00:9::5]:32000")))},
			in:   dataPkt(subIn6), verdict: tcActOK, out: dataPkt(tup(ap("[fd00:5::7]:31000"), ap("[fd00:9::5]:32000"))),
			stats: one("rewrite_in"),
		},
		{
			name:   "egress v4 data without reroute",
			egress: true, flow: &Flow{Out: EndsFrom(subIn4.Reverse()), Flags: FlRev},
			in: dataPkt(sess4.Reverse()), verdict: tcActOK, out: dataPkt(subIn4.Reverse()),
			stats: one("rewrite_out"),
		},
		{
			name:   "egress v4 data rerouted to the next hop",
			egress: true, flow: &Flow{Out: EndsFrom(subOut4), Flags: FlReroute},
			in: dataPkt(sess4), verdict: tcActRedirect, out: dataPkt(subOut4),
			stats: one("rewrite_out"),
		},
		{
			name:   "egress v6 data rerouted to the next hop",
			egress: true, flow: &Flow{Out: EndsFrom(subOut6), Flags: FlReroute},
			in: dataPkt(sess6), verdict: tcActRedirect, out: dataPkt(subOut6),
			stats: one("rewrite_out"),
		},
		{
			name:   "egress v6 SYN-ACK rerouted back to the previous hop",
			egress: true, flow: &Flow{Out: EndsFrom(subIn6.Reverse()), Flags: FlReroute | FlRev},
			in: synAck(sess6.Reverse()), verdict: tcActRedirect, out: synAck(subIn6.Reverse()),
			stats: one("rewrite_out"),
		},
		{
			name:   "egress FIN counted and tracked",
			egress: true, flow: &Flow{Out: EndsFrom(subIn4.Reverse()), SessId: 9, Flags: FlReroute | FlRev},
			sess: estSession(sess4, RoleEnd),
			in:   fin, verdict: tcActRedirect, out: fin.with(subIn4.Reverse()),
			stats: one("rewrite_out", "fin"),
			check: func(t *testing.T, fx *fixture, in []byte) {
				s := fx.onlySession(t)
				if s.State&StFINRev == 0 {
					t.Errorf("session state %#x, want FIN of the reverse direction", s.State)
				}
				if f := fx.rawFlows(t)[fin.key()]; f.Packets != 1 {
					t.Errorf("flow counted %d packets, want the FIN", f.Packets)
				}
			},
		},
		{
			name:   "egress reroute with no route to the new destination",
			egress: true, flow: &Flow{Out: EndsFrom(tup(ap("10.1.0.1:41001"), apOf(noRoute, 80))), Flags: FlReroute},
			in: dataPkt(sess4), verdict: tcActShot,
			stats: one("rewrite_out", "drop_no_route"),
		},
		{
			name: "ingress packet of no flow passes untouched",
			in:   dataPkt(subIn4), verdict: tcActOK, out: dataPkt(subIn4),
		},
		{
			name:   "egress SYN-ACK of no flow passes untouched",
			egress: true, in: synAck(sess4.Reverse()), verdict: tcActOK, out: synAck(sess4.Reverse()),
		},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) { c.run(t, fx) })
	}
}

// TestDeltas covers sequence translation (§3.4): seq,
// ack, SACK edges, TSval/TSecr and window scaling, as nf_conntrack_seqadj
// does, with checksums right.
func TestDeltas(t *testing.T) {
	fx := newFixture(t)
	deltaFlow := func(out wire.Tuple) *Flow { return &Flow{Out: EndsFrom(out), SessId: 3, Flags: FlDelta} }
	stats := func(hook string, delta bool) map[string]uint64 {
		m := map[string]uint64{"rewrite_" + hook: 1}
		if delta {
			m["delta"] = 1
		}
		return m
	}
	ackData := func(t wire.Tuple, opts ...layers.TCPOption) pkt {
		p := pkt{seq: 0x10000000, ack: 0x20000000, flags: "A", win: 1000, opts: opts, payload: []byte("0123456789abcdef")}
		return p.with(t)
	}
	sack := func(n int, d uint32) layers.TCPOption {
		var e []uint32
		for i := 0; i < n; i++ {
			e = append(e, 0x20001000+uint32(i)*0x2000+d, 0x20002000+uint32(i)*0x2000+d)
		}
		return optSACK(e...)
	}
	nop := optNOP()
	const ackD = 0xfffffe0c // -500
	cases := []rewriteCase{
		{
			name:  "seq ack timestamps window and one SACK block",
			flow:  deltaFlow(sess4),
			delta: &Delta{Seq: 1000, Ack: -500, Tsval: 77, Tsecr: -33, WsIn: 7, WsOut: 9, WsOn: 1},
			in:    ackData(subIn4, nop, nop, optTS(5000, 6000), nop, nop, sack(1, 0)),
			out: func() pkt {
				p := ackData(sess4, nop, nop, optTS(5077, 5967), nop, nop, sack(1, ackD))
				p.seq, p.ack, p.win = 0x10000000+1000, 0x20000000-500, 250
				return p
			}(),
			verdict: tcActOK, stats: stats("in", true),
		},
		{
			name: "two SACK blocks, ack delta only",
			flow: deltaFlow(sess4), delta: &Delta{Ack: -500},
			in: ackData(subIn4, nop, nop, optTS(5000, 6000), nop, nop, sack(2, 0)),
			out: func() pkt {
				p := ackData(sess4, nop, nop, optTS(5000, 6000), nop, nop, sack(2, ackD))
				p.ack = 0x20000000 - 500
				return p
			}(),
			verdict: tcActOK, stats: stats("in", true),
		},
		{
			name:   "three SACK blocks and timestamps fill the option space",
			egress: true, flow: deltaFlow(subOut4), delta: &Delta{Seq: -4, Ack: 0x1000, Tsval: 1, Tsecr: 2},
			in: ackData(sess4, nop, nop, optTS(5000, 6000), nop, nop, sack(3, 0)),
			out: func() pkt {
				p := ackData(subOut4, nop, nop, optTS(5001, 6002), nop, nop, sack(3, 0x1000))
				p.seq, p.ack = 0x10000000-4, 0x20001000
				return p
			}(),
			verdict: tcActOK, stats: stats("out", true),
		},
		{
			name:   "four SACK blocks, IPv6",
			egress: true, flow: deltaFlow(subOut6), delta: &Delta{Ack: 0x7fffffff},
			in: ackData(sess6, nop, nop, sack(4, 0)),
			out: func() pkt {
				p := ackData(subOut6, nop, nop, sack(4, 0x7fffffff))
				p.ack = 0x20000000 + 0x7fffffff
				return p
			}(),
			verdict: tcActOK, stats: stats("out", true),
		},
		{
			name: "sequence numbers wrap",
			flow: deltaFlow(sess6), delta: &Delta{Seq: 0x10, Ack: 0x20},
			in: func() pkt {
				p := ackData(subIn6, nop, nop, optSACK(0xfffffff0, 0xfffffff8))
				p.seq, p.ack = 0xfffffff8, 0xfffffff0
				return p
			}(),
			out: func() pkt {
				p := ackData(sess6, nop, nop, optSACK(0x10, 0x18))
				p.seq, p.ack = 0x8, 0x10
				return p
			}(),
			verdict: tcActOK, stats: stats("in", true),
		},
		{
			name:   "ack delta on a segment without ACK: ack untouched",
			egress: true, flow: deltaFlow(subOut4), delta: &Delta{Seq: 100, Ack: 100},
			in: func() pkt {
				p := ackData(sess4)
				p.flags, p.ack, p.payload = "R", 0x33333333, nil
				return p
			}(),
			out: func() pkt {
				p := ackData(subOut4)
				p.flags, p.ack, p.payload, p.seq = "R", 0x33333333, nil, 0x10000000+100
				return p
			}(),
			verdict: tcActOK, stats: map[string]uint64{"rewrite_out": 1, "delta": 1},
		},
		{
			name: "window scaled up is clamped to 65535",
			flow: deltaFlow(sess4), delta: &Delta{WsIn: 9, WsOut: 7, WsOn: 1},
			in: func() pkt {
				p := ackData(subIn4)
				p.win = 0x4001
				return p
			}(),
			out: func() pkt {
				p := ackData(sess4)
				p.win = 0xffff
				return p
			}(),
			verdict: tcActOK, stats: stats("in", true),
		},
		{
			name:   "window of a SYN-ACK is not scaled",
			egress: true, flow: &Flow{Out: EndsFrom(subIn4.Reverse()), Flags: FlDelta | FlRev},
			delta: &Delta{Seq: 1, WsIn: 0, WsOut: 4, WsOn: 1},
			in:    synAck(sess4.Reverse()),
			out: func() pkt {
				p := synAck(subIn4.Reverse())
				p.seq++
				return p
			}(),
			verdict: tcActOK, stats: stats("out", true),
		},
		{
			name: "timestamps only: SACK edges untouched",
			flow: deltaFlow(sess4), delta: &Delta{Tsval: -1000, Tsecr: 5},
			in:      ackData(subIn4, nop, nop, optTS(5000, 6000), nop, nop, sack(2, 0)),
			out:     ackData(sess4, nop, nop, optTS(4000, 6005), nop, nop, sack(2, 0)),
			verdict: tcActOK, stats: stats("in", true),
		},
		// The steady state after a proxy's removal: Linux's data segments
		// carry NOP, NOP, timestamps only, which the datapath translates
		// with direct writes (delta_direct); SACK blocks above take the
		// helpers.
		{
			name:   "NOP NOP timestamps: seq, ack, window and timestamps, IPv4",
			egress: true, flow: deltaFlow(subOut4),
			delta: &Delta{Seq: -70000, Ack: 0x7ffffff0, Tsval: -1, Tsecr: 0x10000, WsIn: 3, WsOut: 5, WsOn: 1},
			in: func() pkt {
				p := ackData(sess4, nop, nop, optTS(0xfffffffe, 6000))
				p.seq, p.win = 0x10, 0xffff
				return p
			}(),
			out: func() pkt {
				p := ackData(subOut4, nop, nop, optTS(0xfffffffd, 6000+0x10000))
				p.seq, p.ack, p.win = 0xfffeeea0, 0x20000000+0x7ffffff0, 0x3fff // seq 0x10 - 70000
				return p
			}(),
			verdict: tcActOK, stats: stats("out", true),
		},
		{
			name: "NOP NOP timestamps, IPv6",
			flow: deltaFlow(sess6), delta: &Delta{Seq: 5, Ack: -5, Tsval: 100, Tsecr: -100},
			in: ackData(subIn6, nop, nop, optTS(5000, 6000)),
			out: func() pkt {
				p := ackData(sess6, nop, nop, optTS(5100, 5900))
				p.seq, p.ack = 0x10000000+5, 0x20000000-5
				return p
			}(),
			verdict: tcActOK, stats: stats("in", true),
		},
		{
			name: "no options, IPv6: seq and ack wrap",
			flow: deltaFlow(sess6), delta: &Delta{Seq: 0x20, Ack: -0x20},
			in: func() pkt {
				p := ackData(subIn6)
				p.seq, p.ack = 0xfffffff0, 0x10
				return p
			}(),
			out: func() pkt {
				p := ackData(sess6)
				p.seq, p.ack = 0x10, 0xfffffff0
				return p
			}(),
			verdict: tcActOK, stats: stats("in", true),
		},
		{
			name: "timestamps in another layout take the helpers",
			flow: deltaFlow(sess4), delta: &Delta{Tsval: 7, Tsecr: 9},
			in:      ackData(subIn4, optTS(5000, 6000), nop, nop),
			out:     ackData(sess4, optTS(5007, 6009), nop, nop),
			verdict: tcActOK, stats: stats("in", true),
		},
		{
			name:    "flow marked for deltas without a delta entry",
			flow:    deltaFlow(sess4),
			in:      ackData(subIn4, nop, nop, optTS(5000, 6000)),
			out:     ackData(sess4, nop, nop, optTS(5000, 6000)),
			verdict: tcActOK, stats: stats("in", false),
		},
		{
			name: "delta entry of a flow not marked for deltas is ignored",
			flow: &Flow{Out: EndsFrom(sess4)}, delta: &Delta{Seq: 1, Ack: 1, Tsval: 1},
			in:      ackData(subIn4, nop, nop, optTS(5000, 6000)),
			out:     ackData(sess4, nop, nop, optTS(5000, 6000)),
			verdict: tcActOK, stats: stats("in", false),
		},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) { c.run(t, fx) })
	}
}
