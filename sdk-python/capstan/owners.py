"""kopf's ownership helpers: make a child object owned by, named after, labelled and placed
like its parent, on plain dicts (before the child is created). Without an owner (or a name,
namespace, labels), they take the object being handled, as kopf does; outside a handler that
is a `LookupError`."""

import collections.abc

from capstan import invoke

#: An argument not given (None is a value for a name or a namespace).
_UNSET = object()


def _guess_owner(owner):
    """`owner`, else the object of the handler running in this context."""
    if owner is not None:
        return owner
    running = invoke._current.get()
    if running is not None and running.call.handler.resource is not None:
        return running.body
    raise LookupError("Owner must be set explicitly, since running outside of a handler.")


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


def append_owner_reference(objs, owner=None, *, controller=True, block_owner_deletion=True):
    """Adds `owner` to the children's ownerReferences (once)."""
    ref = build_owner_reference(_guess_owner(owner), controller=controller, block_owner_deletion=block_owner_deletion)
    for obj in _objects(objs):
        refs = _meta_of(obj).setdefault("ownerReferences", [])
        if not any(r.get("uid") == ref["uid"] for r in refs):
            refs.append(ref)


def remove_owner_reference(objs, owner=None):
    """Removes `owner` from the children's ownerReferences."""
    uid = _guess_owner(owner).get("metadata", {}).get("uid")
    for obj in _objects(objs):
        refs = _meta_of(obj).get("ownerReferences", [])
        _meta_of(obj)["ownerReferences"] = [r for r in refs if r.get("uid") != uid]


def harmonize_naming(objs, name=_UNSET, *, forced=False, strict=False):
    """Names the children after the parent (`generateName` unless `strict`)."""
    if name is _UNSET:
        name = (_guess_owner(None).get("metadata") or {}).get("name")
    if name is None:
        raise LookupError("Name must be set explicitly: couldn't find it automatically.")
    for obj in _objects(objs):
        meta = _meta_of(obj)
        if forced or not (meta.get("name") or meta.get("generateName")):
            if strict:
                meta.pop("generateName", None)
                meta["name"] = name
            else:
                meta.pop("name", None)
                meta["generateName"] = f"{name}-"


def adjust_namespace(objs, namespace=_UNSET, *, forced=False):
    """Puts the children in the parent's namespace."""
    if namespace is _UNSET:
        namespace = (_guess_owner(None).get("metadata") or {}).get("namespace")
    for obj in _objects(objs):
        meta = _meta_of(obj)
        if forced or not meta.get("namespace"):
            meta["namespace"] = namespace


def label(objs, labels=_UNSET, *, forced=False, nested=None):
    """Copies `labels` (by default the parent's) onto the children (and their `nested`
    templates, e.g. 'spec.template')."""
    if labels is _UNSET:
        labels = (_guess_owner(None).get("metadata") or {}).get("labels") or {}
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


def adopt(objs, owner=None, *, forced=False, strict=False, nested=None):
    """All of the above, as kopf.adopt: owner reference, naming, namespace and labels."""
    owner = _guess_owner(owner)
    meta = owner.get("metadata", {})
    append_owner_reference(objs, owner)
    harmonize_naming(objs, meta.get("name"), forced=forced, strict=strict)
    if meta.get("namespace"):
        adjust_namespace(objs, meta.get("namespace"), forced=forced)
    label(objs, meta.get("labels", {}), forced=forced, nested=nested)
