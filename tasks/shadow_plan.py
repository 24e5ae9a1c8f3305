"""The shadow canary's plan (pure): the window, the rules it can judge, the sampled inputs.

``canary.traffic: shadow`` copies ``canary.mirror_pct`` % of live production requests,
through the traffic router, to the candidate loaded alone on the canary Triton; nginx's
``mirror`` throws the copy's answer away, so a client only ever gets production's answer.
The executor (:mod:`tasks.shadow`) does the I/O; this module decides:

- **the window** (:func:`window_action`): ``hold`` until the window is at least
  ``canary.window_s`` old, the candidate has answered ``canary.min_samples`` mirrored
  requests, as many bodies were sampled and :data:`MIN_INTERVALS` metrics intervals
  compare both arms; ``end`` then, or at ``canary.max_duration_s``
  with what it has (the gates say inconclusive on too little); ``abort`` (exit 1, the
  mirror back to 0) when the router does not answer or holds another split than the one
  set (:func:`tasks.traffic_plan.router_problem`);
- **the rules** (:func:`shadow_rules`): the candidate's answers never reach a client, so
  client-side latency rules cannot be judged; a comparative latency rule becomes the same
  tolerance on Triton's own time per request (``server_latency_ratio``, per metrics
  interval, candidate on the canary against production on the replicas over the same
  seconds) unless the policy has such a rule; absolute client-latency thresholds and
  ``throughput_ratio`` are skipped and said so; errors and agreement are judged as they are;
- **the server side** (:func:`shadow_intervals`, :func:`arm_totals`): per metrics tick,
  the candidate's counters on the canary Triton and production's summed over the replicas;
- **the sampled inputs** (:func:`parse_samples`, :func:`pick`): the gateway logs the body
  of every mirrored HTTP request (:data:`modelship.nginx.SAMPLE_FORMAT`); the executor
  sends the same bytes to production and to the candidate, versioned, and compares the
  answers with the agreement of :mod:`tasks.agreement`;
- **what is never agreement** (:func:`input_problem`, :func:`screen`,
  :func:`answer_problem`): live inputs are whatever clients sent. A body that does not
  decode as a KServe request, an input that is NaN or infinite, or a body over
  :data:`MAX_SAMPLE_BYTES` is left out before any replay, counted with its reason; an
  answer pair where either side holds a NaN or an infinity (a huge input overflowing the
  model) is left out of the agreement, counted too. Two NaN answers give the same argmax:
  counted as agreement, they would hide a broken candidate behind production's garbage.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from modelship.errors import UsageError
from modelship.policy import (
    LATENCY_METRICS,
    CanaryPolicy,
    GateRule,
    MannWhitneyRule,
    QuantileRule,
    ServerRatioRule,
)
from modelship.traffic.port import TrafficSplit
from modelship.triton.metrics import (
    COMPUTE_INFER_US,
    COMPUTE_INPUT_US,
    COMPUTE_OUTPUT_US,
    QUEUE_US,
    Scrape,
    VersionDelta,
    delta,
)
from tasks.traffic_plan import router_problem

__all__ = ["GRPC_INFER", "MAX_SAMPLE_BYTES", "MIN_INTERVALS", "ArmTotals", "SampledRequest",
           "ShadowPlan", "WindowAction", "answer_problem", "arm_totals", "grpc_as_http",
           "infer_target", "input_problem", "logged_inferences", "not_compared", "parse_samples",
           "pick", "request_inputs", "screen", "shadow_intervals", "shadow_rules",
           "versioned_uri", "window_action"]

WindowKind = Literal["hold", "end", "abort"]

#: Metrics intervals with both arms answered that a window needs before it may end early
#: (``tasks.gates.MIN_SERVER_INTERVALS`` is the server-side test's floor; not imported:
#: that module loads scipy; a unit test keeps this one at or above it).
MIN_INTERVALS = 5

#: The largest sampled body replayed on both versions (the gateway keeps at most its
#: ``client_body_buffer_size``, 1 MiB, in memory; a longer logged line is not one of its).
MAX_SAMPLE_BYTES = 1 << 20

#: Client-side metrics a shadow cannot measure: nobody receives the candidate's answers.
CLIENT_ONLY: tuple[str, ...] = (*LATENCY_METRICS, "throughput_ratio")

#: The KServe gRPC inference method, as the gateway logs a gRPC request's URI.
GRPC_INFER = "/inference.GRPCInferenceService/ModelInfer"
#: ``InferInputTensor.contents`` field per datatype (a gRPC client that sends typed
#: contents rather than ``raw_input_contents``).
_GRPC_CONTENTS = {"BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents",
                  "INT32": "int_contents", "INT64": "int64_contents",
                  "UINT8": "uint_contents", "UINT16": "uint_contents",
                  "UINT32": "uint_contents", "UINT64": "uint64_contents",
                  "FP32": "fp32_contents", "FP64": "fp64_contents"}
_INFER = re.compile(r"^/v2/models/(?P<model>[^/?]+)(?:/versions/(?P<version>[^/?]+))?"
                    r"/infer(?:\?.*)?$")
_COMPUTE = (QUEUE_US, COMPUTE_INPUT_US, COMPUTE_INFER_US, COMPUTE_OUTPUT_US)


@dataclass(frozen=True)
class ShadowPlan:
    """The shadow window, from the policy.

    Attributes:
        mirror_pct: The share of live requests copied to the candidate, in %.
        min_s: The least length of the window (``canary.window_s``).
        max_s: Its ceiling (``canary.max_duration_s``).
        min_samples: Mirrored requests the candidate must answer, and bodies to sample
            (``canary.min_samples``).
    """

    mirror_pct: float
    min_s: float
    max_s: float
    min_samples: int

    @classmethod
    def from_policy(cls, canary: CanaryPolicy) -> ShadowPlan:
        if canary.traffic != "shadow":
            raise UsageError(f"canary.traffic is {canary.traffic}, not shadow",
                             hint="set canary.traffic: shadow in the model's policy")
        return cls(canary.mirror_share_pct, canary.window_s, canary.max_duration_s,
                   canary.min_samples)

    @property
    def split(self) -> TrafficSplit:
        """What the router holds during the window: production answers every request, the
        candidate gets a copy of ``mirror_pct`` %."""
        return TrafficSplit(canary_pct=0.0, mirror_pct=self.mirror_pct)


@dataclass(frozen=True)
class WindowAction:
    """``hold``, ``end`` (judge what was measured) or ``abort`` (the router failed:
    exit 1), with one sentence for the record."""

    kind: WindowKind
    reason: str


def window_action(plan: ShadowPlan, *, elapsed_s: float, mirrored: int, sampled: int,
                  live: TrafficSplit | None, problem: str | None = None,
                  intervals: int = MIN_INTERVALS, sampling: bool = True) -> WindowAction:
    """What to do after one look at the window (pure; the rules are in the module doc).
    ``sampling``: the router keeps the mirrored bodies (the local gateway); without it
    (the Gateway API) the window waits for no samples."""
    trouble = router_problem(plan.split, live, problem)
    if trouble is not None:
        return WindowAction("abort", f"{trouble} {elapsed_s:.0f} s into the shadow window; "
                            "mirror back to 0 (an infrastructure failure, not the candidate's)")
    bodies = f"{sampled} bodies sampled" if sampling else "no bodies sampled (the router " \
        "keeps none)"
    counts = (f"{mirrored} mirrored requests answered by the candidate, {bodies}, "
              f"{intervals} metrics intervals after {elapsed_s:.0f} s")
    if elapsed_s >= plan.min_s and mirrored >= plan.min_samples \
            and (sampled >= plan.min_samples or not sampling) and intervals >= MIN_INTERVALS:
        return WindowAction("end", f"{counts}: enough ({plan.min_samples} each)")
    if elapsed_s >= plan.max_s:
        return WindowAction("end", f"{counts}: the ceiling ({plan.max_s:g} s) is reached "
                            f"with fewer than {plan.min_samples}; the gates judge what there is")
    return WindowAction("hold", counts)


# --------------------------------------------------------------------------------------
# the rules


def shadow_rules(rules: Sequence[GateRule]) -> tuple[list[GateRule], list[str]]:
    """The rules a shadow judges, and the skipped ones in words (pure).

    A comparative client-latency rule (``mann_whitney``, ``quantile``) becomes a
    ``server_latency_ratio`` rule of the same tolerance and α (named ``NAME (server)``)
    when the policy has no ``server_latency_ratio`` rule of its own; every other rule on a
    client-only metric (:data:`CLIENT_ONLY`) is skipped.
    """
    has_server = any(r.metric == "server_latency_ratio" for r in rules)
    judged: list[GateRule] = []
    skipped: list[str] = []
    for rule in rules:
        if rule.metric not in CLIENT_ONLY:
            judged.append(rule)
            continue
        if isinstance(rule, MannWhitneyRule | QuantileRule) and not has_server:
            judged.append(ServerRatioRule(
                name=f"{rule.name} (server)", metric="server_latency_ratio",
                max_increase_pct=float(rule.max_increase_pct), alpha=rule.alpha,
                dry_run=rule.dry_run))
            skipped.append(f"{rule.name}: judged as Triton's own time per request "
                           f"(server_latency_ratio, +{float(rule.max_increase_pct):g} %): the "
                           "shadow's answers never reach a client")
            continue
        skipped.append(f"{rule.name}: {rule.metric} is measured by clients, and the shadow's "
                       "answers never reach one")
    return judged, skipped


# --------------------------------------------------------------------------------------
# the server side


@dataclass(frozen=True)
class ArmTotals:
    """One arm over the window, from Triton's counters.

    Attributes:
        requests: Answered + failed requests Triton counted.
        failures: Failed requests Triton counted (not wrong-shape ones).
        us: Queue + compute µs of the answered requests.
        queue_us: Queue µs of the answered requests.
    """

    requests: int
    failures: int
    us: float
    queue_us: float

    @property
    def answered(self) -> int:
        return self.requests - self.failures

    def mean_us(self, part: str = "all") -> float | None:
        """µs per answered request (``queue`` or ``compute`` part), None without answers."""
        if self.answered <= 0:
            return None
        total = {"all": self.us, "queue": self.queue_us,
                 "compute": self.us - self.queue_us}[part]
        return total / self.answered

    def to_dict(self) -> dict[str, Any]:
        return {"requests": self.requests, "failures": self.failures,
                "queue_us_mean": self.mean_us("queue"),
                "compute_us_mean": self.mean_us("compute")}


def _change(before: Scrape | None, after: Scrape | None, model: str, version: int
            ) -> VersionDelta | None:
    if before is None or after is None:
        return None
    change = delta(before, after).get((model, str(version)))
    if change is None or change.resets or change.new:
        return None
    return change


def _totals(changes: Iterable[VersionDelta]) -> ArmTotals:
    requests = failures = 0
    us = queue = 0.0
    for change in changes:
        requests += int(change.requests + change.failures)
        failures += int(change.failures)
        us += sum(change.counters.get(name, 0.0) for name in _COMPUTE)
        queue += change.counters.get(QUEUE_US, 0.0)
    return ArmTotals(requests, failures, us, queue)


Tick = Mapping[str, Scrape | None]
"""One look's scrapes: the canary's under ``"canary"``, each replica's under its name."""


def arm_totals(first: Tick, last: Tick, *, model: str, candidate: int, baseline: int
               ) -> tuple[ArmTotals | None, ArmTotals | None]:
    """The candidate (canary) and production (every replica) over the window (pure); None
    for an arm whose counters are missing or restarted on a server (no data is never a
    zero)."""
    cand = _change(first.get("canary"), last.get("canary"), model, candidate)
    replicas = [name for name in first if name != "canary"]
    prod = [_change(first.get(n), last.get(n), model, baseline) for n in replicas]
    return (None if cand is None else _totals([cand]),
            None if not prod or any(c is None for c in prod)
            else _totals([c for c in prod if c is not None]))


def shadow_intervals(ticks: Sequence[Tick], *, model: str, candidate: int, baseline: int
                     ) -> list[dict[str, dict[str, float]]]:
    """Per interval between consecutive ticks, each arm's queue + compute µs and answers
    (``tasks.gates.server_interval_ratios``' input; pure). An interval where a server was
    not scraped or its counters restarted is left out for both arms: the ratio compares
    the same seconds or nothing."""
    out: list[dict[str, dict[str, float]]] = []
    for before, after in zip(ticks, ticks[1:], strict=False):
        cand, prod = arm_totals(before, after, model=model, candidate=candidate,
                                baseline=baseline)
        if cand is None or prod is None:
            continue
        out.append({"candidate": {"us": cand.us, "n": float(cand.answered)},
                    "baseline": {"us": prod.us, "n": float(prod.answered)}})
    return out


# --------------------------------------------------------------------------------------
# the sampled inputs


@dataclass(frozen=True)
class SampledRequest:
    """One mirrored HTTP request as the gateway logged it.

    Attributes:
        uri: Its path (``/v2/models/M[/versions/V]/infer``).
        body: Its bytes, exactly as the client sent them (JSON, or KServe's binary
            tensor extension).
        header_length: ``Inference-Header-Content-Length`` (the binary extension's JSON
            header), None for a JSON body.
        content_type: Its ``Content-Type``.
    """

    uri: str
    body: bytes
    header_length: int | None
    content_type: str = ""

    def headers(self) -> dict[str, str]:
        """The headers that say how to read the body."""
        out = {"Content-Type": self.content_type or "application/json"}
        if self.header_length is not None:
            out["Inference-Header-Content-Length"] = str(self.header_length)
        return out


@dataclass
class Sampled:
    """What :func:`parse_samples` found: the requests of the model and why others were
    left out (``other model``, ``not an inference``, ``body not in memory``, ``unreadable
    line``)."""

    requests: list[SampledRequest] = field(default_factory=list)
    left_out: Counter[str] = field(default_factory=Counter)


def infer_target(uri: str) -> tuple[str, str | None] | None:
    """``(model, version or None)`` of a KServe v2 inference path; None otherwise."""
    found = _INFER.match(uri)
    if found is None:
        return None
    return found.group("model"), found.group("version")


def versioned_uri(model: str, version: int) -> str:
    """The inference path of one version: the sampled input goes to exactly it."""
    return f"/v2/models/{model}/versions/{version}/infer"


def parse_samples(lines: Iterable[bytes], model: str) -> Sampled:
    """The mirrored requests of ``model`` in the gateway's sample log (pure).

    Each line is one JSON object (:data:`modelship.nginx.SAMPLE_FORMAT`, ``escape=json``):
    decoded as ``latin-1``, so the body's raw bytes come back byte for byte."""
    found = Sampled()
    for line in lines:
        if not line.strip():
            continue
        try:
            doc = json.loads(line.decode("latin-1"))
            uri, body = str(doc["uri"]), str(doc["body"]).encode("latin-1")
            length = str(doc.get("header_length") or "")
        except (ValueError, KeyError, TypeError, UnicodeEncodeError):
            found.left_out["unreadable line"] += 1
            continue
        if uri == GRPC_INFER:  # a mirrored gRPC inference: the model is inside the body
            if not body:
                found.left_out["body not in memory (larger than the gateway's buffer)"] += 1
                continue
            converted = grpc_as_http(body, model)
            if isinstance(converted, str):
                found.left_out[converted] += 1
            else:
                found.requests.append(converted)
            continue
        target = infer_target(uri)
        if target is None:
            found.left_out["not an inference"] += 1
        elif target[0] != model:
            found.left_out["other model"] += 1
        elif not body:
            found.left_out["body not in memory (larger than the gateway's buffer)"] += 1
        elif len(body) > MAX_SAMPLE_BYTES:
            found.left_out[f"body over the sample limit ({MAX_SAMPLE_BYTES} bytes)"] += 1
        else:
            found.requests.append(SampledRequest(
                uri, body, int(length) if length.isdigit() else None,
                str(doc.get("content_type") or "")))
    return found


def grpc_as_http(body: bytes, model: str) -> SampledRequest | str:
    """A mirrored KServe gRPC ``ModelInfer`` call, as the gateway logged its body (the
    5-byte gRPC frame, then a ``ModelInferRequest`` protobuf), turned into the KServe HTTP
    binary request with the same input tensors (pure), so it is replayed on both versions
    like an HTTP sample; or why it is left out (``other model``, a compressed or
    unreadable message). The inputs' bytes are carried as they are: ``raw_input_contents``
    is the HTTP binary extension's layout, typed ``contents`` are packed little-endian."""
    from google.protobuf.message import DecodeError
    from tritonclient.grpc import service_pb2  # lazy: only a gRPC sample needs the protos

    if len(body) < 5:
        return "unreadable gRPC body (no gRPC frame)"
    if body[0] != 0:
        return "compressed gRPC message (not decoded)"
    size = int.from_bytes(body[1:5], "big")
    if size != len(body) - 5:
        return "unreadable gRPC body (frame length)"
    try:
        request = service_pb2.ModelInferRequest.FromString(body[5:])
    except DecodeError:
        return "unreadable gRPC body (not a ModelInferRequest)"
    if request.model_name != model:
        return "other model"
    raws = list(request.raw_input_contents)
    if raws and len(raws) != len(request.inputs):
        return "unreadable gRPC body (raw contents do not match the inputs)"
    inputs: list[dict[str, Any]] = []
    chunks: list[bytes] = []
    for index, tensor in enumerate(request.inputs):
        kind = tensor.datatype
        if raws:
            raw = raws[index]
        elif kind in _GRPC_CONTENTS and kind in _DTYPES:
            values = getattr(tensor.contents, _GRPC_CONTENTS[kind])
            raw = np.asarray(list(values)).astype(_DTYPES[kind]).tobytes()
        else:
            return f"unreadable gRPC body (input {tensor.name!r}: {kind} without raw bytes)"
        inputs.append({"name": tensor.name, "shape": [int(d) for d in tensor.shape],
                       "datatype": kind, "parameters": {"binary_data_size": len(raw)}})
        chunks.append(raw)
    if not inputs:
        return "unreadable gRPC body (no inputs)"
    header: dict[str, Any] = {"inputs": inputs}
    if request.outputs:
        header["outputs"] = [{"name": o.name} for o in request.outputs]
    head = json.dumps(header, separators=(",", ":")).encode()
    return SampledRequest(f"/v2/models/{model}/infer", head + b"".join(chunks), len(head),
                          "application/octet-stream")


#: The reasons :func:`parse_samples` gives to a mirrored inference of the model whose body
#: was logged but not kept (the line is still one mirrored inference of the model).
_BODY_REASONS = ("body not in memory", "body over the sample limit", "compressed gRPC",
                 "unreadable gRPC")


def logged_inferences(found: Sampled) -> int:
    """Mirrored inferences of the model (HTTP or gRPC) the gateway logged (pure): the
    sampled ones and those left out for their body; lines of other models, other paths or
    unreadable lines are not counted."""
    return len(found.requests) + sum(n for why, n in found.left_out.items()
                                     if why.startswith(_BODY_REASONS))


def not_compared(mirrored: int, found: Sampled | None) -> dict[str, Any]:
    """The mirrored requests whose bodies no one could compare, and why (pure).

    ``found`` None: the router keeps no bodies (the Gateway API): every mirrored request is
    judged on Triton's counters only. Else the requests Triton counted on the candidate
    beyond the inferences the gateway logged (HTTP and gRPC ``ModelInfer``: other gRPC
    methods such as streaming inference are not logged); both counts come from the same
    window, so a few requests in flight at its edges can move it by a little."""
    if found is None:
        return {"requests": mirrored, "why": "the Gateway API router keeps no copy of the "
                "mirrored bodies: mirrored requests are judged on Triton's counters only "
                "(latency, errors); agreement on the golden rows"}
    unlogged = max(0, mirrored - logged_inferences(found))
    return {"requests": unlogged, "why": "mirrored requests whose body the gateway did not "
            "log (gRPC streaming inference, or requests at the window's edges): judged on "
            "Triton's counters only"}


def pick(items: Sequence[Any], n: int) -> list[Any]:
    """At most ``n`` of ``items``, evenly spread over the window (pure; all when fewer)."""
    if n <= 0:
        return []
    if len(items) <= n:
        return list(items)
    step = len(items) / n
    return [items[int(i * step)] for i in range(n)]


# --------------------------------------------------------------------------------------
# what is never agreement

#: KServe v2 datatypes as numpy dtypes (little-endian, as the binary extension sends them).
_DTYPES = {"BOOL": "?", "INT8": "<i1", "INT16": "<i2", "INT32": "<i4", "INT64": "<i8",
           "UINT8": "<u1", "UINT16": "<u2", "UINT32": "<u4", "UINT64": "<u8",
           "FP16": "<f2", "FP32": "<f4", "FP64": "<f8"}


def request_inputs(sample: SampledRequest) -> dict[str, np.ndarray]:
    """The numeric input tensors of a KServe v2 request body (pure): its JSON header, and
    for each input its ``data`` or its binary extension's bytes (in the inputs' order after
    the header). ``BYTES`` inputs are not numbers and are left out.

    Raises:
        ValueError: the body is not such a request (with what is wrong).
    """
    body = sample.body
    cut = sample.header_length if sample.header_length is not None else len(body)
    if not 0 < cut <= len(body):
        raise ValueError(f"header length {sample.header_length} outside a {len(body)}-byte "
                         "body")
    try:
        doc = json.loads(body[:cut].decode("utf-8"))
        inputs = doc["inputs"]
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
        raise ValueError(f"no JSON inference header ({type(exc).__name__})") from exc
    if not isinstance(inputs, list) or not inputs:
        raise ValueError("no inputs")
    out: dict[str, np.ndarray] = {}
    offset = cut
    for item in inputs:
        if not isinstance(item, dict):
            raise ValueError("an input is not an object")
        name, kind = str(item.get("name", "")), str(item.get("datatype", ""))
        shape = item.get("shape")
        if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0
                                                   for d in shape):
            raise ValueError(f"input {name!r}: no shape")
        size = int((item.get("parameters") or {}).get("binary_data_size", -1))
        raw = body[offset:offset + size] if size >= 0 else None
        offset += max(size, 0)
        if kind not in _DTYPES:
            if kind != "BYTES":
                raise ValueError(f"input {name!r}: unknown datatype {kind!r}")
            continue
        if raw is not None:
            if len(raw) != size or size % np.dtype(_DTYPES[kind]).itemsize:
                raise ValueError(f"input {name!r}: {len(raw)} of {size} binary bytes")
            array = np.frombuffer(raw, dtype=_DTYPES[kind])
        elif "data" in item:
            array = np.asarray(item["data"], dtype=np.float64 if kind.startswith("FP")
                               else _DTYPES[kind]).ravel()
        else:
            raise ValueError(f"input {name!r}: neither data nor binary bytes")
        if array.size != math.prod(shape):
            raise ValueError(f"input {name!r}: {array.size} values for shape {shape}")
        out[name] = array.reshape(shape)
    if offset != len(body) and sample.header_length is not None:
        raise ValueError(f"{len(body) - offset} bytes after the last input")
    return out


def input_problem(sample: SampledRequest) -> str | None:
    """Why a sampled input cannot be judged on agreement, or None (pure, never raises):
    a body that is not a KServe request, or an input with a NaN or an infinity."""
    try:
        inputs = request_inputs(sample)
    except (ValueError, OverflowError, TypeError) as exc:
        return f"malformed body ({str(exc)[:80]})"
    for array in inputs.values():
        if array.dtype.kind == "f" and not np.isfinite(array).all():
            return "non-finite input (NaN or inf)"
    return None


def screen(requests: Iterable[SampledRequest]
           ) -> tuple[list[SampledRequest], Counter[str]]:
    """The sampled requests that can be replayed and compared, and the others counted by
    reason (:func:`input_problem`; pure)."""
    kept: list[SampledRequest] = []
    left_out: Counter[str] = Counter()
    for sample in requests:
        why = input_problem(sample)
        if why is None:
            kept.append(sample)
        else:
            left_out[why.split(" (", 1)[0] if why.startswith("malformed") else why] += 1
    return kept, left_out


def answer_problem(candidate: Mapping[str, Any], production: Mapping[str, Any]
                   ) -> str | None:
    """Why an answer pair is left out of the agreement, or None (pure): a NaN or an
    infinity in any floating output of either version (a huge input overflowing the
    model, or a broken one); two such answers agreeing says nothing."""
    for who, outputs in (("candidate", candidate), ("production", production)):
        for value in outputs.values():
            array = np.asarray(value)
            if array.dtype.kind == "f" and not np.isfinite(array).all():
                return f"non-finite answer ({who})"
    return None
