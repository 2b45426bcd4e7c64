package capstan

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"reflect"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	pb "capstan.dev/sdk-go-example/gen/capstan/v1"
)

func TestHandshakeRegistersEveryHandlerAndSurvivesRejections(t *testing.T) {
	f := startFake(t)
	reg := NewRegistry()
	const res = "examples.demo.capstan.dev"
	reg.OnCreate(res, "create_fn", func(context.Context, *Invocation) (any, error) { return "ok", nil },
		Retries(3), Backoff(2*time.Second), Timeout(time.Minute), Errors(ErrorsPermanent),
		LabelIs("app", "demo"), AnnotationPresent("skip", false))
	reg.OnField(res, "spec.field", "field_fn", func(context.Context, *Invocation) (any, error) { return nil, nil })
	reg.Daemon(res, "monitor", func(ctx context.Context, _ *Invocation) (any, error) { <-ctx.Done(); return nil, ctx.Err() })
	reg.Timer(res, "tick", 10*time.Second, func(context.Context, *Invocation) (any, error) { return nil, nil })
	run(t, f, reg)

	c := f.accept(t)
	hello := c.handshake(t, "monitor", "tick")
	if got := hello.GetCapabilities(); !reflect.DeepEqual(got, []pb.Capability{pb.Capability_CAPABILITY_RESULT_ACK}) {
		t.Errorf("capabilities = %v", got)
	}
	if hello.GetSdk().GetLanguage() != "go" || len(hello.GetInstanceId()) != 32 {
		t.Errorf("sdk = %v, instance id = %q", hello.GetSdk(), hello.GetInstanceId())
	}
	var ids []string
	for _, h := range hello.GetHandlers() {
		ids = append(ids, h.GetHandlerId()+":"+h.GetKind().String())
	}
	want := []string{"create_fn:HANDLER_KIND_CREATE", "field_fn/spec.field:HANDLER_KIND_FIELD",
		"monitor:HANDLER_KIND_DAEMON", "tick:HANDLER_KIND_TIMER"}
	if !reflect.DeepEqual(ids, want) {
		t.Errorf("handlers = %v, want %v", ids, want)
	}
	create := hello.GetHandlers()[0]
	if create.GetResource().GetName() != res || create.GetRetries() != 3 ||
		create.GetBackoff().AsDuration() != 2*time.Second || create.GetTimeout().AsDuration() != time.Minute ||
		create.GetErrorsMode() != pb.ErrorsMode_ERRORS_MODE_PERMANENT {
		t.Errorf("create registration = %v", create)
	}
	if create.GetFilters().GetLabels()["app"].GetEquals() != "demo" ||
		create.GetFilters().GetAnnotations()["skip"].GetPresence() != pb.Presence_PRESENCE_ABSENT {
		t.Errorf("create filters = %v", create.GetFilters())
	}
	if got := hello.GetHandlers()[1].GetFilters().GetField(); got != "spec.field" {
		t.Errorf("field filter = %q", got)
	}
	if got := hello.GetHandlers()[3].GetTimer().GetInterval().AsDuration(); got != 10*time.Second {
		t.Errorf("timer interval = %v", got)
	}

	// The rejections do not stop the process: the accepted handler works.
	c.invoke(t, invocation("i-1", "create_fn"))
	if r := c.result(t); r.GetSuccess() == nil || string(r.GetSuccess().GetResult().GetJson()) != `"ok"` {
		t.Errorf("result = %v", r)
	}
}

func TestSuccessCarriesTheResultThePatchesAndTheArguments(t *testing.T) {
	f := startFake(t)
	seen := make(chan *Invocation, 1)
	run(t, f, one(func(_ context.Context, inv *Invocation) (any, error) {
		seen <- inv
		inv.Logf("creating %s", inv.Name())
		inv.Patch().Label("demo.capstan.dev/handled-by", "go")
		inv.Patch().Status("phase", "Ready")
		return map[string]string{"message": "hello " + inv.Name()}, nil
	}))
	c := f.accept(t)
	c.handshake(t)
	c.invoke(t, &pb.Invocation{
		InvocationId: "i-1", HandlerId: "fn", Attempt: 2, StartedTime: timestamppb.Now(),
		Payload: &pb.Invocation_Change{Change: &pb.ResourceChange{
			Reason: pb.ChangeReason_CHANGE_REASON_CREATE,
			New:    &pb.Json{Json: []byte(`{"spec":{"size":3}}`)},
			Diff: []*pb.DiffItem{{
				Operation: pb.DiffOperation_DIFF_OPERATION_ADD, Path: []string{"spec"},
				New: &pb.Json{Json: []byte(`{"size":3}`)},
			}},
		}},
	})

	// The log record comes first, then the result.
	var log *pb.LogRecord
	select {
	case m := <-c.in:
		log = m.GetLog()
	case <-time.After(wait):
	}
	if log.GetInvocationId() != "i-1" || log.GetMessage() != "creating one" || log.GetLevel() != pb.LogLevel_LOG_LEVEL_INFO {
		t.Errorf("log = %v", log)
	}
	r := c.result(t)
	if r.GetInvocationId() != "i-1" || string(r.GetSuccess().GetResult().GetJson()) != `{"message":"hello one"}` {
		t.Fatalf("result = %v", r)
	}
	if len(r.GetPatches()) != 2 {
		t.Fatalf("patches = %v", r.GetPatches())
	}
	wantPatches := []struct{ target, body string }{
		{"PATCH_TARGET_OBJECT", `{"metadata":{"labels":{"demo.capstan.dev/handled-by":"go"}}}`},
		{"PATCH_TARGET_STATUS", `{"status":{"phase":"Ready"}}`},
	}
	for i, want := range wantPatches {
		p := r.GetPatches()[i]
		if p.GetType() != pb.PatchType_PATCH_TYPE_MERGE || p.GetTarget().String() != want.target ||
			string(p.GetBody().GetJson()) != want.body {
			t.Errorf("patch %d = %v, want %v", i, p, want)
		}
	}
	if r.GetDuration() == nil {
		t.Error("no duration")
	}

	inv := <-seen
	if inv.Reason != "create" || inv.Retry != 1 || inv.Namespace() != "default" ||
		inv.Spec()["size"] != json.Number("3") || inv.Started.IsZero() {
		t.Errorf("invocation = %+v", inv)
	}
	if len(inv.Diff) != 1 || inv.Diff[0].Op != "add" || inv.Diff[0].Path[0] != "spec" || inv.Old != nil {
		t.Errorf("diff = %+v, old = %v", inv.Diff, inv.Old)
	}
}

func TestErrorsAreClassifiedAsKopfDoes(t *testing.T) {
	f := startFake(t)
	reg := NewRegistry()
	add := func(id string, err error) {
		reg.OnCreate("examples", id, func(_ context.Context, inv *Invocation) (any, error) {
			inv.Patch().Label("discarded", "yes")
			return nil, err
		})
	}
	add("temporary", fmt.Errorf("wrapped: %w", Temporaryf(7*time.Second, "not yet")))
	add("temporary_default", &TemporaryError{Err: errors.New("later")})
	add("permanent", Permanentf("never"))
	add("unclassified", errors.New("boom"))
	run(t, f, reg)
	c := f.accept(t)
	c.handshake(t)

	c.invoke(t, invocation("t", "temporary"))
	r := c.result(t)
	if r.GetTemporaryError().GetRetryAfter().AsDuration() != 7*time.Second ||
		r.GetTemporaryError().GetDiagnostics()[0].GetSummary() != "wrapped: not yet" || len(r.GetPatches()) != 0 {
		t.Errorf("temporary = %v", r)
	}
	c.invoke(t, invocation("td", "temporary_default"))
	if r := c.result(t); r.GetTemporaryError() == nil || r.GetTemporaryError().GetRetryAfter() != nil {
		t.Errorf("temporary without a delay = %v", r)
	}
	c.invoke(t, invocation("p", "permanent"))
	if r := c.result(t); r.GetPermanentError().GetDiagnostics()[0].GetSummary() != "never" {
		t.Errorf("permanent = %v", r)
	}
	c.invoke(t, invocation("u", "unclassified"))
	r = c.result(t)
	d := r.GetUnclassifiedError().GetDiagnostics()
	if len(d) != 1 || d[0].GetSummary() != "boom" || d[0].GetErrorType() != "*errors.errorString" {
		t.Errorf("unclassified = %v", r)
	}
}

func TestPanicIsReportedAndTheProcessKeepsServing(t *testing.T) {
	f := startFake(t)
	run(t, f, one(func(_ context.Context, inv *Invocation) (any, error) {
		if inv.ID == "i-1" {
			var m map[string]int
			m["boom"]++ // assignment to a nil map
		}
		return "fine", nil
	}))
	c := f.accept(t)
	c.handshake(t)
	c.invoke(t, invocation("i-1", "fn"))
	r := c.result(t)
	d := r.GetUnclassifiedError().GetDiagnostics()
	if len(d) != 1 || d[0].GetErrorType() != "panic" || !strings.Contains(d[0].GetSummary(), "nil map") ||
		!strings.Contains(d[0].GetStackTrace(), "session_test.go") {
		t.Fatalf("panic result = %v", r)
	}
	c.invoke(t, invocation("i-2", "fn"))
	if r := c.result(t); r.GetInvocationId() != "i-2" || r.GetSuccess() == nil {
		t.Errorf("after the panic: %v", r)
	}
}

func TestUnknownHandlerIsAPermanentError(t *testing.T) {
	f := startFake(t)
	run(t, f, one(func(context.Context, *Invocation) (any, error) { return nil, nil }))
	c := f.accept(t)
	c.handshake(t)
	c.invoke(t, invocation("i-1", "nobody"))
	if r := c.result(t); r.GetPermanentError().GetDiagnostics()[0].GetReason() != "UNKNOWN_HANDLER" {
		t.Errorf("result = %v", r)
	}
}

func TestCancelStopsALongInvocation(t *testing.T) {
	f := startFake(t)
	cause := make(chan error, 1)
	run(t, f, one(func(ctx context.Context, _ *Invocation) (any, error) {
		<-ctx.Done()
		cause <- context.Cause(ctx)
		return nil, ctx.Err()
	}))
	c := f.accept(t)
	c.handshake(t)
	c.invoke(t, invocation("i-1", "fn"))
	c.send(t, &pb.ConnectResponse{Message: &pb.ConnectResponse_Cancel{Cancel: &pb.Cancel{
		InvocationId: "i-1", Reason: pb.CancelReason_CANCEL_REASON_RESOURCE_DELETED,
		GracePeriod: durationpb.New(time.Second),
	}}})
	if r := c.result(t); r.GetCancelled() == nil {
		t.Fatalf("result = %v", r)
	}
	var ce *CancelledError
	if err := <-cause; !errors.As(err, &ce) || ce.Reason != "RESOURCE_DELETED" {
		t.Errorf("cause = %v", err)
	}
}

func TestTheDeadlineIsInTheContext(t *testing.T) {
	f := startFake(t)
	run(t, f, one(func(ctx context.Context, _ *Invocation) (any, error) {
		if _, ok := ctx.Deadline(); !ok {
			return nil, errors.New("no deadline")
		}
		<-ctx.Done()
		return nil, ctx.Err()
	}))
	c := f.accept(t)
	c.handshake(t)
	inv := invocation("i-1", "fn")
	inv.Deadline = timestamppb.New(time.Now().Add(100 * time.Millisecond))
	c.invoke(t, inv)
	if r := c.result(t); r.GetCancelled() == nil {
		t.Errorf("result = %v", r)
	}
}

func TestPingIsAnsweredWhileAHandlerRuns(t *testing.T) {
	f := startFake(t)
	release := make(chan struct{})
	run(t, f, one(func(context.Context, *Invocation) (any, error) {
		<-release
		return nil, nil
	}))
	c := f.accept(t)
	c.handshake(t)
	c.invoke(t, invocation("i-1", "fn"))
	c.send(t, &pb.ConnectResponse{Message: &pb.ConnectResponse_Ping{Ping: &pb.Ping{Nonce: 42}}})
	pong := c.next(t).GetPong()
	if pong.GetNonce() != 42 || pong.GetInFlight() != 1 {
		t.Fatalf("pong = %v", pong)
	}
	close(release)
	if r := c.result(t); r.GetSuccess() == nil {
		t.Errorf("result = %v", r)
	}
}

func TestReconnectsAfterTheStreamIsDropped(t *testing.T) {
	f := startFake(t)
	cause := make(chan error, 1)
	run(t, f, one(func(ctx context.Context, inv *Invocation) (any, error) {
		if inv.ID == "old" {
			<-ctx.Done()
			cause <- context.Cause(ctx)
			return nil, ctx.Err()
		}
		return "new", nil
	}))
	first := f.accept(t)
	hello := first.handshake(t)
	first.invoke(t, invocation("old", "fn"))
	first.end <- status.Error(codes.Unavailable, "dropped")

	if err := <-cause; !errors.Is(err, errStreamLost) {
		t.Errorf("the running invocation's cause = %v", err)
	}
	second := f.accept(t)
	again := second.handshake(t)
	if again.GetInstanceId() != hello.GetInstanceId() || len(again.GetHandlers()) != 1 {
		t.Errorf("hello after reconnect = %v, before = %v", again, hello)
	}
	second.invoke(t, invocation("new", "fn"))
	if r := second.result(t); r.GetInvocationId() != "new" {
		t.Errorf("first result on the new stream = %v (the old invocation must not answer)", r)
	}
}

func TestShutdownSaysGoodbyeAndLetsInvocationsFinish(t *testing.T) {
	f := startFake(t)
	release := make(chan struct{})
	r := run(t, f, one(func(context.Context, *Invocation) (any, error) {
		<-release
		return "done", nil
	}))
	c := f.accept(t)
	c.handshake(t)
	c.invoke(t, invocation("i-1", "fn"))
	c.send(t, &pb.ConnectResponse{Message: &pb.ConnectResponse_Ping{Ping: &pb.Ping{Nonce: 1}}})
	c.next(t) // the pong: the invocation is running
	r.cancel()
	if m := c.next(t); m.GetGoodbye() == nil {
		t.Fatalf("got %T, want goodbye", m.GetMessage())
	}
	close(release)
	if res := c.result(t); string(res.GetSuccess().GetResult().GetJson()) != `"done"` {
		t.Errorf("result = %v", res)
	}
	if err := r.stopped(t); err != nil {
		t.Errorf("Run = %v", err)
	}
}

func TestShutdownCancelsInvocationsAfterTheGracePeriod(t *testing.T) {
	f := startFake(t)
	reg := one(func(ctx context.Context, _ *Invocation) (any, error) {
		<-ctx.Done()
		return nil, ctx.Err()
	})
	reg.ShutdownGrace = 100 * time.Millisecond
	r := run(t, f, reg)
	c := f.accept(t)
	c.handshake(t)
	c.invoke(t, invocation("i-1", "fn"))
	c.send(t, &pb.ConnectResponse{Message: &pb.ConnectResponse_Ping{Ping: &pb.Ping{Nonce: 1}}})
	c.next(t)
	r.cancel()
	if m := c.next(t); m.GetGoodbye() == nil {
		t.Fatalf("got %T, want goodbye", m.GetMessage())
	}
	if res := c.result(t); res.GetCancelled() == nil {
		t.Errorf("result = %v", res)
	}
	if err := r.stopped(t); err != nil {
		t.Errorf("Run = %v", err)
	}
}

func TestNoAcceptedHandlerIsFatal(t *testing.T) {
	f := startFake(t)
	r := run(t, f, one(func(context.Context, *Invocation) (any, error) { return nil, nil }))
	c := f.accept(t)
	c.hello(t)
	c.end <- status.Error(codes.FailedPrecondition, "NO_HANDLERS_ACCEPTED: fn: UNKNOWN_RESOURCE")
	err := r.stopped(t)
	if status.Code(err) != codes.FailedPrecondition {
		t.Errorf("Run = %v", err)
	}
	select {
	case <-f.conns:
		t.Error("the handler process reconnected after a rejection")
	case <-time.After(100 * time.Millisecond):
	}
}

func TestMessagesAboveFourMebibytesPass(t *testing.T) {
	f := startFake(t)
	run(t, f, one(func(_ context.Context, inv *Invocation) (any, error) {
		return inv.Spec()["data"], nil // echoed: a large result
	}))
	c := f.accept(t)
	c.handshake(t)
	data := strings.Repeat("x", 6<<20)
	inv := invocation("i-1", "fn")
	inv.Body = &pb.Json{Json: []byte(`{"spec":{"data":"` + data + `"}}`)}
	c.invoke(t, inv)
	if r := c.result(t); len(r.GetSuccess().GetResult().GetJson()) != len(data)+2 {
		t.Errorf("result of %d bytes", len(r.GetSuccess().GetResult().GetJson()))
	}
}
