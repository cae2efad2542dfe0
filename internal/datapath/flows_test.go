package datapath

import (
	"fmt"
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

// TestDeleteBatches: the collector's batch deletions remove exactly the
// flows, deltas, sessions and set-up state asked for, of both families,
// and go on past keys that are already gone (the datapath frees some
// itself) in the middle of a batch.
func TestDeleteBatches(t *testing.T) {
	d := loadTest(t)
	var del, keep []Tuple
	for i := range 40 {
		for _, s := range [][2]string{
			{"10.1.0.20:%d -> 10.1.0.1:80", "10.3.0.30:%d -> 10.9.0.9:81"},
			{"[fd00:1::20]:%d -> [fd00:1::1]:80", "[fd00:3::30]:%d -> [fd00:9::9]:81"},
		} {
			k := TupleFrom(mustTuple(t, fmt.Sprintf(s[0], 20000+i)))
			out := EndsFrom(mustTuple(t, fmt.Sprintf(s[1], 40000+i)))
			if err := d.PutFlow(k, Flow{SessId: uint32(i + 1), Out: out}, ebpf.UpdateNoExist); err != nil {
				t.Fatal(err)
			}
			if i%3 == 0 {
				if err := d.PutDelta(k, Delta{Seq: int32(i)}); err != nil {
					t.Fatal(err)
				}
			}
			if i%2 == 0 {
				del = append(del, k)
			} else {
				keep = append(keep, k)
			}
		}
	}
	// Keys that are gone already, first, in the middle and last.
	gone := []Tuple{TupleFrom(mustTuple(t, "10.7.0.1:1 -> 10.7.0.2:2")), TupleFrom(mustTuple(t, "[fd00:7::1]:1 -> [fd00:7::2]:2"))}
	ask := append(append(append([]Tuple{gone[0]}, del[:len(del)/2]...), gone...), del[len(del)/2:]...)
	ask = append(ask, gone[1])
	if n := d.DeleteFlows(ask); n != len(del) {
		t.Errorf("DeleteFlows deleted %d flows, want %d", n, len(del))
	}
	deltas := map[Tuple]bool{}
	_ = eachBatch(d.objs.DyscoDeltas, "deltas", &batchBufs[Tuple, Delta]{}, func(k *Tuple, _ *Delta) { deltas[*k] = true })
	for _, k := range del {
		if _, ok := d.Flow(k); ok {
			t.Errorf("flow %s not deleted", k)
		}
		if deltas[k] {
			t.Errorf("delta of %s not deleted", k)
		}
	}
	for i, k := range keep {
		if _, ok := d.Flow(k); !ok {
			t.Errorf("flow %s deleted", k)
		}
		if want := (i/2*2+1)%3 == 0; deltas[k] != want {
			t.Errorf("delta of %s: present %v, want %v", k, deltas[k], want)
		}
	}

	var ids, keepIDs []uint32
	for i := range 20 {
		id, err := d.InsertSession(Session{Tuple: EndsFrom(mustTuple(t, fmt.Sprintf("10.2.0.1:%d -> 10.2.0.2:80", 30000+i)))})
		if err != nil {
			t.Fatal(err)
		}
		if i%2 == 0 {
			ids = append(ids, id)
		} else {
			keepIDs = append(keepIDs, id)
		}
	}
	// Ids above InsertSession's range: gone, first and in the middle.
	d.DeleteSessions(append(append([]uint32{1<<24 + 1}, ids[:5]...), append([]uint32{1<<24 + 2}, ids[5:]...)...))
	for _, id := range ids {
		if d.SessionExists(id) {
			t.Errorf("session %d not deleted", id)
		}
	}
	for _, id := range keepIDs {
		if !d.SessionExists(id) {
			t.Errorf("session %d deleted", id)
		}
	}
}

// TestAllSynHops: the one-walk listing of set-up state gives each session's
// remaining hops, IPv4 unmapped and IPv6 as they are, and nothing for
// sessions without set-up state.
func TestAllSynHops(t *testing.T) {
	d := loadTest(t)
	want := map[uint32][]netip.Addr{
		3: {netip.MustParseAddr("10.0.0.7"), netip.MustParseAddr("10.0.0.9")},
		4: {netip.MustParseAddr("fd00::7")},
		5: nil,
	}
	for id, hops := range want {
		var st dyscoSynState
		for i, h := range hops {
			st.Hops[i] = h.As16()
		}
		st.N_hops = uint8(len(hops))
		if err := d.objs.DyscoSyns.Put(id, &st); err != nil {
			t.Fatal(err)
		}
	}
	got, err := d.AllSynHops()
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != len(want) {
		t.Errorf("%d sessions with set-up state, want %d: %v", len(got), len(want), got)
	}
	for id, hops := range want {
		g, ok := got[id]
		if !ok || fmt.Sprint(g) != fmt.Sprint(hops) {
			t.Errorf("session %d: %v (%v), want %v", id, g, ok, hops)
		}
	}
}
