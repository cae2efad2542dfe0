//go:build !kubernetes

package policyserver

import (
	"strings"
	"testing"
)

// The default build has no Kubernetes store, and says where it is.
func TestKubeOff(t *testing.T) {
	_, err := New(Config{Insecure: true, Kubernetes: true, Logger: quietLogger()})
	if err == nil || !strings.Contains(err.Error(), "run dysco-kube") {
		t.Fatalf("--kubernetes in the default build: %v", err)
	}
}
