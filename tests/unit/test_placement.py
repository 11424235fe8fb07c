"""Preference: throughput, residency over a load over an eviction, local affinity, reasons."""

from __future__ import annotations

from uuid import uuid4

from umbra.domain.eligibility import NodeView
from umbra.domain.models import RegisteredModel
from umbra.domain.placement import best_placement, placements
from umbra.events.types import Device, Requirements, ResidentModel

MODELS = {"m": RegisteredModel(slug="m", vram_min_mb=4000, vram_preferred_mb=8000, load_seconds=12.5)}


def node(*devices: Device, name: str = "box") -> NodeView:
    return NodeView(id=uuid4(), name=name, status="online", trust_domain="local", devices=devices)


def gpu(label: str, factor: float, free: int = 20000, resident=()) -> Device:
    return Device(kind="gpu_discrete", label=label, vram_total_mb=24000, vram_free_mb=free, throughput_factor=factor,
                  resident_models=tuple(ResidentModel(slug=s, vram_held_mb=h) for s, h in resident))  # fmt: skip


def test_throughput_orders_eligible_devices():
    box = node(gpu("slow", 2.0), gpu("fast", 8.0), Device(kind="cpu", label="cpu", ram_total_mb=64000, ram_free_mb=64000))
    ranked, ineligible = placements([box], Requirements(vram_min_mb=1000), {})
    assert [p.device_id for p in ranked] == ["fast", "slow", "cpu"]
    assert [p.score for p in ranked] == [8.0, 2.0, 1.0]  # nothing to load, nothing discounted
    assert ineligible == []


def test_a_resident_model_beats_a_load_which_beats_an_eviction():
    warm = gpu("warm", 4.0, free=500, resident=[("m", 6000)])
    cold = gpu("cold", 5.0)
    crowded = gpu("crowded", 9.0, free=5000, resident=[("other", 12000)])
    ranked, _ = placements([node(warm, cold, crowded)], Requirements(models=("m",)), MODELS)
    by_label = {p.device_id: p for p in ranked}
    assert by_label["warm"].score == 4.0 and by_label["warm"].resident
    assert by_label["cold"].score == 5.0 * 0.7 and not by_label["cold"].resident
    assert by_label["crowded"].score == 9.0 * 0.4 and by_label["crowded"].would_evict == ("other",)
    assert [p.device_id for p in ranked] == ["warm", "crowded", "cold"]  # 4.0 > 3.6 > 3.5


def test_local_affinity_multiplies_by_one_and_a_half_and_says_so():
    near, far = node(gpu("g", 2.0), name="near"), node(gpu("g", 2.5), name="far")
    ranked, _ = placements([far, near], Requirements(prefer_node=near.id), {})
    assert [p.node_id for p in ranked] == [near.id, far.id]
    assert ranked[0].score == 3.0 and ranked[0].reason == "local_affinity:gpu_discrete"
    assert ranked[1].reason == "placed:gpu_discrete"


def test_reasons_name_the_device_kind_or_the_slow_path():
    cpu = Device(kind="cpu", label="cpu", ram_total_mb=64000, ram_free_mb=64000)
    assert best_placement(node(cpu), Requirements(), {}).reason == "placed:cpu"
    slow = best_placement(node(cpu), Requirements(vram_min_mb=8000), {})
    assert (slow.reason, slow.via) == ("placed:slow_path:ram_not_vram", "ram")
    igpu = Device(kind="gpu_integrated", label="i", vram_total_mb=2000, vram_free_mb=1000, ram_total_mb=32000, ram_free_mb=30000)
    boxed = node(igpu)
    assert best_placement(boxed, Requirements(vram_min_mb=500), {}).reason == "placed:gpu_integrated"
    assert best_placement(boxed, Requirements(vram_min_mb=8000, prefer_node=boxed.id), {}).reason == (
        "local_affinity:slow_path:ram_not_vram"
    )


def test_the_estimate_is_the_load_time_of_models_not_yet_resident():
    cold = best_placement(node(gpu("g", 1.0)), Requirements(models=("m",)), MODELS)
    warm = best_placement(node(gpu("g", 1.0, free=500, resident=[("m", 6000)])), Requirements(models=("m",)), MODELS)
    assert (cold.estimated_seconds, warm.estimated_seconds) == (12.5, 0.0)
    assert best_placement(node(gpu("g", 1.0)), Requirements(), {}).estimated_seconds is None
    # Of two models, one warm on the device: only the other one's load is waited for.
    pair = {**MODELS, "cold": RegisteredModel(slug="cold", vram_min_mb=2000, load_seconds=10)}
    half_warm = best_placement(node(gpu("g", 1.0, free=10000, resident=[("m", 6000)])), Requirements(models=("m", "cold")), pair)
    assert half_warm.estimated_seconds == 10.0


def test_no_eligible_device_means_no_placement():
    assert best_placement(node(gpu("g", 1.0, free=100)), Requirements(vram_min_mb=1000), {}) is None
