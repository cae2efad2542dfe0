/* SPDX-License-Identifier: (GPL-2.0-only OR MIT) */
/* SYN set-up (§2.1, §4.2). A session's SYN carries the rest of its chain in
 * an address-list block, announced by the marking option. On ingress,
 * ingress_syn checks a SYN's block, admits it (admit.h), records the session and its two flows
 * at this host and hands the stack a plain SYN of the session, with a local
 * tag if the chain goes on from here. On egress, dysco_setup resolves a new
 * session's chain (resolve_policy) or takes up a tagged or known one, and
 * emit_syn sends the SYN to its next hop with the block of the hops after.
 *
 * Provides: tag_opt, strip_block, tap_syn and ingress_syn (ingress);
 * emit_syn, remove_tag and resolve_policy (egress).
 * Expects: p parsed from skb, and opt the SYN's marking option as dysco_opt
 * (parsing.h) read it; known, if not null, the SYN's flow already made (a
 * retransmission). Scratch space (struct scratch, dysco_scratch, per CPU) is
 * shared: ingress_syn uses its st, buf, sess, fwd, rev, rkey, v4 and ends;
 * emit_syn, given sc and the chain in st, uses its buf, ends, rkey, fwd, rev
 * and v4. Functions that change the packet invalidate packet pointers
 * (rewrite.h). ingress_syn, emit_syn and remove_tag return a TC verdict.
 * Maps: dysco_sessions and dysco_syns (insert; delete on failure),
 * dysco_flows4 or dysco_flows6 (insert), dysco_ids (alloc_session),
 * dysco_policies and dysco_types (read; a type's round-robin cursor),
 * dysco_keys and dysco_trusted (read), dysco_halfopen, dysco_local and
 * dysco_locator, dysco_policy_src and dysco_local_if (read),
 * dysco_scratch, dysco_config (read, tap_on),
 * dysco_stats. */
#ifndef DYSCO_SYN_H
#define DYSCO_SYN_H

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
#include "handshake.h"
#include "admit.h"
#include "noforward.h"

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

/* check_block checks the block of blen bytes at b (in scratch space) that a
 * packet p of protocol proto carries, admits it (admit.h) and reads it into
 * st: 0 if it may set up a session here, else the counter of the drop. The
 * same checks as wire.Decode; a UDP block ends with the session's idle
 * timeouts (wire.UDPExtLen). */
static __attribute__((noinline)) int check_block(struct pkt *p, __u8 *b, __u32 blen, struct syn_state *st, __u8 proto)
{
	__u32 n, i, j, ext = proto == IPPROTO_UDP ? DYSCO_UDP_EXT_LEN : 0;
	int rc;

	if (blen < DYSCO_BLOCK_HEADER_LEN || blen > DYSCO_MAX_BLOCK_LEN)
		return STAT_DROP_BAD_LENGTH;
	if (b[0] != ((DYSCO_MAGIC >> 24) & 0xff) || b[1] != ((DYSCO_MAGIC >> 16) & 0xff) ||
	    b[2] != ((DYSCO_MAGIC >> 8) & 0xff) || b[3] != (DYSCO_MAGIC & 0xff))
		return STAT_DROP_BAD_MAGIC;
	if (b[4] != DYSCO_VERSION)
		return STAT_DROP_BAD_VERSION;
	/* This version defines no flags (wire.ErrReserved); the protocol is
	 * the packet's own (wire.ErrProto). */
	if (b[5] || b[7] != proto)
		return STAT_DROP_MALFORMED;
	n = b[6];
	if (n > DYSCO_MAX_HOPS)
		return STAT_DROP_TOO_MANY_HOPS;
	if (blen != DYSCO_BLOCK_HEADER_LEN + n * DYSCO_ADDR_LEN + ext)
		return STAT_DROP_BAD_LENGTH;
	/* Admission (admit.h) before anything of the block is believed. */
	rc = syn_admit(&p->t, b, blen);
	if (rc)
		return rc;
	__builtin_memset(st, 0, sizeof(*st));
	__builtin_memcpy(st->nonce, b + 8, DYSCO_NONCE_LEN);
	__builtin_memcpy(st->session.saddr, b + 16, 16);
	__builtin_memcpy(st->session.daddr, b + 32, 16);
	__builtin_memcpy(&st->session.sport, b + 48, 2);
	__builtin_memcpy(&st->session.dport, b + 50, 2);
	st->session.proto = proto;
	if (!st->session.sport || !st->session.dport || is_mapped4(st->session.saddr) == p->v6 ||
	    is_mapped4(st->session.daddr) == p->v6 || !unicast(st->session.saddr) || !unicast(st->session.daddr) ||
	    (st->session.sport == st->session.dport && addr_eq(st->session.saddr, st->session.daddr)))
		return STAT_DROP_BAD_SESSION;
	/* A list naming this host or repeating an address would loop. */
	for (i = 0; i < DYSCO_MAX_HOPS; i++) {
		if (i >= n)
			break;
		__builtin_memcpy(st->hops[i], b + DYSCO_BLOCK_HEADER_LEN + i * DYSCO_ADDR_LEN, 16);
		/* Mixed families, or an address no packet can go to: not a loop. */
		if (is_mapped4(st->hops[i]) == p->v6 || !unicast(st->hops[i]))
			return STAT_DROP_MALFORMED;
		if (is_local(st->hops[i]))
			return STAT_DROP_LOOP;
		for (j = 0; j < DYSCO_MAX_HOPS; j++) {
			if (j >= i)
				break;
			if (addr_eq(st->hops[i], st->hops[j]))
				return STAT_DROP_LOOP;
		}
	}
	st->n_hops = n;
	if (ext && blen >= DYSCO_BLOCK_HEADER_LEN + DYSCO_UDP_EXT_LEN && blen <= DYSCO_MAX_BLOCK_LEN) {
		__u8 *e = b + blen - DYSCO_UDP_EXT_LEN;
		if (e[4] | e[5] | e[6] | e[7])
			return STAT_DROP_MALFORMED; /* wire.ErrReserved */
		st->idle_s[0] = ((__u16)e[0] << 8) | e[1];
		st->idle_s[1] = ((__u16)e[2] << 8) | e[3];
	}
	return 0;
}

/* ingress_syn handles a Dysco SYN arriving from the previous hop (§2.1): it
 * checks the block, records the session and its two flows on this side,
 * rewrites the SYN to the session tuple and hands it to the stack. */
static __always_inline int ingress_syn(struct __sk_buff *skb, struct pkt *p, __u8 *opt, struct flow_val *known)
{
	__u32 k0 = 0, blen, n, id;
	struct scratch *sc = bpf_map_lookup_elem(&dysco_scratch, &k0);
	struct syn_state *st;
	__u8 *b;
	int local_dst, keep_tag, rc;

	if (!sc)
		return TC_ACT_SHOT;
	st = &sc->st;
	b = sc->buf;
	if (opt[5]) {
		/* Byte 5 of a SYN block's option is 0 (only a local tag uses
		 * it, and that never arrives from the wire). */
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
	rc = check_block(p, b, blen, st, IPPROTO_TCP);
	if (rc) {
		stat_inc(rc);
		return TC_ACT_SHOT;
	}
	n = st->n_hops;
	local_dst = is_local(st->session.daddr);
	keep_tag = n > 0 || !local_dst;
	if (!local_dst) {
		/* The stack must forward it: refused if it would not. */
		int rc = refuse_unforwarded(skb, p, st->session.daddr);
		if (rc >= 0)
			return rc;
	}

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
		__u64 src = ho_source(p->t.saddr);

		/* A source over its budget of half-open sessions sets up no
		 * more until some are established or collected (admit.h). */
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
		s->proto = IPPROTO_TCP;
		handshake(skb, p, s);
		if (alloc_session(s, &id))
			return TC_ACT_SHOT;
		ends_of(&in->out, &st->session);
		in->sess_id = id;
		in->flags = FL_INGRESS | FL_SYN_STRIP | (s->role != ROLE_END ? FL_TAP : 0);
		reverse(rkey, &in->out, IPPROTO_TCP);
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
		ho_take(src);
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

/* new_subsession makes the subsession of session id to its next hop
 * (sc->st.hops[0]) for the packet p leaving the host (§2.1): its ports,
 * claimed atomically through the reverse flow's key, the two flows, and the
 * set-up state, marked emitted. sc->sub gets the subsession tuple. 0, or -1
 * with the drop counted. */
static __always_inline int subsession_make(struct __sk_buff *skb, struct pkt *p, __u32 id, struct scratch *sc)
{
	struct syn_state *st = &sc->st;
	struct dysco_ends *out = &sc->sub;
	struct bpf_redir_neigh nh;
	struct dysco_ends *next = &sc->ends;
	struct dysco_tuple *rkey = &sc->rkey;
	struct flow_val *fwd = &sc->fwd, *rev = &sc->rev;
	struct session_val *s = bpf_map_lookup_elem(&dysco_sessions, &id);
	__u32 ifindex, r, i;
	__u8 flags_role = 0;
	int ok = 0, picked = 0;

	if (s && s->role == ROLE_MIDDLE)
		flags_role = FL_TAP;
	__builtin_memset(next, 0, sizeof(*next));
	__builtin_memset(fwd, 0, sizeof(*fwd));
	__builtin_memset(rev, 0, sizeof(*rev));
	__builtin_memcpy(next->daddr, st->hops[0], 16);
	if (route(skb, next, p->v6, &nh, &ifindex, out->saddr, p->t.saddr)) {
		stat_inc(STAT_DROP_NO_ROUTE);
		return -1;
	}
	/* A session address (dysco_locator) is the session's, never a
	 * subsession's: the subsession leaves from the host's locator. */
	{
		const __u8 *loc = bpf_map_lookup_elem(&dysco_locator, out->saddr);

		if (loc)
			__builtin_memcpy(out->saddr, loc, 16);
	}
	/* A policy's local sources: the session's hash picks one, used if
	 * it is an address of an interface that carries traffic (route.h
	 * sends the subsession out of that interface: FL_REROUTE). */
	if (s && s->role == ROLE_START && s->policy) {
		__u32 slot = s->policy - 1;
		struct policy_src *ps = bpf_map_lookup_elem(&dysco_policy_src, &slot);
		__u32 fam = p->v6 ? 1 : 0, n, k;

		if (ps) {
			n = ps->n[fam];
			if (n > 0 && n <= MAX_POLICY_SRC) {
				k = bpf_get_hash_recalc(skb) % n;
				/* The verifier does not follow the remainder's
				 * bound: the mask (kept by the empty asm) gives it. */
				asm volatile("" : "+r"(k));
				k &= MAX_POLICY_SRC - 1;
				if (bpf_map_lookup_elem(&dysco_local_if, ps->addr[fam][k])) {
					__builtin_memcpy(out->saddr, ps->addr[fam][k], 16);
					picked = 1;
				}
			}
		}
	}
	__builtin_memcpy(out->daddr, st->hops[0], 16);
	rev->sess_id = id;
	rev->flags = FL_INGRESS | FL_REV | flags_role;
	reverse_ends(&rev->out, &p->t);
	for (i = 0; i < ALLOC_TRIES; i++) {
		r = bpf_get_prandom_u32();
		out->sport = bpf_htons(port_lo + (__u16)((r & 0xffff) % port_n));
		out->dport = bpf_htons(port_lo + (__u16)((r >> 16) % port_n));
		reverse(rkey, out, p->t.proto);
		if (!flow_put(rkey, rev, BPF_NOEXIST, &sc->v4)) {
			ok = 1;
			break;
		}
	}
	if (!ok) {
		stat_inc(STAT_DROP_NO_PORT);
		return -1;
	}
	fwd->out = *out;
	fwd->sess_id = id;
	fwd->flags = FL_SYN_EMIT | (!picked && same_route(skb, p->v6, p->t.daddr, out->daddr) ? 0 : FL_REROUTE);
	fwd->packets = 1;
	fwd->bytes = skb->len;
	fwd->last_ms = stamp();
	reclaim(&p->t);
	if (flow_put(&p->t, fwd, BPF_NOEXIST, &sc->v4)) {
		flow_del(rkey);
		stat_inc(STAT_DROP_FLOWS_FULL);
		return -1;
	}
	st->emitted = 1;
	bpf_map_update_elem(&dysco_syns, &id, st, BPF_ANY);
	return 0;
}

/* new_subsession is subsession_make in a frame of its own, for callers
 * with little stack to spare (udp.h). */
static __attribute__((noinline)) int new_subsession(struct __sk_buff *skb, struct pkt *p, __u32 id, struct scratch *sc)
{
	return subsession_make(skb, p, id, sc);
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
	} else if (subsession_make(skb, p, id, sc)) {
		return TC_ACT_SHOT;
	} else {
		out = sc->sub;
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
		b[7] = DYSCO_PROTO_TCP;
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
		/* Signed for the subsession it goes on (admit.h). */
		syn_sign(b, blen, &out);
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
		/* Raise the data offset over the appended option (no memory
		 * is moved); the room was checked above. */
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
	st->idle_s[0] = pol->idle_s[0];
	st->idle_s[1] = pol->idle_s[1];
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

#endif
