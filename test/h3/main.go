// Command dysco-h3 is an HTTP/3 server and client for Dysco's tests and
// experiments: real QUIC sessions (quic-go, with its defaults: UDP GSO on
// send where the kernel has it) whose bytes are checked end to end, and a
// server that reports whether any of its connections migrated.
//
//	dysco-h3 serve --listen [::]:4433 [--stats FILE] [--cert FILE] [--rate 40M]
//	dysco-h3 get https://10.0.0.2:4433/bytes/52428800 --insecure [--out FILE] [--interval 100ms --samples FILE]
//
// The server serves GET /bytes/N: N pseudo-random bytes that depend only on
// N, with their SHA-256 in the header X-Content-Sha256. The client checks
// the bytes against that header and against its own copy of the stream, and
// prints a JSON summary. --rate paces each response body (bits per
// second), so that a download lasts as long as a test needs whatever the
// machine's speed. A download uses exactly one QUIC connection and is
// never retried: a reset or a timeout is an error (exit status 1).
//
// It lives in its own Go module (test/h3) so that the product binary does
// not depend on quic-go; `make build` builds it into bin/dysco-h3.
package main

import (
	"fmt"
	"os"
)

const usage = `usage:
  dysco-h3 serve --listen ADDR:PORT [--stats FILE] [--cert FILE] [--rate RATE]
  dysco-h3 get URL [--insecure | --ca FILE] [--out FILE] [--interval D --samples FILE] [--timeout D]
`

func main() {
	if len(os.Args) < 2 {
		fmt.Fprint(os.Stderr, usage)
		os.Exit(2)
	}
	var err error
	switch os.Args[1] {
	case "serve":
		err = serveMain(os.Args[2:])
	case "get":
		err = getMain(os.Args[2:])
	case "-h", "--help", "help":
		fmt.Print(usage)
		return
	default:
		err = fmt.Errorf("unknown subcommand %q", os.Args[1])
		fmt.Fprint(os.Stderr, usage)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "dysco-h3:", err)
		os.Exit(1)
	}
}
