package protocol

import (
	"math"
	"net/netip"
	"slices"
	"strings"
	"testing"
	"time"
)

// A state migration runs in the core (migrate.go): the left anchor holds,
// freezes the right anchor, drains, has the old middlebox export and the
// new one import, reports MigrationDone, and switches on Proceed; every
// hold is released, and the old middlebox lets its state go when its path
// is freed.
func TestMigrationSteps(t *testing.T) {
	for _, sem := range []MigrateSemantics{MigrateLossFree, MigrateOrder, MigrateSubstream} {
		h := newHarness(t, 4)
		h.chain([]int{1, 2, 4}, nil)
		h.deliver(addr(1), Reconfigure{Session: sid, RightAnchor: addr(4), Chain: []netip.Addr{addr(3)}, Token: 1,
			Migrate: &MigrateSpec{Semantics: sem}})
		h.runMessages()
		done := h.migDone[addr(1)]
		if len(done) != 1 || done[0].Err != "" || string(done[0].State) != "state of "+addr(2).String() {
			t.Fatalf("%s: migration done %+v\n%s", sem, done, h.trace())
		}
		if len(h.starts[addr(1)]) != 0 {
			t.Fatalf("%s: switched before Proceed", sem)
		}
		if got := h.migLog[addr(3)]; !slices.Equal(got, []string{"import state of " + addr(2).String()}) {
			t.Errorf("%s: new middlebox did %v", sem, got)
		}
		h.deliver(addr(1), Proceed{Session: sid, Req: done[0].Req})
		h.run()
		if res := h.result(1); res.Outcome != Succeeded {
			t.Fatalf("%s: result %+v\n%s", sem, res, h.trace())
		}
		want1, want4 := []string{"release right"}, []string(nil)
		if sem != MigrateLossFree {
			want1 = []string{"hold right", "drain right " + sem.String(), "release right"}
			want4 = []string{"hold left", "drain left " + sem.String(), "release left"}
		}
		if got := h.migLog[addr(1)]; sem == MigrateLossFree && len(got) != 0 || sem != MigrateLossFree && !slices.Equal(got, want1) {
			t.Errorf("%s: left anchor did %v, want %v", sem, got, want1)
		}
		if got := h.migLog[addr(4)]; !slices.Equal(got, want4) {
			t.Errorf("%s: right anchor did %v, want %v", sem, got, want4)
		}
		if got := h.migLog[addr(2)]; !slices.Equal(got, []string{"export", "release state"}) {
			t.Errorf("%s: old middlebox did %v", sem, got)
		}
		h.assertClean(1, 3, 4)
	}
}

// A failed step aborts: the new path is cancelled (§3.6), the holds go,
// the new middlebox lets the imported state go, the reason names the step.
func TestMigrationFailures(t *testing.T) {
	for _, tc := range []struct {
		at   int
		fail string
		want string
	}{
		{2, "export", "export at 10.0.0.2: cannot export"},
		{3, "import", "import at 10.0.0.3: cannot import"},
		{4, "hold", "freeze at the right anchor 10.0.0.4: cannot hold"},
		{1, "hold", "cannot hold"},
	} {
		h := newHarness(t, 4)
		h.chain([]int{1, 2, 4}, nil)
		h.migFail[addr(tc.at)] = tc.fail
		h.deliver(addr(1), Reconfigure{Session: sid, RightAnchor: addr(4), Chain: []netip.Addr{addr(3)}, Token: 1,
			Migrate: &MigrateSpec{Semantics: MigrateOrder}})
		h.runMessages()
		done := h.migDone[addr(1)]
		if len(done) != 1 || done[0].Err != tc.want {
			t.Fatalf("%s at %d: migration done %+v, want %q\n%s", tc.fail, tc.at, done, tc.want, h.trace())
		}
		h.deliver(addr(1), Proceed{Session: sid, Req: done[0].Req, Abort: done[0].Err})
		h.run()
		if res := h.result(1); res.Outcome != Failed || res.Reason != ReasonAborted {
			t.Fatalf("%s: result %+v\n%s", tc.fail, res, h.trace())
		}
		if len(h.starts[addr(1)])+len(h.starts[addr(4)]) != 0 {
			t.Fatalf("%s: switched", tc.fail)
		}
		for _, i := range []int{1, 4} {
			l := h.migLog[addr(i)]
			holds, releases := 0, 0
			for _, x := range l {
				holds += b2i(strings.HasPrefix(x, "hold"))
				releases += b2i(strings.HasPrefix(x, "release "+map[int]string{1: "right", 4: "left"}[i]))
			}
			if tc.fail == "hold" && tc.at == i {
				holds = 0 // the hold failed: nothing to release
			}
			if holds != releases {
				t.Errorf("%s: agent %d held %d times, released %d: %v", tc.fail, i, holds, releases, l)
			}
		}
		if l := h.migLog[addr(2)]; slices.Contains(l, "release state") {
			t.Errorf("%s: the old middlebox let its state go: %v", tc.fail, l)
		}
		if _, ok := h.view(2); !ok {
			t.Errorf("%s: the old middlebox left the path", tc.fail)
		}
	}
}

func b2i(b bool) int {
	if b {
		return 1
	}
	return 0
}

// The right anchor's hold overflows: it tells the left anchor, which
// aborts with its reason.
func TestMigrationRightOverflow(t *testing.T) {
	h := newHarness(t, 4)
	h.chain([]int{1, 2, 4}, nil)
	h.deliver(addr(1), Reconfigure{Session: sid, RightAnchor: addr(4), Chain: []netip.Addr{addr(3)}, Token: 1,
		Migrate: &MigrateSpec{Semantics: MigrateOrder, HoldLimit: 1}})
	// Up to the freeze at the right anchor, which holds and answers.
	for !h.queued(MsgMigrate) {
		if !h.step() {
			t.Fatalf("no freeze\n%s", h.trace())
		}
	}
	h.stepType(MsgMigrate, addr(4))
	h.deliver(addr(4), HoldOverflow{Session: sid, Side: SideLeft})
	h.runMessages()
	done := h.migDone[addr(1)]
	if len(done) != 1 || !strings.Contains(done[0].Err, "hold buffer full at the right anchor") {
		t.Fatalf("migration done %+v\n%s", done, h.trace())
	}
	h.deliver(addr(1), Proceed{Session: sid, Req: done[0].Req, Abort: done[0].Err})
	h.run()
	if got := h.migLog[addr(4)]; !slices.Equal(got, []string{"hold left", "drain left order", "release left"}) {
		t.Errorf("right anchor did %v", got)
	}
	if res := h.result(1); res.Outcome != Failed {
		t.Fatalf("result %+v", res)
	}
}

// A right anchor that holds for a migration switches, and lets go, on the
// left anchor's ACK: with the ACK lost it sends its synAck again until the
// left anchor's ACK comes (onSynAck answers a copy with it), instead of
// holding the session's packets until its hold's lease. The Promela model
// found the stall (docs/verification.md).
func TestMigrationAckLost(t *testing.T) {
	h := newHarness(t, 4)
	h.chain([]int{1, 2, 4}, nil)
	h.deliver(addr(1), Reconfigure{Session: sid, RightAnchor: addr(4), Chain: []netip.Addr{addr(3)}, Token: 1,
		Migrate: &MigrateSpec{Semantics: MigrateOrder}})
	h.runMessages()
	done := h.migDone[addr(1)]
	if len(done) != 1 || done[0].Err != "" {
		t.Fatalf("migration done %+v\n%s", done, h.trace())
	}
	h.deliver(addr(1), Proceed{Session: sid, Req: done[0].Req})
	h.dropType(MsgAck, addr(3))
	// Nor does the left anchor's fin come: in the datapath its old-path
	// data is acknowledged by packets the right anchor holds, so it has no
	// fin to send (the harness has no TCP: its fins are taken away).
	start := h.now
	for i := 0; i < 10000 && len(h.starts[addr(4)]) == 0; i++ {
		kept := h.queue[:0]
		for _, e := range h.queue {
			if e.msg.Type != MsgFin {
				kept = append(kept, e)
			}
		}
		h.queue = kept
		if !h.step() && !h.fireNext() {
			break
		}
	}
	if len(h.starts[addr(4)]) == 0 {
		t.Fatalf("the right anchor never switched\n%s", h.trace())
	}
	if waited := h.now - start; waited > 2*time.Second {
		t.Fatalf("the right anchor switched %v after the ACK was lost, want within the synAck's retransmissions\n%s", waited, h.trace())
	}
	h.run()
	if res := h.result(1); res.Outcome != Succeeded {
		t.Fatalf("result %+v\n%s", res, h.trace())
	}
	if got := h.migLog[addr(4)]; !slices.Contains(got, "release left") {
		t.Errorf("right anchor did %v, want its hold released", got)
	}
}

// A freeze whose bounds a peer set beyond the maxima is clamped at the
// right anchor: it holds at most MaxHoldLimit bytes, and for at most
// MaxMigTimeout (plus its grace) whatever the message says.
func TestMigrationFreezeClamped(t *testing.T) {
	h := newHarness(t, 4)
	h.chain([]int{1, 2, 4}, nil)
	h.deliver(addr(1), Reconfigure{Session: sid, RightAnchor: addr(4), Chain: []netip.Addr{addr(3)}, Token: 1,
		Migrate: &MigrateSpec{Semantics: MigrateOrder}})
	for !h.queued(MsgMigrate) {
		if !h.step() {
			t.Fatalf("no freeze\n%s", h.trace())
		}
	}
	found := false
	for i, e := range h.queue {
		if e.msg.Type != MsgMigrate || e.to != addr(4) {
			continue
		}
		m := *e.msg
		x := *m.Mig
		x.HoldLimit, x.TimeoutMS, x.DrainMS = maxHoldLimit, math.MaxUint32, math.MaxUint32
		m.Mig = &x
		data, err := m.Encode(h.key, e.from)
		if err != nil {
			t.Fatal(err)
		}
		h.queue[i].msg, h.queue[i].data = &m, data
		found = true
	}
	if !found {
		t.Fatalf("no freeze for the right anchor\n%s", h.trace())
	}
	h.stepType(MsgMigrate, addr(4))
	if h.holdLimit != MaxHoldLimit {
		t.Errorf("right anchor holds up to %d bytes, want the maximum %d", h.holdLimit, uint64(MaxHoldLimit))
	}
	for k, at := range h.timers {
		if k.agent == addr(4) && k.id.Kind == TimerMigrate && at-h.now > MaxMigTimeout+rightHoldGrace {
			t.Errorf("right anchor holds for %v, want at most %v", at-h.now, MaxMigTimeout+rightHoldGrace)
		}
	}
	if sp := MigrateSpecDefaults(MigrateSpec{HoldLimit: 1 << 40, TimeoutMS: math.MaxUint32}); sp.HoldLimit != MaxHoldLimit || sp.TimeoutMS != uint32(MaxMigTimeout/time.Millisecond) {
		t.Errorf("spec not clamped: %+v", sp)
	}
	if d := drainTimeout(math.MaxUint32); d != MaxDrainTimeout {
		t.Errorf("drain bound %v, want %v", d, MaxDrainTimeout)
	}
	if d := drainTimeout(0); d != DefaultDrainTimeout {
		t.Errorf("drain bound of 0: %v, want the default", d)
	}
}
