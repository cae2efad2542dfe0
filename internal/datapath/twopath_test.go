package datapath

// Fixture tests of the two-path phase of a reconfiguration (paper §3.5) in
// the datapath: the shared vectors of internal/protocol (Decide, Observe),
// the marks (protocol.Marks), the cut-off (protocol.CutOff) taken by
// dysco_ctl or by the first packet on an armed new subsession, the end of
// the phase (everything on the new path with its delta), the window clamp,
// progress events, orphan drops and flag changes on live flows.

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"github.com/cilium/ebpf"
	"github.com/gopacket/gopacket/layers"

	"github.com/dysco/dysco/internal/protocol"
	"github.com/dysco/dysco/internal/wire"
)

// tpVector is one shared vector (internal/protocol/twopath_test.go).
type tpVector struct {
	Name   string           `json:"name"`
	Vars   protocol.TwoPath `json:"vars"`
	Dir    string           `json:"dir"`  // "out": Decide; "in": Observe
	Path   string           `json:"path"` // "old"/"new" for "in"
	Packet protocol.Packet  `json:"packet"`
	Pieces []protocol.Piece `json:"pieces"`
	// Delivered is an "in" packet as the anchor hands it on.
	Delivered *protocol.Packet `json:"delivered"`
	After     protocol.TwoPath `json:"after"`
}

func loadTPVectors(t *testing.T) []tpVector {
	t.Helper()
	b, err := os.ReadFile("../protocol/testdata/twopath_vectors.json")
	if err != nil {
		t.Fatal(err)
	}
	var vs []tpVector
	if err := json.Unmarshal(b, &vs); err != nil {
		t.Fatal(err)
	}
	if len(vs) == 0 {
		t.Fatal("no vectors")
	}
	return vs
}

// tpSide is one side of a session at an anchor, with its old and new
// subsessions.
type tpSide struct {
	id             uint32
	side           uint32     // 0 left, 1 right
	sess           wire.Tuple // the session tuple of packets sent toward the side: the egress flow's key
	oldSub, newSub wire.Tuple // egress rewrites on the old and the new path
}

// The right side of a left anchor (IPv4), and the left side of a right
// anchor (IPv6): egress flows of direction 0 and 1.
var (
	tpRight4 = tpSide{
		id: 0x123, side: 1,
		sess:   tup(ap("10.1.0.1:40000"), ap("10.9.0.5:80")),
		oldSub: tup(ap("10.1.0.1:41001"), ap("10.1.0.30:41002")),
		newSub: tup(ap("10.1.0.1:41003"), ap("10.1.0.31:41004")),
	}
	tpLeft6 = tpSide{
		id: 0xabcdef, side: 0,
		sess:   tup(ap("[fd00:9::5]:443"), ap("[fd00:5::7]:40000")),
		oldSub: tup(ap("[fd00:1::1]:41005"), ap("[fd00:1::30]:41006")),
		newSub: tup(ap("[fd00:1::1]:41007"), ap("[fd00:1::20]:41008")),
	}
)

func (s tpSide) key() TPKey   { return TPKey{SessId: s.id, Side: s.side} }
func (s tpSide) egKey() Tuple { return TupleFrom(s.sess) }
func (s tpSide) inOld() Tuple { return TupleFrom(s.oldSub.Reverse()) }
func (s tpSide) inNew() Tuple { return TupleFrom(s.newSub.Reverse()) }

// dirOut is the direction of packets sent toward the side (the egress
// flow's), dirIn of packets received from it.
func (s tpSide) dirOut() uint8 { return uint8(1 - s.side) }
func (s tpSide) dirIn() uint8  { return uint8(s.side) }

func revFlag(dir uint8) uint32 {
	if dir == 1 {
		return FlRev
	}
	return 0
}

// flows are the side's flows as the agent installs them for the phase.
func (s tpSide) flows() map[Tuple]Flow {
	in := Flow{Out: EndsFrom(s.sess.Reverse()), SessId: s.id, Flags: FlIngress | FlEst | revFlag(s.dirIn())}
	old, nw := in, in
	old.Flags |= FlTPOld
	nw.Flags |= FlTPNew
	return map[Tuple]Flow{
		s.egKey(): {Out: EndsFrom(s.oldSub), SessId: s.id, Flags: FlTPOut | FlEst | revFlag(s.dirOut())},
		s.inOld(): old,
		s.inNew(): nw,
	}
}

// record is the side's two-path record in state with variables v.
func (s tpSide) record(state uint32, v protocol.TwoPath) TPVal {
	r := TPVal{State: state, EgKey: s.egKey(), InOld: s.inOld(), OldOut: TupleFrom(s.oldSub), NewOut: TupleFrom(s.newSub)}
	setVars(&r, v)
	return r
}

// install empties the fixture's session state and installs rec and the
// side's flows; a flow with a delta gets FlDelta.
func (s tpSide) install(tb testing.TB, fx *fixture, rec TPVal, deltas map[Tuple]Delta) {
	tb.Helper()
	fx.reset(tb)
	clearHash(tb, fx.d.objs.DyscoTp)
	if err := fx.d.PutTwoPath(s.key(), rec); err != nil {
		tb.Fatal(err)
	}
	for k, f := range s.flows() {
		if d, ok := deltas[k]; ok {
			f.Flags |= FlDelta
			if err := fx.d.PutDelta(k, d); err != nil {
				tb.Fatal(err)
			}
		}
		if err := fx.d.AddFlow(k, f); err != nil {
			tb.Fatal(err)
		}
	}
}

func setVars(r *TPVal, v protocol.TwoPath) {
	r.OldSent, r.OldRcvd, r.OldSentAcked, r.OldRcvdAcked = v.OldSent, v.OldRcvd, v.OldSentAcked, v.OldRcvdAcked
	r.FirstNewRcvd, r.NewRcvd = v.FirstNewRcvd, uint32(boolInt(v.NewRcvd))
	r.AckHi, r.AckHiOk = v.AckHi, uint8(boolInt(v.AckHiOK))
}

func varsOf(r TPVal) protocol.TwoPath {
	return protocol.TwoPath{OldSent: r.OldSent, OldRcvd: r.OldRcvd, OldSentAcked: r.OldSentAcked,
		OldRcvdAcked: r.OldRcvdAcked, FirstNewRcvd: r.FirstNewRcvd, NewRcvd: r.NewRcvd != 0,
		AckHi: r.AckHi, AckHiOK: r.AckHiOk != 0}
}

// tpFlags spells protocol TCP flags for pkt.
func tpFlags(tb testing.TB, f uint8) string {
	tb.Helper()
	s := ""
	for _, x := range []struct {
		b uint8
		c string
	}{{protocol.TCPSyn, "S"}, {protocol.TCPAck, "A"}, {protocol.TCPFin, "F"}, {protocol.TCPRst, "R"}} {
		if f&x.b != 0 {
			s += x.c
			f &^= x.b
		}
	}
	if f != 0 {
		tb.Fatalf("unknown protocol TCP flags %#x", f)
	}
	return s
}

// tpPkt is the segment p on tuple t: window 1000, no options, p.Len bytes
// of payload.
func tpPkt(tb testing.TB, t wire.Tuple, p protocol.Packet) pkt {
	tb.Helper()
	payload := make([]byte, p.Len)
	for i := range payload {
		payload[i] = byte('a' + i%26)
	}
	return pkt{seq: p.Seq, ack: p.Ack, flags: tpFlags(tb, p.Flags), win: 1000, payload: payload}.with(t)
}

// translated is p with delta d applied as the datapath does: seq always,
// the ack only on a segment with ACK.
func translated(p protocol.Packet, d Delta) protocol.Packet {
	p.Seq += uint32(d.Seq)
	if p.Flags&protocol.TCPAck != 0 {
		p.Ack += uint32(d.Ack)
	}
	return p
}

func negated(d Delta) Delta {
	return Delta{Seq: -d.Seq, Ack: -d.Ack}
}

func (fx *fixture) twoPath(tb testing.TB, k TPKey) TPVal {
	tb.Helper()
	r, ok := fx.d.TwoPath(k)
	if !ok {
		tb.Fatalf("no two-path record %+v", k)
	}
	return r
}

func (fx *fixture) flow(tb testing.TB, k Tuple) Flow {
	tb.Helper()
	f, ok := fx.d.Flow(k)
	if !ok {
		tb.Fatalf("no flow %v", k)
	}
	return f
}

// sendTP runs the session-space segment p through egress on the side's
// egress flow and returns the verdict and output.
func (fx *fixture) sendTP(tb testing.TB, s tpSide, p protocol.Packet) (uint32, []byte) {
	tb.Helper()
	return fx.run(tb, fx.egress, tpPkt(tb, s.sess, p).frame(tb))
}

// recvTP runs p through ingress on the subsession sub (from the side), with the flow's delta d undone first so that the datapath sees p
// in session space after translating it. It checks that the packet leaves
// as p on the session tuple.
// recvTP sends p (in session space) on sub and expects it delivered as is.
func (fx *fixture) recvTP(tb testing.TB, s tpSide, sub wire.Tuple, d Delta, p protocol.Packet) {
	tb.Helper()
	fx.recvTPAs(tb, s, sub, d, p, p)
}

// recvTPAs sends p (in session space) on sub and expects delivered.
func (fx *fixture) recvTPAs(tb testing.TB, s tpSide, sub wire.Tuple, d Delta, p, delivered protocol.Packet) {
	tb.Helper()
	wirePkt := translated(p, negated(d))
	verdict, out := fx.run(tb, fx.ingress, tpPkt(tb, sub.Reverse(), wirePkt).frame(tb))
	if verdict != tcActOK {
		tb.Fatalf("ingress verdict %d, want OK", verdict)
	}
	expectFrame(tb, out, tpPkt(tb, s.sess.Reverse(), delivered))
}

// counterMoves checks counters that must have moved by exactly the
// amounts given (others are not checked).
func (fx *fixture) counterMoves(tb testing.TB, before map[string]uint64, want map[string]uint64) {
	tb.Helper()
	after := fx.stats(tb)
	for name, w := range want {
		if d := after[name] - before[name]; d != w {
			tb.Errorf("counter %s moved by %d, want %d", name, d, w)
		}
	}
}

// TestTwoPathVectors runs the shared vectors of internal/protocol through
// the datapath: "out" vectors on egress (the packet leaves on the old or
// the new path as the piece says, with the piece's sequence and ack
// numbers), "in" vectors on ingress on the old or the new subsession; the
// record's variables afterwards must be the vector's.
func TestTwoPathVectors(t *testing.T) {
	vecs := loadTPVectors(t)
	fx := newFixture(t)
	variants := []struct {
		name   string
		s      tpSide
		eg, nd Delta // egress: the old path's (the flow's own), the new path's
		inOld  Delta // ingress deltas of the old and the new subsession
		inNew  Delta
	}{
		{name: "v4", s: tpRight4},
		{name: "v6 deltas", s: tpLeft6,
			eg: Delta{Seq: 7000, Ack: -300}, nd: Delta{Seq: -123456, Ack: 0x7fff0000},
			inOld: Delta{Seq: 1000, Ack: -77}, inNew: Delta{Seq: -5000, Ack: 333}},
	}
	for _, vr := range variants {
		for _, v := range vecs {
			t.Run(vr.name+"/"+v.Name, func(t *testing.T) {
				s := vr.s
				rec := s.record(TPActive, v.Vars)
				rec.Nd = vr.nd
				deltas := map[Tuple]Delta{}
				if vr.eg != (Delta{}) {
					deltas[s.egKey()] = vr.eg
				}
				if vr.inOld != (Delta{}) {
					deltas[s.inOld()] = vr.inOld
				}
				if vr.inNew != (Delta{}) {
					deltas[s.inNew()] = vr.inNew
				}
				s.install(t, fx, rec, deltas)
				before := fx.stats(t)
				var wantOld, wantNew, wantStraddle uint64
				switch v.Dir {
				case "out":
					if len(v.Pieces) != 1 {
						t.Fatalf("%d pieces: the datapath sends every packet whole", len(v.Pieces))
					}
					pc := v.Pieces[0]
					verdict, out := fx.sendTP(t, s, v.Packet)
					if verdict != tcActOK {
						t.Fatalf("egress verdict %d, want OK", verdict)
					}
					to, d := s.oldSub, vr.eg
					switch pc.Path {
					case protocol.PathOld:
						wantOld = 1
					case protocol.PathNew:
						to, d = s.newSub, vr.nd
						wantNew = 1
					default:
						t.Fatalf("piece on path %v", pc.Path)
					}
					want := translated(protocol.Packet{Seq: pc.Seq, Ack: pc.Ack, Len: pc.Len, Flags: pc.Flags}, d)
					expectFrame(t, out, tpPkt(t, to, want))
					p := v.Packet
					if pc.Path == protocol.PathOld && p.End() != p.Seq && int32(p.Seq-v.Vars.OldSent) < 0 &&
						int32(v.Vars.OldSent-p.End()) < 0 {
						wantStraddle = 1
					}
					fx.counterMoves(t, before, map[string]uint64{"tp_old": wantOld, "tp_new": wantNew,
						"rewrite_out": 1, "drop_helper": 0})
				case "in":
					sub, d := s.oldSub, vr.inOld
					switch v.Path {
					case "old":
					case "new":
						sub, d = s.newSub, vr.inNew
					default:
						t.Fatalf("path %q", v.Path)
					}
					if v.Delivered == nil {
						t.Fatal("an in vector without its delivered packet")
					}
					fx.recvTPAs(t, s, sub, d, v.Packet, *v.Delivered)
					fx.counterMoves(t, before, map[string]uint64{"tp_old": 0, "tp_new": 0, "rewrite_in": 1, "drop_helper": 0})
				default:
					t.Fatalf("dir %q", v.Dir)
				}
				got := fx.twoPath(t, s.key())
				if g := varsOf(got); g != v.After {
					t.Errorf("variables after:\n got %v\nwant %v", g, v.After)
				}
				if got.State != TPActive {
					t.Errorf("state %d, want active", got.State)
				}
				if got.ToOld != wantOld || got.ToNew != wantNew || got.Straddled != wantStraddle {
					t.Errorf("record counted to_old %d to_new %d straddled %d, want %d %d %d",
						got.ToOld, got.ToNew, got.Straddled, wantOld, wantNew, wantStraddle)
				}
			})
		}
	}
}

// TestTwoPathStraddleCounted: data straddling the cut-off, sent whole on
// the old path, moves the tp_straddle counter (consts.h
// STAT_TP_STRADDLE) as well as the record's own count.
func TestTwoPathStraddleCounted(t *testing.T) {
	fx := newFixture(t)
	s := tpRight4
	vars := protocol.TwoPath{OldSent: 1000, OldSentAcked: 900, OldRcvd: 5000, OldRcvdAcked: 4000}
	s.install(t, fx, s.record(TPActive, vars), nil)
	p := protocol.Packet{Seq: 990, Len: 20, Ack: 4800, Flags: protocol.TCPAck}
	d, _ := protocol.Decide(vars, p)
	if d.N != 1 || d.Pieces[0].Path != protocol.PathOld {
		t.Fatalf("protocol.Decide: %v", d.List())
	}
	before := fx.stats(t)
	if verdict, _ := fx.sendTP(t, s, p); verdict != tcActOK {
		t.Fatalf("verdict %d", verdict)
	}
	if r := fx.twoPath(t, s.key()); r.Straddled != 1 {
		t.Errorf("record counted %d straddling packets, want 1", r.Straddled)
	}
	fx.counterMoves(t, before, map[string]uint64{"tp_straddle": 1, "tp_old": 1})
}

// marksOf reads a flow's marks as protocol.Marks: an egress flow's are
// what was sent, an ingress flow's what was received.
func marksOf(f Flow, ingress bool) protocol.Marks {
	if ingress {
		return protocol.Marks{RcvNxt: f.MkSeq, AckRcvd: f.MkAck, Rcvd: f.Marked()}
	}
	return protocol.Marks{SndNxt: f.MkSeq, AckSent: f.MkAck, Sent: f.Marked()}
}

// TestTwoPathMarks: every flow keeps the marks of protocol.Marks in session
// space: before the egress delta, after the ingress one.
func TestTwoPathMarks(t *testing.T) {
	fx := newFixture(t)
	s := tpRight4
	out := []protocol.Packet{
		{Seq: 0xfffffff0, Ack: 77, Flags: protocol.TCPAck},             // a pure ack: seq is the next byte
		{Seq: 0xfffffff0, Len: 0x20, Ack: 500, Flags: protocol.TCPAck}, // wraps
		{Seq: 0xfffffff8, Len: 8, Ack: 400, Flags: protocol.TCPAck},    // retransmission, stale ack
		{Seq: 0x10, Ack: 610, Flags: protocol.TCPAck | protocol.TCPFin},
		{Seq: 0x11, Ack: 0x7777, Flags: protocol.TCPRst}, // no ACK: its ack field means nothing
	}
	in := []protocol.Packet{
		{Seq: 500, Len: 10, Ack: 0xfffffff0, Flags: protocol.TCPAck},
		{Seq: 510, Len: 100, Ack: 0x10, Flags: protocol.TCPAck},
		{Seq: 400, Len: 10, Ack: 0x8, Flags: protocol.TCPAck}, // retransmission, stale ack
		{Seq: 610, Ack: 0x11, Flags: protocol.TCPAck | protocol.TCPFin},
		{Seq: 0xfffffff0, Len: 0x30, Ack: 0x12, Flags: protocol.TCPAck}, // far behind: wraps, not the highest
	}
	for _, c := range []struct {
		name      string
		s         tpSide
		eg, inOld Delta
	}{
		{name: "v4 no deltas", s: s},
		{name: "v4 deltas", s: s, eg: Delta{Seq: 99, Ack: -5}, inOld: Delta{Seq: 0x1000, Ack: -0x20}},
		{name: "v6 deltas", s: tpLeft6, eg: Delta{Seq: -0x7000000, Ack: 12345}, inOld: Delta{Seq: 3, Ack: 0x40000000}},
	} {
		t.Run(c.name, func(t *testing.T) {
			s := c.s
			fx.reset(t)
			clearHash(t, fx.d.objs.DyscoTp)
			// Plain flows: marks are kept with or without a two-path record.
			eg := Flow{Out: EndsFrom(s.oldSub), SessId: s.id, Flags: FlEst | revFlag(s.dirOut())}
			ing := Flow{Out: EndsFrom(s.sess.Reverse()), SessId: s.id, Flags: FlIngress | FlEst | revFlag(s.dirIn())}
			if c.eg != (Delta{}) {
				eg.Flags |= FlDelta
				if err := fx.d.PutDelta(s.egKey(), c.eg); err != nil {
					t.Fatal(err)
				}
			}
			if c.inOld != (Delta{}) {
				ing.Flags |= FlDelta
				if err := fx.d.PutDelta(s.inOld(), c.inOld); err != nil {
					t.Fatal(err)
				}
			}
			if err := fx.d.AddFlow(s.egKey(), eg); err != nil {
				t.Fatal(err)
			}
			if err := fx.d.AddFlow(s.inOld(), ing); err != nil {
				t.Fatal(err)
			}
			if m := marksOf(fx.flow(t, s.egKey()), false); m.Sent {
				t.Fatalf("new egress flow has marks %+v", m)
			}
			var wantOut, wantIn protocol.Marks
			for i := range out {
				verdict, o := fx.sendTP(t, s, out[i])
				if verdict != tcActOK {
					t.Fatalf("egress verdict %d", verdict)
				}
				expectFrame(t, o, tpPkt(t, s.oldSub, translated(out[i], c.eg)))
				wantOut = wantOut.Out(out[i])
				if got := marksOf(fx.flow(t, s.egKey()), false); got != wantOut {
					t.Errorf("after sending %v: egress marks %+v, want %+v", out[i], got, wantOut)
				}
				fx.recvTP(t, s, s.oldSub, c.inOld, in[i])
				wantIn = wantIn.In(in[i])
				if got := marksOf(fx.flow(t, s.inOld()), true); got != wantIn {
					t.Errorf("after receiving %v: ingress marks %+v, want %+v", in[i], got, wantIn)
				}
			}
		})
	}
}

// tpMarkPackets sends and receives on the old path of s, in session space,
// and returns the side's marks as protocol.Marks computes them. The
// ingress ack passes the highest sequence number sent (as a middlebox that
// joined a path can see) and the highest ack sent passes the highest
// sequence number received, so that both maxima of CutOff matter.
func tpMarkPackets(tb testing.TB, fx *fixture, s tpSide, inOld Delta) protocol.Marks {
	tb.Helper()
	var m protocol.Marks
	out := []protocol.Packet{
		{Seq: 1000, Len: 100, Ack: 5000, Flags: protocol.TCPAck},
		{Seq: 1100, Len: 50, Ack: 5100, Flags: protocol.TCPAck},
		{Seq: 1150, Ack: 5300, Flags: protocol.TCPAck},
	}
	in := []protocol.Packet{
		{Seq: 5000, Len: 200, Ack: 1200, Flags: protocol.TCPAck},
		{Seq: 5200, Ack: 1100, Flags: protocol.TCPAck},
	}
	for i, p := range out {
		verdict, o := fx.sendTP(tb, s, p)
		if verdict != tcActOK {
			tb.Fatalf("egress verdict %d", verdict)
		}
		// Before the phase starts, everything goes on the old path.
		expectFrame(tb, o, tpPkt(tb, s.oldSub, p))
		m = m.Out(p)
		if i < len(in) {
			fx.recvTP(tb, s, s.oldSub, inOld, in[i])
			m = m.In(in[i])
		}
	}
	return m
}

// TestStartTwoPath: dysco_ctl takes the cut-off from the marks of the
// side's egress flow and old ingress flow (protocol.CutOff); a second start
// changes nothing.
func TestStartTwoPath(t *testing.T) {
	fx := newFixture(t)
	for _, s := range []tpSide{tpRight4, tpLeft6} {
		t.Run(s.sess.String(), func(t *testing.T) {
			// Stale variables in the record are replaced by the cut-off.
			rec := s.record(TPIdle, protocol.TwoPath{OldSent: 1, OldRcvd: 2, OldSentAcked: 3, OldRcvdAcked: 4})
			inOld := Delta{Seq: 0x100000, Ack: -0x2000}
			s.install(t, fx, rec, map[Tuple]Delta{s.inOld(): inOld})
			m := tpMarkPackets(t, fx, s, inOld)
			want := protocol.CutOff(m)
			if want.OldSent != 1200 || want.OldRcvd != 5300 {
				t.Fatalf("test packets do not exercise CutOff's maxima: %v", want)
			}
			if r := fx.twoPath(t, s.key()); r.State != TPIdle || varsOf(r) != varsOf(rec) {
				t.Fatalf("record changed before the start: state %d %v", r.State, varsOf(r))
			}
			if err := fx.d.StartTwoPath(s.key()); err != nil {
				t.Fatal(err)
			}
			r := fx.twoPath(t, s.key())
			if r.State != TPActive {
				t.Errorf("state %d, want active", r.State)
			}
			if got := varsOf(r); got != want {
				t.Errorf("cut-off\n got %v\nwant %v (marks %+v)", got, want, m)
			}
			if err := fx.d.StartTwoPath(s.key()); err != nil {
				t.Errorf("second start: %v", err)
			}
			if r2 := fx.twoPath(t, s.key()); r2 != r {
				t.Errorf("second start changed the record:\n got %+v\nwant %+v", r2, r)
			}
			// The phase runs from the cut-off: new data goes on the new path.
			p := protocol.Packet{Seq: want.OldSent, Len: 10, Ack: want.OldRcvd, Flags: protocol.TCPAck}
			d, after := protocol.Decide(want, p)
			_, o := fx.sendTP(t, s, p)
			pc := d.Pieces[0]
			to := s.oldSub
			if pc.Path == protocol.PathNew {
				to = s.newSub
			}
			expectFrame(t, o, tpPkt(t, to, protocol.Packet{Seq: pc.Seq, Ack: pc.Ack, Len: pc.Len, Flags: pc.Flags}))
			if got := varsOf(fx.twoPath(t, s.key())); got != after {
				t.Errorf("after the first packet of the phase\n got %v\nwant %v", got, after)
			}
		})
	}
	if err := fx.d.StartTwoPath(TPKey{SessId: 999, Side: 1}); !errors.Is(err, syscall.ENOENT) {
		t.Errorf("start of a side without a record: %v, want ENOENT", err)
	}
}

// TestTwoPathArmedStart: the first packet on the new subsession of an armed
// side starts the phase from the marks (and is observed on the new path);
// packets on the old subsession (also one still flagged new from an earlier
// reconfiguration), or on the new one of a side not armed, do not.
func TestTwoPathArmedStart(t *testing.T) {
	fx := newFixture(t)
	events, err := fx.d.EventReader()
	if err != nil {
		t.Fatal(err)
	}
	defer events.Close()
	first := protocol.Packet{Seq: 5300, Len: 10, Ack: 1250, Flags: protocol.TCPAck}
	inNew := Delta{Seq: -0x3000, Ack: 0x44}
	for _, s := range []tpSide{tpRight4, tpLeft6} {
		// The old subsession of a side's second reconfiguration was the
		// new one of its first: a flow still marked new as well as old
		// is the old path.
		for _, c := range []struct {
			name      string
			oldWasNew bool
		}{{"armed", false}, {"old path was new", true}} {
			t.Run(s.sess.String()+"/"+c.name, func(t *testing.T) {
				rec := s.record(TPIdle, protocol.TwoPath{})
				rec.Armed = 1
				s.install(t, fx, rec, map[Tuple]Delta{s.inNew(): inNew})
				if c.oldWasNew {
					if err := fx.d.SetFlowFlags(s.inOld(), FlTPNew, 0); err != nil {
						t.Fatal(err)
					}
				}
				m := tpMarkPackets(t, fx, s, Delta{})
				// More on the old subsession: still idle.
				old := protocol.Packet{Seq: 5200, Len: 100, Ack: 1150, Flags: protocol.TCPAck}
				fx.recvTP(t, s, s.oldSub, Delta{}, old)
				m = m.In(old)
				if r := fx.twoPath(t, s.key()); r.State != TPIdle {
					t.Fatalf("a packet on the old subsession changed the state to %d", r.State)
				}
				fx.recvTP(t, s, s.newSub, inNew, first)
				want := protocol.Observe(protocol.CutOff(m), protocol.PathNew, first)
				r := fx.twoPath(t, s.key())
				if r.State != TPActive {
					t.Fatalf("state %d after the first packet on the new subsession, want active", r.State)
				}
				if got := varsOf(r); got != want {
					t.Errorf("variables\n got %v\nwant %v (marks %+v)", got, want, m)
				}
				wantBits := tpBits(TPActive, want)
				if r.Reported != wantBits {
					t.Errorf("reported bits %#x, want %#x", r.Reported, wantBits)
				}
				// Unlike the agent's own start (TestTwoPathEvents), a
				// start by a packet tells the agent: the start's event,
				// then the first packet's if it changed the bits.
				for {
					ev, ok := readEvent(t, events, 2*time.Second)
					if !ok {
						t.Fatalf("no event with bits %#x after the start by a packet", wantBits)
					}
					if ev.SessID != s.id || ev.Side != s.side {
						t.Fatalf("event %+v, want session %d side %d", ev, s.id, s.side)
					}
					if ev.Bits == wantBits {
						break
					}
				}
			})
		}
		t.Run(s.sess.String()+"/not armed", func(t *testing.T) {
			s.install(t, fx, s.record(TPIdle, protocol.TwoPath{}), map[Tuple]Delta{s.inNew(): inNew})
			tpMarkPackets(t, fx, s, Delta{})
			fx.recvTP(t, s, s.newSub, inNew, first)
			r := fx.twoPath(t, s.key())
			if r.State != TPIdle || varsOf(r) != (protocol.TwoPath{}) {
				t.Errorf("a side not armed started: state %d %v", r.State, varsOf(r))
			}
		})
	}
}

// TestTwoPathNew: once the phase ends (TPNew), every packet goes on the new
// path with the new subsession's delta, ack and SACK edges included.
func TestTwoPathNew(t *testing.T) {
	fx := newFixture(t)
	for _, s := range []tpSide{tpRight4, tpLeft6} {
		t.Run(s.sess.String(), func(t *testing.T) {
			vars := protocol.TwoPath{OldSent: 1000, OldSentAcked: 900, OldRcvd: 5000, OldRcvdAcked: 4000}
			rec := s.record(TPActive, vars)
			rec.Nd = Delta{Seq: 3, Ack: int32(-500), Tsecr: -7}
			s.install(t, fx, rec, nil)
			if err := fx.d.SetTwoPathState(s.key(), TPNew); err != nil {
				t.Fatal(err)
			}
			nop := optNOP()
			// A retransmission below oldSent, acking old-path data: the
			// cut-off tables would send it on the old path.
			in := pkt{seq: 900, ack: 4500, flags: "A", win: 1000, payload: []byte("0123456789"),
				opts: []layers.TCPOption{nop, nop, optTS(111, 222), nop, nop, optSACK(4600, 4700, 4800, 4900)}}
			want := in.withOpts(nop, nop, optTS(111, 215), nop, nop, optSACK(4100, 4200, 4300, 4400))
			want.seq, want.ack = 903, 4000
			before := fx.stats(t)
			verdict, out := fx.run(t, fx.egress, in.with(s.sess).frame(t))
			if verdict != tcActOK {
				t.Fatalf("verdict %d", verdict)
			}
			expectFrame(t, out, want.with(s.newSub))
			fx.counterMoves(t, before, map[string]uint64{"tp_new": 1, "tp_old": 0, "rewrite_out": 1})
			r := fx.twoPath(t, s.key())
			if r.State != TPNew || r.ToNew != 1 || r.ToOld != 0 {
				t.Errorf("state %d to_new %d to_old %d, want %d 1 0", r.State, r.ToNew, r.ToOld, TPNew)
			}
			if varsOf(r) != vars {
				t.Errorf("variables changed after the phase: %v", varsOf(r))
			}
		})
	}
}

// TestTwoPathWindowClamp: while a clamp is set, the side advertises at most
// the clamp (in bytes, after its window scale), with the checksum right.
func TestTwoPathWindowClamp(t *testing.T) {
	fx := newFixture(t)
	for _, s := range []tpSide{tpRight4, tpLeft6} {
		for _, state := range []uint32{TPIdle, TPActive, TPNew} {
			t.Run(fmt.Sprintf("%s/state %d", s.sess, state), func(t *testing.T) {
				vars := protocol.TwoPath{OldSent: 1000, OldSentAcked: 1000, OldRcvd: 5000, OldRcvdAcked: 5000}
				rec := s.record(state, vars)
				rec.SndWs = 7
				s.install(t, fx, rec, nil)
				if err := fx.d.SetWindowClamp(s.key(), 65535); err != nil {
					t.Fatal(err)
				}
				if r := fx.twoPath(t, s.key()); r.Clamp != 65535 {
					t.Fatalf("clamp %d", r.Clamp)
				}
				p := protocol.Packet{Seq: 1000, Len: 10, Ack: 5000, Flags: protocol.TCPAck}
				to := s.newSub
				if state == TPIdle {
					to = s.oldSub
				}
				try := func(win, wantWin uint16, clamped uint64) {
					t.Helper()
					in := tpPkt(t, s.sess, p)
					in.win = win
					want := tpPkt(t, to, p)
					want.win = wantWin
					before := fx.stats(t)
					verdict, out := fx.run(t, fx.egress, in.frame(t))
					if verdict != tcActOK {
						t.Fatalf("verdict %d", verdict)
					}
					expectFrame(t, out, want)
					fx.counterMoves(t, before, map[string]uint64{"tp_clamp": clamped})
				}
				try(1000, 65535>>7, 1) // 128000 bytes
				try(512, 511, 1)       // 65536 bytes
				try(511, 511, 0)       // 65408 bytes: within the clamp
				try(300, 300, 0)
				if err := fx.d.SetWindowClamp(s.key(), 0); err != nil {
					t.Fatal(err)
				}
				try(1000, 1000, 0)
			})
		}
	}
}

// tpBits is the progress summary the datapath reports for variables v.
func tpBits(state uint32, v protocol.TwoPath) uint32 {
	var b uint32
	if state == TPActive {
		b |= TPBActive
	}
	if v.SendDone() {
		b |= TPBSendDone
	}
	if v.OldRcvdAcked == v.OldRcvd {
		b |= TPBRcvdAcked
	}
	if v.NewRcvd {
		b |= TPBNewRcvd
		if int32(v.FirstNewRcvd-v.OldRcvd) <= 0 {
			b |= TPBNewAtOld
		}
	}
	return b
}

// readEvent waits up to d for an event.
func readEvent(t *testing.T, r *EventReader, d time.Duration) (TPEvent, bool) {
	t.Helper()
	r.r.SetDeadline(time.Now().Add(d))
	ev, err := r.Read()
	if errors.Is(err, os.ErrDeadlineExceeded) {
		return TPEvent{}, false
	}
	if err != nil {
		t.Fatalf("read event: %v", err)
	}
	return ev, true
}

// TestTwoPathEvents: every change of a side's progress summary made by a
// packet, and only a change, sends an event with the side and the new bits;
// a change made by the agent's command (the cut-off, the end of the phase)
// sends none.
func TestTwoPathEvents(t *testing.T) {
	fx := newFixture(t)
	r, err := fx.d.EventReader()
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	for _, s := range []tpSide{tpRight4, tpLeft6} {
		t.Run(s.sess.String(), func(t *testing.T) {
			s.install(t, fx, s.record(TPIdle, protocol.TwoPath{}), nil)
			expect := func(what string, state uint32, v protocol.TwoPath) {
				t.Helper()
				if got := varsOf(fx.twoPath(t, s.key())); got != v {
					t.Errorf("%s: variables\n got %v\nwant %v", what, got, v)
				}
				want := TPEvent{SessID: s.id, Side: s.side, Bits: tpBits(state, v)}
				ev, ok := readEvent(t, r, 2*time.Second)
				if !ok {
					t.Errorf("%s: no event, want %+v", what, want)
					return
				}
				if ev != want {
					t.Errorf("%s: event %+v, want %+v", what, ev, want)
				}
			}
			none := func(what string) {
				t.Helper()
				if ev, ok := readEvent(t, r, 100*time.Millisecond); ok {
					t.Errorf("%s: unexpected event %+v", what, ev)
				}
			}
			// A change the agent made itself (dysco_ctl) is recorded as
			// reported but sends no event: the agent reads the variables
			// after its command.
			quiet := func(what string, state uint32, v protocol.TwoPath) {
				t.Helper()
				rec := fx.twoPath(t, s.key())
				if got := varsOf(rec); got != v {
					t.Errorf("%s: variables\n got %v\nwant %v", what, got, v)
				}
				if want := tpBits(state, v); rec.Reported != want {
					t.Errorf("%s: reported bits %#x, want %#x", what, rec.Reported, want)
				}
				none(what)
			}
			none("install")
			var m protocol.Marks
			o := protocol.Packet{Seq: 1000, Len: 100, Ack: 5000, Flags: protocol.TCPAck}
			i := protocol.Packet{Seq: 5000, Ack: 1000, Flags: protocol.TCPAck}
			fx.sendTP(t, s, o)
			fx.recvTP(t, s, s.oldSub, Delta{}, i)
			m = m.Out(o).In(i)
			none("packets before the phase")
			if err := fx.d.StartTwoPath(s.key()); err != nil {
				t.Fatal(err)
			}
			v := protocol.CutOff(m)
			quiet("start", TPActive, v)
			if err := fx.d.StartTwoPath(s.key()); err != nil {
				t.Fatal(err)
			}
			none("second start")

			// A pure ack on the old path that changes no bit.
			o = protocol.Packet{Seq: 1100, Ack: 5000, Flags: protocol.TCPAck}
			_, v = protocol.Decide(v, o)
			fx.sendTP(t, s, o)
			none("duplicate ack")
			// The old data acknowledged: send done.
			i = protocol.Packet{Seq: 5000, Ack: 1100, Flags: protocol.TCPAck}
			v = protocol.Observe(v, protocol.PathOld, i)
			fx.recvTP(t, s, s.oldSub, Delta{}, i)
			expect("old data acknowledged", TPActive, v)
			// Old-path data not yet acknowledged.
			i = protocol.Packet{Seq: 5000, Len: 50, Ack: 1100, Flags: protocol.TCPAck}
			v = protocol.Observe(v, protocol.PathOld, i)
			fx.recvTP(t, s, s.oldSub, Delta{}, i)
			expect("old data received", TPActive, v)
			// New-path data beyond it: a hole.
			i = protocol.Packet{Seq: 5100, Len: 10, Ack: 1100, Flags: protocol.TCPAck}
			v = protocol.Observe(v, protocol.PathNew, i)
			fx.recvTP(t, s, s.newSub, Delta{}, i)
			expect("new data after a hole", TPActive, v)
			// The hole filled on the old path, and acknowledged by data
			// sent on the new path.
			i = protocol.Packet{Seq: 5050, Len: 50, Ack: 1100, Flags: protocol.TCPAck}
			v = protocol.Observe(v, protocol.PathOld, i)
			fx.recvTP(t, s, s.oldSub, Delta{}, i)
			expect("hole filled", TPActive, v)
			o = protocol.Packet{Seq: 1100, Len: 10, Ack: 5110, Flags: protocol.TCPAck}
			d, after := protocol.Decide(v, o)
			if d.Pieces[0].Path != protocol.PathNew {
				t.Fatalf("protocol.Decide: %v", d.List())
			}
			v = after
			fx.sendTP(t, s, o)
			expect("old data acknowledged on the new path", TPActive, v)
			if err := fx.d.SetTwoPathState(s.key(), TPNew); err != nil {
				t.Fatal(err)
			}
			quiet("phase ended", TPNew, v)
		})
	}
	if st := fx.stats(t); st["events_lost"] != 0 {
		t.Errorf("%d events lost", st["events_lost"])
	}
}

// TestFlowDrop: a packet of a flow marked FlDrop (a proxy's socket after
// the proxy left the path) is dropped and counted, at either hook.
func TestFlowDrop(t *testing.T) {
	fx := newFixture(t)
	for _, egress := range []bool{true, false} {
		name, prog, in := "ingress", fx.ingress, dataPkt(subIn4)
		f := Flow{Out: EndsFrom(sess4), SessId: 5, Flags: FlDrop | FlIngress | FlEst}
		if egress {
			name, prog, in = "egress", fx.egress, dataPkt(sess4)
			f = Flow{Out: EndsFrom(subOut4), SessId: 5, Flags: FlDrop | FlEst}
		}
		t.Run(name, func(t *testing.T) {
			fx.reset(t)
			if err := fx.d.AddFlow(in.key(), f); err != nil {
				t.Fatal(err)
			}
			before := fx.stats(t)
			if verdict, _ := fx.run(t, prog, in.frame(t)); verdict != tcActShot {
				t.Errorf("verdict %d, want SHOT", verdict)
			}
			fx.expectStats(t, before, map[string]uint64{"drop_orphan": 1})
			if g := fx.flow(t, in.key()); g.Packets != 1 {
				t.Errorf("flow counted %d packets, want 1", g.Packets)
			}
		})
	}
}

// TestSetFlowFlags: flags of a live flow are set and cleared in the kernel
// without losing what the datapath wrote into the entry (counters, marks).
func TestSetFlowFlags(t *testing.T) {
	fx := newFixture(t)
	in := dataPkt(sess4)
	k := in.key()
	if err := fx.d.AddFlow(k, Flow{Out: EndsFrom(subOut4), SessId: 5, Flags: FlEst}); err != nil {
		t.Fatal(err)
	}
	frame := in.frame(t)
	send := func(want uint32) {
		t.Helper()
		if verdict, _ := fx.run(t, fx.egress, frame); verdict != want {
			t.Fatalf("verdict %d, want %d", verdict, want)
		}
	}
	for i := 0; i < 3; i++ {
		send(tcActOK)
	}
	f0 := fx.flow(t, k)
	if f0.Packets != 3 || f0.Bytes != 3*uint64(len(frame)) || !f0.Marked() || f0.Flags != FlEst|FlMarks {
		t.Fatalf("flow before: packets %d bytes %d flags %s", f0.Packets, f0.Bytes, flagNames(f0.Flags))
	}
	check := func(what string, flags uint32, packets uint64) {
		t.Helper()
		f := fx.flow(t, k)
		if f.Flags != flags {
			t.Errorf("%s: flags %s, want %s", what, flagNames(f.Flags), flagNames(flags))
		}
		if f.Packets != packets || f.Bytes != packets*uint64(len(frame)) || int32(f.LastMs-f0.LastMs) < 0 {
			t.Errorf("%s: counters packets %d bytes %d, want %d %d", what, f.Packets, f.Bytes, packets, packets*uint64(len(frame)))
		}
		if f.Marked() != f0.Marked() || f.MkSeq != f0.MkSeq || f.MkAck != f0.MkAck {
			t.Errorf("%s: marks %v %#x %#x, want %v %#x %#x", what, f.Marked(), f.MkSeq, f.MkAck, f0.Marked(), f0.MkSeq, f0.MkAck)
		}
		if f.Out != f0.Out || f.SessId != f0.SessId || f.Dir() != f0.Dir() {
			t.Errorf("%s: flow changed: %+v", what, f)
		}
	}
	if err := fx.d.SetFlowFlags(k, FlDrop, 0); err != nil {
		t.Fatal(err)
	}
	check("drop set", FlEst|FlMarks|FlDrop, 3)
	send(tcActShot)
	check("dropped packet", FlEst|FlMarks|FlDrop, 4)
	if err := fx.d.SetFlowFlags(k, FlTap|FlRouted, FlDrop); err != nil {
		t.Fatal(err)
	}
	check("drop cleared", FlEst|FlMarks|FlTap|FlRouted, 4)
	send(tcActOK)
	check("forwarded again", FlEst|FlMarks|FlTap|FlRouted, 5)
	if err := fx.d.SetFlowFlags(k, 0, FlTap|FlRouted); err != nil {
		t.Fatal(err)
	}
	check("cleared", FlEst|FlMarks, 5)
	err := fx.d.SetFlowFlags(TupleFrom(sess6), FlDrop, 0)
	if !errors.Is(err, syscall.ENOENT) {
		t.Errorf("flags of a missing flow: %v, want ENOENT", err)
	}
	if _, ok := fx.d.Flow(TupleFrom(sess6)); ok {
		t.Error("setting flags created a flow")
	}
}

// TestKeptLock: a middle agent's lock (PutLock) is read back, listed, not
// taken for a side's request, and goes with DeleteReconfigState.
func TestKeptLock(t *testing.T) {
	fx := newFixture(t)
	la := netip.MustParseAddr("10.0.0.1").As16()
	const id = 4242
	if _, _, ok := fx.d.Lock(id); ok {
		t.Fatal("a lock before PutLock")
	}
	if err := fx.d.PutLock(id, la, 17); err != nil {
		t.Fatal(err)
	}
	if got, n, ok := fx.d.Lock(id); !ok || got != la || n != 17 {
		t.Fatalf("Lock = %v %d %v", got, n, ok)
	}
	for side := uint32(0); side < 2; side++ {
		if _, ok := fx.d.TPReqOf(TPKey{SessId: id, Side: side}); ok {
			t.Fatalf("side %d has a request", side)
		}
	}
	var listed []uint32
	if err := fx.d.EachLock(func(id uint32) { listed = append(listed, id) }); err != nil || len(listed) != 1 || listed[0] != id {
		t.Fatalf("EachLock: %v %v", listed, err)
	}
	fx.d.DeleteReconfigState(id)
	if _, _, ok := fx.d.Lock(id); ok {
		t.Fatal("the lock outlived DeleteReconfigState")
	}
}

// TestKeptSplice: a proxy's joined sessions (PutSplice) are listed with
// their delta, are neither a lock nor a side's request, and go with
// DeleteSplice, DeleteReconfigState and FreeSession of the client's
// session.
func TestKeptSplice(t *testing.T) {
	fx := newFixture(t)
	want := Splice{Client: 7, Server: 9, SeqLR: 0xfffffff9, TSLR: 16, SeqRL: 1234, TSRL: 0x80000000,
		ClientCreatedMs: 0xfffffffe, ServerCreatedMs: 3}
	list := func() []Splice {
		t.Helper()
		var got []Splice
		if err := fx.d.EachSplice(func(sp Splice) { got = append(got, sp) }); err != nil {
			t.Fatal(err)
		}
		return got
	}
	put := func() {
		t.Helper()
		if err := fx.d.PutSplice(want); err != nil {
			t.Fatal(err)
		}
		if got := list(); len(got) != 1 || got[0] != want {
			t.Fatalf("EachSplice: %+v, want %+v", got, want)
		}
	}
	put()
	if _, _, ok := fx.d.Lock(want.Client); ok {
		t.Error("joined sessions taken for a kept lock")
	}
	var locks []uint32
	if err := fx.d.EachLock(func(id uint32) { locks = append(locks, id) }); err != nil || len(locks) != 0 {
		t.Errorf("EachLock: %v %v", locks, err)
	}
	for side := uint32(0); side < 2; side++ {
		if _, ok := fx.d.TPReqOf(TPKey{SessId: want.Client, Side: side}); ok {
			t.Fatalf("side %d has a request", side)
		}
	}
	if err := fx.d.SpliceAnswered(want.Client); err != nil {
		t.Fatal(err)
	}
	answered := want
	answered.Answered = true
	if got := list(); len(got) != 1 || got[0] != answered {
		t.Fatalf("after SpliceAnswered: %+v, want %+v", got, answered)
	}
	if err := fx.d.SpliceAnswered(want.Server); !errors.Is(err, ebpf.ErrKeyNotExist) {
		t.Errorf("SpliceAnswered with nothing kept: %v, want ErrKeyNotExist", err)
	}
	fx.d.DeleteSplice(want.Client)
	if got := list(); len(got) != 0 {
		t.Fatalf("after DeleteSplice: %+v", got)
	}
	put()
	fx.d.DeleteReconfigState(want.Server) // not the key's session
	if len(list()) != 1 {
		t.Fatal("DeleteReconfigState of the server's session took the client's")
	}
	fx.d.DeleteReconfigState(want.Client)
	if got := list(); len(got) != 0 {
		t.Fatalf("after DeleteReconfigState: %+v", got)
	}
	put()
	fx.d.DeleteReconfigStates([]uint32{want.Client})
	if got := list(); len(got) != 0 {
		t.Fatalf("after DeleteReconfigStates: %+v", got)
	}
	put()
	if _, err := fx.d.FreeSession(want.Client, Tuple{}); err != nil {
		t.Fatal(err)
	}
	if got := list(); len(got) != 0 {
		t.Fatalf("after FreeSession: %+v", got)
	}
}

// TestDeleteReconfigStates: the collector's batch removes every two-path
// record, request and kept lock of the ended sessions, and nothing of the
// others; ids without any (sessions never reconfigured) are no error.
func TestDeleteReconfigStates(t *testing.T) {
	fx := newFixture(t)
	la := netip.MustParseAddr("10.0.0.1").As16()
	var ended, live []uint32
	for id := uint32(1); id <= 300; id++ { // over one batch of the walk
		for side := uint32(0); side < 2; side++ {
			k := TPKey{SessId: id, Side: side}
			if err := fx.d.PutTwoPath(k, TPVal{State: 1}); err != nil {
				t.Fatal(err)
			}
			if err := fx.d.objs.DyscoTpReq.Put(&k, &TPReq{Id: id}); err != nil {
				t.Fatal(err)
			}
		}
		if err := fx.d.PutLock(id, la, id); err != nil {
			t.Fatal(err)
		}
		if id%3 == 0 {
			live = append(live, id)
		} else {
			ended = append(ended, id)
		}
	}
	// Ids with nothing to delete, first, among and last.
	ask := append(append([]uint32{100000}, ended[:50]...), 100001)
	ask = append(append(ask, ended[50:]...), 100002)
	fx.d.DeleteReconfigStates(ask)
	fx.d.DeleteReconfigStates(nil)
	has := func(id uint32) (n int) {
		for side := uint32(0); side < 2; side++ {
			if _, ok := fx.d.TwoPath(TPKey{SessId: id, Side: side}); ok {
				n++
			}
			if _, ok := fx.d.TPReqOf(TPKey{SessId: id, Side: side}); ok {
				n++
			}
		}
		if _, _, ok := fx.d.Lock(id); ok {
			n++
		}
		return n
	}
	for _, id := range ended {
		if n := has(id); n != 0 {
			t.Errorf("session %d ended: %d entries of 5 left", id, n)
		}
	}
	for _, id := range live {
		if n := has(id); n != 5 {
			t.Errorf("session %d live: %d entries of 5 left", id, n)
		}
	}
}

// TestCtlArgsLayout: ctlArgs hands dysco_ctl the Go struct's own memory,
// which must be what encoding/binary would have written (no hidden
// padding, fields where C has them).
func TestCtlArgsLayout(t *testing.T) {
	a := dyscoCtlArgs{Op: 1, Arg: 2, Ret: -3, Key: TupleFrom(subIn4), Tp: TPKey{SessId: 4, Side: 1}, Key2: TupleFrom(sess6)}
	want, err := binary.Append(nil, binary.NativeEndian, &a)
	if err != nil {
		t.Fatal(err)
	}
	got := unsafe.Slice((*byte)(unsafe.Pointer(&a)), unsafe.Sizeof(a))
	if !bytes.Equal(got, want) {
		t.Fatalf("dyscoCtlArgs in memory:\n%x\nencoded:\n%x", got, want)
	}
}

// TestFreeAndCutSession: CutSession and FreeSession find a session's flows
// in the kernel as the agent's flowKeysOf did (from its tuple and its
// two-path records), touch only the flows that are still the session's,
// and FreeSession leaves nothing of it: deltas, two-path records, kept
// requests, set-up state, the session.
func TestFreeAndCutSession(t *testing.T) {
	fx := newFixture(t)
	fx.reset(t)
	clearHash(t, fx.d.objs.DyscoTp)
	clearHash(t, fx.d.objs.DyscoTpReq)
	m := fx.d.Maps()
	// A middlebox host's session (§3.1 join): in on l, out on r, and a
	// right side in its two-path phase toward a new subsession n.
	sess := tup(ap("10.1.0.1:40000"), ap("10.9.0.5:80"))
	l := tup(ap("10.1.0.20:41001"), ap("10.1.0.30:41002"))
	r := tup(ap("10.1.0.30:41003"), ap("10.1.0.40:41004"))
	n := tup(ap("10.1.0.30:41005"), ap("10.1.0.41:41006"))
	s := Session{Tuple: EndsFrom(sess), Role: RoleMiddle, State: StEst}
	id, err := fx.d.InsertSession(s)
	if err != nil {
		t.Fatal(err)
	}
	other, err := fx.d.InsertSession(s)
	if err != nil {
		t.Fatal(err)
	}
	ingress := map[Tuple]Flow{
		TupleFrom(l):           {Out: EndsFrom(sess), SessId: id, Flags: FlIngress | FlEst | FlDelta},
		TupleFrom(r.Reverse()): {Out: EndsFrom(sess.Reverse()), SessId: id, Flags: FlIngress | FlRev | FlEst},
	}
	egress := map[Tuple]Flow{
		TupleFrom(sess):           {Out: EndsFrom(r), SessId: id, Flags: FlEst | FlTPOut | FlDelta},
		TupleFrom(sess.Reverse()): {Out: EndsFrom(l.Reverse()), SessId: id, Flags: FlRev | FlEst},
	}
	// The new subsession's ingress flow belongs to another session by now
	// (a tuple reused): it must stay.
	foreign := TupleFrom(n.Reverse())
	for k, f := range ingress {
		if err := fx.d.AddFlow(k, f); err != nil {
			t.Fatal(err)
		}
	}
	for k, f := range egress {
		if err := fx.d.AddFlow(k, f); err != nil {
			t.Fatal(err)
		}
	}
	if err := fx.d.AddFlow(foreign, Flow{Out: EndsFrom(sess.Reverse()), SessId: other, Flags: FlIngress | FlDelta}); err != nil {
		t.Fatal(err)
	}
	for _, k := range []Tuple{TupleFrom(l), TupleFrom(sess), foreign} {
		if err := fx.d.PutDelta(k, Delta{Seq: 7}); err != nil {
			t.Fatal(err)
		}
	}
	tk := TPKey{SessId: id, Side: 1}
	if err := fx.d.PutTwoPath(tk, TPVal{State: TPActive, EgKey: TupleFrom(sess), InOld: TupleFrom(r.Reverse()),
		OldOut: TupleFrom(r), NewOut: TupleFrom(n)}); err != nil {
		t.Fatal(err)
	}
	for side := uint32(0); side < 3; side++ {
		k, v := TPKey{SessId: id, Side: side}, TPReq{Id: side + 1}
		if err := fx.d.objs.DyscoTpReq.Update(&k, &v, ebpf.UpdateAny); err != nil {
			t.Fatal(err)
		}
	}
	var st dyscoSynState
	if err := m["syns"].Put(id, &st); err != nil {
		t.Fatal(err)
	}
	m["tp_req"] = fx.d.objs.DyscoTpReq
	count := func(name string) int {
		if name == "flows" {
			return entries(t, m["flows4"]) + entries(t, m["flows6"])
		}
		return entries(t, m[name])
	}

	got, err := fx.d.CutSession(id, Tuple{})
	if err != nil || got != 4 {
		t.Fatalf("CutSession = %d, %v; want its 4 flows", got, err)
	}
	for k := range ingress {
		if _, ok := fx.d.Flow(k); ok {
			t.Errorf("ingress flow %s outlived the cut", k)
		}
	}
	for k, want := range egress {
		if f, ok := fx.d.Flow(k); !ok || f.Flags != want.Flags|FlDrop {
			t.Errorf("egress flow %s after the cut: %+v %v, want flags %#x", k, f, ok, want.Flags|FlDrop)
		}
	}
	if f, ok := fx.d.Flow(foreign); !ok || f.SessId != other || f.Flags&FlDrop != 0 {
		t.Errorf("another session's flow after the cut: %+v %v", f, ok)
	}
	if !fx.d.SessionExists(id) || count("deltas") != 2 {
		t.Fatalf("after the cut: session kept %v, deltas %d (want the egress flow's and the foreign one)", fx.d.SessionExists(id), count("deltas"))
	}

	got, err = fx.d.FreeSession(id, Tuple{})
	if err != nil || got != 2 {
		t.Fatalf("FreeSession = %d, %v; want the 2 egress flows left", got, err)
	}
	if fx.d.SessionExists(id) || !fx.d.SessionExists(other) {
		t.Errorf("after FreeSession: session %v, the other %v", fx.d.SessionExists(id), fx.d.SessionExists(other))
	}
	for name, want := range map[string]int{"flows": 1, "deltas": 1, "syns": 0} {
		if c := count(name); c != want {
			t.Errorf("%s: %d entries left, want %d", name, c, want)
		}
	}
	if _, ok := fx.d.TwoPath(tk); ok {
		t.Error("the two-path record outlived FreeSession")
	}
	if c := count("tp_req"); c != 0 {
		t.Errorf("%d kept requests outlived FreeSession", c)
	}
	if _, ok := fx.d.Flow(foreign); !ok {
		t.Error("FreeSession took another session's flow")
	}
	// A session that is gone: nothing to do, no error.
	if got, err := fx.d.FreeSession(id, Tuple{}); err != nil || got != 0 {
		t.Errorf("FreeSession of a freed session = %d, %v", got, err)
	}
}

// TestCtlConsts checks the Go mirrors of dysco_ctl's operations (consts.h)
// and of the sides of a kept lock and of a proxy's joined sessions
// (twopath.h).
func TestCtlConsts(t *testing.T) {
	var src []byte
	for _, f := range []string{"consts.h", "twopath.h"} {
		b, err := os.ReadFile("../../bpf/include/" + f)
		if err != nil {
			t.Fatal(err)
		}
		src = append(src, b...)
	}
	for name, want := range map[string]int{
		"CTL_FLAGS_SET": ctlFlagsSet, "CTL_FLAGS_CLEAR": ctlFlagsClear, "CTL_TP_START": ctlTPStart,
		"CTL_TP_STATE": ctlTPState, "CTL_TP_CLAMP": ctlTPClamp, "CTL_MARKS_MERGE": ctlMarksMerge,
		"CTL_FREE": ctlFree, "CTL_CUT": ctlCut, "CTL_FREE_RECONF": ctlFreeReconf, "CTL_ADD_SUB": ctlAddSub, "CTL_CLOSED": ctlClosed,
		"SIDE_LOCK": TPSideLock, "SIDE_SPLICE": TPSideSplice,
	} {
		m := regexp.MustCompile(`(?m)^#define ` + name + `\s+(\d+)`).FindSubmatch(src)
		if m == nil {
			t.Errorf("no #define %s", name)
			continue
		}
		if got, _ := strconv.Atoi(string(m[1])); got != want {
			t.Errorf("%s: C %d, Go %d", name, got, want)
		}
	}
}

// TestMergeMarks: a side's new ingress flow inherits its old one's marks
// where they are ahead, by at most a window (2^30), across the wrap of
// sequence numbers too. An old flow behind by more than 2^31, which modular
// comparison alone takes for ahead (an old path removed seconds after the
// switch, the session having carried over 2 GiB on the new one since), and
// one behind by a little, leave the new flow's marks alone.
func TestMergeMarks(t *testing.T) {
	fx := newFixture(t)
	for _, s := range []tpSide{tpRight4, tpLeft6} {
		for _, c := range []struct {
			name                 string
			oldSeq, oldAck       uint32
			newSeq, newAck       uint32
			wantSeq, wantAck     uint32
			newHasMarks, oldMark bool
		}{
			{"old ahead", 5000, 900, 4000, 800, 5000, 900, true, true},
			{"old ahead across the wrap", 100, 50, 0xffffff00, 0xfffffff0, 100, 50, true, true},
			{"old ahead by a window", 1000 + 1<<30, 900, 1000, 900, 1000 + 1<<30, 900, true, true},
			{"old behind", 4000, 800, 5000, 900, 5000, 900, true, true},
			{"old behind by more than 2^31", 1_478_828_461, 3_259_728_347, 3_942_226_509, 3_259_728_347, 3_942_226_509, 3_259_728_347, true, true},
			{"old behind by 2^30 + 1", 1000, 900, 1000 + 1<<30 + 1, 900, 1000 + 1<<30 + 1, 900, true, true},
			{"new without marks", 5000, 900, 0, 0, 5000, 900, false, true},
			{"old without marks", 0, 0, 4000, 800, 4000, 800, true, false},
		} {
			t.Run(s.sess.String()+"/"+c.name, func(t *testing.T) {
				fx.reset(t)
				old, nw := s.flows()[s.inOld()], s.flows()[s.inNew()]
				if c.oldMark {
					old.Flags |= FlMarks
					old.MkSeq, old.MkAck = c.oldSeq, c.oldAck
				}
				if c.newHasMarks {
					nw.Flags |= FlMarks
					nw.MkSeq, nw.MkAck = c.newSeq, c.newAck
				}
				if err := fx.d.AddFlow(s.inOld(), old); err != nil {
					t.Fatal(err)
				}
				if err := fx.d.AddFlow(s.inNew(), nw); err != nil {
					t.Fatal(err)
				}
				if err := fx.d.MergeMarks(s.inOld(), s.inNew()); err != nil {
					t.Fatal(err)
				}
				got := fx.flow(t, s.inNew())
				if got.MkSeq != c.wantSeq || got.MkAck != c.wantAck {
					t.Errorf("marks after the merge: seq %d ack %d, want %d %d", got.MkSeq, got.MkAck, c.wantSeq, c.wantAck)
				}
				if (got.Flags&FlMarks != 0) != (c.newHasMarks || c.oldMark) {
					t.Errorf("FlMarks %v after the merge", got.Flags&FlMarks != 0)
				}
			})
		}
	}
}

// TestAddSubsession: one run of the control program installs what the
// agent's six map operations did (control.addSub): the request, the side's
// record, the new ingress flow and its translation (an IPv4 flow in the
// IPv4 map), and the flags on the side's egress flow and old ingress flow;
// it refuses an ingress flow that exists, and a side without an egress flow.
func TestAddSubsession(t *testing.T) {
	fx := newFixture(t)
	for _, s := range []tpSide{tpRight4, tpLeft6} {
		t.Run(s.sess.String(), func(t *testing.T) {
			fx.reset(t)
			clearHash(t, fx.d.objs.DyscoTp)
			clearHash(t, fx.d.objs.DyscoTpReq)
			clearHash(t, fx.d.objs.DyscoDeltas)
			all := s.flows()
			eg, old, nw := all[s.egKey()], all[s.inOld()], all[s.inNew()]
			eg.Flags &^= FlTPOut
			old.Flags &^= FlTPOld
			eg.Packets, old.Packets = 7, 9 // written by packets meanwhile: kept
			for k, f := range map[Tuple]Flow{s.egKey(): eg, s.inOld(): old} {
				if err := fx.d.AddFlow(k, f); err != nil {
					t.Fatal(err)
				}
			}
			nw.Flags |= FlDelta
			delta := Delta{Seq: 0x1000, Tsval: -5, WsIn: 7, WsOut: 9, WsOn: 1}
			rec := s.record(TPIdle, protocol.TwoPath{})
			rec.Armed, rec.Nd = 1, Delta{Ack: -0x1000}
			req := TPReq{Id: 42, Role: TPReqRightAnchor}
			kept, err := fx.d.AddSubsession(s.key(), s.inNew(), nw, delta, rec, req)
			if err != nil || !kept {
				t.Fatalf("AddSubsession: kept %v, %v", kept, err)
			}
			if got := fx.twoPath(t, s.key()); got != rec {
				t.Errorf("record\n got %+v\nwant %+v", got, rec)
			}
			if got, ok := fx.d.TPReqOf(s.key()); !ok || got != req {
				t.Errorf("request %+v (%v), want %+v", got, ok, req)
			}
			var d Delta
			if err := fx.d.objs.DyscoDeltas.Lookup(s.inNew(), &d); err != nil || d != delta {
				t.Errorf("delta %+v (%v), want %+v", d, err, delta)
			}
			if got := fx.flow(t, s.inNew()); got != nw {
				t.Errorf("new ingress flow\n got %+v\nwant %+v", got, nw)
			}
			eg.Flags |= FlTPOut
			old.Flags |= FlTPOld
			if got := fx.flow(t, s.egKey()); got != eg {
				t.Errorf("egress flow\n got %+v\nwant %+v", got, eg)
			}
			if got := fx.flow(t, s.inOld()); got != old {
				t.Errorf("old ingress flow\n got %+v\nwant %+v", got, old)
			}
			if _, err := fx.d.AddSubsession(s.key(), s.inNew(), nw, delta, rec, req); err == nil || !strings.Contains(err.Error(), "exists") {
				t.Errorf("a second AddSubsession: %v, want: the flow exists", err)
			}
			fx.d.DeleteFlow(s.inNew())
			fx.d.DeleteFlow(s.egKey())
			if _, err := fx.d.AddSubsession(s.key(), s.inNew(), nw, delta, rec, req); !errors.Is(err, syscall.ENOENT) {
				t.Errorf("AddSubsession without the egress flow: %v, want ENOENT", err)
			}
		})
	}
}

// TestFreeAndCutSessionOnward: behind a NAT the session leaves a
// middlebox host with the middlebox's output tuple, which keys its egress
// flow of the SYN's direction (and the right subsession's ingress flow
// rewrites to the reverse of it). Given that tuple, CutSession and
// FreeSession find the right side's two flows too; without it they find
// the left side's only, as before.
func TestFreeAndCutSessionOnward(t *testing.T) {
	fx := newFixture(t)
	fx.reset(t)
	sess := tup(ap("10.1.0.1:40000"), ap("10.9.0.5:80"))
	nat := tup(ap("10.1.0.30:61000"), ap("10.9.0.5:80")) // MASQUERADE's output
	l := tup(ap("10.1.0.20:41001"), ap("10.1.0.30:41002"))
	r := tup(ap("10.1.0.30:41003"), ap("10.1.0.40:41004"))
	install := func() uint32 {
		t.Helper()
		id, err := fx.d.InsertSession(Session{Tuple: EndsFrom(sess), Role: RoleMiddle, State: StEst})
		if err != nil {
			t.Fatal(err)
		}
		for k, f := range map[Tuple]Flow{
			TupleFrom(l):              {Out: EndsFrom(sess), SessId: id, Flags: FlIngress | FlEst},
			TupleFrom(sess.Reverse()): {Out: EndsFrom(l.Reverse()), SessId: id, Flags: FlRev | FlEst},
			TupleFrom(nat):            {Out: EndsFrom(r), SessId: id, Flags: FlEst},
			TupleFrom(r.Reverse()):    {Out: EndsFrom(nat.Reverse()), SessId: id, Flags: FlIngress | FlRev | FlEst},
		} {
			if err := fx.d.AddFlow(k, f); err != nil {
				t.Fatal(err)
			}
		}
		return id
	}
	flows := func() int { return entries(t, fx.d.objs.DyscoFlows4) + entries(t, fx.d.objs.DyscoFlows6) }

	id := install()
	if got, err := fx.d.FreeSession(id, Tuple{}); err != nil || got != 2 {
		t.Fatalf("FreeSession without the onward tuple = %d, %v; want the left side's 2 flows", got, err)
	}
	for _, k := range []Tuple{TupleFrom(nat), TupleFrom(r.Reverse())} {
		fx.d.DeleteFlow(k)
	}
	if n := flows(); n != 0 {
		t.Fatalf("%d flows left before the second round", n)
	}

	id = install()
	got, err := fx.d.CutSession(id, TupleFrom(nat))
	if err != nil || got != 4 {
		t.Fatalf("CutSession = %d, %v; want 4 flows", got, err)
	}
	if f, ok := fx.d.Flow(TupleFrom(nat)); !ok || f.Flags&FlDrop == 0 {
		t.Errorf("the onward egress flow after the cut: %+v %v, want FlDrop", f, ok)
	}
	if _, ok := fx.d.Flow(TupleFrom(r.Reverse())); ok {
		t.Error("the right subsession's ingress flow outlived the cut")
	}
	if got, err := fx.d.FreeSession(id, TupleFrom(nat)); err != nil || got != 2 {
		t.Fatalf("FreeSession after the cut = %d, %v; want the 2 egress flows", got, err)
	}
	if n := flows(); n != 0 || fx.d.SessionExists(id) {
		t.Errorf("after FreeSession: %d flows left, session kept %v", n, fx.d.SessionExists(id))
	}
}

// TestMarkClosed: a middlebox that joined a new path records FINs it did
// not see (the anchors' closed notice). Only the FIN bits are set, other
// state stays, the idle time restarts, and a session that is gone is an
// error.
func TestMarkClosed(t *testing.T) {
	fx := newFixture(t)
	s := Session{State: StSYN | StSYNACK | StEst | StSetupDone, Role: RoleMiddle, CreatedMs: Now() - 60000, LastMs: Now() - 60000}
	id, err := fx.d.InsertSession(s)
	if err != nil {
		t.Fatal(err)
	}
	if err := fx.d.MarkClosed(id, StFINFwd|StRST); err != nil {
		t.Fatal(err)
	}
	got, _ := fx.d.Session(id)
	if got.State != s.State|StFINFwd {
		t.Fatalf("state %#x, want %#x (only the FIN bit set)", got.State, s.State|StFINFwd)
	}
	if Age(Now(), got.LastMs) > 5*time.Second {
		t.Fatalf("the idle time did not restart: %s", Age(Now(), got.LastMs))
	}
	if err := fx.d.MarkClosed(id, StFINRev); err != nil {
		t.Fatal(err)
	}
	if got, _ := fx.d.Session(id); got.State != s.State|StFINFwd|StFINRev {
		t.Fatalf("state %#x after the second notice", got.State)
	}
	fx.d.DeleteSession(id)
	if err := fx.d.MarkClosed(id, StFINFwd); err == nil {
		t.Fatal("MarkClosed of a session that is gone succeeded")
	}
}
