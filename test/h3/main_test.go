package main

import (
	"bufio"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"
)

func TestMain(m *testing.M) {
	// The test binary doubles as dysco-h3 when asked to (see run).
	if os.Getenv("DYSCO_H3_MAIN") != "" {
		os.Args = append([]string{"dysco-h3"}, os.Args[1:]...)
		main()
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// startServe starts serve on listen and returns it with the address it
// listens on (its ready line).
func startServe(t *testing.T, listen string, args ...string) (*exec.Cmd, string) {
	t.Helper()
	srv := command(append([]string{"serve", "--listen", listen}, args...)...)
	out, err := srv.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := srv.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { srv.Process.Kill(); srv.Wait() })
	line, err := bufio.NewReader(out).ReadString('\n')
	if err != nil {
		t.Fatalf("no ready line: %v", err)
	}
	addr, ok := strings.CutPrefix(strings.TrimSpace(line), "listening on ")
	if !ok {
		t.Fatalf("ready line %q", line)
	}
	return srv, addr
}

func command(args ...string) *exec.Cmd {
	cmd := exec.Command(os.Args[0], args...)
	cmd.Env = append(os.Environ(), "DYSCO_H3_MAIN=1")
	return cmd
}

func TestParseBytesPath(t *testing.T) {
	for _, c := range []struct {
		path string
		n    int64
		ok   bool
	}{
		{"/bytes/0", 0, true},
		{"/bytes/52428800", 52428800, true},
		{"/bytes/-1", 0, false},
		{"/bytes/x", 0, false},
		{"/bytes/", 0, false},
		{"/other/5", 0, false},
		{"/bytes/99999999999999", 0, false},
	} {
		n, err := parseBytesPath(c.path)
		if (err == nil) != c.ok || n != c.n {
			t.Errorf("parseBytesPath(%q) = %d, %v", c.path, n, err)
		}
	}
}

func TestStreamDeterministic(t *testing.T) {
	if streamHash(1000) != streamHash(1000) || streamHash(1000) == streamHash(1001) {
		t.Fatal("the stream of /bytes/N must depend on N only")
	}
}

// TestServeGet runs the real server and client on loopback, over IPv4 and
// IPv6, and checks the summary, the samples and the server's report.
func TestServeGet(t *testing.T) {
	dir := t.TempDir()
	stats := filepath.Join(dir, "stats.json")
	cert := filepath.Join(dir, "cert.pem")
	srv, addr := startServe(t, "[::1]:0", "--stats", stats, "--cert", cert)
	samples := filepath.Join(dir, "samples.jsonl")
	get := command("get", "https://"+addr+"/bytes/3000000", "--ca", cert, "--interval", "1ms", "--samples", samples)
	b, err := get.Output()
	if err != nil {
		t.Fatalf("get: %v\n%s", err, b)
	}
	var sum Summary
	if err := json.Unmarshal(b, &sum); err != nil || !sum.OK || sum.Bytes != 3000000 || sum.SHA256 != streamHash(3000000) {
		t.Fatalf("summary %s (%v)", b, err)
	}
	if s, _ := os.ReadFile(samples); !strings.Contains(string(s), `"bytes":3000000`) {
		t.Errorf("samples have no final sample:\n%s", s)
	}
	// An unknown path is an error exit with ok false.
	b, err = command("get", "https://"+addr+"/nope", "--insecure").Output()
	if err == nil || !strings.Contains(string(b), `"ok":false`) {
		t.Errorf("get of /nope: %v %s", err, b)
	}
	// Nothing listens: a timeout, an error exit.
	if b, err := command("get", "https://127.0.0.1:9/bytes/1", "--insecure", "--timeout", "300ms").Output(); err == nil {
		t.Errorf("get from nowhere succeeded: %s", b)
	}
	srv.Process.Signal(syscall.SIGTERM)
	done := make(chan error, 1)
	go func() { done <- srv.Wait() }()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("serve exited with %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("serve did not exit on SIGTERM")
	}
	var st Stats
	b, _ = os.ReadFile(stats)
	if err := json.Unmarshal(b, &st); err != nil {
		t.Fatal(err)
	}
	if st.Connections != 2 || st.Migrated != 0 || st.Conns[0].Requests != 1 || st.Conns[0].Bytes != 3000000 || st.Conns[0].Open {
		t.Errorf("stats:\n%s", b)
	}
}

// TestServerLost: the server dies in the middle of a download and another
// takes its port. get must fail (a timeout here; a stateless reset would
// do too), not dial the new server and hide the loss.
func TestServerLost(t *testing.T) {
	dir := t.TempDir()
	srv, addr := startServe(t, "127.0.0.1:0")
	samples := filepath.Join(dir, "samples.jsonl")
	get := command("get", "https://"+addr+"/bytes/300000000", "--insecure", "--timeout", "3s", "--interval", "10ms", "--samples", samples)
	var out strings.Builder
	get.Stdout = &out
	if err := get.Start(); err != nil {
		t.Fatal(err)
	}
	// The ready signal: the body is flowing.
	deadline := time.Now().Add(10 * time.Second)
	for {
		b, _ := os.ReadFile(samples)
		if regexp.MustCompile(`"bytes":[1-9]`).Match(b) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the download did not start; samples:\n%s", b)
		}
		time.Sleep(5 * time.Millisecond)
	}
	srv.Process.Kill()
	srv.Wait()
	startServe(t, addr)
	err := get.Wait()
	var sum Summary
	if jerr := json.Unmarshal([]byte(out.String()), &sum); jerr != nil || err == nil || sum.OK {
		t.Fatalf("get after the server was lost: exit %v, summary %s", err, out.String())
	}
	t.Logf("get failed as it should: %s", sum.Error)
}

func TestParseBitRate(t *testing.T) {
	for _, c := range []struct {
		in   string
		want int64
		ok   bool
	}{
		{"0", 0, true},
		{"40M", 40_000_000, true},
		{"500k", 500_000, true},
		{"1.5G", 1_500_000_000, true},
		{"1200", 1200, true},
		{"", 0, false},
		{"M", 0, false},
		{"-1M", 0, false},
		{"fast", 0, false},
		{"5T", 0, false},
	} {
		got, err := parseBitRate(c.in)
		if (err == nil) != c.ok || got != c.want {
			t.Errorf("parseBitRate(%q) = %d, %v", c.in, got, err)
		}
	}
}

// TestServeRate: --rate paces the body: 2 MB at 40 Mbit/s take 0.4 s.
func TestServeRate(t *testing.T) {
	_, addr := startServe(t, "127.0.0.1:0", "--rate", "40M")
	const n = 2_000_000
	b, err := command("get", "https://"+addr+"/bytes/2000000", "--insecure").Output()
	var sum Summary
	if err != nil || json.Unmarshal(b, &sum) != nil || !sum.OK || sum.Bytes != n {
		t.Fatalf("get: %v %s", err, b)
	}
	if sum.Seconds < 0.38 || sum.Mbps > 42 {
		t.Errorf("2 MB at 40 Mbit/s came in %.3f s (%.1f Mbit/s)", sum.Seconds, sum.Mbps)
	}
	if _, err := command("serve", "--listen", "127.0.0.1:0", "--rate", "fast").Output(); err == nil {
		t.Error("serve took --rate fast")
	}
}

// slowThenFast is a writer that blocks for a while on its first writes (a
// slow path) and records when each write came.
type slowThenFast struct {
	slow  int
	times []time.Time
}

func (w *slowThenFast) Write(p []byte) (int, error) {
	if len(w.times) < w.slow {
		time.Sleep(20 * time.Millisecond)
	}
	w.times = append(w.times, time.Now())
	return len(p), nil
}

// TestPacedCopyNoCatchUp: a body held back below its rate does not burst
// to catch up once the path is fast again.
func TestPacedCopyNoCatchUp(t *testing.T) {
	const rate = 40_000_000 // 16 KiB chunks every 3.3 ms
	w := &slowThenFast{slow: 10}
	if _, err := pacedCopy(w, stream(40*paceChunk), rate); err != nil {
		t.Fatal(err)
	}
	after := w.times[w.slow:]
	secs := after[len(after)-1].Sub(after[0]).Seconds()
	got := float64((len(after)-1)*paceChunk) * 8 / secs
	if got > 1.1*rate {
		t.Errorf("after the slow writes: %.1f Mbit/s, over the rate of %d", got/1e6, rate/1_000_000)
	}
}
