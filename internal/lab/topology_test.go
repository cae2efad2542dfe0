package lab

import (
	"net/netip"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
)

func TestInferRole(t *testing.T) {
	for name, want := range map[string]Role{
		"mb1": RoleMiddlebox, "mb": RoleMiddlebox, "client": RoleClient, "client7": RoleClient,
		"server2": RoleServer, "web": RoleHost, "proxy": RoleHost,
	} {
		if got := InferRole(name); got != want {
			t.Errorf("InferRole(%q) = %q, want %q", name, got, want)
		}
	}
}

func TestValidate(t *testing.T) {
	for _, tc := range []struct {
		lab  string
		topo Topology
		want string // substring of the error; empty for none
	}{
		{"demo", Star("client", "server"), ""},
		{"a1234567", Line("a", "b"), ""},
		{"Demo", Star("a"), "lab name"},
		{"a12345678", Star("a"), "lab name"},
		{"1lab", Star("a"), "lab name"},
		{"my-lab", Star("a"), "lab name"},
		{"demo", Star("client", "client"), "appears twice"},
		{"demo", Star("router"), "reserved"},
		{"demo", Star("Client"), "host name"},
		{"demo", Star("a12345678901"), "host name"},
		{"demo", Star("a-b"), "host name"},
		{"demo", Line("a"), "needs 2"},
		{"demo", Star(), "needs 1"},
		{"demo", Topology{Hosts: []HostSpec{{Name: "a"}}}, "no \"kind\""},
		{"demo", Topology{Kind: "ring", Hosts: []HostSpec{{Name: "a"}}}, "unknown"},
		{"demo", Topology{Kind: KindStar, Hosts: []HostSpec{{Name: "a", Role: "router"}}}, "role"},
	} {
		_, err := plan(tc.lab, tc.topo)
		switch {
		case tc.want == "" && err != nil:
			t.Errorf("plan(%q, %v): %v", tc.lab, tc.topo, err)
		case tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)):
			t.Errorf("plan(%q, %v) = %v, want an error about %q", tc.lab, tc.topo, err, tc.want)
		}
	}
}

func TestPlanStar(t *testing.T) {
	ly, err := plan("x", Fig11())
	if err != nil {
		t.Fatal(err)
	}
	if len(ly.hosts) != 10 || ly.router == nil || len(ly.links) != 10 {
		t.Fatalf("fig11: %d hosts, router %v, %d links", len(ly.hosts), ly.router, len(ly.links))
	}
	mb2 := ly.hosts[9]
	want := &Host{
		Name: "mb2", Role: RoleMiddlebox, Namespace: "x-mb2", Iface: "eth0",
		Addr4:    netip.MustParseAddr("10.200.10.2"),
		Addr6:    netip.MustParseAddr("fd00:dc:0:10::2"),
		Gateway4: netip.MustParseAddr("10.200.10.1"),
		Gateway6: netip.MustParseAddr("fd00:dc:0:10::1"),
		// Forwarding because it is a middlebox host.
		Forwarding: true,
		Ifaces: []Iface{{
			Name:      "eth0",
			Addr4:     netip.MustParsePrefix("10.200.10.2/24"),
			Addr6:     netip.MustParsePrefix("fd00:dc:0:10::2/64"),
			Peer:      "router",
			PeerIface: "r-10",
		}},
		Routes: []Route{
			{Dst: netip.MustParsePrefix("0.0.0.0/0"), Via: netip.MustParseAddr("10.200.10.1"), Iface: "eth0"},
			{Dst: netip.MustParsePrefix("::/0"), Via: netip.MustParseAddr("fd00:dc:0:10::1"), Iface: "eth0"},
		},
	}
	if !reflect.DeepEqual(mb2, want) {
		t.Errorf("mb2 =\n%+v\nwant\n%+v", mb2, want)
	}
	if c := ly.hosts[0]; c.Forwarding || c.Role != RoleClient || c.Addr4 != netip.MustParseAddr("10.200.1.2") {
		t.Errorf("client1 = %+v", c)
	}
	r := ly.router
	if r.Namespace != "x-router" || !r.Forwarding || len(r.Ifaces) != 10 || len(r.Routes) != 0 ||
		r.Ifaces[9].Name != "r-10" || r.Ifaces[9].Addr4 != netip.MustParsePrefix("10.200.10.1/24") {
		t.Errorf("router = %+v", r)
	}
}

func TestPlanLine(t *testing.T) {
	ly, err := plan("x", Line(DefaultLineHosts...))
	if err != nil {
		t.Fatal(err)
	}
	if ly.router != nil || len(ly.links) != 3 {
		t.Fatalf("line: router %v, %d links", ly.router, len(ly.links))
	}
	type ifc struct{ name, addr4, peer string }
	type rt struct{ dst, via, dev string }
	for i, want := range []struct {
		fwd    bool
		ifaces []ifc
		routes []rt
	}{
		{false, []ifc{{"eth0", "10.201.1.1/24", "mb1"}},
			[]rt{{"0.0.0.0/0", "10.201.1.2", "eth0"}, {"::/0", "fd00:dc:1:1::2", "eth0"}}},
		{true, []ifc{{"eth0", "10.201.1.2/24", "client"}, {"eth1", "10.201.2.1/24", "mb2"}},
			[]rt{{"10.201.3.0/24", "10.201.2.2", "eth1"}, {"fd00:dc:1:3::/64", "fd00:dc:1:2::2", "eth1"}}},
		{true, []ifc{{"eth0", "10.201.2.2/24", "mb1"}, {"eth1", "10.201.3.1/24", "server"}},
			[]rt{{"10.201.1.0/24", "10.201.2.1", "eth0"}, {"fd00:dc:1:1::/64", "fd00:dc:1:2::1", "eth0"}}},
		{false, []ifc{{"eth0", "10.201.3.2/24", "mb2"}},
			[]rt{{"0.0.0.0/0", "10.201.3.1", "eth0"}, {"::/0", "fd00:dc:1:3::1", "eth0"}}},
	} {
		h := ly.hosts[i]
		var ifaces []ifc
		for _, f := range h.Ifaces {
			ifaces = append(ifaces, ifc{f.Name, f.Addr4.String(), f.Peer})
		}
		var routes []rt
		for _, r := range h.Routes {
			routes = append(routes, rt{r.Dst.String(), r.Via.String(), r.Iface})
		}
		if h.Forwarding != want.fwd || !reflect.DeepEqual(ifaces, want.ifaces) || !reflect.DeepEqual(routes, want.routes) {
			t.Errorf("%s: forwarding %v, ifaces %v, routes %v\nwant forwarding %v, ifaces %v, routes %v",
				h.Name, h.Forwarding, ifaces, routes, want.fwd, want.ifaces, want.routes)
		}
		if h.Addr4 != h.Ifaces[0].Addr4.Addr() || h.Iface != "eth0" {
			t.Errorf("%s: primary %s %s", h.Name, h.Iface, h.Addr4)
		}
	}
}

func TestBuiltin(t *testing.T) {
	if _, err := Builtin("star", nil); err == nil {
		t.Error("star without hosts: no error")
	}
	if _, err := Builtin("fig11", []string{"a"}); err == nil {
		t.Error("fig11 with hosts: no error")
	}
	if _, err := Builtin("mesh", nil); err == nil || !strings.Contains(err.Error(), "fig11") {
		t.Errorf("unknown topology: %v", err)
	}
	line, err := Builtin("line", nil)
	if err != nil || len(line.Hosts) != 4 || line.Hosts[1] != (HostSpec{Name: "mb1", Role: RoleMiddlebox}) {
		t.Errorf("line = %+v, %v", line, err)
	}
}

// The files under topologies/ parse, and the built-in ones say the same as
// the Go code, so that the two cannot drift apart.
func TestTopologyFiles(t *testing.T) {
	files, err := filepath.Glob("../../topologies/*.json")
	if err != nil || len(files) == 0 {
		t.Fatalf("no topology files: %v", err)
	}
	for _, f := range files {
		if _, err := LoadTopology(f); err != nil {
			t.Error(err)
		}
	}
	for file, want := range map[string]Topology{"fig11.json": Fig11(), "line.json": Line(DefaultLineHosts...)} {
		got, err := LoadTopology(filepath.Join("../../topologies", file))
		if err != nil {
			t.Fatal(err)
		}
		if !reflect.DeepEqual(got.withRoles(), want.withRoles()) {
			t.Errorf("%s = %+v, built in: %+v", file, got, want)
		}
	}
	if _, err := ParseTopology([]byte(`{"kind": "star", "hosts": [{"name": "a", "rol": "client"}]}`)); err == nil {
		t.Error("unknown field: no error")
	}
}

// TestParseHosts: a host list takes NAME (role from the name) or NAME=ROLE,
// with the short role names mb and plain; an unknown or missing role is an
// error naming the host and the roles there are.
func TestParseHosts(t *testing.T) {
	got, err := ParseHosts([]string{"client", "fw=mb", "ids=middlebox", "web", "mbx=plain", "a=server", "b=client", "c=host", "mb3"})
	if err != nil {
		t.Fatal(err)
	}
	want := []HostSpec{
		{Name: "client", Role: RoleClient}, {Name: "fw", Role: RoleMiddlebox}, {Name: "ids", Role: RoleMiddlebox}, {Name: "web", Role: RoleHost},
		{Name: "mbx", Role: RoleHost}, {Name: "a", Role: RoleServer}, {Name: "b", Role: RoleClient}, {Name: "c", Role: RoleHost}, {Name: "mb3", Role: RoleMiddlebox},
	}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("ParseHosts = %v, want %v", got, want)
	}
	for in, msg := range map[string]string{
		"fw=firewall": `host "fw": role "firewall" is unknown: use client, server, middlebox (or mb) or host (or plain)`,
		"fw=":         `host "fw": role "" is unknown`,
		"fw=router":   `host "fw": role "router" is unknown`,
		"fw=MB":       `host "fw": role "MB" is unknown`,
		"=mb":         `host "=mb": no name before the role`,
		"client:3":    `host "client:3": "3" links: a host has 1 or 2`,
		"client:":     `host "client:": "" links`,
	} {
		if _, err := ParseHosts([]string{"client", in}); err == nil || !strings.Contains(err.Error(), msg) {
			t.Errorf("ParseHosts(%q) = %v, want an error containing %q", in, err, msg)
		}
	}
}

// A multihomed star host: NAME:2 (with or without a role) gives it eth1 on
// 10.202.i.0/24 towards the router's s-i, and default routes through it
// behind eth0's; a line refuses it.
func TestPlanSecondLink(t *testing.T) {
	hs, err := ParseHosts([]string{"client:2", "mb1", "srv=server:2"})
	if err != nil || hs[0].Links != 2 || hs[1].Links != 0 || hs[2] != (HostSpec{Name: "srv", Role: RoleServer, Links: 2}) {
		t.Fatalf("ParseHosts = %+v, %v", hs, err)
	}
	ly, err := plan("x", Topology{Kind: KindStar, Hosts: hs})
	if err != nil {
		t.Fatal(err)
	}
	if len(ly.links) != 5 {
		t.Errorf("%d links, want 5", len(ly.links))
	}
	c := ly.hosts[0]
	wantIf := Iface{Name: "eth1", Addr4: netip.MustParsePrefix("10.202.1.2/24"), Addr6: netip.MustParsePrefix("fd00:dc:2:1::2/64"), Peer: "router", PeerIface: "s-1"}
	if len(c.Ifaces) != 2 || c.Ifaces[1] != wantIf || c.Addr4 != netip.MustParseAddr("10.200.1.2") {
		t.Errorf("client's interfaces %+v", c.Ifaces)
	}
	wantRt := []Route{
		{Dst: netip.MustParsePrefix("0.0.0.0/0"), Via: netip.MustParseAddr("10.202.1.1"), Iface: "eth1", Metric: SecondLinkMetric},
		{Dst: netip.MustParsePrefix("::/0"), Via: netip.MustParseAddr("fd00:dc:2:1::1"), Iface: "eth1", Metric: SecondLinkMetric},
	}
	if len(c.Routes) != 6 || !reflect.DeepEqual(c.Routes[2:4], wantRt) || c.Routes[0].Metric != 0 || c.Routes[4].Table != SecondLinkTable {
		t.Errorf("client's routes %+v", c.Routes)
	}
	if len(c.Rules) != 2 || c.Rules[1] != (Rule{From: netip.MustParsePrefix("fd00:dc:2:1::2/128"), Table: SecondLinkTable}) {
		t.Errorf("client's rules %+v", c.Rules)
	}
	if len(ly.hosts[1].Ifaces) != 1 {
		t.Errorf("mb1 has %d interfaces", len(ly.hosts[1].Ifaces))
	}
	if r := ly.router; len(r.Ifaces) != 5 || r.Ifaces[1].Name != "s-1" || r.Ifaces[1].Addr4 != netip.MustParsePrefix("10.202.1.1/24") || r.Ifaces[4].Name != "s-3" {
		t.Errorf("router's interfaces %+v", r.Ifaces)
	}
	if _, err := plan("x", Topology{Kind: KindLine, Hosts: []HostSpec{{Name: "a", Links: 2}, {Name: "b"}}}); err == nil || !strings.Contains(err.Error(), "only a star") {
		t.Errorf("a line with a second link: %v", err)
	}
}

// TestBuiltinRoles: the built-in star and line take explicit roles, which
// decide forwarding and the tap as an inferred role does; a bad role fails
// before anything is planned.
func TestBuiltinRoles(t *testing.T) {
	for _, kind := range []string{"star", "line"} {
		topo, err := Builtin(kind, []string{"client", "fw=mb", "mb1=host", "server"})
		if err != nil {
			t.Fatalf("%s: %v", kind, err)
		}
		ly, err := plan("x", topo)
		if err != nil {
			t.Fatalf("%s: %v", kind, err)
		}
		roles := map[string]Role{}
		for _, h := range ly.hosts {
			roles[h.Name] = h.Role
		}
		if want := map[string]Role{"client": RoleClient, "fw": RoleMiddlebox, "mb1": RoleHost, "server": RoleServer}; !reflect.DeepEqual(roles, want) {
			t.Errorf("%s: roles %v, want %v", kind, roles, want)
		}
		if kind == "star" {
			for _, h := range ly.hosts {
				if h.Forwarding != (h.Name == "fw") {
					t.Errorf("star host %s (%s): forwarding %v", h.Name, h.Role, h.Forwarding)
				}
			}
		}
	}
	if _, err := Builtin("star", []string{"client", "ids=firewall"}); err == nil || !strings.Contains(err.Error(), `host "ids": role "firewall" is unknown`) {
		t.Errorf("Builtin with an unknown role: %v", err)
	}
}

// TestTopologyFileRoles: a topology file takes the same role names; "mb"
// and "plain" become middlebox and host, an unknown role is an error.
func TestTopologyFileRoles(t *testing.T) {
	topo, err := ParseTopology([]byte(`{"kind": "star", "hosts": [{"name": "client"}, {"name": "fw", "role": "mb"}, {"name": "mb2", "role": "plain"}, {"name": "server"}]}`))
	if err != nil {
		t.Fatal(err)
	}
	ly, err := plan("x", topo)
	if err != nil {
		t.Fatal(err)
	}
	if got := []Role{ly.hosts[1].Role, ly.hosts[2].Role}; !reflect.DeepEqual(got, []Role{RoleMiddlebox, RoleHost}) || !ly.hosts[1].Forwarding || ly.hosts[2].Forwarding {
		t.Errorf("fw and mb2: roles %v, forwarding %v %v; want middlebox (forwarding) and host", got, ly.hosts[1].Forwarding, ly.hosts[2].Forwarding)
	}
	if _, err := ParseTopology([]byte(`{"kind": "star", "hosts": [{"name": "ids", "role": "firewall"}]}`)); err == nil || !strings.Contains(err.Error(), `host "ids": role "firewall" is unknown`) {
		t.Errorf("unknown role in a file: %v", err)
	}
}

// TestPlanSessionAddr: a star host with a session address gets 10.250.i.1
// and fd00:dc:250:i::1 (on lo), and its main table's default routes name
// them as their source; other hosts get none, and a line refuses them.
func TestPlanSessionAddr(t *testing.T) {
	hs, err := ParseHosts([]string{"client:2+session", "mb1", "srv=server+session"})
	if err != nil || !hs[0].SessionAddr || hs[0].Links != 2 || hs[1].SessionAddr || hs[2] != (HostSpec{Name: "srv", Role: RoleServer, SessionAddr: true}) {
		t.Fatalf("ParseHosts = %+v, %v", hs, err)
	}
	ly, err := plan("x", Topology{Kind: KindStar, Hosts: hs})
	if err != nil {
		t.Fatal(err)
	}
	c := ly.hosts[0]
	s4, s6 := netip.MustParseAddr("10.250.1.1"), netip.MustParseAddr("fd00:dc:250:1::1")
	if c.SessionAddr4 != s4 || c.SessionAddr6 != s6 {
		t.Fatalf("client's session addresses %s %s", c.SessionAddr4, c.SessionAddr6)
	}
	for _, r := range c.Routes {
		want := netip.Addr{}
		if r.Table == 0 {
			want = s4
			if r.Dst.Addr().Is6() {
				want = s6
			}
		}
		if r.Src != want {
			t.Errorf("route %+v: source %s, want %s", r, r.Src, want)
		}
	}
	if h := ly.hosts[1]; h.SessionAddr4.IsValid() || h.Routes[0].Src.IsValid() {
		t.Errorf("mb1 has a session address: %+v", h)
	}
	wantRt := []Route{
		{Dst: netip.PrefixFrom(s4, 32), Via: netip.MustParseAddr("10.200.1.2"), Iface: "r-1"},
		{Dst: netip.PrefixFrom(s6, 128), Via: netip.MustParseAddr("fd00:dc:0:1::2"), Iface: "r-1"},
		{Dst: netip.MustParsePrefix("10.250.3.1/32"), Via: netip.MustParseAddr("10.200.3.2"), Iface: "r-3"},
		{Dst: netip.MustParsePrefix("fd00:dc:250:3::1/128"), Via: netip.MustParseAddr("fd00:dc:0:3::2"), Iface: "r-3"},
	}
	if !reflect.DeepEqual(ly.router.Routes, wantRt) {
		t.Errorf("the router's routes to session addresses: %+v", ly.router.Routes)
	}
	if _, err := plan("x", Topology{Kind: KindLine, Hosts: []HostSpec{{Name: "a", SessionAddr: true}, {Name: "b"}}}); err == nil || !strings.Contains(err.Error(), "only a star") {
		t.Errorf("a line with a session address: %v", err)
	}
}
