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
 * segment again at once and enter CWR).
 *
 * The same ring carries packets of a two-path phase that straddle the
 * cut-off (HOLD_F_SPLIT, tp_split in twopath_fwd.h): the agent cuts them at
 * oldSent and re-injects both parts the same way. */
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

/* hold_frame copies the whole frame (a GSO packet whole) with a hold_hdr
 * (flags: HOLD_F_* beyond the family) to the ring. It fails (-1) for a
 * packet longer than HOLD_MAX_FRAME and when the ring is full; the caller
 * decides what then becomes of the packet. */
static __attribute__((noinline)) int hold_frame(struct __sk_buff *skb, __u32 sess_id, __u32 v6, __u32 flags)
{
	__u32 cpu = bpf_get_smp_processor_id();
	struct hold_buf *b = bpf_map_lookup_elem(&dysco_hold_buf, &cpu);
	__u32 len = skb->len;

	if (!b || len < ETH_HLEN || len > HOLD_MAX_FRAME)
		return -1;
	b->h.sess_id = sess_id;
	b->h.ifindex = skb->ifindex;
	b->h.len = len;
	b->h.gso_size = (__u16)skb->gso_size;
	b->h.flags = (__u16)(flags | (v6 ? HOLD_F_V6 : 0));
	if (bpf_skb_load_bytes(skb, 0, b->frame, len))
		return -1;
	if (bpf_ringbuf_output(&dysco_hold, b, sizeof(b->h) + len, 0))
		return -1;
	return 0;
}

/* hold_copy holds a packet: copied to the ring and swallowed. A packet that
 * cannot be held (longer than HOLD_MAX_FRAME, ring full) is dropped and
 * counted: the sender's TCP sends it again, and the agent, seeing hold_drop
 * move, cancels. */
static __always_inline int hold_copy(struct __sk_buff *skb, __u32 sess_id, __u32 v6)
{
	if (hold_frame(skb, sess_id, v6, 0)) {
		stat_inc(STAT_HOLD_DROP);
		return TC_ACT_SHOT;
	}
	stat_inc(STAT_HOLD_PKTS);
	stat_add(STAT_HOLD_BYTES, skb->len);
	return bpf_redirect(HOLD_SINK_IFINDEX, 0);
}

#endif
