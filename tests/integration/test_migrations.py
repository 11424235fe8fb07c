"""Migrations: idempotent, serialised, and the head schema is what we expect."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import anyio
import psycopg
import pytest
from psycopg import conninfo, sql

from tests.helpers import ROOT, eventually, run_umbra, waiting_on_a_lock
from umbra.events.types import JOB_STATUSES, NODE_STATUSES
from umbra.migrate import available_migrations, migrate, pending_migrations

pytestmark = pytest.mark.anyio


async def test_migrating_an_empty_database_three_times_concurrently(pg_server_url):
    """One run applies every migration, the others none; no deadlock, though 0042 builds an index concurrently
    (a build that waits for every older snapshot: a migrator waiting for the lock in a statement held one)."""
    name = "umbra_mig_empty"
    with psycopg.connect(pg_server_url, autocommit=True) as c:
        c.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))
        c.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    url = conninfo.make_conninfo(pg_server_url, dbname=name)
    try:
        results: list[list[str]] = []

        async def run():
            results.append(await migrate(url))

        with anyio.fail_after(120):
            async with anyio.create_task_group() as tg:
                for _ in range(3):
                    tg.start_soon(run)
        names = [m.name for m in available_migrations()]
        assert sorted(results, key=len) == [[], [], names]
        assert await migrate(url) == []
        async with await psycopg.AsyncConnection.connect(url) as c:
            assert await pending_migrations(c) == []
            tables = {r[0] for r in await (await c.execute(
                "SELECT table_name FROM information_schema.tables WHERE table_schema = 'public'")).fetchall()}
        assert {"events", "organizations", "api_keys", "nodes", "node_credentials", "pairing_codes",
                "pairing_attempts", "models", "jobs", "schema_migrations", "node_liveness"} <= tables
    finally:
        with psycopg.connect(pg_server_url, autocommit=True) as c:
            c.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


async def _check_values(conn, table: str, constraint_column: str) -> set[str]:
    row = await (await conn.execute(
        "SELECT pg_get_constraintdef(oid) FROM pg_constraint WHERE conrelid = %s::regclass AND contype = 'c' "
        "AND pg_get_constraintdef(oid) LIKE %s", (table, f"%{constraint_column}%"))).fetchone()
    import re
    return set(re.findall(r"'([a-z_]+)'::text", row[0]))


async def test_status_spellings_agree_with_the_database(conn):
    assert await _check_values(conn, "jobs", "status") == set(JOB_STATUSES)
    assert await _check_values(conn, "nodes", "status") == set(NODE_STATUSES)


async def test_database_clock_can_be_offset_per_session(conn):
    base = (await (await conn.execute("SELECT umbra_now() - now()")).fetchone())[0]
    await conn.execute("SET umbra.clock_offset = '90 seconds'")
    moved = (await (await conn.execute("SELECT umbra_now() - now()")).fetchone())[0]
    assert base.total_seconds() == 0 and moved.total_seconds() == 90


async def test_nodes_revoked_before_revocation_meant_retired_are_retired_by_0028(conn, org):
    """Until 0028 a revoked node was folded to ``offline``; the migration brings stored views in line
    with today's fold, so verify finds them equal to a rebuild, and touches no other node."""
    from umbra.compute.credentials import revoke_node
    from umbra.projections.verify import verify

    from .queue_support import CPU64, add_node

    org_id, _ = org
    revoked, silent = await add_node(conn, org_id, "revoked", [CPU64]), await add_node(conn, org_id, "silent", [CPU64])
    await revoke_node(conn, org_id, revoked, actor="admin")
    # The views as the fold of old left them.
    await conn.execute("UPDATE nodes SET status = 'offline' WHERE id = %s", (revoked,))
    await conn.execute("UPDATE nodes SET status = 'offline' WHERE id = %s", (silent,))
    assert {d.get("id") for d in await verify(conn, org_id)} >= {str(revoked)}
    [migration] = [m for m in available_migrations() if m.version == 28]
    await conn.execute(migration.sql)
    rows = dict(await (await conn.execute("SELECT id, status FROM nodes WHERE organization_id = %s", (org_id,))).fetchall())
    assert rows == {revoked: "retired", silent: "offline"}
    differences = await verify(conn, org_id)
    assert all(d.get("id") != str(revoked) for d in differences), differences


async def test_a_database_migrated_through_0029_gets_the_kind_shapes_function_and_the_old_one_back(conn, db_url, org):
    """0029 first made ``umbra_queued_shapes`` return [kind, requirements] pairs. A database migrated then has
    version 29 recorded; 0031 adds ``umbra_queued_kind_shapes`` (what claims call) and gives the old name its
    requirements back, for servers of the version before 0029 still running during an upgrade."""
    from umbra.compute import claims

    from .queue_support import CPU64, add_node, submit

    org_id, _ = org
    [first_0029] = [m for m in available_migrations() if m.version == 29]
    await conn.execute("DELETE FROM schema_migrations WHERE version IN (30, 31)")
    await conn.execute("DROP FUNCTION umbra_queued_kind_shapes(uuid, integer)")
    await conn.execute("ALTER TABLE nodes DROP COLUMN kinds")
    await conn.execute(first_0029.sql.split("CREATE INDEX jobs_by_shape")[1].split(";", 1)[1])  # its function only
    assert await migrate(db_url) == ["0030_node_kinds.sql", "0031_kind_shapes_function.sql"]
    node = await add_node(conn, org_id, "box", [CPU64])
    job = await submit(conn, org_id, "echo", requires={"ram_min_mb": 10})
    old = [text for (text,) in await (await conn.execute("SELECT umbra_queued_shapes(%s, 10)", (org_id,))).fetchall()]
    assert old == ['{"ram_min_mb": 10}']  # requirements, as servers before 0029 decode them
    claimed = await claims.claim(conn, node_id=node, organization_id=org_id, lease_seconds=60)
    assert claimed is not None and claimed.job_id == job.id


async def test_containers_split_before_0036_are_placed_nowhere_as_today_s_fold_leaves_them(conn, org):
    """Until 0036 a container (a job split into children) kept its claim's placement, as if it still ran on
    the node that split it; the migration brings those rows in line with today's fold, so verify finds them
    equal to a rebuild, and leaves every other job's placement alone."""
    from umbra.compute import claims
    from umbra.projections.verify import verify

    from .queue_support import CPU64, add_node, spec, submit

    org_id, _ = org
    node = await add_node(conn, org_id, "box", [CPU64])
    parent = await submit(conn, org_id, "split")
    running = await claims.claim(conn, node_id=node, organization_id=org_id, lease_seconds=60)
    await claims.add_children(conn, organization_id=org_id, node_id=node, job_id=parent.id, attempt=running.attempt,
                              children=[spec("part")])  # fmt: skip
    child = await claims.claim(conn, node_id=node, organization_id=org_id, lease_seconds=60)
    placed = "SELECT placement IS NOT NULL FROM jobs WHERE id = %s"
    assert (await (await conn.execute(placed, (parent.id,))).fetchone())[0] is False
    # The row as the fold of old left it.
    await conn.execute("UPDATE jobs SET placement = (SELECT placement FROM jobs WHERE id = %s) WHERE id = %s",
                       (child.job_id, parent.id))  # fmt: skip
    assert any(d.get("id") == str(parent.id) for d in await verify(conn, org_id))
    [migration] = [m for m in available_migrations() if m.version == 36]
    await conn.execute(migration.sql)
    assert await verify(conn, org_id) == []
    assert (await (await conn.execute(placed, (child.job_id,))).fetchone())[0] is True


async def test_a_migration_marked_no_transaction_builds_its_index_concurrently_and_is_run_again_whole_after_failing(
    conn, db_url, org, monkeypatch
):
    """0042 built ``jobs_awaiting_dependencies`` concurrently (valid). A no-transaction migration that fails
    half-way (a unique index the data refuses: PostgreSQL leaves the failed concurrent build behind, invalid)
    is not recorded; run again once the data allows it, it drops what was left and builds the index whole."""
    import umbra.migrate as migrations

    from .queue_support import submit

    org_id, _ = org
    valid = "SELECT indisvalid FROM pg_index WHERE indexrelid = to_regclass(%s)"
    assert await (await conn.execute(valid, ("jobs_awaiting_dependencies",))).fetchone() == (True,)
    [first, _] = [await submit(conn, org_id, "same") for _ in range(2)]
    extra = migrations.Migration(9001, "9001_unique_kinds.sql", (
        "-- umbra: no transaction\n-- a test's\nDROP INDEX CONCURRENTLY IF EXISTS jobs_unique_kind;\n"
        "CREATE UNIQUE INDEX CONCURRENTLY jobs_unique_kind ON jobs (kind);\n"))  # fmt: skip
    shipped = migrations.available_migrations()
    monkeypatch.setattr(migrations, "available_migrations", lambda: [*shipped, extra])
    assert not extra.transactional and len(extra.statements()) == 2
    with pytest.raises(psycopg.errors.UniqueViolation):
        await migrate(db_url)
    assert await (await conn.execute(valid, ("jobs_unique_kind",))).fetchone() == (False,)  # left behind, invalid
    assert await pending_migrations(conn) == ["9001_unique_kinds.sql"]
    await conn.execute("UPDATE jobs SET kind = 'other' WHERE id = %s", (first.id,))
    assert await migrate(db_url) == ["9001_unique_kinds.sql"]
    assert await (await conn.execute(valid, ("jobs_unique_kind",))).fetchone() == (True,)
    assert await pending_migrations(conn) == []


def test_a_no_transaction_migration_is_split_at_semicolons_ending_a_line_only():
    from umbra.migrate import Migration

    [shipped] = [m for m in available_migrations() if m.version == 42]
    [queue_view] = [m for m in available_migrations() if m.name.endswith("_queue_view_indexes.sql")]
    assert [m.version for m in available_migrations() if not m.transactional] == [42, 43, 45, queue_view.version, 52, 53]
    assert [next(line for line in s.splitlines() if not line.startswith("--")) for s in queue_view.statements()] == [
        "DROP INDEX CONCURRENTLY IF EXISTS jobs_running_and_blocked_listed",
        "CREATE INDEX CONCURRENTLY jobs_running_and_blocked_listed ON jobs (organization_id, status, priority, seq)",
        "DROP INDEX CONCURRENTLY IF EXISTS jobs_by_position",
        "CREATE INDEX CONCURRENTLY jobs_by_position ON jobs (organization_id, position)"]
    assert shipped.statements()[1] == "CREATE INDEX CONCURRENTLY jobs_awaiting_dependencies ON jobs (id) WHERE awaiting_dependencies"
    text = ("-- umbra: no transaction\n-- first drop it;\nSELECT ';' AS a, 'x; y' AS b;  \n"
            "SELECT 2\n  ;\t\n\n-- trailing comment;\n")  # fmt: skip
    first, second = Migration(1, "0001_x.sql", text).statements()
    assert first.endswith("SELECT ';' AS a, 'x; y' AS b") and second == "SELECT 2"
    assert Migration(1, "0001_x.sql", "-- umbra: no transaction\n-- nothing;\n").statements() == []
    assert Migration(1, "0001_x.sql", "-- a comment first\n-- umbra: no transaction\nSELECT 1;\n").transactional


async def test_a_database_owner_who_may_not_create_roles_migrates_once_the_service_role_is_made_for_it(pg_server_url):
    """A managed or shared server's owner of the database is no superuser and may lack CREATEROLE; the
    service role is then made, once, by someone who may (README). PostgreSQL checks the right to create a
    role before whether it exists, so 0006's ``CREATE ROLE`` failed the migration even so."""
    from umbra.db import assume_service_role

    suffix = uuid.uuid4().hex[:12]
    owner, name = f"umbra_owner_{suffix}", f"umbra_mig_owner_{suffix}"
    with psycopg.connect(pg_server_url, autocommit=True) as c:
        c.execute(sql.SQL("CREATE ROLE {} LOGIN NOSUPERUSER NOCREATEROLE NOCREATEDB").format(sql.Identifier(owner)))
        c.execute("DO $$ BEGIN CREATE ROLE umbra_service NOLOGIN; EXCEPTION WHEN duplicate_object THEN NULL; END $$")
        c.execute(sql.SQL("GRANT umbra_service TO {}").format(sql.Identifier(owner)))
        c.execute(sql.SQL("CREATE DATABASE {} OWNER {}").format(sql.Identifier(name), sql.Identifier(owner)))
    url = conninfo.make_conninfo(pg_server_url, dbname=name, user=owner)
    try:
        assert [m.name for m in available_migrations()] == await migrate(url)
        async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
            assert await assume_service_role(conn)
            assert await pending_migrations(conn) == []
    finally:
        with psycopg.connect(pg_server_url, autocommit=True) as c:
            c.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))
            c.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(owner)))


async def _undo_node_kinds(conn) -> None:
    """The database as 0029 left it: 0030 (``ALTER TABLE nodes``: a lock no reader of ``nodes`` may share) and
    0031 pending."""
    await conn.execute("DELETE FROM schema_migrations WHERE version IN (30, 31)")
    await conn.execute("DROP FUNCTION umbra_queued_kind_shapes(uuid, integer)")
    await conn.execute("ALTER TABLE nodes DROP COLUMN kinds")


async def _has_node_kinds(conn) -> bool:
    row = await (await conn.execute("SELECT count(*) FROM information_schema.columns WHERE table_name = 'nodes' "
                                    "AND column_name = 'kinds'")).fetchone()  # fmt: skip
    return row[0] == 1


@pytest.mark.timeout(180)
async def test_umbra_migrate_behind_an_operators_open_transaction_gives_up_naming_it_and_the_writers_go_on(conn, db_url, org):
    """An operator's transaction left open after reading ``nodes`` (psql: ``BEGIN; SELECT ... FROM nodes;``)
    holds a lock 0030 cannot share. `umbra migrate` waited for it without bound, and its lock request, queued
    ahead of every later one, held every submission (each reads ``nodes``) until the service's own lock
    waits failed them. Now each try waits at most UMBRA_MIGRATE_LOCK_TIMEOUT_SECONDS, the submissions queued
    behind it go through, and after its tries the command exits 1 with one line naming the operator's
    session, 0030 not applied; once that transaction ends, migrating applies it."""
    from umbra.db import _configure

    from .queue_support import submit

    org_id, _ = org
    await _undo_node_kinds(conn)
    env = {**os.environ, "UMBRA_DATABASE_URL": db_url, "UMBRA_MIGRATE_LOCK_TIMEOUT_SECONDS": "0.5"}
    async with await psycopg.AsyncConnection.connect(db_url, application_name="operator psql") as operator, \
            await psycopg.AsyncConnection.connect(db_url, autocommit=True) as service:  # fmt: skip
        await _configure(service)  # as a server's pooled connection: the service role, lock waits bounded at 5 s
        await operator.execute("SELECT count(*) FROM nodes")  # and then left idle in its transaction
        process = subprocess.Popen([sys.executable, "-m", "umbra.cli", "migrate"], cwd=ROOT, env=env,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
        try:
            await eventually(lambda: waiting_on_a_lock(conn), timeout=60)
            with anyio.fail_after(60):
                for _ in range(5):  # through the tries and the pauses between them
                    await submit(service, org_id, "during")
            out, err = await anyio.to_thread.run_sync(lambda: process.communicate(timeout=120))
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
        assert process.returncode == 1 and err.count("\n") == 1, (process.returncode, out, err)
        assert err.startswith("umbra: migration_blocked: 0030_node_kinds.sql was not applied"), err
        assert f"pid {operator.info.backend_pid} (application_name 'operator psql', user " in err, err
        assert "idle in transaction" in err and "UMBRA_MIGRATE_LOCK_TIMEOUT_SECONDS" in err, err
        assert not await _has_node_kinds(conn)
        assert (await pending_migrations(conn))[:2] == ["0030_node_kinds.sql", "0031_kind_shapes_function.sql"]
        await operator.rollback()
    done = await anyio.to_thread.run_sync(lambda: run_umbra("migrate", env={"UMBRA_DATABASE_URL": db_url}))
    assert done.returncode == 0 and "0030_node_kinds.sql, 0031_kind_shapes_function.sql" in done.stdout, done.stderr
    assert await _has_node_kinds(conn) and await pending_migrations(conn) == []


async def test_a_migration_blocked_in_a_transaction_is_rolled_back_whole_and_one_stopped_waiting_for_locks_goes_on(
    conn, db_url, monkeypatch
):
    """A migration in a transaction whose lock another session holds through every try applies nothing of
    itself (its first statement done, its second refused: rolled back whole), and is refused naming the
    session; one whose lock is let go between its tries is applied, as if nothing had held it."""
    import umbra.migrate as migrations

    extra = migrations.Migration(9001, "9001_note.sql", "CREATE TABLE migration_notes (note text);\n"
                                                        "ALTER TABLE jobs ADD COLUMN note text;\n")  # fmt: skip
    shipped = migrations.available_migrations()
    monkeypatch.setattr(migrations, "available_migrations", lambda: [*shipped, extra])
    async with await psycopg.AsyncConnection.connect(db_url, application_name="report") as holder:
        await holder.execute("LOCK jobs IN ACCESS SHARE MODE")
        with pytest.raises(migrations.MigrationBlocked) as blocked:
            await migrate(db_url, lock_timeout_seconds=0.5)
        assert [(h.pid, h.application_name, h.state) for h in blocked.value.holders] == [
            (holder.info.backend_pid, "report", "idle in transaction")]
        assert blocked.value.code == "migration_blocked" and f"pid {holder.info.backend_pid} " in blocked.value.message
        exists = "SELECT to_regclass('migration_notes') IS NOT NULL, count(*) FROM information_schema.columns " \
                 "WHERE table_name = 'jobs' AND column_name = 'note'"  # fmt: skip
        assert await (await conn.execute(exists)).fetchone() == (False, 0)
        assert await pending_migrations(conn) == ["9001_note.sql"]

        async def let_go_once_waited_for() -> None:
            await eventually(lambda: waiting_on_a_lock(conn), timeout=60)
            await holder.rollback()

        async with anyio.create_task_group() as tg:
            tg.start_soon(let_go_once_waited_for)
            assert await migrate(db_url, lock_timeout_seconds=0.5) == ["9001_note.sql"]
    assert await (await conn.execute(exists)).fetchone() == (True, 1)


async def test_a_no_transaction_migration_stopped_waiting_for_a_snapshot_is_not_recorded_and_is_run_again_whole(
    conn, db_url, monkeypatch
):
    """A concurrent index build waits for every transaction holding a snapshot older than its own, an
    operator's repeatable-read one that read any table included: it waited for it without bound. Bounded,
    the build stops with its index left invalid, the migration is not recorded and is refused naming the
    session; run again once it ended, it drops that index and builds it whole."""
    import umbra.migrate as migrations

    extra = migrations.Migration(9002, "9002_jobs_by_kind.sql", (
        "-- umbra: no transaction\nDROP INDEX CONCURRENTLY IF EXISTS jobs_by_kind_test;\n"
        "CREATE INDEX CONCURRENTLY jobs_by_kind_test ON jobs (kind);\n"))  # fmt: skip
    shipped = migrations.available_migrations()
    monkeypatch.setattr(migrations, "available_migrations", lambda: [*shipped, extra])
    valid = "SELECT indisvalid FROM pg_index WHERE indexrelid = to_regclass('jobs_by_kind_test')"
    async with await psycopg.AsyncConnection.connect(db_url, application_name="audit") as holder:
        await holder.set_isolation_level(psycopg.IsolationLevel.REPEATABLE_READ)
        await holder.execute("SELECT count(*) FROM organizations")
        with pytest.raises(migrations.MigrationBlocked) as blocked:
            await migrate(db_url, lock_timeout_seconds=0.5)
        assert [(h.pid, h.application_name) for h in blocked.value.holders] == [(holder.info.backend_pid, "audit")]
        assert await pending_migrations(conn) == ["9002_jobs_by_kind.sql"]
        assert await (await conn.execute(valid)).fetchone() == (False,)  # left behind, invalid
    assert await migrate(db_url) == ["9002_jobs_by_kind.sql"]
    assert await (await conn.execute(valid)).fetchone() == (True,)
