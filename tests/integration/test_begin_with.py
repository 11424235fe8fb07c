"""``db.begin_with``: BEGIN and a first statement in one round trip, parameters still bound by the driver."""

from __future__ import annotations

import uuid

import psycopg
import pytest
from psycopg.pq import TransactionStatus

from umbra.db import begin_with

pytestmark = pytest.mark.anyio


async def test_it_opens_a_transaction_that_commit_and_rollback_end(conn):
    await conn.execute("CREATE TABLE t (v text)")
    cursor = await begin_with(conn, "INSERT INTO t VALUES (%(v)s) RETURNING v", {"v": "kept?"})
    assert await cursor.fetchall() == [("kept?",)]
    assert conn.info.transaction_status == TransactionStatus.INTRANS
    await conn.rollback()
    assert conn.info.transaction_status == TransactionStatus.IDLE
    assert await (await conn.execute("SELECT count(*) FROM t")).fetchone() == (0,)

    await begin_with(conn, "INSERT INTO t VALUES (%(v)s)", {"v": "kept"})
    await conn.execute("COMMIT")
    assert await (await conn.execute("SELECT v FROM t")).fetchall() == [("kept",)]


async def test_parameters_are_data_not_sql(conn):
    """Client-side binding quotes values: a value shaped like SQL stays a value."""
    await conn.execute("CREATE TABLE t (v text)")
    hostile = "x'); DROP TABLE t; --"
    ids = [uuid.uuid4(), uuid.uuid4()]
    cursor = await begin_with(conn, "SELECT %(v)s::text, %(ids)s::uuid[]", {"v": hostile, "ids": ids})
    assert await cursor.fetchall() == [(hostile, ids)]
    await conn.execute("COMMIT")
    assert await (await conn.execute("SELECT count(*) FROM t")).fetchone() == (0,)


async def test_a_failing_first_statement_leaves_a_failed_transaction_to_roll_back(conn):
    with pytest.raises(psycopg.errors.UndefinedTable):
        await begin_with(conn, "SELECT * FROM no_such_table WHERE id = %(id)s", {"id": 1})
    assert conn.info.transaction_status == TransactionStatus.INERROR
    await conn.rollback()
    assert await (await conn.execute("SELECT 1")).fetchone() == (1,)
