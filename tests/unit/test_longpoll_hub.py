"""The waiter hub's wake policy, without a database: wake as many as there is work,
pass a wake on when the woken waiter cannot use it, never lose one."""

from __future__ import annotations

import uuid
from functools import partial

import anyio
import pytest

from tests.helpers import eventually
from umbra.api.longpoll import WaiterHub

pytestmark = pytest.mark.anyio

ORG = uuid.uuid4()


class Queue:
    """Jobs as (name, capability needed); an attempt takes the first one it can run."""

    def __init__(self) -> None:
        self.jobs: list[tuple[str, str]] = []
        self.attempts: dict[str, int] = {}

    def attempt_for(self, who: str, can: set[str]):
        async def attempt():
            self.attempts[who] = self.attempts.get(who, 0) + 1
            await anyio.sleep(0)
            for job in self.jobs:
                if job[1] in can:
                    self.jobs.remove(job)
                    return job[0]
            return None

        return attempt


async def _park(hub: WaiterHub, n: int) -> None:
    await eventually(lambda: _async(hub.waiting(ORG) == n and all(_idle(hub))))


def _idle(hub):
    return [not w.pending for w in hub._waiters.get(ORG, {}).values()]


async def _async(value):
    return value


async def test_one_job_wakes_exactly_one_of_many_waiters():
    hub = WaiterHub(poll_seconds=60)
    queue = Queue()
    results: dict[str, object] = {}
    async with anyio.create_task_group() as tg:
        for i in range(10):
            name = f"w{i}"

            async def run(name=name):
                results[name] = await hub.wait_for(ORG, queue.attempt_for(name, {"cpu"}), timeout=1.5)

            tg.start_soon(run)
        await _park(hub, 10)
        assert sum(queue.attempts.values()) == 10  # each tried once on arrival
        queue.jobs.append(("job-1", "cpu"))
        hub.on_hint(ORG, 1, 1)
        await eventually(lambda: _async("job-1" in results.values()))
        # No herd: one more attempt in total, and the other nine are still parked.
        assert sum(queue.attempts.values()) == 11
        assert hub.waiting(ORG) == 9
    assert list(results.values()).count("job-1") == 1
    assert list(results.values()).count(None) == 9


async def test_a_waiter_that_cannot_run_the_job_passes_the_wake_on():
    hub = WaiterHub(poll_seconds=60)
    queue = Queue()
    results: dict[str, object] = {}
    async with anyio.create_task_group() as tg:

        async def run(name, can):
            results[name] = await hub.wait_for(ORG, queue.attempt_for(name, can), timeout=5)

        tg.start_soon(run, "cpu-only-1", {"cpu"})
        await _park(hub, 1)
        tg.start_soon(run, "cpu-only-2", {"cpu"})
        await _park(hub, 2)
        tg.start_soon(run, "gpu", {"cpu", "gpu"})
        await _park(hub, 3)
        queue.jobs.append(("needs-gpu", "gpu"))
        hub.on_hint(ORG, 1, 1)  # the oldest waiter (cpu-only) gets the wake first
        await eventually(lambda: _async(results.get("gpu") == "needs-gpu"))
        assert queue.attempts == {"cpu-only-1": 2, "cpu-only-2": 2, "gpu": 2}
        assert hub.waiting(ORG) == 2
        # Nobody can use a wake now: it is dropped after one round, not bounced forever.
        queue.jobs.append(("needs-tpu", "tpu"))
        hub.on_hint(ORG, 2, 1)
        await eventually(lambda: _async(queue.attempts == {"cpu-only-1": 3, "cpu-only-2": 3, "gpu": 2}))
        await _park(hub, 2)
        assert queue.attempts == {"cpu-only-1": 3, "cpu-only-2": 3, "gpu": 2}
        tg.cancel_scope.cancel()


async def test_hint_without_claimable_work_wakes_nobody_and_other_orgs_are_untouched():
    hub = WaiterHub(poll_seconds=60)
    queue = Queue()
    async with anyio.create_task_group() as tg:
        tg.start_soon(partial(hub.wait_for, ORG, queue.attempt_for("a", {"cpu"}), timeout=5))
        await _park(hub, 1)
        hub.on_hint(ORG, 5, 0)
        hub.on_hint(uuid.uuid4(), 6, 3)
        assert _idle(hub) == [True]
        tg.cancel_scope.cancel()


async def test_reconnect_makes_every_waiter_recheck():
    hub = WaiterHub(poll_seconds=60)
    queue = Queue()
    results: list[object] = []
    async with anyio.create_task_group() as tg:
        for i in range(3):

            async def run(i=i):
                results.append(await hub.wait_for(ORG, queue.attempt_for(f"w{i}", {"cpu"}), timeout=5))

            tg.start_soon(run)
        await _park(hub, 3)
        queue.jobs += [("a", "cpu"), ("b", "cpu")]  # committed while the listener was away
        hub.on_reconnect()
        await eventually(lambda: _async(sorted(r for r in results if r) == ["a", "b"]))
        assert queue.attempts == {"w0": 2, "w1": 2, "w2": 2}
        tg.cancel_scope.cancel()


async def test_a_recheck_wakes_every_waiter_of_its_organization_only():
    """A change that refuses some parked claims (a node's credentials revoked) sends no work: every waiter of
    the organization tries again, a waiter of another organization does not."""
    hub = WaiterHub(poll_seconds=60)
    queue = Queue()
    other = uuid.uuid4()
    async with anyio.create_task_group() as tg:
        for i, org in enumerate((ORG, ORG, other)):

            async def run(i=i, org=org):
                await hub.wait_for(org, queue.attempt_for(f"w{i}", {"cpu"}), timeout=5)

            tg.start_soon(run)
        await _park(hub, 2)
        await eventually(lambda: _async(hub.waiting(other) == 1 and queue.attempts.get("w2") == 1))
        hub.on_recheck(ORG)
        await eventually(lambda: _async(queue.attempts.get("w0") == 2 and queue.attempts.get("w1") == 2))
        assert queue.attempts["w2"] == 1
        tg.cancel_scope.cancel()


async def test_timeout_answers_none_and_unregisters():
    hub = WaiterHub(poll_seconds=60)
    queue = Queue()
    assert await hub.wait_for(ORG, queue.attempt_for("a", {"cpu"}), timeout=0.05) is None
    assert await hub.wait_for(ORG, queue.attempt_for("a", {"cpu"}), timeout=0) is None
    assert hub.waiting() == 0
    assert queue.attempts == {"a": 2}


async def test_a_waiter_leaving_with_a_wake_passes_it_on():
    hub = WaiterHub(poll_seconds=60)
    queue = Queue()
    results: dict[str, object] = {}
    async with anyio.create_task_group() as tg:
        leaving = anyio.CancelScope()

        async def first():
            with leaving:
                await hub.wait_for(ORG, queue.attempt_for("leaver", {"cpu"}), timeout=5)

        tg.start_soon(first)
        await _park(hub, 1)

        async def second():
            results["stayer"] = await hub.wait_for(ORG, queue.attempt_for("stayer", {"cpu"}), timeout=5)

        tg.start_soon(second)
        await _park(hub, 2)
        queue.jobs.append(("j", "cpu"))
        leaving.cancel()  # the oldest waiter is leaving (its client hung up) ...
        hub.on_hint(ORG, 1, 1)  # ... when the wake is handed to it, before it could try
        await eventually(lambda: _async(results.get("stayer") == "j"))
        assert queue.attempts == {"leaver": 1, "stayer": 2}
        await eventually(lambda: _async(results.get("stayer") == "j"))


async def test_cancelling_mid_attempt_lets_the_attempt_finish():
    hub = WaiterHub(poll_seconds=60)
    finished = anyio.Event()
    started = anyio.Event()

    async def slow_claim():
        started.set()
        await anyio.sleep(0.1)
        finished.set()
        return "claimed"

    result = "not returned"
    with anyio.CancelScope() as scope:

        async def cancel_soon():
            await started.wait()
            scope.cancel()

        async with anyio.create_task_group() as tg:
            tg.start_soon(cancel_soon)
            result = await hub.wait_for(ORG, slow_claim, timeout=5)
    assert finished.is_set()
    assert result == "claimed"  # the caller sees the claim and can release it


async def test_stop_answers_parked_waiters_at_once():
    hub = WaiterHub(poll_seconds=60)
    queue = Queue()
    results: list[object] = []
    async with anyio.create_task_group() as tg:
        for i in range(3):

            async def run(i=i):
                results.append(await hub.wait_for(ORG, queue.attempt_for(f"w{i}", {"cpu"}), timeout=30))

            tg.start_soon(run)
        await _park(hub, 3)
        with anyio.fail_after(2):
            hub.stop()
            await eventually(lambda: _async(len(results) == 3))
    assert results == [None, None, None]


async def test_a_waiter_whose_attempt_raises_passes_the_wake_on():
    """A revoked node's parked poll (its attempt raises) must not take a wake another node could use."""
    hub = WaiterHub(poll_seconds=60)
    queue = Queue()
    results: dict[str, object] = {}
    raised: list[str] = []
    calls = {"revoked": 0}

    async def revoked():
        calls["revoked"] += 1
        if calls["revoked"] > 1:
            raise RuntimeError("credential revoked")
        return None

    async with anyio.create_task_group() as tg:

        async def run_revoked():
            try:
                await hub.wait_for(ORG, revoked, timeout=5)
            except RuntimeError as exc:
                raised.append(str(exc))

        async def run(name, can):
            results[name] = await hub.wait_for(ORG, queue.attempt_for(name, can), timeout=5)

        tg.start_soon(run_revoked)
        await _park(hub, 1)
        tg.start_soon(run, "able", {"cpu"})
        await _park(hub, 2)
        queue.jobs.append(("job-1", "cpu"))
        hub.on_hint(ORG, 1, 1)  # the oldest waiter, the revoked one, gets the wake first
        with anyio.fail_after(2):  # well inside the 60 s safety poll: the wake itself reached "able"
            await eventually(lambda: _async(results.get("able") == "job-1"))
    assert raised == ["credential revoked"]


async def test_a_waiter_kept_from_looking_looks_again_of_its_own_accord():
    """A claim stopped by a committing change (the claim guard) gets no notification when that
    change commits: the waiter tries again shortly by itself, and passes its wake on meanwhile."""
    from umbra.api.longpoll import LOOK_AGAIN_SECONDS, LOOK_AGAIN_SOON

    hub = WaiterHub(poll_seconds=60)
    queue = Queue()
    guarded = {"held": True}
    base = queue.attempt_for("a", {"cpu"})

    async def attempt():
        if guarded["held"]:
            queue.attempts["a"] = queue.attempts.get("a", 0) + 1
            return LOOK_AGAIN_SOON
        return await base()

    results: dict[str, object] = {}
    async with anyio.create_task_group() as tg:

        async def run(name, attempt):
            results[name] = await hub.wait_for(ORG, attempt, timeout=5)

        tg.start_soon(run, "a", attempt)
        await eventually(lambda: _async(queue.attempts.get("a", 0) >= 3))  # looking again, with no wake at all
        tg.start_soon(run, "b", queue.attempt_for("b", {"gpu"}))
        await eventually(lambda: _async(queue.attempts.get("b") == 1))
        queue.jobs.append(("job-1", "cpu"))
        hub.on_hint(ORG, 1, 1)  # the wake goes to a (oldest), which cannot look yet: b gets it
        await eventually(lambda: _async(queue.attempts.get("b") == 2))
        guarded["held"] = False  # the change committed; nothing announces it
        with anyio.fail_after(LOOK_AGAIN_SECONDS * 50):
            await eventually(lambda: _async(results.get("a") == "job-1"))
        tg.cancel_scope.cancel()


async def test_a_waiter_kept_from_looking_still_answers_at_its_deadline():
    from umbra.api.longpoll import LOOK_AGAIN_SOON

    hub = WaiterHub(poll_seconds=60)
    calls = 0

    async def attempt():
        nonlocal calls
        calls += 1
        return LOOK_AGAIN_SOON

    with anyio.fail_after(3):
        assert await hub.wait_for(ORG, attempt, timeout=0.3) is None
    assert calls > 2 and hub.waiting(ORG) == 0


async def test_a_waiter_stopped_again_and_again_looks_less_and_less_often():
    """A long change holds the organization's guard: its waiters back off (doubling, up to the safety
    poll's interval) instead of each looking every 20 ms."""
    from umbra.api.longpoll import LOOK_AGAIN_SOON

    hub = WaiterHub(poll_seconds=0.4)
    calls: list[float] = []

    async def attempt():
        calls.append(anyio.current_time())
        return LOOK_AGAIN_SOON

    assert await hub.wait_for(ORG, attempt, timeout=2.0) is None
    gaps = [b - a for a, b in zip(calls, calls[1:])]
    assert 6 <= len(calls) <= 14, len(calls)  # 20, 40, 80, 160, 320 ms, then 400 ms: not 100 looks
    assert gaps[-1] > 4 * gaps[0] and max(gaps) <= 0.4 * 1.25 + 0.1


async def test_a_waiter_that_leaves_a_job_to_another_passes_the_wake_on_and_looks_again_when_told():
    """Model affinity across nodes: the oldest waiter is woken for a job it leaves to a node that holds its
    model (``LookAgainIn``). The wake goes on to the next waiter, which takes it, and the first looks again
    by itself after the seconds it was given, with no wake at all, and takes what is then its to take."""
    from umbra.api.longpoll import LOOK_AGAIN_MARGIN_SECONDS, LookAgainIn

    hub = WaiterHub(poll_seconds=60)
    calls: dict[str, list[float]] = {"a": [], "b": []}

    async def cold():
        calls["a"].append(anyio.current_time())
        return [None, LookAgainIn(0.3)][len(calls["a"]) - 1] if len(calls["a"]) <= 2 else "job-2"

    async def holder():
        calls["b"].append(anyio.current_time())
        return "job-1" if len(calls["b"]) == 2 else None

    results: dict[str, object] = {}
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:

            async def run(name, attempt):
                results[name] = await hub.wait_for(ORG, attempt, timeout=10)

            tg.start_soon(run, "a", cold)
            await eventually(lambda: _async(len(calls["a"]) == 1))
            tg.start_soon(run, "b", holder)
            await eventually(lambda: _async(len(calls["b"]) == 1))
            hub.on_hint(ORG, 1, 1)  # to a, the oldest: it leaves the job, and b takes it
    assert results == {"a": "job-2", "b": "job-1"}
    assert len(calls["a"]) == 3 and calls["a"][2] - calls["a"][1] >= 0.3 + LOOK_AGAIN_MARGIN_SECONDS - 0.01
    assert calls["b"][1] < calls["a"][2]  # the wake went on at once, not after a's pause
