"""Explain agrees with the claim, on random fleets, registries and jobs (pure).

The claim takes, on the claiming node, :func:`best_placement`; explain ranks
every device of every node with :func:`survey`. For any fleet and job: a node
explain lists an eligible device for is a node whose claim would take the job,
on that node's first-ranked device; a node whose devices explain calls all
ineligible never takes it; and a job the queue would block is one explain
calls eligible nowhere.
"""

from __future__ import annotations

from uuid import UUID

from hypothesis import given, settings
from hypothesis import strategies as st

from umbra.domain.eligibility import REASONS, NodeView, blocking_reason
from umbra.domain.explain import node_level_reason, survey
from umbra.domain.models import RegisteredModel
from umbra.domain.placement import best_placement
from umbra.events.types import Device, Requirements, ResidentModel

SLUGS = ("a", "b", "c")
ACCELERATORS = ("cuda", "metal", "rocm")
MB = st.sampled_from([0, 512, 2048, 4096, 8192, 16384, 24576, 49152])


@st.composite
def devices(draw, label: str) -> Device:
    kind = draw(st.sampled_from(["cpu", "gpu_integrated", "gpu_discrete"]))
    vram_total = 0 if kind == "cpu" else draw(MB)
    ram_total = draw(MB) if kind != "gpu_discrete" else draw(st.sampled_from([0, 8192]))
    room = vram_total if kind != "cpu" else ram_total
    resident: list[ResidentModel] = []
    for slug in draw(st.lists(st.sampled_from(SLUGS), unique=True, max_size=2)):
        held = draw(st.integers(0, room // 4))
        resident.append(ResidentModel(slug=slug, vram_held_mb=held))
    held_total = sum(m.vram_held_mb for m in resident)
    # Consistent reports: free + held never exceed the total (what an agent can actually report).
    vram_free = draw(st.integers(0, max(0, vram_total - held_total))) if kind != "cpu" else 0
    ram_free = draw(st.integers(0, max(0, ram_total - held_total)))
    return Device(
        kind=kind, label=label, vram_total_mb=vram_total, vram_free_mb=vram_free, ram_total_mb=ram_total,
        ram_free_mb=ram_free, throughput_factor=draw(st.sampled_from([0.5, 1.0, 2.0, 8.0])),
        accelerators=tuple(draw(st.lists(st.sampled_from(ACCELERATORS), unique=True, max_size=2))),
        resident_models=tuple(resident),
    )  # fmt: skip


@st.composite
def nodes(draw, index: int) -> NodeView:
    count = draw(st.integers(0, 3))
    return NodeView(
        id=UUID(int=index + 1),
        name=f"n{index}",
        status=draw(st.sampled_from(["online", "online", "online", "offline", "provisioning", "draining", "retired"])),
        trust_domain=draw(st.sampled_from(["local", "cloud"])),
        devices=tuple(draw(devices(f"d{i}")) for i in range(count)),
    )


registries = st.dictionaries(
    st.sampled_from(SLUGS),
    st.builds(
        lambda vram, ram, acc, pref: (vram, ram, acc, pref),
        MB, st.none() | MB, st.lists(st.sampled_from(ACCELERATORS), unique=True, max_size=1), st.none() | MB,
    ),
).map(lambda specs: {slug: RegisteredModel(slug=slug, vram_min_mb=v, ram_min_mb=r, requires_accelerators=tuple(a),
                                           vram_preferred_mb=p) for slug, (v, r, a, p) in specs.items()})  # fmt: skip

requirements = st.builds(
    Requirements,
    vram_min_mb=MB,
    ram_min_mb=MB,
    models=st.lists(st.sampled_from(SLUGS), unique=True, max_size=2).map(tuple),
    trust_domains=st.sampled_from([(), ("local",), ("cloud",)]),
    accelerators=st.lists(st.sampled_from(ACCELERATORS), unique=True, max_size=1).map(tuple),
    prefer_node=st.none() | st.sampled_from([UUID(int=1), UUID(int=2)]),
)


@st.composite
def fleets(draw) -> list[NodeView]:
    return [draw(nodes(i)) for i in range(draw(st.integers(0, 4)))]


@settings(max_examples=400, deadline=None)
@given(fleet=fleets(), models=registries, requires=requirements)
def test_explain_eligible_is_exactly_what_the_claim_would_take(fleet, models, requires):
    eligible, ineligible = survey(fleet, requires, models)
    for node in fleet:
        claimed = best_placement(node, requires, models)
        mine = [e for e in eligible if e.node_id == node.id]
        if claimed is None:
            assert mine == [], "explain called a device eligible on a node whose claim would not take the job"
            refused = [r for r in ineligible if r.node_id == node.id]
            # every device once; a node without devices once, for the node-level rule it fails, if any
            assert len(refused) == (len(node.devices) or int(node_level_reason(node, requires, models) is not None))
        else:
            assert mine, "the claim would take the job on a node explain calls ineligible"
            first = mine[0]
            assert (first.device_label, first.via, first.score, first.placement_reason, first.resident) == (
                claimed.device_id, claimed.via, claimed.score, claimed.reason, claimed.resident
            )
            assert tuple(first.would_evict) == claimed.would_evict


@settings(max_examples=400, deadline=None)
@given(fleet=fleets(), models=registries, requires=requirements)
def test_every_device_is_answered_once_and_the_ranking_is_best_first(fleet, models, requires):
    eligible, ineligible = survey(fleet, requires, models)
    answered = [(e.node_id, e.device_label) for e in eligible] + [
        (r.node_id, r.device_label) for r in ineligible if r.device_label is not None
    ]
    assert sorted(answered, key=str) == sorted(((n.id, d.label) for n in fleet for d in n.devices), key=str)
    assert len([r for r in ineligible if r.device_label is None]) <= sum(1 for n in fleet if not n.devices)
    assert all(r.reason in REASONS for r in ineligible)  # a node-level entry too: never a null reason
    assert [e.score for e in eligible] == sorted((e.score for e in eligible), reverse=True)
    assert all(r.reason in REASONS for r in ineligible if r.device_label is not None)


@settings(max_examples=400, deadline=None)
@given(fleet=fleets(), models=registries, requires=requirements)
def test_a_job_the_queue_would_block_is_eligible_nowhere(fleet, models, requires):
    eligible, _ = survey(fleet, requires, models)
    if blocking_reason(requires, models, fleet) is not None:
        assert eligible == []
