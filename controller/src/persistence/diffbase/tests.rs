use serde_json::json;

use super::*;

fn path(dotted: &str) -> Vec<String> {
    dotted.split('.').map(str::to_owned).collect()
}

fn watched(dotted: &[&str]) -> Watched {
    Watched::paths(dotted.iter().map(|d| path(d)))
}

#[test]
fn round_trips_in_kopf_format() {
    let storage = DiffBaseStorage::Annotations(Keys::kopf());
    let mut body = json!({});
    storage.store(&DiffBase::Essence(json!({"spec": {"a": 1}})), &mut body);
    assert_eq!(
        body["metadata"]["annotations"]["kopf.zalando.org/last-handled-configuration"],
        json!("{\"spec\":{\"a\":1}}\n")
    );
    assert_eq!(
        storage.fetch(&body),
        Some(DiffBase::Essence(json!({"spec": {"a": 1}})))
    );
    let status = DiffBaseStorage::Status {
        name: "capstan".into(),
    };
    status.store(&DiffBase::Essence(json!({"x": 1})), &mut body);
    assert_eq!(status.fetch(&body), Some(DiffBase::Essence(json!({"x": 1}))));
}

#[test]
fn the_compact_format_round_trips_in_both_storages() {
    let essence = json!({"spec": {"a": {"b": [1, 2]}, "big": "x".repeat(1000)}, "status": {"phase": null}});
    let w = watched(&["spec.a", "status.phase", "spec.gone"]);
    let base = DiffBase::of(&essence, &w);
    assert_eq!(
        base.encode(),
        "[1,{\"spec.a\":{\"b\":[1,2]},\"status.phase\":null},[\"spec.gone\"]]\n"
    );
    assert_eq!(DiffBase::parse(&base.encode()), Some(base.clone()));
    for storage in [
        DiffBaseStorage::Annotations(Keys::new("capstan.dev")),
        DiffBaseStorage::Status {
            name: "capstan".into(),
        },
    ] {
        let mut body = json!({"spec": {}});
        storage.store(&base, &mut body);
        assert_eq!(storage.fetch(&body), Some(base.clone()));
    }
}

#[test]
fn nothing_watched_costs_a_few_bytes() {
    let base = DiffBase::of(&json!({"spec": {"big": "x".repeat(1000)}}), &Watched::paths([]));
    assert_eq!(base.encode(), "[1]\n");
    assert_eq!(DiffBase::parse("[1]\n"), Some(DiffBase::Fields(BTreeMap::new())));
    let only_absent = DiffBase::of(&json!({}), &watched(&["spec.a"]));
    assert_eq!(only_absent.encode(), "[1,{},[\"spec.a\"]]\n");
    assert_eq!(DiffBase::parse(&only_absent.encode()), Some(only_absent));
}

#[test]
fn other_values_are_diff_bases_that_cover_nothing() {
    assert_eq!(DiffBase::parse("not json"), None);
    for text in ["[2,{\"spec\":1}]", "\"text\"", "[]", "7"] {
        let base = DiffBase::parse(text).expect("JSON");
        assert_eq!(base, DiffBase::Fields(BTreeMap::new()), "{text}");
        let new = json!({"spec": {"a": 1}});
        assert_eq!(base.overlay(&new, &watched(&["spec.a"])), new);
    }
}

#[test]
fn watched_paths_are_minimal() {
    assert_eq!(
        watched(&["spec.a.b", "spec.a", "spec.ab", "status.phase", "spec.a"]),
        Watched::Paths(vec![path("spec.a"), path("spec.ab"), path("status.phase")])
    );
}

#[test]
fn overlay_puts_the_stored_values_at_covered_paths_only() {
    let stored = DiffBase::of(
        &json!({"spec": {"a": 1, "b": 2, "c": 3}, "metadata": {"labels": {"x": "1"}}}),
        &watched(&["spec.a", "spec.d", "metadata.labels.x"]),
    );
    let new = json!({"spec": {"a": 10, "b": 20, "d": 40}, "metadata": {"labels": {"x": "2", "y": "3"}}});
    let w = watched(&["spec.a", "spec.d", "metadata.labels.x", "spec.c"]);
    // spec.a and labels.x take the stored values, spec.d had none (removed), spec.c is not
    // covered (unchanged), spec.b and labels.y are not watched (unchanged).
    assert_eq!(
        stored.overlay(&new, &w),
        json!({"spec": {"a": 1, "b": 20}, "metadata": {"labels": {"x": "1", "y": "3"}}})
    );
    assert!(!stored.covers(&w));
    assert!(stored.covers(&watched(&["spec.a", "spec.d"])));
}

#[test]
fn overlay_follows_watched_paths_that_grow_and_shrink() {
    let stored = DiffBase::of(
        &json!({"spec": {"a": {"b": 1, "c": 2}, "e": 5}}),
        &watched(&["spec.a", "spec.e"]),
    );
    let new = json!({"spec": {"a": {"b": 10, "c": 20}, "e": 50, "f": 60}});
    // Shrunk: a path under a stored one is covered by it.
    assert_eq!(
        stored.overlay(&new, &watched(&["spec.a.b"])),
        json!({"spec": {"a": {"b": 1, "c": 20}, "e": 50, "f": 60}})
    );
    assert!(stored.covers(&watched(&["spec.a.b"])));
    // Grown: the stored paths inside a wider watched path are put, the rest is unchanged.
    assert_eq!(
        stored.overlay(&new, &watched(&["spec"])),
        json!({"spec": {"a": {"b": 1, "c": 2}, "e": 5, "f": 60}})
    );
    assert!(!stored.covers(&watched(&["spec"])));
    // Everything watched (an update handler without a field): the same.
    assert_eq!(
        stored.overlay(&new, &Watched::All),
        json!({"spec": {"a": {"b": 1, "c": 2}, "e": 5, "f": 60}})
    );
    assert!(!stored.covers(&Watched::All));
    // A stored value of a path whose parent is not an object any more.
    let scalar = json!({"spec": {"a": 7, "e": 50}});
    assert_eq!(
        stored.overlay(&scalar, &watched(&["spec.a.b"])),
        json!({"spec": {"a": {"b": 1}, "e": 50}})
    );
    // A stored absence inside a path whose value is a scalar now: nothing to remove.
    let absent = DiffBase::of(&json!({}), &watched(&["spec.a.b"]));
    assert_eq!(absent.overlay(&scalar, &watched(&["spec.a.b"])), scalar);
    assert_eq!(
        absent.overlay(&new, &watched(&["spec.a"])),
        json!({"spec": {"a": {"c": 20}, "e": 50, "f": 60}})
    );
}

#[test]
fn an_essence_is_read_as_full() {
    let old = json!({"spec": {"a": 1, "b": 2}});
    let stored = DiffBase::parse("{\"spec\":{\"a\":1,\"b\":2}}\n").expect("essence");
    let new = json!({"spec": {"a": 10, "b": 20, "c": 30}});
    assert_eq!(stored.overlay(&new, &Watched::All), old);
    assert!(stored.covers(&Watched::All));
    assert_eq!(
        stored.overlay(&new, &watched(&["spec.a", "spec.c"])),
        json!({"spec": {"a": 1, "b": 20}})
    );
    assert!(stored.covers(&watched(&["spec.c"])));
    // Nothing watched: the old essence is the new one, whatever changed.
    assert_eq!(stored.overlay(&new, &Watched::paths([])), new);
}

#[test]
fn a_new_diff_base_is_written_only_when_it_matters() {
    let handled = json!({"spec": {"a": 1, "b": 2}});
    let w = watched(&["spec.a"]);
    let next = DiffBase::of(&handled, &w);
    // An essence equal to the handled one stays (no write only for the format); one that
    // agrees on the watched fields but not on the others is out of date (`stale`).
    let same = DiffBase::Essence(handled.clone());
    assert!(!same.outdated_by(&next, &handled, &w));
    let essence = DiffBase::Essence(json!({"spec": {"a": 1, "b": 99}}));
    assert!(essence.stale(&handled, &w));
    assert!(essence.outdated_by(&next, &handled, &w));
    let changed = DiffBase::Essence(json!({"spec": {"a": 2, "b": 2}}));
    assert!(changed.outdated_by(&next, &handled, &w));
    // The same compact diff-base: nothing to write; other paths or values: written.
    assert!(!next.outdated_by(&next, &handled, &w));
    let wider = DiffBase::of(&handled, &watched(&["spec.a", "spec.b"]));
    assert!(wider.outdated_by(&next, &handled, &w));
    let narrower = DiffBase::of(&handled, &Watched::paths([]));
    assert!(narrower.outdated_by(&next, &handled, &w));
    // Everything watched: kopf's comparison of essences.
    let full = DiffBase::of(&handled, &Watched::All);
    assert!(!full.outdated_by(&full, &handled, &Watched::All));
    assert!(essence.outdated_by(&full, &handled, &Watched::All));
    assert!(next.outdated_by(&full, &handled, &Watched::All));
}
