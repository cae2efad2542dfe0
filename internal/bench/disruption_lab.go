package bench

// The disruption benchmark's lab: a star of client, mb1, mb2 and server,
// mb1's link shaped (TBF), SACK set per run, the sessions' sockets.

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/dysco/dysco/internal/api"
	"github.com/dysco/dysco/internal/lab"
	"github.com/dysco/dysco/internal/labkit"
)

// The shaping of the old path (mb1's link) and the sender's congestion
// control. 150 Mbit/s is a few per cent of what the unshaped path carries
// here (about 10 Gbit/s, CPU-bound); 40 ms of FIFO at that rate is 750 kB,
// less than the sender's socket buffer, so cubic can fill it.
const (
	disruptionRateMbit = 150
	disruptionBufferMs = 40
	disruptionBurst    = 32 << 10 // bytes: TBF's bucket, about 1.7 ms at the rate
	disruptionCC       = "cubic"
)

// disruptionShaping is the set-up of the old path's shaping, as installed.
type disruptionShaping struct {
	Qdisc    string `json:"qdisc"`
	RateMbit int    `json:"rate_mbit"`
	// BufferMs is the FIFO's length at the rate, LimitBytes the same in
	// bytes (TBF's limit), BurstBytes TBF's bucket.
	BufferMs   int `json:"buffer_ms"`
	LimitBytes int `json:"limit_bytes"`
	BurstBytes int `json:"burst_bytes"`
	// Ifaces are the shaped interfaces, "HOST:IFACE", each on its egress:
	// the router's towards mb1 (client→mb1 data, server→mb1 acks) and
	// mb1's (mb1→server data, mb1→client acks).
	Ifaces   []string `json:"ifaces"`
	Commands []string `json:"commands"`
	// CC is the sender's congestion control (TCP_CONGESTION on its socket).
	CC string `json:"congestion_control"`
	// Unshaped says what is not shaped.
	Unshaped string `json:"unshaped"`
}

func (sh *disruptionShaping) String() string {
	return fmt.Sprintf("old path (mb1's link) shaped with %s to %d Mbit/s, a %d ms FIFO (%d B), on %s; new path (mb2's link) unshaped; sender's congestion control %s",
		sh.Qdisc, sh.RateMbit, sh.BufferMs, sh.LimitBytes, strings.Join(sh.Ifaces, " and "), sh.CC)
}

// newDisruptionShaping is the shaping of the lab's old path: rate in
// Mbit/s, a FIFO of bufferMs at that rate, on the egress of each of
// ifaces ("HOST:IFACE").
func newDisruptionShaping(rateMbit, bufferMs, burst int, ifaces []string) *disruptionShaping {
	sh := &disruptionShaping{Qdisc: "tbf", RateMbit: rateMbit, BufferMs: bufferMs, BurstBytes: burst,
		LimitBytes: rateMbit * 1_000_000 / 8 * bufferMs / 1000, Ifaces: ifaces, CC: disruptionCC,
		Unshaped: "mb2's link, the client's and the server's"}
	for _, hi := range ifaces {
		host, ifc, _ := strings.Cut(hi, ":")
		sh.Commands = append(sh.Commands, fmt.Sprintf("ip netns exec LAB-%s %s", host, strings.Join(sh.tcArgv(ifc), " ")))
	}
	return sh
}

// tcArgv is the command that installs the shaper on an interface.
func (sh *disruptionShaping) tcArgv(ifc string) []string {
	return []string{"tc", "qdisc", "replace", "dev", ifc, "root", "tbf",
		"rate", fmt.Sprintf("%dmbit", sh.RateMbit), "burst", fmt.Sprint(sh.BurstBytes), "limit", fmt.Sprint(sh.LimitBytes)}
}

// shapeError explains a failure to install the shaper.
func shapeError(hostIface string, err error) error {
	msg := err.Error()
	if strings.Contains(msg, "qdisc kind is unknown") || strings.Contains(msg, "Unknown qdisc") {
		return fmt.Errorf("shaping the old path on %s: this kernel has no TBF qdisc (CONFIG_NET_SCH_TBF); the disruption experiment needs it to make the old path slower than the new one (there is no unshaped fallback): %w", hostIface, err)
	}
	return fmt.Errorf("shaping the old path on %s with TBF: %w", hostIface, err)
}

// shape installs the shaper on the old path's interfaces. Lab.Down
// removes the namespaces, and their qdiscs with them.
func (dl *DisruptionLab) shape(ctx context.Context, sh *disruptionShaping) error {
	for _, hi := range sh.Ifaces {
		host, ifc, _ := strings.Cut(hi, ":")
		if _, err := labkit.Run(ctx, dl.lab, host, 10*time.Second, sh.tcArgv(ifc)...); err != nil {
			return shapeError(hi, err)
		}
		st, err := dl.qdiscStats(ctx, hi)
		if err != nil {
			return err
		}
		if st.Kind != sh.Qdisc {
			return fmt.Errorf("shaping the old path on %s: the root qdisc is %q after installing %s", hi, st.Kind, sh.Qdisc)
		}
	}
	return nil
}

// qdiscStats is what `tc -s -j qdisc show` says of an interface's root
// qdisc.
type qdiscStats struct {
	Kind       string `json:"kind"`
	Root       bool   `json:"root"`
	Bytes      uint64 `json:"bytes"`
	Packets    uint64 `json:"packets"`
	Drops      uint64 `json:"drops"`
	Overlimits uint64 `json:"overlimits"`
	Backlog    uint64 `json:"backlog"`
	Qlen       uint64 `json:"qlen"`
}

// parseQdiscStats picks the root qdisc out of `tc -s -j qdisc show dev X`.
func parseQdiscStats(out string) (qdiscStats, error) {
	var all []qdiscStats
	if err := json.Unmarshal([]byte(out), &all); err != nil {
		return qdiscStats{}, fmt.Errorf("tc -s -j qdisc show: %w: %s", err, labkit.Tail(out, 300))
	}
	for _, q := range all {
		if q.Root {
			return q, nil
		}
	}
	return qdiscStats{}, fmt.Errorf("tc -s -j qdisc show: no root qdisc in %s", labkit.Tail(out, 300))
}

func (dl *DisruptionLab) qdiscStats(ctx context.Context, hostIface string) (qdiscStats, error) {
	host, ifc, _ := strings.Cut(hostIface, ":")
	out, err := labkit.Run(ctx, dl.lab, host, 10*time.Second, "tc", "-s", "-j", "qdisc", "show", "dev", ifc)
	if err != nil {
		return qdiscStats{}, err
	}
	return parseQdiscStats(out)
}

// shaperDelta is what a shaper did over a run.
type shaperDelta struct {
	Bytes      uint64 `json:"bytes"`
	Packets    uint64 `json:"packets"`
	Drops      uint64 `json:"drops"`
	Overlimits uint64 `json:"overlimits"`
}

func (dl *DisruptionLab) shaperStats(ctx context.Context) (map[string]qdiscStats, error) {
	out := map[string]qdiscStats{}
	for _, hi := range dl.Shaping.Ifaces {
		st, err := dl.qdiscStats(ctx, hi)
		if err != nil {
			return nil, err
		}
		out[hi] = st
	}
	return out, nil
}

func shaperDeltas(a, b map[string]qdiscStats) map[string]shaperDelta {
	out := map[string]shaperDelta{}
	for k, y := range b {
		x := a[k]
		out[k] = shaperDelta{Bytes: y.Bytes - x.Bytes, Packets: y.Packets - x.Packets, Drops: y.Drops - x.Drops, Overlimits: y.Overlimits - x.Overlimits}
	}
	return out
}

// DisruptionLab is the star lab of the benchmark.
type DisruptionLab struct {
	lab                   *lab.Lab
	client, mb1, mb2, srv netip.Addr
	Shaping               *disruptionShaping
}

// disruptionPolicy is the client's policy for one run's port.
func disruptionPolicy(port int) string { return fmt.Sprintf("tcp dst port %d", port) }

// UpDisruptionLab builds the star lab and installs the client's policies.
func UpDisruptionLab(ctx context.Context, o *Options, set *labkit.Labs, prefix string, pr *labkit.Progress) (_ *DisruptionLab, err error) {
	pr.Logf("building lab %s (star client, mb1, mb2, server)", prefix+"ds")
	l, err := set.Up(ctx, prefix+"ds", lab.Star("client", "mb1", "mb2", "server"), o.Agents())
	if err != nil {
		return nil, err
	}
	dl := &DisruptionLab{lab: l, client: l.Host("client").Addr4, mb1: l.Host("mb1").Addr4,
		mb2: l.Host("mb2").Addr4, srv: l.Host("server").Addr4}
	for _, sack := range []bool{true, false} {
		port := disruptionPortOf(sack)
		if _, err := labkit.DyscoCLI(ctx, o.Dysco, l, "client", "policy", "add", "d"+sackName(sack), "--chain", dl.mb1.String(), disruptionPolicy(port)); err != nil {
			return nil, err
		}
	}
	// The old path's shaping: both ends of mb1's link to the router.
	var toMB1 string
	for _, ifc := range l.Host("router").Ifaces {
		if ifc.Peer == "mb1" {
			toMB1 = ifc.Name
		}
	}
	if toMB1 == "" {
		return nil, fmt.Errorf("lab %s: the router has no interface towards mb1", l.Name())
	}
	dl.Shaping = newDisruptionShaping(disruptionRateMbit, disruptionBufferMs, disruptionBurst,
		[]string{"router:" + toMB1, "mb1:" + l.Host("mb1").Iface})
	pr.Logf("shaping the old path: %s", dl.Shaping)
	if err := dl.shape(ctx, dl.Shaping); err != nil {
		return nil, fmt.Errorf("lab %s: %w", l.Name(), err)
	}
	for _, to := range []netip.Addr{dl.mb1, dl.mb2, dl.srv} {
		if err := l.Ping(ctx, "client", to); err != nil {
			return nil, fmt.Errorf("lab %s: the client does not reach %s: %w", l.Name(), to, err)
		}
	}
	return dl, nil
}

func disruptionPortOf(sack bool) int {
	if sack {
		return disruptionPort
	}
	return disruptionPort + 1
}

func sackName(sack bool) string {
	if sack {
		return "-sack-on"
	}
	return "-sack-off"
}

// tcpInfo reads TCP_INFO of a connection.
func tcpInfo(c *net.TCPConn) (*unix.TCPInfo, error) {
	rc, err := c.SyscallConn()
	if err != nil {
		return nil, err
	}
	var ti *unix.TCPInfo
	var serr error
	if err := rc.Control(func(fd uintptr) {
		ti, serr = unix.GetsockoptTCPInfo(int(fd), unix.IPPROTO_TCP, unix.TCP_INFO)
	}); err != nil {
		return nil, err
	}
	return ti, serr
}

// dialCC connects from host's namespace to dst with the congestion control
// cc set on the socket before the SYN (TCP_CONGESTION).
func dialCC(ctx context.Context, l *lab.Lab, host, dst, cc string) (net.Conn, error) {
	var c net.Conn
	err := l.Do(host, func() (err error) {
		d := net.Dialer{Control: func(_, _ string, rc syscall.RawConn) error {
			var serr error
			if err := rc.Control(func(fd uintptr) {
				serr = unix.SetsockoptString(int(fd), unix.IPPROTO_TCP, unix.TCP_CONGESTION, cc)
			}); err != nil {
				return err
			}
			if serr != nil {
				return fmt.Errorf("TCP_CONGESTION %s: %w (net.ipv4.tcp_available_congestion_control lists what the kernel has)", cc, serr)
			}
			return nil
		}}
		c, err = d.DialContext(ctx, "tcp", dst)
		return err
	})
	return c, err
}

// congestionControl reads a connection's congestion control.
func congestionControl(c *net.TCPConn) (string, error) {
	rc, err := c.SyscallConn()
	if err != nil {
		return "", err
	}
	var cc string
	var serr error
	if err := rc.Control(func(fd uintptr) {
		cc, serr = unix.GetsockoptString(int(fd), unix.IPPROTO_TCP, unix.TCP_CONGESTION)
	}); err != nil {
		return "", err
	}
	return strings.TrimRight(cc, "\x00"), serr
}

// setSACK sets net.ipv4.tcp_sack in the client's and the server's
// namespaces and returns a function that puts the old values back.
func (dl *DisruptionLab) setSACK(ctx context.Context, on bool) (restore func() error, err error) {
	val := "0"
	if on {
		val = "1"
	}
	old := map[string]string{}
	restore = func() error {
		var errs []error
		for h, v := range old {
			rctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
			_, err := labkit.Run(rctx, dl.lab, h, 10*time.Second, "sysctl", "-w", "net.ipv4.tcp_sack="+v)
			cancel()
			errs = append(errs, err)
		}
		return errors.Join(errs...)
	}
	for _, h := range []string{"client", "server"} {
		out, err := labkit.Run(ctx, dl.lab, h, 10*time.Second, "sysctl", "-n", "net.ipv4.tcp_sack")
		if err != nil {
			return restore, err
		}
		old[h] = strings.TrimSpace(out)
		if _, err := labkit.Run(ctx, dl.lab, h, 10*time.Second, "sysctl", "-w", "net.ipv4.tcp_sack="+val); err != nil {
			return restore, err
		}
	}
	return restore, nil
}

// reconfigArgv is the reconfiguration of a run: mb1 replaced by mb2.
func (dl *DisruptionLab) reconfigArgv(o *Options, port int) []string {
	return []string{o.Dysco, "reconfig", "--json", "--match", fmt.Sprintf("tcp port %d", port), "--to", dl.srv.String(), "--chain", dl.mb2.String()}
}

// sessionsOf lists a host's sessions whose tuple ends in the port.
func (dl *DisruptionLab) sessionsOf(ctx context.Context, o *Options, host string, port int) ([]api.Session, error) {
	out, err := labkit.DyscoCLI(ctx, o.Dysco, dl.lab, host, "sessions", "-o", "json")
	if err != nil {
		return nil, err
	}
	var all []api.Session
	if err := json.Unmarshal([]byte(out), &all); err != nil {
		return nil, fmt.Errorf("dysco sessions on %s: %w: %s", host, err, labkit.Tail(out, 300))
	}
	var mine []api.Session
	for _, s := range all {
		if strings.HasSuffix(s.Session, fmt.Sprintf(":%d", port)) {
			mine = append(mine, s)
		}
	}
	return mine, nil
}
