"""Pairing over HTTP: an administrator asks for a code, an agent redeems it.

Redemption is the one unauthenticated write in the API. It is charged against
the caller's source (its address, an IPv6 one's network: :func:`.http.address_block`)
before anything else is looked at (see :mod:`umbra.compute.pairing`), and answers
wrong, expired and used codes alike.
"""

from __future__ import annotations

from typing import Annotated
from uuid import UUID

import msgspec
from msgspec import Meta
from starlette.requests import Request

from umbra.compute import pairing
from umbra.compute.auth import NODE_SCOPES
from umbra.domain.device_reports import Label, Word
from umbra.errors import InvalidRequest
from umbra.events.types import TimestampText

from .http import authorized, json_response, rate_limit_source, read_json
from .http import request_id
from .nodes import Devices, rfc3339, to_devices
from .routing import endpoint


class PairingRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    name: Label
    trust_domain: Annotated[str, Meta(min_length=1, max_length=pairing.TRUST_DOMAIN_MAX_LENGTH)] = "local"
    locality: Annotated[str, Meta(max_length=pairing.LOCALITY_MAX_LENGTH)] | None = None
    ttl_seconds: Annotated[int, Meta(ge=pairing.TTL_MIN_SECONDS, le=pairing.TTL_MAX_SECONDS)] = pairing.TTL_DEFAULT_SECONDS


class PairingOut(msgspec.Struct, kw_only=True):
    #: Six digits, shown only in this response.
    code: str
    node_name: str
    expires_at: TimestampText
    pairing_id: UUID


class RedeemRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    code: Annotated[str, Meta(max_length=32)]
    name: Label
    agent_version: Annotated[str, Meta(max_length=100)] | None = None
    devices: Devices = []
    transport: Word | None = None


class RedeemOut(msgspec.Struct, kw_only=True):
    node_id: UUID
    #: The node credential, shown only in this response.
    credential: str
    scopes: list[str]


async def create_pairing(request: Request):
    who = await authorized(request, "nodes:admin")
    body = await read_json(request, PairingRequest)  # read with no connection held
    issued = await pairing.issue_pairing_code(
        request.app.state.services.pool,  # borrowed around the hash, not held across it
        who.organization_id,
        body.name,
        trust_domain=body.trust_domain,
        locality=body.locality,
        ttl_seconds=body.ttl_seconds,
        issuer=who,  # not revoked while the body arrived, nor while the code was hashed
    )
    out = PairingOut(code=issued.code, node_name=issued.node_name, expires_at=rfc3339(issued.expires_at), pairing_id=issued.id)
    return json_response(out, status=201, headers={"Cache-Control": "no-store"})


async def redeem_pairing(request: Request):
    pool = request.app.state.services.pool
    source = rate_limit_source(request)
    try:
        body = await read_json(request, RedeemRequest)
        devices = to_devices(body.devices)
    except InvalidRequest:
        # An invalid body is an attempt too: past the budget it gets 429, not 422, whatever it carries.
        async with pool.connection() as conn:
            await pairing.charge_attempt(conn, source)
        raise
    redeemed = await pairing.redeem_pairing_code(
        pool,  # borrowed around the hashes, not held across them
        code=body.code,
        name=body.name,
        source=source,
        agent_version=body.agent_version,
        devices=devices,
        transport=body.transport,
        request_id=request_id(request),
    )
    out = RedeemOut(node_id=redeemed.node_id, credential=redeemed.credential, scopes=list(redeemed.scopes))
    return json_response(out, status=201, headers={"Cache-Control": "no-store"})


routes = [
    endpoint(
        "POST",
        "/v1/pairings",
        create_pairing,
        summary="Issue a single-use six-digit pairing code for a named node (shown once).",
        auth="api_key",
        scopes=("nodes:admin",),
        body=PairingRequest,
        success=(201,),
        response=PairingOut,
    ),
    endpoint(
        "POST",
        "/v1/pairings/redeem",
        redeem_pairing,
        summary=f"Redeem a pairing code: creates the node and returns a credential with {', '.join(NODE_SCOPES)}.",
        auth="none",
        body=RedeemRequest,
        success=(201,),
        response=RedeemOut,
        errors={
            401: "Wrong, expired or used code (`pairing_code_invalid`: one answer for all three).",
            409: "The code was issued for another name (`pairing_name_mismatch`), or a node of that name exists "
            "(`node_name_taken`).",
            429: "Over 20 attempts from this source address (an IPv6 client's /64 by default) in 15 minutes "
            "(`rate_limited`, with `Retry-After`), checked before the code.",
            503: "The database is unavailable (`database_unavailable`, with `Retry-After: 1`); send the request again.",
        },
    ),
]
