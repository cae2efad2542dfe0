package protocol

import (
	"net/netip"
	"time"
)

// The early SYN of a direct new path (sendEarlySyn) reaches the right
// anchor before anything there names its session: it can come before the
// requestLock, and through a proxy that removes itself the right anchor's
// session is another TCP session than the left anchor's (§2.4). So the
// per-session replay checks (history, maxID) cannot see it. Instead the
// right anchor remembers, per left anchor, which request numbers it has
// heard of (a requestLock that came to it or through it, or an early
// SYN), in a sliding window like IPsec's anti-replay window (RFC 4303
// §3.4.3): a left anchor numbers its requests upwards across all its
// sessions (Config.FirstReq), so an early SYN whose request is already
// known here, or older than the window, is a replay or a stale
// retransmission and is refused and counted. The same window tells a
// replayed requestLock of a session that has ended here (MessageIn.Gone)
// from a new one; gone.go answers the retransmissions of those it answered
// or passed.

const (
	// reqWindowBits is how far below the newest request heard of from a
	// left anchor an early SYN may still come: more than the requests one
	// left anchor has on their way to one right anchor at once (the
	// benchmark's 600 removals at once).
	reqWindowBits = 2048
	// maxReqWindows bounds the left anchors remembered. When full, the
	// one heard of least recently is forgotten: an early SYN of its
	// later replayed is then kept (at most maxEarlySyns, each for
	// LockLease) and never used, not refused.
	maxReqWindows = 4096
)

// reqWindow is what a right anchor knows of one left anchor's requests.
type reqWindow struct {
	top  uint32 // the newest request heard of
	seen [reqWindowBits / 64]uint64
	last time.Duration // when the window last moved or marked
}

// known reports whether request id is the top one, was marked within the
// window, or is older than the window.
func (w *reqWindow) known(id uint32) bool {
	if id > w.top {
		return false
	}
	d := w.top - id
	if d >= reqWindowBits {
		return true
	}
	return w.seen[id/64%uint32(len(w.seen))]&(1<<(id%64)) != 0
}

// mark records request id, sliding the window up to it if it is newer
// than the top.
func (w *reqWindow) mark(id uint32) {
	if id > w.top {
		if id-w.top >= reqWindowBits {
			w.seen = [reqWindowBits / 64]uint64{}
		} else {
			for i := w.top + 1; i != id; i++ {
				w.seen[i/64%uint32(len(w.seen))] &^= 1 << (i % 64)
			}
		}
		w.top = id
	} else if w.top-id >= reqWindowBits {
		return
	}
	w.seen[id/64%uint32(len(w.seen))] |= 1 << (id % 64)
}

// heardOf records that request k came to this agent.
func (a *Agent) heardOf(k ReqKey) {
	w := a.reqWindows[k.LeftAnchor]
	if w == nil {
		if len(a.reqWindows) >= maxReqWindows {
			var old netip.Addr
			var at time.Duration
			for addr, x := range a.reqWindows {
				if !old.IsValid() || x.last < at {
					old, at = addr, x.last
				}
			}
			delete(a.reqWindows, old)
		}
		// A fresh window starts just below the first request heard of:
		// the requests below it are unknown (an early SYN of theirs is
		// kept) down to the window's bottom.
		w = &reqWindow{}
		if k.ID > 0 {
			w.top = k.ID - 1
		}
		a.reqWindows[k.LeftAnchor] = w
	}
	w.mark(k.ID)
	w.last = a.now
}

// knownReq reports whether request k has been heard of here, or is too
// old to tell.
func (a *Agent) knownReq(k ReqKey) bool {
	w := a.reqWindows[k.LeftAnchor]
	return w != nil && w.known(k.ID)
}
