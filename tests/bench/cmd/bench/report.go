package main

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"time"
)

type machine struct {
	Cores      int     `json:"cores"`
	CPU        string  `json:"cpu"`
	MemoryGiB  float64 `json:"memory_gib"`
	Kernel     string  `json:"kernel"`
	LoadBefore string  `json:"load_before"`
	LoadAfter  string  `json:"load_after"`
}

type b1Result struct {
	N       int     `json:"n"`
	TotalS  float64 `json:"total_s"`  // first create sent → last marker observed
	CreateS float64 `json:"create_s"` // just creating the N objects
	PerS    float64 `json:"objects_per_s"`
	P50Ms   float64 `json:"p50_ms"` // create acknowledged → marker observed
	P99Ms   float64 `json:"p99_ms"`
	CPUS    float64 `json:"controller_cpu_s"`
	// CPU of the other processes over the same interval, to tell who the bottleneck is.
	HandlerCPUS   float64 `json:"handler_cpu_s"`
	APIServerCPUS float64 `json:"apiserver_cpu_s"`
	DriverCPUS    float64 `json:"driver_cpu_s"`
	// QueueP99Ms is the p99 of the controller's own workqueue_queue_duration_seconds over the
	// run (Capstan only): from an object's work arriving to a worker taking it.
	QueueP99Ms float64 `json:"workqueue_queue_p99_ms,omitempty"`
}

type memAt struct {
	Objects int    `json:"objects"`
	Memory  memory `json:"memory"`
	// Handler is the handler process's memory at the same moment (Capstan only): with the
	// controller's, the pod's total.
	Handler *memory `json:"handler,omitempty"`
	// APIServer is the API server's memory (with its embedded etcd) at the same moment: which
	// part of a cluster's memory the objects themselves cost.
	APIServer *memory `json:"apiserver,omitempty"`
	Seconds   float64 `json:"seconds,omitempty"`
	// ProbeS: a new object created as the restarted process starts, create → handled.
	ProbeS float64 `json:"probe_s,omitempty"`
	// ProbeAfterS: the same with the object created 1 s after another restart, while the
	// controller lists the objects (one created before its LIST is among those listed).
	ProbeAfterS float64 `json:"probe_after_s,omitempty"`
}

type b2Result struct {
	Idle    *memory `json:"idle"`
	Steady  []memAt `json:"steady"`
	Restart *memAt  `json:"restart"`
}

type b5Result struct {
	M           int     `json:"m"`
	ListFirstMs float64 `json:"raw_list_first_page_ms"`
	ListAllMs   float64 `json:"raw_list_all_ms"`
	FirstCallMs float64 `json:"first_call_ms"`
	AllHandledS float64 `json:"all_handled_s"`
	Memory      *memory `json:"memory"`
	// Steady is the memory of a fresh controller process started with the M objects handled,
	// a settle time after its start: the HWM in Memory is the start-up's peak, judged
	// against it.
	Steady *memory `json:"steady,omitempty"`
	// CPU of the controller from its start and of the API server over the same time, until
	// all M were handled.
	CPUS          float64 `json:"controller_cpu_s"`
	APIServerCPUS float64 `json:"apiserver_cpu_s"`
	APIServer     *memory `json:"apiserver,omitempty"`
	// FreshMs: an object created once the first of the M was handled, while the rest
	// drain, create → handled.
	FreshMs float64 `json:"fresh_ms,omitempty"`
}

type b4Result struct {
	Controller   string         `json:"controller"`
	Scenario     string         `json:"scenario"`
	Namespace    string         `json:"namespace"`
	From         time.Time      `json:"from"`
	To           time.Time      `json:"to"`
	ObjectOnly   bool           `json:"object_only"`
	HandlerCalls int            `json:"handler_calls"`
	Total        int            `json:"writes"`
	ObjectWrites int            `json:"object_writes"` // to the object and its status
	Events       int            `json:"event_writes"`  // Kubernetes Events posted
	Writes       map[string]int `json:"writes_by_kind"`
	Reads        int            `json:"reads"`
	UserAgents   []string       `json:"user_agents"`
	// The Events in the scenario's namespace after it (all scenarios of that namespace).
	EventMessages []string `json:"events_in_namespace,omitempty"`
}

type hopResult struct {
	Handler     string  `json:"handler"`
	Calls       int     `json:"calls"`
	P50Us       float64 `json:"p50_us"`
	P99Us       float64 `json:"p99_us"`
	RawP50Us    float64 `json:"raw_socket_p50_us"`
	PipelinedPS float64 `json:"pipelined_per_s"`
	InFlight    int     `json:"in_flight"`
	Error       string  `json:"error,omitempty"`
}

type serialResult struct {
	N               int     `json:"n"`
	P50Ms           float64 `json:"p50_ms"`
	P99Ms           float64 `json:"p99_ms"`
	AnnotationBytes int     `json:"annotation_bytes_per_object"`
}

type controllerResult struct {
	Name   string        `json:"name"`
	Serial *serialResult `json:"serial"`
	B1     []b1Result    `json:"b1"`
	B2     b2Result      `json:"b2"`
	B5     []b5Result    `json:"b5"`
	Notes  []string      `json:"notes,omitempty"`
}

type results struct {
	Started     time.Time           `json:"started"`
	Finished    time.Time           `json:"finished"`
	Smoke       bool                `json:"smoke"`
	Large       bool                `json:"large"`
	Sizes       []int               `json:"sizes"`
	KopfMax     int                 `json:"kopf_max"`
	Machine     machine             `json:"machine"`
	Versions    map[string]string   `json:"versions"`
	Controllers []*controllerResult `json:"controllers"`
	B4          []*b4Result         `json:"b4"`
	B3          []hopResult         `json:"b3"`
	Notes       []string            `json:"notes,omitempty"`
	Failures    []string            `json:"failures,omitempty"`
}

func (r *results) controller(prefix string) *controllerResult {
	for _, c := range r.Controllers {
		if strings.HasPrefix(c.Name, prefix) {
			return c
		}
	}
	return nil
}

func (c *controllerResult) b1(n int) *b1Result {
	if c == nil {
		return nil
	}
	for i := range c.B1 {
		if c.B1[i].N == n {
			return &c.B1[i]
		}
	}
	return nil
}

func (c *controllerResult) b5(m int) *b5Result {
	if c == nil {
		return nil
	}
	for i := range c.B5 {
		if c.B5[i].M == m {
			return &c.B5[i]
		}
	}
	return nil
}

// name is the report's file name without extension.
func (r *results) name() string {
	if r.Large {
		return "large"
	}
	return "latest"
}

// memMiB formats an optional memory sample's RSS.
func memMiB(m *memory) string {
	if m == nil {
		return "–"
	}
	return fmt.Sprintf("%.1f", mib(m.RSSKiB))
}

func mib(kib int64) float64 { return float64(kib) / 1024 }

func ratio(a, b float64) string {
	if a == 0 || b == 0 {
		return "–"
	}
	return fmt.Sprintf("%.2f×", a/b)
}

func verdict(ok bool) string {
	if ok {
		return "met"
	}
	return "**missed**"
}

func writeReport(dir string, r *results) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(dir, r.name()+".json"), append(mustJSON(r), '\n'), 0o644); err != nil {
		return err
	}
	var w strings.Builder
	p := func(format string, args ...any) { fmt.Fprintf(&w, format+"\n", args...) }
	mode, flag := "full run", ""
	switch {
	case r.Smoke:
		mode, flag = "smoke run (small N: figures are not meaningful, only that every workload completes)", " --smoke"
	case r.Large:
		mode, flag = "large run (B2 and B5 at scale; B3, B4 and kopf are not part of it)", " --large"
	}
	p("# Capstan benchmark results")
	p("")
	p("%s, %s, %.0f s. Produced by `scripts/bench.sh%s`; raw figures in `%s.json`.", mode, r.Started.UTC().Format("2006-01-02 15:04 UTC"), r.Finished.Sub(r.Started).Seconds(), flag, r.name())
	p("")
	p("Machine: %d cores (%s), %.1f GiB memory, %s; load average %s before, %s after. The API server, etcd, the controller, the handler process and the load generator share these cores.", r.Machine.Cores, r.Machine.CPU, r.Machine.MemoryGiB, r.Machine.Kernel, r.Machine.LoadBefore, r.Machine.LoadAfter)
	p("")
	keys := make([]string, 0, len(r.Versions))
	for k := range r.Versions {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	var vs []string
	for _, k := range keys {
		vs = append(vs, fmt.Sprintf("%s: `%s`", k, r.Versions[k]))
	}
	p("Versions: %s.", strings.Join(vs, "; "))
	p("")
	if len(r.Failures) > 0 {
		p("**Failed workloads:**")
		p("")
		for _, f := range r.Failures {
			p("- %s", strings.SplitN(f, "\n", 2)[0])
		}
		p("")
	}
	floor, capstan, kopf := r.controller("null"), r.controller("capstan+rust"), r.controller("kopf")

	// B1
	p("## B1 — bulk create until every object's handled marker is observed (B0 = null controller)")
	p("")
	p("| N | controller | total (s) | objects/s | p50 latency (ms) | p99 latency (ms) | controller CPU (ms/object) | CPU s: controller / handler / API server | total vs floor | total vs kopf |")
	p("|---|---|---|---|---|---|---|---|---|---|")
	for _, n := range r.Sizes {
		fl, kp := floor.b1(n), kopf.b1(n)
		for _, c := range r.Controllers {
			x := c.b1(n)
			if x == nil {
				continue
			}
			vsFloor, vsKopf := "–", "–"
			if fl != nil && c != floor {
				vsFloor = ratio(x.TotalS, fl.TotalS)
			}
			if kp != nil && c != kopf {
				vsKopf = ratio(x.TotalS, kp.TotalS)
			}
			p("| %d | %s | %.2f | %.0f | %.1f | %.1f | %.2f | %.1f / %.1f / %.1f | %s | %s |", n, c.Name, x.TotalS, x.PerS, x.P50Ms, x.P99Ms, 1000*x.CPUS/float64(n), x.CPUS, x.HandlerCPUS, x.APIServerCPUS, vsFloor, vsKopf)
		}
	}
	p("")
	p("Total: first create sent → last marker seen. Latency: create acknowledged → marker first seen on an independent watch. Creates at concurrency 64; each object ~1 KiB of spec. CPU: utime+stime over the same interval (the API server includes its embedded etcd). The time to only create the N objects is in `latest.json` (`create_s`).")
	p("")
	if capstan != nil {
		var queue []string
		for _, n := range r.Sizes {
			if x := capstan.b1(n); x != nil && x.QueueP99Ms > 0 {
				queue = append(queue, fmt.Sprintf("%.1f ms at N=%d", x.QueueP99Ms, n))
			}
		}
		if len(queue) > 0 {
			p("Capstan's own account of the queue (`workqueue_queue_duration_seconds` on `/metrics`, from an object's work arriving to a worker taking it, p99 as Prometheus's `histogram_quantile` computes it over the run): %s.", strings.Join(queue, ", "))
			p("")
		}
	}

	p("One object at a time (the unloaded latency, create acknowledged → marker seen), and what each controller's bookkeeping adds to an object:")
	p("")
	p("| controller | objects | p50 (ms) | p99 (ms) | p50 vs floor | annotations per object (bytes) |")
	p("|---|---|---|---|---|---|")
	for _, c := range r.Controllers {
		if c.Serial == nil {
			continue
		}
		vs := "–"
		if floor != nil && floor.Serial != nil && c != floor {
			vs = fmt.Sprintf("%+.1f ms", c.Serial.P50Ms-floor.Serial.P50Ms)
		}
		p("| %s | %d | %.1f | %.1f | %s | %d |", c.Name, c.Serial.N, c.Serial.P50Ms, c.Serial.P99Ms, vs, c.Serial.AnnotationBytes)
	}
	p("")

	// B2
	p("## B2 — controller memory (VmRSS of the controller process, not the handler)")
	p("")
	p("| controller | idle RSS (MiB) | RSS at objects (MiB) | per object above idle (KiB) | API server RSS at objects (MiB) | restart with all objects: RSS / peak HWM (MiB) | restart → new object handled (s): created at the start / 1 s after |")
	p("|---|---|---|---|---|---|---|")
	for _, c := range r.Controllers {
		idle := "–"
		if c.B2.Idle != nil {
			idle = fmt.Sprintf("%.1f", mib(c.B2.Idle.RSSKiB))
		}
		var steady, perObject, api []string
		for _, s := range c.B2.Steady {
			steady = append(steady, fmt.Sprintf("%.1f @ %d", mib(s.Memory.RSSKiB), s.Objects))
			if c.B2.Idle != nil && s.Objects > 0 {
				perObject = append(perObject, fmt.Sprintf("%.2f", float64(s.Memory.RSSKiB-c.B2.Idle.RSSKiB)/float64(s.Objects)))
			}
			api = append(api, memMiB(s.APIServer))
		}
		restart, probe := "–", "–"
		if c.B2.Restart != nil {
			restart = fmt.Sprintf("%.1f / %.1f @ %d", mib(c.B2.Restart.Memory.RSSKiB), mib(c.B2.Restart.Memory.HWMKiB), c.B2.Restart.Objects)
			probe = fmt.Sprintf("%.2f / %s", c.B2.Restart.ProbeS, orDash(c.B2.Restart.ProbeAfterS, "%.2f"))
		}
		p("| %s | %s | %s | %s | %s | %s | %s |", c.Name, idle, strings.Join(steady, ", "), strings.Join(perObject, ", "), strings.Join(api, ", "), restart, probe)
	}
	p("")
	p("Restart → new object: the controller restarted with all the objects, one new object created (create acknowledged → handled); at the start, it is usually created before the controller's LIST and so is among the objects listed; 1 s after (another restart), the controller is listing and the object is a change.")
	p("")
	p("The pod's total at objects (controller + handler process, VmRSS, MiB), next to kopf's single process:")
	p("")
	p("| controller | controller + handler = pod total @ objects (MiB) |")
	p("|---|---|")
	for _, c := range r.Controllers {
		var totals []string
		for _, s := range c.B2.Steady {
			if s.Handler != nil {
				totals = append(totals, fmt.Sprintf("%.1f + %.1f = %.1f @ %d", mib(s.Memory.RSSKiB), mib(s.Handler.RSSKiB),
					mib(s.Memory.RSSKiB+s.Handler.RSSKiB), s.Objects))
			} else {
				totals = append(totals, fmt.Sprintf("%.1f @ %d", mib(s.Memory.RSSKiB), s.Objects))
			}
		}
		if len(totals) > 0 {
			p("| %s | %s |", c.Name, strings.Join(totals, ", "))
		}
	}
	p("")

	// B3
	p("## B3 — the gRPC hop (controller side ↔ handler process over a Unix socket)")
	p("")
	if len(r.B3) == 0 {
		p("Not run.")
	} else {
		p("| handler process | calls | p50 (µs) | p99 (µs) | raw socket RTT p50 (µs) | pipelined (calls/s, in flight) |")
		p("|---|---|---|---|---|---|")
		for _, h := range r.B3 {
			if h.Error != "" {
				p("| %s | failed: %s | | | | |", h.Handler, h.Error)
				continue
			}
			p("| %s | %d | %.0f | %.0f | %.0f | %.0f (%d) |", h.Handler, h.Calls, h.P50Us, h.P99Us, h.RawP50Us, h.PipelinedPS, h.InFlight)
		}
	}
	if floor != nil && capstan != nil && floor.Serial != nil && capstan.Serial != nil {
		p("")
		p("End to end, one object at a time (B1 above): Capstan's p50 minus the floor's = %+.1f ms. That difference is the whole runtime per change (watch decode, cause detection, the gRPC hop, the handler, the diff-base, a larger PATCH), not only the hop.", capstan.Serial.P50Ms-floor.Serial.P50Ms)
	}
	p("")

	// B4
	p("## B4 — API requests per handled change (from the API server's audit log)")
	p("")
	var names []string
	for _, c := range r.Controllers {
		for _, s := range r.B4 {
			if s.Controller == c.Name {
				names = append(names, c.Name)
				break
			}
		}
	}
	var scen []string
	for _, s := range r.B4 {
		if !contains(scen, s.Scenario) {
			scen = append(scen, s.Scenario)
		}
	}
	sort.Strings(scen)
	header := "| scenario | target (Capstan) |"
	sep := "|---|---|"
	for _, n := range names {
		header += " " + n + ": object writes + Events (handler calls) |"
		sep += "---|"
	}
	p("%s", header)
	p("%s", sep)
	for _, sc := range scen {
		row := fmt.Sprintf("| %s | %s |", sc, b4Target(sc))
		for _, n := range names {
			cell := "–"
			for _, s := range r.B4 {
				if s.Controller == n && s.Scenario == sc {
					cell = fmt.Sprintf("**%d** + %d (%d)%s", s.ObjectWrites, s.Events, s.HandlerCalls, breakdown(s))
				}
			}
			row += " " + cell + " |"
		}
		p("%s", row)
	}
	p("")
	p("Writes: POST/PATCH/PUT/DELETE by the controller (any client but the benchmark's) in the scenario's namespace and time window, split into writes to the object (including `/status`) and Event POSTs; reads (GET/LIST) are in `latest.json`. Scenario 3's handler returns a value, which goes to `status.update_fn` (the status subresource), so 2 object writes are the minimum there. Scenario 7 counts writes to the object from 0.5 s after its outcome was observed until it was quiet for the settle time, and handler calls beyond the first.")
	p("")

	// B5
	p("## B5 — process start → first handler call, with M pre-existing unhandled objects")
	p("")
	p("| controller | M | first handler call (ms) | all M handled (s) | RSS / HWM after (MiB) | steady RSS, restarted with them handled (MiB) | peak vs steady | CPU s: controller / API server | API server RSS (MiB) | raw LIST by a plain client: first page / all (ms) | new object during the backlog: handled (ms) |")
	p("|---|---|---|---|---|---|---|---|---|---|---|")
	for _, c := range r.Controllers {
		for _, x := range c.B5 {
			mem := "–"
			if x.Memory != nil {
				mem = fmt.Sprintf("%.1f / %.1f", mib(x.Memory.RSSKiB), mib(x.Memory.HWMKiB))
			}
			vs := "–"
			if x.Memory != nil && x.Steady != nil && x.Steady.RSSKiB > 0 {
				vs = fmt.Sprintf("%.2f×", float64(x.Memory.HWMKiB)/float64(x.Steady.RSSKiB))
			}
			p("| %s | %d | %.0f | %.2f | %s | %s | %s | %.1f / %.1f | %s | %.0f / %.0f | %s |", c.Name, x.M, x.FirstCallMs, x.AllHandledS, mem, memMiB(x.Steady), vs, x.CPUS, x.APIServerCPUS, memMiB(x.APIServer), x.ListFirstMs, x.ListAllMs, orDash(x.FreshMs, "%.0f"))
		}
	}
	p("")

	// Targets
	p("## Targets (performance-anchors §8)")
	p("")
	p("| target | figure | verdict |")
	p("|---|---|---|")
	for _, n := range r.Sizes {
		if n < 1000 {
			continue
		}
		if fl, cp := floor.b1(n), capstan.b1(n); fl != nil && cp != nil {
			p("| B1 N=%d: total ≤ 1.2 × floor | %.2f s vs %.2f s (%.2f×) | %s |", n, cp.TotalS, fl.TotalS, cp.TotalS/fl.TotalS, verdict(cp.TotalS <= 1.2*fl.TotalS))
			p("| B1 N=%d: p50 ≤ floor p50 + 5 ms (under load) | %.1f ms vs %.1f ms | %s |", n, cp.P50Ms, fl.P50Ms, verdict(cp.P50Ms <= fl.P50Ms+5))
		}
		if fl, cp := floor.b1(n), capstan.b1(n); n >= 10000 && fl != nil && cp != nil {
			p("| B1 N=%d: total ≤ 1.15 × floor | %.2f s vs %.2f s (%.2f×) | %s |", n, cp.TotalS, fl.TotalS, cp.TotalS/fl.TotalS, verdict(cp.TotalS <= 1.15*fl.TotalS))
			p("| B1 N=%d: API server CPU per object ≤ 1.15 × the floor's | %.2f vs %.2f ms/object (%.2f×) | %s |", n, 1000*cp.APIServerCPUS/float64(n), 1000*fl.APIServerCPUS/float64(n), cp.APIServerCPUS/fl.APIServerCPUS, verdict(cp.APIServerCPUS <= 1.15*fl.APIServerCPUS))
		}
		if kp, cp := kopf.b1(n), capstan.b1(n); n == 1000 && kp != nil && cp != nil {
			p("| B1 N=1000: total ≤ kopf / 3 | %.2f s vs %.2f s (kopf/Capstan = %.1f) | %s |", cp.TotalS, kp.TotalS, kp.TotalS/cp.TotalS, verdict(cp.TotalS*3 <= kp.TotalS))
		}
		if kp, cp := kopf.b1(n), capstan.b1(n); kp != nil && cp != nil {
			p("| B6 N=%d: CPU per change ≤ kopf / 5 | %.2f vs %.2f ms/object | %s |", n, 1000*cp.CPUS/float64(n), 1000*kp.CPUS/float64(n), verdict(cp.CPUS*5 <= kp.CPUS))
		}
	}
	if floor != nil && capstan != nil && floor.Serial != nil && capstan.Serial != nil {
		p("| B1 one at a time: p50 ≤ floor p50 + 5 ms | %.1f ms vs %.1f ms | %s |", capstan.Serial.P50Ms, floor.Serial.P50Ms, verdict(capstan.Serial.P50Ms <= floor.Serial.P50Ms+5))
	}
	if capstan != nil && capstan.Serial != nil {
		specBytes := len(mustCompactJSON(spec1KiB()))
		p("| B4 bytes: the diff-base is a digest or minimal essence, never a spec copy | %d bytes of annotations per object for a %d-byte spec | %s |", capstan.Serial.AnnotationBytes, specBytes, verdict(2*capstan.Serial.AnnotationBytes < specBytes))
		p("| B4 bytes: bookkeeping annotations ≤ 25%% of the spec | %d bytes for a %d-byte spec (%.0f%%) | %s |", capstan.Serial.AnnotationBytes, specBytes, 100*float64(capstan.Serial.AnnotationBytes)/float64(specBytes), verdict(4*capstan.Serial.AnnotationBytes <= specBytes))
	}
	if capstan != nil && capstan.B2.Idle != nil {
		p("| B2 idle RSS ≤ 15 MiB | %.1f MiB | %s |", mib(capstan.B2.Idle.RSSKiB), verdict(mib(capstan.B2.Idle.RSSKiB) <= 15))
	}
	if capstan != nil && len(capstan.B2.Steady) > 0 {
		last := capstan.B2.Steady[len(capstan.B2.Steady)-1]
		if last.Objects >= 10000 && last.Objects < 50000 {
			p("| B2 RSS at %d objects ≤ 40 MiB | %.1f MiB | %s |", last.Objects, mib(last.Memory.RSSKiB), verdict(mib(last.Memory.RSSKiB) <= 40))
			p("| B2 RSS at %d objects ≤ 30 MiB | %.1f MiB | %s |", last.Objects, mib(last.Memory.RSSKiB), verdict(mib(last.Memory.RSSKiB) <= 30))
		}
		if last.Objects >= 50000 && capstan.B2.Idle != nil {
			per := float64(last.Memory.RSSKiB-capstan.B2.Idle.RSSKiB) / float64(last.Objects)
			p("| B2 at %d objects: ≤ 2.5 KiB per object above idle | %.2f KiB (%.1f MiB) | %s |", last.Objects, per, mib(last.Memory.RSSKiB), verdict(per <= 2.5))
			p("| B2 at %d objects: ≤ 250 MiB | %.1f MiB | %s |", last.Objects, mib(last.Memory.RSSKiB), verdict(mib(last.Memory.RSSKiB) <= 250))
		}
		if capstan.B2.Restart != nil {
			peak := mib(capstan.B2.Restart.Memory.HWMKiB)
			p("| B2 peak during the initial list ≤ 1.5 × steady | %.1f MiB vs %.1f MiB | %s |", peak, mib(last.Memory.RSSKiB), verdict(peak <= 1.5*mib(last.Memory.RSSKiB)))
			if after := capstan.B2.Restart.ProbeAfterS; after > 0 {
				limit := 0.5
				if last.Objects >= 50000 {
					limit = 1
				}
				p("| B2 restart with %d objects → a new object (created 1 s after) handled ≤ %.1f s | %.2f s | %s |", capstan.B2.Restart.Objects, limit, after, verdict(after <= limit))
			}
		}
		if kopf != nil && len(kopf.B2.Steady) > 0 {
			kl := kopf.B2.Steady[len(kopf.B2.Steady)-1]
			if kl.Objects == last.Objects && last.Objects >= 10000 {
				p("| B2 RSS at %d objects ≤ kopf / 5 | %.1f vs %.1f MiB | %s |", last.Objects, mib(last.Memory.RSSKiB), mib(kl.Memory.RSSKiB), verdict(5*last.Memory.RSSKiB <= kl.Memory.RSSKiB))
			}
		}
	}
	for _, h := range r.B3 {
		if h.Error == "" {
			p("| B3 %s: hop p50 ≤ 150 µs, p99 ≤ 500 µs | %.0f / %.0f µs | %s |", h.Handler, h.P50Us, h.P99Us, verdict(h.P50Us <= 150 && h.P99Us <= 500))
			p("| B3 %s: ≥ 20k invocations/s on one connection | %.0f/s | %s |", h.Handler, h.PipelinedPS, verdict(h.PipelinedPS >= 20000))
		}
	}
	for _, s := range r.B4 {
		if s.Controller != "capstan+rust" {
			continue
		}
		want := b4Limit(s.Scenario)
		if want >= 0 {
			p("| B4 %s: ≤ %d object writes | %d | %s |", s.Scenario, want, s.ObjectWrites, verdict(s.ObjectWrites <= want))
		}
		if ev := b4EventLimit(s.Scenario); ev >= 0 {
			p("| B4 %s: ≤ %d Events | %d | %s |", s.Scenario, ev, s.Events, verdict(s.Events <= ev))
		}
	}
	if cp := capstan.b5(1); cp != nil {
		p("| B5 M=1: first handler call ≤ 300 ms | %.0f ms | %s |", cp.FirstCallMs, verdict(cp.FirstCallMs <= 300))
		if kp := kopf.b5(1); kp != nil {
			p("| B5 M=1: ≥ 3× faster than kopf | %.0f vs %.0f ms | %s |", cp.FirstCallMs, kp.FirstCallMs, verdict(3*cp.FirstCallMs <= kp.FirstCallMs))
		}
	}
	for _, x := range capstanLarge(capstan) {
		if x.Memory != nil && x.Steady != nil {
			p("| B5 M=%d: start-up peak ≤ 1.5 × steady RSS with the same objects | %.1f MiB vs %.1f MiB (%.2f×) | %s |", x.M, mib(x.Memory.HWMKiB), mib(x.Steady.RSSKiB), float64(x.Memory.HWMKiB)/float64(x.Steady.RSSKiB), verdict(2*x.Memory.HWMKiB <= 3*x.Steady.RSSKiB))
		}
		p("| B5 M=%d: first call ≤ raw LIST first page + 100 ms (or ≤ 1.2 × full LIST) | %.0f ms vs %.0f / %.0f ms | %s |", x.M, x.FirstCallMs, x.ListFirstMs, x.ListAllMs, verdict(x.FirstCallMs <= x.ListFirstMs+100 || x.FirstCallMs <= 1.2*x.ListAllMs))
		if x.FreshMs > 0 {
			p("| B5 M=%d: a new object created while the backlog drains handled ≤ 1 s | %.0f ms | %s |", x.M, x.FreshMs, verdict(x.FreshMs <= 1000))
		}
	}
	p("")
	var notes []string
	notes = append(notes, r.Notes...)
	for _, c := range r.Controllers {
		for _, n := range c.Notes {
			notes = append(notes, c.Name+": "+n)
		}
	}
	if len(notes) > 0 {
		p("Notes:")
		p("")
		for _, n := range notes {
			p("- %s", n)
		}
		p("")
	}
	return os.WriteFile(filepath.Join(dir, r.name()+".md"), []byte(w.String()), 0o644)
}

func mustCompactJSON(v any) []byte {
	data, _ := json.Marshal(v)
	return data
}

func capstanLarge(c *controllerResult) []b5Result {
	if c == nil {
		return nil
	}
	var out []b5Result
	for _, x := range c.B5 {
		if x.M > 1 {
			out = append(out, x)
		}
	}
	return out
}

func contains(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}

func breakdown(s *b4Result) string {
	if len(s.Writes) == 0 {
		return ""
	}
	keys := make([]string, 0, len(s.Writes))
	for k := range s.Writes {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	var parts []string
	for _, k := range keys {
		parts = append(parts, fmt.Sprintf("%d %s", s.Writes[k], k))
	}
	return ": " + strings.Join(parts, ", ")
}

// b4Limit is the Capstan target of a scenario (performance-anchors §8 B4); -1 when none.
func b4Limit(scenario string) int {
	switch scenario[:2] {
	case "1.", "2.":
		return 1
	case "3.":
		return 2 // the diff-base PATCH plus the handler's result on the status subresource
	case "4a", "4b":
		return 2
	case "5.":
		return 3 // ≤ 2 per retry plus the outcome; no touch patches
	case "6.", "7.":
		return 0
	}
	return -1
}

// b4EventLimit is the cap on Kubernetes Events: ≤ 1 per handled change (one per attempt with
// a retry), none for changes that are not handled.
func b4EventLimit(scenario string) int {
	switch scenario[:2] {
	case "5.":
		return 2
	case "6.", "7.":
		return 0
	}
	return 1
}

func b4Target(scenario string) string {
	if n := b4Limit(scenario); n >= 0 {
		if scenario[:2] == "4b" {
			return "≤ 2; Events ≤ 1"
		}
		if scenario[:2] == "5." {
			return "≤ 2 per retry + 1; Events ≤ 2"
		}
		if scenario[:2] == "3." {
			return "1 + 1 /status; Events ≤ 1"
		}
		if b4EventLimit(scenario) == 0 {
			return "0"
		}
		return fmt.Sprintf("%d; Events ≤ 1", n)
	}
	return ""
}

// orDash formats v, or a dash when it was not measured (zero).
func orDash(v float64, format string) string {
	if v <= 0 {
		return "–"
	}
	return fmt.Sprintf(format, v)
}
