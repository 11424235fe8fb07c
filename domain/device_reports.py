"""A device as an agent reports it (``POST /v1/agent/heartbeat``, pairing) and the limits it is held to.

One definition for both ends: the server decodes heartbeats with it, and the
reference agent checks its ``--device`` overrides with it at start, so an
override the server would refuse (a typo'd field, an empty label, a negative
size) stops the agent at once instead of every heartbeat being refused 422
for as long as it runs. It needs nothing but msgspec, which an agent has.
"""

from __future__ import annotations

from typing import Annotated, Iterable, Literal

import msgspec
from msgspec import Meta

from umbra.events.types import Device, ResidentModel

Megabytes = Annotated[int, Meta(ge=0, le=2**31 - 1)]
#: Longest device label (and model slug) a report may carry.
LABEL_MAX = 200
Label = Annotated[str, Meta(min_length=1, max_length=LABEL_MAX)]
Word = Annotated[str, Meta(min_length=1, max_length=100)]
#: Most devices one node reports.
MAX_DEVICES = 256
#: Most resident models one device reports.
MAX_RESIDENT_MODELS = 256


class ResidentModelReport(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    slug: Label
    vram_held_mb: Megabytes = 0


class DeviceReport(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A device as an agent reports it; identified by ``label`` within its node."""

    kind: Literal["cpu", "gpu_integrated", "gpu_discrete"]
    label: Label
    vram_total_mb: Megabytes = 0
    vram_free_mb: Megabytes = 0
    ram_total_mb: Megabytes = 0
    ram_free_mb: Megabytes = 0
    compute_units: Annotated[int, Meta(ge=0)] | None = None
    throughput_factor: Annotated[float, Meta(gt=0, le=1e6)] = 1.0
    accelerators: Annotated[list[Word], Meta(max_length=32)] = []
    resident_models: Annotated[list[ResidentModelReport], Meta(max_length=MAX_RESIDENT_MODELS)] = []

    def __post_init__(self) -> None:
        """Refuse a device saying it has more free memory than the total it reports: claims judge free
        memory, blocking judges totals, and a 24,576 MB card saying 30,000 MB free was given a 28,000 MB job.
        A total left out (0, the default) says nothing to contradict. The message starts with the field, in
        backquotes, which the server's refusal names (``umbra.api.http.read_json``)."""
        for free, total in (("vram_free_mb", "vram_total_mb"), ("ram_free_mb", "ram_total_mb")):
            if getattr(self, total) and getattr(self, free) > getattr(self, total):
                raise ValueError(f"`{free}`: {getattr(self, free)} MB free is more than the device's {total} "
                                 f"({getattr(self, total)} MB).")


def as_device(report: DeviceReport) -> Device:
    """The reported device as the stored value the node's events carry.

    A total left out (0) while memory is free is taken as that free memory: blocking judges totals and
    claims judge what is free, so such a card read as having no VRAM for the one (a job only it could run
    was blocked) and as having it for the other."""
    return Device(
        kind=report.kind,
        label=report.label,
        vram_total_mb=max(report.vram_total_mb, report.vram_free_mb),
        vram_free_mb=report.vram_free_mb,
        ram_total_mb=max(report.ram_total_mb, report.ram_free_mb),
        ram_free_mb=report.ram_free_mb,
        compute_units=report.compute_units,
        throughput_factor=report.throughput_factor,
        accelerators=tuple(report.accelerators),
        resident_models=tuple(ResidentModel(slug=m.slug, vram_held_mb=m.vram_held_mb) for m in report.resident_models),
    )


def label_given_twice(labels: Iterable[str]) -> str | None:
    """The first label given twice, or ``None``: devices are told apart by label within their node."""
    seen: set[str] = set()
    for label in labels:
        if label in seen:
            return label
        seen.add(label)
    return None
