package cli

import (
	"bytes"
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/dysco/dysco/internal/lab"
	"github.com/dysco/dysco/internal/testutil"
)

// runCLI runs the dysco command line in this process.
func runCLI(ctx context.Context, args ...string) (string, error) {
	root := Root()
	var out bytes.Buffer
	root.SetOut(&out)
	root.SetErr(&out)
	root.SetArgs(args)
	err := root.ExecuteContext(ctx)
	return out.String(), err
}

func TestLabCLI(t *testing.T) {
	testutil.RequireRoot(t, "creates network namespaces")
	fake := filepath.Join(t.TempDir(), "fakeagent")
	if out, err := exec.Command("go", "build", "-o", fake, "../lab/testdata/fakeagent").CombinedOutput(); err != nil {
		t.Fatalf("building the fake agent: %v\n%s", err, out)
	}
	name := fmt.Sprintf("ct%06d", rand.IntN(1_000_000))
	t.Cleanup(func() { lab.DownByName(name) })
	ctx := context.Background()

	out, err := runCLI(ctx, "lab", "up", "--name", name, "--hosts", "client,mb1,server,fw=mb",
		"--agent-binary", fake, "--agent-arg=--extra", "--agent-arg=hello")
	if err != nil {
		t.Fatalf("lab up: %v\n%s", err, out)
	}
	for _, want := range []string{"lab " + name + " is up", "mb1", "middlebox", name + "-router", "10.200.3.2/24", "fd00:dc:0:2::2/64", "(alive)",
		"\nfw      middlebox  " + name + "-fw"} {
		if !strings.Contains(out, want) {
			t.Errorf("lab up output lacks %q:\n%s", want, out)
		}
	}
	ready, err := os.ReadFile(filepath.Join(lab.RunDir(name), "mb1.ready"))
	if err != nil || !strings.Contains(string(ready), `"extra":"hello"`) || !strings.Contains(string(ready), `"tap":"dysco-tap"`) {
		t.Errorf("mb1's agent saw %s (%v)", ready, err)
	}
	// fw is a middlebox by its explicit role: a tap, like mb1.
	if ready, err := os.ReadFile(filepath.Join(lab.RunDir(name), "fw.ready")); err != nil || !strings.Contains(string(ready), `"tap":"dysco-tap"`) {
		t.Errorf("fw's agent saw %s (%v)", ready, err)
	}

	out, err = runCLI(ctx, "lab", "status", "--name", name)
	if err != nil || !strings.Contains(out, "star topology, 4 hosts") || strings.Count(out, "(alive)") != 4 || !strings.Contains(out, "\nfw      middlebox  ") {
		t.Errorf("lab status: %v\n%s", err, out)
	}
	out, err = runCLI(ctx, "lab", "status", "-o", "json")
	if err != nil || !strings.Contains(out, `"namespace": "`+name+`-client"`) {
		t.Errorf("lab status -o json: %v\n%s", err, out)
	}

	out, err = runCLI(ctx, "lab", "exec", "--name", name, "server", "--", "ip", "-o", "-4", "addr", "show", "dev", "eth0")
	if err != nil || !strings.Contains(out, "10.200.3.2/24") {
		t.Errorf("lab exec: %v\n%s", err, out)
	}
	if _, err = runCLI(ctx, "lab", "exec", "--name", name, "server", "--", "sh", "-c", "exit 3"); err != exitError(3) {
		t.Errorf("lab exec of a failing program: %v, want exit status 3", err)
	}
	if _, err = runCLI(ctx, "lab", "exec", "--name", name, "nohost", "--", "true"); err == nil || !strings.Contains(err.Error(), "no host") {
		t.Errorf("lab exec on an unknown host: %v", err)
	}

	if out, err = runCLI(ctx, "lab", "up", "--name", name, "--topology", "fig11", "--no-agents"); err == nil || !strings.Contains(err.Error(), "already exists") {
		t.Errorf("second lab up: %v\n%s", err, out)
	}

	if out, err = runCLI(ctx, "lab", "down", "--name", name); err != nil {
		t.Fatalf("lab down: %v\n%s", err, out)
	}
	if nss, _ := filepath.Glob("/run/netns/" + name + "-*"); len(nss) > 0 {
		t.Errorf("namespaces left: %v", nss)
	}
	if _, err := os.Stat(lab.RunDir(name)); err == nil {
		t.Error("run directory left")
	}

	// An interrupted lab up leaves nothing behind.
	cctx, cancel := context.WithCancel(ctx)
	cancel()
	if _, err := runCLI(cctx, "lab", "up", "--name", name, "--topology", "line", "--no-agents"); err == nil || !strings.Contains(err.Error(), "context canceled") {
		t.Errorf("interrupted lab up: %v", err)
	}
	if nss, _ := filepath.Glob("/run/netns/" + name + "-*"); len(nss) > 0 {
		t.Errorf("namespaces left after an interrupted lab up: %v", nss)
	}
}

func TestLabTopologyFlags(t *testing.T) {
	for _, tc := range []struct {
		topo, file string
		hosts      []string
		want       string // error substring, or the kind
	}{
		{"", "", []string{"client", "server"}, "star"},
		{"line", "", nil, "line"},
		{"fig11", "", nil, "star"},
		{"", "", nil, "say which topology"},
		{"star", "", nil, "needs hosts"},
		{"star", "x.json", nil, "do not combine"},
		{"ring", "", nil, "not built in"},
	} {
		topo, err := labTopology(tc.topo, tc.file, tc.hosts)
		got := string(topo.Kind)
		if err != nil {
			got = err.Error()
		}
		if !strings.Contains(got, tc.want) {
			t.Errorf("labTopology(%q, %q, %v) = %q, want %q", tc.topo, tc.file, tc.hosts, got, tc.want)
		}
	}
}

// TestLabUpRoles: an unknown role in --hosts is an error naming the host and
// the roles there are, before anything is built.
func TestLabUpRoles(t *testing.T) {
	_, err := runCLI(context.Background(), "lab", "up", "--name", "never", "--hosts", "client,ids=firewall,server")
	if err == nil || !strings.Contains(err.Error(), `host "ids": role "firewall" is unknown: use client, server, middlebox (or mb) or host (or plain)`) {
		t.Errorf("lab up with an unknown role: %v", err)
	}
}
