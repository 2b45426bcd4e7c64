// Command conformance-handler is the Go SDK's conformance handler for the capstan.v1
// conformance kit (tests/conformance/README.md): a handler process that registers the kit's
// fixed set of handlers on widgets.v1.conformance.capstan.dev and runs, in each resource
// handler, the script in the spec.script of the body it is given.
//
// It dials CAPSTAN_ENDPOINT (a unix:// path or a loopback host:port; default
// unix:///run/capstan/capstan.sock), registers the handlers of the features named in
// CAPSTAN_CONFORMANCE_FEATURES (comma-separated; unset: every feature this SDK supports), and
// runs until SIGTERM (or SIGINT), then stops as the SDK stops: goodbye, results of what runs,
// closing its side. It logs to standard error only.
//
// Where the Go SDK cannot do exactly what the kit says:
//
//   - a TemporaryError's delay of 0 means "no delay given", so {"delay": 0} sends no delay;
//   - Deny has no default code: a "deny" without a code uses kopf's default, 500;
//   - the value an admission handler returns is not sent (the protocol has no place for it),
//     so an "echo" in validate or mutate ends in an allowed verdict and nothing more;
//   - Run refuses to start without handlers: features that register none make the process
//     exit with status 2.
package main

import (
	"context"
	"log/slog"
	"os"
	"os/signal"
	"slices"
	"strings"
	"syscall"
	"time"

	"capstan.dev/sdk-go-example/capstan"
)

// resource is the conformance kit's resource: group conformance.capstan.dev, version v1,
// plural widgets.
const resource = "conformance.capstan.dev/v1/widgets"

// features are the kit's features this SDK supports, in the order of the kit's table.
// subhandlers, object_updates, result_ack and cleanup_on_goodbye are capabilities the SDK
// always announces, and tcp is a way of dialling: they register no handler.
var features = []string{
	"change", "field", "event", "daemon", "timer", "index", "admission", "sdk_filters",
	"activities", "probe", "subhandlers", "object_updates", "result_ack", "cleanup_on_goodbye", "tcp",
	"invocation_updates", "attempt_details",
}

// enabledFeatures returns the features named in CAPSTAN_CONFORMANCE_FEATURES, or all of them
// when it is unset. Names this SDK does not know are logged and left out.
func enabledFeatures(log *slog.Logger) map[string]bool {
	enabled := map[string]bool{}
	value, set := os.LookupEnv("CAPSTAN_CONFORMANCE_FEATURES")
	if !set {
		for _, f := range features {
			enabled[f] = true
		}
		return enabled
	}
	for _, name := range strings.Split(value, ",") {
		name = strings.TrimSpace(name)
		switch {
		case name == "":
		case slices.Contains(features, name):
			enabled[name] = true
		default:
			log.Warn("conformance handler: unknown feature; ignored", "feature", name)
		}
	}
	return enabled
}

// registry registers the handlers of the enabled features with the kit's ids and options.
func registry(enabled map[string]bool) *capstan.Registry {
	reg := capstan.NewRegistry()
	if enabled["change"] {
		reg.OnCreate(resource, "create", scripted, capstan.Param(map[string]any{"p": 1}))
		reg.OnUpdate(resource, "update", scripted,
			capstan.Retries(3), capstan.Backoff(2*time.Second), capstan.Timeout(30*time.Second))
		reg.OnDelete(resource, "delete", scripted)
		reg.OnResume(resource, "resume", scripted)
	}
	if enabled["field"] {
		// The SDK makes the id "field/spec.watched" (kopf's on.field naming); see the doc comment.
		reg.OnField(resource, "spec.watched", "field", scripted)
	}
	if enabled["event"] {
		reg.OnEvent(resource, "event", scripted)
	}
	if enabled["daemon"] {
		reg.Daemon(resource, "daemon", scripted)
	}
	if enabled["timer"] {
		reg.Timer(resource, "timer", 3600*time.Second, scripted)
	}
	if enabled["index"] {
		reg.Index(resource, "index", scripted)
	}
	if enabled["admission"] {
		reg.OnValidate(resource, "validate", scripted)
		reg.OnMutate(resource, "mutate", scripted)
	}
	if enabled["sdk_filters"] {
		reg.OnCreate(resource, "when", scripted, capstan.When(allowed))
	}
	if enabled["activities"] {
		reg.OnStartup("startup", startup)
		reg.OnCleanup("cleanup", cleanup)
		reg.OnLogin("login", login)
	}
	if enabled["probe"] {
		reg.OnProbe("probe", probe)
	}
	return reg
}

// allowed is the SDK-side filter of the "when" handler: spec.allowed is true.
func allowed(inv *capstan.Invocation) bool {
	return inv.Spec()["allowed"] == true
}

// startup fails temporarily on its first attempt, then logs "startup" and succeeds.
func startup(_ context.Context, inv *capstan.Invocation) (any, error) {
	if inv.Retry == 0 {
		return nil, capstan.Temporaryf(250*time.Millisecond, "not yet")
	}
	inv.Logf("startup")
	return nil, nil
}

// cleanup logs "cleanup" and succeeds.
func cleanup(_ context.Context, inv *capstan.Invocation) (any, error) {
	inv.Logf("cleanup")
	return nil, nil
}

// login returns the kit's fixed credentials.
func login(context.Context, *capstan.Invocation) (any, error) {
	return &capstan.Credentials{
		Server:           "https://conformance.invalid:6443",
		Token:            "conformance-token",
		DefaultNamespace: "conformance",
	}, nil
}

// probe reports {"probe": "ok"}.
func probe(context.Context, *capstan.Invocation) (any, error) {
	return map[string]any{"probe": "ok"}, nil
}

func main() {
	log := slog.New(slog.NewTextHandler(os.Stderr, nil))
	slog.SetDefault(log)

	endpoint := os.Getenv("CAPSTAN_ENDPOINT")
	if endpoint == "" {
		endpoint = capstan.DefaultEndpoint
	}
	enabled := enabledFeatures(log)
	reg := registry(enabled)
	reg.Logger = log
	if len(reg.Handlers()) == 0 {
		// The SDK cannot run a process without handlers (Run refuses it).
		log.Error("conformance handler: the features register no handler; the Go SDK cannot run without one",
			"features", os.Getenv("CAPSTAN_CONFORMANCE_FEATURES"))
		os.Exit(2)
	}

	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	log.Info("conformance handler starting", "endpoint", endpoint, "handlers", reg.Handlers())
	if err := reg.Run(ctx, endpoint); err != nil {
		log.Error("conformance handler failed", "error", err)
		os.Exit(1)
	}
	log.Info("conformance handler stopped")
}
