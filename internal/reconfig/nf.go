package reconfig

// Network functions on demand (heterogeneous-sfc-quic §IV): the protocol
// core asks for a function before this host joins a new path
// (protocol.StartNF); the shell has the agent's manager start it aside,
// and hands the result back to the core (protocol.NFStarted). Sessions
// joined with a function hold it until they are freed, so that the
// manager stops it only once it has served none for its idle time.

import (
	"context"
	"fmt"
	"time"

	"github.com/dysco/dysco/internal/protocol"
)

// NFManager starts the network functions a new path names for this host
// (a *nf.Manager).
type NFManager interface {
	// Ensure returns once the function runs and is ready, or why it is
	// not (unknown, failed, timed out). It bounds its own wait.
	Ensure(ctx context.Context, name string) error
	// Acquire and Release count the sessions that use a function.
	Acquire(name string)
	Release(name string)
}

// nfEnsureLimit bounds a start from the shell's side (the manager bounds
// it by the function's start timeout, at most 20 s).
const nfEnsureLimit = 30 * time.Second

// doStartNF starts the function aside and feeds the answer back to the
// core (loop goroutine).
func (c *Shell) doStartNF(v6 bool, x protocol.StartNF) {
	answer := func(err string) {
		c.handle(v6, protocol.NFStarted{Req: x.Req, Name: x.Name, Err: err})
	}
	if c.cfg.NFs == nil {
		c.deferred = append(c.deferred, func() {
			answer(fmt.Sprintf("unknown network function %q (this agent has none: start it with --nf %s.start=CMD)", x.Name, x.Name))
		})
		return
	}
	c.log.Info("network function asked for by a new path", "nf", x.Name, "req", x.Req.String(), "session", x.Session.String())
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), nfEnsureLimit)
		defer cancel()
		err := c.cfg.NFs.Ensure(ctx, x.Name)
		c.post(func() {
			if err != nil {
				answer(err.Error())
				return
			}
			answer("")
		})
	}()
}

// holdNF records that the joined session id uses the function name.
func (c *Shell) holdNF(id uint32, name string) {
	if name == "" || c.cfg.NFs == nil {
		return
	}
	if old, ok := c.nfOf[id]; ok {
		c.cfg.NFs.Release(old)
	}
	c.nfOf[id] = name
	c.cfg.NFs.Acquire(name)
}

// releaseNF: the session id no longer uses its function, if it had one.
func (c *Shell) releaseNF(id uint32) {
	if name, ok := c.nfOf[id]; ok {
		delete(c.nfOf, id)
		c.cfg.NFs.Release(name)
	}
}
