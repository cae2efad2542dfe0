package migrate

import (
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"os/exec"
	"runtime"
	"strconv"
	"strings"
	"testing"

	"github.com/vishvananda/netns"

	"github.com/dysco/dysco/internal/testutil"
)

// Test helpers: named network namespaces ("dmig-" prefix, deleted by
// t.Cleanup even when the test fails), commands run in them, and Go code run
// in them on a thread locked to it.

// requireNetfilter skips a test unless it runs as root, and fails it if the
// firewall tools it drives are missing.
func requireNetfilter(t *testing.T) {
	t.Helper()
	testutil.RequireRoot(t, "creates network namespaces, firewall rules and conntrack entries")
	for _, c := range []string{"ip", "iptables", "iptables-save", "ip6tables", "ip6tables-save"} {
		if _, err := exec.LookPath(c); err != nil {
			t.Fatalf("%s not installed (Debian package iproute2 or iptables)", c)
		}
	}
}

// runCmd runs a command and fails the test when it fails.
func runCmd(t testing.TB, args ...string) string {
	t.Helper()
	out, err := exec.Command(args[0], args[1:]...).CombinedOutput()
	if err != nil {
		t.Fatalf("%s: %v\n%s", strings.Join(args, " "), err, out)
	}
	return string(out)
}

// nsRun runs a command inside namespace ns.
func nsRun(t testing.TB, ns string, args ...string) string {
	t.Helper()
	return runCmd(t, append([]string{"ip", "netns", "exec", ns}, args...)...)
}

// newNS creates a namespace named dmig-<random>-<short>, with lo up.
func newNS(t testing.TB, short string) string {
	t.Helper()
	var b [3]byte
	_, _ = rand.Read(b[:])
	name := "dmig-" + hex.EncodeToString(b[:]) + "-" + short
	runCmd(t, "ip", "netns", "add", name)
	t.Cleanup(func() {
		// Processes started in the namespace are the tests' own and are
		// ended by their own cleanups (run before this one).
		if out, err := exec.Command("ip", "netns", "del", name).CombinedOutput(); err != nil {
			t.Errorf("ip netns del %s: %v: %s", name, err, out)
		}
	})
	runCmd(t, "ip", "-n", name, "link", "set", "lo", "up")
	return name
}

// inNS runs fn on a thread inside namespace ns. The thread is never
// unlocked: the runtime discards it when the goroutine ends.
func inNS(t testing.TB, ns string, fn func()) {
	t.Helper()
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		h, err := netns.GetFromName(ns)
		if err != nil {
			errc <- fmt.Errorf("namespace %s: %w", ns, err)
			return
		}
		defer h.Close()
		if err := netns.Set(h); err != nil {
			errc <- fmt.Errorf("entering %s: %w", ns, err)
			return
		}
		defer func() { errc <- nil }()
		fn()
	}()
	if err := <-errc; err != nil {
		t.Fatal(err)
	}
}

// policyDrops returns the packets dropped by the FORWARD chain's policy in
// namespace ns (ip6tables when v6).
func policyDrops(t testing.TB, ns string, v6 bool) uint64 {
	t.Helper()
	cmd := "iptables"
	if v6 {
		cmd = "ip6tables"
	}
	out := nsRun(t, ns, cmd, "-L", "FORWARD", "-n", "-v", "-x")
	// Chain FORWARD (policy DROP 3 packets, 180 bytes)
	first, _, _ := strings.Cut(out, "\n")
	f := strings.Fields(first)
	for i, w := range f {
		if w == "DROP" && i+1 < len(f) {
			n, err := strconv.ParseUint(f[i+1], 10, 64)
			if err != nil {
				t.Fatalf("%s -L FORWARD: %q: %v", cmd, first, err)
			}
			return n
		}
	}
	t.Fatalf("%s -L FORWARD: no DROP policy in %q", cmd, first)
	return 0
}
