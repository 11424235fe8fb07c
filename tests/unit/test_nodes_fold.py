"""The node fold, busy devices, schedulability and admin transition rules."""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta, timezone

import pytest

from umbra.domain.models import RegisteredModel
from umbra.domain.eligibility import NodeView, is_schedulable
from umbra.domain.nodes import check_drain, check_retire, decide_cordon, decide_uncordon, is_busy
from umbra.errors import Conflict, NotFound
from umbra.events.store import RecordedEvent
from umbra.events.types import (
    Device,
    JobCancelled,
    NodeCreated,
    NodeCredentialRevoked,
    NodeDeviceCordoned,
    NodeDeviceUncordoned,
    NodeDraining,
    NodeHeartbeat,
    NodePaired,
    NodeRetired,
    NodeWentOffline,
)
from umbra.projections.nodes import fold

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
NODE = uuid.uuid4()
ORG = uuid.uuid4()
GPU = Device(kind="gpu_discrete", label="gpu0", vram_total_mb=24576, vram_free_mb=24000)


def history(*events):
    return [
        RecordedEvent(position=10 + i, stream=f"node:{NODE}", version=i + 1, organization_id=ORG, event=e,
                      metadata={}, recorded_at=T0 + timedelta(seconds=i))
        for i, e in enumerate(events)
    ]


def fold_all(*events):
    state = None
    for recorded in history(*events):
        state = fold(state, recorded)
    return state


def test_a_created_and_paired_node_is_provisioning():
    state = fold_all(NodeCreated(name="gpu-box", trust_domain="lab"), NodePaired(credential_id=uuid.uuid4(), agent_version="1.0", devices=(GPU,)))
    assert (state.id, state.organization_id, state.name, state.status) == (NODE, ORG, "gpu-box", "provisioning")
    assert state.trust_domain == "lab" and state.devices == (GPU,) and state.agent_version == "1.0"
    assert (state.version, state.position, state.created_at, state.updated_at) == (2, 11, T0, T0 + timedelta(seconds=1))
    assert state.last_heartbeat_at is None


def test_a_heartbeat_promotes_and_records_when_it_was_recorded():
    state = fold_all(NodeCreated(name="n"), NodeHeartbeat(agent_version="1.1", devices=(GPU,), agent_started_at=T0))
    assert state.status == "online" and state.last_heartbeat_at == T0 + timedelta(seconds=1)
    assert state.agent_started_at == T0 and state.agent_version == "1.1"


def test_a_heartbeat_without_a_start_time_keeps_the_recorded_one():
    state = fold_all(NodeCreated(name="n"), NodeHeartbeat(agent_started_at=T0), NodeHeartbeat(agent_version="2"))
    assert state.agent_started_at == T0 and state.agent_version == "2"


@pytest.mark.parametrize("intent", [NodeDraining(), NodeRetired()])
def test_a_heartbeat_never_resurrects_a_draining_or_retired_node(intent):
    state = fold_all(NodeCreated(name="n"), NodeHeartbeat(), intent, NodeHeartbeat())
    assert state.status == ("draining" if isinstance(intent, NodeDraining) else "retired")


def test_going_offline_and_coming_back():
    state = fold_all(NodeCreated(name="n"), NodeHeartbeat(), NodeWentOffline(last_seen_at=T0))
    assert state.status == "offline"
    assert fold(state, history(*[NodeCreated(name="n")] * 3, NodeHeartbeat())[-1]).status == "online"


def test_went_offline_only_applies_to_online():
    assert fold_all(NodeCreated(name="n"), NodeDraining(), NodeWentOffline()).status == "draining"


def test_revoking_retires_the_node_whatever_it_was():
    """Nothing gives a revoked node a credential again: it is out of service for good."""
    assert fold_all(NodeCreated(name="n"), NodeHeartbeat(), NodeCredentialRevoked()).status == "retired"
    assert fold_all(NodeCreated(name="n"), NodeCredentialRevoked()).status == "retired"
    assert fold_all(NodeCreated(name="n"), NodeDraining(), NodeCredentialRevoked(), NodeDraining()).status == "retired"


def test_draining_a_retired_node_leaves_it_retired():
    assert fold_all(NodeCreated(name="n"), NodeRetired(), NodeDraining()).status == "retired"


def test_a_stream_must_open_with_created_and_hold_only_node_events():
    with pytest.raises(ValueError):
        fold_all(NodeHeartbeat())
    with pytest.raises(ValueError):
        fold_all(NodeCreated(name="n"), JobCancelled())


def test_busy_and_schedulable():
    full_gpu = Device(kind="gpu_discrete", label="g", vram_total_mb=8000, vram_free_mb=0)
    full_igpu = Device(kind="gpu_integrated", label="i", vram_free_mb=0, ram_free_mb=4000)
    cpu = Device(kind="cpu", label="c", ram_total_mb=16000, ram_free_mb=100)
    assert is_busy(full_gpu) and is_busy(full_igpu) and not is_busy(cpu) and not is_busy(GPU)

    def node(status: str, *devices: Device, cordoned: frozenset[str] = frozenset()) -> NodeView:
        return NodeView(id=uuid.uuid4(), name="n", status=status, trust_domain="local", devices=devices, cordoned=cordoned)

    assert not is_schedulable(node("online", full_gpu))
    assert is_schedulable(node("online", full_gpu, cpu))
    assert not is_schedulable(node("offline", GPU))
    assert not is_schedulable(node("online"))
    assert not is_schedulable(node("online", full_gpu, cpu, cordoned=frozenset({"c"})))  # its one free device cordoned


def test_admin_transition_rules():
    assert check_drain("online") and check_drain("provisioning") and not check_drain("draining")
    with pytest.raises(Conflict) as refused:
        check_drain("retired")
    assert refused.value.code == "node_retired"
    assert check_retire("draining") and not check_retire("retired")


def test_an_unmeasured_ram_floor_falls_back_to_the_vram_floor():
    assert RegisteredModel(slug="m", vram_min_mb=16000).ram_floor_mb == 16000
    assert RegisteredModel(slug="m", vram_min_mb=16000, ram_min_mb=20000).ram_floor_mb == 20000
    # 0 is no measurement of a model with weights (as the reference reads it): the VRAM floor stands in.
    assert RegisteredModel(slug="m", vram_min_mb=16000, ram_min_mb=0).ram_floor_mb == 16000
    assert RegisteredModel(slug="m", vram_min_mb=0, ram_min_mb=0).ram_floor_mb == 0


def test_cordons_fold_by_label_with_their_latest_reason():
    state = fold_all(NodeCreated(name="n"), NodeDeviceCordoned(device="gpu1", reason="ECC"),
                     NodeDeviceCordoned(device="gpu0"), NodeDeviceCordoned(device="gpu1", reason="Xid 79"))  # fmt: skip
    assert state.cordoned == (("gpu0", None), ("gpu1", "Xid 79")) and state.cordoned_labels == {"gpu0", "gpu1"}
    assert fold_all(NodeCreated(name="n"), NodeDeviceCordoned(device="gpu0"), NodeDeviceUncordoned(device="gpu0")).cordoned == ()


def test_cordon_rules():
    """A cordon records once per reason; a device the node does not report is not found (uncordoning one it
    stopped reporting still works); a retired node is refused; an uncordon of a device in service records nothing."""
    kept = {"labels": {"gpu0", "cpu"}, "by": "key:x"}
    assert decide_cordon(stored="online", cordoned={}, device="gpu0", reason="ECC", **kept) == [
        NodeDeviceCordoned(device="gpu0", reason="ECC", by="key:x")]
    assert decide_cordon(stored="online", cordoned={"gpu0": "ECC"}, device="gpu0", reason="ECC", **kept) == []
    assert len(decide_cordon(stored="draining", cordoned={"gpu0": "ECC"}, device="gpu0", reason="fan", **kept)) == 1
    with pytest.raises(NotFound):
        decide_cordon(stored="online", cordoned={}, device="gpu9", reason=None, **kept)
    with pytest.raises(Conflict):
        decide_cordon(stored="retired", cordoned={}, device="gpu0", reason=None, **kept)
    assert decide_uncordon(cordoned={"gpu9": None}, device="gpu9", **kept) == [NodeDeviceUncordoned(device="gpu9", by="key:x")]
    assert decide_uncordon(cordoned={}, device="gpu0", **kept) == []
    with pytest.raises(NotFound):
        decide_uncordon(cordoned={}, device="gpu9", **kept)
