package main

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"math/rand/v2"
	"strconv"
	"strings"
	"sync"
)

// maxBytes bounds N in /bytes/N (64 GiB): a typo should not start an
// endless download.
const maxBytes = 64 << 30

// hashHeader carries the SHA-256 of a /bytes/N body, in hex.
const hashHeader = "X-Content-Sha256"

// stream returns the deterministic body of /bytes/n: ChaCha8 keyed by the
// SHA-256 of "dysco-h3 <n>", so that client and server agree without
// exchanging anything.
func stream(n int64) io.Reader {
	seed := sha256.Sum256([]byte("dysco-h3 " + strconv.FormatInt(n, 10)))
	return io.LimitReader(rand.NewChaCha8(seed), n)
}

var (
	hashMu    sync.Mutex
	hashCache = map[int64]string{}
)

// streamHash returns the hex SHA-256 of stream(n), computed once per n.
func streamHash(n int64) string {
	hashMu.Lock()
	defer hashMu.Unlock()
	if h, ok := hashCache[n]; ok {
		return h
	}
	h := sha256.New()
	io.Copy(h, stream(n))
	s := hex.EncodeToString(h.Sum(nil))
	hashCache[n] = s
	return s
}

// parseBytesPath reads N from a path "/bytes/N".
func parseBytesPath(p string) (int64, error) {
	rest, ok := strings.CutPrefix(p, "/bytes/")
	if !ok {
		return 0, fmt.Errorf("path %q is not /bytes/N", p)
	}
	n, err := strconv.ParseInt(rest, 10, 64)
	if err != nil || n < 0 {
		return 0, fmt.Errorf("path %q: N must be a non-negative integer", p)
	}
	if n > maxBytes {
		return 0, fmt.Errorf("path %q: N is over the limit of %d bytes", p, int64(maxBytes))
	}
	return n, nil
}
