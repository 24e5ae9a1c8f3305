"""The facts a release carries from stage to stage (plain data, no I/O).

``resolve`` produces a :class:`ResolvedVersion`, ``export`` an :class:`ExportedModel`,
``validate`` a :class:`ValidationReport` and ``stage`` a :class:`StagedVersion`. Each is
JSON-serialisable through ``to_dict`` so the CLI and the release record can print it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from modelship.triton.model_config import ModelSpec


@dataclass(frozen=True)
class ResolvedVersion:
    """One concrete MLflow model version and what the pipeline needs to know about it.

    Attributes:
        name: Registered model name (also the Triton model name).
        version: Registered version number (also the Triton version folder).
        flavor: The flavor modelship exports from: ``onnx``, ``sklearn`` or ``pytorch``.
        flavors: Every flavor in the MLmodel file.
        source: The artifact URI the version points at (``models:/m-...``).
        run_id: The run that produced it, or None.
        signature: ``{"inputs": [...], "outputs": [...]}`` as MLflow stores it, or None.
        metrics: The run's metrics.
        aliases: Aliases currently on this version.
        tags: Version tags.
        local_dir: Where the model artifacts were downloaded.
    """

    name: str
    version: int
    flavor: str
    flavors: tuple[str, ...]
    source: str
    run_id: str | None
    signature: dict[str, Any] | None
    metrics: dict[str, float]
    aliases: tuple[str, ...]
    tags: dict[str, str]
    local_dir: Path

    @property
    def uri(self) -> str:
        return f"models:/{self.name}/{self.version}"

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["local_dir"] = str(self.local_dir)
        data["uri"] = self.uri
        return data


@dataclass(frozen=True)
class GoldenInputs:
    """The rows every check, trial load and canary replays.

    Attributes:
        source: ``artifact`` (golden/inputs.parquet on the run), ``input_example`` or
            ``synthetic`` (generated from the signature; flagged in reports).
        path: A parquet file holding the rows.
        rows: Number of rows.
    """

    source: str
    path: Path
    rows: int

    def to_dict(self) -> dict[str, Any]:
        return {"source": self.source, "path": str(self.path), "rows": self.rows}


@dataclass(frozen=True)
class ExportedModel:
    """A checked ONNX graph ready for a Triton version folder.

    Attributes:
        files: Version-folder-relative file name -> local path (``model.onnx`` plus any
            external-data files).
        opset: The default-domain opset of the graph.
        spec: The graph's inputs and outputs, dims without the batch dimension.
        parity: The parity report (worst element per output).
    """

    files: dict[str, Path]
    opset: int
    spec: ModelSpec
    parity: dict[str, Any] = field(default_factory=dict)

    @property
    def onnx_path(self) -> Path:
        return self.files["model.onnx"]

    def to_dict(self) -> dict[str, Any]:
        return {
            "files": {name: str(path) for name, path in self.files.items()},
            "opset": self.opset,
            "inputs": [asdict(t) for t in self.spec.inputs],
            "outputs": [asdict(t) for t in self.spec.outputs],
            "parity": self.parity,
        }
