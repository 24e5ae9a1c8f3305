"""bench/e2e's arithmetic (pure): the time outside the stages splits into the start, the
time between stages and the end; older result files get the split derived."""

from __future__ import annotations

from typing import Any

from bench.e2e import breakdown, medians

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


def test_an_older_file_gets_the_split_derived() -> None:
    old = {"outside_stages_s": 12.0, "start_s": 8.0, "end_s": 1.0, "overhead_s": 47.0,
           "stages_s": {}, "check_stages_s": {}}
    table = medians([{"first_release": old, "release": {**old, "between_stages_s": 2.5}}])
    assert table["first_release"]["between_stages_s"] == 3.0
    assert table["release"]["between_stages_s"] == 2.5
