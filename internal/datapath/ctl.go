package datapath

// The control program (dysco_ctl): several map changes in one run, from
// user space through BPF_PROG_TEST_RUN.

import (
	"fmt"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"
)

// ctl runs a command of dysco_ctl in the kernel.
func (d objects) ctl(op uint32, k *Tuple, tp *TPKey, arg uint32) error {
	a := dyscoCtlArgs{Op: op, Arg: arg}
	if k != nil {
		a.Key = *k
	}
	if tp != nil {
		a.Tp = *tp
	}
	return d.ctlArgs(a)
}

func (d objects) ctlArgs(a dyscoCtlArgs) error {
	_, err := d.ctlRun(a)
	return err
}

// progRunAttr is the BPF_PROG_TEST_RUN part of union bpf_attr
// (include/uapi/linux/bpf.h, "test").
type progRunAttr struct {
	progFD      uint32
	retval      uint32
	dataSizeIn  uint32
	dataSizeOut uint32
	dataIn      uint64
	dataOut     uint64
	repeat      uint32
	duration    uint32
	ctxSizeIn   uint32
	ctxSizeOut  uint32
	ctxIn       unsafe.Pointer
	ctxOut      uint64
	flags       uint32
	cpu         uint32
	batchSize   uint32
	_           uint32
}

// ctlRun runs dysco_ctl and returns its non-negative result.
//
// One bpf system call, not cilium/ebpf's Program.Run: that masks SIGPROF
// around every run (two more system calls and the thread locked), because a
// test run of packet programs stops at a pending signal. A syscall program's
// run (bpf_prog_test_run_syscall) runs it once and never checks for
// signals; EINTR is retried all the same.
func (d objects) ctlRun(a dyscoCtlArgs) (int, error) {
	// The struct's own memory (bpf2go lays it out as C does, padding
	// included: TestCtlArgsLayout): no encoding/binary reflection, which
	// cost microseconds per call.
	attr := progRunAttr{progFD: uint32(d.objs.DyscoCtl.FD()), ctxSizeIn: uint32(unsafe.Sizeof(a)), ctxIn: unsafe.Pointer(&a)}
	for {
		_, _, errno := unix.Syscall(unix.SYS_BPF, unix.BPF_PROG_TEST_RUN, uintptr(unsafe.Pointer(&attr)), unsafe.Sizeof(attr))
		if errno == unix.EINTR {
			continue
		}
		if errno != 0 {
			return 0, fmt.Errorf("datapath: control program: %w", errno)
		}
		break
	}
	if r := int32(attr.retval); r < 0 {
		return 0, syscall.Errno(-r)
	}
	return int(int32(attr.retval)), nil
}

// objects is what every group of maps shares: the loaded programs and maps,
// with the control program that changes several maps in one run.
type objects struct{ objs *dyscoObjects }
