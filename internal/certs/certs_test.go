package certs

import (
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

func parse(t *testing.T, path string) *x509.Certificate {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := pem.Decode(data)
	if b == nil {
		t.Fatalf("%s: no PEM", path)
	}
	c, err := x509.ParseCertificate(b.Bytes)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

func mode(t *testing.T, path string) os.FileMode {
	t.Helper()
	st, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	return st.Mode().Perm()
}

// A CA issues server and client certificates with the lifetimes, uses and
// identities asked for; keys are the owner's only; nothing is overwritten
// without Force.
func TestIssueAndVerify(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "pki")
	now := time.Now()
	caPath, err := CreateCA(dir, "", Options{})
	if err != nil {
		t.Fatal(err)
	}
	ca := parse(t, caPath)
	if !ca.IsCA || ca.NotAfter.Sub(now) < 3649*24*time.Hour {
		t.Errorf("CA: IsCA %v, expires %v", ca.IsCA, ca.NotAfter)
	}
	if m := mode(t, filepath.Join(dir, CAKeyFile)); m != 0o600 {
		t.Errorf("CA key mode %v, want 0600", m)
	}
	if _, err := CreateCA(dir, "", Options{}); err == nil || !strings.Contains(err.Error(), "--force") {
		t.Errorf("second CA without force: %v, want a refusal naming --force", err)
	}

	srv, skey, err := IssueServer(dir, []string{"ps.example"}, []netip.Addr{netip.MustParseAddr("10.0.0.9")}, Options{})
	if err != nil {
		t.Fatal(err)
	}
	sc := parse(t, srv)
	if sc.VerifyHostname("10.0.0.9") != nil || sc.VerifyHostname("ps.example") != nil || sc.VerifyHostname("other") == nil {
		t.Errorf("server SANs: %v %v", sc.DNSNames, sc.IPAddresses)
	}
	if d := sc.NotAfter.Sub(now); d < 364*24*time.Hour || d > 366*24*time.Hour {
		t.Errorf("server lifetime %v, want a year", d)
	}
	if m := mode(t, skey); m != 0o600 {
		t.Errorf("server key mode %v", m)
	}
	if _, _, err := IssueServer(dir, nil, nil, Options{Force: true}); err == nil {
		t.Error("server certificate without names accepted")
	}

	roots, err := LoadPool(caPath)
	if err != nil {
		t.Fatal(err)
	}
	for _, role := range Roles {
		cp, kp, err := IssueClient(dir, role, "h1", Options{Days: 30})
		if err != nil {
			t.Fatal(err)
		}
		if filepath.Base(cp) != role+"-h1.crt" || mode(t, kp) != 0o600 {
			t.Errorf("%s: files %s %s (%v)", role, cp, kp, mode(t, kp))
		}
		c := parse(t, cp)
		if d := c.NotAfter.Sub(now); d > 31*24*time.Hour {
			t.Errorf("%s: lifetime %v, want 30 days", role, d)
		}
		id, err := Verify([]*x509.Certificate{c}, roots, now)
		if err != nil || id != (Identity{Role: role, Name: "h1"}) {
			t.Errorf("%s: identity %+v, %v", role, id, err)
		}
		if _, err := Verify([]*x509.Certificate{c}, roots, now.AddDate(0, 0, 31)); err == nil {
			t.Errorf("%s: expired certificate verified", role)
		}
	}
	// The server's certificate is no client's.
	if _, err := Verify([]*x509.Certificate{sc}, roots, now); err == nil {
		t.Error("the server certificate verified as a client certificate")
	}
	// Another CA's client certificate is refused.
	other := filepath.Join(t.TempDir(), "other")
	if _, err := CreateCA(other, "", Options{}); err != nil {
		t.Fatal(err)
	}
	op, _, err := IssueClient(other, RoleOperator, RoleOperator, Options{})
	if err != nil {
		t.Fatal(err)
	}
	if filepath.Base(op) != "operator.crt" {
		t.Errorf("operator file %s", op)
	}
	if _, err := Verify([]*x509.Certificate{parse(t, op)}, roots, now); err == nil {
		t.Error("a certificate of another CA verified")
	}
	if _, err := Verify(nil, roots, now); err == nil {
		t.Error("no certificate verified")
	}

	// Bad input: clear errors.
	if _, _, err := IssueClient(dir, "admin", "x", Options{}); err == nil || !strings.Contains(err.Error(), "unknown role") {
		t.Errorf("unknown role: %v", err)
	}
	if _, _, err := IssueClient(dir, RoleAgent, strings.Repeat("a", MaxNameLen+1), Options{}); err == nil {
		t.Error("over-long name accepted")
	}
	if _, _, err := IssueClient(dir, RoleAgent, "../etc", Options{}); err == nil {
		t.Error("name with a slash accepted")
	}
	if _, _, err := IssueClient(t.TempDir(), RoleAgent, "h2", Options{}); err == nil || !strings.Contains(err.Error(), "dysco certs ca") {
		t.Errorf("no CA: %v", err)
	}
	// Force replaces, keeping the key private.
	if _, kp, err := IssueClient(dir, RoleAgent, "h1", Options{Force: true}); err != nil || mode(t, kp) != 0o600 {
		t.Errorf("forced reissue: %v", err)
	}
}

func TestClientIdentityFile(t *testing.T) {
	dir := t.TempDir()
	if _, err := CreateCA(dir, "", Options{}); err != nil {
		t.Fatal(err)
	}
	cp, kp, err := IssueClient(dir, RoleAgent, "mb1", Options{})
	if err != nil {
		t.Fatal(err)
	}
	id, err := ClientIdentity(cp)
	if err != nil || id.Name != "mb1" || id.Role != RoleAgent {
		t.Fatalf("%+v %v", id, err)
	}
	if _, err := ClientTLS(filepath.Join(dir, CAFile), cp, kp); err != nil {
		t.Fatal(err)
	}
	sp, sk, err := IssueServer(dir, []string{"localhost"}, nil, Options{})
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := ServerTLS(sp, sk, filepath.Join(dir, CAFile)); err != nil {
		t.Fatal(err)
	}
	if _, err := ClientIdentity(filepath.Join(dir, CAKeyFile)); err == nil {
		t.Error("a key read as a certificate")
	}
}

// A certificate renewed in place (--force) is used from the next
// handshake on, by the client and by the server alike, with no restart.
func TestRenewedCertificateReloaded(t *testing.T) {
	dir := t.TempDir()
	if _, err := CreateCA(dir, "", Options{}); err != nil {
		t.Fatal(err)
	}
	cp, kp, err := IssueClient(dir, RoleAgent, "h1", Options{})
	if err != nil {
		t.Fatal(err)
	}
	sp, sk, err := IssueServer(dir, []string{"localhost"}, nil, Options{})
	if err != nil {
		t.Fatal(err)
	}
	ctc, err := ClientTLS(filepath.Join(dir, CAFile), cp, kp)
	if err != nil {
		t.Fatal(err)
	}
	stc, _, err := ServerTLS(sp, sk, filepath.Join(dir, CAFile))
	if err != nil {
		t.Fatal(err)
	}
	serial := func(c *tls.Certificate, err error) string {
		t.Helper()
		if err != nil || c == nil {
			t.Fatalf("certificate: %v", err)
		}
		x, err := x509.ParseCertificate(c.Certificate[0])
		if err != nil {
			t.Fatal(err)
		}
		return x.SerialNumber.String()
	}
	c0, s0 := serial(ctc.GetClientCertificate(nil)), serial(stc.GetCertificate(nil))
	if c0 != serial(ctc.GetClientCertificate(nil)) {
		t.Fatal("client certificate changed with no renewal")
	}
	if _, _, err := IssueClient(dir, RoleAgent, "h1", Options{Force: true}); err != nil {
		t.Fatal(err)
	}
	if _, _, err := IssueServer(dir, []string{"localhost"}, nil, Options{Force: true}); err != nil {
		t.Fatal(err)
	}
	if c1 := serial(ctc.GetClientCertificate(nil)); c1 == c0 {
		t.Error("renewed client certificate not reloaded")
	}
	if s1 := serial(stc.GetCertificate(nil)); s1 == s0 {
		t.Error("renewed server certificate not reloaded")
	}
	// A broken file leaves the last good pair in use.
	if err := os.WriteFile(cp, []byte("garbage"), 0o644); err != nil {
		t.Fatal(err)
	}
	if c, err := ctc.GetClientCertificate(nil); err != nil || c == nil {
		t.Errorf("after a broken renewal: %v %v", c, err)
	}
}

// A key readable by others is refused, with the fix.
func TestKeyFileModeRefused(t *testing.T) {
	dir := t.TempDir()
	if _, err := CreateCA(dir, "", Options{}); err != nil {
		t.Fatal(err)
	}
	cp, kp, err := IssueClient(dir, RoleOperator, RoleOperator, Options{})
	if err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(kp, 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := ClientTLS(filepath.Join(dir, CAFile), cp, kp); err == nil || !strings.Contains(err.Error(), "chmod 600") {
		t.Errorf("key with mode 0644: %v, want a refusal", err)
	}
	sp, sk, err := IssueServer(dir, []string{"localhost"}, nil, Options{})
	if err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(sk, 0o640); err != nil {
		t.Fatal(err)
	}
	if _, _, err := ServerTLS(sp, sk, filepath.Join(dir, CAFile)); err == nil || !strings.Contains(err.Error(), "chmod 600") {
		t.Errorf("server key with mode 0640: %v, want a refusal", err)
	}
}
