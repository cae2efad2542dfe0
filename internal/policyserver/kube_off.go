//go:build !kubernetes

package policyserver

import "errors"

// KubeSupport tells whether this build has the Kubernetes store: the
// default build leaves client-go out (it would more than double the
// binary every agent runs); `make build` writes bin/dysco-kube with it.
const KubeSupport = false

// openKube refuses: this build has no Kubernetes store.
func (s *Server) openKube(Config) error {
	return errors.New("policy server: this dysco is built without the Kubernetes store; run dysco-kube (`make build` writes bin/dysco-kube; docs/kubernetes.md)")
}
