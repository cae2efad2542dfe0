//go:build ignore
/* SPDX-License-Identifier: (GPL-2.0-only OR MIT) */
/* The Dysco datapath: TC programs on ingress and egress of every interface of
 * a host (paper §2.1, §4.1-4.2).
 *
 * Packets between hosts carry subsession tuples; applications and middleboxes
 * on a host see session tuples. Ingress maps subsession -> session before
 * netfilter and the stack; egress maps session -> subsession after them. The
 * first SYN carries the rest of the address list in its payload, announced by
 * an 8-byte TCP option that is always the last option, so that it is found
 * in O(1). Steady-state packets are one hash lookup and a header rewrite; they
 * never reach user space.
 *
 * This file holds the programs' entry points; the rest is in include/, one
 * concern per header, each saying what it provides, what it expects of its
 * callers and which maps it touches:
 *
 *   consts.h, structs.h, maps.h  constants, the maps' types, the maps
 *   parsing.h, flows.h           packet parsing; the flow maps by family
 *   rewrite.h                    header rewrites, checksums, deltas
 *   config.h                     constants set at load; the tap's switch
 *   tuple.h                      addresses and tuples
 *   session.h                    stamps, session ids, TCP state, reuse
 *   route.h                      routing of rewritten packets
 *   handshake.h                  the handshake's options
 *   forward.h                    the steady-state path (forward)
 *   twopath.h, twopath_fwd.h     the two-path phase: decisions; packets
 *   hold.h                       holding packets for the agent
 *   admit.h                      admission of Dysco SYNs: MAC, half-open budget, nonces
 *   syn.h                        SYN set-up on ingress and egress
 *   noforward.h                  refusing SYNs a host that does not forward must pass on
 *   udp.h                        UDP sessions: set-up by the first datagram, steady state
 *   icmp.h                       ICMP errors about subsession packets
 *   control.h                    the agent's commands (dysco_ctl) */
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
#include "include/config.h"
#include "include/tuple.h"
#include "include/session.h"
#include "include/route.h"
#include "include/handshake.h"
#include "include/twopath_fwd.h"
#include "include/forward.h"
#include "include/syn.h"
#include "include/udp.h"
#include "include/icmp.h"
#include "include/control.h"

char LICENSE[] SEC("license") = "Dual MIT/GPL";

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
	if (p.udp) {
		/* A block for this host (not one it routes on: see below). */
		if ((!f || (f->flags & FL_SYN_STRIP)) && udp_marker(skb, &p, opt) && is_local(p.t.daddr)) {
			/* Set-up in its own program: its stack and its
			 * states stay out of this one's. */
			bpf_tail_call(skb, &dysco_progs, PROG_UDP_INGRESS);
			stat_inc(STAT_DROP_NO_SETUP);
			return TC_ACT_SHOT;
		}
		if (f && udp6_zero(skb, &p)) {
			skb->cb[CB_MODE] = 0;
			bpf_tail_call(skb, &dysco_progs, PROG_UDP6_SUM);
			stat_inc(STAT_DROP_NO_SETUP);
			return TC_ACT_SHOT;
		}
		if (f)
			return forward_udp(skb, &p, f, out, 0);
		return TC_ACT_OK;
	}
	if ((p.flags & (TH_SYN | TH_ACK)) == TH_SYN) {
		int otype = dysco_opt(skb, &p, opt);
		if (otype == DYSCO_OPT_TYPE_LOCAL_TAG) {
			/* A local tag never leaves the host that wrote it (§4.2):
			 * one from the wire is forged, and egress would continue
			 * the chain of the session it names with it. */
			stat_inc(STAT_DROP_MALFORMED);
			return TC_ACT_SHOT;
		}
		/* A block is for the host its packet is addressed to: a host
		 * that only routes the packet on (a line of hosts, where the
		 * path between two hops crosses a third) forwards it as it
		 * is. */
		if (otype == DYSCO_OPT_TYPE_SYN_BLOCK && (!f || (f->flags & FL_SYN_STRIP)) && is_local(p.t.daddr))
			return ingress_syn(skb, &p, opt, f);
	}
	if (f)
		return forward(skb, &p, f, out, 0);
	return TC_ACT_OK;
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
	if (p.udp) {
		/* A UDP datagram after the policy program. */
		bpf_tail_call(skb, &dysco_progs, PROG_UDP_SETUP);
		stat_inc(STAT_DROP_NO_SETUP);
		return TC_ACT_SHOT;
	}
	otype = dysco_opt(skb, &p, opt);
	st = &sc->st;
	if (mode == SETUP_NEW) {
		__u32 slot = skb->cb[CB_POLICY];
		struct session_val *s = &sc->sess;

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
		make_nonce(sc, st->nonce);
		__builtin_memset(s, 0, sizeof(*s));
		ends_of(&s->tuple, &p.t);
		s->created_ms = s->last_ms = stamp();
		__builtin_memcpy(s->nonce, st->nonce, DYSCO_NONCE_LEN);
		s->state = ST_SYN;
		s->policy = (__u16)slot;
		s->role = ROLE_START;
		s->is_v6 = p.v6;
		s->proto = IPPROTO_TCP;
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

/* dysco_udp_setup handles UDP datagrams on egress that may need a block
 * (udp.h, setup_udp), reached by tail call from dysco_egress or, after the
 * policy program, from dysco_setup. */
SEC("tc")
int dysco_udp_setup(struct __sk_buff *skb)
{
	__u32 k0 = 0;
	struct scratch *sc = bpf_map_lookup_elem(&dysco_scratch, &k0);

	if (!sc || parse(skb, &sc->pk) || !sc->pk.udp)
		return TC_ACT_SHOT;
	return setup_udp(skb, &sc->pk, skb->cb[CB_MODE], sc);
}

/* dysco_udp_ingress handles a datagram that ends with a block's marker,
 * reached by tail call from dysco_ingress (udp.h, ingress_udp). */
SEC("tc")
int dysco_udp_ingress(struct __sk_buff *skb)
{
	__u32 k0 = 0;
	struct scratch *sc = bpf_map_lookup_elem(&dysco_scratch, &k0);
	struct flow_val *f;
	struct pkt p;
	__u8 m[DYSCO_OPT_LEN];

	if (!sc || parse(skb, &p) || !p.udp || !udp_marker(skb, &p, m))
		return TC_ACT_SHOT;
	f = flow_get(&p.t, &sc->fout);
	if (f && !(f->flags & FL_INGRESS))
		f = 0;
	if (f && !(f->flags & FL_SYN_STRIP))
		return forward_udp(skb, &p, f, &sc->fout, 0);
	return ingress_udp(skb, &p, m, f);
}

/* dysco_udp6_sum forwards an IPv6 datagram of a session that has no
 * checksum (udp.h, udp6_zero) once its checksum is computed, reached by tail
 * call from dysco_ingress (cb[CB_MODE] 0) or dysco_egress (1). */
SEC("tc")
int dysco_udp6_sum(struct __sk_buff *skb)
{
	__u32 k0 = 0, egress = skb->cb[CB_MODE];
	struct scratch *sc = bpf_map_lookup_elem(&dysco_scratch, &k0);
	struct flow_val *f;

	if (!sc || parse(skb, &sc->pk) || !sc->pk.udp)
		return TC_ACT_SHOT;
	f = flow_get(&sc->pk.t, &sc->fout);
	if (!f || !(f->flags & FL_INGRESS) != !!egress)
		return TC_ACT_SHOT;
	if (udp6_sum(skb, &sc->pk, sc)) {
		stat_inc(STAT_DROP_HELPER);
		return TC_ACT_SHOT;
	}
	return forward_udp(skb, &sc->pk, f, &sc->fout, egress);
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
	if (p.udp) {
		if (udp_control(&p))
			return TC_ACT_OK;
		if (f && !(f->flags & FL_SYN_EMIT) && udp6_zero(skb, &p)) {
			skb->cb[CB_MODE] = 1;
			bpf_tail_call(skb, &dysco_progs, PROG_UDP6_SUM);
			stat_inc(STAT_DROP_NO_SETUP);
			return TC_ACT_SHOT;
		}
		if (f && !(f->flags & FL_SYN_EMIT))
			return forward_udp(skb, &p, f, out, 1);
		if (f || udp_setup_id(skb)) {
			skb->cb[CB_MODE] = SETUP_CONT;
			bpf_tail_call(skb, &dysco_progs, PROG_UDP_SETUP);
			stat_inc(STAT_DROP_NO_SETUP);
			return TC_ACT_SHOT;
		}
		skb->cb[CB_MODE] = SETUP_NEW;
		skb->cb[CB_POLICY] = 0;
		bpf_tail_call(skb, &dysco_progs, PROG_POLICY);
		return TC_ACT_OK; /* no policies installed */
	}
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

		struct session_val *s = bpf_map_lookup_elem(&dysco_sessions, &id);

		if (s)
			ho_release(s);
		free_reconf(id);
		bpf_map_delete_elem(&dysco_syns, &id);
		bpf_map_delete_elem(&dysco_sessions, &id);
		return n;
	}
	if (op == CTL_HO_RELEASE) {
		/* The collector is about to delete the session (admit.h). */
		struct session_val *s = bpf_map_lookup_elem(&dysco_sessions, &tk.sess_id);

		if (!s)
			return -2;
		ho_release(s);
		return 0;
	}
	if (op == CTL_CUT)
		return session_flows(tk.sess_id, CTL_CUT, &key);
	if (op == CTL_ADD_SUB)
		return add_sub(a, &key, &tk);
	if (op == CTL_FREE_RECONF) {
		free_reconf(tk.sess_id);
		return 0;
	}
	if (op == CTL_WS) {
		/* A middlebox that joined a new path learns the window scale
		 * of the leftward direction from the new path's synAck (the
		 * SYN brought the other): it needs both should it be an
		 * anchor later (the window clamp). */
		struct session_val *s = bpf_map_lookup_elem(&dysco_sessions, &tk.sess_id);

		if (!s || arg > 14)
			return s ? -22 : -2;
		s->ws[1] = arg;
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
