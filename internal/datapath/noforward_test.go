package datapath

import (
	"bytes"
	"encoding/binary"
	"net/netip"
	"os"
	"reflect"
	"testing"
	"time"

	"github.com/dysco/dysco/internal/wire"
)

// setForwarding turns IP forwarding of both families on or off in the
// fixture's namespace (all interfaces).
func (fx *fixture) setForwarding(tb testing.TB, on bool) {
	tb.Helper()
	v := []byte("0")
	if on {
		v = []byte("1")
	}
	var err error
	fx.net.do(func() {
		for _, f := range []string{"/proc/sys/net/ipv4/conf/all/forwarding", "/proc/sys/net/ipv6/conf/all/forwarding"} {
			if err == nil {
				err = os.WriteFile(f, v, 0o644)
			}
		}
	})
	if err != nil {
		tb.Fatal(err)
	}
}

// TestNoForwardRefused: a chained SYN that this host would have to forward
// (hops remain, or the chain ends here before the destination) while IP
// forwarding is off is refused at once: counted, no state left, and turned
// into a reset to the previous hop on its subsession, acknowledging the SYN,
// with every checksum right, sent back out of the interface it came in on.
// With forwarding on, the same SYN sets the session up; a SYN for this host
// itself is never refused.
func TestNoForwardRefused(t *testing.T) {
	fx := newFixture(t)
	t.Cleanup(func() { fx.setForwarding(t, true) })
	cases := []struct {
		name   string
		sub    wire.Tuple
		blk    wire.SynBlock
		ipOpts bool
		stat   string // the set-up counted with forwarding on
	}{
		{"v4, hops remain", subIn4, wire.SynBlock{Session: sess4, Nonce: nonceOf(1), Hops: []netip.Addr{serverV4}}, false, "setup_cont"},
		{"v4 with IP options", subIn4, wire.SynBlock{Session: sess4, Nonce: nonceOf(2), Hops: []netip.Addr{mbox2V4, serverV4}}, true, "setup_cont"},
		{"v4, chain ends before the destination", subIn4, wire.SynBlock{Session: sess4, Nonce: nonceOf(3)}, false, "setup_end"},
		{"v6, hops remain", subIn6, wire.SynBlock{Session: sess6, Nonce: nonceOf(4), Hops: []netip.Addr{serverV6}}, false, "setup_cont"},
		{"v6, chain ends before the destination", subIn6, wire.SynBlock{Session: sess6, Nonce: nonceOf(5)}, false, "setup_end"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			blk := block(t, c.blk.Session, c.blk.Nonce, c.blk.Hops...)
			in := dyscoSYN(c.sub, blk, len(blk))
			in.ipOpts = c.ipOpts
			frame := in.frame(t)

			fx.reset(t)
			fx.setForwarding(t, false)
			before := fx.stats(t)
			verdict, out := fx.run(t, fx.ingress, frame)
			if verdict != tcActRedirect {
				t.Fatalf("verdict %d, want a redirect (%d)", verdict, tcActRedirect)
			}
			fx.expectStats(t, before, map[string]uint64{"drop_no_forward": 1})
			fx.expectNoState(t)
			checkRefusal(t, frame, out, c.sub)

			fx.reset(t)
			fx.setForwarding(t, true)
			before = fx.stats(t)
			if verdict, _ := fx.run(t, fx.ingress, frame); verdict != tcActOK {
				t.Fatalf("forwarding on: verdict %d, want %d", verdict, tcActOK)
			}
			fx.expectStats(t, before, map[string]uint64{c.stat: 1})
			fx.onlySession(t)
		})
	}
	t.Run("destination is this host", func(t *testing.T) {
		fx.reset(t)
		fx.setForwarding(t, false)
		sess := tup(apOf(clientV4, 40000), apOf(hostV4, 80))
		blk := block(t, sess, nonceOf(6))
		before := fx.stats(t)
		if verdict, _ := fx.run(t, fx.ingress, dyscoSYN(tup(ap("10.1.0.30:31000"), ap("10.1.0.1:32000")), blk, len(blk)).frame(t)); verdict != tcActOK {
			t.Fatalf("verdict %d, want %d", verdict, tcActOK)
		}
		fx.expectStats(t, before, map[string]uint64{"setup_end": 1})
	})
}

// TestNoForwardCheckOff: a datapath loaded with NoForwardCheck hands such
// SYNs to the stack as before (a host whose local transparent proxy takes
// them).
func TestNoForwardCheckOff(t *testing.T) {
	fx := newFixtureWith(t, func(_ *testNet, cfg *Config) { cfg.NoForwardCheck = true })
	fx.setForwarding(t, false)
	t.Cleanup(func() { fx.setForwarding(t, true) })
	blk := block(t, sess4, nonceOf(1), serverV4)
	before := fx.stats(t)
	if verdict, _ := fx.run(t, fx.ingress, dyscoSYN(subIn4, blk, len(blk)).frame(t)); verdict != tcActOK {
		t.Fatalf("verdict %d, want %d", verdict, tcActOK)
	}
	fx.expectStats(t, before, map[string]uint64{"setup_cont": 1})
}

// checkRefusal checks the reset made of the SYN frame syn (subsession
// sub): back to the previous hop on the subsession, acknowledging the SYN,
// nothing else in it, checksums recomputed from scratch.
func checkRefusal(t *testing.T, syn, out []byte, sub wire.Tuple) {
	t.Helper()
	l3, ipLen := 40, 20 // IPv6: payload length
	if sub.Is4() {
		l3, ipLen = 20, 40 // IPv4: total length, options gone
	}
	if want := 14 + l3 + 20; len(out) != want {
		t.Fatalf("reset of %d bytes, want %d:\n%x", len(out), want, out)
	}
	if !bytes.Equal(out[0:6], syn[6:12]) || !bytes.Equal(out[6:12], syn[0:6]) || !bytes.Equal(out[12:14], syn[12:14]) {
		t.Errorf("Ethernet header %x, want the SYN's (%x) with the addresses swapped", out[:14], syn[:14])
	}
	checkFrame(t, out)
	v, _ := decode(t, out)
	want := view{
		EthSrc: v.EthSrc, EthDst: v.EthDst, // checked above
		Src: netip.AddrPortFrom(sub.Dst, sub.DstPort), Dst: netip.AddrPortFrom(sub.Src, sub.SrcPort),
		TTL: 64, IPLen: ipLen, Seq: 0,
		Flags: "AR", DataOff: 5, Payload: "",
	}
	if sub.Is4() {
		want.IPFlags, want.IPOpts = 2, "ihl 5 " // DF, no options
		want.Ack = binary.BigEndian.Uint32(syn[14+int(syn[14]&0xf)*4+4:]) + 1
	} else {
		want.Ack = binary.BigEndian.Uint32(syn[14+40+4:]) + 1
	}
	if !reflect.DeepEqual(v, want) {
		t.Errorf("reset\n%+v\nwant\n%+v", v, want)
	}
}

// BenchmarkForwardCheck times a chained SYN on a middlebox host (a
// retransmission: the session exists, so that each run takes the same
// path) with the forwarding check and without it: the check's cost is one
// bpf_fib_lookup per chained SYN the host passes on.
func BenchmarkForwardCheck(b *testing.B) {
	for _, c := range []struct {
		name string
		off  bool
	}{{"check", false}, {"no-check", true}} {
		b.Run(c.name, func(b *testing.B) {
			fx := newFixtureWith(b, func(_ *testNet, cfg *Config) { cfg.NoForwardCheck = c.off })
			blk := block(b, sess4, nonceOf(1), serverV4)
			frame := dyscoSYN(subIn4, blk, len(blk)).frame(b)
			if verdict, _ := fx.run(b, fx.ingress, frame); verdict != tcActOK {
				b.Fatalf("set-up: verdict %d", verdict)
			}
			var total time.Duration
			fx.net.do(func() {
				b.ResetTimer()
				for i := 0; i < b.N; i++ {
					// One run per call: a run changes the packet, which
					// a repeated run would see.
					_, d, err := fx.ingress.Benchmark(frame, 1, nil)
					if err != nil {
						b.Fatal(err)
					}
					total += d
				}
			})
			b.ReportMetric(float64(total.Nanoseconds())/float64(b.N), "ns/run")
		})
	}
}
