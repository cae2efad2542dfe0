package bench

// The reconfiguration times of a proxy removal, from the client's history.

import (
	"encoding/json"
	"fmt"
	"math"
	"sort"
	"strings"

	"github.com/dysco/dysco/internal/api"
	"github.com/dysco/dysco/internal/labkit"
)

// RemovalStats summarises the reconfiguration results of the sessions.
type RemovalStats struct {
	Results   int            `json:"results"`
	Succeeded int            `json:"succeeded"`
	Outcomes  map[string]int `json:"outcomes"`
	Reasons   map[string]int `json:"reasons,omitempty"` // "outcome: reason" of the others
	// Named is how many results name one of the benchmark's sessions.
	Named int `json:"named"`
	// Micros are the times of the succeeded results, sorted.
	Micros []int64 `json:"micros"`
	P50ms  float64 `json:"p50_ms"`
	P99ms  float64 `json:"p99_ms"`
	MaxMs  float64 `json:"max_ms"`
	// Under2ms and Under4ms are the fractions of the sessions (of all
	// expected, failed and missing ones counting as over) removed in
	// under 2 and 4 ms, the paper's marks.
	Under2ms float64 `json:"under_2ms"`
	Under4ms float64 `json:"under_4ms"`
	// Phases are the medians of the succeeded results' phases at the
	// left anchor (api.ReconfigResult): locking, setting up the new path,
	// the two-path phase; NaN without phase times (older agents).
	LockP50ms, SetupP50ms, TwoPathP50ms float64 `json:"-"` // MarshalJSON writes them
}

// met tells whether the removal-time target holds: a result for each of
// the n sessions, all succeeded, p50 ≤ 1 ms and p99 ≤ 3 ms.
func (s RemovalStats) met(n int) bool {
	return s.Succeeded == n && s.Results == n && !math.IsNaN(s.P50ms) && s.P50ms <= 1 && s.P99ms <= 3
}

// resultsText describes the results of n sessions for a figure's note.
func (s RemovalStats) resultsText(n int) string {
	return fmt.Sprintf("%d results for %d sessions, %d succeeded; p99 %.2f ms, max %.2f ms; %.1f %% under 2 ms, %.1f %% under 4 ms; %s",
		s.Results, n, s.Succeeded, s.P99ms, s.MaxMs, 100*s.Under2ms, 100*s.Under4ms, labkit.OrText(s.PhasesText(), "phases unknown"))
}

// PhasesText describes the median phases, "" when unknown.
func (s RemovalStats) PhasesText() string {
	if math.IsNaN(s.LockP50ms) {
		return ""
	}
	return fmt.Sprintf("median phases at the left anchor: locking %.2f ms, new path set-up %.2f ms, two-path phase %.2f ms", s.LockP50ms, s.SetupP50ms, s.TwoPathP50ms)
}

// Summarize computes the RemovalStats of the results over n expected sessions,
// whose client ends are locals ("IP:PORT").
func Summarize(results []api.ReconfigResult, n int, locals map[string]bool) RemovalStats {
	s := RemovalStats{Results: len(results), Outcomes: map[string]int{}, Reasons: map[string]int{}}
	var ms, lock, setup, two []float64
	for _, x := range results {
		s.Outcomes[x.Outcome]++
		if src, _, ok := strings.Cut(x.Session, " -> "); ok && locals[src] {
			s.Named++
		}
		if x.Outcome != "succeeded" {
			k := x.Outcome
			if x.Reason != "" {
				k += ": " + x.Reason
			}
			s.Reasons[k]++
			continue
		}
		s.Succeeded++
		s.Micros = append(s.Micros, x.Micros)
		ms = append(ms, float64(x.Micros)/1000)
		if x.LockMicros > 0 && x.SetupMicros >= x.LockMicros {
			lock = append(lock, float64(x.LockMicros)/1000)
			setup = append(setup, float64(x.SetupMicros-x.LockMicros)/1000)
			two = append(two, float64(x.Micros-x.SetupMicros)/1000)
		}
	}
	s.LockP50ms, s.SetupP50ms, s.TwoPathP50ms = labkit.Quantile(lock, 0.5), labkit.Quantile(setup, 0.5), labkit.Quantile(two, 0.5)
	sort.Slice(s.Micros, func(i, j int) bool { return s.Micros[i] < s.Micros[j] })
	s.P50ms, s.P99ms = labkit.Quantile(ms, 0.5), labkit.Quantile(ms, 0.99)
	s.MaxMs = labkit.Quantile(ms, 1)
	if n > 0 {
		for _, m := range ms {
			if m < 2 {
				s.Under2ms++
			}
			if m < 4 {
				s.Under4ms++
			}
		}
		s.Under2ms /= float64(n)
		s.Under4ms /= float64(n)
	}
	return s
}

// NewResults returns the entries of h recorded after prev, an earlier
// reading of the same history: those after prev's last entry, found from
// the end (the agent trims its history when it is long).
func NewResults(prev, h []api.ReconfigResult) []api.ReconfigResult {
	if len(prev) == 0 {
		return h
	}
	last := prev[len(prev)-1]
	for i := len(h) - 1; i >= 0; i-- {
		if h[i] == last {
			return h[i+1:]
		}
	}
	return h
}

// MarshalJSON writes the figures that have no value (no removal succeeded)
// as null: encoding/json refuses NaN.
func (s RemovalStats) MarshalJSON() ([]byte, error) {
	type plain RemovalStats
	num := labkit.JSONNum
	return json.Marshal(struct {
		plain
		P50ms    *float64 `json:"p50_ms"`
		P99ms    *float64 `json:"p99_ms"`
		MaxMs    *float64 `json:"max_ms"`
		Under2ms *float64 `json:"under_2ms"`
		Under4ms *float64 `json:"under_4ms"`
		Lock     *float64 `json:"lock_p50_ms"`
		Setup    *float64 `json:"setup_p50_ms"`
		TwoPath  *float64 `json:"two_path_p50_ms"`
	}{plain(s), num(s.P50ms), num(s.P99ms), num(s.MaxMs), num(s.Under2ms), num(s.Under4ms), num(s.LockP50ms), num(s.SetupP50ms), num(s.TwoPathP50ms)})
}
