package api

import (
	"fmt"
	"net"
	"os"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// AgentUIDEnv names the environment variable that sets the user id the
// agent's socket must be served by (CheckAgentPeer), for an agent run as a
// dedicated user with capabilities; unset: root (0). libdysco reads it too.
const AgentUIDEnv = "DYSCO_AGENT_UID"

// ImpostorError says that the agent's socket is served by a process of
// another user than the agent's: any local user can bind an abstract
// socket's name before the agent does. Nothing was sent to it.
type ImpostorError struct {
	Socket  string
	PID     int32
	UID     uint32
	WantUID uint32
	Command string // the process's name, when readable
}

func (e *ImpostorError) Error() string {
	who := fmt.Sprintf("pid %d", e.PID)
	if e.Command != "" {
		who += " (" + e.Command + ")"
	}
	return fmt.Sprintf("%s is served by %s of uid %d, not by the agent's uid %d: another user bound the name "+
		"before the agent; nothing was sent to it. Stop that process, then (re)start the agent "+
		"(%s sets another uid for an agent not run as root)", e.Socket, who, e.UID, e.WantUID, AgentUIDEnv)
}

// AgentUID is the user id the agent's socket must be served by: $DYSCO_AGENT_UID,
// or 0.
func AgentUID() (uint32, error) {
	v, ok := os.LookupEnv(AgentUIDEnv)
	if !ok || strings.TrimSpace(v) == "" {
		return 0, nil
	}
	n, err := strconv.ParseUint(strings.TrimSpace(v), 10, 32)
	if err != nil {
		return 0, fmt.Errorf("%s=%q is not a user id", AgentUIDEnv, v)
	}
	return uint32(n), nil
}

// CheckAgentPeer checks, with SO_PEERCRED, that the process serving the
// Unix connection c runs as the agent's user (AgentUID): before anything is
// sent on it.
func CheckAgentPeer(c net.Conn, socket string) error {
	want, err := AgentUID()
	if err != nil {
		return err
	}
	uc, ok := c.(*net.UnixConn)
	if !ok {
		return fmt.Errorf("%s: not a Unix socket connection", socket)
	}
	raw, err := uc.SyscallConn()
	if err != nil {
		return err
	}
	var cred *unix.Ucred
	var cerr error
	if err := raw.Control(func(fd uintptr) {
		cred, cerr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED)
	}); err != nil {
		return err
	}
	if cerr != nil {
		return fmt.Errorf("%s: cannot read the credentials of the process serving it: %w", socket, cerr)
	}
	if cred.Uid == want {
		return nil
	}
	e := &ImpostorError{Socket: socket, PID: cred.Pid, UID: cred.Uid, WantUID: want}
	if b, err := os.ReadFile(fmt.Sprintf("/proc/%d/comm", cred.Pid)); err == nil {
		e.Command = strings.TrimSpace(string(b))
	}
	return e
}
