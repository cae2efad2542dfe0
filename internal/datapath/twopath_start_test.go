package datapath

// Tests of the start and end of a side's two-path phase, its window clamp
// and its progress events.

import (
	"errors"
	"fmt"
	"os"
	"syscall"
	"testing"
	"time"

	"github.com/dysco/dysco/internal/protocol"
	"github.com/gopacket/gopacket/layers"
)

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
