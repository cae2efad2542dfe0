package migrate

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"

	"golang.org/x/sys/unix"
)

// Conntrack is the "conntrack" plug-in: the Linux netfilter firewall's
// connection-tracking entries of the session (both tuples, so NAT bindings
// move too), read and written over ctnetlink, with the firewall rules they
// rely on (rules.go).
type Conntrack struct {
	zones []uint16
}

// NewConntrack returns the "conntrack" plug-in looking for entries in zones
// (nil: zone 0).
func NewConntrack(zones []uint16) *Conntrack {
	if len(zones) == 0 {
		zones = []uint16{0}
	}
	return &Conntrack{zones: zones}
}

// Name returns "conntrack".
func (*Conntrack) Name() string { return NameConntrack }

// ctState is the plug-in's state as it moves.
type ctState struct {
	Entries []*ctEntry `json:"entries"`
	// RulesFrom is the command the rules were read with; empty when the
	// exporting host had none (nothing is checked then).
	RulesFrom string   `json:"rules_from,omitempty"`
	Rules     []fwRule `json:"rules,omitempty"`
}

// sessionTuple is the entry's original tuple for session s: the session
// tuple as the firewall sees it.
func sessionTuple(s Session) ctTuple {
	t := s.Tuple
	return ctTuple{Src: t.Src.Unmap(), Dst: t.Dst.Unmap(), Sport: t.SrcPort, Dport: t.DstPort, Proto: s.Proto}
}

// Export returns the session's entries (the ones whose original tuple is
// the session tuple, in each zone) and the rules they rely on; nil when
// the firewall tracks no such connection.
func (c *Conntrack) Export(ctx context.Context, s Session) ([]byte, error) {
	orig := sessionTuple(s)
	nl, err := dialNetfilter()
	if err != nil {
		return nil, err
	}
	defer nl.Close()
	st := ctState{}
	marked := false
	for _, z := range c.zones {
		e, err := nl.ctGet(ctx, orig, z)
		if errors.Is(err, errNoEntry) {
			continue
		}
		if err != nil {
			return nil, fmt.Errorf("reading conntrack entry %s zone %d: %w", orig, z, err)
		}
		st.Entries = append(st.Entries, e)
		marked = marked || e.Mark != 0
	}
	if len(st.Entries) == 0 {
		return nil, nil
	}
	all, err := hostRules(ctx, orig.Src.Is4())
	switch {
	case errors.Is(err, errNoIptables):
	case err != nil:
		return nil, fmt.Errorf("reading firewall rules: %w", err)
	default:
		st.RulesFrom = saveCommand(orig.Src.Is4())
		st.Rules = relevantRules(all, marked)
	}
	return json.Marshal(st)
}

// Import checks that this host has the rules the entries rely on, then
// creates each entry; an entry that exists already with the same tuples is
// updated in place (so a retransmitted import changes nothing more), one
// with other tuples (another NAT binding) is replaced.
func (c *Conntrack) Import(ctx context.Context, s Session, state []byte) error {
	st, err := decodeState(s, state)
	if err != nil {
		return err
	}
	orig := sessionTuple(s)
	if st.RulesFrom != "" {
		have, err := hostRules(ctx, orig.Src.Is4())
		if errors.Is(err, errNoIptables) {
			return fmt.Errorf("the exporting host's conntrack entries rely on %s rules, but this host has no %s to check them", st.RulesFrom, st.RulesFrom)
		}
		if err != nil {
			return fmt.Errorf("reading firewall rules: %w", err)
		}
		if miss := missingRules(st.Rules, have); len(miss) > 0 {
			var names []string
			for _, r := range miss {
				names = append(names, r.String())
			}
			return fmt.Errorf("this host lacks firewall rule %s that the session's conntrack entry relies on (the migrated entry would not let the session through); add an equivalent rule (%s; comments and interface names are not compared)",
				strings.Join(names, ", "), st.RulesFrom)
		}
	}
	nl, err := dialNetfilter()
	if err != nil {
		return err
	}
	defer nl.Close()
	var created []*ctEntry
	for _, e := range st.Entries {
		fresh, err := importEntry(ctx, nl, e)
		if err != nil {
			for _, d := range created {
				_ = nl.ctDelete(ctx, d.Orig, d.Zone)
			}
			return fmt.Errorf("writing conntrack entry %s zone %d: %w", e.Orig, e.Zone, err)
		}
		if fresh {
			created = append(created, e)
		}
	}
	return nil
}

// decodeState reads the state another host exported for session s and
// checks that every entry is the session's.
func decodeState(s Session, state []byte) (ctState, error) {
	var st ctState
	if err := json.Unmarshal(state, &st); err != nil {
		return ctState{}, fmt.Errorf("decoding state: %w", err)
	}
	orig := sessionTuple(s)
	for _, e := range st.Entries {
		if e == nil {
			return ctState{}, errors.New("state holds an empty entry")
		}
		if e.Orig != orig {
			return ctState{}, fmt.Errorf("state holds entry %s, not of session %s", e.Orig, s)
		}
		// Both ends valid and of the session's family: the import makes
		// NAT ranges from them (natAttrs); a missing address would be
		// taken for :: or 0.0.0.0 (found by FuzzConntrackState).
		if !e.Reply.Src.IsValid() || !e.Reply.Dst.IsValid() || e.Reply.Src.Is4() != orig.Src.Is4() ||
			e.Reply.Dst.Is4() != orig.Src.Is4() || e.Reply.Proto != orig.Proto {
			return ctState{}, fmt.Errorf("entry %s: reply tuple %s does not match", e.Orig, e.Reply)
		}
	}
	return st, nil
}

// importEntry makes the kernel's entry equal to e; fresh tells whether it
// was created.
func importEntry(ctx context.Context, nl *nlConn, e *ctEntry) (fresh bool, err error) {
	cur, err := nl.ctGet(ctx, e.Orig, e.Zone)
	switch {
	case errors.Is(err, errNoEntry):
		return true, nl.ctCreate(ctx, e)
	case err != nil:
		return false, err
	}
	if cur.Reply == e.Reply {
		err := nl.ctUpdate(ctx, cur, e)
		if !errors.Is(err, unix.EBUSY) {
			return false, err
		}
		// EBUSY: the existing entry has SEEN_REPLY or ASSURED, which the
		// kernel will not clear; replace the entry.
	}
	if err := nl.ctDelete(ctx, e.Orig, e.Zone); err != nil && !errors.Is(err, errNoEntry) {
		return false, err
	}
	return true, nl.ctCreate(ctx, e)
}

// Release deletes the session's entries (each zone); none: nil.
func (c *Conntrack) Release(ctx context.Context, s Session) error {
	orig := sessionTuple(s)
	nl, err := dialNetfilter()
	if err != nil {
		return err
	}
	defer nl.Close()
	for _, z := range c.zones {
		if err := nl.ctDelete(ctx, orig, z); err != nil && !errors.Is(err, errNoEntry) {
			return fmt.Errorf("deleting conntrack entry %s zone %d: %w", orig, z, err)
		}
	}
	return nil
}
