// Package policy turns policies (paper §2.2: "sessions whose first SYN
// matches this predicate go through this chain") into the eBPF classifier
// the datapath runs on the first packet of a new session: a TCP SYN, or the
// first UDP datagram of a flow (Chained lists the protocols).
//
// A policy's predicate is a tcpdump filter, compiled by libpcap into classic
// BPF for Ethernet frames (CompileFilter). The package translates every
// policy's classic BPF into one eBPF SchedCLS program (BuildProgram) that
// the datapath reaches by a tail call, and evaluates the same classic BPF in
// user space (Matcher) for `dysco policy test` and as the tests' oracle.
// Both sides follow one set of semantics, documented on BuildProgram and
// Filter.Match, so that what the CLI reports is what the datapath does.
//
// Compile also finds which protocols a filter matches (Filter.Protocols) and
// refuses a policy whose filter matches none the datapath chains, so that
// a policy is never accepted for sessions that would bypass its chain.
package policy

import (
	"fmt"

	"github.com/dysco/dysco/internal/api"
)

// Compiled is a validated policy together with its compiled filter.
type Compiled struct {
	Policy api.Policy
	Filter Filter
	// Protocols is what the filter matches (Filter.Protocols); it holds
	// at least one protocol of Chained.
	Protocols ProtoSet
}

// Compile validates p, compiles its filter and finds the protocols the
// filter matches. Errors name the policy, e.g. `policy "web": filter "tcp dst
// port": can't parse filter expression: syntax error`. A filter that matches
// no protocol in Chained is refused with an *UnchainedError: its policy
// would never steer a session.
func Compile(p api.Policy) (Compiled, error) {
	if err := p.Validate(); err != nil {
		return Compiled{}, err
	}
	f, err := CompileFilter(p.Filter)
	if err != nil {
		return Compiled{}, fmt.Errorf("policy %q: %w", p.Name, err)
	}
	ps, err := checkChained(p.Name, f)
	if err != nil {
		return Compiled{}, err
	}
	return Compiled{Policy: p, Filter: f, Protocols: ps}, nil
}

// CompileAll compiles policies in the order given, which is the order the
// classifier evaluates them in; it stops at the first error.
func CompileAll(policies []api.Policy) ([]Compiled, error) {
	out := make([]Compiled, 0, len(policies))
	for _, p := range policies {
		c, err := Compile(p)
		if err != nil {
			return nil, err
		}
		out = append(out, c)
	}
	return out, nil
}

// Matcher evaluates an ordered list of policies on Ethernet frames in user
// space, with the semantics of the eBPF classifier BuildProgram describes.
type Matcher struct {
	policies []Compiled
}

// NewMatcher returns a Matcher for policies, evaluated in order.
func NewMatcher(policies []Compiled) *Matcher {
	return &Matcher{policies: policies}
}

// Verdict returns what the classifier writes to cb[0] for frame: i+1 for the
// first policy i whose filter accepts it, 0 when none does.
func (m *Matcher) Verdict(frame []byte) uint32 {
	for i, p := range m.policies {
		if p.Filter.Match(frame) {
			return uint32(i + 1)
		}
	}
	return 0
}

// Match returns the first policy that accepts frame, if any.
func (m *Matcher) Match(frame []byte) (api.Policy, bool) {
	v := m.Verdict(frame)
	if v == 0 {
		return api.Policy{}, false
	}
	return m.policies[v-1].Policy, true
}
