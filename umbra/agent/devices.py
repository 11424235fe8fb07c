"""What this machine can run on: the CPU with system RAM, and NVIDIA GPUs.

Discovery is a measurement, repeated for every heartbeat, and free memory moves
constantly. The server records a heartbeat in the log whenever the device set
changes, so reporting every megabyte of drift would write an event every ten
seconds per node. :func:`steady` keeps the previously reported figures until
they move materially, which keeps the log to real changes while eligibility
still sees memory that filled up or freed.
"""

from __future__ import annotations

import logging
import platform
import shutil
import subprocess
from typing import Iterable, Sequence

import msgspec
import psutil

from umbra.domain.device_reports import MAX_DEVICES, DeviceReport, as_device, label_given_twice
from umbra.events.types import Device

log = logging.getLogger(__name__)

#: The query sent to ``nvidia-smi``; :func:`parse_nvidia_smi` reads its columns.
NVIDIA_QUERY = "index,name,memory.total,memory.free"
#: ``nvidia-smi`` is a local tool; a hung driver must not stall a heartbeat.
NVIDIA_TIMEOUT_SECONDS = 5.0
#: A free-memory figure is re-reported only when it moves by more than this many
#: MB, or by more than :data:`DRIFT_FRACTION` of the device's total, whichever
#: is larger.
DRIFT_MB = 256
DRIFT_FRACTION = 0.02


class DeviceSpecError(ValueError):
    """A ``--device`` override is not a valid Device object."""


def cpu_device() -> Device:
    """The CPU with system RAM (unified memory: its memory *is* the RAM)."""
    memory = psutil.virtual_memory()
    label = platform.processor() or platform.machine() or "cpu"
    return Device(
        kind="cpu",
        label=f"cpu ({label})",
        ram_total_mb=memory.total // (1024 * 1024),
        ram_free_mb=memory.available // (1024 * 1024),
        compute_units=psutil.cpu_count(logical=True),
        throughput_factor=1.0,
    )


def parse_nvidia_smi(output: str) -> list[Device]:
    """Devices from ``nvidia-smi --query-gpu=NVIDIA_QUERY --format=csv,noheader,nounits``.

    Lines that do not parse (a driver message, ``[N/A]`` figures) are skipped
    rather than guessed at.
    """
    devices = []
    for line in output.splitlines():
        parts = [part.strip() for part in line.split(",")]
        if len(parts) != 4:
            continue
        index, name, total, free = parts
        try:
            total_mb, free_mb = int(float(total)), int(float(free))
        except ValueError:
            continue
        devices.append(
            Device(
                kind="gpu_discrete",
                label=f"cuda:{index} {name}",
                vram_total_mb=total_mb,
                vram_free_mb=free_mb,
                throughput_factor=1.0,
                accelerators=("cuda",),
            )
        )
    return devices


def nvidia_devices() -> list[Device]:
    """NVIDIA GPUs via ``nvidia-smi`` when it is installed; none otherwise."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return []
    try:
        completed = subprocess.run(
            [exe, f"--query-gpu={NVIDIA_QUERY}", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=NVIDIA_TIMEOUT_SECONDS,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        log.warning("nvidia-smi did not answer", extra={"action": "gpu_discovery_failed"})
        return []
    if completed.returncode != 0:
        log.warning("nvidia-smi failed", extra={"action": "gpu_discovery_failed", "returncode": completed.returncode})
        return []
    return parse_nvidia_smi(completed.stdout)


def discover() -> list[Device]:
    """Every device of this machine, CPU first."""
    return [cpu_device(), *nvidia_devices()]


def parse_device_spec(text: str) -> Device:
    """One ``--device`` override: a JSON Device object as in API.md, held to the server's limits
    (:class:`umbra.domain.device_reports.DeviceReport`, what the server decodes heartbeats with).

    A field the Device object does not have is refused, not dropped: it is a typo
    (``vram_totl_mb``) that would report a 24 GB GPU with no VRAM, busy for ever.
    """
    try:
        report = msgspec.json.decode(text, type=DeviceReport)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        fields = f" (a device has: {', '.join(DeviceReport.__struct_fields__)})" if "unknown field" in str(exc) else ""
        raise DeviceSpecError(f"--device is not a valid device object: {exc}{fields}") from None
    return as_device(report)


def check_device_set(devices: Sequence[Device]) -> None:
    """Raise :class:`DeviceSpecError` for a set of devices the server refuses as a whole:
    a label given twice (devices are told apart by label within the node), or too many."""
    twice = label_given_twice(device.label for device in devices)
    if twice is not None:
        raise DeviceSpecError(f"--device label {twice!r} is given twice; each device needs its own label.")
    if len(devices) > MAX_DEVICES:
        raise DeviceSpecError(f"--device is given {len(devices)} times; a node reports at most {MAX_DEVICES} devices.")


def _moved(old: int, new: int, total: int) -> bool:
    # Reaching or leaving zero always counts: a GPU with no free VRAM is busy (no new work).
    return (old <= 0) != (new <= 0) or abs(new - old) > max(DRIFT_MB, DRIFT_FRACTION * total)


def steady(previous: Sequence[Device] | None, current: Iterable[Device]) -> list[Device]:
    """``current``, except that small free-memory drift keeps the previous figures.

    A device is matched to its previous report by label. Any change other than
    free memory (a device appearing, totals, resident models) passes through,
    and so does free memory reaching or leaving zero.
    """
    before = {device.label: device for device in previous or ()}
    out = []
    for device in current:
        old = before.get(device.label)
        if old is not None and msgspec.structs.replace(
            old, vram_free_mb=device.vram_free_mb, ram_free_mb=device.ram_free_mb
        ) == device:
            if not _moved(old.vram_free_mb, device.vram_free_mb, device.vram_total_mb) and not _moved(
                old.ram_free_mb, device.ram_free_mb, device.ram_total_mb
            ):
                device = old
        out.append(device)
    return out
