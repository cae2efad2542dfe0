package agent

import (
	"net"
	"net/netip"
	"time"

	"github.com/dysco/dysco/internal/keys"
	"github.com/dysco/dysco/internal/protocol"
	"github.com/vishvananda/netlink"
)

// onKeys takes a ring the control key file gave after a change (a step of
// a rotation, docs/operating.md "Control keys"): control messages are
// signed by its first secret's key from now on, and checked against all;
// Dysco SYNs are signed under its first secret's SYN key, and admitted under
// the first two's (admission.go).
func (a *Agent) onKeys(r *keys.Ring) {
	if a.ctl != nil {
		a.ctl.SetKeys(protocol.KeysFromRing(r))
	}
	if err := a.setSynKeys(r); err != nil {
		a.log.Error("SYN MAC keys not changed", "err", err)
	}
}

// srcEntry is a source address found for a destination, and when.
type srcEntry struct {
	src netip.Addr
	at  time.Time
}

// srcTTL bounds how long a source address found for a peer is used without
// a route change having been seen.
const srcTTL = 5 * time.Second

// sourceAddr returns the address the host sends a datagram to peer from:
// the source its route to peer selects (what 'ip route get' shows). The
// MAC of a control message covers the sender's address as the receiver
// sees it (docs/protocol.md, "Authentication"). Invalid if there is no
// route: the protocol then uses the agent's address of the family.
func (a *Agent) sourceAddr(peer netip.Addr) netip.Addr {
	now := time.Now()
	a.srcMu.Lock()
	if e, ok := a.srcCache[peer]; ok && now.Sub(e.at) < srcTTL {
		a.srcMu.Unlock()
		return e.src
	}
	a.srcMu.Unlock()
	var src netip.Addr
	if rs, err := netlink.RouteGet(net.IP(peer.AsSlice())); err == nil && len(rs) > 0 {
		if s, ok := netip.AddrFromSlice(rs[0].Src); ok {
			src = s.Unmap()
		}
	}
	if a.isSessionAddr(src) {
		// Nothing is sent from a session address: its sessions'
		// subsessions and messages leave from the locator.
		a.mu.Lock()
		src = a.locators[src]
		a.mu.Unlock()
	}
	a.srcMu.Lock()
	if a.srcCache == nil || len(a.srcCache) >= 4096 {
		a.srcCache = map[netip.Addr]srcEntry{}
	}
	a.srcCache[peer] = srcEntry{src, now}
	a.srcMu.Unlock()
	return src
}

// forgetSources drops the source addresses found: routes or addresses
// changed.
func (a *Agent) forgetSources() {
	a.srcMu.Lock()
	a.srcCache = nil
	a.srcMu.Unlock()
}
