"""The per-model release policy: one YAML file per model, validated strictly.

A policy holds every knob of a release that may differ between models: the Triton config,
export tolerances, data expectations, the canary load, the gates, approval, the swap,
staging and notifications. Without a file the documented defaults apply (they suit the
embedded CPU stack).

Every section forbids unknown keys. A misspelt gate bound that silently fell back to its
default is how a bad model ships, so a typo is an error that names the file and the dotted
key path (``policies/fraud.yaml: unknown key 'gates.0.mxa'``).

::

    Policy
    ├── triton          TritonPolicy         max_batch_size, dynamic_batching, instance_group,
    │                                        gpu (accelerators, warmup, swap headroom)
    ├── export          ExportPolicy         opsets, parity tolerances, golden rows
    ├── validation      ValidationPolicy     input expectations, output checks, class mix
    ├── canary          CanaryPolicy         load shape, windows, agreement, traffic mode
    │                                        (replay, shadow, progressive steps)
    ├── gates           list[GateRule]       the rules the canary is judged by, one class
    │                                        per test (a union discriminated on ``test``)
    ├── approval        ApprovalPolicy       required, approvers, timeout
    ├── swap            SwapPolicy           pause_batching, deadline
    ├── staging         StagingPolicy        retention, multipart sizes
    └── notifications   NotificationsPolicy  Slack channel

Lists replace their default rather than merging with it: a ``gates:`` list in a file is the
whole rule set.
"""

from __future__ import annotations

import difflib
import json
import types
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, TypeAlias, Union, get_args, get_origin

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)

from modelship.errors import PolicyError

__all__ = [
    "DEFAULT_MIRROR_PCT",
    "DEFAULT_STEPS",
    "DEFAULT_STEP_MAX_S",
    "DEFAULT_STEP_MIN_S",
    "FAMILY_ALPHA",
    "GPU_METRICS",
    "KNOWN_METRICS",
    "LATENCY_METRICS",
    "TAIL_LATENCY_METRICS",
    "TYPICAL_LATENCY_METRICS",
    "AgreementPolicy",
    "ApprovalPolicy",
    "CanaryPolicy",
    "CanaryTraffic",
    "ColumnExpectation",
    "DynamicBatchingPolicy",
    "ExportPolicy",
    "ExactRateRule",
    "GateRule",
    "GateTest",
    "MannWhitneyRule",
    "QuantileRule",
    "ServerRatioRule",
    "ThresholdRule",
    "GpuPolicy",
    "InputExpectations",
    "InstanceGroupPolicy",
    "NotificationsPolicy",
    "OutputChecks",
    "ParityPolicy",
    "Policy",
    "StagingPolicy",
    "SwapPolicy",
    "Target",
    "TensorRTPolicy",
    "TritonPolicy",
    "ValidationPolicy",
    "WarmupPolicy",
    "default_gates",
    "gate_rule",
    "infer_test",
    "load_policy",
    "policy_for",
    "policy_reference_markdown",
    "traffic_problems",
]

Target = Literal["cpu", "gpu"]
"""Where the model is served: the embedded stack is ``cpu``, the production fleet ``gpu``."""

MiB = 1024 * 1024


class _Section(BaseModel):
    """Base of every policy section: unknown keys are errors, assignments are validated, and
    no number may be NaN or infinite (``min: .nan`` would make a gate that never fails)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, validate_default=True,
                              allow_inf_nan=False)


# --------------------------------------------------------------------------------------
# triton


class DynamicBatchingPolicy(_Section):
    """Triton's dynamic batcher: merges concurrent requests into one model execution."""

    enabled: bool = Field(
        default=True,
        description="Let Triton merge concurrent requests into one batch. `true` or `false`. "
        "Default `true`; needs `triton.max_batch_size` > 0.",
    )
    preferred_batch_sizes: list[Annotated[int, Field(gt=0)]] = Field(
        default_factory=list,
        description="Batch sizes the scheduler tries to form, each in 1..`max_batch_size`. "
        "Default `[]`: Triton then prefers `max_batch_size`.",
    )
    max_queue_delay_us: int = Field(
        default=100,
        ge=0,
        description="How long a request may wait for a batch to fill, in µs. Integer ≥ 0. "
        "Default 100.",
    )


class InstanceGroupPolicy(_Section):
    """How many model instances Triton runs and on which device."""

    kind: Literal["auto", "cpu", "gpu"] = Field(
        default="auto",
        description="Device of the instances: `auto` (follow `triton.target`), `cpu` or `gpu`. "
        "Default `auto`.",
    )
    count: int = Field(
        default=1,
        ge=1,
        le=64,
        description="Instances per device. Integer 1..64. Default 1.",
    )
    gpus: list[Annotated[int, Field(ge=0)]] | None = Field(
        default=None,
        description="GPU device ids the instances run on (`count` instances on each), GPU "
        "instances only. List of integers ≥ 0, or `null` for every GPU the pod sees. "
        "Default `null`.",
    )

    @field_validator("gpus")
    @classmethod
    def _distinct_gpus(cls, gpus: list[int] | None) -> list[int] | None:
        if gpus is not None and (not gpus or len(set(gpus)) != len(gpus)):
            raise ValueError("gpus must be a non-empty list of distinct device ids, or null")
        return gpus


class TensorRTPolicy(_Section):
    """ONNX Runtime's TensorRT execution provider (``accelerator: tensorrt``)."""

    precision: Literal["FP32", "FP16", "INT8"] = Field(
        default="FP16",
        description="TensorRT precision mode. `FP32`, `FP16` or `INT8` (INT8 needs a "
        "calibrated graph). Default `FP16`; export parity is checked in FP32, so keep the "
        "canary's agreement gate on.",
    )
    max_workspace_bytes: int = Field(
        default=1024 * MiB,
        ge=16 * MiB,
        description="Scratch GPU memory TensorRT may use while building and running an "
        "engine, bytes. Integer ≥ 16 MiB. Default 1073741824 (1 GiB); it counts in the swap's "
        "GPU headroom.",
    )
    engine_cache: bool = Field(
        default=True,
        description="Cache built engines in the pod's scratch dir so a reload of the same "
        "version skips the build. `true` or `false`. Default `true`.",
    )


class WarmupPolicy(_Section):
    """``model_warmup``: requests Triton runs before it reports a GPU model ready."""

    enabled: bool = Field(
        default=True,
        description="Render `model_warmup` on the GPU target, so TensorRT engines and CUDA "
        "allocations happen before the model is ready rather than on the first requests. "
        "`true` or `false`. Default `true`. Never rendered on the CPU target.",
    )
    data: Literal["zero", "random"] = Field(
        default="zero",
        description="What the warmup tensors hold: `zero` or `random`. Default `zero`. Their "
        "shapes come from the golden rows (batch size and variable dims).",
    )
    count: int = Field(
        default=1,
        ge=1,
        le=100,
        description="Times each warmup sample runs. Integer 1..100. Default 1.",
    )


class GpuPolicy(_Section):
    """What the GPU rendering adds: ONNX Runtime accelerators, warmup, swap headroom."""

    accelerator: Literal["cuda", "tensorrt", "none"] = Field(
        default="cuda",
        description="ONNX Runtime execution accelerator on GPU instances: `cuda` (the CUDA "
        "provider), `tensorrt` (TensorRT engines, see `tensorrt`), or `none` (the backend's "
        "default, CUDA). Default `cuda`.",
    )
    tensorrt: TensorRTPolicy = Field(
        default_factory=TensorRTPolicy,
        description="TensorRT settings, used when `accelerator` is `tensorrt`.",
    )
    warmup: WarmupPolicy = Field(
        default_factory=WarmupPolicy,
        description="Warmup settings (see the keys below).",
    )
    headroom_bytes: int = Field(
        default=256 * MiB,
        ge=0,
        description="Free GPU memory that must remain on every replica with the candidate "
        "loaded next to production, bytes (the swap preflight). Integer ≥ 0. Default "
        "268435456 (256 MiB).",
    )


class TritonPolicy(_Section):
    """The knobs of the rendered Triton model config."""

    target: Target = Field(
        default="cpu",
        description="Where the model is served: `cpu` (the embedded stack) or `gpu` (the "
        "production fleet). Default `cpu`.",
    )
    backend: str = Field(
        default="onnxruntime",
        min_length=1,
        description="Triton backend name. Default `onnxruntime` (the C++ backend on GPUs, the "
        "Python-based one on the local CPU stack; the same config works on both).",
    )
    max_batch_size: int = Field(
        default=32,
        ge=0,
        description="Largest batch Triton may form; 0 turns batching off and then the dims "
        "include the batch dimension. Integer ≥ 0. Default 32.",
    )
    dynamic_batching: DynamicBatchingPolicy = Field(
        default_factory=DynamicBatchingPolicy,
        description="Dynamic batcher settings (see the keys below).",
    )
    instance_group: InstanceGroupPolicy = Field(
        default_factory=InstanceGroupPolicy,
        description="Instance group settings (see the keys below).",
    )
    gpu: GpuPolicy = Field(
        default_factory=GpuPolicy,
        description="GPU rendering settings (see the keys below); used on the `gpu` target.",
    )

    @model_validator(mode="after")
    def _consistent(self) -> TritonPolicy:
        batching = self.dynamic_batching
        if batching.enabled and self.max_batch_size == 0:
            raise ValueError(
                "dynamic_batching.enabled needs max_batch_size > 0 (Triton accepts the pair "
                "and then every request fails); set max_batch_size or disable batching"
            )
        too_big = [n for n in batching.preferred_batch_sizes if n > self.max_batch_size]
        if batching.enabled and too_big:
            raise ValueError(
                f"dynamic_batching.preferred_batch_sizes {too_big} exceed max_batch_size "
                f"{self.max_batch_size}"
            )
        if self.instance_group.kind == "gpu" and self.target == "cpu":
            raise ValueError(
                "instance_group.kind 'gpu' cannot run on target 'cpu'; use kind 'auto' or "
                "target 'gpu'"
            )
        if self.instance_group.gpus is not None and self.instance_group.kind == "cpu":
            raise ValueError("instance_group.gpus needs GPU instances; drop it or use kind "
                             "'auto' or 'gpu'")
        return self


# --------------------------------------------------------------------------------------
# export


class ParityPolicy(_Section):
    """How close ONNX Runtime must be to the native model: |a - b| <= atol + rtol * |b|."""

    atol: float = Field(
        default=1e-4,
        ge=0,
        description="Absolute tolerance of the ONNX-vs-native parity check. Float ≥ 0. "
        "Default 1e-4.",
    )
    rtol: float = Field(
        default=1e-3,
        ge=0,
        description="Relative tolerance of the parity check. Float ≥ 0. Default 1e-3.",
    )


class ExportPolicy(_Section):
    """Export to ONNX: the opset window and the parity check."""

    max_opset: int = Field(
        default=21,
        ge=7,
        description="Highest ONNX opset accepted; newer graphs are rejected because the "
        "serving runtime may not implement them. Integer ≥ 7. Default 21.",
    )
    min_opset: int | None = Field(
        default=None,
        ge=7,
        description="Lowest ONNX opset accepted. Integer ≥ 7, or `null` for no floor. "
        "Default `null`.",
    )
    target_opset: int = Field(
        default=17,
        ge=7,
        description="Opset that skl2onnx converts sklearn models to. Integer within "
        "[`min_opset`, `max_opset`]. Default 17.",
    )
    parity: ParityPolicy = Field(
        default_factory=ParityPolicy,
        description="Parity tolerances (see the keys below).",
    )
    golden_max_rows: int = Field(
        default=1000,
        ge=1,
        description="Cap on the golden input rows used for parity, validation and canary "
        "replay. Integer ≥ 1. Default 1000.",
    )
    allow_synthetic_golden: bool = Field(
        default=True,
        description="When the MLflow run logged no input example, synthesise golden rows from "
        "the signature. `true` or `false`. Default `true`; `false` rejects such models.",
    )

    @model_validator(mode="after")
    def _opset_window(self) -> ExportPolicy:
        low = self.min_opset if self.min_opset is not None else self.target_opset
        if not low <= self.target_opset <= self.max_opset:
            raise ValueError(
                f"target_opset {self.target_opset} must lie within [min_opset "
                f"{self.min_opset}, max_opset {self.max_opset}]"
            )
        return self


# --------------------------------------------------------------------------------------
# validation


class ColumnExpectation(_Section):
    """Expectations for one input column of the golden data."""

    min: float | None = Field(
        default=None,
        description="Smallest allowed value. Number or `null` (no bound). Default `null`.",
    )
    max: float | None = Field(
        default=None,
        description="Largest allowed value. Number or `null` (no bound). Default `null`.",
    )
    not_null: bool | None = Field(
        default=None,
        description="Reject nulls/NaN in this column. `true`, `false`, or `null` to follow "
        "`validation.inputs.not_null`. Default `null`.",
    )

    @model_validator(mode="after")
    def _ordered(self) -> ColumnExpectation:
        if self.min is not None and self.max is not None and self.min > self.max:
            raise ValueError(f"min {self.min} is greater than max {self.max}")
        return self


class InputExpectations(_Section):
    """Great Expectations checks on the golden inputs (types always come from the signature)."""

    not_null: bool = Field(
        default=True,
        description="Reject nulls/NaN in every input column unless a column says otherwise. "
        "`true` or `false`. Default `true`.",
    )
    columns: dict[str, ColumnExpectation] = Field(
        default_factory=dict,
        description="Per-column expectations, keyed by input column name. Default `{}`.",
    )


def _auto_or_names(value: Any) -> Any:
    if value == "auto" or (isinstance(value, list) and all(isinstance(v, str) for v in value)):
        return value
    raise ValueError(f"expected 'auto' or a list of output names, got {value!r}")


class OutputChecks(_Section):
    """Checks on the model's outputs for the golden inputs.

    NaN and infinity are always rejected in every output; that is not configurable.
    """

    probabilities: Annotated[
        Literal["auto"] | list[str], BeforeValidator(_auto_or_names)
    ] = Field(
        default="auto",
        description="Outputs holding class probabilities, checked to lie in [0, 1] and sum to "
        "1 per row: `auto` (float outputs named like `prob*` with one column per class), a "
        "list of output names, or `[]` for none. Default `auto`.",
    )
    sum_tolerance: float = Field(
        default=1e-3,
        ge=0,
        description="Allowed |sum - 1| of each probability row, and how far a probability "
        "may lie outside [0, 1] (float32 rounding: tree ensembles exported to ONNX answer "
        "-3.6e-07). Float ≥ 0. Default 1e-3.",
    )


class ValidationPolicy(_Section):
    """The contract, breaking-change and data checks of the validate stage."""

    inputs: InputExpectations = Field(
        default_factory=InputExpectations,
        description="Input expectations (see the keys below).",
    )
    outputs: OutputChecks = Field(
        default_factory=OutputChecks,
        description="Output checks (see the keys below).",
    )
    allow_breaking_changes: bool = Field(
        default=False,
        description="Accept a change of input/output names, dtypes or dims against the "
        "production version. `true` or `false`. Default `false`.",
    )
    max_class_share: float | None = Field(
        default=None,
        gt=0,
        le=1,
        description="Largest share of golden rows one predicted class may take (a sanity check "
        "on the class mix). Float in (0, 1], or `null` for no check. Default `null`.",
    )


# --------------------------------------------------------------------------------------
# canary


class AgreementPolicy(_Section):
    """When candidate and baseline outputs count as agreeing on the same input."""

    kind: Literal["auto", "classifier", "regressor"] = Field(
        default="auto",
        description="`classifier` (same predicted label), `regressor` (values within "
        "tolerance) or `auto` (classifier when the model has a label or probability "
        "output). Default `auto`.",
    )
    regressor_rel_tol: float = Field(
        default=0.05,
        ge=0,
        description="Regressor agreement: |c - b| <= regressor_abs_tol + regressor_rel_tol * "
        "|b|. Two versions are different models, so this is a release tolerance, not the "
        "export's parity one: at 1e-3 even a retrained linear model agreed on under 20% of "
        "rows. Float ≥ 0. Default 0.05.",
    )
    regressor_abs_tol: float = Field(
        default=1e-6,
        ge=0,
        description="Absolute part of the regressor tolerance, so values near 0 can agree. "
        "Float ≥ 0. Default 1e-6.",
    )


CanaryTraffic = Literal["replay", "shadow", "progressive"]
"""What a canary judges the candidate on: golden rows, mirrored live requests, or a share
of live requests it answers."""

#: The defaults of the traffic modes (a ``null`` key under its own mode).
DEFAULT_MIRROR_PCT = 10.0
DEFAULT_STEPS: tuple[float, ...] = (1.0, 5.0, 25.0, 50.0)
DEFAULT_STEP_MIN_S = 10.0
DEFAULT_STEP_MAX_S = 60.0


class CanaryPolicy(_Section):
    """The canary: the replay load run against candidate and baseline side by side, or
    live traffic through the router (``traffic``)."""

    mode: Literal["concurrency", "rate"] = Field(
        default="concurrency",
        description="Load shape: `concurrency` (a fixed number of requests in flight) or "
        "`rate` (a fixed request rate). Default `concurrency`.",
    )
    concurrency: int = Field(
        default=4,
        ge=1,
        description="Requests in flight per version in `concurrency` mode. Integer ≥ 1. "
        "Default 4 (the local stack has 2 cores).",
    )
    rate_rps: float = Field(
        default=200.0,
        gt=0,
        description="Requests per second per version in `rate` mode. Float > 0. Default 200.",
    )
    poisson: bool = Field(
        default=False,
        description="In `rate` mode, send with Poisson (exponential) gaps instead of constant "
        "ones. `true` or `false`. Default `false`.",
    )
    protocol: Literal["http", "grpc"] = Field(
        default="http",
        description="Inference protocol of the load: `http` or `grpc`. Default `http`. Both "
        "transports of the load generator are written for the client's CPU (keep-alive HTTP/1.1; "
        "gRPC as prebuilt HTTP/2 frames) and cost about the same, ~70-120 µs of client CPU per "
        "request at concurrency 16, at perf_analyzer's throughput or above (bench/loadgen).",
    )
    warmup_s: float = Field(
        default=2.0,
        ge=0,
        description="Seconds of load discarded before measuring. Float ≥ 0. Default 2.",
    )
    window_s: float = Field(
        default=5.0,
        gt=0,
        description="Length of one measurement window, in s. Float > 0. Default 5.",
    )
    stability_pct: float = Field(
        default=10.0,
        gt=0,
        le=100,
        description="Windows count as stable when their throughput and p99 latency differ "
        "by at most this percentage. Float in (0, 100]. Default 10.",
    )
    max_duration_s: float = Field(
        default=60.0,
        gt=0,
        description="Hard cap on the whole canary run, in s; reaching it before enough "
        "samples makes the gates inconclusive. Float > 0. Default 60.",
    )
    min_samples: int = Field(
        default=2000,
        ge=1,
        description="Floor on requests per version, whatever the computed sample size says. "
        "Integer ≥ 1. Default 2000.",
    )
    sequential: bool = Field(
        default=False,
        description="Watch the canary with always-valid sequential tests (tasks.sequential: "
        "mixture e-processes on counts deflated by the variance inflation measured from the "
        "looks, each look a time block) in rounds of `sequential_round_s`: stop as soon as a "
        "latency or error regression is certain (verdict `failed`), or, once `min_samples` "
        "are in, as soon as a confidence sequence shows every latency and error rule within "
        "its tolerance (at each rule's `power`). The watch spends a fifth of each of those "
        "rules' α and the fixed tests the rest, so the family-wise α is spent once. "
        "`true` or `false`. Default `false` (one fixed-horizon judgement).",
    )
    sequential_round_s: float = Field(
        default=1.0,
        gt=0,
        description="Length of one look of the sequential watch, in s. Float > 0. Default 1.",
    )
    agreement: AgreementPolicy = Field(
        default_factory=AgreementPolicy,
        description="Output agreement settings (see the keys below).",
    )
    traffic: CanaryTraffic = Field(
        default="replay",
        description="What the candidate is judged on. `replay`: golden rows sent to the "
        "canary Triton (the load keys above). `shadow`: a copy of `mirror_pct` % of live "
        "requests goes to the candidate through the router; its answers are compared with "
        "production's and thrown away, never sent to a client. `progressive`: the "
        "candidate answers a growing share of live requests, weight by weight (`steps`), "
        "the sequential judge between steps, back to 0 % on a breach, then the atomic swap "
        "of the fleet. Shadow and progressive need a traffic router (the stack's gateway, "
        "or `MODELSHIP_K8S_ROUTE`). Default `replay`.",
    )
    mirror_pct: float | None = Field(
        default=None,
        gt=0,
        le=100,
        description="`shadow` only: the share of live requests copied to the candidate, in "
        f"%. Float in (0, 100], or `null`: {DEFAULT_MIRROR_PCT:g} under `shadow`. "
        "Refused with another `traffic`. Default `null`.",
    )
    steps: list[float] | None = Field(
        default=None,
        description="`progressive` only: the candidate's share of live requests at each "
        "step, in %, strictly increasing, each in (0, 100) (after the last step the atomic "
        "swap moves the whole fleet; a step of 100 would bypass it). `null`: "
        f"{list(DEFAULT_STEPS)} under `progressive`. Refused with another `traffic`. "
        "Default `null`.",
    )
    step_min_s: float | None = Field(
        default=None,
        gt=0,
        description="`progressive` only: the least time a step's weight is live before it "
        "may advance, in s (a breach steps back at once). Float > 0, or `null`: "
        f"{DEFAULT_STEP_MIN_S:g} under `progressive`. Refused with another `traffic`. "
        "Default `null`.",
    )
    step_max_s: float | None = Field(
        default=None,
        gt=0,
        description="`progressive` only: a step's ceiling, in s: a step that has neither "
        "passed nor breached by then advances (no evidence against it, and the next weight "
        "brings more); at the last step it ends the canary inconclusive (weight back to 0, "
        "no swap). Float > 0 and ≥ `step_min_s`, or `null`: "
        f"{DEFAULT_STEP_MAX_S:g} under `progressive`. Refused with another `traffic`. "
        "Default `null`.",
    )

    @model_validator(mode="after")
    def _fits(self) -> CanaryPolicy:
        if self.warmup_s + self.window_s > self.max_duration_s:
            raise ValueError(
                f"warmup_s + window_s ({self.warmup_s + self.window_s:g} s) exceed "
                f"max_duration_s ({self.max_duration_s:g} s)"
            )
        problems = traffic_problems(self)
        if problems:
            raise ValueError("; ".join(problems))
        return self

    @property
    def mirror_share_pct(self) -> float:
        """The share mirrored under ``shadow`` (0 otherwise)."""
        if self.traffic != "shadow":
            return 0.0
        return DEFAULT_MIRROR_PCT if self.mirror_pct is None else self.mirror_pct

    @property
    def progressive_steps(self) -> tuple[float, ...]:
        """The weights of ``progressive``, in order (empty otherwise)."""
        if self.traffic != "progressive":
            return ()
        return DEFAULT_STEPS if self.steps is None else tuple(self.steps)

    @property
    def step_bounds_s(self) -> tuple[float, float]:
        """``(minimum, ceiling)`` of one progressive step, in s."""
        low = DEFAULT_STEP_MIN_S if self.step_min_s is None else self.step_min_s
        high = DEFAULT_STEP_MAX_S if self.step_max_s is None else self.step_max_s
        return low, high


_ONLY_WITH: dict[str, CanaryTraffic] = {"mirror_pct": "shadow", "steps": "progressive",
                                        "step_min_s": "progressive",
                                        "step_max_s": "progressive"}


def traffic_problems(canary: CanaryPolicy) -> list[str]:
    """What is incoherent in the canary's traffic keys, each naming its key (pure; empty
    when coherent). A key of another mode is refused, never ignored: a policy that says
    `mirror_pct: 5` under `replay` would otherwise promise a shadow it never runs."""
    problems = [f"canary.{key} is only read with canary.traffic: {mode} (traffic is "
                f"{canary.traffic}); remove it, or set traffic: {mode}"
                for key, mode in _ONLY_WITH.items()
                if getattr(canary, key) is not None and canary.traffic != mode]
    if canary.steps is not None:
        steps = canary.steps
        if not steps:
            problems.append("canary.steps is empty; give at least one weight, e.g. "
                            f"{list(DEFAULT_STEPS)}, or remove it for the default")
        outside = [s for s in steps if not 0 < s < 100]
        if outside:
            problems.append(f"canary.steps {steps}: each weight must be in (0, 100) %; "
                            f"{outside} is not (the atomic swap moves the fleet after the "
                            "last step)")
        if any(b <= a for a, b in zip(steps, steps[1:], strict=False)):
            problems.append(f"canary.steps {steps} must strictly increase (a step back to 0 "
                            "is what a breach does, never a planned step)")
    if canary.step_min_s is not None and canary.step_max_s is not None \
            and canary.step_min_s > canary.step_max_s:
        problems.append(f"canary.step_min_s ({canary.step_min_s:g} s) exceeds "
                        f"canary.step_max_s ({canary.step_max_s:g} s); a step's minimum "
                        "must fit under its ceiling")
    return problems


# --------------------------------------------------------------------------------------
# gates

LATENCY_METRICS: tuple[str, ...] = (
    "latency_p50_ms",
    "latency_p90_ms",
    "latency_p95_ms",
    "latency_p99_ms",
    "latency_mean_ms",
)

KNOWN_METRICS: dict[str, str] = {
    "latency_p50_ms": "client-side median latency of the candidate, ms",
    "latency_p90_ms": "client-side 90th percentile latency of the candidate, ms",
    "latency_p95_ms": "client-side 95th percentile latency of the candidate, ms",
    "latency_p99_ms": "client-side 99th percentile latency of the candidate, ms",
    "latency_mean_ms": "client-side mean latency of the candidate, ms",
    "error_rate": "failed / sent requests of the candidate, fraction in [0, 1]",
    "agreement": "share of inputs where candidate and baseline outputs agree, in [0, 1]",
    "throughput_ratio": "candidate / baseline requests per second under the same load",
    "queue_us_mean": "server-side mean queue time per request of the candidate, µs",
    "compute_us_mean": "server-side mean compute time per request of the candidate, µs",
    "server_latency_ratio": "candidate / baseline Triton queue + compute µs per request, "
    "measured on the canary server at the same time (no client overhead)",
    "gpu_memory_growth_pct": "GPU memory the candidate takes over the baseline's, % of the "
    "baseline's (the rise of nv_gpu_memory_used_bytes as each loads on the canary GPU)",
    "gpu_memory_candidate_bytes": "GPU memory the candidate took when it loaded on the "
    "canary GPU, bytes per GPU",
    "gpu_utilization": "mean nv_gpu_utilization of the canary GPUs during the load, in [0, 1]",
}
"""Metric names a gate may use, with their meaning and units."""

GPU_METRICS: tuple[str, ...] = (
    "gpu_memory_growth_pct",
    "gpu_memory_candidate_bytes",
    "gpu_utilization",
)
"""Metrics from the canary's ``nv_gpu_*`` gauges: absent on a CPU canary, where rules on
them are skipped with a note (never failed); judged by ``threshold`` only."""

GateTest = Literal["mann_whitney", "quantile", "server_ratio", "exact_rate", "threshold"]
"""The tests a gate rule can name; each is one class below, with only its own keys."""

TYPICAL_LATENCY_METRICS: tuple[str, ...] = ("latency_p50_ms", "latency_mean_ms")
"""Latency metrics that describe a typical request: Mann-Whitney's domain."""

TAIL_LATENCY_METRICS: tuple[str, ...] = ("latency_p90_ms", "latency_p95_ms", "latency_p99_ms")
"""Tail percentiles: judged by the quantile test, which looks at the percentile named."""

_ALPHA_TEXT = (
    "False-fail rate of this rule at its boundary (the candidate exactly at the tolerance or "
    "budget). The rules' α add up to the family-wise rate of the rule set (Bonferroni; 5% for "
    "the default set), shown in the gate report; with `canary.sequential` it is split between "
    "the watch and the fixed test, spent once. Float in (0, 0.5). Default 0.05."
)


def infer_test(data: Mapping[str, Any]) -> GateTest:
    """The test a rule means when it names none: from its bounds first, then its metric.

    Only an omitted ``test`` is inferred; a stated one is never changed (a rule whose keys
    or metric do not fit its test is refused).
    """
    if data.get("min") is not None or data.get("max") is not None:
        return "threshold"
    if data.get("metric") in TAIL_LATENCY_METRICS:
        return "quantile"
    if data.get("metric") == "server_latency_ratio":
        return "server_ratio"
    if data.get("max_increase_pct") is not None or data.get("min_effect_ms") is not None:
        return "mann_whitney"
    if data.get("max_rate") is not None:
        return "exact_rate"
    if data.get("metric") in LATENCY_METRICS:
        return "mann_whitney"
    if data.get("metric") == "error_rate":
        return "exact_rate"
    return "threshold"


_infer_test = infer_test
"""The old private name: ``bench/judge.py`` runs ``tasks/gates.py`` as it was at an older
commit, which imports it."""


def _test_for_metric(metric: str) -> GateTest:
    """The test that judges ``metric`` when a rule gives only its metric."""
    return infer_test({"metric": metric})


class _RuleBase(_Section):
    """What every gate rule has. Subclasses narrow ``metric`` and fix ``test``."""

    TEST: ClassVar[GateTest]
    METRICS: ClassVar[tuple[str, ...]] = ()
    """The metrics this test takes (empty: every known metric)."""
    PURPOSE: ClassVar[str] = ""
    """Why the test takes only :attr:`METRICS`, for the refusal of another metric."""
    BOUNDS: ClassVar[tuple[str, ...]] = ()
    """The keys that bound this rule (its tolerance or budget), for plans and messages."""

    name: str = Field(
        min_length=1,
        description="Unique rule name, shown in reports. Required.",
    )
    metric: str = Field(
        description="What is measured: one of " + ", ".join(f"`{m}`" for m in KNOWN_METRICS)
        + "; each test takes only its own (see below). Required.",
    )
    test: GateTest = Field(
        description="The test that judges the rule: `mann_whitney` (typical latency as a test "
        "of stochastic order, not of the median: is a random candidate request slower than a "
        "random baseline one × (1 + tolerance)?), `quantile` (a tail percentile against the "
        "baseline's), `server_ratio` (Triton's own time per request against the baseline's), "
        "`exact_rate` (the error rate against a budget) or `threshold` (a value against "
        "`min`/`max`). Each takes only its own keys and metrics (below): a rule with a key or "
        "metric of another test is refused (exit 2, naming the key), never read as another "
        "test. Default: inferred when omitted, from the bounds given (`min`/`max`: threshold), "
        "else from the metric (tail percentiles: quantile, `server_latency_ratio`: "
        "server_ratio), else from the other bounds (`max_increase_pct`: mann_whitney, "
        "`max_rate`: exact_rate), else from the metric (typical latency: mann_whitney, "
        "`error_rate`: exact_rate, others: threshold).",
    )
    dry_run: bool = Field(
        default=False,
        description="Report the verdict but never block the release. `true` or `false`. "
        "Default `false`.",
    )

    @field_validator("metric", mode="before")
    @classmethod
    def _metric_fits(cls, metric: Any) -> Any:
        if not isinstance(metric, str):
            return metric  # the type error names the key
        if metric not in KNOWN_METRICS:
            close = difflib.get_close_matches(metric, list(KNOWN_METRICS), n=1)
            guess = f" (did you mean '{close[0]}'?)" if close else ""
            raise ValueError(
                f"unknown metric '{metric}'{guess}; known metrics are " + ", ".join(KNOWN_METRICS)
            )
        if cls.METRICS and metric not in cls.METRICS:
            fits = _test_for_metric(metric)
            instead = (
                f"write `test: {fits}` (the test of {metric}; it takes "
                f"{', '.join(_RULES[fits].BOUNDS)})" if fits != "threshold" else
                f"for a bound on the value of {metric} write `test: threshold` with `min` "
                "and/or `max`"
            )
            raise ValueError(
                f"{cls.TEST} {cls.PURPOSE}, so its metric is "
                f"{' or '.join(repr(m) for m in cls.METRICS)}, not '{metric}'; {instead}"
            )
        return metric

    def bounds(self) -> dict[str, float | None]:
        """This rule's bounds by key (``max_rate``, ``min``/``max``, ...), for plans."""
        return {key: getattr(self, key) for key in self.BOUNDS}


class _StatisticalRule(_RuleBase):
    """A rule judged by a test at level ``alpha``."""

    alpha: float = Field(default=0.05, gt=0, lt=0.5, description=_ALPHA_TEXT)


class _PlannedRule(_StatisticalRule):
    """A statistical rule the canary sizes its load for."""

    power: float = Field(
        default=0.8,
        gt=0,
        lt=1,
        description="Probability of detecting a true violation of size `effect`; the canary "
        "sizes its load from it. Float in (0, 1). Default 0.8.",
    )


class _LatencyRule(_PlannedRule):
    """A client-latency rule against the baseline, with a relative tolerance and a floor."""

    BOUNDS: ClassVar[tuple[str, ...]] = ("max_increase_pct", "min_effect_ms")

    max_increase_pct: float = Field(
        gt=0,
        description="Tolerated slowdown, in percent of the baseline's metric; the candidate "
        "fails when it is significantly beyond the baseline × (1 + tolerance). Float > 0. "
        "Required.",
    )
    min_effect_ms: float | None = Field(
        default=None,
        ge=0,
        description="Tolerance floor in ms: the tolerance is max(`max_increase_pct`% of the "
        "baseline's metric, this), so a slowdown below it never fails, however significant. "
        "Float ≥ 0 or `null` (no floor). Default `null`.",
    )
    effect: float | None = Field(
        default=None,
        gt=0,
        description="Smallest violation *beyond the tolerance* the canary must detect with "
        "`power`, in percentage points above `max_increase_pct`. Float > 0 or `null` (the "
        "tolerance itself). Default `null`.",
    )


class MannWhitneyRule(_LatencyRule):
    """``mann_whitney``: typical latency as a test of **stochastic order**, not of the median.

    H0 "a random request of the candidate is no slower than a random one of the baseline ×
    (1 + tolerance)", ``P(C > r·P) ≤ ½``: a one-sided Mann-Whitney U test per time block and
    on the whole run, with the tolerance ``max(max_increase_pct% of the baseline's metric,
    min_effect_ms)``; the Hodges-Lehmann ratio is reported. It compares whole distributions,
    so a tail-only regression barely moves it: it takes ``latency_p50_ms`` and
    ``latency_mean_ms`` only (a tail percentile is a :class:`QuantileRule`).
    """

    TEST: ClassVar[GateTest] = "mann_whitney"
    METRICS: ClassVar[tuple[str, ...]] = TYPICAL_LATENCY_METRICS
    PURPOSE: ClassVar[str] = (
        "tests stochastic order (is a random candidate request slower than a random "
        "baseline one?), which a tail-only regression hardly moves"
    )

    metric: Literal["latency_p50_ms", "latency_mean_ms"] = Field(
        description="`latency_p50_ms` or `latency_mean_ms` (typical latency). Required.",
    )
    test: Literal["mann_whitney"] = Field(
        default="mann_whitney",
        description="`mann_whitney`: typical latency as a test of stochastic order (not a "
        "median test): H0 \"a random candidate request is no slower than a random baseline "
        "request × (1 + tolerance)\".",
    )


class QuantileRule(_LatencyRule):
    """``quantile``: a tail percentile (p90/p95/p99) against the baseline's, scaled.

    The candidate's percentile against the baseline's × (1 + tolerance), with the
    pooled-quantile exceedance test per time block and on the whole run (Fisher's exact
    test): a tail-only regression fails it, a body-only one does not.
    """

    TEST: ClassVar[GateTest] = "quantile"
    METRICS: ClassVar[tuple[str, ...]] = TAIL_LATENCY_METRICS
    PURPOSE: ClassVar[str] = "tests the tail percentile it names"

    metric: Literal["latency_p90_ms", "latency_p95_ms", "latency_p99_ms"] = Field(
        description="`latency_p90_ms`, `latency_p95_ms` or `latency_p99_ms` (tail latency). "
        "Required.",
    )
    test: Literal["quantile"] = Field(
        default="quantile",
        description="`quantile`: the candidate's tail percentile against the baseline's × "
        "(1 + tolerance) (pooled-quantile exceedance test).",
    )


class ServerRatioRule(_StatisticalRule):
    """``server_ratio``: Triton's own queue + compute µs per request, candidate over baseline.

    Per metrics interval (the canary scrapes every second), a one-sided t-test on the log
    ratios against ``1 + max_increase_pct/100``: client overhead cannot dilute a
    server-side regression.
    """

    TEST: ClassVar[GateTest] = "server_ratio"
    METRICS: ClassVar[tuple[str, ...]] = ("server_latency_ratio",)
    PURPOSE: ClassVar[str] = "compares Triton's own time per request of the two versions"
    BOUNDS: ClassVar[tuple[str, ...]] = ("max_increase_pct",)

    metric: Literal["server_latency_ratio"] = Field(
        description="`server_latency_ratio`. Required.",
    )
    test: Literal["server_ratio"] = Field(
        default="server_ratio",
        description="`server_ratio`: Triton's queue + compute time per request, candidate "
        "over baseline, per metrics interval (t-test on the log ratios).",
    )
    max_increase_pct: float = Field(
        gt=0,
        description="Tolerated slowdown of Triton's queue + compute time per request, in "
        "percent of the baseline's: the rule fails when the ratio is significantly above "
        "1 + this / 100. Float > 0. Required.",
    )


class ExactRateRule(_PlannedRule):
    """``exact_rate``: H0 "the candidate's error rate ≤ ``max_rate``", exact binomial test.

    A candidate within its budget fails at most α of the time at any sample size, and the
    test stays correct with zero errors.
    """

    TEST: ClassVar[GateTest] = "exact_rate"
    METRICS: ClassVar[tuple[str, ...]] = ("error_rate",)
    PURPOSE: ClassVar[str] = "tests an error rate (failed requests against a budget)"
    BOUNDS: ClassVar[tuple[str, ...]] = ("max_rate",)

    metric: Literal["error_rate"] = Field(description="`error_rate`. Required.")
    test: Literal["exact_rate"] = Field(
        default="exact_rate",
        description="`exact_rate`: the candidate's error rate against its budget (exact "
        "binomial test, correct with zero errors).",
    )
    max_rate: float = Field(
        ge=0,
        le=1,
        description="Highest tolerated error rate, a fraction in [0, 1] (0.001 = 0.1%). "
        "Required.",
    )
    effect: float | None = Field(
        default=None,
        gt=0,
        description="Smallest violation *beyond the budget* the canary must detect with "
        "`power`: a rate above `max_rate`. Float > 0 or `null` (`max_rate` itself; 0.001 "
        "when `max_rate` is 0). Default `null`.",
    )


class ThresholdRule(_RuleBase):
    """``threshold``: the metric's point value must be ``>= min`` and/or ``<= max``.

    Deterministic: no α, no power, nothing to size.
    """

    TEST: ClassVar[GateTest] = "threshold"
    BOUNDS: ClassVar[tuple[str, ...]] = ("min", "max")

    metric: str = Field(
        description="Any metric: " + ", ".join(f"`{m}`" for m in KNOWN_METRICS) + ". Required.",
    )
    test: Literal["threshold"] = Field(
        default="threshold",
        description="`threshold`: the metric's value against `min` and/or `max`; any metric.",
    )
    min: float | None = Field(
        default=None,
        description="Lowest passing value (inclusive). Number or `null`. At least one of "
        "`min`/`max` is required. Default `null`.",
    )
    max: float | None = Field(
        default=None,
        description="Highest passing value (inclusive). Number or `null`. Default `null`.",
    )

    @model_validator(mode="after")
    def _bounded(self) -> ThresholdRule:
        if self.min is None and self.max is None:
            raise ValueError("a threshold rule needs at least one of min or max")
        if self.min is not None and self.max is not None and self.min > self.max:
            raise ValueError(f"min {self.min:g} is greater than max {self.max:g}")
        return self


_RULES: dict[str, type[_RuleBase]] = {
    rule.TEST: rule
    for rule in (MannWhitneyRule, QuantileRule, ServerRatioRule, ExactRateRule, ThresholdRule)
}
"""Each test's rule class, by the value of ``test``."""


def _rule_test(value: Any) -> str | None:
    """The discriminator of :data:`GateRule`: the stated ``test``, or the inferred one."""
    if isinstance(value, _RuleBase):
        return value.test
    if not isinstance(value, Mapping):
        return None
    test = value.get("test")
    if test is None:
        return infer_test(value)
    return test if isinstance(test, str) and test in _RULES else None


GateRule: TypeAlias = Annotated[
    Annotated[MannWhitneyRule, Tag("mann_whitney")]
    | Annotated[QuantileRule, Tag("quantile")]
    | Annotated[ServerRatioRule, Tag("server_ratio")]
    | Annotated[ExactRateRule, Tag("exact_rate")]
    | Annotated[ThresholdRule, Tag("threshold")],
    Discriminator(
        _rule_test,
        custom_error_type="gate_test",
        custom_error_message="test must be one of " + ", ".join(get_args(GateTest)),
    ),
]
"""One canary gate, a union discriminated on ``test``; :mod:`tasks.gates` turns it into a
verdict. Each variant holds only its own keys, so a rule that mixes tests is refused with
the key named (a ``mann_whitney`` rule on ``latency_p99_ms`` is refused with a pointer to
``quantile``, never rewritten). When ``test`` is omitted it is inferred (:func:`infer_test`).
"""

_RULE_UNION: Any = get_args(GateRule)[0]
"""The union inside :data:`GateRule`, as the schema walkers meet it."""

_GATE_RULE: TypeAdapter[GateRule] = TypeAdapter(GateRule)


def gate_rule(data: Mapping[str, Any] | None = None, /, **fields: Any) -> GateRule:
    """One gate rule from a mapping and/or keywords, validated like a policy file's.

    Raises:
        pydantic.ValidationError: the rule is incoherent (a key or metric of another test,
            a missing bound) or a value is out of range.
    """
    return _GATE_RULE.validate_python({**(data or {}), **fields})


FAMILY_ALPHA = 0.05
"""The family-wise false-fail rate of the default rule set: a candidate at the boundary of
every default rule at once fails some rule with probability ≤ 5% (Bonferroni: the rules' α
add up to it, 0.01 + 0.01 + 0.02 + 0.01). It is spent once: with ``canary.sequential`` each
rule's α is split between the sequential watch and the fixed test. A custom rule set's
family-wise rate is the sum of its blocking statistical rules' α, shown in every gate
report (``tasks.gates.family_alpha``)."""


def default_gates() -> list[GateRule]:
    """The documented default rule set (DESIGN §2.6), family-wise α = :data:`FAMILY_ALPHA`.

    Typical latency (p50, a test of stochastic order) and tail latency (p99, quantile test)
    each within 10% of the baseline at α = 0.01, sized to catch +25% on the p50 with power
    0.95 and +40% on the p99 (tail only, the p50 unchanged) with power 0.90; errors within
    a 0.1% budget at α = 0.02; agreement ≥ 98% (deterministic: no α); and Triton's own
    queue + compute time within 10% of the baseline's at α = 0.01, so client overhead
    cannot dilute a server-side regression. The α add up to 5%: a candidate exactly at
    every tolerance at once fails ≤ 5% of the time, an identical one much less.
    """
    return [
        MannWhitneyRule(name="latency_p50", metric="latency_p50_ms", max_increase_pct=10.0,
                        min_effect_ms=0.05, alpha=0.01, power=0.95, effect=15.0),
        QuantileRule(name="latency_p99", metric="latency_p99_ms", max_increase_pct=10.0,
                     min_effect_ms=0.5, alpha=0.01, power=0.90, effect=30.0),
        ExactRateRule(name="error_rate", metric="error_rate", max_rate=0.001, alpha=0.02,
                      power=0.95, effect=0.004),
        ThresholdRule(name="agreement", metric="agreement", min=0.98),
        ServerRatioRule(name="server_latency", metric="server_latency_ratio",
                        max_increase_pct=10.0, alpha=0.01),
    ]


# --------------------------------------------------------------------------------------
# approval, swap, staging, notifications


class ApprovalPolicy(_Section):
    """Human approval between the gates and the swap (four-eyes: never the requester)."""

    required: bool = Field(
        default=False,
        description="Wait for an approval click before the swap. `true` or `false`. "
        "Default `false` (`--require-approval` overrides it).",
    )
    approvers: list[str] = Field(
        default_factory=list,
        description="Slack user ids allowed to approve (e.g. `U024BE7LH`). Needs at least one "
        "when `required` is true (`--approvers` overrides it). Default `[]`.",
    )
    timeout_s: int = Field(
        default=3600,
        gt=0,
        description="Seconds before an unanswered approval expires and the release fails "
        "closed. Integer > 0. Default 3600.",
    )
    channel: str | None = Field(
        default=None,
        description="Slack channel for the approval request, or `null` to use "
        "`notifications.slack_channel`. Default `null`.",
    )

    @model_validator(mode="after")
    def _someone_can_approve(self) -> ApprovalPolicy:
        if self.required and not self.approvers:
            raise ValueError("required is true but approvers is empty, so nobody could approve")
        return self


class SwapPolicy(_Section):
    """The fleet-wide atomic swap (DESIGN §4)."""

    pause_batching: bool = Field(
        default=True,
        description="Turn dynamic batching off on every replica for the switch and back on "
        "after (≈4 s to 100% new instead of ≈2 s, 0 failed requests either way). `true` or "
        "`false`. Default `true`.",
    )
    pause_mode: Literal["separate", "at_switch"] = Field(
        default="separate",
        description="With `pause_batching`: `separate` pauses batching on P everywhere first, "
        "then switches (DESIGN §4: three reloads, ≈2× the plain-reload time to 100% new); "
        "`at_switch` brings C up without batching directly from P and resumes once every "
        "replica answers as C (two reloads, ≈1× plain). Default `separate`.",
    )
    deadline_s: float = Field(
        default=60.0,
        gt=0,
        description="Seconds every replica has to report the candidate ready and answer a "
        "probe as it; past it the swap aborts back to the production version. Float > 0. "
        "Default 60.",
    )
    probe_timeout_s: float = Field(
        default=5.0,
        gt=0,
        description="Timeout of one probe inference, in s. Float > 0, below `deadline_s`. "
        "Default 5.",
    )

    @model_validator(mode="after")
    def _probe_fits(self) -> SwapPolicy:
        if self.probe_timeout_s >= self.deadline_s:
            raise ValueError(
                f"probe_timeout_s ({self.probe_timeout_s:g}) must be below deadline_s "
                f"({self.deadline_s:g})"
            )
        return self


class StagingPolicy(_Section):
    """The S3 model repository."""

    keep_versions: int = Field(
        default=3,
        ge=2,
        description="Version folders kept per model (Triton downloads every one on each load, "
        "so retired ones are pruned); at least 2, so rollback stays a swap. Integer ≥ 2. "
        "Default 3.",
    )
    multipart_threshold_bytes: int = Field(
        default=64 * MiB,
        ge=5 * MiB,
        description="Files at least this large upload in parts, in bytes. Integer ≥ 5 MiB. "
        "Default 67108864 (64 MiB).",
    )
    multipart_chunk_bytes: int = Field(
        default=16 * MiB,
        ge=5 * MiB,
        le=5 * 1024 * MiB,
        description="Size of one upload part, in bytes (S3 allows 5 MiB to 5 GiB). Default "
        "16777216 (16 MiB).",
    )


class NotificationsPolicy(_Section):
    """Where the release thread goes."""

    enabled: bool = Field(
        default=True,
        description="Post the release thread to Slack. `true` or `false`. Default `true` "
        "(without Slack settings nothing is posted either way).",
    )
    slack_channel: str = Field(
        default="#releases",
        pattern=r"^(#[a-z0-9][a-z0-9_.-]{0,79}|[CG][A-Z0-9]{8,})$",
        description="Slack channel name (`#releases`) or id (`C0123456789`). Default "
        "`#releases`.",
    )


class BakePolicy(_Section):
    """The watch after the swap: a breach rolls the fleet back on its own (SageMaker's
    baking period)."""

    duration_s: float = Field(
        default=10.0,
        ge=0,
        description="Seconds the fleet is watched after the swap; `0` skips the bake. "
        "Float ≥ 0. Default 10.",
    )
    window_s: float = Field(
        default=2.0,
        gt=0,
        description="Length of one watch window, in s; each window is judged on its own. "
        "Float > 0. Default 2.",
    )
    baseline_s: float = Field(
        default=30.0,
        gt=0,
        description="Seconds of the same probe load on the production version just before "
        "the swap, in windows of `window_s`: the pre-swap reference the latency is compared "
        "with, at the load it saw. Its size bounds what the bake can tell apart: with 30 s "
        "at 80 req/s, +30% latency is caught ≥ 90% within a 120-s bake (`promote --dry-run` "
        "prints the effective tolerance); below 2 × `window_s` the latency rules have no "
        "reference and only errors are judged. Float > 0. Default 30.",
    )
    probe_rps: float = Field(
        default=80.0,
        gt=0,
        description="Requests per second of golden rows the bake sends across the fleet, "
        "before the swap (the reference) and after it, so there is always evidence (organic "
        "traffic counts too, through Triton's metrics). Float > 0. Default 80.",
    )
    max_error_rate: float = Field(
        default=0.001,
        ge=0,
        le=1,
        description="The new version's error budget: failed requests (client-side or "
        "counted by Triton) per request. The release rolls back once the failures since the "
        "swap show a rate above it with always-valid evidence (see `alpha`); `0` rolls back "
        "at the first failure. Float in [0, 1]. Default 0.001.",
    )
    alpha: float = Field(
        default=0.01,
        gt=0,
        lt=1,
        description="Chance that the bake rolls back a version whose error rate is within "
        "`max_error_rate`, over the whole bake however many windows it looks at (a betting "
        "e-process on per-window error fractions, valid with bursts; Ville's inequality); "
        "the latency rules together get the same chance for a version within the latency "
        "tolerance at matched load (windows as blocks, Bonferroni over a fixed schedule of "
        "looks). Float in (0, 1). Default 0.01.",
    )
    max_latency_increase_pct: float = Field(
        default=25.0,
        gt=0,
        description="Latency tolerance after the swap, in percent of the pre-swap reference "
        "at matched load: the release rolls back once the windows since the swap show the "
        "probe's quantile (see `latency_quantiles`, per window) above the reference's times "
        "1 + this / 100 (false rollbacks ≤ `alpha` in all, however many windows). Windows "
        "whose request rate left the reference's (`load_tolerance_pct`) are held, not "
        "judged. Float > 0. Default 25 (×1.5 is caught within a few windows, +30% within "
        "120 s).",
    )
    latency_quantiles: list[float] = Field(
        default_factory=lambda: [0.5, 0.9],
        description="Quantiles of the probe's per-request latency judged after the swap, "
        "one rule each on the windows' quantiles (`alpha` split evenly between them): 0.5 "
        "for the typical request, 0.9 for the tail (a higher one needs more probe requests "
        "per window: `probe_rps` × `window_s` should put ≥ 10 above it). Each in (0, 1); "
        "`[]` turns the latency rules off. Default `[0.5, 0.9]`.",
    )
    min_latency_effect_us: float = Field(
        default=300.0,
        ge=0,
        description="A latency increase smaller than this many µs never counts as slow "
        "(noise floor on small models): the slow limit is at least the pre-swap quantile "
        "plus this. Float ≥ 0. Default 300.",
    )
    load_tolerance_pct: float = Field(
        default=20.0,
        gt=0,
        description="How far the fleet's request rate (Triton's count, every replica) may "
        "move from the pre-swap reference's, in percent, before the latency rules hold: a "
        "window outside it is not judged on latency (no rollback, no pass on latency alone; "
        "errors are still judged) and the record says so. Float > 0. Default 20.",
    )
    breach_windows: int = Field(
        default=2,
        ge=1,
        description="Deprecated and ignored: the latency rule no longer needs windows in a "
        "row (it is always-valid over every window). Accepted so older policies still load. "
        "Integer ≥ 1. Default 2.",
    )
    holdback_pct: float = Field(
        default=0.0,
        ge=0,
        le=50,
        description="A concurrent control for the bake: the share of live requests, in %, "
        "the canary Triton answers with the previous version while the fleet serves the "
        "new one, through the traffic router; the bake then compares the fleet with the "
        "holdback on the same traffic at the same time (a surge reaches both). Back to 0 "
        "at the end of the bake and on every failure path. Needs a router and a bake "
        "(`duration_s` > 0); ignored on a first release (no previous version). Float in "
        "[0, 50]. Default 0: no holdback (the bake compares with the pre-swap reference).",
    )

    @field_validator("latency_quantiles")
    @classmethod
    def _quantiles_inside(cls, value: list[float]) -> list[float]:
        bad = [q for q in value if not 0.0 < q < 1.0]
        if bad:
            raise ValueError(f"latency quantiles must be in (0, 1), got {bad}")
        return sorted(set(value))

    @model_validator(mode="after")
    def _holdback_needs_a_bake(self) -> BakePolicy:
        if self.holdback_pct > 0 and self.duration_s == 0:
            raise ValueError(
                f"bake.holdback_pct ({self.holdback_pct:g} %) needs a bake, but "
                "bake.duration_s is 0 (no bake); set duration_s > 0, or holdback_pct: 0")
        return self


# --------------------------------------------------------------------------------------
# the policy


class NightlyPolicy(_Section):
    """The nightly retrain's rule: when tonight's challenger counts as better than the
    champion in production (MLflow's ``MetricThreshold`` fields), so it is promoted."""

    metric: Literal["accuracy", "f1_macro"] = Field(
        default="accuracy",
        description="Held-out metric compared, higher is better: `accuracy` or `f1_macro`. "
        "Default `accuracy`.",
    )
    min_absolute_change: float | None = Field(
        default=0.01,
        ge=0,
        description="Promote only when the challenger beats the champion by at least this "
        "much, in metric units; `null`: no absolute margin. Float ≥ 0 or null. Default 0.01.",
    )
    min_relative_change: float | None = Field(
        default=None,
        ge=0,
        description="... or by at least this fraction of the champion's value; `null`: none. "
        "Float ≥ 0 or null. Default null.",
    )
    threshold: float | None = Field(
        default=None,
        description="A floor the challenger's metric must reach whatever the champion's; "
        "`null`: none. Float or null. Default null.",
    )


class Policy(_Section):
    """The release policy of one model. ``Policy()`` is the documented default."""

    triton: TritonPolicy = Field(
        default_factory=TritonPolicy, description="The Triton model config knobs."
    )
    export: ExportPolicy = Field(
        default_factory=ExportPolicy, description="ONNX export and parity."
    )
    validation: ValidationPolicy = Field(
        default_factory=ValidationPolicy, description="Contract and data checks."
    )
    canary: CanaryPolicy = Field(
        default_factory=CanaryPolicy, description="The canary replay load."
    )
    gates: list[GateRule] = Field(
        default_factory=default_gates,
        min_length=1,
        description="The canary gates; a list here replaces the defaults. Default: typical "
        "latency (p50, a test of stochastic order) and p99 (quantile test) ≤ 10% worse than the "
        "baseline at α 0.01 each, error rate ≤ 0.1% (α 0.02), Triton's queue + compute time ≤ "
        "10% worse (α 0.01), agreement ≥ 0.98: a family-wise false-fail rate of 5% (the α add "
        "up, Bonferroni). Every statistical rule judges time blocks, not single requests. At "
        "least one rule (use `dry_run` to observe only).",
    )
    approval: ApprovalPolicy = Field(
        default_factory=ApprovalPolicy, description="Human approval."
    )
    swap: SwapPolicy = Field(default_factory=SwapPolicy, description="The fleet swap.")
    bake: BakePolicy = Field(
        default_factory=BakePolicy, description="The watch after the swap."
    )
    staging: StagingPolicy = Field(
        default_factory=StagingPolicy, description="The S3 repository."
    )
    notifications: NotificationsPolicy = Field(
        default_factory=NotificationsPolicy, description="Slack notifications."
    )
    nightly: NightlyPolicy = Field(
        default_factory=NightlyPolicy,
        description="The nightly retrain: when a challenger beats the champion.",
    )

    @model_validator(mode="after")
    def _unique_gate_names(self) -> Policy:
        names = [rule.name for rule in self.gates]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"gate names must be unique; repeated: {', '.join(dupes)}")
        return self


# --------------------------------------------------------------------------------------
# loading


class _UniqueKeyLoader(yaml.SafeLoader):
    """A SafeLoader that rejects duplicate keys, which PyYAML would silently overwrite."""


def _construct_unique_mapping(loader: yaml.SafeLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    seen: dict[Any, Any] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                "while constructing a mapping",
                node.start_mark,
                f"found duplicate key {key!r}",
                key_node.start_mark,
            )
        seen[key] = True
    return loader.construct_mapping(node)


_UniqueKeyLoader.add_constructor(
    yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_unique_mapping
)


def load_policy(path: Path) -> Policy:
    """Read and validate one policy file.

    An empty file, or an empty section (``triton:`` with nothing under it), means the
    defaults.

    Raises:
        PolicyError: the file is missing or unreadable, is not valid YAML (with line and
            column), is not a mapping, or breaks the schema. The message names the file and
            the dotted key path of every problem; the hint lists the known keys.
    """
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError as exc:
        raise PolicyError(
            f"{path}: policy file not found",
            hint="check the path, or omit --policy to use policies/MODEL.yaml or the defaults",
            file=str(path),
        ) from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise PolicyError(
            f"{path}: cannot read the policy file ({exc})",
            hint="make it a readable UTF-8 YAML file",
            file=str(path),
        ) from exc
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = exc.problem or exc.context or "invalid YAML"
        raise PolicyError(
            f"{path}: YAML syntax error{where}: {problem}",
            hint="fix the YAML there (indentation, a missing ':', an unclosed quote or a "
            "repeated key)",
            file=str(path),
            line=mark.line + 1 if mark else None,
        ) from exc
    except yaml.YAMLError as exc:
        raise PolicyError(
            f"{path}: YAML error: {exc}", hint="fix the YAML syntax", file=str(path)
        ) from exc
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise PolicyError(
            f"{path}: a policy must be a mapping of sections, got {_yaml_kind(data)}",
            hint="start the file with section keys such as 'triton:' or 'gates:'; known "
            f"sections are {', '.join(Policy.model_fields)}",
            file=str(path),
        )
    # `triton:` with every key commented out parses as null: treat it as the defaults.
    data = {k: v for k, v in data.items() if not (v is None and k in Policy.model_fields)}
    try:
        return Policy.model_validate(data)
    except ValidationError as exc:
        raise _policy_error(path, exc, data) from exc


def policy_for(model: str, policies_dir: Path, explicit: Path | None = None) -> Policy:
    """The policy of ``model``: the explicit file, else ``policies_dir/MODEL.yaml``, else defaults.

    An explicit file that does not exist is an error (the user asked for it); a missing
    per-model file is not (most models run on the defaults).
    """
    if explicit is not None:
        return load_policy(explicit)
    if not model or Path(model).name != model or model in {".", ".."}:
        raise PolicyError(
            f"model name {model!r} cannot name a policy file",
            hint="use the MLflow registered-model name, without path separators",
            model=model,
        )
    for suffix in (".yaml", ".yml"):
        candidate = policies_dir / f"{model}{suffix}"
        if candidate.is_file():
            return load_policy(candidate)
    return Policy()


def _yaml_kind(value: Any) -> str:
    if isinstance(value, list):
        return "a list"
    if isinstance(value, str):
        return f"a string ({value[:40]!r})"
    return f"a {type(value).__name__}"


def _dotted(loc: tuple[int | str, ...]) -> str:
    return ".".join(str(part) for part in loc)


def _unwrap(tp: Any) -> Any:
    """Strip ``X | None`` and ``Annotated`` down to the type that holds keys."""
    while True:
        origin = get_origin(tp)
        if origin is Annotated:
            tp = get_args(tp)[0]
        elif origin is Union or origin is types.UnionType:
            args = [a for a in get_args(tp) if a is not type(None)]
            holders = [
                a for a in args
                if get_origin(a) in (list, dict)
                or (isinstance(a, type) and issubclass(a, BaseModel))
            ]
            if not holders:
                return tp
            tp = holders[0]
        else:
            return tp


def _locate(loc: tuple[int | str, ...]) -> tuple[tuple[int | str, ...], type[BaseModel] | None]:
    """A pydantic error location as the key path a user writes, and the section model there.

    Pydantic puts the chosen test of a gate rule into the path (``gates.2.quantile.metric``);
    the key path drops it (``gates.2.metric``) and the model is that test's rule class. The
    model is None when the path ends on a value or leaves the schema.
    """
    tp: Any = Policy
    keys: list[int | str] = []
    for part in loc:
        tp = _unwrap(tp) if tp is not None else None
        if tp is _RULE_UNION:
            tp = _RULES.get(part) if isinstance(part, str) else None
            if tp is not None:
                continue
        keys.append(part)
        if isinstance(tp, type) and issubclass(tp, BaseModel):
            field = tp.model_fields.get(part) if isinstance(part, str) else None
            tp = field.annotation if field is not None else None
        elif get_origin(tp) is list and isinstance(part, int):
            tp = get_args(tp)[0]
        elif get_origin(tp) is dict:
            tp = get_args(tp)[1]
        else:
            tp = None
    tp = _unwrap(tp) if tp is not None else None
    return tuple(keys), tp if isinstance(tp, type) and issubclass(tp, BaseModel) else None


def _model_at(loc: tuple[int | str, ...]) -> type[BaseModel] | None:
    """The section model found at a (pydantic) location, or None when it leaves the schema."""
    return _locate(loc)[1]


def _rule_named_test(data: Any, keys: tuple[int | str, ...]) -> bool:
    """Whether the gate rule at ``keys`` (``("gates", i, ...)``) states its ``test``."""
    rules = data.get("gates") if isinstance(data, Mapping) else None
    if len(keys) < 2 or not isinstance(rules, list) or not isinstance(keys[1], int) \
            or not 0 <= keys[1] < len(rules) or not isinstance(rules[keys[1]], Mapping):
        return True
    return rules[keys[1]].get("test") is not None


def _rule_problem(err: Any, keys: tuple[int | str, ...], rule: type[_RuleBase] | None,
                  data: Any) -> tuple[str, str, str] | None:
    """Key, problem and hint of an error only gate rules have, else None."""
    key = _dotted(keys)
    if err["type"] == "gate_test":
        given = err.get("input")
        if not isinstance(given, Mapping):
            return (key, f"'{key}': a gate rule is a mapping of keys (name, metric, test, ...), "
                    f"got {_yaml_kind(given)}",
                    "see policies/README.md for the keys of a gate rule")
        tests = list(get_args(GateTest))
        close = difflib.get_close_matches(str(given.get("test")), tests, n=1)
        guess = f" (did you mean '{close[0]}'?)" if close else ""
        return (f"{key}.test", f"'{key}.test': unknown test "
                f"{json.dumps(given.get('test'), default=str)}{guess}",
                f"write one of: {', '.join(tests)}")
    if rule is None:
        return None
    inferred = "" if _rule_named_test(data, keys) else \
        f" (the rule names no test, so its keys made it {rule.TEST})"
    name = str(keys[-1])
    owners = [t for t, cls in _RULES.items() if name in cls.model_fields and cls is not rule]
    if err["type"] == "extra_forbidden" and owners:
        return (key, f"'{key}' does not apply to a {rule.TEST} rule{inferred}: {name} is a key of "
                f"{' and '.join(owners)}",
                f"drop '{name}', or write `test: {owners[0]}` if that is the test you mean "
                f"(a {rule.TEST} rule takes: {', '.join(rule.model_fields)})")
    if err["type"] == "value_error" and name == "metric":
        return (key, f"'{key}': {err['msg'].removeprefix('Value error, ')}{inferred}",
                f"'{key}': {rule.model_fields['metric'].description}")
    return None


def _policy_error(path: Path, exc: ValidationError, data: Any = None) -> PolicyError:
    problems: list[str] = []
    hints: list[str] = []
    details: list[dict[str, Any]] = []
    for err in exc.errors(include_url=False):
        raw = tuple(err["loc"])
        loc, _ = _locate(raw)
        key = _dotted(loc)
        owner = _model_at(raw[:-1]) if raw else None
        rule = owner if isinstance(owner, type) and issubclass(owner, _RuleBase) else None
        special = _rule_problem(err, loc, rule, data)
        if special is not None:
            key, problem, hint = special
        elif err["type"] == "extra_forbidden":
            parent, name = loc[:-1], str(loc[-1])
            known = sorted(owner.model_fields) if owner else []
            close = difflib.get_close_matches(name, known, n=1)
            problem = f"unknown key '{key}'" + (f" (did you mean '{close[0]}'?)" if close else "")
            where = f"under '{_dotted(parent)}'" if parent else "at the top level"
            hint = f"known keys {where} are: {', '.join(known)}" if known else ""
        elif err["type"] == "missing":
            problem = f"missing key '{key}'" + (f" (a {rule.TEST} rule needs it)" if rule else "")
            field = owner.model_fields.get(str(loc[-1])) if owner else None
            hint = field.description or "" if field else ""
        else:
            custom = err["type"] == "value_error"
            msg = err["msg"].removeprefix("Value error, ")
            shown = json.dumps(err.get("input"), default=str)
            if len(shown) > 60:
                shown = shown[:57] + "..."
            if not raw or _model_at(raw) is not None:
                # A rule across several keys of one section (or list item) was broken.
                problem = f"{key or 'policy'}: {msg}"
                hint = f"see policies/README.md for the keys of '{key or 'policy'}'"
            else:
                problem = f"'{key}': {msg}" + ("" if custom else f" (got {shown})")
                field = None
                if owner is not None and isinstance(loc[-1], str):
                    field = owner.model_fields.get(loc[-1])
                hint = f"'{key}': {field.description}" if field and field.description else ""
        problems.append(problem)
        if hint and hint not in hints:
            hints.append(hint)
        details.append({"key": key, "problem": problem, "hint": hint or None})
    return PolicyError(
        f"{path}: " + "; ".join(problems),
        hint=" | ".join(hints) or "see policies/README.md for every key and its default",
        file=str(path),
        errors=details,
    )


# --------------------------------------------------------------------------------------
# reference documentation


def _reference_row(key: str, field: Any, shown: str | None = None) -> str:
    if shown is None and field.is_required():
        shown = "required"
    elif shown is None:
        default = field.get_default(call_default_factory=True)
        listed = isinstance(default, list) and default
        shown = "see below" if listed and isinstance(default[0], BaseModel) else \
            f"`{json.dumps(default)}`"
    text = (field.description or "").replace("|", "\\|")
    return f"| `{key}` | {shown} | {text} |"


def _rule_reference_rows(prefix: str) -> list[str]:
    """The keys of a gate rule: the common ones once, then each test's own, a key shared by
    several tests with the same meaning in one row that names them."""
    common = ("name", "test", "dry_run")
    rows = [_reference_row(f"{prefix}{name}", _RuleBase.model_fields[name],
                           "inferred" if name == "test" else None) for name in common]
    grouped: dict[tuple[str, str], tuple[Any, list[str]]] = {}
    for test, rule in _RULES.items():
        for name, field in rule.model_fields.items():
            if name not in common:
                grouped.setdefault((name, field.description or ""), (field, []))[1].append(test)
    for (name, _), (field, tests) in grouped.items():
        row = _reference_row(f"{prefix}{name}", field)
        which = ", ".join(f"`{t}`" for t in tests)
        rows.append(row.replace(f"| `{prefix}{name}` |", f"| `{prefix}{name}` ({which}) |", 1))
    return rows


def _rule_yaml(rule: GateRule) -> dict[str, Any]:
    """A rule as a policy file would say it: name, metric and test, then what differs from
    the defaults."""
    given = rule.model_dump(exclude_defaults=True)
    first = {"name": rule.name, "metric": rule.metric, "test": rule.test,
             **{k: given[k] for k in rule.BOUNDS if k in given}}
    return {**first, **{k: v for k, v in given.items() if k not in first}}


def policy_reference_markdown() -> str:
    """The key reference of ``policies/README.md``, generated so it cannot drift from the code."""
    lines = ["| Key | Default | Meaning and accepted values |", "|---|---|---|"]

    def walk(model: type[BaseModel], prefix: str) -> None:
        for name, field in model.model_fields.items():
            key = f"{prefix}{name}"
            tp = _unwrap(field.annotation)
            if isinstance(tp, type) and issubclass(tp, BaseModel):
                walk(tp, f"{key}.")
                continue
            lines.append(_reference_row(key, field))
            item = _unwrap(get_args(tp)[0]) if get_origin(tp) is list else None
            value = get_args(tp)[1] if get_origin(tp) is dict else None
            if item is _RULE_UNION:
                lines.extend(_rule_reference_rows(f"{key}[]."))
            elif isinstance(item, type) and issubclass(item, BaseModel):
                walk(item, f"{key}[].")
            if isinstance(value, type) and issubclass(value, BaseModel):
                walk(value, f"{key}.<name>.")

    walk(Policy, "")
    lines += ["", "Default `gates`:", "", "```yaml", "gates:"]
    for rule in default_gates():
        first = True
        for k, v in _rule_yaml(rule).items():
            lines.append(f"  {'- ' if first else '  '}{k}: {json.dumps(v)}")
            first = False
    lines.append("```")
    return "\n".join(lines) + "\n"
