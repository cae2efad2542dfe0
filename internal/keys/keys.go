// Package keys holds the deployment secrets that authenticate what Dysco
// agents tell each other, and the purpose keys derived from them (the
// paper's §2.3, "Security", leaves the protection of control packets to
// conventional techniques; these are this implementation's).
//
// A key file holds one or more deployment secrets, one hex string per
// line; '#' starts a comment. The first secret signs, every secret of the
// file is accepted: that is what lets an operator rotate secrets without
// stopping anything (docs/operating.md, "Control keys"). A secret is never
// used as a key itself: every use derives its own key with HKDF-SHA256
// (RFC 5869) and a label of its own (Derive), so that a key of one use
// cannot be turned against another.
package keys

import (
	"bufio"
	"bytes"
	"crypto/hkdf"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"
	"syscall"
)

// Purposes: the HKDF info label of every key derived from a deployment
// secret. Each use has its own; changing a label changes the key (and so
// the wire format of whatever it authenticates).
const (
	// PurposeControl authenticates control messages (docs/protocol.md,
	// "Authentication").
	PurposeControl = "dysco control-mac v1"
	// PurposeSYN authenticates the block of a Dysco SYN in the datapath.
	PurposeSYN = "dysco syn-mac v1"
	// PurposeID names a secret in logs and status (KeyID): a public
	// fingerprint, useless as a key.
	PurposeID = "dysco key-id v1"
)

const (
	// MinSecretLen is the shortest deployment secret accepted (128 bits).
	MinSecretLen = 16
	// MaxSecretLen bounds a secret (a line of the file).
	MaxSecretLen = 1024
	// MaxSecrets bounds the secrets of one file: a message that no key
	// authenticates costs one MAC per secret.
	MaxSecrets = 8
	// DerivedLen is the length of every derived key (SHA-256's output).
	DerivedLen = 32
	// maxFileLen bounds the key file read.
	maxFileLen = 64 << 10
)

// Derive returns the key for purpose derived from a deployment secret:
// HKDF-SHA256 with no salt, the purpose as info, 32 bytes.
func Derive(secret []byte, purpose string) []byte {
	k, err := hkdf.Key(sha256.New, secret, nil, purpose, DerivedLen)
	if err != nil {
		// Only a length beyond 255 hash outputs fails.
		panic("keys: HKDF: " + err.Error())
	}
	return k
}

// KeyID is a secret's public name: 8 hex digits derived from it
// (PurposeID), for logs and status. Two files with the same secret show the
// same id; the id tells nothing of the secret.
func KeyID(secret []byte) string {
	return hex.EncodeToString(Derive(secret, PurposeID)[:4])
}

// Ring is the set of deployment secrets of a key file, in file order: the
// first signs, all verify. Immutable.
type Ring struct {
	secrets [][]byte
	ids     []string
}

// NewRing returns a ring of secrets (the first signs). Each must be
// MinSecretLen to MaxSecretLen bytes, at most MaxSecrets of them, no two
// alike.
func NewRing(secrets ...[]byte) (*Ring, error) {
	if len(secrets) == 0 {
		return nil, errors.New("no key")
	}
	if len(secrets) > MaxSecrets {
		return nil, fmt.Errorf("%d keys, at most %d", len(secrets), MaxSecrets)
	}
	r := &Ring{}
	for i, s := range secrets {
		if len(s) < MinSecretLen {
			return nil, fmt.Errorf("key %d: %d bytes, at least %d needed (%d hex digits; e.g. 'openssl rand -hex 32')", i+1, len(s), MinSecretLen, 2*MinSecretLen)
		}
		if len(s) > MaxSecretLen {
			return nil, fmt.Errorf("key %d: %d bytes, at most %d", i+1, len(s), MaxSecretLen)
		}
		for j := range i {
			if bytes.Equal(secrets[j], s) {
				return nil, fmt.Errorf("key %d repeats key %d", i+1, j+1)
			}
		}
		r.secrets = append(r.secrets, bytes.Clone(s))
		r.ids = append(r.ids, KeyID(s))
	}
	return r, nil
}

// Parse reads a key file's text: one hex secret per line, the first
// signing; blank lines and everything from a '#' to the end of its line
// are ignored.
func Parse(text []byte) (*Ring, error) {
	var secrets [][]byte
	sc := bufio.NewScanner(bytes.NewReader(text))
	sc.Buffer(make([]byte, 0, 4096), maxFileLen)
	for n := 1; sc.Scan(); n++ {
		line := sc.Text()
		if i := strings.IndexByte(line, '#'); i >= 0 {
			line = line[:i]
		}
		line = strings.TrimSpace(line)
		if line == "" {
			continue
		}
		s, err := hex.DecodeString(line)
		if err != nil {
			return nil, fmt.Errorf("line %d: not a hex key (one key per line, '#' for comments): %v", n, err)
		}
		if len(secrets) == MaxSecrets {
			return nil, fmt.Errorf("line %d: more than %d keys", n, MaxSecrets)
		}
		secrets = append(secrets, s)
	}
	if err := sc.Err(); err != nil {
		return nil, err
	}
	r, err := NewRing(secrets...)
	if err != nil && len(secrets) == 0 {
		return nil, errors.New("no key in it")
	}
	return r, err
}

// Len is the number of secrets.
func (r *Ring) Len() int { return len(r.secrets) }

// IDs are the secrets' ids (KeyID), the signing one first.
func (r *Ring) IDs() []string { return append([]string(nil), r.ids...) }

// Signing is the secret that signs (the file's first).
func (r *Ring) Signing() []byte { return r.secrets[0] }

// Derive returns the key of purpose derived from every secret, the signing
// one's first.
func (r *Ring) Derive(purpose string) [][]byte {
	out := make([][]byte, len(r.secrets))
	for i, s := range r.secrets {
		out[i] = Derive(s, purpose)
	}
	return out
}

// Equal reports whether two rings hold the same secrets in the same order.
func (r *Ring) Equal(o *Ring) bool {
	if r == nil || o == nil || len(r.secrets) != len(o.secrets) {
		return r == o
	}
	for i := range r.secrets {
		if !bytes.Equal(r.secrets[i], o.secrets[i]) {
			return false
		}
	}
	return true
}

// FileError is a key file refused for its permissions or owner.
type FileError struct {
	Path string
	Msg  string
}

func (e *FileError) Error() string { return e.Path + ": " + e.Msg }

// Load reads a key file. The file must be a regular file owned by root or
// by uid (the agent's user), readable and writable by its owner only (mode
// 0600 or 0400): a secret that another user can read is no secret, and one
// that another can write lets them choose it.
func Load(path string, uid int) (*Ring, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	// The checks and the read are of the same open file.
	fi, err := f.Stat()
	if err != nil {
		return nil, err
	}
	if !fi.Mode().IsRegular() {
		return nil, &FileError{path, fmt.Sprintf("not a regular file (%s)", fi.Mode().Type())}
	}
	if perm := fi.Mode().Perm(); perm&0o077 != 0 {
		return nil, &FileError{path, fmt.Sprintf("mode %04o lets group or others read or write the key; run 'chmod 600 %s'", perm, path)}
	}
	if st, ok := fi.Sys().(*syscall.Stat_t); ok && st.Uid != 0 && int(st.Uid) != uid {
		return nil, &FileError{path, fmt.Sprintf("owned by uid %d, not by root or the agent's uid %d; run 'chown %d %s'", st.Uid, uid, uid, path)}
	}
	if fi.Size() > maxFileLen {
		return nil, &FileError{path, fmt.Sprintf("%d bytes, a key file has at most %d", fi.Size(), maxFileLen)}
	}
	b, err := io.ReadAll(io.LimitReader(f, maxFileLen+1))
	if err != nil {
		return nil, err
	}
	if len(b) > maxFileLen {
		return nil, &FileError{path, fmt.Sprintf("more than %d bytes", maxFileLen)}
	}
	r, perr := Parse(b)
	clear(b)
	if perr != nil {
		return nil, fmt.Errorf("%s: %w", path, perr)
	}
	return r, nil
}
