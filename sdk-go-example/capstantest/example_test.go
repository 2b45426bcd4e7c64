package capstantest_test

import (
	"context"
	"testing"

	"capstan.dev/sdk-go-example/capstan"
	"capstan.dev/sdk-go-example/capstantest"
)

func registry() *capstan.Registry {
	reg := capstan.NewRegistry()
	reg.OnCreate("examples.demo.capstan.dev", "create_fn",
		func(_ context.Context, inv *capstan.Invocation) (any, error) {
			inv.Patch().Label("demo.capstan.dev/handled", "yes")
			return map[string]string{"message": "hello " + inv.Name()}, nil
		})
	reg.Daemon("examples.demo.capstan.dev", "monitor",
		func(ctx context.Context, inv *capstan.Invocation) (any, error) {
			p := &capstan.Patch{}
			p.Status("seen", inv.Spec()["size"])
			_ = inv.SendPatch(p)
			<-ctx.Done()
			return nil, ctx.Err()
		})
	return reg
}

// A unit test of an operator's handlers: the real Run loop against the fake controller.
func TestOperator(t *testing.T) {
	ctl := capstantest.NewController(t)
	ctl.Serve(t, registry())

	res := ctl.Invoke(t, capstantest.Invocation{
		Handler: "create_fn",
		Body:    map[string]any{"metadata": map[string]any{"name": "one"}},
	})
	if res.Outcome != capstantest.Success || res.Value.(map[string]any)["message"] != "hello one" {
		t.Fatalf("create_fn: %+v", res)
	}

	daemon := ctl.Start(t, capstantest.Invocation{
		Handler: "monitor",
		Body:    map[string]any{"metadata": map[string]any{"name": "one"}, "spec": map[string]any{"size": 3}},
	})
	if update := daemon.NextUpdate(t); update.Status == nil {
		t.Fatalf("no progress: %+v", update)
	}
	daemon.Cancel(t, capstan.CancelResourceDeleted)
	if res := daemon.Wait(t); res.Outcome != capstantest.Cancelled {
		t.Fatalf("monitor: %+v", res)
	}
}
