"""The operator of the kopf-style runner test (tests/tests/python_kopf_example_tests.rs, with
`runner_example.py`), on the lines of kopf's example 11-filtering-handlers: create handlers
whose label, annotation and `when` filters match or do not, each logging one line. Run by real
kopf's `KopfRunner` and by `capstan.kopf.testing.KopfRunner` (CAPSTAN_DIFFERENTIAL=capstan)."""

import os

if os.environ.get("CAPSTAN_DIFFERENTIAL") == "capstan":
    import capstan.kopf as kopf
else:
    import kopf

RESOURCE = ("demo.capstan.dev", "v1", "examples")


@kopf.on.create(*RESOURCE, labels={"tier": "backend"})
def label_value_matches(logger, **_):
    logger.info("The label has the value asked for.")


@kopf.on.create(*RESOURCE, labels={"tier": kopf.PRESENT})
def label_present(logger, **_):
    logger.info("The label is there.")


@kopf.on.create(*RESOURCE, labels={"tier": "frontend"})
def label_value_differs(logger, **_):
    logger.info("The label has another value.")


@kopf.on.create(*RESOURCE, annotations={"owner": "team-a"})
def annotation_value_matches(logger, **_):
    logger.info("The annotation has the value asked for.")


@kopf.on.create(*RESOURCE, annotations={"owner": kopf.ABSENT})
def annotation_absent(logger, **_):
    logger.info("The annotation is missing.")


@kopf.on.create(*RESOURCE, when=lambda spec, **_: spec.get("field") == "x")
def when_matches(logger, **_):
    logger.info("The condition holds.")


@kopf.on.create(*RESOURCE, when=lambda spec, **_: spec.get("field") == "y")
def when_differs(logger, **_):
    logger.info("The condition does not hold.")


@kopf.on.delete(*RESOURCE)
def delete_fn(logger, **_):
    logger.info("Deleting it.")
