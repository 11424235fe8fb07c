"""``umbra``'s arguments: every command has help, and every mistake in them is one line and exit 2
(no database, no server: refused before either is reached)."""

from __future__ import annotations

import pytest

from umbra.cli import main

#: An organization id no database holds (fixed: the parameters' ids must be the same in every test worker).
ORG = "7f3c2a10-0000-4000-8000-000000000001"

COMMANDS = [
    [], ["migrate"], ["serve"], ["admin"], ["admin", "create-org"], ["admin", "create-key"], ["admin", "list-keys"],
    ["admin", "revoke-key"], ["admin", "create-project"], ["admin", "pairing-code"], ["admin", "drain"],
    ["admin", "retire"], ["admin", "revoke"], ["agent"], ["events"], ["events", "tail"], ["events", "replay"],
    ["verify"], ["jobs"], ["jobs", "explain"], ["bench"],
]


@pytest.mark.parametrize("argv", COMMANDS, ids=lambda argv: " ".join(argv) or "umbra")
def test_every_command_has_help(argv, capsys):
    """``umbra --help`` and each command's ``--help`` exit 0 and print its usage: README's commands all exist."""
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--help"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.startswith("usage: umbra")


@pytest.mark.parametrize("argv", [
    [], ["bogus"], ["admin"], ["admin", "create-org"], ["admin", "create-key", "--org", "x", "--scopes", "jobs:read"],
    ["admin", "pairing-code", "--org", ORG, "--name", "x", "--ttl", "abc"],
    ["admin", "pairing-code", "--org", ORG, "--name", "x", "--ttl", "5"],
    ["admin", "pairing-code", "--org", ORG, "--name", " "],
    ["admin", "pairing-code", "--org", ORG, "--name", "x", "--trust-domain", ""],
    ["events"], ["events", "replay", "not-a-uuid"], ["jobs"], ["jobs", "explain"], ["serve", "--port", "99999"],
    ["agent", "--handler", "nonsense"], ["agent", "--device", "{}"], ["events", "tail", "--after", "x"],
], ids=lambda argv: " ".join(argv) or "umbra")  # fmt: skip
def test_wrong_arguments_are_one_line_and_exit_2(argv, capsys):
    """Every argument mistake: one line ``umbra: invalid_request: <command>: ... (see <command> --help)``,
    exit 2, so a script tells a mistyped command from a refusal by the database or the server (exit 1)."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert err.count("\n") == 1 and err.startswith("umbra: invalid_request: umbra") and "--help)" in err, err


@pytest.mark.parametrize("given, quoted", [
    ("7f3c2a10-0000-4000-8000-00000000000", True),  # a UUID mistyped (a digit short) is shown, to be corrected
    ("uk_0123456789_S3cretS3cretS3cret", False),  # an API key pasted where the id belongs is not
    ("nk_0123456789_S3cretS3cretS3cret", False),
])  # fmt: skip
def test_an_id_refused_is_quoted_only_when_it_cannot_be_a_secret(given, quoted, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["admin", "list-keys", "--org", given])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "not a UUID" in err and err.count("\n") == 1, err
    assert (given in err) is quoted, err
