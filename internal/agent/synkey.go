package agent

import (
	"errors"

	"github.com/dysco/dysco/internal/keys"
	"github.com/dysco/dysco/internal/wire"
)

// SynMACKey derives the key that signs and verifies the MACs of Dysco SYN
// blocks (wire.BlockMAC, admission in the datapath) from a deployment
// secret: the first wire.MACKeyLen bytes of keys.Derive(secret,
// keys.PurposeSYN), that is HKDF-SHA256 with no salt and the info label
// "dysco syn-mac v1" (an HKDF output's prefix is the shorter output).
// Every host of a deployment derives the same key from the same secret.
func SynMACKey(secret []byte) (wire.MACKey, error) {
	if len(secret) < 16 {
		return wire.MACKey{}, errors.New("agent: a deployment secret of at least 16 bytes is needed for the SYN key")
	}
	return *synKey(keys.Derive(secret, keys.PurposeSYN)), nil
}

// synKey is the SYN MAC key in a key derived for keys.PurposeSYN.
func synKey(derived []byte) *wire.MACKey {
	var k wire.MACKey
	copy(k[:], derived)
	return &k
}
