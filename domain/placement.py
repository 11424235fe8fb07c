"""Preference: ranking the devices that are eligible for a job.

Ranking never decides *whether* a device may run a job (that is
:mod:`umbra.domain.eligibility`); it orders the ones that may. The score is the
device's ``throughput_factor``, discounted by what arriving costs: a resident
model beats a load (×0.7 when the job's models must be loaded) and a load beats
an eviction (×0.4 when somebody's warm model would be unloaded). A job that
names no model loads nothing and is not discounted. A job that prefers a node
(``requires.prefer_node``) scores ×1.5 there: local affinity.

Every placement carries a machine-readable reason, recorded in the claim event
so a queue shows which jobs run on the slow path and why:
``placed:<device kind>``, ``placed:slow_path:ram_not_vram``, and the same with
``local_affinity`` instead of ``placed`` on the preferred node.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Collection, Mapping, Sequence
from uuid import UUID

import msgspec

from umbra.events.types import Device, Placement, Requirements, ResidentModel

from .eligibility import UNIFIED_MEMORY_KINDS, NodeView, Verdict, judge_node, takes_kind
from .models import RegisteredModel

#: Score multiplier when the job's models must be loaded first.
LOAD_FACTOR = 0.7
#: Score multiplier when loading them would evict a resident model.
EVICT_FACTOR = 0.4
#: Score multiplier on the node the job prefers.
AFFINITY_FACTOR = 1.5


def score(verdict: Verdict, throughput_factor: float, requires: Requirements) -> float:
    value = throughput_factor
    if verdict.would_evict:
        value *= EVICT_FACTOR
    elif requires.models and not verdict.resident:
        value *= LOAD_FACTOR
    if requires.prefer_node is not None and verdict.node_id == requires.prefer_node:
        value *= AFFINITY_FACTOR
    return value


def reason(verdict: Verdict, requires: Requirements) -> str:
    prefix = "local_affinity" if requires.prefer_node is not None and verdict.node_id == requires.prefer_node else "placed"
    if verdict.slow_path:
        return f"{prefix}:slow_path:ram_not_vram"
    return f"{prefix}:{verdict.device_kind}"


def estimated_seconds(
    requires: Requirements, models: Mapping[str, RegisteredModel], verdict: Verdict, device: Device,
    loading: frozenset[tuple[str, str]] = frozenset(),
) -> float | None:
    """Seconds before the work can start: loading the models not already resident on ``device``
    (``loading``: those an earlier job of the same claim loads there, waited for too).

    ``None`` when nothing is known (no model named, or no load time registered
    for the models to load).
    """
    if verdict.resident or not requires.models:
        return 0.0 if verdict.resident else None
    resident = {m.slug for m in device.resident_models if (device.label, m.slug) not in loading}
    to_load = [models[slug] for slug in requires.models if slug in models and slug not in resident]
    known = [model.load_seconds for model in to_load if model.load_seconds]
    return float(sum(known)) if known else None


def placements(
    nodes: Sequence[NodeView], requires: Requirements, models: Mapping[str, RegisteredModel]
) -> tuple[list[Placement], list[Verdict]]:
    """Every eligible device as a :class:`Placement`, best first, and every ineligible verdict.

    Ties keep node order, then device order, so the ranking is deterministic.
    """
    eligible: list[tuple[float, int, Placement]] = []
    ineligible: list[Verdict] = []
    order = 0
    for node in nodes:
        for device, verdict in zip(node.devices, judge_node(node, requires, models)):
            order += 1
            if not verdict.eligible:
                ineligible.append(verdict)
                continue
            value = score(verdict, device.throughput_factor, requires)
            eligible.append(
                (
                    -value,
                    order,
                    Placement(
                        node_id=node.id,
                        device_id=device.label,
                        device_kind=device.kind,
                        reason=reason(verdict, requires),
                        via=verdict.via or "vram",
                        resident=verdict.resident,
                        would_evict=verdict.would_evict,
                        score=round(value, 6),
                        estimated_seconds=estimated_seconds(requires, models, verdict, device, node.loading),
                    ),
                )
            )
    eligible.sort(key=lambda item: (item[0], item[1]))
    return [placement for _, _, placement in eligible], ineligible


def best_placement(node: NodeView, requires: Requirements, models: Mapping[str, RegisteredModel]) -> Placement | None:
    """The best device of one node for the job, or ``None`` if no device is eligible."""
    ranked, _ = placements([node], requires, models)
    return ranked[0] if ranked else None


def defers(requires: Requirements, placement: Placement, *, waited_seconds: float, affinity_seconds: float) -> bool:
    """Model affinity: whether a node passes over this job for now, for one of the same priority whose
    models it holds.

    Loading a model costs a GPU seconds to minutes; in queue order a node with
    model A resident takes the next job for B and evicts A, while the node
    that holds B takes the next job for A, and the cards spend their time
    loading. With an affinity of ``affinity_seconds``, a job naming models
    that this node would have to load is claimed after the jobs of the same
    priority it can start at once (its models resident, or naming none), until
    it has been queued that long: a node that holds its models has that long
    to take it, and it never waits longer (delay scheduling, as Spark's
    locality wait). A node with nothing else to take takes it at once, unless
    another node holds the job's models (:func:`passes_over`).
    """
    return affinity_seconds > 0 and bool(requires.models) and not placement.resident and waited_seconds < affinity_seconds


def holds_models(node: NodeView, requires: Requirements, models: Mapping[str, RegisteredModel]) -> bool:
    """Whether ``node`` could start a job of ``requires`` now with every model it names resident on one
    eligible device: online, that device neither cordoned nor busy, the job's other requirements met."""
    return bool(requires.models) and any(placement.resident for placement in placements([node], requires, models)[0])


class ModelHolders:
    """The nodes that hold models (as last reported), asked which of them besides a claimer's could start a
    job with its models resident (:func:`holds_models`) and would take it: their agents take its kind
    (``kinds``, by node, as their heartbeats reported them; absent or None: every kind). Each answer is kept,
    for one claim's decisions."""

    def __init__(self, nodes: Sequence[NodeView], models: Mapping[str, RegisteredModel],
                 kinds: Mapping[UUID, Collection[str] | None] | None = None) -> None:  # fmt: skip
        self._nodes = nodes
        self._models = models
        self._kinds = kinds or {}
        self._holders: dict[Requirements, frozenset[UUID]] = {}

    @property
    def any(self) -> bool:
        """Whether any node holds a model asked about: without, no job is passed over."""
        return bool(self._nodes)

    def holding(self, requires: Requirements, kind: str | None = None) -> list[NodeView]:
        """The nodes that could start a job of ``requires`` with its models resident and whose agents take
        ``kind`` (None: any), in the order they were read: a holder without a handler for the job never claims it."""
        if not self._nodes or not requires.models:
            return []
        holders = self._holders.get(requires)
        if holders is None:
            holders = self._holders[requires] = frozenset(n.id for n in self._nodes if holds_models(n, requires, self._models))
        return [n for n in self._nodes if n.id in holders and (kind is None or takes_kind(self._kinds.get(n.id), kind))]

    def elsewhere(self, node_id: UUID, requires: Requirements, kind: str | None = None) -> bool:
        """Whether a node other than ``node_id`` holds the models of a job of ``requires`` and takes ``kind``
        (:meth:`holding`)."""
        return any(holder.id != node_id for holder in self.holding(requires, kind))


#: Nobody holds anything: a claim judges against this when affinity is off or it would load no model.
NO_HOLDERS = ModelHolders((), {})


def passes_over(requires: Requirements, placement: Placement, *, node_id: UUID, waited_seconds: float,
                affinity_seconds: float, holders: ModelHolders, kind: str | None = None) -> float | None:  # fmt: skip
    """Model affinity across nodes: the seconds for which ``node_id`` leaves this job alone even with nothing
    else to take, because another node holds its models; ``None`` when it may take it now.

    :func:`defers` only orders one node's choices, so a node with nothing
    else queued would take at once a job it must load a model for while an
    idle node beside it holds that model warm: a load (seconds to minutes of
    a GPU), often an eviction, for nothing. Such a job is left to the nodes
    that hold its models until it has waited the affinity; then any eligible
    node takes it, so no job waits longer than the affinity (Spark's locality
    wait, across machines). When no other node holds them there is nobody to
    leave it to, and the node takes it in the order :func:`defers` gives.
    """
    if not defers(requires, placement, waited_seconds=waited_seconds, affinity_seconds=affinity_seconds):
        return None
    if not holders.elsewhere(node_id, requires, kind):
        return None
    return affinity_seconds - waited_seconds


def takes_memory(requires: Requirements) -> bool:
    """Whether a job of ``requires`` takes memory where it is placed: a job that names no model and no
    floor takes none, however many of it one claim places on a device."""
    return bool(requires.models or requires.vram_min_mb or requires.ram_min_mb)


def after_placement(
    node: NodeView, placement: Placement, requires: Requirements, models: Mapping[str, RegisteredModel]
) -> NodeView:
    """``node`` as the next job of the same claim finds it: the placed job's memory taken, its models in use.

    A claim of several jobs (``?max=N``, a completion claiming the next N) judges
    them together against the memory the node last reported free; without
    this, one claim put two 16,000 MB jobs on one 24,000 MB card. On the
    memory it runs from, the job takes its models' floors (those not resident
    there already, which then are: a later job naming them shares them, as a
    resident model is not loaded twice, though it waits for the load too) and
    its own need beyond them; the models it would evict give theirs back. The
    models it runs on are in use: no later job of the claim evicts them. On a
    unified-memory device (``cpu``, ``gpu_integrated``) the memory is the
    node's system RAM, which every such device of the node reports: what one
    takes, none has, and an integrated GPU's VRAM (its share of that RAM) has
    no more free than the RAM has left, so a CPU job and a GPU job on an
    Apple silicon Mac cannot together ask for more than its RAM. Returns ``node`` itself when the job takes nothing (no
    requirement), so a claim of such jobs costs no second judgement.

    Claims made one after another are bounded by the jobs of earlier claims
    taken the same way (:func:`with_running_jobs`).
    """
    if not takes_memory(requires):
        return node  # the common no-op job: nothing to take, nothing to look up
    index = next((i for i, d in enumerate(node.devices) if d.label == placement.device_id), None)
    if index is None:
        return node
    device = node.devices[index]
    named = [models[slug] for slug in requires.models if slug in models]
    via_vram = placement.via == "vram"
    floors = [m.vram_min_mb if via_vram else m.ram_floor_mb for m in named]
    own = requires.vram_min_mb if via_vram else (requires.ram_min_mb or requires.vram_min_mb)
    kept = [m for m in device.resident_models if m.slug not in placement.would_evict]
    freed = sum(m.vram_held_mb for m in device.resident_models if m.slug in placement.would_evict)
    present = {m.slug for m in kept}
    loaded = [(m.slug, floor) for m, floor in zip(named, floors) if m.slug not in present]
    change = freed - sum(floor for _, floor in loaded) - max(0, own - sum(floors))  # MB given back (negative: taken)
    resident = (*kept, *(ResidentModel(slug=slug, vram_held_mb=floor) for slug, floor in loaded))
    system_ram = device.kind in UNIFIED_MEMORY_KINDS

    def after(d: Device, i: int) -> Device:
        vram, ram = d.vram_free_mb, d.ram_free_mb
        if i == index and via_vram:
            vram += change
        if system_ram and d.kind in UNIFIED_MEMORY_KINDS:
            ram += change
            if d.kind == "gpu_integrated":
                vram = min(vram, ram)  # its VRAM is that same RAM: never more free than the RAM has left
        if i == index:
            return msgspec.structs.replace(d, vram_free_mb=max(0, vram), ram_free_mb=max(0, ram), resident_models=resident)
        return msgspec.structs.replace(d, vram_free_mb=max(0, vram), ram_free_mb=max(0, ram)) if (vram, ram) != (d.vram_free_mb, d.ram_free_mb) else d

    return replace(
        node,
        devices=tuple(after(d, i) for i, d in enumerate(node.devices)),
        # Every model it names, registered or not: one removed from the registry while the job runs on it
        # (DELETE /v1/models) is still in use, and no later claim may evict it.
        in_use=node.in_use | {(device.label, slug) for slug in requires.models},
        loading=node.loading | {(device.label, slug) for slug, _ in loaded},
    )



@dataclass(frozen=True, slots=True)
class RunningJob:
    """A job a node is running that takes memory (:func:`takes_memory`): what it needs, and where it was placed."""

    requires: Requirements
    placement: Placement


def _without_jobs(node: NodeView) -> tuple[Device, ...]:
    """The node's devices with nothing running: their totals, less what the models they list resident hold
    (on unified memory, what those of every such device of the node hold; an integrated GPU's VRAM is that
    same RAM, so it has no more free than the RAM has)."""
    in_system_ram = sum(m.vram_held_mb for d in node.devices if d.kind in UNIFIED_MEMORY_KINDS for m in d.resident_models)

    def idle(d: Device) -> Device:
        vram = d.vram_total_mb - sum(m.vram_held_mb for m in d.resident_models)
        ram = d.ram_total_mb - (in_system_ram if d.kind in UNIFIED_MEMORY_KINDS else 0)
        if d.kind == "gpu_integrated":
            vram = min(vram, ram)
        return msgspec.structs.replace(d, vram_free_mb=max(0, vram), ram_free_mb=max(0, ram))

    return tuple(idle(d) for d in node.devices)


def with_running_jobs(node: NodeView, running: Sequence[RunningJob], models: Mapping[str, RegisteredModel]) -> NodeView:
    """``node`` as a claim must judge it: no device has more free than its running jobs leave of its total.

    A claim judges the memory the node last reported free, and a job claimed
    since that report is not in it: without this, a claim made after another
    (two agents on one node, or one agent's next claim before its next beat)
    found the first job's memory still free, and a 24,000 MB card took two
    16,000 MB jobs. So each device's free memory is the lesser of two bounds:
    what the report says, and what the running jobs leave of the device's
    total, each taking its memory as :func:`after_placement` takes that of an
    earlier job of one claim (a model's floor once per device, however many
    jobs share it). Once the report shows a job's memory taken, the report is
    the lower bound, so nothing is counted twice, and no report, however
    early, makes a running job's memory free again. Their models are in use (a
    claim never evicts a model a running job uses) and, if the report does not
    list them resident, being loaded: a job naming one shares it.

    The models the report lists resident hold their memory in the second
    bound too (a job may share one, or evict it as its claim said). What it
    cannot see: other memory outside the jobs (a driver's, a desktop's) is in
    the report only, so until the report shows a new job, the job's need is
    taken from the device's total less the listed models rather than from
    what was free; and a cancelled job is not running, though its agent
    learns of it only at its next renewal and a handler may run on after.
    """
    if not running:
        return node
    idle = replace(node, devices=_without_jobs(node), in_use=frozenset(), loading=frozenset())
    for job in running:
        idle = after_placement(idle, job.placement, job.requires, models)
    devices = []
    loading = set(node.loading)
    for reported, promised in zip(node.devices, idle.devices):
        listed = {m.slug for m in reported.resident_models}
        unlisted = tuple(m for m in promised.resident_models if m.slug not in listed)
        loading |= {(reported.label, m.slug) for m in unlisted}
        # A model a running job evicts (its placement's ``would_evict``) is gone from the bound, which counts
        # its memory free: it is not resident for a later job to share as well (its memory counted twice).
        kept_slugs = {m.slug for m in promised.resident_models}
        kept = tuple(m for m in reported.resident_models if m.slug in kept_slugs)
        vram, ram = min(reported.vram_free_mb, promised.vram_free_mb), min(reported.ram_free_mb, promised.ram_free_mb)
        if (vram, ram) == (reported.vram_free_mb, reported.ram_free_mb) and not unlisted and len(kept) == len(reported.resident_models):
            devices.append(reported)
        else:
            devices.append(msgspec.structs.replace(
                reported, vram_free_mb=vram, ram_free_mb=ram, resident_models=(*kept, *unlisted)
            ))  # fmt: skip
    return replace(node, devices=tuple(devices), in_use=node.in_use | idle.in_use, loading=frozenset(loading))
