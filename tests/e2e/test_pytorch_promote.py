"""A real PyTorch model (the ``mlflow.pytorch`` flavor, with a tensor signature) promoted
end to end on the session's stack (``modelship promote`` in the test process,
:func:`tests.inprocess.run_inprocess`): check exports it with ``torch.onnx.export`` and
proves parity on the golden rows, stage, canary, swap, bake and record follow, and every
replica then answers what the torch module computes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from model_registry.client import point_mlflow_at
from modelship.clients import build_clients
from modelship.settings import Settings
from tests import models
from tests.inprocess import run_inprocess

pytestmark = pytest.mark.e2e
torch = pytest.importorskip("torch")

MODEL = "cli-pytorch"
POLICY: dict[str, Any] = {
    # windows that count as stable at once: the canary stops when its rules have samples
    "canary": {"warmup_s": 0.5, "window_s": 1.0, "stability_pct": 100.0,
               "max_duration_s": 20.0, "min_samples": 100},
    "gates": [
        # sized to catch 5% errors (117 requests), not 2% (982): the flavour is tested here
        {"name": "error_rate", "metric": "error_rate", "test": "exact_rate", "max_rate": 0.01,
         "effect": 0.04},
        {"name": "agreement", "metric": "agreement", "test": "threshold", "min": 0.98},
        # A GPU rule: the CPU stack has no nv_gpu_* metrics, so it is skipped, not failed.
        {"name": "gpu_growth", "metric": "gpu_memory_growth_pct", "max": 25.0},
    ],
    "bake": {"duration_s": 2.0, "window_s": 1.0, "baseline_s": 1.0,
             "max_latency_increase_pct": 400.0},
}


def _module(seed: int) -> Any:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(models.N_FEATURES, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3),
        torch.nn.Softmax(dim=1)).eval()


def _register(tracking_uri: str, module: Any, rows: np.ndarray) -> int:
    import mlflow
    import mlflow.pytorch
    from mlflow.models import infer_signature

    with torch.no_grad():
        out = module(torch.from_numpy(rows)).numpy()
    point_mlflow_at(tracking_uri)
    with mlflow.start_run():
        info = mlflow.pytorch.log_model(
            module, name="model", registered_model_name=MODEL,
            signature=infer_signature(rows, out), input_example=rows[:16],
            pip_requirements=["torch"])
    return int(info.registered_model_version)


def _promote(settings: Settings, policy: Path, version: int) -> dict[str, Any]:
    done = run_inprocess("promote", MODEL, "--version", str(version), "--policy", str(policy),
                         "--json", home=settings.home, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return dict(json.loads(done.stdout))


def test_pytorch_model_promotes_end_to_end_with_parity(stack_settings: Settings,
                                                       tmp_path: Path) -> None:
    import tritonclient.http as httpclient

    frame, _ = models.training_data()
    rows = frame.to_numpy(np.float32)[:64].copy()
    policy = models.write_policy(tmp_path / "policy.yaml", POLICY)
    uri = str(stack_settings.mlflow_tracking_uri)
    v1 = _register(uri, _module(0), rows)
    # v2: the same network trained a little further (perturbed weights): it must agree
    v2_module = _module(0)
    with torch.no_grad():
        for p in v2_module.parameters():
            p.add_(1e-4 * torch.randn_like(p))
    v2 = _register(uri, v2_module, rows)

    first = _promote(stack_settings, policy, v1)
    assert first["status"] == "released" and first["from_version"] is None
    second = _promote(stack_settings, policy, v2)
    assert second["status"] == "released" and second["from_version"] == v1
    gates = second["gates"]
    assert gates["verdict"] == "passed" and gates["baseline"] == v1
    assert {r["rule"]: r["verdict"] for r in gates["results"]} == {
        "error_rate": "passed", "agreement": "passed"}
    assert gates["skipped_rules"] == ["gpu_growth"] and gates["gpu"] is None
    assert second["bake"]["outcome"] == "passed"
    assert second["swap"]["headroom"]["footprint"] is None  # CPU replicas: skipped
    assert len(second["swap"]["headroom"]["skipped"]) == len(stack_settings.triton_replicas)

    # The staged provenance: exported from the pytorch flavour, parity proven on the rows.
    clients = build_clients(stack_settings)
    assert clients.storage is not None
    manifest = json.loads(clients.storage.get_bytes(
        f"{stack_settings.repository_prefix}/{MODEL}/{v2}/release.json"))
    provenance = manifest["provenance"]
    assert provenance["flavor"] == "pytorch"
    parity = provenance["parity"]["outputs"]["prediction"]
    assert parity["passed"] is True and parity["max_abs_err"] < 1e-5

    # What serves is the torch module: every replica answers as v2 with its outputs.
    with torch.no_grad():
        expected = v2_module(torch.from_numpy(rows[:8])).numpy()
    for endpoint in stack_settings.triton_replicas:
        client = httpclient.InferenceServerClient(endpoint.http.removeprefix("http://"))
        request = httpclient.InferInput("input", list(rows[:8].shape), "FP32")
        request.set_data_from_numpy(rows[:8])
        answer = client.infer(MODEL, [request])
        assert answer.get_response()["model_version"] == str(v2)
        np.testing.assert_allclose(answer.as_numpy("prediction"), expected, atol=1e-5)
        client.close()
