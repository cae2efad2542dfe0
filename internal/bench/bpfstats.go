package bench

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"net"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/cilium/ebpf/link"
	"github.com/dysco/dysco/internal/lab"
	"golang.org/x/sys/unix"

	"github.com/dysco/dysco/internal/labkit"
)

const statsSysctl = "/proc/sys/kernel/bpf_stats_enabled"

// enableBPFStats turns on the kernel's run-time statistics of BPF programs
// and returns how to turn them off again. It prefers BPF_ENABLE_STATS,
// whose effect ends with the file descriptor (so also if the runner dies),
// and falls back to the kernel.bpf_stats_enabled sysctl, restored by the
// returned function.
func enableBPFStats() (method string, restore func() error, err error) {
	c, err := ebpf.EnableStats(uint32(unix.BPF_STATS_RUN_TIME))
	if err == nil {
		return "BPF_ENABLE_STATS (BPF_STATS_RUN_TIME; same effect as sysctl kernel.bpf_stats_enabled=1, undone when the runner closes the fd)", c.Close, nil
	}
	old, rerr := os.ReadFile(statsSysctl)
	if rerr != nil {
		return "", nil, errors.Join(err, rerr)
	}
	if werr := os.WriteFile(statsSysctl, []byte("1"), 0); werr != nil {
		return "", nil, errors.Join(err, werr)
	}
	prev := strings.TrimSpace(string(old))
	return "sysctl kernel.bpf_stats_enabled=1 (restored to " + prev + " after)", func() error {
		return os.WriteFile(statsSysctl, []byte(prev), 0)
	}, nil
}

// hook is a program attached to one hook of one interface.
type hook struct {
	Iface   string `json:"iface"`
	Hook    string `json:"hook"` // "ingress" or "egress"
	Program string `json:"program"`
	ID      uint32 `json:"id"`
}

// hostHooks returns the hooks of the links the agent of host pinned, and the
// programs attached through them, by id.
func hostHooks(l *lab.Lab, host string) ([]hook, map[ebpf.ProgramID]*ebpf.Program, error) {
	dir := filepath.Join(lab.PinDir(l.Host(host).Namespace), "links")
	progs := map[ebpf.ProgramID]*ebpf.Program{}
	ents, err := os.ReadDir(dir)
	if err != nil {
		return nil, progs, fmt.Errorf("links of %s: %w", host, err)
	}
	var hooks []hook
	for _, e := range ents {
		ifname, hk, ok := strings.Cut(e.Name(), "@")
		if !ok {
			continue
		}
		ifname = strings.ReplaceAll(ifname, "%2e", ".")
		lk, err := link.LoadPinnedLink(filepath.Join(dir, e.Name()), nil)
		if err != nil {
			return nil, progs, fmt.Errorf("link %s of %s: %w", e.Name(), host, err)
		}
		info, err := lk.Info()
		lk.Close()
		if err != nil {
			return nil, progs, err
		}
		prog := progs[info.Program]
		if prog == nil {
			if prog, err = ebpf.NewProgramFromID(info.Program); err != nil {
				return nil, progs, err
			}
			progs[info.Program] = prog
		}
		pi, err := prog.Info()
		if err != nil {
			return nil, progs, err
		}
		hooks = append(hooks, hook{Iface: ifname, Hook: hk, Program: pi.Name, ID: uint32(info.Program)})
	}
	return hooks, progs, nil
}

// hostPrograms returns the attached programs of a host by name (several
// objects of one name are possible, though the agent loads one per hook).
func hostPrograms(l *lab.Lab, host string) (map[string][]*ebpf.Program, error) {
	hooks, progs, err := hostHooks(l, host)
	out := map[string][]*ebpf.Program{}
	for _, h := range hooks {
		if p := progs[ebpf.ProgramID(h.ID)]; p != nil {
			out[h.Program] = append(out[h.Program], p)
			delete(progs, ebpf.ProgramID(h.ID))
		}
	}
	for _, p := range progs {
		p.Close()
	}
	return out, err
}

// hostSnap is the statistics of a host's programs and the packet counters
// of its interfaces at one moment.
type hostSnap struct {
	runtime map[string]time.Duration // by program name
	runs    map[string]uint64
	packets map[string]uint64 // by "iface@hook": rx for ingress, tx for egress
}

func takeSnap(ctx context.Context, l *lab.Lab, host string, hooks []hook, progs map[ebpf.ProgramID]*ebpf.Program) (*hostSnap, error) {
	s := &hostSnap{runtime: map[string]time.Duration{}, runs: map[string]uint64{}, packets: map[string]uint64{}}
	for id, p := range progs {
		st, err := p.Stats()
		if err != nil {
			return nil, fmt.Errorf("stats of program %d on %s: %w", id, host, err)
		}
		for _, h := range hooks {
			if ebpf.ProgramID(h.ID) == id {
				s.runtime[h.Program] += st.Runtime
				s.runs[h.Program] += st.RunCount
				break
			}
		}
	}
	var files, keys []string
	for _, h := range hooks {
		dir := "rx_packets"
		if h.Hook == "egress" {
			dir = "tx_packets"
		}
		files = append(files, "/sys/class/net/"+h.Iface+"/statistics/"+dir)
		keys = append(keys, h.Iface+"@"+h.Hook)
	}
	out, err := labkit.Run(ctx, l, host, 10*time.Second, append([]string{"cat"}, files...)...)
	if err != nil {
		return nil, err
	}
	vals := strings.Fields(out)
	if len(vals) != len(keys) {
		return nil, fmt.Errorf("interface counters of %s: got %d values for %d files", host, len(vals), len(keys))
	}
	for i, k := range keys {
		n, err := strconv.ParseUint(vals[i], 10, 64)
		if err != nil {
			return nil, err
		}
		s.packets[k] = n
	}
	return s, nil
}

// Names of the empty programs that measure what the run-time statistics
// cost by themselves (attachEmpty).
const (
	emptyIngress = "empty_ingress"
	emptyEgress  = "empty_egress"
)

// emptyHooks is an empty TC program (it returns TCX_NEXT and does nothing
// else) attached to the hooks of one host, and the hooks, for takeSnap.
type emptyHooks struct {
	hooks []hook
	progs map[ebpf.ProgramID]*ebpf.Program
	links []link.Link
}

func (e *emptyHooks) Close() {
	for _, l := range e.links {
		l.Close()
	}
	for _, p := range e.progs {
		p.Close()
	}
}

// attachEmpty attaches an empty program (TCX, first in line) to the hooks
// of host that like carries Dysco's programs in the Dysco lab: one program
// for the ingress hooks and one for the egress hooks, as the agent has.
// What the kernel's statistics give per run for it is their own cost (two
// clock reads around the run, which are slow on a VM, and the program's
// call), measured on the same hooks and the same workload: the floor that
// every program's figure includes. Nothing is pinned, so the programs go
// with the runner even if it dies.
func attachEmpty(l *lab.Lab, host string, like []hook) (_ *emptyHooks, err error) {
	e := &emptyHooks{progs: map[ebpf.ProgramID]*ebpf.Program{}}
	defer func() {
		if err != nil {
			e.Close()
		}
	}()
	byHook := map[string]*ebpf.Program{}
	ids, names := map[string]ebpf.ProgramID{}, map[string]string{}
	for _, hk := range []struct{ hook, name string }{{"ingress", emptyIngress}, {"egress", emptyEgress}} {
		prog, err := ebpf.NewProgram(&ebpf.ProgramSpec{
			Name: hk.name, Type: ebpf.SchedCLS, License: "GPL",
			Instructions: asm.Instructions{asm.Mov.Imm(asm.R0, -1 /* TCX_NEXT */), asm.Return()},
		})
		if err != nil {
			return nil, fmt.Errorf("loading an empty program: %w", err)
		}
		info, err := prog.Info()
		if err != nil {
			prog.Close()
			return nil, err
		}
		id, _ := info.ID()
		e.progs[id] = prog
		byHook[hk.hook], ids[hk.hook], names[hk.hook] = prog, id, hk.name
	}
	err = l.Do(host, func() error {
		for _, h := range like {
			if h.Program != "dysco_ingress" && h.Program != "dysco_egress" {
				continue
			}
			ifc, err := net.InterfaceByName(h.Iface)
			if err != nil {
				return fmt.Errorf("interface %s of %s: %w", h.Iface, host, err)
			}
			at := ebpf.AttachTCXIngress
			if h.Hook == "egress" {
				at = ebpf.AttachTCXEgress
			}
			lk, err := link.AttachTCX(link.TCXOptions{Interface: ifc.Index, Program: byHook[h.Hook], Attach: at, Anchor: link.Head()})
			if err != nil {
				return fmt.Errorf("attaching an empty program to %s %s of %s: %w", h.Iface, h.Hook, host, err)
			}
			e.links = append(e.links, lk)
			e.hooks = append(e.hooks, hook{Iface: h.Iface, Hook: h.Hook, Program: names[h.Hook], ID: uint32(ids[h.Hook])})
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	if len(e.hooks) == 0 {
		return nil, fmt.Errorf("%s has no hook with a Dysco program to compare with", host)
	}
	return e, nil
}

// progCost is the cost of a program during one workload.
type progCost struct {
	Host     string `json:"host"`
	Program  string `json:"program"`
	Workload string `json:"workload"`
	// RunTimeNs and Runs are the deltas of the kernel's run_time_ns and
	// run_cnt; Packets the packets counted by the interfaces the program
	// is attached to (rx for ingress, tx for egress).
	RunTimeNs   int64   `json:"run_time_ns"`
	Runs        uint64  `json:"runs"`
	Packets     uint64  `json:"packets"`
	NsPerRun    float64 `json:"ns_per_run"`
	NsPerPacket float64 `json:"ns_per_packet"`
}

func costs(host, workload string, hooks []hook, a, b *hostSnap) []progCost {
	var out []progCost
	names := make([]string, 0, len(a.runtime))
	for n := range a.runtime {
		names = append(names, n)
	}
	sort.Strings(names)
	for _, n := range names {
		c := progCost{Host: host, Program: n, Workload: workload,
			RunTimeNs: int64(a.runtime[n] - b.runtime[n]), Runs: a.runs[n] - b.runs[n],
			NsPerRun: math.NaN(), NsPerPacket: math.NaN()}
		for _, h := range hooks {
			if h.Program == n {
				k := h.Iface + "@" + h.Hook
				c.Packets += a.packets[k] - b.packets[k]
			}
		}
		if c.Runs > 0 {
			c.NsPerRun = float64(c.RunTimeNs) / float64(c.Runs)
		}
		if c.Packets > 0 {
			c.NsPerPacket = float64(c.RunTimeNs) / float64(c.Packets)
		}
		out = append(out, c)
	}
	return out
}

// MarshalJSON writes NaN as null.
func (c progCost) MarshalJSON() ([]byte, error) {
	type plain progCost
	type withNulls struct {
		plain
		NsPerRun    *float64 `json:"ns_per_run"`
		NsPerPacket *float64 `json:"ns_per_packet"`
	}
	p := func(v float64) *float64 {
		if math.IsNaN(v) {
			return nil
		}
		return &v
	}
	return json.Marshal(withNulls{plain(c), p(c.NsPerRun), p(c.NsPerPacket)})
}

// benchBPFStats measures the cost per packet of the TC programs on mb1 (and,
// for reference, on the client) of the Dysco lab, during an iperf3 bulk
// transfer and during wrk: the kernel's run_time_ns over the packets that
// the interfaces carrying the hook counted. Per packet rather than per run:
// a program may run more than once per packet (bpf_redirect_neigh from the
// egress hook passes the packet through the egress hook again). Each
// workload then runs through the baseline lab with an empty program on its
// mb1's hooks (attachEmpty): what the statistics cost by themselves, which
// the figures judged against the target leave out.
func benchBPFStats(ctx context.Context, o *Options, p *labkit.Pair, r *Report, pr *labkit.Progress) (err error) {
	l := p.Dysco.Lab
	hosts := []string{"mb1", "client"}
	hooks := map[string][]hook{}
	progs := map[string]map[ebpf.ProgramID]*ebpf.Program{}
	defer func() {
		for _, ps := range progs {
			for _, p := range ps {
				p.Close()
			}
		}
	}()
	for _, h := range hosts {
		hk, ps, err := hostHooks(l, h)
		hooks[h], progs[h] = hk, ps
		if err != nil {
			return err
		}
	}
	for _, want := range []string{"dysco_ingress", "dysco_egress"} {
		found := false
		for _, h := range hooks["mb1"] {
			found = found || h.Program == want
		}
		if !found {
			return fmt.Errorf("mb1 of lab %s has no program %s attached", l.Name(), want)
		}
	}
	// The floor: an empty program on the same hooks of the baseline lab's
	// mb1, under the same workload.
	var empty *emptyHooks
	floorErr := ""
	if p.Base == nil {
		floorErr = "no baseline lab"
	} else if empty, err = attachEmpty(p.Base.Lab, "mb1", hooks["mb1"]); err != nil {
		floorErr = err.Error()
	} else {
		defer empty.Close()
	}
	method, restore, err := enableBPFStats()
	if err != nil {
		return fmt.Errorf("enabling BPF statistics: %w", err)
	}
	defer func() {
		if rerr := restore(); rerr != nil {
			err = errors.Join(err, fmt.Errorf("restoring BPF statistics: %w", rerr))
		}
	}()
	var all, floors []progCost
	mb1Counters := map[string]map[string]uint64{}
	r.Details["bpfstats"] = map[string]any{"method": method, "hooks": hooks, "costs": &all, "mb1_counters": mb1Counters,
		"floor": "an empty program (returns TCX_NEXT) on the same hooks of the baseline lab's mb1, same workload", "floor_costs": &floors, "floor_error": floorErr}
	workloads := []struct {
		name    string
		argv    []string
		timeout time.Duration
	}{
		{"iperf3", iperfArgv(p.Dysco.Server.String(), o, 1), o.IperfTime + 60*time.Second},
		{"wrk", wrkArgv(p.Dysco.Server.String(), o), o.WrkTime + 60*time.Second},
	}
	baseArgv := map[string][]string{}
	if p.Base != nil {
		baseArgv["iperf3"] = iperfArgv(p.Base.Server.String(), o, 1)
		baseArgv["wrk"] = wrkArgv(p.Base.Server.String(), o)
	}
	for _, w := range workloads {
		pr.Logf("datapath cost: %s through the Dysco lab with BPF statistics on", w.name)
		stBefore, err := labkit.AgentStatus(ctx, o.Dysco, l, "mb1")
		if err != nil {
			return err
		}
		before := map[string]*hostSnap{}
		for _, h := range hosts {
			if before[h], err = takeSnap(ctx, l, h, hooks[h], progs[h]); err != nil {
				return err
			}
		}
		if _, err := labkit.Run(ctx, l, "client", w.timeout, w.argv...); err != nil {
			return err
		}
		var cs []progCost
		for _, h := range hosts {
			after, err := takeSnap(ctx, l, h, hooks[h], progs[h])
			if err != nil {
				return err
			}
			cs = append(cs, costs(h, w.name, hooks[h], after, before[h])...)
		}
		stAfter, err := labkit.AgentStatus(ctx, o.Dysco, l, "mb1")
		if err != nil {
			return err
		}
		counters := labkit.CounterDelta(stBefore, stAfter)
		mb1Counters[w.name] = counters
		all = append(all, cs...)
		find := func(host, prog string) (progCost, bool) {
			for _, c := range cs {
				if c.Host == host && c.Program == prog {
					return c, true
				}
			}
			return progCost{}, false
		}
		// The same workload through the baseline lab, with the empty
		// programs on its mb1.
		floor := map[string]float64{"dysco_ingress": math.NaN(), "dysco_egress": math.NaN()}
		wFloorErr := floorErr
		if empty != nil {
			pr.Logf("datapath cost: %s through the baseline lab with an empty program on mb1's hooks", w.name)
			fc, err := emptyCost(ctx, p.Base.Lab, empty, w.name, baseArgv[w.name], w.timeout)
			if err != nil {
				return err
			}
			floors = append(floors, fc...)
			for _, c := range fc {
				if c.Packets == 0 {
					continue
				}
				switch c.Program {
				case emptyIngress:
					floor["dysco_ingress"] = c.NsPerPacket
				case emptyEgress:
					floor["dysco_egress"] = c.NsPerPacket
				}
			}
		}
		cmd := "ip netns exec LAB-client " + strings.Join(w.argv, " ")
		for _, prog := range []string{"dysco_ingress", "dysco_egress"} {
			c, _ := find("mb1", prog)
			if c.Runs == 0 || c.Packets == 0 {
				return fmt.Errorf("%s on mb1 saw no packet during %s (%d runs, %d packets): the traffic did not take the chain, or statistics are off", prog, w.name, c.Runs, c.Packets)
			}
			rewrites := counters["rewrite_in"]
			if prog == "dysco_egress" {
				rewrites = counters["rewrite_out"]
			}
			client := ""
			if cc, ok := find("client", prog); ok && cc.Packets > 0 {
				client = fmt.Sprintf("; on the client (end host) %.0f ns per packet", cc.NsPerPacket)
			}
			// What the target judges: the program's own cost, the
			// figure less the statistics' floor on the same hook; the
			// gross figure where the floor could not be measured.
			fl := floor[prog]
			measured, floorNote := c.NsPerPacket-fl, fmt.Sprintf("; measured = Dysco − baseline, the baseline being what the statistics give for an empty program on the same hooks of the baseline lab's mb1 under the same workload (%.0f ns: their own cost, two clock reads per run)", fl)
			if math.IsNaN(fl) {
				if wFloorErr == "" {
					wFloorErr = "the empty program saw no packet"
				}
				measured, floorNote = c.NsPerPacket, "; measured = Dysco (with the statistics' own cost): the floor was not measured: "+wFloorErr
			}
			r.add(&Figure{
				Key:     fmt.Sprintf("bpf-%s-%s", prog, w.name),
				Name:    fmt.Sprintf("datapath cost per packet, mb1 %s hook (%s)", strings.TrimPrefix(prog, "dysco_"), w.name),
				Command: fmt.Sprintf("%s; Δrun_time_ns of %s on LAB-mb1 ÷ Δ%s_packets of its interfaces", cmd, prog, map[bool]string{true: "rx", false: "tx"}[prog == "dysco_ingress"]),
				Unit:    "ns", Dysco: c.NsPerPacket, Baseline: fl, Ratio: math.NaN(),
				Measured: measured, MeasuredUnit: "ns/packet",
				Target: "≤ 100 ns", Paper: "131 ns lookup + 214 ns rewrite",
				Met: metStr(measured <= 100),
				Note: fmt.Sprintf("%d packets (skbs: a GSO packet counts once), %.2f runs and %.2f rewrites per packet, %.0f ns per run%s%s",
					c.Packets, float64(c.Runs)/float64(c.Packets), float64(rewrites)/float64(c.Packets), c.NsPerRun, client, floorNote),
			})
		}
	}
	return nil
}

// emptyCost runs argv at the client of the baseline lab and returns what the
// empty programs on its mb1 cost per packet meanwhile.
func emptyCost(ctx context.Context, l *lab.Lab, e *emptyHooks, workload string, argv []string, timeout time.Duration) ([]progCost, error) {
	before, err := takeSnap(ctx, l, "mb1", e.hooks, e.progs)
	if err != nil {
		return nil, err
	}
	if _, err := labkit.Run(ctx, l, "client", timeout, argv...); err != nil {
		return nil, err
	}
	after, err := takeSnap(ctx, l, "mb1", e.hooks, e.progs)
	if err != nil {
		return nil, err
	}
	return costs("mb1", workload, e.hooks, after, before), nil
}
