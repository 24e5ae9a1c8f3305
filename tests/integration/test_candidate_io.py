"""One promotion reads its candidate once (issue 19 item 1): a real release on the
session's stack, run in-process through the function the CLI runs (``run_flow`` over
``promote_flow``), with counting wrappers around the registry's downloads and the
storage's reads.

The check resolves and downloads the candidate from MLflow once; after the stage the
release carries it (:class:`modelship.candidate.ReleaseCandidate`), so the canary, the
bake and the swap read neither MLflow nor the staged config again. The staged manifest and
config are read back once, by the stage's publish check, which hands the manifest's digest
to the release; the swap's preflight verifies the staged bytes against the manifest
(DESIGN §4): that read stays, and is counted apart.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from flows.promote import PromoteParams, promote_flow
from model_registry.client import RegistryClient
from modelship.clients import build_clients
from modelship.prefect_api import run_flow
from modelship.repository import CONFIG_NAME, MANIFEST_NAME
from modelship.settings import Settings
from modelship.storage import S3Storage
from tasks import swap as swap_module
from tasks.evidence import read_candidate_digest
from tests import models
from tests.conftest import RUNTIME_VENV

pytestmark = pytest.mark.integration

MODEL = "candidate-io"
POLICY: dict[str, Any] = {
    # the cheapest real release: a deterministic error gate, a short canary and bake
    "canary": {"warmup_s": 0.5, "window_s": 1.0, "max_duration_s": 60.0, "min_samples": 50},
    "gates": [{"name": "errors", "metric": "error_rate", "test": "threshold", "max": 0.01}],
    "bake": {"duration_s": 2.0, "window_s": 1.0, "baseline_s": 1.0},
}


class Reads:
    """Every counted call, in order, with whether it happened inside the swap's
    verification (``tasks.swap.read_verified``)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, bool]] = []
        self.verifying = threading.Event()

    def wrap(self, monkeypatch: pytest.MonkeyPatch, owner: Any, name: str, kind: str,
             key_of: Callable[..., str]) -> None:
        original = getattr(owner, name)

        def counted(self_: Any, *args: Any, **kwargs: Any) -> Any:
            self.calls.append((kind, key_of(*args, **kwargs), self.verifying.is_set()))
            return original(self_, *args, **kwargs)

        monkeypatch.setattr(owner, name, counted)

    def count(self, kind: str, suffix: str, *, verifying: bool) -> int:
        return sum(1 for k, key, v in self.calls
                   if k == kind and key.endswith(suffix) and v == verifying)


def test_one_promotion_downloads_the_candidate_once_and_reads_its_staging_once(
        stack_settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    version = models.register_onnx(str(stack_settings.mlflow_tracking_uri), MODEL,
                                   models.onnx_graph("softmax"))
    policy = models.write_policy(tmp_path / "policy.yaml", POLICY)
    monkeypatch.setenv("MODELSHIP_HOME", str(stack_settings.home))
    monkeypatch.setenv("MODELSHIP_TRITON_RUNTIME", str(RUNTIME_VENV))

    reads = Reads()
    reads.wrap(monkeypatch, RegistryClient, "resolve", "download",
               lambda name, **kw: f"{name}/{kw.get('version') or kw.get('alias')}")
    reads.wrap(monkeypatch, RegistryClient, "download_run_artifact", "artifact",
               lambda run_id, path, dst: f"{run_id}/{path}")
    reads.wrap(monkeypatch, S3Storage, "get_bytes", "get", lambda key: key)
    reads.wrap(monkeypatch, S3Storage, "iter_bytes", "get", lambda key, **_: key)
    original_verified = swap_module.read_verified
    verifications: list[int] = []

    def verified(*args: Any, **kwargs: Any) -> Any:
        verifications.append(kwargs["version"])
        reads.verifying.set()
        try:
            return original_verified(*args, **kwargs)
        finally:
            reads.verifying.clear()

    monkeypatch.setattr(swap_module, "read_verified", verified)

    params = PromoteParams(model=MODEL, version=version, policy_file=str(policy),
                           trigger="cli", requested_by="test")
    record = run_flow(lambda: promote_flow(params), api_url=stack_settings.prefect_api_url)

    assert record["status"] == "released", record.get("reason")
    names = [s["name"] for s in record["stages"]]
    assert {"check", "stage", "canary", "swap", "bake", "record"} <= set(names), names
    assert record["candidate"]["manifest_sha256"]  # the digest the release is bound to
    # MLflow: the candidate is resolved and downloaded once (the check's), and so is its
    # golden artifact at most once
    downloads = [key for kind, key, _ in reads.calls if kind == "download"]
    assert downloads == [f"{MODEL}/{version}"], reads.calls
    artifacts = [key for kind, key, _ in reads.calls if kind == "artifact"]
    assert len(artifacts) == len(set(artifacts)), artifacts
    # S3, outside the swap's verification: the stage reads back what it published (its
    # manifest and config, once: tasks/stage.py _verify_or_unpublish) and hands the
    # manifest's digest on; no later stage reads either again (before issue 19 item 1:
    # manifest 3, config 5). The swap's verification reads both, once.
    folder = f"{MODEL}/{version}/"
    manifest, config = folder + MANIFEST_NAME, folder + CONFIG_NAME
    assert reads.count("get", manifest, verifying=False) == 1, reads.calls
    assert reads.count("get", config, verifying=False) == 1, reads.calls
    assert verifications == [version]
    assert reads.count("get", manifest, verifying=True) == 1, reads.calls
    assert reads.count("get", config, verifying=True) == 1, reads.calls
    # the digest handed over is the staged manifest's (what a standalone swap binds to)
    clients = build_clients(stack_settings)
    try:
        assert clients.storage is not None
        staged = read_candidate_digest(clients.storage, model=MODEL, version=version,
                                       repository_prefix=stack_settings.repository_prefix)
    finally:
        clients.close()
    assert {k: record["candidate"][k] for k in staged} == staged
