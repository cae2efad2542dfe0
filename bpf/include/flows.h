/* SPDX-License-Identifier: (GPL-2.0-only OR MIT) */
/* The flow maps by family. An IPv4 flow (both addresses of its key
 * IPv4-mapped: parse() never yields an IPv6 packet with such addresses) is
 * kept in dysco_flows4 with a 16-byte key and a 48-byte value; an IPv6 flow in
 * dysco_flows6. Code everywhere else speaks struct dysco_tuple and struct
 * flow_val: flow_get returns a pointer that is valid for the head of the
 * value only (FLOW_HEAD_LEN bytes, the fields before out, which both layouts
 * share) and copies the rewrite target out; the verifier rejects any read of
 * out through the pointer on the IPv4 path. */
#ifndef DYSCO_FLOWS_H
#define DYSCO_FLOWS_H

#include "maps.h"
#include "parsing.h"

static __always_inline int key_is4(const struct dysco_tuple *k)
{
	return is_mapped4(k->saddr) && is_mapped4(k->daddr);
}

static __always_inline void key4_of(struct dysco_tuple4 *k4, const struct dysco_tuple *k)
{
	__builtin_memcpy(&k4->saddr, k->saddr + 12, 4);
	__builtin_memcpy(&k4->daddr, k->daddr + 12, 4);
	k4->sport = k->sport;
	k4->dport = k->dport;
	k4->proto = k->proto;
	k4->pad[0] = k4->pad[1] = k4->pad[2] = 0;
}

static __always_inline void ends_from4(struct dysco_ends *e, const struct dysco_ends4 *e4)
{
	map4(e->saddr, e4->saddr);
	map4(e->daddr, e4->daddr);
	e->sport = e4->sport;
	e->dport = e4->dport;
}

/* flow_get finds the flow at k. The pointer reaches the head only; out, if
 * not null, receives the rewrite target. */
static __always_inline struct flow_val *flow_get(const struct dysco_tuple *k, struct dysco_ends *out)
{
	if (key_is4(k)) {
		struct dysco_tuple4 k4;
		struct flow_val4 *f4;

		key4_of(&k4, k);
		f4 = bpf_map_lookup_elem(&dysco_flows4, &k4);
		if (f4 && out)
			ends_from4(out, &f4->out);
		return (struct flow_val *)f4;
	} else {
		struct flow_val *f = bpf_map_lookup_elem(&dysco_flows6, k);

		if (f && out)
			__builtin_memcpy(out, &f->out, sizeof(*out));
		return f;
	}
}

/* flow_put inserts (or replaces, by flags) the flow at k; an IPv4 flow is
 * converted in tmp. A flow whose target is of the other family than its key
 * is refused (-EINVAL): no chain mixes families. */
static __always_inline long flow_put(const struct dysco_tuple *k, const struct flow_val *v, __u64 flags,
				     struct flow_val4 *tmp)
{
	if (key_is4(k)) {
		struct dysco_tuple4 k4;

		if (!is_mapped4(v->out.saddr) || !is_mapped4(v->out.daddr))
			return -22;
		key4_of(&k4, k);
		__builtin_memcpy(tmp, v, FLOW_HEAD_LEN);
		__builtin_memcpy(&tmp->out.saddr, v->out.saddr + 12, 4);
		__builtin_memcpy(&tmp->out.daddr, v->out.daddr + 12, 4);
		tmp->out.sport = v->out.sport;
		tmp->out.dport = v->out.dport;
		return bpf_map_update_elem(&dysco_flows4, &k4, tmp, flags);
	}
	return bpf_map_update_elem(&dysco_flows6, k, v, flags);
}

static __always_inline long flow_del(const struct dysco_tuple *k)
{
	if (key_is4(k)) {
		struct dysco_tuple4 k4;

		key4_of(&k4, k);
		return bpf_map_delete_elem(&dysco_flows4, &k4);
	}
	return bpf_map_delete_elem(&dysco_flows6, k);
}

#endif
