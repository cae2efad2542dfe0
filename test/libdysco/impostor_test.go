package libdysco_test

import (
	"fmt"
	"os"
	"strings"
	"testing"

	"github.com/dysco/dysco/internal/testutil"
)

// TestSpliceImpostor: a process of an unprivileged user serves the agent's
// socket name. dysco_splice refuses it (EACCES) without sending it
// anything, and logs its pid and uid; the proxy goes on relaying.
func TestSpliceImpostor(t *testing.T) {
	const line = "hello\n"
	name := fmt.Sprintf("@dysco-test-%d-squat-%d", os.Getpid(), agentCount.Add(1))
	sq := testutil.Squat(t, name, "")
	be := startBackend(t, "127.0.0.1", "")
	host, port := be.hostPort()
	p := startProxy(t, []string{"DYSCO_AGENT_SOCKET=" + name, "DYSCO_AGENT_UID=0"}, lenProxy, "127.0.0.1", host, port, "add")
	c := dial(t, "127.0.0.1", p.port)
	rest := randomBytes(1000)
	exchange(t, c, append([]byte(line), rest...), append([]byte("X-Len: "+line), rest...), nil)
	p.wait(t)
	s := p.stderr.String()
	for _, w := range []string{"lenproxy: dysco_splice: Permission denied",
		fmt.Sprintf("%s is served by pid %d of uid %d", name, sq.PID, testutil.NobodyUID), "nothing sent to it"} {
		if !strings.Contains(s, w) {
			t.Errorf("stderr does not say %q:\n%s", w, s)
		}
	}
	if n := sq.Conn(t); n != 0 {
		t.Errorf("the impostor got %d bytes", n)
	}
}
