package lab

import (
	"encoding/json"
	"os"
	"path/filepath"
	"reflect"
	"testing"
)

// FuzzParseTopology: ParseTopology, which reads the user's topology files,
// never panics. What it accepts:
//   - is one JSON document (a typo, such as text after the topology, does not
//     go unnoticed);
//   - is a valid topology that the lab can lay out (plan), one host per
//     topology host, with distinct namespaces and IPv4 addresses;
//   - marshals back to JSON that parses to an equal topology.
//
// `go test` runs the seeds; `go test -run '^$' -fuzz '^FuzzParseTopology$'
// ./internal/lab` searches.
func FuzzParseTopology(f *testing.F) {
	files, _ := filepath.Glob("../../topologies/*.json")
	for _, file := range files {
		if data, err := os.ReadFile(file); err == nil {
			f.Add(data)
		}
	}
	for _, s := range []string{
		`{"name": "fig11", "kind": "star", "hosts": [{"name": "client1", "role": "client"}, {"name": "mb1"}]}`,
		`{"kind": "line", "hosts": [{"name": "client"}, {"name": "mb1", "role": "middlebox"}, {"name": "server", "role": "server"}]}`,
		`{"kind": "star", "hosts": [{"name": "a", "role": "host"}]}`,
		`{"kind": "star", "hosts": [{"name": "a", "rol": "client"}]}`,
		`{"kind": "line", "hosts": [{"name": "a"}]}`,
		`{"kind": "ring", "hosts": [{"name": "a"}]}`,
		`{"kind": "star", "hosts": [{"name": "router"}]}`,
		`{"kind": "star", "hosts": [{"name": "a"}, {"name": "a"}]}`,
		`{"kind": "star", "hosts": [{"name": "a", "role": "router"}]}`,
		`{"kind": "star", "hosts": [{"name": "a"}]} {"kind": "line"}`,
		`{"kind": "star", "hosts": [{"name": "a"}]`,
		`{"kind": "star", "hosts": null}`,
		`null`, `[]`, ``,
	} {
		f.Add([]byte(s))
	}

	f.Fuzz(func(t *testing.T, data []byte) {
		topo, err := ParseTopology(data)
		if err != nil {
			return
		}
		if !json.Valid(data) {
			t.Fatalf("accepted what is not one JSON document: %q", data)
		}
		if err := topo.Validate(); err != nil {
			t.Fatalf("accepted an invalid topology: %v", err)
		}
		ly, err := plan("fuzz", topo)
		if err != nil {
			t.Fatalf("accepted topology cannot be laid out: %v\n%+v", err, topo)
		}
		if len(ly.hosts) != len(topo.Hosts) {
			t.Fatalf("%d hosts laid out for %d", len(ly.hosts), len(topo.Hosts))
		}
		namespaces, addrs := map[string]bool{}, map[string]bool{}
		for _, h := range ly.all() {
			a := h.Addr4.String()
			if namespaces[h.Namespace] || !h.Addr4.IsValid() || addrs[a] {
				t.Fatalf("host %s: namespace %q, address %s, taken or invalid", h.Name, h.Namespace, a)
			}
			namespaces[h.Namespace], addrs[a] = true, true
		}
		enc, err := json.Marshal(topo)
		if err != nil {
			t.Fatal(err)
		}
		again, err := ParseTopology(enc)
		if err != nil {
			t.Fatalf("marshalled topology does not parse: %v\n%s", err, enc)
		}
		if !reflect.DeepEqual(again, topo) {
			t.Fatalf("round trip\n got %+v\nwant %+v", again, topo)
		}
	})
}
