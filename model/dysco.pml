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

/* MsgTypes (message.go), in the Go order. */
mtype = { requestLock, ackLock, nackLock, cancelLock, ackCancel, syn, synAck, ack, fin, finAck };
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
#define ReasonSetupFailed 7

/* Outcomes (types.go). */
#define Succeeded 1
#define Refused   2
#define Failed    3

#define NONE 255
#define LEFT 0
#define RIGHT 1
#define LAST (NA-1)

typedef Msg { mtype t; byte from; byte req; byte x; byte s; byte a; byte st; byte at };

chan net[NA] = [QS] of { mtype, byte, byte, byte, byte, byte, byte, byte };

/* ---- agent state (one session per agent) ---- */
byte leftN[NA], rightN[NA];     /* neighbours of the left and right sides */
byte sdL[NA], sdR[NA];          /* subsession deltas (ingress seq +, egress ack -) */
byte appR[NA], appL[NA];        /* AppDelta.Right / AppDelta.Left */
bool freed[NA];                 /* FreeSession done (middle left the path) */
bool orig[NA];                  /* on the initial chain */
bool dead[NA];                  /* host never answers (new path failure) */

mtype lock[NA] = unlocked;      /* lock of the subsession to the right */
byte requestor[NA];             /* request holding / pending the lock */
byte qreq[NA], qdelta[NA], qfrom[NA]; /* the blocked-request queue (one slot) */
byte reqFrom[NA];               /* where the pending requestLock came from */
byte busyRA[NA];                /* right anchor of an unfinished reconfiguration */

/* two-path state of an anchor (twopath.go TwoPath), on side tpSide */
bool tp[NA];
byte tpReq[NA], laReq[NA];      /* request of the two-path phase / of the left anchor */
byte tpSide[NA], oldN[NA], newN[NA], dNew[NA];
byte oldSent[NA], oldRcvd[NA], oldSentAcked[NA], oldRcvdAcked[NA], firstNewRcvd[NA];
bool newRcvd[NA];
bool finSent[NA], finAcked[NA], answered[NA], haveCut[NA];
byte cutoff[NA];
byte lingerN[NA], lingerD[NA];  /* old subsession kept after completion */
byte finPassed[NA];             /* middles: fin-acks seen (bit 0 rightward, bit 1 leftward) */

/* marks of each side (twopath.go Marks), session space */
byte sndNxt[2*NA], ackSent[2*NA], rcvNxt[2*NA], ackRcvd[2*NA];
/* highest L->R / R->L sequence end a middle has forwarded (ack check) */
byte fwdR[NA], fwdL[NA];

/* ---- per request ---- */
mtype stageL[NR+1], stageR[NR+1];
byte rightDelta[NR+1], leftDelta[NR+1];
byte outcome[NR+1], reason[NR+1];
byte synTries[NR+1];
bool held[NR+1];                /* the request holds its segment (locked to completion) */

/* ---- end hosts ---- */
byte hSndNxt[2], hSndUna[2], hRcvNxt[2], hRcvd[2];
bool hFinSent[2], hFinRcvd[2];

#ifndef FINS
#define FINS 0
#endif

#include "tcp.pml"
#include "agent.pml"

inline setup() {
	CHAIN; REQS; APPD; DEAD;
	i = 0;
	do
	:: i < NA -> leftN[i] = NONE; rightN[i] = NONE; newN[i] = NONE; lingerN[i] = NONE; oldN[i] = NONE; i++
	:: else -> break
	od;
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

#define QUIET (stageL[1] != settingUp && stageL[NR] != settingUp)

inline finalCheck() {
	i = 0;
	do
	:: i < NA ->
		assert(len(net[i]) == 0);
		/* every lock back to unlocked, no queue, no two-path state */
		assert(lock[i] == unlocked && qreq[i] == 0 && busyRA[i] == 0 && !tp[i] && newN[i] == NONE);
		i++
	:: else -> break
	od;
	/* no data lost: every byte (and FIN) arrived, everything acknowledged */
	assert(hRcvNxt[0] == TDL + NDL + FINS && hRcvNxt[1] == TDR + NDR + FINS);
	assert(hSndUna[0] == hSndNxt[0] && hSndUna[1] == hSndNxt[1]);
	/* every request answered */
	i = 1;
	do
	:: i <= NR -> assert(stageL[i] == done && (stageR[i] == 0 || stageR[i] == done)); i++
	:: else -> break
	od;
#if defined(CANCEL)
	assert(outcome[1] == Failed && reason[1] == ReasonSetupFailed);
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
	/* the chain is consistent from host to host, and no freed agent is on it */
	a = 0; i = 0;
	do
	:: a != LAST ->
		assert(i < NA && rightN[a] != NONE && leftN[rightN[a]] == a && !freed[a]);
		a = rightN[a]; i++
	:: else -> break
	od;
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
