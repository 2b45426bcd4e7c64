package main

// The script language of the conformance kit: every resource handler runs the actions in the
// spec.script of its body, in order, until one ends it.

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"time"

	"capstan.dev/sdk-go-example/capstan"
)

// scripted is every resource handler: it runs the script of the body it is given.
func scripted(ctx context.Context, inv *capstan.Invocation) (any, error) {
	script, err := scriptOf(inv.Spec()["script"])
	if err != nil {
		return nil, err
	}
	return run(ctx, inv, script)
}

// scriptOf reads a script: a list of actions; absent (or null) is the empty script.
func scriptOf(v any) ([]any, error) {
	switch s := v.(type) {
	case nil:
		return nil, nil
	case []any:
		return s, nil
	}
	return nil, fmt.Errorf("conformance: a script must be a list of actions, not %s", show(v))
}

// run runs a script's actions in order. The first action that ends the handler gives its
// outcome; a script that runs out ends in success with no result.
func run(ctx context.Context, inv *capstan.Invocation, script []any) (any, error) {
	for i, item := range script {
		action, ok := item.(map[string]any)
		if !ok || len(action) != 1 {
			return nil, fmt.Errorf("conformance: action %d is not an object with one key: %s", i, show(item))
		}
		for name, arg := range action {
			value, err, done := do(ctx, inv, name, arg)
			if done {
				return value, err
			}
		}
	}
	return nil, nil
}

// do performs one action; done says whether it ends the handler (with value and err).
func do(ctx context.Context, inv *capstan.Invocation, name string, arg any) (value any, err error, done bool) {
	fields, _ := arg.(map[string]any)
	switch name {
	case "log":
		inv.Log(logLevel(fields["level"]), text(fields["message"]))
		return nil, nil, false
	case "event":
		inv.Event(text(fields["type"]), text(fields["reason"]), text(fields["message"]))
		return nil, nil, false
	case "patch":
		doc, ok := arg.(map[string]any)
		if !ok {
			return nil, fmt.Errorf("conformance: patch needs an object, not %s", show(arg)), true
		}
		inv.Patch().Merge(doc)
		return nil, nil, false
	case "send_patch":
		doc, ok := arg.(map[string]any)
		if !ok {
			return nil, fmt.Errorf("conformance: send_patch needs an object, not %s", show(arg)), true
		}
		var p capstan.Patch
		p.Merge(doc)
		if err := inv.SendPatch(&p); err != nil {
			return nil, err, true
		}
		return nil, nil, false
	case "return":
		return arg, nil, true
	case "echo":
		return echo(inv), nil, true
	case "temporary":
		var delay time.Duration
		if d, ok := fields["delay"]; ok && d != nil {
			if delay, err = seconds(d); err != nil {
				return nil, err, true
			}
		}
		return nil, capstan.Temporaryf(delay, "%s", text(fields["message"])), true
	case "permanent":
		return nil, capstan.Permanentf("%s", text(fields["message"])), true
	case "crash":
		return nil, errors.New(text(fields["message"])), true
	case "sleep":
		d, err := seconds(arg)
		if err != nil {
			return nil, err, true
		}
		select {
		case <-ctx.Done():
			return nil, ctx.Err(), true
		case <-time.After(d):
			return nil, nil, false
		}
	case "hang":
		<-ctx.Done()
		return nil, ctx.Err(), true
	case "hang_ignoring_cancel":
		d, err := seconds(arg)
		if err != nil {
			return nil, err, true
		}
		time.Sleep(d)
		return map[string]any{"ignored_cancel": true}, nil, true
	case "subhandlers":
		subs, ok := arg.([]any)
		if !ok {
			return nil, fmt.Errorf("conformance: subhandlers needs a list, not %s", show(arg)), true
		}
		for i, item := range subs {
			sub, _ := item.(map[string]any)
			id, _ := sub["id"].(string)
			script, err := scriptOf(sub["script"])
			if id == "" || err != nil {
				return nil, fmt.Errorf("conformance: sub-handler %d needs an id and a script: %s", i, show(item)), true
			}
			inv.Subhandler(id, func(ctx context.Context, child *capstan.Invocation) (any, error) {
				return run(ctx, child, script)
			})
		}
		return nil, nil, false
	case "deny":
		code, err := statusCode(fields["code"])
		if err != nil {
			return nil, err, true
		}
		return nil, capstan.Deny(code, "%s", text(fields["message"])), true
	case "warn":
		inv.AddWarning("%s", text(arg))
		return nil, nil, false
	}
	return nil, fmt.Errorf("conformance: unknown action %q", name), true
}

// echo describes what the handler was given (the kit's "The echo"); what it was not given is
// null.
func echo(inv *capstan.Invocation) map[string]any {
	body := inv.Body()
	meta, _ := body["metadata"].(map[string]any)
	labels := any(map[string]any{})
	if l, ok := meta["labels"].(map[string]any); ok {
		labels = l
	}
	out := map[string]any{
		"name":        orNil(inv.Name(), meta["name"]),
		"namespace":   orNil(inv.Namespace(), meta["namespace"]),
		"uid":         orNil(inv.UID(), meta["uid"]),
		"spec":        body["spec"],
		"labels":      labels,
		"retry":       inv.Retry,
		"param":       inv.Param,
		"reason":      nil,
		"old":         nil,
		"new":         nil,
		"diff":        nil,
		"event_type":  nil,
		"operation":   nil,
		"dry_run":     nil,
		"subresource": nil,
	}
	switch inv.Kind {
	case capstan.KindCreate, capstan.KindUpdate, capstan.KindDelete, capstan.KindResume, capstan.KindField:
		if inv.Reason != "" {
			out["reason"] = string(inv.Reason)
		}
		out["old"], out["new"] = inv.Old, inv.New
		diff := make([]any, 0, len(inv.Diff))
		for _, d := range inv.Diff {
			path := make([]any, 0, len(d.Path))
			for _, p := range d.Path {
				path = append(path, p)
			}
			diff = append(diff, []any{string(d.Op), path, d.Old, d.New})
		}
		out["diff"] = diff
	case capstan.KindEvent:
		if inv.EventType != capstan.EventListed {
			out["event_type"] = string(inv.EventType)
		}
	}
	if a := inv.Admission; a != nil {
		out["operation"] = string(a.Operation)
		out["dry_run"] = a.DryRun
		if a.SubResource != "" {
			out["subresource"] = a.SubResource
		}
	}
	out["idempotency_key"], out["traceparent"], out["last_error"] = nil, nil, nil
	if inv.IdempotencyKey != "" {
		out["idempotency_key"] = inv.IdempotencyKey
	}
	if inv.Traceparent != "" {
		out["traceparent"] = inv.Traceparent
	}
	if inv.LastError != nil {
		out["last_error"] = inv.LastError.Summary
	}
	return out
}

// orNil returns the first non-empty string of the invocation's reference and the body's
// metadata, or nil.
func orNil(ref string, meta any) any {
	if ref != "" {
		return ref
	}
	if s, ok := meta.(string); ok && s != "" {
		return s
	}
	return nil
}

// logLevel reads a log level; anything unknown is info.
func logLevel(v any) capstan.LogLevel {
	switch l := capstan.LogLevel(text(v)); l {
	case capstan.LevelDebug, capstan.LevelInfo, capstan.LevelWarning, capstan.LevelError:
		return l
	}
	return capstan.LevelInfo
}

// number reads a JSON number (the SDK decodes them as json.Number).
func number(v any) (float64, bool) {
	switch n := v.(type) {
	case json.Number:
		f, err := n.Float64()
		return f, err == nil
	case float64:
		return n, true
	case int:
		return float64(n), true
	}
	return 0, false
}

// seconds reads a number of seconds as a duration.
func seconds(v any) (time.Duration, error) {
	f, ok := number(v)
	if !ok || f < 0 || math.IsInf(f, 0) || math.IsNaN(f) || f > 365*24*3600 {
		return 0, fmt.Errorf("conformance: %s is not a number of seconds", show(v))
	}
	return time.Duration(f * float64(time.Second)), nil
}

// statusCode reads the HTTP status code of a denial; absent (or null) is kopf's default for
// AdmissionError, 500 (the Go SDK's Deny has no default of its own).
func statusCode(v any) (int32, error) {
	if v == nil {
		return 500, nil
	}
	f, ok := number(v)
	if !ok || f != math.Trunc(f) || f < math.MinInt32 || f > math.MaxInt32 {
		return 0, fmt.Errorf("conformance: %s is not an integer", show(v))
	}
	return int32(f), nil
}

// text reads a string; a non-string value is shown as JSON.
func text(v any) string {
	switch s := v.(type) {
	case string:
		return s
	case nil:
		return ""
	}
	return show(v)
}

// show formats a JSON value for messages.
func show(v any) string {
	b, err := json.Marshal(v)
	if err != nil {
		return fmt.Sprint(v)
	}
	return string(b)
}
