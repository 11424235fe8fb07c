"""The agent's pure parts and local state, without a server or database:
device discovery parsing, reporting drift, back-off, handlers, the credential
file, and the CLI's SSE reader."""

from __future__ import annotations

import os
import random
import stat
from types import SimpleNamespace

import msgspec
import pytest

from umbra.agent.credentials import CredentialFile, CredentialFileError, StoredCredential
from umbra.agent import devices as agent_devices
from umbra.agent.devices import (
    MAX_DEVICES,
    DeviceSpecError,
    amd_devices,
    apple_gpu,
    check_device_set,
    cpu_device,
    parse_device_spec,
    parse_nvidia_smi,
    steady,
)
from umbra.agent.handlers import HandlerRegistry, PermanentError, RetryableError, UnknownKind, is_retryable
from umbra.agent.jobrun import backoff_delay
from umbra.cli_events import SseParser
from umbra.domain.nodes import is_busy
from umbra.events.types import Device

pytestmark = pytest.mark.anyio

NVIDIA_OUTPUT = """0, NVIDIA GeForce RTX 4090, 24564, 23012
1, NVIDIA A100-SXM4-80GB, 81920, [N/A]
NVIDIA-SMI has failed because it couldn't communicate with the driver on one line
2, Tesla T4, 15360, 15100
"""


def test_nvidia_smi_lines_become_discrete_cuda_devices_and_unreadable_lines_are_skipped():
    devices = parse_nvidia_smi(NVIDIA_OUTPUT)
    assert [d.label for d in devices] == ["cuda:0 NVIDIA GeForce RTX 4090", "cuda:2 Tesla T4"]
    first = devices[0]
    assert first.kind == "gpu_discrete" and first.accelerators == ("cuda",)
    assert (first.vram_total_mb, first.vram_free_mb, first.ram_total_mb) == (24564, 23012, 0)


def test_an_nvidia_smi_line_with_more_free_than_total_reports_the_total_free():
    """The server refuses a device saying it has more free memory than it has (a driver's rounding would
    otherwise stop the agent at its first heartbeat): what is free is at most the total."""
    [device] = parse_nvidia_smi("0, NVIDIA A10, 23028, 23040\n")
    assert (device.vram_total_mb, device.vram_free_mb) == (23028, 23028)


GIB = 1024**3


def _card(drm, name, **files):
    device = drm / name / "device"
    device.mkdir(parents=True)
    for file, text in files.items():
        (device / file).write_text(text)


def test_amd_cards_in_sysfs_become_discrete_rocm_devices_and_other_cards_are_skipped(tmp_path):
    _card(tmp_path, "card0", vendor="0x8086\n")  # an Intel iGPU: not AMD
    (tmp_path / "card0-DP-1").mkdir()  # a connector of card0, not a card
    _card(tmp_path, "card1", vendor="0x1002\n", mem_info_vram_total=f"{24 * GIB}\n",
          mem_info_vram_used=f"{GIB}\n", product_name="AMD Radeon RX 7900 XTX\n", device="0x744c\n")
    _card(tmp_path, "card2", vendor="0x1002\n", mem_info_vram_total="\n", mem_info_vram_used="0\n")  # unreadable
    _card(tmp_path, "card3", vendor="0x1002\n", mem_info_vram_total=f"{16 * GIB}\n")  # no used figure
    # card10 sorts after card2 by number, not before it by text; no product name: its PCI id names it.
    _card(tmp_path, "card10", vendor="0x1002\n", mem_info_vram_total=f"{64 * GIB}\n", mem_info_vram_used="0\n",
          product_name="\n", device="0x740c\n")
    _card(tmp_path, "card11", vendor="0x1002\n", mem_info_vram_total=f"{8 * GIB}\n",
          mem_info_vram_used=f"{9 * GIB}\n")  # used past total (read while it moved): none free

    found = amd_devices(tmp_path)
    assert [d.label for d in found] == ["rocm:0 AMD Radeon RX 7900 XTX", "rocm:1 AMD GPU 0x740c", "rocm:2 AMD GPU"]
    assert all(d.kind == "gpu_discrete" and d.accelerators == ("rocm",) for d in found)
    assert [(d.vram_total_mb, d.vram_free_mb, d.ram_total_mb) for d in found] == [
        (24576, 23552, 0), (65536, 65536, 0), (8192, 0, 0)]
    assert is_busy(found[2]) and not is_busy(found[0])
    assert amd_devices(tmp_path / "missing") == []


def test_amd_cards_are_reported_only_where_rocm_is_installed(tmp_path, monkeypatch):
    """The ``amdgpu`` driver comes with every kernel: without ROCm, a Radeon only drives the screen."""
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    monkeypatch.setenv("ROCM_PATH", str(tmp_path / "rocm"))
    assert not agent_devices.rocm_installed()
    (tmp_path / "rocm").mkdir()
    assert agent_devices.rocm_installed()
    monkeypatch.setenv("ROCM_PATH", str(tmp_path / "elsewhere"))
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "rocminfo").write_text("#!/bin/sh\n")
    (tmp_path / "bin" / "rocminfo").chmod(0o755)
    assert agent_devices.rocm_installed()


def test_an_apple_silicon_gpu_is_unified_memory_sized_by_macos_share_or_the_operators_limit():
    small = apple_gpu("Apple M2 Max", ram_total_mb=32768, ram_free_mb=20000)
    assert (small.kind, small.label, small.accelerators) == ("gpu_integrated", "metal:0 Apple M2 Max GPU", ("metal",))
    assert (small.vram_total_mb, small.vram_free_mb, small.ram_total_mb, small.ram_free_mb) == (21845, 20000, 32768, 20000)
    large = apple_gpu("Apple M3 Ultra", ram_total_mb=196608, ram_free_mb=180000)
    assert (large.vram_total_mb, large.vram_free_mb) == (147456, 147456)  # three quarters, free up to it
    raised = apple_gpu("Apple M3 Ultra", ram_total_mb=196608, ram_free_mb=180000, wired_limit_mb=188416)
    assert (raised.vram_total_mb, raised.vram_free_mb) == (188416, 180000)
    assert apple_gpu("Apple M1", ram_total_mb=8192, ram_free_mb=4000, wired_limit_mb=99999).vram_total_mb == 8192
    assert is_busy(apple_gpu("Apple M1", ram_total_mb=8192, ram_free_mb=0)) and not is_busy(small)


def test_a_mac_reports_its_gpu_read_from_sysctl_and_other_machines_none(monkeypatch):
    values = {"machdep.cpu.brand_string": "Apple M4 Pro", "iogpu.wired_limit_mb": "0"}
    monkeypatch.setattr(agent_devices, "_sysctl", values.get)
    agent_devices._apple_chip.cache_clear()
    monkeypatch.setattr(agent_devices.sys, "platform", "linux")
    assert agent_devices.apple_devices() == []
    monkeypatch.setattr(agent_devices.sys, "platform", "darwin")
    monkeypatch.setattr(agent_devices.platform, "machine", lambda: "arm64")
    [gpu] = agent_devices.apple_devices()
    assert gpu.label == "metal:0 Apple M4 Pro GPU" and gpu.ram_total_mb == cpu_device().ram_total_mb
    values["iogpu.wired_limit_mb"] = "12000"
    values["machdep.cpu.brand_string"] = "renamed"  # read once: the label stays
    assert [(d.label, d.vram_total_mb) for d in agent_devices.apple_devices()] == [("metal:0 Apple M4 Pro GPU", 12000)]
    values["iogpu.wired_limit_mb"] = "not a number"
    assert agent_devices.apple_devices()[0].vram_total_mb == gpu.vram_total_mb  # macOS's share, as with "0"
    agent_devices._apple_chip.cache_clear()


def test_every_device_discovery_makes_is_one_the_server_accepts(tmp_path):
    """The agent's reports pass the server's own decoding (``DeviceReport``), as a heartbeat's would."""
    _card(tmp_path, "card1", vendor="0x1002", mem_info_vram_total=str(24 * GIB), mem_info_vram_used="0",
          product_name="x" * 300)  # a firmware name past the label's limit
    found = [cpu_device(), *parse_nvidia_smi(NVIDIA_OUTPUT), *amd_devices(tmp_path),
             apple_gpu("Apple M2", ram_total_mb=16384, ram_free_mb=9000)]
    check_device_set(found)
    for device in found:
        assert parse_device_spec(msgspec.json.encode(device).decode()) == device


def test_a_discovered_gpu_is_placed_before_the_cpu_for_work_that_asks_for_vram(tmp_path):
    """Both are eligible (the CPU through the RAM, its slow path): the GPU's factor puts it first, even when
    the job's model must be loaded there; a job the GPU cannot hold still goes to the CPU."""
    from uuid import uuid4

    from umbra.domain.eligibility import NodeView
    from umbra.domain.placement import placements
    from umbra.events.types import Requirements

    _card(tmp_path, "card0", vendor="0x1002", mem_info_vram_total=str(16 * GIB), mem_info_vram_used="0")
    cpu = Device(kind="cpu", label="cpu", ram_total_mb=65536, ram_free_mb=60000)
    for gpu in (parse_nvidia_smi(NVIDIA_OUTPUT)[0], amd_devices(tmp_path)[0],
                apple_gpu("Apple M2 Max", ram_total_mb=65536, ram_free_mb=60000)):
        node = NodeView(id=uuid4(), name="box", status="online", trust_domain="local", devices=(cpu, gpu))
        [best, *_], _ = placements([node], Requirements(vram_min_mb=8000), {})
        assert (best.device_id, best.via) == (gpu.label, "vram"), gpu.label
        [best, *_], _ = placements([node], Requirements(vram_min_mb=gpu.vram_total_mb + 1, ram_min_mb=1000), {})
        assert best.device_id == ("cpu" if gpu.kind == "gpu_discrete" else gpu.label), gpu.label


def test_cpu_device_reports_system_memory():
    cpu = cpu_device()
    assert cpu.kind == "cpu" and cpu.ram_total_mb > 0 and 0 < cpu.ram_free_mb <= cpu.ram_total_mb
    assert cpu.compute_units and cpu.compute_units >= 1


def test_device_override_is_a_strict_device_object():
    device = parse_device_spec('{"kind": "gpu_discrete", "label": "g0", "vram_total_mb": 8192, "vram_free_mb": 8000}')
    assert device == Device(kind="gpu_discrete", label="g0", vram_total_mb=8192, vram_free_mb=8000)
    with pytest.raises(DeviceSpecError):
        parse_device_spec('{"kind": "tpu", "label": "t"}')
    with pytest.raises(DeviceSpecError):
        parse_device_spec("not json")


def test_device_override_refuses_a_field_the_device_object_does_not_have():
    """Dropped, ``vram_totl_mb`` would report a 24 GB GPU with no VRAM: busy, never given work."""
    with pytest.raises(DeviceSpecError, match="unknown field `vram_totl_mb`.*a device has: kind, label, vram_total_mb"):
        parse_device_spec('{"kind": "gpu_discrete", "label": "g0", "vram_totl_mb": 24576}')


@pytest.mark.parametrize("fields", ['"label": ""', '"label": "c", "ram_free_mb": -1', '"label": "c", "throughput_factor": 0',
                                    '"label": "c", "vram_total_mb": 2147483648', '"label": "c", "accelerators": [""]'])
def test_device_override_is_held_to_the_servers_limits(fields):
    with pytest.raises(DeviceSpecError):
        parse_device_spec('{"kind": "cpu", %s}' % fields)


def test_a_device_set_with_a_label_twice_or_too_many_devices_is_refused():
    cpu = Device(kind="cpu", label="c0", ram_total_mb=8192, ram_free_mb=8000)
    check_device_set([cpu, msgspec.structs.replace(cpu, label="c1")])
    with pytest.raises(DeviceSpecError, match="'c0' is given twice"):
        check_device_set([cpu, msgspec.structs.replace(cpu, ram_free_mb=1)])
    with pytest.raises(DeviceSpecError, match="at most 256"):
        check_device_set([msgspec.structs.replace(cpu, label=f"c{i}") for i in range(MAX_DEVICES + 1)])


def test_small_memory_drift_keeps_the_previous_report_and_real_changes_pass():
    before = [Device(kind="cpu", label="cpu", ram_total_mb=65536, ram_free_mb=40000)]
    drifted = [Device(kind="cpu", label="cpu", ram_total_mb=65536, ram_free_mb=40300)]
    assert steady(before, drifted) == before
    moved = [Device(kind="cpu", label="cpu", ram_total_mb=65536, ram_free_mb=30000)]
    assert steady(before, moved) == moved
    new_gpu = [*drifted, Device(kind="gpu_discrete", label="g", vram_total_mb=8192, vram_free_mb=8192)]
    assert steady(before, new_gpu) == [before[0], new_gpu[1]]
    resized = [Device(kind="cpu", label="cpu", ram_total_mb=131072, ram_free_mb=40300)]
    assert steady(before, resized) == resized
    assert steady(None, drifted) == drifted


def test_a_gpu_running_out_of_free_memory_is_reported_even_within_the_drift():
    """A non-CPU device with no free VRAM is busy: reaching zero, or leaving it, is never drift."""
    gpu = Device(kind="gpu_discrete", label="g", vram_total_mb=24576, vram_free_mb=200)
    full = msgspec.structs.replace(gpu, vram_free_mb=0)
    assert steady([gpu], [full]) == [full]
    assert steady([full], [gpu]) == [gpu]
    assert steady([gpu], [msgspec.structs.replace(gpu, vram_free_mb=300)]) == [gpu]


def test_backoff_grows_exponentially_is_capped_and_jittered():
    rng = random.Random(7)
    delays = [backoff_delay(n, 0.5, 30.0, rng) for n in range(1, 12)]
    for n, delay in enumerate(delays, start=1):
        ceiling = min(30.0, 0.5 * 2 ** (n - 1))
        assert ceiling / 2 <= delay <= ceiling
    assert max(delays) <= 30.0 and delays[-1] >= 15.0
    assert len({round(backoff_delay(3, 0.5, 30.0, rng), 6) for _ in range(20)}) > 1


def _claim(kind: str, payload=None):
    return SimpleNamespace(kind=kind, payload=payload, job={"id": "j", "kind": kind, "payload": payload})


async def test_builtin_handlers_echo_and_sleep():
    registry = HandlerRegistry.default()
    assert {"echo", "sleep"} <= set(registry.kinds)
    assert await registry.run(_claim("echo", {"a": [1, 2]})) == {"a": [1, 2]}
    assert await registry.run(_claim("sleep", {"seconds": 0.01})) == {"slept": 0.01}
    with pytest.raises(PermanentError):
        await registry.run(_claim("sleep", {"seconds": "soon"}))


async def test_unknown_kind_is_a_permanent_failure_naming_the_kind():
    with pytest.raises(UnknownKind) as info:
        await HandlerRegistry.default().run(_claim("transcode"))
    assert not is_retryable(info.value) and "'transcode'" in str(info.value) and "echo" in str(info.value)


async def test_sync_handlers_run_in_a_thread_and_retryability_is_the_handlers_choice():
    def flaky(claim):
        raise RetryableError("GPU busy, try later")

    def broken(claim):
        raise ValueError("bad input")

    registry = HandlerRegistry({"flaky": flaky, "broken": broken, "sum": lambda c: sum(c.payload)})
    assert await registry.run(_claim("sum", [1, 2, 3])) == 6
    with pytest.raises(RetryableError) as retryable:
        await registry.run(_claim("flaky"))
    assert is_retryable(retryable.value)
    with pytest.raises(ValueError) as final:
        await registry.run(_claim("broken"))
    assert not is_retryable(final.value)


def test_credential_file_is_written_private_and_refused_when_readable_by_others(tmp_path):
    store = CredentialFile(tmp_path / "agent" / "credential.json")
    credential = StoredCredential(server="http://s", node_id="n", name="box", credential="un_x_y", scopes=("compute:claim",))
    store.save(credential)
    assert stat.S_IMODE(store.path.stat().st_mode) == 0o600
    assert stat.S_IMODE(store.path.parent.stat().st_mode) == 0o700
    assert store.load() == credential
    assert [p.name for p in store.path.parent.iterdir()] == ["credential.json"]
    with pytest.raises(CredentialFileError, match="already holds"):
        store.save(credential)
    os.chmod(store.path, 0o644)
    with pytest.raises(CredentialFileError, match="chmod 600"):
        store.load()
    with pytest.raises(CredentialFileError, match="pair first"):
        CredentialFile(tmp_path / "missing.json").load()


def test_sse_parser_reads_ids_events_multiline_data_and_skips_comments():
    parser = SseParser()
    lines = ["retry: 2000", "", ": ping", "", "id: 7", "event: job.submitted", 'data: {"a":', "data: 1}", "", "data: x", ""]
    messages = [m for m in map(parser.feed, lines) if m is not None]
    assert messages == [("job.submitted", '{"a":\n1}', "7"), ("message", "x", "7")]
    assert parser.last_id == "7"


def double(claim):
    """An entry-point handler for the test below."""
    return [2 * x for x in claim.payload]


async def test_handlers_come_from_the_umbra_handlers_entry_point_group_and_from_module_paths(monkeypatch):
    from importlib.metadata import EntryPoint

    import umbra.agent.handlers as handlers

    points = [
        EntryPoint(name="double", value=f"{__name__}:double", group=handlers.ENTRY_POINT_GROUP),
        EntryPoint(name="broken", value="no.such.module:fn", group=handlers.ENTRY_POINT_GROUP),
    ]
    monkeypatch.setattr(handlers, "entry_points", lambda group: [p for p in points if p.group == group])
    registry = HandlerRegistry.default()
    assert "double" in registry.kinds and "broken" not in registry.kinds, "a broken plug-in is skipped, not fatal"
    assert await registry.run(_claim("double", [1, 2])) == [2, 4]
    assert handlers.load_object(f"{__name__}:double") is double
    with pytest.raises(ValueError):
        handlers.load_object("no-colon")


def test_a_credential_file_that_cannot_be_written_is_found_out_before_pairing(tmp_path):
    (tmp_path / "afile").write_text("not a directory")
    with pytest.raises(CredentialFileError) as refused:
        CredentialFile(tmp_path / "afile" / "credential.json").check_writable()
    assert "Cannot write a credential" in refused.value.message
    writable = CredentialFile(tmp_path / "agent" / "credential.json")
    writable.check_writable()
    assert list((tmp_path / "agent").iterdir()) == []  # the probe is gone, nothing is saved yet
