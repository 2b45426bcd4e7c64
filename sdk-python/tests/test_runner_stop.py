"""The end of `run()`: tasks that handlers left running get kopf's grace to finish (a cleanup
handler may just have asked them to), then are cancelled."""

import asyncio

from capstan import runner


def test_spawned_tasks_finish_within_the_grace_and_the_rest_are_cancelled(monkeypatch):
    monkeypatch.setattr(runner, "SPAWNED_TASKS_GRACE", 0.3)
    seen = []

    async def main():
        before = asyncio.all_tasks()
        stop = asyncio.Event()

        async def asked_to_stop():
            await stop.wait()
            seen.append("stopped on request")

        async def forever():
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                seen.append("cancelled")
                raise

        tasks = [asyncio.create_task(asked_to_stop()), asyncio.create_task(forever())]
        await asyncio.sleep(0)
        loop = asyncio.get_running_loop()
        loop.call_later(0.05, stop.set)  # a cleanup handler's request
        started = loop.time()
        await runner._finish_spawned_tasks(before)
        assert all(task.done() for task in tasks)
        return loop.time() - started

    took = asyncio.run(main())
    assert seen == ["stopped on request", "cancelled"]
    assert 0.3 <= took < 2


def test_nothing_spawned_ends_at_once():
    async def main():
        loop = asyncio.get_running_loop()
        started = loop.time()
        await runner._finish_spawned_tasks(asyncio.all_tasks())
        return loop.time() - started

    assert asyncio.run(main()) < 0.1


def test_the_grace_is_cut_to_what_is_left_of_the_stops_budget(monkeypatch):
    monkeypatch.setattr(runner, "STOP_BUDGET", 1.5)
    monkeypatch.setattr(runner, "CANCELLED_TASKS_GRACE", 0.2)

    async def main():
        before = asyncio.all_tasks()
        task = asyncio.create_task(asyncio.sleep(3600))
        loop = asyncio.get_running_loop()
        started = loop.time()
        # The stop was asked for a second ago: 0.3 s of the grace are left, not 5.
        await runner._finish_spawned_tasks(before, since=runner.time.monotonic() - 1.0)
        return task.cancelled(), loop.time() - started

    cancelled, took = asyncio.run(main())
    assert cancelled and took < 1.0
