package sim

import (
	"fmt"
	"time"

	"github.com/dysco/dysco/internal/protocol"
)

// State migration (protocol/migrate.go): gated requests that move the
// replaced middlebox's state. The simulated agents carry out the core's
// actions abstractly: a hold is a token per host and side (no packet is
// held), a drain answers after a while, and a middlebox's plug-in state is
// a token naming the session and the host it came from. Now and then a
// step fails on purpose (the request's abort: a hold refused or
// overflowing, an export or import refused, a drain that does not end).
//
// Checked:
//   - the new middlebox imports exactly the old one's state, at most once
//     per request, and before the left anchor switches; no switch of a
//     migrating request before its import is confirmed;
//   - the old middlebox exports at most once per request, and keeps its
//     state until its path is freed (ReleaseState only for a session the
//     host no longer carries, or that ended);
//   - every hold is released, on success and on every failure, once (a
//     release of no hold is a double release);
//   - a migration that failed does not switch: the session stays on the
//     old path (the left anchor's result is a failure, checked as any).

// simMig is a migrating request, known from its NewPathReady.
type simMig struct {
	r        *request
	req      protocol.ReqKey
	left     *host
	sess     protocol.SessionID
	oldMbox  *host
	newMbox  *host
	fail     string // the step that fails on purpose, "" for none
	exports  int
	imports  int
	imported bool
	switched bool
	done     bool
	err      string
}

// holdKey names a hold at a host.
type holdKey struct {
	sess protocol.SessionID
	side protocol.Side
}

// migFailures are the steps a migration may fail at on purpose.
var migFailures = []string{"hold-left", "hold-right", "overflow-left", "overflow-right", "export", "import", "drain"}

func (w *world) migOf(k protocol.ReqKey) *simMig {
	return w.migs[k]
}

// onMigReady starts following a migrating request at its left anchor.
func (w *world) onMigReady(h *host, r *request, x protocol.NewPathReady) {
	m := &simMig{r: r, req: x.Req, left: h, sess: x.Session, oldMbox: w.byAddr[x.OldPeer], newMbox: w.byAddr[x.NewPeer]}
	if r.abort {
		m.fail = migFailures[w.rng.IntN(len(migFailures))]
	}
	w.migs[x.Req] = m
	w.stats.Migrations++
	w.tracef("%s MIGRATION %s of %s fail=%q", h, x.Req, r, m.fail)
}

// applyMigration carries out a migration action at host h.
func (h *host) applyMigration(act protocol.Action) {
	w := h.w
	later := func(fn func()) {
		w.after(time.Duration(w.rng.Int64N(int64(15*time.Millisecond))), func() {
			fn()
			w.checkLocks()
		})
	}
	switch x := act.(type) {
	case protocol.Hold:
		k := holdKey{x.Session, x.Side}
		if _, ok := h.holds[k]; ok {
			w.fail("%s: a second hold of session %d side %s", h, x.Session, x.Side)
			return
		}
		m := w.migOf(x.Req)
		h.holds[k] = x.Req
		w.stats.Holds++
		w.tracef("%s HOLD %d %s for %s", h, x.Session, x.Side, x.Req)
		failHere := m != nil && (m.fail == "hold-left" && h == m.left || m.fail == "hold-right" && h != m.left)
		overflow := m != nil && (m.fail == "overflow-left" && h == m.left || m.fail == "overflow-right" && h != m.left)
		later(func() {
			if failHere {
				delete(h.holds, k)
				h.handle(protocol.Held{Session: x.Session, Side: x.Side, Req: x.Req, Err: "simulated: cannot hold"})
				return
			}
			h.handle(protocol.Held{Session: x.Session, Side: x.Side, Req: x.Req, Marks: protocol.FlowMarks{Seq: 1, Ack: 1, OK: true}})
			if overflow {
				later(func() {
					if h.holds[k] == x.Req {
						w.tracef("%s HOLD OVERFLOW %d %s", h, x.Session, x.Side)
						h.handle(protocol.HoldOverflow{Session: x.Session, Side: x.Side})
					}
				})
			}
		})
	case protocol.ReleaseHold:
		k := holdKey{x.Session, x.Side}
		if req, ok := h.holds[k]; !ok || req != x.Req {
			w.fail("%s: release of a hold of session %d side %s for %s that it does not have", h, x.Session, x.Side, x.Req)
			return
		}
		delete(h.holds, k)
		w.tracef("%s RELEASE HOLD %d %s", h, x.Session, x.Side)
	case protocol.WaitDrained:
		m := w.migOf(x.Req)
		ok := m == nil || m.fail != "drain"
		later(func() { h.handle(protocol.Drained{Session: x.Session, Side: x.Side, Req: x.Req, OK: ok}) })
	case protocol.ExportState:
		m := w.migOf(x.Req)
		if m == nil {
			w.fail("%s: export for %s, which is not a migration", h, x.Req)
			return
		}
		if h != m.oldMbox {
			w.fail("%s: export for %s, whose old middlebox is %s", h, x.Req, m.oldMbox)
			return
		}
		m.exports++
		if m.exports > 1 {
			w.fail("%s: exported twice for %s", h, x.Req)
			return
		}
		ds := h.dp[x.Session]
		if ds == nil {
			w.fail("%s: export of a session it does not carry", h)
			return
		}
		token := stateToken(ds.sess, h)
		h.state[x.Session] = token
		fail := m.fail == "export"
		later(func() {
			if fail {
				h.handle(protocol.StateExported{Session: x.Session, Req: x.Req, Err: "simulated: the plug-in refuses to export"})
				return
			}
			h.handle(protocol.StateExported{Session: x.Session, Req: x.Req, Blob: []byte(token)})
		})
	case protocol.ImportState:
		m := w.migOf(x.Req)
		if m == nil || h != m.newMbox {
			w.fail("%s: import for %s, not its new middlebox", h, x.Req)
			return
		}
		m.imports++
		if m.imports > 1 {
			w.fail("%s: the state of %s applied twice", h, x.Req)
			return
		}
		if m.switched {
			w.fail("%s: import for %s after the switch", h, x.Req)
			return
		}
		ds := h.dp[x.Session]
		if ds == nil || string(x.Blob) != stateToken(ds.sess, m.oldMbox) {
			w.fail("%s: imported %q, not the old middlebox's state", h, x.Blob)
			return
		}
		fail := m.fail == "import"
		later(func() {
			if fail {
				h.handle(protocol.StateImported{Session: x.Session, Req: x.Req, Tuple: x.Tuple, Err: "simulated: the plug-in refuses to import"})
				return
			}
			if m.switched {
				w.fail("%s: the state of %s in place only after the switch", h, x.Req)
				return
			}
			m.imported = true
			h.state[x.Session] = string(x.Blob)
			h.handle(protocol.StateImported{Session: x.Session, Req: x.Req, Tuple: x.Tuple})
		})
	case protocol.ReleaseState:
		if ds := h.dp[x.Session]; ds != nil && !ds.gone && !ds.ending && !ds.sess.rst && !ds.sess.ending {
			w.fail("%s: released the state of s%d, which it still carries", h, ds.sess.idx)
			return
		}
		delete(h.state, x.Session)
		w.tracef("%s RELEASE STATE %d", h, x.Session)
	case protocol.MigrationDone:
		m := w.migOf(x.Req)
		if m == nil || m.left != h || m.done {
			w.fail("%s: migration done for %s: not its left anchor's, or twice", h, x.Req)
			return
		}
		m.done, m.err = true, x.Err
		if x.Err != "" {
			m.r.abort = true // a failed migration aborts: justified
			w.stats.MigAborted++
		} else {
			w.stats.MigMoved++
		}
		w.tracef("%s MIGRATION DONE %s err=%q", h, x.Req, x.Err)
		later(func() { h.handle(protocol.Proceed{Session: x.Session, Req: x.Req, Abort: x.Err, Report: m.r.report()}) })
	default:
		panic(fmt.Sprintf("sim: unknown migration action %T", act))
	}
}

// stateToken is the plug-in state of a session at a middlebox.
func stateToken(s *simSession, h *host) string { return fmt.Sprintf("state of s%d at %s", s.idx, h) }

// onMigSwitch checks a left anchor's switch (StartTwoPath on its right).
func (w *world) onMigSwitch(h *host, x protocol.StartTwoPath) {
	if x.Side != protocol.SideRight {
		return
	}
	for _, m := range w.migs {
		if m.left == h && m.sess == x.Session && !m.switched && m.r.res == nil {
			m.switched = true
			if !m.imported {
				w.fail("%s: %s switched before the new middlebox imported the state", h, m.req)
			}
			if m.err != "" {
				w.fail("%s: %s switched after its migration failed: %s", h, m.req, m.err)
			}
		}
	}
}

// finishMigrations checks what the run leaves: no hold.
func (w *world) finishMigrations() {
	for _, h := range w.hosts {
		for k, req := range h.holds {
			w.fail("%s: hold of session %d side %s for %s never released", h, k.sess, k.side, req)
			return
		}
	}
}
