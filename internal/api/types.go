// Package api holds the types that the agent's local API, the policy server
// and the CLI exchange as JSON, and the small client the CLI uses.
package api

import (
	"fmt"
	"net/netip"
	"regexp"
	"strings"
)

// Policy steers the sessions whose first SYN matches Filter through Chain
// (paper §2.2). Policies are evaluated in ascending Priority, then Name; the
// first match wins.
type Policy struct {
	// Name identifies the policy; [A-Za-z0-9._-], at most 63 characters.
	Name string `json:"name"`
	// Filter is a predicate in tcpdump filter syntax, compiled by libpcap
	// against the Ethernet frame of the session's first SYN.
	Filter string `json:"filter"`
	// Chain lists the middleboxes to traverse, in order. An empty chain makes
	// matching sessions Dysco sessions straight to their destination so that
	// they can be reconfigured later.
	Chain []Hop `json:"chain,omitempty"`
	// EndBeforeDestination ends the chain at its last hop, which hands the
	// plain SYN on to the destination by ordinary routing (§2.4). Without
	// it the destination is the chain's last address.
	EndBeforeDestination bool `json:"end_before_destination,omitempty"`
	// Priority orders policies; lower is evaluated first.
	Priority int `json:"priority,omitempty"`
	// Hosts names the agents the policy server gives this policy to; empty
	// means every agent.
	Hosts []string `json:"hosts,omitempty"`
}

// Hop is one element of a chain: a middlebox address, or the name of a
// middlebox type whose instance the agent picks (round robin).
type Hop struct {
	Addr netip.Addr `json:"addr,omitzero"`
	Type string     `json:"type,omitempty"`
}

func (h Hop) String() string {
	if h.Type != "" {
		return h.Type
	}
	return h.Addr.String()
}

// ParseHop reads an address, or else a type name.
func ParseHop(s string) (Hop, error) {
	s = strings.TrimSpace(s)
	if a, err := netip.ParseAddr(s); err == nil {
		return Hop{Addr: a.Unmap()}, nil
	}
	if !nameRE.MatchString(s) {
		return Hop{}, fmt.Errorf("hop %q: neither an IP address nor a middlebox type name", s)
	}
	return Hop{Type: s}, nil
}

// MiddleboxType is a named set of interchangeable middlebox instances.
type MiddleboxType struct {
	Name      string       `json:"name"`
	Instances []netip.Addr `json:"instances"`
}

var nameRE = regexp.MustCompile(`^[A-Za-z][A-Za-z0-9._-]{0,62}$`)

// MaxChain is the longest chain a policy may name (the SYN block carries the
// chain plus the destination).
const MaxChain = 7

// Validate checks everything about p that does not need libpcap.
func (p *Policy) Validate() error {
	if !nameRE.MatchString(p.Name) {
		return fmt.Errorf("policy %q: name must start with a letter and contain only letters, digits, '.', '_' and '-' (at most 63)", p.Name)
	}
	if strings.TrimSpace(p.Filter) == "" {
		return fmt.Errorf("policy %q: empty filter (use \"tcp\" to match every TCP session)", p.Name)
	}
	if len(p.Chain) > MaxChain {
		return fmt.Errorf("policy %q: chain has %d hops, at most %d are allowed", p.Name, len(p.Chain), MaxChain)
	}
	if p.EndBeforeDestination && len(p.Chain) == 0 {
		return fmt.Errorf("policy %q: end_before_destination needs a chain", p.Name)
	}
	seen := map[string]bool{}
	for i, h := range p.Chain {
		if h.Addr.IsValid() == (h.Type != "") {
			return fmt.Errorf("policy %q: hop %d must be an address or a type, not both or neither", p.Name, i+1)
		}
		if h.Addr.IsValid() && seen[h.String()] {
			return fmt.Errorf("policy %q: hop %s appears twice (the chain would loop)", p.Name, h)
		}
		seen[h.String()] = true
	}
	return nil
}

// Validate checks a middlebox type.
func (t *MiddleboxType) Validate() error {
	if !nameRE.MatchString(t.Name) {
		return fmt.Errorf("type %q: invalid name", t.Name)
	}
	if len(t.Instances) == 0 {
		return fmt.Errorf("type %q: no instances", t.Name)
	}
	return nil
}

// PolicySet is what the policy server hands an agent, and what an agent keeps
// on disk to keep working while the server is down.
type PolicySet struct {
	// Version increases with every change at the server.
	Version  uint64          `json:"version"`
	Policies []Policy        `json:"policies"`
	Types    []MiddleboxType `json:"types"`
}
