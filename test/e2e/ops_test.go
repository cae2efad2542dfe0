package e2e

import (
	"crypto/sha256"
	"encoding/binary"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/dysco/dysco/internal/agent"
	"github.com/dysco/dysco/internal/lab"
	"github.com/dysco/dysco/internal/testutil"
	"github.com/dysco/dysco/internal/wire"
	"github.com/gopacket/gopacket"
	"github.com/gopacket/gopacket/layers"
	"golang.org/x/sys/unix"
)

// TestManySessions holds 10,000 sessions open at once through one chain.
func TestManySessions(t *testing.T) {
	n := 10000
	if testing.Short() {
		n = 2000
	}
	if limit := raiseFileLimit(); limit < uint64(n)+1000 {
		t.Fatalf("the open file limit is %d; %d sessions need more", limit, n)
	}
	e := newLab(t, labOpts{topology: lab.Star("client", "mb1", "server")})
	e.run("server", "sysctl", "-qw", "net.core.somaxconn=8192", "net.ipv4.tcp_max_syn_backlog=16384")
	dst := e.addr("server", false)
	e.policy("client", "many", "tcp dst port 9100", e.addr("mb1", false).String())

	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	srv := netip.AddrPortFrom(dst, 9100)
	if _, err := e.lab.Start("server", "echo", "env", "DYSCO_E2E_ECHO="+srv.String(), self); err != nil {
		t.Fatal(err)
	}
	testutil.Eventually(t, 10*time.Second, "the echo server to listen", func() bool {
		c, err := e.dial("server", srv, time.Second)
		if err == nil {
			c.Close()
		}
		return err == nil
	})
	base := e.status("mb1").Counters["setup_cont"]
	conns := make([]net.Conn, n)
	var failed atomic.Int64
	var firstErr atomic.Value
	sem := make(chan struct{}, 128)
	var wg sync.WaitGroup
	start := time.Now()
	for i := 0; i < n; i++ {
		wg.Add(1)
		sem <- struct{}{}
		go func(i int) {
			defer wg.Done()
			defer func() { <-sem }()
			c, err := e.dial("client", netip.AddrPortFrom(dst, 9100), 20*time.Second)
			if err == nil {
				var msg [8]byte
				binary.BigEndian.PutUint64(msg[:], uint64(i))
				var back [8]byte
				if _, err = c.Write(msg[:]); err == nil {
					c.SetReadDeadline(time.Now().Add(20 * time.Second))
					_, err = io.ReadFull(c, back[:])
					if err == nil && back != msg {
						err = fmt.Errorf("echo of session %d came back as %x", i, back)
					}
				}
			}
			if err != nil {
				failed.Add(1)
				firstErr.CompareAndSwap(nil, err)
				if c != nil {
					c.Close()
				}
				return
			}
			conns[i] = c
		}(i)
	}
	wg.Wait()
	t.Logf("%d sessions opened and echoed in %v", n, time.Since(start).Round(time.Millisecond))
	if f := failed.Load(); f > 0 {
		t.Fatalf("%d of %d sessions failed; first error: %v", f, n, firstErr.Load())
	}
	if got := e.status("mb1").Sessions; got < n {
		t.Errorf("mb1 holds %d sessions, want at least %d open at once", got, n)
	}
	if got := e.status("mb1").Counters["setup_cont"] - base; got != uint64(n) {
		t.Errorf("mb1 continued %d chains, want %d", got, n)
	}
	for _, c := range conns {
		c.Close()
	}
	for _, h := range []string{"client", "mb1", "server"} {
		testutil.Eventually(t, 60*time.Second, "sessions on "+h+" to be collected", func() bool { return e.status(h).Sessions == 0 })
	}
	for _, h := range []string{"client", "mb1", "server"} {
		st := e.status(h)
		for k, v := range st.Counters {
			if strings.HasPrefix(k, "drop_") && v != 0 {
				t.Errorf("%s: %s = %d", h, k, v)
			}
		}
	}
}

// TestAgentRestart restarts the agents of the client and the middlebox while
// a transfer runs in both directions: the pinned datapath carries the
// session on, and not a byte is lost.
func TestAgentRestart(t *testing.T) {
	e := newLab(t, labOpts{topology: lab.Star("client", "mb1", "server")})
	dst := e.addr("server", false)
	e.policy("client", "r", "tcp dst portrange 9200-9201", e.addr("mb1", false).String())

	const total = 64 * mib
	ln := e.listen("server", netip.AddrPortFrom(dst, 9200))
	serverErr := make(chan error, 1)
	var received atomic.Int64
	go func() {
		c, err := ln.Accept()
		if err != nil {
			serverErr <- err
			return
		}
		defer c.Close()
		serverErr <- transfer(countingConn{c, &received}, 2, 1, total)
	}()
	c, err := e.dial("client", netip.AddrPortFrom(dst, 9200), 10*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	clientErr := make(chan error, 1)
	// 16 MiB/s, slowed to a trickle after 8 MiB until the agents are back:
	// however long the restarts take, data flows through them and most of
	// the transfer comes after.
	restarted := make(chan struct{})
	go func() {
		clientErr <- transfer(&slowedConn{Conn: c, fast: 16 * mib, slow: 256 << 10, at: 8 * mib, until: restarted}, 1, 2, total)
	}()

	// Restart once data flows, and check that it flows on afterwards.
	testutil.Eventually(t, 30*time.Second, "the transfer to start", func() bool { return received.Load() > 4*mib })
	for _, h := range []string{"mb1", "client"} {
		if err := e.lab.RestartAgent(h); err != nil {
			t.Fatalf("restart agent on %s: %v", h, err)
		}
	}
	if got := received.Load(); got >= total {
		t.Fatalf("the transfer ended before the agents restarted (%d bytes received)", got)
	}
	close(restarted)
	for _, ch := range []chan error{clientErr, serverErr} {
		select {
		case err := <-ch:
			if err != nil {
				t.Fatal(err)
			}
		case <-time.After(2 * time.Minute):
			t.Fatal("transfer did not finish")
		}
	}
	if len(e.sessions("mb1")) == 0 && e.status("mb1").Counters["rewrite_in"] == 0 {
		t.Error("the restarted agent on mb1 sees no trace of the session")
	}
	// The restarted agent reads the hold ring and renews its lease for
	// packets straddling a cut-off (docs/protocol.md, "Two paths"): what is
	// left of it grows again within a renewal's period.
	prev := e.status("client").Counters["split_lease_ms"]
	if prev == 0 || prev > 3000 {
		t.Errorf("the restarted client agent's split lease has %d ms left, want 1..3000", prev)
	}
	testutil.Eventually(t, 10*time.Second, "the client agent to renew its split lease", func() bool {
		left := e.status("client").Counters["split_lease_ms"]
		renewed := left > prev
		prev = left
		return renewed
	})
	// A session begun right after the restart is chained: the restarted
	// agent installed its policies before swapping its programs in.
	base := e.status("mb1").Counters["setup_cont"]
	e.exchange("client", "server", dst, 9201, mib)
	if got := e.status("mb1").Counters["setup_cont"]; got != base+1 {
		t.Errorf("a session after the restart did not go through mb1 (setup_cont %d -> %d)", base, got)
	}
}

type countingConn struct {
	net.Conn
	n *atomic.Int64
}

func (c countingConn) CloseWrite() error { return c.Conn.(*net.TCPConn).CloseWrite() }

func (c pacedConn) CloseWrite() error {
	if cw, ok := c.Conn.(interface{ CloseWrite() error }); ok {
		return cw.CloseWrite()
	}
	return nil
}

func (c countingConn) Read(p []byte) (int, error) {
	n, err := c.Conn.Read(p)
	c.n.Add(int64(n))
	return n, err
}

// slowedConn writes at about fast bytes per second, but at slow from the
// moment at bytes are written until until is closed: a transfer that must
// run through a step of the test, however long the step takes on a loaded
// machine, without either stopping or ending before it.
type slowedConn struct {
	net.Conn
	fast, slow, at int64
	until          <-chan struct{}
	written        int64 // by the one writing goroutine only
}

func (c *slowedConn) rate() int64 {
	if c.written < c.at {
		return c.fast
	}
	select {
	case <-c.until:
		return c.fast
	default:
		return c.slow
	}
}

func (c *slowedConn) Write(p []byte) (int, error) {
	n, err := pacedWrite(c.Conn, p, c.rate)
	c.written += int64(n)
	return n, err
}

func (c *slowedConn) CloseWrite() error { return pacedConn{Conn: c.Conn}.CloseWrite() }

// pacedConn writes at about rate bytes per second, so that a transfer lasts
// long enough to restart agents in its middle.
type pacedConn struct {
	net.Conn
	rate int64
}

func (c pacedConn) Write(p []byte) (int, error) {
	return pacedWrite(c.Conn, p, func() int64 { return c.rate })
}

// pacedWrite writes p at about rate() bytes per second, in chunks of what
// 2 ms at that rate carry (4 to 64 KiB; rate is read before each chunk, so
// that it may change meanwhile). Short gaps: a test that needs packets in a
// window of a few milliseconds (a migration's hold) gets them, where 64 KiB
// bursts 10 ms apart at 6 MiB/s could leave such a window empty.
func pacedWrite(c net.Conn, p []byte, rate func() int64) (int, error) {
	done := 0
	for done < len(p) {
		chunk := int(min(max(rate()/500, 4<<10), 64<<10))
		end := min(done+chunk, len(p))
		n, err := c.Write(p[done:end])
		done += n
		if err != nil {
			return done, err
		}
		time.Sleep(time.Duration(int64(n) * int64(time.Second) / rate()))
	}
	return done, nil
}

// TestPolicyServer: agents take their policies from the policy server, and
// keep chaining new sessions while it is down, also after a restart.
func TestPolicyServer(t *testing.T) {
	router := "10.200.1.1" // the router's address on the client's link
	url := "https://" + router + ":7017"
	pki := mgmtPKI(t, router, "client", "mb1", "server")
	e := newLab(t, labOpts{topology: lab.Star("client", "mb1", "server"), agentArgs: []string{"--policy-server", url, "--pki-dir", pki}})
	ps := e.startPolicyServer(router, pki)
	dst := e.addr("server", false)
	e.dysco("client", "policy", "add", "central", "--server", url, "--pki-dir", pki, "--chain", e.addr("mb1", false).String(), "tcp dst portrange 9300-9309")
	testutil.Eventually(t, 20*time.Second, "the client agent to get the policy", func() bool { return e.status("client").PolicyVersion >= 1 })

	through := func() uint64 { return e.status("mb1").Counters["setup_cont"] }
	base := through()
	e.exchange("client", "server", dst, 9300, mib)
	if through() != base+1 {
		t.Fatalf("the session did not go through mb1 (setup_cont %d -> %d)", base, through())
	}
	if err := ps.Stop(); err != nil {
		t.Logf("policy server stop: %v", err)
	}
	testutil.Eventually(t, 20*time.Second, "the client agent to notice the server is down", func() bool { return !e.status("client").PolicyServerOK })
	e.exchange("client", "server", dst, 9301, mib)
	if through() != base+2 {
		t.Fatalf("with the server down, the session did not go through mb1")
	}
	if err := e.lab.RestartAgent("client"); err != nil {
		t.Fatal(err)
	}
	e.exchange("client", "server", dst, 9302, mib)
	if through() != base+3 {
		t.Fatalf("after an agent restart with the server down, the session did not go through mb1")
	}
}

// TestBadSYNs sends forged and malformed Dysco SYNs to a middlebox host: each
// is dropped and counted, and no state is left.
func TestBadSYNs(t *testing.T) {
	e := newLab(t, labOpts{topology: lab.Star("client", "mb1", "server")})
	src, mb, dst := e.addr("client", false), e.addr("mb1", false), e.addr("server", false)
	good := wire.SynBlock{Session: wire.Tuple{Src: src, Dst: dst, SrcPort: 40000, DstPort: 80}, Hops: []netip.Addr{dst}}
	enc := func(b wire.SynBlock) []byte {
		p, err := b.Encode(nil)
		if err != nil {
			t.Fatal(err)
		}
		return p
	}
	mut := func(f func([]byte) []byte) []byte { return f(enc(good)) }
	cases := []struct {
		name    string
		block   []byte
		optLen  int // the length the option announces; -1: the block's own
		counter string
	}{
		{"bad magic", mut(func(p []byte) []byte { p[0] ^= 0xff; return p }), -1, "drop_bad_magic"},
		{"unknown version", mut(func(p []byte) []byte { p[4] = 7; return p }), -1, "drop_bad_version"},
		{"too many hops", mut(func(p []byte) []byte { p[6] = 9; return p }), -1, "drop_too_many_hops"},
		{"hop count vs length", mut(func(p []byte) []byte { p[6] = 2; return p }), -1, "drop_bad_length"},
		{"option vs payload", enc(good), 200, "drop_bad_length"},
		{"truncated", enc(good)[:40], -1, "drop_bad_length"},
		{"loop through this host", enc(wire.SynBlock{Session: good.Session, Hops: []netip.Addr{mb, dst}}), -1, "drop_loop"},
		{"zero port", mut(func(p []byte) []byte { p[48], p[49] = 0, 0; return p }), -1, "drop_bad_session"},
	}
	// Each block is signed for its subsession with the lab's key, so that
	// it is admitted and the check meant refuses it.
	key, err := agent.SynMACKey(e.secret())
	if err != nil {
		t.Fatal(err)
	}
	for i, c := range cases {
		before := e.status("mb1").Counters[c.counter]
		l := c.optLen
		if l < 0 {
			l = len(c.block)
		}
		wire.SignBlock(key, c.block, wire.Tuple{Src: src, Dst: mb, SrcPort: uint16(30000 + i), DstPort: 20000})
		e.sendRawSYN("client", src, mb, uint16(30000+i), 20000, l, c.block)
		testutil.Eventually(t, 5*time.Second, c.name+" to be counted as "+c.counter, func() bool {
			return e.status("mb1").Counters[c.counter] > before
		})
	}
	if s := e.sessions("mb1"); len(s) != 0 {
		t.Errorf("bad SYNs left sessions on mb1: %+v", s)
	}
	// The agent is still well: a real chain works.
	e.policy("client", "ok", "tcp dst port 9400", mb.String())
	e.exchange("client", "server", dst, 9400, mib)
}

// sendRawSYN sends, from host, an IPv4 SYN to dst carrying the Dysco marking
// option announcing optLen bytes, and block as payload.
func (e *env) sendRawSYN(host string, src, dst netip.Addr, sport, dport uint16, optLen int, block []byte) {
	e.t.Helper()
	opt := wire.Option(optLen)
	ip := &layers.IPv4{Version: 4, TTL: 64, Protocol: layers.IPProtocolTCP, SrcIP: src.AsSlice(), DstIP: dst.AsSlice()}
	tcp := &layers.TCP{SrcPort: layers.TCPPort(sport), DstPort: layers.TCPPort(dport), SYN: true, Seq: 1, Window: 64240,
		Options: []layers.TCPOption{{OptionType: layers.TCPOptionKind(opt[0]), OptionLength: opt[1], OptionData: opt[2:]}}}
	tcp.SetNetworkLayerForChecksum(ip)
	buf := gopacket.NewSerializeBuffer()
	if err := gopacket.SerializeLayers(buf, gopacket.SerializeOptions{FixLengths: true, ComputeChecksums: true}, ip, tcp, gopacket.Payload(block)); err != nil {
		e.t.Fatal(err)
	}
	err := e.inNS(host, func() error {
		fd, err := unix.Socket(unix.AF_INET, unix.SOCK_RAW, unix.IPPROTO_RAW)
		if err != nil {
			return err
		}
		defer unix.Close(fd)
		sa := &unix.SockaddrInet4{Addr: dst.As4()}
		return unix.Sendto(fd, buf.Bytes(), 0, sa)
	})
	if err != nil {
		e.t.Fatalf("raw send from %s: %v", host, err)
	}
}

// TestRerouteSettled: on a host that does not forward, the agent finds from
// the routes that a subsession leaves by the same next hop as its session,
// and stops the per-packet re-routing; a route change makes it decide again.
// Data flows throughout.
func TestRerouteSettled(t *testing.T) {
	e := newLab(t, labOpts{topology: lab.Star("client", "mb1", "server")})
	dst := e.addr("server", false)
	e.policy("client", "s", "tcp dst port 9900", e.addr("mb1", false).String())
	ln := e.listen("server", netip.AddrPortFrom(dst, 9900))
	srvErr := make(chan error, 1)
	go func() {
		c, err := ln.Accept()
		if err != nil {
			srvErr <- err
			return
		}
		defer c.Close()
		for i := uint64(0); i < 3; i++ {
			if err := transferOnce(c, 100+i, 200+i, mib); err != nil {
				srvErr <- err
				return
			}
		}
		srvErr <- nil
	}()
	c, err := e.dial("client", netip.AddrPortFrom(dst, 9900), 10*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	step := func(i uint64) {
		t.Helper()
		if err := transferOnce(c, 200+i, 100+i, mib); err != nil {
			t.Fatalf("exchange %d: %v", i, err)
		}
	}
	step(0)
	settled := func() uint64 { return e.status("client").Counters["agent_reroutes_settled"] }
	testutil.Eventually(t, 10*time.Second, "the client's agent to settle the re-routing", func() bool { return settled() >= 1 })
	step(1)
	before := settled()
	e.run("client", "ip", "route", "add", e.addr("mb1", false).String()+"/32", "via", e.host("client").Gateway4.String())
	testutil.Eventually(t, 10*time.Second, "the client's agent to decide again after the route change", func() bool { return settled() > before })
	step(2)
	if err := <-srvErr; err != nil {
		t.Fatal(err)
	}
}

// transferOnce sends n bytes of stream sendSeed and reads n bytes that must
// hash like stream recvSeed, on a connection that stays open.
func transferOnce(c net.Conn, sendSeed, recvSeed uint64, n int64) error {
	werr := make(chan error, 1)
	go func() {
		_, err := io.Copy(c, io.LimitReader(newStream(sendSeed), n))
		werr <- err
	}()
	h := sha256.New()
	if _, err := io.CopyN(h, c, n); err != nil {
		return err
	}
	if err := <-werr; err != nil {
		return err
	}
	return checkStream(h, recvSeed, n)
}

// TestTupleReuse: a client that reuses its port right after a session ended
// (the server closed first, so the client has no TIME_WAIT) gets a new
// chained session at once, not a SYN taken for a retransmission of the old
// one and dropped.
func TestTupleReuse(t *testing.T) {
	e := newLab(t, labOpts{topology: lab.Star("client", "mb1", "server")})
	dst := e.addr("server", false)
	e.policy("client", "reuse", "tcp dst port 9990", e.addr("mb1", false).String())
	ln := e.listen("server", netip.AddrPortFrom(dst, 9990))
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				c.Write([]byte("hello"))
				// Outlive the agents' close linger (1 s here) and a
				// collector pass: a session mistaken for the ended one
				// would be collected under the live connection.
				time.Sleep(2500 * time.Millisecond)
				c.Write([]byte("world"))
				c.Close() // the server closes first
			}()
		}
	}()
	local := netip.AddrPortFrom(e.addr("client", false), 45678)
	for i := 0; i < 3; i++ {
		var c net.Conn
		start := time.Now()
		err := e.inNS("client", func() error {
			d := net.Dialer{Timeout: 5 * time.Second, LocalAddr: net.TCPAddrFromAddrPort(local),
				Control: func(_, _ string, rc syscall.RawConn) error {
					var serr error
					rc.Control(func(fd uintptr) { serr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_REUSEADDR, 1) })
					return serr
				}}
			var err error
			c, err = d.Dial("tcp", netip.AddrPortFrom(dst, 9990).String())
			return err
		})
		if err != nil {
			t.Fatalf("connection %d from %s: %v", i, local, err)
		}
		b, _ := io.ReadAll(c)
		c.Close()
		if string(b) != "helloworld" {
			t.Fatalf("connection %d read %q", i, b)
		}
		if took := time.Since(start); took > 3500*time.Millisecond {
			t.Errorf("connection %d took %v: its SYN was not taken at once", i, took)
		}
		// Wait until the client's agent has seen both FINs of this session.
		testutil.Eventually(t, 5*time.Second, "the session to close", func() bool {
			for _, s := range e.sessions("client") {
				if s.State != "closed" && s.State != "reset" {
					return false
				}
			}
			return true
		})
	}
	if n := e.status("client").Counters["reused"]; n < 2 {
		t.Errorf("the client's agent freed %d ended sessions for reuse, want 2", n)
	}
}
