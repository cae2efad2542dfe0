// Package nf runs the network functions an agent starts on demand: when a
// reconfiguration asks this host to join a new path and names the function
// it must run (paper heterogeneous-sfc-quic §IV: "Agents running on
// processor-based middleboxes can adjust (reconfigure) middlebox
// functionality by starting/terminating VNF processes. The need for a
// specific VNF can be included in the control packet during service chain
// modification").
//
// A function is a shell command (its process group is the function), a
// readiness check polled until it succeeds, an optional command that
// cleans up after the process is gone, and an idle time after which an
// unused function is stopped.
package nf

import (
	"fmt"
	"regexp"
	"strings"
	"time"
)

// Defaults and bounds of a Spec.
const (
	// DefaultStartTimeout bounds a start: the readiness check must succeed
	// within it.
	DefaultStartTimeout = 10 * time.Second
	// MaxStartTimeout bounds StartTimeout: the new path's set-up waits for
	// the start while the old path's agents hold their locks, whose lease
	// is 30 s (docs/protocol.md, "Timers and back-off").
	MaxStartTimeout = 20 * time.Second
	// MaxNameLen bounds a name (it travels in the control message).
	MaxNameLen = 32
	// StopGrace is the time between SIGTERM and SIGKILL when a function
	// is stopped.
	StopGrace = 2 * time.Second
	// stopCmdTimeout bounds a stop command.
	stopCmdTimeout = 10 * time.Second
)

var nameRE = regexp.MustCompile(`^[A-Za-z][A-Za-z0-9_-]*$`)

// ValidName reports why s is not a network function name (nil: it is
// one): a letter, then letters, digits, '_' and '-', at most MaxNameLen
// bytes.
func ValidName(s string) error {
	if len(s) == 0 || len(s) > MaxNameLen || !nameRE.MatchString(s) {
		return fmt.Errorf("network function name %q: want a letter, then letters, digits, '_' or '-', at most %d characters", s, MaxNameLen)
	}
	return nil
}

// Spec is one network function an agent can start.
type Spec struct {
	Name string
	// Start is run with /bin/sh -c in its own process group; the
	// function runs as long as it does.
	Start string
	// Ready is run with /bin/sh -c until it exits 0 (back-off from 20 ms
	// to 500 ms); empty: ready once started.
	Ready string
	// Stop, if set, is run with /bin/sh -c after the function's processes
	// are gone (stopped, or exited by themselves): it cleans up what the
	// function left (rules, files).
	Stop string
	// StopIdle stops the function once it has served no session, nor been
	// asked for, for this long; 0: never.
	StopIdle time.Duration
	// StartTimeout bounds a start (0: DefaultStartTimeout).
	StartTimeout time.Duration
}

// ParseFlags reads the values of the agent's repeated --nf flag, one
// attribute each: NAME.KEY=VALUE, KEY one of start, ready, stop,
// stop-idle, start-timeout. The value is the rest of the flag, so that a
// command may contain any character. Every function needs a start
// command.
func ParseFlags(vals []string) ([]Spec, error) {
	var order []string
	specs := map[string]*Spec{}
	for _, v := range vals {
		lhs, val, ok := strings.Cut(v, "=")
		name, key, ok2 := strings.Cut(lhs, ".")
		if !ok || !ok2 {
			return nil, fmt.Errorf("--nf %q: want NAME.KEY=VALUE (KEY: start, ready, stop, stop-idle or start-timeout)", v)
		}
		if err := ValidName(name); err != nil {
			return nil, fmt.Errorf("--nf %q: %w", v, err)
		}
		s := specs[name]
		if s == nil {
			s = &Spec{Name: name}
			specs[name] = s
			order = append(order, name)
		}
		dur := func() (time.Duration, error) {
			d, err := time.ParseDuration(strings.TrimSpace(val))
			if err != nil || d < 0 {
				return 0, fmt.Errorf("--nf %s.%s=%q: want a duration such as 30s or 2m (0: never)", name, key, val)
			}
			return d, nil
		}
		var err error
		switch key {
		case "start":
			s.Start = val
		case "ready":
			s.Ready = val
		case "stop":
			s.Stop = val
		case "stop-idle":
			s.StopIdle, err = dur()
		case "start-timeout":
			s.StartTimeout, err = dur()
			if err == nil && (s.StartTimeout <= 0 || s.StartTimeout > MaxStartTimeout) {
				err = fmt.Errorf("--nf %s.start-timeout=%s: want more than 0 and at most %s (the locks of the old path are leased for 30 s)", name, val, MaxStartTimeout)
			}
		default:
			err = fmt.Errorf("--nf %q: unknown key %q (start, ready, stop, stop-idle or start-timeout)", v, key)
		}
		if err != nil {
			return nil, err
		}
	}
	out := make([]Spec, 0, len(order))
	for _, n := range order {
		s := specs[n]
		if strings.TrimSpace(s.Start) == "" {
			return nil, fmt.Errorf("--nf %s: no start command (--nf %s.start=CMD)", n, n)
		}
		out = append(out, *s)
	}
	return out, nil
}
