package agent

// IP forwarding. A host that passes chained sessions on (a middlebox host,
// or the end of a chain before the session's destination) hands the
// rewritten SYN to its stack, which must forward it. Where forwarding is
// off for the SYN's family on the interface it came in on, the datapath
// refuses the SYN at once (bpf/include/noforward.h: counted as
// drop_no_forward, a reset back along the chain). The agent reads the
// sysctls for `dysco status`, warns at start on a host that expects chained
// sessions, and logs refusals with the sysctls to set.

import (
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/dysco/dysco/internal/api"
)

const (
	// procSys is where the kernel's sysctls are read.
	procSys = "/proc/sys"
	// forwardPoll is how often the agent reads the forwarding sysctls and
	// the refusal counter.
	forwardPoll = time.Second
	// refusalLogEvery bounds the log lines about refused SYNs: at most
	// one per interval, with the count since the last one.
	refusalLogEvery = 10 * time.Second
	// statNoForward is the datapath counter of refused SYNs.
	statNoForward = "drop_no_forward"
)

// fwdFamily is one family's forwarding sysctls: the host's, and the
// interfaces' (the kernel checks the interface a packet comes in on; writing
// the host's value sets every interface's). Paths are under /proc/sys; a
// sysctl's name is its path with dots (sysctlName).
type fwdFamily struct {
	host  string // the host's
	iface string // an interface's, with %s for its name
	v4    bool
}

var fwdFamilies = []fwdFamily{
	{host: "net/ipv4/ip_forward", iface: "net/ipv4/conf/%s/forwarding", v4: true},
	{host: "net/ipv6/conf/all/forwarding", iface: "net/ipv6/conf/%s/forwarding"},
}

// sysctlName is the name sysctl(8) gives the sysctl at path (under
// /proc/sys), for interface ifc where path has %s: dots for slashes, and
// the dots of an interface name as slashes.
func sysctlName(path, ifc string) string {
	return strings.Replace(strings.ReplaceAll(path, "/", "."), "%s", strings.ReplaceAll(ifc, ".", "/"), 1)
}

// readForwarding reads the forwarding sysctls under root (procSys) for the
// host and the interfaces ifaces. A family forwards when its host value and
// every interface's are 1. Off names the values at 0: the family's host
// sysctl if that is 0 (which turns the interfaces' off with it), else each
// interface's. A family whose host sysctl is missing (IPv6 disabled) does
// not forward and names nothing.
func readForwarding(root string, ifaces []string) api.Forwarding {
	var out api.Forwarding
	for _, fam := range fwdFamilies {
		on := false
		if v, ok := readSysctl(root, fam.host); ok {
			if v == "0" {
				out.Off = append(out.Off, sysctlName(fam.host, ""))
			} else {
				on = true
				for _, ifc := range ifaces {
					if v, ok := readSysctl(root, strings.Replace(fam.iface, "%s", ifc, 1)); ok && v == "0" {
						on = false
						out.Off = append(out.Off, sysctlName(fam.iface, ifc))
					}
				}
			}
		}
		if fam.v4 {
			out.IPv4 = on
		} else {
			out.IPv6 = on
		}
	}
	return out
}

func readSysctl(root, path string) (string, bool) {
	b, err := os.ReadFile(filepath.Join(root, path))
	if err != nil {
		return "", false
	}
	return strings.TrimSpace(string(b)), true
}

// forwardWatch is the agent's view of forwarding and of the refusals, kept
// by the agent's main loop.
type forwardWatch struct {
	refused   uint64    // drop_no_forward when last logged (or at start)
	loggedAt  time.Time // last log line about refusals
	lastState *api.Forwarding
}

// startForwarding reads forwarding and the refusal counter at start and
// warns when the host expects chained sessions (a tap, or trusted peers)
// but does not forward a family.
func (a *Agent) startForwarding() {
	f := readForwarding(procSys, a.ifaceList())
	a.fwd.Store(&f)
	a.fwdWatch.lastState = &f
	if st, err := a.dp.Stats(); err == nil {
		a.fwdWatch.refused = st[statNoForward] // counters outlive the agent
	}
	if (a.cfg.Tap == "" && len(a.cfg.Trusted) == 0) || len(f.Off) == 0 {
		return
	}
	why := "it has a session-view tap (a middlebox host)"
	if a.cfg.Tap == "" {
		why = "it accepts chained sessions from trusted peers"
	}
	if a.cfg.NoForwardCheck {
		a.log.Warn("IP forwarding is off, but "+why+": chained SYNs it must pass on are dropped by the stack unless a local transparent proxy takes them; set the sysctls to 1 (sysctl -w NAME=1)",
			"sysctls", strings.Join(f.Off, ","), "ipv4", f.IPv4, "ipv6", f.IPv6)
		return
	}
	a.log.Warn("IP forwarding is off, but "+why+": chained SYNs it must pass on are refused (drop_no_forward, a reset back to the client); set the sysctls to 1 (sysctl -w NAME=1)",
		"sysctls", strings.Join(f.Off, ","), "ipv4", f.IPv4, "ipv6", f.IPv6)
}

// pollForwarding reads forwarding again (logging a change) and logs SYNs
// refused since the last look, at most once per refusalLogEvery.
func (a *Agent) pollForwarding(now time.Time) {
	f := readForwarding(procSys, a.ifaceList())
	a.fwd.Store(&f)
	if old := a.fwdWatch.lastState; old != nil && (old.IPv4 != f.IPv4 || old.IPv6 != f.IPv6 || !slices.Equal(old.Off, f.Off)) {
		a.log.Info("IP forwarding changed", "ipv4", f.IPv4, "ipv6", f.IPv6, "off", strings.Join(f.Off, ","))
	}
	a.fwdWatch.lastState = &f
	st, err := a.dp.Stats()
	if err != nil {
		return
	}
	refused, ok := a.fwdWatch.due(now, st[statNoForward])
	if !ok {
		return
	}
	names := f.Off
	if len(names) == 0 {
		// Turned on since: name what was off.
		names = []string{sysctlName(fwdFamilies[0].host, ""), sysctlName(fwdFamilies[1].host, "")}
	}
	a.log.Warn("refused chained SYNs that this host would have to forward: IP forwarding is off; set the sysctls to 1 (sysctl -w NAME=1), or start the agent with --forward-check=false if a local transparent proxy takes them",
		"refused", refused, "sysctls", strings.Join(names, ","))
}

// due tells whether to log refusals now, the refusal counter being n, and
// how many there were since the last log line: at most one line per
// refusalLogEvery, the first at once. A counter lower than before (a
// datapath loaded afresh) starts the count again.
func (w *forwardWatch) due(now time.Time, n uint64) (uint64, bool) {
	if n < w.refused {
		w.refused = 0
	}
	if n == w.refused || now.Sub(w.loggedAt) < refusalLogEvery {
		return 0, false
	}
	d := n - w.refused
	w.refused, w.loggedAt = n, now
	return d, true
}
