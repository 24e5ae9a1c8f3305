"""The shadow canary (``canary.traffic: shadow``) on the session's stack, end to end.

Production serves v1; v2 answers exactly as v1 on the golden rows (inputs within
[-1, 1]) and differently everywhere else (it negates an input outside that range, so its
top-1 label becomes v1's last). Live clients send inputs outside the golden range
through the gateway while ``modelship promote`` of v2 runs: the replay canary would have
passed it on the golden rows; the shadow canary mirrors the live requests to v2, samples
their bodies, replays them on both versions, and rejects v2 (exit 4) on the agreement
gate. The clients only ever got v1's answers, and the mirror is back to 0 at the end.

Crash safety and locks: a shadow release SIGKILLed while its mirror is on leaves the
mirror (and the sample log) for the next command, which removes both; a second release
of the model meanwhile is refused by the model's lock and writes nothing.
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from modelship.loadgen import LoadSpec, run_load_sync
from modelship.loadgen.spec import Target
from modelship.loadgen.transports.kserve_http import build_body
from modelship.settings import Settings
from modelship.stack.state import read_state
from modelship.traffic.local_gateway import LocalGateway
from modelship.traffic.port import PRODUCTION_ONLY, TrafficSplit
from tasks import shadow as shadow_canary
from tasks.shadow_plan import SampledRequest, grpc_as_http, versioned_uri
from tests import models
from tests.conftest import start_cli
from tests.e2e import live_clients
from tests.e2e.organic import Organic
from tests.inprocess import run_inprocess

pytestmark = pytest.mark.e2e

MODEL = "shadow-canary"
POLICY: dict[str, Any] = {
    "canary": {"traffic": "shadow", "mirror_pct": 100.0, "warmup_s": 0.0, "window_s": 2.0,
               "max_duration_s": 40.0, "min_samples": 150},
    "gates": [
        # client-side: the shadow judges it as Triton's own time per request
        {"name": "latency_p99", "metric": "latency_p99_ms", "test": "quantile",
         "max_increase_pct": 200.0, "min_effect_ms": 1.0},
        {"name": "error_rate", "metric": "error_rate", "test": "exact_rate", "max_rate": 0.01},
        {"name": "agreement", "metric": "agreement", "test": "threshold", "min": 0.98},
    ],
}
GOLDEN = np.random.default_rng(5).uniform(-0.9, 0.9, (16, models.N_FEATURES)).astype(np.float32)
_rng = np.random.default_rng(6)
LIVE = (_rng.uniform(2.0, 5.0, (64, models.N_FEATURES))
        * _rng.choice([-1.0, 1.0], (64, models.N_FEATURES))).astype(np.float32)


def outside_negated_graph() -> Any:
    """v1's graph (``models.onnx_graph("softmax")``) on ``x`` where every |x| <= 1, on
    ``-x`` elsewhere: the same answers on the golden rows, the opposite label outside."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(3)  # v1's weights (models.onnx_graph)
    weights = rng.standard_normal((models.N_FEATURES, 3)).astype(np.float32)
    inits = [numpy_helper.from_array(weights, "W"),
             numpy_helper.from_array(np.array([1.0], np.float32), "one")]
    nodes = [helper.make_node("Abs", ["input"], ["magnitude"]),
             helper.make_node("Greater", ["magnitude", "one"], ["outside_row"]),
             helper.make_node("Cast", ["outside_row"], ["outside_f"], to=TensorProto.FLOAT),
             helper.make_node("ReduceMax", ["outside_f"], ["outside_any"], axes=[1],
                              keepdims=1),
             helper.make_node("Cast", ["outside_any"], ["outside"], to=TensorProto.BOOL),
             helper.make_node("Neg", ["input"], ["negated"]),
             helper.make_node("Where", ["outside", "negated", "input"], ["seen"]),
             helper.make_node("MatMul", ["seen", "W"], ["logits"]),
             helper.make_node("Softmax", ["logits"], ["probabilities"], axis=1),
             helper.make_node("ArgMax", ["probabilities"], ["label"], axis=1, keepdims=0)]
    return models.classifier_graph(nodes, inits, name="outside-negated")


def _cli(*args: str, settings: Settings, code: int = 0) -> dict[str, Any]:
    done = run_inprocess(*args, "--json", home=settings.home, timeout=600)
    assert done.returncode == code, done.stderr[-4000:]
    doc: dict[str, Any] = json.loads(done.stdout)
    return doc


@pytest.fixture(scope="module")
def production(stack_settings: Settings) -> int:
    """v1 in production (staged and swapped, no canary)."""
    uri = str(stack_settings.mlflow_tracking_uri)
    v1 = models.register_onnx(uri, MODEL, models.onnx_graph("softmax"),
                              example={"input": GOLDEN})
    _cli("stage", MODEL, "--version", str(v1), settings=stack_settings)
    _cli("swap", MODEL, "--to", str(v1), "--force", settings=stack_settings)
    return v1


def test_a_candidate_that_disagrees_on_live_inputs_only_is_rejected(
        stack_settings: Settings, tmp_path: Path, production: int) -> None:
    uri = str(stack_settings.mlflow_tracking_uri)
    example = {"input": GOLDEN}
    v1 = production
    v2 = models.register_onnx(uri, MODEL, outside_negated_graph(), example=example)
    gateway = stack_settings.gateway_url
    assert gateway, "the session stack runs a gateway"
    policy = models.write_policy(tmp_path / "policy.yaml", POLICY)

    # live traffic through the gateway until the promotion returns (one open-loop run of
    # modelship load's engine on a thread): the versions that answered the clients
    with Organic(stack_settings, MODEL, 80.0, 600, protocol="http", rows={"input": LIVE}
                 ) as clients:
        done = run_inprocess("promote", MODEL, "--version", str(v2), "--policy", str(policy),
                             "--json", home=stack_settings.home, timeout=600)
    answered = Counter(r.model_version if r.ok else f"error: {r.error}"
                       for r in clients.report.records)
    assert done.returncode == 4, done.stderr[-4000:]
    record = json.loads(done.stdout)["details"]["record"]
    gates = record["gates"]
    shadow = gates["load"]
    assert shadow["mode"] == "shadow" and shadow["mirror_pct"] == 100.0
    # the candidate answered the mirrored copies (Triton's counters), their bodies were
    # sampled and replayed on both versions
    assert shadow["mirrored"] >= 150 and shadow["sampled"] >= 150
    assert shadow["compared_inputs"] >= 150
    # the golden rows agree, the live inputs do not: the agreement gate rejects v2
    assert shadow["golden_agreement"] == 1.0 and shadow["golden_rows"] == len(GOLDEN)
    assert shadow["agreement"] is not None and shadow["agreement"] < 0.5
    assert shadow["router"] == "local-gateway" and shadow["agreement_source"] == "live inputs"
    # HTTP clients only: no mirrored request went uncompared for want of a logged body
    # (a few at the window's edges at most: Triton's tick and the log's read are not one)
    assert shadow["not_compared"]["requests"] <= 0.05 * shadow["mirrored"], shadow
    assert "gRPC" in shadow["not_compared"]["why"]
    verdicts = {r["rule"]: r["verdict"] for r in gates["results"]}
    assert verdicts["agreement"] == "failed"
    assert "latency_p99 (server)" in verdicts and verdicts["error_rate"] != "failed"
    assert any("latency_p99" in s for s in gates["skipped_rules"])
    # the clients only ever got production's answers
    assert set(answered) == {str(v1)}, answered
    # the mirror was written to the record, and is back to 0 on the record and the gateway
    assert record["traffic"]["split"]["mirror_pct"] == 0.0
    assert record["traffic"]["shadow"]["agreement"] == shadow["agreement"]
    # the window and the verdict are in the release's Slack thread
    with urllib.request.urlopen(f"{stack_settings.slack_api_url}/_emulator/messages",
                                timeout=10) as response:
        messages = json.loads(response.read())
    thread = [m["text"] for m in messages.get("messages", messages)
              if m.get("thread_ts") == record["slack"]["ts"]]
    assert any(t.startswith("shadow: mirroring 100 %") for t in thread), thread
    assert any(t.startswith("shadow: failed: agreement on live inputs") for t in thread)
    live = LocalGateway.from_state(read_state(stack_settings.stack_file) or {}).live()
    assert live.is_production_only, live
    assert not LocalGateway.from_state(read_state(stack_settings.stack_file) or {}
                                       ).layout.sample_log.exists()
    # a gRPC ModelInfer of live inputs, as the gateway logs its body, replays on the real
    # Triton as the same HTTP request does (the session stack serves other models, so its
    # gRPC is not mirrored here; the decoding is tested through a real nginx in unit tests)
    http = live_clients.replica_urls(stack_settings)[0]
    rows = {"input": LIVE[:4]}
    sample = grpc_as_http(_grpc_frame(MODEL, rows), MODEL)
    assert isinstance(sample, SampledRequest), sample
    body, headers = build_body(Target("", MODEL), rows)
    uri = versioned_uri(MODEL, v1)
    timeout = stack_settings.http_timeout_s
    replayed = shadow_canary._infer(http, uri, sample.body, sample.headers(), timeout)
    direct = shadow_canary._infer(http, uri, body, headers, timeout)
    assert replayed.keys() == direct.keys() and replayed
    assert all(np.array_equal(replayed[k], direct[k]) for k in direct)


def _grpc_frame(model: str, rows: dict[str, np.ndarray]) -> bytes:
    """A ModelInfer call's body on the wire, as tritonclient's gRPC client sends it."""
    from tritonclient.grpc import service_pb2

    request = service_pb2.ModelInferRequest(model_name=model)
    for name, array in rows.items():
        tensor = request.inputs.add()
        tensor.name, tensor.datatype = name, "FP32"
        tensor.shape.extend(array.shape)
        request.raw_input_contents.append(np.ascontiguousarray(array).tobytes())
    message = request.SerializeToString()
    return b"\0" + len(message).to_bytes(4, "big") + message


def _gateway(settings: Settings) -> LocalGateway:
    return LocalGateway.from_state(read_state(settings.stack_file) or {})


def test_a_killed_shadow_leaves_its_mirror_to_the_next_command_and_a_second_is_refused(
        stack_settings: Settings, tmp_path: Path, production: int) -> None:
    """Crash safety of the shadow (issue 20 item 5) and two releases of one model at once:
    while the mirror is on, a second promote of the model is refused by the model's
    release lock (exit 1, naming the holder) and changes nothing on the gateway; status
    shows the mirror. The release is SIGKILLed there: the mirror and the sample log of
    production's inputs stay (nothing ran to remove them), status still shows it, and the
    next command (`modelship reconcile`) returns the gateway to production, deletes the
    log and unloads the candidate from the canary Triton."""
    same = models.register_onnx(str(stack_settings.mlflow_tracking_uri), MODEL,
                                models.onnx_graph("softmax"), example={"input": GOLDEN})
    policy = models.write_policy(tmp_path / "hold.yaml", {
        **POLICY, "canary": {**POLICY["canary"], "window_s": 300.0,
                             "max_duration_s": 600.0}})
    router = _gateway(stack_settings)
    release = start_cli("promote", MODEL, "--version", str(same), "--policy", str(policy),
                        "--json", home=stack_settings.home)
    try:
        deadline = time.monotonic() + 240
        while router.live().mirror_pct != 100.0:
            assert release.poll() is None, release.communicate(timeout=30)
            assert time.monotonic() < deadline, "the mirror never went on"
            time.sleep(0.1)
        load = run_load_sync([str(stack_settings.gateway_url)], MODEL, {"input": LIVE},
                             LoadSpec(protocol="http", rate_rps=50.0, duration_s=1.0,
                                      warmup_s=0.0, timeout_s=10.0))
        assert load.records and all(r.ok for r in load.records)
        second = run_inprocess("promote", MODEL, "--version", str(same), "--policy",
                               str(policy), "--json", home=stack_settings.home, timeout=300)
        assert second.returncode == 1, (second.stdout[-2000:], second.stderr[-2000:])
        assert f"another release of {MODEL} is running" in second.stdout + second.stderr
        assert router.live() == TrafficSplit(mirror_pct=100.0)  # the loser wrote nothing
        shown = live_clients.status(stack_settings, MODEL)["traffic"]
        assert shown["live"]["mirror_pct"] == 100.0 and not shown["production_only"], shown
        # status names the requests the mirror applies to: this model's, read from the
        # gateway's running workers
        assert shown["scope"]["model"] == MODEL, shown
        assert shown["scope"]["applies_to"].startswith(f"{MODEL}'s HTTP requests"), shown
    finally:
        release.kill()
        release.communicate(timeout=30)
    assert router.live() == TrafficSplit(mirror_pct=100.0)  # a SIGKILL restores nothing
    assert router.layout.sample_log.stat().st_size > 0  # production's inputs, left behind
    shown = live_clients.status(stack_settings, MODEL)["traffic"]
    assert shown["live"]["mirror_pct"] == 100.0, shown
    healed = json.loads(run_inprocess("reconcile", MODEL, "--json",
                                      home=stack_settings.home).stdout)
    print(json.dumps(healed)[:2000])
    assert healed["traffic"]["restored"], healed["traffic"]
    assert router.live() == PRODUCTION_ONLY
    assert not router.layout.sample_log.exists()
    recovered = healed["models"][0]["recovered"]
    assert recovered["interrupted"] and MODEL in recovered["unloaded"], recovered
    status = live_clients.status(stack_settings, MODEL)
    assert status["traffic"]["production_only"], status["traffic"]
    assert status["consistent"] and status["production_version"] == production
