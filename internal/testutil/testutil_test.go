package testutil

import (
	"strings"
	"testing"
	"time"
)

func TestRootMissing(t *testing.T) {
	if msg := rootMissing(0, nil); msg != "" {
		t.Errorf("root: %q", msg)
	}
	msg := rootMissing(1000, []string{"loads eBPF programs"})
	for _, want := range []string{"needs root", "CAP_NET_ADMIN", "CAP_BPF", "uid 1000", "loads eBPF programs"} {
		if !strings.Contains(msg, want) {
			t.Errorf("%q lacks %q", msg, want)
		}
	}
}

func TestToolMissing(t *testing.T) {
	if msg := toolMissing([]string{"sh"}); msg != "" {
		t.Errorf("sh: %q", msg)
	}
	if msg := toolMissing([]string{"sh", "dysco-no-such-program"}); !strings.Contains(msg, "needs dysco-no-such-program") {
		t.Errorf("missing program: %q", msg)
	}
}

func TestEventually(t *testing.T) {
	n := 0
	Eventually(t, 5*time.Second, "three checks", func() bool { n++; return n == 3 })
	if n != 3 {
		t.Errorf("checked %d times, want 3", n)
	}
}
