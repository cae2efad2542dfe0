package datapath

// Locks kept by middle agents for a restart (§3.2).

import "github.com/cilium/ebpf"

// PutLock keeps the request (its left anchor and number) that a middle
// agent holds the lock of session id for.
func (d *LockMap) PutLock(id uint32, leftAnchor [16]byte, req uint32) error {
	v := TPReq{LeftAnchor: leftAnchor, Id: req, Role: TPReqMiddle}
	return d.objs.DyscoTpReq.Update(&TPKey{SessId: id, Side: TPSideLock}, &v, ebpf.UpdateAny)
}

// Lock returns the request kept by PutLock for session id.
func (d *LockMap) Lock(id uint32) (leftAnchor [16]byte, req uint32, ok bool) {
	var v TPReq
	if d.objs.DyscoTpReq.Lookup(&TPKey{SessId: id, Side: TPSideLock}, &v) != nil || v.Role != TPReqMiddle {
		return leftAnchor, 0, false
	}
	return v.LeftAnchor, v.Id, true
}

// DeleteLock forgets the lock kept for session id.
func (d *LockMap) DeleteLock(id uint32) {
	_ = d.objs.DyscoTpReq.Delete(&TPKey{SessId: id, Side: TPSideLock})
}

// EachLock calls fn for every session with a lock kept by PutLock (read
// at agent start only).
func (d *LockMap) EachLock(fn func(id uint32)) error {
	return eachBatch(d.objs.DyscoTpReq, "kept locks", &batchBufs[TPKey, TPReq]{}, func(k *TPKey, v *TPReq) {
		if k.Side == TPSideLock {
			fn(k.SessId)
		}
	})
}
