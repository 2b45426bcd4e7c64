package capstan_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"reflect"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"capstan.dev/sdk-go-example/capstan"
	"capstan.dev/sdk-go-example/capstantest"
)

const res = "examples.demo.capstan.dev"

func noop(context.Context, *capstan.Invocation) (any, error) { return nil, nil }

func body(name string, spec map[string]any) map[string]any {
	return map[string]any{"metadata": map[string]any{"name": name, "namespace": "default", "uid": "uid-" + name},
		"spec": spec}
}

func TestEveryKindAndOptionIsRegistered(t *testing.T) {
	reg := capstan.NewRegistry()
	reg.MaxInFlight = 32
	reg.OnCreate(res, "create_fn", noop, capstan.Retries(3), capstan.Backoff(2*time.Second),
		capstan.Timeout(time.Minute), capstan.Errors(capstan.ErrorsPermanent), capstan.MaxInFlight(4),
		capstan.Param(map[string]any{"x": 1}), capstan.Label("app", capstan.Equals("db")),
		capstan.Annotation("skip", capstan.Absent), capstan.Field("spec.size"), capstan.Value(capstan.Equals(3)),
		capstan.When(func(*capstan.Invocation) bool { return true }),
		capstan.LabelSelector("app=db"), capstan.FieldSelector("metadata.name=one"), capstan.AlsoFor("demo.capstan.dev/v1/others"))
	reg.OnUpdate(res, "update_fn", noop, capstan.Field("spec.size"), capstan.Old(capstan.Present), capstan.New(capstan.Equals(2)))
	reg.OnDelete(res, "delete_fn", noop, capstan.Optional())
	reg.OnResume(res, "resume_fn", noop, capstan.Deleted())
	reg.OnField(res, "spec.field", "field_fn", noop)
	reg.OnEvent(res, "event_fn", noop)
	reg.Daemon(res, "monitor", noop, capstan.InitialDelay(time.Second), capstan.CancellationBackoff(2*time.Second),
		capstan.CancellationTimeout(3*time.Second), capstan.RestartBackoff(4*time.Second), capstan.NoRestartAfterSuccess())
	reg.Timer(res, "tick", 10*time.Second, noop, capstan.Idle(5*time.Second), capstan.Sharp(), capstan.InitialDelay(time.Second))
	reg.OnStartup("startup_fn", noop)
	reg.OnCleanup("cleanup_fn", noop)
	reg.OnLogin("login_fn", noop)
	reg.OnProbe("probe_fn", noop)

	ctl := capstantest.NewController(t)
	ctl.Serve(t, reg)
	hello := ctl.Hello(t)

	var kinds []string
	for _, h := range hello.Handlers {
		kinds = append(kinds, h.ID+":"+string(h.Kind))
	}
	want := []string{"create_fn:create", "create_fn:create", "update_fn:update", "delete_fn:delete", "resume_fn:resume",
		"field_fn/spec.field:field", "event_fn:event", "monitor:daemon", "tick:timer", "startup_fn:startup",
		"cleanup_fn:cleanup", "login_fn:login", "probe_fn:probe"}
	if !reflect.DeepEqual(kinds, want) {
		t.Errorf("handlers = %v, want %v", kinds, want)
	}
	for _, c := range []string{"CAPABILITY_RESULT_ACK", "CAPABILITY_INVOCATION_UPDATES", "CAPABILITY_SDK_FILTERS",
		"CAPABILITY_SUBHANDLERS", "CAPABILITY_OBJECT_UPDATES"} {
		if !strings.Contains(strings.Join(hello.Capabilities, " "), c) {
			t.Errorf("capability %s not announced: %v", c, hello.Capabilities)
		}
	}
	if hello.MaxInFlight != 32 || !strings.HasSuffix(hello.SDK, " go") || len(hello.InstanceID) != 32 {
		t.Errorf("hello = %+v", hello)
	}

	create := hello.Handlers[0]
	if create.Resource != res || create.Retries != 3 || create.Backoff != 2*time.Second || create.Timeout != time.Minute ||
		create.Errors != capstan.ErrorsPermanent || create.MaxInFlight != 4 || create.LabelSelector != "app=db" ||
		create.FieldSelector != "metadata.name=one" {
		t.Errorf("create_fn = %+v", create)
	}
	if p, _ := create.Param.(map[string]any); p["x"] != json.Number("1") {
		t.Errorf("param = %v", create.Param)
	}
	filters, _ := json.Marshal(create.Filters)
	for _, s := range []string{`"app":{"equals":"db"}`, `"skip":{"presence":"PRESENCE_ABSENT"}`, `"field":"spec.size"`,
		`"value":{"equals":3}`, `"sdk_when":true`} {
		if !strings.Contains(string(filters), s) {
			t.Errorf("filters %s lack %s", filters, s)
		}
	}
	also := hello.Handlers[1]
	if also.Group != "demo.capstan.dev" || also.Version != "v1" || also.Resource != "others" {
		t.Errorf("AlsoFor registration = %+v", also)
	}
	checks := map[string]string{
		"update_fn":           `"old":{"presence":"PRESENCE_PRESENT"}`,
		"delete_fn":           `"optional":true`,
		"resume_fn":           `"deleted":true`,
		"monitor":             `"cancellation_backoff":"2s","cancellation_timeout":"3s","initial_delay":"1s","no_restart_after_success":true,"restart_backoff":"4s"`,
		"tick":                `"idle":"5s","initial_delay":"1s","interval":"10s","sharp":true`,
		"field_fn/spec.field": `"field":"spec.field"`,
	}
	for id, s := range checks {
		h, _ := hello.Handler(id)
		doc, _ := json.Marshal(map[string]any{"f": h.Filters, "k": h.KindOptions})
		if !strings.Contains(string(doc), s) {
			t.Errorf("%s: %s lacks %s", id, doc, s)
		}
	}
	if h, _ := hello.Handler("probe_fn"); h.Resource != "" {
		t.Errorf("an activity has a resource: %+v", h)
	}
}

func TestMisusedOptionsPanicAtRegistration(t *testing.T) {
	cases := map[string]func(r *capstan.Registry){
		"duplicate id":         func(r *capstan.Registry) { r.OnCreate(res, "a", noop); r.OnUpdate(res, "a", noop) },
		"empty id":             func(r *capstan.Registry) { r.OnCreate(res, "", noop) },
		"nil function":         func(r *capstan.Registry) { r.OnCreate(res, "a", nil) },
		"optional on create":   func(r *capstan.Registry) { r.OnCreate(res, "a", noop, capstan.Optional()) },
		"label on an activity": func(r *capstan.Registry) { r.OnStartup("a", noop, capstan.Label("x", capstan.Present)) },
		"value without field":  func(r *capstan.Registry) { r.OnCreate(res, "a", noop, capstan.Value(capstan.Equals(1))) },
		"old on create": func(r *capstan.Registry) {
			r.OnCreate(res, "a", noop, capstan.Field("x"), capstan.Old(capstan.Present))
		},
		"value with new": func(r *capstan.Registry) {
			r.OnUpdate(res, "a", noop, capstan.Field("x"), capstan.Value(capstan.Present), capstan.New(capstan.Present))
		},
		"zero interval":       func(r *capstan.Registry) { r.Timer(res, "a", 0, noop) },
		"sharp on a daemon":   func(r *capstan.Registry) { r.Daemon(res, "a", noop, capstan.Sharp()) },
		"non-string label":    func(r *capstan.Registry) { r.OnCreate(res, "a", noop, capstan.Label("x", capstan.Equals(1))) },
		"unknown errors mode": func(r *capstan.Registry) { r.OnCreate(res, "a", noop, capstan.Errors("sometimes")) },
	}
	for name, register := range cases {
		t.Run(name, func(t *testing.T) {
			defer func() {
				if recover() == nil {
					t.Error("no panic")
				}
			}()
			register(capstan.NewRegistry())
		})
	}
}

func TestChangeHandlersGetKopfsArgumentsAndReturnResultsAndPatches(t *testing.T) {
	seen := make(chan *capstan.Invocation, 8)
	handler := func(_ context.Context, inv *capstan.Invocation) (any, error) {
		seen <- inv
		inv.Logf("handling %s", inv.Name())
		inv.Patch().Label("demo.capstan.dev/handled-by", "go")
		inv.Patch().Status("phase", "Ready")
		return map[string]string{"message": "hello " + inv.Name()}, nil
	}
	reg := capstan.NewRegistry()
	for _, k := range []string{"create", "update", "delete", "resume"} {
		switch k {
		case "create":
			reg.OnCreate(res, k, handler)
		case "update":
			reg.OnUpdate(res, k, handler)
		case "delete":
			reg.OnDelete(res, k, handler)
		case "resume":
			reg.OnResume(res, k, handler)
		}
	}
	reg.OnField(res, "spec.size", "field_fn", handler, capstan.Param("p"))
	ctl := capstantest.NewController(t)
	ctl.Serve(t, reg)

	for _, id := range []string{"create", "update", "delete", "resume"} {
		r := ctl.Invoke(t, capstantest.Invocation{Handler: id, Body: body("one", map[string]any{"size": 3}), Attempt: 3,
			LastError: "earlier failure"})
		if r.Outcome != capstantest.Success || !reflect.DeepEqual(r.Value, map[string]any{"message": "hello one"}) {
			t.Fatalf("%s: %+v", id, r)
		}
		if r.Patch.Object["metadata"] == nil || !reflect.DeepEqual(r.Patch.Status, map[string]any{"status": map[string]any{"phase": "Ready"}}) {
			t.Errorf("%s: patch = %+v", id, r.Patch)
		}
		if len(r.Logs) != 1 || r.Logs[0].Message != "handling one" || r.Logs[0].Level != capstan.LevelInfo {
			t.Errorf("%s: logs = %+v", id, r.Logs)
		}
		inv := <-seen
		if string(inv.Reason) != id || inv.Retry != 2 || inv.Spec()["size"] != json.Number("3") || inv.UID() != "uid-one" ||
			inv.LastError == nil || inv.LastError.Summary != "earlier failure" || inv.Kind != capstan.Kind(id) {
			t.Errorf("%s: invocation = %+v", id, inv)
		}
	}
	r := ctl.Invoke(t, capstantest.Invocation{Handler: "field_fn/spec.size", Old: 1, New: 2,
		Diff: []capstan.DiffItem{{Op: capstan.DiffChange, Path: []string{"spec", "size"}, Old: 1, New: 2}}})
	if r.Outcome != capstantest.Success {
		t.Fatalf("field: %+v", r)
	}
	inv := <-seen
	if inv.Field != "spec.size" || inv.Old != json.Number("1") || inv.New != json.Number("2") || inv.Param != "p" ||
		len(inv.Diff) != 1 || inv.Diff[0].Op != capstan.DiffChange || inv.Reason != capstan.ReasonUpdate {
		t.Errorf("field invocation = %+v", inv)
	}
}

func TestEventHandlersSeeTheEventTypeAndDeletedEventsDropTheMemo(t *testing.T) {
	types := make(chan capstan.EventType, 4)
	memo := make(chan any, 4)
	reg := capstan.NewRegistry()
	reg.OnEvent(res, "event_fn", func(_ context.Context, inv *capstan.Invocation) (any, error) {
		types <- inv.EventType
		v, _ := inv.Memo().LoadOrStore("seen", inv.EventType)
		memo <- v
		return nil, nil
	})
	ctl := capstantest.NewController(t)
	ctl.Serve(t, reg)
	for _, et := range []capstan.EventType{capstan.EventListed, capstan.EventModified, capstan.EventDeleted, capstan.EventAdded} {
		if r := ctl.Invoke(t, capstantest.Invocation{Handler: "event_fn", EventType: et}); r.Outcome != capstantest.Success {
			t.Fatalf("%q: %+v", et, r)
		}
		if got := <-types; got != et {
			t.Errorf("event type %q, want %q", got, et)
		}
	}
	// The memo kept the first value until the DELETED event, and started afresh after it.
	got := []any{<-memo, <-memo, <-memo, <-memo}
	want := []any{capstan.EventListed, capstan.EventListed, capstan.EventListed, capstan.EventAdded}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("memo values %v, want %v", got, want)
	}
}

func TestActivitiesRunAndLoginReturnsCredentials(t *testing.T) {
	activities := make(chan capstan.Activity, 4)
	record := func(_ context.Context, inv *capstan.Invocation) (any, error) {
		activities <- inv.Activity
		return nil, nil
	}
	reg := capstan.NewRegistry()
	reg.OnStartup("startup_fn", record)
	reg.OnCleanup("cleanup_fn", record)
	reg.OnLogin("login_fn", func(context.Context, *capstan.Invocation) (any, error) {
		return &capstan.Credentials{Server: "https://api", Token: "secret", Priority: 5,
			Expiration: time.Unix(2000000000, 0)}, nil
	})
	reg.OnProbe("probe_fn", func(context.Context, *capstan.Invocation) (any, error) { return 42, nil })
	ctl := capstantest.NewController(t)
	ctl.Serve(t, reg)
	for _, id := range []string{"startup_fn", "cleanup_fn"} {
		if r := ctl.Invoke(t, capstantest.Invocation{Handler: id}); r.Outcome != capstantest.Success {
			t.Fatalf("%s: %+v", id, r)
		}
	}
	if a, b := <-activities, <-activities; a != capstan.ActivityStartup || b != capstan.ActivityCleanup {
		t.Errorf("activities %q, %q", a, b)
	}
	r := ctl.Invoke(t, capstantest.Invocation{Handler: "login_fn"})
	if c := r.Credentials; c == nil || c.Server != "https://api" || c.Token != "secret" || c.Priority != 5 ||
		!c.Expiration.Equal(time.Unix(2000000000, 0)) {
		t.Errorf("login = %+v", r)
	}
	if r := ctl.Invoke(t, capstantest.Invocation{Handler: "probe_fn"}); r.Value != json.Number("42") {
		t.Errorf("probe = %+v", r)
	}
}

func TestWhenFiltersSkipInvocations(t *testing.T) {
	calls := atomic.Int32{}
	reg := capstan.NewRegistry()
	reg.OnCreate(res, "fn", func(context.Context, *capstan.Invocation) (any, error) { calls.Add(1); return nil, nil },
		capstan.When(func(inv *capstan.Invocation) bool { return inv.Name() != "ignored" }))
	ctl := capstantest.NewController(t)
	ctl.Serve(t, reg)
	if r := ctl.Invoke(t, capstantest.Invocation{Handler: "fn", Body: body("ignored", nil)}); r.Outcome != capstantest.Skipped {
		t.Errorf("ignored: %+v", r)
	}
	if r := ctl.Invoke(t, capstantest.Invocation{Handler: "fn", Body: body("taken", nil)}); r.Outcome != capstantest.Success {
		t.Errorf("taken: %+v", r)
	}
	if calls.Load() != 1 {
		t.Errorf("%d calls", calls.Load())
	}
}

func TestErrorsAreClassifiedAsKopfDoesAndPanicsAreReported(t *testing.T) {
	reg := capstan.NewRegistry()
	add := func(id string, err error) {
		reg.OnCreate(res, id, func(_ context.Context, inv *capstan.Invocation) (any, error) {
			inv.Patch().Label("discarded", "yes")
			return nil, err
		})
	}
	add("temporary", fmt.Errorf("wrapped: %w", capstan.Temporaryf(7*time.Second, "not yet")))
	add("temporary_default", &capstan.TemporaryError{Err: errors.New("later")})
	add("permanent", capstan.Permanentf("never"))
	add("unclassified", errors.New("boom\nmore detail"))
	reg.OnCreate(res, "panics", func(context.Context, *capstan.Invocation) (any, error) {
		panic(fmt.Sprintf("handler bug %d", 42))
	})
	reg.OnCreate(res, "unencodable", func(context.Context, *capstan.Invocation) (any, error) { return func() {}, nil })
	ctl := capstantest.NewController(t)
	ctl.Serve(t, reg)

	inv := func(id string) capstantest.Result { return ctl.Invoke(t, capstantest.Invocation{Handler: id}) }
	if r := inv("temporary"); r.Outcome != capstantest.Temporary || r.Delay != 7*time.Second ||
		r.Message != "wrapped: not yet" || r.Patch.Object != nil {
		t.Errorf("temporary = %+v", r)
	}
	if r := inv("temporary_default"); r.Outcome != capstantest.Temporary || r.Delay != 0 {
		t.Errorf("temporary without a delay = %+v", r)
	}
	if r := inv("permanent"); r.Outcome != capstantest.Permanent || r.Message != "never" {
		t.Errorf("permanent = %+v", r)
	}
	if r := inv("unclassified"); r.Outcome != capstantest.Unclassified || r.Message != "boom" ||
		r.Detail != "more detail" || r.ErrorType != "*errors.errorString" {
		t.Errorf("unclassified = %+v", r)
	}
	if r := inv("panics"); r.Outcome != capstantest.Unclassified || r.ErrorType != "panic" ||
		!strings.Contains(r.Message, "handler bug 42") || !strings.Contains(r.StackTrace, "capstan_test.go") {
		t.Errorf("panic = %+v", r)
	}
	if r := inv("unencodable"); r.Outcome != capstantest.Unclassified {
		t.Errorf("unencodable result = %+v", r)
	}
	if r := inv("nobody"); r.Outcome != capstantest.Permanent || r.Reason != "UNKNOWN_HANDLER" {
		t.Errorf("unknown handler = %+v", r)
	}
	if r := inv("temporary"); r.Outcome != capstantest.Temporary {
		t.Errorf("the process stopped serving after a panic: %+v", r)
	}
}

func TestDaemonsSeeLiveBodiesSendInterimPatchesAndLearnWhyTheyStop(t *testing.T) {
	sizes := make(chan any, 4)
	reasons := make(chan capstan.CancelReason, 1)
	reg := capstan.NewRegistry()
	reg.Daemon(res, "monitor", func(ctx context.Context, inv *capstan.Invocation) (any, error) {
		inv.Memo().Store("daemon", "running")
		for {
			sizes <- inv.Spec()["size"]
			p := &capstan.Patch{}
			p.Status("size", inv.Spec()["size"])
			if err := inv.SendPatch(p); err != nil {
				return nil, err
			}
			select {
			case <-ctx.Done():
				var c *capstan.CancelledError
				if errors.As(context.Cause(ctx), &c) {
					reasons <- c.Reason
				}
				if inv.CancelReason() != c.Reason {
					return nil, fmt.Errorf("CancelReason() = %q", inv.CancelReason())
				}
				return nil, ctx.Err()
			case <-time.After(20 * time.Millisecond):
			}
		}
	})
	memo := make(chan any, 1)
	reg.OnUpdate(res, "update_fn", func(_ context.Context, inv *capstan.Invocation) (any, error) {
		v, _ := inv.Memo().Load("daemon")
		memo <- v
		return nil, nil
	})
	ctl := capstantest.NewController(t)
	ctl.Serve(t, reg)
	run := ctl.Start(t, capstantest.Invocation{Handler: "monitor", Body: body("d", map[string]any{"size": 1})})
	if u := run.NextUpdate(t); !reflect.DeepEqual(u.Status, map[string]any{"status": map[string]any{"size": json.Number("1")}}) {
		t.Fatalf("first update = %+v", u)
	}
	run.UpdateBody(t, body("d", map[string]any{"size": 2}))
	deadline := time.After(capstantest.Wait)
	for seen := false; !seen; {
		select {
		case s := <-sizes:
			seen = s == json.Number("2")
		case <-deadline:
			t.Fatal("the daemon never saw the new body")
		}
	}
	// Another handler of the same object shares the daemon's memo.
	ctl.Invoke(t, capstantest.Invocation{Handler: "update_fn", Body: body("d", nil)})
	if v := <-memo; v != "running" {
		t.Errorf("memo value %v", v)
	}
	if n := ctl.Ping(t); n != 1 {
		t.Errorf("in flight = %d", n)
	}
	run.Cancel(t, capstan.CancelResourceDeleted)
	if r := run.Wait(t); r.Outcome != capstantest.Cancelled {
		t.Errorf("result = %+v", r)
	}
	if r := <-reasons; r != capstan.CancelResourceDeleted {
		t.Errorf("reason = %q", r)
	}
	// The object is gone: its memo went with it.
	ctl.Invoke(t, capstantest.Invocation{Handler: "update_fn", Body: body("d", nil)})
	if v := <-memo; v != nil {
		t.Errorf("memo survived the deletion: %v", v)
	}
}

func TestTimersTick(t *testing.T) {
	reg := capstan.NewRegistry()
	reg.Timer(res, "tick", time.Second, func(_ context.Context, inv *capstan.Invocation) (any, error) {
		if inv.Scheduled.IsZero() {
			return nil, errors.New("no schedule")
		}
		inv.Patch().Status("ticks", 1)
		return nil, nil
	})
	ctl := capstantest.NewController(t)
	ctl.Serve(t, reg)
	if r := ctl.Invoke(t, capstantest.Invocation{Handler: "tick"}); r.Outcome != capstantest.Success || r.Patch.Status == nil {
		t.Errorf("tick = %+v", r)
	}
}

func TestSubhandlersNestRunUntilFinishedAndApplyTheirOptions(t *testing.T) {
	var calls atomic.Int32
	reg := capstan.NewRegistry()
	reg.OnCreate(res, "parent", func(_ context.Context, inv *capstan.Invocation) (any, error) {
		inv.Subhandler("a", func(_ context.Context, sub *capstan.Invocation) (any, error) {
			sub.Patch().Label("a", "done")
			return map[string]any{"id": sub.HandlerID}, nil
		})
		inv.Subhandler("b", func(_ context.Context, sub *capstan.Invocation) (any, error) {
			sub.Subhandler("c", func(context.Context, *capstan.Invocation) (any, error) {
				calls.Add(1)
				return nil, errors.New("flaky")
			}, capstan.Backoff(3*time.Second), capstan.Retries(2))
			return nil, nil
		})
		inv.Subhandler("ignored", func(context.Context, *capstan.Invocation) (any, error) {
			return nil, errors.New("boom")
		}, capstan.Errors(capstan.ErrorsIgnored))
		inv.Subhandler("skipped", noop, capstan.When(func(*capstan.Invocation) bool { return false }))
		return "parent done", nil
	})
	ctl := capstantest.NewController(t)
	ctl.Serve(t, reg)

	r := ctl.Invoke(t, capstantest.Invocation{Handler: "parent"})
	outcomes := map[string]capstantest.SubhandlerResult{}
	for _, s := range r.Subhandlers {
		outcomes[s.ID] = s
	}
	if r.Outcome != capstantest.Success || r.Value != "parent done" || len(r.Subhandlers) != 3 {
		t.Fatalf("result = %+v", r)
	}
	if a := outcomes["a"]; a.Outcome != capstantest.Success || !reflect.DeepEqual(a.Value, map[string]any{"id": "parent/a"}) {
		t.Errorf("a = %+v", a)
	}
	// b is reported only once its own sub-handler c has finished.
	if c := outcomes["b/c"]; c.Outcome != capstantest.Temporary || c.Delay != 3*time.Second {
		t.Errorf("b/c = %+v", c)
	}
	if _, ok := outcomes["b"]; ok {
		t.Errorf("b reported before its sub-handler finished: %+v", r.Subhandlers)
	}
	if s := outcomes["ignored"]; s.Outcome != capstantest.Success {
		t.Errorf("an ignored error = %+v", s)
	}
	if !reflect.DeepEqual(r.Patch.Object, map[string]any{"metadata": map[string]any{"labels": map[string]any{"a": "done"}}}) {
		t.Errorf("patch = %+v", r.Patch)
	}

	// The next attempt skips the finished ones; c's second attempt exhausts its retries.
	r = ctl.Invoke(t, capstantest.Invocation{Handler: "parent", Attempt: 2, Subhandlers: []capstantest.SubhandlerState{
		{ID: "a", Success: true}, {ID: "ignored", Success: true}, {ID: "b/c", Retries: 1},
	}})
	got := map[string]capstantest.Outcome{}
	for _, s := range r.Subhandlers {
		got[s.ID] = s.Outcome
	}
	if !reflect.DeepEqual(got, map[string]capstantest.Outcome{"b/c": capstantest.Permanent, "b": capstantest.Success}) {
		t.Errorf("second attempt = %+v", r.Subhandlers)
	}
	// A sub-handler that waits for its retry is not run.
	r = ctl.Invoke(t, capstantest.Invocation{Handler: "parent", Subhandlers: []capstantest.SubhandlerState{
		{ID: "a", Success: true}, {ID: "ignored", Success: true}, {ID: "b/c", DelayedUntil: time.Now().Add(time.Hour)},
	}})
	if len(r.Subhandlers) != 0 || calls.Load() != 2 {
		t.Errorf("waiting sub-handler ran: %+v, %d calls", r.Subhandlers, calls.Load())
	}
}

func TestCancelsDeadlinesAndPings(t *testing.T) {
	release := make(chan struct{})
	reg := capstan.NewRegistry()
	reg.OnCreate(res, "waits", func(ctx context.Context, _ *capstan.Invocation) (any, error) {
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-release:
			return "released", nil
		}
	})
	reg.OnCreate(res, "gives_up", func(ctx context.Context, _ *capstan.Invocation) (any, error) {
		<-ctx.Done()
		return nil, errors.New("stopped half-way") // any error after a cancel is "cancelled"
	})
	ctl := capstantest.NewController(t)
	ctl.Serve(t, reg)

	gaveUp := ctl.Start(t, capstantest.Invocation{Handler: "gives_up"})
	gaveUp.Cancel(t, capstan.CancelPaused)
	if r := gaveUp.Wait(t); r.Outcome != capstantest.Cancelled {
		t.Errorf("an error after a cancel = %+v", r)
	}

	run := ctl.Start(t, capstantest.Invocation{Handler: "waits"})
	if n := ctl.Ping(t); n != 1 {
		t.Errorf("in flight while running = %d", n)
	}
	close(release)
	if r := run.Wait(t); r.Value != "released" {
		t.Errorf("result = %+v", r)
	}
	release = make(chan struct{})
	r := ctl.Invoke(t, capstantest.Invocation{Handler: "waits", Deadline: time.Now().Add(50 * time.Millisecond)})
	if r.Outcome != capstantest.Cancelled {
		t.Errorf("after the deadline = %+v", r)
	}
	run = ctl.Start(t, capstantest.Invocation{Handler: "waits"})
	run.Cancel(t, capstan.CancelRuntimeShutdown)
	if r := run.Wait(t); r.Outcome != capstantest.Cancelled {
		t.Errorf("cancelled = %+v", r)
	}
}

func TestReconnectsAfterALostStreamAndSaysGoodbyeOnShutdown(t *testing.T) {
	causes := make(chan error, 1)
	reg := capstan.NewRegistry()
	reg.OnCreate(res, "fn", func(ctx context.Context, inv *capstan.Invocation) (any, error) {
		if inv.Name() == "old" {
			<-ctx.Done()
			causes <- context.Cause(ctx)
			return nil, ctx.Err()
		}
		return "new", nil
	})
	ctl := capstantest.NewController(t)
	p := ctl.Serve(t, reg)
	first := ctl.Hello(t)
	ctl.Start(t, capstantest.Invocation{Handler: "fn", Body: body("old", nil)})
	ctl.Ping(t) // the invocation is running
	ctl.Drop(t)
	var c *capstan.CancelledError
	if err := <-causes; !errors.As(err, &c) || c.Reason != capstan.CancelStreamLost {
		t.Errorf("cause of the running invocation = %v", err)
	}
	again := ctl.WaitConnected(t)
	if again.InstanceID != first.InstanceID {
		t.Errorf("a new instance id after reconnecting")
	}
	if r := ctl.Invoke(t, capstantest.Invocation{Handler: "fn", Body: body("new", nil)}); r.Value != "new" {
		t.Errorf("after reconnecting = %+v", r)
	}
	if err := p.Stop(t); err != nil {
		t.Errorf("Run = %v", err)
	}
	if ctl.Goodbyes() != 1 {
		t.Errorf("%d goodbyes", ctl.Goodbyes())
	}
}

func TestAProcessWithCleanupHandlersAsksForThemInItsGoodbyeAndStopsAtTheFarewell(t *testing.T) {
	reg := &capstan.Registry{ShutdownGrace: time.Second}
	reg.OnCleanup("cleanup_fn", func(context.Context, *capstan.Invocation) (any, error) { return nil, nil })
	ctl := capstantest.NewController(t)
	p := ctl.Serve(t, reg)
	ctl.Ping(t) // the session serves
	started := time.Now()
	if err := p.Stop(t); err != nil {
		t.Errorf("Run = %v", err)
	}
	if ctl.Goodbyes() != 1 || ctl.CleanupGoodbyes() != 1 {
		t.Errorf("%d goodbyes, %d asking for cleanup", ctl.Goodbyes(), ctl.CleanupGoodbyes())
	}
	if elapsed := time.Since(started); elapsed > 5*time.Second {
		t.Errorf("Run returned %s after the stop: the farewell was not taken", elapsed)
	}

	plain := &capstan.Registry{}
	plain.OnStartup("startup_fn", func(context.Context, *capstan.Invocation) (any, error) { return nil, nil })
	ctl = capstantest.NewController(t)
	p = ctl.Serve(t, plain)
	ctl.Ping(t)
	if err := p.Stop(t); err != nil {
		t.Errorf("Run = %v", err)
	}
	if ctl.Goodbyes() != 1 || ctl.CleanupGoodbyes() != 0 {
		t.Errorf("without cleanup handlers: %d goodbyes, %d asking for cleanup", ctl.Goodbyes(), ctl.CleanupGoodbyes())
	}
}

func TestShutdownLetsInvocationsFinishThenCancelsThem(t *testing.T) {
	reg := capstan.NewRegistry()
	reg.ShutdownGrace = 100 * time.Millisecond
	reg.OnCreate(res, "fn", func(ctx context.Context, _ *capstan.Invocation) (any, error) {
		<-ctx.Done()
		return nil, ctx.Err()
	})
	ctl := capstantest.NewController(t)
	p := ctl.Serve(t, reg)
	run := ctl.Start(t, capstantest.Invocation{Handler: "fn"})
	ctl.Ping(t)
	if err := p.Stop(t); err != nil {
		t.Errorf("Run = %v", err)
	}
	if r := run.Wait(t); r.Outcome != capstantest.Cancelled {
		t.Errorf("result = %+v", r)
	}
}

func TestNoAcceptedHandlerIsFatalAndRejectionsAreSurvived(t *testing.T) {
	ctl := capstantest.NewController(t)
	ctl.Reject("tick", "BAD_FILTER")
	reg := capstan.NewRegistry()
	reg.OnCreate(res, "fn", func(context.Context, *capstan.Invocation) (any, error) { return "ok", nil })
	reg.Timer(res, "tick", time.Second, noop)
	ctl.Serve(t, reg)
	if r := ctl.Invoke(t, capstantest.Invocation{Handler: "fn"}); r.Value != "ok" {
		t.Errorf("the accepted handler = %+v", r)
	}

	lonely := capstantest.NewController(t)
	lonely.Reject("only", "UNKNOWN_RESOURCE")
	reg = capstan.NewRegistry()
	reg.OnCreate(res, "only", noop)
	done := make(chan error, 1)
	go func() { done <- reg.Run(context.Background(), lonely.Endpoint) }()
	select {
	case err := <-done:
		if err == nil || !strings.Contains(err.Error(), "accepted no handler") {
			t.Errorf("Run = %v", err)
		}
	case <-time.After(capstantest.Wait):
		t.Fatal("Run kept retrying after every handler was rejected")
	}
}

func TestMessagesAboveFourMebibytesPass(t *testing.T) {
	reg := capstan.NewRegistry()
	reg.OnCreate(res, "echo", func(_ context.Context, inv *capstan.Invocation) (any, error) {
		return inv.Spec()["data"], nil
	})
	ctl := capstantest.NewController(t)
	ctl.Serve(t, reg)
	data := strings.Repeat("x", 6<<20)
	r := ctl.Invoke(t, capstantest.Invocation{Handler: "echo", Body: body("big", map[string]any{"data": data})})
	if s, _ := r.Value.(string); len(s) != len(data) {
		t.Errorf("result of %d bytes", len(s))
	}
}
