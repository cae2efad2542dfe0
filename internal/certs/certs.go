// Package certs is the public-key infrastructure of Dysco's management
// plane: a certificate authority of its own, the policy server's
// certificate, and the client certificates that carry an identity and a
// role (operator, agent, monitor) to the policy server, which serves HTTPS
// with mutual TLS (internal/policyserver). It uses Go's crypto/x509 only.
//
// A client certificate names its holder in the subject's common name (for
// an agent, its --name, the host whose policies and operations it may
// take) and its role in the subject's organizational unit; its extended
// key usage is client authentication only, so that it cannot serve as the
// server's certificate, and the server's cannot serve as a client's.
package certs

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"fmt"
	"math/big"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"sync"
	"time"
)

// Roles carried by client certificates.
const (
	// RoleOperator may change policies and types and queue operations.
	RoleOperator = "operator"
	// RoleAgent may watch its own policies and claim and report its own
	// operations; its name is the certificate's common name.
	RoleAgent = "agent"
	// RoleMonitor may read: list policies and operations.
	RoleMonitor = "monitor"
)

// Roles lists the client roles.
var Roles = []string{RoleOperator, RoleAgent, RoleMonitor}

// Defaults of the files and lifetimes.
const (
	// DefaultDir is where the CLI, the agent and the policy server look for
	// their certificates unless told otherwise.
	DefaultDir = "/etc/dysco/pki"
	// DefaultCADays and DefaultLeafDays are the lifetimes of a new CA and
	// of the certificates it issues.
	DefaultCADays   = 3650
	DefaultLeafDays = 365
	// CAFile is the CA's certificate in a PKI directory; CAKeyFile its key.
	CAFile    = "ca.crt"
	CAKeyFile = "ca.key"
	// ServerName is the base name of the policy server's files.
	ServerName = "server"
	// MaxNameLen bounds the name in a client certificate (an agent's host
	// name).
	MaxNameLen = 64
	// organization is the subject organization of every certificate issued.
	organization = "dysco"
)

// nameRE is the rule for the names in client certificates: a host name
// label-like string (an agent's --name).
var nameRE = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._-]*$`)

// ValidName checks a name for a client certificate.
func ValidName(name string) error {
	switch {
	case name == "":
		return errors.New("empty name")
	case len(name) > MaxNameLen:
		return fmt.Errorf("name %.20q... is %d bytes long, more than %d", name, len(name), MaxNameLen)
	case !nameRE.MatchString(name):
		return fmt.Errorf("name %q: use letters, digits, '.', '_' and '-', starting with a letter or digit", name)
	}
	return nil
}

// Options tune the issuing of certificates.
type Options struct {
	// Days is the lifetime (DefaultCADays or DefaultLeafDays when zero).
	Days int
	// Force overwrites existing files; without it they are left alone and
	// an error says so.
	Force bool
	// now is the clock (tests).
	now func() time.Time
}

func (o Options) clock() time.Time {
	if o.now != nil {
		return o.now()
	}
	return time.Now()
}

// BaseName is the base of the file names (NAME.crt, NAME.key) of a
// certificate of role for name: "server", "agent-NAME", and for operators
// and monitors the role, or "ROLE-NAME" when name is not the role.
func BaseName(role, name string) string {
	switch {
	case role == ServerName:
		return ServerName
	case role == RoleAgent || name != role:
		return role + "-" + name
	}
	return role
}

// Paths returns the certificate and key files of base in dir.
func Paths(dir, base string) (cert, key string) {
	return filepath.Join(dir, base+".crt"), filepath.Join(dir, base+".key")
}

// CreateCA creates a CA in dir (ca.crt, and ca.key readable by its owner
// only) and returns the certificate's path.
func CreateCA(dir, name string, o Options) (string, error) {
	if name == "" {
		name = "dysco CA"
	}
	days := o.Days
	if days == 0 {
		days = DefaultCADays
	}
	if days < 0 {
		return "", fmt.Errorf("lifetime of %d days", days)
	}
	certPath, keyPath := filepath.Join(dir, CAFile), filepath.Join(dir, CAKeyFile)
	if err := checkFree(o.Force, certPath, keyPath); err != nil {
		return "", err
	}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return "", err
	}
	now := o.clock()
	tmpl, err := template(name, now, days)
	if err != nil {
		return "", err
	}
	tmpl.IsCA = true
	tmpl.BasicConstraintsValid = true
	tmpl.MaxPathLenZero = true
	tmpl.KeyUsage = x509.KeyUsageCertSign | x509.KeyUsageCRLSign
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, key.Public(), key)
	if err != nil {
		return "", fmt.Errorf("creating the CA certificate: %w", err)
	}
	if err := writePair(dir, certPath, keyPath, der, key, o.Force); err != nil {
		return "", err
	}
	return certPath, nil
}

// IssueServer issues the policy server's certificate (server.crt,
// server.key) for the DNS names and addresses clients reach it by.
func IssueServer(dir string, dnsNames []string, addrs []netip.Addr, o Options) (certPath, keyPath string, err error) {
	if len(dnsNames) == 0 && len(addrs) == 0 {
		return "", "", errors.New("a server certificate needs the names (--dns) or addresses (--ip) that clients use in the server's URL")
	}
	cn := ""
	if len(dnsNames) > 0 {
		cn = dnsNames[0]
	} else {
		cn = addrs[0].String()
	}
	return issue(dir, ServerName, cn, o, func(t *x509.Certificate) {
		t.DNSNames = dnsNames
		for _, a := range addrs {
			t.IPAddresses = append(t.IPAddresses, net.IP(a.Unmap().AsSlice()))
		}
		t.ExtKeyUsage = []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}
	})
}

// IssueClient issues a client certificate of role for name (files named by
// BaseName).
func IssueClient(dir, role, name string, o Options) (certPath, keyPath string, err error) {
	if !slices.Contains(Roles, role) {
		return "", "", fmt.Errorf("unknown role %q (roles: operator, agent, monitor)", role)
	}
	if err := ValidName(name); err != nil {
		return "", "", err
	}
	return issue(dir, BaseName(role, name), name, o, func(t *x509.Certificate) {
		t.Subject.OrganizationalUnit = []string{role}
		t.ExtKeyUsage = []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}
	})
}

// issue creates a key and a certificate signed by dir's CA.
func issue(dir, base, cn string, o Options, set func(*x509.Certificate)) (string, string, error) {
	days := o.Days
	if days == 0 {
		days = DefaultLeafDays
	}
	if days < 0 {
		return "", "", fmt.Errorf("lifetime of %d days", days)
	}
	certPath, keyPath := Paths(dir, base)
	if err := checkFree(o.Force, certPath, keyPath); err != nil {
		return "", "", err
	}
	ca, caKey, err := LoadCA(dir)
	if err != nil {
		return "", "", err
	}
	now := o.clock()
	tmpl, err := template(cn, now, days)
	if err != nil {
		return "", "", err
	}
	if tmpl.NotAfter.After(ca.NotAfter) {
		tmpl.NotAfter = ca.NotAfter // a certificate outliving its CA would not verify anyway
	}
	tmpl.KeyUsage = x509.KeyUsageDigitalSignature
	set(tmpl)
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return "", "", err
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca, key.Public(), caKey)
	if err != nil {
		return "", "", fmt.Errorf("signing the certificate: %w", err)
	}
	if err := writePair(dir, certPath, keyPath, der, key, o.Force); err != nil {
		return "", "", err
	}
	return certPath, keyPath, nil
}

func template(cn string, now time.Time, days int) (*x509.Certificate, error) {
	serial, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 127))
	if err != nil {
		return nil, err
	}
	return &x509.Certificate{
		SerialNumber: serial,
		Subject:      pkix.Name{CommonName: cn, Organization: []string{organization}},
		// A little back-dating covers clocks slightly behind this one.
		NotBefore: now.Add(-5 * time.Minute),
		NotAfter:  now.AddDate(0, 0, days),
	}, nil
}

// checkFree refuses to overwrite existing files unless force.
func checkFree(force bool, paths ...string) error {
	if force {
		return nil
	}
	for _, p := range paths {
		if _, err := os.Lstat(p); err == nil {
			return fmt.Errorf("%s exists: not overwriting it (--force replaces it)", p)
		} else if !errors.Is(err, os.ErrNotExist) {
			return err
		}
	}
	return nil
}

// writePair writes the certificate (0644) and the key (0600, written
// first, so that no certificate is left without its key).
func writePair(dir, certPath, keyPath string, der []byte, key crypto.Signer, force bool) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	kder, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		return err
	}
	if err := writeFile(keyPath, pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: kder}), 0o600, force); err != nil {
		return err
	}
	return writeFile(certPath, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o644, force)
}

// writeFile writes data to path with mode perm: through a new file and a
// rename (force), or by creating path exclusively.
func writeFile(path string, data []byte, perm os.FileMode, force bool) error {
	if !force {
		f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_EXCL, perm)
		if err != nil {
			if errors.Is(err, os.ErrExist) {
				return fmt.Errorf("%s exists: not overwriting it (--force replaces it)", path)
			}
			return err
		}
		if _, err := f.Write(data); err != nil {
			f.Close()
			os.Remove(path)
			return err
		}
		return f.Close()
	}
	f, err := os.CreateTemp(filepath.Dir(path), "."+filepath.Base(path)+".tmp*")
	if err != nil {
		return err
	}
	tmp := f.Name()
	defer os.Remove(tmp)
	if err := f.Chmod(perm); err != nil {
		f.Close()
		return err
	}
	if _, err := f.Write(data); err != nil {
		f.Close()
		return err
	}
	if err := f.Close(); err != nil {
		return err
	}
	return os.Rename(tmp, path)
}

// LoadCA reads the CA of dir, its certificate and key.
func LoadCA(dir string) (*x509.Certificate, crypto.Signer, error) {
	certPath, keyPath := filepath.Join(dir, CAFile), filepath.Join(dir, CAKeyFile)
	pair, err := tls.LoadX509KeyPair(certPath, keyPath)
	if err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return nil, nil, fmt.Errorf("no CA in %s (%v): create one with `dysco certs ca --dir %s`", dir, err, dir)
		}
		return nil, nil, fmt.Errorf("CA of %s: %w", dir, err)
	}
	ca, err := x509.ParseCertificate(pair.Certificate[0])
	if err != nil {
		return nil, nil, fmt.Errorf("%s: %w", certPath, err)
	}
	if !ca.IsCA {
		return nil, nil, fmt.Errorf("%s is not a CA certificate", certPath)
	}
	signer, ok := pair.PrivateKey.(crypto.Signer)
	if !ok {
		return nil, nil, fmt.Errorf("%s: the key cannot sign", keyPath)
	}
	return ca, signer, nil
}

// LoadPool reads the CA certificates of file (PEM) into a pool.
func LoadPool(file string) (*x509.CertPool, error) {
	data, err := os.ReadFile(file)
	if err != nil {
		return nil, fmt.Errorf("CA certificate: %w", err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(data) {
		return nil, fmt.Errorf("CA certificate %s: no PEM certificate in it", file)
	}
	return pool, nil
}

// Identity is who a verified client certificate names.
type Identity struct {
	Role string // RoleOperator, RoleAgent or RoleMonitor
	Name string // the common name: an agent's host name
}

// Verify checks that chain (a client's certificates, leaf first) is
// signed by roots, valid now and meant for client authentication, and
// returns the identity it carries.
func Verify(chain []*x509.Certificate, roots *x509.CertPool, now time.Time) (Identity, error) {
	if len(chain) == 0 {
		return Identity{}, errors.New("no client certificate")
	}
	inter := x509.NewCertPool()
	for _, c := range chain[1:] {
		inter.AddCert(c)
	}
	leaf := chain[0]
	if _, err := leaf.Verify(x509.VerifyOptions{Roots: roots, Intermediates: inter, CurrentTime: now,
		KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}}); err != nil {
		return Identity{}, fmt.Errorf("client certificate %q not accepted: %w", leaf.Subject.CommonName, err)
	}
	return IdentityOf(leaf)
}

// IdentityOf reads the role and name of a client certificate (not
// verifying it).
func IdentityOf(c *x509.Certificate) (Identity, error) {
	var roles []string
	for _, ou := range c.Subject.OrganizationalUnit {
		if slices.Contains(Roles, ou) {
			roles = append(roles, ou)
		}
	}
	if len(roles) != 1 {
		return Identity{}, fmt.Errorf("client certificate %q carries %d roles (organizational unit operator, agent or monitor), want one", c.Subject.CommonName, len(roles))
	}
	if err := ValidName(c.Subject.CommonName); err != nil {
		return Identity{}, fmt.Errorf("client certificate: %w", err)
	}
	return Identity{Role: roles[0], Name: c.Subject.CommonName}, nil
}

// ServerTLS returns the TLS configuration of the policy server: its
// certificate, and client certificates requested (not required: a client
// without one gets an HTTP 401 that the server counts; the server verifies
// them with Verify against the pool returned).
//
// The certificate is read again when its file changes (a renewed
// certificate, written with `dysco certs --force`), on the next handshake.
func ServerTLS(certFile, keyFile, caFile string) (*tls.Config, *x509.CertPool, error) {
	kp, err := newKeyPair(certFile, keyFile)
	if err != nil {
		return nil, nil, fmt.Errorf("server certificate: %w", err)
	}
	pool, err := LoadPool(caFile)
	if err != nil {
		return nil, nil, err
	}
	return &tls.Config{
		GetCertificate: func(*tls.ClientHelloInfo) (*tls.Certificate, error) { return kp.get(), nil },
		ClientAuth:     tls.RequestClientCert,
		MinVersion:     tls.VersionTLS13,
		NextProtos:     []string{"http/1.1"},
	}, pool, nil
}

// ClientTLS returns the TLS configuration of a client of the policy
// server: the server verified against caFile, and the client's certificate
// (none when certFile is empty), read again when its file changes.
func ClientTLS(caFile, certFile, keyFile string) (*tls.Config, error) {
	pool, err := LoadPool(caFile)
	if err != nil {
		return nil, err
	}
	tc := &tls.Config{RootCAs: pool, MinVersion: tls.VersionTLS13}
	if certFile != "" {
		kp, err := newKeyPair(certFile, keyFile)
		if err != nil {
			return nil, fmt.Errorf("client certificate: %w", err)
		}
		tc.GetClientCertificate = func(*tls.CertificateRequestInfo) (*tls.Certificate, error) { return kp.get(), nil }
	}
	return tc, nil
}

// CheckKeyFile refuses a private key file that others than its owner may
// read or write.
func CheckKeyFile(path string) error {
	st, err := os.Stat(path)
	if err != nil {
		return err
	}
	if m := st.Mode().Perm(); m&0o077 != 0 {
		return fmt.Errorf("key file %s has mode %04o: others than its owner may read it; chmod 600 %s", path, m, path)
	}
	return nil
}

// keyPair is a certificate and its key, read again from their files when
// the certificate file's modification time or size changes. A file that
// cannot be read, or a pair that does not match, leaves the last good pair
// in use (a renewal in progress writes the key first, then the
// certificate).
type keyPair struct {
	certFile, keyFile string
	mu                sync.Mutex
	pair              *tls.Certificate
	mod               time.Time
	size              int64
}

func newKeyPair(certFile, keyFile string) (*keyPair, error) {
	kp := &keyPair{certFile: certFile, keyFile: keyFile}
	if err := kp.load(); err != nil {
		return nil, err
	}
	return kp, nil
}

func (kp *keyPair) load() error {
	st, err := os.Stat(kp.certFile)
	if err != nil {
		return err
	}
	if err := CheckKeyFile(kp.keyFile); err != nil {
		return err
	}
	pair, err := tls.LoadX509KeyPair(kp.certFile, kp.keyFile)
	if err != nil {
		return err
	}
	kp.pair, kp.mod, kp.size = &pair, st.ModTime(), st.Size()
	return nil
}

// get returns the pair, read again if the certificate file changed.
func (kp *keyPair) get() *tls.Certificate {
	kp.mu.Lock()
	defer kp.mu.Unlock()
	if st, err := os.Stat(kp.certFile); err == nil && (!st.ModTime().Equal(kp.mod) || st.Size() != kp.size) {
		kp.load() // on failure the last good pair stays
	}
	return kp.pair
}

// ClientIdentity reads the identity of the client certificate file (for
// an agent's check that its certificate names it).
func ClientIdentity(certFile string) (Identity, error) {
	c, err := readCert(certFile)
	if err != nil {
		return Identity{}, err
	}
	return IdentityOf(c)
}
