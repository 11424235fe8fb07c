"""``umbra admin`` commands for nodes: pairing codes, drain, retire, revoke, a device's cordon.

They talk to the database directly (like ``create-org``) and call the same
commands as the HTTP API, so a node drained from the shell records the same
``node.draining`` event, attributed to ``cli``. The pairing code is printed
once and is never logged. ``pairing-code`` also refuses a name a node already
holds: the code would be refused at redemption (``POST /v1/pairings`` issues it
all the same, as the contract says), and an operator at a shell would only
find out on the node.
"""

from __future__ import annotations

import argparse
import json
import shlex

#: The actor recorded in events these commands append.
CLI_ACTOR = "cli"


def _admin_subparsers(sub: argparse._SubParsersAction) -> argparse._SubParsersAction:
    """The ``admin`` group's subcommand table, created by the bootstrap registrar."""
    admin = sub.choices["admin"]
    for action in admin._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action
    raise RuntimeError("the admin command group has no subcommands")


async def _pairing_code(conn, args) -> int:
    from umbra.compute.accounts import require_organization
    from umbra.compute.pairing import issue_pairing_code, require_name_free

    async with conn.transaction():
        await require_organization(conn, args.org)
        await require_name_free(conn, args.org, args.name)  # else the code could never be redeemed
        issued = await issue_pairing_code(
            conn, args.org, args.name, trust_domain=args.trust_domain, locality=args.locality, ttl_seconds=args.ttl
        )
    expires = issued.expires_at.isoformat().replace("+00:00", "Z")
    if args.json:
        print(json.dumps({"code": issued.code, "node_name": issued.node_name, "expires_at": expires}))
    else:
        print(f"pairing code for {issued.node_name}: {issued.code} (single use, expires {expires})")
        print(f"on the node: umbra agent --server URL --name {shlex.quote(issued.node_name)} --code {issued.code}")
    return 0


def _pairing_checked(check: str, convert=str):
    """An argparse ``type``: ``convert`` the text, then check it with :mod:`umbra.compute.pairing`'s ``check``,
    the check :func:`~umbra.compute.pairing.issue_pairing_code` makes, so a value it refuses is refused as an
    argument (exit 2) before the database is opened. Imported when an argument is parsed, not when any
    command's parser is built."""

    def parse(text: str):
        from umbra.compute import pairing
        from umbra.errors import InvalidRequest

        try:
            return getattr(pairing, check)(convert(text))
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
        except InvalidRequest as refused:
            raise argparse.ArgumentTypeError(refused.message) from None

    return parse


def _node_json(state) -> dict:
    out = {"node_id": str(state.id), "name": state.name, "stored_status": state.status}
    return {**out, "cordoned": dict(state.cordoned)} if state.cordoned else out


def _node_command(name: str):
    async def run(conn, args) -> int:
        from umbra.cli_events import printable
        from umbra.compute import credentials, nodes
        from umbra.settings import load_settings

        stale = load_settings().heartbeat_stale_seconds  # a silence the views read offline is recorded first
        if name == "drain":
            state = await nodes.drain_node(conn, args.org, args.node_id, actor=CLI_ACTOR, stale_seconds=stale)
            out = _node_json(state)
        elif name == "retire":
            state = await nodes.retire_node(conn, args.org, args.node_id, actor=CLI_ACTOR, stale_seconds=stale)
            out = _node_json(state)
        elif name == "cordon":
            state = await nodes.cordon_device(conn, args.org, args.node_id, args.device, reason=args.reason, actor=CLI_ACTOR,
                                              stale_seconds=stale)
            out = _node_json(state)
        elif name == "uncordon":
            state = await nodes.uncordon_device(conn, args.org, args.node_id, args.device, actor=CLI_ACTOR,
                                                stale_seconds=stale)
            out = _node_json(state)
        else:
            state, revoked = await credentials.revoke_node(conn, args.org, args.node_id, actor=CLI_ACTOR,
                                                              stale_seconds=stale)
            out = {**_node_json(state), "revoked_credentials": [str(c) for c in revoked]}
        if args.json:
            print(json.dumps(out))
        else:  # the name is the node's: it may hold what a terminal would act on
            for key, value in out.items():
                shown = ",".join(value) if isinstance(value, list) else value
                if isinstance(value, dict):  # cordoned devices, with their reasons
                    shown = ", ".join(label if why is None else f"{label} ({why})" for label, why in value.items())
                print(printable(f"{key}: {shown}"))
        return 0

    return run


_NODE_HELP = {
    "drain": "let the node finish its current work and take no new",
    "retire": "take the node out of service for good",
    "revoke": "revoke the node's credentials; its agent is refused at once",
    "cordon": "take one device of the node out of service; its other devices go on taking work",
    "uncordon": "put a cordoned device back in service",
}


def register(sub: argparse._SubParsersAction) -> None:
    from umbra.cli import _uuid, _with_database

    admin = _admin_subparsers(sub)
    p = admin.add_parser(
        "pairing-code",
        help="issue a single-use pairing code for a named node",
        description="Issue a six-digit, single-use pairing code bound to a node name. "
        "It is shown once; the node is created when an agent redeems it. A node's name stays taken, "
        "retired nodes' too: a machine paired again is paired under a new name.",
    )
    p.add_argument("--org", type=_uuid, required=True, help="organization id")
    p.add_argument("--name", type=_pairing_checked("check_node_name"), required=True,
                   help="the node name the code is bound to, 1..200 characters, one no node holds (retired or not)")
    p.add_argument("--ttl", type=_pairing_checked("check_ttl", int), default=600,
                   help="lifetime in seconds, 60..1800 (default 600)")
    p.add_argument("--trust-domain", type=_pairing_checked("check_trust_domain"), default="local",
                   help="trust domain of the node, 1..100 characters (default local)")
    p.add_argument("--locality", type=_pairing_checked("check_locality"), default=None,
                   help="where the node is (free text, at most 200 characters)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_with_database(_pairing_code))

    for name, help_text in _NODE_HELP.items():
        p = admin.add_parser(name, help=help_text, description=help_text[0].upper() + help_text[1:] + ".")
        p.add_argument("--org", type=_uuid, required=True, help="organization id")
        p.add_argument("node_id", type=_uuid, help="node id")
        if name in ("cordon", "uncordon"):
            p.add_argument("device", help="the device's label, as the node reports it (e.g. gpu0)")
        if name == "cordon":
            p.add_argument("--reason", default=None, help="why, for whoever reads the node next (e.g. ECC errors)")
        p.add_argument("--json", action="store_true", help="print JSON")
        p.set_defaults(func=_with_database(_node_command(name)))
