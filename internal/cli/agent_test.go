package cli

import (
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/dysco/dysco/internal/datapath"
	"github.com/dysco/dysco/internal/testutil"
	"golang.org/x/sys/unix"
)

// TestResetRefusesOtherDirectories: --reset removes nothing that is not on a
// bpffs (a mistyped --pin-dir), and says why.
func TestResetRefusesOtherDirectories(t *testing.T) {
	dir := t.TempDir()
	keep := filepath.Join(dir, "precious")
	if err := os.WriteFile(keep, []byte("x"), 0o600); err != nil {
		t.Fatal(err)
	}
	var out strings.Builder
	err := resetDatapath(&out, dir, fmt.Sprintf("@dysco-test-reset-none-%d", os.Getpid()))
	if err == nil || !strings.Contains(err.Error(), "not on a bpffs") {
		t.Fatalf("reset of %s: err = %v, want a refusal", dir, err)
	}
	if _, err := os.Stat(keep); err != nil {
		t.Fatalf("refused reset removed a file: %v", err)
	}
}

// TestResetDatapath: --reset removes a pin directory, says so when there is
// nothing to remove, and refuses while an agent answers on its socket.
func TestResetDatapath(t *testing.T) {
	testutil.RequireRoot(t, "makes a directory on the bpffs")
	if !datapath.OnBPFFS("/sys/fs/bpf") {
		if err := unix.Mount("bpf", "/sys/fs/bpf", "bpf", 0, ""); err != nil {
			t.Fatalf("mounting a bpffs on /sys/fs/bpf: %v", err)
		}
	}
	sock := fmt.Sprintf("@dysco-test-reset-%d", os.Getpid())
	dir := "/sys/fs/bpf/dysco-test/" + t.Name()
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	if err := os.MkdirAll(filepath.Join(dir, "links"), 0o700); err != nil {
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

// TestAgentUDPFlags: the UDP timeouts and the drain time are checked before
// the agent starts, with the bounds in the message.
func TestAgentUDPFlags(t *testing.T) {
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"--udp-drain", "10s"}, "--udp-drain 10s: want more than 0 and at most 7.5s"},
		{[]string{"--udp-drain", "0s"}, "--udp-drain 0s: want more than 0"},
		{[]string{"--udp-timeout", "500ms"}, "--udp-timeout 500ms: want 1s to 18h"},
		{[]string{"--udp-stream-timeout", "19h"}, "--udp-stream-timeout 19h0m0s: want 1s to 18h"},
	} {
		out, err := runDysco(t, append([]string{"agent"}, c.args...)...)
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("dysco agent %s: %v, want %q\n%s", strings.Join(c.args, " "), err, c.want, out)
		}
	}
}
