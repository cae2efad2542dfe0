package protocol

import (
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
)

// The Promela model (model/dysco.pml, docs/verification.md) uses the Go
// names. This test parses its declarations and fails when they and the Go
// enumerations diverge. It does not need Spin.

func readModel(t *testing.T) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("..", "..", "model", "dysco.pml"))
	if err != nil {
		t.Fatalf("reading the model: %v", err)
	}
	return string(b)
}

var mtypeDecl = regexp.MustCompile(`(?s)/\*\s*([A-Za-z]+)\b[^*]*\*/\s*mtype\s*=\s*\{([^}]*)\}`)

// modelMtypes returns the mtype declarations of the model, keyed by the
// first word of the comment before each (e.g. "MsgTypes").
func modelMtypes(t *testing.T, src string) map[string][]string {
	t.Helper()
	out := map[string][]string{}
	for _, m := range mtypeDecl.FindAllStringSubmatch(src, -1) {
		var names []string
		for _, n := range strings.Split(m[2], ",") {
			if n = strings.TrimSpace(n); n != "" {
				names = append(names, n)
			}
		}
		out[m[1]] = names
	}
	return out
}

func equalNames(t *testing.T, what string, model, gonames []string) {
	t.Helper()
	if strings.Join(model, ",") != strings.Join(gonames, ",") {
		t.Errorf("%s: model declares %v, Go has %v (same names, same order)", what, model, gonames)
	}
}

func TestModelEnumerations(t *testing.T) {
	src := readModel(t)
	decls := modelMtypes(t, src)

	var msgs []string
	for _, m := range MsgTypes {
		msgs = append(msgs, m.String())
	}
	equalNames(t, "MsgTypes", decls["MsgTypes"], msgs)

	var locks []string
	for _, l := range LockStates {
		locks = append(locks, l.String())
	}
	equalNames(t, "LockStates", decls["LockStates"], locks)

	var stages []string
	for _, s := range Stages {
		stages = append(stages, s.String())
	}
	equalNames(t, "Stages", decls["Stages"], stages)
}

var defineRe = regexp.MustCompile(`(?m)^#define\s+(Reason[A-Za-z]+|Succeeded|Refused|Failed|res[A-Z][A-Za-z]+|Timer[A-Z][A-Za-z]+)\s+(\d+)\s*$`)

// The reasons, outcomes, resolution kinds (the history answering
// retransmissions) and timer kinds the model uses are #defines with the Go
// values.
func TestModelReasonsAndOutcomes(t *testing.T) {
	src := readModel(t)
	goValues := map[string]int{
		"ReasonNone":         int(ReasonNone),
		"ReasonLocked":       int(ReasonLocked),
		"ReasonBusy":         int(ReasonBusy),
		"ReasonNotOnPath":    int(ReasonNotOnPath),
		"ReasonInvalid":      int(ReasonInvalid),
		"ReasonNoSession":    int(ReasonNoSession),
		"ReasonTimeout":      int(ReasonTimeout),
		"ReasonSetupFailed":  int(ReasonSetupFailed),
		"ReasonSessionEnded": int(ReasonSessionEnded),
		"ReasonStale":        int(ReasonStale),
		"ReasonAborted":      int(ReasonAborted),
		"ReasonOnPath":       int(ReasonOnPath),
		"ReasonNotNextHop":   int(ReasonNotNextHop),
		"Succeeded":          int(Succeeded),
		"Refused":            int(Refused),
		"Failed":             int(Failed),
		"resNacked":          int(resNacked),
		"resCancelled":       int(resCancelled),
		"resDone":            int(resDone),
		"resExpired":         int(resExpired),
		"TimerRequest":       int(TimerRequest),
		"TimerSyn":           int(TimerSyn),
		"TimerCancel":        int(TimerCancel),
		"TimerFin":           int(TimerFin),
		"TimerLease":         int(TimerLease),
		"TimerTrigger":       int(TimerTrigger),
		"TimerMigrateMsg":    int(TimerMigrateMsg),
	}
	found := 0
	for _, m := range defineRe.FindAllStringSubmatch(src, -1) {
		want, ok := goValues[m[1]]
		if !ok {
			t.Errorf("model defines %s, which Go does not have", m[1])
			continue
		}
		got, _ := strconv.Atoi(m[2])
		if got != want {
			t.Errorf("%s: model %d, Go %d", m[1], got, want)
		}
		found++
	}
	if found < 17 {
		t.Errorf("only %d reason/outcome/resolution/timer #defines found in the model", found)
	}
}

// modelOnly are the model's inline procedures that have no method of the
// same name in the package: the network, the datapath and the end hosts
// (tcp.pml, udp.pml), and the model's own checks and bookkeeping.
var modelOnly = map[string]bool{
	"ctl":            true, // a send on the lossy network
	"ctlA":           true, // the same, with a second value (requestLock's leftDelta)
	"dropped":        true, // a rejected message is lost for its sender
	"startReq":       true, // onReconfigure + startLeft
	"newRequestLock": true, // onRequestLock after its checks for duplicates
	"middleFinAck":   true, // onFinAck + onLinger at a middle agent
	"startTwoPath":   true, // switchPaths + the datapath's CutOff
	"releaseHold":    true, // the datapath's ReleaseHold (migReleaseLeft, migReleaseRight)
	"put":            true,
	"egress":         true,
	"hostSend":       true,
	"hostRecv":       true,
	"tcpIn":          true,
	"setup":          true,
	"finalCheck":     true,
}

var inlineRe = regexp.MustCompile(`(?m)^inline\s+([A-Za-z]+)\s*\(`)

// Every inline procedure of the model that stands for a step of the Go
// agent is named after the Agent method it mirrors.
func TestModelProcedureNames(t *testing.T) {
	var src strings.Builder
	for _, f := range []string{"dysco.pml", "agent.pml", "tcp.pml", "udp.pml"} {
		b, err := os.ReadFile(filepath.Join("..", "..", "model", f))
		if err != nil {
			t.Fatalf("reading the model: %v", err)
		}
		src.Write(b)
	}
	goSrc := agentSource(t)
	n := 0
	for _, m := range inlineRe.FindAllStringSubmatch(src.String(), -1) {
		name := m[1]
		if modelOnly[name] {
			continue
		}
		n++
		if !regexp.MustCompile(`func \(a \*Agent\) ` + name + `\(`).Match(goSrc) {
			t.Errorf("model procedure %s: the package has no Agent method %s", name, name)
		}
	}
	if n < 10 {
		t.Errorf("only %d model procedures named after Go methods", n)
	}
}

// The two-path variables and the lock variables keep their Go names.
func TestModelVariableNames(t *testing.T) {
	src := readModel(t)
	for _, v := range []string{"oldSent", "oldRcvd", "oldSentAcked", "oldRcvdAcked", "firstNewRcvd",
		"newRcvd", "requestor", "rightDelta", "leftDelta", "lock", "joinReq"} {
		if !regexp.MustCompile(`\b` + v + `\[`).MatchString(src) {
			t.Errorf("model does not declare %s", v)
		}
	}
	// TwoPath still uses those names.
	for _, v := range []string{"oldSent", "oldRcvd", "oldSentAcked", "oldRcvdAcked", "firstNewRcvd"} {
		if !strings.Contains(TwoPath{}.String(), v+"=") {
			t.Errorf("TwoPath no longer names %s", v)
		}
	}
}

// The parser itself: a divergence is detected.
func TestModelEnumerationsParser(t *testing.T) {
	d := modelMtypes(t, "/* MsgTypes (x). */\nmtype = { a, b };\n/* LockStates */ mtype = {c};")
	if strings.Join(d["MsgTypes"], ",") != "a,b" || strings.Join(d["LockStates"], ",") != "c" {
		t.Fatalf("parser: %v", d)
	}
}

// agentSource is the Go source of the package's non-test files, where the
// Agent's methods are.
func agentSource(t *testing.T) []byte {
	t.Helper()
	files, err := filepath.Glob("*.go")
	if err != nil {
		t.Fatal(err)
	}
	var src []byte
	for _, f := range files {
		if strings.HasSuffix(f, "_test.go") {
			continue
		}
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		src = append(src, b...)
	}
	return src
}
