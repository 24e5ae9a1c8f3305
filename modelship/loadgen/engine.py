"""The engine: drives one load run over a transport and turns its records into a report.

Shapes of a run:

- **concurrency**: ``concurrency`` workers in a closed loop (send, wait, send again).
- **rate**: open loop at ``rate_rps`` with constant or Poisson gaps; at most
  ``max_outstanding`` requests in flight, after which new arrivals wait (and are counted
  as ``throttled``) rather than pile up without bound.
- **stability** (default) or **fixed duration** (``duration_s``: no stability rule, for
  benchmarks that run through a swap); both end early on a ``stop`` event.
- **paired**: two arms (server, model, version) get the SAME row back-to-back, alternating
  which goes first, each record tagged with its arm. ``concurrency`` and ``rate_rps`` then
  count pairs, i.e. they are per arm.

The transport is chosen by :func:`choose_transport`, looked up here at call time (the
client-CPU benchmark swaps it to compare transports).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from modelship.errors import UsageError
from modelship.loadgen.payload import check_payload
from modelship.loadgen.report import LoadReport, RequestRecord, WindowStats
from modelship.loadgen.spec import LoadSpec, Target, arrival_gaps_s
from modelship.loadgen.stats import is_stable, short_error, summarize, window_stats
from modelship.loadgen.transports import RequestFailed, Transport, choose_transport

_DRAIN_GRACE_S = 1.0


@dataclass(frozen=True)
class _Leg:
    """One request of a unit: which target, and the arm's tag in paired mode."""

    target: int
    tag: str | None


class _Engine:
    """Runs one load: workers or an arrival scheduler, plus the window monitor."""

    def __init__(
        self,
        transport: Transport,
        units: Callable[[int], Sequence[_Leg]],
        spec: LoadSpec,
        stop: asyncio.Event | None,
        n_rows: int,
    ) -> None:
        self._transport = transport
        self._n_rows = n_rows
        self._units = units
        self._spec = spec
        self._stop = stop
        self._records: list[RequestRecord] = []
        self._counter = 0
        self._stopping = False
        self._throttled = 0
        self._t0 = 0.0

    def _next(self) -> int:
        """The next request index (shared by every worker, so rows cycle in order)."""
        index = self._counter
        self._counter += 1
        return index

    async def _unit(self, index: int) -> None:
        """Send one unit: one request, or one row to both arms in turn."""
        records = self._records
        send = self._transport.send
        t0 = self._t0
        for leg in self._units(index):
            started = time.perf_counter()
            error: str | None = None
            version = ""
            outputs = None
            try:
                version, outputs = await send(leg.target, index)
            except RequestFailed as exc:
                error = short_error(str(exc))
            except Exception as exc:  # noqa: BLE001 - any failure is a failed request
                error = short_error(f"{type(exc).__name__}: {exc}")
            ended = time.perf_counter()
            records.append(
                RequestRecord(
                    start_s=started - t0,
                    latency_ms=(ended - started) * 1000.0,
                    ok=error is None,
                    error=error,
                    server=leg.target,
                    model_version=version,
                    row=(index * self._spec.batch_size) % self._n_rows,
                    tag=leg.tag,
                    outputs=outputs,
                )
            )

    async def _worker(self) -> None:
        """A closed-loop worker: send, wait for the answer, send again."""
        while not self._stopping:
            await self._unit(self._next())

    async def _scheduler(self) -> None:
        """The open loop: arrivals at the spec's rate, at most ``max_outstanding`` in flight."""
        spec = self._spec
        gap = arrival_gaps_s(spec, random.Random(spec.seed))
        slots = asyncio.Semaphore(spec.max_outstanding)
        in_flight: set[asyncio.Task[None]] = set()

        async def one(index: int) -> None:
            try:
                await self._unit(index)
            finally:
                slots.release()

        next_s = time.perf_counter()
        try:
            while not self._stopping:
                delay_s = next_s - time.perf_counter()
                if delay_s > 0:
                    await asyncio.sleep(delay_s)
                if self._stopping:
                    break
                if slots.locked():
                    self._throttled += 1
                await slots.acquire()
                task = asyncio.ensure_future(one(self._next()))
                in_flight.add(task)
                task.add_done_callback(in_flight.discard)
                next_s += gap()
        finally:
            if in_flight:
                await asyncio.wait(in_flight, timeout=spec.timeout_s + _DRAIN_GRACE_S)
                for task in in_flight:
                    task.cancel()

    async def _sleep_until(self, at_s: float) -> bool:
        """Sleep until ``at_s`` (run-relative); ``True`` if the stop event fired first."""
        delay_s = at_s - (time.perf_counter() - self._t0)
        if self._stop is None:
            if delay_s > 0:
                await asyncio.sleep(delay_s)
            return False
        if self._stop.is_set():
            return True
        if delay_s <= 0:
            return False
        try:
            await asyncio.wait_for(self._stop.wait(), timeout=delay_s)
        except TimeoutError:
            return False
        return True

    async def _monitor(self) -> tuple[float, float, list[WindowStats], bool | None, bool]:
        """Warm up, then close windows until stable, out of time or stopped."""
        spec = self._spec
        fixed = spec.duration_s is not None
        end_s = spec.duration_s if fixed else spec.max_duration_s
        assert end_s is not None
        warmup_s = min(spec.warmup_s, end_s)
        windows: list[WindowStats] = []
        if await self._sleep_until(warmup_s):
            now_s = time.perf_counter() - self._t0
            return warmup_s, max(now_s, warmup_s), windows, (None if fixed else False), True
        seen = _completed_after(self._records, warmup_s)
        window_start_s = warmup_s
        while True:
            window_end_s = min(window_start_s + spec.window_s, end_s)
            stopped = await self._sleep_until(window_end_s)
            if stopped:
                window_end_s = time.perf_counter() - self._t0
            fresh = self._records[seen:]
            seen = len(self._records)
            if window_end_s - window_start_s >= spec.window_s * 0.5 or not windows:
                windows.append(window_stats(fresh, window_start_s, window_end_s))
            if stopped:
                return warmup_s, window_end_s, windows, (None if fixed else False), True
            if not fixed and is_stable(windows, spec.stability_pct, spec.stable_windows):
                first = windows[-spec.stable_windows].start_s
                return first, window_end_s, windows, True, False
            if fixed and window_end_s >= end_s:
                return warmup_s, window_end_s, windows, None, False
            if not fixed and window_end_s + spec.window_s > end_s + 1e-9:
                return warmup_s, window_end_s, windows, False, False
            window_start_s = window_end_s

    async def run(self, server_names: Sequence[str]) -> LoadReport:
        """Drive the load until the monitor ends it, drain, and summarize every record."""
        spec = self._spec
        self._t0 = time.perf_counter()
        if spec.concurrency is not None:
            drivers = [asyncio.ensure_future(self._worker()) for _ in range(spec.concurrency)]
        else:
            drivers = [asyncio.ensure_future(self._scheduler())]
        try:
            from_s, to_s, windows, stable, stopped = await self._monitor()
        finally:
            self._stopping = True
            done, pending = await asyncio.wait(drivers, timeout=spec.timeout_s * 2 + 2.0)
            for task in pending:
                task.cancel()
            await self._transport.close()
        for task in done:
            failure = None if task.cancelled() else task.exception()
            if failure is not None:
                raise failure
        return summarize(
            self._records,
            measured_from_s=from_s,
            measured_to_s=to_s,
            spec=spec,
            server_names=server_names,
            windows=windows,
            stable=stable,
            throttled=self._throttled,
            stopped=stopped,
        )


def _completed_after(records: Sequence[RequestRecord], at_s: float) -> int:
    """Index of the first record (records are in completion order) completed after at_s."""
    for i in range(len(records) - 1, -1, -1):
        if records[i].end_s <= at_s:
            return i + 1
    return 0



async def run_load(
    servers: Sequence[str],
    model: str,
    payload: Mapping[str, np.ndarray],
    spec: LoadSpec,
    *,
    version: str = "",
    stop: asyncio.Event | None = None,
) -> LoadReport:
    """Load one model on one or more servers, requests spread round-robin over them.

    Args:
        servers: gRPC ``host:port`` or HTTP ``http://host:port`` of each server (e.g.
            every replica), matching ``spec.protocol``.
        model: Triton model name.
        payload: Input arrays by name, rows first; request ``i`` takes the next
            ``spec.batch_size`` rows, cyclically.
        spec: Load shape, windows and timeouts.
        version: Explicit model version, or ``""`` for Triton's choice.
        stop: Ends the run early when set (the report then has ``stopped: true``).

    Returns:
        The report; ``report.records`` has every request.

    Raises:
        UsageError: An invalid spec, payload or an empty server list.
    """
    spec.validate()
    if not servers:
        raise UsageError("no servers to load", hint="Give at least one Triton endpoint")
    n_rows = check_payload(payload)
    targets = [Target(url, model, version) for url in servers]
    n = len(targets)
    legs = [(_Leg(i, None),) for i in range(n)]
    engine = _Engine(
        choose_transport(targets, payload, spec), lambda i: legs[i % n], spec, stop, n_rows
    )
    return await engine.run(list(servers))


async def run_paired(
    baseline: Target,
    candidate: Target,
    payload: Mapping[str, np.ndarray],
    spec: LoadSpec,
    *,
    stop: asyncio.Event | None = None,
    tags: tuple[str, str] = ("baseline", "candidate"),
) -> LoadReport:
    """Send the same rows to two arms back-to-back, alternating which goes first.

    Records carry the arm as ``tag`` and ``server`` (0 baseline, 1 candidate), so the
    canary compares latency, errors and outputs (``spec.keep_outputs``) on identical
    inputs at the same time, as Kayenta compares against a concurrent baseline.

    Args:
        baseline: The production arm.
        candidate: The arm under test.
        payload: Input arrays by name, rows first.
        spec: Load shape; ``concurrency`` and ``rate_rps`` count pairs (per arm).
        stop: Ends the run early when set.
        tags: Names of the two arms in records and ``by_arm``.

    Returns:
        The report, with ``by_arm`` per arm.

    Raises:
        UsageError: An invalid spec or payload.
    """
    spec.validate()
    n_rows = check_payload(payload)
    targets = [baseline, candidate]
    orders = (
        (_Leg(0, tags[0]), _Leg(1, tags[1])),
        (_Leg(1, tags[1]), _Leg(0, tags[0])),
    )
    engine = _Engine(
        choose_transport(targets, payload, spec), lambda i: orders[i % 2], spec, stop, n_rows
    )
    names = [f"{t.url}/{t.model}/{t.version or '-'}" for t in targets]
    return await engine.run(names)


def run_load_sync(
    servers: Sequence[str],
    model: str,
    payload: Mapping[str, np.ndarray],
    spec: LoadSpec,
    *,
    version: str = "",
) -> LoadReport:
    """:func:`run_load` in a fresh event loop, for the CLI and scripts."""
    return asyncio.run(run_load(servers, model, payload, spec, version=version))
