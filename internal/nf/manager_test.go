package nf

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

func newTestManager(t *testing.T, specs ...Spec) *Manager {
	t.Helper()
	m, err := NewManager(specs, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		m.Close(ctx)
	})
	return m
}

// waitFor polls cond until it holds or d passes.
func waitFor(t *testing.T, d time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func status(m *Manager, name string) Status {
	for _, s := range m.Status() {
		if s.Name == name {
			return s
		}
	}
	return Status{}
}

func alive(pid int) bool { return pid > 0 && syscall.Kill(pid, 0) == nil }

func TestParseFlags(t *testing.T) {
	specs, err := ParseFlags([]string{
		"fw.start=iptables -A FORWARD -j ACCEPT; exec sleep 1000",
		"fw.ready=iptables -S FORWARD | grep -q ACCEPT",
		"fw.stop-idle=30s",
		"fw.start-timeout=3s",
		"fw.stop=iptables -F FORWARD",
		"ids.start=sleep 1000",
	})
	if err != nil {
		t.Fatal(err)
	}
	if len(specs) != 2 || specs[0].Name != "fw" || specs[1].Name != "ids" {
		t.Fatalf("specs %+v", specs)
	}
	fw := specs[0]
	if fw.Start != "iptables -A FORWARD -j ACCEPT; exec sleep 1000" || fw.Ready != "iptables -S FORWARD | grep -q ACCEPT" ||
		fw.StopIdle != 30*time.Second || fw.StartTimeout != 3*time.Second || fw.Stop != "iptables -F FORWARD" {
		t.Fatalf("fw %+v", fw)
	}
	for _, bad := range [][]string{
		{"fw=sleep 1"},                      // no key
		{"fw.run=sleep 1"},                  // unknown key
		{"1fw.start=sleep 1"},               // bad name
		{"f.w.start=sleep 1"},               // '.' in the name
		{"fw.ready=true"},                   // no start
		{"fw.start=x", "fw.stop-idle=soon"}, // bad duration
		{"fw.start=x", "fw.start-timeout=1m"},
		{strings.Repeat("a", MaxNameLen+1) + ".start=x"},
	} {
		if _, err := ParseFlags(bad); err == nil {
			t.Errorf("%q: accepted", bad)
		}
	}
}

func TestStartReadyByFile(t *testing.T) {
	dir := t.TempDir()
	ready := filepath.Join(dir, "ready")
	count := filepath.Join(dir, "starts")
	m := newTestManager(t, Spec{Name: "fw",
		Start: "echo x >> " + count + "; sleep 0.2; touch " + ready + "; exec sleep 1000",
		Ready: "test -e " + ready, StartTimeout: 5 * time.Second})
	// Concurrent demands share one start.
	var wg sync.WaitGroup
	errs := make([]error, 4)
	for i := range errs {
		wg.Add(1)
		go func() { defer wg.Done(); errs[i] = m.Ensure(context.Background(), "fw") }()
	}
	wg.Wait()
	for _, err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	st := status(m, "fw")
	if st.State != Ready || !alive(st.PID) || st.Starts != 1 || st.StartedAt.IsZero() {
		t.Fatalf("status %+v", st)
	}
	b, _ := os.ReadFile(count)
	if n := strings.Count(string(b), "x"); n != 1 {
		t.Fatalf("started %d times", n)
	}
	// Ready: at once.
	if err := m.Ensure(context.Background(), "fw"); err != nil {
		t.Fatal(err)
	}
	if err := m.Ensure(context.Background(), "nope"); !errors.Is(err, ErrUnknown) || !strings.Contains(err.Error(), "fw") {
		t.Fatalf("unknown: %v", err)
	}
}

func TestStartNeverReady(t *testing.T) {
	dir := t.TempDir()
	stopped := filepath.Join(dir, "stopped")
	m := newTestManager(t, Spec{Name: "slow", Start: "exec sleep 1000", Ready: "false",
		Stop: "touch " + stopped, StartTimeout: 300 * time.Millisecond})
	t0 := time.Now()
	err := m.Ensure(context.Background(), "slow")
	if err == nil || !strings.Contains(err.Error(), "not ready within 300ms") {
		t.Fatalf("err %v", err)
	}
	if time.Since(t0) > 3*time.Second {
		t.Fatalf("took %s", time.Since(t0))
	}
	st := status(m, "slow")
	if st.State != Failed || st.Failures != 1 || st.LastError == "" {
		t.Fatalf("status %+v", st)
	}
	// Its process is stopped, and the stop command cleans up.
	waitFor(t, 5*time.Second, "the stop command", func() bool { _, err := os.Stat(stopped); return err == nil })
	waitFor(t, 5*time.Second, "the process gone", func() bool { return status(m, "slow").PID == 0 })
	// A later demand starts it again.
	if err := m.Ensure(context.Background(), "slow"); err == nil {
		t.Fatal("second start succeeded")
	}
	if st := status(m, "slow"); st.Starts != 2 || st.Failures != 2 {
		t.Fatalf("status %+v", st)
	}
}

func TestStartCommandExits(t *testing.T) {
	m := newTestManager(t, Spec{Name: "bad", Start: "echo broken >&2; exit 3", Ready: "false", StartTimeout: 5 * time.Second})
	err := m.Ensure(context.Background(), "bad")
	if err == nil || !strings.Contains(err.Error(), "exited during its start") || !strings.Contains(err.Error(), "exit status 3") {
		t.Fatalf("err %v", err)
	}
}

func TestExitNoticedAndRestarted(t *testing.T) {
	m := newTestManager(t, Spec{Name: "fw", Start: "exec sleep 1000"})
	if err := m.Ensure(context.Background(), "fw"); err != nil {
		t.Fatal(err)
	}
	pid := status(m, "fw").PID
	if !alive(pid) {
		t.Fatalf("pid %d not running", pid)
	}
	_ = syscall.Kill(pid, syscall.SIGKILL)
	waitFor(t, 5*time.Second, "the exit noticed", func() bool { return status(m, "fw").State == Stopped })
	st := status(m, "fw")
	if st.Exits != 1 || !strings.Contains(st.LastError, "exited by itself") || st.PID != 0 {
		t.Fatalf("status %+v", st)
	}
	if err := m.Ensure(context.Background(), "fw"); err != nil {
		t.Fatal(err)
	}
	st = status(m, "fw")
	if st.State != Ready || st.Starts != 2 || st.PID == pid || !alive(st.PID) {
		t.Fatalf("status %+v", st)
	}
}

func TestIdleStop(t *testing.T) {
	dir := t.TempDir()
	stopped := filepath.Join(dir, "stopped")
	// The shell traps SIGTERM: the group is stopped by it, and the
	// stop command runs after.
	m := newTestManager(t, Spec{Name: "fw", Start: "trap 'exit 0' TERM; sleep 1000 & wait",
		Stop: "touch " + stopped, StopIdle: 200 * time.Millisecond})
	if err := m.Ensure(context.Background(), "fw"); err != nil {
		t.Fatal(err)
	}
	m.Acquire("fw")
	pid := status(m, "fw").PID
	// In use: not stopped however long.
	time.Sleep(400 * time.Millisecond) // longer than the idle time, to show nothing happens
	if st := status(m, "fw"); st.State != Ready || st.Sessions != 1 {
		t.Fatalf("in use: %+v", st)
	}
	m.Release("fw")
	waitFor(t, 5*time.Second, "the idle stop", func() bool { return status(m, "fw").State == Stopped })
	if _, err := os.Stat(stopped); err != nil {
		t.Fatal("stop command did not run")
	}
	if alive(pid) {
		t.Fatalf("pid %d still running", pid)
	}
	if st := status(m, "fw"); st.Exits != 0 || st.Sessions != 0 {
		t.Fatalf("status %+v", st)
	}
}

func TestStopKillsStubbornGroup(t *testing.T) {
	m := newTestManager(t, Spec{Name: "stubborn", Start: "trap '' TERM; sleep 1000 & wait", StopIdle: 50 * time.Millisecond})
	if err := m.Ensure(context.Background(), "stubborn"); err != nil {
		t.Fatal(err)
	}
	pid := status(m, "stubborn").PID
	waitFor(t, 10*time.Second, "SIGKILL after the grace", func() bool { return status(m, "stubborn").State == Stopped })
	if alive(pid) {
		t.Fatalf("pid %d still running", pid)
	}
}

// TestStartExitsWithoutReadyCheck: a function without a readiness check
// whose command ends at once is not taken for ready.
func TestStartExitsWithoutReadyCheck(t *testing.T) {
	m := newTestManager(t, Spec{Name: "oneshot", Start: "true"})
	for range 5 {
		err := m.Ensure(context.Background(), "oneshot")
		if err == nil {
			// It may have been seen alive; then its exit is noticed.
			waitFor(t, 5*time.Second, "the exit noticed", func() bool { return status(m, "oneshot").State == Stopped })
			continue
		}
		if !strings.Contains(err.Error(), "exited during its start") {
			t.Fatalf("err %v", err)
		}
		if st := status(m, "oneshot"); st.State != Failed || st.PID != 0 {
			t.Fatalf("status %+v", st)
		}
	}
}
