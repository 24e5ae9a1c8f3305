"""The shadow canary's live inputs are whatever clients sent (issue 20, adversarial):
NaN, inf, huge or malformed bodies are counted and reported, never crash the judge and
never count as agreement; a body over the sample limit is left out with its reason."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import numpy as np
import pytest

from modelship.loadgen.spec import Target
from modelship.loadgen.transports.kserve_http import build_body
from modelship.policy import AgreementPolicy, Policy
from tasks import shadow
from tasks.agreement import rows_agree
from tasks.shadow_plan import (
    MAX_SAMPLE_BYTES,
    SampledRequest,
    answer_problem,
    input_problem,
    parse_samples,
    request_inputs,
    screen,
)


def binary(array: np.ndarray) -> SampledRequest:
    """A sampled request as the project's load generator sends it (binary extension)."""
    body, headers = build_body(Target("", "m"), {"input": array})
    return SampledRequest("/v2/models/m/infer", body,
                          int(headers["Inference-Header-Content-Length"]),
                          headers["Content-Type"])


def as_json(text: str) -> SampledRequest:
    return SampledRequest("/v2/models/m/infer", text.encode(), None, "application/json")


ROW = np.array([[0.5, -1.0, 2.0, 3.0]], np.float32)
GOOD = binary(ROW)
JSON_ROW = ('{"inputs":[{"name":"input","shape":[1,4],"datatype":"FP32",'
            '"data":[0.5,-1.0,2.0,3.0]}]}')


@pytest.mark.parametrize(("sample", "problem"), [
    (GOOD, None),
    (as_json(JSON_ROW), None),
    (binary(np.array([[0.5, np.nan, 2.0, 3.0]], np.float32)), "non-finite input"),
    (binary(np.array([[np.inf, 0, 0, 0]], np.float32)), "non-finite input"),
    (binary(np.array([[1.0, 2.0, -np.inf, 0]], np.float64)), "non-finite input"),
    # Python's json (and Triton's) read NaN and Infinity tokens
    (as_json(JSON_ROW.replace("0.5", "NaN")), "non-finite input"),
    (as_json(JSON_ROW.replace("0.5", "-Infinity")), "non-finite input"),
    # huge but finite: not refused here; an overflowing answer is (answer_problem)
    (binary(np.full((1, 4), 3e38, np.float32)), None),
    (binary(np.array([[2**62, 1, 2, 3]], np.int64)), None),
    # malformed
    (as_json("not json at all"), "malformed body"),
    (as_json('{"inputs": []}'), "malformed body"),
    (as_json('{"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32"}]}'),
     "malformed body"),
    (as_json(JSON_ROW.replace("[1,4]", "[2,4]")), "malformed body"),
    (as_json(JSON_ROW.replace("FP32", "FP99")), "malformed body"),
    (as_json(JSON_ROW.replace('"data":[0.5', '"data":["x"')), "malformed body"),
    (SampledRequest(GOOD.uri, GOOD.body[:-3], GOOD.header_length), "malformed body"),
    (SampledRequest(GOOD.uri, GOOD.body + b"\0", GOOD.header_length), "malformed body"),
    (SampledRequest(GOOD.uri, GOOD.body, len(GOOD.body) + 10), "malformed body"),
    (SampledRequest(GOOD.uri, GOOD.body, 0), "malformed body"),
    (SampledRequest(GOOD.uri, b"\xff\xfe" + GOOD.body[2:], GOOD.header_length),
     "malformed body"),
])
def test_input_problem(sample: SampledRequest, problem: str | None) -> None:
    found = input_problem(sample)
    if problem is None:
        assert found is None
    else:
        assert found is not None and found.startswith(problem), found


def test_a_good_binary_body_decodes_to_its_own_values() -> None:
    assert np.array_equal(request_inputs(GOOD)["input"], ROW)
    assert np.array_equal(request_inputs(as_json(JSON_ROW))["input"], ROW)


def test_screen_keeps_the_good_ones_in_order_and_counts_the_rest_by_reason() -> None:
    nan = binary(np.array([[np.nan, 0, 0, 0]], np.float32))
    other = binary(ROW * 2)
    kept, left_out = screen([GOOD, nan, as_json("{"), other, nan, as_json("[]")])
    assert kept == [GOOD, other]
    assert left_out == Counter({"non-finite input (NaN or inf)": 2, "malformed body": 2})


def test_garbage_never_raises() -> None:
    """Random bytes, truncations and odd JSON: a reason, never an exception."""
    rng = np.random.default_rng(0)
    samples = [SampledRequest("/v2/models/m/infer", rng.bytes(int(n)),
                              int(h) if h else None)
               for n, h in zip(rng.integers(1, 200, 300), rng.integers(0, 60, 300),
                               strict=True)]
    samples += [SampledRequest(GOOD.uri, GOOD.body[:cut], GOOD.header_length)
                for cut in range(1, len(GOOD.body))]
    samples += [as_json(json.dumps(doc)) for doc in (
        {"inputs": None}, {"inputs": [1]}, {"inputs": [{"shape": "x"}]},
        {"inputs": [{"name": "x", "shape": [-1], "datatype": "FP32", "data": []}]},
        {"inputs": [{"name": "x", "shape": [1], "datatype": "FP32",
                     "parameters": {"binary_data_size": "many"}}]},
        {"inputs": [{"name": "x", "shape": [1], "datatype": "INT8", "data": [1e300]}]})]
    reasons = [input_problem(s) for s in samples]
    assert all(r is not None and r.startswith("malformed body") for r in reasons)


def test_a_logged_body_over_the_sample_limit_is_left_out_with_its_reason() -> None:
    big = json.dumps({"uri": "/v2/models/m/infer", "body": "x" * (MAX_SAMPLE_BYTES + 1),
                      "header_length": "", "content_type": ""}).encode()
    small = json.dumps({"uri": "/v2/models/m/infer", "body": JSON_ROW}).encode()
    found = parse_samples([big, small], "m")
    assert [r.body for r in found.requests] == [JSON_ROW.encode()]
    assert found.left_out == Counter({f"body over the sample limit ({MAX_SAMPLE_BYTES} "
                                      "bytes)": 1})


PROBS = np.array([[0.2, 0.7, 0.1]], np.float32)


@pytest.mark.parametrize(("candidate", "production", "problem"), [
    ({"probabilities": PROBS, "label": np.array([1])},
     {"probabilities": PROBS, "label": np.array([1])}, None),
    ({"probabilities": np.full((1, 3), np.nan, np.float32), "label": np.array([0])},
     {"probabilities": PROBS, "label": np.array([1])}, "non-finite answer (candidate)"),
    ({"probabilities": PROBS}, {"probabilities": np.array([[np.inf, 0, 0]])},
     "non-finite answer (production)"),
    ({"label": np.array([0])}, {"label": np.array([0])}, None),
])
def test_answer_problem(candidate: dict[str, np.ndarray], production: dict[str, np.ndarray],
                        problem: str | None) -> None:
    assert answer_problem(candidate, production) == problem


class _Run(shadow._Shadow):
    def __init__(self) -> None:  # only what pair() reads
        endpoint = type("E", (), {"http": "http://127.0.0.1:9"})()
        server: Any = type("T", (), {"endpoint": endpoint, "name": "t"})()
        self.settings: Any = type("S", (), {"http_timeout_s": 1.0})()
        self.model, self.candidate, self.baseline = "m", 2, 1
        self.replicas, self.canary = [server], server
        self.notes, self.left_out = [], Counter()


def test_overflowing_answers_never_count_as_agreement(monkeypatch: pytest.MonkeyPatch
                                                      ) -> None:
    """A huge live input overflows both versions to NaN probabilities: their argmax is the
    same label, which the agreement would count as agreeing. The pair is left out and
    counted instead; an input neither version answers is counted too."""
    nan = {"probabilities": np.full((1, 3), np.nan, np.float32)}
    assert rows_agree("classifier", nan, nan, AgreementPolicy()).all()  # why it matters
    answers = iter([nan, nan, {"probabilities": PROBS}, {"probabilities": PROBS}])

    def infer(base: str, uri: str, body: bytes, headers: Any, timeout: float) -> Any:
        answer = next(answers, None)
        if answer is None:
            raise OSError("HTTP Error 400: Bad Request")
        return answer

    monkeypatch.setattr(shadow, "_infer", infer)
    run = _Run()
    pairs = [run.pair(s, live=True) for s in (GOOD, GOOD, GOOD)]
    assert pairs[0] is None and pairs[2] is None and pairs[1] is not None
    assert run.left_out == Counter({"non-finite answer (candidate)": 1,
                                    "not answered by both versions": 1})
    agreement, rows, _ = shadow._compare([p for p in pairs if p is not None],
                                         Policy.model_validate({}))
    assert (agreement, rows) == (1.0, 1)
    golden = _Run()  # the golden rows' replay is not a live input: nothing counted
    monkeypatch.setattr(shadow, "_infer", lambda *a: nan)
    assert golden.pair(GOOD) is None and not golden.left_out
