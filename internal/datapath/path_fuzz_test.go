package datapath

import (
	"bytes"
	"encoding/binary"
	"net/netip"
	"reflect"
	"strings"
	"testing"

	"github.com/cilium/ebpf"
)

// FuzzPath feeds the real egress and ingress programs (BPF_PROG_TEST_RUN)
// whatever frames the fuzzer makes, on a host with the flows of a
// middlebox's steady state (egress: the session rewritten onto its
// subsessions, IPv4 and IPv6; ingress: the reverse subsessions' flows that
// ICMP errors quoting them are translated with). The seeds are data
// segments, a SYN-ACK, and ICMP and ICMPv6 errors quoting a subsession;
// the fuzzer mutates headers, lengths, options and quoted packets.
// Whatever it gets, the datapath must:
//   - give a verdict of TC_ACT_OK, TC_ACT_SHOT or TC_ACT_REDIRECT;
//   - move exactly one drop counter, by one, for a drop, and none otherwise;
//   - keep its flows' routes as they were (marks and caches may move), and make no session from a packet at
//     egress (the host has no policy);
//   - leave a valid IPv4 header checksum on a packet it changed, when the
//     input's header was valid.
//
// `go test` runs the seeds; `go test -run '^$' -fuzz '^FuzzPath$'
// ./internal/datapath` searches (root).
func FuzzPath(f *testing.F) {
	routerV4, routerV6 := netip.MustParseAddr("10.1.0.254"), netip.MustParseAddr("fd00:1::fe")
	seeds := []struct {
		frame   []byte
		ingress bool
	}{
		{dataPkt(sess4).frame(f), false},
		{dataPkt(sess6).frame(f), false},
		{withIPOpts(dataPkt(sess4)).frame(f), false},
		{dataPkt(sess4.Reverse()).frame(f), false},
		{synAck(sess6.Reverse()).frame(f), false},
		{dataPkt(subOut4.Reverse()).frame(f), true},
		{icmpErr(f, routerV4, dataPkt(subOut4)), true},
		{icmpErr(f, routerV6, dataPkt(subOut6)), true},
		{icmpErr(f, routerV4, dataPkt(sess4)), true}, // quotes no flow of this host
		{icmpErr(f, routerV4, dataPkt(subOut4))[:40], true},
		{make([]byte, 14), false},
	}
	for _, s := range seeds {
		f.Add(s.frame, s.ingress)
	}
	fx := newFixture(f)
	flows := map[Tuple]Flow{
		// Egress: the session onto its next subsession, and the reverse
		// direction back onto the previous one.
		TupleFrom(sess4):           {Out: EndsFrom(subOut4), Flags: FlReroute},
		TupleFrom(sess6):           {Out: EndsFrom(subOut6), Flags: FlReroute},
		TupleFrom(sess4.Reverse()): {Out: EndsFrom(subIn4.Reverse()), Flags: FlRev},
		// Ingress: replies on the next subsession map to the session.
		TupleFrom(subOut4.Reverse()): {Out: EndsFrom(sess4.Reverse()), SessId: 1, Flags: FlIngress | FlRev},
		TupleFrom(subOut6.Reverse()): {Out: EndsFrom(sess6.Reverse()), SessId: 2, Flags: FlIngress | FlRev},
	}
	f.Fuzz(func(t *testing.T, frame []byte, ingress bool) {
		if len(frame) > 1500 { // within the test device's MTU
			frame = frame[:1500]
		}
		for n := testRunMin(frame); len(frame) < n; n = testRunMin(frame) {
			frame = append(frame[:len(frame):len(frame)], make([]byte, n-len(frame))...)
		}
		fx.reset(t)
		for k, fl := range flows {
			if err := fx.d.PutFlow(k, fl, ebpf.UpdateAny); err != nil {
				t.Fatal(err)
			}
		}
		flowsBefore := flowRoutes(fx.flows(t))
		prog := fx.egress
		if ingress {
			prog = fx.ingress
		}
		before := fx.stats(t)
		verdict, out := fx.run(t, prog, frame)
		after := fx.stats(t)
		var drops []string
		for _, name := range StatNames {
			if strings.HasPrefix(name, "drop_") && after[name] != before[name] {
				drops = append(drops, name)
			}
		}
		switch verdict {
		case tcActShot:
			if len(drops) != 1 || after[drops[0]]-before[drops[0]] != 1 {
				t.Errorf("dropped, with drop counters moved: %v", drops)
			}
		case tcActOK, tcActRedirect:
			if len(drops) != 0 {
				t.Errorf("verdict %d, but drop counters moved: %v", verdict, drops)
			}
		default:
			t.Fatalf("verdict %d", verdict)
		}
		if !ingress {
			if s := fx.sessions(t); len(s) != 0 {
				t.Errorf("a packet at egress made %d sessions", len(s))
			}
		}
		if got := flowRoutes(fx.flows(t)); len(fx.sessions(t)) == 0 && !reflect.DeepEqual(got, flowsBefore) {
			t.Errorf("flows changed:\n got %v\nwant %v", got, flowsBefore)
		}
		if verdict != tcActShot && !bytes.Equal(out, frame) && ipv4HeaderOK(frame) && !ipv4HeaderOK(out) {
			t.Errorf("changed the packet and left a wrong IPv4 header checksum:\n in  %x\n out %x", frame, out)
		}
	})
}

// ipv4HeaderOK tells whether frame is an Ethernet frame with an IPv4
// header whose length fits and whose checksum is right.
func ipv4HeaderOK(frame []byte) bool {
	if len(frame) < 14+20 || binary.BigEndian.Uint16(frame[12:]) != 0x0800 || frame[14]>>4 != 4 {
		return false
	}
	ihl := int(frame[14]&0xf) * 4
	if ihl < 20 || len(frame) < 14+ihl {
		return false
	}
	var sum uint32
	for i := 14; i < 14+ihl; i += 2 {
		sum += uint32(binary.BigEndian.Uint16(frame[i:]))
	}
	for sum>>16 != 0 {
		sum = sum&0xffff + sum>>16
	}
	return sum == 0xffff
}

// flowRoute is what a flow does with a packet: its rewrite, session and
// flags, without the marks and the caches that packets move (FlMarks,
// FlEst, FlRouted).
type flowRoute struct {
	Out    Ends
	SessId uint32
	Flags  uint16
}

func flowRoutes(m map[Tuple]Flow) map[Tuple]flowRoute {
	out := map[Tuple]flowRoute{}
	for k, f := range m {
		out[k] = flowRoute{Out: f.Out, SessId: f.SessId, Flags: uint16(f.Flags) &^ (FlMarks | FlEst | FlRouted)}
	}
	return out
}

// testRunMin is the shortest frame BPF_PROG_TEST_RUN takes for frame's
// ethertype: an Ethernet header, and for IPv4 and IPv6 the fixed IP header
// too (the kernel refuses shorter ones with EINVAL, checked on 6.18), so
// such frames are padded with zeros, and the fuzzer still mutates every
// field of the headers.
func testRunMin(frame []byte) int {
	if len(frame) < 14 {
		return 14
	}
	switch binary.BigEndian.Uint16(frame[12:]) {
	case 0x0800:
		return 14 + 20
	case 0x86dd:
		return 14 + 40
	}
	return 14
}
