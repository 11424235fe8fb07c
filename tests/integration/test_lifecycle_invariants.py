"""Random histories of one organization at the command layer, with the database clock moved:
after every step the lifecycle's invariants hold and the views equal a fold of the log.

Submit (priorities, attempts, shapes, idempotency keys), claim from a CPU node and a GPU node
(checked against priority-then-submission order), renew, complete and fail (now and then with a
stale attempt), decompose, cancel anything, move time on and sweep, change a node's devices.
"""

from __future__ import annotations

import random as _random

import pytest

from umbra.compute import claims as _claims, jobs as _jobs
from umbra.compute.claims import ChildRequest as _ChildRequest
from umbra.errors import UmbraError as _UmbraError
from umbra.events import store as _store
from umbra.events.types import TERMINAL_JOB_STATUSES as _TERMINAL
from umbra.projections import jobs as _queue
from umbra.projections.verify import verify
from umbra.settings import load_settings as _load_settings

from .queue_support import CPU64 as _CPU64, GPU24 as _GPU24, add_node as _add_node, beat as _beat, set_clock as _set_clock, spec as _spec

pytestmark = pytest.mark.anyio

_SETTINGS = _load_settings({})
_SHAPES = [{}, {}, {"accelerators": ["cuda"]}, {"vram_min_mb": 999_999}]


async def _all_rows(conn, org_id):
    return await _queue.live(conn, org_id)


async def _check_invariants(conn, org_id, label):
    rows = await _all_rows(conn, org_id)
    by_parent: dict = {}
    for row in rows.values():
        if row.parent_job_id:
            by_parent.setdefault(row.parent_job_id, []).append(row)
    for row in rows.values():
        stream = await _store.read_stream(conn, _store.job_stream(row.id))
        types = [e.type for e in stream]
        # nothing happens to a job after it ended
        states = []
        state = None
        for e in stream:
            state = _queue.fold(state, e)
            states.append(state.status)
        for i, status in enumerate(states[:-1]):
            assert status not in _TERMINAL, (label, row.id, types)
        assert row.attempt <= row.max_attempts, (label, row.id, types)
        if row.status == "queued":
            assert row.lease_owner is None and row.lease_expires_at is None, (label, types)
        kids = by_parent.get(row.id, [])
        assert len(kids) == row.children_total, (label, types)
        if row.children_total:
            if row.status == "running":
                assert any(k.status not in _TERMINAL for k in kids), (label, "open parent, all children ended", types)
                assert row.lease_owner is None
            elif row.status in ("complete", "partial"):
                assert all(k.status in _TERMINAL for k in kids), (label, types)
                failed = sum(k.status in ("failed", "cancelled", "partial") for k in kids)
                assert row.status == ("partial" if failed else "complete"), (label, types)
        elif row.status == "running":
            assert row.lease_owner is not None and row.lease_expires_at is not None, (label, types)
    differences = await verify(conn, org_id)
    assert differences == [], (label, differences)


async def _random_history(conn, seed: int, steps: int) -> None:
    rng = _random.Random(seed)
    from umbra.compute.accounts import create_organization as _create

    org_id, _ = await _create(conn, f"fuzz{seed}")
    a = await _add_node(conn, org_id, f"a{seed}", [_CPU64])
    b_devices = [_CPU64, _GPU24]
    b = await _add_node(conn, org_id, f"b{seed}", b_devices)
    nodes = {a: [_CPU64], b: b_devices}
    clock = 0.0
    held: dict = {}  # job id -> (node, attempt) as the holder believes
    log = []
    for step in range(steps):
        op = rng.choice(["submit", "submit", "claim", "claim", "renew", "complete", "complete", "fail", "children",
                         "cancel", "time", "heartbeat"])  # fmt: skip
        rows = await _all_rows(conn, org_id)
        ids = list(rows)
        try:
            if op == "submit":
                fields = {"priority": rng.randint(-2, 2), "max_attempts": rng.randint(1, 3),
                          "requires": rng.choice(_SHAPES)}  # fmt: skip
                if rng.random() < 0.3:
                    fields["idempotency_key"] = f"k{rng.randint(0, 3)}"
                created, _ = await _jobs.submit(conn, org_id, [_spec("k", **fields)], actor="t", batch=False)
                log.append((op, fields, created[0].id))
            elif op == "claim":
                node = rng.choice(list(nodes))
                before = await _all_rows(conn, org_id)
                got = await _claims.claim(conn, node_id=node, organization_id=org_id, lease_seconds=10)
                log.append((op, node == a, got and got.job_id))
                if got is not None:
                    held[got.job_id] = (node, got.attempt)
                    now = (await (await conn.execute("SELECT umbra_now()")).fetchone())[0]
                    due = [r for r in before.values() if r.status == "queued" and (r.not_before is None or r.not_before <= now)]
                    if node == a:
                        due = [r for r in due if not r.requires.accelerators and not r.requires.vram_min_mb]
                    best = min(due, key=lambda r: (r.priority, r.seq))
                    assert best.id == got.job_id, (seed, step, "claim order", log[-5:])
            elif op in ("renew", "complete", "fail", "children") and held:
                job_id = rng.choice(list(held))
                node, attempt = held[job_id]
                if rng.random() < 0.15:
                    attempt = max(1, attempt - 1)
                common = dict(organization_id=org_id, node_id=node, job_id=job_id, attempt=attempt)
                log.append((op, job_id, attempt))
                if op == "renew":
                    await _claims.renew(conn, lease_seconds=10, **common)
                elif op == "complete":
                    await _claims.complete(conn, result={"s": step}, **common)
                    held.pop(job_id, None)
                elif op == "fail":
                    await _claims.fail(conn, error="e", retry=rng.random() < 0.7, **common)
                    held.pop(job_id, None)
                else:
                    kids = [_ChildRequest(kind="c", requires=_spec("c", requires=rng.choice(_SHAPES)).requires)
                            for _ in range(rng.randint(1, 3))]  # fmt: skip
                    await _claims.add_children(conn, children=kids, **common)
                    held.pop(job_id, None)
            elif op == "cancel" and ids:
                job_id = rng.choice(ids)
                log.append((op, job_id, rows[job_id].status))
                await _jobs.cancel(conn, org_id, job_id, actor="t")
            elif op == "time":
                clock += rng.choice([1, 6, 11, 30])
                await _set_clock(conn, clock)
                log.append((op, clock))
                await _sweeper_once(conn)
            elif op == "heartbeat":
                nodes[b] = [_CPU64] if len(nodes[b]) == 2 else b_devices
                log.append((op, len(nodes[b])))
                await _beat(conn, org_id, b, nodes[b])
        except _UmbraError as refusal:
            log.append(("refused", refusal.code))
        await _check_invariants(conn, org_id, (seed, step, log[-3:]))


async def _sweeper_once(conn):
    from umbra.compute.sweeper import sweep_once

    await sweep_once(conn, _SETTINGS, reexamine=True)


@pytest.mark.parametrize("seed", range(6))
async def test_random_histories_keep_the_lifecycle_invariants_and_verify(conn, seed):
    await _random_history(conn, seed, 70)


# -- claim order over HTTP (group commit), few and many requirement shapes -----------------
