package datapath

// Fixture tests of the two-path phase of a reconfiguration (paper §3.5) in
// the datapath: the shared vectors of internal/protocol (Decide, Observe),
// the marks (protocol.Marks), the cut-off (protocol.CutOff) taken by
// dysco_ctl or by the first packet on an armed new subsession, the end of
// the phase (everything on the new path with its delta), the window clamp,
// progress events, orphan drops and flag changes on live flows.

import (
	"encoding/json"
	"os"
	"testing"

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
