package datapath

import (
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"syscall"
	"unsafe"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/ringbuf"
	"golang.org/x/sys/unix"
)

// Two-path phase of a reconfiguration (paper §3.5): mirrors of consts.h.
const (
	TPIdle     = 0 // new subsession installed; everything still on the old path
	TPStarting = 1 // the cut-off is being taken
	TPActive   = 2 // two paths: the cut-off tables
	TPNew      = 3 // everything on the new path

	// Progress bits of a TPEvent.
	TPBActive    = 1 << 0
	TPBSendDone  = 1 << 1
	TPBRcvdAcked = 1 << 2
	TPBNewRcvd   = 1 << 3
	TPBNewAtOld  = 1 << 4

	ctlFlagsSet   = 1
	ctlFlagsClear = 2
	ctlTPStart    = 3
	ctlTPState    = 4
	ctlTPClamp    = 5
	ctlMarksMerge = 6
	ctlFree       = 7
	ctlCut        = 8
	ctlFreeReconf = 9
	ctlAddSub     = 10
	ctlClosed     = 11

	evProgress = 1
)

// TPKey names one side of a session (0 left, 1 right).
type TPKey = dyscoTpKey

// TPVal is the two-path record of a side.
type TPVal = dyscoTpVal

// TPEvent is a notice from the datapath: the progress summary of a side in
// its two-path phase changed.
type TPEvent struct {
	SessID uint32
	Side   uint32
	Bits   uint32
}

// MergeMarks raises the marks of flow to to those of flow from (both in
// session space): a side's new ingress flow inherits what its old one saw.
func (d *Datapath) MergeMarks(from, to Tuple) error {
	return d.ctlArgs(dyscoCtlArgs{Op: ctlMarksMerge, Key: from, Key2: to})
}

// ctl runs a command of dysco_ctl in the kernel.
func (d *Datapath) ctl(op uint32, k *Tuple, tp *TPKey, arg uint32) error {
	a := dyscoCtlArgs{Op: op, Arg: arg}
	if k != nil {
		a.Key = *k
	}
	if tp != nil {
		a.Tp = *tp
	}
	return d.ctlArgs(a)
}

func (d *Datapath) ctlArgs(a dyscoCtlArgs) error {
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
func (d *Datapath) ctlRun(a dyscoCtlArgs) (int, error) {
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

// FreeSession deletes session id and everything of it at this host in one
// run of the control program (some thirty map operations from user space):
// its flows, found from its tuple and its two-path records and each only if
// it is still the session's (a newer session may reuse a tuple), with their
// deltas; its two-path records, the requests behind them, a kept lock and
// joined sessions (Splice); its set-up state; the session. onward is the
// key of the session's egress flow of the SYN's direction where that is not
// its tuple (behind a NAT: the middlebox's output; the agent's onward), the
// zero Tuple otherwise. It returns how many flows went.
func (d *Datapath) FreeSession(id uint32, onward Tuple) (int, error) {
	return d.ctlRun(dyscoCtlArgs{Op: ctlFree, Key: onward, Tp: TPKey{SessId: id}})
}

// MarkClosed records in session id's state FINs that this host did not
// see (StFINFwd, StFINRev in dirs; other bits are ignored), and restarts
// its idle time: the collector then ends it the close linger from now, as
// if the FINs had passed. A middlebox that joined a new path misses the
// FINs that the old path carried.
func (d *Datapath) MarkClosed(id uint32, dirs uint32) error {
	return d.ctlArgs(dyscoCtlArgs{Op: ctlClosed, Tp: TPKey{SessId: id}, Arg: dirs, Stamp: Now()})
}

// CutSession cuts this host off session id, in one run of the control
// program: the session's ingress flows go (with their deltas), its egress
// flows get FlDrop; the session stays. Flows are found as FreeSession finds
// them (onward as there). It returns how many flows were the session's.
func (d *Datapath) CutSession(id uint32, onward Tuple) (int, error) {
	return d.ctlRun(dyscoCtlArgs{Op: ctlCut, Key: onward, Tp: TPKey{SessId: id}})
}

// Flow returns the flow at key k.
func (d *Datapath) Flow(k Tuple) (Flow, bool) {
	f, err := d.lookupFlow(k)
	return f, err == nil
}

// AddFlow installs a new flow; an existing flow at k is an error.
func (d *Datapath) AddFlow(k Tuple, f Flow) error {
	if err := d.PutFlow(k, f, ebpf.UpdateNoExist); err != nil {
		if errors.Is(err, ebpf.ErrKeyExist) {
			return fmt.Errorf("datapath: flow %s exists", k)
		}
		return fmt.Errorf("datapath: add flow %s: %w", k, err)
	}
	return nil
}

// AddSubsession installs the new subsession of side k in one run of the
// control program (add_sub in bpf/include/control.h), where the agent made six map
// operations: the request behind it (req, for an agent that restarts), the
// side's two-path record tp, the translation delta and the flow f of the
// new subsession's ingress at in, and the flags that point the side's
// egress flow (tp.EgKey) and its old ingress flow (tp.InOld) at the record.
// reqKept is false when everything but the request was installed. On an
// error the steps before the failing one stay, as they did one by one.
func (d *Datapath) AddSubsession(k TPKey, in Tuple, f Flow, delta Delta, tp TPVal, req TPReq) (reqKept bool, err error) {
	r, err := d.ctlRun(dyscoCtlArgs{Op: ctlAddSub, Key: in, Tp: k, Flow: f, Delta: delta, Tpv: tp, Req: req})
	switch {
	case errors.Is(err, syscall.EEXIST):
		return false, fmt.Errorf("datapath: flow %s exists", in)
	case err != nil:
		return false, fmt.Errorf("datapath: add the subsession of session %d side %d: %w", k.SessId, k.Side, err)
	}
	return r == 0, nil
}

// PutDelta sets the sequence translation of the flow at k (applied when
// the flow has FlDelta).
func (d *Datapath) PutDelta(k Tuple, v Delta) error {
	return d.objs.DyscoDeltas.Update(&k, &v, ebpf.UpdateAny)
}

// DeleteDelta removes the translation of the flow at k.
func (d *Datapath) DeleteDelta(k Tuple) { _ = d.objs.DyscoDeltas.Delete(&k) }

// PutTwoPath writes a side's two-path record. Only before the side's flows
// point at it (FlTPOut, FlTPOld, FlTPNew); afterwards the datapath owns the
// variables and the agent changes the record through StartTwoPath,
// SetTwoPathState and SetWindowClamp only.
func (d *Datapath) PutTwoPath(k TPKey, v TPVal) error {
	return d.objs.DyscoTp.Update(&k, &v, ebpf.UpdateAny)
}

// TwoPath reads a side's two-path record.
func (d *Datapath) TwoPath(k TPKey) (TPVal, bool) {
	var v TPVal
	err := d.objs.DyscoTp.Lookup(&k, &v)
	return v, err == nil
}

// DeleteTwoPath removes a side's two-path record and the request behind it.
func (d *Datapath) DeleteTwoPath(k TPKey) {
	_ = d.objs.DyscoTp.Delete(&k)
	_ = d.objs.DyscoTpReq.Delete(&k)
}

// TPReq is the request behind a side's two-path record (bpf struct
// tp_req): what an agent needs to resume the side's reconfiguration after
// it restarts.
type TPReq = dyscoTpReq

// Roles of TPReq.
const (
	TPReqLeftAnchor  = 1
	TPReqRightAnchor = 2
	// TPReqMiddle: the request a middle agent of the old path is locked
	// for (protocol.KeepLock), kept under the session's TPSideLock key.
	TPReqMiddle = 3
)

// TPReqSplice: a proxy's two joined sessions (Splice), kept under the
// client session's TPSideSplice key.
const TPReqSplice = 4

// TPSideLock is the Side of the TPKey under which a middle agent keeps the
// lock it holds (TPReqMiddle); sides 0 and 1 are the session's own.
const TPSideLock = 2

// TPSideSplice is the Side of the TPKey under which a proxy's agent keeps
// the sessions it joined (TPReqSplice).
const TPSideSplice = 3

// Splice is what a proxy's agent keeps of the two TCP sessions it joined
// into one (paper §2.4, §4.2; internal/reconfig/splice.go), so that a restarted agent
// can take the joined session up again: the session the client opened to
// the proxy (Client), the one the proxy opened to the server (Server), the
// proxy's own delta (protocol.AppDelta): sequence number and timestamp
// left to right (SeqLR, TSLR) and right to left (SeqRL, TSRL); the two
// sessions' CreatedMs (Session.CreatedMs), which tell that the ids still
// name them; and whether the left anchor answered the proxy's trigger.
type Splice struct {
	Client, Server                   uint32
	SeqLR, TSLR, SeqRL, TSRL         uint32
	ClientCreatedMs, ServerCreatedMs uint32
	Answered                         bool
}

// PutSplice keeps a proxy's joined sessions until the client's session is
// freed (FreeSession) or its reconfiguration state is (DeleteReconfigState,
// DeleteReconfigStates): when the old path through the proxy is torn down,
// or when either session ends.
func (d *Datapath) PutSplice(sp Splice) error {
	v := TPReq{Role: TPReqSplice, PeerId: sp.Server, App: [4]uint32{sp.SeqLR, sp.TSLR, sp.SeqRL, sp.TSRL},
		CreatedMs: [2]uint32{sp.ClientCreatedMs, sp.ServerCreatedMs}}
	if sp.Answered {
		v.Answered = 1
	}
	return d.objs.DyscoTpReq.Update(&TPKey{SessId: sp.Client, Side: TPSideSplice}, &v, ebpf.UpdateAny)
}

// SpliceAnswered notes in the joined sessions kept for client session id
// that the left anchor answered the proxy's trigger. ENOENT if none are
// kept.
func (d *Datapath) SpliceAnswered(id uint32) error {
	k := TPKey{SessId: id, Side: TPSideSplice}
	var v TPReq
	if err := d.objs.DyscoTpReq.Lookup(&k, &v); err != nil {
		return err
	}
	if v.Role != TPReqSplice {
		return fmt.Errorf("datapath: the request kept under %d/%d is not a splice", id, TPSideSplice)
	}
	v.Answered = 1
	return d.objs.DyscoTpReq.Update(&k, &v, ebpf.UpdateExist)
}

// DeleteSplice forgets the joined sessions kept for client session id.
func (d *Datapath) DeleteSplice(id uint32) {
	_ = d.objs.DyscoTpReq.Delete(&TPKey{SessId: id, Side: TPSideSplice})
}

// EachSplice calls fn for every proxy's joined sessions kept by PutSplice
// (read at agent start only).
func (d *Datapath) EachSplice(fn func(Splice)) error {
	return eachBatch(d.objs.DyscoTpReq, "joined sessions", &batchBufs[TPKey, TPReq]{}, func(k *TPKey, v *TPReq) {
		if k.Side == TPSideSplice && v.Role == TPReqSplice {
			fn(Splice{Client: k.SessId, Server: v.PeerId, SeqLR: v.App[0], TSLR: v.App[1], SeqRL: v.App[2], TSRL: v.App[3],
				ClientCreatedMs: v.CreatedMs[0], ServerCreatedMs: v.CreatedMs[1], Answered: v.Answered != 0})
		}
	})
}

// PutLock keeps the request (its left anchor and number) that a middle
// agent holds the lock of session id for.
func (d *Datapath) PutLock(id uint32, leftAnchor [16]byte, req uint32) error {
	v := TPReq{LeftAnchor: leftAnchor, Id: req, Role: TPReqMiddle}
	return d.objs.DyscoTpReq.Update(&TPKey{SessId: id, Side: TPSideLock}, &v, ebpf.UpdateAny)
}

// Lock returns the request kept by PutLock for session id.
func (d *Datapath) Lock(id uint32) (leftAnchor [16]byte, req uint32, ok bool) {
	var v TPReq
	if d.objs.DyscoTpReq.Lookup(&TPKey{SessId: id, Side: TPSideLock}, &v) != nil || v.Role != TPReqMiddle {
		return leftAnchor, 0, false
	}
	return v.LeftAnchor, v.Id, true
}

// DeleteLock forgets the lock kept for session id.
func (d *Datapath) DeleteLock(id uint32) {
	_ = d.objs.DyscoTpReq.Delete(&TPKey{SessId: id, Side: TPSideLock})
}

// EachLock calls fn for every session with a lock kept by PutLock (read
// at agent start only).
func (d *Datapath) EachLock(fn func(id uint32)) error {
	return eachBatch(d.objs.DyscoTpReq, "kept locks", &batchBufs[TPKey, TPReq]{}, func(k *TPKey, v *TPReq) {
		if k.Side == TPSideLock {
			fn(k.SessId)
		}
	})
}

// DeleteReconfigState removes what reconfigurations left of session id:
// both sides' two-path records, the requests behind them, a kept lock and
// a proxy's joined sessions (Splice, when id is the client's session).
// One run of the control program, not five map deletions.
func (d *Datapath) DeleteReconfigState(id uint32) {
	_ = d.ctlArgs(dyscoCtlArgs{Op: ctlFreeReconf, Tp: TPKey{SessId: id}})
}

// reconfBatch is the batch of the walks of the two-path records and
// requests: their values are hundreds of bytes, and the maps hold entries
// only for sessions that were reconfigured.
const reconfBatch = 256

// DeleteReconfigStates is DeleteReconfigState for the sessions the
// collector ends together: the records and requests among them are found
// by one walk of each map and deleted in batches, so that sessions never
// reconfigured (most of them) cost no system call each.
func (d *Datapath) DeleteReconfigStates(ids []uint32) {
	if len(ids) == 0 {
		return
	}
	dead := make(map[uint32]bool, len(ids))
	for _, id := range ids {
		dead[id] = true
	}
	var tks, rks []TPKey
	_ = eachBatch(d.objs.DyscoTp, "two-path records", &d.tpBufs, func(k *TPKey, _ *TPVal) {
		if dead[k.SessId] {
			tks = append(tks, *k)
		}
	})
	_ = eachBatch(d.objs.DyscoTpReq, "requests", &d.tpReqBufs, func(k *TPKey, _ *TPReq) {
		if dead[k.SessId] {
			rks = append(rks, *k)
		}
	})
	deleteBatch(d.objs.DyscoTp, tks)
	deleteBatch(d.objs.DyscoTpReq, rks)
}

// TPReqOf reads the request behind a side's two-path record.
func (d *Datapath) TPReqOf(k TPKey) (TPReq, bool) {
	var v TPReq
	err := d.objs.DyscoTpReq.Lookup(&k, &v)
	return v, err == nil
}

// DeleteTPReq forgets the request behind a side's two-path record (its
// two-path phase ended, or it was cancelled).
func (d *Datapath) DeleteTPReq(k TPKey) { _ = d.objs.DyscoTpReq.Delete(&k) }

// EachTwoPath calls fn for every side's two-path record (read at agent
// start only: its buffers are not kept).
func (d *Datapath) EachTwoPath(fn func(k TPKey, v TPVal)) error {
	return eachBatch(d.objs.DyscoTp, "two-path records", &batchBufs[TPKey, TPVal]{}, func(k *TPKey, v *TPVal) { fn(*k, *v) })
}

// ReqHigh returns the highest request number an agent on this host may
// have used (protocol.ReqKey.ID), kept across agent restarts.
func (d *Datapath) ReqHigh() (uint32, error) {
	var v dyscoAgentState
	if err := d.objs.DyscoAgent.Lookup(uint32(0), &v); err != nil {
		return 0, fmt.Errorf("datapath: agent state: %w", err)
	}
	return v.ReqHi, nil
}

// SetReqHigh records the highest request number an agent may use before
// it calls SetReqHigh again.
func (d *Datapath) SetReqHigh(n uint32) error {
	v := dyscoAgentState{ReqHi: n}
	if err := d.objs.DyscoAgent.Update(uint32(0), &v, ebpf.UpdateAny); err != nil {
		return fmt.Errorf("datapath: agent state: %w", err)
	}
	return nil
}

// StartTwoPath takes the cut-off from the side's marks and starts the
// two-path phase, unless it started already (EBUSY when another start is
// half-way).
func (d *Datapath) StartTwoPath(k TPKey) error { return d.ctl(ctlTPStart, nil, &k, 0) }

// SetTwoPathState changes the state of a side's two-path record (TPNew
// ends the phase: everything goes on the new path).
func (d *Datapath) SetTwoPathState(k TPKey, state uint32) error {
	return d.ctl(ctlTPState, nil, &k, state)
}

// SetWindowClamp limits the window the side advertises (0: no limit).
func (d *Datapath) SetWindowClamp(k TPKey, bytes uint32) error {
	return d.ctl(ctlTPClamp, nil, &k, bytes)
}

// EventReader returns a reader of the datapath's notices; Read blocks
// until one arrives or the reader is closed.
func (d *Datapath) EventReader() (*EventReader, error) {
	r, err := ringbuf.NewReader(d.objs.DyscoEvents)
	if err != nil {
		return nil, fmt.Errorf("datapath: events: %w", err)
	}
	return &EventReader{r: r}, nil
}

// EventReader reads TPEvents, from one goroutine.
type EventReader struct {
	r   *ringbuf.Reader
	rec ringbuf.Record // reused: no allocation per event
}

// Pending tells whether more events wait in the ring (without a system
// call): a reader can take them all before acting on any.
func (e *EventReader) Pending() bool { return e.r.AvailableBytes() > 0 }

// Read returns the next event.
func (e *EventReader) Read() (TPEvent, error) {
	for {
		if err := e.r.ReadInto(&e.rec); err != nil {
			return TPEvent{}, err
		}
		if len(e.rec.RawSample) < 16 {
			continue
		}
		b := e.rec.RawSample
		if binary.NativeEndian.Uint32(b[12:]) != evProgress {
			continue
		}
		return TPEvent{SessID: binary.NativeEndian.Uint32(b), Side: binary.NativeEndian.Uint32(b[4:]),
			Bits: binary.NativeEndian.Uint32(b[8:])}, nil
	}
}

// Close stops the reader; a blocked Read returns an error.
func (e *EventReader) Close() error { return e.r.Close() }

// InsertSession stores a session the agent creates (a middlebox joining a
// new path, §3.1) under a fresh id below 2^24, as the datapath does.
func (d *Datapath) InsertSession(s Session) (uint32, error) {
	for range 16 {
		var b [4]byte
		if _, err := rand.Read(b[:]); err != nil {
			return 0, err
		}
		id := binary.LittleEndian.Uint32(b[:]) & 0xffffff
		if id == 0 {
			continue
		}
		err := d.objs.DyscoSessions.Update(id, &s, ebpf.UpdateNoExist)
		if err == nil {
			return id, nil
		}
		if !errors.Is(err, ebpf.ErrKeyExist) {
			return 0, fmt.Errorf("datapath: insert session: %w", err)
		}
	}
	return 0, errors.New("datapath: no free session id")
}
