// Command example-operator is a Capstan handler process written in Go: it handles the example
// resource examples.demo.capstan.dev (kind Example, short name cex) and shows the common
// patterns of an operator: results stored in the status, retries, sub-handlers, a daemon that
// follows its object and writes progress while it runs, a timer, and the operator's startup,
// cleanup and probe activities, and (with CAPSTAN_EXAMPLE_WEBHOOKS=true, for a controller
// that serves admission webhooks) a validating and a mutating admission handler.
//
// Run it next to a capstan controller; it dials CAPSTAN_ENDPOINT (default
// unix:///run/capstan/capstan.sock) and stops on SIGTERM or SIGINT.
package main

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"sync/atomic"
	"syscall"
	"time"

	"capstan.dev/sdk-go-example/capstan"
)

// resource is the selector of the example resource.
const resource = "examples.demo.capstan.dev"

// handled counts successful create handler calls, for the probe.
var handled atomic.Int64

// startupFn runs once before the controller starts watching.
func startupFn(_ context.Context, inv *capstan.Invocation) (any, error) {
	inv.Logf("example operator startup done")
	return nil, nil
}

// cleanupFn runs once when the controller stops.
func cleanupFn(_ context.Context, inv *capstan.Invocation) (any, error) {
	inv.Logf("example operator cleanup done")
	return nil, nil
}

// probeFn reports this process's state on the controller's liveness endpoint.
func probeFn(context.Context, *capstan.Invocation) (any, error) {
	return map[string]any{"language": "go", "created": handled.Load()}, nil
}

// createFn greets new objects and marks them as handled by this process; its result goes to
// status.create_fn. With spec.fail_times set it first fails that many times with a temporary
// error, to show retries.
func createFn(_ context.Context, inv *capstan.Invocation) (any, error) {
	if failTimes := number(inv.Spec()["fail_times"]); inv.Retry < failTimes {
		return nil, capstan.Temporaryf(time.Second, "not ready yet (attempt %d of %d failing)", inv.Attempt, failTimes)
	}
	inv.Patch().Label("demo.capstan.dev/handled-by", "go")
	inv.Logf("created %s", inv.Name())
	handled.Add(1)
	return map[string]string{"message": fmt.Sprintf("hello %s from go", inv.Name())}, nil
}

// setupFn declares two sub-handlers, each recorded on its own ("setup/config",
// "setup/service"): a failing one is retried without running the finished one again.
func setupFn(_ context.Context, inv *capstan.Invocation) (any, error) {
	inv.Subhandler("config", func(_ context.Context, sub *capstan.Invocation) (any, error) {
		sub.Patch().Annotation("demo.capstan.dev/config", "ready")
		return nil, nil
	})
	inv.Subhandler("service", func(_ context.Context, sub *capstan.Invocation) (any, error) {
		if sub.Spec()["fail_service"] == true && sub.Retry == 0 {
			return nil, capstan.Temporaryf(time.Second, "service not ready yet")
		}
		sub.Patch().Annotation("demo.capstan.dev/service", fmt.Sprintf("ready after %d retries", sub.Retry))
		return nil, nil
	}, capstan.Retries(5))
	return nil, nil
}

// updateFn acknowledges changes of the object.
func updateFn(_ context.Context, inv *capstan.Invocation) (any, error) {
	inv.Logf("updated %s", inv.Name())
	return map[string]string{"message": fmt.Sprintf("updated %s from go", inv.Name())}, nil
}

// fieldFn records how spec.field changed in the annotation demo.capstan.dev/field.
func fieldFn(_ context.Context, inv *capstan.Invocation) (any, error) {
	change := fmt.Sprintf("%s->%s", show(inv.Old), show(inv.New))
	inv.Patch().Annotation("demo.capstan.dev/field", change)
	inv.Logf("spec.field changed: %s", change)
	return nil, nil
}

// deleteFn logs deletions.
func deleteFn(_ context.Context, inv *capstan.Invocation) (any, error) {
	inv.Logf("deleting %s", inv.Name())
	return nil, nil
}

// monitor follows its object while it lives: whenever spec.field changes, it writes the value
// it sees to the annotation demo.capstan.dev/monitored at once, without waiting to return.
func monitor(ctx context.Context, inv *capstan.Invocation) (any, error) {
	seen := ""
	for {
		if now := show(inv.Spec()["field"]); now != seen { // Spec() is the latest body
			seen = now
			p := &capstan.Patch{}
			p.Annotation("demo.capstan.dev/monitored", now)
			if err := inv.SendPatch(p); err != nil {
				return nil, err
			}
		}
		select {
		case <-ctx.Done():
			slog.Info("monitor stopped", "object", inv.Name(), "reason", inv.CancelReason())
			return nil, ctx.Err()
		case <-time.After(500 * time.Millisecond):
		}
	}
}

// tick counts timer ticks in status.ticks.
func tick(_ context.Context, inv *capstan.Invocation) (any, error) {
	inv.Patch().Status("ticks", number(inv.Status()["ticks"])+1)
	return nil, nil
}

// number reads a JSON number (json.Number, as the package decodes them) as an int; 0 otherwise.
func number(v any) int {
	n, ok := v.(json.Number)
	if !ok {
		return 0
	}
	i, err := n.Int64()
	if err != nil {
		return 0
	}
	return int(i)
}

// show formats a field value for an annotation; an absent field is "none".
func show(v any) string {
	if v == nil {
		return "none"
	}
	return fmt.Sprint(v)
}

// registry registers the handlers.
// validateFn refuses examples whose spec.size is above 100, and warns about examples without
// spec.field (kopf on.validate).
func validateFn(_ context.Context, inv *capstan.Invocation) (any, error) {
	if _, ok := inv.Spec()["field"]; !ok {
		inv.AddWarning("%s has no spec.field", inv.Name())
	}
	if size := number(inv.Spec()["size"]); size > 100 {
		return nil, capstan.Deny(422, "spec.size %d is above 100", size)
	}
	return nil, nil
}

// mutateFn defaults spec.size to 1 and labels the object as admitted by this operator (kopf
// on.mutate). The change is made before the object is stored.
func mutateFn(_ context.Context, inv *capstan.Invocation) (any, error) {
	if _, ok := inv.Spec()["size"]; !ok {
		inv.Patch().Set([]string{"spec", "size"}, 1)
	}
	inv.Patch().Label("demo.capstan.dev/admitted-by", "go")
	return nil, nil
}

func registry() *capstan.Registry {
	reg := capstan.NewRegistry()
	reg.OnStartup("startup_fn", startupFn)
	reg.OnCleanup("cleanup_fn", cleanupFn)
	reg.OnProbe("probe_fn", probeFn)
	reg.OnCreate(resource, "create_fn", createFn, capstan.Retries(5))
	reg.OnCreate(resource, "setup", setupFn)
	reg.OnUpdate(resource, "update_fn", updateFn)
	reg.OnField(resource, "spec.field", "field_fn", fieldFn)
	reg.OnDelete(resource, "delete_fn", deleteFn)
	reg.Daemon(resource, "monitor", monitor, capstan.CancellationTimeout(10*time.Second))
	reg.Timer(resource, "tick", 5*time.Second, tick)
	if os.Getenv("CAPSTAN_EXAMPLE_WEBHOOKS") == "true" {
		reg.OnValidate(resource, "validate_fn", validateFn,
			capstan.Operations(capstan.OperationCreate, capstan.OperationUpdate))
		reg.OnMutate(resource, "mutate_fn", mutateFn, capstan.Operations(capstan.OperationCreate))
	}
	return reg
}

func main() {
	slog.SetDefault(slog.New(slog.NewTextHandler(os.Stderr, nil)))
	endpoint := os.Getenv("CAPSTAN_ENDPOINT")
	if endpoint == "" {
		endpoint = capstan.DefaultEndpoint
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	slog.Info("example operator starting", "endpoint", endpoint)
	if err := registry().Run(ctx, endpoint); err != nil {
		slog.Error("example operator failed", "error", err)
		os.Exit(1)
	}
	slog.Info("example operator stopped")
}
