// Command capstan-testenv runs a real kube-apiserver with etcd embedded in
// the same process, for Capstan's tests. See README.md.
package main

import (
	"errors"
	"flag"
	"fmt"
	"io/fs"
	"os"
	"os/signal"
	"path/filepath"
	"sync"
	"syscall"
	"time"
	_ "time/tzdata"

	etcdversion "go.etcd.io/etcd/api/v3/version"
	"go.etcd.io/etcd/server/v3/embed"
	"k8s.io/component-base/cli"
	_ "k8s.io/component-base/logs/json/register"
	_ "k8s.io/component-base/metrics/prometheus/clientgo"
	_ "k8s.io/component-base/metrics/prometheus/version"
	"k8s.io/component-base/version"
	"k8s.io/kubernetes/cmd/kube-apiserver/app"
)

const usage = `capstan-testenv: a real kube-apiserver with embedded etcd, for tests.

Usage:
  capstan-testenv start --dir DIR [--port N] [--audit-log PATH] [--timeout 60s]
                        [--v N] [--etcd-log-level LEVEL] [--keep-data]
                        [-- EXTRA-KUBE-APISERVER-FLAGS...]
  capstan-testenv version

start prints exactly one line to stdout, "ready <DIR>/kubeconfig", once the
server answers /readyz; everything else goes to stderr. It runs until SIGTERM
or SIGINT, then stops the API server and etcd and deletes the instance data
under DIR (the audit log is kept).
`

func main() {
	if len(os.Args) < 2 {
		fmt.Fprint(os.Stderr, usage)
		os.Exit(2)
	}
	switch os.Args[1] {
	case "start":
		os.Exit(runStart(os.Args[2:]))
	case "version", "--version":
		fmt.Printf("capstan-testenv kube-apiserver %s etcd %s\n", version.Get().GitVersion, etcdversion.Version)
	case "help", "-h", "--help":
		fmt.Print(usage)
	default:
		fmt.Fprintf(os.Stderr, "capstan-testenv: unknown command %q\n\n%s", os.Args[1], usage)
		os.Exit(2)
	}
}

func logf(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "capstan-testenv: "+format+"\n", args...)
}

// instance is the state shared by the startup, readiness and shutdown paths.
type instance struct {
	dir, kubeconfig, readyFile, etcdDir, pkiDir, policyFile string
	removeDir, keepData                                     bool

	mu      sync.Mutex
	closing bool
	etcd    *embed.Etcd
}

// shutdown stops etcd and removes the instance data. Safe to call more than
// once and from any goroutine; after it, nothing more is written. A
// non-graceful shutdown (the process is about to exit while kube-apiserver is
// still running) skips stopping etcd, which would wait for the apiserver's
// open watch streams to time out.
func (in *instance) shutdown(graceful bool) {
	in.mu.Lock()
	defer in.mu.Unlock()
	if in.closing {
		return
	}
	in.closing = true
	os.Remove(in.readyFile)
	if in.etcd != nil && graceful {
		quietEtcd()
		in.etcd.Close()
	}
	if in.keepData {
		return
	}
	os.Remove(in.kubeconfig)
	os.Remove(in.policyFile)
	os.RemoveAll(in.etcdDir)
	os.RemoveAll(in.pkiDir)
	if in.removeDir {
		os.Remove(in.dir) // only if empty: an audit log inside DIR is kept
	}
}

// fail stops everything and exits; used from background goroutines.
func (in *instance) fail(err error) {
	logf("error: %v", err)
	in.shutdown(false)
	logf("stopped (exit code 1)")
	os.Exit(1)
}

func runStart(args []string) int {
	began := time.Now()
	fset := flag.NewFlagSet("start", flag.ContinueOnError)
	dirFlag := fset.String("dir", "", "instance directory (created; required)")
	port := fset.Int("port", 0, "API server port on 127.0.0.1; 0 picks a free one")
	auditLog := fset.String("audit-log", "", "write a JSON audit log (every request, Metadata level) to this file")
	timeout := fset.Duration("timeout", 60*time.Second, "fail if not ready within this time")
	verbosity := fset.Int("v", 0, "kube-apiserver log verbosity")
	etcdLog := fset.String("etcd-log-level", "error", "embedded etcd log level (debug, info, warn, error)")
	keep := fset.Bool("keep-data", false, "keep etcd data, certificates and kubeconfig on exit (debugging)")
	fset.Usage = func() { fmt.Fprint(os.Stderr, usage, "\nFlags of start:\n"); fset.PrintDefaults() }
	if err := fset.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		return 2
	}
	if *dirFlag == "" {
		logf("error: --dir is required")
		return 2
	}
	if *port < 0 || *port > 65535 {
		logf("error: --port %d out of range", *port)
		return 2
	}
	dir, err := filepath.Abs(*dirFlag)
	if err != nil {
		logf("error: --dir: %v", err)
		return 2
	}
	audit := *auditLog
	if audit != "" {
		if audit, err = filepath.Abs(audit); err != nil {
			logf("error: --audit-log: %v", err)
			return 2
		}
	}

	in := &instance{
		dir:        dir,
		kubeconfig: filepath.Join(dir, "kubeconfig"),
		readyFile:  filepath.Join(dir, "ready"),
		etcdDir:    filepath.Join(dir, "etcd"),
		pkiDir:     filepath.Join(dir, "pki"),
		policyFile: filepath.Join(dir, "audit-policy.yaml"),
		keepData:   *keep,
	}
	if _, err := os.Stat(dir); errors.Is(err, fs.ErrNotExist) {
		in.removeDir = true
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		logf("error: create --dir: %v", err)
		return 1
	}
	// Leftovers of an earlier run in the same DIR must not look ready.
	os.Remove(in.readyFile)
	os.Remove(in.kubeconfig)
	os.RemoveAll(in.etcdDir)

	code, err := in.run(began, *port, audit, *timeout, *verbosity, *etcdLog, fset.Args())
	if err != nil {
		logf("error: %v", err)
	}
	in.shutdown(true)
	logf("stopped (exit code %d)", code)
	return code
}

func (in *instance) run(began time.Time, port int, auditLog string, timeout time.Duration,
	verbosity int, etcdLogLevel string, extra []string) (int, error) {
	deadline := began.Add(timeout)

	if port != 0 {
		if err := checkPortFree(port); err != nil {
			return 1, err
		}
	} else {
		p, err := freePort()
		if err != nil {
			return 1, err
		}
		port = p
	}
	etcdPorts, err := distinctFreePorts(2, port)
	if err != nil {
		return 1, err
	}

	p, err := generatePKI(in.pkiDir)
	if err != nil {
		return 1, fmt.Errorf("generate certificates: %w", err)
	}
	args, err := apiserverArgs(apiserverConfig{
		port: port, etcdPort: etcdPorts[0], pki: p, auditLog: auditLog,
		policyFile: in.policyFile, verbosity: verbosity, extraArgs: extra,
	})
	if err != nil {
		return 1, err
	}

	// Creating the command installs kube-apiserver's SIGTERM/SIGINT handler
	// (its context is cancelled on the first signal, the process exits on
	// the second). We listen too, to know that a stop was requested and to
	// bound the graceful shutdown.
	cmd := app.NewAPIServerCommand()
	cmd.SetArgs(args)
	signalled := make(chan struct{})
	sigs := make(chan os.Signal, 2)
	signal.Notify(sigs, syscall.SIGTERM, syscall.SIGINT)
	go func() {
		s := <-sigs
		logf("received %v, shutting down", s)
		close(signalled)
		time.Sleep(30 * time.Second)
		in.fail(fmt.Errorf("graceful shutdown took longer than 30s, exiting"))
	}()

	e, err := startEtcd(in.etcdDir, etcdPorts[0], etcdPorts[1], etcdLogLevel, deadline)
	if err != nil {
		return 1, err
	}
	in.mu.Lock()
	in.etcd = e
	in.mu.Unlock()
	go func() {
		err := <-e.Err()
		in.mu.Lock()
		closing := in.closing
		in.mu.Unlock()
		if !closing {
			in.fail(fmt.Errorf("embedded etcd stopped: %v", err))
		}
	}()
	select {
	case <-signalled:
		return 0, nil
	default:
	}

	client, err := adminHTTPClient(p)
	if err != nil {
		return 1, err
	}
	server := fmt.Sprintf("https://127.0.0.1:%d", port)
	isReady := false
	go func() {
		if err := waitReady(client, server, deadline); err != nil {
			select {
			case <-signalled:
				return
			default:
			}
			in.fail(fmt.Errorf("%w (timeout %v; raise it with --timeout)", err, timeout))
		}
		if err := in.publish(server, p); err != nil {
			in.fail(err)
		}
		in.mu.Lock()
		isReady = !in.closing
		in.mu.Unlock()
		logf("ready in %.1fs: %s (etcd on 127.0.0.1:%d)", time.Since(began).Seconds(), server, etcdPorts[0])
	}()

	code := cli.Run(cmd) // blocks until the API server stops
	in.mu.Lock()
	wasReady := isReady
	in.mu.Unlock()
	select {
	case <-signalled:
		return code, nil
	default:
	}
	if code == 0 {
		code = 1
	}
	if wasReady {
		return code, fmt.Errorf("kube-apiserver stopped unexpectedly")
	}
	return code, fmt.Errorf("kube-apiserver failed to start (see its log above)")
}

// publish writes the kubeconfig, then the ready file, then the stdout line,
// unless shutdown has already begun.
func (in *instance) publish(server string, p *pki) error {
	in.mu.Lock()
	defer in.mu.Unlock()
	if in.closing {
		return nil
	}
	if err := writeKubeconfig(in.kubeconfig, server, p); err != nil {
		return fmt.Errorf("write kubeconfig: %w", err)
	}
	if err := writeAtomic(in.readyFile, []byte(server+"\n"), 0o644); err != nil {
		return fmt.Errorf("write ready file: %w", err)
	}
	fmt.Printf("ready %s\n", in.kubeconfig)
	return nil
}
