"""The canary report: what the approver reads before clicking Approve.

Three files from one result (:func:`write_canary_report`):

- ``canary.md``: the verdict, the gates table (value, baseline, threshold, p-value,
  verdict per rule), client latency percentiles, throughput and errors per version,
  output agreement, Triton's server-side queue and compute µs, the load, the plot, and,
  on a GPU canary, GPU memory (P's and C's footprints, growth) and utilization.
  The same text is the CLI's human output and the Prefect artifact.
- ``canary.png``: the latency ECDFs of baseline and candidate on a log axis; a shift or a
  fatter tail shows at a glance where a table of percentiles hides it.
- ``canary.json``: the result's ``to_dict()``, with these paths.

Rendering is pure (:func:`render_markdown`); only the writer touches the disk.
"""

from __future__ import annotations

import json
import math
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from modelship.measurements import ArmMeasurements, CanarySnapshot
from modelship.triton.gpu import GpuEvidence
from tasks.gate_report import GateReport
from tasks.gates import markdown_table

MARKDOWN_NAME = "canary.md"
PLOT_NAME = "canary.png"
JSON_NAME = "canary.json"
_PLOT_DPI = 110
_PLOT_SIZE_IN = (7.0, 4.2)
_PLOT_MARGINS = {"left": 0.1, "right": 0.97, "bottom": 0.12, "top": 0.92}
_COLOURS = {"baseline": "#4c72b0", "candidate": "#dd8452"}


class CanaryReportSource(Protocol):
    """What a report is written from (``tasks.canary.CanaryResult`` is one)."""

    model: str
    candidate: int
    baseline: int | None
    verdict: str
    snapshot: CanarySnapshot
    gate_report: GateReport
    load: dict[str, Any]
    seconds: float
    skipped_rules: list[str]
    gpu: GpuEvidence | None

    def to_dict(self) -> dict[str, Any]:
        """The JSON document of the result."""
        ...


@dataclass(frozen=True)
class ReportPaths:
    """Where one canary report was written."""

    markdown: str
    png: str
    json: str

    def to_dict(self) -> dict[str, str]:
        """JSON-ready form."""
        return {"markdown": self.markdown, "png": self.png, "json": self.json}


# --------------------------------------------------------------------------- formatting (pure)


def _num(value: float | None, digits: int = 3) -> str:
    """A number for a table cell; ``–`` for no data (never a fake 0)."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "–"
    return f"{value:.{digits}g}"


def _pct(value: float | None) -> str:
    if value is None or not math.isfinite(value):
        return "–"
    return f"{value * 100:.2f}%"


def _arms(snapshot: CanarySnapshot) -> list[tuple[str, ArmMeasurements]]:
    arms = [("baseline", snapshot.baseline)] if snapshot.baseline is not None else []
    return [*arms, ("candidate", snapshot.candidate)]


def latency_table(snapshot: CanarySnapshot) -> str:
    """Client-side latency percentiles (ms), throughput and errors per version."""
    lines = ["| arm | version | answered | p50 ms | p90 ms | p95 ms | p99 ms | mean ms | "
             "throughput req/s | errors | error rate |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, arm in _arms(snapshot):
        lat = np.asarray(arm.latency_ms, dtype=float)
        lat = lat[np.isfinite(lat)]
        pcts = [float(np.percentile(lat, q)) if lat.size else None for q in (50, 90, 95, 99)]
        mean = float(lat.mean()) if lat.size else None
        rate = arm.errors / arm.requests if arm.requests > 0 else None
        cells = [name, f"v{arm.version}", str(int(lat.size)), *[_num(p) for p in pcts],
                 _num(mean), _num(arm.throughput_rps, 4), str(arm.errors), _pct(rate)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def server_table(snapshot: CanarySnapshot) -> str:
    """Triton's own view per version next to the client's, and the client overhead.

    Queue + compute is what the server spent per request (the ``server_latency`` rule
    compares it between the arms); Triton's end-to-end request time against the client's
    mean latency gives the client overhead (network, serialisation, the load generator),
    in ms and as a share of the client latency. Overhead dilutes a relative slowdown seen
    from the client: a +15% server-side regression is less than +15% client-side.
    """
    server = snapshot.extra.get("server_metrics") or {}
    lines = ["| arm | version | queue µs | compute µs | queue + compute µs | infer µs | "
             "server request µs | client mean µs | client overhead | mean batch | "
             "server requests | server failures |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, arm in _arms(snapshot):
        seen: Mapping[str, Any] = server.get(name) or {}
        lat = np.asarray(arm.latency_ms, dtype=float)
        lat = lat[np.isfinite(lat)]
        client_us = float(lat.mean()) * 1000.0 if lat.size else None
        both = (arm.queue_us_mean + arm.compute_us_mean
                if arm.queue_us_mean is not None and arm.compute_us_mean is not None else None)
        request_us = seen.get("request_us_mean")
        overhead = "–"
        if client_us is not None and request_us is not None and client_us > 0:
            extra = client_us - float(request_us)
            overhead = f"{extra:.4g} µs ({extra / client_us:.0%})"
        cells = [name, f"v{arm.version}", _num(arm.queue_us_mean), _num(arm.compute_us_mean),
                 _num(both), _num(seen.get("compute_infer_us_mean")), _num(request_us),
                 _num(client_us), overhead, _num(seen.get("batch_size_mean")),
                 _num(seen.get("requests"), 9) if seen else "–",
                 _num(seen.get("failures"), 9) if seen else "–"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def agreement_line(snapshot: CanarySnapshot) -> str:
    """One sentence on output agreement, saying why when there is none."""
    if snapshot.baseline is None:
        return "No baseline (first release): output agreement was not measured."
    if snapshot.agreement is None or snapshot.agreement_samples == 0:
        return ("No input row was answered by both versions, so agreement is unknown "
                "(see the errors above).")
    how = ("same top-1 label" if snapshot.agreement_kind == "classifier"
           else "values within the regressor tolerance")
    return (f"{_pct(snapshot.agreement)} of {snapshot.agreement_samples} rows agree "
            f"({snapshot.agreement_kind}: {how}).")


def gpu_table(gpu: GpuEvidence) -> str:
    """Per GPU of the canary, with P and C loaded: memory used/total (MiB), utilization."""
    lines = ["| GPU | used MiB | total MiB | free MiB | utilization | power W |",
             "|---|---|---|---|---|---|"]
    for sample in gpu.after.values():
        cells = [sample.uuid, _mib(sample.memory_used_bytes), _mib(sample.memory_total_bytes),
                 _mib(sample.free_bytes), _pct(sample.utilization),
                 _num(sample.power_usage_w)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _mib(value: float | None) -> str:
    if value is None or not math.isfinite(value):
        return "–"
    return f"{value / 2**20:,.0f}"


def render_markdown(result: CanaryReportSource, *, plot_name: str | None = PLOT_NAME) -> str:
    """The whole report as Markdown (pure); ``plot_name`` is linked relative to the file."""
    snapshot = result.snapshot
    against = f"v{result.baseline}" if result.baseline is not None else "no baseline"
    load = result.load
    lines = [
        f"# Canary: {result.model} v{result.candidate} against {against}: "
        f"**{result.verdict.upper()}**",
        "",
        f"- Model `{result.model}`, candidate v{result.candidate}, baseline "
        + (f"v{result.baseline} (production)" if result.baseline is not None
           else "none (first release: only absolute gates apply)"),
        f"- Measured {_num(snapshot.window_s)} s"
        + (f" ({len(load.get('rounds', []))} round(s), stable: {load.get('stable')})"
           if load else "")
        + f"; the canary took {_num(result.seconds)} s in all",
    ]
    if load:
        samples = load.get("samples", {})
        lines.append(
            "- Samples per version: "
            + ", ".join(f"{arm} {n}" for arm, n in sorted(samples.items()))
            + f" (required {load.get('required_samples')})"
        )
        shape = (f"concurrency {load.get('concurrency')}" if load.get("mode") == "concurrency"
                 else f"rate {load.get('rate_rps')} req/s")
        how = ("paired (same row to both, interleaved)" if load.get("paired")
               else "candidate only")
        lines.append(f"- Load: {load.get('protocol')}, {shape} per version, {how}"
                     f", warm-up {_num(load.get('warmup_s'))} s; inputs: "
                     f"{load.get('payload_rows')} rows ({load.get('payload_source')})")
    lines += ["", "## Gates", "", markdown_table(result.gate_report).rstrip(), ""]
    messages = [r.message for r in result.gate_report.results]
    lines += [f"- {m}" for m in messages if m]
    if result.skipped_rules:
        lines.append(f"- Not judged without a baseline: {', '.join(result.skipped_rules)}")
    lines += ["", "## Latency (client side)", "", latency_table(snapshot).rstrip(), ""]
    if plot_name:
        lines += [f"![Latency ECDF, baseline against candidate]({plot_name})", ""]
    lines += ["## Output agreement", "", agreement_line(snapshot), ""]
    lines += ["## Server side (Triton, per request)", "",
              "Triton's counters, scraped after the warm-up and after the last round, so "
              "they cover every measured round (client figures cover the measurement "
              "windows only). Client overhead = client mean latency − Triton's request "
              "time: the part of the client latency the model version does not cause.", "",
              server_table(snapshot).rstrip(), ""]
    gpu = result.gpu
    if gpu is not None:
        lines += ["## GPU (canary server)", "", gpu_table(gpu).rstrip(), "",
                  *[f"- {line}" for line in gpu.report_lines()], ""]
    notes = snapshot.extra.get("notes") or []
    if notes:
        lines += ["## Notes", "", *[f"- {n}" for n in notes], ""]
    return "\n".join(lines)


# --------------------------------------------------------------------------- plot


def prepare_plotting() -> None:
    """Import what :func:`plot_latency_ecdf` needs (~1-3 s), e.g. while the canary waits
    for Triton to unload."""
    # lazy: matplotlib costs ~1 s at import; only the latency plot needs it
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: F401
    from matplotlib.figure import Figure  # noqa: F401


def plot_latency_ecdf(snapshot: CanarySnapshot, path: Path) -> Path:
    """Write the latency ECDFs (log x) of baseline and candidate as a PNG.

    Uses matplotlib's Agg canvas directly, not pyplot, so it never touches a display or
    pyplot's global state (safe in worker threads and Prefect tasks).
    """
    # lazy: matplotlib costs ~1 s at import; only the latency plot needs it
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=_PLOT_SIZE_IN, dpi=_PLOT_DPI)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot(1, 1, 1)
    drawn = False
    for name, arm in _arms(snapshot):
        lat = np.sort(np.asarray(arm.latency_ms, dtype=float))
        lat = lat[np.isfinite(lat) & (lat > 0)]
        if not lat.size:
            continue
        ecdf = np.arange(1, lat.size + 1) / lat.size
        p99 = float(np.percentile(lat, 99))
        axes.step(lat, ecdf, where="post", color=_COLOURS[name], linewidth=1.5,
                  label=f"{name} v{arm.version} (n={lat.size}, p50 "
                        f"{np.percentile(lat, 50):.3g} ms, p99 {p99:.3g} ms)")
        axes.axvline(p99, color=_COLOURS[name], linestyle=":", linewidth=1)
        drawn = True
    if drawn:
        axes.set_xscale("log")
        axes.legend(loc="lower right", fontsize=8)
    else:
        axes.text(0.5, 0.5, "no answered requests: nothing to plot", ha="center",
                  va="center", transform=axes.transAxes)
    axes.axhline(0.99, color="grey", linestyle="--", linewidth=0.8)
    axes.set_ylim(0, 1.01)
    axes.set_xlabel("client latency, ms (log scale; dotted: p99)")
    axes.set_ylabel("fraction of requests ≤ x")
    axes.set_title(f"{snapshot.model}: latency ECDF, baseline against candidate")
    axes.grid(True, which="both", alpha=0.3)
    # fixed margins: tight_layout measures every text (~0.7 s) for the same layout
    figure.subplots_adjust(**_PLOT_MARGINS)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(str(path), format="png")
    return path


# --------------------------------------------------------------------------- writing


def write_canary_report(result: CanaryReportSource, out_dir: Path, *,
                        plotted: bool = False) -> ReportPaths:
    """Write ``canary.md``, ``canary.png`` and ``canary.json`` into ``out_dir``.

    ``plotted``: ``canary.png`` is already there, drawn by :func:`plot_latency_ecdf` from
    this result's snapshot (the canary draws it while Triton unloads)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = ReportPaths(markdown=str(out_dir / MARKDOWN_NAME), png=str(out_dir / PLOT_NAME),
                        json=str(out_dir / JSON_NAME))
    if not plotted or not Path(paths.png).is_file():
        plot_latency_ecdf(result.snapshot, Path(paths.png))
    Path(paths.markdown).write_text(render_markdown(result, plot_name=PLOT_NAME),
                                    encoding="utf-8")
    document = {**result.to_dict(), "report": paths.to_dict()}
    Path(paths.json).write_text(json.dumps(document, indent=2, default=_json_default,
                                           allow_nan=False) + "\n", encoding="utf-8")
    return paths


def _json_default(value: Any) -> Any:
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.floating):
        return float(value) if math.isfinite(value) else None
    if isinstance(value, np.ndarray):
        return value.tolist()
    return str(value)


def artifact_key(text: str) -> str:
    """A Prefect artifact key: lowercase letters, digits and dashes only."""
    return re.sub(r"-+", "-", re.sub(r"[^a-z0-9-]", "-", text.lower())).strip("-") or "canary"


def publish_markdown_artifact(markdown: str, *, key: str,
                              description: str = "Canary report") -> bool:
    """Attach the report to the current Prefect flow or task run; False outside one.

    Outside a run there is nowhere to attach it (and creating one would start Prefect's
    ephemeral server), so the CLI path writes files only. Prefect is not even imported
    unless something already imported it.
    """
    if "prefect" not in sys.modules:
        return False
    # lazy: prefect costs ~3 s at import and tasks.canary does not load it; only a Prefect run
    from prefect.artifacts import create_markdown_artifact
    from prefect.context import FlowRunContext, TaskRunContext

    if FlowRunContext.get() is None and TaskRunContext.get() is None:
        return False
    create_markdown_artifact(markdown=markdown, key=artifact_key(key), description=description)
    return True
