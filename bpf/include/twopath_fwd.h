/* SPDX-License-Identifier: (GPL-2.0-only OR MIT) */
/* The two-path phase on packets at an anchor (§3.5). twopath.h decides;
 * this header moves the packets: an egress packet of a side in its phase
 * goes on the old or the new path with that path's delta and rewrite, or,
 * when it straddles the cut-off, to the agent, which splits it; a packet
 * received on a side's old or new subsession updates the phase's variables,
 * and the first one on an armed new subsession starts the phase.
 *
 * Provides: struct fwd_flow, clamp_window, tp_split, tp_egress, tp_ingress.
 * Expects: to be called by forward() (forward.h) after the flow's counters
 * and marks were taken, with p parsed from skb and still in session space
 * on egress; fp the flow's head (flow_get). tp_egress returns -1 for a side
 * without a record, for forward() to go on as without one, and otherwise a
 * TC verdict; tp_ingress the ack to hand the packet on with.
 * Maps: dysco_tp (its variables in place), dysco_deltas (read),
 * dysco_config (split_until), dysco_hold and dysco_hold_buf (hold_frame),
 * dysco_events (tp_report), dysco_stats. */
#ifndef DYSCO_TWOPATH_FWD_H
#define DYSCO_TWOPATH_FWD_H

#include <linux/bpf.h>
#include <linux/pkt_cls.h>
#include "maps.h"
#include "parsing.h"
#include "rewrite.h"
#include "twopath.h"
#include "hold.h"
#include "session.h"
#include "route.h"

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

#endif
