package testutil

import (
	"bytes"
	"encoding/json"
)

// ListedJSON tells whether list has an item named like v (by name) that
// encodes to the same JSON as v.
func ListedJSON[T any](list []T, v T, name func(T) string) bool {
	want, _ := json.Marshal(v)
	for _, x := range list {
		if name(x) == name(v) {
			got, _ := json.Marshal(x)
			return bytes.Equal(got, want)
		}
	}
	return false
}
