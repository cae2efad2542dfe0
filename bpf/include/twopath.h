/* SPDX-License-Identifier: (GPL-2.0-only OR MIT) */
/* The two-path phase of a reconfiguration at an anchor (paper §3.5), and the
 * marks it starts from. Mirrors internal/protocol/twopath.go (Marks, CutOff,
 * Decide, Observe); the shared vectors in internal/protocol/testdata check
 * that the two agree.
 *
 * Data that straddles the cut-off (a retransmission that Linux collapsed, a
 * GRO packet at a forwarding anchor) is split as the paper's tables say, but
 * not here: tp_split (twopath_fwd.h) hands it to the agent, which cuts it at
 * oldSent and sends both parts again. Where the agent cannot (no hold ring
 * reader, ring full, packet too long) it goes whole on the old path, the
 * variant the Go core's Decide implements and the simulation verifies; the
 * completion predicate accepts old-path data beyond the cut-off for it. An
 * ack is counted as acknowledging old-path data on whichever path it goes,
 * so no extra ack is ever needed on the old path. See docs/protocol.md
 * "Datapath". */
#ifndef DYSCO_TWOPATH_H
#define DYSCO_TWOPATH_H

#include "maps.h"
#include "parsing.h"
#include "flows.h"

#define TH_FIN_ 0x01
#define TH_SYN_ 0x02
#define TH_RST_ 0x04
#define TH_ACK_ 0x10

#define SIDE_LEFT 0
#define SIDE_RIGHT 1
/* dysco_tp_req only: a middle agent's kept lock (datapath.TPSideLock) */
#define SIDE_LOCK 2
/* dysco_tp_req only: a proxy's joined sessions (datapath.TPSideSplice) */
#define SIDE_SPLICE 3

static __always_inline int seq_lt(__u32 a, __u32 b) { return (__s32)(a - b) < 0; }
static __always_inline int seq_leq(__u32 a, __u32 b) { return (__s32)(a - b) <= 0; }

/* seq_end is the sequence number after a packet: payload, plus one for a
 * SYN and for a FIN (protocol.Packet.End). */
static __always_inline __u32 seq_end(__u32 seq, __u32 len, __u8 flags)
{
	__u32 e = seq + len;
	if (flags & TH_FIN_)
		e++;
	if (flags & TH_SYN_)
		e++;
	return e;
}

/* mark records a packet in its flow's marks (protocol.Marks.Out / In). */
static __always_inline void mark(struct flow_val *fp, __u32 seq, __u32 ack, __u32 end, __u8 flags)
{
	if (!(fp->flags & FL_MARKS)) {
		fp->mk_seq = seq;
		fp->mk_ack = ack;
		__sync_fetch_and_or(&fp->flags, FL_MARKS);
	}
	if (seq_lt(fp->mk_seq, end))
		fp->mk_seq = end;
	if ((flags & TH_ACK_) && seq_lt(fp->mk_ack, ack))
		fp->mk_ack = ack;
}

/* mark_newer tells whether mark a is ahead of mark b, for merging an old
 * ingress flow's marks into the new one's (CTL_MARKS_MERGE). What the old
 * path delivered can be ahead of what the new path did by at most a window,
 * and no TCP window exceeds 2^30 bytes (RFC 7323 §2.3); a mark "ahead" by
 * more is in fact behind by more than 2^31. The agent merges once, at the
 * end of the two-path phase, where the marks are a window apart at most (a
 * merge seconds later, after a 3-4 GiB move, defeats any bound: the agent's
 * removeSub). seq_lt alone would take a far-behind old mark for the newer,
 * and the new flow's marks would stop there (mark() then sees every packet
 * as behind them) and with them the next reconfiguration's cut-off. */
#define MARK_MERGE_SPAN (1u << 30)

static __always_inline int mark_newer(__u32 a, __u32 b)
{
	__u32 d = a - b;

	return d && d <= MARK_MERGE_SPAN;
}

/* tp_bits summarises the variables the agent's completion test reads. */
static __always_inline __u32 tp_bits(const struct tp_val *tp)
{
	__u32 b = 0;

	if (tp->state == TP_ACTIVE)
		b |= TPB_ACTIVE;
	if (tp->old_sent_acked == tp->old_sent)
		b |= TPB_SEND_DONE;
	if (tp->old_rcvd_acked == tp->old_rcvd)
		b |= TPB_RCVD_ACKED;
	if (tp->new_rcvd) {
		b |= TPB_NEW_RCVD;
		if (seq_leq(tp->first_new_rcvd, tp->old_rcvd))
			b |= TPB_NEW_AT_OLD;
	}
	return b;
}

/* tp_report tells the agent when the summary changed. A change the agent
 * made itself (dysco_ctl: quiet) is only recorded: the agent reads the
 * variables after its command (control.go, StartTwoPath), and an event
 * would cost the command the ring buffer's wake-up of the agent's reader,
 * which on this lab's virtual machines was 40-60 us of a 50-70 us command
 * (BENCHMARKS.md, "Quiet commands"). */
static __always_inline void tp_report(struct tp_val *tp, const struct tp_key *k, int quiet)
{
	__u32 b = tp_bits(tp);
	struct tp_event ev;

	if (b == tp->reported)
		return;
	tp->reported = b;
	if (quiet)
		return;
	ev.sess_id = k->sess_id;
	ev.side = k->side;
	ev.bits = b;
	ev.kind = EV_PROGRESS;
	if (bpf_ringbuf_output(&dysco_events, &ev, sizeof(ev), 0))
		stat_inc(STAT_EVENTS_LOST);
}

/* tp_start takes the cut-off from the side's marks and starts the two-path
 * phase (protocol.CutOff): from now on no new data goes on the old path.
 * Whoever wins the state change (the agent through dysco_ctl, or the first
 * packet on an armed new subsession) does it once. */
static __always_inline int tp_start(struct tp_val *tp, const struct tp_key *k, int quiet)
{
	struct flow_val *eg, *in;
	__u32 snd = 0, ack_sent = 0, rcv = 0, ack_rcvd = 0;

	if (!__sync_bool_compare_and_swap(&tp->state, TP_IDLE, TP_STARTING))
		return tp->state == TP_ACTIVE ? 0 : -1;
	eg = flow_get(&tp->eg_key, 0);
	in = flow_get(&tp->in_old, 0);
	if (eg && (eg->flags & FL_MARKS)) {
		snd = eg->mk_seq;
		ack_sent = eg->mk_ack;
	}
	if (in && (in->flags & FL_MARKS)) {
		rcv = in->mk_seq;
		ack_rcvd = in->mk_ack;
	}
	tp->old_sent = seq_lt(snd, ack_rcvd) ? ack_rcvd : snd;
	tp->old_rcvd = seq_lt(rcv, ack_sent) ? ack_sent : rcv;
	tp->old_sent_acked = ack_rcvd;
	tp->old_rcvd_acked = ack_sent;
	tp->ack_hi = ack_rcvd;
	tp->ack_hi_ok = in && (in->flags & FL_MARKS);
	tp->new_rcvd = 0;
	__sync_lock_test_and_set(&tp->state, TP_ACTIVE);
	tp_report(tp, k, quiet);
	return 0;
}

/* tp_observe updates the variables for a packet received on the old or
 * the new path, in session space (protocol.Observe). */
static __always_inline void tp_observe(struct tp_val *tp, int new_path, __u32 seq, __u32 ack, __u32 end, __u8 flags)
{
	if (flags & TH_RST_)
		return;
	if (end != seq) {
		if (!new_path) {
			if (seq_lt(tp->old_rcvd, end))
				tp->old_rcvd = end;
		} else if (!tp->new_rcvd || seq_lt(seq, tp->first_new_rcvd)) {
			tp->first_new_rcvd = seq;
			tp->new_rcvd = 1;
		}
	}
	if (flags & TH_ACK_) {
		__u32 a = seq_lt(tp->old_sent, ack) ? tp->old_sent : ack;
		if (seq_lt(tp->old_sent_acked, a))
			tp->old_sent_acked = a;
		if (!tp->ack_hi_ok || seq_lt(tp->ack_hi, ack)) {
			tp->ack_hi = ack;
			tp->ack_hi_ok = 1;
		}
	}
}

/* tp_deliver returns the ack a packet received on the old path is handed
 * on with (protocol.Deliver): at least the highest ack received on either
 * path. A late old-path packet's own ack can be more than a window behind
 * what the host has had acknowledged on the new path, and a TCP receiver
 * discards such a segment whole (RFC 5961 §5.2), so the old data would
 * never arrive. */
static __always_inline __u32 tp_deliver(const struct tp_val *tp, int new_path, __u32 ack, __u8 flags)
{
	if (!new_path && (flags & TH_ACK_) && !(flags & TH_RST_) && tp->ack_hi_ok && seq_lt(ack, tp->ack_hi))
		return tp->ack_hi;
	return ack;
}

/* Where tp_decide sends a packet. */
#define TPD_OLD 1
#define TPD_NEW 2

/* tp_decide applies the cut-off tables to a packet sent on the side
 * (protocol.Decide): data below oldSent on the old path (whole, if it
 * straddles and tp_split did not take it), data at or above it on the new
 * path; a packet without data
 * goes where its ack belongs (ack <= oldRcvd: old). A packet with data on
 * the old path acknowledges at most oldRcvd (*ack_to, when it must be
 * lowered), and a pure ack on the old path never names a sequence number
 * beyond oldSent (*seq_to). A RST goes on the new path. A straddling packet
 * is counted unless !count (a re-injected one: counted when tp_split handed
 * it over). */
static __always_inline int tp_decide(struct tp_val *tp, __u32 seq, __u32 ack, __u32 end, __u8 flags,
				     __u32 *seq_to, __u32 *ack_to, int count)
{
	int has_ack = flags & TH_ACK_, path;
	__u32 a = ack;

	*seq_to = seq;
	*ack_to = ack;
	if (flags & TH_RST_)
		return TPD_NEW;
	if (end != seq) {
		if (seq_lt(seq, tp->old_sent)) {
			path = TPD_OLD;
			if (count && seq_lt(tp->old_sent, end)) {
				tp->straddled++;
				stat_inc(STAT_TP_STRADDLE);
			}
			if (has_ack && seq_lt(tp->old_rcvd, ack))
				*ack_to = a = tp->old_rcvd;
		} else {
			path = TPD_NEW;
		}
	} else if (has_ack && seq_leq(ack, tp->old_rcvd)) {
		path = TPD_OLD;
		if (seq_lt(tp->old_sent, seq))
			*seq_to = tp->old_sent;
	} else {
		path = TPD_NEW;
	}
	if (has_ack) {
		if (seq_lt(tp->old_rcvd, a))
			a = tp->old_rcvd;
		if (seq_lt(tp->old_rcvd_acked, a))
			tp->old_rcvd_acked = a;
	}
	return path;
}

#endif
