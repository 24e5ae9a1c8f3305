"""A `triton.target: gpu` policy on the CPU stack (issue 13), through the commands run in the
test process (:func:`tests.inprocess.run_inprocess`).

The staged version is the GPU config the policy asks for (KIND_GPU on device 0, TensorRT
with its precision and workspace, warmup); the canary, the swap, the production pin and
reconcile load its CPU form, so the release succeeds on CPU servers, `status` shows the
fleet consistent, reconcile changes nothing and a second swap to the same version is a
no-op. A pin left in the GPU form is rendered by reconcile too.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from tritonclient.grpc import model_config_pb2 as pb

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

MODEL = "gpu-policy-on-cpu"
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
        # sized to catch 5% errors (117 requests), not 2% (982): the GPU policy is tested here
        {"name": "error_rate", "metric": "error_rate", "test": "exact_rate", "max_rate": 0.01,
         "effect": 0.04},
        {"name": "agreement", "metric": "agreement", "test": "threshold", "min": 0.98},
    ],
    "bake": {"duration_s": 2.0, "window_s": 1.0, "baseline_s": 1.0,
             "max_latency_increase_pct": 400.0},
}


def _cli(settings: Settings, *args: str, code: int = 0) -> dict[str, Any]:
    done = run_inprocess(*args, "--json", home=settings.home, timeout=600)
    assert done.returncode == code, done.stderr[-4000:]
    doc: dict[str, Any] = json.loads(done.stdout)
    return doc


def _config(settings: Settings, key: str) -> ModelConfig:
    storage = build_clients(settings).storage
    assert storage is not None
    return from_pbtxt(storage.get_bytes(f"{settings.repository_prefix}/{key}").decode())


def test_a_gpu_policy_stages_the_gpu_config_and_releases_its_cpu_form_on_the_cpu_stack(
        stack_settings: Settings, tmp_path: Path) -> None:
    uri = str(stack_settings.mlflow_tracking_uri)
    graph = models.onnx_graph("softmax")
    v1 = models.register_onnx(uri, MODEL, graph)
    v2 = models.register_onnx(uri, MODEL, graph)
    policy = str(models.write_policy(tmp_path / "policy.yaml", POLICY))

    first = _cli(stack_settings, "promote", MODEL, "--version", str(v1), "--policy", policy)
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
    pin = _config(stack_settings, f"{MODEL}/config.pbtxt")
    assert pin == with_versions(for_target(staged, "cpu"), [v1])
    assert [g.kind for g in pin.instance_group] == [pb.ModelInstanceGroup.KIND_CPU]
    assert not pin.model_warmup and not pin.HasField("optimization")
    clients = build_clients(stack_settings)
    try:
        live = [from_live_json(r.model_config(MODEL)) for r in clients.replicas]
    finally:
        clients.close()
    assert len(live) == 2
    assert {serving_digest(c) for c in live} == {serving_digest(pin)}
    assert first["swap"]["serving_form"]["target"] == "cpu"
    assert first["swap"]["serving_form"]["source"] == "detected"

    # A second release: the canary loads P and C in the CPU form, the swap moves the fleet.
    second = _cli(stack_settings, "promote", MODEL, "--version", str(v2), "--policy", policy)
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
    # the fleet ends consistent on the CPU form.
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
