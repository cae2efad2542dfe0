package keys

import (
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/dysco/dysco/internal/testutil"
)

const (
	hexA = "00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff"
	hexB = "ffeeddccbbaa99887766554433221100"
	hexC = "0123456789abcdef0123456789abcdef01"
)

func TestParse(t *testing.T) {
	r, err := Parse([]byte("# deployment keys of the lab\n\n  " + hexB + "  # new, signs\n" + hexA + "\n# old\n"))
	if err != nil {
		t.Fatal(err)
	}
	if r.Len() != 2 || string(r.Signing()) != string(mustHex(hexB)) {
		t.Fatalf("ring %v: want two keys, %s first", r.IDs(), hexB)
	}
	if ids := r.IDs(); ids[0] != KeyID(mustHex(hexB)) || ids[1] != KeyID(mustHex(hexA)) || ids[0] == ids[1] || len(ids[0]) != 8 {
		t.Fatalf("ids %v", ids)
	}
	for _, tc := range []struct{ name, text, want string }{
		{"empty", "", "no key"},
		{"only comments", "# nothing\n\n", "no key"},
		{"not hex", hexA + "\nzz" + hexB + "\n", "line 2: not a hex key"},
		{"odd digits", hexA[:33] + "\n", "line 1: not a hex key"},
		{"short key", hexA[:30] + "\n", "key 1: 15 bytes, at least 16"},
		{"short second key", hexA + "\n" + hexB[:30] + "\n", "key 2: 15 bytes"},
		{"two keys on a line", hexA + " " + hexB + "\n", "line 1: not a hex key"},
		{"repeated", hexA + "\n" + hexB + "\n" + hexA + "\n", "key 3 repeats key 1"},
		{"too many", strings.Repeat(hexA[:32]+"\n", 1) + manyKeys(MaxSecrets), "line 9: more than 8 keys"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := Parse([]byte(tc.text))
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("got %v, want an error with %q", err, tc.want)
			}
		})
	}
	if r, err := Parse([]byte(hexC + "\r\n")); err != nil || r.Len() != 1 {
		t.Fatalf("CRLF line: %v", err)
	}
}

func manyKeys(n int) string {
	var b strings.Builder
	for i := range n {
		b.WriteString(strings.Repeat("0", 30) + string("0123456789"[i%10]) + "f\n")
	}
	return b.String()
}

func mustHex(s string) []byte {
	r, err := Parse([]byte(s))
	if err != nil {
		panic(err)
	}
	return r.Signing()
}

// Derive is HKDF-SHA256 (RFC 5869) with no salt and the purpose as info,
// computed here from its definition; each purpose gets its own key.
func TestDerive(t *testing.T) {
	secret := mustHex(hexA)
	mac := func(k, b []byte) []byte { h := hmac.New(sha256.New, k); h.Write(b); return h.Sum(nil) }
	prk := mac(make([]byte, sha256.Size), secret)
	seen := map[string]string{}
	for _, p := range []string{PurposeControl, PurposeSYN, PurposeID} {
		want := mac(prk, append([]byte(p), 1))
		got := Derive(secret, p)
		if string(got) != string(want) {
			t.Fatalf("%s: %x, want %x", p, got, want)
		}
		if q, ok := seen[string(got)]; ok {
			t.Fatalf("%s and %s derive the same key", p, q)
		}
		seen[string(got)] = p
	}
	if string(Derive(mustHex(hexB), PurposeControl)) == string(Derive(secret, PurposeControl)) {
		t.Fatal("two secrets derive the same key")
	}
}

func writeKey(t *testing.T, path, text string, mode os.FileMode) {
	t.Helper()
	if err := os.WriteFile(path, []byte(text), mode); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(path, mode); err != nil {
		t.Fatal(err)
	}
}

func TestLoadPermissions(t *testing.T) {
	dir := t.TempDir()
	p := filepath.Join(dir, "control.key")
	uid := os.Geteuid()
	for _, mode := range []os.FileMode{0o600, 0o400} {
		writeKey(t, p, hexA+"\n", mode)
		if _, err := Load(p, uid); err != nil {
			t.Fatalf("mode %04o: %v", mode, err)
		}
	}
	for _, mode := range []os.FileMode{0o640, 0o604, 0o620, 0o602, 0o644, 0o660, 0o666} {
		writeKey(t, p, hexA+"\n", mode)
		_, err := Load(p, uid)
		var fe *FileError
		if !errors.As(err, &fe) {
			t.Fatalf("mode %04o: got %v, want a refusal", mode, err)
		}
		msg := err.Error()
		if !strings.Contains(msg, "mode "+octal(mode)) || !strings.Contains(msg, "chmod 600 "+p) {
			t.Fatalf("mode %04o: %q does not name the mode and the fix", mode, msg)
		}
	}
	if err := os.Mkdir(filepath.Join(dir, "d"), 0o700); err != nil {
		t.Fatal(err)
	}
	if _, err := Load(filepath.Join(dir, "d"), uid); err == nil || !strings.Contains(err.Error(), "not a regular file") {
		t.Fatalf("directory: %v", err)
	}
	if _, err := Load(filepath.Join(dir, "missing"), uid); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("missing file: %v", err)
	}
	writeKey(t, p, hexA[:30]+"\n", 0o600)
	if _, err := Load(p, uid); err == nil || !strings.Contains(err.Error(), p+": key 1: 15 bytes") {
		t.Fatalf("short key: %v", err)
	}
}

func octal(m os.FileMode) string {
	const digits = "01234567"
	p := uint32(m.Perm())
	return string([]byte{'0', digits[p>>6&7], digits[p>>3&7], digits[p&7]})
}

// A key file owned by another user than root or the agent's is refused.
func TestLoadOwner(t *testing.T) {
	testutil.RequireRoot(t, "chown")
	p := filepath.Join(t.TempDir(), "control.key")
	writeKey(t, p, hexA+"\n", 0o600)
	if err := os.Chown(p, 4242, 4242); err != nil {
		t.Fatal(err)
	}
	if _, err := Load(p, 0); err == nil || !strings.Contains(err.Error(), "owned by uid 4242, not by root or the agent's uid 0") {
		t.Fatalf("owned by 4242, agent uid 0: %v", err)
	}
	if _, err := Load(p, 4242); err != nil {
		t.Fatalf("owned by the agent's uid: %v", err)
	}
	if err := os.Chown(p, 0, 0); err != nil {
		t.Fatal(err)
	}
	if _, err := Load(p, 4242); err != nil {
		t.Fatalf("owned by root, agent uid 4242: %v", err)
	}
}

// The rotation procedure on one host: add the new key second, move it
// first, drop the old. The file is read again when it changes and on
// SIGHUP; a file that does not load leaves the ring in use.
func TestFileReload(t *testing.T) {
	p := filepath.Join(t.TempDir(), "control.key")
	writeKey(t, p, hexA+"\n", 0o600)
	f, err := Open(p, os.Geteuid(), nil)
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var got [][]string
	f.OnChange(func(r *Ring) { mu.Lock(); got = append(got, r.IDs()); mu.Unlock() })
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	f.Start(ctx, 10*time.Millisecond)
	a, b := KeyID(mustHex(hexA)), KeyID(mustHex(hexB))
	wait := func(what string, ids ...string) {
		t.Helper()
		testutil.Eventually(t, 5*time.Second, what, func() bool {
			return strings.Join(f.Ring().IDs(), ",") == strings.Join(ids, ",")
		})
	}
	writeKey(t, p, hexA+"\n"+hexB+"  # new\n", 0o600)
	wait("the new key added second", a, b)
	writeKey(t, p, "# rotated\n"+hexB+"\n"+hexA+"\n", 0o600)
	wait("the new key first", b, a)

	// Refused: a mode too open, then garbage. The ring stays.
	errs := f.Errors()
	writeKey(t, p, hexB+"\n", 0o644)
	testutil.Eventually(t, 5*time.Second, "the open file refused", func() bool { return f.Errors() > errs })
	errs = f.Errors()
	writeKey(t, p, "not a key\n", 0o600)
	testutil.Eventually(t, 5*time.Second, "the garbage refused", func() bool { return f.Errors() > errs })
	if ids := f.Ring().IDs(); len(ids) != 2 || ids[0] != b {
		t.Fatalf("a refused file changed the ring: %v", ids)
	}
	writeKey(t, p, hexB+"\n", 0o600)
	wait("the old key dropped", b)
	mu.Lock()
	if len(got) != 3 || f.Reloads() != 3 {
		t.Fatalf("changes reported %v, reloads %d; want 3", got, f.Reloads())
	}
	mu.Unlock()

	// SIGHUP: a file written with its old size and times restored, which
	// a poll does not see, is read on SIGHUP.
	f2, err := Open(p, os.Geteuid(), nil)
	if err != nil {
		t.Fatal(err)
	}
	ctx2, cancel2 := context.WithCancel(context.Background())
	defer cancel2()
	f2.Start(ctx2, time.Hour)
	writeKey(t, p, hexA[:32]+"\n", 0o600) // as long as hexB's line
	if err := syscall.Kill(os.Getpid(), syscall.SIGHUP); err != nil {
		t.Fatal(err)
	}
	testutil.Eventually(t, 5*time.Second, "the reload on SIGHUP", func() bool {
		return f2.Ring().IDs()[0] == KeyID(mustHex(hexA[:32]))
	})
}

// A poll reads a changed file only once a second poll finds it as the
// first did: a file caught half-written (here, its first line only, a
// valid ring of one key) is not taken.
func TestFilePollSteady(t *testing.T) {
	p := filepath.Join(t.TempDir(), "control.key")
	writeKey(t, p, hexA+"\n", 0o600)
	f, err := Open(p, os.Geteuid(), nil)
	if err != nil {
		t.Fatal(err)
	}
	a, b := KeyID(mustHex(hexA)), KeyID(mustHex(hexB))
	ids := func() string { return strings.Join(f.Ring().IDs(), ",") }
	f.poll()
	if ids() != a || f.Reloads() != 0 {
		t.Fatalf("an unchanged file was read again: %s, %d reloads", ids(), f.Reloads())
	}
	writeKey(t, p, hexB+"\n", 0o600) // the first line of "B, A", being written
	f.poll()
	if ids() != a {
		t.Fatalf("a file that had just changed was taken: %s", ids())
	}
	writeKey(t, p, hexB+"\n"+hexA+"\n", 0o600) // whole now
	f.poll()
	if ids() != a {
		t.Fatalf("a file still changing was taken: %s", ids())
	}
	f.poll()
	if ids() != b+","+a || f.Reloads() != 1 {
		t.Fatalf("the steady file: %s, %d reloads; want %s,%s once", ids(), f.Reloads(), b, a)
	}
	f.poll()
	if f.Reloads() != 1 {
		t.Fatalf("read again with no change: %d reloads", f.Reloads())
	}
}
