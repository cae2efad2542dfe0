package testutil

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// squatEnv, set in the environment of a test binary, makes it a squatter
// (Squat) instead of running tests.
const squatEnv = "DYSCO_TESTUTIL_SQUAT"

func init() {
	if name := os.Getenv(squatEnv); name != "" {
		os.Exit(squat(name))
	}
}

// NobodyUID is the unprivileged user a Squatter runs as.
const NobodyUID = 65534

// Squatter is a process of an unprivileged user serving a Unix socket name
// before the agent does: it answers any request as if it were the agent and
// reports the bytes each connection brought it.
type Squatter struct {
	PID   int
	lines *bufio.Scanner
	cmd   *exec.Cmd
}

// Squat starts a squatter on the Unix socket name ("@name": abstract) as
// uid and gid NobodyUID, in the caller's network namespace, or in the named
// one (netns, through ip netns exec) when not empty. It needs root; it
// stops with the test.
func Squat(tb testing.TB, name, netns string) *Squatter {
	tb.Helper()
	RequireRoot(tb, "to start a process as another user")
	self, err := os.Executable()
	if err != nil {
		tb.Fatal(err)
	}
	// A copy of the test binary that the unprivileged user may run.
	dir, err := os.MkdirTemp("", "dysco-squat")
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { os.RemoveAll(dir) })
	bin := filepath.Join(dir, "squatter")
	if err := copyFile(self, bin); err != nil {
		tb.Fatal(err)
	}
	if err := os.Chmod(dir, 0o755); err != nil {
		tb.Fatal(err)
	}
	var cmd *exec.Cmd
	if netns == "" {
		cmd = exec.Command(bin)
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: NobodyUID, Gid: NobodyUID}}
	} else {
		// ip netns exec needs root: drop to the user after it.
		RequireTools(tb, "ip", "setpriv")
		cmd = exec.Command("ip", "netns", "exec", netns, "setpriv", "--reuid", strconv.Itoa(NobodyUID),
			"--regid", strconv.Itoa(NobodyUID), "--clear-groups", bin)
	}
	cmd.Env = append(os.Environ(), squatEnv+"="+name)
	cmd.Stderr = os.Stderr
	out, err := cmd.StdoutPipe()
	if err != nil {
		tb.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		tb.Fatal(err)
	}
	s := &Squatter{cmd: cmd, lines: bufio.NewScanner(out)}
	tb.Cleanup(func() {
		cmd.Process.Kill()
		cmd.Wait()
	})
	line, err := s.next(10 * time.Second)
	if err != nil {
		tb.Fatalf("squatter on %s: %v", name, err)
	}
	if _, err := fmt.Sscanf(line, "ready %d", &s.PID); err != nil {
		tb.Fatalf("squatter on %s: %q", name, line)
	}
	return s
}

// next reads the squatter's next report line, waiting at most d.
func (s *Squatter) next(d time.Duration) (string, error) {
	type res struct {
		line string
		err  error
	}
	ch := make(chan res, 1)
	go func() {
		if s.lines.Scan() {
			ch <- res{line: s.lines.Text()}
			return
		}
		err := s.lines.Err()
		if err == nil {
			err = io.EOF
		}
		ch <- res{err: err}
	}()
	select {
	case r := <-ch:
		return r.line, r.err
	case <-time.After(d):
		return "", fmt.Errorf("no report in %v", d)
	}
}

// Conn waits for the squatter's report of its next connection and returns
// the bytes that connection brought it.
func (s *Squatter) Conn(tb testing.TB) int {
	tb.Helper()
	line, err := s.next(10 * time.Second)
	if err != nil {
		tb.Fatalf("squatter: %v", err)
	}
	var n int
	if _, err := fmt.Sscanf(line, "conn %d", &n); err != nil {
		tb.Fatalf("squatter: %q", line)
	}
	return n
}

func copyFile(from, to string) error {
	in, err := os.Open(from)
	if err != nil {
		return err
	}
	defer in.Close()
	out, err := os.OpenFile(to, os.O_CREATE|os.O_WRONLY|os.O_TRUNC, 0o755)
	if err != nil {
		return err
	}
	if _, err := io.Copy(out, in); err != nil {
		out.Close()
		return err
	}
	return out.Close()
}

// squat is the squatter's main: serve name, answer every request with a
// fake agent status, report "conn N" (the bytes received) per connection.
func squat(name string) int {
	ln, err := net.Listen("unix", name)
	if err != nil {
		fmt.Fprintln(os.Stderr, "squatter:", err)
		return 1
	}
	fmt.Printf("ready %d\n", os.Getpid())
	for {
		c, err := ln.Accept()
		if err != nil {
			return 1
		}
		c.SetDeadline(time.Now().Add(5 * time.Second))
		var got []byte
		buf := make([]byte, 4096)
		for !strings.Contains(string(got), "\r\n\r\n") {
			n, err := c.Read(buf)
			got = append(got, buf[:n]...)
			if err != nil {
				break
			}
		}
		if len(got) > 0 {
			body := `{"name":"impostor","version":"0","counters":{}}`
			fmt.Fprintf(c, "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s", len(body), body)
		}
		c.Close()
		fmt.Printf("conn %d\n", len(got))
	}
}
