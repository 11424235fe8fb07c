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


async def test_service_role_reaches_projects_of_orgs_created_before_the_role_existed(pg_server_url, monkeypatch):
    """An organization created before 0006 got its tenant schema from 0002's function, which granted the
    service role nothing (the role did not exist yet). Upgraded, the service role must still reach that
    tenant's projects: a submission naming one was a 500 (permission denied for the schema)."""
    import umbra.migrate as migrations
    from psycopg import conninfo, sql

    name = f"umbra_svc_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(pg_server_url, autocommit=True) as c:
        c.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))
        c.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    url = conninfo.make_conninfo(pg_server_url, dbname=name)
    try:
        shipped = migrations.available_migrations()
        monkeypatch.setattr(migrations, "available_migrations", lambda: [m for m in shipped if m.version < 6])
        await migrations.migrate(url)
        async with await psycopg.AsyncConnection.connect(url, autocommit=True) as admin:
            org, _ = await create_organization(admin, "before-0006")
            project = await create_project(admin, org, "p")
        monkeypatch.setattr(migrations, "available_migrations", lambda: shipped)
        assert "0006_service_role.sql" in await migrations.migrate(url)
        async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
            assert await assume_service_role(conn)
            assert await project_exists(conn, org, project)
            assert not await project_exists(conn, org, uuid.uuid4())
    finally:
        with psycopg.connect(pg_server_url, autocommit=True) as c:
            c.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


async def test_service_role_cannot_record_a_migration(db_url):
    """A row of ``schema_migrations`` says a migration ran: one the service could write would make every
    later ``umbra migrate`` skip it."""
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as conn:
        assert await assume_service_role(conn)
        for statement in ("INSERT INTO schema_migrations (version, name) VALUES (9999, 'x')",
                          "UPDATE schema_migrations SET name = 'x'", "DELETE FROM schema_migrations"):  # fmt: skip
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                await conn.execute(statement)


async def test_a_login_role_that_may_not_assume_the_service_role_is_warned_of_once(db_url, pg_server_url, monkeypatch, caplog):
    """It runs as itself, the log kept by its trigger alone: said once per process, not per connection."""
    import umbra.db
    from psycopg import conninfo, sql

    monkeypatch.setattr(umbra.db, "_own_role_warned", False)
    role = f"umbra_plain_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(pg_server_url, autocommit=True) as c:
        c.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role)))
    try:
        for _ in range(2):
            async with await psycopg.AsyncConnection.connect(conninfo.make_conninfo(db_url, user=role), autocommit=True) as conn:
                assert not await assume_service_role(conn)
        warned = [r.getMessage() for r in caplog.records if getattr(r, "action", None) == "service_role_not_assumed"]
        assert len(warned) == 1 and warned[0].startswith(f"connections act as {role}, which may not assume umbra_service"), warned
    finally:
        with psycopg.connect(pg_server_url, autocommit=True) as c:
            c.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(role)))
