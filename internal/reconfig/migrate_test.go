package reconfig

import (
	"context"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/dysco/dysco/internal/testutil"
)

// migLab is a chain a → m1 → b whose middlebox m1 is replaced by m2 with
// state migration: every host holds in name (fakeHolder) and has fake
// plug-ins.
func migLab(t *testing.T) (*lab, session) {
	l := newLab(t, "a", "m1", "b", "m2")
	for _, h := range l.order {
		l.stopHost(h)
		h.holder, h.states = newFakeHolder(), newFakeStates(h.name)
		l.start(h)
	}
	s := l.chain("a", "m1", "b")
	l.hosts["m1"].states.have[s.t] = "state of m1" // the firewall tracks the session
	return l, s
}

func (l *lab) migrate(s session, o MigrateOptions) Outcome {
	l.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	out := l.hosts["a"].sh.Reconfigure(ctx, []uint32{s.ids["a"]}, l.hosts["b"].addr, []netip.Addr{l.hosts["m2"].addr}, &o)
	if len(out) != 1 {
		l.t.Fatalf("%d outcomes", len(out))
	}
	return out[0]
}

// holdsReleased waits until every hold of the lab's hosts is released,
// and checks that the anchors held as many times as the semantics says.
func (l *lab) holdsReleased(what string, want map[string]int) {
	l.t.Helper()
	testutil.Eventually(l.t, 5*time.Second, what+": every hold released", func() bool {
		for _, h := range l.order {
			if _, _, active := h.holder.counts(); active != 0 {
				return false
			}
		}
		return true
	})
	for name, n := range want {
		if started, _, _ := l.hosts[name].holder.counts(); started != n {
			l.t.Errorf("%s: %s held %d times, want %d", what, name, started, n)
		}
	}
}

func TestShellMigration(t *testing.T) {
	for _, sem := range []string{SemLossFree, SemOrder} {
		l, s := migLab(t)
		o := l.migrate(s, MigrateOptions{Semantics: sem})
		succeeded(t, o)
		if o.Migration == nil || o.Migration.Error != "" || o.Migration.Semantics != sem || o.Migration.StateBytes == 0 ||
			len(o.Migration.Plugins) != 1 || o.Migration.Plugins[0] != "fake" {
			t.Fatalf("%s: migration report %+v", sem, o.Migration)
		}
		if st, ok := l.hosts["m2"].states.state(s.t); !ok || st != "state of m1" {
			t.Fatalf("%s: m2 has state %q %v, want m1's", sem, st, ok)
		}
		holds := map[string]int{"a": 1, "b": 1}
		if sem == SemLossFree {
			holds = map[string]int{"a": 0, "b": 0}
		}
		l.holdsReleased(sem, holds)
		// The old instance lets go once its path is freed.
		testutil.Eventually(t, 5*time.Second, sem+": m1 to release the state", func() bool {
			_, ok := l.hosts["m1"].states.state(s.t)
			return !ok && l.hosts["m1"].states.releases > 0
		})
		if n := l.hosts["m2"].states.imports; n != 1 {
			t.Errorf("%s: m2 imported %d times", sem, n)
		}
	}
}

// Each failure aborts: the session stays on m1, which keeps its state, m2
// lets go of what it may have imported, every hold is released, and the
// reason names the failing step.
func TestShellMigrationFailures(t *testing.T) {
	for _, tc := range []struct {
		name string
		set  func(l *lab)
		want string
	}{
		{"export fails", func(l *lab) { l.hosts["m1"].states.failExport = true }, "export"},
		{"import fails", func(l *lab) { l.hosts["m2"].states.failImport = true }, "import"},
		{"hold overflow at the left anchor", func(l *lab) {
			l.hosts["a"].holder.overflow, l.hosts["m1"].states.exportDelay = true, 300*time.Millisecond
		}, "hold buffer full at the left anchor"},
		{"hold overflow at the right anchor", func(l *lab) {
			l.hosts["b"].holder.overflow, l.hosts["m1"].states.exportDelay = true, 300*time.Millisecond
		}, "hold buffer full at the right anchor"},
	} {
		l, s := migLab(t)
		tc.set(l)
		o := l.migrate(s, MigrateOptions{Semantics: SemOrder})
		if o.Result == nil || o.Result.Outcome.String() != "failed" || !strings.Contains(o.Record.Reason, tc.want) {
			t.Fatalf("%s: outcome %+v, want a failure naming %q", tc.name, o, tc.want)
		}
		if o.Migration == nil || !strings.Contains(o.Migration.Error, tc.want) {
			t.Fatalf("%s: migration report %+v", tc.name, o.Migration)
		}
		l.holdsReleased(tc.name, nil)
		if _, ok := l.hosts["m1"].dp.Session(s.ids["m1"]); !ok {
			t.Errorf("%s: the session left m1", tc.name)
		}
		if _, ok := l.hosts["m1"].states.state(s.t); !ok {
			t.Errorf("%s: m1 lost its state", tc.name)
		}
		testutil.Eventually(t, 5*time.Second, tc.name+": m2 to hold no state", func() bool {
			_, ok := l.hosts["m2"].states.state(s.t)
			return !ok
		})
	}
}
