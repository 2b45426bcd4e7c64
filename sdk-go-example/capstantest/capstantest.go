// Package capstantest runs Capstan handlers in tests without a cluster, as net/http/httptest
// runs HTTP handlers without a network.
//
// A [Controller] is an in-process fake of the Capstan controller: it serves the real gRPC
// protocol (capstan.v1 RuntimeService) on a Unix socket of its own, so the code under test is
// the real [capstan.Registry.Run] loop — handshake, dispatch, results, patches, cancellation,
// daemons with live bodies, sub-handlers and reconnection — with no Kubernetes behind it. The
// test decides what the controller sends (an invocation of a handler, a cancel, a newer body,
// a ping, a dropped stream) and inspects what comes back ([Result]).
//
//	ctl := capstantest.NewController(t)
//	ctl.Serve(t, registry())                  // runs Registry.Run until the test ends
//	res := ctl.Invoke(t, capstantest.Invocation{
//		Handler: "create_fn",
//		Body:    map[string]any{"metadata": map[string]any{"name": "one"}, "spec": map[string]any{"size": 3}},
//	})
//	if res.Outcome != capstantest.Success || res.Patch.Object["metadata"] == nil { ... }
//
// The payload of each invocation matches the handler's kind as registered in Hello (a change
// with a reason for change handlers, an event type for event handlers, an activity for
// startup, cleanup and login handlers, ...). Declarative filters are not evaluated: the fake
// invokes what the test asks for; the [capstan.When] filter runs, as it does in production.
package capstantest

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"capstan.dev/sdk-go-example/capstan"
	pb "capstan.dev/sdk-go-example/gen/capstan/v1"
)

// Wait bounds every wait of the fake controller; a test that waits longer fails.
var Wait = 10 * time.Second

// maxMessageBytes is the protocol's message size limit (16 MiB).
const maxMessageBytes = 16 << 20

// Controller is a fake Capstan controller on a real Unix socket. Create it with
// [NewController]; it stops when the test ends.
type Controller struct {
	// Endpoint is the address to pass to [capstan.Registry.Run].
	Endpoint string

	conns chan *conn

	mu       sync.Mutex
	rejected map[string]string
	cur      *conn
	nextID   int
	logs     []Log
	goodbyes int
	// cleanupGoodbyes counts the goodbyes that asked for the process's cleanup handlers.
	cleanupGoodbyes int
}

// NewController starts a fake controller that serves until the test ends.
func NewController(t testing.TB) *Controller {
	t.Helper()
	dir, err := os.MkdirTemp("", "capstantest-") // short: socket paths are limited to ~100 bytes
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	socket := filepath.Join(dir, "c.sock")
	lis, err := net.Listen("unix", socket)
	if err != nil {
		t.Fatal(err)
	}
	c := &Controller{Endpoint: "unix://" + socket, conns: make(chan *conn, 8), rejected: map[string]string{}}
	srv := grpc.NewServer(grpc.MaxRecvMsgSize(maxMessageBytes), grpc.MaxSendMsgSize(maxMessageBytes))
	pb.RegisterRuntimeServiceServer(srv, &server{c: c})
	go func() { _ = srv.Serve(lis) }()
	t.Cleanup(srv.Stop)
	return c
}

// Reject makes the controller reject the registration of handlerID in its next welcomes, with
// the diagnostic reason (e.g. "UNSUPPORTED_HANDLER_KIND"), as a controller that does not run
// a kind does. When no registration is left, the stream ends with FAILED_PRECONDITION.
func (c *Controller) Reject(handlerID, reason string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.rejected[handlerID] = reason
}

// Process is a [capstan.Registry.Run] started by [Controller.Serve].
type Process struct {
	cancel context.CancelFunc
	done   chan error
	err    error
	ended  bool
}

// Serve runs reg.Run against the controller until the test ends (or [Process.Stop]) and waits
// for its handshake. Unless set, the registry's logger is silenced and its reconnect delays
// are shortened to a few milliseconds.
func (c *Controller) Serve(t testing.TB, reg *capstan.Registry) *Process {
	t.Helper()
	if reg.Logger == nil {
		reg.Logger = slog.New(slog.NewTextHandler(io.Discard, nil))
	}
	if reg.ReconnectDelay == 0 {
		reg.ReconnectDelay, reg.MaxReconnectDelay = 10*time.Millisecond, 50*time.Millisecond
	}
	ctx, cancel := context.WithCancel(context.Background())
	p := &Process{cancel: cancel, done: make(chan error, 1)}
	go func() { p.done <- reg.Run(ctx, c.Endpoint) }()
	t.Cleanup(func() {
		if _, err := p.wait(); err != nil {
			t.Errorf("capstantest: %v", err)
		}
	})
	c.WaitConnected(t)
	return p
}

// Stop cancels Run's context, as a SIGTERM does, and returns Run's error.
func (p *Process) Stop(t testing.TB) error {
	t.Helper()
	err, waitErr := p.wait()
	if waitErr != nil {
		t.Fatalf("capstantest: %v", waitErr)
	}
	return err
}

// Done returns Run's error once Run has returned by itself, e.g. after the controller rejected
// every handler; ok is false while Run is still running after [Wait].
func (p *Process) Done() (err error, ok bool) {
	if p.ended {
		return p.err, true
	}
	select {
	case p.err = <-p.done:
		p.ended = true
		return p.err, true
	case <-time.After(Wait):
		return nil, false
	}
}

func (p *Process) wait() (error, error) {
	p.cancel()
	if p.ended {
		return p.err, nil
	}
	select {
	case p.err = <-p.done:
		p.ended = true
		return p.err, nil
	case <-time.After(3 * Wait):
		return nil, errors.New("capstan.Registry.Run did not return after its context was cancelled")
	}
}

// conn is one Connect stream as the fake controller sees it.
type conn struct {
	stream grpc.BidiStreamingServer[pb.ConnectRequest, pb.ConnectResponse]
	hello  Hello
	kinds  map[string]capstan.Kind
	params map[string]*pb.Json
	end    chan error
	closed chan struct{}

	sendMu sync.Mutex
	mu     sync.Mutex
	calls  map[string]*Running
	pongs  chan *pb.Pong
}

// server is the gRPC service of a Controller (kept out of its exported API).
type server struct {
	pb.UnimplementedRuntimeServiceServer
	c *Controller
}

// Connect serves one handler process: the handshake, then a reader that routes what the
// process sends to the invocations waiting for it.
func (s *server) Connect(stream grpc.BidiStreamingServer[pb.ConnectRequest, pb.ConnectResponse]) error {
	c := s.c
	first, err := stream.Recv()
	if err != nil {
		return err
	}
	hello := first.GetHello()
	if hello == nil {
		return status.Error(codes.InvalidArgument, "the first message must be hello")
	}
	cn := &conn{stream: stream, end: make(chan error, 1), closed: make(chan struct{}),
		calls: map[string]*Running{}, pongs: make(chan *pb.Pong, 8),
		kinds: map[string]capstan.Kind{}, params: map[string]*pb.Json{}}
	cn.hello = helloOf(hello)
	welcome := &pb.Welcome{ConnectionId: "capstantest", Capabilities: hello.GetCapabilities(),
		Runtime: &pb.SoftwareInfo{Name: "capstantest", Language: "go"}, Limits: &pb.Limits{MaxInFlight: 256}}
	accepted := 0
	c.mu.Lock()
	for _, h := range hello.GetHandlers() {
		st := &pb.RegistrationStatus{HandlerId: h.GetHandlerId(), Accepted: true}
		if reason, ok := c.rejected[h.GetHandlerId()]; ok {
			st.Accepted = false
			st.Diagnostics = []*pb.Diagnostic{{Severity: pb.Severity_SEVERITY_ERROR, Reason: reason,
				Summary: "rejected by the test"}}
		} else {
			accepted++
			cn.kinds[h.GetHandlerId()] = kindOf[h.GetKind()]
			cn.params[h.GetHandlerId()] = h.GetParam()
		}
		welcome.Registrations = append(welcome.Registrations, st)
	}
	c.mu.Unlock()
	if accepted == 0 {
		return status.Error(codes.FailedPrecondition, "NO_HANDLERS_ACCEPTED: every registration was rejected")
	}
	if err := stream.Send(&pb.ConnectResponse{Message: &pb.ConnectResponse_Welcome{Welcome: welcome}}); err != nil {
		return err
	}
	go c.read(cn)
	c.mu.Lock()
	c.cur = cn
	c.mu.Unlock()
	c.conns <- cn
	select {
	case err := <-cn.end:
		return err
	case <-cn.closed:
		return nil
	case <-stream.Context().Done():
		return nil
	}
}

// read routes the messages of one handler process until its side of the stream ends.
func (c *Controller) read(cn *conn) {
	defer close(cn.closed)
	for {
		m, err := cn.stream.Recv()
		if err != nil {
			cn.mu.Lock()
			for _, r := range cn.calls {
				r.fail(fmt.Errorf("the stream ended before the result: %v", err))
			}
			cn.mu.Unlock()
			return
		}
		switch msg := m.GetMessage().(type) {
		case *pb.ConnectRequest_Result:
			if r := cn.take(msg.Result.GetInvocationId()); r != nil {
				r.done <- resultOf(msg.Result)
			}
			cn.ack(msg.Result.GetInvocationId())
		case *pb.ConnectRequest_Update:
			if r := cn.get(msg.Update.GetInvocationId()); r != nil {
				select {
				case r.updates <- patchOf(msg.Update.GetPatches()):
				default: // a test that does not read updates must not block the stream
				}
			}
		case *pb.ConnectRequest_Log:
			l := logOf(msg.Log)
			c.mu.Lock()
			c.logs = append(c.logs, l)
			c.mu.Unlock()
			if r := cn.get(l.Invocation); r != nil {
				r.mu.Lock()
				r.logs = append(r.logs, l)
				r.mu.Unlock()
			}
		case *pb.ConnectRequest_Pong:
			select {
			case cn.pongs <- msg.Pong:
			default:
			}
		case *pb.ConnectRequest_Goodbye:
			c.mu.Lock()
			c.goodbyes++
			if msg.Goodbye.GetCleanup() {
				c.cleanupGoodbyes++
			}
			c.mu.Unlock()
			if msg.Goodbye.GetCleanup() {
				// The fake runs no handler by itself (Invoke cleanup handlers explicitly): the
				// cleanup asked for is done at once.
				_ = cn.send(&pb.ConnectResponse{Message: &pb.ConnectResponse_Farewell{
					Farewell: &pb.Farewell{Reason: "capstantest runs no cleanup handlers by itself"},
				}})
			}
		}
	}
}

// ack acknowledges a result, as the controller does with CAPABILITY_RESULT_ACK.
func (cn *conn) ack(id string) {
	cn.send(&pb.ConnectResponse{Message: &pb.ConnectResponse_ResultAck{ResultAck: &pb.ResultAck{
		InvocationId: id, Accepted: true,
	}}})
}

func (cn *conn) send(m *pb.ConnectResponse) error {
	cn.sendMu.Lock()
	defer cn.sendMu.Unlock()
	return cn.stream.Send(m)
}

func (cn *conn) get(id string) *Running {
	cn.mu.Lock()
	defer cn.mu.Unlock()
	return cn.calls[id]
}

func (cn *conn) take(id string) *Running {
	cn.mu.Lock()
	defer cn.mu.Unlock()
	r := cn.calls[id]
	delete(cn.calls, id)
	return r
}

// WaitConnected waits for the next handshake of a handler process (the first, or the one after
// a [Controller.Drop]) and returns its hello.
func (c *Controller) WaitConnected(t testing.TB) Hello {
	t.Helper()
	select {
	case cn := <-c.conns:
		return cn.hello
	case <-time.After(Wait):
		t.Fatal("capstantest: no handler process connected")
		return Hello{}
	}
}

// current returns the current connection.
func (c *Controller) current(t testing.TB) *conn {
	t.Helper()
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.cur == nil {
		t.Fatal("capstantest: no handler process is connected")
	}
	return c.cur
}

// Hello returns the hello of the current connection.
func (c *Controller) Hello(t testing.TB) Hello {
	t.Helper()
	return c.current(t).hello
}

// Invoke sends an invocation and waits for its result.
func (c *Controller) Invoke(t testing.TB, inv Invocation) Result {
	t.Helper()
	return c.Start(t, inv).Wait(t)
}

// Start sends an invocation and returns at once; use it for daemons and other long handlers.
func (c *Controller) Start(t testing.TB, inv Invocation) *Running {
	t.Helper()
	cn := c.current(t)
	c.mu.Lock()
	c.nextID++
	id := "inv-" + strconv.Itoa(c.nextID)
	c.mu.Unlock()
	m, err := inv.message(id, cn.kinds[inv.Handler], cn.params[inv.Handler])
	if err != nil {
		t.Fatalf("capstantest: %v", err)
	}
	r := &Running{ID: id, cn: cn, done: make(chan Result, 1), updates: make(chan Patch, 64)}
	cn.mu.Lock()
	cn.calls[id] = r
	cn.mu.Unlock()
	if err := cn.send(&pb.ConnectResponse{Message: &pb.ConnectResponse_Invocation{Invocation: m}}); err != nil {
		t.Fatalf("capstantest: sending the invocation: %v", err)
	}
	return r
}

// ObjectGone tells the process that the object with uid is gone, as the controller does once it
// saw the object deleted.
func (c *Controller) ObjectGone(t testing.TB, uid string) {
	t.Helper()
	gone := &pb.ObjectGone{Object: &pb.ResourceRef{Uid: uid}}
	if err := c.current(t).send(&pb.ConnectResponse{Message: &pb.ConnectResponse_ObjectGone{ObjectGone: gone}}); err != nil {
		t.Fatalf("capstantest: object gone: %v", err)
	}
}

// Ping sends a ping and returns the in-flight count of the pong.
func (c *Controller) Ping(t testing.TB) int {
	t.Helper()
	cn := c.current(t)
	if err := cn.send(&pb.ConnectResponse{Message: &pb.ConnectResponse_Ping{Ping: &pb.Ping{Nonce: 7}}}); err != nil {
		t.Fatalf("capstantest: ping: %v", err)
	}
	select {
	case p := <-cn.pongs:
		return int(p.GetInFlight())
	case <-time.After(Wait):
		t.Fatal("capstantest: no pong")
		return 0
	}
}

// Drop ends the current stream as a lost connection does (UNAVAILABLE); the process cancels
// its running invocations and reconnects. Wait for that with [Controller.WaitConnected].
func (c *Controller) Drop(t testing.TB) {
	t.Helper()
	c.current(t).end <- status.Error(codes.Unavailable, "dropped by the test")
	c.mu.Lock()
	c.cur = nil
	c.mu.Unlock()
}

// Logs returns every log record received so far, in order.
func (c *Controller) Logs() []Log {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]Log(nil), c.logs...)
}

// Goodbyes returns how many goodbyes handler processes have sent.
func (c *Controller) Goodbyes() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.goodbyes
}

// CleanupGoodbyes returns how many goodbyes asked for the process's cleanup handlers (a
// process with cleanup handlers does, stopping before the controller); the fake answers each
// with a farewell at once.
func (c *Controller) CleanupGoodbyes() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.cleanupGoodbyes
}

// Running is an invocation that was sent and has not necessarily answered yet.
type Running struct {
	// ID is the invocation id.
	ID string

	cn      *conn
	done    chan Result
	updates chan Patch
	mu      sync.Mutex
	logs    []Log
	result  *Result
}

func (r *Running) fail(err error) {
	select {
	case r.done <- Result{Outcome: Lost, Message: err.Error()}:
	default:
	}
}

// Wait waits for the result.
func (r *Running) Wait(t testing.TB) Result {
	t.Helper()
	if r.result != nil {
		return *r.result
	}
	select {
	case res := <-r.done:
		r.mu.Lock()
		res.Logs = append([]Log(nil), r.logs...)
		r.mu.Unlock()
		r.result = &res
		return res
	case <-time.After(Wait):
		t.Fatalf("capstantest: no result for %s", r.ID)
		return Result{}
	}
}

// Cancel asks the handler process to stop the invocation, as the controller does when a
// daemon's object is deleted, a deadline passes or it stops.
func (r *Running) Cancel(t testing.TB, reason capstan.CancelReason) {
	t.Helper()
	m := &pb.Cancel{InvocationId: r.ID, Reason: cancelReasons[reason]}
	if err := r.cn.send(&pb.ConnectResponse{Message: &pb.ConnectResponse_Cancel{Cancel: m}}); err != nil {
		t.Fatalf("capstantest: cancel: %v", err)
	}
}

// UpdateBody sends the object's newer body to the running invocation, as the controller does
// for daemons when their object changes.
func (r *Running) UpdateBody(t testing.TB, body map[string]any) {
	t.Helper()
	raw, err := json.Marshal(body)
	if err != nil {
		t.Fatalf("capstantest: encoding the body: %v", err)
	}
	m := &pb.ObjectUpdate{InvocationId: r.ID, Body: &pb.Json{Json: raw}}
	if err := r.cn.send(&pb.ConnectResponse{Message: &pb.ConnectResponse_ObjectUpdate{ObjectUpdate: m}}); err != nil {
		t.Fatalf("capstantest: object update: %v", err)
	}
}

// NextUpdate waits for the next interim patch the invocation sends ([capstan.Invocation.SendPatch]).
func (r *Running) NextUpdate(t testing.TB) Patch {
	t.Helper()
	select {
	case p := <-r.updates:
		return p
	case <-time.After(Wait):
		t.Fatalf("capstantest: no update from %s", r.ID)
		return Patch{}
	}
}
