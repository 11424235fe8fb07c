"""Heartbeat coalescing and promotion, decided without a database."""

from __future__ import annotations

from dataclasses import dataclass

from msgspec.structs import replace
from datetime import datetime, timedelta, timezone

import pytest

from umbra.domain.heartbeat import (
    MEMORY_EVENT_SPACING_SECONDS,
    HeartbeatReport,
    Silence,
    crosses_busy_line,
    decide_heartbeat,
    device_changes,
    frees_memory,
    normalize_devices,
)
from umbra.events.types import Device, ResidentModel

NOW = datetime(2026, 1, 1, 12, 0, tzinfo=timezone.utc)
GPU = Device(kind="gpu_discrete", label="gpu0", vram_total_mb=24576, vram_free_mb=20000, ram_total_mb=0,
             accelerators=("cuda",), resident_models=(ResidentModel(slug="gemma4:26b", vram_held_mb=4000),))
CPU = Device(kind="cpu", label="cpu", ram_total_mb=65536, ram_free_mb=30000)


@dataclass
class Recorded:
    status: str = "online"
    devices: tuple = normalize_devices([GPU, CPU])
    agent_version: str | None = "1.0"
    agent_started_at: datetime | None = NOW - timedelta(hours=1)
    last_heartbeat_at: datetime | None = NOW - timedelta(seconds=30)
    kinds: tuple[str, ...] | None = None
    version: int = 3


def decide(current=None, **report):
    return decide_heartbeat(current or Recorded(), HeartbeatReport(**report), NOW, event_interval_seconds=300)


def test_an_unchanged_beat_records_nothing():
    decision = decide(devices=(CPU, GPU), agent_version="1.0", agent_started_at=NOW - timedelta(hours=1))
    assert decision.event is None and decision.reasons == ()


def test_a_beat_that_reports_nothing_new_records_nothing():
    assert decide().event is None


def test_the_kinds_an_agent_takes_are_recorded_when_they_change_in_any_order():
    first = decide(kinds=("sleep", "echo", "echo"))
    assert first.reasons == ("kinds",) and first.event.kinds == ("echo", "sleep")
    assert decide(Recorded(kinds=("echo", "sleep")), kinds=("sleep", "echo")).event is None
    assert decide(Recorded(kinds=("echo", "sleep"))).event is None  # not reported: unchanged
    changed = decide(Recorded(kinds=("echo", "sleep")), kinds=("echo",))
    assert changed.reasons == ("kinds",) and changed.event.kinds == ("echo",) and not changed.changes_capacity
    periodic = decide(Recorded(kinds=("echo",), last_heartbeat_at=NOW - timedelta(seconds=301)))
    assert periodic.event.kinds == ("echo",)  # a recorded beat restates them, as it restates the devices
    every = decide(Recorded(kinds=("echo",)), kinds=())  # an agent that names none takes every kind
    assert every.reasons == ("kinds",) and every.event.kinds == ()
    assert decide(kinds=()).event is None  # None recorded (every kind) and none named: unchanged


def test_the_periodic_beat_is_recorded_with_the_current_devices():
    decision = decide(Recorded(last_heartbeat_at=NOW - timedelta(seconds=300)))
    assert decision.reasons == ("periodic",)
    assert decision.event.devices == Recorded().devices
    assert decision.event.agent_started_at is None


def test_the_first_beat_is_recorded():
    assert "periodic" in decide(Recorded(last_heartbeat_at=None)).reasons


@pytest.mark.parametrize("stored", ["provisioning", "offline"])
def test_provisioning_and_offline_nodes_are_promoted(stored):
    decision = decide(Recorded(status=stored))
    assert "promotion" in decision.reasons and decision.changes_capacity


@pytest.mark.parametrize("stored", ["online", "draining", "retired"])
def test_other_statuses_are_not_a_promotion(stored):
    assert decide(Recorded(status=stored)).event is None


def test_agent_started_at_is_recorded_once_per_restart():
    restarted = NOW - timedelta(seconds=5)
    decision = decide(agent_started_at=restarted)
    assert decision.reasons == ("agent_restart",)
    assert decision.event.agent_started_at == restarted
    again = decide(Recorded(agent_started_at=restarted), agent_started_at=restarted)
    assert again.event is None


def test_a_periodic_beat_does_not_reset_agent_started_at():
    decision = decide(Recorded(last_heartbeat_at=NOW - timedelta(hours=1)), agent_started_at=NOW - timedelta(hours=1))
    assert decision.event is not None and decision.event.agent_started_at is None


def test_a_new_agent_version_is_recorded():
    decision = decide(agent_version="1.1")
    assert decision.reasons == ("agent_version",) and decision.event.agent_version == "1.1"
    assert not decision.changes_capacity


def test_devices_are_identified_by_label_and_order_does_not_matter():
    assert device_changes(normalize_devices([GPU, CPU]), normalize_devices([CPU, GPU])) == set()
    renamed = replace(GPU, label="gpu1")
    assert device_changes(normalize_devices([GPU]), normalize_devices([renamed])) == {"devices"}


def test_a_removed_device_is_a_change_and_the_set_is_replaced():
    decision = decide(devices=(CPU,))
    assert decision.reasons == ("devices",)
    assert [d.label for d in decision.event.devices] == ["cpu"]


def test_memory_jitter_is_not_a_change_but_a_real_move_is():
    old = normalize_devices([GPU, CPU])
    jitter = normalize_devices([replace(GPU, vram_free_mb=19900), replace(CPU, ram_free_mb=29500)])
    assert device_changes(old, jitter) == set()
    moved = normalize_devices([replace(GPU, vram_free_mb=8000), CPU])
    assert device_changes(old, moved) == {"memory"}


def test_a_gpu_running_out_of_vram_is_a_change_however_small():
    almost = normalize_devices([replace(GPU, vram_free_mb=50), CPU])
    full = normalize_devices([replace(GPU, vram_free_mb=0), CPU])
    assert device_changes(almost, full) == {"memory"}


def test_a_move_of_free_memory_alone_is_recorded_at_most_once_per_spacing_and_a_busy_line_crossing_at_once():
    moved = (replace(GPU, vram_free_mb=8000), CPU)
    lately = Recorded(last_heartbeat_at=NOW - timedelta(seconds=MEMORY_EVENT_SPACING_SECONDS - 1))
    assert decide(lately, devices=moved).event is None
    spaced = decide(Recorded(last_heartbeat_at=NOW - timedelta(seconds=MEMORY_EVENT_SPACING_SECONDS)), devices=moved)
    assert spaced.reasons == ("memory",) and spaced.event.devices[1].vram_free_mb == 8000
    full = decide(lately, devices=(replace(GPU, vram_free_mb=0), CPU))
    assert full.reasons == ("memory",) and full.changes_capacity  # its one GPU is busy now: at once
    assert decide(Recorded(last_heartbeat_at=None), devices=moved).event is not None  # the node's first beat
    # With other news, the beat is recorded with its memory, for every reason it has.
    both = decide(lately, devices=moved, agent_version="1.1")
    assert both.reasons == ("memory", "agent_version") and both.event.devices[1].vram_free_mb == 8000
    loaded = replace(moved[0], resident_models=(*GPU.resident_models, ResidentModel(slug="phi3", vram_held_mb=9000)))
    assert decide(lately, devices=(loaded, CPU)).reasons == ("memory", "models")
    # The memory a resident model holds is memory: it moving (a model's cache growing) waits the same.
    grown = replace(GPU, vram_free_mb=16000, resident_models=(ResidentModel(slug="gemma4:26b", vram_held_mb=8000),))
    assert decide(lately, devices=(grown, CPU)).event is None
    assert decide(Recorded(last_heartbeat_at=NOW - timedelta(seconds=61)), devices=(grown, CPU)).reasons == ("memory",)
    in_ram = replace(CPU, resident_models=(ResidentModel(slug="phi3", vram_held_mb=3000),))
    assert device_changes((in_ram,), (replace(in_ram, resident_models=(ResidentModel(slug="phi3", vram_held_mb=6000),)),)) == {"memory"}


def test_memory_freed_between_two_reports_is_room_a_parked_claim_should_look_at():
    before = normalize_devices([GPU, CPU])
    assert frees_memory(before, normalize_devices([replace(GPU, vram_free_mb=21000), CPU]))
    assert frees_memory(before, normalize_devices([GPU, replace(CPU, ram_free_mb=32000)]))
    assert not frees_memory(before, normalize_devices([replace(GPU, vram_free_mb=20400), CPU]))  # jitter
    assert not frees_memory(before, normalize_devices([replace(GPU, vram_free_mb=8000), CPU]))  # taken, not freed
    busy = normalize_devices([replace(GPU, vram_free_mb=0), CPU])
    assert frees_memory(busy, normalize_devices([replace(GPU, vram_free_mb=100), CPU]))  # no longer busy
    assert not frees_memory(busy, normalize_devices([CPU]))  # a device gone frees nothing of the ones left
    assert crosses_busy_line(before, busy) and crosses_busy_line(busy, before) and not crosses_busy_line(before, before)


def test_resident_models_coming_and_going_is_a_change():
    loaded = replace(GPU, resident_models=(*GPU.resident_models, ResidentModel(slug="llama3:8b", vram_held_mb=5000)))
    decision = decide(devices=(loaded, CPU))
    assert "models" in decision.reasons and decision.changes_capacity


def test_normalize_sorts_and_dedupes():
    messy = replace(GPU, accelerators=("rocm", "cuda", "cuda"))
    (device,) = normalize_devices([messy])
    assert device.accelerators == ("cuda", "rocm")


def after(silent_seconds: float, *, version: int = 3, previous=...) -> Silence:
    """The silence a beat heard at NOW ends, the previous beat ``silent_seconds`` before it."""
    previous = NOW - timedelta(seconds=silent_seconds) if previous is ... else previous
    return Silence(previous_seen_at=previous, seen_at=NOW, stale_seconds=45, version=version)


def decide_after(silence: Silence, current=None):
    return decide_heartbeat(current or Recorded(), HeartbeatReport(), NOW, event_interval_seconds=300, silence=silence)


def test_a_beat_after_an_unrecorded_offline_spell_records_it_then_the_return():
    """Views read a stored ``online`` silent past the threshold as ``offline``; if the sweeper has not recorded
    that, the beat does: ``node.went_offline`` with the last beat before the silence, then a promotion."""
    decision = decide_after(after(46))
    assert decision.went_offline is not None and decision.went_offline.last_seen_at == NOW - timedelta(seconds=46)
    assert decision.event is not None and decision.reasons[:2] == ("silence", "promotion") and decision.changes_capacity
    never = decide_after(after(0, previous=None))  # stored online, no liveness at all: read offline too
    assert never.went_offline is not None and never.went_offline.last_seen_at is None


def test_a_silence_no_view_read_as_offline_records_no_spell():
    """Exactly the threshold is still online (the views' rule), so nothing is recorded but the beat's own worth."""
    decision = decide_after(after(45))
    assert decision.went_offline is None and decision.event is None


@pytest.mark.parametrize("stored", ["offline", "provisioning", "draining", "retired"])
def test_a_spell_the_log_already_has_or_an_intent_status_records_no_second_one(stored):
    """A stored ``offline`` is the spell already recorded (by the sweeper or a sign-off): the beat only promotes.
    Intent statuses never expire, so they have no spell to record."""
    decision = decide_after(after(120), Recorded(status=stored))
    assert decision.went_offline is None
    assert ("promotion" in decision.reasons) == (stored in ("offline", "provisioning"))


def test_a_node_changed_since_the_silence_was_measured_records_no_spell():
    """Another beat that ended the same silence (or the sweeper) moved the node's version under the row lock:
    it has answered for the spell, so this beat records none."""
    assert decide_after(after(120, version=2)).went_offline is None
