/*
 * Promela model of the Dysco reconfiguration protocol (SIGCOMM 2017, §3)
 * as implemented in internal/protocol (docs/protocol.md).
 *
 * One process per Dysco agent; agents 0 and LAST are the end hosts, the
 * others middleboxes. Every process reads its own channel net[me]; a message
 * names its sender (from), which tells the subsession it came on. Control
 * messages (UDP) and TCP segments share the channels, so FIFO order holds
 * per pair of neighbours and paths interleave arbitrarily.
 *
 * Configurations are chosen with -D flags, see config.pml and verify.sh.
 * Names follow the Go code: MsgTypes, LockStates, Stages (types.go,
 * message.go); the two-path variables of twopath.go.
 */

#include "config.pml"

/* Triggers (trigger, triggerResult) are sent only in the -DTRIGGER
 * configuration, a state migration's migrate and migrateAnswer only in
 * -DMIGRATE (docs/verification.md, "Triggers" and "State migration");
 * other configurations keep no variable of theirs. */
/* Rebinds (rebind, rebindAck) are sent only in the -DREBIND
 * configurations (REBIND_RIGHT, REBIND_LEFT, REBIND_CONTEND,
 * REBIND_CONTEND_RIGHT; docs/verification.md, "Rebinds"). */
/* MsgTypes (message.go), in the Go order. */
mtype = { requestLock, ackLock, nackLock, cancelLock, ackCancel, syn, synAck, ack, fin, finAck, trigger, triggerResult, migrate, migrateAnswer, rebind, rebindAck };
/* LockStates (types.go). */
mtype = { unlocked, lockPending, locked };
/* Stages (types.go); idle = no stage (the zero value in Go). */
mtype = { locking, settingUp, waitSyn, waitAck, twoPath, cancelling, done };
/* The TCP segment (not a control message). */
mtype = { tcp };

/* RejectReasons used by the model (types.go Reason values). */
#define ReasonNone      0
#define ReasonLocked    1
#define ReasonBusy      2
#define ReasonNotOnPath 3
#define ReasonNoSession 5
#define ReasonTimeout   6
#define ReasonSetupFailed 7
#define ReasonAborted   10   /* a gated request aborted before the switch (a failed migration) */
#define ReasonOnPath    11   /* a hop of the new chain is already on the session's path */
#define ReasonNotNextHop 13  /* trigger: the sender is no longer the left neighbour's next hop */

/* resKind (internal/protocol): how a request was resolved at an agent (its history,
 * which answers retransmissions); 0 = not resolved here. */
#define resNacked    1
#define resCancelled 2
#define resDone      3
#define resExpired   4

/* TimerKind (events.go) of the timers the model has. */
#define TimerRequest 1
#define TimerSyn     2
#define TimerCancel  3
#define TimerFin     4
#define TimerLease   5
#define TimerTrigger 9
#define TimerMigrateMsg 11

/* Outcomes (types.go). */
#define Succeeded 1
#define Refused   2
#define Failed    3

#define NONE 255
#define LEFT 0
#define RIGHT 1
#define LAST (NA-1)

typedef Msg { mtype t; byte from; byte req; byte x; byte s; byte a; byte st; byte at };

chan net[NA] = [QS + TCPQ] of { mtype, byte, byte, byte, byte, byte, byte, byte };

/* ---- agent state (one session per agent) ---- */
byte leftN[NA], rightN[NA];     /* neighbours of the left and right sides */
byte sdL[NA], sdR[NA];          /* subsession deltas (ingress seq +, egress ack -) */
byte appR[NA], appL[NA];        /* AppDelta.Right / AppDelta.Left */
bool freed[NA];                 /* FreeSession done (middle left the path) */
bool orig[NA];                  /* on the initial chain */
bool dead[NA];                  /* host never answers (new path failure) */

mtype lock[NA] = unlocked;      /* lock of the subsession to the right */
byte requestor[NA];             /* request holding / pending the lock */
byte qreq[NA], qdelta[NA], qldelta[NA], qfrom[NA]; /* the blocked-request queue (one slot); qldelta: its leftDelta gathered */
byte reqFrom[NA];               /* where the pending requestLock came from */
byte busyRA[NA];                /* right anchor of an unfinished reconfiguration */

/* two-path state of an anchor (twopath.go TwoPath), on side tpSide */
bool tp[NA];
byte tpReq[NA], laReq[NA];      /* request of the two-path phase / of the left anchor */
byte tpSide[NA], oldN[NA], newN[NA], dNew[NA];
byte oldSent[NA], oldRcvd[NA], oldSentAcked[NA], oldRcvdAcked[NA], firstNewRcvd[NA];
bool newRcvd[NA];
bool finSent[NA], finAcked[NA], answered[NA], haveCut[NA];
byte finVia[NA];                /* anchor.finVia: the other's fin came on the old path (1), the direct new path (2) */
bool finOldAcked[NA];           /* anchor.finOldAcked: a finAck came on the old path (or the anchor gave up) */
byte cutoff[NA];
byte probes[NA];                /* anchor.probes: fins sent to ask for the other's (waitFin) */
byte lingerN[NA], lingerD[NA];  /* old subsession kept after completion */
byte lingerC[NA];               /* tomb.cutoff: the cut-off its fin carried */
bool lingerAcked[NA];           /* tomb.acked: its old path answered our fin (or we gave up) */
byte finPassed[NA];             /* middles: fin-acks seen (bit 0 rightward, bit 1 leftward), fins (bits 2, 3) */

/* marks of each side (twopath.go Marks), session space */
byte sndNxt[2*NA], ackSent[2*NA], rcvNxt[2*NA], ackRcvd[2*NA];
/* highest L->R / R->L sequence end a middle has forwarded (ack check) */
byte fwdR[NA], fwdL[NA];

/* ---- per request ---- */
mtype stageL[NR+1], stageR[NR+1];
byte rightDelta[NR+1], leftDelta[NR+1];
/* the leftDelta a request's requestLock gathered on its way (Message.LeftDelta),
 * kept by its right anchor for the granting synAck (internal/protocol synAckMsg) */
byte grantL[NR+1];
byte outcome[NR+1], reason[NR+1];
byte reqTries[NR+1], synTries[NR+1];  /* anchor.tries while locking / settingUp */
bool held[NR+1];                /* the request holds its segment (locked to completion) */
bool canJob[NR+1], canAnchor[NR+1]; /* a cancelJob at the left anchor; its anchor is set (not a stale lock) */
byte canTries[NR+1];            /* cancelJob.tries */
byte unconf[NR+1];              /* completed Unconfirmed: bit 0 left anchor, bit 1 right anchor */
/* the early SYN of a direct new path (agent.pml sendEarlySyn, since
 * 2026-11-23): pendSyn, the right anchor keeps it until the request's
 * requestLock (Agent.earlySyns); synEarly, the left anchor has the SYN-ACK
 * while still locking (anchor.synAcked) */
bool pendSyn[NR+1], synEarly[NR+1];

/* ---- loss of control messages (UDP, §3.3) ----
 * At most LOSS control messages are lost in a run. A loss marks the
 * exchange it belongs to (the message or its answer was lost): only then
 * may the sender's retransmission timer fire. lossy: an exchange of the
 * request has lost a message (the timer may fire, also spuriously, until
 * the exchange is answered); lostNow: the last transmission or its answer
 * was lost (the timer may fire after the last try: the sender gives up). */
#ifndef LOSS
#define LOSS 0
#endif
#define XREQ  1   /* requestLock, ackLock, nackLock: TimerRequest */
#define XSYN  2   /* syn, synAck: TimerSyn */
#define XCAN  4   /* cancelLock, ackCancel: TimerCancel */
#define XFINL 8   /* the left anchor's fin and the finAck answering it: its TimerFin */
#define XFINR 16  /* the right anchor's fin and its finAck */
#define XWAITL 32 /* the left anchor's probes (TimerFin in waitFin): set by any loss or */
#define XWAITR 64 /* rejection of a fin or finAck of the request, cleared by each probe */
#define XTRIG 128 /* trigger, triggerResult: the sender's TimerTrigger (-DTRIGGER) */
#define XMIG  128 /* migrate, migrateAnswer: the left anchor's TimerMigrateMsg (-DMIGRATE; never with TRIGGER) */
#define NOTX(X) (255 - (X))
byte nlost;                     /* control messages lost so far */
byte ndrop;                     /* control messages dropped at a full queue (up to 2, agent.pml ctl) */
byte lossy[NR+1], lostNow[NR+1];
byte gaveUp;                    /* a sender gave up after MAXTRIES (TimerRequest, TimerCancel, TimerFin) */

/* per agent: session.history (resolved requests), the joined request,
 * the tomb's request (old subsession kept after completion), fin tries */
byte hist[NA*(NR+1)], histR[NA*(NR+1)];
/* the old neighbour of each completed request's tomb: Go keeps a tomb per
 * request (session.tombs), the model only the last one in full (lingerN...);
 * an older tomb still answers fins (onTomb) */
byte tombN[NA*(NR+1)];
#define HI(me, r) ((me)*(NR+1)+(r))
byte joinReq[NA];
byte lingerR[NA];
byte finTries[NA];

/* ---- end hosts ---- */
byte hSndNxt[2], hSndUna[2], hRcvNxt[2], hRcvd[2];
bool hFinSent[2], hFinRcvd[2];

#ifndef FINS
#define FINS 0
#endif
/* the flag of a fin re-sent by a tomb (message.go FlagDone), in the message's s field */
#define FlagDone 4
/* message.go FlagPartial (an ackLock whose list does not name every middle
 * agent of the old segment) and FlagRefuse (a synAck refusing the new
 * path), in the message's s field, with the Go values */
#define FlagPartial 16
#define FlagRefuse  32

/* ---- a host on both paths (message version 3; docs/verification.md,
 * "A middlebox on both paths: the model") ----
 * The ackLock lists the old segment's middle agents (listSelf): in its a
 * field as a set (bit i: agent i), in st in path order for up to two
 * (LISTCODE: first+1, or (first+1)*8 + second+1; 255 for more); the count
 * is the size of the set (a repeat makes the list partial, FlagPartial). */
#ifndef MAXLIST
#define MAXLIST 8               /* wire.MaxHops: a list this long is full */
#endif
#define BIT(v, i) (((v) >> (i)) & 1)
#define LISTLEN(v) (BIT(v,0) + BIT(v,1) + BIT(v,2) + BIT(v,3) + BIT(v,4) + BIT(v,5) + BIT(v,6) + BIT(v,7))
/* the new chain of r in the list's two encodings */
#define CHAINMASK(r) ((nh[r] >= 1 -> (1 << hop[2*(r)]) : 0) | (nh[r] >= 2 -> (1 << hop[2*(r)+1]) : 0))
#define CHAINCODE(r) (nh[r] == 1 -> hop[2*(r)] + 1 : (nh[r] == 2 -> (hop[2*(r)] + 1)*8 + hop[2*(r)+1] + 1 : 0))
/* The datapath holds one state per session tuple. HOLDS: this agent has a
 * state of the session; LIVE: on a live path (Agent.OnLivePath: not a
 * middle agent of an old path past which both anchors' fins have gone,
 * finPassed bits 2 and 3). A host that joins a new path while LIVE breaks
 * the session: asserted at JoinSession (onNewSyn). */
#define HOLDS(i) (!freed[i] && (leftN[i] != NONE || rightN[i] != NONE))
#ifdef BROKEN_LIVE_KNOWN
#define LIVE(i) HOLDS(i)        /* broken: known here is on the live path */
#else
#define LIVE(i) (HOLDS(i) && (finPassed[i] & 12) != 12)
#endif
/* MessageIn.OnPath, as the agent marks a new path's SYN (internal/reconfig liveHere) */
#ifdef BROKEN_ONPATH
#define ONPATH(i) false         /* broken: the old behaviour, the host joins anyway */
#else
#define ONPATH(i) LIVE(i)
#endif
bool unchanged[NR+1];           /* Result.Unchanged */
byte refHop[NR+1];              /* Result.Hop: the hop already on the path (0: none; set with cancelJob.end) */
byte canOut[NR+1];              /* cancelJob.end: the outcome the request reports once the locks are released (0: Failed setupFailed) */
/* canOut MIGABORT: a migration failed, the request reports Failed aborted */
#define MIGABORT 4
#define CANREASON(r) (canOut[r] == Refused -> ReasonOnPath : (canOut[r] == Failed -> ReasonSetupFailed : (canOut[r] == MIGABORT -> ReasonAborted : ReasonNone)))
bool joinedAny;                 /* some host joined a new path (JoinSession) */
byte joinFails;                 /* JoinFailed events so far (at most JOINFAIL) */
#ifndef JOINFAIL
#define JOINFAIL 0
#endif
/* the old path's session at a middle agent whose datapath state a new path
 * took over (it joined after both anchors' fins had passed it): Go keeps
 * it as a separate session that passes the old path's fins and finAcks
 * until they are done (or its lease expires). oReq its request, oL / oR
 * its neighbours, oFP the finAcks passed (bit 0 rightward, 1 leftward),
 * oLock its lock still held. tdReq: the request whose fins passed this
 * middle (Go teardown.req). Only configurations that can rejoin (REJOIN)
 * keep them per agent; the others have one slot, never written (OX), so
 * that their state vectors do not grow. */
#ifdef REJOIN
#define OX(i) (i)
#define ONA NA
#else
#define OX(i) 0
#define ONA 1
#endif
byte oReq[ONA], oL[ONA], oR[ONA], oFP[ONA], tdReq[ONA];
/* Subsessions of a new path are told apart by their tuples in Go (a host
 * that joins again gets a new port to its right); the model names them by
 * neighbour, so syn and synAck carry in st which subsession of a joined
 * host they travel on: joinGen, counted up at each join of that host
 * (genL: the one of its left neighbour, genR: the right anchor's new
 * subsession). A synAck for an earlier join of a host that joined again is
 * rejected there, as Go rejects it (unknown subsession). */
/* A host joins the same request's new path again only after a JoinFailed
 * (the SYN is then retransmitted through it): configurations without
 * -DJOINFAIL keep one slot, always 0 (GX), so that their state vectors do
 * not grow and every check on it holds. */
#if JOINFAIL > 0
#define GX(i) (i)
#define GNA NA
#define NEWGEN(me) joinGen[me]++; assert(joinGen[me] < 8)
#else
#define GX(i) 0
#define GNA 1
#define NEWGEN(me) skip
#endif
byte joinGen[GNA], genL[GNA], genR[GNA];
/* jfail: the request whose join failed at this host (JoinFailed): the host
 * keeps its joined state, with no datapath, to refuse the SYN again, until
 * the left anchor's cancelLock on the new path (internal/protocol joinFailed) */
byte jfail[GNA];
/* a host leaves a new path: its subsessions are gone */
#define LEAVEGEN(me) genL[GX(me)] = 0
bool oLock[ONA];
#ifdef REJOIN
#define NOTETD(r) tdReq[OX(me)] = r
#else
#define NOTETD(r) skip
#endif

/* ---- triggers (trigger.go; -DTRIGGER) ----
 * Middlebox TRIGGERER asks its left neighbour, with a trigger on their
 * subsession, to be left anchor of request TRIGR (its deletion, a proxy's
 * splice). The sender: trigTries (trigOut.sent), trigPend (its trigOut,
 * until the final answer or it gives up), trigFinal (final answers it took),
 * trigGot / trigGotRs (the outcome and reason they carried). The left
 * neighbour: trigTaken (its trigIn), trigPeer (trigIn.peer), trigAns / trigRs (trigIn.answer: the
 * outcome and reason answered, trigAns 0 while the request runs),
 * trigStarted (requests it started for the trigger). */
#ifdef TRIGGER
byte trigTries, trigFinal, trigGot, trigGotRs, trigAns, trigRs, trigStarted, trigTo, trigPeer;
bool trigPend, trigTaken;
#endif

/* ---- state migration (migrate.go; -DMIGRATE) ----
 * Request 1 replaces middlebox MOLD by MNEW and moves MOLD's state of the
 * session to MNEW. hasState: the host holds the session's middlebox state
 * (a token: MOLD's at the start); nImport: imports done. The left anchor:
 * migPh (migPhase), the step in flight (migTo, migOp, migTries: migCall);
 * exported, migAborted, migFails (export or import failures chosen so
 * far, at most one). The right anchor: rmig (0 none, 1 holding and
 * draining, 2 answered), rmigAns (its answer). The old and new middleboxes:
 * expAns, impAns (migServe.answer: 0 none yet, MigOK, MigFailed). holdL:
 * an anchor holds the packets it would send on the old path (Hold ..
 * ReleaseHold); the anchors are the end hosts, so a hold is the host not
 * sending, its acknowledgements owed (ackOwed) sent cumulatively when the
 * hold is released. */
#ifdef MIGRATE
#define MIGABORTS true
#else
#define MIGABORTS false
#endif
#ifdef MIGRATE
bool hasState[NA], holdL[NA], ackOwed[NA];
byte nImport, migPh, migTo, migOp, migTries, migFails, rmig, rmigAns, expAns, impAns;
bool exported, migAborted;
bool holdLeased;                /* the right anchor's hold went by its lease (TimerMigrate) */
#endif

/* ---- rebinds (rebind.go; -DREBIND) ----
 * Agent RBMOVER (the session's first agent, or its last) moves the
 * subsession of its side RBSIDE to a new address of its own (break before
 * make). A subsession is named by its neighbours (as everywhere in the
 * model) and a generation, the address part a rebind changes: sgL / sgR,
 * the generation of each side's subsession at each agent: 0 for the
 * initial subsessions and for those a reconfiguration sets up, RBADDR once
 * the mover's end is at its new address.
 * The mover (its rebindOut): rbOn (s.rebind != nil), rbReq (the
 * attempt's Req: attempts so far, at most RBTRIES), rbPeer (the
 * neighbour), rbOld (the old subsession), rbTries, rbLost0 (losses before
 * the attempt), rbDrop (a copy or answer of it dropped at a full queue),
 * rbRej (copies of it the neighbour rejected without an answer); the last
 * attempt's result: rbOut, rbRs (RebindResult), rbEnds (results emitted),
 * rbGULoss (it gave up after its own losses). Its
 * subsessions kept for Linger (s.moved): mOld (the old one after a
 * switch, from mOldPeer), mGU (the new one after a give-up, from mGUpeer;
 * mGUmask: the attempts that gave up on it; mGUold: the old one it may
 * still follow).
 * The neighbour: rbBound (s.rebound: the last rebind it accepted), rfReq,
 * rfRs (s.refused: the last it refused, and why), mvSub, mvSide, mvPeer
 * (the old subsession it keeps for Linger).
 * TCP segments carry the generation of the subsession they are sent on
 * in their req field (PTAG); the receiver asserts that it has an ingress
 * flow for it (RBIN). Configurations without REBIND keep none of these
 * variables. */
#ifdef REBIND
#if defined(UDP)
#error "-DUDP: no rebind configuration"
#endif
#define RBADDR 1
byte sgL[NA], sgR[NA];
bool rbOn, rbGULoss, rbDrop;
byte rbReq, rbPeer, rbOld, rbTries, rbLost0, rbRej, rbOut, rbRs, rbEnds;
byte mOld = NONE, mOldPeer, mGU = NONE, mGUpeer, mGUold, mGUmask;
byte rbBound[NA], rfReq[NA], rfRs[NA], mvSub[NA], mvSide[NA], mvPeer[NA];
#define SG(i, sd) (sd == LEFT -> sgL[i] : sgR[i])
/* the generation a segment to neighbour nb carries: that side's subsession
 * (a new path of a reconfiguration: 0) */
#define PTAG(nb) (nb == leftN[me] -> sgL[me] : (nb == rightN[me] -> sgR[me] : 0))
/* agent i has an ingress flow for subsession g of side sd from agent f:
 * the side's own; at the mover, the new one it listens on, the old one
 * after a switch, the new one after a give-up; at the neighbour, the old
 * one after MoveAll (each until Linger) */
#define RBIN(i, sd, f, g) (g == SG(i, sd) || \
	(i == RBMOVER && sd == RBSIDE && ((rbOn && f == rbPeer && g == RBADDR) || \
	 (mOld != NONE && f == mOldPeer && g == mOld) || (mGU != NONE && f == mGUpeer && g == mGU))) || \
	(mvSub[i] != NONE && mvSide[i] == sd && f == mvPeer[i] && g == mvSub[i]))
/* agent i keeps a subsession for Linger */
#define MVAT(i) (i < NA && (mvSub[i] != NONE || (i == RBMOVER && (mOld != NONE || mGU != NONE))))
#define RBQUIET (!MVAT(0) && !MVAT(1) && !MVAT(2) && !MVAT(3))
#else
#define PTAG(nb) 0
#define RBQUIET true
#endif

#include "tcp.pml"
#include "agent.pml"

inline setup() {
	CHAIN; REQS; APPD; DEAD;
#ifdef MIGRATE
	hasState[MOLD] = 1;
#endif
	i = 0;
	do
	:: i < NA -> leftN[i] = NONE; rightN[i] = NONE; newN[i] = NONE; lingerN[i] = NONE; oldN[i] = NONE; i++
	:: else -> break
	od;
	i = 0;
	do
	:: i < NA*(NR+1) -> tombN[i] = NONE; i++
	:: else -> break
	od;
#ifdef REBIND
	i = 0;
	do
	:: i < NA -> mvSub[i] = NONE; i++
	:: else -> break
	od;
#endif
	i = 0;
	do
	:: i < NC -> TDR = TDR + appR[chain[i]]; TDL = TDL + appL[chain[i]]; i++
	:: else -> break
	od;
	/* initial marks (the handshake): ISNs 0 at the hosts, moved by the
	 * AppDeltas of the middleboxes passed */
	i = 0; j = 0; k = TDL;   /* j: L->R before chain[i], k: R->L at chain[i]'s left */
	do
	:: i < NC ->
		a = chain[i]; orig[a] = 1;
		if :: i > 0 -> leftN[a] = chain[i-1] :: else fi;
		if :: i < NC-1 -> rightN[a] = chain[i+1] :: else fi;
		sndNxt[M(a, LEFT)] = k; ackRcvd[M(a, LEFT)] = k;
		rcvNxt[M(a, LEFT)] = j; ackSent[M(a, LEFT)] = j;
		j = j + appR[a]; k = k - appL[a];
		sndNxt[M(a, RIGHT)] = j; ackRcvd[M(a, RIGHT)] = j;
		rcvNxt[M(a, RIGHT)] = k; ackSent[M(a, RIGHT)] = k;
		i++
	:: else -> break
	od;
	hRcvNxt[0] = TDL; hRcvNxt[1] = TDR
}

/* no timer can fire any more: no sender about to give up, no anchor
 * waiting for the other's fin (its probe timer is due), no moved
 * subsession waiting for its Linger (RBQUIET), no lease to expire (leases
 * run only after a sender gave up, agent.pml) */
#define LEASEAT(i) (i < NA && LEASE(i))
#define QUIET (NOGIVEUPDUE && NOWAITFIN && RBQUIET && (gaveUp == 0 || !(LEASEAT(0) || LEASEAT(1) || LEASEAT(2) || LEASEAT(3) || LEASEAT(4) || LEASEAT(5))))

inline finalCheck() {
	i = 0;
	do
	:: i < NA ->
		assert(len(net[i]) == 0);
		/* every lock back to unlocked, no queue, no two-path state */
		assert(qreq[i] == 0);
		/* (oLock: the old path's session set aside at a rejoined middle is done) */
		assert(lock[i] == unlocked && busyRA[i] == 0 && !tp[i] && newN[i] == NONE && !oLock[OX(i)]);
		i++
	:: else -> break
	od;
#ifdef UDP
	/* no datagram lost: each arrived at the other host once (udp.pml) */
	assert(hRcvd[0] == (1 << NDL) - 1 && hRcvd[1] == (1 << NDR) - 1 && dgOld == 0);
#else
	/* no data lost: every byte (and FIN) arrived, everything acknowledged */
	assert(hRcvNxt[0] == TDL + NDL + FINS && hRcvNxt[1] == TDR + NDR + FINS);
	assert(hSndUna[0] == hSndNxt[0] && hSndUna[1] == hSndNxt[1]);
#endif
	/* every request answered, no cancel job left, no loss beyond LOSS */
	assert(nlost <= LOSS);
#ifdef TRIGGER
	/* the trigger: its sender has one final answer (or gave up after
	 * MAXTRIES), which is the result of the one request it started */
	assert(!trigPend && trigFinal <= 1 && trigStarted <= 1);
	assert(trigFinal == 1 || gaveUp > 0);
	assert(!trigTaken || (trigAns != 0 && trigStarted == 1));
	assert(trigFinal == 0 || (trigGot == outcome[TRIGR] && trigGotRs == reason[TRIGR]));
#define TRIGNONE(i) (i == TRIGR && !trigTaken && gaveUp > 0)
#else
#define TRIGNONE(i) false
#endif
#ifdef MIGRATE
	/* every hold released, the state imported at most once; a success
	 * moved the state to the new middlebox, a failure left the session
	 * on the old path with the old middlebox's state (and none at the new
	 * one, unless a loss kept the new path's cancelLock from it) */
	i = 0;
	do
	:: i < NA -> assert(!holdL[i] && !ackOwed[i]); i++
	:: else -> break
	od;
	assert(nImport <= 1);
	if
	:: outcome[1] == Succeeded -> assert(hasState[MNEW] && exported && !migAborted && rightN[0] == MNEW)
	:: else ->
		assert(outcome[1] == Failed && rightN[0] == MOLD && leftN[3] == MOLD && hasState[MOLD]);
		assert(!hasState[MNEW] || nlost > 0)
	fi;
#endif
#ifdef REBIND
	/* every attempt ended once; nothing of a rebind is left: none runs at
	 * the mover (its lock is checked above), no subsession kept for
	 * Linger; the agent stopped asking because the side is on the new
	 * address or it has asked RBTRIES times */
	assert(rbReq >= 1 && !rbOn && rbEnds == rbReq && RBQUIET);
	assert(SG(RBMOVER, RBSIDE) == RBADDR || rbReq == RBTRIES);
	/* the last attempt's result: Succeeded; Refused only by a
	 * reconfiguration holding the side (busy, or the mover's lock); Failed
	 * only by a timeout, after a loss, a copy the neighbour rejected, or
	 * (RB_SLOW) a slow answer */
	assert(rbOut == Succeeded || (rbOut == Refused && RBCONTEND && (rbRs == ReasonBusy || rbRs == ReasonLocked)) ||
	       (rbOut == Failed && rbRs == ReasonTimeout && (nlost + ndrop > 0 || rbRej > 0 || RBFIRE)));
	assert(rbOut == Succeeded || LOSS > 0 || RBCONTEND || RBFIRE);
	/* both ends of every subsession of the chain agree on it (k: the
	 * subsessions they do not agree on) */
	a = 0; k = 0;
	do
	:: a != LAST ->
		j = rightN[a];
		if
		:: sgR[a] != sgL[j] -> k++
		:: else
		fi;
		a = j
	:: else -> break
	od;
	/* except when the last attempt gave up after its own copies or their
	 * answers were lost (as many as a give-up takes), every attempt's
	 * answers lost: the neighbour is on the new subsession, the mover on
	 * the old (the agent goes on asking, docs/mobility.md) */
	assert(k == 0 || (k == 1 && rbOut == Failed && rbGULoss && SG(rbPeer, 1 - RBSIDE) == RBADDR &&
	                  SG(RBMOVER, RBSIDE) == rbOld));
#endif
#ifndef NOREQ
	i = 1;
	do
	:: i <= NR ->
		assert((stageL[i] == done || TRIGNONE(i)) && (stageR[i] == 0 || stageR[i] == done));
		assert(!canJob[i]);
		assert(unconf[i] == 0 || gaveUp > 0);
		i++
	:: else -> break
	od;
#endif
	if
	:: gaveUp == 0 ->
#if defined(CANCEL)
		assert(outcome[1] == Failed && reason[1] == ReasonSetupFailed);
#elif (defined(ONPATH_SAME) || defined(ONPATH_SAME2)) && MAXLIST > 1
		/* the new chain is the old segment: nothing changed, nothing joined */
		assert(outcome[1] == Succeeded && unchanged[1] && !joinedAny);
#elif defined(ONPATH_SAME2)
		/* the same with a partial list: the left anchor goes on, the
		 * first hop of the new chain, on the old path, refuses */
		assert(outcome[1] == Refused && reason[1] == ReasonOnPath && refHop[1] == 1 && !joinedAny);
#elif defined(ONPATH_CROSS) || defined(ONPATH_OUTSIDE)
		assert(outcome[1] == Refused && reason[1] == ReasonOnPath && refHop[1] == 1 && !joinedAny);
#elif defined(ONPATH_REORDER)
		assert(outcome[1] == Refused && reason[1] == ReasonOnPath && refHop[1] == 2 && !joinedAny);
#elif defined(ONPATH_OUTSIDE2)
		/* 3 joined before 1 refused; the check below wants it gone */
		assert(outcome[1] == Refused && reason[1] == ReasonOnPath && refHop[1] == 1 && joinedAny);
#elif defined(ONPATH_NONE)
		assert(outcome[1] == Succeeded && unchanged[1]);
#elif defined(REJOIN)
		/* the delete succeeds; the insert of its middlebox elsewhere
		 * succeeds, or is refused by it while it is still on the old path */
		assert(outcome[1] == Succeeded && !unchanged[1]);
		assert(outcome[2] == Succeeded || (outcome[2] == Refused && reason[2] == ReasonOnPath && refHop[2] == 1));
#elif JOINFAIL > 0
		assert(outcome[1] == Succeeded || (outcome[1] == Failed && reason[1] == ReasonSetupFailed && joinFails > 0));
#elif defined(MIGRATE)
		/* without a give-up only a failed export or import aborts */
		assert(outcome[1] == Succeeded || (outcome[1] == Failed && reason[1] == ReasonAborted && migFails > 0));
#elif defined(NOREQ)
		skip   /* no reconfiguration (a rebind alone) */
#elif defined(REBIND_CONTEND)
		/* the delete succeeds, or the right anchor refuses it while its
		 * left subsession moves */
		assert(outcome[1] == Succeeded || (outcome[1] == Refused && reason[1] == ReasonBusy));
#elif defined(REBIND_CONTEND_RIGHT)
		/* the delete succeeds, or its left anchor refuses it while the
		 * rebind holds its lock */
		assert(outcome[1] == Succeeded || (outcome[1] == Refused && reason[1] == ReasonLocked));
#elif defined(CONTEND)
		/* exactly one of the contending requests succeeds (once one has
		 * succeeded the other's segment no longer exists) */
		assert((outcome[1] == Succeeded) != (outcome[2] == Succeeded));
#elif NR == 2
		/* at least one succeeds; both only one after the other (mutual
		 * exclusion is asserted when a request takes its segment) */
		assert(outcome[1] == Succeeded || outcome[2] == Succeeded);
#else
		assert(outcome[1] == Succeeded);
#endif
	:: else ->
		/* a sender gave up after MAXTRIES lost transmissions: a request
		 * may fail (timeout: no answer to requestLock; setupFailed: none
		 * to the SYN), never with another reason */
		i = 1;
		do
		:: i <= NR ->
			assert(outcome[i] == Succeeded || (outcome[i] == Refused && NR == 2) ||
			       (outcome[i] == Refused && reason[i] == ReasonOnPath) ||
			       (outcome[i] == Failed && (reason[i] == ReasonTimeout || reason[i] == ReasonSetupFailed)) ||
			       (outcome[i] == Failed && reason[i] == ReasonAborted && MIGABORTS) || TRIGNONE(i) ||
			       (outcome[i] == Refused && RBCONTEND) || NOREQS);
			i++
		:: else -> break
		od;
#if defined(CONTEND)
		assert(!(outcome[1] == Succeeded && outcome[2] == Succeeded));
#endif
		skip
	fi;
	/* the chain is consistent from host to host, and no freed agent is on it */
	a = 0; i = 0;
	do
	:: a != LAST ->
		j = rightN[a];
		assert(i < NA && j != NONE && !freed[a]);
		assert(leftN[j] == a);
		a = j; i++
	:: else -> break
	od;
#if defined(ONPATH_CHECKS)
	/* a host that joined a new path is on the chain, or has left it
	 * (refused further on, JoinFailed, the new path's cancelLock) */
	if
	:: nlost == 0 ->
		i = 1;
		do
		:: i < LAST ->
			a = 0;
			do
			:: a != LAST && a != i -> a = rightN[a]
			:: else -> break
			od;
			assert(a == i || joinReq[i] == 0 || freed[i] || (leftN[i] == NONE && rightN[i] == NONE));
			i++
		:: else -> break
		od
	:: else
	fi;
#endif
	/* the new path is the one requested */
	i = 1;
	do
	:: i <= NR ->
		if
		:: outcome[i] == Succeeded && !freed[la[i]] ->
			if
			:: nh[i] == 0 -> assert(rightN[la[i]] == ra[i])
			:: nh[i] == 1 -> assert(rightN[la[i]] == hop[2*i] && rightN[hop[2*i]] == ra[i])
			:: nh[i] == 2 -> assert(rightN[la[i]] == hop[2*i] && rightN[hop[2*i]] == hop[2*i+1] && rightN[hop[2*i+1]] == ra[i])
			fi
		:: else
		fi;
		i++
	:: else -> break
	od
}

init {
	byte i, j, k, a;
	atomic {
		setup();
		i = 0;
		do
		:: i < NA -> run agent(i); i++
		:: else -> break
		od
	}
	/* quiescence: everything is finished */
	(timeout && QUIET);
	finalCheck()
}
