/*
 * Configurations: an initial chain and the reconfigurations attempted.
 * Agent 0 is the left end host (client), agent NA-1 the right one (server).
 * Each request r (1..NR) has a left anchor la[r], a right anchor ra[r] and
 * the middleboxes of its new path hop[r][0..nh[r]-1].
 *
 *   DELETE        0-1-2,   r1: 0 deletes 1 (0→2, new path [])
 *   INSERT        0-2,     r1: 0 inserts 1 (0→2, [1])
 *   REPLACE       0-1-3,   r1: 0 replaces 1 by 2 (0→3, [2])
 *   DELETE_DELTA  0-1-2,   as DELETE, middlebox 1 has AppDelta right +1, left +2
 *   CONTEND       0-1-2-3, r1: 0 deletes 1 (0→2); r2: 1 deletes 2 (1→3), concurrently
 *   CONTEND_SAME  0-1-2-3, r1: 0 deletes 1 and 2 (0→3); r2: 1 deletes 2 (1→3), same right anchor
 *   CONTEND_NESTED 0-1-3-4, r1: 0 deletes 1 and 3 (0→4); r2: 1 inserts 2 (1→3, [2]): r2's
 *                 segment lies inside r1's, both of its anchors are r1's middleboxes
 *   DELETE2       0-1-2-3, r1: 0 deletes 1 and 2 (0→3, new path [])
 *   CANCEL        0-2,     r1: 0 inserts 1, 1 is dead: SYN unanswered, cancelLock/ackCancel
 *   CANCEL_REPLACE 0-1-3,  r1: 0 replaces 1 by 2, 2 is dead: the cancelLock passes middlebox 1
 *   INSERT2       0-3,     r1: 0 inserts 1 and 2 (0→3, [1,2])
 *   REPLACE2BY1   0-1-2-4, r1: 0 replaces 1,2 by 3 (0→4, [3]), deltas on 1 and 2
 *   INSERT_RIGHT  0-1-3,   r1: 1 inserts 2 right of middlebox 1 (1→3, [2]), delta on 1
 *
 *   TRIGGER       0-1-2,   middlebox 1, a proxy (AppDelta right +1, left +2), splices:
 *                 it triggers 0 to delete it (r1: 0→2, new path []); 1 sends the
 *                 trigger, 0 starts r1 and answers with its result (trigger.go)
 *   MIGRATE       0-1-3,   r1: 0 replaces 1 by 2 and moves 1's state to 2 (migrate.go),
 *                 loss-free (nothing held); with -DMIG_ORDER order-preserving: both
 *                 anchors hold, the old path drains before the export. The export
 *                 or the import may fail (one of them, chosen nondeterministically):
 *                 the new path is cancelled (§3.6)
 *
 * A host on both paths (message version 3; docs/verification.md, "A
 * middlebox on both paths: the model"):
 *   ONPATH_SAME   0-1-2,   r1: 0 replaces 0..2 by [1], the segment it has: unchanged
 *   ONPATH_SAME2  0-1-2-3, r1: 0 replaces 0..3 by [1,2], the segment it has: unchanged
 *                 (with -DMAXLIST=1 the ackLock's list is partial: 1 refuses the SYN)
 *   ONPATH_CROSS  0-1-3,   r1: 0 replaces 0..3 by [1,2]: 1 is on the old segment, refused
 *   ONPATH_REORDER 0-1-2-3, r1: 0 replaces 0..3 by [2,1]: refused (2 named first)
 *   ONPATH_OUTSIDE 0-1-2-3, r1: 2 inserts 1 between 2 and 3 (2→3, [1]): 1 carries the
 *                 session outside the segment and refuses the SYN
 *   ONPATH_OUTSIDE2 0-1-2-4, r1: 2 inserts [3,1] between 2 and 4: 3 joins, 1 refuses,
 *                 3 passes the refusal on and leaves
 *   ONPATH_NONE   0-2,     r1: 0 deletes nothing (0→2, []): unchanged at once
 *   REJOIN        0-1-2-3-4, r1: 0 deletes 1 (0→2); r2, once r1 has its result: 3
 *                 inserts 1 between 3 and 4 (3→4, [1]), while r1's fins or finAcks may
 *                 still cross 1; with REJOIN_ANY r2 comes at any moment
 *   -DJOINFAIL=1  the datapath may refuse one JoinSession (JoinFailed)
 *
 * Rebinds (break before make, rebind.go; docs/verification.md, "Rebinds"):
 *   REBIND_RIGHT  0-1-2,   no reconfiguration; 0 rebinds its right subsession (to 1)
 *   REBIND_LEFT   0-1-2,   no reconfiguration; 2 rebinds its left subsession (to 1)
 *   REBIND_CONTEND 0-1-2,  r1: 0 deletes 1 (0→2); 2 rebinds its left subsession,
 *                 concurrently (to 1, or to 0 once r1 has completed at 2)
 *   REBIND_CONTEND_RIGHT 0-1-2, r1: 0 deletes 1 (0→2); 0 rebinds its right
 *                 subsession, concurrently (to 1, or to 2 once r1 has completed at 0)
 *   -DRBTRIES=N   the agent asks for the rebind up to N times (default 2: once
 *                 more after a refusal or a give-up)
 *   -DRB_SLOW     answers may be slower than the mover's timer: it retransmits,
 *                 and gives up after its last try, with no loss
 *
 * Loss (agent.pml): -DLOSS=N lets the network lose up to N control
 * messages per run (default 0); -DMAXTRIES=N transmissions before a sender
 * gives up (default 2: one retransmission).
 *
 * Data: NDR bytes left to right, NDL right to left (1 sequence number
 * each, one segment per byte); with FINS each host closes (TCP FIN) at a
 * nondeterministic moment after its data, so FINs fall in every phase.
 *
 * -DUDP (with a configuration whose anchors are end hosts or middleboxes,
 * no deltas, no FINS, no MIGRATE): a UDP session, NDR and NDL datagrams
 * each way, the two-path phase for datagrams (udp.pml); with
 * -DBROKEN_UDP_NO_QUIET an anchor ends its side at its switch.
 */

#ifndef NDR
#define NDR 1
#endif
#ifndef NDL
#define NDL 1
#endif
#ifndef QS
#define QS 8
#endif
/* Each channel holds QS + TCPQ messages: control messages fill at most
 * QS places (with loss, a control message finding QS queued is dropped,
 * agent.pml ctl); the TCPQ more are kept for TCP segments, which are never
 * dropped (the model has no TCP retransmission; tcp.pml put asserts
 * room). */
#ifndef TCPQ
#define TCPQ 2
#endif
#ifndef MAXTRIES
#define MAXTRIES 2
#endif

#if defined(DELETE) || defined(DELETE_DELTA)
#define NA 3
#define NR 1
#define NC 3
#define CHAIN chain[0]=0; chain[1]=1; chain[2]=2
#define REQS la[1]=0; ra[1]=2; nh[1]=0
#ifdef DELETE_DELTA
#define APPD appR[1]=1; appL[1]=2
#endif
#endif

#ifdef TRIGGER
#define NA 3
#define NR 1
#define NC 3
#define CHAIN chain[0]=0; chain[1]=1; chain[2]=2
#define REQS la[1]=0; ra[1]=2; nh[1]=0
#define APPD appR[1]=1; appL[1]=2
#define TRIGGERER 1
#define TRIGR 1
#endif

#ifdef MIGRATE
#define NA 4
#define NR 1
#define NC 3
#define CHAIN chain[0]=0; chain[1]=1; chain[2]=3
#define REQS la[1]=0; ra[1]=3; nh[1]=1; hop[2]=2
#define MOLD 1
#define MNEW 2
#endif

#ifdef INSERT
#define NA 3
#define NR 1
#define NC 2
#define CHAIN chain[0]=0; chain[1]=2
#define REQS la[1]=0; ra[1]=2; nh[1]=1; hop[2]=1
#endif

#if defined(CANCEL) && !defined(CANCEL_REPLACE)
#define NA 3
#define NR 1
#define NC 2
#define CHAIN chain[0]=0; chain[1]=2
#define REQS la[1]=0; ra[1]=2; nh[1]=1; hop[2]=1
#define DEAD dead[1]=1
#endif

#ifdef CANCEL_REPLACE
#define CANCEL
#define NA 4
#define NR 1
#define NC 3
#define CHAIN chain[0]=0; chain[1]=1; chain[2]=3
#define REQS la[1]=0; ra[1]=3; nh[1]=1; hop[2]=2
#define DEAD dead[2]=1
#endif

#if defined(REPLACE)
#define NA 4
#define NR 1
#define NC 3
#define CHAIN chain[0]=0; chain[1]=1; chain[2]=3
#define REQS la[1]=0; ra[1]=3; nh[1]=1; hop[2]=2
#endif

#ifdef INSERT2
#define NA 4
#define NR 1
#define NC 2
#define CHAIN chain[0]=0; chain[1]=3
#define REQS la[1]=0; ra[1]=3; nh[1]=2; hop[2]=1; hop[3]=2
#endif

#ifdef REPLACE2BY1
#define NA 5
#define NR 1
#define NC 4
#define CHAIN chain[0]=0; chain[1]=1; chain[2]=2; chain[3]=4
#define REQS la[1]=0; ra[1]=4; nh[1]=1; hop[2]=3
#define APPD appR[1]=1; appL[2]=1
#endif

#ifdef INSERT_RIGHT
#define NA 4
#define NR 1
#define NC 3
#define CHAIN chain[0]=0; chain[1]=1; chain[2]=3
#define REQS la[1]=1; ra[1]=3; nh[1]=1; hop[2]=2
#define APPD appR[1]=1; appL[1]=1
#endif

#if defined(CONTEND) || defined(CONTEND_SAME)
#define NA 4
#define NR 2
#define NC 4
#define CHAIN chain[0]=0; chain[1]=1; chain[2]=2; chain[3]=3
#ifdef CONTEND
#define REQS la[1]=0; ra[1]=2; nh[1]=0; la[2]=1; ra[2]=3; nh[2]=0
#else
#define REQS la[1]=0; ra[1]=3; nh[1]=0; la[2]=1; ra[2]=3; nh[2]=0
#endif
#endif

#ifdef DELETE2
#define NA 4
#define NR 1
#define NC 4
#define CHAIN chain[0]=0; chain[1]=1; chain[2]=2; chain[3]=3
#define REQS la[1]=0; ra[1]=3; nh[1]=0
#endif

#ifdef CONTEND_NESTED
#define NA 5
#define NR 2
#define NC 4
#define CHAIN chain[0]=0; chain[1]=1; chain[2]=3; chain[3]=4
#define REQS la[1]=0; ra[1]=4; nh[1]=0; la[2]=1; ra[2]=3; nh[2]=1; hop[4]=2
#endif

#ifdef ONPATH_SAME
#define ONPATH_CHECKS
#define NA 3
#define NR 1
#define NC 3
#define CHAIN chain[0]=0; chain[1]=1; chain[2]=2
#define REQS la[1]=0; ra[1]=2; nh[1]=1; hop[2]=1
#endif

#ifdef ONPATH_SAME2
#define ONPATH_CHECKS
#define NA 4
#define NR 1
#define NC 4
#define CHAIN chain[0]=0; chain[1]=1; chain[2]=2; chain[3]=3
#define REQS la[1]=0; ra[1]=3; nh[1]=2; hop[2]=1; hop[3]=2
#endif

#ifdef ONPATH_CROSS
#define ONPATH_CHECKS
#define NA 4
#define NR 1
#define NC 3
#define CHAIN chain[0]=0; chain[1]=1; chain[2]=3
#define REQS la[1]=0; ra[1]=3; nh[1]=2; hop[2]=1; hop[3]=2
#endif

#ifdef ONPATH_REORDER
#define ONPATH_CHECKS
#define NA 4
#define NR 1
#define NC 4
#define CHAIN chain[0]=0; chain[1]=1; chain[2]=2; chain[3]=3
#define REQS la[1]=0; ra[1]=3; nh[1]=2; hop[2]=2; hop[3]=1
#endif

#ifdef ONPATH_OUTSIDE
#define ONPATH_CHECKS
#define NA 4
#define NR 1
#define NC 4
#define CHAIN chain[0]=0; chain[1]=1; chain[2]=2; chain[3]=3
#define REQS la[1]=2; ra[1]=3; nh[1]=1; hop[2]=1
#endif

#ifdef ONPATH_OUTSIDE2
#define ONPATH_CHECKS
#define NA 5
#define NR 1
#define NC 4
#define CHAIN chain[0]=0; chain[1]=1; chain[2]=2; chain[3]=4
#define REQS la[1]=2; ra[1]=4; nh[1]=2; hop[2]=3; hop[3]=1
#endif

#ifdef ONPATH_NONE
#define ONPATH_CHECKS
#define NA 3
#define NR 1
#define NC 2
#define CHAIN chain[0]=0; chain[1]=2
#define REQS la[1]=0; ra[1]=2; nh[1]=0
#endif

#ifdef REJOIN
#define ONPATH_CHECKS
#define NA 5
#define NR 2
#define NC 5
#define CHAIN chain[0]=0; chain[1]=1; chain[2]=2; chain[3]=3; chain[4]=4
#define REQS la[1]=0; ra[1]=2; nh[1]=0; la[2]=3; ra[2]=4; nh[2]=1; hop[4]=1
/* the two segments are disjoint: both requests may hold theirs at once */
#define DISJOINT 1
#ifndef REJOIN_ANY
/* r2 is asked for once r1 has its result (the operator's sequence) */
#define AFTER1 (stageL[1] == done)
#endif
#endif

#if JOINFAIL > 0
#define ONPATH_CHECKS
#endif

#if defined(REBIND_RIGHT) || defined(REBIND_LEFT)
#define REBIND
#define NOREQ
#define NA 3
#define NR 1
#define NC 3
#define CHAIN chain[0]=0; chain[1]=1; chain[2]=2
/* request 1 is never asked for (NOREQ): the arrays keep one slot */
#define REQS la[1]=0; ra[1]=2; nh[1]=0
#endif

#if defined(REBIND_CONTEND) || defined(REBIND_CONTEND_RIGHT)
#define REBIND
#define RBCONTEND 1
#define NA 3
#define NR 1
#define NC 3
#define CHAIN chain[0]=0; chain[1]=1; chain[2]=2
#define REQS la[1]=0; ra[1]=2; nh[1]=0
#endif

/* the mover and the side it moves */
#if defined(REBIND_RIGHT) || defined(REBIND_CONTEND_RIGHT)
#define RBMOVER 0
#define RBSIDE RIGHT
#endif
#if defined(REBIND_LEFT) || defined(REBIND_CONTEND)
#define RBMOVER LAST
#define RBSIDE LEFT
#endif

#ifndef AFTER1
#define AFTER1 1
#endif
#ifndef DISJOINT
#define DISJOINT 0
#endif
#ifndef RBCONTEND
#define RBCONTEND 0
#endif
#ifndef RBTRIES
#define RBTRIES 2
#endif
#ifdef NOREQ
#define NOREQS true
#else
#define NOREQS false
#endif

#ifndef NA
#error "choose a configuration: -DDELETE, -DINSERT, -DREPLACE, ..."
#endif
#if defined(UDP) && (FINS || defined(MIGRATE) || defined(APPD))
#error "-DUDP: no FINS, MIGRATE or AppDeltas (datagrams have no sequence numbers)"
#endif
#ifndef APPD
#define APPD skip
#endif
#ifndef DEAD
#define DEAD skip
#endif

byte chain[NC];
byte la[NR+1], ra[NR+1], nh[NR+1];
byte hop[2*NR+2];               /* hop[2r+i]: i-th middlebox of r's new path */
byte TDR, TDL;                  /* end-to-end deltas, constant across reconfigurations */
