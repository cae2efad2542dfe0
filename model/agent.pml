/*
 * The control half of an agent (internal/protocol): locking (§3.2), deltas (§3.4),
 * the UDP SYN handshake of the new path (§3.1, §3.3), UDP FIN / FIN-ACK
 * teardown of the old path (§3.5), cancelLock / ackCancel (§3.6), and the
 * retransmission timers with the receivers' duplicate handling (internal/protocol
 * onTimer, the history of resolved requests).
 */

#ifdef TRIGGER
/* the operator asks the middlebox to be removed: it triggers its left neighbour */
#define PENDING(me) (me == TRIGGERER && trigTries == 0)
#elif defined(NOREQ)
#define PENDING(me) false   /* a rebind alone */
#else
#define PENDING(me) ((la[1] == me && stageL[1] == 0) || (la[NR] == me && stageL[NR] == 0 && AFTER1))
#endif

/* Rebinds (rebind.go; -DREBIND, dysco.pml): the macros the lock and
 * teardown code needs; the procedures are further down */
#ifdef REBIND
#if defined(TRIGGER) || defined(MIGRATE)
#error "-DREBIND: no TRIGGER or MIGRATE (XREB shares their exchange bit)"
#endif
#define XREB 128   /* rebind, rebindAck: the mover's TimerRebind */
#define RBR 1      /* the slot of lossy / lostNow (bit XREB) the rebind's exchange uses */
#define RBQ (NR+1) /* the requestor of a lock the rebind holds (s.requestor = the rebind's Req) */
/* a reconfiguration holds side sd of agent i: it is the right anchor of
 * one on its left (s.right), the left anchor of one on its right (s.left),
 * or its lock is taken; or the side is moving itself (onRebindIn) */
#define LEFTANCHOR(i) (laReq[i] != 0 && stageL[laReq[i]] != 0 && stageL[laReq[i]] != done)
#ifdef BROKEN_REBIND_NO_BUSY
#define RBHELD(i, sd) false   /* broken: the neighbour does not refuse */
#else
#define RBHELD(i, sd) ((sd == LEFT && busyRA[i] != 0) || (sd == RIGHT && (LEFTANCHOR(i) || lock[i] != unlocked)) || \
	(rbOn && i == RBMOVER && sd == RBSIDE))
#endif
/* the right anchor refuses a requestLock while its left subsession moves (lock.go) */
#ifdef BROKEN_REBIND_RA
#define RBLEFTMOVES(i) false  /* broken: it accepts the request */
#else
#define RBLEFTMOVES(i) (rbOn && i == RBMOVER && RBSIDE == LEFT)
#endif
/* a reconfiguration's new subsession (complete): generation 0 at both ends */
#define RBNEWSUB(v) v[me] = 0
/* the agent (docs/mobility.md) asks for a rebind while the side is not on
 * the new address, up to RBTRIES times (the first, and RBTRIES-1 more
 * after a refusal or a give-up) */
#define RBSTART(me) (me == RBMOVER && !rbOn && rbReq < RBTRIES && SG(me, RBSIDE) != RBADDR)
/* TimerRebind is armed. It fires once a copy or its answer was lost, or a
 * copy rejected; with RB_SLOW also when the answer is merely slower than
 * the timer (spurious retransmissions, a give-up while the answer is on
 * its way) */
#define TREB(me) (me == RBMOVER && rbOn)
#ifdef RB_SLOW
#define RBFIRE true
#else
#define RBFIRE false
#endif
#define REBDUE (rbOn && rbTries >= MAXTRIES)
/* TimerRebound: Linger runs out once nothing else can happen (it outlasts
 * every attempt of the mover: Go gives an attempt at most Linger/2) */
#define LINGERDUE (timeout && !rbOn)
#else
#define RBLEFTMOVES(i) false
#define RBNEWSUB(v) skip
#define REBDUE false
#endif
/* a rebind or rebindAck dropped at a full queue: counted for the
 * attempt's give-up (ndrop stops at 2) */
#ifdef REBIND
#define RBDROP(X) rbDrop = rbDrop || ((X) == XREB)
#else
#define RBDROP(X) skip
#endif

/* A migrating request is gated (newPathUp): its SYN-ACK starts the
 * migration instead of the switch, and its SYN is no longer retransmitted
 * (TimerSyn cancelled). Other configurations switch at once. */
#ifdef MIGRATE
#define GATEOPEN(r) false
#define SYNOPEN(r) (migPh == 0)
#else
#define GATEOPEN(r) true
#define SYNOPEN(r) true
#endif

/* the exchange of a message type (fin and finAck name theirs explicitly) */
#define XOF(t) ((t == requestLock || t == ackLock || t == nackLock) -> XREQ : \
	((t == syn || t == synAck) -> XSYN : ((t == cancelLock || t == ackCancel) -> XCAN : 0)))

/* coverage markers: with -DREACH (and pan compiled with -DPRINTF) each
 * prints "REACH n" when its branch is taken; otherwise a skip. The
 * branches are listed in docs/verification.md "What is covered". */
#ifdef REACH
#define REACHED(n) printf("REACH %d\n", n)
#else
#define REACHED(n) skip
#endif

/* a lost or rejected message in exchange X; one of the fin exchanges
 * (a fin, a probe, a tomb's fin, or a finAck answering one) also lets the
 * probe timers of both anchors fire (XWAITL, XWAITR): a fin's receiver
 * may be waiting for it, its sender may have sent it as a probe, a finAck
 * may answer a probe */
#define ARM(X) ((X) | (((X) & (XFINL | XFINR)) != 0 -> XWAITL | XWAITR : 0))

/*
 * Send a control message (UDP): the network may lose it (at most LOSS in a
 * run). A loss marks exchange X of request r: the sender's timer for it may
 * fire from then on. fl is the message's flag (syn: position in the address
 * list; cancelLock: 1 = FlagNewPath; fin: FlagDone; ackLock: FlagPartial;
 * synAck: 1 = the grant, FlagRefuse).
 */
inline ctlA(cnb, ct, cr, cx, cfl, ca, cst, cX) {
	if
	:: LOSS > 0 && len(net[cnb]) >= QS ->
		/* the receiver's queue is full for control messages (the search
		 * kept it from reading while others retransmitted; TCPQ more
		 * places stay for TCP segments, config.pml): the network drops
		 * the datagram, as a full socket buffer would. Counted apart from
		 * LOSS (ndrop, up to 2: only the give-up assertion reads it); like
		 * a loss it lets the sender's timer fire. Without loss nothing is
		 * retransmitted and the channels must never fill (asserted
		 * below). */
		printf("MSC: %d -> %d %e r%d DROPPED (queue full)\n", me, cnb, ct, cr);
		REACHED(49);
		ndrop = (ndrop < 2 -> ndrop + 1 : 2); lossy[cr] = lossy[cr] | ARM(cX); lostNow[cr] = lostNow[cr] | ARM(cX);
		RBDROP(cX)
	:: LOSS > 0 && len(net[cnb]) < QS && nlost < LOSS ->
		printf("MSC: %d -> %d %e r%d LOST\n", me, cnb, ct, cr);
		nlost++; lossy[cr] = lossy[cr] | ARM(cX); lostNow[cr] = lostNow[cr] | ARM(cX)
	:: LOSS == 0 || len(net[cnb]) < QS ->
		assert(len(net[cnb]) < QS);   /* without loss the channels never fill */
		net[cnb]!ct(me, cr, cx, cfl, ca, cst, 0)
	fi
}
/* ca: a second value, the leftDelta gathered by a requestLock (its field
 * a), the set of agents an ackLock lists, the host a refusing synAck
 * names; cst: a third, the ackLock's list in path order (field st) */
#define ctl(cnb, ct, cr, cx, cfl, cX) ctlA(cnb, ct, cr, cx, cfl, 0, 0, cX)
#define CTL(nb, t, r, x) ctl(nb, t, r, x, 0, XOF(t))

/* one lost message never makes a sender give up: it gives up only if at
 * least min(MAXTRIES, 2) control messages were lost (the one that started
 * its timer, and its last try or the answer to it; with a timer firing
 * early, two losses can use up more than two tries). With fewer, every
 * exchange is answered: no timeout, no setupFailed on a working path, no
 * Unconfirmed. */
#define GIVEUP printf("MSC: %d gives up r%d\n", me, r); gaveUp++; assert(nlost + ndrop >= (MAXTRIES < 2 -> MAXTRIES : 2))

/* a message the receiver rejects (Rejected, no answer) may leave its
 * sender without an answer: its timer may fire (retransmit). It does not
 * count as the loss of the last try: another copy may be on its way (a
 * rejected duplicate); if none is, the sender gives up at quiescence. */
inline dropped(r, X) {
	lossy[r] = lossy[r] | (X)
}

/* the left anchor's part in r ends (finishLeft); the history says how */
inline finishLeft(r, o, rs) {
	stageL[r] = done; outcome[r] = o; reason[r] = rs; synEarly[r] = 0;
	hist[HI(me, r)] = (o == Succeeded -> resDone : resNacked)
}

/* sendRequestLock: (re)transmission, same request, anchors add no delta */
inline sendRequestLock(r) {
	reqTries[r]++;
	CTL(rightN[me], requestLock, r, 0)
}

/* sendEarlySyn: on a direct new path (nh[r] == 0: a delete, a proxy
 * removal) the left anchor sends the new path's SYN beside requestLock,
 * straight to the right anchor, which keeps it (pendSyn) until it grants
 * the lock and then answers it at once (acceptSyn): the SYN and SYN-ACK
 * travel while the lock is taken. It is the SYN's first try (exchange
 * XSYN): if its SYN-ACK has not come when the lock is held, TimerSyn sends
 * it again (onAckLock: synTries 1, no send). Only a direct path: a
 * middlebox of a new path would join it before the lock is held. */
inline sendEarlySyn(r) {
	if
	:: nh[r] == 0 -> CTL(ra[r], syn, r, 0)
	:: else
	fi
}

/* acceptSyn: the right anchor, locked for r, takes the new path's SYN from
 * sfrom: AddSubsession armed, delta = left side's + rightDelta; SYN-ACK.
 * From the left anchor itself (a direct new path) the SYN-ACK also grants
 * the lock (synAckMsg: flag 1, x = the leftDelta requestLock gathered) */
inline sendSynAck(r, sfrom) {
	if
	:: sfrom == la[r] -> ctl(sfrom, synAck, r, grantL[r], 1, XSYN)
	:: else -> ctlA(sfrom, synAck, r, 0, 0, 0, genR[GX(me)], XSYN)
	fi
}
/* sgen: which subsession of sfrom the SYN came on (joinGen, below) */
inline acceptSyn(r, sfrom, sgen) {
	newN[me] = sfrom; genR[GX(me)] = sgen; dNew[me] = sdL[me] + rightDelta[r];
	stageR[r] = waitAck;
	sendSynAck(r, sfrom)
}

/* the left anchor starts (or restarts, from the queue) request r */
inline startReq(r) {
	if
	:: freed[me] || rightN[me] == NONE ->
		stageL[r] = done; outcome[r] = Refused; reason[r] = ReasonNoSession
	:: else -> if
		:: nh[r] == 0 && rightN[me] == ra[r] && lock[me] == unlocked ->
			/* onReconfigure: a delete with nothing to delete (the right
			 * anchor is our neighbour already): Succeeded, Unchanged, no
			 * message */
			REACHED(64); stageL[r] = done; outcome[r] = Succeeded; reason[r] = ReasonNone;
			unchanged[r] = 1; hist[HI(me, r)] = resDone
		:: !(nh[r] == 0 && rightN[me] == ra[r]) && lock[me] == unlocked ->
			/* startLeft */
			lock[me] = lockPending; requestor[me] = r; stageL[r] = locking; laReq[me] = r;
			sendRequestLock(r);
			sendEarlySyn(r)
		:: lock[me] == lockPending ->
			/* a request passing through holds it: wait in the queue */
			assert(qreq[me] == 0);
			qreq[me] = r; qdelta[me] = 0; qldelta[me] = 0; stageL[r] = locking; laReq[me] = r
		:: lock[me] == locked ->
			stageL[r] = done; outcome[r] = Refused; reason[r] = ReasonLocked
		fi
	fi
}

/* nack: refuse a request from the left and remember the answer */
inline nack(r, rfrom, rs) {
	hist[HI(me, r)] = resNacked; histR[HI(me, r)] = rs;
	/* a right anchor refusing r drops r's early SYN (onRequestLock takes it) */
	pendSyn[r] = (me == ra[r] -> 0 : pendSyn[r]);
	CTL(rfrom, nackLock, r, rs)
}

/* a requestLock that is not a duplicate (onRequestLock after its checks
 * for duplicates); dl: rightDelta so far, dll: the leftDelta gathered so
 * far (each middle adds what it will add to the ackLock, forwardRequest) */
inline newRequestLock(r, dl, dll, fromQueue, rfrom) {
	if
	:: freed[me] -> nack(r, rfrom, ReasonNoSession)
	:: !freed[me] && busyRA[me] != 0 ->
		/* right anchor of an unfinished reconfiguration of its left side */
		nack(r, rfrom, ReasonBusy)
	:: !freed[me] && busyRA[me] == 0 && me == ra[r] && RBLEFTMOVES(me) ->
		/* its left subsession is moving (rebind.go) */
		REACHED(110); nack(r, rfrom, ReasonBusy)
	:: !freed[me] && busyRA[me] == 0 && me == ra[r] && !RBLEFTMOVES(me) ->
		/* accept: right anchor in waitSyn, ackLock with leftDelta 0 (sendAckLock: on the left side) */
		busyRA[me] = r; stageR[r] = waitSyn; rightDelta[r] = dl; grantL[r] = dll;
		CTL(leftN[me], ackLock, r, 0);
		if
		:: pendSyn[r] -> REACHED(50); pendSyn[r] = 0; acceptSyn(r, la[r], 0)   /* its early SYN came first */
		:: else
		fi
	:: !freed[me] && busyRA[me] == 0 && me != ra[r] && rightN[me] == NONE ->
		nack(r, rfrom, ReasonNotOnPath)
	:: !freed[me] && busyRA[me] == 0 && me != ra[r] && rightN[me] != NONE ->
#ifdef BROKEN_SKIP_LOCK
		/* broken: the lock is taken over whatever its state */
		lock[me] = lockPending; requestor[me] = r; reqFrom[me] = rfrom;
		ctlA(rightN[me], requestLock, r, dl + sdL[me] + appR[me], 0, dll + sdR[me] + appL[me], 0, XREQ)
#else
		if
		:: lock[me] == unlocked ->
			lock[me] = lockPending; requestor[me] = r; reqFrom[me] = rfrom;
			ctlA(rightN[me], requestLock, r, dl + sdL[me] + appR[me], 0, dll + sdR[me] + appL[me], 0, XREQ)
		:: lock[me] == lockPending ->
			assert(qreq[me] == 0 && !fromQueue);
			qreq[me] = r; qdelta[me] = dl; qldelta[me] = dll; qfrom[me] = rfrom
		:: lock[me] == locked ->
			nack(r, rfrom, ReasonLocked)
		fi
#endif
	fi
}

/*
 * requestLock(r, rightDelta) from the left (rfrom: the agent it came from;
 * every answer goes back there, reqFrom remembers it for the ackLock).
 * First the duplicates (a retransmission by the left anchor), as
 * onRequestLock: resolved here → the same nackLock again, or nothing
 * (cancelled, done, expired); right anchor of r → ackLock again; lock held
 * by r → forward again (the right anchor answers again); r queued here →
 * nothing. (The replay check on request ids is subsumed here: one request
 * per left anchor, every earlier one is caught by the checks above.)
 */
inline onRequestLock(r, dl, dll, fromQueue, rfrom) {
#ifdef BROKEN_NO_DEDUP
	/* broken: every requestLock is handled as a new request */
	newRequestLock(r, dl, dll, fromQueue, rfrom)
#else
	if
	:: hist[HI(me, r)] == resNacked -> REACHED(1); CTL(rfrom, nackLock, r, histR[HI(me, r)])
	:: hist[HI(me, r)] != 0 && hist[HI(me, r)] != resNacked ->
		REACHED(hist[HI(me, r)]);   /* 2 cancelled, 3 done, 4 expired */
		dropped(r, XREQ)   /* Rejected: already resolved */
	:: hist[HI(me, r)] == 0 && busyRA[me] == r -> REACHED(5); CTL(leftN[me], ackLock, r, 0)
	:: hist[HI(me, r)] == 0 && busyRA[me] != r && lock[me] != unlocked && requestor[me] == r ->
		REACHED(6); ctlA(rightN[me], requestLock, r, dl + sdL[me] + appR[me], 0, dll + sdR[me] + appL[me], 0, XREQ)
	:: hist[HI(me, r)] == 0 && busyRA[me] != r && !(lock[me] != unlocked && requestor[me] == r) &&
	   qreq[me] == r && la[r] != me -> REACHED(7)
	:: else -> newRequestLock(r, dl, dll, fromQueue, rfrom)
	fi
#endif
}

/* refuse the queued request (the lock went to another): nackQueue */
inline nackQueue() {
	if
	:: qreq[me] != 0 && la[qreq[me]] == me ->
		stageL[qreq[me]] = done; outcome[qreq[me]] = Refused; reason[qreq[me]] = ReasonLocked;
		qreq[me] = 0
	:: qreq[me] != 0 && la[qreq[me]] != me ->
		nack(qreq[me], qfrom[me], ReasonLocked);
		qreq[me] = 0
	:: else
	fi
}

/* release the first queued request (now the rightmost: cannot block again) */
inline releaseQueue() {
	if
	:: qreq[me] != 0 && lock[me] == unlocked ->
		q = qreq[me]; qreq[me] = 0;
		if
		:: la[q] == me -> startReq(q)
		:: else -> onRequestLock(q, qdelta[me], qldelta[me], 1, qfrom[me])
		fi
	:: else
	fi
}

/* startCancel / sendCancel (§3.6): cancelLock on the old path until
 * ackCancel; anchor = the left anchor's own cancellation, else a stale lock */
inline sendCancel(r) {
	canTries[r]++;
	CTL(rightN[me], cancelLock, r, 0)
}
inline startCancel(r, anchor) {
	canJob[r] = 1; canAnchor[r] = anchor; canTries[r] = 0;
	lossy[r] = lossy[r] & NOTX(XCAN); lostNow[r] = lostNow[r] & NOTX(XCAN);
	sendCancel(r)
}
/* cancelDone: ackCancel, or no answer after MAXTRIES (leases free the rest) */
inline cancelDone(r) {
	canJob[r] = 0;
	if
	:: canAnchor[r] && stageL[r] == cancelling && canOut[r] == 0 ->
		lock[me] = unlocked; requestor[me] = 0;
		finishLeft(r, Failed, ReasonSetupFailed)
	:: canAnchor[r] && stageL[r] == cancelling && canOut[r] != 0 ->
		/* cancelJob.end: the new chain was the old segment, crossed it,
		 * or a host of the new path refused it (finishLeftWith) */
		lock[me] = unlocked; requestor[me] = 0;
		unchanged[r] = (canOut[r] == Succeeded);
		finishLeft(r, (canOut[r] == MIGABORT -> Failed : canOut[r]), CANREASON(r))
	:: else
	fi
}

/* dropNewPath: the left anchor abandons the new path being set up.
 * RemoveSubsession, a best-effort cancelLock on the new path (frees joined
 * middleboxes; not retransmitted), then cancelLock on the old path; o, hp:
 * what the request reports once the locks are released (cancelJob.end, its
 * reason CANREASON; o = 0: Failed setupFailed) and the hop it names */
inline dropNewPath(r, o, hp) {
	ctl(newN[me], cancelLock, r, 0, 1, 0);
	newN[me] = NONE; held[r] = 0; stageL[r] = cancelling;
	startCancel(r, 1);
	canOut[r] = o; refHop[r] = hp
}
/* abortSetup: the new path does not answer */
inline abortSetup(r) {
	dropNewPath(r, 0, 0)
}

/* listSelf: a middle agent forwarding an ackLock puts itself in front of
 * its list of the old segment's middle agents; a full list, or one naming
 * it already, stays as it is and is marked FlagPartial (in place, in m) */
inline listSelf() {
	if
	:: (m.s & FlagPartial) != 0 -> skip
	:: (m.s & FlagPartial) == 0 && (LISTLEN(m.a) >= MAXLIST || BIT(m.a, me)) ->
		REACHED(57); m.s = m.s | FlagPartial
	:: (m.s & FlagPartial) == 0 && LISTLEN(m.a) < MAXLIST && !BIT(m.a, me) ->
		m.st = (LISTLEN(m.a) == 0 -> me + 1 : (LISTLEN(m.a) == 1 -> (me + 1)*8 + m.st : 255));
		m.a = m.a | (1 << me)
	fi
}

/* sameOrCrossing: the left anchor's ackLock lists the whole old segment
 * (not partial) and its new chain, not empty, equals it (SAME) or names
 * one of its middleboxes (CROSS): nothing is set up; the segment is locked
 * now, the locks are released with cancelLock (§3.6), and the request
 * reports Succeeded Unchanged, or Refused onPath naming the hop */
#define LISTSAME(r) (LISTLEN(m.a) == nh[r] && m.st == CHAINCODE(r))
#define SAMEORCROSS(r) (nh[r] > 0 && (m.s & FlagPartial) == 0 && (LISTSAME(r) || (m.a & CHAINMASK(r)) != 0))
inline sameOrCrossing(r) {
	lock[me] = locked; leftDelta[r] = m.x;
	nackQueue();
	if
	:: LISTSAME(r) -> REACHED(58); canOut[r] = Succeeded
	:: !LISTSAME(r) -> REACHED(59); canOut[r] = Refused;
		refHop[r] = (BIT(m.a, hop[2*r]) -> hop[2*r] : hop[2*r+1])
	fi;
	stageL[r] = cancelling;
	startCancel(r, 1)
}

/* refuseSyn: a synAck with FlagRefuse (reason in x, this host in a) back
 * the way the SYN came (on the subsession sgen of sto); this host does not
 * join (stateless: a retransmitted SYN gets the same answer) */
inline refuseSyn(sto, r, rs, sgen) {
	ctlA(sto, synAck, r, rs, FlagRefuse, me, sgen, XSYN)
}

/* onJoinFailed (JoinFailed, handled in the step of the join, as the agent
 * does: deferred after the step's actions): the datapath could not install
 * the joined session. The SYN went on already: a refusing synAck
 * (setupFailed) to the left; the session stays (jfail), with no datapath,
 * to refuse the SYN again if it comes again, and passes the left anchor's
 * cancelLock on the new path on to the hosts after it and the right
 * anchor. (Its lease, which sends that cancelLock on should it never come,
 * is not modelled: with loss the final check allows joined hosts left
 * behind, as for any lost cancelLock of a new path.) */
inline onJoinFailed(r) {
	REACHED(65); joinFails++;
	refuseSyn(leftN[me], r, ReasonSetupFailed, genL[GX(me)]);
	jfail[GX(me)] = r
}

/* onNewSyn: a new path's SYN at a host that has not joined it. OnPath (the
 * session is live here, ONPATH): refuse. Otherwise JoinSession: the
 * datapath holds one state per session tuple, so joining while the session
 * is live here would break it (asserted: what the old protocol did). A
 * middle agent of an old path past which both anchors' fins have gone
 * joins: the new path takes its datapath state, and the old path's session
 * is set aside (oReq ...) to pass that path's fins and finAcks. */
inline onNewSyn(r) {
	if
	:: ONPATH(me) ->
		/* only a host that carries the session on a live path refuses:
		 * not a freed one, not a middle past which both fins have gone */
		assert(HOLDS(me) && (finPassed[me] & 12) != 12);
		REACHED(60); refuseSyn(m.from, r, ReasonOnPath, m.st)
	:: !ONPATH(me) ->
		assert(!LIVE(me));   /* the datapath: one state per session tuple */
		if
		:: HOLDS(me) || freed[me] ->
			REACHED(66);
			assert(tdReq[OX(me)] != 0 && oReq[OX(me)] == 0 && qreq[me] == 0 && busyRA[me] == 0 && !tp[me]);
			oReq[OX(me)] = tdReq[OX(me)]; oL[OX(me)] = leftN[me]; oR[OX(me)] = rightN[me];
			oFP[OX(me)] = (freed[me] -> 3 : finPassed[me] & 3);
			oLock[OX(me)] = (!freed[me] && lock[me] != unlocked);
			lock[me] = unlocked; requestor[me] = 0; finPassed[me] = 0; freed[me] = 0; tdReq[OX(me)] = 0
		:: else
		fi;
		/* JoinSession: a new hop, no deltas, not an original middlebox */
		orig[me] = 0; sdL[me] = 0; sdR[me] = 0; joinedAny = 1;
		leftN[me] = m.from; joinReq[me] = r; genL[GX(me)] = m.st;
		NEWGEN(me);
		rightN[me] = (m.s + 1 < nh[r] -> hop[2*r + m.s + 1] : ra[r]);
		ctlA(rightN[me], syn, r, 0, m.s + 1, 0, joinGen[GX(me)], XSYN);
		if
		:: joinFails < JOINFAIL -> onJoinFailed(r)
		:: true
		fi
	fi
}

/* the right anchor abandons a request that never switched (releaseRight) */
inline releaseRight(r, kind) {
	busyRA[me] = 0; newN[me] = NONE; genR[GX(me)] = 0; stageR[r] = done; hist[HI(me, r)] = kind
}

#define FINX(me, r) (la[r] == me -> XFINL : XFINR)     /* exchange of the fin an anchor sends */
#define FINACKX(me, r) (la[r] == me -> XFINR : XFINL)  /* exchange of the finAck an anchor sends */
#define WAITX(me, r) (la[r] == me -> XWAITL : XWAITR)   /* an anchor's probes */
/* waitFin: our fin is answered, the other's has not come: TimerFin stays
 * armed and sends our fin again as a probe (internal/protocol waitFin, onTimer) */
#define WAITFIN(i) (tp[i] && finAcked[i] && !haveCut[i])

/* sendFin: the fin carries the cut-off; retransmitted on TimerFin. On a
 * direct new path (no middlebox: nh[r] == 0, newN is the other anchor) a
 * copy goes on it too (internal/protocol sendFin, anchor.direct) */
inline sendFin(r) {
	finTries[me]++;
	ctl(oldN[me], fin, r, oldSent[me], 0, FINX(me, r));
	if
	:: nh[r] == 0 -> ctl(newN[me], fin, r, oldSent[me], 0, FINX(me, r))
	:: else
	fi
}

/* sendFinAck: answer the other's fin the ways it came (internal/protocol sendFinAck) */
inline sendFinAck(r, via) {
	if
	:: (via & 1) != 0 -> ctl(oldN[me], finAck, r, 0, 0, FINACKX(me, r))
	:: else
	fi;
	if
	:: (via & 2) != 0 -> ctl(newN[me], finAck, r, 0, 0, FINACKX(me, r))
	:: else
	fi
}

/* complete: EndTwoPath, the new subsession becomes the side's; the old
 * one is a tomb that answers retransmitted fins (onTomb) with the cut-off
 * its own fin carried */
inline complete(r) {
	tp[me] = 0;
	lingerN[me] = oldN[me]; lingerR[me] = r; lingerC[me] = oldSent[me]; lingerAcked[me] = finOldAcked[me];
	tombN[HI(me, r)] = oldN[me];
	if
	:: tpSide[me] == RIGHT -> lingerD[me] = sdR[me]; rightN[me] = newN[me]; sdR[me] = dNew[me]; RBNEWSUB(sgR)
	:: else -> lingerD[me] = sdL[me]; leftN[me] = newN[me]; sdL[me] = dNew[me]; RBNEWSUB(sgL)
	fi;
	newN[me] = NONE; genR[GX(me)] = 0;
	if
	:: la[r] == me ->
		lock[me] = unlocked; requestor[me] = 0; held[r] = 0;
		finishLeft(r, Succeeded, ReasonNone)
	:: else ->
		stageR[r] = done; busyRA[me] = 0; hist[HI(me, r)] = resDone
	fi
}

/* a fin on the torn-down old path (onTomb): finAck, and, if we completed
 * Unconfirmed and the fin is not itself a tomb's (FlagDone), our own fin
 * again with FlagDone: the other anchor may still wait for it (every copy
 * lost). A confirmed completion means the other anchor has our fin. */
inline onTomb(r) {
	ctl(m.from, finAck, r, 0, 0, FINACKX(me, r));
#ifndef BROKEN_NO_PROBE
	if
	:: (m.s & FlagDone) == 0 && (unconf[r] & (la[r] == me -> 1 : 2)) != 0 ->
		REACHED(24); ctl(m.from, fin, r, lingerC[me], FlagDone, FINX(me, r))
	:: else -> REACHED(25)
	fi
#endif
}

/* one of the two anchors is done with two paths: completion checks (evaluate) */
#ifdef UDP
/* UDP (udp.pml, internal/protocol/udp.go): the fin once this side has
 * ended (uq), the other's fin answered at once, completion when both */
inline evaluate() {
	if
	:: tp[me] ->
		r = tpReq[me];
		if
		:: !finSent[me] && uq[me] -> finSent[me] = 1; finTries[me] = 0; sendFin(r)
		:: else
		fi;
		if
		:: haveCut[me] && !answered[me] -> answered[me] = 1; sendFinAck(r, finVia[me])
		:: else
		fi;
		if
		:: finAcked[me] && answered[me] -> complete(r)
		:: else
		fi
	:: else
	fi
}
#else
inline evaluate() {
	if
	:: tp[me] ->
		r = tpReq[me];
		/* 1. everything sent on the old path acknowledged: fin(cutoff) */
		if
		:: !finSent[me] && oldSentAcked[me] == oldSent[me] ->
			finSent[me] = 1; finTries[me] = 0; sendFin(r)
		:: else
		fi;
		/* 2. answer the other's fin once all its old data is in and acked */
		if
		:: haveCut[me] && !answered[me] && oldRcvdAcked[me] == oldRcvd[me] &&
		   ((newRcvd[me] && firstNewRcvd[me] <= oldRcvd[me]) || oldRcvd[me] >= cutoff[me] + dNew[me]) ->
			answered[me] = 1; sendFinAck(r, finVia[me])
		:: else
		fi;
		/* 3. complete */
		if
		:: finAcked[me] && answered[me] -> complete(r)
		:: else
		fi
	:: else
	fi
}
#endif

/* a middle agent of the old path: fin-acks passed both ways, it frees the
 * session (after Linger in Go; retransmitted fins are still passed here) */
inline middleFinAck() {
	finPassed[me] = finPassed[me] | (m.from == leftN[me] -> 1 : 2);
	if
	:: (finPassed[me] & 3) == 3 -> freed[me] = 1; lock[me] = unlocked; requestor[me] = 0; hist[HI(me, r)] = resDone
	:: else
	fi
}

/* TimerLease (onLease): a right anchor before the switch, or a middle's lock;
 * a middle of the old path that passed both anchors' fins (bits 2 and 3 of
 * finPassed) but not both finAcks frees the session: nothing more crosses
 * the old path (internal/protocol onLease) */
#define LEASE(i) ((busyRA[i] != 0 && (stageR[busyRA[i]] == waitSyn || stageR[busyRA[i]] == waitAck)) || \
	(lock[i] != unlocked && requestor[i] != 0 && requestor[i] <= NR && la[requestor[i]] != i && !freed[i]) || oLock[OX(i)])
inline onLease() {
	if
	:: oLock[OX(me)] ->
		/* the old path's session set aside at a rejoined middle: both
		 * fins passed it, so it is freed (as branch 56) */
		REACHED(68); oLock[OX(me)] = 0; hist[HI(me, oReq[OX(me)])] = resDone
	:: !oLock[OX(me)] && busyRA[me] != 0 && (stageR[busyRA[me]] == waitSyn || stageR[busyRA[me]] == waitAck) ->
		r = busyRA[me]; releaseRight(r, resExpired)
	:: !oLock[OX(me)] && !(busyRA[me] != 0 && (stageR[busyRA[me]] == waitSyn || stageR[busyRA[me]] == waitAck)) ->
		r = requestor[me];
		if
		:: (finPassed[me] & 12) == 12 -> REACHED(56); freed[me] = 1; hist[HI(me, r)] = resDone
		:: else -> hist[HI(me, r)] = resExpired
		fi;
		lock[me] = unlocked; requestor[me] = 0
	fi
}

/* granted: the left anchor holds r, granted by the ackLock (viaSynAck 0)
 * or by the right anchor's synAck (viaSynAck 1: internal/protocol granted,
 * synAckMsg); ld is leftDelta. Every agent of the old path is locked by r,
 * or, granted by the synAck, its lock may still be pending for r (the
 * ackLock, which locks it, is on its way) */
inline granted(r, ld, viaSynAck) {
	lock[me] = locked; stageL[r] = settingUp; leftDelta[r] = ld;
	/* the contending requests are never both holding the segment */
	held[r] = 1;
	/* while a left anchor holds its segment, every agent of the old path
	 * up to the right anchor is locked by that request (§3.2) */
	q = rightN[me];
	do
	:: q != ra[r] ->
		assert(q != NONE && !freed[q] && requestor[q] == r &&
		       (lock[q] == locked || (viaSynAck && lock[q] == lockPending)));
		q = rightN[q]
	:: else -> break
	od;
	/* (waitAck: it answered our early SYN) */
	assert(busyRA[q] == r && (stageR[r] == waitSyn || stageR[r] == waitAck));
	assert(!(held[1] && held[NR]) || NR == 1 || DISJOINT);
	nackQueue();
	/* beginSetup: the UDP SYN, then AddSubsession to the first new hop (one
	 * atomic step here, as in the agent: their order is not observable) */
	newN[me] = (nh[r] > 0 -> hop[2*r] : ra[r]);
	dNew[me] = sdR[me] + leftDelta[r];
	if
	:: synEarly[r] ->
		/* the early SYN's SYN-ACK came while locking: the new path
		 * is up, switch (as on a SYN-ACK in settingUp below) */
		REACHED(52); synEarly[r] = 0;
		CTL(newN[me], ack, r, 0);
		startTwoPath(me, RIGHT, r);
		stageL[r] = twoPath
	:: else ->
		synTries[r] = 1;
		if
		:: nh[r] == 0 -> skip   /* the early SYN was the first try: TimerSyn */
		:: else -> CTL(newN[me], syn, r, 0)
		fi
	fi
}

/* a middle agent whose lock is still pending for r when a fin or finAck of
 * r passes it takes it then (internal/protocol passOldPath): the anchors send them
 * only once r was granted, and with the granting synAck the ackLock may
 * still be on its way, or lost (the left anchor no longer asks) */
inline lockByTeardown(r) {
	if
	:: lock[me] == lockPending && requestor[me] == r -> REACHED(55); lock[me] = locked; nackQueue()
	:: else
	fi
}

#ifdef TRIGGER
#define TRIGDUE (trigPend && trigTries >= MAXTRIES)
/* the sender's TimerTrigger is armed */
#define TTRIG(me) (me == TRIGGERER && trigPend)

/* transmitTrigger: (re)send the trigger to the left neighbour it went to */
inline transmitTrigger() {
	trigTries++;
	ctl(trigTo, trigger, TRIGR, 0, 0, XTRIG)
}
/* sendTrigger: the middlebox asks its left neighbour to reconfigure as
 * left anchor (the right anchor and chain of request TRIGR) */
inline sendTrigger() {
	trigPend = 1; trigTo = leftN[me];
	transmitTrigger()
}
/* onTriggerTimer: retransmit (the give-up is in the agent loop) */
inline onTriggerTimer() {
	transmitTrigger()
}
/* onTriggerResult at the sender: an answer that the request runs (x 0)
 * keeps the trigger; the final one ends it; one to no pending trigger (a
 * duplicate, or after it gave up) is refused */
inline onTriggerResult(r) {
	if
	:: !trigPend -> REACHED(82)   /* Rejected: answered already, or given up */
	:: trigPend && m.x == 0 -> REACHED(83)   /* the left neighbour is at it */
	:: trigPend && m.x != 0 ->
		assert(m.from == trigTo);
		/* the answer is the result of the request it started */
		assert(m.x == outcome[r] && m.s == reason[r] && stageL[r] == done);
		trigPend = 0; trigFinal++; trigGot = m.x; trigGotRs = m.s
	fi
}
/* answerTrigger: the final answer (the request's result), kept for the
 * retransmissions; refuseTrigger: one that starts no request */
inline answerTrigger(r) {
	trigAns = outcome[r]; trigRs = reason[r];
	ctl(trigPeer, triggerResult, r, trigAns, trigRs, XTRIG)
}
inline refuseTrigger(r, rs) {
	trigAns = Refused; trigRs = rs;
	ctl(trigPeer, triggerResult, r, trigAns, trigRs, XTRIG)
}
/* onTrigger at the left neighbour: the copies first (the same answer, or
 * "running"; a replay, a number heard of but not in the history, cannot
 * happen here: the history is never forgotten), then the refusals (the
 * side is being reconfigured by this agent: busy; the sender is no longer
 * its next hop), then the request, started as a local one (startReq) */
inline onTrigger(r) {
	if
#ifndef BROKEN_TRIGGER_DUP
	:: trigTaken -> REACHED(80); ctl(m.from, triggerResult, r, trigAns, trigRs, XTRIG)
	:: !trigTaken ->
#else
	:: true ->   /* broken: every copy is taken as a new trigger */
#endif
		trigTaken = 1; trigPeer = m.from;
		if
		:: m.from != rightN[me] -> REACHED(86); refuseTrigger(r, ReasonNotNextHop)
		:: m.from == rightN[me] && laReq[me] != 0 && stageL[laReq[me]] != done ->
			REACHED(87); refuseTrigger(r, ReasonBusy)
		:: m.from == rightN[me] && !(laReq[me] != 0 && stageL[laReq[me]] != done) ->
			REACHED(81); trigStarted++;
			/* exactly one request per trigger */
			assert(trigStarted == 1);
			startReq(r)
		fi
	fi
}
#else
#define TRIGDUE false
#endif

#ifdef MIGRATE
/* MigOps (message_ext.go), in a migrate's x; a migrateAnswer's s: */
#define MigFreeze 1
#define MigExport 2
#define MigImport 3
#define MigOK     1
#define MigFailed 2
#define MigRunning 3
/* migPhase (migrate.go) */
#define migFreezing  2
#define migDraining  3
#define migExporting 4
#define migImporting 5
#define migDone      6
#define RELEASESTATE(me) hasState[me] = 0
/* a step is in flight (TimerMigrateMsg armed) */
#define TMIG(me) (me == la[1] && (migPh == migFreezing || migPh == migExporting || migPh == migImporting))
/* the right anchor's hold lease is due (below), or a step's give-up */
#define HOLDLEASE(me) (holdL[me] && me == ra[1] && busyRA[me] == 1 && stageR[1] != twoPath)
#define MIGDUE ((TMIG(la[1]) && migTries >= MAXTRIES) || HOLDLEASE(ra[1]))
/* WaitDrained (order): the left anchor after the freeze's answer, the
 * right anchor while it holds */
#define MIGDRAINING(me) ((me == la[1] && migPh == migDraining) || (me == ra[1] && rmig == 1))
/* Drained: no segment is about to cross the old middlebox, nor on its way
 * from it to this anchor (both anchors hold: nothing new enters the old
 * path; the datapath compares the marks, the model looks at the channels) */
#define DRAINED(me) (!(net[MOLD]??[tcp, _, _, _, _, _, _, _]) && !(net[me]??[tcp, MOLD, _, _, _, _, _, _]))

/* the step's message (again) */
inline migTransmit() {
	migTries++;
	ctl(migTo, migrate, 1, migOp, 0, XMIG)
}
inline migCallStart(to, op) {
	migTo = to; migOp = op; migTries = 0; lostNow[1] = lostNow[1] & NOTX(XMIG);
	migTransmit()
}
/* migExport: ask the old middlebox, on the old path */
inline migExport(r) {
	migPh = migExporting; migCallStart(rightN[me], MigExport)
}
/* the left anchor lets its held packets go (ReleaseHold) */
inline migReleaseLeft() {
	releaseHold()
}
inline migReleaseRight() {
	releaseHold()
}
inline releaseHold() {
	holdL[me] = 0;
	if
	:: ackOwed[me] ->
		ackOwed[me] = 0; hh = HOST(me);
		hside = (hh == 0 -> RIGHT : LEFT);
		hat = hRcvNxt[hh] - TDIN(hh);
		egress(hside, hSndNxt[hh], hRcvNxt[hh], 0, 0, hat)
	:: else
	fi
}
/* onProceed after MigrationDone (migFinish): switch and ACK (its hold goes
 * on the new path), or abandon the new path (§3.6: the session stays on
 * the old path, what it held goes there) */
inline migFinish(r) {
	migPh = migDone;
	CTL(newN[me], ack, r, 0);
	startTwoPath(me, RIGHT, r);
	stageL[r] = twoPath;
	migReleaseLeft()
}
inline migFail(r) {
	migPh = migDone; migAborted = 1;
	dropNewPath(r, MIGABORT, 0);
	migReleaseLeft()
}
/* newPathUp: the new path answered a gated request: startMigration (its
 * first SYN-ACK; the copies after it are ignored) */
inline newPathUp(r) {
	if
	:: migPh == 0 -> startMigration(r)
	:: else -> REACHED(90)
	fi
}
inline startMigration(r) {
#ifdef MIG_ORDER
	/* Hold (Held at once), then the freeze, straight to the right anchor */
	holdL[me] = 1; migPh = migFreezing; migCallStart(ra[r], MigFreeze)
#else
	/* loss-free: make before break, nothing held */
	migExport(r)
#endif
}
/* onMigAnswer at the left anchor: the answer to the step in flight */
inline onMigAnswer(r) {
	if
	:: !(TMIG(me) && m.x == migOp && m.from == migTo) -> REACHED(91)   /* Rejected: no such step pending */
	:: TMIG(me) && m.x == migOp && m.from == migTo && m.s == MigRunning -> REACHED(92)
	:: TMIG(me) && m.x == migOp && m.from == migTo && m.s == MigFailed -> REACHED(93); migFail(r)
	:: TMIG(me) && m.x == migOp && m.from == migTo && m.s == MigOK ->
		if
		:: m.x == MigFreeze -> migPh = migDraining   /* WaitDrained */
		:: m.x == MigExport ->
			migPh = migImporting; migCallStart(newN[me], MigImport)
#ifdef BROKEN_MIG_EARLY_SWITCH
			/* broken: the import is not confirmed */
			; migFinish(r)
#endif
		:: m.x == MigImport -> migFinish(r)
		fi
	fi
}
/* onDrained: the left anchor exports; the right anchor answers the freeze */
inline onDrained(r) {
	if
	:: me == la[r] -> migExport(r)
	:: else -> rmig = 2; rmigAns = MigOK; ctl(la[r], migrateAnswer, r, MigFreeze, rmigAns, XMIG)
	fi
}
/* onFreeze at the right anchor: hold, wait for the drain, answer; a copy
 * gets the same answer, or "running" */
inline onFreeze(r) {
	if
	:: busyRA[me] != r -> REACHED(94); dropped(r, XMIG)   /* Rejected: not (any more) its right anchor */
	:: busyRA[me] == r && rmig == 2 -> ctl(m.from, migrateAnswer, r, MigFreeze, rmigAns, XMIG)
	:: busyRA[me] == r && rmig == 1 -> ctl(m.from, migrateAnswer, r, MigFreeze, MigRunning, XMIG)
	:: busyRA[me] == r && rmig == 0 && stageR[r] != waitAck ->
		rmig = 2; rmigAns = MigFailed; ctl(m.from, migrateAnswer, r, MigFreeze, rmigAns, XMIG)
	:: busyRA[me] == r && rmig == 0 && stageR[r] == waitAck -> rmig = 1; holdL[me] = 1
	fi
}
/* onMigServe: the export at the old middlebox (on its left subsession,
 * locked for r, the right anchor next), the import at the new one (joined
 * r's new path, nothing imported yet). The plug-ins' work (ExportState,
 * StateExported; ImportState, StateImported) is one step here; one of
 * the two may fail (migFails). A copy gets the same answer. */
inline onMigServe(r) {
	assert(m.from == la[r]);
	if
	:: m.x == MigExport && expAns != 0 -> ctl(m.from, migrateAnswer, r, MigExport, expAns, XMIG)
	:: m.x == MigExport && expAns == 0 ->
		if
		:: !(leftN[me] == m.from && lock[me] == locked && requestor[me] == r && rightN[me] == ra[r]) ->
			REACHED(96); expAns = MigFailed
		:: leftN[me] == m.from && lock[me] == locked && requestor[me] == r && rightN[me] == ra[r] ->
			assert(hasState[me]);
#ifdef MIG_ORDER
			/* order: nothing is about to cross this middlebox */
			assert(!(net[me]??[tcp, _, _, _, _, _, _, _]));
#endif
			if
			:: expAns = MigOK; exported = 1
			:: migFails == 0 -> REACHED(97); migFails++; expAns = MigFailed
			fi
		fi;
		ctl(m.from, migrateAnswer, r, MigExport, expAns, XMIG)
	:: m.x == MigImport && impAns != 0 -> ctl(m.from, migrateAnswer, r, MigImport, impAns, XMIG)
	:: m.x == MigImport && impAns == 0 ->
		if
		:: !(joinReq[me] == r && leftN[me] == m.from && jfail[GX(me)] != r) -> REACHED(98); impAns = MigFailed
		:: joinReq[me] == r && leftN[me] == m.from && jfail[GX(me)] != r ->
			if
			:: impAns = MigOK; hasState[me] = 1; nImport++;
				/* the state is imported at most once */
				assert(nImport == 1)
			:: migFails == 0 -> REACHED(99); migFails++; impAns = MigFailed
			fi
		fi;
		ctl(m.from, migrateAnswer, r, MigImport, impAns, XMIG)
	fi
}
#else
#define RELEASESTATE(me) skip
#define MIGDUE false
#define newPathUp(r) skip   /* never reached: GATEOPEN */
#endif

#ifdef REBIND
/* the rebind's end at the mover (RebindResult) */
#define RBRESULT(o, rs) rbOut = o; rbRs = rs; rbEnds++
#define SETSG(i, sd, g) if :: sd == LEFT -> sgL[i] = g :: else -> sgR[i] = g fi
#define MIN2 (MAXTRIES < 2 -> MAXTRIES : 2)

/* sendRebind: the rebind (again), from the new address, to the
 * neighbour: x its Req, a the subsession it names (the old one's
 * generation), st the new address (the new subsession's generation) */
inline sendRebind() {
	rbTries++;
	ctlA(rbPeer, rebind, RBR, rbReq, 0, rbOld, RBADDR, XREB)
}

/* onRebind at the mover: refused while a reconfiguration holds its side
 * (right side: a left anchor, busy; its lock taken, locked; left side: a
 * right anchor, busy); else it takes the lock of a right side, listens on
 * the new subsession (MoveListen, RBIN: a subsession it gave up earlier
 * is taken again) and sends the rebind. (The agent asks only while the
 * side is not on the new address: Go's "already there" is not reached.) */
inline onRebind() {
	rbReq++; rbRej = 0; rbLost0 = nlost + ndrop; rbDrop = 0;
	/* a new exchange (its own TimerRebind) */
	lossy[RBR] = lossy[RBR] & NOTX(XREB); lostNow[RBR] = lostNow[RBR] & NOTX(XREB);
	if
	:: RBSIDE == RIGHT && LEFTANCHOR(me) -> REACHED(100); RBRESULT(Refused, ReasonBusy)
	:: RBSIDE == RIGHT && !LEFTANCHOR(me) && lock[me] != unlocked -> REACHED(101); RBRESULT(Refused, ReasonLocked)
	:: RBSIDE == LEFT && busyRA[me] != 0 -> REACHED(102); RBRESULT(Refused, ReasonBusy)
	:: else ->
		rbOn = 1; rbPeer = SIDEN(me, RBSIDE); rbOld = SG(me, RBSIDE); rbTries = 0;
		if
		:: RBSIDE == RIGHT -> lock[me] = locked; requestor[me] = RBQ
		:: else
		fi;
		sendRebind()
	fi
}

/* switchSide: the mover's side goes to the new subsession (MoveSwitch);
 * the old one is kept, marked moved, until Linger */
inline switchSide(sold, snew, speer) {
	mOld = sold; mOldPeer = speer;
	SETSG(me, RBSIDE, snew);
	mGU = NONE; mGUmask = 0
}

/* endRebind: the mover switches (Succeeded), keeps the new subsession
 * marked moved for Linger (Failed timeout: MoveGiveUp; a late answer, or
 * the neighbour answering the next attempt at once, may still move it),
 * or abandons it (Refused: MoveAbandon); it releases the lock, reports */
inline endRebind(o, rs) {
	rbOn = 0;
	if
	:: o == Succeeded -> switchSide(rbOld, RBADDR, rbPeer)
	:: o == Failed ->
		if
		:: mGU != RBADDR || mGUpeer != rbPeer -> mGUmask = 0
		:: else
		fi;
		mGU = RBADDR; mGUpeer = rbPeer; mGUold = rbOld; mGUmask = mGUmask | (1 << rbReq)
	:: o == Refused ->
		if
		:: mGU == RBADDR && mGUpeer == rbPeer -> mGU = NONE; mGUmask = 0   /* the same subsession, deleted */
		:: else
		fi
	fi;
	if
	:: RBSIDE == RIGHT && requestor[me] == RBQ -> lock[me] = unlocked; requestor[me] = 0
	:: else
	fi;
	printf("MSC: %d rebind r%d ends: %d (reason %d); side on generation %d\n", me, rbReq, o, rs, SG(me, RBSIDE));
	RBRESULT(o, rs)
}

/* onRebindTimer: retransmit, or give up after MAXTRIES (Failed timeout;
 * Go: or half of Linger). The attempt's losses (min(MAXTRIES, 2), as for
 * any sender, or a copy or answer dropped at a full queue: rbGULoss), a
 * copy the neighbour rejected, or (RB_SLOW) a slow answer make it give
 * up. */
inline onRebindTimer() {
	if
	:: rbTries >= MAXTRIES ->
		printf("MSC: %d gives up the rebind r%d\n", me, rbReq);
		REACHED(103);
		rbGULoss = (nlost + ndrop - rbLost0 >= MIN2 || rbDrop);
		assert(rbGULoss || rbRej > 0 || RBFIRE);
		endRebind(Failed, ReasonTimeout)
	:: else ->
		printf("MSC: %d TimerRebind: retransmit r%d\n", me, rbReq);
		sendRebind()
	fi
}

/* onRebindAck at the mover, by the subsession it came on: the new one
 * it listens on (the answer to the attempt that runs: a copy of an
 * earlier attempt's answer is rejected); its current one (an acceptance
 * when no rebind runs answers a copy, ignored); the new one of an attempt
 * it gave up (onLateRebindAck); anything else: rejected */
inline onRebindAck() {
	if
	:: rbOn && m.from == rbPeer && m.a == RBADDR ->
		if
		:: m.x != rbReq -> REACHED(107)   /* Rejected: another attempt's */
		:: m.x == rbReq && m.s != ReasonNone -> REACHED(104); endRebind(Refused, m.s)
		:: m.x == rbReq && m.s == ReasonNone -> endRebind(Succeeded, ReasonNone)
		fi
	:: !(rbOn && m.from == rbPeer && m.a == RBADDR) && m.from == SIDEN(me, RBSIDE) && m.a == SG(me, RBSIDE) ->
		if
		:: !rbOn && m.s == ReasonNone -> REACHED(105)
		:: else -> REACHED(107)
		fi
	:: !(rbOn && m.from == rbPeer && m.a == RBADDR) && !(m.from == SIDEN(me, RBSIDE) && m.a == SG(me, RBSIDE)) &&
	   mGU != NONE && m.from == mGUpeer && m.a == mGU ->
		onLateRebindAck()
	:: else -> REACHED(106); printf("MSC: %d rejects the rebindAck: unknown subsession\n", me)
	fi
}

/* onLateRebindAck: an answer on the new subsession of an attempt the
 * mover gave up: an acceptance of one of those attempts, while no rebind
 * runs and the side is still on that attempt's old subsession (the same
 * peer and generation: not one a reconfiguration set up since), moves
 * the side too */
inline onLateRebindAck() {
	if
	:: (mGUmask & (1 << m.x)) != 0 && m.s == ReasonNone && !rbOn && SIDEN(me, RBSIDE) == mGUpeer && SG(me, RBSIDE) == mGUold ->
		REACHED(114); printf("MSC: %d late rebindAck r%d: switches\n", me, m.x);
		switchSide(mGUold, mGU, mGUpeer)
	:: else -> REACHED(115)   /* Rejected */
	fi
}

/* sendRebindAck: the neighbour's answer, on the new subsession g, to the
 * mover's new address */
inline sendRebindAck(g, rs) {
	ctlA(m.from, rebindAck, RBR, m.x, rs, g, 0, XREB)
}

/* onRebindIn at the neighbour, in the order of the Go checks, by the
 * subsession the rebind names:
 * - the old subsession of a rebind it accepted: from the current peer, a
 *   copy of that rebind, or a newer one (than the last accepted and the
 *   last refused) that asks for where the side is already (the mover gave
 *   up, every answer lost), is answered, and becomes the last accepted;
 *   anything else is a replay;
 * - the side's subsession: a copy of the last refused rebind gets the
 *   same refusal; one not newer than the last accepted or refused is a
 *   replay; one a reconfiguration holds here is refused (busy) and
 *   remembered; else the side moves at once (MoveAll: egress to the new
 *   subsession, the old ingress flow kept until Linger) and it is
 *   answered;
 * - the new subsession of a reconfiguration it has not completed (m.Sub
 *   != sd.Sub, the reconfiguration holding the side): refused (busy), not
 *   remembered;
 * - anything else (unknown, a tomb, a session it left): rejected without
 *   an answer */
#define NEWER(i) (m.x > rbBound[i] && m.x > rfReq[i])
inline onRebindIn() {
	if
	:: !freed[me] && mvSub[me] != NONE && m.from == mvPeer[me] && m.a == mvSub[me] ->
		side = mvSide[me];
		if
#ifdef BROKEN_REBIND_NO_RECOVER
		:: m.from == SIDEN(me, side) && m.x == rbBound[me] ->   /* broken: a copy only */
#else
		:: m.from == SIDEN(me, side) && (m.x == rbBound[me] || (NEWER(me) && m.st == SG(me, side))) ->
#endif
			REACHED(108); rbBound[me] = m.x;
			d = SG(me, side); sendRebindAck(d, ReasonNone); d = 0
#ifdef BROKEN_REBIND_NO_RECOVER
		:: !(m.from == SIDEN(me, side) && m.x == rbBound[me]) ->
#else
		:: !(m.from == SIDEN(me, side) && (m.x == rbBound[me] || (NEWER(me) && m.st == SG(me, side)))) ->
#endif
			REACHED(109); printf("MSC: %d rejects the rebind: replay\n", me); rbRej++; dropped(RBR, XREB)
		fi
	:: !freed[me] && !(mvSub[me] != NONE && m.from == mvPeer[me] && m.a == mvSub[me]) &&
	   ((m.from == leftN[me] && m.a == sgL[me]) || (m.from == rightN[me] && m.a == sgR[me])) ->
		side = (m.from == leftN[me] -> LEFT : RIGHT);
		if
#ifndef BROKEN_REBIND_FORGET
		:: m.x == rfReq[me] -> REACHED(116); printf("MSC: %d refuses a copy again\n", me); sendRebindAck(m.st, rfRs[me])
#endif
		:: m.x != rfReq[me] && !NEWER(me) -> REACHED(117); rbRej++; dropped(RBR, XREB)   /* Rejected: replay */
		:: m.x != rfReq[me] && NEWER(me) && RBHELD(me, side) ->
			REACHED(111); printf("MSC: %d refuses the rebind: busy\n", me);
#ifndef BROKEN_REBIND_FORGET
			rfReq[me] = m.x; rfRs[me] = ReasonBusy;
#endif
			sendRebindAck(m.st, ReasonBusy)
		:: m.x != rfReq[me] && NEWER(me) && !RBHELD(me, side) ->
			printf("MSC: %d moves its side %d to generation %d (MoveAll)\n", me, side, m.st);
			mvSub[me] = SG(me, side); mvSide[me] = side; mvPeer[me] = m.from;
			SETSG(me, side, m.st);
			rbBound[me] = m.x;
			sendRebindAck(m.st, ReasonNone)
		fi
	:: !freed[me] && !(mvSub[me] != NONE && m.from == mvPeer[me] && m.a == mvSub[me]) &&
	   !((m.from == leftN[me] && m.a == sgL[me]) || (m.from == rightN[me] && m.a == sgR[me])) &&
	   m.from == newN[me] ->
		REACHED(112); printf("MSC: %d refuses the rebind of a path it is replacing: busy\n", me);
		sendRebindAck(m.st, ReasonBusy)
	:: else ->
		REACHED(113);
		printf("MSC: %d rejects the rebind (no answer)\n", me);
		rbRej++; dropped(RBR, XREB)
	fi
}

/* onRebound: Linger has run out: the subsessions kept after a rebind go
 * (RemoveSubsession), at the neighbour and at the mover */
inline onRebound() {
	printf("MSC: %d Linger: the moved subsessions go\n", me);
	mvSub[me] = NONE; mvSide[me] = 0; mvPeer[me] = 0;
	if
	:: me == RBMOVER -> mOld = NONE; mOldPeer = 0; mGU = NONE; mGUpeer = 0; mGUold = 0; mGUmask = 0
	:: else
	fi
}
#endif

inline onMessage() {
	r = m.req;
	if
	:: m.t == requestLock -> onRequestLock(r, m.x, m.a, 0, m.from)
	:: m.t == ackLock && me == la[r] ->
		if
		:: stageL[r] == locking && lock[me] == lockPending && requestor[me] == r ->
#ifndef BROKEN_ONPATH
			if
			:: SAMEORCROSS(r) -> sameOrCrossing(r)
			:: else -> granted(r, m.x, 0)
			fi
#else
			granted(r, m.x, 0)   /* broken: the old behaviour, no comparison */
#endif
		:: stageL[r] == done && outcome[r] != Succeeded && !canJob[r] ->
			/* an answer to a request this agent gave up: somebody holds a
			 * lock for it; release it (§3.6) */
			REACHED(8); startCancel(r, 0)
		:: else -> REACHED(9)   /* duplicate, or a cancel job already runs */
		fi
	:: m.t == ackLock && me != la[r] ->
		if
		:: lock[me] != unlocked && requestor[me] == r ->
			if
			:: lock[me] == lockPending -> lock[me] = locked; nackQueue()
			:: else -> REACHED(10)   /* a duplicate: forward it again */
			fi;
			listSelf();
			ctlA(reqFrom[me], ackLock, r, m.x + sdR[me] + appL[me], m.s, m.a, m.st, XREQ)
		:: else -> REACHED(11); dropped(r, XREQ)   /* Rejected: unexpected */
		fi
	:: m.t == nackLock && me == la[r] ->
		if
		:: stageL[r] == locking && lock[me] == lockPending && requestor[me] == r ->
			lock[me] = unlocked; requestor[me] = 0;
			finishLeft(r, Refused, m.x)
		:: else -> REACHED(12)   /* stale */
		fi
	:: m.t == nackLock && me != la[r] ->
		if
		:: lock[me] == lockPending && requestor[me] == r ->
			lock[me] = unlocked; requestor[me] = 0;
			hist[HI(me, r)] = resNacked; histR[HI(me, r)] = m.x;
			CTL(reqFrom[me], nackLock, r, m.x)
		:: else -> REACHED(13); dropped(r, XREQ)   /* Rejected: unexpected */
		fi
	:: m.t == syn && me == ra[r] ->
		if
		:: busyRA[me] == r && stageR[r] == waitSyn -> acceptSyn(r, m.from, m.st)
		:: busyRA[me] == r && stageR[r] != waitSyn && m.from == newN[me] && m.st == genR[GX(me)] ->
			REACHED(14); sendSynAck(r, m.from)   /* onSynDup: a retransmitted SYN */
		:: busyRA[me] != r && hist[HI(me, r)] == 0 && m.from == la[r] && !pendSyn[r] ->
			/* an early SYN before r's requestLock: kept (onNewSyn; Go keeps
			 * it also when r is resolved here, but no requestLock of r is
			 * granted after that, so it is never used) */
			REACHED(51); pendSyn[r] = 1
		:: else -> REACHED(15); dropped(r, XSYN)   /* Rejected: not (or no longer) locked here */
		fi
	:: m.t == syn && me != ra[r] ->
		if
		:: joinReq[me] == r && leftN[me] == m.from && genL[GX(me)] == m.st && jfail[GX(me)] != r ->
			/* onSynDup: a retransmitted SYN is forwarded again */
			REACHED(16); ctlA(rightN[me], syn, r, 0, m.s + 1, 0, joinGen[GX(me)], XSYN)
		:: joinReq[me] == r && leftN[me] == m.from && genL[GX(me)] == m.st && jfail[GX(me)] == r ->
			/* onSynDup after a JoinFailed: the refusal again (it was lost) */
			REACHED(70); refuseSyn(m.from, r, ReasonSetupFailed, m.st)
		:: !(joinReq[me] == r && leftN[me] == m.from && genL[GX(me)] == m.st) ->
			/* onNewSyn: join with the rest of the list, or refuse */
			onNewSyn(r)
		fi
	:: m.t == synAck && me == la[r] && (m.s & FlagRefuse) != 0 ->
		/* onSynAck: a host of the new path refused to join it */
		if
		:: stageL[r] == settingUp && m.from == newN[me] ->
			REACHED(62);
			dropNewPath(r, (m.x == ReasonOnPath -> Refused : Failed), m.a)
		:: else -> REACHED(63)   /* after the first refusal, or not set up (ignored) */
		fi
	:: m.t == synAck && me == la[r] && (m.s & FlagRefuse) == 0 ->
		if
		:: stageL[r] == settingUp && m.from == newN[me] && GATEOPEN(r) ->
			CTL(newN[me], ack, r, 0);
			startTwoPath(me, RIGHT, r);
			stageL[r] = twoPath
		:: stageL[r] == settingUp && m.from == newN[me] && !GATEOPEN(r) -> newPathUp(r)
		:: stageL[r] == twoPath -> REACHED(17); CTL(newN[me], ack, r, 0)   /* our ACK was lost */
		:: stageL[r] == locking && nh[r] == 0 && m.from == ra[r] && lock[me] == lockPending && requestor[me] == r && m.s == 1 ->
			/* the early SYN's answer, granting the lock: the new path is
			 * up and the segment ours (granted switches: synEarly) */
			REACHED(54); synEarly[r] = 1; granted(r, m.x, 1)
		:: stageL[r] == locking && nh[r] == 0 && m.from == ra[r] && lock[me] == lockPending && requestor[me] == r && m.s == 0 ->
			REACHED(53); synEarly[r] = 1   /* the early SYN's answer: kept until ackLock */
		:: else -> REACHED(18)
		fi
	:: m.t == synAck && me != la[r] ->
		if
		:: joinReq[me] == r && leftN[me] != NONE && m.st == joinGen[GX(me)] && jfail[GX(me)] == r ->
			REACHED(71)   /* refused here already: not passed on */
		:: joinReq[me] == r && leftN[me] != NONE && m.st == joinGen[GX(me)] && jfail[GX(me)] != r ->
			ctlA(leftN[me], synAck, r, m.x, m.s, m.a, genL[GX(me)], XSYN);
			if
			:: (m.s & FlagRefuse) != 0 && m.x == ReasonOnPath ->
				/* refused further on, the SYN not passed on after it:
				 * pass it on and leave (FreeSession) */
				REACHED(61); leftN[me] = NONE; rightN[me] = NONE; joinReq[me] = 0; LEAVEGEN(me)
			:: (m.s & FlagRefuse) != 0 && m.x != ReasonOnPath ->
				/* a join failed further on, after the SYN went past
				 * it: stay, for the left anchor's cancelLock to pass
				 * through (joinFailed) */
				REACHED(72); jfail[GX(me)] = r
			:: else
			fi
		:: !(joinReq[me] == r && leftN[me] != NONE && m.st == joinGen[GX(me)]) && joinFails > 0 && joinReq[me] != r ->
			/* the right anchor's answer to a SYN passed on before a
			 * JoinFailed, at the host that failed or one its cancelLock
			 * freed: rejected, but the left anchor has its answer (the
			 * refusal; if that is lost, the loss lets its timer fire) */
			REACHED(69)
		:: !(joinReq[me] == r && leftN[me] != NONE && m.st == joinGen[GX(me)]) && !(joinFails > 0 && joinReq[me] != r) ->
			REACHED(19); dropped(r, XSYN)
		fi
	:: m.t == ack && me == ra[r] ->
		if
		:: busyRA[me] == r && stageR[r] == waitAck -> startTwoPath(me, LEFT, r); stageR[r] = twoPath
		:: else -> REACHED(20)   /* already switched by a new-path packet or the fin */
		fi
	:: m.t == ack && me != ra[r] ->
		if
		:: joinReq[me] == r && rightN[me] != NONE && jfail[GX(me)] != r -> CTL(rightN[me], ack, r, 0)
		:: else -> REACHED(21)
		fi
	:: m.t == fin && (me == la[r] || me == ra[r]) ->
		if
		:: me == ra[r] && busyRA[me] == r && stageR[r] == waitAck -> startTwoPath(me, LEFT, r); stageR[r] = twoPath
		:: else
		fi;
		if
		:: tp[me] && tpReq[me] == r ->
			if
			:: (m.s & FlagDone) != 0 -> REACHED(27)   /* from the other's tomb */
			:: else
			fi;
			if
			:: haveCut[me] && !answered[me] -> REACHED(23)   /* a duplicate before the answer */
			:: else
			fi;
			haveCut[me] = 1; cutoff[me] = m.x;
			assert(m.from == oldN[me] || (nh[r] == 0 && m.from == newN[me]));
			finVia[me] = finVia[me] | (m.from == oldN[me] -> 1 : 2);
			if
#ifndef BROKEN_FIN_NO_REANSWER
			:: answered[me] -> REACHED(22); ctl(m.from, finAck, r, 0, 0, FINACKX(me, r))   /* answer again */
#endif
			:: else   /* evaluate (evaluate) follows */
			fi
#ifndef BROKEN_FIN_NO_REANSWER
		:: !(tp[me] && tpReq[me] == r) && lingerN[me] == m.from && lingerR[me] == r ->
			onTomb(r)   /* a retransmitted fin (or a probe) on the torn-down old path */
#endif
		:: !(tp[me] && tpReq[me] == r) && !(lingerN[me] == m.from && lingerR[me] == r) && tombN[HI(me, r)] == m.from ->
			/* the tomb of an earlier request, which the model does not keep
			 * in full: its finAck (onTomb) */
			REACHED(48); ctl(m.from, finAck, r, 0, 0, FINACKX(me, r))
		:: else ->
			/* only a retransmission can come after the anchor is done */
			assert((me == la[r] && stageL[r] == done) || (me == ra[r] && stageR[r] == done));
			REACHED(26); dropped(r, ARM(FINACKX(me, r)))
		fi
	:: m.t == fin && me != la[r] && me != ra[r] && oReq[OX(me)] == r && joinReq[me] != r ->
		/* the old path's session set aside here (onNewSyn) passes it */
		REACHED(67);
		fwn = (m.from == oL[OX(me)] -> oR[OX(me)] : oL[OX(me)]); fwx = (m.from == oL[OX(me)] -> XFINL : XFINR);
		ctl(fwn, fin, r, m.x, m.s, fwx)
	:: m.t == fin && me != la[r] && me != ra[r] && !(oReq[OX(me)] == r && joinReq[me] != r) ->
		lockByTeardown(r); NOTETD(r);
		finPassed[me] = finPassed[me] | (m.from == leftN[me] -> 4 : 8);
		fwn = (m.from == leftN[me] -> rightN[me] : leftN[me]); fwx = (m.from == leftN[me] -> XFINL : XFINR);
		ctl(fwn, fin, r, m.x, m.s, fwx)
	:: m.t == finAck && (me == la[r] || me == ra[r]) ->
		/* the old path answered our fin: its middles saw the teardown */
		if
		:: tp[me] && tpReq[me] == r && m.from == oldN[me] -> finOldAcked[me] = 1
		:: !(tp[me] && tpReq[me] == r) && lingerN[me] == m.from && lingerR[me] == r -> lingerAcked[me] = 1
		:: else
		fi;
		if
		:: tp[me] && tpReq[me] == r && !finAcked[me] -> assert(finSent[me]); finAcked[me] = 1
		:: tp[me] && tpReq[me] == r && WAITFIN(me) -> REACHED(28); probes[me] = 0   /* the other anchor, or its tomb, is there */
		:: tp[me] && tpReq[me] == r && finAcked[me] && haveCut[me] -> REACHED(29)   /* a duplicate */
		:: !(tp[me] && tpReq[me] == r) ->
			/* a duplicate (answer to a retransmitted fin), after completion */
			assert((me == la[r] && stageL[r] == done) || (me == ra[r] && stageR[r] == done));
			REACHED(30)
		fi
	:: m.t == finAck && me != la[r] && me != ra[r] && oReq[OX(me)] == r && joinReq[me] != r ->
		REACHED(67);
		fwn = (m.from == oL[OX(me)] -> oR[OX(me)] : oL[OX(me)]); fwx = (m.from == oL[OX(me)] -> XFINR : XFINL);
		ctl(fwn, finAck, r, 0, 0, fwx);
		oFP[OX(me)] = oFP[OX(me)] | (m.from == oL[OX(me)] -> 1 : 2);
		if
		:: oFP[OX(me)] == 3 && oLock[OX(me)] -> oLock[OX(me)] = 0; hist[HI(me, r)] = resDone
		:: else
		fi
	:: m.t == finAck && me != la[r] && me != ra[r] && !(oReq[OX(me)] == r && joinReq[me] != r) ->
		lockByTeardown(r); NOTETD(r);
		fwn = (m.from == leftN[me] -> rightN[me] : leftN[me]); fwx = (m.from == leftN[me] -> XFINR : XFINL);
		ctl(fwn, finAck, r, 0, 0, fwx);
		middleFinAck()
	:: m.t == cancelLock && m.s == 1 ->
		/* FlagNewPath: a new path that will not be used */
		if
		:: joinReq[me] == r && me != ra[r] && rightN[me] != NONE ->
			ctl(rightN[me], cancelLock, r, 0, 1, 0);
			/* FreeSession of the joined session (and ReleaseState of a
			 * state it imported) */
			leftN[me] = NONE; rightN[me] = NONE; joinReq[me] = 0; LEAVEGEN(me); jfail[GX(me)] = 0;
			RELEASESTATE(me)
		:: me == ra[r] && busyRA[me] == r && stageR[r] != twoPath -> releaseRight(r, resCancelled)
		:: else -> REACHED(33)
		fi
	:: m.t == cancelLock && m.s == 0 && me == ra[r] ->
		if
		:: busyRA[me] == r && stageR[r] == twoPath -> REACHED(34); dropped(r, XCAN)   /* Rejected: after the switch */
		:: busyRA[me] == r && stageR[r] != twoPath ->
			releaseRight(r, resCancelled); CTL(leftN[me], ackCancel, r, 0)
		:: busyRA[me] != r -> REACHED(35); hist[HI(me, r)] = resCancelled; CTL(leftN[me], ackCancel, r, 0)
		fi
	:: m.t == cancelLock && m.s == 0 && me != ra[r] ->
		if
		:: rightN[me] == NONE -> REACHED(36); hist[HI(me, r)] = resCancelled; CTL(leftN[me], ackCancel, r, 0)
		:: rightN[me] != NONE && lock[me] != unlocked && requestor[me] == r ->
			/* held here: release, pass on */
			lock[me] = unlocked; requestor[me] = 0; hist[HI(me, r)] = resCancelled;
			CTL(rightN[me], cancelLock, r, 0)
		:: rightN[me] != NONE && !(lock[me] != unlocked && requestor[me] == r) && hist[HI(me, r)] == resCancelled ->
			REACHED(37); CTL(rightN[me], cancelLock, r, 0)   /* a retransmission: pass on again */
		:: rightN[me] != NONE && !(lock[me] != unlocked && requestor[me] == r) && hist[HI(me, r)] != resCancelled ->
			/* the request never got past this agent */
			REACHED(38); CTL(leftN[me], ackCancel, r, 0)
		fi
	:: m.t == ackCancel && me == la[r] ->
		if
		:: canJob[r] -> cancelDone(r)
		:: else -> REACHED(39)
		fi
	:: m.t == ackCancel && me != la[r] ->
		if
		:: hist[HI(me, r)] == resCancelled && leftN[me] != NONE -> CTL(leftN[me], ackCancel, r, 0)
		:: else -> REACHED(40); dropped(r, XCAN)   /* Rejected (e.g. the left side changed since) */
		fi
#ifdef TRIGGER
	:: m.t == trigger -> onTrigger(r)
	:: m.t == triggerResult -> onTriggerResult(r)
#endif
#ifdef MIGRATE
	:: m.t == migrate && m.x == MigFreeze -> onFreeze(r)
	:: m.t == migrate && m.x != MigFreeze -> onMigServe(r)
	:: m.t == migrateAnswer -> onMigAnswer(r)
#endif
#ifdef REBIND
	:: m.t == rebind -> onRebindIn()
	:: m.t == rebindAck -> onRebindAck()
#endif
	fi
}

/* TimerRequest, TimerSyn, TimerCancel of the left anchor of request r, TimerFin of an anchor */
#define TREQ(me, r) (r != 0 && stageL[r] == locking && lock[me] == lockPending && requestor[me] == r)
#define TSYN(me, r) (r != 0 && stageL[r] == settingUp && SYNOPEN(r))
#define TCAN(me, r) (r != 0 && canJob[r])
#define TFIN(me) (tp[me] && finSent[me] && !finAcked[me])
/* TimerFin after a finAck on the direct new path (anchor), or TimerTombFin
 * (tomb): our fin has not been answered on the old path yet, whose middles
 * free the session only once they have passed the finAcks both ways; OLDR
 * is the request */
#define TOLD(me) ((tp[me] && finAcked[me] && !finOldAcked[me]) || (!tp[me] && lingerN[me] != NONE && !lingerAcked[me]))
#define OLDR(me) (tp[me] -> tpReq[me] : lingerR[me])
#ifdef BROKEN_NO_PROBE
#define TPROBE(me) false   /* broken: internal/protocol before waitFin */
#else
#define TPROBE(me) WAITFIN(me)
#endif
/* a timer of r may give up now (MAXTRIES sent, no answer) */
#define GIVEUPDUE(r) ((TREQ(la[r], r) && reqTries[r] >= MAXTRIES) || (TSYN(la[r], r) && synTries[r] >= MAXTRIES) || \
	(TCAN(la[r], r) && canTries[r] >= MAXTRIES) || \
	(TFIN(la[r]) && tpReq[la[r]] == r && finTries[la[r]] >= MAXTRIES) || \
	(TFIN(ra[r]) && tpReq[ra[r]] == r && finTries[ra[r]] >= MAXTRIES) || \
	(TOLD(la[r]) && OLDR(la[r]) == r && finTries[la[r]] >= MAXTRIES) || \
	(TOLD(ra[r]) && OLDR(ra[r]) == r && finTries[ra[r]] >= MAXTRIES) || \
	(TPROBE(la[r]) && tpReq[la[r]] == r && probes[la[r]] >= MAXTRIES) || \
	(TPROBE(ra[r]) && tpReq[ra[r]] == r && probes[ra[r]] >= MAXTRIES))
#define NOGIVEUPDUE (!GIVEUPDUE(1) && !GIVEUPDUE(NR) && !TRIGDUE && !MIGDUE && !REBDUE)
/* no anchor waits for the other's fin (at quiescence its probe timer is due) */
#define NOWAITFIN (!TPROBE(la[1]) && !TPROBE(ra[1]) && !TPROBE(la[NR]) && !TPROBE(ra[NR]))
/* a middlebox of r's new path is dead (§3.6) */
#define DEADPATH(r) ((nh[r] > 0 && dead[hop[2*(r)]]) || (nh[r] > 1 && dead[hop[2*(r)+1]]))

proctype agent(byte me) {
	Msg m;
	byte r, q, side, path, d, ao, hx, hs, hb, rq, dd, nb2, hh, hside, sq, hat, fwn, fwx;
	bool dataOld, dataNew, ackOld;

	if
	:: dead[me] ->
		/* a failed host: swallows everything (§3.6): for the sender, every
		 * message to it is lost (the SYN's timer may fire) */
end_dead:	do
		:: atomic { net[me]?m.t, m.from, m.req, m.x, m.s, m.a, m.st, m.at ->
			/* (the new path's cancelLock has no timer) */
			d = (m.t == cancelLock && m.s == 1 -> 0 : XOF(m.t));
			lossy[m.req] = lossy[m.req] | d; lostNow[m.req] = lostNow[m.req] | d }
		od
	:: else
	fi;
end:
	do
	:: atomic {
		if
		:: net[me]?m.t, m.from, m.req, m.x, m.s, m.a, m.st, m.at ->
			if
			:: m.t == tcp -> tcpIn()
			:: else -> onMessage()
			fi
		/* the operator (or a middlebox) asks this agent to reconfigure */
		:: PENDING(me) ->
#ifdef TRIGGER
			sendTrigger()
#else
			rq = (la[1] == me && stageL[1] == 0 -> 1 : NR);
			startReq(rq)
#endif
#ifdef UDP
		/* TimerQuiet: this anchor's old path has been quiet for the
		 * drain time since its switch (udp.pml UQUIET) */
		:: UQUIET(me) -> printf("MSC: %d TimerQuiet: side ended\n", me); uq[me] = 1
#endif
		/* the host writes its next byte, or closes (not while it holds) */
		:: ISHOST(me) && !HELD(me) && (hSndNxt[HOST(me)] < NDH(HOST(me)) || (FINS && !hFinSent[HOST(me)])) ->
			hh = HOST(me); hostSend(hh)
		/*
		 * Timers (onTimer). A timer fires only once a message of its
		 * exchange (or its answer) was lost or rejected; a retransmission
		 * is the same message with the same request. After MAXTRIES sends
		 * the sender gives up, once the last try (or its answer) was lost,
		 * or when nothing at all can happen any more (timeout).
		 */
		/* TimerRequest: resend requestLock; after MAXTRIES the request
		 * fails (timeout), the lock is released, a cancel job frees stale
		 * locks */
		:: TREQ(me, laReq[me]) && (lossy[laReq[me]] & XREQ) && reqTries[laReq[me]] < MAXTRIES ->
			r = laReq[me]; lostNow[r] = lostNow[r] & NOTX(XREQ);
			printf("MSC: %d TimerRequest r%d: retransmit\n", me, r);
			sendRequestLock(r)
		:: TREQ(me, laReq[me]) && ((lostNow[laReq[me]] & XREQ) || timeout) && reqTries[laReq[me]] >= MAXTRIES ->
			r = laReq[me]; GIVEUP; REACHED(41);
			lock[me] = unlocked; requestor[me] = 0;
			finishLeft(r, Failed, ReasonTimeout);
			startCancel(r, 0)
		/* TimerSyn: resend the SYN; after MAXTRIES abortSetup (§3.6) */
		:: TSYN(me, laReq[me]) && (lossy[laReq[me]] & XSYN) && synTries[laReq[me]] < MAXTRIES ->
			r = laReq[me]; lostNow[r] = lostNow[r] & NOTX(XSYN);
			printf("MSC: %d TimerSyn r%d: retransmit\n", me, r);
			synTries[r]++; CTL(newN[me], syn, r, 0)
		:: TSYN(me, laReq[me]) && ((lostNow[laReq[me]] & XSYN) || timeout) && synTries[laReq[me]] >= MAXTRIES ->
			r = laReq[me];
			if
			:: !DEADPATH(r) -> GIVEUP; REACHED(42)   /* the new path works: its messages were lost */
			:: else
			fi;
			abortSetup(r)
		/* TimerCancel: resend cancelLock; after MAXTRIES cancelDone */
		:: TCAN(me, laReq[me]) && (lossy[laReq[me]] & XCAN) && canTries[laReq[me]] < MAXTRIES ->
			r = laReq[me]; lostNow[r] = lostNow[r] & NOTX(XCAN);
			printf("MSC: %d TimerCancel r%d: retransmit\n", me, r);
			sendCancel(r)
		:: TCAN(me, laReq[me]) && ((lostNow[laReq[me]] & XCAN) || timeout) && canTries[laReq[me]] >= MAXTRIES ->
			r = laReq[me]; GIVEUP; REACHED(43); cancelDone(r)
		/* TimerFin / TimerTombFin: resend our fin on the old path only
		 * (answered on the direct new path, not yet on the old one); after
		 * MAXTRIES stop (the old path's middles are freed by their lease) */
		:: TOLD(me) && (lossy[OLDR(me)] & FINX(me, OLDR(me))) && finTries[me] < MAXTRIES ->
			r = OLDR(me); lostNow[r] = lostNow[r] & NOTX(FINX(me, r));
			printf("MSC: %d TimerFin r%d: retransmit on the old path\n", me, r);
			REACHED(46); finTries[me]++;
			if
			:: tp[me] -> ctl(oldN[me], fin, r, oldSent[me], 0, FINX(me, r))
			:: else -> ctl(lingerN[me], fin, r, lingerC[me], FlagDone, FINX(me, r))
			fi
		:: TOLD(me) && ((lostNow[OLDR(me)] & FINX(me, OLDR(me))) || timeout) && finTries[me] >= MAXTRIES ->
			r = OLDR(me); GIVEUP; REACHED(47);
			if
			:: tp[me] -> finOldAcked[me] = 1
			:: else -> lingerAcked[me] = 1
			fi
		/* TimerFin: resend the fin; after MAXTRIES go on, Unconfirmed */
		:: TFIN(me) && (lossy[tpReq[me]] & FINX(me, tpReq[me])) && finTries[me] < MAXTRIES ->
			r = tpReq[me]; lostNow[r] = lostNow[r] & NOTX(FINX(me, r));
			printf("MSC: %d TimerFin r%d: retransmit\n", me, r);
			sendFin(r)
		:: TFIN(me) && ((lostNow[tpReq[me]] & FINX(me, tpReq[me])) || timeout) && finTries[me] >= MAXTRIES ->
			r = tpReq[me]; GIVEUP; REACHED(44);
			finAcked[me] = 1; finOldAcked[me] = 1; unconf[r] = unconf[r] | (la[r] == me -> 1 : 2)
			/* (then waitFin, if the other's fin has not come: TPROBE) */
		/* TimerFin in waitFin (our fin answered, the other's missing):
		 * send our fin again as a probe, once a fin or finAck of r was
		 * lost or rejected since the last probe, or at quiescence when no
		 * give-up is due (a finAck resets the count, so each probe needs
		 * a new cause: the executions stay finite); after MAXTRIES
		 * unanswered probes complete, Unconfirmed */
		:: TPROBE(me) && ((lossy[tpReq[me]] & WAITX(me, tpReq[me])) || (timeout && NOGIVEUPDUE)) && probes[me] < MAXTRIES ->
			r = tpReq[me];
			lossy[r] = lossy[r] & NOTX(WAITX(me, r)); lostNow[r] = lostNow[r] & NOTX(WAITX(me, r) | FINX(me, r));
			printf("MSC: %d TimerFin r%d: probe\n", me, r);
			REACHED(31); probes[me]++; sendFin(r)
		:: TPROBE(me) && ((lostNow[tpReq[me]] & WAITX(me, tpReq[me])) || timeout) && probes[me] >= MAXTRIES ->
			r = tpReq[me]; GIVEUP; REACHED(32);
			unconf[r] = unconf[r] | (la[r] == me -> 1 : 2);
			complete(r)
		/* TimerLease: only after a sender gave up, and once nothing else
		 * can happen, no other timer included (LockLease exceeds every
		 * exchange, and probes renew the old path's leases) */
		:: timeout && gaveUp > 0 && NOGIVEUPDUE && NOWAITFIN && LEASE(me) -> printf("MSC: %d TimerLease\n", me); REACHED(45); onLease()
#ifdef TRIGGER
		/* TimerTrigger: resend the trigger; after MAXTRIES give up (NoAnswer) */
		:: TTRIG(me) && (lossy[TRIGR] & XTRIG) && trigTries < MAXTRIES ->
			r = TRIGR; lostNow[r] = lostNow[r] & NOTX(XTRIG);
			printf("MSC: %d TimerTrigger: retransmit\n", me);
			onTriggerTimer()
		:: TTRIG(me) && ((lostNow[TRIGR] & XTRIG) || timeout) && trigTries >= MAXTRIES ->
			r = TRIGR; GIVEUP; REACHED(85); trigPend = 0
#endif
#ifdef MIGRATE
		/* TimerMigrateMsg: resend the step in flight; after MAXTRIES the
		 * migration fails and the new path is abandoned */
		:: TMIG(me) && (lossy[1] & XMIG) && migTries < MAXTRIES ->
			r = 1; lostNow[r] = lostNow[r] & NOTX(XMIG);
			printf("MSC: %d TimerMigrateMsg: retransmit\n", me);
			migTransmit()
		:: TMIG(me) && ((lostNow[1] & XMIG) || timeout) && migTries >= MAXTRIES ->
			r = 1; GIVEUP; REACHED(95); migFail(r)
		/* TimerMigrate at the right anchor: its hold's lease (the
		 * migration's timeout + 5 s after the freeze) lets what it holds
		 * go, once nothing else can happen: needed only after a loss (the
		 * left anchor's ACK lost after its switch; the right anchor, its
		 * acknowledgements held, waits for the left anchor's fin, which
		 * waits for them) */
		:: timeout && HOLDLEASE(me) ->
			printf("MSC: %d TimerMigrate: hold released\n", me);
			REACHED(88); assert(nlost + ndrop > 0); holdLeased = 1; migReleaseRight()
		/* Drained: an anchor's side of the old path drained (order) */
		:: MIGDRAINING(me) && DRAINED(me) -> r = 1; onDrained(r)
#endif
#ifdef REBIND
		/* the agent (mobility: the address is gone) asks the mover to
		 * rebind its side, and again after a failure */
		:: RBSTART(me) -> onRebind()
		/* TimerRebind: resend the rebind; after MAXTRIES give up */
		:: TREB(me) && ((lossy[RBR] & XREB) || RBFIRE) && rbTries < MAXTRIES ->
			lostNow[RBR] = lostNow[RBR] & NOTX(XREB); onRebindTimer()
		:: TREB(me) && ((lostNow[RBR] & XREB) || timeout || RBFIRE) && rbTries >= MAXTRIES -> onRebindTimer()
		/* TimerRebound: Linger for the subsessions kept after a rebind */
		:: MVAT(me) && LINGERDUE -> onRebound()
#endif
		fi;
		/* the end of every event: evaluate the two-path phase, and let
		 * the first queued request go on if the lock was released
		 * (releaseQueue, wherever internal/protocol unlocks) */
		evaluate();
		releaseQueue();
#ifdef TRIGGER
		/* emitResult: the request a trigger asked for ended: answer it */
		if
		:: me == la[TRIGR] && trigTaken && trigAns == 0 && stageL[TRIGR] == done -> answerTrigger(TRIGR)
		:: else
		fi;
#endif
#ifdef MIGRATE
		/* the right anchor lets its held packets go at its switch, or
		 * when the request ended here (cancelLock, lease) */
		if
		:: holdL[me] && me == ra[1] && (busyRA[me] != 1 || stageR[1] == twoPath) -> migReleaseRight()
		:: else
		fi;
#endif
	}
	od
}
