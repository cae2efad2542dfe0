package api

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strings"
	"testing"

	"github.com/dysco/dysco/internal/testutil"
)

// A process of an unprivileged user that binds the agent's socket name
// first is refused before anything is sent to it, with its pid and uid
// named; with DYSCO_AGENT_UID naming its uid, the same process is talked to
// (which shows that the squatter would otherwise be believed).
func TestSquattedSocketRefused(t *testing.T) {
	name := fmt.Sprintf("@dysco-test-squat-%d", os.Getpid())
	sq := testutil.Squat(t, name, "")

	_, err := NewUnixClient(name).Status(context.Background())
	var imp *ImpostorError
	if !errors.As(err, &imp) {
		t.Fatalf("status from a squatted socket: %v, want an ImpostorError", err)
	}
	if imp.PID != int32(sq.PID) || imp.UID != testutil.NobodyUID || imp.WantUID != 0 {
		t.Errorf("impostor %+v, want pid %d uid %d", imp, sq.PID, testutil.NobodyUID)
	}
	for _, w := range []string{name, fmt.Sprintf("pid %d", sq.PID), fmt.Sprintf("uid %d", testutil.NobodyUID), "nothing was sent"} {
		if !strings.Contains(err.Error(), w) {
			t.Errorf("error %q does not say %q", err, w)
		}
	}
	if n := sq.Conn(t); n != 0 {
		t.Errorf("the squatter got %d bytes", n)
	}

	t.Setenv(AgentUIDEnv, fmt.Sprint(testutil.NobodyUID))
	st, err := NewUnixClient(name).Status(context.Background())
	if err != nil || st.Name != "impostor" {
		t.Fatalf("with %s=%d: %+v %v", AgentUIDEnv, testutil.NobodyUID, st, err)
	}
	if n := sq.Conn(t); n == 0 {
		t.Error("the squatter got no request")
	}

	t.Setenv(AgentUIDEnv, "root")
	if _, err := NewUnixClient(name).Status(context.Background()); err == nil || !strings.Contains(err.Error(), "not a user id") {
		t.Errorf("%s=root: %v", AgentUIDEnv, err)
	}
}
