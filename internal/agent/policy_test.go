package agent

import (
	"bytes"
	"log/slog"
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

// A policy whose filter matches no protocol the datapath chains is refused
// with a clear log line and counted, as one whose filter does not compile.
func TestCompilePolicyRefusals(t *testing.T) {
	var logs bytes.Buffer
	a := &Agent{log: slog.New(slog.NewTextHandler(&logs, nil))}
	if _, err := a.compilePolicy(api.Policy{Name: "web", Filter: "tcp dst port 80"}); err != nil {
		t.Fatal(err)
	}
	_, err := a.compilePolicy(api.Policy{Name: "quic", Filter: "icmp"})
	want := `policy "quic": filter "icmp" matches only icmp packets; dysco chains tcp and udp sessions`
	if err == nil || err.Error() != want {
		t.Errorf("icmp policy: %v, want %s", err, want)
	}
	if _, err := a.compilePolicy(api.Policy{Name: "bad", Filter: "tcp dst port"}); err == nil {
		t.Error("a filter that does not compile was accepted")
	}
	if u, f := a.refusedUnchained.Load(), a.refusedFilter.Load(); u != 1 || f != 1 {
		t.Errorf("counters unchained %d, filter %d; want 1 and 1", u, f)
	}
	for _, w := range []string{`msg="policy refused, not installed" name=quic filter=icmp reason=unchained`, `name=bad filter="tcp dst port" reason=filter`} {
		if !strings.Contains(logs.String(), w) {
			t.Errorf("log\n%s\nlacks %s", logs.String(), w)
		}
	}
}
