package agent

import (
	"net"
	"net/netip"

	"github.com/dysco/dysco/internal/datapath"
	"github.com/vishvananda/netlink"
)

// The datapath re-routes a rewritten packet (a FIB lookup and
// bpf_redirect_neigh, and a second pass through egress) unless the new
// destination leaves by the same interface and next hop as the old one, in
// which case the packet's link-layer header is already right. Forwarding
// hosts decide that at set-up; on other hosts bpf_fib_lookup does not
// answer, so the agent decides it here from the kernel's routes and clears
// FL_REROUTE where it can. When the routes change, every flow that rewrites
// a destination is marked for re-routing again and decided anew.

// routeKey is a pair of destinations whose routes were compared.
type routeKey struct{ a, b netip.Addr }

// sameRoute tells whether a and b leave by the same interface and next hop.
func (a *Agent) sameRoute(x, y netip.Addr) bool {
	k := routeKey{x, y}
	if v, ok := a.routeCache[k]; ok {
		return v
	}
	hop := func(d netip.Addr) (int, netip.Addr, bool) {
		rs, err := netlink.RouteGet(net.IP(d.AsSlice()))
		if err != nil || len(rs) != 1 {
			return 0, netip.Addr{}, false
		}
		gw, ok := netip.AddrFromSlice(rs[0].Gw)
		if !ok {
			gw = d // on link: the destination is its own next hop
		}
		return rs[0].LinkIndex, gw.Unmap(), true
	}
	li, gi, ok1 := hop(x)
	lj, gj, ok2 := hop(y)
	same := ok1 && ok2 && li == lj && gi == gj
	a.routeCache[k] = same
	return same
}

// settleReroutes decides the egress flows marked for re-routing that it has
// not decided yet (FL_ROUTED): it clears FL_REROUTE where the rewrite keeps
// the route. Called by the collector with the flows it saw.
func (a *Agent) settleReroutes(flows []datapath.FlowEntry) {
	for _, f := range flows {
		old := f.Key.Wire().Dst
		now := f.Out.Wire().Dst
		clear := uint32(0)
		if old == now || a.sameRoute(old, now) {
			clear = datapath.FlReroute
			a.rerouteCleared.Add(1)
		}
		_ = a.dp.SetFlowFlags(f.Key, datapath.FlRouted, clear)
	}
}

// routesChanged forgets what was decided: every egress flow that rewrites a
// destination goes back to re-routing until the collector decides again.
func (a *Agent) routesChanged() {
	a.routeCache = map[routeKey]bool{}
	var keys []datapath.Tuple
	_ = a.dp.EachFlow(func(k *datapath.Tuple, f *datapath.Flow) {
		if f.Flags&datapath.FlIngress == 0 && k.Daddr != f.Out.Daddr {
			keys = append(keys, *k)
		}
	})
	for _, k := range keys {
		_ = a.dp.SetFlowFlags(k, datapath.FlReroute, datapath.FlRouted)
	}
}
