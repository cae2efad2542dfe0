package lab

import (
	"fmt"
	"net/netip"
)

// Host is one host of a lab (or the star's router), with its namespace and
// addresses. The addresses are deterministic: they depend only on the
// topology's kind and the host's position in it.
//
// Star host i (1-based, in topology order) has eth0 with 10.200.i.2/24 and
// fd00:dc:0:i::2/64, and default routes via the router's 10.200.i.1 and
// fd00:dc:0:i::1 on its interface r-i. The IPv6 group is i written in decimal
// digits, so 10.200.12.2 goes with fd00:dc:0:12::2. A multihomed star host
// (HostSpec.Links 2) also has eth1 with 10.202.i.2/24 and fd00:dc:2:i::2/64,
// towards the router's s-i (10.202.i.1, fd00:dc:2:i::1), and second default
// routes through it with metric SecondLinkMetric: packets leave by eth0
// while it is up, and by eth1 once it is down. As on any multihomed host,
// packets from eth1's addresses leave by eth1 (a rule from each of them to
// table SecondLinkTable, whose default routes go through eth1): a session
// moved to that address (docs/mobility.md) uses the second link both ways.
//
// In a line of n hosts, link k (1 ≤ k < n) joins host k and host k+1 on
// 10.201.k.0/24 and fd00:dc:1:k::/64; host k has .1 (::1) there and host k+1
// has .2 (::2). Every host's eth0 faces the previous host, except the first
// host's, which faces the second; the intermediate hosts' eth1 faces the next
// host. The ends have default routes into the line; the intermediate hosts
// forward and have a route to every link that is not adjacent.
type Host struct {
	// Name is the host's name in the topology ("router" for the router).
	Name string `json:"name"`
	// Role is the host's role.
	Role Role `json:"role"`
	// Namespace is the name of the host's network namespace,
	// "<lab>-<host>"; `ip netns exec <Namespace> …` runs a program there.
	Namespace string `json:"namespace"`
	// Iface is the host's primary interface, "eth0" (for the router, its
	// interface towards the first host).
	Iface string `json:"iface"`
	// Addr4 and Addr6 are the addresses of Iface.
	Addr4 netip.Addr `json:"addr4"`
	Addr6 netip.Addr `json:"addr6"`
	// Gateway4 and Gateway6 are the next hops of the host's default routes;
	// zero if it has none (the router and the line's intermediate hosts).
	Gateway4 netip.Addr `json:"gateway4,omitzero"`
	Gateway6 netip.Addr `json:"gateway6,omitzero"`
	// Forwarding says whether the host forwards packets (ip_forward and IPv6
	// forwarding on): the router, middlebox hosts and the line's
	// intermediate hosts.
	Forwarding bool `json:"forwarding"`
	// Ifaces are all of the host's interfaces except lo, Iface first.
	Ifaces []Iface `json:"ifaces"`
	// Routes are the host's static routes, beyond the connected ones.
	Routes []Route `json:"routes,omitempty"`
	// Rules are the host's routing rules by source address.
	Rules []Rule `json:"rules,omitempty"`
	// SessionAddr4 and SessionAddr6 are the host's session addresses
	// (HostSpec.SessionAddr): 10.250.i.1/32 and fd00:dc:250:i::1/128 on
	// SessionIface, never on a link. Its default routes
	// in the main table name them as the source, so that applications use
	// them, and the router routes them to the host's first link (sessions
	// can be opened to them); zero when the host has none.
	SessionAddr4 netip.Addr `json:"session_addr4,omitzero"`
	SessionAddr6 netip.Addr `json:"session_addr6,omitzero"`
}

// SessionIface is the interface of a host's session addresses: its
// loopback.
const SessionIface = "lo"

// Rule sends the packets from From to the routing table Table.
type Rule struct {
	From  netip.Prefix `json:"from"`
	Table int          `json:"table"`
}

// Iface is one end of a veth link.
type Iface struct {
	// Name is the interface name in the host's namespace.
	Name string `json:"name"`
	// Addr4 and Addr6 are the interface's addresses with their subnets.
	Addr4 netip.Prefix `json:"addr4"`
	Addr6 netip.Prefix `json:"addr6"`
	// Peer and PeerIface name the host and interface at the other end.
	Peer      string `json:"peer"`
	PeerIface string `json:"peer_iface"`
}

// Route is a static route: Dst via the gateway Via, out of Iface. A Dst of
// length 0 is a default route. Metric 0 is the kernel's default; Table 0
// the main table.
type Route struct {
	Dst    netip.Prefix `json:"dst"`
	Via    netip.Addr   `json:"via"`
	Iface  string       `json:"iface"`
	Metric int          `json:"metric,omitempty"`
	Table  int          `json:"table,omitempty"`
	// Src is the route's preferred source address; zero: the kernel's
	// choice.
	Src netip.Addr `json:"src,omitzero"`
}

// SecondLinkTable is the routing table of the packets from a multihomed
// host's second-link addresses.
const SecondLinkTable = 202

// SecondLinkMetric is the metric of a multihomed host's default routes
// through its second link: above the kernel's defaults for the first
// (0 for IPv4, 1024 for IPv6).
const SecondLinkMetric = 2048

// link is a veth pair to create: A.AIface <-> B.BIface.
type link struct {
	A, AIface, B, BIface string
}

// layout is everything Up builds, computed before anything is touched.
type layout struct {
	hosts  []*Host // topology order
	router *Host   // nil for a line
	links  []link
}

// all returns every host, the router last.
func (ly *layout) all() []*Host {
	if ly.router == nil {
		return ly.hosts
	}
	return append(append([]*Host(nil), ly.hosts...), ly.router)
}

var (
	default4 = netip.MustParsePrefix("0.0.0.0/0")
	default6 = netip.MustParsePrefix("::/0")
)

// addr4 returns 10.<net>.<sub>.<host>.
func addr4(net, sub, host int) netip.Addr {
	return netip.AddrFrom4([4]byte{10, byte(net), byte(sub), byte(host)})
}

// addr6 returns fd00:dc:<net>:<sub>::<host>, with sub written in decimal
// digits so that it reads like the IPv4 subnet.
func addr6(net, sub, host int) netip.Addr {
	return netip.MustParseAddr(fmt.Sprintf("fd00:dc:%d:%d::%x", net, sub, host))
}

// Namespace returns the name of the network namespace of a host (or of the
// router) of the named lab: "<lab>-<host>".
func Namespace(lab, host string) string { return lab + "-" + host }

// plan computes the namespaces, links, addresses and routes of a lab. It is
// pure, so that the addressing is tested without root.
func plan(labName string, t Topology) (*layout, error) {
	if err := ValidateLabName(labName); err != nil {
		return nil, err
	}
	if err := t.Validate(); err != nil {
		return nil, err
	}
	t = t.withRoles()
	ly := &layout{}
	links := map[string]int{}
	sessAddr := map[string]bool{}
	for _, s := range t.Hosts {
		links[s.Name] = s.Links
		sessAddr[s.Name] = s.SessionAddr
		ly.hosts = append(ly.hosts, &Host{
			Name:       s.Name,
			Role:       s.Role,
			Namespace:  Namespace(labName, s.Name),
			Iface:      "eth0",
			Forwarding: s.Role == RoleMiddlebox,
		})
	}
	switch t.Kind {
	case KindStar:
		planStar(labName, ly, links, sessAddr)
	case KindLine:
		planLine(ly)
	}
	for _, h := range ly.all() {
		h.Addr4 = h.Ifaces[0].Addr4.Addr()
		h.Addr6 = h.Ifaces[0].Addr6.Addr()
	}
	return ly, nil
}

func planStar(labName string, ly *layout, links map[string]int, sessAddr map[string]bool) {
	r := &Host{
		Name:       routerName,
		Role:       RoleRouter,
		Namespace:  Namespace(labName, routerName),
		Iface:      "r-1",
		Forwarding: true,
	}
	ly.router = r
	const net4, net6 = 200, 0
	for i, h := range ly.hosts {
		sub := i + 1
		rif := fmt.Sprintf("r-%d", sub)
		gw4, gw6 := addr4(net4, sub, 1), addr6(net6, sub, 1)
		h.Ifaces = []Iface{{
			Name:      "eth0",
			Addr4:     netip.PrefixFrom(addr4(net4, sub, 2), 24),
			Addr6:     netip.PrefixFrom(addr6(net6, sub, 2), 64),
			Peer:      routerName,
			PeerIface: rif,
		}}
		h.Gateway4, h.Gateway6 = gw4, gw6
		if sessAddr[h.Name] {
			// The router reaches the session addresses through the
			// host's first link (their "home"): a session can be
			// opened to them.
			h.SessionAddr4, h.SessionAddr6 = addr4(250, sub, 1), addr6(250, sub, 1)
			r.Routes = append(r.Routes,
				Route{Dst: netip.PrefixFrom(h.SessionAddr4, 32), Via: addr4(net4, sub, 2), Iface: rif},
				Route{Dst: netip.PrefixFrom(h.SessionAddr6, 128), Via: addr6(net6, sub, 2), Iface: rif})
		}
		h.Routes = []Route{
			{Dst: default4, Via: gw4, Iface: "eth0", Src: h.SessionAddr4},
			{Dst: default6, Via: gw6, Iface: "eth0", Src: h.SessionAddr6},
		}
		r.Ifaces = append(r.Ifaces, Iface{
			Name:      rif,
			Addr4:     netip.PrefixFrom(gw4, 24),
			Addr6:     netip.PrefixFrom(gw6, 64),
			Peer:      h.Name,
			PeerIface: "eth0",
		})
		ly.links = append(ly.links, link{A: h.Name, AIface: "eth0", B: routerName, BIface: rif})
		if links[h.Name] != 2 {
			continue
		}
		const net4b, net6b = 202, 2
		sif := fmt.Sprintf("s-%d", sub)
		gw4b, gw6b := addr4(net4b, sub, 1), addr6(net6b, sub, 1)
		h.Ifaces = append(h.Ifaces, Iface{
			Name:      "eth1",
			Addr4:     netip.PrefixFrom(addr4(net4b, sub, 2), 24),
			Addr6:     netip.PrefixFrom(addr6(net6b, sub, 2), 64),
			Peer:      routerName,
			PeerIface: sif,
		})
		h.Routes = append(h.Routes,
			Route{Dst: default4, Via: gw4b, Iface: "eth1", Metric: SecondLinkMetric, Src: h.SessionAddr4},
			Route{Dst: default6, Via: gw6b, Iface: "eth1", Metric: SecondLinkMetric, Src: h.SessionAddr6},
			Route{Dst: default4, Via: gw4b, Iface: "eth1", Table: SecondLinkTable},
			Route{Dst: default6, Via: gw6b, Iface: "eth1", Table: SecondLinkTable})
		h.Rules = []Rule{
			{From: netip.PrefixFrom(addr4(net4b, sub, 2), 32), Table: SecondLinkTable},
			{From: netip.PrefixFrom(addr6(net6b, sub, 2), 128), Table: SecondLinkTable},
		}
		r.Ifaces = append(r.Ifaces, Iface{
			Name:      sif,
			Addr4:     netip.PrefixFrom(gw4b, 24),
			Addr6:     netip.PrefixFrom(gw6b, 64),
			Peer:      h.Name,
			PeerIface: "eth1",
		})
		ly.links = append(ly.links, link{A: h.Name, AIface: "eth1", B: routerName, BIface: sif})
	}
}

func planLine(ly *layout) {
	const net4, net6 = 201, 1
	n := len(ly.hosts)
	// rightIf is host k's interface towards host k+1 (0-based k).
	rightIf := func(k int) string {
		if k == 0 {
			return "eth0"
		}
		return "eth1"
	}
	for k := 0; k < n-1; k++ {
		sub := k + 1
		left, right := ly.hosts[k], ly.hosts[k+1]
		left.Ifaces = append(left.Ifaces, Iface{
			Name:      rightIf(k),
			Addr4:     netip.PrefixFrom(addr4(net4, sub, 1), 24),
			Addr6:     netip.PrefixFrom(addr6(net6, sub, 1), 64),
			Peer:      right.Name,
			PeerIface: "eth0",
		})
		// The right host's eth0 goes first: appended before its eth1.
		right.Ifaces = append(right.Ifaces, Iface{
			Name:      "eth0",
			Addr4:     netip.PrefixFrom(addr4(net4, sub, 2), 24),
			Addr6:     netip.PrefixFrom(addr6(net6, sub, 2), 64),
			Peer:      left.Name,
			PeerIface: rightIf(k),
		})
		ly.links = append(ly.links, link{A: left.Name, AIface: rightIf(k), B: right.Name, BIface: "eth0"})
	}
	for k, h := range ly.hosts {
		switch {
		case k == 0:
			h.Gateway4, h.Gateway6 = addr4(net4, 1, 2), addr6(net6, 1, 2)
		case k == n-1:
			h.Gateway4, h.Gateway6 = addr4(net4, n-1, 1), addr6(net6, n-1, 1)
		default:
			h.Forwarding = true
			// Links 1..k-1 (1-based) lie to the left, via host k-1's
			// address on link k; links k+2..n-1 to the right, via host
			// k+1's address on link k+1. Links k and k+1 are connected.
			for sub := 1; sub < k; sub++ {
				h.Routes = append(h.Routes,
					Route{Dst: netip.PrefixFrom(addr4(net4, sub, 0), 24), Via: addr4(net4, k, 1), Iface: "eth0"},
					Route{Dst: netip.PrefixFrom(addr6(net6, sub, 0), 64), Via: addr6(net6, k, 1), Iface: "eth0"})
			}
			for sub := k + 2; sub < n; sub++ {
				h.Routes = append(h.Routes,
					Route{Dst: netip.PrefixFrom(addr4(net4, sub, 0), 24), Via: addr4(net4, k+1, 2), Iface: "eth1"},
					Route{Dst: netip.PrefixFrom(addr6(net6, sub, 0), 64), Via: addr6(net6, k+1, 2), Iface: "eth1"})
			}
			continue
		}
		h.Routes = []Route{
			{Dst: default4, Via: h.Gateway4, Iface: "eth0"},
			{Dst: default6, Via: h.Gateway6, Iface: "eth0"},
		}
	}
}
