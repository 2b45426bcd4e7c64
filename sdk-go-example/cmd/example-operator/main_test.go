package main

import (
	"encoding/json"
	"testing"

	"capstan.dev/sdk-go-example/capstan"
	"capstan.dev/sdk-go-example/capstantest"
)

func object(name string, spec map[string]any) map[string]any {
	return map[string]any{"metadata": map[string]any{"name": name, "namespace": "default", "uid": "u-" + name}, "spec": spec}
}

func TestTheOperatorAgainstAFakeController(t *testing.T) {
	ctl := capstantest.NewController(t)
	ctl.Serve(t, registry())

	// Retries: spec.fail_times temporary failures, then the greeting.
	flaky := object("flaky", map[string]any{"fail_times": 2})
	for attempt := 1; attempt <= 2; attempt++ {
		r := ctl.Invoke(t, capstantest.Invocation{Handler: "create_fn", Body: flaky, Attempt: attempt})
		if r.Outcome != capstantest.Temporary {
			t.Fatalf("attempt %d: %+v", attempt, r)
		}
	}
	r := ctl.Invoke(t, capstantest.Invocation{Handler: "create_fn", Body: flaky, Attempt: 3})
	if r.Outcome != capstantest.Success || r.Value.(map[string]any)["message"] != "hello flaky from go" {
		t.Fatalf("third attempt: %+v", r)
	}

	// Sub-handlers: service fails once and is retried alone.
	r = ctl.Invoke(t, capstantest.Invocation{Handler: "setup", Body: object("s", map[string]any{"fail_service": true})})
	if len(r.Subhandlers) != 2 || r.Subhandlers[0].Outcome != capstantest.Success || r.Subhandlers[1].Outcome != capstantest.Temporary {
		t.Fatalf("setup: %+v", r.Subhandlers)
	}
	r = ctl.Invoke(t, capstantest.Invocation{Handler: "setup", Body: object("s", map[string]any{"fail_service": true}),
		Subhandlers: []capstantest.SubhandlerState{{ID: "config", Success: true}, {ID: "service", Retries: 1}}})
	if len(r.Subhandlers) != 1 || r.Subhandlers[0].ID != "service" || r.Subhandlers[0].Outcome != capstantest.Success {
		t.Fatalf("setup again: %+v", r.Subhandlers)
	}

	// The daemon follows its object's body and writes what it sees at once.
	run := ctl.Start(t, capstantest.Invocation{Handler: "monitor", Body: object("d", map[string]any{"field": "a"})})
	if u := run.NextUpdate(t); u.Object["metadata"].(map[string]any)["annotations"].(map[string]any)["demo.capstan.dev/monitored"] != "a" {
		t.Fatalf("first update: %+v", u)
	}
	run.UpdateBody(t, object("d", map[string]any{"field": "b"}))
	if u := run.NextUpdate(t); u.Object["metadata"].(map[string]any)["annotations"].(map[string]any)["demo.capstan.dev/monitored"] != "b" {
		t.Fatalf("second update: %+v", u)
	}
	run.Cancel(t, capstan.CancelResourceDeleted)
	if r := run.Wait(t); r.Outcome != capstantest.Cancelled {
		t.Fatalf("daemon: %+v", r)
	}

	// The timer counts, and the probe reports the creations.
	body := object("t", nil)
	body["status"] = map[string]any{"ticks": 4}
	r = ctl.Invoke(t, capstantest.Invocation{Handler: "tick", Body: body})
	if r.Patch.Status["status"].(map[string]any)["ticks"] != json.Number("5") {
		t.Fatalf("tick: %+v", r)
	}
	r = ctl.Invoke(t, capstantest.Invocation{Handler: "probe_fn"})
	if r.Value.(map[string]any)["created"] != json.Number("1") {
		t.Fatalf("probe: %+v", r)
	}
}

func TestNumberReadsOnlyJSONIntegers(t *testing.T) {
	for _, c := range []struct {
		in   any
		want int
	}{{json.Number("3"), 3}, {json.Number("1.5"), 0}, {"3", 0}, {nil, 0}} {
		if got := number(c.in); got != c.want {
			t.Errorf("number(%#v) = %d, want %d", c.in, got, c.want)
		}
	}
}

func TestTheAdmissionHandlersAgainstAFakeController(t *testing.T) {
	t.Setenv("CAPSTAN_EXAMPLE_WEBHOOKS", "true")
	ctl := capstantest.NewController(t)
	ctl.Serve(t, registry())

	r := ctl.Invoke(t, capstantest.Invocation{Handler: "validate_fn", Body: object("big", map[string]any{"size": 500})})
	if r.Outcome != capstantest.Success || r.Verdict == nil || r.Verdict.Allowed ||
		r.Verdict.Code != 422 || r.Verdict.Message != "spec.size 500 is above 100" {
		t.Fatalf("validate big: %+v %+v", r, r.Verdict)
	}
	if len(r.Verdict.Warnings) != 1 || r.Verdict.Warnings[0] != "big has no spec.field" {
		t.Fatalf("warnings: %+v", r.Verdict.Warnings)
	}
	r = ctl.Invoke(t, capstantest.Invocation{Handler: "validate_fn", Body: object("ok", map[string]any{"size": 5, "field": "x"}),
		Operation: capstan.OperationUpdate, DryRun: true})
	if r.Verdict == nil || !r.Verdict.Allowed || len(r.Verdict.Warnings) != 0 {
		t.Fatalf("validate ok: %+v", r.Verdict)
	}

	r = ctl.Invoke(t, capstantest.Invocation{Handler: "mutate_fn", Body: object("m", map[string]any{})})
	if r.Verdict == nil || !r.Verdict.Allowed {
		t.Fatalf("mutate: %+v", r)
	}
	spec, _ := r.Patch.Object["spec"].(map[string]any)
	labels, _ := r.Patch.Object["metadata"].(map[string]any)["labels"].(map[string]any)
	if spec["size"] != json.Number("1") || labels["demo.capstan.dev/admitted-by"] != "go" {
		t.Fatalf("mutate patch: %+v", r.Patch.Object)
	}
}
