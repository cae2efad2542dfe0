/* SPDX-License-Identifier: (GPL-2.0-only OR MIT) */
/* Addresses and tuples: copies and comparisons of addresses, the checks an
 * address of a SYN's block must pass, and the reversals that give the key
 * and the rewrite target of the answering direction.
 *
 * Provides: copy16, addr_eq, unicast, is_local, reverse, reverse_ends,
 * ends_of.
 * Expects: 16-byte addresses, IPv4 ones IPv4-mapped (structs.h); addr_eq
 * and unicast read them as 32-bit words.
 * Maps: dysco_local (read, is_local). */
#ifndef DYSCO_TUPLE_H
#define DYSCO_TUPLE_H

#include <linux/bpf.h>
#include "maps.h"
#include "parsing.h"

/* copy16 copies an address between scratch areas that clang cannot prove
 * disjoint (a memcpy would become an unsupported memmove). */
static __always_inline void copy16(__u8 *d, const __u8 *s)
{
	__u8 tmp[16];

	__builtin_memcpy(tmp, s, 16);
	__builtin_memcpy(d, tmp, 16);
}

static __always_inline int addr_eq(const __u8 *a, const __u8 *b)
{
	const __u32 *x = (const __u32 *)a, *y = (const __u32 *)b;

	return x[0] == y[0] && x[1] == y[1] && x[2] == y[2] && x[3] == y[3];
}

/* unicast tells whether a (IPv4-mapped or IPv6) can be a session's host or
 * a hop: not unspecified, loopback, multicast or the IPv4 broadcast address
 * (wire.Unicast, which the agent applies to the same fields). */
static __always_inline int unicast(const __u8 *a)
{
	const __u32 *w = (const __u32 *)a;

	if (is_mapped4(a))
		return w[3] != 0 && a[12] != 127 && (a[12] & 0xf0) != 0xe0 && w[3] != 0xffffffff;
	if (a[0] == 0xff)
		return 0; /* multicast */
	if (w[0] || w[1] || w[2])
		return 1;
	return w[3] != 0 && w[3] != bpf_htonl(1); /* :: and ::1 */
}

static __always_inline int is_local(const __u8 *addr)
{
	return bpf_map_lookup_elem(&dysco_local, addr) != 0;
}

/* reverse gives the key of the packets of protocol proto that answer those
 * sent to e. */
static __always_inline void reverse(struct dysco_tuple *r, const struct dysco_ends *e, __u8 proto)
{
	__builtin_memcpy(r->saddr, e->daddr, 16);
	__builtin_memcpy(r->daddr, e->saddr, 16);
	r->sport = e->dport;
	r->dport = e->sport;
	r->proto = proto;
	r->pad[0] = r->pad[1] = r->pad[2] = 0;
}

/* reverse_ends gives the rewrite target that answers packets of key t. */
static __always_inline void reverse_ends(struct dysco_ends *r, const struct dysco_tuple *t)
{
	__builtin_memcpy(r->saddr, t->daddr, 16);
	__builtin_memcpy(r->daddr, t->saddr, 16);
	r->sport = t->dport;
	r->dport = t->sport;
}

/* ends_of gives the addresses and ports of tuple t. */
static __always_inline void ends_of(struct dysco_ends *e, const struct dysco_tuple *t)
{
	__builtin_memcpy(e->saddr, t->saddr, 16);
	__builtin_memcpy(e->daddr, t->daddr, 16);
	e->sport = t->sport;
	e->dport = t->dport;
}

#endif
