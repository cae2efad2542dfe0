package lab

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/dysco/dysco/internal/keys"
	"golang.org/x/sys/unix"
)

// The lab's key files are mode 0600 whatever the umask (the agent refuses
// others), each host's holds the lab's deployment secret, and a host's
// file, once written, is kept (a rotation test edits it).
func TestLabKeyFiles(t *testing.T) {
	old := unix.Umask(0)
	defer unix.Umask(old)
	l := &Lab{runDir: t.TempDir()}
	if err := l.writeKeyFile("client"); err != nil {
		t.Fatal(err)
	}
	if err := l.writeKeyFile("server"); err != nil {
		t.Fatal(err)
	}
	var ids []string
	for _, p := range []string{filepath.Join(l.runDir, "control.key"), l.ControlKeyFile("client"), l.ControlKeyFile("server")} {
		fi, err := os.Stat(p)
		if err != nil {
			t.Fatal(err)
		}
		if fi.Mode().Perm() != 0o600 {
			t.Errorf("%s: mode %04o, want 0600", p, fi.Mode().Perm())
		}
		r, err := keys.Load(p, os.Geteuid())
		if err != nil {
			t.Fatal(err)
		}
		ids = append(ids, r.IDs()[0])
	}
	if ids[0] != ids[1] || ids[0] != ids[2] {
		t.Fatalf("key ids %v: want the lab's secret everywhere", ids)
	}
	edited := "# rotated\n00112233445566778899aabbccddeeff\n"
	if err := os.WriteFile(l.ControlKeyFile("client"), []byte(edited), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := l.writeKeyFile("client"); err != nil {
		t.Fatal(err)
	}
	if b, _ := os.ReadFile(l.ControlKeyFile("client")); string(b) != edited {
		t.Fatalf("a restart rewrote the host's key file: %q", b)
	}
}
