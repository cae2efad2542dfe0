package cli

import (
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestResetDatapath: --reset removes the pin directory, says so when there
// is nothing to remove, and refuses while an agent answers on its socket.
func TestResetDatapath(t *testing.T) {
	sock := fmt.Sprintf("@dysco-test-reset-%d", os.Getpid())
	dir := filepath.Join(t.TempDir(), "pins")
	if err := os.MkdirAll(filepath.Join(dir, "links"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "dysco_sessions"), nil, 0o600); err != nil {
		t.Fatal(err)
	}

	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	var out strings.Builder
	err = resetDatapath(&out, dir, sock)
	if err == nil || !strings.Contains(err.Error(), "an agent is running") {
		t.Fatalf("with an agent answering: err = %v, want a refusal", err)
	}
	if _, err := os.Stat(dir); err != nil {
		t.Fatalf("refused reset touched the pins: %v", err)
	}
	l.Close()

	out.Reset()
	if err := resetDatapath(&out, dir, sock); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(dir); !os.IsNotExist(err) {
		t.Errorf("pin directory still there after reset (stat: %v)", err)
	}
	if !strings.Contains(out.String(), "removed the pinned datapath "+dir) {
		t.Errorf("output %q does not say what was removed", out.String())
	}

	out.Reset()
	if err := resetDatapath(&out, dir, sock); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(out.String(), "nothing pinned at "+dir) {
		t.Errorf("second reset said %q, want that nothing was pinned", out.String())
	}
}
