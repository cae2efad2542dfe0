package bench

import (
	"context"
	"fmt"
	"math"
	"net/netip"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/cilium/ebpf"
	"github.com/dysco/dysco/internal/datapath"
	"github.com/dysco/dysco/internal/lab"
	"github.com/dysco/dysco/internal/wire"

	"github.com/dysco/dysco/internal/labkit"
)

// mapMem is one BPF map of a host's datapath as the kernel reports it.
type mapMem struct {
	Name       string `json:"name"`
	Type       string `json:"type"`
	KeySize    uint32 `json:"key_size"`
	ValueSize  uint32 `json:"value_size"`
	MaxEntries uint32 `json:"max_entries"`
	Flags      uint32 `json:"flags"`
	// Memlock is the kernel's bytes_memlock (fdinfo "memlock"): for a
	// preallocated hash map, the memory of max_entries elements and the
	// buckets, whatever the number of live entries.
	Memlock uint64 `json:"memlock"`
	// PerEntry is Memlock / MaxEntries.
	PerEntry float64 `json:"per_entry"`
}

// memResult is the raw data of the memory benchmark on one host.
type memResult struct {
	Host            string         `json:"host"`
	Kind            string         `json:"kind"`
	Sessions        int            `json:"sessions"`
	FlowsPerSession int            `json:"flows_per_session"`
	MapsBefore      []mapMem       `json:"maps_before"`
	MapsAfter       []mapMem       `json:"maps_after"`
	MapsTotal       uint64         `json:"maps_total_memlock"`
	MapsTotalBefore uint64         `json:"maps_total_memlock_before_fill"`
	EntriesBefore   map[string]int `json:"entries_before"`
	EntriesAfter    map[string]int `json:"entries_after"`
	AgentPid        int            `json:"agent_pid"`
	RSSBeforeKiB    []int          `json:"rss_before_kib"`
	RSSAfterKiB     []int          `json:"rss_after_kib"`
	RSSDelta        int64          `json:"rss_delta_bytes"`
	PerSessionAll   float64        `json:"per_session_all_maps_and_agent"`
	FillTime        time.Duration  `json:"fill_time_ns"`
	// Capacity is max_entries of dysco_sessions.
	Capacity uint32 `json:"capacity"`
	// AgentCPU is the agent's CPU use (cores) while it held the sessions.
	AgentCPU float64 `json:"agent_cpu_cores"`
}

// benchMemory fills the session and flow maps of the Dysco lab's agents on
// mb1 (four flows per session) and the client (two) with o.Sessions
// sessions' worth of established entries, through the pinned maps, and
// reports the kernel's memlock of every map of the datapath plus the growth
// of the agent's RSS.
func benchMemory(ctx context.Context, o *Options, p *labkit.Pair, r *Report, pr *labkit.Progress) error {
	var results []*memResult
	r.Details["memory"] = &results
	for _, h := range []struct {
		host, kind string
		flows      int
		base       uint32
	}{
		{"mb1", "middlebox host", 4, 0x800000},
		{"client", "end host", 2, 0x800000},
	} {
		pr.Logf("memory: filling %s (%s) with %d sessions, %d flows each", h.host, h.kind, o.Sessions, h.flows)
		res, err := memoryHost(ctx, o, p.Dysco.Lab, h.host, h.kind, h.flows, h.base, pr)
		if res != nil {
			results = append(results, res)
		}
		if err != nil {
			return err
		}
		// The session maps are not preallocated (BPF_F_NO_PREALLOC): what a
		// session costs is what the maps and the agent grow by.
		growth := res.PerSessionAll
		r.add(&Figure{
			Key:  "memory-all-" + h.host,
			Name: fmt.Sprintf("memory per session at %d sessions, %s (growth of all maps + agent)", o.Sessions, h.kind),
			Command: fmt.Sprintf("fill LAB-%s's pinned dysco_sessions/dysco_flows4 (IPv4 sessions, %d flows/session); (Σ bytes_memlock of its maps after − before + agent RSS delta) ÷ %d",
				h.host, h.flows, o.Sessions),
			Unit: "B", Dysco: growth, Baseline: math.NaN(), Ratio: math.NaN(),
			Measured: growth, MeasuredUnit: "B/session",
			Target: "< 512 B", Met: metStr(growth < 512),
			Note: fmt.Sprintf("maps %.1f MiB after the fill, %.1f MiB before (%s), agent RSS %+.1f MiB; the agent used %.2f cores meanwhile (its collector reads every session and flow each second, in batches)",
				float64(res.MapsTotal)/(1<<20), float64(res.MapsTotalBefore)/(1<<20), res.entryCosts(), float64(res.RSSDelta)/(1<<20), res.AgentCPU),
		})
		r.add(&Figure{
			Key:     "memory-fixed-" + h.host,
			Name:    fmt.Sprintf("datapath memory with no session, %s (all maps)", h.kind),
			Command: fmt.Sprintf("Σ bytes_memlock of LAB-%s's maps before the fill", h.host),
			Unit:    "MiB", Dysco: float64(res.MapsTotalBefore) / (1 << 20), Baseline: math.NaN(), Ratio: math.NaN(),
			Measured: float64(res.MapsTotalBefore) / (1 << 20), MeasuredUnit: "MiB",
			Target: "(reported)", Met: "–",
			Note: "fixed: array maps (policies, types, stats, scratch) and the empty hash maps' buckets",
		})
	}
	return nil
}

// entryCosts tells what the session and flow maps grew by per session, as
// the kernel accounts it (48 + key + value + 8 bytes an entry), and what
// the entries really take: each is one object of the kmalloc size class
// that holds 48 + key + value + 8 bytes (128 for an IPv4 flow, 192 for a
// session; /proc/slabinfo; docs/architecture.md, "Small entries").
func (r *memResult) entryCosts() string {
	var parts []string
	for _, name := range []string{"dysco_flows4", "dysco_sessions"} {
		var before, after uint64
		var key, value uint32
		for _, m := range r.MapsBefore {
			if m.Name == name {
				before = m.Memlock
			}
		}
		for _, m := range r.MapsAfter {
			if m.Name == name {
				after, key, value = m.Memlock, m.KeySize, m.ValueSize
			}
		}
		if r.Sessions == 0 || after == 0 {
			continue
		}
		perEntry := 48 + roundUp8(key) + roundUp8(value) + 8
		growth := (float64(after) - float64(before)) / float64(r.Sessions)
		parts = append(parts, fmt.Sprintf("%s %+.0f B/session: %d-byte values, %d B an entry as accounted, in a %d-byte kmalloc object",
			name, growth, value, perEntry, kmallocClass(perEntry)))
	}
	return strings.Join(parts, "; ")
}

func roundUp8(n uint32) uint32 { return (n + 7) &^ 7 }

// kmallocClass is the kmalloc size class an object of n bytes comes from.
func kmallocClass(n uint32) uint32 {
	for _, c := range []uint32{8, 16, 32, 64, 96, 128, 192, 256, 512, 1024, 2048, 4096} {
		if n <= c {
			return c
		}
	}
	return n
}

func memoryHost(ctx context.Context, o *Options, l *lab.Lab, host, kind string, flowsPer int, base uint32, pr *labkit.Progress) (*memResult, error) {
	res := &memResult{Host: host, Kind: kind, Sessions: o.Sessions, FlowsPerSession: flowsPer}
	agent := l.Agent(host)
	if agent == nil {
		return res, fmt.Errorf("lab %s has no agent on %s", l.Name(), host)
	}
	res.AgentPid = agent.Pid()
	if comm, err := os.ReadFile(fmt.Sprintf("/proc/%d/comm", res.AgentPid)); err != nil || !strings.HasPrefix(strings.TrimSpace(string(comm)), "dysco") {
		return res, fmt.Errorf("pid %d of the agent on %s is not a dysco process (comm %q, %v)", res.AgentPid, host, comm, err)
	}
	pin := lab.PinDir(l.Host(host).Namespace)
	sessions, err := ebpf.LoadPinnedMap(filepath.Join(pin, "dysco_sessions"), nil)
	if err != nil {
		return res, err
	}
	defer sessions.Close()
	// The sessions are IPv4: their flows go to the IPv4 flow map.
	flows, err := ebpf.LoadPinnedMap(filepath.Join(pin, "dysco_flows4"), nil)
	if err != nil {
		return res, err
	}
	defer flows.Close()
	res.Capacity = sessions.MaxEntries()
	if uint64(o.Sessions) > uint64(sessions.MaxEntries()) || uint64(o.Sessions*flowsPer) > uint64(flows.MaxEntries()) {
		return res, fmt.Errorf("%d sessions do not fit: dysco_sessions holds %d, dysco_flows4 %d", o.Sessions, sessions.MaxEntries(), flows.MaxEntries())
	}
	if res.MapsBefore, err = datapathMaps(l, host); err != nil {
		return res, err
	}
	res.EntriesBefore = map[string]int{
		"dysco_sessions": count[uint32, datapath.Session](sessions),
		"dysco_flows4":   count[datapath.Tuple4, datapath.Flow4](flows),
	}
	if res.RSSBeforeKiB, err = rssSamples(ctx, res.AgentPid, 2*time.Second); err != nil {
		return res, err
	}

	// Fill: established, fresh sessions (the collector keeps them), each
	// with its flows; keys in 198.18.0.0/15, which no lab uses.
	start := time.Now()
	now := datapath.Now()
	ids := make([]uint32, 0, o.Sessions)
	svals := make([]datapath.Session, 0, o.Sessions)
	fkeys := make([]datapath.Tuple4, 0, o.Sessions*flowsPer)
	fvals := make([]datapath.Flow4, 0, o.Sessions*flowsPer)
	server := netip.MustParseAddr("198.19.255.1")
	for i := 0; i < o.Sessions; i++ {
		id := base + uint32(i)
		client := netip.AddrFrom4([4]byte{198, 18 + byte(i>>16), byte(i >> 8), byte(i)})
		st := wire.Tuple{Src: client, Dst: server, SrcPort: 40000, DstPort: 443}
		ids = append(ids, id)
		svals = append(svals, datapath.Session{
			Tuple: datapath.EndsFrom(st), CreatedMs: now, LastMs: now,
			State: datapath.StSYN | datapath.StSYNACK | datapath.StEst | datapath.StSetupDone,
			Role:  datapath.RoleMiddle,
		})
		for f := 0; f < flowsPer; f++ {
			k := st
			k.SrcPort = uint16(20000 + f)
			if f%2 == 1 {
				k = k.Reverse()
			}
			fkeys = append(fkeys, datapath.TupleFrom(k).To4())
			fl := datapath.Flow{Out: datapath.EndsFrom(st), SessId: id, LastMs: now}
			if f%2 == 1 {
				fl.Flags = datapath.FlRev
			}
			f4, err := fl.To4()
			if err != nil {
				return res, err
			}
			fvals = append(fvals, f4)
		}
	}
	defer func() {
		// Leave the lab as it was (it is torn down next anyway).
		batchDelete(flows, fkeys)
		batchDelete(sessions, ids)
	}()
	if err := batchPut(sessions, ids, svals); err != nil {
		return res, fmt.Errorf("filling dysco_sessions on %s: %w", host, err)
	}
	if err := batchPut(flows, fkeys, fvals); err != nil {
		return res, fmt.Errorf("filling dysco_flows4 on %s: %w", host, err)
	}
	res.FillTime = time.Since(start)
	pr.Logf("memory: %s filled in %v; watching the agent's RSS for 6 s (its collector scans the maps every second)", host, res.FillTime.Round(time.Millisecond))
	cpu0, _ := CPUTime(res.AgentPid)
	const watch = 6 * time.Second
	if res.RSSAfterKiB, err = rssSamples(ctx, res.AgentPid, watch); err != nil {
		return res, err
	}
	if cpu1, err := CPUTime(res.AgentPid); err == nil {
		res.AgentCPU = float64(cpu1-cpu0) / float64(watch)
	}
	if res.MapsAfter, err = datapathMaps(l, host); err != nil {
		return res, err
	}
	res.EntriesAfter = map[string]int{
		"dysco_sessions": count[uint32, datapath.Session](sessions),
		"dysco_flows4":   count[datapath.Tuple4, datapath.Flow4](flows),
	}
	// Every filled entry must still be there: the collector must not
	// have taken them for dead sessions.
	for i := 0; i < len(ids); i += 997 {
		var s datapath.Session
		if err := sessions.Lookup(ids[i], &s); err != nil {
			return res, fmt.Errorf("filled session %#x on %s is gone after 6 s: %w", ids[i], host, err)
		}
	}

	for _, m := range res.MapsAfter {
		res.MapsTotal += m.Memlock
	}
	for _, m := range res.MapsBefore {
		res.MapsTotalBefore += m.Memlock
	}
	rssBefore := labkit.Median(ints(res.RSSBeforeKiB))
	rssAfter := maxInt(res.RSSAfterKiB)
	res.RSSDelta = int64((float64(rssAfter) - rssBefore) * 1024)
	res.PerSessionAll = (float64(res.MapsTotal) - float64(res.MapsTotalBefore) + float64(res.RSSDelta)) / float64(o.Sessions)
	return res, nil
}

// datapathMaps returns every map of a host's datapath: those its agent
// pinned and those its attached programs use (the program array and the
// per-CPU scratch map are not pinned).
func datapathMaps(l *lab.Lab, host string) ([]mapMem, error) {
	ids := map[ebpf.MapID]bool{}
	pin := lab.PinDir(l.Host(host).Namespace)
	ents, err := os.ReadDir(pin)
	if err != nil {
		return nil, err
	}
	for _, e := range ents {
		if e.IsDir() {
			continue
		}
		m, err := ebpf.LoadPinnedMap(filepath.Join(pin, e.Name()), nil)
		if err != nil {
			continue // not a map
		}
		if info, err := m.Info(); err == nil {
			if id, ok := info.ID(); ok {
				ids[id] = true
			}
		}
		m.Close()
	}
	progs, err := hostPrograms(l, host)
	for _, ps := range progs {
		for _, p := range ps {
			if info, ierr := p.Info(); ierr == nil {
				if mids, ok := info.MapIDs(); ok {
					for _, id := range mids {
						ids[id] = true
					}
				}
			}
			p.Close()
		}
	}
	if err != nil {
		return nil, err
	}
	var out []mapMem
	for id := range ids {
		m, err := ebpf.NewMapFromID(id)
		if err != nil {
			return nil, fmt.Errorf("map %d of %s: %w", id, host, err)
		}
		info, err := m.Info()
		m.Close()
		if err != nil {
			return nil, err
		}
		mem, _ := info.Memlock()
		mm := mapMem{Name: info.Name, Type: info.Type.String(), KeySize: info.KeySize, ValueSize: info.ValueSize,
			MaxEntries: info.MaxEntries, Flags: info.Flags, Memlock: mem}
		if info.MaxEntries > 0 {
			mm.PerEntry = float64(mem) / float64(info.MaxEntries)
		}
		out = append(out, mm)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Memlock > out[j].Memlock })
	return out, nil
}

// count returns the number of entries of a map with keys K and values V.
func count[K, V any](m *ebpf.Map) int {
	n := 0
	it := m.Iterate()
	var k K
	var v V
	for it.Next(&k, &v) {
		n++
	}
	return n
}

// CPUTime returns the user+system CPU time of pid.
func CPUTime(pid int) (time.Duration, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, err
	}
	// The fields after the command (which may hold spaces) follow ") ".
	s := string(b)
	i := strings.LastIndex(s, ") ")
	if i < 0 {
		return 0, fmt.Errorf("/proc/%d/stat: unexpected format", pid)
	}
	f := strings.Fields(s[i+2:])
	if len(f) < 13 {
		return 0, fmt.Errorf("/proc/%d/stat: too few fields", pid)
	}
	// utime and stime are fields 14 and 15 of stat, 12 and 13 here.
	ut, err1 := strconv.ParseUint(f[11], 10, 64)
	st, err2 := strconv.ParseUint(f[12], 10, 64)
	if err1 != nil || err2 != nil {
		return 0, fmt.Errorf("/proc/%d/stat: bad utime/stime", pid)
	}
	const hz = 100 // USER_HZ
	return time.Duration(ut+st) * time.Second / hz, nil
}

const batch = 8192

func batchPut[K, V any](m *ebpf.Map, keys []K, vals []V) error {
	for i := 0; i < len(keys); i += batch {
		j := min(i+batch, len(keys))
		if _, err := m.BatchUpdate(keys[i:j], vals[i:j], &ebpf.BatchOptions{}); err != nil {
			// Kernels without batch operations: one by one.
			for x := i; x < j; x++ {
				if err := m.Update(keys[x], vals[x], ebpf.UpdateNoExist); err != nil {
					return err
				}
			}
		}
	}
	return nil
}

func batchDelete[K any](m *ebpf.Map, keys []K) {
	for i := 0; i < len(keys); i += batch {
		j := min(i+batch, len(keys))
		if _, err := m.BatchDelete(keys[i:j], nil); err != nil {
			for x := i; x < j; x++ {
				_ = m.Delete(keys[x])
			}
		}
	}
}

// rssSamples reads the VmRSS of pid (KiB) every 200 ms for d.
func rssSamples(ctx context.Context, pid int, d time.Duration) ([]int, error) {
	var out []int
	end := time.Now().Add(d)
	for {
		kb, err := vmRSS(pid)
		if err != nil {
			return out, err
		}
		out = append(out, kb)
		if time.Now().After(end) {
			return out, nil
		}
		select {
		case <-ctx.Done():
			return out, ctx.Err()
		case <-time.After(200 * time.Millisecond):
		}
	}
}

func vmRSS(pid int) (int, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0, fmt.Errorf("agent process %d: %w", pid, err)
	}
	for _, l := range strings.Split(string(b), "\n") {
		if f := strings.Fields(l); len(f) >= 2 && f[0] == "VmRSS:" {
			return strconv.Atoi(f[1])
		}
	}
	return 0, fmt.Errorf("no VmRSS in /proc/%d/status", pid)
}

func ints(xs []int) []float64 {
	out := make([]float64, len(xs))
	for i, x := range xs {
		out[i] = float64(x)
	}
	return out
}

func maxInt(xs []int) int {
	m := 0
	for _, x := range xs {
		m = max(m, x)
	}
	return m
}
