/* SPDX-License-Identifier: (GPL-2.0-only OR MIT) */
/* Header rewrites with incremental checksums (paper §4.2 "Packet rewriting").
 *
 * Contract: every function here may call helpers that change the packet, so
 * packet pointers held by the caller are invalid afterwards; struct pkt
 * offsets stay valid unless the function says otherwise.
 *
 * Checksums: bpf_l4_csum_replace needs BPF_F_PSEUDO_HDR for fields of the
 * pseudo header (addresses, length) only. With CHECKSUM_PARTIAL (transmit
 * offload) the check field holds the pseudo-header sum and the kernel helpers
 * leave it alone for non-pseudo changes, which is right because the payload
 * and header are summed later; with offload off they update it. */
#ifndef DYSCO_REWRITE_H
#define DYSCO_REWRITE_H

#include <stddef.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_core_read.h>
#include "parsing.h"
#include "maps.h"

#define IP_CSUM_OFF(p) ((p)->l3 + offsetof(struct iphdr, check))
#define TCP_CSUM_OFF(p) ((p)->l4 + offsetof(struct tcphdr, check))
/* The checksum of the packet's transport header, TCP or UDP. */
#define L4_CSUM_OFF(p) ((p)->l4 + ((p)->udp ? offsetof(struct udphdr, check) : offsetof(struct tcphdr, check)))

/* How the kernel holds an skb's checksum (include/linux/skbuff.h). */
#define CSUM_NONE 0
#define CSUM_UNNECESSARY 1
#define CSUM_COMPLETE 2
#define CSUM_PARTIAL 3

/* The one field of the kernel's sk_buff read here, relocated against the
 * running kernel's BTF (CO-RE): a program cannot tell the checksum modes
 * apart from __sk_buff. */
struct sk_buff___dysco {
	__u8 ip_summed : 2;
} __attribute__((preserve_access_index));

extern void *bpf_cast_to_kern_ctx(void *obj) __ksym;

static __always_inline __u32 skb_ip_summed(struct __sk_buff *skb)
{
	struct sk_buff___dysco *k = bpf_cast_to_kern_ctx(skb);

	return (__u32)BPF_CORE_READ_BITFIELD(k, ip_summed);
}

/* l4_mode gives how the packet's transport checksum field is to be
 * updated: as skb_ip_summed says, except for a UDP GSO packet, whose field
 * holds the pseudo header's sum whatever ip_summed says (the kernel's
 * udp4_hwcsum and udp6_hwcsum_outgoing write it and leave ip_summed at
 * CHECKSUM_NONE when the device does not offload checksums; segmentation
 * computes the checksums from it). */
static __always_inline __u32 l4_mode(struct __sk_buff *skb, const struct pkt *p)
{
	if (p->udp && skb->gso_size)
		return CSUM_PARTIAL;
	return skb_ip_summed(skb);
}

/* l4_flags gives the flags of bpf_l4_csum_replace for the packet's transport
 * checksum (a UDP GSO packet whose ip_summed is not CHECKSUM_PARTIAL never
 * gets here: rewrite_fast). A UDP checksum of zero means "none" (RFC 768): it stays zero,
 * and a computed zero is sent as 0xffff (BPF_F_MARK_MANGLED_0, as the
 * kernel's own NAT does). With CHECKSUM_PARTIAL the field is the pseudo
 * header's sum, where zero is a value like any other. */
static __always_inline __u64 l4_flags(struct __sk_buff *skb, const struct pkt *p)
{
	if (p->udp && skb_ip_summed(skb) != CSUM_PARTIAL)
		return BPF_F_MARK_MANGLED_0;
	return 0;
}

/* Ones' complement arithmetic of the Internet checksum (RFC 1071) on 32-bit
 * words as they lie in the packet (the sum does not depend on byte order). */
static __always_inline __u32 csum_add(__u32 s, __u32 v)
{
	s += v;
	return s + (s < v);
}

/* csum_swap adds to s the change of one word from o to n (RFC 1624). */
static __always_inline __u32 csum_swap(__u32 s, __u32 o, __u32 n)
{
	return csum_add(csum_add(s, ~o), n);
}

static __always_inline __u16 csum_fold(__u32 s)
{
	s = (s & 0xffff) + (s >> 16);
	s = (s & 0xffff) + (s >> 16);
	return (__u16)s;
}

/* fix_tcp_check applies the sums of changed words to the TCP checksum: da of
 * words in the pseudo header (addresses), dp of words in the segment
 * (ports). With CHECKSUM_PARTIAL the field holds the pseudo header's sum,
 * uncomplemented, and the segment is summed later: only da applies.
 * Otherwise the field holds the full checksum (RFC 1624 eqn. 3). */
static __always_inline __u16 fix_tcp_check(__u16 check, __u32 mode, __u32 da, __u32 dp)
{
	if (mode == CSUM_PARTIAL)
		return csum_fold(csum_add(check, da));
	return (__u16)~csum_fold(csum_add(csum_add((__u16)~check, da), dp));
}

/* fix_l4_check updates the transport checksum at ck as fix_tcp_check does,
 * with UDP's rule for zero (l4_flags). */
static __always_inline void fix_l4_check(__u16 *ck, int udp, __u32 mode, __u32 da, __u32 dp)
{
	__u16 v;

	if (udp && mode != CSUM_PARTIAL && *ck == 0)
		return;
	v = fix_tcp_check(*ck, mode, da, dp);
	*ck = (udp && v == 0) ? 0xffff : v;
}

/* rewrite_direct writes out's addresses and ports with direct packet
 * access and checksums computed here: no helper calls, the steady-state
 * path's largest cost (BENCHMARKS.md, "Datapath cost, alone"). It takes IPv4
 * without options and IPv6 with the TCP header in the linear part, and
 * skbs whose checksum is not CHECKSUM_COMPLETE (skb->csum would need
 * updating, which only the helpers do); otherwise it returns 1 and
 * rewrite_tuple uses the helpers. A cloned skb is uncloned by the prologue
 * the verifier adds to programs that write packets directly. */
static __attribute__((noinline)) int rewrite_direct(struct __sk_buff *skb, struct pkt *p, const struct dysco_ends *out)
{
	void *data = (void *)(long)skb->data;
	void *end = (void *)(long)skb->data_end;
	__u32 mode = l4_mode(skb, p), da = 0, dp, i;
	__u32 newp = (__u32)out->sport | ((__u32)out->dport << 16);
	const __u32 *n;

	if (mode == CSUM_COMPLETE || p->l3 != sizeof(struct ethhdr))
		return 1;
	if (!p->v6) {
		struct iphdr *ip = data + sizeof(struct ethhdr);
		struct tcphdr *th = (void *)(ip + 1);
		__u32 *ports = (__u32 *)th;
		__u16 *ck = p->udp ? (__u16 *)((__u8 *)th + offsetof(struct udphdr, check)) : &th->check;
		__u32 s4, d4;

		/* The transport header in the linear part: a UDP GSO packet's
		 * may hold nothing after it. */
		if (p->l4 != p->l3 + sizeof(struct iphdr) || (void *)th + (p->udp ? 8 : sizeof(*th)) > end)
			return 1;
		__builtin_memcpy(&s4, out->saddr + 12, 4);
		__builtin_memcpy(&d4, out->daddr + 12, 4);
		da = csum_swap(csum_swap(0, ip->saddr, s4), ip->daddr, d4);
		dp = csum_swap(0, *ports, newp);
		ip->check = (__u16)~csum_fold(csum_add((__u16)~ip->check, da));
		ip->saddr = s4;
		ip->daddr = d4;
		fix_l4_check(ck, p->udp, mode, da, dp);
		*ports = newp;
	} else {
		struct ipv6hdr *ip6 = data + sizeof(struct ethhdr);
		struct tcphdr *th = (void *)(ip6 + 1);
		__u32 *ports = (__u32 *)th;
		__u16 *ck = p->udp ? (__u16 *)((__u8 *)th + offsetof(struct udphdr, check)) : &th->check;
		__u32 *a = (__u32 *)&ip6->saddr;

		if ((void *)th + (p->udp ? 8 : sizeof(*th)) > end)
			return 1;
		n = (const __u32 *)out->saddr;
#pragma unroll
		for (i = 0; i < 8; i++) {
			__u32 w;
			__builtin_memcpy(&w, (const __u8 *)n + 4 * i, 4);
			da = csum_swap(da, a[i], w);
			a[i] = w;
		}
		dp = csum_swap(0, *ports, newp);
		fix_l4_check(ck, p->udp, mode, da, dp);
		*ports = newp;
	}
	__builtin_memcpy(p->t.saddr, out->saddr, 16);
	__builtin_memcpy(p->t.daddr, out->daddr, 16);
	p->t.sport = out->sport;
	p->t.dport = out->dport;
	return 0;
}

/* rewrite_tuple writes out's addresses and ports into the packet with the
 * kernel's helpers, which also keep a CHECKSUM_COMPLETE skb's csum right.
 * Without IPv4 options the addresses and the ports are contiguous: one
 * store. Set-up and the two-path phase use it; the steady state
 * (rewrite_fast) tries rewrite_direct first. */
static __attribute__((noinline)) int rewrite_tuple(struct __sk_buff *skb, struct pkt *p, const struct dysco_ends *out)
{
	__u32 k0 = 0;
	struct scratch *sc = bpf_map_lookup_elem(&dysco_scratch, &k0);
	__u32 oldp = (__u32)p->t.sport | ((__u32)p->t.dport << 16);
	__u32 newp = (__u32)out->sport | ((__u32)out->dport << 16);
	__u64 lf = l4_flags(skb, p);
	__u32 co = L4_CSUM_OFF(p);
	__s64 diff;

	/* In scratch space: the callers' frames leave little room. */
	if (!sc)
		return -1;
	if (!p->v6) {
		__u32 *old = sc->csw, *new = sc->csw + 8;
		__builtin_memcpy(&old[0], p->t.saddr + 12, 4);
		__builtin_memcpy(&old[1], p->t.daddr + 12, 4);
		__builtin_memcpy(&new[0], out->saddr + 12, 4);
		__builtin_memcpy(&new[1], out->daddr + 12, 4);
		new[2] = newp;
		if (old[0] != new[0] || old[1] != new[1]) {
			diff = bpf_csum_diff(old, 8, new, 8, 0);
			if (bpf_l3_csum_replace(skb, IP_CSUM_OFF(p), 0, diff, 0) ||
			    bpf_l4_csum_replace(skb, co, 0, diff, BPF_F_PSEUDO_HDR | lf))
				return -1;
		}
		if (oldp != newp) {
			diff = bpf_csum_diff(&oldp, 4, &newp, 4, 0);
			if (bpf_l4_csum_replace(skb, co, 0, diff, lf))
				return -1;
		}
		if (p->l4 == p->l3 + sizeof(struct iphdr)) {
			if (bpf_skb_store_bytes(skb, p->l3 + offsetof(struct iphdr, saddr), new, 12, 0))
				return -1;
		} else if (bpf_skb_store_bytes(skb, p->l3 + offsetof(struct iphdr, saddr), new, 8, 0) ||
			   bpf_skb_store_bytes(skb, p->l4, &newp, 4, 0)) {
			return -1;
		}
	} else {
		__u32 *old = sc->csw, *new = sc->csw + 8;
		__builtin_memcpy(&old[0], p->t.saddr, 16);
		__builtin_memcpy(&old[4], p->t.daddr, 16);
		__builtin_memcpy(&new[0], out->saddr, 16);
		__builtin_memcpy(&new[4], out->daddr, 16);
		new[8] = newp;
		diff = bpf_csum_diff(old, 32, new, 32, 0);
		if (bpf_l4_csum_replace(skb, co, 0, diff, BPF_F_PSEUDO_HDR | lf))
			return -1;
		if (oldp != newp) {
			diff = bpf_csum_diff(&oldp, 4, &newp, 4, 0);
			if (bpf_l4_csum_replace(skb, co, 0, diff, lf))
				return -1;
		}
		/* The TCP header follows the IPv6 header (parse allows no
		 * extension headers): addresses and ports are contiguous. */
		if (bpf_skb_store_bytes(skb, p->l3 + offsetof(struct ipv6hdr, saddr), new, 36, 0))
			return -1;
	}
	__builtin_memcpy(p->t.saddr, out->saddr, 16);
	__builtin_memcpy(p->t.daddr, out->daddr, 16);
	p->t.sport = out->sport;
	p->t.dport = out->dport;
	return 0;
}

/* rewrite_fast is rewrite_tuple for the steady state: direct writes where
 * they are right, the helpers otherwise. Kept out of the rarer paths, whose
 * stack frames have no room for both. */
static __always_inline int rewrite_fast(struct __sk_buff *skb, struct pkt *p, const struct dysco_ends *out)
{
	if (!rewrite_direct(skb, p, out))
		return 0;
	/* A UDP GSO packet's field is the pseudo header's sum, which the
	 * helpers update as a full checksum unless ip_summed says
	 * CHECKSUM_PARTIAL (l4_mode): rewrite_direct takes every such packet
	 * but one with IPv4 options, which no sender of UDP GSO writes. */
	if (p->udp && skb->gso_size && skb_ip_summed(skb) != CSUM_PARTIAL)
		return -1;
	return rewrite_tuple(skb, p, out);
}

/* set_l3_len changes the IP length fields (and the pseudo-header length of
 * the transport checksum; UDP: its length field too) for a packet about to
 * grow or shrink to l3_len bytes of IP. */
static __always_inline int set_l3_len(struct __sk_buff *skb, struct pkt *p, __u32 l3_len)
{
	__u32 hl = p->l4 - p->l3;
	__be16 oldt = bpf_htons(p->l3_len - hl), newt = bpf_htons(l3_len - hl);

	if (!p->v6) {
		__be16 o = bpf_htons(p->l3_len), n = bpf_htons(l3_len);
		if (bpf_l3_csum_replace(skb, IP_CSUM_OFF(p), o, n, 2) ||
		    bpf_skb_store_bytes(skb, p->l3 + offsetof(struct iphdr, tot_len), &n, 2, 0))
			return -1;
	} else {
		__be16 n = bpf_htons(l3_len - sizeof(struct ipv6hdr));
		if (bpf_skb_store_bytes(skb, p->l3 + offsetof(struct ipv6hdr, payload_len), &n, 2, 0))
			return -1;
	}
	if (p->udp) {
		__u64 lf = l4_flags(skb, p);

		/* The length is in the pseudo header and in the UDP header. */
		if (bpf_l4_csum_replace(skb, L4_CSUM_OFF(p), oldt, newt, BPF_F_PSEUDO_HDR | lf | 2) ||
		    bpf_l4_csum_replace(skb, L4_CSUM_OFF(p), oldt, newt, lf | 2) ||
		    bpf_skb_store_bytes(skb, p->l4 + offsetof(struct udphdr, len), &newt, 2, 0))
			return -1;
	} else if (bpf_l4_csum_replace(skb, TCP_CSUM_OFF(p), oldt, newt, BPF_F_PSEUDO_HDR | 2)) {
		return -1;
	}
	p->l3_len = l3_len;
	return 0;
}

/* set_doff changes the TCP data offset to doff bytes. */
static __always_inline int set_doff(struct __sk_buff *skb, struct pkt *p, __u32 doff)
{
	__u16 old, new;

	if (bpf_skb_load_bytes(skb, p->l4 + 12, &old, 2))
		return -1;
	new = old;
	((__u8 *)&new)[0] = (__u8)((doff / 4) << 4) | (((__u8 *)&old)[0] & 0x0f);
	if (bpf_l4_csum_replace(skb, TCP_CSUM_OFF(p), old, new, 2) ||
	    bpf_skb_store_bytes(skb, p->l4 + 12, &new, 2, 0))
		return -1;
	p->doff = doff;
	return 0;
}

/* csum_bytes accounts in the TCP checksum for len bytes (a multiple of 4,
 * at most 512) added to or removed from the segment. */
static __always_inline int csum_bytes(struct __sk_buff *skb, struct pkt *p, void *buf, __u32 len, int removed)
{
	__s64 diff;

	if (removed)
		diff = bpf_csum_diff(buf, len, 0, 0, 0);
	else
		diff = bpf_csum_diff(0, 0, buf, len, 0);
	if (diff < 0)
		return -1;
	return bpf_l4_csum_replace(skb, L4_CSUM_OFF(p), 0, diff, l4_flags(skb, p)) ? -1 : 0;
}

/* replace_u32 rewrites a 32-bit TCP header or option field at off. */
static __always_inline int replace_u32(struct __sk_buff *skb, struct pkt *p, __u32 off, __u32 add)
{
	__be32 old, new;

	if (bpf_skb_load_bytes(skb, off, &old, 4))
		return -1;
	new = bpf_htonl(bpf_ntohl(old) + add);
	if (bpf_l4_csum_replace(skb, TCP_CSUM_OFF(p), old, new, 4) ||
	    bpf_skb_store_bytes(skb, off, &new, 4, 0))
		return -1;
	return 0;
}

#define TCPOPT_EOL 0
#define TCPOPT_NOP 1
#define TCPOPT_WS 3
#define TCPOPT_SACK 5
#define TCPOPT_TS 8

struct optstate {
	struct __sk_buff *skb;
	struct pkt *p;
	const struct delta_val *d;
	__u32 off; /* offset of the next option in the packet */
	__u32 end; /* end of the options */
	int err;
};

/* opt_step translates one TCP option (SACK edges, timestamps) and moves to
 * the next; it returns 1 when the options are done. It runs under bpf_loop,
 * so the verifier checks it once rather than once per iteration. */
static long opt_step(__u32 idx, void *ctx)
{
	struct optstate *s = ctx;
	struct __sk_buff *skb = s->skb;
	__u8 hdr[2];
	__u32 i;

	if (s->off >= s->end)
		return 1;
	if (bpf_skb_load_bytes(skb, s->off, hdr, 1))
		return 1;
	if (hdr[0] == TCPOPT_EOL)
		return 1;
	if (hdr[0] == TCPOPT_NOP) {
		s->off++;
		return 0;
	}
	if (s->off + 2 > s->end || bpf_skb_load_bytes(skb, s->off, hdr, 2) || hdr[1] < 2 ||
	    s->off + hdr[1] > s->end)
		return 1;
	if (hdr[0] == TCPOPT_TS && hdr[1] == 10) {
		if (s->d->tsval && replace_u32(skb, s->p, s->off + 2, s->d->tsval))
			s->err = 1;
		if (s->d->tsecr && replace_u32(skb, s->p, s->off + 6, s->d->tsecr))
			s->err = 1;
	} else if (hdr[0] == TCPOPT_SACK && s->d->ack) {
		/* SACK blocks name bytes of the other direction, as the ack does
		 * (like nf_conntrack_seqadj's SACK adjustment). */
		for (i = 0; i < 4; i++) {
			if (2 + (i + 1) * 8 > hdr[1])
				break;
			if (replace_u32(skb, s->p, s->off + 2 + i * 8, s->d->ack) ||
			    replace_u32(skb, s->p, s->off + 6 + i * 8, s->d->ack))
				s->err = 1;
		}
	}
	s->off += hdr[1];
	return 0;
}

/* apply_delta translates seq, ack, SACK blocks, timestamps and the window
 * of a packet by d (§3.4 table, §4.2 option translation). */
static __always_inline int apply_delta(struct __sk_buff *skb, struct pkt *p, const struct delta_val *d)
{
	struct optstate s = {.skb = skb, .p = p, .d = d, .off = p->l4 + sizeof(struct tcphdr), .end = p->l4 + p->doff};

	if (d->seq && replace_u32(skb, p, p->l4 + 4, d->seq))
		return -1;
	if (d->ack && (p->flags & TH_ACK) && replace_u32(skb, p, p->l4 + 8, d->ack))
		return -1;
	if (d->ws_on && !(p->flags & TH_SYN)) {
		__be16 old, new;
		__u32 w;
		if (bpf_skb_load_bytes(skb, p->l4 + 14, &old, 2))
			return -1;
		w = ((__u32)bpf_ntohs(old) << (d->ws_in & 15)) >> (d->ws_out & 15);
		if (w > 0xffff)
			w = 0xffff;
		new = bpf_htons(w);
		if (bpf_l4_csum_replace(skb, TCP_CSUM_OFF(p), old, new, 2) ||
		    bpf_skb_store_bytes(skb, p->l4 + 14, &new, 2, 0))
			return -1;
	}
	if (!d->tsval && !d->tsecr && !d->ack)
		return 0;
	bpf_loop(40, opt_step, &s, 0);
	return s.err ? -1 : 0;
}

/* delta_direct applies d to the fixed TCP header and, when they are the
 * only option, the timestamps, with direct writes and the checksum computed
 * here (as rewrite_direct): the steady state of a session whose proxy left,
 * where every packet of both directions is translated. It takes headers in
 * the linear part (IPv4 without options, IPv6), no options or exactly Linux's
 * NOP, NOP, timestamps, and skbs that are not CHECKSUM_COMPLETE; anything
 * else (SACK blocks among them) returns 1 for apply_delta. Sequence, ack,
 * window and timestamps are in the segment, not in the pseudo header: with
 * CHECKSUM_PARTIAL the check field does not change. */
static __attribute__((noinline)) int delta_direct(struct __sk_buff *skb, struct pkt *p, const struct delta_val *d)
{
	void *data = (void *)(long)skb->data;
	void *end = (void *)(long)skb->data_end;
	__u32 mode = skb_ip_summed(skb), sum = 0, o, n;
	__u32 *w;

	if (mode == CSUM_COMPLETE || p->l3 != sizeof(struct ethhdr))
		return 1;
	if (!p->v6) {
		if (p->l4 != p->l3 + sizeof(struct iphdr))
			return 1;
		w = data + sizeof(struct ethhdr) + sizeof(struct iphdr);
	} else {
		w = data + sizeof(struct ethhdr) + sizeof(struct ipv6hdr);
	}
	/* w: the TCP header as 32-bit words, then the 12 bytes of options when
	 * there are any. */
	if (p->doff == sizeof(struct tcphdr)) {
		if ((void *)(w + 5) > end)
			return 1;
	} else if (p->doff == sizeof(struct tcphdr) + 12) {
		if ((void *)(w + 8) > end || w[5] != bpf_htonl(0x0101080a))
			return 1;
	} else {
		return 1;
	}
	if (d->seq) {
		o = w[1];
		n = bpf_htonl(bpf_ntohl(o) + d->seq);
		sum = csum_swap(sum, o, n);
		w[1] = n;
	}
	if (d->ack && (p->flags & TH_ACK)) {
		o = w[2];
		n = bpf_htonl(bpf_ntohl(o) + d->ack);
		sum = csum_swap(sum, o, n);
		w[2] = n;
	}
	if (d->ws_on && !(p->flags & TH_SYN)) {
		/* Word 3: data offset, flags, window. */
		__u32 win;
		o = w[3];
		win = ((bpf_ntohl(o) & 0xffff) << (d->ws_in & 15)) >> (d->ws_out & 15);
		if (win > 0xffff)
			win = 0xffff;
		n = bpf_htonl((bpf_ntohl(o) & 0xffff0000) | win);
		sum = csum_swap(sum, o, n);
		w[3] = n;
	}
	if (p->doff != sizeof(struct tcphdr) && (void *)(w + 8) <= end) {
		if (d->tsval) {
			o = w[6];
			n = bpf_htonl(bpf_ntohl(o) + d->tsval);
			sum = csum_swap(sum, o, n);
			w[6] = n;
		}
		if (d->tsecr) {
			o = w[7];
			n = bpf_htonl(bpf_ntohl(o) + d->tsecr);
			sum = csum_swap(sum, o, n);
			w[7] = n;
		}
	}
	if (mode != CSUM_PARTIAL) {
		/* The check field: bytes 16-17 of the header, in word 4. */
		__u16 *check = (__u16 *)(w + 4);
		*check = (__u16)~csum_fold(csum_add((__u16)~*check, sum));
	}
	return 0;
}

/* apply_delta_fast is apply_delta for the steady state: direct writes where
 * delta_direct takes the packet, the helpers otherwise. */
static __always_inline int apply_delta_fast(struct __sk_buff *skb, struct pkt *p, const struct delta_val *d)
{
	if (!delta_direct(skb, p, d))
		return 0;
	return apply_delta(skb, p, d);
}

#endif
