"""bench/traffic's breach-to-0 figures (bench/traffic_breach.py): the times of one trial
from the router's and the clients' timestamps (pure)."""

from __future__ import annotations

from bench.traffic_breach import SLOW_VERSION, trial_figures
from modelship.traffic.port import PRODUCTION_ONLY, TrafficSplit

SLOW = str(SLOW_VERSION)


def test_a_trial_measures_from_the_deciding_look() -> None:
    calls = [("set_weights", 5.0, 1.0), ("live", TrafficSplit(5, 0), 1.2),
             ("live", TrafficSplit(5, 0), 9.9),          # a read before the decision
             ("set_weights", 0.0, 10.2), ("mirror", 0.0, 10.25),
             ("live", PRODUCTION_ONLY, 10.3)]
    answers = [(9.0, SLOW), (9.8, "1"), (10.05, SLOW), (10.15, SLOW), (10.4, "1")]
    got = trial_figures(10.0, calls, answers, step_set=1.0)
    assert got == {"breach_after_s": 9.0, "weight0_s": 0.2, "production_s": 0.3,
                   "last_answer_s": 0.15, "answers_after_decision": 2}


def test_a_router_that_never_read_production_has_no_production_time() -> None:
    calls = [("set_weights", 0.0, 10.2), ("live", TrafficSplit(5, 0), 10.3)]
    got = trial_figures(10.0, calls, [(9.0, "1")], step_set=5.0)
    assert (got["weight0_s"], got["production_s"], got["last_answer_s"]) == (0.2, None, None)
