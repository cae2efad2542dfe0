package protocol

import "fmt"

// TCP flags of a Packet.
const (
	TCPFin = 1 << 0
	TCPSyn = 1 << 1
	TCPRst = 1 << 2
	TCPAck = 1 << 4
)

// Packet summarises a TCP segment at an anchor, in the anchor's session
// sequence space: deltas are already applied to incoming packets and not
// yet applied to outgoing ones (§3.5, last paragraph of the tables).
type Packet struct {
	Seq   uint32 `json:"seq"`
	Ack   uint32 `json:"ack"`
	Len   uint32 `json:"len"`   // payload bytes
	Flags uint8  `json:"flags"` // TCP* bits
}

// End returns the sequence number after the packet: payload plus one for
// a FIN (and for a SYN).
func (p Packet) End() uint32 {
	e := p.Seq + p.Len
	if p.Flags&TCPFin != 0 {
		e++
	}
	if p.Flags&TCPSyn != 0 {
		e++
	}
	return e
}

func (p Packet) String() string {
	f := ""
	for _, x := range []struct {
		b uint8
		s string
	}{{TCPSyn, "S"}, {TCPFin, "F"}, {TCPRst, "R"}, {TCPAck, "."}} {
		if p.Flags&x.b != 0 {
			f += x.s
		}
	}
	return fmt.Sprintf("[%s] seq=%d len=%d ack=%d", f, p.Seq, p.Len, p.Ack)
}

// seqLT compares sequence numbers modulo 2^32 (RFC 793 §3.3).
func seqLT(a, b uint32) bool { return int32(a-b) < 0 }

func seqLEQ(a, b uint32) bool { return int32(a-b) <= 0 }

func seqMax(a, b uint32) uint32 {
	if seqLT(a, b) {
		return b
	}
	return a
}

// Marks are what the datapath records of one side of a session at all
// times, so that an anchor knows its variables at the cut-off: the highest
// sequence number sent and received (plus one) and the highest ack sent and
// received, in session space. The datapath starts them from the handshake
// (Sent and Rcvd true); a middlebox that joined a new path starts with none
// and learns them from the first packet each way (every segment's sequence
// number is the sender's next one, and it carries an ack).
type Marks struct {
	SndNxt  uint32 `json:"sndNxt"`  // highest sequence number sent, plus one
	AckSent uint32 `json:"ackSent"` // highest acknowledgment sent
	RcvNxt  uint32 `json:"rcvNxt"`  // highest sequence number received, plus one
	AckRcvd uint32 `json:"ackRcvd"` // highest acknowledgment received
	Sent    bool   `json:"sent"`    // SndNxt and AckSent are known
	Rcvd    bool   `json:"rcvd"`    // RcvNxt and AckRcvd are known
}

// Out records a packet sent on the side.
func (m Marks) Out(p Packet) Marks {
	if !m.Sent {
		m.SndNxt, m.AckSent, m.Sent = p.Seq, p.Ack, true
	}
	m.SndNxt = seqMax(m.SndNxt, p.End())
	if p.Flags&TCPAck != 0 {
		m.AckSent = seqMax(m.AckSent, p.Ack)
	}
	return m
}

// In records a packet received on the side.
func (m Marks) In(p Packet) Marks {
	if !m.Rcvd {
		m.RcvNxt, m.AckRcvd, m.Rcvd = p.Seq, p.Ack, true
	}
	m.RcvNxt = seqMax(m.RcvNxt, p.End())
	if p.Flags&TCPAck != 0 {
		m.AckRcvd = seqMax(m.AckRcvd, p.Ack)
	}
	return m
}

// Ready reports whether both directions are known: only then can the side
// be cut over (the protocol waits for DatapathReady on joined sessions).
func (m Marks) Ready() bool { return m.Sent && m.Rcvd }

// TwoPath holds an anchor's variables for the side being reconfigured
// during the two-path phase (§3.5). All are in session space.
type TwoPath struct {
	OldSent      uint32 `json:"oldSent"`      // highest sequence number sent on the old path, plus one: the cut-off, fixed
	OldRcvd      uint32 `json:"oldRcvd"`      // highest sequence number received on the old path, plus one
	OldSentAcked uint32 `json:"oldSentAcked"` // highest sequence number sent on the old path and acknowledged, plus one
	OldRcvdAcked uint32 `json:"oldRcvdAcked"` // highest sequence number received on the old path and acknowledged, plus one
	FirstNewRcvd uint32 `json:"firstNewRcvd"` // lowest sequence number received on the new path, if NewRcvd
	NewRcvd      bool   `json:"newRcvd"`      // something was received on the new path
	// AckHi is the highest acknowledgment received on either path, if
	// AckHiOK: what Deliver writes into late packets of the old path.
	AckHi   uint32 `json:"ackHi"`
	AckHiOK bool   `json:"ackHiOK"`
	// OldDgrams (UDP sessions only; none of the above is used for them)
	// counts the datagrams that arrived on the old path since the side
	// switched: the protocol ends the side's phase once it has not moved
	// for the drain time (udp.go).
	OldDgrams uint64 `json:"oldDgrams,omitempty"`
}

func (v TwoPath) String() string {
	f := "-"
	if v.NewRcvd {
		f = fmt.Sprint(v.FirstNewRcvd)
	}
	h := "-"
	if v.AckHiOK {
		h = fmt.Sprint(v.AckHi)
	}
	return fmt.Sprintf("oldSent=%d oldRcvd=%d oldSentAcked=%d oldRcvdAcked=%d firstNewRcvd=%s ackHi=%s",
		v.OldSent, v.OldRcvd, v.OldSentAcked, v.OldRcvdAcked, f, h)
}

// CutOff starts the two-path phase from the side's marks: from now on no
// new data goes on the old path, so oldSent is known (§3.5).
//
// A byte acknowledged through this side counts as sent and received here
// even if it never passed: a middlebox that joined a new path may have
// learned its marks from a retransmission, below bytes that went on the
// path before it joined (and were all acknowledged before that
// reconfiguration completed). Without this, oldRcvd would wait forever for
// bytes that will not come.
func CutOff(m Marks) TwoPath {
	return TwoPath{
		OldSent:      seqMax(m.SndNxt, m.AckRcvd),
		OldRcvd:      seqMax(m.RcvNxt, m.AckSent),
		OldSentAcked: m.AckRcvd,
		OldRcvdAcked: m.AckSent,
		AckHi:        m.AckRcvd,
		AckHiOK:      m.Rcvd,
	}
}

// SendDone reports whether everything the anchor sent on the old path has
// been acknowledged: oldSentAcked = oldSent.
func (v TwoPath) SendDone() bool { return v.OldSentAcked == v.OldSent }

// RecvDone reports whether the anchor has received and acknowledged
// everything the other anchor sent on the old path (§3.5):
// oldRcvdAcked = oldRcvd ∧ oldRcvd ≥ firstNewRcvd. When the other anchor's
// cut-off is known (it comes in its UDP FIN), oldRcvd ≥ cutoff is the same
// fact without waiting for new data; this matters when the other anchor has
// nothing more to send. The paper asks equality; old-path data can end
// beyond the cut-off here because a straddling packet is sent whole (Decide)
// where the agent cannot split it (docs/protocol.md, "Two paths").
func (v TwoPath) RecvDone(cutoff uint32, haveCutoff bool) bool {
	if v.OldRcvdAcked != v.OldRcvd {
		return false
	}
	return v.NewRcvd && seqLEQ(v.FirstNewRcvd, v.OldRcvd) || haveCutoff && seqLEQ(cutoff, v.OldRcvd)
}

// Piece is where an outgoing packet goes in the two-path phase, and the
// sequence and ack numbers it leaves with. Its payload is the whole
// packet's: Decide never splits a packet (see Decide).
type Piece struct {
	Path  Path   `json:"path"` // 1 old, 2 new
	Seq   uint32 `json:"seq"`
	Len   uint32 `json:"len"` // payload bytes (a FIN is in Flags)
	Ack   uint32 `json:"ack"`
	Flags uint8  `json:"flags"`
}

func (c Piece) String() string {
	return fmt.Sprintf("%s%s", c.Path, Packet{Seq: c.Seq, Ack: c.Ack, Len: c.Len, Flags: c.Flags})
}

// Decision says where an outgoing packet goes in the two-path phase. It
// always holds one piece (N = 1); the type keeps room for more.
type Decision struct {
	N      int
	Pieces [3]Piece
}

func (d *Decision) add(c Piece) {
	d.Pieces[d.N] = c
	d.N++
}

// List returns the pieces.
func (d Decision) List() []Piece { return d.Pieces[:d.N] }

// Decide applies the cut-off tables of §3.5 to a packet the anchor sends on
// the side being reconfigured, and returns where it goes and the variables
// after sending it. bpf/include/twopath.h does the same in the datapath.
//
// Bytes: byteSeq < oldSent → old path; byteSeq ≥ oldSent → new path.
// Acks: ack ≤ oldRcvd → old path; ack > oldRcvd → new path.
//
// Where the paper splits a packet, this sends it whole, so that the
// datapath never has to cut or copy a packet:
//   - data that straddles oldSent (a retransmission that TCP collapsed, a
//     GRO packet at a forwarding anchor) goes whole on the old path; the
//     receiving anchor's completion test accepts old-path data beyond the
//     cut-off (RecvDone). The agent splits such packets where it can (the
//     datapath hands them to it, docs/protocol.md "Two paths"), and each
//     part is then decided here on its own; this is what happens when it
//     cannot;
//   - a packet whose data belongs to the old path but whose ack belongs to
//     the new one goes on the old path acknowledging oldRcvd (the ack is
//     repeated by the next packet, on the new path);
//   - the paper's extra ack of oldRcvd on the old path is not sent: an ack
//     on either path counts as acknowledging the old-path data below it
//     (oldRcvdAcked), as the other anchor counts acks on either path
//     (Observe). Old-path middleboxes that terminate TCP (a proxy being
//     removed) may then miss their last acks; they leave the path anyway.
//
// An ack that does not advance (a duplicate ack, a window update) still
// concerns old data when ack ≤ oldRcvd, and goes on the old path; a pure
// ack there never names a sequence number beyond oldSent. A RST goes on
// the new path.
func Decide(v TwoPath, p Packet) (Decision, TwoPath) { return decide(v, p, 0) }

// DecideFault is Decide with deliberate faults, for the simulation's
// broken variants.
func DecideFault(v TwoPath, p Packet, f Fault) (Decision, TwoPath) { return decide(v, p, f) }

func decide(v TwoPath, p Packet, f Fault) (Decision, TwoPath) {
	var d Decision
	c := Piece{Seq: p.Seq, Len: p.Len, Ack: p.Ack, Flags: p.Flags}
	hasAck := p.Flags&TCPAck != 0
	data := p.End() != p.Seq
	switch {
	case p.Flags&TCPRst != 0:
		c.Path = PathNew
		d.add(c)
		return d, v
	case data && seqLT(p.Seq, v.OldSent):
		c.Path = PathOld
		if hasAck && seqLT(v.OldRcvd, p.Ack) && f&FaultAcksOnOldPath == 0 {
			c.Ack = v.OldRcvd
		}
	case data:
		c.Path = PathNew
	case hasAck && (seqLEQ(p.Ack, v.OldRcvd) || f&FaultAcksOnOldPath != 0):
		c.Path = PathOld
		if seqLT(v.OldSent, p.Seq) {
			c.Seq = v.OldSent
		}
	default:
		c.Path = PathNew
	}
	if hasAck {
		a := c.Ack
		if seqLT(v.OldRcvd, a) {
			a = v.OldRcvd
		}
		v.OldRcvdAcked = seqMax(v.OldRcvdAcked, a)
	}
	d.add(c)
	return d, v
}

// Observe updates the variables for a packet the anchor received on path
// (already translated to session space).
func Observe(v TwoPath, path Path, p Packet) TwoPath {
	if p.Flags&TCPRst != 0 {
		return v
	}
	if end := p.End(); end != p.Seq {
		switch path {
		case PathOld:
			v.OldRcvd = seqMax(v.OldRcvd, end)
		case PathNew:
			if !v.NewRcvd || seqLT(p.Seq, v.FirstNewRcvd) {
				v.FirstNewRcvd = p.Seq
				v.NewRcvd = true
			}
		}
	}
	if p.Flags&TCPAck != 0 {
		// An ack received on either path covers the old bytes below it:
		// an ack of new data on the new path implies the old data arrived.
		a := p.Ack
		if seqLT(v.OldSent, a) {
			a = v.OldSent
		}
		v.OldSentAcked = seqMax(v.OldSentAcked, a)
		if !v.AckHiOK || seqLT(v.AckHi, p.Ack) {
			v.AckHi, v.AckHiOK = p.Ack, true
		}
	}
	return v
}

// Deliver returns a packet received on path as the anchor hands it on,
// after Observe: a packet of the old path acknowledges at least AckHi.
//
// The other anchor stops sending new data on the old path at the cut-off,
// so the acknowledgments the old path carries stop at the data it carried,
// while the new path's move on. A late packet of the old path (data an old
// middlebox still had to deliver, or its retransmission) then carries an
// ack far behind the host's send window, and a TCP receiver discards the
// whole segment when the ack is more than a window old (RFC 5961 §5.2;
// Linux: SKB_DROP_REASON_TCP_TOO_OLD_ACK): the old data never arrives and
// the two-path phase never ends. This happens as soon as the host sent more
// than a window on the new path before the old path drained, for example
// when a loaded proxy being removed is slow to flush what it holds. The
// ack written instead is one the host has already received, so it
// acknowledges nothing new.
func Deliver(v TwoPath, path Path, p Packet) Packet { return DeliverFault(v, path, p, 0) }

// DeliverFault is Deliver with deliberate faults, for the simulation's
// broken variants.
func DeliverFault(v TwoPath, path Path, p Packet, f Fault) Packet {
	if f&FaultStaleOldAcks == 0 && path == PathOld && p.Flags&TCPAck != 0 && p.Flags&TCPRst == 0 && v.AckHiOK && seqLT(p.Ack, v.AckHi) {
		p.Ack = v.AckHi
	}
	return p
}
