package capstan_test

import (
	"errors"
	"reflect"
	"testing"

	"capstan.dev/sdk-go-example/capstan"
)

func owner() map[string]any {
	return map[string]any{
		"apiVersion": "demo.capstan.dev/v1", "kind": "Example",
		"metadata": map[string]any{
			"name": "parent", "namespace": "team", "uid": "u-1",
			"labels": map[string]any{"app": "demo", "tier": "db"},
		},
	}
}

func TestAdoptSetsOwnerNamingNamespaceAndLabelsOnce(t *testing.T) {
	a := map[string]any{"apiVersion": "v1", "kind": "ConfigMap"}
	b := map[string]any{
		"metadata": map[string]any{"name": "fixed", "namespace": "elsewhere", "labels": map[string]any{"tier": "web"}},
		"spec":     map[string]any{"template": map[string]any{}},
	}
	opts := capstan.AdoptOptions{Nested: []string{"spec.template"}}
	if err := capstan.Adopt([]map[string]any{a, b}, owner(), opts); err != nil {
		t.Fatal(err)
	}
	if err := capstan.Adopt([]map[string]any{a}, owner(), opts); err != nil {
		t.Fatal(err)
	}
	meta := a["metadata"].(map[string]any)
	if meta["generateName"] != "parent-" || meta["namespace"] != "team" {
		t.Errorf("naming or namespace: %v", meta)
	}
	if refs := meta["ownerReferences"].([]any); len(refs) != 1 || refs[0].(map[string]any)["controller"] != true {
		t.Errorf("owner references: %v", refs)
	}
	if !reflect.DeepEqual(meta["labels"], map[string]any{"app": "demo", "tier": "db"}) {
		t.Errorf("labels: %v", meta["labels"])
	}
	bm := b["metadata"].(map[string]any)
	if bm["name"] != "fixed" || bm["namespace"] != "elsewhere" || bm["labels"].(map[string]any)["tier"] != "web" {
		t.Errorf("kept unless forced: %v", bm)
	}
	tmpl := b["spec"].(map[string]any)["template"].(map[string]any)["metadata"].(map[string]any)
	if tmpl["labels"].(map[string]any)["app"] != "demo" {
		t.Errorf("nested template: %v", tmpl)
	}
	if err := capstan.Adopt([]map[string]any{b}, owner(), capstan.AdoptOptions{Forced: true, Strict: true}); err != nil {
		t.Fatal(err)
	}
	if bm["name"] != "parent" || bm["namespace"] != "team" || bm["labels"].(map[string]any)["tier"] != "db" {
		t.Errorf("forced: %v", bm)
	}
}

func TestOwnerReferencesAreBuiltAppendedAndRemoved(t *testing.T) {
	ref, err := capstan.BuildOwnerReference(owner(), true, false)
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]any{"apiVersion": "demo.capstan.dev/v1", "kind": "Example", "name": "parent",
		"uid": "u-1", "controller": true, "blockOwnerDeletion": false}
	if !reflect.DeepEqual(ref, want) {
		t.Errorf("owner reference = %v", ref)
	}
	obj, err := capstan.BuildObjectReference(owner())
	if err != nil || obj["namespace"] != "team" || obj["uid"] != "u-1" {
		t.Errorf("object reference = %v, %v", obj, err)
	}
	other := map[string]any{"apiVersion": "v1", "kind": "Secret", "metadata": map[string]any{"name": "s", "uid": "u-2"}}
	child := map[string]any{}
	objs := []map[string]any{child}
	if err := capstan.AppendOwnerReference(objs, owner(), true, true); err != nil {
		t.Fatal(err)
	}
	if err := capstan.AppendOwnerReference(objs, other, false, false); err != nil {
		t.Fatal(err)
	}
	if err := capstan.RemoveOwnerReference(objs, owner()); err != nil {
		t.Fatal(err)
	}
	refs := child["metadata"].(map[string]any)["ownerReferences"].([]any)
	if len(refs) != 1 || refs[0].(map[string]any)["uid"] != "u-2" {
		t.Errorf("after removal: %v", refs)
	}
}

func TestUnfitInputIsAClearErrorAndNothingIsWritten(t *testing.T) {
	good := map[string]any{"kind": "ConfigMap"}
	bad := map[string]any{"metadata": "not a map"}
	err := capstan.Adopt([]map[string]any{good, bad}, owner(), capstan.AdoptOptions{})
	var he *capstan.HierarchyError
	if !errors.As(err, &he) || he.Index != 1 {
		t.Fatalf("err = %v", err)
	}
	if len(good) != 1 {
		t.Errorf("the first object was changed: %v", good)
	}
	noUID := owner()
	delete(noUID["metadata"].(map[string]any), "uid")
	err = capstan.Adopt([]map[string]any{good}, noUID, capstan.AdoptOptions{})
	if !errors.As(err, &he) || he.Field != "metadata.uid" {
		t.Fatalf("err = %v", err)
	}
	if len(good) != 1 {
		t.Errorf("changed without an owner uid: %v", good)
	}
	if err := capstan.AdjustNamespace([]map[string]any{good}, "", false); err == nil {
		t.Error("an empty namespace was accepted")
	}
	tmpl := map[string]any{"spec": map[string]any{"template": 3}}
	if err := capstan.LabelObjects([]map[string]any{tmpl}, map[string]string{"a": "b"}, false, "spec.template"); err == nil {
		t.Error("a template that is not a map was accepted")
	}
	if _, ok := tmpl["metadata"]; ok {
		t.Errorf("labelled despite the error: %v", tmpl)
	}
}

func TestHarmonizeNamingFollowsKopf(t *testing.T) {
	a := map[string]any{}
	b := map[string]any{"metadata": map[string]any{"generateName": "mine-"}}
	if err := capstan.HarmonizeNaming([]map[string]any{a, b}, "parent", false, true); err != nil {
		t.Fatal(err)
	}
	if a["metadata"].(map[string]any)["name"] != "parent" {
		t.Errorf("strict: %v", a)
	}
	if !reflect.DeepEqual(b["metadata"], map[string]any{"generateName": "mine-"}) {
		t.Errorf("kept: %v", b)
	}
}
