package capstan

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// Invocation is one call of a handler: kopf's handler arguments.
//
// JSON values (the body, Old, New, Diff values, Param) are decoded with encoding/json into
// map[string]any, []any, string, bool, nil and [json.Number] (numbers keep their exact text, so
// 64-bit integers survive). Treat them as read-only.
type Invocation struct {
	// ID is the invocation id (unique per attempt); compare it, never parse it.
	ID string
	// HandlerID is the id of the handler being called ("parent/child" for sub-handlers).
	HandlerID string
	// Kind is the handler's kind.
	Kind Kind
	// Attempt is the 1-based attempt number.
	Attempt int
	// Retry is kopf's retry: the number of attempts before this one.
	Retry int
	// IdempotencyKey is stable across all attempts of the same work; use it to make side
	// effects safe to repeat.
	IdempotencyKey string
	// Started is when the first attempt of this work started.
	Started time.Time
	// Resource identifies the object; zero for activities.
	Resource ResourceRef
	// Reason is the cause of a change or field handler; empty for other kinds.
	Reason Reason
	// Old and New are the old and new essence (for field handlers: the field's old and new
	// value); nil when absent.
	Old, New any
	// Diff lists the differences between Old and New.
	Diff []DiffItem
	// Field is the dotted path of a field handler's field.
	Field string
	// EventType is the watch event type of an event handler.
	EventType EventType
	// Activity is the activity of a startup, cleanup or login handler.
	Activity Activity
	// Restarts counts the earlier starts of a daemon for this object.
	Restarts int
	// Scheduled is when a timer's tick was scheduled.
	Scheduled time.Time
	// IndexDeleted is set for an index invocation whose object leaves the index; the handler
	// is not called for it (its entries are dropped).
	IndexDeleted bool
	// Param is the registration's [Param], echoed; nil when unset.
	Param any
	// LastError is the previous attempt's failure, if any.
	LastError *Diagnostic
	// Traceparent is the W3C trace context of this invocation: the controller traces every
	// processing cycle of an object and each invocation is a span of it. Pass it on (HTTP
	// headers, messages) to continue the trace; empty when the controller sent none.
	Traceparent string
	// Admission is the request of a validate or mutate handler; nil for other kinds.
	Admission *AdmissionRequest

	body    atomic.Pointer[map[string]any]
	patch   Patch
	logger  *slog.Logger
	send    func(message)
	memos   *memos
	memo    *Memo
	indexes *indexes

	mu           sync.Mutex
	cancelReason CancelReason
	warnings     []string
	subhandlers  []subhandler
	canDeclare   bool
}

// message is what an invocation sends on the stream besides its result: a log record or an
// interim patch.
type message struct {
	log   *logRecord
	patch *Patch
	id    string
}

// logRecord is one log record of an invocation.
type logRecord struct {
	level   LogLevel
	message string
	time    time.Time
	// event: posted as a Kubernetes Event about the object, with this reason and type.
	event     bool
	reason    string
	eventType string
}

// AddWarning adds a warning returned to the client of an admission request (kopf's
// `warnings`).
func (inv *Invocation) AddWarning(format string, args ...any) {
	inv.mu.Lock()
	defer inv.mu.Unlock()
	inv.warnings = append(inv.warnings, fmt.Sprintf(format, args...))
}

func (inv *Invocation) takeWarnings() []string {
	inv.mu.Lock()
	defer inv.mu.Unlock()
	w := inv.warnings
	inv.warnings = nil
	return w
}

// Body returns the object's latest body (nil for activities): the body the invocation carried,
// or for a running daemon the newest one the controller has sent since (kopf's live body).
func (inv *Invocation) Body() map[string]any {
	if b := inv.body.Load(); b != nil {
		return *b
	}
	return nil
}

// setBody replaces the body with a newer one.
func (inv *Invocation) setBody(body map[string]any) { inv.body.Store(&body) }

// Spec returns the latest body's "spec" as a map (empty when absent).
func (inv *Invocation) Spec() map[string]any { return section(inv.Body(), "spec") }

// Meta returns the latest body's "metadata" as a map (empty when absent).
func (inv *Invocation) Meta() map[string]any { return section(inv.Body(), "metadata") }

// Status returns the latest body's "status" as a map (empty when absent).
func (inv *Invocation) Status() map[string]any { return section(inv.Body(), "status") }

// Labels returns the latest body's labels (empty when none).
func (inv *Invocation) Labels() map[string]any { return section(inv.Meta(), "labels") }

// Annotations returns the latest body's annotations (empty when none).
func (inv *Invocation) Annotations() map[string]any { return section(inv.Meta(), "annotations") }

// Name returns the object's name (empty for activities).
func (inv *Invocation) Name() string { return inv.Resource.Name }

// Namespace returns the object's namespace (empty for cluster-scoped objects and activities).
func (inv *Invocation) Namespace() string { return inv.Resource.Namespace }

// UID returns the object's uid (empty for activities).
func (inv *Invocation) UID() string { return inv.Resource.UID }

// Runtime returns how long ago the first attempt started (kopf's runtime).
func (inv *Invocation) Runtime() time.Duration { return time.Since(inv.Started) }

// DecodeBody decodes the object's latest body into v, e.g. a struct with JSON tags.
func (inv *Invocation) DecodeBody(v any) error {
	raw, err := json.Marshal(inv.Body())
	if err != nil {
		return err
	}
	return json.Unmarshal(raw, v)
}

// Patch returns the invocation's patch; it is sent with the result if the handler succeeds,
// and discarded otherwise.
func (inv *Invocation) Patch() *Patch { return &inv.patch }

// SendPatch sends p to the controller now, while the handler keeps running, and the controller
// applies it at once (a daemon's progress). It does not touch [Invocation.Patch].
func (inv *Invocation) SendPatch(p *Patch) error {
	if inv.send == nil {
		return errors.New("capstan: the invocation is not connected to a controller")
	}
	if p.Empty() {
		return nil
	}
	inv.send(message{id: inv.ID, patch: p.clone()})
	return nil
}

// Memo returns the object's memo: values kept in this process across the invocations of all
// handlers for the same object (kopf's memo), e.g. a client or a cache a daemon shares with the
// change handlers. It starts as a shallow copy of [Registry.OperatorMemo]. It is dropped when
// the object goes away: when the controller says so (ObjectGone), after a DELETED event, a
// daemon or timer cancelled because the object was deleted, or a minute after a delete handler
// succeeded. It is not persisted: a restarted process starts with empty memos. Activities get
// the operator-wide memo.
func (inv *Invocation) Memo() *Memo {
	inv.mu.Lock()
	defer inv.mu.Unlock()
	if inv.memo == nil {
		if inv.memos == nil {
			inv.memos = &memos{}
		}
		inv.memo = inv.memos.get(inv.UID())
	}
	return inv.memo
}

// Index returns the index built by the index handler name of this process (kopf's index
// kwarg). Other handlers run only once every index has been built from its initial listing.
// An unknown name is a [PermanentError] naming the indexes there are.
func (inv *Invocation) Index(name string) (*Index, error) {
	if inv.indexes != nil {
		if x := inv.indexes.get(name); x != nil {
			return x, nil
		}
		if names := inv.indexes.names(); len(names) > 0 {
			return nil, Permanentf("there is no index %q; the indexes are %s", name, strings.Join(names, ", "))
		}
	}
	return nil, Permanentf("there is no index %q: this process registers no index handlers", name)
}

// CancelReason returns why the controller cancelled the invocation; empty while it is not
// cancelled.
func (inv *Invocation) CancelReason() CancelReason {
	inv.mu.Lock()
	defer inv.mu.Unlock()
	return inv.cancelReason
}

func (inv *Invocation) cancelled(reason CancelReason) {
	inv.mu.Lock()
	defer inv.mu.Unlock()
	if inv.cancelReason == "" {
		inv.cancelReason = reason
	}
}

// Subhandler declares a sub-handler (kopf's register/@subhandler). After this handler returns
// successfully, each declared sub-handler that has not finished in an earlier attempt runs in
// declaration order, and the controller records its outcome under "<handler id>/<id>". As in
// kopf, the parent is invoked again until all its sub-handlers have finished and must declare
// the same sub-handlers every time.
//
// Only change and field handlers and their sub-handlers may declare sub-handlers; sub-handlers
// nest. The options [Retries], [Backoff], [Timeout], [Errors] and [When] apply to the
// sub-handler itself; others are ignored with a warning.
func (inv *Invocation) Subhandler(id string, fn HandlerFunc, opts ...Option) {
	if !inv.canDeclare || id == "" || fn == nil {
		inv.Warnf("sub-handler %q cannot be declared here; ignored", id)
		return
	}
	s := spec{kind: inv.Kind, id: id}
	for _, opt := range opts {
		switch opt.name {
		case "Retries", "Backoff", "Timeout", "Errors", "When":
			if err := opt.apply(&s); err != nil {
				inv.Warnf("sub-handler %q: %s: %v; ignored", id, opt.name, err)
			}
		default:
			inv.Warnf("sub-handler %q: %s does not apply to sub-handlers; ignored", id, opt.name)
		}
	}
	inv.mu.Lock()
	defer inv.mu.Unlock()
	for _, sub := range inv.subhandlers {
		if sub.spec.id == id {
			return
		}
	}
	inv.subhandlers = append(inv.subhandlers, subhandler{spec: s, fn: fn})
}

func (inv *Invocation) takeSubhandlers() []subhandler {
	inv.mu.Lock()
	defer inv.mu.Unlock()
	subs := inv.subhandlers
	inv.subhandlers = nil
	inv.canDeclare = false
	return subs
}

// Logf logs at info level: the record is sent to the controller, which may post it as a
// Kubernetes Event on the object, and written to the local log.
func (inv *Invocation) Logf(format string, args ...any) {
	inv.Log(LevelInfo, fmt.Sprintf(format, args...))
}

// Warnf logs at warning level, like [Invocation.Logf].
func (inv *Invocation) Warnf(format string, args ...any) {
	inv.Log(LevelWarning, fmt.Sprintf(format, args...))
}

// Debugf logs at debug level, like [Invocation.Logf].
func (inv *Invocation) Debugf(format string, args ...any) {
	inv.Log(LevelDebug, fmt.Sprintf(format, args...))
}

// Log logs msg at level, like [Invocation.Logf].
func (inv *Invocation) Log(level LogLevel, msg string) {
	if inv.logger != nil {
		local := slog.LevelInfo
		switch level {
		case LevelDebug:
			local = slog.LevelDebug
		case LevelWarning:
			local = slog.LevelWarn
		case LevelError:
			local = slog.LevelError
		}
		inv.logger.Log(context.Background(), local, msg, "handler", inv.HandlerID,
			"object", inv.Namespace()+"/"+inv.Name(), "invocation", inv.ID, "trace_id", inv.TraceID())
	}
	if inv.send != nil {
		inv.send(message{id: inv.ID, log: &logRecord{level: level, message: msg, time: time.Now()}})
	}
}

// Event posts a Kubernetes Event about the invocation's object (kopf's `kopf.event`): of type
// eventType ("Normal", "Warning", or any name of 1 to 64 letters and digits), with reason and
// message. It is written to the local log too, at info level for Normal and warning otherwise.
func (inv *Invocation) Event(eventType, reason, msg string) {
	level := LevelWarning
	if eventType == "Normal" {
		level = LevelInfo
	}
	if inv.logger != nil {
		local := slog.LevelWarn
		if level == LevelInfo {
			local = slog.LevelInfo
		}
		inv.logger.Log(context.Background(), local, msg, "handler", inv.HandlerID, "object",
			inv.Namespace()+"/"+inv.Name(), "event", eventType, "reason", reason, "invocation", inv.ID)
	}
	if inv.send != nil {
		inv.send(message{id: inv.ID, log: &logRecord{level: level, message: msg, time: time.Now(),
			event: true, reason: reason, eventType: eventType}})
	}
}

// TraceID returns the trace id of [Invocation.Traceparent] (32 hex digits, as the controller
// logs it), or "" when there is no well-formed traceparent.
func (inv *Invocation) TraceID() string {
	parts := strings.Split(inv.Traceparent, "-")
	if len(parts) != 4 || len(parts[1]) != 32 {
		return ""
	}
	for _, c := range parts[1] {
		if !strings.ContainsRune("0123456789abcdef", c) {
			return ""
		}
	}
	return parts[1]
}

// section returns m[key] as a map, or an empty map.
func section(m map[string]any, key string) map[string]any {
	if v, ok := m[key].(map[string]any); ok {
		return v
	}
	return map[string]any{}
}
