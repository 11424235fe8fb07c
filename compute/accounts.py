"""Organizations, their tenant schemas and projects, and API keys."""

from __future__ import annotations

from datetime import datetime
from typing import Any
from uuid import UUID, uuid4

import anyio
import psycopg
from psycopg import sql

from umbra.errors import InvalidRequest, NotFound
from umbra.events import store
from umbra.security import hash_secret, is_prefix, new_token, verify_secret

from .auth import API_KEY_KIND, API_KEY_SCOPES


def tenant_schema(organization_id: UUID) -> str:
    """The schema holding an organization's projects: derived, never supplied."""
    return f"tenant_{organization_id.hex}"


async def create_organization(conn: psycopg.AsyncConnection, name: str) -> tuple[UUID, str]:
    """Create an organization, its tenant schema and an all-scopes API key.

    Returns ``(organization_id, api_key)``; the key is shown only this once.
    """
    name = name.strip()
    if not name or len(name) > 200:
        raise InvalidRequest("name must be 1..200 characters.", field="name")
    org_id = uuid4()
    async with conn.transaction():
        await conn.execute("INSERT INTO organizations (id, name) VALUES (%s, %s)", (org_id, name))
        await conn.execute("SELECT create_tenant_schema(%s)", (org_id,))
        key = await _insert_api_key(conn, org_id, API_KEY_SCOPES)
    return org_id, key


async def _insert_api_key(conn: psycopg.AsyncConnection, organization_id: UUID, scopes) -> str:
    token, prefix = new_token(API_KEY_KIND)
    await conn.execute(
        "INSERT INTO api_keys (id, organization_id, prefix, secret_hash, scopes) VALUES (%s, %s, %s, %s, %s)",
        (uuid4(), organization_id, prefix, hash_secret(token), list(scopes)),
    )
    return token


async def create_api_key(conn: psycopg.AsyncConnection, organization_id: UUID, scopes: list[str]) -> str:
    unknown = sorted(set(scopes) - set(API_KEY_SCOPES))
    if unknown or not scopes:
        raise InvalidRequest(
            f"scopes must be a non-empty subset of {', '.join(API_KEY_SCOPES)}; unknown: {', '.join(unknown) or 'none'}.",
            field="scopes",
        )
    async with conn.transaction():
        await require_organization(conn, organization_id)
        return await _insert_api_key(conn, organization_id, sorted(set(scopes)))


async def list_api_keys(conn: psycopg.AsyncConnection, organization_id: UUID) -> list[dict[str, Any]]:
    """The organization's API keys, oldest first: id, prefix (the token's second part), scopes, dates.

    Never a secret or its hash: the token was shown once, at creation.
    """
    await require_organization(conn, organization_id)
    rows = await (await conn.execute(_KEYS, (organization_id,))).fetchall()
    return [{"id": str(key_id), "prefix": prefix, "scopes": list(scopes), "created_at": created.isoformat(),
             "revoked_at": revoked.isoformat() if revoked else None}
            for key_id, prefix, scopes, created, revoked in rows]  # fmt: skip


_KEYS = "SELECT id, prefix, scopes, created_at, revoked_at FROM api_keys WHERE organization_id = %s ORDER BY created_at, id"
_REVOKE_KEY = """
UPDATE api_keys SET revoked_at = coalesce(revoked_at, now())
WHERE id = %s AND organization_id = %s
RETURNING revoked_at
"""


#: What stands for a key's secret where only its prefix is shown (list-keys prints ``uk_<prefix>_…``),
#: as typed or pasted: a key named so is named by its prefix.
ELIDED_SECRET = ("…", "...")


async def api_key_named(conn: psycopg.AsyncConnection, organization_id: UUID, name: str) -> UUID:
    """The id of the organization's key ``name`` names: its id, its prefix (``uk_<prefix>``, what
    create-key printed, ``uk_<prefix>_…``, what list-keys prints, or the bare prefix) or the whole token.
    Refused when nothing, or more than one key, matches."""
    try:
        return UUID(name)
    except ValueError:
        pass
    name = name.strip()
    parts = name.split("_", 2)
    if len(parts) == 3 and parts[2] in ELIDED_SECRET:
        parts = parts[:2]
    prefix = parts[1] if len(parts) >= 2 and parts[0] == API_KEY_KIND else parts[0]
    rows = await (await conn.execute(_KEYS_BY_PREFIX, (organization_id, prefix))).fetchall()
    if len(parts) == 3:  # the whole key: it names only the key it verifies against, not any sharing its prefix
        rows = [row for row in rows if await anyio.to_thread.run_sync(verify_secret, row[1], name)]
    if not rows:  # named by its prefix only if it is one: a key mistyped (the secret alone, say) is not repeated
        named = f" (prefix {prefix})" if is_prefix(prefix) else ""
        raise NotFound("api_key_not_found", f"No such API key{named} in this organization; name it by its id or prefix, "
                       "as list-keys prints them, or by the whole key.")  # fmt: skip
    if len(rows) > 1:
        raise InvalidRequest(f"{len(rows)} keys share the prefix {prefix}; name one by its id (see list-keys).")
    return rows[0][0]


_KEYS_BY_PREFIX = "SELECT id, secret_hash FROM api_keys WHERE organization_id = %s AND prefix = %s"


async def revoke_api_key(conn: psycopg.AsyncConnection, organization_id: UUID, key_id: UUID) -> datetime:
    """Revoke one of the organization's API keys; returns when it was revoked (the first time: idempotent).

    Every request re-checks ``revoked_at`` (:mod:`umbra.compute.auth`), an open
    stream before each read: the key fails at once in every server process. The
    organization's streams are asked to read now (:func:`store.ask_recheck`), so
    one of this key's ends at once, not at its next wake.
    """
    row = await (await conn.execute(_REVOKE_KEY, (key_id, organization_id))).fetchone()
    if row is None:
        raise NotFound("api_key_not_found", f"No API key {key_id} in this organization.")
    await store.ask_recheck(conn, organization_id)
    return row[0]


async def require_organization(conn: psycopg.AsyncConnection, organization_id: UUID) -> None:
    row = await (await conn.execute("SELECT 1 FROM organizations WHERE id = %s", (organization_id,))).fetchone()
    if row is None:
        raise NotFound("organization_not_found", f"No organization {organization_id}.")


async def create_project(conn: psycopg.AsyncConnection, organization_id: UUID, name: str) -> UUID:
    name = name.strip()
    if not name or len(name) > 200:
        raise InvalidRequest("name must be 1..200 characters.", field="name")
    project_id = uuid4()
    async with conn.transaction():
        await require_organization(conn, organization_id)
        await conn.execute(
            sql.SQL("INSERT INTO {}.projects (id, name) VALUES (%s, %s)").format(
                sql.Identifier(tenant_schema(organization_id))
            ),
            (project_id, name),
        )
    return project_id


async def project_exists(conn: psycopg.AsyncConnection, organization_id: UUID, project_id: UUID) -> bool:
    """True only when the project is in *this* organization's schema.

    Addressed by explicit schema name, never ``search_path``: another tenant's
    project and a missing one are the same observation from here.
    """
    row = await (
        await conn.execute(
            sql.SQL("SELECT 1 FROM {}.projects WHERE id = %s").format(sql.Identifier(tenant_schema(organization_id))),
            (project_id,),
        )
    ).fetchone()
    return row is not None
