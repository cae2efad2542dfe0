package bench

import "testing"

func TestContainsAddr(t *testing.T) {
	for _, c := range []struct {
		s, a string
		want bool
	}{
		{"10.0.0.1:4000 -> 10.0.0.2:80", "10.0.0.1:4000", true},
		{"10.0.0.1:40001 -> 10.0.0.2:80", "10.0.0.1:4000", false},
		{"10.0.0.1:40001 -> 10.0.0.1:4000", "10.0.0.1:4000", true},
		{"ESTAB 0 0 10.0.0.2:80 10.0.0.1:4000\tino:1", "10.0.0.1:4000", true},
		{"", "10.0.0.1:4000", false},
	} {
		if got := containsAddr(c.s, c.a); got != c.want {
			t.Errorf("containsAddr(%q, %q) = %v, want %v", c.s, c.a, got, c.want)
		}
	}
}
