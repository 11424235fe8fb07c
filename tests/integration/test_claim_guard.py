"""The claim guard: no claim commits for a node after its drain, retirement or revocation has answered.

A claim reads its node when its transaction starts and commits later; the
change in between must either wait for that claim or be seen by it (see
:func:`umbra.compute.nodes.guard_against_claims`).
"""

from __future__ import annotations

import anyio
import psycopg
import pytest

from umbra.compute import batch_commands, claims
from umbra.compute.batch_commands import Command
from umbra.compute.credentials import revoke_node
from umbra.compute.models import upsert_model
from umbra.compute.nodes import drain_node, guard_against_claims, guard_key, retire_node
from umbra.domain.models import RegisteredModel
from umbra.events import store

from tests.helpers import until_done_or_waiting

from .queue_support import CPU64, GPU24, add_node, beat, register_model, submit

pytestmark = pytest.mark.anyio

CHANGES = {
    "heartbeat that loses the GPU": lambda conn, org_id, node: beat(conn, org_id, node, [CPU64]),
    "drain": lambda conn, org_id, node: drain_node(conn, org_id, node, actor="admin"),
    "retire": lambda conn, org_id, node: retire_node(conn, org_id, node, actor="admin"),
    "revoke": lambda conn, org_id, node: revoke_node(conn, org_id, node, actor="admin"),
}


@pytest.mark.parametrize("change", sorted(CHANGES))
async def test_a_change_answers_only_after_the_claim_that_read_its_node_online_commits(db_url, conn, org, change):
    org_id, _ = org
    node = await add_node(conn, org_id, "a", [CPU64, GPU24])
    await add_node(conn, org_id, "b", [GPU24])  # so the change leaves the job runnable: it never touches the job's row
    job = (await submit(conn, org_id, requires={"vram_min_mb": 8000})).id
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as claimer, \
            await psycopg.AsyncConnection.connect(db_url, autocommit=True) as admin:  # fmt: skip
        staged, _ = await batch_commands.stage(claimer, [Command("claim", org_id, node)])
        assert [s.state.id for s in staged] == [job]  # read the node online and locked the job: not committed yet
        changed = anyio.Event()

        async def run_change() -> None:
            await CHANGES[change](admin, org_id, node)
            changed.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(run_change)
            await until_done_or_waiting(conn, changed.is_set)
            assert not changed.is_set(), f"the {change} answered while a claim that saw the node online was in flight"
            await batch_commands.write(claimer, staged)
        claimed = [e for e in await store.read_stream(conn, store.job_stream(job)) if e.type == "job.claimed"]
        node_events = await store.read_stream(conn, store.node_stream(node))
        assert len(claimed) == 1 and claimed[0].position < node_events[-1].position


async def test_a_claim_for_a_node_being_changed_takes_nothing_and_waits_for_nothing(db_url, conn, org):
    org_id, _ = org
    a = await add_node(conn, org_id, "a", [CPU64])
    b = await add_node(conn, org_id, "b", [CPU64])
    while guard_key(org_id, b) == guard_key(org_id, a):  # nodes share guards (1 in NODE_GUARDS): b must not share a's
        b = await add_node(conn, org_id, f"b{b}", [CPU64])
    first, second = (await submit(conn, org_id)).id, (await submit(conn, org_id)).id
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as admin, \
            await psycopg.AsyncConnection.connect(db_url, autocommit=True) as claimer:  # fmt: skip
        async with admin.transaction():
            await guard_against_claims(admin, org_id, a)  # a drain of `a` that has not committed yet
            with anyio.fail_after(5):
                staged, _ = await batch_commands.stage(claimer, [Command("claim", org_id, a), Command("claim", org_id, b)])
                assert [(s.command.node_id, s.state.id) for s in staged] == [(b, first)]
                await batch_commands.write(claimer, staged)
                assert await claims.claim(claimer, node_id=a, organization_id=org_id, lease_seconds=60) is None
        got = await claims.claim(claimer, node_id=a, organization_id=org_id, lease_seconds=60)
        assert got is not None and got.job_id == second


async def test_a_registry_update_answers_only_after_the_claim_that_read_the_old_entry_commits(db_url, conn, org):
    org_id, _ = org
    await register_model(conn, org_id, "m", vram_min_mb=16000)
    node = await add_node(conn, org_id, "a", [GPU24])
    job = (await submit(conn, org_id, requires={"models": ["m"]})).id
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as claimer, \
            await psycopg.AsyncConnection.connect(db_url, autocommit=True) as admin:  # fmt: skip
        staged, _ = await batch_commands.stage(claimer, [Command("claim", org_id, node)])
        assert [s.state.id for s in staged] == [job]  # placed by the 16,000 MB floor: not committed yet
        changed = anyio.Event()

        async def raise_floor() -> None:
            await upsert_model(admin, org_id, RegisteredModel(slug="m", vram_min_mb=40000))
            changed.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(raise_floor)
            await until_done_or_waiting(conn, changed.is_set)
            assert not changed.is_set(), "the registry update answered while a claim placed by the old floor was in flight"
            await batch_commands.write(claimer, staged)
        with anyio.fail_after(10):
            await changed.wait()
        other = (await submit(conn, org_id, requires={"models": ["m"]}))
        assert other.status == "blocked"  # the new floor holds from the moment the update answered


async def test_a_claim_while_the_registry_is_being_changed_takes_nothing(db_url, conn, org):
    org_id, _ = org
    node = await add_node(conn, org_id, "a", [CPU64])
    job = (await submit(conn, org_id)).id
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as admin, \
            await psycopg.AsyncConnection.connect(db_url, autocommit=True) as claimer:  # fmt: skip
        async with admin.transaction():
            await guard_against_claims(admin, org_id)  # a registry update that has not committed yet
            with anyio.fail_after(5):
                staged, _ = await batch_commands.stage(claimer, [Command("claim", org_id, node)])
                assert staged == []
                await batch_commands.write(claimer, staged)
                assert await claims.claim(claimer, node_id=node, organization_id=org_id, lease_seconds=60) is None
        got = await claims.claim(claimer, node_id=node, organization_id=org_id, lease_seconds=60)
        assert got is not None and got.job_id == job


def test_nodes_share_a_bounded_number_of_guards_per_organization():
    """However many nodes a batch serves, it holds at most NODE_GUARDS guards per organization, and its own."""
    from uuid import uuid4

    from umbra.compute.nodes import NODE_GUARDS

    org, other = uuid4(), uuid4()
    keys = {guard_key(org, uuid4()) for _ in range(5000)}
    assert len(keys) == NODE_GUARDS and guard_key(org) not in keys
    assert not keys & {guard_key(other, uuid4()) for _ in range(5000)}  # another organization's are its own
    node = uuid4()
    assert guard_key(org, node) == guard_key(org, node)
