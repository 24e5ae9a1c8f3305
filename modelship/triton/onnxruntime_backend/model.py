"""A Triton Python-based backend that serves ONNX models with onnxruntime on the CPU.

Triton's "Python-based backends" feature runs ``<backend-directory>/onnxruntime/model.py``
for every model whose config says ``backend: "onnxruntime"`` (or
``platform: "onnxruntime_onnx"``) when no C++ ``libtriton_onnxruntime.so`` is installed.
The model directory then needs only ``config.pbtxt`` and ``<version>/model.onnx`` (plus any
external-data files next to it), exactly as for the C++ backend, so the same
``config.pbtxt`` works on a GPU server.

Behaviour, chosen to match the C++ backend where it matters:

* At load time the config is checked against the graph. An input or output name that is
  not in the graph, a graph input the config does not feed, a data type that differs, or a
  shape that cannot match is refused with a message that names both sides.
* A dynamic batch of requests becomes ONE onnxruntime run: inputs are concatenated along
  the batch dimension and outputs split back per request.
* Each request gets only the outputs it asked for (all configured outputs when it asked
  for none), cast to the config's data type and shaped like the config says.
* Threads are modest (``intra_op_thread_count`` = 1 unless the config's ``parameters``
  say otherwise), so several instances can share a small CPU.

This file runs inside the server's own Python environment (numpy < 2, onnxruntime), not
the project's; it imports nothing from modelship.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
import onnxruntime as ort
import triton_python_backend_utils as pb_utils

# onnxruntime type string -> Triton config data type.
_ORT_TO_TRITON = {
    "tensor(float)": "TYPE_FP32",
    "tensor(double)": "TYPE_FP64",
    "tensor(float16)": "TYPE_FP16",
    "tensor(bfloat16)": "TYPE_BF16",
    "tensor(int8)": "TYPE_INT8",
    "tensor(int16)": "TYPE_INT16",
    "tensor(int32)": "TYPE_INT32",
    "tensor(int64)": "TYPE_INT64",
    "tensor(uint8)": "TYPE_UINT8",
    "tensor(uint16)": "TYPE_UINT16",
    "tensor(uint32)": "TYPE_UINT32",
    "tensor(uint64)": "TYPE_UINT64",
    "tensor(bool)": "TYPE_BOOL",
    "tensor(string)": "TYPE_STRING",
}

# Parameter keys understood by Triton's C++ onnxruntime backend, honoured here too.
_INTRA_OP_KEY = "intra_op_thread_count"
_INTER_OP_KEY = "inter_op_thread_count"
_DEFAULT_INTRA_OP = 1
_DEFAULT_INTER_OP = 1


class ConfigMismatch(ValueError):
    """The model configuration does not fit the ONNX graph."""


def _dims(values: Any) -> list[int]:
    return [int(v) for v in (values or [])]


def _parameter(config: dict[str, Any], key: str) -> str | None:
    entry = (config.get("parameters") or {}).get(key)
    if isinstance(entry, dict):
        value = entry.get("string_value")
        return None if value in (None, "") else str(value)
    return None


def _shape_text(shape: list[Any]) -> str:
    return "[" + ",".join(str(d) if isinstance(d, int) else "-1" for d in shape) + "]"


def _is_fixed(dim: Any) -> bool:
    return isinstance(dim, int) and dim >= 0


class _TensorSpec:
    """One configured input or output, resolved against the graph."""

    def __init__(self, entry: dict[str, Any]) -> None:
        self.name: str = entry["name"]
        self.data_type: str = entry.get("data_type", "TYPE_INVALID")
        self.dims = _dims(entry.get("dims"))
        reshape = entry.get("reshape")
        # With a reshape the backend sees (inputs) / produces (outputs) the reshaped shape.
        self.model_dims = _dims(reshape.get("shape")) if isinstance(reshape, dict) else self.dims
        self.optional = bool(entry.get("optional", False))
        self.np_dtype = (
            np.dtype(object)
            if self.data_type == "TYPE_STRING"
            else np.dtype(pb_utils.triton_string_to_numpy(self.data_type))
        )


class TritonPythonModel:
    """Runs one ONNX model version with onnxruntime, batching a whole dynamic batch at once."""

    def initialize(self, args: dict[str, str]) -> None:
        """Load ``<model_repository>/<version>/model.onnx`` and check the config against it.

        Args:
            args: Triton's arguments; ``model_config`` (JSON), ``model_repository`` (the
                model's directory, local even for an S3 repository), ``model_version`` and
                ``model_name`` are used.

        Raises:
            ConfigMismatch: The config's inputs, outputs, data types or shapes do not fit the
                graph.
            FileNotFoundError: The version folder holds no ONNX file.
        """
        self.config: dict[str, Any] = json.loads(args["model_config"])
        self.model_name: str = args.get("model_name") or self.config.get("name", "?")
        self.max_batch_size = int(self.config.get("max_batch_size", 0) or 0)

        filename = self.config.get("default_model_filename") or ""
        if not filename or filename.endswith(".py"):
            filename = "model.onnx"
        version_dir = os.path.join(args["model_repository"], str(args["model_version"]))
        path = os.path.join(version_dir, filename)
        if not os.path.isfile(path):
            present = sorted(os.listdir(version_dir)) if os.path.isdir(version_dir) else []
            raise FileNotFoundError(
                f"model '{self.model_name}': no ONNX file at {path} (version folder holds "
                f"{present}); put the graph at <version>/{filename}, with any external-data "
                "files next to it"
            )

        options = ort.SessionOptions()
        options.intra_op_num_threads = self._thread_count(_INTRA_OP_KEY, _DEFAULT_INTRA_OP)
        options.inter_op_num_threads = self._thread_count(_INTER_OP_KEY, _DEFAULT_INTER_OP)
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        # Loading from the path (not bytes) lets onnxruntime find external data next to it.
        self.session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])

        self.inputs = [_TensorSpec(e) for e in self.config.get("input", [])]
        self.outputs = [_TensorSpec(e) for e in self.config.get("output", [])]
        self._check_config()
        self.output_by_name = {spec.name: spec for spec in self.outputs}

    def _thread_count(self, key: str, default: int) -> int:
        raw = _parameter(self.config, key)
        if raw is None:
            return default
        try:
            value = int(raw)
        except ValueError:
            raise ConfigMismatch(
                f"model '{self.model_name}': parameter {key}={raw!r} is not an integer"
            ) from None
        return max(value, 0)

    # -- load-time checks -------------------------------------------------------------

    def _check_config(self) -> None:
        graph_inputs = {arg.name: arg for arg in self.session.get_inputs()}
        graph_outputs = {arg.name: arg for arg in self.session.get_outputs()}
        problems: list[str] = []

        unknown_in = [s.name for s in self.inputs if s.name not in graph_inputs]
        if unknown_in:
            problems.append(
                f"configuration has input(s) {unknown_in} that the ONNX graph does not have; "
                f"the graph's inputs are {sorted(graph_inputs)}"
            )
        configured_in = {s.name for s in self.inputs}
        unfed = [name for name in graph_inputs if name not in configured_in]
        if unfed:
            problems.append(
                f"the ONNX graph needs input(s) {unfed} that the configuration does not "
                f"declare; the configuration's inputs are {sorted(configured_in)}"
            )
        unknown_out = [s.name for s in self.outputs if s.name not in graph_outputs]
        if unknown_out:
            problems.append(
                f"configuration has output(s) {unknown_out} that the ONNX graph does not "
                f"have; the graph's outputs are {sorted(graph_outputs)}"
            )
        if not self.outputs:
            problems.append(
                f"configuration declares no outputs; the graph's outputs are "
                f"{sorted(graph_outputs)}"
            )

        for kind, specs, graph in (
            ("input", self.inputs, graph_inputs),
            ("output", self.outputs, graph_outputs),
        ):
            for spec in specs:
                arg = graph.get(spec.name)
                if arg is not None:
                    problems.extend(self._check_tensor(kind, spec, arg))

        if problems:
            raise ConfigMismatch(
                f"unable to load model '{self.model_name}': the configuration does not match "
                "the ONNX graph: " + "; ".join(problems)
            )

    def _check_tensor(self, kind: str, spec: _TensorSpec, arg: Any) -> list[str]:
        problems: list[str] = []
        graph_type = _ORT_TO_TRITON.get(arg.type)
        if graph_type is None:
            problems.append(
                f"{kind} '{spec.name}' has graph type {arg.type}, which is not a plain tensor "
                "(for scikit-learn classifiers convert with options {id(clf): "
                "{'zipmap': False}})"
            )
        elif graph_type != spec.data_type:
            problems.append(
                f"{kind} '{spec.name}' has data type {spec.data_type} in the configuration "
                f"but {graph_type} ({arg.type}) in the graph"
            )

        graph_shape = list(arg.shape) if arg.shape is not None else None
        if graph_shape is None:
            return problems  # unknown rank: nothing to compare
        expected = ([-1] if self.max_batch_size > 0 else []) + spec.model_dims
        config_text = (
            "an initial batch dimension because max_batch_size > 0 followed by the explicit "
            f"tensor shape, making complete shape {_shape_text(expected)}"
            if self.max_batch_size > 0
            else f"shape {_shape_text(expected)}"
        )
        if len(graph_shape) != len(expected):
            problems.append(
                f"{kind} '{spec.name}': the graph expects {len(graph_shape)} dimensions "
                f"(shape {_shape_text(graph_shape)}) but the configuration specifies "
                f"{len(expected)} dimensions ({config_text})"
            )
            return problems
        if self.max_batch_size > 0 and _is_fixed(graph_shape[0]):
            problems.append(
                f"{kind} '{spec.name}': max_batch_size is {self.max_batch_size} but the graph's "
                f"first dimension is fixed at {graph_shape[0]} (shape "
                f"{_shape_text(graph_shape)}); export the graph with a dynamic batch "
                "dimension or set max_batch_size: 0"
            )
        start = 1 if self.max_batch_size > 0 else 0
        for g, c in zip(graph_shape[start:], expected[start:], strict=True):
            if _is_fixed(g) and c >= 0 and g != c:
                problems.append(
                    f"{kind} '{spec.name}': the graph's shape {_shape_text(graph_shape)} does "
                    f"not match the configuration's complete shape {_shape_text(expected)}"
                    + (" (batch dimension first)" if self.max_batch_size > 0 else "")
                )
                break
        return problems

    # -- serving ----------------------------------------------------------------------

    def execute(self, requests: list[Any]) -> list[Any]:
        """Run every request of a dynamic batch through one onnxruntime call where possible.

        Requests whose inputs have the same non-batch shapes (all of them, with Triton's
        dynamic batcher) are concatenated along dimension 0; a model without batching
        (``max_batch_size: 0``) runs each request on its own.

        Args:
            requests: ``pb_utils.InferenceRequest`` objects.

        Returns:
            One ``pb_utils.InferenceResponse`` per request, in order.
        """
        responses: list[Any] = [None] * len(requests)
        groups: dict[Any, list[tuple[int, dict[str, Any], list[str]]]] = {}
        for index, request in enumerate(requests):
            try:
                feeds, wanted = self._read_request(request)
            except Exception as exc:  # noqa: BLE001 - reported to this request's client
                responses[index] = pb_utils.InferenceResponse(
                    output_tensors=[], error=pb_utils.TritonError(str(exc))
                )
                continue
            if self.max_batch_size > 0:
                key: Any = tuple(
                    sorted((name, arr.shape[1:], arr.dtype.str) for name, arr in feeds.items())
                )
            else:
                key = ("single", index)
            groups.setdefault(key, []).append((index, feeds, wanted))

        for members in groups.values():
            self._run_group(members, responses)
        return responses

    def _read_request(self, request: Any) -> tuple[dict[str, Any], list[str]]:
        feeds: dict[str, Any] = {}
        batch = None
        for spec in self.inputs:
            tensor = pb_utils.get_input_tensor_by_name(request, spec.name)
            if tensor is None:
                if spec.optional:
                    continue
                raise ValueError(f"request for model '{self.model_name}' lacks input '{spec.name}'")
            arr = tensor.as_numpy()
            if spec.data_type == "TYPE_STRING":
                arr = (
                    np.vectorize(
                        lambda v: v.decode("utf-8") if isinstance(v, bytes) else v, otypes=[object]
                    )(arr)
                    if arr.size
                    else arr.astype(object)
                )
            if self.max_batch_size > 0:
                if arr.ndim == 0:
                    raise ValueError(f"input '{spec.name}' has no batch dimension")
                if batch is None:
                    batch = arr.shape[0]
                elif arr.shape[0] != batch:
                    raise ValueError(
                        f"inputs of one request disagree on the batch size ({batch} and "
                        f"{arr.shape[0]} for '{spec.name}')"
                    )
            feeds[spec.name] = arr
        requested = list(request.requested_output_names() or [])
        wanted = requested or [spec.name for spec in self.outputs]
        unknown = [name for name in wanted if name not in self.output_by_name]
        if unknown:
            raise ValueError(
                f"unknown output(s) {unknown} requested from model '{self.model_name}'; "
                f"it has {[spec.name for spec in self.outputs]}"
            )
        return feeds, wanted

    def _run_group(
        self, members: list[tuple[int, dict[str, Any], list[str]]], responses: list[Any]
    ) -> None:
        names = [spec.name for spec in self.outputs if any(spec.name in m[2] for m in members)]
        sizes: list[int] = []
        try:
            if len(members) == 1:
                feeds = members[0][1]
            else:
                feeds = {
                    name: np.concatenate([m[1][name] for m in members], axis=0)
                    for name in members[0][1]
                }
            if self.max_batch_size > 0:
                sizes = [next(iter(m[1].values())).shape[0] if m[1] else 1 for m in members]
            results = self.session.run(names, feeds)
        except Exception as exc:  # noqa: BLE001 - every request of the group gets the error
            for index, _, _ in members:
                responses[index] = pb_utils.InferenceResponse(
                    output_tensors=[],
                    error=pb_utils.TritonError(
                        f"onnxruntime failed for model '{self.model_name}': {exc}"
                    ),
                )
            return

        by_name = dict(zip(names, results, strict=True))
        offset = 0
        for position, (index, _, wanted) in enumerate(members):
            if self.max_batch_size > 0:
                size = sizes[position]
                start, stop = offset, offset + size
                offset = stop
            else:
                size, start, stop = 0, 0, None
            try:
                tensors = []
                for name in wanted:
                    spec = self.output_by_name[name]
                    arr = np.asarray(by_name[name])
                    if self.max_batch_size > 0:
                        arr = arr[start:stop]
                    arr = self._conform(arr, spec, size)
                    tensors.append(pb_utils.Tensor(name, arr))
                responses[index] = pb_utils.InferenceResponse(output_tensors=tensors)
            except Exception as exc:  # noqa: BLE001
                responses[index] = pb_utils.InferenceResponse(
                    output_tensors=[], error=pb_utils.TritonError(str(exc))
                )

    def _conform(self, arr: Any, spec: _TensorSpec, batch: int) -> Any:
        """Cast to the config's data type and shape the tensor like the config declares."""
        if spec.data_type == "TYPE_STRING":
            arr = np.array(
                [v.encode("utf-8") if isinstance(v, str) else v for v in arr.reshape(-1)],
                dtype=object,
            ).reshape(arr.shape)
        elif arr.dtype != spec.np_dtype:
            arr = arr.astype(spec.np_dtype)
        target = ([batch] if self.max_batch_size > 0 else []) + spec.model_dims
        if list(arr.shape) != target:
            free = [i for i, d in enumerate(target) if d < 0]
            if not free and int(np.prod(target)) == arr.size:
                arr = arr.reshape(target)
            elif len(free) == 1:
                arr = arr.reshape(target)
        return np.ascontiguousarray(arr) if arr.dtype != object else arr

    def finalize(self) -> None:
        """Release the onnxruntime session."""
        self.session = None
