"""How a group-commit batch of claims hands out rows (``_claim_for_org`` in compute/batch_commands.py).

Rows are promised to the claimers in arrival order before any is locked, and only promised rows are
locked: each claimer gets what it would have got alone, no node is over-committed, and no row is left
locked untaken for the other batch in flight to skip.
"""

from __future__ import annotations


import anyio
import msgspec
import psycopg
import pytest

from umbra.compute import batch_commands, claims, jobs
from umbra.compute.batch_commands import Command

from .queue_support import CPU64, GPU24, add_node, spec, submit
from .test_claim_reservation import in_two_batches

pytestmark = pytest.mark.anyio

ECHO = frozenset({"echo"})


async def claim_in_one_batch(conn, commands):
    staged, _ = await batch_commands.stage(conn, commands)
    await batch_commands.write(conn, staged)
    return staged


def taken_by(staged, command) -> list:
    return [item.state.id for item in staged if item.command is command]


async def queued_free_to_others(db_url, org_id) -> list:
    """The queued rows another transaction can lock now (in claim order)."""
    async with await psycopg.AsyncConnection.connect(db_url) as probe:
        rows = await (await probe.execute(
            "SELECT id FROM jobs WHERE organization_id = %s AND status = 'queued' ORDER BY priority, seq "
            "FOR UPDATE SKIP LOCKED", (org_id,))).fetchall()  # fmt: skip
        await probe.rollback()
    return [r[0] for r in rows]


async def queued(conn, org_id) -> list:
    rows = await (await conn.execute("SELECT id FROM jobs WHERE organization_id = %s AND status = 'queued'", (org_id,))).fetchall()
    return [r[0] for r in rows]


async def no_job_twice(conn, org_id) -> None:
    cursor = await conn.execute(
        "SELECT stream, count(*) FROM events WHERE type = 'job.claimed' GROUP BY stream HAVING count(*) > 1")
    assert await cursor.fetchall() == [], "a job was claimed twice"


# -- defects -----------------------------------------------------------------------------------


async def test_an_earlier_claimer_whose_promised_row_is_held_elsewhere_still_gets_the_next_row_it_can_run(conn, org, db_url):
    """Claimers are served in arrival order, each the first free row it can run (what the same claims run one
    after another would take). A claimer whose first promised row the other batch in flight holds must still
    get the next free row it can run, not lose it to a later claimer that could have taken another job."""
    org_id, _ = org
    other_node = await add_node(conn, org_id, "other", [CPU64])
    echo_only = await add_node(conn, org_id, "echo-only", [CPU64])
    anything = await add_node(conn, org_id, "anything", [CPU64])
    r1 = await submit(conn, org_id, kind="echo")
    r2 = await submit(conn, org_id, kind="echo")
    r3 = await submit(conn, org_id, kind="render")
    first_batch = Command("claim", org_id, other_node, kinds=ECHO)  # takes r1, holds it while the second stages
    early = Command("claim", org_id, echo_only, kinds=ECHO)
    late = Command("claim", org_id, anything)
    staged_a, staged_b = await in_two_batches(conn, db_url, [first_batch], [early, late])
    assert taken_by(staged_a, first_batch) == [r1.id]
    assert taken_by(staged_b, early) == [r2.id], (
        f"the first claimer (echo only) got {taken_by(staged_b, early)} while r2 went to the later claimer "
        f"{taken_by(staged_b, late)}, which could have run r3; r3 stays queued: {await queued(conn, org_id) == [r3.id]}"
    )
    assert taken_by(staged_b, late) == [r3.id]


# -- guarantees that hold (regression checks) --------------------------------------------------


async def test_two_claimers_of_one_card_with_a_held_row_never_overcommit_and_lock_only_what_they_take(conn, org, db_url):
    """Two agents on one 24,000 MB card in one batch, the first 10,000 MB row held by another transaction: they
    take no more than the card has room for together, and every queued row they do not take stays free to others."""
    org_id, _ = org
    node = await add_node(conn, org_id, "card", [GPU24])
    await jobs.submit(conn, org_id, [spec("infer", requires={"vram_min_mb": 10000}) for _ in range(3)]
                      + [spec("echo") for _ in range(2)] + [spec("infer", requires={"vram_min_mb": 10000})],
                      actor="test", batch=True)  # fmt: skip
    order = await queued_free_to_others(db_url, org_id)
    async with await psycopg.AsyncConnection.connect(db_url) as holder:
        await holder.execute("SELECT 1 FROM jobs WHERE id = %s FOR UPDATE", (order[0],))
        async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as mine:
            a, b = Command("claim", org_id, node, count=2), Command("claim", org_id, node, count=3)
            staged, _ = await batch_commands.stage(mine, [a, b])
            taken = [item.state.id for item in staged]
            free = await queued_free_to_others(db_url, org_id)
            await mine.execute("ROLLBACK")
        await holder.rollback()
    vram = sum(item.state.requires.vram_min_mb or 0 for item in staged)
    assert vram <= 24000, f"{vram} MB placed on a 24,000 MB card"
    assert vram == 20000 and len(taken) == 4  # two 10,000 MB rows and both echo rows
    assert taken_by(staged, a) == [order[1], order[2]]  # the two free 10,000 MB rows in claim order
    assert taken_by(staged, b) == [order[3], order[4]]  # the echo rows: no room beside a's for a third 10,000 MB
    assert set(free) == set(order[1:]) - set(taken), "a queued row was locked and not handed out"


async def test_a_claim_of_n_gets_n_when_n_are_free_past_rows_held_elsewhere(conn, org, db_url):
    """A claim of ``max=N`` gets N jobs when N are free, its first promised rows held by another transaction,
    and they are the first free ones in claim order; no row is locked that it does not take."""
    org_id, _ = org
    node = await add_node(conn, org_id, "box", [CPU64])
    made = [(await submit(conn, org_id, payload={"i": i}, requires=[{}, {"ram_min_mb": 10}][i % 2])).id for i in range(12)]
    async with await psycopg.AsyncConnection.connect(db_url) as holder:
        await holder.execute("SELECT 1 FROM jobs WHERE id = ANY(%s) FOR UPDATE", (made[:5],))
        async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as mine:
            command = Command("claim", org_id, node, count=4)
            staged, _ = await batch_commands.stage(mine, [command])
            free = await queued_free_to_others(db_url, org_id)
            await mine.execute("ROLLBACK")
        await holder.rollback()
    assert taken_by(staged, command) == made[5:9]
    assert free == made[9:]


async def test_many_claimers_past_many_held_rows_terminate_and_take_the_first_free_rows(conn, org, db_url):
    """With most of a page held elsewhere, the promise loop ends, each claimer gets one job, no job twice, and
    together they take the first free rows in claim order (priority then submission)."""
    org_id, _ = org
    nodes = [await add_node(conn, org_id, f"n{i}", [CPU64]) for i in range(4)]
    rows, _ = await jobs.submit(conn, org_id, [spec("echo", payload={"i": i}, requires=[{}, {"ram_min_mb": 10}][i % 2],
                                                    priority=i % 3) for i in range(100)], actor="test", batch=True)  # fmt: skip
    order = await queued_free_to_others(db_url, org_id)
    held = order[::5] + order[1::5] + order[2::5] + order[3::5]  # 80 of 100, the free ones spread out
    commands = [Command("claim", org_id, nodes[i % 4]) for i in range(12)]
    async with await psycopg.AsyncConnection.connect(db_url) as holder:
        await holder.execute("SELECT 1 FROM jobs WHERE id = ANY(%s) FOR UPDATE", (held,))
        with anyio.fail_after(15):
            staged = await claim_in_one_batch(conn, commands)
        await holder.rollback()
    free_order = [j for j in order if j not in set(held)]
    assert [len(taken_by(staged, c)) for c in commands] == [1] * 12
    assert sorted(item.state.id for item in staged) == sorted(free_order[:12]), "claimers did not take the first free rows"
    await no_job_twice(conn, org_id)


async def test_a_claimer_whose_rows_are_held_elsewhere_is_not_told_nothing_is_left_while_others_remain(conn, org, db_url):
    """``nothing_left`` ends a long-poll's wake chain: a claimer (echo only) whose every runnable row is held
    elsewhere gets nothing, and is not told nothing is left while rows it cannot run stay queued for others."""
    org_id, _ = org
    node = await add_node(conn, org_id, "echo-only", [CPU64])
    held = (await submit(conn, org_id, kind="echo")).id
    await submit(conn, org_id, kind="render")
    async with await psycopg.AsyncConnection.connect(db_url) as holder:
        await holder.execute("SELECT 1 FROM jobs WHERE id = %s FOR UPDATE", (held,))
        command = Command("claim", org_id, node, kinds=ECHO)
        staged = await claim_in_one_batch(conn, [command])
        await holder.rollback()
    assert staged == []
    assert not command.nothing_left


async def test_a_completion_chained_claim_and_another_agent_of_the_node_share_the_memory_it_frees(conn, org, db_url):
    """``complete?claim_next`` beside another agent's claim for the same node in one batch: the completion's
    memory is free for the two together, never for each (no over-commit), and nothing is left locked untaken."""
    org_id, _ = org
    node = await add_node(conn, org_id, "card", [GPU24])
    first = await submit(conn, org_id, kind="infer", requires={"vram_min_mb": 16000})
    running = await claims.claim(conn, node_id=node, organization_id=org_id, lease_seconds=60)
    assert running.job_id == first.id
    await jobs.submit(conn, org_id, [spec("infer", requires={"vram_min_mb": 16000}) for _ in range(2)]
                      + [spec("infer", requires={"vram_min_mb": 8000}) for _ in range(2)], actor="test", batch=True)  # fmt: skip
    chained = Command("claim", org_id, node, count=2)
    other = Command("claim", org_id, node, count=2)
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as mine:
        staged, _ = await batch_commands.stage(mine, [
            Command("complete", org_id, node, first.id, running.attempt, result={}, then=chained), other])
        free = await queued_free_to_others(db_url, org_id)
        await batch_commands.write(mine, staged)
    claimed = [item for item in staged if item.command.kind == "claim"]
    vram = sum(item.state.requires.vram_min_mb for item in claimed)
    assert vram <= 24000, f"{vram} MB placed on the 24,000 MB card once its 16,000 MB job ended"
    assert vram == 24000 and len(claimed) == 2  # a 16,000 MB job for the chained claim, an 8,000 MB one beside it
    assert set(free) == set(await queued(conn, org_id)), "a queued row was locked and not handed out"


async def test_a_batch_of_sixty_claimers_over_pages_stages_every_claim_it_can(conn, org):
    """Sixty claimers (several per node, memory taken) over 150 queued rows of two shapes: the batch stages
    every claim, and no node takes more than its card holds."""
    org_id, _ = org
    big = msgspec.structs.replace(GPU24, vram_total_mb=200000, vram_free_mb=200000)
    nodes = [await add_node(conn, org_id, f"g{i}", [big]) for i in range(6)]
    await jobs.submit(conn, org_id, [spec("infer", requires={"vram_min_mb": [1000, 30000][i % 2]}) for i in range(150)],
                      actor="test", batch=True)  # fmt: skip
    commands = [Command("claim", org_id, nodes[i % 6]) for i in range(60)]
    staged, _ = await batch_commands.stage(conn, commands)
    await conn.execute("ROLLBACK")
    per_node: dict = {}
    for item in staged:
        per_node[item.command.node_id] = per_node.get(item.command.node_id, 0) + item.state.requires.vram_min_mb
    assert max(per_node.values()) <= 200000
    assert len(staged) == 60


@pytest.mark.parametrize("claimers", [60, 150])
async def test_claimers_of_one_card_the_first_few_fill_take_only_what_is_left(conn, org, claimers):
    """Sixty (and 150) claimers of one node whose card the first few fill, 100 rows that no longer fit ahead of
    the rest: together they take what is left (three more of those rows and the ten echo jobs behind them), and
    the card is never over-committed."""
    org_id, _ = org
    node = await add_node(conn, org_id, "card", [GPU24])
    await jobs.submit(conn, org_id, [spec("infer", requires={"vram_min_mb": 7000}) for _ in range(100)]
                      + [spec("echo") for _ in range(10)] + [spec("infer", requires={"vram_min_mb": 7000}) for _ in range(100)], actor="test", batch=True)  # fmt: skip
    commands = [Command("claim", org_id, node) for _ in range(claimers)]
    staged, _ = await batch_commands.stage(conn, commands)
    await conn.execute("ROLLBACK")
    vram = sum(item.state.requires.vram_min_mb or 0 for item in staged)
    assert vram <= 24000
    assert len(staged) == 13  # three 7,000 MB jobs and the ten echo jobs (behind 100 that no longer fit)
