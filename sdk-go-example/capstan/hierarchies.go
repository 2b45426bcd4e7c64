package capstan

// Ownership and naming of the objects a handler creates: kopf's hierarchy helpers (adopt,
// append_owner_reference, remove_owner_reference, label, harmonize_naming, adjust_namespace,
// build_object_reference, build_owner_reference).
//
// They work on objects as maps (as decoded from JSON; a typed client object can be turned into
// one with encoding/json) and change them in place; the handler then creates them with its own
// client. Every helper checks all its inputs before it changes anything: an owner without an
// apiVersion, kind, name or uid, a namespace that is required but empty, or an object whose
// metadata (or a nested template) is not a map is a *HierarchyError and no object is touched.

import (
	"fmt"
	"strings"
)

// HierarchyError says why a hierarchy helper changed nothing.
type HierarchyError struct {
	// Field is the owner's missing field (e.g. "metadata.uid"), or empty.
	Field string
	// Index is the position of the unfit object in the list given, or -1.
	Index int
	// Message says what is wrong.
	Message string
}

func (e *HierarchyError) Error() string { return e.Message }

func ownerIncomplete(field string) error {
	return &HierarchyError{Field: field, Index: -1,
		Message: fmt.Sprintf("the owner has no %s; an owner reference needs it", field)}
}

func notAnObject(index int) error {
	return &HierarchyError{Index: index,
		Message: fmt.Sprintf("object #%d is not a Kubernetes object (its metadata or a nested template is not a map)", index)}
}

// AdoptOptions are kopf's keyword arguments of adopt.
type AdoptOptions struct {
	// Forced overwrites existing names, namespaces and labels.
	Forced bool
	// Strict names children exactly as the owner instead of generateName "<owner>-".
	Strict bool
	// Nested are templates to label too, e.g. "spec.template".
	Nested []string
}

// BuildObjectReference returns a reference to body (kopf's build_object_reference):
// apiVersion, kind, name, uid, and namespace when it has one.
func BuildObjectReference(body map[string]any) (map[string]any, error) {
	ref, err := identity(body)
	if err != nil {
		return nil, err
	}
	if ns := text(body, "metadata", "namespace"); ns != "" {
		ref["namespace"] = ns
	}
	return ref, nil
}

// BuildOwnerReference returns an owner reference to owner (kopf's build_owner_reference;
// kopf's defaults for controller and blockOwnerDeletion are both true).
func BuildOwnerReference(owner map[string]any, controller, blockOwnerDeletion bool) (map[string]any, error) {
	ref, err := identity(owner)
	if err != nil {
		return nil, err
	}
	ref["controller"] = controller
	ref["blockOwnerDeletion"] = blockOwnerDeletion
	return ref, nil
}

// AppendOwnerReference adds an owner reference to owner to each object that has none with the
// owner's uid (kopf's append_owner_reference).
func AppendOwnerReference(objs []map[string]any, owner map[string]any, controller, blockOwnerDeletion bool) error {
	ref, err := BuildOwnerReference(owner, controller, blockOwnerDeletion)
	if err != nil {
		return err
	}
	if err := check(objs, nil); err != nil {
		return err
	}
	for _, obj := range objs {
		meta := mapAt(obj, "metadata")
		refs, _ := meta["ownerReferences"].([]any)
		found := false
		for _, r := range refs {
			if m, ok := r.(map[string]any); ok && m["uid"] == ref["uid"] {
				found = true
			}
		}
		if !found {
			copied := make(map[string]any, len(ref))
			for k, v := range ref {
				copied[k] = v
			}
			meta["ownerReferences"] = append(refs, copied)
		}
	}
	return nil
}

// RemoveOwnerReference removes every owner reference to owner (by uid) from each object (kopf's
// remove_owner_reference).
func RemoveOwnerReference(objs []map[string]any, owner map[string]any) error {
	uid := text(owner, "metadata", "uid")
	if uid == "" {
		return ownerIncomplete("metadata.uid")
	}
	if err := check(objs, nil); err != nil {
		return err
	}
	for _, obj := range objs {
		meta := mapAt(obj, "metadata")
		refs, ok := meta["ownerReferences"].([]any)
		if !ok {
			continue
		}
		kept := refs[:0:0]
		for _, r := range refs {
			if m, ok := r.(map[string]any); ok && m["uid"] == uid {
				continue
			}
			kept = append(kept, r)
		}
		meta["ownerReferences"] = kept
	}
	return nil
}

// LabelObjects sets labels on each object, keeping values already there unless forced (kopf's
// label; [Label] is the filter option of a registration). Each nested path (e.g.
// "spec.template") is labelled too, at <path>.metadata.labels.
func LabelObjects(objs []map[string]any, labels map[string]string, forced bool, nested ...string) error {
	if err := check(objs, nested); err != nil {
		return err
	}
	for _, obj := range objs {
		for _, path := range append([]string{""}, nested...) {
			at := obj
			if path != "" {
				at = mapAt(obj, strings.Split(path, ".")...)
			}
			current := mapAt(at, "metadata", "labels")
			for k, v := range labels {
				if _, there := current[k]; forced || !there {
					current[k] = v
				}
			}
		}
	}
	return nil
}

// HarmonizeNaming names each object after name when it has neither a name nor a generateName,
// or always when forced (kopf's harmonize_naming): generateName "<name>-", or exactly name
// when strict.
func HarmonizeNaming(objs []map[string]any, name string, forced, strict bool) error {
	if err := check(objs, nil); err != nil {
		return err
	}
	for _, obj := range objs {
		meta := mapAt(obj, "metadata")
		_, hasName := meta["name"]
		_, hasGenerate := meta["generateName"]
		if (hasName || hasGenerate) && !forced {
			continue
		}
		if strict {
			delete(meta, "generateName")
			meta["name"] = name
		} else {
			delete(meta, "name")
			meta["generateName"] = name + "-"
		}
	}
	return nil
}

// AdjustNamespace puts each object in namespace when it has none, or always when forced
// (kopf's adjust_namespace).
func AdjustNamespace(objs []map[string]any, namespace string, forced bool) error {
	if namespace == "" {
		return &HierarchyError{Index: -1, Message: "the owner has no namespace to put its children in"}
	}
	if err := check(objs, nil); err != nil {
		return err
	}
	for _, obj := range objs {
		meta := mapAt(obj, "metadata")
		if ns, _ := meta["namespace"].(string); forced || ns == "" {
			meta["namespace"] = namespace
		}
	}
	return nil
}

// Adopt makes each object a child of owner (kopf's adopt): a controller owner reference that
// blocks the owner's deletion, a name after the owner's, the owner's namespace (a
// cluster-scoped owner leaves its children's namespaces alone) and the owner's labels.
func Adopt(objs []map[string]any, owner map[string]any, opts AdoptOptions) error {
	if _, err := BuildOwnerReference(owner, true, true); err != nil {
		return err
	}
	if err := check(objs, opts.Nested); err != nil {
		return err
	}
	labels := map[string]string{}
	for k, v := range section(section(owner, "metadata"), "labels") {
		if s, ok := v.(string); ok {
			labels[k] = s
		}
	}
	// Checked above: none of these can fail now.
	_ = AppendOwnerReference(objs, owner, true, true)
	_ = HarmonizeNaming(objs, text(owner, "metadata", "name"), opts.Forced, opts.Strict)
	if ns := text(owner, "metadata", "namespace"); ns != "" {
		_ = AdjustNamespace(objs, ns, opts.Forced)
	}
	return LabelObjects(objs, labels, opts.Forced, opts.Nested...)
}

// Owner returns the invocation's object as an owner of others: its latest body, with
// apiVersion and kind taken from the invocation's resource when the body lacks them.
func (inv *Invocation) Owner() map[string]any {
	owner := map[string]any{}
	for k, v := range inv.Body() {
		owner[k] = v
	}
	if _, ok := owner["apiVersion"]; !ok && inv.Resource.Version != "" {
		if inv.Resource.Group == "" {
			owner["apiVersion"] = inv.Resource.Version
		} else {
			owner["apiVersion"] = inv.Resource.Group + "/" + inv.Resource.Version
		}
	}
	if _, ok := owner["kind"]; !ok && inv.Resource.Kind != "" {
		owner["kind"] = inv.Resource.Kind
	}
	return owner
}

// Adopt makes objs children of the invocation's object (kopf's adopt with the current object
// as the owner); see [Adopt].
func (inv *Invocation) Adopt(objs []map[string]any, opts AdoptOptions) error {
	return Adopt(objs, inv.Owner(), opts)
}

// identity returns apiVersion, kind, name and uid of body, all present.
func identity(body map[string]any) (map[string]any, error) {
	ref := map[string]any{}
	for _, f := range []struct{ key, field string }{
		{"apiVersion", "apiVersion"}, {"kind", "kind"}, {"name", "metadata.name"}, {"uid", "metadata.uid"},
	} {
		v := text(body, strings.Split(f.field, ".")...)
		if v == "" {
			return nil, ownerIncomplete(f.field)
		}
		ref[f.key] = v
	}
	return ref, nil
}

// text returns the string at a path of keys, or "".
func text(body map[string]any, path ...string) string {
	var at any = body
	for _, key := range path {
		m, ok := at.(map[string]any)
		if !ok {
			return ""
		}
		at = m[key]
	}
	s, _ := at.(string)
	return s
}

// check reports the first object whose metadata, or a nested template's, is neither absent
// nor a map.
func check(objs []map[string]any, nested []string) error {
	for i, obj := range objs {
		if obj == nil || !reachable(obj, "metadata") {
			return notAnObject(i)
		}
		for _, path := range nested {
			if !reachable(obj, path) {
				return notAnObject(i)
			}
		}
	}
	return nil
}

// reachable reports whether every step of a dotted path is a map or absent.
func reachable(obj map[string]any, path string) bool {
	at := obj
	for _, key := range strings.Split(path, ".") {
		switch next := at[key].(type) {
		case nil:
			return true
		case map[string]any:
			at = next
		default:
			return false
		}
	}
	return true
}

// mapAt returns the map at a path of keys below obj, creating empty maps in place of absent
// ones (callers checked that nothing else is in the way).
func mapAt(obj map[string]any, path ...string) map[string]any {
	at := obj
	for _, key := range path {
		next, ok := at[key].(map[string]any)
		if !ok {
			next = map[string]any{}
			at[key] = next
		}
		at = next
	}
	return at
}
