/*
 * UDP sessions (-DUDP; internal/protocol/udp.go, docs/protocol.md "UDP
 * sessions"): datagrams instead of TCP segments, and the two-path phase
 * for datagrams instead of §3.5's cut-off rules.
 *
 * A datagram: x = 1, s its number in its host's stream, a its tag: 1 put
 * on a subsession that is not the new one of a two-path phase (the path as
 * it was, which becomes the old path when a phase starts), 2 put on a new
 * subsession. No acks, no deltas, no marks. dgOld counts the datagrams
 * tagged 1 in the channels, hop by hop (put: +1, received: -1).
 *
 * An anchor switches at startTwoPath: from then on it sends every
 * datagram on its new subsession. It ends its side of the phase (uq, the
 * Go TimerQuiet: its old path quiet for the drain time since its switch)
 * only once the old path holds no datagram (dgOld == 0): that is the
 * assumption that the drain time exceeds the longest time a datagram
 * spends on the old path, as a guard, since the model has no time. Then it
 * sends its fin (evaluate), answers the other's at once, and completes
 * when both are done, exactly as for TCP.
 *
 * Checked: every datagram reaches the other host exactly once (the
 * network loses no data in the model), and none arrives at a host whose
 * state of the path it travels is gone: on an anchor's old subsession
 * after the anchor completed (its tomb), on a subsession already removed,
 * or at a middle agent that left the path (freed). -DBROKEN_UDP_NO_QUIET:
 * an anchor ends its side at its switch; this must fail.
 */
byte dgOld;                     /* datagrams on a path as it was (tag 1) in the channels */
bool uq[NA];                    /* anchor.quiet: this anchor ended its side of the phase */

inline startTwoPath(me, side, r) {
	tp[me] = 1; tpSide[me] = side; tpReq[me] = r;
	oldN[me] = SIDEN(me, side);
	finSent[me] = 0; finAcked[me] = 0; answered[me] = 0; haveCut[me] = 0; probes[me] = 0; finVia[me] = 0; finOldAcked[me] = 0;
#ifdef BROKEN_UDP_NO_QUIET
	uq[me] = 1
#else
	uq[me] = 0
#endif
}

/* UQUIET: TimerQuiet may fire (udp.go onQuiet) */
#define UQUIET(i) (tp[i] && !uq[i] && dgOld == 0)

inline put(nb, ps, ptag, pst) {
	assert(nfull(net[nb]));
	if
	:: ptag == 1 -> dgOld++
	:: else
	fi;
	net[nb]!tcp(me, 0, 1, ps, ptag, pst, 0)
}

/* a datagram leaves agent me on side: on the new subsession once that
 * side has switched, else on the side's subsession (tag 1) */
inline egress(side, es, ex, est) {
	if
	:: tp[me] && tpSide[me] == side -> put(newN[me], es, 2, est)
	:: else -> nb2 = SIDEN(me, side); put(nb2, es, 1, est)
	fi
}

/* a host sends its next datagram */
inline hostSend(h) {
	hs = hSndNxt[h];
	hSndNxt[h]++;
	hside = (h == 0 -> RIGHT : LEFT);
	egress(hside, hs, 1, h)
}

/* a host receives a datagram: from the other host, once */
inline hostRecv(h) {
	assert(m.st == 1 - h && m.s < NDH(1-h));
	assert((hRcvd[h] & (1 << m.s)) == 0);
	hRcvd[h] = hRcvd[h] | (1 << m.s)
}

inline tcpIn() {
	if
	:: m.a == 1 -> dgOld--
	:: else
	fi;
	/* no datagram reaches a middle agent that left the path */
	assert(ISHOST(me) || !freed[me]);
	if
	:: tp[me] && m.from == newN[me] -> side = tpSide[me]; path = 2
	:: !tp[me] && newN[me] != NONE && m.from == newN[me] && busyRA[me] != 0 ->
		/* armed: the first datagram on the new path switches the right anchor */
		assert(stageR[busyRA[me]] == waitAck);
		startTwoPath(me, LEFT, busyRA[me]);
		stageR[busyRA[me]] = twoPath;
		side = LEFT; path = 2
	:: m.from == leftN[me] && (!tp[me] || m.from != newN[me]) -> side = LEFT; path = 1
	:: m.from == rightN[me] && (!tp[me] || m.from != newN[me]) -> side = RIGHT; path = 1
	:: m.from != leftN[me] && m.from != rightN[me] && m.from != newN[me] ->
		/* the old subsession after the anchor completed (its tomb), or
		 * one already removed: the old path was torn down before it
		 * drained, and the datagram is lost */
		assert(false)
	fi;
	if
	:: ISHOST(me) -> hh = HOST(me); hostRecv(hh)
	:: !ISHOST(me) && side == LEFT -> egress(RIGHT, m.s, 1, m.st)
	:: !ISHOST(me) && side == RIGHT -> egress(LEFT, m.s, 1, m.st)
	fi
}
