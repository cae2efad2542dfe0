package policy

import (
	"fmt"

	"github.com/cilium/ebpf/asm"
	"golang.org/x/net/bpf"
)

// Register and stack allocation of the translated classic BPF machine. The
// classic registers live in callee-saved eBPF registers so that the
// bpf_skb_load_bytes calls behind packet loads (which clobber R0-R5) leave
// them alone.
const (
	regCtx = asm.R6 // *__sk_buff, needed by every helper call
	regA   = asm.R7 // classic accumulator A, always zero-extended 32 bits
	regX   = asm.R8 // classic index register X, always zero-extended 32 bits

	// scratchOff is the frame offset of M[0]; M[n] is at scratchOff-8*n.
	// Each 32-bit cell gets its own 8-byte slot so that the verifier tracks
	// every cell as a separate stack slot.
	scratchOff = -8
	// loadBufOff is the frame offset of the 8-byte buffer bpf_skb_load_bytes
	// copies packet bytes into, below the 16 scratch slots.
	loadBufOff = scratchOff - 8*16

	// skbLenOff is offsetof(struct __sk_buff, len): classic BPF's "len".
	skbLenOff = 0
	// maxLoadOffset is the largest offset bpf_skb_load_bytes accepts
	// (INT_MAX); it is also far beyond any real frame.
	maxLoadOffset = 0x7fffffff
)

// labels names the places a translated filter jumps to when it is done.
type labels struct {
	prefix  string // makes this filter's internal labels unique in the program
	match   string // jumped to when the filter accepts the packet
	nomatch string // jumped to when it rejects it, or a load or division fails
}

func (l labels) pc(pc int) string { return fmt.Sprintf("%s.%d", l.prefix, pc) }

// emitter accumulates eBPF instructions. A symbol set with label is attached
// to the next instruction added, so a classic instruction's label lands on
// the first eBPF instruction of its translation.
type emitter struct {
	insns asm.Instructions
	sym   string
	refs  map[string]bool // labels jumped to so far
}

func newEmitter() *emitter { return &emitter{refs: map[string]bool{}} }

func (e *emitter) label(name string) {
	if e.sym != "" {
		// Two labels on one instruction would silently lose one.
		panic(fmt.Sprintf("policy: labels %q and %q on the same instruction", e.sym, name))
	}
	e.sym = name
}

func (e *emitter) add(insns ...asm.Instruction) {
	for _, ins := range insns {
		if e.sym != "" {
			ins = ins.WithSymbol(e.sym)
			e.sym = ""
		}
		if ref := ins.Reference(); ref != "" {
			e.refs[ref] = true
		}
		e.insns = append(e.insns, ins)
	}
}

// translation is one classic filter in eBPF form.
type translation struct {
	insns asm.Instructions
	// matches and fails report whether the code can reach the match and
	// nomatch labels. The caller must not emit unreachable code after it:
	// the verifier rejects programs with unreachable instructions.
	matches, fails bool
}

// translate converts a decoded classic BPF program into eBPF that starts from
// A = X = 0 and ends by jumping to l.match or l.nomatch; it never falls
// through. It expects regCtx to hold the context pointer.
//
// Semantics follow golang.org/x/net/bpf's VM, which Filter.Match uses, so
// that user space and the kernel always agree:
//   - a packet load past the end of the frame rejects the packet, as does a
//     division or modulo by X == 0 (classic BPF aborts with return 0);
//   - shifts by 32 or more give 0 (Go semantics; eBPF would mask the count);
//   - LD IND computes X+K without 32-bit wrap-around;
//   - the scratch cells M[] start at 0.
func translate(prog []bpf.Instruction, l labels) (translation, error) {
	reach, err := reachable(prog)
	if err != nil {
		return translation{}, err
	}

	e := newEmitter()
	e.label(l.prefix)
	e.add(
		asm.Mov.Imm32(regA, 0),
		asm.Mov.Imm32(regX, 0),
	)
	// Give the scratch cells the program reads a defined value: the VM
	// starts them at zero, a read of a never-written stack slot is refused
	// without CAP_PERFMON, and a value an earlier policy left behind would
	// both leak into this one and defeat the verifier's state pruning
	// between policies.
	var zeroed [16]bool
	for pc, ins := range prog {
		ls, ok := ins.(bpf.LoadScratch)
		if ok && reach[pc] && ls.N >= 0 && ls.N < len(zeroed) && !zeroed[ls.N] {
			zeroed[ls.N] = true
			e.add(asm.StoreImm(asm.RFP, scratchSlot(ls.N), 0, asm.Word))
		}
	}

	for pc, ins := range prog {
		if !reach[pc] {
			continue
		}
		e.label(l.pc(pc))
		if err := e.instruction(pc, ins, l); err != nil {
			return translation{}, fmt.Errorf("instruction %d (%v): %w", pc, ins, err)
		}
	}
	return translation{insns: e.insns, matches: e.refs[l.match], fails: e.refs[l.nomatch]}, nil
}

// reachable marks the instructions reachable from the entry point and checks
// that control never leaves the program except through a RET.
func reachable(prog []bpf.Instruction) ([]bool, error) {
	n := len(prog)
	if n == 0 {
		return nil, fmt.Errorf("empty program")
	}
	reach := make([]bool, n)
	reach[0] = true
	mark := func(pc, target int) error {
		if target >= n {
			return fmt.Errorf("instruction %d: jump or fall-through past the end of the program", pc)
		}
		reach[target] = true
		return nil
	}
	for pc := 0; pc < n; pc++ {
		if !reach[pc] {
			continue
		}
		var err error
		switch ins := prog[pc].(type) {
		case bpf.RetA, bpf.RetConstant:
		case bpf.Jump:
			err = mark(pc, pc+1+int(ins.Skip))
		case bpf.JumpIf:
			err = mark(pc, pc+1+int(ins.SkipTrue))
			if err == nil {
				err = mark(pc, pc+1+int(ins.SkipFalse))
			}
		case bpf.JumpIfX:
			err = mark(pc, pc+1+int(ins.SkipTrue))
			if err == nil {
				err = mark(pc, pc+1+int(ins.SkipFalse))
			}
		default:
			err = mark(pc, pc+1)
		}
		if err != nil {
			return nil, err
		}
	}
	return reach, nil
}

func scratchSlot(n int) int16 { return int16(scratchOff - 8*n) }

// reg maps a classic register to its eBPF register.
func reg(r bpf.Register) asm.Register {
	if r == bpf.RegX {
		return regX
	}
	return regA
}

func (e *emitter) instruction(pc int, ins bpf.Instruction, l labels) error {
	next := l.pc(pc + 1)
	switch ins := ins.(type) {
	case bpf.LoadConstant:
		e.add(asm.Mov.Imm32(reg(ins.Dst), int32(ins.Val)))
	case bpf.LoadScratch:
		if ins.N < 0 || ins.N > 15 {
			return fmt.Errorf("scratch cell %d out of range", ins.N)
		}
		e.add(asm.LoadMem(reg(ins.Dst), asm.RFP, scratchSlot(ins.N), asm.Word))
	case bpf.StoreScratch:
		if ins.N < 0 || ins.N > 15 {
			return fmt.Errorf("scratch cell %d out of range", ins.N)
		}
		e.add(asm.StoreMem(asm.RFP, scratchSlot(ins.N), reg(ins.Src), asm.Word))
	case bpf.LoadExtension:
		if ins.Num != bpf.ExtLen {
			return fmt.Errorf("unsupported extension %d", ins.Num)
		}
		e.add(asm.LoadMem(regA, regCtx, skbLenOff, asm.Word))
	case bpf.LoadAbsolute:
		return e.loadPacket(regA, ins.Size, ins.Off, false, l.nomatch)
	case bpf.LoadIndirect:
		return e.loadPacket(regA, ins.Size, ins.Off, true, l.nomatch)
	case bpf.LoadMemShift:
		if err := e.loadPacket(regX, 1, ins.Off, false, l.nomatch); err != nil {
			return err
		}
		e.add(
			asm.And.Imm32(regX, 0xf),
			asm.LSh.Imm32(regX, 2),
		)
	case bpf.TAX:
		e.add(asm.Mov.Reg32(regX, regA))
	case bpf.TXA:
		e.add(asm.Mov.Reg32(regA, regX))
	case bpf.NegateA:
		e.add(asm.Neg.Imm32(regA, 0))
	case bpf.ALUOpConstant:
		return e.aluConstant(ins)
	case bpf.ALUOpX:
		return e.aluX(ins, l, pc, next)
	case bpf.Jump:
		e.add(asm.Ja.Label(l.pc(pc + 1 + int(ins.Skip))))
	case bpf.JumpIf:
		op, t, f, err := condition(ins.Cond, pc+1+int(ins.SkipTrue), pc+1+int(ins.SkipFalse))
		if err != nil {
			return err
		}
		e.add(op.Imm32(regA, int32(ins.Val), l.pc(t)))
		if f != pc+1 {
			e.add(asm.Ja.Label(l.pc(f)))
		}
	case bpf.JumpIfX:
		op, t, f, err := condition(ins.Cond, pc+1+int(ins.SkipTrue), pc+1+int(ins.SkipFalse))
		if err != nil {
			return err
		}
		e.add(op.Reg32(regA, regX, l.pc(t)))
		if f != pc+1 {
			e.add(asm.Ja.Label(l.pc(f)))
		}
	case bpf.RetConstant:
		if ins.Val != 0 {
			e.add(asm.Ja.Label(l.match))
		} else {
			e.add(asm.Ja.Label(l.nomatch))
		}
	case bpf.RetA:
		e.add(
			asm.JNE.Imm32(regA, 0, l.match),
			asm.Ja.Label(l.nomatch),
		)
	default:
		return fmt.Errorf("unsupported instruction %T", ins)
	}
	return nil
}

// condition maps a classic jump test to an eBPF jump taken towards t, with f
// as the other target. eBPF has no "bits not set" jump, so that test jumps
// on JSET with the targets swapped.
func condition(c bpf.JumpTest, t, f int) (asm.JumpOp, int, int, error) {
	switch c {
	case bpf.JumpEqual:
		return asm.JEq, t, f, nil
	case bpf.JumpNotEqual:
		return asm.JNE, t, f, nil
	case bpf.JumpGreaterThan:
		return asm.JGT, t, f, nil
	case bpf.JumpLessThan:
		return asm.JLT, t, f, nil
	case bpf.JumpGreaterOrEqual:
		return asm.JGE, t, f, nil
	case bpf.JumpLessOrEqual:
		return asm.JLE, t, f, nil
	case bpf.JumpBitsSet:
		return asm.JSet, t, f, nil
	case bpf.JumpBitsNotSet:
		return asm.JSet, f, t, nil
	}
	return 0, 0, 0, fmt.Errorf("unknown jump test %d", c)
}

// aluOps maps the classic ALU operations to eBPF; all are done on the 32-bit
// subregisters, which wrap like classic BPF's uint32 and zero the upper half.
var aluOps = map[bpf.ALUOp]asm.ALUOp{
	bpf.ALUOpAdd:        asm.Add,
	bpf.ALUOpSub:        asm.Sub,
	bpf.ALUOpMul:        asm.Mul,
	bpf.ALUOpDiv:        asm.Div,
	bpf.ALUOpOr:         asm.Or,
	bpf.ALUOpAnd:        asm.And,
	bpf.ALUOpShiftLeft:  asm.LSh,
	bpf.ALUOpShiftRight: asm.RSh,
	bpf.ALUOpMod:        asm.Mod,
	bpf.ALUOpXor:        asm.Xor,
}

func (e *emitter) aluConstant(ins bpf.ALUOpConstant) error {
	op, ok := aluOps[ins.Op]
	if !ok {
		return fmt.Errorf("unknown ALU operation %d", ins.Op)
	}
	switch {
	case (ins.Op == bpf.ALUOpDiv || ins.Op == bpf.ALUOpMod) && ins.Val == 0:
		// The classic checkers refuse this program outright; so do we.
		return fmt.Errorf("division by constant zero")
	case (ins.Op == bpf.ALUOpShiftLeft || ins.Op == bpf.ALUOpShiftRight) && ins.Val >= 32:
		// The verifier refuses out-of-range constant shifts.
		e.add(asm.Mov.Imm32(regA, 0))
	default:
		// Immediates are 32 bits in 32-bit eBPF operations, so the
		// int32 conversion keeps K's bit pattern, and DIV/MOD treat it
		// as unsigned.
		e.add(op.Imm32(regA, int32(ins.Val)))
	}
	return nil
}

func (e *emitter) aluX(ins bpf.ALUOpX, l labels, pc int, next string) error {
	op, ok := aluOps[ins.Op]
	if !ok {
		return fmt.Errorf("unknown ALU operation %d", ins.Op)
	}
	switch ins.Op {
	case bpf.ALUOpDiv, bpf.ALUOpMod:
		// eBPF defines x/0 as 0 and x%0 as x; classic BPF aborts the
		// filter, which rejects the packet.
		e.add(
			asm.JEq.Imm32(regX, 0, l.nomatch),
			op.Reg32(regA, regX),
		)
	case bpf.ALUOpShiftLeft, bpf.ALUOpShiftRight:
		// eBPF masks the shift count; make counts of 32 or more give 0.
		inRange := fmt.Sprintf("%s.%d.shift", l.prefix, pc)
		e.add(
			asm.JLT.Imm32(regX, 32, inRange),
			asm.Mov.Imm32(regA, 0),
			asm.Ja.Label(next),
			op.Reg32(regA, regX).WithSymbol(inRange),
		)
	default:
		e.add(op.Reg32(regA, regX))
	}
	return nil
}

// loadPacket emits dst = big-endian packet bytes [off(+X), off(+X)+size),
// jumping to fail when they are not all inside the packet. Direct packet
// access would need a bounds check the verifier can follow for every variable
// offset; bpf_skb_load_bytes checks the bounds itself, and also reads
// non-linear (paged) skb data.
func (e *emitter) loadPacket(dst asm.Register, size int, off uint32, indirect bool, fail string) error {
	var width asm.Size
	switch size {
	case 1:
		width = asm.Byte
	case 2:
		width = asm.Half
	case 4:
		width = asm.Word
	default:
		return fmt.Errorf("invalid load size %d", size)
	}
	// w2 = K zero-extends, so offsets of 2^31 and more stay large and
	// make the helper fail instead of turning negative.
	e.add(asm.Mov.Imm32(asm.R2, int32(off)))
	if indirect {
		// X and K are both zero-extended, so the 64-bit sum cannot wrap;
		// the helper takes a u32 offset, so refuse what does not fit.
		e.add(
			asm.Add.Reg(asm.R2, regX),
			asm.JGT.Imm(asm.R2, maxLoadOffset, fail),
		)
	}
	e.add(
		asm.Mov.Reg(asm.R1, regCtx),
		asm.Mov.Reg(asm.R3, asm.RFP),
		asm.Add.Imm(asm.R3, loadBufOff),
		asm.Mov.Imm(asm.R4, int32(size)),
		asm.FnSkbLoadBytes.Call(),
		asm.JNE.Imm(asm.R0, 0, fail),
		asm.LoadMem(dst, asm.RFP, loadBufOff, width),
	)
	if size > 1 {
		// Packet bytes are in network order; HostTo(BE) is the same
		// swap in both directions and zero-extends the result.
		e.add(asm.HostTo(asm.BE, dst, width))
	}
	return nil
}
