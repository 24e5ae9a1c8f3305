"""GPU evidence against recorded Triton GPU-server metrics (tests/fixtures/triton_gpu_metrics)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from modelship.errors import PreflightError
from modelship.policy import TritonPolicy
from modelship.triton.gpu import (
    ESTIMATE_FACTOR,
    Footprint,
    canary_gpu_evidence,
    check_headroom,
    choose_footprint,
    estimate_footprint,
    fleet_target,
    gpu_memory_growth_pct,
    headroom_checks,
    initializer_bytes,
    parse_gpu_metrics,
    summarize,
)
from modelship.triton.model_config import ModelSpec, TensorSpec, render_model_config

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "triton_gpu_metrics"
MiB = 1024 * 1024
CANARY_GPU = "GPU-3b1f8d2c-9a77-4e0f-b1c2-5d6e7f809a1b"


def text(name: str) -> str:
    return (FIXTURES / name).read_text()


def cpu_only(name: str) -> str:
    """The same exposition as a CPU server writes it: no nv_gpu_* or nv_energy_* series."""
    keep = [ln for ln in text(name).splitlines() if "nv_gpu_" not in ln and "nv_energy" not in ln]
    return "\n".join(keep) + "\n"


def test_parse_reads_every_gauge_per_gpu() -> None:
    gpus = parse_gpu_metrics(text("canary_both.txt"))
    assert list(gpus) == [CANARY_GPU]
    gpu = gpus[CANARY_GPU]
    assert gpu.memory_total_bytes == 24152899584
    assert gpu.memory_used_bytes == 3546284032
    assert gpu.free_bytes == 24152899584 - 3546284032
    assert (gpu.utilization, gpu.power_usage_w, gpu.power_limit_w, gpu.energy_j) == (
        0.41, 58.3, 72.0, 130002.5)


def test_two_gpus_are_kept_apart_and_summed_in_the_summary() -> None:
    gpus = parse_gpu_metrics(text("replica_two_gpus.txt"))
    assert len(gpus) == 2
    summary = summarize(gpus)
    assert summary["gpus"] == 2
    assert summary["memory_used_bytes"] == sum(g.memory_used_bytes or 0 for g in gpus.values())
    assert summary["utilization_mean"] == pytest.approx((0.30 + 0.91) / 2)


def test_cpu_server_has_no_gpu_figures_not_zeros() -> None:
    assert parse_gpu_metrics(cpu_only("canary_both.txt")) == {}
    assert summarize({}) == {"gpus": 0, "memory_used_bytes": None, "memory_total_bytes": None,
                             "utilization_mean": None, "power_usage_w": None}
    assert fleet_target(cpu_only("canary_both.txt")) == "cpu"
    assert fleet_target(text("canary_both.txt")) == "gpu"


def test_nan_gauges_are_missing() -> None:
    gpus = parse_gpu_metrics('nv_gpu_utilization{gpu_uuid="GPU-x"} NaN\n'
                             'nv_gpu_memory_used_bytes{gpu_uuid="GPU-x"} 5\n')
    assert gpus["GPU-x"].utilization is None and gpus["GPU-x"].free_bytes is None


# --------------------------------------------------------------------------- canary evidence


def test_canary_measures_baseline_and_candidate_footprints() -> None:
    evidence = canary_gpu_evidence(text("canary_empty.txt"), text("canary_baseline.txt"),
                                   text("canary_both.txt"))
    used = {n: parse_gpu_metrics(text(n))[CANARY_GPU].memory_used_bytes
            for n in ("canary_empty.txt", "canary_baseline.txt", "canary_both.txt")}
    assert evidence.baseline_bytes == used["canary_baseline.txt"] - used["canary_empty.txt"]
    assert evidence.candidate_bytes == used["canary_both.txt"] - used["canary_baseline.txt"]
    assert evidence.growth_pct == pytest.approx(
        100 * (evidence.candidate_bytes - evidence.baseline_bytes) / evidence.baseline_bytes)
    metrics = evidence.metrics()
    assert metrics["gpu_memory_growth_pct"] == evidence.growth_pct
    assert metrics["gpu_utilization"] == 0.41
    lines = evidence.report_lines()
    assert "1,350 MiB" in lines[1] and "1,620 MiB" in lines[1] and "+20.0%" in lines[1]
    assert evidence.to_dict()["gpus"][0]["uuid"] == CANARY_GPU


def test_first_release_measures_the_candidate_only() -> None:
    evidence = canary_gpu_evidence(text("canary_empty.txt"), None, text("canary_baseline.txt"))
    assert evidence.baseline_bytes is None and evidence.growth_pct is None
    assert evidence.candidate_bytes == 1350 * MiB


def test_cpu_canary_gives_no_gpu_evidence() -> None:
    evidence = canary_gpu_evidence(cpu_only("canary_empty.txt"), cpu_only("canary_baseline.txt"),
                                   cpu_only("canary_both.txt"))
    assert evidence.metrics() == {"gpu_memory_growth_pct": None,
                                  "gpu_memory_candidate_bytes": None, "gpu_utilization": None}
    assert "CPU server" in evidence.report_lines()[0]


@pytest.mark.parametrize(("candidate", "baseline", "expected"), [
    (120, 100, 20.0), (100, 100, 0.0), (80, 100, -20.0),
    (None, 100, None), (120, None, None), (120, 0, None),
])
def test_growth_pct(candidate: int | None, baseline: int | None, expected: float | None) -> None:
    assert gpu_memory_growth_pct(candidate, baseline) == expected


# --------------------------------------------------------------------------- footprint


def _model(external_dir: Path | None = None) -> onnx.ModelProto:
    weights = numpy_helper.from_array(np.ones((256, 128), dtype=np.float32), "w")
    bias = numpy_helper.from_array(np.ones((128,), dtype=np.float16), "b")
    const = helper.make_node("Constant", [], ["c"], value=numpy_helper.from_array(
        np.ones((10,), dtype=np.int64), "cv"))
    nodes = [const, helper.make_node("MatMul", ["x", "w"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                        [None, 256])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT,
                                                             [None, 128])],
                              initializer=[weights, bias])
    return helper.make_model(graph)


EXPECTED_WEIGHTS = 256 * 128 * 4 + 128 * 2 + 10 * 8


def test_initializer_bytes_counts_weights_and_constants() -> None:
    assert initializer_bytes(_model()) == EXPECTED_WEIGHTS


def test_initializer_bytes_reads_external_data_sizes(tmp_path: Path) -> None:
    model = _model()
    onnx.save_model(model, tmp_path / "model.onnx", save_as_external_data=True,
                    location="model.onnx.data", size_threshold=0)
    loaded = onnx.load(tmp_path / "model.onnx", load_external_data=False)
    assert any(t.data_location == TensorProto.EXTERNAL for t in loaded.graph.initializer)
    assert initializer_bytes(loaded) == EXPECTED_WEIGHTS


SPEC = ModelSpec("fraud", inputs=(TensorSpec("x", "float32", (256,)),),
                 outputs=(TensorSpec("y", "float32", (128,)),))


@pytest.mark.parametrize(("triton", "instances", "workspace"), [
    ({}, 1, 0),
    ({"instance_group": {"count": 3}}, 3, 0),
    ({"gpu": {"accelerator": "tensorrt"}}, 1, 1024 * MiB),
    ({"instance_group": {"count": 2}, "gpu": {"accelerator": "tensorrt",
                                              "tensorrt": {"max_workspace_bytes": 64 * MiB}}},
     2, 64 * MiB),
])
def test_estimate_from_weights_instances_and_workspace(triton: dict[str, object], instances: int,
                                                       workspace: int) -> None:
    cfg = render_model_config(SPEC, TritonPolicy.model_validate({"target": "gpu", **triton}))
    estimate = estimate_footprint(EXPECTED_WEIGHTS, cfg)
    assert estimate.source == "estimated"
    assert estimate.bytes_per_gpu == int(instances * EXPECTED_WEIGHTS * ESTIMATE_FACTOR) + workspace
    assert f"{instances} instance(s)" in estimate.detail


def test_measurement_wins_over_the_estimate_when_there_is_one() -> None:
    estimate = Footprint(500 * MiB, "estimated", "x")
    assert choose_footprint(1620 * MiB, estimate).source == "measured"
    assert choose_footprint(1620 * MiB, estimate).bytes_per_gpu == 1620 * MiB
    assert choose_footprint(None, estimate) is estimate
    assert choose_footprint(0, estimate) is estimate  # no rise is no measurement


# --------------------------------------------------------------------------- headroom


def _footprint() -> Footprint:
    evidence = canary_gpu_evidence(text("canary_empty.txt"), text("canary_baseline.txt"),
                                   text("canary_both.txt"))
    return choose_footprint(evidence.candidate_bytes, Footprint(1, "estimated", "unused"))


def test_headroom_passes_when_every_replica_fits() -> None:
    replicas = {"10.0.0.1:8001": text("replica_roomy.txt")}
    checks = headroom_checks(replicas, _footprint(), headroom_bytes=256 * MiB)
    assert [c.fits for c in checks] == [True]
    check_headroom("fraud", 7, checks, _footprint())  # does not raise


def test_headroom_refuses_with_the_numbers_when_one_replica_is_short() -> None:
    replicas = {"10.0.0.1:8001": text("replica_roomy.txt"),
                "10.0.0.2:8001": text("replica_tight.txt")}
    footprint = _footprint()
    checks = headroom_checks(replicas, footprint, headroom_bytes=256 * MiB)
    assert [c.fits for c in checks] == [True, False]
    tight = checks[1]
    assert tight.free_bytes == 1200 * MiB and tight.need_bytes == 1620 * MiB + 256 * MiB
    with pytest.raises(PreflightError) as info:
        check_headroom("fraud", 7, checks, footprint)
    err = info.value
    assert err.exit_code == 1
    assert "10.0.0.2:8001" in err.message and "10.0.0.1:8001" not in err.message
    assert "free 1,200 MiB" in err.message and "needs 1,876 MiB" in err.message
    assert "measured" in err.message and err.hint
    assert err.details["footprint"]["source"] == "measured"


@pytest.mark.parametrize(("gpus", "fits"), [(None, [True, False]), ([0], [True]), ([1], [False])])
def test_headroom_only_checks_the_gpus_the_instances_use(gpus: list[int] | None,
                                                         fits: list[bool]) -> None:
    checks = headroom_checks({"pod": text("replica_two_gpus.txt")}, _footprint(),
                             headroom_bytes=0, gpus=gpus)
    assert [c.fits for c in checks] == fits


def test_a_replica_without_gpu_metrics_does_not_fit() -> None:
    checks = headroom_checks({"pod": cpu_only("replica_roomy.txt")}, _footprint(),
                             headroom_bytes=0)
    assert [(c.gpu_uuid, c.fits) for c in checks] == [(None, False)]
    with pytest.raises(PreflightError, match="no GPU metrics"):
        check_headroom("fraud", 7, checks, _footprint())
    with pytest.raises(PreflightError, match="no replicas"):
        check_headroom("fraud", 7, [], _footprint())


def test_exactly_at_the_limit_fits() -> None:
    free = parse_gpu_metrics(text("replica_tight.txt"))
    (gpu,) = free.values()
    assert gpu.free_bytes is not None
    exact = Footprint(int(gpu.free_bytes), "estimated", "x")
    (check,) = headroom_checks({"pod": text("replica_tight.txt")}, exact, headroom_bytes=0)
    assert check.fits and not math.isnan(check.need_bytes)
