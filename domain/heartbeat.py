"""Which heartbeats are worth an event: coalescing, decided without I/O.

A thousand nodes beating every 10 s would append 100 events a second that say
nothing. So a beat is recorded in the log only when it changes something the
scheduler or an operator acts on — the device set, resident models, the agent
version or process start, a status promotion — or when the last recorded beat
is older than the event interval. Every other beat only refreshes
``node_liveness`` (a measurement, outside the fold).

Free memory is a measurement that jitters on every beat. A change counts when
it crosses the busy line (a GPU's free VRAM reaching or leaving zero) or moves
by at least :data:`MEMORY_TOLERANCE_FRACTION` of the device's total (and at
least :data:`MEMORY_TOLERANCE_FLOOR_MB`), and the periodic beat re-anchors the
folded device set.

On a busy GPU fleet free memory moves past that tolerance whenever a job
starts, loads or ends, and a training job's memory can grow on every beat: a
beat whose only news is such a move is recorded at most once per
:data:`MEMORY_EVENT_SPACING_SECONDS` (a busy-line crossing at once). Nothing
placement judges is lost by it: claims, ``explain`` and the Node object read
the devices as last reported, kept at every beat, and memory freed between
recorded beats still wakes a parked claim (:func:`frees_memory`). The node's
history shows its memory at most that often, and at every other change.

A beat after a silence longer than the stale threshold ends an offline spell:
views read the node ``offline`` meanwhile (the effective status). When the
sweeper has not recorded that spell yet, the beat records it first, as
``node.went_offline`` with the last beat before the silence, and then its
return, as it does after a spell the sweeper recorded: the log alone explains
every status a view showed, however late the sweeper looks.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Iterable, Protocol

from msgspec.structs import replace

from umbra.events.types import Device, NodeHeartbeat, NodeWentOffline, ResidentModel

from .node_status import effective_status
from .nodes import PROMOTABLE, after_went_offline, is_busy

#: Free-memory moves smaller than this share of the total are jitter.
MEMORY_TOLERANCE_FRACTION = 0.02
#: ... and smaller than this many MB, whatever the total.
MEMORY_TOLERANCE_FLOOR_MB = 128

#: A beat that only moved free memory (not across the busy line) is recorded no sooner than this after the
#: last recorded beat (see the module's docstring).
MEMORY_EVENT_SPACING_SECONDS = 60

#: Reasons that change what could run where (blocked jobs deserve a second look).
CAPACITY_REASONS = frozenset({"devices", "memory", "models", "promotion"})


class HeartbeatBasis(Protocol):
    """What the decision needs to know about the node as last recorded."""

    status: str
    devices: tuple[Device, ...]
    agent_version: str | None
    agent_started_at: datetime | None
    #: ``recorded_at`` of the last ``node.heartbeat`` event, None before the first.
    last_heartbeat_at: datetime | None
    kinds: tuple[str, ...] | None
    #: The node stream's version (read only when a :class:`Silence` is judged).
    version: int


@dataclass(frozen=True, slots=True)
class HeartbeatReport:
    """One beat as the agent sent it. ``None`` means "not reported, unchanged"."""

    devices: tuple[Device, ...] | None = None
    agent_version: str | None = None
    agent_started_at: datetime | None = None
    #: The job kinds the agent takes (its handlers); empty: every kind; None: not reported (unchanged).
    kinds: tuple[str, ...] | None = None


@dataclass(frozen=True, slots=True)
class Silence:
    """The node's silence before this beat, as liveness measured it (the database clock)."""

    #: When the node was heard from before this beat; None: never.
    previous_seen_at: datetime | None
    #: When this beat was heard.
    seen_at: datetime
    stale_seconds: int
    #: The node's stream version read together with ``previous_seen_at``. A node event appended since
    #: (another beat after the same silence, the sweeper) has already answered for this silence.
    version: int

    def unrecorded_spell(self, current: HeartbeatBasis) -> NodeWentOffline | None:
        """The ``node.went_offline`` a view's ``offline`` reading calls for and the log lacks, or None.

        Views read a stored ``online`` silent past the threshold as ``offline``
        (:func:`umbra.domain.node_status.effective_status`, the same rule, judged
        when this beat was heard). Only a stored ``online`` still says nothing
        of the spell: a stored ``offline`` is the spell recorded, and intent
        statuses never expire.
        """
        if current.version != self.version or current.status != "online":
            return None
        if effective_status(current.status, self.previous_seen_at, self.seen_at, stale_seconds=self.stale_seconds) == "online":
            return None
        return NodeWentOffline(last_seen_at=self.previous_seen_at)


@dataclass(frozen=True, slots=True)
class HeartbeatDecision:
    event: NodeHeartbeat | None
    reasons: tuple[str, ...]
    #: An offline spell views showed and the log lacks, recorded before ``event``.
    went_offline: NodeWentOffline | None = None

    @property
    def changes_capacity(self) -> bool:
        return bool(CAPACITY_REASONS.intersection(self.reasons))


def normalize_devices(devices: Iterable[Device]) -> tuple[Device, ...]:
    """Devices in a canonical order: by label, accelerators and models sorted.

    Devices are identified by label within a node, so two reports listing the
    same devices in another order are the same set.
    """
    return tuple(
        replace(
            d,
            accelerators=tuple(sorted(set(d.accelerators))),
            resident_models=tuple(sorted(d.resident_models, key=lambda m: (m.slug, m.vram_held_mb))),
        )
        for d in sorted(devices, key=lambda d: d.label)
    )


def _shape(d: Device) -> tuple:
    return (d.kind, d.vram_total_mb, d.ram_total_mb, d.compute_units, d.throughput_factor, d.accelerators)


def _tolerance(total: int) -> float:
    return max(MEMORY_TOLERANCE_FLOOR_MB, total * MEMORY_TOLERANCE_FRACTION)


def _moved(old_free: int, new_free: int, total: int) -> bool:
    return abs(new_free - old_free) >= _tolerance(total)


def _models(d: Device) -> frozenset[str]:
    return frozenset(m.slug for m in d.resident_models)


def _held(models: tuple[ResidentModel, ...]) -> dict[str, int]:
    return {m.slug: m.vram_held_mb for m in models}


def _same_labels(old: Iterable[Device], new: Iterable[Device]) -> Iterable[tuple[Device, Device]]:
    before = {d.label: d for d in old}
    return ((before[d.label], d) for d in new if d.label in before)


def crosses_busy_line(old: tuple[Device, ...], new: tuple[Device, ...]) -> bool:
    """Whether a device of both sets became busy or stopped being busy (:func:`umbra.domain.nodes.is_busy`)."""
    return any(is_busy(a) != is_busy(b) for a, b in _same_labels(old, new))


def frees_memory(old: tuple[Device, ...], new: tuple[Device, ...]) -> bool:
    """Whether ``new`` has room ``old`` had not: a device stopped being busy, or its free VRAM or RAM grew by at
    least the tolerance. Between two consecutive reports, whether or not either was recorded: a claim parked
    because nothing fitted should look again."""
    return any(
        (is_busy(a) and not is_busy(b))
        or b.vram_free_mb - a.vram_free_mb >= _tolerance(b.vram_total_mb)
        or b.ram_free_mb - a.ram_free_mb >= _tolerance(b.ram_total_mb)
        for a, b in _same_labels(old, new)
    )


def device_changes(old: tuple[Device, ...], new: tuple[Device, ...]) -> set[str]:
    """The material differences between two normalized device sets.

    ``devices``: a device appeared, disappeared or changed kind, totals,
    accelerators or throughput; ``memory``: free memory crossed the busy line or
    moved beyond the tolerance, or the memory a resident model holds did;
    ``models``: resident models came or went.
    """
    before = {d.label: d for d in old}
    after = {d.label: d for d in new}
    changes: set[str] = set()
    if before.keys() != after.keys():
        changes.add("devices")
    for label in before.keys() & after.keys():
        a, b = before[label], after[label]
        if _shape(a) != _shape(b):
            changes.add("devices")
        if (
            is_busy(a) != is_busy(b)
            or _moved(a.vram_free_mb, b.vram_free_mb, b.vram_total_mb)
            or _moved(a.ram_free_mb, b.ram_free_mb, b.ram_total_mb)
        ):
            changes.add("memory")
        if _models(a) != _models(b):
            changes.add("models")
        else:
            held_a, held_b = _held(a.resident_models), _held(b.resident_models)
            memory = b.ram_total_mb if b.kind == "cpu" else b.vram_total_mb  # what a model there holds
            if any(_moved(held_a[s], held_b[s], memory) for s in held_a):
                changes.add("memory")
    return changes


def decide_heartbeat(
    current: HeartbeatBasis,
    report: HeartbeatReport,
    now: datetime,
    *,
    event_interval_seconds: int,
    silence: Silence | None = None,
) -> HeartbeatDecision:
    """The ``node.heartbeat`` event this beat deserves, or None (liveness only).

    The event always carries the full device set (the fold replaces it) and
    carries ``agent_started_at`` only when the agent reports a process start
    that differs from the recorded one, so a restart is recorded once, not
    every beat.

    ``silence``: when it holds an offline spell the log lacks, the decision
    records it first (``went_offline``) and the beat is then a promotion from
    ``offline``, recorded as after a spell the sweeper recorded.
    """
    went_offline = None if silence is None else silence.unrecorded_spell(current)
    status = after_went_offline(current.status) if went_offline is not None else current.status
    reasons: list[str] = ["silence"] if went_offline is not None else []
    devices = current.devices if report.devices is None else normalize_devices(report.devices)
    if report.devices is not None:
        reasons.extend(sorted(device_changes(current.devices, devices)))
    if report.agent_version is not None and report.agent_version != current.agent_version:
        reasons.append("agent_version")
    # Reported kinds replace the recorded ones; none named (an empty list) is every kind, stored as None.
    reported = None if report.kinds is None else tuple(sorted(set(report.kinds)))
    if reported is not None and (reported or None) != current.kinds:
        reasons.append("kinds")
    restarted = report.agent_started_at is not None and report.agent_started_at != current.agent_started_at
    if restarted:
        reasons.append("agent_restart")
    if status in PROMOTABLE:
        reasons.append("promotion")
    if current.last_heartbeat_at is None or now - current.last_heartbeat_at >= timedelta(seconds=event_interval_seconds):
        reasons.append("periodic")
    if not reasons or (reasons == ["memory"] and _memory_recorded_lately(current, devices, now)):
        return HeartbeatDecision(None, ())
    event = NodeHeartbeat(
        agent_version=report.agent_version if report.agent_version is not None else current.agent_version,
        devices=devices,
        agent_started_at=report.agent_started_at if restarted else None,
        kinds=reported if reported is not None else current.kinds,
    )
    return HeartbeatDecision(event, tuple(reasons), went_offline)


def _memory_recorded_lately(current: HeartbeatBasis, devices: tuple[Device, ...], now: datetime) -> bool:
    """Whether a beat that only moved free memory waits for the spacing (:data:`MEMORY_EVENT_SPACING_SECONDS`):
    a busy-line crossing does not, and neither does the first beat of a node."""
    return (
        current.last_heartbeat_at is not None
        and now - current.last_heartbeat_at < timedelta(seconds=MEMORY_EVENT_SPACING_SECONDS)
        and not crosses_busy_line(current.devices, devices)
    )
