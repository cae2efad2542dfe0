package lab

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"time"
)

// Grace periods for stopping processes: SIGTERM, then SIGKILL after
// stopGrace, then give up after killWait.
const (
	stopGrace = 5 * time.Second
	killWait  = 2 * time.Second
)

// Proc is a background process of a lab: an agent, or a program started with
// (*Lab).Start. Its stdout and stderr go to Log. It runs in its own session,
// so that a Ctrl-C meant for the test or CLI does not reach it; the lab stops
// it on Down.
type Proc struct {
	// Host and Name identify the process in the lab ("agent" for agents).
	Host, Name string
	// Log is the file that receives its stdout and stderr.
	Log string
	// Argv is the command line that started it.
	Argv []string

	cmd   *exec.Cmd
	done  chan struct{}
	err   error // from Wait, once done is closed
	ready string
	stop  sync.Once
}

// spawn starts argv as a Proc, with stdout and stderr appended to logPath.
func spawn(host, name, logPath string, argv []string) (*Proc, error) {
	f, err := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return nil, fmt.Errorf("opening log of %s on %s: %w", name, host, err)
	}
	defer f.Close()
	cmd := exec.Command(argv[0], argv[1:]...)
	cmd.Stdout, cmd.Stderr = f, f
	// Its own session: not killed by the terminal's Ctrl-C, and Stop can
	// signal the whole process group, forked children included.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("starting %s on %s (%s): %w", name, host, strings.Join(argv, " "), err)
	}
	p := &Proc{Host: host, Name: name, Log: logPath, Argv: argv, cmd: cmd, done: make(chan struct{})}
	go func() {
		p.err = cmd.Wait()
		close(p.done)
	}()
	return p, nil
}

// waitNetns waits until the process is in namespace ns. `ip netns exec`
// opens the namespace, enters it and then executes the program under the
// same pid; until it has entered, the process is in the caller's namespace,
// where a teardown's scan of the lab's namespaces does not look, and if the
// namespace is deleted meanwhile the process enters it afterwards, out of
// reach. A process that exits first is not waited for (Err tells how it
// ended); one that is still outside after timeout is an error.
func (p *Proc) waitNetns(ns string, timeout time.Duration) error {
	deadline := time.NewTimer(timeout)
	defer deadline.Stop()
	tick := time.NewTicker(time.Millisecond)
	defer tick.Stop()
	for !pidInNetns(p.Pid(), ns) {
		select {
		case <-p.done:
			return nil // gone already: nothing left to reach (how it exited is Err's)
		case <-deadline.C:
			return fmt.Errorf("it did not enter namespace %s within %s", ns, timeout)
		case <-tick.C:
		}
	}
	return nil
}

// Pid returns the process id.
func (p *Proc) Pid() int { return p.cmd.Process.Pid }

// Done is closed when the process has exited.
func (p *Proc) Done() <-chan struct{} { return p.done }

// Err returns how the process exited (nil for exit status 0); call it after
// Done is closed.
func (p *Proc) Err() error {
	select {
	case <-p.done:
		return p.err
	default:
		return errors.New("process is still running")
	}
}

// Stop sends SIGTERM to the process group and waits for the process to
// exit, with SIGKILL after 5 s. It is idempotent, and returns an error only
// if the process could not be killed.
func (p *Proc) Stop() error {
	var err error
	p.stop.Do(func() { err = stopProcs([]*Proc{p}) })
	if err == nil {
		select {
		case <-p.done:
		default:
			err = fmt.Errorf("%s on %s (pid %d) is still running", p.Name, p.Host, p.Pid())
		}
	}
	return err
}

// stopProcs stops several processes at once: SIGTERM to all, then SIGKILL to
// those that remain after stopGrace.
func stopProcs(ps []*Proc) error {
	signal := func(sig syscall.Signal) {
		for _, p := range ps {
			select {
			case <-p.done:
			default:
				// The group first, then the process itself in case it
				// left its group.
				_ = syscall.Kill(-p.Pid(), sig)
				_ = syscall.Kill(p.Pid(), sig)
			}
		}
	}
	wait := func(d time.Duration) bool {
		timer := time.NewTimer(d)
		defer timer.Stop()
		for _, p := range ps {
			select {
			case <-p.done:
			case <-timer.C:
				return false
			}
		}
		return true
	}
	signal(syscall.SIGTERM)
	if wait(stopGrace) {
		return nil
	}
	signal(syscall.SIGKILL)
	if wait(killWait) {
		return nil
	}
	var alive []string
	for _, p := range ps {
		select {
		case <-p.done:
		default:
			alive = append(alive, fmt.Sprintf("%s on %s (pid %d)", p.Name, p.Host, p.Pid()))
		}
	}
	return fmt.Errorf("still running after SIGKILL: %s", strings.Join(alive, ", "))
}

// logTail returns about the last lines of a log file, for error messages.
func logTail(path string, lines int) string {
	f, err := os.Open(path)
	if err != nil {
		return fmt.Sprintf("(cannot read log: %v)", err)
	}
	defer f.Close()
	const max = 4096
	if st, err := f.Stat(); err == nil && st.Size() > max {
		_, _ = f.Seek(st.Size()-max, io.SeekStart)
	}
	data, _ := io.ReadAll(f)
	data = bytes.TrimRight(data, "\n")
	if len(data) == 0 {
		return "(log is empty)"
	}
	ls := strings.Split(string(data), "\n")
	if len(ls) > lines {
		ls = ls[len(ls)-lines:]
	}
	return strings.Join(ls, "\n")
}
