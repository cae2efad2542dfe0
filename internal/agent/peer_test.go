package agent

import (
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/dysco/dysco/internal/testutil"
)

// TestAPIRefusesOtherUsers: the local API answers root, and closes the
// connection of another user before reading a byte, counted and logged.
func TestAPIRefusesOtherUsers(t *testing.T) {
	testutil.RequireRoot(t, "to connect as another user")
	testutil.RequireTools(t, "setpriv", "curl")
	name := fmt.Sprintf("dysco-peer-test-%d", os.Getpid())
	ln, err := net.Listen("unix", "@"+name)
	if err != nil {
		t.Fatal(err)
	}
	var refused atomic.Uint64
	var logged strings.Builder
	var logMu = make(chan struct{}, 1)
	logMu <- struct{}{}
	log := slog.New(slog.NewTextHandler(lockedWriter{&logged, logMu}, nil))
	var served atomic.Uint64
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		served.Add(1)
		io.WriteString(w, "ok")
	})}
	go srv.Serve(&rootOnly{Listener: ln, log: log, refused: &refused})
	t.Cleanup(func() { srv.Close() })

	curl := func(asNobody bool) (string, error) {
		args := []string{"curl", "-sS", "--max-time", "10", "--abstract-unix-socket", name, "http://dysco-agent/v1/status"}
		if asNobody {
			id := strconv.Itoa(testutil.NobodyUID)
			args = append([]string{"setpriv", "--reuid", id, "--regid", id, "--clear-groups", "--"}, args...)
		}
		out, err := exec.Command(args[0], args[1:]...).CombinedOutput()
		return string(out), err
	}
	if out, err := curl(false); err != nil || out != "ok" {
		t.Fatalf("root: %q, %v", out, err)
	}
	for i := 0; i < 3; i++ {
		if out, err := curl(true); err == nil {
			t.Fatalf("uid %d was answered: %q", testutil.NobodyUID, out)
		}
	}
	if served.Load() != 1 {
		t.Errorf("handler ran %d times, want once (root's request only)", served.Load())
	}
	if refused.Load() != 3 {
		t.Errorf("refused %d peers, want 3", refused.Load())
	}
	<-logMu
	l := logged.String()
	logMu <- struct{}{}
	if n := strings.Count(l, "refused a peer that is not root"); n != 1 {
		t.Errorf("refusals logged %d times, want once a minute:\n%s", n, l)
	}
	if !strings.Contains(l, "uid="+strconv.Itoa(testutil.NobodyUID)) {
		t.Errorf("log does not name the uid:\n%s", l)
	}
}

// lockedWriter serialises writes to a strings.Builder.
type lockedWriter struct {
	b  *strings.Builder
	mu chan struct{}
}

func (w lockedWriter) Write(p []byte) (int, error) {
	<-w.mu
	defer func() { w.mu <- struct{}{} }()
	return w.b.Write(p)
}
