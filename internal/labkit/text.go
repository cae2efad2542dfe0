package labkit

// Text and numbers of the reports, shared by the benchmarks and the
// experiments.

import (
	"fmt"
	"math"
	"sort"
	"strings"
)

// FirstN is the first n of xs (all when there are fewer).
func FirstN(xs []string, n int) []string {
	if len(xs) > n {
		return xs[:n]
	}
	return xs
}

// SortedCounts is "KEY ×N" for every key of m, sorted.
func SortedCounts(m map[string]int) []string {
	var out []string
	for k, v := range m {
		out = append(out, fmt.Sprintf("%s ×%d", k, v))
	}
	sort.Slice(out, func(i, j int) bool { return out[i] < out[j] })
	return out
}

// CountsText is "KEY N, ..." for every key of m, in key order.
func CountsText(m map[string]uint64) string {
	var ks []string
	for k := range m {
		ks = append(ks, k)
	}
	sort.Strings(ks)
	var out []string
	for _, k := range ks {
		out = append(out, fmt.Sprintf("%s %d", k, m[k]))
	}
	return strings.Join(out, ", ")
}

// OrText is s, or alt when s is empty.
func OrText(s, alt string) string {
	if s == "" {
		return alt
	}
	return s
}

// Plural is "s" unless n is 1.
func Plural(n int) string {
	if n == 1 {
		return ""
	}
	return "s"
}

// JSONNum is v for encoding/json, or nil (null) when v is NaN or infinite,
// which encoding/json refuses.
func JSONNum(v float64) *float64 {
	if math.IsNaN(v) || math.IsInf(v, 0) {
		return nil
	}
	return &v
}
