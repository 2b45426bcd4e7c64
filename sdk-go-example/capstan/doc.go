// Package capstan is the Go SDK for Capstan: it registers the handlers of a Kubernetes
// operator with a Capstan controller and runs them when the controller invokes them, with
// kopf's semantics and the Rust SDK's names.
//
// The controller watches the cluster, detects causes, persists progress, retries, runs daemons
// and timers, and writes to the API; a handler process only runs handlers. It opens one gRPC
// stream to the controller ([Registry.Run]), registers its handlers, and answers each
// invocation with exactly one result:
//
//   - [Registry] collects handlers of every kind the controller runs — [Registry.OnCreate],
//     [Registry.OnUpdate], [Registry.OnDelete], [Registry.OnResume], [Registry.OnField],
//     [Registry.OnEvent], [Registry.Daemon], [Registry.Timer] and the activities
//     [Registry.OnStartup], [Registry.OnCleanup], [Registry.OnLogin], [Registry.OnProbe] —
//     with kopf's options as [Option] values ([Retries], [Backoff], [Timeout], [Errors],
//     [Label], [Field], [When], [Optional], ...).
//   - Each invocation runs in its own goroutine as a [HandlerFunc] with an [*Invocation]
//     (kopf's arguments, the [Patch], a logger, [Invocation.Subhandler],
//     [Invocation.SendPatch], [Invocation.Memo]) and a context that carries the deadline and is
//     cancelled when the controller cancels the invocation ([CancelledError] says why).
//   - The returned value is the result (stored at status.<handler id>); the returned error is
//     classified as kopf does: [TemporaryError], [PermanentError], or unclassified (the
//     handler's [ErrorsMode] decides); a panic is recovered and reported, and the process
//     keeps serving.
//   - Run reconnects with jittered backoff when the stream is lost and says goodbye, letting
//     running handlers finish, when its context is cancelled.
//
// The package's API has its own types only; the generated protocol code is an implementation
// detail. Package capstantest runs handlers against an in-process fake controller, for unit
// tests without a cluster. Admission handlers are not offered until the controller runs them;
// Run stops with an [UnsupportedError] for any handler kind the connected controller rejects.
//
// The protocol is documented in proto/README.md and proto/capstan/v1/*.proto.
package capstan
