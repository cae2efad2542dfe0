// Package crds holds the custom resource definitions of the Kubernetes
// store (docs/kubernetes.md), for the programs that install them without
// kustomize: the end-to-end test and the convergence benchmark.
package crds

import (
	"embed"
	"io/fs"
	"strings"
)

//go:embed policies.yaml middleboxtypes.yaml operations.yaml
var files embed.FS

// YAML is every definition, as one multi-document YAML stream.
func YAML() []byte {
	var docs []string
	ents, _ := fs.ReadDir(files, ".")
	for _, e := range ents {
		b, err := files.ReadFile(e.Name())
		if err != nil {
			panic(err) // embedded above
		}
		docs = append(docs, string(b))
	}
	return []byte(strings.Join(docs, "\n---\n"))
}
