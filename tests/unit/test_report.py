"""The canary report from a synthetic snapshot judged by the real (pure) gates: the
markdown says the verdict and every rule's numbers, the PNG is a real image, the JSON is
valid (no NaN) and names the files."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from modelship.measurements import ArmMeasurements, CanarySnapshot
from modelship.policy import gate_rule
from modelship.triton.gpu import GpuEvidence
from tasks.gates import GateReport, evaluate
from tasks.report import (
    PLOT_NAME,
    agreement_line,
    artifact_key,
    latency_table,
    plot_latency_ecdf,
    publish_markdown_artifact,
    render_markdown,
    server_table,
    write_canary_report,
)

RULES = [
    gate_rule(name="latency_p99", metric="latency_p99_ms", max_increase_pct=10.0,
             min_effect_ms=0.5),
    gate_rule(name="error_rate", metric="error_rate", max_rate=0.01),
    gate_rule(name="agreement", metric="agreement", min=0.98),
]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _arm(version: int, median_ms: float, *, n: int = 3200, errors: int = 0,
         seed: int = 0) -> ArmMeasurements:
    rng = np.random.default_rng(seed)
    return ArmMeasurements(version=version,
                           latency_ms=rng.lognormal(np.log(median_ms), 0.3, n),
                           requests=n + errors, errors=errors, throughput_rps=n / 5.0,
                           queue_us_mean=120.0, compute_us_mean=400.0)


def _snapshot(*, slow: float = 1.0, baseline: bool = True,
              agreement: float | None = 0.995) -> CanarySnapshot:
    return CanarySnapshot(
        model="fraud",
        candidate=_arm(8, 2.0 * slow, seed=1),
        baseline=_arm(7, 2.0, seed=2) if baseline else None,
        agreement=agreement if baseline else None,
        agreement_samples=2000 if baseline and agreement is not None else 0,
        agreement_kind="classifier",
        window_s=5.0,
        extra={"server_metrics": {"candidate": {"compute_infer_us_mean": 321.0,
                                                "batch_size_mean": 1.5, "requests": 2100.0,
                                                "failures": 0.0},
                                  "baseline": None},
               "notes": ["Triton reported no metrics for fraud/7 after the load"]},
    )


@dataclass
class FakeResult:
    """Only what the report reads; CanaryResult provides the same attributes."""

    snapshot: CanarySnapshot
    gate_report: GateReport
    model: str = "fraud"
    candidate: int = 8
    baseline: int | None = 7
    seconds: float = 12.5
    load: dict[str, Any] = field(default_factory=lambda: {
        "protocol": "grpc", "mode": "concurrency", "concurrency": 4, "paired": True,
        "warmup_s": 1.0, "rounds": [{"mode": "stability"}], "stable": True,
        "required_samples": 1500, "samples": {"baseline": 2000, "candidate": 2000},
        "payload_rows": 16, "payload_source": "input_example"})
    skipped_rules: list[str] = field(default_factory=list)
    gpu: GpuEvidence | None = None  # a CPU canary measures none

    @property
    def verdict(self) -> str:
        return str(self.gate_report.verdict)

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "verdict": self.verdict,
                "gates": self.gate_report.to_dict(), "snapshot": self.snapshot.to_dict(),
                "report": {}}


def _result(snapshot: CanarySnapshot, **kwargs: Any) -> FakeResult:
    rules = RULES if snapshot.baseline is not None else [RULES[1]]
    return FakeResult(snapshot=snapshot, gate_report=evaluate(snapshot, rules, min_samples=500),
                      **kwargs)


def test_markdown_of_a_passing_canary_has_verdict_gates_latency_and_plot_link() -> None:
    result = _result(_snapshot())
    assert result.verdict == "passed"
    text = render_markdown(result)
    assert text.startswith("# Canary: fraud v8 against v7: **PASSED**")
    assert "| rule | value | baseline | threshold | p-value | dependence | verdict |" in text
    for rule in ("latency_p99", "error_rate", "agreement"):
        assert f"| {rule} |" in text
    assert "| baseline | v7 | 3200 |" in text and "| candidate | v8 | 3200 |" in text
    assert "99.50% of 2000 rows agree (classifier: same top-1 label)." in text
    assert "![Latency ECDF, baseline against candidate](canary.png)" in text
    assert "required 1500" in text
    assert "- Triton reported no metrics for fraud/7 after the load" in text


def test_markdown_of_a_slow_candidate_names_the_failed_rule() -> None:
    result = _result(_snapshot(slow=1.6))
    assert result.verdict == "failed"
    text = render_markdown(result, plot_name=None)
    row = next(line for line in text.splitlines() if line.startswith("| latency_p99 |"))
    assert row.endswith("| failed |")
    assert "canary.png" not in text


def test_first_release_report_says_there_is_no_baseline() -> None:
    result = _result(_snapshot(baseline=False), baseline=None,
                     skipped_rules=["latency_p99", "agreement"])
    text = render_markdown(result)
    assert "against no baseline" in text
    assert "first release: only absolute gates apply" in text
    assert "Not judged without a baseline: latency_p99, agreement" in text
    assert "| baseline |" not in latency_table(result.snapshot)


def test_tables_show_missing_data_as_a_dash_not_zero() -> None:
    snapshot = CanarySnapshot(model="m", candidate=ArmMeasurements(
        version=2, latency_ms=np.array([]), requests=0, errors=0))
    assert "| candidate | v2 | 0 | – | – | – | – | – | – | 0 | – |" in latency_table(snapshot)
    assert "| candidate | v2 | – | – | – | – | – | – |" in server_table(snapshot)


@pytest.mark.parametrize(
    ("snapshot", "expected"),
    [
        (_snapshot(baseline=False), "No baseline (first release)"),
        (_snapshot(agreement=None), "agreement is unknown"),
        (_snapshot(agreement=0.5), "50.00% of 2000 rows agree"),
    ],
)
def test_agreement_line(snapshot: CanarySnapshot, expected: str) -> None:
    assert expected in agreement_line(snapshot)


def test_write_canary_report_writes_markdown_png_and_strict_json(tmp_path: Path) -> None:
    result = _result(_snapshot(slow=1.6))
    paths = write_canary_report(result, tmp_path / "out")
    markdown = Path(paths.markdown).read_text(encoding="utf-8")
    assert "**FAILED**" in markdown
    png = Path(paths.png).read_bytes()
    assert png.startswith(PNG_MAGIC) and len(png) > 10_000
    document = json.loads(Path(paths.json).read_text(encoding="utf-8"))
    assert document["verdict"] == "failed"
    assert document["report"] == paths.to_dict()
    assert [r["rule"] for r in document["gates"]["results"]] == [r.name for r in RULES]


def test_a_plot_drawn_before_is_kept_and_a_missing_one_is_drawn(tmp_path: Path) -> None:
    result = _result(_snapshot(slow=1.6))
    drawn = plot_latency_ecdf(result.snapshot, tmp_path / "out" / PLOT_NAME)
    before = drawn.read_bytes()
    drawn.write_bytes(before + b"kept")  # a marker: a second drawing would replace it
    paths = write_canary_report(result, tmp_path / "out", plotted=True)
    assert Path(paths.png).read_bytes() == before + b"kept"
    assert "**FAILED**" in Path(paths.markdown).read_text(encoding="utf-8")
    paths = write_canary_report(result, tmp_path / "other", plotted=True)  # none there
    assert Path(paths.png).read_bytes().startswith(PNG_MAGIC)


def test_plot_without_answers_still_writes_an_image(tmp_path: Path) -> None:
    snapshot = CanarySnapshot(model="m", candidate=ArmMeasurements(
        version=2, latency_ms=np.array([]), requests=10, errors=10))
    result = FakeResult(snapshot=snapshot,
                        gate_report=evaluate(snapshot, [RULES[1]], min_samples=5),
                        baseline=None)
    paths = write_canary_report(result, tmp_path)
    assert Path(paths.png).read_bytes().startswith(PNG_MAGIC)
    assert result.verdict == "failed"


def test_artifact_key_and_no_artifact_outside_a_prefect_run() -> None:
    assert artifact_key("canary-Fraud_Model-v7") == "canary-fraud-model-v7"
    assert publish_markdown_artifact("# x", key="canary-x") is False


def test_server_table_sets_triton_time_next_to_client_latency_and_the_overhead() -> None:
    arm = ArmMeasurements(version=3, latency_ms=np.full(100, 2.0), requests=100, errors=0,
                          queue_us_mean=100.0, compute_us_mean=1400.0)
    snapshot = CanarySnapshot(model="m", candidate=arm, extra={"server_metrics": {
        "candidate": {"request_us_mean": 1600.0, "requests": 100.0, "failures": 0.0}}})
    row = next(line for line in server_table(snapshot).splitlines()
               if line.startswith("| candidate"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    # queue, compute, queue + compute, infer, server request, client mean, overhead
    assert cells[2:9] == ["100", "1.4e+03", "1.5e+03", "–", "1.6e+03", "2e+03",
                          "400 µs (20%)"]
