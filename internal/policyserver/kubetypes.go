package policyserver

// The custom resources of deploy/crds (dysco.io/v1alpha1) as Go values, and
// their translation to and from the policy server's own types. Kubernetes
// names fields in camelCase and selects nodes and pods by labels; the
// policy set names hosts and instance addresses: the translation resolves
// the selectors against the nodes and pods it is given.

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"net/http"
	"net/netip"
	"slices"
	"sort"
	"strings"
	"time"

	"github.com/dysco/dysco/internal/api"
)

// DefaultKubeNamespace is where the replicas keep the published set, the
// controller's Lease and the agents' Leases.
const DefaultKubeNamespace = "dysco-system"

// KubeControllerLease is the Lease, in that namespace, that elects the
// controller: its holder identity is HOSTNAME-PID-START of the replica.
const KubeControllerLease = "dysco-policy-controller"

// The custom resources' group and version.
const (
	kubeGroup   = "dysco.io"
	kubeVersion = "v1alpha1"
)

// kubePolicySpec is the spec of a Policy object.
type kubePolicySpec struct {
	Filter               string            `json:"filter"`
	Chain                []kubeHop         `json:"chain,omitempty"`
	EndBeforeDestination bool              `json:"endBeforeDestination,omitempty"`
	Priority             int               `json:"priority,omitempty"`
	Nodes                []string          `json:"nodes,omitempty"`
	NodeSelector         *kubeLabelMatcher `json:"nodeSelector,omitempty"`
	IdleTimeoutSeconds   int               `json:"idleTimeoutSeconds,omitempty"`
	Via                  []string          `json:"via,omitempty"`
}

// kubeHop is one hop of a Policy's chain: an address or a type's name.
type kubeHop struct {
	Addr string `json:"addr,omitempty"`
	Type string `json:"type,omitempty"`
}

// kubeLabelMatcher selects objects whose labels include all of MatchLabels.
type kubeLabelMatcher struct {
	MatchLabels map[string]string `json:"matchLabels,omitempty"`
}

// matches tells whether labels include every label of m.
func (m *kubeLabelMatcher) matches(labels map[string]string) bool {
	for k, v := range m.MatchLabels {
		if got, ok := labels[k]; !ok || got != v {
			return false
		}
	}
	return true
}

// kubeTypeSpec is the spec of a MiddleboxType object.
type kubeTypeSpec struct {
	Instances    []string          `json:"instances,omitempty"`
	PodSelector  *kubeLabelMatcher `json:"podSelector,omitempty"`
	PodNamespace string            `json:"podNamespace,omitempty"`
}

// kubeNode is what the translation needs of a node: its name and labels.
type kubeNode struct {
	Name   string
	Labels map[string]string
}

// kubePod is what the translation needs of a pod.
type kubePod struct {
	Namespace string
	Labels    map[string]string
	IPs       []netip.Addr
	Ready     bool
}

// policyFromKube is the policy named name with spec, its node selector
// resolved against nodes (sorted names), checked as the policy server
// checks a policy it is given.
func policyFromKube(name string, spec kubePolicySpec, nodes []kubeNode) (api.Policy, error) {
	p := api.Policy{Name: name, Filter: spec.Filter, EndBeforeDestination: spec.EndBeforeDestination,
		Priority: spec.Priority, IdleTimeoutS: spec.IdleTimeoutSeconds}
	for i, h := range spec.Chain {
		switch {
		case h.Addr != "" && h.Type != "":
			return api.Policy{}, fmt.Errorf("policy %q: hop %d is both an address and a type", name, i+1)
		case h.Addr != "":
			a, err := netip.ParseAddr(h.Addr)
			if err != nil {
				return api.Policy{}, fmt.Errorf("policy %q: hop %d: %v", name, i+1, err)
			}
			p.Chain = append(p.Chain, api.Hop{Addr: a.Unmap()})
		default:
			p.Chain = append(p.Chain, api.Hop{Type: h.Type})
		}
	}
	for _, v := range spec.Via {
		a, err := netip.ParseAddr(v)
		if err != nil {
			return api.Policy{}, fmt.Errorf("policy %q: via: %v", name, err)
		}
		p.Via = append(p.Via, a.Unmap())
	}
	switch {
	case spec.NodeSelector != nil:
		for _, n := range nodes {
			if spec.NodeSelector.matches(n.Labels) {
				p.Hosts = append(p.Hosts, n.Name)
			}
		}
		sort.Strings(p.Hosts)
		if len(p.Hosts) == 0 {
			// A selector that matches no node gives the policy to no
			// agent, not to every one.
			return api.Policy{}, errNoNode
		}
	default:
		p.Hosts = slices.Clone(spec.Nodes)
	}
	if err := p.Validate(); err != nil {
		return api.Policy{}, err
	}
	return p, nil
}

// errNoNode is a policy whose node selector matches no node now: held back,
// not an error of the object.
var errNoNode = fmt.Errorf("its nodeSelector matches no node")

// errNoInstance is a type without an instance now (its pods not ready).
var errNoInstance = fmt.Errorf("it has no instance now (no listed address, and no ready pod selected)")

// policyToKube is the spec of p as a Policy object.
func policyToKube(p api.Policy) kubePolicySpec {
	spec := kubePolicySpec{Filter: p.Filter, EndBeforeDestination: p.EndBeforeDestination, Priority: p.Priority,
		Nodes: slices.Clone(p.Hosts), IdleTimeoutSeconds: p.IdleTimeoutS}
	for _, h := range p.Chain {
		if h.Addr.IsValid() {
			spec.Chain = append(spec.Chain, kubeHop{Addr: h.Addr.String()})
		} else {
			spec.Chain = append(spec.Chain, kubeHop{Type: h.Type})
		}
	}
	for _, a := range p.Via {
		spec.Via = append(spec.Via, a.String())
	}
	return spec
}

// typeFromKube is the middlebox type named name with spec: its listed
// instances, then the addresses of the ready pods its selector matches
// (in pods' order, each once), at most api.MaxInstances.
func typeFromKube(name string, spec kubeTypeSpec, pods []kubePod) (api.MiddleboxType, error) {
	t := api.MiddleboxType{Name: name, Instances: []netip.Addr{}}
	seen := map[netip.Addr]bool{}
	add := func(a netip.Addr) {
		a = a.Unmap()
		if !seen[a] {
			seen[a] = true
			t.Instances = append(t.Instances, a)
		}
	}
	for i, s := range spec.Instances {
		a, err := netip.ParseAddr(s)
		if err != nil {
			return api.MiddleboxType{}, fmt.Errorf("type %q: instance %d: %v", name, i+1, err)
		}
		add(a)
	}
	if spec.PodSelector != nil {
		for _, p := range pods {
			if p.Ready && p.Namespace == spec.PodNamespace && spec.PodSelector.matches(p.Labels) {
				for _, a := range p.IPs {
					add(a)
				}
			}
		}
	}
	if len(t.Instances) > api.MaxInstances {
		t.Instances = t.Instances[:api.MaxInstances]
	}
	if len(t.Instances) == 0 {
		// A selector with no ready pod now: held back, and so are the
		// policies that name the type.
		return api.MiddleboxType{}, errNoInstance
	}
	if err := t.Validate(); err != nil {
		return api.MiddleboxType{}, err
	}
	return t, nil
}

// typeToKube is the spec of t as a MiddleboxType object.
func typeToKube(t api.MiddleboxType) kubeTypeSpec {
	spec := kubeTypeSpec{}
	for _, a := range t.Instances {
		spec.Instances = append(spec.Instances, a.String())
	}
	return spec
}

// netipParse parses an address, IPv4-mapped ones unmapped.
func netipParse(s string) (netip.Addr, error) {
	a, err := netip.ParseAddr(s)
	return a.Unmap(), err
}

// objectName is name as part of a Kubernetes object's name: lower-case
// letters, digits and '-', at most 51 characters; a name that had to be
// changed gets a hash of the original, so that two names stay apart.
func objectName(name string) string {
	var b strings.Builder
	for _, r := range strings.ToLower(name) {
		if (r >= 'a' && r <= 'z') || (r >= '0' && r <= '9') || r == '-' {
			b.WriteRune(r)
		} else {
			b.WriteByte('-')
		}
	}
	out := strings.Trim(b.String(), "-")
	if out == name && len(out) <= 51 && out != "" {
		return out
	}
	sum := sha256.Sum256([]byte(name))
	h := hex.EncodeToString(sum[:4])
	if prefix := strings.Trim(out[:min(len(out), 42)], "-"); prefix != "" {
		return prefix + "-" + h
	}
	return h
}

// kubePublishWait bounds how long a write through a replica waits for the
// controller to take it into the published set.
const kubePublishWait = 5 * time.Second

// UnpublishedError says that an object written through a replica is
// stored but not in the published set: the controller holds it back
// (Reason and Message are its Accepted condition's), or no controller
// took it within kubePublishWait (Reason empty).
type UnpublishedError struct {
	Kind, Name      string
	Reason, Message string
}

func (e *UnpublishedError) Error() string {
	if e.Reason == "" {
		return fmt.Sprintf("%s %q is stored, but no controller published it within %s: is a policy server running and holding the Lease %s/%s? The agents get it once one does",
			e.Kind, e.Name, kubePublishWait, DefaultKubeNamespace, KubeControllerLease)
	}
	return fmt.Sprintf("%s %q is stored, but the controller holds it back (%s): %s", e.Kind, e.Name, e.Reason, e.Message)
}

// status is the HTTP status of a write that ended with e: 409 when the
// controller holds the object back, 504 when none answered in time.
func (e *UnpublishedError) status() int {
	if e.Reason != "" {
		return http.StatusConflict
	}
	return http.StatusGatewayTimeout
}
