package capstan_test

import (
	"context"
	"errors"
	"fmt"
	"reflect"
	"strings"
	"testing"
	"time"

	"capstan.dev/sdk-go-example/capstan"
	"capstan.dev/sdk-go-example/capstantest"
)

func labelled(name, app string) map[string]any {
	b := body(name, nil)
	if app != "" {
		b["metadata"].(map[string]any)["labels"] = map[string]any{"app": app}
	}
	return b
}

func TestIndexesFoldResultsAsKopfAndOtherHandlersReadThem(t *testing.T) {
	reg := capstan.NewRegistry()
	reg.Index("configmaps", "by_app", func(_ context.Context, inv *capstan.Invocation) (any, error) {
		labels, _ := inv.Meta()["labels"].(map[string]any)
		switch app, _ := labels["app"].(string); app {
		case "":
			return nil, nil
		case "plain":
			return inv.Name(), nil
		case "broken":
			return nil, capstan.Permanentf("cannot index %s", inv.Name())
		case "flaky":
			return nil, errors.New("unclassified")
		default:
			return map[string]any{app: inv.Name()}, nil
		}
	})
	reg.OnCreate(res, "lookup", func(_ context.Context, inv *capstan.Invocation) (any, error) {
		x, err := inv.Index("by_app")
		if err != nil {
			return nil, err
		}
		return x.Get(capstan.Key("web")), nil
	})
	ctl := capstantest.NewController(t)
	ctl.Serve(t, reg)
	index := func(b map[string]any, deleted bool) {
		t.Helper()
		if r := ctl.Invoke(t, capstantest.Invocation{Handler: "by_app", Body: b, IndexDeleted: deleted}); r.Outcome == "" {
			t.Fatalf("no result: %+v", r)
		}
	}
	lookup := func() any {
		t.Helper()
		return ctl.Invoke(t, capstantest.Invocation{Handler: "lookup"}).Value
	}
	index(labelled("b", "web"), false)
	index(labelled("a", "web"), false)
	index(labelled("p", "plain"), false)
	if got, want := lookup(), []any{"a", "b"}; !reflect.DeepEqual(got, want) {
		t.Errorf("web = %v, want %v", got, want)
	}
	index(labelled("a", ""), false) // nil: a keeps its entry
	index(labelled("b", "db"), false)
	if got, want := lookup(), []any{"a"}; !reflect.DeepEqual(got, want) {
		t.Errorf("web = %v, want %v", got, want)
	}
	index(labelled("a", "flaky"), false) // unclassified under IGNORED: kept
	if got, want := lookup(), []any{"a"}; !reflect.DeepEqual(got, want) {
		t.Errorf("after an ignored error web = %v, want %v", got, want)
	}
	index(labelled("a", "broken"), false) // permanent: dropped
	if got := lookup(); got != nil {
		t.Errorf("after a permanent error web = %v", got)
	}
	index(labelled("b", "web"), false)
	index(labelled("b", "web"), true) // left the index
	if got := lookup(); got != nil {
		t.Errorf("after a deletion web = %v", got)
	}

	// A new stream starts with empty indexes.
	index(labelled("c", "web"), false)
	ctl.Drop(t)
	ctl.WaitConnected(t)
	if got := lookup(); got != nil {
		t.Errorf("after a reconnect web = %v", got)
	}
}

func TestUnknownIndexesAndUnserialisableValuesAreClearErrors(t *testing.T) {
	reg := capstan.NewRegistry()
	reg.Index("configmaps", "by_app", func(context.Context, *capstan.Invocation) (any, error) {
		return map[string]any{"c": make(chan int)}, nil
	})
	reg.OnCreate(res, "typo", func(_ context.Context, inv *capstan.Invocation) (any, error) {
		_, err := inv.Index("by_ap")
		return nil, err
	})
	ctl := capstantest.NewController(t)
	ctl.Serve(t, reg)
	r := ctl.Invoke(t, capstantest.Invocation{Handler: "by_app"})
	if r.Outcome != capstantest.Permanent || !strings.Contains(r.Message, `"by_app"`) ||
		!strings.Contains(r.Message, "not JSON-serialisable") {
		t.Errorf("unserialisable = %+v", r)
	}
	r = ctl.Invoke(t, capstantest.Invocation{Handler: "typo"})
	if r.Outcome != capstantest.Permanent || !strings.Contains(r.Message, "the indexes are by_app") {
		t.Errorf("unknown index = %+v", r)
	}
}

func TestMemosStartFromTheOperatorMemoAndGoWithTheObject(t *testing.T) {
	reg := capstan.NewRegistry()
	reg.OperatorMemo().Store("greeting", "hello")
	reg.OnCreate(res, "count", func(_ context.Context, inv *capstan.Invocation) (any, error) {
		n, _ := inv.Memo().LoadOrStore("calls", new(int))
		*n.(*int)++
		g, _ := inv.Memo().Load("greeting")
		return map[string]any{"calls": *n.(*int), "greeting": g}, nil
	})
	ctl := capstantest.NewController(t)
	ctl.Serve(t, reg)
	call := func() map[string]any {
		t.Helper()
		v, _ := ctl.Invoke(t, capstantest.Invocation{Handler: "count", Body: body("one", nil)}).Value.(map[string]any)
		return v
	}
	if v := call(); v["greeting"] != "hello" || fmt.Sprint(v["calls"]) != "1" {
		t.Errorf("first call = %v", v)
	}
	if v := call(); fmt.Sprint(v["calls"]) != "2" {
		t.Errorf("second call = %v", v)
	}
	if !strings.Contains(strings.Join(ctl.Hello(t).Capabilities, " "), "CAPABILITY_OBJECT_GONE") {
		t.Errorf("CAPABILITY_OBJECT_GONE not announced")
	}
	ctl.ObjectGone(t, "uid-one")
	// The stream keeps order: the next invocation is read after the notice.
	if v := call(); fmt.Sprint(v["calls"]) != "1" {
		t.Errorf("after the object was gone = %v", v)
	}
}

func TestKindsTheControllerDoesNotRunStopRun(t *testing.T) {
	ctl := capstantest.NewController(t)
	ctl.Reject("by_app", "UNSUPPORTED_HANDLER_KIND")
	reg := capstan.NewRegistry()
	reg.OnCreate(res, "fn", noop)
	reg.Index("configmaps", "by_app", noop)
	done := make(chan error, 1)
	go func() { done <- reg.Run(context.Background(), ctl.Endpoint) }()
	select {
	case err := <-done:
		var unsupported *capstan.UnsupportedError
		if !errors.As(err, &unsupported) || !strings.Contains(err.Error(), `"by_app"`) {
			t.Errorf("Run = %v", err)
		}
	case <-time.After(capstantest.Wait):
		t.Fatal("Run went on without a handler the controller does not run")
	}
}

func TestAnIndexHandlerWhoseWhenRejectsTheObjectDropsItsEntries(t *testing.T) {
	reg := capstan.NewRegistry()
	reg.Index("configmaps", "by_app", func(_ context.Context, inv *capstan.Invocation) (any, error) {
		labels, _ := inv.Meta()["labels"].(map[string]any)
		return map[string]any{"app": labels["app"]}, nil
	}, capstan.When(func(inv *capstan.Invocation) bool {
		labels, _ := inv.Meta()["labels"].(map[string]any)
		_, ok := labels["app"]
		return ok
	}))
	reg.OnCreate(res, "lookup", func(_ context.Context, inv *capstan.Invocation) (any, error) {
		x, err := inv.Index("by_app")
		if err != nil {
			return nil, err
		}
		return x.Get(capstan.Key("app")), nil
	})
	ctl := capstantest.NewController(t)
	ctl.Serve(t, reg)
	ctl.Invoke(t, capstantest.Invocation{Handler: "by_app", Body: labelled("a", "web")})
	if got, want := ctl.Invoke(t, capstantest.Invocation{Handler: "lookup"}).Value, []any{"web"}; !reflect.DeepEqual(got, want) {
		t.Fatalf("app = %v, want %v", got, want)
	}
	// kopf: an object the handler's when filter rejects is not in that index.
	if r := ctl.Invoke(t, capstantest.Invocation{Handler: "by_app", Body: labelled("a", "")}); r.Outcome != capstantest.Skipped {
		t.Errorf("rejected = %+v", r)
	}
	if got := ctl.Invoke(t, capstantest.Invocation{Handler: "lookup"}).Value; got != nil {
		t.Errorf("the rejected object kept its entries: app = %v", got)
	}
}

func TestAnIndexHandlerOfALostStreamLeavesTheNextStreamsIndexAlone(t *testing.T) {
	release := make(chan struct{})
	returned := make(chan string, 2)
	reg := capstan.NewRegistry()
	reg.Index("configmaps", "by_app", func(_ context.Context, inv *capstan.Invocation) (any, error) {
		labels, _ := inv.Meta()["labels"].(map[string]any)
		app, _ := labels["app"].(string)
		switch app {
		case "slow":
			// A handler that ignores its cancellation and answers after its stream was lost.
			<-release
			returned <- inv.Name()
			return map[string]any{"web": "stale " + inv.Name()}, nil
		case "slow-broken":
			<-release
			returned <- inv.Name()
			return nil, capstan.Permanentf("cannot index %s", inv.Name())
		}
		return map[string]any{app: inv.Name()}, nil
	})
	reg.OnCreate(res, "lookup", func(_ context.Context, inv *capstan.Invocation) (any, error) {
		x, err := inv.Index("by_app")
		if err != nil {
			return nil, err
		}
		return x.Get(capstan.Key("web")), nil
	})
	ctl := capstantest.NewController(t)
	ctl.Serve(t, reg)
	ctl.Start(t, capstantest.Invocation{Handler: "by_app", Body: labelled("old", "slow")})
	ctl.Start(t, capstantest.Invocation{Handler: "by_app", Body: labelled("kept", "slow-broken")})
	ctl.Drop(t)
	ctl.WaitConnected(t)

	// The next stream builds its index afresh; then the lost stream's handlers answer.
	ctl.Invoke(t, capstantest.Invocation{Handler: "by_app", Body: labelled("kept", "web")})
	close(release)
	for range 2 {
		select {
		case <-returned:
		case <-time.After(capstantest.Wait):
			t.Fatal("the lost stream's index handlers did not return")
		}
	}
	// What they return is folded (if at all) right after they return: look a few times.
	deadline := time.Now().Add(300 * time.Millisecond)
	for time.Now().Before(deadline) {
		if got, want := ctl.Invoke(t, capstantest.Invocation{Handler: "lookup"}).Value, []any{"kept"}; !reflect.DeepEqual(got, want) {
			t.Fatalf("web = %v, want %v: a lost stream's handler changed the next stream's index", got, want)
		}
		time.Sleep(20 * time.Millisecond)
	}
}
