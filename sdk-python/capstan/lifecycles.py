"""kopf's lifecycles (`kopf.lifecycles`, `kopf.set_default_lifecycle`): which of an object's
pending handlers run in one cycle. kopf's default, `asap`, runs one per cycle (the fewest
retries first). With Capstan every pending handler of a cycle runs — the controller's
top-level handlers, and a parent's sub-handlers in the handler process (the protocol has no
outcome for a sub-handler left for a later cycle) — so the functions are kopf's own, for code
that calls them, and setting one says once that it is not applied."""

import logging
import random
from typing import Any, Callable, Optional, Sequence

log = logging.getLogger("capstan")

LifeCycleFn = Callable[..., Sequence[Any]]


def all_at_once(handlers: Sequence[Any], **_: Any) -> Sequence[Any]:
    """Every pending handler at once."""
    return handlers


def one_by_one(handlers: Sequence[Any], **_: Any) -> Sequence[Any]:
    """The first pending handler only."""
    return handlers[:1]


def randomized(handlers: Sequence[Any], **_: Any) -> Sequence[Any]:
    """One pending handler, picked at random."""
    return [random.choice(handlers)] if handlers else []


def shuffled(handlers: Sequence[Any], **_: Any) -> Sequence[Any]:
    """Every pending handler, in random order."""
    handlers = list(handlers)
    random.shuffle(handlers)
    return handlers


def asap(handlers: Sequence[Any], *, state: Any = None, **_: Any) -> Sequence[Any]:
    """The pending handler with the fewest retries."""
    def retries(handler):
        record = state[handler.id] if state is not None and handler.id in state else None
        return getattr(record, "retries", 0) or 0

    return sorted(handlers, key=retries)[:1]


_default: Optional[LifeCycleFn] = None
_said = False


def get_default_lifecycle() -> LifeCycleFn:
    return _default if _default is not None else asap


def set_default_lifecycle(lifecycle: Optional[LifeCycleFn]) -> None:
    global _default, _said
    _default = lifecycle
    if lifecycle is not None and not _said:
        _said = True
        log.info("kopf.set_default_lifecycle(%s) has no effect with Capstan: the controller orders the handlers",
                 getattr(lifecycle, "__name__", lifecycle))
