"""``umbra agent``'s flags: a value the agent cannot use is refused at start with a clear error
naming the flag (exit 2, as every refused argument), never accepted and found out later (no
database, no server)."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import sighup_at_default

from umbra.agent.cli import stop_signals
from umbra.agent.runner import AgentConfig
from umbra.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]

CPU = {"kind": "cpu", "label": "c0", "ram_total_mb": 8192, "ram_free_mb": 8000}


def _parse(*argv: str):
    return build_parser().parse_args(["agent", *argv])


def _refused(capsys, *argv: str) -> str:
    """What ``umbra agent ARGV`` says when its parser refuses ARGV (exit 2, as argparse's)."""
    with pytest.raises(SystemExit) as refused:
        _parse(*argv)
    assert refused.value.code == 2
    return capsys.readouterr().err


# -- --device ------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "spec, field",
    [
        ({"kind": "gpu_discrete", "label": "g0", "vram_totl_mb": 24576, "vram_free_mb": 24000}, "vram_totl_mb"),
        ({"kind": "cpu", "label": "c0", "ram_total": 65536, "ram_free_mb": 60000}, "ram_total"),
    ],
    ids=["vram_totl_mb", "ram_total"],
)
def test_a_device_with_a_field_the_device_object_does_not_have_is_refused_naming_it(capsys, spec, field):
    """A misspelt field is not dropped: the GPU would be reported with 0 MB of VRAM, busy for ever."""
    err = _refused(capsys, "--device", json.dumps(spec))
    assert "--device" in err and f"unknown field `{field}`" in err, err


@pytest.mark.parametrize(
    "spec, where",
    [
        ({**CPU, "label": ""}, "$.label"),
        ({**CPU, "label": "x" * 201}, "$.label"),
        ({**CPU, "ram_total_mb": -1}, "$.ram_total_mb"),
        ({**CPU, "ram_free_mb": 2**31}, "$.ram_free_mb"),
        ({**CPU, "throughput_factor": 0}, "$.throughput_factor"),
        ({**CPU, "compute_units": -2}, "$.compute_units"),
        ({**CPU, "accelerators": [""]}, "$.accelerators[0]"),
        ({**CPU, "resident_models": [{"slug": "m", "vram_held_mb": -5}]}, "$.resident_models[0].vram_held_mb"),
        ({**CPU, "ram_free_mb": 9000}, "`ram_free_mb`"),
    ],
    ids=["empty-label", "long-label", "negative-mb", "huge-mb", "zero-throughput", "negative-units",
         "empty-accelerator", "negative-resident", "more-free-than-total"],
)
def test_a_device_the_server_would_refuse_is_refused_at_start(capsys, spec, where):
    """The server refuses such a heartbeat (422) every time it is sent: the agent refuses it first."""
    err = _refused(capsys, "--device", json.dumps(spec))
    assert where in err, err


def test_two_devices_with_one_label_are_refused_at_start(capsys):
    """Devices are told apart by label within a node: the server refuses a set naming one twice."""
    err = _refused(capsys, "--device", json.dumps(CPU), "--device", json.dumps({**CPU, "ram_free_mb": 4000}))
    assert "'c0' is given twice" in err, err


def test_devices_the_server_accepts_are_kept_in_order():
    gpu = {"kind": "gpu_discrete", "label": "g0", "vram_total_mb": 24576, "vram_free_mb": 24000,
           "accelerators": ["cuda"], "resident_models": [{"slug": "m", "vram_held_mb": 100}]}
    args = _parse("--device", json.dumps(CPU), "--device", json.dumps(gpu))
    assert [(d.label, d.kind) for d in args.device] == [("c0", "cpu"), ("g0", "gpu_discrete")]
    assert args.device[1].resident_models[0].slug == "m"
    assert _parse().device == [], "no --device: discovery (and the default list is never appended to)"


# -- --heartbeat, --grace, --claim-wait, --concurrency, --log-level -----------------------------

def _agent(*argv: str, tmp_path: Path) -> subprocess.CompletedProcess:
    """``umbra agent ARGV`` as a process, with no credential: it stops at start either way."""
    missing = tmp_path / "no-credential.json"
    return subprocess.run(
        [sys.executable, "-m", "umbra.cli", "agent", *argv, "--credential-file", str(missing),
         "--server", "http://127.0.0.1:9"],
        cwd=ROOT, capture_output=True, text=True, timeout=60, env=dict(os.environ),
    )


@pytest.mark.parametrize("argv", [("--heartbeat", "0"), ("--heartbeat", "-3"), ("--heartbeat", "nan"),
                                  ("--heartbeat", "0.5"), ("--heartbeat", "301"), ("--heartbeat", "inf"),
                                  ("--grace", "-1"), ("--grace", "nan"), ("--grace", "3601"),
                                  ("--claim-wait", "-1"), ("--claim-wait", "99"), ("--concurrency", "0"),
                                  ("--concurrency", "65"), ("--concurrency", "x"), ("--concurrency", "1.5"),
                                  ("--log-level", "bogus")],
                         ids=lambda argv: "=".join(argv).removeprefix("--"))
def test_a_flag_out_of_its_range_is_refused_as_an_argument_naming_it(argv, capsys):
    """A value out of the range --help gives (heartbeat 1..300 s, grace 0..3600 s, claim wait 0..60 s,
    concurrency 1..64, a log level) exits 2 with one line naming the flag, as every refused argument does,
    so a wrapper tells a mistyped flag from a refusal by the server (exit 1). With --heartbeat 0 a failed
    beat would be retried at once, hammering a server that is down."""
    err = _refused(capsys, *argv)
    assert err.startswith(f"umbra: invalid_request: umbra agent: argument {argv[0]}: ") and err.count("\n") == 1, err
    assert err.rstrip().endswith("(see umbra agent --help)"), err


def test_a_flag_out_of_its_range_exits_2_from_the_command_too(tmp_path):
    """The same refusal from ``umbra agent`` as a process: exit 2, one line, before any credential is read."""
    done = _agent("--concurrency", "0", tmp_path=tmp_path)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith("umbra: invalid_request: umbra agent: argument --concurrency: must be between 1 and 64")


def test_flags_at_their_bounds_are_accepted(tmp_path):
    """Past the range checks, the agent stops only for want of a credential."""
    done = _agent("--heartbeat", "1", "--grace", "0", "--claim-wait", "0", "--concurrency", "1", tmp_path=tmp_path)
    assert done.returncode == 1 and done.stderr.startswith("umbra: credential_file:"), done.stderr
    done = _agent("--heartbeat", "300", "--grace", "3600", "--claim-wait", "60", "--concurrency", "64",
                  "--log-level", "debug", tmp_path=tmp_path)  # fmt: skip
    assert done.returncode == 1 and done.stderr.startswith("umbra: credential_file:"), done.stderr


def test_the_log_level_is_taken_in_any_case():
    assert _parse("--log-level", "warning").log_level == "WARNING" and _parse().log_level == "INFO"


@pytest.mark.parametrize("heartbeat", [0.0, -1.0, math.nan, math.inf])
def test_the_agent_loop_refuses_a_heartbeat_period_it_would_spin_on(heartbeat):
    """Whoever builds an Agent: a failed beat is retried after min(period, back-off), so a period of
    zero would retry a failing server without pause."""
    with pytest.raises(ValueError, match="heartbeat_seconds"):
        AgentConfig(agent_version="t", heartbeat_seconds=heartbeat)


@pytest.mark.parametrize("grace", [-1.0, math.nan])
def test_the_agent_loop_refuses_a_grace_that_is_not_a_duration(grace):
    with pytest.raises(ValueError, match="grace_seconds"):
        AgentConfig(agent_version="t", grace_seconds=grace)


# -- signals -------------------------------------------------------------------------------

def test_sighup_stops_the_agent_as_sigterm_and_sigint_do():
    """A closed terminal or SSH session stops the agent gracefully instead of killing it mid-job."""
    with sighup_at_default():
        assert {signal.SIGTERM, signal.SIGINT, signal.SIGHUP} <= set(stop_signals())


def test_a_sighup_ignored_as_under_nohup_stays_ignored():
    """``nohup umbra agent`` asks for an agent that outlives its terminal."""
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        assert signal.SIGHUP not in stop_signals()
        assert {signal.SIGTERM, signal.SIGINT} <= set(stop_signals())
    finally:
        signal.signal(signal.SIGHUP, previous)


@pytest.mark.parametrize("argv", [("jobs", "retry", "00000000-0000-0000-0000-000000000001", "--max-attempts", "0"),
                                  ("jobs", "retry-failed", "--max-attempts", "101"),
                                  ("jobs", "submit", "k", "--max-attempts", "0")], ids=["retry", "retry-failed", "submit"])
def test_jobs_max_attempts_outside_1_to_100_is_refused_as_an_argument(capsys, argv):
    """As its help says, and as every range flag: the parser's refusal (exit 2), not the server's (exit 1)."""
    with pytest.raises(SystemExit) as refused:
        build_parser().parse_args(list(argv))
    assert refused.value.code == 2
    assert "argument --max-attempts: must be between 1 and 100" in capsys.readouterr().err


def test_progress_seconds_is_a_range_flag_and_reaches_the_agent_s_config(capsys):
    assert _parse("--progress-seconds", "0.5").progress_seconds == 0.5
    assert "argument --progress-seconds: must be between 0.5 and 3600 seconds, not 0.1" in _refused(capsys, "--progress-seconds", "0.1")
    with pytest.raises(ValueError):
        AgentConfig(agent_version="x", progress_seconds=0)
