"""Pure node rules: busy devices, schedulability, and which transitions are allowed.

Every rule here is shared by the command that decides an event and the fold
that applies it, so a live row and a rebuilt one cannot disagree about what a
transition did.
"""

from __future__ import annotations

from typing import Iterable

from umbra.errors import Conflict
from umbra.events.types import Device

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


def is_schedulable(effective_status: str, devices: Iterable[Device]) -> bool:
    """Effectively online and at least one device that is not busy."""
    return effective_status == "online" and any(not is_busy(d) for d in devices)


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
