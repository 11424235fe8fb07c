"""Eligibility: can this device run this job at all, and from which memory?

Eligibility is a yes/no per device and says nothing about speed; ranking the
eligible devices is :mod:`umbra.domain.placement`. Keeping the questions apart
is the point: a CPU is slow, not incapable, so a model that fits its RAM runs
there instead of not running at all, while a device that is too small is never
offered the work.

:func:`judge_device` returns a :class:`Verdict` carrying either the memory the
job would run from (``via`` = ``vram`` or ``ram``) or the *first* rule the
device fails, as one of :data:`REASONS`. The claim path and the explain view
call the same function, so what a job is told about a device is what decided
its claim. Rules, in the order they are checked:

1. the node is effectively ``online`` (``node_offline``, ``node_provisioning``,
   ``node_draining``, ``node_retired``);
2. the node's trust domain is one the job allows (``trust_domain``). A job
   naming no trust domains accepts every node of its organization: nodes are
   already the organization's own, and ``trust_domains`` narrows further when
   the submitter asks;
3. an operator has not taken the device out of service (``device_cordoned``:
   a GPU throwing ECC errors is cordoned alone, while the node's other devices
   go on working);
4. every model the job names is registered (``model_not_registered``);
5. the device supports every accelerator the job and its models require
   (``accelerator_missing``);
6. a non-CPU device with no free VRAM is busy (``device_busy``): a resident
   model holds its memory whether or not it is generating;
7. memory: the job fits the VRAM available to it → ``via vram`` (never on a
   ``cpu`` device, which has none); else, on a unified-memory device (``cpu``,
   ``gpu_integrated``), it fits the RAM available to it → ``via ram``, the
   slow path. A discrete GPU out of VRAM is *not* eligible: the work would
   really run on the CPU, which is its own device (``vram_insufficient``); a
   unified device that fits neither fails ``ram_insufficient``.

Memory arithmetic. The VRAM a job needs is the larger of its own
``vram_min_mb`` and the sum of its models' VRAM floors (a job naming two models
holds both). The RAM it needs is the larger of its ``ram_min_mb`` and the sum
of its models' RAM floors, where a model (or a job) with a VRAM floor but no
RAM floor needs at least its VRAM floor in RAM: its size does not shrink on the
processor, and "no RAM floor measured" must not read as "any RAM will do". The
memory available to a job is the device's free memory plus what the job's own
models already hold there (a resident model is not loaded twice); and the
models it must still load must fit in the free memory alone, for what a
resident model holds, however far above its floor, is in use by that model.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Collection, Literal, Mapping, Sequence
from uuid import UUID

import msgspec

from umbra.events.types import Device, Requirements

from .models import RegisteredModel
from .nodes import is_busy

#: Every reason a device can be ineligible, as the explain view reports them.
REASONS = (
    "node_offline",
    "node_provisioning",
    "node_draining",
    "node_retired",
    "trust_domain",
    "accelerator_missing",
    "vram_insufficient",
    "ram_insufficient",
    "device_busy",
    "model_not_registered",
    "device_cordoned",
)

#: Devices whose memory *is* system RAM.
UNIFIED_MEMORY_KINDS = frozenset({"cpu", "gpu_integrated"})

#: Node statuses that take no new work even if the node is reachable.
NOT_ACCEPTING = frozenset({"draining", "retired"})


@dataclass(frozen=True, slots=True)
class NodeView:
    """What eligibility needs to know about a node. ``status`` is the *effective* status."""

    id: UUID
    name: str
    status: str
    trust_domain: str
    devices: tuple[Device, ...]
    #: (device label, model) pairs that jobs placed earlier in the same claim run on (never evicted for a
    #: later one), and of those, the ones they load (resident for memory, but not loaded yet: a later job
    #: waits for them too). See :func:`umbra.domain.placement.after_placement`.
    in_use: frozenset[tuple[str, str]] = frozenset()
    loading: frozenset[tuple[str, str]] = frozenset()
    #: Labels of the devices an operator took out of service (``node.device_cordoned``).
    cordoned: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True)
class Verdict:
    """One device's answer for one job: ``via`` when eligible, else ``reason``."""

    node_id: UUID
    node_name: str
    device_label: str
    device_kind: str
    via: Literal["vram", "ram"] | None = None
    reason: str | None = None
    #: Every model the job names is already resident on this device.
    resident: bool = False
    #: Resident models that would be unloaded to give the job's models their preferred memory.
    would_evict: tuple[str, ...] = ()
    #: True when the job states a VRAM need but runs from system RAM.
    slow_path: bool = False
    #: For memory verdicts: MB needed and MB available on the path judged.
    needed_mb: int = 0
    available_mb: int = 0

    @property
    def eligible(self) -> bool:
        return self.via is not None


def vram_needed(requires: Requirements, models: Mapping[str, RegisteredModel]) -> int:
    return max(requires.vram_min_mb, sum(models[slug].vram_min_mb for slug in requires.models if slug in models))


def ram_needed(requires: Requirements, models: Mapping[str, RegisteredModel]) -> int:
    own = requires.ram_min_mb or requires.vram_min_mb
    return max(own, sum(models[slug].ram_floor_mb for slug in requires.models if slug in models))


def required_accelerators(requires: Requirements, models: Mapping[str, RegisteredModel]) -> frozenset[str]:
    wanted = set(requires.accelerators)
    for slug in requires.models:
        if slug in models:
            wanted.update(models[slug].requires_accelerators)
    return frozenset(wanted)


def missing_models(requires: Requirements, models: Mapping[str, RegisteredModel]) -> tuple[str, ...]:
    return tuple(slug for slug in requires.models if slug not in models)


def takes_kind(kinds: Collection[str] | None, kind: str) -> bool:
    """Whether a claimer that takes ``kinds`` (``None``: it named none, so every kind) may take a job of ``kind``.

    A claim names the kinds its agent has handlers for; kinds are not part of
    eligibility (a device either could run the job or not), only of whose
    claims may take it.
    """
    return kinds is None or kind in kinds


def judge_device(
    node: NodeView, device: Device, requires: Requirements, models: Mapping[str, RegisteredModel]
) -> Verdict:
    """Apply the rules in order; the first failure is the verdict's ``reason``."""
    base = Verdict(node_id=node.id, node_name=node.name, device_label=device.label, device_kind=device.kind)
    if node.status != "online":
        return replace(base, reason=f"node_{node.status}")
    if requires.trust_domains and node.trust_domain not in requires.trust_domains:
        return replace(base, reason="trust_domain")
    if device.label in node.cordoned:
        return replace(base, reason="device_cordoned")
    if missing_models(requires, models):
        return replace(base, reason="model_not_registered")
    if not required_accelerators(requires, models) <= set(device.accelerators):
        return replace(base, reason="accelerator_missing")
    if is_busy(device):
        return replace(base, reason="device_busy")

    resident_here = {m.slug: m.vram_held_mb for m in device.resident_models}
    held = sum(resident_here.get(slug, 0) for slug in requires.models)
    resident = bool(requires.models) and all(slug in resident_here and (device.label, slug) not in node.loading for slug in requires.models)
    to_load = [models[slug] for slug in requires.models if slug not in resident_here]

    vram_need = vram_needed(requires, models)
    vram_available = device.vram_free_mb + held
    vram_short = _shortfall(vram_need, vram_available, sum(m.vram_min_mb for m in to_load), device.vram_free_mb)
    if device.kind != "cpu" and vram_short is None:
        wanted = sum(max(m.vram_preferred_mb or 0, m.vram_min_mb) for m in to_load)
        return replace(
            base,
            via="vram",
            resident=resident,
            would_evict=_evictions(device, requires, wanted - device.vram_free_mb, node.in_use),
            needed_mb=vram_need,
            available_mb=vram_available,
        )
    ram_need = ram_needed(requires, models)
    ram_available = device.ram_free_mb + held
    ram_short = _shortfall(ram_need, ram_available, sum(m.ram_floor_mb for m in to_load), device.ram_free_mb)
    if device.kind in UNIFIED_MEMORY_KINDS and ram_short is None:
        wanted = sum(m.ram_floor_mb for m in to_load)
        return replace(
            base,
            via="ram",
            resident=resident,
            would_evict=_evictions(device, requires, wanted - device.ram_free_mb, node.in_use),
            slow_path=vram_need > 0,
            needed_mb=ram_need,
            available_mb=ram_available,
        )
    if device.kind == "gpu_discrete":
        needed, available = vram_short or (vram_need, vram_available)
        return replace(base, reason="vram_insufficient", needed_mb=needed, available_mb=available)
    needed, available = ram_short or (ram_need, ram_available)
    return replace(base, reason="ram_insufficient", needed_mb=needed, available_mb=available)


def _shortfall(need: int, available: int, to_load: int, free: int) -> tuple[int, int] | None:
    """``None`` when the job fits one memory, else the (needed, available) MB of the first test it fails:
    everything it needs against what is free plus what its resident models hold, then the models it must
    load against what is free."""
    if available < need:
        return need, available
    if free < to_load:
        return to_load, free
    return None


def _evictions(device: Device, requires: Requirements, shortfall_mb: int, in_use: frozenset[tuple[str, str]]) -> tuple[str, ...]:
    """Resident models (not the job's own, nor one another job of the claim runs on) to unload, largest first,
    to cover the shortfall."""
    if shortfall_mb <= 0:
        return ()
    others = sorted(
        (m for m in device.resident_models if m.slug not in requires.models and (device.label, m.slug) not in in_use),
        key=lambda m: (-m.vram_held_mb, m.slug),
    )
    chosen: list[str] = []
    freed = 0
    for model in others:
        if freed >= shortfall_mb:
            break
        chosen.append(model.slug)
        freed += model.vram_held_mb
    return tuple(sorted(chosen))


def in_service(node: NodeView) -> bool:
    """Whether one of the node's devices may take work now: neither cordoned nor busy (the node's own
    status aside)."""
    return any(not is_busy(d) and d.label not in node.cordoned for d in node.devices)


def is_schedulable(node: NodeView) -> bool:
    """Effectively online, with a device that may take work now (:func:`in_service`)."""
    return node.status == "online" and in_service(node)


def judge_node(node: NodeView, requires: Requirements, models: Mapping[str, RegisteredModel]) -> list[Verdict]:
    """Verdicts for every device of ``node``, in the node's device order."""
    return [judge_device(node, device, requires, models) for device in node.devices]


def at_capacity(node: NodeView) -> NodeView:
    """The node as if online and idle: every device's memory free, nothing resident.

    Blocking asks whether a job could *ever* run, so it judges against device
    totals and capabilities rather than the memory free at this moment.
    """
    devices = tuple(
        msgspec.structs.replace(d, vram_free_mb=d.vram_total_mb, ram_free_mb=d.ram_total_mb, resident_models=())
        for d in node.devices
    )
    return NodeView(id=node.id, name=node.name, status="online", trust_domain=node.trust_domain, devices=devices,
                    cordoned=node.cordoned)  # fmt: skip


def blocking_reason(
    requires: Requirements, models: Mapping[str, RegisteredModel], nodes: Sequence[NodeView]
) -> str | None:
    """Why no registered device could ever run the job, or ``None`` if one could.

    Judged against every node that may take new work in future (not draining or
    retired), as if it were online and idle. The reason names the shortfall so a
    person can act on it, e.g. ``no_eligible_device: needs 40000 MB VRAM,
    largest is 24576 MB (gpu-box/gpu0)``, and when a device outside the job's
    trust domains could run it, names that too (``...; big-box/gpu0 would fit
    but is outside trust domain secure (in local)``): the fix is then to widen
    the job's trust domains or move that node, not to buy a bigger card.
    """
    missing = missing_models(requires, models)
    if missing:
        return f"model_not_registered: {', '.join(missing)}"
    candidates = [at_capacity(node) for node in nodes if node.status not in NOT_ACCEPTING]
    if not any(node.devices for node in candidates):
        return "no_eligible_device: no active node with devices is registered"
    verdicts = [v for node in candidates for v in judge_node(node, requires, models)]
    if any(v.eligible for v in verdicts):
        return None
    back = _fits_if_uncordoned(requires, models, candidates)
    if back is not None:
        return f"no_eligible_device: {back}"
    fleet = candidates
    if any(node.cordoned for node in candidates):  # the cordons change nothing: say what the whole fleet lacks
        candidates = [replace(node, cordoned=frozenset()) for node in candidates]
        verdicts = [v for node in candidates for v in judge_node(node, requires, models)]
    return "no_eligible_device: " + "; ".join(_shortfalls(requires, models, candidates, verdicts, fleet=fleet))


def _shortfalls(
    requires: Requirements, models: Mapping[str, RegisteredModel], nodes: Sequence[NodeView], verdicts: Sequence[Verdict],
    *, fleet: Sequence[NodeView],
) -> list[str]:
    """The clauses of a blocking reason, each true of the devices the job's trust domains allow. ``nodes`` are
    judged for what they lack (their cordons set aside when those change nothing), ``fleet`` as it stands for
    a device outside the trust domains that could run the job: a cordoned one could not.

    Memory clauses name the largest such device; the accelerator clause is
    said only when none of them has the accelerators (a CPU lacking CUDA
    beside a CUDA card too small is a memory shortfall, not a missing
    accelerator); a device outside the trust domains that could run the job
    is named last.
    """
    reasons = {v.reason for v in verdicts}
    clauses: list[str] = []
    if reasons == {"trust_domain"}:
        return [f"no node in trust domain {', '.join(requires.trust_domains)}"]
    devices = {(n.name, d.label): d for n in nodes for d in n.devices}
    allowed = [v for v in verdicts if v.reason != "trust_domain"]
    if "vram_insufficient" in reasons or "ram_insufficient" in reasons:
        memory = [v for v in verdicts if v.reason in ("vram_insufficient", "ram_insufficient")]
        gpus = [v for v in memory if v.device_kind != "cpu"]
        if gpus:
            best = max(gpus, key=lambda v: devices[(v.node_name, v.device_label)].vram_total_mb)
            largest = devices[(best.node_name, best.device_label)].vram_total_mb
            clauses.append(
                f"needs {vram_needed(requires, models)} MB VRAM, largest is {largest} MB "
                f"({best.node_name}/{best.device_label})"
            )
        unified = [v for v in memory if v.device_kind in UNIFIED_MEMORY_KINDS]
        if unified:
            best = max(unified, key=lambda v: devices[(v.node_name, v.device_label)].ram_total_mb)
            largest = devices[(best.node_name, best.device_label)].ram_total_mb
            clauses.append(
                f"needs {ram_needed(requires, models)} MB RAM, largest is {largest} MB "
                f"({best.node_name}/{best.device_label})"
            )
    wanted = required_accelerators(requires, models)
    if "accelerator_missing" in reasons and not any(
        wanted <= set(devices[(v.node_name, v.device_label)].accelerators) for v in allowed
    ):
        clauses.append(f"needs accelerator {', '.join(sorted(wanted))}, which no eligible device supports")
    if "device_busy" in reasons:
        clauses.append("some GPUs report no VRAM at all")
    if "trust_domain" in reasons and not clauses:
        clauses.append(f"no node in trust domain {', '.join(requires.trust_domains)}")
    if "trust_domain" in reasons:
        outside = _fits_outside_trust_domains(requires, models, fleet)
        if outside is not None:
            clauses.append(outside)
    return clauses


def _fits_if_uncordoned(requires: Requirements, models: Mapping[str, RegisteredModel], nodes: Sequence[NodeView]) -> str | None:
    """A clause naming the first cordoned device that could run the job if it were put back in service: then
    that is what the job waits for, not a bigger card."""
    for node in nodes:
        if not node.cordoned:
            continue
        for verdict in judge_node(replace(node, cordoned=frozenset()), requires, models):
            if verdict.eligible and verdict.device_label in node.cordoned:
                return f"{node.name}/{verdict.device_label} would fit but is cordoned"
    return None


def _fits_outside_trust_domains(
    requires: Requirements, models: Mapping[str, RegisteredModel], nodes: Sequence[NodeView]
) -> str | None:
    """A clause naming the first device outside the job's trust domains that could run it, or None."""
    anywhere = msgspec.structs.replace(requires, trust_domains=())
    for node in nodes:
        if node.trust_domain in requires.trust_domains:
            continue
        for verdict in judge_node(node, anywhere, models):
            if verdict.eligible:
                return (
                    f"{node.name}/{verdict.device_label} would fit but is outside trust domain "
                    f"{', '.join(requires.trust_domains)} (in {node.trust_domain})"
                )
    return None
