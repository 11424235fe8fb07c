"""Event types: a msgspec tagged union with explicit, permanent, versioned tags.

The ``tag`` of each class is what is stored in ``events.type``; renaming a class
never orphans stored rows, and a tag is never reused. New fields get defaults so
old rows still decode, and unknown fields written by a newer version are ignored
on read (stored events are never decoded with ``forbid_unknown_fields``).

The tag carries the type's schema version: version 1 is the bare name
(``job.failed``), a later one ends in ``.v<N>`` (:func:`event_version`). Within
a version a type changes only compatibly (a field added with a default). A
change old rows cannot be read as (a field renamed, retyped or given another
meaning) makes a new version: the struct takes the next tag, the old tag
leaves the union, and an upcast from the old version's stored form to the
next one's is registered in :data:`UPCASTS`. Stored rows are never rewritten;
:func:`decode_event` upcasts them as it reads them, so the folds only ever
meet the current versions. The API shows events as stored, never through
these types (``umbra.events.store.StoredEvent``): every field a writer
stored, a newer release's included, under the tag it was recorded with.

The value structs (devices, requirements, placements) live here too because
they are part of what the log stores; everything above this layer imports them.
"""

from __future__ import annotations

from datetime import datetime
import re
from typing import Annotated, Any, Callable, Literal, Union
from uuid import UUID

import msgspec

from . import documents

#: A moment an answer carries (sent as RFC 3339 in UTC, ``...Z``): the OpenAPI document describes it as
#: ``format: date-time``, as it does a request's. Only the description changes; encoding is the same.
Timestamp = Annotated[datetime, msgspec.Meta(tz=True)]
#: The same for an answer that holds the moment already written out (``umbra.api.nodes.rfc3339``).
TimestampText = Annotated[str, msgspec.Meta(extra_json_schema={"format": "date-time"})]

JobStatus = Literal["queued", "running", "blocked", "partial", "complete", "failed", "cancelled"]
JOB_STATUSES: tuple[str, ...] = JobStatus.__args__  # type: ignore[attr-defined]
TERMINAL_JOB_STATUSES = frozenset({"complete", "failed", "cancelled", "partial"})

NodeStatus = Literal["provisioning", "online", "offline", "draining", "retired"]
NODE_STATUSES: tuple[str, ...] = NodeStatus.__args__  # type: ignore[attr-defined]

DeviceKind = Literal["cpu", "gpu_integrated", "gpu_discrete"]


# -- values stored inside events ---------------------------------------------


class ResidentModel(msgspec.Struct, frozen=True, kw_only=True):
    slug: str
    vram_held_mb: int = 0


class Device(msgspec.Struct, frozen=True, kw_only=True):
    kind: DeviceKind
    label: str
    vram_total_mb: int = 0
    vram_free_mb: int = 0
    ram_total_mb: int = 0
    ram_free_mb: int = 0
    compute_units: int | None = None
    throughput_factor: float = 1.0
    accelerators: tuple[str, ...] = ()
    resident_models: tuple[ResidentModel, ...] = ()


class Requirements(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    vram_min_mb: int = 0
    ram_min_mb: int = 0
    models: tuple[str, ...] = ()
    trust_domains: tuple[str, ...] = ()
    accelerators: tuple[str, ...] = ()
    max_runtime_s: int | None = None
    #: Rank-only: a node to prefer when it is eligible (local affinity ×1.5).
    prefer_node: UUID | None = None


class Placement(msgspec.Struct, frozen=True, kw_only=True):
    node_id: UUID
    device_id: str
    device_kind: DeviceKind
    reason: str
    via: Literal["vram", "ram"] = "vram"
    resident: bool = False
    would_evict: tuple[str, ...] = ()
    score: float = 0.0
    estimated_seconds: float | None = None


# -- job stream events ---------------------------------------------------------


class _Event(msgspec.Struct, frozen=True, kw_only=True, tag_field="type"):
    pass


class JobSubmitted(_Event, tag="job.submitted"):
    kind: str
    priority: int
    max_attempts: int
    requires: Requirements = Requirements()
    payload: dict[str, Any] = {}
    project_id: UUID | None = None
    lang: str | None = None
    parent_job_id: UUID | None = None
    idempotency_key: str | None = None
    requested_by: str | None = None
    #: The jobs this one runs after (each must complete first); written once, here.
    depends_on: tuple[UUID, ...] = ()
    #: Not to run before this moment (a delayed submission): set aside until then (``JobBlocked.until``).
    not_before: datetime | None = None


class JobClaimed(_Event, tag="job.claimed"):
    attempt: int
    node_id: UUID
    placement: Placement
    lease_expires_at: datetime


class Progress(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """How far a running job is, as its holder last said: the fraction done (0 to 1) and a line for people
    ("epoch 4 of 10"). Either may be left out."""

    fraction: float | None = None
    message: str | None = None


class JobLeaseRenewed(_Event, tag="job.lease_renewed", omit_defaults=True):
    """The holder extended its lease; with ``progress``, it also said how far the job is (left out when it
    said nothing)."""

    attempt: int
    lease_expires_at: datetime
    progress: Progress | None = None


class JobCompleted(_Event, tag="job.completed"):
    attempt: int
    result: Any = None


class JobFailed(_Event, tag="job.failed"):
    """Terminal failure. ``reason`` says why it is final."""

    attempt: int
    error: str
    reason: Literal["not_retryable", "attempts_exhausted", "lease_expired", "blocked_timeout", "runtime_exceeded",
                    "dependency_failed"] = "not_retryable"


class JobRequeued(_Event, tag="job.requeued"):
    """A retryable failure: back to the queue after a backoff."""

    attempt: int
    error: str
    not_before: datetime


class JobLeaseExpired(_Event, tag="job.lease_expired"):
    """The holder's lease ended without a report; requeues or fails.

    ``cause`` says why: ``expired`` (the holder stopped renewing; appended by the
    sweeper) or ``node_revoked`` (an administrator revoked the holder's
    credentials, so it can never report: ended at once, not at expiry).
    """

    attempt: int
    node_id: UUID | None = None
    requeued: bool = True
    not_before: datetime | None = None
    cause: Literal["expired", "node_revoked"] = "expired"


class JobReleased(_Event, tag="job.released"):
    """The holder gave the job back unstarted (agent shutdown, client gone)."""

    attempt: int
    reason: str = "released"


class JobBlocked(_Event, tag="job.blocked", omit_defaults=True):
    """Set aside: no device could ever run it (``reason`` names the shortfall), it waits for the jobs it
    depends on (``waiting_on``: those not complete when it was set aside), or for its time (``until``: the
    ``not_before`` it was submitted with, after which the sweeper releases it)."""

    reason: str
    waiting_on: tuple[UUID, ...] = ()
    until: datetime | None = None


class JobUnblocked(_Event, tag="job.unblocked"):
    reason: str = "eligible_device_available"


class JobDecomposed(_Event, tag="job.decomposed"):
    attempt: int
    children: tuple[UUID, ...]


class JobSettled(_Event, tag="job.settled"):
    outcome: Literal["complete", "partial"]
    detail: str
    children_total: int
    children_failed: int


class JobCancelled(_Event, tag="job.cancelled"):
    by: str | None = None
    reason: str | None = None


class JobRetried(_Event, tag="job.retried"):
    """An operator sent a failed job back to the queue.

    ``max_attempts`` is its run budget from here on: the runs it was charged
    so far and those the retry grants; ``uncharged`` the claims up to the
    retry that were not charged, counted once, here (see
    ``umbra.domain.jobs.UnchargedEnds``). ``attempt`` (the fencing token) goes
    on counting from where it stood, so a report from a run before the failure
    still names a stale attempt. ``not_before`` is the one it was submitted
    with (a delayed submission), which the retried job keeps: one whose
    dependency failed before its time is retried still waiting for it.
    """

    attempt: int
    max_attempts: int
    uncharged: int = 0
    by: str | None = None
    not_before: datetime | None = None


class JobReprioritized(_Event, tag="job.reprioritized"):
    """Someone moved a waiting (queued or blocked) job to another priority: ``priority`` from here on,
    ``previous`` the one it replaced. Among the jobs of its new priority it keeps its submission order."""

    priority: int
    previous: int
    by: str | None = None


# -- node stream events --------------------------------------------------------


class NodeCreated(_Event, tag="node.created"):
    name: str
    trust_domain: str = "local"
    locality: str | None = None
    transport: str | None = None


class NodePaired(_Event, tag="node.paired"):
    credential_id: UUID
    agent_version: str | None = None
    devices: tuple[Device, ...] = ()


class NodeHeartbeat(_Event, tag="node.heartbeat"):
    """A heartbeat worth recording: the first, a change, or a periodic one."""

    agent_version: str | None = None
    devices: tuple[Device, ...] = ()
    #: Set when the agent reports a new process start; unchanged otherwise.
    agent_started_at: datetime | None = None
    #: The job kinds the agent takes (sorted), when it reports them; empty: it names none, so every
    #: kind; None: unchanged (older agents and events never report them: their nodes take every kind).
    kinds: tuple[str, ...] | None = None


class NodeWentOffline(_Event, tag="node.went_offline"):
    """An online node went offline: silent too long (appended by the sweeper), or its agent stopped
    on purpose and said so (``POST /v1/agent/offline``; the event's actor is the node)."""

    last_seen_at: datetime | None = None


class NodeDraining(_Event, tag="node.draining"):
    by: str | None = None


class NodeRetired(_Event, tag="node.retired"):
    by: str | None = None


class NodeDeviceCordoned(_Event, tag="node.device_cordoned"):
    """An operator took one device of the node out of service (by its label); the others go on."""

    device: str
    reason: str | None = None
    by: str | None = None


class NodeDeviceUncordoned(_Event, tag="node.device_uncordoned"):
    """The device takes work again."""

    device: str
    by: str | None = None


class NodeCredentialRevoked(_Event, tag="node.revoked"):
    credential_id: UUID | None = None
    by: str | None = None


JobEvent = Union[
    JobSubmitted,
    JobClaimed,
    JobLeaseRenewed,
    JobCompleted,
    JobFailed,
    JobRequeued,
    JobLeaseExpired,
    JobReleased,
    JobBlocked,
    JobUnblocked,
    JobDecomposed,
    JobSettled,
    JobCancelled,
    JobRetried,
    JobReprioritized,
]
NodeEvent = Union[
    NodeCreated,
    NodePaired,
    NodeHeartbeat,
    NodeWentOffline,
    NodeDraining,
    NodeRetired,
    NodeCredentialRevoked,
    NodeDeviceCordoned,
    NodeDeviceUncordoned,
]
Event = Union[JobEvent, NodeEvent]

EVENT_TYPES: dict[str, type] = {cls.__struct_config__.tag: cls for cls in Event.__args__}  # type: ignore[attr-defined]

_decoder = documents.decoder(Event)


def encode_event(event: Event) -> bytes:
    return documents.encode(event)


_VERSIONED_TAG = re.compile(r"^(?P<name>.+)\.v(?P<version>[2-9]|[1-9][0-9]+)$")


def event_version(tag: str) -> int:
    """The schema version a tag names: ``job.failed`` is 1, ``job.failed.v2`` is 2."""
    match = _VERSIONED_TAG.match(tag)
    return int(match["version"]) if match else 1


#: Superseded tag -> the upcast of its stored form (a dict, ``type`` included) to the next version's.
#: Applied in turn until the tag is a current one. Empty while every type is at its first version.
UPCASTS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {}


class UnknownEvent(msgspec.Struct, frozen=True):
    """A stored event this server cannot read: a type, or a field's value, from a newer writer.

    Unknown *fields* are ignored when an event is decoded; an unknown event
    type or value (a new failure reason, say) would fail the decoding, and
    with it every read of the log that pages over the event: the event API,
    the SSE stream (for ever, at that position), ``as_of`` and ``verify``.
    So it is read as this instead. The API shows it as stored, as it shows
    every event; the folds skip it (advancing the stream's version), so a view
    this server rebuilds lacks what it meant, and ``verify`` shows where.
    """

    type: str
    data: dict[str, Any]


def decode_event(data: bytes | str) -> Event | UnknownEvent:
    """Decode one stored event, upcast to its type's current version. Raises ``msgspec.DecodeError`` for what is not a JSON object.

    A current event decodes in one pass; only an event the union cannot read
    (a superseded version, or a newer writer's) is looked at again.
    """
    try:
        return documents.decode_stored(_decoder, data)  # an earlier release's over-long numbers read too
    except msgspec.ValidationError:
        raw = documents.decode(data)
        if not isinstance(raw, dict):
            raise
        stored, upcast = raw, False
        while isinstance(raw.get("type"), str) and raw["type"] in UPCASTS:
            raw, upcast = UPCASTS[raw["type"]](dict(raw)), True
        if upcast:
            try:
                return _decoder.decode(documents.encode(raw))
            except msgspec.ValidationError:
                pass  # upcast, yet still not readable: shown as stored
        return UnknownEvent(type=str(stored.get("type", "")), data=stored)


def to_builtins(event: Event) -> dict[str, Any]:
    return documents.to_builtins(event)
