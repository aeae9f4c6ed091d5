"""`gather_or_cancel` (actors/async_loop.py): one failing episode cancels its siblings before the failure is
raised, so nothing is left running on the engine's loop; without a failure it is `asyncio.gather`."""

from __future__ import annotations

import asyncio

import pytest

from actors.async_loop import gather_or_cancel


def test_results_in_order_when_nothing_fails() -> None:
    async def value(x: int) -> int:
        await asyncio.sleep(0)
        return x * 10

    assert asyncio.run(gather_or_cancel(value(1), value(2), value(3))) == [10, 20, 30]


def test_a_failure_cancels_the_siblings_before_it_is_raised() -> None:
    cancelled: list[int] = []
    finished: list[int] = []

    async def blocked(i: int) -> None:  # an episode waiting on a turn that never comes
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.append(i)
            raise

    async def done_early(i: int) -> None:
        finished.append(i)

    async def fails() -> None:
        await asyncio.sleep(0)  # after every sibling has started
        raise ValueError("bad chat template")

    async def main() -> int:
        with pytest.raises(ValueError, match="bad chat template"):  # the failure itself, not a group
            await gather_or_cancel(blocked(0), done_early(1), fails(), blocked(3))
        return len(asyncio.all_tasks())  # this coroutine's own task only: no orphan left

    assert asyncio.run(main()) == 1
    assert sorted(cancelled) == [0, 3]  # both blocked siblings were cancelled ...
    assert finished == [1]  # ... and the one that had finished kept its result


def test_cancelling_the_gather_cancels_every_child() -> None:
    cancelled: list[int] = []

    async def blocked(i: int) -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.append(i)
            raise

    async def main() -> None:
        task = asyncio.ensure_future(gather_or_cancel(blocked(0), blocked(1)))
        await asyncio.sleep(0)
        await asyncio.sleep(0)  # both children are waiting now
        task.cancel()  # what EpisodeRunner.drive does when a weight load fails
        with pytest.raises(asyncio.CancelledError):  # carries no message: its type is the whole signal
            await task

    asyncio.run(main())
    assert sorted(cancelled) == [0, 1]
