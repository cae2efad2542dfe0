package datapath

import (
	"net/netip"
	"testing"

	"github.com/dysco/dysco/internal/wire"
)

// BenchmarkSynAdmission times the ingress program on Dysco SYNs that it
// drops without keeping state, so that every repeat of BPF_PROG_TEST_RUN
// sees the same packet: from a host with no key (refused before any MAC
// is computed), with a MAC that does not verify (one SipHash-2-4 of the
// block and tuple, 104 bytes with one hop, 216 with eight), and with a
// valid MAC on a block dropped after it (the whole admission and the
// block's checks). The MAC's cost is the difference between the bad-MAC
// and the no-key cases. Run with
// `go test -run - -bench SynAdmission ./internal/datapath` (root).
func BenchmarkSynAdmission(b *testing.B) {
	fx := newFixture(b)
	hops8 := make([]netip.Addr, 0, wire.MaxHops)
	for i := range wire.MaxHops - 1 {
		hops8 = append(hops8, netip.AddrFrom4([4]byte{10, 1, 0, byte(100 + i)}))
	}
	hops8 = append(hops8, serverV4)
	one := block(b, sess4, nonceOf(1), serverV4)
	eight := block(b, sess4, nonceOf(1), hops8...)
	loop := block(b, sess4, nonceOf(1), hostV4, serverV4) // names this host: drop_loop
	cases := []struct {
		name  string
		keyed bool
		in    pkt
		stat  string
	}{
		{"no-key/1-hop", false, dyscoSYNRaw(subIn4, one, len(one)), "drop_untrusted"},
		{"bad-mac/1-hop", true, dyscoSYNRaw(subIn4, one, len(one)), "drop_bad_mac"},
		{"no-key/8-hops", false, dyscoSYNRaw(subIn4, eight, len(eight)), "drop_untrusted"},
		{"bad-mac/8-hops", true, dyscoSYNRaw(subIn4, eight, len(eight)), "drop_bad_mac"},
		{"good-mac/2-hops-loop", true, dyscoSYN(subIn4, loop, len(loop)), "drop_loop"},
	}
	for _, c := range cases {
		b.Run(c.name, func(b *testing.B) {
			fx.reset(b)
			key := &fxSynKey
			if !c.keyed {
				key = nil
			}
			if err := fx.d.SetSynKeys(key, nil); err != nil {
				b.Fatal(err)
			}
			b.Cleanup(func() { _ = fx.d.SetSynKeys(&fxSynKey, nil) })
			frame := c.in.frame(b)
			before := fx.stats(b)
			var per float64
			fx.net.do(func() {
				b.ResetTimer()
				_, d, err := fx.ingress.Benchmark(frame, max(b.N, 1), nil)
				if err != nil {
					b.Fatal(err)
				}
				per = float64(d.Nanoseconds())
			})
			if after := fx.stats(b); after[c.stat] == before[c.stat] {
				b.Fatalf("%s did not move: not the path meant", c.stat)
			}
			b.ReportMetric(per, "ns/run")
		})
	}
}
