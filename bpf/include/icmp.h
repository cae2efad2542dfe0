/* SPDX-License-Identifier: (GPL-2.0-only OR MIT) */
/* ICMP errors about subsession packets, made errors about their session so
 * that the session's source learns of them as it would without Dysco.
 *
 * Provides: ingress_icmp.
 * Expects: to be called on ingress with a packet that parse() refused: it
 * reads the headers itself, by offset from the Ethernet header. Returns a
 * TC verdict (TC_ACT_OK for anything but such an error).
 * Maps: dysco_scratch (buf, next, ends), dysco_flows4 or dysco_flows6
 * (read), dysco_local (read), dysco_stats. */
#ifndef DYSCO_ICMP_H
#define DYSCO_ICMP_H

#include <linux/bpf.h>
#include <linux/pkt_cls.h>
#include <linux/if_ether.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>
#include "maps.h"
#include "parsing.h"
#include "flows.h"
#include "tuple.h"

/* ingress_icmp translates an ICMP error about a subsession packet this host
 * sent (a next hop unreachable, a packet too big, a closed UDP port) into
 * one about the session, addressed to the session's source: that host's TCP
 * or UDP socket then learns of it as it would without Dysco (a UDP socket
 * gets ECONNREFUSED for a closed port), and a connection to a dead next hop
 * fails at once instead of by timeout. The quoted tuple is rewritten (with
 * the quoted IPv4 checksum and the ICMP checksum), and the outer destination
 * becomes the session's source when that is another host (an agentless
 * client behind an edge host, or the client of a middlebox's session). */
static __attribute__((noinline)) int ingress_icmp(struct __sk_buff *skb)
{
	__u32 k0 = 0, l3 = sizeof(struct ethhdr), icmp, in3, in4, ihl;
	struct scratch *sc = bpf_map_lookup_elem(&dysco_scratch, &k0);
	struct dysco_tuple *kp;
	struct dysco_ends *fo;
	struct flow_val *f;
	__u8 *hdr;
	__u16 proto;
	__u8 l4p;
	int v6;
	__s64 diff;

	/* Buffers in scratch space: this runs beside ingress_syn's frame. */
	if (!sc)
		return TC_ACT_OK;
	hdr = sc->buf;
	kp = &sc->next;
	fo = &sc->ends;
	__builtin_memset(kp, 0, sizeof(*kp));

	if (bpf_skb_load_bytes(skb, 12, &proto, 2))
		return TC_ACT_OK;
	if (proto == bpf_htons(ETH_P_IP)) {
		if (bpf_skb_load_bytes(skb, l3, hdr, 20) || hdr[9] != IPPROTO_ICMP)
			return TC_ACT_OK;
		v6 = 0;
		icmp = l3 + (hdr[0] & 0xf) * 4;
		if (bpf_skb_load_bytes(skb, icmp, hdr, 1) || (hdr[0] != 3 && hdr[0] != 11 && hdr[0] != 12))
			return TC_ACT_OK;
		in3 = icmp + 8;
		if (bpf_skb_load_bytes(skb, in3, hdr, 20) || (hdr[9] != IPPROTO_TCP && hdr[9] != IPPROTO_UDP))
			return TC_ACT_OK;
		l4p = hdr[9];
		ihl = (hdr[0] & 0xf) * 4;
		if (ihl < 20 || ihl > 60)
			return TC_ACT_OK;
		map4(kp->daddr, *(__u32 *)&hdr[12]); /* key = reverse of the quote */
		map4(kp->saddr, *(__u32 *)&hdr[16]);
		in4 = in3 + ihl;
	} else if (proto == bpf_htons(ETH_P_IPV6)) {
		if (bpf_skb_load_bytes(skb, l3, hdr, 40) || hdr[6] != IPPROTO_ICMPV6)
			return TC_ACT_OK;
		v6 = 1;
		icmp = l3 + 40;
		if (bpf_skb_load_bytes(skb, icmp, hdr, 1) || hdr[0] < 1 || hdr[0] > 4)
			return TC_ACT_OK;
		in3 = icmp + 8;
		if (bpf_skb_load_bytes(skb, in3, hdr, 40) || (hdr[6] != IPPROTO_TCP && hdr[6] != IPPROTO_UDP))
			return TC_ACT_OK;
		l4p = hdr[6];
		__builtin_memcpy(kp->daddr, &hdr[8], 16);
		__builtin_memcpy(kp->saddr, &hdr[24], 16);
		in4 = in3 + 40;
	} else {
		return TC_ACT_OK;
	}
	if (bpf_skb_load_bytes(skb, in4, hdr, 4))
		return TC_ACT_OK;
	kp->dport = *(__be16 *)&hdr[0];
	kp->sport = *(__be16 *)&hdr[2];
	kp->proto = l4p;
	f = flow_get(kp, fo);
	if (!f || !(f->flags & FL_INGRESS))
		return TC_ACT_OK;
	/* The quote becomes the reverse of the flow's target (fo): the
	 * session as this host sees it on the side the packet was going. kp
	 * holds the quote's source and destination swapped. */
	{
		__u32 icsum = icmp + 2;
		__be16 nports[2] = {fo->dport, fo->sport}, oports[2] = {kp->dport, kp->sport};
		__u8 nsrc[16], ndst[16];

		__builtin_memcpy(nsrc, fo->daddr, 16);
		__builtin_memcpy(ndst, fo->saddr, 16);
		if (!v6) {
			__u32 *oa = (__u32 *)(sc->buf + 48), *na = (__u32 *)(sc->buf + 112);
			__builtin_memcpy(&oa[0], kp->daddr + 12, 4);
			__builtin_memcpy(&oa[1], kp->saddr + 12, 4);
			__builtin_memcpy(&na[0], nsrc + 12, 4);
			__builtin_memcpy(&na[1], ndst + 12, 4);
			/* The quoted header's checksum absorbs the address change,
			 * so the ICMP checksum sees only the ports change. */
			diff = bpf_csum_diff(oa, 8, na, 8, 0);
			if (bpf_l3_csum_replace(skb, in3 + 10, 0, diff, 0) ||
			    bpf_skb_store_bytes(skb, in3 + 12, na, 8, 0))
				goto fail;
		} else {
			__u32 *oa = (__u32 *)(sc->buf + 48), *na = (__u32 *)(sc->buf + 112);
			__builtin_memcpy(&oa[0], kp->daddr, 16);
			__builtin_memcpy(&oa[4], kp->saddr, 16);
			__builtin_memcpy(&na[0], nsrc, 16);
			__builtin_memcpy(&na[4], ndst, 16);
			diff = bpf_csum_diff(oa, 32, na, 32, 0);
			if (bpf_l4_csum_replace(skb, icsum, 0, diff, 0) ||
			    bpf_skb_store_bytes(skb, in3 + 8, na, 32, 0))
				goto fail;
		}
		diff = bpf_csum_diff((__u32 *)oports, 4, (__u32 *)nports, 4, 0);
		if (bpf_l4_csum_replace(skb, icsum, 0, diff, 0) || bpf_skb_store_bytes(skb, in4, nports, 4, 0))
			goto fail;
		/* Address it to the session's source if that is another host. */
		if (!is_local(nsrc)) {
			if (!v6) {
				__u32 od, nd;
				if (bpf_skb_load_bytes(skb, l3 + 16, &od, 4))
					goto fail;
				__builtin_memcpy(&nd, nsrc + 12, 4);
				if (bpf_l3_csum_replace(skb, l3 + 10, od, nd, 4) || bpf_skb_store_bytes(skb, l3 + 16, &nd, 4, 0))
					goto fail;
			} else {
				__u32 od[4];
				if (bpf_skb_load_bytes(skb, l3 + 24, od, 16))
					goto fail;
				diff = bpf_csum_diff(od, 16, (__u32 *)nsrc, 16, 0);
				if (bpf_l4_csum_replace(skb, icsum, 0, diff, BPF_F_PSEUDO_HDR) ||
				    bpf_skb_store_bytes(skb, l3 + 24, nsrc, 16, 0))
					goto fail;
			}
		}
	}
	stat_inc(STAT_ICMP);
	return TC_ACT_OK;
fail:
	stat_inc(STAT_DROP_HELPER);
	return TC_ACT_SHOT;
}

#endif
