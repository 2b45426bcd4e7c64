package capstan

import (
	"time"

	"google.golang.org/protobuf/types/known/durationpb"

	pb "capstan.dev/sdk-go-example/gen/capstan/v1"
)

// Option changes a handler's registration. The options map one to one onto the fields of
// HandlerRegistration in proto/capstan/v1/registration.proto.
type Option func(*pb.HandlerRegistration)

// ErrorsMode says how unclassified errors of a handler are treated (kopf ErrorsMode).
type ErrorsMode = pb.ErrorsMode

// The errors modes. Without [Errors], the kind's default applies (temporary for change
// handlers, daemons and timers; ignored for event handlers).
const (
	ErrorsTemporary = pb.ErrorsMode_ERRORS_MODE_TEMPORARY
	ErrorsPermanent = pb.ErrorsMode_ERRORS_MODE_PERMANENT
	ErrorsIgnored   = pb.ErrorsMode_ERRORS_MODE_IGNORED
)

// Retries limits the number of attempts in total (0, the default, means unlimited).
func Retries(n uint32) Option {
	return func(r *pb.HandlerRegistration) { r.Retries = n }
}

// Backoff sets the delay before an unclassified error is retried (default 60 s).
func Backoff(d time.Duration) Option {
	return func(r *pb.HandlerRegistration) { r.Backoff = durationpb.New(d) }
}

// Timeout makes the handler give up once d has passed since its first attempt; it also
// bounds each attempt's deadline, which the handler sees in its context.
func Timeout(d time.Duration) Option {
	return func(r *pb.HandlerRegistration) { r.Timeout = durationpb.New(d) }
}

// Errors sets how unclassified errors are treated.
func Errors(mode ErrorsMode) Option {
	return func(r *pb.HandlerRegistration) { r.ErrorsMode = mode }
}

// LabelSelector restricts the handler to objects a Kubernetes label selector selects (e.g.
// "app=db,tier in (a,b)"). When every handler of the resource gives the same selectors, the
// controller's watch filters on the server.
func LabelSelector(selector string) Option {
	return func(r *pb.HandlerRegistration) {
		if r.Resource != nil {
			r.Resource.LabelSelector = selector
		}
	}
}

// FieldSelector restricts the handler to objects a field selector selects, e.g.
// "spec.nodeName=node-1" for a per-node operator; a missing field compares as empty.
func FieldSelector(selector string) Option {
	return func(r *pb.HandlerRegistration) {
		if r.Resource != nil {
			r.Resource.FieldSelector = selector
		}
	}
}

// LabelIs requires the label key to have exactly value.
func LabelIs(key, value string) Option {
	return func(r *pb.HandlerRegistration) {
		filters(r).Labels[key] = &pb.MetaMatch{Condition: &pb.MetaMatch_Equals{Equals: value}}
	}
}

// LabelPresent requires the label key to exist (present) or not to exist (!present).
func LabelPresent(key string, present bool) Option {
	return func(r *pb.HandlerRegistration) { filters(r).Labels[key] = presence(present) }
}

// AnnotationIs requires the annotation key to have exactly value.
func AnnotationIs(key, value string) Option {
	return func(r *pb.HandlerRegistration) {
		filters(r).Annotations[key] = &pb.MetaMatch{Condition: &pb.MetaMatch_Equals{Equals: value}}
	}
}

// AnnotationPresent requires the annotation key to exist (present) or not to exist
// (!present).
func AnnotationPresent(key string, present bool) Option {
	return func(r *pb.HandlerRegistration) { filters(r).Annotations[key] = presence(present) }
}

// Field restricts the handler to changes of the dotted field path (kopf's field=); on
// update handlers, only changes of that field then invoke it.
func Field(path string) Option {
	return func(r *pb.HandlerRegistration) { filters(r).Field = path }
}

// filters returns the registration's filters, creating them on first use.
func filters(r *pb.HandlerRegistration) *pb.Filters {
	if r.Filters == nil {
		r.Filters = &pb.Filters{}
	}
	if r.Filters.Labels == nil {
		r.Filters.Labels = map[string]*pb.MetaMatch{}
	}
	if r.Filters.Annotations == nil {
		r.Filters.Annotations = map[string]*pb.MetaMatch{}
	}
	return r.Filters
}

// presence returns a PRESENT or ABSENT condition.
func presence(present bool) *pb.MetaMatch {
	p := pb.Presence_PRESENCE_ABSENT
	if present {
		p = pb.Presence_PRESENCE_PRESENT
	}
	return &pb.MetaMatch{Condition: &pb.MetaMatch_Presence{Presence: p}}
}
