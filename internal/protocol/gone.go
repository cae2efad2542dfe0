package protocol

import (
	"net/netip"
	"time"

	"github.com/dysco/dysco/internal/wire"
)

// Answers to requests for sessions that ended here (MessageIn.Gone).
//
// A host whose datapath has collected a session answers a requestLock for
// it with a nackLock "session ended", so that the left anchor does not
// wait out its retransmissions. The answer must survive loss: if it is
// lost, the left anchor's next retransmission must get it again; and a
// request that passed this host while the session still lived (marked in
// its left anchor's window, replay.go) must get it when its retransmission
// finds the session gone. So the agent remembers, for a bounded time and
// number, which (request, subsession, sender) it has answered or passed,
// and answers a copy from the same sender on the same subsession again,
// at most once per goneMinGap (RTO). What is not answered: a copy that follows
// the last answer sooner than any retransmission can (a duplicate the
// network or an attacker made), and anything after the left anchor's
// retransmissions have run out (goneSpan: a replay of an old request).
//
// Why a re-answered nack is not a replay risk: the copy has passed the
// MAC check (its sender's address is covered, so it comes from that
// address) before it gets here; the answer is the same nack every time,
// goes only to that authenticated sender, and changes no state here or
// there (a left anchor drops a nack for a request it is not running).

// maxGone bounds the requests remembered for re-answering.
const maxGone = 4096

type goneKey struct {
	req  ReqKey
	sub  wire.Tuple
	from netip.Addr
}

type goneEntry struct {
	first, last time.Duration // first seen here; last answered (answered)
	answered    bool
}

type goneSet struct {
	m    map[goneKey]goneEntry
	ring []goneKey // insertion order, for eviction
	next int
}

// notePassed records that requestLock m came from from while its session
// lived here: a retransmission that finds the session gone is answered.
func (a *Agent) notePassed(m *Message, from netip.Addr) {
	k := goneKey{req: m.Req, sub: m.Sub, from: from}
	if _, ok := a.gone.m[k]; ok {
		return
	}
	a.gone.put(k, goneEntry{first: a.now})
}

func (g *goneSet) put(k goneKey, e goneEntry) {
	if g.m == nil {
		g.m = map[goneKey]goneEntry{}
	}
	if _, ok := g.m[k]; !ok {
		if len(g.ring) < maxGone {
			g.ring = append(g.ring, k)
		} else {
			delete(g.m, g.ring[g.next])
			g.ring[g.next] = k
			g.next = (g.next + 1) % maxGone
		}
	}
	g.m[k] = e
}

// goneSpan is how long a left anchor retransmits a requestLock: the sum of
// its back-offs.
func (a *Agent) goneSpan() time.Duration {
	var d time.Duration
	for i := 1; i <= a.cfg.MaxTries; i++ {
		d += a.backoff(i)
	}
	return d
}

// goneMinGap is the shortest time between two answers to one request: a
// left anchor (of the same deployment, so of the same RTO) retransmits at
// least RTO after the copy before; a copy that comes sooner is the
// network's or an attacker's. (A retransmission that overtook part of that
// gap in the network is not answered; the next one is.)
func (a *Agent) goneMinGap() time.Duration { return a.cfg.RTO }

// onGoneRequest answers requestLock m for a session that ended here, if it
// is the first copy heard of, or a retransmission of one answered or
// passed here (above).
func (a *Agent) onGoneRequest(m *Message, from netip.Addr) {
	k := goneKey{req: m.Req, sub: m.Sub, from: from}
	e, seen := a.gone.m[k]
	switch {
	case !a.knownReq(m.Req):
		a.heardOf(m.Req)
		e = goneEntry{first: a.now}
	case !seen:
		return // heard of elsewhere (a replay from another subsession), or too old to tell
	case a.now-e.first > a.goneSpan():
		return // its left anchor has stopped asking: a replay
	case e.answered && a.now-e.last < a.goneMinGap():
		return // no retransmission comes this soon: a duplicate
	}
	e.answered, e.last = true, a.now
	a.gone.put(k, e)
	n := &Message{Type: MsgNackLock, Reason: ReasonSessionEnded, Nonce: m.Nonce, Sub: m.Sub,
		Session: m.Session, Req: m.Req, RightAnchor: m.RightAnchor}
	a.send(from, n)
}
