package capstan

import (
	"context"
	cryptorand "crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"sort"
	"strings"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/keepalive"
	"google.golang.org/grpc/status"

	pb "capstan.dev/sdk-go-example/gen/capstan/v1"
)

// DefaultEndpoint is where the controller listens unless configured otherwise.
const DefaultEndpoint = "unix:///run/capstan/capstan.sock"

// Version is the version of this package, sent in Hello.
const Version = "0.2.0"

// maxMessageBytes is the protocol's message size limit, both ways (16 MiB).
const maxMessageBytes = 16 << 20

// capabilities are the protocol features this package implements, announced in Hello.
var capabilities = []pb.Capability{
	pb.Capability_CAPABILITY_RESULT_ACK,
	pb.Capability_CAPABILITY_INVOCATION_UPDATES,
	pb.Capability_CAPABILITY_SDK_FILTERS,
	pb.Capability_CAPABILITY_SUBHANDLERS,
	pb.Capability_CAPABILITY_OBJECT_UPDATES,
	pb.Capability_CAPABILITY_OBJECT_GONE,
	pb.Capability_CAPABILITY_CLEANUP_ON_GOODBYE,
}

// handshakeTimeout bounds the wait for Welcome after Hello.
const handshakeTimeout = 30 * time.Second

// Run connects to the controller at endpoint ("unix:///path/to.sock", or "host:port" for a
// development controller on loopback TCP) and serves the registered handlers until ctx is
// cancelled; it then says Goodbye, lets running invocations finish within ShutdownGrace,
// and returns nil.
//
// When the stream is lost, Run cancels the invocations that ran on it and reconnects with
// jittered exponential backoff (250 ms doubling up to 30 s), sending the same Hello. It
// returns an error only when it cannot go on: no handlers, a malformed endpoint, or a
// controller that accepted none of the registrations (FAILED_PRECONDITION).
func (r *Registry) Run(ctx context.Context, endpoint string) error {
	if len(r.handlers) == 0 {
		return errors.New("capstan: no handlers registered")
	}
	regs, err := r.registrations()
	if err != nil {
		return err
	}
	hello := &pb.Hello{
		Capabilities: capabilities,
		Sdk:          &pb.SoftwareInfo{Name: "capstan-sdk-go", Version: Version, Language: "go"},
		InstanceId:   newInstanceID(),
		Handlers:     regs,
		MaxInFlight:  r.MaxInFlight,
	}
	log := r.logger()
	for failures := 0; ; failures++ {
		conn, err := grpc.NewClient(target(endpoint), dialOptions()...)
		if err != nil {
			return fmt.Errorf("capstan: endpoint %q: %w", endpoint, err)
		}
		welcomed, err := r.connect(ctx, conn, hello)
		_ = conn.Close()
		if ctx.Err() != nil {
			return nil
		}
		if status.Code(err) == codes.FailedPrecondition && !onlyTaken(status.Convert(err).Message()) {
			return fmt.Errorf("capstan: the controller accepted no handler: %w", err)
		}
		var unsupported *UnsupportedError
		if errors.As(err, &unsupported) {
			return err
		}
		if welcomed {
			failures = 0
		}
		delay := r.backoff(failures)
		log.Warn("capstan: not connected to the controller; retrying", "error", err, "in", delay)
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(delay):
		}
	}
}

// connect runs one stream: Hello, Welcome, then the session until the stream ends or ctx is
// cancelled. welcomed says whether the handshake succeeded.
func (r *Registry) connect(ctx context.Context, conn *grpc.ClientConn, hello *pb.Hello) (welcomed bool, err error) {
	// The stream outlives ctx, so that Goodbye can still be sent when ctx is cancelled.
	streamCtx, cancelStream := context.WithCancel(context.Background())
	defer cancelStream()
	stopEarly := context.AfterFunc(ctx, cancelStream) // until the handshake is done
	timer := time.AfterFunc(handshakeTimeout, cancelStream)
	defer timer.Stop()

	s, err := pb.NewRuntimeServiceClient(conn).Connect(streamCtx)
	if err != nil {
		return false, err
	}
	if err := s.Send(&pb.ConnectRequest{Message: &pb.ConnectRequest_Hello{Hello: hello}}); err != nil {
		_, err = s.Recv() // the stream's status says why
		return false, err
	}
	first, err := s.Recv()
	if !timer.Stop() {
		return false, fmt.Errorf("no welcome within %s", handshakeTimeout)
	}
	if err != nil {
		return false, err
	}
	welcome := first.GetWelcome()
	if welcome == nil {
		return false, fmt.Errorf("the controller sent %T before welcome", first.GetMessage())
	}
	if !stopEarly() {
		return true, nil // ctx was cancelled during the handshake
	}
	r.logWelcome(welcome)
	if err := unsupportedKinds(welcome); err != nil {
		_ = s.CloseSend()
		return true, err
	}
	sess := newSession(r, s)
	sess.cleanupOnGoodbye = slices.Contains(welcome.GetCapabilities(), pb.Capability_CAPABILITY_CLEANUP_ON_GOODBYE) &&
		r.hasCleanup()
	return true, sess.serve(ctx)
}

// UnsupportedError says which handlers the connected controller does not run (their kind was
// rejected with UNSUPPORTED_HANDLER_KIND): [Registry.Run] stops with it rather than run an
// operator that silently misses them.
type UnsupportedError struct {
	// Handlers maps each handler id to the controller's explanation.
	Handlers map[string]string
}

func (e *UnsupportedError) Error() string {
	ids := make([]string, 0, len(e.Handlers))
	for id := range e.Handlers {
		ids = append(ids, id)
	}
	sort.Strings(ids)
	parts := make([]string, len(ids))
	for i, id := range ids {
		parts[i] = fmt.Sprintf("%q (%s)", id, e.Handlers[id])
	}
	return "capstan: the controller does not run these handlers' kinds: " + strings.Join(parts, ", ")
}

// unsupportedKinds returns an [UnsupportedError] when the welcome rejected a handler's kind.
func unsupportedKinds(w *pb.Welcome) error {
	found := map[string]string{}
	for _, st := range w.GetRegistrations() {
		if st.GetAccepted() {
			continue
		}
		for _, d := range st.GetDiagnostics() {
			if d.GetReason() == "UNSUPPORTED_HANDLER_KIND" {
				found[st.GetHandlerId()] = d.GetSummary()
			}
		}
	}
	if len(found) == 0 {
		return nil
	}
	return &UnsupportedError{Handlers: found}
}

// logWelcome logs the connection and every registration: rejected handlers are never
// invoked, while the accepted ones work normally.
func (r *Registry) logWelcome(w *pb.Welcome) {
	log := r.logger()
	log.Info("capstan: connected to the controller", "connection", w.GetConnectionId(),
		"runtime", w.GetRuntime().GetName()+" "+w.GetRuntime().GetVersion(),
		"max_in_flight", w.GetLimits().GetMaxInFlight())
	for _, st := range w.GetRegistrations() {
		if st.GetAccepted() {
			res := st.GetResource()
			log.Info("capstan: handler registered", "handler", st.GetHandlerId(),
				"resource", res.GetPlural()+"."+res.GetGroup()+"/"+res.GetVersion())
			continue
		}
		for _, d := range st.GetDiagnostics() {
			log.Warn("capstan: handler rejected", "handler", st.GetHandlerId(), "reason", d.GetReason(),
				"field", d.GetField(), "summary", d.GetSummary())
		}
	}
}

// dialOptions are the gRPC options the protocol asks for: plaintext (a Unix socket or
// loopback), 16 MiB messages both ways, and HTTP/2 keepalive also while idle.
func dialOptions() []grpc.DialOption {
	return []grpc.DialOption{
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithDefaultCallOptions(
			grpc.MaxCallRecvMsgSize(maxMessageBytes),
			grpc.MaxCallSendMsgSize(maxMessageBytes),
		),
		grpc.WithKeepaliveParams(keepalive.ClientParameters{
			Time:                30 * time.Second,
			Timeout:             10 * time.Second,
			PermitWithoutStream: true,
		}),
	}
}

// target turns an endpoint into a gRPC target: "unix:" endpoints are gRPC targets already,
// and "host:port" is resolved as such.
func target(endpoint string) string {
	if strings.HasPrefix(endpoint, "unix:") {
		return endpoint
	}
	return "dns:///" + endpoint
}

// backoff returns the delay before reconnect attempt failures+1: exponential between the
// bounds, with jitter (a random delay in its upper half) so that many processes do not
// reconnect in step.
func (r *Registry) backoff(failures int) time.Duration {
	lo, hi := r.ReconnectDelay, r.MaxReconnectDelay
	if lo <= 0 {
		lo = 250 * time.Millisecond
	}
	if hi <= 0 {
		hi = 30 * time.Second
	}
	d := hi
	if failures < 30 && lo<<failures < hi {
		d = lo << failures
	}
	return d/2 + rand.N(d/2+1)
}

// newInstanceID returns a random id for this process, kept across reconnects.
func newInstanceID() string {
	b := make([]byte, 16)
	_, _ = cryptorand.Read(b)
	return hex.EncodeToString(b)
}

// onlyTaken reports whether every registration a NO_HANDLERS_ACCEPTED status names was rejected
// only because another connection holds its id ("[HANDLER_ID_TAKEN]"): a previous connection of
// a process that just died, which the controller lets go soon, so dialling again succeeds.
func onlyTaken(message string) bool {
	_, list, ok := strings.Cut(message, "(")
	if !ok {
		return false
	}
	reasons := 0
	for _, item := range strings.Split(strings.TrimSuffix(list, ")"), "; ") {
		_, rest, ok := strings.Cut(item, "[")
		if !ok {
			continue
		}
		named, _, ok := strings.Cut(rest, "]")
		if !ok {
			continue
		}
		for _, reason := range strings.Split(named, ",") {
			if reason != "HANDLER_ID_TAKEN" {
				return false
			}
			reasons++
		}
	}
	return reasons > 0
}
