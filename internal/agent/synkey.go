package agent

import (
	"crypto/hkdf"
	"crypto/sha256"
	"errors"

	"github.com/dysco/dysco/internal/wire"
)

// synKeyInfo labels the SYN MAC key among the keys derived from a
// deployment secret.
const synKeyInfo = "dysco syn-mac v1"

// SynMACKey derives the key that signs and verifies the MACs of Dysco SYN
// blocks (wire.BlockMAC, admission in the datapath) from a deployment
// secret: HKDF-SHA256 with no salt and the info label "dysco syn-mac v1".
// Every host of a deployment derives the same key from the same secret.
func SynMACKey(secret []byte) (wire.MACKey, error) {
	var k wire.MACKey
	if len(secret) < 16 {
		return k, errors.New("agent: a deployment secret of at least 16 bytes is needed for the SYN key")
	}
	b, err := hkdf.Key(sha256.New, secret, nil, synKeyInfo, wire.MACKeyLen)
	if err != nil {
		return k, err
	}
	copy(k[:], b)
	return k, nil
}
