"""A wake that finds no claimable job at all ends there instead of visiting every waiter."""

from __future__ import annotations

import uuid
from functools import partial

import anyio
import pytest

from tests.helpers import until
from umbra.api.longpoll import NOTHING_QUEUED, WaiterHub

pytestmark = pytest.mark.anyio

ORG = uuid.uuid4()


def _idle(hub: WaiterHub) -> bool:
    return all(not w.pending for w in hub._waiters.get(ORG, {}).values())


async def test_an_empty_queue_ends_the_wake_after_one_attempt():
    hub = WaiterHub(poll_seconds=60)
    attempts: list[str] = []
    jobs: list[str] = []

    def attempt_for(name: str):
        async def attempt():
            attempts.append(name)
            await anyio.sleep(0)
            return jobs.pop(0) if jobs else NOTHING_QUEUED

        return attempt

    async with anyio.create_task_group() as tg:
        for i in range(10):
            tg.start_soon(partial(hub.wait_for, ORG, attempt_for(f"w{i}"), timeout=30))
        await until(lambda: hub.waiting(ORG) == 10 and len(attempts) == 10 and _idle(hub))
        attempts.clear()
        # The job the hint announced was already taken elsewhere: one waiter looks, nobody else.
        hub.on_hint(ORG, 1, 1)
        await until(lambda: len(attempts) == 1 and _idle(hub))
        await anyio.sleep(0.05)
        assert attempts == ["w0"]
        assert hub.waiting(ORG) == 10
        tg.cancel_scope.cancel()


async def test_work_nobody_here_can_run_still_visits_every_waiter_once():
    hub = WaiterHub(poll_seconds=60)
    attempts: list[str] = []

    def attempt_for(name: str):
        async def attempt():
            attempts.append(name)
            await anyio.sleep(0)
            return None  # there is a job, but not one this waiter can run

        return attempt

    async with anyio.create_task_group() as tg:
        for i in range(5):
            tg.start_soon(partial(hub.wait_for, ORG, attempt_for(f"w{i}"), timeout=30))
        await until(lambda: hub.waiting(ORG) == 5 and len(attempts) == 5 and _idle(hub))
        attempts.clear()
        hub.on_hint(ORG, 1, 1)
        await until(lambda: len(attempts) == 5 and _idle(hub))
        assert sorted(attempts) == [f"w{i}" for i in range(5)]
        tg.cancel_scope.cancel()
