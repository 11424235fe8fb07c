"""A job's program started tethered to its agent (:mod:`umbra.agent.tether`): it starts as
:class:`subprocess.Popen` would start it (its environment and signal dispositions the agent's, whatever the
interpreter starting it changes of its own), and one whose agent is already gone does not run at all. That it
dies with its agent: ``test_a_command_s_program_ends_with_its_agent_killed_by_sigkill``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from umbra.agent.commands import CommandHandler
from umbra.agent.tether import tethered

from .test_command_handler import FakeClaim

pytestmark = [pytest.mark.anyio, pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")]


async def test_a_program_s_environment_is_the_one_it_was_given_in_a_c_locale_too(monkeypatch):
    """Python sets ``LC_CTYPE`` in a C locale (PEP 538) as it starts: the program must not inherit that."""
    monkeypatch.delenv("LC_ALL", raising=False)
    monkeypatch.delenv("LC_CTYPE", raising=False)
    monkeypatch.setenv("LANG", "C")
    result = await CommandHandler(["env"])(FakeClaim())
    seen = dict(line.split("=", 1) for line in result["output"].splitlines() if "=" in line)
    assert "LC_CTYPE" not in seen and seen["LANG"] == "C"
    monkeypatch.setenv("LC_CTYPE", "POSIX")
    result = await CommandHandler(["env"])(FakeClaim())
    assert "LC_CTYPE=POSIX" in result["output"].splitlines()


async def test_a_program_s_ignored_signals_are_those_popen_would_leave_it():
    """Python ignores ``SIGPIPE`` and ``SIGXFSZ``; a program that inherited that would never die of a closed pipe
    (``yes | head`` runs for ever)."""
    read = ["grep", "^SigIgn:", "/proc/self/status"]
    expected = subprocess.run(read, capture_output=True, text=True, check=True).stdout
    assert (await CommandHandler(read)(FakeClaim()))["output"] == expected


def test_a_program_whose_agent_died_before_it_asked_for_the_signal_does_not_run(tmp_path):
    """Run by a process other than the one it was tethered to (here a shell in between, as if the agent had died
    and it had been reparented): it kills itself before the program starts."""
    marker = tmp_path / "ran"
    command = tethered(["touch", str(marker)], dict(os.environ))
    done = subprocess.run(["sh", "-c", '"$@"; exit $?', "sh", *command], check=False)
    assert done.returncode == 128 + signal.SIGKILL and not marker.exists()
    assert subprocess.run(command, check=False).returncode == 0 and marker.exists()


async def test_a_program_that_cannot_be_started_fails_for_good_with_status_127():
    with pytest.raises(Exception) as refused:
        await CommandHandler(["/no/such/program", "x"])(FakeClaim())
    assert str(refused.value) == ("/no/such/program exited with status 127: "
                                  "could not start '/no/such/program': No such file or directory")  # fmt: skip
