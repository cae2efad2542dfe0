package protocol

import (
	"bytes"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"hash"
	"net/netip"
	"slices"
	"sync"

	"github.com/dysco/dysco/internal/keys"
	"github.com/dysco/dysco/internal/wire"
)

// MsgType is the type of a control message (§3.1–§3.6, Figure 4).
type MsgType uint8

// Control message types, named as in the paper. The lock messages and
// cancelLock/ackCancel, UDP FIN/FIN-ACK travel on the old path, hop by hop
// through the agents of the segment; SYN, SYN-ACK and ACK set up the new
// path hop by hop (§3.3).
const (
	MsgRequestLock MsgType = iota + 1 // left anchor → right anchor, old path (§3.2)
	MsgAckLock                        // right anchor → left anchor, old path
	MsgNackLock                       // refusal, towards the left anchor
	MsgCancelLock                     // left anchor → right anchor, releases the locks (§3.6)
	MsgAckCancel                      // right anchor (or first agent not locked) → left anchor
	MsgSyn                            // left anchor → right anchor, new path, carries the address list
	MsgSynAck                         // right anchor → left anchor, new path
	MsgAck                            // left anchor → right anchor, new path
	MsgFin                            // anchor → anchor on the old path (and a copy on a direct new path): all my old-path data is acknowledged; carries my cut-off
	MsgFinAck                         // answer: I have received and acknowledged everything you sent on the old path
	// MsgTrigger: a middlebox asks the left neighbour of one of its
	// sessions to reconfigure as left anchor (§2.3, §4.2; trigger.go).
	MsgTrigger
	// MsgTriggerResult: the left neighbour's answer to a trigger, with
	// the result of the request it started (or "still running").
	MsgTriggerResult
	// MsgMigrate: a step of a state migration that the left anchor of a
	// gated request asks of another agent (§3.5 last paragraph, §5.3;
	// migrate.go): freeze (the right anchor), export (the old
	// middlebox), import (the new one), or abort (the right anchor to
	// the left one: its hold overflowed). The body says which (MigStep).
	MsgMigrate
	// MsgMigrateAnswer: the answer to a MsgMigrate (or "still working").
	MsgMigrateAnswer
	// MsgRebind: an agent whose address changed moves its subsession
	// with its right neighbour to its new address, break before make
	// (M2M §4.2.3; rebind.go). It names the old subsession and comes
	// from the new address.
	MsgRebind
	// MsgRebindAck: the neighbour's answer to a rebind, on the new
	// subsession: accepted, or refused with a reason.
	MsgRebindAck
)

// MsgTypes lists every message type, for comparison with the model.
var MsgTypes = []MsgType{MsgRequestLock, MsgAckLock, MsgNackLock, MsgCancelLock, MsgAckCancel,
	MsgSyn, MsgSynAck, MsgAck, MsgFin, MsgFinAck, MsgTrigger, MsgTriggerResult, MsgMigrate, MsgMigrateAnswer,
	MsgRebind, MsgRebindAck}

func (t MsgType) String() string {
	switch t {
	case MsgRequestLock:
		return "requestLock"
	case MsgAckLock:
		return "ackLock"
	case MsgNackLock:
		return "nackLock"
	case MsgCancelLock:
		return "cancelLock"
	case MsgAckCancel:
		return "ackCancel"
	case MsgSyn:
		return "syn"
	case MsgSynAck:
		return "synAck"
	case MsgAck:
		return "ack"
	case MsgFin:
		return "fin"
	case MsgFinAck:
		return "finAck"
	case MsgTrigger:
		return "trigger"
	case MsgTriggerResult:
		return "triggerResult"
	case MsgMigrate:
		return "migrate"
	case MsgMigrateAnswer:
		return "migrateAnswer"
	case MsgRebind:
		return "rebind"
	case MsgRebindAck:
		return "rebindAck"
	}
	return fmt.Sprintf("msg-%d", uint8(t))
}

// Wire constants of control messages.
const (
	// MsgMagic opens every control message ("DYSR").
	MsgMagic = 0x44595352
	// MsgVersion is the version this code writes and accepts (6 since
	// messages carry the session's transport, TCP or UDP; 5 since
	// the MAC covers the sender's address and is keyed by a key derived
	// from the deployment secret (Keys); 4 since triggers are control
	// messages with an extension body, and state migration's steps too
	// (extension kind 3); 3 added the ackLock's list of the old segment's
	// middle agents and the refusing synAck; 2 the leftDelta gathered by
	// requestLock). Every agent of a deployment must speak the same
	// version: a left anchor takes an ackLock's list for the whole old
	// segment, and a middlebox's trigger is a message of this protocol.
	MsgVersion = 6
	// MsgHeaderLen is the fixed part before the hops.
	MsgHeaderLen = 172
	// MACLen is the length of the truncated HMAC-SHA256 that ends a message.
	MACLen = 16
	// MaxKeys bounds the keys a receiver tries (Keys): a message that no
	// key authenticates costs one HMAC per key.
	MaxKeys = 8
	// MaxExtLen bounds the extension body: the longest message still fits
	// one IPv4 UDP datagram (65,507 bytes of payload).
	MaxExtLen = 65507 - MsgHeaderLen - wire.MaxHops*wire.AddrLen - MACLen
	// MaxMsgLen is the longest message.
	MaxMsgLen = MsgHeaderLen + wire.MaxHops*wire.AddrLen + MaxExtLen + MACLen
)

// Message flags.
const (
	// FlagLeftward marks a fin or finAck travelling from the right anchor
	// to the left anchor (they travel both ways).
	FlagLeftward = 1 << 0
	// FlagNewPath marks a cancelLock sent on the new path, to free the
	// middleboxes that joined it (best effort).
	FlagNewPath = 1 << 1
	// FlagDone marks a fin re-sent by an anchor that has completed (its
	// old subsession's tomb), in answer to the other anchor's fin. A tomb
	// answers a fin carrying it with a finAck only, so two tombs never
	// answer each other's fins for ever.
	FlagDone = 1 << 2
	// FlagGrant marks a synAck by which the right anchor also grants the
	// lock (its early SYN's answer, a direct new path): it carries
	// leftDelta and the window scale, as the ackLock does, so the left
	// anchor need not wait for the ackLock's two hops back along the old
	// path (docs/protocol.md, "The granting SYN-ACK").
	FlagGrant = 1 << 3
	// FlagPartial marks an ackLock whose hop list does not name every
	// middle agent of the old segment (it was full, or an agent found
	// itself in it already): the left anchor cannot compare the new chain
	// with the old path (onAckLock) and goes on; a middlebox of the new
	// path that holds the session already refuses it (FlagRefuse).
	FlagPartial = 1 << 4
	// FlagDirect marks a SYN that a left anchor moving the session to
	// another of its addresses (Reconfigure.Source), or whose own address
	// is a session address that nothing is sent from (rebind.go), sends
	// straight to the right anchor (a direct new path). The right anchor keeps it as an
	// early SYN, grants the lock with its synAck and sends its fins on
	// the new path, as it does for a direct SYN from the left anchor's own
	// address, which it tells by that address. Other SYNs do not carry
	// it, so that agents of the same message version without it still
	// take them. The bit is FlagPartial's, which only an ackLock carries.
	FlagDirect = FlagPartial
	// FlagRefuse marks a synAck by which a host named in the new path
	// refuses to join it (the reason byte says why: ReasonOnPath, the
	// session already crosses that host; ReasonSetupFailed, it could not
	// install the session). It travels back to the left anchor like a
	// synAck; the left anchor abandons the new path and cancels (§3.6).
	FlagRefuse = 1 << 5
	// FlagClosedFwd and FlagClosedRev make an ack (from the left anchor)
	// or a synAck (from the right anchor) sent after the anchor completed
	// a closed notice: the TCP session's FIN in the SYN's direction, or in
	// the other, went on the old path before the cut-off, and the
	// middleboxes of the new path, which never saw it, record it
	// (FinsSeen, MarkClosed).
	FlagClosedFwd = 1 << 6
	FlagClosedRev = 1 << 7
	flagsClosed   = FlagClosedFwd | FlagClosedRev
	knownFlags    = FlagLeftward | FlagNewPath | FlagDone | FlagGrant | FlagPartial | FlagRefuse | flagsClosed
)

// Message is a decoded control message.
//
// Layout (network byte order; addresses IPv4-mapped as in the SYN block):
//
//	0   magic (4)        4 version (1)   5 type (1)   6 flags (1)   7 reason (1)
//	8   nonce (8): the session nonce from the SYN block (§2.3)
//	16  subsession: src addr (16), dst addr (16), src port (2), dst port (2)
//	52  session:    src addr (16), dst addr (16), src port (2), dst port (2)
//	88  request: left anchor (16), id (4)
//	108 right anchor (16)
//	124 blocker request: left anchor (16), id (4)   (nackLock)
//	144 delta seq (4), delta ts (4): rightDelta (requestLock), leftDelta
//	    (ackLock, a granting synAck), the sender's cut-off oldSent (fin)
//	152 window scale (low 7 bits; at most 14): the sending anchor's stack's
//	    (requestLock, ackLock, syn, synAck); and transport (bit 7: UDP)
//	    153 hop count (1)
//	154 extension length (2): the bytes of the extension body, 0: none
//	156 anchor nonce (8)
//	164 left delta seq (4), ts (4): the leftDelta gathered so far
//	    (requestLock: each middle adds what it will add to the ackLock)
//	172 hops, 16 bytes each (syn: the addresses after the receiver, ending
//	    with the right anchor; ackLock: the middle agents of the old
//	    segment it has passed, in path order; trigger: the new chain)
//	    extension body (trigger: an optional migration spec;
//	    triggerResult: the answer), see ExtVersion
//	end HMAC-SHA256 of the sender's address (16 bytes, IPv4-mapped: the
//	    source address of the datagram as the receiver sees it) followed
//	    by everything before the MAC, under the control key derived from
//	    the deployment secret (Keys), truncated to 16 bytes
//
// A trigger names, in the header: Sub, the subsession from the left
// neighbour to the sender (as its SYN went); Nonce, that subsession's
// session nonce; Req, the trigger's identity (the sender's address and a
// number from its request counter); RightAnchor. Its answer repeats them,
// with Reason and Blocker the request's.
type Message struct {
	Type    MsgType
	Flags   uint8
	Reason  Reason
	Nonce   [wire.NonceLen]byte
	Sub     wire.Tuple // the subsession the message travels on, written as the SYN that made it went (left to right)
	Session wire.Tuple
	Req     ReqKey
	// RightAnchor is the right anchor of Req.
	RightAnchor netip.Addr
	// Blocker is the request that holds the lock a nackLock reports.
	Blocker ReqKey
	Delta   Delta
	// LeftDelta (requestLock) is the leftDelta gathered so far: the sum of
	// the contributions the middle agents passed will add to the ackLock
	// (§3.4). The right anchor puts it in its granting synAck.
	LeftDelta Delta
	WScale    uint8
	// Proto is the session's transport (every message of a session
	// carries it; a middlebox joining a new path takes it from the SYN).
	Proto Proto
	// AnchorNonce (requestLock) is the left anchor's nonce, which the new
	// path will carry: middle agents pass it on unchanged.
	AnchorNonce [wire.NonceLen]byte
	Hops        []netip.Addr
	// Migrate (trigger) asks for a state migration; nil: none.
	Migrate *MigrateSpec
	// Answer (triggerResult) is the answer's body.
	Answer *TriggerAnswer
	// Mig (migrate, migrateAnswer) is the migration step's body.
	Mig *MigStep
	// NF (syn, synAck) names network functions (NFBody); nil: none.
	NF *NFBody
}

// RejectReason classifies a message the agent refused; agents count them.
type RejectReason uint8

// Reject reasons.
const (
	RejectMalformed      RejectReason = iota + 1 // wrong length, unknown type, bad field
	RejectMagic                                  // not a Dysco control message
	RejectVersion                                // a version this code does not speak
	RejectMAC                                    // HMAC mismatch: forged or corrupted
	RejectNonce                                  // nonce differs from the session's: off-path forgery or another session
	RejectUnknownSession                         // no session has that subsession (ended, or never existed)
	RejectWrongPeer                              // not sent by the agent at the other end of the subsession
	RejectReplay                                 // an older request from the same left anchor: replay or stale retransmission
	RejectUnexpected                             // valid but meaningless in the current state (stale, duplicate of a finished exchange)
	RejectRate                                   // a rebind sooner after the session's last one than allowed (rebind.go)
)

// RejectReasons lists every reject reason, for counters.
var RejectReasons = []RejectReason{RejectMalformed, RejectMagic, RejectVersion, RejectMAC,
	RejectNonce, RejectUnknownSession, RejectWrongPeer, RejectReplay, RejectUnexpected, RejectRate}

func (r RejectReason) String() string {
	switch r {
	case RejectMalformed:
		return "malformed"
	case RejectMagic:
		return "bad_magic"
	case RejectVersion:
		return "bad_version"
	case RejectMAC:
		return "bad_mac"
	case RejectNonce:
		return "bad_nonce"
	case RejectUnknownSession:
		return "unknown_session"
	case RejectWrongPeer:
		return "wrong_peer"
	case RejectReplay:
		return "replay"
	case RejectUnexpected:
		return "unexpected"
	case RejectRate:
		return "rate"
	}
	return fmt.Sprintf("reject-%d", uint8(r))
}

// DecodeError is returned by Decode; Reason says what to count.
type DecodeError struct {
	Reason RejectReason
	Detail string
}

func (e *DecodeError) Error() string {
	return fmt.Sprintf("dysco control message: %s: %s", e.Reason, e.Detail)
}

func decodeErr(r RejectReason, format string, args ...any) error {
	return &DecodeError{Reason: r, Detail: fmt.Sprintf(format, args...)}
}

// ErrTooManyHops is returned by Encode for an address list longer than wire.MaxHops.
var ErrTooManyHops = errors.New("dysco control message: too many hops")

// Encode returns m in wire format, authenticated under the signing key of
// k as sent by from: the address the datagram leaves from, as the
// receiver will see it (its Decode's from).
func (m *Message) Encode(k *Keys, from netip.Addr) ([]byte, error) {
	if len(m.Hops) > wire.MaxHops {
		return nil, ErrTooManyHops
	}
	ext, err := m.ext()
	if err != nil {
		return nil, err
	}
	b := make([]byte, MsgHeaderLen, MsgHeaderLen+len(m.Hops)*wire.AddrLen+len(ext)+MACLen)
	binary.BigEndian.PutUint32(b[0:], MsgMagic)
	b[4] = MsgVersion
	b[5] = byte(m.Type)
	b[6] = m.Flags
	b[7] = byte(m.Reason)
	copy(b[8:16], m.Nonce[:])
	putTuple(b[16:52], m.Sub)
	putTuple(b[52:88], m.Session)
	putAddr(b[88:104], m.Req.LeftAnchor)
	binary.BigEndian.PutUint32(b[104:], m.Req.ID)
	putAddr(b[108:124], m.RightAnchor)
	putAddr(b[124:140], m.Blocker.LeftAnchor)
	binary.BigEndian.PutUint32(b[140:], m.Blocker.ID)
	binary.BigEndian.PutUint32(b[144:], m.Delta.Seq)
	binary.BigEndian.PutUint32(b[148:], m.Delta.TS)
	b[152] = m.WScale&0x7f | byte(m.Proto)<<7
	b[153] = byte(len(m.Hops))
	binary.BigEndian.PutUint16(b[154:], uint16(len(ext)))
	copy(b[156:164], m.AnchorNonce[:])
	binary.BigEndian.PutUint32(b[164:], m.LeftDelta.Seq)
	binary.BigEndian.PutUint32(b[168:], m.LeftDelta.TS)
	for _, h := range m.Hops {
		a := h.As16()
		b = append(b, a[:]...)
	}
	b = append(b, ext...)
	return k.seal(b, from), nil
}

// Decode authenticates and parses a message that came from the address
// from (the datagram's source), trying each key of k, the signing one
// first. Errors are *DecodeError.
func Decode(k *Keys, from netip.Addr, b []byte) (*Message, error) {
	if len(b) < 5 {
		return nil, decodeErr(RejectMalformed, "%d bytes", len(b))
	}
	if binary.BigEndian.Uint32(b) != MsgMagic {
		return nil, decodeErr(RejectMagic, "magic %#x", binary.BigEndian.Uint32(b))
	}
	if b[4] != MsgVersion {
		return nil, decodeErr(RejectVersion, "version %d, want %d", b[4], MsgVersion)
	}
	if len(b) < MsgHeaderLen+MACLen {
		return nil, decodeErr(RejectMalformed, "%d bytes, shorter than a header", len(b))
	}
	n := int(b[153])
	if n > wire.MaxHops {
		return nil, decodeErr(RejectMalformed, "%d hops, at most %d", n, wire.MaxHops)
	}
	x := int(binary.BigEndian.Uint16(b[154:]))
	if x > MaxExtLen {
		return nil, decodeErr(RejectMalformed, "extension body of %d bytes, at most %d", x, MaxExtLen)
	}
	if want := MsgHeaderLen + n*wire.AddrLen + x + MACLen; len(b) != want {
		return nil, decodeErr(RejectMalformed, "%d bytes, %d hops and an extension of %d need %d", len(b), n, x, want)
	}
	if !k.open(b, from) {
		return nil, decodeErr(RejectMAC, "HMAC mismatch (forged, corrupted, under another key, or replayed from another address than %s's)", from)
	}
	m := &Message{
		Type:   MsgType(b[5]),
		Flags:  b[6],
		Reason: Reason(b[7]),
	}
	if m.Type < MsgRequestLock || m.Type > MsgRebindAck {
		return nil, decodeErr(RejectMalformed, "unknown type %d", b[5])
	}
	if m.Flags&^knownFlags != 0 {
		return nil, decodeErr(RejectMalformed, "reserved bits set")
	}
	copy(m.Nonce[:], b[8:16])
	m.Sub = getTuple(b[16:52])
	m.Session = getTuple(b[52:88])
	m.Req = ReqKey{LeftAnchor: getAddr(b[88:104]), ID: binary.BigEndian.Uint32(b[104:])}
	m.RightAnchor = getAddr(b[108:124])
	m.Blocker = ReqKey{LeftAnchor: getAddr(b[124:140]), ID: binary.BigEndian.Uint32(b[140:])}
	if !m.Blocker.LeftAnchor.IsValid() {
		m.Blocker = ReqKey{}
	}
	m.Delta = Delta{Seq: binary.BigEndian.Uint32(b[144:]), TS: binary.BigEndian.Uint32(b[148:])}
	m.WScale, m.Proto = b[152]&0x7f, Proto(b[152]>>7)
	copy(m.AnchorNonce[:], b[156:164])
	m.LeftDelta = Delta{Seq: binary.BigEndian.Uint32(b[164:]), TS: binary.BigEndian.Uint32(b[168:])}
	for i := 0; i < n; i++ {
		off := MsgHeaderLen + i*wire.AddrLen
		m.Hops = append(m.Hops, getAddr(b[off:off+wire.AddrLen]))
	}
	if x > 0 {
		off := MsgHeaderLen + n*wire.AddrLen
		if err := m.decodeExt(b[off : off+x]); err != nil {
			return nil, err
		}
	}
	if err := m.validate(); err != nil {
		return nil, err
	}
	return m, nil
}

func (m *Message) validate() error {
	if !validTuple(m.Sub) {
		return decodeErr(RejectMalformed, "invalid subsession %s", m.Sub)
	}
	if !validTuple(m.Session) {
		return decodeErr(RejectMalformed, "invalid session %s", m.Session)
	}
	if !m.Req.LeftAnchor.IsValid() || !m.RightAnchor.IsValid() {
		return decodeErr(RejectMalformed, "missing anchor")
	}
	if !wire.Unicast(m.Req.LeftAnchor) || !wire.Unicast(m.RightAnchor) {
		return decodeErr(RejectMalformed, "anchor not a unicast address")
	}
	// One family throughout: no chain mixes them (wire.SynBlock).
	v4 := m.Session.Is4()
	for _, a := range []netip.Addr{m.Sub.Src, m.Sub.Dst, m.Req.LeftAnchor, m.RightAnchor} {
		if a.Unmap().Is4() != v4 {
			return decodeErr(RejectMalformed, "addresses of both families")
		}
	}
	if b := m.Blocker.LeftAnchor; b.IsValid() && (!wire.Unicast(b) || b.Unmap().Is4() != v4) {
		return decodeErr(RejectMalformed, "blocker %s invalid", b)
	}
	if m.Type == MsgTrigger || m.Type == MsgTriggerResult {
		return m.validateTrigger(v4)
	}
	if m.Type == MsgMigrate || m.Type == MsgMigrateAnswer {
		return m.validateMig()
	}
	if m.Reason > ReasonStale && m.Reason != ReasonOnPath && m.Reason != ReasonNF {
		return decodeErr(RejectMalformed, "unknown reason %d", m.Reason)
	}
	for i, h := range m.Hops {
		if !wire.Unicast(h) {
			return decodeErr(RejectMalformed, "hop %d invalid", i)
		}
		if h.Unmap().Is4() != v4 {
			return decodeErr(RejectMalformed, "hop %d of the other family", i)
		}
		if slices.Contains(m.Hops[:i], h) {
			return decodeErr(RejectMalformed, "hop %d repeats %s (the path would loop)", i, h)
		}
	}
	if (m.Type == MsgRebind || m.Type == MsgRebindAck) && m.Flags != 0 ||
		m.Flags&FlagPartial != 0 && m.Type != MsgAckLock && m.Type != MsgSyn || m.Flags&FlagRefuse != 0 && m.Type != MsgSynAck ||
		m.Type == MsgSyn && m.Flags&FlagDirect != 0 && len(m.Hops) != 0 ||
		m.Flags&flagsClosed != 0 && (m.Type != MsgAck && m.Type != MsgSynAck || m.Flags&^flagsClosed != 0) {
		return decodeErr(RejectMalformed, "flags %#x on a %s", m.Flags, m.Type)
	}
	switch {
	case m.Type == MsgSyn, m.Type == MsgAckLock:
	case m.Type == MsgSynAck && m.Flags&FlagRefuse != 0:
		// A refusal names the host that refused (refuseSyn), and why.
		if len(m.Hops) != 1 || m.Reason != ReasonOnPath && m.Reason != ReasonSetupFailed && m.Reason != ReasonStale && m.Reason != ReasonNF {
			return decodeErr(RejectMalformed, "refusing synAck with %d hops, reason %d", len(m.Hops), m.Reason)
		}
	case len(m.Hops) > 0:
		return decodeErr(RejectMalformed, "%d hops on a %s", len(m.Hops), m.Type)
	}
	if err := m.validateNF(); err != nil {
		return err
	}
	if m.Type == MsgSyn {
		// The receiver of a syn is the packet's destination; the list
		// names the hops after it and ends with the right anchor, or is
		// empty when the receiver is the right anchor itself.
		last := m.Sub.Dst
		if len(m.Hops) > 0 {
			last = m.Hops[len(m.Hops)-1]
		}
		if last != m.RightAnchor {
			return decodeErr(RejectMalformed, "syn address list does not end with the right anchor")
		}
	}
	return nil
}

func validTuple(t wire.Tuple) bool {
	return wire.Unicast(t.Src) && wire.Unicast(t.Dst) && t.Src.Unmap().Is4() == t.Dst.Unmap().Is4() &&
		t.SrcPort != 0 && t.DstPort != 0
}

// Keys are the keys of control messages at an agent (§2.3, "Security":
// against off-path attackers, control packets carry the session's nonce;
// this implementation also authenticates each message, nonce and sender
// included, under a key the deployment shares), derived from the
// deployment secrets of its key file (KeysFromRing): the first signs what
// the agent sends, each verifies what it receives, the signing one first
// (during a rotation a peer may still sign with the old one). Immutable;
// safe for concurrent use.
//
// Each key keeps a pool of HMAC states with its pads hashed already:
// hmac.New would hash the key's two pads again for every message, two of
// the about seven SHA-256 blocks a message costs, and allocate
// (BenchmarkMessage).
type Keys struct {
	macs []*macKey
}

type macKey struct {
	pool sync.Pool // of *macState
}

// macState is a pooled HMAC state with its buffers (kept off the stack:
// slices of them passed to the hash would escape).
type macState struct {
	h    hash.Hash
	addr [16]byte
	sum  [sha256.Size]byte
}

// NewKeys returns the keys (at least one, at most MaxKeys), the first
// signing. They are used as they are: KeysFromRing derives them from
// deployment secrets.
func NewKeys(keys ...[]byte) *Keys {
	if len(keys) == 0 || len(keys) > MaxKeys {
		panic(fmt.Sprintf("protocol: %d control keys, want 1 to %d", len(keys), MaxKeys))
	}
	k := &Keys{}
	for _, key := range keys {
		kc := bytes.Clone(key)
		k.macs = append(k.macs, &macKey{pool: sync.Pool{New: func() any { return &macState{h: hmac.New(sha256.New, kc)} }}})
	}
	return k
}

// KeysFromRing returns the control keys of a ring of deployment secrets:
// each derived with keys.PurposeControl (HKDF-SHA256), in the ring's order.
func KeysFromRing(r *keys.Ring) *Keys {
	return NewKeys(r.Derive(keys.PurposeControl)...)
}

// Len is the number of keys.
func (k *Keys) Len() int { return len(k.macs) }

// seal appends to b the MAC of from and b under the signing key.
func (k *Keys) seal(b []byte, from netip.Addr) []byte {
	var sum [MACLen]byte
	return append(b, k.macs[0].sum(sum[:0], from, b)...)
}

// open reports whether b ends with the MAC of from and the rest of b under
// one of the keys.
func (k *Keys) open(b []byte, from netip.Addr) bool {
	body, mac := b[:len(b)-MACLen], b[len(b)-MACLen:]
	var sum [MACLen]byte
	for _, mk := range k.macs {
		if hmac.Equal(mac, mk.sum(sum[:0], from, body)) {
			return true
		}
	}
	return false
}

// sum appends to dst the HMAC-SHA-256 of from (16 bytes, IPv4-mapped) and
// body, truncated to MACLen.
func (mk *macKey) sum(dst []byte, from netip.Addr, body []byte) []byte {
	st := mk.pool.Get().(*macState)
	st.h.Reset()
	st.addr = [16]byte{}
	if from.IsValid() {
		st.addr = from.As16()
	}
	st.h.Write(st.addr[:])
	st.h.Write(body)
	dst = append(dst, st.h.Sum(st.sum[:0])[:MACLen]...)
	mk.pool.Put(st)
	return dst
}

func putAddr(b []byte, a netip.Addr) {
	if !a.IsValid() {
		return // all zero
	}
	s := a.As16()
	copy(b, s[:])
}

func getAddr(b []byte) netip.Addr {
	var a [16]byte
	copy(a[:], b)
	if a == [16]byte{} {
		return netip.Addr{}
	}
	return netip.AddrFrom16(a).Unmap()
}

func putTuple(b []byte, t wire.Tuple) {
	putAddr(b[0:16], t.Src)
	putAddr(b[16:32], t.Dst)
	binary.BigEndian.PutUint16(b[32:], t.SrcPort)
	binary.BigEndian.PutUint16(b[34:], t.DstPort)
}

func getTuple(b []byte) wire.Tuple {
	return wire.Tuple{Src: getAddr(b[0:16]), Dst: getAddr(b[16:32]),
		SrcPort: binary.BigEndian.Uint16(b[32:]), DstPort: binary.BigEndian.Uint16(b[34:])}
}

func (m *Message) String() string {
	s := fmt.Sprintf("%s req=%s ra=%s sub=%s", m.Type, m.Req, m.RightAnchor, m.Sub)
	if m.Proto != ProtoTCP {
		s += " " + m.Proto.String()
	}
	switch m.Type {
	case MsgRequestLock:
		s += " delta=" + m.Delta.String() + " leftDelta=" + m.LeftDelta.String()
	case MsgAckLock:
		s += " delta=" + m.Delta.String()
	case MsgSynAck:
		if m.Flags&FlagGrant != 0 {
			s += " delta=" + m.Delta.String()
		}
		if m.NF != nil {
			s += fmt.Sprintf(" nf=%q", m.NF.Names)
			if m.Flags&FlagRefuse != 0 {
				s += fmt.Sprintf(" reason=%q text=%q", m.Reason, m.NF.Text)
			} else {
				s += " starting"
			}
		}
	case MsgNackLock:
		s += fmt.Sprintf(" reason=%q blocker=%s", m.Reason, m.Blocker)
	case MsgRebindAck:
		if m.Reason != ReasonNone {
			s += fmt.Sprintf(" refused reason=%q blocker=%s", m.Reason, m.Blocker)
		}
	case MsgFin:
		s += fmt.Sprintf(" cutoff=%d", m.Delta.Seq)
	case MsgSyn:
		s += fmt.Sprintf(" hops=%v", m.Hops)
		if m.NF != nil {
			s += fmt.Sprintf(" nf=%q", m.NF.Names)
		}
	case MsgTrigger:
		s += fmt.Sprintf(" chain=%v", m.Hops)
		if m.Migrate != nil {
			s += fmt.Sprintf(" migrate=%+v", *m.Migrate)
		}
	case MsgMigrate, MsgMigrateAnswer:
		if x := m.Mig; x != nil {
			s += " " + x.Op.String()
			switch {
			case x.Running:
				s += " running"
			case x.Failed:
				s += fmt.Sprintf(" failed %q", x.Text)
			case x.Text != "":
				s += fmt.Sprintf(" note %q", x.Text)
			}
			if len(x.Blob) > 0 {
				s += fmt.Sprintf(" state=%dB", len(x.Blob))
			}
		}
	case MsgTriggerResult:
		if x := m.Answer; x == nil || x.Outcome == 0 {
			s += " running"
		} else {
			s += fmt.Sprintf(" %s reason=%q blocker=%s request=%d", x.Outcome, m.Reason, m.Blocker, x.ReqID)
		}
	}
	if m.Flags&FlagLeftward != 0 {
		s += " leftward"
	}
	if m.Flags&FlagNewPath != 0 {
		s += " newpath"
	}
	if m.Flags&FlagDone != 0 {
		s += " done"
	}
	if m.Flags&FlagGrant != 0 {
		s += " grant"
	}
	if m.Type == MsgSyn && m.Flags&FlagDirect != 0 {
		s += " direct"
	}
	return s
}
