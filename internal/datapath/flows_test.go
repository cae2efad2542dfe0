package datapath

import (
	"net/netip"
	"testing"

	"github.com/cilium/ebpf"

	"github.com/dysco/dysco/internal/wire"
)

// TestFlowConversions: an IPv4 tuple and flow survive the trip through the
// IPv4 flow map's compact layout; IPv6 and IPv4-mapped tuples are told
// apart; a flow whose target is of the other family is refused.
func TestFlowConversions(t *testing.T) {
	k := TupleFrom(mustTuple(t, "10.1.0.20:31000 -> 10.1.0.1:32000"))
	f := Flow{Packets: 3, Bytes: 400, SessId: 9, Flags: FlIngress | FlMarks, MkSeq: 5, MkAck: 6, LastMs: 7,
		Out: EndsFrom(mustTuple(t, "10.5.0.7:40000 -> 10.9.0.5:80"))}
	if !k.Is4() {
		t.Fatalf("%s is not IPv4", k)
	}
	if got := k.To4().Tuple(); got != k {
		t.Errorf("key round trip: %s, want %s", got, k)
	}
	f4, err := f.To4()
	if err != nil {
		t.Fatal(err)
	}
	if got := f4.Flow(); got != f {
		t.Errorf("flow round trip: %+v, want %+v", got, f)
	}
	v6 := TupleFrom(mustTuple(t, "[fd00:1::1]:1 -> [fd00:9::5]:2"))
	if v6.Is4() {
		t.Errorf("%s taken for IPv4", v6)
	}
	mixed := k
	mixed.Daddr = v6.Daddr
	if mixed.Is4() {
		t.Error("a tuple with one IPv6 address taken for IPv4")
	}
	bad := f
	bad.Out = v6.Ends()
	if _, err := bad.To4(); err == nil {
		t.Error("an IPv4 flow with an IPv6 target was converted")
	}
}

// TestFlowMapsByFamily: flows go to the map of their family and come back
// whole through every access path (Flow, EachFlow, DeleteFlow); a flow of
// mixed families is refused; an IPv6 packet with IPv4-mapped addresses is
// not taken for the IPv4 flow of the same addresses (parse refuses it).
func TestFlowMapsByFamily(t *testing.T) {
	fx := newFixture(t)
	m := fx.d.Maps()
	k4 := TupleFrom(mustTuple(t, "10.1.0.20:31000 -> 10.1.0.1:32000"))
	f4 := Flow{Packets: 1, Bytes: 2, SessId: 4, Flags: FlIngress, Out: EndsFrom(mustTuple(t, "10.5.0.7:40000 -> 10.9.0.5:80"))}
	k6 := TupleFrom(mustTuple(t, "[fd00:1::1]:41001 -> [fd00:9::5]:41002"))
	f6 := Flow{Packets: 3, Bytes: 4, SessId: 6, Out: EndsFrom(mustTuple(t, "[fd00:1::1]:40000 -> [fd00:9::5]:443"))}
	for _, c := range []struct {
		k Tuple
		f Flow
	}{{k4, f4}, {k6, f6}} {
		if err := fx.d.AddFlow(c.k, c.f); err != nil {
			t.Fatal(err)
		}
		if err := fx.d.AddFlow(c.k, c.f); err == nil {
			t.Errorf("flow %s added twice", c.k)
		}
		if got, ok := fx.d.Flow(c.k); !ok || got != c.f {
			t.Errorf("flow %s: %+v %v, want %+v", c.k, got, ok, c.f)
		}
	}
	if n4, n6 := entries(t, m["flows4"]), entries(t, m["flows6"]); n4 != 1 || n6 != 1 {
		t.Fatalf("%d IPv4 and %d IPv6 flows, want one each", n4, n6)
	}
	seen := map[Tuple]Flow{}
	if err := fx.d.EachFlow(func(k *Tuple, f *Flow) { seen[*k] = *f }); err != nil {
		t.Fatal(err)
	}
	if len(seen) != 2 || seen[k4] != f4 || seen[k6] != f6 {
		t.Errorf("EachFlow saw %+v", seen)
	}
	if id, err := fx.d.SessionIDByTuple(mustTuple(t, "10.1.0.1:32000 -> 10.1.0.20:31000")); err != nil || id != 4 {
		t.Errorf("SessionIDByTuple: %d, %v", id, err)
	}
	mixed := f4
	mixed.Out = f6.Out
	if err := fx.d.PutFlow(TupleFrom(mustTuple(t, "10.1.0.21:1 -> 10.1.0.1:2")), mixed, ebpf.UpdateAny); err == nil {
		t.Error("an IPv4 flow with an IPv6 target was stored")
	}

	// The same addresses as k4, IPv4-mapped in an IPv6 packet.
	mapped := wire.Tuple{Src: netip.MustParseAddr("::ffff:10.1.0.20"), Dst: netip.MustParseAddr("::ffff:10.1.0.1"),
		SrcPort: 31000, DstPort: 32000}
	in := dataPkt(mapped)
	before := fx.stats(t)
	verdict, out := fx.run(t, fx.ingress, in.frame(t))
	if verdict != tcActOK {
		t.Fatalf("verdict %d for an IPv6 packet with IPv4-mapped addresses", verdict)
	}
	if got, _ := decode(t, out); got.Src != in.src || got.Dst != in.dst {
		t.Errorf("the packet was rewritten: %s -> %s", got.Src, got.Dst)
	}
	fx.expectStats(t, before, nil)
	if got, _ := fx.d.Flow(k4); got.Packets != f4.Packets {
		t.Errorf("the IPv4 flow counted the IPv6 packet: %d packets", got.Packets)
	}

	for _, k := range []Tuple{k4, k6} {
		fx.d.DeleteFlow(k)
		if _, ok := fx.d.Flow(k); ok {
			t.Errorf("flow %s outlived DeleteFlow", k)
		}
	}
}
