"""A real PyTorch model (the ``mlflow.pytorch`` flavor, with a tensor signature) released
twice, end to end on the session's stack under a ``triton.target: gpu`` policy (issue 13),
through the commands run in the test process (:func:`tests.inprocess.run_inprocess`).

The two releases (:func:`released`, a module fixture) are what both tests assert:

- the flavour: check exports the module with ``torch.onnx.export`` and proves parity on
  the golden rows; stage, canary, swap, bake and record follow, and every replica then
  answers what the torch module computes;
- the GPU policy on CPU servers: the staged version is the GPU config the policy asks for
  (KIND_GPU on device 0, TensorRT with its precision and workspace, warmup); the canary,
  the swap, the production pin and reconcile load its CPU form, so the release succeeds on
  CPU servers, `status` shows the fleet consistent, reconcile changes nothing and a second
  swap to the same version is a no-op. A pin left in the GPU form is rendered by reconcile
  too.

(Until session 24 these were two files, each releasing two versions of its own model:
tests/e2e/test_gpu_policy_on_cpu.py an ONNX graph under the GPU policy, this one the torch
module under a CPU policy. The flavour and the policy are independent; each test's
assertions are unchanged.)
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tritonclient.grpc import model_config_pb2 as pb

from model_registry.client import point_mlflow_at
from modelship.clients import build_clients
from modelship.settings import Settings
from modelship.signing import key_bytes
from modelship.triton.model_config import (
    ModelConfig,
    config_digest,
    for_target,
    from_live_json,
    from_pbtxt,
    serving_digest,
    with_versions,
)
from tasks.swap import _write_model_config
from tests import models
from tests.inprocess import run_inprocess

pytestmark = pytest.mark.e2e
torch = pytest.importorskip("torch")

MODEL = "cli-pytorch"
MiB = 1024 * 1024
POLICY: dict[str, Any] = {
    "triton": {
        "target": "gpu",
        "instance_group": {"count": 1, "gpus": [0]},
        "gpu": {"accelerator": "tensorrt",
                "tensorrt": {"precision": "FP16", "max_workspace_bytes": 512 * MiB},
                "warmup": {"enabled": True, "data": "random", "count": 2}},
    },
    # windows that count as stable at once: the canary stops when its rules have samples
    "canary": {"warmup_s": 0.5, "window_s": 1.0, "stability_pct": 100.0,
               "max_duration_s": 20.0, "min_samples": 100},
    "gates": [
        # sized to catch 5% errors (117 requests), not 2% (982): the flavour and the GPU
        # policy are tested here
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


def _cli(settings: Settings, *args: str, code: int = 0) -> dict[str, Any]:
    done = run_inprocess(*args, "--json", home=settings.home, timeout=600)
    assert done.returncode == code, done.stderr[-4000:]
    doc: dict[str, Any] = json.loads(done.stdout)
    return doc


def _config(settings: Settings, key: str) -> ModelConfig:
    storage = build_clients(settings).storage
    assert storage is not None
    return from_pbtxt(storage.get_bytes(f"{settings.repository_prefix}/{key}").decode())


def _live_configs(settings: Settings) -> list[ModelConfig]:
    """The config each replica serves :data:`MODEL` with, as Triton reports it."""
    clients = build_clients(settings)
    try:
        return [from_live_json(r.model_config(MODEL)) for r in clients.replicas]
    finally:
        clients.close()


@dataclass
class Released:
    """The two releases of :func:`released` and what served between them."""

    rows: np.ndarray  # golden-like rows the modules were logged with
    v1: int
    v2: int
    v2_module: Any
    first: dict[str, Any]  # v1's record (the model's first release)
    pin_after_first: ModelConfig  # the production pin once v1 served
    live_after_first: list[ModelConfig]  # each replica's config of v1
    second: dict[str, Any]  # v2's record (baseline v1)
    policy: Path


@pytest.fixture(scope="module")
def released(stack_settings: Settings, tmp_path_factory: pytest.TempPathFactory) -> Released:
    """v1 (a torch module), then v2 (the same network trained a little further: perturbed
    weights, so it must agree), both released under :data:`POLICY`."""
    frame, _ = models.training_data()
    rows = frame.to_numpy(np.float32)[:64].copy()
    policy = models.write_policy(tmp_path_factory.mktemp("pytorch") / "policy.yaml", POLICY)
    uri = str(stack_settings.mlflow_tracking_uri)
    v1 = _register(uri, _module(0), rows)
    v2_module = _module(0)
    with torch.no_grad():
        for p in v2_module.parameters():
            p.add_(1e-4 * torch.randn_like(p))
    v2 = _register(uri, v2_module, rows)

    first = _cli(stack_settings, "promote", MODEL, "--version", str(v1), "--policy",
                 str(policy))
    assert first["status"] == "released", first.get("reason")
    pin_after_first = _config(stack_settings, f"{MODEL}/config.pbtxt")
    live_after_first = _live_configs(stack_settings)
    second = _cli(stack_settings, "promote", MODEL, "--version", str(v2), "--policy",
                  str(policy))
    return Released(rows=rows, v1=v1, v2=v2, v2_module=v2_module, first=first,
                    pin_after_first=pin_after_first, live_after_first=live_after_first,
                    second=second, policy=policy)


def test_pytorch_model_promotes_end_to_end_with_parity(stack_settings: Settings,
                                                       released: Released) -> None:
    import tritonclient.http as httpclient

    v1, v2, rows = released.v1, released.v2, released.rows
    first, second = released.first, released.second
    assert first["status"] == "released" and first["from_version"] is None
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
        expected = released.v2_module(torch.from_numpy(rows[:8])).numpy()
    for endpoint in stack_settings.triton_replicas:
        client = httpclient.InferenceServerClient(endpoint.http.removeprefix("http://"))
        request = httpclient.InferInput("input", list(rows[:8].shape), "FP32")
        request.set_data_from_numpy(rows[:8])
        answer = client.infer(MODEL, [request])
        assert answer.get_response()["model_version"] == str(v2)
        np.testing.assert_allclose(answer.as_numpy("prediction"), expected, atol=1e-5)
        client.close()


def test_a_gpu_policy_stages_the_gpu_config_and_releases_its_cpu_form_on_the_cpu_stack(
        stack_settings: Settings, released: Released) -> None:
    v1, v2, first = released.v1, released.v2, released.first
    policy = str(released.policy)
    assert first["status"] == "released", first.get("reason")

    # Staged: the GPU config the policy asks for.
    staged = _config(stack_settings, f"{MODEL}/{v1}/config.pbtxt")
    (group,) = staged.instance_group
    assert (group.kind, group.count, list(group.gpus)) == (pb.ModelInstanceGroup.KIND_GPU, 1, [0])
    (accel,) = staged.optimization.execution_accelerators.gpu_execution_accelerator
    assert accel.name == "tensorrt"
    assert accel.parameters["precision_mode"] == "FP16"
    assert accel.parameters["max_workspace_size_bytes"] == str(512 * MiB)
    assert staged.model_warmup and all(w.count == 2 for w in staged.model_warmup)
    assert all(i.random_data for w in staged.model_warmup for i in w.inputs.values())

    # Served and pinned: its CPU form, which every replica runs.
    pin = released.pin_after_first
    assert pin == with_versions(for_target(staged, "cpu"), [v1])
    assert [g.kind for g in pin.instance_group] == [pb.ModelInstanceGroup.KIND_CPU]
    assert not pin.model_warmup and not pin.HasField("optimization")
    live = released.live_after_first
    assert len(live) == 2
    assert {serving_digest(c) for c in live} == {serving_digest(pin)}
    assert first["swap"]["serving_form"]["target"] == "cpu"
    assert first["swap"]["serving_form"]["source"] == "detected"

    # A second release: the canary loads P and C in the CPU form, the swap moves the fleet.
    second = released.second
    assert second["status"] == "released", second.get("reason")
    assert second["gates"]["verdict"] == "passed" and second["gates"]["baseline"] == v1
    assert second["swap"]["kind"] == "swap" and not second["swap"]["aborted"]
    assert second["bake"]["outcome"] == "passed"
    pin = _config(stack_settings, f"{MODEL}/config.pbtxt")
    staged_v2 = _config(stack_settings, f"{MODEL}/{v2}/config.pbtxt")
    assert [g.kind for g in staged_v2.instance_group] == [pb.ModelInstanceGroup.KIND_GPU]
    assert pin == with_versions(for_target(staged_v2, "cpu"), [v2])

    status = _cli(stack_settings, "status", MODEL)
    assert status["consistent"] and status["production_version"] == v2
    assert {r["config_digest"] for r in status["replicas"]} == {config_digest(pin)}

    reconciled = _cli(stack_settings, "reconcile", MODEL)
    assert reconciled["ok"] and reconciled["changed"] == 0
    (entry,) = reconciled["models"]
    assert entry["serving_form"]["target"] == "cpu"
    assert [r["action"] for r in entry["replicas"]] == ["ok", "ok"]

    # The same version again is a no-op, and the CPU canary measured no GPU footprint.
    again = _cli(stack_settings, "swap", MODEL, "--to", str(v2), "--policy", policy)
    assert again["kind"] == "noop" and again["phases"] == []
    assert again["footprint"]["source"] == "estimate"

    # A pin in the staged GPU form (as written before issue 13) and a replica that lost the
    # model: reconcile renders the pin for the CPU fleet, reloads only that replica, and
    # the fleet ends consistent on the CPU form (serving v2, as before).
    clients = build_clients(stack_settings)
    try:
        assert clients.storage is not None
        _write_model_config(clients.storage, model=MODEL, config=with_versions(staged_v2, [v2]),
                            repository_prefix=stack_settings.repository_prefix,
                            signing_key=key_bytes(stack_settings.manifest_signing_key))
        clients.replicas[1].unload_model(MODEL)
        healed = _cli(stack_settings, "reconcile", MODEL)
        assert healed["ok"] and healed["changed"] == 1
        assert [r["action"] for r in healed["models"][0]["replicas"]] == ["ok", "load"]
        live = [from_live_json(r.model_config(MODEL)) for r in clients.replicas]
    finally:
        clients.close()
    assert {serving_digest(c) for c in live} == {serving_digest(for_target(staged_v2, "cpu"))}
    assert _cli(stack_settings, "status", MODEL)["consistent"]
