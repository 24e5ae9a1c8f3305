"""A swap outside a release sizes its GPU headroom by the footprint C's canary measured,
read back from the release ledger when the staged digest matches, else by the estimate;
the plan says which (recorded GPU-server metrics text: tests/fixtures/triton_gpu_metrics)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from modelship.errors import PreflightError
from modelship.ledger import ReleaseRecord
from modelship.policy import TritonPolicy
from modelship.triton.gpu import canary_gpu_evidence, check_headroom, plan_headroom
from modelship.triton.model_config import ModelSpec, TensorSpec, render_model_config
from tasks.swap import RecordedFootprint, recorded_footprint

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "triton_gpu_metrics"
MiB = 1024 * 1024
DIGEST = {"model": "fraud", "version": 8, "onnx_sha256": "aa" * 32,
          "manifest_sha256": "m8" * 32}
RESTAGED = {**DIGEST, "manifest_sha256": "ff" * 32}


def text(name: str) -> str:
    return (FIXTURES / name).read_text()


# What a GPU canary recorded for v8: the rise when C loaded next to P, in bytes.
MEASURED = canary_gpu_evidence(text("canary_empty.txt"), text("canary_baseline.txt"),
                               text("canary_both.txt"))
assert MEASURED.candidate_bytes is not None and MEASURED.candidate_bytes > 0


def rec(release_id: str, *, digest: dict[str, Any] | None = None, kind: str = "promote",
        gpu: dict[str, Any] | None = None, verdict: str = "passed") -> ReleaseRecord:
    return ReleaseRecord(id=release_id, kind=kind, model="fraud",  # type: ignore[arg-type]
                         to_version=int((digest or DIGEST)["version"]),
                         candidate=dict(digest or DIGEST),
                         gates={"verdict": verdict, "gpu": gpu})


GPU = MEASURED.to_dict()
CASES: list[tuple[str, list[ReleaseRecord], int | None, str, str | None]] = [
    # id, records, bytes used, source, release id
    ("nothing on record", [], None, "estimate", None),
    ("measured by a promote", [rec("20261201T010000Z-a", gpu=GPU)], MEASURED.candidate_bytes,
     "canary", "20261201T010000Z-a"),
    ("measured by a standalone canary that failed its gates",
     [rec("20261201T010000Z-a", kind="canary", gpu=GPU, verdict="failed")],
     MEASURED.candidate_bytes, "canary", "20261201T010000Z-a"),
    ("cpu canary measured nothing", [rec("20261201T010000Z-a", gpu=None)], None, "estimate",
     None),
    ("zero bytes is no measurement",
     [rec("20261201T010000Z-a", gpu={**GPU, "candidate_bytes": 0})], None, "estimate", None),
    ("the newest measurement wins",
     [rec("20261201T010000Z-a", gpu={**GPU, "candidate_bytes": 100 * MiB}),
      rec("20261201T020000Z-b", gpu={**GPU, "candidate_bytes": 300 * MiB}),
      rec("20261201T030000Z-c", gpu=None)],
     300 * MiB, "canary", "20261201T020000Z-b"),
    ("re-staged since: other bytes, estimate",
     [rec("20261201T010000Z-a", digest=RESTAGED, gpu=GPU)], None, "estimate", None),
    ("another version's measurement is not C's",
     [rec("20261201T010000Z-a", digest={**DIGEST, "version": 7}, gpu=GPU)], None, "estimate",
     None),
]


@pytest.mark.parametrize(("records", "bytes_", "source", "release_id"),
                         [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_recorded_footprint_table(records: list[ReleaseRecord], bytes_: int | None,
                                  source: str, release_id: str | None) -> None:
    found = recorded_footprint(records, digest=DIGEST)
    assert (found.bytes_per_gpu, found.source, found.release_id) == (bytes_, source, release_id)
    assert found.to_dict()["source"] == source and found.detail


def test_restaged_says_why_the_measurement_was_not_used() -> None:
    found = recorded_footprint([rec("20261201T010000Z-a", digest=RESTAGED, gpu=GPU)],
                               digest=DIGEST)
    assert "other bytes" in found.detail and "20261201T010000Z-a" in found.detail


SPEC = ModelSpec("fraud", inputs=(TensorSpec("x", "float32", (256,)),),
                 outputs=(TensorSpec("y", "float32", (128,)),))
CFG = render_model_config(SPEC, TritonPolicy.model_validate({"target": "gpu"}))


def _plan(found: RecordedFootprint, weights: int) -> Any:
    return plan_headroom("fraud", 8, {"replica-0": text("replica_roomy.txt")}, cfg=CFG,
                         measured_bytes=found.bytes_per_gpu,
                         measured_detail=found.detail, weights_bytes=lambda: weights,
                         headroom_bytes=256 * MiB)


# ~20.8 GiB free on the roomy replica: 12,000 MiB of weights x 2 does not fit, the
# measured 1,620 MiB does.
WEIGHTS = 12_000 * MiB


def test_the_recorded_measurement_sizes_the_headroom_and_the_plan_names_its_record() -> None:
    found = recorded_footprint([rec("20261201T010000Z-a", gpu=GPU)], digest=DIGEST)
    plan = _plan(found, weights=WEIGHTS)
    assert plan.footprint is not None and plan.footprint.source == "measured"
    assert plan.footprint.bytes_per_gpu == MEASURED.candidate_bytes
    assert "release 20261201T010000Z-a" in plan.lines[0]
    assert plan.to_dict()["footprint"]["source"] == "measured"
    assert plan.fits, plan.lines
    check_headroom("fraud", 8, plan.checks, plan.footprint)


def test_without_a_usable_record_the_estimate_is_used_and_the_refusal_says_so() -> None:
    found = recorded_footprint([rec("20261201T010000Z-a", digest=RESTAGED, gpu=GPU)],
                               digest=DIGEST)
    plan = _plan(found, weights=WEIGHTS)
    assert plan.footprint is not None and plan.footprint.source == "estimated"
    with pytest.raises(PreflightError) as caught:
        check_headroom("fraud", 8, plan.checks, plan.footprint)
    assert caught.value.exit_code == 1 and "estimated" in caught.value.message
