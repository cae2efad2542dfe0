package datapath

// The datapath's configuration maps: local addresses, policies, middlebox
// types, trusted prefixes, and the flags the agent sets at run time.

import (
	"fmt"
	"net/netip"
	"time"

	"github.com/cilium/ebpf"

	"github.com/dysco/dysco/internal/wire"
)

// SetLocalAddrs replaces the set of this host's addresses.
func (d *Datapath) SetLocalAddrs(addrs []netip.Addr) error {
	want := map[[16]byte]uint8{}
	for _, a := range addrs {
		want[a.As16()] = 1
	}
	return replaceAddrMap(d.objs.DyscoLocal, want, "local address")
}

// SetLocalIfaces replaces the interfaces of this host's addresses that can
// carry traffic (address → ifindex): on a host that does not forward, a
// rewritten packet leaves by the interface of its source address.
func (d *Datapath) SetLocalIfaces(ifs map[netip.Addr]int) error {
	want := map[[16]byte]uint32{}
	for a, i := range ifs {
		want[a.As16()] = uint32(i)
	}
	return replaceAddrMap(d.objs.DyscoLocalIf, want, "interface of local address")
}

// SetLocators replaces the host's session addresses and their locators
// (session address → the host's current address of its family): a first
// subsession of a session from a session address leaves from its locator
// (docs/mobility.md).
func (d *Datapath) SetLocators(locs map[netip.Addr]netip.Addr) error {
	want := map[[16]byte][16]byte{}
	for s, l := range locs {
		if s.Is4() != l.Is4() {
			return fmt.Errorf("datapath: session address %s and locator %s are of different families", s, l)
		}
		want[s.As16()] = l.As16()
	}
	return replaceAddrMap(d.objs.DyscoLocator, want, "session address")
}

// replaceAddrMap makes m, keyed by address, hold exactly want: stale keys
// are deleted, the others written.
func replaceAddrMap[V uint8 | uint32 | [16]byte](m *ebpf.Map, want map[[16]byte]V, what string) error {
	var k [16]byte
	var v V
	var stale [][16]byte
	it := m.Iterate()
	for it.Next(&k, &v) {
		if _, ok := want[k]; !ok {
			stale = append(stale, k)
		}
	}
	for _, s := range stale {
		_ = m.Delete(s)
	}
	for a, v := range want {
		if err := m.Put(a, v); err != nil {
			return fmt.Errorf("datapath: %s %s: %w", what, netip.AddrFrom16(a).Unmap(), err)
		}
	}
	return nil
}

// PolicyHop is one resolved hop of a policy: an address or a type index.
type PolicyHop struct {
	Addr netip.Addr
	Type int // index into the types given to SetTypes, when Addr is not valid
}

// PolicyChain is what the datapath needs of one policy slot.
type PolicyChain struct {
	Hops  []PolicyHop
	ToDst bool
	// IdleS holds a UDP session's idle timeouts in seconds, one way and
	// both ways (0: the agents' defaults); they travel in the block.
	IdleS [2]uint16
	// Via are local addresses the policy's sessions leave from, spread
	// by the session's hash within each family (an address given k times
	// has weight k; at most MaxPolicySources per family); none: the
	// route's source.
	Via []netip.Addr
}

// MaxPolicySources is the most local sources of one family a policy can
// spread its sessions over: MAX_POLICY_SRC in bpf/include/consts.h, as
// the generated struct has it.
const MaxPolicySources = len(dyscoPolicySrc{}.Addr[0])

// PolicyBanks is the number of banks of policy slots and middlebox types
// (POLICY_BANKS in bpf/include/consts.h): InstallPolicies writes a new set
// into the bank the installed classifier does not refer to.
const PolicyBanks = 2

// PoliciesPerBank and TypesPerBank are the policy slots and middlebox types
// of one bank.
func (d *Datapath) PoliciesPerBank() int { return int(d.objs.DyscoPolicies.MaxEntries()) / PolicyBanks }

// TypesPerBank: see PoliciesPerBank.
func (d *Datapath) TypesPerBank() int { return int(d.objs.DyscoTypes.MaxEntries()) / PolicyBanks }

// PolicyBank returns the bank that the installed classifier refers to, as
// recorded in dysco_config (pinned: it outlives the agent).
func (d *Datapath) PolicyBank() (int, error) {
	var v dyscoConfig
	if err := d.objs.DyscoConfig.Lookup(uint32(0), &v); err != nil {
		return 0, fmt.Errorf("datapath: configuration: %w", err)
	}
	return int(v.PolicyBank % PolicyBanks), nil
}

// InstallPolicies puts a policy set in force all or nothing. It writes the
// middlebox types and the chains (whose PolicyHop.Type index types) into the
// bank that the installed classifier does not refer to, asks load for the
// classifier of that bank (its verdict for chains[i] must be base+i+1, base
// being the bank's first slot), and swaps that classifier in with one update
// of the program array; then it records the bank. Until the swap, new
// sessions are classified by the old classifier into the old bank, which
// nothing here writes: if writing the bank or load fails, the error is
// returned and the set in force is untouched. A nil program from load (no
// policies) removes the classifier. InstallPolicies returns the program
// installed; the caller keeps it open until it installs the next and then
// closes it (the program array holds its own reference).
func (d *Datapath) InstallPolicies(types [][]netip.Addr, chains []PolicyChain, load func(base int) (*ebpf.Program, error)) (*ebpf.Program, error) {
	d.polMu.Lock()
	defer d.polMu.Unlock()
	active, err := d.PolicyBank()
	if err != nil {
		return nil, err
	}
	next := (active + 1) % PolicyBanks
	if err := d.writeBank(next, active, types, chains); err != nil {
		return nil, err
	}
	prog, err := load(next * d.PoliciesPerBank())
	if err != nil {
		return nil, err
	}
	if err := d.SetPolicyProgram(prog); err != nil {
		return nil, err
	}
	if err := d.setConfig(func(v *dyscoConfig) { v.PolicyBank = uint32(next) }); err != nil {
		return prog, fmt.Errorf("datapath: policies in force, but their bank not recorded: %w", err)
	}
	return prog, nil
}

// writeBank writes types and chains into bank, clearing its other slots;
// each type keeps the round-robin cursor it has in the bank from.
func (d *Datapath) writeBank(bank, from int, types [][]netip.Addr, chains []PolicyChain) error {
	np, nt := d.PoliciesPerBank(), d.TypesPerBank()
	if len(chains) > np {
		return fmt.Errorf("datapath: %d policies, at most %d", len(chains), np)
	}
	if len(types) > nt {
		return fmt.Errorf("datapath: %d middlebox types, at most %d", len(types), nt)
	}
	for i := 0; i < nt; i++ {
		var v dyscoTypeVal
		if i < len(types) {
			var err error
			if v, err = d.typeVal(i, types[i], uint32(from*nt+i)); err != nil {
				return err
			}
		}
		if err := d.objs.DyscoTypes.Put(uint32(bank*nt+i), v); err != nil {
			return err
		}
	}
	for i := 0; i < np; i++ {
		var v dyscoPolicyVal
		var src dyscoPolicySrc
		if i < len(chains) {
			var err error
			if v, err = policyVal(i, chains[i], len(types), bank*nt); err != nil {
				return err
			}
			if src, err = policySrc(i, chains[i].Via); err != nil {
				return err
			}
		}
		if err := d.objs.DyscoPolicySrc.Put(uint32(bank*np+i), src); err != nil {
			return err
		}
		if err := d.objs.DyscoPolicies.Put(uint32(bank*np+i), v); err != nil {
			return err
		}
	}
	return nil
}

// policySrc is the dysco_policy_src entry of a policy's local sources.
func policySrc(i int, via []netip.Addr) (dyscoPolicySrc, error) {
	var v dyscoPolicySrc
	for _, a := range via {
		f := 0
		if a.Unmap().Is6() {
			f = 1
		}
		if int(v.N[f]) >= MaxPolicySources {
			return v, fmt.Errorf("datapath: policy slot %d: more than %d sources of a family", i, MaxPolicySources)
		}
		v.Addr[f][v.N[f]] = a.Unmap().As16() // IPv4 addresses IPv4-mapped
		v.N[f]++
	}
	return v, nil
}

// policyVal is the dysco_policies entry of chain c, in slot i, whose type
// indices (below ntypes) are relative to typeBase.
func policyVal(i int, c PolicyChain, ntypes, typeBase int) (dyscoPolicyVal, error) {
	var v dyscoPolicyVal
	if len(c.Hops)+boolInt(c.ToDst) > wire.MaxHops {
		return v, fmt.Errorf("datapath: policy slot %d: %d hops, at most %d", i, len(c.Hops), wire.MaxHops-boolInt(c.ToDst))
	}
	v.N_hops = uint8(len(c.Hops))
	v.ToDst = boolU8(c.ToDst)
	v.IdleS = c.IdleS
	for j, h := range c.Hops {
		if h.Addr.IsValid() {
			v.Kind[j] = hopAddr
			v.Addr[j] = h.Addr.As16()
			continue
		}
		if h.Type < 0 || h.Type >= ntypes {
			return v, fmt.Errorf("datapath: policy slot %d: hop %d names type %d of %d", i, j, h.Type, ntypes)
		}
		v.Kind[j] = hopType
		v.Type[j] = uint32(typeBase + h.Type)
	}
	return v, nil
}

func boolInt(b bool) int {
	if b {
		return 1
	}
	return 0
}

// typeVal is the dysco_types entry of type i with instances addrs; it keeps
// the round-robin cursor of the entry at cursorFrom.
func (d *Datapath) typeVal(i int, addrs []netip.Addr, cursorFrom uint32) (dyscoTypeVal, error) {
	var v dyscoTypeVal
	if len(addrs) > len(v.Addr) {
		return v, fmt.Errorf("datapath: type %d has %d instances, at most %d", i, len(addrs), len(v.Addr))
	}
	var old dyscoTypeVal
	if err := d.objs.DyscoTypes.Lookup(cursorFrom, &old); err == nil {
		v.Rr = old.Rr
	}
	v.N = uint32(len(addrs))
	for j, a := range addrs {
		v.Addr[j] = a.As16()
	}
	return v, nil
}

// SetTrusted replaces the prefixes whose Dysco SYNs are admitted without a
// valid MAC (admission.go).
func (d *Datapath) SetTrusted(prefixes []netip.Prefix) error {
	var k dyscoTrustedKey
	var v uint8
	var stale []dyscoTrustedKey
	it := d.objs.DyscoTrusted.Iterate()
	for it.Next(&k, &v) {
		stale = append(stale, k)
	}
	for _, s := range stale {
		_ = d.objs.DyscoTrusted.Delete(s)
	}
	for _, p := range prefixes {
		bits := p.Bits()
		if p.Addr().Is4() {
			bits += 96
		}
		k := dyscoTrustedKey{Prefixlen: uint32(bits), Addr: p.Addr().As16()}
		if err := d.objs.DyscoTrusted.Put(k, uint8(1)); err != nil {
			return err
		}
	}
	return nil
}

// SetTapActive tells the datapath whether a capture listens on the
// session-view tap; copies are made only then.
func (d *Datapath) SetTapActive(on bool) error {
	return d.setConfig(func(v *dyscoConfig) { v.TapActive = uint32(boolU8(on)) })
}

// SetSplitReader tells the datapath that the agent reads the hold ring and
// so splits packets that straddle a cut-off (HeldPacket.Split), for lease
// from now on (on the datapath's clock, Monotonic); a lease of 0 or less
// says that it does not. Only while a lease runs does the datapath hand
// such packets over; otherwise they go whole on the old path. The agent
// renews its lease well before it runs out, so that an agent that dies
// without clearing it does not leave straddling packets to a ring nobody
// reads for longer than the lease.
func (d *Datapath) SetSplitReader(lease time.Duration) error {
	return d.setConfig(func(v *dyscoConfig) { v.SplitUntil = leaseStamp(Monotonic(), lease) })
}

// SplitReaderLease returns what is left of the split reader's lease
// (SetSplitReader), 0 if there is none or it has run out.
func (d *Datapath) SplitReaderLease() (time.Duration, error) {
	var v dyscoConfig
	if err := d.objs.DyscoConfig.Lookup(uint32(0), &v); err != nil {
		return 0, fmt.Errorf("datapath: configuration: %w", err)
	}
	return leaseLeft(v.SplitUntil, Monotonic()), nil
}

// leaseLeft is the time from now to the lease's end stamp until (modulo
// 2^32 ms, as the datapath compares), 0 for none or one that has run out.
func leaseLeft(until uint32, now time.Duration) time.Duration {
	left := int32(until - uint32(now/time.Millisecond))
	if until == 0 || left <= 0 {
		return 0
	}
	return time.Duration(left) * time.Millisecond
}

// leaseStamp is the stamp (32 bits of milliseconds of Monotonic, as
// stamp() in bpf/include/session.h) at which a lease taken at now runs out, or 0 (no
// lease) for lease <= 0. A lease that would end at stamp 0, which means
// none, ends a millisecond later. Leases are compared modulo 2^32 ms, so
// they must be shorter than about 24 days.
func leaseStamp(now, lease time.Duration) uint32 {
	if lease <= 0 {
		return 0
	}
	until := uint32((now + lease) / time.Millisecond)
	if until == 0 {
		until = 1
	}
	return until
}

// setConfig changes the one entry of dysco_config (pinned: it outlives the
// agent) field by field, under cfgMu.
func (d *Datapath) setConfig(f func(*dyscoConfig)) error {
	d.cfgMu.Lock()
	defer d.cfgMu.Unlock()
	var v dyscoConfig
	if err := d.objs.DyscoConfig.Lookup(uint32(0), &v); err != nil {
		return fmt.Errorf("datapath: configuration: %w", err)
	}
	f(&v)
	return d.objs.DyscoConfig.Put(uint32(0), v)
}
