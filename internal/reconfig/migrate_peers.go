package reconfig

// State migration at the middleboxes: the old one exports the session's
// state, the new one imports it, and each lets it go when the path
// through it is freed (protocol.ExportState, ImportState, ReleaseState).
// The plug-ins work aside; the core gets their outcome as an event.

import (
	"context"
	"fmt"

	"github.com/dysco/dysco/internal/migrate"
	"github.com/dysco/dysco/internal/protocol"
)

// stateSession checks that this agent can move the state of a session:
// plug-ins, and the session in the datapath.
func (c *Shell) stateSession(pid protocol.SessionID) (uint32, string) {
	if c.states == nil {
		return 0, "state migration is disabled on this agent (no --state-plugins)"
	}
	id := c.dpID(pid)
	if _, ok := c.dp.Session(id); !ok {
		return 0, "session gone"
	}
	return id, ""
}

// doExport exports a session's state through the plug-ins (the old
// middlebox); the Set refuses a bundle too large for one control message.
func (c *Shell) doExport(v6 bool, x protocol.ExportState) {
	answer := func(blob []byte, err string) {
		c.handle(v6, protocol.StateExported{Session: x.Session, Req: x.Req, Blob: blob, Err: err})
	}
	id, bad := c.stateSession(x.Session)
	t := x.Tuple
	if bad == "" {
		// The tuple the middlebox sees is the one the session arrives
		// with here; the core names the session by the one it leaves
		// with (its onward tuple).
		s, _ := c.dp.Session(id)
		t = s.Tuple.Wire()
		if on := c.onward(id, &s); on != t {
			// This middlebox translates the session (a NAT): its
			// replacement would send the session on with the NAT's
			// output, and a host joining a new path keys the session's
			// egress by the tuple in the SYN (docs/state-migration.md,
			// "What is not covered").
			bad = fmt.Sprintf("this middlebox translates the session's tuple (%s leaves as %s): a replacement cannot take it over on a new path", t, on)
		}
	}
	if bad != "" {
		c.deferred = append(c.deferred, func() { answer(nil, bad) })
		return
	}
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), defaultMigTimeout)
		defer cancel()
		b, err := c.states.Export(ctx, migrate.Session{Tuple: t, Proto: 6})
		var blob []byte
		if err == nil {
			blob, err = b.Encode()
		}
		if err != nil {
			c.post(func() { answer(nil, err.Error()) })
			return
		}
		c.post(func() { answer(blob, "") })
	}()
}

// doImport installs the state at the new middlebox before any packet of
// the session reaches it.
func (c *Shell) doImport(v6 bool, x protocol.ImportState) {
	answer := func(err string) {
		c.handle(v6, protocol.StateImported{Session: x.Session, Req: x.Req, Tuple: x.Tuple, Err: err})
	}
	_, bad := c.stateSession(x.Session)
	b, err := migrate.DecodeBundle(x.Blob)
	if bad == "" && err != nil {
		bad = "the state does not decode: " + err.Error()
	}
	if bad != "" {
		c.deferred = append(c.deferred, func() { answer(bad) })
		return
	}
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), defaultMigTimeout)
		defer cancel()
		if err := c.states.Import(ctx, migrate.Session{Tuple: x.Tuple, Proto: 6}, b); err != nil {
			c.post(func() { answer(err.Error()) })
			return
		}
		c.post(func() { answer("") })
	}()
}

// doReleaseState drops the state of a session this host exported (or
// imported), once the path through it is freed: the old path after the
// move, or a new path that was abandoned (the work runs aside).
func (c *Shell) doReleaseState(x protocol.ReleaseState) {
	if c.states == nil {
		return
	}
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), defaultMigTimeout)
		defer cancel()
		if err := c.states.Release(ctx, migrate.Session{Tuple: x.Tuple, Proto: 6}); err != nil {
			c.log.Warn("releasing migrated state", "session", x.Tuple.String(), "err", err)
		}
	}()
}
