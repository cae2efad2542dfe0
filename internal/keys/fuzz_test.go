package keys

import (
	"bytes"
	"encoding/hex"
	"strings"
	"testing"
)

// FuzzParse: any text either fails to parse with an error, or gives a ring
// of 1 to MaxSecrets distinct secrets of MinSecretLen to MaxSecretLen
// bytes, each named by a distinct 8-digit id, whose hex written back one
// per line parses to the same ring.
//
// `go test` runs the seeds; `go test -run '^$' -fuzz '^FuzzParse$'
// ./internal/keys` searches.
func FuzzParse(f *testing.F) {
	for _, s := range []string{
		"", "\n", "# only a comment\n", hexA + "\n", hexA, hexA + "\r\n",
		"# keys\n" + hexB + "  # new\n" + hexA + "\n",
		hexA + "\n" + hexA + "\n", hexA[:30] + "\n", "zz" + hexA + "\n", hexA + " " + hexB + "\n",
		manyKeys(MaxSecrets + 1), strings.Repeat("ab", MaxSecretLen+1) + "\n", "#\n#" + hexA + "\n",
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, text []byte) {
		r, err := Parse(text)
		if err != nil {
			if r != nil {
				t.Fatalf("a ring and an error: %v", err)
			}
			return
		}
		if r.Len() < 1 || r.Len() > MaxSecrets {
			t.Fatalf("%d secrets", r.Len())
		}
		ids := map[string]bool{}
		var again bytes.Buffer
		for i, s := range r.secrets {
			if len(s) < MinSecretLen || len(s) > MaxSecretLen {
				t.Fatalf("secret %d of %d bytes", i+1, len(s))
			}
			id := r.IDs()[i]
			if len(id) != 8 || ids[id] {
				t.Fatalf("id %q of secret %d (ids %v)", id, i+1, r.IDs())
			}
			ids[id] = true
			again.WriteString(strings.ToUpper(hex.EncodeToString(s)) + "\n")
		}
		r2, err := Parse(again.Bytes())
		if err != nil || !r2.Equal(r) {
			t.Fatalf("written back: %v", err)
		}
	})
}
