/* SPDX-License-Identifier: (GPL-2.0-only OR MIT) */
/* Packet parsing. Offsets are kept rather than pointers: most helpers that
 * touch the packet invalidate every packet pointer, so code re-derives
 * pointers from these offsets after each helper call. */
#ifndef DYSCO_PARSING_H
#define DYSCO_PARSING_H

#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/in.h>
#include <linux/ip.h>
#include <linux/ipv6.h>
#include <linux/tcp.h>
#include <linux/udp.h>
#include <bpf/bpf_endian.h>
#include "structs.h"

#define TH_FIN 0x01
#define TH_SYN 0x02
#define TH_RST 0x04
#define TH_ACK 0x10


static __always_inline void map4(__u8 *dst, __be32 a)
{
	__builtin_memset(dst, 0, 10);
	dst[10] = 0xff;
	dst[11] = 0xff;
	__builtin_memcpy(dst + 12, &a, 4);
}

static __always_inline int is_mapped4(const __u8 *a)
{
	const __u32 *w = (const __u32 *)a;
	return w[0] == 0 && w[1] == 0 && w[2] == bpf_htonl(0xffff);
}

/* parse fills p for a TCP or UDP packet over IPv4 (unfragmented) or IPv6
 * (no extension headers). Anything else is not Dysco's business: -1. */
static __always_inline int parse(struct __sk_buff *skb, struct pkt *p)
{
	void *data = (void *)(long)skb->data;
	void *end = (void *)(long)skb->data_end;
	struct ethhdr *eth = data;
	struct tcphdr *th;

	if ((void *)(eth + 1) > end)
		return -1;
	p->l3 = sizeof(*eth);
	__builtin_memset(&p->t, 0, sizeof(p->t));
	if (eth->h_proto == bpf_htons(ETH_P_IP)) {
		struct iphdr *ip = data + sizeof(*eth);
		if ((void *)(ip + 1) > end)
			return -1;
		if ((ip->protocol != IPPROTO_TCP && ip->protocol != IPPROTO_UDP) || ip->ihl < 5)
			return -1;
		p->t.proto = ip->protocol;
		if (ip->frag_off & bpf_htons(0x3fff)) /* MF or offset */
			return -1;
		p->v6 = 0;
		p->l4 = p->l3 + ip->ihl * 4;
		p->l3_len = bpf_ntohs(ip->tot_len);
		map4(p->t.saddr, ip->saddr);
		map4(p->t.daddr, ip->daddr);
	} else if (eth->h_proto == bpf_htons(ETH_P_IPV6)) {
		struct ipv6hdr *ip6 = data + sizeof(*eth);
		if ((void *)(ip6 + 1) > end)
			return -1;
		if (ip6->nexthdr != IPPROTO_TCP && ip6->nexthdr != IPPROTO_UDP)
			return -1;
		p->t.proto = ip6->nexthdr;
		p->v6 = 1;
		p->l4 = p->l3 + sizeof(*ip6);
		p->l3_len = sizeof(*ip6) + bpf_ntohs(ip6->payload_len);
		__builtin_memcpy(p->t.saddr, &ip6->saddr, 16);
		__builtin_memcpy(p->t.daddr, &ip6->daddr, 16);
		/* IPv4-mapped addresses never appear on the wire (RFC 4291
		 * 2.5.5.2); Dysco keys IPv4 flows by them (flows.h). */
		if (is_mapped4(p->t.saddr) || is_mapped4(p->t.daddr))
			return -1;
	} else {
		return -1;
	}
	if (p->l4 > 14 + 60)
		return -1;
	p->udp = p->t.proto == IPPROTO_UDP;
	if (p->udp) {
		struct udphdr *uh = data + p->l4;

		if ((void *)(uh + 1) > end)
			return -1;
		p->t.sport = uh->source;
		p->t.dport = uh->dest;
		p->doff = sizeof(*uh);
		p->flags = 0;
		p->seq = p->ack = 0;
		if (p->l3_len < p->l4 - p->l3 + sizeof(*uh))
			return -1;
		p->payload = p->l3_len - (p->l4 - p->l3) - sizeof(*uh);
		return 0;
	}
	th = data + p->l4;
	if ((void *)(th + 1) > end)
		return -1;
	p->t.sport = th->source;
	p->t.dport = th->dest;
	p->doff = th->doff * 4;
	p->flags = ((__u8 *)th)[13];
	p->seq = bpf_ntohl(th->seq);
	p->ack = bpf_ntohl(th->ack_seq);
	if (p->doff < sizeof(*th) || p->l3_len < p->l4 - p->l3 + p->doff)
		return -1;
	p->payload = p->l3_len - (p->l4 - p->l3) - p->doff;
	return 0;
}

/* dysco_opt reads the 8 bytes at the end of the TCP options, where Dysco
 * puts its marking option, so that recognising a Dysco SYN is O(1). It
 * returns the option type (DYSCO_OPT_TYPE_*) or 0, and copies the option. */
static __always_inline int dysco_opt(struct __sk_buff *skb, const struct pkt *p, __u8 opt[DYSCO_OPT_LEN])
{
	if (p->udp)
		return 0;
	if (p->doff < sizeof(struct tcphdr) + DYSCO_OPT_LEN)
		return 0;
	if (bpf_skb_load_bytes(skb, p->l4 + p->doff - DYSCO_OPT_LEN, opt, DYSCO_OPT_LEN))
		return 0;
	if (opt[0] != DYSCO_OPT_KIND || opt[1] != DYSCO_OPT_LEN ||
	    opt[2] != (DYSCO_OPT_EXID >> 8) || opt[3] != (DYSCO_OPT_EXID & 0xff))
		return 0;
	if (opt[4] != DYSCO_OPT_TYPE_SYN_BLOCK && opt[4] != DYSCO_OPT_TYPE_LOCAL_TAG)
		return 0;
	return opt[4];
}

#endif
