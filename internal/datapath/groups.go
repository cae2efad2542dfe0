package datapath

// The datapath's maps in groups, one type each: the Datapath embeds them,
// so d.Flow and the like are its methods too, and a consumer can depend on
// the group it uses alone.

// FlowMap is the flows (IPv4 and IPv6, one entry per tuple and direction)
// and their translation deltas.
type FlowMap struct {
	objects
	flow6Bufs batchBufs[Tuple, Flow]
	flow4Bufs batchBufs[Tuple4, Flow4]
	deltaBufs batchBufs[Tuple, Delta]
}

// SessionMap is the sessions, and the set-up state of sessions whose SYN
// has not completed.
type SessionMap struct {
	objects
	sessionBufs batchBufs[uint32, Session]
	setupBufs   batchBufs[uint32, dyscoSynState]
}

// TwoPathMap is each side's reconfiguration record (§3.5), the request
// behind it, the request numbers kept for a restart and the progress ring.
type TwoPathMap struct {
	objects
	tpBufs    batchBufs[TPKey, TPVal]
	tpReqBufs batchBufs[TPKey, TPReq]
}

// LockMap is the locks that middle agents keep for a restart (§3.2).
type LockMap struct{ objects }

// SpliceMap is a proxy's joined sessions (§2.4), kept for a restart.
type SpliceMap struct{ objects }

// initGroups points the groups at the loaded objects.
func (d *Datapath) initGroups() {
	o := objects{&d.objs}
	d.FlowMap = &FlowMap{objects: o}
	d.SessionMap = &SessionMap{objects: o}
	d.TwoPathMap = &TwoPathMap{objects: o, tpBufs: batchBufs[TPKey, TPVal]{size: reconfBatch}, tpReqBufs: batchBufs[TPKey, TPReq]{size: reconfBatch}}
	d.LockMap = &LockMap{o}
	d.SpliceMap = &SpliceMap{o}
}
