package lab

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// netnsDir is where `ip netns` keeps the named namespaces.
const netnsDir = "/run/netns"

// ipNetns runs `ip netns <args>`. We create and delete namespaces with ip
// itself rather than by hand so that its bookkeeping (the shared bind mount of
// /run/netns that `ip netns exec` relies on) is always right.
func ipNetns(args ...string) error {
	out, err := exec.Command("ip", append([]string{"netns"}, args...)...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("ip netns %s: %v: %s", strings.Join(args, " "), err, bytes.TrimSpace(out))
	}
	return nil
}

func netnsExists(name string) bool {
	_, err := os.Stat(filepath.Join(netnsDir, name))
	return err == nil
}

// listNetns returns the named namespaces whose names start with prefix.
func listNetns(prefix string) ([]string, error) {
	ents, err := os.ReadDir(netnsDir)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	var names []string
	for _, e := range ents {
		if strings.HasPrefix(e.Name(), prefix) {
			names = append(names, e.Name())
		}
	}
	return names, nil
}

// inNetns runs fn on an OS thread that has entered the named namespace.
// Sockets that fn opens stay in that namespace; goroutines that fn starts do
// not run in it.
func inNetns(name string, fn func() error) error {
	target, err := netns.GetFromName(name)
	if err != nil {
		return fmt.Errorf("opening namespace %s: %w", name, err)
	}
	defer target.Close()
	errc := make(chan error, 1)
	// A fresh goroutine, so that the caller's thread is never touched.
	go func() {
		runtime.LockOSThread()
		orig, err := netns.Get()
		if err != nil {
			runtime.UnlockOSThread()
			errc <- fmt.Errorf("opening current namespace: %w", err)
			return
		}
		defer orig.Close()
		if err := netns.Set(target); err != nil {
			runtime.UnlockOSThread()
			errc <- fmt.Errorf("entering namespace %s: %w", name, err)
			return
		}
		ferr := fn()
		if err := netns.Set(orig); err != nil {
			// Leave the thread locked: the runtime ends it with this
			// goroutine, so no other goroutine runs in the wrong namespace.
			errc <- errors.Join(ferr, fmt.Errorf("leaving namespace %s: %w", name, err))
			return
		}
		runtime.UnlockOSThread()
		errc <- ferr
	}()
	return <-errc
}

// writeSysctl sets a sysctl of the current thread's network namespace; key is
// its path under /proc/sys, such as "net/ipv4/ip_forward".
func writeSysctl(key, val string) error {
	if err := os.WriteFile(filepath.Join("/proc/sys", key), []byte(val), 0); err != nil {
		return fmt.Errorf("sysctl %s=%s: %w", strings.ReplaceAll(key, "/", "."), val, err)
	}
	return nil
}

// nsPids returns the processes whose network namespace is the named one, as
// `ip netns pids` does. The calling process is never among them.
func nsPids(name string) ([]int, error) {
	var want syscall.Stat_t
	if err := syscall.Stat(filepath.Join(netnsDir, name), &want); err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return nil, nil
		}
		return nil, fmt.Errorf("namespace %s: %w", name, err)
	}
	ents, err := os.ReadDir("/proc")
	if err != nil {
		return nil, err
	}
	self := os.Getpid()
	var pids []int
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil || pid == self {
			continue
		}
		var st syscall.Stat_t
		if syscall.Stat(filepath.Join("/proc", e.Name(), "ns/net"), &st) != nil {
			continue // gone, or a zombie
		}
		if st.Dev == want.Dev && st.Ino == want.Ino {
			pids = append(pids, pid)
		}
	}
	return pids, nil
}

// pidInNetns reports whether pid is alive and in the named namespace.
func pidInNetns(pid int, name string) bool {
	var want, st syscall.Stat_t
	if syscall.Stat(filepath.Join(netnsDir, name), &want) != nil {
		return false
	}
	if syscall.Stat(filepath.Join("/proc", strconv.Itoa(pid), "ns/net"), &st) != nil {
		return false
	}
	return st.Dev == want.Dev && st.Ino == want.Ino
}

// nsConfig configures namespaces with netlink handles opened in them.
type nsConfig struct {
	handles map[string]*netlink.Handle // by host name
	fds     map[string]netns.NsHandle
}

func (c *nsConfig) close() {
	for _, h := range c.handles {
		h.Close()
	}
	for _, fd := range c.fds {
		fd.Close()
	}
}

func (c *nsConfig) open(h *Host) error {
	fd, err := netns.GetFromName(h.Namespace)
	if err != nil {
		return fmt.Errorf("opening namespace %s: %w", h.Namespace, err)
	}
	nh, err := netlink.NewHandleAt(fd)
	if err != nil {
		fd.Close()
		return fmt.Errorf("netlink in namespace %s: %w", h.Namespace, err)
	}
	c.fds[h.Name] = fd
	c.handles[h.Name] = nh
	return nil
}

// sysctls sets a host's namespace-wide sysctls. It runs before the
// interfaces exist, so that they inherit the "default" values.
func sysctls(h *Host) error {
	return inNetns(h.Namespace, func() error {
		kv := [][2]string{
			// The Dysco datapath rewrites addresses; strict reverse-path
			// filtering would drop rewritten packets.
			{"net/ipv4/conf/all/rp_filter", "0"},
			{"net/ipv4/conf/default/rp_filter", "0"},
			// Addresses are usable at once (no duplicate address
			// detection on links we built ourselves).
			{"net/ipv6/conf/all/accept_dad", "0"},
			{"net/ipv6/conf/default/accept_dad", "0"},
			// When a link gets its carrier, the kernel joins the
			// solicited-node groups of its addresses only after a random
			// delay of up to router_solicitation_delay (1 s), and until then
			// ignores neighbour solicitations for them: the first IPv6
			// packets would wait for a retransmission.
			{"net/ipv6/conf/all/router_solicitation_delay", "0"},
			{"net/ipv6/conf/default/router_solicitation_delay", "0"},
		}
		if h.Forwarding {
			kv = append(kv,
				[2]string{"net/ipv4/ip_forward", "1"},
				[2]string{"net/ipv6/conf/all/forwarding", "1"},
				// A forwarder must not teach hosts to bypass it.
				[2]string{"net/ipv4/conf/all/send_redirects", "0"},
				[2]string{"net/ipv4/conf/default/send_redirects", "0"},
			)
		}
		for _, s := range kv {
			if err := writeSysctl(s[0], s[1]); err != nil {
				return err
			}
		}
		return nil
	})
}

func ipNet(p netip.Prefix) *net.IPNet {
	return &net.IPNet{IP: p.Addr().AsSlice(), Mask: net.CIDRMask(p.Bits(), p.Addr().BitLen())}
}

// configure builds the links, addresses and routes of a planned lab in its
// (already created) namespaces.
func configure(ctx context.Context, ly *layout) error {
	c := &nsConfig{handles: map[string]*netlink.Handle{}, fds: map[string]netns.NsHandle{}}
	defer c.close()
	hosts := ly.all()
	for _, h := range hosts {
		if err := sysctls(h); err != nil {
			return fmt.Errorf("host %s: %w", h.Name, err)
		}
		if err := c.open(h); err != nil {
			return err
		}
		lo, err := c.handles[h.Name].LinkByName("lo")
		if err == nil {
			err = c.handles[h.Name].LinkSetUp(lo)
		}
		if err != nil {
			return fmt.Errorf("host %s: setting lo up: %w", h.Name, err)
		}
	}
	for _, l := range ly.links {
		// Create the pair in A's namespace with the peer straight in B's,
		// so that the names never meet in the root namespace.
		veth := &netlink.Veth{
			LinkAttrs:     netlink.LinkAttrs{Name: l.AIface},
			PeerName:      l.BIface,
			PeerNamespace: netlink.NsFd(c.fds[l.B]),
		}
		if err := c.handles[l.A].LinkAdd(veth); err != nil {
			return fmt.Errorf("creating veth %s:%s <-> %s:%s: %w", l.A, l.AIface, l.B, l.BIface, err)
		}
	}
	for _, h := range hosts {
		nh := c.handles[h.Name]
		for _, ifc := range h.Ifaces {
			if err := configureIface(h, nh, ifc); err != nil {
				return fmt.Errorf("host %s, interface %s: %w", h.Name, ifc.Name, err)
			}
		}
	}
	for _, h := range hosts {
		if h.SessionAddr4.IsValid() {
			if err := addSessionIface(c.handles[h.Name], h); err != nil {
				return fmt.Errorf("host %s: %w", h.Name, err)
			}
		}
	}
	// Routes last: their gateways must be on links that are up.
	for _, h := range hosts {
		nh := c.handles[h.Name]
		for _, r := range h.Routes {
			lk, err := nh.LinkByName(r.Iface)
			if err != nil {
				return fmt.Errorf("host %s: route %s: %w", h.Name, r.Dst, err)
			}
			rt := &netlink.Route{LinkIndex: lk.Attrs().Index, Dst: ipNet(r.Dst), Gw: r.Via.AsSlice(), Priority: r.Metric, Table: r.Table}
			if r.Src.IsValid() {
				rt.Src = r.Src.AsSlice()
			}
			if err := nh.RouteAdd(rt); err != nil {
				return fmt.Errorf("host %s: adding route %s via %s dev %s: %w", h.Name, r.Dst, r.Via, r.Iface, err)
			}
		}
		for _, r := range h.Rules {
			rule := netlink.NewRule()
			rule.Src, rule.Table, rule.Priority = ipNet(r.From), r.Table, 1000
			rule.Family = unix.AF_INET
			if r.From.Addr().Is6() {
				rule.Family = unix.AF_INET6
			}
			if err := nh.RuleAdd(rule); err != nil {
				return fmt.Errorf("host %s: adding rule from %s table %d: %w", h.Name, r.From, r.Table, err)
			}
		}
	}
	return waitSettled(ctx, c, hosts)
}

// waitSettled waits until every interface has its carrier and a link-local
// address, and no address is still tentative. The kernel finishes these
// steps asynchronously after a link comes up; a neighbour solicitation that
// arrives before then is ignored, and the first IPv6 packet would wait a
// second for its retransmission.
func waitSettled(ctx context.Context, c *nsConfig, hosts []*Host) error {
	ctx, cancel := context.WithTimeout(ctx, settleTimeout)
	defer cancel()
	for {
		pending := ""
		for _, h := range hosts {
			for _, ifc := range h.Ifaces {
				if !settled(c.handles[h.Name], ifc.Name) {
					pending = h.Name + ":" + ifc.Name
					break
				}
			}
			if pending != "" {
				break
			}
		}
		if pending == "" {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("interface %s did not come up with usable addresses: %w", pending, ctx.Err())
		case <-time.After(2 * time.Millisecond):
		}
	}
}

// settleTimeout bounds waitSettled.
const settleTimeout = 10 * time.Second

func settled(nh *netlink.Handle, name string) bool {
	lk, err := nh.LinkByName(name)
	if err != nil || lk.Attrs().OperState != netlink.OperUp {
		return false
	}
	addrs, err := nh.AddrList(lk, netlink.FAMILY_V6)
	if err != nil {
		return false
	}
	linkLocal := false
	for _, a := range addrs {
		if a.Flags&unix.IFA_F_TENTATIVE != 0 {
			return false
		}
		if a.IP.IsLinkLocalUnicast() {
			linkLocal = true
		}
	}
	return linkLocal
}

// addSessionIface gives h its session addresses on its loopback
// interface, SessionIface (the kernel of the lab's machine may have no
// dummy interfaces; an address on lo is as much the host's).
func addSessionIface(nh *netlink.Handle, h *Host) error {
	lk, err := nh.LinkByName(SessionIface)
	if err != nil {
		return err
	}
	for _, a := range []netip.Addr{h.SessionAddr4, h.SessionAddr6} {
		if err := nh.AddrAdd(lk, &netlink.Addr{IPNet: ipNet(netip.PrefixFrom(a, a.BitLen())), Flags: unix.IFA_F_NODAD}); err != nil {
			return fmt.Errorf("adding session address %s: %w", a, err)
		}
	}
	return nil
}

func configureIface(h *Host, nh *netlink.Handle, ifc Iface) error {
	lk, err := nh.LinkByName(ifc.Name)
	if err != nil {
		return err
	}
	if err := nh.AddrAdd(lk, &netlink.Addr{IPNet: ipNet(ifc.Addr4)}); err != nil {
		return fmt.Errorf("adding %s: %w", ifc.Addr4, err)
	}
	// nodad: usable at once, without waiting for duplicate detection.
	if err := nh.AddrAdd(lk, &netlink.Addr{IPNet: ipNet(ifc.Addr6), Flags: unix.IFA_F_NODAD}); err != nil {
		return fmt.Errorf("adding %s: %w", ifc.Addr6, err)
	}
	if err := nh.LinkSetUp(lk); err != nil {
		return fmt.Errorf("setting up: %w", err)
	}
	return inNetns(h.Namespace, func() error {
		return writeSysctl("net/ipv4/conf/"+ifc.Name+"/rp_filter", "0")
	})
}
