package agent

import (
	"crypto/hmac"
	"crypto/sha256"
	"testing"
)

// TestSynMACKey: the SYN key is HKDF-SHA256 of the secret (no salt, info
// "dysco syn-mac v1"), computed here from RFC 5869's definition with HMAC
// so that the derivation cannot change unnoticed: a change would split a
// deployment whose hosts run different versions.
func TestSynMACKey(t *testing.T) {
	secret := []byte("0123456789abcdef0123456789abcdef")
	got, err := SynMACKey(secret)
	if err != nil {
		t.Fatal(err)
	}
	// Extract with a zero salt, then the first block of expand.
	ext := hmac.New(sha256.New, make([]byte, sha256.Size))
	ext.Write(secret)
	prk := ext.Sum(nil)
	exp := hmac.New(sha256.New, prk)
	exp.Write([]byte("dysco syn-mac v1"))
	exp.Write([]byte{1})
	want := exp.Sum(nil)[:16]
	if string(got[:]) != string(want) {
		t.Fatalf("SynMACKey = %x, want %x", got, want)
	}
	other, _ := SynMACKey(append([]byte("x"), secret...))
	if other == got {
		t.Fatal("two secrets give the same key")
	}
	if _, err := SynMACKey(secret[:15]); err == nil {
		t.Fatal("a 15-byte secret is accepted")
	}
}
