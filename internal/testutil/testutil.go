// Package testutil holds what the test packages share: skips that name
// what a test lacks (root, a program), and a wait for a condition. Only
// tests import it.
package testutil

import (
	"fmt"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"
)

// rootCaps are the capabilities the tests that need root use: network
// namespaces and bpffs mounts (CAP_SYS_ADMIN), links, routes, qdiscs and
// firewall rules (CAP_NET_ADMIN), packet sockets (CAP_NET_RAW), eBPF
// programs and maps (CAP_BPF).
const rootCaps = "CAP_SYS_ADMIN, CAP_NET_ADMIN, CAP_NET_RAW, CAP_BPF"

// RequireRoot skips the test unless it runs as root. uses, if given, says
// what the test does with it, for the skip message:
//
//	testutil.RequireRoot(t, "creates network namespaces and veth links")
//
// skips with "needs root (CAP_SYS_ADMIN, ...), runs as uid 1000: creates
// network namespaces and veth links".
func RequireRoot(tb testing.TB, uses ...string) {
	tb.Helper()
	if msg := rootMissing(os.Geteuid(), uses); msg != "" {
		tb.Skip(msg)
	}
}

// rootMissing is RequireRoot's skip message for uid, "" for root.
func rootMissing(uid int, uses []string) string {
	if uid == 0 {
		return ""
	}
	msg := fmt.Sprintf("needs root (%s), runs as uid %d", rootCaps, uid)
	if len(uses) > 0 {
		msg += ": " + strings.Join(uses, "; ")
	}
	return msg
}

// RequireTools skips the test unless every program is on the PATH; the
// skip names the first one missing.
func RequireTools(tb testing.TB, programs ...string) {
	tb.Helper()
	if msg := toolMissing(programs); msg != "" {
		tb.Skip(msg)
	}
}

// toolMissing is RequireTools' skip message, "" when none is missing.
func toolMissing(programs []string) string {
	for _, p := range programs {
		if _, err := exec.LookPath(p); err != nil {
			return fmt.Sprintf("needs %s, which is not installed (scripts/deps.sh installs it)", p)
		}
	}
	return ""
}

// Eventually waits until cond holds and fails the test (FailNow) if it
// does not within timeout; what names the condition in the failure. The
// condition is the ready signal; the interval only paces the checks: 10 ms
// at first, doubling to 50 ms, so that a quick condition is seen at once
// and one that runs a command (`dysco status`) is not run back to back.
func Eventually(tb testing.TB, timeout time.Duration, what string, cond func() bool) {
	tb.Helper()
	deadline := time.Now().Add(timeout)
	pace := 10 * time.Millisecond
	for !cond() {
		if time.Now().After(deadline) {
			tb.Fatalf("timed out after %v waiting for %s", timeout, what)
		}
		time.Sleep(pace)
		pace = min(2*pace, 50*time.Millisecond)
	}
}
