package main

// The admission workload: the latency of an admission round trip (API server → webhook server
// → handler → back) for one validating and one mutating handler, Capstan (the controller's
// webhook server and the Rust SDK handler over the stream) side by side with kopf's own
// webhook server, both on loopback in development mode, against one API server in one run.
//
// Each request is a server-side dry-run create of a 1 KiB Example (nothing is stored, so etcd
// stays out of the measurement), sent one at a time. The same requests without any webhook
// give the floor; "overhead" is a percentile minus the floor's.

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"sort"
	"strings"
	"syscall"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/rest"
)

var (
	validatingGVR = schema.GroupVersionResource{Group: "admissionregistration.k8s.io", Version: "v1", Resource: "validatingwebhookconfigurations"}
	mutatingGVR   = schema.GroupVersionResource{Group: "admissionregistration.k8s.io", Version: "v1", Resource: "mutatingwebhookconfigurations"}
)

// admissionResult is one row of the report.
type admissionResult struct {
	System   string  `json:"system"`
	Handler  string  `json:"handler"`
	Requests int     `json:"requests"`
	P50Ms    float64 `json:"p50_ms"`
	P99Ms    float64 `json:"p99_ms"`
	Over50Ms float64 `json:"overhead_p50_ms"`
	Over99Ms float64 `json:"overhead_p99_ms"`
}

func runAdmission(args []string) error {
	fs := flag.NewFlagSet("admission", flag.ExitOnError)
	testenv := fs.String("testenv", "", "the capstan-testenv binary")
	capstanBin := fs.String("capstan", "", "the capstan binary")
	rustHandler := fs.String("rust-handler", "", "capstan-e2e-handler (Rust SDK)")
	kopfBin := fs.String("kopf", "", "the kopf executable (optional)")
	kopfOp := fs.String("kopf-operator", "", "kopf/operator.py")
	crd := fs.String("crd", "", "examples/crd.yaml")
	out := fs.String("out", "", "directory for admission.md and admission.json")
	requests := fs.Int("requests", 300, "measured requests per workload")
	warmup := fs.Int("warmup", 30, "unmeasured requests before each workload")
	_ = fs.Parse(args)
	for _, req := range []struct{ v, n string }{{*out, "out"}, {*testenv, "testenv"}, {*capstanBin, "capstan"}, {*rustHandler, "rust-handler"}, {*crd, "crd"}} {
		if req.v == "" {
			return fmt.Errorf("--%s is required", req.n)
		}
	}
	ctx, cancel := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer cancel()
	defer stopAll()
	work, err := os.MkdirTemp("", "capstan-bench-admission-")
	if err != nil {
		return err
	}
	say("work directory %s", work)
	env, kubeconfig, err := startAPIServer(*testenv, work, "")
	if err != nil {
		return err
	}
	defer env.stop(30 * time.Second)
	cfg, err := restConfig(kubeconfig, "capstan-bench/admission")
	if err != nil {
		return err
	}
	// Every request comes back with the handlers' warnings; they are expected.
	cfg.WarningHandler = rest.NoWarnings{}
	dyn, err := dynamic.NewForConfig(cfg)
	if err != nil {
		return err
	}
	if err := applyCRD(ctx, dyn, *crd); err != nil {
		return err
	}
	const ns = "default"
	measure := func(n int) ([]float64, error) {
		lat := make([]float64, 0, n)
		for i := 0; i < n; i++ {
			obj := newExample(ns, fmt.Sprintf("adm-%d", i), spec1KiB())
			t0 := time.Now()
			_, err := dyn.Resource(exampleGVR).Namespace(ns).Create(ctx, obj, metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}})
			if err != nil {
				return nil, err
			}
			lat = append(lat, float64(time.Since(t0).Microseconds())/1000)
		}
		sort.Float64s(lat)
		return lat, nil
	}
	if _, err := measure(*warmup); err != nil {
		return err
	}
	floor, err := measure(*requests)
	if err != nil {
		return err
	}
	say("floor (no webhook): p50 %.2f ms, p99 %.2f ms", pct(floor, 0.5), pct(floor, 0.99))
	var rows []admissionResult
	row := func(system, handler string, lat []float64) {
		r := admissionResult{System: system, Handler: handler, Requests: len(lat), P50Ms: pct(lat, 0.5), P99Ms: pct(lat, 0.99)}
		r.Over50Ms, r.Over99Ms = r.P50Ms-pct(floor, 0.5), r.P99Ms-pct(floor, 0.99)
		rows = append(rows, r)
		say("%s %s: p50 %.2f ms, p99 %.2f ms", system, handler, r.P50Ms, r.P99Ms)
	}
	// ready waits until a dry-run create shows that the webhook of `preset` is in effect.
	ready := func(preset string, alive func() bool) error {
		deadline := time.Now().Add(90 * time.Second)
		for time.Now().Before(deadline) && alive() {
			spec := spec1KiB()
			if preset == "validate" {
				spec["size"] = int64(99)
			}
			got, err := dyn.Resource(exampleGVR).Namespace(ns).Create(ctx, newExample(ns, "adm-probe", spec), metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}})
			switch {
			case preset == "validate" && err != nil && strings.Contains(err.Error(), "size 99 is too large"):
				return nil
			case preset == "mutate" && err == nil && got.GetLabels()["e2e/mutated"] == "yes":
				return nil
			}
			time.Sleep(200 * time.Millisecond)
		}
		return fmt.Errorf("the %s webhook did not take effect", preset)
	}
	gone := func() {
		for _, gvr := range []schema.GroupVersionResource{validatingGVR, mutatingGVR} {
			_ = dyn.Resource(gvr).Delete(ctx, "capstan-bench", metav1.DeleteOptions{})
			_ = dyn.Resource(gvr).Delete(ctx, "bench.kopf.dev", metav1.DeleteOptions{})
		}
	}
	var failures []string
	for _, preset := range []string{"validate", "mutate"} {
		// Capstan: the controller's webhook server, the Rust SDK handler over the stream.
		port, err := freePort()
		if err != nil {
			return err
		}
		sock := filepath.Join(work, "capstan-"+preset+".sock")
		main, err := startProc("capstan-"+preset, work, []string{"KUBECONFIG=" + kubeconfig, "CAPSTAN_LOG=warn"}, *capstanBin,
			"run", "--standalone", "--listen", "unix://"+sock, "--admin-listen", "127.0.0.1:0",
			"--webhook-listen", fmt.Sprintf("127.0.0.1:%d", port), "--webhook-managed", "capstan-bench")
		if err != nil {
			return err
		}
		for deadline := time.Now().Add(60 * time.Second); !fileExists(sock); time.Sleep(10 * time.Millisecond) {
			if !main.alive() || time.Now().After(deadline) {
				return fmt.Errorf("capstan did not open its socket\n%s", main.tail(20))
			}
		}
		handler, err := startProc("handler-"+preset, work, []string{"CAPSTAN_ENDPOINT=unix://" + sock, "E2E_HANDLERS=" + preset, "RUST_LOG=warn"}, *rustHandler)
		if err != nil {
			return err
		}
		if err := ready(preset, main.alive); err != nil {
			failures = append(failures, fmt.Sprintf("capstan %s: %v\n%s", preset, err, main.tail(20)))
		} else if _, err := measure(*warmup); err != nil {
			failures = append(failures, fmt.Sprintf("capstan %s: %v", preset, err))
		} else if lat, err := measure(*requests); err != nil {
			failures = append(failures, fmt.Sprintf("capstan %s: %v", preset, err))
		} else {
			row("capstan+rust", preset, lat)
		}
		handler.stop(10 * time.Second)
		main.stop(30 * time.Second)
		gone()

		if *kopfBin == "" {
			continue
		}
		// kopf: its own webhook server (aiohttp, TLS) with a certificate made here.
		kport, err := freePort()
		if err != nil {
			return err
		}
		cert, key := filepath.Join(work, "kopf.crt"), filepath.Join(work, "kopf.key")
		if !fileExists(cert) {
			gen := exec.Command("openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
				"-nodes", "-keyout", key, "-out", cert, "-days", "1", "-subj", "/CN=127.0.0.1",
				"-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost")
			if b, err := gen.CombinedOutput(); err != nil {
				return fmt.Errorf("openssl: %v: %s", err, b)
			}
		}
		kenv := []string{"KUBECONFIG=" + kubeconfig, "BENCH_HANDLERS=" + preset, "BENCH_WEBHOOK_PORT=" + fmt.Sprint(kport),
			"BENCH_WEBHOOK_CERT=" + cert, "BENCH_WEBHOOK_KEY=" + key}
		kopf, err := startProc("kopf-"+preset, work, kenv, *kopfBin, "run", "--standalone", "-A", "--log-format=plain", "--quiet", *kopfOp)
		if err != nil {
			return err
		}
		if err := ready(preset, kopf.alive); err != nil {
			failures = append(failures, fmt.Sprintf("kopf %s: %v\n%s", preset, err, kopf.tail(20)))
		} else if _, err := measure(*warmup); err != nil {
			failures = append(failures, fmt.Sprintf("kopf %s: %v", preset, err))
		} else if lat, err := measure(*requests); err != nil {
			failures = append(failures, fmt.Sprintf("kopf %s: %v", preset, err))
		} else {
			row("kopf", preset, lat)
		}
		kopf.stop(30 * time.Second)
		gone()
	}
	if err := os.MkdirAll(*out, 0o755); err != nil {
		return err
	}
	var md strings.Builder
	fmt.Fprintf(&md, "# Admission round trip\n\nServer-side dry-run creates of a 1 KiB Example, one at a time, %d measured after %d warm-up requests; %s. Floor (no webhook): p50 %.2f ms, p99 %.2f ms. Overhead = percentile − floor.\n\n",
		*requests, *warmup, loadAverage(), pct(floor, 0.5), pct(floor, 0.99))
	md.WriteString("| system | handler | p50 ms | p99 ms | overhead p50 ms | overhead p99 ms |\n|---|---|---|---|---|---|\n")
	for _, r := range rows {
		fmt.Fprintf(&md, "| %s | %s | %.2f | %.2f | %.2f | %.2f |\n", r.System, r.Handler, r.P50Ms, r.P99Ms, r.Over50Ms, r.Over99Ms)
	}
	for _, f := range failures {
		fmt.Fprintf(&md, "\nFAILED: %s\n", f)
	}
	if err := os.WriteFile(filepath.Join(*out, "admission.md"), []byte(md.String()), 0o644); err != nil {
		return err
	}
	data, _ := json.MarshalIndent(map[string]any{"floor_p50_ms": pct(floor, 0.5), "floor_p99_ms": pct(floor, 0.99), "rows": rows, "failures": failures}, "", "  ")
	if err := os.WriteFile(filepath.Join(*out, "admission.json"), data, 0o644); err != nil {
		return err
	}
	fmt.Print(md.String())
	if len(failures) > 0 {
		return fmt.Errorf("%d admission workload(s) failed", len(failures))
	}
	_ = os.RemoveAll(work)
	return nil
}

func fileExists(path string) bool {
	_, err := os.Stat(path)
	return err == nil
}
