"""kopf's lifecycles (`kopf.lifecycles`, `kopf.set_default_lifecycle`): which of a parent
handler's pending sub-handlers run in one call of the parent. kopf's default, `asap`, runs one
per call (the fewest retries first), so the parent is called once more for each further
sub-handler; the others are reported to the controller as deferred
(CAPABILITY_DEFERRED_SUBHANDLERS), and it calls the parent again at once. An older controller
that cannot take them gets every pending sub-handler in one call. Top-level handlers are the
controller's: it runs every pending handler of a cycle, so for them a lifecycle has no effect
(the handlers called are the same, in fewer cycles)."""

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
        log.info("kopf.set_default_lifecycle(%s) picks the sub-handlers of each call; the controller runs "
                 "every pending top-level handler of a cycle", getattr(lifecycle, "__name__", lifecycle))
