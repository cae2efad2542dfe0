package agent

import (
	"net/netip"
	"strings"
	"testing"

	"github.com/dysco/dysco/internal/api"
	"github.com/dysco/dysco/internal/datapath"
)

func TestEffectiveSet(t *testing.T) {
	server := api.PolicySet{Version: 3, Policies: []api.Policy{
		{Name: "b", Filter: "tcp", Priority: 5},
		{Name: "shared", Filter: "tcp port 1"},
	}, Types: []api.MiddleboxType{{Name: "fw", Instances: []netip.Addr{netip.MustParseAddr("10.0.0.1")}}}}
	local := api.PolicySet{Policies: []api.Policy{
		{Name: "a", Filter: "tcp", Priority: 5},
		{Name: "shared", Filter: "tcp port 2", Priority: 1},
	}, Types: []api.MiddleboxType{{Name: "fw", Instances: []netip.Addr{netip.MustParseAddr("10.0.0.2")}}}}
	pols, types := effectiveSet(local, server)
	var names []string
	for _, p := range pols {
		names = append(names, p.Name)
	}
	if got := strings.Join(names, ","); got != "shared,a,b" {
		t.Errorf("order %s, want shared (priority 1), then a and b by name", got)
	}
	if pols[0].Filter != "tcp port 2" {
		t.Errorf("a local policy must override the server's of the same name: %+v", pols[0])
	}
	if len(types) != 1 || types[0].Instances[0] != netip.MustParseAddr("10.0.0.2") {
		t.Errorf("types %+v: the local type must override", types)
	}
}

func TestResolveChain(t *testing.T) {
	idx := map[string]int{"fw": 0, "ids": 1}
	p := api.Policy{Name: "p", Filter: "tcp", Chain: []api.Hop{{Type: "ids"}, {Addr: netip.MustParseAddr("10.0.0.9")}}}
	c, err := resolveChain(p, idx)
	if err != nil {
		t.Fatal(err)
	}
	if !c.ToDst || len(c.Hops) != 2 || c.Hops[0].Type != 1 || c.Hops[0].Addr.IsValid() || c.Hops[1].Addr != netip.MustParseAddr("10.0.0.9") {
		t.Errorf("chain %+v", c)
	}
	p.EndBeforeDestination = true
	if c, _ := resolveChain(p, idx); c.ToDst {
		t.Error("end_before_destination must not append the destination")
	}
	p.Chain = []api.Hop{{Type: "scrubber"}}
	if _, err := resolveChain(p, idx); err == nil || !strings.Contains(err.Error(), `"scrubber" is not defined`) {
		t.Errorf("undefined type: %v", err)
	}
}

func TestCounted(t *testing.T) {
	in := datapath.Flow{Flags: datapath.FlIngress}
	out0 := datapath.Flow{}                      // the SYN's direction
	out1 := datapath.Flow{Flags: datapath.FlRev} // the reverse
	for _, c := range []struct {
		f    datapath.Flow
		role uint8
		want bool
	}{
		{in, datapath.RoleMiddle, true},
		{out0, datapath.RoleMiddle, false}, // counted where it entered
		{out0, datapath.RoleStart, true},   // made here
		{out1, datapath.RoleStart, false},
		{out1, datapath.RoleEnd, true},
		{out1, datapath.RoleEndFwd, true},
	} {
		if got := datapath.Counted(c.f, c.role); got != c.want {
			t.Errorf("Counted(%+v, role %d) = %v, want %v", c.f, c.role, got, c.want)
		}
	}
}
