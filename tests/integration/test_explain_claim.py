"""Explain agrees with the real claim, on random fleets stored in PostgreSQL.

Each example builds an organization through the real paths (pairing,
heartbeats, drain, retire, the model registry, submit), asks explain, then lets
every node try the real claim, each in a transaction rolled back afterwards so
they all face the same queue. A node explain lists an eligible device for must
claim the job, on the device explain ranks first for it; a node explain finds
nothing on must claim nothing.
"""

from __future__ import annotations

from uuid import UUID, uuid4

import anyio
import msgspec
import psycopg
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from umbra.compute import claims
from umbra.compute.accounts import create_organization
from umbra.compute.explain import explain
from umbra.compute.nodes import drain_node, retire_node
from umbra.domain.eligibility import NodeView
from umbra.domain.models import RegisteredModel
from umbra.events.types import Requirements
from tests.unit.test_explain_agrees_with_claim import SLUGS, fleets, registries, requirements

from .queue_support import add_node, register_model, submit

#: Modest jobs, so that a good share of examples has a node that can claim (random ones mostly cannot).
modest_requirements = st.builds(
    Requirements,
    vram_min_mb=st.sampled_from([0, 512, 2048]),
    ram_min_mb=st.sampled_from([0, 512]),
    models=st.lists(st.sampled_from(SLUGS), max_size=1).map(tuple),
    trust_domains=st.sampled_from([(), (), ("local",)]),
    accelerators=st.sampled_from([(), (), ("cuda",)]),
)

_MAKE_STALE = "UPDATE node_liveness SET last_seen_at = last_seen_at - interval '10 minutes' WHERE node_id = %s"


async def _build(conn, org_id: UUID, fleet: list[NodeView]) -> dict[UUID, UUID]:
    """Store ``fleet``; returns generated node id → stored node id."""
    stored: dict[UUID, UUID] = {}
    for node in fleet:
        name = f"{node.name}-{uuid4().hex[:8]}"
        heard = node.status != "provisioning"
        node_id = await add_node(conn, org_id, name, node.devices, trust_domain=node.trust_domain, online=heard)
        if node.status == "draining":
            await drain_node(conn, org_id, node_id)
        elif node.status == "retired":
            await retire_node(conn, org_id, node_id)
        elif node.status == "offline":
            await conn.execute(_MAKE_STALE, (node_id,))
        stored[node.id] = node_id
    return stored


async def _scenario(db_url: str, fleet: list[NodeView], models: dict[str, RegisteredModel], requires: Requirements) -> None:
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as conn:
        org_id, _ = await create_organization(conn, "prop")
        for model in models.values():
            preferred = None if model.vram_preferred_mb is None else max(model.vram_preferred_mb, model.vram_min_mb)
            await register_model(conn, org_id, model.slug, vram_min_mb=model.vram_min_mb, ram_min_mb=model.ram_min_mb,
                                 vram_preferred_mb=preferred, requires_accelerators=model.requires_accelerators)  # fmt: skip
        stored = await _build(conn, org_id, fleet)
        prefer = stored.get(requires.prefer_node) if requires.prefer_node else None
        wanted = msgspec.to_builtins(msgspec.structs.replace(requires, prefer_node=prefer))
        job = await submit(conn, org_id, requires=wanted)
        answer = await explain(conn, org_id, job.id)
        assert answer.status == job.status
        for node_id in stored.values():
            async with conn.transaction(force_rollback=True):
                got = await claims.claim(conn, node_id=node_id, organization_id=org_id, lease_seconds=60)
            mine = [e for e in answer.eligible if e.node_id == node_id]
            if got is None:
                assert mine == [], f"explain called {mine[0].device_label} eligible but the claim took nothing"
            else:
                assert mine, "the claim took the job on a node explain called ineligible"
                assert (got.placement["device_id"], got.placement["score"]) == (mine[0].device_label, mine[0].score)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(fleet=fleets(), models=registries, requires=st.one_of(modest_requirements, requirements))
def test_a_device_explain_calls_eligible_can_claim_and_an_ineligible_one_never_does(db_url, fleet, models, requires):
    # Each example is its own organization in the test's database, so examples never see each other.
    anyio.run(_scenario, db_url, fleet, models, requires)

