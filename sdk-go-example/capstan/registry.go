package capstan

import (
	"context"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"time"
)

// HandlerFunc is the signature of every handler.
//
// ctx carries the invocation's deadline, if any, and is cancelled when the controller cancels
// the invocation (its cause is a [*CancelledError]) or the stream is lost; a handler that gives
// up because of it returns ctx.Err() (or any error) and is reported as cancelled.
//
// The returned value, unless nil, is encoded as JSON: change, event, daemon and timer handlers
// have it stored at status.<handler id>, probe handlers have it shown by the liveness endpoint,
// and login handlers return a [*Credentials]. The returned error decides the outcome: see
// [TemporaryError] and [PermanentError]; any other error is unclassified and follows the
// registration's [ErrorsMode].
type HandlerFunc func(ctx context.Context, inv *Invocation) (any, error)

// handler is one registered handler: its registration and the function to call.
type handler struct {
	spec spec
	fn   HandlerFunc
}

// Registry holds the handlers of a handler process and runs them ([Registry.Run]).
//
// Register every handler before calling Run; the registrations are sent once per connection,
// in the order they were added. Registering is not safe for concurrent use.
type Registry struct {
	// Logger receives the package's own logs and a copy of every handler log record; nil means
	// slog.Default().
	Logger *slog.Logger
	// ShutdownGrace is how long Run lets running invocations finish after its context is
	// cancelled before it cancels them; 0 means 10 seconds.
	ShutdownGrace time.Duration
	// MaxInFlight caps the invocations in flight to this process; 0 means the controller's
	// default.
	MaxInFlight uint32
	// ReconnectDelay is the first delay before dialling again after the stream was lost; it
	// doubles, with jitter, up to MaxReconnectDelay. Zero means 250 ms and 30 s.
	ReconnectDelay, MaxReconnectDelay time.Duration

	handlers []*handler
	byID     map[string]*handler
	memos    memos
	// indexNames are the ids of the index handlers: each session starts empty indexes of them.
	indexNames []string
}

// NewRegistry returns an empty registry.
func NewRegistry() *Registry {
	return &Registry{byID: map[string]*handler{}}
}

// Index registers an index handler (kopf index): it is called for every object of the
// resource, and its results form the index that every handler of the process reads with
// [Invocation.Index]. A map result gives keys and values, any other non-nil result goes under
// [NoneKey], nil changes nothing; a failure drops the object's entries, except an unclassified
// error under the default [ErrorsIgnored], which keeps them (kopf).
func (r *Registry) Index(resource, id string, fn HandlerFunc, opts ...Option) {
	r.indexNames = append(r.indexNames, id)
	r.add(KindIndex, resource, id, fn, opts)
}

// OperatorMemo returns the operator-wide memo (kopf's kopf.run(memo=…)): fill it before Run.
// Activities get it as their memo, and every object's memo starts as a shallow copy of it.
func (r *Registry) OperatorMemo() *Memo {
	return r.memos.operatorMemo()
}

// OnCreate registers a handler called once when an object is first seen (kopf on.create).
func (r *Registry) OnCreate(resource, id string, fn HandlerFunc, opts ...Option) {
	r.add(KindCreate, resource, id, fn, opts)
}

// OnUpdate registers a handler called when an object's essence changes (kopf on.update).
func (r *Registry) OnUpdate(resource, id string, fn HandlerFunc, opts ...Option) {
	r.add(KindUpdate, resource, id, fn, opts)
}

// OnDelete registers a handler called when an object is marked for deletion (kopf on.delete).
// The object keeps a finalizer until the handler succeeds, unless it is [Optional].
func (r *Registry) OnDelete(resource, id string, fn HandlerFunc, opts ...Option) {
	r.add(KindDelete, resource, id, fn, opts)
}

// OnResume registers a handler called for objects that existed before the controller started
// (kopf on.resume); with [Deleted], also for objects already marked for deletion.
func (r *Registry) OnResume(resource, id string, fn HandlerFunc, opts ...Option) {
	r.add(KindResume, resource, id, fn, opts)
}

// OnField registers a handler called when the value of the dotted field path changes, for any
// cause (kopf on.field). As in kopf, the handler id becomes id + "/" + field, e.g.
// "field_fn/spec.field"; [Invocation.Old] and [Invocation.New] hold the field's values.
func (r *Registry) OnField(resource, field, id string, fn HandlerFunc, opts ...Option) {
	opts = append([]Option{Field(field)}, opts...)
	r.add(KindField, resource, id+"/"+field, fn, opts)
}

// OnEvent registers a handler called for every watch event (kopf on.event); it is not
// persisted and, by default, not retried.
func (r *Registry) OnEvent(resource, id string, fn HandlerFunc, opts ...Option) {
	r.add(KindEvent, resource, id, fn, opts)
}

// Daemon registers a long-running handler per object (kopf daemon). It runs until it returns
// or ctx is cancelled (the object was deleted, the controller stops, ...); meanwhile
// [Invocation.Body] follows the object, and [Invocation.SendPatch] writes progress.
func (r *Registry) Daemon(resource, id string, fn HandlerFunc, opts ...Option) {
	r.add(KindDaemon, resource, id, fn, opts)
}

// Timer registers a handler called every interval per object (kopf timer).
func (r *Registry) Timer(resource, id string, interval time.Duration, fn HandlerFunc, opts ...Option) {
	opts = append([]Option{{name: "interval", apply: func(s *spec) error { s.interval = interval; return nil }}}, opts...)
	r.add(KindTimer, resource, id, fn, opts)
}

// OnStartup registers a handler run once before the controller starts watching (kopf
// on.startup); no object is handled until every startup handler has succeeded.
func (r *Registry) OnStartup(id string, fn HandlerFunc, opts ...Option) {
	r.add(KindStartup, "", id, fn, opts)
}

// OnCleanup registers a handler run once when the operator stops (kopf on.cleanup): when the
// controller stops, or when this process stops first (as in the chart's pod, where the handler
// container is stopped before the controller), before Run returns.
func (r *Registry) OnCleanup(id string, fn HandlerFunc, opts ...Option) {
	r.add(KindCleanup, "", id, fn, opts)
}

// hasCleanup says whether a cleanup handler is registered (a stopping process then asks the
// controller to run it before the stream closes).
func (r *Registry) hasCleanup() bool {
	return slices.ContainsFunc(r.handlers, func(h *handler) bool { return h.spec.kind == KindCleanup })
}

// OnLogin registers a handler returning API credentials for the controller (kopf on.login);
// it returns a [*Credentials].
func (r *Registry) OnLogin(id string, fn HandlerFunc, opts ...Option) {
	r.add(KindLogin, "", id, fn, opts)
}

// OnProbe registers a handler whose result the controller's liveness endpoint reports (kopf
// on.probe); an error fails liveness.
func (r *Registry) OnProbe(id string, fn HandlerFunc, opts ...Option) {
	r.add(KindProbe, "", id, fn, opts)
}

// OnValidate registers a validating admission handler (kopf on.validate): return a [Deny]
// error to refuse the request; [Invocation.AddWarning] adds warnings. The controller serves the
// webhook and calls the handler for every matching request.
func (r *Registry) OnValidate(resource, id string, fn HandlerFunc, opts ...Option) {
	r.add(KindValidate, resource, id, fn, opts)
}

// OnMutate registers a mutating admission handler (kopf on.mutate): changes made with
// [Invocation.Patch] are applied to the object before it is stored. Later mutating handlers
// see them.
func (r *Registry) OnMutate(resource, id string, fn HandlerFunc, opts ...Option) {
	r.add(KindMutate, resource, id, fn, opts)
}

// add registers one handler. An empty or duplicate id, a nil function, and an option that does
// not apply to the kind are programming errors and panic, as a duplicate pattern does in
// net/http.ServeMux.
func (r *Registry) add(kind Kind, resource, id string, fn HandlerFunc, opts []Option) {
	if id == "" {
		panic("capstan: empty handler id")
	}
	if fn == nil {
		panic(fmt.Sprintf("capstan: nil handler for %q", id))
	}
	if r.byID == nil {
		r.byID = map[string]*handler{}
	}
	if _, ok := r.byID[id]; ok {
		panic(fmt.Sprintf("capstan: handler id %q registered twice", id))
	}
	h := &handler{spec: spec{kind: kind, id: id}, fn: fn}
	if !kind.IsActivity() {
		h.spec.resource = parseSelector(resource)
	}
	for _, opt := range opts {
		if opt.apply == nil {
			continue
		}
		if err := opt.apply(&h.spec); err != nil {
			panic(fmt.Sprintf("capstan: handler %q: %s %v", id, opt.name, err))
		}
	}
	if err := h.spec.check(); err != nil {
		panic(fmt.Sprintf("capstan: handler %q: %v", id, err))
	}
	r.handlers = append(r.handlers, h)
	r.byID[id] = h
}

// Handlers returns the ids of the registered handlers, in registration order.
func (r *Registry) Handlers() []string {
	ids := make([]string, len(r.handlers))
	for i, h := range r.handlers {
		ids[i] = h.spec.id
	}
	return ids
}

// logger returns the configured logger.
func (r *Registry) logger() *slog.Logger {
	if r.Logger != nil {
		return r.Logger
	}
	return slog.Default()
}

// parseSelector splits "group/version/name", "version/name" (core group, e.g. "v1/pods") and
// "group/name"; anything else is a name the controller resolves as kopf does (plural, kind,
// singular, short name or category, possibly dotted with version and group).
func parseSelector(text string) selector {
	parts := strings.Split(text, "/")
	switch {
	case len(parts) == 3:
		return selector{group: parts[0], version: parts[1], name: parts[2]}
	case len(parts) == 2 && isVersion(parts[0]):
		return selector{version: parts[0], name: parts[1]}
	case len(parts) == 2:
		return selector{group: parts[0], name: parts[1]}
	}
	return selector{name: text}
}

// isVersion reports whether s looks like a Kubernetes API version: v1, v1beta2, v2alpha1.
func isVersion(s string) bool {
	rest, ok := strings.CutPrefix(s, "v")
	if !ok {
		return false
	}
	digits := 0
	for digits < len(rest) && rest[digits] >= '0' && rest[digits] <= '9' {
		digits++
	}
	if digits == 0 {
		return false
	}
	tail := rest[digits:]
	if tail == "" {
		return true
	}
	for _, stage := range []string{"alpha", "beta"} {
		if n, ok := strings.CutPrefix(tail, stage); ok && n != "" && strings.Trim(n, "0123456789") == "" {
			return true
		}
	}
	return false
}
