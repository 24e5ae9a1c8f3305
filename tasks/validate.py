"""Stage 3, validate: the candidate's contract, its Triton config and breaking changes.

Three views of the same model must agree before a server sees it: the ONNX graph, the
MLflow signature and the rendered Triton config (names, dtypes, dims). Against the version
in production, a change of I/O is refused unless the policy allows it explicitly, because
clients built for the old contract would break at the swap. The data checks (Great
Expectations) live in :mod:`tasks.expectations`, the trial load in :mod:`tasks.trial_load`.
All functions here are pure.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from modelship.errors import ValidationFailed
from modelship.policy import Policy, Target
from modelship.triton.model_config import (
    ModelConfig,
    ModelSpec,
    TensorSpec,
    assert_lint_clean,
    for_target,
    from_pbtxt,
    lint,
    numpy_dtype_from_triton,
    render_model_config,
    to_pbtxt,
)

_COLUMN_KINDS = {"double": "f", "float": "f", "long": "i", "integer": "i", "boolean": "b",
                 "string": "O", "binary": "O", "datetime": "M"}


@dataclass(frozen=True)
class Problem:
    """One disagreement, phrased for a person: what, where, and how to fix it."""

    where: str
    message: str

    def __str__(self) -> str:
        return f"{self.where}: {self.message}"


def _parse(signature: Mapping[str, Any] | None, part: str) -> list[dict[str, Any]]:
    if not signature or not signature.get(part):
        return []
    raw = signature[part]
    return list(json.loads(raw) if isinstance(raw, str) else raw)


def _dims_agree(a: tuple[int, ...], b: tuple[int, ...]) -> bool:
    """Same rank, and every dimension fixed on both sides is equal (-1 is variable)."""
    return len(a) == len(b) and all(x == y or x < 0 or y < 0 for x, y in zip(a, b, strict=True))


def check_signature(signature: Mapping[str, Any] | None, graph: ModelSpec) -> list[Problem]:
    """The MLflow signature against the ONNX graph's I/O."""
    problems: list[Problem] = []
    inputs = _parse(signature, "inputs")
    if not inputs:
        return problems
    graph_inputs = {t.name: t for t in graph.inputs}
    if all(spec.get("type") == "tensor" for spec in inputs):
        named = [spec for spec in inputs if spec.get("name")]
        if len(named) < len(inputs) and len(inputs) == 1 and len(graph.inputs) == 1:
            named = [{**inputs[0], "name": graph.inputs[0].name}]
        for spec in named:
            problems += _tensor_against_graph("signature input", spec, graph_inputs)
        wanted = {spec["name"] for spec in named}
        for name in graph_inputs.keys() - wanted:
            problems.append(Problem(
                f"graph input {name!r}",
                f"is not in the MLflow signature (signature inputs: {sorted(wanted)}); re-log "
                "the model with a signature that names every graph input"))
        outputs = [s for s in _parse(signature, "outputs")
                   if s.get("type") == "tensor" and s.get("name")]
        graph_outputs = {t.name: t for t in graph.outputs}
        for spec in outputs:
            problems += _tensor_against_graph("signature output", spec, graph_outputs)
        return problems
    # Column-based: either one graph input per column, or one [batch, n_columns] matrix.
    columns = [spec for spec in inputs if spec.get("type") != "tensor"]
    names = [str(spec.get("name")) for spec in columns]
    if set(names) <= graph_inputs.keys():
        for spec in columns:
            tensor = graph_inputs[str(spec["name"])]
            if not _column_fits(str(spec.get("type")), tensor.dtype):
                problems.append(Problem(
                    f"input {tensor.name!r}",
                    f"the signature says {spec.get('type')} but the graph takes "
                    f"{tensor.dtype}; re-export the model so the two agree"))
        return problems
    if len(graph.inputs) != 1:
        missing = [n for n in names if n not in graph_inputs]
        return [Problem("inputs",
                        f"signature columns {missing} have no graph input of that name, and "
                        f"the graph has {len(graph.inputs)} inputs "
                        f"({sorted(graph_inputs)}); name the graph inputs after the columns")]
    tensor = graph.inputs[0]
    width = tensor.dims[-1] if tensor.dims else 1
    if len(tensor.dims) != 1 or (width >= 0 and width != len(columns)):
        problems.append(Problem(
            f"input {tensor.name!r}",
            f"the signature has {len(columns)} columns but the graph input has dims "
            f"{list(tensor.dims)} (expected [{len(columns)}]); re-export with one column per "
            "feature"))
    bad = [str(spec.get("name")) for spec in columns
           if not _column_fits(str(spec.get("type")), tensor.dtype)]
    if bad:
        problems.append(Problem(
            f"input {tensor.name!r}",
            f"columns {bad} cannot feed a {tensor.dtype} tensor; encode them as numbers "
            "before the model, or give the model one input per column"))
    return problems


def _column_fits(column_type: str, dtype: str) -> bool:
    kind = _COLUMN_KINDS.get(column_type, "?")
    if kind in "fib":
        return dtype.startswith(("float", "int", "uint", "bool"))
    return dtype == "object" if kind == "O" else False


def _tensor_against_graph(
    role: str, spec: Mapping[str, Any], graph: Mapping[str, TensorSpec]
) -> list[Problem]:
    name = str(spec["name"])
    info = spec.get("tensor-spec", {})
    if name not in graph:
        return [Problem(f"{role} {name!r}",
                        f"is not in the ONNX graph (graph has {sorted(graph)}); the names "
                        "must match: re-export the graph or re-log the signature")]
    tensor = graph[name]
    problems = []
    dtype = str(info.get("dtype", ""))
    if dtype and dtype != tensor.dtype:
        problems.append(Problem(f"{role} {name!r}",
                                f"dtype {dtype} in the signature but {tensor.dtype} in the "
                                "graph; cast one of them so they agree"))
    shape = tuple(int(d) for d in info.get("shape", []))[1:]
    if info.get("shape") is not None and not _dims_agree(shape, tensor.dims):
        problems.append(Problem(f"{role} {name!r}",
                                f"dims {list(shape)} in the signature (batch excluded) but "
                                f"{list(tensor.dims)} in the graph; fix the export or the "
                                "signature"))
    return problems


def spec_of_config(config: ModelConfig) -> ModelSpec:
    """The I/O a Triton config promises, dims without batch (a ``[1]`` reshaped to ``[]``
    is a scalar per row)."""

    def tensors(items: Any) -> tuple[TensorSpec, ...]:
        out = []
        for item in items:
            dims = tuple(item.dims)
            if item.HasField("reshape") and not list(item.reshape.shape) and dims == (1,):
                dims = ()
            out.append(TensorSpec(item.name, numpy_dtype_from_triton(item.data_type), dims))
        return tuple(out)

    return ModelSpec(config.name, tensors(config.input), tensors(config.output))


def check_config_against_graph(config: ModelConfig, graph: ModelSpec) -> list[Problem]:
    """The rendered Triton config must describe exactly the graph's tensors."""
    problems: list[Problem] = []
    declared = spec_of_config(config)
    for role, mine, theirs in (("input", declared.inputs, graph.inputs),
                               ("output", declared.outputs, graph.outputs)):
        graph_by_name = {t.name: t for t in theirs}
        for tensor in mine:
            other = graph_by_name.get(tensor.name)
            if other is None:
                problems.append(Problem(f"config {role} {tensor.name!r}",
                                        f"is not in the graph ({sorted(graph_by_name)})"))
                continue
            if other.dtype != tensor.dtype:
                problems.append(Problem(f"config {role} {tensor.name!r}",
                                        f"is {tensor.dtype} but the graph says {other.dtype}"))
            if not _dims_agree(tensor.dims, other.dims):
                problems.append(Problem(f"config {role} {tensor.name!r}",
                                        f"has dims {list(tensor.dims)} but the graph has "
                                        f"{list(other.dims)}"))
        if role == "input":
            for name in graph_by_name.keys() - {t.name for t in mine}:
                problems.append(Problem(f"graph input {name!r}", "is missing from the config"))
    return problems


def check_contract(
    signature: Mapping[str, Any] | None, graph: ModelSpec, config: ModelConfig | None
) -> None:
    """Raise ValidationFailed listing every disagreement between the three views (the
    config is left out while it is not rendered yet)."""
    problems = check_signature(signature, graph)
    if config is not None:
        problems += check_config_against_graph(config, graph)
    if problems:
        raise ValidationFailed(
            f"{graph.name}: the ONNX graph, the MLflow signature and the Triton config "
            f"disagree: {'; '.join(map(str, problems))}",
            hint="make the export and the logged signature describe the same tensors "
            "(names, dtypes, dims), then register a new version",
            stage="contract",
            problems=[str(p) for p in problems],
        )


def breaking_changes(production: ModelSpec, candidate: ModelSpec) -> list[Problem]:
    """I/O changes that would break clients of the production version (pure).

    Removing or changing an input or output breaks clients; adding an input breaks them
    too (they do not send it); adding an output does not.
    """
    problems: list[Problem] = []
    for role, old, new in (("input", production.inputs, candidate.inputs),
                           ("output", production.outputs, candidate.outputs)):
        new_by_name = {t.name: t for t in new}
        old_names = {t.name for t in old}
        for tensor in old:
            now = new_by_name.get(tensor.name)
            if now is None:
                problems.append(Problem(f"{role} {tensor.name!r}", "was removed"))
            elif now.dtype != tensor.dtype:
                problems.append(Problem(f"{role} {tensor.name!r}",
                                        f"dtype changed {tensor.dtype} -> {now.dtype}"))
            elif now.dims != tensor.dims:
                problems.append(Problem(f"{role} {tensor.name!r}",
                                        f"dims changed {list(tensor.dims)} -> {list(now.dims)}"))
        if role == "input":
            for name in sorted(new_by_name.keys() - old_names):
                problems.append(Problem(f"input {name!r}", "was added"))
    return problems


def check_breaking(
    production: ModelSpec | None, production_version: int | None, candidate: ModelSpec,
    *, allowed: bool,
) -> list[str]:
    """Refuse an I/O change against production unless allowed; return what changed."""
    if production is None:
        return []
    changes = breaking_changes(production, candidate)
    if changes and not allowed:
        raise ValidationFailed(
            f"{candidate.name}: the candidate changes the I/O of production version "
            f"{production_version}: {'; '.join(map(str, changes))}",
            hint="keep the contract, or if clients are ready set "
            "validation.allow_breaking_changes: true in the policy (or pass "
            "--allow-breaking-changes)",
            stage="breaking_changes",
            changes=[str(c) for c in changes],
        )
    return [str(c) for c in changes]


def render_checked_config(
    graph: ModelSpec, policy: Policy, *, target: Target, versions: list[int] | None = None,
    golden_shapes: Mapping[str, Sequence[int]] | None = None,
) -> ModelConfig:
    """Render the Triton config from the graph and the policy for ``target``, then lint it.

    The lint runs on the config as Triton will read it: serialised to ``config.pbtxt`` and
    parsed back with Triton's protobuf schema (the round trip must be exact).
    """
    config = render_model_config(graph, policy.triton, versions=versions, target=target,
                                 golden_shapes=golden_shapes)
    parsed = from_pbtxt(to_pbtxt(config))
    if parsed != config:
        raise ValidationFailed(
            f"{graph.name}: the rendered {target} config does not survive config.pbtxt",
            hint="report this as a bug in modelship/triton/model_config.py")
    assert_lint_clean(lint(parsed, target=target), model=graph.name)
    return parsed


@dataclass(frozen=True)
class RenderedConfigs:
    """The configs of one check: what is staged, and what the CPU stack serves.

    Attributes:
        target: The policy's declared target, the fleet the staged config is for.
        staged: Rendered for ``target``; it goes into the version folder and the manifest.
        cpu: ``for_target(staged, "cpu")``: what a CPU server (the local stack's canary and
            replicas) loads. Equal to ``staged`` when the target is ``cpu``.
    """

    target: Target
    staged: ModelConfig
    cpu: ModelConfig

    def for_fleet(self, fleet: Target) -> ModelConfig:
        """The config a fleet of ``fleet`` loads."""
        return self.staged if fleet == self.target else for_target(self.staged, fleet)


def render_checked_configs(
    graph: ModelSpec, policy: Policy, *, versions: list[int] | None = None,
    golden: Mapping[str, Any] | None = None,
) -> RenderedConfigs:
    """Render and lint the staged config (the policy's target) and its CPU form.

    A check on the CPU stack therefore still renders and lints the GPU config (instance
    groups, accelerators, warmup) of a ``triton.target: gpu`` policy, and trial-loads its
    CPU form.

    Args:
        graph: The exported graph's I/O.
        policy: The release policy.
        versions: ``version_policy: specific`` versions.
        golden: The golden feed (input name to array ``[rows, *dims]``), which shapes the
            GPU warmup; only the arrays' ``shape`` is read.

    Raises:
        ValidationFailed: either config fails lint.
    """
    shapes = {name: tuple(array.shape) for name, array in (golden or {}).items()}
    target = policy.triton.target
    staged = render_checked_config(graph, policy, target=target, versions=versions,
                                   golden_shapes=shapes)
    cpu = for_target(staged, "cpu")
    if target != "cpu":
        assert_lint_clean(lint(cpu, target="cpu"), model=graph.name)
    return RenderedConfigs(target=target, staged=staged, cpu=cpu)
