"""kopf's flags for an embedded operator (`kopf.operator(stop_flag=..., ready_flag=...)`): the
application that embeds the operator may hold an `asyncio.Event`, a `threading.Event`, an
`asyncio.Future` or a `concurrent.futures.Future`, often in another thread than the
operator's event loop (kopf's example 12 runs the operator in a thread of its own). The
operator waits on an `asyncio.Event` of its loop that follows the flag, and raises the ready
flag whatever its kind."""

import asyncio
import concurrent.futures
import threading
from typing import Any, Optional, Tuple

#: How often a `threading.Event` is looked at (it cannot wake an event loop by itself).
POLL_INTERVAL = 0.1


def stop_event(flag: Any) -> Tuple[asyncio.Event, Optional[asyncio.Task]]:
    """An `asyncio.Event` of the running loop that is set once `flag` is, and the task that
    follows a `threading.Event` (the caller cancels it when the operator ends)."""
    if flag is None:
        return asyncio.Event(), None
    if isinstance(flag, asyncio.Event):
        return flag, None
    event = asyncio.Event()
    loop = asyncio.get_running_loop()
    if isinstance(flag, threading.Event):
        async def follow():
            while not flag.is_set():
                await asyncio.sleep(POLL_INTERVAL)
            event.set()

        return event, asyncio.create_task(follow(), name="capstan-stop-flag")
    if isinstance(flag, (asyncio.Future, concurrent.futures.Future)):
        flag.add_done_callback(lambda _: loop.call_soon_threadsafe(event.set))
        return event, None
    raise TypeError(f"stop_flag must be an asyncio or threading Event or a Future, got {type(flag).__name__}")


def raise_flag(flag: Any) -> None:
    """Sets `flag` (kopf's ready flag), whatever its kind; a future already done stays so."""
    if flag is None:
        return
    if isinstance(flag, (asyncio.Event, threading.Event)):
        flag.set()
    elif isinstance(flag, (asyncio.Future, concurrent.futures.Future)):
        if not flag.done():
            flag.set_result(None)
    else:
        raise TypeError(f"ready_flag must be an asyncio or threading Event or a Future, got {type(flag).__name__}")
