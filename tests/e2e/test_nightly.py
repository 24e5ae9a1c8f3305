"""`modelship nightly` on the session's stack: a first night releases, a worse challenger
is skipped with a Slack notice and production untouched, a better one (after drift) is
promoted through the promote subflow with trigger ``schedule``.

The first night runs through the console script (its exit code and JSON document); the
others, and ``status``, in the test process (:func:`tests.inprocess.run_inprocess`)."""

from __future__ import annotations

import json
import subprocess
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from modelship.settings import Settings
from tasks import train as training
from tests import models
from tests.conftest import run_cli
from tests.inprocess import run_inprocess
from tests.policies import short_policy

pytestmark = pytest.mark.e2e

MODEL = "nightly-e2e"
#: The night is tested (its verdict, its promote subflow, its notice), not the stages'
#: measurements: the short release (tests/policies.py), no bake.
POLICY = short_policy()


def train_weak(request: training.TrainRequest) -> str:
    """A user trainer (the pluggable entry point): 40 rows, heavily regularised."""
    from sklearn.linear_model import LogisticRegression

    frame, labels = training.transactions(1040, seed=request.seed, drift=request.drift)
    model = LogisticRegression(C=1e-4).fit(frame.iloc[:40], labels[:40])
    return training.log_candidate(model, request, train=frame.iloc[:40],
                                  train_labels=labels[:40],
                                  heldout=frame.iloc[40:].reset_index(drop=True),
                                  heldout_labels=labels[40:], params={"trainer": "weak"})


def _nightly(settings: Settings, policy: Path, *args: str,
             run: Callable[..., subprocess.CompletedProcess[str]] = run_inprocess
             ) -> dict[str, Any]:
    done = run("nightly", "--model", MODEL, "--policy", str(policy), "--json", *args,
               home=settings.home, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return dict(json.loads(done.stdout))


def _status(settings: Settings) -> dict[str, Any]:
    return dict(json.loads(run_inprocess("status", MODEL, "--json",
                                         home=settings.home).stdout))


def _version_tags(settings: Settings, version: int) -> dict[str, str]:
    from mlflow import MlflowClient

    uri = str(settings.mlflow_tracking_uri)
    client = MlflowClient(uri, registry_uri=uri)
    return dict(client.get_model_version(MODEL, str(version)).tags)


def test_nightly_skips_a_worse_challenger_and_promotes_a_better_one(
        stack_settings: Settings, tmp_path: Path) -> None:
    policy = models.write_policy(tmp_path / "policy.yaml", POLICY)

    first = _nightly(stack_settings, policy, "--seed", "1", "--drift", "0", run=run_cli)
    assert first["status"] == "promoted" and first["exit_code"] == 0, first
    assert first["comparison"]["verdict"] == "no_champion"
    assert first["release"]["trigger"] == "schedule"
    champion = first["version"]
    assert _status(stack_settings)["production_version"] == champion

    worse = _nightly(stack_settings, policy, "--seed", "2", "--drift", "0",
                     "--train", "tests.e2e.test_nightly:train_weak")
    assert worse["status"] == "skipped" and worse["exit_code"] == 0, worse
    comparison = worse["comparison"]
    assert comparison["verdict"] == "not_better" and comparison["champion_version"] == champion
    assert comparison["challenger"]["accuracy"] < comparison["champion"]["accuracy"] - 0.01
    assert worse["release"] is None and worse["notice"]["posted"] is True
    status = _status(stack_settings)
    assert status["production_version"] == champion == status["aliases"]["production"]
    tags = _version_tags(stack_settings, worse["version"])
    assert tags["nightly.verdict"] == "not_better"
    assert float(tags["nightly.champion.accuracy"]) == pytest.approx(
        comparison["champion"]["accuracy"], abs=1e-6)
    with urllib.request.urlopen(f"{stack_settings.slack_api_url}/_emulator/messages",
                                timeout=10) as response:
        messages = json.loads(response.read())
    texts = [m["text"] for m in messages.get("messages", messages)]
    notice = [t for t in texts if f"nightly {MODEL}: skipped v{worse['version']}" in t]
    assert notice and f"champion v{champion}" in notice[0] and "unchanged" in notice[0]

    better = _nightly(stack_settings, policy, "--seed", "3", "--drift", "1.0")
    comparison = better["comparison"]
    assert comparison["verdict"] == "better", comparison
    assert better["status"] == "promoted" and better["exit_code"] == 0, better["reason"]
    release = better["release"]
    assert release["trigger"] == "schedule" and release["requester"] == "nightly"
    assert release["from_version"] == champion and release["to_version"] == better["version"]
    status = _status(stack_settings)
    assert status["production_version"] == better["version"] == status["aliases"]["production"]
    assert _version_tags(stack_settings, better["version"])["nightly.verdict"] == "better"
