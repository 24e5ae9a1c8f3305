"""The shadow canary through either router (tasks/shadow.py, tasks/shadow_plan.py): the
Gateway API's RequestMirror carries the copy but keeps no body, so its window waits for no
samples and its agreement is the golden rows', said on the record and in the thread; and
what the shadow could not compare (gRPC requests on the local gateway, every request on the
Gateway API) is counted with the reason."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from modelship import nginx
from modelship.errors import UsageError
from modelship.policy import CanaryPolicy, Policy, gate_rule
from modelship.traffic.local_gateway import LocalGateway
from modelship.traffic.port import TrafficSplit
from tasks import shadow
from tasks.shadow_plan import (
    GRPC_INFER,
    ArmTotals,
    Sampled,
    SampledRequest,
    ShadowPlan,
    grpc_as_http,
    input_problem,
    logged_inferences,
    not_compared,
    parse_samples,
    request_inputs,
    window_action,
)
from tests.fake_router import FakeRouter

PLAN = ShadowPlan(mirror_pct=10.0, min_s=5.0, max_s=30.0, min_samples=100)
MIRRORING = TrafficSplit(mirror_pct=10.0)


@pytest.mark.parametrize(("sampled", "sampling", "kind", "words"), [
    (0, False, "end", "no bodies sampled (the router keeps none)"),  # Gateway API: no wait
    (0, True, "hold", "0 bodies sampled"),                          # the local gateway waits
    (100, True, "end", "enough"),
])
def test_a_router_that_keeps_no_bodies_ends_the_window_on_the_counters(
        sampled: int, sampling: bool, kind: str, words: str) -> None:
    action = window_action(PLAN, elapsed_s=6.0, mirrored=500, sampled=sampled,
                           live=MIRRORING, sampling=sampling)
    assert action.kind == kind and words in action.reason


def _sampled(n: int, left_out: dict[str, int]) -> Sampled:
    return Sampled([SampledRequest("/v2/models/m/infer", b"{}", None, "")] * n,
                   Counter(left_out))


@pytest.mark.parametrize(("mirrored", "found", "requests", "why"), [
    # the local gateway: what Triton counted beyond the logged inferences (HTTP and gRPC)
    (120, _sampled(100, {}), 20, "did not log"),
    (120, _sampled(90, {"body not in memory (larger than the gateway's buffer)": 10,
                        "other model": 50, "not an inference": 7}), 20, "did not log"),
    (100, _sampled(96, {"body over the sample limit (1048576 bytes)": 2,
                        "compressed gRPC message (not decoded)": 2}), 0, "did not log"),
    (95, _sampled(100, {}), 0, "did not log"),  # requests in flight at the window's edge
    # the Gateway API: every mirrored request, judged on the counters only
    (300, None, 300, "the Gateway API router keeps no copy"),
])
def test_what_was_mirrored_but_not_compared_is_counted_with_why(
        mirrored: int, found: Sampled | None, requests: int, why: str) -> None:
    done = not_compared(mirrored, found)
    assert done["requests"] == requests and why in done["why"]


def test_only_the_models_mirrored_inferences_count_as_logged() -> None:
    assert logged_inferences(_sampled(3, {"other model": 9, "unreadable line": 2,
                                          "body not in memory (x)": 4,
                                          "unreadable gRPC body (frame length)": 1})) == 8


def test_a_shadow_needs_a_router_and_takes_either() -> None:
    """No router: exit 2, naming the three ways out. The Gateway API is no longer refused:
    its RequestMirror carries the shadow's copy."""
    with pytest.raises(UsageError) as refused:
        shadow._mirroring("m", 1, None)
    assert refused.value.exit_code == 2 and refused.value.details["key"] == "canary.traffic"
    hint = refused.value.hint or ""
    assert "modelship stack up" in hint and "MODELSHIP_K8S_ROUTE" in hint and "replay" in hint
    router = FakeRouter(name="gateway-api")
    assert shadow._mirroring("m", 1, router) == (router, 1)
    with pytest.raises(UsageError, match="needs a production version"):
        shadow._mirroring("m", None, router)


def _run(router: Any) -> shadow._Shadow:
    policy = Policy(canary=CanaryPolicy(traffic="shadow", mirror_pct=20.0, min_samples=10),
                    gates=[gate_rule(name="agree", metric="agreement", min=0.9),
                           gate_rule(name="errors", metric="error_rate", max=0.05)])
    clients: Any = type("C", (), {"replicas": []})()
    return shadow._Shadow(None, clients, policy, model="m", candidate=2,  # type: ignore[arg-type]
                          baseline=1, router=router, canary=None,  # type: ignore[arg-type]
                          progress=lambda _: None)


@pytest.mark.parametrize(("golden", "verdict"), [((1.0, 40), "passed"), ((0.5, 40), "failed")])
def test_through_the_gateway_api_the_golden_rows_agreement_is_judged_and_said(
        monkeypatch: pytest.MonkeyPatch, golden: tuple[float, int], verdict: str) -> None:
    """No live bodies: the agreement rule judges the golden rows (never nothing), the record
    says where the agreement came from and that every mirrored request was judged on the
    counters only; the thread's line says live agreement was not measured."""
    run = _run(FakeRouter(name="gateway-api"))
    assert not run.sampling and run.sampled_lines() == []
    run.forget_samples()  # no sample log to delete: nothing to do, nothing raised
    run.golden_kind, run.window_s, run.ticks = "classifier", 12.0, [{}, {}]
    monkeypatch.setattr(shadow, "arm_totals", lambda *a, **k: (ArmTotals(300, 0, 3e5, 1e4),
                                                               ArmTotals(3000, 0, 3e6, 1e5)))
    monkeypatch.setattr(shadow, "shadow_intervals", lambda *a, **k: [])
    written: list[dict[str, Any]] = []
    result = shadow._judge(run, run.policy, written.append, traffic={"router": "gateway-api"},
                           golden=golden, pairs=[], found=Sampled(), cleanup="unloaded")
    summary = written[-1]["shadow"]
    assert summary["agreement_source"] == "golden rows" and summary["agreement"] is None
    assert summary["not_compared"]["requests"] == 300
    assert summary["verdicts"]["agree"]["value"] == golden[0]
    assert summary["verdicts"]["agree"]["verdict"] == verdict
    assert any("the agreement judged is the golden rows'" in n for n in run.notes)
    said = shadow._agreement_said(result.load)
    assert said.startswith("agreement on live inputs not measured (gateway-api keeps no")
    assert f"golden rows {golden[0]:.1%} over 40 rows, judged" in said
    assert "300 mirrored requests not compared" in said


def test_through_the_local_gateway_unlogged_requests_are_said_mirrored_not_compared(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    layout = nginx.GatewayLayout(1, 2, 3, (("a", "b"),), ("c", "d"), str(tmp_path),
                                 str(tmp_path / "e.log"))
    run = _run(LocalGateway(layout, pid=1, start_ticks=None, timeout_s=1.0))  # no I/O here
    assert run.sample_log == layout.sample_log
    assert run.sampling
    run.golden_kind, run.window_s, run.ticks = "classifier", 12.0, [{}, {}]
    monkeypatch.setattr(shadow, "arm_totals", lambda *a, **k: (ArmTotals(130, 0, 1e5, 1e4),
                                                               ArmTotals(1300, 0, 1e6, 1e5)))
    monkeypatch.setattr(shadow, "shadow_intervals", lambda *a, **k: [])
    answer = {"out": np.array([[0.1, 0.9]])}
    written: list[dict[str, Any]] = []
    result = shadow._judge(run, run.policy, written.append, traffic={}, golden=(1.0, 40),
                           pairs=[(answer, answer)] * 12, found=_sampled(100, {}),
                           cleanup="unloaded")
    summary = written[-1]["shadow"]
    assert summary["agreement_source"] == "live inputs" and summary["agreement"] == 1.0
    assert summary["not_compared"]["requests"] == 30
    assert "did not log" in summary["not_compared"]["why"]
    assert any("30 mirrored requests not compared: mirrored requests whose body" in n
               for n in result.snapshot.extra["notes"])  # the published report's notes
    said = shadow._agreement_said(result.load)
    assert said.startswith("agreement on live inputs 100.0% over 12 rows (golden rows 100.0%)")
    assert "30 mirrored requests not compared (mirrored requests whose body" in said


# --------------------------------------------------------------------------------------
# gRPC bodies: the gateway logs a mirrored ModelInfer's frame; it is replayed over HTTP


def _grpc_body(model: str, inputs: dict[str, np.ndarray], *, raw: bool = True,
               outputs: tuple[str, ...] = ()) -> bytes:
    """A ModelInfer call's body on the wire (the 5-byte gRPC frame and the protobuf)."""
    from tritonclient.grpc import service_pb2

    request = service_pb2.ModelInferRequest(model_name=model, model_version="")
    for name, array in inputs.items():
        tensor = request.inputs.add()
        tensor.name, tensor.datatype = name, {"float32": "FP32", "int64": "INT64"}[
            array.dtype.name]
        tensor.shape.extend(array.shape)
        if raw:
            request.raw_input_contents.append(array.tobytes())
        elif array.dtype.name == "float32":
            tensor.contents.fp32_contents.extend(array.ravel().tolist())
        else:
            tensor.contents.int64_contents.extend(array.ravel().tolist())
    for name in outputs:
        request.outputs.add().name = name
    message = request.SerializeToString()
    return b"\0" + len(message).to_bytes(4, "big") + message


X = np.arange(8, dtype=np.float32).reshape(2, 4) / 3
IDS = np.array([[7], [-2]], dtype=np.int64)


@pytest.mark.parametrize(("body", "inputs"), [
    (_grpc_body("m", {"input": X}), {"input": X}),
    (_grpc_body("m", {"input": X}, raw=False), {"input": X}),        # typed contents
    (_grpc_body("m", {"input": X, "ids": IDS}, outputs=("probabilities",)),
     {"input": X, "ids": IDS}),
    (_grpc_body("m", {"input": X, "ids": IDS}, raw=False), {"input": X, "ids": IDS}),
])
def test_a_grpc_model_infer_becomes_the_same_http_request(
        body: bytes, inputs: dict[str, np.ndarray]) -> None:
    sample = grpc_as_http(body, "m")
    assert isinstance(sample, SampledRequest), sample
    assert sample.uri == "/v2/models/m/infer" and input_problem(sample) is None
    decoded = request_inputs(sample)
    assert decoded.keys() == inputs.keys()
    for name, array in inputs.items():
        assert decoded[name].dtype == array.dtype and decoded[name].shape == array.shape
        assert np.array_equal(decoded[name], array)


@pytest.mark.parametrize(("body", "why"), [
    (_grpc_body("other", {"input": X}), "other model"),
    (b"\1" + _grpc_body("m", {"input": X})[1:], "compressed gRPC message"),
    (_grpc_body("m", {"input": X})[:-3], "frame length"),
    (b"\0\0\0", "no gRPC frame"),
    (b"\0\0\0\0\4\xff\xff\xff\xff", "not a ModelInferRequest"),
    (_grpc_body("m", {}), "no inputs"),
])
def test_a_grpc_body_that_is_not_a_replayable_inference_is_left_out_with_why(
        body: bytes, why: str) -> None:
    said = grpc_as_http(body, "m")
    assert isinstance(said, str) and why in said


def test_the_sample_log_reads_grpc_lines_with_the_http_ones() -> None:
    """Lines as nginx logs them (escape=json: latin-1 bytes back): a gRPC ModelInfer of
    the model is sampled, another model's and an empty body are counted."""
    import json

    def line(uri: str, body: bytes) -> bytes:
        return json.dumps({"uri": uri, "body": body.decode("latin-1"), "content_type":
                           "application/grpc", "header_length": ""}).encode("latin-1")

    found = parse_samples([line(GRPC_INFER, _grpc_body("m", {"input": X})),
                           line(GRPC_INFER, _grpc_body("n", {"input": X})),
                           line(GRPC_INFER, b""),
                           line("/inference.GRPCInferenceService/ServerLive", b"")], "m")
    assert len(found.requests) == 1
    assert np.array_equal(request_inputs(found.requests[0])["input"], X)
    assert found.left_out == Counter({"other model": 1, "not an inference": 1,
                                      "body not in memory (larger than the gateway's "
                                      "buffer)": 1})
