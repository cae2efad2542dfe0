/* SPDX-License-Identifier: (GPL-2.0-only OR MIT) */
/* UDP sessions: the chain of §2.1 for a protocol without a SYN.
 *
 * Set-up. The first datagram of a new UDP five-tuple that a policy matches
 * starts the chain: it carries the address-list block (the SYN's, with the
 * protocol byte UDP and the session's idle timeouts) after its data, closed
 * by an 8-byte marker that is the datagram's last 8 bytes
 * (wire.UDPMarker), with a zero byte before the block if the data's length
 * is odd, so that the block's checksum is summed at an even offset. Each
 * hop's ingress checks and admits the block (check_block, admit.h), records
 * the session and strips block and marker before netfilter, the middlebox
 * or the application sees the datagram: they see the session's datagram,
 * unchanged. On a middlebox host the datagram leaves the middlebox with a
 * socket mark (UDP_SETUP_MARK and the session id) that links it to its
 * session on egress, the TCP SYN's local tag: a NAT may have changed its
 * tuple. Egress then sends it on its next subsession with the block of the
 * hops after. A datagram thus never reaches a host before its subsession
 * there exists, and set-up neither holds, reorders nor adds a datagram.
 *
 * Until the next hop answers (a datagram of the session arrives back on
 * the subsession: it has the session), every datagram a host sends on the
 * subsession carries the block again, as a retransmitted SYN does; at most
 * UDP_BLOCK_DATAGRAMS of them, so that a one-way session stops paying for
 * it. The receiver takes a block on a known subsession as a retransmission.
 *
 * Lifetime. No FIN: the collector ends a UDP session after an idle time,
 * one-way before it has carried datagrams both ways (ST_EST) and both-ways
 * after, from the policy (session_val.idle_s) or the agent's defaults.
 *
 * Provides: udp_marker, ingress_udp (ingress); emit_udp, udp_setup_cont
 * (egress, dysco_setup); forward_udp (both).
 * Expects: p parsed from skb with p->udp set. Scratch space as syn.h.
 * Maps: as syn.h and forward.h. */
#ifndef DYSCO_UDP_H
#define DYSCO_UDP_H

#include <linux/bpf.h>
#include <linux/pkt_cls.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>
#include "maps.h"
#include "parsing.h"
#include "flows.h"
#include "rewrite.h"
#include "config.h"
#include "tuple.h"
#include "session.h"
#include "route.h"
#include "admit.h"
#include "syn.h"
#include "twopath.h"

/* A datagram's socket mark between ingress and egress of a middlebox host,
 * while it carries a block: the top byte, and the session id below. */
#define UDP_SETUP_MARK 0xd5000000
#define UDP_SETUP_MASK 0xff000000
/* Datagrams of a subsession that carry the block at most, without an
 * answer from the next hop. */
#define UDP_BLOCK_DATAGRAMS 8

/* udp_setup_id gives the session id of a datagram that the ingress of this
 * host marked, or 0. */
static __always_inline __u32 udp_setup_id(struct __sk_buff *skb)
{
	if ((skb->mark & UDP_SETUP_MASK) != UDP_SETUP_MARK)
		return 0;
	return skb->mark & SESS_ID_MASK;
}

/* udp_control tells whether the datagram belongs to the agents' control
 * channel, which is never chained (it carries the protocol that changes
 * chains). */
static __always_inline int udp_control(const struct pkt *p)
{
	return ctl_port && (p->t.sport == bpf_htons(ctl_port) || p->t.dport == bpf_htons(ctl_port));
}

/* udp_marker reads the datagram's last 8 bytes into m and tells whether they
 * are a block's marker. A GSO packet never carries one (the sender appends
 * blocks to single datagrams only). */
static __always_inline int udp_marker(struct __sk_buff *skb, const struct pkt *p, __u8 *m)
{
	if (p->payload < DYSCO_OPT_LEN + DYSCO_BLOCK_HEADER_LEN || skb->gso_size)
		return 0;
	if (bpf_skb_load_bytes(skb, p->l3 + p->l3_len - DYSCO_OPT_LEN, m, DYSCO_OPT_LEN))
		return 0;
	return m[0] == DYSCO_OPT_KIND && m[1] == DYSCO_OPT_LEN && m[2] == (DYSCO_OPT_EXID >> 8) &&
	       m[3] == (DYSCO_OPT_EXID & 0xff) && m[4] == DYSCO_OPT_TYPE_UDP_BLOCK;
}

/* udp_strip removes pad, block (blen bytes, in b) and marker m from the end
 * of the datagram. */
static __always_inline int udp_strip(struct __sk_buff *skb, struct pkt *p, __u8 *b, __u32 blen, __u8 *m, __u32 pad)
{
	__u32 cut = pad + blen + DYSCO_OPT_LEN;

	if (blen > DYSCO_MAX_BLOCK_LEN || csum_bytes(skb, p, b, blen, 1) || csum_bytes(skb, p, m, DYSCO_OPT_LEN, 1) ||
	    set_l3_len(skb, p, p->l3_len - cut) || bpf_skb_change_tail(skb, p->l3 + p->l3_len, 0))
		return -1;
	p->payload -= cut;
	return 0;
}

/* ingress_udp handles a datagram that carries a block (§2.1): it checks the
 * block, records the session and its two flows on this side (known: the
 * ingress flow of a block seen before), strips the block, rewrites the
 * datagram to the session tuple and hands it to the stack. */
static __attribute__((noinline)) int ingress_udp(struct __sk_buff *skb, struct pkt *p, __u8 *m, struct flow_val *known)
{
	__u32 k0 = 0, blen, pad, n, id, at;
	struct scratch *sc = bpf_map_lookup_elem(&dysco_scratch, &k0);
	struct syn_state *st;
	__u8 *b;
	int local_dst, keep, rc;

	if (!sc)
		return TC_ACT_SHOT;
	st = &sc->st;
	b = sc->buf;
	pad = m[5];
	blen = ((__u32)m[6] << 8) | m[7];
	if (pad > 1 || blen < DYSCO_BLOCK_HEADER_LEN || blen > DYSCO_MAX_BLOCK_LEN ||
	    pad + blen + DYSCO_OPT_LEN > p->payload) {
		stat_inc(STAT_DROP_BAD_LENGTH);
		return TC_ACT_SHOT;
	}
	at = p->l3 + p->l3_len - DYSCO_OPT_LEN - blen;
	if (bpf_skb_load_bytes(skb, at, b, blen)) {
		stat_inc(STAT_DROP_MALFORMED);
		return TC_ACT_SHOT;
	}
	rc = check_block(p, b, blen, st, IPPROTO_UDP);
	if (rc) {
		stat_inc(rc);
		return TC_ACT_SHOT;
	}
	n = st->n_hops;
	local_dst = is_local(st->session.daddr);
	keep = n > 0 || !local_dst;
	if (known) {
		/* A block again on a known subsession: the previous hop has
		 * not heard back yet. Same session, same flows. */
		id = known->sess_id;
		count(known, skb->len);
		stat_inc(STAT_SYN_RETRANS);
	} else {
		struct session_val *s = &sc->sess;
		struct flow_val *in = &sc->fwd, *out = &sc->rev;
		struct dysco_tuple *rkey = &sc->rkey;
		__u64 src = ho_source(p->t.saddr);

		/* Half-open until a datagram comes back (admit.h). */
		if (ho_over(src)) {
			stat_inc(STAT_DROP_HALF_OPEN);
			return TC_ACT_SHOT;
		}
		__builtin_memset(s, 0, sizeof(*s));
		__builtin_memset(in, 0, sizeof(*in));
		__builtin_memset(out, 0, sizeof(*out));
		s->ho_src = src;
		ends_of(&s->tuple, &st->session);
		s->created_ms = s->last_ms = stamp();
		__builtin_memcpy(s->nonce, st->nonce, DYSCO_NONCE_LEN);
		s->state = ST_SYN;
		s->role = n > 0 ? ROLE_MIDDLE : (local_dst ? ROLE_END : ROLE_END_FWD);
		s->is_v6 = p->v6;
		s->proto = IPPROTO_UDP;
		s->idle_s[0] = st->idle_s[0];
		s->idle_s[1] = st->idle_s[1];
		if (alloc_session(s, &id))
			return TC_ACT_SHOT;
		ends_of(&in->out, &st->session);
		in->sess_id = id;
		in->flags = FL_INGRESS | FL_SYN_STRIP | (s->role != ROLE_END ? FL_TAP : 0);
		reverse(rkey, &in->out, IPPROTO_UDP);
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
		if (keep && bpf_map_update_elem(&dysco_syns, &id, st, BPF_ANY)) {
			flow_del(&p->t);
			flow_del(rkey);
			bpf_map_delete_elem(&dysco_sessions, &id);
			stat_inc(STAT_DROP_SESSIONS_FULL);
			return TC_ACT_SHOT;
		}
		/* The session's tuple links the datagram to its session on
		 * egress too, should the middlebox overwrite the mark (a
		 * CONNMARK restore): a pending flow, replaced by the
		 * subsession's (setup_udp). */
		if (keep) {
			__builtin_memset(in, 0, sizeof(*in));
			in->sess_id = id;
			in->flags = FL_SYN_EMIT | FL_PENDING;
			flow_put(&st->session, in, BPF_NOEXIST, &sc->v4);
		}
		ho_take(src);
		stat_inc(n > 0 ? STAT_SETUP_CONT : STAT_SETUP_END);
	}
	ends_of(&sc->ends, &st->session);
	if (udp_strip(skb, p, b, blen, m, pad) || rewrite_tuple(skb, p, &sc->ends)) {
		stat_inc(STAT_DROP_HELPER);
		return TC_ACT_SHOT;
	}
	/* Egress finds the session by this mark if a NAT changes the tuple. */
	if (keep && (skb->mark == 0 || udp_setup_id(skb)))
		skb->mark = UDP_SETUP_MARK | id;
	if (keep && tap_on()) {
		bpf_clone_redirect(skb, tap_ifindex, BPF_F_INGRESS);
		stat_inc(STAT_TAP);
	}
	return TC_ACT_OK;
}

/* emit_udp sends a datagram of session id on its subsession to the next
 * hop with the block of the hops after: known's, or else the one just made
 * in sc->sub (new_subsession). The chain is in sc->st. */
static __attribute__((noinline)) int emit_udp(struct __sk_buff *skb, struct pkt *p, __u32 id,
					      struct flow_val *known, struct scratch *sc)
{
	struct syn_state *st = &sc->st;
	__u8 *buf = sc->buf;
	struct dysco_ends *out = &sc->sub;
	__u32 n = st->n_hops, blen, pad = p->payload & 1, add, at, i, mtu = 0;

	if (n == 0 || n > DYSCO_MAX_HOPS)
		return TC_ACT_SHOT;
	blen = DYSCO_BLOCK_HEADER_LEN + (n - 1) * DYSCO_ADDR_LEN + DYSCO_UDP_EXT_LEN;
	add = pad + blen + DYSCO_OPT_LEN;
	/* A datagram that cannot carry the block is refused before any state
	 * is made: a GSO packet (its segments are cut later), or one that the
	 * block would take past the MTU. */
	if (skb->gso_size) {
		stat_inc(STAT_DROP_SETUP_GSO);
		return TC_ACT_SHOT;
	}
	if (bpf_check_mtu(skb, 0, &mtu, add, 0)) {
		stat_inc(STAT_DROP_SETUP_MTU);
		return TC_ACT_SHOT;
	}
	if (!known && !st->emitted)
		return TC_ACT_SHOT;
	if (known) {
		*out = known->out;
		stat_inc(STAT_SYN_RETRANS);
	} else if (!st->emitted) {
		goto fail; /* the caller makes the subsession (new_subsession) */
	}
	{
		__u8 *b = buf;
		b[0] = (DYSCO_MAGIC >> 24) & 0xff;
		b[1] = (DYSCO_MAGIC >> 16) & 0xff;
		b[2] = (DYSCO_MAGIC >> 8) & 0xff;
		b[3] = DYSCO_MAGIC & 0xff;
		b[4] = DYSCO_VERSION;
		b[5] = 0;
		b[6] = n - 1;
		b[7] = DYSCO_PROTO_UDP;
		__builtin_memcpy(b + 8, st->nonce, DYSCO_NONCE_LEN);
		__builtin_memcpy(b + 16, st->session.saddr, 16);
		__builtin_memcpy(b + 32, st->session.daddr, 16);
		__builtin_memcpy(b + 48, &st->session.sport, 2);
		__builtin_memcpy(b + 50, &st->session.dport, 2);
		__builtin_memset(b + DYSCO_MAC_OFF, 0, DYSCO_MAC_LEN);
		for (i = 1; i < DYSCO_MAX_HOPS; i++) {
			if (i >= n)
				break;
			copy16(b + DYSCO_BLOCK_HEADER_LEN + (i - 1) * DYSCO_ADDR_LEN, st->hops[i]);
		}
		if (blen > DYSCO_MAX_BLOCK_LEN || blen < DYSCO_BLOCK_HEADER_LEN + DYSCO_UDP_EXT_LEN)
			goto fail;
		b[blen - 8] = st->idle_s[0] >> 8;
		b[blen - 7] = st->idle_s[0] & 0xff;
		b[blen - 6] = st->idle_s[1] >> 8;
		b[blen - 5] = st->idle_s[1] & 0xff;
		__builtin_memset(b + blen - 4, 0, 4);
		/* Signed for the subsession it goes on (admit.h). */
		syn_sign(b, blen, out);
		/* The marker, after the block. */
		b[blen] = DYSCO_OPT_KIND;
		b[blen + 1] = DYSCO_OPT_LEN;
		b[blen + 2] = DYSCO_OPT_EXID >> 8;
		b[blen + 3] = DYSCO_OPT_EXID & 0xff;
		b[blen + 4] = DYSCO_OPT_TYPE_UDP_BLOCK;
		b[blen + 5] = pad;
		b[blen + 6] = blen >> 8;
		b[blen + 7] = blen & 0xff;
	}
	if (rewrite_tuple(skb, p, out))
		goto fail;
	at = p->l3 + p->l3_len;
	if (set_l3_len(skb, p, p->l3_len + add) || bpf_skb_change_tail(skb, at + add, 0))
		goto fail;
	if (pad) {
		__u8 z = 0;
		if (bpf_skb_store_bytes(skb, at, &z, 1, 0))
			goto fail;
	}
	if (blen > DYSCO_MAX_BLOCK_LEN)
		goto fail;
	if (bpf_skb_store_bytes(skb, at + pad, buf, blen + DYSCO_OPT_LEN, 0) ||
	    csum_bytes(skb, p, buf, blen + DYSCO_OPT_LEN, 0))
		goto fail;
	return redirect_to(skb, out, p->v6);
fail:
	stat_inc(STAT_DROP_HELPER);
	return TC_ACT_SHOT;
}

/* udp_answered clears the block rule of the egress flow whose subsession
 * the ingress flow with target out answers (the next hop has the session
 * id). Its own frame: the key is not on the caller's stack. */
static __attribute__((noinline)) void udp_answered(const struct dysco_ends *out, __u32 id)
{
	struct dysco_tuple k;
	struct flow_val *e;

	reverse(&k, out, IPPROTO_UDP);
	e = flow_get(&k, 0);
	if (e && e->sess_id == id && (e->flags & FL_SYN_EMIT))
		__sync_fetch_and_and(&e->flags, ~FL_SYN_EMIT);
}

/* udp6_zero tells whether the datagram is an IPv6 one whose checksum field
 * is zero: no checksum, which IPv6 allows only for tunnels (RFC 6935). The
 * rewrite cannot update what was never computed; udp6_sum computes it. */
static __always_inline int udp6_zero(struct __sk_buff *skb, const struct pkt *p)
{
	__u16 ck = 1;

	if (!p->v6 || !p->udp || skb->gso_size || skb_ip_summed(skb) == CSUM_PARTIAL)
		return 0;
	bpf_skb_load_bytes(skb, p->l4 + 6, &ck, 2);
	return ck == 0;
}

/* udp6_chunk adds the next chunk of the segment to the sum (a bpf_loop
 * step); the last chunk is padded with zeros to a multiple of 4 bytes,
 * which adds nothing. */
struct udp6_loop {
	struct __sk_buff *skb;
};

static long udp6_chunk(__u32 i, void *ctx)
{
	struct __sk_buff *skb = ((struct udp6_loop *)ctx)->skb;
	__u32 k0 = 0, n;
	struct scratch *sc = bpf_map_lookup_elem(&dysco_scratch, &k0);
	__s64 s;

	if (!sc || sc->at >= sc->end)
		return 1;
	n = sc->end - sc->at;
	if (n > sizeof(sc->chunk))
		n = sizeof(sc->chunk);
	__builtin_memset(sc->chunk, 0, sizeof(sc->chunk));
	if (n == 0 || n > sizeof(sc->chunk) || bpf_skb_load_bytes(skb, sc->at, sc->chunk, n))
		return 1;
	s = bpf_csum_diff(0, 0, (__be32 *)sc->chunk, (n + 3) & ~3u, sc->sum);
	if (s < 0)
		return 1;
	sc->sum = (__u32)s;
	sc->at += n;
	return 0;
}

/* udp6_sum writes the full UDP checksum of an IPv6 datagram that has none
 * (udp6_zero), so that the rewrite can update it as any other: the pseudo
 * header, then the segment, chunk by chunk. Segments longer than
 * UDP6_SUM_MAX are refused: 0, or -1 for a drop. */
static __attribute__((noinline)) int udp6_sum(struct __sk_buff *skb, struct pkt *p, struct scratch *sc)
{
	__u32 len = p->l3_len - (p->l4 - p->l3), w[10];
	struct udp6_loop lc = {.skb = skb};
	__u16 ck;
	__s64 s;

	if (len < 8 || len > UDP6_SUM_MAX)
		return -1;
	__builtin_memcpy(w, p->t.saddr, 16);
	__builtin_memcpy(w + 4, p->t.daddr, 16);
	w[8] = bpf_htonl(len);
	w[9] = bpf_htonl(IPPROTO_UDP);
	s = bpf_csum_diff(0, 0, w, sizeof(w), 0);
	if (s < 0)
		return -1;
	sc->sum = (__u32)s;
	sc->at = p->l4;
	sc->end = p->l4 + len;
	bpf_loop(UDP6_SUM_MAX / sizeof(sc->chunk) + 1, udp6_chunk, &lc, 0);
	if (sc->at != sc->end)
		return -1;
	ck = ~csum_fold(sc->sum);
	if (ck == 0)
		ck = 0xffff;
	return bpf_skb_store_bytes(skb, p->l4 + 6, &ck, 2, BPF_F_RECOMPUTE_CSUM) ? -1 : 0;
}

/* udp_tp_egress sends a datagram of a side with a two-path record (§3.5 for
 * UDP, docs/protocol.md "UDP sessions"): on the new path once the side has
 * switched (TP_ACTIVE: its anchor switched; TP_NEW: the old path is gone),
 * on the old path before; the old path is the record's (after an earlier
 * reconfiguration, its new path), not the flow's own target. No deltas, no
 * cut-off. Returns -1 without a record, else a TC verdict. */
static __attribute__((noinline)) int udp_tp_egress(struct __sk_buff *skb, struct pkt *p, __u32 id, __u32 flags)
{
	struct tp_key k = {.sess_id = id, .side = (flags & FL_REV) ? SIDE_LEFT : SIDE_RIGHT};
	struct tp_val *tp = bpf_map_lookup_elem(&dysco_tp, &k);
	__u32 k0 = 0;
	struct scratch *sc = bpf_map_lookup_elem(&dysco_scratch, &k0);
	__u32 st;
	__u8 reroute;

	if (!tp || !sc)
		return -1;
	st = tp->state;
	/* A tuple's ends are its first 36 bytes (struct dysco_ends). */
	if (st == TP_ACTIVE || st == TP_NEW) {
		__builtin_memcpy(&sc->sub, &tp->new_out, sizeof(sc->sub));
		reroute = tp->reroute_new;
		tp->to_new++;
		stat_inc(STAT_TP_NEW);
	} else {
		__builtin_memcpy(&sc->sub, &tp->old_out, sizeof(sc->sub));
		reroute = tp->reroute_old;
		tp->to_old++;
		stat_inc(STAT_TP_OLD);
	}
	if (rewrite_fast(skb, p, &sc->sub)) {
		stat_inc(STAT_DROP_HELPER);
		return TC_ACT_SHOT;
	}
	stat_inc(STAT_REWRITE_OUT);
	if (reroute)
		return redirect_to(skb, &sc->sub, p->v6);
	return TC_ACT_OK;
}

/* udp_tp_ingress records a datagram received on a side's old or new
 * subsession: old-path datagrams after the switch are counted (the
 * protocol's OldDgrams, in old_rcvd), and the first datagram on an armed
 * new subsession switches the side (the right anchor whose ACK was lost),
 * reported to the agent. */
static __always_inline void udp_tp_ingress(__u32 id, __u32 flags)
{
	struct tp_key k = {.sess_id = id, .side = (flags & FL_REV) ? SIDE_RIGHT : SIDE_LEFT};
	struct tp_val *tp = bpf_map_lookup_elem(&dysco_tp, &k);
	int new_path = (flags & (FL_TP_NEW | FL_TP_OLD)) == FL_TP_NEW;

	if (!tp)
		return;
	if (new_path) {
		if (tp->armed && tp->state == TP_IDLE)
			tp_start(tp, &k, 0);
		tp->new_rcvd = 1;
		return;
	}
	if (tp->state == TP_ACTIVE || tp->state == TP_NEW)
		__sync_fetch_and_add(&tp->old_rcvd, 1);
}

/* forward_udp applies a flow to a datagram: the steady state of a UDP
 * session. The first datagram that comes back on a subsession tells this
 * host that the next hop has the session: the session has carried
 * datagrams both ways (ST_EST, its stream timeout from now on), and the
 * datagrams this host sends on that subsession stop carrying the block. */
static __always_inline int forward_udp(struct __sk_buff *skb, struct pkt *p, struct flow_val *fp,
				       const struct dysco_ends *out, int egress)
{
	__u32 id = fp->sess_id, flags = fp->flags;

	count(fp, skb->len);
	if (flags & FL_DROP) {
		stat_inc(STAT_DROP_ORPHAN);
		return TC_ACT_SHOT;
	}
	if (!(flags & FL_EST)) {
		struct session_val *s = bpf_map_lookup_elem(&dysco_sessions, &id);

		if (s) {
			if ((flags & FL_REV) && !(s->state & ST_EST)) {
				__sync_fetch_and_or(&s->state, ST_EST);
				s->last_ms = stamp();
				ho_release(s);
			}
			if (s->state & ST_EST) {
				__sync_fetch_and_or(&fp->flags, FL_EST);
				if (!egress && (flags & FL_REV))
					udp_answered(out, id);
			}
		}
	}
	if (egress && (flags & FL_TP_OUT)) {
		int rc = udp_tp_egress(skb, p, id, flags);
		if (rc >= 0)
			return rc;
	}
	if (!egress && (flags & (FL_TP_OLD | FL_TP_NEW)))
		udp_tp_ingress(id, flags);
	if (rewrite_fast(skb, p, out)) {
		stat_inc(STAT_DROP_HELPER);
		return TC_ACT_SHOT;
	}
	if (egress) {
		stat_inc(STAT_REWRITE_OUT);
		if (flags & FL_REROUTE)
			return redirect_to(skb, out, p->v6);
		return TC_ACT_OK;
	}
	stat_inc(STAT_REWRITE_IN);
	if ((flags & FL_TAP) && tap_on()) {
		bpf_clone_redirect(skb, tap_ifindex, BPF_F_INGRESS);
		stat_inc(STAT_TAP);
	}
	return TC_ACT_OK;
}

/* setup_udp handles, on egress (dysco_setup), a datagram that may need a
 * block: the first of a new session once the policy program chose a policy
 * (SETUP_NEW), or one of a session being set up here (SETUP_CONT: a
 * subsession not answered yet, or a datagram marked by this host's
 * ingress). */
static __always_inline int setup_udp(struct __sk_buff *skb, struct pkt *p, __u32 mode, struct scratch *sc)
{
	struct syn_state *st = &sc->st, *saved;
	struct flow_val *f, *known = 0;
	__u32 id, mid = udp_setup_id(skb);
	int rc;

	if (mode == SETUP_NEW) {
		__u32 slot = skb->cb[CB_POLICY];
		struct session_val *s = &sc->sess;

		if (slot == 0)
			return TC_ACT_OK; /* no policy matches */
		__builtin_memset(st, 0, sizeof(*st));
		if (resolve_policy(slot - 1, p, st)) {
			stat_inc(STAT_DROP_BAD_POLICY);
			return TC_ACT_SHOT;
		}
		if (skb->gso_size) {
			stat_inc(STAT_DROP_SETUP_GSO);
			return TC_ACT_SHOT;
		}
		st->session = p->t;
		make_nonce(sc, st->nonce);
		__builtin_memset(s, 0, sizeof(*s));
		ends_of(&s->tuple, &p->t);
		s->created_ms = s->last_ms = stamp();
		__builtin_memcpy(s->nonce, st->nonce, DYSCO_NONCE_LEN);
		s->state = ST_SYN;
		s->policy = (__u16)slot;
		s->role = ROLE_START;
		s->is_v6 = p->v6;
		s->proto = IPPROTO_UDP;
		s->idle_s[0] = st->idle_s[0];
		s->idle_s[1] = st->idle_s[1];
		if (alloc_session(s, &id))
			return TC_ACT_SHOT;
		stat_inc(STAT_SETUP_START);
		rc = new_subsession(skb, p, id, sc) ? TC_ACT_SHOT : emit_udp(skb, p, id, 0, sc);
		if (rc == TC_ACT_SHOT && !st->emitted)
			bpf_map_delete_elem(&dysco_sessions, &id);
		return rc;
	}
	f = flow_get(&p->t, &sc->known.out);
	if (f && (f->flags & FL_INGRESS))
		f = 0;
	if (f && (f->flags & FL_PENDING)) {
		/* The session's tuple, unchanged by the middlebox: the
		 * subsession's flow takes the pending one's place. */
		if (!mid)
			mid = f->sess_id;
		flow_del(&p->t);
		f = 0;
	}
	if (f) {
		struct session_val *s;

		if (!(f->flags & FL_SYN_EMIT))
			return forward_udp(skb, p, f, &sc->known.out, 1);
		id = f->sess_id;
		s = bpf_map_lookup_elem(&dysco_sessions, &id);
		if (!s || (s->state & ST_EST) || f->packets >= UDP_BLOCK_DATAGRAMS || skb->gso_size) {
			/* Answered, or enough blocks sent: plain from now on. A
			 * GSO packet goes plain and leaves the rule as it is. */
			if (!skb->gso_size)
				__sync_fetch_and_and(&f->flags, ~FL_SYN_EMIT);
			return forward_udp(skb, p, f, &sc->known.out, 1);
		}
		count(f, skb->len);
		__builtin_memcpy(&sc->known, f, FLOW_HEAD_LEN);
		known = &sc->known;
	} else if (mid) {
		id = mid;
	} else {
		return TC_ACT_OK;
	}
	saved = bpf_map_lookup_elem(&dysco_syns, &id);
	if (!saved || saved->session.proto != IPPROTO_UDP) {
		if (known) {
			/* Set-up state collected: the session is answered. */
			__sync_fetch_and_and(&f->flags, ~FL_SYN_EMIT);
			return forward_udp(skb, p, f, &sc->known.out, 1);
		}
		/* A mark of this form that this host did not write: the
		 * datagram is a new one, for the policies to decide. */
		skb->cb[CB_MODE] = SETUP_NEW;
		skb->cb[CB_POLICY] = 0;
		bpf_tail_call(skb, &dysco_progs, PROG_POLICY);
		return TC_ACT_OK;
	}
	if (udp_setup_id(skb))
		skb->mark = 0;
	__builtin_memcpy(st, saved, sizeof(*st));
	if (st->n_hops == 0) {
		/* The chain ends here; the datagram goes on plain (§2.4). Its
		 * tuple becomes a flow of the session that changes nothing, so
		 * that the next datagrams are known as the session's. */
		if (!known) {
			struct flow_val *fwd = &sc->fwd;

			__builtin_memset(fwd, 0, sizeof(*fwd));
			ends_of(&fwd->out, &p->t);
			fwd->sess_id = id;
			fwd->packets = 1;
			fwd->bytes = skb->len;
			fwd->last_ms = stamp();
			if (flow_put(&p->t, fwd, BPF_NOEXIST, &sc->v4) == -12 /* E2BIG: full */) {
				stat_inc(STAT_DROP_FLOWS_FULL);
				return TC_ACT_SHOT;
			}
		}
		return TC_ACT_OK;
	}
	/* A datagram out of the middlebox continues the chain with the tuple
	 * it has now: a NAT may have changed it (§2.1). */
	if (!known) {
		st->session = p->t;
		if (new_subsession(skb, p, id, sc))
			return TC_ACT_SHOT;
	}
	return emit_udp(skb, p, id, known, sc);
}

#endif
