package datapath

import (
	"bytes"
	"encoding/binary"
	"strings"
	"testing"

	"github.com/dysco/dysco/internal/wire"
)

// FuzzIngressSYN feeds the real ingress program (BPF_PROG_TEST_RUN) SYNs
// that carry Dysco's option, on an IPv4 or an IPv6 subsession, with
// whatever block, announced block length and option type the fuzzer makes. Whatever it
// gets, the datapath must do one of three things (bad input is
// a counted drop, never a leak or a bypass):
//   - drop the SYN, move exactly one drop counter, and keep no state;
//   - let it pass unchanged and keep no state (not a Dysco SYN);
//   - take it as a Dysco SYN: then the block is one that the agent's own
//     decoder (wire.Decode) accepts, of the announced length, with a MAC
//     that verifies (wire.VerifyBlock) for its subsession, and the
//     datapath keeps exactly the block's session, its two flows and, where
//     hops remain, one set-up state with those hops.
//
// `go test` runs the seeds; `go test -run '^$' -fuzz FuzzIngressSYN
// ./internal/datapath` searches (root).
func FuzzIngressSYN(f *testing.F) {
	n := nonceOf(3)
	good4 := block(f, sess4, n, serverV4)
	good6 := block(f, sess6, n, serverV6)
	seeds := []struct {
		blk  []byte
		blen int
		v6   bool
		typ  uint8
	}{
		{good4, len(good4), false, 0},
		{good4, len(good4), false, 9},         // not a Dysco option type: not Dysco
		{nil, 0, false, wire.OptTypeLocalTag}, // a local tag from the wire: forged
		{good6, len(good6), true, wire.OptTypeLocalTag},
		{good6, len(good6), true, 0},
		{block(f, sess4, n), wire.BlockHeaderLen, false, 0},
		{block(f, sess4, n, mbox2V4, serverV4), wire.BlockHeaderLen + 2*wire.AddrLen, false, 0},
		{good4[:40], 40, false, 0},
		{good4, len(good4) + 16, false, 0},
		{rawBlock(sess4, n, 9), wire.BlockHeaderLen, false, 0},
		{rawBlock(sess4, n, 1, serverV6), wire.BlockHeaderLen + wire.AddrLen, false, 0},
		{good6, len(good6), false, 0},
		{nil, 0, false, 0},
		// Found by review, not by the fuzzer: the datapath took a session
		// from an end to itself, which wire.Decode refuses.
		{rawBlock(tup(apOf(clientV4, 40000), apOf(clientV4, 40000)), n, 1, serverV4), wire.BlockHeaderLen + wire.AddrLen, false, 0},
	}
	for _, s := range seeds {
		f.Add(s.blk, uint16(s.blen), s.v6, s.typ|0x10) // signed
	}
	f.Add(good4, uint16(len(good4)), false, uint8(0)) // not signed: a forged MAC
	f.Add(good6, uint16(len(good6)), true, uint8(0))
	fx := newFixture(f)
	f.Fuzz(func(t *testing.T, blk []byte, blen uint16, v6 bool, typ uint8) {
		if len(blk) > 1200 { // the frame stays within the test device's MTU
			blk = blk[:1200]
		}
		// The fuzzer sees the coverage of Go code only, not of the BPF
		// program: the top bits of typ repair the fields that random
		// bytes rarely get right, so that the deeper checks are reached.
		if typ&0x80 != 0 && len(blk) >= 8 {
			blk = append([]byte(nil), blk...)
			binary.BigEndian.PutUint32(blk, wire.Magic)
			blk[4] = wire.Version
			if typ&0x40 != 0 {
				blk[6] = byte((len(blk) - wire.BlockHeaderLen) / wire.AddrLen)
			}
		}
		if typ&0x20 != 0 {
			blen = uint16(len(blk))
		}
		sign := typ&0x80 != 0 || typ&0x10 != 0
		typ &= 0x0f
		sub := subIn4
		if v6 {
			sub = subIn6
		}
		fx.reset(t)
		in := dyscoSYNRaw(sub, blk, int(blen))
		if sign { // a MAC made for the subsession, so that the checks after it are reached
			in = dyscoSYN(sub, blk, int(blen))
		}
		if typ != 0 { // the option's type byte (low 4 bits): 0 keeps the SYN block's
			o := wire.Option(int(blen))
			o[4] = typ
			in.opts[len(in.opts)-1] = optRaw(o[:]...)
		}
		frame := in.frame(t)
		before := fx.stats(t)
		verdict, out := fx.run(t, fx.ingress, frame)
		after := fx.stats(t)
		var drops []string
		for _, name := range StatNames {
			if strings.HasPrefix(name, "drop_") && after[name] != before[name] {
				drops = append(drops, name)
			}
		}
		sessions := fx.sessions(t)
		t.Logf("verdict %d, %d sessions, drops %v", verdict, len(sessions), drops)
		switch {
		case verdict == tcActShot:
			if len(drops) != 1 || after[drops[0]]-before[drops[0]] != 1 {
				t.Errorf("dropped, with drop counters moved: %v", drops)
			}
			fx.expectNoState(t)
		case verdict == tcActOK && len(sessions) == 0:
			if len(drops) != 0 {
				t.Errorf("passed, but drop counters moved: %v", drops)
			}
			if !bytes.Equal(out[:len(frame)], frame) {
				t.Errorf("passed as no Dysco SYN, but changed:\n got %x\nwant %x", out[:len(frame)], frame)
			}
			fx.expectNoState(t)
		case verdict == tcActOK:
			if len(drops) != 0 {
				t.Errorf("accepted, but drop counters moved: %v", drops)
			}
			if int(blen) != len(blk) {
				t.Errorf("accepted a block of %d bytes announced as %d", len(blk), blen)
			}
			b, err := wire.Decode(blk)
			if err != nil {
				t.Fatalf("accepted a block the agent's decoder refuses: %v", err)
			}
			if !wire.VerifyBlock(fxSynKey, in.payload, sub) {
				t.Errorf("accepted a block whose MAC does not verify for %v", sub)
			}
			if b.Session.Is4() != sub.Is4() {
				t.Errorf("accepted a block of session %v on subsession %v", b.Session, sub)
			}
			if len(sessions) != 1 {
				t.Fatalf("%d sessions, want 1", len(sessions))
			}
			s := sessions[0]
			if s.Tuple != EndsFrom(b.Session) || s.Nonce != b.Nonce {
				t.Errorf("session %+v, want the block's %v", s.Session, b.Session)
			}
			if fl := fx.flows(t); len(fl) != 2 {
				t.Errorf("%d flows, want 2: %v", len(fl), fl)
			}
			st, ok := fx.synState(t, s.ID)
			switch {
			case len(b.Hops) == 0 && ok && len(hopsOf(st)) != 0:
				t.Errorf("set-up hops %v for a block without hops", hopsOf(st))
			case len(b.Hops) > 0 && (!ok || !equalAddrs(hopsOf(st), b.Hops)):
				t.Errorf("set-up state %v (kept: %v), want hops %v", hopsOf(st), ok, b.Hops)
			}
			if n := fx.synCount(t); n > 1 {
				t.Errorf("%d set-up states, want at most 1", n)
			}
		default:
			t.Errorf("verdict %d for a SYN at ingress", verdict)
		}
	})
}
