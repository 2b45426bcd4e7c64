package main

import (
	"math"
	"testing"
)

func TestQuantileCountsOnlyTheRunsObservationsAndInterpolatesAsPrometheus(t *testing.T) {
	inf := math.Inf(1)
	before := histogram{0.001: 5, 0.01: 5, 0.1: 5, inf: 5}
	// The run: 90 observations at or below 1 ms, 10 between 10 ms and 100 ms.
	after := histogram{0.001: 95, 0.01: 95, 0.1: 105, inf: 105}
	// Rank 50 of 100 lies in the first bucket, (0, 1 ms], 50 of its 90.
	if got := quantile(0.5, before, after); math.Abs(got-0.001*50/90) > 1e-12 {
		t.Errorf("p50 = %v, want %v", got, 0.001*50/90)
	}
	// Rank 99 of 100 lies in the (10 ms, 100 ms] bucket, 9 of its 10: 10 + 90 × 9/10 ms.
	if got := quantile(0.99, before, after); math.Abs(got-0.091) > 1e-9 {
		t.Errorf("p99 = %v, want 0.091", got)
	}
	if got := quantile(0.99, after, after); got != 0 {
		t.Errorf("p99 without observations = %v, want 0", got)
	}
}
