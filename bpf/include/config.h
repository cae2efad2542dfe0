/* SPDX-License-Identifier: (GPL-2.0-only OR MIT) */
/* The datapath's configuration: the constants the agent sets before load,
 * and the switch of the session-view tap, which it flips at run time.
 *
 * Provides: tap_ifindex, port_lo, port_n and half_open_max (volatile const
 * globals in .rodata, which the loader sets by name: datapath.go), and
 * tap_on.
 * Expects: a single compilation unit (it defines the globals).
 * Maps: dysco_config (read). */
#ifndef DYSCO_CONFIG_H
#define DYSCO_CONFIG_H

#include <linux/bpf.h>
#include "maps.h"

/* Set by the agent before load. */
volatile const __u32 tap_ifindex = 0;       /* session-view tap, 0: none */
volatile const __u16 port_lo = 20000;       /* subsession port range */
volatile const __u16 port_n = 40000;
volatile const __u32 half_open_max = 2048;  /* half-open sessions per source (admit.h) */
volatile const __u16 ctl_port = 0;          /* the agents' control channel (UDP), never chained; 0: none */

/* tap_on tells whether packets are copied to the session-view tap: one
 * was given at load (tap_ifindex) and a capture is open on it (the
 * agent sets tap_active in dysco_config). */
static __always_inline int tap_on(void)
{
	__u32 k0 = 0;
	struct config *cfg;

	if (!tap_ifindex)
		return 0;
	cfg = bpf_map_lookup_elem(&dysco_config, &k0);
	return cfg && cfg->tap_active;
}

#endif
