package capstan

import (
	"fmt"
	"time"
)

// Option refines a handler's registration: kopf's decorator keyword arguments. Options that do
// not apply to the handler's kind make the registration panic, as kopf raises at decoration
// time.
type Option struct {
	name  string
	apply func(*spec) error
}

// Match is a condition on a label, annotation or field value: [Equals], [Present] or [Absent].
type Match struct {
	equals   any
	presence presence
}

type presence int

const (
	noPresence presence = iota
	present
	absent
)

// Equals matches a label or annotation with exactly this string value, or a field with this
// JSON value (compared after JSON encoding).
func Equals(value any) Match { return Match{equals: value} }

// Present and Absent match a label, annotation or field that exists (with any value) or does
// not exist (kopf.PRESENT and kopf.ABSENT).
var (
	Present = Match{presence: present}
	Absent  = Match{presence: absent}
)

// spec is one handler's registration as the options build it.
type spec struct {
	kind        Kind
	id          string
	resource    selector
	also        []selector
	labels      map[string]Match
	annotations map[string]Match
	field       string
	value       *Match
	old, new    *Match
	when        func(*Invocation) bool
	errors      ErrorsMode
	retries     uint32
	backoff     time.Duration
	timeout     time.Duration
	maxInFlight uint32
	param       any
	hasParam    bool

	optional, deleted bool

	initialDelay          time.Duration
	cancellationBackoff   time.Duration
	cancellationTimeout   time.Duration
	restartBackoff        time.Duration
	noRestartAfterSuccess bool

	interval time.Duration
	idle     time.Duration
	sharp    bool

	operations     []Operation
	subresource    string
	sideEffects    bool
	ignoreFailures bool
}

// selector is a resource selector: kopf's resource name with an optional group and version.
type selector struct {
	group, version, name         string
	labelSelector, fieldSelector string
}

func option(name string, apply func(*spec) error) Option { return Option{name: name, apply: apply} }

func errNotFor(s *spec) error { return fmt.Errorf("does not apply to %s handlers", s.kind) }

// onResource rejects options for activities, which have no object.
func onResource(apply func(*spec)) func(*spec) error {
	return func(s *spec) error {
		if s.kind.IsActivity() {
			return errNotFor(s)
		}
		apply(s)
		return nil
	}
}

// only rejects options for kinds other than kinds.
func only(apply func(*spec), kinds ...Kind) func(*spec) error {
	return func(s *spec) error {
		for _, k := range kinds {
			if s.kind == k {
				apply(s)
				return nil
			}
		}
		return errNotFor(s)
	}
}

// Errors sets how unclassified errors are treated; default: the kind's (kopf's) default.
func Errors(mode ErrorsMode) Option {
	return option("Errors", func(s *spec) error {
		switch mode {
		case ErrorsTemporary, ErrorsPermanent, ErrorsIgnored:
			s.errors = mode
			return nil
		}
		return fmt.Errorf("unknown errors mode %q", mode)
	})
}

// Retries limits the number of attempts in total; default (0) unlimited.
func Retries(attempts uint32) Option {
	return option("Retries", func(s *spec) error { s.retries = attempts; return nil })
}

// Backoff sets the delay before an unclassified error is retried; default 60 s.
func Backoff(delay time.Duration) Option {
	return option("Backoff", func(s *spec) error { s.backoff = delay; return nil })
}

// Timeout makes the handler give up once this long has passed since its first attempt; it
// also bounds each attempt's deadline, which the handler sees in its context.
func Timeout(timeout time.Duration) Option {
	return option("Timeout", func(s *spec) error { s.timeout = timeout; return nil })
}

// MaxInFlight allows at most this many invocations of the handler at once; 0: the default.
func MaxInFlight(limit uint32) Option {
	return option("MaxInFlight", func(s *spec) error { s.maxInFlight = limit; return nil })
}

// Param is an opaque value, encoded as JSON, echoed in every invocation ([Invocation.Param]);
// one function registered under several ids can tell them apart by it.
func Param(value any) Option {
	return option("Param", func(s *spec) error { s.param, s.hasParam = value, true; return nil })
}

// Label requires the label key to match: Equals("value"), [Present] or [Absent].
func Label(key string, m Match) Option {
	return option("Label", onResource(func(s *spec) {
		if s.labels == nil {
			s.labels = map[string]Match{}
		}
		s.labels[key] = m
	}))
}

// Annotation requires the annotation key to match: Equals("value"), [Present] or [Absent].
func Annotation(key string, m Match) Option {
	return option("Annotation", onResource(func(s *spec) {
		if s.annotations == nil {
			s.annotations = map[string]Match{}
		}
		s.annotations[key] = m
	}))
}

// Field names the dotted field (e.g. "spec.replicas") that [Value], [Old] and [New] test; on
// update handlers only changes of that field then invoke the handler (kopf's field=).
func Field(path string) Option {
	return option("Field", onResource(func(s *spec) { s.field = path }))
}

// Value requires the [Field]'s value to match (in the old or new state for change handlers,
// in the current body for others).
func Value(m Match) Option {
	return option("Value", onResource(func(s *spec) { s.value = &m }))
}

// Old requires the [Field]'s old value to match (update and field handlers).
func Old(m Match) Option {
	return option("Old", only(func(s *spec) { s.old = &m }, KindUpdate, KindField))
}

// New requires the [Field]'s new value to match (update and field handlers).
func New(m Match) Option {
	return option("New", only(func(s *spec) { s.new = &m }, KindUpdate, KindField))
}

// When is a callable filter evaluated in this process before the handler runs (kopf's when=):
// when it returns false the invocation is answered "skipped" and nothing is recorded.
func When(filter func(*Invocation) bool) Option {
	return option("When", onResource(func(s *spec) { s.when = filter }))
}

// LabelSelector restricts the handler to objects a Kubernetes label selector selects (e.g.
// "app=db,tier in (a,b)"). When every handler of the resource gives the same selectors, the
// controller's watch filters on the server.
func LabelSelector(selector string) Option {
	return option("LabelSelector", onResource(func(s *spec) { s.resource.labelSelector = selector }))
}

// FieldSelector restricts the handler to objects a field selector selects, e.g.
// "spec.nodeName=node-1" for a per-node operator; a missing field compares as empty.
func FieldSelector(selector string) Option {
	return option("FieldSelector", onResource(func(s *spec) { s.resource.fieldSelector = selector }))
}

// AlsoFor registers the same handler for another resource too. Where several selectors name
// the same resource, the controller calls the handler once per event of an object.
func AlsoFor(resource string) Option {
	return option("AlsoFor", onResource(func(s *spec) { s.also = append(s.also, parseSelector(resource)) }))
}

// Optional makes a delete handler never block deletion with a finalizer (kopf optional=True).
func Optional() Option {
	return option("Optional", only(func(s *spec) { s.optional = true }, KindDelete))
}

// Deleted makes a resume handler also resume objects already marked for deletion (kopf
// deleted=True).
func Deleted() Option {
	return option("Deleted", only(func(s *spec) { s.deleted = true }, KindResume))
}

// InitialDelay is the delay between the object's appearance and the daemon's start or the
// timer's first tick.
func InitialDelay(delay time.Duration) Option {
	return option("InitialDelay", only(func(s *spec) { s.initialDelay = delay }, KindDaemon, KindTimer))
}

// CancellationBackoff is a daemon's grace between a stop request and its cancellation.
func CancellationBackoff(delay time.Duration) Option {
	return option("CancellationBackoff", only(func(s *spec) { s.cancellationBackoff = delay }, KindDaemon))
}

// CancellationTimeout is how long a cancelled daemon may take to end before the controller
// abandons it; default forever.
func CancellationTimeout(timeout time.Duration) Option {
	return option("CancellationTimeout", only(func(s *spec) { s.cancellationTimeout = timeout }, KindDaemon))
}

// RestartBackoff is how long to wait before restarting a daemon that failed temporarily
// without asking for a delay (default: the handler's backoff). A daemon that returns, or fails
// permanently, is done for its object until the controller restarts (kopf).
func RestartBackoff(delay time.Duration) Option {
	return option("RestartBackoff", only(func(s *spec) { s.restartBackoff = delay }, KindDaemon))
}

// NoRestartAfterSuccess has no effect and is kept for compatibility: a daemon that returns is
// never restarted (kopf's semantics).
//
// Deprecated: daemons that return are never restarted.
func NoRestartAfterSuccess() Option {
	return option("NoRestartAfterSuccess", only(func(s *spec) { s.noRestartAfterSuccess = true }, KindDaemon))
}

// Idle makes a timer tick only once the object has not changed for this long.
func Idle(idle time.Duration) Option {
	return option("Idle", only(func(s *spec) { s.idle = idle }, KindTimer))
}

// Sharp aligns a timer's ticks to a fixed schedule instead of counting the interval from the
// end of the previous tick.
func Sharp() Option {
	return option("Sharp", only(func(s *spec) { s.sharp = true }, KindTimer))
}

// check validates a registration as kopf does at decoration time.
// Operations sets the admission operations a validate or mutate handler intercepts; default
// all (a mutate handler without operations is not called for DELETE, as in kopf).
func Operations(ops ...Operation) Option {
	return option("Operations", only(func(s *spec) { s.operations = ops }, KindValidate, KindMutate))
}

// Subresource sets the subresource a validate or mutate handler intercepts, e.g. "status".
func Subresource(name string) Option {
	return option("Subresource", only(func(s *spec) { s.subresource = name }, KindValidate, KindMutate))
}

// SideEffects declares that a validate or mutate handler has side effects (it then must do
// nothing when [AdmissionRequest.DryRun] is set).
func SideEffects() Option {
	return option("SideEffects", only(func(s *spec) { s.sideEffects = true }, KindValidate, KindMutate))
}

// IgnoreFailures admits requests when the handler fails, times out or is not connected,
// instead of denying them (kopf's ignore_failures, failurePolicy: Ignore).
func IgnoreFailures() Option {
	return option("IgnoreFailures", only(func(s *spec) { s.ignoreFailures = true }, KindValidate, KindMutate))
}

func (s *spec) check() error {
	if s.timeout < 0 || s.backoff < 0 || s.interval < 0 || s.idle < 0 || s.initialDelay < 0 {
		return fmt.Errorf("negative duration")
	}
	if (s.value != nil || s.old != nil || s.new != nil) && s.field == "" {
		return fmt.Errorf("Value, Old and New need Field")
	}
	if s.value != nil && (s.old != nil || s.new != nil) {
		return fmt.Errorf("Value cannot be combined with Old or New")
	}
	for key, m := range s.labels {
		if _, ok := m.equals.(string); m.presence == noPresence && !ok {
			return fmt.Errorf("label %q: Equals needs a string", key)
		}
	}
	for key, m := range s.annotations {
		if _, ok := m.equals.(string); m.presence == noPresence && !ok {
			return fmt.Errorf("annotation %q: Equals needs a string", key)
		}
	}
	if s.kind == KindTimer && s.interval <= 0 {
		return fmt.Errorf("a timer needs a positive interval")
	}
	return nil
}
