package capstan_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/signal"
	"syscall"
	"time"

	"capstan.dev/sdk-go-example/capstan"
)

// A handler process: register handlers, then run until SIGTERM.
func Example() {
	reg := capstan.NewRegistry()
	reg.OnCreate("examples.demo.capstan.dev", "create_fn",
		func(_ context.Context, inv *capstan.Invocation) (any, error) {
			inv.Logf("creating %s", inv.Name())
			inv.Patch().Label("demo.capstan.dev/handled", "yes")
			return map[string]string{"message": "hello " + inv.Name()}, nil // → status.create_fn
		}, capstan.Retries(5))

	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	if err := reg.Run(ctx, capstan.DefaultEndpoint); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
}

// Options are kopf's decorator arguments; filters in the registration are evaluated by the
// controller, When in this process.
func ExampleRegistry_OnUpdate() {
	reg := capstan.NewRegistry()
	reg.OnUpdate("apps/v1/deployments", "scaled",
		func(_ context.Context, inv *capstan.Invocation) (any, error) {
			return map[string]any{"replicas": inv.New}, nil
		},
		capstan.Label("app", capstan.Equals("db")),
		capstan.Annotation("paused", capstan.Absent),
		capstan.Field("spec.replicas"), capstan.New(capstan.Present),
		capstan.When(func(inv *capstan.Invocation) bool { return inv.Namespace() != "kube-system" }),
		capstan.Errors(capstan.ErrorsPermanent), capstan.Timeout(time.Hour))
	fmt.Println(reg.Handlers())
	// Output: [scaled]
}

// A field handler's id gets the field appended, as in kopf.
func ExampleRegistry_OnField() {
	reg := capstan.NewRegistry()
	reg.OnField("examples.demo.capstan.dev", "spec.field", "field_fn",
		func(_ context.Context, inv *capstan.Invocation) (any, error) {
			inv.Logf("%v -> %v", inv.Old, inv.New)
			return nil, nil
		})
	fmt.Println(reg.Handlers())
	// Output: [field_fn/spec.field]
}

// A daemon reads the latest body of its object, writes progress while it runs, and learns why
// it was stopped.
func ExampleRegistry_Daemon() {
	reg := capstan.NewRegistry()
	reg.Daemon("examples.demo.capstan.dev", "monitor",
		func(ctx context.Context, inv *capstan.Invocation) (any, error) {
			for {
				p := &capstan.Patch{}
				p.Status("observed", inv.Spec()["field"]) // Spec() follows the object
				if err := inv.SendPatch(p); err != nil {
					return nil, err
				}
				select {
				case <-ctx.Done():
					inv.Logf("stopped: %s", inv.CancelReason()) // e.g. resource_deleted
					return nil, ctx.Err()
				case <-time.After(10 * time.Second):
				}
			}
		}, capstan.CancellationTimeout(30*time.Second))
	fmt.Println(reg.Handlers())
	// Output: [monitor]
}

// Activities belong to the operator, not to an object.
func ExampleRegistry_OnLogin() {
	reg := capstan.NewRegistry()
	reg.OnLogin("login_fn", func(context.Context, *capstan.Invocation) (any, error) {
		return &capstan.Credentials{Server: "https://10.0.0.1:6443", Token: os.Getenv("API_TOKEN")}, nil
	})
	reg.OnProbe("probe_fn", func(context.Context, *capstan.Invocation) (any, error) {
		return map[string]any{"queue": 0}, nil
	})
	fmt.Println(reg.Handlers())
	// Output: [login_fn probe_fn]
}

// Sub-handlers are declared by a running change handler; each one is recorded, retried and
// finished on its own.
func ExampleInvocation_Subhandler() {
	reg := capstan.NewRegistry()
	reg.OnCreate("examples.demo.capstan.dev", "provision",
		func(_ context.Context, inv *capstan.Invocation) (any, error) {
			for _, part := range []string{"volume", "service"} {
				inv.Subhandler(part, func(_ context.Context, sub *capstan.Invocation) (any, error) {
					sub.Patch().Annotation("demo.capstan.dev/"+part, "ready")
					return nil, nil
				}, capstan.Retries(3), capstan.Backoff(5*time.Second))
			}
			return nil, nil
		})
	fmt.Println(reg.Handlers())
	// Output: [provision]
}

// Patches are JSON merge patches; status keys go to the status subresource.
func ExamplePatch() {
	var p capstan.Patch
	p.Label("app", "db")
	p.RemoveAnnotation("old")
	p.Set([]string{"spec", "replicas"}, 3)
	p.Status("phase", "Ready")
	object, status := p.Documents()
	o, _ := json.Marshal(object)
	s, _ := json.Marshal(status)
	fmt.Println(string(o))
	fmt.Println(string(s))
	// Output:
	// {"metadata":{"annotations":{"old":null},"labels":{"app":"db"}},"spec":{"replicas":3}}
	// {"status":{"phase":"Ready"}}
}

// Errors decide the outcome, as in kopf; wrapping keeps the class.
func ExampleTemporaryError() {
	err := fmt.Errorf("creating the volume: %w", capstan.Temporaryf(30*time.Second, "quota exceeded"))
	var temporary *capstan.TemporaryError
	if errors.As(err, &temporary) {
		fmt.Println("retry in", temporary.Delay)
	}
	// Output: retry in 30s
}

// The memo keeps values per object in the handler process.
func ExampleMemo() {
	var m capstan.Memo
	client, loaded := m.LoadOrStore("client", "connected")
	fmt.Println(client, loaded)
	client, loaded = m.LoadOrStore("client", "again")
	fmt.Println(client, loaded)
	// Output:
	// connected false
	// connected true
}
