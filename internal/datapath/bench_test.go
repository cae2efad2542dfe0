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
	// Sequence translation as after a proxy's removal: every delta, both
	// ways (the second flow undoes the first), on Linux's usual options
	// (NOP, NOP, timestamps: direct writes) and with SACK blocks (the
	// helpers).
	delta := &Delta{Seq: 1000, Ack: -500, Tsval: 77, Tsecr: -33}
	tsOnly := dataPkt(subIn4).withOpts(optNOP(), optNOP(), optTS(1000, 2000))
	cases := []struct {
		name   string
		prog   *ebpf.Program
		flow   *Flow
		delta  *Delta
		packet pkt
	}{
		{"ingress/no-flow", fx.ingress, nil, nil, dataPkt(sess4)},
		{"ingress/rewrite", fx.ingress, &Flow{Out: EndsFrom(sess4), SessId: 7, Flags: FlIngress}, nil, dataPkt(subIn4)},
		{"ingress/rewrite+delta", fx.ingress, &Flow{Out: EndsFrom(sess4), SessId: 7, Flags: FlIngress | FlDelta}, delta, tsOnly},
		{"ingress/rewrite+delta+sack", fx.ingress, &Flow{Out: EndsFrom(sess4), SessId: 7, Flags: FlIngress | FlDelta}, delta, dataPkt(subIn4)},
		{"egress/no-flow", fx.egress, nil, nil, dataPkt(subOut4)},
		{"egress/rewrite", fx.egress, &Flow{Out: EndsFrom(subOut4), SessId: 7}, nil, dataPkt(sess4)},
	}
	for _, c := range cases {
		b.Run(c.name, func(b *testing.B) {
			fx.reset(b)
			if c.flow != nil {
				back := *c.flow
				back.Out = c.packet.key().Ends()
				if err := fx.d.PutFlow(c.packet.key(), est(*c.flow), ebpf.UpdateAny); err != nil {
					b.Fatal(err)
				}
				if err := fx.d.PutFlow(c.flow.Out.Tuple(), est(back), ebpf.UpdateAny); err != nil {
					b.Fatal(err)
				}
				if c.delta != nil {
					undo := Delta{Seq: -c.delta.Seq, Ack: -c.delta.Ack, Tsval: -c.delta.Tsval, Tsecr: -c.delta.Tsecr}
					if err := m["deltas"].Put(c.packet.key(), *c.delta); err != nil {
						b.Fatal(err)
					}
					if err := m["deltas"].Put(c.flow.Out.Tuple(), undo); err != nil {
						b.Fatal(err)
					}
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

// BenchmarkMapAccess times what the agent pays per map update and lookup
// (a two-path record, a flow) from Go: keys and values passed by value go
// through encoding/binary's reflection in cilium/ebpf; passed by pointer
// they are used in place, as the Datapath methods do. Run with
// `go test -run - -bench MapAccess ./internal/datapath` (root).
func BenchmarkMapAccess(b *testing.B) {
	fx := newFixture(b)
	tp := fx.d.objs.DyscoTp
	k := TPKey{SessId: 5, Side: 1}
	var v TPVal
	b.Run("two-path/by-value", func(b *testing.B) {
		for b.Loop() {
			_ = tp.Update(k, v, ebpf.UpdateAny)
			_ = tp.Lookup(k, &v)
		}
	})
	b.Run("two-path/by-pointer", func(b *testing.B) {
		for b.Loop() {
			_ = tp.Update(&k, &v, ebpf.UpdateAny)
			_ = tp.Lookup(&k, &v)
		}
	})
	fk := TupleFrom(subIn4).To4()
	var f Flow4
	b.Run("flow/by-value", func(b *testing.B) {
		for b.Loop() {
			_ = fx.d.objs.DyscoFlows4.Update(fk, f, ebpf.UpdateAny)
			_ = fx.d.objs.DyscoFlows4.Lookup(fk, &f)
		}
	})
	b.Run("flow/by-pointer", func(b *testing.B) {
		for b.Loop() {
			_ = fx.d.objs.DyscoFlows4.Update(&fk, &f, ebpf.UpdateAny)
			_ = fx.d.objs.DyscoFlows4.Lookup(&fk, &f)
		}
	})
	b.Run("ctl", func(b *testing.B) {
		for b.Loop() {
			_ = fx.d.ctl(ctlTPClamp, nil, &k, 0)
		}
	})
}
