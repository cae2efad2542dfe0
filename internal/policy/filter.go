package policy

import (
	"fmt"
	"strings"

	"github.com/gopacket/gopacket/layers"
	"github.com/gopacket/gopacket/pcap"
	"golang.org/x/net/bpf"
)

// snapLen is the capture length libpcap compiles filters for. It only shows
// up in the value that accepting RET instructions return; any non-zero value
// means "match" to us, so the largest Ethernet snap length is as good as any.
const snapLen = 65535

// maxClassicInsns is the kernel's limit on classic BPF programs (BPF_MAXINSNS).
// libpcap never gets near it for realistic filters.
const maxClassicInsns = 4096

// Filter is a tcpdump filter expression compiled by libpcap into classic BPF
// for Ethernet frames (DLT_EN10MB): packet offset 0 is the first byte of the
// destination MAC address. Make one with CompileFilter or NewFilter; a Filter
// built by hand has no user-space VM and matches nothing in Match.
type Filter struct {
	// Expr is the expression as the operator wrote it.
	Expr string
	// Insns is libpcap's optimised classic BPF program.
	Insns []bpf.RawInstruction

	// vm evaluates Insns in user space; built once at compile time because
	// it also validates the program (jump bounds, constant division by
	// zero, final RET) for the translator.
	vm *bpf.VM
}

// CompileFilter compiles a tcpdump filter expression with libpcap for
// Ethernet frames. Errors carry libpcap's message, for example
// `filter "tcp dst port": can't parse filter expression: syntax error`.
// Host and port names in expr are resolved now, as tcpdump does.
func CompileFilter(expr string) (Filter, error) {
	if strings.TrimSpace(expr) == "" {
		// libpcap accepts the empty expression as "match everything",
		// which is never what an operator meant by a policy.
		return Filter{}, fmt.Errorf("filter %q: empty expression", expr)
	}
	prog, err := pcap.CompileBPFFilter(layers.LinkTypeEthernet, snapLen, expr)
	if err != nil {
		return Filter{}, fmt.Errorf("filter %q: %v", expr, err)
	}
	raw := make([]bpf.RawInstruction, len(prog))
	for i, ins := range prog {
		raw[i] = bpf.RawInstruction{Op: ins.Code, Jt: ins.Jt, Jf: ins.Jf, K: ins.K}
	}
	f, err := NewFilter(expr, raw)
	if err != nil {
		// libpcap produced something we cannot run: a bug in libpcap or
		// a feature we do not translate, not an operator error.
		return Filter{}, fmt.Errorf("filter %q: libpcap output not supported: %v", expr, err)
	}
	return f, nil
}

// NewFilter wraps an already compiled classic BPF program, checking that both
// the user-space VM and the eBPF translator accept it; expr becomes Filter.Expr.
// Most callers want CompileFilter.
func NewFilter(expr string, insns []bpf.RawInstruction) (Filter, error) {
	decoded, err := decode(insns)
	if err != nil {
		return Filter{}, err
	}
	vm, err := bpf.NewVM(forVM(decoded))
	if err != nil {
		return Filter{}, err
	}
	// Translate once so that a filter that cannot become eBPF is refused
	// here, with the policy's name attached, and not later when the agent
	// rebuilds the whole classifier.
	if _, err := translate(decoded, labels{prefix: "check", match: "m", nomatch: "n"}); err != nil {
		return Filter{}, err
	}
	return Filter{Expr: expr, Insns: insns, vm: vm}, nil
}

// Match runs the filter on an Ethernet frame in user space with the classic
// BPF semantics the eBPF classifier implements (those of golang.org/x/net/bpf's
// VM): a load beyond the end of the frame, or a division or modulo by zero,
// rejects the frame; A, X and M[] start at 0; arithmetic wraps at 32 bits,
// except that shifts by 32 or more give 0 and X+K in indirect loads does not
// wrap.
func (f Filter) Match(frame []byte) bool {
	if f.vm == nil {
		return false
	}
	n, err := f.vm.Run(frame)
	// Run fails only on instructions NewVM has already refused.
	return err == nil && n != 0
}

// decode disassembles raw classic BPF and refuses what the translator does
// not handle (Linux ancillary loads other than the packet length, unknown
// opcodes). golang.org/x/net/bpf returns unknown opcodes as RawInstruction.
func decode(insns []bpf.RawInstruction) ([]bpf.Instruction, error) {
	if len(insns) == 0 {
		return nil, fmt.Errorf("empty program")
	}
	if len(insns) > maxClassicInsns {
		return nil, fmt.Errorf("%d instructions, at most %d are allowed", len(insns), maxClassicInsns)
	}
	out := make([]bpf.Instruction, len(insns))
	for pc, raw := range insns {
		ins := raw.Disassemble()
		switch ins := ins.(type) {
		case bpf.RawInstruction:
			return nil, fmt.Errorf("instruction %d: unsupported opcode %#04x", pc, ins.Op)
		case bpf.LoadExtension:
			if ins.Num != bpf.ExtLen {
				return nil, fmt.Errorf("instruction %d: unsupported Linux extension load %d", pc, ins.Num)
			}
		case bpf.Jump:
			if int32(ins.Skip) < 0 {
				// libpcap loops for "protochain"; neither the
				// kernel's classic BPF nor our translation allows it.
				return nil, fmt.Errorf("instruction %d: backward jump (a loop, as protochain generates)", pc)
			}
		}
		out[pc] = ins
	}
	return out, nil
}

// forVM adapts a decoded program to golang.org/x/net/bpf's VM, which does
// not implement NegateA: A*0xffffffff is -A modulo 2^32, and a one-for-one
// replacement keeps every jump offset valid.
func forVM(prog []bpf.Instruction) []bpf.Instruction {
	out := make([]bpf.Instruction, len(prog))
	for i, ins := range prog {
		if _, ok := ins.(bpf.NegateA); ok {
			ins = bpf.ALUOpConstant{Op: bpf.ALUOpMul, Val: 0xffffffff}
		}
		out[i] = ins
	}
	return out
}
