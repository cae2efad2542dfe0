package e2e

// The reconfiguration protocol's UDP control channel (paper §3.3) under
// attack and under trouble: forged, truncated and replayed messages are
// refused and counted without touching any session; lost, delayed and
// reordered control messages are retransmitted until reconfigurations
// succeed; a session that ends during a reconfiguration fails it cleanly.

import (
	"context"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	mrand "math/rand/v2"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/dysco/dysco/internal/agent"
	"github.com/dysco/dysco/internal/api"
	"github.com/dysco/dysco/internal/datapath"
	"github.com/dysco/dysco/internal/keys"
	"github.com/dysco/dysco/internal/lab"
	"github.com/dysco/dysco/internal/protocol"
	"github.com/dysco/dysco/internal/testutil"
	"github.com/dysco/dysco/internal/wire"
)

const ctlPort = agent.DefaultControlPort

// ---- helpers ----

// ctlKey returns the control key of the lab's deployment secret (HKDF,
// keys.PurposeControl), which authenticates the control messages between
// its agents.
func (e *env) ctlKey() []byte {
	e.t.Helper()
	return keys.Derive(e.secret(), keys.PurposeControl)
}

// secret is the lab's deployment secret, from which the agents derive
// their keys (the control messages', the Dysco SYNs').
func (e *env) secret() []byte {
	e.t.Helper()
	r, err := keys.Load(filepath.Join(e.lab.RunDir(), "control.key"), os.Geteuid())
	if err != nil {
		e.t.Fatalf("deployment secret: %v", err)
	}
	return r.Signing()
}

// ctlSocket opens a UDP socket in host's namespace, bound to addr and an
// ephemeral port (agents only look at the sender's address).
func (e *env) ctlSocket(host string, addr netip.Addr) *net.UDPConn {
	e.t.Helper()
	var c *net.UDPConn
	err := e.inNS(host, func() error {
		var err error
		c, err = net.ListenUDP("udp", net.UDPAddrFromAddrPort(netip.AddrPortFrom(addr, 0)))
		return err
	})
	if err != nil {
		e.t.Fatalf("UDP socket on %s in %s: %v", addr, host, err)
	}
	e.t.Cleanup(func() { c.Close() })
	return c
}

func ctlSend(t *testing.T, c *net.UDPConn, to netip.Addr, b []byte) {
	t.Helper()
	if _, err := c.WriteToUDPAddrPort(b, netip.AddrPortFrom(to, ctlPort)); err != nil {
		t.Fatalf("send to %s: %v", to, err)
	}
}

// ctlRejected returns the control_rejected_* counters, by reason.
func ctlRejected(st api.Status) map[string]uint64 {
	out := map[string]uint64{}
	for k, v := range st.Counters {
		if r, ok := strings.CutPrefix(k, "control_rejected_"); ok {
			out[r] = v
		}
	}
	return out
}

// ctlDiff returns the counters that changed from before to after.
func ctlDiff(before, after map[string]uint64) map[string]uint64 {
	out := map[string]uint64{}
	for k, v := range after {
		if v != before[k] {
			out[k] = v - before[k]
		}
	}
	for k := range before {
		if _, ok := after[k]; !ok {
			out[k] = 0 // vanished: shown as a change
		}
	}
	return out
}

func ctlSum(m map[string]uint64) (n uint64) {
	for _, v := range m {
		n += v
	}
	return n
}

// ctlSession returns host's session of the TCP session to dst port, if any.
func (e *env) ctlSession(host string, port uint16) (api.Session, bool) {
	e.t.Helper()
	for _, s := range e.sessions(host) {
		if tu, err := wire.ParseTuple(s.Session); err == nil && tu.DstPort == port {
			return s, true
		}
	}
	return api.Session{}, false
}

func (e *env) ctlMustSession(host string, port uint16) api.Session {
	e.t.Helper()
	s, ok := e.ctlSession(host, port)
	if !ok {
		e.t.Fatalf("%s has no session to port %d", host, port)
	}
	return s
}

// ctlSameSession compares what a session is at a host: not its counters,
// and not the rest of its address list, which is shown only until the
// collector drops the set-up state of the established session.
func ctlSameSession(a, b api.Session) bool {
	return a.ID == b.ID && a.Session == b.Session && a.Left == b.Left && a.Right == b.Right &&
		a.Role == b.Role && a.State == b.State && a.Policy == b.Policy
}

func ctlTuple(t *testing.T, s string) wire.Tuple {
	t.Helper()
	tu, err := wire.ParseTuple(s)
	if err != nil {
		t.Fatalf("tuple %q: %v", s, err)
	}
	return tu
}

// pinnedMap opens one of host's pinned datapath maps, read-only.
func (e *env) pinnedMap(host, name string) *ebpf.Map {
	e.t.Helper()
	m, err := ebpf.LoadPinnedMap(filepath.Join(lab.PinDir(e.host(host).Namespace), name), &ebpf.LoadPinOptions{ReadOnly: true})
	if err != nil {
		e.t.Fatalf("%s of %s: %v", name, host, err)
	}
	return m
}

// ctlHasFlow looks a flow up in host's pinned datapath maps.
func (e *env) ctlHasFlow(host string, k wire.Tuple) bool {
	e.t.Helper()
	m4, m6 := e.pinnedMap(host, "dysco_flows4"), e.pinnedMap(host, "dysco_flows6")
	defer m4.Close()
	defer m6.Close()
	_, err := datapath.LookupFlowIn(m4, m6, datapath.TupleFrom(k))
	if err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
		e.t.Fatalf("flow %s at %s: %v", k, host, err)
	}
	return err == nil
}

// pinnedEntries counts the entries of one of host's pinned datapath maps.
func (e *env) pinnedEntries(host, name string) int {
	e.t.Helper()
	m := e.pinnedMap(host, name)
	defer m.Close()
	n := 0
	var k, v []byte
	it := m.Iterate()
	for it.Next(&k, &v) {
		n++
	}
	if err := it.Err(); err != nil {
		e.t.Fatalf("%s of %s: %v", name, host, err)
	}
	return n
}

// ctlOldTrigger builds a JSON trigger as agents before control protocol
// version 4 sent them: "DYST", version 1, kind 1, a JSON body, then
// HMAC-SHA256/16 under key. Agents now refuse it as another version.
func ctlOldTrigger(key []byte, from netip.Addr, body any) []byte {
	j, _ := json.Marshal(body)
	b := append([]byte("DYST"), 1, 1)
	b = append(b, j...)
	return ctlSeal(key, from, b)
}

// ctlSeal appends HMAC-SHA256/16 under key of the sender's address (16
// bytes) and body, as control messages end.
func ctlSeal(key []byte, from netip.Addr, body []byte) []byte {
	h := hmac.New(sha256.New, key)
	a := from.As16()
	h.Write(a[:])
	h.Write(body)
	return append(body, h.Sum(nil)[:protocol.MACLen]...)
}

// ctlResealed is an encoded control message b with its MAC recomputed
// under key after edit changed it: authentic, whatever edit did.
func ctlResealed(key []byte, from netip.Addr, b []byte, edit func(b []byte)) []byte {
	body := append([]byte(nil), b[:len(b)-protocol.MACLen]...)
	edit(body)
	return ctlSeal(key, from, body)
}

// ctlReconfig runs `dysco reconfig` without failing the test, so that it
// can run in a goroutine.
func (e *env) ctlReconfig(host string, timeout time.Duration, match string, to netip.Addr, chain ...netip.Addr) ([]api.ReconfigResult, error) {
	args := []string{"reconfig", "--json", "--timeout", timeout.String(), "--match", match, "--to", to.String()}
	if len(chain) > 0 {
		var hs []string
		for _, h := range chain {
			hs = append(hs, h.String())
		}
		args = append(args, "--chain", strings.Join(hs, ","))
	}
	ctx, cancel := context.WithTimeout(context.Background(), timeout+30*time.Second)
	defer cancel()
	out, err := e.lab.Command(ctx, host, append([]string{dyscoBin}, args...)...).Output()
	var rep api.ReconfigReply
	if jerr := json.Unmarshal(out, &rep); jerr != nil {
		return nil, fmt.Errorf("%s: dysco %s: %v (%v)\n%s", host, strings.Join(args, " "), jerr, err, out)
	}
	return rep.Results, nil
}

// ctlTransfer is a live transfer whose pace can change: slow while the test
// works on the session, fast to finish it.
type ctlTransfer struct {
	received  atomic.Int64
	rate      atomic.Int64
	conn      *net.TCPConn // the client's socket
	clientErr chan error
	serverErr chan error
}

type ctlPaced struct {
	net.Conn
	rate *atomic.Int64
}

func (c ctlPaced) Write(p []byte) (int, error) { return pacedWrite(c.Conn, p, c.rate.Load) }

func (c ctlPaced) CloseWrite() error {
	if cw, ok := c.Conn.(interface{ CloseWrite() error }); ok {
		return cw.CloseWrite()
	}
	return nil
}

func (e *env) ctlStartTransfer(client, server string, dst netip.Addr, port uint16, total, rate int64) *ctlTransfer {
	e.t.Helper()
	x := &ctlTransfer{clientErr: make(chan error, 1), serverErr: make(chan error, 1)}
	x.rate.Store(rate)
	ln := e.listen(server, netip.AddrPortFrom(dst, port))
	go func() {
		c, err := ln.Accept()
		if err != nil {
			x.serverErr <- err
			return
		}
		defer c.Close()
		x.serverErr <- transfer(ctlPaced{countingConn{c, &x.received}, &x.rate}, 2, 1, total)
	}()
	c, err := e.dial(client, netip.AddrPortFrom(dst, port), 10*time.Second)
	if err != nil {
		e.t.Fatal(err)
	}
	x.conn = c.(*net.TCPConn)
	e.t.Cleanup(func() { c.Close() })
	go func() { x.clientErr <- transfer(ctlPaced{c, &x.rate}, 1, 2, total) }()
	return x
}

// finish lets the transfer run at full speed and checks both ends.
func (x *ctlTransfer) finish(t *testing.T) {
	t.Helper()
	x.rate.Store(1 << 40)
	for _, ch := range []chan error{x.clientErr, x.serverErr} {
		select {
		case err := <-ch:
			if err != nil {
				t.Fatal(err)
			}
		case <-time.After(2 * time.Minute):
			t.Fatal("transfer did not finish")
		}
	}
}

// ---- 1. forged messages ----

// TestControlForgedMessages sends forged, malformed and truncated control
// messages and triggers to the agents of a live chain (client → mb1 →
// server) from the client's namespace. Each is refused and counted under
// its reason at the receiving agent, the sessions do not change, the
// transfer goes on byte for byte, and a legitimate reconfiguration
// afterwards succeeds. Nothing answers them, but for two: a well-formed
// requestLock under the right key for a session this host does not have
// is answered once with a nackLock "session ended" (a session that ended
// here: docs/protocol.md), and its copy in the bundle, sent within the
// retransmission timeout (a duplicate, not a retransmission), is not;
// a well-formed trigger for a subsession this host does not have is
// answered once, refused, and its copy and an older one are not. Forged
// rebinds (a guessed nonce, an unknown subsession, a flood of 200 under
// a wrong key) are refused and answered by nothing.
func TestControlForgedMessages(t *testing.T) {
	t.Run("ipv4", func(t *testing.T) { controlForged(t, false) })
	t.Run("ipv6", func(t *testing.T) { controlForged(t, true) })
}

func controlForged(t *testing.T, v6 bool) {
	e := newLab(t, labOpts{topology: lab.Star("client", "mb1", "server")})
	cli, mb1, dst := e.addr("client", v6), e.addr("mb1", v6), e.addr("server", v6)
	const port = 9400
	e.policy("client", "f", fmt.Sprintf("tcp dst port %d", port), mb1.String())

	const total = 96 * mib // about 12 s at 8 MiB/s
	lt := e.startTransfer("client", "server", dst, port, total, 8*mib)
	testutil.Eventually(t, 30*time.Second, "the transfer to start", func() bool { return lt.received.Load() > 2*mib })

	key := e.ctlKey()
	wrongKey := make([]byte, len(key))
	copy(wrongKey, key)
	wrongKey[0] ^= 0xff
	sock := e.ctlSocket("client", cli)

	targets := []struct {
		host string
		addr netip.Addr
	}{{"mb1", mb1}, {"server", dst}}
	type snapshot struct {
		rej      map[string]uint64
		in, out  uint64
		sess     api.Session
		rewrites uint64
	}
	snap := func(host string) snapshot {
		st := e.status(host)
		s := e.ctlMustSession(host, port)
		return snapshot{rej: ctlRejected(st), in: st.Counters["control_messages_in"], out: st.Counters["control_messages_out"],
			sess: s, rewrites: rewrites(st)}
	}
	before := map[string]snapshot{}
	for _, tg := range targets {
		before[tg.host] = snap(tg.host)
	}

	for _, tg := range targets {
		real := before[tg.host].sess
		realSub := ctlTuple(t, real.Left) // as its SYN went: the left neighbour → this host
		// A message that is well formed but concerns no session here.
		fake := protocol.Message{
			Type:        protocol.MsgRequestLock,
			Sub:         wire.Tuple{Src: cli, Dst: tg.addr, SrcPort: 61999, DstPort: 62999},
			Session:     wire.Tuple{Src: cli, Dst: dst, SrcPort: 40999, DstPort: port},
			Req:         protocol.ReqKey{LeftAnchor: cli, ID: 1},
			RightAnchor: dst,
		}
		rand.Read(fake.Nonce[:])
		// The same naming the real subsession, with a nonce the attacker
		// had to guess.
		guess := fake
		guess.Sub = realSub
		guess.Session = ctlTuple(t, real.Session)
		enc := func(m protocol.Message, k []byte) []byte {
			b, err := m.Encode(protocol.NewKeys(k), cli)
			if err != nil {
				t.Fatal(err)
			}
			return b
		}
		valid := enc(fake, key)
		badVersion := append([]byte(nil), valid...)
		badVersion[4] = protocol.MsgVersion + 1
		garbage := make([]byte, 200)
		rand.Read(garbage)
		copy(garbage, "GET / HTTP/1.1\r\n")
		// Triggers (docs/protocol.md, "Triggers"): a trigger from the
		// client for a subsession from the target to the client that the
		// target does not have. Its first copy is answered once, refused
		// (the session ended); the same again is a replay, and so is one
		// numbered far below it (older than the client's window at the
		// target, 2048 numbers): refused, not answered.
		trig := protocol.Message{
			Type:        protocol.MsgTrigger,
			Sub:         wire.Tuple{Src: tg.addr, Dst: cli, SrcPort: 61998, DstPort: 62998},
			Session:     fake.Session,
			Req:         protocol.ReqKey{LeftAnchor: cli, ID: 5000},
			RightAnchor: dst,
			Migrate:     &protocol.MigrateSpec{Semantics: protocol.MigrateOrder},
		}
		trig.Nonce = fake.Nonce
		newTrig := enc(trig, key)
		staleTrig := trig
		staleTrig.Req.ID = 1000
		badTrig := enc(trig, key)
		badTrig[len(badTrig)-1] ^= 0x5a
		// Version 3, its MAC right: another version.
		v3Trig := ctlResealed(key, cli, newTrig, func(b []byte) { b[4] = 3 })
		// Version 4, before the MAC covered the sender: another version.
		v4Msg := ctlResealed(key, cli, enc(guess, key), func(b []byte) { b[4] = 4 })
		// Authentic, but as sent by the target itself: a message taken
		// off the wire and sent again from another address.
		elsewhere, err := guess.Encode(protocol.NewKeys(key), tg.addr)
		if err != nil {
			t.Fatal(err)
		}
		// The migration spec's own version byte (the first of the
		// extension body, which ends the message before its MAC).
		badExt := ctlResealed(key, cli, newTrig, func(b []byte) { b[len(b)-16] = 9 })
		// The real subsession, its nonce guessed.
		guessTrig := trig
		guessTrig.Sub, guessTrig.Session, guessTrig.Req.ID = realSub, guess.Session, 5001
		oldTrig := ctlOldTrigger(key, cli, map[string]any{"token": 77, "sub": realSub, "right_anchor": dst, "sent_unix_ms": time.Now().UnixMilli()})
		// Bundles (docs/protocol.md, "Bundles"): each message in one is
		// checked as if it had come alone; a malformed bundle is refused
		// whole.
		bundle := protocol.PackBundles([][]byte{enc(fake, wrongKey), valid, garbage}, protocol.BundleMax)
		if len(bundle) != 1 || !protocol.IsBundle(bundle[0]) {
			t.Fatalf("three messages did not pack into one bundle: %d datagrams", len(bundle))
		}
		badBundle := append([]byte(nil), bundle[0]...)
		badBundle[5] = 4 // count: one payload more than it holds

		type forged struct {
			what   string
			b      []byte
			reason string // for each message of the datagram, comma-separated
		}
		msgs := []forged{
			{"(a) garbage", garbage, "bad_magic"},
			{"(a) three bytes", []byte("DYS"), "malformed"},
			{"(b) wrong HMAC key", enc(fake, wrongKey), "bad_mac"},
			{"unknown version", badVersion, "bad_version"},
			{"(c) unknown subsession", valid, "unknown_session"},
			{"real subsession, guessed nonce", enc(guess, key), "bad_nonce"},
			{"(d) truncated header", valid[:100], "malformed"},
			{"(d) one byte short", valid[:len(valid)-1], "malformed"},
			{"(e) trigger with a bad MAC", badTrig, "bad_mac"},
			{"trigger of version 3", v3Trig, "bad_version"},
			{"message of version 4", v4Msg, "bad_version"},
			{"(f) authentic, replayed from another address", elsewhere, "bad_mac"},
			{"JSON trigger (DYST) of an older agent", oldTrig, "bad_version"},
			{"trigger with a malformed extension body", badExt, "malformed"},
			{"trigger for the real subsession, guessed nonce", enc(guessTrig, key), "bad_nonce"},
			{"trigger for an unknown subsession", newTrig, "unknown_session"},
			{"the same trigger again", newTrig, "replay"},
			{"a trigger older than the window", enc(staleTrig, key), "replay"},
			{"a bundle of a wrong HMAC, an unknown subsession and garbage", bundle[0], "bad_mac,unknown_session,bad_magic"},
			{"a bundle that counts more than it holds", badBundle, "bad_bundle"},
		}
		// Rebinds (docs/protocol.md, "Rebinds"): a claim to be the
		// session's moved end, from the client's address. Its real
		// subsession with a guessed nonce, an unknown subsession, and
		// a flood of forged ones.
		rebind := protocol.Message{Type: protocol.MsgRebind, Sub: realSub, Session: guess.Session, Nonce: fake.Nonce,
			Req: protocol.ReqKey{LeftAnchor: cli, ID: 9000}, RightAnchor: cli}
		unknownRebind := rebind
		unknownRebind.Sub = fake.Sub
		msgs = append(msgs,
			forged{"rebind of the real subsession, guessed nonce", enc(rebind, key), "bad_nonce"},
			forged{"rebind of an unknown subsession", enc(unknownRebind, key), "unknown_session"})
		for range 200 {
			msgs = append(msgs, forged{"a flood of forged rebinds", enc(rebind, wrongKey), "bad_mac"})
		}
		want := map[string]uint64{}
		nmsgs := 0
		for _, m := range msgs {
			ctlSend(t, sock, tg.addr, m.b)
			for _, r := range strings.Split(m.reason, ",") {
				want[r]++
				nmsgs++
			}
		}
		b := before[tg.host]
		var got map[string]uint64
		var st api.Status
		testutil.Eventually(t, 10*time.Second, "the agent of "+tg.host+" to read every forged message", func() bool {
			st = e.status(tg.host)
			return st.Counters["control_messages_in"] >= b.in+uint64(nmsgs)
		})
		// Every message read has been refused and counted once the loop
		// got to it: wait for the counts, then compare exactly.
		testutil.Eventually(t, 10*time.Second, "the refusals at "+tg.host+" to be counted", func() bool {
			st = e.status(tg.host)
			got = ctlDiff(b.rej, ctlRejected(st))
			return ctlSum(got) >= uint64(nmsgs)
		})
		t.Logf("%s refused: %v", tg.host, got)
		for r, n := range want {
			if got[r] != n {
				t.Errorf("%s: control_rejected_%s grew by %d, want %d", tg.host, r, got[r], n)
			}
		}
		for r, n := range got {
			if _, ok := want[r]; !ok {
				t.Errorf("%s: control_rejected_%s grew by %d, want 0", tg.host, r, n)
			}
		}
		if in := st.Counters["control_messages_in"] - b.in; in != uint64(nmsgs) {
			t.Errorf("%s: control_messages_in grew by %d, want %d", tg.host, in, nmsgs)
		}
		if out := st.Counters["control_messages_out"]; out != b.out+2 {
			t.Errorf("%s answered forged messages: control_messages_out %d -> %d, want two more (the nack of the unknown subsession's request, the refusal of the first trigger for one)",
				tg.host, b.out, out)
		}
	}

	// Nothing changed: the sessions are the same, mb1 still carries the
	// session, and data flows on.
	at := lt.received.Load()
	testutil.Eventually(t, 30*time.Second, "more data after the forgeries", func() bool { return lt.received.Load() > at+2*mib })
	for _, tg := range targets {
		now := snap(tg.host)
		if !ctlSameSession(now.sess, before[tg.host].sess) {
			t.Errorf("%s: session changed:\nbefore %+v\nafter  %+v", tg.host, before[tg.host].sess, now.sess)
		}
		if now.rewrites <= before[tg.host].rewrites {
			t.Errorf("%s rewrites no more packets of the session", tg.host)
		}
	}
	if lt.received.Load() >= total {
		t.Fatal("the transfer ended before the legitimate reconfiguration: pace it slower")
	}

	// A legitimate reconfiguration of the same session: delete mb1.
	res := e.reconfig("client", fmt.Sprintf("tcp port %d", port), dst)
	if len(res) != 1 || res[0].Outcome != "succeeded" {
		t.Fatalf("reconfiguration after the forgeries: %+v", res)
	}
	t.Logf("delete mb1 after the forgeries: %.2f ms", float64(res[0].Micros)/1000)
	testutil.Eventually(t, 15*time.Second, "mb1 to leave the path", func() bool { _, ok := e.ctlSession("mb1", port); return !ok })
	lt.wait(t)
}

// ---- 2. replay ----

// ctlPkt is a captured UDP datagram.
type ctlPkt struct {
	src, dst netip.AddrPort
	payload  []byte
}

type ctlCapture struct {
	f    *os.File
	mu   sync.Mutex
	pkts []ctlPkt
	done chan struct{}
}

func ctlHtons(v uint16) uint16 { return v<<8 | v>>8 }

// ctlCaptureUDP captures the IPv4 and IPv6 UDP datagrams to port on host's
// lab interface (AF_PACKET socket opened in its namespace: capturing from the
// moment it returns).
func (e *env) ctlCaptureUDP(host string, port uint16) *ctlCapture {
	e.t.Helper()
	var fd int
	err := e.inNS(host, func() error {
		ifc, err := net.InterfaceByName(e.host(host).Iface)
		if err != nil {
			return err
		}
		fd, err = unix.Socket(unix.AF_PACKET, unix.SOCK_DGRAM|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, int(ctlHtons(unix.ETH_P_ALL)))
		if err != nil {
			return err
		}
		if err := unix.Bind(fd, &unix.SockaddrLinklayer{Protocol: ctlHtons(unix.ETH_P_ALL), Ifindex: ifc.Index}); err != nil {
			unix.Close(fd)
			return err
		}
		return nil
	})
	if err != nil {
		e.t.Fatalf("capture in %s: %v", host, err)
	}
	c := &ctlCapture{f: os.NewFile(uintptr(fd), "capture"), done: make(chan struct{})}
	go func() {
		defer close(c.done)
		buf := make([]byte, 1<<16)
		for {
			n, err := c.f.Read(buf)
			if err != nil {
				return
			}
			b := buf[:n]
			var src, dst netip.Addr
			var u []byte
			switch {
			case n >= 20 && b[0]>>4 == 4 && b[9] == unix.IPPROTO_UDP && n >= int(b[0]&0xf)*4+8:
				src, dst = netip.AddrFrom4([4]byte(b[12:16])), netip.AddrFrom4([4]byte(b[16:20]))
				u = b[int(b[0]&0xf)*4:]
			case n >= 48 && b[0]>>4 == 6 && b[6] == unix.IPPROTO_UDP: // no extension headers in the lab
				src, dst = netip.AddrFrom16([16]byte(b[8:24])), netip.AddrFrom16([16]byte(b[24:40]))
				u = b[40:]
			default:
				continue
			}
			ulen := int(binary.BigEndian.Uint16(u[4:]))
			if ulen < 8 || ulen > len(u) || binary.BigEndian.Uint16(u[2:]) != port {
				continue
			}
			p := ctlPkt{
				src:     netip.AddrPortFrom(src, binary.BigEndian.Uint16(u[0:])),
				dst:     netip.AddrPortFrom(dst, binary.BigEndian.Uint16(u[2:])),
				payload: append([]byte(nil), u[8:ulen]...),
			}
			c.mu.Lock()
			c.pkts = append(c.pkts, p)
			c.mu.Unlock()
		}
	}()
	e.t.Cleanup(func() { c.stop() })
	return c
}

func (c *ctlCapture) stop() []ctlPkt {
	c.f.Close()
	<-c.done
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]ctlPkt(nil), c.pkts...)
}

// TestControlReplay captures, at the server, the control messages of a
// live reconfiguration (client deletes mb1), then sends each again to the
// server's agent from its original sender's address, in the sender's
// namespace: once while the session lives, once after it has ended. Every
// replay is refused and counted, none is answered, and the session stays
// as the reconfiguration left it.
func TestControlReplay(t *testing.T) {
	t.Run("ipv4", func(t *testing.T) { controlReplay(t, false) })
	t.Run("ipv6", func(t *testing.T) { controlReplay(t, true) })
}

// addrPrefix is how the sessions table begins an address and port:
// "10.0.3.2:" or "[fd00::2]:".
func addrPrefix(a netip.Addr) string {
	return strings.TrimSuffix(netip.AddrPortFrom(a, 0).String(), "0")
}

func controlReplay(t *testing.T, v6 bool) {
	e := newLab(t, labOpts{topology: lab.Star("client", "mb1", "server")})
	mb1, dst := e.addr("mb1", v6), e.addr("server", v6)
	const port = 9410
	e.policy("client", "r", fmt.Sprintf("tcp dst port %d", port), mb1.String())

	const total = 96 * mib // about 12 s at 8 MiB/s
	lt := e.startTransfer("client", "server", dst, port, total, 8*mib)
	testutil.Eventually(t, 30*time.Second, "the transfer to start", func() bool { return lt.received.Load() > 2*mib })
	oldLeft := ctlTuple(t, e.ctlMustSession("server", port).Left)
	if oldLeft.Src != mb1 {
		t.Fatalf("the server's left subsession %s does not come from mb1", oldLeft)
	}

	capture := e.ctlCaptureUDP("server", ctlPort)
	res := e.reconfig("client", fmt.Sprintf("tcp port %d", port), dst)
	if len(res) != 1 || res[0].Outcome != "succeeded" {
		t.Fatalf("delete mb1: %+v", res)
	}
	// The server completes as right anchor (its left side is the new,
	// direct subsession), then its old subsession lingers to answer
	// retransmitted FINs and goes: from then on it has nothing more to
	// receive about this reconfiguration.
	testutil.Eventually(t, 15*time.Second, "the server to complete", func() bool {
		s, ok := e.ctlSession("server", port)
		return ok && strings.HasPrefix(s.Left, addrPrefix(e.addr("client", v6)))
	})
	testutil.Eventually(t, 15*time.Second, "the server's old subsession to go", func() bool { return !e.ctlHasFlow("server", oldLeft) })
	testutil.Eventually(t, 15*time.Second, "mb1 to leave the path", func() bool { _, ok := e.ctlSession("mb1", port); return !ok })
	pkts := capture.stop()

	key := e.ctlKey()
	hostOf := map[netip.Addr]string{}
	for _, h := range e.lab.Hosts() {
		hostOf[h.Addr4], hostOf[h.Addr6] = h.Name, h.Name
	}
	var replay []ctlPkt
	n := uint64(0) // messages: a bundle carries several
	for _, p := range pkts {
		if p.dst != netip.AddrPortFrom(dst, ctlPort) {
			continue
		}
		msgs := [][]byte{p.payload}
		if protocol.IsBundle(p.payload) {
			var err error
			if msgs, err = protocol.SplitBundle(p.payload); err != nil {
				t.Fatalf("captured from %s: %v", p.src, err)
			}
		}
		for i, b := range msgs {
			what := "?"
			if m, err := protocol.Decode(protocol.NewKeys(key), p.src.Addr().Unmap(), b); err == nil {
				what = m.String()
			}
			if len(msgs) > 1 {
				what = fmt.Sprintf("(bundle %d/%d) %s", i+1, len(msgs), what)
			}
			t.Logf("captured from %s (%s): %s", p.src, hostOf[p.src.Addr()], what)
		}
		n += uint64(len(msgs))
		replay = append(replay, p)
	}
	if n < 5 {
		t.Fatalf("captured %d control messages to the server, want at least requestLock, syn, ack, fin, finAck", n)
	}

	socks := map[netip.Addr]*net.UDPConn{}
	// replayAll sends every captured message again, each from its original
	// sender's address in the sender's namespace, and checks that the
	// server refuses and counts every one and answers none.
	replayAll := func(when string) {
		t.Helper()
		before := e.status("server")
		for _, p := range replay {
			h, ok := hostOf[p.src.Addr()]
			if !ok {
				t.Fatalf("captured a message from %s, which is no lab host", p.src)
			}
			if socks[p.src.Addr()] == nil {
				socks[p.src.Addr()] = e.ctlSocket(h, p.src.Addr())
			}
			ctlSend(t, socks[p.src.Addr()], dst, p.payload)
		}
		var after api.Status
		testutil.Eventually(t, 10*time.Second, "the server to refuse every replay "+when, func() bool {
			after = e.status("server")
			return after.Counters["control_messages_in"] >= before.Counters["control_messages_in"]+n &&
				ctlSum(ctlDiff(ctlRejected(before), ctlRejected(after))) >= n
		})
		got := ctlDiff(ctlRejected(before), ctlRejected(after))
		t.Logf("replayed %d messages %s; refused: %v", n, when, got)
		if sum := ctlSum(got); sum != n {
			t.Errorf("%s: %d refusals counted for %d replayed messages", when, sum, n)
		}
		for r := range got {
			switch r {
			case "replay", "unknown_session", "unexpected":
			default:
				t.Errorf("replays %s refused as %s", when, r)
			}
		}
		if out := after.Counters["control_messages_out"]; out != before.Counters["control_messages_out"] {
			t.Errorf("the server answered replays %s: control_messages_out %d -> %d", when, before.Counters["control_messages_out"], out)
		}
	}

	sessBefore := e.ctlMustSession("server", port)
	replayAll("during the session")
	// The session did not change, and carries on.
	at := lt.received.Load()
	testutil.Eventually(t, 30*time.Second, "more data after the replays", func() bool { return lt.received.Load() > at+mib })
	sessAfter := e.ctlMustSession("server", port)
	if !ctlSameSession(sessAfter, sessBefore) {
		t.Errorf("the server's session changed:\nbefore %+v\nafter  %+v", sessBefore, sessAfter)
	}
	if lt.received.Load() >= total {
		t.Fatal("the transfer ended before the replays were checked: pace it slower")
	}
	lt.wait(t)

	// Once the session has ended nothing at the server names its
	// subsessions any more: the early SYN of the delete (sent beside
	// requestLock, docs/protocol.md) is told a replay by its request's
	// number alone, and must still be refused and counted, not kept.
	testutil.Eventually(t, 15*time.Second, "the server's session to be collected", func() bool { return len(e.sessions("server")) == 0 })
	replayAll("after the session")
	if ss := e.sessions("server"); len(ss) != 0 {
		t.Errorf("replays after the session made sessions at the server: %v", ss)
	}
}

// ---- 3. loss, delay, reordering ----

// ctlLossy relays the control traffic (UDP to the control port) that
// crosses the star's router, losing, delaying and reordering it as
// `netem loss 20% delay 5ms 2ms reorder 25%` would. The kernel of the test
// machines may lack netem and prio (CONFIG_NET_SCH_NETEM, _PRIO), so the
// router diverts the datagrams with TPROXY to this relay, which sends
// them on from their original source address (IP_TRANSPARENT). Every
// message between two hosts crosses the router once.
type ctlLossy struct {
	conn *net.UDPConn
	// out sends on from each lab host's address, in the router's namespace.
	out                                     map[netip.Addr]*net.UDPConn
	seen, dropped, early, delayed, sendErrs atomic.Int64
	wg                                      sync.WaitGroup // delayed sends
	done                                    chan struct{}
	once                                    sync.Once
}

const (
	ctlRelayPort = 4791
	ctlLoss      = 0.20
	ctlReorder   = 0.25
	ctlDelay     = 5 * time.Millisecond
	ctlJitter    = 2 * time.Millisecond
)

// ctlTransparent sets IP_TRANSPARENT (and IP_RECVORIGDSTADDR) on a socket
// before it is bound.
func ctlTransparent(origDst, v6 bool) func(network, address string, c syscall.RawConn) error {
	level, transparent, recvOrig := unix.SOL_IP, unix.IP_TRANSPARENT, unix.IP_RECVORIGDSTADDR
	if v6 {
		level, transparent, recvOrig = unix.SOL_IPV6, unix.IPV6_TRANSPARENT, unix.IPV6_RECVORIGDSTADDR
	}
	return func(_, _ string, c syscall.RawConn) error {
		var serr error
		err := c.Control(func(fd uintptr) {
			serr = unix.SetsockoptInt(int(fd), level, transparent, 1)
			if serr == nil && origDst {
				serr = unix.SetsockoptInt(int(fd), level, recvOrig, 1)
			}
		})
		if err != nil {
			return err
		}
		return serr
	}
}

// ctlStartLossy diverts the control traffic of one address family crossing
// the router to a lossy relay, until the test ends.
func (e *env) ctlStartLossy(v6 bool) *ctlLossy {
	e.t.Helper()
	r := &ctlLossy{out: map[netip.Addr]*net.UDPConn{}, done: make(chan struct{})}
	network, any, ipt, ip, local := "udp4", netip.IPv4Unspecified(), "iptables", "-4", "0.0.0.0/0"
	if v6 {
		network, any, ipt, ip, local = "udp6", netip.IPv6Unspecified(), "ip6tables", "-6", "::/0"
	}
	err := e.inNS("router", func() error {
		lc := net.ListenConfig{Control: ctlTransparent(true, v6)}
		pc, err := lc.ListenPacket(context.Background(), network, netip.AddrPortFrom(any, ctlRelayPort).String())
		if err != nil {
			return err
		}
		r.conn = pc.(*net.UDPConn)
		for _, h := range e.lab.Hosts() {
			a := h.Addr4
			if v6 {
				a = h.Addr6
			}
			lc := net.ListenConfig{Control: ctlTransparent(false, v6)}
			pc, err := lc.ListenPacket(context.Background(), network, netip.AddrPortFrom(a, 0).String())
			if err != nil {
				return fmt.Errorf("sending socket for %s: %w", a, err)
			}
			r.out[a] = pc.(*net.UDPConn)
		}
		return nil
	})
	if err != nil {
		e.t.Fatalf("lossy relay in the router: %v", err)
	}
	e.t.Cleanup(r.stop)
	go r.loop()
	// The relay is listening: divert the control port to it.
	e.run("router", ipt, "-t", "mangle", "-A", "PREROUTING", "-p", "udp", "--dport", strconv.Itoa(ctlPort),
		"-j", "TPROXY", "--on-port", strconv.Itoa(ctlRelayPort), "--tproxy-mark", "0x1/0x1")
	e.run("router", "ip", ip, "rule", "add", "fwmark", "0x1/0x1", "lookup", "100")
	e.run("router", "ip", ip, "route", "add", "local", local, "dev", "lo", "table", "100")
	return r
}

func (r *ctlLossy) loop() {
	defer close(r.done)
	buf := make([]byte, 1<<16)
	oob := make([]byte, 512)
	for {
		n, oobn, _, src, err := r.conn.ReadMsgUDPAddrPort(buf, oob)
		if err != nil {
			return
		}
		dst, ok := ctlOrigDst(oob[:oobn])
		if !ok {
			r.sendErrs.Add(1)
			continue
		}
		r.seen.Add(1)
		data := append([]byte(nil), buf[:n]...)
		from := src.Addr().Unmap()
		switch {
		case mrand.Float64() < ctlLoss:
			r.dropped.Add(1)
		case mrand.Float64() < ctlReorder:
			r.early.Add(1) // overtakes the delayed ones
			r.send(from, dst, data)
		default:
			r.delayed.Add(1)
			d := ctlDelay - ctlJitter + mrand.N(2*ctlJitter)
			r.wg.Add(1)
			time.AfterFunc(d, func() {
				defer r.wg.Done()
				r.send(from, dst, data)
			})
		}
	}
}

func (r *ctlLossy) send(from netip.Addr, to netip.AddrPort, data []byte) {
	c := r.out[from]
	if c == nil {
		r.sendErrs.Add(1)
		return
	}
	if _, err := c.WriteToUDPAddrPort(data, to); err != nil {
		r.sendErrs.Add(1)
	}
}

// ctlOrigDst reads the original destination of a diverted datagram.
func ctlOrigDst(oob []byte) (netip.AddrPort, bool) {
	msgs, err := unix.ParseSocketControlMessage(oob)
	if err != nil {
		return netip.AddrPort{}, false
	}
	for _, m := range msgs {
		if m.Header.Level == unix.SOL_IP && m.Header.Type == unix.IP_ORIGDSTADDR && len(m.Data) >= 8 {
			return netip.AddrPortFrom(netip.AddrFrom4([4]byte(m.Data[4:8])), binary.BigEndian.Uint16(m.Data[2:4])), true
		}
		if m.Header.Level == unix.SOL_IPV6 && m.Header.Type == unix.IPV6_ORIGDSTADDR && len(m.Data) >= 24 {
			// struct sockaddr_in6: family, port, flow info, address.
			return netip.AddrPortFrom(netip.AddrFrom16([16]byte(m.Data[8:24])), binary.BigEndian.Uint16(m.Data[2:4])), true
		}
	}
	return netip.AddrPort{}, false
}

func (r *ctlLossy) stop() {
	r.once.Do(func() {
		r.conn.Close()
		<-r.done
		r.wg.Wait()
		for _, c := range r.out {
			c.Close()
		}
	})
}

func (r *ctlLossy) String() string {
	return fmt.Sprintf("%d control datagrams: %d lost, %d sent at once, %d delayed %v±%v, %d errors",
		r.seen.Load(), r.dropped.Load(), r.early.Load(), r.delayed.Load(), ctlDelay, ctlJitter, r.sendErrs.Load())
}

// TestControlLoss runs the reconfigurations of TestReconfigure on a live
// session, IPv4 and IPv6 (mb1 replaced by mb2, mb2 deleted, mb1 inserted)
// while every control message between hosts is lost with probability 0.2,
// delayed 5 ms ± 2 ms, and reordered (a quarter overtake the others); data
// packets are untouched. Every reconfiguration succeeds and every byte
// arrives.
func TestControlLoss(t *testing.T) {
	t.Run("ipv4", func(t *testing.T) { controlLoss(t, false) })
	t.Run("ipv6", func(t *testing.T) { controlLoss(t, true) })
}

func controlLoss(t *testing.T, v6 bool) {
	e := newLab(t, labOpts{topology: lab.Star("client", "mb1", "mb2", "server")})
	cli, mb1, mb2, dst := e.addr("client", v6), e.addr("mb1", v6), e.addr("mb2", v6), e.addr("server", v6)
	const port = 9420
	e.policy("client", "l", fmt.Sprintf("tcp dst port %d", port), mb1.String())
	r := e.ctlStartLossy(v6)

	const total = 256 * mib // slow while reconfiguring, then at full speed
	x := e.ctlStartTransfer("client", "server", dst, port, total, 4*mib)
	testutil.Eventually(t, 30*time.Second, "the transfer to start", func() bool { return x.received.Load() > 2*mib })

	match := fmt.Sprintf("tcp port %d", port)
	step := func(what string, neighbour netip.Addr, chain ...netip.Addr) {
		t.Helper()
		res, err := e.ctlReconfig("client", 30*time.Second, match, dst, chain...)
		if err != nil {
			t.Fatal(err)
		}
		if len(res) != 1 || res[0].Outcome != "succeeded" {
			t.Fatalf("%s: %+v (relay: %s)", what, res, r)
		}
		t.Logf("%s: %.2f ms %s", what, float64(res[0].Micros)/1000, res[0].Reason)
		// The right anchor completes too: its left side comes from the
		// new neighbour.
		testutil.Eventually(t, 30*time.Second, "the server to complete "+what, func() bool {
			s, ok := e.ctlSession("server", port)
			return ok && strings.HasPrefix(s.Left, addrPrefix(neighbour))
		})
	}
	left := func(host string) {
		t.Helper()
		start := time.Now()
		testutil.Eventually(t, 45*time.Second, host+" to leave the path", func() bool { _, ok := e.ctlSession(host, port); return !ok })
		t.Logf("%s left the path after %v", host, time.Since(start).Round(time.Millisecond))
	}
	carries := e.carries

	step("replace mb1 by mb2", mb2, mb2)
	left("mb1")
	carries("mb2")
	step("delete mb2", cli)
	left("mb2")
	step("insert mb1", mb1, mb1)
	carries("mb1")
	if x.received.Load() >= total {
		t.Fatal("the transfer ended before the reconfigurations: pace it slower")
	}
	x.finish(t)

	r.stop()
	t.Logf("relay: %s", r)
	ipt := e.run("router", map[bool]string{false: "iptables", true: "ip6tables"}[v6], "-t", "mangle", "-L", "PREROUTING", "-n", "-v", "-x")
	t.Logf("router mangle PREROUTING:\n%s", ipt)
	if r.seen.Load() == 0 || r.delayed.Load() == 0 {
		t.Fatalf("no control message went through the lossy relay: %s", r)
	}
	if r.seen.Load() >= 40 && (r.dropped.Load() == 0 || r.early.Load() == 0) {
		t.Errorf("the relay lost or reordered nothing: %s", r)
	}
	if r.sendErrs.Load() != 0 {
		t.Errorf("the relay failed to pass some messages on: %s", r)
	}
}

// ---- 4. the session ends during a reconfiguration ----

// TestControlSessionEnds resets a session while its reconfiguration waits
// for a new path that cannot be set up (its hop is an address nobody has):
// the reconfiguration fails, and nothing is left behind: a new session
// through the same middlebox is reconfigured at once.
func TestControlSessionEnds(t *testing.T) {
	t.Run("ipv4", func(t *testing.T) { controlSessionEnds(t, false) })
	t.Run("ipv6", func(t *testing.T) { controlSessionEnds(t, true) })
}

func controlSessionEnds(t *testing.T, v6 bool) {
	e := newLab(t, labOpts{topology: lab.Star("client", "mb1", "server")})
	mb1, dst := e.addr("mb1", v6), e.addr("server", v6)
	const port, port2 = 9430, 9431
	e.policy("client", "s", fmt.Sprintf("tcp dst portrange %d-%d", port, port2), mb1.String())

	x := e.ctlStartTransfer("client", "server", dst, port, 256*mib, 2*mib)
	testutil.Eventually(t, 30*time.Second, "the transfer to start", func() bool { return x.received.Load() > mib })
	e.ctlMustSession("mb1", port)

	b := dst.As16()
	b[15] = 250
	nowhere := netip.AddrFrom16(b).Unmap() // in the server's subnet; no host answers
	out := func(host string) uint64 { return e.status(host).Counters["control_messages_out"] }
	base := map[string]uint64{"client": out("client"), "server": out("server")}

	type outcome struct {
		res []api.ReconfigResult
		err error
	}
	done := make(chan outcome, 1)
	start := time.Now()
	go func() {
		res, err := e.ctlReconfig("client", 30*time.Second, fmt.Sprintf("tcp port %d", port), dst, nowhere)
		done <- outcome{res, err}
	}()
	// Locked (the server sent ackLock) and the SYN of the new path sent
	// and retransmitted at least once: the reconfiguration is stuck in
	// its set-up.
	var early *outcome
	testutil.Eventually(t, 10*time.Second, "the reconfiguration to wait for the new path", func() bool {
		select {
		case o := <-done:
			early = &o
			return true
		default:
		}
		return out("server") >= base["server"]+1 && out("client") >= base["client"]+3
	})
	if early != nil {
		t.Fatalf("the reconfiguration ended before the reset: %+v %v", early.res, early.err)
	}
	if err := x.conn.SetLinger(0); err != nil {
		t.Fatal(err)
	}
	x.conn.Close() // RST
	reset := time.Now()

	var o outcome
	select {
	case o = <-done:
	case <-time.After(60 * time.Second):
		t.Fatal("the reconfiguration did not end")
	}
	if o.err != nil {
		t.Fatal(o.err)
	}
	if len(o.res) != 1 {
		t.Fatalf("results: %+v", o.res)
	}
	t.Logf("reconfiguration through %s: %s (%s) after %v, %v after the reset", nowhere, o.res[0].Outcome, o.res[0].Reason,
		time.Since(start).Round(time.Millisecond), time.Since(reset).Round(time.Millisecond))
	if o.res[0].Outcome != "failed" {
		t.Errorf("outcome %q, want failed", o.res[0].Outcome)
	}
	if r := o.res[0].Reason; !strings.Contains(r, "session ended") && !strings.Contains(r, "could not be set up") {
		t.Errorf("reason %q, want the session's end or the new path's failure", r)
	}
	// The transfer's ends saw the reset.
	for _, ch := range []chan error{x.clientErr, x.serverErr} {
		select {
		case err := <-ch:
			t.Logf("reset transfer: %v", err)
		case <-time.After(30 * time.Second):
			t.Fatal("the reset transfer did not end")
		}
	}
	// The session is gone everywhere.
	for _, h := range []string{"client", "mb1", "server"} {
		testutil.Eventually(t, 15*time.Second, "the reset session to go at "+h, func() bool { _, ok := e.ctlSession(h, port); return !ok })
	}

	// A new session through mb1: mb1 can be deleted from it at once.
	y := e.ctlStartTransfer("client", "server", dst, port2, 64*mib, 4*mib)
	testutil.Eventually(t, 30*time.Second, "the second transfer to start", func() bool { return y.received.Load() > mib })
	e.ctlMustSession("mb1", port2)
	res, err := e.ctlReconfig("client", 10*time.Second, fmt.Sprintf("tcp port %d", port2), dst)
	if err != nil {
		t.Fatal(err)
	}
	if len(res) != 1 || res[0].Outcome != "succeeded" {
		t.Fatalf("delete mb1 from a new session: %+v", res)
	}
	t.Logf("delete mb1 from a new session: %.2f ms", float64(res[0].Micros)/1000)
	testutil.Eventually(t, 15*time.Second, "mb1 to leave the new session's path", func() bool { _, ok := e.ctlSession("mb1", port2); return !ok })
	if y.received.Load() >= 64*mib {
		t.Fatal("the second transfer ended before the reconfiguration: pace it slower")
	}
	y.finish(t)
}
