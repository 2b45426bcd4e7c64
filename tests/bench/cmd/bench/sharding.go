package main

// `bench sharding`: horizontal sharding (`capstan run --sharding`) against the real API server,
// each member a real `capstan` with its own Rust SDK handler process, as a pod of the chart
// would run it. It measures:
//
//  1. hand-over: with the objects spread over the members, one member leaves (SIGTERM), one
//     joins, one crashes (SIGKILL); right after each ring change every object is changed, and
//     for each object whose owner changed, the time from the ring change to its change being
//     handled (the handler's `seen <name> <value>` line, timed by polling the call logs
//     every 20 ms);
//  2. throughput: objects whose create handler sleeps 200 ms, at most 8 invocations in flight
//     per handler process, created at once for 1..4 members (creation → all handled);
//  3. per-member cost: each member's `capstan_watch_events_total` and resident memory after
//     the objects were created and changed once, on the 1.35 server (no shard filter: every
//     member receives every object) and on the 1.36 server with ShardedListAndWatch;
//  4. never twice: no `seen <name> <value>` line twice across the members' logs, and one
//     create_fn call per object.

import (
	"bufio"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"math"
	"net/http"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/dynamic"
)

var leaseGVR = schema.GroupVersionResource{Group: "coordination.k8s.io", Version: "v1", Resource: "leases"}

const (
	handledMarker = "capstan.dev/last-handled-configuration"
	// The member Leases live here (`--lease-namespace`).
	shardLeaseNamespace = "default"
	// How often the members' call logs are read: the resolution of every handling time.
	tailEvery = 20 * time.Millisecond
	// The gate of KEP-5866 on the 1.36 server.
	shardGate = "ShardedListAndWatch=true"
)

type shardingOptions struct {
	out, testenv, testenvSharded, capstan, handler, crd, profile string
	smoke, keep                                                  bool
	handoverMembers, handoverObjects                             int
	scenarios                                                    []string
	tpObjects                                                    int
	tpMembers                                                    []int
	costObjects                                                  int
	costMembers                                                  []int
	sleep                                                        float64
	inFlight                                                     int
	leaseDuration, renewDeadline, retryPeriod, settle            time.Duration
}

// ---------------------------------------------------------------------------------------------
// Results.

type latencyStats struct {
	N    int     `json:"n"`
	P50S float64 `json:"p50_s"`
	P99S float64 `json:"p99_s"`
	MaxS float64 `json:"max_s"`
}

func statsOf(values []float64) latencyStats {
	if len(values) == 0 {
		return latencyStats{}
	}
	s := append([]float64(nil), values...)
	sort.Float64s(s)
	return latencyStats{N: len(s), P50S: pct(s, 0.50), P99S: pct(s, 0.99), MaxS: s[len(s)-1]}
}

type handoverResult struct {
	Scenario      string   `json:"scenario"`
	Kind          string   `json:"kind"` // leave, join, crash
	Member        string   `json:"member"`
	MembersBefore []string `json:"members_before"`
	MembersAfter  []string `json:"members_after"`
	RingChange    string   `json:"ring_change"` // what the times are measured from
	Objects       int      `json:"objects"`
	Moved         int      `json:"moved"` // objects whose owner differs between the two rings
	// Changes of moving objects handled by their old owner before it let them go (a join: the
	// old owners notice the newcomer up to a retry period after the ring change).
	MovedByOldOwner int `json:"moved_handled_by_old_owner"`
	// Changes handled by a member that owns the object in neither ring: must be 0.
	ByNeither int `json:"handled_by_neither_owner"`
	// Ring change → the last of the driver's patches acknowledged: of the moved objects
	// (patched first), and of all.
	PatchedMovedS float64 `json:"patched_moved_s"`
	PatchedS      float64 `json:"patched_s"`
	// Moved objects: ring change → change handled; the object's patch acknowledged → handled.
	FromRingChange latencyStats `json:"moved_from_ring_change"`
	FromPatch      latencyStats `json:"moved_from_patch"`
	// Every object, moved or not: ring change → handled (every member pauses on a ring change).
	All latencyStats `json:"all_from_ring_change"`
	// Ring change → every remaining member's readiness says the new ring, settled.
	SettledS float64 `json:"settled_s"`
	// The members' own account (capstan_sharding_handover_seconds over this scenario): sum and
	// count of the pauses by member.
	PauseSumS  map[string]float64 `json:"pause_sum_s"`
	PauseCount map[string]float64 `json:"pause_count"`
	// A join: the new member's process start → its Lease created.
	LeaseAfterStartS float64 `json:"lease_after_start_s,omitempty"`
	TargetS          float64 `json:"target_s"`
	Met              bool    `json:"met"`
	Failure          string  `json:"failure,omitempty"`
}

type throughputResult struct {
	Members int     `json:"members"`
	Objects int     `json:"objects"`
	CreateS float64 `json:"create_s"` // first create sent → last create acknowledged
	TotalS  float64 `json:"total_s"`  // first create sent → last handled marker observed
	PerS    float64 `json:"objects_per_s"`
	// Objects each member's create_fn was called for, and its share of the hash space.
	Handled map[string]int     `json:"handled_by_member"`
	Shares  map[string]float64 `json:"ring_share_by_member"`
	// PerS / (members × the 1-member figure); the target is ≥ 0.9.
	Ratio float64 `json:"ratio_to_n_times_one"`
	// The most the ratio can be when every member handles its objects at the 1-member rate:
	// objects / (members × the busiest member's objects).
	Bound   float64 `json:"ratio_bound_by_busiest_member"`
	Met     bool    `json:"met"`
	Failure string  `json:"failure,omitempty"`
}

type memberCost struct {
	Member      string  `json:"member"`
	WatchEvents float64 `json:"watch_events"`
	RSSMiB      float64 `json:"rss_mib"` // process_resident_memory_bytes
	HWMMiB      float64 `json:"hwm_mib"` // VmHWM from /proc
	Objects     float64 `json:"objects"` // capstan_sharding_objects
	CPUS        float64 `json:"cpu_s"`   // the controller's CPU since its start
}

type costResult struct {
	Server  string `json:"server"`
	Members int    `json:"members"`
	Objects int    `json:"objects"`
	// What the members' logs say: "yes" (the server echoed shardInfo), "not confirmed" (it
	// did not: 1.35, or a custom resource on 1.36), "refused", or "" (no selector sent: one
	// member holds everything). The watch events say whether the server filtered.
	ServerFilters string       `json:"server_filters"`
	PerMember     []memberCost `json:"per_member"`
	MeanEvents    float64      `json:"mean_watch_events"`
	MeanRSSMiB    float64      `json:"mean_rss_mib"`
	Failure       string       `json:"failure,omitempty"`
}

type onceResult struct {
	Group           string `json:"group"`
	Objects         int    `json:"objects"`
	SeenLines       int    `json:"seen_lines"`
	SeenRepeated    int    `json:"seen_repeated"` // lines beyond the first of each `seen <name> <value>`
	SeenMissing     int    `json:"seen_missing"`  // changes made and never handled
	CreateCalls     int    `json:"create_calls"`
	CreateBeyondOne int    `json:"create_calls_beyond_one_per_object"`
	CreateMissing   int    `json:"objects_without_create_call"`
}

type shardingResults struct {
	Started    time.Time          `json:"started"`
	Finished   time.Time          `json:"finished"`
	DurationS  float64            `json:"duration_s"`
	Smoke      bool               `json:"smoke"`
	Profile    string             `json:"profile"`
	Machine    machine            `json:"machine"`
	Versions   map[string]string  `json:"versions"`
	Settings   map[string]string  `json:"settings"`
	Handover   []handoverResult   `json:"handover"`
	Throughput []throughputResult `json:"throughput"`
	Cost       []costResult       `json:"cost"`
	Once       []onceResult       `json:"never_twice"`
	Notes      []string           `json:"notes,omitempty"`
	Failures   []string           `json:"failures,omitempty"`
}

// ---------------------------------------------------------------------------------------------

func runSharding(args []string) error {
	fs := flag.NewFlagSet("sharding", flag.ExitOnError)
	var o shardingOptions
	var scenarios, tpMembers, costMembers string
	fs.StringVar(&o.out, "out", "", "directory for sharding.md, sharding.json and sharding.svg")
	fs.StringVar(&o.testenv, "testenv", "", "the capstan-testenv binary (Kubernetes 1.35: no shard filter)")
	fs.StringVar(&o.testenvSharded, "testenv-sharded", "", "the capstan-testenv 1.36 binary, started with --feature-gates="+shardGate+" for the per-member cost with the server's shard filter (optional)")
	fs.StringVar(&o.capstan, "capstan", "", "the capstan binary")
	fs.StringVar(&o.handler, "rust-handler", "", "capstan-e2e-handler")
	fs.StringVar(&o.crd, "crd", "", "examples/crd.yaml")
	fs.StringVar(&o.profile, "profile", "release", "the cargo profile capstan was built with (reported)")
	fs.BoolVar(&o.smoke, "smoke", false, "for CI: 40 objects, 1 and 2 members, one graceful hand-over; fails when a workload does not complete")
	fs.BoolVar(&o.keep, "keep", false, "keep the work directory (every process log and call log)")
	fs.IntVar(&o.handoverMembers, "handover-members", 3, "members before the hand-over scenarios")
	fs.IntVar(&o.handoverObjects, "handover-objects", 1000, "objects of the hand-over scenarios")
	fs.StringVar(&scenarios, "scenarios", "leave,join,crash", "hand-over scenarios, in order: leave (SIGTERM), join (a new member), crash (SIGKILL)")
	fs.IntVar(&o.tpObjects, "throughput-objects", 1000, "objects created for each throughput point")
	fs.StringVar(&tpMembers, "throughput-members", "1,2,3,4", "members of the throughput points (the first should be 1)")
	fs.IntVar(&o.costObjects, "cost-objects", 1000, "objects of the per-member cost")
	fs.StringVar(&costMembers, "cost-members", "1,2,3,4", "members of the per-member cost points (empty: none)")
	fs.Float64Var(&o.sleep, "sleep", 0.2, "seconds each create_fn call sleeps in the throughput points")
	fs.IntVar(&o.inFlight, "max-in-flight", 8, "capstan run --max-in-flight of the throughput points")
	fs.DurationVar(&o.leaseDuration, "lease-duration", 15*time.Second, "capstan run --lease-duration (capstan's default)")
	fs.DurationVar(&o.renewDeadline, "renew-deadline", 10*time.Second, "capstan run --renew-deadline (capstan's default)")
	fs.DurationVar(&o.retryPeriod, "retry-period", 2*time.Second, "capstan run --retry-period (capstan's default)")
	fs.DurationVar(&o.settle, "sharding-settle", 4*time.Second, "capstan run --sharding-settle (capstan's default)")
	fromJSON := fs.String("from-json", "", "only write sharding.md and sharding.svg again from this sharding.json (into --out)")
	_ = fs.Parse(args)
	if *fromJSON != "" {
		data, err := os.ReadFile(*fromJSON)
		if err != nil {
			return err
		}
		var res shardingResults
		if err := json.Unmarshal(data, &res); err != nil {
			return fmt.Errorf("%s: %w", *fromJSON, err)
		}
		if o.out == "" {
			o.out = filepath.Dir(*fromJSON)
		}
		return writeSharding(o.out, &res)
	}
	if o.smoke {
		given := map[string]bool{}
		fs.Visit(func(f *flag.Flag) { given[f.Name] = true })
		if !given["handover-members"] {
			o.handoverMembers = 2
		}
		if !given["handover-objects"] {
			o.handoverObjects = 40
		}
		if !given["scenarios"] {
			scenarios = "leave"
		}
		if !given["throughput-objects"] {
			o.tpObjects = 40
		}
		if !given["throughput-members"] {
			tpMembers = "1,2"
		}
		if !given["cost-members"] {
			costMembers = ""
		}
	}
	for _, req := range []struct{ v, n string }{{o.out, "out"}, {o.testenv, "testenv"}, {o.capstan, "capstan"}, {o.handler, "rust-handler"}, {o.crd, "crd"}} {
		if req.v == "" {
			return fmt.Errorf("--%s is required", req.n)
		}
	}
	var err error
	if o.tpMembers, err = parseOptionalSizes(tpMembers); err != nil {
		return err
	}
	if o.costMembers, err = parseOptionalSizes(costMembers); err != nil {
		return err
	}
	for _, s := range strings.Split(scenarios, ",") {
		switch s = strings.TrimSpace(s); s {
		case "":
		case "leave", "join", "crash":
			o.scenarios = append(o.scenarios, s)
		default:
			return fmt.Errorf("unknown hand-over scenario %q (leave, join, crash)", s)
		}
	}
	if o.handoverMembers < 2 && len(o.scenarios) > 0 {
		return fmt.Errorf("--handover-members must be at least 2")
	}

	ctx, cancel := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer cancel()
	defer stopAll()
	work, err := os.MkdirTemp("", "capstan-sharding-")
	if err != nil {
		return err
	}
	say("work directory %s", work)
	res := &shardingResults{Started: time.Now(), Smoke: o.smoke, Profile: o.profile, Machine: describeMachine(), Versions: map[string]string{}}
	res.Settings = map[string]string{
		"--lease-duration":   o.leaseDuration.String(),
		"--renew-deadline":   o.renewDeadline.String(),
		"--retry-period":     o.retryPeriod.String(),
		"--sharding-settle":  o.settle.String(),
		"--max-in-flight":    fmt.Sprintf("%d (throughput points; 256, the default, elsewhere)", o.inFlight),
		"create_fn sleep":    fmt.Sprintf("%gs (throughput points)", o.sleep),
		"call log poll":      tailEvery.String(),
		"handler presets":    "create,update-seen",
		"member identities":  "m1, m2, … (the join: the next unused)",
		"--lease-namespace":  shardLeaseNamespace,
		"objects per change": "merge patch of spec.field with a value of the scenario's own, 64 patches in flight",
	}
	version := func(bin string) string {
		out, err := exec.Command(bin, "version").Output()
		if err != nil {
			return ""
		}
		return strings.TrimSpace(strings.SplitN(string(out), "\n", 2)[0])
	}
	res.Versions["capstan"] = version(o.capstan) + " (" + o.profile + " build)"
	res.Versions["testenv"] = version(o.testenv)
	if o.testenvSharded != "" {
		res.Versions["testenv (sharded)"] = version(o.testenvSharded)
	}
	b := &shardingBench{o: o, ctx: ctx, work: work, res: res}

	srv, err := b.startServer("1.35", o.testenv, nil)
	if err != nil {
		return err
	}
	b.srv = srv
	if len(o.scenarios) > 0 {
		b.runHandover()
	}
	for _, n := range o.tpMembers {
		if ctx.Err() != nil {
			break
		}
		b.runThroughput(n)
	}
	for _, n := range o.costMembers {
		if ctx.Err() != nil {
			break
		}
		b.runCost(n)
	}
	srv.stop()
	switch {
	case len(o.costMembers) == 0:
	case o.testenvSharded == "":
		res.Notes = append(res.Notes, "No 1.36 API server (--testenv-sharded): the per-member cost with the server's shard filter was not measured.")
	case ctx.Err() == nil:
		srv, err := b.startServer("1.36", o.testenvSharded, []string{"--feature-gates=" + shardGate})
		if err != nil {
			b.fail("the 1.36 API server with %s: %v", shardGate, err)
			break
		}
		b.srv = srv
		for _, n := range o.costMembers {
			if ctx.Err() != nil {
				break
			}
			b.runCost(n)
		}
		srv.stop()
	}
	if ctx.Err() != nil {
		return fmt.Errorf("interrupted (logs in %s)", work)
	}
	res.Finished = time.Now()
	res.DurationS = res.Finished.Sub(res.Started).Seconds()
	res.Machine.LoadAfter = loadAverage()
	if err := writeSharding(o.out, res); err != nil {
		return err
	}
	say("wrote %s", filepath.Join(o.out, "sharding.md"))
	if len(res.Failures) > 0 {
		return fmt.Errorf("%d sharding workload(s) did not complete (logs in %s)", len(res.Failures), work)
	}
	if !o.keep {
		_ = os.RemoveAll(work)
	} else {
		say("logs kept in %s", work)
	}
	return nil
}

func parseOptionalSizes(s string) ([]int, error) {
	if strings.TrimSpace(s) == "" {
		return nil, nil
	}
	return parseSizes(s)
}

type shardingBench struct {
	o      shardingOptions
	ctx    context.Context
	work   string
	res    *shardingResults
	srv    *shardServer
	tokens int // capstan's tokens per member (VIRTUAL_NODES), once known
}

// knowTokens finds capstan's tokens per member from the objects' first creates, once.
func (b *shardingBench) knowTokens(members []string, tail *callTail, uids map[string]string) bool {
	if b.tokens > 0 {
		return true
	}
	if len(members) < 2 {
		return false
	}
	b.tokens = detectTokens(members, tail.owners("create_fn"), uids)
	if b.tokens > 0 {
		b.res.Settings["ring tokens per member"] = fmt.Sprintf("%d (found from the creates' members)", b.tokens)
	}
	return b.tokens > 0
}

func (b *shardingBench) fail(format string, args ...any) {
	msg := fmt.Sprintf(format, args...)
	say("FAILED: %s", msg)
	b.res.Failures = append(b.res.Failures, msg)
}

// shardServer is one API server with the driver's client and observer watch.
type shardServer struct {
	tag        string // "1.35" or "1.36"
	api        *proc
	kubeconfig string
	dyn        dynamic.Interface
	obs        *observer
	stopObs    context.CancelFunc
}

func (s *shardServer) stop() {
	s.stopObs()
	s.api.stop(30 * time.Second)
}

// startServer starts the testenv API server `bin` under the work directory with extra
// kube-apiserver flags, applies the CRD and starts the observer watch.
func (b *shardingBench) startServer(tag, bin string, extra []string) (*shardServer, error) {
	say("sharding: starting the %s API server %s", tag, strings.Join(extra, " "))
	dir := filepath.Join(b.work, "apiserver-"+tag)
	args := []string{"start", "--dir", dir, "--timeout", "120s"}
	if len(extra) > 0 {
		args = append(append(args, "--"), extra...)
	}
	api, err := startProc("testenv-"+tag, b.work, nil, bin, args...)
	if err != nil {
		return nil, err
	}
	if _, err := waitFileNonEmpty(filepath.Join(dir, "ready"), 150*time.Second, api.alive); err != nil {
		api.stop(10 * time.Second)
		return nil, fmt.Errorf("the %s API server did not start: %w\n%s", tag, err, api.tail(20))
	}
	kubeconfig := filepath.Join(dir, "kubeconfig")
	cfg, err := restConfig(kubeconfig, "capstan-bench/driver")
	if err != nil {
		return nil, err
	}
	dyn, err := dynamic.NewForConfig(cfg)
	if err != nil {
		return nil, err
	}
	if err := applyCRD(b.ctx, dyn, b.o.crd); err != nil {
		return nil, err
	}
	obs := newObserver([]string{handledMarker})
	ready := make(chan error, 1)
	obsCtx, stopObs := context.WithCancel(b.ctx)
	go obs.run(obsCtx, dyn, ready)
	if err := <-ready; err != nil {
		stopObs()
		return nil, fmt.Errorf("starting the observer watch: %w", err)
	}
	return &shardServer{tag: tag, api: api, kubeconfig: kubeconfig, dyn: dyn, obs: obs, stopObs: stopObs}, nil
}

// ---------------------------------------------------------------------------------------------
// Members.

// shardMember is one replica: `capstan run --sharding` and its handler process.
type shardMember struct {
	id      string
	ring    string
	ctrl    *proc
	handler *proc
	calls   string
	admin   string
	once    sync.Once
	gone    chan struct{} // closed once both processes were stopped
}

func ms(d time.Duration) string { return fmt.Sprintf("%dms", d.Milliseconds()) }

// startMember starts a member of `ring` watching `ns`: the controller, then its handler process
// as soon as the socket exists (as a native sidecar's handler container would).
func (b *shardingBench) startMember(ns, ring, id, presets string, extra ...string) (*shardMember, error) {
	dir := filepath.Join(b.work, b.srv.tag+"-"+ring)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, err
	}
	sock := filepath.Join(dir, id+".sock")
	_ = os.Remove(sock)
	port, err := freePort()
	if err != nil {
		return nil, err
	}
	admin := fmt.Sprintf("127.0.0.1:%d", port)
	args := []string{"run", "--standalone", "--namespace", ns,
		"--sharding", "--lease-name", ring, "--lease-namespace", shardLeaseNamespace,
		"--lease-duration", ms(b.o.leaseDuration), "--renew-deadline", ms(b.o.renewDeadline),
		"--retry-period", ms(b.o.retryPeriod), "--sharding-settle", ms(b.o.settle),
		"--peer-id", id, "--listen", "unix://" + sock, "--admin-listen", admin}
	args = append(args, extra...)
	// One glibc malloc arena, as the container image (Dockerfile) runs the controller.
	env := []string{"KUBECONFIG=" + b.srv.kubeconfig, "MALLOC_ARENA_MAX=1"}
	ctrl, err := startProc(ring+"-"+id, dir, env, b.o.capstan, args...)
	if err != nil {
		return nil, err
	}
	m := &shardMember{id: id, ring: ring, ctrl: ctrl, calls: filepath.Join(dir, id+".calls"), admin: admin, gone: make(chan struct{})}
	if err := waitUntil(b.ctx, 60*time.Second, func() bool {
		_, err := os.Stat(sock)
		return err == nil || !ctrl.alive()
	}); err != nil || !ctrl.alive() {
		ctrl.stop(10 * time.Second)
		return nil, fmt.Errorf("member %s did not open its socket\n%s", id, ctrl.tail(15))
	}
	m.handler, err = startProc(ring+"-"+id+"-handler", dir,
		append([]string{"CAPSTAN_ENDPOINT=unix://" + sock}, rustHandlerEnv(presets, m.calls)...), b.o.handler)
	if err != nil {
		ctrl.stop(10 * time.Second)
		return nil, err
	}
	return m, nil
}

// startMembers starts members m1..mn of `ring` at once and waits until they are settled in
// a ring of n.
func (b *shardingBench) startMembers(ns, ring, presets string, n int, extra ...string) ([]*shardMember, error) {
	var members []*shardMember
	for i := 1; i <= n; i++ {
		m, err := b.startMember(ns, ring, fmt.Sprintf("m%d", i), presets, extra...)
		if err != nil {
			stopMembers(members)
			return nil, err
		}
		members = append(members, m)
	}
	if _, err := b.settled(b.ctx, members, n, 90*time.Second); err != nil {
		stopMembers(members)
		return nil, err
	}
	return members, nil
}

// terminate stops the member as a pod's containers are stopped: SIGTERM to the controller,
// which drains and leaves the ring, then to the handler process. It returns at once; `gone`
// closes when both exited.
func (m *shardMember) terminate() {
	m.once.Do(func() {
		go func() {
			m.ctrl.stop(30 * time.Second)
			m.handler.stop(10 * time.Second)
			close(m.gone)
		}()
	})
}

// kill ends both processes at once with SIGKILL (a crashed node or pod).
func (m *shardMember) kill() {
	m.once.Do(func() {
		_ = syscall.Kill(-m.ctrl.pid(), syscall.SIGKILL)
		_ = syscall.Kill(-m.handler.pid(), syscall.SIGKILL)
		m.ctrl.stop(5 * time.Second)
		m.handler.stop(5 * time.Second)
		close(m.gone)
	})
}

// stopMembers stops every member at once and waits until they are gone.
func stopMembers(members []*shardMember) {
	for _, m := range members {
		m.terminate()
	}
	for _, m := range members {
		<-m.gone
	}
}

var adminClient = &http.Client{Timeout: 3 * time.Second}

func (m *shardMember) get(path string) (string, error) {
	resp, err := adminClient.Get("http://" + m.admin + path)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(resp.Body)
	return string(data), err
}

// ringView is what the member's readiness says of the ring: `member of 3 (<gen>), 33.1% of
// the objects[; handing over, waiting for …]`.
func (m *shardMember) ringView() string {
	body, err := m.get("/readyz")
	if err != nil {
		return ""
	}
	var report struct {
		Checks map[string]struct {
			Message string `json:"message"`
		} `json:"checks"`
	}
	if json.Unmarshal([]byte(body), &report) != nil {
		return ""
	}
	return report.Checks["sharding"].Message
}

// settled waits until every member says it is a settled member of one ring of n (the same
// generation, no hand-over waiting) and returns when that was seen.
func (b *shardingBench) settled(ctx context.Context, members []*shardMember, n int, timeout time.Duration) (time.Time, error) {
	wanted := fmt.Sprintf("member of %d (", n)
	deadline := time.Now().Add(timeout)
	var views []string
	for {
		views = views[:0]
		gen, ok := "", true
		for _, m := range members {
			v := m.ringView()
			views = append(views, m.id+": "+v)
			if !strings.HasPrefix(v, wanted) || strings.Contains(v, "handing over") {
				ok = false
				continue
			}
			g, _, _ := strings.Cut(strings.TrimPrefix(v, wanted), ")")
			if gen == "" {
				gen = g
			} else if g != gen {
				ok = false
			}
		}
		if ok {
			return time.Now(), nil
		}
		if ctx.Err() != nil {
			return time.Time{}, ctx.Err()
		}
		if time.Now().After(deadline) {
			var logs []string
			for _, m := range members {
				logs = append(logs, fmt.Sprintf("--- %s:\n%s", m.id, m.ctrl.tail(10)))
			}
			return time.Time{}, fmt.Errorf("the ring of %d did not settle within %s: %q\n%s", n, timeout, views, strings.Join(logs, "\n"))
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// metrics reads the member's /metrics as series → value ("name{labels}" as printed).
func (m *shardMember) metrics() map[string]float64 {
	out := map[string]float64{}
	body, err := m.get("/metrics")
	if err != nil {
		return out
	}
	sc := bufio.NewScanner(strings.NewReader(body))
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if line == "" || line[0] == '#' {
			continue
		}
		i := strings.LastIndexByte(line, ' ')
		if i < 0 {
			continue
		}
		v, err := strconv.ParseFloat(line[i+1:], 64)
		if err != nil {
			continue
		}
		out[line[:i]] = v
	}
	return out
}

// metricSum sums the series of metric `name` (any labels).
func metricSum(series map[string]float64, name string) float64 {
	total := 0.0
	for k, v := range series {
		base, _, _ := strings.Cut(k, "{")
		if base == name {
			total += v
		}
	}
	return total
}

// serverFilters says what the member's log says of the server's shard filter ("" when it sent
// no selector: one member holds everything).
func (m *shardMember) serverFilters() string {
	data, _ := os.ReadFile(m.ctrl.log)
	switch s := string(data); {
	case strings.Contains(s, "the API server refuses the shard selector"):
		return "refused"
	case strings.Contains(s, "the API server filters by shard"):
		return "yes"
	case strings.Contains(s, "the API server did not confirm a shard filter"):
		return "not confirmed"
	case strings.Contains(s, "the API server does not filter by shard"):
		return "no"
	}
	return ""
}

// ---------------------------------------------------------------------------------------------
// The members' call logs, read every tailEvery: when each line was first seen, and by whom.

type callAt struct {
	member string
	at     time.Time
}

type tailFile struct {
	member, path string
	off          int64
	rest         []byte
}

type callTail struct {
	mu    sync.Mutex
	files []*tailFile
	// `seen <name> <value>` lines whole; other lines `<handler> <name>` (the attempt cut).
	lines map[string][]callAt
	stop  chan struct{}
	done  chan struct{}
}

func newCallTail() *callTail {
	t := &callTail{lines: map[string][]callAt{}, stop: make(chan struct{}), done: make(chan struct{})}
	go func() {
		defer close(t.done)
		tick := time.NewTicker(tailEvery)
		defer tick.Stop()
		for {
			t.poll()
			select {
			case <-t.stop:
				t.poll()
				return
			case <-tick.C:
			}
		}
	}()
	return t
}

func (t *callTail) add(member, path string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.files = append(t.files, &tailFile{member: member, path: path})
}

func (t *callTail) close() {
	close(t.stop)
	<-t.done
}

func (t *callTail) poll() {
	t.mu.Lock()
	files := append([]*tailFile(nil), t.files...)
	t.mu.Unlock()
	for _, f := range files {
		fh, err := os.Open(f.path)
		if err != nil {
			continue
		}
		if _, err := fh.Seek(f.off, io.SeekStart); err != nil {
			fh.Close()
			continue
		}
		data, _ := io.ReadAll(fh)
		fh.Close()
		if len(data) == 0 {
			continue
		}
		now := time.Now()
		f.off += int64(len(data))
		data = append(f.rest, data...)
		last := strings.LastIndexByte(string(data), '\n')
		if last < 0 {
			f.rest = data
			continue
		}
		f.rest = append([]byte(nil), data[last+1:]...)
		t.mu.Lock()
		for _, line := range strings.Split(string(data[:last]), "\n") {
			key := line
			if !strings.HasPrefix(line, "seen ") {
				fields := strings.Fields(line)
				if len(fields) >= 2 {
					key = fields[0] + " " + fields[1]
				}
			}
			t.lines[key] = append(t.lines[key], callAt{member: f.member, at: now})
		}
		t.mu.Unlock()
	}
}

func (t *callTail) first(key string) (callAt, bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	c, ok := t.lines[key]
	if !ok || len(c) == 0 {
		return callAt{}, false
	}
	return c[0], true
}

func (t *callTail) missing(keys []string) []string {
	t.mu.Lock()
	defer t.mu.Unlock()
	var out []string
	for _, k := range keys {
		if len(t.lines[k]) == 0 {
			out = append(out, k)
		}
	}
	return out
}

// byMember counts, per member, the objects whose `handler` was called there.
func (t *callTail) byMember(handler string) map[string]int {
	t.mu.Lock()
	defer t.mu.Unlock()
	out := map[string]int{}
	for k, calls := range t.lines {
		if strings.HasPrefix(k, handler+" ") && len(calls) > 0 {
			out[calls[0].member]++
		}
	}
	return out
}

// owners is, per object, the member its first `handler` call was made by.
func (t *callTail) owners(handler string) map[string]string {
	t.mu.Lock()
	defer t.mu.Unlock()
	out := map[string]string{}
	for k, calls := range t.lines {
		if name, ok := strings.CutPrefix(k, handler+" "); ok && len(calls) > 0 {
			out[name] = calls[0].member
		}
	}
	return out
}

// once checks that every change was handled once, and every object created once.
func (t *callTail) once(group string, names []string, changes []string) onceResult {
	t.mu.Lock()
	defer t.mu.Unlock()
	r := onceResult{Group: group, Objects: len(names)}
	for k, calls := range t.lines {
		if strings.HasPrefix(k, "seen ") {
			r.SeenLines += len(calls)
			r.SeenRepeated += len(calls) - 1
		}
	}
	for _, name := range names {
		for _, v := range changes {
			if len(t.lines["seen "+name+" "+v]) == 0 {
				r.SeenMissing++
			}
		}
		c := len(t.lines["create_fn "+name])
		r.CreateCalls += c
		if c == 0 {
			r.CreateMissing++
		} else {
			r.CreateBeyondOne += c - 1
		}
	}
	return r
}

// ---------------------------------------------------------------------------------------------
// The ring, as controller/src/sharding/ring.rs computes it: 64-bit FNV-1a of the uid,
// consistent hashing with VIRTUAL_NODES tokens per member (splitmix64's finalizer over the
// identity's hash and the token's index); a point belongs to the first token at or after it.
// The number of tokens is found from the members' first objects (detectTokens).

// tokenCandidates are the tokens per member tried, the most likely first.
var tokenCandidates = []int{512, 256, 1024, 128, 2048, 64, 4096}

func fnv1a64(s string) uint64 {
	h := uint64(0xcbf29ce484222325)
	for i := 0; i < len(s); i++ {
		h ^= uint64(s[i])
		h *= 0x100000001b3
	}
	return h
}

func ringToken(base uint64, i uint32) uint64 {
	z := base + (uint64(i)+1)*0x9e3779b97f4a7c15
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9
	z = (z ^ (z >> 27)) * 0x94d049bb133111eb
	return z ^ (z >> 31)
}

type ringTok struct {
	t     uint64
	owner int
}

type hashRing struct {
	members []string
	tokens  []ringTok
}

// detectTokens finds the tokens per member with which the ring of `members` gives every object
// of `owners` (name → the member that handled its create) to that member; 0 when none does.
func detectTokens(members []string, owners, uids map[string]string) int {
	for _, tokens := range tokenCandidates {
		ring := newHashRing(members, tokens)
		ok := len(owners) > 0
		for name, member := range owners {
			if ring.ownerOf(uids[name]) != member {
				ok = false
				break
			}
		}
		if ok {
			return tokens
		}
	}
	return 0
}

func newHashRing(ids []string, tokens int) *hashRing {
	set := map[string]bool{}
	var members []string
	for _, id := range ids {
		if !set[id] {
			set[id] = true
			members = append(members, id)
		}
	}
	sort.Strings(members)
	r := &hashRing{members: members}
	for owner, id := range members {
		base := fnv1a64(id)
		for i := uint32(0); i < uint32(tokens); i++ {
			r.tokens = append(r.tokens, ringTok{ringToken(base, i), owner})
		}
	}
	sort.Slice(r.tokens, func(i, j int) bool {
		if r.tokens[i].t != r.tokens[j].t {
			return r.tokens[i].t < r.tokens[j].t
		}
		return r.tokens[i].owner < r.tokens[j].owner
	})
	dedup := r.tokens[:0]
	for i, tok := range r.tokens {
		if i == 0 || tok.t != r.tokens[i-1].t {
			dedup = append(dedup, tok)
		}
	}
	r.tokens = dedup
	return r
}

func (r *hashRing) ownerOf(uid string) string {
	if len(r.tokens) == 0 {
		return ""
	}
	p := fnv1a64(uid)
	i := sort.Search(len(r.tokens), func(i int) bool { return r.tokens[i].t >= p })
	if i == len(r.tokens) {
		i = 0
	}
	return r.members[r.tokens[i].owner]
}

// shares is each member's part of the hash space.
func (r *hashRing) shares() map[string]float64 {
	out := map[string]float64{}
	for i, tok := range r.tokens {
		prev := r.tokens[(i+len(r.tokens)-1)%len(r.tokens)].t
		arc := tok.t - prev // wraps for the first token
		if len(r.tokens) == 1 {
			arc = math.MaxUint64
		}
		out[r.members[tok.owner]] += float64(arc) / math.Pow(2, 64)
	}
	return out
}

func memberIDs(members []*shardMember) []string {
	var out []string
	for _, m := range members {
		out = append(out, m.id)
	}
	return out
}

// ---------------------------------------------------------------------------------------------
// Objects.

// uids lists the example objects of ns: name → uid.
func (b *shardingBench) uids(ns string) (map[string]string, error) {
	out := map[string]string{}
	cont := ""
	for {
		list, err := b.srv.dyn.Resource(exampleGVR).Namespace(ns).List(b.ctx, metav1.ListOptions{Limit: 500, Continue: cont})
		if err != nil {
			return nil, err
		}
		for _, item := range list.Items {
			out[item.GetName()] = string(item.GetUID())
		}
		if cont = list.GetContinue(); cont == "" {
			return out, nil
		}
	}
}

// patchAll sets spec.field of every object to value, 64 patches in flight; returns when each
// patch was acknowledged.
func (b *shardingBench) patchAll(ns string, names []string, value string) (map[string]time.Time, error) {
	acks := make(map[string]time.Time, len(names))
	var mu sync.Mutex
	var firstErr error
	jobs := make(chan string)
	var wg sync.WaitGroup
	patch := []byte(fmt.Sprintf(`{"spec":{"field":%q}}`, value))
	for w := 0; w < 64; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for name := range jobs {
				var err error
				for attempt := 0; attempt < 5; attempt++ {
					_, err = b.srv.dyn.Resource(exampleGVR).Namespace(ns).Patch(b.ctx, name, types.MergePatchType, patch, metav1.PatchOptions{})
					if err == nil || b.ctx.Err() != nil {
						break
					}
					time.Sleep(200 * time.Millisecond)
				}
				now := time.Now()
				mu.Lock()
				if err != nil && firstErr == nil {
					firstErr = fmt.Errorf("patching %s/%s: %w", ns, name, err)
				}
				acks[name] = now
				mu.Unlock()
			}
		}()
	}
	for _, n := range names {
		jobs <- n
	}
	close(jobs)
	wg.Wait()
	return acks, firstErr
}

func objectNames(prefix string, n int) []string {
	out := make([]string, n)
	for i := range out {
		out[i] = fmt.Sprintf("%s-%05d", prefix, i)
	}
	return out
}

func seenKeys(names []string, value string) []string {
	out := make([]string, len(names))
	for i, n := range names {
		out[i] = "seen " + n + " " + value
	}
	return out
}

// waitSeen waits until every object's change to value was handled (by any member).
func (b *shardingBench) waitSeen(tail *callTail, names []string, value string, timeout time.Duration) error {
	keys := seenKeys(names, value)
	err := waitUntil(b.ctx, timeout, func() bool { return len(tail.missing(keys)) == 0 })
	if err != nil {
		missing := tail.missing(keys)
		if len(missing) > 5 {
			missing = append(missing[:5], "…")
		}
		return fmt.Errorf("%d of %d changes to %q not handled: %v (%v)", len(tail.missing(keys)), len(names), value, missing, err)
	}
	return nil
}

// cleanup deletes the objects of ns (its members stopped first) and waits until they are gone.
func (b *shardingBench) cleanup(ns string) {
	api := b.srv.dyn.Resource(exampleGVR).Namespace(ns)
	deadline := time.Now().Add(5 * time.Minute)
	for {
		err := api.DeleteCollection(b.ctx, metav1.DeleteOptions{}, metav1.ListOptions{})
		list, lerr := api.List(b.ctx, metav1.ListOptions{Limit: 1})
		if lerr == nil && len(list.Items) == 0 {
			return
		}
		if b.ctx.Err() != nil || time.Now().After(deadline) {
			b.fail("deleting the objects of %s: %v %v", ns, err, lerr)
			return
		}
		time.Sleep(time.Second)
	}
}

// ---------------------------------------------------------------------------------------------
// 1. Hand-over.

func (b *shardingBench) runHandover() {
	const ns, ring = "sharding-handover", "ho"
	n := b.o.handoverObjects
	say("sharding: hand-over, %d members, %d objects", b.o.handoverMembers, n)
	if err := ensureNamespace(b.ctx, b.srv.dyn, ns); err != nil {
		b.fail("hand-over: %v", err)
		return
	}
	members, err := b.startMembers(ns, ring, "create,update-seen", b.o.handoverMembers)
	if err != nil {
		b.fail("hand-over: starting the members: %v", err)
		return
	}
	all := append([]*shardMember(nil), members...)
	defer func() {
		stopMembers(all)
		b.cleanup(ns)
	}()
	tail := newCallTail()
	defer tail.close()
	for _, m := range members {
		tail.add(m.id, m.calls)
	}
	names := objectNames("ho", n)
	if _, _, err := createMany(b.ctx, b.srv.dyn, ns, "ho", n, 64, func(int) map[string]any { return spec1KiB() }); err != nil {
		b.fail("hand-over: creating the objects: %v", err)
		return
	}
	if err := b.srv.obs.waitCount(b.ctx, handledMarker, ns, n, 120*time.Second); err != nil {
		b.fail("hand-over: the creates: %v", err)
		return
	}
	uids, err := b.uids(ns)
	if err != nil {
		b.fail("hand-over: listing: %v", err)
		return
	}
	// The driver's ring is the controllers': every create was handled by the owner it names.
	if !b.knowTokens(memberIDs(members), tail, uids) {
		b.fail("hand-over: no ring of %v tokens per member gives every create to the member that handled it (the driver's ring differs from capstan's)", tokenCandidates)
		return
	}
	time.Sleep(2 * time.Second) // the creates' writes settle
	var changes []string
	next := len(members) + 1
	for _, kind := range b.o.scenarios {
		if b.ctx.Err() != nil {
			return
		}
		value := "v-" + kind
		r, after := b.handover(kind, ns, ring, &next, members, tail, names, uids, value, &all)
		changes = append(changes, value)
		b.res.Handover = append(b.res.Handover, r)
		if r.Failure != "" {
			b.fail("hand-over %s: %s", kind, r.Failure)
			break
		}
		say("sharding: %s: %d moved; from the ring change p50 %.2fs p99 %.2fs max %.2fs (target %.0fs)", r.Scenario, r.Moved, r.FromRingChange.P50S, r.FromRingChange.P99S, r.FromRingChange.MaxS, r.TargetS)
		members = after
		time.Sleep(2 * time.Second)
	}
	time.Sleep(time.Second)
	b.res.Once = append(b.res.Once, tail.once("hand-over ("+ring+")", names, changes))
}

// handover runs one ring change and measures it; returns the members after it.
func (b *shardingBench) handover(kind, ns, ring string, next *int, members []*shardMember, tail *callTail, names []string, uids map[string]string, value string, all *[]*shardMember) (handoverResult, []*shardMember) {
	r := handoverResult{Kind: kind, Objects: len(names), MembersBefore: memberIDs(members), PauseSumS: map[string]float64{}, PauseCount: map[string]float64{}}
	before := map[string]map[string]float64{}
	for _, m := range members {
		before[m.id] = m.metrics()
	}
	var after []*shardMember
	var t0 time.Time
	switch kind {
	case "leave", "crash":
		victim := members[len(members)-1]
		if kind == "crash" {
			victim = members[0]
		}
		for _, m := range members {
			if m != victim {
				after = append(after, m)
			}
		}
		r.Member = victim.id
		r.Scenario = fmt.Sprintf("%s: %d→%d, %s", kind, len(members), len(after), map[string]string{"leave": "SIGTERM", "crash": "SIGKILL"}[kind])
		t0 = time.Now()
		if kind == "leave" {
			r.RingChange = "SIGTERM sent to the member's controller"
			victim.terminate()
		} else {
			r.RingChange = "SIGKILL sent to the member's controller and handler process"
			victim.kill()
		}
		r.TargetS = 5
		if kind == "crash" {
			r.TargetS = b.o.leaseDuration.Seconds() + 5
		}
	case "join":
		id := fmt.Sprintf("m%d", *next)
		*next++
		started := time.Now()
		m, err := b.startMember(ns, ring, id, "create,update-seen")
		if err != nil {
			r.Failure = err.Error()
			return r, members
		}
		*all = append(*all, m)
		tail.add(m.id, m.calls)
		after = append(append(after, members...), m)
		r.Member = id
		r.Scenario = fmt.Sprintf("join: %d→%d, a new member", len(members), len(after))
		created, err := b.leaseCreated(ring, id, started)
		if err != nil {
			r.Failure = err.Error()
			return r, after
		}
		r.LeaseAfterStartS = created.Sub(started).Seconds()
		// A new member watches the ring for --sharding-settle before it writes its Lease;
		// from then on it is in every member's view.
		t0 = created
		r.RingChange = "the new member's Lease created (its first spec.renewTime)"
		r.TargetS = 5
	}
	r.MembersAfter = memberIDs(after)
	oldRing, newRing := newHashRing(r.MembersBefore, b.tokens), newHashRing(r.MembersAfter, b.tokens)
	settledAt := make(chan time.Time, 1)
	settleCtx, stopSettle := context.WithCancel(b.ctx)
	defer stopSettle()
	go func() {
		at, err := b.settled(settleCtx, after, len(after), b.o.leaseDuration+90*time.Second)
		if err != nil && settleCtx.Err() == nil {
			say("sharding: %s: %v", kind, err)
		}
		settledAt <- at
	}()
	// The objects that move are changed first: the driver's own patching (a few seconds for
	// 1,000 objects on this machine) is then less of what is measured.
	var ordered, rest []string
	for _, name := range names {
		if oldRing.ownerOf(uids[name]) != newRing.ownerOf(uids[name]) {
			ordered = append(ordered, name)
		} else {
			rest = append(rest, name)
		}
	}
	acks, err := b.patchAll(ns, append(ordered, rest...), value)
	if err != nil {
		r.Failure = err.Error()
		return r, after
	}
	for name, t := range acks {
		r.PatchedS = math.Max(r.PatchedS, t.Sub(t0).Seconds())
		if oldRing.ownerOf(uids[name]) != newRing.ownerOf(uids[name]) {
			r.PatchedMovedS = math.Max(r.PatchedMovedS, t.Sub(t0).Seconds())
		}
	}
	if err := b.waitSeen(tail, names, value, b.o.leaseDuration+90*time.Second); err != nil {
		var logs []string
		for _, m := range after {
			logs = append(logs, fmt.Sprintf("--- %s (%s):\n%s", m.id, m.ringView(), m.ctrl.tail(8)))
		}
		r.Failure = fmt.Sprintf("%v\n%s", err, strings.Join(logs, "\n"))
		return r, after
	}
	if at := <-settledAt; !at.IsZero() {
		r.SettledS = at.Sub(t0).Seconds()
	}
	var moved, fromPatch, everyone []float64
	for _, name := range names {
		c, _ := tail.first("seen " + name + " " + value)
		d := c.at.Sub(t0).Seconds()
		everyone = append(everyone, d)
		was, is := oldRing.ownerOf(uids[name]), newRing.ownerOf(uids[name])
		if c.member != is && c.member != was {
			r.ByNeither++
		}
		if was == is {
			continue
		}
		r.Moved++
		if c.member == was {
			r.MovedByOldOwner++
		}
		moved = append(moved, d)
		fromPatch = append(fromPatch, c.at.Sub(acks[name]).Seconds())
	}
	r.FromRingChange, r.FromPatch, r.All = statsOf(moved), statsOf(fromPatch), statsOf(everyone)
	r.Met = r.Moved > 0 && r.FromRingChange.MaxS <= r.TargetS && r.ByNeither == 0
	for _, m := range after {
		now := m.metrics()
		key := `{member="` + m.id + `"}`
		r.PauseSumS[m.id] = now["capstan_sharding_handover_seconds_sum"+key] - before[m.id]["capstan_sharding_handover_seconds_sum"+key]
		r.PauseCount[m.id] = now["capstan_sharding_handover_seconds_count"+key] - before[m.id]["capstan_sharding_handover_seconds_count"+key]
	}
	if r.ByNeither > 0 {
		r.Failure = fmt.Sprintf("%d changes were handled by a member that owns the object in neither ring", r.ByNeither)
	}
	return r, after
}

// leaseCreated waits for the member Lease of `id` and returns its creation: the renewTime of
// its first version (the member's clock is this machine's), else when it was first seen.
func (b *shardingBench) leaseCreated(ring, id string, since time.Time) (time.Time, error) {
	name := ring + "-member-" + id
	deadline := since.Add(60 * time.Second)
	for time.Now().Before(deadline) {
		lease, err := b.srv.dyn.Resource(leaseGVR).Namespace(shardLeaseNamespace).Get(b.ctx, name, metav1.GetOptions{})
		seen := time.Now()
		if err == nil {
			if s, ok, _ := unstructured.NestedString(lease.Object, "spec", "renewTime"); ok {
				if t, err := time.Parse(time.RFC3339Nano, s); err == nil && t.After(since.Add(-time.Second)) && t.Before(seen.Add(time.Second)) {
					return t, nil
				}
			}
			return seen, nil
		}
		if !apierrors.IsNotFound(err) {
			return time.Time{}, err
		}
		if b.ctx.Err() != nil {
			return time.Time{}, b.ctx.Err()
		}
		time.Sleep(tailEvery)
	}
	return time.Time{}, fmt.Errorf("the Lease %s/%s did not appear within 60s", shardLeaseNamespace, name)
}

// ---------------------------------------------------------------------------------------------
// 2. Throughput with a latency-bound handler.

func (b *shardingBench) runThroughput(n int) {
	ns, ring := fmt.Sprintf("sharding-tp-%d", n), fmt.Sprintf("tp%d", n)
	objects := b.o.tpObjects
	r := throughputResult{Members: n, Objects: objects}
	record := func() { b.res.Throughput = append(b.res.Throughput, r) }
	say("sharding: throughput, %d member(s), %d objects", n, objects)
	if err := ensureNamespace(b.ctx, b.srv.dyn, ns); err != nil {
		r.Failure = err.Error()
		b.fail("throughput %d: %v", n, err)
		record()
		return
	}
	members, err := b.startMembers(ns, ring, "create,update-seen", n, "--max-in-flight", strconv.Itoa(b.o.inFlight))
	if err != nil {
		r.Failure = err.Error()
		b.fail("throughput %d: starting the members: %v", n, err)
		record()
		return
	}
	tail := newCallTail()
	for _, m := range members {
		tail.add(m.id, m.calls)
	}
	prefix := fmt.Sprintf("tp%d", n)
	t0 := time.Now()
	_, created, err := createMany(b.ctx, b.srv.dyn, ns, prefix, objects, 64, func(int) map[string]any {
		s := spec1KiB()
		s["sleep"] = map[string]any{"create_fn": b.o.sleep}
		return s
	})
	r.CreateS = created.Seconds()
	if err == nil {
		// 200 ms per call, 8 at once: 40 objects/s per member at best; allow a quarter of that.
		err = b.srv.obs.waitCount(b.ctx, handledMarker, ns, objects, 60*time.Second+time.Duration(float64(objects)/(float64(b.o.inFlight)/b.o.sleep)*4*float64(time.Second)))
	}
	if err != nil {
		r.Failure = err.Error()
		b.fail("throughput %d: %v", n, err)
	} else {
		_, last := b.srv.obs.firstAndLast(handledMarker, ns)
		r.TotalS = last.Sub(t0).Seconds()
		r.PerS = float64(objects) / r.TotalS
		for _, tp := range b.res.Throughput {
			if tp.Members == 1 && tp.Failure == "" && n > 1 {
				r.Ratio = r.PerS / (float64(n) * tp.PerS)
				r.Met = r.Ratio >= 0.9
			}
		}
		if n == 1 {
			r.Ratio, r.Met = 1, true
		}
		say("sharding: throughput %d member(s): %.1f objects/s in %.2fs (ratio %.2f)", n, r.PerS, r.TotalS, r.Ratio)
	}
	time.Sleep(time.Second)
	stopMembers(members)
	tail.close()
	r.Handled = tail.byMember("create_fn")
	if n > 1 && b.tokens == 0 {
		if uids, err := b.uids(ns); err == nil {
			b.knowTokens(memberIDs(members), tail, uids)
		}
	}
	if b.tokens > 0 {
		r.Shares = newHashRing(memberIDs(members), b.tokens).shares()
	}
	busiest := 0
	for _, c := range r.Handled {
		busiest = max(busiest, c)
	}
	if busiest > 0 {
		r.Bound = float64(objects) / float64(n*busiest)
	}
	b.res.Once = append(b.res.Once, tail.once(fmt.Sprintf("throughput, %d member(s) (%s)", n, ring), objectNames(prefix, objects), nil))
	record()
	b.cleanup(ns)
}

// ---------------------------------------------------------------------------------------------
// 3. Per-member cost: watch events and memory.

func (b *shardingBench) runCost(n int) {
	tag := strings.ReplaceAll(b.srv.tag, ".", "")
	ns, ring := fmt.Sprintf("sharding-cost-%s-%d", tag, n), fmt.Sprintf("c%s-%d", tag, n)
	objects := b.o.costObjects
	server := "1.35 (no shard filter)"
	if b.srv.tag != "1.35" {
		server = b.srv.tag + " (" + shardGate + ")"
	}
	r := costResult{Server: server, Members: n, Objects: objects}
	record := func() { b.res.Cost = append(b.res.Cost, r) }
	say("sharding: per-member cost on %s, %d member(s), %d objects", server, n, objects)
	if err := ensureNamespace(b.ctx, b.srv.dyn, ns); err != nil {
		r.Failure = err.Error()
		b.fail("cost %s %d: %v", b.srv.tag, n, err)
		record()
		return
	}
	members, err := b.startMembers(ns, ring, "create,update-seen", n)
	if err != nil {
		r.Failure = err.Error()
		b.fail("cost %s %d: starting the members: %v", b.srv.tag, n, err)
		record()
		return
	}
	defer func() {
		stopMembers(members)
		b.cleanup(ns)
	}()
	tail := newCallTail()
	defer tail.close()
	for _, m := range members {
		tail.add(m.id, m.calls)
	}
	prefix := fmt.Sprintf("c%sn%d", tag, n)
	names := objectNames(prefix, objects)
	_, _, err = createMany(b.ctx, b.srv.dyn, ns, prefix, objects, 64, func(int) map[string]any { return spec1KiB() })
	if err == nil {
		err = b.srv.obs.waitCount(b.ctx, handledMarker, ns, objects, 180*time.Second)
	}
	if err == nil {
		time.Sleep(time.Second)
		_, err = b.patchAll(ns, names, "changed")
	}
	if err == nil {
		err = b.waitSeen(tail, names, "changed", 180*time.Second)
	}
	if err != nil {
		r.Failure = err.Error()
		b.fail("cost %s %d: %v", b.srv.tag, n, err)
		record()
		return
	}
	time.Sleep(3 * time.Second) // the writes after the handlers, and their echoes, arrive
	for _, m := range members {
		series := m.metrics()
		c := memberCost{
			Member:      m.id,
			WatchEvents: metricSum(series, "capstan_watch_events_total"),
			RSSMiB:      metricSum(series, "process_resident_memory_bytes") / (1 << 20),
			Objects:     metricSum(series, "capstan_sharding_objects"),
		}
		if mem, err := readMemory(m.ctrl.pid()); err == nil {
			c.HWMMiB = mib(mem.HWMKiB)
		}
		c.CPUS = cpuSeconds(m.ctrl.pid())
		r.PerMember = append(r.PerMember, c)
		r.MeanEvents += c.WatchEvents / float64(n)
		r.MeanRSSMiB += c.RSSMiB / float64(n)
		if f := m.serverFilters(); f != "" {
			r.ServerFilters = f
		}
	}
	say("sharding: cost on %s, %d member(s): %.0f watch events and %.1f MiB per member; server filters: %q", server, n, r.MeanEvents, r.MeanRSSMiB, r.ServerFilters)
	b.res.Once = append(b.res.Once, tail.once(fmt.Sprintf("per-member cost, %s, %d member(s) (%s)", b.srv.tag, n, ring), names, []string{"changed"}))
	record()
}

// ---------------------------------------------------------------------------------------------
// Report.

func writeSharding(dir string, r *shardingResults) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	data, _ := json.MarshalIndent(r, "", "  ")
	if err := os.WriteFile(filepath.Join(dir, "sharding.json"), data, 0o644); err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(dir, "sharding.md"), []byte(shardingMarkdown(r)), 0o644); err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(dir, "sharding.svg"), []byte(shardingSVG(r)), 0o644)
}

func shardingMarkdown(r *shardingResults) string {
	var b strings.Builder
	mode := "full run"
	if r.Smoke {
		mode = "smoke run (few objects; the figures prove the workloads run, not their scale)"
	}
	by := "`scripts/bench.sh --sharding`"
	if r.Smoke {
		by = "`scripts/bench.sh --smoke`"
	}
	fmt.Fprintf(&b, "# Sharding: hand-over, throughput and per-member cost\n\n%s, %s, %.0f s. Produced by %s; raw figures in `sharding.json`, the plot in `sharding.svg`.\n\n", mode, r.Started.UTC().Format("2006-01-02 15:04 UTC"), r.DurationS, by)
	fmt.Fprintf(&b, "Machine: %d cores (%s), %.1f GiB memory; load average %s before, %s after. The API server (with etcd), every member (controller + handler process) and the driver share these cores.\n\n", r.Machine.Cores, r.Machine.CPU, r.Machine.MemoryGiB, r.Machine.LoadBefore, r.Machine.LoadAfter)
	var vs []string
	for _, k := range sortedKeys(r.Versions) {
		vs = append(vs, fmt.Sprintf("%s: `%s`", k, r.Versions[k]))
	}
	fmt.Fprintf(&b, "Versions: %s.\n\n", strings.Join(vs, "; "))
	var ss []string
	for _, k := range sortedKeys(r.Settings) {
		ss = append(ss, fmt.Sprintf("`%s` %s", k, r.Settings[k]))
	}
	fmt.Fprintf(&b, "Settings: %s.\n\n", strings.Join(ss, "; "))

	if len(r.Handover) > 0 {
		b.WriteString("## Hand-over\n\n")
		fmt.Fprintf(&b, "%d objects spread over the members; right after each ring change the driver changes every object (those that move first), and the time until an object's change is handled is read from the members' call logs (polled every %s). *Moved*: objects whose owner differs between the ring before and after. Every member pauses on a ring change, so the last column is every object's change, moved or not.\n\n", r.Handover[0].Objects, tailEvery)
		b.WriteString("| scenario | ring change (t = 0) | moved | handled by the old owner | patches acknowledged by (s): moved / all | moved: t → handled p50 / p99 / max (s) | moved: own patch → handled p50 / p99 / max (s) | ring settled (s) | members' pause (s) | target (max) | verdict | every object: max (s) |\n|---|---|---|---|---|---|---|---|---|---|---|---|\n")
		for _, h := range r.Handover {
			if h.Failure != "" {
				fmt.Fprintf(&b, "| %s | %s | did not complete: %s | | | | | | | | | |\n", h.Scenario, h.RingChange, oneLine(h.Failure))
				continue
			}
			fmt.Fprintf(&b, "| %s | %s | %d | %d | %.2f / %.2f | %.2f / %.2f / **%.2f** | %.2f / %.2f / %.2f | %.2f | %s | ≤ %.0f s | %s | %.2f |\n",
				h.Scenario, h.RingChange, h.Moved, h.MovedByOldOwner, h.PatchedMovedS, h.PatchedS,
				h.FromRingChange.P50S, h.FromRingChange.P99S, h.FromRingChange.MaxS,
				h.FromPatch.P50S, h.FromPatch.P99S, h.FromPatch.MaxS, h.SettledS, pauses(h), h.TargetS, verdict(h.Met), h.All.MaxS)
		}
		b.WriteString("\nMembers' pause: `capstan_sharding_handover_seconds` over the scenario, per remaining member (sum of its pauses, from seeing the new ring to handling its new ranges).")
		for _, h := range r.Handover {
			if h.Kind == "join" && h.Failure == "" {
				fmt.Fprintf(&b, " Join: the new member's Lease was created %.2f s after its process started (`--sharding-settle` %s), and every member's readiness said the ring of %d, settled, %.2f s after the Lease appeared; the new member's pause counts from its start.", h.LeaseAfterStartS, r.Settings["--sharding-settle"], len(h.MembersAfter), h.SettledS)
			}
		}
		b.WriteString("\n\n")
	}

	if len(r.Throughput) > 0 {
		b.WriteString("## Throughput with a latency-bound handler\n\n")
		fmt.Fprintf(&b, "Each create_fn call sleeps %s; at most %s. N objects are created at once (64 creates in flight) into a settled ring; total = first create sent → the last object's handled marker observed by the driver's watch. Target: ≥ 0.9 × n × the 1-member figure. *Bound*: the ratio if every member handled its objects at the 1-member rate, N / (n × the busiest member's objects): objects are placed by the hash of their uid, so the busiest member has more than N/n (its share of the ring, and chance).\n\n", r.Settings["create_fn sleep"], "`--max-in-flight` "+r.Settings["--max-in-flight"])
		b.WriteString("| members | objects | total (s) | objects/s | vs n × 1 member | target | bound by the busiest member | objects handled per member (ring share) |\n|---|---|---|---|---|---|---|---|\n")
		for _, t := range r.Throughput {
			if t.Failure != "" {
				fmt.Fprintf(&b, "| %d | %d | did not complete: %s | | | | | |\n", t.Members, t.Objects, oneLine(t.Failure))
				continue
			}
			var per []string
			for _, id := range sortedKeys(t.Handled) {
				if share, ok := t.Shares[id]; ok {
					per = append(per, fmt.Sprintf("%s %d (%.1f%%)", id, t.Handled[id], share*100))
				} else {
					per = append(per, fmt.Sprintf("%s %d", id, t.Handled[id]))
				}
			}
			target := "–"
			if t.Members > 1 {
				target = "≥ 0.90 — " + verdict(t.Met)
			}
			fmt.Fprintf(&b, "| %d | %d | %.2f | %.1f | %.2f | %s | %.2f | %s |\n", t.Members, t.Objects, t.TotalS, t.PerS, t.Ratio, target, t.Bound, strings.Join(per, ", "))
		}
		b.WriteString("\n")
	}

	if len(r.Cost) > 0 {
		b.WriteString("## Per-member cost: watch events and memory\n\n")
		fmt.Fprintf(&b, "%d objects created and handled, then each changed once and handled; then each member's `capstan_watch_events_total` (objects received from its watches, before other members' are dropped) and `process_resident_memory_bytes`. *Members' log*: what the members say of the server: *yes* (\"the API server filters by shard\": it echoed shardInfo), *not confirmed* (\"did not confirm a shard filter\": no shardInfo, which 1.35 never sends and 1.36 does not send for custom resources), or *–* (one member sends no selector); the watch events show what the server did. Controller CPU: utime+stime of the member's `capstan` from its start (the ring's start-up included).\n\n", r.Cost[0].Objects)
		b.WriteString("| server | members | members' log: server filters by shard | watch events per member | mean | vs 1 member | RSS per member (MiB) | mean RSS (MiB) | controller CPU per member (s) | objects per member |\n|---|---|---|---|---|---|---|---|---|---|\n")
		one := map[string]float64{}
		for _, c := range r.Cost {
			if c.Members == 1 && c.Failure == "" {
				one[c.Server] = c.MeanEvents
			}
		}
		for _, c := range r.Cost {
			if c.Failure != "" {
				fmt.Fprintf(&b, "| %s | %d | did not complete: %s | | | | | | | |\n", c.Server, c.Members, oneLine(c.Failure))
				continue
			}
			var ev, rss, cpu, objs []string
			for _, m := range c.PerMember {
				ev = append(ev, fmt.Sprintf("%.0f", m.WatchEvents))
				rss = append(rss, fmt.Sprintf("%.1f", m.RSSMiB))
				cpu = append(cpu, fmt.Sprintf("%.2f", m.CPUS))
				objs = append(objs, fmt.Sprintf("%.0f", m.Objects))
			}
			vs := "–"
			if base := one[c.Server]; base > 0 {
				vs = fmt.Sprintf("%.2f (1/n = %.2f)", c.MeanEvents/base, 1/float64(c.Members))
			}
			filters := c.ServerFilters
			if filters == "" {
				filters = "– (no selector)"
			}
			fmt.Fprintf(&b, "| %s | %d | %s | %s | %.0f | %s | %s | %.1f | %s | %s |\n", c.Server, c.Members, filters, strings.Join(ev, ", "), c.MeanEvents, vs, strings.Join(rss, ", "), c.MeanRSSMiB, strings.Join(cpu, ", "), strings.Join(objs, ", "))
		}
		b.WriteString("\n")
	}

	if len(r.Once) > 0 {
		b.WriteString("## Never twice\n\n")
		b.WriteString("Across the members' call logs of each group: `seen <name> <value>` lines (one per handled change; every change has a value of its own) and create_fn calls.\n\n")
		b.WriteString("| group | objects | `seen` lines | repeated | changes never handled | create_fn calls | beyond one per object | objects never created | verdict |\n|---|---|---|---|---|---|---|---|---|\n")
		for _, o := range r.Once {
			ok := o.SeenRepeated == 0 && o.CreateBeyondOne == 0 && o.SeenMissing == 0 && o.CreateMissing == 0
			fmt.Fprintf(&b, "| %s | %d | %d | **%d** | %d | %d | **%d** | %d | %s |\n", o.Group, o.Objects, o.SeenLines, o.SeenRepeated, o.SeenMissing, o.CreateCalls, o.CreateBeyondOne, o.CreateMissing, verdict(ok))
		}
		b.WriteString("\n")
	}
	for _, n := range r.Notes {
		fmt.Fprintf(&b, "Note: %s\n\n", n)
	}
	for _, f := range r.Failures {
		fmt.Fprintf(&b, "FAILED: %s\n\n", oneLine(f))
	}
	return b.String()
}

func pauses(h handoverResult) string {
	var out []string
	for _, id := range sortedKeys(h.PauseSumS) {
		out = append(out, fmt.Sprintf("%s %.2f", id, h.PauseSumS[id]))
	}
	return strings.Join(out, ", ")
}

func oneLine(s string) string {
	return strings.ReplaceAll(strings.SplitN(s, "\n", 2)[0], "|", "/")
}

func sortedKeys[V any](m map[string]V) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys
}

// shardingSVG draws three panels: throughput against members with the 0.9·n target line, the
// hand-over times per scenario against their targets, and the watch events per member with
// and without the server's shard filter.
func shardingSVG(r *shardingResults) string {
	const w, h, pad = 1260, 400, 60
	pw, ph := w/3-pad-30, h-2*pad
	var s strings.Builder
	fmt.Fprintf(&s, `<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" font-family="sans-serif" font-size="12">`+"\n", w, h)
	fmt.Fprintf(&s, `<rect width="%d" height="%d" fill="white"/>`+"\n", w, h)
	axes := func(x0 int, title string, maxV float64, unit string) func(float64) float64 {
		yOf := func(v float64) float64 { return float64(pad+ph) - v/maxV*float64(ph) }
		fmt.Fprintf(&s, `<text x="%d" y="%d" font-weight="bold">%s</text>`+"\n", x0+pad, pad-24, title)
		fmt.Fprintf(&s, `<line x1="%d" y1="%d" x2="%d" y2="%d" stroke="black"/>`+"\n", x0+pad, pad+ph, x0+pad+pw, pad+ph)
		fmt.Fprintf(&s, `<line x1="%d" y1="%d" x2="%d" y2="%d" stroke="black"/>`+"\n", x0+pad, pad, x0+pad, pad+ph)
		for i := 0; i <= 4; i++ {
			v := maxV * float64(i) / 4
			fmt.Fprintf(&s, `<text x="%d" y="%.0f" text-anchor="end">%s</text>`+"\n", x0+pad-6, yOf(v)+4, trimFloat(v))
			fmt.Fprintf(&s, `<line x1="%d" y1="%.0f" x2="%d" y2="%.0f" stroke="#ddd"/>`+"\n", x0+pad+1, yOf(v), x0+pad+pw, yOf(v))
		}
		fmt.Fprintf(&s, `<text x="%d" y="%d" transform="rotate(-90 %d %d)" text-anchor="middle">%s</text>`+"\n", x0+14, pad+ph/2, x0+14, pad+ph/2, unit)
		return yOf
	}
	// A panel's x axis of 1..maxN members, labelled; where member counts go on it.
	membersAxis := func(x0, maxN int) func(int) float64 {
		xOf := func(n int) float64 {
			if maxN <= 1 {
				return float64(x0 + pad + pw/2)
			}
			return float64(x0+pad+20) + float64(n-1)/float64(maxN-1)*float64(pw-40)
		}
		for n := 1; n <= maxN; n++ {
			fmt.Fprintf(&s, `<text x="%.0f" y="%d" text-anchor="middle">%d</text>`+"\n", xOf(n), pad+ph+16, n)
		}
		fmt.Fprintf(&s, `<text x="%d" y="%d" text-anchor="middle">members</text>`+"\n", x0+pad+pw/2, pad+ph+34)
		return xOf
	}
	legend := func(x, y int, color, dash, text string) {
		fmt.Fprintf(&s, `<line x1="%d" y1="%d" x2="%d" y2="%d" stroke="%s" stroke-width="2" stroke-dasharray="%s"/><text x="%d" y="%d">%s</text>`+"\n", x, y-4, x+18, y-4, color, dash, x+22, y, text)
	}

	// Panel 1: throughput.
	{
		x0 := 0
		var one float64
		maxN := 1
		maxV := 1.0
		for _, t := range r.Throughput {
			if t.Failure != "" {
				continue
			}
			if t.Members == 1 {
				one = t.PerS
			}
			maxN = max(maxN, t.Members)
			maxV = math.Max(maxV, t.PerS)
		}
		maxV = math.Max(maxV, one*float64(maxN)) * 1.1
		yOf := axes(x0, "Throughput, 200 ms handler, 8 in flight", maxV, "objects/s")
		xOf := membersAxis(x0, maxN)
		if one > 0 {
			fmt.Fprintf(&s, `<line x1="%.1f" y1="%.1f" x2="%.1f" y2="%.1f" stroke="#999" stroke-dasharray="2,3"/>`+"\n", xOf(1), yOf(one), xOf(maxN), yOf(one*float64(maxN)))
			fmt.Fprintf(&s, `<line x1="%.1f" y1="%.1f" x2="%.1f" y2="%.1f" stroke="#d62728" stroke-dasharray="6,4"/>`+"\n", xOf(1), yOf(0.9*one), xOf(maxN), yOf(0.9*one*float64(maxN)))
		}
		var pts []string
		for _, t := range r.Throughput {
			if t.Failure == "" {
				pts = append(pts, fmt.Sprintf("%.1f,%.1f", xOf(t.Members), yOf(t.PerS)))
				fmt.Fprintf(&s, `<circle cx="%.1f" cy="%.1f" r="3" fill="#1f77b4"/><text x="%.1f" y="%.1f" font-size="10">%.0f</text>`+"\n", xOf(t.Members), yOf(t.PerS), xOf(t.Members)+5, yOf(t.PerS)-6, t.PerS)
			}
		}
		if len(pts) > 0 {
			fmt.Fprintf(&s, `<polyline fill="none" stroke="#1f77b4" stroke-width="2" points="%s"/>`+"\n", strings.Join(pts, " "))
		}
		legend(x0+pad+4, pad-6, "#1f77b4", "", "measured")
		legend(x0+pad+90, pad-6, "#d62728", "6,4", "target 0.9·n·one")
		legend(x0+pad+230, pad-6, "#999", "2,3", "n·one")
	}

	// Panel 2: hand-over times per scenario.
	{
		x0 := w / 3
		maxV := 1.0
		for _, ho := range r.Handover {
			maxV = math.Max(maxV, math.Max(ho.TargetS, ho.FromRingChange.MaxS))
		}
		maxV *= 1.1
		yOf := axes(x0, "Hand-over: ring change → moved objects handled", maxV, "seconds")
		slot := float64(pw) / float64(max(len(r.Handover), 1))
		bars := []struct {
			color string
			value func(handoverResult) float64
		}{
			{"#9ecae1", func(h handoverResult) float64 { return h.FromRingChange.P50S }},
			{"#4292c6", func(h handoverResult) float64 { return h.FromRingChange.P99S }},
			{"#08519c", func(h handoverResult) float64 { return h.FromRingChange.MaxS }},
		}
		for i, ho := range r.Handover {
			left := float64(x0+pad) + slot*float64(i)
			bw := slot / 5
			if ho.Failure == "" {
				for j, bar := range bars {
					v := bar.value(ho)
					fmt.Fprintf(&s, `<rect x="%.1f" y="%.1f" width="%.1f" height="%.1f" fill="%s"/>`+"\n", left+bw*(float64(j)+1), yOf(v), bw*0.9, float64(pad+ph)-yOf(v), bar.color)
				}
				fmt.Fprintf(&s, `<text x="%.1f" y="%.1f" font-size="10" text-anchor="middle">%.1f</text>`+"\n", left+bw*3.45, yOf(ho.FromRingChange.MaxS)-4, ho.FromRingChange.MaxS)
			}
			fmt.Fprintf(&s, `<line x1="%.1f" y1="%.1f" x2="%.1f" y2="%.1f" stroke="#d62728" stroke-dasharray="6,4" stroke-width="2"/>`+"\n", left+bw*0.5, yOf(ho.TargetS), left+bw*4.5, yOf(ho.TargetS))
			label, _, _ := strings.Cut(ho.Scenario, ",")
			fmt.Fprintf(&s, `<text x="%.1f" y="%d" text-anchor="middle">%s</text>`+"\n", left+slot/2, pad+ph+16, label)
		}
		fmt.Fprintf(&s, `<rect x="%d" y="%d" width="10" height="10" fill="#9ecae1"/><text x="%d" y="%d">p50</text>`+"\n", x0+pad+4, pad-16, x0+pad+18, pad-6)
		fmt.Fprintf(&s, `<rect x="%d" y="%d" width="10" height="10" fill="#4292c6"/><text x="%d" y="%d">p99</text>`+"\n", x0+pad+50, pad-16, x0+pad+64, pad-6)
		fmt.Fprintf(&s, `<rect x="%d" y="%d" width="10" height="10" fill="#08519c"/><text x="%d" y="%d">max</text>`+"\n", x0+pad+96, pad-16, x0+pad+110, pad-6)
		legend(x0+pad+146, pad-6, "#d62728", "6,4", "target")
	}

	// Panel 3: watch events per member.
	{
		x0 := 2 * w / 3
		maxV := 1.0
		maxN := 1
		servers := []string{}
		for _, c := range r.Cost {
			if c.Failure == "" {
				maxV = math.Max(maxV, c.MeanEvents)
				maxN = max(maxN, c.Members)
			}
			if !contains(servers, c.Server) {
				servers = append(servers, c.Server)
			}
		}
		maxV *= 1.1
		yOf := axes(x0, "Watch events per member", maxV, "objects received")
		xOf := membersAxis(x0, maxN)
		colors := []string{"#ff7f0e", "#2ca02c", "#9467bd"}
		for i, server := range servers {
			color := colors[i%len(colors)]
			var pts []string
			var one float64
			for _, c := range r.Cost {
				if c.Server == server && c.Failure == "" {
					pts = append(pts, fmt.Sprintf("%.1f,%.1f", xOf(c.Members), yOf(c.MeanEvents)))
					if c.Members == 1 {
						one = c.MeanEvents
					}
				}
			}
			if len(pts) > 0 {
				fmt.Fprintf(&s, `<polyline fill="none" stroke="%s" stroke-width="2" points="%s"/>`+"\n", color, strings.Join(pts, " "))
			}
			if one > 0 && i > 0 {
				var ideal []string
				for n := 1; n <= maxN; n++ {
					ideal = append(ideal, fmt.Sprintf("%.1f,%.1f", xOf(n), yOf(one/float64(n))))
				}
				fmt.Fprintf(&s, `<polyline fill="none" stroke="#999" stroke-dasharray="2,3" points="%s"/>`+"\n", strings.Join(ideal, " "))
			}
			legend(x0+pad+10, pad+ph-56+16*i, color, "", server)
		}
		if len(servers) > 1 {
			legend(x0+pad+10, pad+ph-56+16*len(servers), "#999", "2,3", "1/n of one member's")
		}
	}
	s.WriteString("</svg>\n")
	return s.String()
}

func trimFloat(v float64) string {
	if v >= 10 {
		return fmt.Sprintf("%.0f", v)
	}
	return fmt.Sprintf("%.1f", v)
}
