// Package lab builds a multi-host testbed of network namespaces on one
// machine: the hosts of a topology as named namespaces, links as veth pairs,
// the star topology's router as a forwarding namespace, and optionally one
// Dysco agent per host. End-to-end tests, benchmarks and `make demo` run in
// it; `dysco lab` is its command line.
//
// A lab called N has namespaces "N-<host>" (and "N-router"), a run directory
// RunDir(N) with a state file, ready files and logs, and BPF pin directories
// PinDir("N-<host>"). Down and DownByName remove all of them, and kill every
// process in the namespaces, whoever started it.
//
// The namespaces have no link to the root namespace: traffic in a lab stays
// in the lab.
package lab

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"sync"
	"syscall"
	"time"
)

// DefaultReadyTimeout is how long Up waits for the agents' ready files when
// Config.ReadyTimeout is zero.
const DefaultReadyTimeout = 30 * time.Second

// Config says what lab Up builds.
type Config struct {
	// Name names the lab, ^[a-z][a-z0-9]{0,7}$.
	Name string
	// Topology is the lab's hosts and links.
	Topology Topology
	// AgentBinary is the dysco binary that runs the agents; empty means no
	// agents (a baseline with plain forwarding).
	AgentBinary string
	// AgentArgs, if set, returns extra arguments for the agent of h.
	AgentArgs func(h *Host) []string
	// ReadyTimeout bounds the wait for each agent's ready file;
	// zero means DefaultReadyTimeout.
	ReadyTimeout time.Duration
}

// Lab is a running lab. Its methods are safe for concurrent use.
type Lab struct {
	name    string
	cfg     Config
	runDir  string
	ly      *layout
	byName  map[string]*Host // hosts and router
	created time.Time

	mu     sync.Mutex
	agents map[string]*Proc // by host
	procs  []*Proc
	ready  bool
	down   bool
}

// Up builds a lab: its namespaces, links, addresses and routes, then starts
// the agents, if any, and waits until every agent has written its ready file.
// If anything fails, or ctx is cancelled, Up tears down what it built. It
// refuses to touch a lab of the same name that already exists.
func Up(ctx context.Context, cfg Config) (_ *Lab, err error) {
	ly, err := plan(cfg.Name, cfg.Topology)
	if err != nil {
		return nil, err
	}
	if cfg.AgentBinary != "" {
		bin, err := exec.LookPath(cfg.AgentBinary)
		if err != nil {
			return nil, fmt.Errorf("agent binary: %w (give the path of a dysco binary, or no binary for a lab without agents)", err)
		}
		if cfg.AgentBinary, err = filepath.Abs(bin); err != nil {
			return nil, err
		}
	}
	if cfg.ReadyTimeout <= 0 {
		cfg.ReadyTimeout = DefaultReadyTimeout
	}
	if err := checkAbsent(cfg.Name); err != nil {
		return nil, err
	}
	if err := os.MkdirAll(RunRoot, 0o755); err != nil {
		return nil, fmt.Errorf("creating %s: %w", RunRoot, err)
	}
	runDir := RunDir(cfg.Name)
	// Mkdir, not MkdirAll: the run directory is the lab's lock, so that two
	// Ups of the same name never both build.
	if err := os.Mkdir(runDir, 0o755); err != nil {
		if errors.Is(err, fs.ErrExist) {
			return nil, existsError(cfg.Name, runDir)
		}
		return nil, fmt.Errorf("creating run directory: %w", err)
	}
	l := &Lab{
		name:    cfg.Name,
		cfg:     cfg,
		runDir:  runDir,
		ly:      ly,
		byName:  make(map[string]*Host),
		created: time.Now(),
		agents:  make(map[string]*Proc),
	}
	for _, h := range ly.all() {
		l.byName[h.Name] = h
	}
	defer func() {
		if err != nil {
			if derr := l.Down(); derr != nil {
				err = errors.Join(err, fmt.Errorf("tearing down lab %s after the failure: %w (run `dysco lab down --name %s`)", l.name, derr, l.name))
			}
		}
	}()
	// The state file first: a crash from here on leaves enough for
	// DownByName and `dysco lab status`.
	if err := l.save(); err != nil {
		return nil, err
	}
	for _, h := range ly.all() {
		if err := ctx.Err(); err != nil {
			return nil, fmt.Errorf("building lab %s: %w", l.name, err)
		}
		if err := ipNetns("add", h.Namespace); err != nil {
			return nil, fmt.Errorf("creating namespace of host %s: %w", h.Name, err)
		}
	}
	if err := ctx.Err(); err != nil {
		return nil, fmt.Errorf("building lab %s: %w", l.name, err)
	}
	if err := configure(ctx, ly); err != nil {
		return nil, fmt.Errorf("building lab %s: %w", l.name, err)
	}
	if cfg.AgentBinary != "" {
		if err := l.startAgents(ctx); err != nil {
			return nil, fmt.Errorf("lab %s: %w", l.name, err)
		}
	}
	l.mu.Lock()
	l.ready = true
	l.mu.Unlock()
	if err := l.save(); err != nil {
		return nil, err
	}
	return l, nil
}

// checkAbsent fails if anything of a lab called name is on the system.
func checkAbsent(name string) error {
	if _, err := os.Stat(RunDir(name)); err == nil {
		return existsError(name, RunDir(name))
	}
	nss, err := listNetns(name + "-")
	if err != nil {
		return err
	}
	if len(nss) > 0 {
		return existsError(name, "namespaces "+fmt.Sprint(nss))
	}
	pins, _ := filepath.Glob(filepath.Join(PinRoot, name+"-*"))
	if len(pins) > 0 {
		return existsError(name, "BPF pin directories "+fmt.Sprint(pins))
	}
	return nil
}

func existsError(name, what string) error {
	return fmt.Errorf("lab %q already exists (%s): pick another name, or remove it with `dysco lab down --name %s`", name, what, name)
}

// Name returns the lab's name.
func (l *Lab) Name() string { return l.name }

// RunDir returns the lab's run directory, which holds the logs.
func (l *Lab) RunDir() string { return l.runDir }

// Hosts returns the hosts in topology order, without the router. The
// caller must not modify them.
func (l *Lab) Hosts() []*Host { return slices.Clone(l.ly.hosts) }

// Host returns the named host, "router" for the star's router, or nil if the
// lab has no such host. The caller must not modify it.
func (l *Lab) Host(name string) *Host { return l.byName[name] }

// Agent returns the agent of the named host, or nil if it has none.
func (l *Lab) Agent(host string) *Proc {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.agents[host]
}

func (l *Lab) host(name string) (*Host, error) {
	h := l.byName[name]
	if h == nil {
		names := make([]string, 0, len(l.byName))
		for _, h := range l.ly.all() {
			names = append(names, h.Name)
		}
		return nil, fmt.Errorf("lab %s has no host %q (its hosts: %v)", l.name, name, names)
	}
	return h, nil
}

// Command returns a command that runs argv in the namespace of host, through
// `ip netns exec`, which also gives it the namespace's view of /sys. Like
// exec.CommandContext, it is killed if ctx is done before it exits.
func (l *Lab) Command(ctx context.Context, host string, argv ...string) *exec.Cmd {
	h, err := l.host(host)
	if err != nil {
		cmd := exec.CommandContext(ctx, "false")
		cmd.Err = err
		return cmd
	}
	if len(argv) == 0 {
		cmd := exec.CommandContext(ctx, "false")
		cmd.Err = errors.New("lab: Command needs a program to run")
		return cmd
	}
	return exec.CommandContext(ctx, "ip", append([]string{"netns", "exec", h.Namespace}, argv...)...)
}

// procNameRE limits the names of background programs, which name log files.
var procNameRE = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9_.-]{0,31}$`)

// Start runs argv in the background in the namespace of host (through `ip
// netns exec`), with stdout and stderr appended to <rundir>/<host>.<name>.log.
// Name identifies the program; it must be unique among the programs of the
// host that are still running. Down stops it, if Proc.Stop has not.
//
// Start returns once the process is in the host's namespace (so that Down,
// or DownByName after a crash, finds it there), not once the program is
// ready: wait for what it offers (Dial a port) rather than for a while.
func (l *Lab) Start(host, name string, argv ...string) (*Proc, error) {
	h, err := l.host(host)
	if err != nil {
		return nil, err
	}
	if !procNameRE.MatchString(name) || name == "agent" {
		return nil, fmt.Errorf("program name %q is invalid: use up to 32 letters, digits, '.', '_' or '-', and not \"agent\"", name)
	}
	if len(argv) == 0 {
		return nil, fmt.Errorf("starting %s on %s: no program given", name, host)
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.down {
		return nil, fmt.Errorf("lab %s is down", l.name)
	}
	for _, p := range l.procs {
		if p.Host == host && p.Name == name {
			select {
			case <-p.done:
			default:
				return nil, fmt.Errorf("a program called %s is already running on %s (pid %d): stop it or pick another name", name, host, p.Pid())
			}
		}
	}
	full := append([]string{"ip", "netns", "exec", h.Namespace}, argv...)
	p, err := spawn(host, name, filepath.Join(l.runDir, host+"."+name+".log"), full)
	if err != nil {
		return nil, err
	}
	if err := p.waitNetns(h.Namespace, 10*time.Second); err != nil {
		p.Stop()
		return nil, fmt.Errorf("starting %s on %s: %w", name, host, err)
	}
	l.procs = slices.DeleteFunc(l.procs, func(q *Proc) bool { return q.Host == host && q.Name == name })
	l.procs = append(l.procs, p)
	return p, l.saveLocked()
}

// Down stops the lab's processes and every other process in its namespaces,
// deletes the namespaces and removes the run directory and the BPF pin
// directories. It is idempotent: it removes whatever of the lab is left.
func (l *Lab) Down() error {
	l.mu.Lock()
	l.down = true
	own := slices.Clone(l.procs)
	for _, p := range l.agents {
		own = append(own, p)
	}
	l.mu.Unlock()
	var nss []string
	for _, h := range l.ly.all() {
		nss = append(nss, h.Namespace)
	}
	return teardown(l.name, nss, own)
}

// DownByName removes the named lab using only what is on the system: the
// namespaces called "<name>-*", the state file and the pin directories. It
// works after the process that built the lab has died, and when nothing of
// the lab is left (then it does nothing).
func DownByName(name string) error {
	if err := ValidateLabName(name); err != nil {
		return err
	}
	var nss []string
	if st, err := ReadState(name); err == nil {
		nss = st.Namespaces
	}
	return teardown(name, nss, nil)
}

// teardown removes the lab called name: its own processes (stopped
// gracefully), every process in the namespaces known plus those called
// "<name>-*", the pin directories, the namespaces and the run directory.
func teardown(name string, known []string, own []*Proc) error {
	var errs []error
	if len(own) > 0 {
		if err := stopProcs(own); err != nil {
			errs = append(errs, err)
		}
	}
	found, err := listNetns(name + "-")
	if err != nil {
		errs = append(errs, err)
	}
	nss := union(known, found)
	if err := killNamespaces(nss); err != nil {
		errs = append(errs, err)
	}
	pins, _ := filepath.Glob(filepath.Join(PinRoot, name+"-*"))
	for _, ns := range nss {
		pins = union(pins, []string{PinDir(ns)})
	}
	for _, p := range pins {
		if err := os.RemoveAll(p); err != nil {
			errs = append(errs, fmt.Errorf("removing pin directory: %w", err))
		}
	}
	for _, ns := range nss {
		if netnsExists(ns) {
			if err := ipNetns("delete", ns); err != nil {
				errs = append(errs, err)
			}
		}
	}
	if err := os.RemoveAll(RunDir(name)); err != nil {
		errs = append(errs, fmt.Errorf("removing run directory: %w", err))
	}
	return errors.Join(errs...)
}

// killNamespaces kills every process in the namespaces: SIGTERM, and SIGKILL
// to those left after stopGrace. It polls the namespaces, so it also catches
// processes that were forked meanwhile.
func killNamespaces(nss []string) error {
	sig := syscall.SIGTERM
	deadline := time.Now().Add(stopGrace)
	signalled := make(map[int]syscall.Signal)
	for {
		var pids []int
		for _, ns := range nss {
			p, err := nsPids(ns)
			if err != nil {
				return err
			}
			pids = append(pids, p...)
		}
		if len(pids) == 0 {
			return nil
		}
		if time.Now().After(deadline) {
			if sig == syscall.SIGKILL {
				return fmt.Errorf("processes %v in namespaces %v survived SIGKILL", pids, nss)
			}
			sig, deadline = syscall.SIGKILL, time.Now().Add(killWait)
		}
		for _, pid := range pids {
			if signalled[pid] != sig {
				_ = syscall.Kill(pid, sig)
				signalled[pid] = sig
			}
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// union returns a followed by the elements of b that are not in a.
func union(a, b []string) []string {
	out := slices.Clone(a)
	for _, s := range b {
		if !slices.Contains(out, s) {
			out = append(out, s)
		}
	}
	return out
}

func (l *Lab) save() error {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.saveLocked()
}

func (l *Lab) saveLocked() error {
	if l.down {
		return nil
	}
	st := &State{
		Name:     l.name,
		Topology: l.cfg.Topology.withRoles(),
		Hosts:    l.ly.all(),
		Created:  l.created,
		Ready:    l.ready,
	}
	for _, h := range l.ly.all() {
		st.Namespaces = append(st.Namespaces, h.Namespace)
	}
	ps := func(p *Proc) ProcState {
		return ProcState{Host: p.Host, Name: p.Name, Pid: p.Pid(), Log: p.Log, Argv: p.Argv}
	}
	for _, h := range l.ly.hosts {
		if p := l.agents[h.Name]; p != nil {
			st.Agents = append(st.Agents, ps(p))
		}
	}
	for _, p := range l.procs {
		st.Procs = append(st.Procs, ps(p))
	}
	return writeState(l.runDir, st)
}
