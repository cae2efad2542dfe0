package datapath

import (
	"os"
	"regexp"
	"strings"
	"testing"

	"github.com/cilium/ebpf"
)

// TestStatNames checks that every counter of the datapath has a name: the
// stats map has one slot per entry of enum stat, and StatNames one name per
// slot.
func TestStatNames(t *testing.T) {
	d := loadTest(t)
	if n := d.Maps()["stats"].MaxEntries(); int(n) != len(StatNames) {
		t.Errorf("stats map has %d counters, StatNames names %d", n, len(StatNames))
	}
	seen := map[string]bool{}
	for _, n := range StatNames {
		if seen[n] {
			t.Errorf("counter name %q repeated", n)
		}
		seen[n] = true
	}
}

// TestStatEnum compares StatNames with enum stat in consts.h entry by entry
// (the names differ in spelling here and there, so only the order of the
// words that carry meaning is checked).
func TestStatEnum(t *testing.T) {
	src, err := os.ReadFile("../../bpf/include/consts.h")
	if err != nil {
		t.Fatal(err)
	}
	body := regexp.MustCompile(`(?s)enum stat \{(.*?)\};`).FindSubmatch(src)
	if body == nil {
		t.Fatal("no enum stat in consts.h")
	}
	var enum []string
	for _, m := range regexp.MustCompile(`\bSTAT_([A-Z0-9_]+)`).FindAllSubmatch(body[1], -1) {
		if string(m[1]) != "MAX" {
			enum = append(enum, strings.ToLower(string(m[1])))
		}
	}
	if len(enum) != len(StatNames) {
		t.Fatalf("enum stat has %d counters, StatNames %d", len(enum), len(StatNames))
	}
	// Known spellings that differ between C and Go.
	alias := map[string]string{"syn_retrans": "syn_retransmit", "drop_opt_space": "drop_option_space"}
	for i, e := range enum {
		want := e
		if a, ok := alias[e]; ok {
			want = a
		}
		if StatNames[i] != want {
			t.Errorf("counter %d: enum STAT_%s, StatNames %q", i, strings.ToUpper(e), StatNames[i])
		}
	}
}

// TestStatsBatch: the batch read of the counters (one system call) sums the
// same per-CPU values, under the same names, as one lookup per counter.
func TestStatsBatch(t *testing.T) {
	d := loadTest(t)
	ncpu, err := ebpf.PossibleCPU()
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]uint64{}
	for i, name := range StatNames {
		per := make([]uint64, ncpu)
		for c := range per {
			per[c] = uint64(1000*i + c + 1)
			want[name] += per[c]
		}
		if err := d.objs.DyscoStats.Put(uint32(i), per); err != nil {
			t.Fatal(err)
		}
	}
	got, ok := d.statsBatch()
	if !ok {
		t.Fatal("the kernel refused the batch lookup")
	}
	each, err := d.statsEach()
	if err != nil {
		t.Fatal(err)
	}
	for _, name := range StatNames {
		if got[name] != want[name] || each[name] != want[name] {
			t.Errorf("%s: batch %d, one by one %d, want %d", name, got[name], each[name], want[name])
		}
	}
	if len(got) != len(StatNames) {
		t.Errorf("batch read %d counters, want %d", len(got), len(StatNames))
	}
}
