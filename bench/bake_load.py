"""What organic load does to the bake's evidence on the real stack: the probe's latency and
Triton's queue and compute time per request, at rising organic load, same version.

Run: ``.venv/bin/python -m bench.bake_load [--levels 0,2,12] [--windows 3]``. It starts the
embedded stack (2 replicas and the canary) in a temporary home, releases a small ONNX
classifier (``tests.models.onnx_graph("softmax")``) with ``modelship promote``, then for
each organic level ``c`` runs ``modelship load --concurrency c`` (closed-loop clients, as
the issue's "1 → 12 requests in flight") and measures ``--windows`` bake windows of 4 s
with :func:`tasks.bake.measure_window` at the default probe rate (80 req/s): the fleet's
request rate, requests in flight (Little's law), queue and compute µs per request, and the
probe's p50/p90. The last level is the quiet fleet again (drift check).

The question it answers (tasks/bake.py's docstring): can Triton's compute time, which
excludes queueing, be a load-free control on a CPU fleet? Figures go to
``bench/results/bake_load.json``; the ratios are each level's median window against the
quiet fleet's. Runtime: about 4 minutes on 2 CPUs (stack start included).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.results import print_table, write_results
from modelship.clients import build_clients
from modelship.policy import BakePolicy
from modelship.settings import Settings, load_settings
from modelship.stack import manager
from tasks.bake import measure_window
from tasks.payload import load_payload
from tests import models
from tests.conftest import MODELSHIP, RUNTIME_VENV, cli_env, run_cli

MODEL = "bake-load"
WINDOW_S = 4.0


def measure(settings: Settings, levels: list[int], windows: int) -> dict[str, Any]:
    """Release the model, then the windows at each organic level."""
    uri = str(settings.mlflow_tracking_uri)
    version = models.register_onnx(uri, MODEL, models.onnx_graph("softmax"))
    policy_file = models.write_policy(settings.home / "bake-load.yaml", {
        "canary": {"warmup_s": 1.0, "window_s": 2.0, "max_duration_s": 30.0,
                   "min_samples": 300}, "bake": {"duration_s": 0.0}})
    done = run_cli("promote", MODEL, "--version", str(version), "--policy", str(policy_file),
                   "--json", home=settings.home, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"promote failed ({done.returncode}): {done.stderr[-2000:]}")
    clients = build_clients(settings)
    assert clients.storage is not None
    payload, _ = load_payload(clients.storage, clients.registry,
                              repository_prefix=settings.repository_prefix, model=MODEL,
                              version=version)
    policy = BakePolicy()
    rows: list[dict[str, Any]] = []
    try:
        for level in levels:
            organic = None
            if level:
                organic = subprocess.Popen(
                    [str(MODELSHIP), "load", MODEL, "--concurrency", str(level), "--duration",
                     f"{windows * (WINDOW_S + 1) + 10:g}", "--json"],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                    env=cli_env(settings.home))
                time.sleep(4)  # the clients are up and sending
            try:
                for i in range(windows):
                    w = measure_window(clients.replicas, index=i, model=MODEL,
                                       version=version, payload=payload, policy=policy,
                                       seconds=WINDOW_S, timeout_s=settings.http_timeout_s)
                    lat = np.asarray(w.latencies_ms)
                    rows.append({"organic_concurrency": level, "window": i,
                                 "rate_rps": w.load_rps, "inflight": w.inflight,
                                 "pending": w.pending, "queue_us": w.queue_us,
                                 "compute_us": w.compute_us,
                                 "probe_p50_ms": float(np.median(lat)),
                                 "probe_p90_ms": float(np.percentile(lat, 90)),
                                 "probe_log_sd": float(np.std(np.log(lat)))})
                    print(rows[-1], flush=True)
            finally:
                if organic is not None:
                    organic.kill()
                    organic.wait()
    finally:
        clients.close()
    return {"rows": rows, "levels": summarize(rows)}


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per level (in order, the quiet fleet's first run as the base): medians and ratios."""
    seen: list[int] = []
    for row in rows:
        key = row["organic_concurrency"]
        if not seen or seen[-1] != key:
            seen.append(key)
    out = []
    blocks = []
    start = 0
    for key in seen:
        block = []
        while start < len(rows) and rows[start]["organic_concurrency"] == key:
            block.append(rows[start])
            start += 1
        blocks.append((key, block))
    base = {k: statistics.median(r[k] for r in blocks[0][1])
            for k in ("compute_us", "probe_p50_ms", "queue_us", "rate_rps")}
    for key, block in blocks:
        med = {k: statistics.median(r[k] for r in block if r[k] is not None)
               for k in ("rate_rps", "inflight", "queue_us", "compute_us", "probe_p50_ms",
                         "probe_p90_ms", "probe_log_sd")}
        out.append({"organic_concurrency": key, **med,
                    "compute_ratio": med["compute_us"] / base["compute_us"],
                    "probe_p50_ratio": med["probe_p50_ms"] / base["probe_p50_ms"],
                    "rate_ratio": med["rate_rps"] / base["rate_rps"]})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.bake_load", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--levels", default="0,2,12,0",
                        help="organic closed-loop concurrency levels, in order")
    parser.add_argument("--windows", type=int, default=3, help="windows per level")
    args = parser.parse_args(argv)
    for key, value in {"DO_NOT_TRACK": "true", "MLFLOW_DISABLE_TELEMETRY": "true",
                       "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
                       "GX_ANALYTICS_ENABLED": "false"}.items():
        os.environ.setdefault(key, value)
    levels = [int(x) for x in args.levels.split(",")]
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="ms-bench-bake-") as tmp:
        home = Path(tmp) / ".modelship"
        base = Settings(home=home, triton_runtime=RUNTIME_VENV)
        try:
            manager.up(base, replicas=2)
            figures = measure(load_settings(home=home, triton_runtime=RUNTIME_VENV), levels,
                              args.windows)
        finally:
            manager.down(base)
    figures["runtime_s"] = round(time.monotonic() - started, 1)
    path = write_results("bake_load", figures)
    print_table("Same version, rising organic load (medians of 4-s windows; probe 80 req/s)",
                ["organic c", "rate req/s", "in flight", "queue µs", "compute µs",
                 "compute ×", "probe p50 ms", "probe p50 ×", "log-sd"],
                [[r["organic_concurrency"], f"{r['rate_rps']:.0f}", f"{r['inflight']:.2f}",
                  f"{r['queue_us']:.0f}", f"{r['compute_us']:.0f}",
                  f"{r['compute_ratio']:.2f}", f"{r['probe_p50_ms']:.2f}",
                  f"{r['probe_p50_ratio']:.2f}", f"{r['probe_log_sd']:.2f}"]
                 for r in figures["levels"]])
    print(f"\nwritten to {path} ({figures['runtime_s']} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
