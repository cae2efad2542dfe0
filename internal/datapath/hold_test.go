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
	"net"
	"os"
	"reflect"
	"regexp"
	"runtime"
	"strconv"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/btf"
	"github.com/gopacket/gopacket"
	"github.com/gopacket/gopacket/layers"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/dysco/dysco/internal/protocol"
	"github.com/dysco/dysco/internal/testutil"
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

// holdNS is a named network namespace (dhold-*) with a goroutine locked to
// a thread inside it.
type holdNS struct {
	name string
	ns   netns.NsHandle
	work chan func()
}

func newHoldNS(t *testing.T, suffix string) *holdNS {
	t.Helper()
	n := &holdNS{name: fmt.Sprintf("dhold-%d-%s", os.Getpid(), suffix), work: make(chan func())}
	ready := make(chan error)
	go func() {
		runtime.LockOSThread() // never unlocked: the thread leaves with the namespace
		ns, err := netns.NewNamed(n.name)
		if err != nil {
			ready <- err
			return
		}
		n.ns = ns
		ready <- nil
		for f := range n.work {
			f()
		}
	}()
	if err := <-ready; err != nil {
		t.Fatalf("namespace %s: %v", n.name, err)
	}
	t.Cleanup(func() {
		close(n.work)
		n.ns.Close()
		if err := netns.DeleteNamed(n.name); err != nil {
			t.Errorf("remove namespace %s: %v", n.name, err)
		}
	})
	return n
}

func (n *holdNS) do(fn func()) {
	done := make(chan struct{})
	n.work <- func() { defer close(done); fn() }
	<-done
}

// TestReinject holds a packet sent by a raw socket through the datapath
// attached with TCX, checks that the sender was told it was sent and that
// nothing reached the wire, then re-injects it (and a GSO frame of the same
// session) with a Reinjector: the peer receives them translated, with whole
// checksums, while the flow still holds new data, which proves the
// re-injected packets carried ReinjectMark.
func TestReinject(t *testing.T) {
	testutil.RequireRoot(t)
	host, peer := newHoldNS(t, "h"), newHoldNS(t, "p")
	hh, err := netlink.NewHandleAt(host.ns)
	if err != nil {
		t.Fatal(err)
	}
	defer hh.Close()
	hp, err := netlink.NewHandleAt(peer.ns)
	if err != nil {
		t.Fatal(err)
	}
	defer hp.Close()
	la := netlink.NewLinkAttrs()
	la.Name = "dh0"
	if err := hh.LinkAdd(&netlink.Veth{LinkAttrs: la, PeerName: "dp0", PeerNamespace: netlink.NsFd(peer.ns)}); err != nil {
		t.Fatal(err)
	}
	dh0, err := hh.LinkByName("dh0")
	if err != nil {
		t.Fatal(err)
	}
	dp0, err := hp.LinkByName("dp0")
	if err != nil {
		t.Fatal(err)
	}
	for _, x := range []struct {
		h    *netlink.Handle
		l    netlink.Link
		addr string
	}{{hh, dh0, "10.78.0.1/24"}, {hp, dp0, "10.78.0.2/24"}} {
		a, _ := netlink.ParseAddr(x.addr)
		if err := x.h.AddrAdd(x.l, a); err != nil {
			t.Fatal(err)
		}
		if err := x.h.LinkSetUp(x.l); err != nil {
			t.Fatal(err)
		}
	}
	if err := hh.NeighAdd(&netlink.Neigh{LinkIndex: dh0.Attrs().Index, State: netlink.NUD_PERMANENT,
		IP: net.ParseIP("10.78.0.2"), HardwareAddr: dp0.Attrs().HardwareAddr}); err != nil {
		t.Fatal(err)
	}
	sess := tup(ap("10.78.0.1:40000"), ap("10.78.0.2:80"))
	sub := tup(ap("10.78.0.1:41001"), ap("10.78.0.2:41002"))
	var d *Datapath
	host.do(func() {
		if d, err = Load(Config{PinDir: testPinDir(t)}); err != nil {
			return
		}
		err = d.AttachInterface("dh0")
	})
	if d != nil {
		t.Cleanup(func() { host.do(func() { d.Close() }) })
	}
	if err != nil {
		t.Fatal(err)
	}
	if d.Attach != "tcx" {
		t.Fatalf("attached with %s, want tcx on this kernel", d.Attach)
	}
	f := Flow{Out: EndsFrom(sub), SessId: 0x77, Flags: FlEst | FlagHoldData | FlMarks, MkSeq: 1000}
	if err := d.AddFlow(TupleFrom(sess), f); err != nil {
		t.Fatal(err)
	}
	r, err := d.HoldReader()
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()

	// The peer captures TCP frames on dp0.
	var capFd int
	peer.do(func() {
		capFd, err = unix.Socket(unix.AF_PACKET, unix.SOCK_RAW, int(htons(unix.ETH_P_ALL)))
		if err == nil {
			err = unix.Bind(capFd, &unix.SockaddrLinklayer{Protocol: htons(unix.ETH_P_ALL), Ifindex: dp0.Attrs().Index})
		}
	})
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(capFd)
	_ = unix.SetsockoptTimeval(capFd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &unix.Timeval{Usec: 200000})
	captured := func(want int) [][]byte {
		t.Helper()
		var got [][]byte
		buf := make([]byte, 70000)
		deadline := time.Now().Add(2 * time.Second)
		for len(got) < want+1 && time.Now().Before(deadline) {
			n, from, err := unix.Recvfrom(capFd, buf, 0)
			if err != nil {
				if len(got) >= want {
					break
				}
				continue
			}
			if ll, ok := from.(*unix.SockaddrLinklayer); ok && ll.Pkttype == unix.PACKET_OUTGOING {
				continue // the peer's own answers (RSTs)
			}
			if n > 14+20 && binary.BigEndian.Uint16(buf[12:]) == etherIPv4 && buf[14+9] == ipProtoTCP {
				got = append(got, append([]byte(nil), buf[:n]...))
			}
		}
		return got
	}

	// A data packet beyond the mark, sent by a raw socket: held.
	payload := bytes.Repeat([]byte("held data "), 10)
	p := pkt{seq: 1000, ack: 7, flags: "AP", win: 100, payload: payload}.with(sess)
	frame := p.frame(t)
	host.do(func() {
		var fd int
		fd, err = unix.Socket(unix.AF_INET, unix.SOCK_RAW, unix.IPPROTO_RAW)
		if err != nil {
			return
		}
		defer unix.Close(fd)
		// With IP_RECVERR a dropped packet fails the send (ENOBUFS).
		_ = unix.SetsockoptInt(fd, unix.IPPROTO_IP, unix.IP_RECVERR, 1)
		err = unix.Sendto(fd, frame[14:], 0, &unix.SockaddrInet4{Addr: [4]byte{10, 78, 0, 2}})
	})
	if err != nil {
		t.Fatalf("send of the packet to hold: %v (the sender must be told it was sent)", err)
	}
	h := nextHeld(t, r)
	if h.Session != 0x77 || h.Ifindex != dh0.Attrs().Index || h.IPv6 || !bytes.Equal(h.Frame[14:], frame[14:]) {
		t.Fatalf("held %+v", h)
	}
	if got := captured(0); len(got) != 0 {
		t.Fatalf("a held packet reached the peer: %x", got[0])
	}

	// Re-inject it, and a 3-segment GSO frame of the same session.
	gp := pkt{seq: 1100, ack: 7, flags: "AP", win: 100, payload: bytes.Repeat([]byte{0x5a}, 3000)}.with(sess)
	gso := HeldPacket{Session: 0x77, Ifindex: h.Ifindex, GSOSize: 1000, Frame: gp.frame(t)}
	copy(gso.Frame, h.Frame[:14])
	var rj *Reinjector
	host.do(func() {
		rj = NewReinjector()
		if err = rj.Send(h); err == nil {
			err = rj.Send(gso)
		}
	})
	defer rj.Close()
	if err != nil {
		t.Fatal(err)
	}
	got := captured(4)
	if len(got) != 4 {
		t.Fatalf("peer received %d TCP frames, want 4", len(got))
	}
	want := []pkt{p.with(sub)}
	for i := 0; i < 3; i++ {
		q := gp.with(sub)
		q.seq, q.payload = 1100+uint32(i)*1000, gp.payload[i*1000:(i+1)*1000]
		if i < 2 {
			q.flags = "A"
		}
		want = append(want, q)
	}
	for i, g := range got {
		gv, _ := decode(t, g)
		wv, _ := decode(t, want[i].frame(t))
		checkFrame(t, g)
		if gv.Src != wv.Src || gv.Dst != wv.Dst || gv.Seq != wv.Seq || gv.Flags != wv.Flags || gv.Payload != wv.Payload {
			t.Errorf("frame %d at the peer:\n got %+v\nwant %+v", i, gv, wv)
		}
	}
	st, err := d.Stats()
	if err != nil {
		t.Fatal(err)
	}
	if st["hold_pkts"] != 1 || st["hold_drop"] != 0 || st["rewrite_out"] != 4 {
		t.Errorf("counters: hold_pkts %d hold_drop %d rewrite_out %d, want 1 0 4", st["hold_pkts"], st["hold_drop"], st["rewrite_out"])
	}
	if fl, _ := d.Flow(TupleFrom(sess)); fl.MkSeq != 4100 {
		t.Errorf("mark after re-injection %d, want 4100", fl.MkSeq)
	}
}

// TestSplitFrame: a frame straddling a cut-off is cut into the bytes before
// it and the rest (with the FIN), each a valid frame; a frame that does not
// straddle is refused.
// TestLeaseStamp: the split reader's lease in the datapath's stamps
// (32 bits of milliseconds), 0 for none, never 0 for a lease.
func TestLeaseStamp(t *testing.T) {
	ms := time.Millisecond
	for _, c := range []struct {
		now, lease time.Duration
		want       uint32
	}{
		{1000 * ms, 0, 0},
		{1000 * ms, -time.Second, 0},
		{1000 * ms, 3 * time.Second, 4000},
		{1000*ms + 999*time.Microsecond, 3 * time.Second, 4000},
		{(1<<32 - 10) * ms, 5 * ms, 1<<32 - 5},
		{(1<<32 - 10) * ms, 20 * ms, 10},      // wraps
		{(1<<32 - 10) * ms, 10 * ms, 1},       // would be 0, which means none
		{(3<<32 + 7) * ms, time.Second, 1007}, // the clock past several wraps
	} {
		if got := leaseStamp(c.now, c.lease); got != c.want {
			t.Errorf("leaseStamp(%v, %v) = %d, want %d", c.now, c.lease, got, c.want)
		}
	}
	for _, c := range []struct {
		until uint32
		now   time.Duration
		want  time.Duration
	}{
		{0, 1000 * ms, 0},
		{4000, 1000 * ms, 3 * time.Second},
		{4000, 1000*ms + 999*time.Microsecond, 3 * time.Second},
		{4000, 4000 * ms, 0},
		{4000, 5000 * ms, 0},
		{10, (1<<32 - 10) * ms, 20 * ms},      // across the wrap
		{1<<32 - 10, (1<<32 + 5) * ms, 0},     // run out across the wrap
		{1007, (3<<32 + 7) * ms, time.Second}, // the clock past several wraps
	} {
		if got := leaseLeft(c.until, c.now); got != c.want {
			t.Errorf("leaseLeft(%d, %v) = %v, want %v", c.until, c.now, got, c.want)
		}
	}
}

func TestSplitFrame(t *testing.T) {
	for _, v6 := range []bool{false, true} {
		t.Run(fmt.Sprintf("v6=%v", v6), func(t *testing.T) {
			ipHdr := 20
			if v6 {
				ipHdr = 40
			}
			in := gsoFrame(t, v6, 5000) // seq 0xfffff000, CWR|PSH|FIN|ACK
			// A partial checksum (GSO, or transmit offload): the parts get
			// full ones.
			in[14+ipHdr+16], in[14+ipHdr+17] = 0x12, 0x34
			_, inTCP := decode(t, in)
			for _, c := range []struct {
				name string
				off  int
			}{{"across the sequence wrap", 4100}, {"one byte in", 1}, {"one byte short", 4999}, {"data before, FIN after", 5000}} {
				cut := inTCP.Seq + uint32(c.off)
				parts, err := SplitFrame(in, cut, 1000)
				if err != nil {
					t.Fatalf("%s: %v", c.name, err)
				}
				if len(parts) != 2 {
					t.Fatalf("%s: %d parts", c.name, len(parts))
				}
				for i, f := range parts {
					checkFrame(t, f)
					v, tcp := decode(t, f)
					lo, hi, seq := 0, c.off, inTCP.Seq
					if i == 1 {
						lo, hi, seq = c.off, 5000, cut
					}
					if tcp.Seq != seq || !bytes.Equal(tcp.Payload, inTCP.Payload[lo:hi]) || len(tcp.Payload) != hi-lo {
						t.Errorf("%s: part %d: seq %#x, %d payload bytes; want seq %#x, bytes %d..%d", c.name, i, tcp.Seq, len(tcp.Payload), seq, lo, hi)
					}
					if tcp.FIN != (i == 1) || tcp.PSH != (i == 1) || tcp.CWR != (i == 0) || !tcp.ACK {
						t.Errorf("%s: part %d: flags %s", c.name, i, v.Flags)
					}
					if len(tcp.Options) != 3 || tcp.Ack != 99 || tcp.Window != 500 {
						t.Errorf("%s: part %d: header not copied: %+v", c.name, i, v)
					}
					// The first part is re-injected as ceil(off/1000)
					// segments of 1000 bytes: the second's id follows theirs.
					if wantID := 0x4242 + uint16(i*((c.off+999)/1000)); !v6 && v.ID != wantID {
						t.Errorf("%s: part %d: IPv4 id %#x, want %#x", c.name, i, v.ID, wantID)
					}
				}
			}
			if parts, err := SplitFrame(in, inTCP.Seq+4100, 0); err != nil || len(parts) != 2 {
				t.Fatal(err)
			} else if checkFrame(t, parts[1]); !v6 && binary.BigEndian.Uint16(parts[1][14+4:]) != 0x4243 {
				t.Errorf("not GSO: second part's IPv4 id %#x, want 0x4243", binary.BigEndian.Uint16(parts[1][14+4:]))
			}
			// Urgent data: the pointer keeps to its byte; a part that
			// starts at or after that byte has no URG.
			for _, c := range []struct {
				ptr, want1 uint16
				urg1       bool
			}{{4200, 100, true}, {4101, 1, true}, {4100, 0, false}, {3000, 0, false}} {
				urg := append([]byte(nil), in...)
				urg[14+ipHdr+13] |= tcpURG
				binary.BigEndian.PutUint16(urg[14+ipHdr+18:], c.ptr)
				parts, err := SplitFrame(urg, inTCP.Seq+4100, 1000)
				if err != nil || len(parts) != 2 {
					t.Fatalf("urgent pointer %d: %d parts, %v", c.ptr, len(parts), err)
				}
				for i, f := range parts {
					checkFrame(t, f)
					_, tcp := decode(t, f)
					wantURG, wantPtr := true, c.ptr
					if i == 1 {
						wantURG, wantPtr = c.urg1, c.want1
					}
					if tcp.URG != wantURG || tcp.Urgent != wantPtr {
						t.Errorf("urgent pointer %d, cut at 4100: part %d: URG %v pointer %d, want %v %d", c.ptr, i, tcp.URG, tcp.Urgent, wantURG, wantPtr)
					}
				}
			}
			noFin := append([]byte(nil), in...)
			noFin[14+ipHdr+13] &^= tcpFIN
			for name, c := range map[string]struct {
				f   []byte
				cut uint32
			}{
				"cut at the first byte":        {in, inTCP.Seq},
				"cut before the segment":       {in, inTCP.Seq - 1},
				"cut after the FIN":            {in, inTCP.Seq + 5001},
				"cut at the end, with no FIN":  {noFin, inTCP.Seq + 5000},
				"not TCP over IP (ARP)":        {append(append([]byte(nil), in[:12]...), 0x08, 0x06), inTCP.Seq + 1},
				"truncated below its length":   {in[:len(in)-1], inTCP.Seq + 1},
				"segment with no payload, FIN": {gsoFrame(t, v6, 0), 0xfffff000},
			} {
				if parts, err := SplitFrame(c.f, c.cut, 0); err == nil {
					t.Errorf("%s: cut into %d parts, want an error", name, len(parts))
				} else {
					t.Logf("%s: %v", name, err)
				}
			}
		})
	}
}

// TestTwoPathSplit: with the agent splitting (tp->split), egress hands a
// packet that straddles the cut-off to the hold ring, untranslated and
// uncounted, naming its side; the two parts SplitFrame makes of it, sent
// again with ReinjectMark, go the old and the new path. A re-injected
// packet that straddles is not handed over again, and without tp->split
// the packet goes whole on the old path.
func TestTwoPathSplit(t *testing.T) {
	fx := newFixture(t)
	r := fx.holdReader(t)
	ack := uint8(protocol.TCPAck)
	for _, s := range []tpSide{tpRight4, tpLeft6} {
		for _, c := range []struct {
			name string
			p    protocol.Packet
		}{
			{"data", protocol.Packet{Seq: 990, Len: 20, Ack: 4800, Flags: ack}},
			{"data then FIN", protocol.Packet{Seq: 990, Len: 10, Ack: 4800, Flags: ack | protocol.TCPFin}},
		} {
			t.Run(fmt.Sprintf("%s/%s", s.sess, c.name), func(t *testing.T) {
				vars := protocol.TwoPath{OldSent: 1000, OldSentAcked: 900, OldRcvd: 5000, OldRcvdAcked: 4000}
				rec := s.record(TPActive, vars)
				rec.Split = 1
				s.install(t, fx, rec, nil)
				if err := fx.d.SetSplitReader(time.Minute); err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() { fx.d.SetSplitReader(0) })
				if left, err := fx.d.SplitReaderLease(); err != nil || left <= 50*time.Second || left > time.Minute {
					t.Fatalf("lease of a minute: %v left (%v)", left, err)
				}
				drainHeld(r)
				ctx := skbCtx{Ifindex: uint32(fx.net.ifindex)}
				marked := ctx
				marked.Mark = ReinjectMark
				in := tpPkt(t, s.sess, c.p)
				frame := in.frame(t)
				before, fBefore := fx.stats(t), fx.flow(t, s.egKey())
				verdict, _ := fx.runCtx(t, ctx, frame)
				if verdict != tcActRedirect {
					t.Fatalf("verdict %d, want %d (handed to the agent)", verdict, tcActRedirect)
				}
				h := nextHeld(t, r)
				want := HeldPacket{Session: s.id, Ifindex: fx.net.ifindex, IPv6: s.sess.Src.Is6(), Split: true, Side: s.side, Frame: frame}
				if fmt.Sprint(h) != fmt.Sprint(want) {
					t.Errorf("record\n got %+v\nwant %+v", h, want)
				}
				fx.counterMoves(t, before, map[string]uint64{"tp_straddle": 1, "tp_old": 0, "tp_new": 0,
					"rewrite_out": 0, "hold_pkts": 0, "hold_drop": 0})
				// The counters are taken back (the parts are counted); the
				// mark may move to the packet's end, where its parts take it.
				if f := fx.flow(t, s.egKey()); f.Packets != fBefore.Packets || f.Bytes != fBefore.Bytes {
					t.Errorf("handing over counted the packet: packets %d -> %d, bytes %d -> %d", fBefore.Packets, f.Packets, fBefore.Bytes, f.Bytes)
				}
				if rr := fx.twoPath(t, s.key()); rr.Straddled != 1 {
					t.Errorf("record counted %d straddling packets, want 1", rr.Straddled)
				}

				parts, err := SplitFrame(h.Frame, rec.OldSent, int(h.GSOSize))
				if err != nil {
					t.Fatal(err)
				}
				n := int(vars.OldSent - c.p.Seq)
				old := tpPkt(t, s.oldSub, protocol.Packet{Seq: c.p.Seq, Len: uint32(n), Ack: c.p.Ack, Flags: ack})
				old.payload = in.payload[:n]
				nw := tpPkt(t, s.newSub, protocol.Packet{Seq: vars.OldSent, Len: c.p.Len - uint32(n), Ack: c.p.Ack, Flags: c.p.Flags})
				nw.payload = in.payload[n:]
				nw.idPlus = 1 // the second part (IPv4)
				before = fx.stats(t)
				for i, w := range []pkt{old, nw} {
					f := parts[i]
					if len(f) < 60 { // the Ethernet padding the expected frame has (a bare FIN)
						f = append(f, make([]byte, 60-len(f))...)
					}
					verdict, out := fx.runCtx(t, marked, f)
					if verdict != tcActOK {
						t.Fatalf("part %d: verdict %d", i, verdict)
					}
					expectFrame(t, out, w)
				}
				expectNoHeld(t, r)
				fx.counterMoves(t, before, map[string]uint64{"tp_straddle": 0, "tp_old": 1, "tp_new": 1, "rewrite_out": 2})
				if f := fx.flow(t, s.egKey()); f.Packets != fBefore.Packets+2 || f.MkSeq != c.p.End() {
					t.Errorf("after the parts: flow packets %d (before %d), mark %d, want %d", f.Packets, fBefore.Packets, f.MkSeq, c.p.End())
				}

				// Re-injected (the agent could not split it), a straddling
				// packet is not handed over again, nor counted again: whole
				// on the old path.
				before = fx.stats(t)
				verdict, out := fx.runCtx(t, marked, frame)
				if verdict != tcActOK {
					t.Fatalf("re-injected straddler: verdict %d", verdict)
				}
				expectFrame(t, out, in.with(s.oldSub))
				expectNoHeld(t, r)
				fx.counterMoves(t, before, map[string]uint64{"tp_straddle": 0, "tp_old": 1})

				// No agent reads the ring now: whole on the old path, counted.
				whole := func(what string) {
					t.Helper()
					before := fx.stats(t)
					verdict, out := fx.runCtx(t, ctx, frame)
					if verdict != tcActOK {
						t.Fatalf("%s: verdict %d", what, verdict)
					}
					expectFrame(t, out, in.with(s.oldSub))
					expectNoHeld(t, r)
					fx.counterMoves(t, before, map[string]uint64{"tp_straddle": 1, "tp_old": 1})
				}
				if err := fx.d.SetSplitReader(0); err != nil {
					t.Fatal(err)
				}
				whole("no ring reader")
				// A reader's lease that ran out (its agent died without
				// clearing it): whole too.
				if err := fx.d.setConfig(func(v *dyscoConfig) {
					v.SplitUntil = leaseStamp(Monotonic()-time.Minute, 50*time.Second)
				}); err != nil {
					t.Fatal(err)
				}
				if left, err := fx.d.SplitReaderLease(); err != nil || left != 0 {
					t.Fatalf("a lease run out: %v left (%v)", left, err)
				}
				whole("lease run out")
				if err := fx.d.SetSplitReader(time.Minute); err != nil {
					t.Fatal(err)
				}
				// A record made by an agent that does not split: whole too.
				if err := fx.d.PutTwoPath(s.key(), s.record(TPActive, vars)); err != nil {
					t.Fatal(err)
				}
				whole("record without split")
			})
		}
	}
}
