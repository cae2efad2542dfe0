// Command gen writes bpf/include/wire_gen.h from package wire, so that the
// datapath's C code and the Go code share one definition of the wire format.
package main

import (
	"flag"
	"log"
	"os"

	"github.com/dysco/dysco/internal/wire"
)

func main() {
	out := flag.String("o", "wire_gen.h", "output file")
	flag.Parse()
	if err := os.WriteFile(*out, wire.CHeader(), 0o644); err != nil {
		log.Fatal(err)
	}
}
