/* SPDX-License-Identifier: (GPL-2.0-only OR MIT) */
/* Bookkeeping of sessions and flows: time stamps, session ids, the TCP state
 * that the agent's collector ends sessions by, flow counters, and the end of
 * a session whose tuple a new session reuses.
 *
 * Provides: stamp, alloc_session, track_state, count, ended, reclaim.
 * Expects: flow pointers from flow_get (flows.h), valid for the flow's head
 * only; session ids below 2^24 (SESS_ID_MASK).
 * Maps: dysco_ids (the next id), dysco_sessions (insert; state and last_ms
 * in place; delete in reclaim), dysco_flows4 or dysco_flows6 and dysco_syns
 * (reclaim deletes), dysco_halfopen (ho_release), dysco_stats. */
#ifndef DYSCO_SESSION_H
#define DYSCO_SESSION_H

#include <linux/bpf.h>
#include "maps.h"
#include "parsing.h"
#include "flows.h"
#include "tuple.h"
#include "admit.h"

/* stamp is the time stamp of flows and sessions: CLOCK_MONOTONIC_COARSE in
 * milliseconds, modulo 2^32 (it wraps every 49.7 days), as the agent reads it
 * (datapath.Now, datapath.Age: an age is (now - stamp) mod 2^32). 32 bits
 * keep flow_val and session_val at 72 and 80 bytes. */
static __always_inline __u32 stamp(void)
{
	return (__u32)(bpf_ktime_get_coarse_ns() / 1000000);
}

/* alloc_session inserts s under a fresh 24-bit id (the id is also the local
 * tag of the SYN inside a middlebox host). A full map fails closed. */
static __always_inline int alloc_session(struct session_val *s, __u32 *id)
{
	__u32 k0 = 0;
	__u64 *next = bpf_map_lookup_elem(&dysco_ids, &k0);
	int i, err = 0;

	if (!next)
		return -1;
	for (i = 0; i < ALLOC_TRIES; i++) {
		__u32 cand = (__u32)__sync_fetch_and_add(next, 1) & SESS_ID_MASK;
		if (cand == 0)
			continue;
		err = bpf_map_update_elem(&dysco_sessions, &cand, s, BPF_NOEXIST);
		if (!err) {
			*id = cand;
			return 0;
		}
		if (err != -17 /* EEXIST */)
			break;
	}
	stat_inc(STAT_DROP_SESSIONS_FULL);
	return -1;
}

/* track_state records the session's TCP state (teardown is driven by the
 * agent's collector from these bits). */
static __always_inline void track_state(struct session_val *s, const struct pkt *p, __u8 dir)
{
	__u32 st = s->state, set = 0;

	if (p->flags & TH_RST) {
		set |= ST_RST;
		stat_inc(STAT_RST);
	}
	if (p->flags & TH_FIN) {
		set |= dir ? ST_FIN_REV : ST_FIN_FWD;
		stat_inc(STAT_FIN);
	}
	if ((p->flags & (TH_SYN | TH_ACK)) == (TH_SYN | TH_ACK))
		set |= ST_SYNACK;
	else if (dir == 0 && (p->flags & (TH_SYN | TH_ACK)) == TH_ACK && (st & ST_SYNACK))
		set |= ST_EST;
	if (set & ~st) {
		__sync_fetch_and_or(&s->state, set);
		s->last_ms = stamp();
		/* No longer half-open (admit.h). */
		if (set & (ST_EST | ST_RST))
			ho_release(s);
	}
}

/* count adds a packet to a flow's counters. A packet crossing a host passes
 * its ingress and its egress flow; the agent counts each packet once. */
static __always_inline void count(struct flow_val *fp, __u32 len)
{
	fp->last_ms = stamp();
	__sync_fetch_and_add(&fp->packets, 1);
	__sync_fetch_and_add(&fp->bytes, len);
}

/* ended tells whether the session of flow f is over, or past its handshake:
 * a SYN on one of its tuples then starts a new session that reuses the
 * tuple (a client port reused soon after a close), not a retransmission. */
static __always_inline int ended(const struct flow_val *f)
{
	struct session_val *s = bpf_map_lookup_elem(&dysco_sessions, &f->sess_id);

	if (!s)
		return 1;
	return (s->state & (ST_RST | ST_EST)) ||
	       (s->state & (ST_FIN_FWD | ST_FIN_REV)) == (ST_FIN_FWD | ST_FIN_REV);
}

/* reclaim frees the flow at key, with its reverse flow, session and set-up
 * state, if it belongs to a session that has ended: its tuple is being
 * reused. The collector removes the session's other flows. Returns 1 if the
 * key is free now. */
static __attribute__((noinline)) int reclaim(const struct dysco_tuple *key)
{
	struct dysco_ends out;
	struct flow_val *f = flow_get(key, &out);
	struct dysco_tuple rk;
	struct session_val *s;
	__u32 id;

	if (!f)
		return 1;
	if (!ended(f))
		return 0;
	id = f->sess_id;
	reverse(&rk, &out, key->proto);
	flow_del(&rk);
	flow_del(key);
	s = bpf_map_lookup_elem(&dysco_sessions, &id);
	if (s)
		ho_release(s);
	bpf_map_delete_elem(&dysco_sessions, &id);
	bpf_map_delete_elem(&dysco_syns, &id);
	stat_inc(STAT_REUSED);
	return 1;
}

#endif
