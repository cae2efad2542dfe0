package datapath

// Admission of Dysco SYNs (bpf/include/admit.h): the keys that sign and
// verify SYN blocks, the key of session nonces, and the half-open budget
// per source.

import (
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"

	"github.com/dysco/dysco/internal/wire"
)

// Slots of dysco_keys (KEY_* in bpf/include/consts.h).
const (
	keySynCur  = 0
	keySynPrev = 1
	keyNonce   = 2
)

// DefaultHalfOpenPerSource is the budget of half-open sessions each source
// (an IPv4 address or an IPv6 /64) may hold at a host: 1/64 of the default
// session map (131,072), so that no fewer than 64 sources can fill it.
const DefaultHalfOpenPerSource = 2048

func macKey(k *wire.MACKey) dyscoMacKey {
	if k == nil {
		return dyscoMacKey{}
	}
	return dyscoMacKey{K0: binary.LittleEndian.Uint64(k[0:]), K1: binary.LittleEndian.Uint64(k[8:]), Set: 1}
}

// SetSynKeys sets the keys of SYN admission: current signs the blocks this
// host sends and verifies those it receives; previous, if not nil, also
// verifies them (the key before a rotation, for as long as SYNs signed
// with it may still arrive). Call it again to rotate: with (new, old)
// first, then (new, nil) once the old key is out of use; previous is
// written before current, so that a key that verified before the call
// verifies throughout it. current nil removes both keys: SYNs are then
// admitted from trusted prefixes only (SetTrusted).
func (d *Datapath) SetSynKeys(current, previous *wire.MACKey) error {
	if current == nil && previous != nil {
		return errors.New("datapath: a previous SYN key needs a current one")
	}
	if err := d.objs.DyscoKeys.Put(uint32(keySynPrev), macKey(previous)); err != nil {
		return fmt.Errorf("datapath: set SYN key: %w", err)
	}
	if err := d.objs.DyscoKeys.Put(uint32(keySynCur), macKey(current)); err != nil {
		return fmt.Errorf("datapath: set SYN key: %w", err)
	}
	return nil
}

// SynKeyed tells which SYN key slots hold a key.
func (d *Datapath) SynKeyed() (current, previous bool, err error) {
	var c, p dyscoMacKey
	if err := d.objs.DyscoKeys.Lookup(uint32(keySynCur), &c); err != nil {
		return false, false, err
	}
	if err := d.objs.DyscoKeys.Lookup(uint32(keySynPrev), &p); err != nil {
		return false, false, err
	}
	return c.Set != 0, p.Set != 0, nil
}

// ensureNonceKey gives the datapath a random key for session nonces, unless
// pinned maps hold one already (the nonces of a restarted agent's host
// stay unpredictable either way; keeping the key avoids a window without
// one).
func (d *Datapath) ensureNonceKey() error {
	var k dyscoMacKey
	if err := d.objs.DyscoKeys.Lookup(uint32(keyNonce), &k); err == nil && k.Set != 0 {
		return nil
	}
	var b wire.MACKey
	if _, err := rand.Read(b[:]); err != nil {
		return fmt.Errorf("datapath: nonce key: %w", err)
	}
	if err := d.objs.DyscoKeys.Put(uint32(keyNonce), macKey(&b)); err != nil {
		return fmt.Errorf("datapath: nonce key: %w", err)
	}
	return nil
}

// HalfOpenSource is the key of a previous hop's half-open budget: its IPv4
// address, or the /64 of its IPv6 address (ho_source in admit.h).
func HalfOpenSource(a netip.Addr) uint64 {
	b := a.As16()
	if a.Unmap().Is4() {
		return binary.LittleEndian.Uint64(b[8:])
	}
	return binary.LittleEndian.Uint64(b[:8])
}

// HalfOpen returns the number of half-open sessions counted against the
// budget of source a.
func (d *Datapath) HalfOpen(a netip.Addr) uint32 {
	var n uint32
	if err := d.objs.DyscoHalfopen.Lookup(HalfOpenSource(a), &n); err != nil {
		return 0
	}
	return n
}

// HalfOpenPerSource is the budget this datapath was loaded with.
func (d *Datapath) HalfOpenPerSource() int { return d.cfg.HalfOpenPerSource }

// ReleaseHalfOpen gives back the half-open counts of sessions about to be
// deleted (the collector's, which deletes them in batches): those still
// counted (Session.HoSrc not 0). Each release is atomic with the
// datapath's own (dysco_ctl).
func (d *SessionMap) ReleaseHalfOpen(ids []uint32) {
	for _, id := range ids {
		_ = d.ctlArgs(dyscoCtlArgs{Op: ctlHoRelease, Tp: TPKey{SessId: id}})
	}
}

func checkHalfOpen(n int) error {
	if n < 1 || n > MaxSessionsLimit {
		return fmt.Errorf("datapath: half-open budget %d per source: from 1 to %d", n, MaxSessionsLimit)
	}
	return nil
}
