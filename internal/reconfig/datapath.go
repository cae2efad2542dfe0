package reconfig

import (
	"net/netip"
	"time"

	"github.com/dysco/dysco/internal/datapath"
)

// Datapath is what the shell needs of the host's datapath, grouped by the
// map each part works on. *datapath.Datapath implements it; tests use a
// fake.
type Datapath interface {
	Flows
	Sessions
	TwoPaths
	Locks
	Splices
	Requests
	Rings
}

// Flows: the flow map, one entry per subsession tuple and direction.
type Flows interface {
	Flow(k datapath.Tuple) (datapath.Flow, bool)
	AddFlow(k datapath.Tuple, f datapath.Flow) error
	ReplaceFlow(k datapath.Tuple, f datapath.Flow) error
	DeleteFlow(k datapath.Tuple)
	SetFlowFlags(k datapath.Tuple, set, clear uint32) error
	EachFlow(fn func(k *datapath.Tuple, f *datapath.Flow)) error
	Delta(k datapath.Tuple) (datapath.Delta, bool)
	PutDelta(k datapath.Tuple, v datapath.Delta) error
	DeleteDelta(k datapath.Tuple)
}

// Sessions: the session map.
type Sessions interface {
	Session(id uint32) (datapath.Session, bool)
	Sessions() ([]datapath.SessionEntry, error)
	EachSession(fn func(id uint32, s *datapath.Session)) error
	InsertSession(s datapath.Session) (uint32, error)
	DeleteSession(id uint32)
	FreeSession(id uint32, onward datapath.Tuple) (int, error)
	CutSession(id uint32, onward datapath.Tuple) (int, error)
	MarkClosed(id uint32, dirs uint32) error
	SetLeftwardWScale(id uint32, ws uint8) error
	SetWindowClamp(k datapath.TPKey, bytes uint32) error
}

// TwoPaths: each side's reconfiguration record (§3.5 variables and state)
// and its request.
type TwoPaths interface {
	TwoPath(k datapath.TPKey) (datapath.TPVal, bool)
	PutTwoPath(k datapath.TPKey, v datapath.TPVal) error
	DeleteTwoPath(k datapath.TPKey)
	EachTwoPath(fn func(k datapath.TPKey, v datapath.TPVal)) error
	StartTwoPath(k datapath.TPKey) error
	SetTwoPathState(k datapath.TPKey, state uint32) error
	MergeMarks(from, to datapath.Tuple) error
	AddSubsession(k datapath.TPKey, in datapath.Tuple, f datapath.Flow, delta datapath.Delta, tp datapath.TPVal, req datapath.TPReq) (bool, error)
	TPReqOf(k datapath.TPKey) (datapath.TPReq, bool)
	DeleteTPReq(k datapath.TPKey)
	DeleteReconfigState(id uint32)
}

// Locks: the locks held by requests (§3.2), kept across agent restarts.
type Locks interface {
	Lock(id uint32) (leftAnchor [16]byte, req uint32, ok bool)
	PutLock(id uint32, leftAnchor [16]byte, req uint32) error
	DeleteLock(id uint32)
	EachLock(fn func(id uint32)) error
}

// Splices: a proxy's joined sessions (§2.4).
type Splices interface {
	PutSplice(sp datapath.Splice) error
	DeleteSplice(id uint32)
	EachSplice(fn func(datapath.Splice)) error
	SpliceAnswered(id uint32) error
}

// Requests: the highest request number an agent of this host may have
// used, kept for the next agent (protocol.Config.FirstReq).
type Requests interface {
	ReqHigh() (uint32, error)
	SetReqHigh(n uint32) error
}

// Rings: the datapath's notices of two-path progress, and its ring of held
// packets (state migration, packets split at a cut-off). A datapath
// without them returns an error; the shell then polls, and migration is
// off.
type Rings interface {
	EventReader() (*datapath.EventReader, error)
	HoldReader() (*datapath.HoldReader, error)
	SetSplitReader(lease time.Duration) error
}

// Conn is the control socket (a *net.UDPConn).
type Conn interface {
	ReadFromUDPAddrPort(b []byte) (int, netip.AddrPort, error)
	WriteToUDPAddrPort(b []byte, addr netip.AddrPort) (int, error)
	// WriteMsgUDPAddrPort sends with ancillary data: the source address
	// (IPV6_PKTINFO) of a datagram that must not leave from the one the
	// route chooses.
	WriteMsgUDPAddrPort(b, oob []byte, addr netip.AddrPort) (n, oobn int, err error)
	Close() error
}

var _ Datapath = (*datapath.Datapath)(nil)
