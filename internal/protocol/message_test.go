package protocol

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"
	"reflect"
	"strings"
	"sync"
	"testing"

	"github.com/dysco/dysco/internal/keys"
	"github.com/dysco/dysco/internal/wire"
)

func sampleMessage() *Message {
	return &Message{
		Type:        MsgSyn,
		Flags:       FlagLeftward | FlagGrant,
		Reason:      ReasonLocked,
		Nonce:       testNonce,
		Sub:         wire.Tuple{Src: addr(1), Dst: addr(6), SrcPort: 40000, DstPort: 80},
		Session:     sessionTuple,
		Req:         ReqKey{LeftAnchor: addr(1), ID: 42},
		RightAnchor: addr(4),
		Blocker:     ReqKey{LeftAnchor: addr(2), ID: 7},
		Delta:       Delta{Seq: neg(-12345), TS: 99},
		LeftDelta:   Delta{Seq: 777, TS: neg(-5)},
		WScale:      7,
		Hops:        []netip.Addr{addr(7), addr(4)},
	}
}

// sampleMessage6 is sampleMessage with IPv6 addresses throughout.
func sampleMessage6() *Message {
	a := func(i int) netip.Addr { return netip.AddrFrom16([16]byte{0x20, 0x01, 0x0d, 0xb8, 15: byte(i)}) }
	m := sampleMessage()
	m.Sub = wire.Tuple{Src: a(1), Dst: a(6), SrcPort: 1, DstPort: 2}
	m.Session = wire.Tuple{Src: a(1), Dst: a(9), SrcPort: 3, DstPort: 443}
	m.Req.LeftAnchor, m.RightAnchor, m.Blocker.LeftAnchor = a(1), a(4), a(2)
	m.Hops = []netip.Addr{a(7), a(4)}
	return m
}

// sampleOf is base made a message of type typ: hops only where a type
// carries them; a trigger with the new chain and a migration spec, an
// answer with its body (no flags on either).
func sampleOf(typ MsgType, base *Message) Message {
	m := *base
	m.Type = typ
	switch typ {
	case MsgSyn:
	case MsgTrigger:
		m.Flags, m.Reason, m.Blocker = 0, ReasonNone, ReqKey{}
		m.Migrate = &MigrateSpec{Semantics: MigrateOrder, HoldLimit: 1 << 20, TimeoutMS: 2500}
	case MsgTriggerResult:
		m.Flags, m.Hops = 0, nil
		m.Answer = &TriggerAnswer{Outcome: Refused, Unconfirmed: true, ReqID: 77, Hop: m.Hops0(), Micros: 12345,
			Report: []byte(`{"semantics":"order"}`)}
	case MsgMigrate:
		m.Flags, m.Reason, m.Blocker, m.Hops = 0, ReasonNone, ReqKey{}, nil
		m.Mig = &MigStep{Op: MigImport, Blob: []byte(`{"conntrack":"AAEC"}`)}
	case MsgMigrateAnswer:
		m.Flags, m.Reason, m.Blocker, m.Hops = 0, ReasonNone, ReqKey{}, nil
		m.Mig = &MigStep{Op: MigFreeze, Text: "drain timeout", Marks: FlowMarks{Seq: 1 << 31, Ack: 7, OK: true}}
	case MsgRebind, MsgRebindAck:
		m.Flags, m.Hops = 0, nil
	default:
		m.Hops = nil
	}
	return m
}

// Hops0 is m's first hop, or no address.
func (m *Message) Hops0() netip.Addr {
	if len(m.Hops) == 0 {
		return netip.Addr{}
	}
	return m.Hops[0]
}

// extLen is the length of m's extension body.
func extLen(t testing.TB, m *Message) int {
	x, err := m.ext()
	if err != nil {
		t.Fatal(err)
	}
	return len(x)
}

func TestMessageRoundTrip(t *testing.T) {
	for _, typ := range MsgTypes {
		for _, base := range []*Message{sampleMessage(), sampleMessage6()} {
			m := sampleOf(typ, base)
			b, err := m.Encode(testKey, testFrom)
			if err != nil {
				t.Fatal(err)
			}
			if len(b) != MsgHeaderLen+len(m.Hops)*wire.AddrLen+extLen(t, &m)+MACLen {
				t.Errorf("%s: %d bytes", typ, len(b))
			}
			got, err := Decode(testKey, testFrom, b)
			if err != nil {
				t.Fatalf("%s: %v", typ, err)
			}
			if !reflect.DeepEqual(got, &m) {
				t.Errorf("%s: round trip\n got %+v\nwant %+v", typ, got, &m)
			}
		}
	}
}

// remac recomputes the MAC after a test edits the body: the message is then
// authentic but malformed, so that the later checks are exercised.
func remac(b []byte) []byte {
	return testKey.seal(append([]byte(nil), b[:len(b)-MACLen]...), testFrom)
}

func TestMessageRejects(t *testing.T) {
	good, err := sampleMessage().Encode(testKey, testFrom)
	if err != nil {
		t.Fatal(err)
	}
	edit := func(f func(b []byte) []byte) []byte {
		return f(append([]byte(nil), good...))
	}
	for _, tc := range []struct {
		name string
		b    []byte
		key  *Keys
		want RejectReason
	}{
		{"empty", nil, testKey, RejectMalformed},
		{"truncated", good[:100], testKey, RejectMalformed},
		{"bad magic", edit(func(b []byte) []byte { b[0] ^= 1; return b }), testKey, RejectMagic},
		{"future version", edit(func(b []byte) []byte { b[4] = MsgVersion + 1; return remac(b) }), testKey, RejectVersion},
		{"forged field", edit(func(b []byte) []byte { b[144] ^= 0x80; return b }), testKey, RejectMAC},
		{"forged mac", edit(func(b []byte) []byte { b[len(b)-1] ^= 1; return b }), testKey, RejectMAC},
		{"other deployment", good, NewKeys([]byte("another key")), RejectMAC},
		{"version 4 of an older agent", edit(func(b []byte) []byte { b[4] = 4; return b }), testKey, RejectVersion},
		{"extra byte", append(append([]byte(nil), good...), 0), testKey, RejectMalformed},
		{"hop count too big", edit(func(b []byte) []byte { b[153] = 9; return b }), testKey, RejectMalformed},
		{"hop count mismatch", edit(func(b []byte) []byte { b[153] = 1; return remac(b) }), testKey, RejectMalformed},
		{"unknown type", edit(func(b []byte) []byte { b[5] = 99; return remac(b) }), testKey, RejectMalformed},
		{"reserved flag", edit(func(b []byte) []byte { b[6] |= 0x80; return remac(b) }), testKey, RejectMalformed},
		{"reserved bytes", edit(func(b []byte) []byte { b[154] = 1; return remac(b) }), testKey, RejectMalformed},
		{"zero port", edit(func(b []byte) []byte { binary.BigEndian.PutUint16(b[48:], 0); return remac(b) }), testKey, RejectMalformed},
		{"multicast hop", edit(func(b []byte) []byte {
			putAddr(b[MsgHeaderLen:], netip.MustParseAddr("224.0.0.1"))
			return remac(b)
		}), testKey, RejectMalformed},
		{"repeated hop", edit(func(b []byte) []byte {
			putAddr(b[MsgHeaderLen:], addr(4))
			return remac(b)
		}), testKey, RejectMalformed},
		{"hop of the other family", edit(func(b []byte) []byte {
			putAddr(b[MsgHeaderLen:], netip.MustParseAddr("2001:db8::7"))
			return remac(b)
		}), testKey, RejectMalformed},
		{"subsession of both families", edit(func(b []byte) []byte {
			putAddr(b[32:48], netip.MustParseAddr("2001:db8::6"))
			return remac(b)
		}), testKey, RejectMalformed},
		{"loopback session destination", edit(func(b []byte) []byte {
			putAddr(b[68:84], netip.MustParseAddr("127.0.0.1"))
			return remac(b)
		}), testKey, RejectMalformed},
		{"broadcast left anchor", edit(func(b []byte) []byte {
			putAddr(b[88:104], netip.MustParseAddr("255.255.255.255"))
			return remac(b)
		}), testKey, RejectMalformed},
		{"right anchor of the other family", edit(func(b []byte) []byte {
			putAddr(b[108:124], netip.MustParseAddr("2001:db8::4"))
			return remac(b)
		}), testKey, RejectMalformed},
		{"unspecified blocker", edit(func(b []byte) []byte {
			putAddr(b[124:140], netip.MustParseAddr("::ffff:0.0.0.0"))
			return remac(b)
		}), testKey, RejectMalformed},
		{"syn list not ending at right anchor", edit(func(b []byte) []byte {
			b[MsgHeaderLen+2*wire.AddrLen-1] = 99 // last hop 10.0.0.99
			return remac(b)
		}), testKey, RejectMalformed},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := Decode(tc.key, testFrom, tc.b)
			var de *DecodeError
			if !errors.As(err, &de) || de.Reason != tc.want {
				t.Fatalf("got %v, want %s", err, tc.want)
			}
		})
	}
}

// Agent-level rejections: replays, wrong nonce, wrong sender, unknown
// session; none of them changes any state.
func TestAgentRejects(t *testing.T) {
	h := newHarness(t, 4)
	h.chain([]int{1, 2, 3, 4}, nil)
	h.reconfigure(1, 3, nil, 1)
	first := h.queue[0] // requestLock #1 from 1 to 2
	h.run()
	h.reconfigure(1, 4, nil, 2)
	h.run()
	if h.result(1).Outcome != Succeeded || h.result(2).Outcome != Succeeded {
		t.Fatalf("setup\n%s", h.trace())
	}
	// Build messages on the live subsession 1 -> 4 (after both requests).
	v1, _ := h.view(1)
	sub := v1.Sides[SideRight].Sub
	// mk encodes a message as sent by from (a key holder there).
	mk := func(from netip.Addr, mut func(m *Message)) []byte {
		m := &Message{Type: MsgRequestLock, Nonce: testNonce, Sub: sub, Session: sessionTuple,
			Req: ReqKey{LeftAnchor: addr(1), ID: 1}, RightAnchor: addr(4)}
		mut(m)
		b, err := m.Encode(testKey, from)
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	for _, tc := range []struct {
		name string
		from netip.Addr
		to   netip.Addr
		b    []byte
		want RejectReason
	}{
		{"replayed old request", addr(1), addr(4), mk(addr(1), func(*Message) {}), RejectReplay},
		{"wrong nonce", addr(1), addr(4), mk(addr(1), func(m *Message) { m.Nonce[0] ^= 1; m.Req.ID = 9 }), RejectNonce},
		{"wrong sender", addr(2), addr(4), mk(addr(2), func(m *Message) { m.Req.ID = 9 }), RejectWrongPeer},
		{"replayed from another address", addr(2), addr(4), mk(addr(1), func(m *Message) { m.Req.ID = 9 }), RejectMAC},
		{"unknown subsession", addr(1), addr(2), first.data, RejectUnknownSession},
		{"wrong direction", addr(4), addr(1), mk(addr(4), func(m *Message) { m.Req.ID = 9 }), RejectUnexpected},
		{"forged", addr(1), addr(4), append(mk(addr(1), func(m *Message) { m.Req.ID = 9 })[:MsgHeaderLen], make([]byte, MACLen)...), RejectMAC},
	} {
		t.Run(tc.name, func(t *testing.T) {
			before, _ := h.agents[tc.to].View(sid)
			h.rejected = nil
			h.deliver(tc.to, MessageIn{From: tc.from, Data: tc.b})
			if len(h.rejected) != 1 || h.rejected[0].Reason != tc.want {
				t.Fatalf("rejected %+v, want %s", h.rejected, tc.want)
			}
			if len(h.queue) != 0 {
				t.Fatalf("answered: %v", h.queue[0].msg)
			}
			after, _ := h.agents[tc.to].View(sid)
			if !reflect.DeepEqual(before, after) {
				t.Fatalf("state changed\n%+v\n%+v", before, after)
			}
		})
	}
}

// TestMACKeys: messages under different keys, encoded and decoded at once
// from many goroutines, each authenticate under their own key only (each
// key pools its HMAC states).
func TestMACKeys(t *testing.T) {
	keys := []*Keys{NewKeys([]byte("key one")), NewKeys([]byte("key two")),
		NewKeys([]byte("a third, longer key than SHA-256's block of sixty-four bytes"))}
	var wg sync.WaitGroup
	errs := make(chan error, 64)
	for g := range 8 {
		wg.Go(func() {
			for i := range 200 {
				k, other := keys[(g+i)%3], keys[(g+i+1)%3]
				m := sampleMessage()
				m.Req.ID = uint32(g*1000 + i)
				b, err := m.Encode(k, testFrom)
				if err != nil {
					errs <- err
					return
				}
				if got, err := Decode(k, testFrom, b); err != nil || got.Req.ID != m.Req.ID {
					errs <- fmt.Errorf("decode under its own key: %v", err)
					return
				}
				if _, err := Decode(other, testFrom, b); err == nil {
					errs <- errors.New("a message authenticated under another key")
					return
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
}

// The MAC covers the sender's address: a message taken off the wire and
// sent again from another address is refused before anything reads it,
// whatever its kind, and whether the address is another host's or the
// same host's in the other family.
func TestMACSender(t *testing.T) {
	v6 := sampleMessage6()
	for _, typ := range MsgTypes {
		for _, base := range []*Message{sampleMessage(), v6} {
			m := sampleOf(typ, base)
			from := m.Sub.Src
			b, err := m.Encode(testKey, from)
			if err != nil {
				t.Fatal(err)
			}
			if _, err := Decode(testKey, from, b); err != nil {
				t.Fatalf("%s from its sender %s: %v", typ, from, err)
			}
			for _, other := range []netip.Addr{m.Sub.Dst, addr(99), netip.MustParseAddr("fd00::1"), netip.Addr{}} {
				if _, err := Decode(testKey, other, b); !isReject(err, RejectMAC) {
					t.Errorf("%s sent by %s, replayed from %s: %v, want %s", typ, from, other, err, RejectMAC)
				}
			}
		}
	}
	// An IPv4 sender is the same address whether the socket reports it
	// plain or IPv4-mapped.
	m := sampleMessage()
	b, _ := m.Encode(testKey, addr(1))
	if _, err := Decode(testKey, netip.AddrFrom16(addr(1).As16()), b); err != nil {
		t.Fatalf("IPv4-mapped sender: %v", err)
	}
}

// Keys from a ring of deployment secrets: each verifies, the first signs;
// a key no longer in the ring no longer verifies. This is a rotation as
// the agents of a deployment see it (docs/operating.md, "Control keys").
func TestKeysRotation(t *testing.T) {
	oldS, newS := []byte("the old deployment secret"), []byte("the new deployment secret")
	ring := func(secrets ...[]byte) *Keys {
		r, err := keys.NewRing(secrets...)
		if err != nil {
			t.Fatal(err)
		}
		return KeysFromRing(r)
	}
	before, adding, moved, after := ring(oldS), ring(oldS, newS), ring(newS, oldS), ring(newS)
	msg := func(k *Keys) []byte {
		b, err := sampleMessage().Encode(k, testFrom)
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	for _, tc := range []struct {
		name         string
		signer, recv *Keys
		ok           bool
	}{
		{"old to old", before, before, true},
		{"old to old+new", before, adding, true},
		{"old+new to old", adding, before, true},
		{"new+old to old+new", moved, adding, true},
		{"old+new to new+old", adding, moved, true},
		{"new+old to new", moved, after, true},
		{"new to new+old", after, moved, true},
		{"new to old", after, before, false},
		{"old to new", before, after, false},
		{"old+new to new", adding, after, false},
	} {
		_, err := Decode(tc.recv, testFrom, msg(tc.signer))
		if tc.ok && err != nil || !tc.ok && !isReject(err, RejectMAC) {
			t.Errorf("%s: %v, want accepted=%v", tc.name, err, tc.ok)
		}
	}
	// The control key is derived: the raw secret is not it.
	if _, err := Decode(NewKeys(oldS), testFrom, msg(before)); !isReject(err, RejectMAC) {
		t.Fatalf("a message authenticated under the raw secret: %v", err)
	}
}

// BenchmarkMessage is what an agent pays per control message for its
// encoding and authentication: Encode at the sender, Decode at the
// receiver.
func BenchmarkMessage(b *testing.B) {
	k := NewKeys([]byte("deployment key of the benchmark"))
	m := sampleMessage()
	for b.Loop() {
		buf, err := m.Encode(k, testFrom)
		if err != nil {
			b.Fatal(err)
		}
		if _, err := Decode(k, testFrom, buf); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkMessageRotation: the same during a rotation, at a receiver that
// signs with the new key while its peer still signs with the old one,
// second in the receiver's ring: one HMAC more per message received.
func BenchmarkMessageRotation(b *testing.B) {
	oldK, newK := []byte("deployment key of the benchmark"), []byte("the new deployment key")
	sender, recv := NewKeys(oldK, newK), NewKeys(newK, oldK)
	m := sampleMessage()
	for b.Loop() {
		buf, err := m.Encode(sender, testFrom)
		if err != nil {
			b.Fatal(err)
		}
		if _, err := Decode(recv, testFrom, buf); err != nil {
			b.Fatal(err)
		}
	}
}

// The flags and lists that version 3 added: where they may appear.
func TestMessageListsAndFlags(t *testing.T) {
	mk := func(typ MsgType, flags uint8, r Reason, hops ...int) *Message {
		m := sampleMessage()
		m.Type, m.Flags, m.Reason, m.Hops = typ, flags, r, nil
		for _, h := range hops {
			m.Hops = append(m.Hops, addr(h))
		}
		return m
	}
	for _, tc := range []struct {
		name string
		m    *Message
		ok   bool
	}{
		{"ackLock listing the old segment", mk(MsgAckLock, 0, 0, 2, 3), true},
		{"partial ackLock", mk(MsgAckLock, FlagPartial, 0, 2), true},
		{"refusing synAck", mk(MsgSynAck, FlagRefuse, ReasonOnPath, 5), true},
		{"refusing synAck, setup failed", mk(MsgSynAck, FlagRefuse, ReasonSetupFailed, 5), true},
		{"closed notice (ack)", mk(MsgAck, FlagClosedFwd, 0), true},
		{"closed notice (synAck)", mk(MsgSynAck, FlagClosedFwd|FlagClosedRev, 0), true},
		{"refusal naming nobody", mk(MsgSynAck, FlagRefuse, ReasonOnPath), false},
		{"refusal naming two", mk(MsgSynAck, FlagRefuse, ReasonOnPath, 5, 6), false},
		{"refusal for contention", mk(MsgSynAck, FlagRefuse, ReasonLocked, 5), false},
		{"partial fin", mk(MsgFin, FlagPartial, 0), false},
		{"refusing ack", mk(MsgAck, FlagRefuse, ReasonOnPath, 5), false},
		{"closed fin", mk(MsgFin, FlagClosedFwd, 0), false},
		{"closed granting synAck", mk(MsgSynAck, FlagClosedFwd|FlagGrant, 0), false},
		{"list on a fin", mk(MsgFin, 0, 0, 2), false},
		{"list on a plain synAck", mk(MsgSynAck, 0, 0, 2), false},
		{"list on a requestLock", mk(MsgRequestLock, 0, 0, 2), false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b, err := tc.m.Encode(testKey, testFrom)
			if err != nil {
				t.Fatal(err)
			}
			got, err := Decode(testKey, testFrom, b)
			if tc.ok {
				if err != nil || !reflect.DeepEqual(got, tc.m) {
					t.Fatalf("round trip: %v\n got %+v\nwant %+v", err, got, tc.m)
				}
				return
			}
			var de *DecodeError
			if !errors.As(err, &de) || de.Reason != RejectMalformed {
				t.Fatalf("got %v, want malformed", err)
			}
		})
	}
}

// TestMessageNF: the network functions of a new path's hosts
// (heterogeneous-sfc-quic §IV) round-trip on a syn and a synAck, and
// what does not fit the type is refused as malformed.
func TestMessageNF(t *testing.T) {
	syn := sampleMessage()
	syn.Hops = []netip.Addr{addr(20), addr(21), syn.RightAnchor}
	syn.NF = &NFBody{Names: []string{"firewall", "", "ids"}}
	starting := sampleOf(MsgSynAck, sampleMessage())
	starting.Flags, starting.Reason, starting.Blocker = 0, ReasonNone, ReqKey{}
	starting.NF = &NFBody{Names: []string{"firewall"}}
	refused := sampleOf(MsgSynAck, sampleMessage6())
	refused.Flags, refused.Reason, refused.Blocker = FlagRefuse, ReasonNF, ReqKey{}
	refused.Hops = []netip.Addr{refused.Sub.Dst}
	refused.NF = &NFBody{Names: []string{"ids_2"}, Text: "network function ids_2 not ready within 10s"}
	for _, m := range []*Message{syn, &starting, &refused} {
		b, err := m.Encode(testKey, testFrom)
		if err != nil {
			t.Fatal(err)
		}
		got, err := Decode(testKey, testFrom, b)
		if err != nil {
			t.Fatalf("%s: %v", m, err)
		}
		if !reflect.DeepEqual(got, m) {
			t.Fatalf("round trip\n got %+v\nwant %+v", got, m)
		}
	}
	bad := func(what string, m *Message) {
		t.Helper()
		b, err := m.Encode(testKey, testFrom)
		if err != nil {
			return // refused already
		}
		var de *DecodeError
		if _, err := Decode(testKey, testFrom, b); !errors.As(err, &de) || de.Reason != RejectMalformed {
			t.Errorf("%s: %v, want malformed", what, err)
		}
	}
	with := func(base Message, fn func(m *Message)) *Message {
		m := base
		if base.NF != nil {
			nf := *base.NF
			nf.Names = append([]string(nil), nf.Names...)
			m.NF = &nf
		}
		fn(&m)
		return &m
	}
	bad("count short of the hops", with(*syn, func(m *Message) { m.NF.Names = m.NF.Names[:2] }))
	bad("a name for the right anchor", with(*syn, func(m *Message) { m.NF.Names = append(m.NF.Names, "x") }))
	bad("none named", with(*syn, func(m *Message) { m.NF.Names[0], m.NF.Names[2] = "", "" }))
	bad("a text on a syn", with(*syn, func(m *Message) { m.NF.Text = "hi" }))
	bad("a bad character", with(*syn, func(m *Message) { m.NF.Names[0] = "fire wall" }))
	bad("a digit first", with(*syn, func(m *Message) { m.NF.Names[0] = "9fw" }))
	bad("too long", with(*syn, func(m *Message) { m.NF.Names[0] = strings.Repeat("f", MaxNFName+1) }))
	bad("two on a synAck", with(starting, func(m *Message) { m.NF.Names = []string{"a", "b"} }))
	bad("a text on a starting synAck", with(starting, func(m *Message) { m.NF.Text = "why" }))
	bad("on a granting synAck", with(starting, func(m *Message) { m.Flags = FlagGrant }))
	bad("a refusal for it without its name", with(refused, func(m *Message) { m.NF = nil }))
	bad("on another refusal", with(refused, func(m *Message) { m.Reason = ReasonOnPath }))
	bad("on an ack", with(starting, func(m *Message) { m.Type = MsgAck }))
	bad("on a requestLock", with(*syn, func(m *Message) { m.Type = MsgRequestLock; m.Hops = nil; m.NF.Names = []string{"fw"} }))
	if !ValidNFName("firewall") || !ValidNFName("a-b_9") || ValidNFName("") || ValidNFName("a.b") {
		t.Fatal("ValidNFName")
	}
}
