"""Nodes over HTTP: the agent's heartbeat, administration and reads.

Handlers are thin: authenticate, decode the body strictly, call one command in
:mod:`umbra.compute`, render. Another organization's node is 404
``node_not_found`` (never 403), and a node credential sees only its own node.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Annotated, Any
from uuid import UUID

import msgspec
from msgspec import Meta
from starlette.requests import Request
from starlette.responses import Response

from umbra.compute import credentials, heartbeat, nodes
from umbra.compute.jobs import Kinds, in_utc
from umbra.domain.device_reports import MAX_DEVICES, DeviceReport, Label, as_device, label_given_twice
from umbra.domain.heartbeat import HeartbeatReport
from umbra.domain.nodes import MAX_CORDON_REASON, is_busy
from umbra.errors import InvalidRequest
from umbra.events.types import NODE_STATUSES, Device, TimestampText

from .http import acting_as, authenticated, authorized, json_response, path_uuid, read_json, request_id
from .params import query_statuses
from .routing import endpoint

Devices = Annotated[list[DeviceReport], Meta(max_length=MAX_DEVICES)]


def to_devices(reports: list[DeviceReport]) -> tuple[Device, ...]:
    """Request devices as stored values; a label reported twice is refused."""
    if label_given_twice(d.label for d in reports) is not None:
        raise InvalidRequest("devices: each device needs a distinct label within the node.", field="devices")
    return tuple(as_device(d) for d in reports)


class HeartbeatRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    #: The whole device set (it replaces the stored one); omitted means unchanged.
    devices: Devices | None = None
    agent_version: Annotated[str, Meta(max_length=100)] | None = None
    #: When the agent process started; a new value records a restart.
    agent_started_at: Annotated[datetime, Meta(tz=True)] | None = None
    #: The job kinds the agent takes (the kinds its claims name); empty: every kind; omitted: unchanged.
    kinds: Kinds | None = None

    def __post_init__(self) -> None:
        if self.agent_started_at is not None:
            self.agent_started_at = in_utc(self.agent_started_at, "agent_started_at")


class CordonRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``POST /v1/nodes/{id}/cordon``: the device (its label), and why, for whoever reads the node next."""

    device: Label
    reason: Annotated[str, Meta(min_length=1, max_length=MAX_CORDON_REASON)] | None = None


class UncordonRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    device: Label


class HeartbeatOut(msgspec.Struct, kw_only=True):
    node_id: UUID
    status: str
    heartbeat_interval_seconds: int


class NodeOut(msgspec.Struct, kw_only=True):
    id: UUID
    organization_id: UUID
    name: str
    status: str
    stored_status: str
    trust_domain: str
    locality: str | None
    transport: str | None
    last_heartbeat_at: TimestampText | None
    agent_version: str | None
    agent_started_at: TimestampText | None
    devices: list[dict[str, Any]]
    schedulable: bool
    created_at: TimestampText
    updated_at: TimestampText
    #: The job kinds its agent takes, as its heartbeat last reported them; null: not reported.
    kinds: list[str] | None = None
    #: Its devices an operator took out of service, by label, with the reason given (null: none given).
    cordoned: dict[str, str | None] = {}


class NodeList(msgspec.Struct, kw_only=True):
    nodes: list[NodeOut]


def rfc3339(value: datetime | None) -> str | None:
    return None if value is None else value.astimezone(timezone.utc).isoformat().replace("+00:00", "Z")


def node_out(view: nodes.NodeView) -> NodeOut:
    s = view.state
    return NodeOut(
        id=s.id,
        organization_id=s.organization_id,
        name=s.name,
        status=view.status,
        stored_status=s.status,
        trust_domain=s.trust_domain,
        locality=s.locality,
        transport=s.transport,
        last_heartbeat_at=rfc3339(view.last_seen_at),
        agent_version=s.agent_version,
        agent_started_at=rfc3339(s.agent_started_at),
        devices=[{**msgspec.to_builtins(d), "busy": is_busy(judged)} for d, judged in zip(s.devices, view.judged_devices)],
        schedulable=view.schedulable,
        created_at=rfc3339(s.created_at),
        updated_at=rfc3339(s.updated_at),
        kinds=None if s.kinds is None else list(s.kinds),
        cordoned=dict(s.cordoned),
    )


def _stale(request: Request) -> int:
    return request.app.state.services.settings.heartbeat_stale_seconds


async def agent_heartbeat(request: Request):
    services = request.app.state.services
    who = await authorized(request, "compute:heartbeat")
    body = await read_json(request, HeartbeatRequest)  # read with no connection held
    async with services.pool.connection() as conn:
        report = HeartbeatReport(
            devices=None if body.devices is None else to_devices(body.devices),
            agent_version=body.agent_version,
            agent_started_at=body.agent_started_at,
            kinds=None if body.kinds is None else tuple(body.kinds),
        )
        result = await heartbeat.heartbeat(
            conn,
            who.organization_id,
            who.node_id,
            report,
            event_interval_seconds=services.settings.heartbeat_event_seconds,
            stale_seconds=services.settings.heartbeat_stale_seconds,
            request_id=request_id(request),
            credential_id=who.credential_id,
        )
    interval = services.settings.heartbeat_interval_seconds
    return json_response(HeartbeatOut(node_id=result.node_id, status=result.status, heartbeat_interval_seconds=interval))


async def agent_offline(request: Request):
    """``POST /v1/agent/offline``: the agent is stopping on purpose (see ``compute.nodes.sign_off``)."""
    services = request.app.state.services
    who = await authorized(request, "compute:heartbeat")
    async with services.pool.connection() as conn:
        await nodes.sign_off(conn, who.organization_id, who.node_id, request_id=request_id(request))
        view = await nodes.node_view(conn, who.node_id, organization_id=who.organization_id, stale_seconds=_stale(request))
    return json_response(node_out(view))


async def list_nodes(request: Request):
    async with authenticated(request, "jobs:read", "nodes:admin") as (who, conn):
        statuses = query_statuses(request, NODE_STATUSES)
        views = await nodes.load_schedulable_view(conn, who.organization_id, stale_seconds=_stale(request), statuses=statuses)
    return json_response(NodeList(nodes=[node_out(v) for v in views]))


async def get_node(request: Request):
    async with authenticated(request, "jobs:read", "nodes:admin", "compute:read") as (who, conn):
        node_id = path_uuid(request, "id", code="node_not_found")
        view = None
        if who.node_id is None or who.node_id == node_id:
            view = await nodes.node_view(conn, node_id, organization_id=who.organization_id, stale_seconds=_stale(request))
    if view is None:
        raise nodes.node_not_found(node_id)
    return json_response(node_out(view))


def _admin_action(command):
    async def handle(request: Request):
        async with authenticated(request, "nodes:admin") as (who, conn):
            node_id = path_uuid(request, "id", code="node_not_found")
            await command(request, conn, who, node_id)
            view = await nodes.node_view(conn, node_id, organization_id=who.organization_id, stale_seconds=_stale(request))
        return json_response(node_out(view))

    return handle


async def _drain(request, conn, who, node_id):
    await nodes.drain_node(conn, who.organization_id, node_id, actor=who.actor, request_id=request_id(request),
                           stale_seconds=_stale(request))


async def _retire(request, conn, who, node_id):
    await nodes.retire_node(conn, who.organization_id, node_id, actor=who.actor, request_id=request_id(request),
                           stale_seconds=_stale(request))


async def _revoke(request, conn, who, node_id):
    _, revoked = await credentials.revoke_node(
        conn, who.organization_id, node_id, actor=who.actor, request_id=request_id(request), stale_seconds=_stale(request)
    )
    for credential_id in revoked:
        request.app.state.services.token_cache.forget_credential(credential_id)


async def _device_change(request: Request, body_type: type, change) -> Response:
    """A change of one device (a cordon, an uncordon): the credential, the node's id and the body first (read
    with no connection held), then ``change(conn, who, node_id, body)`` and the node as it leaves it."""
    who = await authorized(request, "nodes:admin")
    node_id = path_uuid(request, "id", code="node_not_found")
    body = await read_json(request, body_type)
    async with acting_as(request, who) as conn:
        await change(conn, who, node_id, body)
        view = await nodes.node_view(conn, node_id, organization_id=who.organization_id, stale_seconds=_stale(request))
    return json_response(node_out(view))


async def cordon(request: Request) -> Response:
    return await _device_change(request, CordonRequest, lambda conn, who, node_id, body: nodes.cordon_device(
        conn, who.organization_id, node_id, body.device, reason=body.reason, actor=who.actor, request_id=request_id(request),
        stale_seconds=_stale(request)))


async def uncordon(request: Request) -> Response:
    return await _device_change(request, UncordonRequest, lambda conn, who, node_id, body: nodes.uncordon_device(
        conn, who.organization_id, node_id, body.device, actor=who.actor, request_id=request_id(request),
        stale_seconds=_stale(request)))


def _admin_route(verb: str, command, summary: str, errors: dict[int, str] | None = None):
    return endpoint(
        "POST",
        f"/v1/nodes/{{id}}/{verb}",
        _admin_action(command),
        summary=summary,
        auth="api_key",
        scopes=("nodes:admin",),
        response=NodeOut,
        errors=errors,
    )


routes = [
    endpoint(
        "POST",
        "/v1/agent/heartbeat",
        agent_heartbeat,
        summary="Report liveness and the device set; promotes a provisioning or offline node to online.",
        auth="node",
        scopes=("compute:heartbeat",),
        body=HeartbeatRequest,
        response=HeartbeatOut,
    ),
    endpoint(
        "POST",
        "/v1/agent/offline",
        agent_offline,
        summary="The agent is stopping on purpose: an online node reads offline at once, until its next heartbeat.",
        auth="node",
        scopes=("compute:heartbeat",),
        response=NodeOut,
    ),
    endpoint(
        "GET",
        "/v1/nodes",
        list_nodes,
        summary="The organization's nodes with effective status and schedulability.",
        auth="api_key",
        scopes=("jobs:read", "nodes:admin"),
        query={"status": (str, False, "comma-separated effective statuses, e.g. online,draining (default: every node)")},
        response=NodeList,
    ),
    endpoint(
        "GET",
        "/v1/nodes/{id}",
        get_node,
        summary="One node; a node credential may read only its own.",
        auth="api_key|node",
        scopes=("jobs:read", "nodes:admin", "compute:read"),
        response=NodeOut,
    ),
    _admin_route("drain", _drain, "Drain a node: it finishes current work and takes no new.",
                 errors={409: "The node is retired (`node_retired`); retirement is final."}),
    _admin_route("retire", _retire, "Retire a node for good."),
    _admin_route("revoke", _revoke, "Revoke the node's credentials; they fail on their next request."),
    endpoint("POST", "/v1/nodes/{id}/cordon", cordon,
             summary="Take one device of the node out of service; the node's other devices go on taking work.",
             auth="api_key", scopes=("nodes:admin",), body=CordonRequest, response=NodeOut,
             errors={404: "No such node (`node_not_found`) or device (`device_not_found`).",
                     409: "The node is retired (`node_retired`)."}),
    endpoint("POST", "/v1/nodes/{id}/uncordon", uncordon,
             summary="Put a cordoned device back in service.",
             auth="api_key", scopes=("nodes:admin",), body=UncordonRequest, response=NodeOut,
             errors={404: "No such node (`node_not_found`) or device (`device_not_found`)."}),
]
