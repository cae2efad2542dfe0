/* SPDX-License-Identifier: (GPL-2.0-only OR MIT) */
/* Routing of rewritten packets: a packet whose destination the datapath
 * changed leaves by that destination's route (bpf_fib_lookup), through
 * bpf_redirect_neigh.
 *
 * Provides: route, same_route, redirect_to.
 * Expects: a TC program's skb (the lookup starts from skb->ifindex);
 * addresses in the packet's family (v6), IPv4 ones IPv4-mapped.
 * redirect_to returns a TC verdict, which the caller returns.
 * Maps: dysco_local (read, through is_local), dysco_local_if (read),
 * dysco_stats. */
#ifndef DYSCO_ROUTE_H
#define DYSCO_ROUTE_H

#include <linux/bpf.h>
#include <linux/pkt_cls.h>
#include "maps.h"
#include "parsing.h"
#include "tuple.h"

#ifndef AF_INET
#define AF_INET 2
#endif
#ifndef AF_INET6
#define AF_INET6 10
#endif

/* route finds the way to t's destination for bpf_redirect_neigh: the
 * interface and next hop, and (with src) the source address to use. A
 * rewritten destination leaves by its own route: no host needs static
 * routes through middleboxes.
 *
 * bpf_fib_lookup answers only on hosts that forward. On other hosts (plain
 * end hosts) the packet leaves by the interface of its source address
 * (dysco_local_if: a subsession moved to another interface's address,
 * Reconfigure.Source) or else by the one its session was routed to, with
 * the kernel resolving the next hop (nh->nh_family == 0); a packet whose
 * source is no longer the host's has no way out (-1); a source to choose
 * (src) is the session's own local address. */
static __always_inline int route(struct __sk_buff *skb, const struct dysco_ends *t, int v6,
				 struct bpf_redir_neigh *nh, __u32 *ifindex, __u8 *src, const __u8 *own)
{
	struct bpf_fib_lookup f = {};
	__u32 flags = BPF_FIB_LOOKUP_SKIP_NEIGH | (src ? BPF_FIB_LOOKUP_SRC : 0);
	long rc;

	__builtin_memset(nh, 0, sizeof(*nh));
	f.l4_protocol = IPPROTO_TCP;
	f.sport = t->sport;
	f.dport = t->dport;
	f.ifindex = skb->ifindex;
	if (!v6) {
		f.family = AF_INET;
		__builtin_memcpy(&f.ipv4_dst, t->daddr + 12, 4);
		if (!src)
			__builtin_memcpy(&f.ipv4_src, t->saddr + 12, 4);
	} else {
		f.family = AF_INET6;
		__builtin_memcpy(f.ipv6_dst, t->daddr, 16);
		if (!src)
			__builtin_memcpy(f.ipv6_src, t->saddr, 16);
	}
	rc = bpf_fib_lookup(skb, &f, sizeof(f), flags);
	if (rc == BPF_FIB_LKUP_RET_FWD_DISABLED) {
		const __u32 *oif;

		*ifindex = skb->ifindex;
		if (src) {
			if (!own || !is_local(own))
				return -1;
			__builtin_memcpy(src, own, 16);
			return 0;
		}
		oif = bpf_map_lookup_elem(&dysco_local_if, t->saddr);
		if (oif && *oif)
			*ifindex = *oif;
		else if (!is_local(t->saddr))
			/* The source address is gone (the host moved; its
			 * sessions are being rebound): sent anyway, the packet
			 * would wait in the neighbour queue of an interface
			 * with no route, and TCP does not retransmit a segment
			 * until its last copy has left the host. Dropped, it
			 * is retransmitted on the new subsession. */
			return -1;
		return 0;
	}
	if (rc != BPF_FIB_LKUP_RET_SUCCESS)
		return -1;
	*ifindex = f.ifindex;
	if (f.family == AF_INET) {
		nh->nh_family = AF_INET;
		nh->ipv4_nh = f.ipv4_dst;
		if (src)
			map4(src, f.ipv4_src);
	} else {
		nh->nh_family = AF_INET6;
		__builtin_memcpy(nh->ipv6_nh, f.ipv6_dst, 16);
		if (src)
			__builtin_memcpy(src, f.ipv6_src, 16);
	}
	return 0;
}

/* same_route tells whether packets to a and to b leave by the same
 * interface and next hop: then a rewrite from one destination to the other
 * needs no new route, and the packet no second pass through egress. Only
 * forwarding hosts can tell (bpf_fib_lookup); on others the answer is no. */
static __attribute__((noinline)) int same_route(struct __sk_buff *skb, int v6, const __u8 *a, const __u8 *b)
{
	struct bpf_fib_lookup f;
	__u32 nh[4], ifindex, i;

	for (i = 0; i < 2; i++) {
		__builtin_memset(&f, 0, sizeof(f));
		f.l4_protocol = IPPROTO_TCP;
		f.ifindex = skb->ifindex;
		f.family = v6 ? AF_INET6 : AF_INET;
		if (v6)
			__builtin_memcpy(f.ipv6_dst, i ? b : a, 16);
		else
			__builtin_memcpy(&f.ipv4_dst, (i ? b : a) + 12, 4);
		if (bpf_fib_lookup(skb, &f, sizeof(f), BPF_FIB_LOOKUP_SKIP_NEIGH) != BPF_FIB_LKUP_RET_SUCCESS)
			return 0;
		if (i == 0) {
			ifindex = f.ifindex;
			__builtin_memcpy(nh, f.ipv6_dst, 16); /* ipv4_dst shares the first word */
		}
	}
	return ifindex == f.ifindex && nh[0] == f.ipv6_dst[0] &&
	       (!v6 || (nh[1] == f.ipv6_dst[1] && nh[2] == f.ipv6_dst[2] && nh[3] == f.ipv6_dst[3]));
}

static __always_inline int redirect_to(struct __sk_buff *skb, const struct dysco_ends *t, int v6)
{
	struct bpf_redir_neigh nh;
	__u32 ifindex;

	if (route(skb, t, v6, &nh, &ifindex, 0, 0)) {
		stat_inc(STAT_DROP_NO_ROUTE);
		return TC_ACT_SHOT;
	}
	if (!nh.nh_family)
		return bpf_redirect_neigh(ifindex, 0, 0, 0);
	return bpf_redirect_neigh(ifindex, &nh, sizeof(nh), 0);
}

#endif
