package psclient

import "testing"

func TestWatchConfigErrors(t *testing.T) {
	if err := Watch(t.Context(), WatchConfig{Host: "h"}); err == nil {
		t.Error("Watch without URL succeeded")
	}
	if err := Watch(t.Context(), WatchConfig{URL: "http://x"}); err == nil {
		t.Error("Watch without host succeeded")
	}
}
