package capstan

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"strings"
	"time"

	"google.golang.org/protobuf/types/known/timestamppb"

	pb "capstan.dev/sdk-go-example/gen/capstan/v1"
)

// Invocation is one call of a handler: kopf's handler arguments, decoded from the protocol's
// Invocation message.
//
// JSON values (Body, Old, New, Diff values, Param) are decoded with encoding/json into
// map[string]any, []any, string, bool, nil and [json.Number] (numbers keep their exact text,
// so 64-bit integers survive).
type Invocation struct {
	// ID is the invocation id (unique per attempt); compare it, never parse it.
	ID string
	// HandlerID is the id of the handler being called.
	HandlerID string
	// Attempt is the 1-based attempt number.
	Attempt int
	// Retry is kopf's retry: Attempt - 1.
	Retry int
	// IdempotencyKey is stable across all attempts of the same work; use it to make side
	// effects safe to repeat.
	IdempotencyKey string
	// Started is when the first attempt of this work started.
	Started time.Time
	// Body is the object as the controller saw it, with the patches of the handlers that ran
	// before in the same processing cycle; nil for activities.
	Body map[string]any
	// Reason is the cause of a change or field handler: "create", "update", "delete" or
	// "resume"; empty for other kinds.
	Reason string
	// Old and New are the old and new essence (for field handlers: the field's old and new
	// value); nil when absent.
	Old, New any
	// Diff lists the differences between Old and New.
	Diff []DiffItem
	// Field is the dotted path of a field handler's field.
	Field string
	// EventType is the watch event type of an event handler: "ADDED", "MODIFIED", "DELETED",
	// or empty for an object of the initial listing.
	EventType string
	// Param is the registration's param, echoed; nil when unset.
	Param any
	// LastError is the previous attempt's failure, if any.
	LastError *pb.Diagnostic
	// Raw is the message as received, for anything this type does not mirror.
	Raw *pb.Invocation

	patch  Patch
	logger *slog.Logger
	send   func(*pb.ConnectRequest)
}

// DiffItem is one difference between two essences, as kopf's (op, path, old, new).
type DiffItem struct {
	// Op is "add", "change" or "remove".
	Op string
	// Path is the field path, one element per nesting level.
	Path []string
	// Old is the old value (nil for "add"); New the new value (nil for "remove").
	Old, New any
}

// Spec returns Body["spec"] as a map (empty when absent).
func (inv *Invocation) Spec() map[string]any { return section(inv.Body, "spec") }

// Meta returns Body["metadata"] as a map (empty when absent).
func (inv *Invocation) Meta() map[string]any { return section(inv.Body, "metadata") }

// Status returns Body["status"] as a map (empty when absent).
func (inv *Invocation) Status() map[string]any { return section(inv.Body, "status") }

// Name returns the object's name.
func (inv *Invocation) Name() string { return inv.Raw.GetResource().GetName() }

// Namespace returns the object's namespace (empty for cluster-scoped objects).
func (inv *Invocation) Namespace() string { return inv.Raw.GetResource().GetNamespace() }

// UID returns the object's uid.
func (inv *Invocation) UID() string { return inv.Raw.GetResource().GetUid() }

// DecodeBody decodes the object's body into v, e.g. a struct with JSON tags.
func (inv *Invocation) DecodeBody(v any) error {
	return json.Unmarshal(inv.Raw.GetBody().GetJson(), v)
}

// Patch returns the invocation's merge patch; it is sent with the result if the handler
// succeeds, and discarded otherwise.
func (inv *Invocation) Patch() *Patch { return &inv.patch }

// Logf logs an info message: it is sent to the controller as a log record of this invocation
// (which may post it as a Kubernetes Event) and written to the local log.
func (inv *Invocation) Logf(format string, args ...any) {
	inv.log(pb.LogLevel_LOG_LEVEL_INFO, slog.LevelInfo, fmt.Sprintf(format, args...))
}

// Warnf logs a warning, like [Invocation.Logf].
func (inv *Invocation) Warnf(format string, args ...any) {
	inv.log(pb.LogLevel_LOG_LEVEL_WARNING, slog.LevelWarn, fmt.Sprintf(format, args...))
}

// log sends a log record and writes it locally.
func (inv *Invocation) log(level pb.LogLevel, local slog.Level, msg string) {
	if inv.logger != nil {
		inv.logger.Log(context.Background(), local, msg, "handler", inv.HandlerID, "object", inv.Namespace()+"/"+inv.Name(),
			"invocation", inv.ID)
	}
	if inv.send != nil {
		inv.send(&pb.ConnectRequest{Message: &pb.ConnectRequest_Log{Log: &pb.LogRecord{
			InvocationId: inv.ID,
			Level:        level,
			Message:      msg,
			Time:         timestamppb.Now(),
		}}})
	}
}

// newInvocation decodes an Invocation message. A value that is not valid JSON is an error.
func newInvocation(m *pb.Invocation) (*Invocation, error) {
	inv := &Invocation{
		ID:             m.GetInvocationId(),
		HandlerID:      m.GetHandlerId(),
		Attempt:        int(m.GetAttempt()),
		Retry:          max(int(m.GetAttempt())-1, 0),
		IdempotencyKey: m.GetIdempotencyKey(),
		LastError:      m.GetLastError(),
		Raw:            m,
	}
	if m.GetStartedTime() != nil {
		inv.Started = m.GetStartedTime().AsTime()
	}
	var err error
	var body any
	if body, err = decode(m.GetBody()); err != nil {
		return nil, fmt.Errorf("body: %w", err)
	}
	inv.Body, _ = body.(map[string]any)
	if inv.Param, err = decode(m.GetParam()); err != nil {
		return nil, fmt.Errorf("param: %w", err)
	}
	if change := m.GetChange(); change != nil {
		inv.Reason = lowerSuffix(change.GetReason().String(), "CHANGE_REASON_")
		inv.Field = change.GetField()
		if inv.Old, err = decode(change.GetOld()); err != nil {
			return nil, fmt.Errorf("change.old: %w", err)
		}
		if inv.New, err = decode(change.GetNew()); err != nil {
			return nil, fmt.Errorf("change.new: %w", err)
		}
		for i, d := range change.GetDiff() {
			item := DiffItem{Op: lowerSuffix(d.GetOperation().String(), "DIFF_OPERATION_"), Path: d.GetPath()}
			if item.Old, err = decode(d.GetOld()); err != nil {
				return nil, fmt.Errorf("change.diff[%d].old: %w", i, err)
			}
			if item.New, err = decode(d.GetNew()); err != nil {
				return nil, fmt.Errorf("change.diff[%d].new: %w", i, err)
			}
			inv.Diff = append(inv.Diff, item)
		}
	}
	if event := m.GetEvent(); event != nil && event.GetType() != pb.EventType_EVENT_TYPE_UNSPECIFIED {
		inv.EventType = event.GetType().String()[len("EVENT_TYPE_"):]
	}
	return inv, nil
}

// decode parses a Json message; an unset one is nil.
func decode(j *pb.Json) (any, error) {
	if j == nil {
		return nil, nil
	}
	dec := json.NewDecoder(bytes.NewReader(j.GetJson()))
	dec.UseNumber()
	var v any
	if err := dec.Decode(&v); err != nil {
		return nil, err
	}
	return v, nil
}

// lowerSuffix turns "CHANGE_REASON_CREATE" into "create"; unspecified values become "".
func lowerSuffix(name, prefix string) string {
	s := name[min(len(prefix), len(name)):]
	if s == "UNSPECIFIED" {
		return ""
	}
	return strings.ToLower(s)
}

// section returns m[key] as a map, or an empty map.
func section(m map[string]any, key string) map[string]any {
	if v, ok := m[key].(map[string]any); ok {
		return v
	}
	return map[string]any{}
}
