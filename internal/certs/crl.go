package certs

import (
	"crypto/rand"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"math/big"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"
)

// Revocation: the CA keeps a certificate revocation list (X.509 CRL, PEM)
// beside its certificate, CRLFile. `dysco certs revoke` adds certificates
// to it; the policy server refuses a client certificate it lists, and
// reads the file again when it changes.

// CRLFile is the revocation list's file in a PKI directory.
const CRLFile = "crl.pem"

// crlDays is how long a revocation list says it is good for: the server
// does not expire it (a list past its date still revokes), but X.509 wants
// a date.
const crlDays = 3650

// Revoke adds the certificates of files to the revocation list of dir,
// signed by dir's CA, and returns the list's path and number. A
// certificate listed already stays listed once; one the CA did not issue
// is refused.
func Revoke(dir string, files []string, now time.Time) (path string, number *big.Int, revoked []*x509.Certificate, err error) {
	ca, key, err := LoadCA(dir)
	if err != nil {
		return "", nil, nil, err
	}
	path = filepath.Join(dir, CRLFile)
	var entries []x509.RevocationListEntry
	number = big.NewInt(1)
	if old, err := readCRL(path, ca); err == nil {
		entries = old.RevokedCertificateEntries
		number.Add(old.Number, big.NewInt(1))
	} else if !errors.Is(err, os.ErrNotExist) {
		return "", nil, nil, err
	}
	for _, f := range files {
		c, err := readCert(f)
		if err != nil {
			return "", nil, nil, err
		}
		if err := c.CheckSignatureFrom(ca); err != nil {
			return "", nil, nil, fmt.Errorf("%s: not issued by the CA of %s: %w", f, dir, err)
		}
		if c.IsCA {
			return "", nil, nil, fmt.Errorf("%s is the CA's own certificate: to revoke it, create a new CA", f)
		}
		if !slices.Contains(c.ExtKeyUsage, x509.ExtKeyUsageClientAuth) {
			return "", nil, nil, fmt.Errorf("%s is not a client certificate: only the policy server reads the list, so only its clients' certificates can be revoked (replace the server's with `dysco certs server --force`)", f)
		}
		if !slices.ContainsFunc(entries, func(e x509.RevocationListEntry) bool { return e.SerialNumber.Cmp(c.SerialNumber) == 0 }) {
			entries = append(entries, x509.RevocationListEntry{SerialNumber: c.SerialNumber, RevocationTime: now.UTC()})
		}
		revoked = append(revoked, c)
	}
	der, err := x509.CreateRevocationList(rand.Reader, &x509.RevocationList{
		Number: number, ThisUpdate: now.UTC(), NextUpdate: now.UTC().AddDate(0, 0, crlDays),
		RevokedCertificateEntries: entries,
	}, ca, key)
	if err != nil {
		return "", nil, nil, fmt.Errorf("revocation list: %w", err)
	}
	if err := writeFile(path, pem.EncodeToMemory(&pem.Block{Type: "X509 CRL", Bytes: der}), 0o644, true); err != nil {
		return "", nil, nil, err
	}
	return path, number, revoked, nil
}

// CertFile is the certificate file that arg names: a path to a file, or a
// base name in dir (agent-mb1, operator, server).
func CertFile(dir, arg string) string {
	if strings.ContainsRune(arg, os.PathSeparator) || strings.HasSuffix(arg, ".crt") {
		return arg
	}
	return filepath.Join(dir, arg+".crt")
}

// readPEM reads the first PEM block of path, which must be of type typ.
func readPEM(path, typ string) ([]byte, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	b, _ := pem.Decode(data)
	if b == nil || b.Type != typ {
		return nil, fmt.Errorf("%s: no PEM %s in it", path, strings.ToLower(typ))
	}
	return b.Bytes, nil
}

// readCert reads one PEM certificate.
func readCert(file string) (*x509.Certificate, error) {
	der, err := readPEM(file, "CERTIFICATE")
	if err != nil {
		return nil, err
	}
	c, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", file, err)
	}
	return c, nil
}

// readCRL reads the revocation list of path and checks that ca signed it.
func readCRL(path string, ca *x509.Certificate) (*x509.RevocationList, error) {
	der, err := readPEM(path, "X509 CRL")
	if err != nil {
		return nil, fmt.Errorf("revocation list: %w", err)
	}
	l, err := x509.ParseRevocationList(der)
	if err != nil {
		return nil, fmt.Errorf("revocation list %s: %w", path, err)
	}
	if err := l.CheckSignatureFrom(ca); err != nil {
		return nil, fmt.Errorf("revocation list %s: not signed by the CA: %w", path, err)
	}
	return l, nil
}

// Revocations is a revocation list read from its file, read again when
// the file changes (checked at most once a second). A list that cannot be
// read or is not the CA's leaves the last good one in force; a file that
// is removed revokes nothing any more.
type Revocations struct {
	path string
	ca   *x509.Certificate

	mu      sync.Mutex
	serials map[string]bool
	number  *big.Int
	mod     time.Time
	size    int64
	checked time.Time
	// badMod and badSize are those of a file that could not be read: it
	// is not read (or reported) again until it changes.
	badMod  time.Time
	badSize int64
	// Failed is called with the error when a changed file cannot be read.
	Failed func(error)
}

// LoadRevocations reads the revocation list of path, signed by the first
// certificate of caFile. A path that does not exist is an empty list
// (until it is written).
func LoadRevocations(path, caFile string) (*Revocations, error) {
	ca, err := readCert(caFile)
	if err != nil {
		return nil, fmt.Errorf("CA certificate: %w", err)
	}
	r := &Revocations{path: path, ca: ca, serials: map[string]bool{}}
	if err := r.load(time.Now()); err != nil {
		return nil, err
	}
	return r, nil
}

// load reads the file if it changed since the last read.
func (r *Revocations) load(now time.Time) error {
	r.checked = now
	st, err := os.Stat(r.path)
	if errors.Is(err, os.ErrNotExist) {
		r.serials, r.number, r.mod, r.size = map[string]bool{}, nil, time.Time{}, 0
		return nil
	}
	if err != nil {
		return err
	}
	if st.ModTime().Equal(r.mod) && st.Size() == r.size || st.ModTime().Equal(r.badMod) && st.Size() == r.badSize {
		return nil
	}
	l, err := readCRL(r.path, r.ca)
	if err != nil {
		r.badMod, r.badSize = st.ModTime(), st.Size()
		return err
	}
	serials := map[string]bool{}
	for _, e := range l.RevokedCertificateEntries {
		serials[e.SerialNumber.String()] = true
	}
	r.serials, r.number, r.mod, r.size = serials, l.Number, st.ModTime(), st.Size()
	return nil
}

// Revoked tells whether c is on the list, reading the file again first if
// it changed and was last looked at over a second ago.
func (r *Revocations) Revoked(c *x509.Certificate) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	if now := time.Now(); now.Sub(r.checked) >= time.Second {
		if err := r.load(now); err != nil && r.Failed != nil {
			r.Failed(err)
		}
	}
	return r.serials[c.SerialNumber.String()]
}

// Len is the number of certificates the list in force revokes.
func (r *Revocations) Len() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.serials)
}
