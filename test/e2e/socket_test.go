package e2e

import (
	"fmt"
	"os"
	"os/exec"
	"strings"
	"testing"

	"github.com/dysco/dysco/internal/api"
	"github.com/dysco/dysco/internal/testutil"
)

// TestSquattedAgentSocket: in a network namespace with no agent yet, an
// unprivileged user binds the agent's socket name first. Root's CLI
// refuses to talk to it: nothing is sent, and the error names the
// impostor's pid and uid.
func TestSquattedAgentSocket(t *testing.T) {
	testutil.RequireRoot(t, "to make a network namespace")
	testutil.RequireTools(t, "ip", "setpriv")
	ns := fmt.Sprintf("c-squat-%d", os.Getpid())
	if out, err := exec.Command("ip", "netns", "add", ns).CombinedOutput(); err != nil {
		t.Fatalf("ip netns add: %v: %s", err, out)
	}
	t.Cleanup(func() { exec.Command("ip", "netns", "del", ns).Run() })
	sq := testutil.Squat(t, api.AgentSocket, ns)

	for _, args := range [][]string{
		{"status"},
		{"policy", "add", "web", "--chain", "10.0.2.2", "tcp dst port 80"},
		{"agent", "--reset"},
	} {
		out, err := exec.Command("ip", append([]string{"netns", "exec", ns, dyscoBin}, args...)...).CombinedOutput()
		if err == nil {
			t.Fatalf("dysco %s through a squatted socket succeeded: %s", strings.Join(args, " "), out)
		}
		for _, w := range []string{api.AgentSocket + " is served by", fmt.Sprintf("pid %d", sq.PID),
			fmt.Sprintf("uid %d", testutil.NobodyUID), "nothing was sent"} {
			if !strings.Contains(string(out), w) {
				t.Errorf("dysco %s: %q does not say %q", strings.Join(args, " "), out, w)
			}
		}
		if n := sq.Conn(t); n != 0 {
			t.Errorf("dysco %s: the squatter got %d bytes", strings.Join(args, " "), n)
		}
	}
}
