package e2e

// Admission of Dysco SYNs (paper §2.3 "Security"): a middlebox sets up a
// session only for a SYN whose block carries a valid MAC under the
// deployment's key, or that comes from a --trusted prefix. Forged blocks
// made from a captured real SYN, a host with another key, and a flood of
// valid SYNs from one source are refused and counted, while real sessions
// through the same middlebox go on.

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/dysco/dysco/internal/agent"
	"github.com/dysco/dysco/internal/lab"
	"github.com/dysco/dysco/internal/testutil"
	"github.com/dysco/dysco/internal/wire"
)

// counter returns one datapath counter of host.
func (e *env) counter(host, name string) uint64 {
	e.t.Helper()
	c, ok := e.status(host).Counters[name]
	if !ok {
		e.t.Fatalf("%s: no counter %s", host, name)
	}
	return c
}

// synPacket is an IPv4 TCP SYN as it travels between hosts.
type synPacket struct {
	src, dst         netip.Addr
	sport, dport     uint16
	seq              uint32
	opts, payload    []byte // TCP options (a multiple of 4 bytes) and payload
	ipID             uint16
	window, ttl, tos uint8
}

// parseSYN reads an IPv4 packet (from its IP header) holding a TCP SYN.
func parseSYN(b []byte) (synPacket, error) {
	if len(b) < 20 || b[0]>>4 != 4 || b[9] != unix.IPPROTO_TCP {
		return synPacket{}, errors.New("not IPv4 TCP")
	}
	ihl := int(b[0]&0xf) * 4
	total := int(binary.BigEndian.Uint16(b[2:]))
	if total > len(b) || ihl+20 > total {
		return synPacket{}, errors.New("truncated")
	}
	t := b[ihl:total]
	doff := int(t[12]>>4) * 4
	if doff < 20 || doff > len(t) || t[13]&0x12 != 0x02 {
		return synPacket{}, errors.New("not a SYN")
	}
	return synPacket{
		src: netip.AddrFrom4([4]byte(b[12:16])), dst: netip.AddrFrom4([4]byte(b[16:20])),
		sport: binary.BigEndian.Uint16(t[0:]), dport: binary.BigEndian.Uint16(t[2:]), seq: binary.BigEndian.Uint32(t[4:]),
		opts: append([]byte(nil), t[20:doff]...), payload: append([]byte(nil), t[doff:]...), ipID: binary.BigEndian.Uint16(b[4:]),
		ttl: 64,
	}, nil
}

// block returns the Dysco SYN block the packet carries, if any.
func (p synPacket) block() ([]byte, bool) {
	o := p.opts
	if len(o) < wire.OptLen || o[len(o)-8] != wire.OptKind || o[len(o)-4] != wire.OptTypeSYNBlock {
		return nil, false
	}
	return p.payload, len(p.payload) >= wire.BlockHeaderLen
}

func (p synPacket) sub() wire.Tuple {
	return wire.Tuple{Src: p.src, Dst: p.dst, SrcPort: p.sport, DstPort: p.dport}
}

// bytes encodes the packet, TCP checksum included (the kernel fills the IP
// header's checksum and length of a raw socket's packet).
func (p synPacket) bytes() []byte {
	tl := 20 + len(p.opts) + len(p.payload)
	b := make([]byte, 20+tl)
	b[0], b[8], b[9] = 0x45, 64, unix.IPPROTO_TCP
	binary.BigEndian.PutUint16(b[2:], uint16(len(b)))
	binary.BigEndian.PutUint16(b[4:], p.ipID)
	binary.BigEndian.PutUint16(b[6:], 0x4000)
	s, d := p.src.As4(), p.dst.As4()
	copy(b[12:], s[:])
	copy(b[16:], d[:])
	t := b[20:]
	binary.BigEndian.PutUint16(t[0:], p.sport)
	binary.BigEndian.PutUint16(t[2:], p.dport)
	binary.BigEndian.PutUint32(t[4:], p.seq)
	t[12] = byte((20 + len(p.opts)) / 4 << 4)
	t[13] = 0x02
	binary.BigEndian.PutUint16(t[14:], 64240)
	copy(t[20:], p.opts)
	copy(t[20+len(p.opts):], p.payload)
	// Pseudo header, then the segment.
	sum := uint32(0)
	add := func(x []byte) {
		for i := 0; i+1 < len(x); i += 2 {
			sum += uint32(binary.BigEndian.Uint16(x[i:]))
		}
		if len(x)%2 == 1 {
			sum += uint32(x[len(x)-1]) << 8
		}
	}
	add(b[12:20])
	sum += unix.IPPROTO_TCP + uint32(tl)
	add(t)
	for sum>>16 != 0 {
		sum = sum&0xffff + sum>>16
	}
	binary.BigEndian.PutUint16(t[16:], ^uint16(sum))
	return b
}

// sendRaw sends IPv4 packets from host through a raw socket: the packets'
// own source addresses and ports, whatever the host's sockets.
func (e *env) sendRaw(host string, pkts ...[]byte) {
	e.t.Helper()
	err := e.inNS(host, func() error {
		fd, err := unix.Socket(unix.AF_INET, unix.SOCK_RAW, unix.IPPROTO_RAW)
		if err != nil {
			return err
		}
		defer unix.Close(fd)
		for _, p := range pkts {
			to := &unix.SockaddrInet4{Addr: [4]byte(p[16:20])}
			for {
				err := unix.Sendto(fd, p, 0, to)
				if errors.Is(err, unix.ENOBUFS) {
					continue // the qdisc is full: wait for room, as TCP would
				}
				if err != nil {
					return err
				}
				break
			}
		}
		return nil
	})
	if err != nil {
		e.t.Fatalf("raw send from %s: %v", host, err)
	}
}

// captureSYN opens a packet socket on host and returns a function that
// waits for the first Dysco SYN arriving there whose block carries a
// session to port (a real one, as a client's agent sent it).
func (e *env) captureSYN(host string, port uint16) func() synPacket {
	e.t.Helper()
	var fd int
	err := e.inNS(host, func() error {
		var err error
		// ETH_P_ALL: such sockets see a packet before tc ingress, where
		// the block is still in it (a socket of ETH_P_IP sees it after).
		fd, err = unix.Socket(unix.AF_PACKET, unix.SOCK_DGRAM, int(htons(unix.ETH_P_ALL)))
		if err != nil {
			return err
		}
		tv := unix.Timeval{Usec: 200000}
		return unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv)
	})
	if err != nil {
		e.t.Fatalf("packet socket on %s: %v", host, err)
	}
	return func() synPacket {
		e.t.Helper()
		defer unix.Close(fd)
		buf := make([]byte, 2048)
		deadline := time.Now().Add(20 * time.Second)
		for time.Now().Before(deadline) {
			n, from, err := unix.Recvfrom(fd, buf, 0)
			if err != nil {
				continue // the receive timeout: look at the deadline
			}
			if ll, ok := from.(*unix.SockaddrLinklayer); ok && ll.Pkttype == unix.PACKET_OUTGOING {
				continue
			}
			p, err := parseSYN(buf[:n])
			if err != nil {
				continue
			}
			if blk, ok := p.block(); ok {
				if b, err := wire.Decode(blk); err == nil && b.Session.DstPort == port {
					return p
				}
			}
		}
		e.t.Fatalf("no Dysco SYN of a session to port %d arrived at %s", port, host)
		return synPacket{}
	}
}

func htons(v uint16) uint16 { return v<<8 | v>>8 }

// TestAdmissionForgedSYN: blocks made from a captured real SYN — with a
// wrong MAC, with the session altered, replayed from another address — and
// the SYNs of a host whose agent has another key are dropped by the
// middlebox and counted (drop_bad_mac), no session is made for them, and
// real sessions through the same middlebox still work.
func TestAdmissionForgedSYN(t *testing.T) {
	other := filepath.Join(t.TempDir(), "other.key")
	if err := os.WriteFile(other, []byte(strings.Repeat("ab", 32)+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	e := newLab(t, labOpts{
		topology: lab.Star("client", "client2", "client3", "mb1", "server"),
		hostArgs: map[string][]string{"client3": {"--control-key-file", other}},
	})
	dst, mb := e.addr("server", false), e.addr("mb1", false)
	for _, h := range []string{"client", "client3"} {
		e.policy(h, "web", "tcp and (dst port 9000 or dst port 9001)", mb.String())
	}
	if got := e.status("mb1").Admission; got != "MAC (deployment key)" {
		t.Errorf("mb1 admission %q, want a MAC", got)
	}

	// A real session, and its SYN as it arrived at the middlebox.
	capture := e.captureSYN("mb1", 9000)
	e.exchange("client", "server", dst, 9000, 64<<10)
	real := capture()
	blk, _ := real.block()
	if key, err := agent.SynMACKey(e.secret()); err != nil || !wire.VerifyBlock(key, blk, real.sub()) {
		t.Fatalf("the captured SYN's block does not verify under the lab's SYN key (%v)", err)
	}
	setups := e.counter("mb1", "setup_cont")
	bad := e.counter("mb1", "drop_bad_mac")
	sessions := len(e.sessions("mb1"))

	// Forgeries of it. Each is sent from a subsession the middlebox has
	// not seen (another source port), so that none is a retransmission.
	forged := func(port uint16, f func(p *synPacket)) []byte {
		p := real
		p.sport = port
		p.payload = append([]byte(nil), real.payload...)
		f(&p)
		return p.bytes()
	}
	wrongMAC := forged(real.sport+1, func(p *synPacket) {
		wire.SignBlock(wire.MACKey{1, 2, 3}, p.payload, p.sub()) // a key of no member
	})
	rewritten := forged(real.sport+2, func(p *synPacket) {
		// Signed for its own subsession, then its session pointed elsewhere.
		key, _ := agent.SynMACKey(e.secret())
		wire.SignBlock(key, p.payload, p.sub())
		binary.BigEndian.PutUint16(p.payload[50:], 9001)
	})
	asIs := forged(real.sport+3, func(*synPacket) {}) // the MAC of another subsession
	replayed := real
	replayed.src = e.addr("client2", false) // the same bytes, from another host
	e.sendRaw("client", wrongMAC, rewritten, asIs)
	e.sendRaw("client2", replayed.bytes())
	testutil.Eventually(t, 5*time.Second, "the middlebox to drop the four forged SYNs", func() bool {
		return e.counter("mb1", "drop_bad_mac") >= bad+4
	})
	if got := e.counter("mb1", "drop_bad_mac") - bad; got != 4 {
		t.Errorf("drop_bad_mac moved by %d for four forged SYNs", got)
	}

	// A host whose agent has another key: its SYNs are refused, its
	// connect() fails.
	if c, err := e.dial("client3", netip.AddrPortFrom(dst, 9001), 2*time.Second); err == nil {
		c.Close()
		t.Fatal("a host with another key set up a session through the middlebox")
	}
	if got := e.counter("mb1", "drop_bad_mac") - bad; got < 5 {
		t.Errorf("drop_bad_mac moved by %d, want the forged SYNs and client3's", got)
	}
	if got := e.counter("mb1", "setup_cont"); got != setups {
		t.Errorf("setup_cont moved by %d for refused SYNs", got-setups)
	}
	if got := len(e.sessions("mb1")); got > sessions {
		t.Errorf("mb1 holds %d sessions, %d before the forged SYNs", got, sessions)
	}

	// The real client's sessions through the same middlebox still work.
	e.exchange("client", "server", dst, 9001, 64<<10)
	if got := e.counter("mb1", "setup_cont"); got != setups+1 {
		t.Errorf("setup_cont moved by %d for one real session", got-setups)
	}
}

// TestAdmissionHalfOpenFlood: a flood of well-formed Dysco SYNs with valid
// MACs from one source (many session tuples, towards a destination that
// never answers) fills that source's budget of half-open sessions at the
// middlebox, not its session map: the rest is dropped and counted
// (drop_half_open), and another source's chained sessions go on.
func TestAdmissionHalfOpenFlood(t *testing.T) {
	const budget, flood = 100, 600
	e := newLab(t, labOpts{
		topology: lab.Star("client", "client2", "mb1", "server"),
		// Flood sessions stay half-open for the whole test.
		hostArgs: map[string][]string{"mb1": {"--half-open-per-source", fmt.Sprint(budget), "--half-open-timeout", "5m"}},
	})
	dst, mb, src := e.addr("server", false), e.addr("mb1", false), e.addr("client", false)
	e.policy("client2", "web", "tcp dst portrange 9000-9009", mb.String())
	key, err := agent.SynMACKey(e.secret())
	if err != nil {
		t.Fatal(err)
	}
	// A destination in the server's subnet that nobody holds: the plain
	// SYNs the middlebox sends on are never answered.
	nobody := netip.AddrFrom4(func() [4]byte { a := dst.As4(); a[3] = 99; return a }())
	pkts := make([][]byte, flood)
	for i := range pkts {
		b := wire.SynBlock{
			Session: wire.Tuple{Src: netip.AddrFrom4([4]byte{10, 77, byte(i >> 8), byte(i)}), Dst: nobody, SrcPort: uint16(30000 + i), DstPort: 80},
			Nonce:   [wire.NonceLen]byte{byte(i), byte(i >> 8), 0x5e},
		}
		blk, err := b.Encode(nil)
		if err != nil {
			t.Fatal(err)
		}
		p := synPacket{src: src, dst: mb, sport: uint16(20000 + i), dport: 45000, seq: uint32(i) * 7919, payload: blk}
		wire.SignBlock(key, p.payload, p.sub())
		o := wire.Option(len(blk))
		p.opts = append([]byte{2, 4, 0x05, 0xb4}, o[:]...) // MSS, then the marking option
		pkts[i] = p.bytes()
	}
	ended := e.counter("mb1", "setup_end")
	over := e.counter("mb1", "drop_half_open")
	e.sendRaw("client", pkts...)
	testutil.Eventually(t, 10*time.Second, "the middlebox to take the flood", func() bool {
		return e.counter("mb1", "setup_end")+e.counter("mb1", "drop_half_open") >= ended+over+flood
	})
	if got := e.counter("mb1", "setup_end") - ended; got != budget {
		t.Errorf("the flood set up %d sessions, want the budget %d", got, budget)
	}
	if got := e.counter("mb1", "drop_half_open") - over; got != flood-budget {
		t.Errorf("drop_half_open moved by %d, want %d", got, flood-budget)
	}
	if got := len(e.sessions("mb1")); got > budget+1 {
		t.Errorf("mb1 holds %d sessions after the flood, want at most the budget %d", got, budget)
	}

	// Another source's chained sessions are set up meanwhile.
	setups := e.counter("mb1", "setup_cont")
	for i := range 3 {
		e.exchange("client2", "server", dst, uint16(9000+i), 64<<10)
	}
	if got := e.counter("mb1", "setup_cont") - setups; got != 3 {
		t.Errorf("client2 set up %d sessions through mb1, want 3", got)
	}
}

// TestAdmissionTrusted: --trusted admits Dysco SYNs from its prefixes at a
// host without a deployment key and refuses the others (drop_untrusted); a
// host with a key admits a valid MAC or a trusted source; a host with
// neither a key nor trusted prefixes refuses every Dysco SYN from the
// network, and says so when it starts.
func TestAdmissionTrusted(t *testing.T) {
	// Star addressing: the i-th host is 10.200.i.2.
	const clientA, mb1A = "10.200.1.2", "10.200.3.2"
	e := newLab(t, labOpts{
		topology: lab.Star("client", "client2", "mb1", "mb2", "server"),
		hostArgs: map[string][]string{
			"mb1":    {"--control-key-file", "", "--trusted", clientA},
			"mb2":    {"--control-key-file", ""},
			"server": {"--trusted", mb1A + "/32"}, // mb1 has no key: its SYNs carry no MAC
		},
	})
	if e.addr("client", false).String() != clientA || e.addr("mb1", false).String() != mb1A {
		t.Fatalf("lab addresses changed: client %s, mb1 %s", e.addr("client", false), e.addr("mb1", false))
	}
	dst, mb1, mb2 := e.addr("server", false), e.addr("mb1", false), e.addr("mb2", false)
	e.policy("client", "via-mb1", "tcp dst port 9000", mb1.String())
	e.policy("client", "via-mb2", "tcp dst port 9002", mb2.String())
	e.policy("client2", "via-mb1", "tcp dst port 9000", mb1.String())
	for host, want := range map[string]string{
		"mb1":    "trusted sources only (1 prefixes)",
		"mb2":    "none (no deployment key, no trusted prefixes): Dysco SYNs from other hosts are refused",
		"server": "MAC or trusted source (1 prefixes)",
	} {
		if got := e.status(host).Admission; got != want {
			t.Errorf("%s admission %q, want %q", host, got, want)
		}
	}
	log, err := os.ReadFile(filepath.Join(e.lab.RunDir(), "mb2.agent.log"))
	if err != nil || !strings.Contains(string(log), "Dysco SYNs from other hosts are refused") {
		t.Errorf("mb2's agent did not warn that it admits no Dysco SYN (%v):\n%s", err, log)
	}

	// From the trusted prefix: admitted at mb1, and at the server (which
	// trusts mb1).
	e.exchange("client", "server", dst, 9000, 64<<10)

	// From outside it: refused at mb1.
	untrusted := e.counter("mb1", "drop_untrusted")
	setups := e.counter("mb1", "setup_cont")
	if c, err := e.dial("client2", netip.AddrPortFrom(dst, 9000), 2*time.Second); err == nil {
		c.Close()
		t.Fatal("a host outside --trusted set up a session through mb1")
	}
	if e.counter("mb1", "drop_untrusted") == untrusted || e.counter("mb1", "setup_cont") != setups {
		t.Error("mb1 did not refuse and count the SYNs of a host outside --trusted")
	}

	// Neither key nor trusted prefix: refused at mb2.
	untrusted = e.counter("mb2", "drop_untrusted")
	if c, err := e.dial("client", netip.AddrPortFrom(dst, 9002), 2*time.Second); err == nil {
		c.Close()
		t.Fatal("a host with no key and no --trusted admitted a Dysco SYN")
	}
	if e.counter("mb2", "drop_untrusted") == untrusted || e.counter("mb2", "setup_cont") != 0 {
		t.Error("mb2 did not refuse and count the SYNs")
	}
}
