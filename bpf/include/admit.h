/* SPDX-License-Identifier: (GPL-2.0-only OR MIT) */
/* Admission of Dysco SYNs (paper §2.3 "Security": the agents of a chain are
 * cooperating entities that must trust each other, and off-path attackers
 * are kept out with secrets they cannot guess).
 *
 * A SYN block carries a SipHash-2-4 MAC (wire.BlockMAC) of the block, its
 * MAC field zeroed, followed by the subsession tuple of the packet carrying
 * it: the receiver computes it over the tuple the SYN arrives on, so a block
 * altered in any byte or replayed from another address or port fails. Each
 * host that sends a SYN on signs its block for the subsession it sends it on
 * (emit_syn). A SYN is admitted if a key of dysco_keys verifies its MAC, or
 * if it comes from a trusted prefix (dysco_trusted); a host with no key and
 * no trusted prefix admits none. Nothing of TCP but the tuple enters the MAC,
 * so another protocol's set-up can be admitted by the same code.
 *
 * New sessions set up by admitted SYNs count against a budget of half-open
 * sessions per source (the previous hop's IPv4 address or IPv6 /64), so that
 * one source cannot fill the session map; a session gives its count back
 * when it is established or reset (track_state), reclaimed (reclaim) or
 * freed (dysco_ctl CTL_FREE, CTL_HO_RELEASE).
 *
 * Session nonces are SipHash-2-4 under a secret key (KEY_NONCE, random,
 * set by the loader) of the time, the CPU, a per-CPU counter and
 * bpf_get_prandom_u32: unique inputs through a keyed PRF, so that a nonce
 * cannot be predicted from others without the key.
 *
 * Provides: siphash, syn_admit, syn_sign, make_nonce, ho_source, ho_over,
 * ho_take, ho_release.
 * Expects: messages in scratch space (struct scratch's buf), a multiple of
 * 8 bytes long.
 * Maps: dysco_keys and dysco_trusted (read), dysco_halfopen, dysco_stats. */
#ifndef DYSCO_ADMIT_H
#define DYSCO_ADMIT_H

#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>
#include "maps.h"
#include "config.h"
#include "tuple.h"

/* Words of the longest MAC input: a block with every hop and the tuple. */
#define SIP_MAX_WORDS ((DYSCO_MAX_BLOCK_LEN + DYSCO_MAC_SUB_LEN) / 8)

#define ROTL64(x, b) (((x) << (b)) | ((x) >> (64 - (b))))
#define SIPROUND(v0, v1, v2, v3)                                                                                       \
	do {                                                                                                           \
		v0 += v1;                                                                                              \
		v1 = ROTL64(v1, 13);                                                                                   \
		v1 ^= v0;                                                                                              \
		v0 = ROTL64(v0, 32);                                                                                   \
		v2 += v3;                                                                                              \
		v3 = ROTL64(v3, 16);                                                                                   \
		v3 ^= v2;                                                                                              \
		v0 += v3;                                                                                              \
		v3 = ROTL64(v3, 21);                                                                                   \
		v3 ^= v0;                                                                                              \
		v2 += v1;                                                                                              \
		v1 = ROTL64(v1, 17);                                                                                   \
		v1 ^= v2;                                                                                              \
		v2 = ROTL64(v2, 32);                                                                                   \
	} while (0)

struct sip_state {
	__u64 v0, v1, v2, v3;
	__u8 *msg;
};

/* sip_step compresses word i of the message (a bpf_loop step: the verifier
 * checks it once, whatever the length). */
static long sip_step(__u32 i, void *ctx)
{
	struct sip_state *s = ctx;
	__u64 v0 = s->v0, v1 = s->v1, v2 = s->v2, v3 = s->v3, m;

	if (i >= SIP_MAX_WORDS)
		return 1;
	__builtin_memcpy(&m, s->msg + i * 8, 8);
	v3 ^= m;
	SIPROUND(v0, v1, v2, v3);
	SIPROUND(v0, v1, v2, v3);
	v0 ^= m;
	s->v0 = v0;
	s->v1 = v1;
	s->v2 = v2;
	s->v3 = v3;
	return 0;
}

/* siphash is SipHash-2-4 (wire.SipHash24) of the len bytes at msg, len a
 * multiple of 8 and at most SIP_MAX_WORDS words; msg is in scratch space. */
static __attribute__((noinline)) __u64 siphash(const struct mac_key *k, __u8 *msg, __u32 len)
{
	struct sip_state s;
	__u64 v0, v1, v2, v3, last = (__u64)len << 56;

	s.v0 = k->k0 ^ 0x736f6d6570736575ULL;
	s.v1 = k->k1 ^ 0x646f72616e646f6dULL;
	s.v2 = k->k0 ^ 0x6c7967656e657261ULL;
	s.v3 = k->k1 ^ 0x7465646279746573ULL;
	s.msg = msg;
	bpf_loop(len / 8, sip_step, &s, 0);
	v0 = s.v0;
	v1 = s.v1;
	v2 = s.v2;
	v3 = s.v3;
	v3 ^= last;
	SIPROUND(v0, v1, v2, v3);
	SIPROUND(v0, v1, v2, v3);
	v0 ^= last;
	v2 ^= 0xff;
	SIPROUND(v0, v1, v2, v3);
	SIPROUND(v0, v1, v2, v3);
	SIPROUND(v0, v1, v2, v3);
	SIPROUND(v0, v1, v2, v3);
	return v0 ^ v1 ^ v2 ^ v3;
}

/* mac_input appends the subsession tuple (the first 36 bytes of a tuple or
 * ends: addresses, then ports) to the block of blen bytes at b and zeroes the
 * block's MAC field; it returns the input's length. */
static __always_inline __u32 mac_input(__u8 *b, __u32 blen, const void *sub)
{
	if (blen > DYSCO_MAX_BLOCK_LEN)
		return 0;
	__builtin_memcpy(b + blen, sub, DYSCO_MAC_SUB_LEN);
	__builtin_memset(b + DYSCO_MAC_OFF, 0, DYSCO_MAC_LEN);
	return blen + DYSCO_MAC_SUB_LEN;
}

/* mac_try tells whether the key in slot verifies mac over the len bytes
 * at b: 1 if so, 0 if not, -1 if the slot holds no key. */
static __always_inline int mac_try(__u32 slot, __u8 *b, __u32 len, __u64 mac)
{
	struct mac_key *k = bpf_map_lookup_elem(&dysco_keys, &slot);

	if (!k || !k->set)
		return -1;
	return siphash(k, b, len) == mac;
}

/* syn_admit decides whether the SYN whose block (blen bytes, checked
 * already) is at b, in scratch space with room after it, may set up a
 * session here: 0 if so, else the counter of the drop. The block is left
 * as it came. */
static __attribute__((noinline)) int syn_admit(struct dysco_tuple *sub, __u8 *b, __u32 blen)
{
	__u32 len;
	__u64 mac;
	int cur, prev = -1;
	struct trusted_key tk = {.prefixlen = 128};

	if (blen > DYSCO_MAX_BLOCK_LEN)
		return STAT_DROP_BAD_LENGTH;
	__builtin_memcpy(&mac, b + DYSCO_MAC_OFF, DYSCO_MAC_LEN);
	len = mac_input(b, blen, sub);
	/* The current key first; the previous one only if it fails. */
	cur = mac_try(KEY_SYN_CUR, b, len, mac);
	if (cur != 1)
		prev = mac_try(KEY_SYN_PREV, b, len, mac);
	__builtin_memcpy(b + DYSCO_MAC_OFF, &mac, DYSCO_MAC_LEN);
	if (cur == 1 || prev == 1)
		return 0;
	__builtin_memcpy(tk.addr, sub->saddr, 16);
	if (bpf_map_lookup_elem(&dysco_trusted, &tk))
		return 0;
	return cur >= 0 || prev >= 0 ? STAT_DROP_BAD_MAC : STAT_DROP_UNTRUSTED;
}

/* syn_sign writes the MAC of the block (blen bytes at b, in scratch space)
 * for the subsession it is sent on, under the current key; without one the
 * MAC is 0, which only a receiver that trusts this host admits. */
static __always_inline void syn_sign(__u8 *b, __u32 blen, const struct dysco_ends *sub)
{
	__u32 slot = KEY_SYN_CUR, len = mac_input(b, blen, sub);
	struct mac_key *k = bpf_map_lookup_elem(&dysco_keys, &slot);
	__u64 h;

	if (!k || !k->set || !len)
		return;
	h = siphash(k, b, len);
	__builtin_memcpy(b + DYSCO_MAC_OFF, &h, DYSCO_MAC_LEN);
}

/* make_nonce writes a new session nonce: SipHash of (time, CPU and counter,
 * random) under the nonce key; bpf_get_prandom_u32 alone where no key was
 * set (the loader sets one). Uses sc->buf. */
static __always_inline void make_nonce(struct scratch *sc, __u8 *nonce)
{
	__u32 slot = KEY_NONCE;
	struct mac_key *k = bpf_map_lookup_elem(&dysco_keys, &slot);
	__u64 r = ((__u64)bpf_get_prandom_u32() << 32) | bpf_get_prandom_u32(), w[4];

	if (k && k->set) {
		w[0] = bpf_ktime_get_ns();
		w[1] = ((__u64)bpf_get_smp_processor_id() << 48) ^ ++sc->nonce_ctr;
		w[2] = r;
		w[3] = 0;
		__builtin_memcpy(sc->buf, w, sizeof(w));
		r = siphash(k, sc->buf, sizeof(w));
	}
	__builtin_memcpy(nonce, &r, DYSCO_NONCE_LEN);
}

/* ho_source is the half-open budget's key for a previous hop: the IPv4
 * address (the low 8 bytes of its mapped form) or the IPv6 /64 (the high 8
 * bytes, never 0 for a unicast address). */
static __always_inline __u64 ho_source(const __u8 *a)
{
	__u64 k;

	if (is_mapped4(a))
		__builtin_memcpy(&k, a + 8, 8);
	else
		__builtin_memcpy(&k, a, 8);
	return k;
}

/* ho_over tells whether source src has its budget of half-open sessions. */
static __always_inline int ho_over(__u64 src)
{
	__u32 *c = bpf_map_lookup_elem(&dysco_halfopen, &src);

	return c && *c >= half_open_max;
}

/* ho_take counts a new half-open session of src. */
static __always_inline void ho_take(__u64 src)
{
	__u32 one = 1, *c = bpf_map_lookup_elem(&dysco_halfopen, &src);

	if (c) {
		__sync_fetch_and_add(c, 1);
		return;
	}
	if (bpf_map_update_elem(&dysco_halfopen, &src, &one, BPF_NOEXIST)) {
		c = bpf_map_lookup_elem(&dysco_halfopen, &src);
		if (c)
			__sync_fetch_and_add(c, 1);
	}
}

/* ho_release gives back the half-open count of session s, once (whoever
 * clears ho_src first). */
static __always_inline void ho_release(struct session_val *s)
{
	__u64 src;
	__u32 *c;

	if (!s->ho_src)
		return;
	src = __sync_lock_test_and_set(&s->ho_src, 0);
	if (!src)
		return;
	c = bpf_map_lookup_elem(&dysco_halfopen, &src);
	if (c && *c)
		__sync_fetch_and_add(c, -1);
}

#endif
