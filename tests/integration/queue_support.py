"""Shared set-up for the queue tests: nodes made through the real pairing and heartbeat paths."""

from __future__ import annotations

from typing import Any, Sequence
from uuid import UUID

from umbra.compute import jobs
from umbra.compute.heartbeat import heartbeat
from umbra.compute.jobs import JobRequest
from umbra.compute.pairing import issue_pairing_code, redeem_pairing_code
from umbra.domain.heartbeat import HeartbeatReport
from umbra.events.types import Device, ResidentModel

GPU24 = Device(kind="gpu_discrete", label="gpu0", vram_total_mb=24576, vram_free_mb=24000, ram_total_mb=0,
               ram_free_mb=0, accelerators=("cuda",), throughput_factor=10.0)  # fmt: skip
CPU64 = Device(kind="cpu", label="cpu", ram_total_mb=65536, ram_free_mb=60000, throughput_factor=1.0)
CPU8 = Device(kind="cpu", label="cpu", ram_total_mb=8192, ram_free_mb=6000, throughput_factor=1.0)


async def add_node(
    conn, org_id: UUID, name: str, devices: Sequence[Device], *, trust_domain: str = "local", online: bool = True
) -> UUID:
    """Pair a node (and heartbeat it online unless ``online`` is False)."""
    issued = await issue_pairing_code(conn, org_id, name, trust_domain=trust_domain)
    redeemed = await redeem_pairing_code(conn, code=issued.code, name=name, source=f"test:{name}", devices=list(devices))
    if online:
        await beat(conn, org_id, redeemed.node_id, devices)
    return redeemed.node_id


async def beat(conn, org_id: UUID, node_id: UUID, devices: Sequence[Device]):
    return await heartbeat(conn, org_id, node_id, HeartbeatReport(devices=tuple(devices)), event_interval_seconds=300)


def spec(kind: str = "echo", **fields: Any) -> JobRequest:
    import msgspec

    return msgspec.convert({"kind": kind, **fields}, JobRequest)


async def submit(conn, org_id: UUID, kind: str = "echo", **fields: Any):
    rows, _ = await jobs.submit(conn, org_id, [spec(kind, **fields)], actor="test", batch=False)
    return rows[0]


async def register_model(conn, org_id: UUID, slug: str, **fields: Any) -> None:
    from umbra.compute.models import upsert_model
    from umbra.domain.models import RegisteredModel

    await upsert_model(conn, org_id, RegisteredModel(slug=slug, **fields))


async def set_clock(conn, seconds: float) -> None:
    """Move this connection's database clock (umbra_now) by ``seconds``."""
    await conn.execute("SELECT set_config('umbra.clock_offset', %s, false)", (f"{seconds} seconds",))


__all__ = ["CPU64", "CPU8", "GPU24", "ResidentModel", "add_node", "beat", "register_model", "set_clock", "spec", "submit"]
