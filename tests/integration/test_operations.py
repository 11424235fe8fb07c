"""Operations: `umbra serve` and `umbra migrate` as processes (the listen address, the logs, /metrics at start,
a database that is away, misconfigured or ahead of this release) and `umbra verify` run by an auditor's
read-only role."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx
import psycopg
import pytest
from psycopg import conninfo, sql

from tests.conftest import free_port
from tests.helpers import ROOT, run_umbra


@contextlib.contextmanager
def serve(db_url: str, *args: str, **env: str):
    """`umbra serve` as a real process; yields (process, port, stderr path)."""
    port = free_port()
    log = Path(tempfile.gettempdir()) / f"umbra_serve_{uuid.uuid4().hex[:8]}.log"
    environment = {**os.environ, "UMBRA_DATABASE_URL": db_url, "UMBRA_SWEEP_INTERVAL_SECONDS": "0.2", **env}
    with log.open("wb") as err:
        process = subprocess.Popen([sys.executable, "-m", "umbra.cli", "serve", "--port", str(port), *args],
                                   cwd=ROOT, env=environment, stdout=subprocess.DEVNULL, stderr=err)  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while "serving on" not in log.read_text():
            assert process.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        yield process, port, log
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        log.unlink(missing_ok=True)


def _listening(port: int) -> set[str]:
    """Local addresses with a listening TCP socket on ``port`` (from /proc/net/tcp{,6})."""
    found = set()
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        with contextlib.suppress(FileNotFoundError):
            for line in Path(table).read_text().splitlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                address, hex_port = local.split(":")
                if state == "0A" and int(hex_port, 16) == port:
                    found.add(address if len(address) == width else address)
    return found


def test_serve_with_an_empty_umbra_host_stays_on_the_loopback(db_url):
    """UMBRA_HOST set but empty is unset, as every other variable: the loopback, not every interface (which
    an empty host would be to the socket layer: the whole API, /metrics included)."""
    with serve(db_url, UMBRA_HOST="") as (_process, port, log):
        text = log.read_text()
        addresses = _listening(port)
    wildcard = {"00000000", "00000000000000000000000000000000"}
    assert not (addresses & wildcard), f"listening on {addresses}; log: {text}"
    assert "http://0.0.0.0:" not in text and "http://[::]:" not in text


def test_serve_warns_when_secrets_are_hashed_at_the_tests_cheap_cost_and_not_otherwise(db_url):
    """The suite runs with argon2id at its smallest cost: a deployment that set that variable is told so."""
    from umbra.settings import CHEAP_HASHING_VARIABLE

    for value, warned in (("1", True), ("0", False)):
        with serve(db_url, **{CHEAP_HASHING_VARIABLE: value}) as (_process, _port, log):
            lines = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
        cheap = [line for line in lines if line.get("action") == "cheap_hashing"]
        assert len(cheap) == (1 if warned else 0), (value, lines)
        if warned:
            assert cheap[0]["level"] == "warning" and cheap[0]["variable"] == CHEAP_HASHING_VARIABLE


def test_a_fresh_servers_metrics_name_claims_claim_wait_and_sweeper_actions(db_url):
    """A server that has claimed and swept nothing yet shows its claims, claim waits and sweeper actions at 0,
    so a dashboard or an alert on rate(umbra_claims_total[5m]) reads 0 rather than "no data"."""
    with serve(db_url) as (_process, port, _log):
        body = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    samples = {line.split("{")[0].split(" ")[0] for line in body.splitlines() if line and not line.startswith("#")}
    missing = [name for name in ("umbra_claims_total", "umbra_claim_wait_seconds_count", "umbra_sweeper_actions_total")
               if name not in samples]  # fmt: skip
    assert not missing, f"no samples for {missing}"


def test_every_line_serve_writes_to_stderr_is_json(db_url):
    """Every line on stderr is JSON, uvicorn's own too (a malformed request from anyone who reaches the port)."""
    with serve(db_url) as (_process, port, log):
        with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
            raw.sendall(b"NOT-HTTP\x00\x01 garbage\r\n\r\n")
            with contextlib.suppress(OSError):
                raw.recv(1024)
        httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=10)
        time.sleep(0.5)
        lines = [line for line in log.read_text().splitlines() if line.strip()]
    not_json = []
    for line in lines:
        try:
            json.loads(line)
        except ValueError:
            not_json.append(line)
    assert not not_json, not_json


def test_verify_runs_with_a_read_only_auditor_role(db_url):
    """An audit needs only read rights, and changes nothing: `umbra verify` does not migrate (a SELECT-only role
    has no rights to), and refuses a database behind this version, naming what to run."""
    role = f"umbra_auditor_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(db_url, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role)))
        admin.execute(sql.SQL("GRANT SELECT ON ALL TABLES IN SCHEMA public TO {}").format(sql.Identifier(role)))
    try:
        env = {**os.environ, "UMBRA_DATABASE_URL": conninfo.make_conninfo(db_url, user=role)}
        done = subprocess.run([sys.executable, "-m", "umbra.cli", "verify", "--json"], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=60)  # fmt: skip
    finally:
        with psycopg.connect(db_url, autocommit=True) as admin:
            admin.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
            admin.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"ok": True, "differences": []}


def test_verify_refuses_a_database_behind_this_version_without_migrating_it(db_url):
    with psycopg.connect(db_url, autocommit=True) as admin:
        [(last,)] = admin.execute("SELECT max(version) FROM schema_migrations").fetchall()
        admin.execute("DELETE FROM schema_migrations WHERE version = %s", (last,))
    env = {**os.environ, "UMBRA_DATABASE_URL": db_url}
    done = subprocess.run([sys.executable, "-m", "umbra.cli", "verify"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert done.returncode != 0 and "migrations_pending" in done.stderr and "umbra migrate" in done.stderr, done.stderr
    with psycopg.connect(db_url, autocommit=True) as admin:
        assert admin.execute("SELECT count(*) FROM schema_migrations WHERE version = %s", (last,)).fetchone() == (0,)


def test_a_database_that_refuses_connections_is_one_line_per_command_without_its_password():
    """`migrate`, `admin create-org`, `verify` and `serve` against a database nothing answers at: one line
    `umbra: database_unavailable: ...` on stderr, no traceback, the URL's password not repeated; exit 1
    (`verify` 2, keeping 1 for drifted views)."""
    url = f"postgresql://nobody:S3CRETPW@127.0.0.1:{free_port()}/x"
    for argv, status in ((["migrate"], 1), (["admin", "create-org", "acme"], 1), (["verify"], 2),
                         (["serve", "--port", str(free_port())], 1)):  # fmt: skip
        done = run_umbra(*argv, env={"UMBRA_DATABASE_URL": url})
        assert done.returncode == status, (argv, done.returncode, done.stderr)
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("umbra: database_unavailable:"), (argv, done.stderr)
        assert "S3CRETPW" not in done.stderr + done.stdout and "Traceback" not in done.stderr


def test_serve_on_a_port_another_process_listens_on_is_refused_in_one_line_having_changed_nothing(pg_server_url):
    """`umbra serve` with its port taken exits 2 at once with one line naming the address and the flag or
    variable that gave the port, as every configuration error, before it touches the database: it logged
    uvicorn's ``[Errno 98] error while attempting to bind`` and exited 3, once it had migrated it."""
    name = f"umbra_busy_port_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(pg_server_url, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    url = conninfo.make_conninfo(pg_server_url, dbname=name)
    try:
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            port = taken.getsockname()[1]
            for args, env, named in ((["--port", str(port)], {}, "--port"), ([], {"UMBRA_PORT": str(port)}, "UMBRA_PORT")):
                done = run_umbra("serve", *args, env={"UMBRA_DATABASE_URL": url, **env})
                assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
                assert done.stderr.startswith(f"umbra: configuration error: {named} {port} is in use on 127.0.0.1:{port} "
                                              "by another process"), done.stderr  # fmt: skip
        with psycopg.connect(url, autocommit=True) as c:
            assert c.execute("SELECT to_regclass('schema_migrations')").fetchone() == (None,)  # not migrated
    finally:
        with psycopg.connect(pg_server_url, autocommit=True) as admin:
            admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


@pytest.mark.parametrize("argv,env,named", [
    ([], {"UMBRA_HOST": "not a host"}, "UMBRA_HOST must be an IP address"),
    ([], {"UMBRA_HOST": "999.1.1.1"}, "UMBRA_HOST is not an IPv4 address"),
    ([], {"UMBRA_HOST": "no-such-host.invalid"}, "UMBRA_HOST 'no-such-host.invalid' does not resolve"),
    ([], {"UMBRA_HOST": "192.0.2.1"}, "UMBRA_HOST '192.0.2.1' is not an address of this machine"),  # TEST-NET-1
    (["--host", "no-such-host.invalid"], {"UMBRA_HOST": "127.0.0.1"}, "--host 'no-such-host.invalid' does not resolve"),
], ids=["not-a-host", "no-ipv4-address", "unresolved", "not-this-machine", "flag"])  # fmt: skip
def test_serve_refuses_a_host_it_cannot_listen_on_at_start_in_one_line_naming_the_variable(db_url, argv, env, named):
    """Every other setting is refused at start naming it (exit 2); UMBRA_HOST met uvicorn's bind once the
    database was up and migrated, which logged ``[Errno -2] Name or service not known``, naming neither."""
    done = run_umbra("serve", "--port", str(free_port()), *argv, env={"UMBRA_DATABASE_URL": db_url, **env})
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith(f"umbra: configuration error: {named}"), done.stderr


@pytest.mark.parametrize("host,reached", [("localhost", "127.0.0.1"), ("[::1]", "[::1]")])
def test_serve_listens_on_a_host_name_and_a_bracketed_ipv6_address(db_url, host, reached):
    if reached.startswith("[") and not (socket.has_ipv6 and Path("/proc/net/if_inet6").exists()):
        pytest.skip("no IPv6 here")
    with serve(db_url, UMBRA_HOST=host) as (_process, port, _log):
        assert httpx.get(f"http://{reached}:{port}/healthz", timeout=10).status_code == 200


def test_a_database_a_newer_release_migrated_is_said_to_be_ahead_and_still_served(db_url):
    """A database holding migrations this release does not ship (a newer release migrated it: a rolling
    upgrade under way, or a rollback) is not "current": `umbra migrate` says the schema is ahead, naming
    them, and exits 0; `umbra serve` logs a warning naming them and serves all the same (servers of the
    previous release run against the newer schema during a rolling upgrade), /readyz included."""
    with psycopg.connect(db_url, autocommit=True) as admin:
        admin.execute("INSERT INTO schema_migrations (version, name) VALUES (9999, '9999_from_a_newer_release.sql')")
    done = run_umbra("migrate", env={"UMBRA_DATABASE_URL": db_url})
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("applied 0 migration(s); the schema is ahead of this release:"), done.stdout
    assert "9999_from_a_newer_release.sql" in done.stdout and "current" not in done.stdout
    with serve(db_url) as (_process, port, log):
        ready = httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=10)
        records = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    assert ready.status_code == 200, ready.text
    warnings = [r for r in records if r.get("action") == "schema_ahead_of_release"]
    assert [(r["level"], r["migrations"]) for r in warnings] == [("warning", "9999_from_a_newer_release.sql")]


def test_migrate_on_a_current_database_says_so(db_url):
    """What `umbra migrate` says once nothing is left to apply, and nothing is ahead."""
    done = run_umbra("migrate", env={"UMBRA_DATABASE_URL": db_url})
    assert (done.returncode, done.stdout) == (0, "applied 0 migration(s); schema is current\n"), done.stderr


def test_serve_refuses_a_duration_too_long_for_a_date_at_start_in_one_line(db_url):
    """A duration setting no date can hold (a typo's extra zeros) stops `umbra serve` before it serves, naming
    the variable in one line, exit 2, as every configuration error: it served, and its sweeper then died
    with an OverflowError traceback (UMBRA_SWEEP_INTERVAL_SECONDS), or every claim, heartbeat or pairing was
    answered 500 (UMBRA_LEASE_SECONDS, UMBRA_HEARTBEAT_*_SECONDS)."""
    done = run_umbra("serve", "--port", "0", env={"UMBRA_DATABASE_URL": db_url, "UMBRA_SWEEP_INTERVAL_SECONDS": "1e300"})
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.startswith("umbra: configuration error: UMBRA_SWEEP_INTERVAL_SECONDS") and done.stderr.count("\n") == 1, done.stderr
