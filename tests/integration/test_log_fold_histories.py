"""Random histories with retries, reprioritizations, releases, dependencies and delayed jobs: every few
steps the views equal a rebuild from the log, every stream's versions are gap-free, and ``as_of`` reads
equal a fold of the log up to that position."""

from __future__ import annotations

import random
from datetime import timedelta

import pytest

from umbra.compute import claims, credentials, jobs, nodes as fleet, priorities, retries
from umbra.compute.accounts import create_organization
from umbra.compute.claims import ChildRequest
from umbra.compute.sweeper import sweep_once
from umbra.errors import UmbraError
from umbra.events import store
from umbra.projections import jobs as queue
from umbra.projections.verify import verify
from umbra.settings import load_settings

from .queue_support import CPU64, GPU24, add_node, beat, set_clock, spec

pytestmark = pytest.mark.anyio

SETTINGS = load_settings({})


#: Every how many steps the views are checked (and after the last): each check folds the whole log.
CHECK_EVERY = 10
_STATUSES = "SELECT id, status FROM jobs WHERE organization_id = %s ORDER BY seq"


async def _statuses(conn, org_id) -> dict:
    return dict(await (await conn.execute(_STATUSES, (org_id,))).fetchall())


async def _check(conn, org_id, rng, label):
    differences = await verify(conn, org_id)
    assert differences == [], (label, differences)
    for job_id in await _statuses(conn, org_id):
        stream = await store.read_stream(conn, store.job_stream(job_id))
        assert [e.version for e in stream] == list(range(1, len(stream) + 1)), label
        positions = [e.position for e in stream]
        assert positions == sorted(positions), label
        at = rng.choice(positions)
        folded = None
        for e in stream:
            if e.position <= at:
                folded = queue.fold(folded, e)
        got = await jobs.get_job(conn, org_id, job_id, as_of=at)
        assert got == folded, (label, job_id)
    log = await store.read_log(conn, organization_id=org_id, limit=100000)
    assert [e.position for e in log] == sorted({e.position for e in log})


async def _history(conn, seed: int, steps: int) -> None:
    rng = random.Random(seed)
    org_id, _ = await create_organization(conn, f"logfold{seed}")
    a = await add_node(conn, org_id, f"a{seed}", [CPU64])
    b = await add_node(conn, org_id, f"b{seed}", [CPU64, GPU24])
    both = [a, b]
    clock = 0.0
    held: dict = {}
    log = []
    for step in range(steps):
        op = rng.choice(["submit", "submit", "claim", "claim", "renew", "complete", "fail", "fail", "children",
                         "cancel", "time", "retry", "retry", "priority", "release", "give_back", "node", "beat"])  # fmt: skip
        statuses = await _statuses(conn, org_id)
        ids = list(statuses)
        try:
            if op == "submit":
                fields = {"priority": rng.randint(-2, 2), "max_attempts": rng.randint(1, 2),
                          "requires": rng.choice([{}, {}, {"accelerators": ["cuda"]}, {"vram_min_mb": 999_999},
                                                  {"max_runtime_s": 5}])}
                if ids and rng.random() < 0.4:
                    fields["depends_on"] = [str(x) for x in rng.sample(ids, rng.randint(1, min(2, len(ids))))]
                if rng.random() < 0.3:
                    now = (await (await conn.execute("SELECT umbra_now()")).fetchone())[0]
                    fields["not_before"] = (now + timedelta(seconds=rng.choice([1, 5, 20]))).isoformat()
                created, _ = await jobs.submit(conn, org_id, [spec("k", **fields)], actor="t", batch=False)
                log.append((op, fields, created[0].id))
            elif op == "claim":
                node = rng.choice(both)
                got = await claims.claim(conn, node_id=node, organization_id=org_id, lease_seconds=10)
                log.append((op, got and got.job_id))
                if got is not None:
                    held[got.job_id] = (node, got.attempt)
            elif op == "node":
                node = rng.choice(both)
                which = rng.choice(["drain", "cordon", "uncordon", "revoke", "retire"])
                log.append((op, which, node == a))
                if which == "drain":
                    await fleet.drain_node(conn, org_id, node, actor="t")
                elif which == "cordon":
                    await fleet.cordon_device(conn, org_id, node, "cpu", actor="t", reason="r")
                elif which == "uncordon":
                    await fleet.uncordon_device(conn, org_id, node, "cpu", actor="t")
                elif which == "revoke" and rng.random() < 0.3:
                    await credentials.revoke_node(conn, org_id, node, actor="t")
                elif which == "retire" and rng.random() < 0.3:
                    await fleet.retire_node(conn, org_id, node, actor="t")
            elif op == "beat":
                node = rng.choice(both)
                log.append((op, node == a))
                await beat(conn, org_id, node, [CPU64] if node == a or rng.random() < 0.5 else [CPU64, GPU24])
            elif op in ("renew", "complete", "fail", "children", "release", "give_back") and held:
                job_id = rng.choice(list(held))
                node, attempt = held[job_id]
                common = dict(organization_id=org_id, node_id=node, job_id=job_id, attempt=attempt)
                log.append((op, job_id, attempt))
                if op == "renew":
                    await claims.renew(conn, lease_seconds=10, **common)
                elif op == "complete":
                    held.pop(job_id, None)
                    await claims.complete(conn, result={"s": step}, **common)
                elif op == "fail":
                    held.pop(job_id, None)
                    await claims.fail(conn, error="e", retry=rng.random() < 0.5, **common)
                elif op == "give_back":
                    held.pop(job_id, None)
                    await claims.give_back(conn, **common)
                elif op == "release":
                    held.pop(job_id, None)
                    await claims.release(conn, job_id, node, attempt)
                else:
                    held.pop(job_id, None)
                    kids = [ChildRequest(kind="c", requires=spec("c").requires) for _ in range(rng.randint(1, 2))]
                    await claims.add_children(conn, children=kids, **common)
            elif op == "cancel" and ids:
                job_id = rng.choice(ids)
                log.append((op, job_id, statuses[job_id]))
                await jobs.cancel(conn, org_id, job_id, actor="t")
            elif op == "retry" and ids:
                failed = [i for i in ids if statuses[i] == "failed"] or ids
                job_id = rng.choice(failed)
                log.append((op, job_id, statuses[job_id]))
                await retries.retry(conn, org_id, job_id, actor="t", max_attempts=rng.choice([None, 1, 2]))
            elif op == "priority" and ids:
                job_id = rng.choice(ids)
                log.append((op, job_id, statuses[job_id]))
                await priorities.reprioritize(conn, org_id, job_id, rng.randint(-3, 3), actor="t")
            elif op == "time":
                clock += rng.choice([1, 6, 11, 30])
                await set_clock(conn, clock)
                log.append((op, clock))
                await sweep_once(conn, SETTINGS, reexamine=True)
        except UmbraError as refusal:
            log.append(("refused", refusal.code))
        if step % CHECK_EVERY == CHECK_EVERY - 1 or step == steps - 1:
            await _check(conn, org_id, rng, (seed, step, log[-4:]))


@pytest.mark.parametrize("seed", range(8))
async def test_random_histories_fold_to_the_live_rows(conn, seed):
    await _history(conn, seed, 100)
