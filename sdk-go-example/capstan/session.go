package capstan

import (
	"context"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/protobuf/types/known/durationpb"

	pb "capstan.dev/sdk-go-example/gen/capstan/v1"
)

// errStreamLost is the context cause of invocations whose stream ended.
var errStreamLost = &CancelledError{Reason: CancelStreamLost}

// errStopping is the context cause of invocations still running when the shutdown grace
// period ran out.
var errStopping = &CancelledError{Reason: CancelProcessStopping}

// stream is the client side of Connect.
type stream = grpc.BidiStreamingClient[pb.ConnectRequest, pb.ConnectResponse]

// session is one Connect stream after the handshake: the reader loop, the invocations
// running on it, and the shutdown. Every connection gets a new session, so results of
// invocations from a lost stream can never reach the next one.
type session struct {
	reg    *Registry
	log    *slog.Logger
	stream stream
	// indexes are this session's own: the controller feeds every object again on a new
	// stream before any other handler runs, and index handlers of a lost stream that answer
	// late fold into the lost stream's indexes, never into these.
	indexes *indexes
	// ctx is the parent of every invocation's context; cancel ends them all.
	ctx    context.Context
	cancel context.CancelCauseFunc

	sendMu sync.Mutex
	closed bool // no more sends: the stream ended or our side was closed

	mu      sync.Mutex
	running map[string]*active
	idle    chan struct{} // closed when running becomes empty; see waitIdle

	// cleanupOnGoodbye: the goodbye asks the controller to run this process's cleanup
	// handlers (CAPABILITY_CLEANUP_ON_GOODBYE is in effect and some are registered).
	cleanupOnGoodbye bool
	// farewell is closed when the controller says the cleanup is done.
	farewell     chan struct{}
	farewellOnce sync.Once
}

// active is one running invocation.
type active struct {
	cancel context.CancelCauseFunc
	inv    *Invocation
}

// newSession wraps a stream whose handshake is done.
func newSession(reg *Registry, s stream) *session {
	ctx, cancel := context.WithCancelCause(context.Background())
	return &session{
		reg:      reg,
		log:      reg.logger(),
		stream:   s,
		indexes:  newIndexes(reg.indexNames),
		ctx:      ctx,
		cancel:   cancel,
		running:  map[string]*active{},
		farewell: make(chan struct{}),
	}
}

// send sends one message. Sends are serialised (gRPC streams allow one sender at a time);
// once the stream has ended they are dropped: the controller redelivers lost work itself.
func (s *session) send(m *pb.ConnectRequest) {
	s.sendMu.Lock()
	defer s.sendMu.Unlock()
	if s.closed {
		return
	}
	if err := s.stream.Send(m); err != nil {
		s.closed = true
		s.log.Debug("capstan: send failed; the stream has ended", "error", err)
	}
}

// sendMessage sends what an invocation sends besides its result.
func (s *session) sendMessage(m message) {
	req, err := m.request()
	if err != nil {
		s.log.Warn("capstan: dropping an unencodable patch", "invocation", m.id, "error", err)
		return
	}
	s.send(req)
}

// serve reads the stream until it ends (returning why) or ctx is cancelled (returning nil
// after a graceful shutdown).
func (s *session) serve(ctx context.Context) error {
	lost := make(chan error, 1)
	go func() { lost <- s.read() }()
	select {
	case err := <-lost:
		s.abandon()
		return err
	case <-ctx.Done():
		s.shutdown(lost)
		return nil
	}
}

// read is the stream reader. It never waits for user code: invocations run in their own
// goroutines, and pings are answered from here.
func (s *session) read() error {
	for {
		m, err := s.stream.Recv()
		if err != nil {
			return err
		}
		switch msg := m.GetMessage().(type) {
		case *pb.ConnectResponse_Invocation:
			s.start(msg.Invocation)
		case *pb.ConnectResponse_Cancel:
			s.cancelOne(msg.Cancel)
		case *pb.ConnectResponse_Ping:
			s.send(&pb.ConnectRequest{Message: &pb.ConnectRequest_Pong{Pong: &pb.Pong{
				Nonce:    msg.Ping.GetNonce(),
				InFlight: uint32(s.inFlight()),
			}}})
		case *pb.ConnectResponse_ObjectUpdate:
			s.updateBody(msg.ObjectUpdate)
		case *pb.ConnectResponse_ObjectGone:
			s.reg.memos.drop(msg.ObjectGone.GetObject().GetUid(), 0)
		case *pb.ConnectResponse_Drain:
			s.log.Info("capstan: the controller is draining; no new invocations will come",
				"reason", msg.Drain.GetReason(), "grace", msg.Drain.GetGracePeriod().AsDuration())
		case *pb.ConnectResponse_ResultAck:
			if !msg.ResultAck.GetAccepted() {
				s.logDiagnostics("capstan: result not accepted", msg.ResultAck.GetInvocationId(),
					msg.ResultAck.GetDiagnostics())
			}
		case *pb.ConnectResponse_Farewell:
			s.log.Info("capstan: the controller ran this process's cleanup", "reason", msg.Farewell.GetReason())
			s.farewellOnce.Do(func() { close(s.farewell) })
		case *pb.ConnectResponse_Notice:
			s.logDiagnostics("capstan: notice from the controller", msg.Notice.GetInvocationId(),
				msg.Notice.GetDiagnostics())
		default:
			// A second welcome or a message of a newer protocol revision: ignored.
			s.log.Debug("capstan: ignoring a message", "type", fmt.Sprintf("%T", msg))
		}
	}
}

// start runs one invocation in its own goroutine and sends its result.
func (s *session) start(m *pb.Invocation) {
	id := m.GetInvocationId()
	h := s.reg.byID[m.GetHandlerId()]
	if h == nil {
		s.reject(id, "UNKNOWN_HANDLER", fmt.Sprintf("no handler %q is registered in this process", m.GetHandlerId()))
		return
	}
	inv, err := newInvocation(m, h.spec.kind)
	if err != nil {
		s.reject(id, "INVALID_INVOCATION", fmt.Sprintf("the invocation carries malformed JSON: %v", err))
		return
	}
	inv.logger, inv.send, inv.memos, inv.indexes = s.log, s.sendMessage, &s.reg.memos, s.indexes

	ctx, cancel := context.WithCancelCause(s.ctx)
	stopDeadline := context.CancelFunc(func() {})
	if deadline := m.GetDeadline(); deadline != nil {
		ctx, stopDeadline = context.WithDeadlineCause(ctx, deadline.AsTime(),
			&CancelledError{Reason: CancelDeadlineExceeded})
	}
	s.mu.Lock()
	s.running[id] = &active{cancel: cancel, inv: inv}
	s.mu.Unlock()

	go func() {
		defer stopDeadline()
		begin := time.Now()
		res := dispatch(ctx, h, inv, m.GetSubhandlers())
		res.InvocationId = id
		res.Duration = durationpb.New(time.Since(begin))
		if f := res.GetUnclassifiedError(); f != nil && len(f.GetDiagnostics()) > 0 &&
			f.GetDiagnostics()[0].GetReason() == "HANDLER_PANIC" {
			d := f.GetDiagnostics()[0]
			s.log.Error("capstan: handler panicked", "handler", inv.HandlerID, "invocation", id,
				"panic", d.GetSummary(), "stack", d.GetStackTrace())
		}
		s.send(&pb.ConnectRequest{Message: &pb.ConnectRequest_Result{Result: res}})
		cancel(nil)
		s.finish(id)
		s.forget(inv, res)
	}()
}

// forget drops the memo of an object that went away: after a DELETED event, and a while after
// a delete handler succeeded.
func (s *session) forget(inv *Invocation, res *pb.InvocationResult) {
	switch {
	case inv.EventType == EventDeleted:
		s.reg.memos.drop(inv.UID(), 0)
	case inv.Reason == ReasonDelete && res.GetSuccess() != nil:
		s.reg.memos.drop(inv.UID(), memoGrace)
	}
}

// updateBody shows a running invocation the latest body of its object.
func (s *session) updateBody(u *pb.ObjectUpdate) {
	s.mu.Lock()
	a := s.running[u.GetInvocationId()]
	s.mu.Unlock()
	if a == nil {
		return // already finished
	}
	body, err := decode(u.GetBody())
	if b, ok := body.(map[string]any); ok && err == nil {
		a.inv.setBody(b)
		return
	}
	s.log.Warn("capstan: ignoring an object update without an object body", "invocation", u.GetInvocationId(),
		"error", err)
}

// reject answers an invocation that cannot run with a permanent error.
func (s *session) reject(id, reason, summary string) {
	s.log.Warn("capstan: rejecting an invocation", "invocation", id, "reason", reason, "summary", summary)
	s.send(&pb.ConnectRequest{Message: &pb.ConnectRequest_Result{Result: &pb.InvocationResult{
		InvocationId: id,
		Outcome: &pb.InvocationResult_PermanentError{PermanentError: &pb.PermanentError{
			Diagnostics: []*pb.Diagnostic{{Severity: pb.Severity_SEVERITY_ERROR, Summary: summary, Reason: reason}},
		}},
	}}})
}

// cancelOne cancels the context of a running invocation; its handler then answers.
func (s *session) cancelOne(c *pb.Cancel) {
	s.mu.Lock()
	a := s.running[c.GetInvocationId()]
	s.mu.Unlock()
	if a == nil {
		return // already finished: its result is on the way
	}
	reason := cancelReasons[c.GetReason()]
	if reason == "" {
		reason = CancelReason(strings.ToLower(strings.TrimPrefix(c.GetReason().String(), "CANCEL_REASON_")))
	}
	a.inv.cancelled(reason)
	a.cancel(&CancelledError{Reason: reason})
	if reason == CancelResourceDeleted {
		s.reg.memos.drop(a.inv.UID(), 0)
	}
}

// finish forgets a finished invocation.
func (s *session) finish(id string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	delete(s.running, id)
	if len(s.running) == 0 && s.idle != nil {
		close(s.idle)
		s.idle = nil
	}
}

// inFlight returns the number of running invocations.
func (s *session) inFlight() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.running)
}

// waitIdle returns a channel that is closed once no invocation runs.
func (s *session) waitIdle() <-chan struct{} {
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(s.running) == 0 {
		done := make(chan struct{})
		close(done)
		return done
	}
	if s.idle == nil {
		s.idle = make(chan struct{})
	}
	return s.idle
}

// abandon ends the session after the stream was lost: no more sends, and every running
// invocation is cancelled (its result is dropped; the controller redelivers the work).
func (s *session) abandon() {
	s.sendMu.Lock()
	s.closed = true
	s.sendMu.Unlock()
	s.cancelAll(errStreamLost)
}

// cancelAll cancels every running invocation with cause.
func (s *session) cancelAll(cause *CancelledError) {
	s.mu.Lock()
	for _, a := range s.running {
		a.inv.cancelled(cause.Reason)
	}
	s.mu.Unlock()
	s.cancel(cause)
}

// cleanupTimeout bounds how long a stopping process waits for the controller to run its
// cleanup handlers (counted from its goodbye; the controller's own bound is its shutdown grace,
// 20 s by default).
const cleanupTimeout = 20 * time.Second

// shutdown says goodbye, lets the running invocations finish within the grace period, cancels
// the rest, sends their results, and closes our side of the stream.
func (s *session) shutdown(lost <-chan error) {
	grace := s.reg.ShutdownGrace
	if grace <= 0 {
		grace = 10 * time.Second
	}
	s.log.Info("capstan: stopping; saying goodbye", "running", s.inFlight(), "cleanup", s.cleanupOnGoodbye)
	s.send(&pb.ConnectRequest{Message: &pb.ConnectRequest_Goodbye{
		Goodbye: &pb.Goodbye{Reason: "the handler process is stopping", Cleanup: s.cleanupOnGoodbye},
	}})
	deadline := time.Now().Add(grace)
	if s.cleanupOnGoodbye {
		// The cleanup handlers come now, on this stream; cancelling what runs would cancel
		// them too, so nothing is cancelled before the controller said they are done (the
		// grace, counted from the goodbye, may have passed by then).
		select {
		case <-s.farewell:
		case <-lost:
			s.abandon()
			return
		case <-time.After(cleanupTimeout):
			s.log.Warn("capstan: the controller did not finish this process's cleanup handlers in time")
		}
	}
	select {
	case <-s.waitIdle():
	case <-lost:
		s.abandon()
		return
	case <-time.After(time.Until(deadline)):
		s.cancelAll(errStopping)
		select {
		case <-s.waitIdle():
		case <-time.After(grace):
			s.log.Warn("capstan: handlers ignored their cancellation", "running", s.inFlight())
		}
	}
	s.sendMu.Lock()
	s.closed = true
	_ = s.stream.CloseSend()
	s.sendMu.Unlock()
	select {
	case <-lost:
	case <-time.After(grace):
	}
	s.cancel(errStopping)
}

// logDiagnostics logs what the controller reported about something this process sent.
func (s *session) logDiagnostics(msg, invocation string, diags []*pb.Diagnostic) {
	for _, d := range diags {
		s.log.Warn(msg, "invocation", invocation, "reason", d.GetReason(), "summary", d.GetSummary(),
			"field", d.GetField(), "detail", d.GetDetail())
	}
}
