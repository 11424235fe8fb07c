"""Preference: throughput, residency over a load over an eviction, local affinity, reasons."""

from __future__ import annotations

import dataclasses
import random
from uuid import uuid4

import pytest

from umbra.domain.eligibility import NodeView, judge_device
from umbra.domain.explain import survey
from umbra.domain.models import RegisteredModel
from umbra.domain.placement import (
    NO_HOLDERS, ModelHolders, RunningJob, after_placement, best_placement, defers, holds_models, passes_over, placements,
    with_running_jobs,
)  # fmt: skip
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


def test_a_preferred_vram_amount_only_ranks_and_never_refuses():
    """Only a model's VRAM floor refuses a device: where its preferred size does not fit, the device is still
    eligible at the floor (×0.7 to load it; ×0.4 when reaching the preferred size would unload a resident
    model), and one MB under the floor is refused with the floor as the amount needed."""
    registry = {"m": RegisteredModel(slug="m", vram_min_mb=8000, vram_preferred_mb=20000)}
    needs = Requirements(models=("m",))
    placed = best_placement(node(gpu("g", 10.0, free=9000)), needs, registry)
    assert placed is not None and (placed.via, placed.would_evict, placed.score) == ("vram", (), pytest.approx(7.0))
    placed = best_placement(node(gpu("g", 10.0, free=9000, resident=[("other", 6000)])), needs, registry)
    assert placed is not None and placed.would_evict == ("other",) and placed.score == pytest.approx(4.0)
    short = node(gpu("g", 10.0, free=7999))
    verdict = judge_device(short, short.devices[0], needs, registry)
    assert (verdict.reason, verdict.needed_mb, verdict.available_mb) == ("vram_insufficient", 8000, 7999)


def test_affinity_multiplies_the_load_and_eviction_scores_and_eviction_does_not_compound_with_load():
    """Score = throughput × (0.4 if it would evict, else 0.7 if the job's models must be loaded) × 1.5 on the
    preferred node: an eviction is ×0.4 (not ×0.4×0.7), affinity applies on top of either, and the reason
    says ``local_affinity:<kind>`` on the preferred node and ``placed:<kind>`` elsewhere."""
    registry = {"m": RegisteredModel(slug="m", vram_min_mb=4000, vram_preferred_mb=20000)}
    near = node(gpu("g", 10.0, free=6000, resident=[("other", 10000)]), name="near")
    far = node(gpu("g", 10.0, free=24000), name="far")
    names = {near.id: "near", far.id: "far"}
    for prefer, expected in ((near, {"near": 10.0 * 0.4 * 1.5, "far": 10.0 * 0.7}),
                             (far, {"near": 10.0 * 0.4, "far": 10.0 * 0.7 * 1.5})):  # fmt: skip
        ranked, _ = placements([near, far], Requirements(models=("m",), prefer_node=prefer.id), registry)
        assert {names[p.node_id]: p.score for p in ranked} == pytest.approx(expected)
        assert {names[p.node_id]: p.reason for p in ranked} == {
            name: "local_affinity:gpu_discrete" if name == prefer.name else "placed:gpu_discrete" for name in expected
        }
        assert [p.score for p in ranked] == sorted((p.score for p in ranked), reverse=True)


def test_equal_scores_rank_by_node_order_then_device_order_every_time():
    """Ties are deterministic: equal scores keep the order the nodes are given in (the claim's reader gives
    them by name), then the node's device order, however often it is asked."""
    fleet = [node(gpu("g0", 2.0), gpu("g1", 2.0), name=name) for name in ("a", "b", "c")]
    names = {n.id: n.name for n in fleet}
    for _ in range(5):
        ranked, _ = placements(fleet, Requirements(vram_min_mb=1000), {})
        assert [(names[p.node_id], p.device_id) for p in ranked] == [(n.name, label) for n in fleet for label in ("g0", "g1")]
    shuffled = fleet[:]
    random.Random(7).shuffle(shuffled)
    ranked, _ = placements(shuffled, Requirements(vram_min_mb=1000), {})
    assert [names[p.node_id] for p in ranked][::2] == [n.name for n in shuffled]


def test_multi_model_jobs_are_resident_only_when_every_model_is_and_never_evict_their_own():
    """A job naming two models is ``resident`` (undiscounted, estimate 0) only where both are; with one warm it
    is a load (×0.7, or ×0.4 when it evicts) waiting only for the other's load time; the job's own warm model
    is never in ``would_evict``, even when reaching the other's preferred size needs room; and the two need
    the sum of their floors."""
    registry = {"a": RegisteredModel(slug="a", vram_min_mb=4000, load_seconds=20),
                "b": RegisteredModel(slug="b", vram_min_mb=4000, vram_preferred_mb=16000, load_seconds=30)}  # fmt: skip
    needs = Requirements(models=("a", "b"))
    both = best_placement(node(gpu("g", 10.0, free=2000, resident=[("a", 6000), ("b", 6000)])), needs, registry)
    assert both is not None and (both.resident, both.score, both.estimated_seconds, both.would_evict) == (True, 10.0, 0.0, ())
    half = best_placement(node(gpu("g", 10.0, free=6000, resident=[("a", 6000), ("z", 8000)])), needs, registry)
    assert half is not None and not half.resident and half.estimated_seconds == 30.0
    assert half.would_evict == ("z",) and half.score == pytest.approx(4.0)
    tight = node(gpu("g", 10.0, free=7999))
    assert judge_device(tight, tight.devices[0], needs, registry).reason == "vram_insufficient"


def test_a_full_discrete_gpu_never_runs_from_ram_and_explain_lists_the_slow_path_best_first():
    """A discrete GPU too small in VRAM is refused (``vram_insufficient``) however much RAM it reports; the
    same job on the node's CPU or integrated GPU runs from RAM and says ``placed:slow_path:ram_not_vram``; an
    integrated GPU whose VRAM fits says ``placed:gpu_integrated``; explain lists the eligible best first."""
    rich_gpu = Device(kind="gpu_discrete", label="gpu0", vram_total_mb=8192, vram_free_mb=8000, ram_total_mb=131072,
                      ram_free_mb=131072, throughput_factor=10.0)  # fmt: skip
    igpu = Device(kind="gpu_integrated", label="igpu", vram_total_mb=4096, vram_free_mb=4000, ram_total_mb=65536,
                  ram_free_mb=60000, throughput_factor=3.0)  # fmt: skip
    box = node(rich_gpu, igpu, Device(kind="cpu", label="cpu", ram_total_mb=65536, ram_free_mb=60000))
    eligible, ineligible = survey([box], Requirements(vram_min_mb=12000), {})
    assert [(e.device_label, e.via, e.placement_reason) for e in eligible] == [
        ("igpu", "ram", "placed:slow_path:ram_not_vram"), ("cpu", "ram", "placed:slow_path:ram_not_vram"),
    ]
    assert [(i.device_label, i.reason) for i in ineligible] == [("gpu0", "vram_insufficient")]
    small = best_placement(box, Requirements(vram_min_mb=3000), {})
    assert small is not None and (small.device_id, small.reason) == ("gpu0", "placed:gpu_discrete")
    only_igpu = best_placement(node(igpu), Requirements(vram_min_mb=3000), {})
    assert only_igpu is not None and (only_igpu.via, only_igpu.reason) == ("vram", "placed:gpu_integrated")


def test_no_eligible_device_means_no_placement():
    assert best_placement(node(gpu("g", 1.0, free=100)), Requirements(vram_min_mb=1000), {}) is None


def test_after_a_placement_the_next_job_of_the_claim_finds_the_memory_it_took_gone():
    box = node(gpu("g0", 1.0, free=20000), gpu("g1", 1.0, free=20000))
    placed = best_placement(box, Requirements(vram_min_mb=12000), {})
    after = after_placement(box, placed, Requirements(vram_min_mb=12000), {})
    assert [d.vram_free_mb for d in after.devices] == [8000, 20000]
    assert best_placement(after, Requirements(vram_min_mb=12000), {}).device_id == "g1"
    # A job that needs nothing takes nothing: the same node, not a copy to judge again.
    assert after_placement(box, best_placement(box, Requirements(), {}), Requirements(), {}) is box


def test_after_a_placement_its_models_are_resident_and_the_evicted_ones_gone():
    registry = {"m": RegisteredModel(slug="m", vram_min_mb=4000), "big": RegisteredModel(slug="big", vram_min_mb=8000, vram_preferred_mb=14000)}
    box = node(gpu("g", 1.0, free=9000, resident=[("a", 3000), ("b", 9000)]))
    placed = best_placement(box, Requirements(models=("big",)), registry)
    assert placed.would_evict == ("b",)
    [device] = after_placement(box, placed, Requirements(models=("big",)), registry).devices
    assert (device.vram_free_mb, sorted(m.slug for m in device.resident_models)) == (9000 + 9000 - 8000, ["a", "big"])
    # The job's own need beyond its models' floors is taken too; a model already resident is not loaded again.
    warm = node(gpu("g", 1.0, free=10000, resident=[("m", 4000)]))
    taken = after_placement(warm, best_placement(warm, Requirements(models=("m",), vram_min_mb=7000), registry),
                            Requirements(models=("m",), vram_min_mb=7000), registry)  # fmt: skip
    assert taken.devices[0].vram_free_mb == 10000 - 3000


def test_after_a_placement_on_the_slow_path_ram_is_taken():
    cpu = Device(kind="cpu", label="cpu", ram_total_mb=32768, ram_free_mb=20000)
    box = node(cpu)
    placed = best_placement(box, Requirements(ram_min_mb=12000), {})
    assert placed.via == "ram"
    after = after_placement(box, placed, Requirements(ram_min_mb=12000), {})
    assert after.devices[0].ram_free_mb == 8000 and best_placement(after, Requirements(ram_min_mb=12000), {}) is None


def test_on_unified_memory_what_one_device_takes_every_such_device_of_the_node_loses():
    """A node's CPU and integrated GPU report the same system RAM: a job on either takes it from both."""
    cpu = Device(kind="cpu", label="cpu", ram_total_mb=32768, ram_free_mb=20000)
    igpu = Device(kind="gpu_integrated", label="igpu", vram_total_mb=16384, vram_free_mb=8000, ram_total_mb=32768, throughput_factor=4.0,
                  ram_free_mb=20000)  # fmt: skip
    box = node(cpu, igpu)
    placed = best_placement(box, Requirements(vram_min_mb=6000), {})
    assert (placed.device_id, placed.via) == ("igpu", "vram")
    after = after_placement(box, placed, Requirements(vram_min_mb=6000), {})
    assert [(d.vram_free_mb, d.ram_free_mb) for d in after.devices] == [(0, 14000), (2000, 14000)]


def test_an_integrated_gpu_has_no_more_vram_free_than_the_ram_a_cpu_job_left():
    """An Apple silicon Mac: the GPU may use up to 48 GB of the 64 GB RAM. A CPU job taking 40 GB leaves 20 GB
    of RAM, so a job wanting 30 GB of VRAM no longer fits the GPU, though its own share was untouched; one
    wanting 16 GB still does. The same when the CPU job is a running one the claim reads."""
    cpu = Device(kind="cpu", label="cpu", ram_total_mb=64000, ram_free_mb=60000)
    igpu = Device(kind="gpu_integrated", label="metal:0", vram_total_mb=48000, vram_free_mb=48000, ram_total_mb=64000,
                  ram_free_mb=60000, throughput_factor=10.0)  # fmt: skip
    box = node(cpu, igpu)
    big_cpu_job = Requirements(ram_min_mb=40000)
    on_cpu = best_placement(node(cpu), big_cpu_job, {})
    after = after_placement(box, on_cpu, big_cpu_job, {})
    assert [(d.vram_free_mb, d.ram_free_mb) for d in after.devices] == [(0, 20000), (20000, 20000)]
    assert best_placement(after, Requirements(vram_min_mb=30000), {}) is None
    assert best_placement(after, Requirements(vram_min_mb=16000), {}).device_id == "metal:0"
    bounded = with_running_jobs(box, [RunningJob(big_cpu_job, on_cpu)], {})
    assert [(d.vram_free_mb, d.ram_free_mb) for d in bounded.devices] == [(0, 24000), (24000, 24000)]  # from the totals
    assert best_placement(bounded, Requirements(vram_min_mb=30000), {}) is None
    # Its own share still bounds it: with the RAM all free, 48 GB, not 64.
    assert best_placement(box, Requirements(vram_min_mb=50000), {}).via == "ram"


def test_a_model_a_job_of_the_claim_runs_on_is_never_evicted_for_a_later_one():
    registry = {"m": RegisteredModel(slug="m", vram_min_mb=8000),
                "n": RegisteredModel(slug="n", vram_min_mb=4000, vram_preferred_mb=16000)}  # fmt: skip
    box = node(gpu("g", 1.0, free=12000, resident=[("m", 8000)]))
    alone = best_placement(box, Requirements(models=("n",)), registry)
    assert alone.would_evict == ("m",)  # for its preferred size, n alone would unload m
    after = after_placement(box, best_placement(box, Requirements(models=("m",)), registry), Requirements(models=("m",)), registry)
    assert best_placement(after, Requirements(models=("n",)), registry).would_evict == ()



def running(box: NodeView, requires: Requirements, models=MODELS) -> RunningJob:
    placement = best_placement(box, requires, models)
    assert placement is not None
    return RunningJob(requires, placement)


def test_a_running_job_not_in_the_report_takes_its_memory_from_the_total():
    box = node(gpu("g", 1.0, free=20000))  # the report, from before the job was claimed
    bounded = with_running_jobs(box, [running(box, Requirements(vram_min_mb=16000))], MODELS)
    assert bounded.devices[0].vram_free_mb == 24000 - 16000
    assert best_placement(bounded, Requirements(vram_min_mb=16000), MODELS) is None


def test_a_running_job_the_report_shows_is_not_counted_twice():
    claimed_on = node(gpu("g", 1.0, free=20000))
    shown = node(gpu("g", 1.0, free=4000))  # the report once the job took its 16,000 MB
    bounded = with_running_jobs(shown, [running(claimed_on, Requirements(vram_min_mb=16000))], MODELS)
    assert bounded.devices[0].vram_free_mb == 4000


def test_a_running_jobs_model_not_listed_resident_is_shared_and_in_use():
    box = node(gpu("g", 1.0, free=20000))
    bounded = with_running_jobs(box, [running(box, Requirements(models=("m",)))], MODELS)
    device = bounded.devices[0]
    assert device.vram_free_mb == 24000 - 4000 and [(m.slug, m.vram_held_mb) for m in device.resident_models] == [("m", 4000)]
    assert ("g", "m") in bounded.loading and ("g", "m") in bounded.in_use
    again = best_placement(bounded, Requirements(models=("m",)), MODELS)
    assert again is not None and not again.resident and again.estimated_seconds == 12.5  # shares it, waits for its load


def test_jobs_sharing_a_model_count_its_floor_once():
    box = node(gpu("g", 1.0, free=20000))
    job = running(box, Requirements(models=("m",)))
    bounded = with_running_jobs(box, [job, job, job], MODELS)
    assert bounded.devices[0].vram_free_mb == 24000 - 4000


def test_a_model_a_running_job_uses_is_never_evicted():
    box = node(gpu("g", 1.0, free=7000, resident=[("m", 8000)]))
    other = {"n": RegisteredModel(slug="n", vram_min_mb=6000, vram_preferred_mb=12000), **MODELS}
    evicting = best_placement(box, Requirements(models=("n",)), other)
    assert evicting is not None and evicting.would_evict == ("m",)  # with nothing running on m, it makes room
    bounded = with_running_jobs(box, [running(box, Requirements(models=("m",)), other)], other)
    beside = best_placement(bounded, Requirements(models=("n",)), other)
    assert beside is not None and beside.would_evict == ()


def test_a_model_a_running_job_uses_is_never_evicted_once_removed_from_the_registry():
    """``DELETE /v1/models/m`` while a job runs on m: the job runs on (docs/API.md), and m stays in use. Judged by
    the registry's models only, m was free to evict for n's preferred size, and its 8,000 MB counted free."""
    box = node(gpu("g", 1.0, free=7000, resident=[("m", 8000)]))
    other = {"n": RegisteredModel(slug="n", vram_min_mb=6000, vram_preferred_mb=12000), **MODELS}
    job = running(box, Requirements(models=("m",)), other)
    without_m = {slug: model for slug, model in other.items() if slug != "m"}
    bounded = with_running_jobs(box, [job], without_m)
    assert ("g", "m") in bounded.in_use
    beside = best_placement(bounded, Requirements(models=("n",)), without_m)
    assert beside is not None and beside.would_evict == ()
    assert after_placement(bounded, beside, Requirements(models=("n",)), without_m).devices[0].vram_free_mb == 7000 - 6000


def test_a_model_a_running_job_evicts_is_not_shared_by_the_next_claim():
    """The running job evicts m for n's preferred size: the bound counts m's 8,000 MB free, so m is not also
    resident (its 8,000 MB held) for a job naming it: 16,000 free beside m and n was 32,000 MB on a 24,000 card."""
    registry = {"m": RegisteredModel(slug="m", vram_min_mb=8000),
                "n": RegisteredModel(slug="n", vram_min_mb=8000, vram_preferred_mb=20000)}  # fmt: skip
    box = node(gpu("g", 1.0, free=16000, resident=[("m", 8000)]))
    evicting = running(box, Requirements(models=("n",)), registry)
    assert evicting.placement.would_evict == ("m",)
    on_m = Requirements(models=("m",), vram_min_mb=20000)
    assert best_placement(after_placement(box, evicting.placement, evicting.requires, registry), on_m, registry) is None
    bounded = with_running_jobs(box, [evicting], registry)
    device = bounded.devices[0]
    assert device.vram_free_mb + sum(m.vram_held_mb for m in device.resident_models) <= device.vram_total_mb
    assert best_placement(bounded, on_m, registry) is None  # as one claim of both jobs decides


def test_running_jobs_on_unified_memory_bound_every_such_device_of_the_node():
    cpu = Device(kind="cpu", label="cpu", ram_total_mb=32000, ram_free_mb=30000)
    igpu = Device(kind="gpu_integrated", label="i", vram_total_mb=8000, vram_free_mb=8000, ram_total_mb=32000, ram_free_mb=30000)
    box = node(cpu, igpu)
    on_cpu = RunningJob(Requirements(ram_min_mb=20000), best_placement(node(cpu), Requirements(ram_min_mb=20000), {}))
    bounded = with_running_jobs(box, [on_cpu], {})
    assert [d.ram_free_mb for d in bounded.devices] == [12000, 12000]


def test_models_the_report_lists_hold_their_memory_in_the_running_jobs_bound():
    box = node(gpu("g", 1.0, free=8000, resident=[("m", 8000)]))  # 24,000 in all: 8,000 held by m, 8,000 by a job
    before = node(gpu("g", 1.0, free=16000, resident=[("m", 8000)]))
    bounded = with_running_jobs(box, [running(before, Requirements(vram_min_mb=8000))], MODELS)
    assert bounded.devices[0].vram_free_mb == 8000  # the report: 24,000 - 8,000 (m) - 8,000 (the job)
    stale = with_running_jobs(before, [running(before, Requirements(vram_min_mb=8000))], MODELS)
    assert stale.devices[0].vram_free_mb == 8000  # the bound, before the report shows the job


def test_no_running_job_leaves_the_node_as_reported():
    box = node(gpu("g", 1.0))
    assert with_running_jobs(box, [], MODELS) is box
    gone = running(node(gpu("gone", 1.0)), Requirements(vram_min_mb=16000))
    assert with_running_jobs(box, [gone], MODELS).devices == box.devices  # a device the report no longer lists


def test_model_affinity_defers_only_young_jobs_naming_models_the_node_must_load():
    """Passed over for now: a job naming a model this node would load, queued less than the affinity. Never a
    job naming none, one whose models are resident, one that waited the affinity, nor anything with it off."""
    box = node(gpu("g0", 1.0, resident=[("m", 8000)]), gpu("g1", 1.0))
    resident = best_placement(box, Requirements(models=("m",)), MODELS)
    loading = best_placement(node(gpu("g1", 1.0)), Requirements(models=("m",)), MODELS)
    bare = best_placement(box, Requirements(), MODELS)
    assert resident.resident and not loading.resident
    assert defers(Requirements(models=("m",)), loading, waited_seconds=5, affinity_seconds=30)
    assert not defers(Requirements(models=("m",)), loading, waited_seconds=30, affinity_seconds=30)
    assert not defers(Requirements(models=("m",)), loading, waited_seconds=5, affinity_seconds=0)
    assert not defers(Requirements(models=("m",)), resident, waited_seconds=5, affinity_seconds=30)
    assert not defers(Requirements(), bare, waited_seconds=0, affinity_seconds=30)


def test_a_node_leaves_a_young_job_to_another_node_that_holds_its_models_until_it_has_waited_the_affinity():
    """Model affinity across nodes: a node that would load ``m`` passes the job over, even with nothing else to
    take, while another node could start it with ``m`` resident, for what is left of the affinity; not once it
    has waited that long, not when the node holds ``m`` itself, and not when nobody else holds it."""
    needs_m = Requirements(models=("m",))
    cold, warm = node(gpu("g0", 1.0), name="cold"), node(gpu("g0", 1.0, resident=[("m", 8000)]), name="warm")
    holders = ModelHolders([warm], MODELS)
    loading = best_placement(cold, needs_m, MODELS)
    resident = best_placement(warm, needs_m, MODELS)
    assert passes_over(needs_m, loading, node_id=cold.id, waited_seconds=5, affinity_seconds=30, holders=holders) == 25
    assert passes_over(needs_m, loading, node_id=cold.id, waited_seconds=30, affinity_seconds=30, holders=holders) is None
    assert passes_over(needs_m, loading, node_id=cold.id, waited_seconds=5, affinity_seconds=0, holders=holders) is None
    assert passes_over(needs_m, resident, node_id=warm.id, waited_seconds=5, affinity_seconds=30, holders=holders) is None
    assert passes_over(needs_m, loading, node_id=cold.id, waited_seconds=5, affinity_seconds=30, holders=NO_HOLDERS) is None
    # The holder is not "another node" to itself: a warm node that reads as loading (its model resident on one
    # card, the job placed on another) is not told to leave the job to itself.
    assert passes_over(needs_m, loading, node_id=warm.id, waited_seconds=5, affinity_seconds=30, holders=holders) is None
    # A job naming no model is never passed over, nor one whose models the holder does not hold all of.
    bare = best_placement(cold, Requirements(), MODELS)
    assert passes_over(Requirements(), bare, node_id=cold.id, waited_seconds=0, affinity_seconds=30, holders=holders) is None
    both = Requirements(models=("m", "n"))
    two = {**MODELS, "n": RegisteredModel(slug="n", vram_min_mb=4000)}
    assert passes_over(both, best_placement(cold, both, two), node_id=cold.id, waited_seconds=0, affinity_seconds=30,
                       holders=ModelHolders([warm], two)) is None  # fmt: skip


def test_only_a_node_that_could_start_the_job_now_holds_its_models():
    """A holder must be able to take the job with its models resident: online, the device not cordoned, the
    job's other requirements met (here a trust domain). Otherwise nobody is waited for."""
    needs_m = Requirements(models=("m",))
    warm = node(gpu("g0", 1.0, resident=[("m", 8000)]), name="warm")
    assert holds_models(warm, needs_m, MODELS)
    assert not holds_models(warm, Requirements(), MODELS)
    assert not holds_models(dataclasses.replace(warm, status="offline"), needs_m, MODELS)
    assert not holds_models(dataclasses.replace(warm, cordoned=frozenset({"g0"})), needs_m, MODELS)
    assert not holds_models(warm, Requirements(models=("m",), trust_domains=("vault",)), MODELS)
    assert not holds_models(node(gpu("g0", 1.0), gpu("g1", 1.0, resident=[("other", 8000)])), needs_m, MODELS)
    cold = node(gpu("g0", 1.0), name="cold")
    assert ModelHolders([warm], MODELS).elsewhere(cold.id, needs_m) and not ModelHolders([warm], MODELS).elsewhere(warm.id, needs_m)
    assert not ModelHolders([dataclasses.replace(warm, status="offline")], MODELS).elsewhere(cold.id, needs_m)


def test_claim_rank_puts_deferred_jobs_after_the_others_of_their_priority_only():
    from umbra.compute.claims import claim_rank

    load, hold = '["chat",{"models":["llama"]}]', '["chat",{"models":["m"]}]'
    page = [("a", 0, 1, load, 2.0), ("b", 0, 2, hold, 1.0), ("c", 1, 3, hold, 0.5), ("d", 0, 4, load, 90.0)]
    placed = {load: best_placement(node(gpu("g1", 1.0)), Requirements(models=("m",)), MODELS),
              hold: best_placement(node(gpu("g0", 1.0, resident=[("m", 8000)])), Requirements(models=("m",)), MODELS)}
    key = claim_rank(page, 30)(placed.get)
    assert sorted("abcd", key=key) == ["b", "d", "a", "c"]  # d waited past the affinity: in its place
    assert sorted("abcd", key=claim_rank(page, 0)(placed.get)) == ["a", "b", "d", "c"]  # off: queue order
