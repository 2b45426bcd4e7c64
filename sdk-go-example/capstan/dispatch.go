package capstan

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"runtime/debug"
	"strings"
	"time"

	"google.golang.org/protobuf/types/known/durationpb"

	pb "capstan.dev/sdk-go-example/gen/capstan/v1"
)

// This file runs one invocation, from the decoded [Invocation] to its InvocationResult: the
// When filter, the handler, the sub-handlers it declared, and the classification of the
// outcome as kopf classifies it. Exactly one result per invocation, whatever happens; patches
// ride only with a success.

// subhandler is one sub-handler declared by a running parent.
type subhandler struct {
	spec spec
	fn   HandlerFunc
}

// dispatch runs h for inv and returns the result (without its id and duration).
func dispatch(ctx context.Context, h *handler, inv *Invocation, states []*pb.SubhandlerState) *pb.InvocationResult {
	if h.spec.kind == KindIndex && inv.IndexDeleted {
		// The object left the index: its entries go, and the handler is not called (kopf).
		if x := inv.indexes.get(h.spec.id); x != nil {
			x.drop(inv.objectKey())
		}
		return &pb.InvocationResult{Outcome: &pb.InvocationResult_Success{Success: &pb.Success{}}}
	}
	if h.spec.when != nil && !h.spec.when(inv) {
		if h.spec.kind == KindIndex {
			// kopf: an object the index handler's filters reject is not in that index.
			if x := inv.indexes.get(h.spec.id); x != nil {
				x.drop(inv.objectKey())
			}
		}
		return &pb.InvocationResult{Outcome: &pb.InvocationResult_Skipped{Skipped: &pb.Skipped{}}}
	}
	value, err := call(ctx, h.fn, inv)
	if h.spec.kind == KindIndex {
		foldIndex(ctx, h, inv, value, err)
	}
	res := &pb.InvocationResult{}
	if h.spec.kind.IsAdmission() {
		if verdict, ok := admissionVerdict(ctx, inv, err); ok {
			res.Outcome = &pb.InvocationResult_Success{Success: &pb.Success{
				KindResult: &pb.Success_Admission{Admission: verdict}}}
			if verdict.GetAllowed() {
				if res.Patches, err = inv.patch.messages(); err == nil {
					return res
				}
				res.Outcome = nil
			} else {
				return res
			}
		}
	}
	if err == nil {
		var success *pb.Success
		success, err = encodeSuccess(value, h.spec.kind)
		if err != nil {
			err = fmt.Errorf("handler %q returned a value that is not JSON-serialisable: %w", h.spec.id, err)
			if h.spec.kind == KindIndex {
				// It would fail the same way every time: the object stays out of the index.
				err = Permanentf("%v", err)
			}
		} else {
			res.Outcome = &pb.InvocationResult_Success{Success: success}
			if res.Patches, err = inv.patch.messages(); err == nil {
				var byID map[string]*pb.SubhandlerState
				if len(states) > 0 {
					byID = make(map[string]*pb.SubhandlerState, len(states))
					for _, st := range states {
						byID[st.GetSubhandlerId()] = st
					}
				}
				var p []*pb.Patch
				var interrupted bool
				res.Subhandlers, p, _, interrupted = runSubhandlers(ctx, inv, "", byID)
				if interrupted {
					// Cancelled while its sub-handlers ran: the parent is not finished, and the
					// sub-handlers left run on its next call.
					res.Subhandlers, res.Patches = nil, nil
					res.Outcome = &pb.InvocationResult_Cancelled{Cancelled: &pb.Cancelled{}}
					return res
				}
				res.Patches = append(res.Patches, p...)
				return res
			}
		}
	}
	res.Patches = nil
	switch f := classify(ctx, err).(type) {
	case *pb.TemporaryError:
		res.Outcome = &pb.InvocationResult_TemporaryError{TemporaryError: f}
	case *pb.PermanentError:
		res.Outcome = &pb.InvocationResult_PermanentError{PermanentError: f}
	case *pb.UnclassifiedError:
		res.Outcome = &pb.InvocationResult_UnclassifiedError{UnclassifiedError: f}
	default:
		res.Outcome = &pb.InvocationResult_Cancelled{Cancelled: &pb.Cancelled{}}
	}
	return res
}

// foldIndex applies an index handler's outcome to its index, with kopf's rules: a result is
// folded in; a failure drops the object's entries, except an unclassified error under the
// IGNORED errors mode (the default of index handlers), which keeps them.
func foldIndex(ctx context.Context, h *handler, inv *Invocation, value any, err error) {
	x := inv.indexes.get(h.spec.id)
	if x == nil {
		return
	}
	if err == nil {
		if _, encodeErr := encodeSuccess(value, KindIndex); encodeErr == nil {
			x.fold(inv.objectKey(), value)
			return
		}
	} else if _, unclassified := classify(ctx, err).(*pb.UnclassifiedError); unclassified &&
		(h.spec.errors == "" || h.spec.errors == ErrorsIgnored) {
		return
	}
	x.drop(inv.objectKey())
}

// objectKey identifies the invocation's object in an index.
func (inv *Invocation) objectKey() objectKey {
	return objectKey{namespace: inv.Resource.Namespace, name: inv.Resource.Name, uid: inv.Resource.UID}
}

// runSubhandlers runs the sub-handlers that parent declared and that are not finished,
// returning their outcomes (ids relative to the top-level handler), the patches of those that
// succeeded, whether all of them are finished, and whether ctx stopped them (a sub-handler cut
// short, or some left unrun: the parent then answers cancelled). A sub-handler that declared
// sub-handlers of its own is reported only once those are finished; until then it runs again
// with its parent.
func runSubhandlers(ctx context.Context, parent *Invocation, prefix string, states map[string]*pb.SubhandlerState) (
	outcomes []*pb.SubhandlerOutcome, patches []*pb.Patch, finished, interrupted bool) {
	finished = true
	for _, sub := range parent.takeSubhandlers() {
		if ctx.Err() != nil {
			return outcomes, patches, false, true
		}
		id := prefix + sub.spec.id
		st := states[id]
		if st.GetSuccess() || st.GetFailure() {
			continue
		}
		if t := st.GetDelayedUntil(); t != nil && time.Until(t.AsTime()) > 0 {
			finished = false
			continue
		}
		child := parent.child(sub.spec.id, st)
		if sub.spec.when != nil && !sub.spec.when(child) {
			continue
		}
		outcome := &pb.SubhandlerOutcome{SubhandlerId: id}
		var err error
		if sub.spec.timeout > 0 && child.Runtime() > sub.spec.timeout {
			err = Permanentf("timed out after %s", sub.spec.timeout)
		} else {
			var value any
			value, err = call(ctx, sub.fn, child)
			if err == nil {
				var success *pb.Success
				if success, err = encodeSuccess(value, KindCreate); err == nil {
					var own []*pb.Patch
					if own, err = child.patch.messages(); err == nil {
						more, morePatches, done, stopped := runSubhandlers(ctx, child, id+"/", states)
						if stopped {
							return outcomes, patches, false, true
						}
						outcomes = append(outcomes, more...)
						patches = append(append(patches, own...), morePatches...)
						if !done {
							finished = false
							continue
						}
						outcome.Outcome = &pb.SubhandlerOutcome_Success{Success: success}
						outcomes = append(outcomes, outcome)
						continue
					}
				}
			}
		}
		if ctx.Err() != nil {
			return outcomes, patches, false, true
		}
		switch f := sub.spec.judge(classify(ctx, err), int(st.GetRetries())).(type) {
		case *pb.TemporaryError:
			outcome.Outcome = &pb.SubhandlerOutcome_TemporaryError{TemporaryError: f}
			finished = false
		case *pb.PermanentError:
			outcome.Outcome = &pb.SubhandlerOutcome_PermanentError{PermanentError: f}
		case *pb.UnclassifiedError:
			outcome.Outcome = &pb.SubhandlerOutcome_UnclassifiedError{UnclassifiedError: f}
			finished = false
		case *pb.Success:
			outcome.Outcome = &pb.SubhandlerOutcome_Success{Success: f}
		}
		outcomes = append(outcomes, outcome)
	}
	return outcomes, patches, finished, false
}

// child returns the invocation of a sub-handler of inv.
func (inv *Invocation) child(id string, st *pb.SubhandlerState) *Invocation {
	c := &Invocation{
		ID: inv.ID, HandlerID: inv.HandlerID + "/" + id, Kind: inv.Kind,
		Attempt: int(st.GetRetries()) + 1, Retry: int(st.GetRetries()), IdempotencyKey: inv.IdempotencyKey + "/" + id,
		Started: time.Now(), Resource: inv.Resource, Reason: inv.Reason, Old: inv.Old, New: inv.New,
		Diff: inv.Diff, Field: inv.Field, Param: inv.Param, Traceparent: inv.Traceparent,
		logger: inv.logger, send: inv.send, memos: inv.memos, canDeclare: true,
	}
	if t := st.GetStartedTime(); t != nil {
		c.Started = t.AsTime()
	}
	if msg := st.GetMessage(); msg != "" {
		c.LastError = &Diagnostic{Summary: msg}
	}
	c.body.Store(inv.body.Load())
	c.cancelReason = inv.CancelReason()
	return c
}

// judge applies a sub-handler's own options to its failure: its errors mode and backoff to an
// unclassified error, and its retry limit to any retryable failure. The controller judges the
// result further with the parent's registration.
func (s *spec) judge(failure any, retries int) any {
	if u, ok := failure.(*pb.UnclassifiedError); ok {
		switch s.errors {
		case ErrorsIgnored:
			return &pb.Success{}
		case ErrorsPermanent:
			failure = &pb.PermanentError{Diagnostics: u.GetDiagnostics()}
		case ErrorsTemporary:
			failure = &pb.TemporaryError{Diagnostics: u.GetDiagnostics(), RetryAfter: duration(s.backoff)}
		default:
			if s.backoff > 0 {
				failure = &pb.TemporaryError{Diagnostics: u.GetDiagnostics(), RetryAfter: duration(s.backoff)}
			}
		}
	}
	if s.retries > 0 && retries+1 >= int(s.retries) {
		var diags []*pb.Diagnostic
		switch f := failure.(type) {
		case *pb.TemporaryError:
			diags = f.GetDiagnostics()
		case *pb.UnclassifiedError:
			diags = f.GetDiagnostics()
		default:
			return failure
		}
		if len(diags) > 0 {
			diags[0].Summary = fmt.Sprintf("%s (retries exhausted after %d attempts)", diags[0].GetSummary(), retries+1)
		}
		return &pb.PermanentError{Diagnostics: diags}
	}
	return failure
}

// call calls a handler and turns a panic into an error.
func call(ctx context.Context, fn HandlerFunc, inv *Invocation) (value any, err error) {
	defer func() {
		if r := recover(); r != nil {
			value, err = nil, &panicError{value: r, stack: debug.Stack()}
		}
	}()
	return fn(ctx, inv)
}

// classify turns a handler's error into a failure message, as kopf classifies errors:
//
//   - the context was cancelled (by the controller, the deadline, a lost stream or shutdown)
//     and the handler returned an error: nil (cancelled), as the Rust SDK answers;
//   - a [TemporaryError] in the chain: TemporaryError with retry_after = Delay;
//   - a [PermanentError] in the chain: PermanentError;
//   - anything else, a recovered panic included: UnclassifiedError.
func classify(ctx context.Context, err error) any {
	var temporary *TemporaryError
	var permanent *PermanentError
	switch {
	case ctx.Err() != nil:
		return nil
	case errors.As(err, &temporary):
		var delay *durationpb.Duration
		if temporary.Delay > 0 {
			delay = durationpb.New(temporary.Delay)
		}
		return &pb.TemporaryError{RetryAfter: delay, Diagnostics: diagnostics(err, "TEMPORARY_ERROR")}
	case errors.As(err, &permanent):
		return &pb.PermanentError{Diagnostics: diagnostics(err, "PERMANENT_ERROR")}
	}
	return &pb.UnclassifiedError{Diagnostics: diagnostics(err, "HANDLER_ERROR")}
}

// admissionVerdict is the verdict of an admission handler that returned err: admitted (nil),
// denied (an [AdmissionError]), or no verdict (any other error, which fails the request).
func admissionVerdict(ctx context.Context, inv *Invocation, err error) (*pb.AdmissionVerdict, bool) {
	var denial *AdmissionError
	switch {
	case err == nil:
		return &pb.AdmissionVerdict{Allowed: true, Warnings: inv.takeWarnings()}, true
	case ctx.Err() == nil && errors.As(err, &denial):
		return &pb.AdmissionVerdict{Allowed: false, Message: denial.Message, Code: denial.Code,
			Warnings: inv.takeWarnings()}, true
	}
	return nil, false
}

// encodeSuccess encodes a handler's return value: credentials for login handlers, JSON for
// the others (nil and JSON null are no result).
func encodeSuccess(value any, kind Kind) (*pb.Success, error) {
	success := &pb.Success{}
	if kind == KindLogin {
		switch c := value.(type) {
		case *Credentials:
			if c != nil {
				success.KindResult = &pb.Success_Credentials{Credentials: c.message()}
			}
			return success, nil
		case Credentials:
			success.KindResult = &pb.Success_Credentials{Credentials: c.message()}
			return success, nil
		}
	}
	if value == nil {
		return success, nil
	}
	body, err := json.Marshal(value)
	if err != nil {
		return nil, fmt.Errorf("encoding the result: %w", err)
	}
	if string(body) != "null" {
		success.Result = &pb.Json{Json: body}
	}
	return success, nil
}

// diagnostics describes an error: its first line as the summary, the rest as the detail, its
// Go type, and for a panic the stack trace.
func diagnostics(err error, reason string) []*pb.Diagnostic {
	summary, detail, _ := strings.Cut(err.Error(), "\n")
	d := &pb.Diagnostic{
		Severity:  pb.Severity_SEVERITY_ERROR,
		Summary:   summary,
		Detail:    detail,
		Reason:    reason,
		ErrorType: fmt.Sprintf("%T", err),
	}
	var p *panicError
	if errors.As(err, &p) {
		d.ErrorType = "panic"
		d.Reason = "HANDLER_PANIC"
		d.StackTrace = string(p.stack)
	}
	return []*pb.Diagnostic{d}
}
