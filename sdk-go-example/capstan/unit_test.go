package capstan

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	pb "capstan.dev/sdk-go-example/gen/capstan/v1"
)

func TestPatchBuildsMergePatchesPerTarget(t *testing.T) {
	var p Patch
	if !p.Empty() {
		t.Fatal("a new patch is not empty")
	}
	p.Label("a", "1")
	p.RemoveLabel("b")
	p.Annotation("c.example/d", "x")
	p.Set([]string{"spec", "size"}, 3)
	p.Status("phase", "Ready")
	msgs, err := p.messages()
	if err != nil {
		t.Fatal(err)
	}
	want := []struct {
		target pb.PatchTarget
		body   string
	}{
		{pb.PatchTarget_PATCH_TARGET_OBJECT,
			`{"metadata":{"annotations":{"c.example/d":"x"},"labels":{"a":"1","b":null}},"spec":{"size":3}}`},
		{pb.PatchTarget_PATCH_TARGET_STATUS, `{"status":{"phase":"Ready"}}`},
	}
	if len(msgs) != len(want) {
		t.Fatalf("patches = %v", msgs)
	}
	for i, w := range want {
		if msgs[i].GetTarget() != w.target || string(msgs[i].GetBody().GetJson()) != w.body ||
			msgs[i].GetType() != pb.PatchType_PATCH_TYPE_MERGE {
			t.Errorf("patch %d = %v, want %v", i, msgs[i], w)
		}
	}
}

func TestResultOfAnUnencodableValueIsUnclassified(t *testing.T) {
	r := result("i", func() {}, nil, &Patch{}, false, time.Millisecond)
	if r.GetUnclassifiedError() == nil {
		t.Errorf("result = %v", r)
	}
	r = result("i", json.RawMessage(`null`), nil, &Patch{}, false, time.Millisecond)
	if r.GetSuccess() == nil || r.GetSuccess().GetResult() != nil {
		t.Errorf("a null result must be no result: %v", r)
	}
}

func TestInvocationRejectsMalformedJSON(t *testing.T) {
	if _, err := newInvocation(&pb.Invocation{Body: &pb.Json{Json: []byte("{")}}); err == nil {
		t.Error("a malformed body was accepted")
	}
	inv, err := newInvocation(&pb.Invocation{Attempt: 1, Payload: &pb.Invocation_Event{Event: &pb.ResourceEvent{Type: pb.EventType_EVENT_TYPE_MODIFIED}}})
	if err != nil || inv.EventType != "MODIFIED" || inv.Reason != "" || inv.Body != nil {
		t.Errorf("event invocation = %+v, %v", inv, err)
	}
}

func TestBackoffGrowsWithJitterUpToTheCap(t *testing.T) {
	var r Registry
	for range 100 {
		if d := r.backoff(0); d < 125*time.Millisecond || d > 250*time.Millisecond {
			t.Fatalf("first delay %v", d)
		}
		if d := r.backoff(3); d < time.Second || d > 2*time.Second {
			t.Fatalf("fourth delay %v", d)
		}
		if d := r.backoff(1000); d < 15*time.Second || d > 30*time.Second {
			t.Fatalf("capped delay %v", d)
		}
	}
}

func TestDuplicateHandlerIDsPanic(t *testing.T) {
	defer func() {
		if recover() == nil {
			t.Error("no panic")
		}
	}()
	reg := NewRegistry()
	reg.OnCreate("examples", "fn", func(_ context.Context, _ *Invocation) (any, error) { return nil, nil })
	reg.OnUpdate("examples", "fn", func(_ context.Context, _ *Invocation) (any, error) { return nil, nil })
}

func TestSelectorsGoIntoTheResourceSelector(t *testing.T) {
	reg := NewRegistry()
	noop := func(_ context.Context, _ *Invocation) (any, error) { return nil, nil }
	reg.OnCreate("pods", "local", noop, FieldSelector("spec.nodeName=node-1"), LabelSelector("app=db"))
	got := reg.registrations()[0].GetResource()
	if got.GetFieldSelector() != "spec.nodeName=node-1" || got.GetLabelSelector() != "app=db" {
		t.Fatalf("selectors not set: %v", got)
	}
}
