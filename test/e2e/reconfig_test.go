package e2e

import (
	"encoding/json"
	"net/netip"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/dysco/dysco/internal/api"
	"github.com/dysco/dysco/internal/lab"
)

// liveTransfer runs a paced transfer of total bytes each way between client
// and server; wait returns when both sides checked what they received.
type liveTransfer struct {
	received  atomic.Int64
	clientErr chan error
	serverErr chan error
}

func (e *env) startTransfer(client, server string, dst netip.Addr, port uint16, total, rate int64) *liveTransfer {
	e.t.Helper()
	ap := netip.AddrPortFrom(dst, port)
	return e.startTransferVia(client, server, ap, ap, total, rate)
}

// startTransferVia is startTransfer with the server listening on listen and
// the client dialling dial (a proxy in between).
func (e *env) startTransferVia(client, server string, listen, dial netip.AddrPort, total, rate int64) *liveTransfer {
	e.t.Helper()
	lt := &liveTransfer{clientErr: make(chan error, 1), serverErr: make(chan error, 1)}
	ln := e.listen(server, listen)
	go func() {
		c, err := ln.Accept()
		if err != nil {
			lt.serverErr <- err
			return
		}
		defer c.Close()
		lt.serverErr <- transfer(pacedConn{countingConn{c, &lt.received}, rate}, 2, 1, total)
	}()
	c, err := e.dial(client, dial, 10*time.Second)
	if err != nil {
		e.t.Fatal(err)
	}
	e.t.Cleanup(func() { c.Close() })
	go func() { lt.clientErr <- transfer(pacedConn{c, rate}, 1, 2, total) }()
	return lt
}

func (lt *liveTransfer) wait(t *testing.T) {
	t.Helper()
	for _, ch := range []chan error{lt.clientErr, lt.serverErr} {
		select {
		case err := <-ch:
			if err != nil {
				t.Fatal(err)
			}
		case <-time.After(3 * time.Minute):
			t.Fatal("transfer did not finish")
		}
	}
}

// reconfig runs `dysco reconfig` on host and returns its results.
func (e *env) reconfig(host, match string, to netip.Addr, chain ...netip.Addr) []api.ReconfigResult {
	e.t.Helper()
	args := []string{"reconfig", "--json", "--match", match, "--to", to.String()}
	if len(chain) > 0 {
		var hs []string
		for _, h := range chain {
			hs = append(hs, h.String())
		}
		args = append(args, "--chain", strings.Join(hs, ","))
	}
	out, err := e.lab.Command(e.t.Context(), host, append([]string{dyscoBin}, args...)...).Output()
	var rep api.ReconfigReply
	if jerr := json.Unmarshal(out, &rep); jerr != nil {
		e.t.Fatalf("%s: dysco %s: %v (%v)\n%s", host, strings.Join(args, " "), jerr, err, out)
	}
	return rep.Results
}

func rewrites(st api.Status) uint64 { return st.Counters["rewrite_in"] + st.Counters["rewrite_out"] }

// TestReconfigure changes the chain of one live session, while data flows
// in both directions (paper §3.1): mb1 replaced by mb2, mb2 deleted (the
// session goes direct), mb1 inserted again. Every byte arrives, and a
// middlebox that left the path sees none of the session's packets.
func TestReconfigure(t *testing.T) {
	for _, off := range []bool{false, true} {
		name := "offload"
		if off {
			name = "tx-csum-off"
		}
		t.Run(name, func(t *testing.T) { reconfigure(t, off) })
	}
}

func reconfigure(t *testing.T, off bool) {
	e := newLab(t, labOpts{topology: lab.Star("client", "mb1", "mb2", "server")})
	if off {
		e.txOff("client", "mb1", "mb2", "server")
	}
	dst := e.addr("server", false)
	mb1, mb2 := e.addr("mb1", false), e.addr("mb2", false)
	e.policy("client", "r", "tcp dst port 9300", mb1.String())

	const total = 96 * mib
	lt := e.startTransfer("client", "server", dst, 9300, total, 12*mib)
	eventually(t, 30*time.Second, "the transfer to start", func() bool { return lt.received.Load() > 4*mib })

	step := func(what string, chain ...netip.Addr) {
		t.Helper()
		res := e.reconfig("client", "tcp port 9300", dst, chain...)
		if len(res) != 1 || res[0].Outcome != "succeeded" {
			t.Fatalf("%s: %+v", what, res)
		}
		t.Logf("%s: %.2f ms", what, float64(res[0].Micros)/1000)
		if lt.received.Load() >= total {
			t.Fatalf("%s: the transfer ended before the reconfiguration: pace it slower", what)
		}
	}
	left := func(host string) {
		t.Helper()
		// The host freed the session (FreeSession) and sees none of its
		// packets any more.
		eventually(t, 10*time.Second, host+" to leave the path", func() bool { return len(e.sessions(host)) == 0 })
		before := rewrites(e.status(host))
		at := lt.received.Load()
		eventually(t, 30*time.Second, "more data", func() bool { return lt.received.Load() > at+2*mib })
		if after := rewrites(e.status(host)); after != before {
			t.Errorf("%s still rewrites packets after leaving the path: %d -> %d", host, before, after)
		}
	}
	carries := func(host string) {
		t.Helper()
		before := rewrites(e.status(host))
		eventually(t, 10*time.Second, host+" to carry the session", func() bool { return rewrites(e.status(host)) > before+100 })
	}

	step("replace mb1 by mb2", mb2)
	left("mb1")
	carries("mb2")
	step("delete mb2")
	left("mb2")
	step("insert mb1", mb1)
	carries("mb1")
	lt.wait(t)
}
