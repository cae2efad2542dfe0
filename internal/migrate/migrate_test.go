package migrate

import (
	"context"
	"errors"
	"net/netip"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/dysco/dysco/internal/wire"
)

// memPlugin keeps state in memory and records calls. Tests inject
// failures and delays through it.
type memPlugin struct {
	name      string
	state     map[Session][]byte
	failExp   error         // Export fails with this
	failImp   error         // Import fails with this
	delayExp  time.Duration // Export waits this long first (less if its context ends)
	calls     *[]string
	releaseOK bool
}

func (m *memPlugin) Name() string { return m.name }
func (m *memPlugin) Export(ctx context.Context, s Session) ([]byte, error) {
	*m.calls = append(*m.calls, m.name+".export")
	if m.delayExp > 0 {
		t := time.NewTimer(m.delayExp)
		defer t.Stop()
		select {
		case <-t.C:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
	if m.failExp != nil {
		return nil, m.failExp
	}
	return m.state[s], nil
}
func (m *memPlugin) Import(_ context.Context, s Session, st []byte) error {
	*m.calls = append(*m.calls, m.name+".import")
	if m.failImp != nil {
		return m.failImp
	}
	m.state[s] = st
	return nil
}
func (m *memPlugin) Release(_ context.Context, s Session) error {
	*m.calls = append(*m.calls, m.name+".release")
	delete(m.state, s)
	return nil
}

var testSession = Session{Tuple: wire.Tuple{Src: netip.MustParseAddr("10.0.0.1"), Dst: netip.MustParseAddr("10.0.0.2"), SrcPort: 1234, DstPort: 80}, Proto: 6}

func TestNewSet(t *testing.T) {
	s, err := NewSet([]string{"api", "conntrack"}, Options{APIProviders: NewProviders()})
	if err != nil {
		t.Fatal(err)
	}
	if got := s.Names(); !slices.Equal(got, []string{"api", "conntrack"}) {
		t.Errorf("Names() = %v", got)
	}
	for _, c := range []struct {
		names []string
		opt   Options
		want  string
	}{
		{[]string{"conntrack", "nginx"}, Options{}, `unknown state plug-in "nginx" (known plug-ins: conntrack, api)`},
		{[]string{"conntrack", "conntrack"}, Options{}, `state plug-in "conntrack" given twice (known plug-ins: conntrack, api)`},
		{[]string{"api"}, Options{}, `state plug-in "api" needs a provider registry`},
	} {
		_, err := NewSet(c.names, c.opt)
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("NewSet(%v): %v, want %q", c.names, err, c.want)
		}
	}
}

func TestSetImportRollsBack(t *testing.T) {
	var calls []string
	a := &memPlugin{name: "a", state: map[Session][]byte{}, calls: &calls}
	b := &memPlugin{name: "b", state: map[Session][]byte{}, calls: &calls, failImp: errors.New("disk full")}
	c := &memPlugin{name: "c", state: map[Session][]byte{}, calls: &calls}
	set := newSetOf(a, b, c)
	ctx := context.Background()

	err := set.Import(ctx, testSession, Bundle{"a": []byte("A"), "b": []byte("B"), "c": []byte("C")})
	if err == nil || err.Error() != "b: import: disk full" {
		t.Fatalf("Import: %v, want b's failure", err)
	}
	if want := []string{"a.import", "b.import", "a.release"}; !slices.Equal(calls, want) {
		t.Errorf("calls %v, want %v", calls, want)
	}
	if len(a.state)+len(c.state) != 0 {
		t.Errorf("state left after rollback: a %v c %v", a.state, c.state)
	}

	calls = nil
	err = set.Import(ctx, testSession, Bundle{"a": []byte("A"), "zz": []byte("?")})
	if err == nil || !strings.Contains(err.Error(), `state for plug-in "zz", which this host has not enabled (enabled: a, b, c)`) {
		t.Fatalf("Import of an unknown plug-in's state: %v", err)
	}
	if len(calls) != 0 {
		t.Errorf("plug-ins called before the bundle was checked: %v", calls)
	}

	b.failImp = nil
	if err := set.Import(ctx, testSession, Bundle{"c": []byte("C"), "a": []byte("A")}); err != nil {
		t.Fatal(err)
	}
	if want := []string{"a.import", "c.import"}; !slices.Equal(calls, want) {
		t.Errorf("import order %v, want Set order %v", calls, want)
	}
	got, err := set.Export(ctx, testSession)
	if err != nil || len(got) != 2 || string(got["a"]) != "A" || string(got["c"]) != "C" {
		t.Errorf("Export after import: %v %v", got, err)
	}
}

// TestSetPluginFailures: a plug-in's failed export fails the Set's, naming
// the plug-in, and asks no plug-in after it; a failed import rolls back the
// plug-ins already imported.
func TestSetPluginFailures(t *testing.T) {
	var calls []string
	errBroken := errors.New("broken")
	a := &memPlugin{name: "a", state: map[Session][]byte{testSession: []byte("A")}, calls: &calls, failExp: errBroken}
	b := &memPlugin{name: "b", state: map[Session][]byte{}, calls: &calls, failImp: errBroken}
	ctx := context.Background()
	got, err := newSetOf(a, b).Export(ctx, testSession)
	if err == nil || err.Error() != "a: export: broken" || !errors.Is(err, errBroken) || got != nil {
		t.Errorf("Export with a failing: %v %v", got, err)
	}
	if want := []string{"a.export"}; !slices.Equal(calls, want) {
		t.Errorf("calls %v, want %v", calls, want)
	}
	calls = nil
	err = newSetOf(a, b).Import(ctx, testSession, Bundle{"a": []byte("A2"), "b": []byte("B")})
	if err == nil || !errors.Is(err, errBroken) || !strings.HasPrefix(err.Error(), "b: import: broken") {
		t.Errorf("Import with b failing: %v", err)
	}
	if want := []string{"a.import", "b.import", "a.release"}; !slices.Equal(calls, want) {
		t.Errorf("calls %v, want %v", calls, want)
	}
	if _, ok := a.state[testSession]; ok {
		t.Error("a's import not rolled back after b's failure")
	}
}

// TestSetSlowExport: a plug-in that takes long holds the Set's Export back
// that long; when the context ends first, nothing is exported (the plug-ins
// after it are not asked).
func TestSetSlowExport(t *testing.T) {
	var calls []string
	const d = 30 * time.Millisecond
	a := &memPlugin{name: "a", state: map[Session][]byte{testSession: []byte("A")}, calls: &calls, delayExp: d}
	b := &memPlugin{name: "b", state: map[Session][]byte{testSession: []byte("B")}, calls: &calls}
	t0 := time.Now()
	got, err := newSetOf(a, b).Export(context.Background(), testSession)
	if took := time.Since(t0); err != nil || string(got["a"]) != "A" || string(got["b"]) != "B" || took < d {
		t.Errorf("Export delayed by %v: %v %v after %v", d, got, err, took)
	}
	calls = nil
	a.delayExp = time.Hour
	ctx, cancel := context.WithTimeout(context.Background(), time.Millisecond)
	defer cancel()
	got, err = newSetOf(a, b).Export(ctx, testSession)
	if err == nil || !errors.Is(err, context.DeadlineExceeded) || !strings.HasPrefix(err.Error(), "a: export: ") || got != nil {
		t.Errorf("Export delayed past its context: %v %v", got, err)
	}
	if want := []string{"a.export"}; !slices.Equal(calls, want) {
		t.Errorf("calls %v, want %v", calls, want)
	}
}

func TestSetExportBundleLimit(t *testing.T) {
	var calls []string
	big := &memPlugin{name: "big", state: map[Session][]byte{testSession: make([]byte, 50000)}, calls: &calls}
	_, err := newSetOf(big).Export(context.Background(), testSession)
	if err == nil || !strings.Contains(err.Error(), "exceeds 60000 (big 50000 bytes)") {
		t.Errorf("Export of a 50000-byte state (base64 ~66667): %v", err)
	}
	big.state[testSession] = make([]byte, 40000)
	b, err := newSetOf(big).Export(context.Background(), testSession)
	if err != nil {
		t.Fatal(err)
	}
	enc, _ := b.Encode()
	back, err := DecodeBundle(enc)
	if err != nil || len(back["big"]) != 40000 {
		t.Errorf("bundle round trip: %d bytes, %v", len(back["big"]), err)
	}
}

func TestSessionValidate(t *testing.T) {
	bad := testSession
	bad.Tuple.Dst = netip.MustParseAddr("fd00::1")
	if err := newSetOf().Release(context.Background(), bad); err == nil || !strings.Contains(err.Error(), "mixes IPv4 and IPv6") {
		t.Errorf("mixed families: %v", err)
	}
	bad = testSession
	bad.Proto = 1
	if _, err := newSetOf().Export(context.Background(), bad); err == nil || !strings.Contains(err.Error(), "protocol must be 6 (tcp) or 17 (udp)") {
		t.Errorf("icmp: %v", err)
	}
}
