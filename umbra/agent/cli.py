"""``umbra agent``: pair once with a code, then heartbeat, claim and run jobs.

The first run (with --code) redeems the pairing code and saves the node
credential; every later run reuses the saved credential. SIGTERM, SIGINT or
SIGHUP (the terminal or SSH session closing; unless started under nohup)
stops polling and lets the current job finish within --grace seconds, then
gives it back to the server; a second SIGTERM or SIGINT gives up on it at once. Either way the exit status
is 0. A credential the server rejects, or a heartbeat or claim it refuses for
what it says (devices it does not accept, a credential without the scope),
stops the agent with the server's error and exit status 1.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import anyio

from umbra.cli import _within
from umbra.cli_events import SERVER_HELP
from umbra.errors import InvalidRequest, UmbraError
from umbra.settings import server_url

from .client import AgentClient, ServiceError
from .credentials import CredentialFile, StoredCredential
from .devices import DeviceSpecError, check_device_set, discover, parse_device_spec
from .commands import CommandHandler, parse_command
from .handlers import HandlerRegistry, load_object
from .resident import OllamaModels, ollama_url, place_resident
from .runner import Agent, AgentConfig

log = logging.getLogger(__name__)


def agent_version() -> str:
    try:
        return version("umbra-compute")
    except PackageNotFoundError:
        return "0+unknown"


#: Most jobs one agent runs at once (each slot is a long-poll and a connection).
MAX_CONCURRENCY = 64
#: --heartbeat bounds, seconds. Below one second a failing server is retried in a tight loop (a failed
#: beat is retried after the back-off or the interval, whichever is shorter); the upper bound refuses
#: milliseconds given for seconds, and infinity.
HEARTBEAT_RANGE = (1.0, 300.0)
#: --grace bounds, seconds: a stop still ends within the hour (a supervisor's stop timeout is shorter).
GRACE_RANGE = (0.0, 3600.0)
PROGRESS_RANGE = (0.5, 3600.0)
#: --claim-wait bounds, seconds: the longest long-poll the server holds (API.md: ``wait`` 0..60).
CLAIM_WAIT_RANGE = (0.0, 60.0)
#: --log-level choices, taken in any case.
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def _seconds(low: float, high: float):
    """An argparse ``type``: seconds from ``low`` to ``high``."""
    return _within(low, high, float, unit=" seconds")


def _device(text: str):
    try:
        return parse_device_spec(text)
    except DeviceSpecError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


class _AddDevice(argparse.Action):
    """``--device`` appended to the set, refused at once when the set is one the server would refuse."""

    def __call__(self, parser, namespace, device, option_string=None) -> None:
        devices = [*(getattr(namespace, self.dest) or ()), device]  # a copy: never the default list itself
        try:
            check_device_set(devices)
        except DeviceSpecError as exc:
            raise argparse.ArgumentError(self, str(exc)) from None
        setattr(namespace, self.dest, devices)


def _handler_spec(text: str) -> tuple[str, str]:
    kind, sep, target = text.partition("=")
    if not sep or not kind.strip() or ":" not in target:
        raise argparse.ArgumentTypeError(f"--handler must look like KIND=package.module:function, got {text!r}")
    return kind.strip(), target.strip()


def _command_spec(text: str) -> tuple[str, list[str]]:
    kind, sep, command = text.partition("=")
    try:
        argv = parse_command(command)
    except ValueError as exc:
        argv, why = [], str(exc)
    else:
        why = ""
    if not sep or not kind.strip() or not argv:
        raise argparse.ArgumentTypeError(f"--command must look like KIND='PROGRAM ARGS...', got {text!r}"
                                         + (f" ({why})" if why else ""))  # fmt: skip
    return kind.strip(), argv


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "agent",
        help="run the reference agent on this machine",
        description=__doc__.split("\n\n", 1)[1] if __doc__ else None,
    )
    p.add_argument("--server", default=None, help="controller URL (default: the one saved at pairing, else " + SERVER_HELP.removeprefix("service URL (default "))
    p.add_argument("--code", help="six-digit pairing code (first run only)")
    p.add_argument("--name", help="node name the pairing code was issued for")
    p.add_argument("--credential-file", type=Path, help="where the node credential is kept (default: <data dir>/agent/credential.json)")
    p.add_argument("--device", type=_device, action=_AddDevice, default=[], metavar="JSON",
                   help="report this device instead of discovering (repeatable; a Device object as in API.md, checked"
                        " as the server checks it: no unknown fields, a non-empty label of its own, no negative MB)")
    p.add_argument("--ollama", nargs="?", const="", default=None, metavar="URL",
                   help="report the models the Ollama server at URL holds loaded, on the devices holding them, with "
                        "each heartbeat (default URL: OLLAMA_HOST as Ollama reads it, a host alone on its port 11434; else "
                        "http://127.0.0.1:11434)")  # fmt: skip
    p.add_argument("--handler", type=_handler_spec, action="append", default=[], metavar="KIND=MODULE:FUNC",
                   help="add or replace the handler for a job kind (repeatable)")
    p.add_argument("--command", type=_command_spec, action="append", default=[], metavar="KIND='PROGRAM ARGS'",
                   help="run a program for each job of a kind: the payload as JSON on its standard input, its standard "
                        "output (JSON, else text) the result, exit 0 complete, 75 retry, other failed; a line "
                        "'umbra-progress 0.5 message' on standard error reports progress (repeatable)")  # fmt: skip
    p.add_argument("--grace", type=_seconds(*GRACE_RANGE), default=30.0,
                   help="seconds a running job may continue after SIGTERM, SIGINT or SIGHUP, 0..3600 (default 30)")
    p.add_argument("--claim-wait", type=_seconds(*CLAIM_WAIT_RANGE), default=30.0,
                   help="long-poll seconds per claim request, 0..60 (default 30)")
    p.add_argument("--concurrency", type=_within(1, MAX_CONCURRENCY), default=1,
                   help=f"jobs run at once, 1..{MAX_CONCURRENCY} (default 1)")
    p.add_argument("--progress-seconds", type=_seconds(*PROGRESS_RANGE), default=5.0,
                   help="how soon a handler's report_progress reaches the server (with an early renewal of the "
                        "lease), 0.5..3600 (default 5)")  # fmt: skip
    p.add_argument("--heartbeat", type=_seconds(*HEARTBEAT_RANGE), default=10.0,
                   help="heartbeat seconds until the server names an interval, 1..300 (default 10)")
    p.add_argument("--log-level", type=str.upper, choices=LOG_LEVELS, default="INFO",
                   help=f"{', '.join(LOG_LEVELS)} (default INFO)")
    p.set_defaults(func=run_agent)


def run_agent(args) -> int:
    from umbra.logs import configure_logging
    from umbra.settings import load_settings

    configure_logging(args.log_level)
    store = CredentialFile(args.credential_file) if args.credential_file else CredentialFile.default(load_settings().data_dir)
    registry = HandlerRegistry.default()
    for kind, target in args.handler:
        registry.register(kind, load_object(target))
    for kind, argv in args.command:
        registry.register(kind, CommandHandler(argv))
    overrides = list(args.device)
    resident = OllamaModels(ollama_url(args.ollama or None)) if args.ollama is not None else None

    def devices():
        found = overrides or discover()
        return found if resident is None else place_resident(found, resident())

    try:
        status = anyio.run(_main, args, store, registry, devices)
    except UmbraError as refusal:  # a rejected credential, say: said on one line, as the CLI says refusals
        hint = ""
        if refusal.code == "unauthenticated" and not args.code:
            hint = (f" (the credential in {store.path} was revoked or its node removed: remove the file, or pass"
                    " another --credential-file, and pair again with --code)")  # fmt: skip
        print(f"umbra: {refusal.code}: {refusal.message}{hint}", file=sys.stderr)
        status = 1
    finally:
        if resident is not None:
            resident.close()
    _exit_past_abandoned_handlers(status)
    return status


def _exit_past_abandoned_handlers(status: int) -> None:
    """Exit now if a plain handler's thread is still running: its job was handed back (or its grace
    ran out) and a thread cannot be stopped, but the interpreter would wait for it at exit, and the
    agent would never end. Logs are flushed first; nothing else is left to do."""
    if any(t.is_alive() and not t.daemon for t in threading.enumerate() if t is not threading.main_thread()):
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


async def _pair(args, store: CredentialFile, devices) -> StoredCredential:
    if store.exists():
        raise InvalidRequest(f"{store.path} already holds a credential; run without --code, or remove it to pair again.")
    if not args.name:
        raise InvalidRequest("--name is required with --code: the name the pairing code was issued for.")
    store.check_writable()  # before the code is spent: the credential is shown only once
    server = args.server or server_url()
    async with AgentClient(server) as client:
        answer = await client.redeem(code=args.code, name=args.name, agent_version=agent_version(), devices=devices())
    stored = StoredCredential(
        server=server, node_id=answer["node_id"], name=args.name, credential=answer["credential"],
        scopes=tuple(answer.get("scopes") or ()),
    )
    store.save(stored)
    print(f"paired as {args.name} (node {stored.node_id}); credential saved to {store.path}", flush=True)
    return stored


async def _main(args, store: CredentialFile, registry: HandlerRegistry, devices) -> int:
    stored = await _pair(args, store, devices) if args.code else store.load()
    if args.name and args.name != stored.name:
        raise InvalidRequest(f"{store.path} belongs to node {stored.name!r}, not {args.name!r}; use --credential-file.")
    if args.server and args.server.rstrip("/") != stored.server.rstrip("/"):
        # The credential is a secret of the server that issued it: never sent anywhere else on a flag's word.
        raise InvalidRequest(f"{store.path} holds a credential issued by {stored.server}, not {args.server}; "
                             "it is sent only there (if that service moved, edit the file's \"server\").")  # fmt: skip
    config = AgentConfig(
        agent_version=agent_version(),
        heartbeat_seconds=args.heartbeat,
        claim_wait_seconds=args.claim_wait,
        grace_seconds=args.grace,
        concurrency=args.concurrency,
        progress_seconds=args.progress_seconds,
    )
    async with AgentClient(stored.server, stored.credential) as client:
        agent = Agent(client, registry, devices, config)
        fatal: ServiceError | None = None
        async with anyio.create_task_group() as tg:
            tg.start_soon(_stop_on_signals, agent)
            log.info("agent started", extra={"action": "agent_started", "node_id": stored.node_id, "kinds": ",".join(registry.kinds)})
            try:
                await agent.run()
            except ServiceError as exc:  # a rejected credential, or devices refused: retrying cannot help
                fatal = exc
            tg.cancel_scope.cancel()
    if fatal is not None:
        raise fatal
    log.info("agent stopped", extra={"action": "agent_stopped", "node_id": stored.node_id})
    return 0


def stop_signals() -> list[signal.Signals]:
    """The signals that stop the agent gracefully.

    SIGHUP is one: the terminal or SSH session the agent was started from closing would
    otherwise kill it outright, its running job neither finished nor given back (it waits
    out its lease) and the node left to go stale. Under ``nohup`` (SIGHUP ignored) the
    user asked it to outlive the terminal, and it stays ignored.
    """
    signals = [signal.SIGTERM, signal.SIGINT]
    hangup = getattr(signal, "SIGHUP", None)  # not on Windows
    if hangup is not None and signal.getsignal(hangup) != signal.SIG_IGN:
        signals.append(hangup)
    return signals


async def _stop_on_signals(agent: Agent) -> None:
    """The first signal stops the agent within the grace; a second SIGTERM or SIGINT, at once.

    A SIGHUP once the agent is stopping changes nothing: a supervisor may send it right
    after SIGTERM (systemd's ``SendSIGHUP=``), and the terminal closing is no request to
    give up the running job either.
    """
    hangup = getattr(signal, "SIGHUP", None)
    with anyio.open_signal_receiver(*stop_signals()) as signals:
        async for signum in signals:
            if agent.stopping and signum == hangup:
                continue
            log.info("stop requested", extra={"action": "agent_stopping", "signal": signal.Signals(signum).name,
                                              "immediately": agent.stopping})
            agent.stop(immediately=agent.stopping)
