package main

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
)

// The example resource of the repository (examples/crd.yaml).
var exampleGVR = schema.GroupVersionResource{Group: "demo.capstan.dev", Version: "v1", Resource: "examples"}

var (
	nsGVR    = schema.GroupVersionResource{Version: "v1", Resource: "namespaces"}
	eventGVR = schema.GroupVersionResource{Version: "v1", Resource: "events"}
	crdGVR   = schema.GroupVersionResource{Group: "apiextensions.k8s.io", Version: "v1", Resource: "customresourcedefinitions"}
)

// restConfig loads a kubeconfig without any client-side rate limit.
func restConfig(kubeconfig, userAgent string) (*rest.Config, error) {
	cfg, err := clientcmd.BuildConfigFromFlags("", kubeconfig)
	if err != nil {
		return nil, err
	}
	cfg.QPS = -1
	cfg.Burst = 0
	cfg.UserAgent = userAgent
	return cfg, nil
}

// spec1KiB is a ~1 KiB spec, the object size of performance-anchors §8.
func spec1KiB() map[string]any {
	items := make([]any, 16)
	for i := range items {
		items[i] = fmt.Sprintf("item-%02d-%s", i, strings.Repeat("x", 52))
	}
	return map[string]any{"field": "initial", "size": int64(1), "items": items}
}

func newExample(ns, name string, spec map[string]any) *unstructured.Unstructured {
	return &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "demo.capstan.dev/v1",
		"kind":       "Example",
		"metadata":   map[string]any{"name": name, "namespace": ns, "labels": map[string]any{"bench.capstan.dev/object": "yes"}},
		"spec":       spec,
	}}
}

// ensureNamespace creates a namespace when missing.
func ensureNamespace(ctx context.Context, dyn dynamic.Interface, ns string) error {
	obj := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "v1", "kind": "Namespace", "metadata": map[string]any{"name": ns},
	}}
	_, err := dyn.Resource(nsGVR).Create(ctx, obj, metav1.CreateOptions{})
	if err != nil && !apierrors.IsAlreadyExists(err) {
		return fmt.Errorf("creating namespace %s: %w", ns, err)
	}
	return nil
}

// createMany creates the objects <prefix>-<i> in ns with `concurrency` workers and returns the
// time each create was acknowledged.
func createMany(ctx context.Context, dyn dynamic.Interface, ns, prefix string, n, concurrency int, spec func(i int) map[string]any) (map[string]time.Time, time.Duration, error) {
	acks := make(map[string]time.Time, n)
	var mu sync.Mutex
	var firstErr error
	jobs := make(chan int)
	var wg sync.WaitGroup
	start := time.Now()
	for w := 0; w < concurrency; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range jobs {
				name := fmt.Sprintf("%s-%05d", prefix, i)
				var err error
				for attempt := 0; attempt < 5; attempt++ {
					_, err = dyn.Resource(exampleGVR).Namespace(ns).Create(ctx, newExample(ns, name, spec(i)), metav1.CreateOptions{})
					if err == nil || apierrors.IsAlreadyExists(err) || ctx.Err() != nil {
						err = nil
						break
					}
					time.Sleep(200 * time.Millisecond)
				}
				now := time.Now()
				mu.Lock()
				if err != nil && firstErr == nil {
					firstErr = fmt.Errorf("creating %s/%s: %w", ns, name, err)
				}
				acks[name] = now
				mu.Unlock()
			}
		}()
	}
	for i := 0; i < n; i++ {
		jobs <- i
	}
	close(jobs)
	wg.Wait()
	return acks, time.Since(start), firstErr
}

// deleteAllExamples removes every example object in the given namespaces and waits until none
// is left anywhere. A collection of 100,000 objects (--large) outlasts one DeleteCollection
// request (the API server gives up after a minute, having deleted part of it), so the request
// is repeated until nothing is left.
func deleteAllExamples(ctx context.Context, dyn dynamic.Interface, namespaces []string) error {
	deadline := time.Now().Add(20 * time.Minute) // 100,000 objects in --large
	var lastErr error
	for {
		for _, ns := range namespaces {
			err := dyn.Resource(exampleGVR).Namespace(ns).DeleteCollection(ctx, metav1.DeleteOptions{}, metav1.ListOptions{})
			if err != nil && !apierrors.IsNotFound(err) {
				lastErr = fmt.Errorf("deleting the objects of %s: %w", ns, err)
			}
		}
		list, err := dyn.Resource(exampleGVR).List(ctx, metav1.ListOptions{Limit: 500})
		if err != nil {
			return err
		}
		if len(list.Items) == 0 {
			return nil
		}
		// Objects still held by a finalizer (a stopped controller's) are released here.
		for _, item := range list.Items {
			if len(item.GetFinalizers()) > 0 {
				patch := []byte(`{"metadata":{"finalizers":null}}`)
				_, _ = dyn.Resource(exampleGVR).Namespace(item.GetNamespace()).Patch(ctx, item.GetName(), types.MergePatchType, patch, metav1.PatchOptions{})
			}
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%d+ example objects still exist after deleting them (last error: %v)", len(list.Items), lastErr)
		}
		time.Sleep(time.Second)
	}
}

// ---------------------------------------------------------------------------------------------
// The observer: one independent cluster-wide watch that records when each object first shows
// each marker annotation, and when it is gone.

type observer struct {
	mu      sync.Mutex
	markers []string
	// first time a marker was seen, by marker then "ns/name"
	seen map[string]map[string]time.Time
	// objects seen with a marker, by marker then namespace
	count map[string]map[string]int
	// the last annotations of each object, for checks on a marker's value
	annotations map[string]map[string]string
	deleted     map[string]time.Time
	changed     chan struct{}
}

func newObserver(markers []string) *observer {
	o := &observer{
		markers:     markers,
		seen:        map[string]map[string]time.Time{},
		count:       map[string]map[string]int{},
		annotations: map[string]map[string]string{},
		deleted:     map[string]time.Time{},
		changed:     make(chan struct{}),
	}
	for _, m := range markers {
		o.seen[m] = map[string]time.Time{}
		o.count[m] = map[string]int{}
	}
	return o
}

// run watches until ctx ends, re-establishing the watch when it closes.
func (o *observer) run(ctx context.Context, dyn dynamic.Interface, ready chan<- error) {
	list, err := dyn.Resource(exampleGVR).List(ctx, metav1.ListOptions{Limit: 1})
	if err != nil {
		ready <- err
		return
	}
	rv := list.GetResourceVersion()
	first := true
	for ctx.Err() == nil {
		w, err := dyn.Resource(exampleGVR).Watch(ctx, metav1.ListOptions{ResourceVersion: rv, AllowWatchBookmarks: true})
		if err != nil {
			if first {
				ready <- err
				return
			}
			time.Sleep(100 * time.Millisecond)
			continue
		}
		if first {
			ready <- nil
			first = false
		}
		for ev := range w.ResultChan() {
			now := time.Now()
			obj, ok := ev.Object.(*unstructured.Unstructured)
			if !ok {
				continue // a Status (e.g. 410 Gone): restart from the last resource version
			}
			rv = obj.GetResourceVersion()
			if ev.Type == watch.Bookmark {
				continue
			}
			o.record(ev.Type, obj, now)
		}
		w.Stop()
	}
}

func (o *observer) record(t watch.EventType, obj *unstructured.Unstructured, now time.Time) {
	key := obj.GetNamespace() + "/" + obj.GetName()
	ann := obj.GetAnnotations()
	o.mu.Lock()
	defer o.mu.Unlock()
	if t == watch.Deleted {
		o.deleted[key] = now
		delete(o.annotations, key)
	} else {
		o.annotations[key] = ann
		for _, m := range o.markers {
			if _, has := ann[m]; has {
				if _, was := o.seen[m][key]; !was {
					o.seen[m][key] = now
					o.count[m][obj.GetNamespace()]++
				}
			}
		}
	}
	close(o.changed)
	o.changed = make(chan struct{})
}

// waitFor waits until cond (called under the lock) holds, or the timeout passes.
func (o *observer) waitFor(ctx context.Context, timeout time.Duration, what string, cond func() bool) error {
	deadline := time.NewTimer(timeout)
	defer deadline.Stop()
	for {
		o.mu.Lock()
		ok := cond()
		ch := o.changed
		o.mu.Unlock()
		if ok {
			return nil
		}
		select {
		case <-ch:
		case <-deadline.C:
			return fmt.Errorf("timed out after %s waiting for %s", timeout, what)
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

func (o *observer) waitCount(ctx context.Context, marker, ns string, n int, timeout time.Duration) error {
	return o.waitFor(ctx, timeout, fmt.Sprintf("%d objects in %s with %s", n, ns, marker), func() bool {
		return o.count[marker][ns] >= n
	})
}

func (o *observer) countOf(marker, ns string) int {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.count[marker][ns]
}

func (o *observer) seenAt(marker, ns, name string) (time.Time, bool) {
	o.mu.Lock()
	defer o.mu.Unlock()
	t, ok := o.seen[marker][ns+"/"+name]
	return t, ok
}

// firstAndLast returns the earliest and latest time a marker was first seen in ns.
func (o *observer) firstAndLast(marker, ns string) (time.Time, time.Time) {
	o.mu.Lock()
	defer o.mu.Unlock()
	var first, last time.Time
	prefix := ns + "/"
	for k, t := range o.seen[marker] {
		if !strings.HasPrefix(k, prefix) {
			continue
		}
		if first.IsZero() || t.Before(first) {
			first = t
		}
		if t.After(last) {
			last = t
		}
	}
	return first, last
}
