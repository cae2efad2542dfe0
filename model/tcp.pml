/*
 * TCP segments through the chain: deltas (§3.4), marks, the two-path
 * phase (§3.5: twopath.go CutOff, Decide, Observe) and the end hosts.
 *
 * A segment: x = 0 pure ack, 1 one data byte, 2 FIN (one sequence
 * number); s its sequence number, a its ack (every segment carries ACK).
 * st and at are tags the sending host sets and nobody changes except by the
 * same amount as s / a: the receiving host checks that the numbers it sees
 * mean what the sender meant (§3.7 "sequence and ack numbers correct").
 */

#define MAX(a, b) (a > b -> a : b)
#define MIN(a, b) (a < b -> a : b)
#define SIDEN(me, side) (side == LEFT -> leftN[me] : rightN[me])
#define SIDED(me, side) (side == LEFT -> sdL[me] : sdR[me])
#define M(me, side) (2*(me)+(side))
#define ISHOST(me) ((me) == 0 || (me) == LAST)
#define HOST(me) (me == 0 -> 0 : 1)
/* bytes (data + FIN) of the stream sent by host h */
#define NDH(h) (h == 0 -> NDR : NDL)
/* end-to-end delta of the stream host h receives */
#define TDIN(h) (h == 0 -> TDL : TDR)

/* State migration (-DMIGRATE): the new middlebox has the state before
 * any packet of the session reaches it; with order semantics no end host
 * sends a packet to the old middlebox after its export, before its own
 * switch (after it, §3.5's cut-off rules keep retransmissions and acks
 * of bytes sent before on the old path) or the abort. */
#ifdef MIGRATE
#define HELD(me) holdL[me]
#define ACKOWED(me) ackOwed[me] = 1
#define MIGSTATEIN() assert(me != MNEW || joinReq[me] == 0 || hasState[me])
#ifdef MIG_ORDER
/* (after the right anchor's hold lease, only after a loss, what it held
 * and sends after it crosses the old middlebox: order is not kept) */
#define MIGORDERPUT(nb) assert(!(nb == MOLD && ISHOST(me) && exported && !migAborted && !tp[me] && !holdLeased))
#else
#define MIGORDERPUT(nb) skip
#endif
#else
#define HELD(me) false
#define ACKOWED(me) skip
#define MIGSTATEIN() skip
#define MIGORDERPUT(nb) skip
#endif

#ifdef UDP
#include "udp.pml"
#else
/* twopath.go CutOff: snapshot the side's marks */
inline startTwoPath(me, side, r) {
	tp[me] = 1; tpSide[me] = side; tpReq[me] = r;
	oldN[me] = SIDEN(me, side);
	oldSent[me] = MAX(sndNxt[M(me, side)], ackRcvd[M(me, side)]);
	oldRcvd[me] = MAX(rcvNxt[M(me, side)], ackSent[M(me, side)]);
	oldSentAcked[me] = ackRcvd[M(me, side)];
	oldRcvdAcked[me] = ackSent[M(me, side)];
	newRcvd[me] = 0; firstNewRcvd[me] = 0;
	finSent[me] = 0; finAcked[me] = 0; answered[me] = 0; haveCut[me] = 0; probes[me] = 0; finVia[me] = 0; finOldAcked[me] = 0
}
#endif

#ifndef UDP
/* one piece on one path: egress delta (ack - delta) */
inline put(nb, d, ps, pa, px, pst, pat) {
	assert(nfull(net[nb]));   /* the bounded channels never overflow */
	MIGORDERPUT(nb);
	net[nb]!tcp(me, PTAG(nb), px, ps, pa - d, pst, pat)
}

/*
 * Egress of a segment (session space) on a side of agent me: the marks,
 * then twopath.go Decide when the side is in the two-path phase.
 */
inline egress(side, es, ea, ex, est, eat) {
	sndNxt[M(me, side)] = MAX(sndNxt[M(me, side)], es + (ex != 0));
	ackSent[M(me, side)] = MAX(ackSent[M(me, side)], ea);
	if
	:: tp[me] && tpSide[me] == side ->
		/* Decide (twopath.go): one path per packet, never split.
		 * Bytes below oldSent old, others new; a packet without data
		 * goes where its ack belongs (ack <= oldRcvd: old). Data on the
		 * old path acknowledges at most oldRcvd. Any ack, on either
		 * path, raises oldRcvdAcked up to oldRcvd. */
		dataOld = (ex != 0 && es < oldSent[me]);
		dataNew = (ex != 0 && es >= oldSent[me]);
#ifdef BROKEN_ACKS_OLD
		ackOld = 1;
#else
		ackOld = (ea <= oldRcvd[me]);
#endif
		ao = ea;
		if
		:: dataOld ->
			ao = (ackOld -> ea : oldRcvd[me]);
			dd = SIDED(me, side);
			put(oldN[me], dd, es, ao, ex, est, eat + ao - ea)
		:: dataNew ->
			put(newN[me], dNew[me], es, ea, ex, est, eat)
		:: ex == 0 && ackOld ->
			dd = SIDED(me, side);
			sq = MIN(es, oldSent[me]);
			put(oldN[me], dd, sq, ea, 0, 0, eat)
		:: ex == 0 && !ackOld ->
			put(newN[me], dNew[me], es, ea, 0, 0, eat)
		fi;
		oldRcvdAcked[me] = MAX(oldRcvdAcked[me], MIN(ao, oldRcvd[me]))
	:: else ->
		dd = SIDED(me, side); nb2 = SIDEN(me, side);
		put(nb2, dd, es, ea, ex, est, eat)
	fi
}

/* a host sends its next byte (or its FIN) with its cumulative ack */
inline hostSend(h) {
	hx = (hSndNxt[h] < NDH(h) -> 1 : 2);
	hs = hSndNxt[h];
	hSndNxt[h]++;
	if
	:: hx == 2 -> hFinSent[h] = 1
	:: else
	fi;
	hside = (h == 0 -> RIGHT : LEFT);
	hat = hRcvNxt[h] - TDIN(h);
	egress(hside, hs, hRcvNxt[h], hx, hs, hat)
}

/* a host receives a segment (session space) */
inline hostRecv(h) {
	/* acks mean what the other host meant, and ack nothing unsent */
	assert(m.a == m.at);
	assert(m.a <= hSndNxt[h]);
	hSndUna[h] = MAX(hSndUna[h], m.a);
	if
	:: m.x != 0 ->
		/* sequence number means what the sender meant */
		assert(m.s == m.st + TDIN(h));
		hb = m.s - TDIN(h);               /* offset in the stream */
		assert(hb < NDH(1-h) + 1);
		/* no byte received twice */
		assert((hRcvd[h] & (1 << hb)) == 0);
		hRcvd[h] = hRcvd[h] | (1 << hb);
		if
		:: m.x == 2 -> assert(hb == NDH(1-h)); hFinRcvd[h] = 1
		:: else -> assert(hb < NDH(1-h))
		fi;
		do
		:: (hRcvd[h] & (1 << (hRcvNxt[h] - TDIN(h)))) != 0 -> hRcvNxt[h]++
		:: else -> break
		od;
		/* acknowledge at once (pure ack); a host that holds (a
		 * migration's freeze) owes it until the hold is released */
		if
		:: HELD(me) -> ACKOWED(me)
		:: else ->
		hside = (h == 0 -> RIGHT : LEFT);
		hat = hRcvNxt[h] - TDIN(h);
		egress(hside, hSndNxt[h], hRcvNxt[h], 0, 0, hat)
		fi
	:: else
	fi
}

/*
 * Ingress of a segment at agent me: which side and path it came on, the
 * ingress delta, the marks, Observe; then the host takes it or the
 * middlebox forwards it (AppDelta) to the other side.
 */
inline tcpIn() {
	MIGSTATEIN();
	if
	:: tp[me] && m.from == newN[me] -> side = tpSide[me]; path = 2; d = dNew[me]
	:: !tp[me] && newN[me] != NONE && m.from == newN[me] && busyRA[me] != 0 ->
		/* armed subsession: the first packet on the new path starts the
		 * two-path phase at the right anchor (ack lost or late). (A left
		 * anchor setting up a new path whose first hop is its neighbour
		 * already, which refuses it, gets that neighbour's packets on its
		 * old subsession: below.) */
		assert(stageR[busyRA[me]] == waitAck);
		startTwoPath(me, LEFT, busyRA[me]);
		stageR[busyRA[me]] = twoPath;
		side = LEFT; path = 2; d = dNew[me]
	:: m.from == leftN[me] && (!tp[me] || m.from != newN[me]) -> side = LEFT; path = 1; d = sdL[me]
	:: m.from == rightN[me] && (!tp[me] || m.from != newN[me]) -> side = RIGHT; path = 1; d = sdR[me]
	:: m.from != leftN[me] && m.from != rightN[me] && m.from != newN[me] && m.from == lingerN[me] ->
		/* the old subsession lingering after completion */
		side = tpSide[me]; path = 1; d = lingerD[me]
	:: m.from != leftN[me] && m.from != rightN[me] && m.from != newN[me] && m.from != lingerN[me] ->
		/* an older subsession, already removed (after Linger): the packet
		 * is dropped; it must not carry data (that would be lost) */
		assert(m.x == 0);
		path = 0
	fi;
	if
	:: path == 0 -> skip
	:: else ->
#ifdef REBIND
	/* a rebind: the segment's subsession (its generation, PTAG) has an
	 * ingress flow here (dysco.pml RBIN) */
	if
	:: path == 1 && m.from == SIDEN(me, side) -> assert(RBIN(me, side, m.from, m.req))
	:: else
	fi;
#endif
	m.s = m.s + d;
	rcvNxt[M(me, side)] = MAX(rcvNxt[M(me, side)], m.s + (m.x != 0));
	ackRcvd[M(me, side)] = MAX(ackRcvd[M(me, side)], m.a);
	if
	:: tp[me] && tpSide[me] == side ->
		/* Observe */
		if
		:: m.x != 0 && path == 1 -> oldRcvd[me] = MAX(oldRcvd[me], m.s + 1)
		:: m.x != 0 && path == 2 && (!newRcvd[me] || m.s < firstNewRcvd[me]) ->
			firstNewRcvd[me] = m.s; newRcvd[me] = 1
		:: else
		fi;
		oldSentAcked[me] = MAX(oldSentAcked[me], MIN(m.a, oldSent[me]))
	:: else
	fi;
	if
	:: ISHOST(me) -> hh = HOST(me); hostRecv(hh)
	:: !ISHOST(me) && side == LEFT ->
		/* an original middlebox never forwards an ack for data it has
		 * not forwarded (why acks of old data use the old path, §3.1) */
		assert(!orig[me] || m.a <= sndNxt[M(me, LEFT)]);
		egress(RIGHT, m.s + appR[me], m.a - appL[me], m.x, m.st, m.at)
	:: !ISHOST(me) && side == RIGHT ->
		assert(!orig[me] || m.a <= sndNxt[M(me, RIGHT)]);
		egress(LEFT, m.s + appL[me], m.a - appR[me], m.x, m.st, m.at)
	fi
	fi
}
#endif
