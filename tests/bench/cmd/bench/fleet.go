package main

// The fleet simulation (per-node mode at scale): N controllers, each with its own node name
// and handler process, against one API server, handle changes of one shared object. For each
// per-node storage (annotations, status, node-local files) and each N it measures, per change
// of the object: the PATCHes the controllers sent, the watch events delivered to them, the
// object's size, the API server's CPU, and the time until every node has handled the change.

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"math"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/dynamic"
)

// fleetStorages are the per-node storages compared, with their controller flags.
var fleetStorages = []struct {
	name  string
	flags func(dir string) []string
}{
	{"annotations", func(string) []string { return nil }},
	{"status", func(string) []string {
		return []string{"--progress-storage", "status", "--diffbase-storage", "status"}
	}},
	{"node-local", func(dir string) []string { return []string{"--node-storage", "file:" + dir} }},
}

// fleetPoint is one storage at one fleet size.
type fleetPoint struct {
	Storage string `json:"storage"`
	Nodes   int    `json:"nodes"`
	// Per change, averaged over the changes.
	Patches        float64 `json:"patches_per_change"`
	WatchEvents    float64 `json:"watch_events_per_change"`
	ObjectBytes    int     `json:"object_bytes"`
	APIServerCPUms float64 `json:"apiserver_cpu_ms_per_change"`
	AllHandledMs   float64 `json:"all_nodes_handled_ms"`
	Failure        string  `json:"failure,omitempty"`
}

type fleetResults struct {
	Started time.Time    `json:"started"`
	Smoke   bool         `json:"smoke"`
	Profile string       `json:"profile"`
	Changes int          `json:"changes"`
	Machine machine      `json:"machine"`
	Points  []fleetPoint `json:"points"`
}

func runFleet(args []string) error {
	fs := flag.NewFlagSet("fleet", flag.ExitOnError)
	var out, testenv, capstanBin, handler, crd, nodes string
	var changes int
	var smoke bool
	var profile string
	fs.StringVar(&out, "out", "", "directory for fleet.md, fleet.json and fleet.svg")
	fs.StringVar(&testenv, "testenv", "", "the capstan-testenv binary")
	fs.StringVar(&capstanBin, "capstan", "", "the capstan binary")
	fs.StringVar(&handler, "rust-handler", "", "capstan-e2e-handler")
	fs.StringVar(&crd, "crd", "", "examples/crd.yaml")
	fs.StringVar(&nodes, "nodes", "1,10,30,100", "fleet sizes")
	fs.IntVar(&changes, "changes", 3, "changes of the shared object per fleet size")
	fs.BoolVar(&smoke, "smoke", false, "for CI: small fleets; any fleet that does not finish fails the run")
	fs.StringVar(&profile, "profile", "release", "the cargo profile capstan was built with (reported)")
	_ = fs.Parse(args)
	for _, req := range []struct{ v, n string }{{out, "out"}, {testenv, "testenv"}, {capstanBin, "capstan"}, {handler, "rust-handler"}, {crd, "crd"}} {
		if req.v == "" {
			return fmt.Errorf("--%s is required", req.n)
		}
	}
	sizes, err := parseSizes(nodes)
	if err != nil {
		return err
	}
	ctx, cancel := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer cancel()
	defer stopAll()
	work, err := os.MkdirTemp("", "capstan-fleet-")
	if err != nil {
		return err
	}
	audit := filepath.Join(work, "audit.log")
	api, kubeconfig, err := startAPIServer(testenv, work, audit)
	if err != nil {
		return err
	}
	cfg, err := restConfig(kubeconfig, "capstan-bench/driver")
	if err != nil {
		return err
	}
	dyn, err := dynamic.NewForConfig(cfg)
	if err != nil {
		return err
	}
	if err := applyCRD(ctx, dyn, crd); err != nil {
		return err
	}
	res := &fleetResults{Started: time.Now(), Smoke: smoke, Changes: changes, Machine: describeMachine(), Profile: profile}
	f := &fleet{ctx: ctx, dyn: dyn, work: work, kubeconfig: kubeconfig, capstan: capstanBin, handler: handler, api: api, audit: audit, changes: changes}
	failed := 0
	for _, st := range fleetStorages {
		for _, n := range sizes {
			if ctx.Err() != nil {
				return fmt.Errorf("interrupted (logs in %s)", work)
			}
			say("fleet: %s storage, %d nodes", st.name, n)
			p := f.measure(st.name, st.flags, n)
			if p.Failure != "" {
				failed++
				say("FAILED: %s", p.Failure)
			}
			res.Points = append(res.Points, p)
		}
	}
	api.stop(30 * time.Second)
	if err := writeFleet(out, res); err != nil {
		return err
	}
	say("wrote %s", filepath.Join(out, "fleet.md"))
	// In a full run a fleet that does not finish is a finding (where a storage stops scaling on
	// this machine), reported in the table; the smoke run must finish every fleet.
	if failed > 0 && smoke {
		return fmt.Errorf("%d fleet measurement(s) failed (logs in %s)", failed, work)
	}
	_ = os.RemoveAll(work)
	return nil
}

type fleet struct {
	ctx        context.Context
	dyn        dynamic.Interface
	work       string
	kubeconfig string
	capstan    string
	handler    string
	api        *proc
	audit      string
	changes    int
}

// measure runs one fleet: starts n node operators, creates the shared object, changes it
// f.changes times and takes the figures of each change.
func (f *fleet) measure(storage string, flags func(string) []string, n int) fleetPoint {
	p := fleetPoint{Storage: storage, Nodes: n}
	ns := fmt.Sprintf("fleet-%s-%d", storage, n)
	if err := ensureNamespace(f.ctx, f.dyn, ns); err != nil {
		p.Failure = err.Error()
		return p
	}
	dir := filepath.Join(f.work, ns)
	_ = os.MkdirAll(dir, 0o755)
	var nodes []*running
	defer func() {
		for _, r := range nodes {
			r.stop()
		}
	}()
	for i := 0; i < n; i++ {
		r, err := f.startNode(dir, ns, fmt.Sprintf("node-%03d", i), flags(filepath.Join(dir, fmt.Sprintf("store-%03d", i))))
		if err != nil {
			p.Failure = fmt.Sprintf("%s, %d nodes: starting node %d: %v", storage, n, i, err)
			return p
		}
		nodes = append(nodes, r)
	}
	all := func(handler string, want int) func() bool {
		return func() bool {
			for _, r := range nodes {
				if countLinesMatching(r.callLog, handler+" shared ") < want {
					return false
				}
			}
			return true
		}
	}
	timeout := 60*time.Second + time.Duration(n)*time.Second
	if _, err := f.dyn.Resource(exampleGVR).Namespace(ns).Create(f.ctx, newExample(ns, "shared", spec1KiB()), metav1.CreateOptions{}); err != nil {
		p.Failure = err.Error()
		return p
	}
	if err := waitUntil(f.ctx, timeout, all("create_fn", 1)); err != nil {
		p.Failure = fmt.Sprintf("%s, %d nodes: the create was not handled by every node: %v", storage, n, err)
		return p
	}
	time.Sleep(2 * time.Second) // the create's writes settle
	var patches, events, cpu, handled float64
	for c := 1; c <= f.changes; c++ {
		from := time.Now()
		cpuBefore := cpuSeconds(f.api.pid())
		patch := fmt.Sprintf(`{"spec":{"field":"change-%d"}}`, c)
		if _, err := f.dyn.Resource(exampleGVR).Namespace(ns).Patch(f.ctx, "shared", types.MergePatchType, []byte(patch), metav1.PatchOptions{}); err != nil {
			p.Failure = err.Error()
			return p
		}
		if err := waitUntil(f.ctx, timeout, all("update_fn", c)); err != nil {
			p.Failure = fmt.Sprintf("%s, %d nodes: change %d was not handled by every node: %v", storage, n, c, err)
			return p
		}
		handled += float64(time.Since(from).Milliseconds())
		// The writes the nodes make after their handlers (the bookkeeping) settle.
		time.Sleep(time.Second + time.Duration(n)*20*time.Millisecond)
		to := time.Now()
		cpu += (cpuSeconds(f.api.pid()) - cpuBefore) * 1000
		w, err := objectWrites(f.audit, ns, from, to)
		if err != nil {
			p.Failure = err.Error()
			return p
		}
		patches += float64(w)
		// Every version of the object (the driver's change and each PATCH) reaches every node.
		events += float64((w + 1) * n)
	}
	obj, err := f.dyn.Resource(exampleGVR).Namespace(ns).Get(f.ctx, "shared", metav1.GetOptions{})
	if err == nil {
		data, _ := json.Marshal(obj.Object)
		p.ObjectBytes = len(data)
	}
	k := float64(f.changes)
	p.Patches, p.WatchEvents, p.APIServerCPUms, p.AllHandledMs = patches/k, events/k, cpu/k, handled/k
	return p
}

// startNode starts one node's operator: the controller watching `ns` as node `node`, and its
// handler process.
func (f *fleet) startNode(dir, ns, node string, extra []string) (*running, error) {
	sock := filepath.Join(dir, node+".sock")
	port, err := freePort()
	if err != nil {
		return nil, err
	}
	args := append([]string{"run", "--standalone", "--namespace", ns, "--node-name", node,
		"--listen", "unix://" + sock, "--admin-listen", fmt.Sprintf("127.0.0.1:%d", port), "--events", "false"}, extra...)
	main, err := startProc(ns+"-"+node, dir, []string{"KUBECONFIG=" + f.kubeconfig, "RUST_LOG=warn"}, f.capstan, args...)
	if err != nil {
		return nil, err
	}
	callLog := filepath.Join(dir, node+".calls")
	r := &running{main: main, callLog: callLog, started: main.started}
	if err := waitUntil(f.ctx, 60*time.Second, func() bool {
		_, err := os.Stat(sock)
		return err == nil || !main.alive()
	}); err != nil || !main.alive() {
		r.stop()
		return nil, fmt.Errorf("the controller did not open its socket\n%s", r.tails())
	}
	r.handler, err = startProc(ns+"-"+node+"-handler", dir,
		append([]string{"CAPSTAN_ENDPOINT=unix://" + sock}, rustHandlerEnv("create,update-plain", callLog)...), f.handler)
	if err != nil {
		r.stop()
		return nil, err
	}
	return r, nil
}

func waitUntil(ctx context.Context, timeout time.Duration, done func() bool) error {
	deadline := time.Now().Add(timeout)
	for !done() {
		if ctx.Err() != nil {
			return ctx.Err()
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("not within %s", timeout)
		}
		time.Sleep(20 * time.Millisecond)
	}
	return nil
}

// objectWrites counts the PATCHes and UPDATEs of the examples in `ns` by anything but the
// driver between from and to.
func objectWrites(path, ns string, from, to time.Time) (int, error) {
	s := &b4Result{Namespace: ns, From: from, To: to, ObjectOnly: true}
	paths, _ := filepath.Glob(strings.TrimSuffix(path, ".log") + "*.log")
	if err := countWrites(paths, []*b4Result{s}); err != nil {
		return 0, err
	}
	return s.ObjectWrites, nil
}

func writeFleet(dir string, r *fleetResults) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	data, _ := json.MarshalIndent(r, "", "  ")
	if err := os.WriteFile(filepath.Join(dir, "fleet.json"), data, 0o644); err != nil {
		return err
	}
	var b strings.Builder
	mode := "full run"
	if r.Smoke {
		mode = "smoke run (small fleets; the figures prove the workload runs, not its scale)"
	}
	fmt.Fprintf(&b, "# Per-node operators at fleet scale\n\n%s, %s. Produced by `scripts/bench.sh --fleet`; raw figures in `fleet.json`, the plot in `fleet.svg`.\n\n", mode, r.Started.UTC().Format("2006-01-02 15:04 UTC"))
	fmt.Fprintf(&b, "capstan build: %s profile. ", r.Profile)
	fmt.Fprintf(&b, "Machine: %d cores (%s), %.1f GiB memory. N node operators (controller + handler process each, `--node-name node-NNN`) and the API server share these cores. One shared object (~1 KiB of spec); each of its %d changes is handled by every node with an update handler that writes nothing, so every PATCH counted is Capstan's own bookkeeping (PATCH requests from the audit log, refused ones such as conflicts included). Watch events are derived, not measured: every version of the object (the change and each PATCH) reaches each of the N watches. API server CPU includes its embedded etcd. A fleet that did not finish is where that storage stops on this machine (with N controllers, their handler processes, the API server and the driver on the same cores; the driver's own request timing out counts).\n\n", r.Machine.Cores, r.Machine.CPU, r.Machine.MemoryGiB, r.Changes)
	b.WriteString("| storage | nodes | PATCHes per change | watch events per change | object size (bytes) | API server CPU per change (ms) | until all nodes handled (ms) |\n|---|---|---|---|---|---|---|\n")
	for _, p := range r.Points {
		if p.Failure != "" {
			fmt.Fprintf(&b, "| %s | %d | did not finish: %s | | | | |\n", p.Storage, p.Nodes, strings.ReplaceAll(strings.SplitN(p.Failure, "\n", 2)[0], "|", "/"))
			continue
		}
		fmt.Fprintf(&b, "| %s | %d | %.1f | %.0f | %d | %.0f | %.0f |\n", p.Storage, p.Nodes, p.Patches, p.WatchEvents, p.ObjectBytes, p.APIServerCPUms, p.AllHandledMs)
	}
	if err := os.WriteFile(filepath.Join(dir, "fleet.md"), []byte(b.String()), 0o644); err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(dir, "fleet.svg"), []byte(fleetSVG(r)), 0o644)
}

// fleetSVG draws two panels against N (log scale): PATCHes per change, and the time until all
// nodes handled a change; one line per storage.
func fleetSVG(r *fleetResults) string {
	const w, h, pad = 900, 380, 60
	colors := map[string]string{"annotations": "#d62728", "status": "#ff7f0e", "node-local": "#2ca02c"}
	maxN := 1
	for _, p := range r.Points {
		if p.Nodes > maxN {
			maxN = p.Nodes
		}
	}
	var s strings.Builder
	fmt.Fprintf(&s, `<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" font-family="sans-serif" font-size="12">`+"\n", w, h)
	fmt.Fprintf(&s, `<rect width="%d" height="%d" fill="white"/>`+"\n", w, h)
	panel := func(x0 int, title string, value func(fleetPoint) float64) {
		pw, ph := w/2-pad-20, h-2*pad
		maxV := 1.0
		for _, p := range r.Points {
			if p.Failure == "" {
				maxV = math.Max(maxV, value(p))
			}
		}
		xOf := func(n int) float64 {
			if maxN <= 1 {
				return float64(x0 + pad)
			}
			return float64(x0+pad) + math.Log10(float64(n))/math.Log10(float64(maxN))*float64(pw)
		}
		yOf := func(v float64) float64 { return float64(pad+ph) - v/maxV*float64(ph) }
		fmt.Fprintf(&s, `<text x="%d" y="%d" font-weight="bold">%s</text>`+"\n", x0+pad, pad-20, title)
		fmt.Fprintf(&s, `<line x1="%d" y1="%d" x2="%d" y2="%d" stroke="black"/>`+"\n", x0+pad, pad+ph, x0+pad+pw, pad+ph)
		fmt.Fprintf(&s, `<line x1="%d" y1="%d" x2="%d" y2="%d" stroke="black"/>`+"\n", x0+pad, pad, x0+pad, pad+ph)
		for _, n := range []int{1, 3, 10, 30, 100, 300} {
			if n > maxN {
				break
			}
			fmt.Fprintf(&s, `<text x="%.0f" y="%d" text-anchor="middle">%d</text>`+"\n", xOf(n), pad+ph+16, n)
		}
		fmt.Fprintf(&s, `<text x="%d" y="%d" text-anchor="middle">nodes (log scale)</text>`+"\n", x0+pad+pw/2, pad+ph+34)
		for i := 0; i <= 4; i++ {
			v := maxV * float64(i) / 4
			fmt.Fprintf(&s, `<text x="%d" y="%.0f" text-anchor="end">%.0f</text>`+"\n", x0+pad-6, yOf(v)+4, v)
		}
		for _, st := range fleetStorages {
			var pts []string
			for _, p := range r.Points {
				if p.Storage == st.name && p.Failure == "" {
					pts = append(pts, fmt.Sprintf("%.1f,%.1f", xOf(p.Nodes), yOf(value(p))))
				}
			}
			if len(pts) > 0 {
				fmt.Fprintf(&s, `<polyline fill="none" stroke="%s" stroke-width="2" points="%s"/>`+"\n", colors[st.name], strings.Join(pts, " "))
			}
		}
	}
	panel(0, "PATCHes per change (Capstan's bookkeeping)", func(p fleetPoint) float64 { return p.Patches })
	panel(w/2, "ms until every node handled a change", func(p fleetPoint) float64 { return p.AllHandledMs })
	for i, st := range fleetStorages {
		fmt.Fprintf(&s, `<rect x="%d" y="%d" width="12" height="12" fill="%s"/><text x="%d" y="%d">%s</text>`+"\n", pad+i*150, h-18, colors[st.name], pad+i*150+16, h-8, st.name)
	}
	s.WriteString("</svg>\n")
	return s.String()
}
