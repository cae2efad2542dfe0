package certs

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// TestRevoke: revoked certificates go on the CA's list, once each, the
// list's number rising; what the CA did not issue, its own certificate
// and the server's are refused; Revocations reads the list again when it
// changes, keeps the last good one when the file is broken, and revokes
// nothing once the file is gone.
func TestRevoke(t *testing.T) {
	dir := t.TempDir()
	if _, err := CreateCA(dir, "", Options{}); err != nil {
		t.Fatal(err)
	}
	for _, who := range [][2]string{{RoleOperator, "alice"}, {RoleAgent, "mb1"}, {RoleOperator, "bob"}} {
		if _, _, err := IssueClient(dir, who[0], who[1], Options{}); err != nil {
			t.Fatal(err)
		}
	}
	if _, _, err := IssueServer(dir, []string{"ps"}, nil, Options{}); err != nil {
		t.Fatal(err)
	}
	alice, mb1, bob := parse(t, CertFile(dir, "operator-alice")), parse(t, CertFile(dir, "agent-mb1")), parse(t, CertFile(dir, "operator-bob"))

	crl := filepath.Join(dir, CRLFile)
	r, err := LoadRevocations(crl, filepath.Join(dir, CAFile))
	if err != nil {
		t.Fatalf("no list yet: %v", err)
	}
	if r.Revoked(alice) || r.Len() != 0 {
		t.Fatal("an absent list revokes")
	}
	now := time.Now()
	if _, n, got, err := Revoke(dir, []string{CertFile(dir, "operator-alice"), CertFile(dir, "agent-mb1")}, now); err != nil || n.Int64() != 1 || len(got) != 2 {
		t.Fatalf("first revocation: number %v, %d certificates, %v", n, len(got), err)
	}
	if _, n, _, err := Revoke(dir, []string{CertFile(dir, "operator-alice")}, now); err != nil || n.Int64() != 2 {
		t.Fatalf("second revocation: number %v, %v", n, err)
	}
	r.checked = time.Time{} // look again now
	if !r.Revoked(alice) || !r.Revoked(mb1) || r.Revoked(bob) || r.Len() != 2 {
		t.Fatalf("after revoking alice and mb1 (alice twice): alice %v mb1 %v bob %v, %d listed", r.Revoked(alice), r.Revoked(mb1), r.Revoked(bob), r.Len())
	}

	for _, c := range []struct{ file, want string }{
		{CertFile(dir, "server"), "not a client certificate"},
		{filepath.Join(dir, CAFile), "CA's own certificate"},
		{CertFile(dir, "nosuch"), "no such file"},
	} {
		if _, _, _, err := Revoke(dir, []string{c.file}, now); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("revoking %s: %v, want %q", c.file, err, c.want)
		}
	}
	other := t.TempDir()
	if _, err := CreateCA(other, "", Options{}); err != nil {
		t.Fatal(err)
	}
	if _, _, err := IssueClient(other, RoleOperator, "eve", Options{}); err != nil {
		t.Fatal(err)
	}
	if _, _, _, err := Revoke(dir, []string{CertFile(other, "operator-eve")}, now); err == nil || !strings.Contains(err.Error(), "not issued by the CA") {
		t.Errorf("revoking another CA's certificate: %v", err)
	}
	// Another CA's list is refused at start, and kept out when it
	// replaces a good one.
	if _, _, _, err := Revoke(other, []string{CertFile(other, "operator-eve")}, now); err != nil {
		t.Fatal(err)
	}
	if _, err := LoadRevocations(filepath.Join(other, CRLFile), filepath.Join(dir, CAFile)); err == nil || !strings.Contains(err.Error(), "not signed by the CA") {
		t.Errorf("another CA's list: %v", err)
	}
	var failed []error
	r.Failed = func(err error) { failed = append(failed, err) }
	data, err := os.ReadFile(filepath.Join(other, CRLFile))
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(crl, data, 0o644); err != nil {
		t.Fatal(err)
	}
	for range 2 {
		r.checked = time.Time{}
		if !r.Revoked(alice) {
			t.Fatal("a foreign list replaced the good one")
		}
	}
	if len(failed) != 1 {
		t.Errorf("a bad list reported %d times, want once until it changes: %v", len(failed), failed)
	}
	// Gone: nothing revoked.
	if err := os.Remove(crl); err != nil {
		t.Fatal(err)
	}
	r.checked = time.Time{}
	if r.Revoked(alice) {
		t.Error("a removed list still revokes")
	}
}
