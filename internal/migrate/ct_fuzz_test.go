package migrate

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"net/netip"
	"reflect"
	"testing"

	"github.com/dysco/dysco/internal/wire"
)

// ctFuzzSession is the session of FuzzConntrackState's imports (IPv4 or
// IPv6, chosen by the fuzzer).
func ctFuzzSession(v6 bool) Session {
	if v6 {
		return Session{Tuple: wire.Tuple{Src: netip.MustParseAddr("fd00::1"), Dst: netip.MustParseAddr("fd00::9"), SrcPort: 40000, DstPort: 443}, Proto: 6}
	}
	return Session{Tuple: wire.Tuple{Src: netip.MustParseAddr("10.0.0.1"), Dst: netip.MustParseAddr("10.0.0.9"), SrcPort: 40000, DstPort: 80}, Proto: 6}
}

// FuzzConntrackState: the conntrack state another host exports, as this
// host decodes it for an import (decodeState), whatever its bytes. What is
// accepted:
//   - holds only entries of the session, each with a reply tuple of the
//     session's family and protocol;
//   - encodes to JSON that decodes to the same state;
//   - gives, for every entry, netlink attributes (the key, the NAT ranges
//     and the settable fields that the import sends the kernel) that parse
//     back to the same tuple, NAT addresses and fields: nothing is cut or
//     misread on the way to the kernel.
//
// `go test` runs the seeds; `go test -run '^$' -fuzz '^FuzzConntrackState$'
// ./internal/migrate` searches.
func FuzzConntrackState(f *testing.F) {
	for _, v6 := range []bool{false, true} {
		orig := sessionTuple(ctFuzzSession(v6))
		reply := orig.reverse()
		nat := reply
		if v6 {
			nat.Src = netip.MustParseAddr("fd00::77")
		} else {
			nat.Src = netip.MustParseAddr("10.0.0.77")
		}
		for _, st := range []ctState{
			{Entries: []*ctEntry{{Orig: orig, Reply: reply, Status: 0x18e, Timeout: 431999, TCP: &ctTCP{State: 3, WscaleOrig: 7, WscaleReply: 9, FlagsOrig: 0x23}}}},
			{Entries: []*ctEntry{{Orig: orig, Reply: nat, Zone: 4, Mark: 9, Labels: []byte{1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x80}}},
				RulesFrom: "iptables-save", Rules: []fwRule{}},
			{},
		} {
			b, err := json.Marshal(st)
			if err != nil {
				f.Fatal(err)
			}
			f.Add(b, v6)
		}
	}
	for _, s := range []string{`{"entries":[null]}`, `{"entries":[{}]}`, `null`, `{"entries":[{"orig":{"src":"10.0.0.1"}}]}`,
		`{"entries":[{"orig":{"src":"10.0.0.1","dst":"10.0.0.9","sport":40000,"dport":80,"proto":6},"reply":{"src":"","dst":"","proto":6}}]}`} {
		f.Add([]byte(s), false)
	}
	f.Fuzz(func(t *testing.T, state []byte, v6 bool) {
		s := ctFuzzSession(v6)
		st, err := decodeState(s, state)
		if err != nil {
			return
		}
		orig := sessionTuple(s)
		for _, e := range st.Entries {
			if e.Orig != orig || e.Reply.Src.Is4() != orig.Src.Is4() || e.Reply.Proto != orig.Proto {
				t.Fatalf("accepted entry %s / %s for session %s", e.Orig, e.Reply, s)
			}
		}
		enc, err := json.Marshal(st)
		if err != nil {
			t.Fatalf("accepted state does not encode: %v", err)
		}
		again, err := decodeState(s, enc)
		if err != nil || !reflect.DeepEqual(again, st) {
			t.Fatalf("state round trip: %v\n got %+v\nwant %+v", err, again, st)
		}
		for _, e := range st.Entries {
			checkEntryAttrs(t, e)
		}
	})
}

// checkEntryAttrs checks that the attributes an import sends for e parse
// back to e's key, NAT binding and settable fields.
func checkEntryAttrs(t *testing.T, e *ctEntry) {
	t.Helper()
	m, err := parseAttrs(keyAttrs(e.Orig, e.Zone))
	if err != nil {
		t.Fatalf("key attributes: %v", err)
	}
	if got, err := parseTuple(m[ctaTupleOrig]); err != nil || got != e.Orig {
		t.Fatalf("key tuple %v (%v), want %v", got, err, e.Orig)
	}
	if z := m[ctaZone]; len(z) != 2 || binary.BigEndian.Uint16(z) != e.Zone {
		t.Fatalf("zone %x, want %d", z, e.Zone)
	}
	nat, err := parseAttrs(natAttrs(e))
	if err != nil {
		t.Fatalf("NAT attributes: %v", err)
	}
	for typ, want := range map[uint16]netip.AddrPort{ctaNatDst: netip.AddrPortFrom(e.Reply.Src, e.Reply.Sport), ctaNatSrc: netip.AddrPortFrom(e.Reply.Dst, e.Reply.Dport)} {
		v, ok := nat[typ]
		if !ok {
			continue
		}
		r, err := parseAttrs(v)
		if err != nil {
			t.Fatalf("NAT range: %v", err)
		}
		min := r[ctaNatV4Min]
		if !want.Addr().Is4() {
			min = r[ctaNatV6Min]
		}
		if a, ok := netip.AddrFromSlice(min); !ok || a != want.Addr() {
			t.Fatalf("NAT range from %x, want %v", min, want)
		}
	}
	set, err := parseAttrs(setAttrs(e, e.Status))
	if err != nil {
		t.Fatalf("settable attributes: %v", err)
	}
	if !bytes.Equal(set[ctaLabels], e.Labels) {
		t.Fatalf("labels sent as %d bytes, want the %d imported", len(set[ctaLabels]), len(e.Labels))
	}
	if v := set[ctaMark]; len(v) != 4 || binary.BigEndian.Uint32(v) != e.Mark {
		t.Fatalf("mark %x, want %d", v, e.Mark)
	}
}

// FuzzConntrackNetlink: parseEntry, which reads the kernel's conntrack
// entries (ctnetlink) for an export, whatever the bytes. What it accepts
// has original and reply tuples whose ends are valid addresses of one
// family, and whose attributes (ctTuple.attrs, as an import sends them)
// parse back to the same tuples; and the entry encodes to JSON that
// decodes to the same entry (what the export sends is what was read).
//
// `go test` runs the seeds; `go test -run '^$' -fuzz '^FuzzConntrackNetlink$'
// ./internal/migrate` searches.
func FuzzConntrackNetlink(f *testing.F) {
	for _, v6 := range []bool{false, true} {
		orig := sessionTuple(ctFuzzSession(v6))
		e := &ctEntry{Orig: orig, Reply: orig.reverse(), Zone: 2, Status: 0x18e, Timeout: 120, Mark: 5,
			Labels: []byte{0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0}, TCP: &ctTCP{State: 3, WscaleOrig: 7, WscaleReply: 7, FlagsOrig: 0x23, FlagsReply: 0x23}}
		b := attrs(nil).nest(ctaTupleOrig, e.Orig.attrs()).nest(ctaTupleReply, e.Reply.attrs()).be16(ctaZone, e.Zone).
			add(ctaStatus, binary.BigEndian.AppendUint32(nil, e.Status))
		b = append(b, setAttrs(e, e.Status)...)
		f.Add([]byte(b))
		f.Add([]byte(b[:len(b)/2]))
	}
	f.Add([]byte{4, 0, 1, 0})
	f.Add([]byte{})
	f.Fuzz(func(t *testing.T, b []byte) {
		e, err := parseEntry(b)
		if err != nil {
			return
		}
		for _, tu := range []ctTuple{e.Orig, e.Reply} {
			if !tu.Src.IsValid() || !tu.Dst.IsValid() || tu.Src.Is4() != tu.Dst.Is4() {
				t.Fatalf("accepted tuple %v", tu)
			}
			m, err := parseAttrs(tu.attrs())
			if err != nil {
				t.Fatal(err)
			}
			if got, err := parseTuple(attrs(nil).nest(ctaTupleIP, m[ctaTupleIP]).nest(ctaTupleProto, m[ctaTupleProto])); err != nil || got != tu {
				t.Fatalf("tuple %v sent as attributes reads back as %v (%v)", tu, got, err)
			}
		}
		enc, err := json.Marshal(e)
		if err != nil {
			t.Fatal(err)
		}
		var again ctEntry
		if err := json.Unmarshal(enc, &again); err != nil || !reflect.DeepEqual(&again, e) {
			t.Fatalf("entry JSON round trip: %v\n got %+v\nwant %+v", err, again, e)
		}
	})
}
