//go:build ignore
/* SPDX-License-Identifier: (GPL-2.0-only OR MIT) */
/* The Dysco datapath: TC programs on ingress and egress of every interface of
 * a host (paper §2.1, §4.1-4.2; DESIGN.md "Hard requirements").
 *
 * Packets between hosts carry subsession tuples; applications and middleboxes
 * on a host see session tuples. Ingress maps subsession -> session before
 * netfilter and the stack; egress maps session -> subsession after them. The
 * first SYN carries the rest of the address list in its payload, announced by
 * an 8-byte TCP option that is always the last option, so that it is found
 * in O(1). Steady-state packets are one hash lookup and a header rewrite; they
 * never reach user space. */
#include <linux/bpf.h>
#include <linux/pkt_cls.h>
#include <linux/if_ether.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

#include "include/consts.h"
#include "include/structs.h"
#include "include/maps.h"
#include "include/parsing.h"
#include "include/flows.h"
#include "include/rewrite.h"
#include "include/twopath.h"
#include "include/hold.h"

#ifndef AF_INET
#define AF_INET 2
#endif
#ifndef AF_INET6
#define AF_INET6 10
#endif

/* Set by the agent before load. */
volatile const __u32 tap_ifindex = 0;       /* session-view tap, 0: none */
volatile const __u16 port_lo = 20000;       /* subsession port range */
volatile const __u16 port_n = 40000;
volatile const __u8 enforce_trusted = 0;    /* accept Dysco SYNs only from dysco_trusted */

char LICENSE[] SEC("license") = "Dual MIT/GPL";

/* copy16 copies an address between scratch areas that clang cannot prove
 * disjoint (a memcpy would become an unsupported memmove). */
static __always_inline void copy16(__u8 *d, const __u8 *s)
{
	__u8 tmp[16];

	__builtin_memcpy(tmp, s, 16);
	__builtin_memcpy(d, tmp, 16);
}

static __always_inline int addr_eq(const __u8 *a, const __u8 *b)
{
	const __u32 *x = (const __u32 *)a, *y = (const __u32 *)b;

	return x[0] == y[0] && x[1] == y[1] && x[2] == y[2] && x[3] == y[3];
}

/* unicast tells whether a (IPv4-mapped or IPv6) can be a session's host or
 * a hop: not unspecified, loopback, multicast or the IPv4 broadcast address
 * (wire.Unicast, which the agent applies to the same fields). */
static __always_inline int unicast(const __u8 *a)
{
	const __u32 *w = (const __u32 *)a;

	if (is_mapped4(a))
		return w[3] != 0 && a[12] != 127 && (a[12] & 0xf0) != 0xe0 && w[3] != 0xffffffff;
	if (a[0] == 0xff)
		return 0; /* multicast */
	if (w[0] || w[1] || w[2])
		return 1;
	return w[3] != 0 && w[3] != bpf_htonl(1); /* :: and ::1 */
}

static __always_inline int is_local(const __u8 *addr)
{
	return bpf_map_lookup_elem(&dysco_local, addr) != 0;
}

/* reverse gives the key of the packets that answer those sent to e. */
static __always_inline void reverse(struct dysco_tuple *r, const struct dysco_ends *e)
{
	__builtin_memcpy(r->saddr, e->daddr, 16);
	__builtin_memcpy(r->daddr, e->saddr, 16);
	r->sport = e->dport;
	r->dport = e->sport;
	r->proto = IPPROTO_TCP;
	r->pad[0] = r->pad[1] = r->pad[2] = 0;
}

/* reverse_ends gives the rewrite target that answers packets of key t. */
static __always_inline void reverse_ends(struct dysco_ends *r, const struct dysco_tuple *t)
{
	__builtin_memcpy(r->saddr, t->daddr, 16);
	__builtin_memcpy(r->daddr, t->saddr, 16);
	r->sport = t->dport;
	r->dport = t->sport;
}

/* ends_of gives the addresses and ports of tuple t. */
static __always_inline void ends_of(struct dysco_ends *e, const struct dysco_tuple *t)
{
	__builtin_memcpy(e->saddr, t->saddr, 16);
	__builtin_memcpy(e->daddr, t->daddr, 16);
	e->sport = t->sport;
	e->dport = t->dport;
}

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

/* route finds the way to t's destination for bpf_redirect_neigh: the
 * interface and next hop, and (with src) the source address to use. A
 * rewritten destination leaves by its own route (requirement 3): no host
 * needs static routes through middleboxes.
 *
 * bpf_fib_lookup answers only on hosts that forward. On other hosts (plain
 * end hosts) the packet leaves by the interface its session was routed to,
 * with the kernel resolving the next hop (nh->nh_family == 0), and the
 * source is the session's own local address. */
static __always_inline int route(struct __sk_buff *skb, const struct dysco_ends *t, int v6,
				 struct bpf_redir_neigh *nh, __u32 *ifindex, __u8 *src, const __u8 *own)
{
	struct bpf_fib_lookup f = {};
	__u32 flags = BPF_FIB_LOOKUP_SKIP_NEIGH | (src ? BPF_FIB_LOOKUP_SRC : 0);
	long rc;

	__builtin_memset(nh, 0, sizeof(*nh));
	f.l4_protocol = IPPROTO_TCP;
	f.sport = t->sport;
	f.dport = t->dport;
	f.ifindex = skb->ifindex;
	if (!v6) {
		f.family = AF_INET;
		__builtin_memcpy(&f.ipv4_dst, t->daddr + 12, 4);
		if (!src)
			__builtin_memcpy(&f.ipv4_src, t->saddr + 12, 4);
	} else {
		f.family = AF_INET6;
		__builtin_memcpy(f.ipv6_dst, t->daddr, 16);
		if (!src)
			__builtin_memcpy(f.ipv6_src, t->saddr, 16);
	}
	rc = bpf_fib_lookup(skb, &f, sizeof(f), flags);
	if (rc == BPF_FIB_LKUP_RET_FWD_DISABLED) {
		*ifindex = skb->ifindex;
		if (src) {
			if (!own || !is_local(own))
				return -1;
			__builtin_memcpy(src, own, 16);
		}
		return 0;
	}
	if (rc != BPF_FIB_LKUP_RET_SUCCESS)
		return -1;
	*ifindex = f.ifindex;
	if (f.family == AF_INET) {
		nh->nh_family = AF_INET;
		nh->ipv4_nh = f.ipv4_dst;
		if (src)
			map4(src, f.ipv4_src);
	} else {
		nh->nh_family = AF_INET6;
		__builtin_memcpy(nh->ipv6_nh, f.ipv6_dst, 16);
		if (src)
			__builtin_memcpy(src, f.ipv6_src, 16);
	}
	return 0;
}

/* same_route tells whether packets to a and to b leave by the same
 * interface and next hop: then a rewrite from one destination to the other
 * needs no new route, and the packet no second pass through egress. Only
 * forwarding hosts can tell (bpf_fib_lookup); on others the answer is no. */
static __attribute__((noinline)) int same_route(struct __sk_buff *skb, int v6, const __u8 *a, const __u8 *b)
{
	struct bpf_fib_lookup f;
	__u32 nh[4], ifindex, i;

	for (i = 0; i < 2; i++) {
		__builtin_memset(&f, 0, sizeof(f));
		f.l4_protocol = IPPROTO_TCP;
		f.ifindex = skb->ifindex;
		f.family = v6 ? AF_INET6 : AF_INET;
		if (v6)
			__builtin_memcpy(f.ipv6_dst, i ? b : a, 16);
		else
			__builtin_memcpy(&f.ipv4_dst, (i ? b : a) + 12, 4);
		if (bpf_fib_lookup(skb, &f, sizeof(f), BPF_FIB_LOOKUP_SKIP_NEIGH) != BPF_FIB_LKUP_RET_SUCCESS)
			return 0;
		if (i == 0) {
			ifindex = f.ifindex;
			__builtin_memcpy(nh, f.ipv6_dst, 16); /* ipv4_dst shares the first word */
		}
	}
	return ifindex == f.ifindex && nh[0] == f.ipv6_dst[0] &&
	       (!v6 || (nh[1] == f.ipv6_dst[1] && nh[2] == f.ipv6_dst[2] && nh[3] == f.ipv6_dst[3]));
}

static __always_inline int redirect_to(struct __sk_buff *skb, const struct dysco_ends *t, int v6)
{
	struct bpf_redir_neigh nh;
	__u32 ifindex;

	if (route(skb, t, v6, &nh, &ifindex, 0, 0)) {
		stat_inc(STAT_DROP_NO_ROUTE);
		return TC_ACT_SHOT;
	}
	if (!nh.nh_family)
		return bpf_redirect_neigh(ifindex, 0, 0, 0);
	return bpf_redirect_neigh(ifindex, &nh, sizeof(nh), 0);
}

/* track_state records the session's TCP state (teardown is driven by the
 * agent's collector from these bits, requirement 8). */
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

static __always_inline int tap_on(void)
{
	__u32 k0 = 0;
	struct config *cfg;

	if (!tap_ifindex)
		return 0;
	cfg = bpf_map_lookup_elem(&dysco_config, &k0);
	return cfg && cfg->tap_active;
}

/* handshake records a SYN's or SYN-ACK's initial sequence number, window
 * scale and timestamp in the session (index 0: the SYN's direction). */
struct hsopt {
	struct __sk_buff *skb;
	__u32 off;
	__u32 end;
	__u32 tsval;
	__u32 tsecr;
	__u8 ws;
	__u8 has_ts;
};

static long hs_step(__u32 idx, void *ctx)
{
	struct hsopt *o = ctx;
	__u8 h[2];
	__be32 v[2];

	if (o->off >= o->end || o->off > 0xffff)
		return 1;
	if (bpf_skb_load_bytes(o->skb, o->off, h, 1) || h[0] == 0)
		return 1;
	if (h[0] == 1) {
		o->off++;
		return 0;
	}
	if (o->off + 2 > o->end || bpf_skb_load_bytes(o->skb, o->off, h, 2) || h[1] < 2)
		return 1;
	if (h[0] == 3 && h[1] == 3 && o->off + 3 <= o->end) {
		if (!bpf_skb_load_bytes(o->skb, o->off + 2, h, 1))
			o->ws = h[0] > 14 ? 14 : h[0];
	} else if (h[0] == 8 && h[1] == 10 && o->off + 10 <= o->end) {
		if (!bpf_skb_load_bytes(o->skb, o->off + 2, v, 8)) {
			o->tsval = bpf_ntohl(v[0]);
			o->tsecr = bpf_ntohl(v[1]);
			o->has_ts = 1;
		}
	}
	o->off += h[1];
	return 0;
}

/* handshake records a SYN's or SYN-ACK's initial sequence number, window
 * scale and timestamp in the session (index 0: the SYN's direction), for
 * the agent to translate options between sessions (§4.2). */
static __attribute__((noinline)) int handshake(struct __sk_buff *skb, struct pkt *p, struct session_val *s)
{
	struct hsopt o = {.skb = skb, .off = p->l4 + 20, .end = p->l4 + p->doff, .ws = 0xff};
	__u64 now = bpf_ktime_get_ns();
	__u32 tsval, tsecr, has_ts;
	__u8 ws;

	bpf_loop(40, hs_step, &o, 0);
	ws = o.ws;
	tsval = o.has_ts ? o.tsval : 0;
	tsecr = o.tsecr;
	has_ts = o.has_ts;
	if (p->flags & TH_ACK) {
		s->isn[1] = p->seq;
		s->ws[1] = ws;
		if (has_ts) {
			s->tsoff[1] = tsval - (__u32)(now / 1000000);
			s->has_ts |= HS_TS1;
			if (!(s->has_ts & HS_SYN_SEEN) && tsecr) {
				/* The SYN's TSval, echoed, at the time the SYN was
				 * seen (the coarse clock: one tick of error; the
				 * stamp is the clock in ms modulo 2^32, as the
				 * offset is). */
				s->tsoff[0] = tsecr - s->created_ms;
				s->has_ts |= HS_TS0;
			}
		}
		if (!(s->has_ts & HS_SYN_SEEN))
			s->isn[0] = p->ack - 1;
	} else {
		s->isn[0] = p->seq;
		s->ws[0] = ws;
		s->has_ts |= HS_SYN_SEEN;
		if (has_ts) {
			s->tsoff[0] = tsval - (__u32)(now / 1000000);
			s->has_ts |= HS_TS0;
		}
	}
	return 0;
}

/* What forward() keeps of a flow (the entry itself is read in place). The
 * flow's direction is FL_REV. */
struct fwd_flow {
	__u32 sess_id;
	__u32 flags;
};

/* clamp_window limits the window a packet advertises to clamp bytes (§5.3:
 * min(window, 64 KB) while a side is being reconfigured). */
static __always_inline int clamp_window(struct __sk_buff *skb, struct pkt *p, __u32 clamp, __u8 ws)
{
	__be16 old, new;
	__u32 w;

	if (p->flags & TH_SYN)
		return 0;
	if (bpf_skb_load_bytes(skb, p->l4 + 14, &old, 2))
		return -1;
	w = (__u32)bpf_ntohs(old) << (ws & 15);
	if (w <= clamp)
		return 0;
	new = bpf_htons(clamp >> (ws & 15));
	stat_inc(STAT_TP_CLAMP);
	if (bpf_l4_csum_replace(skb, TCP_CSUM_OFF(p), old, new, 2) || bpf_skb_store_bytes(skb, p->l4 + 14, &new, 2, 0))
		return -1;
	return 0;
}

/* tp_split hands a packet of a side in its two-path phase whose data
 * straddles the cut-off (oldSent) to the agent, which splits it there and
 * sends both parts again (the paper's split, §3.5: each part then takes
 * its own path, the bytes below oldSent the old one). The packet leaves
 * the datapath unchanged, and its flow's counters are taken back: the parts
 * are counted when they come back (ReinjectMark; they never straddle, and a
 * re-injected packet is not split again). Only when the agent that made the
 * record reads the hold ring (tp->split) and an agent reads it now (its
 * lease, config split_until, has not run out); otherwise, and when the
 * packet cannot be handed over (too long, ring full), it returns -1 and the
 * packet goes whole on the old path (tp_decide), as the Go core's Decide
 * sends it. */
static __always_inline int tp_split(struct __sk_buff *skb, const struct pkt *p, struct tp_val *tp,
				    const struct tp_key *k, struct flow_val *fp, __u32 end)
{
	__u32 k0 = 0, len = skb->len;
	struct config *cfg;

	if (!tp->split || !p->payload || (p->flags & TH_RST) || skb->mark == DYSCO_REINJECT_MARK ||
	    !seq_lt(p->seq, tp->old_sent) || !seq_lt(tp->old_sent, end))
		return -1;
	cfg = bpf_map_lookup_elem(&dysco_config, &k0);
	if (!cfg || !cfg->split_until || (__s32)(cfg->split_until - stamp()) <= 0)
		return -1;
	if (hold_frame(skb, k->sess_id, p->v6, HOLD_F_SPLIT | (k->side == SIDE_RIGHT ? HOLD_F_RIGHT : 0)))
		return -1;
	__sync_fetch_and_add(&fp->packets, -1);
	__sync_fetch_and_add(&fp->bytes, -(__u64)len);
	tp->straddled++;
	stat_inc(STAT_TP_STRADDLE);
	return bpf_redirect(HOLD_SINK_IFINDEX, 0);
}

/* tp_egress sends a packet of a side in its two-path phase (§3.5): on the
 * old path with the flow's own delta, or on the new path with the new
 * subsession's. Returns -1 to let forward() go on as without a record. */
static __attribute__((noinline)) int tp_egress(struct __sk_buff *skb, struct pkt *p, __u32 sess_id, __u32 fflags,
					       struct flow_val *fp)
{
	struct tp_key k = {.sess_id = sess_id, .side = (fflags & FL_REV) ? SIDE_LEFT : SIDE_RIGHT};
	struct tp_val *tp = bpf_map_lookup_elem(&dysco_tp, &k);
	struct dysco_tuple *target;
	const struct dysco_ends *out;
	struct delta_val *dv = 0;
	__u32 st, seq_to, ack_to, end;
	int path = TPD_OLD, reroute;

	if (!tp)
		return -1;
	st = tp->state;
	end = seq_end(p->seq, p->payload, p->flags);
	if (st == TP_NEW)
		path = TPD_NEW;
	else if (st == TP_ACTIVE) {
		int rc = tp_split(skb, p, tp, &k, fp, end);
		if (rc >= 0)
			return rc;
		path = tp_decide(tp, p->seq, p->ack, end, p->flags, &seq_to, &ack_to,
				 skb->mark != DYSCO_REINJECT_MARK);
		if (seq_to != p->seq && replace_u32(skb, p, p->l4 + 4, seq_to - p->seq))
			goto fail;
		if (ack_to != p->ack && replace_u32(skb, p, p->l4 + 8, ack_to - p->ack))
			goto fail;
		tp_report(tp, &k, 0);
	}
	if (tp->clamp && clamp_window(skb, p, tp->clamp, tp->snd_ws))
		goto fail;
	if (path == TPD_NEW) {
		dv = &tp->nd;
		target = &tp->new_out;
		reroute = tp->reroute_new;
		tp->to_new++;
		stat_inc(STAT_TP_NEW);
	} else {
		if (fflags & FL_DELTA)
			dv = bpf_map_lookup_elem(&dysco_deltas, &p->t);
		target = &tp->old_out;
		reroute = tp->reroute_old;
		tp->to_old++;
		stat_inc(STAT_TP_OLD);
	}
	if (dv && (dv->seq || dv->ack || dv->tsval || dv->tsecr || dv->ws_on) && apply_delta_fast(skb, p, dv))
		goto fail;
	/* A tuple's ends are its first 36 bytes (struct dysco_ends). */
	out = (const struct dysco_ends *)target;
	if (rewrite_fast(skb, p, out))
		goto fail;
	stat_inc(STAT_REWRITE_OUT);
	if (reroute)
		return redirect_to(skb, out, p->v6);
	return TC_ACT_OK;
fail:
	stat_inc(STAT_DROP_HELPER);
	return TC_ACT_SHOT;
}

/* tp_ingress records a packet received on the old or the new subsession of
 * a side in its two-path phase; the first packet on an armed new
 * subsession starts the phase (the right anchor, §3.5, if the ACK of the
 * new path's handshake is lost). It returns the ack the packet is to be
 * handed on with (tp_deliver). */
static __attribute__((noinline)) __u32 tp_ingress(const struct fwd_flow *f, const struct pkt *p, __u32 seq, __u32 ack)
{
	struct tp_key k = {.sess_id = f->sess_id, .side = (f->flags & FL_REV) ? SIDE_RIGHT : SIDE_LEFT};
	struct tp_val *tp = bpf_map_lookup_elem(&dysco_tp, &k);
	/* A side's old subsession in its second reconfiguration was the new
	 * one of its first: the agent clears FL_TP_NEW before it arms the new
	 * record, and a flow with both flags (left by an earlier agent) is
	 * the old path. Taken for the new one, the old path's packets would
	 * start an armed side before the other anchor can receive on the new
	 * path, and count on the wrong path. */
	int new_path = (f->flags & (FL_TP_NEW | FL_TP_OLD)) == FL_TP_NEW;
	__u8 flags = p->flags;
	__u32 end = seq_end(seq, p->payload, flags);

	if (!tp)
		return ack;
	if (new_path && tp->armed && tp->state == TP_IDLE)
		tp_start(tp, &k, 0);
	if (tp->state != TP_ACTIVE)
		return ack;
	tp_observe(tp, new_path, seq, ack, end, flags);
	tp_report(tp, &k, 0);
	return tp_deliver(tp, new_path, ack, flags);
}

/* forward applies a flow to a packet: the steady-state path. One lookup (the
 * flow); the session only for packets that can change its state. Every use
 * of the flow's entry (fp, in dysco_flows4 or dysco_flows6) comes first:
 * below the marks the verifier sees both families' states as one, and the
 * rest of the path is verified once, not once per flow map. */
static __always_inline int forward(struct __sk_buff *skb, struct pkt *p, struct flow_val *fp,
				   const struct dysco_ends *out, int egress)
{
	struct fwd_flow f = {.sess_id = fp->sess_id, .flags = fp->flags};
	struct delta_val dv;
	__u32 sseq = p->seq, sack = p->ack;
	int has_dv = 0;

	/* Holding (hold.h) comes first: a held packet is not sent now, so it
	 * must move neither the counters, the session state nor the marks, and
	 * its copy stays in session space, untranslated, for whatever path the
	 * session uses when it is re-injected. */
	if (egress && (f.flags & (FL_HOLD_DATA | FL_HOLD_ALL)) && hold_wanted(skb, fp, f.flags, p))
		return hold_copy(skb, f.sess_id, p->v6);
	count(fp, skb->len);
	if (f.flags & FL_DROP) {
		stat_inc(STAT_DROP_ORPHAN);
		return TC_ACT_SHOT;
	}
	if ((p->flags & (TH_SYN | TH_FIN | TH_RST)) || !(f.flags & FL_EST)) {
		struct session_val *s = bpf_map_lookup_elem(&dysco_sessions, &f.sess_id);
		if (s) {
			track_state(s, p, !!(f.flags & FL_REV));
			if ((p->flags & (TH_SYN | TH_ACK)) == (TH_SYN | TH_ACK))
				handshake(skb, p, s);
			if ((s->state & ST_EST) && !(f.flags & FL_EST))
				__sync_fetch_and_or(&fp->flags, FL_EST);
		}
	}
	if (f.flags & FL_DELTA) {
		/* Keyed by the packet's own tuple, before any rewrite. */
		struct delta_val *d = bpf_map_lookup_elem(&dysco_deltas, &p->t);
		if (d) {
			dv = *d;
			has_dv = 1;
		}
	}
	/* Marks are in session space: what egress sends before translation,
	 * what ingress receives after it. */
	if (!egress && has_dv) {
		sseq += dv.seq;
		sack += dv.ack;
	}
	mark(fp, sseq, sack, seq_end(sseq, p->payload, p->flags), p->flags);

	if (egress && (f.flags & FL_TP_OUT)) {
		/* The two-path phase translates with its own deltas. */
		int rc = tp_egress(skb, p, f.sess_id, f.flags, fp);
		if (rc >= 0)
			return rc;
	}
	if (has_dv) {
		if (apply_delta_fast(skb, p, &dv)) {
			stat_inc(STAT_DROP_HELPER);
			return TC_ACT_SHOT;
		}
		stat_inc(STAT_DELTA);
	}
	if (!egress && (f.flags & (FL_TP_OLD | FL_TP_NEW))) {
		__u32 ack_to = tp_ingress(&f, p, sseq, sack);
		if (ack_to != sack && replace_u32(skb, p, p->l4 + 8, ack_to - sack)) {
			stat_inc(STAT_DROP_HELPER);
			return TC_ACT_SHOT;
		}
	}
	if (rewrite_fast(skb, p, out)) {
		stat_inc(STAT_DROP_HELPER);
		return TC_ACT_SHOT;
	}
	if (egress) {
		stat_inc(STAT_REWRITE_OUT);
		if (f.flags & FL_REROUTE)
			return redirect_to(skb, out, p->v6);
		return TC_ACT_OK;
	}
	stat_inc(STAT_REWRITE_IN);
	if ((f.flags & FL_TAP) && tap_on()) {
		bpf_clone_redirect(skb, tap_ifindex, BPF_F_INGRESS);
		stat_inc(STAT_TAP);
	}
	return TC_ACT_OK;
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
	__u32 id;

	if (!f)
		return 1;
	if (!ended(f))
		return 0;
	id = f->sess_id;
	reverse(&rk, &out);
	flow_del(&rk);
	flow_del(key);
	bpf_map_delete_elem(&dysco_sessions, &id);
	bpf_map_delete_elem(&dysco_syns, &id);
	stat_inc(STAT_REUSED);
	return 1;
}

/* tag_opt writes the local tag of session id tag (§4.2 "Tagging SYN
 * packets"): the marking option with type LOCAL_TAG and the id in its last
 * three bytes. */
static __always_inline void tag_opt(__u8 *o, __u32 tag)
{
	o[0] = DYSCO_OPT_KIND;
	o[1] = DYSCO_OPT_LEN;
	o[2] = DYSCO_OPT_EXID >> 8;
	o[3] = DYSCO_OPT_EXID & 0xff;
	o[4] = DYSCO_OPT_TYPE_LOCAL_TAG;
	o[5] = (tag >> 16) & 0xff;
	o[6] = (tag >> 8) & 0xff;
	o[7] = tag & 0xff;
}

/* strip_block removes the SYN's address-list block and turns the marking
 * option into a local tag (keep_tag) or removes it, so that the middlebox or
 * the end host sees a plain SYN of the session (§2.1, §4.2 tagging). */
static __always_inline int strip_block(struct __sk_buff *skb, struct pkt *p, __u8 *opt, __u32 blen,
				       __u8 *block, int keep_tag, __u32 tag)
{
	__u32 cut = blen;

	if (csum_bytes(skb, p, block, blen, 1))
		return -1;
	if (keep_tag) {
		__u8 nopt[DYSCO_OPT_LEN];
		__s64 diff;

		tag_opt(nopt, tag);
		diff = bpf_csum_diff((__u32 *)opt, DYSCO_OPT_LEN, (__u32 *)nopt, DYSCO_OPT_LEN, 0);
		if (bpf_l4_csum_replace(skb, TCP_CSUM_OFF(p), 0, diff, 0) ||
		    bpf_skb_store_bytes(skb, p->l4 + p->doff - DYSCO_OPT_LEN, nopt, DYSCO_OPT_LEN, 0))
			return -1;
	} else {
		/* Lower the data offset: the option's 8 bytes become the first
		 * payload bytes, and are cut with the block. */
		if (set_doff(skb, p, p->doff - DYSCO_OPT_LEN) || csum_bytes(skb, p, opt, DYSCO_OPT_LEN, 1))
			return -1;
		cut += DYSCO_OPT_LEN;
	}
	if (set_l3_len(skb, p, p->l3_len - cut))
		return -1;
	if (bpf_skb_change_tail(skb, skb->len - cut, 0))
		return -1;
	p->payload = 0;
	return 0;
}

/* tap_syn copies a tagged SYN to the session-view tap as the session's end
 * hosts see it: without the local tag, which never leaves this host (§4.2).
 * The tag is the last 8 bytes of the options and the SYN has no payload
 * left (strip_block), so it is cut off for the copy and appended again. */
static __attribute__((noinline)) int tap_syn(struct __sk_buff *skb, struct pkt *p, __u32 tag)
{
	__u8 o[DYSCO_OPT_LEN];
	__u32 at;

	tag_opt(o, tag);
	if (set_doff(skb, p, p->doff - DYSCO_OPT_LEN) || csum_bytes(skb, p, o, DYSCO_OPT_LEN, 1) ||
	    set_l3_len(skb, p, p->l3_len - DYSCO_OPT_LEN) || bpf_skb_change_tail(skb, skb->len - DYSCO_OPT_LEN, 0))
		return -1;
	bpf_clone_redirect(skb, tap_ifindex, BPF_F_INGRESS);
	at = skb->len;
	if (bpf_skb_change_tail(skb, at + DYSCO_OPT_LEN, 0) || bpf_skb_store_bytes(skb, at, o, DYSCO_OPT_LEN, 0) ||
	    set_doff(skb, p, p->doff + DYSCO_OPT_LEN) || csum_bytes(skb, p, o, DYSCO_OPT_LEN, 0) ||
	    set_l3_len(skb, p, p->l3_len + DYSCO_OPT_LEN))
		return -1;
	return 0;
}

/* ingress_syn handles a Dysco SYN arriving from the previous hop (§2.1): it
 * checks the block, records the session and its two flows on this side,
 * rewrites the SYN to the session tuple and hands it to the stack. */
static __always_inline int ingress_syn(struct __sk_buff *skb, struct pkt *p, __u8 *opt, struct flow_val *known)
{
	__u32 k0 = 0, blen, n, i, j, id;
	struct scratch *sc = bpf_map_lookup_elem(&dysco_scratch, &k0);
	struct syn_state *st;
	__u8 *b;
	int local_dst, keep_tag;

	if (!sc)
		return TC_ACT_SHOT;
	st = &sc->st;
	b = sc->buf;
	if (opt[5]) {
		/* Byte 5 of a SYN block's option is 0 in version 1 (only a
		 * local tag uses it, and that never arrives from the wire). */
		stat_inc(STAT_DROP_MALFORMED);
		return TC_ACT_SHOT;
	}
	blen = ((__u32)opt[6] << 8) | opt[7];
	if (blen < DYSCO_BLOCK_HEADER_LEN || p->payload != blen) {
		stat_inc(STAT_DROP_BAD_LENGTH);
		return TC_ACT_SHOT;
	}
	if (blen > DYSCO_MAX_BLOCK_LEN) {
		/* Longer than any valid block: a list of too many hops is
		 * counted as such, as wire.Decode reports it. */
		__u8 nh = 0;
		bpf_skb_load_bytes(skb, p->l4 + p->doff + 6, &nh, 1);
		stat_inc(nh > DYSCO_MAX_HOPS ? STAT_DROP_TOO_MANY_HOPS : STAT_DROP_BAD_LENGTH);
		return TC_ACT_SHOT;
	}
	if (bpf_skb_load_bytes(skb, p->l4 + p->doff, b, blen)) {
		stat_inc(STAT_DROP_MALFORMED);
		return TC_ACT_SHOT;
	}
	if (b[0] != ((DYSCO_MAGIC >> 24) & 0xff) || b[1] != ((DYSCO_MAGIC >> 16) & 0xff) ||
	    b[2] != ((DYSCO_MAGIC >> 8) & 0xff) || b[3] != (DYSCO_MAGIC & 0xff)) {
		stat_inc(STAT_DROP_BAD_MAGIC);
		return TC_ACT_SHOT;
	}
	if (b[4] != DYSCO_VERSION) {
		stat_inc(STAT_DROP_BAD_VERSION);
		return TC_ACT_SHOT;
	}
	if (b[5] || b[7]) {
		/* Version 1 defines no flags (wire.ErrReserved). */
		stat_inc(STAT_DROP_MALFORMED);
		return TC_ACT_SHOT;
	}
	n = b[6];
	if (n > DYSCO_MAX_HOPS) {
		stat_inc(STAT_DROP_TOO_MANY_HOPS);
		return TC_ACT_SHOT;
	}
	if (blen != DYSCO_BLOCK_HEADER_LEN + n * DYSCO_ADDR_LEN) {
		stat_inc(STAT_DROP_BAD_LENGTH);
		return TC_ACT_SHOT;
	}
	__builtin_memset(st, 0, sizeof(*st));
	__builtin_memcpy(st->nonce, b + 8, DYSCO_NONCE_LEN);
	__builtin_memcpy(st->session.saddr, b + 16, 16);
	__builtin_memcpy(st->session.daddr, b + 32, 16);
	__builtin_memcpy(&st->session.sport, b + 48, 2);
	__builtin_memcpy(&st->session.dport, b + 50, 2);
	st->session.proto = IPPROTO_TCP;
	if (!st->session.sport || !st->session.dport || is_mapped4(st->session.saddr) == p->v6 ||
	    is_mapped4(st->session.daddr) == p->v6 || !unicast(st->session.saddr) || !unicast(st->session.daddr) ||
	    (st->session.sport == st->session.dport && addr_eq(st->session.saddr, st->session.daddr))) {
		stat_inc(STAT_DROP_BAD_SESSION);
		return TC_ACT_SHOT;
	}
	if (enforce_trusted) {
		struct trusted_key tk = {.prefixlen = 128};
		__builtin_memcpy(tk.addr, p->t.saddr, 16);
		if (!bpf_map_lookup_elem(&dysco_trusted, &tk)) {
			stat_inc(STAT_DROP_UNTRUSTED);
			return TC_ACT_SHOT;
		}
	}
	/* A list naming this host or repeating an address would loop. */
	for (i = 0; i < DYSCO_MAX_HOPS; i++) {
		if (i >= n)
			break;
		__builtin_memcpy(st->hops[i], b + DYSCO_BLOCK_HEADER_LEN + i * DYSCO_ADDR_LEN, 16);
		if (is_mapped4(st->hops[i]) == p->v6 || !unicast(st->hops[i])) {
			/* Mixed families, or an address no SYN can go to: not a loop. */
			stat_inc(STAT_DROP_MALFORMED);
			return TC_ACT_SHOT;
		}
		if (is_local(st->hops[i])) {
			stat_inc(STAT_DROP_LOOP);
			return TC_ACT_SHOT;
		}
		for (j = 0; j < DYSCO_MAX_HOPS; j++) {
			if (j >= i)
				break;
			if (addr_eq(st->hops[i], st->hops[j])) {
				stat_inc(STAT_DROP_LOOP);
				return TC_ACT_SHOT;
			}
		}
	}
	st->n_hops = n;
	local_dst = is_local(st->session.daddr);
	keep_tag = n > 0 || !local_dst;

	if (known) {
		/* Retransmitted SYN: same session, same flows. */
		id = known->sess_id;
		count(known, skb->len);
		stat_inc(STAT_SYN_RETRANS);
	} else {
		/* In scratch space: the stack is needed by same_route. */
		struct session_val *s = &sc->sess;
		struct flow_val *in = &sc->fwd, *out = &sc->rev;
		struct dysco_tuple *rkey = &sc->rkey;

		__builtin_memset(s, 0, sizeof(*s));
		__builtin_memset(in, 0, sizeof(*in));
		__builtin_memset(out, 0, sizeof(*out));

		ends_of(&s->tuple, &st->session);
		s->created_ms = s->last_ms = stamp();
		__builtin_memcpy(s->nonce, st->nonce, DYSCO_NONCE_LEN);
		s->state = ST_SYN;
		s->role = n > 0 ? ROLE_MIDDLE : (local_dst ? ROLE_END : ROLE_END_FWD);
		s->is_v6 = p->v6;
		handshake(skb, p, s);
		if (alloc_session(s, &id))
			return TC_ACT_SHOT;
		ends_of(&in->out, &st->session);
		in->sess_id = id;
		in->flags = FL_INGRESS | FL_SYN_STRIP | (s->role != ROLE_END ? FL_TAP : 0);
		reverse(rkey, &in->out);
		reverse_ends(&out->out, &p->t);
		out->sess_id = id;
		out->flags = FL_REV | (same_route(skb, p->v6, st->session.saddr, p->t.saddr) ? 0 : FL_REROUTE);
		in->packets = 1;
		in->bytes = skb->len;
		in->last_ms = s->created_ms;
		reclaim(rkey);
		if (flow_put(&p->t, in, BPF_NOEXIST, &sc->v4) || flow_put(rkey, out, BPF_NOEXIST, &sc->v4)) {
			flow_del(&p->t);
			bpf_map_delete_elem(&dysco_sessions, &id);
			stat_inc(STAT_DROP_FLOWS_FULL);
			return TC_ACT_SHOT;
		}
		if (keep_tag && bpf_map_update_elem(&dysco_syns, &id, st, BPF_ANY)) {
			flow_del(&p->t);
			flow_del(rkey);
			bpf_map_delete_elem(&dysco_sessions, &id);
			stat_inc(STAT_DROP_SESSIONS_FULL);
			return TC_ACT_SHOT;
		}
		stat_inc(n > 0 ? STAT_SETUP_CONT : STAT_SETUP_END);
	}
	ends_of(&sc->ends, &st->session);
	if (strip_block(skb, p, opt, blen, b, keep_tag, id) || rewrite_tuple(skb, p, &sc->ends)) {
		stat_inc(STAT_DROP_HELPER);
		return TC_ACT_SHOT;
	}
	if ((n > 0 || !local_dst) && tap_on()) {
		if (tap_syn(skb, p, id)) {
			stat_inc(STAT_DROP_HELPER);
			return TC_ACT_SHOT;
		}
		stat_inc(STAT_TAP);
	}
	return TC_ACT_OK;
}

/* ingress_icmp translates an ICMP error about a subsession packet this host
 * sent (a next hop unreachable, a packet too big) into one about the
 * session, addressed to the session's source: that host's TCP then learns
 * of it as it would without Dysco, and a connection to a dead next hop
 * fails at once instead of by timeout. The quoted tuple is rewritten (with
 * the quoted IPv4 checksum and the ICMP checksum), and the outer destination
 * becomes the session's source when that is another host (an agentless
 * client behind an edge host, or the client of a middlebox's session). */
static __attribute__((noinline)) int ingress_icmp(struct __sk_buff *skb)
{
	__u32 k0 = 0, l3 = sizeof(struct ethhdr), icmp, in3, in4, ihl;
	struct scratch *sc = bpf_map_lookup_elem(&dysco_scratch, &k0);
	struct dysco_tuple *kp;
	struct dysco_ends *fo;
	struct flow_val *f;
	__u8 *hdr;
	__u16 proto;
	int v6;
	__s64 diff;

	/* Buffers in scratch space: this runs beside ingress_syn's frame. */
	if (!sc)
		return TC_ACT_OK;
	hdr = sc->buf;
	kp = &sc->next;
	fo = &sc->ends;
	__builtin_memset(kp, 0, sizeof(*kp));

	if (bpf_skb_load_bytes(skb, 12, &proto, 2))
		return TC_ACT_OK;
	if (proto == bpf_htons(ETH_P_IP)) {
		if (bpf_skb_load_bytes(skb, l3, hdr, 20) || hdr[9] != IPPROTO_ICMP)
			return TC_ACT_OK;
		v6 = 0;
		icmp = l3 + (hdr[0] & 0xf) * 4;
		if (bpf_skb_load_bytes(skb, icmp, hdr, 1) || (hdr[0] != 3 && hdr[0] != 11 && hdr[0] != 12))
			return TC_ACT_OK;
		in3 = icmp + 8;
		if (bpf_skb_load_bytes(skb, in3, hdr, 20) || hdr[9] != IPPROTO_TCP)
			return TC_ACT_OK;
		ihl = (hdr[0] & 0xf) * 4;
		if (ihl < 20 || ihl > 60)
			return TC_ACT_OK;
		map4(kp->daddr, *(__u32 *)&hdr[12]); /* key = reverse of the quote */
		map4(kp->saddr, *(__u32 *)&hdr[16]);
		in4 = in3 + ihl;
	} else if (proto == bpf_htons(ETH_P_IPV6)) {
		if (bpf_skb_load_bytes(skb, l3, hdr, 40) || hdr[6] != IPPROTO_ICMPV6)
			return TC_ACT_OK;
		v6 = 1;
		icmp = l3 + 40;
		if (bpf_skb_load_bytes(skb, icmp, hdr, 1) || hdr[0] < 1 || hdr[0] > 4)
			return TC_ACT_OK;
		in3 = icmp + 8;
		if (bpf_skb_load_bytes(skb, in3, hdr, 40) || hdr[6] != IPPROTO_TCP)
			return TC_ACT_OK;
		__builtin_memcpy(kp->daddr, &hdr[8], 16);
		__builtin_memcpy(kp->saddr, &hdr[24], 16);
		in4 = in3 + 40;
	} else {
		return TC_ACT_OK;
	}
	if (bpf_skb_load_bytes(skb, in4, hdr, 4))
		return TC_ACT_OK;
	kp->dport = *(__be16 *)&hdr[0];
	kp->sport = *(__be16 *)&hdr[2];
	kp->proto = IPPROTO_TCP;
	f = flow_get(kp, fo);
	if (!f || !(f->flags & FL_INGRESS))
		return TC_ACT_OK;
	/* The quote becomes the reverse of the flow's target (fo): the
	 * session as this host sees it on the side the packet was going. kp
	 * holds the quote's source and destination swapped. */
	{
		__u32 icsum = icmp + 2;
		__be16 nports[2] = {fo->dport, fo->sport}, oports[2] = {kp->dport, kp->sport};
		__u8 nsrc[16], ndst[16];

		__builtin_memcpy(nsrc, fo->daddr, 16);
		__builtin_memcpy(ndst, fo->saddr, 16);
		if (!v6) {
			__u32 *oa = (__u32 *)(sc->buf + 48), *na = (__u32 *)(sc->buf + 112);
			__builtin_memcpy(&oa[0], kp->daddr + 12, 4);
			__builtin_memcpy(&oa[1], kp->saddr + 12, 4);
			__builtin_memcpy(&na[0], nsrc + 12, 4);
			__builtin_memcpy(&na[1], ndst + 12, 4);
			/* The quoted header's checksum absorbs the address change,
			 * so the ICMP checksum sees only the ports change. */
			diff = bpf_csum_diff(oa, 8, na, 8, 0);
			if (bpf_l3_csum_replace(skb, in3 + 10, 0, diff, 0) ||
			    bpf_skb_store_bytes(skb, in3 + 12, na, 8, 0))
				goto fail;
		} else {
			__u32 *oa = (__u32 *)(sc->buf + 48), *na = (__u32 *)(sc->buf + 112);
			__builtin_memcpy(&oa[0], kp->daddr, 16);
			__builtin_memcpy(&oa[4], kp->saddr, 16);
			__builtin_memcpy(&na[0], nsrc, 16);
			__builtin_memcpy(&na[4], ndst, 16);
			diff = bpf_csum_diff(oa, 32, na, 32, 0);
			if (bpf_l4_csum_replace(skb, icsum, 0, diff, 0) ||
			    bpf_skb_store_bytes(skb, in3 + 8, na, 32, 0))
				goto fail;
		}
		diff = bpf_csum_diff((__u32 *)oports, 4, (__u32 *)nports, 4, 0);
		if (bpf_l4_csum_replace(skb, icsum, 0, diff, 0) || bpf_skb_store_bytes(skb, in4, nports, 4, 0))
			goto fail;
		/* Address it to the session's source if that is another host. */
		if (!is_local(nsrc)) {
			if (!v6) {
				__u32 od, nd;
				if (bpf_skb_load_bytes(skb, l3 + 16, &od, 4))
					goto fail;
				__builtin_memcpy(&nd, nsrc + 12, 4);
				if (bpf_l3_csum_replace(skb, l3 + 10, od, nd, 4) || bpf_skb_store_bytes(skb, l3 + 16, &nd, 4, 0))
					goto fail;
			} else {
				__u32 od[4];
				if (bpf_skb_load_bytes(skb, l3 + 24, od, 16))
					goto fail;
				diff = bpf_csum_diff(od, 16, (__u32 *)nsrc, 16, 0);
				if (bpf_l4_csum_replace(skb, icsum, 0, diff, BPF_F_PSEUDO_HDR) ||
				    bpf_skb_store_bytes(skb, l3 + 24, nsrc, 16, 0))
					goto fail;
			}
		}
	}
	stat_inc(STAT_ICMP);
	return TC_ACT_OK;
fail:
	stat_inc(STAT_DROP_HELPER);
	return TC_ACT_SHOT;
}

SEC("tc")
int dysco_ingress(struct __sk_buff *skb)
{
	__u32 k0 = 0;
	struct scratch *sc = bpf_map_lookup_elem(&dysco_scratch, &k0);
	struct dysco_ends *out;
	struct pkt p;
	struct flow_val *f;
	__u8 opt[DYSCO_OPT_LEN];

	if (!sc)
		return TC_ACT_OK;
	out = &sc->fout;
	if (parse(skb, &p))
		return ingress_icmp(skb);
	/* A flow applies at one hook only: a host that starts or ends a chain
	 * also forwards the session's plain packets, whose tuple keys its
	 * egress flow. */
	f = flow_get(&p.t, out);
	if (f && !(f->flags & FL_INGRESS))
		f = 0;
	if ((p.flags & (TH_SYN | TH_ACK)) == TH_SYN) {
		int otype = dysco_opt(skb, &p, opt);
		if (otype == DYSCO_OPT_TYPE_LOCAL_TAG) {
			/* A local tag never leaves the host that wrote it (§4.2):
			 * one from the wire is forged, and egress would continue
			 * the chain of the session it names with it. */
			stat_inc(STAT_DROP_MALFORMED);
			return TC_ACT_SHOT;
		}
		if (otype == DYSCO_OPT_TYPE_SYN_BLOCK && (!f || (f->flags & FL_SYN_STRIP)))
			return ingress_syn(skb, &p, opt, f);
	}
	if (f)
		return forward(skb, &p, f, out, 0);
	return TC_ACT_OK;
}

/* emit_syn sends the SYN of a session on to its next hop: it allocates the
 * subsession (ports claimed atomically through the reverse flow's key), writes
 * the marking option and the block with the rest of the list (§2.1), and
 * routes the packet to the next hop. */
static __always_inline int emit_syn(struct __sk_buff *skb, struct pkt *p, __u32 id, struct syn_state *st,
				    struct flow_val *known, int has_tag, __u8 *old_opt, struct scratch *sc)
{
	__u8 *buf = sc->buf;
	struct dysco_ends out = {};
	__u32 n = st->n_hops, blen, add, i;
	__u8 flags_role = 0;

	if (n == 0 || n > DYSCO_MAX_HOPS)
		return TC_ACT_SHOT;
	/* A SYN with a full option area cannot carry the appended marking
	 * option: refuse it before any flow or set-up state is made, so that
	 * nothing is left behind. */
	if (!has_tag && p->doff + DYSCO_OPT_LEN > 60) {
		stat_inc(STAT_DROP_OPT_SPACE);
		return TC_ACT_SHOT;
	}
	if (known) {
		out = known->out;
		stat_inc(STAT_SYN_RETRANS);
	} else {
		struct bpf_redir_neigh nh;
		struct dysco_ends *next = &sc->ends;
		struct dysco_tuple *rkey = &sc->rkey;
		struct flow_val *fwd = &sc->fwd, *rev = &sc->rev;
		struct session_val *s = bpf_map_lookup_elem(&dysco_sessions, &id);
		__u32 ifindex, r;
		int ok = 0;

		if (s && s->role == ROLE_MIDDLE)
			flags_role = FL_TAP;
		__builtin_memset(next, 0, sizeof(*next));
		__builtin_memset(fwd, 0, sizeof(*fwd));
		__builtin_memset(rev, 0, sizeof(*rev));
		__builtin_memcpy(next->daddr, st->hops[0], 16);
		if (route(skb, next, p->v6, &nh, &ifindex, out.saddr, p->t.saddr)) {
			stat_inc(STAT_DROP_NO_ROUTE);
			return TC_ACT_SHOT;
		}
		__builtin_memcpy(out.daddr, st->hops[0], 16);
		rev->sess_id = id;
		rev->flags = FL_INGRESS | FL_REV | flags_role;
		reverse_ends(&rev->out, &p->t);
		for (i = 0; i < ALLOC_TRIES; i++) {
			r = bpf_get_prandom_u32();
			out.sport = bpf_htons(port_lo + (__u16)((r & 0xffff) % port_n));
			out.dport = bpf_htons(port_lo + (__u16)((r >> 16) % port_n));
			reverse(rkey, &out);
			if (!flow_put(rkey, rev, BPF_NOEXIST, &sc->v4)) {
				ok = 1;
				break;
			}
		}
		if (!ok) {
			stat_inc(STAT_DROP_NO_PORT);
			return TC_ACT_SHOT;
		}
		fwd->out = out;
		fwd->sess_id = id;
		fwd->flags = FL_SYN_EMIT | (same_route(skb, p->v6, p->t.daddr, out.daddr) ? 0 : FL_REROUTE);
		fwd->packets = 1;
		fwd->bytes = skb->len;
		fwd->last_ms = stamp();
		reclaim(&p->t);
		if (flow_put(&p->t, fwd, BPF_NOEXIST, &sc->v4)) {
			flow_del(rkey);
			stat_inc(STAT_DROP_FLOWS_FULL);
			return TC_ACT_SHOT;
		}
		st->emitted = 1;
		bpf_map_update_elem(&dysco_syns, &id, st, BPF_ANY);
	}

	/* Option and block, built in scratch space. */
	blen = DYSCO_BLOCK_HEADER_LEN + (n - 1) * DYSCO_ADDR_LEN;
	buf[0] = DYSCO_OPT_KIND;
	buf[1] = DYSCO_OPT_LEN;
	buf[2] = DYSCO_OPT_EXID >> 8;
	buf[3] = DYSCO_OPT_EXID & 0xff;
	buf[4] = DYSCO_OPT_TYPE_SYN_BLOCK;
	buf[5] = 0;
	buf[6] = blen >> 8;
	buf[7] = blen & 0xff;
	{
		__u8 *b = buf + DYSCO_OPT_LEN;
		b[0] = (DYSCO_MAGIC >> 24) & 0xff;
		b[1] = (DYSCO_MAGIC >> 16) & 0xff;
		b[2] = (DYSCO_MAGIC >> 8) & 0xff;
		b[3] = DYSCO_MAGIC & 0xff;
		b[4] = DYSCO_VERSION;
		b[5] = 0;
		b[6] = n - 1;
		b[7] = 0;
		__builtin_memcpy(b + 8, st->nonce, DYSCO_NONCE_LEN);
		__builtin_memcpy(b + 16, st->session.saddr, 16);
		__builtin_memcpy(b + 32, st->session.daddr, 16);
		__builtin_memcpy(b + 48, &st->session.sport, 2);
		__builtin_memcpy(b + 50, &st->session.dport, 2);
		for (i = 1; i < DYSCO_MAX_HOPS; i++) {
			if (i >= n)
				break;
			copy16(b + DYSCO_BLOCK_HEADER_LEN + (i - 1) * DYSCO_ADDR_LEN, st->hops[i]);
		}
	}

	if (rewrite_tuple(skb, p, &out))
		goto fail;
	if (has_tag) {
		/* The tag's slot becomes the marking option: same place, same size. */
		__s64 diff = bpf_csum_diff((__u32 *)old_opt, DYSCO_OPT_LEN, (__u32 *)buf, DYSCO_OPT_LEN, 0);
		if (bpf_l4_csum_replace(skb, TCP_CSUM_OFF(p), 0, diff, 0) ||
		    bpf_skb_store_bytes(skb, p->l4 + p->doff - DYSCO_OPT_LEN, buf, DYSCO_OPT_LEN, 0))
			goto fail;
		add = blen;
	} else {
		/* Raise the data offset over the appended option (DESIGN: no
		 * memory is moved); the room was checked above. */
		if (set_doff(skb, p, p->doff + DYSCO_OPT_LEN) || csum_bytes(skb, p, buf, DYSCO_OPT_LEN, 0))
			goto fail;
		add = blen + DYSCO_OPT_LEN;
	}
	if (csum_bytes(skb, p, buf + DYSCO_OPT_LEN, blen, 0) || set_l3_len(skb, p, p->l3_len + add))
		goto fail;
	{
		__u32 at = skb->len;
		if (bpf_skb_change_tail(skb, at + add, 0))
			goto fail;
		if (add > DYSCO_OPT_LEN + DYSCO_MAX_BLOCK_LEN)
			goto fail;
		if (has_tag) {
			if (bpf_skb_store_bytes(skb, at, buf + DYSCO_OPT_LEN, add, 0))
				goto fail;
		} else if (bpf_skb_store_bytes(skb, at, buf, add, 0)) {
			goto fail;
		}
	}
	return redirect_to(skb, &out, p->v6);
fail:
	stat_inc(STAT_DROP_HELPER);
	return TC_ACT_SHOT;
}

/* remove_tag drops the local tag of a SYN that leaves the host plain (the
 * chain ends here, before the destination, §2.4). */
static __always_inline int remove_tag(struct __sk_buff *skb, struct pkt *p, __u8 *opt)
{
	if (set_doff(skb, p, p->doff - DYSCO_OPT_LEN) || csum_bytes(skb, p, opt, DYSCO_OPT_LEN, 1) ||
	    set_l3_len(skb, p, p->l3_len - DYSCO_OPT_LEN) || bpf_skb_change_tail(skb, skb->len - DYSCO_OPT_LEN, 0)) {
		stat_inc(STAT_DROP_HELPER);
		return TC_ACT_SHOT;
	}
	return TC_ACT_OK;
}

/* resolve_policy expands a policy's chain into st->hops: fixed addresses,
 * and middlebox types resolved to an instance round robin (§2.2). */
static __always_inline int resolve_policy(__u32 slot, const struct pkt *p, struct syn_state *st)
{
	struct policy_val *pol = bpf_map_lookup_elem(&dysco_policies, &slot);
	__u32 i, n = 0;

	if (!pol || pol->n_hops > DYSCO_MAX_HOPS)
		return -1;
	for (i = 0; i < DYSCO_MAX_HOPS; i++) {
		if (i >= pol->n_hops)
			break;
		if (pol->kind[i] == HOP_ADDR) {
			__builtin_memcpy(st->hops[n], pol->addr[i], 16);
		} else if (pol->kind[i] == HOP_TYPE) {
			__u32 tid = pol->type[i];
			struct type_val *t = bpf_map_lookup_elem(&dysco_types, &tid);
			__u32 k;
			if (!t || t->n == 0 || t->n > MAX_INSTANCES)
				return -1;
			k = __sync_fetch_and_add(&t->rr, 1) % t->n;
			if (k >= MAX_INSTANCES)
				return -1;
			__builtin_memcpy(st->hops[n], t->addr[k], 16);
		} else {
			return -1;
		}
		n++;
	}
	/* A chain of the other address family cannot carry this session:
	 * fail closed rather than send it anywhere else. */
	for (i = 0; i < DYSCO_MAX_HOPS; i++) {
		if (i >= n)
			break;
		if (is_mapped4(st->hops[i]) == p->v6)
			return -1;
	}
	if (pol->to_dst) {
		if (n >= DYSCO_MAX_HOPS)
			return -1;
		__builtin_memcpy(st->hops[n], p->t.daddr, 16);
		n++;
	}
	if (n == 0)
		return -1;
	st->n_hops = n;
	return 0;
}

/* dysco_setup handles SYNs on egress, reached by tail call: new sessions
 * after the policy program chose a policy (or none), and SYNs of sessions
 * already being set up on this host. */
SEC("tc")
int dysco_setup(struct __sk_buff *skb)
{
	__u32 k0 = 0, mode = skb->cb[CB_MODE], id;
	struct scratch *sc = bpf_map_lookup_elem(&dysco_scratch, &k0);
	struct flow_val *f, *known = 0;
	struct syn_state *st;
	struct pkt p;
	__u8 opt[DYSCO_OPT_LEN];
	int otype, rc;

	if (!sc || parse(skb, &p))
		return TC_ACT_SHOT;
	otype = dysco_opt(skb, &p, opt);
	st = &sc->st;
	if (mode == SETUP_NEW) {
		__u32 slot = skb->cb[CB_POLICY];
		struct session_val *s = &sc->sess;
		__u64 r;

		if (slot == 0)
			return TC_ACT_OK; /* no policy matches */
		__builtin_memset(st, 0, sizeof(*st));
		if (resolve_policy(slot - 1, &p, st)) {
			stat_inc(STAT_DROP_BAD_POLICY);
			return TC_ACT_SHOT;
		}
		if (p.payload) {
			stat_inc(STAT_DROP_SYN_DATA);
			return TC_ACT_SHOT;
		}
		st->session = p.t;
		r = ((__u64)bpf_get_prandom_u32() << 32) | bpf_get_prandom_u32();
		__builtin_memcpy(st->nonce, &r, DYSCO_NONCE_LEN);
		__builtin_memset(s, 0, sizeof(*s));
		ends_of(&s->tuple, &p.t);
		s->created_ms = s->last_ms = stamp();
		__builtin_memcpy(s->nonce, st->nonce, DYSCO_NONCE_LEN);
		s->state = ST_SYN;
		s->policy = (__u16)slot;
		s->role = ROLE_START;
		s->is_v6 = p.v6;
		handshake(skb, &p, s);
		if (alloc_session(s, &id))
			return TC_ACT_SHOT;
		stat_inc(STAT_SETUP_START);
	} else {
		struct syn_state *saved;

		f = flow_get(&p.t, &sc->known.out);
		if (f && (f->flags & FL_INGRESS))
			f = 0;
		if (f) {
			if (!(f->flags & FL_SYN_EMIT))
				return TC_ACT_OK;
			__builtin_memcpy(&sc->known, f, FLOW_HEAD_LEN);
			known = &sc->known;
			id = known->sess_id;
		} else if (otype == DYSCO_OPT_TYPE_LOCAL_TAG) {
			id = ((__u32)opt[5] << 16) | ((__u32)opt[6] << 8) | opt[7];
		} else {
			return TC_ACT_OK;
		}
		saved = bpf_map_lookup_elem(&dysco_syns, &id);
		if (!saved) {
			stat_inc(STAT_DROP_NO_SYN_STATE);
			return TC_ACT_SHOT;
		}
		__builtin_memcpy(st, saved, sizeof(*st));
		if (st->n_hops == 0) {
			/* The chain ends here; the SYN goes on plain (§2.4). */
			if (otype == DYSCO_OPT_TYPE_LOCAL_TAG)
				return remove_tag(skb, &p, opt);
			return TC_ACT_OK;
		}
		/* A SYN out of the middlebox continues the chain with the tuple
		 * it has now: a NAT may have changed it (§2.1). */
		if (!known)
			st->session = p.t;
	}
	rc = emit_syn(skb, &p, id, st, known, otype == DYSCO_OPT_TYPE_LOCAL_TAG, opt, sc);
	if (rc == TC_ACT_SHOT && mode == SETUP_NEW && !st->emitted)
		bpf_map_delete_elem(&dysco_sessions, &id);
	return rc;
}

SEC("tc")
int dysco_egress(struct __sk_buff *skb)
{
	__u32 k0 = 0;
	struct scratch *sc = bpf_map_lookup_elem(&dysco_scratch, &k0);
	struct dysco_ends *out;
	struct pkt p;
	struct flow_val *f;
	__u8 opt[DYSCO_OPT_LEN];

	if (!sc)
		return TC_ACT_OK;
	out = &sc->fout;
	if (parse(skb, &p))
		return TC_ACT_OK;
	f = flow_get(&p.t, out);
	if (f && (f->flags & FL_INGRESS))
		f = 0;
	/* A SYN on the tuple of a session that has ended begins a new one. */
	if ((p.flags & (TH_SYN | TH_ACK)) == TH_SYN && f && (f->flags & FL_SYN_EMIT) && ended(f) && reclaim(&p.t))
		f = 0;
	if ((p.flags & (TH_SYN | TH_ACK)) == TH_SYN && (!f || (f->flags & FL_SYN_EMIT))) {
		int otype = dysco_opt(skb, &p, opt);
		if (otype == DYSCO_OPT_TYPE_SYN_BLOCK)
			return TC_ACT_OK; /* already a subsession SYN */
		if (f || otype == DYSCO_OPT_TYPE_LOCAL_TAG) {
			skb->cb[CB_MODE] = SETUP_CONT;
			bpf_tail_call(skb, &dysco_progs, PROG_SETUP);
			stat_inc(STAT_DROP_NO_SETUP);
			return TC_ACT_SHOT;
		}
		skb->cb[CB_MODE] = SETUP_NEW;
		skb->cb[CB_POLICY] = 0;
		bpf_tail_call(skb, &dysco_progs, PROG_POLICY);
		return TC_ACT_OK; /* no policies installed */
	}
	if (f)
		return forward(skb, &p, f, out, 1);
	return TC_ACT_OK;
}

/* dysco_tap_drop runs on the ingress of the session-view tap: capture tools
 * saw the copy before tc; the stack must not see it again. */
SEC("tc")
int dysco_tap_drop(struct __sk_buff *skb)
{
	return TC_ACT_SHOT;
}

/* session_flow frees (CTL_FREE) or cuts (CTL_CUT) the flow at k if it is
 * session id's (a tuple may be reused by a newer session): a freed flow
 * goes with its delta; a cut ingress flow goes, a cut egress flow drops
 * what it sees. Returns 1 if the flow was the session's. */
static __attribute__((noinline)) int session_flow(const struct dysco_tuple *k, __u32 id, __u32 op)
{
	struct flow_val *f = flow_get(k, 0);

	if (!f || f->sess_id != id)
		return 0;
	if (op == CTL_CUT && !(f->flags & FL_INGRESS)) {
		__sync_fetch_and_or(&f->flags, FL_DROP);
		return 1;
	}
	flow_del(k);
	bpf_map_delete_elem(&dysco_deltas, k);
	return 1;
}

/* session_flows applies session_flow to every flow of session id at this
 * host, found from its tuple without walking the flow map (as the agent's
 * flowKeysOf does): the egress flow of each direction, the ingress flow of
 * the subsession each sends on, and the flows of the subsessions in its
 * two-path records. Behind a middlebox that changes the five-tuple (a
 * NAT), the egress flow of the SYN's direction is keyed by the middlebox's
 * output, which the datapath does not keep: the agent gives it as onward
 * (its proto 0: none; agent/onward.go). Returns how many flows were the
 * session's. */
static __attribute__((noinline)) int session_flows(__u32 id, __u32 op, const struct dysco_tuple *onward)
{
	struct session_val *s = bpf_map_lookup_elem(&dysco_sessions, &id);
	struct dysco_tuple k, in;
	struct dysco_ends out;
	struct flow_val *f;
	struct tp_val *tp;
	struct tp_key tk = {.sess_id = id};
	int n = 0, d;

	if (!s)
		return 0;
	for (d = 0; d < 3; d++) {
		if (d == 0) {
			__builtin_memcpy(k.saddr, s->tuple.saddr, 16);
			__builtin_memcpy(k.daddr, s->tuple.daddr, 16);
			k.sport = s->tuple.sport;
			k.dport = s->tuple.dport;
			k.proto = IPPROTO_TCP;
			k.pad[0] = k.pad[1] = k.pad[2] = 0;
		} else if (d == 1) {
			reverse(&k, &s->tuple);
		} else {
			if (onward->proto != IPPROTO_TCP)
				break;
			__builtin_memcpy(&k, onward, sizeof(k));
			k.pad[0] = k.pad[1] = k.pad[2] = 0;
		}
		f = flow_get(&k, &out);
		if (!f || f->sess_id != id)
			continue;
		reverse(&in, &out);
		n += session_flow(&k, id, op);
		n += session_flow(&in, id, op);
	}
	for (d = SIDE_LEFT; d <= SIDE_RIGHT; d++) {
		tk.side = d;
		tp = bpf_map_lookup_elem(&dysco_tp, &tk);
		if (!tp)
			continue;
		__builtin_memcpy(&k, &tp->in_old, sizeof(k));
		/* new_out is a tuple; its ends are its first 36 bytes. */
		reverse(&in, (const struct dysco_ends *)&tp->new_out);
		n += session_flow(&k, id, op);
		n += session_flow(&in, id, op);
	}
	return n;
}

/* free_reconf deletes what reconfigurations left of session id: its
 * two-path records, the requests behind them, a kept lock and a proxy's
 * joined sessions. */
static __attribute__((noinline)) void free_reconf(__u32 id)
{
	struct tp_key tk = {.sess_id = id};
	int side;

	for (side = SIDE_LEFT; side <= SIDE_RIGHT; side++) {
		tk.side = side;
		bpf_map_delete_elem(&dysco_tp, &tk);
		bpf_map_delete_elem(&dysco_tp_req, &tk);
	}
	tk.side = SIDE_LOCK;
	bpf_map_delete_elem(&dysco_tp_req, &tk);
	tk.side = SIDE_SPLICE;
	bpf_map_delete_elem(&dysco_tp_req, &tk);
}

/* add_sub installs a side's new subsession (§3.1; the agent's
 * control.addSub): the request behind it (for an agent that restarts), the
 * side's two-path record, the new ingress flow's translation and the flow,
 * then the flags that point the side's egress flow and its old ingress flow
 * at the record, in this order: one system call instead of six, on the
 * critical path of both anchors (BENCHMARKS.md, "One command to install").
 * Returns 0, 1 when all but the request was installed (the agent warns:
 * only its restart in the middle could not resume), or a negative errno of
 * the step that failed (the steps before it stay, as they did when the
 * agent made them one by one). The values go through dysco_ctl_buf: a
 * helper does not take them from the context. */
static __always_inline int add_sub(struct ctl_args *a, const struct dysco_tuple *key, const struct tp_key *tk)
{
	struct dysco_tuple eg, in_old;
	struct flow_val4 tmp;
	struct flow_val *fp;
	struct ctl_args *b;
	int kept_req = 1;
	__u32 zero = 0;
	long err;

	b = bpf_map_lookup_elem(&dysco_ctl_buf, &zero);
	if (!b)
		return -12; /* ENOMEM */
	__builtin_memcpy(&b->req, &a->req, sizeof(b->req));
	__builtin_memcpy(&b->tpv, &a->tpv, sizeof(b->tpv));
	__builtin_memcpy(&b->delta, &a->delta, sizeof(b->delta));
	__builtin_memcpy(&b->flow, &a->flow, sizeof(b->flow));
	if (bpf_map_update_elem(&dysco_tp_req, tk, &b->req, BPF_ANY))
		kept_req = 0;
	err = bpf_map_update_elem(&dysco_tp, tk, &b->tpv, BPF_ANY);
	if (err)
		return err;
	err = bpf_map_update_elem(&dysco_deltas, key, &b->delta, BPF_ANY);
	if (err)
		return err;
	err = flow_put(key, &b->flow, BPF_NOEXIST, &tmp);
	if (err)
		return err;
	__builtin_memcpy(&eg, &b->tpv.eg_key, sizeof(eg));
	__builtin_memcpy(&in_old, &b->tpv.in_old, sizeof(in_old));
	fp = flow_get(&eg, 0);
	if (!fp)
		return -2; /* ENOENT */
	__sync_fetch_and_or(&fp->flags, FL_TP_OUT);
	fp = flow_get(&in_old, 0);
	if (!fp)
		return -2;
	__sync_fetch_and_or(&fp->flags, FL_TP_OLD);
	return kept_req ? 0 : 1;
}

/* dysco_ctl carries out a command of the agent inside the kernel, where it
 * is atomic with respect to the datapath's own updates of the same entries
 * (a map update from user space would replace the entry and lose the
 * counters and marks the datapath wrote meanwhile). Run with BPF_PROG_RUN;
 * the return value is 0 (CTL_FREE and CTL_CUT: the number of flows of the
 * session) or a negative errno. */
SEC("syscall")
int dysco_ctl(struct ctl_args *a)
{
	struct dysco_tuple key;
	struct tp_key tk;
	struct flow_val *fp;
	struct tp_val *tp;
	__u32 op = a->op, arg = a->arg;

	__builtin_memcpy(&key, &a->key, sizeof(key));
	__builtin_memcpy(&tk, &a->tp, sizeof(tk));
	if (op == CTL_MARKS_MERGE) {
		/* Marks are in session space, whatever the subsession: a side's
		 * new ingress flow inherits the old one's (a later cut-off must
		 * know what arrived on every earlier path). */
		struct dysco_tuple key2;
		struct flow_val *dst;
		__builtin_memcpy(&key2, &a->key2, sizeof(key2));
		fp = flow_get(&key, 0);
		dst = flow_get(&key2, 0);
		if (!fp || !dst)
			return -2;
		if (!(fp->flags & FL_MARKS))
			return 0;
		if (!(dst->flags & FL_MARKS)) {
			dst->mk_seq = fp->mk_seq;
			dst->mk_ack = fp->mk_ack;
			__sync_fetch_and_or(&dst->flags, FL_MARKS);
			return 0;
		}
		if (mark_newer(fp->mk_seq, dst->mk_seq))
			dst->mk_seq = fp->mk_seq;
		if (mark_newer(fp->mk_ack, dst->mk_ack))
			dst->mk_ack = fp->mk_ack;
		return 0;
	}
	if (op == CTL_FLAGS_SET || op == CTL_FLAGS_CLEAR) {
		fp = flow_get(&key, 0);
		if (!fp)
			return -2; /* ENOENT */
		if (op == CTL_FLAGS_SET)
			__sync_fetch_and_or(&fp->flags, arg);
		else
			__sync_fetch_and_and(&fp->flags, ~arg);
		return 0;
	}
	/* Freeing a session's state: one system call for what would be
	 * some thirty map operations from user space. */
	if (op == CTL_FREE) {
		__u32 id = tk.sess_id;
		int n = session_flows(id, CTL_FREE, &key);

		free_reconf(id);
		bpf_map_delete_elem(&dysco_syns, &id);
		bpf_map_delete_elem(&dysco_sessions, &id);
		return n;
	}
	if (op == CTL_CUT)
		return session_flows(tk.sess_id, CTL_CUT, &key);
	if (op == CTL_ADD_SUB)
		return add_sub(a, &key, &tk);
	if (op == CTL_FREE_RECONF) {
		free_reconf(tk.sess_id);
		return 0;
	}
	if (op == CTL_CLOSED) {
		/* A middlebox that joined a new path learns of FINs that the
		 * old path carried (the anchors' closed notice): the collector
		 * then ends the session as if it had seen them, after the
		 * close linger from now. */
		struct session_val *s = bpf_map_lookup_elem(&dysco_sessions, &tk.sess_id);

		if (!s)
			return -2;
		__sync_fetch_and_or(&s->state, arg & (ST_FIN_FWD | ST_FIN_REV));
		s->last_ms = a->stamp;
		return 0;
	}
	tp = bpf_map_lookup_elem(&dysco_tp, &tk);
	if (!tp)
		return -2;
	switch (op) {
	case CTL_TP_START:
		return tp_start(tp, &tk, 1) ? -16 /* EBUSY */ : 0;
	case CTL_TP_STATE:
		__sync_lock_test_and_set(&tp->state, arg);
		tp_report(tp, &tk, 1);
		return 0;
	case CTL_TP_CLAMP:
		tp->clamp = arg;
		return 0;
	}
	return -22; /* EINVAL */
}
