"""bench/e2e's arithmetic (pure): the time outside the stages splits into the start, the
time between stages and the end; the canary's load window is the wall time its load ran
(from its progress events), the bake's watch includes its baseline window; older result
files get the split derived."""

from __future__ import annotations

from typing import Any

from bench.e2e import breakdown, canary_events, canary_phases, medians

RECORD: dict[str, Any] = {
    "_launched_at": "2026-12-02T00:00:00+00:00", "started_at": "2026-12-02T00:00:07+00:00",
    "finished_at": "2026-12-02T00:01:00+00:00", "_exited_at": "2026-12-02T00:01:01.500000+00:00",
    "stages": [
        {"name": "resolve", "started_at": "2026-12-02T00:00:08+00:00",
         "ended_at": "2026-12-02T00:00:11+00:00"},
        {"name": "canary", "started_at": "2026-12-02T00:00:12+00:00",
         "ended_at": "2026-12-02T00:00:42+00:00"},
        {"name": "bake", "started_at": "2026-12-02T00:00:45+00:00",
         "ended_at": "2026-12-02T00:00:58+00:00"},
    ],
    "gates": {"load": {"rounds": [{"duration_s": 20.0}]}},
    "bake": {"windows": [{"seconds": 5.0}, {"seconds": 5.0}]},
}


def test_outside_the_stages_is_start_between_and_end() -> None:
    figures = breakdown(61.5, RECORD)
    assert figures["stages_s"] == {"resolve": 3.0, "canary": 30.0, "bake": 13.0}
    assert (figures["start_s"], figures["end_s"]) == (7.0, 1.5)
    assert figures["outside_stages_s"] == 15.5
    assert figures["between_stages_s"] == 7.0  # 15.5 - 7.0 - 1.5: 00:07-08, 11-12, 42-45, 58-60
    assert figures["overhead_s"] == 31.5  # 61.5 - 20 s of canary load - 10 s of bake watch
    assert figures["canary_phases_s"] == {}  # no progress events: the measured windows count
    assert figures["overhead_windows_s"] == 31.5


STDERR = """\
00:00:12.100 | INFO    | Task run 'canary m v2 vs 1' - took the canary slot for canary of m v2
00:00:12.500 | INFO    | Task run 'canary m v2 vs 1' - loading m v1 (baseline) and v2 (candidate)
00:00:14.500 | INFO    | Task run 'canary m v2 vs 1' - warming up for 1 s
00:00:15.600 | INFO    | Task run 'canary m v2 vs 1' - measuring until 6000 answered requests
00:00:20.000 | INFO    | Flow run 'promote m v2' - canary round 9: not the canary task's line
00:00:35.900 | INFO    | Task run 'canary m v2 vs 1' - canary round 1: 15.0 s, answered 9000
00:00:37.000 | INFO    | Task run 'canary m v2 vs 1' - canary round 2: 1.0 s, answered 9500
00:00:37.100 | INFO    | Task run 'canary m v2 vs 1' - unloading m from the canary canary
00:00:40.500 | INFO    | Task run 'canary m v2 vs 1' - canary of m v2: passed (report r.md)
00:00:40.700 | INFO    | Task run 'canary m v2 vs 1' - freed the canary slot of canary of m v2
"""


def test_the_canary_load_window_is_the_wall_time_its_load_ran() -> None:
    record = {**RECORD, "_canary_events": canary_events(STDERR),
              "gates": {"load": {"rounds": [{"duration_s": 15.0}, {"duration_s": 1.0}]}},
              "bake": {"windows": [{"seconds": 5.0}, {"seconds": 5.0}],
                       "baseline": {"seconds": 2.0}}}
    assert canary_phases(record) == {"before_load": 0.5, "load": 2.0, "load_window": 22.5,
                                     "after_load": 3.5, "after_report": 1.5}
    figures = breakdown(61.5, record)
    # warm-up and the discarded windows are load: 14.5 -> 37.0; the baseline window is bake
    assert (figures["canary_load_s"], figures["bake_watch_s"]) == (22.5, 12.0)
    assert figures["overhead_s"] == 27.0  # 61.5 - 22.5 - 12.0
    # the figure before session 21: only the kept windows (16 s) and the bake's windows
    assert (figures["canary_measured_s"], figures["bake_windows_s"]) == (16.0, 10.0)
    assert figures["overhead_windows_s"] == 35.5


def test_a_canary_without_its_events_has_no_phases() -> None:
    events = canary_events(STDERR.replace(" - canary of m v2: passed", " - done"))
    assert "verdict" not in events
    assert canary_phases({**RECORD, "_canary_events": events}) == {}


def test_an_older_file_gets_the_split_derived() -> None:
    old = {"outside_stages_s": 12.0, "start_s": 8.0, "end_s": 1.0, "overhead_s": 47.0,
           "stages_s": {}, "check_stages_s": {}}
    table = medians([{"first_release": old, "release": {**old, "between_stages_s": 2.5}}])
    assert table["first_release"]["between_stages_s"] == 3.0
    assert table["release"]["between_stages_s"] == 2.5
    # its overhead counted the measured windows only: that is its overhead_windows_s
    assert table["first_release"]["overhead_windows_s"] == 47.0
