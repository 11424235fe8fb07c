"""The service's database role can append events but never rewrite them."""

from __future__ import annotations

import uuid

import psycopg
import pytest

from umbra.compute.accounts import create_organization, create_project, project_exists
from umbra.db import assume_service_role
from umbra.events import store
from umbra.events.types import NodeDraining

pytestmark = pytest.mark.anyio


async def test_service_role_may_append_but_not_update_or_delete_events(db_url):
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as conn:
        assert await assume_service_role(conn)
        assert (await (await conn.execute("SELECT current_user")).fetchone())[0] == "umbra_service"
        org, _ = await create_organization(conn, "svc")
        await store.append(conn, store.node_stream(uuid.uuid4()), 0, [NodeDraining()], organization_id=org)
        for statement in ("UPDATE events SET type = 'x'", "DELETE FROM events", "TRUNCATE events"):
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                await conn.execute(statement)
        # privileges, not only the trigger: the grant is missing
        row = await (await conn.execute(
            "SELECT has_table_privilege('umbra_service', 'events', 'UPDATE'),"
            " has_table_privilege('umbra_service', 'events', 'DELETE'),"
            " has_table_privilege('umbra_service', 'events', 'INSERT')")).fetchone()
        assert row == (False, False, True)


async def test_service_role_reaches_projects_of_orgs_created_by_the_admin(db_url):
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as admin:
        org, _ = await create_organization(admin, "by-admin")
        project = await create_project(admin, org, "p")
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as conn:
        assert await assume_service_role(conn)
        assert await project_exists(conn, org, project)
        assert not await project_exists(conn, org, uuid.uuid4())
