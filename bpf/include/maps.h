/* SPDX-License-Identifier: (GPL-2.0-only OR MIT) */
/* Maps of the datapath. Session state lives in plain hash maps, never LRU
 * maps: an eviction would silently break a connection.
 * They are not preallocated: memory follows the live sessions, while
 * max_entries still bounds them (a full map refuses new sessions). Every map
 * is pinned by name so that an agent restart keeps live sessions. */
#ifndef DYSCO_MAPS_H
#define DYSCO_MAPS_H

#include <bpf/bpf_helpers.h>
#include "structs.h"

/* Flows by family (flows.h): IPv4 ones with 16-byte keys and 48-byte
 * values, two cache lines per entry with the kernel's header, IPv6 ones
 * with 40-byte keys and 72-byte values. Each holds MAX_FLOWS. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, MAX_FLOWS);
	__type(key, struct dysco_tuple4);
	__type(value, struct flow_val4);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} dysco_flows4 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, MAX_FLOWS);
	__type(key, struct dysco_tuple);
	__type(value, struct flow_val);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} dysco_flows6 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, MAX_SESSIONS);
	__type(key, __u32);
	__type(value, struct session_val);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} dysco_sessions SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, MAX_SESSIONS);
	__type(key, __u32);
	__type(value, struct syn_state);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} dysco_syns SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, MAX_DELTAS);
	__type(key, struct dysco_tuple);
	__type(value, struct delta_val);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} dysco_deltas SEC(".maps");

/* This host's addresses (IPv4-mapped or IPv6), kept by the agent. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, MAX_LOCAL_ADDRS);
	__type(key, __u8[16]);
	__type(value, __u8);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} dysco_local SEC(".maps");

/* The interface of each of this host's addresses that can carry traffic
 * (not lo, not a dummy), kept by the agent: on a host that does not
 * forward, a rewritten packet leaves by the interface of its source
 * (route.h), so that a session moved to another interface's address
 * leaves by that interface. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, MAX_LOCAL_ADDRS);
	__type(key, __u8[16]);
	__type(value, __u32);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} dysco_local_if SEC(".maps");

/* Session addresses (docs/mobility.md): an address the host's
 * applications use that never changes when the host moves, mapped to the
 * host's current address of the family (its locator), kept by the agent.
 * A first subsession from a session address leaves from the locator
 * (syn.h subsession_make); the session tuple keeps the session address. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, MAX_SESSION_ADDRS);
	__type(key, __u8[16]);
	__type(value, __u8[16]);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} dysco_locator SEC(".maps");

/* Each policy slot's local sources (struct policy_src), written with the
 * slot's bank: the first subsession of a session the policy starts leaves
 * from one of them, chosen by the session's hash (syn.h
 * subsession_make). */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, MAX_POLICIES * POLICY_BANKS);
	__type(key, __u32);
	__type(value, struct policy_src);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} dysco_policy_src SEC(".maps");

/* Previous hops allowed to send Dysco SYNs, when the agent enforces it. */
struct trusted_key {
	__u32 prefixlen;
	__u8 addr[16];
};
struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__uint(max_entries, 1024);
	__type(key, struct trusted_key);
	__type(value, __u8);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} dysco_trusted SEC(".maps");

/* Keys of the datapath (admit.h): KEY_SYN_CUR signs the SYN blocks this
 * host sends, KEY_SYN_CUR and KEY_SYN_PREV verify those it receives (a key
 * rotation puts the old key in KEY_SYN_PREV first, then the new one in
 * KEY_SYN_CUR, so that no SYN is refused meanwhile); KEY_NONCE makes the
 * session nonces. Written by the agent only. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, KEY_SLOTS);
	__type(key, __u32);
	__type(value, struct mac_key);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} dysco_keys SEC(".maps");

/* Half-open sessions by source (admit.h): the count of sessions set up by
 * Dysco SYNs from one previous hop (an IPv4 address or an IPv6 /64) that
 * are not yet established. An LRU map: a source forgotten to make room
 * starts again from 0, which errs on the side of admitting. */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, HALF_OPEN_SOURCES);
	__type(key, __u64);
	__type(value, __u32);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} dysco_halfopen SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, MAX_POLICIES * POLICY_BANKS);
	__type(key, __u32);
	__type(value, struct policy_val);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} dysco_policies SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, MAX_TYPES * POLICY_BANKS);
	__type(key, __u32);
	__type(value, struct type_val);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} dysco_types SEC(".maps");

/* Slot 0: generated policy program; slot 1: dysco_setup. Not pinned: the
 * agent fills it at every load (programs are reloaded on restart). */
struct {
	__uint(type, BPF_MAP_TYPE_PROG_ARRAY);
	__uint(max_entries, PROG_SLOTS);
	__type(key, __u32);
	__type(value, __u32);
} dysco_progs SEC(".maps");

/* [0] = next session id candidate; [1] = cookie of the network namespace
 * that owns the pins (the agent resets pins left by a dead namespace). */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 2);
	__type(key, __u32);
	__type(value, __u64);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} dysco_ids SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, STAT_MAX);
	__type(key, __u32);
	__type(value, __u64);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} dysco_stats SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct scratch);
} dysco_scratch SEC(".maps");

/* Where dysco_ctl's CTL_ADD_SUB copies the values it installs: a helper
 * cannot take them from the context (the verifier refuses a context pointer
 * as a map value), and together they exceed the stack. Only CTL_ADD_SUB uses
 * it, and the agent's control loop runs one command at a time. */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct ctl_args);
} dysco_ctl_buf SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct config);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} dysco_config SEC(".maps");

/* Two-path state of the sides being reconfigured (paper §3.5). */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, MAX_TWOPATH);
	__type(key, struct tp_key);
	__type(value, struct tp_val);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} dysco_tp SEC(".maps");

/* The requests behind the records of dysco_tp, for an agent that restarts
 * during a reconfiguration (struct tp_req). */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, MAX_TWOPATH);
	__type(key, struct tp_key);
	__type(value, struct tp_req);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} dysco_tp_req SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct agent_state);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} dysco_agent SEC(".maps");

/* Notices to the agent (two-path progress). */
struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, 1 << 16);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} dysco_events SEC(".maps");

/* Held packets for the agent (hold.h). Pinned: packets held when an agent
 * dies are still there for the next one to re-inject. */
struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, HOLD_RING_BYTES);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} dysco_hold SEC(".maps");

/* One hold_buf per CPU; max_entries is set by the loader to the number of
 * possible CPUs. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, HOLD_CPUS);
	__type(key, __u32);
	__type(value, struct hold_buf);
} dysco_hold_buf SEC(".maps");

static __always_inline void stat_add(__u32 s, __u64 n)
{
	__u64 *v = bpf_map_lookup_elem(&dysco_stats, &s);
	if (v)
		*v += n;
}

static __always_inline void stat_inc(__u32 s)
{
	stat_add(s, 1);
}

#endif
