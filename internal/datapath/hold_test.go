package datapath

// Tests of packet holding (bpf/include/hold.h, hold.go): the constants
// shared with C, the hold decisions of the real egress program on plain and
// two-path flows (BPF_PROG_TEST_RUN), the record on the ring buffer, a full
// ring, the segmentation and checksums of re-injected frames, and a real
// hold and re-injection through TCX on a veth between two namespaces.

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"reflect"
	"regexp"
	"strconv"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/btf"
	"github.com/gopacket/gopacket"
	"github.com/gopacket/gopacket/layers"

	"github.com/dysco/dysco/internal/protocol"
)

// TestHoldConsts checks the Go mirrors of consts.h and the layout of
// struct hold_hdr that HoldReader parses.
func TestHoldConsts(t *testing.T) {
	src, err := os.ReadFile("../../bpf/include/consts.h")
	if err != nil {
		t.Fatal(err)
	}
	for name, want := range map[string]uint64{
		"DYSCO_REINJECT_MARK": uint64(ReinjectMark),
		"FL_HOLD_DATA":        uint64(FlagHoldData),
		"FL_HOLD_ALL":         uint64(FlagHoldAll),
		"HOLD_F_V6":           holdFlagV6,
		"HOLD_F_SPLIT":        holdFlagSplit,
		"HOLD_F_RIGHT":        holdFlagRight,
	} {
		m := regexp.MustCompile(`(?m)^#define ` + name + `\s+(\(1 << (\d+)\)|0x[0-9a-fA-F]+)`).FindSubmatch(src)
		if m == nil {
			t.Errorf("no #define %s in consts.h", name)
			continue
		}
		var got uint64
		if m[2] != nil {
			sh, _ := strconv.Atoi(string(m[2]))
			got = 1 << sh
		} else {
			got, _ = strconv.ParseUint(string(m[1]), 0, 64)
		}
		if got != want {
			t.Errorf("%s: consts.h %#x, Go %#x", name, got, want)
		}
	}
	spec, err := loadDysco()
	if err != nil {
		t.Fatal(err)
	}
	var hdr *btf.Struct
	if err := spec.Types.TypeByName("hold_hdr", &hdr); err != nil {
		t.Fatal(err)
	}
	if hdr.Size != holdHdrLen {
		t.Errorf("struct hold_hdr is %d bytes, HoldReader reads %d", hdr.Size, holdHdrLen)
	}
	offs := map[string]uint32{"sess_id": 0, "ifindex": 4, "len": 8, "gso_size": 12, "flags": 14}
	for _, m := range hdr.Members {
		if off, ok := offs[m.Name]; !ok || m.Offset.Bytes() != off {
			t.Errorf("hold_hdr.%s at byte %d, HoldReader reads it at %d (known: %v)", m.Name, m.Offset.Bytes(), off, ok)
		}
	}
}

// holdCtx is struct __sk_buff up to gso_size: the fields between cb and
// tstamp, and sk, must stay zero for BPF_PROG_TEST_RUN.
type holdCtx struct {
	skbCtx
	_       [152 - 68]byte
	Tstamp  uint64
	WireLen uint32
	GSOSegs uint32
	_       uint64 // sk
	GSOSize uint32
	_       uint32
}

// runCtx is fixture.run with a context of the caller's.
func (fx *fixture) runCtx(tb testing.TB, ctx any, frame []byte) (uint32, []byte) {
	tb.Helper()
	opts := &ebpf.RunOptions{Data: frame, DataOut: make([]byte, len(frame)+512), Context: ctx}
	var ret uint32
	var err error
	fx.net.do(func() { ret, err = fx.egress.Run(opts) })
	if err != nil {
		tb.Fatalf("BPF_PROG_TEST_RUN: %v", err)
	}
	return ret, opts.DataOut
}

func (fx *fixture) holdReader(tb testing.TB) *HoldReader {
	tb.Helper()
	r, err := fx.d.HoldReader()
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { r.Close() })
	return r
}

// nextHeld reads the next held packet, failing after a second.
func nextHeld(tb testing.TB, r *HoldReader) HeldPacket {
	tb.Helper()
	r.SetDeadline(time.Now().Add(time.Second))
	p, err := r.Read()
	if err != nil {
		tb.Fatalf("no held packet: %v", err)
	}
	return p
}

// expectNoHeld checks that nothing is on the ring.
func expectNoHeld(tb testing.TB, r *HoldReader) {
	tb.Helper()
	r.SetDeadline(time.Now().Add(20 * time.Millisecond))
	p, err := r.Read()
	if err == nil {
		tb.Fatalf("unexpected held packet of session %d: %x", p.Session, p.Frame)
	}
	if !errors.Is(err, os.ErrDeadlineExceeded) {
		tb.Fatal(err)
	}
}

func drainHeld(r *HoldReader) int {
	n := 0
	for {
		r.SetDeadline(time.Now().Add(20 * time.Millisecond))
		if _, err := r.Read(); err != nil {
			return n
		}
		n++
	}
}

// TestHold runs the hold decisions through the real egress program on an
// anchor's egress flow, without and with a two-path record (before and
// after StartTwoPath would install one), IPv4 and IPv6.
func TestHold(t *testing.T) {
	fx := newFixture(t)
	r := fx.holdReader(t)
	for _, c := range []struct {
		name string
		s    tpSide
		tp   bool
	}{
		{"v4 plain", tpRight4, false}, {"v6 plain", tpLeft6, false},
		{"v4 two-path", tpRight4, true}, {"v6 two-path", tpLeft6, true},
	} {
		t.Run(c.name, func(t *testing.T) {
			s := c.s
			drainHeld(r)
			if c.tp {
				s.install(t, fx, s.record(TPIdle, protocol.TwoPath{}), nil)
			} else {
				fx.reset(t)
				clearHash(t, fx.d.objs.DyscoTp)
				f := Flow{Out: EndsFrom(s.oldSub), SessId: s.id, Flags: FlEst | revFlag(s.dirOut())}
				if err := fx.d.AddFlow(s.egKey(), f); err != nil {
					t.Fatal(err)
				}
			}
			ctx := skbCtx{Ifindex: uint32(fx.net.ifindex)}
			marked := ctx
			marked.Mark = ReinjectMark
			// pass: the packet leaves translated on the old path.
			pass := func(p protocol.Packet, ctx skbCtx) {
				t.Helper()
				before := fx.stats(t)
				verdict, out := fx.runCtx(t, ctx, tpPkt(t, s.sess, p).frame(t))
				if verdict != tcActOK {
					t.Fatalf("%+v: verdict %d, want OK", p, verdict)
				}
				expectFrame(t, out, tpPkt(t, s.oldSub, p))
				expectNoHeld(t, r)
				fx.counterMoves(t, before, map[string]uint64{"hold_pkts": 0, "hold_drop": 0, "rewrite_out": 1})
			}
			// held: the packet is swallowed, copied whole to the ring, and
			// the flow's marks and counters stay as they were.
			held := func(p protocol.Packet) {
				t.Helper()
				before, fBefore := fx.stats(t), fx.flow(t, s.egKey())
				frame := tpPkt(t, s.sess, p).frame(t)
				verdict, out := fx.runCtx(t, ctx, frame)
				if verdict != tcActRedirect {
					t.Fatalf("%+v: verdict %d, want %d (redirect to no device: swallowed)", p, verdict, tcActRedirect)
				}
				if !bytes.Equal(out[:len(frame)], frame) {
					t.Errorf("held packet changed:\n got %x\nwant %x", out[:len(frame)], frame)
				}
				h := nextHeld(t, r)
				want := HeldPacket{Session: s.id, Ifindex: fx.net.ifindex, IPv6: s.sess.Src.Is6(), Frame: frame}
				if fmt.Sprint(h) != fmt.Sprint(want) {
					t.Errorf("held record\n got %+v\nwant %+v", h, want)
				}
				fx.counterMoves(t, before, map[string]uint64{"hold_pkts": 1, "hold_bytes": uint64(len(frame)),
					"hold_drop": 0, "rewrite_out": 0, "tp_old": 0, "tp_new": 0, "fin": 0})
				fAfter := fx.flow(t, s.egKey())
				if fAfter.MkSeq != fBefore.MkSeq || fAfter.MkAck != fBefore.MkAck || fAfter.Packets != fBefore.Packets ||
					fAfter.Bytes != fBefore.Bytes {
					t.Errorf("holding changed the flow: marks %d/%d -> %d/%d, packets %d -> %d",
						fBefore.MkSeq, fBefore.MkAck, fAfter.MkSeq, fAfter.MkAck, fBefore.Packets, fAfter.Packets)
				}
			}
			ack := uint8(protocol.TCPAck)
			pass(protocol.Packet{Seq: 1000, Len: 100, Ack: 5000, Flags: ack}, ctx) // the mark: 1100
			if err := fx.d.SetFlowFlags(s.egKey(), FlagHoldData, 0); err != nil {
				t.Fatal(err)
			}
			held(protocol.Packet{Seq: 1100, Len: 100, Ack: 5000, Flags: ack})
			held(protocol.Packet{Seq: 1050, Len: 100, Ack: 5000, Flags: ack})      // partly new
			pass(protocol.Packet{Seq: 1000, Len: 100, Ack: 5000, Flags: ack}, ctx) // a retransmission
			pass(protocol.Packet{Seq: 1100, Ack: 5100, Flags: ack}, ctx)           // a pure ACK
			held(protocol.Packet{Seq: 1100, Ack: 5100, Flags: ack | protocol.TCPFin})
			// Re-injected: never held, translated, and the mark moves.
			pass(protocol.Packet{Seq: 1100, Len: 100, Ack: 5100, Flags: ack}, marked)
			if m := fx.flow(t, s.egKey()).MkSeq; m != 1200 {
				t.Errorf("mark after the re-injected packet %d, want 1200", m)
			}
			if err := fx.d.SetFlowFlags(s.egKey(), FlagHoldAll, FlagHoldData); err != nil {
				t.Fatal(err)
			}
			held(protocol.Packet{Seq: 1200, Ack: 5200, Flags: ack}) // a pure ACK too
			held(protocol.Packet{Seq: 1000, Len: 100, Ack: 5200, Flags: ack})
			if err := fx.d.SetFlowFlags(s.egKey(), 0, FlagHoldAll); err != nil {
				t.Fatal(err)
			}
			pass(protocol.Packet{Seq: 1200, Len: 10, Ack: 5200, Flags: ack}, ctx)
			if !c.tp {
				return
			}
			// Held during the migration, re-injected after the switch: the
			// copy takes the path the session uses then.
			if err := fx.d.SetFlowFlags(s.egKey(), FlagHoldData, 0); err != nil {
				t.Fatal(err)
			}
			p := protocol.Packet{Seq: 1210, Len: 10, Ack: 5200, Flags: ack}
			held(p)
			if err := fx.d.SetTwoPathState(s.key(), TPNew); err != nil {
				t.Fatal(err)
			}
			verdict, out := fx.runCtx(t, marked, tpPkt(t, s.sess, p).frame(t))
			if verdict != tcActOK {
				t.Fatalf("re-injected after the switch: verdict %d", verdict)
			}
			expectFrame(t, out, tpPkt(t, s.newSub, p))
		})
	}
}

// TestHoldGSO: a GSO packet is held whole with its segment size, and the
// record segments into the packets TCP meant to send.
func TestHoldGSO(t *testing.T) {
	fx := newFixture(t)
	r := fx.holdReader(t)
	s := tpRight4
	fx.reset(t)
	f := Flow{Out: EndsFrom(s.oldSub), SessId: s.id, Flags: FlEst | FlagHoldData | revFlag(s.dirOut())}
	if err := fx.d.AddFlow(s.egKey(), f); err != nil {
		t.Fatal(err)
	}
	p := protocol.Packet{Seq: 7000, Len: 3000, Ack: 1, Flags: protocol.TCPAck}
	frame := tpPkt(t, s.sess, p).frame(t)
	ctx := holdCtx{skbCtx: skbCtx{Ifindex: uint32(fx.net.ifindex)}, GSOSegs: 3, GSOSize: 1000}
	if verdict, _ := fx.runCtx(t, ctx, frame); verdict != tcActRedirect {
		t.Fatalf("verdict %d, want held", verdict)
	}
	h := nextHeld(t, r)
	if h.GSOSize != 1000 || !bytes.Equal(h.Frame, frame) {
		t.Fatalf("held GSO packet: gso_size %d, %d bytes (want 1000, %d)", h.GSOSize, len(h.Frame), len(frame))
	}
	segs, err := segment(h.Frame, int(h.GSOSize), 1500)
	if err != nil {
		t.Fatal(err)
	}
	if len(segs) != 3 {
		t.Fatalf("%d segments, want 3", len(segs))
	}
	for i, sg := range segs {
		q := protocol.Packet{Seq: 7000 + uint32(i)*1000, Len: 1000, Ack: 1, Flags: protocol.TCPAck}
		want := tpPkt(t, s.sess, q)
		want.payload = tpPkt(t, s.sess, p).payload[i*1000 : (i+1)*1000]
		checkFrame(t, sg)
		gv, _ := decode(t, sg)
		wv, _ := decode(t, want.frame(t))
		if gv.ID != wv.ID+uint16(i) {
			t.Errorf("segment %d: IPv4 id %#x, want %#x", i, gv.ID, wv.ID+uint16(i))
		}
		gv.ID = wv.ID
		if !reflect.DeepEqual(gv, wv) {
			t.Errorf("segment %d:\n got %+v\nwant %+v", i, gv, wv)
		}
	}
}

// TestHoldRingFull: when the ring is full, a packet to hold is dropped and
// counted (the sender's TCP sends it again); what was held stays, in order.
func TestHoldRingFull(t *testing.T) {
	fx := newFixture(t)
	r := fx.holdReader(t)
	s := tpRight4
	fx.reset(t)
	f := Flow{Out: EndsFrom(s.oldSub), SessId: s.id, Flags: FlEst | FlagHoldAll | revFlag(s.dirOut())}
	if err := fx.d.AddFlow(s.egKey(), f); err != nil {
		t.Fatal(err)
	}
	before := fx.stats(t)
	ctx := skbCtx{Ifindex: uint32(fx.net.ifindex)}
	n := 0
	for ; n < 4000; n++ {
		p := protocol.Packet{Seq: uint32(n) * 3000, Len: 3000, Ack: 1, Flags: protocol.TCPAck}
		verdict, _ := fx.runCtx(t, ctx, tpPkt(t, s.sess, p).frame(t))
		if verdict == tcActShot {
			break
		}
		if verdict != tcActRedirect {
			t.Fatalf("packet %d: verdict %d", n, verdict)
		}
	}
	if n == 4000 || n < (4<<20)/3100 {
		t.Fatalf("held %d packets of 3 KB in a 4 MiB ring before a drop", n)
	}
	fx.counterMoves(t, before, map[string]uint64{"hold_pkts": uint64(n), "hold_drop": 1})
	for i := 0; i < n; i++ {
		h := nextHeld(t, r)
		if seq := binary.BigEndian.Uint32(h.Frame[14+20+4:]); seq != uint32(i)*3000 {
			t.Fatalf("held packet %d has seq %d, want %d", i, seq, i*3000)
		}
	}
	expectNoHeld(t, r)
}

// gsoFrame is a TCP frame with payload bytes and flags CWR|PSH|FIN|ACK
// (cutSeedFrame's), its checksum computed in full.
func gsoFrame(t *testing.T, v6 bool, payload int) []byte {
	t.Helper()
	f := cutSeedFrame(t, v6, payload, "APF", false)
	ipHdr := 20
	if v6 {
		ipHdr = 40
	}
	// The checksum again, computed here independently of segment().
	ip := f[14:]
	seg := ip[ipHdr:]
	pseudo := sum16(ip[12:20], 0)
	if v6 {
		pseudo = sum16(ip[8:40], 0)
	}
	seg[16], seg[17] = 0, 0
	binary.BigEndian.PutUint16(seg[16:], ^fold(sum16(seg, pseudo+6+uint32(len(seg)))))
	checkFrame(t, f)
	return f
}

func inTCPSeq(t *testing.T, frame []byte) uint32 {
	t.Helper()
	_, tcp := decode(t, frame)
	return tcp.Seq
}

// TestSegment: a GSO frame splits into valid segments with the right
// sequence numbers, flags and lengths; any frame gets a full checksum.
func TestSegment(t *testing.T) {
	for _, v6 := range []bool{false, true} {
		t.Run(fmt.Sprintf("v6=%v", v6), func(t *testing.T) {
			const mss = 1000
			in := gsoFrame(t, v6, 3*mss)
			// A GSO packet's TCP checksum is partial (pseudo-header only).
			ipHdr := 20
			if v6 {
				ipHdr = 40
			}
			in[14+ipHdr+16], in[14+ipHdr+17] = 0x12, 0x34
			for _, c := range []struct {
				gso, mtu int
				sizes    []int
			}{{mss, 1500, []int{mss, mss, mss}}, {0, 1000 + ipHdr + 32, []int{mss, mss, mss}},
				{0, 1500, []int{1500 - ipHdr - 32, 1500 - ipHdr - 32, 3*mss - 2*(1500-ipHdr-32)}},
				// Segments of gso_size (its sender's MSS) even where the
				// packet would fit the MTU whole.
				{1200, 9000, []int{1200, 1200, 600}}} {
				segs, err := segment(in, c.gso, c.mtu)
				if err != nil {
					t.Fatal(err)
				}
				if len(segs) != len(c.sizes) {
					t.Fatalf("gso %d mtu %d: %d segments, want %d", c.gso, c.mtu, len(segs), len(c.sizes))
				}
				off := 0
				_, inTCP := decode(t, in)
				for i, sg := range segs {
					checkFrame(t, sg)
					if len(sg)-14 > c.mtu {
						t.Errorf("segment %d: %d bytes of IP, MTU %d", i, len(sg)-14, c.mtu)
					}
					v, tcp := decode(t, sg)
					if want := inTCP.Seq + uint32(off); tcp.Seq != want {
						t.Errorf("segment %d: seq %#x, want %#x", i, tcp.Seq, want)
					}
					if len(tcp.Payload) != c.sizes[i] || !bytes.Equal(tcp.Payload, inTCP.Payload[off:off+c.sizes[i]]) {
						t.Errorf("segment %d: payload of %d bytes, want bytes %d..%d", i, len(tcp.Payload), off, off+c.sizes[i])
					}
					last, first := i == len(segs)-1, i == 0
					if tcp.FIN != last || tcp.PSH != last || tcp.CWR != first || !tcp.ACK {
						t.Errorf("segment %d: flags %s", i, v.Flags)
					}
					if len(tcp.Options) != 3 || tcp.Ack != 99 || tcp.Window != 500 {
						t.Errorf("segment %d: header not copied: %+v", i, v)
					}
					if !v6 && v.ID != 0x4242+uint16(i) {
						t.Errorf("segment %d: IPv4 id %#x", i, v.ID)
					}
					pk := gopacket.NewPacket(sg, layers.LayerTypeEthernet, gopacket.Default)
					if l, ok := pk.TransportLayer().(*layers.TCP); !ok || l == nil {
						t.Errorf("segment %d: gopacket finds no TCP", i)
					}
					off += c.sizes[i]
				}
			}
			// A SYN or RST is never cut, whatever its size.
			for _, fl := range []byte{0x02, 0x04} {
				syn := append([]byte(nil), in...)
				syn[14+ipHdr+13] = fl
				if segs, err := segment(syn, 100, 1500); err != nil || len(segs) != 1 {
					t.Errorf("flags %#x: %d segments (%v), want the packet whole", fl, len(segs), err)
				}
				if _, err := SplitFrame(syn, inTCPSeq(t, in)+10, 100); err == nil {
					t.Errorf("flags %#x: split", fl)
				}
			}
			// A plain frame with a partial checksum: one frame, whole checksum.
			plain := gsoFrame(t, v6, 100)
			good := append([]byte(nil), plain...)
			plain[14+ipHdr+16], plain[14+ipHdr+17] = 0xab, 0xcd
			segs, err := segment(plain, 0, 1500)
			if err != nil {
				t.Fatal(err)
			}
			if len(segs) != 1 {
				t.Fatalf("%d frames for a plain packet", len(segs))
			}
			checkFrame(t, segs[0])
			if !bytes.Equal(segs[0], good) {
				t.Errorf("plain frame\n got %x\nwant %x", segs[0], good)
			}
		})
	}
	// What cannot be re-injected says why.
	v6 := gsoFrame(t, true, 10)
	v6[14+6] = 0 // hop-by-hop options header
	arp := gsoFrame(t, false, 10)
	binary.BigEndian.PutUint16(arp[12:], 0x0806)
	udp := gsoFrame(t, false, 10)
	udp[14+9] = 17
	for name, f := range map[string][]byte{"extension header": v6, "ARP": arp, "UDP": udp, "short": arp[:10]} {
		if _, err := segment(f, 0, 1500); err == nil {
			t.Errorf("%s: no error", name)
		} else {
			t.Logf("%s: %v", name, err)
		}
	}
}
