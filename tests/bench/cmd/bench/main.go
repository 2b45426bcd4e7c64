// Command bench runs Capstan's benchmarks (performance-anchors §8, B0–B6) side by side with a
// null controller and kopf against one real API server. See tests/bench/README.md.
//
//	bench run [flags]   run the benchmark and write results/latest.{md,json} (large.{md,json}
//	                    with --large: B2 and B5 at 100,000 objects)
//	bench null          the null controller of B0 (started by `bench run`)
//	bench admission     the admission round trip, Capstan's webhook server beside kopf's
//	bench hop [flags]   B3: a fake controller that drives a handler process over a Unix socket
//	bench fleet [flags] per-node operators at fleet scale (fleet.{md,json,svg})
//	bench sharding      sharded replicas: hand-over, throughput, per-member cost (sharding.{md,json,svg})
package main

import (
	"bufio"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/dynamic"
	"sigs.k8s.io/yaml"
)

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: bench run|null [flags]")
		os.Exit(2)
	}
	var err error
	switch os.Args[1] {
	case "run":
		err = runBench(os.Args[2:])
	case "null":
		err = runNull(os.Args[2:])
	case "fleet":
		err = runFleet(os.Args[2:])
	case "admission":
		err = runAdmission(os.Args[2:])
	case "sharding":
		err = runSharding(os.Args[2:])
	default:
		err = fmt.Errorf("unknown command %q", os.Args[1])
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		os.Exit(1)
	}
}

type options struct {
	smoke       bool
	large       bool
	out         string
	testenv     string
	capstan     string
	rustHandler string
	goHandler   string
	pyHandler   string
	tsHandler   string
	kopf        string
	kopfOp      string
	crd         string
	hop         string
	sizes       []int
	kopfMax     int
	b5Large     int
	settle      time.Duration
	steady      time.Duration
	only        string
	keep        bool
	serial      int
	profile     string
}

func say(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "[%s] %s\n", time.Now().Format("15:04:05"), fmt.Sprintf(format, args...))
}

func parseSizes(s string) ([]int, error) {
	var out []int
	for _, f := range strings.Split(s, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil || n <= 0 {
			return nil, fmt.Errorf("bad size %q", f)
		}
		out = append(out, n)
	}
	return out, nil
}

func runBench(args []string) error {
	fs := flag.NewFlagSet("run", flag.ExitOnError)
	var o options
	var sizes string
	fs.BoolVar(&o.smoke, "smoke", false, "small N and short settles; for CI")
	fs.BoolVar(&o.large, "large", false, "B2 and B5 at 100,000 objects (B1 builds B2's objects), with the null controller and capstan+rust only; no B3, B4 or kopf; writes large.{md,json}")
	fs.StringVar(&o.out, "out", "", "directory for latest.md and latest.json")
	fs.StringVar(&o.testenv, "testenv", "", "the capstan-testenv binary")
	fs.StringVar(&o.capstan, "capstan", "", "the capstan binary")
	fs.StringVar(&o.rustHandler, "rust-handler", "", "capstan-e2e-handler (Rust SDK)")
	fs.StringVar(&o.goHandler, "go-handler", "", "the Go SDK handler (optional)")
	fs.StringVar(&o.pyHandler, "python-handler", "", "the Python SDK handler: an executable that runs python -m capstan run (optional)")
	fs.StringVar(&o.tsHandler, "typescript-handler", "", "the TypeScript SDK handler: an executable that runs node tshandler/handlers.js (optional)")
	fs.StringVar(&o.kopf, "kopf", "", "the kopf executable (optional)")
	fs.StringVar(&o.kopfOp, "kopf-operator", "", "kopf/operator.py")
	fs.StringVar(&o.crd, "crd", "", "examples/crd.yaml")
	fs.StringVar(&o.hop, "hop", "", "the B3 hop benchmark binary (optional)")
	fs.StringVar(&sizes, "sizes", "100,1000,10000", "B1 object counts")
	fs.IntVar(&o.kopfMax, "kopf-max", 10000, "largest N run with kopf")
	fs.IntVar(&o.b5Large, "b5-objects", 10000, "B5's large pre-existing object count")
	fs.DurationVar(&o.settle, "settle", 3*time.Second, "quiet time after a B4 scenario")
	fs.DurationVar(&o.steady, "steady", 10*time.Second, "wait before B2's steady-state sample")
	fs.StringVar(&o.only, "only", "", "comma-separated controller names to run (default all)")
	fs.StringVar(&o.profile, "profile", "release", "the cargo profile capstan was built with (reported)")
	fs.IntVar(&o.serial, "serial", 20, "objects created one at a time for the unloaded latency")
	fs.BoolVar(&o.keep, "keep", false, "keep the work directory (logs, audit log)")
	_ = fs.Parse(args)
	if o.large {
		given := map[string]bool{}
		fs.Visit(func(f *flag.Flag) { given[f.Name] = true })
		if !given["sizes"] {
			sizes = "100000"
		}
		if !given["b5-objects"] {
			o.b5Large = 100000
		}
		if !given["only"] {
			o.only = "null,capstan+rust"
		}
		if !given["serial"] {
			o.serial = 5
		}
		if !given["steady"] {
			o.steady = 30 * time.Second
		}
		o.hop = ""
	}
	var err error
	if o.sizes, err = parseSizes(sizes); err != nil {
		return err
	}
	for _, req := range []struct{ v, n string }{{o.out, "out"}, {o.testenv, "testenv"}, {o.capstan, "capstan"}, {o.rustHandler, "rust-handler"}, {o.crd, "crd"}} {
		if req.v == "" {
			return fmt.Errorf("--%s is required", req.n)
		}
	}
	ctx, cancel := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer cancel()
	defer stopAll()

	work, err := os.MkdirTemp("", "capstan-bench-")
	if err != nil {
		return err
	}
	say("work directory %s", work)
	res := &results{Started: time.Now(), Smoke: o.smoke, Large: o.large, Sizes: o.sizes, KopfMax: o.kopfMax, Machine: describeMachine()}
	res.Versions = versions(o)

	// The API server.
	audit := filepath.Join(work, "audit.log")
	env, kubeconfig, err := startAPIServer(o.testenv, work, audit)
	if err != nil {
		return err
	}
	cfg, err := restConfig(kubeconfig, "capstan-bench/driver")
	if err != nil {
		return err
	}
	dyn, err := dynamic.NewForConfig(cfg)
	if err != nil {
		return err
	}
	if err := applyCRD(ctx, dyn, o.crd); err != nil {
		return err
	}
	obs := newObserver([]string{"capstan.dev/last-handled-configuration", "kopf.zalando.org/last-handled-configuration", nullMarker})
	ready := make(chan error, 1)
	obsCtx, stopObserver := context.WithCancel(ctx)
	defer stopObserver()
	go obs.run(obsCtx, dyn, ready)
	if err := <-ready; err != nil {
		return fmt.Errorf("starting the observer watch: %w", err)
	}

	self, _ := os.Executable()
	ctrls := []controller{nullController(self, kubeconfig), capstanController("capstan+rust", o.capstan, o.rustHandler, kubeconfig, rustHandlerEnv)}
	if o.goHandler != "" {
		c := capstanController("capstan+go", o.capstan, o.goHandler, kubeconfig, goHandlerEnv)
		c.B4 = !o.smoke // the controller's writes do not depend on the handler's language
		ctrls = append(ctrls, c)
	} else {
		res.Notes = append(res.Notes, "The Go SDK handler was not built; its column is missing.")
	}
	if o.pyHandler != "" {
		ctrls = append(ctrls, capstanController("capstan+python", o.capstan, o.pyHandler, kubeconfig, goHandlerEnv))
	} else {
		res.Notes = append(res.Notes, "The Python SDK venv was not set up; its column is missing.")
	}
	if o.tsHandler != "" {
		ctrls = append(ctrls, capstanController("capstan+typescript", o.capstan, o.tsHandler, kubeconfig, goHandlerEnv))
	} else {
		res.Notes = append(res.Notes, "The TypeScript SDK handler was not built; its column is missing.")
	}
	if o.kopf != "" {
		ctrls = append(ctrls, kopfController(o.kopf, o.kopfOp, kubeconfig))
	} else {
		res.Notes = append(res.Notes, "kopf was not installed; its column is missing.")
	}
	if o.only != "" {
		keep := map[string]bool{}
		for _, n := range strings.Split(o.only, ",") {
			keep[strings.TrimSpace(n)] = true
		}
		var sel []controller
		for _, c := range ctrls {
			if keep[c.Name] || keep[strings.Fields(c.Name)[0]] {
				sel = append(sel, c)
			}
		}
		ctrls = sel
	}

	b := &bencher{o: o, ctx: ctx, dyn: dyn, obs: obs, work: work, res: res, api: env}
	for _, c := range ctrls {
		if ctx.Err() != nil {
			break
		}
		b.runController(c)
	}
	if o.hop != "" && ctx.Err() == nil {
		b.runHop()
	}

	// B4 from the audit log, once everything has been written.
	time.Sleep(time.Second)
	audits, _ := filepath.Glob(filepath.Join(work, "audit*.log"))
	if err := countWrites(audits, res.B4); err != nil {
		res.Failures = append(res.Failures, fmt.Sprintf("B4: reading the audit log: %v", err))
	}
	res.Finished = time.Now()
	res.Machine.LoadAfter = loadAverage()
	stopObserver()
	env.stop(30 * time.Second)
	if ctx.Err() != nil {
		return fmt.Errorf("interrupted; no report written (logs in %s)", work)
	}
	if err := writeReport(o.out, res); err != nil {
		return err
	}
	say("wrote %s", filepath.Join(o.out, res.name()+".md"))
	if len(res.Failures) > 0 {
		for _, f := range res.Failures {
			fmt.Fprintln(os.Stderr, "FAILED:", f)
		}
		return fmt.Errorf("%d workload(s) failed", len(res.Failures))
	}
	if !o.keep {
		_ = os.RemoveAll(work)
	}
	return nil
}

func applyCRD(ctx context.Context, dyn dynamic.Interface, path string) error {
	data, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	var obj map[string]any
	if err := yaml.Unmarshal(data, &obj); err != nil {
		return err
	}
	u := &unstructured.Unstructured{Object: obj}
	if _, err := dyn.Resource(crdGVR).Create(ctx, u, metav1.CreateOptions{}); err != nil {
		return fmt.Errorf("creating the CRD: %w", err)
	}
	deadline := time.Now().Add(60 * time.Second)
	for time.Now().Before(deadline) {
		got, err := dyn.Resource(crdGVR).Get(ctx, u.GetName(), metav1.GetOptions{})
		if err == nil {
			conds, _, _ := unstructured.NestedSlice(got.Object, "status", "conditions")
			for _, c := range conds {
				m, _ := c.(map[string]any)
				if m["type"] == "Established" && m["status"] == "True" {
					// The resource is served a moment after it is established.
					if _, err := dyn.Resource(exampleGVR).List(ctx, metav1.ListOptions{Limit: 1}); err == nil {
						return nil
					}
				}
			}
		}
		time.Sleep(100 * time.Millisecond)
	}
	return fmt.Errorf("the CRD was not established in time")
}

// ---------------------------------------------------------------------------------------------

type bencher struct {
	o    options
	ctx  context.Context
	dyn  dynamic.Interface
	obs  *observer
	work string
	res  *results
	nss  []string // namespaces holding objects of the current controller
	api  *proc    // the API server
}

func (b *bencher) fail(format string, args ...any) {
	msg := fmt.Sprintf(format, args...)
	say("FAILED: %s", msg)
	b.res.Failures = append(b.res.Failures, msg)
}

func (b *bencher) namespace(ns string) string {
	if err := ensureNamespace(b.ctx, b.dyn, ns); err != nil {
		b.fail("%v", err)
	}
	b.nss = append(b.nss, ns)
	return ns
}

func (b *bencher) callLog(c controller, what string) string {
	return filepath.Join(b.work, fmt.Sprintf("calls-%s-%s-%d.log", sanitize(c.Name), what, time.Now().UnixNano()))
}

// waitTimeout is generous: a run that needs more is broken, not slow.
func (b *bencher) waitTimeout(n int) time.Duration {
	return 90*time.Second + time.Duration(n)*200*time.Millisecond
}

func (b *bencher) cleanup(c controller) {
	if err := deleteAllExamples(b.ctx, b.dyn, b.nss); err != nil {
		b.fail("%s: cleaning up: %v", c.Name, err)
	}
	b.nss = nil
}

func (b *bencher) runController(c controller) {
	short := sanitize(strings.Fields(c.Name)[0])
	say("=== %s", c.Name)
	cr := &controllerResult{Name: c.Name}
	b.res.Controllers = append(b.res.Controllers, cr)
	if c.B4 && !b.o.large {
		b.runB4(c, short)
	}
	for _, phase := range []func(){
		func() { b.runB1B2(c, short, cr) },
		func() { b.cleanup(c) },
		func() { b.runB5(c, short, cr) },
		func() { b.cleanup(c) },
	} {
		if b.ctx.Err() != nil {
			return
		}
		phase()
	}
}

// probe creates one object in a fresh namespace and waits for its marker: the controller is up.
func (b *bencher) probe(c controller, r *running, ns string) (time.Duration, error) {
	return b.probeWithin(c, r, ns, 120*time.Second)
}

// probeWithin is probe, waiting up to timeout for the marker.
func (b *bencher) probeWithin(c controller, r *running, ns string, timeout time.Duration) (time.Duration, error) {
	ns = b.namespace(ns)
	t0 := time.Now()
	if _, _, err := createMany(b.ctx, b.dyn, ns, "probe", 1, 1, func(int) map[string]any { return spec1KiB() }); err != nil {
		return 0, err
	}
	if err := b.obs.waitCount(b.ctx, c.Marker, ns, 1, timeout); err != nil {
		return 0, fmt.Errorf("%w\n%s", err, r.tails())
	}
	return time.Since(t0), nil
}

func (b *bencher) runB1B2(c controller, short string, cr *controllerResult) {
	r, err := c.start(b.work, "create", b.callLog(c, "b1"))
	if err != nil {
		b.fail("%s: starting: %v", c.Name, err)
		return
	}
	defer func() { r.stop() }()
	if _, err := b.probe(c, r, "bench-"+short+"-probe"); err != nil {
		b.fail("%s: probe object not handled: %v", c.Name, err)
		return
	}
	// One object at a time: the unloaded per-object latency.
	serialNS := b.namespace("bench-" + short + "-serial")
	var serial []float64
	for i := 0; i < b.o.serial && b.ctx.Err() == nil; i++ {
		name := fmt.Sprintf("one-%03d", i)
		if _, err := b.dyn.Resource(exampleGVR).Namespace(serialNS).Create(b.ctx, newExample(serialNS, name, spec1KiB()), metav1.CreateOptions{}); err != nil {
			b.fail("%s: serial create: %v", c.Name, err)
			return
		}
		ack := time.Now()
		if err := b.obs.waitCount(b.ctx, c.Marker, serialNS, i+1, 60*time.Second); err != nil {
			b.fail("%s: serial: %v\n%s", c.Name, err, r.tails())
			return
		}
		t, _ := b.obs.seenAt(c.Marker, serialNS, name)
		serial = append(serial, max(t.Sub(ack).Seconds()*1000, 0))
	}
	sort.Float64s(serial)
	cr.Serial = &serialResult{N: len(serial), P50Ms: pct(serial, .5), P99Ms: pct(serial, .99), AnnotationBytes: b.annotationBytes(serialNS)}
	say("%s: one at a time: p50 %.1fms p99 %.1fms; annotations %d bytes/object", c.Name, cr.Serial.P50Ms, cr.Serial.P99Ms, cr.Serial.AnnotationBytes)
	time.Sleep(b.o.steady / 2)
	if m, err := readMemory(r.main.pid()); err == nil {
		cr.B2.Idle = &m
	}
	total := 1 + len(serial)
	for _, n := range b.o.sizes {
		if b.ctx.Err() != nil {
			return
		}
		if c.Name == "kopf" && n > b.o.kopfMax {
			cr.Notes = append(cr.Notes, fmt.Sprintf("N=%d skipped for kopf (capped at %d)", n, b.o.kopfMax))
			continue
		}
		ns := b.namespace(fmt.Sprintf("bench-%s-n%d", short, n))
		say("%s: B1 N=%d", c.Name, n)
		cpu0, api0, self0 := cpuSeconds(r.main.pid()), cpuSeconds(b.api.pid()), cpuSeconds(os.Getpid())
		handler0 := 0.0
		if r.handler != nil {
			handler0 = cpuSeconds(r.handler.pid())
		}
		var queue0 histogram
		if r.admin != "" {
			queue0, _ = scrapeQueueDuration(b.ctx, r.admin)
		}
		t0 := time.Now()
		acks, tCreate, err := createMany(b.ctx, b.dyn, ns, "obj", n, 64, func(int) map[string]any { return spec1KiB() })
		if err != nil {
			b.fail("%s: B1 N=%d: %v", c.Name, n, err)
			return
		}
		if err := b.obs.waitCount(b.ctx, c.Marker, ns, n, b.waitTimeout(n)); err != nil {
			b.fail("%s: B1 N=%d: %v (%d handled)\n%s", c.Name, n, err, b.obs.countOf(c.Marker, ns), r.tails())
			return
		}
		_, last := b.obs.firstAndLast(c.Marker, ns)
		cpu1, api1, self1 := cpuSeconds(r.main.pid()), cpuSeconds(b.api.pid()), cpuSeconds(os.Getpid())
		handler1 := 0.0
		if r.handler != nil {
			handler1 = cpuSeconds(r.handler.pid())
		}
		lat := make([]float64, 0, n)
		for name, ack := range acks {
			if t, ok := b.obs.seenAt(c.Marker, ns, name); ok {
				d := t.Sub(ack).Seconds() * 1000
				lat = append(lat, max(d, 0))
			}
		}
		sort.Float64s(lat)
		total += n
		run := b1Result{
			N: n, TotalS: last.Sub(t0).Seconds(), CreateS: tCreate.Seconds(),
			P50Ms: pct(lat, 0.50), P99Ms: pct(lat, 0.99), CPUS: cpu1 - cpu0,
			HandlerCPUS: handler1 - handler0, APIServerCPUS: api1 - api0, DriverCPUS: self1 - self0,
		}
		run.PerS = float64(n) / run.TotalS
		if queue0 != nil {
			if queue1, err := scrapeQueueDuration(b.ctx, r.admin); err == nil {
				run.QueueP99Ms = 1000 * quantile(0.99, queue0, queue1)
			}
		}
		cr.B1 = append(cr.B1, run)
		say("%s: B1 N=%d: %.2fs (%.0f/s), p50 %.1fms p99 %.1fms, workqueue_queue_duration_seconds p99 %.1fms, cpu: controller %.2fs handler %.2fs apiserver %.2fs driver %.2fs",
			c.Name, n, run.TotalS, run.PerS, run.P50Ms, run.P99Ms, run.QueueP99Ms, run.CPUS, run.HandlerCPUS, run.APIServerCPUS, run.DriverCPUS)
		time.Sleep(b.o.steady)
		if m, err := readMemory(r.main.pid()); err == nil {
			at := memAt{Objects: total, Memory: m}
			if am, err := readMemory(b.api.pid()); err == nil {
				at.APIServer = &am
			}
			if r.handler != nil {
				if hm, err := readMemory(r.handler.pid()); err == nil {
					at.Handler = &hm
				}
			}
			cr.B2.Steady = append(cr.B2.Steady, at)
		}
	}
	// Restart with every object present (all handled): the initial list's peak.
	r.stop()
	say("%s: restart with %d existing objects", c.Name, total)
	r, err = c.start(b.work, "create", b.callLog(c, "restart"))
	if err != nil {
		b.fail("%s: restarting: %v", c.Name, err)
		return
	}
	d, err := b.probe(c, r, "bench-"+short+"-probe2")
	if err != nil {
		b.fail("%s: probe after restart: %v", c.Name, err)
		return
	}
	time.Sleep(b.o.steady / 2)
	if m, err := readMemory(r.main.pid()); err == nil {
		cr.B2.Restart = &memAt{Objects: total + 1, Memory: m, Seconds: time.Since(r.started).Seconds() - (b.o.steady / 2).Seconds(), ProbeS: d.Seconds()}
	}
	// Again, with the new object created 1 s after the start: every controller is listing
	// then, and an object created before its LIST would be among those listed.
	r.stop()
	r, err = c.start(b.work, "create", b.callLog(c, "restart-after"))
	if err != nil {
		b.fail("%s: restarting again: %v", c.Name, err)
		return
	}
	select {
	case <-b.ctx.Done():
		return
	case <-time.After(time.Second):
	}
	d, err = b.probe(c, r, "bench-"+short+"-probe3")
	if err != nil {
		b.fail("%s: probe 1 s after another restart: %v", c.Name, err)
		return
	}
	if cr.B2.Restart != nil {
		cr.B2.Restart.ProbeAfterS = d.Seconds()
	}
}

func (b *bencher) runB5(c controller, short string, cr *controllerResult) {
	sizes := []int{1, b.o.b5Large}
	for _, m := range sizes {
		if b.ctx.Err() != nil {
			return
		}
		if c.Name == "kopf" && m > b.o.kopfMax {
			m = b.o.kopfMax
		}
		ns := b.namespace(fmt.Sprintf("b5-%s-m%d", short, m))
		if _, _, err := createMany(b.ctx, b.dyn, ns, "pre", m, 64, func(int) map[string]any { return spec1KiB() }); err != nil {
			b.fail("%s: B5 M=%d: %v", c.Name, m, err)
			return
		}
		listFirst, listAll := b.rawList(ns)
		say("%s: B5 start with %d unhandled objects", c.Name, m)
		callLog := b.callLog(c, "b5")
		api0 := cpuSeconds(b.api.pid())
		r, err := c.start(b.work, "create", callLog)
		if err != nil {
			b.fail("%s: B5 M=%d: starting: %v", c.Name, m, err)
			return
		}
		first, err := waitFileNonEmpty(callLog, b.waitTimeout(m), func() bool { return r.alive() && b.ctx.Err() == nil })
		if err != nil {
			b.fail("%s: B5 M=%d: no handler call: %v\n%s", c.Name, m, err, r.tails())
			r.stop()
			return
		}
		// A new object while the backlog drains: is it held behind it? (A controller that
		// lists everything before it watches handles it only near the end.)
		var fresh time.Duration
		if m > 1 {
			if fresh, err = b.probeWithin(c, r, fmt.Sprintf("b5-%s-m%d-fresh", short, m), b.waitTimeout(m)); err != nil {
				b.fail("%s: B5 M=%d: a new object during the backlog: %v", c.Name, m, err)
				r.stop()
				return
			}
		}
		if err := b.obs.waitCount(b.ctx, c.Marker, ns, m, b.waitTimeout(m)); err != nil {
			b.fail("%s: B5 M=%d: %v\n%s", c.Name, m, err, r.tails())
			r.stop()
			return
		}
		_, last := b.obs.firstAndLast(c.Marker, ns)
		res := b5Result{M: m, ListFirstMs: listFirst, ListAllMs: listAll, FirstCallMs: first.Sub(r.started).Seconds() * 1000, AllHandledS: last.Sub(r.started).Seconds(), FreshMs: fresh.Seconds() * 1000}
		res.CPUS, res.APIServerCPUS = cpuSeconds(r.main.pid()), cpuSeconds(b.api.pid())-api0
		if mem, err := readMemory(r.main.pid()); err == nil {
			res.Memory = &mem
		}
		cr.B5 = append(cr.B5, res)
		say("%s: B5 M=%d: first call %.0fms, all handled %.2fs", c.Name, m, res.FirstCallMs, res.AllHandledS)
		r.stop()
		// The steady state with the same objects, which the start-up's peak (HWM) is judged
		// against: a fresh process started with the M objects now handled, a settle time
		// after its initial listing (a process keeps the pages its allocator once held, so
		// the one that did the start-up cannot show it).
		if m > 1 && b.ctx.Err() == nil {
			r, err := c.start(b.work, "create", b.callLog(c, "b5-steady"))
			if err != nil {
				b.fail("%s: B5 M=%d: restarting for the steady state: %v", c.Name, m, err)
				return
			}
			if _, err := b.probe(c, r, fmt.Sprintf("b5-%s-m%d-probe", short, m)); err != nil {
				b.fail("%s: B5 M=%d: probe after restart: %v", c.Name, m, err)
				r.stop()
				return
			}
			time.Sleep(b.o.steady)
			if mem, err := readMemory(r.main.pid()); err == nil {
				cr.B5[len(cr.B5)-1].Steady = &mem
			}
			if mem, err := readMemory(b.api.pid()); err == nil {
				cr.B5[len(cr.B5)-1].APIServer = &mem
			}
			r.stop()
		}
	}
}

// ---------------------------------------------------------------------------------------------
// B4: scenarios whose API writes are counted from the audit log at the end.

func (b *bencher) runB4(c controller, short string) {
	settle := b.o.settle
	add := func(scenario, ns string, from, to time.Time, objectOnly bool, calls int) {
		b.res.B4 = append(b.res.B4, &b4Result{Controller: c.Name, Scenario: scenario, Namespace: ns, From: from, To: to, ObjectOnly: objectOnly, HandlerCalls: calls})
	}
	type step func(r *running, ns, callLog string) error
	configs := []struct {
		presets, ns string
		run         step
	}{
		{"create", "create", func(r *running, ns, callLog string) error {
			t0 := time.Now()
			if err := b.createOne(c, r, ns, "one", nil); err != nil {
				return err
			}
			tm, _ := b.obs.seenAt(c.Marker, ns, "one")
			time.Sleep(settle)
			add("1. create, 1 handler", ns, t0, tm.Add(settle), false, countLinesMatching(callLog, " one "))
			add("7. echo of our own write", ns, tm.Add(500*time.Millisecond), tm.Add(settle), true, max(countLinesMatching(callLog, " one ")-1, 0))
			// 6. a status-only change by a third party
			ts := time.Now()
			patch := []byte(`{"status":{"external":"changed by someone else"}}`)
			if _, err := b.dyn.Resource(exampleGVR).Namespace(ns).Patch(b.ctx, "one", types.MergePatchType, patch, metav1.PatchOptions{}, "status"); err != nil {
				return err
			}
			time.Sleep(settle)
			add("6. status-only change by a third party", ns, ts, time.Now(), false, max(countLinesMatching(callLog, " one ")-1, 0))
			// 5. the handler fails once (retryable), then succeeds
			t0 = time.Now()
			if err := b.createOne(c, r, ns, "retry", map[string]any{"temporary": map[string]any{"create_fn": int64(1)}}); err != nil {
				return err
			}
			tm, _ = b.obs.seenAt(c.Marker, ns, "retry")
			time.Sleep(settle)
			add("5. create, handler fails once then succeeds", ns+"#retry", t0, tm.Add(settle), false, countLinesMatching(callLog, " retry "))
			return nil
		}},
		{"create3", "create3", func(r *running, ns, callLog string) error {
			t0 := time.Now()
			if err := b.createOne(c, r, ns, "three", nil); err != nil {
				return err
			}
			tm, _ := b.obs.seenAt(c.Marker, ns, "three")
			time.Sleep(settle)
			add("2. create, 3 handlers", ns, t0, tm.Add(settle), false, countLinesMatching(callLog, " three "))
			return nil
		}},
		{"create,update", "update", func(r *running, ns, callLog string) error {
			if err := b.createOne(c, r, ns, "upd", nil); err != nil {
				return err
			}
			time.Sleep(settle)
			tu := time.Now()
			patch := []byte(`{"spec":{"field":"changed-by-update"}}`)
			if _, err := b.dyn.Resource(exampleGVR).Namespace(ns).Patch(b.ctx, "upd", types.MergePatchType, patch, metav1.PatchOptions{}); err != nil {
				return err
			}
			err := b.obs.waitFor(b.ctx, 60*time.Second, "the update handled", func() bool {
				return strings.Contains(b.obs.annotations[ns+"/upd"][c.Marker], "changed-by-update")
			})
			if err != nil {
				return fmt.Errorf("%w\n%s", err, r.tails())
			}
			time.Sleep(settle)
			add("3. update (spec change), 1 handler", ns, tu, time.Now(), false, countLinesMatching(callLog, "update_fn upd "))
			return nil
		}},
		{"create,delete", "delete", func(r *running, ns, callLog string) error {
			t0 := time.Now()
			if err := b.createOne(c, r, ns, "del", nil); err != nil {
				return err
			}
			tm, _ := b.obs.seenAt(c.Marker, ns, "del")
			time.Sleep(settle)
			add("4a. create with a delete handler", ns, t0, tm.Add(settle), false, countLinesMatching(callLog, "create_fn del "))
			td := time.Now()
			if err := b.dyn.Resource(exampleGVR).Namespace(ns).Delete(b.ctx, "del", metav1.DeleteOptions{}); err != nil {
				return err
			}
			err := b.obs.waitFor(b.ctx, 60*time.Second, "the object gone", func() bool {
				_, gone := b.obs.deleted[ns+"/del"]
				return gone
			})
			if err != nil {
				return fmt.Errorf("%w\n%s", err, r.tails())
			}
			time.Sleep(settle)
			add("4b. delete with a delete handler", ns, td, time.Now(), false, countLinesMatching(callLog, "delete_fn del "))
			return nil
		}},
	}
	for _, cfg := range configs {
		if b.ctx.Err() != nil {
			return
		}
		ns := b.namespace(fmt.Sprintf("b4-%s-%s", short, cfg.ns))
		callLog := b.callLog(c, "b4-"+cfg.ns)
		say("%s: B4 %s", c.Name, cfg.presets)
		r, err := c.start(b.work, cfg.presets, callLog)
		if err != nil {
			b.fail("%s: B4 %s: starting: %v", c.Name, cfg.presets, err)
			continue
		}
		if err := cfg.run(r, ns, callLog); err != nil {
			b.fail("%s: B4 %s: %v", c.Name, cfg.presets, err)
		}
		r.stop()
		b.recordEvents(ns)
	}
}

// recordEvents keeps the Events posted in a B4 namespace (reason and message) for the report.
func (b *bencher) recordEvents(ns string) {
	list, err := b.dyn.Resource(eventGVR).Namespace(ns).List(b.ctx, metav1.ListOptions{})
	if err != nil {
		return
	}
	for _, s := range b.res.B4 {
		base, _, _ := strings.Cut(s.Namespace, "#")
		if base != ns {
			continue
		}
		for _, ev := range list.Items {
			name, _, _ := unstructured.NestedString(ev.Object, "involvedObject", "name")
			reason, _, _ := unstructured.NestedString(ev.Object, "reason")
			msg, _, _ := unstructured.NestedString(ev.Object, "message")
			count, _, _ := unstructured.NestedInt64(ev.Object, "count")
			s.EventMessages = append(s.EventMessages, fmt.Sprintf("%s: %s: %s (count %d)", name, reason, msg, count))
		}
	}
}

func (b *bencher) createOne(c controller, r *running, ns, name string, extra map[string]any) error {
	spec := spec1KiB()
	for k, v := range extra {
		spec[k] = v
	}
	if _, err := b.dyn.Resource(exampleGVR).Namespace(ns).Create(b.ctx, newExample(ns, name, spec), metav1.CreateOptions{}); err != nil {
		return err
	}
	if err := b.obs.waitFor(b.ctx, 60*time.Second, name+" handled", func() bool {
		_, ok := b.obs.seen[c.Marker][ns+"/"+name]
		return ok
	}); err != nil {
		return fmt.Errorf("%w\n%s", err, r.tails())
	}
	return nil
}

// ---------------------------------------------------------------------------------------------

func pct(sorted []float64, p float64) float64 {
	if len(sorted) == 0 {
		return 0
	}
	i := int(p*float64(len(sorted)-1) + 0.5)
	return sorted[min(i, len(sorted)-1)]
}

func loadAverage() string {
	data, _ := os.ReadFile("/proc/loadavg")
	f := strings.Fields(string(data))
	if len(f) < 3 {
		return ""
	}
	return strings.Join(f[:3], " ")
}

func describeMachine() machine {
	m := machine{LoadBefore: loadAverage()}
	if f, err := os.Open("/proc/cpuinfo"); err == nil {
		sc := bufio.NewScanner(f)
		for sc.Scan() {
			line := sc.Text()
			if strings.HasPrefix(line, "processor") {
				m.Cores++
			}
			if strings.HasPrefix(line, "model name") && m.CPU == "" {
				m.CPU = strings.TrimSpace(strings.SplitN(line, ":", 2)[1])
			}
		}
		f.Close()
	}
	if data, err := os.ReadFile("/proc/meminfo"); err == nil {
		for _, line := range strings.Split(string(data), "\n") {
			if strings.HasPrefix(line, "MemTotal:") {
				kb, _ := strconv.ParseFloat(strings.Fields(line)[1], 64)
				m.MemoryGiB = kb / 1024 / 1024
			}
		}
	}
	if out, err := exec.Command("uname", "-sr").Output(); err == nil {
		m.Kernel = strings.TrimSpace(string(out))
	}
	return m
}

func versions(o options) map[string]string {
	v := map[string]string{}
	run := func(name string, args ...string) string {
		out, err := exec.Command(name, args...).Output()
		if err != nil {
			return ""
		}
		return strings.TrimSpace(strings.SplitN(string(out), "\n", 2)[0])
	}
	v["testenv"] = run(o.testenv, "version")
	v["capstan"] = run(o.capstan, "version") + " (" + o.profile + " build)"
	if o.kopf != "" {
		v["kopf"] = run(o.kopf, "--version")
	}
	if o.tsHandler != "" {
		v["node"] = run("node", "--version")
	}
	return v
}

func mustJSON(v any) []byte {
	data, _ := json.MarshalIndent(v, "", "  ")
	return data
}

// rawList times a paginated LIST (500 per page, as client-go's reflector) of a namespace's
// objects: the first page and all pages, in ms.
func (b *bencher) rawList(ns string) (float64, float64) {
	t0 := time.Now()
	var first time.Duration
	cont := ""
	for {
		list, err := b.dyn.Resource(exampleGVR).Namespace(ns).List(b.ctx, metav1.ListOptions{Limit: 500, Continue: cont})
		if err != nil {
			return 0, 0
		}
		if first == 0 {
			first = time.Since(t0)
		}
		if cont = list.GetContinue(); cont == "" {
			break
		}
	}
	return first.Seconds() * 1000, time.Since(t0).Seconds() * 1000
}

// runHop runs the B3 micro-benchmark binary against each handler process.
func (b *bencher) runHop() {
	calls, warmup, pipelined := "20000", "2000", "50000"
	if b.o.smoke {
		calls, warmup, pipelined = "2000", "200", "5000"
	}
	handlers := []struct{ name, bin, env string }{
		{"Rust SDK (capstan-e2e-handler)", b.o.rustHandler, "E2E_HANDLERS=create"},
	}
	if b.o.goHandler != "" {
		handlers = append(handlers, struct{ name, bin, env string }{"Go SDK (bench-go-handler)", b.o.goHandler, "BENCH_HANDLERS=create"})
	}
	if b.o.pyHandler != "" {
		handlers = append(handlers, struct{ name, bin, env string }{"Python SDK (pyhandler, async)", b.o.pyHandler, "BENCH_HANDLERS=create"})
	}
	if b.o.tsHandler != "" {
		handlers = append(handlers, struct{ name, bin, env string }{"TypeScript SDK (tshandler, Node)", b.o.tsHandler, "BENCH_HANDLERS=create"})
	}
	for _, h := range handlers {
		say("B3: gRPC hop with the %s", h.name)
		cmd := exec.CommandContext(b.ctx, b.o.hop, "-handler", h.bin, "-env", h.env, "-env", "RUST_LOG=warn",
			"-calls", calls, "-warmup", warmup, "-pipelined", pipelined, "-in-flight", "64")
		var stderr strings.Builder
		cmd.Stderr = &stderr
		out, err := cmd.Output()
		res := hopResult{Handler: h.name}
		if err == nil {
			err = json.Unmarshal(out, &res)
			res.Handler = h.name
		}
		if err != nil {
			res.Error = err.Error()
			b.fail("B3 %s: %v\n%s", h.name, err, stderr.String())
		} else {
			say("B3 %s: p50 %.0fµs p99 %.0fµs, raw %.0fµs, pipelined %.0f/s", h.name, res.P50Us, res.P99Us, res.RawP50Us, res.PipelinedPS)
		}
		b.res.B3 = append(b.res.B3, res)
	}
}

// annotationBytes is the mean size of the annotations (keys and values) of a namespace's
// objects: what the controller's bookkeeping adds to each object.
func (b *bencher) annotationBytes(ns string) int {
	b.obs.mu.Lock()
	defer b.obs.mu.Unlock()
	total, n := 0, 0
	for key, ann := range b.obs.annotations {
		if !strings.HasPrefix(key, ns+"/") {
			continue
		}
		for k, v := range ann {
			total += len(k) + len(v)
		}
		n++
	}
	if n == 0 {
		return 0
	}
	return total / n
}
