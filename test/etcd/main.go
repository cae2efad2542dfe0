// Command etcd is the etcd server (go.etcd.io/etcd/server/v3), built from
// Go modules for the tests and benchmarks of the etcd backend: `make build`
// writes bin/etcd, and bin/etcdctl from the same module's tool.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() { etcdmain.Main(os.Args) }
