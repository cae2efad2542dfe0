package datapath

// The flows: one entry per tuple and direction (IPv4 and IPv6 maps), and
// the translation deltas of the flows that have one.

import (
	"errors"
	"fmt"

	"github.com/cilium/ebpf"
	"github.com/dysco/dysco/internal/wire"
)

// PutFlow writes the flow at k into the map of its family. The datapath
// writes flows itself; the agent adds the flows of new subsessions
// (AddFlow), and tests and benchmarks install flows with it.
func (d *FlowMap) PutFlow(k Tuple, f Flow, flags ebpf.MapUpdateFlags) error {
	if k.Is4() {
		f4, err := f.To4()
		if err != nil {
			return err
		}
		k4 := k.To4()
		return d.objs.DyscoFlows4.Update(&k4, &f4, flags)
	}
	return d.objs.DyscoFlows6.Update(&k, &f, flags)
}

func (d *FlowMap) lookupFlow(k Tuple) (Flow, error) {
	return LookupFlowIn(d.objs.DyscoFlows4, d.objs.DyscoFlows6, k)
}

// LookupFlowIn looks the flow at k up in the flow map of its family:
// flows4 and flows6 are a datapath's dysco_flows4 and dysco_flows6 (its
// pinned maps, for a reader outside the agent).
func LookupFlowIn(flows4, flows6 *ebpf.Map, k Tuple) (Flow, error) {
	if k.Is4() {
		var f4 Flow4
		k4 := k.To4()
		if err := flows4.Lookup(&k4, &f4); err != nil {
			return Flow{}, err
		}
		return f4.Flow(), nil
	}
	var f Flow
	err := flows6.Lookup(&k, &f)
	return f, err
}

// EachFlow calls fn for every flow, IPv4 and IPv6, without holding them
// all; k and f are valid during the call only.
func (d *FlowMap) EachFlow(fn func(k *Tuple, f *Flow)) error {
	var k Tuple
	var f Flow
	if err := eachBatch(d.objs.DyscoFlows4, "IPv4 flows", &d.flow4Bufs, func(k4 *Tuple4, f4 *Flow4) {
		k, f = k4.Tuple(), f4.Flow()
		fn(&k, &f)
	}); err != nil {
		return err
	}
	return eachBatch(d.objs.DyscoFlows6, "IPv6 flows", &d.flow6Bufs, fn)
}

// FlowEntry is a flow with its key.
type FlowEntry struct {
	Key Tuple
	Flow
}

// Flows lists the flows.
func (d *FlowMap) Flows() ([]FlowEntry, error) {
	var out []FlowEntry
	err := d.EachFlow(func(k *Tuple, f *Flow) { out = append(out, FlowEntry{Key: *k, Flow: *f}) })
	return out, err
}

// DeleteFlows removes flows and the deltas attached to them, in batches:
// the flows of each family with one call per batch, and of the deltas (a
// small map: only reconfigured flows have one) those it holds for the
// keys, found by one walk of it rather than a deletion per key, which
// would mostly miss. It returns how many flows it deleted.
func (d *FlowMap) DeleteFlows(keys []Tuple) int {
	var k4s []Tuple4
	var k6s []Tuple
	want := make(map[Tuple]bool, len(keys))
	for _, k := range keys {
		want[k] = true
		if k.Is4() {
			k4s = append(k4s, k.To4())
		} else {
			k6s = append(k6s, k)
		}
	}
	n := deleteBatch(d.objs.DyscoFlows4, k4s) + deleteBatch(d.objs.DyscoFlows6, k6s)
	var dks []Tuple
	_ = eachBatch(d.objs.DyscoDeltas, "deltas", &d.deltaBufs, func(k *Tuple, _ *Delta) {
		if want[*k] {
			dks = append(dks, *k)
		}
	})
	deleteBatch(d.objs.DyscoDeltas, dks)
	return n
}

// DeleteFlow removes one flow and any delta attached to it.
func (d *FlowMap) DeleteFlow(k Tuple) {
	if k.Is4() {
		k4 := k.To4()
		_ = d.objs.DyscoFlows4.Delete(&k4)
	} else {
		_ = d.objs.DyscoFlows6.Delete(&k)
	}
	_ = d.objs.DyscoDeltas.Delete(&k)
}

// SessionIDByTuple finds a session set up on this host by its session tuple
// (as it entered the host).
func (d *FlowMap) SessionIDByTuple(t wire.Tuple) (uint32, error) {
	f, err := d.lookupFlow(TupleFrom(t.Reverse()))
	if err != nil {
		return 0, fmt.Errorf("no session %s on this host", t)
	}
	return f.SessId, nil
}

// SetFlowFlags sets and clears flags of a flow, atomically with respect to
// the datapath's own updates of the entry (dysco_ctl runs in the kernel).
// Flags that steer packets are only ever changed here, by the agent. FlMarks
// and FlRev are not the agent's to change: the datapath sets the first when
// it writes the marks, and the second is the flow's direction.
func (d *FlowMap) SetFlowFlags(k Tuple, set, clear uint32) error {
	if (set|clear)&(FlMarks|FlRev) != 0 {
		return fmt.Errorf("datapath: flow %s: FlMarks and FlRev cannot be changed", k)
	}
	if set != 0 {
		if err := d.ctl(ctlFlagsSet, &k, nil, set); err != nil {
			return err
		}
	}
	if clear != 0 {
		return d.ctl(ctlFlagsClear, &k, nil, clear)
	}
	return nil
}

// MergeMarks raises the marks of flow to to those of flow from (both in
// session space): a side's new ingress flow inherits what its old one saw.
func (d *FlowMap) MergeMarks(from, to Tuple) error {
	return d.ctlArgs(dyscoCtlArgs{Op: ctlMarksMerge, Key: from, Key2: to})
}

// Flow returns the flow at key k.
func (d *FlowMap) Flow(k Tuple) (Flow, bool) {
	f, err := d.lookupFlow(k)
	return f, err == nil
}

// AddFlow installs a new flow; an existing flow at k is an error.
func (d *FlowMap) AddFlow(k Tuple, f Flow) error {
	if err := d.PutFlow(k, f, ebpf.UpdateNoExist); err != nil {
		if errors.Is(err, ebpf.ErrKeyExist) {
			return fmt.Errorf("datapath: flow %s exists", k)
		}
		return fmt.Errorf("datapath: add flow %s: %w", k, err)
	}
	return nil
}

// ReplaceFlow overwrites the flow at k, which must exist.
func (d *FlowMap) ReplaceFlow(k Tuple, f Flow) error {
	if err := d.PutFlow(k, f, ebpf.UpdateExist); err != nil {
		return fmt.Errorf("datapath: replace flow %s: %w", k, err)
	}
	return nil
}

// Delta returns the sequence translation of the flow at k, if it has one.
func (d *FlowMap) Delta(k Tuple) (Delta, bool) {
	var v Delta
	err := d.objs.DyscoDeltas.Lookup(&k, &v)
	return v, err == nil
}

// PutDelta sets the sequence translation of the flow at k (applied when
// the flow has FlDelta).
func (d *FlowMap) PutDelta(k Tuple, v Delta) error {
	return d.objs.DyscoDeltas.Update(&k, &v, ebpf.UpdateAny)
}

// DeleteDelta removes the translation of the flow at k.
func (d *FlowMap) DeleteDelta(k Tuple) { _ = d.objs.DyscoDeltas.Delete(&k) }
