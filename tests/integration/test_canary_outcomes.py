"""The canary's outcomes that latency does not decide, on the real stack: answers that
disagree, a first release (absolute gates only), and the ways out of a canary (a failed run,
a canary Triton killed under load, a load call that times out), each leaving nothing loaded.

The latency verdicts are tests/integration/test_canary.py's, which ``make test`` runs alone
on a quiet machine; these need no quiet machine, so they run with the rest of the suite and
keep that file's setup, on the suite's critical path, small. Same model and policy as
there: v1 the baseline, v2 the same sklearn model registered again, v3 a model trained on
other data (other answers).
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from modelship.clients import Clients
from modelship.errors import GateFailed, InfrastructureError, ModelshipError
from modelship.policy import Policy
from modelship.settings import Settings, TritonEndpoint
from modelship.stack.local_triton import LocalTriton, local_tritonserver
from modelship.triton.client import TritonServer
from tasks.canary import run_canary
from tests.integration.test_canary import (
    CANARY_POLICY,
    MODEL,
    assert_nothing_loaded,
    judged_canary,
    rule,
    staged_arms,
)

pytestmark = pytest.mark.integration


@dataclass(frozen=True)
class Arms:
    baseline: int
    same: int
    different: int


@pytest.fixture(scope="module")
def arms(stack_settings: Settings, clients: Clients,
         tmp_path_factory: pytest.TempPathFactory) -> Arms:
    """Register, check and stage the three versions, as `modelship stage` would."""
    baseline, same, different = staged_arms(stack_settings, clients, tmp_path_factory, 1)
    return Arms(baseline=baseline, same=same, different=different)


def test_candidate_with_other_answers_fails_agreement(stack_settings: Settings,
                                                      clients: Clients, arms: Arms,
                                                      tmp_path: Path) -> None:
    # Agreement is the subject: no latency rule, whose plan (3,100 requests a version) would
    # hold the canary to its cap; it ends once agreement has its samples.
    policy = {**CANARY_POLICY, "gates": [g for g in CANARY_POLICY["gates"]
                                         if g["name"] in ("error_rate", "agreement")]}
    result = judged_canary(stack_settings, clients, tmp_path, candidate=arms.different,
                           baseline=arms.baseline, policy=policy)
    agreement = rule(result, "agreement")
    assert str(agreement.verdict) == "failed", agreement.message
    assert result.snapshot.agreement is not None and result.snapshot.agreement < 0.98
    assert result.snapshot.agreement_samples >= 300
    assert result.verdict == "failed"


def test_first_release_judges_only_absolute_gates(stack_settings: Settings, clients: Clients,
                                                  arms: Arms, tmp_path: Path) -> None:
    policy = {**CANARY_POLICY, "canary": {**CANARY_POLICY["canary"], "max_duration_s": 6.0}}
    result = judged_canary(stack_settings, clients, tmp_path, candidate=arms.same, baseline=None,
                           policy=policy)
    assert result.verdict == "passed", result.to_dict()["gates"]
    # The quantile and server-side tests need a baseline.
    assert result.skipped_rules == ["latency_p99", "agreement", "server_latency"]
    assert [r.rule for r in result.gate_report.results] == ["error_rate"]
    assert result.snapshot.baseline is None and result.snapshot.agreement is None
    assert "first release" in Path(result.report_paths["markdown"]).read_text(encoding="utf-8")


def test_canary_is_unloaded_when_the_run_fails(stack_settings: Settings, clients: Clients,
                                               arms: Arms, tmp_path: Path) -> None:
    class Interrupted(Exception):
        pass

    def progress(line: str) -> None:
        if line.startswith("warming up"):
            assert clients.canary is not None
            assert clients.canary.is_model_ready(MODEL, str(arms.same))
            raise Interrupted(line)

    with pytest.raises(Interrupted):
        run_canary(stack_settings, clients, Policy.model_validate(CANARY_POLICY), model=MODEL,
                   candidate=arms.same, baseline=arms.baseline, progress=progress,
                   report_dir=tmp_path)
    assert_nothing_loaded(clients)


RUNTIME_VENV = Path(__file__).resolve().parents[2] / ".venv-triton"


@contextmanager
def _own_canary(stack_settings: Settings, workdir: Path) -> Iterator[tuple[LocalTriton,
                                                                         TritonServer]]:
    """A tritonserver of our own on the stack's S3 repository: ours to kill."""
    secret = stack_settings.aws_secret_access_key
    assert stack_settings.aws_access_key_id and secret is not None
    with local_tritonserver(RUNTIME_VENV, stack_settings.repository_url, workdir,
                            deadline_s=90.0,
                            s3_credentials=(stack_settings.aws_access_key_id,
                                            secret.get_secret_value())) as own:
        endpoint = TritonEndpoint(http=own.http_url, grpc=own.grpc_url,
                                  metrics=own.metrics_url, name="own-canary")
        server = TritonServer(endpoint, timeout_s=stack_settings.http_timeout_s,
                              control_timeout_s=stack_settings.control_timeout_s)
        try:
            yield own, server
        finally:
            server.close()


def test_a_canary_triton_killed_mid_canary_is_an_infrastructure_error(
        stack_settings: Settings, clients: Clients, arms: Arms,
        tmp_path: Path) -> None:
    """Kill our own canary Triton while the load runs: exit 1, never a gate failure (4)."""
    with _own_canary(stack_settings, tmp_path / "own") as (own, server):
        mine = replace(clients, canary=server)
        killer: list[threading.Timer] = []

        def progress(line: str) -> None:
            if line.startswith("measuring until") and not killer:
                killer.append(threading.Timer(1.0, os.killpg, (own.process.pid,
                                                               signal.SIGKILL)))
                killer[0].start()

        with pytest.raises(ModelshipError) as info:
            run_canary(stack_settings, mine, Policy.model_validate(CANARY_POLICY), model=MODEL,
                       candidate=arms.same, baseline=arms.baseline,
                       progress=progress, report_dir=tmp_path / "report")
        killer[0].join()
    error = info.value
    assert isinstance(error, InfrastructureError) and not isinstance(error, GateFailed)
    assert error.exit_code == 1
    assert "stopped answering" in error.message or "measured nothing" in error.message
    assert error.hint and "not judged" in error.hint
    # The cleanup could not reach a dead server, and the error says so.
    assert error.details["cleanup"].startswith("unload failed")
    assert "cleanup: unload failed" in error.message


class _ImpatientServer(TritonServer):
    """The real server, with a load call whose client deadline (50 ms) expires first."""

    def load_model(self, name: str, *, config_json: str | None = None,
                   files: dict[str, bytes] | None = None) -> None:
        try:
            self.grpc.load_model(name, config=config_json, files=files, client_timeout=0.05)
        except Exception as exc:
            raise self._unreachable(exc, f"load model {name}") from exc


def test_a_load_call_that_times_out_is_unloaded_and_reported(
        stack_settings: Settings, clients: Clients, arms: Arms,
        tmp_path: Path) -> None:
    with _own_canary(stack_settings, tmp_path / "own") as (own, _):
        endpoint = TritonEndpoint(http=own.http_url, grpc=own.grpc_url,
                                  metrics=own.metrics_url, name="own-canary")
        server = _ImpatientServer(endpoint, timeout_s=stack_settings.http_timeout_s,
                                  control_timeout_s=stack_settings.control_timeout_s)
        try:
            with pytest.raises(InfrastructureError) as info:
                run_canary(stack_settings, replace(clients, canary=server),
                           Policy.model_validate(CANARY_POLICY), model=MODEL,
                           candidate=arms.same, baseline=arms.baseline,
                           report_dir=tmp_path / "report")
            assert info.value.exit_code == 1
            assert "did not answer while trying to load model" in info.value.message
            # The server finished the load on its own; the canary unloaded it anyway.
            assert info.value.details["cleanup"] == "unloaded"
            left = [m for m in server.repository_index()
                    if m.get("name") == MODEL and m.get("state") in ("READY", "LOADING")]
            assert left == []
        finally:
            server.close()


