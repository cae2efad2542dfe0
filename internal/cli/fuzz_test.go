package cli

import (
	"encoding/json"
	"net/netip"
	"reflect"
	"strings"
	"testing"

	"github.com/dysco/dysco/internal/api"
	"github.com/dysco/dysco/internal/protocol"
	"github.com/dysco/dysco/internal/wire"
)

// FuzzSessionArgs: the strings that name a session and its hops on the
// command line and in the agent's API: prepend's tuple ("SRC:PORT ->
// DST:PORT", read by wire.ParseTuple, here and in the agent) and hop list,
// reconfig's --chain (parseHops), and a proxy's splice request (the JSON
// of api.SpliceRequest, two sockets' tuples). What each accepts:
//   - a tuple prints (Tuple.String) to a string that parses to the same
//     tuple, with IPv4-mapped addresses read as IPv4 and both ends of one
//     family;
//   - hops are valid addresses, IPv4 unmapped; --chain's are unicast,
//     distinct and at most api.MaxChain;
//   - a splice request encodes to JSON that decodes to the same request.
//
// `go test` runs the seeds; `go test -run '^$' -fuzz '^FuzzSessionArgs$'
// ./internal/cli` searches.
func FuzzSessionArgs(f *testing.F) {
	for _, s := range []struct{ tuple, hops, splice string }{
		{"10.0.0.1:40000 -> 10.0.0.9:80", "10.0.1.1,10.0.1.2",
			`{"in":{"local":"10.0.0.2:80","remote":"10.0.0.1:41234"},"out":{"local":"10.0.1.2:40000","remote":"10.0.1.3:80"},"delta":0,"delta_rev":0,"wait":false}`},
		{"[fd00::1]:1 -> [fd00::9]:443", "fd00::5, ::ffff:10.0.0.1",
			`{"in":{"local":"[fe80::1%eth0]:80","remote":"[fe80::2%eth0]:1"},"out":{"local":"[::1]:2","remote":"[::1]:3"},"delta":-9223372036854775808}`},
		{"10.0.0.1:1 10.0.0.2:2", "", `{"in":{"local":"10.0.0.2:80"}}`},
		{"10.0.0.1:1 -> [::1]:2", ",,", `{"in":{"local":"10.0.0.2"}}`},
		{"[::ffff:10.0.0.1]:1 -> 10.0.0.2:2", "224.0.0.1,127.0.0.1,0.0.0.0,10.0.0.1,10.0.0.1", `null`},
		{"[fe80::1%eth0]:1 -> [fe80::2%eth0]:2", "fe80::1%eth0", `{"delta":1e3}`},
		{" -> ", "x", `[]`},
		{"10.0.0.1:1 -> 10.0.0.2:2", "fw@10.0.1.1,10.0.1.2,ids@fd00::1,@10.0.0.3,a b@10.0.0.4", `{}`},
	} {
		f.Add(s.tuple, s.hops, []byte(s.splice))
	}
	f.Fuzz(func(t *testing.T, tuple, hops string, splice []byte) {
		if tu, err := wire.ParseTuple(tuple); err == nil {
			if tu.Src.Is4In6() || tu.Dst.Is4In6() {
				t.Fatalf("%q: IPv4-mapped address kept: %v", tuple, tu)
			}
			if tu.Src.Is4() != tu.Dst.Is4() {
				t.Fatalf("%q: accepted a tuple of two families: %v", tuple, tu)
			}
			again, err := wire.ParseTuple(tu.String())
			if err != nil || again != tu {
				t.Fatalf("%q: %v prints as %q, which parses to %v (%v)", tuple, tu, tu.String(), again, err)
			}
		}
		if hs, err := parsePrependHops(hops); err == nil {
			for _, h := range hs {
				if !h.IsValid() || h.Is4In6() {
					t.Fatalf("%q: hop %v", hops, h)
				}
			}
		}
		vals := strings.Split(hops, ",")
		if hs, err := parseHops("--chain", vals); err == nil {
			if len(hs) > api.MaxChain {
				t.Fatalf("%q: %d hops", hops, len(hs))
			}
			seen := map[netip.Addr]bool{}
			for _, h := range hs {
				if !wire.Unicast(h) || h.Is4In6() || seen[h] {
					t.Fatalf("%q: hop %v (not unicast, mapped or repeated)", hops, h)
				}
				seen[h] = true
			}
		}
		if hs, nfs, err := parseNFHops("--chain", vals); err == nil {
			if nfs != nil && len(nfs) != len(hs) || protocol.CheckNFs(hs, nfs) != nil {
				t.Fatalf("%q: hops %v, network functions %q", hops, hs, nfs)
			}
		}
		var req api.SpliceRequest
		if json.Unmarshal(splice, &req) == nil {
			enc, err := json.Marshal(req)
			if err != nil {
				t.Fatalf("accepted splice request does not encode: %v", err)
			}
			var again api.SpliceRequest
			if err := json.Unmarshal(enc, &again); err != nil || !reflect.DeepEqual(again, req) {
				t.Fatalf("splice request round trip: %+v -> %s -> %+v (%v)", req, enc, again, err)
			}
		}
	})
}
