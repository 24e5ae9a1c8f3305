"""The local gateway (nginx) under load: failed requests while the weights and the mirror
move, and the latency it adds against direct Triton, in the same run.

Run: ``.venv/bin/python -m bench.traffic [--move-s S] [--latency-s S] [--trials N]``. It starts a
2-replica stack in a temporary home (stopped at the end, also on failure), puts a tiny ONNX
MLP ``gw`` in its S3 repository, and loads it as version 1 on the replicas and version 2 on
the canary Triton, so each answer names its backend. Then:

1. **Added latency**, per protocol: :func:`modelship.loadgen.run_paired` at concurrency 1
   sends each row to replica 0 directly and through the gateway back to back (the order
   alternates), for ``--latency-s``; p50/p99 of each arm and their ratio.
2. **Moves under load**: HTTP and gRPC load (concurrency 4 each) through the gateway for
   ``--move-s`` while the split steps through :data:`MOVES` (one change a second); failed
   requests, requests the client sent again because nginx had not read them (a graceful
   reload closes kept-alive connections: docs/gateway.md), answers per backend, and how
   long each change took (call to the new workers answering).
3. **Breach to weight 0** (:mod:`bench.traffic_breach`): ``--trials`` progressive canaries
   of a slow v3 on the canary Triton under HTTP load through the gateway, each run by the
   real executor and judge until it steps back; the seconds from the deciding look to the
   weight set to 0, to the gateway read back at production only, and to the candidate's
   last answer to a client.
4. **Stack start**: when the gateway was ready against the whole ``stack up``.

Figures go to ``bench/results/traffic.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bench.results import print_table, write_results
from bench.traffic_breach import SLOW_VERSION, breach_to_zero
from modelship.clients import build_clients
from modelship.loadgen import LoadReport, LoadSpec, Target, percentiles_ms, run_load, run_paired
from modelship.loadgen import engine as load_engine
from modelship.settings import Settings, load_settings
from modelship.stack import manager
from modelship.stack.local_triton import mlp_classifier_onnx
from modelship.traffic.local_gateway import LocalGateway
from modelship.traffic.port import TrafficSplit

ROOT = Path(__file__).resolve().parent.parent
MODEL = "gw"
N_FEATURES = 4
PAYLOAD = {"input": np.random.default_rng(7).standard_normal((64, N_FEATURES))
           .astype(np.float32)}
#: The splits the moves step through, in order, again and again (canary %, mirror %).
MOVES = [TrafficSplit(5, 0), TrafficSplit(5, 50), TrafficSplit(50, 50), TrafficSplit(100, 0),
         TrafficSplit(25, 100), TrafficSplit(0, 0)]


def model_config(version: int) -> dict[str, Any]:
    """``gw``'s full config, serving ``version`` only (a load's override replaces it)."""
    return {
        "name": MODEL, "backend": "onnxruntime", "max_batch_size": 32,
        "version_policy": {"specific": {"versions": [version]}},
        "input": [{"name": "input", "data_type": "TYPE_FP32", "dims": [N_FEATURES]}],
        "output": [
            {"name": "label", "data_type": "TYPE_INT64", "dims": [1], "reshape": {"shape": []}},
            {"name": "probabilities", "data_type": "TYPE_FP32", "dims": [3]},
        ],
        "instance_group": [{"kind": "KIND_CPU", "count": 1}],
    }


def serve_two_versions(settings: Settings, state: dict[str, Any]) -> Callable[[], None]:
    """Put ``gw`` in the stack's repository, load v1 on the replicas and v2 on the canary;
    returns the undo (unload everywhere, delete the objects)."""
    storage = build_clients(settings).storage
    assert storage is not None
    prefix = f"{settings.repository_prefix}/{MODEL}"
    onnx = mlp_classifier_onnx(N_FEATURES)[0].SerializeToString()
    storage.put_bytes(f"{prefix}/config.pbtxt", f'name: "{MODEL}"\n'.encode())
    for version in (1, 2):
        storage.put_bytes(f"{prefix}/{version}/model.onnx", onnx)
    tritons = [(e["http"], 1) for e in state["triton"]["replicas"]]
    tritons.append((state["triton"]["canary"]["http"], 2))
    for url, version in tritons:
        _triton(url).load_model(MODEL, config=json.dumps(model_config(version)))

    def undo() -> None:
        for url, _ in tritons:
            _triton(url).unload_model(MODEL)
        storage.delete_prefix(prefix + "/")

    return undo


def _triton(url: str) -> Any:
    import tritonclient.http as triton_http  # lazy: only when a stack is there

    return triton_http.InferenceServerClient(url.removeprefix("http://"), network_timeout=60.0)


def slow_candidate(settings: Settings, state: dict[str, Any]) -> Callable[[], None]:
    """What loads a slow v3 of ``gw`` (a heavy MatMul chain in the path) alone on the
    canary Triton (``serve_two_versions``' undo removes it)."""
    # lazy: tests.integration.test_canary pulls pytest and pandas; only this phase needs it
    from tests.integration.test_canary import slow_onnx_graph

    def load() -> None:
        storage = build_clients(settings).storage
        assert storage is not None
        graph = slow_onnx_graph(N_FEATURES, width=512, layers=64)
        storage.put_bytes(f"{settings.repository_prefix}/{MODEL}/{SLOW_VERSION}/model.onnx",
                          graph.SerializeToString())
        _triton(state["triton"]["canary"]["http"]).load_model(
            MODEL, config=json.dumps(model_config(SLOW_VERSION)))

    return load


class CountingTransports:
    """Keeps every transport the load generator builds, to read their resend counts."""

    def __init__(self) -> None:
        self.made: list[Any] = []
        self._choose = load_engine.choose_transport

    def __enter__(self) -> CountingTransports:
        def choose(*args: Any, **kwargs: Any) -> Any:
            transport = self._choose(*args, **kwargs)
            self.made.append(transport)
            return transport

        load_engine.choose_transport = choose  # type: ignore[assignment]
        return self

    def __exit__(self, *_: object) -> None:
        load_engine.choose_transport = self._choose

    @property
    def resent(self) -> int:
        return sum(int(getattr(t, "resent", 0)) for t in self.made)


def added_latency(state: dict[str, Any], protocol: str, seconds: float) -> dict[str, Any]:
    """p50/p99 of replica 0 direct against the gateway, each row to both back to back."""
    direct = state["triton"]["replicas"][0]["http" if protocol == "http" else "grpc"]
    gateway = state["gateway"]["http" if protocol == "http" else "grpc"]
    spec = LoadSpec(protocol=protocol, concurrency=1, duration_s=seconds,  # type: ignore[arg-type]
                    warmup_s=1.0, timeout_s=10.0)
    report = asyncio.run(run_paired(Target(direct, MODEL), Target(gateway, MODEL), PAYLOAD,
                                    spec, tags=("direct", "gateway")))
    arms: dict[str, Any] = {}
    for tag in ("direct", "gateway"):
        latencies = [r.latency_ms for r in report.records if r.tag == tag and r.ok]
        pct = percentiles_ms(latencies)
        arms[tag] = {"requests": len(latencies), "p50_ms": round(pct["p50"], 3),
                     "p99_ms": round(pct["p99"], 3),
                     "failed": sum(1 for r in report.records if r.tag == tag and not r.ok)}
    arms["ratio_p50"] = round(arms["gateway"]["p50_ms"] / arms["direct"]["p50_ms"], 2)
    arms["ratio_p99"] = round(arms["gateway"]["p99_ms"] / arms["direct"]["p99_ms"], 2)
    arms["added_p50_ms"] = round(arms["gateway"]["p50_ms"] - arms["direct"]["p50_ms"], 3)
    return arms


def moves_under_load(state: dict[str, Any], router: LocalGateway,
                     seconds: float) -> dict[str, Any]:
    """HTTP and gRPC load through the gateway while the split steps through MOVES."""
    reports: dict[str, LoadReport] = {}
    targets = (("http", state["gateway"]["http"]), ("grpc", state["gateway"]["grpc"]))

    def load() -> None:
        async def both() -> None:
            done = await asyncio.gather(*[
                run_load([target], MODEL, PAYLOAD, LoadSpec(
                    protocol=protocol, concurrency=4, duration_s=seconds,  # type: ignore[arg-type]
                    warmup_s=0.0, timeout_s=10.0))
                for protocol, target in targets])
            reports.update(zip(("http", "grpc"), done, strict=True))

        asyncio.run(both())

    changes: list[float] = []
    with CountingTransports() as counted:
        thread = threading.Thread(target=load)
        thread.start()
        time.sleep(1.0)
        step = 0
        end = time.monotonic() + seconds - 2.0
        while time.monotonic() < end:
            split = MOVES[step % len(MOVES)]
            for change, share in ((router.set_weights, split.canary_pct),
                                  (router.mirror, split.mirror_pct)):
                started = time.monotonic()
                change(share)
                changes.append(time.monotonic() - started)
            if router.live() != split:
                raise AssertionError(f"the gateway says {router.live()}, not {split}")
            step += 1
            time.sleep(1.0)
        router.set_weights(0)
        router.mirror(0)
        thread.join()
    out: dict[str, Any] = {"changes": len(changes), "splits": step,
                           "change_s_median": round(statistics.median(changes), 3),
                           "change_s_max": round(max(changes), 3),
                           "resent_unread": counted.resent}
    for protocol, report in reports.items():
        out[protocol] = {
            "requests": len(report.records),
            "failed": sum(1 for r in report.records if not r.ok),
            "errors": dict(Counter(r.error for r in report.records if not r.ok)),
            "answered_by": dict(Counter(r.model_version for r in report.records if r.ok)),
        }
    return out


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--move-s", type=float, default=30.0)
    parser.add_argument("--latency-s", type=float, default=10.0)
    parser.add_argument("--trials", type=int, default=3,
                        help="progressive canaries of the slow candidate (breach to 0)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="ms-bench-traffic-") as tmp:
        settings = Settings(home=Path(tmp) / ".modelship", triton_runtime=ROOT / ".venv-triton")
        try:
            state, startup = manager.up(settings, replicas=2)
            loaded = load_settings(home=settings.home, triton_runtime=settings.triton_runtime)
            undo = serve_two_versions(loaded, state)
            router = LocalGateway.from_state(state)
            latency = {p: added_latency(state, p, args.latency_s) for p in ("grpc", "http")}
            moves = moves_under_load(state, router, args.move_s)
            breach = breach_to_zero(loaded, state, router, slow_candidate(loaded, state),
                                    PAYLOAD, args.trials)
            undo()
        finally:
            manager.down(settings)
    figures = {
        "stack_up": {"gateway_ready_s": startup.ready_s.get("gateway"),
                     "total_s": startup.total_s,
                     "last_ready": max(startup.ready_s, key=lambda k: startup.ready_s[k])},
        "added_latency": latency, "moves": moves, "breach_to_zero": breach,
        "goal": "0 failed requests while the split moves",
    }
    path = write_results("traffic", figures)
    print_table("the gateway's added latency (concurrency 1, paired rows, same run)",
                ["protocol", "direct p50", "gateway p50", "ratio", "direct p99", "gateway p99",
                 "ratio"],
                [[p, f"{a['direct']['p50_ms']:.2f} ms", f"{a['gateway']['p50_ms']:.2f} ms",
                  f"{a['ratio_p50']:.2f}", f"{a['direct']['p99_ms']:.2f} ms",
                  f"{a['gateway']['p99_ms']:.2f} ms", f"{a['ratio_p99']:.2f}"]
                 for p, a in latency.items()])
    print_table(f"moves under load ({moves['changes']} changes, median "
                f"{moves['change_s_median']:.2f} s, max {moves['change_s_max']:.2f} s; "
                f"{moves['resent_unread']} unread requests sent again)",
                ["protocol", "requests", "failed", "answered by v1/v2"],
                [[p, moves[p]["requests"], moves[p]["failed"],
                  f"{moves[p]['answered_by'].get('1', 0)}/{moves[p]['answered_by'].get('2', 0)}"]
                 for p in ("http", "grpc")])
    print_breach(breach)
    print(f"\ngateway ready {figures['stack_up']['gateway_ready_s']} s into a "
          f"{startup.total_s} s `stack up`; written to {path}")


def print_breach(breach: dict[str, Any]) -> None:
    """The breach-to-0 table: one row per trial, times from the deciding look."""
    print_table(f"breach to weight 0 (a slow v{SLOW_VERSION} under progressive "
                f"{'/'.join(f'{s:g}' for s in breach['plan']['steps'])} %, HTTP load through "
                f"the gateway, {breach['load_failed']} of {breach['load_requests']} requests "
                "failed; seconds from the deciding look)",
                ["trial", "step", "breach after", "set 0 returned", "read back production",
                 "last v3 answer", "v3 answers after"],
                [[i + 1, r["step"], f"{r['breach_after_s']:.1f} s", f"{r['weight0_s']} s",
                  f"{r['production_s']} s", f"{r['last_answer_s']} s",
                  r["answers_after_decision"]] for i, r in enumerate(breach["trials"])])


if __name__ == "__main__":
    main()
