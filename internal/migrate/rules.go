package migrate

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os/exec"
	"slices"
	"strings"
	"sync"
)

// A conntrack entry lets a session through a firewall only together with
// the rules that accept its established packets (and, for marked entries,
// the rules that act on the mark). The "conntrack" plug-in records those
// rules of the exporting host with the entries and, on import, refuses a
// host that lacks one of them: the entry alone would not let the session
// through there.
//
// The check is deliberately simple. Rules come from iptables-save or
// ip6tables-save (every table it prints). A rule is recorded when it
// matches conntrack state ESTABLISHED or RELATED (-m conntrack --ctstate,
// -m state --state), or, when an entry has a non-zero mark, when it uses
// the conntrack mark (-m connmark, --ctmark, CONNMARK --restore-mark).
// Rules compare as normalized text: comments dropped, interface names
// (-i/-o) dropped since hosts name their interfaces differently, state lists
// sorted. Chain policies, rule order and native nftables rules are not
// compared.

// fwRule is one recorded firewall rule.
type fwRule struct {
	Table string `json:"table"`
	Rule  string `json:"rule"` // normalized, "-A CHAIN ..."
}

func (r fwRule) String() string { return fmt.Sprintf("%q (table %s)", r.Rule, r.Table) }

// saveCommand returns the iptables-save flavour of an address family.
func saveCommand(v4 bool) string {
	if v4 {
		return "iptables-save"
	}
	return "ip6tables-save"
}

// errNoIptables: the host has no iptables-save; its rules are not recorded.
var errNoIptables = errors.New("iptables-save not installed")

// ruleReads coalesces concurrent reads of the rules: a burst of exports
// (a firewall replaced under a hundred sessions) runs the save command once
// per family at a time instead of once per session. A caller that arrives
// while a read runs shares it, so the rules it gets may be older than its
// request by at most that read's duration (milliseconds). The caller that
// starts a read runs it on its own thread: tests switch network namespaces
// per thread.
var ruleReads struct {
	mu      sync.Mutex
	running [2]*ruleRead // by family
}

type ruleRead struct {
	done  chan struct{}
	rules []fwRule
	err   error
}

// hostRules returns every rule of the host, normalized.
func hostRules(ctx context.Context, v4 bool) ([]fwRule, error) {
	fam := 0
	if v4 {
		fam = 1
	}
	ruleReads.mu.Lock()
	if r := ruleReads.running[fam]; r != nil {
		ruleReads.mu.Unlock()
		select {
		case <-r.done:
			return r.rules, r.err
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
	r := &ruleRead{done: make(chan struct{})}
	ruleReads.running[fam] = r
	ruleReads.mu.Unlock()
	r.rules, r.err = readRules(ctx, v4)
	ruleReads.mu.Lock()
	ruleReads.running[fam] = nil
	ruleReads.mu.Unlock()
	close(r.done)
	return r.rules, r.err
}

// readRules runs the save command and returns every rule, normalized.
func readRules(ctx context.Context, v4 bool) ([]fwRule, error) {
	name := saveCommand(v4)
	path, err := exec.LookPath(name)
	if err != nil {
		return nil, errNoIptables
	}
	var stderr bytes.Buffer
	cmd := exec.CommandContext(ctx, path)
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return nil, fmt.Errorf("%s: %w: %s", name, err, strings.TrimSpace(stderr.String()))
	}
	return parseSave(string(out)), nil
}

// parseSave returns the rules of iptables-save output, normalized.
func parseSave(out string) []fwRule {
	var rules []fwRule
	table := ""
	for line := range strings.SplitSeq(out, "\n") {
		line = strings.TrimSpace(line)
		switch {
		case strings.HasPrefix(line, "*"):
			table = line[1:]
		case strings.HasPrefix(line, "-A "):
			rules = append(rules, fwRule{Table: table, Rule: normalizeRule(splitRule(line))})
		case strings.HasPrefix(line, "[") && strings.Contains(line, "] -A "):
			// iptables-save -c: counters first.
			_, r, _ := strings.Cut(line, "] ")
			rules = append(rules, fwRule{Table: table, Rule: normalizeRule(splitRule(r))})
		}
	}
	return rules
}

// splitRule splits a rule line into words, keeping quoted strings ("a b",
// with \" inside) as one word without their quotes.
func splitRule(line string) []string {
	var words []string
	var cur strings.Builder
	inWord, quoted := false, false
	for i := 0; i < len(line); i++ {
		c := line[i]
		switch {
		case quoted && c == '\\' && i+1 < len(line):
			i++
			cur.WriteByte(line[i])
		case c == '"':
			quoted = !quoted
			inWord = true
		case !quoted && (c == ' ' || c == '\t'):
			if inWord {
				words = append(words, cur.String())
				cur.Reset()
				inWord = false
			}
		default:
			cur.WriteByte(c)
			inWord = true
		}
	}
	if inWord {
		words = append(words, cur.String())
	}
	return words
}

// normalizeRule drops what may differ between equivalent rules of two hosts
// (comments, interface names) and sorts state lists.
func normalizeRule(w []string) string {
	var out []string
	for i := 0; i < len(w); i++ {
		switch w[i] {
		case "-m":
			if i+1 < len(w) && w[i+1] == "comment" {
				i++
				continue
			}
		case "--comment":
			i++
			continue
		case "!":
			if i+1 < len(w) && isIfaceOpt(w[i+1]) {
				i += 2
				continue
			}
		case "--ctstate", "--state":
			out = append(out, w[i])
			if i+1 < len(w) {
				s := strings.Split(w[i+1], ",")
				slices.Sort(s)
				out = append(out, strings.Join(s, ","))
				i++
			}
			continue
		}
		if isIfaceOpt(w[i]) {
			i++
			continue
		}
		out = append(out, w[i])
	}
	return strings.Join(out, " ")
}

func isIfaceOpt(w string) bool {
	return w == "-i" || w == "-o" || w == "--in-interface" || w == "--out-interface"
}

// concerns tells whether a normalized rule is one a migrated entry relies
// on: it matches established or related traffic, or (marked is true) it
// uses the conntrack mark.
func concerns(rule string, marked bool) bool {
	w := strings.Fields(rule)
	for i, x := range w {
		if (x == "--ctstate" || x == "--state") && i+1 < len(w) {
			if strings.Contains(w[i+1], "ESTABLISHED") || strings.Contains(w[i+1], "RELATED") {
				return true
			}
		}
		if marked && (x == "--ctmark" || x == "--restore-mark" || (x == "connmark" && i > 0 && w[i-1] == "-m")) {
			return true
		}
	}
	return false
}

// relevantRules returns the rules among all that a migrated entry relies on.
func relevantRules(all []fwRule, marked bool) []fwRule {
	var out []fwRule
	for _, r := range all {
		if concerns(r.Rule, marked) && !slices.Contains(out, r) {
			out = append(out, r)
		}
	}
	return out
}

// missingRules returns the recorded rules that have no equal among have.
func missingRules(recorded, have []fwRule) []fwRule {
	var out []fwRule
	for _, r := range recorded {
		if !slices.Contains(have, r) {
			out = append(out, r)
		}
	}
	return out
}
