package labkit

import (
	"math"
	"testing"
)

func TestQuantile(t *testing.T) {
	xs := []float64{5, 1, 4, 2, 3}
	if m := Median(xs); m != 3 {
		t.Errorf("median = %v, want 3", m)
	}
	if q := Quantile(xs, 0.25); q != 2 {
		t.Errorf("quantile 0.25 = %v, want 2", q)
	}
	if q := Quantile([]float64{1, 2}, 0.5); q != 1.5 {
		t.Errorf("median of 1,2 = %v, want 1.5", q)
	}
	if !math.IsNaN(Median(nil)) {
		t.Error("median of nothing is not NaN")
	}
	if xs[0] != 5 {
		t.Error("quantile sorted its argument in place")
	}
}
