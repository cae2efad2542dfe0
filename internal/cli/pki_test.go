package cli

import (
	"path/filepath"
	"strings"
	"testing"

	"github.com/dysco/dysco/internal/agent"
	"github.com/dysco/dysco/internal/certs"
)

// The agent takes its certificate from PKI-DIR/agent-NAME.crt, and refuses
// one that is not an agent certificate naming it.
func TestAgentServerTLS(t *testing.T) {
	dir := t.TempDir()
	if _, err := certs.CreateCA(dir, "", certs.Options{}); err != nil {
		t.Fatal(err)
	}
	for _, c := range [][2]string{{certs.RoleAgent, "h1"}, {certs.RoleAgent, "h2"}, {certs.RoleOperator, "operator"}} {
		if _, _, err := certs.IssueClient(dir, c[0], c[1], certs.Options{}); err != nil {
			t.Fatal(err)
		}
	}
	pki := pkiFlags{dir: dir, base: "agent-{name}"}
	cfg := agent.Config{Name: "h1", PolicyServer: "https://10.0.0.9:7017"}
	if err := agentServerTLS(&cfg, pki); err != nil || cfg.PolicyServerTLS == nil || cfg.PolicyServerTLS.GetClientCertificate == nil {
		t.Fatalf("h1's own certificate: %v", err)
	}
	for _, c := range []struct {
		cert, want string
	}{
		{"agent-h2.crt", `not the agent certificate of "h1"`},
		{"operator.crt", `operator certificate of "operator"`},
	} {
		cfg := agent.Config{Name: "h1", PolicyServer: "https://10.0.0.9:7017"}
		p := pki
		p.cert = filepath.Join(dir, c.cert)
		if err := agentServerTLS(&cfg, p); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("--tls-cert %s: %v, want %q", c.cert, err, c.want)
		}
	}
	cfg = agent.Config{Name: "h3", PolicyServer: "https://10.0.0.9:7017"}
	if err := agentServerTLS(&cfg, pki); err == nil || !strings.Contains(err.Error(), "agent-h3.crt") {
		t.Errorf("no certificate for h3: %v", err)
	}
	// An http:// server (run with --insecure): no certificates.
	cfg = agent.Config{Name: "h3", PolicyServer: "http://10.0.0.9:7017"}
	if err := agentServerTLS(&cfg, pki); err != nil || cfg.PolicyServerTLS != nil {
		t.Errorf("http:// server: %v %v", err, cfg.PolicyServerTLS)
	}
}
