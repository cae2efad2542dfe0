package datapath

import (
	"fmt"
	"math"
	"net/netip"
)

// SetPolicies writes the chains of policy slots 0..len-1 and clears the
// rest, of every bank, with no classifier swap: the tests' way to set slots
// directly (the agent uses InstallPolicies). Type indices are written as
// given, unchecked, so that a test can name a type that does not exist.
func (d *Datapath) SetPolicies(chains []PolicyChain) error {
	if len(chains) > int(d.objs.DyscoPolicies.MaxEntries()) {
		return fmt.Errorf("datapath: %d policies, at most %d", len(chains), d.objs.DyscoPolicies.MaxEntries())
	}
	for i := 0; i < int(d.objs.DyscoPolicies.MaxEntries()); i++ {
		var v dyscoPolicyVal
		var src dyscoPolicySrc
		if i < len(chains) {
			var err error
			if v, err = policyVal(i, chains[i], math.MaxInt32, 0); err != nil {
				return err
			}
			if src, err = policySrc(i, chains[i].Via); err != nil {
				return err
			}
		}
		if err := d.objs.DyscoPolicies.Put(uint32(i), v); err != nil {
			return err
		}
		if err := d.objs.DyscoPolicySrc.Put(uint32(i), src); err != nil {
			return err
		}
	}
	return nil
}

// SetTypes writes the middlebox types (index = type id, over every bank)
// with no classifier swap, as SetPolicies. The round-robin cursor of each
// type is kept.
func (d *Datapath) SetTypes(types [][]netip.Addr) error {
	max := int(d.objs.DyscoTypes.MaxEntries())
	if len(types) > max {
		return fmt.Errorf("datapath: %d middlebox types, at most %d", len(types), max)
	}
	for i := 0; i < max; i++ {
		var v dyscoTypeVal
		if i < len(types) {
			var err error
			if v, err = d.typeVal(i, types[i], uint32(i)); err != nil {
				return err
			}
		}
		if err := d.objs.DyscoTypes.Put(uint32(i), v); err != nil {
			return err
		}
	}
	return nil
}
