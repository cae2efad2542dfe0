/* SPDX-License-Identifier: (GPL-2.0-only OR MIT) */
/* The handshake's TCP options: the initial sequence number, window scale
 * and timestamp of a SYN and of its SYN-ACK, recorded in their session for
 * the agent to translate options between sessions (§4.2).
 *
 * Provides: handshake (and hs_step, its bpf_loop step).
 * Expects: p parsed from skb (parsing.h), a SYN or a SYN-ACK; s the
 * session's entry or a copy being built, written in place.
 * Maps: none. */
#ifndef DYSCO_HANDSHAKE_H
#define DYSCO_HANDSHAKE_H

#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>
#include "parsing.h"

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

#endif
