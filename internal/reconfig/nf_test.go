package reconfig

import (
	"context"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/dysco/dysco/internal/nf"
	"github.com/dysco/dysco/internal/protocol"
	"github.com/dysco/dysco/internal/testutil"
)

// withNFs restarts host name of l with a network function manager of
// specs (real processes).
func (l *lab) withNFs(name string, specs ...nf.Spec) *nf.Manager {
	l.t.Helper()
	m, err := nf.NewManager(specs, nil)
	if err != nil {
		l.t.Fatal(err)
	}
	l.t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		m.Close(ctx)
	})
	h := l.hosts[name]
	l.stopHost(h)
	h.nfs = m
	l.start(h)
	return m
}

// reconfigureNF is reconfigure with a network function per hop.
func (l *lab) reconfigureNF(from string, s session, to string, chain, nfs []string) Outcome {
	l.t.Helper()
	var hops []netip.Addr
	for _, c := range chain {
		hops = append(hops, l.hosts[c].addr)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	out := l.hosts[from].sh.ReconfigurePath(ctx, []uint32{s.ids[from]}, NewPath{To: l.hosts[to].addr, Chain: hops, NFs: nfs}, nil)
	if len(out) != 1 {
		l.t.Fatalf("%d outcomes", len(out))
	}
	return out[0]
}

func nfStatus(m *nf.Manager, name string) nf.Status {
	for _, s := range m.Status() {
		if s.Name == name {
			return s
		}
	}
	return nf.Status{}
}

// TestShellInsertWithNF: inserting a middlebox whose agent must start a
// network function first (heterogeneous-sfc-quic §IV). The function is
// started once, though its start outlasts the SYN's retransmissions; the
// middlebox joins once it is ready; history shows the wait as its own
// phase; the joined session holds the function, and once it leaves the
// function is stopped after its idle time.
func TestShellInsertWithNF(t *testing.T) {
	dir := t.TempDir()
	count, ready := filepath.Join(dir, "starts"), filepath.Join(dir, "ready")
	l := newLab(t, "a", "b", "m")
	mgr := l.withNFs("m", nf.Spec{Name: "fw", Start: "echo x >> " + count + "; sleep 0.3; touch " + ready + "; exec sleep 1000",
		Ready: "test -e " + ready, Stop: "rm -f " + ready, StopIdle: 200 * time.Millisecond, StartTimeout: 5 * time.Second})
	s := l.chain("a", "b")
	o := l.reconfigureNF("a", s, "b", []string{"m"}, []string{"fw"})
	succeeded(t, o)
	a, m := l.hosts["a"], l.hosts["m"]
	if out := rightOut(a, s.ids["a"]); out.Dst != m.addr {
		t.Fatalf("a sends the session to %s, want m", out)
	}
	if o.Record.NF != "fw" || o.Record.NFMicros < 250_000 || o.Record.NFMicros > o.Record.SetupMicros {
		t.Fatalf("record %+v: want the wait for fw, about 300 ms, within the set-up", o.Record)
	}
	if st := nfStatus(mgr, "fw"); st.State != nf.Ready || st.Starts != 1 || st.Sessions != 1 {
		t.Fatalf("fw %+v", st)
	}
	if b, _ := os.ReadFile(count); strings.Count(string(b), "x") != 1 {
		t.Fatalf("started %q", b)
	}
	l.settled()
	// m leaves the path: its session goes, and the function after its
	// idle time.
	succeeded(t, l.reconfigure("a", s, "b"))
	testutil.Eventually(t, 10*time.Second, "fw stopped when idle", func() bool {
		st := nfStatus(mgr, "fw")
		return st.State == nf.Stopped && st.Sessions == 0
	})
	if _, err := os.Stat(ready); err == nil {
		t.Fatal("the stop command did not run")
	}
	l.settled()
}

// TestShellNFRefused: a function the host does not have, or one never
// ready, makes the host refuse the new path: the request fails with the
// reason and the session stays on its old path.
func TestShellNFRefused(t *testing.T) {
	l := newLab(t, "a", "b", "m")
	mgr := l.withNFs("m", nf.Spec{Name: "slow", Start: "exec sleep 1000", Ready: "false", StartTimeout: 300 * time.Millisecond})
	s := l.chain("a", "b")
	for _, c := range []struct{ name, want string }{
		{"nope", `unknown network function "nope"`},
		{"slow", "not ready within 300ms"},
	} {
		o := l.reconfigureNF("a", s, "b", []string{"m"}, []string{c.name})
		if o.Result == nil || o.Result.Outcome != protocol.Failed || o.Result.Reason != protocol.ReasonNF {
			t.Fatalf("%s: %s, want failed for the network function", c.name, outcome(o))
		}
		if !strings.Contains(o.Record.Reason, c.want) || !strings.Contains(o.Record.Reason, "network function "+c.name+" could not be started at "+l.hosts["m"].addr.String()) {
			t.Fatalf("%s: reason %q", c.name, o.Record.Reason)
		}
		if out := rightOut(l.hosts["a"], s.ids["a"]); out.Dst != l.hosts["b"].addr {
			t.Fatalf("%s: a sends the session to %s, want b still", c.name, out)
		}
		l.settled()
	}
	if st := nfStatus(mgr, "slow"); st.State != nf.Failed || st.Failures != 1 || st.Sessions != 0 {
		t.Fatalf("slow %+v", st)
	}
	// The session still reconfigures.
	succeeded(t, l.reconfigure("a", s, "b", "m"))
	l.settled()
}
