package lab

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// TapName is the session-view tap the agents of middlebox hosts offer
// (a veth end that capture tools listen on).
const TapName = "dysco-tap"

// bpffsRoot is where the agents pin their maps and links.
const bpffsRoot = "/sys/fs/bpf"

// readyPoll is how often Up looks for ready files.
const readyPoll = 10 * time.Millisecond

// ensureBPFFS mounts a bpffs at /sys/fs/bpf unless one is there.
func ensureBPFFS() error {
	var st unix.Statfs_t
	if err := unix.Statfs(bpffsRoot, &st); err == nil && st.Type == unix.BPF_FS_MAGIC {
		return nil
	}
	if err := os.MkdirAll(bpffsRoot, 0o755); err != nil {
		return fmt.Errorf("creating %s: %w", bpffsRoot, err)
	}
	if err := unix.Mount("bpf", bpffsRoot, "bpf", 0, ""); err != nil {
		return fmt.Errorf("mounting a bpffs on %s (the agents pin their datapath there): %w", bpffsRoot, err)
	}
	return nil
}

// agentArgv returns the command line of h's agent. nsenter --net, not ip
// netns exec: the latter remounts /sys, which hides the bpffs pins.
func (l *Lab) agentArgv(h *Host, ready string) []string {
	argv := []string{
		"nsenter", "--net=" + filepath.Join(netnsDir, h.Namespace), "--",
		l.cfg.AgentBinary, "agent",
		"--name", h.Name,
		"--ready-file", ready,
		"--pin-dir", PinDir(h.Namespace),
		// Local policies live and die with the lab.
		"--state-dir", filepath.Join(l.runDir, h.Name+".state"),
		// One deployment secret per lab, in a key file of each host's
		// own (ControlKeyFile: a test rotates them host by host):
		// reconfiguration messages between its agents are
		// authenticated with it.
		"--control-key-file", l.ControlKeyFile(h.Name),
	}
	if h.Role == RoleMiddlebox {
		argv = append(argv, "--tap", TapName)
	}
	if h.SessionAddr4.IsValid() {
		argv = append(argv, "--session-addr", h.SessionAddr4.String()+","+h.SessionAddr6.String())
	}
	if l.cfg.AgentArgs != nil {
		argv = append(argv, l.cfg.AgentArgs(h)...)
	}
	return argv
}

// startAgent starts h's agent without waiting for it.
func (l *Lab) startAgent(h *Host) (*Proc, error) {
	ready := filepath.Join(l.runDir, h.Name+".ready")
	if err := os.Remove(ready); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return nil, err
	}
	if err := os.MkdirAll(PinDir(h.Namespace), 0o755); err != nil {
		return nil, fmt.Errorf("creating pin directory of %s: %w", h.Name, err)
	}
	if err := l.writeKeyFile(h.Name); err != nil {
		return nil, err
	}
	p, err := spawn(h.Name, "agent", filepath.Join(l.runDir, h.Name+".agent.log"), l.agentArgv(h, ready))
	if err != nil {
		return nil, err
	}
	p.ready = ready
	return p, nil
}

// startAgents starts one agent per host (not the router) and waits until
// all are ready.
func (l *Lab) startAgents(ctx context.Context) error {
	if err := ensureBPFFS(); err != nil {
		return err
	}
	var started []*Proc
	for _, h := range l.ly.hosts {
		p, err := l.startAgent(h)
		if err != nil {
			return err
		}
		l.mu.Lock()
		l.agents[h.Name] = p
		l.mu.Unlock()
		started = append(started, p)
	}
	if err := l.save(); err != nil {
		return err
	}
	return waitReady(ctx, started, l.cfg.ReadyTimeout)
}

// waitReady waits until every agent has written its ready file. It fails as
// soon as one exits, with the end of its log, or at the deadline.
func waitReady(ctx context.Context, ps []*Proc, timeout time.Duration) error {
	deadline := time.NewTimer(timeout)
	defer deadline.Stop()
	tick := time.NewTicker(readyPoll)
	defer tick.Stop()
	pending := ps
	for {
		var still []*Proc
		for _, p := range pending {
			// Exit first: an agent that wrote its ready file and died is
			// not ready.
			select {
			case <-p.done:
				return fmt.Errorf("agent on %s exited before it was ready (%v); last lines of %s:\n%s",
					p.Host, p.err, p.Log, logTail(p.Log, 20))
			default:
			}
			if _, err := os.Stat(p.ready); err != nil {
				still = append(still, p)
			}
		}
		pending = still
		if len(pending) == 0 {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("waiting for agents: %w", ctx.Err())
		case <-deadline.C:
			var msgs []string
			for _, p := range pending {
				msgs = append(msgs, fmt.Sprintf("agent on %s (pid %d) wrote no ready file %s within %v; last lines of %s:\n%s",
					p.Host, p.Pid(), p.ready, timeout, p.Log, logTail(p.Log, 10)))
			}
			return fmt.Errorf("%s\n(raise Config.ReadyTimeout if the agents are slow to start)", strings.Join(msgs, "\n"))
		case <-tick.C:
		case <-pending[0].done:
		}
	}
}

// RestartAgent stops the agent of host (SIGTERM, then waits for it to exit)
// and starts a new one, with the same arguments, and waits until it is
// ready. The pin directory is kept: that is what lets a restarted agent pick
// up live sessions.
func (l *Lab) RestartAgent(host string) error {
	h, err := l.host(host)
	if err != nil {
		return err
	}
	l.mu.Lock()
	old := l.agents[host]
	down := l.down
	l.mu.Unlock()
	if down {
		return fmt.Errorf("lab %s is down", l.name)
	}
	if old == nil {
		return fmt.Errorf("lab %s has no agent on %s (agents run only when Config.AgentBinary is set, and not on the router)", l.name, host)
	}
	if err := old.Stop(); err != nil {
		return fmt.Errorf("stopping agent on %s: %w", host, err)
	}
	p, err := l.startAgent(h)
	if err != nil {
		return err
	}
	l.mu.Lock()
	l.agents[host] = p
	err = l.saveLocked()
	l.mu.Unlock()
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(context.Background(), l.cfg.ReadyTimeout)
	defer cancel()
	return waitReady(ctx, []*Proc{p}, l.cfg.ReadyTimeout)
}

// ControlKeyFile is the control key file of host's agent.
func (l *Lab) ControlKeyFile(host string) string {
	return filepath.Join(l.runDir, host+".control.key")
}

// writeKeyFile writes host's control key file, if it has none yet, with
// the lab's deployment secret (control.key in the run directory, made
// with a random secret the first time). Both are mode 0600, as the agent
// demands. An existing host file is kept: a restarted agent goes on with
// the keys it had.
func (l *Lab) writeKeyFile(host string) error {
	secret := filepath.Join(l.runDir, "control.key")
	if _, err := os.Stat(secret); errors.Is(err, fs.ErrNotExist) {
		k := make([]byte, 32)
		if _, err := rand.Read(k); err != nil {
			return err
		}
		if err := writeNew(secret, "# the lab's deployment secret\n"+hex.EncodeToString(k)+"\n"); err != nil {
			return fmt.Errorf("lab deployment secret: %w", err)
		}
	}
	p := l.ControlKeyFile(host)
	if _, err := os.Stat(p); err == nil {
		return nil
	}
	b, err := os.ReadFile(secret)
	if err != nil {
		return fmt.Errorf("lab deployment secret: %w", err)
	}
	if err := writeNew(p, string(b)); err != nil {
		return fmt.Errorf("control key file of %s: %w", host, err)
	}
	return nil
}

// writeNew creates path with mode 0600 (whatever the umask) and writes text.
func writeNew(path, text string) error {
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return err
	}
	if err := f.Chmod(0o600); err != nil {
		f.Close()
		return err
	}
	if _, err := f.WriteString(text); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}
