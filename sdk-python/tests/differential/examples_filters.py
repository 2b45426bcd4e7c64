"""The filters operator of the kopf examples' differential test
(tests/tests/python_kopf_children_filters.rs), on the lines of kopf's example
11-filtering-handlers: run once by real kopf (`kopf run`) and once by Capstan
(`python -m capstan run`, with CAPSTAN_DIFFERENTIAL=capstan selecting `capstan.kopf`).

Many create, update, field and delete handlers on the same Example, each with its own filter;
for each cause, some filters match the object and some do not. $DIFFERENTIAL_FILTERS selects
one group of handlers:

- `metadata`: `labels=` and `annotations=` filters with exact values, `kopf.PRESENT`,
  `kopf.ABSENT`, callbacks, and several of them combined;
- `conditions`: `when=` callbacks, and `field=` with `value=`, `old=` and `new=`.

Handlers named `*_no` must never be called; those named `*_yes` are called for their cause.
Each call is appended to $DIFFERENTIAL_LOG as one JSON line (handler, object name, the cause's
reason).

The test creates the Example with the labels a=x, b=1, the annotations n=1, m=yes and the spec
f=v, g=keep; updates it to the labels a=xy, c=1 (b removed), the annotation n=2 and f=w; and
deletes it."""

import json
import os

if os.environ.get("CAPSTAN_DIFFERENTIAL") == "capstan":
    import capstan.kopf as kopf
else:
    import kopf

RESOURCE = ("demo.capstan.dev", "v1", "examples")
GROUP = os.environ.get("DIFFERENTIAL_FILTERS", "")


def record(handler, name, reason):
    with open(os.environ["DIFFERENTIAL_LOG"], "a") as log:
        log.write(json.dumps({"handler": handler, "name": name,
                              "reason": str(getattr(reason, "value", reason))}, sort_keys=True) + "\n")


def handler(decorator, handler_id, **filters):
    """Registers a handler that records its calls under `handler_id`."""
    def fn(name, reason, **_):
        record(handler_id, name, reason)
    fn.__name__ = fn.__qualname__ = handler_id
    decorator(*RESOURCE, id=handler_id, **filters)(fn)


def starts_with_x(value, **_):
    return value is not None and value.startswith("x")


if GROUP == "metadata":
    # Creation: labels a=x, b=1; annotations n=1, m=yes.
    handler(kopf.on.create, "create_label_value_yes", labels={"a": "x"})
    handler(kopf.on.create, "create_label_value_no", labels={"a": "y"})
    handler(kopf.on.create, "create_label_present_yes", labels={"b": kopf.PRESENT})
    handler(kopf.on.create, "create_label_present_no", labels={"c": kopf.PRESENT})
    handler(kopf.on.create, "create_label_absent_yes", labels={"c": kopf.ABSENT})
    handler(kopf.on.create, "create_label_absent_no", labels={"a": kopf.ABSENT})
    handler(kopf.on.create, "create_label_callback_yes", labels={"a": starts_with_x})
    handler(kopf.on.create, "create_label_callback_no", labels={"b": lambda value, **_: value == "2"})
    handler(kopf.on.create, "create_annotation_value_yes", annotations={"n": "1"})
    handler(kopf.on.create, "create_annotation_value_no", annotations={"n": "2"})
    handler(kopf.on.create, "create_annotation_present_yes", annotations={"m": kopf.PRESENT})
    handler(kopf.on.create, "create_annotation_absent_yes", annotations={"o": kopf.ABSENT})
    handler(kopf.on.create, "create_annotation_absent_no", annotations={"m": kopf.ABSENT})
    handler(kopf.on.create, "create_annotation_callback_yes", annotations={"m": lambda value, **_: value == "yes"})
    handler(kopf.on.create, "create_combined_yes",
            labels={"a": "x", "c": kopf.ABSENT}, annotations={"n": "1", "m": kopf.PRESENT})
    handler(kopf.on.create, "create_combined_no", labels={"a": "x"}, annotations={"n": "2"})

    # Update: labels a=xy, c=1, b removed; annotation n=2. Filters see the new object.
    handler(kopf.on.update, "update_label_value_yes", labels={"a": "xy"})
    handler(kopf.on.update, "update_label_value_no", labels={"a": "x"})
    handler(kopf.on.update, "update_label_present_yes", labels={"c": kopf.PRESENT})
    handler(kopf.on.update, "update_label_present_no", labels={"b": kopf.PRESENT})
    handler(kopf.on.update, "update_label_absent_yes", labels={"b": kopf.ABSENT})
    handler(kopf.on.update, "update_label_absent_no", labels={"c": kopf.ABSENT})
    handler(kopf.on.update, "update_label_callback_yes", labels={"a": starts_with_x})
    handler(kopf.on.update, "update_label_callback_no", labels={"b": lambda value, **_: value is not None})
    handler(kopf.on.update, "update_annotation_value_yes", annotations={"n": "2"})
    handler(kopf.on.update, "update_annotation_value_no", annotations={"n": "1"})

    # Deletion: the object as updated. The matching ones keep the finalizer on it.
    handler(kopf.on.delete, "delete_label_callback_yes", labels={"a": starts_with_x})
    handler(kopf.on.delete, "delete_label_value_no", labels={"a": "x"})
    handler(kopf.on.delete, "delete_annotation_present_yes", annotations={"m": kopf.PRESENT})
    handler(kopf.on.delete, "delete_label_absent_no", labels={"c": kopf.ABSENT})

elif GROUP == "conditions":
    # Creation: spec f=v, g=keep.
    handler(kopf.on.create, "create_when_yes", when=lambda spec, **_: spec.get("f") == "v")
    handler(kopf.on.create, "create_when_no", when=lambda spec, **_: spec.get("f") == "w")
    handler(kopf.on.create, "create_when_labels_yes", when=lambda labels, **_: labels.get("a") == "x")
    handler(kopf.on.create, "create_field_value_yes", field="spec.f", value="v")
    handler(kopf.on.create, "create_field_value_no", field="spec.f", value="w")

    # Field handlers: for creation and update alike, when their field changes.
    handler(kopf.on.field, "field_f_value_v_yes", field="spec.f", value="v")
    handler(kopf.on.field, "field_f_value_w_yes", field="spec.f", value="w")
    handler(kopf.on.field, "field_g_yes", field="spec.g")
    handler(kopf.on.field, "field_h_no", field="spec.h")

    # Update: f=v to f=w, g unchanged.
    handler(kopf.on.update, "update_when_yes", when=lambda spec, **_: spec.get("f") == "w")
    handler(kopf.on.update, "update_when_no", when=lambda spec, **_: spec.get("f") == "v")
    handler(kopf.on.update, "update_when_old_new_yes",
            when=lambda old, new, **_: old["spec"]["f"] == "v" and new["spec"]["f"] == "w")
    handler(kopf.on.update, "update_field_old_new_yes", field="spec.f", old="v", new="w")
    handler(kopf.on.update, "update_field_old_new_no", field="spec.f", old="w", new="v")
    handler(kopf.on.update, "update_field_new_yes", field="spec.f", new="w")
    handler(kopf.on.update, "update_field_old_no", field="spec.f", old="x")
    handler(kopf.on.update, "update_field_unchanged_no", field="spec.g")
    handler(kopf.on.update, "update_field_old_absent_no", field="spec.f", old=kopf.ABSENT)

    # Deletion.
    handler(kopf.on.delete, "delete_when_yes", when=lambda spec, **_: spec.get("f") == "w")
    handler(kopf.on.delete, "delete_when_no", when=lambda spec, **_: spec.get("f") == "v")
    handler(kopf.on.delete, "delete_field_value_yes", field="spec.g", value="keep")
    handler(kopf.on.delete, "delete_field_value_no", field="spec.g", value="other")

else:
    raise RuntimeError(f"DIFFERENTIAL_FILTERS={GROUP!r}: expected 'metadata' or 'conditions'")
