package protocol

import (
	"bytes"
	"encoding/binary"
	"errors"
	"net/netip"
	"reflect"
	"testing"

	"github.com/dysco/dysco/internal/wire"
)

// FuzzDecode: Decode, which reads control messages from other hosts over
// UDP, never panics, and errors are always *DecodeError. Every input is
// decoded twice: as it is (almost always a MAC mismatch) and with its MAC
// recomputed under the key (remac), so that the fuzzer reaches the parsing
// and validation behind the HMAC check. What Decode accepts:
//   - has the length its hop count says, at most wire.MaxHops hops, and a
//     known type, flags and reason;
//   - encodes again (Encode, same key) to bytes that decode to an equal
//     message;
//   - and those bytes are the input's: the encoding is canonical (IPv4
//     addresses are written IPv4-mapped and read back unmapped; an absent
//     address is all zeros either way) but for one field Decode drops: the
//     blocker's id when there is no blocker address.
//
// `go test` runs the seeds; `go test -run '^$' -fuzz '^FuzzDecode$'
// ./internal/protocol` searches.
func FuzzDecode(f *testing.F) {
	v6 := sampleMessage6()
	var good []byte
	for _, typ := range MsgTypes {
		for _, base := range []*Message{sampleMessage(), v6} {
			m := sampleOf(typ, base)
			if typ != MsgNackLock && typ != MsgTriggerResult && typ != MsgMigrate && typ != MsgMigrateAnswer {
				m.Blocker, m.Reason = ReqKey{}, ReasonNone
			}
			b, err := m.Encode(testKey, testFrom)
			if err != nil {
				f.Fatal(err)
			}
			f.Add(b)
			if good == nil {
				good = b
			}
		}
	}
	// A syn that ends at the receiver (no hops), and the largest message.
	end := sampleMessage()
	end.Hops, end.RightAnchor = nil, end.Sub.Dst
	full := sampleMessage()
	full.Hops = nil
	for i := range wire.MaxHops {
		full.Hops = append(full.Hops, addr(20+i))
	}
	full.RightAnchor = full.Hops[wire.MaxHops-1]
	for _, m := range []*Message{end, full} {
		b, err := m.Encode(testKey, testFrom)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
	// Triggers: without a migration spec, an answer that the request
	// still runs, an answer with no report, the longest report.
	trig := sampleOf(MsgTrigger, sampleMessage())
	trig.Migrate = nil
	running := sampleOf(MsgTriggerResult, sampleMessage())
	running.Reason, running.Blocker, running.Answer = ReasonNone, ReqKey{}, &TriggerAnswer{Micros: 5}
	bare := sampleOf(MsgTriggerResult, v6)
	bare.Answer.Report, bare.Answer.Hop = nil, netip.Addr{}
	long := sampleOf(MsgTriggerResult, sampleMessage())
	long.Answer.Report = bytes.Repeat([]byte{'r'}, MaxReportLen)
	var answer []byte
	for _, m := range []*Message{&trig, &running, &bare, &long} {
		b, err := m.Encode(testKey, testFrom)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
		if m == &bare {
			answer = b
		}
	}
	withSpec := sampleOf(MsgTrigger, sampleMessage())
	spec, err := withSpec.Encode(testKey, testFrom)
	if err != nil {
		f.Fatal(err)
	}
	at := func(b []byte, i int) int { return len(b) - MACLen - extLen(f, &Message{Answer: bare.Answer}) + i }
	editOf := func(src []byte, fn func(b []byte) []byte) []byte { return fn(append([]byte(nil), src...)) }
	specAt := len(spec) - MACLen - extMigrateLen
	f.Add(editOf(spec, func(b []byte) []byte { b[specAt] = 2; return remac(b) }))        // extension version
	f.Add(editOf(spec, func(b []byte) []byte { b[specAt+1] = 2; return remac(b) }))      // an answer's kind on a trigger
	f.Add(editOf(spec, func(b []byte) []byte { b[specAt+2] = 9; return remac(b) }))      // unknown semantics
	f.Add(editOf(spec, func(b []byte) []byte { b[specAt+4] = 0xff; return remac(b) }))   // hold limit too large
	f.Add(editOf(spec, func(b []byte) []byte { b[155]--; return remac(b[:len(b)-1]) }))  // spec one byte short
	f.Add(editOf(answer, func(b []byte) []byte { b[at(b, 2)] = 9; return remac(b) }))    // unknown outcome
	f.Add(editOf(answer, func(b []byte) []byte { b[at(b, 3)] = 0x80; return remac(b) })) // unknown flag
	f.Add(editOf(answer, func(b []byte) []byte { b[at(b, 33)] = 1; return remac(b) }))   // a report past the end
	f.Add(editOf(answer, func(b []byte) []byte { b[7] = byte(ReasonNoAnswer); return remac(b) }))
	f.Add(editOf(answer, func(b []byte) []byte { b[6] = FlagLeftward; return remac(b) }))
	f.Add(editOf(answer, func(b []byte) []byte { b[154], b[155] = 0xff, 0xff; return remac(b) }))
	f.Add(editOf(good, func(b []byte) []byte { b[155] = 2; return remac(append(b[:len(b)-MACLen], 1, 1, 0)) })) // an extension on a syn
	// Migration steps: a freeze with its fields, an export's answer with
	// the largest state, a failure, a running answer; and edits.
	freeze := sampleOf(MsgMigrate, sampleMessage())
	freeze.Mig = &MigStep{Op: MigFreeze, Semantics: MigrateOrder, HoldLimit: 1 << 20, TimeoutMS: 5000, DrainMS: 200,
		Marks: FlowMarks{Seq: 5, Ack: 6, OK: true}}
	exported := sampleOf(MsgMigrateAnswer, v6)
	exported.Mig = &MigStep{Op: MigExport, Blob: bytes.Repeat([]byte{'s'}, MaxStateLen)}
	failed := sampleOf(MsgMigrateAnswer, sampleMessage())
	failed.Mig = &MigStep{Op: MigImport, Failed: true, Text: "the provider refuses"}
	runningMig := sampleOf(MsgMigrateAnswer, sampleMessage())
	runningMig.Mig = &MigStep{Op: MigExport, Running: true}
	var fz []byte
	for _, m := range []*Message{&freeze, &exported, &failed, &runningMig} {
		b, err := m.Encode(testKey, testFrom)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
		if m == &freeze {
			fz = b
		}
	}
	migAt := len(fz) - MACLen - extMigStepLen
	f.Add(editOf(fz, func(b []byte) []byte { b[migAt+2] = 9; return remac(b) }))               // unknown op
	f.Add(editOf(fz, func(b []byte) []byte { b[migAt+4] |= 0x80; return remac(b) }))           // unknown flag
	f.Add(editOf(fz, func(b []byte) []byte { b[migAt+5] = 1; return remac(b) }))               // reserved byte
	f.Add(editOf(fz, func(b []byte) []byte { b[migAt+35] = 1; return remac(b) }))              // a blob past the end
	f.Add(editOf(fz, func(b []byte) []byte { b[migAt+2] = byte(MigExport); return remac(b) })) // marks on an export
	// Network functions (NFBody): a syn naming them, a synAck that one
	// starts, a refusal; and edits.
	nfSyn := sampleMessage()
	nfSyn.Hops = []netip.Addr{addr(20), nfSyn.RightAnchor}
	nfSyn.NF = &NFBody{Names: []string{"firewall", ""}}
	nfStarting := sampleOf(MsgSynAck, sampleMessage())
	nfStarting.Flags, nfStarting.Blocker, nfStarting.Reason, nfStarting.NF = 0, ReqKey{}, ReasonNone, &NFBody{Names: []string{"ids-2"}}
	nfRefused := sampleOf(MsgSynAck, v6)
	nfRefused.Flags, nfRefused.Reason, nfRefused.Blocker = FlagRefuse, ReasonNF, ReqKey{}
	nfRefused.Hops = []netip.Addr{v6.Sub.Dst}
	nfRefused.NF = &NFBody{Names: []string{"firewall"}, Text: "not ready within 10s"}
	var nfb []byte
	for _, m := range []*Message{nfSyn, &nfStarting, &nfRefused} {
		b, err := m.Encode(testKey, testFrom)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
		if m == nfSyn {
			nfb = b
		}
	}
	nfAt := len(nfb) - MACLen - (extNFLen + 1 + len("firewall") + 1)
	f.Add(editOf(nfb, func(b []byte) []byte { b[nfAt+2] = 1; return remac(b) }))       // count short of the hops
	f.Add(editOf(nfb, func(b []byte) []byte { b[nfAt+3] = 1; return remac(b) }))       // reserved byte
	f.Add(editOf(nfb, func(b []byte) []byte { b[nfAt+7] = '!'; return remac(b) }))     // a bad character
	f.Add(editOf(nfb, func(b []byte) []byte { b[nfAt+6] = 200; return remac(b) }))     // a name past the end
	f.Add(editOf(nfb, func(b []byte) []byte { b[nfAt+5] = 1; return remac(b) }))       // a text past the end
	f.Add(editOf(nfb, func(b []byte) []byte { b[5] = byte(MsgAck); return remac(b) })) // on an ack
	f.Add(editOf(nfb, func(b []byte) []byte {                                          // a name for the right anchor
		b[nfAt+2], b[155] = 3, b[155]+2
		return remac(append(append(b[:len(b)-MACLen], 1, 'x'), make([]byte, MACLen)...))
	}))
	edit := func(fn func(b []byte) []byte) []byte { return fn(append([]byte(nil), good...)) }
	f.Add([]byte(nil))
	f.Add(good[:5])
	f.Add(good[:MsgHeaderLen])
	f.Add(good[:len(good)-1])
	f.Add(edit(func(b []byte) []byte { return append(b, 0) }))
	f.Add(edit(func(b []byte) []byte { b[153] = 9; return remac(b) }))
	f.Add(edit(func(b []byte) []byte { b[153] = 1; return remac(b) }))
	f.Add(edit(func(b []byte) []byte { b[5] = 99; return remac(b) }))
	f.Add(edit(func(b []byte) []byte { b[6] |= 0x80; return remac(b) }))
	f.Add(edit(func(b []byte) []byte { b[154] = 1; return remac(b) }))
	f.Add(edit(func(b []byte) []byte { clear(b[124:140]); return remac(b) })) // a blocker id, no blocker address
	f.Add(edit(func(b []byte) []byte { clear(b[16:32]); return remac(b) }))   // no subsession source

	f.Fuzz(func(t *testing.T, b []byte) {
		check := func(in []byte) {
			m, err := Decode(testKey, testFrom, in)
			if err != nil {
				var de *DecodeError
				if !errors.As(err, &de) || de.Reason < RejectMalformed || de.Reason > RejectRate {
					t.Fatalf("error %v (%T) is not a *DecodeError with a reason", err, err)
				}
				return
			}
			if n := extLen(t, m); len(m.Hops) > wire.MaxHops || n > MaxExtLen || len(in) != MsgHeaderLen+len(m.Hops)*wire.AddrLen+n+MACLen {
				t.Fatalf("accepted %d bytes with %d hops and an extension of %d", len(in), len(m.Hops), n)
			}
			if m.Type < MsgRequestLock || m.Type > MsgRebindAck || m.Flags&^knownFlags != 0 || m.Flags != 0 && (m.Type == MsgRebind || m.Type == MsgRebindAck) || m.Reason > lastWireReason && m.Reason != ReasonNF {
				t.Fatalf("accepted type %d, flags %#x, reason %d", m.Type, m.Flags, m.Reason)
			}
			if m.Migrate != nil && m.Type != MsgTrigger || (m.Answer != nil) != (m.Type == MsgTriggerResult) ||
				(m.Mig != nil) != (m.Type == MsgMigrate || m.Type == MsgMigrateAnswer) ||
				m.NF != nil && m.Type != MsgSyn && m.Type != MsgSynAck {
				t.Fatalf("accepted a %s with migrate=%v answer=%v", m.Type, m.Migrate, m.Answer)
			}
			enc, err := m.Encode(testKey, testFrom)
			if err != nil {
				t.Fatalf("decoded message does not encode: %v\n%s", err, m)
			}
			again, err := Decode(testKey, testFrom, enc)
			if err != nil {
				t.Fatalf("re-encoded message does not decode: %v\n%s", err, m)
			}
			if !reflect.DeepEqual(again, m) {
				t.Fatalf("round trip\n got %+v\nwant %+v", again, m)
			}
			want := append([]byte(nil), in[:len(in)-MACLen]...)
			if !m.Blocker.LeftAnchor.IsValid() {
				binary.BigEndian.PutUint32(want[140:], 0)
			}
			if !bytes.Equal(enc[:len(enc)-MACLen], want) {
				t.Fatalf("re-encoding differs from the input\n got %x\nwant %x", enc, in)
			}
		}
		check(b)
		if len(b) >= MACLen {
			check(remac(b))
		}
	})
}
