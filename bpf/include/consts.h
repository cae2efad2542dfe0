/* SPDX-License-Identifier: (GPL-2.0-only OR MIT) */
/* Constants of the Dysco datapath. Sizes are overridable at build time. */
#ifndef DYSCO_CONSTS_H
#define DYSCO_CONSTS_H

#include "wire_gen.h"

#ifndef MAX_FLOWS
#define MAX_FLOWS 524288 /* four flows per session on a middlebox host */
#endif
#ifndef MAX_SESSIONS
#define MAX_SESSIONS 131072
#endif
#ifndef MAX_POLICIES
#define MAX_POLICIES 64
#endif
#ifndef MAX_TYPES
#define MAX_TYPES 64
#endif
/* Policy slots and middlebox types come in POLICY_BANKS banks of
 * MAX_POLICIES and MAX_TYPES: the agent writes a new policy set into the
 * bank the installed classifier does not refer to, then swaps in the
 * classifier that does (one program-array update), so that a set is in force
 * whole or not at all. Slot b*MAX_POLICIES+i is policy i of bank b. */
#define POLICY_BANKS 2
#ifndef MAX_INSTANCES
#define MAX_INSTANCES 16
#endif
/* Local sources a policy spreads its sessions over, per family
 * (dysco_policy_src); an address given k times has weight k. */
#define MAX_POLICY_SRC 8 /* a power of two (syn.h masks an index with it) */
#ifndef MAX_LOCAL_ADDRS
#define MAX_LOCAL_ADDRS 256
#endif
/* Session addresses of a host (dysco_locator): a few, one per family is
 * the common case. */
#ifndef MAX_SESSION_ADDRS
#define MAX_SESSION_ADDRS 16
#endif
#ifndef MAX_DELTAS
#define MAX_DELTAS 65536
#endif

#ifndef HALF_OPEN_SOURCES
#define HALF_OPEN_SOURCES 16384 /* sources with a half-open budget (dysco_halfopen) */
#endif
/* Slots of dysco_keys (admit.h). */
#define KEY_SYN_CUR 0  /* signs SYN blocks, verifies them */
#define KEY_SYN_PREV 1 /* verifies them (the key before a rotation) */
#define KEY_NONCE 2    /* makes session nonces */
#define KEY_SLOTS 3

#ifndef MAX_TWOPATH
#define MAX_TWOPATH 16384 /* sides with a new subsession (reconfigured sessions) */
#endif
/* Session ids double as the 24-bit local tag of SYNs inside a middlebox host
 * (paper §4.2 "Tagging SYN packets"), so they stay below 2^24. */
#define SESS_ID_MASK 0xffffff
/* Attempts to find a free session id or a free pair of subsession ports. */
#define ALLOC_TRIES 4

/* Slots of the dysco_progs program array. */
#define PROG_POLICY 0 /* generated from the policies' tcpdump filters */
#define PROG_SETUP 1  /* dysco_setup: SYN handling on egress */
#define PROG_UDP_SETUP 2   /* dysco_udp_setup: UDP set-up on egress */
#define PROG_UDP_INGRESS 3 /* dysco_udp_ingress: datagrams with a block on ingress */
#define PROG_UDP6_SUM 4    /* dysco_udp6_sum: an IPv6 datagram without a checksum (udp.h) */
#define PROG_SLOTS 5
/* Longest UDP segment whose checksum the datapath computes in full. */
#define UDP6_SUM_MAX 4096

/* skb->cb words passed between tail calls on egress. */
#define CB_POLICY 0 /* written by the policy program: policy slot + 1, or 0 */
#define CB_MODE 1   /* SETUP_* below, written before the first tail call */
#define SETUP_NEW 1  /* a SYN of no known session: policy decides */
#define SETUP_CONT 2 /* a SYN with a local tag or of a known flow */

/* Counters (the stats per-CPU array), exported to Prometheus by name. Keep in
 * sync with internal/datapath/stats.go: a test checks the two lists. */
enum stat {
	STAT_SETUP_START,        /* chains started here (policy match) */
	STAT_SETUP_CONT,         /* chains continued here (middlebox host) */
	STAT_SETUP_END,          /* chains ended here */
	STAT_SYN_RETRANS,        /* SYN retransmissions re-sent with their block */
	STAT_REWRITE_IN,         /* packets rewritten on ingress */
	STAT_REWRITE_OUT,        /* packets rewritten on egress */
	STAT_TAP,                /* packets copied to the session-view tap */
	STAT_DROP_MALFORMED,     /* Dysco SYN: block unparsable, flags set, hops of another family or not unicast, or a forged local tag */
	STAT_DROP_BAD_MAGIC,
	STAT_DROP_BAD_VERSION,
	STAT_DROP_BAD_LENGTH,    /* block length does not match option / hop count */
	STAT_DROP_TOO_MANY_HOPS,
	STAT_DROP_LOOP,          /* address list names this host or repeats */
	STAT_DROP_BAD_SESSION,   /* session tuple in the block is not valid (port 0, an end not unicast, both ends the same) */
	STAT_DROP_UNTRUSTED,     /* Dysco SYN from an address not trusted, at a host with no SYN key */
	STAT_DROP_BAD_MAC,       /* Dysco SYN whose MAC no key verifies (forged, altered, replayed from elsewhere), not from a trusted address */
	STAT_DROP_HALF_OPEN,     /* Dysco SYN of a new session from a source over its half-open budget */
	STAT_DROP_SESSIONS_FULL, /* no room in the session map: fail closed */
	STAT_DROP_FLOWS_FULL,    /* no room in the flow map: fail closed */
	STAT_DROP_NO_PORT,       /* no free subsession port pair */
	STAT_DROP_NO_ROUTE,      /* no route to the next hop */
	STAT_DROP_OPT_SPACE,     /* no room for the marking option in the SYN */
	STAT_DROP_SYN_DATA,      /* a SYN with data (TCP Fast Open) at chain start */
	STAT_DROP_NO_SETUP,      /* set-up program missing: fail closed */
	STAT_DROP_BAD_POLICY,    /* policy slot empty or chain unresolvable */
	STAT_DROP_NO_SYN_STATE,  /* SYN of a known flow whose set-up state is gone */
	STAT_DROP_HELPER,        /* a packet helper failed */
	STAT_FIN,
	STAT_RST,
	STAT_DELTA,              /* packets with sequence deltas applied */
	STAT_ICMP,               /* ICMP errors about subsessions translated */
	STAT_REUSED,             /* ended sessions freed early: a new SYN reused their tuple */
	STAT_TP_OLD,             /* two-path phase: packets sent on the old path */
	STAT_TP_NEW,             /* two-path phase: packets sent on the new path */
	STAT_TP_STRADDLE,        /* two-path phase: data straddling the cut-off (split by the agent, or sent whole on the old path) */
	STAT_TP_CLAMP,           /* windows clamped during reconfiguration (§5.3) */
	STAT_DROP_ORPHAN,        /* packets of a proxy's sockets after it left the path */
	STAT_EVENTS_LOST,        /* notices to the agent lost (ring buffer full) */
	STAT_HOLD_PKTS,          /* packets held for the agent (FL_HOLD_*) */
	STAT_HOLD_BYTES,         /* their bytes, link-layer header included */
	STAT_HOLD_DROP,          /* packets to hold that did not fit (too long, ring full): dropped */
	STAT_DROP_NO_FORWARD,    /* chained SYN to pass on while IP forwarding is off: refused with a reset (noforward.h) */
	STAT_DROP_SETUP_GSO,     /* first datagram of a UDP session is a GSO packet: cannot carry the block */
	STAT_DROP_SETUP_MTU,     /* datagram that the block would take past the MTU */
	STAT_MAX,
};

/* session_val.role */
enum role {
	ROLE_START = 1,  /* left end of the chain */
	ROLE_MIDDLE = 2, /* middlebox host */
	ROLE_END = 3,    /* right end, session destination */
	ROLE_END_FWD = 4 /* right end of a chain that ends before the destination */
};

/* session_val.state bits */
#define ST_SYN (1 << 0)
#define ST_SYNACK (1 << 1)
#define ST_EST (1 << 2)
#define ST_FIN_FWD (1 << 3)
#define ST_FIN_REV (1 << 4)
#define ST_RST (1 << 5)
#define ST_SETUP_DONE (1 << 6) /* set-up state (syn_state) can be collected */

/* session_val.has_ts */
#define HS_TS0 (1 << 0)      /* tsoff[0] is known */
#define HS_TS1 (1 << 1)      /* tsoff[1] is known */
#define HS_SYN_SEEN (1 << 2) /* the SYN went through here (isn[0], ws[0]) */

/* flow_val.flags */
#define FL_REROUTE (1 << 0)  /* destination changed on egress: route again */
#define FL_SYN_STRIP (1 << 1) /* SYNs on this ingress flow carry a block */
#define FL_SYN_EMIT (1 << 2) /* SYNs on this egress flow must carry a block */
#define FL_TAP (1 << 3)      /* copy to the session-view tap */
#define FL_DELTA (1 << 4)    /* look up sequence deltas in dysco_deltas */
#define FL_REV (1 << 5)      /* the flow's direction: against the SYN's (without it: the SYN's) */
#define FL_INGRESS (1 << 6)  /* applies on ingress; every other flow on egress */
#define FL_EST (1 << 7)      /* session established: no state to track on plain packets */
#define FL_ROUTED (1 << 8)   /* the agent decided FL_REROUTE from the routes (not read here) */
#define FL_TP_OUT (1 << 9)   /* egress flow of a side with a two-path record (dysco_tp) */
#define FL_TP_OLD (1 << 10)  /* ingress flow of the old subsession of such a side */
#define FL_TP_NEW (1 << 11)  /* ingress flow of the new subsession of such a side */
#define FL_DROP (1 << 12)    /* drop: a proxy's socket after the proxy left the path */
#define FL_HOLD_DATA (1 << 13) /* egress: hold packets with new data (beyond mk_seq), see hold.h */
#define FL_HOLD_ALL (1 << 14)  /* egress: hold every packet of the flow */
#define FL_MARKS (1 << 15)     /* mk_seq and mk_ack are known (set once, by mark() or CTL_MARKS_MERGE) */
#define FL_PENDING (1 << 16)   /* egress: a UDP session's tuple before its subsession exists (udp.h) */

/* tp_val.state */
#define TP_IDLE 0      /* new subsession installed; everything still on the old path */
#define TP_STARTING 1  /* the cut-off is being taken */
#define TP_ACTIVE 2    /* two paths: cut-off tables (§3.5) */
#define TP_NEW 3       /* everything on the new path */

/* tp_event.kind and bits */
#define EV_PROGRESS 1
#define TPB_ACTIVE (1 << 0)   /* the phase started */
#define TPB_SEND_DONE (1 << 1) /* oldSentAcked = oldSent */
#define TPB_RCVD_ACKED (1 << 2) /* oldRcvdAcked = oldRcvd */
#define TPB_NEW_RCVD (1 << 3) /* something arrived on the new path */
#define TPB_NEW_AT_OLD (1 << 4) /* firstNewRcvd <= oldRcvd */

/* dysco_ctl operations */
#define CTL_FLAGS_SET 1   /* flow key: flags |= arg */
#define CTL_FLAGS_CLEAR 2 /* flow key: flags &= ~arg */
#define CTL_TP_START 3    /* tp: take the cut-off and start the two-path phase */
#define CTL_TP_STATE 4    /* tp: state = arg */
#define CTL_TP_CLAMP 5    /* tp: clamp = arg */
#define CTL_MARKS_MERGE 6 /* flow key2's marks = max(its own, flow key's) */
#define CTL_FREE 7        /* tp.sess_id: the session and all its state at this host */
#define CTL_CUT 8         /* tp.sess_id: its ingress flows go, its egress flows drop */
#define CTL_FREE_RECONF 9 /* tp.sess_id: its two-path records and kept requests */
#define CTL_ADD_SUB 10    /* tp: a side's new subsession (add_sub): req, tpv; key: its ingress flow, delta */
#define CTL_CLOSED 11     /* tp.sess_id: state |= arg & (ST_FIN_FWD | ST_FIN_REV): FINs that passed elsewhere */
#define CTL_HO_RELEASE 12 /* tp.sess_id: its half-open count is given back (the collector ends it) */
#define CTL_WS 13         /* tp.sess_id: ws[1] = arg, the leftward window scale a joined session learns */

/* Packet holding (hold.h). The agent re-injects held packets through an
 * AF_PACKET socket with this socket mark; the datapath never holds a packet
 * that carries it. */
#define DYSCO_REINJECT_MARK 0x0d5c0001
/* Longest frame that can be held: an IPv6 GSO packet of 64 KiB with its
 * Ethernet header. */
#ifndef HOLD_MAX_FRAME
#define HOLD_MAX_FRAME 65600
#endif
/* Entries of the copy buffer, one per possible CPU; the loader sets the
 * real count. */
#ifndef HOLD_CPUS
#define HOLD_CPUS 64
#endif
#define HOLD_RING_BYTES (4 << 20)
#define HOLD_F_V6 (1 << 0) /* hold_hdr.flags: an IPv6 packet */
/* hold_hdr.flags: not held but handed over to be split at the cut-off of
 * the two-path record (sess_id, side), side HOLD_F_RIGHT ? 1 : 0 (§3.5) */
#define HOLD_F_SPLIT (1 << 1)
#define HOLD_F_RIGHT (1 << 2)

/* policy hop kinds */
#define HOP_ADDR 1
#define HOP_TYPE 2

#endif
