package datapath

// Tests of sending held packets on again, the split reader's lease and
// splitting a packet at a cut-off.

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"net"
	"os"
	"runtime"
	"testing"
	"time"

	"github.com/dysco/dysco/internal/protocol"
	"github.com/dysco/dysco/internal/testutil"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

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
