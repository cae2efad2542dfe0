package sim

import (
	"time"

	"github.com/dysco/dysco/internal/protocol"
)

// tcpEnd is a simplified TCP endpoint: cumulative acks, a fixed window,
// reassembly of out-of-order segments, retransmission from the first
// unacknowledged byte on timeout, FIN, RST, timestamps. It checks every
// segment it receives against the tags its peer put in.
type tcpEnd struct {
	w    *world
	h    *host
	ds   *dpSess
	sess *simSession
	side protocol.Side // towards the chain
	dir  int           // direction of the data it sends
	name string

	iss, irs   uint32
	total      uint32 // bytes the application sends, then closes
	avail      uint32 // bytes the application has written so far
	sndUna     uint32
	sndNxt     uint32
	finSent    bool
	finAcked   bool
	rcvOff     uint32      // bytes of the peer's stream received in order (FIN included)
	segs       [][2]uint32 // out-of-order ranges of offsets
	finAt      uint32
	haveFin    bool
	finRcvd    bool
	peerTotal  uint32
	tsOff      uint32 // added to our clock in TSval
	peerTSBase uint32 // what the peer's TSvals look like here, minus its clock
	echo       uint32
	echoTag    uint32
	haveEcho   bool

	state int
	rto   *event
	tries int
}

const (
	tcpOpen = iota
	tcpTimeWait
	tcpReset
	tcpAborted
)

func (e *tcpEnd) clock() uint32 { return uint32(e.w.now/time.Millisecond) + 1 }

// emit sends a segment from the TCP into the datapath.
func (e *tcpEnd) emit(seq, n uint32, flags uint8) {
	p := pkt{sess: e.sess, dir: e.dir, seq: seq, ack: e.irs + e.rcvOff, len: n, flags: flags | protocol.TCPAck,
		tsval: e.tsOff + e.clock(), tsecr: e.echo, off: seq - e.iss, ackOff: e.rcvOff,
		tsTag: e.clock(), ecrTag: e.echoTag, hasEcr: e.haveEcho}
	e.h.send(e.ds, e.side, p)
}

// pump sends what the window allows; it reports whether it sent anything.
func (e *tcpEnd) pump() bool {
	if e.state != tcpOpen || e.ds.gone {
		return false
	}
	sent := false
	for {
		inflight := e.sndNxt - e.sndUna
		off := e.sndNxt - e.iss
		if off < e.avail && inflight < tcpWindow {
			n := min(uint32(1+e.w.rng.IntN(mss)), e.avail-off, tcpWindow-inflight)
			e.emit(e.sndNxt, n, 0)
			e.sndNxt += n
			sent = true
			continue
		}
		if off == e.total && e.avail == e.total && !e.finSent {
			e.emit(e.sndNxt, 0, protocol.TCPFin)
			e.finSent = true
			e.sndNxt++
			sent = true
			continue
		}
		break
	}
	if e.sndUna != e.sndNxt && e.rto == nil {
		e.armRTO()
	}
	return sent
}

func (e *tcpEnd) armRTO() {
	d := tcpRTO
	for i := 0; i < e.tries && d < tcpMaxRTO; i++ {
		d *= 2
	}
	e.rto = e.w.after(min(d, tcpMaxRTO), e.onRTO)
}

func (e *tcpEnd) stopRTO() {
	if e.rto != nil {
		e.rto.cancelled = true
		e.rto = nil
	}
}

func (e *tcpEnd) onRTO() {
	e.rto = nil
	if e.state != tcpOpen || e.sndUna == e.sndNxt || e.ds.gone {
		return
	}
	e.tries++
	if e.tries > tcpMaxTries {
		e.w.tracef("%s aborts after %d retransmissions", e.name, tcpMaxTries)
		e.emit(e.sndNxt, 0, protocol.TCPRst)
		e.state = tcpAborted
		return
	}
	off := e.sndUna - e.iss
	if off == e.total {
		e.emit(e.sndUna, 0, protocol.TCPFin) // the FIN alone is outstanding
	} else {
		dataEnd := e.sndNxt
		if e.finSent {
			dataEnd--
		}
		e.emit(e.sndUna, min(uint32(mss), dataEnd-e.sndUna), 0)
	}
	e.armRTO()
}

// reset is the application aborting the connection.
func (e *tcpEnd) reset() {
	if e.state != tcpOpen || e.ds.gone {
		return
	}
	e.w.tracef("%s RESET by the application", e.name)
	e.sess.rst = true
	e.w.stats.Resets++
	e.emit(e.sndNxt, 0, protocol.TCPRst)
	e.state = tcpReset
	e.stopRTO()
}

func (e *tcpEnd) receive(p pkt) {
	w := e.w
	switch e.state {
	case tcpReset, tcpAborted:
		if p.flags&protocol.TCPRst == 0 {
			e.emit(p.ack, 0, protocol.TCPRst)
		}
		return
	case tcpTimeWait:
		if p.len > 0 || p.flags&protocol.TCPFin != 0 {
			e.emit(e.sndNxt, 0, 0) // acknowledge a retransmission again
		}
		return
	}
	if p.flags&protocol.TCPRst != 0 {
		w.tracef("%s reset by the peer", e.name)
		e.sess.rst = true
		e.state = tcpReset
		e.stopRTO()
		return
	}
	// §3.7: the sequence and acknowledgment numbers end hosts see are right.
	if p.seq-e.irs != p.off {
		w.fail("%s: sequence number %d means offset %d, the sender sent offset %d (%s)", e.name, p.seq, p.seq-e.irs, p.off, p)
		return
	}
	if p.ack-e.iss != p.ackOff {
		w.fail("%s: ack %d means offset %d, the receiver acknowledged %d (%s)", e.name, p.ack, p.ack-e.iss, p.ackOff, p)
		return
	}
	if seqLT(e.sndNxt, p.ack) {
		w.fail("%s: ack %d beyond what was sent (%d)", e.name, p.ack, e.sndNxt)
		return
	}
	if p.tsval-e.peerTSBase != p.tsTag || p.hasEcr && p.tsecr-e.tsOff != p.ecrTag {
		w.fail("%s: timestamps %d/%d mean %d/%d, sent as %d/%d", e.name, p.tsval, p.tsecr,
			p.tsval-e.peerTSBase, p.tsecr-e.tsOff, p.tsTag, p.ecrTag)
		return
	}
	// A segment whose ack is more than a window behind what is already
	// acknowledged is discarded whole, data and all, as Linux does (RFC
	// 5961 §5.2; SKB_DROP_REASON_TCP_TOO_OLD_ACK): the window is the
	// largest the peer offered, or the bytes acknowledged if fewer.
	if p.flags&protocol.TCPAck != 0 && seqLT(p.ack, e.sndUna-min(uint32(tcpWindow), e.sndUna-e.iss)) {
		w.stats.TooOldAcks++
		w.tracef("%s discards %s: its ack is more than a window old", e.name, p)
		return
	}
	if seqLT(e.sndUna, p.ack) {
		e.sndUna = p.ack
		e.tries = 0
		e.stopRTO()
		if e.finSent && e.sndUna == e.sndNxt {
			e.finAcked = true
		}
	}
	if p.len > 0 || p.flags&protocol.TCPFin != 0 {
		e.echo, e.echoTag, e.haveEcho = p.tsval, p.tsTag, true
		lo, hi := p.off, p.off+p.len
		if p.flags&protocol.TCPFin != 0 {
			if e.haveFin && e.finAt != hi {
				w.fail("%s: FIN moved from offset %d to %d", e.name, e.finAt, hi)
				return
			}
			e.finAt, e.haveFin = hi, true
		}
		if hi > e.peerTotal {
			w.fail("%s: data beyond the stream: offset %d, stream has %d", e.name, hi, e.peerTotal)
			return
		}
		if lo < hi {
			e.segs = append(e.segs, [2]uint32{lo, hi})
		}
		e.advance()
		if !e.pump() {
			e.emit(e.sndNxt, 0, 0)
		}
	} else {
		e.pump()
	}
	if e.finRcvd && e.finAcked {
		e.state = tcpTimeWait
		e.stopRTO()
		w.tracef("%s closed: received %d, sent %d", e.name, e.rcvOff-1, e.total)
	}
}

// advance moves rcvOff over the ranges received in order.
func (e *tcpEnd) advance() {
	for moved := true; moved; {
		moved = false
		kept := e.segs[:0]
		for _, r := range e.segs {
			switch {
			case r[1] <= e.rcvOff:
			case r[0] <= e.rcvOff:
				e.rcvOff = r[1]
				moved = true
			default:
				kept = append(kept, r)
			}
		}
		e.segs = kept
	}
	if e.haveFin && !e.finRcvd && e.rcvOff == e.finAt {
		e.rcvOff++
		e.finRcvd = true
	}
}
