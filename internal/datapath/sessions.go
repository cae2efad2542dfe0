package datapath

// The sessions, their set-up state, and what the control program does to
// a whole session (free, cut off, mark closed).

import (
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"

	"github.com/cilium/ebpf"
	"github.com/dysco/dysco/internal/wire"
)

// SessionEntry is a session with its id.
type SessionEntry struct {
	ID uint32
	Session
}

// EachSession calls fn for every session without holding them all; s is
// valid during the call only.
func (d *SessionMap) EachSession(fn func(id uint32, s *Session)) error {
	return eachBatch(d.objs.DyscoSessions, "sessions", &d.sessionBufs, func(k *uint32, v *Session) { fn(*k, v) })
}

// EachSetup calls fn with the id of every session that has set-up state.
func (d *SessionMap) EachSetup(fn func(id uint32)) error {
	return eachBatch(d.objs.DyscoSyns, "set-up state", &d.setupBufs, func(k *uint32, _ *dyscoSynState) { fn(*k) })
}

// Sessions lists the sessions.
func (d *SessionMap) Sessions() ([]SessionEntry, error) {
	var out []SessionEntry
	err := d.EachSession(func(id uint32, s *Session) { out = append(out, SessionEntry{ID: id, Session: *s}) })
	return out, err
}

// Session returns one session.
func (d *SessionMap) Session(id uint32) (Session, bool) {
	var s Session
	return s, d.objs.DyscoSessions.Lookup(id, &s) == nil
}

// synHops returns the address list a session's SYN still had to visit.
func synHops(st *dyscoSynState) []netip.Addr {
	var out []netip.Addr
	for i := 0; i < int(st.N_hops) && i < len(st.Hops); i++ {
		out = append(out, netip.AddrFrom16(st.Hops[i]).Unmap())
	}
	return out
}

// AllSynHops returns, by session id, the address list still to visit of
// every session that has set-up state, from one walk of the map: a session
// listing would otherwise make a lookup per session, most of which miss
// (set-up state goes once a session is established).
func (d *SessionMap) AllSynHops() (map[uint32][]netip.Addr, error) {
	out := map[uint32][]netip.Addr{}
	err := eachBatch(d.objs.DyscoSyns, "set-up state", &d.setupBufs, func(k *uint32, st *dyscoSynState) { out[*k] = synHops(st) })
	return out, err
}

// DeleteSession removes a session and its set-up state; flows are removed
// by DeleteFlow.
func (d *SessionMap) DeleteSession(id uint32) {
	_ = d.objs.DyscoSessions.Delete(id)
	_ = d.objs.DyscoSyns.Delete(id)
}

// DeleteSessions removes sessions, in batches (the collector ends many at
// once); their set-up state goes with DeleteSynStates.
func (d *SessionMap) DeleteSessions(ids []uint32) {
	deleteBatch(d.objs.DyscoSessions, ids)
}

// DeleteSynStates removes set-up state, in batches.
func (d *SessionMap) DeleteSynStates(ids []uint32) {
	deleteBatch(d.objs.DyscoSyns, ids)
}

// SessionExists tells whether session id is in the session map.
func (d *SessionMap) SessionExists(id uint32) bool {
	var s Session
	return d.objs.DyscoSessions.Lookup(id, &s) == nil
}

// ErrTooLate is returned when a session's SYN has already left the host.
var ErrTooLate = errors.New("the session's SYN has already left this host")

// PrependHops puts hops at the head of the untraversed part of a session's
// address list (paper §2.2: a middlebox such as a classifier chooses the
// next middlebox). It works while the SYN is inside this host, before the
// middlebox has let it go on.
func (d *SessionMap) PrependHops(id uint32, hops []netip.Addr) ([]netip.Addr, error) {
	var st dyscoSynState
	if err := d.objs.DyscoSyns.Lookup(id, &st); err != nil {
		return nil, fmt.Errorf("session %d has no pending SYN on this host (is this host in its chain, and not its last hop?)", id)
	}
	if st.Emitted != 0 {
		return nil, ErrTooLate
	}
	n := int(st.N_hops)
	if n+len(hops) > len(st.Hops) {
		return nil, fmt.Errorf("the address list would have %d hops, at most %d", n+len(hops), len(st.Hops))
	}
	v4 := netip.AddrFrom16(st.Session.Saddr).Unmap().Is4()
	var list [wire.MaxHops][16]byte
	seen := map[[16]byte]bool{}
	for i, h := range hops {
		if h.Unmap().Is4() != v4 {
			return nil, fmt.Errorf("hop %s is not of the session's address family", h)
		}
		if !wire.Unicast(h) {
			return nil, fmt.Errorf("hop %s is not a unicast address", h.Unmap())
		}
		list[i] = h.Unmap().As16()
	}
	copy(list[len(hops):], st.Hops[:n])
	for _, a := range list[:n+len(hops)] {
		if seen[a] {
			return nil, fmt.Errorf("hop %s would appear twice in the address list", netip.AddrFrom16(a).Unmap())
		}
		seen[a] = true
	}
	st.Hops = list
	st.N_hops = uint8(n + len(hops))
	if err := d.objs.DyscoSyns.Update(id, &st, ebpf.UpdateExist); err != nil {
		return nil, fmt.Errorf("update session %d: %w", id, err)
	}
	out := make([]netip.Addr, 0, n+len(hops))
	for _, a := range list[:n+len(hops)] {
		out = append(out, netip.AddrFrom16(a).Unmap())
	}
	return out, nil
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
func (d *SessionMap) FreeSession(id uint32, onward Tuple) (int, error) {
	return d.ctlRun(dyscoCtlArgs{Op: ctlFree, Key: onward, Tp: TPKey{SessId: id}})
}

// MarkClosed records in session id's state FINs that this host did not
// see (StFINFwd, StFINRev in dirs; other bits are ignored), and restarts
// its idle time: the collector then ends it the close linger from now, as
// if the FINs had passed. A middlebox that joined a new path misses the
// FINs that the old path carried.
func (d *SessionMap) MarkClosed(id uint32, dirs uint32) error {
	return d.ctlArgs(dyscoCtlArgs{Op: ctlClosed, Tp: TPKey{SessId: id}, Arg: dirs, Stamp: Now()})
}

// SetLeftwardWScale records the window scale of the leftward direction of
// session id (Ws[1]), which a middlebox that joined a new path learns from
// its synAck; the datapath's copy of the session is changed in place.
func (d *SessionMap) SetLeftwardWScale(id uint32, ws uint8) error {
	return d.ctlArgs(dyscoCtlArgs{Op: ctlWS, Tp: TPKey{SessId: id}, Arg: uint32(ws)})
}

// CutSession cuts this host off session id, in one run of the control
// program: the session's ingress flows go (with their deltas), its egress
// flows get FlDrop; the session stays. Flows are found as FreeSession finds
// them (onward as there). It returns how many flows were the session's.
func (d *SessionMap) CutSession(id uint32, onward Tuple) (int, error) {
	return d.ctlRun(dyscoCtlArgs{Op: ctlCut, Key: onward, Tp: TPKey{SessId: id}})
}

// InsertSession stores a session the agent creates (a middlebox joining a
// new path, §3.1) under a fresh id below 2^24, as the datapath does.
func (d *SessionMap) InsertSession(s Session) (uint32, error) {
	if s.Proto == 0 {
		s.Proto = ProtoTCP
	}
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
