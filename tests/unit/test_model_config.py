"""Triton model configs: rendering, serialisation, digests, swap helpers and lint."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

import pytest
from tritonclient.grpc import model_config_pb2 as pb

from modelship.errors import ValidationFailed
from modelship.policy import DynamicBatchingPolicy, TritonPolicy
from modelship.triton.model_config import (
    LintFinding,
    ModelConfig,
    ModelSpec,
    TensorSpec,
    assert_lint_clean,
    config_digest,
    for_target,
    from_live_json,
    from_pbtxt,
    lint,
    numpy_dtype_from_onnx,
    numpy_dtype_from_triton,
    onnx_elem_type,
    render_model_config,
    serving_digest,
    to_json,
    to_pbtxt,
    triton_dtype,
    with_versions,
    without_dynamic_batching,
)

SPEC = ModelSpec(
    name="fraud",
    inputs=(TensorSpec("features", "float32", (30,)), TensorSpec("country", "object", (1,))),
    outputs=(TensorSpec("label", "int64", (1,)), TensorSpec("probabilities", "float32", (2,))),
)


def render(**policy: object) -> ModelConfig:
    return render_model_config(SPEC, TritonPolicy.model_validate(policy), versions=[3])


# ---------------------------------------------------------------------------- dtypes


@pytest.mark.parametrize(
    ("numpy", "triton", "onnx"),
    [
        ("float32", "TYPE_FP32", 1),
        ("float64", "TYPE_FP64", 11),
        ("float16", "TYPE_FP16", 10),
        ("int64", "TYPE_INT64", 7),
        ("int32", "TYPE_INT32", 6),
        ("uint8", "TYPE_UINT8", 2),
        ("bool", "TYPE_BOOL", 9),
        ("object", "TYPE_STRING", 8),
    ],
)
def test_dtype_mapping_round_trips(numpy: str, triton: str, onnx: int) -> None:
    assert triton_dtype(numpy) == triton
    assert numpy_dtype_from_triton(triton) == numpy
    assert numpy_dtype_from_triton(pb.DataType.Value(triton)) == numpy
    assert onnx_elem_type(numpy) == onnx
    assert numpy_dtype_from_onnx(onnx) == numpy


@pytest.mark.parametrize(("alias", "canonical"), [("<f4", "float32"), ("string", "object"),
                                                  ("bytes", "object"), ("float", "float64")])
def test_dtype_aliases(alias: str, canonical: str) -> None:
    assert TensorSpec("x", alias, (1,)).dtype == canonical


@pytest.mark.parametrize("call", [
    lambda: triton_dtype("complex64"),
    lambda: triton_dtype("not-a-dtype"),
    lambda: numpy_dtype_from_triton("TYPE_INVALID"),
    lambda: numpy_dtype_from_onnx(14),  # COMPLEX64
])
def test_unsupported_dtypes_fail_validation(call: object) -> None:
    with pytest.raises(ValidationFailed):
        call()  # type: ignore[operator]


# ---------------------------------------------------------------------------- render


def test_render_follows_the_policy() -> None:
    cfg = render(max_batch_size=16, dynamic_batching={"preferred_batch_sizes": [4, 8]})
    assert cfg.name == "fraud" and cfg.backend == "onnxruntime"
    assert cfg.max_batch_size == 16
    assert [(t.name, pb.DataType.Name(t.data_type), list(t.dims)) for t in cfg.input] == [
        ("features", "TYPE_FP32", [30]),
        ("country", "TYPE_STRING", [1]),
    ]
    assert list(cfg.dynamic_batching.preferred_batch_size) == [4, 8]
    assert cfg.dynamic_batching.max_queue_delay_microseconds == 100
    assert [(g.kind, g.count) for g in cfg.instance_group] == [(pb.ModelInstanceGroup.KIND_CPU, 1)]
    assert list(cfg.version_policy.specific.versions) == [3]


@pytest.mark.parametrize(
    ("policy", "target", "kind"),
    [
        ({}, None, pb.ModelInstanceGroup.KIND_CPU),
        ({"target": "gpu"}, None, pb.ModelInstanceGroup.KIND_GPU),
        ({"target": "gpu"}, "cpu", pb.ModelInstanceGroup.KIND_CPU),
        (
            {"target": "gpu", "instance_group": {"kind": "cpu"}},
            None,
            pb.ModelInstanceGroup.KIND_CPU,
        ),
    ],
)
def test_instance_kind_follows_target(
    policy: dict[str, object], target: Any, kind: int
) -> None:
    cfg = render_model_config(SPEC, TritonPolicy.model_validate(policy), target=target)
    assert cfg.instance_group[0].kind == kind


def test_render_without_versions_serves_latest_and_without_batching_has_none() -> None:
    policy = TritonPolicy(dynamic_batching=DynamicBatchingPolicy(enabled=False))
    cfg = render_model_config(SPEC, policy)
    assert cfg.version_policy.latest.num_versions == 1
    assert not cfg.HasField("dynamic_batching")


def test_render_rejects_an_empty_version_list() -> None:
    with pytest.raises(ValidationFailed, match="empty version list"):
        render_model_config(SPEC, TritonPolicy(), versions=[])


# ---------------------------------------------------------------------------- serialisation


def test_pbtxt_round_trip() -> None:
    cfg = render()
    text = to_pbtxt(cfg)
    assert 'backend: "onnxruntime"' in text and "KIND_CPU" in text
    assert from_pbtxt(text) == cfg


@pytest.mark.parametrize(
    "text",
    ["name: 'x'\nmax_batch_siz: 4\n", "dynamic_batching { max_queue_delay_microseconds: -1 }"],
)
def test_bad_pbtxt_fails_validation(text: str) -> None:
    with pytest.raises(ValidationFailed, match="does not parse"):
        from_pbtxt(text)


def test_json_override_round_trip() -> None:
    cfg = render()
    text = to_json(cfg)
    doc = json.loads(text)
    assert doc["max_batch_size"] == 32  # proto field names, as Triton expects
    assert doc["version_policy"] == {"specific": {"versions": ["3"]}}
    assert from_live_json(doc) == cfg


# What Triton 2.51 returned for a config rendered like render() (HTTP /config shape).
LIVE = {
    "name": "fraud",
    "platform": "onnxruntime_onnx",
    "backend": "onnxruntime",
    "runtime": "model.py",
    "version_policy": {"specific": {"versions": ["3"]}},
    "max_batch_size": 32,
    "input": [
        {"name": "features", "data_type": "TYPE_FP32", "format": "FORMAT_NONE", "dims": [30],
         "is_shape_tensor": False, "allow_ragged_batch": False, "optional": False,
         "is_non_linear_format_io": False},
        {"name": "country", "data_type": "TYPE_STRING", "dims": [1]},
    ],
    "output": [
        {"name": "label", "data_type": "TYPE_INT64", "dims": [1], "label_filename": ""},
        {"name": "probabilities", "data_type": "TYPE_FP32", "dims": [2]},
    ],
    "batch_input": [],
    "batch_output": [],
    "optimization": {"priority": "PRIORITY_DEFAULT", "input_pinned_memory": {"enable": True},
                     "output_pinned_memory": {"enable": True},
                     "gather_kernel_buffer_threshold": 0, "eager_batching": False},
    "dynamic_batching": {"preferred_batch_size": [32], "max_queue_delay_microseconds": 100,
                         "preserve_ordering": False, "priority_levels": 0,
                         "default_priority_level": 0, "priority_queue_policy": {}},
    "instance_group": [{"name": "fraud_0", "kind": "KIND_CPU", "count": 1, "gpus": [],
                        "secondary_devices": [], "profile": [], "passive": False,
                        "host_policy": ""}],
    "default_model_filename": "model.onnx",
    "cc_model_filenames": {},
    "metric_tags": {},
    "parameters": {},
    "model_warmup": [],
    "a_field_from_a_newer_server": {"x": 1},
}


@pytest.mark.parametrize("doc", [LIVE, {"config": LIVE}], ids=["http", "grpc-as-json"])
def test_from_live_json_strips_server_fields(doc: dict[str, object]) -> None:
    cfg = from_live_json(doc)
    assert not cfg.runtime and not cfg.platform and not cfg.default_model_filename
    assert not cfg.HasField("optimization")
    assert cfg.instance_group[0].name == ""
    assert '"runtime"' not in to_json(cfg)
    # Triton's filled-in preferred size is its default: the digests still match.
    assert config_digest(cfg) == config_digest(render())
    assert serving_digest(cfg) == serving_digest(render())


def test_from_live_json_keeps_non_default_choices() -> None:
    doc = {**LIVE, "default_model_filename": "graph.onnx",
           "optimization": {"input_pinned_memory": {"enable": False}},
           "instance_group": [{"name": "gpu_pool", "kind": "KIND_GPU", "count": 2}]}
    cfg = from_live_json(doc)
    assert cfg.default_model_filename == "graph.onnx"
    assert cfg.HasField("optimization")
    assert cfg.instance_group[0].name == "gpu_pool"


def test_a_gpu_config_and_its_live_copy_digest_alike() -> None:
    """Triton adds its pinned-memory defaults next to the accelerators we render: a GPU
    fleet serving the staged config is a no-op swap, not a reload every time."""
    cfg = render_gpu(instance_group={"count": 1, "gpus": [0]}, gpu={"accelerator": "tensorrt"})
    live = json.loads(to_json(cfg))
    live["optimization"].update({"priority": "PRIORITY_DEFAULT",
                                 "input_pinned_memory": {"enable": True},
                                 "output_pinned_memory": {"enable": True},
                                 "gather_kernel_buffer_threshold": 0, "eager_batching": False})
    live["instance_group"][0]["name"] = "fraud_0"
    back = from_live_json({**live, "runtime": "model.py", "platform": "onnxruntime_onnx"})
    assert _accelerators(back) == _accelerators(cfg) and back.model_warmup == cfg.model_warmup
    assert serving_digest(back) == serving_digest(cfg)
    assert config_digest(back) == config_digest(cfg)


def test_from_live_json_rejects_garbage() -> None:
    with pytest.raises(ValidationFailed):
        from_live_json({"max_batch_size": "many"})


# ---------------------------------------------------------------------------- digests


def test_digest_is_of_the_content_not_of_the_object() -> None:
    base = render()
    # the same content reached another way: serialised to pbtxt and parsed back
    reparsed = from_pbtxt(to_pbtxt(base))
    assert reparsed is not base
    assert config_digest(reparsed) == config_digest(base)
    assert serving_digest(reparsed) == serving_digest(base)
    assert re.fullmatch(r"[0-9a-f]{64}", config_digest(base))
    # other content: another version policy changes the config digest but not how it serves
    other = with_versions(base, [4])
    assert config_digest(other) != config_digest(base)
    assert serving_digest(other) == serving_digest(base)


@pytest.mark.parametrize(
    "change",
    [
        lambda c: setattr(c, "max_batch_size", 16),
        lambda c: c.input[0].dims.__setitem__(0, 31),
        lambda c: setattr(c.dynamic_batching, "max_queue_delay_microseconds", 500),
        lambda c: setattr(c.instance_group[0], "count", 2),
        lambda c: c.ClearField("dynamic_batching"),
    ],
)
def test_digests_change_when_serving_changes(change: object) -> None:
    base = render()
    changed = render()
    change(changed)  # type: ignore[operator]
    assert config_digest(changed) != config_digest(base)
    assert serving_digest(changed) != serving_digest(base)


def test_serving_digest_ignores_the_version_policy() -> None:
    p, c = render(), with_versions(render(), [4])
    assert config_digest(p) != config_digest(c)
    assert serving_digest(p) == serving_digest(c)


def test_absent_version_policy_digests_as_latest_one() -> None:
    cfg = render_model_config(SPEC, TritonPolicy())
    bare = ModelConfig()
    bare.CopyFrom(cfg)
    bare.ClearField("version_policy")
    assert config_digest(bare) == config_digest(cfg)


# ---------------------------------------------------------------------------- swap helpers


def test_swap_helpers_do_not_mutate_their_input() -> None:
    cfg = render()
    before = cfg.SerializeToString(deterministic=True)
    paused = without_dynamic_batching(cfg)
    moved = with_versions(paused, [5, 4, 5])
    assert cfg.SerializeToString(deterministic=True) == before
    assert cfg.HasField("dynamic_batching") and not paused.HasField("dynamic_batching")
    assert list(paused.version_policy.specific.versions) == [3]
    assert list(moved.version_policy.specific.versions) == [4, 5]
    assert not moved.HasField("dynamic_batching")
    latest = render_model_config(SPEC, TritonPolicy())
    assert with_versions(latest, [7]).version_policy.WhichOneof("policy_choice") == "specific"


def test_with_versions_rejects_empty() -> None:
    with pytest.raises(ValidationFailed):
        with_versions(render(), [])


# ---------------------------------------------------------------------------- lint


BASE = (
    'name: "fraud" backend: "onnxruntime" max_batch_size: 32 '
    'input { name: "x" data_type: TYPE_FP32 dims: [ 4 ] } '
    'output { name: "y" data_type: TYPE_FP32 dims: [ 2 ] } '
    "instance_group { kind: KIND_CPU count: 1 } "
    "dynamic_batching { max_queue_delay_microseconds: 100 } "
)
KIND_GPU = pb.ModelInstanceGroup.KIND_GPU


def _cfg(change: Callable[[ModelConfig], object] | None = None) -> ModelConfig:
    cfg = from_pbtxt(BASE)
    if change is not None:
        change(cfg)
    return cfg


def _dims(tensor: Any, *dims: int) -> None:
    del tensor.dims[:]
    tensor.dims.extend(dims)


def _unbatched(cfg: ModelConfig, max_batch_size: int) -> None:
    cfg.max_batch_size = max_batch_size
    cfg.ClearField("dynamic_batching")


def _unbatched_full_rank(cfg: ModelConfig) -> None:
    _unbatched(cfg, 0)
    _dims(cfg.input[0], -1, 4)
    _dims(cfg.output[0], -1, 2)


Change = Callable[[ModelConfig], object] | None
CASES: list[tuple[str, Change, dict[str, Any], str | None]] = [
    # id, change to the clean base config, lint kwargs, the rule expected to fail (None: clean)
    ("clean", None, {}, None),
    ("batching needs mbs", lambda c: setattr(c, "max_batch_size", 0), {},
     "batching-needs-max-batch-size"),
    ("mbs 0 without batching", lambda c: _unbatched(c, 0), {}, None),
    ("negative mbs", lambda c: _unbatched(c, -1), {}, "max-batch-size"),
    ("preferred ok", lambda c: c.dynamic_batching.preferred_batch_size.extend([8, 32]), {}, None),
    ("preferred > max", lambda c: c.dynamic_batching.preferred_batch_size.append(64), {},
     "preferred-batch-size"),
    ("preferred 0", lambda c: c.dynamic_batching.preferred_batch_size.append(0), {},
     "preferred-batch-size"),
    ("gpu kind on cpu", lambda c: setattr(c.instance_group[0], "kind", KIND_GPU),
     {"target": "cpu"}, "instance-kind"),
    ("gpu kind on gpu", lambda c: setattr(c.instance_group[0], "kind", KIND_GPU),
     {"target": "gpu"}, None),
    ("instance count 0", lambda c: setattr(c.instance_group[0], "count", 0), {}, "instance-kind"),
    ("numeric versions", None, {"version_dirs": ["1", "2"]}, None),
    ("non-numeric version", None, {"version_dirs": ["1", "v2"]}, "version-dirs"),
    ("leading zero version", None, {"version_dirs": ["01"]}, "version-dirs"),
    ("specific present", lambda c: c.version_policy.specific.versions.append(2),
     {"version_dirs": ["1", "2"]}, None),
    ("specific missing", lambda c: c.version_policy.specific.versions.append(3),
     {"version_dirs": ["1", "2"]}, "version-dirs"),
    ("rank ok", None, {"graph_rank": {"x": 2, "y": 2}}, None),
    ("batch dim included", lambda c: _dims(c.input[0], -1, 4), {"graph_rank": {"x": 2}},
     "batch-dim-included"),
    ("no batching keeps full rank", _unbatched_full_rank, {"graph_rank": {"x": 2, "y": 2}}, None),
    ("rank mismatch", None, {"graph_rank": {"x": 3}}, "rank-mismatch"),
    ("empty dims", lambda c: _dims(c.input[0]), {}, "dims-empty"),
    ("zero dim", lambda c: _dims(c.input[0], 0), {}, "dims-value"),
    ("variable dim ok", lambda c: _dims(c.input[0], -1), {}, None),
    ("duplicate names", lambda c: c.input.add(name="x", data_type=pb.TYPE_INT64, dims=[1]), {},
     "unique-names"),
    ("no data type", lambda c: setattr(c.output[0], "data_type", pb.TYPE_INVALID), {},
     "data-type"),
    ("no outputs", lambda c: c.ClearField("output"), {}, "io-declared"),
    ("no backend", lambda c: c.ClearField("backend"), {}, "backend"),
]


@pytest.mark.parametrize(
    ("change", "kwargs", "rule"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_lint_rules(change: Change, kwargs: dict[str, Any], rule: str | None) -> None:
    findings = lint(_cfg(change), **{"target": "cpu", **kwargs})
    errors = [f for f in findings if f.severity == "error"]
    if rule is None:
        assert errors == []
        assert_lint_clean(findings)
    else:
        assert [f.rule for f in errors] == [rule]
        assert errors[0].message and errors[0].hint


def test_cpu_kind_on_gpu_target_is_a_warning_only() -> None:
    findings = lint(_cfg(), target="gpu")
    assert [(f.rule, f.severity) for f in findings] == [("instance-kind", "warning")]
    assert_lint_clean(findings)  # does not raise


def test_rendered_default_config_is_lint_clean() -> None:
    cfg = render()
    ranks = {"features": 2, "country": 2, "label": 2, "probabilities": 2}
    assert lint(cfg, target="cpu", version_dirs=["3"], graph_rank=ranks) == []


def test_assert_lint_clean_lists_every_error_with_its_fix() -> None:
    findings = lint(
        _cfg(lambda c: setattr(c, "max_batch_size", 0)), target="cpu", version_dirs=["v2"]
    )
    with pytest.raises(ValidationFailed) as info:
        assert_lint_clean(findings, model="fraud")
    message = info.value.message
    assert "'fraud'" in message and "2 error(s)" in message
    assert "[batching-needs-max-batch-size]" in message and "[version-dirs]" in message
    assert message.count("(fix: ") == 2
    assert len(info.value.details["findings"]) == 2


def test_lint_finding_is_a_value() -> None:
    assert LintFinding("r", "m", "h") == LintFinding("r", "m", "h", "error")


# ---------------------------------------------------------------------------- GPU rendering

GOLDEN = {"features": (20, 30), "country": (20, 1)}


def render_gpu(golden: dict[str, tuple[int, ...]] | None = GOLDEN, **triton: Any) -> ModelConfig:
    policy = TritonPolicy.model_validate({"target": "gpu", **triton})
    return render_model_config(SPEC, policy, versions=[3], golden_shapes=golden)


def _accelerators(cfg: ModelConfig) -> list[tuple[str, dict[str, str]]]:
    found = cfg.optimization.execution_accelerators.gpu_execution_accelerator
    return [(a.name, dict(a.parameters)) for a in found]


TRT_DEFAULTS = {"precision_mode": "FP16", "max_workspace_size_bytes": str(1024 * 1024 * 1024),
                "trt_engine_cache_enable": "1", "trt_engine_cache_path": "/tmp/trt-engines"}
GPU_CASES: list[tuple[str, dict[str, Any], list[tuple[str, dict[str, str]]]]] = [
    # id, triton policy (target gpu), the accelerators expected
    ("cuda default", {}, [("cuda", {})]),
    ("no accelerator", {"gpu": {"accelerator": "none"}}, []),
    ("tensorrt defaults", {"gpu": {"accelerator": "tensorrt"}}, [("tensorrt", TRT_DEFAULTS)]),
    ("tensorrt fp32 2GiB no cache",
     {"gpu": {"accelerator": "tensorrt",
              "tensorrt": {"precision": "FP32", "max_workspace_bytes": 2 << 30,
                           "engine_cache": False}}},
     [("tensorrt", {"precision_mode": "FP32", "max_workspace_size_bytes": str(2 << 30)})]),
    ("tensorrt int8", {"gpu": {"accelerator": "tensorrt", "tensorrt": {"precision": "INT8"}}},
     [("tensorrt", {**TRT_DEFAULTS, "precision_mode": "INT8"})]),
]


@pytest.mark.parametrize(("triton", "accelerators"), [c[1:] for c in GPU_CASES],
                         ids=[c[0] for c in GPU_CASES])
@pytest.mark.parametrize("gpus", [None, [0], [0, 1]])
@pytest.mark.parametrize("count", [1, 2])
def test_gpu_rendering_table(triton: dict[str, Any], accelerators: list[Any],
                             gpus: list[int] | None, count: int) -> None:
    cfg = render_gpu(**triton, instance_group={"count": count, "gpus": gpus})
    (group,) = cfg.instance_group
    assert (group.kind, group.count, list(group.gpus)) == (KIND_GPU, count, gpus or [])
    assert _accelerators(cfg) == accelerators
    assert [w.batch_size for w in cfg.model_warmup] == [1, 20]
    # Triton's schema reads back exactly what was rendered, and lint finds nothing.
    assert from_pbtxt(to_pbtxt(cfg)) == cfg
    assert lint(cfg, target="gpu", graph_rank={"features": 2, "country": 2}) == []
    # The CPU form of the same config: no GPU, no accelerator, no warmup, still clean.
    cpu = for_target(cfg, "cpu")
    assert [(g.kind, g.count, list(g.gpus)) for g in cpu.instance_group] == [
        (pb.ModelInstanceGroup.KIND_CPU, count, [])]
    assert not cpu.HasField("optimization") and not cpu.model_warmup
    assert lint(cpu, target="cpu") == []
    assert serving_digest(cpu) == serving_digest(render(instance_group={"count": count}))


@pytest.mark.parametrize(
    ("golden", "max_batch_size", "sizes", "features_dims"),
    [
        (GOLDEN, 32, [1, 20], [30]),
        ({"features": (100, 30), "country": (100, 1)}, 32, [1, 32], [30]),
        ({"features": (1, 30), "country": (1, 1)}, 32, [1], [30]),
        (None, 32, [1], [30]),
        (GOLDEN, 0, [1], [30]),  # no batching: one sample, dims are the full shape
    ],
    ids=["rows<mbs", "rows>mbs", "one row", "no golden", "no batching"],
)
def test_warmup_is_shaped_by_the_golden_rows(
    golden: dict[str, tuple[int, ...]] | None, max_batch_size: int, sizes: list[int],
    features_dims: list[int],
) -> None:
    batching = {"enabled": max_batch_size > 0}
    cfg = render_gpu(golden, max_batch_size=max_batch_size, dynamic_batching=batching)
    assert [w.batch_size for w in cfg.model_warmup] == sizes
    for sample in cfg.model_warmup:
        assert set(sample.inputs) == {"features", "country"}
        assert sample.inputs["country"].data_type == pb.TYPE_STRING
        assert sample.inputs["country"].WhichOneof("input_data_type") == "zero_data"
    if max_batch_size:
        assert list(cfg.model_warmup[0].inputs["features"].dims) == features_dims
    assert [f for f in lint(cfg, target="gpu") if f.severity == "error"] == []


def test_warmup_resolves_variable_dims_from_the_golden_rows() -> None:
    spec = ModelSpec("seq", inputs=(TensorSpec("tokens", "int64", (-1,)),),
                     outputs=(TensorSpec("score", "float32", (1,)),))
    policy = TritonPolicy.model_validate({"target": "gpu", "gpu": {"warmup": {"data": "random"}}})
    cfg = render_model_config(spec, policy, golden_shapes={"tokens": (8, 128)})
    assert [list(w.inputs["tokens"].dims) for w in cfg.model_warmup] == [[128], [128]]
    assert cfg.model_warmup[0].inputs["tokens"].random_data
    no_golden = render_model_config(spec, policy)
    assert [list(w.inputs["tokens"].dims) for w in no_golden.model_warmup] == [[1]]


def test_warmup_can_be_turned_off_and_cpu_target_never_renders_gpu_parts() -> None:
    off = render_gpu(gpu={"warmup": {"enabled": False}})
    assert not off.model_warmup and _accelerators(off) == [("cuda", {})]
    cpu = render_model_config(SPEC, TritonPolicy(), golden_shapes=GOLDEN)
    assert not cpu.HasField("optimization") and not cpu.model_warmup


def test_for_target_gpu_is_an_unchanged_copy() -> None:
    cfg = render_gpu()
    out = for_target(cfg, "gpu")
    assert out == cfg and out is not cfg


def test_gpus_need_gpu_instances() -> None:
    with pytest.raises(ValueError, match="gpus"):
        TritonPolicy.model_validate({"target": "gpu", "instance_group": {"kind": "cpu",
                                                                         "gpus": [0]}})
    with pytest.raises(ValueError, match="distinct"):
        TritonPolicy.model_validate({"target": "gpu", "instance_group": {"gpus": [0, 0]}})


def _gpu_cfg(change: Callable[[ModelConfig], object] | None = None) -> ModelConfig:
    cfg = render_gpu(gpu={"accelerator": "tensorrt"})
    if change is not None:
        change(cfg)
    return cfg


def _trt(cfg: ModelConfig) -> Any:
    return cfg.optimization.execution_accelerators.gpu_execution_accelerator[0]


GPU_LINT: list[tuple[str, Change, str, str | None]] = [
    # id, change to a clean TensorRT config, target, rule expected to fail (None: clean)
    ("clean", None, "gpu", None),
    ("unknown accelerator", lambda c: setattr(_trt(c), "name", "openvino"), "gpu",
     "accelerator"),
    ("bad precision", lambda c: _trt(c).parameters.__setitem__("precision_mode", "FP8"), "gpu",
     "accelerator"),
    ("bad workspace", lambda c: _trt(c).parameters.__setitem__("max_workspace_size_bytes", "-1"),
     "gpu", "accelerator"),
    ("gpus on cpu group", lambda c: c.instance_group[0].MergeFrom(
        pb.ModelInstanceGroup(kind=pb.ModelInstanceGroup.KIND_CPU, gpus=[0])), "gpu",
     "instance-gpus"),
    ("warmup batch too big", lambda c: setattr(c.model_warmup[1], "batch_size", 64), "gpu",
     "warmup"),
    ("warmup missing input", lambda c: c.model_warmup[0].inputs.pop("country"), "gpu", "warmup"),
    ("warmup wrong dtype", lambda c: setattr(c.model_warmup[0].inputs["features"], "data_type",
                                             pb.TYPE_FP16), "gpu", "warmup"),
    ("warmup variable dim", lambda c: _dims(c.model_warmup[0].inputs["features"], -1), "gpu",
     "warmup"),
    ("warmup wrong dim", lambda c: _dims(c.model_warmup[0].inputs["features"], 31), "gpu",
     "warmup"),
    ("warmup no data", lambda c: c.model_warmup[0].inputs["features"].ClearField("zero_data"),
     "gpu", "warmup"),
    ("gpu config on cpu", None, "cpu", "instance-kind"),
]


@pytest.mark.parametrize(("change", "target", "rule"), [c[1:] for c in GPU_LINT],
                         ids=[c[0] for c in GPU_LINT])
def test_gpu_lint_rules(change: Change, target: str, rule: str | None) -> None:
    cfg = _gpu_cfg(change)
    errors = [f for f in lint(cfg, target=target) if f.severity == "error"]  # type: ignore[arg-type]
    assert [f.rule for f in errors] == ([] if rule is None else [rule])
    assert all(f.message and f.hint for f in errors)


def test_gpu_accelerator_on_cpu_instances_is_a_warning() -> None:
    cfg = render_gpu(instance_group={"kind": "cpu"})
    findings = lint(cfg, target="gpu")
    assert {(f.rule, f.severity) for f in findings} == {
        ("instance-kind", "warning"), ("accelerator", "warning")}
