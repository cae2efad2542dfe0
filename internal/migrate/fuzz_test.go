package migrate

import (
	"bytes"
	"reflect"
	"testing"
)

// FuzzDecodeBundle: DecodeBundle, which reads the state bundle a peer agent
// sends, never panics. What it accepts encodes again (Bundle.Encode) to
// bytes that decode to an equal bundle (nil states stay nil, empty ones
// empty), and that encoding is stable: encoding the decoded copy gives the
// same bytes. (The input's own bytes need not come back: JSON allows other
// spacing, key order, escapes and duplicate keys.)
//
// `go test` runs the seeds; `go test -run '^$' -fuzz '^FuzzDecodeBundle$'
// ./internal/migrate` searches.
func FuzzDecodeBundle(f *testing.F) {
	for _, b := range []Bundle{
		{"a": []byte("A"), "b": []byte("B"), "c": []byte("C")},
		{NameConntrack: bytes.Repeat([]byte{0, 1, 2, 0xff}, 40), NameAPI: []byte(`{"counter": 7}`)},
		{"big": make([]byte, 300)}, // small: the fuzzer minimizes new inputs in quadratic time
		{"empty": []byte{}, "none": nil},
		{},
		nil,
	} {
		enc, err := b.Encode()
		if err != nil {
			f.Fatal(err)
		}
		f.Add(enc)
		f.Add(enc[:len(enc)/2])
	}
	for _, s := range []string{
		``, `{`, `[]`, `"x"`, `{"a": 1}`, `{"a": "not base64!"}`, `{"a": "QQ"}`, `{"a": "QQ=="} {}`,
		`{"a": "QQ==", "a": null}`, `{"\u00e9\ud800": "QQ=="}`, "{\"\xff\": \"\"}", `{"a":"Q\nQ=="}`,
	} {
		f.Add([]byte(s))
	}

	f.Fuzz(func(t *testing.T, data []byte) {
		b, err := DecodeBundle(data)
		if err != nil {
			return
		}
		enc, err := b.Encode()
		if err != nil {
			t.Fatalf("decoded bundle does not encode: %v", err)
		}
		again, err := DecodeBundle(enc)
		if err != nil {
			t.Fatalf("re-encoded bundle does not decode: %v\n%s", err, enc)
		}
		if !reflect.DeepEqual(again, b) {
			t.Fatalf("round trip\n got %#v\nwant %#v", again, b)
		}
		enc2, err := again.Encode()
		if err != nil || !bytes.Equal(enc2, enc) {
			t.Fatalf("encoding not stable (%v)\n%s\n%s", err, enc, enc2)
		}
	})
}
