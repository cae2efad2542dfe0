package datapath

import (
	"encoding/binary"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/dysco/dysco/internal/api"
	"github.com/dysco/dysco/internal/testutil"
)

func testPinDir(t testing.TB) string {
	t.Helper()
	dir := "/sys/fs/bpf/dysco-test/" + t.Name()
	t.Cleanup(func() { _ = Reset(dir) })
	_ = Reset(dir)
	return dir
}

// loadTest loads the datapath with the default configuration under the
// test's own pin directory; it is closed when the test ends.
func loadTest(t *testing.T) *Datapath {
	t.Helper()
	testutil.RequireRoot(t)
	d, err := Load(Config{PinDir: testPinDir(t)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { d.Close() })
	return d
}

// TestLoadVerifies: the object loads (every program passes the verifier)
// and closes again.
func TestLoadVerifies(t *testing.T) {
	loadTest(t)
}

// TestLoadRefusesIncompatiblePins: maps pinned by a version whose layouts
// differ (here the sizes of flow_val and session_val before they were
// shrunk to 72 and 80 bytes) are not reused. Load names every such map
// with both sizes, touches nothing, and works once the pins are reset.
func TestLoadRefusesIncompatiblePins(t *testing.T) {
	testutil.RequireRoot(t)
	dir := testPinDir(t)
	if _, err := ensureBPFFS(dir); err != nil {
		t.Fatal(err)
	}
	spec, err := loadDysco()
	if err != nil {
		t.Fatal(err)
	}
	// dysco_flows is retired (the flows are now by family), with the
	// layout it had last.
	old := map[string]uint32{"dysco_flows6": 88, "dysco_sessions": 88, "dysco_flows": 72}
	for name, vsize := range old {
		from := name
		if name == "dysco_flows" {
			from = "dysco_flows6"
		}
		ms := spec.Maps[from].Copy()
		ms.Name = name
		ms.ValueSize = vsize
		ms.Key, ms.Value = nil, nil // no BTF: the old value type is not at hand
		ms.Pinning = ebpf.PinNone
		m, err := ebpf.NewMap(ms)
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		if err := m.Put(make([]byte, ms.KeySize), make([]byte, vsize)); err != nil {
			t.Fatal(err)
		}
		if err := m.Pin(filepath.Join(dir, name)); err != nil {
			t.Fatal(err)
		}
		m.Close()
	}

	d, err := Load(Config{PinDir: dir})
	if err == nil {
		d.Close()
		t.Fatal("Load reused maps of another layout")
	}
	t.Log(err)
	if !errors.Is(err, ebpf.ErrMapIncompatible) {
		t.Errorf("error does not wrap ErrMapIncompatible: %v", err)
	}
	for _, want := range []string{
		"dysco_flows6 (ValueSize: 88 changed to 72)", "dysco_sessions (ValueSize: 88 changed to 96)",
		"dysco_flows (no longer used: the flows are in dysco_flows4 and dysco_flows6)",
		"dysco agent --reset --pin-dir " + dir,
	} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error does not say %q: %v", want, err)
		}
	}
	// Nothing was changed: the old maps keep their entries, and no map
	// of the new version was pinned beside them.
	ents, _ := os.ReadDir(dir)
	if len(ents) != len(old) {
		t.Errorf("%d pins after the refused load, want %d", len(ents), len(old))
	}
	for name, vsize := range old {
		m, err := ebpf.LoadPinnedMap(filepath.Join(dir, name), nil)
		if err != nil {
			t.Fatal(err)
		}
		n := 0
		for it := m.Iterate(); it.Next(make([]byte, m.KeySize()), make([]byte, m.ValueSize())); {
			n++
		}
		if m.ValueSize() != vsize || n != 1 {
			t.Errorf("%s: value size %d with %d entries after the refused load, want %d with 1", name, m.ValueSize(), n, vsize)
		}
		m.Close()
	}

	// The documented way out: reset, then load.
	if err := Reset(dir); err != nil {
		t.Fatal(err)
	}
	if d, err = Load(Config{PinDir: dir}); err != nil {
		t.Fatalf("load after reset: %v", err)
	}
	d.Close()
}

// TestValueSizes: the sizes the memory benchmark's figures rest on (the
// kernel accounts a hash entry as 48 + key + value + 8 bytes).
func TestValueSizes(t *testing.T) {
	for _, c := range []struct {
		name string
		got  int
		want int
	}{
		{"flow_val", binary.Size(Flow{}), 72},
		{"flow_val4", binary.Size(Flow4{}), 48},
		{"dysco_tuple4", binary.Size(Tuple4{}), 16},
		{"session_val", binary.Size(Session{}), 96},
		{"dysco_ends", binary.Size(Ends{}), 36},
		{"dysco_tuple", binary.Size(Tuple{}), 40},
	} {
		if c.got != c.want {
			t.Errorf("%s is %d bytes, want %d", c.name, c.got, c.want)
		}
	}
}

// TestInstancesBound: a middlebox type the API accepts fits the datapath's
// type entry (MAX_INSTANCES).
func TestInstancesBound(t *testing.T) {
	if n := len(dyscoTypeVal{}.Addr); n != api.MaxInstances {
		t.Fatalf("type_val holds %d instances, api.MaxInstances is %d", n, api.MaxInstances)
	}
}

// TestLoadSizing: MaxSessions sizes the session maps (four flows per
// session); maps pinned by an earlier load keep their size, and their
// entries, when the datapath is loaded again with another size; a size out
// of range is refused.
func TestLoadSizing(t *testing.T) {
	testutil.RequireRoot(t)
	spec, err := loadDysco()
	if err != nil {
		t.Fatal(err)
	}
	def := spec.Maps["dysco_sessions"].MaxEntries // MAX_SESSIONS
	for _, name := range []string{"dysco_flows4", "dysco_flows6"} {
		if spec.Maps[name].MaxEntries != 4*def {
			t.Fatalf("the object's %s holds %d, not four times its MAX_SESSIONS %d", name, spec.Maps[name].MaxEntries, def)
		}
	}
	dir := testPinDir(t)
	caps := func(d *Datapath) [3]uint32 {
		if n4, n6 := d.objs.DyscoFlows4.MaxEntries(), d.objs.DyscoFlows6.MaxEntries(); n4 != n6 {
			t.Fatalf("the IPv4 flow map holds %d, the IPv6 one %d", n4, n6)
		}
		return [3]uint32{d.objs.DyscoSessions.MaxEntries(), d.objs.DyscoSyns.MaxEntries(), d.objs.DyscoFlows4.MaxEntries()}
	}
	d, err := Load(Config{PinDir: dir, MaxSessions: 1000})
	if err != nil {
		t.Fatal(err)
	}
	if got, want := caps(d), [3]uint32{1000, 1000, 4000}; got != want {
		t.Fatalf("sessions, syns, flows: %v, want %v", got, want)
	}
	if sz := d.Sizing; sz != (Sizing{Sessions: 1000, Flows: 4000, Requested: 1000}) {
		t.Fatalf("sizing %+v", sz)
	}
	k := Tuple{Proto: 6, Sport: 1, Dport: 2}
	if err := d.AddFlow(k, Flow{SessId: 7}); err != nil {
		t.Fatal(err)
	}
	d.Close()

	d, err = Load(Config{PinDir: dir, MaxSessions: 5000})
	if err != nil {
		t.Fatal(err)
	}
	if got, want := caps(d), [3]uint32{1000, 1000, 4000}; got != want {
		t.Fatalf("after a reload asking for 5000: sessions, syns, flows: %v, want the pinned %v", got, want)
	}
	if sz := d.Sizing; !sz.Kept || sz.Requested != 5000 {
		t.Fatalf("sizing %+v: want Kept and Requested 5000", sz)
	}
	if f, ok := d.Flow(k); !ok || f.SessId != 7 {
		t.Fatalf("the pinned flow did not survive the reload: %+v %v", f, ok)
	}
	d.Close()

	if err := Reset(dir); err != nil {
		t.Fatal(err)
	}
	d, err = Load(Config{PinDir: dir})
	if err != nil {
		t.Fatal(err)
	}
	if got, want := caps(d), [3]uint32{def, def, 4 * def}; got != want {
		t.Fatalf("default after a reset: %v, want %v", got, want)
	}
	d.Close()

	for _, n := range []int{-1, MaxSessionsLimit + 1} {
		if _, err := Load(Config{PinDir: dir, MaxSessions: n}); err == nil || !strings.Contains(err.Error(), "sessions: the maps hold") {
			t.Fatalf("MaxSessions %d: err %v, want a refusal", n, err)
		}
	}
}
