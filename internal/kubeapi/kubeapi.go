// Package kubeapi prepares a real kube-apiserver (bin/kube-apiserver, built
// by `make kube`) for the programs that run one without envtest: the
// end-to-end test of agents following Kubernetes objects, and the
// convergence benchmark. It writes the serving certificate, an
// administrator's token and kubeconfig, and the service-account key, and
// gives the command line; the caller starts the process where it wants
// (a lab namespace, or loopback), waits with Ready and installs the
// custom resources with Install. No kubelet runs: Pods can be created as
// objects but never start.
package kubeapi

import (
	"bufio"
	"bytes"
	"context"
	"crypto/rand"
	"crypto/tls"
	"encoding/hex"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"github.com/dysco/dysco/deploy/crds"
	"github.com/dysco/dysco/internal/certs"
	"github.com/dysco/dysco/internal/policyserver"
)

// Server is an API server's files and address.
type Server struct {
	Addr       netip.AddrPort // where it listens (HTTPS)
	Etcd       string         // its etcd's client URLs, comma-separated
	Dir        string
	CAFile     string // the CA that signed the serving certificate
	Token      string // an administrator's bearer token (system:masters)
	Kubeconfig string // an administrator's kubeconfig
	certFile   string
	keyFile    string
}

// Prepare writes, in dir, what an API server at addr over etcd needs.
func Prepare(dir string, addr netip.AddrPort, etcd string) (*Server, error) {
	s := &Server{Addr: addr, Etcd: etcd, Dir: dir}
	var err error
	if s.CAFile, err = certs.CreateCA(dir, "kube-apiserver CA", certs.Options{}); err != nil {
		return nil, err
	}
	if s.certFile, s.keyFile, err = certs.IssueServer(dir, []string{"localhost"}, []netip.Addr{addr.Addr()}, certs.Options{}); err != nil {
		return nil, err
	}
	tok := make([]byte, 16)
	rand.Read(tok)
	s.Token = hex.EncodeToString(tok)
	if err := os.WriteFile(filepath.Join(dir, "tokens.csv"), []byte(s.Token+`,admin,admin,"system:masters"`+"\n"), 0o600); err != nil {
		return nil, err
	}
	s.Kubeconfig = filepath.Join(dir, "kubeconfig")
	kc := fmt.Sprintf(`apiVersion: v1
kind: Config
clusters:
- name: lab
  cluster:
    server: %s
    certificate-authority: %s
users:
- name: admin
  user:
    token: %s
contexts:
- name: lab
  context: {cluster: lab, user: admin}
current-context: lab
`, s.URL(), s.CAFile, s.Token)
	if err := os.WriteFile(s.Kubeconfig, []byte(kc), 0o600); err != nil {
		return nil, err
	}
	return s, nil
}

// URL is the API server's address as clients use it.
func (s *Server) URL() string { return "https://" + s.Addr.String() }

// Argv is the command line of the API server, bin its binary: RBAC, the
// administrator's token, no ServiceAccount admission (no controller
// manager creates the default accounts). The service-account tokens
// are signed with the serving key.
func (s *Server) Argv(bin string) []string {
	return []string{bin,
		"--etcd-servers", s.Etcd,
		"--bind-address", s.Addr.Addr().String(), "--advertise-address", s.Addr.Addr().String(),
		"--secure-port", fmt.Sprint(s.Addr.Port()),
		"--tls-cert-file", s.certFile, "--tls-private-key-file", s.keyFile, "--cert-dir", s.Dir,
		"--token-auth-file", filepath.Join(s.Dir, "tokens.csv"),
		"--authorization-mode", "RBAC",
		"--service-account-issuer", s.URL(), "--service-account-key-file", s.certFile, "--service-account-signing-key-file", s.keyFile,
		"--service-cluster-ip-range", "10.0.0.0/24", "--disable-admission-plugins", "ServiceAccount", "--allow-privileged=true",
		// No Service named kubernetes: its endpoints would refuse loopback.
		"--endpoint-reconciler-type", "none",
	}
}

// Ready waits, for at most within, until the API server answers /readyz
// with 200. dial opens its connections (nil: the caller's network
// namespace); exited, when it is closed, means the process is gone.
func (s *Server) Ready(ctx context.Context, within time.Duration, dial func(ctx context.Context, network, addr string) (net.Conn, error), exited <-chan struct{}) error {
	cl, err := s.client(dial, 2*time.Second)
	if err != nil {
		return err
	}
	defer cl.CloseIdleConnections()
	end := time.Now().Add(within)
	last := "no answer"
	for {
		resp, err := s.get(ctx, cl, "/readyz")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == 200 {
				return nil
			}
			last = resp.Status
		} else {
			last = err.Error()
		}
		if time.Now().After(end) {
			return fmt.Errorf("kube-apiserver at %s not ready within %s: %s", s.URL(), within, last)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-exited:
			return fmt.Errorf("kube-apiserver at %s exited", s.URL())
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// Kubectl is the command line of kubectl with args as the administrator.
func (s *Server) Kubectl(args ...string) []string {
	return append([]string{"kubectl", "--kubeconfig", s.Kubeconfig}, args...)
}

// Install creates the policy servers' namespace and the custom resource
// definitions, and waits until they are established. command makes the
// kubectl commands (exec.CommandContext, or a lab's Command to run them
// in a namespace).
func (s *Server) Install(ctx context.Context, command func(ctx context.Context, name string, args ...string) *exec.Cmd) error {
	run := func(stdin []byte, args ...string) error {
		argv := s.Kubectl(args...)
		cmd := command(ctx, argv[0], argv[1:]...)
		cmd.Stdin = bytes.NewReader(stdin)
		if out, err := cmd.CombinedOutput(); err != nil {
			return fmt.Errorf("kubectl %s: %v: %s", strings.Join(args, " "), err, bytes.TrimSpace(out))
		}
		return nil
	}
	if err := run(nil, "create", "namespace", policyserver.DefaultKubeNamespace); err != nil {
		return err
	}
	if err := run(crds.YAML(), "apply", "--server-side", "-f", "-"); err != nil {
		return err
	}
	return run(nil, "wait", "--for=condition=Established", "--timeout=30s",
		"crd/policies.dysco.io", "crd/middleboxtypes.dysco.io", "crd/operations.dysco.io")
}

// ControllerPID is the process ID of the policy-server replica that holds
// the controller's Lease (its identity is HOSTNAME-PID-START).
func (s *Server) ControllerPID(ctx context.Context, command func(ctx context.Context, name string, args ...string) *exec.Cmd) (int, error) {
	argv := s.Kubectl("get", "lease", policyserver.KubeControllerLease, "-n", policyserver.DefaultKubeNamespace,
		"-o", "jsonpath={.spec.holderIdentity}")
	out, err := command(ctx, argv[0], argv[1:]...).CombinedOutput()
	if err != nil {
		return 0, fmt.Errorf("the controller's Lease: %v: %s", err, bytes.TrimSpace(out))
	}
	f := strings.Split(strings.TrimSpace(string(out)), "-")
	var pid int
	if len(f) < 3 {
		return 0, fmt.Errorf("the controller's Lease is held by %q, not HOSTNAME-PID-START", out)
	}
	if _, err := fmt.Sscan(f[len(f)-2], &pid); err != nil {
		return 0, fmt.Errorf("the controller's Lease is held by %q: %v", out, err)
	}
	return pid, nil
}

// Requests is the number of requests of verb (LIST, WATCH, GET…) the API
// server has served: the sum of its apiserver_request_total series with
// that verb, from /metrics.
func (s *Server) Requests(ctx context.Context, verb string) (float64, error) {
	cl, err := s.client(nil, 5*time.Second)
	if err != nil {
		return 0, err
	}
	defer cl.CloseIdleConnections()
	resp, err := s.get(ctx, cl, "/metrics")
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != 200 {
		return 0, fmt.Errorf("kube-apiserver /metrics: %s", resp.Status)
	}
	var sum float64
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		l := sc.Text()
		if !strings.HasPrefix(l, "apiserver_request_total{") || !strings.Contains(l, `verb="`+verb+`"`) {
			continue
		}
		var n float64
		if _, err := fmt.Sscan(l[strings.LastIndexByte(l, ' ')+1:], &n); err == nil {
			sum += n
		}
	}
	return sum, sc.Err()
}

// client is an HTTPS client of the API server that trusts its CA; dial
// opens its connections (nil: the caller's network namespace).
func (s *Server) client(dial func(ctx context.Context, network, addr string) (net.Conn, error), timeout time.Duration) (*http.Client, error) {
	pool, err := certs.LoadPool(s.CAFile)
	if err != nil {
		return nil, err
	}
	return &http.Client{Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool}, DialContext: dial}, Timeout: timeout}, nil
}

// get GETs path as the administrator.
func (s *Server) get(ctx context.Context, cl *http.Client, path string) (*http.Response, error) {
	req, err := http.NewRequestWithContext(ctx, "GET", s.URL()+path, nil)
	if err != nil {
		return nil, err
	}
	req.Header.Set("Authorization", "Bearer "+s.Token)
	return cl.Do(req)
}
