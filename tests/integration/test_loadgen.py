"""The load generator against a real tritonserver 2.51 (CPU) on a local model repository.

One server for the module on free loopback ports, serving a tiny sklearn MLP exported to
ONNX as two versions of ``clf`` (so the answering version is visible in the records).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from modelship.errors import StackError
from modelship.loadgen import (
    LoadSpec,
    RequestFailed,
    Target,
    run_load,
    run_paired,
)
from modelship.loadgen.transports import choose_transport
from modelship.loadgen.transports.grpc_aio import GrpcTransport
from modelship.loadgen.transports.grpc_raw import RawGrpcTransport
from modelship.stack.local_triton import LocalTriton, local_tritonserver, mlp_classifier_onnx
from modelship.stack.triton_runtime import find_triton_runtime

pytestmark = pytest.mark.integration

REPO_ROOT = Path(__file__).resolve().parents[2]
RUNTIME_VENV = REPO_ROOT / ".venv-triton"
N_FEATURES = 4
READY_DEADLINE_S = 60.0
MODEL = "clf"

CONFIG_PBTXT = f"""
name: "{MODEL}"
backend: "onnxruntime"
max_batch_size: 32
version_policy {{ all {{ }} }}
input [ {{ name: "input" data_type: TYPE_FP32 dims: [ {N_FEATURES} ] }} ]
output [
  {{ name: "label" data_type: TYPE_INT64 dims: [ 1 ] reshape {{ shape: [ ] }} }},
  {{ name: "probabilities" data_type: TYPE_FP32 dims: [ 3 ] }}
]
dynamic_batching {{ }}
instance_group [ {{ kind: KIND_CPU count: 1 }} ]
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalTriton]:
    try:
        find_triton_runtime(RUNTIME_VENV)
    except StackError as exc:
        # The runtime is part of the project (`make install` builds .venv-triton from
        # requirements-triton.txt): missing, it is a broken checkout, not a reason to skip.
        pytest.fail(f"no Triton runtime: {exc}; run `make install` to build .venv-triton",
                    pytrace=False)

    base = tmp_path_factory.mktemp("loadgen-triton")
    onnx_bytes = mlp_classifier_onnx(N_FEATURES)[0].SerializeToString()
    for version in ("1", "2"):
        (base / "repo" / MODEL / version).mkdir(parents=True)
        (base / "repo" / MODEL / version / "model.onnx").write_bytes(onnx_bytes)
    (base / "repo" / MODEL / "config.pbtxt").write_text(CONFIG_PBTXT)
    with local_tritonserver(
        RUNTIME_VENV,
        base / "repo",
        base,
        ready_models=[MODEL],
        deadline_s=READY_DEADLINE_S,
        extra_args=[f"--load-model={MODEL}"],
    ) as srv:
        yield srv


@pytest.fixture(scope="module")
def payload() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    return {"input": rng.normal(size=(64, N_FEATURES)).astype(np.float32)}


def _fixed(**overrides: object) -> LoadSpec:
    values: dict[str, object] = {
        "warmup_s": 0.3,
        "window_s": 0.5,
        "duration_s": 1.5,
        "timeout_s": 5.0,
    }
    values.update(overrides)
    return LoadSpec(**values)  # type: ignore[arg-type]


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_concurrency_mode_records_answering_version(
    server: LocalTriton, payload: dict[str, np.ndarray], protocol: str
) -> None:
    url = server.grpc_url if protocol == "grpc" else server.http_url
    spec = _fixed(protocol=protocol, concurrency=4)
    report = asyncio.run(run_load([url], MODEL, payload, spec, version="1"))

    assert report.errors == 0, report.error_texts
    assert report.requests > 50
    assert report.throughput_rps > 0
    assert all(report.latency_ms[k] is not None for k in ("p50", "p90", "p95", "p99"))
    assert report.latency_ms["p50"] <= report.latency_ms["p99"]  # type: ignore[operator]
    assert {r.model_version for r in report.records} == {"1"}
    assert set(report.by_version) == {"1"}
    rows = [r.row for r in report.records]
    assert set(rows) <= set(range(64)) and len(set(rows)) > 1
    document = report.to_dict()
    assert list(document)[:4] == ["requests", "errors", "throughput_rps", "latency_ms"]
    assert set(document["latency_ms"]) == {"p50", "p90", "p95", "p99"}
    assert "records" not in document and document["stable"] is None
    assert document["mode"] == "concurrency" and document["concurrency"] == 4


def test_round_robin_over_servers_and_unversioned_answers_highest(
    server: LocalTriton, payload: dict[str, np.ndarray]
) -> None:
    # The same server twice stands in for two replicas: requests alternate between them.
    spec = _fixed(concurrency=2, batch_size=3, duration_s=1.0)
    report = asyncio.run(run_load([server.grpc_url, server.grpc_url], MODEL, payload, spec))

    assert report.errors == 0, report.error_texts
    assert {r.model_version for r in report.records} == {"2"}
    servers = [r.server for r in report.records]
    assert abs(servers.count(0) - servers.count(1)) <= 2
    assert len(report.by_server) == 1  # both indices name the same URL
    assert {r.row for r in report.records} <= {(3 * i) % 64 for i in range(64)}


def test_rate_mode_holds_the_requested_rate(
    server: LocalTriton, payload: dict[str, np.ndarray]
) -> None:
    for arrival in ("constant", "poisson"):
        spec = _fixed(rate_rps=200.0, arrival=arrival, duration_s=3.0, warmup_s=0.5, window_s=0.5)
        report = asyncio.run(run_load([server.grpc_url], MODEL, payload, spec))

        assert report.errors == 0, report.error_texts
        assert report.mode == "rate" and report.to_dict()["rate_rps"] == 200.0
        # Generous: Poisson over 2.5 s has a relative sd of ~4%; the scheduler is asyncio.
        assert 150 <= report.throughput_rps <= 250, (arrival, report.throughput_rps)
        assert report.duration_s == pytest.approx(2.5, abs=0.3)


def test_errors_are_counted_with_readable_text(
    server: LocalTriton, payload: dict[str, np.ndarray]
) -> None:
    for protocol, url in (("grpc", server.grpc_url), ("http", server.http_url)):
        spec = _fixed(protocol=protocol, concurrency=2, duration_s=0.8, warmup_s=0.0)
        report = asyncio.run(run_load([url], "no_such_model", payload, spec))

        assert report.requests > 0 and report.errors == report.requests
        assert report.throughput_rps == 0.0
        assert report.latency_ms == {"p50": None, "p90": None, "p95": None, "p99": None}
        (text,) = report.error_texts
        assert "no_such_model" in text and len(text) <= 200, text
        assert not any(r.ok for r in report.records) and report.by_version == {}


def test_wrong_shape_is_an_error_on_the_client(server: LocalTriton) -> None:
    # Triton's metrics do not count these as failures, so the client must.
    bad = {"input": np.zeros((8, N_FEATURES + 1), dtype=np.float32)}
    spec = _fixed(concurrency=1, duration_s=0.5, warmup_s=0.0)
    report = asyncio.run(run_load([server.grpc_url], MODEL, bad, spec))
    assert report.requests > 0 and report.errors == report.requests
    assert "INVALID_ARGUMENT" in next(iter(report.error_texts))


def test_paired_mode_alternates_arms_on_identical_rows(
    server: LocalTriton, payload: dict[str, np.ndarray]
) -> None:
    baseline = Target(server.grpc_url, MODEL, "1")
    candidate = Target(server.grpc_url, MODEL, "2")
    spec = _fixed(concurrency=1, duration_s=1.0, warmup_s=0.0, keep_outputs=True)
    report = asyncio.run(run_paired(baseline, candidate, payload, spec))

    assert report.errors == 0, report.error_texts
    records = report.records
    assert len(records) >= 20
    pairs = [records[i : i + 2] for i in range(0, len(records) - 1, 2)]
    firsts = [a.tag for a, _ in pairs]
    for a, b in pairs:
        assert a.row == b.row and {a.tag, b.tag} == {"baseline", "candidate"}
        assert {a.model_version, b.model_version} == {"1", "2"}
        assert b.start_s >= a.end_s - 1e-6  # back-to-back, not overlapping
        assert a.outputs is not None and b.outputs is not None
        np.testing.assert_array_equal(a.outputs["label"], b.outputs["label"])
    assert firsts[:6] == ["baseline", "candidate"] * 3
    assert set(report.by_arm) == {"baseline", "candidate"}
    counts = [report.by_arm[a]["requests"] for a in ("baseline", "candidate")]
    assert abs(counts[0] - counts[1]) <= 1
    assert report.to_dict()["by_arm"]["candidate"]["errors"] == 0


def test_stability_rule_reports_stable_on_steady_load(
    server: LocalTriton, payload: dict[str, np.ndarray]
) -> None:
    # A rate well under capacity is steady; the rule stops at the third agreeing window.
    # One-second windows and a 50% band: a p95 over half a second of a busy 2-core CI
    # machine swings by more than 30% without the load changing at all.
    spec = LoadSpec(
        rate_rps=150.0,
        warmup_s=0.5,
        window_s=1.0,
        stability_pct=50.0,
        max_duration_s=20.0,
        timeout_s=5.0,
    )
    started = time.monotonic()
    report = asyncio.run(run_load([server.grpc_url], MODEL, payload, spec))

    assert report.stable is True, [w.to_dict() for w in report.windows]
    assert len(report.windows) >= 3
    assert time.monotonic() - started < 22.0
    assert report.duration_s == pytest.approx(3.0, abs=0.15)  # the last three windows
    assert report.to_dict()["stable"] is True


def test_stability_rule_reports_unstable_when_time_runs_out(
    server: LocalTriton, payload: dict[str, np.ndarray]
) -> None:
    spec = LoadSpec(concurrency=2, warmup_s=0.2, window_s=0.5, max_duration_s=1.0, timeout_s=5.0)
    started = time.monotonic()
    report = asyncio.run(run_load([server.grpc_url], MODEL, payload, spec))

    assert report.stable is False and report.to_dict()["stable"] is False
    assert len(report.windows) < 3
    assert report.requests > 0 and report.errors == 0
    # it ended when its time ran out: within the budget plus one request's timeout (not
    # a tighter wall bound: starting the loop and the channel is slow on a busy machine)
    assert time.monotonic() - started < spec.max_duration_s + spec.timeout_s


def test_stop_event_ends_a_run_early(server: LocalTriton, payload: dict[str, np.ndarray]) -> None:
    async def scenario() -> tuple[float, bool]:
        stop = asyncio.Event()
        spec = _fixed(concurrency=2, duration_s=20.0, warmup_s=0.0)
        asyncio.get_running_loop().call_later(0.7, stop.set)
        started = time.monotonic()
        report = await run_load([server.grpc_url], MODEL, payload, spec, stop=stop)
        assert report.requests > 0
        return time.monotonic() - started, report.stopped

    elapsed_s, stopped = asyncio.run(scenario())
    assert stopped and elapsed_s < 20.0 / 3  # at the stop (0.7 s), far before the 20-s run


def test_raw_grpc_answers_match_tritonclient(
    server: LocalTriton, payload: dict[str, np.ndarray]
) -> None:
    # gRPC load takes the raw HTTP/2 transport; every answer it keeps must be what
    # tritonclient's own client gets for the same row from the same version.
    import tritonclient.grpc as grpcclient

    targets = [Target(server.grpc_url, MODEL, "1")]
    spec = _fixed(concurrency=4, duration_s=0.8, warmup_s=0.0, keep_outputs=True)
    assert isinstance(choose_transport(targets, payload, spec), RawGrpcTransport)
    report = asyncio.run(run_load([server.grpc_url], MODEL, payload, spec, version="1"))
    assert report.errors == 0 and len(report.records) > 20, report.error_texts

    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        expected = {}
        for row in sorted({r.row for r in report.records}):
            item = grpcclient.InferInput("input", [1, N_FEATURES], "FP32")
            item.set_data_from_numpy(payload["input"][row : row + 1])
            result = client.infer(MODEL, [item], model_version="1", client_timeout=5.0)
            expected[row] = {o: result.as_numpy(o) for o in ("label", "probabilities")}
    finally:
        client.close()
    for record in report.records:
        assert record.model_version == "1" and record.outputs is not None
        assert set(record.outputs) == {"label", "probabilities"}
        want = expected[record.row]
        np.testing.assert_array_equal(record.outputs["label"], want["label"])
        assert record.outputs["probabilities"].dtype == want["probabilities"].dtype
        # Dynamic batching may group rows differently: equal up to float rounding.
        np.testing.assert_allclose(record.outputs["probabilities"], want["probabilities"],
                                   rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("case", ["unknown model", "wrong shape"])
def test_raw_grpc_errors_read_as_grpc_aio_errors(server: LocalTriton, case: str) -> None:
    # The error texts users see (and the canary counts) do not depend on the transport.
    model, rows = (("no_such_model", np.zeros((4, N_FEATURES), dtype=np.float32))
                   if case == "unknown model"
                   else (MODEL, np.zeros((4, N_FEATURES + 1), dtype=np.float32)))
    spec = _fixed(concurrency=1)
    targets = [Target(server.grpc_url, model)]

    async def first_error(kind: Any) -> str:
        transport = kind(targets, {"input": rows}, spec)  # channels need the running loop
        try:
            await transport.send(0, 0)
        except RequestFailed as exc:
            return str(exc)
        finally:
            await transport.close()
        raise AssertionError("the request did not fail")

    raw = asyncio.run(first_error(RawGrpcTransport))
    aio = asyncio.run(first_error(GrpcTransport))
    assert raw == aio
    assert raw.startswith("NOT_FOUND" if case == "unknown model" else "INVALID_ARGUMENT"), raw
