package datapath

import (
	"encoding/binary"
	"errors"
	"fmt"
	"syscall"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/ringbuf"
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
	ctlHoRelease  = 12
	ctlWS         = 13

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

// AddSubsession installs the new subsession of side k in one run of the
// control program (add_sub in bpf/include/control.h), where the agent made six map
// operations: the request behind it (req, for an agent that restarts), the
// side's two-path record tp, the translation delta and the flow f of the
// new subsession's ingress at in, and the flags that point the side's
// egress flow (tp.EgKey) and its old ingress flow (tp.InOld) at the record.
// reqKept is false when everything but the request was installed. On an
// error the steps before the failing one stay, as they did one by one.
func (d *TwoPathMap) AddSubsession(k TPKey, in Tuple, f Flow, delta Delta, tp TPVal, req TPReq) (reqKept bool, err error) {
	r, err := d.ctlRun(dyscoCtlArgs{Op: ctlAddSub, Key: in, Tp: k, Flow: f, Delta: delta, Tpv: tp, Req: req})
	switch {
	case errors.Is(err, syscall.EEXIST):
		return false, fmt.Errorf("datapath: flow %s exists", in)
	case err != nil:
		return false, fmt.Errorf("datapath: add the subsession of session %d side %d: %w", k.SessId, k.Side, err)
	}
	return r == 0, nil
}

// PutTwoPath writes a side's two-path record. Only before the side's flows
// point at it (FlTPOut, FlTPOld, FlTPNew); afterwards the datapath owns the
// variables and the agent changes the record through StartTwoPath,
// SetTwoPathState and SetWindowClamp only.
func (d *TwoPathMap) PutTwoPath(k TPKey, v TPVal) error {
	return d.objs.DyscoTp.Update(&k, &v, ebpf.UpdateAny)
}

// TwoPath reads a side's two-path record.
func (d *TwoPathMap) TwoPath(k TPKey) (TPVal, bool) {
	var v TPVal
	err := d.objs.DyscoTp.Lookup(&k, &v)
	return v, err == nil
}

// DeleteTwoPath removes a side's two-path record and the request behind it.
func (d *TwoPathMap) DeleteTwoPath(k TPKey) {
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

// DeleteReconfigState removes what reconfigurations left of session id:
// both sides' two-path records, the requests behind them, a kept lock and
// a proxy's joined sessions (Splice, when id is the client's session).
// One run of the control program, not five map deletions.
func (d *TwoPathMap) DeleteReconfigState(id uint32) {
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
func (d *TwoPathMap) DeleteReconfigStates(ids []uint32) {
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
func (d *TwoPathMap) TPReqOf(k TPKey) (TPReq, bool) {
	var v TPReq
	err := d.objs.DyscoTpReq.Lookup(&k, &v)
	return v, err == nil
}

// DeleteTPReq forgets the request behind a side's two-path record (its
// two-path phase ended, or it was cancelled).
func (d *TwoPathMap) DeleteTPReq(k TPKey) { _ = d.objs.DyscoTpReq.Delete(&k) }

// EachTwoPath calls fn for every side's two-path record (read at agent
// start only: its buffers are not kept).
func (d *TwoPathMap) EachTwoPath(fn func(k TPKey, v TPVal)) error {
	return eachBatch(d.objs.DyscoTp, "two-path records", &batchBufs[TPKey, TPVal]{}, func(k *TPKey, v *TPVal) { fn(*k, *v) })
}

// ReqHigh returns the highest request number an agent on this host may
// have used (protocol.ReqKey.ID), kept across agent restarts.
func (d *TwoPathMap) ReqHigh() (uint32, error) {
	var v dyscoAgentState
	if err := d.objs.DyscoAgent.Lookup(uint32(0), &v); err != nil {
		return 0, fmt.Errorf("datapath: agent state: %w", err)
	}
	return v.ReqHi, nil
}

// SetReqHigh records the highest request number an agent may use before
// it calls SetReqHigh again.
func (d *TwoPathMap) SetReqHigh(n uint32) error {
	v := dyscoAgentState{ReqHi: n}
	if err := d.objs.DyscoAgent.Update(uint32(0), &v, ebpf.UpdateAny); err != nil {
		return fmt.Errorf("datapath: agent state: %w", err)
	}
	return nil
}

// StartTwoPath takes the cut-off from the side's marks and starts the
// two-path phase, unless it started already (EBUSY when another start is
// half-way).
func (d *TwoPathMap) StartTwoPath(k TPKey) error { return d.ctl(ctlTPStart, nil, &k, 0) }

// SetTwoPathState changes the state of a side's two-path record (TPNew
// ends the phase: everything goes on the new path).
func (d *TwoPathMap) SetTwoPathState(k TPKey, state uint32) error {
	return d.ctl(ctlTPState, nil, &k, state)
}

// SetWindowClamp limits the window the side advertises (0: no limit).
func (d *TwoPathMap) SetWindowClamp(k TPKey, bytes uint32) error {
	return d.ctl(ctlTPClamp, nil, &k, bytes)
}

// EventReader returns a reader of the datapath's notices; Read blocks
// until one arrives or the reader is closed.
func (d *TwoPathMap) EventReader() (*EventReader, error) {
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
