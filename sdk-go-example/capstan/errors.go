package capstan

import (
	"fmt"
	"time"
)

// TemporaryError makes the controller retry the handler (kopf TemporaryError): after Delay,
// or after the registration's backoff when Delay is 0. Return it, or an error wrapping it.
type TemporaryError struct {
	// Err says what went wrong.
	Err error
	// Delay is how long to wait before the next attempt; 0 means the handler's backoff.
	Delay time.Duration
}

func (e *TemporaryError) Error() string { return e.Err.Error() }

// Unwrap returns the cause.
func (e *TemporaryError) Unwrap() error { return e.Err }

// Temporaryf returns a [TemporaryError] with a formatted message; %w wraps as in fmt.Errorf.
func Temporaryf(delay time.Duration, format string, args ...any) error {
	return &TemporaryError{Err: fmt.Errorf(format, args...), Delay: delay}
}

// PermanentError records a final failure (kopf PermanentError): the handler is not retried
// until the next change of the object. Return it, or an error wrapping it.
type PermanentError struct {
	// Err says what went wrong.
	Err error
}

func (e *PermanentError) Error() string { return e.Err.Error() }

// Unwrap returns the cause.
func (e *PermanentError) Unwrap() error { return e.Err }

// Permanentf returns a [PermanentError] with a formatted message; %w wraps as in fmt.Errorf.
func Permanentf(format string, args ...any) error {
	return &PermanentError{Err: fmt.Errorf(format, args...)}
}

// AdmissionError denies an admission request (kopf AdmissionError): return it from a validate
// or mutate handler. Other errors of an admission handler fail the request (or, with
// [IgnoreFailures], leave the handler out).
type AdmissionError struct {
	// Message is shown to the user.
	Message string
	// Code is the HTTP status code; 0 means 400.
	Code int32
}

func (e *AdmissionError) Error() string { return "admission denied: " + e.Message }

// Deny returns an [AdmissionError] with HTTP status code and a formatted message.
func Deny(code int32, format string, args ...any) error {
	return &AdmissionError{Message: fmt.Sprintf(format, args...), Code: code}
}

// CancelledError is the cause (see [context.Cause]) of a handler context that was cancelled:
// by the controller's Cancel, because the stream was lost, or because the process is stopping.
type CancelledError struct {
	// Reason says why.
	Reason CancelReason
}

func (e *CancelledError) Error() string { return "capstan: invocation cancelled: " + string(e.Reason) }

// panicError is a recovered panic of a handler.
type panicError struct {
	value any
	stack []byte
}

func (e *panicError) Error() string { return fmt.Sprintf("panic: %v", e.value) }
