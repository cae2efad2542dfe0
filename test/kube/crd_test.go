package kube

import (
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// TestCRDs: the custom resources of deploy/crds installed in a real API
// server; valid objects are accepted, and the schema and its CEL rules
// refuse what the policy servers would refuse, with the reason.
func TestCRDs(t *testing.T) {
	kc := apiServer(t)
	crds := filepath.Join("..", "..", "deploy", "crds")
	if out, err := kubectl(t, kc, "apply", "--server-side", "-k", crds); err != nil {
		t.Fatalf("installing the CRDs: %v\n%s", err, out)
	}
	if out, err := kubectl(t, kc, "wait", "--for=condition=Established", "--timeout=30s", "crd/policies.dysco.io", "crd/middleboxtypes.dysco.io", "crd/operations.dysco.io"); err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	apply := func(t *testing.T, doc string) (string, error) {
		t.Helper()
		cmd := exec.Command("kubectl", "--kubeconfig", kc, "apply", "-f", "-")
		cmd.Stdin = strings.NewReader(doc)
		out, err := cmd.CombinedOutput()
		return string(out), err
	}
	policy := func(name, spec string) string {
		return "apiVersion: dysco.io/v1alpha1\nkind: Policy\nmetadata:\n  name: " + name + "\nspec:\n" + spec
	}
	for _, tc := range []struct {
		name, doc, want string // want: "" to be accepted, else a part of the refusal
	}{
		{"policy", policy("web", "  filter: tcp dst port 80\n  chain: [{addr: 10.0.2.2}, {type: fw}]\n  priority: 10\n  nodes: [node-a]\n"), ""},
		{"policy, no chain", policy("plain", "  filter: tcp\n"), ""},
		{"policy, IPv6 hop", policy("v6", "  filter: tcp\n  chain: [{addr: 'fd00::2'}]\n  idleTimeoutSeconds: 60\n"), ""},
		{"no filter", policy("nofilter", "  chain: [{addr: 10.0.2.2}]\n"), "spec.filter: Required value"},
		{"blank filter", policy("blank", "  filter: '  '\n"), "use \"tcp\" to match every TCP session"},
		{"eight hops", policy("long", "  filter: tcp\n  chain: [{addr: 10.0.0.1}, {addr: 10.0.0.2}, {addr: 10.0.0.3}, {addr: 10.0.0.4}, {addr: 10.0.0.5}, {addr: 10.0.0.6}, {addr: 10.0.0.7}, {addr: 10.0.0.8}]\n"), "Too many: 8: must have at most 7 items"},
		{"not an address", policy("badip", "  filter: tcp\n  chain: [{addr: 10.0.2.300}]\n"), "a hop's address is a unicast IPv4 or IPv6 address"},
		{"loopback hop", policy("lo", "  filter: tcp\n  chain: [{addr: 127.0.0.1}]\n"), "a hop's address is a unicast"},
		{"multicast hop", policy("mc", "  filter: tcp\n  chain: [{addr: 224.0.0.5}]\n"), "a hop's address is a unicast"},
		{"hop twice", policy("loop", "  filter: tcp\n  chain: [{addr: 10.0.2.2}, {addr: 10.0.2.3}, {addr: 10.0.2.2}]\n"), "the chain would loop"},
		{"address and type", policy("both", "  filter: tcp\n  chain: [{addr: 10.0.2.2, type: fw}]\n"), "not both or neither"},
		{"empty hop", policy("neither", "  filter: tcp\n  chain: [{}]\n"), "not both or neither"},
		{"end before destination, no chain", policy("ebd", "  filter: tcp\n  endBeforeDestination: true\n"), "endBeforeDestination needs a chain"},
		{"nodes and selector", policy("sel", "  filter: tcp\n  nodes: [a]\n  nodeSelector: {matchLabels: {role: edge}}\n"), "give nodes or nodeSelector, not both"},
		{"idle too long", policy("idle", "  filter: udp\n  idleTimeoutSeconds: 70000\n"), "should be less than or equal to 64800"},
		{"policy, via", policy("multi", "  filter: tcp\n  nodes: [node-a]\n  via: [10.0.1.2, 10.0.2.2, 10.0.2.2, 'fd00::2']\n"), ""},
		{"via not an address", policy("badvia", "  filter: tcp\n  via: [eth1]\n"), "a via address is a unicast"},
		{"nine via of a family", policy("manyvia", "  filter: tcp\n  via: [10.0.0.1, 10.0.0.1, 10.0.0.1, 10.0.0.1, 10.0.0.1, 10.0.0.1, 10.0.0.1, 10.0.0.1, 10.0.0.2]\n"), "at most 8 via addresses of each family"},
		{"name with a dot first", policy("9lives", "  filter: tcp\n"), "a policy's name starts with a letter"},
		{"type", "apiVersion: dysco.io/v1alpha1\nkind: MiddleboxType\nmetadata:\n  name: fw\nspec:\n  instances: [10.0.2.2, 10.0.2.3]\n", ""},
		{"type by pods", "apiVersion: dysco.io/v1alpha1\nkind: MiddleboxType\nmetadata:\n  name: ids\nspec:\n  podSelector: {matchLabels: {app: ids}}\n  podNamespace: security\n", ""},
		{"type, nothing", "apiVersion: dysco.io/v1alpha1\nkind: MiddleboxType\nmetadata:\n  name: empty\nspec: {}\n", "give instances, a podSelector, or both"},
		{"type, selector without namespace", "apiVersion: dysco.io/v1alpha1\nkind: MiddleboxType\nmetadata:\n  name: nons\nspec:\n  podSelector: {matchLabels: {app: ids}}\n", "needs the podNamespace"},
		{"type, bad instance", "apiVersion: dysco.io/v1alpha1\nkind: MiddleboxType\nmetadata:\n  name: bad\nspec:\n  instances: [fw.example]\n", "an instance is a unicast"},
		{"operation", "apiVersion: dysco.io/v1alpha1\nkind: Operation\nmetadata:\n  name: op1\nspec:\n  host: mb1\n  middlebox: {match: tcp, timeout_ms: 2000}\n", ""},
		{"operation, two requests", "apiVersion: dysco.io/v1alpha1\nkind: Operation\nmetadata:\n  name: op2\nspec:\n  host: mb1\n  middlebox: {match: tcp}\n  query: {what: sessions}\n", "give exactly one of reconfig, middlebox and query"},
		{"operation, bad anchor", "apiVersion: dysco.io/v1alpha1\nkind: Operation\nmetadata:\n  name: op3\nspec:\n  host: client\n  reconfig: {match: tcp, to: server}\n", "the right anchor is an IPv4 or IPv6 address"},
		{"operation, unknown query", "apiVersion: dysco.io/v1alpha1\nkind: Operation\nmetadata:\n  name: op4\nspec:\n  host: mb1\n  query: {what: keys}\n", "Unsupported value: \"keys\""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			out, err := apply(t, tc.doc)
			switch {
			case tc.want == "" && err != nil:
				t.Fatalf("refused: %v\n%s", err, out)
			case tc.want != "" && err == nil:
				t.Fatalf("accepted, want a refusal with %q:\n%s", tc.want, out)
			case tc.want != "" && !strings.Contains(out, tc.want):
				t.Fatalf("refused, but not with %q:\n%s", tc.want, out)
			}
		})
	}
	// An operation's request cannot change.
	out, err := apply(t, "apiVersion: dysco.io/v1alpha1\nkind: Operation\nmetadata:\n  name: op1\nspec:\n  host: mb2\n  middlebox: {match: tcp, timeout_ms: 2000}\n")
	if err == nil || !strings.Contains(out, "an operation's request cannot change") {
		t.Fatalf("an operation's request changed: %v\n%s", err, out)
	}
	if out, err := exec.Command("kubectl", "--kubeconfig", kc, "get", "dpol", "-o", "name").CombinedOutput(); err != nil || strings.Count(string(out), "policy.dysco.io/") != 4 {
		t.Fatalf("policies stored: %v\n%s", err, out)
	}
}
