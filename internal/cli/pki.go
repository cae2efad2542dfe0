package cli

import (
	"crypto/tls"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/spf13/pflag"

	"github.com/dysco/dysco/internal/api"
	"github.com/dysco/dysco/internal/certs"
)

// defaultPKIDir is where certificates are looked for: $DYSCO_PKI_DIR, else
// /etc/dysco/pki.
func defaultPKIDir() string {
	if d := os.Getenv("DYSCO_PKI_DIR"); d != "" {
		return d
	}
	return certs.DefaultDir
}

// pkiFlags are the certificate flags of a client of the policy server: the
// client's certificate and key (by default BASE.crt and BASE.key in the
// PKI directory) and the CA that signs the server's certificate.
type pkiFlags struct {
	dir, cert, key, ca string
	base               string // default base name of the client's files
}

// add registers --pki-dir, --tls-cert, --tls-key and --tls-ca; base names
// the default certificate files (e.g. "operator", "agent-{name}").
func (p *pkiFlags) add(f *pflag.FlagSet, base string) {
	p.base = base
	f.StringVar(&p.dir, "pki-dir", defaultPKIDir(), "directory of the certificates for the policy server (made by dysco certs; env DYSCO_PKI_DIR)")
	f.StringVar(&p.cert, "tls-cert", "", "client certificate for an https:// policy server (default PKI-DIR/"+base+".crt)")
	f.StringVar(&p.key, "tls-key", "", "its key (default PKI-DIR/"+base+".key)")
	f.StringVar(&p.ca, "tls-ca", "", "CA certificate that signs the policy server's (default PKI-DIR/"+certs.CAFile+")")
}

// files returns the certificate, key and CA files, base's {name} replaced
// by name.
func (p pkiFlags) files(name string) (cert, key, ca string) {
	base := strings.ReplaceAll(p.base, "{name}", name)
	dc, dk := certs.Paths(p.dir, base)
	cert, key, ca = p.cert, p.key, p.ca
	if cert == "" {
		cert = dc
	}
	if key == "" {
		key = dk
		if p.cert != "" && strings.HasSuffix(p.cert, ".crt") {
			key = strings.TrimSuffix(p.cert, ".crt") + ".key"
		}
	}
	if ca == "" {
		ca = filepath.Join(p.dir, certs.CAFile)
	}
	return cert, key, ca
}

// tlsFor returns the TLS configuration for serverURL: nil for an http://
// URL (a server started with --insecure), else the client certificate and
// the CA, loaded now so that a missing file is reported at once.
func (p pkiFlags) tlsFor(serverURL, name string) (*tls.Config, error) {
	if strings.HasPrefix(strings.TrimSpace(serverURL), "http://") {
		return nil, nil
	}
	cert, key, ca := p.files(name)
	tc, err := certs.ClientTLS(ca, cert, key)
	if err != nil {
		return nil, fmt.Errorf("policy server %s: %w (issue certificates with `dysco certs`; give them with --pki-dir or --tls-cert, --tls-key, --tls-ca)", serverURL, err)
	}
	return tc, nil
}

// serverClient returns the client of the policy server at serverURL with
// the certificates of p.
func (p pkiFlags) serverClient(serverURL string) (*api.Client, error) {
	tc, err := p.tlsFor(serverURL, "")
	if err != nil {
		return nil, err
	}
	return api.NewServerClientTLS(serverURL, tc), nil
}
