package policy

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"strings"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"

	"github.com/dysco/dysco/internal/api"
	"github.com/dysco/dysco/internal/testutil"
)

// setupRetBase is what the stand-in set-up program adds to cb[0], so that a
// run returns setupRetBase+verdict when the tail call happened and a TC
// action (0 or 2) when it did not.
const setupRetBase = 100

// classifier is a policy classifier loaded in the kernel, wired to a prog
// array like the datapath's.
type classifier struct {
	prog  *ebpf.Program
	progs *ebpf.Map
}

// newClassifier builds the classifier for filters (policy i is named "p<i>")
// and puts it into slot ClassifierSlot of a fresh prog array. With setup, slot
// SetupSlot holds a program that returns setupRetBase + cb[0].
func newClassifier(t *testing.T, filters []string, setup bool) *classifier {
	t.Helper()
	return loadClassifier(t, compileAll(t, filters), setup)
}

func loadClassifier(t *testing.T, policies []Compiled, setup bool) *classifier {
	t.Helper()
	testutil.RequireRoot(t, "loads BPF programs and runs them with BPF_PROG_TEST_RUN")
	progs, err := ebpf.NewMap(&ebpf.MapSpec{
		Type:       ebpf.ProgramArray,
		KeySize:    4,
		ValueSize:  4,
		MaxEntries: 2,
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { progs.Close() })

	prog, err := ebpf.NewProgram(mustBuild(t, policies, progs))
	if err != nil {
		var ve *ebpf.VerifierError
		if errors.As(err, &ve) {
			t.Fatalf("verifier: %+v", ve)
		}
		t.Fatal(err)
	}
	t.Cleanup(func() { prog.Close() })
	if err := progs.Put(uint32(ClassifierSlot), prog); err != nil {
		t.Fatal(err)
	}

	if setup {
		sp, err := ebpf.NewProgram(&ebpf.ProgramSpec{
			Name: "test_setup",
			Type: ebpf.SchedCLS,
			Instructions: asm.Instructions{
				asm.LoadMem(asm.R0, asm.R1, VerdictOffset, asm.Word),
				asm.Add.Imm(asm.R0, setupRetBase),
				asm.Return(),
			},
			License: "GPL",
		})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { sp.Close() })
		if err := progs.Put(uint32(SetupSlot), sp); err != nil {
			t.Fatal(err)
		}
	}
	return &classifier{prog: prog, progs: progs}
}

func compileAll(tb testing.TB, filters []string) []Compiled {
	tb.Helper()
	var cs []Compiled
	for i, f := range filters {
		// CompileFilter, not Compile: the classifier must run filters
		// that Compile refuses for the protocols they match (vlan, IP
		// options) exactly as the user-space VM does.
		cf, err := CompileFilter(f)
		if err != nil {
			tb.Fatal(err)
		}
		cs = append(cs, Compiled{Policy: api.Policy{Name: fmt.Sprintf("p%d", i), Filter: f}, Filter: cf})
	}
	return cs
}

func mustBuild(tb testing.TB, cs []Compiled, progs *ebpf.Map) *ebpf.ProgramSpec {
	tb.Helper()
	spec, err := BuildProgram(cs, progs, 0)
	if err != nil {
		tb.Fatal(err)
	}
	return spec
}

// run runs the classifier on frame and returns its return value. cb[0]
// starts at a non-zero value, so a classifier that forgot to write the
// no-match verdict would show.
func (c *classifier) run(tb testing.TB, frame []byte) uint32 {
	tb.Helper()
	ctx := make([]uint32, 17) // __sk_buff up to and including cb[4]
	ctx[VerdictOffset/4] = 77
	ret, err := c.prog.Run(&ebpf.RunOptions{Data: frame, Context: ctx})
	if err != nil {
		tb.Fatalf("BPF_PROG_TEST_RUN on %d-byte frame: %v", len(frame), err)
	}
	return ret
}

// verdict runs the classifier and returns the verdict the set-up program saw.
func (c *classifier) verdict(tb testing.TB, frame []byte) uint32 {
	tb.Helper()
	ret := c.run(tb, frame)
	if ret < setupRetBase {
		tb.Fatalf("classifier returned %d without tail-calling the set-up program", ret)
	}
	return ret - setupRetBase
}

var syn80 = frame{src: "10.0.0.1", dst: "10.200.4.2", sport: 40000, dport: 80}

func TestClassifierVerdicts(t *testing.T) {
	web := "tcp dst port 80 and host 10.200.4.2"
	tls := "tcp and (port 443 or port 8443) and not src net 10.0.0.0/8"
	for _, tc := range []struct {
		name    string
		filters []string
		frame   frame
		want    uint32
	}{
		{"no policies", nil, syn80, 0},
		{"web matches", []string{web}, syn80, 1},
		{"web, other port", []string{web}, frame{src: "10.0.0.1", dst: "10.200.4.2", sport: 40000, dport: 81}, 0},
		{"web, other host", []string{web}, frame{src: "10.0.0.1", dst: "10.200.4.3", sport: 40000, dport: 80}, 0},
		{"web, host is the source", []string{web}, frame{src: "10.200.4.2", dst: "10.0.0.9", sport: 40000, dport: 80}, 1},
		{"web, IPv4 options move the TCP header", []string{web}, frame{src: "10.0.0.1", dst: "10.200.4.2", sport: 40000, dport: 80, ipOpts: true}, 1},
		{"web, later fragment", []string{web}, frame{src: "10.0.0.1", dst: "10.200.4.2", sport: 40000, dport: 80, fragOff: 3}, 0},
		{"web, UDP", []string{web}, frame{src: "10.0.0.1", dst: "10.200.4.2", sport: 40000, dport: 80, udp: true}, 0},
		{"ip6 and tcp, v6", []string{"ip6 and tcp"}, frame{src: "2001:db8::1", dst: "2001:db8::2", sport: 1, dport: 2}, 1},
		{"ip6 and tcp, v4", []string{"ip6 and tcp"}, syn80, 0},
		{"ip6 and tcp, v6 udp", []string{"ip6 and tcp"}, frame{src: "2001:db8::1", dst: "2001:db8::2", sport: 1, dport: 2, udp: true}, 0},
		{"tls, outside src", []string{tls}, frame{src: "192.168.1.1", dst: "10.0.0.1", sport: 5000, dport: 8443}, 1},
		{"tls, inside src", []string{tls}, frame{src: "10.1.1.1", dst: "192.168.1.1", sport: 5000, dport: 443}, 0},
		{"tls, src port", []string{tls}, frame{src: "192.168.1.1", dst: "10.0.0.1", sport: 443, dport: 5000}, 1},
		{"tls, v6", []string{tls}, frame{src: "2001:db8::1", dst: "2001:db8::2", sport: 5000, dport: 443}, 1},
		{"syn only, SYN", []string{"tcp[tcpflags] & (tcp-syn|tcp-ack) == tcp-syn"}, syn80, 1},
		{"syn only, SYN-ACK", []string{"tcp[tcpflags] & (tcp-syn|tcp-ack) == tcp-syn"}, frame{src: "10.0.0.1", dst: "10.0.0.2", sport: 1, dport: 2, flags: "SA"}, 0},
		{"len, long", []string{"len > 100"}, frame{src: "10.0.0.1", dst: "10.0.0.2", sport: 1, dport: 2, payload: make([]byte, 100)}, 1},
		{"len, short", []string{"len > 100"}, syn80, 0},
		{"vlan and tcp", []string{"vlan and tcp"}, frame{src: "10.0.0.1", dst: "10.0.0.2", sport: 1, dport: 2, vlan: true}, 1},
		{"vlan and tcp, untagged", []string{"vlan and tcp"}, syn80, 0},
		{"ether src", []string{"ether src 02:00:00:00:00:01"}, syn80, 1},
		{"payload at X-computed offset", []string{"tcp[((tcp[12:1] & 0xf0) >> 2):4] = 0x47455420"},
			frame{src: "10.0.0.1", dst: "10.0.0.2", sport: 1, dport: 80, flags: "AP", payload: []byte("GET / HTTP/1.1\r\n")}, 1},
		{"negation", []string{"ip[8] = -ip[9] & 0xff"}, frame{src: "10.0.0.1", dst: "10.0.0.2", sport: 1, dport: 2}, 0},
		{"negation, true", []string{"-ip[8] & 0xff = 192"}, frame{src: "10.0.0.1", dst: "10.0.0.2", sport: 1, dport: 2}, 1},
		{"shift by X of 32 or more gives 0", []string{"tcp and (1 << ip[0]) = 0"}, syn80, 1},
		{"shift by X of 32 to 63 gives 0", []string{"tcp and (1 << (ip[0] - 20)) = 0"}, syn80, 1},
		{"shift by X below 32", []string{"tcp and (1 << (ip[0] & 0xf)) = 32"}, syn80, 1},
		{"division by X", []string{"ip and ip[2:2] / (ip[1] & 3) > 10"}, frame{src: "10.0.0.1", dst: "10.0.0.2", sport: 1, dport: 2, tos: 1}, 1},
		// §2.2: first match wins, and a policy that cannot run on a
		// packet does not stop the ones after it.
		// eBPF defines x/0 = 0 and x%0 = x: these filters would match
		// if the translation did not guard the division.
		{"division by zero skips to next policy", []string{"ip and ip[2:2] / (ip[1] & 3) = 0", "ip"}, syn80, 2},
		{"modulo by zero skips to next policy", []string{"ip and ip[2:2] % (ip[1] & 3) != 0", "ip"}, syn80, 2},
		{"first match wins", []string{"tcp", web}, syn80, 1},
		{"first match wins, reversed", []string{web, "tcp"}, syn80, 1},
		{"first match wins, later", []string{"udp", "ip6", web, "tcp"}, syn80, 3},
		{"none of several", []string{"udp", "ip6", "port 22"}, syn80, 0},
		// Classic BPF aborts the whole filter on an out-of-bounds load,
		// so the "or" does not rescue policy 1.
		{"truncated frame: load out of bounds means no match", []string{"ip[100] = 0 or ip src 10.0.0.1", "ip src 10.0.0.1"}, syn80, 2},
		{"truncated frame: TCP header cut off", []string{web, "ip src 10.0.0.1"}, frame{src: "10.0.0.1", dst: "10.200.4.2", sport: 40000, dport: 80, truncate: 14 + 20 + 1}, 2},
		{"VLAN tag cut off", []string{"vlan and tcp", "len <= 16"}, frame{src: "10.0.0.1", dst: "10.0.0.2", sport: 1, dport: 2, vlan: true, truncate: 16}, 2},
		// A policy that accepts everything makes the rest unreachable.
		{"catch-all first", []string{"len >= 0", web}, syn80, 1},
		{"catch-all last", []string{"udp", "len >= 0"}, syn80, 2},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b := tc.frame.bytes(t)
			if got := NewMatcher(compileAll(t, tc.filters)).Verdict(b); got != tc.want {
				t.Errorf("Matcher verdict = %d, want %d", got, tc.want)
			}
			c := newClassifier(t, tc.filters, true)
			if got := c.verdict(t, b); got != tc.want {
				t.Errorf("eBPF verdict = %d, want %d", got, tc.want)
			}
		})
	}
}

// TestClassifierFailsClosed checks what happens when the set-up program is
// missing: a session a policy claims is dropped rather than sent around the
// middleboxes, and other SYNs pass.
func TestClassifierFailsClosed(t *testing.T) {
	c := newClassifier(t, []string{"tcp dst port 80"}, false)
	if got := c.run(t, syn80.bytes(t)); got != tcActShot {
		t.Errorf("matching SYN, empty set-up slot: return %d, want TC_ACT_SHOT (%d)", got, tcActShot)
	}
	other := syn80
	other.dport = 22
	if got := c.run(t, other.bytes(t)); got != tcActOK {
		t.Errorf("non-matching SYN, empty set-up slot: return %d, want TC_ACT_OK (%d)", got, tcActOK)
	}
}

// realisticFilters are the shapes of filters operators write; the classifier
// must verify with MaxPolicies of them.
func realisticFilters(n int) []string {
	var fs []string
	for i := range n {
		switch i % 6 {
		case 0:
			fs = append(fs, fmt.Sprintf("tcp dst port %d and host 10.200.%d.2", 8000+i, i))
		case 1:
			fs = append(fs, "ip6 and tcp and dst port "+fmt.Sprint(9000+i))
		case 2:
			fs = append(fs, fmt.Sprintf("tcp and (port %d or port %d) and not src net 10.%d.0.0/16", 1000+i, 2000+i, i))
		case 3:
			// libpcap's tcp[] is IPv4 only; TCP flags after a bare
			// IPv6 header are at ip6[53].
			fs = append(fs, fmt.Sprintf("ip6[53] & 2 != 0 and dst net 2001:db8:%x::/48 and tcp dst port %d", i, 3000+i))
		case 4:
			fs = append(fs, fmt.Sprintf("vlan and tcp and dst host 192.168.%d.1", i))
		case 5:
			fs = append(fs, fmt.Sprintf("tcp[((tcp[12:1] & 0xf0) >> 2):4] = 0x47455420 and dst portrange %d-%d", 4000+i, 4100+i))
		}
	}
	return fs
}

func TestClassifierMaxPolicies(t *testing.T) {
	fs := realisticFilters(MaxPolicies)
	// Only the last policy matches this SYN: every filter runs on it.
	last := frame{src: "10.0.0.1", dst: "10.0.0.2", sport: 5555, dport: 80}
	fs[MaxPolicies-1] = "tcp port 5555"
	c := newClassifier(t, fs, true)
	if got := c.verdict(t, last.bytes(t)); got != MaxPolicies {
		t.Errorf("verdict = %d, want %d", got, MaxPolicies)
	}
	if got := c.verdict(t, syn80.bytes(t)); got != 0 {
		t.Errorf("verdict = %d, want 0", got)
	}
	info, err := c.prog.Info()
	if err != nil {
		t.Fatal(err)
	}
	if n, ok := info.VerifiedInstructions(); ok {
		t.Logf("%d policies: %d instructions verified", MaxPolicies, n)
	}

	_, err = BuildProgram(compileAll(t, realisticFilters(MaxPolicies+1)), c.progs, 0)
	if err == nil || !strings.Contains(err.Error(), fmt.Sprint(MaxPolicies)) {
		t.Errorf("BuildProgram with %d policies: error %v, want one naming the limit", MaxPolicies+1, err)
	}
}

// oracleFilters exercise every classic BPF instruction libpcap emits for
// Ethernet: absolute and indirect loads of all sizes, LDX MSH, scratch
// memory, ALU with K and X (division, modulo, shifts, negation), every jump
// form, "len".
var oracleFilters = []string{
	"tcp dst port 80 and host 10.200.4.2",
	"ip6 and tcp",
	"tcp and (port 443 or port 8443) and not src net 10.0.0.0/8",
	"tcp[tcpflags] & (tcp-syn|tcp-ack) == tcp-syn",
	"ip6 and dst net 2001:db8::/32 and tcp dst port 443",
	"vlan and tcp",
	"greater 80 and less 200",
	"ip and ip[2:2] / (ip[1] & 3) > 10",
	"tcp and ip[2:2] % (tcp[13] & 7) = 1",
	"tcp and (tcp[0] << ip[0]) = 0 and (ip[1] >> (ip[8] - 60)) = 0",
	"tcp[((tcp[12:1] & 0xf0) >> 2):4] = 0x47455420",
	"ip[6:2] & 0x1fff != 0 or ip[0] & 0xf > 5",
	"-ip[8] & 0xff = 192 or udp port 53",
	"tcp src portrange 1000-30000 and ip[2:2] * 3 - 7 > 200",
	"tcp[4:4] ^ 0xffffffff > 0x80000000 or ip6[6] == 17",
}

// TestClassifierAgainstOracle compares the eBPF classifier with the user-space
// VM on random frames, one filter at a time (so that every filter's verdict is
// seen, not just the first match) and all filters together.
func TestClassifierAgainstOracle(t *testing.T) {
	testutil.RequireRoot(t, "loads BPF programs and runs them with BPF_PROG_TEST_RUN")
	// A fixed seed keeps failures reproducible; change it to explore.
	r := rand.New(rand.NewPCG(2017, 1))
	frames := make([][]byte, 400)
	for i := range frames {
		frames[i] = randomFrame(t, r)
	}

	check := func(t *testing.T, filters []string) {
		c := newClassifier(t, filters, true)
		m := NewMatcher(compileAll(t, filters))
		hits := 0
		for i, b := range frames {
			want := m.Verdict(b)
			if got := c.verdict(t, b); got != want {
				t.Errorf("frame %d (%x): eBPF verdict %d, oracle %d", i, b, got, want)
			}
			if want != 0 {
				hits++
			}
		}
		t.Logf("%d of %d frames matched", hits, len(frames))
	}
	for i, f := range oracleFilters {
		t.Run(fmt.Sprint(i), func(t *testing.T) { check(t, []string{f}) })
	}
	t.Run("all", func(t *testing.T) { check(t, oracleFilters) })
}

// TestContractMatchesDatapath checks the numbers this package shares with the
// datapath's C headers, which have their own spelling of them.
func TestContractMatchesDatapath(t *testing.T) {
	const header = "../../bpf/include/consts.h"
	src, err := os.ReadFile(header)
	if err != nil {
		t.Fatalf("datapath constants: %v", err)
	}
	defines := map[string]string{}
	for _, line := range strings.Split(string(src), "\n") {
		if f := strings.Fields(line); len(f) >= 3 && f[0] == "#define" {
			defines[f[1]] = f[2]
		}
	}
	for name, want := range map[string]int{
		"PROG_POLICY":  ClassifierSlot,
		"PROG_SETUP":   SetupSlot,
		"CB_POLICY":    (VerdictOffset - 48) / 4, // cb[] starts at offset 48 of __sk_buff
		"MAX_POLICIES": MaxPolicies,
	} {
		if got, ok := defines[name]; !ok || got != fmt.Sprint(want) {
			t.Errorf("%s: %s defines %q, this package uses %d", header, name, got, want)
		}
	}
}
