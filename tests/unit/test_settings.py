import os
import re
import subprocess
import sys
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from umbra.settings import MAX_DURATION_SECONDS, SettingsError, load_settings

ROOT = Path(__file__).resolve().parents[2]


def test_defaults():
    s = load_settings({})
    assert s.database_url is None and s.lease_seconds == 60 and s.heartbeat_stale_seconds == 45
    assert s.blocked_timeout_seconds == 24 * 3600  # SPEC: a job blocked longer than this (default 24 h) fails
    assert s.rate_limit_ipv6_prefix == 64  # an IPv6 client is counted by its /64


@pytest.mark.parametrize(
    "name,value",
    [("UMBRA_PORT", "eighty"), ("UMBRA_LEASE_SECONDS", "0"), ("UMBRA_TRUSTED_PROXIES", "10.0.0.0/33"),
     ("UMBRA_LOG_LEVEL", "chatty"), ("UMBRA_POLL_FALLBACK_SECONDS", "-1"), ("UMBRA_PORT", "70000"),
     ("UMBRA_SWEEP_INTERVAL_SECONDS", "nan"), ("UMBRA_SWEEP_INTERVAL_SECONDS", "inf"),
     ("UMBRA_HOST", "not a host"), ("UMBRA_HOST", "999.1.1.1"), ("UMBRA_HOST", "[localhost]"),
     ("UMBRA_MIGRATE_LOCK_TIMEOUT_SECONDS", "0"), ("UMBRA_MIGRATE_LOCK_TIMEOUT_SECONDS", "3601"),
     ("UMBRA_RATE_LIMIT_IPV6_PREFIX", "47"), ("UMBRA_RATE_LIMIT_IPV6_PREFIX", "129"), ("UMBRA_RATE_LIMIT_IPV6_PREFIX", "/64")],
)
def test_invalid_values_fail_naming_the_variable(name, value):
    with pytest.raises(SettingsError, match=name):
        load_settings({name: value})


def test_values_are_read(tmp_path: Path):
    s = load_settings({"UMBRA_DATA_DIR": str(tmp_path), "UMBRA_TRUSTED_PROXIES": "10.0.0.0/8, ::1", "UMBRA_PORT": "9000"})
    assert s.pgdata == tmp_path / "pg" and s.port == 9000 and len(s.trusted_proxies) == 2
    with pytest.raises(Exception):
        s.port = 1  # frozen


def test_the_embedded_database_refuses_a_data_dir_with_spaces_in_one_line(tmp_path: Path):
    from umbra.db import resolve_database

    settings = load_settings({"UMBRA_DATA_DIR": str(tmp_path / "with space")})
    with pytest.raises(SettingsError, match="UMBRA_DATA_DIR must resolve to letters"):
        resolve_database(settings)
    assert not (tmp_path / "with space").exists(), "refused before anything was created"


def test_the_default_data_dir_has_no_spaces_on_any_system(monkeypatch, tmp_path: Path):
    import umbra.settings as settings_module

    monkeypatch.setattr(settings_module.os, "geteuid", lambda: 1000)
    monkeypatch.delenv("XDG_DATA_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert load_settings({}).data_dir == tmp_path / ".local" / "share" / "umbra"


def test_the_clients_find_the_server_this_machines_settings_start():
    """UMBRA_SERVER, else UMBRA_HOST and UMBRA_PORT (the loopback for a wildcard or unset host), as the
    README's settings table and every client's ``--server`` help say."""
    from umbra.cli_events import SERVER_HELP
    from umbra.settings import server_url

    assert "http://UMBRA_HOST:UMBRA_PORT" in SERVER_HELP
    assert server_url({"UMBRA_HOST": "127.0.0.2", "UMBRA_PORT": "9000"}) == "http://127.0.0.2:9000"
    assert server_url({}) == "http://127.0.0.1:8080"
    assert server_url({"UMBRA_PORT": "9000"}) == "http://127.0.0.1:9000"
    assert server_url({"UMBRA_HOST": "0.0.0.0", "UMBRA_PORT": "9000"}) == "http://127.0.0.1:9000"
    assert server_url({"UMBRA_HOST": "::1"}) == server_url({"UMBRA_HOST": "[::1]"}) == "http://[::1]:8080"
    assert server_url({"UMBRA_HOST": "[::]"}) == "http://127.0.0.1:8080"
    assert server_url({"UMBRA_SERVER": "https://umbra.example/", "UMBRA_PORT": "9000"}) == "https://umbra.example"
    with pytest.raises(SettingsError, match="UMBRA_PORT"):
        server_url({"UMBRA_PORT": "eighty"})
    with pytest.raises(SettingsError, match="UMBRA_HOST"):
        server_url({"UMBRA_HOST": "not a host"})


def test_only_an_unreachable_database_is_an_outage_to_retry():
    """503 database_unavailable says "send it again": right for a connection that failed or was ended,
    wrong for a statement PostgreSQL refused (a deadlock, a cancelled query, a row too large)."""
    import psycopg
    from psycopg import errors
    from psycopg_pool import PoolTimeout

    from umbra.db import database_away

    for away in (psycopg.OperationalError("connection failed"), PoolTimeout("no connection in 5 s"),
                 errors.AdminShutdown(), errors.CannotConnectNow(), errors.TooManyConnections(),
                 errors.ConnectionFailure(), psycopg.InterfaceError("the connection is closed"),
                 errors.IdleInTransactionSessionTimeout()):  # fmt: skip
        assert database_away(away), away
    for refused in (errors.DeadlockDetected(), errors.SerializationFailure(), errors.QueryCanceled(),
                    errors.ProgramLimitExceeded(), ValueError("not a database error")):  # fmt: skip
        assert not database_away(refused), refused


def test_an_empty_umbra_host_does_not_listen_on_every_interface():
    """``UMBRA_HOST=`` (an empty line in an EnvironmentFile, a compose ``UMBRA_HOST:``) is unset, as for every
    other variable: an empty host is every interface to the socket layer."""
    assert load_settings({"UMBRA_HOST": ""}).host == load_settings({"UMBRA_HOST": "  "}).host == "127.0.0.1"


@pytest.mark.parametrize("value", ["not a host", "http://0.0.0.0", "0.0.0.0:8080", "999.1.1.1", "10.1", "-api.internal",
                                   "[localhost]", "a..b", "x" * 64])  # fmt: skip
def test_a_umbra_host_that_is_no_address_or_host_name_is_refused_at_start_naming_the_variable(value):
    """Refused at start, as every other setting, not by uvicorn once the database was up and migrated (its
    ``[Errno -2] Name or service not known`` named neither the value nor the variable); so is ``--host``."""
    from umbra.cli import main

    with pytest.raises(SettingsError, match=r"^UMBRA_HOST .*" + re.escape(repr(value))):
        load_settings({"UMBRA_HOST": value})
    with pytest.raises(SystemExit) as refused:
        main(["serve", "--host", value])
    assert refused.value.code == 2


@pytest.mark.parametrize("value,host", [("0.0.0.0", "0.0.0.0"), ("::", "::"), ("[::]", "::"), ("::1", "::1"), ("[::1]", "::1"),
                                        ("localhost", "localhost"), (" api.internal ", "api.internal"), ("umbra_api", "umbra_api"),
                                        ("db1.example.", "db1.example."), ("fe80::1%eth0", "fe80::1%eth0"), ("10.0.0.7", "10.0.0.7")])  # fmt: skip
def test_a_umbra_host_an_operator_writes_is_taken(value, host):
    """An IP address of either family (an IPv6 one bracketed as in a URL too), a host name, a fully qualified
    one with its final dot, a container's name with an underscore; whether a name resolves is asked when the
    server starts (``umbra.listen``), not by every command that reads the settings."""
    assert load_settings({"UMBRA_HOST": value}).host == host


def test_the_migrations_lock_timeout_is_a_few_seconds_unless_set():
    """Under the service's own lock waits (5 s), so the writers queued behind a migration's try do not fail."""
    from umbra.db import LOCK_WAIT_SECONDS

    assert load_settings({}).migrate_lock_timeout_seconds == 2.0 < LOCK_WAIT_SECONDS
    assert load_settings({"UMBRA_MIGRATE_LOCK_TIMEOUT_SECONDS": "0.5"}).migrate_lock_timeout_seconds == 0.5


@pytest.mark.parametrize("interval,stale", [("60", "45"), ("45", "45")])
def test_a_stale_threshold_not_above_the_heartbeat_interval_is_refused(interval, stale):
    """With the interval agents are told at or above the stale time, every healthy node reads offline between
    its beats and takes no work then."""
    with pytest.raises(SettingsError, match="UMBRA_HEARTBEAT_STALE_SECONDS"):
        load_settings({"UMBRA_HEARTBEAT_INTERVAL_SECONDS": interval, "UMBRA_HEARTBEAT_STALE_SECONDS": stale})


@pytest.mark.parametrize("url", ["postgresql//umbra:Hunter2-s3cret@db.internal/umbra", "mysql://root:Hunter2-s3cret@db/x"],
                         ids=["no-colon", "not-postgresql"])
@pytest.mark.parametrize("command", [["migrate"], ["verify"], ["admin", "create-org", "x", "--json"]])
def test_a_malformed_database_url_is_named_and_its_password_never_printed(command, url):
    """A mistyped UMBRA_DATABASE_URL ("postgresql//" without the colon) or another database's stops the command
    with one line naming the variable, exit 2 as every configuration error; libpq's own message would echo it
    whole, password and all, to stderr and whatever collects it."""
    env = {**os.environ, "UMBRA_DATABASE_URL": url}
    done = subprocess.run([sys.executable, "-m", "umbra.cli", *command], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "Hunter2-s3cret" not in done.stderr + done.stdout, done.stderr
    assert done.stderr.startswith("umbra: configuration error: UMBRA_DATABASE_URL"), done.stderr


@pytest.mark.parametrize("url", ["postgresql://umbra:Hunter2@s3cret-tail@127.0.0.1/umbra",
                                 "postgresql://umbra:Hunter2@s3cret/tail@127.0.0.1/umbra",
                                 "postgresql://umbra:Hunter2/s3cret@127.0.0.1:5432/umbra",
                                 "postgres://umbra:Pass?x@s3cret-tail@127.0.0.1/umbra"],
                         ids=["at", "at-and-slash", "slash", "question-and-at"])  # fmt: skip
def test_a_password_whose_at_or_slash_is_not_percent_encoded_is_refused_and_never_printed(url):
    """A password holding an @ (or a /) written raw, not as %40, is a URL libpq parses, but not as meant: the
    password's tail becomes the host (or the database name, the port) and the connection's failure
    ("failed to resolve host 's3cret-tail@127.0.0.1'") printed it on stderr, and in the server's log at
    every listener retry and /readyz probe. Refused at start naming the variable, like any other
    malformed UMBRA_DATABASE_URL, and nothing of the password printed."""
    with pytest.raises(SettingsError, match="UMBRA_DATABASE_URL") as refused:
        load_settings({"UMBRA_DATABASE_URL": url})
    assert "s3cret" not in str(refused.value) and "Hunter2" not in str(refused.value)


def test_a_password_with_a_raw_at_is_not_printed_by_migrate():
    env = {**os.environ, "UMBRA_DATABASE_URL": "postgresql://umbra:Hunter2@s3cret-tail@127.0.0.1/umbra"}
    done = subprocess.run([sys.executable, "-m", "umbra.cli", "migrate"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert "s3cret" not in done.stderr + done.stdout, done.stderr
    assert done.returncode == 2 and done.stderr.startswith("umbra: configuration error: UMBRA_DATABASE_URL"), done.stderr


@pytest.mark.parametrize("url", ["postgresql://umbra:p%40ss%2Fw@db.internal:5432/umbra", "postgresql://umbra@db/umbra",
                                 "postgresql:///umbra?host=/run/postgresql@x", "host=/tmp/a@b dbname=x user=u@corp",
                                 "postgresql://u%40corp@db1,db2/umbra?sslmode=require&application_name=a@b"])  # fmt: skip
def test_a_database_url_with_its_at_signs_encoded_or_in_their_place_is_taken(url):
    assert load_settings({"UMBRA_DATABASE_URL": url}).database_url == url


@pytest.mark.parametrize("value", ["", "  "])
def test_an_empty_log_level_is_unset_as_every_other_variable(value):
    """``UMBRA_LOG_LEVEL=`` (an empty line in an EnvironmentFile, a compose ``UMBRA_LOG_LEVEL:``) is unset, as
    ``UMBRA_HOST=`` and every other variable: it was refused, and the server (every admin command too)
    would not start."""
    assert load_settings({"UMBRA_LOG_LEVEL": value}).log_level == "INFO"
    assert load_settings({"UMBRA_LOG_LEVEL": " debug "}).log_level == "DEBUG"


#: The durations the server adds to or takes from the clock (a lease's end, the delay after an expired
#: lease, a blocked job's deadline, a node's silence, a heartbeat's recording interval, how far back a new
#: sweeper leader announces due jobs).
DURATIONS = ["UMBRA_LEASE_SECONDS", "UMBRA_LEASE_EXPIRED_DELAY_SECONDS", "UMBRA_BLOCKED_TIMEOUT_SECONDS",
             "UMBRA_HEARTBEAT_STALE_SECONDS", "UMBRA_HEARTBEAT_EVENT_SECONDS", "UMBRA_SWEEP_INTERVAL_SECONDS",
             "UMBRA_POLL_FALLBACK_SECONDS"]  # fmt: skip


@pytest.mark.parametrize("name", DURATIONS)
def test_a_duration_no_timestamp_can_hold_is_refused_at_start_naming_the_variable(name):
    """``999999999999`` (some 31,700 years: "never", as an operator may spell it) was taken, and then every
    claim (a lease's end past year 9999), every sweep of expired leases, blocked jobs or silent nodes (a
    moment out of PostgreSQL's range) and every ``explain`` of a blocked job failed, each tick, for as
    long as the server ran; a sweep interval that long stopped the sweeper as it began to lead. The
    longest one taken still leaves every moment counted from now in range."""
    with pytest.raises(SettingsError, match=name):
        load_settings({name: "999999999999"})
    longest = getattr(load_settings({name: str(MAX_DURATION_SECONDS)}), name.removeprefix("UMBRA_").lower())
    now = datetime.now(timezone.utc)
    assert now - timedelta(seconds=longest) < now < now + timedelta(seconds=longest)


def test_the_settings_repr_holds_no_secret():
    """A settings object printed (a log line, a traceback's locals) shows neither the database's password nor the metrics token."""
    settings = load_settings({"UMBRA_DATABASE_URL": "postgresql://owner:Pw-s3cret@db.example:5432/umbra",
                              "UMBRA_METRICS_TOKEN": "mt-s3cret"})  # fmt: skip
    assert settings.database_url.endswith("@db.example:5432/umbra") and settings.metrics_token == "mt-s3cret"
    assert "s3cret" not in repr(settings) and "s3cret" not in str(settings)
