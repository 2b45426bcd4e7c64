// Command bench-hop is B3's micro-benchmark of the gRPC hop: it plays the controller's side of
// capstan.v1 RuntimeService (generated stubs of sdk-go-example/gen) on a Unix socket, starts a
// real handler process that dials it, and invokes the handler's no-op create handler:
//
//   - ping-pong: one invocation at a time (after a warm-up), p50/p99 of send → result;
//   - pipelined: `-in-flight` invocations outstanding on the one stream, calls per second;
//   - raw: a 1 KiB length-prefixed echo between this process and a child over a Unix socket,
//     the physical floor of a round trip between two processes on this machine.
//
// It prints one JSON object on stdout.
//
//	bench-hop -handler BIN [-env K=V]... [-calls 20000] [-warmup 2000] [-in-flight 64]
//	bench-hop rawecho SOCKET   (the child of the raw measurement)
package main

import (
	"encoding/binary"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"syscall"
	"time"

	pb "capstan.dev/sdk-go-example/gen/capstan/v1"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/types/known/durationpb"
)

type envFlags []string

func (e *envFlags) String() string     { return strings.Join(*e, ",") }
func (e *envFlags) Set(v string) error { *e = append(*e, v); return nil }

type report struct {
	Calls       int     `json:"calls"`
	P50Us       float64 `json:"p50_us"`
	P90Us       float64 `json:"p90_us"`
	P99Us       float64 `json:"p99_us"`
	RawP50Us    float64 `json:"raw_socket_p50_us"`
	RawP99Us    float64 `json:"raw_socket_p99_us"`
	PipelinedPS float64 `json:"pipelined_per_s"`
	InFlight    int     `json:"in_flight"`
}

func main() {
	if len(os.Args) == 3 && os.Args[1] == "rawecho" {
		if err := rawEcho(os.Args[2]); err != nil {
			fmt.Fprintln(os.Stderr, "rawecho:", err)
			os.Exit(1)
		}
		return
	}
	handler := flag.String("handler", "", "the handler process to start")
	var env envFlags
	flag.Var(&env, "env", "K=V for the handler process (repeatable)")
	calls := flag.Int("calls", 20000, "measured ping-pong calls")
	warmup := flag.Int("warmup", 2000, "warm-up calls")
	inFlight := flag.Int("in-flight", 64, "outstanding calls in the pipelined test")
	pipelined := flag.Int("pipelined", 50000, "calls in the pipelined test")
	flag.Parse()
	if err := run(*handler, env, *calls, *warmup, *inFlight, *pipelined); err != nil {
		fmt.Fprintln(os.Stderr, "bench-hop:", err)
		os.Exit(1)
	}
}

// server is the controller's side: it hands the stream to the benchmark once the handler said
// hello.
type server struct {
	pb.UnimplementedRuntimeServiceServer
	streams chan pb.RuntimeService_ConnectServer
	done    chan struct{}
}

func (s *server) Connect(stream pb.RuntimeService_ConnectServer) error {
	first, err := stream.Recv()
	if err != nil {
		return err
	}
	hello := first.GetHello()
	if hello == nil {
		return errors.New("the first message was not a hello")
	}
	var regs []*pb.RegistrationStatus
	for _, h := range hello.GetHandlers() {
		regs = append(regs, &pb.RegistrationStatus{
			HandlerId: h.GetHandlerId(), Accepted: true,
			Resource: &pb.ResolvedResource{Group: "demo.capstan.dev", Version: "v1", Plural: "examples", Kind: "Example", Namespaced: true},
		})
	}
	err = stream.Send(&pb.ConnectResponse{Message: &pb.ConnectResponse_Welcome{Welcome: &pb.Welcome{
		ConnectionId: "bench-hop",
		Runtime:      &pb.SoftwareInfo{Name: "bench-hop", Version: "0", Language: "go"},
		Limits: &pb.Limits{
			MaxMessageBytes: 16 << 20, PingInterval: durationpb.New(time.Hour), PingTimeout: durationpb.New(time.Hour),
			MaxInFlight: 1024, CancelGracePeriod: durationpb.New(5 * time.Second),
		},
		Registrations: regs,
	}}})
	if err != nil {
		return err
	}
	s.streams <- stream
	<-s.done
	return nil
}

func body(name string) []byte {
	items := make([]string, 16)
	for i := range items {
		items[i] = fmt.Sprintf("item-%02d-%s", i, strings.Repeat("x", 52))
	}
	obj := map[string]any{
		"apiVersion": "demo.capstan.dev/v1", "kind": "Example",
		"metadata": map[string]any{"name": name, "namespace": "bench", "uid": "00000000-0000-0000-0000-000000000001", "resourceVersion": "1"},
		"spec":     map[string]any{"field": "initial", "size": 1, "items": items},
	}
	data, _ := json.Marshal(obj)
	return data
}

func run(handler string, env []string, calls, warmup, inFlight, pipelined int) error {
	dir, err := os.MkdirTemp("", "bench-hop-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	sock := filepath.Join(dir, "capstan.sock")
	lis, err := net.Listen("unix", sock)
	if err != nil {
		return err
	}
	srv := &server{streams: make(chan pb.RuntimeService_ConnectServer, 1), done: make(chan struct{})}
	gs := grpc.NewServer(grpc.MaxRecvMsgSize(16<<20), grpc.MaxSendMsgSize(16<<20))
	pb.RegisterRuntimeServiceServer(gs, srv)
	go func() { _ = gs.Serve(lis) }()
	defer gs.Stop()
	defer close(srv.done)

	cmd := exec.Command(handler)
	cmd.Env = append(append(os.Environ(), env...), "CAPSTAN_ENDPOINT=unix://"+sock)
	cmd.Stderr = os.Stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		return err
	}
	defer func() {
		_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGTERM)
		waited := make(chan struct{})
		go func() { _ = cmd.Wait(); close(waited) }()
		select {
		case <-waited:
		case <-time.After(5 * time.Second):
			_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
		}
	}()
	var stream pb.RuntimeService_ConnectServer
	select {
	case stream = <-srv.streams:
	case <-time.After(30 * time.Second):
		return errors.New("the handler process did not connect")
	}

	// Results are read by one goroutine and handed to the waiters by invocation id.
	var mu sync.Mutex
	waiters := map[string]chan struct{}{}
	recvErr := make(chan error, 1)
	go func() {
		for {
			msg, err := stream.Recv()
			if err != nil {
				recvErr <- err
				return
			}
			res := msg.GetResult()
			if res == nil {
				continue // logs, flow control
			}
			if res.GetSuccess() == nil {
				recvErr <- fmt.Errorf("invocation %s did not succeed: %v", res.GetInvocationId(), res)
				return
			}
			mu.Lock()
			ch := waiters[res.GetInvocationId()]
			delete(waiters, res.GetInvocationId())
			mu.Unlock()
			if ch != nil {
				close(ch)
			}
		}
	}()
	obj := body("hop")
	var sendMu sync.Mutex
	seq := 0
	invoke := func() (chan struct{}, error) {
		sendMu.Lock()
		defer sendMu.Unlock()
		seq++
		id := fmt.Sprintf("inv-%d", seq)
		ch := make(chan struct{})
		mu.Lock()
		waiters[id] = ch
		mu.Unlock()
		inv := &pb.Invocation{
			InvocationId: id, HandlerId: "create_fn", Attempt: 1, IdempotencyKey: id,
			Resource: &pb.ResourceRef{Group: "demo.capstan.dev", Version: "v1", Kind: "Example", Plural: "examples", Namespace: "bench", Name: "hop", Uid: "00000000-0000-0000-0000-000000000001", ResourceVersion: "1"},
			Body:     &pb.Json{Json: obj},
			Payload:  &pb.Invocation_Change{Change: &pb.ResourceChange{Reason: pb.ChangeReason_CHANGE_REASON_CREATE, New: &pb.Json{Json: []byte(`{"spec":{"field":"initial"}}`)}}},
		}
		return ch, stream.Send(&pb.ConnectResponse{Message: &pb.ConnectResponse_Invocation{Invocation: inv}})
	}
	wait := func(ch chan struct{}) error {
		select {
		case <-ch:
			return nil
		case err := <-recvErr:
			return err
		case <-time.After(30 * time.Second):
			return errors.New("no result within 30 s")
		}
	}
	lat := make([]float64, 0, calls)
	for i := 0; i < warmup+calls; i++ {
		t0 := time.Now()
		ch, err := invoke()
		if err != nil {
			return err
		}
		if err := wait(ch); err != nil {
			return err
		}
		if i >= warmup {
			lat = append(lat, float64(time.Since(t0).Nanoseconds())/1000)
		}
	}
	sort.Float64s(lat)
	rep := report{Calls: calls, P50Us: pct(lat, .5), P90Us: pct(lat, .9), P99Us: pct(lat, .99), InFlight: inFlight}

	// Pipelined: keep inFlight outstanding.
	sem := make(chan struct{}, inFlight)
	var wg sync.WaitGroup
	var firstErr error
	var errMu sync.Mutex
	t0 := time.Now()
	for i := 0; i < pipelined; i++ {
		sem <- struct{}{}
		ch, err := invoke()
		if err != nil {
			return err
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := wait(ch); err != nil {
				errMu.Lock()
				firstErr = err
				errMu.Unlock()
			}
			<-sem
		}()
	}
	wg.Wait()
	if firstErr != nil {
		return firstErr
	}
	rep.PipelinedPS = float64(pipelined) / time.Since(t0).Seconds()

	rep.RawP50Us, rep.RawP99Us, err = rawRTT(dir, calls, warmup)
	if err != nil {
		return err
	}
	return json.NewEncoder(os.Stdout).Encode(rep)
}

// rawRTT measures a 1 KiB ping-pong with a child process over a Unix socket.
func rawRTT(dir string, calls, warmup int) (float64, float64, error) {
	sock := filepath.Join(dir, "raw.sock")
	lis, err := net.Listen("unix", sock)
	if err != nil {
		return 0, 0, err
	}
	defer lis.Close()
	self, _ := os.Executable()
	cmd := exec.Command(self, "rawecho", sock)
	cmd.Stderr = os.Stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		return 0, 0, err
	}
	defer func() { _ = cmd.Process.Kill(); _ = cmd.Wait() }()
	conn, err := lis.Accept()
	if err != nil {
		return 0, 0, err
	}
	defer conn.Close()
	msg := make([]byte, 4+1024)
	binary.BigEndian.PutUint32(msg, 1024)
	buf := make([]byte, len(msg))
	lat := make([]float64, 0, calls)
	for i := 0; i < warmup+calls; i++ {
		t0 := time.Now()
		if _, err := conn.Write(msg); err != nil {
			return 0, 0, err
		}
		if _, err := io.ReadFull(conn, buf); err != nil {
			return 0, 0, err
		}
		if i >= warmup {
			lat = append(lat, float64(time.Since(t0).Nanoseconds())/1000)
		}
	}
	sort.Float64s(lat)
	return pct(lat, .5), pct(lat, .99), nil
}

func rawEcho(sock string) error {
	conn, err := net.Dial("unix", sock)
	if err != nil {
		return err
	}
	defer conn.Close()
	hdr := make([]byte, 4)
	buf := make([]byte, 64<<10)
	for {
		if _, err := io.ReadFull(conn, hdr); err != nil {
			if errors.Is(err, io.EOF) {
				return nil
			}
			return err
		}
		n := binary.BigEndian.Uint32(hdr)
		if _, err := io.ReadFull(conn, buf[:n]); err != nil {
			return err
		}
		if _, err := conn.Write(append(hdr, buf[:n]...)); err != nil {
			return err
		}
	}
}

func pct(sorted []float64, p float64) float64 {
	if len(sorted) == 0 {
		return 0
	}
	i := int(p*float64(len(sorted)-1) + 0.5)
	return sorted[min(i, len(sorted)-1)]
}
