"""GPU evidence from Triton's metrics: parsing, the canary's memory delta, swap headroom.

Everything here is pure: callers fetch the metrics text (``GET <metrics>/metrics``) and
pass it in, so the arithmetic is tested against recorded GPU-server text
(``tests/fixtures/triton_gpu_metrics/``) on machines without a GPU.

Triton (with ``--allow-gpu-metrics=true``, the default on GPU servers) exports one gauge
per GPU, labelled ``gpu_uuid``:

- ``nv_gpu_memory_total_bytes``, ``nv_gpu_memory_used_bytes`` (bytes);
- ``nv_gpu_utilization`` (fraction 0..1 over the last interval);
- ``nv_gpu_power_usage``, ``nv_gpu_power_limit`` (W), ``nv_energy_consumption`` (J).

A CPU server exports none of them, which :func:`fleet_target` uses to tell the fleets
apart; no GPU series is never read as "zero bytes used".

**C's footprint**, for the swap preflight (DESIGN §4: Triton builds C before it drops P,
so every replica must hold both for a moment):

- *measured* (preferred): the canary loads P alone, then P and C; the rise of
  ``nv_gpu_memory_used_bytes`` on the busiest GPU between the two scrapes is C's footprint
  with its real instance count, accelerator and arena (:func:`canary_gpu_evidence`);
- *estimated* (fallback, when no canary measurement is on record): the ONNX initializers'
  bytes times instances per GPU times :data:`ESTIMATE_FACTOR` (weights plus activation and
  arena growth), plus the TensorRT workspace (:func:`estimate_footprint`).

:func:`plan_headroom` (the swap preflight, ``tasks/swap.py``) takes the measurement when
the canary handed one over, else the estimate, says which, and skips replicas without GPU
gauges with a plan line; :func:`check_headroom` raises
:class:`~modelship.errors.PreflightError` (exit 1) with every replica's numbers when C does
not fit next to P on every GPU it will use.

The only I/O around this module: ``tasks/canary.py`` scrapes the canary (before loading,
after P, after P and C, and every second under load), ``tasks/bake.py`` every replica per
window, ``tasks/swap.py`` every replica before the swap, all through
:func:`modelship.triton.metrics.scrape_text`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import onnx
from onnx import TensorProto, helper
from tritonclient.grpc import model_config_pb2

from modelship.errors import PreflightError
from modelship.policy import GPU_METRICS, Target
from modelship.triton.metrics import parse_text

__all__ = [
    "ESTIMATE_FACTOR",
    "Footprint",
    "GpuEvidence",
    "GpuSample",
    "HeadroomCheck",
    "HeadroomPlan",
    "canary_gpu_evidence",
    "check_headroom",
    "choose_footprint",
    "estimate_footprint",
    "fleet_target",
    "gpu_memory_growth_pct",
    "headroom_checks",
    "initializer_bytes",
    "instance_gpus",
    "plan_headroom",
    "parse_gpu_metrics",
    "summarize",
]

MEMORY_USED = "nv_gpu_memory_used_bytes"
MEMORY_TOTAL = "nv_gpu_memory_total_bytes"
UTILIZATION = "nv_gpu_utilization"
POWER_USAGE = "nv_gpu_power_usage"
POWER_LIMIT = "nv_gpu_power_limit"
ENERGY = "nv_energy_consumption"
_FIELDS = {
    MEMORY_USED: "memory_used_bytes",
    MEMORY_TOTAL: "memory_total_bytes",
    UTILIZATION: "utilization",
    POWER_USAGE: "power_usage_w",
    POWER_LIMIT: "power_limit_w",
    ENERGY: "energy_j",
}

ESTIMATE_FACTOR = 2.0
"""Estimated GPU bytes per initializer byte and instance: the weights once, plus as much
again for activations, the CUDA arena's rounding and the backend's buffers. Deliberately
pessimistic: an estimate only stands in when the canary measured nothing."""

MiB = 1024 * 1024


@dataclass(frozen=True)
class GpuSample:
    """One GPU as one scrape saw it; a gauge the server did not export is None.

    Attributes:
        uuid: ``gpu_uuid`` label (``GPU-1f0e...``).
        memory_used_bytes / memory_total_bytes: bytes.
        utilization: fraction 0..1.
        power_usage_w / power_limit_w: watts.
        energy_j: joules since the server started.
    """

    uuid: str
    memory_used_bytes: float | None = None
    memory_total_bytes: float | None = None
    utilization: float | None = None
    power_usage_w: float | None = None
    power_limit_w: float | None = None
    energy_j: float | None = None

    @property
    def free_bytes(self) -> float | None:
        """Total minus used, bytes; None when either gauge is missing."""
        if self.memory_used_bytes is None or self.memory_total_bytes is None:
            return None
        return self.memory_total_bytes - self.memory_used_bytes

    def to_dict(self) -> dict[str, Any]:
        return {"uuid": self.uuid, **{f: getattr(self, f) for f in _FIELDS.values()},
                "free_bytes": self.free_bytes}


def parse_gpu_metrics(text: str) -> dict[str, GpuSample]:
    """Per-GPU gauges from one Triton metrics exposition, keyed by ``gpu_uuid`` (pure).

    NaN values and series without a ``gpu_uuid`` are left out; a CPU server gives ``{}``.
    """
    if not any(name in text for name in _FIELDS):
        # No GPU series: a CPU server's answer, known without a second full parse of the
        # exposition (~6 ms for 10 loaded models; every bake window and swap asks).
        return {}
    found: dict[str, dict[str, float]] = {}
    for sample in parse_text(text):
        attr = _FIELDS.get(sample.name)
        uuid = sample.labels.get("gpu_uuid")
        if attr is None or uuid is None or math.isnan(sample.value):
            continue
        found.setdefault(uuid, {})[attr] = sample.value
    return {uuid: GpuSample(uuid, **values) for uuid, values in sorted(found.items())}


def fleet_target(text: str) -> Target:
    """``gpu`` when the server exports GPU memory gauges, else ``cpu`` (pure).

    A GPU server started with ``--allow-gpu-metrics=false`` reads as ``cpu``; infra/ keeps
    the flag on.
    """
    gpus = parse_gpu_metrics(text)
    return "gpu" if any(g.memory_total_bytes for g in gpus.values()) else "cpu"


def summarize(gpus: Mapping[str, GpuSample]) -> dict[str, Any]:
    """Totals for a report: memory used/total (bytes), mean utilization, power (W).

    Every figure is None when no GPU reported it (a CPU server), never 0.
    """
    def total(attr: str) -> float | None:
        values = [getattr(g, attr) for g in gpus.values() if getattr(g, attr) is not None]
        return float(sum(values)) if values else None

    utils = [g.utilization for g in gpus.values() if g.utilization is not None]
    return {
        "gpus": len(gpus),
        "memory_used_bytes": total("memory_used_bytes"),
        "memory_total_bytes": total("memory_total_bytes"),
        "utilization_mean": float(np.mean(utils)) if utils else None,
        "power_usage_w": total("power_usage_w"),
    }


# --------------------------------------------------------------------------- footprint


def initializer_bytes(model: onnx.ModelProto) -> int:
    """Bytes of the graph's weights: every initializer, inline or external (pure).

    Load the model with ``onnx.load(path, load_external_data=False)``: an external
    tensor's size is read from its ``length`` entry, else from its dims and type.
    Initializers of subgraphs (If/Loop bodies) count too.
    """
    total = 0
    graphs = [model.graph]
    while graphs:
        graph = graphs.pop()
        for tensor in graph.initializer:
            total += _tensor_bytes(tensor)
        for node in graph.node:
            for attr in node.attribute:
                if attr.type == onnx.AttributeProto.GRAPH:
                    graphs.append(attr.g)
                elif attr.type == onnx.AttributeProto.GRAPHS:
                    graphs.extend(attr.graphs)
                elif attr.type == onnx.AttributeProto.TENSOR:  # Constant nodes
                    total += _tensor_bytes(attr.t)
    return total


def _tensor_bytes(tensor: TensorProto) -> int:
    if tensor.data_location == TensorProto.EXTERNAL:
        entries = {e.key: e.value for e in tensor.external_data}
        if "length" in entries:
            return int(entries["length"])
    if tensor.raw_data:
        return len(tensor.raw_data)
    count = math.prod(tensor.dims) if tensor.dims else 1
    if tensor.data_type == TensorProto.STRING:
        return sum(len(s) for s in tensor.string_data)
    itemsize = np.dtype(helper.tensor_dtype_to_np_dtype(tensor.data_type)).itemsize
    return int(count * itemsize)


FootprintSource = Literal["measured", "estimated"]
_MEASURED = "rise of nv_gpu_memory_used_bytes when the candidate loaded on the canary GPU"


@dataclass(frozen=True)
class Footprint:
    """GPU memory one version takes on each GPU it runs on, bytes, and where it came from."""

    bytes_per_gpu: int
    source: FootprintSource
    detail: str

    def to_dict(self) -> dict[str, Any]:
        return {"bytes_per_gpu": self.bytes_per_gpu, "source": self.source,
                "detail": self.detail}


def _instances_per_gpu(cfg: model_config_pb2.ModelConfig) -> int:
    """Model instances that share one GPU: ``count`` summed over the GPU groups."""
    gpu_groups = [g for g in cfg.instance_group
                  if g.kind == model_config_pb2.ModelInstanceGroup.KIND_GPU]
    return max(sum(g.count for g in gpu_groups), 1)


def _tensorrt_workspace(cfg: model_config_pb2.ModelConfig) -> int:
    for accel in cfg.optimization.execution_accelerators.gpu_execution_accelerator:
        value = accel.parameters.get("max_workspace_size_bytes", "")
        if accel.name == "tensorrt" and value.isdigit():
            return int(value)
    return 0


def estimate_footprint(weights_bytes: int, cfg: model_config_pb2.ModelConfig, *,
                       factor: float = ESTIMATE_FACTOR) -> Footprint:
    """C's estimated GPU bytes per GPU from its weights and its config (pure).

    ``instances x weights x factor + TensorRT workspace``: the onnxruntime backend builds
    one session, so one copy of the weights, per instance.
    """
    instances = _instances_per_gpu(cfg)
    workspace = _tensorrt_workspace(cfg)
    total = int(instances * weights_bytes * factor) + workspace
    return Footprint(total, "estimated",
                     f"{instances} instance(s) x {weights_bytes} B of initializers x {factor:g}"
                     f" + {workspace} B TensorRT workspace")


def choose_footprint(measured: int | None, estimated: Footprint) -> Footprint:
    """The canary's measurement when there is one (> 0), else the estimate."""
    if measured is not None and measured > 0:
        return Footprint(int(measured), "measured",
                         f"{_MEASURED} (estimate was {estimated.bytes_per_gpu} B)")
    return estimated


# --------------------------------------------------------------------------- canary evidence


def _rise(before: Mapping[str, GpuSample], after: Mapping[str, GpuSample]) -> int | None:
    """The largest rise of used memory on one GPU between two scrapes, bytes (≥ 0)."""
    rises = []
    for uuid, now in after.items():
        was = before[uuid].memory_used_bytes if uuid in before else None
        if now.memory_used_bytes is not None and was is not None:
            rises.append(now.memory_used_bytes - was)
    return max(0, int(max(rises))) if rises else None


def gpu_memory_growth_pct(candidate_bytes: int | None, baseline_bytes: int | None
                          ) -> float | None:
    """How much more GPU memory C takes than P, in percent of P's; None without data."""
    if candidate_bytes is None or baseline_bytes is None or baseline_bytes <= 0:
        return None
    return 100.0 * (candidate_bytes - baseline_bytes) / baseline_bytes


@dataclass(frozen=True)
class GpuEvidence:
    """What the canary's GPU says about P and C; every figure None on a CPU canary.

    Attributes:
        baseline_bytes: rise of used memory when P loaded (per GPU, bytes), or None.
        candidate_bytes: rise when C loaded next to P, bytes, or None.
        growth_pct: ``100 * (C - P) / P``, the gate metric ``gpu_memory_growth_pct``.
        after: the GPUs with both loaded (before the measured load).
        utilization_mean: mean ``nv_gpu_utilization`` over the scrapes taken during the
            measured load (fraction 0..1); the ``after`` scrape's when there were none.
        peak_used_bytes: the most memory used on one GPU in any scrape during the load,
            bytes (activations and arena growth show here, not in the footprints).
        load_scrapes: how many scrapes during the load reported GPUs.
    """

    baseline_bytes: int | None
    candidate_bytes: int | None
    growth_pct: float | None
    after: dict[str, GpuSample]
    utilization_mean: float | None = None
    peak_used_bytes: float | None = None
    load_scrapes: int = 0

    @property
    def measured(self) -> bool:
        """Whether the canary's server reported any GPU at all."""
        return bool(self.after)

    def metrics(self) -> dict[str, float | None]:
        """Gate metrics (:data:`~modelship.policy.GPU_METRICS`): growth %, C's bytes,
        utilization under load."""
        values = {
            "gpu_memory_growth_pct": self.growth_pct,
            "gpu_memory_candidate_bytes": (None if self.candidate_bytes is None
                                           else float(self.candidate_bytes)),
            "gpu_utilization": self.utilization_mean,
        }
        assert tuple(values) == GPU_METRICS
        return values

    def to_dict(self) -> dict[str, Any]:
        return {"baseline_bytes": self.baseline_bytes, "candidate_bytes": self.candidate_bytes,
                "growth_pct": self.growth_pct, **summarize(self.after),
                "utilization_mean": self.utilization_mean,
                "peak_used_bytes": self.peak_used_bytes, "load_scrapes": self.load_scrapes,
                "gpus": [g.to_dict() for g in self.after.values()]}

    def report_lines(self) -> list[str]:
        """Sentences for the canary report; one line saying so on a CPU canary."""
        if not self.after:
            return ["GPU: none reported by the canary (CPU server): no GPU figures."]
        s = summarize(self.after)
        lines = [f"GPU memory: {_mib(s['memory_used_bytes'])} used of "
                 f"{_mib(s['memory_total_bytes'])} on {s['gpus']} GPU(s) with both loaded; "
                 f"under load utilization {_pct(self.utilization_mean)} (mean of "
                 f"{self.load_scrapes} scrape(s)), peak {_mib(self.peak_used_bytes)} used "
                 "on one GPU."]
        lines.append(f"Footprint per GPU: baseline {_mib(self.baseline_bytes)}, candidate "
                     f"{_mib(self.candidate_bytes)} (growth "
                     f"{'n/a' if self.growth_pct is None else f'{self.growth_pct:+.1f}%'}).")
        return lines


def canary_gpu_evidence(empty: str, baseline_loaded: str | None, both_loaded: str, *,
                        under_load: Sequence[Mapping[str, GpuSample]] = ()) -> GpuEvidence:
    """GPU evidence from three scrapes of the canary's metrics text (pure).

    The footprints come from scrapes taken with no load running, right after each load
    reported READY (Triton's ``model_warmup`` has run by then), so P and C are measured
    the same way; what the load adds on top shows in ``peak_used_bytes``.

    Args:
        empty: Before the canary loads anything of this model.
        baseline_loaded: After P alone is loaded (None on a first release: no P).
        both_loaded: After ``[P, C]`` are loaded (or C alone), before the load.
        under_load: The GPUs of each scrape taken during the measured load
            (:func:`parse_gpu_metrics` of each), for utilization and peak memory.
    """
    before = parse_gpu_metrics(empty)
    mid = parse_gpu_metrics(baseline_loaded) if baseline_loaded is not None else None
    after = parse_gpu_metrics(both_loaded)
    loaded = [gpus for gpus in under_load if gpus]
    utils = [g.utilization for gpus in loaded for g in gpus.values()
             if g.utilization is not None]
    if not loaded:
        utils = [g.utilization for g in after.values() if g.utilization is not None]
    used = [g.memory_used_bytes for gpus in (*loaded, after) for g in gpus.values()
            if g.memory_used_bytes is not None]
    figures: dict[str, Any] = {
        "utilization_mean": float(np.mean(utils)) if utils else None,
        "peak_used_bytes": float(max(used)) if used else None,
        "load_scrapes": len(loaded),
    }
    if mid is None:
        return GpuEvidence(None, _rise(before, after), None, after, **figures)
    baseline = _rise(before, mid)
    candidate = _rise(mid, after)
    return GpuEvidence(baseline, candidate, gpu_memory_growth_pct(candidate, baseline), after,
                       **figures)


# --------------------------------------------------------------------------- headroom


@dataclass(frozen=True)
class HeadroomCheck:
    """One GPU of one replica: does C fit next to P with the margin left over?"""

    replica: str
    gpu_uuid: str | None
    free_bytes: float | None
    need_bytes: int
    fits: bool

    def describe(self) -> str:
        gpu = self.gpu_uuid or "no GPU metrics"
        return (f"{self.replica} [{gpu}]: free {_mib(self.free_bytes)}, needs "
                f"{_mib(self.need_bytes)} ({'fits' if self.fits else 'does NOT fit'})")


def headroom_checks(replicas: Mapping[str, str], footprint: Footprint, *,
                    headroom_bytes: int, gpus: Sequence[int] | None = None
                    ) -> list[HeadroomCheck]:
    """Per replica and GPU, whether ``footprint`` plus ``headroom_bytes`` fits (pure).

    Args:
        replicas: Replica URL to its metrics text, scraped with P serving.
        footprint: C's bytes per GPU (:func:`choose_footprint`).
        headroom_bytes: What must stay free afterwards (policy ``triton.gpu.headroom_bytes``).
        gpus: Device indices C's instances use (the config's ``gpus``; None: every GPU).
            Indices follow the order of the GPUs' uuids in the scrape.

    A replica without GPU metrics cannot show that C fits, so it does not fit.
    """
    need = footprint.bytes_per_gpu + headroom_bytes
    out: list[HeadroomCheck] = []
    for replica, text in replicas.items():
        found = list(parse_gpu_metrics(text).values())
        used = found if gpus is None else [found[i] for i in gpus if i < len(found)]
        if not used:
            out.append(HeadroomCheck(replica, None, None, need, False))
        for gpu in used:
            free = gpu.free_bytes
            out.append(HeadroomCheck(replica, gpu.uuid, free, need,
                                     free is not None and free >= need))
    return out


def check_headroom(model: str, version: int, checks: Sequence[HeadroomCheck],
                   footprint: Footprint) -> None:
    """Refuse the swap unless every GPU of every replica fits C next to P.

    Raises:
        PreflightError: exit 1, listing each replica's free and needed bytes, the footprint
            and whether it was measured or estimated.
    """
    short = [c for c in checks if not c.fits]
    if not checks or short:
        listed = "; ".join(c.describe() for c in (short or checks)) or "no replicas"
        raise PreflightError(
            f"{model} v{version} does not fit next to production on every GPU: {listed}. "
            f"Footprint {_mib(footprint.bytes_per_gpu)} per GPU ({footprint.source}: "
            f"{footprint.detail})",
            hint="free GPU memory (unload unused models, fewer instances), lower "
            "triton.gpu.headroom_bytes or the TensorRT workspace, or use bigger GPUs; "
            "nothing was changed",
            model=model, version=version, footprint=footprint.to_dict(),
            replicas=[c.__dict__ for c in checks],
        )


def instance_gpus(cfg: model_config_pb2.ModelConfig) -> list[int] | None:
    """Device indices C's ``KIND_GPU`` instances are pinned to; None: every GPU (pure)."""
    pinned = sorted({int(i) for g in cfg.instance_group
                     if g.kind == model_config_pb2.ModelInstanceGroup.KIND_GPU for i in g.gpus})
    return pinned or None


@dataclass(frozen=True)
class HeadroomPlan:
    """The swap preflight's GPU headroom decision, before anything changes.

    Attributes:
        footprint: C's bytes per GPU and whether measured or estimated; None when no
            replica reported a GPU (nothing to check, and no estimate was computed).
        checks: One per GPU of each replica that reported GPUs.
        skipped: Replicas without GPU metrics (a CPU server), with why.
        lines: Plan lines for the swap's plan and progress.
    """

    footprint: Footprint | None
    checks: list[HeadroomCheck] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    lines: list[str] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return all(c.fits for c in self.checks)

    def to_dict(self) -> dict[str, Any]:
        return {"footprint": self.footprint.to_dict() if self.footprint else None,
                "checks": [c.__dict__ for c in self.checks], "skipped": self.skipped,
                "fits": self.fits}


def plan_headroom(model: str, version: int, replicas: Mapping[str, str | None], *,
                  cfg: model_config_pb2.ModelConfig, measured_bytes: int | None,
                  weights_bytes: Callable[[], int], headroom_bytes: int,
                  measured_detail: str | None = None) -> HeadroomPlan:
    """Decide the GPU headroom preflight of a swap (pure but for ``weights_bytes``).

    Args:
        replicas: Replica name to its metrics text, scraped with P serving; None when the
            scrape failed.
        cfg: C's staged config (instance count, ``gpus``, TensorRT workspace).
        measured_bytes: C's footprint measured by the canary, or None.
        weights_bytes: Reads C's ONNX initializer bytes; called only when there is a GPU
            to check and no measurement (the estimate's input).
        headroom_bytes: What must stay free (policy ``triton.gpu.headroom_bytes``).
        measured_detail: Where the measurement comes from (e.g. the release record it was
            read from), for the plan line; default: the canary's memory rise.

    A replica without ``nv_gpu_*`` gauges is skipped with a line (a CPU server: nothing to
    hold). A replica whose scrape failed is skipped too when no replica reports a GPU,
    and does not fit when others do: on a GPU fleet it cannot show that C fits.
    """
    gpu_texts = {name: text for name, text in replicas.items()
                 if text is not None and fleet_target(text) == "gpu"}
    skipped: dict[str, str] = {}
    for name, text in replicas.items():
        if name in gpu_texts:
            continue
        skipped[name] = ("its metrics could not be read" if text is None
                         else "no nv_gpu_* metrics (a CPU server)")
    if not gpu_texts:
        lines = [f"{model}: GPU headroom: skipped on {name}: {why}"
                 for name, why in skipped.items()]
        return HeadroomPlan(None, [], skipped, lines)
    footprint = (Footprint(int(measured_bytes), "measured", measured_detail or _MEASURED)
                 if measured_bytes is not None and measured_bytes > 0
                 else estimate_footprint(weights_bytes(), cfg))
    checks = headroom_checks(gpu_texts, footprint, headroom_bytes=headroom_bytes,
                             gpus=instance_gpus(cfg))
    need = footprint.bytes_per_gpu + headroom_bytes
    for name, why in list(skipped.items()):
        if why.startswith("its metrics"):
            checks.append(HeadroomCheck(name, None, None, need, False))
            del skipped[name]
    lines = [f"{model}: GPU headroom for v{version}: footprint "
             f"{_mib(footprint.bytes_per_gpu)} per GPU ({footprint.source}: "
             f"{footprint.detail}) + {_mib(headroom_bytes)} headroom"]
    lines += [f"{model}: GPU headroom: {c.describe()}" for c in checks]
    lines += [f"{model}: GPU headroom: skipped on {name}: {why}"
              for name, why in skipped.items()]
    return HeadroomPlan(footprint, checks, skipped, lines)


def _mib(value: float | None) -> str:
    return "n/a" if value is None else f"{value / MiB:,.0f} MiB"


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.0f}%"
