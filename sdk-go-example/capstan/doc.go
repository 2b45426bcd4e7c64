// Package capstan is a thin Go layer over the capstan.v1 handler protocol: it registers
// handlers with a Capstan controller and runs them when the controller invokes them.
//
// A handler process opens one bidirectional gRPC stream (capstan.v1.RuntimeService/Connect)
// to the controller, sends Hello with every handler registration, and then answers each
// Invocation with exactly one InvocationResult. This package does that and nothing more:
//
//   - [Registry] collects handlers (create, update, delete, resume, field, event, daemon,
//     timer) with their options ([Retries], [Backoff], [Timeout], [Errors], label and
//     annotation filters, [Field]) and turns them into HandlerRegistrations.
//   - [Registry.Run] dials the controller, performs the handshake, serves invocations, answers
//     pings from the stream reader, reconnects with jittered exponential backoff when the
//     stream is lost, and says Goodbye when its context is cancelled.
//   - Each invocation runs in its own goroutine as a [HandlerFunc] with a [context.Context]
//     that carries the invocation's deadline and is cancelled when the controller sends
//     Cancel (daemon stop, deadline, shutdown) or the stream is lost.
//   - The handler's return value becomes the result (stored by the controller at
//     status.<handler id>), [Invocation.Patch] collects JSON merge patches, and the returned
//     error is classified: [TemporaryError] and [PermanentError] (found with errors.As), any
//     other error is unclassified, and a panic is recovered and reported as an unclassified
//     error while the process keeps serving.
//
// Example:
//
//	reg := capstan.NewRegistry()
//	reg.OnCreate("examples.demo.capstan.dev", "create_fn",
//		func(ctx context.Context, inv *capstan.Invocation) (any, error) {
//			inv.Patch().Label("demo.capstan.dev/handled", "yes")
//			return map[string]string{"message": "hello " + inv.Name()}, nil
//		}, capstan.Retries(5))
//	err := reg.Run(ctx, "unix:///run/capstan/capstan.sock")
//
// The protocol itself is documented in proto/README.md and proto/capstan/v1/*.proto.
package capstan
