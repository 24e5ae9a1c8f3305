"""Bounded and honest exits: the real console script against dependencies that are down.

Every endpoint is a closed loopback port, each system its own, so a message can be checked
for naming the right one. No server is started. Each command must end within a generous
bound (a behaviour bound, not a benchmark), exit 1, say one ``error:`` line on stderr naming
what it could not reach, print one JSON error document on stdout, and show no traceback.

The commands against the closed ports run as processes forked from one pre-imported
``modelship`` (:class:`tests.zygote.Zygote`, as the fault matrix runs its CLIs): each is a
real process running the console script's ``main`` to its exit status, and the bound times
the command, not five interpreters importing Prefect and MLflow on a busy machine. The
release with no stack runs the console script itself, from a fresh interpreter.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.conftest import ROOT, cli_env, run_cli
from tests.zygote import Zygote

BOUND_S = 45.0


def _closed_ports(n: int) -> list[int]:
    """Ports that were free a moment ago: nothing listens there."""
    sockets = [socket.socket() for _ in range(n)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [int(sock.getsockname()[1]) for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


# command, the system it must name (the first it needs)
COMMANDS: list[tuple[tuple[str, ...], str | None]] = [
    (("history", "fraud"), "s3"),
    (("promote", "fraud", "--version", "2", "--dry-run"), "prefect"),
    (("rollback", "fraud", "--dry-run"), None),
    (("swap", "fraud", "--to", "2", "--dry-run"), None),
    (("locks", "fraud"), None),
]


#: What the commands below import before they run (the rest each imports itself).
PRELOAD = ("modelship.cli", "flows.promote", "flows.standalone")


@pytest.fixture(scope="module")
def outage(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str],
                                                               dict[str, str]]:
    mlflow, s3, prefect, triton, canary = _closed_ports(5)
    endpoints = {"mlflow": f"http://127.0.0.1:{mlflow}", "s3": f"http://127.0.0.1:{s3}",
                 "prefect": f"http://127.0.0.1:{prefect}/api",
                 "triton": f"http://127.0.0.1:{triton}"}

    def server(name: str, port: int) -> dict[str, str]:
        return {"name": name, "http": f"http://127.0.0.1:{port}",
                "grpc": f"127.0.0.1:{port}", "metrics": f"http://127.0.0.1:{port}/metrics"}

    env = {"MLFLOW_TRACKING_URI": endpoints["mlflow"],
           "MODELSHIP_S3_ENDPOINT": endpoints["s3"],
           "AWS_ACCESS_KEY_ID": "modelship", "AWS_SECRET_ACCESS_KEY": "modelship-secret",
           "PREFECT_API_URL": endpoints["prefect"],
           "MODELSHIP_MANIFEST_SIGNING_KEY": "k" * 40,
           "MODELSHIP_TRITON_REPLICAS": json.dumps([server("triton-0", triton)]),
           "MODELSHIP_TRITON_CANARY": json.dumps(server("canary", canary))}
    return tmp_path_factory.mktemp("outage"), env, endpoints


@pytest.fixture(scope="module")
def cli(outage: tuple[Path, dict[str, str], dict[str, str]]) -> Iterator[Zygote]:
    """``modelship`` imported once, in the outage's environment (as :func:`run_cli` gives
    it: Prefect reads its API URL at import); each run a process forked from it."""
    home, env, _ = outage
    with Zygote(target="modelship.cli:main", preload=PRELOAD, env=cli_env(home, env),
                cwd=ROOT, prepare="tests.faults:cli_defaults") as zygote:
        zygote.wait_ready()
        yield zygote


def _run(zygote: Zygote, args: tuple[str, ...]) -> tuple[float, object]:
    started = time.monotonic()
    result = zygote.run(["modelship", *args, "--json"], timeout=BOUND_S * 3)
    return time.monotonic() - started, result


def test_every_command_ends_in_time_and_names_what_it_could_not_reach(
        outage: tuple[Path, dict[str, str], dict[str, str]], cli: Zygote) -> None:
    _, _, endpoints = outage
    with ThreadPoolExecutor(max_workers=2) as pool:
        runs = list(pool.map(lambda item: _run(cli, item[0]), COMMANDS))
    for (args, names), (seconds, result) in zip(COMMANDS, runs, strict=True):
        assert seconds < BOUND_S, (args, seconds)
        code, out, err = result.returncode, result.stdout, result.stderr  # type: ignore[attr-defined]
        assert "Traceback" not in out + err, (args, err[-2000:])
        errors = [line for line in err.splitlines() if line.startswith("error: ")]
        assert len(errors) == 1, (args, err[-2000:])
        document = json.loads(out)  # exactly one JSON document on stdout
        assert code == document["exit_code"] == 1, (args, code, document)
        assert document["message"] in errors[0]
        named = [system for system, url in endpoints.items()
                 if url.rsplit("/api", 1)[0] in errors[0]]
        assert named, (args, errors[0])  # it says which endpoint it could not reach
        if names is not None:
            assert named == [names], (args, errors[0])
        assert document["error"] in ("Unreachable", "InfrastructureError", "PreflightError"), \
            (args, document)


def test_a_release_with_no_stack_and_no_prefect_says_how_to_get_one(tmp_path: Path) -> None:
    """No stack in the home and no PREFECT_API_URL: exit 1 naming both ways out, not
    Prefect's "No Prefect API URL provided" as an unexpected error (and no ephemeral
    Prefect server started for it)."""
    result = run_cli("promote", "fraud", "--version", "2", "--json",
                     home=tmp_path / ".modelship", timeout=BOUND_S * 3)
    document = json.loads(result.stdout)
    assert result.returncode == document["exit_code"] == 1, result.stderr[-2000:]
    assert document["error"] == "InfrastructureError", document
    assert "no Prefect API" in document["message"], document
    assert "modelship stack up" in document["hint"] and "PREFECT_API_URL" in document["hint"]
    assert "Traceback" not in result.stdout + result.stderr
