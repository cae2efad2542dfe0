package protocol

import (
	"encoding/binary"
	"errors"
	"fmt"
)

// Bundles: several control datagrams' payloads in one UDP datagram
// (docs/protocol.md, "Bundles"). An agent that has more than one message
// for the same agent at the end of a step of its loop sends them as one
// bundle: under many concurrent reconfigurations (a proxy removing itself
// from hundreds of sessions at once) the agents' time goes mostly to
// carrying datagrams through the network stack, once per datagram. A
// bundle adds no authentication of its own: each message in it is checked
// as if it had come alone, so a bundle can carry nothing its messages could
// not carry one by one.
//
// Layout (network byte order):
//
//	0 magic "DYSB" (4)   4 version (1)   5 count (1), at least 2
//	6 count times: length (2), at least 1, then that many bytes: one
//	  datagram's payload (a control message, a trigger, a migration
//	  message; never a bundle)
//
// and nothing after the last one.
const (
	// BundleMagic opens a bundle ("DYSB").
	BundleMagic = 0x44595342
	// BundleVersion is the bundle layout this code writes and accepts.
	BundleVersion = 1
	// BundleHeaderLen is the fixed part before the first length.
	BundleHeaderLen = 6
	// BundleMax is the largest bundle written: a UDP payload that fits the
	// IPv6 minimum MTU (1280 − 40 − 8), so bundles are never fragmented.
	BundleMax = 1232
	// bundleMaxCount is the most payloads a bundle holds (its count byte).
	bundleMaxCount = 255
)

// IsBundle tells whether a datagram's payload claims to be a bundle (its
// magic); SplitBundle checks the rest.
func IsBundle(b []byte) bool {
	return len(b) >= 4 && binary.BigEndian.Uint32(b) == BundleMagic
}

// ErrBundle is wrapped by SplitBundle's errors.
var ErrBundle = errors.New("malformed bundle")

// SplitBundle returns the payloads of a bundle, in order; they share b's
// memory. Any departure from the layout refuses the whole bundle.
func SplitBundle(b []byte) ([][]byte, error) {
	if !IsBundle(b) {
		return nil, fmt.Errorf("%w: no bundle magic", ErrBundle)
	}
	if len(b) < BundleHeaderLen {
		return nil, fmt.Errorf("%w: %d bytes, shorter than a header", ErrBundle, len(b))
	}
	if b[4] != BundleVersion {
		return nil, fmt.Errorf("%w: version %d, want %d", ErrBundle, b[4], BundleVersion)
	}
	n := int(b[5])
	if n < 2 {
		return nil, fmt.Errorf("%w: count %d, at least 2", ErrBundle, n)
	}
	out := make([][]byte, 0, n)
	rest := b[BundleHeaderLen:]
	for i := range n {
		if len(rest) < 2 {
			return nil, fmt.Errorf("%w: payload %d of %d: no length", ErrBundle, i+1, n)
		}
		l := int(binary.BigEndian.Uint16(rest))
		rest = rest[2:]
		if l == 0 || l > len(rest) {
			return nil, fmt.Errorf("%w: payload %d of %d: length %d, %d bytes left", ErrBundle, i+1, n, l, len(rest))
		}
		p := rest[:l:l]
		if IsBundle(p) {
			return nil, fmt.Errorf("%w: payload %d of %d is a bundle", ErrBundle, i+1, n)
		}
		out = append(out, p)
		rest = rest[l:]
	}
	if len(rest) != 0 {
		return nil, fmt.Errorf("%w: %d bytes after the last payload", ErrBundle, len(rest))
	}
	return out, nil
}

// PackBundles packs payloads for one destination into datagrams of at most
// max bytes, keeping their order: consecutive payloads that fit together
// go as a bundle, a payload that travels alone (the only one, or one too
// long to share a datagram) goes as it is. Payloads must not be empty or
// bundles themselves (PackBundles panics: a programming error).
func PackBundles(payloads [][]byte, max int) [][]byte {
	var out [][]byte
	for i := 0; i < len(payloads); {
		// The longest run from i that fits one bundle.
		size, j := BundleHeaderLen, i
		for j < len(payloads) && j-i < bundleMaxCount {
			p := payloads[j]
			if len(p) == 0 || IsBundle(p) {
				panic("protocol: PackBundles: an empty payload or a bundle")
			}
			if size+2+len(p) > max {
				break
			}
			size += 2 + len(p)
			j++
		}
		if j-i < 2 {
			out = append(out, payloads[i])
			i++
			continue
		}
		b := make([]byte, BundleHeaderLen, size)
		binary.BigEndian.PutUint32(b, BundleMagic)
		b[4], b[5] = BundleVersion, byte(j-i)
		for _, p := range payloads[i:j] {
			b = binary.BigEndian.AppendUint16(b, uint16(len(p)))
			b = append(b, p...)
		}
		out = append(out, b)
		i = j
	}
	return out
}
