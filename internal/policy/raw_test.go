package policy

import (
	"fmt"
	"strings"
	"testing"

	"github.com/cilium/ebpf/asm"
	"golang.org/x/net/bpf"

	"github.com/dysco/dysco/internal/api"
)

// rawPolicies turns hand-written classic BPF programs into policies. They
// cover instructions and corner cases libpcap rarely or never emits but the
// translator must still get right.
func rawPolicies(tb testing.TB, progs ...[]bpf.Instruction) []Compiled {
	tb.Helper()
	var cs []Compiled
	for i, p := range progs {
		raw, err := bpf.Assemble(p)
		if err != nil {
			tb.Fatal(err)
		}
		f, err := NewFilter(fmt.Sprintf("raw%d", i), raw)
		if err != nil {
			tb.Fatal(err)
		}
		cs = append(cs, Compiled{Policy: api.Policy{Name: fmt.Sprintf("raw%d", i)}, Filter: f})
	}
	return cs
}

func TestClassifierRawPrograms(t *testing.T) {
	// syn80's bytes 12-13 are the IPv4 EtherType 0x0800.
	ldEtherType := bpf.LoadAbsolute{Off: 12, Size: 2}
	jumpX := func(cond bpf.JumpTest, x uint32) []bpf.Instruction {
		return []bpf.Instruction{
			bpf.LoadConstant{Dst: bpf.RegX, Val: x},
			ldEtherType,
			bpf.JumpIfX{Cond: cond, SkipTrue: 1},
			bpf.RetConstant{Val: 0},
			bpf.RetConstant{Val: 1},
		}
	}
	jumpK := func(cond bpf.JumpTest, k uint32) []bpf.Instruction {
		return []bpf.Instruction{
			ldEtherType,
			bpf.JumpIf{Cond: cond, Val: k, SkipTrue: 1},
			bpf.RetConstant{Val: 0},
			bpf.RetConstant{Val: 1},
		}
	}
	// aluIs accepts the packet when ops turn A = a into exactly want.
	aluIs := func(a, want uint32, ops ...bpf.Instruction) []bpf.Instruction {
		p := append([]bpf.Instruction{bpf.LoadConstant{Dst: bpf.RegA, Val: a}}, ops...)
		return append(p, bpf.JumpIf{Cond: bpf.JumpEqual, Val: want, SkipTrue: 1}, bpf.RetConstant{Val: 0}, bpf.RetConstant{Val: 1})
	}
	for _, tc := range []struct {
		name  string
		progs [][]bpf.Instruction
		want  uint32
	}{
		{"RET A non-zero", [][]bpf.Instruction{{ldEtherType, bpf.RetA{}}}, 1},
		{"RET A zero", [][]bpf.Instruction{{bpf.LoadConstant{Dst: bpf.RegA, Val: 0}, bpf.RetA{}}}, 0},
		{"unreachable instructions are dropped", [][]bpf.Instruction{{
			bpf.Jump{Skip: 2},
			bpf.LoadAbsolute{Off: 1000, Size: 4},
			bpf.RetConstant{Val: 0},
			bpf.RetConstant{Val: 1},
		}}, 1},
		{"jt and jf both away", [][]bpf.Instruction{{
			ldEtherType,
			bpf.JumpIf{Cond: bpf.JumpEqual, Val: 0x0800, SkipTrue: 2, SkipFalse: 1},
			bpf.RetConstant{Val: 0},
			bpf.RetConstant{Val: 0},
			bpf.RetConstant{Val: 1},
		}}, 1},
		{"jt equals jf", [][]bpf.Instruction{{
			ldEtherType,
			bpf.JumpIf{Cond: bpf.JumpEqual, Val: 1, SkipTrue: 1, SkipFalse: 1},
			bpf.RetConstant{Val: 0},
			bpf.RetConstant{Val: 1},
		}}, 1},
		{"JEQ K", [][]bpf.Instruction{jumpK(bpf.JumpEqual, 0x0800)}, 1},
		{"JNE K", [][]bpf.Instruction{jumpK(bpf.JumpNotEqual, 0x0800)}, 0},
		{"JGT K", [][]bpf.Instruction{jumpK(bpf.JumpGreaterThan, 0x07ff)}, 1},
		{"JLT K", [][]bpf.Instruction{jumpK(bpf.JumpLessThan, 0x0800)}, 0},
		{"JGE K", [][]bpf.Instruction{jumpK(bpf.JumpGreaterOrEqual, 0x0800)}, 1},
		{"JLE K", [][]bpf.Instruction{jumpK(bpf.JumpLessOrEqual, 0x07ff)}, 0},
		{"JSET K", [][]bpf.Instruction{jumpK(bpf.JumpBitsSet, 0x0c00)}, 1},
		{"JSET K clear", [][]bpf.Instruction{jumpK(bpf.JumpBitsNotSet, 0x0400)}, 1},
		{"JGT K unsigned", [][]bpf.Instruction{jumpK(bpf.JumpGreaterThan, 0x80000000)}, 0},
		{"JEQ X", [][]bpf.Instruction{jumpX(bpf.JumpEqual, 0x0800)}, 1},
		{"JNE X", [][]bpf.Instruction{jumpX(bpf.JumpNotEqual, 0x0800)}, 0},
		{"JGT X", [][]bpf.Instruction{jumpX(bpf.JumpGreaterThan, 0x0800)}, 0},
		{"JLT X", [][]bpf.Instruction{jumpX(bpf.JumpLessThan, 0x0801)}, 1},
		{"JGE X", [][]bpf.Instruction{jumpX(bpf.JumpGreaterOrEqual, 0x0801)}, 0},
		{"JLE X", [][]bpf.Instruction{jumpX(bpf.JumpLessOrEqual, 0x0800)}, 1},
		{"JSET X", [][]bpf.Instruction{jumpX(bpf.JumpBitsSet, 0x00ff)}, 0},
		{"JSET X clear", [][]bpf.Instruction{jumpX(bpf.JumpBitsNotSet, 0x00ff)}, 1},
		{"JGT X unsigned", [][]bpf.Instruction{jumpX(bpf.JumpGreaterThan, 0xffffffff)}, 0},
		{"LD IND X+K does not wrap", [][]bpf.Instruction{{
			bpf.LoadConstant{Dst: bpf.RegX, Val: 0xffffffff},
			bpf.LoadIndirect{Off: 13, Size: 1},
			bpf.RetConstant{Val: 1},
		}}, 0},
		{"LD IND", [][]bpf.Instruction{{
			bpf.LoadConstant{Dst: bpf.RegX, Val: 10},
			bpf.LoadIndirect{Off: 2, Size: 2},
			bpf.JumpIf{Cond: bpf.JumpEqual, Val: 0x0800, SkipTrue: 1},
			bpf.RetConstant{Val: 0},
			bpf.RetConstant{Val: 1},
		}}, 1},
		{"LD ABS beyond 2^31", [][]bpf.Instruction{{bpf.LoadAbsolute{Off: 0x80000000, Size: 1}, bpf.RetConstant{Val: 1}}}, 0},
		{"LD IND byte at the last byte", [][]bpf.Instruction{{bpf.LoadExtension{Num: bpf.ExtLen},
			bpf.ALUOpConstant{Op: bpf.ALUOpSub, Val: 1}, bpf.TAX{},
			bpf.LoadIndirect{Off: 0, Size: 1}, bpf.RetConstant{Val: 1}}}, 1},
		{"LD IND half at the last byte", [][]bpf.Instruction{{bpf.LoadExtension{Num: bpf.ExtLen},
			bpf.ALUOpConstant{Op: bpf.ALUOpSub, Val: 1}, bpf.TAX{},
			bpf.LoadIndirect{Off: 0, Size: 2}, bpf.RetConstant{Val: 1}}}, 0},
		{"LD ABS past the end", [][]bpf.Instruction{{bpf.LoadAbsolute{Off: 0xffff, Size: 4}, bpf.RetConstant{Val: 1}}}, 0},
		{"LD W", [][]bpf.Instruction{{
			bpf.LoadAbsolute{Off: 26, Size: 4}, // IPv4 source 10.0.0.1
			bpf.JumpIf{Cond: bpf.JumpEqual, Val: 0x0a000001, SkipTrue: 1},
			bpf.RetConstant{Val: 0},
			bpf.RetConstant{Val: 1},
		}}, 1},
		{"LDX MSH", [][]bpf.Instruction{aluIs(0, 20, bpf.LoadMemShift{Off: 14}, bpf.TXA{})}, 1},
		{"scratch starts at zero in every policy", [][]bpf.Instruction{
			{bpf.LoadConstant{Dst: bpf.RegA, Val: 7}, bpf.StoreScratch{Src: bpf.RegA, N: 3}, bpf.RetConstant{Val: 0}},
			{bpf.LoadScratch{Dst: bpf.RegA, N: 3}, bpf.RetA{}},
		}, 0},
		{"A and X start at zero in every policy", [][]bpf.Instruction{
			{bpf.LoadConstant{Dst: bpf.RegA, Val: 9}, bpf.TAX{}, bpf.RetConstant{Val: 0}},
			{bpf.TXA{}, bpf.RetA{}},
		}, 0},
		{"scratch round trip", [][]bpf.Instruction{aluIs(0, 0xdeadbeef,
			bpf.LoadConstant{Dst: bpf.RegX, Val: 0xdeadbeef}, bpf.StoreScratch{Src: bpf.RegX, N: 15},
			bpf.LoadScratch{Dst: bpf.RegA, N: 15})}, 1},
		{"NEG", [][]bpf.Instruction{aluIs(1, 0xffffffff, bpf.NegateA{})}, 1},
		{"DIV K unsigned", [][]bpf.Instruction{aluIs(0xffffffff, 1, bpf.ALUOpConstant{Op: bpf.ALUOpDiv, Val: 0x80000000})}, 1},
		{"MOD K", [][]bpf.Instruction{aluIs(17, 2, bpf.ALUOpConstant{Op: bpf.ALUOpMod, Val: 5})}, 1},
		{"MUL wraps at 32 bits", [][]bpf.Instruction{aluIs(0x80000001, 2, bpf.ALUOpConstant{Op: bpf.ALUOpMul, Val: 2})}, 1},
		{"ADD wraps at 32 bits", [][]bpf.Instruction{aluIs(0xffffffff, 1, bpf.ALUOpConstant{Op: bpf.ALUOpAdd, Val: 2})}, 1},
		{"SUB wraps at 32 bits", [][]bpf.Instruction{aluIs(1, 0xffffffff, bpf.ALUOpConstant{Op: bpf.ALUOpSub, Val: 2})}, 1},
		{"LSH K 32 or more", [][]bpf.Instruction{aluIs(1, 0, bpf.ALUOpConstant{Op: bpf.ALUOpShiftLeft, Val: 40})}, 1},
		{"RSH K 32 or more", [][]bpf.Instruction{aluIs(0xffffffff, 0, bpf.ALUOpConstant{Op: bpf.ALUOpShiftRight, Val: 32})}, 1},
		{"RSH X 32 to 63", [][]bpf.Instruction{aluIs(0xffffffff, 0,
			bpf.LoadConstant{Dst: bpf.RegX, Val: 33}, bpf.ALUOpX{Op: bpf.ALUOpShiftRight})}, 1},
		{"RSH X", [][]bpf.Instruction{aluIs(0x80000000, 0x100,
			bpf.LoadConstant{Dst: bpf.RegX, Val: 23}, bpf.ALUOpX{Op: bpf.ALUOpShiftRight})}, 1},
		{"ALU X", [][]bpf.Instruction{aluIs(6, 8, bpf.LoadConstant{Dst: bpf.RegX, Val: 3},
			// ((6+3)*3-3)/3 = 8; 8|3 = 11; 11&3 = 3; 3^3 = 0
			bpf.ALUOpX{Op: bpf.ALUOpAdd}, bpf.ALUOpX{Op: bpf.ALUOpMul}, bpf.ALUOpX{Op: bpf.ALUOpSub},
			bpf.ALUOpX{Op: bpf.ALUOpDiv}, bpf.ALUOpX{Op: bpf.ALUOpOr}, bpf.ALUOpX{Op: bpf.ALUOpAnd},
			bpf.ALUOpX{Op: bpf.ALUOpXor},
			// (0|10)%3 = 1; 1<<3 = 8
			bpf.ALUOpConstant{Op: bpf.ALUOpOr, Val: 10}, bpf.ALUOpX{Op: bpf.ALUOpMod},
			bpf.ALUOpX{Op: bpf.ALUOpShiftLeft})}, 1},
		{"ALU K", [][]bpf.Instruction{aluIs(6, 0x15,
			// 6&4 = 4; 4|1 = 5; 5<<4 = 80; 80>>2 = 20; 20^1 = 21
			bpf.ALUOpConstant{Op: bpf.ALUOpAnd, Val: 4}, bpf.ALUOpConstant{Op: bpf.ALUOpOr, Val: 1},
			bpf.ALUOpConstant{Op: bpf.ALUOpShiftLeft, Val: 4}, bpf.ALUOpConstant{Op: bpf.ALUOpShiftRight, Val: 2},
			bpf.ALUOpConstant{Op: bpf.ALUOpXor, Val: 1})}, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cs := rawPolicies(t, tc.progs...)
			b := syn80.bytes(t)
			if got := NewMatcher(cs).Verdict(b); got != tc.want {
				t.Errorf("Matcher verdict = %d, want %d", got, tc.want)
			}
			if got := loadClassifier(t, cs, true).verdict(t, b); got != tc.want {
				t.Errorf("eBPF verdict = %d, want %d", got, tc.want)
			}
		})
	}
}

func TestNewFilterRefuses(t *testing.T) {
	for _, tc := range []struct {
		name string
		prog []bpf.RawInstruction
		want string
	}{
		{"empty", nil, "empty program"},
		{"backward jump", []bpf.RawInstruction{{Op: 0x05, K: 0xffffffff}, {Op: 0x06, K: 1}}, "backward jump"},
		{"jump past the end", []bpf.RawInstruction{{Op: 0x05, K: 1}, {Op: 0x06, K: 1}}, "past program bounds"},
		{"falls off the end", []bpf.RawInstruction{{Op: 0x06, K: 1}, {Op: 0x00, K: 1}}, "must end with"},
		{"Linux extension", []bpf.RawInstruction{{Op: 0x20, K: 0xfffff000}, {Op: 0x16}}, "extension"},
		{"division by constant zero", []bpf.RawInstruction{{Op: 0x34, K: 0}, {Op: 0x16}}, "divide by zero"},
		{"unknown opcode", []bpf.RawInstruction{{Op: 0xff}, {Op: 0x16}}, "unsupported opcode"},
		{"too long", make([]bpf.RawInstruction, maxClassicInsns+1), "at most 4096"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := NewFilter(tc.name, tc.prog)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("NewFilter error = %v, want one containing %q", err, tc.want)
			}
		})
	}
}

func TestCompileErrors(t *testing.T) {
	for _, tc := range []struct {
		policy api.Policy
		want   string // the whole message when exact, else its beginning
		exact  bool
	}{
		{api.Policy{Name: "web", Filter: "tcp dst port"},
			`policy "web": filter "tcp dst port": can't parse filter expression: syntax error`, true},
		{api.Policy{Name: "web", Filter: "tcp and and port 80"},
			`policy "web": filter "tcp and and port 80": can't parse filter expression: syntax error`, true},
		// libpcap reads "prot" as a host name here; the message is
		// whatever the resolver says, so only its framing is checked.
		{api.Policy{Name: "web", Filter: "tcp dst prot 80"}, `policy "web": filter "tcp dst prot 80": `, false},
		{api.Policy{Name: "never", Filter: "tcp and not tcp"},
			`policy "never": filter "tcp and not tcp": expression rejects all packets`, true},
		{api.Policy{Name: "loop", Filter: "ip6 protochain 6"},
			`policy "loop": filter "ip6 protochain 6": libpcap output not supported: instruction`, false},
		{api.Policy{Name: "bcast", Filter: "ip broadcast"},
			`policy "bcast": filter "ip broadcast": netmask not known`, false},
		// Validate runs first and names the policy itself.
		{api.Policy{Name: "empty", Filter: "  "}, `policy "empty": empty filter`, false},
		{api.Policy{Name: "9bad", Filter: "tcp"}, `policy "9bad": name must`, false},
	} {
		t.Run(tc.policy.Filter, func(t *testing.T) {
			_, err := Compile(tc.policy)
			switch {
			case err == nil:
				t.Fatalf("Compile(%+v) succeeded", tc.policy)
			case tc.exact && err.Error() != tc.want,
				!tc.exact && (!strings.HasPrefix(err.Error(), tc.want) || len(err.Error()) == len(tc.want)):
				t.Errorf("Compile error\n got %q\nwant %q", err, tc.want)
			}
		})
	}
	if _, err := CompileFilter(""); err == nil {
		t.Error(`CompileFilter("") succeeded; libpcap would match everything`)
	}
}

func TestCompileAllStopsAtFirstError(t *testing.T) {
	_, err := CompileAll([]api.Policy{
		{Name: "ok", Filter: "tcp"},
		{Name: "bad", Filter: "tcp dst port"},
		{Name: "worse", Filter: "((("},
	})
	if err == nil || !strings.HasPrefix(err.Error(), `policy "bad": `) {
		t.Errorf("CompileAll error = %v, want the one of policy \"bad\"", err)
	}
	cs, err := CompileAll([]api.Policy{{Name: "a", Filter: "tcp"}, {Name: "b", Filter: "udp"}})
	if err != nil || len(cs) != 2 || cs[1].Policy.Name != "b" {
		t.Fatalf("CompileAll = %v, %v", cs, err)
	}
	p, ok := NewMatcher(cs).Match(syn80.bytes(t))
	if !ok || p.Name != "a" {
		t.Errorf("Match = %q, %v, want \"a\"", p.Name, ok)
	}
	udp := syn80
	udp.udp = true
	if p, ok := NewMatcher(cs[:1]).Match(udp.bytes(t)); ok {
		t.Errorf("Match of UDP frame against \"tcp\" = %q", p.Name)
	}
}

func TestCheckJumps(t *testing.T) {
	far := asm.Instructions{asm.Ja.Label("far")}
	for range 40000 {
		far = append(far, asm.Mov.Imm(asm.R0, 0))
	}
	far = append(far, asm.Return().WithSymbol("far"))
	if err := checkJumps(far); err == nil || !strings.Contains(err.Error(), "spans") {
		t.Errorf("checkJumps over 40000 instructions: %v, want a range error", err)
	}
	if err := checkJumps(far[:2]); err == nil || !strings.Contains(err.Error(), "undefined") {
		t.Errorf("checkJumps without the jump's label: %v", err)
	}
	near := asm.Instructions{asm.Ja.Label("near"), asm.Return().WithSymbol("near")}
	if err := checkJumps(near); err != nil {
		t.Errorf("checkJumps: %v", err)
	}
}
