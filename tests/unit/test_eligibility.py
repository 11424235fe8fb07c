"""Eligibility: one verdict per device, the first failing rule as its reason."""

from __future__ import annotations

import dataclasses
from uuid import uuid4

import msgspec
import pytest

from umbra.domain.eligibility import REASONS, NodeView, blocking_reason, judge_device, judge_node
from umbra.domain.models import RegisteredModel
from umbra.events.types import Device, Requirements, ResidentModel

GPU = Device(kind="gpu_discrete", label="gpu0", vram_total_mb=24576, vram_free_mb=20000, accelerators=("cuda",))
IGPU = Device(kind="gpu_integrated", label="igpu", vram_total_mb=4096, vram_free_mb=2000, ram_total_mb=32768,
              ram_free_mb=30000, accelerators=("metal",))  # fmt: skip
CPU = Device(kind="cpu", label="cpu", ram_total_mb=16384, ram_free_mb=12000)
GEMMA = RegisteredModel(slug="gemma", vram_min_mb=16000)
MODELS = {"gemma": GEMMA, "tiny": RegisteredModel(slug="tiny", vram_min_mb=1000, ram_min_mb=1500),
          "cudaonly": RegisteredModel(slug="cudaonly", vram_min_mb=100, requires_accelerators=("cuda",))}  # fmt: skip


def node(*devices: Device, status: str = "online", trust_domain: str = "local", name: str = "box") -> NodeView:
    return NodeView(id=uuid4(), name=name, status=status, trust_domain=trust_domain, devices=devices)


def judge(device: Device, registry=MODELS, status: str = "online", trust_domain: str = "local", **requires):
    return judge_device(node(device, status=status, trust_domain=trust_domain), device, Requirements(**requires), registry)


@pytest.mark.parametrize("status", ["offline", "provisioning", "draining", "retired"])
def test_a_node_that_is_not_online_is_ineligible_with_its_status(status):
    verdict = judge(GPU, status=status)
    assert (verdict.eligible, verdict.reason) == (False, f"node_{status}")
    assert verdict.reason in REASONS


def test_no_trust_domains_accepts_any_node_of_the_organization():
    assert judge(GPU, trust_domain="lab").eligible
    assert judge(GPU, trust_domain="lab", trust_domains=("lab", "local")).eligible
    assert judge(GPU, trust_domain="cloud", trust_domains=("local",)).reason == "trust_domain"


def test_an_unregistered_model_is_named_as_the_reason():
    assert judge(GPU, models=("nope",)).reason == "model_not_registered"


def test_accelerators_of_the_job_and_of_its_models_must_be_supported():
    assert judge(CPU, accelerators=("cuda",)).reason == "accelerator_missing"
    assert judge(IGPU, models=("cudaonly",)).reason == "accelerator_missing"
    assert judge(GPU, models=("cudaonly",)).eligible


def test_a_gpu_with_no_free_vram_is_busy_but_a_cpu_never_is():
    full = Device(kind="gpu_discrete", label="g", vram_total_mb=8000, vram_free_mb=0)
    assert judge(full).reason == "device_busy"
    assert judge(CPU).eligible  # a CPU reports no VRAM at all


def test_fitting_free_vram_runs_via_vram():
    verdict = judge(GPU, vram_min_mb=20000)
    assert (verdict.via, verdict.slow_path, verdict.reason) == ("vram", False, None)


def test_a_discrete_gpu_out_of_vram_is_not_eligible_even_with_ram_reported():
    gpu = Device(kind="gpu_discrete", label="g", vram_total_mb=8000, vram_free_mb=4000, ram_total_mb=64000, ram_free_mb=64000)
    verdict = judge(gpu, vram_min_mb=6000)
    assert (verdict.eligible, verdict.reason, verdict.needed_mb, verdict.available_mb) == (False, "vram_insufficient", 6000, 4000)


def test_a_unified_device_out_of_vram_falls_back_to_ram_the_slow_path():
    verdict = judge(IGPU, vram_min_mb=8000)
    assert (verdict.via, verdict.slow_path) == ("ram", True)
    assert judge(IGPU, vram_min_mb=8000, ram_min_mb=40000).reason == "ram_insufficient"


def test_a_cpu_is_eligible_whenever_ram_fits():
    assert judge(CPU).via == "ram"
    assert judge(CPU).slow_path is False  # nothing asked for VRAM
    assert judge(CPU, ram_min_mb=12000).eligible
    assert judge(CPU, ram_min_mb=12001).reason == "ram_insufficient"


def test_a_vram_floor_without_a_ram_floor_needs_that_much_ram_from_system_memory():
    small = Device(kind="cpu", label="cpu", ram_total_mb=8192, ram_free_mb=8000)
    assert judge(small, models=("gemma",)).reason == "ram_insufficient"  # 16000 MB VRAM floor stands in for RAM
    assert judge(CPU, models=("gemma",)).reason == "ram_insufficient"  # 12000 free < 16000
    roomy = Device(kind="cpu", label="cpu", ram_total_mb=32768, ram_free_mb=20000)
    assert judge(roomy, models=("gemma",)).via == "ram"
    # The job's own VRAM floor counts the same way when it gives no RAM floor.
    assert judge(small, vram_min_mb=9000).reason == "ram_insufficient"
    # A measured RAM floor is used as measured.
    assert judge(Device(kind="cpu", label="c", ram_total_mb=2048, ram_free_mb=1600), models=("tiny",)).eligible
    # A RAM floor of 0 is no measurement (as the reference reads it): the VRAM floor still stands in.
    zero = {"big": RegisteredModel(slug="big", vram_min_mb=16000, ram_min_mb=0)}
    assert judge(Device(kind="cpu", label="c", ram_total_mb=4000, ram_free_mb=3000), zero, models=("big",)).reason == "ram_insufficient"


def test_models_named_together_need_the_sum_of_their_floors():
    gpu = Device(kind="gpu_discrete", label="g", vram_total_mb=20000, vram_free_mb=16500)
    assert judge(gpu, models=("gemma",)).eligible
    assert judge(gpu, models=("gemma", "tiny")).reason == "vram_insufficient"


def test_a_resident_model_counts_toward_the_job_that_needs_it():
    warm = Device(kind="gpu_discrete", label="g", vram_total_mb=24576, vram_free_mb=4000,
                  resident_models=(ResidentModel(slug="gemma", vram_held_mb=17000),))  # fmt: skip
    verdict = judge(warm, models=("gemma",))
    assert (verdict.via, verdict.resident, verdict.would_evict) == ("vram", True, ())
    assert judge(warm, vram_min_mb=16000).reason == "vram_insufficient"  # the warm model is not this job's


def test_the_models_a_job_must_load_fit_in_free_memory_whatever_its_resident_ones_hold():
    """What a warm model holds above its floor is in use by it, not room for the job's other model."""
    pair = {"a": RegisteredModel(slug="a", vram_min_mb=4000), "b": RegisteredModel(slug="b", vram_min_mb=2000)}
    warm_a = Device(kind="gpu_discrete", label="g", vram_total_mb=8192, vram_free_mb=1000,
                    resident_models=(ResidentModel(slug="a", vram_held_mb=6000),))  # fmt: skip
    verdict = judge(warm_a, pair, models=("a", "b"))
    assert (verdict.reason, verdict.needed_mb, verdict.available_mb) == ("vram_insufficient", 2000, 1000)
    roomier = msgspec.structs.replace(warm_a, vram_free_mb=2000)
    assert judge(roomier, pair, models=("a", "b")).via == "vram"
    # The same on the RAM path of a unified device.
    ram_pair = {"a": RegisteredModel(slug="a", vram_min_mb=4000, ram_min_mb=4000),
                "b": RegisteredModel(slug="b", vram_min_mb=2000, ram_min_mb=2000)}  # fmt: skip
    cpu = Device(kind="cpu", label="c", ram_total_mb=16384, ram_free_mb=1500,
                 resident_models=(ResidentModel(slug="a", vram_held_mb=6000),))  # fmt: skip
    assert (judge(cpu, ram_pair, models=("a", "b")).reason, judge(cpu, ram_pair, models=("a",)).via) == ("ram_insufficient", "ram")


def test_loading_to_the_preferred_size_names_the_models_it_would_evict():
    preferring = {"big": RegisteredModel(slug="big", vram_min_mb=8000, vram_preferred_mb=14000)}
    crowded = Device(kind="gpu_discrete", label="g", vram_total_mb=24576, vram_free_mb=9000,
                     resident_models=(ResidentModel(slug="a", vram_held_mb=3000), ResidentModel(slug="b", vram_held_mb=9000)))  # fmt: skip
    verdict = judge(crowded, preferring, models=("big",))
    assert (verdict.eligible, verdict.would_evict) == (True, ("b",))  # the largest resident covers the 5000 MB shortfall
    roomy = Device(kind="gpu_discrete", label="g", vram_total_mb=24576, vram_free_mb=20000)
    assert judge(roomy, preferring, models=("big",)).would_evict == ()


def test_the_first_failing_rule_wins():
    assert judge(CPU, status="offline", models=("nope",), accelerators=("cuda",)).reason == "node_offline"
    assert judge(CPU, trust_domain="x", trust_domains=("y",), models=("nope",)).reason == "trust_domain"
    assert judge(CPU, models=("nope",), accelerators=("cuda",)).reason == "model_not_registered"
    full = Device(kind="gpu_discrete", label="g", vram_total_mb=8000, vram_free_mb=0)
    assert judge(full, accelerators=("cuda",)).reason == "accelerator_missing"


def test_judge_node_gives_one_verdict_per_device_in_order():
    box = node(GPU, CPU)
    verdicts = judge_node(box, Requirements(vram_min_mb=10000), MODELS)
    assert [(v.device_label, v.via, v.reason) for v in verdicts] == [("gpu0", "vram", None), ("cpu", "ram", None)]
    verdicts = judge_node(box, Requirements(vram_min_mb=22000), MODELS)
    assert [(v.device_label, v.reason) for v in verdicts] == [("gpu0", "vram_insufficient"), ("cpu", "ram_insufficient")]


# -- blocking: could anything *ever* run it? ----------------------------------------


def test_blocking_judges_device_totals_not_the_memory_free_right_now():
    busy = Device(kind="gpu_discrete", label="gpu0", vram_total_mb=24576, vram_free_mb=0, accelerators=("cuda",))
    assert blocking_reason(Requirements(vram_min_mb=20000), MODELS, [node(busy, status="offline")]) is None


def test_blocking_names_the_shortfall_and_the_largest_device():
    fleet = [node(GPU, name="gpu-box"), node(Device(kind="gpu_discrete", label="g", vram_total_mb=8192, vram_free_mb=8000), name="small")]
    reason = blocking_reason(Requirements(vram_min_mb=40000, ram_min_mb=1), MODELS, fleet)
    assert reason == "no_eligible_device: needs 40000 MB VRAM, largest is 24576 MB (gpu-box/gpu0)"
    with_cpu = [node(GPU, CPU, name="gpu-box")]
    reason = blocking_reason(Requirements(vram_min_mb=40000), MODELS, with_cpu)
    assert reason == ("no_eligible_device: needs 40000 MB VRAM, largest is 24576 MB (gpu-box/gpu0); "
                      "needs 40000 MB RAM, largest is 16384 MB (gpu-box/cpu)")  # fmt: skip


def test_blocking_on_an_unregistered_model_says_so():
    assert blocking_reason(Requirements(models=("gemma", "nope")), MODELS, [node(GPU)]) == "model_not_registered: nope"


def test_draining_and_retired_nodes_cannot_unblock_anything_but_offline_ones_can():
    needs_gpu = Requirements(accelerators=("cuda",))
    assert blocking_reason(needs_gpu, MODELS, [node(GPU, status="offline")]) is None
    assert blocking_reason(needs_gpu, MODELS, [node(GPU, status="provisioning")]) is None
    for status in ("draining", "retired"):
        assert blocking_reason(needs_gpu, MODELS, [node(GPU, status=status)]).startswith("no_eligible_device")


def test_an_empty_fleet_blocks_with_a_reason_and_other_shortfalls_are_named():
    assert blocking_reason(Requirements(), MODELS, []) == "no_eligible_device: no active node with devices is registered"
    assert "trust domain secure" in blocking_reason(Requirements(trust_domains=("secure",)), MODELS, [node(GPU)])
    assert "accelerator rocm" in blocking_reason(Requirements(accelerators=("rocm",)), MODELS, [node(GPU, CPU)])


def test_a_card_too_small_beside_a_device_lacking_the_accelerator_is_a_memory_shortfall_only():
    """The accelerator clause is said only when no allowed device has the accelerators: a CPU lacking CUDA next
    to a CUDA card too small is a size problem, and naming CUDA as missing would send the operator astray."""
    reason = blocking_reason(Requirements(vram_min_mb=40000, accelerators=("cuda",)), MODELS, [node(CPU, GPU)])
    assert reason == "no_eligible_device: needs 40000 MB VRAM, largest is 24576 MB (box/gpu0)"
    assert blocking_reason(Requirements(accelerators=("rocm",)), MODELS, [node(CPU, GPU)]) == (
        "no_eligible_device: needs accelerator rocm, which no eligible device supports")


def test_a_device_outside_the_jobs_trust_domains_that_would_fit_is_named():
    """When widening the trust domains would let the job run, the reason says which device and where it is; a
    device outside them that would not fit either is not named (widening would not help)."""
    big = msgspec.structs.replace(GPU, vram_total_mb=49152, vram_free_mb=48000)
    fleet = [node(big, name="local-box"), node(GPU, name="vault", trust_domain="secure")]
    assert blocking_reason(Requirements(vram_min_mb=40000, trust_domains=("secure",)), MODELS, fleet) == (
        "no_eligible_device: needs 40000 MB VRAM, largest is 24576 MB (vault/gpu0); "
        "local-box/gpu0 would fit but is outside trust domain secure (in local)")  # fmt: skip
    assert blocking_reason(Requirements(vram_min_mb=60000, trust_domains=("secure",)), MODELS, fleet) == (
        "no_eligible_device: needs 60000 MB VRAM, largest is 24576 MB (vault/gpu0)")
    cpu_vault = [node(CPU, GPU, name="local-box"), node(CPU, name="vault", trust_domain="secure")]
    assert blocking_reason(Requirements(accelerators=("cuda",), trust_domains=("secure",)), MODELS, cpu_vault) == (
        "no_eligible_device: needs accelerator cuda, which no eligible device supports; "
        "local-box/gpu0 would fit but is outside trust domain secure (in local)")  # fmt: skip
    assert blocking_reason(Requirements(trust_domains=("secure",)), MODELS, [node(GPU)]) == (
        "no_eligible_device: no node in trust domain secure")


def test_a_cordoned_device_is_ineligible_and_the_nodes_others_are_not():
    """A cordoned GPU fails ``device_cordoned`` before any capability or memory rule; the CPU beside it is judged
    as ever."""
    box = NodeView(id=uuid4(), name="box", status="online", trust_domain="local", devices=(GPU, CPU), cordoned=frozenset({"gpu0"}))
    gpu, cpu = judge_node(box, Requirements(ram_min_mb=1000), MODELS)
    assert (gpu.eligible, gpu.reason, cpu.eligible) == (False, "device_cordoned", True)
    assert "device_cordoned" in REASONS


def test_a_job_only_a_cordoned_device_could_run_is_blocked_naming_it():
    """Blocking judges the fleet as it may take work: a CUDA job whose only CUDA card is cordoned is blocked,
    and the reason says that card would fit; with the card back, nothing blocks it."""
    cordoned = NodeView(id=uuid4(), name="box", status="online", trust_domain="local", devices=(GPU, CPU),
                        cordoned=frozenset({"gpu0"}))  # fmt: skip
    needs_cuda = Requirements(vram_min_mb=16000, accelerators=("cuda",))
    reason = blocking_reason(needs_cuda, MODELS, [cordoned])
    assert reason is not None and "box/gpu0 would fit but is cordoned" in reason, reason
    assert blocking_reason(needs_cuda, MODELS, [node(GPU, CPU)]) is None
    too_big = Requirements(vram_min_mb=40000, accelerators=("cuda",))
    # It would not fit the card anyway: the reason is the fleet's shortfall, as with the card in service.
    assert blocking_reason(too_big, MODELS, [cordoned]) == blocking_reason(too_big, MODELS, [node(GPU, CPU)])
    assert "needs 40000 MB VRAM" in blocking_reason(too_big, MODELS, [cordoned])


def test_a_blocked_reason_never_offers_a_cordoned_device_as_the_fix():
    """A job for trust domain ``secure``, whose node's card is too small; the card that would fit is in
    ``local`` and cordoned: widening the trust domains would not run it, so the reason does not say so."""
    vault = NodeView(id=uuid4(), name="vault", status="online", trust_domain="secure",
                     devices=(msgspec.structs.replace(GPU, vram_total_mb=8192, vram_free_mb=8000),))  # fmt: skip
    local = NodeView(id=uuid4(), name="box", status="online", trust_domain="local", devices=(GPU,), cordoned=frozenset({"gpu0"}))
    needs = Requirements(vram_min_mb=16000, accelerators=("cuda",), trust_domains=("secure",))
    reason = blocking_reason(needs, MODELS, [vault, local])
    assert reason is not None and "outside trust domain" not in reason and "largest is 8192 MB" in reason, reason
    in_service = blocking_reason(needs, MODELS, [vault, dataclasses.replace(local, cordoned=frozenset())])
    assert "box/gpu0 would fit but is outside trust domain secure" in in_service, in_service
