"""The per-organization model registry over HTTP."""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta
from starlette.requests import Request

from umbra.compute import models
from umbra.domain.device_reports import Megabytes, Word
from umbra.domain.models import RegisteredModel
from umbra.events.types import TimestampText

from .http import acting_as, authenticated, authorized, json_response, read_json, request_id
from .nodes import rfc3339
from .routing import endpoint


class ModelRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    kind: Word = "llm"
    vram_min_mb: Megabytes
    vram_preferred_mb: Megabytes | None = None
    ram_min_mb: Megabytes | None = None
    requires_accelerators: Annotated[list[Word], Meta(max_length=32)] = []
    reference_throughput: Annotated[float, Meta(gt=0)] | None = None
    load_seconds: Annotated[float, Meta(ge=0)] | None = None


class ModelOut(msgspec.Struct, kw_only=True):
    slug: str
    kind: str
    vram_min_mb: int
    vram_preferred_mb: int | None
    ram_min_mb: int | None
    #: RAM needed from system memory: ``ram_min_mb``, or the VRAM floor when unmeasured.
    ram_floor_mb: int
    requires_accelerators: list[str]
    reference_throughput: float | None
    load_seconds: float | None
    updated_at: TimestampText | None


class ModelList(msgspec.Struct, kw_only=True):
    models: list[ModelOut]


def model_out(m: RegisteredModel) -> ModelOut:
    return ModelOut(
        slug=m.slug,
        kind=m.kind,
        vram_min_mb=m.vram_min_mb,
        vram_preferred_mb=m.vram_preferred_mb,
        ram_min_mb=m.ram_min_mb,
        ram_floor_mb=m.ram_floor_mb,
        requires_accelerators=list(m.requires_accelerators),
        reference_throughput=m.reference_throughput,
        load_seconds=m.load_seconds,
        updated_at=rfc3339(m.updated_at),
    )


async def list_models(request: Request):
    async with authenticated(request, "jobs:read", "nodes:admin", "compute:read") as (who, conn):
        registry = await models.list_models(conn, who.organization_id)
    return json_response(ModelList(models=[model_out(m) for m in registry]))


async def put_model(request: Request):
    slug = request.path_params["slug"]
    who = await authorized(request, "nodes:admin")
    body = await read_json(request, ModelRequest)  # read with no connection held
    async with acting_as(request, who) as conn:  # not revoked while the body arrived
        spec = RegisteredModel(
            slug=slug,
            kind=body.kind,
            vram_min_mb=body.vram_min_mb,
            vram_preferred_mb=body.vram_preferred_mb,
            ram_min_mb=body.ram_min_mb,
            requires_accelerators=tuple(body.requires_accelerators),
            reference_throughput=body.reference_throughput,
            load_seconds=body.load_seconds,
        )
        stored = await models.upsert_model(conn, who.organization_id, spec, request_id=request_id(request))
    return json_response(model_out(stored))


async def delete_model(request: Request):
    who = await authorized(request, "nodes:admin")
    async with acting_as(request, who) as conn:
        removed = await models.remove_model(conn, who.organization_id, request.path_params["slug"],
                                            request_id=request_id(request))  # fmt: skip
    return json_response(model_out(removed))


routes = [
    endpoint(
        "GET",
        "/v1/models",
        list_models,
        summary="The organization's model registry.",
        auth="api_key|node",
        scopes=("jobs:read", "nodes:admin", "compute:read"),
        response=ModelList,
    ),
    endpoint(
        "PUT",
        "/v1/models/{slug:path}",
        put_model,
        summary="Create or replace a model in the organization's registry.",
        auth="api_key",
        scopes=("nodes:admin",),
        body=ModelRequest,
        response=ModelOut,
    ),
    endpoint(
        "DELETE",
        "/v1/models/{slug:path}",
        delete_model,
        summary="Remove a model from the organization's registry; queued and blocked jobs naming it are blocked "
        "model_not_registered. Answers the model as it was registered.",
        auth="api_key",
        scopes=("nodes:admin",),
        response=ModelOut,
        errors={404: "No model of that slug is registered (`model_not_found`)."},
    ),
]
