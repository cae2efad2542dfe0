package lab

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"time"
)

// RunRoot holds one run directory per lab: /run/dysco/lab/<name>/, with the
// state file, the agents' ready files and every process's log.
const RunRoot = "/run/dysco/lab"

// PinRoot holds the agents' BPF pin directories, one per namespace:
// /sys/fs/bpf/dysco/<namespace>.
const PinRoot = "/sys/fs/bpf/dysco"

// stateFile is the name of the state file in a lab's run directory.
const stateFile = "state.json"

// RunDir returns the run directory of the named lab.
func RunDir(name string) string { return filepath.Join(RunRoot, name) }

// PinDir returns the BPF pin directory of a namespace.
func PinDir(namespace string) string { return filepath.Join(PinRoot, namespace) }

// State is what a lab's state file holds: enough to show the lab and to tear
// it down from another process, also after the process that built it died.
type State struct {
	// Name is the lab's name.
	Name string `json:"name"`
	// Topology is the topology the lab was built from.
	Topology Topology `json:"topology"`
	// Hosts are the hosts in topology order, then the router if any.
	Hosts []*Host `json:"hosts"`
	// Namespaces are the namespaces of the lab, created or about to be.
	Namespaces []string `json:"namespaces"`
	// Agents are the agents, one per non-router host, if the lab has any.
	Agents []ProcState `json:"agents,omitempty"`
	// Procs are the background programs started with Start.
	Procs []ProcState `json:"procs,omitempty"`
	// Created is when Up began.
	Created time.Time `json:"created"`
	// Ready says whether Up finished.
	Ready bool `json:"ready"`
}

// ProcState is a process of the lab.
type ProcState struct {
	// Host and Name identify the process, as in Proc.
	Host string `json:"host"`
	Name string `json:"name"`
	// Pid is its process id when it was started.
	Pid int `json:"pid"`
	// Log receives its stdout and stderr.
	Log string `json:"log"`
	// Argv is its command line.
	Argv []string `json:"argv"`
	// Alive is filled in by ReadState: the process exists and is in its
	// host's namespace.
	Alive bool `json:"-"`
}

// Labs returns the names of the labs that have a run directory, sorted.
func Labs() ([]string, error) {
	ents, err := os.ReadDir(RunRoot)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	var names []string
	for _, e := range ents {
		if e.IsDir() && ValidateLabName(e.Name()) == nil {
			names = append(names, e.Name())
		}
	}
	sort.Strings(names)
	return names, nil
}

// ReadState reads the named lab's state file and fills in which of its
// processes are alive.
func ReadState(name string) (*State, error) {
	if err := ValidateLabName(name); err != nil {
		return nil, err
	}
	path := filepath.Join(RunDir(name), stateFile)
	data, err := os.ReadFile(path)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, fmt.Errorf("lab %q has no state file %s: it is not up (or was built by a crashed process; `dysco lab down --name %s` removes what is left)", name, path, name)
	}
	if err != nil {
		return nil, err
	}
	var st State
	if err := json.Unmarshal(data, &st); err != nil {
		return nil, fmt.Errorf("state file %s: %w", path, err)
	}
	ns := make(map[string]string)
	for _, h := range st.Hosts {
		ns[h.Name] = h.Namespace
	}
	for _, ps := range []([]ProcState){st.Agents, st.Procs} {
		for i := range ps {
			ps[i].Alive = pidInNetns(ps[i].Pid, ns[ps[i].Host])
		}
	}
	return &st, nil
}

// writeState replaces the state file atomically.
func writeState(dir string, st *State) error {
	data, err := json.MarshalIndent(st, "", "  ")
	if err != nil {
		return err
	}
	tmp := filepath.Join(dir, stateFile+".tmp")
	if err := os.WriteFile(tmp, append(data, '\n'), 0o644); err != nil {
		return fmt.Errorf("writing lab state: %w", err)
	}
	if err := os.Rename(tmp, filepath.Join(dir, stateFile)); err != nil {
		return fmt.Errorf("writing lab state: %w", err)
	}
	return nil
}
