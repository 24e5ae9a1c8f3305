"""Seeded traffic generators for calibrating the judges: dependent latency, bursty errors,
load steps. Pure (a ``numpy.random.Generator`` in, arrays out); shared by the unit tests
(``tests/unit/test_blocks.py``, ``test_gates_calibration.py``, ``test_sequential.py``) and
``bench/judge.py``.

- :func:`standard_latency`: the judge bench's standard family, per request in ms: lognormal
  body (median 2 ms, log-sd 0.3) plus, on 5% of requests, an exponential tail of mean 4 ms
  (p50 ≈ 2.0, p99 ≈ 8.6 ms).
- :func:`ar1`: a stationary Gaussian AR(1) series, ``z_t = φ z_{t-1} + √(1-φ²) ε_t``.
- :func:`ar1_latency`: latencies with an exact marginal (any sampler) and AR(1) serial
  dependence: the sorted draws are assigned by the ranks of an AR(1) series (a Gaussian
  copula by rank matching). φ = 0 is the independent sample.
- :func:`bursty_errors`: failures from a two-state Markov chain whose long-run failure rate
  is ``rate`` and whose bursts last ``mean_burst`` requests on average (geometric).
- :func:`tail_stretch`: a tail-only regression: requests below the anchor quantile (p97 for
  p99) unchanged, the excess above it stretched so that the q-quantile moves by ``ratio``.
- :func:`load_step`: a multiplicative latency factor that steps from 1 to ``factor`` at a
  given request (a traffic surge: queueing makes every request slower).
- :func:`arm`: one arm's requests over a run: latencies of the answered ones, their send
  times, and the send times of the failures.
- :func:`load_profile` and :class:`LiveTraffic`: live traffic split by a router (issue 20):
  flat, bursty (on/off) or diurnal-ramp load on both versions at once, AR(1) requests per
  server and a per-server drift, read look by look as the live judge does
  (``tests/unit/test_live_judge_traffic.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from scipy import signal

__all__ = ["Arm", "LiveTraffic", "ar1", "ar1_latency", "arm", "bursty_errors", "load_profile",
           "load_step", "standard_latency", "tail_stretch"]

Sampler = Callable[[np.random.Generator, int], np.ndarray]


def standard_latency(rng: np.random.Generator, n: int) -> np.ndarray:
    """The standard family: lognormal body (median 2 ms, log-sd 0.3) + 5% exp(4 ms) tail."""
    body = 2.0 * np.exp(0.3 * rng.standard_normal(n))
    return body + (rng.random(n) < 0.05) * rng.exponential(4.0, n)


def ar1(rng: np.random.Generator, n: int, phi: float) -> np.ndarray:
    """A stationary standard-normal AR(1) series of length ``n`` with coefficient ``phi``."""
    if n <= 0:
        return np.zeros(0)
    eps = rng.standard_normal(n)
    eps[0] /= np.sqrt(max(1.0 - phi * phi, 1e-12))  # z_0 ~ N(0, 1) after the scaling below
    z: np.ndarray = signal.lfilter([np.sqrt(1.0 - phi * phi)], [1.0, -phi], eps)
    return z


def ar1_latency(rng: np.random.Generator, n: int, phi: float,
                sampler: Sampler = standard_latency) -> np.ndarray:
    """``n`` latencies, marginally ``sampler``'s, serially dependent as an AR(1) of ``phi``."""
    draws = np.sort(sampler(rng, n))
    if phi == 0.0:
        return rng.permutation(draws)
    ranks = np.argsort(np.argsort(ar1(rng, n, phi)))
    return draws[ranks]


def bursty_errors(rng: np.random.Generator, n: int, rate: float,
                  mean_burst: float = 1.0) -> np.ndarray:
    """Which of ``n`` requests fail: long-run rate ``rate``, bursts of mean ``mean_burst``.

    A burst goes on with probability ``1 - 1/mean_burst`` per request; one starts with
    probability ``s = rate / (mean_burst (1 - rate))``, so that the stationary share of
    failing requests is ``rate``. ``mean_burst = 1`` is independent Bernoulli failures.
    """
    if n <= 0 or rate <= 0:
        return np.zeros(max(n, 0), dtype=bool)
    if mean_burst <= 1.0:
        return rng.random(n) < rate
    stay = 1.0 - 1.0 / mean_burst
    start = rate / (mean_burst * (1.0 - rate))
    u = rng.random(n)
    state = bool(rng.random() < rate)
    if start <= stay:
        # Request i fails when u_i < (stay if the previous failed else start): below start it
        # fails and at or above stay it succeeds whatever came before; in between it repeats
        # the previous request. So each request takes the last decided one's state.
        decided = (u < start) | (u >= stay)
        last = np.maximum.accumulate(np.where(decided, np.arange(n), -1))
        return np.where(last >= 0, u[np.maximum(last, 0)] < start, state)
    out = np.zeros(n, dtype=bool)
    for i in range(n):  # start > stay (a rate near 1): a failure makes the next less likely
        state = bool(u[i] < (stay if state else start))
        out[i] = state
    return out


def tail_stretch(latency: np.ndarray, reference: np.ndarray, q: float = 0.99,
                 ratio: float = 1.4) -> np.ndarray:
    """A tail-only regression of ``latency``: its q-quantile ×``ratio``, the body unchanged.

    The anchor is the reference's ``q - 2(1 - q)`` quantile (p97 for p99); the excess over
    the anchor is stretched by ``(ratio·Q(q) - anchor) / (Q(q) - anchor)``.
    """
    anchor = float(np.quantile(reference, max(q - 2.0 * (1.0 - q), 0.5)))
    top = float(np.quantile(reference, q))
    stretch = (ratio * top - anchor) / (top - anchor)
    lat = np.asarray(latency, dtype=float)
    return np.where(lat > anchor, anchor + (lat - anchor) * stretch, lat)


def load_step(n: int, at: int, factor: float) -> np.ndarray:
    """Latency factor per request: 1 before request ``at``, ``factor`` from it on."""
    out = np.ones(n)
    out[max(at, 0):] = factor
    return out


@dataclass(frozen=True)
class Arm:
    """One arm's requests over a run.

    Attributes:
        latency_ms: Latencies of the answered requests, in send order, ms.
        ok_s: Send time of each answered request, s since the run started.
        error_s: Send time of each failed request, s.
    """

    latency_ms: np.ndarray
    ok_s: np.ndarray
    error_s: np.ndarray

    @property
    def requests(self) -> int:
        return int(self.latency_ms.size + self.error_s.size)


def arm(rng: np.random.Generator, n: int, *, phi: float = 0.0, error_rate: float = 0.0,
        mean_burst: float = 1.0, duration_s: float = 30.0,
        sampler: Sampler = standard_latency,
        transform: Callable[[np.ndarray], np.ndarray] | None = None) -> Arm:
    """``n`` requests sent evenly over ``duration_s``: AR(1) latency, bursty failures.

    ``transform`` maps the latencies of all ``n`` requests (in send order) before the
    failures are taken out: a scale (``lambda x: 1.1 * x``), :func:`tail_stretch` or a
    :func:`load_step` factor.
    """
    lat = ar1_latency(rng, n, phi, sampler)
    if transform is not None:
        lat = np.asarray(transform(lat), dtype=float)
    failed = bursty_errors(rng, n, error_rate, mean_burst)
    times = (np.arange(n) + 0.5) * (duration_s / max(n, 1))
    return Arm(lat[~failed], times[~failed], times[failed])


# ----------------------------------------------------------------------------- the bake


def queueing_factor(load: np.ndarray | float, base_util: float = 0.25) -> np.ndarray:
    """Latency multiplier of a server at ``load`` × its usual traffic, when the usual
    traffic keeps it busy ``base_util`` of the time (M/M/1: the time in system ∝
    1 / (1 - ρ)). With the default 0.25, doubling the traffic makes requests ×1.5 slower
    (the issue's surge); ρ is capped at 0.95."""
    rho = np.minimum(base_util * np.asarray(load, dtype=float), 0.95)
    return np.asarray((1.0 - base_util) / (1.0 - rho))


@dataclass(frozen=True)
class BakeTraffic:
    """A simulated bake: per window, the probe's latencies and the fleet's requests.

    Attributes:
        latency_ms: The probe's answered latencies in each window, ms.
        requests: Answered requests per window (probe and organic).
        errors: Failed requests per window.
        rate_rps: Requests per second the fleet counted in each window.
        reference: The first ``reference`` windows are the pre-swap reference.
    """

    latency_ms: tuple[np.ndarray, ...]
    requests: np.ndarray
    errors: np.ndarray
    rate_rps: np.ndarray
    reference: int


def bake_traffic(rng: np.random.Generator, *, reference: int, windows: int,
                 window_s: float = 2.0, probe_rps: float = 40.0, phi: float = 0.0,
                 sampler: Sampler = standard_latency, scale: float = 1.0,
                 load_after: float = 1.0, load_at: int = 0, error_rate: float = 0.0,
                 mean_burst: float = 1.0, base_util: float = 0.25) -> BakeTraffic:
    """``reference`` pre-swap windows, then ``windows`` after the swap, of one fleet.

    The probe sends ``probe_rps`` in every window; its latencies are one AR(1) series of
    ``phi`` across the whole run (:func:`ar1_latency`), so dependence crosses windows and
    the swap. After the swap the version's latency is ×``scale``, and from window
    ``load_at`` after it the traffic is ×``load_after`` (a surge: more requests, slower
    by :func:`queueing_factor`); a negative ``load_at`` starts the step that many windows
    before the swap (a load step the reference shares). Failures follow
    :func:`bursty_errors` over every request after the swap (probe and organic), in order,
    so bursts cross window edges.
    """
    per = max(int(round(probe_rps * window_s)), 1)
    total = reference + windows
    lat = ar1_latency(rng, per * total, phi, sampler).reshape(total, per)
    load = np.ones(total)
    load[max(reference + load_at, 0):] = load_after
    lat = lat * queueing_factor(load, base_util)[:, None] / queueing_factor(1.0, base_util)
    lat[reference:] *= scale
    sent = np.rint(per * load).astype(np.int64)
    failed = bursty_errors(rng, int(sent.sum()), error_rate, mean_burst)
    errors = np.add.reduceat(failed.astype(np.int64), np.concatenate([[0],
                                                                      np.cumsum(sent)[:-1]]))
    errors[:reference] = 0
    return BakeTraffic(tuple(lat), sent - errors, errors, sent / window_s, reference)


# ------------------------------------------------------------------- live traffic (issue 20)


def load_profile(rng: np.random.Generator, kind: str, looks: int, *, look_s: float = 0.5,
                 base_rps: float = 200.0, burst_x: float = 4.0, burst_every_s: float = 10.0,
                 burst_s: float = 3.0, ramp: tuple[float, float] = (0.5, 2.5)) -> np.ndarray:
    """Requests per second reaching the router at each look (pure, seeded).

    - ``flat``: ``base_rps`` throughout;
    - ``bursty``: on/off: bursts start as a Poisson process (one per ``burst_every_s`` on
      average), last an exponential ``burst_s`` on average, and multiply the rate by
      ``burst_x``;
    - ``diurnal``: the morning arriving: a linear ramp from ``ramp[0]`` to ``ramp[1]`` ×
      ``base_rps`` over the looks.
    """
    if kind == "flat":
        return np.full(looks, base_rps)
    if kind == "diurnal":
        return base_rps * np.linspace(ramp[0], ramp[1], looks)
    if kind != "bursty":
        raise ValueError(f"unknown load profile {kind!r}")
    start, end = look_s / burst_every_s, look_s / burst_s
    u = rng.random(looks)
    on = np.zeros(looks, dtype=bool)
    state = False
    for i in range(looks):
        state = bool(u[i] >= end) if state else bool(u[i] < start)
        on[i] = state
    return base_rps * np.where(on, burst_x, 1.0)


@dataclass
class LiveTraffic:
    """Live traffic split by a router between production P (the replicas) and a candidate C
    (the canary Triton), one look at a time, as the live judge reads it: per arm, the
    requests of the look and their mean server-side µs (pure, seeded).

    - requests: Poisson(``rps[i] · look_s``), each to C with probability ``share``;
    - per request: :func:`standard_latency`, AR(1)-dependent in request order on each
      server (``phi``: requests share a queue and a batcher), so dependence crosses looks;
    - load: the same :func:`queueing_factor` of the look's rate on both arms (a burst or the
      morning ramp reaches both versions at the same time);
    - drift: a per-server slow factor ``exp(drift · AR(1)(drift_phi))`` per look,
      independent between the arms (a noisy neighbour, CPU contention, a cache): the
      dependence a shared load does not cancel;
    - the candidate's latency is ×``candidate_x``.
    """

    rng: np.random.Generator
    rps: np.ndarray
    phi: float = 0.6
    drift: float = 0.15
    drift_phi: float = 0.6
    candidate_x: float = 1.0
    look_s: float = 0.5
    base_util: float = 0.25

    def __post_init__(self) -> None:
        looks = self.rps.size
        total = int(self.rps.sum() * self.look_s * 1.2) + 100
        self._streams = [ar1_latency(self.rng, total, self.phi) * 1000.0 for _ in range(2)]
        self._drifts = [np.exp(self.drift * ar1(self.rng, looks, self.drift_phi))
                        for _ in range(2)]
        self._load = queueing_factor(self.rps / float(np.median(self.rps)), self.base_util) \
            / queueing_factor(1.0, self.base_util)
        self._next = [0, 0]

    def look(self, i: int, share: float) -> tuple[tuple[int, float | None],
                                                   tuple[int, float | None]]:
        """Look ``i`` with the candidate at ``share`` (0-1): ``((requests, mean µs or
        None), ...)`` of the candidate, then production."""
        sent = int(self.rng.poisson(self.rps[i] * self.look_s))
        to_c = int(self.rng.binomial(sent, share))
        out = []
        for arm, n, scale in ((0, to_c, self.candidate_x), (1, sent - to_c, 1.0)):
            at = self._next[arm]
            self._next[arm] = at + n
            mean = float(self._streams[arm][at:at + n].mean()) if n else None
            out.append((n, None if mean is None else
                        mean * scale * float(self._load[i] * self._drifts[arm][i])))
        return out[0], out[1]
