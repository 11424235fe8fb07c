"""The per-organization model registry.

The registry is configuration, not a stream of transitions: an upsert replaces
the model's whole specification (PUT semantics). Eligibility reads it through
:func:`load_models`; a job naming a slug missing here is blocked with that
reason by the queue.
"""

from __future__ import annotations

import logging
import re
from uuid import UUID

import psycopg

from umbra.domain.models import RegisteredModel
from umbra.errors import InvalidRequest, NotFound

from .blocked import hold_capacity, reexamine_waiting_jobs
from .nodes import capacity_cause, guard_against_claims

log = logging.getLogger(__name__)

#: Slugs such as ``gemma4:26b`` or ``meta-llama/Llama-3-8B``.
SLUG = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,199}$")

_COLUMNS = (
    "slug, kind, vram_min_mb, vram_preferred_mb, ram_min_mb, requires_accelerators, "
    "reference_throughput, load_seconds, updated_at"
)
_UPSERT = f"""
INSERT INTO models (organization_id, slug, kind, vram_min_mb, vram_preferred_mb, ram_min_mb,
                    requires_accelerators, reference_throughput, load_seconds, updated_at)
VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, umbra_now())
ON CONFLICT (organization_id, slug) DO UPDATE SET
    kind = EXCLUDED.kind, vram_min_mb = EXCLUDED.vram_min_mb, vram_preferred_mb = EXCLUDED.vram_preferred_mb,
    ram_min_mb = EXCLUDED.ram_min_mb, requires_accelerators = EXCLUDED.requires_accelerators,
    reference_throughput = EXCLUDED.reference_throughput, load_seconds = EXCLUDED.load_seconds,
    updated_at = EXCLUDED.updated_at
RETURNING {_COLUMNS}
"""
_LIST = f"SELECT {_COLUMNS} FROM models WHERE organization_id = %s ORDER BY slug"
_DELETE = f"DELETE FROM models WHERE organization_id = %s AND slug = %s RETURNING {_COLUMNS}"


def _model(row: tuple) -> RegisteredModel:
    slug, kind, vram_min, vram_preferred, ram_min, accelerators, throughput, load_seconds, updated_at = row
    return RegisteredModel(
        slug=slug,
        kind=kind,
        vram_min_mb=vram_min,
        vram_preferred_mb=vram_preferred,
        ram_min_mb=ram_min,
        requires_accelerators=tuple(accelerators),
        reference_throughput=throughput,
        load_seconds=load_seconds,
        updated_at=updated_at,
    )


def check_model(model: RegisteredModel) -> None:
    """Refuse specifications that cannot be right, naming the field."""
    if not SLUG.match(model.slug):
        raise InvalidRequest(
            "slug must be 1..200 characters of letters, digits and . _ : / @ + -, starting with a letter or digit.",
            field="slug",
        )
    if not model.kind.strip() or len(model.kind) > 100:
        raise InvalidRequest("kind must be 1..100 characters.", field="kind")
    if model.vram_preferred_mb is not None and model.vram_preferred_mb < model.vram_min_mb:
        raise InvalidRequest("vram_preferred_mb must be at least vram_min_mb (it is a target above the floor).", field="vram_preferred_mb")
    for name in model.requires_accelerators:
        if not name.strip() or len(name) > 50:
            raise InvalidRequest("requires_accelerators entries must be 1..50 characters.", field="requires_accelerators")


async def _change_registry(conn: psycopg.AsyncConnection, organization_id: UUID, statement: str, params: tuple, *,
                           request_id: str | None) -> tuple | None:  # fmt: skip
    """Run one change of the organization's registry and give its waiting jobs a second look, in one transaction.

    The claim guard first: no claim places work by the old entry once the
    change answers; then the capacity lock, as every change of what could run
    a job takes it. The re-examination is skipped when the change touched no
    row (nothing changed, and the caller refuses it).
    """
    async with conn.transaction():
        await guard_against_claims(conn, organization_id)
        await hold_capacity(conn, organization_id, exclusive=True)
        row = await (await conn.execute(statement, params)).fetchone()
        if row is not None:
            await reexamine_waiting_jobs(conn, organization_id, metadata=capacity_cause(None, request_id))
    return row


async def upsert_model(
    conn: psycopg.AsyncConnection, organization_id: UUID, model: RegisteredModel, *, request_id: str | None = None
) -> RegisteredModel:
    """Create or replace the organization's model ``model.slug``; blocked jobs get a second look."""
    check_model(model)
    params = (organization_id, model.slug, model.kind, model.vram_min_mb, model.vram_preferred_mb, model.ram_min_mb,
              sorted(set(model.requires_accelerators)), model.reference_throughput, model.load_seconds)  # fmt: skip
    row = await _change_registry(conn, organization_id, _UPSERT, params, request_id=request_id)
    assert row is not None  # an upsert always returns its row
    log.info("model registered", extra={"action": "model_upserted", "slug": model.slug})
    return _model(row)


async def remove_model(
    conn: psycopg.AsyncConnection, organization_id: UUID, slug: str, *, request_id: str | None = None
) -> RegisteredModel:
    """Remove the organization's model ``slug`` (a model withdrawn from service); returns what was registered.

    Work naming it gets a second look, as after any registry change: queued
    and blocked jobs naming it are blocked ``model_not_registered`` (and fail
    at the blocked timeout unless it is registered again). A job already
    placed by it runs on. A slug not registered writes nothing.
    """
    valid = SLUG.match(slug) is not None  # a slug no model can have is not looked for (nor echoed)
    row = await _change_registry(conn, organization_id, _DELETE, (organization_id, slug), request_id=request_id) if valid else None
    if row is None:
        raise NotFound("model_not_found", f"No model {slug if valid else 'of that slug'} is registered in this organization.")
    log.info("model removed", extra={"action": "model_removed", "slug": slug})
    return _model(row)


async def list_models(conn: psycopg.AsyncConnection, organization_id: UUID) -> list[RegisteredModel]:
    return [_model(row) for row in await (await conn.execute(_LIST, (organization_id,))).fetchall()]


async def load_models(conn: psycopg.AsyncConnection, organization_id: UUID) -> dict[str, RegisteredModel]:
    """The organization's registry keyed by slug, for eligibility."""
    return {m.slug: m for m in await list_models(conn, organization_id)}
