"""Pure node rules: busy devices, schedulability, and which transitions are allowed.

Every rule here is shared by the command that decides an event and the fold
that applies it, so a live row and a rebuilt one cannot disagree about what a
transition did.
"""

from __future__ import annotations

from typing import Collection, Mapping

from umbra.errors import Conflict, InvalidRequest, NotFound
from umbra.events.types import Device, Event, NodeDeviceCordoned, NodeDeviceUncordoned

#: Statuses a heartbeat promotes to ``online``. ``draining`` and ``retired`` are
#: an administrator's intent: a node still beating must not re-advertise itself
#: for the work it is being drained from.
PROMOTABLE = frozenset({"provisioning", "offline"})


def is_busy(device: Device) -> bool:
    """A non-CPU device with no free VRAM is busy.

    Separate from utilisation: a GPU at 0% whose VRAM is held by resident
    models cannot take another model, and reads as constrained, not idle.
    """
    return device.kind != "cpu" and device.vram_free_mb <= 0


def after_heartbeat(stored: str) -> str:
    """The stored status a recorded heartbeat leaves behind."""
    return "online" if stored in PROMOTABLE else stored


def after_went_offline(stored: str) -> str:
    """Only a stored ``online`` goes stale; intent statuses never expire."""
    return "offline" if stored == "online" else stored


def after_revoked(stored: str) -> str:
    """A node whose credentials are revoked is out of service for good: ``retired``.

    Nothing gives a node a credential again (pairing makes a new node), so it
    can never speak or take work again. Read as ``offline`` it would look like
    a node that may come back: work only it could run would stay ``queued``,
    looking alive, instead of ``blocked`` with a reason, and an operator could
    not tell it from a node that is merely silent.
    """
    return "retired"


def after_draining(stored: str) -> str:
    return "retired" if stored == "retired" else "draining"


def check_drain(stored: str) -> bool:
    """Whether a drain request records anything: False when already draining.

    Raises ``node_retired`` for a retired node: retirement is final, and quietly
    turning it back into ``draining`` would put it back on the dashboard.
    """
    if stored == "retired":
        raise Conflict("node_retired", "This node is retired; retirement is final and it cannot be drained.")
    return stored != "draining"


def check_retire(stored: str) -> bool:
    """Whether a retire request records anything: False when already retired."""
    return stored != "retired"


#: The longest reason a cordon may give.
MAX_CORDON_REASON = 500


def decide_cordon(*, stored: str, labels: Collection[str], cordoned: Mapping[str, str | None], device: str,
                  reason: str | None, by: str | None) -> list[Event]:  # fmt: skip
    """Take one device out of service: nothing new is placed on it, the node's other devices go on.

    What runs there runs on (its agent reports it as ever); a GPU throwing ECC
    errors or waiting for a driver stops taking work without draining the
    whole machine. Nothing is recorded when the device is already cordoned
    for the same reason (a new reason is recorded). A device the node does
    not report → ``device_not_found``; a retired node → ``node_retired``, as
    for a drain.
    """
    if reason is not None and not 0 < len(reason) <= MAX_CORDON_REASON:
        raise InvalidRequest(f"reason: 1 to {MAX_CORDON_REASON} characters, or none.", field="reason")
    if stored == "retired":
        raise Conflict("node_retired", "This node is retired; retirement is final and its devices take no work anyway.")
    if device not in labels:
        raise _no_device(device)
    if device in cordoned and cordoned[device] == reason:
        return []
    return [NodeDeviceCordoned(device=device, reason=reason, by=by)]


def decide_uncordon(*, labels: Collection[str], cordoned: Mapping[str, str | None], device: str, by: str | None) -> list[Event]:
    """Put a cordoned device back in service; nothing is recorded for one that is not cordoned. A device
    neither reported nor cordoned → ``device_not_found`` (one the node stopped reporting can still be
    uncordoned)."""
    if device in cordoned:
        return [NodeDeviceUncordoned(device=device, by=by)]
    if device not in labels:
        raise _no_device(device)
    return []


def _no_device(device: str) -> NotFound:
    return NotFound("device_not_found", f"The node reports no device {device!r}.", device=device)
