// Package migrate moves a session's middlebox state from one middlebox
// instance to another: the plug-ins behind middlebox replacement with state
// transfer (paper §3.5, last paragraph; §5.3). While the anchors hold the
// session frozen, the agent of the old middlebox host exports the session's
// state through its enabled plug-ins (a Bundle), the agent of the new host
// imports it, and only then does traffic move; the old host finally
// releases its copy.
//
// Plug-ins act in the caller's network namespace: the agent runs inside the
// host's namespace, so the netlink sockets and commands a plug-in opens reach
// that host's kernel state.
package migrate

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"sort"
	"strings"

	"github.com/dysco/dysco/internal/wire"
)

// Session names the session whose state moves: the TCP (or UDP) five-tuple
// as the middlebox application sees it (the session tuple, initiator ->
// responder).
type Session struct {
	Tuple wire.Tuple
	Proto uint8 // 6 tcp, 17 udp
}

func (s Session) String() string {
	p := "tcp"
	switch s.Proto {
	case 6:
	case 17:
		p = "udp"
	default:
		p = fmt.Sprintf("proto %d", s.Proto)
	}
	return p + " " + s.Tuple.String()
}

// validate refuses sessions no plug-in can name.
func (s Session) validate() error {
	t := s.Tuple
	if !t.Src.IsValid() || !t.Dst.IsValid() {
		return fmt.Errorf("session %s: missing address", s)
	}
	if t.Src.Unmap().Is4() != t.Dst.Unmap().Is4() {
		return fmt.Errorf("session %s: mixes IPv4 and IPv6", s)
	}
	if s.Proto != 6 && s.Proto != 17 {
		return fmt.Errorf("session %s: protocol must be 6 (tcp) or 17 (udp)", s)
	}
	return nil
}

// Plugin exports and imports one kind of middlebox state on this host (the
// agent runs inside the host's network namespace; netlink sockets opened by
// the plugin act there).
type Plugin interface {
	Name() string
	// Export returns this host's state of the session, or (nil, nil) when
	// there is none. Must not change the state.
	Export(ctx context.Context, s Session) ([]byte, error)
	// Import installs state exported by the same plugin on another host.
	// Idempotent (a retransmitted import succeeds and changes nothing
	// more); replaces any state this host already has for the session.
	Import(ctx context.Context, s Session, state []byte) error
	// Release removes the session's state from this host after the session
	// moved away (old instance). No state: nil.
	Release(ctx context.Context, s Session) error
}

// Bundle is what moves between agents: plug-in name -> its state. It is
// encoded as JSON (the states in base64) and travels in one UDP datagram.
type Bundle map[string][]byte

// MaxBundleSize is the largest encoded Bundle the agent sends: it travels in
// one UDP control datagram.
const MaxBundleSize = 60000

// Encode returns the bundle as it travels (JSON).
func (b Bundle) Encode() ([]byte, error) { return json.Marshal(b) }

// DecodeBundle is the inverse of Encode.
func DecodeBundle(data []byte) (Bundle, error) {
	var b Bundle
	if err := json.Unmarshal(data, &b); err != nil {
		return nil, fmt.Errorf("state bundle: %w", err)
	}
	return b, nil
}

// Plug-in names NewSet knows.
const (
	NameConntrack = "conntrack"
	NameAPI       = "api"
)

// KnownPlugins lists the names NewSet accepts.
var KnownPlugins = []string{NameConntrack, NameAPI}

// Options configures the plug-ins of a Set.
type Options struct {
	// APIProviders is the registry of middleboxes serving their state over
	// the provider protocol (docs/state-migration-plugins.md); required
	// when "api" is enabled, may be nil otherwise.
	APIProviders *Providers
	// ConntrackZones are the conntrack zones the "conntrack" plug-in looks
	// in for the session's entries; nil means zone 0 only.
	ConntrackZones []uint16
}

// Set is the agent's enabled plug-ins, in order.
type Set struct {
	plugins []Plugin
}

// NewSet returns the plug-ins names (known: "conntrack", "api"), in that
// order.
func NewSet(names []string, opt Options) (*Set, error) {
	s := &Set{}
	seen := map[string]bool{}
	known := strings.Join(KnownPlugins, ", ")
	for _, n := range names {
		if seen[n] {
			return nil, fmt.Errorf("state plug-in %q given twice (known plug-ins: %s)", n, known)
		}
		seen[n] = true
		switch n {
		case NameConntrack:
			s.plugins = append(s.plugins, NewConntrack(opt.ConntrackZones))
		case NameAPI:
			if opt.APIProviders == nil {
				return nil, errors.New(`state plug-in "api" needs a provider registry (Options.APIProviders)`)
			}
			s.plugins = append(s.plugins, NewAPI(opt.APIProviders))
		default:
			return nil, fmt.Errorf("unknown state plug-in %q (known plug-ins: %s)", n, known)
		}
	}
	return s, nil
}

// newSetOf returns a Set of the given plug-ins (tests).
func newSetOf(ps ...Plugin) *Set { return &Set{plugins: ps} }

// Names returns the enabled plug-ins' names, in order.
func (s *Set) Names() []string {
	out := make([]string, len(s.plugins))
	for i, p := range s.plugins {
		out[i] = p.Name()
	}
	return out
}

// Export collects the session's state from every enabled plug-in; plug-ins
// without state leave no entry. An error names the plug-in ("conntrack:
// export: ..."); so does a bundle too large to travel.
func (s *Set) Export(ctx context.Context, sess Session) (Bundle, error) {
	if err := sess.validate(); err != nil {
		return nil, err
	}
	b := Bundle{}
	for _, p := range s.plugins {
		st, err := p.Export(ctx, sess)
		if err != nil {
			return nil, fmt.Errorf("%s: export: %w", p.Name(), err)
		}
		if st != nil {
			b[p.Name()] = st
		}
	}
	enc, err := b.Encode()
	if err != nil {
		return nil, fmt.Errorf("state bundle: %w", err)
	}
	if len(enc) > MaxBundleSize {
		var sizes []string
		for _, n := range sortedKeys(b) {
			sizes = append(sizes, fmt.Sprintf("%s %d bytes", n, len(b[n])))
		}
		return nil, fmt.Errorf("state of session %s: bundle of %d bytes encoded exceeds %d (%s)", sess, len(enc), MaxBundleSize, strings.Join(sizes, ", "))
	}
	return b, nil
}

// Import installs a bundle exported by another host's Set. Every entry must
// belong to a plug-in enabled here (checked before anything is imported);
// entries are imported in Set order, and when one fails the plug-ins
// already imported are released again (rolled back) before the error (which
// names the plug-in) is returned.
func (s *Set) Import(ctx context.Context, sess Session, b Bundle) error {
	if err := sess.validate(); err != nil {
		return err
	}
	names := s.Names()
	for _, n := range sortedKeys(b) {
		if !slices.Contains(names, n) {
			return fmt.Errorf("state bundle has state for plug-in %q, which this host has not enabled (enabled: %s)", n, strings.Join(names, ", "))
		}
	}
	var done []Plugin
	for _, p := range s.plugins {
		st, ok := b[p.Name()]
		if !ok {
			continue
		}
		if err := p.Import(ctx, sess, st); err != nil {
			err = fmt.Errorf("%s: import: %w", p.Name(), err)
			for i := len(done) - 1; i >= 0; i-- {
				if rerr := done[i].Release(ctx, sess); rerr != nil {
					err = errors.Join(err, fmt.Errorf("rolling back %s: release: %w", done[i].Name(), rerr))
				}
			}
			return err
		}
		done = append(done, p)
	}
	return nil
}

// Release removes the session's state from every enabled plug-in; it tries
// them all and returns their errors together, each naming its plug-in.
func (s *Set) Release(ctx context.Context, sess Session) error {
	if err := sess.validate(); err != nil {
		return err
	}
	var errs []error
	for _, p := range s.plugins {
		if err := p.Release(ctx, sess); err != nil {
			errs = append(errs, fmt.Errorf("%s: release: %w", p.Name(), err))
		}
	}
	return errors.Join(errs...)
}

func sortedKeys[V any](m map[string]V) []string {
	ks := make([]string, 0, len(m))
	for k := range m {
		ks = append(ks, k)
	}
	sort.Strings(ks)
	return ks
}
