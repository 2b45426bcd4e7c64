package main

import (
	"fmt"
	"net"
	"os"
	"path/filepath"
	"time"
)

// controller is one system under test: how to start it with a set of handler presets.
type controller struct {
	Name   string // e.g. "capstan+rust"
	Marker string // the annotation that says an object was handled
	B4     bool   // whether the API-write scenarios run for it
	start  func(dir, presets, callLog string) (*running, error)
}

// running is a started controller (and its handler process, if separate).
type running struct {
	main    *proc // the controller process: RSS and CPU are read from it
	handler *proc
	callLog string // one line per handler call
	started time.Time
	admin   string // the controller's admin address (`/metrics`), when it has one
}

func (r *running) alive() bool {
	return r.main.alive() && (r.handler == nil || r.handler.alive())
}

func (r *running) stop() {
	if r == nil {
		return
	}
	r.handler.stop(10 * time.Second)
	r.main.stop(30 * time.Second)
}

func (r *running) tails() string {
	s := fmt.Sprintf("--- %s log (last lines):\n%s\n", r.main.name, r.main.tail(15))
	if r.handler != nil {
		s += fmt.Sprintf("--- %s log (last lines):\n%s\n", r.handler.name, r.handler.tail(15))
	}
	return s
}

func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

var startCount int

// capstanController runs `capstan run` with a handler process that dials its socket. The
// handler starts as soon as the socket exists, as a native sidecar's handler container would.
func capstanController(name, capstanBin, handlerBin, kubeconfig string, handlerEnv func(presets, callLog string) []string) controller {
	return controller{
		Name:   name,
		Marker: "capstan.dev/last-handled-configuration",
		B4:     true,
		start: func(dir, presets, callLog string) (*running, error) {
			startCount++
			sock := filepath.Join(dir, fmt.Sprintf("capstan-%d.sock", startCount))
			_ = os.Remove(sock)
			port, err := freePort()
			if err != nil {
				return nil, err
			}
			// One glibc malloc arena, as the container image (Dockerfile) runs the controller.
			env := []string{"KUBECONFIG=" + kubeconfig, "MALLOC_ARENA_MAX=1"}
			main, err := startProc(fmt.Sprintf("%s-capstan-%d", sanitize(name), startCount), dir, env, capstanBin,
				"run", "--standalone", "--listen", "unix://"+sock, "--admin-listen", fmt.Sprintf("127.0.0.1:%d", port))
			if err != nil {
				return nil, err
			}
			r := &running{main: main, callLog: callLog, started: main.started, admin: fmt.Sprintf("127.0.0.1:%d", port)}
			deadline := time.Now().Add(60 * time.Second)
			for {
				if _, err := os.Stat(sock); err == nil {
					break
				}
				if !main.alive() || time.Now().After(deadline) {
					r.stop()
					return nil, fmt.Errorf("capstan did not open its socket\n%s", r.tails())
				}
				time.Sleep(time.Millisecond)
			}
			henv := append([]string{"CAPSTAN_ENDPOINT=unix://" + sock}, handlerEnv(presets, callLog)...)
			r.handler, err = startProc(fmt.Sprintf("%s-handler-%d", sanitize(name), startCount), dir, henv, handlerBin)
			if err != nil {
				r.stop()
				return nil, err
			}
			return r, nil
		},
	}
}

func rustHandlerEnv(presets, callLog string) []string {
	return []string{"E2E_HANDLERS=" + presets, "E2E_LOG=" + callLog, "RUST_LOG=warn"}
}

func goHandlerEnv(presets, callLog string) []string {
	return []string{"BENCH_HANDLERS=" + presets, "BENCH_LOG=" + callLog}
}

func kopfController(kopfBin, operator, kubeconfig string) controller {
	return controller{
		Name:   "kopf",
		Marker: "kopf.zalando.org/last-handled-configuration",
		B4:     true,
		start: func(dir, presets, callLog string) (*running, error) {
			startCount++
			env := []string{"KUBECONFIG=" + kubeconfig, "BENCH_HANDLERS=" + presets, "BENCH_LOG=" + callLog}
			main, err := startProc(fmt.Sprintf("kopf-%d", startCount), dir, env, kopfBin,
				"run", "--standalone", "-A", "--log-format=plain", operator)
			if err != nil {
				return nil, err
			}
			return &running{main: main, callLog: callLog, started: main.started}, nil
		},
	}
}

func nullController(self, kubeconfig string) controller {
	return controller{
		Name:   "null (floor)",
		Marker: nullMarker,
		start: func(dir, _ string, callLog string) (*running, error) {
			startCount++
			env := []string{"KUBECONFIG=" + kubeconfig, "BENCH_LOG=" + callLog}
			main, err := startProc(fmt.Sprintf("null-%d", startCount), dir, env, self, "null", "--concurrency", "64")
			if err != nil {
				return nil, err
			}
			return &running{main: main, callLog: callLog, started: main.started}, nil
		},
	}
}

func sanitize(s string) string {
	out := []rune{}
	for _, r := range s {
		if (r >= 'a' && r <= 'z') || (r >= '0' && r <= '9') || r == '-' {
			out = append(out, r)
		} else {
			out = append(out, '-')
		}
	}
	return string(out)
}
