"""bench/traffic's breach-to-0 figure (issue 20 item 6): how long a slow candidate keeps
answering live requests after the progressive canary's judge decides it breached.

A slow ONNX graph (``tests.integration.test_canary.slow_onnx_graph``, the I/O of the
bench's model with a heavy MatMul chain in the path) is loaded as ``gw`` version 3 alone on
the canary Triton; production (v1) stays on the replicas. Under HTTP load through the
gateway, each trial runs the real progressive executor (:func:`tasks.progressive.
run_progressive`, the real judge on Triton's counters: :class:`tasks.progressive.
LiveEvidence`, the default policy's rules) over steps 5 → 25 → 50 % until it steps back.
Every router call and every answer the clients received is timestamped on one clock
(``time.perf_counter``), so per trial:

- ``weight0_s``: from the look that decided the breach to ``set_weights(0)`` returned;
- ``production_s``: from that look to the first ``live()`` read back production only
  (what ``to_production_s`` in the canary stage's record measures);
- ``last_answer_s``: from that look to the last answer the clients got from the candidate
  (requests the gateway had already routed to it finish after the weight moved), and how
  many of its answers arrived after the decision.

The gateway's access log is off outside a shadow window (docs/gateway.md), so the last
answer is read from the clients' side: each answer names the version that served it.
"""

from __future__ import annotations

import asyncio
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from modelship.clients import build_clients
from modelship.loadgen import LoadSpec, run_load
from modelship.loadgen import engine as load_engine
from modelship.policy import Policy
from modelship.settings import Settings
from modelship.traffic.local_gateway import LocalGateway
from modelship.traffic.port import PRODUCTION_ONLY, TrafficSplit
from tasks.live_judge import LiveJudge, LiveRules
from tasks.progressive import LOOK_S, LiveEvidence, Progressive, run_progressive
from tasks.traffic_plan import ProgressivePlan, Status, same_split

SLOW_VERSION = 3
PRODUCTION_VERSION = 1
PLAN = ProgressivePlan(steps=(5.0, 25.0, 50.0), min_s=2.0, max_s=20.0)


class TimedRouter:
    """The gateway with every call's return time kept (``time.perf_counter``)."""

    def __init__(self, inner: LocalGateway) -> None:
        self.inner, self.name = inner, inner.name
        self.calls: list[tuple[str, Any, float]] = []

    def set_weights(self, canary_pct: float) -> None:
        self.inner.set_weights(canary_pct)
        self.calls.append(("set_weights", canary_pct, time.perf_counter()))

    def mirror(self, pct: float) -> None:
        self.inner.mirror(pct)
        self.calls.append(("mirror", pct, time.perf_counter()))

    def live(self) -> TrafficSplit:
        split = self.inner.live()
        self.calls.append(("live", split, time.perf_counter()))
        return split


@dataclass
class AnswerClock:
    """Wraps every transport the load generator builds: the time each answer arrived and
    the version that gave it."""

    answers: list[tuple[float, str]] = field(default_factory=list)

    def __enter__(self) -> AnswerClock:
        choose = self._choose = load_engine.choose_transport

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            transport = choose(*args, **kwargs)
            send = transport.send

            async def timed(target: int, index: int) -> Any:
                out = await send(target, index)
                self.answers.append((time.perf_counter(), str(out[0])))
                return out

            setattr(transport, "send", timed)  # noqa: B010 - wraps the instance's method
            return transport

        load_engine.choose_transport = wrapped
        return self

    def __exit__(self, *_: object) -> None:
        load_engine.choose_transport = self._choose


def trial_figures(decided: float, router_calls: list[tuple[str, Any, float]],
                  answers: list[tuple[float, str]], *, step_set: float) -> dict[str, Any]:
    """One trial's times, from the deciding look (pure)."""
    after = [c for c in router_calls if c[2] >= decided]
    weight0 = next((t for name, pct, t in after if name == "set_weights" and pct == 0), None)
    production = next((t for name, split, t in after if name == "live"
                       and same_split(split, PRODUCTION_ONLY)), None)
    mine = [t for t, version in answers if version == str(SLOW_VERSION)]
    late = [t for t in mine if t >= decided]

    def since(t: float | None) -> float | None:
        return None if t is None else round(t - decided, 3)

    return {"breach_after_s": round(decided - step_set, 2),
            "weight0_s": since(weight0), "production_s": since(production),
            "last_answer_s": since(max(mine)) if mine else None,
            "answers_after_decision": len(late)}


def one_trial(settings: Settings, router: LocalGateway,
              answers: AnswerClock) -> dict[str, Any]:
    """One progressive canary of the slow candidate, to its step back."""
    clients = build_clients(settings)
    assert clients.canary is not None
    judge = LiveJudge(LiveRules.from_policy(Policy()))
    evidence = LiveEvidence(clients.canary, list(clients.replicas), model="gw",
                            candidate=SLOW_VERSION, production=PRODUCTION_VERSION,
                            judge=judge, timeout_s=10.0)
    timed = TimedRouter(router)
    decisions: list[tuple[Status, float, int]] = []

    def judged(step: int) -> Status:
        status = evidence(step)
        decisions.append((status, time.perf_counter(), step))
        return status

    result = run_progressive(Progressive(PLAN, timed, judged, lambda _doc: None,
                                         look_s=LOOK_S, clock=time.perf_counter))
    status, decided, step = decisions[-1]
    sets = [t for name, pct, t in timed.calls if name == "set_weights" and pct == PLAN.steps[step]]
    return {"outcome": result.action.outcome, "step": PLAN.name(step), "judge": status,
            "looks": judge.looks, "to_production_s": round(result.to_production_s or 0, 3),
            **trial_figures(decided, timed.calls, answers.answers, step_set=sets[-1])}


def breach_to_zero(settings: Settings, state: dict[str, Any], router: LocalGateway,
                   load_slow: Callable[[], None], payload: dict[str, np.ndarray],
                   trials: int) -> dict[str, Any]:
    """``trials`` progressive canaries of the slow candidate under HTTP load (concurrency
    4) through the gateway; each one's times, and their median and max."""
    load_slow()
    ready = threading.Event()
    holder: dict[str, Any] = {}

    def load() -> None:
        async def run() -> None:
            holder["loop"], holder["stop"] = asyncio.get_running_loop(), asyncio.Event()
            ready.set()
            holder["report"] = await run_load(
                [state["gateway"]["http"]], "gw", payload,
                LoadSpec(protocol="http", concurrency=4, duration_s=600.0, warmup_s=0.0,
                         timeout_s=10.0), stop=holder["stop"])

        asyncio.run(run())

    rows: list[dict[str, Any]] = []
    with AnswerClock() as answers:
        thread = threading.Thread(target=load)
        thread.start()
        ready.wait(30.0)
        try:
            time.sleep(1.0)
            for _ in range(trials):
                rows.append(one_trial(settings, router, answers))
                time.sleep(1.0)
        finally:
            holder["loop"].call_soon_threadsafe(holder["stop"].set)
            thread.join()
    failed = sum(1 for r in holder["report"].records if not r.ok)
    summary = {key: {"median": statistics.median(v), "max": max(v)}
               for key in ("weight0_s", "production_s", "last_answer_s")
               if (v := [r[key] for r in rows if r[key] is not None])}
    return {"trials": rows, "summary": summary, "load_failed": failed,
            "load_requests": len(holder["report"].records),
            "plan": {"steps": list(PLAN.steps), "look_s": LOOK_S}}
