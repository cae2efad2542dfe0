/* SPDX-License-Identifier: (GPL-2.0-only OR MIT) */
/* Operations of the agent's control program (dysco_ctl): commands that the
 * agent runs inside the kernel with BPF_PROG_RUN, atomic with respect to the
 * datapath's own updates of the same entries.
 *
 * Provides: session_flow and session_flows (CTL_FREE, CTL_CUT), free_reconf
 * (CTL_FREE, CTL_FREE_RECONF), add_sub (CTL_ADD_SUB).
 * Expects: a syscall program's context (struct ctl_args), no packet; keys
 * copied out of the context by the caller (add_sub copies the values it
 * stores to dysco_ctl_buf itself). session_flow and session_flows return
 * how many flows were the session's; add_sub 0, 1 or a negative errno.
 * Maps: dysco_sessions (read), dysco_flows4 or dysco_flows6 (delete, flags
 * in place, insert), dysco_deltas (delete, insert), dysco_tp and
 * dysco_tp_req (insert, delete), dysco_ctl_buf. */
#ifndef DYSCO_CONTROL_H
#define DYSCO_CONTROL_H

#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>
#include "maps.h"
#include "flows.h"
#include "twopath.h"
#include "tuple.h"

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
			k.proto = s->proto;
			k.pad[0] = k.pad[1] = k.pad[2] = 0;
		} else if (d == 1) {
			reverse(&k, &s->tuple, s->proto);
		} else {
			if (onward->proto != s->proto)
				break;
			__builtin_memcpy(&k, onward, sizeof(k));
			k.pad[0] = k.pad[1] = k.pad[2] = 0;
		}
		f = flow_get(&k, &out);
		if (!f || f->sess_id != id)
			continue;
		reverse(&in, &out, k.proto);
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
		reverse(&in, (const struct dysco_ends *)&tp->new_out, k.proto);
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

#endif
