package datapath

// A proxy's joined sessions (§2.4), kept for a restart of its agent.

import (
	"fmt"

	"github.com/cilium/ebpf"
)

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
func (d *SpliceMap) PutSplice(sp Splice) error {
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
func (d *SpliceMap) SpliceAnswered(id uint32) error {
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
func (d *SpliceMap) DeleteSplice(id uint32) {
	_ = d.objs.DyscoTpReq.Delete(&TPKey{SessId: id, Side: TPSideSplice})
}

// EachSplice calls fn for every proxy's joined sessions kept by PutSplice
// (read at agent start only).
func (d *SpliceMap) EachSplice(fn func(Splice)) error {
	return eachBatch(d.objs.DyscoTpReq, "joined sessions", &batchBufs[TPKey, TPReq]{}, func(k *TPKey, v *TPReq) {
		if k.Side == TPSideSplice && v.Role == TPReqSplice {
			fn(Splice{Client: k.SessId, Server: v.PeerId, SeqLR: v.App[0], TSLR: v.App[1], SeqRL: v.App[2], TSRL: v.App[3],
				ClientCreatedMs: v.CreatedMs[0], ServerCreatedMs: v.CreatedMs[1], Answered: v.Answered != 0})
		}
	})
}
