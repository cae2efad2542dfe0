package datapath

import (
	"os"
	"testing"
)

// requireRoot skips tests that need CAP_BPF/CAP_NET_ADMIN when not root.
func requireRoot(t testing.TB) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root: loads eBPF programs")
	}
}

func testPinDir(t testing.TB) string {
	t.Helper()
	dir := "/sys/fs/bpf/dysco-test/" + t.Name()
	t.Cleanup(func() { _ = Reset(dir) })
	_ = Reset(dir)
	return dir
}

func TestLoadVerifies(t *testing.T) {
	requireRoot(t)
	d, err := Load(Config{PinDir: testPinDir(t)})
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
}
