/* SPDX-License-Identifier: (GPL-2.0-only OR MIT) */
/* The steady-state path: forward() applies a flow to a packet on ingress or
 * on egress (holding, counters, session state, marks, delta, rewrite,
 * routing and the session-view tap) after the caller's one flow lookup.
 *
 * Provides: forward.
 * Expects: p parsed from skb; fp the flow at p's tuple from flow_get (its
 * head only), one that applies at this hook (FL_INGRESS set on ingress,
 * clear on egress); out its rewrite target, in scratch space (struct
 * scratch, fout), not on the stack. Returns a TC verdict.
 * Maps: the flow's entry in dysco_flows4 or dysco_flows6 (counters, flags
 * and marks in place), dysco_sessions (state), dysco_deltas (read),
 * dysco_config (read, tap_on), dysco_stats; and those of twopath_fwd.h and
 * hold.h. */
#ifndef DYSCO_FORWARD_H
#define DYSCO_FORWARD_H

#include <linux/bpf.h>
#include <linux/pkt_cls.h>
#include "maps.h"
#include "parsing.h"
#include "rewrite.h"
#include "twopath.h"
#include "hold.h"
#include "config.h"
#include "session.h"
#include "route.h"
#include "handshake.h"
#include "twopath_fwd.h"

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

#endif
