package protocol

// The extension body of version 4 messages: a trigger's migration spec
// and answer, a migration step; its layout and its checks.

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"
	"slices"

	"github.com/dysco/dysco/internal/wire"
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
	// ExtNF: the network functions of a new path's hosts (Message.NF).
	ExtNF = 4
	// extNFLen is its fixed part: version, kind, count, reserved (1
	// each), text length (2); the names (a length byte and the name
	// each), then the text follow.
	extNFLen = 6
	// MaxNFName bounds a network function's name.
	MaxNFName = 32
	// MaxNFText bounds a refusal's text.
	MaxNFText = 512
)

// NFBody is the body of extension kind ExtNF: the network functions a new
// path's hosts must run (heterogeneous-sfc-quic §IV: "The need for a
// specific VNF can be included in the control packet during service chain
// modification").
//
//   - syn: Names[0] is the receiver's, then one per later middlebox (as
//     many names as hops: the last hop, the right anchor, runs none);
//     "" for a host that runs none, at least one name set.
//   - synAck without FlagRefuse: a host of the new path starts its
//     function (Names, one); the left anchor keeps waiting.
//   - synAck refusing with ReasonNF: the function (Names, one) could not
//     be started; Text says why.
type NFBody struct {
	Names []string
	Text  string
}

// ValidNFName reports whether s may name a network function on the wire:
// 1 to MaxNFName bytes, a letter first, then letters, digits, '_' and '-'.
func ValidNFName(s string) bool {
	if len(s) == 0 || len(s) > MaxNFName {
		return false
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		switch {
		case c >= 'a' && c <= 'z', c >= 'A' && c <= 'Z':
		case i > 0 && (c >= '0' && c <= '9' || c == '_' || c == '-'):
		default:
			return false
		}
	}
	return true
}

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
	case m.NF != nil:
		x := m.NF
		if len(x.Names) > wire.MaxHops || len(x.Text) > MaxNFText {
			return nil, ErrExtTooLong
		}
		b := make([]byte, extNFLen, extNFLen+len(x.Text)+len(x.Names)*(MaxNFName+1))
		b[0], b[1], b[2] = ExtVersion, ExtNF, byte(len(x.Names))
		binary.BigEndian.PutUint16(b[4:], uint16(len(x.Text)))
		for _, n := range x.Names {
			if len(n) > MaxNFName {
				return nil, ErrExtTooLong
			}
			b = append(b, byte(len(n)))
			b = append(b, n...)
		}
		return append(b, x.Text...), nil
	}
	return nil, nil
}

// decodeNF parses an ExtNF body; validateNF checks it against the type.
func (m *Message) decodeNF(b []byte) error {
	if len(b) < extNFLen {
		return decodeErr(RejectMalformed, "network functions of %d bytes, at least %d", len(b), extNFLen)
	}
	c, t := int(b[2]), int(binary.BigEndian.Uint16(b[4:]))
	if c > wire.MaxHops || b[3] != 0 || t > MaxNFText {
		return decodeErr(RejectMalformed, "network functions: %d names, reserved %d, text of %d", c, b[3], t)
	}
	x := &NFBody{}
	off := extNFLen
	for i := 0; i < c; i++ {
		if off >= len(b) {
			return decodeErr(RejectMalformed, "network functions: name %d missing", i)
		}
		n := int(b[off])
		off++
		if n > MaxNFName || off+n > len(b) {
			return decodeErr(RejectMalformed, "network functions: name %d of %d bytes", i, n)
		}
		name := string(b[off : off+n])
		if n > 0 && !ValidNFName(name) {
			return decodeErr(RejectMalformed, "network functions: name %d %q invalid", i, name)
		}
		x.Names = append(x.Names, name)
		off += n
	}
	if len(b) != off+t {
		return decodeErr(RejectMalformed, "network functions of %d bytes, %d names and a text of %d need %d", len(b), c, t, off+t)
	}
	x.Text = string(b[off:])
	m.NF = x
	return nil
}

// validateNF checks a message's network functions (NFBody) against its
// type: names for the receiver and every hop but the last (the right
// anchor) on a syn, at least one set; one name, set, on a synAck (with a text only on
// a refusal for ReasonNF, which must carry it); none elsewhere.
func (m *Message) validateNF() error {
	x := m.NF
	refusesNF := m.Type == MsgSynAck && m.Flags&FlagRefuse != 0 && m.Reason == ReasonNF
	if x == nil {
		if refusesNF {
			return decodeErr(RejectMalformed, "a refusal for a network function without its name")
		}
		return nil
	}
	switch {
	case m.Type == MsgSyn:
		if len(x.Names) != len(m.Hops) || x.Text != "" {
			return decodeErr(RejectMalformed, "syn with %d hops and %d network function names (or a text)", len(m.Hops), len(x.Names))
		}
		if !slices.ContainsFunc(x.Names, func(n string) bool { return n != "" }) {
			return decodeErr(RejectMalformed, "syn with network functions that names none")
		}
	case m.Type == MsgSynAck && m.Flags == 0 && m.Reason == ReasonNone, refusesNF:
		if len(x.Names) != 1 || x.Names[0] == "" || x.Text != "" && !refusesNF {
			return decodeErr(RejectMalformed, "synAck with %d network function names", len(x.Names))
		}
	default:
		return decodeErr(RejectMalformed, "network functions on a %s (flags %#x, reason %d)", m.Type, m.Flags, m.Reason)
	}
	return nil
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
	case b[1] == ExtNF && (m.Type == MsgSyn || m.Type == MsgSynAck):
		return m.decodeNF(b)
	default:
		return decodeErr(RejectMalformed, "extension of kind %d on a %s", b[1], m.Type)
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
	case m.Reason > lastWireReason && m.Reason != ReasonNF:
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
