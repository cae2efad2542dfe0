package e2e

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/dysco/dysco/internal/api"
	"github.com/dysco/dysco/internal/keys"
	"github.com/dysco/dysco/internal/lab"
	"github.com/dysco/dysco/internal/testutil"
)

// TestKeyRotationLive rotates the deployment secret of every agent, host by
// host, following docs/operating.md ("Control keys": add the new secret
// second everywhere, move it first everywhere, drop the old one), while
// two sessions carry data (curl downloading a file from nginx, and a
// paced transfer both ways checked byte for byte) and the client's agent
// reconfigures both back to back (mb1, mb2, direct, mb1...). Every
// reconfiguration succeeds, no agent refuses a control message for its
// MAC, every byte arrives intact, and each agent ends with the new secret
// alone. The first step is seen by each agent's poll of its file, the
// others on SIGHUP.
func TestKeyRotationLive(t *testing.T) {
	testutil.RequireTools(t, "nginx", "curl", "sha256sum")
	e := newLab(t, labOpts{topology: lab.Star("client", "mb1", "mb2", "server"), prefix: "k"})
	hosts := []string{"client", "mb1", "mb2", "server"}
	dst := e.addr("server", false)
	mb1, mb2 := e.addr("mb1", false), e.addr("mb2", false)
	const port = 9310
	e.policy("client", "k", fmt.Sprintf("tcp dst port 80 or tcp dst port %d", port), mb1.String())
	match := fmt.Sprintf("tcp port 80 or tcp port %d", port)

	oldKey, err := keys.Load(e.lab.ControlKeyFile("client"), os.Geteuid())
	if err != nil {
		t.Fatal(err)
	}
	oldHex := hex.EncodeToString(oldKey.Signing())
	newSecret := make([]byte, 32)
	if _, err := rand.Read(newSecret); err != nil {
		t.Fatal(err)
	}
	newHex := hex.EncodeToString(newSecret)
	oldID, newID := keys.KeyID(oldKey.Signing()), keys.KeyID(newSecret)

	// The data: a file downloaded by curl, paced, and a paced transfer
	// both ways; each outlasts the rotation.
	const size, rate = 256 * mib, 4 * mib
	dir := t.TempDir()
	e.nginx("server", dir)
	want := randomFile(t, filepath.Join(dir, "www", "blob"), size)
	type curlOut struct {
		out string
		err error
	}
	curlDone := make(chan curlOut, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
		defer cancel()
		out, err := e.lab.Command(ctx, "client", "sh", "-c",
			fmt.Sprintf("curl -sS -f -g --limit-rate %d %s | sha256sum", rate, urlFor(dst, "/blob"))).CombinedOutput()
		curlDone <- curlOut{string(out), err}
	}()
	lt := e.startTransfer("client", "server", dst, port, size, rate)
	testutil.Eventually(t, 30*time.Second, "both sessions to carry data", func() bool {
		return lt.received.Load() > 2*mib && len(e.sessions("mb1")) == 2
	})

	before := map[string]uint64{}
	for _, h := range hosts {
		st := e.status(h)
		before[h] = st.Counters["control_rejected_bad_mac"]
		if !equalIDs(st.ControlKeys, oldID) {
			t.Fatalf("%s starts with keys %v, want [%s]", h, st.ControlKeys, oldID)
		}
	}

	// Reconfigurations back to back until the rotation is over. A round
	// refused because the previous one is still completing at an anchor
	// (its old path's FIN exchange, ReasonBusy: the protocol's own
	// refusal of overlapping requests) is asked again until it runs; any
	// other outcome than success fails the test.
	var rounds, busy atomic.Int64
	var mu sync.Mutex
	var failures []string
	stop := make(chan struct{})
	loopDone := make(chan struct{})
	go func() {
		defer close(loopDone)
		chains := [][]netip.Addr{{mb2}, nil, {mb1}}
		for i := 0; ; i++ {
			select {
			case <-stop:
				return
			default:
			}
			chain := chains[i%len(chains)]
			deadline := time.Now().Add(20 * time.Second)
			for {
				res, err := e.ctlReconfig("client", 20*time.Second, match, dst, chain...)
				ok, retry := err == nil && len(res) == 2, false
				for _, r := range res {
					ok = ok && r.Outcome == "succeeded"
					retry = retry || r.Outcome == "refused" && strings.Contains(r.Reason, "still completing an earlier reconfiguration")
				}
				if !ok && retry && time.Now().Before(deadline) {
					busy.Add(1)
					continue
				}
				if !ok {
					mu.Lock()
					failures = append(failures, fmt.Sprintf("round %d (chain %v): %v %+v", i, chain, err, res))
					mu.Unlock()
				}
				break
			}
			rounds.Add(1)
		}
	}()
	// nextRound waits until a reconfiguration started after the call has
	// ended: each step of the rotation lands between reconfigurations of
	// a busy agent, not on an idle one.
	nextRound := func() {
		t.Helper()
		n := rounds.Load()
		testutil.Eventually(t, 30*time.Second, "a reconfiguration round", func() bool { return rounds.Load() >= n+2 })
	}

	hup := func(h string) {
		t.Helper()
		p := e.lab.Agent(h)
		if p == nil {
			t.Fatalf("no agent on %s", h)
		}
		if err := syscall.Kill(p.Pid(), syscall.SIGHUP); err != nil {
			t.Fatalf("SIGHUP to the agent of %s: %v", h, err)
		}
	}
	for _, step := range []struct {
		what   string
		text   string
		ids    []string
		signal bool
	}{
		{"add the new secret second", "# rotation: the new secret added\n" + oldHex + "\n" + newHex + "\n", []string{oldID, newID}, false},
		{"move the new secret first", "# rotation: the new secret signs\n" + newHex + "\n" + oldHex + "  # old\n", []string{newID, oldID}, true},
		{"drop the old secret", newHex + "\n", []string{newID}, true},
	} {
		for _, h := range hosts {
			nextRound()
			at := time.Now()
			writeKeyFile(t, e.lab.ControlKeyFile(h), step.text)
			if step.signal {
				hup(h)
			}
			testutil.Eventually(t, 10*time.Second, fmt.Sprintf("%s to %s", h, step.what), func() bool {
				return equalIDs(e.status(h).ControlKeys, step.ids...)
			})
			t.Logf("%s: %s (taken in %v) after %d rounds", h, step.what, time.Since(at).Round(time.Millisecond), rounds.Load())
		}
	}
	nextRound()
	close(stop)
	<-loopDone
	if lt.received.Load() >= size {
		t.Fatalf("the transfer ended before the rotation: pace it slower")
	}

	mu.Lock()
	if len(failures) > 0 {
		t.Errorf("%d of %d reconfigurations failed:\n%s", len(failures), rounds.Load(), strings.Join(failures, "\n"))
	}
	mu.Unlock()
	t.Logf("%d reconfigurations of two sessions during the rotation (%d asked again: the previous one was still completing)", rounds.Load(), busy.Load())
	for _, h := range hosts {
		st := e.status(h)
		if n := st.Counters["control_rejected_bad_mac"]; n != before[h] {
			t.Errorf("%s refused %d control messages for their MAC during the rotation", h, n-before[h])
		}
		if n := st.Counters["control_key_reloads"]; n != 3 {
			t.Errorf("%s reloaded its keys %d times, want 3", h, n)
		}
		if n := st.Counters["control_key_reload_errors"]; n != 0 {
			t.Errorf("%s refused %d key files", h, n)
		}
	}
	lt.wait(t)
	select {
	case c := <-curlDone:
		if c.err != nil {
			t.Fatalf("curl: %v\n%s", c.err, c.out)
		}
		if got := strings.Fields(c.out); len(got) == 0 || got[0] != want {
			t.Fatalf("curl through the rotation: sha256 %q, want %s", c.out, want)
		}
	case <-time.After(3 * time.Minute):
		t.Fatal("curl did not finish")
	}
	// The agents go on with the new secret: one more reconfiguration.
	res := e.reconfig("client", match, dst, mb2)
	for _, r := range res {
		if r.Outcome != "succeeded" {
			t.Fatalf("after the rotation: %+v", res)
		}
	}
}

// writeKeyFile replaces a key file as an operator's editor would: a new
// file, mode 0600, renamed over the old one.
func writeKeyFile(t *testing.T, path, text string) {
	t.Helper()
	tmp := path + ".new"
	if err := os.WriteFile(tmp, []byte(text), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, path); err != nil {
		t.Fatal(err)
	}
}

func equalIDs(got []string, want ...string) bool {
	return strings.Join(got, ",") == strings.Join(want, ",")
}

// TestControlMACMultiHomed: the middleboxes of a line have an address on
// each of their links and send to each neighbour from the address of that
// link; toward the server that is not the agent's own address (its
// lowest). The MAC covers the sender's address as the receiver sees it
// (the source address the route selects): middleboxes that take
// themselves out, sending triggers and passing the requests of others on
// from their second address, succeed with no message refused for its MAC.
func TestControlMACMultiHomed(t *testing.T) {
	e := newLab(t, labOpts{topology: lab.Line("client", "mb1", "mb2", "server"), prefix: "k"})
	hosts := []string{"client", "mb1", "mb2", "server"}
	mb1, mb2 := e.host("mb1"), e.host("mb2")
	dst := e.addr("server", false)
	if len(mb1.Ifaces) < 2 || len(mb2.Ifaces) < 2 {
		t.Fatalf("the line's middleboxes have %d and %d interfaces, want two each", len(mb1.Ifaces), len(mb2.Ifaces))
	}
	// mb1 and mb2 as the chain names them: the address facing the client.
	const port = 9311
	e.policy("client", "k", fmt.Sprintf("tcp dst port %d", port), mb1.Addr4.String(), mb2.Addr4.String())
	const total, rate = 48 * mib, 4 * mib
	lt := e.startTransfer("client", "server", dst, port, total, rate)
	testutil.Eventually(t, 30*time.Second, "the transfer to start", func() bool { return lt.received.Load() > 2*mib })
	before := map[string]uint64{}
	for _, h := range hosts {
		before[h] = e.status(h).Counters["control_rejected_bad_mac"]
	}
	removeSelf := func(what, host string) {
		t.Helper()
		out, err := e.lab.Command(t.Context(), host, dyscoBin, "middlebox", "remove", "--json").Output()
		var rep api.ReconfigReply
		if jerr := json.Unmarshal(out, &rep); jerr != nil {
			t.Fatalf("%s: dysco middlebox remove: %v %v\n%s", host, err, jerr, out)
		}
		if err != nil || len(rep.Results) != 1 || rep.Results[0].Outcome != "succeeded" {
			t.Fatalf("%s: %v %+v", what, err, rep.Results)
		}
		if lt.received.Load() >= total {
			t.Fatalf("%s: the transfer ended first: pace it slower", what)
		}
	}
	// mb1's trigger goes to the client; the client's request passes mb1,
	// which sends it on to mb2 from its second address.
	removeSelf("mb1 takes itself out", "mb1")
	// mb2's trigger goes to the client, its left neighbour now.
	removeSelf("mb2 takes itself out", "mb2")
	lt.wait(t)
	for _, h := range hosts {
		if n := e.status(h).Counters["control_rejected_bad_mac"]; n != before[h] {
			t.Errorf("%s refused %d control messages for their MAC", h, n-before[h])
		}
	}
}
