package datapath

import (
	"net"
	"net/netip"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/dysco/dysco/internal/wire"
)

// TestTapSYNCopy checks what the session-view tap shows of a chained SYN on
// a middlebox host: the session's SYN as the end hosts see it, without the
// local tag, while the SYN handed to the middlebox keeps the tag that its
// egress continues the chain by (§4.2 "Tagging SYN packets"). The tap is dy1
// here; a packet socket on it reads the copies.
func TestTapSYNCopy(t *testing.T) {
	fx := newFixtureWith(t, func(n *testNet, cfg *Config) {
		n.do(func() {
			l, err := net.InterfaceByName("dy1")
			if err != nil {
				t.Fatal(err)
			}
			cfg.TapIfindex = uint32(l.Index)
		})
	})
	if err := fx.d.SetTapActive(true); err != nil {
		t.Fatal(err)
	}
	var fd int
	fx.net.do(func() {
		var err error
		fd, err = unix.Socket(unix.AF_PACKET, unix.SOCK_RAW, int(htons(unix.ETH_P_ALL)))
		if err != nil {
			t.Fatal(err)
		}
		l, _ := net.InterfaceByName("dy1")
		if err := unix.Bind(fd, &unix.SockaddrLinklayer{Protocol: htons(unix.ETH_P_ALL), Ifindex: l.Index}); err != nil {
			t.Fatal(err)
		}
	})
	defer unix.Close(fd)
	tv := unix.NsecToTimeval((2 * time.Second).Nanoseconds())
	if err := unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv); err != nil {
		t.Fatal(err)
	}

	cases := []struct {
		name string
		sub  wire.Tuple
		blk  wire.SynBlock
	}{
		{"v4, hops remain", subIn4, wire.SynBlock{Session: sess4, Nonce: nonceOf(1), Hops: []netip.Addr{serverV4}}},
		{"v6, hops remain", subIn6, wire.SynBlock{Session: sess6, Nonce: nonceOf(2), Hops: []netip.Addr{serverV6}}},
		{"v4, chain ends before the destination", subIn4, wire.SynBlock{Session: sess4, Nonce: nonceOf(3)}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			fx.reset(t)
			drain(fd)
			blk := block(t, c.blk.Session, c.blk.Nonce, c.blk.Hops...)
			in := dyscoSYN(c.sub, blk, len(blk))
			before := fx.stats(t)
			verdict, out := fx.run(t, fx.ingress, in.frame(t))
			if verdict != tcActOK {
				t.Fatalf("verdict %d, want %d", verdict, tcActOK)
			}
			fx.expectStats(t, before, map[string]uint64{"tap": 1, setupStat(c.blk): 1})
			s := fx.onlySession(t)
			plain := in.with(c.blk.Session).withPayload(nil)
			plain.opts = synOpts()
			tagged := plain
			tagged.opts = append(synOpts(), optTag(s.ID))
			expectFrame(t, out, tagged)

			expectFrame(t, readSYN(t, fd), plain)
		})
	}
}

func setupStat(b wire.SynBlock) string {
	if len(b.Hops) > 0 {
		return "setup_cont"
	}
	return "setup_end"
}

// drain empties the packet socket of what earlier cases left.
func drain(fd int) {
	buf := make([]byte, 2048)
	for {
		if _, _, err := unix.Recvfrom(fd, buf, unix.MSG_DONTWAIT); err != nil {
			return
		}
	}
}

// readSYN returns the next TCP SYN frame the packet socket reads (the tap
// may also carry the stack's own traffic, ARP among it).
func readSYN(t *testing.T, fd int) []byte {
	t.Helper()
	buf := make([]byte, 2048)
	for {
		n, _, err := unix.Recvfrom(fd, buf, 0)
		if err != nil {
			t.Fatalf("no SYN on the tap: %v", err)
		}
		f := buf[:n]
		if isTCPSYN(f) {
			return append([]byte(nil), f...)
		}
	}
}

func isTCPSYN(f []byte) bool {
	if len(f) < 14 {
		return false
	}
	var l4 []byte
	switch uint16(f[12])<<8 | uint16(f[13]) {
	case unix.ETH_P_IP:
		if len(f) < 14+20 || f[14+9] != unix.IPPROTO_TCP {
			return false
		}
		l4 = f[14+int(f[14]&0xf)*4:]
	case unix.ETH_P_IPV6:
		if len(f) < 14+40 || f[14+6] != unix.IPPROTO_TCP {
			return false
		}
		l4 = f[14+40:]
	default:
		return false
	}
	return len(l4) >= 20 && l4[13]&0x12 == 0x02
}
