"""The fake Triton fleet's pure parts and the fleet-scale bench's bounds (no servers)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from tritonclient.grpc import model_config_pb2 as mc

from bench.fake_triton import (
    Faults,
    _decode_http_inputs,
    _encode_http_outputs,
    fake_outputs,
    iter_switches,
    versions_of,
)
from bench.fleet_scale import Limits, bound, faulty_replicas


def policy(text: str) -> mc.ModelVersionPolicy | None:
    if not text:
        return None
    out = mc.ModelVersionPolicy()
    kind, _, arg = text.partition(":")
    if kind == "specific":
        out.specific.versions.extend(int(v) for v in arg.split(","))
    elif kind == "latest":
        out.latest.num_versions = int(arg)
    else:
        out.all.SetInParent()
    return out


@pytest.mark.parametrize(("text", "available", "expected"), [
    ("", [1, 2, 3], (3,)),                     # no policy: latest 1, as Triton
    ("latest:2", [1, 3, 2], (2, 3)),
    ("latest:5", [1, 2], (1, 2)),
    ("all", [2, 1], (1, 2)),
    ("specific:2", [1, 2], (2,)),
    ("specific:7", [1, 2], (7,)),              # a missing one is the load's error to report
    ("specific:2,1", [1, 2], (1, 2)),
])
def test_versions_of_follows_tritons_version_policy(text: str, available: list[int],
                                                    expected: tuple[int, ...]) -> None:
    assert versions_of(policy(text), available) == expected


def test_fake_versions_answer_differently_and_deterministically() -> None:
    feed = {"input": np.arange(8, dtype=np.float32).reshape(2, 4)}
    one, again, two = (fake_outputs("m", 1, feed), fake_outputs("m", 1, feed),
                       fake_outputs("m", 2, feed))
    assert np.array_equal(one["probabilities"], again["probabilities"])
    assert not np.allclose(one["probabilities"], two["probabilities"])
    assert one["label"].shape == (2, 1) and one["probabilities"].shape == (2, 2)


def test_faults_refuse_unknown_fields_and_slow_versions_override_the_load_time() -> None:
    faults = Faults(load_s=0.5)
    with pytest.raises(ValueError, match="unknown fault fields"):
        faults.update({"lod_s": 1})
    faults.update({"slow_versions": {"2": 8.0}})
    assert faults.build_s([1]) == 0.5 and faults.build_s([2]) == 8.0


def test_http_codec_round_trips_binary_inputs_and_outputs() -> None:
    from tritonclient.http import InferResult

    array = np.arange(6, dtype=np.float32).reshape(2, 3)
    head = json.dumps({"inputs": [{"name": "input", "datatype": "FP32", "shape": [2, 3],
                                   "parameters": {"binary_data_size": array.nbytes}}]})
    parsed, arrays = _decode_http_inputs(head.encode() + array.tobytes(), len(head))
    assert np.array_equal(arrays["input"], array) and parsed["inputs"][0]["name"] == "input"
    body, length = _encode_http_outputs("m", 2, {"out": array}, [{"name": "out"}], True)
    assert length is not None
    result = InferResult.from_response_body(body, header_length=length)
    assert result.get_response()["model_version"] == "2"
    assert np.array_equal(result.as_numpy("out"), array)


def test_iter_switches_ignores_reloads_of_the_same_version() -> None:
    calls = [{"call": "switched", "model": "m", "replica": "a", "t": 1.0, "versions": [2],
              "previous": [1]},
             {"call": "switched", "model": "m", "replica": "a", "t": 2.0, "versions": [2],
              "previous": [2]},
             {"call": "load", "model": "m", "replica": "b", "t": 1.5, "versions": [2]}]
    assert list(iter_switches(calls, "m", 2)) == [("a", 1.0)]


@pytest.mark.parametrize(("n", "expected"), [
    (5, ["r0", "r2", "r4"]), (3, ["r0", "r1", "r2"]), (2, ["r0", "r1"]),
])
def test_faulty_replicas_are_spread_over_the_fleet(n: int, expected: list[str]) -> None:
    assert faulty_replicas([f"r{i}" for i in range(n)]) == expected


LIMITS = Limits(load_s=0.5, slow_s=8.0, deadline_s=4.0, probe_rtt_ms=2.0)


@pytest.mark.parametrize(("scenario", "n", "figure", "value"), [
    # 10 ms dispatch + 50 ms poll + 2 ms RTT + 100 x 3 ms
    ("clean", 100, "skew_ms", 362.0),
    # 2 loads + 1 s margin + 2 x 100 x 3 ms
    ("dead", 100, "abort_s", 2.6),
    ("fail", 10, "abort_s", 2.06),
    # gives up at 6 s; the slow replica's revert queues behind its 8 s load: 8.5 + 1 + 0.6
    ("slow", 100, "abort_s", 10.1),
    # two phases give up at deadline + grace
    ("hung", 100, "abort_s", 13.0),
])
def test_bounds(scenario: str, n: int, figure: str, value: float) -> None:
    got_figure, got_value, formula = bound(scenario, n, LIMITS, dispatch_ms=10.0, cpu_ms=3.0)
    assert (got_figure, got_value) == (figure, value) and formula
