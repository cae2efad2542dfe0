package datapath

// The datapath's counters.

import (
	"errors"

	"github.com/cilium/ebpf"
)

// Names of the datapath counters, in the order of enum stat in
// bpf/include/consts.h (a test checks the count against the map size).
var StatNames = []string{
	"setup_start", "setup_cont", "setup_end", "syn_retransmit",
	"rewrite_in", "rewrite_out", "tap",
	"drop_malformed", "drop_bad_magic", "drop_bad_version", "drop_bad_length",
	"drop_too_many_hops", "drop_loop", "drop_bad_session", "drop_untrusted",
	"drop_bad_mac", "drop_half_open",
	"drop_sessions_full", "drop_flows_full", "drop_no_port", "drop_no_route",
	"drop_option_space", "drop_syn_data", "drop_no_setup", "drop_bad_policy",
	"drop_no_syn_state", "drop_helper",
	"fin", "rst", "delta", "icmp", "reused",
	"tp_old", "tp_new", "tp_straddle", "tp_clamp", "drop_orphan", "events_lost",
	"hold_pkts", "hold_bytes", "hold_drop",
	"drop_no_forward", "drop_setup_gso", "drop_setup_mtu",
}

// Stats sums the per-CPU counters.
func (d *Datapath) Stats() (map[string]uint64, error) {
	if out, ok := d.statsBatch(); ok {
		return out, nil
	}
	return d.statsEach()
}

// statsBatch reads every counter of every CPU with one batch lookup (`dysco
// status` and each metrics scrape read them all); ok is false if the
// kernel refuses it.
func (d *Datapath) statsBatch() (map[string]uint64, bool) {
	ncpu, err := ebpf.PossibleCPU()
	if err != nil {
		return nil, false
	}
	keys := make([]uint32, len(StatNames))
	per := make([]uint64, len(StatNames)*ncpu)
	var cur ebpf.MapBatchCursor
	n, err := d.objs.DyscoStats.BatchLookup(&cur, keys, per, nil)
	if (err != nil && !errors.Is(err, ebpf.ErrKeyNotExist)) || n != len(StatNames) {
		return nil, false
	}
	out := make(map[string]uint64, len(StatNames))
	for i, k := range keys {
		if int(k) >= len(StatNames) {
			return nil, false
		}
		var sum uint64
		for _, v := range per[i*ncpu : (i+1)*ncpu] {
			sum += v
		}
		out[StatNames[k]] = sum
	}
	return out, len(out) == len(StatNames)
}

// statsEach reads the counters one lookup each.
func (d *Datapath) statsEach() (map[string]uint64, error) {
	out := make(map[string]uint64, len(StatNames))
	for i, name := range StatNames {
		var per []uint64
		if err := d.objs.DyscoStats.Lookup(uint32(i), &per); err != nil {
			return nil, err
		}
		var sum uint64
		for _, v := range per {
			sum += v
		}
		out[name] = sum
	}
	return out, nil
}
