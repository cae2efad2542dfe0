/* SPDX-License-Identifier: (GPL-2.0-only OR MIT) */
/* Chained SYNs that this host would have to forward while IP forwarding is
 * off for their family. After the ingress rewrite (§2.1) such a SYN has the
 * session's destination, which is not this host: the kernel would drop it
 * silently, and the client's connect() would hang for its whole SYN retry
 * cycle. It is refused at once instead: counted (drop_no_forward) and
 * answered with a reset on its subsession, back to the previous hop, whose
 * datapath translates it like any packet of the session (forward.h), hop by
 * hop back to the session's source: connect() fails with ECONNREFUSED, and
 * every host on the way records the reset and frees the session early. The
 * agent sees the counter grow and logs which sysctl to set.
 *
 * A reset rather than an ICMP error: a TCP socket drops an ICMP error that
 * arrives while connect() still holds it (LockDroppedIcmps; on one machine,
 * veth pairs carry the answer back within that window), and a reset is
 * queued to the socket's backlog instead.
 *
 * Whether the host forwards is the kernel's own answer for the interface the
 * SYN came in on: bpf_fib_lookup says BPF_FIB_LKUP_RET_FWD_DISABLED when
 * forwarding is off there (net.ipv4.conf.IFACE.forwarding, which
 * net.ipv4.ip_forward sets on every interface; for IPv6
 * net.ipv6.conf.IFACE.forwarding, which net.ipv6.conf.all.forwarding sets),
 * before any route is looked up.
 *
 * Provides: forward_check (a volatile const global the loader sets:
 * datapath.go) and refuse_unforwarded.
 * Expects: p parsed from skb on ingress, the packet not changed yet; dst the
 * session's destination (16 bytes, IPv4-mapped for IPv4), not a local
 * address. refuse_unforwarded returns a TC verdict if it refused the SYN and
 * a negative number otherwise. The lookup's parameters use scratch's known
 * (only dysco_setup, on egress, uses it); a refusal also uses buf, where
 * ingress_syn holds the block, which is not needed after it.
 * Maps: dysco_scratch (known; buf when refusing), dysco_stats. */
#ifndef DYSCO_NOFORWARD_H
#define DYSCO_NOFORWARD_H

#include <linux/bpf.h>
#include <linux/pkt_cls.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>
#include "maps.h"
#include "parsing.h"
#include "rewrite.h"
#include "route.h"

/* Set by the agent before load: 0 hands such SYNs to the stack as any other
 * (a host whose local transparent proxy takes them needs no forwarding). */
volatile const __u8 forward_check = 1;

/* The reset: Ethernet, IPv4 without options or IPv6, and a TCP header
 * without options; the SYN's Ethernet addresses are kept after it in the
 * scratch buffer. */
#define NOFWD_MAX_LEN (ETH_HLEN + 40 + 20)
/* A routing table id that no host uses (RT_TABLE_MAX). */
#define NOFWD_NO_TABLE 0xffffffffU
#define NOFWD_MAC_AT NOFWD_MAX_LEN
_Static_assert(sizeof(struct bpf_fib_lookup) <= sizeof(struct flow_val), "fib lookup parameters do not fit scratch's known");
_Static_assert(NOFWD_MAC_AT + 12 <= sizeof(((struct scratch *)0)->buf), "scratch buffer too short for the reset");

/* nofwd_rst turns the SYN in skb into the reset that refuses it, in place:
 * Ethernet addresses, IP addresses and ports swapped, sequence 0 and
 * acknowledgment ISN + 1 (RFC 793 3.4, a reset for a segment without ACK),
 * no options, no payload. IPv4 options are removed (the TCP header does not
 * move then: a CHECKSUM_PARTIAL skb's checksum start stays right). With
 * CHECKSUM_PARTIAL the check field gets the pseudo header's sum, for the
 * device to complete; otherwise the full checksum. Returns 0 when the
 * packet is ready for the redirect. */
static __always_inline int nofwd_rst(struct __sk_buff *skb, const struct pkt *p, __u8 *b)
{
	__u32 ihl = p->l4 - p->l3, l3n = p->v6 ? 40 : 20, th = ETH_HLEN + l3n, total = th + 20, sum, ack = bpf_htonl(p->seq + 1);
	__u8 *mac = b + NOFWD_MAC_AT, *t;
	__u16 x;

	if (ihl < l3n || ihl > 60 || bpf_skb_load_bytes(skb, 0, mac, 12))
		return -1;
	if (ihl > l3n && bpf_skb_adjust_room(skb, -(__s32)(ihl - l3n), BPF_ADJ_ROOM_NET, 0))
		return -1;
	if (bpf_skb_change_tail(skb, total, 0))
		return -1;
	__builtin_memcpy(b, mac + 6, 6); /* to the sender */
	__builtin_memcpy(b + 6, mac, 6);
	if (!p->v6) {
		__builtin_memset(b + 12, 0, 2 + 20 + 20);
		b[12] = 0x08;
		b[14] = 0x45;
		b[16] = 0;
		b[17] = 40;
		b[20] = 0x40; /* DF, as Linux sends resets */
		b[22] = 64;
		b[23] = IPPROTO_TCP;
		__builtin_memcpy(b + 26, p->t.daddr + 12, 4); /* from the address the SYN came to */
		__builtin_memcpy(b + 30, p->t.saddr + 12, 4);
		x = (__u16)~csum_fold(bpf_csum_diff(0, 0, (__be32 *)(b + 14), 20, 0));
		__builtin_memcpy(b + 24, &x, 2);
		/* The pseudo header (RFC 793 3.1): addresses, protocol, length. */
		sum = bpf_csum_diff(0, 0, (__be32 *)(b + 26), 8, 0);
	} else {
		__builtin_memset(b + 12, 0, 2 + 40 + 20);
		b[12] = 0x86;
		b[13] = 0xdd;
		b[14] = 0x60;
		b[19] = 20;
		b[20] = IPPROTO_TCP;
		b[21] = 64;
		__builtin_memcpy(b + 22, p->t.daddr, 16);
		__builtin_memcpy(b + 38, p->t.saddr, 16);
		/* The pseudo header (RFC 8200 8.1). */
		sum = bpf_csum_diff(0, 0, (__be32 *)(b + 22), 32, 0);
	}
	sum = csum_add(sum, bpf_htonl(IPPROTO_TCP + 20));
	t = b + th;
	__builtin_memcpy(t, &p->t.dport, 2);
	__builtin_memcpy(t + 2, &p->t.sport, 2);
	__builtin_memcpy(t + 8, &ack, 4);
	t[12] = 5 << 4;
	t[13] = TH_RST | TH_ACK;
	if (skb_ip_summed(skb) == CSUM_PARTIAL)
		x = csum_fold(sum);
	else
		x = (__u16)~csum_fold(bpf_csum_diff(0, 0, (__be32 *)t, 20, sum));
	__builtin_memcpy(t + 16, &x, 2);
	if (total > NOFWD_MAX_LEN || bpf_skb_store_bytes(skb, 0, b, total, 0))
		return -1;
	return 0;
}

/* refuse_unforwarded refuses a chained SYN for the non-local destination dst
 * when this host does not forward its family on the interface it came in
 * on: it counts it and sends the reset back out of that interface. */
static __attribute__((noinline)) int refuse_unforwarded(struct __sk_buff *skb, const struct pkt *p, const __u8 *dst)
{
	__u32 k0 = 0;
	struct scratch *sc;
	struct bpf_fib_lookup *f;

	if (!forward_check)
		return -1;
	/* The lookup's parameters in scratch space (the caller's stack is
	 * nearly full): in known, which only dysco_setup (egress) uses; buf
	 * still holds the SYN's block. */
	sc = bpf_map_lookup_elem(&dysco_scratch, &k0);
	if (!sc)
		return -1;
	f = (struct bpf_fib_lookup *)&sc->known;
	__builtin_memset(f, 0, sizeof(*f));
	f->l4_protocol = IPPROTO_TCP;
	f->ifindex = skb->ifindex;
	if (!p->v6) {
		f->family = AF_INET;
		__builtin_memcpy(&f->ipv4_dst, dst + 12, 4);
	} else {
		f->family = AF_INET6;
		__builtin_memcpy(f->ipv6_dst, dst, 16);
	}
	/* Only the forwarding check is wanted, which comes first: a table
	 * that does not exist ends the lookup right after it (NOT_FWDED)
	 * rather than a route lookup per SYN. Where the kernel has no
	 * multiple tables the main table is looked up instead; the answer
	 * that matters is the same. */
	f->tbid = NOFWD_NO_TABLE;
	if (bpf_fib_lookup(skb, f, sizeof(*f), BPF_FIB_LOOKUP_DIRECT | BPF_FIB_LOOKUP_TBID | BPF_FIB_LOOKUP_SKIP_NEIGH) !=
	    BPF_FIB_LKUP_RET_FWD_DISABLED)
		return -1;
	stat_inc(STAT_DROP_NO_FORWARD);
	if (nofwd_rst(skb, p, sc->buf)) {
		stat_inc(STAT_DROP_HELPER);
		return TC_ACT_SHOT;
	}
	return bpf_redirect(skb->ifindex, 0);
}

#endif
