package bench

// The churn runner's reconfiguration rounds: what each asks of which
// sessions, and how each result is set against its session's fate.

import (
	"context"
	"encoding/json"
	"fmt"
	"net/netip"
	"slices"
	"sort"
	"strings"
	"time"

	"github.com/dysco/dysco/internal/api"
	"github.com/dysco/dysco/internal/labkit"
)

// rounds runs the reconfiguration rounds.
func (c *churn) rounds(ctx context.Context) error {
	s := c.spec
	first := s.Start
	if s.Duration > 0 {
		first = min(first, s.Duration)
	}
	if err := labkit.SleepCtx(ctx, first); err != nil {
		return err
	}
	var prev *ChurnRound
	follow := false
	lastLog := time.Now()
	for n := 1; ; n++ {
		if s.MaxRounds > 0 && n > s.MaxRounds || s.Duration > 0 && time.Since(c.t0) >= s.Duration {
			return nil
		}
		rd, f := c.nextRound(n, prev, follow)
		follow = len(s.Alternate) == 0 && c.rng.Float64() < s.FollowUps
		c.runRound(ctx, rd, f)
		c.res.Rounds = append(c.res.Rounds, rd)
		if ctx.Err() != nil {
			return ctx.Err()
		}
		prev = rd
		if time.Since(lastLog) >= 5*time.Second || s.MaxRounds > 0 && s.MaxRounds <= 30 {
			lastLog = time.Now()
			c.logf("t=%.1f s: round %d (%s) %s", time.Since(c.t0).Seconds(), n, rd.Family, roundLine(rd))
		}
		if !follow {
			if err := labkit.SleepCtx(ctx, s.Interval); err != nil {
				return err
			}
		}
	}
}

// roundLine describes a round's outcome in one line.
func roundLine(rd *ChurnRound) string {
	chain := strings.Join(rd.Chain, ",")
	if chain == "" {
		chain = "(none)"
	}
	if rd.Err != "" {
		return fmt.Sprintf("%q → %s: error %s", rd.Match, chain, rd.Err)
	}
	n := map[string]int{}
	var worst int64
	for _, o := range rd.Results {
		n[o.Outcome]++
		worst = max(worst, o.Micros)
	}
	f := ""
	if rd.FollowUp {
		f = ", follow-up"
	}
	return fmt.Sprintf("%q → %s%s: %d results, %d succeeded, %d refused, %d failed, slowest %.1f ms, %.0f ms wall",
		rd.Match, chain, f, len(rd.Results), n["succeeded"], n["refused"], n["failed"], float64(worst)/1000, rd.WallMs)
}

// nextRound picks round n's family, match and chain.
func (c *churn) nextRound(n int, prev *ChurnRound, follow bool) (*ChurnRound, *churnFam) {
	s := c.spec
	rd := &ChurnRound{N: n}
	if len(s.Alternate) > 0 {
		f := c.fams[0]
		rd.Family, rd.Match, rd.To = f.name, f.filter(labkit.HTTPPort), f.server.String()
		rd.Chain = []string{s.Alternate[(n-1)%len(s.Alternate)]}
		return rd, f
	}
	type target struct {
		ports []int
		chain []string // the policy's, nil for several ports
	}
	targets := []target{{[]int{labkit.HTTPPort}, s.HTTPChain}}
	all := []int{labkit.HTTPPort}
	if s.Streams > 0 {
		targets = append(targets, target{[]int{churnStreamPort}, s.StreamChain})
		all = append(all, churnStreamPort)
	}
	if s.Shorts > 0 {
		targets = append(targets, target{[]int{churnShortPort}, s.ShortChain})
		all = append(all, churnShortPort)
	}
	if len(all) > 1 {
		targets = append(targets, target{all, nil})
	}
	var f *churnFam
	var t target
	if follow && prev != nil {
		rd.FollowUp = true
		for _, x := range c.fams {
			if x.name == prev.Family {
				f = x
			}
		}
		for _, x := range targets {
			if f.filter(x.ports...) == prev.Match {
				t = x
			}
		}
	} else {
		f = c.fams[c.rng.IntN(len(c.fams))]
		t = targets[c.rng.IntN(len(targets))]
	}
	rd.Family, rd.Match, rd.To = f.name, f.filter(t.ports...), f.server.String()
	last, hasLast := c.last[rd.Match]
	for {
		switch x := c.rng.Float64(); {
		case x < 0.15 && hasLast:
			// The chain of the last round on these sessions: those it
			// reconfigured, and still alive, are on it already.
			rd.Chain = slices.Clone(last)
		case x < 0.3 && t.chain != nil:
			// The policy's chain: the path of the sessions opened since.
			rd.Chain = slices.Clone(t.chain)
		case x < 0.45:
			rd.Chain = nil
		case x < 0.85 || len(s.Middleboxes) < 2:
			rd.Chain = []string{s.Middleboxes[c.rng.IntN(len(s.Middleboxes))]}
		default:
			p := c.rng.Perm(len(s.Middleboxes))
			rd.Chain = []string{s.Middleboxes[p[0]], s.Middleboxes[p[1]]}
		}
		// A follow-up asks for another path than the round before.
		if !rd.FollowUp || !slices.Equal(rd.Chain, prev.Chain) {
			break
		}
	}
	return rd, f
}

// churnKind tells what a chain asks of a session on path cur.
func churnKind(cur, next []string) string {
	switch {
	case slices.Equal(cur, next):
		return "unchanged"
	case slices.ContainsFunc(next, func(h string) bool { return slices.Contains(cur, h) }):
		return "overlap"
	case len(cur) == 0:
		return "insert"
	case len(next) == 0:
		return "delete"
	}
	return "replace"
}

// runRound runs one round and records its results.
func (c *churn) runRound(ctx context.Context, rd *ChurnRound, f *churnFam) {
	args := []string{"reconfig", "--json", "--match", rd.Match, "--to", rd.To}
	if len(rd.Chain) > 0 {
		args = append(args, "--chain", strings.Join(f.addrs(rd.Chain), ","))
	}
	t := time.Now()
	rd.At = t.Sub(c.t0).Seconds()
	out, err := c.dysco(ctx, "client", 90*time.Second, args...)
	rd.WallMs = float64(time.Since(t).Microseconds()) / 1000
	var rep api.ReconfigReply
	if jerr := json.Unmarshal([]byte(out), &rep); jerr != nil {
		if err == nil {
			err = jerr
		}
		rd.Err = strings.TrimSpace(labkit.Tail(err.Error(), 400))
		// "no live session matches" is not an error of the product.
		if !strings.Contains(err.Error(), "no live session") {
			c.res.Errors = append(c.res.Errors, fmt.Sprintf("round %d (%s %q): %s", rd.N, rd.Family, rd.Match, rd.Err))
		}
		return
	}
	c.last[rd.Match] = rd.Chain
	for _, r := range rep.Results {
		o := &ChurnOutcome{ReconfigResult: r}
		o.Path = c.pathOf(r)
		o.Kind = churnKind(o.Path, rd.Chain)
		if r.Outcome == "succeeded" {
			c.paths[pathKey(r)] = slices.Clone(rd.Chain)
		}
		rd.Results = append(rd.Results, o)
	}
}

// pathKey names a session at the client's agent: its id there and its
// tuple.
func pathKey(r api.ReconfigResult) string { return fmt.Sprintf("%d %s", r.ID, r.Session) }

// pathOf is the path the runner knows a session has: the chain of its last
// successful round, or its policy's.
func (c *churn) pathOf(r api.ReconfigResult) []string {
	if p, ok := c.paths[pathKey(r)]; ok {
		return p
	}
	_, dst, ok := parseSession(r.Session)
	if !ok {
		return nil
	}
	switch dst.Port() {
	case churnStreamPort:
		return c.spec.StreamChain
	case churnShortPort:
		return c.spec.ShortChain
	}
	return c.spec.HTTPChain
}

// parseSession splits "SRC:PORT -> DST:PORT".
func parseSession(s string) (src, dst netip.AddrPort, ok bool) {
	a, b, found := strings.Cut(s, " -> ")
	if !found {
		return src, dst, false
	}
	src, err1 := netip.ParseAddrPort(a)
	dst, err2 := netip.ParseAddrPort(b)
	if err1 != nil || err2 != nil {
		return src, dst, false
	}
	return netip.AddrPortFrom(src.Addr().Unmap(), src.Port()), netip.AddrPortFrom(dst.Addr().Unmap(), dst.Port()), true
}

// evaluate sets every result against its session's fate and gathers the
// problems.
func (c *churn) evaluate() {
	r := c.res
	var ms []float64
	for i, rd := range r.Rounds {
		end := rd.At + rd.WallMs/1000
		for _, o := range rd.Results {
			r.Kinds[o.Kind]++
			k := o.Outcome
			if o.Reason != "" {
				k += ": " + o.Reason
			}
			r.Outcomes[k]++
			if o.Outcome == "succeeded" {
				ms = append(ms, float64(o.Micros)/1000)
			}
			src, dst, _ := parseSession(o.Session)
			o.Fate = "unseen"
			if c.socks != nil {
				o.Fate = c.socks.fate(src, dst, end)
			}
			ended := strings.Contains(o.Reason, "session ended")
			what := fmt.Sprintf("round %d (%s, %q → %s), session %s (%s, path %s): %s%s after %.1f ms",
				i+1, rd.Family, rd.Match, labkit.OrText(strings.Join(rd.Chain, ","), "no middlebox"), o.Session, o.Kind,
				labkit.OrText(strings.Join(o.Path, ","), "none"), o.Outcome, prefixed(": ", o.Reason), float64(o.Micros)/1000)
			switch {
			case o.Outcome == "succeeded":
			case ended && o.Fate == "alive":
				o.Classes = append(o.Classes, ClassClaimedEnded)
			case ended:
			case o.Fate == "alive" && !(o.Outcome == "refused" && o.Kind == "overlap"):
				o.Classes = append(o.Classes, ClassLiveNotReconfigured)
			case o.Fate != "alive" && o.Outcome == "failed":
				o.Classes = append(o.Classes, ClassEndedOtherReason)
			}
			if time.Duration(o.Micros)*time.Microsecond > c.spec.SlowAfter && !(ended && o.Fate != "alive") {
				o.Classes = append(o.Classes, ClassSlow)
			}
			for _, cl := range o.Classes {
				if cl == ClassSlow {
					c.problem("stuck", "%s: %s (socket %s)", what, cl, o.Fate)
				} else {
					r.Unexpected = append(r.Unexpected, fmt.Sprintf("%s: %s (socket %s)", what, cl, o.Fate))
				}
			}
		}
	}
	sort.Float64s(ms)
	r.Times = ChurnTimes{N: len(ms), P50: labkit.Quantile(ms, 0.5), P90: labkit.Quantile(ms, 0.9), P99: labkit.Quantile(ms, 0.99), Max: labkit.Quantile(ms, 1)}
	for _, w := range r.Wrk {
		if n := w.SocketErrors(); n > 0 {
			c.problem("resets", "wrk (%s): socket errors: connect %d, read %d, write %d, timeout %d", w.Family, w.Connect, w.Read, w.Write, w.Timeout)
		}
		if w.Non2xx > 0 {
			c.problem("failed", "wrk (%s): %d non-2xx responses", w.Family, w.Non2xx)
		}
		if w.Requests == 0 {
			r.Errors = append(r.Errors, fmt.Sprintf("wrk (%s) reported no requests: %s", w.Family, labkit.Tail(w.Output, 300)))
		}
	}
	var keys []string
	for k := range r.KernelResets {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		if v := r.KernelResets[k]; v > 0 {
			c.problem("resets", "%s went up by %d during the workload", k, v)
		}
	}
	if c.spec.Streams > 0 {
		r.Streams = c.streams.result()
	}
	if c.spec.Shorts > 0 {
		r.Shorts = c.shorts.result()
	}
	c.mu.Lock()
	r.Resets = append(r.Resets, c.problems["resets"]...)
	r.Failed = append(r.Failed, c.problems["failed"]...)
	r.Stuck = append(r.Stuck, c.problems["stuck"]...)
	c.mu.Unlock()
	if c.socks != nil {
		r.SocketPolls, r.SocketLives = c.socks.stats()
	}
}

func prefixed(p, s string) string {
	if s == "" {
		return ""
	}
	return p + s
}
