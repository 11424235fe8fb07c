"""Reads of nodes that run on every submission and every sweeper tick: nodes are never deleted, so an organization
whose machines come and go (autoscaled, spot) keeps every node it ever paired, retired. These reads are bounded by
the nodes in service, not by that history: their plans take the partial index of migration 0052."""

from __future__ import annotations

import pytest

from umbra.compute.blocked import BlockingJudge, read_nodes
from umbra.compute.nodes import drain_node, mark_stale_page, retire_node
from tests.helpers import generic_plans, index_names

from .queue_support import CPU64, add_node

pytestmark = pytest.mark.anyio


async def _fleet_with_history(conn, org_id):
    """Two nodes in service, one draining, two retired; (the online ones, the others)."""
    online = [await add_node(conn, org_id, f"up-{i}", [CPU64]) for i in range(2)]
    draining = await add_node(conn, org_id, "draining", [CPU64])
    await drain_node(conn, org_id, draining, actor="test")
    retired = [await add_node(conn, org_id, f"old-{i}", [CPU64]) for i in range(2)]
    for node in retired:
        await retire_node(conn, org_id, node, actor="test")
    return online, [draining, *retired]


async def test_a_blocking_judgement_reads_the_nodes_in_service_not_every_node_ever_paired(conn, org):
    """Every submission judges the fleet (``BlockingJudge.load``): the nodes it counts (not draining, not retired)
    came from the organization's every node, filtered, in a generic plan: ``nodes_name_per_org`` read whole. It
    reads ``nodes_accepting``, and still judges exactly the nodes in service, in name order."""
    org_id, _ = org
    online, _others = await _fleet_with_history(conn, org_id)
    async with conn.transaction():
        judged = await read_nodes(conn, org_id, accepting_only=True)
    assert [node.name for node in judged] == ["up-0", "up-1"]
    assert {node.id for node in judged} == set(online)

    async def load() -> None:
        async with conn.transaction():
            await BlockingJudge.load(conn, org_id)

    for plan in await generic_plans(conn, load, table="nodes"):
        assert "nodes_accepting" in index_names(plan) and "nodes_name_per_org" not in index_names(plan), plan


async def test_the_sweeper_s_look_for_silent_nodes_reads_the_online_ones_only(conn, org):
    """Every tick looks for online nodes gone silent (``mark_stale_page``): with no index of status it read every
    node ever paired, of every organization. It reads ``nodes_accepting`` (an online node is in service)."""
    org_id, _ = org
    await _fleet_with_history(conn, org_id)

    async def look() -> None:
        assert await mark_stale_page(conn, stale_seconds=3600, limit=500) == ([], None)

    for plan in await generic_plans(conn, look, table="nodes"):
        assert "nodes_accepting" in index_names(plan) and "nodes_pkey" not in index_names(plan), plan
