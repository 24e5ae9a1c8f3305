"""The xdist controller brings down the stacks a crashed worker left (tests/conftest.py)."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import leftover_stack_homes


def test_the_stack_homes_under_the_workers_temp_directories_are_found(tmp_path: Path) -> None:
    homes = [tmp_path / "popen-gw0" / "stack0" / ".modelship",
             tmp_path / "popen-gw1" / "heal0" / ".modelship"]
    for home in homes:
        home.mkdir(parents=True)
        (home / "stack.json").write_text("{}")
    (tmp_path / "popen-gw1" / "other").mkdir()  # no stack.json: not a stack
    for other in (tmp_path / "elsewhere" / ".modelship",  # not a worker's
                  tmp_path / "popen-gw0" / "test_x0" / "deep" / ".modelship"):  # test data
        other.mkdir(parents=True)
        (other / "stack.json").write_text("{}")
    corrupt = tmp_path / "popen-gw1" / "test_corrupt0" / ".modelship"  # a test's own data
    corrupt.mkdir(parents=True)
    (corrupt / "stack.json").write_text("{not json")
    assert leftover_stack_homes(tmp_path) == sorted(homes)
