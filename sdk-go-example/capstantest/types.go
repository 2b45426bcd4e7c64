package capstantest

import (
	"bytes"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"strings"
	"time"

	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	"capstan.dev/sdk-go-example/capstan"
	pb "capstan.dev/sdk-go-example/gen/capstan/v1"
)

// Invocation describes an invocation the fake controller sends. Zero fields get defaults.
type Invocation struct {
	// Handler is the handler id to invoke.
	Handler string
	// Body is the object; default: an object named "test" in namespace "default" with uid
	// "uid-test". Its metadata's name, namespace and uid also fill the invocation's
	// [capstan.ResourceRef]. Ignored for activities.
	Body map[string]any
	// Reason is the cause of change handlers; default: the kind's own (create, update, delete,
	// resume) and update for field handlers.
	Reason capstan.Reason
	// Old, New and Diff are the change's payload; Field defaults to the field of a field
	// handler's id ("field_fn/spec.x" → "spec.x").
	Old, New any
	Diff     []capstan.DiffItem
	Field    string
	// EventType is the watch event type of event handlers.
	EventType capstan.EventType
	// IndexDeleted makes an index handler's invocation say that the object leaves the index.
	IndexDeleted bool
	// Attempt is the 1-based attempt; default 1.
	Attempt int
	// Started is when the first attempt started; default now.
	Started time.Time
	// Deadline is when the controller wants the attempt finished; zero means none.
	Deadline time.Time
	// LastError is the previous attempt's failure summary.
	LastError string
	// Subhandlers is the persisted state of sub-handlers from earlier attempts.
	Subhandlers []SubhandlerState
	// Operation, DryRun and OldObject are the admission request of validate and mutate
	// handlers; Operation defaults to CREATE.
	Operation capstan.Operation
	DryRun    bool
	OldObject map[string]any
}

// Verdict is the answer of a validate or mutate handler.
type Verdict struct {
	// Allowed says whether the request is admitted.
	Allowed bool
	// Message and Code are a denial's.
	Message string
	Code    int32
	// Warnings are returned to the client.
	Warnings []string
}

// SubhandlerState is the persisted state of one sub-handler, as the controller sends it with a
// parent's invocation.
type SubhandlerState struct {
	// ID is the sub-handler id relative to the parent ("child", or "child/grandchild").
	ID string
	// Retries is the number of attempts made so far.
	Retries int
	// Success and Failure say that it finished.
	Success, Failure bool
	// DelayedUntil is when it may run again.
	DelayedUntil time.Time
	// Started is when its first attempt started.
	Started time.Time
	// Message is its last error.
	Message string
}

// Outcome is the kind of an invocation's result.
type Outcome string

// The outcomes.
const (
	Success      Outcome = "success"
	Temporary    Outcome = "temporary"
	Permanent    Outcome = "permanent"
	Unclassified Outcome = "unclassified"
	Cancelled    Outcome = "cancelled"
	Skipped      Outcome = "skipped"
	// Lost means the stream ended before the process answered.
	Lost Outcome = "lost"
)

// Result is what the handler process answered.
type Result struct {
	// Outcome is what happened.
	Outcome Outcome
	// Value is the handler's JSON result, decoded (numbers as json.Number); nil for none.
	Value any
	// Credentials is a login handler's result.
	Credentials *capstan.Credentials
	// Verdict is a validate or mutate handler's answer.
	Verdict *Verdict
	// Patch holds the patches sent with the result.
	Patch Patch
	// Delay is a temporary error's retry delay (0: the handler's backoff).
	Delay time.Duration
	// Message, Detail, Reason, ErrorType and StackTrace describe a failure.
	Message, Detail, Reason, ErrorType, StackTrace string
	// Subhandlers are the outcomes of the sub-handlers that ran.
	Subhandlers []SubhandlerResult
	// Logs are the invocation's log records received before the result.
	Logs []Log
	// Duration is the handler's run time as the process measured it.
	Duration time.Duration
}

// SubhandlerResult is the outcome of one sub-handler.
type SubhandlerResult struct {
	// ID is the sub-handler id relative to the top-level handler.
	ID string
	// Outcome, Value, Delay and Message as in [Result].
	Outcome Outcome
	Value   any
	Delay   time.Duration
	Message string
}

// Patch is a set of RFC 7386 merge patches, merged per target.
type Patch struct {
	// Object patches the object (metadata, spec); Status the status subresource (its
	// documents start at "status").
	Object, Status map[string]any
}

// Log is one log record from the handler process.
type Log struct {
	// Invocation is the invocation id; empty for process-wide records.
	Invocation string
	// Level and Message are the record's.
	Level   capstan.LogLevel
	Message string
}

// Hello is the handshake of a handler process.
type Hello struct {
	// InstanceID is kept for the life of the process.
	InstanceID string
	// SDK is "name version language".
	SDK string
	// Capabilities are the protocol features announced, e.g. "CAPABILITY_SUBHANDLERS".
	Capabilities []string
	// MaxInFlight is the process's cap; 0: the controller's default.
	MaxInFlight uint32
	// Handlers are the registrations, in order.
	Handlers []Registration
}

// Handler returns the first registration of id.
func (h Hello) Handler(id string) (Registration, bool) {
	for _, r := range h.Handlers {
		if r.ID == id {
			return r, true
		}
	}
	return Registration{}, false
}

// Registration is one handler's registration as sent in Hello.
type Registration struct {
	// ID is the handler id; Kind its kind.
	ID   string
	Kind capstan.Kind
	// Group, Version and Resource select the resource; empty for activities.
	Group, Version, Resource string
	// LabelSelector and FieldSelector are the handler's selectors.
	LabelSelector, FieldSelector string
	// Errors is the errors mode; empty for the kind's default.
	Errors capstan.ErrorsMode
	// Retries, MaxInFlight, Backoff and Timeout are the options of the same names; 0 unset.
	Retries, MaxInFlight uint32
	Backoff, Timeout     time.Duration
	// Param is the decoded param; nil when unset.
	Param any
	// Filters and KindOptions are the registration's filters and kind-specific options in
	// the protocol's JSON form (proto field names, e.g. {"labels": {"app": {"equals":
	// "db"}}, "sdk_when": true} and {"interval": "10s", "sharp": true}); nil when unset.
	Filters, KindOptions map[string]any
}

var kindOf = map[pb.HandlerKind]capstan.Kind{
	pb.HandlerKind_HANDLER_KIND_CREATE: capstan.KindCreate, pb.HandlerKind_HANDLER_KIND_UPDATE: capstan.KindUpdate,
	pb.HandlerKind_HANDLER_KIND_DELETE: capstan.KindDelete, pb.HandlerKind_HANDLER_KIND_RESUME: capstan.KindResume,
	pb.HandlerKind_HANDLER_KIND_FIELD: capstan.KindField, pb.HandlerKind_HANDLER_KIND_EVENT: capstan.KindEvent,
	pb.HandlerKind_HANDLER_KIND_INDEX:  capstan.KindIndex,
	pb.HandlerKind_HANDLER_KIND_DAEMON: capstan.KindDaemon, pb.HandlerKind_HANDLER_KIND_TIMER: capstan.KindTimer,
	pb.HandlerKind_HANDLER_KIND_STARTUP: capstan.KindStartup, pb.HandlerKind_HANDLER_KIND_CLEANUP: capstan.KindCleanup,
	pb.HandlerKind_HANDLER_KIND_LOGIN: capstan.KindLogin, pb.HandlerKind_HANDLER_KIND_PROBE: capstan.KindProbe,
}

var cancelReasons = map[capstan.CancelReason]pb.CancelReason{
	capstan.CancelResourceDeleted:     pb.CancelReason_CANCEL_REASON_RESOURCE_DELETED,
	capstan.CancelFilterMismatch:      pb.CancelReason_CANCEL_REASON_FILTER_MISMATCH,
	capstan.CancelDeadlineExceeded:    pb.CancelReason_CANCEL_REASON_DEADLINE_EXCEEDED,
	capstan.CancelSuperseded:          pb.CancelReason_CANCEL_REASON_SUPERSEDED,
	capstan.CancelRuntimeShutdown:     pb.CancelReason_CANCEL_REASON_RUNTIME_SHUTDOWN,
	capstan.CancelHandlerUnregistered: pb.CancelReason_CANCEL_REASON_HANDLER_UNREGISTERED,
	capstan.CancelPaused:              pb.CancelReason_CANCEL_REASON_PAUSED,
}

var errorsModes = map[pb.ErrorsMode]capstan.ErrorsMode{
	pb.ErrorsMode_ERRORS_MODE_TEMPORARY: capstan.ErrorsTemporary,
	pb.ErrorsMode_ERRORS_MODE_PERMANENT: capstan.ErrorsPermanent,
	pb.ErrorsMode_ERRORS_MODE_IGNORED:   capstan.ErrorsIgnored,
}

func helloOf(h *pb.Hello) Hello {
	out := Hello{InstanceID: h.GetInstanceId(), MaxInFlight: h.GetMaxInFlight(),
		SDK: strings.Join([]string{h.GetSdk().GetName(), h.GetSdk().GetVersion(), h.GetSdk().GetLanguage()}, " ")}
	for _, c := range h.GetCapabilities() {
		out.Capabilities = append(out.Capabilities, c.String())
	}
	for _, r := range h.GetHandlers() {
		reg := Registration{ID: r.GetHandlerId(), Kind: kindOf[r.GetKind()],
			Group: r.GetResource().GetGroup(), Version: r.GetResource().GetVersion(), Resource: r.GetResource().GetName(),
			LabelSelector: r.GetResource().GetLabelSelector(), FieldSelector: r.GetResource().GetFieldSelector(),
			Errors: errorsModes[r.GetErrorsMode()], Retries: r.GetRetries(), MaxInFlight: r.GetMaxInFlight(),
			Backoff: r.GetBackoff().AsDuration(), Timeout: r.GetTimeout().AsDuration(),
			Filters: jsonOf(r.GetFilters())}
		reg.Param, _ = decode(r.GetParam())
		switch o := r.GetKindOptions().(type) {
		case *pb.HandlerRegistration_Daemon:
			reg.KindOptions = jsonOf(o.Daemon)
		case *pb.HandlerRegistration_Timer:
			reg.KindOptions = jsonOf(o.Timer)
		case *pb.HandlerRegistration_Delete:
			reg.KindOptions = jsonOf(o.Delete)
		case *pb.HandlerRegistration_Resume:
			reg.KindOptions = jsonOf(o.Resume)
		}
		out.Handlers = append(out.Handlers, reg)
	}
	return out
}

// jsonOf renders a message in the protocol's JSON form, with proto field names.
func jsonOf(m proto.Message) map[string]any {
	if m == nil || !m.ProtoReflect().IsValid() {
		return nil
	}
	raw, err := protojson.MarshalOptions{UseProtoNames: true}.Marshal(m)
	if err != nil {
		return nil
	}
	var out map[string]any
	if json.Unmarshal(raw, &out) != nil {
		return nil
	}
	inlineJSON(out)
	return out
}

// inlineJSON replaces the protocol's Json messages ({"json": "<base64 of JSON text>"}) with
// the values they carry.
func inlineJSON(m map[string]any) {
	for k, v := range m {
		sub, ok := v.(map[string]any)
		if !ok {
			continue
		}
		if text, ok := sub["json"].(string); ok && len(sub) == 1 {
			if raw, err := base64.StdEncoding.DecodeString(text); err == nil {
				if value, err := decode(&pb.Json{Json: raw}); err == nil {
					m[k] = value
					continue
				}
			}
		}
		inlineJSON(sub)
	}
}

// message builds the wire invocation.
func (inv Invocation) message(id string, kind capstan.Kind, param *pb.Json) (*pb.Invocation, error) {
	if inv.Handler == "" {
		return nil, fmt.Errorf("an invocation needs a handler id")
	}
	m := &pb.Invocation{InvocationId: id, HandlerId: inv.Handler, Attempt: uint32(max(inv.Attempt, 1)),
		IdempotencyKey: inv.Handler + "/" + id, Param: param, StartedTime: timestamppb.Now()}
	if !inv.Started.IsZero() {
		m.StartedTime = timestamppb.New(inv.Started)
	}
	if !inv.Deadline.IsZero() {
		m.Deadline = timestamppb.New(inv.Deadline)
	}
	if inv.LastError != "" {
		m.LastError = &pb.Diagnostic{Severity: pb.Severity_SEVERITY_ERROR, Summary: inv.LastError}
	}
	for _, s := range inv.Subhandlers {
		st := &pb.SubhandlerState{SubhandlerId: s.ID, Retries: uint32(s.Retries), Success: s.Success,
			Failure: s.Failure, Message: s.Message}
		if !s.DelayedUntil.IsZero() {
			st.DelayedUntil = timestamppb.New(s.DelayedUntil)
		}
		if !s.Started.IsZero() {
			st.StartedTime = timestamppb.New(s.Started)
		}
		m.Subhandlers = append(m.Subhandlers, st)
	}
	if kind.IsActivity() {
		switch kind {
		case capstan.KindProbe:
			m.Payload = &pb.Invocation_Probe{Probe: &pb.ProbeRequest{}}
		default:
			activity := map[capstan.Kind]pb.Activity{capstan.KindStartup: pb.Activity_ACTIVITY_STARTUP,
				capstan.KindCleanup: pb.Activity_ACTIVITY_CLEANUP, capstan.KindLogin: pb.Activity_ACTIVITY_LOGIN}[kind]
			m.Payload = &pb.Invocation_Activity{Activity: &pb.ActivityRequest{Activity: activity}}
		}
		return m, nil
	}
	body := inv.Body
	if body == nil {
		body = map[string]any{"metadata": map[string]any{"name": "test", "namespace": "default", "uid": "uid-test"}}
	}
	raw, err := json.Marshal(body)
	if err != nil {
		return nil, fmt.Errorf("encoding the body: %w", err)
	}
	m.Body = &pb.Json{Json: raw}
	meta, _ := body["metadata"].(map[string]any)
	str := func(k string) string { s, _ := meta[k].(string); return s }
	m.Resource = &pb.ResourceRef{Name: str("name"), Namespace: str("namespace"), Uid: str("uid"),
		ResourceVersion: str("resourceVersion")}
	switch kind {
	case capstan.KindEvent:
		m.Payload = &pb.Invocation_Event{Event: &pb.ResourceEvent{Type: map[capstan.EventType]pb.EventType{
			capstan.EventAdded: pb.EventType_EVENT_TYPE_ADDED, capstan.EventModified: pb.EventType_EVENT_TYPE_MODIFIED,
			capstan.EventDeleted: pb.EventType_EVENT_TYPE_DELETED}[inv.EventType]}}
	case capstan.KindDaemon:
		m.Payload = &pb.Invocation_Daemon{Daemon: &pb.DaemonStart{}}
	case capstan.KindIndex:
		m.Payload = &pb.Invocation_Index{Index: &pb.IndexRequest{Deleted: inv.IndexDeleted}}
	case capstan.KindTimer:
		m.Payload = &pb.Invocation_Timer{Timer: &pb.TimerTick{ScheduledTime: timestamppb.Now()}}
	case capstan.KindValidate, capstan.KindMutate:
		op := inv.Operation
		if op == "" {
			op = capstan.OperationCreate
		}
		old, err := encode(inv.OldObject)
		if err != nil {
			return nil, err
		}
		if inv.OldObject == nil {
			old = nil
		}
		m.Payload = &pb.Invocation_Admission{Admission: &pb.AdmissionRequest{Uid: "uid-review", Operation: string(op),
			DryRun: inv.DryRun, OldObject: old}}
	default:
		change, err := inv.change(kind)
		if err != nil {
			return nil, err
		}
		m.Payload = &pb.Invocation_Change{Change: change}
	}
	return m, nil
}

// change builds the payload of change and field handlers.
func (inv Invocation) change(kind capstan.Kind) (*pb.ResourceChange, error) {
	reason := inv.Reason
	if reason == "" {
		reason = map[capstan.Kind]capstan.Reason{capstan.KindCreate: capstan.ReasonCreate,
			capstan.KindDelete: capstan.ReasonDelete, capstan.KindResume: capstan.ReasonResume}[kind]
		if reason == "" {
			reason = capstan.ReasonUpdate
		}
	}
	c := &pb.ResourceChange{Reason: map[capstan.Reason]pb.ChangeReason{
		capstan.ReasonCreate: pb.ChangeReason_CHANGE_REASON_CREATE, capstan.ReasonUpdate: pb.ChangeReason_CHANGE_REASON_UPDATE,
		capstan.ReasonDelete: pb.ChangeReason_CHANGE_REASON_DELETE, capstan.ReasonResume: pb.ChangeReason_CHANGE_REASON_RESUME,
	}[reason], Field: inv.Field}
	if c.Field == "" && kind == capstan.KindField {
		if _, field, ok := strings.Cut(inv.Handler, "/"); ok {
			c.Field = field
		}
	}
	var err error
	if c.Old, err = encode(inv.Old); err != nil {
		return nil, err
	}
	if c.New, err = encode(inv.New); err != nil {
		return nil, err
	}
	for _, d := range inv.Diff {
		item := &pb.DiffItem{Path: d.Path, Operation: map[capstan.DiffOp]pb.DiffOperation{
			capstan.DiffAdd: pb.DiffOperation_DIFF_OPERATION_ADD, capstan.DiffChange: pb.DiffOperation_DIFF_OPERATION_CHANGE,
			capstan.DiffRemove: pb.DiffOperation_DIFF_OPERATION_REMOVE}[d.Op]}
		if item.Old, err = encode(d.Old); err != nil {
			return nil, err
		}
		if item.New, err = encode(d.New); err != nil {
			return nil, err
		}
		c.Diff = append(c.Diff, item)
	}
	return c, nil
}

// encode encodes a value as a Json message; nil is absent.
func encode(v any) (*pb.Json, error) {
	if v == nil {
		return nil, nil
	}
	raw, err := json.Marshal(v)
	if err != nil {
		return nil, fmt.Errorf("encoding %T: %w", v, err)
	}
	return &pb.Json{Json: raw}, nil
}

// decode decodes a Json message with json.Number numbers; absent is nil.
func decode(j *pb.Json) (any, error) {
	if j == nil {
		return nil, nil
	}
	dec := json.NewDecoder(bytes.NewReader(j.GetJson()))
	dec.UseNumber()
	var v any
	err := dec.Decode(&v)
	return v, err
}

func resultOf(r *pb.InvocationResult) Result {
	res := Result{Patch: patchOf(r.GetPatches()), Duration: r.GetDuration().AsDuration()}
	var diags []*pb.Diagnostic
	switch o := r.GetOutcome().(type) {
	case *pb.InvocationResult_Success:
		res.Outcome = Success
		res.Value, _ = decode(o.Success.GetResult())
		if c := o.Success.GetCredentials(); c != nil {
			res.Credentials = credentialsOf(c)
		}
		if a := o.Success.GetAdmission(); a != nil {
			res.Verdict = &Verdict{Allowed: a.GetAllowed(), Message: a.GetMessage(), Code: a.GetCode(),
				Warnings: a.GetWarnings()}
		}
	case *pb.InvocationResult_TemporaryError:
		res.Outcome, res.Delay, diags = Temporary, o.TemporaryError.GetRetryAfter().AsDuration(), o.TemporaryError.GetDiagnostics()
	case *pb.InvocationResult_PermanentError:
		res.Outcome, diags = Permanent, o.PermanentError.GetDiagnostics()
	case *pb.InvocationResult_UnclassifiedError:
		res.Outcome, diags = Unclassified, o.UnclassifiedError.GetDiagnostics()
	case *pb.InvocationResult_Cancelled:
		res.Outcome = Cancelled
	case *pb.InvocationResult_Skipped:
		res.Outcome = Skipped
	}
	if len(diags) > 0 {
		d := diags[0]
		res.Message, res.Detail, res.Reason, res.ErrorType, res.StackTrace =
			d.GetSummary(), d.GetDetail(), d.GetReason(), d.GetErrorType(), d.GetStackTrace()
	}
	for _, s := range r.GetSubhandlers() {
		sub := SubhandlerResult{ID: s.GetSubhandlerId()}
		var diags []*pb.Diagnostic
		switch o := s.GetOutcome().(type) {
		case *pb.SubhandlerOutcome_Success:
			sub.Outcome = Success
			sub.Value, _ = decode(o.Success.GetResult())
		case *pb.SubhandlerOutcome_TemporaryError:
			sub.Outcome, sub.Delay, diags = Temporary, o.TemporaryError.GetRetryAfter().AsDuration(), o.TemporaryError.GetDiagnostics()
		case *pb.SubhandlerOutcome_PermanentError:
			sub.Outcome, diags = Permanent, o.PermanentError.GetDiagnostics()
		case *pb.SubhandlerOutcome_UnclassifiedError:
			sub.Outcome, diags = Unclassified, o.UnclassifiedError.GetDiagnostics()
		}
		if len(diags) > 0 {
			sub.Message = diags[0].GetSummary()
		}
		res.Subhandlers = append(res.Subhandlers, sub)
	}
	return res
}

func credentialsOf(c *pb.Credentials) *capstan.Credentials {
	out := &capstan.Credentials{Server: c.GetServer(), CertificateAuthority: c.GetCertificateAuthority(),
		Insecure: c.GetInsecure(), Username: c.GetUsername(), Password: c.GetPassword(), Token: c.GetToken(),
		ClientCertificate: c.GetClientCertificate(), ClientKey: c.GetClientKey(),
		DefaultNamespace: c.GetDefaultNamespace(), Priority: c.GetPriority()}
	if t := c.GetExpirationTime(); t != nil {
		out.Expiration = t.AsTime()
	}
	return out
}

// patchOf merges merge patches per target (JSON patches are not merged and are left out).
func patchOf(patches []*pb.Patch) Patch {
	var p Patch
	for _, m := range patches {
		if m.GetType() != pb.PatchType_PATCH_TYPE_MERGE {
			continue
		}
		doc, err := decode(m.GetBody())
		obj, ok := doc.(map[string]any)
		if err != nil || !ok {
			continue
		}
		target := &p.Object
		if m.GetTarget() == pb.PatchTarget_PATCH_TARGET_STATUS {
			target = &p.Status
		}
		if *target == nil {
			*target = map[string]any{}
		}
		merge(*target, obj)
	}
	return p
}

// merge merges a merge-patch document into another, keeping nulls (they delete keys).
func merge(into, doc map[string]any) {
	for k, v := range doc {
		sub, ok := v.(map[string]any)
		cur, curOK := into[k].(map[string]any)
		if ok && curOK {
			merge(cur, sub)
			continue
		}
		into[k] = v
	}
}

func logOf(l *pb.LogRecord) Log {
	levels := map[pb.LogLevel]capstan.LogLevel{pb.LogLevel_LOG_LEVEL_DEBUG: capstan.LevelDebug,
		pb.LogLevel_LOG_LEVEL_WARNING: capstan.LevelWarning, pb.LogLevel_LOG_LEVEL_ERROR: capstan.LevelError}
	level, ok := levels[l.GetLevel()]
	if !ok {
		level = capstan.LevelInfo
	}
	return Log{Invocation: l.GetInvocationId(), Level: level, Message: l.GetMessage()}
}
