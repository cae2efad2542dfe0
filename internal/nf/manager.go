package nf

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os/exec"
	"slices"
	"strings"
	"sync"
	"syscall"
	"time"
)

// State is where a network function is.
type State string

// States of a network function.
const (
	Stopped  State = "stopped"
	Starting State = "starting"
	Ready    State = "ready"
	Stopping State = "stopping"
	// Failed: its last start failed (it is started again on the next
	// demand).
	Failed State = "failed"
)

// ErrUnknown is wrapped by Ensure's error for a name the agent has no
// network function of.
var ErrUnknown = errors.New("unknown network function")

// Status is what `dysco status` shows of a network function.
type Status struct {
	Name  string `json:"name"`
	State State  `json:"state"`
	// PID is the process group leader's, while one runs.
	PID       int       `json:"pid,omitempty"`
	StartedAt time.Time `json:"started_at,omitzero"`
	// Sessions is the number of sessions joined here that named it.
	Sessions int `json:"sessions"`
	// Starts counts the processes started; Exits those that exited by
	// themselves; Failures the starts that failed.
	Starts   uint64 `json:"starts"`
	Exits    uint64 `json:"exits"`
	Failures uint64 `json:"failures"`
	// LastError is why the last start failed or the process last exited
	// by itself.
	LastError string `json:"last_error,omitempty"`
}

// Manager starts, watches and stops the network functions of one agent.
// Safe for concurrent use.
type Manager struct {
	log *slog.Logger
	mu  sync.Mutex
	fns map[string]*fn
}

type fn struct {
	spec Spec
	// Guarded by Manager.mu.
	state     State
	pid       int
	startedAt time.Time
	sessions  int
	starts    uint64
	exits     uint64
	failures  uint64
	lastErr   string
	// startDone is closed when the current start ends; startErr is its
	// error.
	startDone chan struct{}
	startErr  error
	// exited is closed when the current process has been reaped (and
	// the stop command has run).
	exited chan struct{}
	// stopping: the agent stops the process (no exit by itself).
	stopping bool
	idle     *time.Timer
}

// NewManager returns a manager of the given functions (names must be
// distinct and valid; ParseFlags makes them so).
func NewManager(specs []Spec, log *slog.Logger) (*Manager, error) {
	if log == nil {
		log = slog.Default()
	}
	m := &Manager{log: log, fns: map[string]*fn{}}
	for _, s := range specs {
		if err := ValidName(s.Name); err != nil {
			return nil, err
		}
		if _, dup := m.fns[s.Name]; dup {
			return nil, fmt.Errorf("network function %q configured twice", s.Name)
		}
		if strings.TrimSpace(s.Start) == "" {
			return nil, fmt.Errorf("network function %q: no start command", s.Name)
		}
		if s.StartTimeout <= 0 {
			s.StartTimeout = DefaultStartTimeout
		}
		m.fns[s.Name] = &fn{spec: s, state: Stopped}
	}
	return m, nil
}

// Names lists the functions, sorted.
func (m *Manager) Names() []string {
	m.mu.Lock()
	defer m.mu.Unlock()
	var out []string
	for n := range m.fns {
		out = append(out, n)
	}
	slices.Sort(out)
	return out
}

// Ensure returns once the function is ready: at once if it is, after its
// start (this call's or one under way) otherwise. Concurrent callers share
// one start. The error says why it is not ready: an unknown name
// (ErrUnknown), a start that failed or timed out, or ctx.
func (m *Manager) Ensure(ctx context.Context, name string) error {
	m.mu.Lock()
	f := m.fns[name]
	if f == nil {
		m.mu.Unlock()
		return fmt.Errorf("%w %q (this agent has: %s)", ErrUnknown, name, m.namesText())
	}
	for {
		switch f.state {
		case Ready:
			// A demand: the idle time starts again, so that the session
			// asking has time to take the function (Acquire).
			m.armIdle(f)
			m.mu.Unlock()
			return nil
		case Stopping:
			ch := f.exited
			m.mu.Unlock()
			select {
			case <-ch:
			case <-ctx.Done():
				return ctx.Err()
			}
			m.mu.Lock()
			continue
		case Stopped, Failed:
			if ch := f.exited; ch != nil && !closed(ch) {
				// The last process is still being reaped (its stop
				// command runs): the new one starts after it.
				m.mu.Unlock()
				select {
				case <-ch:
				case <-ctx.Done():
					return ctx.Err()
				}
				m.mu.Lock()
				continue
			}
			f.state = Starting
			f.startDone = make(chan struct{})
			f.startErr = nil
			go m.start(f, f.startDone)
		}
		ch := f.startDone
		m.mu.Unlock()
		select {
		case <-ch:
		case <-ctx.Done():
			return ctx.Err()
		}
		m.mu.Lock()
		if f.startDone == ch {
			err := f.startErr
			m.mu.Unlock()
			return err
		}
		// Another start began since (the function exited meanwhile):
		// look again.
	}
}

func (m *Manager) namesText() string {
	var ns []string
	for n := range m.fns {
		ns = append(ns, n)
	}
	if len(ns) == 0 {
		return "none"
	}
	slices.Sort(ns)
	return strings.Join(ns, ", ")
}

// start runs one start of f: the process, then the readiness check until
// it succeeds, the process exits or the start timeout passes.
func (m *Manager) start(f *fn, done chan struct{}) {
	sp := f.spec
	cmd := exec.Command("/bin/sh", "-c", sp.Start)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	out := &lineLog{log: m.log, name: sp.Name}
	cmd.Stdout, cmd.Stderr = out, out
	// Wait returns even if a child of the function keeps the output
	// pipe open.
	cmd.WaitDelay = time.Second
	t0 := time.Now()
	if err := cmd.Start(); err != nil {
		m.endStart(f, done, fmt.Errorf("network function %s: start: %w", sp.Name, err), false)
		return
	}
	exited := make(chan struct{})
	m.mu.Lock()
	f.pid, f.startedAt, f.starts = cmd.Process.Pid, t0, f.starts+1
	f.exited, f.stopping = exited, false
	m.mu.Unlock()
	m.log.Info("network function starting", "nf", sp.Name, "pid", cmd.Process.Pid)
	go m.reap(f, cmd, exited)

	ctx, cancel := context.WithTimeout(context.Background(), sp.StartTimeout)
	defer cancel()
	wait := 20 * time.Millisecond
	var last string
	for {
		if sp.Ready == "" {
			break
		}
		rc := exec.CommandContext(ctx, "/bin/sh", "-c", sp.Ready)
		rc.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
		rc.Cancel = func() error { return syscall.Kill(-rc.Process.Pid, syscall.SIGKILL) }
		rc.WaitDelay = time.Second
		b, err := rc.CombinedOutput()
		if err == nil {
			break
		}
		last = err.Error()
		if s := strings.TrimSpace(string(b)); s != "" {
			last += ": " + truncate(s, 200)
		}
		select {
		case <-exited:
			m.endStart(f, done, fmt.Errorf("network function %s exited during its start (%s)", sp.Name, m.exitText(f)), false)
			return
		case <-ctx.Done():
			m.endStart(f, done, fmt.Errorf("network function %s not ready within %s (ready check: %s)", sp.Name, sp.StartTimeout, last), true)
			return
		case <-time.After(wait):
		}
		wait = min(2*wait, 500*time.Millisecond)
	}
	m.mu.Lock()
	if f.pid == 0 {
		// Reaped already (reap clears pid first, under the lock): it
		// exited during its start.
		m.mu.Unlock()
		<-exited
		m.endStart(f, done, fmt.Errorf("network function %s exited during its start (%s)", sp.Name, m.exitText(f)), false)
		return
	}
	f.state = Ready
	f.startErr = nil
	close(done)
	m.armIdle(f)
	m.mu.Unlock()
	m.log.Info("network function ready", "nf", sp.Name, "pid", cmd.Process.Pid, "took", time.Since(t0).Round(time.Millisecond))
}

func (m *Manager) exitText(f *fn) string {
	m.mu.Lock()
	defer m.mu.Unlock()
	return f.lastErr
}

// endStart records a failed start; kill stops the process still running.
func (m *Manager) endStart(f *fn, done chan struct{}, err error, kill bool) {
	m.log.Warn("network function failed to start", "nf", f.spec.Name, "err", err)
	m.mu.Lock()
	f.failures++
	f.lastErr = err.Error()
	f.startErr = err
	if kill {
		m.stopLocked(f)
	}
	f.state = Failed
	close(done)
	m.mu.Unlock()
}

// reap waits for the process, runs the stop command, and records the
// exit: asked for (stopping) or by itself (counted, started again on the
// next demand).
func (m *Manager) reap(f *fn, cmd *exec.Cmd, exited chan struct{}) {
	err := cmd.Wait()
	m.mu.Lock()
	f.pid = 0
	asked := f.stopping
	why := "exit status 0"
	if err != nil {
		why = err.Error()
	}
	if !asked {
		f.exits++
		f.lastErr = "exited by itself: " + why
	}
	if f.state == Ready {
		f.state = Stopping
	}
	f.pid = 0
	f.stopIdle()
	m.mu.Unlock()
	if asked {
		m.log.Info("network function stopped", "nf", f.spec.Name, "status", why)
	} else {
		m.log.Warn("network function exited by itself", "nf", f.spec.Name, "status", why)
	}
	// What is left of the group (children that kept running).
	_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
	if f.spec.Stop != "" {
		ctx, cancel := context.WithTimeout(context.Background(), stopCmdTimeout)
		sc := exec.CommandContext(ctx, "/bin/sh", "-c", f.spec.Stop)
		sc.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
		sc.WaitDelay = time.Second
		if b, err := sc.CombinedOutput(); err != nil {
			m.log.Warn("network function: stop command failed", "nf", f.spec.Name, "err", err, "output", truncate(strings.TrimSpace(string(b)), 200))
		}
		cancel()
	}
	m.mu.Lock()
	if f.state == Stopping {
		f.state = Stopped
	}
	f.stopping = false
	close(exited)
	m.mu.Unlock()
}

// stopLocked sends SIGTERM to f's process group, and SIGKILL after
// StopGrace if it is still there.
func (m *Manager) stopLocked(f *fn) {
	if f.pid == 0 || f.stopping {
		return
	}
	f.stopping = true
	f.stopIdle()
	if f.state == Ready {
		f.state = Stopping
	}
	pid, exited := f.pid, f.exited
	_ = syscall.Kill(-pid, syscall.SIGTERM)
	go func() {
		select {
		case <-exited:
		case <-time.After(StopGrace):
			_ = syscall.Kill(-pid, syscall.SIGKILL)
		}
	}()
}

func (f *fn) stopIdle() {
	if f.idle != nil {
		f.idle.Stop()
		f.idle = nil
	}
}

// armIdle starts the idle timer of a ready function no session uses.
func (m *Manager) armIdle(f *fn) {
	f.stopIdle()
	if f.spec.StopIdle <= 0 || f.sessions > 0 || f.state != Ready {
		return
	}
	var t *time.Timer
	t = time.AfterFunc(f.spec.StopIdle, func() {
		m.mu.Lock()
		defer m.mu.Unlock()
		if f.idle != t || f.sessions > 0 || f.state != Ready {
			return
		}
		m.log.Info("network function idle: stopping it", "nf", f.spec.Name, "idle", f.spec.StopIdle)
		m.stopLocked(f)
	})
	f.idle = t
}

// Acquire counts a session that uses the function (a session joined here
// whose request named it).
func (m *Manager) Acquire(name string) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if f := m.fns[name]; f != nil {
		f.sessions++
		f.stopIdle()
	}
}

// Release counts a session that no longer uses the function; the last
// one starts its idle time.
func (m *Manager) Release(name string) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if f := m.fns[name]; f != nil && f.sessions > 0 {
		f.sessions--
		m.armIdle(f)
	}
}

// Status returns every function's status, sorted by name.
func (m *Manager) Status() []Status {
	m.mu.Lock()
	defer m.mu.Unlock()
	out := make([]Status, 0, len(m.fns))
	for _, f := range m.fns {
		st := Status{Name: f.spec.Name, State: f.state, PID: f.pid, Sessions: f.sessions,
			Starts: f.starts, Exits: f.exits, Failures: f.failures, LastError: f.lastErr}
		if f.pid != 0 {
			st.StartedAt = f.startedAt
		}
		out = append(out, st)
	}
	slices.SortFunc(out, func(a, b Status) int { return strings.Compare(a.Name, b.Name) })
	return out
}

// Close stops every running function and waits (until ctx ends) for them
// to be gone.
func (m *Manager) Close(ctx context.Context) {
	m.mu.Lock()
	var waits []chan struct{}
	for _, f := range m.fns {
		if f.pid != 0 {
			m.stopLocked(f)
			waits = append(waits, f.exited)
		}
	}
	m.mu.Unlock()
	for _, ch := range waits {
		select {
		case <-ch:
		case <-ctx.Done():
			return
		}
	}
}

func closed(ch chan struct{}) bool {
	select {
	case <-ch:
		return true
	default:
		return false
	}
}

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "…"
}

// lineLog writes a function's output to the agent's log, a line at a
// time, prefixed with the function's name.
type lineLog struct {
	log  *slog.Logger
	name string
	mu   sync.Mutex
	buf  []byte
}

func (w *lineLog) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.buf = append(w.buf, p...)
	for {
		i := bytes.IndexByte(w.buf, '\n')
		if i < 0 {
			break
		}
		w.log.Info("nf "+w.name+": "+string(w.buf[:i]), "nf", w.name)
		w.buf = w.buf[i+1:]
	}
	if len(w.buf) > 4096 {
		w.log.Info("nf "+w.name+": "+string(w.buf), "nf", w.name)
		w.buf = w.buf[:0]
	}
	return len(p), nil
}
