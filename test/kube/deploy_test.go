// Package kube tests the Kubernetes manifests of deploy/ against a real
// kube-apiserver (built by `make kube`) over a real etcd (`make etcd`),
// started by controller-runtime's envtest. Pods cannot run here (no
// kubelet, no images): the API server's admission and validation is what
// is tested.
package kube

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"sigs.k8s.io/controller-runtime/pkg/envtest"
)

// apiServer starts etcd and kube-apiserver and returns the path of an
// administrator's kubeconfig; both stop when the test ends.
func apiServer(t *testing.T) string {
	t.Helper()
	bin, err := filepath.Abs(filepath.Join("..", "..", "bin"))
	if err != nil {
		t.Fatal(err)
	}
	for _, b := range []string{"kube-apiserver", "etcd"} {
		if _, err := os.Stat(filepath.Join(bin, b)); err != nil {
			t.Fatalf("%v: run `make build` (it builds bin/etcd and bin/kube-apiserver)", err)
		}
	}
	if _, err := exec.LookPath("kubectl"); err != nil {
		t.Fatalf("kubectl: %v (scripts/deps.sh installs it)", err)
	}
	env := &envtest.Environment{BinaryAssetsDirectory: bin}
	if _, err := env.Start(); err != nil {
		t.Fatalf("starting etcd and kube-apiserver: %v", err)
	}
	t.Cleanup(func() {
		if err := env.Stop(); err != nil {
			t.Errorf("stopping the API server: %v", err)
		}
	})
	user, err := env.ControlPlane.AddUser(envtest.User{Name: "dysco-test-admin", Groups: []string{"system:masters"}}, nil)
	if err != nil {
		t.Fatal(err)
	}
	kc, err := user.KubeConfig()
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(t.TempDir(), "kubeconfig")
	if err := os.WriteFile(path, kc, 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

// kubectl runs kubectl against the test's API server.
func kubectl(t *testing.T, kubeconfig string, args ...string) (string, error) {
	t.Helper()
	out, err := exec.Command("kubectl", append([]string{"--kubeconfig", kubeconfig}, args...)...).CombinedOutput()
	return string(out), err
}

// TestDeployManifests: every object of deploy/base passes the API
// server's validation and admission (kubectl apply --dry-run=server), and
// a broken one does not (the dry run really validates).
func TestDeployManifests(t *testing.T) {
	kc := apiServer(t)
	base := filepath.Join("..", "..", "deploy", "base")
	rendered, err := exec.Command("kubectl", "kustomize", base).CombinedOutput()
	if err != nil {
		t.Fatalf("kubectl kustomize %s: %v\n%s", base, err, rendered)
	}
	// A dry run creates nothing: the namespace the other objects go in
	// must exist for real.
	if out, err := kubectl(t, kc, "create", "namespace", "dysco-system"); err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	out, err := kubectl(t, kc, "apply", "--dry-run=server", "-k", base)
	if err != nil {
		t.Fatalf("kubectl apply --dry-run=server -k %s: %v\n%s", base, err, out)
	}
	for _, want := range []string{
		"namespace/dysco-system", "configmap/dysco-config", "service/dysco-policy-server",
		"deployment.apps/dysco-policy-server", "poddisruptionbudget.policy/dysco-policy-server",
		"daemonset.apps/dysco-agent",
	} {
		if !strings.Contains(out, want) || !strings.Contains(out, "(server dry run)") {
			t.Errorf("the dry run does not list %s:\n%s", want, out)
		}
	}

	// The variant with the policy set in custom resources: the CRDs, the
	// policy servers' account and permissions.
	over := filepath.Join("..", "..", "deploy", "kubernetes")
	out, err = kubectl(t, kc, "apply", "--dry-run=server", "-k", over)
	if err != nil {
		t.Fatalf("kubectl apply --dry-run=server -k %s: %v\n%s", over, err, out)
	}
	for _, want := range []string{
		"customresourcedefinition.apiextensions.k8s.io/policies.dysco.io", "serviceaccount/dysco-policy-server",
		"clusterrole.rbac.authorization.k8s.io/dysco-policy-server", "role.rbac.authorization.k8s.io/dysco-policy-server",
		"deployment.apps/dysco-policy-server", "daemonset.apps/dysco-agent",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("the dry run of %s does not list %s:\n%s", over, want, out)
		}
	}

	// The same DaemonSet with a mount propagation that needs privilege
	// taken away is refused by the API server's validation.
	broken := strings.Replace(string(rendered), "privileged: true", "privileged: false", 1)
	if broken == string(rendered) {
		t.Fatal("the rendered manifests have no privileged container")
	}
	file := filepath.Join(t.TempDir(), "broken.yaml")
	if err := os.WriteFile(file, []byte(broken), 0o644); err != nil {
		t.Fatal(err)
	}
	out, err = kubectl(t, kc, "apply", "--dry-run=server", "-f", file)
	if err == nil || !strings.Contains(out, "Bidirectional") {
		t.Fatalf("a DaemonSet with Bidirectional propagation and no privilege was accepted: %v\n%s", err, out)
	}
}
