package protocol

import (
	"bytes"
	"encoding/binary"
	"errors"
	"testing"
)

func payload(n int, fill byte) []byte { return bytes.Repeat([]byte{fill}, n) }

// unpack returns what a receiver makes of datagrams: each bundle split,
// everything else as it is.
func unpack(t *testing.T, dgs [][]byte) [][]byte {
	t.Helper()
	var out [][]byte
	for _, d := range dgs {
		if !IsBundle(d) {
			out = append(out, d)
			continue
		}
		ps, err := SplitBundle(d)
		if err != nil {
			t.Fatalf("a packed bundle does not split: %v", err)
		}
		out = append(out, ps...)
	}
	return out
}

func TestPackBundles(t *testing.T) {
	msg := func(i int) []byte { return payload(180, byte(i)) } // a control message without hops
	var six, seven, mixed [][]byte
	for i := range 6 {
		six = append(six, msg(i))
	}
	for i := range 7 {
		seven = append(seven, msg(i))
	}
	mixed = [][]byte{msg(1), payload(1300, 2), msg(3), msg(4), payload(1000, 5), payload(300, 6)}
	cases := []struct {
		name  string
		in    [][]byte
		sizes []int // of the datagrams; a negative size: a payload sent alone
	}{
		{"none", nil, nil},
		{"one goes alone", six[:1], []int{-180}},
		{"two", six[:2], []int{6 + 2*182}},
		{"six fit 1232 bytes", six, []int{6 + 6*182}},
		{"the seventh opens a datagram of its own", seven, []int{6 + 6*182, -180}},
		// msg(1) cannot share with 1300 bytes; 1300 alone; msg 3 and 4
		// together (1000 would not fit with them); 1000 and 300 do not
		// fit together either.
		{"too long to share", mixed, []int{-180, -1300, 6 + 2*182, -1000, -300}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			dgs := PackBundles(c.in, BundleMax)
			if len(dgs) != len(c.sizes) {
				t.Fatalf("%d datagrams, want %d", len(dgs), len(c.sizes))
			}
			for i, d := range dgs {
				want, bundle := c.sizes[i], c.sizes[i] > 0
				if !bundle {
					want = -want
				}
				if len(d) != want || IsBundle(d) != bundle {
					t.Errorf("datagram %d: %d bytes (bundle %v), want %d (bundle %v)", i, len(d), IsBundle(d), want, bundle)
				}
				if bundle && len(d) > BundleMax {
					t.Errorf("datagram %d: a bundle of %d bytes, over %d", i, len(d), BundleMax)
				}
			}
			got := unpack(t, dgs)
			if len(got) != len(c.in) {
				t.Fatalf("%d payloads back, want %d", len(got), len(c.in))
			}
			for i := range got {
				if !bytes.Equal(got[i], c.in[i]) {
					t.Errorf("payload %d changed or out of order", i)
				}
			}
		})
	}
}

func TestPackBundlesCount(t *testing.T) {
	var in [][]byte
	for i := range 600 {
		in = append(in, []byte{byte(i)})
	}
	dgs := PackBundles(in, 1<<16)
	if len(dgs) != 3 {
		t.Fatalf("600 one-byte payloads: %d datagrams, want 3 (255 + 255 + 90)", len(dgs))
	}
	if got := unpack(t, dgs); len(got) != 600 || got[599][0] != byte(599%256) {
		t.Fatalf("%d payloads back", len(got))
	}
}

func TestSplitBundleRefuses(t *testing.T) {
	good := PackBundles([][]byte{payload(10, 1), payload(20, 2)}, BundleMax)[0]
	if _, err := SplitBundle(good); err != nil {
		t.Fatal(err)
	}
	mutate := func(f func(b []byte) []byte) []byte { return f(append([]byte(nil), good...)) }
	nested := PackBundles([][]byte{payload(10, 1), payload(20, 2)}, BundleMax)[0]
	withNested := make([]byte, BundleHeaderLen)
	binary.BigEndian.PutUint32(withNested, BundleMagic)
	withNested[4], withNested[5] = BundleVersion, 2
	withNested = binary.BigEndian.AppendUint16(withNested, uint16(len(nested)))
	withNested = append(withNested, nested...)
	withNested = binary.BigEndian.AppendUint16(withNested, 3)
	withNested = append(withNested, 1, 2, 3)
	cases := map[string][]byte{
		"no magic":            mutate(func(b []byte) []byte { b[3] = 'X'; return b }),
		"header cut":          good[:5],
		"other version":       mutate(func(b []byte) []byte { b[4] = BundleVersion + 1; return b }),
		"count 0":             mutate(func(b []byte) []byte { b[5] = 0; return b }),
		"count 1":             mutate(func(b []byte) []byte { b[5] = 1; return b }),
		"count over payloads": mutate(func(b []byte) []byte { b[5] = 3; return b }),
		"bytes after":         mutate(func(b []byte) []byte { return append(b, 0) }),
		"zero length":         mutate(func(b []byte) []byte { b[6], b[7] = 0, 0; return b }),
		"length over the end": mutate(func(b []byte) []byte { b[6], b[7] = 0xff, 0xff; return b }),
		"last one cut":        good[:len(good)-1],
		"a bundle inside":     withNested,
	}
	for name, b := range cases {
		t.Run(name, func(t *testing.T) {
			ps, err := SplitBundle(b)
			if err == nil || !errors.Is(err, ErrBundle) {
				t.Fatalf("accepted (%d payloads), err %v", len(ps), err)
			}
		})
	}
}

// FuzzSplitBundle: SplitBundle never panics, and what it accepts packs
// back to the same bytes.
func FuzzSplitBundle(f *testing.F) {
	f.Add(PackBundles([][]byte{payload(10, 1), payload(20, 2)}, BundleMax)[0])
	f.Add([]byte("DYSB\x01\x02\x00\x01a\x00\x01b"))
	f.Fuzz(func(t *testing.T, b []byte) {
		ps, err := SplitBundle(b)
		if err != nil {
			return
		}
		again := PackBundles(ps, 1<<20)
		if len(again) != 1 || !bytes.Equal(again[0], b) {
			t.Fatalf("%d payloads repack differently", len(ps))
		}
	})
}
