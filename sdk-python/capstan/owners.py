"""kopf's ownership helpers: make a child object owned by, named after, labelled and placed
like its parent, on plain dicts (before the child is created)."""

import collections.abc


def _meta_of(obj):
    meta = obj.setdefault("metadata", {})
    return meta


def build_owner_reference(owner, *, controller=True, block_owner_deletion=True):
    """The ownerReference that points at `owner`."""
    meta = owner.get("metadata", {})
    return {
        "apiVersion": owner.get("apiVersion"), "kind": owner.get("kind"), "name": meta.get("name"),
        "uid": meta.get("uid"), "controller": controller, "blockOwnerDeletion": block_owner_deletion,
    }


def _objects(objs):
    if isinstance(objs, collections.abc.MutableMapping):
        return [objs]
    return list(objs)


def append_owner_reference(objs, owner, *, controller=True, block_owner_deletion=True):
    """Adds `owner` to the children's ownerReferences (once)."""
    ref = build_owner_reference(owner, controller=controller, block_owner_deletion=block_owner_deletion)
    for obj in _objects(objs):
        refs = _meta_of(obj).setdefault("ownerReferences", [])
        if not any(r.get("uid") == ref["uid"] for r in refs):
            refs.append(ref)


def remove_owner_reference(objs, owner):
    """Removes `owner` from the children's ownerReferences."""
    uid = owner.get("metadata", {}).get("uid")
    for obj in _objects(objs):
        refs = _meta_of(obj).get("ownerReferences", [])
        _meta_of(obj)["ownerReferences"] = [r for r in refs if r.get("uid") != uid]


def harmonize_naming(objs, name, *, forced=False, strict=False):
    """Names the children after the parent (`generateName` unless `strict`)."""
    for obj in _objects(objs):
        meta = _meta_of(obj)
        if forced or not (meta.get("name") or meta.get("generateName")):
            if strict:
                meta.pop("generateName", None)
                meta["name"] = name
            else:
                meta.pop("name", None)
                meta["generateName"] = f"{name}-"


def adjust_namespace(objs, namespace, *, forced=False):
    """Puts the children in the parent's namespace."""
    for obj in _objects(objs):
        meta = _meta_of(obj)
        if forced or not meta.get("namespace"):
            meta["namespace"] = namespace


def label(objs, labels, *, forced=False, nested=None):
    """Copies `labels` onto the children (and their `nested` templates, e.g. 'spec.template')."""
    nested = [nested] if isinstance(nested, str) else list(nested or [])
    for obj in _objects(objs):
        targets = [obj]
        for path in nested:
            node = obj
            for key in path.split("."):
                node = node.setdefault(key, {})
            targets.append(node)
        for target in targets:
            existing = _meta_of(target).setdefault("labels", {})
            for key, value in dict(labels).items():
                if forced or key not in existing:
                    existing[key] = value


def adopt(objs, owner, *, forced=False, strict=False, nested=None):
    """All of the above, as kopf.adopt: owner reference, naming, namespace and labels."""
    meta = owner.get("metadata", {})
    append_owner_reference(objs, owner)
    harmonize_naming(objs, meta.get("name"), forced=forced, strict=strict)
    if meta.get("namespace"):
        adjust_namespace(objs, meta.get("namespace"), forced=forced)
    label(objs, meta.get("labels", {}), forced=forced, nested=nested)
