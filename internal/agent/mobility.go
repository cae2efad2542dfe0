package agent

// Session addresses and break-before-make moves (docs/mobility.md, M2M
// §4.2.3): the host's applications use a session address that never
// changes; the first subsession of their sessions leaves from the host's
// current address of the family (its locator). When that address goes,
// the agent rebinds each such session from the new locator. Sessions that
// came to the session address (a server's) are rebound from the new
// locator when the locator changes: the network's route to the session
// address led to the old one.

import (
	"context"
	"fmt"
	"maps"
	"net"
	"net/netip"
	"slices"
	"sort"
	"time"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/dysco/dysco/internal/datapath"
	"github.com/dysco/dysco/internal/protocol"
)

// Rebinds of one move: each session gets rebindWait (the rebind's own
// retransmissions take up to ~20 s). A session refused for contention (a
// reconfiguration holds it, which may wait for its old path's timeouts,
// or its last rebind is too recent) is tried again, first rebindRetry
// later and then twice as late each time up to rebindMaxRetry, for
// rebindPatience in all.
const (
	rebindWait     = 30 * time.Second
	rebindRetry    = 250 * time.Millisecond
	rebindMaxRetry = 5 * time.Second
	rebindPatience = 2 * time.Minute
)

// checkSessionAddrs refuses session addresses that are not this host's
// global unicast addresses, or two of one family.
func (a *Agent) checkSessionAddrs() error {
	seen := map[bool]netip.Addr{}
	for _, s := range a.cfg.SessionAddrs {
		if !s.IsGlobalUnicast() {
			return fmt.Errorf("--session-addr %s: not a global unicast address", s)
		}
		if o, ok := seen[s.Is6()]; ok {
			return fmt.Errorf("--session-addr %s and %s: at most one session address per family", o, s)
		}
		seen[s.Is6()] = s
		if !a.ownAddr(s) {
			return fmt.Errorf("--session-addr %s: not an address of this host (add it first, for example on a dummy interface: ip link add dysco0 type dummy; ip link set dysco0 up; ip addr add %s dev dysco0)", s, netip.PrefixFrom(s, s.BitLen()))
		}
	}
	if a.cfg.ControlKeyFile == "" && len(a.cfg.SessionAddrs) > 0 {
		a.log.Warn("--session-addr without --control-key-file: sessions cannot be rebound when this host's address changes")
	}
	return nil
}

// isSessionAddr reports whether x is one of the host's session addresses.
func (a *Agent) isSessionAddr(x netip.Addr) bool {
	return slices.Contains(a.cfg.SessionAddrs, x.Unmap())
}

// sessionAddr returns the session address of a family, if any.
func (a *Agent) sessionAddr(v6 bool) netip.Addr {
	for _, s := range a.cfg.SessionAddrs {
		if s.Is6() == v6 {
			return s
		}
	}
	return netip.Addr{}
}

// locator returns the host's current address of a family for the first
// subsessions of sessions from its session address: the source of the
// main table's best default route if it is not a session address, or else
// the first usable global address of that route's interface; with no
// default route, the host's lowest usable global address on an interface
// that carries traffic.
func (a *Agent) locator(v6 bool) netip.Addr {
	fam := netlink.FAMILY_V4
	if v6 {
		fam = netlink.FAMILY_V6
	}
	usable := func(ad netlink.Addr) (netip.Addr, bool) {
		ip, ok := netip.AddrFromSlice(ad.IP)
		ip = ip.Unmap()
		bad := unix.IFA_F_TENTATIVE | unix.IFA_F_DADFAILED | unix.IFA_F_DEPRECATED
		return ip, ok && ip.IsGlobalUnicast() && ip.Is6() == v6 && ad.Flags&bad == 0 && !a.isSessionAddr(ip)
	}
	up := upLinks()
	routes, _ := netlink.RouteListFiltered(fam, &netlink.Route{Table: unix.RT_TABLE_MAIN}, netlink.RT_FILTER_TABLE)
	var defs []netlink.Route
	for _, r := range routes {
		if r.Dst == nil {
			defs = append(defs, r)
		} else if ones, _ := r.Dst.Mask.Size(); ones == 0 {
			defs = append(defs, r)
		}
	}
	sort.SliceStable(defs, func(i, j int) bool { return defs[i].Priority < defs[j].Priority })
	for _, r := range defs {
		if !up[r.LinkIndex] || r.Flags&unix.RTNH_F_LINKDOWN != 0 {
			continue
		}
		if s, ok := netip.AddrFromSlice(r.Src); ok && !a.isSessionAddr(s.Unmap()) && s.Unmap().IsGlobalUnicast() {
			return s.Unmap()
		}
		l, err := netlink.LinkByIndex(r.LinkIndex)
		if err != nil {
			continue
		}
		addrs, _ := netlink.AddrList(l, fam)
		for _, ad := range addrs {
			if ip, ok := usable(ad); ok {
				return ip
			}
		}
	}
	ifs, _ := trafficIfaces()
	var best netip.Addr
	for ip, idx := range ifs {
		if up[idx] && ip.Is6() == v6 && ip.IsGlobalUnicast() && !a.isSessionAddr(ip) && (!best.IsValid() || ip.Less(best)) {
			best = ip
		}
	}
	return best
}

// upLinks lists the interfaces that can carry packets now: up, and not
// known to be without a carrier.
func upLinks() map[int]bool {
	links, _ := netlink.LinkList()
	out := map[int]bool{}
	for _, l := range links {
		at := l.Attrs()
		if at.Flags&net.FlagUp != 0 && at.OperState != netlink.OperDown && at.OperState != netlink.OperLowerLayerDown {
			out[at.Index] = true
		}
	}
	return out
}

// usableAddrs lists this host's addresses on interfaces that can carry
// packets now.
func usableAddrs() []netip.Addr {
	up := upLinks()
	ifs, _ := trafficIfaces()
	var out []netip.Addr
	for ip, idx := range ifs {
		if up[idx] {
			out = append(out, ip)
		}
	}
	return out
}

// syncLocators puts each session address's locator into the datapath.
func (a *Agent) syncLocators() error {
	// Without session addresses the map is emptied: an earlier agent of
	// the pinned datapath may have had some.
	locs := map[netip.Addr]netip.Addr{}
	for _, s := range a.cfg.SessionAddrs {
		if l := a.locator(s.Is6()); l.IsValid() {
			locs[s] = l
		}
	}
	a.mu.Lock()
	changed := !maps.Equal(a.locators, locs)
	a.locators = locs
	for s, l := range locs {
		if last := a.lastLocator[s]; last.IsValid() && last != l {
			a.homeMoved[s] = true
		}
		a.lastLocator[s] = l
	}
	a.mu.Unlock()
	if changed {
		a.log.Info("locators", "map", locs)
	}
	return a.dp.SetLocators(locs)
}

// rebindLost starts (or asks the running pass to repeat) a pass that
// rebinds the sessions whose first subsession's address is gone.
func (a *Agent) rebindLost(ctx context.Context) {
	if a.ctl == nil || len(a.cfg.SessionAddrs) == 0 && !a.viaUsed.Load() {
		return
	}
	a.mu.Lock()
	if a.rebinding {
		a.rebindAgain = true
		a.mu.Unlock()
		return
	}
	a.rebinding = true
	a.mu.Unlock()
	go func() {
		for {
			a.rebindPass(ctx)
			a.mu.Lock()
			if !a.rebindAgain || ctx.Err() != nil {
				a.rebinding = false
				a.mu.Unlock()
				return
			}
			a.rebindAgain = false
			a.mu.Unlock()
		}
	}()
}

// move is where lost sessions go: a side and this host's new address
// on it.
type move struct {
	side protocol.Side
	to   netip.Addr
}

// lostSessions lists, by where they move, the sessions whose end
// subsession at this host uses an address the host no longer has, or has
// on an interface that is down. A session this host starts from a
// session address moves its right side to the locator; one from a link
// address that is still usable (moved off it with reconfig --via) moves
// back to it. A session that came to a session address moves its left
// side to the locator if its end of it is lost, or is the session address
// itself after the locator changed (homeMoved).
func (a *Agent) lostSessions() map[move][]uint32 {
	own := usableAddrs()
	a.mu.Lock()
	locs, home := a.locators, maps.Clone(a.homeMoved)
	a.mu.Unlock()
	out := map[move][]uint32{}
	_ = a.dp.EachSession(func(id uint32, s *datapath.Session) {
		from := s.Tuple.Wire().Src.Unmap()
		if s.State&datapath.StRST != 0 {
			return
		}
		if s.Role == datapath.RoleEnd || s.Role == datapath.RoleEndFwd {
			sa := s.Tuple.Wire().Dst.Unmap()
			if !a.isSessionAddr(sa) {
				return
			}
			end, ok := a.ownEnd(id, s, protocol.SideLeft)
			lost := ok && (end == sa && home[sa] || end != sa && !slices.Contains(own, end))
			if to := locs[sa]; lost && to.IsValid() && to != end {
				k := move{protocol.SideLeft, to}
				out[k] = append(out[k], id)
			}
			return
		}
		if s.Role != datapath.RoleStart {
			return
		}
		src, ok := a.ownEnd(id, s, protocol.SideRight)
		if !ok || slices.Contains(own, src) {
			return
		}
		to := locs[from]
		if !a.isSessionAddr(from) {
			if !slices.Contains(own, from) {
				return // its own address is gone too
			}
			to = from
		}
		if to.IsValid() && to != src {
			k := move{protocol.SideRight, to}
			out[k] = append(out[k], id)
		}
	})
	return out
}

// rebindPass rebinds the lost sessions, trying again those refused for
// contention.
func (a *Agent) rebindPass(ctx context.Context) {
	wait, start := rebindRetry, time.Now()
	for ctx.Err() == nil && time.Since(start) < rebindPatience {
		lost := a.lostSessions()
		if len(lost) == 0 {
			return
		}
		again := false
		for mv, ids := range lost {
			c, cancel := context.WithTimeout(ctx, rebindWait)
			start := time.Now()
			outs := a.ctl.Rebind(c, ids, mv.side, mv.to)
			cancel()
			ok := 0
			peers := map[netip.Addr]bool{}
			for _, o := range outs {
				if o.Outcome == "succeeded" {
					ok++
					peer := o.New.Dst
					if mv.side == protocol.SideLeft {
						peer = o.New.Src
					}
					peers[peer.Unmap()] = true
					continue
				}
				again = true
				a.log.Warn("rebind", "session", o.ID, "side", mv.side.String(), "to", mv.to, "outcome", o.Outcome, "reason", o.Reason)
			}
			a.log.Info("sessions moved to a new address", "to", mv.to, "side", mv.side.String(), "sessions", len(ids), "moved", ok, "took", time.Since(start))
			flushIncomplete(peers)
		}
		if !again {
			return
		}
		select {
		case <-ctx.Done():
		case <-time.After(wait):
		}
		wait = min(2*wait, rebindMaxRetry)
	}
}

// ownEnd returns this host's address on the subsession of a side of a
// session it is an end of: the source of the side's egress flow (the
// session's tuple on the right, its reverse on the left), or that of the
// new path of a reconfiguration it went through.
func (a *Agent) ownEnd(id uint32, s *datapath.Session, side protocol.Side) (netip.Addr, bool) {
	eg := s.Tuple.Wire()
	if side == protocol.SideLeft {
		eg = eg.Reverse()
	}
	f, ok := a.dp.Flow(datapath.TupleOf(eg, s.Proto))
	if !ok || f.SessId != id {
		return netip.Addr{}, false
	}
	src := f.Out.Wire().Src
	if tp, ok := a.dp.TwoPath(datapath.TPKey{SessId: id, Side: uint32(side)}); ok && tp.State == datapath.TPNew {
		src = tp.NewOut.Wire().Src
	}
	return src.Unmap(), true
}

// flushIncomplete deletes the unresolved neighbour entries of peers. A
// packet sent from the lost address before the datapath knew it was gone
// may wait in such an entry's queue, on an interface with no route to the
// peer, until resolution fails (three seconds); TCP does not retransmit a
// segment while a copy of it is still in the host, so the session would
// stall that long. Deleting the entry drops the packet, and TCP sends it
// again on the new subsession.
func flushIncomplete(peers map[netip.Addr]bool) {
	if len(peers) == 0 {
		return
	}
	ns, err := netlink.NeighList(0, netlink.FAMILY_ALL)
	if err != nil {
		return
	}
	for _, n := range ns {
		ip, ok := netip.AddrFromSlice(n.IP)
		if ok && peers[ip.Unmap()] && n.State&(netlink.NUD_INCOMPLETE|netlink.NUD_FAILED) != 0 {
			_ = netlink.NeighDel(&n)
		}
	}
}
