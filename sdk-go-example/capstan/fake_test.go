package capstan

import (
	"context"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	"google.golang.org/grpc"

	pb "capstan.dev/sdk-go-example/gen/capstan/v1"
)

// wait bounds every wait of the tests.
const wait = 5 * time.Second

// fakeController is an in-process RuntimeService on a Unix socket. Every Connect stream is
// handed to the test as a fakeConn, which the test drives message by message.
type fakeController struct {
	pb.UnimplementedRuntimeServiceServer
	conns    chan *fakeConn
	endpoint string
}

// fakeConn is one Connect stream as the fake controller sees it.
type fakeConn struct {
	stream grpc.BidiStreamingServer[pb.ConnectRequest, pb.ConnectResponse]
	in     chan *pb.ConnectRequest // from the handler process; closed when its side ends
	end    chan error              // the status to end the stream with
}

// startFake serves a fake controller until the test ends.
func startFake(t *testing.T) *fakeController {
	t.Helper()
	dir, err := os.MkdirTemp("", "capstan-go-") // short: socket paths are limited to ~100 bytes
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	socket := filepath.Join(dir, "c.sock")
	lis, err := net.Listen("unix", socket)
	if err != nil {
		t.Fatal(err)
	}
	f := &fakeController{conns: make(chan *fakeConn, 8), endpoint: "unix://" + socket}
	srv := grpc.NewServer(grpc.MaxRecvMsgSize(maxMessageBytes), grpc.MaxSendMsgSize(maxMessageBytes))
	pb.RegisterRuntimeServiceServer(srv, f)
	go func() { _ = srv.Serve(lis) }()
	t.Cleanup(srv.Stop)
	return f
}

// Connect hands the stream to the test and ends it when the test says so or the handler
// process closes its side (as the controller does).
func (f *fakeController) Connect(stream grpc.BidiStreamingServer[pb.ConnectRequest, pb.ConnectResponse]) error {
	c := &fakeConn{stream: stream, in: make(chan *pb.ConnectRequest, 64), end: make(chan error, 1)}
	closed := make(chan struct{})
	go func() {
		defer close(closed)
		defer close(c.in)
		for {
			m, err := stream.Recv()
			if err != nil {
				return
			}
			c.in <- m
		}
	}()
	f.conns <- c
	select {
	case err := <-c.end:
		return err
	case <-closed:
		return nil
	case <-stream.Context().Done():
		return nil
	}
}

// accept waits for the next connection.
func (f *fakeController) accept(t *testing.T) *fakeConn {
	t.Helper()
	select {
	case c := <-f.conns:
		return c
	case <-time.After(wait):
		t.Fatal("the handler process did not connect")
		return nil
	}
}

// next returns the next message from the handler process, skipping log records.
func (c *fakeConn) next(t *testing.T) *pb.ConnectRequest {
	t.Helper()
	for {
		select {
		case m, ok := <-c.in:
			if !ok {
				t.Fatal("the handler process closed the stream")
			}
			if m.GetLog() != nil {
				continue
			}
			return m
		case <-time.After(wait):
			t.Fatal("no message from the handler process")
		}
	}
}

// hello reads the handshake.
func (c *fakeConn) hello(t *testing.T) *pb.Hello {
	t.Helper()
	m := c.next(t)
	if m.GetHello() == nil {
		t.Fatalf("first message is %T, want hello", m.GetMessage())
	}
	return m.GetHello()
}

// handshake reads hello and answers welcome, rejecting the given handler ids.
func (c *fakeConn) handshake(t *testing.T, rejected ...string) *pb.Hello {
	t.Helper()
	hello := c.hello(t)
	w := &pb.Welcome{ConnectionId: "1", Capabilities: hello.GetCapabilities()}
	for _, h := range hello.GetHandlers() {
		st := &pb.RegistrationStatus{HandlerId: h.GetHandlerId(), Accepted: true}
		for _, r := range rejected {
			if r == h.GetHandlerId() {
				st.Accepted = false
				st.Diagnostics = []*pb.Diagnostic{{Reason: "UNSUPPORTED_HANDLER_KIND", Summary: "not supported"}}
			}
		}
		w.Registrations = append(w.Registrations, st)
	}
	c.send(t, &pb.ConnectResponse{Message: &pb.ConnectResponse_Welcome{Welcome: w}})
	return hello
}

// send sends one message to the handler process.
func (c *fakeConn) send(t *testing.T, m *pb.ConnectResponse) {
	t.Helper()
	if err := c.stream.Send(m); err != nil {
		t.Fatalf("send: %v", err)
	}
}

// invoke sends an invocation of handler with an object body.
func (c *fakeConn) invoke(t *testing.T, inv *pb.Invocation) {
	t.Helper()
	if inv.Resource == nil {
		inv.Resource = &pb.ResourceRef{Name: "one", Namespace: "default"}
	}
	if inv.Body == nil {
		inv.Body = &pb.Json{Json: []byte(`{"metadata":{"name":"one"},"spec":{"size":3}}`)}
	}
	if inv.Attempt == 0 {
		inv.Attempt = 1
	}
	c.send(t, &pb.ConnectResponse{Message: &pb.ConnectResponse_Invocation{Invocation: inv}})
}

// result reads the next message, which must be a result.
func (c *fakeConn) result(t *testing.T) *pb.InvocationResult {
	t.Helper()
	m := c.next(t)
	if m.GetResult() == nil {
		t.Fatalf("got %T, want a result", m.GetMessage())
	}
	return m.GetResult()
}

// running is a started Registry.Run.
type running struct {
	cancel context.CancelFunc
	done   chan error
}

// run starts reg.Run against the fake controller and stops it when the test ends.
func run(t *testing.T, f *fakeController, reg *Registry) *running {
	t.Helper()
	reg.Logger = slog.New(slog.NewTextHandler(io.Discard, nil))
	reg.minBackoff, reg.maxBackoff = 10*time.Millisecond, 50*time.Millisecond
	ctx, cancel := context.WithCancel(context.Background())
	r := &running{cancel: cancel, done: make(chan error, 1)}
	go func() { r.done <- reg.Run(ctx, f.endpoint) }()
	t.Cleanup(func() {
		cancel()
		select {
		case <-r.done:
		case <-time.After(3 * wait):
			t.Error("Run did not return")
		}
	})
	return r
}

// stopped waits for Run to return and returns its error.
func (r *running) stopped(t *testing.T) error {
	t.Helper()
	select {
	case err := <-r.done:
		r.done <- err // for the cleanup
		return err
	case <-time.After(3 * wait):
		t.Fatal("Run did not return")
		return nil
	}
}

// invocation returns an invocation message of handler with id.
func invocation(id, handler string) *pb.Invocation {
	return &pb.Invocation{InvocationId: id, HandlerId: handler}
}

// one registers a single create handler "fn".
func one(fn HandlerFunc, opts ...Option) *Registry {
	reg := NewRegistry()
	reg.OnCreate("examples.demo.capstan.dev", "fn", fn, opts...)
	return reg
}
