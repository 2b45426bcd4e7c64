"""Indexes (kopf's `@kopf.index`): kopf's folding rules, the readers' `Index` and `Store`, the
failures, and the kwargs by index name, through the test kit (the same code as under the
controller)."""

import pytest

import capstan
from capstan.registry import Registry
from capstan.testing import TestKit


def cm(name, app, uid=None, namespace="default"):
    return {"metadata": {"name": name, "namespace": namespace, "uid": uid or f"u-{name}", "labels": {"app": app}}}


@pytest.fixture
def kit():
    registry = Registry()

    @capstan.index("configmaps", registry=registry, id="by_app")
    def by_app(labels, name, spec, **_):
        if spec.get("fail") == "temporary":
            raise capstan.TemporaryError("not now", delay=1)
        if spec.get("fail") == "unclassified":
            raise ValueError("oops")
        if spec.get("none"):
            return None
        if spec.get("object"):
            return {"x": object()}
        return {labels.get("app"): name}

    @capstan.on.create("examples", registry=registry, id="reader")
    def reader(by_app: capstan.Index, **_):
        return {app: sorted(store) for app, store in by_app.items()}

    return TestKit(registry)


def test_results_fold_into_the_index_as_kopf_does(kit):
    for name, app in [("a", "web"), ("b", "web"), ("c", "db")]:
        assert kit.index("by_app", cm(name, app)).status == "success"
    assert kit.invoke("reader", {}).result == {"web": ["a", "b"], "db": ["c"]}
    # A change moves the object's entry; an object leaving the index loses it, uncalled.
    kit.index("by_app", cm("b", "db"))
    kit.index("by_app", cm("c", "db"), deleted=True)
    assert kit.invoke("reader", {}).result == {"web": ["a"], "db": ["b"]}
    # None changes nothing.
    body = cm("a", "cache")
    body["spec"] = {"none": True}
    kit.index("by_app", body)
    assert kit.invoke("reader", {}).result == {"web": ["a"], "db": ["b"]}


def test_index_and_store_read_as_kopf(kit):
    kit.index("by_app", cm("a", "web"))
    kit.index("by_app", cm("b", "web"))
    index = kit.indexes.views()["by_app"]
    assert isinstance(index, capstan.Index) and len(index) == 1 and "web" in index
    store = index["web"]
    assert isinstance(store, capstan.Store) and len(store) == 2 and "a" in store
    with pytest.raises(KeyError):
        index["nothing"]  # empty stores do not exist
    kit.index("by_app", cm("c", "db"))
    assert set(index) == {"web", "db"}, "an Index is a live view"


def test_failures_drop_or_keep_the_objects_entries(kit):
    kit.index("by_app", cm("a", "web"))
    kit.index("by_app", cm("b", "web"))
    unclassified = cm("a", "web")
    unclassified["spec"] = {"fail": "unclassified"}
    out = kit.index("by_app", unclassified)
    assert out.status == "unclassified"
    assert kit.invoke("reader", {}).result == {"web": ["a", "b"]}, "IGNORED keeps the stale values"
    temporary = cm("a", "web")
    temporary["spec"] = {"fail": "temporary"}
    assert kit.index("by_app", temporary).status == "temporary"
    assert kit.invoke("reader", {}).result == {"web": ["b"]}, "a failure drops the entries"


def test_a_value_that_is_not_json_names_the_handler(kit):
    body = cm("a", "web")
    body["spec"] = {"object": True}
    out = kit.index("by_app", body)
    assert out.status == "permanent"
    assert "by_app" in out.message and "not JSON-serialisable" in out.message


def test_a_kwarg_that_is_no_index_fails_when_the_operator_starts():
    registry = Registry()

    @capstan.index("configmaps", registry=registry, id="by_app")
    def by_app(**_):
        return None

    @capstan.on.create("examples", registry=registry)
    def reader(by_ap, **_):
        return None

    with pytest.raises(capstan.RegistrationError, match=r"unknown kwarg 'by_ap'.*by_app"):
        TestKit(registry)


def test_index_handlers_get_no_patch():
    registry = Registry()

    @capstan.index("configmaps", registry=registry)
    def by_app(patch, **_):
        return None

    with pytest.raises(capstan.RegistrationError, match=r"unknown kwarg 'patch' for index handlers"):
        registry.check()


def test_objects_leave_by_uid_and_when_they_stop_matching():
    registry = Registry()

    @capstan.index("configmaps", registry=registry, id="by_app", when=lambda labels, **_: "app" in labels)
    def by_app(labels, meta, **_):
        return {labels["app"]: meta}  # the SDK's view is kept as plain data

    @capstan.on.create("examples", registry=registry, id="reader")
    def reader(by_app, **_):
        return {app: [m["name"] for m in store] for app, store in by_app.items()}

    kit = TestKit(registry)
    kit.index("by_app", cm("a", "web"))
    kit.index("by_app", cm("b", "web"))
    assert kit.invoke("reader", {}).result == {"web": ["a", "b"]}
    # Vanished while the controller was paused: only the uid is known.
    kit.index("by_app", {"metadata": {"uid": "u-a"}}, deleted=True)
    assert kit.invoke("reader", {}).result == {"web": ["b"]}
    # No longer matching the SDK-side filter: the entries go.
    unlabelled = cm("b", "web")
    unlabelled["metadata"]["labels"] = {}
    assert kit.index("by_app", unlabelled).status == "skipped"
    assert kit.invoke("reader", {}).result == {}


def test_stores_keep_kopfs_order():
    from capstan.indexes import Indexes
    indexes = Indexes(["by_app"])
    c, a, b = ("ns", "c", "u-c"), ("ns", "a", "u-a"), ("ns", "b", "u-b")
    for obj in (c, a, b):
        indexes.apply("by_app", obj, [("web", obj[1])])
    view = indexes.views()["by_app"]
    assert list(view["web"]) == ["c", "a", "b"]
    indexes.apply("by_app", a, [("web", "a2")])  # a new value keeps its place
    assert list(view["web"]) == ["c", "a2", "b"]
    indexes.apply("by_app", a, [("db", "a")])  # leaves "web", then comes back last
    indexes.apply("by_app", a, [("web", "a")])
    assert list(view["web"]) == ["c", "b", "a"] and "db" not in view
    assert repr(view["web"]) == "['c', 'b', 'a']"
