package capstan

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"time"

	"google.golang.org/protobuf/types/known/durationpb"

	pb "capstan.dev/sdk-go-example/gen/capstan/v1"
)

// result builds the one InvocationResult of a finished call, as kopf classifies outcomes:
//
//   - no error: success with the JSON-encoded value (unless nil) and the patches;
//   - the handler's context was cancelled and it returned the context's error: cancelled;
//   - a [TemporaryError] in the chain: temporary_error with retry_after = Delay;
//   - a [PermanentError] in the chain: permanent_error;
//   - anything else, a recovered panic included: unclassified_error.
//
// stopped says whether the handler's context was done when it returned.
func result(id string, value any, err error, patch *Patch, stopped bool, took time.Duration) *pb.InvocationResult {
	res := &pb.InvocationResult{InvocationId: id, Duration: durationpb.New(took)}
	if err == nil {
		success, patches, encErr := encodeSuccess(value, patch)
		if encErr == nil {
			res.Outcome = &pb.InvocationResult_Success{Success: success}
			res.Patches = patches
			return res
		}
		err = encErr
	}
	var temporary *TemporaryError
	var permanent *PermanentError
	switch {
	case stopped && (errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded)):
		res.Outcome = &pb.InvocationResult_Cancelled{Cancelled: &pb.Cancelled{}}
	case errors.As(err, &temporary):
		outcome := &pb.TemporaryError{Diagnostics: diagnostics(err)}
		if temporary.Delay > 0 {
			outcome.RetryAfter = durationpb.New(temporary.Delay)
		}
		res.Outcome = &pb.InvocationResult_TemporaryError{TemporaryError: outcome}
	case errors.As(err, &permanent):
		res.Outcome = &pb.InvocationResult_PermanentError{
			PermanentError: &pb.PermanentError{Diagnostics: diagnostics(err)},
		}
	default:
		res.Outcome = &pb.InvocationResult_UnclassifiedError{
			UnclassifiedError: &pb.UnclassifiedError{Diagnostics: diagnostics(err)},
		}
	}
	return res
}

// encodeSuccess encodes a handler's return value and patches.
func encodeSuccess(value any, patch *Patch) (*pb.Success, []*pb.Patch, error) {
	success := &pb.Success{}
	if value != nil {
		body, err := json.Marshal(value)
		if err != nil {
			return nil, nil, fmt.Errorf("encoding the result: %w", err)
		}
		if string(body) != "null" {
			success.Result = &pb.Json{Json: body}
		}
	}
	patches, err := patch.messages()
	if err != nil {
		return nil, nil, err
	}
	return success, patches, nil
}

// diagnostics describes an error: its first line as the summary, the rest as the detail, its
// Go type, and for a panic the stack trace.
func diagnostics(err error) []*pb.Diagnostic {
	summary, detail, _ := strings.Cut(err.Error(), "\n")
	d := &pb.Diagnostic{
		Severity:  pb.Severity_SEVERITY_ERROR,
		Summary:   summary,
		Detail:    detail,
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
