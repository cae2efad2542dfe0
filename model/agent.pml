/*
 * The control half of an agent (agent.go): locking (§3.2), deltas (§3.4),
 * the UDP SYN handshake of the new path (§3.1, §3.3), UDP FIN / FIN-ACK
 * teardown of the old path (§3.5), cancelLock / ackCancel (§3.6).
 */

#define PENDING(me) ((la[1] == me && stageL[1] == 0) || (la[NR] == me && stageL[NR] == 0))

/* send a control message */
#define CTL(nb, t, r, x) assert(nfull(net[nb])); net[nb]!t(me, r, x, 0, 0, 0, 0)

/* the left anchor starts (or restarts, from the queue) request r */
inline startReq(r) {
	if
	:: freed[me] || rightN[me] == NONE ->
		stageL[r] = done; outcome[r] = Refused; reason[r] = ReasonNoSession
	:: else -> if
		:: lock[me] == unlocked ->
			lock[me] = lockPending; requestor[me] = r; stageL[r] = locking; laReq[me] = r;
			CTL(rightN[me], requestLock, r, 0)     /* anchors add no delta */
		:: lock[me] == lockPending ->
			/* a request passing through holds it: wait in the queue */
			assert(qreq[me] == 0);
			qreq[me] = r; qdelta[me] = 0; stageL[r] = locking; laReq[me] = r
		:: lock[me] == locked ->
			stageL[r] = done; outcome[r] = Refused; reason[r] = ReasonLocked
		fi
	fi
}

/* requestLock(r, rightDelta) from the left (from: the agent it came from;
 * every answer goes back there, reqFrom remembers it for the ackLock) */
inline onRequestLock(r, dl, fromQueue, rfrom) {
	if
	:: freed[me] -> CTL(rfrom, nackLock, r, ReasonNoSession)
	:: !freed[me] && busyRA[me] != 0 && busyRA[me] != r ->
		/* right anchor of an unfinished reconfiguration of its left side */
		CTL(rfrom, nackLock, r, ReasonBusy)
	:: !freed[me] && busyRA[me] == 0 && me == ra[r] ->
		/* accept: right anchor in waitSyn, ackLock with leftDelta 0 */
		busyRA[me] = r; stageR[r] = waitSyn; rightDelta[r] = dl;
		CTL(rfrom, ackLock, r, 0)
	:: !freed[me] && busyRA[me] == 0 && me != ra[r] && rightN[me] == NONE ->
		CTL(rfrom, nackLock, r, ReasonNotOnPath)
	:: !freed[me] && busyRA[me] == 0 && me != ra[r] && rightN[me] != NONE ->
#ifdef BROKEN_SKIP_LOCK
		/* broken: the lock is taken over whatever its state */
		lock[me] = lockPending; requestor[me] = r; reqFrom[me] = rfrom;
		CTL(rightN[me], requestLock, r, dl + sdL[me] + appR[me])
#else
		if
		:: lock[me] == unlocked ->
			lock[me] = lockPending; requestor[me] = r; reqFrom[me] = rfrom;
			CTL(rightN[me], requestLock, r, dl + sdL[me] + appR[me])
		:: lock[me] == lockPending ->
			assert(qreq[me] == 0 && !fromQueue);
			qreq[me] = r; qdelta[me] = dl; qfrom[me] = rfrom
		:: lock[me] == locked ->
			CTL(rfrom, nackLock, r, ReasonLocked)
		fi
#endif
	fi
}

/* refuse the queued request (the lock went to another) */
inline refuseQueued() {
	if
	:: qreq[me] != 0 && la[qreq[me]] == me ->
		stageL[qreq[me]] = done; outcome[qreq[me]] = Refused; reason[qreq[me]] = ReasonLocked;
		qreq[me] = 0
	:: qreq[me] != 0 && la[qreq[me]] != me ->
		CTL(qfrom[me], nackLock, qreq[me], ReasonLocked);
		qreq[me] = 0
	:: else
	fi
}

/* release the first queued request (now the rightmost: cannot block again) */
inline releaseQueued() {
	if
	:: qreq[me] != 0 ->
		q = qreq[me]; qreq[me] = 0;
		if
		:: la[q] == me -> startReq(q)
		:: else -> onRequestLock(q, qdelta[me], 1, qfrom[me])
		fi
	:: else
	fi
}

/* one of the two anchors is done with two paths: completion checks */
inline checkTwoPath() {
	if
	:: tp[me] ->
		r = tpReq[me];
		/* 1. everything sent on the old path acknowledged: fin(cutoff) */
		if
		:: !finSent[me] && oldSentAcked[me] == oldSent[me] ->
			finSent[me] = 1; CTL(oldN[me], fin, r, oldSent[me])
		:: else
		fi;
		/* 2. answer the other's fin once all its old data is in and acked */
		if
		:: haveCut[me] && !answered[me] && oldRcvdAcked[me] == oldRcvd[me] &&
		   ((newRcvd[me] && firstNewRcvd[me] <= oldRcvd[me]) || oldRcvd[me] >= cutoff[me] + dNew[me]) ->
			answered[me] = 1; CTL(oldN[me], finAck, r, 0)
		:: else
		fi;
		/* 3. complete: EndTwoPath, the new subsession becomes the side's */
		if
		:: finAcked[me] && answered[me] ->
			tp[me] = 0;
			lingerN[me] = oldN[me];
			if
			:: tpSide[me] == RIGHT -> lingerD[me] = sdR[me]; rightN[me] = newN[me]; sdR[me] = dNew[me]
			:: else -> lingerD[me] = sdL[me]; leftN[me] = newN[me]; sdL[me] = dNew[me]
			fi;
			newN[me] = NONE;
			if
			:: la[r] == me ->
				lock[me] = unlocked; requestor[me] = 0;
				stageL[r] = done; outcome[r] = Succeeded; held[r] = 0
			:: else ->
				stageR[r] = done; busyRA[me] = 0
			fi
		:: else
		fi
	:: else
	fi
}

/* a middle agent of the old path: fin-acks passed both ways, it frees the session */
inline middleFinAck() {
	finPassed[me] = finPassed[me] | (m.from == leftN[me] -> 1 : 2);
	if
	:: finPassed[me] == 3 -> freed[me] = 1; lock[me] = unlocked; requestor[me] = 0
	:: else
	fi
}

inline control() {
	r = m.req;
	if
	:: m.t == requestLock -> onRequestLock(r, m.x, 0, m.from)
	:: m.t == ackLock && me == la[r] ->
		assert(stageL[r] == locking);
		lock[me] = locked; stageL[r] = settingUp; leftDelta[r] = m.x;
		/* the contending requests are never both holding the segment */
		held[r] = 1;
		/* while a left anchor holds its segment, every agent of the old path
		 * up to the right anchor is locked by that request (§3.2) */
		q = rightN[me];
		do
		:: q != ra[r] ->
			assert(q != NONE && !freed[q] && lock[q] == locked && requestor[q] == r);
			q = rightN[q]
		:: else -> break
		od;
		assert(busyRA[q] == r && stageR[r] == waitSyn);
		assert(!(held[1] && held[NR]) || NR == 1);
		refuseQueued();
		/* AddSubsession to the first new hop, then the UDP SYN */
		newN[me] = (nh[r] > 0 -> hop[2*r] : ra[r]);
		dNew[me] = sdR[me] + leftDelta[r];
		synTries[r] = 1;
		CTL(newN[me], syn, r, 0)
	:: m.t == ackLock && me != la[r] ->
#ifndef BROKEN_SKIP_LOCK
		assert(lock[me] == lockPending && requestor[me] == r);
#endif
		lock[me] = locked;
		CTL(reqFrom[me], ackLock, r, m.x + sdR[me] + appL[me]);
		refuseQueued()
	:: m.t == nackLock && me == la[r] ->
		assert(stageL[r] == locking);
		lock[me] = unlocked; requestor[me] = 0;
		stageL[r] = done; outcome[r] = Refused; reason[r] = m.x;
		releaseQueued()
	:: m.t == nackLock && me != la[r] ->
#ifndef BROKEN_SKIP_LOCK
		assert(requestor[me] == r);
#endif
		lock[me] = unlocked; requestor[me] = 0;
		CTL(reqFrom[me], nackLock, r, m.x);
		releaseQueued()
	:: m.t == syn && me == ra[r] ->
		if
		:: stageR[r] == waitSyn ->
			/* AddSubsession armed, delta = left side's + rightDelta */
			newN[me] = m.from; dNew[me] = sdL[me] + rightDelta[r];
			stageR[r] = waitAck
		:: else -> assert(m.from == newN[me])   /* retransmitted SYN */
		fi;
		CTL(m.from, synAck, r, 0)
	:: m.t == syn && me != ra[r] ->
		/* JoinSession: a new hop, no deltas; forward with the rest of the list */
		leftN[me] = m.from;
		rightN[me] = (m.s + 1 < nh[r] -> hop[2*r + m.s + 1] : ra[r]);
		net[rightN[me]]!syn(me, r, 0, m.s + 1, 0, 0, 0)
	:: m.t == synAck && me == la[r] ->
		if
		:: stageL[r] == settingUp ->
			CTL(newN[me], ack, r, 0);
			startTwoPath(me, RIGHT, r);
			stageL[r] = twoPath
		:: else   /* duplicate */
		fi
	:: m.t == synAck && me != la[r] -> CTL(leftN[me], synAck, r, 0)
	:: m.t == ack && me == ra[r] ->
		if
		:: stageR[r] == waitAck -> startTwoPath(me, LEFT, r); stageR[r] = twoPath
		:: else   /* already switched by a new-path packet or the fin */
		fi
	:: m.t == ack && me != ra[r] -> CTL(rightN[me], ack, r, 0)
	:: m.t == fin && (me == la[r] || me == ra[r]) ->
		if
		:: me == ra[r] && stageR[r] == waitAck -> startTwoPath(me, LEFT, r); stageR[r] = twoPath
		:: else
		fi;
		assert(tp[me] && tpReq[me] == r);
		haveCut[me] = 1; cutoff[me] = m.x
	:: m.t == fin && me != la[r] && me != ra[r] ->
		CTL((m.from == leftN[me] -> rightN[me] : leftN[me]), fin, r, m.x)
	:: m.t == finAck && (me == la[r] || me == ra[r]) ->
		assert(tp[me] && finSent[me]);
		finAcked[me] = 1
	:: m.t == finAck && me != la[r] && me != ra[r] ->
		CTL((m.from == leftN[me] -> rightN[me] : leftN[me]), finAck, r, 0);
		middleFinAck()
	:: m.t == cancelLock && me == ra[r] ->
		/* release the right anchor's state */
		if
		:: busyRA[me] == r -> busyRA[me] = 0; newN[me] = NONE; stageR[r] = done
		:: else
		fi;
		CTL(leftN[me], ackCancel, r, 0)
	:: m.t == cancelLock && me != ra[r] ->
		if
		:: requestor[me] == r -> lock[me] = unlocked; requestor[me] = 0
		:: else
		fi;
		CTL(rightN[me], cancelLock, r, 0)
	:: m.t == ackCancel && me == la[r] ->
		assert(stageL[r] == cancelling);
		lock[me] = unlocked; requestor[me] = 0;
		stageL[r] = done; outcome[r] = Failed; reason[r] = ReasonSetupFailed
	:: m.t == ackCancel && me != la[r] -> CTL(leftN[me], ackCancel, r, 0)
	fi
}

proctype agent(byte me) {
	Msg m;
	byte r, q, side, path, d, ao, hx, hs, hb, rq, dd, nb2, hh, hside, sq, hat;
	bool dataOld, dataNew, ackOld;

	if
	:: dead[me] ->
		/* a failed host: swallows everything (§3.6) */
end_dead:	do :: net[me]?m.t, m.from, m.req, m.x, m.s, m.a, m.st, m.at -> skip od
	:: else
	fi;
end:
	do
	:: atomic { net[me]?m.t, m.from, m.req, m.x, m.s, m.a, m.st, m.at ->
		if
		:: m.t == tcp -> tcpIn()
		:: else -> control()
		fi;
		checkTwoPath() }
	/* the operator (or a middlebox) asks this agent to reconfigure */
	:: atomic { PENDING(me) ->
		rq = (la[1] == me && stageL[1] == 0 -> 1 : NR);
		startReq(rq) }
	/* the host writes its next byte, or closes */
	:: atomic { ISHOST(me) && (hSndNxt[HOST(me)] < NDH(HOST(me)) || (FINS && !hFinSent[HOST(me)])) ->
		hh = HOST(me); hostSend(hh); checkTwoPath() }
	/* no answer to the SYN: retransmit, after MAXTRIES cancel (§3.6) */
	:: atomic { timeout && laReq[me] != 0 && stageL[laReq[me]] == settingUp ->
		r = laReq[me];
		if
		:: synTries[r] < MAXTRIES ->
			synTries[r]++; CTL(newN[me], syn, r, 0)
		:: else ->
			/* RemoveSubsession; cancelLock on the old path until ackCancel */
			newN[me] = NONE; held[r] = 0; stageL[r] = cancelling;
			CTL(rightN[me], cancelLock, r, 0)
		fi }
	od
}
