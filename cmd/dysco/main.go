// Command dysco is the Dysco agent, policy server, operator CLI and lab, in one
// binary. See README.md.
package main

import (
	"os"

	"github.com/dysco/dysco/internal/cli"
)

func main() {
	os.Exit(cli.Main(os.Args[1:]))
}
