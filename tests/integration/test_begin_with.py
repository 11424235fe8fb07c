"""``db.begin_with``: BEGIN and prepared reads in one round trip, arguments still bound by the driver."""

from __future__ import annotations

import uuid

import psycopg
import pytest
from psycopg.pq import TransactionStatus

from umbra.db import PreparedStatement, begin_with, run_together, text_array, uuid_array

pytestmark = pytest.mark.anyio

INSERT = PreparedStatement("test_insert", "INSERT INTO t VALUES (%(v)s) RETURNING v")


async def _prepared(conn) -> list[str]:
    return [name for (name,) in await (await conn.execute("SELECT name FROM pg_prepared_statements ORDER BY name")).fetchall()]


def test_placeholders_become_positional_parameters_in_first_use_order():
    read = PreparedStatement("r", "SELECT * FROM t WHERE a = ANY(%(ids)s) AND b = %(org)s AND c = ANY(%(ids)s)")
    assert read.prepare == "PREPARE r AS SELECT * FROM t WHERE a = ANY($1) AND b = $2 AND c = ANY($1)"
    assert read.execute == "EXECUTE r(%(ids)s, %(org)s)"
    assert PreparedStatement("p", "SELECT 'a%%' || %(x)s").prepare == "PREPARE p AS SELECT 'a%' || $1"


async def test_it_opens_a_transaction_that_commit_and_rollback_end(conn):
    await conn.execute("CREATE TABLE t (v text)")
    assert await begin_with(conn, [(INSERT, {"v": "kept?"})]) == [[("kept?",)]]
    assert conn.info.transaction_status == TransactionStatus.INTRANS
    await conn.rollback()
    assert conn.info.transaction_status == TransactionStatus.IDLE
    assert await (await conn.execute("SELECT count(*) FROM t")).fetchone() == (0,)

    await begin_with(conn, [(INSERT, {"v": "kept"})], generic_plans=True)
    assert await (await conn.execute("SHOW plan_cache_mode")).fetchone() == ("force_generic_plan",)
    await conn.execute("COMMIT")
    assert await (await conn.execute("SELECT v FROM t")).fetchall() == [("kept",)]
    assert await (await conn.execute("SHOW plan_cache_mode")).fetchone() == ("auto",)  # SET LOCAL: that transaction only
    assert await _prepared(conn) == ["test_insert"]  # prepared once for the connection


async def test_a_literal_percent_sign_survives(conn):
    read = PreparedStatement("test_percent", "SELECT 'a%%' || %(x)s::text")
    assert await begin_with(conn, [(read, {"x": "%b"})]) == [[("a%%b",)]]
    await conn.rollback()


async def test_arguments_are_data_not_sql(conn):
    """Client-side binding quotes values: a value shaped like SQL stays a value."""
    await conn.execute("CREATE TABLE t (v text)")
    hostile = "x'); DROP TABLE t; --"
    ids = [uuid.uuid4(), uuid.uuid4()]
    read = PreparedStatement("test_echo", "SELECT %(v)s::text, %(ids)s::uuid[], (SELECT count(*) FROM t WHERE v = ANY(%(none)s))")
    assert await begin_with(conn, [(read, {"v": hostile, "ids": ids, "none": []})]) == [[(hostile, ids, 0)]]
    await conn.execute("COMMIT")
    assert await (await conn.execute("SELECT count(*) FROM t")).fetchone() == (0,)


async def test_a_deallocated_family_is_prepared_again_and_the_reads_sent_once_more(conn):
    await conn.execute("CREATE TABLE t (v text)")
    later = PreparedStatement("test_later", "SELECT count(*) FROM t")
    await begin_with(conn, [(INSERT, {"v": "a"})], family=[later])
    await conn.execute("COMMIT")
    assert await _prepared(conn) == ["test_insert", "test_later"]  # the whole family, with the reads
    await conn.execute("DEALLOCATE ALL")
    assert await begin_with(conn, [(INSERT, {"v": "b"})], family=[later]) == [[("b",)]]
    assert await run_together(conn, [(later, {})], then="COMMIT") == [[(2,)]]  # prepared again with the reads
    assert await (await conn.execute("SELECT v FROM t ORDER BY v")).fetchall() == [("a",), ("b",)]


async def test_a_statement_whose_table_changed_is_prepared_afresh(conn):
    """A migration that changes the columns a prepared statement returns makes every EXECUTE fail
    until it is deallocated: the reads are sent again once it is prepared afresh."""
    await conn.execute("CREATE TABLE t (v text)")
    await conn.execute("INSERT INTO t VALUES ('a')")
    every = PreparedStatement("test_every", "SELECT * FROM t WHERE v = %(v)s")
    assert await begin_with(conn, [(every, {"v": "a"})]) == [[("a",)]]
    await conn.execute("COMMIT")
    await conn.execute("ALTER TABLE t ADD COLUMN w int DEFAULT 7")
    assert await begin_with(conn, [(every, {"v": "a"})]) == [[("a", 7)]]  # failed once, prepared afresh, sent again
    await conn.execute("COMMIT")


async def test_a_statement_prepared_by_an_earlier_connection_object_is_replaced(conn):
    """The same session seen under a new tracking entry: the statement found there is prepared afresh."""
    await conn.execute("CREATE TABLE t (v text)")
    await conn.execute(INSERT.prepare)
    await begin_with(conn, [(INSERT, {"v": "a"})])
    await conn.execute("COMMIT")
    assert await (await conn.execute("SELECT v FROM t")).fetchall() == [("a",)]


async def test_several_reads_share_the_round_trip_each_with_its_own_arguments_and_rows(conn):
    await conn.execute("CREATE TABLE t (v text)")
    await conn.execute("INSERT INTO t VALUES ('a'), ('b'), ('c')")
    equal = PreparedStatement("test_equal", "SELECT v FROM t WHERE v = %(v)s")
    above = PreparedStatement("test_above", "SELECT v FROM t WHERE v > %(v)s ORDER BY v")
    results = await begin_with(conn, [(equal, {"v": "a"}), (above, {"v": "a"}), (equal, {"v": "z"})], generic_plans=True)
    assert results == [[("a",)], [("b",), ("c",)], []]
    assert conn.info.transaction_status == TransactionStatus.INTRANS
    await conn.rollback()


async def test_commit_with_runs_the_last_statements_in_order_and_commits(conn):
    from umbra.db import commit_with

    await conn.execute("CREATE TABLE t (v text UNIQUE)")
    counted = PreparedStatement("test_counted", "SELECT count(*) FROM t WHERE v <= %(v)s")
    touched = PreparedStatement("test_touched", "UPDATE t SET v = v WHERE v = %(v)s")
    await begin_with(conn, [(INSERT, {"v": "a"})])
    results = await commit_with(conn, [(INSERT, {"v": "b"}), (counted, {"v": "b"}), (touched, {"v": "a"}),
                                       (INSERT, {"v": "c"})])  # fmt: skip
    assert results == [[("b",)], [(2,)], [], [("c",)]]  # the second saw the first one's row; the third has none
    assert conn.info.transaction_status == TransactionStatus.IDLE
    assert await (await conn.execute("SELECT v FROM t ORDER BY v")).fetchall() == [("a",), ("b",), ("c",)]

    await begin_with(conn, [(INSERT, {"v": "d"})])
    with pytest.raises(psycopg.errors.UniqueViolation):
        await commit_with(conn, [(INSERT, {"v": "e"}), (INSERT, {"v": "a"}), (INSERT, {"v": "f"})])  # the second fails
    await conn.rollback()
    assert await (await conn.execute("SELECT v FROM t ORDER BY v")).fetchall() == [("a",), ("b",), ("c",)]


async def test_a_rollback_that_deallocates_everything_costs_the_next_transaction_a_retry_not_an_error(conn):
    """psycopg sends DEALLOCATE ALL at a rollback once it has prepared statements of its own."""
    await conn.execute("CREATE TABLE t (v text)")
    await begin_with(conn, [(INSERT, {"v": "a"})])
    await conn.execute("COMMIT")
    for _ in range(10):  # often enough for psycopg to prepare it
        await conn.execute("SELECT count(*) FROM t WHERE v = %s", ("a",))
    with pytest.raises(psycopg.errors.UndefinedTable):
        async with conn.transaction():
            await conn.execute("SELECT * FROM no_such_table")
    assert await _prepared(conn) == []  # ours went too
    assert await begin_with(conn, [(INSERT, {"v": "b"})]) == [[("b",)]]
    await conn.execute("COMMIT")
    assert "test_insert" in await _prepared(conn)


async def test_array_literals_carry_every_value_as_it_is_through_a_prepared_statement(conn):
    """``text_array`` and ``uuid_array`` build the literals a prepared statement's array parameters take: a text
    spelled NULL, or holding a comma, a quote, a backslash or braces, arrives as that text, and no value at all
    as an empty array."""
    texts = ["NULL", "null", "a,b", 'q"uote', "back\\slash", "{br}", " sp ", "", "r-1.x:y@z"]
    ids = [uuid.uuid4(), uuid.uuid4()]
    read = PreparedStatement("test_arrays", "SELECT %(texts)s::text[], %(ids)s::uuid[], %(none)s::text[]")
    [[(got_texts, got_ids, none)]] = await begin_with(conn, [(read, {"texts": text_array(texts), "ids": uuid_array(ids),
                                                                   "none": text_array([])})])  # fmt: skip
    await conn.rollback()
    assert (got_texts, got_ids, none) == (texts, ids, [])
