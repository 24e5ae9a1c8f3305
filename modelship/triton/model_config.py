"""Triton model configs, built and checked with Triton's own protobuf schema.

Everything here is pure: configs are rendered from a :class:`ModelSpec` and the policy,
serialised for ``config.pbtxt`` or for the load-with-config override, compared by digest,
rewritten for the swap protocol and linted. No function mutates its input.

Why lint ourselves: Triton 2.51 *accepts* ``max_batch_size: 0`` with dynamic batching and
then every client request fails (RECIPES.md). A config that reaches a server must already
be known to be sane.

Facts about live configs (measured on Triton 2.51 with the Python-based ``onnxruntime``
backend), which :func:`from_live_json` and the digests account for:

- Triton adds ``runtime: "model.py"``, ``platform: "onnxruntime_onnx"``,
  ``default_model_filename: "model.onnx"``, instance group names ``MODEL_0``, ... and an
  ``optimization`` block with pinned input/output memory enabled.
- With dynamic batching and no preferred sizes, Triton fills in ``[max_batch_size]``.
- Without a ``version_policy``, Triton uses ``latest { num_versions: 1 }``.
- The JSON override takes int64 fields as strings (``"dims": ["4"]``), as
  ``json_format.MessageToJson`` writes them.

One staged version, two kinds of fleet (CPU stack, GPU production): **the staged config is
rendered for the policy's declared target** (``triton.target``), and a CPU fleet serves
its derivation :func:`for_target` ``(cfg, "cpu")``. Which form a server loads is decided
where it is loaded, from the server's own metrics, by one helper
(:func:`modelship.triton.target.render_for_servers`: the canary, the swap and its pin,
reconcile, the trial load). Why this way round:

- What serves in production is what was staged, hashed into ``release.json`` and linted at
  check time: no re-rendering at swap time from a policy file that may have changed since.
- Deriving *down* is lossless and needs no policy: the CPU form only turns ``KIND_GPU``
  into ``KIND_CPU`` and drops what has no meaning on a CPU (GPU device ids, GPU
  accelerators, warmup). Deriving *up* would need the accelerator choices, so it is never
  done; a check on the CPU stack renders and lints the GPU config all the same
  (``tasks.validate.render_checked_configs``).
- Rendering per target at swap time would have made every swap depend on the policy file
  of the day, and staging a config per target would have put two candidate configs in each
  version folder for every reader to choose from.

GPU rendering (``target: gpu``): ``KIND_GPU`` instance groups (``count``, optional
``gpus``), ONNX Runtime accelerators in ``optimization.execution_accelerators``
(``tensorrt`` with ``precision_mode`` and ``max_workspace_size_bytes``, or ``cuda``), and
``model_warmup`` shaped by the golden rows. Warmup data are zeros or random values rather
than the golden bytes: Triton reads warmup files from ``<model>/warmup/``, a model-level
folder outside the immutable, manifested version folder, and what warmup is for (building
TensorRT engines and CUDA allocations) depends on shapes only.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
from google.protobuf import json_format, text_format
from onnx import TensorProto
from tritonclient.grpc import model_config_pb2
from tritonclient.grpc.model_config_pb2 import ModelConfig

from modelship.errors import ValidationFailed
from modelship.policy import Target, TritonPolicy

__all__ = [
    "LintFinding",
    "ModelConfig",
    "ModelSpec",
    "TensorSpec",
    "assert_lint_clean",
    "config_digest",
    "for_target",
    "from_live_json",
    "from_pbtxt",
    "lint",
    "numpy_dtype_from_onnx",
    "numpy_dtype_from_triton",
    "onnx_elem_type",
    "render_model_config",
    "serving_digest",
    "to_json",
    "to_pbtxt",
    "triton_dtype",
    "warmup_samples",
    "with_versions",
    "without_dynamic_batching",
]

# --------------------------------------------------------------------------------------
# dtypes

# numpy dtype name -> (Triton data type name, ONNX TensorProto elem type)
_DTYPES: dict[str, tuple[str, int]] = {
    "bool": ("TYPE_BOOL", TensorProto.BOOL),
    "uint8": ("TYPE_UINT8", TensorProto.UINT8),
    "uint16": ("TYPE_UINT16", TensorProto.UINT16),
    "uint32": ("TYPE_UINT32", TensorProto.UINT32),
    "uint64": ("TYPE_UINT64", TensorProto.UINT64),
    "int8": ("TYPE_INT8", TensorProto.INT8),
    "int16": ("TYPE_INT16", TensorProto.INT16),
    "int32": ("TYPE_INT32", TensorProto.INT32),
    "int64": ("TYPE_INT64", TensorProto.INT64),
    "float16": ("TYPE_FP16", TensorProto.FLOAT16),
    "float32": ("TYPE_FP32", TensorProto.FLOAT),
    "float64": ("TYPE_FP64", TensorProto.DOUBLE),
    "bfloat16": ("TYPE_BF16", TensorProto.BFLOAT16),
    "object": ("TYPE_STRING", TensorProto.STRING),
}
# Names that mean "variable-length bytes/strings": Triton's BYTES, numpy's object arrays.
_STRING_ALIASES = {"object", "string", "str", "bytes", "bytes_", "str_", "object_", "O"}
_FROM_TRITON = {triton: name for name, (triton, _) in _DTYPES.items()}
_FROM_ONNX = {elem: name for name, (_, elem) in _DTYPES.items()}


def _canonical_dtype(dtype: str) -> str:
    """Normalise a numpy dtype name ("<f4", "float", "string") to the names of the table."""
    if dtype in _STRING_ALIASES:
        return "object"
    if dtype in _DTYPES:
        return dtype
    try:
        name = np.dtype(dtype).name
    except TypeError:
        name = dtype
    if name in _DTYPES:
        return name
    if name.startswith(("str", "bytes")):
        return "object"
    raise ValidationFailed(
        f"dtype {dtype!r} has no Triton equivalent",
        hint="use one of " + ", ".join(sorted(_DTYPES)) + " (strings as 'object')",
        dtype=dtype,
    )


def triton_dtype(dtype: str) -> str:
    """Triton's data type name (``"TYPE_FP32"``) for a numpy dtype name (``"float32"``)."""
    return _DTYPES[_canonical_dtype(dtype)][0]


def numpy_dtype_from_triton(data_type: str | int) -> str:
    """The numpy dtype name for a Triton data type, given by name or enum value.

    Strings come back as ``"object"``, the dtype Triton's Python clients use for BYTES.
    """
    if isinstance(data_type, int):
        known = data_type in model_config_pb2.DataType.values()
        data_type = model_config_pb2.DataType.Name(data_type) if known else str(data_type)
    try:
        return _FROM_TRITON[data_type]
    except KeyError:
        raise ValidationFailed(
            f"Triton data type {data_type!r} is not supported",
            hint="use one of " + ", ".join(sorted(_FROM_TRITON)),
            data_type=data_type,
        ) from None


def onnx_elem_type(dtype: str) -> int:
    """The ONNX ``TensorProto`` element type for a numpy dtype name."""
    return _DTYPES[_canonical_dtype(dtype)][1]


def numpy_dtype_from_onnx(elem_type: int) -> str:
    """The numpy dtype name for an ONNX ``TensorProto`` element type."""
    try:
        return _FROM_ONNX[elem_type]
    except KeyError:
        name = (
            TensorProto.DataType.Name(elem_type)
            if elem_type in TensorProto.DataType.values()
            else str(elem_type)
        )
        raise ValidationFailed(
            f"ONNX element type {name} has no Triton equivalent",
            hint="cast the graph's inputs/outputs to a supported type (e.g. float32, int64)",
            elem_type=elem_type,
        ) from None


# --------------------------------------------------------------------------------------
# specs


@dataclass(frozen=True)
class TensorSpec:
    """One model input or output as Triton sees it.

    Attributes:
        name: Tensor name; it must match the ONNX graph.
        dtype: numpy dtype name (``"float32"``, ``"int64"``, ``"bool"``, ``"object"`` for
            strings).
        dims: Shape **without** the batch dimension when the model batches
            (``max_batch_size > 0``); ``-1`` marks a variable dimension.
    """

    name: str
    dtype: str
    dims: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "dims", tuple(int(d) for d in self.dims))
        object.__setattr__(self, "dtype", _canonical_dtype(self.dtype))


@dataclass(frozen=True)
class ModelSpec:
    """The I/O contract of one model: the Triton model name and its tensors."""

    name: str
    inputs: tuple[TensorSpec, ...] = field(default_factory=tuple)
    outputs: tuple[TensorSpec, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        object.__setattr__(self, "inputs", tuple(self.inputs))
        object.__setattr__(self, "outputs", tuple(self.outputs))


# --------------------------------------------------------------------------------------
# rendering and serialisation


_KINDS = {
    "cpu": model_config_pb2.ModelInstanceGroup.KIND_CPU,
    "gpu": model_config_pb2.ModelInstanceGroup.KIND_GPU,
}


def render_model_config(
    spec: ModelSpec,
    triton_policy: TritonPolicy,
    *,
    versions: Sequence[int] | None = None,
    target: Target | None = None,
    golden_shapes: Mapping[str, Sequence[int]] | None = None,
) -> ModelConfig:
    """Render the full Triton config of a model from its I/O spec and its policy.

    Every field is explicit (instance group, version policy), because a load override
    replaces the whole config rather than merging with it.

    Args:
        spec: Model name and tensors (dims without the batch dimension when batching).
        triton_policy: The ``triton`` section of the release policy.
        versions: Serve exactly these versions (``version_policy: specific``); ``None``
            serves the latest one.
        target: Overrides ``triton_policy.target``, e.g. ``"cpu"`` for the local stack when
            the policy targets the GPU fleet. An instance group kind ``auto`` follows it.
            On ``gpu``, the ``triton.gpu`` accelerators and warmup are rendered too.
        golden_shapes: Input name to the shape of the golden feed (``[rows, *dims]``), which
            sizes the warmup requests; without it the warmup uses batch 1 and variable dims
            of 1.

    Raises:
        ValidationFailed: a dtype has no Triton equivalent, or ``versions`` is empty.
    """
    where = target or triton_policy.target
    cfg = ModelConfig(
        name=spec.name,
        backend=triton_policy.backend,
        max_batch_size=triton_policy.max_batch_size,
    )
    for tensor in spec.inputs:
        added = cfg.input.add(
            name=tensor.name,
            data_type=model_config_pb2.DataType.Value(triton_dtype(tensor.dtype)),
            dims=list(tensor.dims) or [1],
        )
        if not tensor.dims:  # one scalar per batch item: Triton's idiom is [1] reshaped to []
            added.reshape.SetInParent()
    for tensor in spec.outputs:
        added_out = cfg.output.add(
            name=tensor.name,
            data_type=model_config_pb2.DataType.Value(triton_dtype(tensor.dtype)),
            dims=list(tensor.dims) or [1],
        )
        if not tensor.dims:
            added_out.reshape.SetInParent()
    batching = triton_policy.dynamic_batching
    if batching.enabled:
        cfg.dynamic_batching.max_queue_delay_microseconds = batching.max_queue_delay_us
        cfg.dynamic_batching.preferred_batch_size.extend(batching.preferred_batch_sizes)
    group = triton_policy.instance_group
    kind = where if group.kind == "auto" else group.kind
    added_group = cfg.instance_group.add(kind=_KINDS[kind], count=group.count)
    if kind == "gpu" and group.gpus is not None:
        added_group.gpus.extend(group.gpus)
    if versions is None:
        cfg.version_policy.latest.num_versions = 1
    else:
        _set_specific(cfg, versions)
    if where == "gpu":
        _render_gpu(cfg, triton_policy, golden_shapes)
    return cfg


_TRT_PRECISION = ("FP32", "FP16", "INT8")
_ORT_GPU_ACCELERATORS = ("tensorrt", "cuda")


def _render_gpu(cfg: ModelConfig, triton_policy: TritonPolicy,
                golden_shapes: Mapping[str, Sequence[int]] | None) -> None:
    gpu = triton_policy.gpu
    if gpu.accelerator != "none":
        accel = cfg.optimization.execution_accelerators.gpu_execution_accelerator.add(
            name=gpu.accelerator)
        if gpu.accelerator == "tensorrt":
            trt = gpu.tensorrt
            accel.parameters["precision_mode"] = trt.precision
            accel.parameters["max_workspace_size_bytes"] = str(trt.max_workspace_bytes)
            if trt.engine_cache:
                accel.parameters["trt_engine_cache_enable"] = "1"
                accel.parameters["trt_engine_cache_path"] = "/tmp/trt-engines"
    if gpu.warmup.enabled:
        cfg.model_warmup.extend(warmup_samples(cfg, golden_shapes, data=gpu.warmup.data,
                                               count=gpu.warmup.count))


def warmup_samples(
    cfg: ModelConfig,
    golden_shapes: Mapping[str, Sequence[int]] | None,
    *,
    data: Literal["zero", "random"] = "zero",
    count: int = 1,
) -> list[model_config_pb2.ModelWarmup]:
    """``model_warmup`` entries for ``cfg``, shaped by the golden rows (pure).

    One sample at batch 1 and, when the golden rows and ``max_batch_size`` allow more, one
    at ``min(golden rows, max_batch_size)``, so both the single-request and the full-batch
    shapes are built before the model reports ready. Variable dims (-1) take the golden
    feed's size, else 1.

    Args:
        cfg: A config with its inputs rendered.
        golden_shapes: Input name to the golden feed's shape ``[rows, *dims]``, or None.
        data: ``zero`` or ``random`` tensor contents.
        count: How many times Triton runs each sample.
    """
    shapes = dict(golden_shapes or {})
    batching = cfg.max_batch_size > 0
    rows = min((int(shape[0]) for shape in shapes.values() if len(shape)), default=1)
    sizes = [1]
    if batching and min(rows, cfg.max_batch_size) > 1:
        sizes.append(min(rows, cfg.max_batch_size))
    samples = []
    for batch in sizes:
        sample = model_config_pb2.ModelWarmup(
            name=f"golden_batch_{batch}", batch_size=batch, count=count)
        for tensor in cfg.input:
            golden = list(shapes.get(tensor.name, ()))
            golden_dims = golden[1:] if batching else golden
            dims = []
            for i, d in enumerate(tensor.dims):
                known = golden_dims[i] if i < len(golden_dims) else 1
                dims.append(int(d) if d > 0 else max(int(known), 1))
            entry = sample.inputs[tensor.name]
            entry.data_type = tensor.data_type
            entry.dims.extend(dims)
            if data == "random" and tensor.data_type != model_config_pb2.TYPE_STRING:
                entry.random_data = True
            else:
                entry.zero_data = True
        samples.append(sample)
    return samples


def for_target(cfg: ModelConfig, target: Target) -> ModelConfig:
    """The config a fleet of ``target`` serves, from the staged config (pure, deterministic).

    ``gpu`` returns a copy unchanged (a CPU-rendered config serves on a GPU fleet, slowly;
    lint warns). ``cpu`` derives the CPU form of a GPU config: every ``KIND_GPU`` group
    becomes ``KIND_CPU`` without ``gpus``, and the GPU accelerators and ``model_warmup`` are
    dropped. The derivation depends on the config alone, so every CPU replica, the
    canary and the swap arrive at the same bytes and digests.
    """
    out = _copy(cfg)
    if target == "gpu":
        return out
    for group in out.instance_group:
        if group.kind == model_config_pb2.ModelInstanceGroup.KIND_GPU:
            group.kind = model_config_pb2.ModelInstanceGroup.KIND_CPU
        group.ClearField("gpus")
    if out.HasField("optimization"):
        out.optimization.execution_accelerators.ClearField("gpu_execution_accelerator")
        if not out.optimization.execution_accelerators.ListFields():
            out.optimization.ClearField("execution_accelerators")
        if not out.optimization.ListFields():
            out.ClearField("optimization")
    out.ClearField("model_warmup")
    return out


def _set_specific(cfg: ModelConfig, versions: Iterable[int]) -> None:
    wanted = sorted({int(v) for v in versions})
    if not wanted:
        raise ValidationFailed(
            f"model '{cfg.name}': an empty version list would serve nothing",
            hint="pass at least one version number",
        )
    cfg.ClearField("version_policy")
    cfg.version_policy.specific.versions.extend(wanted)


def _copy(cfg: ModelConfig) -> ModelConfig:
    out = ModelConfig()
    out.CopyFrom(cfg)
    return out


def to_pbtxt(cfg: ModelConfig) -> str:
    """The ``config.pbtxt`` text of a config."""
    return str(text_format.MessageToString(cfg))


def from_pbtxt(text: str) -> ModelConfig:
    """Parse ``config.pbtxt`` text.

    Raises:
        ValidationFailed: the text is not a valid ModelConfig (names the line).
    """
    try:
        return text_format.Parse(text, ModelConfig())
    except text_format.ParseError as exc:
        raise ValidationFailed(
            f"config.pbtxt does not parse: {exc}",
            hint="fix the field named there; see Triton's model_config.proto for the schema",
        ) from exc


def to_json(cfg: ModelConfig) -> str:
    """The JSON for Triton's load-with-config override (``load_model(name, config=...)``).

    Field names follow the proto (``max_batch_size``), as Triton expects; int64 fields come
    out as strings, which Triton accepts.
    """
    return str(json_format.MessageToJson(cfg, preserving_proto_field_name=True, indent=None))


_DEFAULT_OPTIMIZATION = ModelConfig(
    optimization={"input_pinned_memory": {"enable": True}, "output_pinned_memory": {"enable": True}}
).optimization


def from_live_json(obj: Mapping[str, Any]) -> ModelConfig:
    """A config read back from a server, cleaned so it can be sent again or compared.

    Accepts the HTTP ``/config`` document or the gRPC ``get_model_config(as_json=True)``
    answer (``{"config": {...}}``). Unknown fields (a newer server) are ignored. Removed,
    because the server derives them and they would pin this server's choices elsewhere:

    - ``runtime`` (``model.py`` here: it would force the Python runtime on a GPU server,
      where the C++ onnxruntime backend should run);
    - ``platform`` when ``backend`` is set (derived from the backend);
    - ``default_model_filename`` when it is the backend's default ``model.onnx``;
    - instance group names Triton generated (``MODEL_0``, ``MODEL_1``, ...);
    - the pinned input/output memory settings Triton fills in by default (``enable:
      true``), and the ``optimization`` block when nothing else is left in it (a GPU
      config keeps its execution accelerators).

    Raises:
        ValidationFailed: the document is not a ModelConfig.
    """
    doc = obj.get("config", obj) if isinstance(obj.get("config"), Mapping) else obj
    try:
        cfg = json_format.ParseDict(dict(doc), ModelConfig(), ignore_unknown_fields=True)
    except json_format.ParseError as exc:
        raise ValidationFailed(
            f"the server's model config does not parse: {exc}",
            hint="check that the document is a Triton model config",
        ) from exc
    cfg.ClearField("runtime")
    if cfg.backend:
        cfg.ClearField("platform")
    if cfg.default_model_filename == "model.onnx":
        cfg.ClearField("default_model_filename")
    for i, group in enumerate(cfg.instance_group):
        if group.name == f"{cfg.name}_{i}":
            group.ClearField("name")
    if cfg.HasField("optimization"):
        # Triton's pinned-memory defaults, also next to the GPU accelerators we render, so a
        # GPU config and its live copy digest alike
        for name in ("input_pinned_memory", "output_pinned_memory"):
            if getattr(cfg.optimization, name) == getattr(_DEFAULT_OPTIMIZATION, name):
                cfg.optimization.ClearField(name)
        if not cfg.optimization.ListFields():
            cfg.ClearField("optimization")
    return cfg


def _normalised(cfg: ModelConfig, *, keep_versions: bool) -> ModelConfig:
    """Apply Triton's own defaults, so a rendered config and its live copy digest alike."""
    out = _copy(cfg)
    if not out.HasField("version_policy"):
        out.version_policy.latest.num_versions = 1
    if not keep_versions:
        out.ClearField("version_policy")
    batching = out.dynamic_batching
    if out.HasField("dynamic_batching") and not batching.preferred_batch_size:
        if out.max_batch_size > 0:
            batching.preferred_batch_size.append(out.max_batch_size)
    return out


def _digest(cfg: ModelConfig) -> str:
    canonical = json_format.MessageToJson(
        cfg, preserving_proto_field_name=True, indent=None, sort_keys=True
    )
    return hashlib.sha256(canonical.encode()).hexdigest()


def config_digest(cfg: ModelConfig) -> str:
    """sha256 (hex) of the whole config, version policy included.

    The serialisation is canonical (sorted JSON of the proto) and Triton's defaults are
    applied first, so a rendered config and the same config read back with
    :func:`from_live_json` give the same digest.
    """
    return _digest(_normalised(cfg, keep_versions=True))


def serving_digest(cfg: ModelConfig) -> str:
    """sha256 (hex) of how the model is served: the config without its version policy.

    The swap protocol changes only ``version_policy`` (``specific [P]`` → ``[C]``), so two
    replicas, or P's and C's production configs, that agree on I/O, batching and instances
    share this digest while serving different versions. Which versions are served is
    checked separately, from the replicas' ready versions.
    """
    return _digest(_normalised(cfg, keep_versions=False))


# --------------------------------------------------------------------------------------
# swap helpers


def with_versions(cfg: ModelConfig, versions: Sequence[int]) -> ModelConfig:
    """A copy of ``cfg`` that serves exactly ``versions`` (``version_policy: specific``).

    Raises:
        ValidationFailed: ``versions`` is empty.
    """
    out = _copy(cfg)
    _set_specific(out, versions)
    return out


def without_dynamic_batching(cfg: ModelConfig) -> ModelConfig:
    """A copy of ``cfg`` with dynamic batching off: the "pause batching" step of the swap."""
    out = _copy(cfg)
    out.ClearField("dynamic_batching")
    return out


# --------------------------------------------------------------------------------------
# lint


Severity = Literal["error", "warning"]


@dataclass(frozen=True)
class LintFinding:
    """One problem in a config: which rule, what is wrong, how to fix it.

    ``error`` findings block a release; ``warning`` findings are reported only.
    """

    rule: str
    message: str
    hint: str
    severity: Severity = "error"


_VERSION_DIR = re.compile(r"^[1-9][0-9]*$")


def lint(
    cfg: ModelConfig,
    *,
    target: Target,
    version_dirs: Sequence[str] | None = None,
    graph_rank: Mapping[str, int] | None = None,
) -> list[LintFinding]:
    """Check a config for what Triton accepts but then serves wrongly, or refuses late.

    Rules (``rule`` id: what it checks):

    - ``backend``: ``backend`` or ``platform`` is set.
    - ``max-batch-size``: ``max_batch_size`` ≥ 0.
    - ``batching-needs-max-batch-size``: dynamic batching needs ``max_batch_size`` > 0.
    - ``preferred-batch-size``: every preferred size is in 1..``max_batch_size``.
    - ``io-declared``: at least one input and one output.
    - ``unique-names``: no two inputs, and no two outputs, share a name.
    - ``data-type``: every tensor has a data type.
    - ``dims-empty``: every tensor has dims.
    - ``dims-value``: every dim is > 0 or -1 (variable).
    - ``batch-dim-included`` / ``rank-mismatch`` (only with ``graph_rank``, the rank of
      each tensor in the ONNX graph): with ``max_batch_size`` > 0 the dims must be the
      graph's shape minus its leading batch dimension, so ``len(dims) == rank - 1``;
      without batching ``len(dims) == rank``.
    - ``instance-kind``: ``KIND_GPU`` on a cpu target is an error (the model cannot load);
      ``KIND_CPU`` on a gpu target is a warning (it serves, slowly; legitimate for cheap
      models, so it does not block). ``count`` ≥ 1.
    - ``instance-gpus``: device ids (``gpus``) on a ``KIND_CPU`` group (Triton refuses).
    - ``accelerator``: GPU execution accelerators of the onnxruntime backend are
      ``tensorrt`` or ``cuda``; TensorRT's ``precision_mode`` is FP32/FP16/INT8 and
      ``max_workspace_size_bytes`` a positive integer. GPU accelerators without a
      ``KIND_GPU`` group are a warning (ignored).
    - ``warmup``: each ``model_warmup`` sample has a batch size in 1..``max_batch_size``
      (exactly 1 without batching), one entry per config input and no other, the input's
      data type, concrete dims (> 0) of the input's rank that agree with its fixed dims,
      and a data source.
    - ``version-dirs`` (only with ``version_dirs``): version folders are positive integers
      without leading zeros (Triton skips other folders, so the version would silently not
      exist), and every ``specific`` version has a folder.

    ``max_queue_delay_microseconds`` needs no rule: it is a uint64, so the schema rejects a
    negative value when the config is parsed.

    Args:
        cfg: The config to check.
        target: Where it will be served, ``"cpu"`` or ``"gpu"``.
        version_dirs: Names of the folders in the model's repository directory.
        graph_rank: Tensor name to rank in the ONNX graph, for the batch-dimension check.
    """
    findings: list[LintFinding] = []

    def add(rule: str, message: str, hint: str, severity: Severity = "error") -> None:
        findings.append(LintFinding(rule, message, hint, severity))

    scope = _LintScope(cfg, target, version_dirs, graph_rank)
    for check in _LINT_RULES:
        check(scope, add)
    return findings


@dataclass(frozen=True)
class _LintScope:
    """What one :func:`lint` run checks: the config, its target and the facts from outside
    the config (the repository's folders, the graph's ranks) when the caller has them."""

    cfg: ModelConfig
    target: Target
    version_dirs: Sequence[str] | None
    graph_rank: Mapping[str, int] | None


#: ``add(rule, message, hint, severity="error")``: records one finding.
_Add = Callable[..., None]


def _lint_backend(scope: _LintScope, add: _Add) -> None:
    """``backend``."""
    cfg = scope.cfg
    if not cfg.backend and not cfg.platform:
        add("backend", f"model '{cfg.name or '<unnamed>'}' names no backend",
            "set backend: \"onnxruntime\"")


def _lint_batching(scope: _LintScope, add: _Add) -> None:
    """``max-batch-size``, ``batching-needs-max-batch-size``, ``preferred-batch-size``."""
    cfg = scope.cfg
    mbs = cfg.max_batch_size
    if mbs < 0:
        add("max-batch-size", f"max_batch_size is {mbs}", "use 0 (no batching) or a positive size")
    if not cfg.HasField("dynamic_batching"):
        return
    if mbs <= 0:
        add(
            "batching-needs-max-batch-size",
            f"dynamic_batching is on but max_batch_size is {mbs}; Triton accepts this and "
            "then every request fails",
            "set triton.max_batch_size > 0, or disable triton.dynamic_batching",
        )
        return
    bad = [n for n in cfg.dynamic_batching.preferred_batch_size if not 0 < n <= mbs]
    if bad:
        add(
            "preferred-batch-size",
            f"preferred_batch_size {bad} outside 1..max_batch_size ({mbs})",
            "make every triton.dynamic_batching.preferred_batch_sizes entry between 1 "
            "and max_batch_size",
        )


def _lint_io_names(scope: _LintScope, add: _Add) -> None:
    """``io-declared``, ``unique-names``."""
    cfg = scope.cfg
    if not cfg.input or not cfg.output:
        add(
            "io-declared",
            f"model '{cfg.name or '<unnamed>'}' declares {len(cfg.input)} inputs and "
            f"{len(cfg.output)} outputs",
            "render the config from the ONNX graph so every input and output is listed",
        )
    for role, group in (("input", cfg.input), ("output", cfg.output)):
        names = [t.name for t in group]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            add(
                "unique-names",
                f"{role} names repeated: {dupes}",
                f"give each {role} its graph name once",
            )


def _lint_tensors(scope: _LintScope, add: _Add) -> None:
    """``data-type``, ``dims-empty``, ``dims-value``, then the rank rules, tensor by tensor."""
    cfg = scope.cfg
    tensors: list[tuple[str, Any]] = [("input", t) for t in cfg.input]
    tensors += [("output", t) for t in cfg.output]
    for role, t in tensors:
        if t.data_type == model_config_pb2.TYPE_INVALID:
            add(
                "data-type",
                f"{role} '{t.name}' has no data_type",
                "set the graph's dtype, e.g. TYPE_FP32",
            )
        dims = list(t.dims)
        if not dims:
            add(
                "dims-empty",
                f"{role} '{t.name}' has no dims",
                "use dims: [ 1 ] for one value per batch row",
            )
        bad_dims = [d for d in dims if d == 0 or d < -1]
        if bad_dims:
            add(
                "dims-value",
                f"{role} '{t.name}' has dims {dims}",
                "make each dim > 0, or -1 for a variable dim",
            )
        if scope.graph_rank is not None and t.name in scope.graph_rank:
            _lint_rank(f"{role} '{t.name}'", dims, scope.graph_rank[t.name],
                       cfg.max_batch_size, add)


def _lint_rank(where: str, dims: list[int], rank: int, mbs: int, add: _Add) -> None:
    """``batch-dim-included`` / ``rank-mismatch``: dims against the graph tensor's rank."""
    expected = rank - 1 if mbs > 0 else rank
    if len(dims) == expected:
        return
    if mbs > 0 and len(dims) == rank:
        add(
            "batch-dim-included",
            f"{where} dims {dims} include the batch dimension "
            f"(graph rank {rank}, max_batch_size {mbs})",
            f"drop the leading dim: dims {dims[1:]}",
        )
    else:
        add(
            "rank-mismatch",
            f"{where} has {len(dims)} dims but the graph tensor has rank "
            f"{rank} (expected {expected} with max_batch_size {mbs})",
            "render the dims from the graph shape",
        )


def _lint_instances(scope: _LintScope, add: _Add) -> None:
    """``instance-kind``, ``instance-gpus``."""
    for group in scope.cfg.instance_group:
        kind = group.kind
        if scope.target == "cpu" and kind == model_config_pb2.ModelInstanceGroup.KIND_GPU:
            add(
                "instance-kind",
                "instance_group KIND_GPU on a cpu target: the model cannot load",
                "use triton.instance_group.kind 'auto' or 'cpu', or target 'gpu'",
            )
        elif scope.target == "gpu" and kind == model_config_pb2.ModelInstanceGroup.KIND_CPU:
            add(
                "instance-kind",
                "instance_group KIND_CPU on a gpu target: the model runs on the CPU",
                "use triton.instance_group.kind 'auto' or 'gpu' unless CPU is intended",
                "warning",
            )
        if group.count < 1:
            add("instance-kind", f"instance_group count is {group.count}", "use count ≥ 1")
        if kind == model_config_pb2.ModelInstanceGroup.KIND_CPU and group.gpus:
            add("instance-gpus", f"instance_group KIND_CPU lists gpus {list(group.gpus)}",
                "drop triton.instance_group.gpus, or serve on GPU instances")


def _lint_accelerators(scope: _LintScope, add: _Add) -> None:
    """``accelerator``."""
    cfg = scope.cfg
    accelerators = cfg.optimization.execution_accelerators.gpu_execution_accelerator
    on_gpu = any(g.kind == model_config_pb2.ModelInstanceGroup.KIND_GPU
                 for g in cfg.instance_group)
    if accelerators and not on_gpu:
        add("accelerator", "GPU execution accelerators without a KIND_GPU instance group are "
            "ignored", "serve on GPU instances, or drop triton.gpu.accelerator", "warning")
    for accel in accelerators:
        if cfg.backend == "onnxruntime" and accel.name not in _ORT_GPU_ACCELERATORS:
            add("accelerator", f"unknown onnxruntime GPU accelerator '{accel.name}'",
                "use 'tensorrt' or 'cuda'")
        if accel.name != "tensorrt":
            continue
        precision = accel.parameters.get("precision_mode", "FP32")
        if precision not in _TRT_PRECISION:
            add("accelerator", f"TensorRT precision_mode '{precision}'",
                "use one of " + ", ".join(_TRT_PRECISION))
        workspace = accel.parameters.get("max_workspace_size_bytes")
        if workspace is not None and not (workspace.isdigit() and int(workspace) > 0):
            add("accelerator", f"TensorRT max_workspace_size_bytes '{workspace}'",
                "give a positive number of bytes")


def _lint_warmup(scope: _LintScope, add: _Add) -> None:
    """``warmup``."""
    cfg = scope.cfg
    mbs = cfg.max_batch_size
    inputs = {t.name: t for t in cfg.input}
    for sample in cfg.model_warmup:
        where = f"model_warmup '{sample.name or '<unnamed>'}'"
        high = mbs if mbs > 0 else 1
        if not 1 <= sample.batch_size <= high:
            add("warmup", f"{where} batch_size {sample.batch_size} outside 1..{high}",
                "warm up with batch sizes the model accepts")
        missing = sorted(inputs.keys() - sample.inputs.keys())
        extra = sorted(sample.inputs.keys() - inputs.keys())
        if missing or extra:
            add("warmup", f"{where} inputs missing {missing}, unknown {extra}",
                "render the warmup from the config's inputs")
        for name, entry in sample.inputs.items():
            tensor = inputs.get(name)
            if tensor is None:
                continue
            if entry.data_type != tensor.data_type:
                add("warmup", f"{where} input '{name}' data_type differs from the input's",
                    "use the input's data type")
            dims = list(entry.dims)
            fixed = list(tensor.dims)
            if len(dims) != len(fixed) or any(d <= 0 for d in dims) or any(
                    f > 0 and d != f for d, f in zip(dims, fixed, strict=False)):
                add("warmup", f"{where} input '{name}' dims {dims} do not fit {fixed}",
                    "give concrete dims (> 0) of the input's rank")
            if entry.WhichOneof("input_data_type") is None:
                add("warmup", f"{where} input '{name}' has no data",
                    "set zero_data, random_data or input_data_file")


def _lint_version_dirs(scope: _LintScope, add: _Add) -> None:
    """``version-dirs``."""
    if scope.version_dirs is None:
        return
    version_dirs = scope.version_dirs
    bad_dirs = sorted(d for d in version_dirs if not _VERSION_DIR.match(d))
    if bad_dirs:
        add(
            "version-dirs",
            f"version folders {bad_dirs} are not positive integers; Triton ignores them",
            "name each version folder by its MLflow version number, e.g. '2'",
        )
    present = {int(d) for d in version_dirs if _VERSION_DIR.match(d)}
    policy = scope.cfg.version_policy
    if policy.WhichOneof("policy_choice") == "specific":
        missing = sorted(set(policy.specific.versions) - present)
        if missing:
            add(
                "version-dirs",
                f"version_policy names versions {missing} that have no folder",
                "stage those versions first, or serve the versions that exist",
            )


#: The rules of :func:`lint`, in the order their findings are listed.
_LINT_RULES: tuple[Callable[[_LintScope, _Add], None], ...] = (
    _lint_backend, _lint_batching, _lint_io_names, _lint_tensors, _lint_instances,
    _lint_accelerators, _lint_warmup, _lint_version_dirs,
)


def assert_lint_clean(findings: Sequence[LintFinding], *, model: str | None = None) -> None:
    """Raise if any finding is an error; warnings alone pass.

    Raises:
        ValidationFailed: lists every error with its fix; ``findings`` holds all findings.
    """
    errors = [f for f in findings if f.severity == "error"]
    if not errors:
        return
    subject = f"Triton config of '{model}'" if model else "Triton config"
    listed = "; ".join(f"[{f.rule}] {f.message} (fix: {f.hint})" for f in errors)
    raise ValidationFailed(
        f"{subject} failed lint with {len(errors)} error(s): {listed}",
        hint="fix the policy's triton section or the model's I/O, then run modelship check",
        findings=[f.__dict__ for f in findings],
    )


def example_request(cfg: ModelConfig, *, rows: int = 1, random: bool = False,
                    seed: int = 0) -> dict[str, Any]:
    """A valid request for ``cfg`` (pure): ``rows`` rows per input, variable dims set to 1.

    Used by the swap's probes, which only need *an* answer and the version that gave it.
    """
    rng = np.random.default_rng(seed)
    arrays: dict[str, Any] = {}
    for tensor in cfg.input:
        dtype = np.dtype(numpy_dtype_from_triton(tensor.data_type))
        shape = (rows, *[d if d > 0 else 1 for d in tensor.dims])
        if dtype == np.dtype(object):
            arrays[tensor.name] = np.full(shape, b"0", dtype=object)
        elif random and dtype.kind == "f":
            arrays[tensor.name] = rng.standard_normal(shape).astype(dtype)
        else:
            arrays[tensor.name] = np.zeros(shape, dtype=dtype)
    return arrays
