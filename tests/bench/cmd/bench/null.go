package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"sync"
	"syscall"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/dynamic"
)

// nullMarker is the annotation the null controller writes.
const nullMarker = "bench.capstan.dev/null-handled"

// runNull is B0's null controller: list+watch the example resource cluster-wide and, for each
// object without the marker, send one merge PATCH that sets it. No diff-base, no progress, no
// events, no retries beyond the API call itself; `concurrency` PATCHes in flight at most.
// With BENCH_LOG set, every PATCH appends "null <name> 1" there (for B5's first-call time).
func runNull(args []string) error {
	fs := flag.NewFlagSet("null", flag.ExitOnError)
	kubeconfig := fs.String("kubeconfig", os.Getenv("KUBECONFIG"), "kubeconfig")
	concurrency := fs.Int("concurrency", 64, "PATCHes in flight at most")
	_ = fs.Parse(args)
	cfg, err := restConfig(*kubeconfig, "capstan-bench/null")
	if err != nil {
		return err
	}
	dyn, err := dynamic.NewForConfig(cfg)
	if err != nil {
		return err
	}
	var logMu sync.Mutex
	var logFile *os.File
	if path := os.Getenv("BENCH_LOG"); path != "" {
		if logFile, err = os.OpenFile(path, os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o644); err != nil {
			return err
		}
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()

	jobs := make(chan [2]string, 1024)
	patch := []byte(fmt.Sprintf(`{"metadata":{"annotations":{%q:"1"}}}`, nullMarker))
	for w := 0; w < *concurrency; w++ {
		go func() {
			for job := range jobs {
				if logFile != nil {
					logMu.Lock()
					fmt.Fprintf(logFile, "null %s 1\n", job[1])
					logMu.Unlock()
				}
				_, err := dyn.Resource(exampleGVR).Namespace(job[0]).Patch(ctx, job[1], types.MergePatchType, patch, metav1.PatchOptions{})
				if err != nil && ctx.Err() == nil {
					fmt.Fprintf(os.Stderr, "null: patch %s/%s: %v\n", job[0], job[1], err)
				}
			}
		}()
	}
	// The only state: uids already queued, so an object is patched once.
	queued := map[types.UID]struct{}{}
	offer := func(obj *unstructured.Unstructured) {
		if _, done := obj.GetAnnotations()[nullMarker]; done || obj.GetDeletionTimestamp() != nil {
			return
		}
		if _, ok := queued[obj.GetUID()]; ok {
			return
		}
		queued[obj.GetUID()] = struct{}{}
		select {
		case jobs <- [2]string{obj.GetNamespace(), obj.GetName()}:
		case <-ctx.Done():
		}
	}
	rv := ""
	cont := ""
	for {
		list, err := dyn.Resource(exampleGVR).List(ctx, metav1.ListOptions{Limit: 500, Continue: cont})
		if err != nil {
			return err
		}
		for i := range list.Items {
			offer(&list.Items[i])
		}
		rv = list.GetResourceVersion()
		if cont = list.GetContinue(); cont == "" {
			break
		}
	}
	for ctx.Err() == nil {
		w, err := dyn.Resource(exampleGVR).Watch(ctx, metav1.ListOptions{ResourceVersion: rv, AllowWatchBookmarks: true})
		if err != nil {
			time.Sleep(100 * time.Millisecond)
			continue
		}
		for ev := range w.ResultChan() {
			obj, ok := ev.Object.(*unstructured.Unstructured)
			if !ok {
				continue
			}
			rv = obj.GetResourceVersion()
			switch ev.Type {
			case watch.Added, watch.Modified:
				offer(obj)
			case watch.Deleted:
				delete(queued, obj.GetUID())
			}
		}
		w.Stop()
	}
	return nil
}
