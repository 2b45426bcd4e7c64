package capstan

import (
	"context"
	"fmt"
	"log/slog"
	"time"

	"google.golang.org/protobuf/types/known/durationpb"

	pb "capstan.dev/sdk-go-example/gen/capstan/v1"
)

// HandlerFunc is the signature of every handler.
//
// ctx carries the invocation's deadline, if any, and is cancelled when the controller cancels
// the invocation or the stream is lost; a handler that gives up because of it returns ctx.Err()
// (or an error wrapping it) and is reported as cancelled.
//
// The returned value, unless nil, is encoded as JSON and becomes the handler's result (the
// controller stores it at status.<handler id>). The returned error decides the outcome: see
// [TemporaryError] and [PermanentError]; any other error is unclassified and follows the
// registration's [ErrorsMode].
type HandlerFunc func(ctx context.Context, inv *Invocation) (any, error)

// handler is one registered handler: what is sent in Hello and the function to call.
type handler struct {
	registration *pb.HandlerRegistration
	fn           HandlerFunc
}

// Registry holds the handlers of a handler process and runs them ([Registry.Run]).
//
// Register every handler before calling Run; the registrations are sent once per connection,
// in the order they were added.
type Registry struct {
	// Logger receives the layer's own logs and a copy of every handler log record; nil means
	// slog.Default().
	Logger *slog.Logger
	// ShutdownGrace is how long Run lets running invocations finish after its context is
	// cancelled before it cancels them; 0 means 10 seconds.
	ShutdownGrace time.Duration

	handlers []*handler
	byID     map[string]*handler

	// Reconnect backoff bounds; zero means 250 ms and 30 s. Tests shorten them.
	minBackoff, maxBackoff time.Duration
}

// NewRegistry returns an empty registry.
func NewRegistry() *Registry {
	return &Registry{byID: map[string]*handler{}}
}

// OnCreate registers a handler called once when an object is first seen (kopf on.create).
func (r *Registry) OnCreate(resource, id string, fn HandlerFunc, opts ...Option) {
	r.add(pb.HandlerKind_HANDLER_KIND_CREATE, resource, id, fn, opts)
}

// OnUpdate registers a handler called when an object's essence changes (kopf on.update).
func (r *Registry) OnUpdate(resource, id string, fn HandlerFunc, opts ...Option) {
	r.add(pb.HandlerKind_HANDLER_KIND_UPDATE, resource, id, fn, opts)
}

// OnDelete registers a handler called when an object is marked for deletion (kopf
// on.delete). The controller keeps a finalizer on the object until the handler succeeds.
func (r *Registry) OnDelete(resource, id string, fn HandlerFunc, opts ...Option) {
	r.add(pb.HandlerKind_HANDLER_KIND_DELETE, resource, id, fn, opts)
}

// OnResume registers a handler called for objects that existed before the controller started
// (kopf on.resume).
func (r *Registry) OnResume(resource, id string, fn HandlerFunc, opts ...Option) {
	r.add(pb.HandlerKind_HANDLER_KIND_RESUME, resource, id, fn, opts)
}

// OnField registers a handler called when the value of the dotted field path changes, for
// any cause (kopf on.field). As is conventional, the registered handler id is id + "/" +
// field, e.g. "field_fn/spec.field"; [Invocation.Old] and [Invocation.New] hold the field's
// values.
func (r *Registry) OnField(resource, field, id string, fn HandlerFunc, opts ...Option) {
	opts = append([]Option{Field(field)}, opts...)
	r.add(pb.HandlerKind_HANDLER_KIND_FIELD, resource, id+"/"+field, fn, opts)
}

// OnEvent registers a handler called for every watch event (kopf on.event); it is not
// persisted and, by default, not retried.
func (r *Registry) OnEvent(resource, id string, fn HandlerFunc, opts ...Option) {
	r.add(pb.HandlerKind_HANDLER_KIND_EVENT, resource, id, fn, opts)
}

// Daemon registers a long-running handler per object (kopf daemon). It runs until it returns
// or ctx is cancelled (the object was deleted, the controller stops, ...).
func (r *Registry) Daemon(resource, id string, fn HandlerFunc, opts ...Option) {
	r.add(pb.HandlerKind_HANDLER_KIND_DAEMON, resource, id, fn, opts)
}

// Timer registers a handler called every interval per object (kopf timer).
func (r *Registry) Timer(resource, id string, interval time.Duration, fn HandlerFunc, opts ...Option) {
	opts = append([]Option{func(reg *pb.HandlerRegistration) {
		reg.KindOptions = &pb.HandlerRegistration_Timer{
			Timer: &pb.TimerOptions{Interval: durationpb.New(interval)},
		}
	}}, opts...)
	r.add(pb.HandlerKind_HANDLER_KIND_TIMER, resource, id, fn, opts)
}

// add registers one handler. A duplicate or empty id is a programming error and panics, as a
// duplicate pattern does in net/http.ServeMux.
func (r *Registry) add(kind pb.HandlerKind, resource, id string, fn HandlerFunc, opts []Option) {
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
	reg := &pb.HandlerRegistration{
		HandlerId: id,
		Kind:      kind,
		Resource:  &pb.ResourceSelector{Name: resource},
	}
	for _, opt := range opts {
		opt(reg)
	}
	h := &handler{registration: reg, fn: fn}
	r.handlers = append(r.handlers, h)
	r.byID[id] = h
}

// registrations returns the HandlerRegistrations for Hello, in registration order.
func (r *Registry) registrations() []*pb.HandlerRegistration {
	regs := make([]*pb.HandlerRegistration, len(r.handlers))
	for i, h := range r.handlers {
		regs[i] = h.registration
	}
	return regs
}

// logger returns the configured logger.
func (r *Registry) logger() *slog.Logger {
	if r.Logger != nil {
		return r.Logger
	}
	return slog.Default()
}
