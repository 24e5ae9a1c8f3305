"""Stage 3, trial load: the candidate must load and answer in a scratch Triton model.

The candidate is loaded on the canary Triton under a scratch model name, with its files
sent inside the load request (``load_model(config=..., files=...)``), so nothing is written
to the shared repository before the candidate has proven that it loads. The golden rows
go through Triton and must match onnxruntime's answers within the parity tolerance. The
scratch model is unloaded afterwards, on success and on failure.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from modelship.errors import ModelshipError, Unreachable, ValidationFailed
from modelship.policy import ParityPolicy
from modelship.triton.client import TritonServer
from modelship.triton.infer import TritonInference
from modelship.triton.model_config import ModelConfig, to_json
from modelship.triton.target import render_for_servers


def scratch_name(model: str, version: int) -> str:
    """A model name no release uses, so a trial never touches the served model."""
    return f"_trial_{model}_v{version}_{uuid.uuid4().hex[:8]}"


def load_files(files: Mapping[str, Path], version: int = 1) -> dict[str, bytes]:
    """The ``files`` argument of a load request: ``file:<version>/<name>`` -> bytes."""
    return {f"file:{version}/{name}": Path(path).read_bytes() for name, path in files.items()}


def run_onnxruntime(onnx_path: Path, feed: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Reference answers from onnxruntime in this process."""
    session = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, dict(feed)), strict=True))


def compare_outputs(
    reference: Mapping[str, np.ndarray], served: Mapping[str, np.ndarray], parity: ParityPolicy
) -> dict[str, Any]:
    """Per output: the worst element and whether it is within tolerance (pure)."""
    report: dict[str, Any] = {}
    for name, want in reference.items():
        got = served.get(name)
        if got is None:
            report[name] = {"passed": False, "reason": "missing from Triton's answer"}
            continue
        want_a = np.asarray(want)
        got_a = np.asarray(got).reshape(want_a.shape) if np.asarray(got).size == want_a.size \
            else np.asarray(got)
        if got_a.shape != want_a.shape:
            report[name] = {"passed": False,
                            "reason": f"shape {list(got_a.shape)} != {list(want_a.shape)}"}
            continue
        if want_a.dtype.kind in "fc":
            diff = np.abs(got_a.astype(np.float64) - want_a.astype(np.float64))
            bound = parity.atol + parity.rtol * np.abs(want_a.astype(np.float64))
            bad = ~(diff <= bound)
            worst = int(np.nanargmax(np.where(np.isnan(diff), np.inf, diff))) if diff.size else 0
            report[name] = {"passed": not bool(bad.any()),
                            "max_abs_err": float(np.nanmax(diff)) if diff.size else 0.0,
                            "mismatches": int(bad.sum()),
                            "worst_index": [int(i) for i in np.unravel_index(worst, diff.shape)]}
        else:
            mismatches = int((got_a != want_a).sum())
            report[name] = {"passed": mismatches == 0, "mismatches": mismatches}
    return report


def trial_load(
    canary: TritonServer,
    inference: TritonInference,
    *,
    model: str,
    version: int,
    config: ModelConfig,
    files: Mapping[str, Path],
    feed: Mapping[str, np.ndarray],
    parity: ParityPolicy,
) -> dict[str, Any]:
    """Load under a scratch name, answer the golden rows, compare, always unload.

    ``config`` is loaded in the canary's form (:mod:`modelship.triton.target`): a GPU
    config is trial-loaded as its CPU derivation on a CPU canary, as is on a GPU one.
    """
    name = scratch_name(model, version)
    scratch, _ = render_for_servers(config, [canary], timeout_s=canary.timeout_s)
    scratch.name = name
    scratch.version_policy.Clear()
    scratch.version_policy.specific.versions.append(1)
    started = time.monotonic()
    loaded = False
    try:
        try:
            canary.load_model(name, config_json=to_json(scratch), files=load_files(files))
            loaded = True
        except ModelshipError as exc:
            if isinstance(exc, Unreachable):
                raise
            raise ValidationFailed(
                f"{model} v{version} failed to load in a scratch Triton model: {exc.message}",
                hint="the graph or its config is not servable; fix the export (see the "
                "Triton error above) and register a new version",
                stage="trial_load",
            ) from exc
        load_s = time.monotonic() - started
        outputs = [o.name for o in config.output]
        served = inference.infer_rows(name, dict(feed), outputs=outputs,
                                      max_batch=max(1, config.max_batch_size))
        reference = run_onnxruntime(files["model.onnx"], feed)
        report = compare_outputs({k: reference[k] for k in outputs if k in reference}, served,
                                 parity)
        failed = {k: v for k, v in report.items() if not v["passed"]}
        if failed:
            raise ValidationFailed(
                f"{model} v{version} answers differently in Triton than in onnxruntime: "
                + "; ".join(f"{k}: {v}" for k, v in failed.items()),
                hint="the Triton config does not match the graph (dtypes, dims, reshape)",
                stage="trial_load", outputs=report,
            )
        return {"success": True, "scratch_model": name, "server": canary.name,
                "load_s": round(load_s, 3),
                "rows": int(len(next(iter(feed.values())))), "outputs": report}
    finally:
        if loaded:
            try:
                canary.unload_model(name)
            except ModelshipError:
                pass
