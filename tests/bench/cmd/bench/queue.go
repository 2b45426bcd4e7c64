package main

// The controller's own account of B1's queue latency: workqueue_queue_duration_seconds, the
// controller-runtime histogram Capstan exports on /metrics (from an object's work arriving to a
// worker taking it), read before and after a run so that only the run's objects count.

import (
	"bufio"
	"context"
	"fmt"
	"net/http"
	"sort"
	"strconv"
	"strings"
	"time"
)

// histogram is a cumulative histogram: count of observations at or below each bound.
type histogram map[float64]float64

// scrapeQueueDuration reads workqueue_queue_duration_seconds of every resource from the
// controller at addr, summed over resources.
func scrapeQueueDuration(ctx context.Context, addr string) (histogram, error) {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+addr+"/metrics", nil)
	if err != nil {
		return nil, err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("/metrics answered %s", resp.Status)
	}
	h := histogram{}
	scanner := bufio.NewScanner(resp.Body)
	scanner.Buffer(make([]byte, 1<<20), 1<<20)
	for scanner.Scan() {
		line := scanner.Text()
		if !strings.HasPrefix(line, "workqueue_queue_duration_seconds_bucket{") {
			continue
		}
		i := strings.Index(line, `le="`)
		if i < 0 {
			continue
		}
		rest := line[i+4:]
		j := strings.IndexByte(rest, '"')
		k := strings.LastIndexByte(line, ' ')
		if j < 0 || k < 0 {
			continue
		}
		bound, err1 := strconv.ParseFloat(strings.Replace(rest[:j], "+Inf", "Inf", 1), 64)
		value, err2 := strconv.ParseFloat(line[k+1:], 64)
		if err1 != nil || err2 != nil {
			continue
		}
		h[bound] += value
	}
	return h, scanner.Err()
}

// quantile of the observations in after but not in before, as Prometheus's
// histogram_quantile computes it (linear within the bucket); 0 without observations.
func quantile(q float64, before, after histogram) float64 {
	bounds := make([]float64, 0, len(after))
	for b := range after {
		bounds = append(bounds, b)
	}
	sort.Float64s(bounds)
	if len(bounds) == 0 {
		return 0
	}
	total := after[bounds[len(bounds)-1]] - before[bounds[len(bounds)-1]]
	if total <= 0 {
		return 0
	}
	rank := q * total
	lower, below := 0.0, 0.0
	for _, b := range bounds {
		count := after[b] - before[b]
		if count >= rank {
			if b > 1e300 {
				return lower
			}
			if count == below {
				return b
			}
			return lower + (b-lower)*(rank-below)/(count-below)
		}
		lower, below = b, count
	}
	return lower
}
