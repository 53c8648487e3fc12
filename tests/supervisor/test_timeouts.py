"""supervisor.timeouts.Deadline does what asyncio.timeout does, in each case
the broker meets: every test runs both and compares."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager

import pytest

from supervisor.timeouts import Deadline

#: Long enough never to fire while a test's own steps run.
NEVER_S = 60.0
#: The bound on every test's own wait.
STEP_S = 10.0

Limit = Callable[[float], AbstractAsyncContextManager[object]]
LIMITS = pytest.mark.parametrize(
    "limit", [asyncio.timeout, Deadline], ids=["asyncio.timeout", "Deadline"]
)
#: asyncio.timeout leaves a cancel asked before it began alone from 3.11.3 on
#: (gh-102780); 3.11.2 (Debian 12's) raises CancelledError for its own expiry.
STDLIB_KEEPS_EARLIER_CANCELS = sys.version_info >= (3, 11, 3)


@LIMITS
async def test_a_block_that_outlives_its_delay_is_cancelled_and_raises_timeout_error(
    limit: Limit,
) -> None:
    never = asyncio.get_running_loop().create_future()
    seen: list[str] = []

    async def handler() -> None:
        try:
            await never
        except asyncio.CancelledError:
            seen.append("cancelled")
            raise

    async with asyncio.timeout(STEP_S):
        with pytest.raises(TimeoutError):
            async with limit(0.01):
                await handler()
    task = asyncio.current_task()

    assert seen == ["cancelled"]
    assert task is not None and task.cancelling() == 0


@LIMITS
async def test_a_block_that_ends_in_time_returns_and_is_never_cancelled_later(
    limit: Limit,
) -> None:
    loop = asyncio.get_running_loop()
    async with limit(0.01):
        value = 42
    # Timers run in the order of their times: this one comes after the delay.
    later = loop.create_future()
    loop.call_later(0.05, later.set_result, None)
    async with asyncio.timeout(STEP_S):
        await later  # a stray cancel from the block's timer would land here
    task = asyncio.current_task()

    assert value == 42
    assert task is not None and task.cancelling() == 0


@LIMITS
async def test_an_error_in_the_block_passes_through_unchanged(limit: Limit) -> None:
    with pytest.raises(KeyError, match="boom"):
        async with limit(NEVER_S):
            raise KeyError("boom")


@LIMITS
async def test_a_cancel_from_outside_stays_a_cancel(limit: Limit) -> None:
    loop = asyncio.get_running_loop()
    started = loop.create_future()
    never = loop.create_future()

    async def dispatch() -> str:
        async with limit(NEVER_S):
            started.set_result(None)
            await never
        return "returned"

    task = asyncio.create_task(dispatch())
    async with asyncio.timeout(STEP_S):
        await started
        task.cancel()  # a shutdown
        with pytest.raises(asyncio.CancelledError):
            await task


@LIMITS
async def test_a_cancel_from_outside_at_the_moment_of_expiry_stays_a_cancel(
    limit: Limit,
) -> None:
    loop = asyncio.get_running_loop()
    never = loop.create_future()
    expired = loop.create_future()

    async def dispatch() -> str:
        try:
            async with limit(0.01):
                try:
                    await never
                except asyncio.CancelledError:
                    expired.set_result(None)
                    await asyncio.shield(loop.create_future())  # held until cancelled again
        except TimeoutError:
            return "timed out"
        return "returned"

    task = asyncio.create_task(dispatch())
    async with asyncio.timeout(STEP_S):
        await expired  # the delay has passed and cancelled the block
        task.cancel()  # and a shutdown asks too
        with pytest.raises(asyncio.CancelledError):
            await task


@LIMITS
async def test_a_task_already_being_cancelled_keeps_that_cancel(limit: Limit) -> None:
    if limit is asyncio.timeout and not STDLIB_KEEPS_EARLIER_CANCELS:
        pytest.skip("this Python's asyncio.timeout predates gh-102780; Deadline is still tested")
    loop = asyncio.get_running_loop()
    started = loop.create_future()
    never = loop.create_future()
    outcome: list[str] = []

    async def dispatch() -> None:
        task = asyncio.current_task()
        assert task is not None
        try:
            started.set_result(None)
            await never
        except asyncio.CancelledError:
            pass  # swallowed once; the task is still "cancelling"
        assert task.cancelling() == 1
        try:
            async with limit(0.01):
                await loop.create_future()
        except TimeoutError:
            outcome.append("timed out")
        outcome.append(f"cancelling {task.cancelling()}")

    task = asyncio.create_task(dispatch())
    async with asyncio.timeout(STEP_S):
        await started
        task.cancel()
        await task

    assert outcome == ["timed out", "cancelling 1"]


async def test_a_deadline_cannot_be_entered_twice_at_once() -> None:
    deadline = Deadline(NEVER_S)
    async with deadline:
        with pytest.raises(RuntimeError, match="already entered"):
            async with deadline:
                pass
    assert not deadline.expired
