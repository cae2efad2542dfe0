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
	"sync/atomic"

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
)

// MsgTypes lists every message type, for comparison with the model.
var MsgTypes = []MsgType{MsgRequestLock, MsgAckLock, MsgNackLock, MsgCancelLock, MsgAckCancel,
	MsgSyn, MsgSynAck, MsgAck, MsgFin, MsgFinAck, MsgTrigger, MsgTriggerResult, MsgMigrate, MsgMigrateAnswer}

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
	}
	return fmt.Sprintf("msg-%d", uint8(t))
}

// Wire constants of control messages.
const (
	// MsgMagic opens every control message ("DYSR").
	MsgMagic = 0x44595352
	// MsgVersion is the version this code writes and accepts (4 since
	// triggers are control messages with an extension body, and state
	// migration's steps too (extension kind 3); 3 added the
	// ackLock's list of the old segment's middle agents and the refusing
	// synAck; 2 the leftDelta gathered by requestLock). Every agent of a
	// deployment must speak the same version: a left anchor takes an
	// ackLock's list for the whole old segment, and a middlebox's trigger
	// is a message of this protocol.
	MsgVersion = 4
	// MsgHeaderLen is the fixed part before the hops.
	MsgHeaderLen = 172
	// MACLen is the length of the truncated HMAC-SHA256 that ends a message.
	MACLen = 16
	// MaxExtLen bounds the extension body: the longest message still fits
	// one IPv4 UDP datagram (65,507 bytes of payload).
	MaxExtLen = 65507 - MsgHeaderLen - wire.MaxHops*wire.AddrLen - MACLen
	// MaxMsgLen is the longest message.
	MaxMsgLen = MsgHeaderLen + wire.MaxHops*wire.AddrLen + MaxExtLen + MACLen
)

// The extension body (Message.Migrate, Message.Answer) opens with its own
// version and kind; each kind has a fixed layout, but for a length-prefixed
// blob at its end, and the body's length (offset 154) must be exactly what
// the kind's fields say. Kinds to come take new kind numbers under the
// same version.
const (
	// ExtVersion is the extension layout this code writes and accepts.
	ExtVersion = 1
	// ExtMigrate: a trigger's state migration spec (Message.Migrate).
	ExtMigrate = 1
	// ExtAnswer: a trigger's answer (Message.Answer).
	ExtAnswer = 2
	// extMigrateLen: version, kind, semantics, reserved (1 each), hold
	// limit (8), timeout in ms (4).
	extMigrateLen = 16
	// extAnswerLen is the answer's fixed part: version, kind, outcome,
	// flags (1 each), request id (4), hop (16), micros (8), report
	// length (2); the report follows.
	extAnswerLen = 34
	// MaxReportLen bounds the report blob of an answer.
	MaxReportLen = MaxExtLen - extAnswerLen
	// ExtMigStep: a state migration's step or its answer (Message.Mig).
	ExtMigStep = 3
	// extMigStepLen is a step's fixed part: version, kind, op, semantics,
	// flags (1 each), reserved (3), hold limit (8), timeout in ms (4),
	// drain timeout in ms (4), marks: seq (4), ack (4), text length (2),
	// blob length (2); the text, then the blob follow.
	extMigStepLen = 36
	// MaxMigText bounds a step's text (an error or a note).
	MaxMigText = 1024
	// MaxStateLen bounds the state blob a step carries (an export's
	// answer, an import): the plug-ins' bundle (internal/migrate,
	// MaxBundleSize) must fit one datagram with the rest of the message.
	MaxStateLen = 60000
)

// Flags of a migration step's body.
const (
	migMarks   = 1 << 0 // Marks are set
	migRunning = 1 << 1 // answer: still working; the request is alive
	migFailed  = 1 << 2 // answer: the step failed; Text says why
	migFlags   = migMarks | migRunning | migFailed
)

// MigOp is the step of a state migration a MsgMigrate asks for.
type MigOp uint8

// Steps of a state migration (migrate.go).
const (
	MigFreeze MigOp = iota + 1 // left anchor → right anchor: hold, drain, answer with marks
	MigExport                  // left anchor → old middlebox, on the old path: export the session's state
	MigImport                  // left anchor → new middlebox, on the new path: import the blob
	MigAbort                   // right anchor → left anchor: cannot go on (its hold overflowed)
)

func (o MigOp) String() string {
	switch o {
	case MigFreeze:
		return "freeze"
	case MigExport:
		return "export"
	case MigImport:
		return "import"
	case MigAbort:
		return "abort"
	}
	return fmt.Sprintf("op-%d", uint8(o))
}

// FlowMarks are what one side of an anchor has sent on the old path, in the
// session's sequence space (the datapath's flow marks): the highest
// sequence number and acknowledgment. OK is false when the flow has none.
type FlowMarks struct {
	Seq, Ack uint32
	OK       bool
}

// MigStep is the body of a MsgMigrate or MsgMigrateAnswer.
type MigStep struct {
	Op        MigOp
	Semantics MigrateSemantics // freeze
	// Running (answer): the receiver still works at it; Failed: it
	// failed, and Text says why. Otherwise Text is a note (empty: none).
	Running, Failed bool
	HoldLimit       uint64 // freeze
	TimeoutMS       uint32 // freeze: the migration's bound
	DrainMS         uint32 // freeze: the drain's bound (order)
	// Marks (freeze and its answer): the sender's side at its freeze.
	Marks FlowMarks
	Text  string
	// Blob is the state (an export's answer, an import), opaque to the
	// protocol, at most MaxStateLen bytes.
	Blob []byte
}

// Flags of an answer's extension body.
const (
	answerUnchanged   = 1 << 0
	answerUnconfirmed = 1 << 1
	answerResumed     = 1 << 2
	answerFlags       = answerUnchanged | answerUnconfirmed | answerResumed
)

// MigrateSemantics is the cut-over a state migration asks for (M2M §5);
// the agent's migration code gives it meaning.
type MigrateSemantics uint8

// Semantics of a state migration.
const (
	MigrateDefault MigrateSemantics = iota // the agent's default (loss-free)
	MigrateLossFree
	MigrateOrder
	MigrateSubstream
)

// MigrateSpec is a trigger's request that the left neighbour move the
// state of the middlebox it replaces (§3.5 last paragraph): the request
// it starts is gated (Reconfigure.Gate). Zero values are the agent's
// defaults.
type MigrateSpec struct {
	Semantics MigrateSemantics
	// HoldLimit bounds the bytes each anchor holds, at most 1<<62.
	HoldLimit uint64
	// TimeoutMS bounds freeze, drain, export and import.
	TimeoutMS uint32
}

// maxHoldLimit bounds MigrateSpec.HoldLimit (an int64 for the agent).
const maxHoldLimit = 1 << 62

// TriggerAnswer is the body of a triggerResult: the outcome of the request
// the trigger started at the left neighbour (its reason and blocker travel
// in the header's fields), or Outcome zero: the request is still running
// (an acknowledgement of a retransmitted trigger, §3.6).
type TriggerAnswer struct {
	Outcome                         Outcome
	Unchanged, Unconfirmed, Resumed bool
	// ReqID is the number of the request the trigger started (its left
	// anchor is the answer's sender); zero when the trigger was refused
	// before it started one.
	ReqID uint32
	// Hop (ReasonOnPath) is the hop of the new chain already on the path.
	Hop netip.Addr
	// Micros is the time from the trigger's arrival to the answer, at
	// the left neighbour.
	Micros uint64
	// Report is opaque to the protocol: what the left neighbour's agent
	// reported at the request's gate (Proceed.Report: a state
	// migration's report), at most MaxReportLen bytes.
	Report []byte
}

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
//	152 window scale (1)   153 hop count (1)
//	154 extension length (2): the bytes of the extension body, 0: none
//	156 anchor nonce (8)
//	164 left delta seq (4), ts (4): the leftDelta gathered so far
//	    (requestLock: each middle adds what it will add to the ackLock)
//	172 hops, 16 bytes each (syn: the addresses after the receiver, ending
//	    with the right anchor; ackLock: the middle agents of the old
//	    segment it has passed, in path order; trigger: the new chain)
//	    extension body (trigger: an optional migration spec;
//	    triggerResult: the answer), see ExtVersion
//	end HMAC-SHA256 under the deployment key of everything before it,
//	    truncated to 16 bytes
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
)

// RejectReasons lists every reject reason, for counters.
var RejectReasons = []RejectReason{RejectMalformed, RejectMagic, RejectVersion, RejectMAC,
	RejectNonce, RejectUnknownSession, RejectWrongPeer, RejectReplay, RejectUnexpected}

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

// ErrExtTooLong is returned by Encode for an extension body longer than
// MaxExtLen (an answer's report longer than MaxReportLen).
var ErrExtTooLong = errors.New("dysco control message: extension body too long")

// ext returns m's extension body, nil if it has none.
func (m *Message) ext() ([]byte, error) {
	switch {
	case m.Migrate != nil:
		b := make([]byte, extMigrateLen)
		b[0], b[1], b[2] = ExtVersion, ExtMigrate, byte(m.Migrate.Semantics)
		binary.BigEndian.PutUint64(b[4:], m.Migrate.HoldLimit)
		binary.BigEndian.PutUint32(b[12:], m.Migrate.TimeoutMS)
		return b, nil
	case m.Answer != nil:
		x := m.Answer
		if len(x.Report) > MaxReportLen {
			return nil, ErrExtTooLong
		}
		b := make([]byte, extAnswerLen, extAnswerLen+len(x.Report))
		b[0], b[1], b[2] = ExtVersion, ExtAnswer, byte(x.Outcome)
		if x.Unchanged {
			b[3] |= answerUnchanged
		}
		if x.Unconfirmed {
			b[3] |= answerUnconfirmed
		}
		if x.Resumed {
			b[3] |= answerResumed
		}
		binary.BigEndian.PutUint32(b[4:], x.ReqID)
		putAddr(b[8:24], x.Hop)
		binary.BigEndian.PutUint64(b[24:], x.Micros)
		binary.BigEndian.PutUint16(b[32:], uint16(len(x.Report)))
		return append(b, x.Report...), nil
	case m.Mig != nil:
		x := m.Mig
		if len(x.Text) > MaxMigText || len(x.Blob) > MaxStateLen {
			return nil, ErrExtTooLong
		}
		b := make([]byte, extMigStepLen, extMigStepLen+len(x.Text)+len(x.Blob))
		b[0], b[1], b[2], b[3] = ExtVersion, ExtMigStep, byte(x.Op), byte(x.Semantics)
		if x.Marks.OK {
			b[4] |= migMarks
		}
		if x.Running {
			b[4] |= migRunning
		}
		if x.Failed {
			b[4] |= migFailed
		}
		binary.BigEndian.PutUint64(b[8:], x.HoldLimit)
		binary.BigEndian.PutUint32(b[16:], x.TimeoutMS)
		binary.BigEndian.PutUint32(b[20:], x.DrainMS)
		binary.BigEndian.PutUint32(b[24:], x.Marks.Seq)
		binary.BigEndian.PutUint32(b[28:], x.Marks.Ack)
		binary.BigEndian.PutUint16(b[32:], uint16(len(x.Text)))
		binary.BigEndian.PutUint16(b[34:], uint16(len(x.Blob)))
		b = append(b, x.Text...)
		return append(b, x.Blob...), nil
	}
	return nil, nil
}

// Encode returns m in wire format, authenticated under key.
func (m *Message) Encode(key []byte) ([]byte, error) {
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
	b[152] = m.WScale
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
	return appendMAC(b, key, b), nil
}

// Decode authenticates and parses a message. Errors are *DecodeError.
func Decode(key, b []byte) (*Message, error) {
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
	body := b[:len(b)-MACLen]
	var sum [MACLen]byte
	if !hmac.Equal(b[len(b)-MACLen:], appendMAC(sum[:0], key, body)) {
		return nil, decodeErr(RejectMAC, "HMAC mismatch")
	}
	m := &Message{
		Type:   MsgType(b[5]),
		Flags:  b[6],
		Reason: Reason(b[7]),
	}
	if m.Type < MsgRequestLock || m.Type > MsgMigrateAnswer {
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
	m.WScale = b[152]
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

// decodeExt parses an extension body (ExtVersion): its version, its kind,
// which must be the message type's, and exactly the length its fields say.
func (m *Message) decodeExt(b []byte) error {
	if len(b) < 2 {
		return decodeErr(RejectMalformed, "extension body of %d bytes", len(b))
	}
	if b[0] != ExtVersion {
		return decodeErr(RejectMalformed, "extension version %d, want %d", b[0], ExtVersion)
	}
	switch {
	case b[1] == ExtMigrate && m.Type == MsgTrigger:
		if len(b) != extMigrateLen {
			return decodeErr(RejectMalformed, "migration spec of %d bytes, want %d", len(b), extMigrateLen)
		}
		sp := &MigrateSpec{Semantics: MigrateSemantics(b[2]), HoldLimit: binary.BigEndian.Uint64(b[4:]),
			TimeoutMS: binary.BigEndian.Uint32(b[12:])}
		if sp.Semantics > MigrateSubstream || b[3] != 0 || sp.HoldLimit > maxHoldLimit {
			return decodeErr(RejectMalformed, "migration spec: semantics %d, reserved %d, hold limit %d", b[2], b[3], sp.HoldLimit)
		}
		m.Migrate = sp
	case b[1] == ExtAnswer && m.Type == MsgTriggerResult:
		if len(b) < extAnswerLen {
			return decodeErr(RejectMalformed, "answer of %d bytes, at least %d", len(b), extAnswerLen)
		}
		if r := int(binary.BigEndian.Uint16(b[32:])); len(b) != extAnswerLen+r {
			return decodeErr(RejectMalformed, "answer of %d bytes with a report of %d", len(b), r)
		}
		x := &TriggerAnswer{Outcome: Outcome(b[2]), Unchanged: b[3]&answerUnchanged != 0,
			Unconfirmed: b[3]&answerUnconfirmed != 0, Resumed: b[3]&answerResumed != 0,
			ReqID: binary.BigEndian.Uint32(b[4:]), Hop: getAddr(b[8:24]), Micros: binary.BigEndian.Uint64(b[24:])}
		if x.Outcome > Failed || b[3]&^answerFlags != 0 {
			return decodeErr(RejectMalformed, "answer: outcome %d, flags %#x", b[2], b[3])
		}
		if len(b) > extAnswerLen {
			x.Report = bytes.Clone(b[extAnswerLen:])
		}
		m.Answer = x
	case b[1] == ExtMigStep && (m.Type == MsgMigrate || m.Type == MsgMigrateAnswer):
		if len(b) < extMigStepLen {
			return decodeErr(RejectMalformed, "migration step of %d bytes, at least %d", len(b), extMigStepLen)
		}
		nt, nb := int(binary.BigEndian.Uint16(b[32:])), int(binary.BigEndian.Uint16(b[34:]))
		if len(b) != extMigStepLen+nt+nb || nt > MaxMigText || nb > MaxStateLen {
			return decodeErr(RejectMalformed, "migration step of %d bytes with a text of %d and a blob of %d", len(b), nt, nb)
		}
		x := &MigStep{Op: MigOp(b[2]), Semantics: MigrateSemantics(b[3]), Running: b[4]&migRunning != 0,
			Failed: b[4]&migFailed != 0, HoldLimit: binary.BigEndian.Uint64(b[8:]),
			TimeoutMS: binary.BigEndian.Uint32(b[16:]), DrainMS: binary.BigEndian.Uint32(b[20:]),
			Marks: FlowMarks{Seq: binary.BigEndian.Uint32(b[24:]), Ack: binary.BigEndian.Uint32(b[28:]), OK: b[4]&migMarks != 0}}
		if x.Op < MigFreeze || x.Op > MigAbort || x.Semantics > MigrateSubstream || b[4]&^migFlags != 0 ||
			b[5]|b[6]|b[7] != 0 || x.HoldLimit > maxHoldLimit {
			return decodeErr(RejectMalformed, "migration step: op %d, semantics %d, flags %#x, hold limit %d", b[2], b[3], b[4], x.HoldLimit)
		}
		if nt > 0 {
			x.Text = string(b[extMigStepLen : extMigStepLen+nt])
		}
		if nb > 0 {
			x.Blob = bytes.Clone(b[extMigStepLen+nt:])
		}
		m.Mig = x
	default:
		return decodeErr(RejectMalformed, "extension of kind %d on a %s", b[1], m.Type)
	}
	return nil
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
	if m.Reason > ReasonStale && m.Reason != ReasonOnPath {
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
	if m.Flags&FlagPartial != 0 && m.Type != MsgAckLock || m.Flags&FlagRefuse != 0 && m.Type != MsgSynAck ||
		m.Flags&flagsClosed != 0 && (m.Type != MsgAck && m.Type != MsgSynAck || m.Flags&^flagsClosed != 0) {
		return decodeErr(RejectMalformed, "flags %#x on a %s", m.Flags, m.Type)
	}
	switch {
	case m.Type == MsgSyn, m.Type == MsgAckLock:
	case m.Type == MsgSynAck && m.Flags&FlagRefuse != 0:
		// A refusal names the host that refused (refuseSyn), and why.
		if len(m.Hops) != 1 || m.Reason != ReasonOnPath && m.Reason != ReasonSetupFailed {
			return decodeErr(RejectMalformed, "refusing synAck with %d hops, reason %d", len(m.Hops), m.Reason)
		}
	case len(m.Hops) > 0:
		return decodeErr(RejectMalformed, "%d hops on a %s", len(m.Hops), m.Type)
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

// validateTrigger checks what is particular to a trigger and its answer:
// no flags; a trigger carries no reason nor blocker, and its hops (the new
// chain) are unicast, of the session's family and distinct; an answer
// carries no hops, a reason a request can end with, and a hop of the
// session's family if any.
func (m *Message) validateTrigger(v4 bool) error {
	if m.Flags != 0 {
		return decodeErr(RejectMalformed, "flags %#x on a %s", m.Flags, m.Type)
	}
	fam := func(a netip.Addr) bool { return wire.Unicast(a) && a.Unmap().Is4() == v4 }
	if m.Type == MsgTrigger {
		if m.Reason != ReasonNone || !m.Blocker.IsZero() {
			return decodeErr(RejectMalformed, "a trigger with a reason or a blocker")
		}
		for i, h := range m.Hops {
			if !fam(h) {
				return decodeErr(RejectMalformed, "hop %d invalid", i)
			}
			if slices.Contains(m.Hops[:i], h) {
				return decodeErr(RejectMalformed, "hop %d repeats %s", i, h)
			}
		}
		return nil
	}
	x := m.Answer
	switch {
	case x == nil:
		return decodeErr(RejectMalformed, "a triggerResult without its answer")
	case len(m.Hops) > 0:
		return decodeErr(RejectMalformed, "%d hops on a triggerResult", len(m.Hops))
	case m.Reason > lastWireReason:
		return decodeErr(RejectMalformed, "unknown reason %d", m.Reason)
	case x.Hop.IsValid() && !fam(x.Hop):
		return decodeErr(RejectMalformed, "answer: hop %s invalid", x.Hop)
	}
	return nil
}

// validateMig checks a migration step and its answer: no flags, reason,
// blocker nor hops; a body; marks only on a freeze and its answer; a blob
// only on an import and an export's answer; a request neither running nor
// failed, with a text only when it aborts.
func (m *Message) validateMig() error {
	x := m.Mig
	switch {
	case x == nil:
		return decodeErr(RejectMalformed, "a %s without its body", m.Type)
	case m.Flags != 0 || m.Reason != ReasonNone || !m.Blocker.IsZero() || len(m.Hops) > 0:
		return decodeErr(RejectMalformed, "a %s with flags, a reason, a blocker or hops", m.Type)
	case x.Marks != (FlowMarks{}) && x.Op != MigFreeze:
		return decodeErr(RejectMalformed, "marks on a %s step", x.Op)
	}
	blob := x.Op == MigImport && m.Type == MsgMigrate || x.Op == MigExport && m.Type == MsgMigrateAnswer && !x.Failed && !x.Running
	if len(x.Blob) > 0 && !blob {
		return decodeErr(RejectMalformed, "a state blob on a %s of %s", m.Type, x.Op)
	}
	if m.Type == MsgMigrate {
		if x.Running || x.Failed || x.Text != "" && x.Op != MigAbort {
			return decodeErr(RejectMalformed, "a %s request that is running, failed or has a text", x.Op)
		}
	} else if x.Running && (x.Failed || x.Text != "") {
		return decodeErr(RejectMalformed, "a running %s answer that failed or has a text", x.Op)
	}
	if x.Op != MigFreeze && (x.Semantics != 0 || x.HoldLimit != 0 || x.TimeoutMS != 0 || x.DrainMS != 0) {
		return decodeErr(RejectMalformed, "a %s step with a freeze's fields", x.Op)
	}
	return nil
}

func validTuple(t wire.Tuple) bool {
	return wire.Unicast(t.Src) && wire.Unicast(t.Dst) && t.Src.Unmap().Is4() == t.Dst.Unmap().Is4() &&
		t.SrcPort != 0 && t.DstPort != 0
}

// appendMAC appends to dst the HMAC-SHA-256 of body under key, truncated to
// MACLen. The HMAC states come from a pool kept for the last key used (an
// agent has one deployment key): hmac.New would hash the key's two pads
// again for every message, two of the about seven SHA-256 blocks a message
// costs, and allocate (BenchmarkMessage).
func appendMAC(dst, key, body []byte) []byte {
	p := macs.Load()
	if p == nil || !bytes.Equal(p.key, key) {
		k := bytes.Clone(key)
		p = &macPool{key: k, pool: sync.Pool{New: func() any { return hmac.New(sha256.New, k) }}}
		macs.Store(p)
	}
	h := p.pool.Get().(hash.Hash)
	h.Reset()
	h.Write(body)
	var sum [sha256.Size]byte
	dst = append(dst, h.Sum(sum[:0])[:MACLen]...)
	p.pool.Put(h)
	return dst
}

type macPool struct {
	key  []byte
	pool sync.Pool
}

var macs atomic.Pointer[macPool]

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
	switch m.Type {
	case MsgRequestLock:
		s += " delta=" + m.Delta.String() + " leftDelta=" + m.LeftDelta.String()
	case MsgAckLock:
		s += " delta=" + m.Delta.String()
	case MsgSynAck:
		if m.Flags&FlagGrant != 0 {
			s += " delta=" + m.Delta.String()
		}
	case MsgNackLock:
		s += fmt.Sprintf(" reason=%q blocker=%s", m.Reason, m.Blocker)
	case MsgFin:
		s += fmt.Sprintf(" cutoff=%d", m.Delta.Seq)
	case MsgSyn:
		s += fmt.Sprintf(" hops=%v", m.Hops)
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
	return s
}
