package protocol

import (
	"encoding/json"
	"flag"
	"os"
	"reflect"
	"testing"
)

var update = flag.Bool("update", false, "rewrite testdata/twopath_vectors.json")

// The simulation's flags (package sim), defined here too so that
// go test ./internal/protocol/... -run Sim -seed N works for both packages.
var (
	_ = flag.Int64("seed", -1, "simulation seed (package sim)")
	_ = flag.Int("seeds", 0, "number of simulation seeds (package sim)")
	_ = flag.Int64("first-seed", 1, "first simulation seed (package sim)")
	_ = flag.Bool("simtrace", false, "print the simulation trace (package sim)")
)

// Vector is one shared test vector of the two-path rules, for this package
// and for the datapath's fixtures (which must give the same pieces).
type vector struct {
	Name   string  `json:"name"`
	Vars   TwoPath `json:"vars"`
	Dir    string  `json:"dir"`            // "out": Decide; "in": Observe
	Path   string  `json:"path,omitempty"` // "old"/"new" for "in"
	Packet Packet  `json:"packet"`
	Pieces []Piece `json:"pieces,omitempty"`
	// Delivered is an "in" packet as the anchor hands it on (Deliver).
	Delivered *Packet `json:"delivered,omitempty"`
	After     TwoPath `json:"after"`
}

// The anchor of most cases: it sent up to 1000 on the old path, received
// up to 5000 on it and acked 4000 of that.
var base = TwoPath{OldSent: 1000, OldSentAcked: 900, OldRcvd: 5000, OldRcvdAcked: 4000, AckHi: 900, AckHiOK: true}

func with(f func(v *TwoPath)) TwoPath {
	v := base
	f(&v)
	return v
}

const ack = TCPAck

func vectorCases() []vector {
	return []vector{
		// §3.5 byte table.
		{Name: "retransmission below oldSent goes old, ack in old range", Vars: base, Dir: "out",
			Packet: Packet{Seq: 900, Len: 100, Ack: 4500, Flags: ack}},
		{Name: "new data at oldSent goes new with its ack", Vars: base, Dir: "out",
			Packet: Packet{Seq: 1000, Len: 100, Ack: 5000, Flags: ack}},
		{Name: "straddling packet with FIN goes whole on old, ack lowered", Vars: base, Dir: "out",
			Packet: Packet{Seq: 950, Len: 100, Ack: 6000, Flags: ack | TCPFin}},
		{Name: "straddling packet, ack in old range, whole on old", Vars: base, Dir: "out",
			Packet: Packet{Seq: 990, Len: 20, Ack: 4800, Flags: ack}},
		{Name: "FIN alone at oldSent goes new", Vars: base, Dir: "out",
			Packet: Packet{Seq: 1000, Len: 0, Ack: 5000, Flags: ack | TCPFin}},
		{Name: "retransmitted FIN below oldSent goes old", Vars: with(func(v *TwoPath) { v.OldSent = 1001 }), Dir: "out",
			Packet: Packet{Seq: 1000, Len: 0, Ack: 4000, Flags: ack | TCPFin}},
		// §3.5 ack table.
		{Name: "ack <= oldRcvd and > oldRcvdAcked: old path", Vars: base, Dir: "out",
			Packet: Packet{Seq: 1200, Ack: 4500, Flags: ack}},
		{Name: "ack = oldRcvd: old path", Vars: base, Dir: "out",
			Packet: Packet{Seq: 1200, Ack: 5000, Flags: ack}},
		{Name: "duplicate ack <= oldRcvdAcked: old path", Vars: base, Dir: "out",
			Packet: Packet{Seq: 1200, Ack: 4000, Flags: ack}},
		{Name: "ack > oldRcvd, oldRcvd = oldRcvdAcked: new path only",
			Vars: with(func(v *TwoPath) { v.OldRcvdAcked = 5000 }), Dir: "out",
			Packet: Packet{Seq: 1200, Ack: 6000, Flags: ack}},
		{Name: "ack > oldRcvd, oldRcvd > oldRcvdAcked: new path, counts for oldRcvdAcked", Vars: base, Dir: "out",
			Packet: Packet{Seq: 1200, Ack: 6000, Flags: ack}},
		{Name: "new data with ack > oldRcvd: new", Vars: base, Dir: "out",
			Packet: Packet{Seq: 1100, Len: 500, Ack: 6000, Flags: ack}},
		{Name: "old data with ack > oldRcvd: old, acking oldRcvd", Vars: base, Dir: "out",
			Packet: Packet{Seq: 800, Len: 100, Ack: 6000, Flags: ack}},
		{Name: "RST goes on the new path", Vars: base, Dir: "out",
			Packet: Packet{Seq: 1200, Ack: 6000, Flags: ack | TCPRst}},
		{Name: "sequence numbers wrap", Vars: TwoPath{OldSent: 10, OldSentAcked: 10, OldRcvd: 0xfffffff0, OldRcvdAcked: 0xffffff00},
			Dir: "out", Packet: Packet{Seq: 0xfffffffa, Len: 32, Ack: 20, Flags: ack}},
		// Observe.
		{Name: "old path data raises oldRcvd", Vars: base, Dir: "in", Path: "old",
			Packet: Packet{Seq: 5000, Len: 300, Ack: 950, Flags: ack}},
		{Name: "old path retransmission below oldRcvd changes nothing", Vars: base, Dir: "in", Path: "old",
			Packet: Packet{Seq: 4000, Len: 300, Ack: 900, Flags: ack}},
		{Name: "new path data sets firstNewRcvd", Vars: base, Dir: "in", Path: "new",
			Packet: Packet{Seq: 5200, Len: 100, Ack: 1100, Flags: ack}},
		{Name: "new path data lowers firstNewRcvd", Vars: with(func(v *TwoPath) { v.NewRcvd, v.FirstNewRcvd = true, 5200 }),
			Dir: "in", Path: "new", Packet: Packet{Seq: 5000, Len: 200, Ack: 950, Flags: ack}},
		{Name: "new path ack beyond oldSent acks all old data", Vars: base, Dir: "in", Path: "new",
			Packet: Packet{Seq: 5000, Ack: 1500, Flags: ack}},
		{Name: "new path pure ack does not count as new data", Vars: base, Dir: "in", Path: "new",
			Packet: Packet{Seq: 5000, Ack: 950, Flags: ack}},
		{Name: "old path FIN raises oldRcvd by one", Vars: base, Dir: "in", Path: "old",
			Packet: Packet{Seq: 5000, Ack: 1000, Flags: ack | TCPFin}},
		// Deliver: late old-path packets carry the highest ack received.
		{Name: "new path ack far beyond oldSent raises ackHi", Vars: base, Dir: "in", Path: "new",
			Packet: Packet{Seq: 5000, Ack: 900000, Flags: ack}},
		{Name: "late old path data with a stale ack gets ackHi", Vars: with(func(v *TwoPath) { v.AckHi = 900000 }),
			Dir: "in", Path: "old", Packet: Packet{Seq: 4800, Len: 200, Ack: 1000, Flags: ack}},
		{Name: "old path pure ack with a stale ack gets ackHi", Vars: with(func(v *TwoPath) { v.AckHi = 70000 }),
			Dir: "in", Path: "old", Packet: Packet{Seq: 5000, Ack: 950, Flags: ack}},
		{Name: "new path packet keeps its ack", Vars: with(func(v *TwoPath) { v.AckHi = 70000 }),
			Dir: "in", Path: "new", Packet: Packet{Seq: 5100, Len: 10, Ack: 60000, Flags: ack}},
		{Name: "old path RST keeps its ack", Vars: with(func(v *TwoPath) { v.AckHi = 70000 }),
			Dir: "in", Path: "old", Packet: Packet{Seq: 5000, Ack: 950, Flags: ack | TCPRst}},
		{Name: "unknown ackHi: the first ack sets it, nothing raised", Vars: with(func(v *TwoPath) { v.AckHi, v.AckHiOK = 0, false }),
			Dir: "in", Path: "old", Packet: Packet{Seq: 4000, Len: 100, Ack: 0x90000000, Flags: ack}},
		{Name: "ackHi wraps", Vars: with(func(v *TwoPath) { v.AckHi = 0x10 }),
			Dir: "in", Path: "old", Packet: Packet{Seq: 4000, Len: 100, Ack: 0xfffffff0, Flags: ack}},
	}
}

func runVector(v vector) vector {
	switch v.Dir {
	case "out":
		d, after := Decide(v.Vars, v.Packet)
		v.Pieces, v.After = d.List(), after
	case "in":
		p := PathOld
		if v.Path == "new" {
			p = PathNew
		}
		v.Pieces, v.After = nil, Observe(v.Vars, p, v.Packet)
		d := Deliver(v.After, p, v.Packet)
		v.Delivered = &d
	}
	return v
}

// TestTwoPathVectors checks Decide and Observe against the shared vectors
// (go test -run TwoPathVectors -update rewrites them).
func TestTwoPathVectors(t *testing.T) {
	const file = "testdata/twopath_vectors.json"
	var got []vector
	for _, c := range vectorCases() {
		got = append(got, runVector(c))
	}
	if *update {
		b, err := json.MarshalIndent(got, "", "  ")
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(file, append(b, '\n'), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	b, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	var want []vector
	if err := json.Unmarshal(b, &want); err != nil {
		t.Fatal(err)
	}
	for i := range want {
		if r := runVector(want[i]); !reflect.DeepEqual(r, want[i]) {
			t.Errorf("%s:\n got %+v\nwant %+v", want[i].Name, r, want[i])
		}
	}
	if len(want) != len(got) {
		t.Errorf("%d vectors in %s, %d cases: run with -update", len(want), file, len(got))
	}
}

// The tables of §3.5, checked by hand (the vectors pin the same facts for
// the datapath).
func TestDecideTables(t *testing.T) {
	check := func(name string, v TwoPath, p Packet, want []Piece, wantAcked uint32) {
		t.Helper()
		d, after := Decide(v, p)
		if !reflect.DeepEqual(d.List(), want) {
			t.Errorf("%s:\n got %v\nwant %v", name, d.List(), want)
		}
		if after.OldRcvdAcked != wantAcked {
			t.Errorf("%s: oldRcvdAcked %d, want %d", name, after.OldRcvdAcked, wantAcked)
		}
	}
	check("byteSeq < oldSent: old", base, Packet{Seq: 900, Len: 100, Ack: 4500, Flags: ack},
		[]Piece{{Path: PathOld, Seq: 900, Len: 100, Ack: 4500, Flags: ack}}, 4500)
	check("byteSeq ≥ oldSent: new; ack ≤ oldRcvd: old", base, Packet{Seq: 1000, Len: 100, Ack: 5000, Flags: ack},
		[]Piece{{Path: PathNew, Seq: 1000, Len: 100, Ack: 5000, Flags: ack}}, 5000)
	check("straddling oldSent: whole on old, ack lowered to oldRcvd", base, Packet{Seq: 950, Len: 100, Ack: 6000, Flags: ack | TCPFin},
		[]Piece{{Path: PathOld, Seq: 950, Len: 100, Ack: 5000, Flags: ack | TCPFin}}, 5000)
	check("ack > oldRcvd, oldRcvd = oldRcvdAcked: new only", with(func(v *TwoPath) { v.OldRcvdAcked = 5000 }),
		Packet{Seq: 1200, Ack: 6000, Flags: ack}, []Piece{{Path: PathNew, Seq: 1200, Ack: 6000, Flags: ack}}, 5000)
	check("ack > oldRcvd, oldRcvd > oldRcvdAcked: new, counted as acking oldRcvd", base,
		Packet{Seq: 1200, Ack: 6000, Flags: ack},
		[]Piece{{Path: PathNew, Seq: 1200, Ack: 6000, Flags: ack}}, 5000)
	check("pure ack on old never beyond oldSent", base, Packet{Seq: 1200, Ack: 4800, Flags: ack},
		[]Piece{{Path: PathOld, Seq: 1000, Ack: 4800, Flags: ack}}, 4800)
}

func TestDecideFaultAcksOnOldPath(t *testing.T) {
	d, _ := DecideFault(base, Packet{Seq: 1200, Ack: 6000, Flags: ack}, FaultAcksOnOldPath)
	if d.N != 1 || d.Pieces[0].Path != PathOld || d.Pieces[0].Ack != 6000 {
		t.Fatalf("%v", d.List())
	}
}

func TestPredicates(t *testing.T) {
	v := TwoPath{OldSent: 10, OldSentAcked: 10, OldRcvd: 50, OldRcvdAcked: 50}
	if !v.SendDone() {
		t.Error("SendDone")
	}
	if v.RecvDone(0, false) {
		t.Error("RecvDone without new data or cut-off")
	}
	if !v.RecvDone(50, true) || v.RecvDone(60, true) {
		t.Error("RecvDone with the other anchor's cut-off")
	}
	if !v.RecvDone(40, true) {
		t.Error("RecvDone with old-path data beyond the cut-off (a straddling packet)")
	}
	v.NewRcvd, v.FirstNewRcvd = true, 60 // data after a hole: a byte is missing
	if v.RecvDone(0, false) {
		t.Error("RecvDone with firstNewRcvd > oldRcvd")
	}
	v.FirstNewRcvd = 45
	if !v.RecvDone(0, false) {
		t.Error("RecvDone with firstNewRcvd < oldRcvd")
	}
	v.FirstNewRcvd = 50
	if !v.RecvDone(0, false) {
		t.Error("RecvDone with oldRcvd = firstNewRcvd")
	}
	v.OldRcvdAcked = 40
	if v.RecvDone(50, true) {
		t.Error("RecvDone with unacknowledged old data")
	}
	m := Marks{SndNxt: 100, RcvNxt: 200, AckRcvd: 90, AckSent: 150, Sent: true, Rcvd: true}
	m = m.Out(Packet{Seq: 100, Len: 10, Ack: 200, Flags: ack | TCPFin}).In(Packet{Seq: 200, Len: 5, Ack: 111, Flags: ack})
	if got := CutOff(m); got != (TwoPath{OldSent: 111, OldSentAcked: 111, OldRcvd: 205, OldRcvdAcked: 200, AckHi: 111, AckHiOK: true}) {
		t.Errorf("CutOff %+v", got)
	}
	// A joined middlebox whose first packet each way was a retransmission
	// (data up to 5822) and an ack of everything (6027): the acked bytes
	// count as received, or oldRcvd = cut-off would never hold.
	var j Marks
	j = j.In(Packet{Seq: 4822, Len: 1000, Ack: 77, Flags: ack}).Out(Packet{Seq: 77, Ack: 6027, Flags: ack})
	if got := CutOff(j); got.OldRcvd != 6027 || got.OldRcvdAcked != 6027 || !got.RecvDone(6027, true) {
		t.Errorf("CutOff of a joined middlebox %+v", got)
	}
	j = Marks{}.Out(Packet{Seq: 4822, Len: 1000, Ack: 77, Flags: ack}).In(Packet{Seq: 77, Ack: 6027, Flags: ack})
	if got := CutOff(j); got.OldSent != 6027 || !got.SendDone() {
		t.Errorf("CutOff of a joined middlebox, sending side %+v", got)
	}
}

func TestMarksLearnFromFirstPacket(t *testing.T) {
	var m Marks
	if m.Ready() {
		t.Fatal("empty marks ready")
	}
	m = m.Out(Packet{Seq: 0xfffffff0, Ack: 77, Flags: ack}) // a pure ack: seq is the next byte
	m = m.In(Packet{Seq: 500, Len: 10, Ack: 0xfffffff0, Flags: ack})
	if !m.Ready() || m.SndNxt != 0xfffffff0 || m.AckSent != 77 || m.RcvNxt != 510 || m.AckRcvd != 0xfffffff0 {
		t.Fatalf("%+v", m)
	}
	m = m.Out(Packet{Seq: 0xfffffff0, Len: 0x20, Ack: 510, Flags: ack}) // wraps
	if m.SndNxt != 0x10 || m.AckSent != 510 {
		t.Fatalf("%+v", m)
	}
}
