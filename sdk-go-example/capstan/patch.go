package capstan

import (
	"encoding/json"
	"fmt"
	"sync"

	pb "capstan.dev/sdk-go-example/gen/capstan/v1"
)

// Patch collects the changes a handler makes to its object as RFC 7386 JSON merge patches:
// one for the object (metadata, spec) and one for the status subresource. Both are sent with
// a successful result; the controller folds them into its single write for the cycle.
//
// Patch is safe for concurrent use.
type Patch struct {
	mu     sync.Mutex
	object map[string]any
	status map[string]any
}

// Label sets a label.
func (p *Patch) Label(key, value string) { p.Set([]string{"metadata", "labels", key}, value) }

// RemoveLabel removes a label.
func (p *Patch) RemoveLabel(key string) { p.Set([]string{"metadata", "labels", key}, nil) }

// Annotation sets an annotation.
func (p *Patch) Annotation(key, value string) {
	p.Set([]string{"metadata", "annotations", key}, value)
}

// RemoveAnnotation removes an annotation.
func (p *Patch) RemoveAnnotation(key string) {
	p.Set([]string{"metadata", "annotations", key}, nil)
}

// Set sets the value at path (one element per nesting level) in the object patch; a nil value
// deletes the key. A path under "status" is written to the status subresource.
func (p *Patch) Set(path []string, value any) {
	if len(path) == 0 {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	doc := &p.object
	if path[0] == "status" {
		doc = &p.status
	}
	if *doc == nil {
		*doc = map[string]any{}
	}
	node := *doc
	for _, key := range path[:len(path)-1] {
		next, ok := node[key].(map[string]any)
		if !ok {
			next = map[string]any{}
			node[key] = next
		}
		node = next
	}
	node[path[len(path)-1]] = value
}

// Status sets status.<key> (kopf's patch.status[key] = value).
func (p *Patch) Status(key string, value any) { p.Set([]string{"status", key}, value) }

// Merge merges an RFC 7386 merge patch document into the patch; its "status" key goes to the
// status subresource.
func (p *Patch) Merge(doc map[string]any) {
	for key, value := range doc {
		if sub, ok := value.(map[string]any); ok {
			mergeInto(p, []string{key}, sub)
			continue
		}
		p.Set([]string{key}, value)
	}
}

// mergeInto sets every leaf of doc under path.
func mergeInto(p *Patch, path []string, doc map[string]any) {
	if len(doc) == 0 {
		p.Set(path, map[string]any{})
	}
	for key, value := range doc {
		next := append(append([]string(nil), path...), key)
		if sub, ok := value.(map[string]any); ok && len(sub) > 0 {
			mergeInto(p, next, sub)
			continue
		}
		p.Set(next, value)
	}
}

// Documents returns copies of the two merge patch documents: the object's (metadata, spec)
// and the status subresource's (starting at "status"); nil when empty.
func (p *Patch) Documents() (object, status map[string]any) {
	c := p.clone()
	return c.object, c.status
}

// clone returns a deep copy of the patch.
func (p *Patch) clone() *Patch {
	p.mu.Lock()
	defer p.mu.Unlock()
	return &Patch{object: deepCopy(p.object), status: deepCopy(p.status)}
}

// deepCopy copies the nested maps of a patch document.
func deepCopy(m map[string]any) map[string]any {
	if m == nil {
		return nil
	}
	out := make(map[string]any, len(m))
	for k, v := range m {
		if sub, ok := v.(map[string]any); ok {
			v = deepCopy(sub)
		}
		out[k] = v
	}
	return out
}

// Empty reports whether nothing was patched.
func (p *Patch) Empty() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.object) == 0 && len(p.status) == 0
}

// messages returns the patches as protocol messages: the object patch first, then the status
// patch, each only when it is not empty.
func (p *Patch) messages() ([]*pb.Patch, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	var out []*pb.Patch
	for _, part := range []struct {
		doc    map[string]any
		target pb.PatchTarget
	}{
		{p.object, pb.PatchTarget_PATCH_TARGET_OBJECT},
		{p.status, pb.PatchTarget_PATCH_TARGET_STATUS},
	} {
		if len(part.doc) == 0 {
			continue
		}
		body, err := json.Marshal(part.doc)
		if err != nil {
			return nil, fmt.Errorf("encoding the patch: %w", err)
		}
		out = append(out, &pb.Patch{
			Type:   pb.PatchType_PATCH_TYPE_MERGE,
			Target: part.target,
			Body:   &pb.Json{Json: body},
		})
	}
	return out, nil
}
