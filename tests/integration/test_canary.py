"""The canary's latency verdicts on the real stack: candidate and baseline side by side on
the canary Triton, the same rows to both, judged by the real gates.

One model (``canary_it``), checked and staged like a release: v1 is the baseline, v2 the
same sklearn model registered again, v3 a much heavier ONNX graph with the same I/O. Every
canary must leave nothing loaded.

``make test`` runs this file alone, on a quiet machine, before the rest of the suite: its
verdicts are latency verdicts, and the other worker's promotions make latency bursty. So it
holds only what latency decides, and its setup is on the suite's critical path: the canary's
other outcomes (answers that disagree, a first release, every way out of a canary) are
tests/integration/test_canary_outcomes.py's, which runs with the rest.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from flows.check import run_check
from modelship.clients import Clients
from modelship.loadgen import RequestRecord
from modelship.policy import AgreementPolicy, Policy
from modelship.settings import Settings
from tasks.canary import (
    CanaryResult,
    broken_canary,
    compute_agreement,
    next_round_s,
    rows_agree,
    run_canary,
)
from tests import models

pytestmark = pytest.mark.integration

MODEL = "canary_it"
SLOW_WIDTH = 1024
SLOW_LAYERS = 64
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

CANARY_POLICY: dict[str, Any] = {
    "canary": {"warmup_s": 1.0, "window_s": 2.0, "max_duration_s": 15.0, "min_samples": 300},
    "gates": [
        # A shared 2-core machine: identical versions differ by a few % at p99.
        {"name": "latency_p99", "metric": "latency_p99_ms", "test": "quantile",
         "max_increase_pct": 15.0, "min_effect_ms": 1.0, "effect": 185.0},
        {"name": "error_rate", "metric": "error_rate", "test": "exact_rate", "max_rate": 0.01},
        {"name": "agreement", "metric": "agreement", "test": "threshold", "min": 0.98},
        # Reported, not blocking: its verdicts are asserted where they are certain.
        {"name": "server_latency", "metric": "server_latency_ratio", "test": "server_ratio",
         "max_increase_pct": 10.0, "alpha": 0.01, "dry_run": True},
    ],
}


@dataclass(frozen=True)
class Versions:
    baseline: int
    same: int
    slow: int


def slow_onnx_graph(n_features: int = models.N_FEATURES, *, width: int = SLOW_WIDTH,
                    layers: int = SLOW_LAYERS) -> Any:
    """``tests.models.onnx_graph("softmax")``'s I/O, plus a heavy MatMul chain in the path.

    The input is widened to ``width`` and multiplied ``layers`` times by one
    orthogonal matrix (norms stay put, so no overflow; one shared initializer keeps the
    file small); a vanishing multiple of the chain's sum joins the logits, so the runtime
    cannot skip it and the answers stay a proper softmax.
    """
    from onnx import helper, numpy_helper

    rng = np.random.default_rng(5)
    q, _ = np.linalg.qr(rng.standard_normal((width, width)))
    inits = [
        numpy_helper.from_array(rng.standard_normal((n_features, 3)).astype(np.float32), "W"),
        numpy_helper.from_array(rng.standard_normal((n_features, width))
                                .astype(np.float32), "Wide"),
        numpy_helper.from_array(q.astype(np.float32), "Q"),
        numpy_helper.from_array(np.array([1e-30], np.float32), "tiny"),
    ]
    nodes = [helper.make_node("MatMul", ["input", "Wide"], ["h0"])]
    for i in range(layers):
        nodes.append(helper.make_node("MatMul", [f"h{i}", "Q"], [f"h{i + 1}"]))
    nodes += [
        helper.make_node("ReduceSum", [f"h{layers}"], ["total"], keepdims=1),
        helper.make_node("Mul", ["total", "tiny"], ["nudge"]),
        helper.make_node("MatMul", ["input", "W"], ["raw"]),
        helper.make_node("Add", ["raw", "nudge"], ["logits"]),
        helper.make_node("Softmax", ["logits"], ["probabilities"], axis=1),
        helper.make_node("ArgMax", ["probabilities"], ["label"], axis=1, keepdims=0),
    ]
    return models.classifier_graph(nodes, inits, name="slow_candidate", n_features=n_features)


def checked_and_staged(stack_settings: Settings, clients: Clients, workdir: Path,
                       version: int) -> int:
    """``version`` of :data:`MODEL` checked and staged, as `modelship stage` would."""
    report = run_check(stack_settings, clients, Policy(), model=MODEL, version=version,
                       workdir=workdir, stage=True)
    assert report.verdict == "passed", report
    return version


def staged_arms(stack_settings: Settings, clients: Clients,
                tmp_path_factory: pytest.TempPathFactory, *extra: Any) -> list[int]:
    """The baseline (a sklearn model), the identical candidate and one version per ``extra``
    ONNX graph (``(graph, example)``) or sklearn seed (an int): registered, checked and
    staged, in that order.

    The identical candidate is the baseline's own artifact registered again: the same bytes,
    so its check is the first one's, found in the check cache (this file runs alone, before
    the rest of the suite, and its setup is on the suite's critical path).
    """
    uri = str(stack_settings.mlflow_tracking_uri)
    registered = [models.register_sklearn(uri, MODEL, seed=0, reuse=True),
                  models.register_sklearn(uri, MODEL, seed=0, reuse=True)]
    for arm in extra:
        registered.append(models.register_sklearn(uri, MODEL, seed=arm) if isinstance(arm, int)
                          else models.register_onnx(uri, MODEL, arm[0], example=arm[1]))
    return [checked_and_staged(stack_settings, clients,
                               tmp_path_factory.mktemp(f"check{version}"), version)
            for version in registered]


@pytest.fixture(scope="module")
def versions(stack_settings: Settings, clients: Clients,
             tmp_path_factory: pytest.TempPathFactory) -> Versions:
    """Register, check and stage the three versions, as `modelship stage` would."""
    example = {"input": np.random.default_rng(0).standard_normal((16, models.N_FEATURES))
               .astype(np.float32)}
    baseline, same, slow = staged_arms(stack_settings, clients, tmp_path_factory,
                                       (slow_onnx_graph(), example))
    return Versions(baseline=baseline, same=same, slow=slow)


def judged_canary(stack_settings: Settings, clients: Clients, tmp_path: Path, *,
                  candidate: int, baseline: int | None, policy: dict[str, Any] | None = None,
                  progress: Any = None) -> CanaryResult:
    """A canary of :data:`MODEL` that must end judged, with nothing left loaded."""
    lines: list[str] = []
    result = run_canary(stack_settings, clients, Policy.model_validate(policy or CANARY_POLICY),
                        model=MODEL, candidate=candidate, baseline=baseline,
                        progress=progress or lines.append, report_dir=tmp_path / "report")
    assert_nothing_loaded(clients)
    assert result.cleanup == "unloaded"
    return result


def assert_nothing_loaded(clients: Clients) -> None:
    """No version of :data:`MODEL` is on the canary Triton, or on its way there."""
    assert clients.canary is not None
    left = [m for m in clients.canary.repository_index()
            if m.get("name") == MODEL and m.get("state") in ("READY", "LOADING", "UNLOADING")]
    assert left == []


def rule(result: CanaryResult, name: str) -> Any:
    """The gate report's result of the rule called ``name``."""
    return next(r for r in result.gate_report.results if r.rule == name)


def test_identical_candidate_passes(stack_settings: Settings, clients: Clients,
                                    versions: Versions, tmp_path: Path) -> None:
    result = judged_canary(stack_settings, clients, tmp_path, candidate=versions.same,
                           baseline=versions.baseline)
    document = result.to_dict()
    assert result.verdict == "passed", document["gates"]
    assert result.snapshot.agreement == 1.0
    assert result.snapshot.agreement_kind == "classifier"
    assert result.load["enough_samples"]
    for arm in (result.snapshot.baseline, result.snapshot.candidate):
        assert arm is not None
        assert arm.latency_ms.size >= result.load["required_samples"] >= 300
        assert arm.errors == 0
        # Triton's own figures for each version, from the metrics endpoint.
        assert arm.queue_us_mean is not None and arm.queue_us_mean > 0
        assert arm.compute_us_mean is not None and arm.compute_us_mean > 0
    assert document["snapshot"]["server_metrics"]["candidate"]["requests"] > 0
    # Triton scraped every second: per-interval figures for the server-side test.
    assert len(document["snapshot"]["server_intervals"]) >= 3
    assert rule(result, "server_latency").details["intervals"] >= 3

    markdown = Path(result.report_paths["markdown"]).read_text(encoding="utf-8")
    assert f"# Canary: {MODEL} v{versions.same} against v{versions.baseline}: **PASSED**" \
        in markdown
    assert "| rule | value | baseline | threshold | p-value | dependence | verdict |" in markdown
    assert "](canary.png)" in markdown
    assert Path(result.report_paths["png"]).read_bytes().startswith(PNG_MAGIC)
    assert Path(result.report_paths["json"]).is_file()


def test_much_slower_candidate_fails_the_latency_rule(stack_settings: Settings,
                                                      clients: Clients, versions: Versions,
                                                      tmp_path: Path) -> None:
    # The p99 rule plans 3100 requests per version (30 baseline ones above its p99); a slow
    # candidate's paired load reaches ~100/s here, so the canary needs ~30 s for it.
    policy = {**CANARY_POLICY, "canary": {**CANARY_POLICY["canary"], "max_duration_s": 45.0}}
    result = judged_canary(stack_settings, clients, tmp_path, candidate=versions.slow,
                           baseline=versions.baseline, policy=policy)
    latency = rule(result, "latency_p99")
    assert result.verdict == "failed", [r.message for r in result.gate_report.results]
    assert str(latency.verdict) == "failed", latency.message
    assert latency.p_value is not None and latency.p_value < 0.05
    cand, base = result.snapshot.candidate, result.snapshot.baseline
    assert base is not None and cand.compute_us_mean and base.compute_us_mean
    # The server agrees it is the model, not the client: far more compute per request.
    assert cand.compute_us_mean > 3 * base.compute_us_mean
    server = rule(result, "server_latency")
    assert str(server.verdict) == "failed", server.message
    markdown = Path(result.report_paths["markdown"]).read_text(encoding="utf-8")
    assert "**FAILED**" in markdown


def test_sequential_canary_stops_a_slow_candidate_early(stack_settings: Settings,
                                                        clients: Clients, versions: Versions,
                                                        tmp_path: Path) -> None:
    # A p99 watch waits for a reference of 3000 baseline requests (30 above its p99) before
    # it judges; the p95 one needs 600, so "early" is measurable within this test's budget.
    p95 = {**CANARY_POLICY["gates"][0], "name": "latency_p95", "metric": "latency_p95_ms"}
    # The budget is a hard cap on the canary's wall time, rounds' overhead included: at
    # load 10 the 15-17 looks the watch needs took 30 s of wall time (60 s: 2x that).
    policy = {**CANARY_POLICY, "canary": {**CANARY_POLICY["canary"], "sequential": True,
                                          "max_duration_s": 60.0},
              "gates": [p95, *CANARY_POLICY["gates"][1:]]}
    result = judged_canary(stack_settings, clients, tmp_path, candidate=versions.slow,
                           baseline=versions.baseline, policy=policy)
    assert result.verdict == "failed"
    sequential = rule(result, "sequential")
    assert str(sequential.verdict) == "failed", sequential.message
    assert "regression certain" in sequential.message
    load = result.load
    assert load["sequential"]["status"] == "failed"
    assert all(r["mode"] == "sequential" for r in load["rounds"])
    # It stopped early: at a look of the watch (a "failed" look ends the rounds at once, so
    # the deciding look is the last round), far before the budget: the watch first needs
    # 600 baseline answers, which took under 10 one-second looks idle, 14-15 at load 8-10.
    assert load["sequential"]["looks"] == len(load["rounds"]), load
    assert load["measured_s"] < policy["canary"]["max_duration_s"] / 2, load


def test_with_sequential_and_its_config_are_pure() -> None:
    from tasks.canary import sequential_config, with_sequential
    from tasks.gates import GateReport, Verdict
    from tasks.sequential import SequentialDecision

    policy = Policy.model_validate(CANARY_POLICY)
    config = sequential_config(policy.gates)
    assert config.max_increase_pct == 15.0 and config.max_error_rate == 0.01
    empty = GateReport(Verdict.PASSED, (), 100)
    failed = with_sequential(empty, SequentialDecision("failed", "latency_p50: certain", 3,
                                                       (300, 300)))
    assert failed.verdict is Verdict.FAILED and failed.results[-1].rule == "sequential"
    shared = with_sequential(empty, SequentialDecision("inconclusive", "both fail", 2,
                                                       (200, 200)))
    assert shared.results[-1].details["infrastructure"] is True


def test_server_intervals_difference_consecutive_scrapes() -> None:
    from modelship.triton.metrics import COMPUTE_INFER_US, QUEUE_US, SUCCESS, VersionMetrics
    from tasks.canary import server_intervals

    def scrape(n1: float, us1: float, n2: float, us2: float) -> dict[tuple[str, str], Any]:
        return {("m", "1"): VersionMetrics({SUCCESS: n1, QUEUE_US: us1 / 2,
                                            COMPUTE_INFER_US: us1 / 2}),
                ("m", "2"): VersionMetrics({SUCCESS: n2, QUEUE_US: us2 / 2,
                                            COMPUTE_INFER_US: us2 / 2})}

    scrapes = [scrape(0, 0, 0, 0), scrape(10, 5000, 10, 6000), None,
               scrape(30, 15000, 30, 18000), scrape(5, 100, 35, 20000)]  # v1 restarted
    got = server_intervals(scrapes, "m", {"baseline": 1, "candidate": 2})
    assert got == [{"baseline": {"us": 5000.0, "n": 10.0}, "candidate": {"us": 6000.0, "n": 10.0}},
                   {"baseline": {"us": 10000.0, "n": 20.0},
                    "candidate": {"us": 12000.0, "n": 20.0}}]


@pytest.mark.parametrize(
    ("oks", "tags", "paired", "broken"),
    [
        ([False, False], ["baseline", "candidate"], True, True),
        ([False, True], ["baseline", "candidate"], True, False),
        ([False, False], ["candidate", "candidate"], True, False),  # baseline not measured
        ([False], [None], False, True),
        ([], [], True, True),
    ],
)
def test_broken_canary_needs_every_arm_failing(oks: list[bool], tags: list[str | None],
                                               paired: bool, broken: bool) -> None:
    records = [RequestRecord(start_s=0.0, latency_ms=1.0, ok=ok, error=None if ok else "boom",
                             server=0, model_version="1", row=0, tag=tag, outputs=None)
               for ok, tag in zip(oks, tags, strict=True)]
    reason = broken_canary(records, paired)
    assert (reason is not None) is broken
    if reason and records:
        assert "boom" in reason


# --------------------------------------------------------------------------- agreement (pure)


def _record(tag: str, row: int, outputs: dict[str, np.ndarray], ok: bool = True
            ) -> RequestRecord:
    return RequestRecord(start_s=0.0, latency_ms=1.0, ok=ok, error=None if ok else "x",
                         server=0 if tag == "baseline" else 1, model_version="1", row=row,
                         tag=tag, outputs=outputs if ok else None)


def test_agreement_pairs_rows_and_uses_labels_or_argmax() -> None:
    probs_a = np.array([[0.7, 0.2, 0.1]], np.float32)
    probs_b = np.array([[0.1, 0.2, 0.7]], np.float32)
    records = [
        _record("baseline", 0, {"label": np.array([0]), "probabilities": probs_a}),
        _record("candidate", 0, {"label": np.array([0]), "probabilities": probs_a}),
        _record("candidate", 1, {"label": np.array([2]), "probabilities": probs_b}),
        _record("baseline", 1, {"label": np.array([0]), "probabilities": probs_a}),
        _record("baseline", 2, {}, ok=False),  # unanswered: an error, not a disagreement
        _record("candidate", 2, {"label": np.array([0]), "probabilities": probs_a}),
    ]
    share, compared, kind = compute_agreement(records, AgreementPolicy())
    assert (share, compared, kind) == (0.5, 2, "classifier")
    only_probs = {"probabilities": probs_b}
    assert rows_agree("classifier", only_probs, {"probabilities": probs_b},
                      AgreementPolicy()).tolist() == [True]


def test_regressor_agreement_uses_relative_and_absolute_tolerance() -> None:
    policy = AgreementPolicy(kind="regressor", regressor_rel_tol=1e-2, regressor_abs_tol=1e-3)
    base = {"y": np.array([[100.0], [0.0], [5.0], [np.nan]])}
    cand = {"y": np.array([[100.9], [0.0009], [5.2], [np.nan]])}
    assert rows_agree("regressor", cand, base, policy).tolist() == [True, True, False, False]
    assert compute_agreement([], policy) == (None, 0, "regressor")


@pytest.mark.parametrize(
    ("missing", "ok_per_s", "remaining_s", "expected"),
    [
        (0, 100.0, 10.0, None),  # enough already
        (100, 0.0, 10.0, None),  # nothing answered: more time will not help
        (100, 100.0, 0.2, None),  # out of budget
        (100, 100.0, 10.0, 1.2),  # sized from the rate, with a 20% margin
        (10, 100.0, 10.0, 0.5),  # never a round too short to mean anything
        (10_000, 100.0, 10.0, 10.0),  # capped at the budget
    ],
)
def test_next_round_is_sized_from_the_observed_rate(missing: int, ok_per_s: float,
                                                    remaining_s: float,
                                                    expected: float | None) -> None:
    assert next_round_s(missing=missing, ok_per_s=ok_per_s,
                        remaining_s=remaining_s) == pytest.approx(expected)
