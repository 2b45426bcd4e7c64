package capstan

import (
	"bytes"
	"encoding/json"
	"fmt"
	"time"

	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	pb "capstan.dev/sdk-go-example/gen/capstan/v1"
)

// This file is the one place where the package's own types meet the generated protocol
// types: a change of the generated code changes this file, never the exported API.

var kinds = map[Kind]pb.HandlerKind{
	KindCreate: pb.HandlerKind_HANDLER_KIND_CREATE, KindUpdate: pb.HandlerKind_HANDLER_KIND_UPDATE,
	KindDelete: pb.HandlerKind_HANDLER_KIND_DELETE, KindResume: pb.HandlerKind_HANDLER_KIND_RESUME,
	KindField: pb.HandlerKind_HANDLER_KIND_FIELD, KindEvent: pb.HandlerKind_HANDLER_KIND_EVENT,
	KindIndex:  pb.HandlerKind_HANDLER_KIND_INDEX,
	KindDaemon: pb.HandlerKind_HANDLER_KIND_DAEMON, KindTimer: pb.HandlerKind_HANDLER_KIND_TIMER,
	KindStartup: pb.HandlerKind_HANDLER_KIND_STARTUP, KindCleanup: pb.HandlerKind_HANDLER_KIND_CLEANUP,
	KindLogin: pb.HandlerKind_HANDLER_KIND_LOGIN, KindProbe: pb.HandlerKind_HANDLER_KIND_PROBE,
	KindValidate: pb.HandlerKind_HANDLER_KIND_VALIDATE, KindMutate: pb.HandlerKind_HANDLER_KIND_MUTATE,
}

var operations = map[Operation]pb.Operation{
	OperationCreate: pb.Operation_OPERATION_CREATE, OperationUpdate: pb.Operation_OPERATION_UPDATE,
	OperationDelete: pb.Operation_OPERATION_DELETE, OperationConnect: pb.Operation_OPERATION_CONNECT,
}

var errorsModes = map[ErrorsMode]pb.ErrorsMode{
	ErrorsTemporary: pb.ErrorsMode_ERRORS_MODE_TEMPORARY,
	ErrorsPermanent: pb.ErrorsMode_ERRORS_MODE_PERMANENT,
	ErrorsIgnored:   pb.ErrorsMode_ERRORS_MODE_IGNORED,
}

var cancelReasons = map[pb.CancelReason]CancelReason{
	pb.CancelReason_CANCEL_REASON_RESOURCE_DELETED:     CancelResourceDeleted,
	pb.CancelReason_CANCEL_REASON_FILTER_MISMATCH:      CancelFilterMismatch,
	pb.CancelReason_CANCEL_REASON_DEADLINE_EXCEEDED:    CancelDeadlineExceeded,
	pb.CancelReason_CANCEL_REASON_SUPERSEDED:           CancelSuperseded,
	pb.CancelReason_CANCEL_REASON_RUNTIME_SHUTDOWN:     CancelRuntimeShutdown,
	pb.CancelReason_CANCEL_REASON_HANDLER_UNREGISTERED: CancelHandlerUnregistered,
	pb.CancelReason_CANCEL_REASON_PAUSED:               CancelPaused,
}

var reasons = map[pb.ChangeReason]Reason{
	pb.ChangeReason_CHANGE_REASON_CREATE: ReasonCreate, pb.ChangeReason_CHANGE_REASON_UPDATE: ReasonUpdate,
	pb.ChangeReason_CHANGE_REASON_DELETE: ReasonDelete, pb.ChangeReason_CHANGE_REASON_RESUME: ReasonResume,
}

var eventTypes = map[pb.EventType]EventType{
	pb.EventType_EVENT_TYPE_ADDED: EventAdded, pb.EventType_EVENT_TYPE_MODIFIED: EventModified,
	pb.EventType_EVENT_TYPE_DELETED: EventDeleted,
}

var activities = map[pb.Activity]Activity{
	pb.Activity_ACTIVITY_STARTUP: ActivityStartup, pb.Activity_ACTIVITY_CLEANUP: ActivityCleanup,
	pb.Activity_ACTIVITY_LOGIN: ActivityLogin,
}

var logLevels = map[LogLevel]pb.LogLevel{
	LevelDebug: pb.LogLevel_LOG_LEVEL_DEBUG, LevelInfo: pb.LogLevel_LOG_LEVEL_INFO,
	LevelWarning: pb.LogLevel_LOG_LEVEL_WARNING, LevelError: pb.LogLevel_LOG_LEVEL_ERROR,
}

// registrations returns the HandlerRegistrations for Hello, in registration order.
func (r *Registry) registrations() ([]*pb.HandlerRegistration, error) {
	var regs []*pb.HandlerRegistration
	for _, h := range r.handlers {
		reg, err := h.spec.registration()
		if err != nil {
			return nil, fmt.Errorf("capstan: handler %q: %w", h.spec.id, err)
		}
		regs = append(regs, reg)
		for _, sel := range h.spec.also {
			more, _ := h.spec.registration()
			more.Resource = sel.message()
			regs = append(regs, more)
		}
	}
	return regs, nil
}

func (s selector) message() *pb.ResourceSelector {
	return &pb.ResourceSelector{Group: s.group, Version: s.version, Name: s.name,
		LabelSelector: s.labelSelector, FieldSelector: s.fieldSelector}
}

// registration returns the wire registration of a handler.
func (s *spec) registration() (*pb.HandlerRegistration, error) {
	reg := &pb.HandlerRegistration{
		HandlerId:   s.id,
		Kind:        kinds[s.kind],
		ErrorsMode:  errorsModes[s.errors],
		Retries:     s.retries,
		MaxInFlight: s.maxInFlight,
		Backoff:     duration(s.backoff),
		Timeout:     duration(s.timeout),
	}
	if !s.kind.IsActivity() {
		reg.Resource = s.resource.message()
	}
	if s.hasParam {
		j, err := encode(s.param)
		if err != nil {
			return nil, fmt.Errorf("param: %w", err)
		}
		reg.Param = j
	}
	filters, err := s.filters()
	if err != nil {
		return nil, err
	}
	reg.Filters = filters
	switch s.kind {
	case KindDaemon:
		reg.KindOptions = &pb.HandlerRegistration_Daemon{Daemon: &pb.DaemonOptions{
			InitialDelay:          duration(s.initialDelay),
			CancellationBackoff:   duration(s.cancellationBackoff),
			CancellationTimeout:   duration(s.cancellationTimeout),
			RestartBackoff:        duration(s.restartBackoff),
			NoRestartAfterSuccess: s.noRestartAfterSuccess,
		}}
	case KindTimer:
		reg.KindOptions = &pb.HandlerRegistration_Timer{Timer: &pb.TimerOptions{
			Interval:     duration(s.interval),
			InitialDelay: duration(s.initialDelay),
			Idle:         duration(s.idle),
			Sharp:        s.sharp,
		}}
	case KindDelete:
		reg.KindOptions = &pb.HandlerRegistration_Delete{Delete: &pb.DeleteOptions{Optional: s.optional}}
	case KindResume:
		reg.KindOptions = &pb.HandlerRegistration_Resume{Resume: &pb.ResumeOptions{Deleted: s.deleted}}
	case KindValidate, KindMutate:
		options := &pb.AdmissionOptions{Subresource: s.subresource, SideEffects: s.sideEffects,
			IgnoreFailures: s.ignoreFailures}
		for _, op := range s.operations {
			options.Operations = append(options.Operations, operations[op])
		}
		reg.KindOptions = &pb.HandlerRegistration_Admission{Admission: options}
	}
	return reg, nil
}

// filters returns the wire filters, or nil when there are none.
func (s *spec) filters() (*pb.Filters, error) {
	f := &pb.Filters{Field: s.field, SdkWhen: s.when != nil}
	for key, m := range s.labels {
		if f.Labels == nil {
			f.Labels = map[string]*pb.MetaMatch{}
		}
		f.Labels[key] = m.meta()
	}
	for key, m := range s.annotations {
		if f.Annotations == nil {
			f.Annotations = map[string]*pb.MetaMatch{}
		}
		f.Annotations[key] = m.meta()
	}
	var err error
	if f.Value, err = s.value.valueMatch(); err != nil {
		return nil, err
	}
	if f.Old, err = s.old.valueMatch(); err != nil {
		return nil, err
	}
	if f.New, err = s.new.valueMatch(); err != nil {
		return nil, err
	}
	if f.Field == "" && !f.SdkWhen && f.Labels == nil && f.Annotations == nil {
		return nil, nil
	}
	return f, nil
}

func (p presence) message() pb.Presence {
	if p == present {
		return pb.Presence_PRESENCE_PRESENT
	}
	return pb.Presence_PRESENCE_ABSENT
}

func (m Match) meta() *pb.MetaMatch {
	if m.presence != noPresence {
		return &pb.MetaMatch{Condition: &pb.MetaMatch_Presence{Presence: m.presence.message()}}
	}
	value, _ := m.equals.(string)
	return &pb.MetaMatch{Condition: &pb.MetaMatch_Equals{Equals: value}}
}

func (m *Match) valueMatch() (*pb.ValueMatch, error) {
	if m == nil {
		return nil, nil
	}
	if m.presence != noPresence {
		return &pb.ValueMatch{Condition: &pb.ValueMatch_Presence{Presence: m.presence.message()}}, nil
	}
	j, err := encode(m.equals)
	if err != nil {
		return nil, fmt.Errorf("value filter: %w", err)
	}
	return &pb.ValueMatch{Condition: &pb.ValueMatch_Equals{Equals: j}}, nil
}

// newInvocation decodes an Invocation message. A value that is not valid JSON is an error.
func newInvocation(m *pb.Invocation, kind Kind) (*Invocation, error) {
	inv := &Invocation{
		ID:             m.GetInvocationId(),
		HandlerID:      m.GetHandlerId(),
		Kind:           kind,
		Attempt:        int(m.GetAttempt()),
		Retry:          max(int(m.GetAttempt())-1, 0),
		IdempotencyKey: m.GetIdempotencyKey(),
		Traceparent:    m.GetTraceContext()["traceparent"],
		Started:        time.Now(),
		canDeclare:     kind.isChange(),
	}
	if res := m.GetResource(); res != nil {
		inv.Resource = ResourceRef{Group: res.GetGroup(), Version: res.GetVersion(), Kind: res.GetKind(),
			Plural: res.GetPlural(), Namespace: res.GetNamespace(), Name: res.GetName(), UID: res.GetUid(),
			ResourceVersion: res.GetResourceVersion(), Generation: res.GetGeneration()}
	}
	if d := m.GetLastError(); d != nil {
		inv.LastError = &Diagnostic{Summary: d.GetSummary(), Detail: d.GetDetail(), Reason: d.GetReason(),
			ErrorType: d.GetErrorType()}
	}
	if m.GetStartedTime() != nil {
		inv.Started = m.GetStartedTime().AsTime()
	}
	body, err := decode(m.GetBody())
	if err != nil {
		return nil, fmt.Errorf("body: %w", err)
	}
	if b, ok := body.(map[string]any); ok {
		inv.setBody(b)
	}
	if inv.Param, err = decode(m.GetParam()); err != nil {
		return nil, fmt.Errorf("param: %w", err)
	}
	switch p := m.GetPayload().(type) {
	case *pb.Invocation_Change:
		if err := inv.decodeChange(p.Change); err != nil {
			return nil, err
		}
	case *pb.Invocation_Event:
		inv.EventType = eventTypes[p.Event.GetType()]
	case *pb.Invocation_Daemon:
		inv.Restarts = int(p.Daemon.GetRestarts())
	case *pb.Invocation_Timer:
		if t := p.Timer.GetScheduledTime(); t != nil {
			inv.Scheduled = t.AsTime()
		}
	case *pb.Invocation_Activity:
		inv.Activity = activities[p.Activity.GetActivity()]
	case *pb.Invocation_Index:
		inv.IndexDeleted = p.Index.GetDeleted()
	case *pb.Invocation_Admission:
		a := p.Admission
		inv.Admission = &AdmissionRequest{UID: a.GetUid(), Operation: Operation(a.GetOperation()),
			SubResource: a.GetSubresource(), DryRun: a.GetDryRun()}
		if inv.Admission.OldObject, err = decode(a.GetOldObject()); err != nil {
			return nil, fmt.Errorf("admission.old_object: %w", err)
		}
		if inv.Admission.UserInfo, err = decode(a.GetUserInfo()); err != nil {
			return nil, fmt.Errorf("admission.user_info: %w", err)
		}
	}
	return inv, nil
}

// decodeChange decodes the payload of change and field handlers.
func (inv *Invocation) decodeChange(change *pb.ResourceChange) error {
	inv.Reason = reasons[change.GetReason()]
	inv.Field = change.GetField()
	var err error
	if inv.Old, err = decode(change.GetOld()); err != nil {
		return fmt.Errorf("change.old: %w", err)
	}
	if inv.New, err = decode(change.GetNew()); err != nil {
		return fmt.Errorf("change.new: %w", err)
	}
	for i, d := range change.GetDiff() {
		item := DiffItem{Op: DiffChange, Path: d.GetPath()}
		switch d.GetOperation() {
		case pb.DiffOperation_DIFF_OPERATION_ADD:
			item.Op = DiffAdd
		case pb.DiffOperation_DIFF_OPERATION_REMOVE:
			item.Op = DiffRemove
		}
		if item.Old, err = decode(d.GetOld()); err != nil {
			return fmt.Errorf("change.diff[%d].old: %w", i, err)
		}
		if item.New, err = decode(d.GetNew()); err != nil {
			return fmt.Errorf("change.diff[%d].new: %w", i, err)
		}
		inv.Diff = append(inv.Diff, item)
	}
	return nil
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

// encode encodes a value as a Json message.
func encode(v any) (*pb.Json, error) {
	body, err := json.Marshal(v)
	if err != nil {
		return nil, err
	}
	return &pb.Json{Json: body}, nil
}

// duration returns a Duration message, or nil for 0.
func duration(d time.Duration) *durationpb.Duration {
	if d == 0 {
		return nil
	}
	return durationpb.New(d)
}

// request turns what an invocation sends into a ConnectRequest.
func (m message) request() (*pb.ConnectRequest, error) {
	if m.log != nil {
		record := &pb.LogRecord{
			InvocationId: m.id,
			Level:        logLevels[m.log.level],
			Message:      m.log.message,
			Time:         timestamppb.New(m.log.time),
		}
		if m.log.event {
			record.Posting = pb.EventPosting_EVENT_POSTING_ALWAYS
			record.Reason = m.log.reason
			record.EventType = m.log.eventType
		}
		return &pb.ConnectRequest{Message: &pb.ConnectRequest_Log{Log: record}}, nil
	}
	patches, err := m.patch.messages()
	if err != nil {
		return nil, err
	}
	return &pb.ConnectRequest{Message: &pb.ConnectRequest_Update{Update: &pb.InvocationUpdate{
		InvocationId: m.id, Patches: patches,
	}}}, nil
}

// credentials returns the wire form of a login handler's credentials.
func (c *Credentials) message() *pb.Credentials {
	out := &pb.Credentials{
		Server: c.Server, CertificateAuthority: c.CertificateAuthority, Insecure: c.Insecure,
		Username: c.Username, Password: c.Password, Token: c.Token,
		ClientCertificate: c.ClientCertificate, ClientKey: c.ClientKey,
		DefaultNamespace: c.DefaultNamespace, Priority: c.Priority,
	}
	if !c.Expiration.IsZero() {
		out.ExpirationTime = timestamppb.New(c.Expiration)
	}
	return out
}
