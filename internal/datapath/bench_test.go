package datapath

import (
	"testing"

	"github.com/cilium/ebpf"
)

// BenchmarkDatapath times the entry programs on one packet with
// BPF_PROG_TEST_RUN's repeat mode: the kernel measures the program alone,
// without the BPF statistics' overhead or the rest of the stack. The repeats
// run on the same packet, so the rewrite cases install a flow each way
// (A→B and B→A): every run rewrites. Run with
// `go test -run - -bench Datapath ./internal/datapath` (root).
func BenchmarkDatapath(b *testing.B) {
	fx := newFixture(b)
	m := fx.d.Maps()
	est := func(f Flow) Flow { f.Flags |= FlEst; return f }
	cases := []struct {
		name   string
		prog   *ebpf.Program
		flow   *Flow
		packet pkt
	}{
		{"ingress/no-flow", fx.ingress, nil, dataPkt(sess4)},
		{"ingress/rewrite", fx.ingress, &Flow{Out: EndsFrom(sess4), SessId: 7, Flags: FlIngress}, dataPkt(subIn4)},
		{"egress/no-flow", fx.egress, nil, dataPkt(subOut4)},
		{"egress/rewrite", fx.egress, &Flow{Out: EndsFrom(subOut4), SessId: 7}, dataPkt(sess4)},
	}
	for _, c := range cases {
		b.Run(c.name, func(b *testing.B) {
			fx.reset(b)
			if c.flow != nil {
				back := *c.flow
				back.Out = c.packet.key().Ends()
				if err := m["flows"].Put(c.packet.key(), est(*c.flow)); err != nil {
					b.Fatal(err)
				}
				if err := m["flows"].Put(c.flow.Out.Tuple(), est(back)); err != nil {
					b.Fatal(err)
				}
				if err := m["sessions"].Put(c.flow.SessId, *estSession(sess4, RoleMiddle)); err != nil {
					b.Fatal(err)
				}
			}
			frame := c.packet.frame(b)
			var per float64
			fx.net.do(func() {
				b.ResetTimer()
				_, d, err := c.prog.Benchmark(frame, max(b.N, 1), nil)
				if err != nil {
					b.Fatal(err)
				}
				per = float64(d.Nanoseconds())
			})
			b.ReportMetric(per, "ns/run")
		})
	}
}
