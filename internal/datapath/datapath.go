// Package datapath loads, attaches and pins Dysco's eBPF datapath (bpf/dysco.c)
// and gives typed access to its maps.
//
// Maps are pinned by name under Config.PinDir and TCX links under
// PinDir/links, so that an agent restart reloads the programs into the same
// maps and swaps them into the same links: live sessions are not
// disturbed.
package datapath

import (
	"errors"
	"fmt"
	"maps"
	"net"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"sync"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// Config sets what is fixed for one load of the datapath.
type Config struct {
	// PinDir holds the pinned maps and links; it must be on a bpffs.
	PinDir string
	// TapIfindex is the session-view tap's interface, 0 for none.
	TapIfindex uint32
	// PortLo and PortN give the range of subsession ports [PortLo, PortLo+PortN).
	PortLo, PortN uint16
	// NoForwardCheck hands chained SYNs that this host would have to
	// forward to the stack even while IP forwarding is off for their
	// family (a host whose local transparent proxy takes them); by default
	// they are refused at once with a reset (drop_no_forward).
	NoForwardCheck bool
	// HalfOpenPerSource is the budget of half-open sessions one source
	// (an IPv4 address or an IPv6 /64) may set up here (admission.go); 0:
	// DefaultHalfOpenPerSource.
	HalfOpenPerSource int
	// ControlPort is the UDP port of the agents' control channel: its
	// datagrams are never chained, whatever the policies say. 0: none.
	ControlPort uint16
	// MaxSessions sizes the session maps: this many sessions, and four
	// flows each (a middlebox host's count). 0: the object's own size
	// (MAX_SESSIONS in bpf/include/consts.h). Maps already pinned keep their
	// size (Datapath.Sizing tells).
	MaxSessions int
}

// MaxSessionsLimit bounds Config.MaxSessions: session ids are below 2^24
// (they double as the 24-bit local tag, SESS_ID_MASK), and with four flows
// per session the flow map stays at 2^24 entries at most.
const MaxSessionsLimit = 1 << 22

// Sizing says how the session maps were sized at a load.
type Sizing struct {
	Sessions, Flows int // capacity of dysco_sessions and of each flow map (dysco_flows4, dysco_flows6)
	// Kept is set when maps pinned by an earlier load kept a size other
	// than the one asked for (a change takes a reset of the pins).
	Kept      bool
	Requested int // the sessions asked for
}

// Datapath is a loaded datapath.
type Datapath struct {
	// The maps, in groups (groups.go).
	*FlowMap
	*SessionMap
	*TwoPathMap
	*LockMap
	*SpliceMap

	cfg  Config
	objs dyscoObjects
	// Attach is "tcx", or "clsact" where the kernel lacks TCX.
	Attach string
	// Sizing is the capacity of the session maps.
	Sizing Sizing
	// MountedBPFFS tells that Load found no bpffs at /sys/fs/bpf and
	// mounted one for the pins: in a mount namespace of the process's own
	// (ip netns exec) the pins then go when the process exits.
	MountedBPFFS bool
	links        map[string]link.Link

	// cfgMu serialises changes of dysco_config, whose fields have
	// separate writers (setConfig).
	cfgMu sync.Mutex
	// polMu serialises InstallPolicies.
	polMu sync.Mutex
}

// Hooks on an interface.
const (
	hookIngress = "ingress"
	hookEgress  = "egress"
)

// Load loads the programs, reusing pinned maps when they exist.
func Load(cfg Config) (*Datapath, error) {
	if cfg.PinDir == "" {
		return nil, errors.New("datapath: no pin directory")
	}
	if cfg.PortN == 0 {
		cfg.PortLo, cfg.PortN = 20000, 40000
	}
	if int(cfg.PortLo)+int(cfg.PortN) > 65536 {
		return nil, fmt.Errorf("datapath: port range %d+%d passes 65535", cfg.PortLo, cfg.PortN)
	}
	mounted, err := ensureBPFFS(cfg.PinDir)
	if err != nil {
		return nil, err
	}
	spec, err := loadDysco()
	if err != nil {
		return nil, fmt.Errorf("datapath: %w", err)
	}
	if cfg.HalfOpenPerSource == 0 {
		cfg.HalfOpenPerSource = DefaultHalfOpenPerSource
	}
	if err := checkHalfOpen(cfg.HalfOpenPerSource); err != nil {
		return nil, err
	}
	for name, v := range map[string]any{
		"tap_ifindex":   cfg.TapIfindex,
		"port_lo":       cfg.PortLo,
		"port_n":        cfg.PortN,
		"half_open_max": uint32(cfg.HalfOpenPerSource),
		"forward_check": boolU8(!cfg.NoForwardCheck),
		"ctl_port":      cfg.ControlPort,
	} {
		if err := spec.Variables[name].Set(v); err != nil {
			return nil, fmt.Errorf("datapath: set %s: %w", name, err)
		}
	}
	// One hold buffer per possible CPU (the datapath indexes it by CPU).
	ncpu, err := ebpf.PossibleCPU()
	if err != nil {
		return nil, fmt.Errorf("datapath: possible CPUs: %w", err)
	}
	spec.Maps["dysco_hold_buf"].MaxEntries = uint32(ncpu)
	if err := resetForeignPins(cfg.PinDir); err != nil {
		return nil, err
	}
	sizing, err := sizeMaps(spec, cfg.PinDir, cfg.MaxSessions)
	if err != nil {
		return nil, err
	}
	if err := checkPinned(spec, cfg.PinDir); err != nil {
		return nil, err
	}
	d := &Datapath{cfg: cfg, links: map[string]link.Link{}, Sizing: sizing, MountedBPFFS: mounted}
	d.initGroups()
	err = spec.LoadAndAssign(&d.objs, &ebpf.CollectionOptions{Maps: ebpf.MapOptions{PinPath: cfg.PinDir}})
	if err != nil {
		var ve *ebpf.VerifierError
		if errors.As(err, &ve) {
			return nil, fmt.Errorf("datapath: verifier: %+v", ve)
		}
		if errors.Is(err, ebpf.ErrMapIncompatible) {
			return nil, fmt.Errorf("datapath: pinned maps in %s come from an incompatible version (%w); stop the agent and remove them with 'dysco agent --reset'", cfg.PinDir, err)
		}
		return nil, fmt.Errorf("datapath: load: %w", err)
	}
	if cookie, err := NetnsCookie(); err == nil {
		_ = d.objs.DyscoIds.Put(uint32(idsNetns), cookie)
	}
	if err := d.ensureNonceKey(); err != nil {
		d.Close()
		return nil, err
	}
	for slot, prog := range map[uint32]*ebpf.Program{progSetup: d.objs.DyscoSetup,
		progUDPSetup: d.objs.DyscoUdpSetup, progUDPIngress: d.objs.DyscoUdpIngress, progUDP6Sum: d.objs.DyscoUdp6Sum} {
		if err := d.objs.DyscoProgs.Put(slot, prog); err != nil {
			d.Close()
			return nil, fmt.Errorf("datapath: install set-up program: %w", err)
		}
	}
	return d, nil
}

const (
	progPolicy     = 0
	progSetup      = 1
	progUDPSetup   = 2
	progUDPIngress = 3
	progUDP6Sum    = 4

	idsNetns = 1 // dysco_ids slot holding the owner's netns cookie
)

// NetnsCookie returns the cookie of the current network namespace: unlike
// its inode number, a cookie is never reused while the machine runs.
func NetnsCookie() (uint64, error) {
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return 0, err
	}
	defer unix.Close(fd)
	return unix.GetsockoptUint64(fd, unix.SOL_SOCKET, unix.SO_NETNS_COOKIE)
}

// resetForeignPins removes pins that another network namespace left under
// dir (a namespace that has gone, whose directory name was reused): using
// them would mix its stale sessions into this one's.
func resetForeignPins(dir string) error {
	m, err := ebpf.LoadPinnedMap(filepath.Join(dir, "dysco_ids"), nil)
	if err != nil {
		return nil // nothing pinned, or not ours to judge
	}
	var owner uint64
	lerr := m.Lookup(uint32(idsNetns), &owner)
	m.Close()
	mine, err := NetnsCookie()
	if err != nil || lerr != nil || owner == 0 || owner == mine {
		return nil
	}
	return Reset(dir)
}

// sizeMaps sets the capacity of the session maps: maxSessions sessions (0:
// the object's MAX_SESSIONS), as many set-up states, and four flows per
// session.
// Maps already pinned in dir keep their capacity, so that an agent restarted
// with another --max-sessions carries its live sessions over.
func sizeMaps(spec *ebpf.CollectionSpec, dir string, maxSessions int) (Sizing, error) {
	if maxSessions < 0 || maxSessions > MaxSessionsLimit {
		return Sizing{}, fmt.Errorf("datapath: %d sessions: the maps hold from 1 to %d", maxSessions, MaxSessionsLimit)
	}
	want := maxSessions
	if want == 0 {
		want = int(spec.Maps["dysco_sessions"].MaxEntries)
	}
	sizes := map[string]int{"dysco_sessions": want, "dysco_syns": want, "dysco_flows4": 4 * want, "dysco_flows6": 4 * want}
	kept := false
	for name, n := range sizes {
		m, err := ebpf.LoadPinnedMap(filepath.Join(dir, name), nil)
		if errors.Is(err, os.ErrNotExist) {
			continue
		}
		if err != nil {
			return Sizing{}, fmt.Errorf("datapath: pinned map %s: %w", filepath.Join(dir, name), err)
		}
		if got := int(m.MaxEntries()); got != n {
			sizes[name], kept = got, true
		}
		m.Close()
	}
	for name, n := range sizes {
		spec.Maps[name].MaxEntries = uint32(n)
	}
	return Sizing{Sessions: sizes["dysco_sessions"], Flows: sizes["dysco_flows4"], Kept: kept, Requested: want}, nil
}

// checkPinned compares the maps pinned under dir with those of this
// datapath before anything is loaded. Maps pinned by another version whose
// type, key or value size, capacity or flags differ (an upgrade that changed
// flow_val, say) cannot be reused: their entries would be read with the
// wrong layout. Load then fails naming every such map with both sizes, and
// leaves everything as it is: the old programs, still attached through the
// pinned links, go on forwarding the live sessions on the old maps until
// the operator resets the pins ('dysco agent --reset', which ends every
// session on the host) and starts the new agent. A map not pinned yet is
// created by Load. A pinned map that this version no longer has
// (retiredMaps) holds sessions it would not see: it is refused the same way.
func checkPinned(spec *ebpf.CollectionSpec, dir string) error {
	names := make([]string, 0, len(spec.Maps))
	for name, ms := range spec.Maps {
		if ms.Pinning == ebpf.PinByName {
			names = append(names, name)
		}
	}
	sort.Strings(names)
	var diffs []string
	for _, name := range names {
		m, err := ebpf.LoadPinnedMap(filepath.Join(dir, name), nil)
		if errors.Is(err, os.ErrNotExist) {
			continue
		}
		if err != nil {
			return fmt.Errorf("datapath: pinned map %s: %w", filepath.Join(dir, name), err)
		}
		err = spec.Maps[name].Compatible(m)
		m.Close()
		if errors.Is(err, ebpf.ErrMapIncompatible) {
			diffs = append(diffs, fmt.Sprintf("%s (%s)", name, strings.TrimSuffix(err.Error(), ": "+ebpf.ErrMapIncompatible.Error())))
		} else if err != nil {
			return fmt.Errorf("datapath: pinned map %s: %w", name, err)
		}
	}
	for _, name := range slices.Sorted(maps.Keys(retiredMaps)) {
		if _, err := os.Stat(filepath.Join(dir, name)); err == nil {
			diffs = append(diffs, fmt.Sprintf("%s (no longer used: %s)", name, retiredMaps[name]))
		}
	}
	if len(diffs) == 0 {
		return nil
	}
	return fmt.Errorf("datapath: the maps pinned in %s come from another version of the datapath: %s: %w; "+
		"their sessions cannot be carried over (the old programs keep forwarding them meanwhile): "+
		"stop the agent, run 'dysco agent --reset --pin-dir %s' (every session on this host ends) and start it again",
		dir, strings.Join(diffs, ", "), ebpf.ErrMapIncompatible, dir)
}

// retiredMaps names the pinned maps of earlier versions that this one no
// longer has, with what replaced each.
var retiredMaps = map[string]string{
	"dysco_flows": "the flows are in dysco_flows4 and dysco_flows6",
}

func boolU8(b bool) uint8 {
	if b {
		return 1
	}
	return 0
}

// ensureBPFFS makes dir, mounting a bpffs at /sys/fs/bpf first if the
// directory is not already on one (mounted tells that it did).
func ensureBPFFS(dir string) (mounted bool, err error) {
	if OnBPFFS(filepath.Dir(dir)) || OnBPFFS(dir) {
		return false, os.MkdirAll(dir, 0o700)
	}
	if !strings.HasPrefix(dir, "/sys/fs/bpf/") {
		return false, fmt.Errorf("datapath: %s is not on a bpffs; mount one (mount -t bpf bpf DIR) or use a directory under /sys/fs/bpf", dir)
	}
	if !OnBPFFS("/sys/fs/bpf") {
		if err := unix.Mount("bpf", "/sys/fs/bpf", "bpf", 0, ""); err != nil {
			return false, fmt.Errorf("datapath: mount bpffs at /sys/fs/bpf: %w", err)
		}
		mounted = true
	}
	return mounted, os.MkdirAll(dir, 0o700)
}

// OnBPFFS tells whether dir, or the nearest of its parents that exists, is
// on a bpffs.
func OnBPFFS(dir string) bool {
	for d := dir; ; d = filepath.Dir(d) {
		var st unix.Statfs_t
		if err := unix.Statfs(d, &st); err == nil {
			return st.Type == unix.BPF_FS_MAGIC
		}
		if d == "/" || d == "." {
			return false
		}
	}
}

// SetPolicyProgram installs the program that chooses a policy for new
// sessions (slot 0 of dysco_progs); nil removes it, so that no new session
// is chained.
func (d *Datapath) SetPolicyProgram(p *ebpf.Program) error {
	if p == nil {
		err := d.objs.DyscoProgs.Delete(uint32(progPolicy))
		if errors.Is(err, ebpf.ErrKeyNotExist) {
			return nil
		}
		return err
	}
	return d.objs.DyscoProgs.Put(uint32(progPolicy), p)
}

// ProgArray is the program array the policy program must tail-call into.
func (d *Datapath) ProgArray() *ebpf.Map { return d.objs.DyscoProgs }

func (d *Datapath) linkPin(ifname, hook string) string {
	// bpffs refuses names with dots, which interface names may have.
	return filepath.Join(d.cfg.PinDir, "links", strings.ReplaceAll(ifname, ".", "%2e")+"@"+hook)
}

// AttachInterface attaches the ingress and egress programs to an interface,
// or swaps the new programs into links pinned by an earlier agent.
func (d *Datapath) AttachInterface(ifname string) error {
	ifc, err := net.InterfaceByName(ifname)
	if err != nil {
		return fmt.Errorf("datapath: interface %s: %w", ifname, err)
	}
	if err := os.MkdirAll(filepath.Join(d.cfg.PinDir, "links"), 0o700); err != nil {
		return err
	}
	for _, h := range []struct {
		hook string
		prog *ebpf.Program
		at   ebpf.AttachType
	}{
		{hookIngress, d.objs.DyscoIngress, ebpf.AttachTCXIngress},
		{hookEgress, d.objs.DyscoEgress, ebpf.AttachTCXEgress},
	} {
		if err := d.attach(ifc, h.hook, h.prog, h.at); err != nil {
			return err
		}
	}
	return nil
}

// AttachTap attaches the drop program to the tap's ingress.
func (d *Datapath) AttachTap(ifname string) error {
	ifc, err := net.InterfaceByName(ifname)
	if err != nil {
		return fmt.Errorf("datapath: tap %s: %w", ifname, err)
	}
	if err := os.MkdirAll(filepath.Join(d.cfg.PinDir, "links"), 0o700); err != nil {
		return err
	}
	return d.attach(ifc, hookIngress, d.objs.DyscoTapDrop, ebpf.AttachTCXIngress)
}

func (d *Datapath) attach(ifc *net.Interface, hook string, prog *ebpf.Program, at ebpf.AttachType) error {
	pin := d.linkPin(ifc.Name, hook)
	key := ifc.Name + "." + hook
	if l, err := link.LoadPinnedLink(pin, nil); err == nil {
		// A link pinned by an earlier agent: check that it is still on
		// this interface (names can be reused), then swap the program.
		info, ierr := l.Info()
		if ierr == nil && info.TCX() != nil && int(info.TCX().Ifindex) == ifc.Index {
			if err := l.Update(prog); err != nil {
				l.Close()
				return fmt.Errorf("datapath: update %s link on %s: %w", hook, ifc.Name, err)
			}
			d.links[key] = l
			d.Attach = "tcx"
			return nil
		}
		_ = l.Unpin()
		l.Close()
	}
	l, err := link.AttachTCX(link.TCXOptions{Interface: ifc.Index, Program: prog, Attach: at, Anchor: link.Tail()})
	if errors.Is(err, ebpf.ErrNotSupported) {
		d.Attach = "clsact"
		return attachClsact(ifc, hook, prog)
	}
	if err != nil {
		return fmt.Errorf("datapath: attach %s on %s: %w", hook, ifc.Name, err)
	}
	if err := l.Pin(pin); err != nil {
		l.Close()
		return fmt.Errorf("datapath: pin %s link on %s: %w", hook, ifc.Name, err)
	}
	d.links[key] = l
	d.Attach = "tcx"
	return nil
}

// attachClsact is the fallback for kernels without TCX: a clsact qdisc with
// a direct-action filter, which survives the agent by itself.
func attachClsact(ifc *net.Interface, hook string, prog *ebpf.Program) error {
	qd := &netlink.GenericQdisc{QdiscAttrs: netlink.QdiscAttrs{LinkIndex: ifc.Index, Handle: netlink.MakeHandle(0xffff, 0), Parent: netlink.HANDLE_CLSACT}, QdiscType: "clsact"}
	if err := netlink.QdiscReplace(qd); err != nil {
		return fmt.Errorf("datapath: clsact on %s: %w", ifc.Name, err)
	}
	parent := uint32(netlink.HANDLE_MIN_INGRESS)
	if hook == hookEgress {
		parent = netlink.HANDLE_MIN_EGRESS
	}
	f := &netlink.BpfFilter{
		FilterAttrs:  netlink.FilterAttrs{LinkIndex: ifc.Index, Parent: parent, Handle: 1, Protocol: unix.ETH_P_ALL, Priority: 1},
		Fd:           prog.FD(),
		Name:         "dysco_" + hook,
		DirectAction: true,
	}
	if err := netlink.FilterReplace(f); err != nil {
		return fmt.Errorf("datapath: clsact filter %s on %s: %w", hook, ifc.Name, err)
	}
	return nil
}

// DetachInterface removes the programs from an interface and unpins its links.
func (d *Datapath) DetachInterface(ifname string) {
	for _, hook := range []string{hookIngress, hookEgress} {
		key := ifname + "." + hook
		if l, ok := d.links[key]; ok {
			_ = l.Unpin()
			l.Close()
			delete(d.links, key)
			continue
		}
		if l, err := link.LoadPinnedLink(d.linkPin(ifname, hook), nil); err == nil {
			_ = l.Unpin()
			l.Close()
		}
	}
}

// Close releases the agent's handles; pinned maps and links stay, and with
// them the live sessions.
func (d *Datapath) Close() error {
	for _, l := range d.links {
		l.Close()
	}
	return d.objs.Close()
}

// Reset removes everything pinned under dir: every session on this host ends.
// It refuses a directory that is not on a bpffs: whatever else it names (a
// mistyped --pin-dir) holds no pins and is not to be removed.
func Reset(dir string) error {
	if dir == "" || dir == "/" {
		return fmt.Errorf("datapath: refusing to reset %q", dir)
	}
	if !OnBPFFS(dir) {
		return fmt.Errorf("datapath: %s is not on a bpffs, so it holds no pinned datapath: refusing to remove it", dir)
	}
	if links, err := os.ReadDir(filepath.Join(dir, "links")); err == nil {
		for _, e := range links {
			if l, err := link.LoadPinnedLink(filepath.Join(dir, "links", e.Name()), nil); err == nil {
				_ = l.Unpin()
				l.Close()
			}
		}
	}
	return os.RemoveAll(dir)
}
