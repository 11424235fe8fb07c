"""The ``umbra`` command line.

Errors are one line on stderr with a non-zero exit, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
from typing import Any, Callable
from uuid import UUID

import anyio

from . import security
from .errors import UmbraError
from .settings import CHEAP_HASHING_VARIABLE, SettingsError, listen_host, load_settings

#: Named, not ``__name__``: run as ``python -m umbra.cli`` this module is ``__main__``, outside the ``umbra``
#: logger tree that ``serve`` writes as JSON.
log = logging.getLogger("umbra.cli")

#: Subcommand registrars: each adds its parsers to the subparsers object.
Registrar = Callable[[argparse._SubParsersAction], None]


def _emit(obj, as_json: bool) -> None:
    if as_json:
        print(json.dumps(obj))
    else:
        for key, value in obj.items():
            print(f"{key}: {value if not isinstance(value, list) else ','.join(value)}")


#: What a mistyped UUID holds; only such text is quoted back when it is refused.
_UUID_LIKE = re.compile(r"[0-9A-Fa-f{}\-]{1,64}")


def _uuid(text: str) -> UUID:
    try:
        return UUID(text)
    except ValueError:
        # An API key or a node's credential pasted where an id belongs (--org "$KEY") is not repeated.
        shown = f": {text!r}" if _UUID_LIKE.fullmatch(text) else " (what was given is not repeated: it may be a secret)"
        raise argparse.ArgumentTypeError(f"not a UUID{shown}") from None


def _with_database(fn, *, migrating: bool = True):
    """Run ``fn(conn, args)`` against the configured (or embedded) database, migrated.

    ``migrating=False`` is for a command that only reads (``verify``): an
    auditor's role may read and nothing more, and an audit must not change the
    schema it audits. It refuses a database behind this version instead.
    """

    def run(args) -> int:
        from .db import database, own_connection
        from .migrate import migrate, pending_migrations

        settings = load_settings()
        with database(settings) as url:
            async def main():
                if migrating:
                    await migrate(url, lock_timeout_seconds=settings.migrate_lock_timeout_seconds)
                async with own_connection(url) as conn:
                    if not migrating and (pending := await pending_migrations(conn)):
                        raise UmbraError("migrations_pending", f"The database lacks {len(pending)} migration(s) of this "
                                         f"version (first: {pending[0]}); run `umbra migrate` first.")  # fmt: skip
                    return await fn(conn, args)

            return anyio.run(main) or 0

    return run


# -- bootstrap -----------------------------------------------------------------


async def _migrate(url: str, lock_timeout_seconds: float) -> tuple[list[str], list[str]]:
    """Apply the pending migrations; returns those applied and those the database holds that this release
    does not ship (a newer release migrated it)."""
    from .db import own_connection
    from .migrate import migrate, migrations_ahead

    applied = await migrate(url, lock_timeout_seconds=lock_timeout_seconds)
    async with own_connection(url) as conn:
        return applied, await migrations_ahead(conn)


def cmd_migrate(args) -> int:
    from .db import database

    settings = load_settings()
    with database(settings) as url:
        applied, ahead = anyio.run(_migrate, url, settings.migrate_lock_timeout_seconds)
    said = [f"applied {len(applied)} migration(s)" + (": " + ", ".join(applied) if applied else "")]
    if ahead:  # not refused: servers of this release may run against it while a newer one rolls out
        said.append(f"the schema is ahead of this release: a newer release applied {len(ahead)} migration(s) "
                    f"this one does not ship ({', '.join(ahead)})")  # fmt: skip
    elif not applied:
        said.append("schema is current")
    print("; ".join(said))
    return 0


async def _create_org(conn, args) -> int:
    from .compute.accounts import create_organization

    org_id, key = await create_organization(conn, args.name)
    _emit({"organization_id": str(org_id), "api_key": key, "prefix": _prefix(key)}, args.json)
    return 0


def _prefix(key: str) -> str:
    """What names the key in list-keys and revoke-key without the secret: ``uk_<prefix>``."""
    from .compute.auth import API_KEY_KIND
    from .security import token_prefix

    return f"{API_KEY_KIND}_{token_prefix(key, API_KEY_KIND)}"


async def _create_key(conn, args) -> int:
    from .compute.accounts import create_api_key

    scopes = [s.strip() for s in args.scopes.split(",") if s.strip()]
    key = await create_api_key(conn, args.org, scopes)
    _emit({"api_key": key, "prefix": _prefix(key), "scopes": sorted(set(scopes))}, args.json)
    return 0


async def _list_keys(conn, args) -> int:
    from .compute.accounts import list_api_keys

    keys = await list_api_keys(conn, args.org)
    if args.json:
        _emit({"api_keys": keys}, True)
    else:
        for key in keys:
            state = f"revoked {key['revoked_at']}" if key["revoked_at"] else "live"
            print(f"{key['id']}  uk_{key['prefix']}_…  {','.join(key['scopes'])}  created {key['created_at']}  {state}")
    return 0


async def _revoke_key(conn, args) -> int:
    from .compute.accounts import api_key_named, revoke_api_key

    key_id = await api_key_named(conn, args.org, args.key)
    revoked_at = await revoke_api_key(conn, args.org, key_id)
    _emit({"api_key_id": str(key_id), "revoked_at": revoked_at.isoformat()}, args.json)
    return 0


async def _create_project(conn, args) -> int:
    from .compute.accounts import create_project

    project_id = await create_project(conn, args.org, args.name)
    _emit({"project_id": str(project_id)}, args.json)
    return 0


def cmd_serve(args) -> int:
    from .api.app import create_app
    from .api.server import serve
    from .db import database_and_embedded
    from .embedded import install_exit_on_sigterm
    from .listen import check_listen
    from .logs import configure_logging

    settings = load_settings()
    configure_logging(settings.log_level)
    host = args.host or settings.host
    port = args.port if args.port is not None else settings.port
    # Before the database starts or migrates: a server that cannot listen changes nothing.
    check_listen(host, port, host_name="--host" if args.host else "UMBRA_HOST",
                 port_name="--port" if args.port is not None else "UMBRA_PORT")  # fmt: skip
    app = None
    with database_and_embedded(settings) as (url, embedded):
        install_exit_on_sigterm()  # a server asked to stop has stopped: status 0
        try:
            _, ahead = anyio.run(_migrate, url, settings.migrate_lock_timeout_seconds)
            if ahead:  # a newer release migrated the database: served all the same, as during a rolling upgrade
                log.warning("the schema is ahead of this release",
                            extra={"action": "schema_ahead_of_release", "migrations": ",".join(ahead)})
            if security.PASSWORD_HASHER is not security.PROFILE:
                log.warning("secrets are hashed at argon2id's smallest cost: for a test suite only, never for a deployment",
                            extra={"action": "cheap_hashing", "variable": CHEAP_HASHING_VARIABLE})
            app = create_app(settings, url, embedded=embedded)
            serve(app, host=host, port=port)  # ends SSE streams and long-polls on shutdown
        except KeyboardInterrupt:
            pass
    failure = getattr(app.state, "failure", None) if app is not None else None
    if failure:  # a background task failed and stopped the server: a supervisor should restart it
        print(f"umbra serve: error: {failure}", file=sys.stderr)
        return 1
    return 0


def _within(low: float, high: float | None = None, number: Callable[[str], Any] = int, unit: str = "") -> Callable[[str], Any]:
    """An argparse ``type``: a ``number`` (whole by default) from ``low`` to ``high`` (no bound: None), refused
    as an argument otherwise (exit 2, like any mistyped flag). NaN is refused too: every comparison with it
    is false. ``unit`` follows the bounds in the refusal (" seconds")."""

    def parse(text: str) -> Any:
        try:
            value = number(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a {'whole ' if number is int else ''}number: {text!r}") from None
        if not (low <= value and (high is None or value <= high)):
            bounds = f"between {low:g} and {high:g}" if high is not None else f"at least {low:g}"
            raise argparse.ArgumentTypeError(f"must be {bounds}{unit}, not {text}")
        return value

    return parse


_port = _within(0, 65535)


def _host(text: str) -> str:
    """An argparse ``type``: :func:`~umbra.settings.listen_host`, refused as an argument (exit 2)."""
    try:
        return listen_host(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _register_bootstrap(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("migrate", help="apply database migrations (idempotent)")
    p.set_defaults(func=cmd_migrate)

    p = sub.add_parser("serve", help="serve the HTTP API; runs migrations and the sweeper")
    p.add_argument("--host", type=_host, default=None,
                   help="listen address: an IP address (0.0.0.0 or :: for every interface) or a host name "
                        "(default UMBRA_HOST or 127.0.0.1)")  # fmt: skip
    p.add_argument("--port", type=_port, default=None, help="listen port, 0..65535 (default UMBRA_PORT or 8080)")
    p.set_defaults(func=cmd_serve)

    admin = sub.add_parser("admin", help="organizations, API keys, projects, pairing codes, nodes")
    admin_sub = admin.add_subparsers(dest="admin_command", required=True)
    p = admin_sub.add_parser("create-org", help="create an organization and an all-scopes API key")
    p.add_argument("name")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_with_database(_create_org))
    p = admin_sub.add_parser("create-key", help="create an API key with the given scopes")
    p.add_argument("--org", type=_uuid, required=True)
    p.add_argument("--scopes", required=True, help="comma-separated, e.g. jobs:read,events:read")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_with_database(_create_key))
    p = admin_sub.add_parser("list-keys", help="list the organization's API keys (ids, prefixes, scopes; never secrets)")
    p.add_argument("--org", type=_uuid, required=True)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_with_database(_list_keys))
    p = admin_sub.add_parser("revoke-key", help="revoke an API key: it fails at once, open streams included")
    p.add_argument("--org", type=_uuid, required=True)
    p.add_argument("key", help="the key's id (see list-keys), its prefix as create-key printed it (uk_…), or the key itself")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_with_database(_revoke_key))
    p = admin_sub.add_parser("create-project", help="create a project in the organization's tenant schema")
    p.add_argument("--org", type=_uuid, required=True)
    p.add_argument("name")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_with_database(_create_project))


#: Every registrar; feature modules append theirs here.
REGISTRARS: list[Registrar] = [_register_bootstrap]


def _register_agent(sub: argparse._SubParsersAction) -> None:
    from .agent.cli import register

    register(sub)


def _register_admin_nodes(sub: argparse._SubParsersAction) -> None:
    from .cli_admin import register

    register(sub)


def _register_events(sub: argparse._SubParsersAction) -> None:
    from .cli_events import register

    register(sub)


REGISTRARS.extend([_register_agent, _register_admin_nodes, _register_events])


def _register_jobs(sub: argparse._SubParsersAction) -> None:
    from .cli_jobs import register

    register(sub)


REGISTRARS.append(_register_jobs)


def _register_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="run the benchmarks (from a source checkout); writes bench/results/latest.md")

    def run(args) -> int:
        import os

        if os.getcwd() not in sys.path:  # the console script's path holds .venv/bin, not the checkout it runs in
            sys.path.append(os.getcwd())
        try:
            from bench import run_all
        except ImportError:
            print("umbra: bench: the benchmarks live in the source checkout (bench/); run this from its root", file=sys.stderr)
            return 2
        run_all.run_all(args)
        return 0

    p.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    p.add_argument("--only", default="", help="comma-separated subset of: drain,submit,wake,notify,idle,rebuild,claim_latency")
    p.set_defaults(func=run)


REGISTRARS.append(_register_bench)


class _Parser(argparse.ArgumentParser):
    """argparse, but a refused argument is one line like every other refusal (exit 2, as argparse's)."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"umbra: invalid_request: {self.prog}: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="umbra", description="Umbra Compute: event-sourced compute jobs on PostgreSQL.")
    sub = parser.add_subparsers(dest="command", required=True)
    for register in REGISTRARS:
        register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command. Exit status: 0 done, 2 a refused argument or configuration, 130 Ctrl-C, and for a
    refusal or an error the command's ``failure_status`` (1; ``verify`` keeps 1 for drift and fails with 2)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    failed = getattr(args, "failure_status", 1)
    status = 0
    try:
        status = int(args.func(args) or 0)
        sys.stdout.flush()  # a reader that closed the pipe is met here, not at the interpreter's exit
        return status
    except SettingsError as exc:
        print(f"umbra: configuration error: {exc}", file=sys.stderr)
        return 2
    except UmbraError as exc:
        from .cli_events import printable  # a refusal may echo what was sent: nothing a terminal acts on

        print(printable(f"umbra: {exc.code}: {exc.message}"), file=sys.stderr)
        return failed
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # one line, no traceback
        from .db import database_away

        exc = _leaf(exc)
        if isinstance(exc, BrokenPipeError):  # the reader has what it wanted: done, quietly, as cat(1) and grep(1) are
            detach_stdout()
            return status  # a verdict given before (verify's drift) stands
        if database_away(exc):
            print(f"umbra: database_unavailable: {_first_line(exc)}", file=sys.stderr)
        else:
            print(f"umbra: error: {type(exc).__name__}: {_first_line(exc)}{_server_of(exc)}", file=sys.stderr)
        return failed


def detach_stdout() -> None:
    """Point stdout at /dev/null once its reader has closed it (``umbra events tail | head -1``), so what is
    still buffered is flushed there at exit instead of failing again."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError):  # a stdout without a descriptor (captured): it has no pipe to lose
        pass


def _leaf(exc: BaseException) -> BaseException:
    """The one error inside exception groups of one (what a task group raises), for its one line."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


def _first_line(exc: BaseException) -> str:
    """libpq's messages go on with hints on further lines ("Is the server running on that host..."). """
    return (str(exc).strip().splitlines() or [""])[0]


def _server_of(exc: Exception) -> str:
    """`` (talking to URL)`` for an HTTP client's error: a refused connection should say where it tried."""
    try:
        url = exc.request.url  # type: ignore[attr-defined]  # httpx.RequestError
    except (AttributeError, RuntimeError):
        return ""
    return f" (talking to {url.scheme}://{url.netloc.decode()})"


if __name__ == "__main__":
    sys.exit(main())
