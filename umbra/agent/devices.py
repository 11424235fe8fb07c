"""What this machine can run on: the CPU with system RAM, NVIDIA GPUs (``nvidia-smi``),
AMD GPUs (the ``amdgpu`` driver's files in sysfs) and an Apple silicon GPU (Metal).

Discovery is a measurement, repeated for every heartbeat, and free memory moves
constantly. The server records a heartbeat in the log whenever the device set
changes, so reporting every megabyte of drift would write an event every ten
seconds per node. :func:`steady` keeps the previously reported figures until
they move materially, which keeps the log to real changes while eligibility
still sees memory that filled up or freed.
"""

from __future__ import annotations

import functools
import logging
import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Iterable, Sequence

import msgspec
import psutil

from umbra.domain.device_reports import LABEL_MAX, MAX_DEVICES, DeviceReport, as_device, label_given_twice
from umbra.events.types import Device

log = logging.getLogger(__name__)

#: The query sent to ``nvidia-smi``; :func:`parse_nvidia_smi` reads its columns.
NVIDIA_QUERY = "index,name,memory.total,memory.free"
#: ``nvidia-smi`` and ``sysctl`` are local tools; a hung driver must not stall a heartbeat.
TOOL_TIMEOUT_SECONDS = 5.0
#: A free-memory figure is re-reported only when it moves by more than this many
#: MB, or by more than :data:`DRIFT_FRACTION` of the device's total, whichever
#: is larger.
DRIFT_MB = 256
DRIFT_FRACTION = 0.02
#: Where the kernel lists display devices; an AMD GPU's memory figures are files of its ``device/``.
DRM_CLASS = Path("/sys/class/drm")
#: The PCI vendor id of AMD (ATI) graphics.
AMD_VENDOR = "0x1002"
#: A card's directory (``card0``), not one of its connectors (``card0-DP-1``).
_CARD = re.compile(r"card(\d+)")
#: Of the RAM of an Apple silicon Mac, the part macOS lets the GPU wire by default (Metal's recommended
#: working set): about two thirds up to 36 GB, three quarters above. ``iogpu.wired_limit_mb``, when an
#: operator set it, is the limit instead.
APPLE_GPU_SHARE_SMALL = 2 / 3
APPLE_GPU_SHARE_LARGE = 3 / 4
APPLE_SMALL_RAM_MB = 36 * 1024
#: A discovered GPU's ``throughput_factor``, against the CPU's 1.0. It only ranks (never decides eligibility),
#: but it must rank: a CPU device is eligible for a job of any VRAM floor whenever the RAM fits (its slow
#: path), so at equal factors a job asking for 8 GB of VRAM went to the CPU, listed first, on the node whose
#: GPU had it free. A GPU runs such work an order of magnitude faster; this puts it first, still ahead after
#: a load (×0.7) or an eviction (×0.4). GPUs of one node are not told apart: ``--device`` says more.
DISCOVERED_GPU_FACTOR = 10.0


class DeviceSpecError(ValueError):
    """A ``--device`` override is not a valid Device object."""


def device_label(index: str, name: str) -> str:
    """A discovered device's label: its index for its runtime (``cuda:0``) and the name its driver gives,
    cut to the longest label a report may carry (a firmware's name has no such limit)."""
    return f"{index} {name}"[:LABEL_MAX]


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
                label=device_label(f"cuda:{index}", name),
                vram_total_mb=total_mb,
                vram_free_mb=min(free_mb, total_mb),  # the server refuses a device with more free than its total
                throughput_factor=DISCOVERED_GPU_FACTOR,
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
            timeout=TOOL_TIMEOUT_SECONDS,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        log.warning("nvidia-smi did not answer", extra={"action": "gpu_discovery_failed"})
        return []
    if completed.returncode != 0:
        log.warning("nvidia-smi failed", extra={"action": "gpu_discovery_failed", "returncode": completed.returncode})
        return []
    return parse_nvidia_smi(completed.stdout)


def amd_devices(drm: Path = DRM_CLASS) -> list[Device]:
    """AMD GPUs, from the files the ``amdgpu`` driver keeps for each card (``mem_info_vram_total`` and
    ``mem_info_vram_used``, in bytes): no tool to install or to hang, and read in microseconds.

    A card whose figures cannot be read (another driver, a card going away
    while it is read) is skipped rather than guessed at. An APU's GPU reads as
    discrete here, with the memory its firmware set aside as VRAM: telling it
    from a card needs more than these files say, and ``--device`` describes
    it as ``gpu_integrated`` when its jobs should fall back to system RAM.
    """
    cards = []
    for path in drm.glob("card*"):
        found = _CARD.fullmatch(path.name)
        if found is not None:
            cards.append((int(found.group(1)), path / "device"))
    devices = []
    for _, device in sorted(cards):
        try:
            if (device / "vendor").read_text().strip() != AMD_VENDOR:
                continue
            total = int((device / "mem_info_vram_total").read_text())
            used = int((device / "mem_info_vram_used").read_text())
        except (OSError, ValueError):
            continue
        name = _read_name(device)
        devices.append(
            Device(
                kind="gpu_discrete",
                label=device_label(f"rocm:{len(devices)}", name),
                vram_total_mb=total // (1024 * 1024),
                vram_free_mb=max(total - used, 0) // (1024 * 1024),
                throughput_factor=DISCOVERED_GPU_FACTOR,
                accelerators=("rocm",),
            )
        )
    return devices


def _read_name(device: Path) -> str:
    """The card's product name where its firmware records one, else its PCI device id."""
    for name, template in (("product_name", "{}"), ("device", "AMD GPU {}")):
        try:
            text = (device / name).read_text().strip()
        except (OSError, UnicodeDecodeError):
            continue
        if text:
            return template.format(text)
    return "AMD GPU"


def apple_gpu(chip: str, ram_total_mb: int, ram_free_mb: int, wired_limit_mb: int = 0) -> Device:
    """An Apple silicon GPU: unified memory, so its memory is the system RAM, of which the GPU may wire
    ``wired_limit_mb`` (``iogpu.wired_limit_mb``; 0, the default, leaves macOS's share of the RAM).

    Its free VRAM is what the RAM has free, up to that limit: with none free it
    is busy, as a discrete card with a full VRAM is. A model past the limit may
    still run from the RAM (``gpu_integrated`` is unified memory), on the slow
    path its placement names.
    """
    share = APPLE_GPU_SHARE_SMALL if ram_total_mb <= APPLE_SMALL_RAM_MB else APPLE_GPU_SHARE_LARGE
    limit = wired_limit_mb if wired_limit_mb > 0 else int(ram_total_mb * share)
    limit = min(limit, ram_total_mb)
    return Device(
        kind="gpu_integrated",
        label=device_label("metal:0", f"{chip} GPU"),
        vram_total_mb=limit,
        vram_free_mb=max(min(limit, ram_free_mb), 0),
        ram_total_mb=ram_total_mb,
        ram_free_mb=ram_free_mb,
        throughput_factor=DISCOVERED_GPU_FACTOR,
        accelerators=("metal",),
    )


def apple_devices() -> list[Device]:
    """The GPU of an Apple silicon Mac (Metal); none on any other machine."""
    if sys.platform != "darwin" or platform.machine() != "arm64":
        return []
    memory = psutil.virtual_memory()
    chip = _apple_chip()
    try:
        wired_limit_mb = int(_sysctl("iogpu.wired_limit_mb") or 0)
    except ValueError:
        wired_limit_mb = 0
    return [apple_gpu(chip, memory.total // (1024 * 1024), memory.available // (1024 * 1024), wired_limit_mb)]


@functools.cache
def _apple_chip() -> str:
    """The chip's name (``Apple M2 Max``): read once, it names the device's label, which must not change."""
    return _sysctl("machdep.cpu.brand_string") or "Apple silicon"


def _sysctl(name: str) -> str | None:
    """A ``sysctl -n`` value, or None when the kernel has no such name (an older macOS)."""
    try:
        completed = subprocess.run(["sysctl", "-n", name], capture_output=True, text=True,
                                   timeout=TOOL_TIMEOUT_SECONDS, check=False)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    return completed.stdout.strip() if completed.returncode == 0 else None


def rocm_installed() -> bool:
    """Whether ROCm is installed (its tools on the PATH, or its directory): an AMD card is then one jobs
    can compute on. Without it the card is reported as nothing: a Radeon that only drives the screen
    (the ``amdgpu`` driver comes with every Linux kernel) must not be offered GPU work, as an NVIDIA
    card without its driver's ``nvidia-smi`` is not."""
    return bool(shutil.which("rocminfo") or shutil.which("rocm-smi")
                or Path(os.environ.get("ROCM_PATH") or "/opt/rocm").is_dir())  # fmt: skip


def discover() -> list[Device]:
    """Every device of this machine, CPU first."""
    return [cpu_device(), *nvidia_devices(), *(amd_devices() if rocm_installed() else ()), *apple_devices()]


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
