// Command bench-go-handler is the benchmark's handler process written with the Go SDK
// (sdk-go-example/capstan). Like capstan-e2e-handler, BENCH_HANDLERS (comma-separated presets:
// create, create3, update, delete, results) picks the handlers it registers for the example
// resource, and every call appends "<handler id> <object name> <attempt>" to BENCH_LOG.
package main

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"strings"
	"sync"
	"syscall"
	"time"

	"capstan.dev/sdk-go-example/capstan"
)

const resource = "examples.demo.capstan.dev"

var (
	logMu   sync.Mutex
	logFile *os.File
)

func logCall(inv *capstan.Invocation) {
	if logFile == nil {
		return
	}
	logMu.Lock()
	defer logMu.Unlock()
	fmt.Fprintf(logFile, "%s %s %d\n", inv.HandlerID, inv.Name(), inv.Attempt)
}

// temporary fails the first spec.temporary.<id> attempts, as the Rust e2e handler does.
func temporary(inv *capstan.Invocation) error {
	t, _ := inv.Spec()["temporary"].(map[string]any)
	if n, ok := t[inv.HandlerID]; ok {
		var limit int
		fmt.Sscan(fmt.Sprint(n), &limit)
		if inv.Retry < limit {
			return capstan.Temporaryf(time.Second, "temporary failure %d of %d", inv.Retry+1, limit)
		}
	}
	return nil
}

func plain(_ context.Context, inv *capstan.Invocation) (any, error) {
	logCall(inv)
	return nil, temporary(inv)
}

func labelled(value string) capstan.HandlerFunc {
	return func(_ context.Context, inv *capstan.Invocation) (any, error) {
		logCall(inv)
		inv.Patch().Label("e2e/"+value, "1")
		return nil, nil
	}
}

func withResult(_ context.Context, inv *capstan.Invocation) (any, error) {
	logCall(inv)
	return map[string]any{"message": "hello " + inv.Name(), "attempts": inv.Attempt}, nil
}

func main() {
	slog.SetDefault(slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn})))
	if path := os.Getenv("BENCH_LOG"); path != "" {
		f, err := os.OpenFile(path, os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o644)
		if err != nil {
			slog.Error("opening BENCH_LOG", "error", err)
			os.Exit(1)
		}
		logFile = f
	}
	reg := capstan.NewRegistry()
	presets := os.Getenv("BENCH_HANDLERS")
	if presets == "" {
		presets = "create"
	}
	for _, p := range strings.Split(presets, ",") {
		switch strings.TrimSpace(p) {
		case "create":
			reg.OnCreate(resource, "create_fn", plain)
		case "create3":
			reg.OnCreate(resource, "create_a", labelled("a"))
			reg.OnCreate(resource, "create_b", labelled("b"))
			reg.OnCreate(resource, "create_c", plain)
		case "results":
			reg.OnCreate(resource, "create_fn", withResult)
		case "update":
			reg.OnUpdate(resource, "update_fn", withResult)
		case "delete":
			reg.OnDelete(resource, "delete_fn", plain)
		case "":
		default:
			slog.Error("unknown preset", "preset", p)
			os.Exit(2)
		}
	}
	endpoint := os.Getenv("CAPSTAN_ENDPOINT")
	if endpoint == "" {
		endpoint = capstan.DefaultEndpoint
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	if err := reg.Run(ctx, endpoint); err != nil && ctx.Err() == nil {
		slog.Error("handler process failed", "error", err)
		os.Exit(1)
	}
}
