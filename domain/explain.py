"""Explain: every device's answer for one job, from the rules that decide its claim.

A job waits for one of a few reasons: no device can take it now, it is not due
yet, or other jobs are ahead of it. :func:`survey` answers the first with the
claim's own functions: :func:`umbra.domain.placement.placements` ranks the
eligible devices with the claim's preference score and returns every other
device's verdict from :func:`umbra.domain.eligibility.judge_device`, so what a
person is told about a device is exactly what decided (or will decide) the
claim. Nothing here re-states a rule.

A node that reports no devices has no device to judge; it is listed once, with
the node-level rule it fails (status, trust domain, an unregistered model), or
not at all when it fails none: every listed reason is one of the rules' (API.md
lists them), never null. That rule is found by judging an *ideal* device, one
with every accelerator the job needs and unbounded memory, so only the rules
that do not depend on the device can fail.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, Literal, Mapping, Sequence
from uuid import UUID

import msgspec

from umbra.events.types import Device, Placement, Requirements, Timestamp

from .eligibility import NodeView, judge_device, required_accelerators, takes_kind
from .models import RegisteredModel
from .placement import ModelHolders, best_placement, placements

#: Memory of the ideal device used to find a device-less node's node-level reason.
_UNBOUNDED_MB = 2**62


class EligibleDevice(msgspec.Struct, kw_only=True):
    """A device that could take the job now, with the claim's preference score."""

    node_id: UUID
    node_name: str
    device_label: str
    device_kind: str
    via: Literal["vram", "ram"]
    score: float
    resident: bool
    would_evict: list[str]
    #: The placement reason the claim would record, e.g. ``placed:slow_path:ram_not_vram``.
    placement_reason: str
    estimated_seconds: float | None = None


class IneligibleDevice(msgspec.Struct, kw_only=True):
    """A device that cannot take the job now, and the first rule it fails.

    ``device_label`` is None for a node that reports no devices; its ``reason``
    is then the node-level rule it fails (a node that fails none is not listed).
    """

    node_id: UUID
    node_name: str
    device_label: str | None
    device_kind: str | None
    reason: str | None
    #: For memory reasons: MB the job needs and MB the device has on the path judged.
    needed_mb: int | None = None
    available_mb: int | None = None


class DependencyStatus(msgspec.Struct, kw_only=True):
    """A job another waits for, as ``explain`` finds it."""

    job_id: UUID
    status: str


class Explanation(msgspec.Struct, kw_only=True):
    """The answer of ``GET /v1/jobs/{id}/explain``."""

    job_id: UUID
    status: str
    eligible: list[EligibleDevice]
    ineligible: list[IneligibleDevice]
    summary: str
    #: The placement recorded by the job's last claim (running and finished jobs).
    placement: Placement | None = None
    placement_node_name: str | None = None
    #: For a blocked job: why nothing could ever run it, judged now.
    blocked_reason: str | None = None
    #: For a queued job: due jobs ahead of it in claim order that its eligible nodes would take first.
    ahead: int | None = None
    not_before: Timestamp | None = None
    #: For a job waiting for the jobs it depends on: each of them, in its order, with its status now.
    dependencies: list[DependencyStatus] | None = None


@dataclass(frozen=True, slots=True)
class QueueStanding:
    """Where a queued job stands, measured with the database clock."""

    #: Seconds until ``not_before`` (0 when the job is due).
    due_in_seconds: float = 0.0
    #: Due jobs ahead of it in claim order that one of its eligible nodes would take first.
    ahead: int = 0
    #: With model affinity: the nodes holding its models that the nodes which would load them leave it to
    #: (:func:`left_to_holders`), and for how many seconds more.
    left_to: tuple[str, ...] = ()
    left_for_seconds: float = 0.0


def left_to_holders(eligible: Sequence[EligibleDevice], requires: Requirements, *, waited_seconds: float,
                    affinity_seconds: float, holders: ModelHolders,
                    kind: str | None = None) -> tuple[tuple[str, ...], float]:  # fmt: skip
    """The nodes the job is left to for now, and for how long: with model affinity, when an eligible node whose
    best placement (its first in ``eligible``, which is best first) would load the job's models passes it over
    for another node that holds them (:func:`umbra.domain.placement.passes_over`, seen from the job), the
    nodes that hold them as the claims judge it (``holders``: as last reported, so a holder whose card its
    running jobs fill for now still counts, and only those whose agents take ``kind``). ``((), 0.0)`` when
    nothing is left. Judging holders from ``eligible`` instead told of a job every claim of the cold node
    passed over that nothing held it back."""
    if affinity_seconds <= 0 or not requires.models or waited_seconds >= affinity_seconds:
        return (), 0.0
    best: dict[UUID, EligibleDevice] = {}
    for device in eligible:
        best.setdefault(device.node_id, device)
    if not any(not device.resident and holders.elsewhere(node_id, requires, kind) for node_id, device in best.items()):
        return (), 0.0
    return tuple(node.name for node in holders.holding(requires, kind)), affinity_seconds - waited_seconds


def node_level_reason(node: NodeView, requires: Requirements, models: Mapping[str, RegisteredModel]) -> str | None:
    """The first rule ``node`` fails whatever device it had, or None."""
    ideal = Device(
        kind="cpu",
        label="",
        ram_total_mb=_UNBOUNDED_MB,
        ram_free_mb=_UNBOUNDED_MB,
        accelerators=tuple(sorted(required_accelerators(requires, models))),
    )
    return judge_device(node, ideal, requires, models).reason


def survey(
    nodes: Sequence[NodeView], requires: Requirements, models: Mapping[str, RegisteredModel]
) -> tuple[list[EligibleDevice], list[IneligibleDevice]]:
    """Every device of every node: the eligible ones best first, the others in node and device order."""
    ranked, refused = placements(nodes, requires, models)
    names = {node.id: node.name for node in nodes}
    eligible = [
        EligibleDevice(
            node_id=p.node_id, node_name=names[p.node_id], device_label=p.device_id, device_kind=p.device_kind,
            via=p.via, score=p.score, resident=p.resident, would_evict=list(p.would_evict),
            placement_reason=p.reason, estimated_seconds=p.estimated_seconds,
        )
        for p in ranked
    ]  # fmt: skip
    by_node: dict[UUID, list[IneligibleDevice]] = {}
    for v in refused:
        memory = v.reason in ("vram_insufficient", "ram_insufficient")
        by_node.setdefault(v.node_id, []).append(
            IneligibleDevice(
                node_id=v.node_id, node_name=v.node_name, device_label=v.device_label, device_kind=v.device_kind,
                reason=v.reason, needed_mb=v.needed_mb if memory else None,
                available_mb=v.available_mb if memory else None,
            )
        )  # fmt: skip
    ineligible: list[IneligibleDevice] = []
    for node in nodes:
        if node.devices:
            ineligible.extend(by_node.get(node.id, ()))
        elif (reason := node_level_reason(node, requires, models)) is not None:
            ineligible.append(IneligibleDevice(node_id=node.id, node_name=node.name, device_label=None,
                                               device_kind=None, reason=reason))  # fmt: skip
    return eligible, ineligible


def competing_ahead(
    shapes: Sequence[tuple[str, Requirements, int]],
    nodes: Sequence[NodeView],
    models: Mapping[str, RegisteredModel],
    kinds_taken: Mapping[UUID, Collection[str] | None] | None = None,
) -> int:
    """How many jobs ahead (``(kind, requirements, count)`` per shape) some node in ``nodes`` would claim first.

    A claiming node scans the queue in order and takes the first job it is
    eligible for, so a job ahead holds this one back only where a node that
    could run this one could run it too, and its agent takes that job's kind
    (``kinds_taken``, by node: the kinds its heartbeat reported; absent, every
    kind). Judged with the claim's own :func:`best_placement`, once per shape.
    """
    takes = kinds_taken or {}
    return sum(
        count for kind, requires, count in shapes
        if any(takes_kind(takes.get(node.id), kind) and best_placement(node, requires, models) for node in nodes)
    )  # fmt: skip
