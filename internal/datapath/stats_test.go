package datapath

import (
	"os"
	"regexp"
	"strings"
	"testing"
)

// TestStatNames checks that every counter of the datapath has a name: the
// stats map has one slot per entry of enum stat, and StatNames one name per
// slot.
func TestStatNames(t *testing.T) {
	requireRoot(t)
	d, err := Load(Config{PinDir: testPinDir(t)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { d.Close() })
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
