package agent

import (
	"log/slog"
	"net"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"
)

// rootOnly accepts connections to the local API from root peers only
// (SO_PEERCRED). Any other peer's connection is closed before a byte is
// read, counted (api_refused_peers in the status) and logged, at most once
// a minute so that a local user cannot fill the log. The clients check the
// agent in turn (api.CheckAgentPeer): neither side talks to another user.
type rootOnly struct {
	net.Listener
	log     *slog.Logger
	refused *atomic.Uint64
	lastLog atomic.Int64 // unix nanoseconds of the last refusal logged
}

// peerLogEvery bounds how often a refused peer is logged.
const peerLogEvery = time.Minute

func (l *rootOnly) Accept() (net.Conn, error) {
	for {
		c, err := l.Listener.Accept()
		if err != nil {
			return nil, err
		}
		uc, ok := c.(*net.UnixConn)
		if !ok {
			return c, nil
		}
		cred, err := peerCred(uc)
		if err == nil && cred.Uid == 0 {
			return c, nil
		}
		// Counted before the close, which the peer sees: whoever
		// learns of the refusal finds it counted.
		n := l.refused.Add(1)
		c.Close()
		now := time.Now().UnixNano()
		if last := l.lastLog.Load(); now-last >= int64(peerLogEvery) && l.lastLog.CompareAndSwap(last, now) {
			if err != nil {
				l.log.Warn("local API: refused a peer whose credentials cannot be read", "err", err, "refused", n)
			} else {
				l.log.Warn("local API: refused a peer that is not root", "pid", cred.Pid, "uid", cred.Uid, "refused", n)
			}
		}
	}
}

// peerCred reads the credentials of the process at the other end of c.
func peerCred(c *net.UnixConn) (*unix.Ucred, error) {
	raw, err := c.SyscallConn()
	if err != nil {
		return nil, err
	}
	var cred *unix.Ucred
	var cerr error
	if err := raw.Control(func(fd uintptr) { cred, cerr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED) }); err != nil {
		return nil, err
	}
	return cred, cerr
}
