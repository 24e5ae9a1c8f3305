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


@dataclass(frozen=True, eq=False)
class ReleaseCandidate:
    """The candidate of one release, built once after check and stage; every later stage
    (canary, baseline, swap, bake, record) takes it instead of reading MLflow or S3 again.

    The one read that stays is the swap's verification of the staged bytes against the
    manifest (DESIGN §4): what serves is what verified, never what this object says.

    Attributes:
        resolved: The MLflow version the check resolved (and downloaded, once).
        feed: The golden feed: input name -> batch-first rows (the check's, at most
            ``export.golden_max_rows``), which the canary replays and the bake probes with.
        feed_source: Where the rows came from (``artifact``, ``input_example``,
            ``synthetic``).
        config_pbtxt: The rendered Triton config, exactly as staged.
        digest: The digest a canary, an approval and a swap are bound to
            (:func:`modelship.ledger.candidate_digest`, from the staged manifest).
        probe: The golden probe recorded in the manifest (``GoldenProbe.to_dict``), or None.
    """

    resolved: ResolvedVersion
    feed: dict[str, Any] = field(repr=False)
    feed_source: str
    config_pbtxt: str = field(repr=False)
    digest: dict[str, Any]
    probe: dict[str, Any] | None = field(default=None, repr=False)

    @property
    def model(self) -> str:
        return self.resolved.name

    @property
    def version(self) -> int:
        return self.resolved.version

    def rows(self, count: int) -> dict[str, Any]:
        """The first ``count`` rows of the feed (the bake's probe load takes 64)."""
        return {name: rows[:count] for name, rows in self.feed.items()}
