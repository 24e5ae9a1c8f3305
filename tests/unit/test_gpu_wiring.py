"""GPU evidence wired into the release: gates on GPU metrics, the canary's skip rule, the
report, the bake's per-window GPU record and the swap's headroom preflight, against the
recorded GPU-server metrics text (tests/fixtures/triton_gpu_metrics)."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import numpy as np
import pytest

from modelship.errors import PreflightError
from modelship.measurements import ArmMeasurements, CanarySnapshot
from modelship.policy import GPU_METRICS, TritonPolicy, gate_rule
from modelship.settings import TritonEndpoint
from modelship.triton.client import TritonServer
from modelship.triton.gpu import (
    GpuEvidence,
    GpuSample,
    canary_gpu_evidence,
    check_headroom,
    instance_gpus,
    parse_gpu_metrics,
    plan_headroom,
)
from modelship.triton.model_config import (
    ModelConfig,
    ModelSpec,
    TensorSpec,
    render_model_config,
)
from tasks.bake import _scrape_all
from tasks.canary import CanaryResult, gpu_rules_skipped, is_comparative
from tasks.gates import Verdict, evaluate, judge
from tasks.report import render_markdown
from tasks.swap import _metrics_texts

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "triton_gpu_metrics"
MiB = 1024 * 1024


def text(name: str) -> str:
    return (FIXTURES / name).read_text()


def cpu_only(name: str) -> str:
    keep = [ln for ln in text(name).splitlines() if "nv_gpu_" not in ln and "nv_energy" not in ln]
    return "\n".join(keep) + "\n"


def evidence(under_load: Sequence[Mapping[str, GpuSample]] = ()) -> GpuEvidence:
    return canary_gpu_evidence(text("canary_empty.txt"), text("canary_baseline.txt"),
                               text("canary_both.txt"), under_load=under_load)


def _arm(version: int, n: int = 500) -> ArmMeasurements:
    rng = np.random.default_rng(version)
    return ArmMeasurements(version=version, latency_ms=rng.lognormal(0.7, 0.2, n),
                           requests=n, errors=0, throughput_rps=n / 5.0)


def snapshot(gpu: Mapping[str, float | None] | None, *, baseline: bool = True,
             n: int = 500) -> CanarySnapshot:
    return CanarySnapshot(model="fraud", candidate=_arm(8, n),
                          baseline=_arm(7, n) if baseline else None, agreement=None,
                          agreement_samples=0, agreement_kind="classifier", window_s=5.0,
                          extra={"gpu": gpu, "notes": []})


# --------------------------------------------------------------------------- gates


GROWTH = gate_rule(name="gpu_growth", metric="gpu_memory_growth_pct", max=25.0)


def test_gpu_metrics_are_known_to_policies_and_produced_by_the_evidence() -> None:
    assert tuple(evidence().metrics()) == GPU_METRICS
    assert GROWTH.test == "threshold"
    with pytest.raises(ValueError, match="exact_rate tests an error rate"):
        gate_rule(name="x", metric="gpu_utilization", test="exact_rate", max_rate=0.1)


@pytest.mark.parametrize(("growth", "verdict"), [
    (20.0, Verdict.PASSED),
    (25.0, Verdict.PASSED),      # exactly at the bound passes
    (25.5, Verdict.FAILED),
    (-40.0, Verdict.PASSED),
    (None, Verdict.INCONCLUSIVE),
    (float("nan"), Verdict.INCONCLUSIVE),
])
def test_growth_rule_table(growth: float | None, verdict: Verdict) -> None:
    gpu = {"gpu_memory_growth_pct": growth, "gpu_memory_candidate_bytes": 1620.0 * MiB,
           "gpu_utilization": 0.4}
    result = judge(snapshot(gpu), GROWTH, min_samples=100)
    assert result.verdict == verdict, result.message
    if verdict == Verdict.FAILED:
        assert "+25.5%" in result.message and "+25%" in result.message


def test_no_gpu_evidence_is_inconclusive_never_a_pass() -> None:
    result = judge(snapshot(None), GROWTH, min_samples=100)
    assert result.verdict == Verdict.INCONCLUSIVE
    assert "no GPU evidence" in result.message


def test_gpu_rules_do_not_wait_for_latency_samples() -> None:
    """A memory measurement is one reading of the server: min_samples does not apply."""
    gpu = {"gpu_memory_growth_pct": 10.0, "gpu_memory_candidate_bytes": 1.0,
           "gpu_utilization": 0.2}
    assert judge(snapshot(gpu, n=5), GROWTH, min_samples=100).verdict == Verdict.PASSED
    rule = gate_rule(name="util", metric="gpu_utilization", max=0.9)
    result = judge(snapshot(gpu, n=5), rule, min_samples=100)
    assert result.verdict == Verdict.PASSED and "20%" in result.message


def test_measured_evidence_gates_end_to_end() -> None:
    """The recorded canary grows C by +20% over P: a 10% limit fails, a 25% one passes."""
    gpu = evidence().metrics()
    tight = gate_rule(name="tight", metric="gpu_memory_growth_pct", max=10.0)
    report = evaluate(snapshot(gpu), [GROWTH, tight], min_samples=100)
    verdicts = {r.rule: r.verdict for r in report.results}
    assert verdicts == {"gpu_growth": Verdict.PASSED, "tight": Verdict.FAILED}
    assert report.verdict == Verdict.FAILED


# --------------------------------------------------------------------------- canary


def test_cpu_canary_skips_gpu_rules_and_gpu_canary_keeps_them() -> None:
    latency = gate_rule(name="p50", metric="latency_p50_ms", max_increase_pct=10.0)
    util = gate_rule(name="util", metric="gpu_utilization", max=0.95)
    rules = [latency, GROWTH, util]
    assert gpu_rules_skipped(rules, on_gpu=False) == ["gpu_growth", "util"]
    assert gpu_rules_skipped(rules, on_gpu=True) == []
    # growth compares with P: not judged on a first release; C's own figures still are
    assert is_comparative(GROWTH) and not is_comparative(util)


def test_utilization_and_peak_come_from_the_scrapes_under_load() -> None:
    both = parse_gpu_metrics(text("canary_both.txt"))
    uuid = next(iter(both))
    total = both[uuid].memory_total_bytes
    busy = {uuid: GpuSample(uuid, memory_used_bytes=4000 * MiB, memory_total_bytes=total,
                            utilization=0.9)}
    idle = {uuid: GpuSample(uuid, memory_used_bytes=3500 * MiB, memory_total_bytes=total,
                            utilization=0.5)}
    ev = evidence(under_load=[busy, {}, idle])
    assert ev.load_scrapes == 2
    assert ev.utilization_mean == pytest.approx(0.7)
    assert ev.peak_used_bytes == 4000 * MiB
    assert ev.metrics()["gpu_utilization"] == pytest.approx(0.7)
    # the footprints still come from the idle scrapes, not the loaded ones
    assert ev.candidate_bytes == evidence().candidate_bytes


def _result(gpu: GpuEvidence | None) -> CanaryResult:
    snap = snapshot(gpu.metrics() if gpu is not None else None)
    report = evaluate(snap, [GROWTH], min_samples=100)
    return CanaryResult(model="fraud", candidate=8, baseline=7, verdict="passed",
                        snapshot=snap, gate_report=report, load={}, gpu=gpu)


def test_result_carries_candidate_bytes_for_the_swap_and_the_report_shows_gpu() -> None:
    ev = evidence()
    result = _result(ev)
    assert result.candidate_bytes == ev.candidate_bytes == 1620 * MiB
    document = result.to_dict()
    assert document["candidate_bytes"] == 1620 * MiB
    assert document["gpu"]["growth_pct"] == pytest.approx(20.0)
    markdown = render_markdown(result, plot_name=None)
    assert "## GPU (canary server)" in markdown
    assert "GPU-3b1f8d2c-9a77-4e0f-b1c2-5d6e7f809a1b" in markdown
    assert "candidate 1,620 MiB" in markdown and "+20.0%" in markdown


def test_cpu_result_has_no_gpu_section_and_no_bytes() -> None:
    result = _result(None)
    assert result.candidate_bytes is None and result.to_dict()["gpu"] is None
    assert "## GPU" not in render_markdown(result, plot_name=None)


# --------------------------------------------------------------------------- headroom plan


SPEC = ModelSpec("fraud", inputs=(TensorSpec("x", "float32", (256,)),),
                 outputs=(TensorSpec("y", "float32", (128,)),))


def gpu_config(**triton: object) -> ModelConfig:
    return render_model_config(SPEC, TritonPolicy.model_validate({"target": "gpu", **triton}))


def never() -> int:
    raise AssertionError("the estimate must not be computed here")


def test_cpu_replicas_are_skipped_with_a_plan_line_and_nothing_is_read() -> None:
    plan = plan_headroom("fraud", 8, {"replica-0": cpu_only("replica_roomy.txt"),
                                      "replica-1": cpu_only("replica_tight.txt")},
                         cfg=gpu_config(), measured_bytes=None, weights_bytes=never,
                         headroom_bytes=256 * MiB)
    assert plan.footprint is None and plan.checks == [] and plan.fits
    assert plan.lines == [f"fraud: GPU headroom: skipped on replica-{i}: no nv_gpu_* metrics "
                          "(a CPU server)" for i in (0, 1)]


def test_measured_footprint_fits_on_a_roomy_replica() -> None:
    plan = plan_headroom("fraud", 8, {"replica-0": text("replica_roomy.txt")},
                         cfg=gpu_config(), measured_bytes=1620 * MiB, weights_bytes=never,
                         headroom_bytes=256 * MiB)
    assert plan.fits and plan.footprint is not None
    assert plan.footprint.source == "measured" and plan.footprint.bytes_per_gpu == 1620 * MiB
    assert "(measured:" in plan.lines[0] and "fits" in plan.lines[1]
    check_headroom("fraud", 8, plan.checks, plan.footprint)  # does not raise


def test_estimate_is_used_without_a_measurement_and_the_refusal_has_the_numbers() -> None:
    calls: list[int] = []

    def weights() -> int:
        calls.append(1)
        return 600 * MiB

    plan = plan_headroom("fraud", 8, {"replica-0": text("replica_roomy.txt"),
                                      "replica-1": text("replica_tight.txt"),
                                      "replica-2": cpu_only("replica_roomy.txt")},
                         cfg=gpu_config(instance_group={"count": 2}), measured_bytes=None,
                         weights_bytes=weights, headroom_bytes=256 * MiB)
    assert calls == [1]
    assert plan.footprint is not None and plan.footprint.source == "estimated"
    assert plan.footprint.bytes_per_gpu == 2 * 600 * MiB * 2  # instances x weights x 2
    assert [c.replica for c in plan.checks if not c.fits] == ["replica-1"]
    assert plan.skipped == {"replica-2": "no nv_gpu_* metrics (a CPU server)"}
    with pytest.raises(PreflightError) as caught:
        check_headroom("fraud", 8, plan.checks, plan.footprint)
    err = caught.value
    assert err.exit_code == 1
    tight = parse_gpu_metrics(text("replica_tight.txt"))
    free = next(iter(tight.values())).free_bytes
    assert free is not None
    assert f"free {free / MiB:,.0f} MiB" in err.message
    assert f"needs {(2400 + 256):,} MiB" in err.message
    assert "estimated" in err.message and "replica-0" not in err.message


def test_unreadable_replica_on_a_gpu_fleet_does_not_fit() -> None:
    plan = plan_headroom("fraud", 8, {"replica-0": text("replica_roomy.txt"),
                                      "replica-1": None},
                         cfg=gpu_config(), measured_bytes=100 * MiB, weights_bytes=never,
                         headroom_bytes=0)
    assert not plan.fits and plan.skipped == {}
    assert [(c.replica, c.fits) for c in plan.checks] == [("replica-0", True),
                                                          ("replica-1", False)]


def test_pinned_gpus_are_the_ones_checked() -> None:
    cfg = gpu_config(instance_group={"count": 1, "gpus": [1]})
    assert instance_gpus(cfg) == [1]
    assert instance_gpus(gpu_config()) is None
    plan = plan_headroom("fraud", 8, {"replica-0": text("replica_two_gpus.txt")}, cfg=cfg,
                         measured_bytes=100 * MiB, weights_bytes=never, headroom_bytes=0)
    uuids = sorted(parse_gpu_metrics(text("replica_two_gpus.txt")))
    assert [c.gpu_uuid for c in plan.checks] == [uuids[1]]


# --------------------------------------------------------------------------- real scrapes


@pytest.fixture
def metrics_servers() -> Iterator[list[TritonServer]]:
    """Two loopback HTTP servers answering /metrics with recorded text: a GPU replica and
    a CPU one, plus a dead endpoint."""
    bodies = [text("replica_roomy.txt"), cpu_only("replica_tight.txt")]
    servers: list[http.server.ThreadingHTTPServer] = []
    for body in bodies:
        payload = body.encode()

        class Handler(http.server.BaseHTTPRequestHandler):
            body = payload

            def do_GET(self) -> None:  # noqa: N802
                self.send_response(200)
                self.send_header("Content-Length", str(len(self.body)))
                self.end_headers()
                self.wfile.write(self.body)

            def log_message(self, *args: object) -> None:
                pass

        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
    dead = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    dead_port = dead.server_address[1]
    dead.server_close()
    ports = [s.server_address[1] for s in servers] + [dead_port]
    yield [TritonServer(TritonEndpoint(http="http://127.0.0.1:1", grpc="127.0.0.1:1",
                                       metrics=f"http://127.0.0.1:{port}/metrics",
                                       name=f"replica-{i}"), timeout_s=2, control_timeout_s=2)
           for i, port in enumerate(ports)]
    for server in servers:
        server.shutdown()
        server.server_close()


def test_swap_scrapes_every_replica_and_plans_from_the_texts(
        metrics_servers: list[TritonServer]) -> None:
    texts = _metrics_texts(metrics_servers, timeout_s=2.0)
    assert texts["replica-0"] == text("replica_roomy.txt")
    assert texts["replica-1"] is not None and "nv_gpu_" not in texts["replica-1"]
    assert texts["replica-2"] is None
    plan = plan_headroom("fraud", 8, texts, cfg=gpu_config(), measured_bytes=1620 * MiB,
                         weights_bytes=never, headroom_bytes=256 * MiB)
    assert [(c.replica, c.fits) for c in plan.checks] == [("replica-0", True),
                                                          ("replica-2", False)]
    assert plan.skipped == {"replica-1": "no nv_gpu_* metrics (a CPU server)"}


def test_bake_window_scrape_records_gpus_only_where_exported(
        metrics_servers: list[TritonServer]) -> None:
    found, failed, gpus = _scrape_all(metrics_servers, timeout_s=2.0)
    assert sorted(found) == ["replica-0", "replica-1"] and list(failed) == ["replica-2"]
    assert list(gpus) == ["replica-0"]
    roomy = next(iter(parse_gpu_metrics(text("replica_roomy.txt")).values()))
    assert gpus["replica-0"]["memory_used_bytes"] == roomy.memory_used_bytes
    assert gpus["replica-0"]["utilization_mean"] == roomy.utilization
    assert ("fraud", "6") in found["replica-0"]
