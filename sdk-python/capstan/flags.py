"""kopf's flags for an embedded operator (`kopf.operator(stop_flag=..., ready_flag=...)`): the
application that embeds the operator may hold an `asyncio.Event`, a `threading.Event`, an
`asyncio.Future` or a `concurrent.futures.Future`, often in another thread than the
operator's event loop (kopf's example 12 runs the operator in a thread of its own, with an
event loop of its own). The operator waits on an `asyncio.Event` of its loop that follows the
stop flag, and raises the ready flag whatever its kind, through the flag's own loop when it
belongs to another one (asyncio objects are not thread-safe)."""

import asyncio
import concurrent.futures
import logging
import threading
from typing import Any, Callable, Optional, Tuple

log = logging.getLogger("capstan")

#: How often a `threading.Event` is looked at (it cannot wake an event loop by itself).
POLL_INTERVAL = 0.1

_KINDS = (asyncio.Event, threading.Event, asyncio.Future, concurrent.futures.Future)


def check(name: str, flag: Any) -> None:
    """Refuses a flag of no kind kopf takes, before anything starts."""
    if flag is not None and not isinstance(flag, _KINDS):
        raise TypeError(f"{name} must be an asyncio or threading Event or a Future, got {type(flag).__name__}")


def _loop_of(flag: Any) -> Optional[asyncio.AbstractEventLoop]:
    """The event loop an asyncio flag belongs to (an Event binds to one when first waited on)."""
    if isinstance(flag, asyncio.Future):
        return flag.get_loop()
    return getattr(flag, "_loop", None)


def _in_its_loop(flag: Any, action: Callable[[], None]) -> None:
    """Runs `action` on the asyncio `flag` in its own loop: here when it is the running one (or
    the flag has none yet), through the other loop's thread-safe queue otherwise."""
    loop = _loop_of(flag)
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if loop is None or loop is running:
        action()
        return
    try:
        loop.call_soon_threadsafe(action)
    except RuntimeError:  # its loop is closed: nobody waits on it any more
        log.debug("a flag of a closed event loop was not raised")


def stop_event(flag: Any) -> Tuple[asyncio.Event, Callable[[], None]]:
    """An `asyncio.Event` of the running loop that is set once `flag` is, and what to call
    when the operator ends (it stops following the flag)."""
    check("stop_flag", flag)
    if flag is None:
        return asyncio.Event(), lambda: None
    if isinstance(flag, asyncio.Event) and _loop_of(flag) in (None, asyncio.get_running_loop()):
        return flag, lambda: None
    event = asyncio.Event()
    loop = asyncio.get_running_loop()

    def wake(_=None):
        try:
            loop.call_soon_threadsafe(event.set)
        except RuntimeError:  # the operator's loop is closed: it has ended already
            pass

    if isinstance(flag, (asyncio.Future, concurrent.futures.Future)):
        if isinstance(flag, asyncio.Future):
            _in_its_loop(flag, lambda: flag.add_done_callback(wake))
            return event, lambda: _in_its_loop(flag, lambda: flag.remove_done_callback(wake))
        flag.add_done_callback(wake)  # thread-safe; at once when done already
        return event, lambda: None

    # A threading.Event, or an asyncio.Event of another loop: looked at every POLL_INTERVAL.
    async def follow():
        while not flag.is_set():
            await asyncio.sleep(POLL_INTERVAL)
        event.set()

    following = asyncio.create_task(follow(), name="capstan-stop-flag")
    return event, following.cancel


def raise_flag(flag: Any) -> None:
    """Sets `flag` (kopf's ready flag), whatever its kind; a future already done stays so."""
    check("ready_flag", flag)
    if flag is None:
        return
    if isinstance(flag, threading.Event):
        flag.set()
    elif isinstance(flag, concurrent.futures.Future):
        if not flag.done():
            try:
                flag.set_result(None)
            except concurrent.futures.InvalidStateError:  # done meanwhile, in another thread
                pass
    elif isinstance(flag, asyncio.Event):
        _in_its_loop(flag, flag.set)
    else:
        _in_its_loop(flag, lambda: flag.done() or flag.set_result(None))
