"""The master's read loop starts a mutating request's handler in its own task
(``server._start_eagerly``): a handler that never suspends (a memory log's commit) is
answered there, one that suspends (an fsync, a quorum) goes on in a task exactly as an
awaited coroutine would -- results sent in, exceptions and cancellation thrown in."""

from __future__ import annotations

import asyncio

from kvmesh.store.server import _start_eagerly


def test_a_handler_that_never_suspends_runs_to_its_end_at_once() -> None:
    done: list[str] = []

    async def handler() -> None:  # awaits nothing (a memory log's commit awaits a done future)
        done.append("answered")

    async def main() -> None:
        assert _start_eagerly(handler()) is None
        assert done == ["answered"]  # before the loop ran anything else

    asyncio.run(main())


def test_a_suspended_handler_goes_on_in_a_task_with_what_it_awaited() -> None:
    steps: list[object] = []

    async def handler(fut: asyncio.Future, later: asyncio.Future) -> None:
        steps.append("started")
        steps.append(await fut)  # the result is sent in
        await asyncio.sleep(0)  # a bare yield
        try:
            await later
        except ValueError as e:  # an exception is thrown in
            steps.append(f"raised {e}")

    async def main() -> None:
        loop = asyncio.get_running_loop()
        fut, later = loop.create_future(), loop.create_future()
        t = _start_eagerly(handler(fut, later))
        assert t is not None and steps == ["started"]  # ran up to its first suspension
        fut.set_result(41)
        for _ in range(5):
            await asyncio.sleep(0)
        assert steps == ["started", 41] and not t.done()
        later.set_exception(ValueError("boom"))
        await t
        assert steps == ["started", 41, "raised boom"]

    asyncio.run(main())


def test_cancelling_the_task_cancels_the_suspended_handler() -> None:
    seen: list[str] = []

    async def handler(fut: asyncio.Future) -> None:
        try:
            await fut
        except asyncio.CancelledError:
            seen.append("cancelled")
            raise
        finally:
            seen.append("cleaned up")

    async def main() -> None:
        fut = asyncio.get_running_loop().create_future()
        t = _start_eagerly(handler(fut))
        assert t is not None
        await asyncio.sleep(0)
        t.cancel()
        try:
            await t
        except asyncio.CancelledError:
            pass
        assert t.cancelled()
        assert seen == ["cancelled", "cleaned up"]
        assert fut.cancelled()  # what it waited on is cancelled with it, as for any task

    asyncio.run(main())
