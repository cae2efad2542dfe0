package datapath

import (
	"encoding/binary"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/cilium/ebpf"
)

// requireRoot skips tests that need CAP_BPF/CAP_NET_ADMIN when not root.
func requireRoot(t testing.TB) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root: loads eBPF programs")
	}
}

func testPinDir(t testing.TB) string {
	t.Helper()
	dir := "/sys/fs/bpf/dysco-test/" + t.Name()
	t.Cleanup(func() { _ = Reset(dir) })
	_ = Reset(dir)
	return dir
}

func TestLoadVerifies(t *testing.T) {
	requireRoot(t)
	d, err := Load(Config{PinDir: testPinDir(t)})
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
}

// TestLoadRefusesIncompatiblePins: maps pinned by a version whose layouts
// differ (here the sizes of flow_val and session_val before they were
// shrunk to 72 and 80 bytes) are not reused. Load names every such map
// with both sizes, touches nothing, and works once the pins are reset.
func TestLoadRefusesIncompatiblePins(t *testing.T) {
	requireRoot(t)
	dir := testPinDir(t)
	if err := ensureBPFFS(dir); err != nil {
		t.Fatal(err)
	}
	spec, err := loadDysco()
	if err != nil {
		t.Fatal(err)
	}
	old := map[string]uint32{"dysco_flows": 88, "dysco_sessions": 96}
	for name, vsize := range old {
		ms := spec.Maps[name].Copy()
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
		"dysco_flows (ValueSize: 88 changed to 72)", "dysco_sessions (ValueSize: 96 changed to 80)",
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
		{"session_val", binary.Size(Session{}), 80},
		{"dysco_ends", binary.Size(Ends{}), 36},
		{"dysco_tuple", binary.Size(Tuple{}), 40},
	} {
		if c.got != c.want {
			t.Errorf("%s is %d bytes, want %d", c.name, c.got, c.want)
		}
	}
}
