"""Explain, pure: the eleven reason codes, the ranking, device-less nodes, and the sentences."""

from __future__ import annotations

import dataclasses
from datetime import datetime, timezone
from uuid import uuid4

import pytest

from umbra.domain.eligibility import REASONS, NodeView
from umbra.domain.explain import QueueStanding, competing_ahead, node_level_reason, survey
from umbra.domain.explain_text import blocked_summary, placed_summary, queued_summary
from umbra.domain.models import RegisteredModel
from umbra.domain.placement import ModelHolders
from umbra.events.types import Device, Placement, Requirements, ResidentModel

GPU = Device(kind="gpu_discrete", label="gpu0", vram_total_mb=24576, vram_free_mb=24576, accelerators=("cuda",),
             throughput_factor=10.0)  # fmt: skip
FULL_GPU = Device(kind="gpu_discrete", label="gpu1", vram_total_mb=8192, vram_free_mb=0, accelerators=("cuda",))
IGPU = Device(kind="gpu_integrated", label="m4", vram_total_mb=4096, vram_free_mb=2048, ram_total_mb=32768,
              ram_free_mb=30000, accelerators=("metal",), throughput_factor=3.0)  # fmt: skip
CPU = Device(kind="cpu", label="cpu", ram_total_mb=16384, ram_free_mb=12000)
MODELS = {"gemma": RegisteredModel(slug="gemma", vram_min_mb=16000, load_seconds=30.0)}


def node(*devices: Device, name: str = "box", status: str = "online", trust_domain: str = "local") -> NodeView:
    return NodeView(id=uuid4(), name=name, status=status, trust_domain=trust_domain, devices=devices)


def only_reason(device: Device, *, status: str = "online", trust_domain: str = "local", **requires) -> str | None:
    """``status`` ``cordoned``: the node online, the device cordoned."""
    judged = node(device, status="online" if status == "cordoned" else status, trust_domain=trust_domain)
    if status == "cordoned":
        judged = dataclasses.replace(judged, cordoned=frozenset({device.label}))
    eligible, ineligible = survey([judged], Requirements(**requires), MODELS)
    assert len(eligible) + len(ineligible) == 1
    return ineligible[0].reason if ineligible else None


#: (device, node status, node trust domain, job requirements) -> the reason explain gives.
REASON_TABLE = [
    (GPU, "offline", "local", {}, "node_offline"),
    (GPU, "provisioning", "local", {}, "node_provisioning"),
    (GPU, "draining", "local", {}, "node_draining"),
    (GPU, "retired", "local", {}, "node_retired"),
    (GPU, "online", "cloud", {"trust_domains": ("local",)}, "trust_domain"),
    (CPU, "online", "local", {"accelerators": ("cuda",)}, "accelerator_missing"),
    (GPU, "online", "local", {"vram_min_mb": 30000}, "vram_insufficient"),
    (CPU, "online", "local", {"ram_min_mb": 12001}, "ram_insufficient"),
    (IGPU, "online", "local", {"vram_min_mb": 8000, "ram_min_mb": 40000}, "ram_insufficient"),
    (FULL_GPU, "online", "local", {}, "device_busy"),
    (GPU, "online", "local", {"models": ("llama",)}, "model_not_registered"),
    (GPU, "cordoned", "local", {}, "device_cordoned"),
    # The first failing rule wins: offline before trust domain, trust domain before memory.
    (GPU, "offline", "cloud", {"trust_domains": ("local",)}, "node_offline"),
    (GPU, "online", "cloud", {"trust_domains": ("local",), "vram_min_mb": 99999}, "trust_domain"),
    (FULL_GPU, "online", "local", {"accelerators": ("rocm",)}, "accelerator_missing"),
    (GPU, "cordoned", "cloud", {"trust_domains": ("local",)}, "trust_domain"),
    (FULL_GPU, "cordoned", "local", {"models": ("llama",)}, "device_cordoned"),
    # Eligible combinations have no reason.
    (GPU, "online", "local", {"models": ("gemma",)}, None),
    (IGPU, "online", "local", {"vram_min_mb": 8000}, None),
    (CPU, "online", "local", {"ram_min_mb": 12000}, None),
]


@pytest.mark.parametrize(("device", "status", "trust_domain", "requires", "reason"), REASON_TABLE)
def test_each_combination_gets_the_first_rule_it_fails(device, status, trust_domain, requires, reason):
    assert only_reason(device, status=status, trust_domain=trust_domain, **requires) == reason


def test_the_table_pins_every_reason_code():
    assert {row[-1] for row in REASON_TABLE} - {None} == set(REASONS)


def test_eligible_devices_are_ranked_best_first_with_the_claims_score():
    box = node(GPU, CPU, name="box")
    mac = node(IGPU, name="mac")
    warm = node(Device(kind="gpu_discrete", label="warm", vram_total_mb=24576, vram_free_mb=4000, throughput_factor=8.0,
                       resident_models=(ResidentModel(slug="gemma", vram_held_mb=16000),)), name="warm")  # fmt: skip
    eligible, ineligible = survey([box, mac, warm], Requirements(models=("gemma",)), MODELS)
    # warm: 8.0 resident; gpu0: 10.0 × 0.7 load; the iGPU runs it from RAM, loading it.
    assert [(e.node_name, e.device_label) for e in eligible] == [("warm", "warm"), ("box", "gpu0"), ("mac", "m4")]
    assert [e.score for e in eligible] == [8.0, 7.0, pytest.approx(2.1)]
    assert eligible[0].resident and eligible[0].estimated_seconds == 0.0 and eligible[1].estimated_seconds == 30.0
    assert eligible[2].via == "ram" and eligible[2].placement_reason == "placed:slow_path:ram_not_vram"
    # The CPU has 12000 MB free; gemma needs its 16000 MB VRAM floor in RAM.
    assert [(r.node_name, r.device_label, r.reason, r.needed_mb, r.available_mb) for r in ineligible] == [
        ("box", "cpu", "ram_insufficient", 16000, 12000)
    ]


def test_a_node_without_devices_appears_once_with_its_node_level_reason_or_not_at_all():
    bare_offline = node(name="empty", status="offline")
    bare_online = node(name="new")
    eligible, ineligible = survey([bare_offline, node(CPU, name="cpu-box"), bare_online], Requirements(ram_min_mb=99999), MODELS)
    assert eligible == []
    assert [(r.node_name, r.device_label, r.reason) for r in ineligible] == [
        ("empty", None, "node_offline"), ("cpu-box", "cpu", "ram_insufficient"),
    ]  # fmt: skip  ("new" fails no rule and has no device: not listed, never with a null reason)
    assert node_level_reason(node(trust_domain="x"), Requirements(trust_domains=("y",)), MODELS) == "trust_domain"
    assert node_level_reason(node(), Requirements(models=("nope",)), MODELS) == "model_not_registered"
    assert node_level_reason(node(), Requirements(accelerators=("cuda",), vram_min_mb=10**9), MODELS) is None


def test_memory_refusals_carry_the_rules_numbers():
    _, [refusal] = survey([node(GPU)], Requirements(vram_min_mb=40000), MODELS)
    assert (refusal.reason, refusal.needed_mb, refusal.available_mb) == ("vram_insufficient", 40000, 24576)
    _, [busy] = survey([node(FULL_GPU)], Requirements(), MODELS)
    assert (busy.needed_mb, busy.available_mb) == (None, None)


def test_jobs_ahead_count_only_where_an_eligible_node_would_take_them_first():
    cpu_box = node(CPU, name="cpu-box")
    shapes = [("echo", Requirements(), 3), ("echo", Requirements(accelerators=("cuda",)), 5),
              ("render", Requirements(ram_min_mb=100), 2)]  # fmt: skip
    assert competing_ahead(shapes, [cpu_box], MODELS) == 5
    assert competing_ahead(shapes, [cpu_box, node(GPU)], MODELS) == 10
    assert competing_ahead(shapes, [], MODELS) == 0
    # Jobs of a kind the node's agent does not take are never claimed by it first.
    assert competing_ahead(shapes, [cpu_box], MODELS, {cpu_box.id: ("render",)}) == 2
    assert competing_ahead(shapes, [cpu_box], MODELS, {cpu_box.id: ("echo",)}) == 3


# -- sentences ---------------------------------------------------------------------


def queued(nodes, standing=QueueStanding(), not_before=None, **requires) -> str:
    req = Requirements(**requires)
    eligible, ineligible = survey(nodes, req, MODELS)
    return queued_summary(eligible, ineligible, nodes=nodes, requires=req, models=MODELS, standing=standing,
                          not_before=not_before)  # fmt: skip


def test_nothing_fits_names_the_shortfall_and_the_nodes_that_are_away():
    fleet = [node(GPU, name="gpu-box"), node(GPU, name="a", status="offline"), node(CPU, name="b", status="offline")]
    assert queued(fleet, vram_min_mb=40000) == (
        "No device can take it now: needs 40000 MB VRAM, the largest free is 24576 MB on gpu-box/gpu0; "
        "2 nodes are offline."
    )


def test_every_kind_of_refusal_has_a_clause():
    fleet = [node(FULL_GPU, name="busy"), node(CPU, name="plain"), node(GPU, name="far", trust_domain="cloud"),
             node(GPU, name="dr", status="draining"), node(name="bare")]  # fmt: skip
    text = queued(fleet, accelerators=("cuda",), trust_domains=("local",))
    assert text == (
        "No device can take it now: 1 GPU is busy (no free VRAM); 1 device lacks cuda; "
        "1 node is outside trust domain local; 1 node is draining; 1 node reports no devices."
    )
    assert queued([], ram_min_mb=1) == "No device can take it now: no nodes are paired in this organization."
    assert "model llama is not registered" in queued([node(CPU)], models=("llama",))


def test_an_eligible_job_says_where_it_would_run_and_what_holds_it_back():
    fleet = [node(CPU, name="cpu-box"), node(GPU, name="gpu-box")]
    assert queued(fleet) == (
        "Can run on 2 devices; the best is gpu-box/gpu0 via vram (score 10, placed:gpu_discrete); "
        "nothing holds it back: the next claim by an eligible node takes it."
    )
    at = datetime(2030, 1, 1, 12, 0, 5, 123456, tzinfo=timezone.utc)
    text = queued(fleet, QueueStanding(due_in_seconds=8.4, ahead=3), not_before=at)
    assert text.endswith(
        "it is not due until 2030-01-01T12:00:05Z (8 s from now, a retry backoff) and "
        "3 jobs ahead of it in the queue would be claimed first by the same nodes."
    )
    assert "1 job ahead" in queued(fleet, QueueStanding(ahead=1))


def test_a_job_no_eligible_nodes_agent_takes_waits_for_a_handler_and_the_best_is_one_that_takes_it():
    cpu_box, gpu_box = node(CPU, name="cpu-box"), node(GPU, name="gpu-box")
    req = Requirements()
    eligible, ineligible = survey([cpu_box, gpu_box], req, MODELS)

    def said(kinds_taken):
        return queued_summary(eligible, ineligible, nodes=[cpu_box, gpu_box], requires=req, models=MODELS,
                              standing=QueueStanding(), not_before=None, kind="render", kinds_taken=kinds_taken)  # fmt: skip

    assert said({cpu_box.id: ("echo",), gpu_box.id: ("echo", "sleep")}) == (
        "Can run on 2 devices of 2 nodes, but their agents do not take kind 'render' (they take echo, sleep): "
        "it waits for an agent with a handler for it."
    )
    assert said({cpu_box.id: ("render",), gpu_box.id: ("echo",)}).startswith(
        "Can run on 1 device; the best is cpu-box/cpu via ram")
    assert said({cpu_box.id: ("echo",)}).startswith("Can run on 1 device; the best is gpu-box/gpu0")  # gpu-box: every kind


def test_blocked_sentences_come_from_the_blocking_reason():
    fails = datetime(2030, 1, 2, tzinfo=timezone.utc)
    reason = "no_eligible_device: needs 40000 MB VRAM, largest is 24576 MB (gpu-box/gpu0)"
    assert blocked_summary(stored=reason, current=reason, fails_at=fails) == (
        "Blocked because no registered device could ever run it: needs 40000 MB VRAM, largest is 24576 MB "
        "(gpu-box/gpu0); it fails at 2030-01-02T00:00:00Z unless a node or model change lets it run."
    )
    text = blocked_summary(stored="model_not_registered: llama", current="model_not_registered: llama", fails_at=None)
    assert text == "Blocked because it names a model that is not registered: llama."
    assert "could run it now" in blocked_summary(stored=reason, current=None, fails_at=fails)


def test_placed_and_finished_sentences_name_the_recorded_placement():
    placement = Placement(node_id=uuid4(), device_id="gpu0", device_kind="gpu_discrete", reason="placed:gpu_discrete")
    common = dict(placement=placement, node_name="gpu-box", max_attempts=3, error=None, result=None, children=None)
    assert placed_summary(status="running", attempt=2, lease_seconds_left=41.6, **common) == (
        "Running on gpu-box/gpu0 via vram (placed:gpu_discrete), attempt 2 of 3; its lease expires in 42 s."
    )
    assert "expired 5 s ago" in placed_summary(status="running", attempt=1, lease_seconds_left=-5.0, **common)
    assert placed_summary(status="complete", attempt=1, lease_seconds_left=None, **common) == (
        "Complete on gpu-box/gpu0 after attempt 1."
    )
    assert placed_summary(status="cancelled", attempt=1, lease_seconds_left=None, **common) == (
        "Cancelled while running on gpu-box/gpu0."
    )
    failed = {**common, "error": "out of memory"}
    assert placed_summary(status="failed", attempt=3, lease_seconds_left=None, **failed) == (
        "Failed after attempt 3 of 3 on gpu-box/gpu0: out of memory."
    )
    assert placed_summary(status="failed", attempt=1, lease_seconds_left=None, **failed) == (
        "Failed for good after attempt 1 (of up to 3) on gpu-box/gpu0: out of memory."
    )
    # Uncharged claims (given back unheard, ended by a revocation) are attempts (fencing tokens), not
    # charged runs: "attempt 4 of 3" says which run it is.
    assert placed_summary(status="running", attempt=4, lease_seconds_left=None, uncharged=2, **common) == (
        "Running on gpu-box/gpu0 via vram (placed:gpu_discrete), attempt 4 (run 2 of 3; 2 earlier claims not charged)."
    )
    assert placed_summary(status="failed", attempt=4, lease_seconds_left=None, uncharged=1, **failed) == (
        "Failed after attempt 4 (run 3 of 3; 1 earlier claim not charged) on gpu-box/gpu0: out of memory."
    )
    assert placed_summary(status="failed", attempt=3, lease_seconds_left=None, uncharged=1, **failed) == (
        "Failed for good after run 2, attempt 3 (of up to 3) on gpu-box/gpu0: out of memory."
    )
    container = {**common, "children": (5, 2)}
    assert placed_summary(status="running", attempt=1, lease_seconds_left=None, **container) == (
        "Running as a container: 2 of 5 children finished; it settles when all have."
    )
    settled = {**container, "result": {"detail": "all 5 children completed"}}
    assert placed_summary(status="complete", attempt=1, lease_seconds_left=None, **settled) == (
        "Complete: all 5 children completed."
    )
    handlerless = {**common, "error": "No handler for job kind 'x' on this agent (it handles: echo)."}
    assert placed_summary(status="failed", attempt=1, lease_seconds_left=None, **handlerless).endswith("(it handles: echo).")
    unplaced = {**common, "placement": None, "error": "no_eligible_device: nope"}
    assert placed_summary(status="failed", attempt=0, lease_seconds_left=None, **unplaced) == (
        "Failed without running: no_eligible_device: nope."
    )
    assert placed_summary(status="cancelled", attempt=0, lease_seconds_left=None, **unplaced) == "Cancelled before it ran."
    assert placed_summary(status="cancelled", attempt=1, lease_seconds_left=None, **{**container, "placement": None}) == (
        "Cancelled as a container of 5 children; those still open were cancelled with it."
    )  # a container runs on no node: never "cancelled while running on" the node that split it
    assert placed_summary(status="partial", attempt=1, lease_seconds_left=None,
                          **{**container, "error": "1 of 5 children failed"}) == "Partial: 1 of 5 children failed."  # fmt: skip
    with pytest.raises(ValueError):
        placed_summary(status="queued", attempt=0, lease_seconds_left=None, **common)


def test_a_job_left_to_the_node_holding_its_model_says_so_and_for_how_long():
    """Model affinity: gemma is resident on warm, cold would load it. For the affinity's rest the job is left
    to warm, and the sentence says so; not once it waited the affinity, with affinity off, when no node holds
    gemma, nor when every eligible node holds it (nobody leaves it to anybody)."""
    from umbra.domain.explain import left_to_holders

    warm_gpu = Device(kind="gpu_discrete", label="gpu0", vram_total_mb=24576, vram_free_mb=8000, accelerators=("cuda",),
                      resident_models=(ResidentModel(slug="gemma", vram_held_mb=16000),), throughput_factor=10.0)  # fmt: skip
    fleet = [node(GPU, name="cold"), node(warm_gpu, name="warm")]
    needs = Requirements(models=("gemma",))
    eligible, ineligible = survey(fleet, needs, MODELS)
    holders = ModelHolders(fleet, MODELS)
    assert left_to_holders(eligible, needs, waited_seconds=12, affinity_seconds=30, holders=holders) == (("warm",), 18)
    assert left_to_holders(eligible, needs, waited_seconds=30, affinity_seconds=30, holders=holders) == ((), 0.0)
    assert left_to_holders(eligible, needs, waited_seconds=12, affinity_seconds=0, holders=holders) == ((), 0.0)
    cold_only, warm_only = ModelHolders([fleet[0]], MODELS), ModelHolders([fleet[1]], MODELS)
    assert left_to_holders(survey([fleet[0]], needs, MODELS)[0], needs, waited_seconds=12, affinity_seconds=30,
                           holders=cold_only) == ((), 0.0)  # fmt: skip
    assert left_to_holders(survey([fleet[1]], needs, MODELS)[0], needs, waited_seconds=12, affinity_seconds=30,
                           holders=warm_only) == ((), 0.0)  # fmt: skip
    # The holders are the claims' (as last reported): one whose card its running jobs fill for now still counts,
    # though explain lists it ineligible; one whose agent does not take the job's kind does not.
    assert left_to_holders(survey([fleet[0]], needs, MODELS)[0], needs, waited_seconds=12, affinity_seconds=30,
                           holders=holders) == (("warm",), 18)  # fmt: skip
    embeds = ModelHolders(fleet, MODELS, {fleet[1].id: ("embed",)})
    assert left_to_holders(eligible, needs, waited_seconds=12, affinity_seconds=30, holders=embeds, kind="chat") == ((), 0.0)
    text = queued_summary(eligible, ineligible, nodes=fleet, requires=needs, models=MODELS, not_before=None,
                          standing=QueueStanding(left_to=("warm",), left_for_seconds=18.4))  # fmt: skip
    assert text == ("Can run on 2 devices; the best is warm/gpu0 via vram (score 10, placed:gpu_discrete); "
                    "nodes that would load gemma leave it to warm, which holds it, for 18 s more (model affinity).")  # fmt: skip
