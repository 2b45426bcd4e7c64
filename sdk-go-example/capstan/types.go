package capstan

import "time"

// Kind is the kind of a handler: one value per kind of kopf handler the package registers.
type Kind string

// The handler kinds.
const (
	KindCreate  Kind = "create"  // kopf on.create; see [Registry.OnCreate]
	KindUpdate  Kind = "update"  // kopf on.update; see [Registry.OnUpdate]
	KindDelete  Kind = "delete"  // kopf on.delete; see [Registry.OnDelete]
	KindResume  Kind = "resume"  // kopf on.resume; see [Registry.OnResume]
	KindField   Kind = "field"   // kopf on.field; see [Registry.OnField]
	KindEvent   Kind = "event"   // kopf on.event; see [Registry.OnEvent]
	KindIndex   Kind = "index"   // kopf index; see [Registry.Index]
	KindDaemon  Kind = "daemon"  // kopf daemon; see [Registry.Daemon]
	KindTimer   Kind = "timer"   // kopf timer; see [Registry.Timer]
	KindStartup Kind = "startup" // kopf on.startup; see [Registry.OnStartup]
	KindCleanup Kind = "cleanup" // kopf on.cleanup; see [Registry.OnCleanup]
	KindLogin   Kind = "login"   // kopf on.login; see [Registry.OnLogin]
	KindProbe   Kind = "probe"   // kopf on.probe; see [Registry.OnProbe]

	KindValidate Kind = "validate" // kopf on.validate; see [Registry.OnValidate]
	KindMutate   Kind = "mutate"   // kopf on.mutate; see [Registry.OnMutate]
)

// IsAdmission reports whether handlers of the kind answer admission reviews (validate, mutate).
func (k Kind) IsAdmission() bool { return k == KindValidate || k == KindMutate }

// Operation is an admission operation.
type Operation string

// The admission operations.
const (
	OperationCreate  Operation = "CREATE"
	OperationUpdate  Operation = "UPDATE"
	OperationDelete  Operation = "DELETE"
	OperationConnect Operation = "CONNECT"
)

// AdmissionRequest is what a validating or mutating handler is asked about (kopf's webhook
// kwargs); the object under review is [Invocation.Body].
type AdmissionRequest struct {
	// UID is the review's uid.
	UID string
	// Operation is CREATE, UPDATE, DELETE or CONNECT.
	Operation Operation
	// SubResource is the subresource, if any.
	SubResource string
	// DryRun says that nothing will be stored: no side effects.
	DryRun bool
	// OldObject is the object before the operation (UPDATE, DELETE); nil otherwise.
	OldObject any
	// UserInfo is the requesting user (username, uid, groups, extra), decoded.
	UserInfo any
}

// IsActivity reports whether handlers of the kind belong to the operator, not to an object
// (startup, cleanup, login, probe).
func (k Kind) IsActivity() bool {
	return k == KindStartup || k == KindCleanup || k == KindLogin || k == KindProbe
}

// isChange reports whether the kind is a change handler (the kinds that may declare
// sub-handlers).
func (k Kind) isChange() bool {
	return k == KindCreate || k == KindUpdate || k == KindDelete || k == KindResume || k == KindField
}

// Reason is why a change handler is invoked (kopf's reason).
type Reason string

// The reasons of change handlers.
const (
	ReasonCreate Reason = "create" // the object was seen for the first time
	ReasonUpdate Reason = "update" // the object's essence changed
	ReasonDelete Reason = "delete" // the object is marked for deletion
	ReasonResume Reason = "resume" // the object existed before the controller started
)

// DiffOp is what happened to one field (kopf's diff operation).
type DiffOp string

// The diff operations.
const (
	DiffAdd    DiffOp = "add"    // the field appeared
	DiffChange DiffOp = "change" // the field changed its value
	DiffRemove DiffOp = "remove" // the field disappeared
)

// DiffItem is one difference between the old and the new essence, as kopf's (op, path, old,
// new).
type DiffItem struct {
	// Op is what happened.
	Op DiffOp
	// Path is the field path, one element per nesting level.
	Path []string
	// Old is the old value (nil for DiffAdd); New the new value (nil for DiffRemove).
	Old, New any
}

// EventType is the watch event type of an event handler's invocation.
type EventType string

// The watch event types. An object seen in the initial listing has no event type (kopf's
// type=None): [EventListed].
const (
	EventListed   EventType = ""
	EventAdded    EventType = "ADDED"
	EventModified EventType = "MODIFIED"
	EventDeleted  EventType = "DELETED"
)

// CancelReason is why the controller cancelled an invocation.
type CancelReason string

// The cancellation reasons.
const (
	CancelResourceDeleted     CancelReason = "resource_deleted"     // the object was deleted (daemons)
	CancelFilterMismatch      CancelReason = "filter_mismatch"      // the object no longer matches the filters
	CancelDeadlineExceeded    CancelReason = "deadline_exceeded"    // the invocation's deadline passed
	CancelSuperseded          CancelReason = "superseded"           // a newer version of the object came
	CancelRuntimeShutdown     CancelReason = "runtime_shutdown"     // the controller is stopping
	CancelHandlerUnregistered CancelReason = "handler_unregistered" // the handler is no longer registered
	CancelPaused              CancelReason = "paused"               // leadership lost or frozen by a peer
	CancelStreamLost          CancelReason = "stream_lost"          // the stream to the controller ended
	CancelProcessStopping     CancelReason = "process_stopping"     // this process is stopping
)

// ErrorsMode says how errors that a handler did not classify are treated (kopf ErrorsMode).
type ErrorsMode string

// The errors modes. Without [Errors], the kind's default applies: temporary for change
// handlers, daemons, timers and activities; ignored for event handlers.
const (
	ErrorsTemporary ErrorsMode = "temporary" // retried after the backoff
	ErrorsPermanent ErrorsMode = "permanent" // a final failure, until the next change
	ErrorsIgnored   ErrorsMode = "ignored"   // logged and treated as done
)

// Activity is the operator activity of a startup, cleanup or login handler's invocation.
type Activity string

// The activities.
const (
	ActivityStartup Activity = "startup" // before watching starts
	ActivityCleanup Activity = "cleanup" // when the controller stops
	ActivityLogin   Activity = "login"   // credentials are wanted
)

// LogLevel is the severity of a log record sent to the controller.
type LogLevel string

// The log levels. Info records become Normal Events, warnings and errors Warning Events (by
// the controller's policy).
const (
	LevelDebug   LogLevel = "debug"
	LevelInfo    LogLevel = "info"
	LevelWarning LogLevel = "warning"
	LevelError   LogLevel = "error"
)

// ResourceRef identifies the object of an invocation and the version of it the invocation saw.
type ResourceRef struct {
	// Group (empty for the core group), Version, Kind and Plural name the resource.
	Group, Version, Kind, Plural string
	// Namespace (empty for cluster-scoped objects), Name and UID name the object.
	Namespace, Name, UID string
	// ResourceVersion and Generation are those of the body the invocation carried.
	ResourceVersion string
	Generation      int64
}

// Diagnostic describes the failure of an earlier attempt ([Invocation.LastError]).
type Diagnostic struct {
	// Summary is one line for humans; Detail a longer explanation.
	Summary, Detail string
	// Reason is an UPPER_SNAKE_CASE code, e.g. "TEMPORARY_ERROR".
	Reason string
	// ErrorType is the type of the error on the handler side.
	ErrorType string
}

// Credentials are API credentials, the result of a login handler (kopf.ConnectionInfo). Return
// a *Credentials from an [Registry.OnLogin] handler.
type Credentials struct {
	// Server is the API server URL.
	Server string
	// CertificateAuthority holds PEM-encoded CA certificates to trust.
	CertificateAuthority []byte
	// Insecure skips TLS verification.
	Insecure bool
	// Username and Password are for basic auth; Token is a bearer token.
	Username, Password, Token string
	// ClientCertificate and ClientKey are PEM-encoded.
	ClientCertificate, ClientKey []byte
	// DefaultNamespace is the namespace used when none is given.
	DefaultNamespace string
	// Expiration is when the credentials expire (zero: never); the login handler is called
	// again before then.
	Expiration time.Time
	// Priority orders the credentials of several login handlers (higher first).
	Priority int32
}
