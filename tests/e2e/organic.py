"""Live clients in the test process: open-loop load through the session stack's gateway,
on a thread of its own, with the same engine ``modelship load`` runs
(:func:`modelship.loadgen.run_load`).

``modelship load`` as a process paid its interpreter, imports and clients (5-15 s on a
loaded machine) before its first request, so a surge started after a swap missed the
first part of the bake it was meant to cover, and every process's start-up was CPU that
the two test workers share. Here the first request leaves at once and is stopped at
once. What reaches the stack is the same: requests at ``rate`` per second through the
gateway (routed and mirrored as production traffic is), HTTP or gRPC.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np

from modelship.loadgen import LoadSpec
from modelship.loadgen.engine import run_load
from modelship.settings import Settings
from tests import models
from tests.e2e.live_clients import answered, promote, replica_urls, when_serving
from tests.inprocess import beside, run_inprocess

__all__ = ["ROWS", "Organic", "in_production", "release_under_surge", "when_flowing"]

ROWS = {"input": np.random.default_rng(11).uniform(
    -1.0, 1.0, (64, models.N_FEATURES)).astype(np.float32)}
"""The clients' inputs: rows of the test models' one input (``models.onnx_graph``)."""


class Organic:
    """``rate`` requests/s of ``model`` through the gateway for at most ``seconds``, from a
    thread of this process, until :meth:`stop` (or the ``with`` block's end).

    The report (``report``) is the engine's: every request with its answer."""

    def __init__(self, settings: Settings, model: str, rate: float, seconds: float, *,
                 protocol: str = "grpc", rows: Mapping[str, np.ndarray] = ROWS) -> None:
        url = settings.gateway_grpc if protocol == "grpc" else settings.gateway_url
        assert url, "the session stack runs a gateway"
        self.url, self.model, self.rows = str(url), model, rows
        self.spec = LoadSpec(protocol=protocol,  # type: ignore[arg-type]
                             rate_rps=rate, duration_s=seconds, warmup_s=0.0,
                             timeout_s=settings.http_timeout_s)
        self.report: Any = None
        self.error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"organic-{model}",
                                        daemon=True)
        self._thread.start()
        self._started.wait(30)

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as error:  # noqa: BLE001 - reported by stop()
            self.error = error
        finally:
            self._started.set()

    async def _main(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        self._started.set()
        self.report = await run_load([self.url], self.model, self.rows, self.spec, stop=self._stop)

    def running(self) -> bool:
        """Still sending (False once it ended, by itself or with an error)."""
        return self._thread.is_alive()

    def stop(self) -> Any:
        """End the load and return its report; raises what ended it, if anything did."""
        if self._loop is not None and self._stop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(60)
        assert not self._thread.is_alive(), f"the {self.model} clients did not stop"
        if self.error is not None:
            raise self.error
        return self.report

    def __enter__(self) -> Organic:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        report_error = None
        try:
            self.stop()
        except BaseException as stopped:  # noqa: BLE001 - the body's error comes first
            report_error = stopped
        if error is None and report_error is not None:
            raise report_error


def when_flowing(settings: Settings, clients: Organic, *, requests: int = 40,
                 timeout_s: float = 120) -> None:
    """Wait until the clients' requests reach the replicas (Triton's success counts of
    their model), so a release started next sees them in its first window."""
    urls = replica_urls(settings)
    before, deadline = answered(urls, clients.model), time.monotonic() + timeout_s
    while answered(urls, clients.model) < before + requests:
        assert clients.running(), clients.stop()
        assert time.monotonic() < deadline, f"no live requests after {timeout_s:g} s"
        time.sleep(0.25)


def in_production(settings: Settings, model: str) -> int:
    """A new version of ``model`` (``models.onnx_graph("softmax")``) in production, staged
    and swapped in-process (no check, no canary: the production a test's releases start
    from, not a release under test). Its version."""
    version = models.register_onnx(str(settings.mlflow_tracking_uri), model,
                                   models.onnx_graph("softmax"))
    for args in (("stage", model, "--version", str(version)),
                 ("swap", model, "--to", str(version), "--force")):
        done = run_inprocess(*args, "--json", home=settings.home)
        assert done.returncode == 0, done.stderr[-4000:]
    return version


def release_under_surge(settings: Settings, model: str, policy: Path, version: int, *,
                        rate: float, protocol: str = "grpc") -> tuple[int, Any]:
    """Release ``version`` (in-process) while clients send ``rate`` req/s through the
    gateway (flowing before the release starts), and ×10 that from the moment every
    replica serves ``version`` (the swap is done, the bake begins) to the release's end.
    Its exit code and record."""
    surges: list[Organic] = []

    def surge_once_serving(done: threading.Event) -> None:
        if when_serving(settings, model, done, version) and not done.is_set():
            surges.append(Organic(settings, model, 10 * rate, 300, protocol=protocol))

    with Organic(settings, model, rate, 600, protocol=protocol) as background:
        when_flowing(settings, background)  # before the release measures anything
        try:
            with beside(surge_once_serving) as surging:
                code, record = promote(settings, model, policy, version)
            surging.result()
        finally:
            for surge in surges:
                surge.stop()
    return code, record
