package datapath

// Tests of the control program's operations (dysco_ctl): flags, kept
// locks and splices, freeing and cutting sessions, marks, subsessions.

import (
	"bytes"
	"encoding/binary"
	"errors"
	"net/netip"
	"os"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"github.com/cilium/ebpf"
	"github.com/dysco/dysco/internal/protocol"
)

// TestFlowDrop: a packet of a flow marked FlDrop (a proxy's socket after
// the proxy left the path) is dropped and counted, at either hook.
func TestFlowDrop(t *testing.T) {
	fx := newFixture(t)
	for _, egress := range []bool{true, false} {
		name, prog, in := "ingress", fx.ingress, dataPkt(subIn4)
		f := Flow{Out: EndsFrom(sess4), SessId: 5, Flags: FlDrop | FlIngress | FlEst}
		if egress {
			name, prog, in = "egress", fx.egress, dataPkt(sess4)
			f = Flow{Out: EndsFrom(subOut4), SessId: 5, Flags: FlDrop | FlEst}
		}
		t.Run(name, func(t *testing.T) {
			fx.reset(t)
			if err := fx.d.AddFlow(in.key(), f); err != nil {
				t.Fatal(err)
			}
			before := fx.stats(t)
			if verdict, _ := fx.run(t, prog, in.frame(t)); verdict != tcActShot {
				t.Errorf("verdict %d, want SHOT", verdict)
			}
			fx.expectStats(t, before, map[string]uint64{"drop_orphan": 1})
			if g := fx.flow(t, in.key()); g.Packets != 1 {
				t.Errorf("flow counted %d packets, want 1", g.Packets)
			}
		})
	}
}

// TestSetFlowFlags: flags of a live flow are set and cleared in the kernel
// without losing what the datapath wrote into the entry (counters, marks).
func TestSetFlowFlags(t *testing.T) {
	fx := newFixture(t)
	in := dataPkt(sess4)
	k := in.key()
	if err := fx.d.AddFlow(k, Flow{Out: EndsFrom(subOut4), SessId: 5, Flags: FlEst}); err != nil {
		t.Fatal(err)
	}
	frame := in.frame(t)
	send := func(want uint32) {
		t.Helper()
		if verdict, _ := fx.run(t, fx.egress, frame); verdict != want {
			t.Fatalf("verdict %d, want %d", verdict, want)
		}
	}
	for i := 0; i < 3; i++ {
		send(tcActOK)
	}
	f0 := fx.flow(t, k)
	if f0.Packets != 3 || f0.Bytes != 3*uint64(len(frame)) || !f0.Marked() || f0.Flags != FlEst|FlMarks {
		t.Fatalf("flow before: packets %d bytes %d flags %s", f0.Packets, f0.Bytes, flagNames(f0.Flags))
	}
	check := func(what string, flags uint32, packets uint64) {
		t.Helper()
		f := fx.flow(t, k)
		if f.Flags != flags {
			t.Errorf("%s: flags %s, want %s", what, flagNames(f.Flags), flagNames(flags))
		}
		if f.Packets != packets || f.Bytes != packets*uint64(len(frame)) || int32(f.LastMs-f0.LastMs) < 0 {
			t.Errorf("%s: counters packets %d bytes %d, want %d %d", what, f.Packets, f.Bytes, packets, packets*uint64(len(frame)))
		}
		if f.Marked() != f0.Marked() || f.MkSeq != f0.MkSeq || f.MkAck != f0.MkAck {
			t.Errorf("%s: marks %v %#x %#x, want %v %#x %#x", what, f.Marked(), f.MkSeq, f.MkAck, f0.Marked(), f0.MkSeq, f0.MkAck)
		}
		if f.Out != f0.Out || f.SessId != f0.SessId || f.Dir() != f0.Dir() {
			t.Errorf("%s: flow changed: %+v", what, f)
		}
	}
	if err := fx.d.SetFlowFlags(k, FlDrop, 0); err != nil {
		t.Fatal(err)
	}
	check("drop set", FlEst|FlMarks|FlDrop, 3)
	send(tcActShot)
	check("dropped packet", FlEst|FlMarks|FlDrop, 4)
	if err := fx.d.SetFlowFlags(k, FlTap|FlRouted, FlDrop); err != nil {
		t.Fatal(err)
	}
	check("drop cleared", FlEst|FlMarks|FlTap|FlRouted, 4)
	send(tcActOK)
	check("forwarded again", FlEst|FlMarks|FlTap|FlRouted, 5)
	if err := fx.d.SetFlowFlags(k, 0, FlTap|FlRouted); err != nil {
		t.Fatal(err)
	}
	check("cleared", FlEst|FlMarks, 5)
	err := fx.d.SetFlowFlags(TupleFrom(sess6), FlDrop, 0)
	if !errors.Is(err, syscall.ENOENT) {
		t.Errorf("flags of a missing flow: %v, want ENOENT", err)
	}
	if _, ok := fx.d.Flow(TupleFrom(sess6)); ok {
		t.Error("setting flags created a flow")
	}
}

// TestKeptLock: a middle agent's lock (PutLock) is read back, listed, not
// taken for a side's request, and goes with DeleteReconfigState.
func TestKeptLock(t *testing.T) {
	fx := newFixture(t)
	la := netip.MustParseAddr("10.0.0.1").As16()
	const id = 4242
	if _, _, ok := fx.d.Lock(id); ok {
		t.Fatal("a lock before PutLock")
	}
	if err := fx.d.PutLock(id, la, 17); err != nil {
		t.Fatal(err)
	}
	if got, n, ok := fx.d.Lock(id); !ok || got != la || n != 17 {
		t.Fatalf("Lock = %v %d %v", got, n, ok)
	}
	for side := uint32(0); side < 2; side++ {
		if _, ok := fx.d.TPReqOf(TPKey{SessId: id, Side: side}); ok {
			t.Fatalf("side %d has a request", side)
		}
	}
	var listed []uint32
	if err := fx.d.EachLock(func(id uint32) { listed = append(listed, id) }); err != nil || len(listed) != 1 || listed[0] != id {
		t.Fatalf("EachLock: %v %v", listed, err)
	}
	fx.d.DeleteReconfigState(id)
	if _, _, ok := fx.d.Lock(id); ok {
		t.Fatal("the lock outlived DeleteReconfigState")
	}
}

// TestKeptSplice: a proxy's joined sessions (PutSplice) are listed with
// their delta, are neither a lock nor a side's request, and go with
// DeleteSplice, DeleteReconfigState and FreeSession of the client's
// session.
func TestKeptSplice(t *testing.T) {
	fx := newFixture(t)
	want := Splice{Client: 7, Server: 9, SeqLR: 0xfffffff9, TSLR: 16, SeqRL: 1234, TSRL: 0x80000000,
		ClientCreatedMs: 0xfffffffe, ServerCreatedMs: 3}
	list := func() []Splice {
		t.Helper()
		var got []Splice
		if err := fx.d.EachSplice(func(sp Splice) { got = append(got, sp) }); err != nil {
			t.Fatal(err)
		}
		return got
	}
	put := func() {
		t.Helper()
		if err := fx.d.PutSplice(want); err != nil {
			t.Fatal(err)
		}
		if got := list(); len(got) != 1 || got[0] != want {
			t.Fatalf("EachSplice: %+v, want %+v", got, want)
		}
	}
	put()
	if _, _, ok := fx.d.Lock(want.Client); ok {
		t.Error("joined sessions taken for a kept lock")
	}
	var locks []uint32
	if err := fx.d.EachLock(func(id uint32) { locks = append(locks, id) }); err != nil || len(locks) != 0 {
		t.Errorf("EachLock: %v %v", locks, err)
	}
	for side := uint32(0); side < 2; side++ {
		if _, ok := fx.d.TPReqOf(TPKey{SessId: want.Client, Side: side}); ok {
			t.Fatalf("side %d has a request", side)
		}
	}
	if err := fx.d.SpliceAnswered(want.Client); err != nil {
		t.Fatal(err)
	}
	answered := want
	answered.Answered = true
	if got := list(); len(got) != 1 || got[0] != answered {
		t.Fatalf("after SpliceAnswered: %+v, want %+v", got, answered)
	}
	if err := fx.d.SpliceAnswered(want.Server); !errors.Is(err, ebpf.ErrKeyNotExist) {
		t.Errorf("SpliceAnswered with nothing kept: %v, want ErrKeyNotExist", err)
	}
	fx.d.DeleteSplice(want.Client)
	if got := list(); len(got) != 0 {
		t.Fatalf("after DeleteSplice: %+v", got)
	}
	put()
	fx.d.DeleteReconfigState(want.Server) // not the key's session
	if len(list()) != 1 {
		t.Fatal("DeleteReconfigState of the server's session took the client's")
	}
	fx.d.DeleteReconfigState(want.Client)
	if got := list(); len(got) != 0 {
		t.Fatalf("after DeleteReconfigState: %+v", got)
	}
	put()
	fx.d.DeleteReconfigStates([]uint32{want.Client})
	if got := list(); len(got) != 0 {
		t.Fatalf("after DeleteReconfigStates: %+v", got)
	}
	put()
	if _, err := fx.d.FreeSession(want.Client, Tuple{}); err != nil {
		t.Fatal(err)
	}
	if got := list(); len(got) != 0 {
		t.Fatalf("after FreeSession: %+v", got)
	}
}

// TestDeleteReconfigStates: the collector's batch removes every two-path
// record, request and kept lock of the ended sessions, and nothing of the
// others; ids without any (sessions never reconfigured) are no error.
func TestDeleteReconfigStates(t *testing.T) {
	fx := newFixture(t)
	la := netip.MustParseAddr("10.0.0.1").As16()
	var ended, live []uint32
	for id := uint32(1); id <= 300; id++ { // over one batch of the walk
		for side := uint32(0); side < 2; side++ {
			k := TPKey{SessId: id, Side: side}
			if err := fx.d.PutTwoPath(k, TPVal{State: 1}); err != nil {
				t.Fatal(err)
			}
			if err := fx.d.objs.DyscoTpReq.Put(&k, &TPReq{Id: id}); err != nil {
				t.Fatal(err)
			}
		}
		if err := fx.d.PutLock(id, la, id); err != nil {
			t.Fatal(err)
		}
		if id%3 == 0 {
			live = append(live, id)
		} else {
			ended = append(ended, id)
		}
	}
	// Ids with nothing to delete, first, among and last.
	ask := append(append([]uint32{100000}, ended[:50]...), 100001)
	ask = append(append(ask, ended[50:]...), 100002)
	fx.d.DeleteReconfigStates(ask)
	fx.d.DeleteReconfigStates(nil)
	has := func(id uint32) (n int) {
		for side := uint32(0); side < 2; side++ {
			if _, ok := fx.d.TwoPath(TPKey{SessId: id, Side: side}); ok {
				n++
			}
			if _, ok := fx.d.TPReqOf(TPKey{SessId: id, Side: side}); ok {
				n++
			}
		}
		if _, _, ok := fx.d.Lock(id); ok {
			n++
		}
		return n
	}
	for _, id := range ended {
		if n := has(id); n != 0 {
			t.Errorf("session %d ended: %d entries of 5 left", id, n)
		}
	}
	for _, id := range live {
		if n := has(id); n != 5 {
			t.Errorf("session %d live: %d entries of 5 left", id, n)
		}
	}
}

// TestCtlArgsLayout: ctlArgs hands dysco_ctl the Go struct's own memory,
// which must be what encoding/binary would have written (no hidden
// padding, fields where C has them).
func TestCtlArgsLayout(t *testing.T) {
	a := dyscoCtlArgs{Op: 1, Arg: 2, Ret: -3, Key: TupleFrom(subIn4), Tp: TPKey{SessId: 4, Side: 1}, Key2: TupleFrom(sess6)}
	want, err := binary.Append(nil, binary.NativeEndian, &a)
	if err != nil {
		t.Fatal(err)
	}
	got := unsafe.Slice((*byte)(unsafe.Pointer(&a)), unsafe.Sizeof(a))
	if !bytes.Equal(got, want) {
		t.Fatalf("dyscoCtlArgs in memory:\n%x\nencoded:\n%x", got, want)
	}
}

// TestFreeAndCutSession: CutSession and FreeSession find a session's flows
// in the kernel as the agent's flowKeysOf did (from its tuple and its
// two-path records), touch only the flows that are still the session's,
// and FreeSession leaves nothing of it: deltas, two-path records, kept
// requests, set-up state, the session.
func TestFreeAndCutSession(t *testing.T) {
	fx := newFixture(t)
	fx.reset(t)
	clearHash(t, fx.d.objs.DyscoTp)
	clearHash(t, fx.d.objs.DyscoTpReq)
	m := fx.d.Maps()
	// A middlebox host's session (§3.1 join): in on l, out on r, and a
	// right side in its two-path phase toward a new subsession n.
	sess := tup(ap("10.1.0.1:40000"), ap("10.9.0.5:80"))
	l := tup(ap("10.1.0.20:41001"), ap("10.1.0.30:41002"))
	r := tup(ap("10.1.0.30:41003"), ap("10.1.0.40:41004"))
	n := tup(ap("10.1.0.30:41005"), ap("10.1.0.41:41006"))
	s := Session{Tuple: EndsFrom(sess), Role: RoleMiddle, State: StEst}
	id, err := fx.d.InsertSession(s)
	if err != nil {
		t.Fatal(err)
	}
	other, err := fx.d.InsertSession(s)
	if err != nil {
		t.Fatal(err)
	}
	ingress := map[Tuple]Flow{
		TupleFrom(l):           {Out: EndsFrom(sess), SessId: id, Flags: FlIngress | FlEst | FlDelta},
		TupleFrom(r.Reverse()): {Out: EndsFrom(sess.Reverse()), SessId: id, Flags: FlIngress | FlRev | FlEst},
	}
	egress := map[Tuple]Flow{
		TupleFrom(sess):           {Out: EndsFrom(r), SessId: id, Flags: FlEst | FlTPOut | FlDelta},
		TupleFrom(sess.Reverse()): {Out: EndsFrom(l.Reverse()), SessId: id, Flags: FlRev | FlEst},
	}
	// The new subsession's ingress flow belongs to another session by now
	// (a tuple reused): it must stay.
	foreign := TupleFrom(n.Reverse())
	for k, f := range ingress {
		if err := fx.d.AddFlow(k, f); err != nil {
			t.Fatal(err)
		}
	}
	for k, f := range egress {
		if err := fx.d.AddFlow(k, f); err != nil {
			t.Fatal(err)
		}
	}
	if err := fx.d.AddFlow(foreign, Flow{Out: EndsFrom(sess.Reverse()), SessId: other, Flags: FlIngress | FlDelta}); err != nil {
		t.Fatal(err)
	}
	for _, k := range []Tuple{TupleFrom(l), TupleFrom(sess), foreign} {
		if err := fx.d.PutDelta(k, Delta{Seq: 7}); err != nil {
			t.Fatal(err)
		}
	}
	tk := TPKey{SessId: id, Side: 1}
	if err := fx.d.PutTwoPath(tk, TPVal{State: TPActive, EgKey: TupleFrom(sess), InOld: TupleFrom(r.Reverse()),
		OldOut: TupleFrom(r), NewOut: TupleFrom(n)}); err != nil {
		t.Fatal(err)
	}
	for side := uint32(0); side < 3; side++ {
		k, v := TPKey{SessId: id, Side: side}, TPReq{Id: side + 1}
		if err := fx.d.objs.DyscoTpReq.Update(&k, &v, ebpf.UpdateAny); err != nil {
			t.Fatal(err)
		}
	}
	var st dyscoSynState
	if err := m["syns"].Put(id, &st); err != nil {
		t.Fatal(err)
	}
	m["tp_req"] = fx.d.objs.DyscoTpReq
	count := func(name string) int {
		if name == "flows" {
			return entries(t, m["flows4"]) + entries(t, m["flows6"])
		}
		return entries(t, m[name])
	}

	got, err := fx.d.CutSession(id, Tuple{})
	if err != nil || got != 4 {
		t.Fatalf("CutSession = %d, %v; want its 4 flows", got, err)
	}
	for k := range ingress {
		if _, ok := fx.d.Flow(k); ok {
			t.Errorf("ingress flow %s outlived the cut", k)
		}
	}
	for k, want := range egress {
		if f, ok := fx.d.Flow(k); !ok || f.Flags != want.Flags|FlDrop {
			t.Errorf("egress flow %s after the cut: %+v %v, want flags %#x", k, f, ok, want.Flags|FlDrop)
		}
	}
	if f, ok := fx.d.Flow(foreign); !ok || f.SessId != other || f.Flags&FlDrop != 0 {
		t.Errorf("another session's flow after the cut: %+v %v", f, ok)
	}
	if !fx.d.SessionExists(id) || count("deltas") != 2 {
		t.Fatalf("after the cut: session kept %v, deltas %d (want the egress flow's and the foreign one)", fx.d.SessionExists(id), count("deltas"))
	}

	got, err = fx.d.FreeSession(id, Tuple{})
	if err != nil || got != 2 {
		t.Fatalf("FreeSession = %d, %v; want the 2 egress flows left", got, err)
	}
	if fx.d.SessionExists(id) || !fx.d.SessionExists(other) {
		t.Errorf("after FreeSession: session %v, the other %v", fx.d.SessionExists(id), fx.d.SessionExists(other))
	}
	for name, want := range map[string]int{"flows": 1, "deltas": 1, "syns": 0} {
		if c := count(name); c != want {
			t.Errorf("%s: %d entries left, want %d", name, c, want)
		}
	}
	if _, ok := fx.d.TwoPath(tk); ok {
		t.Error("the two-path record outlived FreeSession")
	}
	if c := count("tp_req"); c != 0 {
		t.Errorf("%d kept requests outlived FreeSession", c)
	}
	if _, ok := fx.d.Flow(foreign); !ok {
		t.Error("FreeSession took another session's flow")
	}
	// A session that is gone: nothing to do, no error.
	if got, err := fx.d.FreeSession(id, Tuple{}); err != nil || got != 0 {
		t.Errorf("FreeSession of a freed session = %d, %v", got, err)
	}
}

// TestCtlConsts checks the Go mirrors of dysco_ctl's operations (consts.h)
// and of the sides of a kept lock and of a proxy's joined sessions
// (twopath.h).
func TestCtlConsts(t *testing.T) {
	var src []byte
	for _, f := range []string{"consts.h", "twopath.h"} {
		b, err := os.ReadFile("../../bpf/include/" + f)
		if err != nil {
			t.Fatal(err)
		}
		src = append(src, b...)
	}
	for name, want := range map[string]int{
		"CTL_FLAGS_SET": ctlFlagsSet, "CTL_FLAGS_CLEAR": ctlFlagsClear, "CTL_TP_START": ctlTPStart,
		"CTL_TP_STATE": ctlTPState, "CTL_TP_CLAMP": ctlTPClamp, "CTL_MARKS_MERGE": ctlMarksMerge,
		"CTL_FREE": ctlFree, "CTL_CUT": ctlCut, "CTL_FREE_RECONF": ctlFreeReconf, "CTL_ADD_SUB": ctlAddSub, "CTL_CLOSED": ctlClosed, "CTL_WS": ctlWS, "CTL_HO_RELEASE": ctlHoRelease,
		"SIDE_LOCK": TPSideLock, "SIDE_SPLICE": TPSideSplice,
	} {
		m := regexp.MustCompile(`(?m)^#define ` + name + `\s+(\d+)`).FindSubmatch(src)
		if m == nil {
			t.Errorf("no #define %s", name)
			continue
		}
		if got, _ := strconv.Atoi(string(m[1])); got != want {
			t.Errorf("%s: C %d, Go %d", name, got, want)
		}
	}
}

// TestMergeMarks: a side's new ingress flow inherits its old one's marks
// where they are ahead, by at most a window (2^30), across the wrap of
// sequence numbers too. An old flow behind by more than 2^31, which modular
// comparison alone takes for ahead (an old path removed seconds after the
// switch, the session having carried over 2 GiB on the new one since), and
// one behind by a little, leave the new flow's marks alone.
func TestMergeMarks(t *testing.T) {
	fx := newFixture(t)
	for _, s := range []tpSide{tpRight4, tpLeft6} {
		for _, c := range []struct {
			name                 string
			oldSeq, oldAck       uint32
			newSeq, newAck       uint32
			wantSeq, wantAck     uint32
			newHasMarks, oldMark bool
		}{
			{"old ahead", 5000, 900, 4000, 800, 5000, 900, true, true},
			{"old ahead across the wrap", 100, 50, 0xffffff00, 0xfffffff0, 100, 50, true, true},
			{"old ahead by a window", 1000 + 1<<30, 900, 1000, 900, 1000 + 1<<30, 900, true, true},
			{"old behind", 4000, 800, 5000, 900, 5000, 900, true, true},
			{"old behind by more than 2^31", 1_478_828_461, 3_259_728_347, 3_942_226_509, 3_259_728_347, 3_942_226_509, 3_259_728_347, true, true},
			{"old behind by 2^30 + 1", 1000, 900, 1000 + 1<<30 + 1, 900, 1000 + 1<<30 + 1, 900, true, true},
			{"new without marks", 5000, 900, 0, 0, 5000, 900, false, true},
			{"old without marks", 0, 0, 4000, 800, 4000, 800, true, false},
		} {
			t.Run(s.sess.String()+"/"+c.name, func(t *testing.T) {
				fx.reset(t)
				old, nw := s.flows()[s.inOld()], s.flows()[s.inNew()]
				if c.oldMark {
					old.Flags |= FlMarks
					old.MkSeq, old.MkAck = c.oldSeq, c.oldAck
				}
				if c.newHasMarks {
					nw.Flags |= FlMarks
					nw.MkSeq, nw.MkAck = c.newSeq, c.newAck
				}
				if err := fx.d.AddFlow(s.inOld(), old); err != nil {
					t.Fatal(err)
				}
				if err := fx.d.AddFlow(s.inNew(), nw); err != nil {
					t.Fatal(err)
				}
				if err := fx.d.MergeMarks(s.inOld(), s.inNew()); err != nil {
					t.Fatal(err)
				}
				got := fx.flow(t, s.inNew())
				if got.MkSeq != c.wantSeq || got.MkAck != c.wantAck {
					t.Errorf("marks after the merge: seq %d ack %d, want %d %d", got.MkSeq, got.MkAck, c.wantSeq, c.wantAck)
				}
				if (got.Flags&FlMarks != 0) != (c.newHasMarks || c.oldMark) {
					t.Errorf("FlMarks %v after the merge", got.Flags&FlMarks != 0)
				}
			})
		}
	}
}

// TestAddSubsession: one run of the control program installs what the
// agent's six map operations did (control.addSub): the request, the side's
// record, the new ingress flow and its translation (an IPv4 flow in the
// IPv4 map), and the flags on the side's egress flow and old ingress flow;
// it refuses an ingress flow that exists, and a side without an egress flow.
func TestAddSubsession(t *testing.T) {
	fx := newFixture(t)
	for _, s := range []tpSide{tpRight4, tpLeft6} {
		t.Run(s.sess.String(), func(t *testing.T) {
			fx.reset(t)
			clearHash(t, fx.d.objs.DyscoTp)
			clearHash(t, fx.d.objs.DyscoTpReq)
			clearHash(t, fx.d.objs.DyscoDeltas)
			all := s.flows()
			eg, old, nw := all[s.egKey()], all[s.inOld()], all[s.inNew()]
			eg.Flags &^= FlTPOut
			old.Flags &^= FlTPOld
			eg.Packets, old.Packets = 7, 9 // written by packets meanwhile: kept
			for k, f := range map[Tuple]Flow{s.egKey(): eg, s.inOld(): old} {
				if err := fx.d.AddFlow(k, f); err != nil {
					t.Fatal(err)
				}
			}
			nw.Flags |= FlDelta
			delta := Delta{Seq: 0x1000, Tsval: -5, WsIn: 7, WsOut: 9, WsOn: 1}
			rec := s.record(TPIdle, protocol.TwoPath{})
			rec.Armed, rec.Nd = 1, Delta{Ack: -0x1000}
			req := TPReq{Id: 42, Role: TPReqRightAnchor}
			kept, err := fx.d.AddSubsession(s.key(), s.inNew(), nw, delta, rec, req)
			if err != nil || !kept {
				t.Fatalf("AddSubsession: kept %v, %v", kept, err)
			}
			if got := fx.twoPath(t, s.key()); got != rec {
				t.Errorf("record\n got %+v\nwant %+v", got, rec)
			}
			if got, ok := fx.d.TPReqOf(s.key()); !ok || got != req {
				t.Errorf("request %+v (%v), want %+v", got, ok, req)
			}
			var d Delta
			if err := fx.d.objs.DyscoDeltas.Lookup(s.inNew(), &d); err != nil || d != delta {
				t.Errorf("delta %+v (%v), want %+v", d, err, delta)
			}
			if got := fx.flow(t, s.inNew()); got != nw {
				t.Errorf("new ingress flow\n got %+v\nwant %+v", got, nw)
			}
			eg.Flags |= FlTPOut
			old.Flags |= FlTPOld
			if got := fx.flow(t, s.egKey()); got != eg {
				t.Errorf("egress flow\n got %+v\nwant %+v", got, eg)
			}
			if got := fx.flow(t, s.inOld()); got != old {
				t.Errorf("old ingress flow\n got %+v\nwant %+v", got, old)
			}
			if _, err := fx.d.AddSubsession(s.key(), s.inNew(), nw, delta, rec, req); err == nil || !strings.Contains(err.Error(), "exists") {
				t.Errorf("a second AddSubsession: %v, want: the flow exists", err)
			}
			fx.d.DeleteFlow(s.inNew())
			fx.d.DeleteFlow(s.egKey())
			if _, err := fx.d.AddSubsession(s.key(), s.inNew(), nw, delta, rec, req); !errors.Is(err, syscall.ENOENT) {
				t.Errorf("AddSubsession without the egress flow: %v, want ENOENT", err)
			}
		})
	}
}

// TestFreeAndCutSessionOnward: behind a NAT the session leaves a
// middlebox host with the middlebox's output tuple, which keys its egress
// flow of the SYN's direction (and the right subsession's ingress flow
// rewrites to the reverse of it). Given that tuple, CutSession and
// FreeSession find the right side's two flows too; without it they find
// the left side's only, as before.
func TestFreeAndCutSessionOnward(t *testing.T) {
	fx := newFixture(t)
	fx.reset(t)
	sess := tup(ap("10.1.0.1:40000"), ap("10.9.0.5:80"))
	nat := tup(ap("10.1.0.30:61000"), ap("10.9.0.5:80")) // MASQUERADE's output
	l := tup(ap("10.1.0.20:41001"), ap("10.1.0.30:41002"))
	r := tup(ap("10.1.0.30:41003"), ap("10.1.0.40:41004"))
	install := func() uint32 {
		t.Helper()
		id, err := fx.d.InsertSession(Session{Tuple: EndsFrom(sess), Role: RoleMiddle, State: StEst})
		if err != nil {
			t.Fatal(err)
		}
		for k, f := range map[Tuple]Flow{
			TupleFrom(l):              {Out: EndsFrom(sess), SessId: id, Flags: FlIngress | FlEst},
			TupleFrom(sess.Reverse()): {Out: EndsFrom(l.Reverse()), SessId: id, Flags: FlRev | FlEst},
			TupleFrom(nat):            {Out: EndsFrom(r), SessId: id, Flags: FlEst},
			TupleFrom(r.Reverse()):    {Out: EndsFrom(nat.Reverse()), SessId: id, Flags: FlIngress | FlRev | FlEst},
		} {
			if err := fx.d.AddFlow(k, f); err != nil {
				t.Fatal(err)
			}
		}
		return id
	}
	flows := func() int { return entries(t, fx.d.objs.DyscoFlows4) + entries(t, fx.d.objs.DyscoFlows6) }

	id := install()
	if got, err := fx.d.FreeSession(id, Tuple{}); err != nil || got != 2 {
		t.Fatalf("FreeSession without the onward tuple = %d, %v; want the left side's 2 flows", got, err)
	}
	for _, k := range []Tuple{TupleFrom(nat), TupleFrom(r.Reverse())} {
		fx.d.DeleteFlow(k)
	}
	if n := flows(); n != 0 {
		t.Fatalf("%d flows left before the second round", n)
	}

	id = install()
	got, err := fx.d.CutSession(id, TupleFrom(nat))
	if err != nil || got != 4 {
		t.Fatalf("CutSession = %d, %v; want 4 flows", got, err)
	}
	if f, ok := fx.d.Flow(TupleFrom(nat)); !ok || f.Flags&FlDrop == 0 {
		t.Errorf("the onward egress flow after the cut: %+v %v, want FlDrop", f, ok)
	}
	if _, ok := fx.d.Flow(TupleFrom(r.Reverse())); ok {
		t.Error("the right subsession's ingress flow outlived the cut")
	}
	if got, err := fx.d.FreeSession(id, TupleFrom(nat)); err != nil || got != 2 {
		t.Fatalf("FreeSession after the cut = %d, %v; want the 2 egress flows", got, err)
	}
	if n := flows(); n != 0 || fx.d.SessionExists(id) {
		t.Errorf("after FreeSession: %d flows left, session kept %v", n, fx.d.SessionExists(id))
	}
}

// TestMarkClosed: a middlebox that joined a new path records FINs it did
// not see (the anchors' closed notice). Only the FIN bits are set, other
// state stays, the idle time restarts, and a session that is gone is an
// error.
func TestMarkClosed(t *testing.T) {
	fx := newFixture(t)
	s := Session{State: StSYN | StSYNACK | StEst | StSetupDone, Role: RoleMiddle, CreatedMs: Now() - 60000, LastMs: Now() - 60000}
	id, err := fx.d.InsertSession(s)
	if err != nil {
		t.Fatal(err)
	}
	if err := fx.d.MarkClosed(id, StFINFwd|StRST); err != nil {
		t.Fatal(err)
	}
	got, _ := fx.d.Session(id)
	if got.State != s.State|StFINFwd {
		t.Fatalf("state %#x, want %#x (only the FIN bit set)", got.State, s.State|StFINFwd)
	}
	if Age(Now(), got.LastMs) > 5*time.Second {
		t.Fatalf("the idle time did not restart: %s", Age(Now(), got.LastMs))
	}
	if err := fx.d.MarkClosed(id, StFINRev); err != nil {
		t.Fatal(err)
	}
	if got, _ := fx.d.Session(id); got.State != s.State|StFINFwd|StFINRev {
		t.Fatalf("state %#x after the second notice", got.State)
	}
	fx.d.DeleteSession(id)
	if err := fx.d.MarkClosed(id, StFINFwd); err == nil {
		t.Fatal("MarkClosed of a session that is gone succeeded")
	}
}

// TestSetLeftwardWScale: a joined session learns the window scale of its
// leftward direction (the synAck's); the rightward one and the rest of the
// session stay; a scale above 14 or a session that is gone is refused.
func TestSetLeftwardWScale(t *testing.T) {
	fx := newFixture(t)
	s := Session{State: StSYN | StSYNACK | StEst | StSetupDone, Role: RoleMiddle, Ws: [2]uint8{9, 0xff}, CreatedMs: Now(), LastMs: Now()}
	id, err := fx.d.InsertSession(s)
	if err != nil {
		t.Fatal(err)
	}
	if err := fx.d.SetLeftwardWScale(id, 7); err != nil {
		t.Fatal(err)
	}
	want := s
	want.Proto, want.Ws[1] = ProtoTCP, 7
	if got, _ := fx.d.Session(id); got != want {
		t.Fatalf("session %+v, want %+v", got, want)
	}
	if err := fx.d.SetLeftwardWScale(id, 15); err == nil {
		t.Error("window scale 15 accepted")
	}
	fx.d.DeleteSession(id)
	if err := fx.d.SetLeftwardWScale(id, 7); err == nil {
		t.Error("a session that is gone learned a window scale")
	}
}

// ctl runs the control program on the datapath's objects (tests).
func (d *Datapath) ctl(op uint32, k *Tuple, tp *TPKey, arg uint32) error {
	return objects{&d.objs}.ctl(op, k, tp, arg)
}
