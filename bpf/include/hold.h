/* SPDX-License-Identifier: (GPL-2.0-only OR MIT) */
/* Packet holding at an anchor while a session's middlebox state migrates
 * (paper §3.5, last paragraph: "the anchors must buffer incoming data";
 * M2M draft §5.2-5.3). eBPF cannot queue an skb, so a held packet is copied
 * to the dysco_hold ring buffer and swallowed; the agent later re-injects
 * the copy through an AF_PACKET socket on the same interface with
 * DYSCO_REINJECT_MARK, and the copy then takes the ordinary egress path
 * (whatever path the session uses by then).
 *
 * The packet is swallowed with a redirect to no device (ifindex 0), not with
 * TC_ACT_STOLEN: TCX maps every verdict but PASS, DROP and REDIRECT to
 * TCX_NEXT (include/net/tcx.h, tcx_action_code), so a STOLEN packet would be
 * sent anyway. A redirect whose target does not exist is freed by
 * skb_do_redirect while sch_handle_egress reports NET_XMIT_SUCCESS, with TCX
 * and with clsact alike: the sending TCP believes the packet left and keeps
 * its state (a drop would return NET_XMIT_DROP, and TCP would send the
 * segment again at once and enter CWR). */
#ifndef DYSCO_HOLD_H
#define DYSCO_HOLD_H

#include "maps.h"
#include "parsing.h"
#include "twopath.h"

/* The interface a held packet is "redirected" to: none. */
#define HOLD_SINK_IFINDEX 0

/* hold_wanted tells whether an egress packet of flow fp (flags fflags) is
 * to be held. FL_HOLD_ALL: every packet. FL_HOLD_DATA: a packet whose end
 * (payload, FIN) lies beyond the flow's mark mk_seq, i.e. one that would
 * advance it; retransmissions, pure ACKs, SYNs and RSTs go on. The mark and
 * p->seq are both in session space: egress marks are taken before any
 * delta is applied (forward()). A re-injected packet is never held again. */
static __always_inline int hold_wanted(const struct __sk_buff *skb, const struct flow_val *fp, __u32 fflags,
				       const struct pkt *p)
{
	__u32 end;

	if (skb->mark == DYSCO_REINJECT_MARK)
		return 0;
	if (fflags & FL_HOLD_ALL)
		return 1;
	if (!(fflags & FL_HOLD_DATA) || (p->flags & (TH_SYN | TH_RST)))
		return 0;
	end = seq_end(p->seq, p->payload, p->flags);
	if (end == p->seq)
		return 0;
	return !(fp->flags & FL_MARKS) || seq_lt(fp->mk_seq, end);
}

/* hold_copy copies the whole frame (a GSO packet whole) with a hold_hdr to
 * the ring and swallows the packet. A packet that cannot be held (longer
 * than HOLD_MAX_FRAME, ring full) is dropped and counted: the sender's TCP
 * sends it again, and the agent, seeing hold_drop move, cancels. */
static __attribute__((noinline)) int hold_copy(struct __sk_buff *skb, __u32 sess_id, __u32 v6)
{
	__u32 cpu = bpf_get_smp_processor_id();
	struct hold_buf *b = bpf_map_lookup_elem(&dysco_hold_buf, &cpu);
	__u32 len = skb->len;

	if (!b || len < ETH_HLEN || len > HOLD_MAX_FRAME)
		goto drop;
	b->h.sess_id = sess_id;
	b->h.ifindex = skb->ifindex;
	b->h.len = len;
	b->h.gso_size = (__u16)skb->gso_size;
	b->h.flags = v6 ? HOLD_F_V6 : 0;
	if (bpf_skb_load_bytes(skb, 0, b->frame, len))
		goto drop;
	if (bpf_ringbuf_output(&dysco_hold, b, sizeof(b->h) + len, 0))
		goto drop;
	stat_inc(STAT_HOLD_PKTS);
	stat_add(STAT_HOLD_BYTES, len);
	return bpf_redirect(HOLD_SINK_IFINDEX, 0);
drop:
	stat_inc(STAT_HOLD_DROP);
	return TC_ACT_SHOT;
}

#endif
