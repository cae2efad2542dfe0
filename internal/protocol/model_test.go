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

var defineRe = regexp.MustCompile(`(?m)^#define\s+(Reason[A-Za-z]+|Succeeded|Refused|Failed)\s+(\d+)\s*$`)

// The reasons and outcomes the model uses are #defines with the Go values.
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
		"Succeeded":          int(Succeeded),
		"Refused":            int(Refused),
		"Failed":             int(Failed),
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
	if found < 8 {
		t.Errorf("only %d reason/outcome #defines found in the model", found)
	}
}

// The two-path variables and the lock variables keep their Go names.
func TestModelVariableNames(t *testing.T) {
	src := readModel(t)
	for _, v := range []string{"oldSent", "oldRcvd", "oldSentAcked", "oldRcvdAcked", "firstNewRcvd",
		"newRcvd", "requestor", "rightDelta", "leftDelta", "lock"} {
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
