// Command example-operator is a Capstan handler process written in Go: it handles the example
// resource examples.demo.capstan.dev (kind Example, short name cex) with one handler of each
// common kind.
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
	"syscall"
	"time"

	"capstan.dev/sdk-go-example/capstan"
)

// resource is the selector of the example resource.
const resource = "examples.demo.capstan.dev"

// createFn greets new objects and marks them as handled by this process. With spec.fail_times
// set it first fails that many times with a temporary error, to show retries.
func createFn(_ context.Context, inv *capstan.Invocation) (any, error) {
	if failTimes := number(inv.Spec()["fail_times"]); inv.Retry < failTimes {
		return nil, capstan.Temporaryf(time.Second, "not ready yet (attempt %d of %d failing)", inv.Attempt, failTimes)
	}
	inv.Patch().Label("demo.capstan.dev/handled-by", "go")
	inv.Logf("created %s", inv.Name())
	return map[string]string{"message": fmt.Sprintf("hello %s from go", inv.Name())}, nil
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

// monitor reports every few seconds that the object is monitored, until it is cancelled.
func monitor(ctx context.Context, inv *capstan.Invocation) (any, error) {
	ticker := time.NewTicker(5 * time.Second)
	defer ticker.Stop()
	for {
		select {
		case <-ctx.Done():
			slog.Info("monitor stopped", "object", inv.Name(), "cause", context.Cause(ctx))
			return nil, ctx.Err()
		case <-ticker.C:
			slog.Info("monitoring", "object", inv.Name())
		}
	}
}

// tick counts timer ticks in status.ticks.
func tick(_ context.Context, inv *capstan.Invocation) (any, error) {
	n, _ := inv.Status()["ticks"].(json.Number)
	ticks, _ := n.Int64() // 0 when absent
	inv.Patch().Status("ticks", ticks+1)
	return nil, nil
}

// show formats a field value for the annotation; an absent field is "none".
// number reads a JSON number (json.Number, as the layer decodes them) as an int; 0 otherwise.
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

func show(v any) string {
	if v == nil {
		return "none"
	}
	return fmt.Sprint(v)
}

// registry registers the handlers. The daemon and the timer are registered like the others;
// a controller that does not support them rejects just those two in its welcome (the layer
// logs why) and invokes the rest.
func registry() *capstan.Registry {
	reg := capstan.NewRegistry()
	reg.OnCreate(resource, "create_fn", createFn, capstan.Retries(5))
	reg.OnUpdate(resource, "update_fn", updateFn)
	reg.OnField(resource, "spec.field", "field_fn", fieldFn)
	reg.OnDelete(resource, "delete_fn", deleteFn)
	reg.Daemon(resource, "monitor", monitor)
	reg.Timer(resource, "tick", 10*time.Second, tick)
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
