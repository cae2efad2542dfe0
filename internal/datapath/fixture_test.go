package datapath

// Fixture harness: the datapath loaded with its maps pinned under the test's
// directory, a fresh network namespace with one veth pair, addresses and
// routes (bpf_fib_lookup resolves in the namespace of the thread that runs
// BPF_PROG_TEST_RUN), and helpers that run a program on a frame and read the
// maps and counters around it.

import (
	"errors"
	"fmt"
	"net/netip"
	"os"
	"runtime"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/dysco/dysco/internal/testutil"
	"github.com/dysco/dysco/internal/wire"
)

// TC verdicts.
const (
	tcActOK       = 0
	tcActShot     = 2
	tcActRedirect = 7
)

// The fixture's subsession port range.
const (
	fxPortLo = 41000
	fxPortN  = 1000
)

// The fixture host and its neighbours. The host has hostV4/hostV6 on dy0, in
// 10.1.0.0/24 and fd00:1::/64; servers in 10.9.0.0/16 and fd00:9::/64 are
// reached through a gateway on that link. Clients sit behind other hosts.
var (
	hostV4   = netip.MustParseAddr("10.1.0.1")
	hostV6   = netip.MustParseAddr("fd00:1::1")
	prevV4   = netip.MustParseAddr("10.1.0.20") // previous Dysco hop
	prevV6   = netip.MustParseAddr("fd00:1::20")
	mboxV4   = netip.MustParseAddr("10.1.0.30") // middlebox hosts
	mbox2V4  = netip.MustParseAddr("10.1.0.31")
	mboxV6   = netip.MustParseAddr("fd00:1::30")
	clientV4 = netip.MustParseAddr("10.5.0.7")
	clientV6 = netip.MustParseAddr("fd00:5::7")
	serverV4 = netip.MustParseAddr("10.9.0.5")
	serverV6 = netip.MustParseAddr("fd00:9::5")
	noRoute  = netip.MustParseAddr("192.0.2.1") // TEST-NET-1: no route in the namespace
)

// skbCtx is the start of struct __sk_buff, up to cb[4]. bpf_prog_test_run_skb
// (net/bpf/test_run.c, convert___skb_to_skb) rejects a context with any field
// other than mark, priority, ingress_ifindex, ifindex, cb, tstamp, wire_len,
// gso_segs, gso_size and hwtstamp set; ifindex picks skb->dev in the calling
// thread's network namespace.
type skbCtx struct {
	Len, PktType, Mark, QueueMapping, Protocol, VlanPresent, VlanTCI, VlanProto uint32
	Priority, IngressIfindex, Ifindex, TCIndex                                  uint32
	CB                                                                          [5]uint32
}

// testNet is a network namespace owned by one goroutine locked to its OS
// thread; work runs there (like cilium/ebpf's NetNS.Do).
type testNet struct {
	ns      netns.NsHandle
	work    chan func()
	ifindex int // dy0
}

func newTestNet(t testing.TB) *testNet {
	t.Helper()
	n := &testNet{work: make(chan func())}
	ready := make(chan error)
	go func() {
		// The thread is never unlocked: it has left the test process's
		// namespace, so the runtime must discard it when this goroutine ends.
		runtime.LockOSThread()
		ns, err := netns.New()
		if err != nil {
			ready <- fmt.Errorf("new network namespace: %w", err)
			return
		}
		n.ns = ns
		ready <- nil
		for f := range n.work {
			f()
		}
	}()
	if err := <-ready; err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		close(n.work)
		n.ns.Close()
	})
	if err := n.configure(); err != nil {
		t.Fatalf("test namespace: %v", err)
	}
	return n
}

// do runs fn on the namespace's thread.
func (n *testNet) do(fn func()) {
	done := make(chan struct{})
	n.work <- func() {
		defer close(done)
		fn()
	}
	<-done
}

// configure builds the fixture host: dy0 (peer dy1) up with the host's
// addresses, a gateway route to the servers, and forwarding on, so that
// bpf_fib_lookup answers.
func (n *testNet) configure() error {
	h, err := netlink.NewHandleAt(n.ns)
	if err != nil {
		return err
	}
	defer h.Close()
	la := netlink.NewLinkAttrs()
	la.Name = "dy0"
	if err := h.LinkAdd(&netlink.Veth{LinkAttrs: la, PeerName: "dy1"}); err != nil {
		return fmt.Errorf("add veth: %w", err)
	}
	var dy0 netlink.Link
	for _, name := range []string{"lo", "dy1", "dy0"} {
		l, err := h.LinkByName(name)
		if err != nil {
			return err
		}
		if err := h.LinkSetUp(l); err != nil {
			return fmt.Errorf("%s up: %w", name, err)
		}
		dy0 = l
	}
	n.ifindex = dy0.Attrs().Index
	for _, a := range []string{"10.1.0.1/24", "fd00:1::1/64"} {
		addr, err := netlink.ParseAddr(a)
		if err != nil {
			return err
		}
		addr.Flags = unix.IFA_F_NODAD // usable as a source at once
		if err := h.AddrAdd(dy0, addr); err != nil {
			return fmt.Errorf("address %s: %w", a, err)
		}
	}
	var errs []error
	n.do(func() {
		for _, f := range []string{"/proc/sys/net/ipv4/conf/all/forwarding", "/proc/sys/net/ipv6/conf/all/forwarding"} {
			errs = append(errs, os.WriteFile(f, []byte("1"), 0o644))
		}
	})
	if err := errors.Join(errs...); err != nil {
		return err
	}
	for _, r := range []struct{ dst, gw string }{{"10.9.0.0/16", "10.1.0.254"}, {"fd00:9::/64", "fd00:1::fe"}} {
		dst, err := netlink.ParseIPNet(r.dst)
		if err != nil {
			return err
		}
		gw := netip.MustParseAddr(r.gw)
		if err := h.RouteAdd(&netlink.Route{LinkIndex: n.ifindex, Dst: dst, Gw: gw.AsSlice()}); err != nil {
			return fmt.Errorf("route %s via %s: %w", r.dst, r.gw, err)
		}
	}
	return nil
}

// fixture is a loaded datapath and the namespace its programs run in.
type fixture struct {
	d                      *Datapath
	net                    *testNet
	ingress, egress, setup *ebpf.Program
}

func newFixture(t testing.TB) *fixture {
	t.Helper()
	return newFixtureWith(t, nil)
}

// newFixtureWith is newFixture with the load configuration changed by
// configure, which sees the namespace (its interfaces) first.
func newFixtureWith(t testing.TB, configure func(n *testNet, cfg *Config)) *fixture {
	t.Helper()
	testutil.RequireRoot(t)
	fx := &fixture{net: newTestNet(t)}
	cfg := Config{PinDir: testPinDir(t), PortLo: fxPortLo, PortN: fxPortN}
	if configure != nil {
		configure(fx.net, &cfg)
	}
	d, err := Load(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { d.Close() })
	fx.d = d
	fx.ingress, fx.egress, fx.setup = d.Programs()
	if err := d.SetLocalAddrs([]netip.Addr{hostV4, hostV6}); err != nil {
		t.Fatal(err)
	}
	if err := d.SetSynKeys(&fxSynKey, nil); err != nil {
		t.Fatal(err)
	}
	return fx
}

// run runs prog on frame as a packet of dy0 and returns the verdict and the
// frame as the program left it.
func (fx *fixture) run(tb testing.TB, prog *ebpf.Program, frame []byte) (uint32, []byte) {
	tb.Helper()
	opts := &ebpf.RunOptions{
		Data:    frame,
		DataOut: make([]byte, len(frame)+512),
		Context: skbCtx{Ifindex: uint32(fx.net.ifindex)},
	}
	var ret uint32
	var err error
	fx.net.do(func() { ret, err = prog.Run(opts) })
	if err != nil {
		tb.Fatalf("BPF_PROG_TEST_RUN %v: %v", prog, err)
	}
	return ret, opts.DataOut
}

// reset empties the session state and the policy maps between table rows.
func (fx *fixture) reset(tb testing.TB) {
	tb.Helper()
	m := fx.d.Maps()
	for _, name := range []string{"flows4", "flows6", "sessions", "syns", "deltas", "halfopen"} {
		clearHash(tb, m[name])
	}
	if err := fx.d.SetPolicies(nil); err != nil {
		tb.Fatal(err)
	}
	if err := fx.d.SetTypes(nil); err != nil {
		tb.Fatal(err)
	}
	if err := fx.d.SetPolicyProgram(nil); err != nil {
		tb.Fatal(err)
	}
}

func clearHash(tb testing.TB, m *ebpf.Map) {
	tb.Helper()
	var keys [][]byte
	k, v := make([]byte, m.KeySize()), make([]byte, m.ValueSize())
	it := m.Iterate()
	for it.Next(&k, &v) {
		keys = append(keys, append([]byte(nil), k...))
	}
	if err := it.Err(); err != nil {
		tb.Fatal(err)
	}
	for _, k := range keys {
		if err := m.Delete(k); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			tb.Fatal(err)
		}
	}
}

// stats reads the counters.
func (fx *fixture) stats(tb testing.TB) map[string]uint64 {
	tb.Helper()
	s, err := fx.d.Stats()
	if err != nil {
		tb.Fatal(err)
	}
	return s
}

// expectStats checks that exactly the counters in want moved since before,
// each by the amount given.
func (fx *fixture) expectStats(tb testing.TB, before map[string]uint64, want map[string]uint64) {
	tb.Helper()
	after := fx.stats(tb)
	for _, name := range StatNames {
		if d := after[name] - before[name]; d != want[name] {
			tb.Errorf("counter %s moved by %d, want %d", name, d, want[name])
		}
	}
}

func (fx *fixture) sessions(tb testing.TB) []SessionEntry {
	tb.Helper()
	s, err := fx.d.Sessions()
	if err != nil {
		tb.Fatal(err)
	}
	return s
}

// flows returns the flows by key, without their counters (and without the
// FL_EST mark, a cache of the session's state), so that tables can compare
// what a flow does.
func (fx *fixture) flows(tb testing.TB) map[Tuple]Flow {
	tb.Helper()
	out := fx.rawFlows(tb)
	for k, f := range out {
		f.Packets, f.Bytes, f.LastMs = 0, 0, 0
		f.Flags &^= FlEst
		out[k] = f
	}
	return out
}

// rawFlows returns the flows by key as the datapath left them.
func (fx *fixture) rawFlows(tb testing.TB) map[Tuple]Flow {
	tb.Helper()
	fs, err := fx.d.Flows()
	if err != nil {
		tb.Fatal(err)
	}
	out := map[Tuple]Flow{}
	for _, f := range fs {
		out[f.Key] = f.Flow
	}
	return out
}

func (fx *fixture) synState(tb testing.TB, id uint32) (dyscoSynState, bool) {
	tb.Helper()
	var st dyscoSynState
	err := fx.d.Maps()["syns"].Lookup(id, &st)
	if errors.Is(err, ebpf.ErrKeyNotExist) {
		return st, false
	}
	if err != nil {
		tb.Fatal(err)
	}
	return st, true
}

func (fx *fixture) synCount(tb testing.TB) int {
	tb.Helper()
	return entries(tb, fx.d.Maps()["syns"])
}

// entries counts the entries of a hash map.
func entries(tb testing.TB, m *ebpf.Map) int {
	tb.Helper()
	n := 0
	k, v := make([]byte, m.KeySize()), make([]byte, m.ValueSize())
	it := m.Iterate()
	for it.Next(&k, &v) {
		n++
	}
	if err := it.Err(); err != nil {
		tb.Fatal(err)
	}
	return n
}

// expectNoState checks that no session, flow or set-up state exists.
func (fx *fixture) expectNoState(tb testing.TB) {
	tb.Helper()
	if s := fx.sessions(tb); len(s) != 0 {
		tb.Errorf("%d sessions left behind: %+v", len(s), s)
	}
	if f := fx.flows(tb); len(f) != 0 {
		tb.Errorf("%d flows left behind: %v", len(f), f)
	}
	if n := fx.synCount(tb); n != 0 {
		tb.Errorf("%d set-up states left behind", n)
	}
}

// onlySession returns the one session there must be.
func (fx *fixture) onlySession(tb testing.TB) SessionEntry {
	tb.Helper()
	s := fx.sessions(tb)
	if len(s) != 1 {
		tb.Fatalf("%d sessions, want 1: %+v", len(s), s)
	}
	return s[0]
}

// expectFlows checks the flow map against want, entry by entry.
func (fx *fixture) expectFlows(tb testing.TB, want map[Tuple]Flow) {
	tb.Helper()
	got := fx.flows(tb)
	for k, w := range want {
		g, ok := got[k]
		if !ok {
			tb.Errorf("no flow for %v", k)
			continue
		}
		if g != w {
			tb.Errorf("flow %v:\n got out %v sess %d flags %s\nwant out %v sess %d flags %s",
				k, g.Out, g.SessId, flagNames(g.Flags), w.Out, w.SessId, flagNames(w.Flags))
		}
	}
	for k := range got {
		if _, ok := want[k]; !ok {
			tb.Errorf("unexpected flow %v -> %v", k, got[k].Out)
		}
	}
}

func flagNames(f uint32) string {
	s := ""
	for i, n := range []string{"reroute", "syn-strip", "syn-emit", "tap", "delta", "rev", "ingress", "est", "routed", "tp-out", "tp-old", "tp-new", "drop", "hold-data", "hold-all", "marks"} {
		if f&(1<<i) != 0 {
			s += n + "|"
		}
	}
	if s == "" {
		return "0"
	}
	return s[:len(s)-1]
}

func flow(out wire.Tuple, id uint32, flags uint32) Flow {
	return Flow{Out: EndsFrom(out), SessId: id, Flags: flags}
}

// hopsOf reads a set-up state's address list.
func hopsOf(st dyscoSynState) []netip.Addr {
	var out []netip.Addr
	for i := 0; i < int(st.N_hops) && i < len(st.Hops); i++ {
		out = append(out, netip.AddrFrom16(st.Hops[i]).Unmap())
	}
	return out
}

// loadClassifier loads a stand-in for the policy program: it writes verdict
// into cb[0] (policy slot + 1, 0 for none) and tail-calls the set-up program,
// as internal/policy's generated classifier does.
func loadClassifier(t *testing.T, d *Datapath, verdict int32) *ebpf.Program {
	t.Helper()
	prog, err := ebpf.NewProgram(&ebpf.ProgramSpec{
		Name: "test_policy",
		Type: ebpf.SchedCLS,
		Instructions: asm.Instructions{
			asm.Mov.Reg(asm.R6, asm.R1),
			asm.Mov.Imm32(asm.R1, verdict),
			asm.StoreMem(asm.R6, 48, asm.R1, asm.Word), // cb[0]
			asm.Mov.Reg(asm.R1, asm.R6),
			asm.LoadMapPtr(asm.R2, d.ProgArray().FD()),
			asm.Mov.Imm(asm.R3, progSetup),
			asm.FnTailCall.Call(),
			asm.Mov.Imm(asm.R0, tcActShot),
			asm.Return(),
		},
		License: "GPL",
	})
	if err != nil {
		t.Fatalf("load stand-in classifier: %v", err)
	}
	t.Cleanup(func() { prog.Close() })
	return prog
}

// nonceOf is a recognisable nonce.
func nonceOf(b byte) [wire.NonceLen]byte {
	return [wire.NonceLen]byte{0xd0, b, 2, 3, 4, 5, 6, b}
}

func tup(src, dst netip.AddrPort) wire.Tuple {
	return wire.Tuple{Src: src.Addr(), Dst: dst.Addr(), SrcPort: src.Port(), DstPort: dst.Port()}
}

func apOf(a netip.Addr, port uint16) netip.AddrPort { return netip.AddrPortFrom(a, port) }
