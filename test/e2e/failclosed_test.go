package e2e

import (
	"encoding/binary"
	"errors"
	"fmt"
	"hash/fnv"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/dysco/dysco/internal/api"
	"github.com/dysco/dysco/internal/lab"
	"github.com/dysco/dysco/internal/testutil"
)

// runPolicyServer starts `dysco policy-server` on db, insecure on loopback
// (the test is about the database; TestMgmtAuth is about TLS), and returns
// its URL and a function that stops it (SIGTERM) and checks that it exited
// cleanly.
func runPolicyServer(t *testing.T, db string) (string, func()) {
	t.Helper()
	ready := filepath.Join(t.TempDir(), "ready")
	w := testutil.NewFileWaiter(t, ready)
	cmd := exec.Command(dyscoBin, "policy-server", "--insecure", "--metrics-listen", "", "--listen", "127.0.0.1:0", "--db", db, "--ready-file", ready)
	var out strings.Builder
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	url := "http://" + w.Wait(t)
	stopped := false
	stop := func() {
		if stopped {
			return
		}
		stopped = true
		cmd.Process.Signal(syscall.SIGTERM)
		if err := cmd.Wait(); err != nil {
			t.Errorf("policy server: %v\n%s", err, out.String())
		}
	}
	t.Cleanup(stop)
	return url, stop
}

func dyscoOut(args ...string) (string, error) {
	out, err := exec.Command(dyscoBin, args...).CombinedOutput()
	return string(out), err
}

// TestPolicyServerFailsClosed: with the real binary, a type a policy uses
// cannot be deleted; a database whose freelist page was overwritten (which
// made bbolt panic) stops the server with a clear error and no panic;
// `policy-server check` says what is wrong; the copy of the last sound
// start brings the policies back.
func TestPolicyServerFailsClosed(t *testing.T) {
	db := filepath.Join(t.TempDir(), "policy.db")
	url, stop := runPolicyServer(t, db)
	for _, args := range [][]string{
		{"type", "add", "fw", "10.0.0.5", "--server", url},
		{"policy", "add", "web", "--server", url, "--chain", "fw", "tcp dst port 80"},
	} {
		if out, err := dyscoOut(args...); err != nil {
			t.Fatalf("dysco %s: %v\n%s", strings.Join(args, " "), err, out)
		}
	}
	out, err := dyscoOut("type", "rm", "fw", "--server", url)
	if err == nil || !strings.Contains(out, `type "fw" is used by policy web`) {
		t.Errorf("type rm of a type in use: %v\n%s", err, out)
	}
	if out, err := dyscoOut("type", "list", "--server", url); err != nil || !strings.Contains(out, "fw") {
		t.Errorf("after a refused rm, type list: %v\n%s", err, out)
	}
	stop()
	// A sound start copies the database to policy.db.bak.
	_, stop = runPolicyServer(t, db)
	stop()

	data, err := os.ReadFile(db)
	if err != nil {
		t.Fatal(err)
	}
	pageSize, freelist := boltMeta(t, data)
	binary.LittleEndian.PutUint16(data[int(freelist)*pageSize+8:], 0x0001) // a branch page's type
	if err := os.WriteFile(db, data, 0o600); err != nil {
		t.Fatal(err)
	}
	out, err = dyscoOut("policy-server", "--insecure", "--metrics-listen", "", "--listen", "127.0.0.1:0", "--db", db)
	var ee *exec.ExitError
	if !errors.As(err, &ee) || ee.ExitCode() != 1 {
		t.Fatalf("policy server on a damaged database: %v\n%s", err, out)
	}
	for _, w := range []string{"is damaged", "invalid freelist page", "dysco policy-server check --db " + db, db + ".bak"} {
		if !strings.Contains(out, w) {
			t.Errorf("policy server's error does not say %q:\n%s", w, out)
		}
	}
	if strings.Contains(out, "goroutine ") {
		t.Errorf("the policy server panicked:\n%s", out)
	}
	if out, err := dyscoOut("policy-server", "check", "--db", db); err == nil || !strings.Contains(out, "invalid freelist page") {
		t.Errorf("check of the damaged database: %v\n%s", err, out)
	}
	if out, err := dyscoOut("policy-server", "backup", "--db", db, "--out", db+".copy"); err == nil {
		t.Errorf("backup copied a damaged database:\n%s", out)
	}

	if err := os.Rename(db+".bak", db); err != nil {
		t.Fatal(err)
	}
	if out, err := dyscoOut("policy-server", "check", "--db", db); err != nil || !strings.Contains(out, "sound: version 2, 1 policies, 1 types") {
		t.Fatalf("check of the restored database: %v\n%s", err, out)
	}
	url, _ = runPolicyServer(t, db)
	if out, err := dyscoOut("policy", "list", "--server", url); err != nil || !strings.Contains(out, "web") {
		t.Errorf("restored server's policies: %v\n%s", err, out)
	}
}

// boltMeta reads a bbolt file's page size and freelist page from its
// current meta page.
func boltMeta(t *testing.T, data []byte) (pageSize int, freelist uint64) {
	t.Helper()
	var best uint64
	found := false
	for _, off := range []int{0, int(binary.LittleEndian.Uint32(data[24:]))} {
		m := data[off+16:]
		h := fnv.New64a()
		h.Write(m[:56])
		if binary.LittleEndian.Uint32(m) != 0xED0CDAED || h.Sum64() != binary.LittleEndian.Uint64(m[56:]) {
			continue
		}
		if tx := binary.LittleEndian.Uint64(m[48:]); !found || tx > best {
			best, found = tx, true
			pageSize, freelist = int(binary.LittleEndian.Uint32(m[8:])), binary.LittleEndian.Uint64(m[32:])
		}
	}
	if !found {
		t.Fatal("no valid bbolt meta page")
	}
	return pageSize, freelist
}

// TestUnreadableCacheStopsAgent: an agent whose cache of the policy
// server's policies is unreadable does not start (in a network namespace
// of its own), naming the file and the way out.
func TestUnreadableCacheStopsAgent(t *testing.T) {
	testutil.RequireRoot(t, "to start an agent")
	testutil.RequireTools(t, "unshare", "timeout")
	dir := t.TempDir()
	cache := filepath.Join(dir, "server-policies.json")
	if err := os.WriteFile(cache, []byte(`{"version":4,"policies":[{"name":"web","filter":`), 0o644); err != nil {
		t.Fatal(err)
	}
	// timeout: an agent that started anyway would serve until stopped.
	out, err := exec.Command("unshare", "--net", "timeout", "30", dyscoBin, "agent", "--name", "a1", "--state-dir", dir,
		"--policy-server", "http://127.0.0.1:1").CombinedOutput()
	var ee *exec.ExitError
	if !errors.As(err, &ee) || ee.ExitCode() != 1 {
		t.Fatalf("agent with an unreadable cache: %v\n%s", err, out)
	}
	for _, w := range []string{cache, "unexpected end of JSON input", "remove " + cache} {
		if !strings.Contains(string(out), w) {
			t.Errorf("agent's error does not say %q:\n%s", w, out)
		}
	}
}

// TestPolicyUpdateAllOrNothing: a local change whose set cannot be put in
// force (a 65th policy: a bank holds 64) is refused and undone, on disk
// too; the set in force stays, and sessions keep their chains, also after
// the agent restarts.
func TestPolicyUpdateAllOrNothing(t *testing.T) {
	e := newLab(t, labOpts{topology: lab.Star("client", "mb1", "server")})
	dst := e.addr("server", false)
	e.dysco("client", "type", "add", "fw", e.addr("mb1", false).String())
	e.policy("client", "web", "tcp dst portrange 9970-9979", "fw")
	for i := 1; i < api.MaxPolicies; i++ {
		e.policy("client", fmt.Sprintf("other%02d", i), fmt.Sprintf("tcp dst port %d", 20000+i))
	}
	through := func() uint64 { return e.status("mb1").Counters["setup_cont"] }
	e.exchange("client", "server", dst, 9970, 64<<10)
	if n := through(); n != 1 {
		t.Fatalf("mb1 continued %d chains, want 1", n)
	}

	out, err := e.lab.Command(t.Context(), "client", dyscoBin, "policy", "add", "one-more", "--chain", "fw", "tcp dst port 9971").CombinedOutput()
	if err == nil || !strings.Contains(string(out), "the change is undone, the policies in force stay") ||
		!strings.Contains(string(out), fmt.Sprintf("at most %d", api.MaxPolicies)) {
		t.Fatalf("policy %d: %v\n%s", api.MaxPolicies+1, err, out)
	}
	list := e.dysco("client", "policy", "list")
	if strings.Contains(list, "one-more") || !strings.Contains(list, "web") {
		t.Errorf("policy list after the refused change:\n%s", list)
	}
	e.exchange("client", "server", dst, 9972, 64<<10)
	if n := through(); n != 2 {
		t.Fatalf("after the refused change, mb1 continued %d chains, want 2", n)
	}
	if err := e.lab.RestartAgent("client"); err != nil {
		t.Fatalf("the agent does not restart on the policies it kept: %v", err)
	}
	e.exchange("client", "server", dst, 9973, 64<<10)
	if n := through(); n != 3 {
		t.Fatalf("after a restart, mb1 continued %d chains, want 3", n)
	}
}
