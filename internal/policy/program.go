package policy

import (
	"errors"
	"fmt"
	"math"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
)

// The contract between the datapath and the policy classifier. The datapath,
// on egress, tail-calls dysco_progs[ClassifierSlot] for a TCP SYN of no known
// session; the classifier writes its verdict into cb[0] and tail-calls
// dysco_progs[SetupSlot]. bpf/include/consts.h spells the same numbers
// PROG_POLICY, PROG_SETUP, CB_POLICY and MAX_POLICIES; a test compares them.
const (
	// ClassifierSlot is the prog-array index where the agent installs the
	// program BuildProgram describes.
	ClassifierSlot = 0
	// SetupSlot is the prog-array index of the datapath's session set-up
	// program, which the classifier tail-calls with its verdict.
	SetupSlot = 1
	// VerdictOffset is offsetof(struct __sk_buff, cb[0]), where the
	// classifier leaves its verdict: 0 for no policy, i+1 for policies[i].
	VerdictOffset = 48
	// MaxPolicies is the most policies one classifier holds: the size of
	// the datapath's dysco_policies array, and the number the tests load
	// through the verifier.
	MaxPolicies = 64

	// tcActOK and tcActShot are TC_ACT_OK and TC_ACT_SHOT.
	tcActOK   = 0
	tcActShot = 2
)

// programName is the kernel-visible name (at most 15 characters).
const programName = "dysco_policy"

// BuildProgram describes the policy classifier for policies, in order: a
// SchedCLS program that runs each policy's filter on the packet (starting at
// the Ethernet header) and stops at the first that accepts it.
//
// Runtime contract:
//   - cb[0] (VerdictOffset) = i+1 for the first policies[i] whose filter
//     accepts the packet, 0 when none does; cb[1..4] are left alone. A
//     filter that loads past the end of the packet or divides by zero
//     rejects it, and evaluation goes on with the next policy (see
//     Filter.Match for the rest of the semantics).
//   - Then tail call progs[SetupSlot]. If that fails (empty slot) the
//     program returns TC_ACT_SHOT when a policy matched, so that a session a
//     policy sends through a middlebox never bypasses it, and TC_ACT_OK
//     otherwise.
//
// The spec refers to progs, which must stay open until the program is
// loaded. The kernel lets only programs with the same type and expected
// attach type share a prog array: set the spec's AttachType to the
// datapath's if the datapath programs have one.
//
// The verdicts are for the policy slots from base on: policies[i] gives
// base+i+1. The datapath keeps two banks of MaxPolicies slots, and the
// agent builds each new classifier for the bank the installed one does not
// use (datapath.InstallPolicies).
func BuildProgram(policies []Compiled, progs *ebpf.Map, base int) (*ebpf.ProgramSpec, error) {
	if base < 0 || base%MaxPolicies != 0 || base >= 0xffff-MaxPolicies {
		return nil, fmt.Errorf("policy classifier: first slot %d is not the start of a bank", base)
	}
	if progs == nil {
		return nil, errors.New("policy classifier: nil prog array")
	}
	if progs.Type() != ebpf.ProgramArray || progs.MaxEntries() <= SetupSlot {
		return nil, fmt.Errorf("policy classifier: map %v is not a prog array with at least %d entries", progs, SetupSlot+1)
	}
	if len(policies) > MaxPolicies {
		return nil, fmt.Errorf("policy classifier: %d policies, at most %d are supported", len(policies), MaxPolicies)
	}

	e := newEmitter()
	e.add(asm.Mov.Reg(regCtx, asm.R1))
	for i, p := range policies {
		name := p.Policy.Name
		prog, err := decode(p.Filter.Insns)
		if err != nil {
			return nil, fmt.Errorf("policy %q: filter %q: %w", name, p.Filter.Expr, err)
		}
		l := labels{
			prefix:  policyLabel(i),
			match:   policyLabel(i) + ".match",
			nomatch: policyLabel(i + 1),
		}
		if i == len(policies)-1 {
			l.nomatch = "nomatch"
		}
		t, err := translate(prog, l)
		if err != nil {
			return nil, fmt.Errorf("policy %q: filter %q: %w", name, p.Filter.Expr, err)
		}
		e.add(t.insns...)
		if t.matches {
			e.label(l.match)
			if err := e.verdict(uint32(base+i+1), tcActShot, progs); err != nil {
				return nil, err
			}
		}
		if !t.fails {
			// This policy accepts every packet: the policies after it
			// and the no-match exit are unreachable, and the verifier
			// refuses unreachable instructions.
			return newSpec(e.insns)
		}
	}
	if len(policies) > 0 {
		e.label("nomatch")
	}
	if err := e.verdict(0, tcActOK, progs); err != nil {
		return nil, err
	}
	return newSpec(e.insns)
}

func policyLabel(i int) string { return fmt.Sprintf("p%d", i) }

// verdict emits: cb[0] = v; tail_call(ctx, progs, SetupSlot); return onFail.
func (e *emitter) verdict(v uint32, onFail int32, progs *ebpf.Map) error {
	ld := asm.LoadMapPtr(asm.R2, progs.FD())
	if err := ld.AssociateMap(progs); err != nil {
		return err
	}
	e.add(
		// BPF_ST into the context is not allowed; store a register.
		asm.Mov.Imm32(asm.R1, int32(v)),
		asm.StoreMem(regCtx, VerdictOffset, asm.R1, asm.Word),
		asm.Mov.Reg(asm.R1, regCtx),
		ld,
		asm.Mov.Imm(asm.R3, SetupSlot),
		asm.FnTailCall.Call(),
		asm.Mov.Imm(asm.R0, onFail),
		asm.Return(),
	)
	return nil
}

func newSpec(insns asm.Instructions) (*ebpf.ProgramSpec, error) {
	if err := checkJumps(insns); err != nil {
		return nil, fmt.Errorf("policy classifier: %w", err)
	}
	return &ebpf.ProgramSpec{
		Name:         programName,
		Type:         ebpf.SchedCLS,
		Instructions: insns,
		// bpf_tail_call and bpf_skb_load_bytes are GPL-only helpers.
		License: "Dual MIT/GPL",
	}, nil
}

// checkJumps makes sure every labelled jump fits the 16-bit offset of an eBPF
// jump; cilium/ebpf would truncate a longer one silently. Jumps stay within
// one policy (or to the code right after it), so only a single enormous
// filter can exceed the range.
func checkJumps(insns asm.Instructions) error {
	symbols := map[string]asm.RawInstructionOffset{}
	for it := insns.Iterate(); it.Next(); {
		if s := it.Ins.Symbol(); s != "" {
			symbols[s] = it.Offset
		}
	}
	for it := insns.Iterate(); it.Next(); {
		ref := it.Ins.Reference()
		if ref == "" || !it.Ins.OpCode.Class().IsJump() {
			continue
		}
		target, ok := symbols[ref]
		if !ok {
			return fmt.Errorf("jump to undefined label %q", ref)
		}
		if d := int64(target) - int64(it.Offset) - 1; d < math.MinInt16 || d > math.MaxInt16 {
			return fmt.Errorf("jump to %q spans %d instructions, more than an eBPF jump can", ref, d)
		}
	}
	return nil
}
