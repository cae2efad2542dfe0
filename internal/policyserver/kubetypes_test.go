package policyserver

import (
	"errors"
	"net/netip"
	"reflect"
	"strings"
	"testing"

	"github.com/dysco/dysco/internal/api"
)

func TestKubePolicyTranslation(t *testing.T) {
	nodes := []kubeNode{{"edge-b", map[string]string{"role": "edge"}}, {"core-a", map[string]string{"role": "core"}}, {"edge-a", map[string]string{"role": "edge", "zone": "z1"}}}
	p := api.Policy{Name: "web", Filter: "tcp dst port 80", Chain: []api.Hop{{Addr: netip.MustParseAddr("10.0.2.2")}, {Type: "fw"}},
		EndBeforeDestination: true, Priority: 5, Hosts: []string{"n1", "n2"}, IdleTimeoutS: 60,
		Via: []netip.Addr{netip.MustParseAddr("10.0.1.5"), netip.MustParseAddr("fd00::5")}}
	got, err := policyFromKube("web", policyToKube(p), nodes)
	if err != nil || !reflect.DeepEqual(got, p) {
		t.Fatalf("round trip: %+v %v, want %+v", got, err, p)
	}
	sel := kubePolicySpec{Filter: "tcp", NodeSelector: &kubeLabelMatcher{MatchLabels: map[string]string{"role": "edge"}}}
	got, err = policyFromKube("edges", sel, nodes)
	if err != nil || !reflect.DeepEqual(got.Hosts, []string{"edge-a", "edge-b"}) {
		t.Fatalf("selector: %v %v", got.Hosts, err)
	}
	sel.NodeSelector.MatchLabels["zone"] = "z9"
	if _, err := policyFromKube("none", sel, nodes); !errors.Is(err, errNoNode) {
		t.Fatalf("a selector matching no node: %v", err)
	}
	for _, tc := range []struct {
		spec kubePolicySpec
		want string
	}{
		{kubePolicySpec{Filter: ""}, "empty filter"},
		{kubePolicySpec{Filter: "tcp", Chain: []kubeHop{{Addr: "10.0.0.1", Type: "fw"}}}, "both an address and a type"},
		{kubePolicySpec{Filter: "tcp", Chain: []kubeHop{{Addr: "10.0.0.300"}}}, "hop 1"},
		{kubePolicySpec{Filter: "tcp", Chain: []kubeHop{{Addr: "127.0.0.1"}}}, "not a unicast address"},
		{kubePolicySpec{Filter: "tcp", EndBeforeDestination: true}, "needs a chain"},
		{kubePolicySpec{Filter: "tcp", Via: []string{"eth1"}}, "via"},
		{kubePolicySpec{Filter: "tcp", Via: []string{"224.0.0.1"}}, "not a unicast address"},
	} {
		if _, err := policyFromKube("bad", tc.spec, nil); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%+v: %v, want %q", tc.spec, err, tc.want)
		}
	}
}

func TestKubeTypeTranslation(t *testing.T) {
	pods := []kubePod{
		{"sec", map[string]string{"app": "ids"}, []netip.Addr{netip.MustParseAddr("10.1.0.5"), netip.MustParseAddr("fd00::5")}, true},
		{"sec", map[string]string{"app": "ids"}, []netip.Addr{netip.MustParseAddr("10.1.0.6")}, false}, // not ready
		{"other", map[string]string{"app": "ids"}, []netip.Addr{netip.MustParseAddr("10.1.0.7")}, true},
		{"sec", map[string]string{"app": "web"}, []netip.Addr{netip.MustParseAddr("10.1.0.8")}, true},
	}
	spec := kubeTypeSpec{Instances: []string{"10.0.2.2", "10.1.0.5"}, PodSelector: &kubeLabelMatcher{MatchLabels: map[string]string{"app": "ids"}}, PodNamespace: "sec"}
	got, err := typeFromKube("ids", spec, pods)
	want := []netip.Addr{netip.MustParseAddr("10.0.2.2"), netip.MustParseAddr("10.1.0.5"), netip.MustParseAddr("fd00::5")}
	if err != nil || !reflect.DeepEqual(got.Instances, want) {
		t.Fatalf("instances %v %v, want %v", got.Instances, err, want)
	}
	typ := api.MiddleboxType{Name: "fw", Instances: []netip.Addr{netip.MustParseAddr("10.0.2.2")}}
	if got, err := typeFromKube("fw", typeToKube(typ), nil); err != nil || !reflect.DeepEqual(got, typ) {
		t.Fatalf("round trip: %+v %v", got, err)
	}
	if _, err := typeFromKube("idle", kubeTypeSpec{PodSelector: &kubeLabelMatcher{MatchLabels: map[string]string{"app": "none"}}, PodNamespace: "sec"}, pods); !errors.Is(err, errNoInstance) {
		t.Fatalf("a type with no ready pod: %v", err)
	}
	if _, err := typeFromKube("bad", kubeTypeSpec{Instances: []string{"fw.example"}}, nil); err == nil {
		t.Fatal("a name as an instance was accepted")
	}
}

func TestObjectName(t *testing.T) {
	for in, want := range map[string]string{"node-a": "node-a", "h1": "h1"} {
		if got := objectName(in); got != want {
			t.Errorf("objectName(%q) = %q, want %q", in, got, want)
		}
	}
	seen := map[string]string{}
	for _, in := range []string{"Node-A", "node_a", "node.a", "node-a.", strings.Repeat("x", 80), strings.Repeat("x", 81), "ÄÖ"} {
		got := objectName(in)
		if len(got) > 51 || strings.Trim(got, "abcdefghijklmnopqrstuvwxyz0123456789-") != "" || strings.HasPrefix(got, "-") {
			t.Errorf("objectName(%q) = %q: not a valid part of an object name", in, got)
		}
		if other, ok := seen[got]; ok {
			t.Errorf("objectName(%q) = objectName(%q) = %q", in, other, got)
		}
		seen[got] = in
	}
}
